//! The WebSocket JSON-RPC and gRPC transports of `gdsllm serve` on the real model, through the
//! standard Python clients (`websockets`, `grpcio`) in scripts/rpc_client_check.py (which
//! pip-installs them into a virtual environment when they are missing; set GDSLLM_RPC_VENV to
//! reuse one): greedy tokens equal REST's, embeddings, cancel, deadlines, auth failures,
//! disconnects that free their sequence, and 200 concurrent streams on each transport.

mod serve_common;

#[test]
fn websocket_and_grpc_python_clients_match_rest() {
    serve_common::run_python_client_check(
        "rpc_client_check.py",
        "GDSLLM_RPC_VENV",
        "all rpc client checks passed",
    );
}
