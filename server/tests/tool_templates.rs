//! Tools against real chat templates (Qwen 2.5's, Qwen3's, Llama 3.1's, DeepSeek-R1's,
//! Phi-3.5's from `GDSLLM_FAMILY_INPUTS/templates`, fetched by
//! `scripts/families/fetch_inputs.py`; Gemma 3's from llama's `tests/chat_templates/`): the
//! tool-call format the server reads off each, and a call and its result rendered back as
//! the server renders them.

use std::path::{Path, PathBuf};

use gdsllm_server::ChatMessage;
use gdsllm_server::tools::{self, ToolCall, ToolFormat};
use llama::{ChatTemplate, ChatValue};
use serde_json::{Value, json};

fn family_templates() -> Option<PathBuf> {
    let inputs = gdsllm_convert::testing::env_path(
        "GDSLLM_FAMILY_INPUTS",
        "run `python3 scripts/families/fetch_inputs.py DIR` and set it to DIR",
    )?;
    Some(inputs.join("templates"))
}

fn template(dir: &Path, name: &str) -> ChatTemplate {
    ChatTemplate::from_file(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn formats_are_read_off_real_templates() {
    let Some(dir) = family_templates() else {
        return;
    };
    for (name, want) in [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", Some(ToolFormat::Hermes)),
        ("Qwen-Qwen3-0.6B.jinja", Some(ToolFormat::Hermes)),
        (
            "meta-llama-Llama-3.1-8B-Instruct.jinja",
            Some(ToolFormat::Llama3Json),
        ),
        // These take no tools: a request with tools gets a 400.
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", None),
        ("microsoft-Phi-3.5-mini-instruct.jinja", None),
    ] {
        assert_eq!(
            ToolFormat::detect(template(&dir, name).source()),
            want,
            "{name}"
        );
    }
    let gemma = Path::new(env!("CARGO_MANIFEST_DIR")).join("../llama/tests/chat_templates");
    assert_eq!(
        ToolFormat::detect(template(&gemma, "google-gemma-3-it.jinja").source()),
        None
    );
}

#[test]
fn a_call_and_its_result_render_back_through_real_templates() {
    let Some(dir) = family_templates() else {
        return;
    };
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let call = ChatMessage {
        tool_calls: vec![ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Paris"}"#.into(),
        }],
        ..ChatMessage::new("assistant", "")
    };
    let result = ChatMessage {
        tool_call_id: Some("call_1".into()),
        ..ChatMessage::new("tool", r#"{"sky": "sunny"}"#)
    };
    let messages = [ChatMessage::new("user", "Weather in Paris?"), call, result];
    let messages: Vec<Value> = messages.iter().map(tools::template_message).collect();
    let render = |name: &str| {
        template(&dir, name)
            .render_conversation(
                &ChatValue::from_serialize(&messages),
                Some(&ChatValue::from_serialize(&vec![weather.clone()])),
                &[("bos_token", "<BOS>"), ("eos_token", "<EOS>")],
                true,
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };

    let qwen = render("Qwen-Qwen2.5-7B-Instruct.jinja");
    for want in [
        r#""name": "get_weather""#,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "<tool_response>\n{\"sky\": \"sunny\"}\n</tool_response>",
    ] {
        assert!(qwen.contains(want), "{want:?} not in\n{qwen}");
    }
    assert!(qwen.ends_with("<|im_start|>assistant\n"), "{qwen}");

    let llama = render("meta-llama-Llama-3.1-8B-Instruct.jinja");
    for want in [
        r#""name": "get_weather""#,
        r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#,
        "<|start_header_id|>ipython<|end_header_id|>\n\n",
    ] {
        assert!(llama.contains(want), "{want:?} not in\n{llama}");
    }
    assert!(llama.contains("sunny"), "{llama}");
}
