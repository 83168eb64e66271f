//! Request bodies, read field by field from JSON so that every wrong type or value is a 400
//! naming the field (`param` in the error body). OpenAI fields this server does not implement
//! ([`UNSUPPORTED_FIELDS`]) are a 400 naming the field too, rather than an answer that quietly
//! ignores them; fields OpenAI does not define are ignored, as OpenAI-style servers do, so
//! clients that send vendor extensions keep working.

use serde_json::{Map, Value};

use crate::engine::{ChatMessage, GrammarSpec, SamplingParams};
use crate::error::ApiError;
use crate::tools::ToolsRequest;

/// Most alternatives per token a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;
/// `max_tokens` of `/v1/completions` when the request gives none (OpenAI's default).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// OpenAI request fields this server does not implement. A request that sets one (to anything
/// but null, an empty list or object, or the field's own "off" value, see [`is_off`]) gets a
/// 400 naming it. Implementing a field means deleting its line here.
pub const UNSUPPORTED_FIELDS: &[&str] = &[
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
];

/// Fields of chat requests that `/v1/completions` and `/v1/embeddings` refuse like
/// [`UNSUPPORTED_FIELDS`].
pub const CHAT_ONLY_FIELDS: &[&str] = &["tools", "tool_choice", "parallel_tool_calls"];

/// Whether `value` of unsupported field `name` asks for nothing this server would ignore.
fn is_off(name: &str, value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Array(items) => items.is_empty(),
        Value::Object(map) if map.is_empty() => true,
        Value::String(s) if name == "tool_choice" => s == "none",
        // Only means something together with tools, which are refused on their own.
        Value::Bool(_) if name == "parallel_tool_calls" => true,
        _ => false,
    }
}

/// A 400 for the first field of [`UNSUPPORTED_FIELDS`] the body sets.
fn reject_unsupported(f: &Fields<'_>) -> Result<(), ApiError> {
    reject_fields(f, UNSUPPORTED_FIELDS)
}

/// [`reject_unsupported`], and [`CHAT_ONLY_FIELDS`] too (for the endpoints that are not chat).
fn reject_unsupported_or_chat_only(f: &Fields<'_>) -> Result<(), ApiError> {
    reject_fields(f, UNSUPPORTED_FIELDS)?;
    reject_fields(f, CHAT_ONLY_FIELDS)
}

fn reject_fields(f: &Fields<'_>, names: &[&str]) -> Result<(), ApiError> {
    for &name in names {
        if let Some(value) = f.obj.get(name)
            && !is_off(name, value)
        {
            return Err(ApiError {
                code: Some("unsupported_parameter"),
                ..ApiError::invalid_param(
                    name,
                    format!("`{name}` is not supported by this server; remove it from the request"),
                )
            });
        }
    }
    Ok(())
}

/// Typed access to a JSON object's fields; `null` counts as absent.
pub struct Fields<'a> {
    obj: &'a Map<String, Value>,
}

pub(crate) fn type_error(name: &str, expected: &str, found: &Value) -> ApiError {
    let found = match found {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    ApiError::invalid_param(name, format!("`{name}` must be {expected}, not {found}"))
}

impl<'a> Fields<'a> {
    /// The body must be a JSON object.
    pub fn new(body: &'a Value) -> Result<Fields<'a>, ApiError> {
        match body {
            Value::Object(obj) => Ok(Fields { obj }),
            other => Err(ApiError::bad_request(format!(
                "the request body must be a JSON object, not {}",
                match other {
                    Value::Array(_) => "an array",
                    _ => "a scalar",
                }
            ))),
        }
    }

    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    /// The field `name`, which the request must give (not null).
    pub fn required(&self, name: &str) -> Result<&'a Value, ApiError> {
        self.get(name)
            .ok_or_else(|| ApiError::invalid_param(name, format!("`{name}` is required")))
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(type_error(name, "a string", v)),
        }
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(type_error(name, "a boolean", v)),
        }
    }

    /// A number within `[lo, hi]`.
    pub fn number_in(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if !(lo..=hi).contains(&x) {
                    return Err(ApiError::invalid_param(
                        name,
                        format!("`{name}` = {x} is out of range: it must be between {lo} and {hi}"),
                    ));
                }
                Ok(Some(x as f32))
            }
            Some(v) => Err(type_error(name, "a number", v)),
        }
    }

    /// An integer within `[lo, hi]`.
    pub fn integer_in(&self, name: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_i64().ok_or_else(|| {
                    ApiError::invalid_param(name, format!("`{name}` must be an integer, not {n}"))
                })?;
                if !(lo..=hi).contains(&x) {
                    return Err(ApiError::invalid_param(
                        name,
                        format!("`{name}` = {x} is out of range: it must be between {lo} and {hi}"),
                    ));
                }
                Ok(Some(x))
            }
            Some(v) => Err(type_error(name, "an integer", v)),
        }
    }
}

/// Most entries of `logit_bias` (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// A 400 naming `field` when it holds more than `max` `things` (`len` of them).
fn at_most(field: &str, len: usize, max: usize, things: &str) -> Result<(), ApiError> {
    if len > max {
        return Err(ApiError::invalid_param(
            field,
            format!("`{field}` has {len} {things}; at most {max} are allowed"),
        ));
    }
    Ok(())
}

/// `logit_bias`: an object from token ids (as strings, JSON keys) to biases in [-100, 100].
fn logit_bias(f: &Fields<'_>) -> Result<Vec<(u32, f32)>, ApiError> {
    const NAME: &str = "logit_bias";
    let map = match f.get(NAME) {
        None => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(v) => return Err(type_error(NAME, "an object of token id -> bias", v)),
    };
    at_most(NAME, map.len(), MAX_LOGIT_BIAS, "entries")?;
    map.iter()
        .map(|(key, value)| {
            let id: u32 = key.trim().parse().map_err(|_| {
                ApiError::invalid_param(
                    NAME,
                    format!("`{NAME}` key {key:?} is not a token id (a non-negative integer)"),
                )
            })?;
            let bias = value.as_f64().ok_or_else(|| {
                type_error(&format!("{NAME}.{key}"), "a number", value)
            })?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(ApiError::invalid_param(
                    NAME,
                    format!("`{NAME}` of token {id} = {bias} is out of range: it must be between -100 and 100"),
                ));
            }
            Ok((id, bias as f32))
        })
        .collect()
}

/// A grammar a request's output must follow, and the request field that set it (named by the
/// 400 when it does not compile).
#[derive(Debug, Clone, PartialEq)]
pub struct OutputGrammar {
    pub spec: GrammarSpec,
    pub param: &'static str,
}

/// `response_format` (OpenAI: `text`, `json_object`, `json_schema`) and llama-server's
/// `grammar` (here in llguidance's Lark syntax), at most one of them.
fn output_grammar(f: &Fields<'_>) -> Result<Option<OutputGrammar>, ApiError> {
    let format = match f.get("response_format") {
        None => None,
        Some(Value::Object(map)) => {
            let kind = match map.get("type") {
                Some(Value::String(t)) => t.as_str(),
                Some(v) => return Err(type_error("response_format.type", "a string", v)),
                None => {
                    return Err(ApiError::invalid_param(
                        "response_format.type",
                        "`response_format.type` is required",
                    ));
                }
            };
            match kind {
                "text" => None,
                "json_object" => Some(GrammarSpec::JsonObject),
                "json_schema" => {
                    let schema = match map.get("json_schema") {
                        Some(Value::Object(js)) => js.get("schema"),
                        Some(v) => {
                            return Err(type_error("response_format.json_schema", "an object", v));
                        }
                        None => None,
                    };
                    match schema {
                        Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                            Some(GrammarSpec::JsonSchema(schema.clone()))
                        }
                        Some(v) => {
                            return Err(type_error(
                                "response_format.json_schema.schema",
                                "a JSON schema object",
                                v,
                            ));
                        }
                        None => {
                            return Err(ApiError::invalid_param(
                                "response_format.json_schema.schema",
                                "`response_format.json_schema.schema` is required with type json_schema",
                            ));
                        }
                    }
                }
                other => {
                    return Err(ApiError::invalid_param(
                        "response_format.type",
                        format!(
                            "`response_format.type` = {other:?} is not one of text, json_object, json_schema"
                        ),
                    ));
                }
            }
        }
        Some(v) => return Err(type_error("response_format", "an object", v)),
    };
    let grammar = f
        .string("grammar")?
        .map(|g| GrammarSpec::Lark(g.to_string()));
    match (format, grammar) {
        (Some(_), Some(_)) => Err(ApiError::invalid_param(
            "grammar",
            "`grammar` and a JSON `response_format` cannot be used together",
        )),
        (Some(spec), None) => Ok(Some(OutputGrammar {
            spec,
            param: "response_format",
        })),
        (None, Some(spec)) => Ok(Some(OutputGrammar {
            spec,
            param: "grammar",
        })),
        (None, None) => Ok(None),
    }
}

/// Parameters shared by chat and text completions.
#[derive(Debug, Clone, PartialEq)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub grammar: Option<OutputGrammar>,
}

fn common(f: &Fields<'_>) -> Result<CommonParams, ApiError> {
    let model = f.string("model")?.map(str::to_string);
    if let Some(n) = f.integer_in("n", i64::MIN, i64::MAX)?
        && n != 1
    {
        return Err(ApiError::invalid_param(
            "n",
            format!(
                "`n` = {n} is not supported: this server generates exactly one choice per request (n = 1)"
            ),
        ));
    }
    let max_completion = f.integer_in("max_completion_tokens", 1, i64::MAX)?;
    let max_tokens = f.integer_in("max_tokens", 1, i64::MAX)?;
    let max_tokens = max_completion.or(max_tokens).map(|n| n as usize);
    let temperature = f.number_in("temperature", 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = f.number_in("top_p", 0.0, 1.0)?.unwrap_or(1.0);
    if top_p == 0.0 {
        return Err(ApiError::invalid_param(
            "top_p",
            "`top_p` = 0 keeps no token: it must be above 0 and at most 1",
        ));
    }
    let top_k = f.integer_in("top_k", 0, i64::from(u32::MAX))?.unwrap_or(0) as usize;
    let min_p = f.number_in("min_p", 0.0, 1.0)?.unwrap_or(0.0);
    let seed = f.integer_in("seed", i64::MIN, i64::MAX)?.map(|s| s as u64);
    let presence_penalty = f.number_in("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    let frequency_penalty = f.number_in("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            at_most("stop", items.len(), MAX_STOP_STRINGS, "strings")?;
            items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(type_error("stop", "a string or a list of strings", other)),
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => return Err(type_error("stop", "a string or a list of strings", v)),
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid_param(
            "stop",
            "`stop` strings must not be empty",
        ));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields { obj: o }
            .bool("include_usage")
            .map_err(|_| {
                ApiError::invalid_param(
                    "stream_options.include_usage",
                    "`stream_options.include_usage` must be a boolean",
                )
            })?
            .unwrap_or(false),
        Some(v) => return Err(type_error("stream_options", "an object", v)),
    };
    Ok(CommonParams {
        model,
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            presence_penalty,
            frequency_penalty,
            logit_bias: logit_bias(f)?,
        },
        stop,
        stream,
        include_usage,
        grammar: output_grammar(f)?,
    })
}

/// A `/v1/chat/completions` body.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub common: CommonParams,
    pub messages: Vec<ChatMessage>,
    /// `Some(k)` when `logprobs` is true (`k` = `top_logprobs`, default 0).
    pub logprobs: Option<usize>,
    /// The functions offered and `tool_choice`; `None` for a chat without tools (or with
    /// `tool_choice: "none"`).
    pub tools: Option<ToolsRequest>,
    /// `parallel_tool_calls` (default true); false keeps only the first call of a reply.
    pub parallel_tool_calls: bool,
}

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

pub fn chat_request(body: &Value) -> Result<ChatRequest, ApiError> {
    let f = Fields::new(body)?;
    reject_unsupported(&f)?;
    let common = common(&f)?;
    let list = match f.get("messages") {
        None => {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` is required: a non-empty list of {role, content} objects",
            ));
        }
        Some(Value::Array(list)) => list,
        Some(v) => {
            return Err(type_error(
                "messages",
                "a list of {role, content} objects",
                v,
            ));
        }
    };
    if list.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` must not be empty",
        ));
    }
    let messages = list
        .iter()
        .enumerate()
        .map(|(i, m)| chat_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top = f.integer_in("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
    if top.is_some() && !logprobs {
        return Err(ApiError::invalid_param(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        ));
    }
    Ok(ChatRequest {
        common,
        messages,
        logprobs: logprobs.then_some(top.unwrap_or(0) as usize),
        tools: ToolsRequest::from_body(f.obj)?,
        parallel_tool_calls: f.bool("parallel_tool_calls")?.unwrap_or(true),
    })
}

fn chat_message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let at = format!("messages[{i}]");
    let obj = match m {
        Value::Object(o) => Fields { obj: o },
        v => return Err(type_error(&at, "a {role, content} object", v)),
    };
    let role_param = format!("{at}.role");
    let role = match obj.get("role") {
        Some(Value::String(r)) => r.as_str(),
        Some(v) => return Err(type_error(&role_param, "a string", v)),
        None => {
            return Err(ApiError::invalid_param(
                &role_param,
                format!("`{role_param}` is required"),
            ));
        }
    };
    if !ROLES.contains(&role) {
        return Err(ApiError::invalid_param(
            &role_param,
            format!(
                "`{role_param}` = {role:?} is not one of {}",
                ROLES.join(", ")
            ),
        ));
    }
    let tool_calls = match obj.get("tool_calls") {
        Some(calls) if role == "assistant" => crate::tools::request_tool_calls(&at, calls)?,
        Some(_) => {
            return Err(ApiError::invalid_param(
                format!("{at}.tool_calls"),
                format!("`{at}.tool_calls` belongs to assistant messages only"),
            ));
        }
        None => Vec::new(),
    };
    let id_param = format!("{at}.tool_call_id");
    let tool_call_id = match obj.get("tool_call_id") {
        Some(Value::String(id)) if role == "tool" => Some(id.clone()),
        Some(v) if role == "tool" => return Err(type_error(&id_param, "a string", v)),
        // Only tool messages answer a call.
        Some(_) => None,
        None if role == "tool" => {
            return Err(ApiError::invalid_param(
                &id_param,
                format!("`{id_param}` is required: the id of the call this answers"),
            ));
        }
        None => None,
    };
    let content_param = format!("{at}.content");
    let content = match obj.get("content") {
        None if role == "assistant" => String::new(),
        None => {
            return Err(ApiError::invalid_param(
                &content_param,
                format!("`{content_param}` is required"),
            ));
        }
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let part_param = format!("{content_param}[{j}]");
                let Value::Object(p) = part else {
                    return Err(type_error(&part_param, "a {type, text} object", part));
                };
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => match p.get("text") {
                        Some(Value::String(t)) => text.push_str(t),
                        other => {
                            return Err(type_error(
                                &format!("{part_param}.text"),
                                "a string",
                                other.unwrap_or(&Value::Null),
                            ));
                        }
                    },
                    other => {
                        return Err(ApiError::invalid_param(
                            format!("{part_param}.type"),
                            format!(
                                "content part type {} is not supported: this model reads text only",
                                other
                                    .map(|t| format!("{t:?}"))
                                    .unwrap_or_else(|| "(missing)".into())
                            ),
                        ));
                    }
                }
            }
            text
        }
        Some(v) => {
            return Err(type_error(
                &content_param,
                "a string or a list of text parts",
                v,
            ));
        }
    };
    // Templates know system, user and assistant; `developer` is OpenAI's newer name for system.
    let role = if role == "developer" { "system" } else { role };
    Ok(ChatMessage {
        role: role.to_string(),
        content,
        tool_calls,
        tool_call_id,
    })
}

/// A prompt as text or as token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// One prompt (or embeddings input) item: a string or a list of token ids.
fn prompt_item(param: &str, v: &Value) -> Result<Option<PromptInput>, ApiError> {
    match v {
        Value::String(s) => Ok(Some(PromptInput::Text(s.clone()))),
        Value::Array(items) if items.iter().all(Value::is_number) && !items.is_empty() => {
            let ids = items
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| {
                            ApiError::invalid_param(
                                param,
                                format!("token id {t} is not a valid id"),
                            )
                        })
                })
                .collect::<Result<_, _>>()?;
            Ok(Some(PromptInput::Tokens(ids)))
        }
        _ => Ok(None),
    }
}

/// Inputs given as a string, a list of strings, a list of token ids or a list of those lists.
pub fn prompt_list(param: &str, v: &Value) -> Result<Vec<PromptInput>, ApiError> {
    let expected = "a string, a list of strings, a list of token ids or a list of token-id lists";
    if let Some(one) = prompt_item(param, v)? {
        return Ok(vec![one]);
    }
    match v {
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|item| prompt_item(param, item)?.ok_or_else(|| type_error(param, expected, item)))
            .collect(),
        Value::Array(_) => Err(ApiError::invalid_param(
            param,
            format!("`{param}` must not be empty"),
        )),
        other => Err(type_error(param, expected, other)),
    }
}

/// A `/v1/completions` body.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub common: CommonParams,
    pub prompt: PromptInput,
    /// `logprobs` = k: the chosen token's log-probability and the k most likely alternatives.
    pub logprobs: Option<usize>,
}

pub fn completion_request(body: &Value) -> Result<CompletionRequest, ApiError> {
    let f = Fields::new(body)?;
    reject_unsupported_or_chat_only(&f)?;
    let common = common(&f)?;
    let mut prompts = prompt_list("prompt", f.required("prompt")?)?;
    if prompts.len() != 1 {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "`prompt` holds {} prompts; this server completes one prompt per request",
                prompts.len()
            ),
        ));
    }
    let prompt = prompts.remove(0);
    if let Some(best_of) = f.integer_in("best_of", i64::MIN, i64::MAX)?
        && best_of != 1
    {
        return Err(ApiError::invalid_param(
            "best_of",
            format!("`best_of` = {best_of} is not supported (only 1)"),
        ));
    }
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::invalid_param(
            "echo",
            "`echo: true` is not supported",
        ));
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param(
            "suffix",
            "`suffix` is not supported",
        ));
    }
    let logprobs = f
        .integer_in("logprobs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|k| k as usize);
    Ok(CompletionRequest {
        common,
        prompt,
        logprobs,
    })
}

/// A `/v1/embeddings` body.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingsRequest {
    pub model: Option<String>,
    pub inputs: Vec<PromptInput>,
    pub base64: bool,
}

/// Most inputs in one embeddings request.
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

pub fn embeddings_request(body: &Value) -> Result<EmbeddingsRequest, ApiError> {
    let f = Fields::new(body)?;
    reject_unsupported_or_chat_only(&f)?;
    let model = f.string("model")?.map(str::to_string);
    let inputs = prompt_list("input", f.required("input")?)?;
    at_most("input", inputs.len(), MAX_EMBEDDING_INPUTS, "items")?;
    let base64 = match f.string("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid_param(
                "encoding_format",
                format!("`encoding_format` = {other:?} is not one of float, base64"),
            ));
        }
    };
    if f.get("dimensions").is_some() {
        return Err(ApiError::invalid_param(
            "dimensions",
            "`dimensions` is not supported: embeddings have the model's hidden size",
        ));
    }
    Ok(EmbeddingsRequest {
        model,
        inputs,
        base64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A one-message chat request with the fields of `extra` added.
    fn chat(extra: Value) -> Result<ChatRequest, ApiError> {
        let mut body = json!({"messages": [{"role": "user", "content": "x"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        chat_request(&body)
    }

    #[test]
    fn unsupported_fields_are_refused_by_name_and_their_off_values_accepted() {
        for (field, value) in [
            (
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            ),
            ("tool_choice", json!("auto")),
            ("functions", json!([{"name": "f"}])),
            ("reasoning_effort", json!("high")),
        ] {
            if CHAT_ONLY_FIELDS.contains(&field) {
                chat(json!({ field: value.clone() }))
                    .unwrap_or_else(|e| panic!("{field}: {}", e.message));
            } else {
                let err = chat(json!({ field: value })).unwrap_err();
                assert_eq!(err.param.as_deref(), Some(field), "{}", err.message);
                assert!(err.message.contains(field), "{}", err.message);
            }
            let body = json!({"prompt": "x", field: value});
            assert_eq!(
                completion_request(&body).unwrap_err().param.as_deref(),
                Some(field)
            );
            let body = json!({"input": "x", field: value});
            assert_eq!(
                embeddings_request(&body).unwrap_err().param.as_deref(),
                Some(field)
            );
        }
        for (field, value) in [
            ("tools", json!([])),
            ("tool_choice", json!("none")),
            ("response_format", json!({"type": "text"})),
            ("parallel_tool_calls", json!(false)),
            ("user", json!("someone")),
            ("x_vendor_extension", json!(1)),
        ] {
            chat(json!({ field: value })).unwrap_or_else(|e| panic!("{field}: {}", e.message));
        }
    }

    #[test]
    fn every_bad_value_names_its_field() {
        let cases = [
            (
                json!({"messages": [{"role":"user","content":"x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"messages": [{"role":"user","content":"x"}], "temperature": 3}),
                "temperature",
            ),
            (
                json!({"messages": [{"role":"user","content":"x"}], "top_p": 0}),
                "top_p",
            ),
            (
                json!({"messages": [{"role":"user","content":"x"}], "top_k": 1.5}),
                "top_k",
            ),
            (
                json!({"messages": [{"role":"user","content":"x"}], "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"messages": [{"role":"user","content":"x"}], "n": 2}),
                "n",
            ),
            (
                json!({"messages": [{"role":"user","content":"x"}], "stop": [1]}),
                "stop",
            ),
            (
                json!({"messages": [{"role":"user","content":"x"}], "top_logprobs": 2}),
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role":"user","content":"x"}], "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role":"wizard","content":"x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role":"user"}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role":"user","content":[{"type":"image_url"}]}]}),
                "messages[0].content[0].type",
            ),
            (json!({"messages": []}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (
                json!({"messages": [{"role":"user","content":"x"}], "stream_options": {"include_usage": 1}}),
                "stream_options.include_usage",
            ),
        ];
        for (body, param) in cases {
            let err = chat_request(&body).expect_err(&body.to_string());
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
            assert_eq!(err.status, 400);
        }
    }

    #[test]
    fn logit_bias_and_output_grammars_are_read_and_bad_ones_named() {
        let r = chat(json!({"logit_bias": {"50": -100, " 7": 2.5}})).unwrap();
        let mut bias = r.common.sampling.logit_bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, vec![(7, 2.5), (50, -100.0)]);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let r = chat(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}}}))
        .unwrap();
        assert_eq!(
            r.common.grammar,
            Some(OutputGrammar {
                spec: GrammarSpec::JsonSchema(schema),
                param: "response_format"
            })
        );
        let r = chat(json!({"response_format": {"type": "json_object"}})).unwrap();
        assert_eq!(r.common.grammar.unwrap().spec, GrammarSpec::JsonObject);
        let r = completion_request(&json!({"prompt": "x", "grammar": "start: \"a\""})).unwrap();
        assert_eq!(
            r.common.grammar,
            Some(OutputGrammar {
                spec: GrammarSpec::Lark("start: \"a\"".into()),
                param: "grammar"
            })
        );
        assert_eq!(
            chat(json!({"response_format": {"type": "text"}}))
                .unwrap()
                .common
                .grammar,
            None
        );
        for (extra, param) in [
            (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
            (json!({"logit_bias": {"-3": 1}}), "logit_bias"),
            (json!({"logit_bias": {"3": 101}}), "logit_bias"),
            (json!({"logit_bias": {"3": -100.5}}), "logit_bias"),
            (json!({"logit_bias": {"3": "x"}}), "logit_bias.3"),
            (json!({"logit_bias": [1]}), "logit_bias"),
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format.type",
            ),
            (json!({"response_format": {}}), "response_format.type"),
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"grammar": 3}), "grammar"),
            (
                json!({"grammar": "start: \"a\"", "response_format": {"type": "json_object"}}),
                "grammar",
            ),
        ] {
            let err = chat(extra.clone()).expect_err(&extra.to_string());
            assert_eq!(
                err.param.as_deref(),
                Some(param),
                "{extra}: {}",
                err.message
            );
        }
    }

    #[test]
    fn chat_defaults_and_content_parts() {
        let r = chat_request(&json!({
            "model": "m",
            "messages": [{"role":"developer","content":"sys"},
                         {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
            "max_completion_tokens": 5, "max_tokens": 9, "stop": "x", "seed": -1,
            "logprobs": true, "top_logprobs": 3
        }))
        .unwrap();
        assert_eq!(r.messages[0].role, "system");
        assert_eq!(r.messages[1].content, "ab");
        assert_eq!(r.common.max_tokens, Some(5));
        assert_eq!(r.common.stop, vec!["x".to_string()]);
        assert_eq!(r.common.sampling.seed, Some(u64::MAX));
        assert_eq!(r.logprobs, Some(3));
        assert_eq!(r.common.sampling.temperature, 1.0);
    }

    #[test]
    fn tool_calls_and_tool_results_are_read_and_bad_ones_named() {
        let r = chat_request(&json!({
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                    "type": "function", "function": {"name": "w", "arguments": "{\"c\": 1}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
            ],
            "tools": [{"type": "function", "function": {"name": "w"}}],
            "parallel_tool_calls": false
        }))
        .unwrap();
        assert_eq!(r.messages[1].content, "");
        assert_eq!(r.messages[1].tool_calls[0].name, "w");
        assert_eq!(r.messages[1].tool_calls[0].arguments, "{\"c\": 1}");
        assert_eq!(r.messages[2].tool_call_id.as_deref(), Some("call_1"));
        assert!(r.tools.is_some() && !r.parallel_tool_calls);
        for (messages, param) in [
            (
                json!([{"role": "tool", "content": "sunny"}]),
                "messages[0].tool_call_id",
            ),
            (
                json!([{"role": "tool", "content": "sunny", "tool_call_id": 7}]),
                "messages[0].tool_call_id",
            ),
            (
                json!([{"role": "user", "content": "x", "tool_calls": []}]),
                "messages[0].tool_calls",
            ),
            (
                json!([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]),
                "messages[0].tool_calls[0].function.arguments",
            ),
        ] {
            let err = chat_request(&json!({ "messages": messages })).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{}", err.message);
        }
    }

    #[test]
    fn completion_prompts() {
        let r = completion_request(&json!({"prompt": [1, 2, 3]})).unwrap();
        assert_eq!(r.prompt, PromptInput::Tokens(vec![1, 2, 3]));
        let r = completion_request(&json!({"prompt": ["one"]})).unwrap();
        assert_eq!(r.prompt, PromptInput::Text("one".into()));
        let err = completion_request(&json!({"prompt": ["a", "b"]})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("prompt"));
        let err = completion_request(&json!({"prompt": [1, -2]})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("prompt"));
        let err = completion_request(&json!({"prompt": "x", "echo": true})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("echo"));
    }

    #[test]
    fn lists_over_their_limit_are_refused_by_name() {
        let strings = |n: usize| Value::from_iter((0..n).map(|i| i.to_string()));
        let bias = |n: usize| Value::Object((0..n).map(|i| (i.to_string(), json!(1))).collect());
        for (err, message) in [
            (
                chat(json!({"stop": strings(MAX_STOP_STRINGS + 1)})).unwrap_err(),
                "`stop` has 17 strings; at most 16 are allowed",
            ),
            (
                chat(json!({"logit_bias": bias(MAX_LOGIT_BIAS + 1)})).unwrap_err(),
                "`logit_bias` has 301 entries; at most 300 are allowed",
            ),
            (
                embeddings_request(&json!({"input": strings(MAX_EMBEDDING_INPUTS + 1)}))
                    .unwrap_err(),
                "`input` has 2049 items; at most 2048 are allowed",
            ),
        ] {
            assert_eq!(err.message, message);
        }
        chat(json!({"stop": strings(MAX_STOP_STRINGS), "logit_bias": bias(MAX_LOGIT_BIAS)}))
            .unwrap();
        embeddings_request(&json!({"input": strings(MAX_EMBEDDING_INPUTS)})).unwrap();
    }

    #[test]
    fn embeddings_inputs() {
        let r = embeddings_request(&json!({"input": ["a", [5, 6]], "encoding_format": "base64"}))
            .unwrap();
        assert_eq!(
            r.inputs,
            vec![
                PromptInput::Text("a".into()),
                PromptInput::Tokens(vec![5, 6])
            ]
        );
        assert!(r.base64);
        let err = embeddings_request(&json!({"input": "a", "encoding_format": "hex"})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("encoding_format"));
        let err = embeddings_request(&json!({"input": {}})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input"));
    }
}
