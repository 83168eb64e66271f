//! Real chat templates (DeepSeek-R1's, Qwen 2.5's and Qwen3's with tools, Llama 3.1's, Phi-3.5's,
//! Gemma 3's) render system/user/assistant/tool conversations exactly as Hugging Face
//! transformers renders them. The expected texts were made by transformers' own renderer
//! (`scripts/families/chat_template_expected.py`); the templates come from llama.cpp's source
//! (`GDSLLM_FAMILY_INPUTS/templates`, fetched by `scripts/families/fetch_inputs.py`), Gemma 3's
//! from `tests/chat_templates/`.

use std::path::{Path, PathBuf};

use llama::{ChatTemplate, ChatValue};
use serde::Deserialize;

#[derive(Deserialize)]
struct Expected {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    template: String,
    case: String,
    messages: ChatValue,
    tools: Option<ChatValue>,
    add_generation_prompt: bool,
    variables: std::collections::BTreeMap<String, String>,
    expected: String,
}

fn template_path(name: &str, inputs: &Path) -> PathBuf {
    let local = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/chat_templates")
        .join(name);
    if local.is_file() {
        local
    } else {
        inputs.join("templates").join(name)
    }
}

#[test]
fn real_templates_render_as_transformers_renders_them() {
    let Some(inputs) = gdsllm_convert::testing::env_path(
        "GDSLLM_FAMILY_INPUTS",
        "run `python3 scripts/families/fetch_inputs.py DIR` and set it to DIR",
    ) else {
        return;
    };
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chat_templates/expected.json");
    let expected: Expected =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(expected.cases.len() >= 12);
    let mut failures = Vec::new();
    for case in &expected.cases {
        let template = ChatTemplate::from_file(template_path(&case.template, &inputs))
            .unwrap_or_else(|e| panic!("{}: {e}", case.template));
        let variables: Vec<(&str, &str)> = case
            .variables
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let got = template.render_conversation(
            &case.messages,
            case.tools.as_ref(),
            &variables,
            case.add_generation_prompt,
        );
        match got {
            Ok(text) if text == case.expected => println!("{} {}: equal", case.template, case.case),
            Ok(text) => failures.push(format!(
                "{} {}:\n--- ours\n{text}\n--- transformers\n{}\n",
                case.template, case.case, case.expected
            )),
            Err(e) => failures.push(format!("{} {}: {e}", case.template, case.case)),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Gemma 3's template refuses roles that do not alternate, through `raise_exception`.
#[test]
fn raise_exception_is_an_error_naming_the_template() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chat_templates/google-gemma-3-it.jinja");
    let template = ChatTemplate::from_file(&path).unwrap();
    let messages = ChatValue::from_json(
        r#"[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]"#,
    )
    .unwrap();
    let err = template
        .render_conversation(&messages, None, &[("bos_token", "<bos>")], true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("google-gemma-3-it.jinja")
            && err.contains("Conversation roles must alternate"),
        "{err}"
    );
}
