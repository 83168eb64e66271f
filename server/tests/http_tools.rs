//! Tool calling over HTTP against an engine that writes a scripted reply: the OpenAI shapes of
//! parsed calls (whole and streamed), forced choices reaching the engine as a grammar, and
//! calls and tool results reaching the chat template.

mod common;

use std::ops::ControlFlow;
use std::sync::Arc;

use common::{TestServer, sse_data};
use gdsllm_server::tools::ToolFormat;
use gdsllm_server::{
    CancelToken, ChatMessage, Engine, EngineError, EngineFinish, GeneratedToken, GenerationRequest,
    GrammarSpec, ServerConfig,
};
use parking_lot::Mutex;
use serde_json::{Value, json};

/// Writes `reply` (a few characters per token) whatever the prompt; records what it renders
/// and what it is asked to generate.
struct ScriptedEngine {
    format: ToolFormat,
    reply: Mutex<String>,
    rendered: Mutex<Vec<(Vec<ChatMessage>, Vec<Value>)>>,
    requests: Mutex<Vec<GenerationRequest>>,
}

impl ScriptedEngine {
    fn new(format: ToolFormat) -> ScriptedEngine {
        ScriptedEngine {
            format,
            reply: Mutex::new(String::new()),
            rendered: Mutex::new(Vec::new()),
            requests: Mutex::new(Vec::new()),
        }
    }
}

impl Engine for ScriptedEngine {
    fn model_id(&self) -> &str {
        "scripted"
    }

    fn context_length(&self) -> usize {
        8192
    }

    fn vocab_size(&self) -> usize {
        1000
    }

    fn check_grammar(&self, _grammar: &GrammarSpec) -> Result<(), EngineError> {
        Ok(())
    }

    fn tokenize(&self, text: &str, _add_bos: bool) -> Result<Vec<u32>, EngineError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        self.render_chat_with_tools(messages, &[])
    }

    fn tool_format(&self) -> Option<ToolFormat> {
        Some(self.format)
    }

    fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
    ) -> Result<String, EngineError> {
        self.rendered
            .lock()
            .push((messages.to_vec(), tools.to_vec()));
        Ok(messages.iter().map(|m| m.content.as_str()).collect())
    }

    fn generate(
        &self,
        request: &GenerationRequest,
        cancel: &CancelToken,
        on_token: &mut dyn FnMut(GeneratedToken) -> ControlFlow<()>,
    ) -> Result<EngineFinish, EngineError> {
        self.requests.lock().push(request.clone());
        let reply: Vec<char> = self.reply.lock().chars().collect();
        for (i, piece) in reply.chunks(3).enumerate() {
            if cancel.is_cancelled() {
                return Ok(EngineFinish::Stopped);
            }
            let token = GeneratedToken {
                id: 100 + i as u32,
                text: piece.iter().collect(),
                logprob: None,
                top_logprobs: Vec::new(),
            };
            if on_token(token).is_break() {
                return Ok(EngineFinish::Stopped);
            }
        }
        Ok(EngineFinish::EndOfSequence)
    }

    fn embed(&self, _tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        Err(EngineError::InvalidInput("no embeddings".into()))
    }
}

async fn start(format: ToolFormat) -> (TestServer, Arc<ScriptedEngine>) {
    let engine = Arc::new(ScriptedEngine::new(format));
    let ts = TestServer::start_loading(ServerConfig::default()).await;
    ts.server.set_engine(engine.clone());
    (ts, engine)
}

async fn post(ts: &TestServer, body: &Value) -> (u16, String) {
    let r = reqwest::Client::new()
        .post(ts.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
}

fn request(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "weather in Paris?"}],
                          "tools": [weather()]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

const CALL_REPLY: &str = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_with_a_call_becomes_tool_calls_whole_and_streamed() {
    let (ts, engine) = start(ToolFormat::Hermes).await;
    *engine.reply.lock() = CALL_REPLY.into();

    let (status, body) = post(&ts, &request(json!({}))).await;
    assert_eq!(status, 200, "{body}");
    let body: Value = serde_json::from_str(&body).unwrap();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    assert_eq!(choice["message"]["content"], "Checking.");
    let call = &choice["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call"), "{call}");
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], r#"{"city":"Paris"}"#);
    // The tools reached the template.
    assert_eq!(engine.rendered.lock()[0].1, vec![weather()]);

    let (status, body) = post(&ts, &request(json!({"stream": true}))).await;
    assert_eq!(status, 200, "{body}");
    let events = sse_data(&body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert_eq!(deltas[0]["role"], "assistant");
    let content: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    assert_eq!(content.trim(), "Checking.");
    let calls: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).collect();
    // First the call's index, id, type and name with empty arguments, then the arguments.
    assert_eq!(calls.len(), 2, "{body}");
    let opening = &calls[0][0];
    assert_eq!(opening["index"], 0);
    assert!(opening["id"].as_str().unwrap().starts_with("call"));
    assert_eq!(opening["type"], "function");
    assert_eq!(opening["function"]["name"], "get_weather");
    assert_eq!(opening["function"]["arguments"], "");
    assert_eq!(calls[1][0]["index"], 0);
    assert_eq!(calls[1][0]["function"]["arguments"], r#"{"city":"Paris"}"#);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    // The tag never leaks into the streamed content.
    assert!(!body.contains("Checking.\\n<tool"), "{body}");
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_calls_are_content_and_parallel_false_keeps_the_first_call() {
    let (ts, engine) = start(ToolFormat::Hermes).await;
    let malformed = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>";
    *engine.reply.lock() = malformed.into();
    for stream in [false, true] {
        let (status, body) = post(&ts, &request(json!({"stream": stream}))).await;
        assert_eq!(status, 200, "{body}");
        if stream {
            let text: String = sse_data(&body)
                .iter()
                .filter(|e| *e != "[DONE]")
                .filter_map(|e| {
                    let v: Value = serde_json::from_str(e).unwrap();
                    v["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(str::to_string)
                })
                .collect();
            assert_eq!(text, malformed);
            assert!(body.contains(r#""finish_reason":"stop""#), "{body}");
        } else {
            let body: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(body["choices"][0]["message"]["content"], malformed);
            assert_eq!(body["choices"][0]["finish_reason"], "stop");
            assert!(body["choices"][0]["message"].get("tool_calls").is_none());
        }
    }

    *engine.reply.lock() = format!("{CALL_REPLY}\n{CALL_REPLY}");
    let calls = async |extra: Value| {
        let (_, body) = post(&ts, &request(extra)).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        body["choices"][0]["message"]["tool_calls"]
            .as_array()
            .map_or(0, Vec::len)
    };
    assert_eq!(calls(json!({})).await, 2);
    assert_eq!(calls(json!({"parallel_tool_calls": false})).await, 1);
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_choices_reach_the_engine_as_a_grammar() {
    let (ts, engine) = start(ToolFormat::Llama3Json).await;
    *engine.reply.lock() =
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}".into();
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let (status, body) = post(&ts, &request(named)).await;
    assert_eq!(status, 200, "{body}");
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        r#"{"city":"Oslo"}"#
    );
    let Some(GrammarSpec::Lark(grammar)) = engine.requests.lock()[0].grammar.clone() else {
        panic!("no grammar reached the engine");
    };
    assert!(
        grammar.contains(r#"\"name\": \"get_weather\", \"parameters\": "#),
        "{grammar}"
    );
    assert!(grammar.contains("%json"), "{grammar}");

    // `auto` constrains nothing.
    post(&ts, &request(json!({"tool_choice": "auto"}))).await;
    assert_eq!(engine.requests.lock()[1].grammar, None);

    for extra in [
        json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
        json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ] {
        let (status, body) = post(&ts, &request(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {body}");
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["error"]["param"], "tool_choice", "{body}");
    }
    ts.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_and_tool_results_sent_back_reach_the_template() {
    let (ts, engine) = start(ToolFormat::Hermes).await;
    *engine.reply.lock() = "It is sunny in Paris.".into();
    let body = json!({
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_7", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "{\"sky\": \"sunny\"}"}
        ],
        "tools": [weather()]
    });
    let (status, reply) = post(&ts, &body).await;
    assert_eq!(status, 200, "{reply}");
    let reply: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        "It is sunny in Paris."
    );
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    let (messages, tools) = engine.rendered.lock()[0].clone();
    assert_eq!(tools, vec![weather()]);
    assert_eq!(messages[1].tool_calls[0].id, "call_7");
    assert_eq!(messages[1].tool_calls[0].name, "get_weather");
    assert_eq!(messages[2].role, "tool");
    assert_eq!(messages[2].tool_call_id.as_deref(), Some("call_7"));
    ts.shutdown().await;
}
