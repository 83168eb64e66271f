//! The official `openai` Python package against `gdsllm serve` on the real model, through
//! scripts/openai_client_check.py, scripts/openai_tools_check.py and
//! scripts/openai_models_check.py (two models in one server) (which pip-install `openai`
//! into a virtual environment when it is missing; set GDSLLM_OPENAI_VENV to reuse one).

mod serve_common;

#[test]
fn official_openai_python_client_works_unchanged() {
    serve_common::run_python_client_check(
        "openai_client_check.py",
        "GDSLLM_OPENAI_VENV",
        "all openai client checks passed",
    );
}

#[test]
fn official_openai_python_client_calls_tools() {
    serve_common::run_python_client_check(
        "openai_tools_check.py",
        "GDSLLM_OPENAI_VENV",
        "all openai tool checks passed",
    );
}

#[test]
fn official_openai_python_client_talks_to_two_models() {
    serve_common::run_python_client_check(
        "openai_models_check.py",
        "GDSLLM_OPENAI_VENV",
        "all openai two-model checks passed",
    );
}
