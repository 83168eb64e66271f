//! Tool calling as OpenAI clients use it: the request's `tools` and `tool_choice`, the model
//! family's tool-call format, the model's output parsed back into `tool_calls`, and the
//! grammar that forces a call when `tool_choice` is `required` or names a function.
//!
//! Models write tool calls as text in their own format; the format is recognised from the chat
//! template (as llama.cpp's `common/chat.cpp` and vLLM's tool parsers do):
//! - [`ToolFormat::Hermes`] (Hermes 2 Pro, Qwen2.5, and the templates that copy them):
//!   `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call, text before
//!   the first block is content;
//! - [`ToolFormat::Llama3Json`] (Llama 3.1/3.2/3.3's JSON tool calling): the whole reply is
//!   `{"name": …, "parameters": {…}}` (several joined by `;`), optionally after
//!   `<|python_tag|>`.
//!
//! Output that does not parse as calls of its format (malformed JSON, a block without a name)
//! is returned as plain content, never an error: the client sees what the model wrote.
//!
//! Not for: sampling (the grammar goes to the engine as a [`GrammarSpec`]) or the response
//! shapes' other fields (`routes`).

use serde_json::{Map, Value, json};

use crate::engine::{ChatMessage, Engine, GrammarSpec};
use crate::error::ApiError;
use crate::params::{ChatRequest, OutputGrammar};

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{"name": "f", "arguments": {…}}</tool_call>`.
    Hermes,
    /// `{"name": "f", "parameters": {…}}`, the whole reply (optionally after `<|python_tag|>`).
    Llama3Json,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// The format a chat template asks its model for, or `None` when the template takes no
    /// tools (it never reads `tools`) or writes calls in a format this server does not parse.
    pub fn detect(template_source: &str) -> Option<ToolFormat> {
        if !template_source.contains("tools") {
            return None;
        }
        if template_source.contains(HERMES_OPEN) {
            Some(ToolFormat::Hermes)
        } else if template_source.contains(PYTHON_TAG) || template_source.contains("ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }
}

/// One function call, as the model made it or as a client sends it back in an assistant
/// message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (OpenAI sends and expects a string).
    pub arguments: String,
}

impl ToolCall {
    /// The OpenAI `tool_calls[i]` object.
    pub fn to_openai(&self) -> Value {
        json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
    }

    /// The call as chat templates read it: `arguments` as a JSON object when it parses (the
    /// Hugging Face templates write `arguments | tojson`), else the text.
    pub fn to_template(&self) -> Value {
        let arguments = serde_json::from_str::<Value>(&self.arguments)
            .unwrap_or_else(|_| Value::String(self.arguments.clone()));
        json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        })
    }
}

/// A message as Hugging Face chat templates read it: `role`, `content`, and `tool_calls`
/// (arguments as objects) or `tool_call_id` where the message has them.
pub fn template_message(message: &ChatMessage) -> Value {
    let mut m = json!({"role": message.role, "content": message.content});
    if !message.tool_calls.is_empty() {
        m["tool_calls"] = message
            .tool_calls
            .iter()
            .map(ToolCall::to_template)
            .collect();
    }
    if let Some(id) = &message.tool_call_id {
        m["tool_call_id"] = json!(id);
    }
    m
}

/// What the response of a chat with tools needs: the format to parse and whether several
/// calls may be returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyTools {
    pub format: ToolFormat,
    /// `parallel_tool_calls`: false keeps only a reply's first call.
    pub parallel: bool,
}

/// A chat request's prompt text, with its tools offered in the template, and (when tools are
/// offered) how its reply is parsed; a forced `tool_choice` becomes the request's grammar.
/// A model whose template takes no tools answers a request with tools with a 400 naming
/// `tools`.
pub(crate) fn render_chat_prompt(
    engine: &dyn Engine,
    req: &mut ChatRequest,
    messages: &[ChatMessage],
) -> Result<(String, Option<ReplyTools>), ApiError> {
    let Some(tools) = &req.tools else {
        return Ok((engine.render_chat_with_tools(messages, &[])?, None));
    };
    let format = engine.tool_format().ok_or_else(|| {
        ApiError::invalid_param(
            "tools",
            "this model's chat template does not take tools (it has no tool-call format this \
             server knows: Hermes/Qwen `<tool_call>` or Llama 3.1 JSON)",
        )
    })?;
    if let Some(spec) = tools.grammar(format) {
        if let Some(other) = &req.common.grammar {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!(
                    "`tool_choice` forces a tool call, which cannot be combined with `{}`",
                    other.param
                ),
            ));
        }
        req.common.grammar = Some(OutputGrammar {
            spec,
            param: "tool_choice",
        });
    }
    let text = engine.render_chat_with_tools(messages, &tools.tools)?;
    Ok((
        text,
        Some(ReplyTools {
            format,
            parallel: req.parallel_tool_calls,
        }),
    ))
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (OpenAI's default when tools are given).
    Auto,
    /// No call: the tools are not shown to the model and its output is not parsed.
    None,
    /// Some call must be made (forced with a grammar).
    Required,
    /// This function must be called (forced with a grammar).
    Named(String),
}

/// The `tools` and `tool_choice` of a chat request, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolsRequest {
    /// The tool objects as sent (`{"type": "function", "function": {…}}`), for the template.
    pub tools: Vec<Value>,
    pub choice: ToolChoice,
}

/// OpenAI's rule for function names.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A tool's function object (every tool of a [`ToolsRequest`] has one).
fn function_of(tool: &Value) -> Option<&Map<String, Value>> {
    tool.get("function")?.as_object()
}

/// A function object's name.
fn name_of(function: &Map<String, Value>) -> &str {
    function
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

impl ToolsRequest {
    /// Reads `tools` and `tool_choice` from a chat body; `None` when the request offers no
    /// tools or `tool_choice` is `none` (then the request is an ordinary chat).
    pub fn from_body(body: &Map<String, Value>) -> Result<Option<ToolsRequest>, ApiError> {
        let tools = match body.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list.clone(),
            Some(v) => {
                return Err(crate::params::type_error(
                    "tools",
                    "a list of {type: function, function: {name, parameters}} objects",
                    v,
                ));
            }
        };
        for (i, tool) in tools.iter().enumerate() {
            check_tool(i, tool)?;
        }
        let names: Vec<&str> = tools.iter().filter_map(function_of).map(name_of).collect();
        if let Some((i, name)) = names
            .iter()
            .enumerate()
            .find(|(i, n)| names[..*i].contains(n))
        {
            return Err(ApiError::invalid_param(
                format!("tools[{i}].function.name"),
                format!("function {name:?} is offered twice"),
            ));
        }
        let choice = match body.get("tool_choice") {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                other => {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!(
                            "`tool_choice` = {other:?} is not one of auto, none, required or \
                             {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                        ),
                    ));
                }
            },
            Some(Value::Object(o)) => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str);
                match (o.get("type").and_then(Value::as_str), name) {
                    (Some("function"), Some(name)) => ToolChoice::Named(name.to_string()),
                    _ => {
                        return Err(ApiError::invalid_param(
                            "tool_choice",
                            "`tool_choice` as an object must be {\"type\": \"function\", \
                             \"function\": {\"name\": …}}",
                        ));
                    }
                }
            }
            Some(v) => {
                return Err(crate::params::type_error(
                    "tool_choice",
                    "a string or a {type: function, function: {name}} object",
                    v,
                ));
            }
        };
        if let ToolChoice::Named(name) = &choice
            && !names.contains(&name.as_str())
        {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!("`tool_choice` names function {name:?}, which is not in `tools`"),
            ));
        }
        if tools.is_empty() {
            return match choice {
                ToolChoice::Auto | ToolChoice::None => Ok(None),
                _ => Err(ApiError::invalid_param(
                    "tool_choice",
                    "`tool_choice` asks for a tool call, but `tools` offers none",
                )),
            };
        }
        if choice == ToolChoice::None {
            return Ok(None);
        }
        Ok(Some(ToolsRequest { tools, choice }))
    }

    /// The grammar that forces one call (for `required`, of any offered function; for a
    /// named choice, of that one) with arguments valid against the function's `parameters`
    /// schema; `None` for `auto`.
    pub fn grammar(&self, format: ToolFormat) -> Option<GrammarSpec> {
        let forced: Vec<&Map<String, Value>> = match &self.choice {
            ToolChoice::Auto | ToolChoice::None => return None,
            ToolChoice::Required => self.tools.iter().filter_map(function_of).collect(),
            ToolChoice::Named(name) => self
                .tools
                .iter()
                .filter_map(function_of)
                .filter(|f| name_of(f) == name)
                .collect(),
        };
        let mut rules = Vec::new();
        let mut calls = Vec::new();
        for (i, function) in forced.iter().enumerate() {
            let name = name_of(function);
            let mut schema = function
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            // Compact JSON, as structured output writes it: a small model allowed free
            // whitespace can spend its whole budget on newlines.
            if let Value::Object(map) = &mut schema
                && !map.contains_key("x-guidance")
            {
                map.insert(
                    "x-guidance".into(),
                    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
                );
            }
            let (open, close) = match format {
                ToolFormat::Hermes => (
                    format!("{HERMES_OPEN}\n{{\"name\": \"{name}\", \"arguments\": "),
                    format!("}}\n{HERMES_CLOSE}"),
                ),
                ToolFormat::Llama3Json => (
                    format!("{{\"name\": \"{name}\", \"parameters\": "),
                    "}".to_string(),
                ),
            };
            // Lark string literals take JSON's escapes.
            let literal = |s: &str| Value::String(s.to_string()).to_string();
            calls.push(format!("call_{i}"));
            rules.push(format!(
                "call_{i}: {} args_{i} {}",
                literal(&open),
                literal(&close)
            ));
            rules.push(format!("args_{i}: %json {schema}"));
        }
        Some(GrammarSpec::Lark(format!(
            "start: {}\n{}\n",
            calls.join(" | "),
            rules.join("\n")
        )))
    }
}

fn check_tool(i: usize, tool: &Value) -> Result<(), ApiError> {
    let at = format!("tools[{i}]");
    let obj = tool.as_object().ok_or_else(|| {
        crate::params::type_error(&at, "a {type: function, function: {…}} object", tool)
    })?;
    if obj.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid_param(
            format!("{at}.type"),
            format!("`{at}.type` must be \"function\" (the only tool type this server runs)"),
        ));
    }
    let Some(Value::Object(function)) = obj.get("function") else {
        return Err(ApiError::invalid_param(
            format!("{at}.function"),
            format!("`{at}.function` must be a {{name, description, parameters}} object"),
        ));
    };
    match function.get("name") {
        Some(Value::String(name)) if valid_function_name(name) => {}
        _ => {
            return Err(ApiError::invalid_param(
                format!("{at}.function.name"),
                format!(
                    "`{at}.function.name` must be 1 to 64 letters, digits, underscores or dashes"
                ),
            ));
        }
    }
    match function.get("parameters") {
        None | Some(Value::Null) | Some(Value::Object(_)) => Ok(()),
        Some(v) => Err(crate::params::type_error(
            &format!("{at}.function.parameters"),
            "a JSON schema object",
            v,
        )),
    }
}

/// Reads `tool_calls` of an assistant message in a request (`at`: `messages[i]`).
pub fn request_tool_calls(at: &str, value: &Value) -> Result<Vec<ToolCall>, ApiError> {
    let param = format!("{at}.tool_calls");
    let list = value.as_array().ok_or_else(|| {
        crate::params::type_error(&param, "a list of {id, type, function} objects", value)
    })?;
    list.iter()
        .enumerate()
        .map(|(j, call)| {
            let at = format!("{param}[{j}]");
            let string = |v: Option<&Value>, field: &str| match v {
                Some(Value::String(s)) => Ok(s.clone()),
                other => Err(crate::params::type_error(
                    &format!("{at}.{field}"),
                    "a string",
                    other.unwrap_or(&Value::Null),
                )),
            };
            let function = call.get("function");
            Ok(ToolCall {
                id: string(call.get("id"), "id")?,
                name: string(function.and_then(|f| f.get("name")), "function.name")?,
                arguments: string(
                    function.and_then(|f| f.get("arguments")),
                    "function.arguments",
                )?,
            })
        })
        .collect()
}

/// A model's reply split into content and tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedReply {
    /// The text that is not a call; `None` when there is none (only whitespace).
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

/// A call from one JSON object `{"name": …, "arguments"|"parameters": {…}}`; `None` when the
/// text is not such an object.
fn call_from_json(text: &str, new_id: &mut dyn FnMut() -> String) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(text.trim()).ok()?;
    let obj = value.as_object()?;
    let name = obj.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok() => s.clone(),
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall {
        id: new_id(),
        name: name.to_string(),
        arguments,
    })
}

fn content_of(text: &str) -> Option<String> {
    let trimmed = text.trim();
    (!trimmed.is_empty()).then(|| trimmed.to_string())
}

/// Splits a whole reply of `format` into content and calls. What does not parse as a call
/// stays content: a malformed `<tool_call>` block as its text, a Llama 3 reply whose calls do
/// not all parse as the whole reply.
pub fn parse_reply(
    format: ToolFormat,
    text: &str,
    new_id: &mut dyn FnMut() -> String,
) -> ParsedReply {
    match format {
        ToolFormat::Hermes => {
            let mut content = String::new();
            let mut calls = Vec::new();
            let mut rest = text;
            while let Some(start) = rest.find(HERMES_OPEN) {
                content.push_str(&rest[..start]);
                let inner = &rest[start + HERMES_OPEN.len()..];
                let (body, after) = match inner.find(HERMES_CLOSE) {
                    Some(end) => (&inner[..end], &inner[end + HERMES_CLOSE.len()..]),
                    // Cut off by max_tokens or the end of sequence: parse what is there.
                    None => (inner, ""),
                };
                match call_from_json(body, new_id) {
                    Some(call) => calls.push(call),
                    // Malformed: the block stays in the content as the text it is.
                    None => content.push_str(&rest[start..rest.len() - after.len()]),
                }
                rest = after;
            }
            content.push_str(rest);
            ParsedReply {
                content: content_of(&content),
                calls,
            }
        }
        ToolFormat::Llama3Json => {
            let body = text.trim_start();
            let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim();
            let plain = || ParsedReply {
                content: content_of(text),
                calls: Vec::new(),
            };
            if !body.starts_with('{') {
                return plain();
            }
            let mut calls = Vec::new();
            for part in split_top_level(body, ';') {
                match call_from_json(part, new_id) {
                    Some(call) => calls.push(call),
                    None => return plain(),
                }
            }
            ParsedReply {
                content: None,
                calls,
            }
        }
    }
}

/// `text` split at `sep` where it is outside JSON strings and brackets.
fn split_top_level(text: &str, sep: char) -> Vec<&str> {
    let (mut parts, mut depth, mut in_string, mut escaped, mut start) =
        (Vec::new(), 0i32, false, false, 0);
    for (i, c) in text.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            c if c == sep && depth == 0 => {
                parts.push(&text[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

/// One piece of a streamed reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamPiece {
    Content(String),
    /// Call number `index` (0, 1, …), whole.
    Call {
        index: usize,
        call: ToolCall,
    },
}

enum StreamMode {
    /// Hermes: text streams as content; a possible start of `<tool_call>` is held back.
    HermesText,
    /// Hermes: inside a `<tool_call>` block, held until it closes.
    HermesCall,
    /// Llama 3: nothing but whitespace yet, so the reply may still be a call.
    Llama3Undecided,
    /// Llama 3: the reply is a call (or malformed); held whole until the end.
    Llama3Call,
    /// Everything from here on is content.
    Text,
}

/// Splits a reply into content and calls as its text arrives, for streaming: content goes out
/// at once except what may start a call; a call goes out once its text is complete.
/// Concatenated, the pieces say what [`parse_reply`] says of the whole text (up to leading
/// and trailing whitespace of the content).
pub struct ToolStream {
    mode: StreamMode,
    held: String,
    calls: usize,
    /// Whitespace content held until more content follows (none is sent after the last call).
    held_space: String,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> ToolStream {
        ToolStream {
            mode: match format {
                ToolFormat::Hermes => StreamMode::HermesText,
                ToolFormat::Llama3Json => StreamMode::Llama3Undecided,
            },
            held: String::new(),
            calls: 0,
            held_space: String::new(),
        }
    }

    /// Whether any call has been sent (the reply then finishes with `tool_calls`).
    pub fn made_calls(&self) -> bool {
        self.calls > 0
    }

    fn content(&mut self, text: &str, out: &mut Vec<StreamPiece>) {
        if text.is_empty() {
            return;
        }
        if text.trim().is_empty() {
            self.held_space.push_str(text);
            return;
        }
        let mut piece = std::mem::take(&mut self.held_space);
        piece.push_str(text);
        out.push(StreamPiece::Content(piece));
    }

    fn call(&mut self, call: ToolCall, out: &mut Vec<StreamPiece>) {
        self.held_space.clear();
        out.push(StreamPiece::Call {
            index: self.calls,
            call,
        });
        self.calls += 1;
    }

    /// The pieces that `text`, the reply's next text, completes.
    pub fn push(&mut self, text: &str, new_id: &mut dyn FnMut() -> String) -> Vec<StreamPiece> {
        let mut out = Vec::new();
        self.held.push_str(text);
        loop {
            match self.mode {
                StreamMode::Text => {
                    let held = std::mem::take(&mut self.held);
                    self.content(&held, &mut out);
                    return out;
                }
                StreamMode::HermesText => match self.held.find(HERMES_OPEN) {
                    Some(start) => {
                        let before: String = self.held.drain(..start + HERMES_OPEN.len()).collect();
                        self.content(&before[..start], &mut out);
                        self.mode = StreamMode::HermesCall;
                    }
                    None => {
                        // Hold back the longest tail that may begin `<tool_call>`.
                        let keep = (1..HERMES_OPEN.len())
                            .rev()
                            .find(|&n| {
                                self.held.len() >= n
                                    && self.held.is_char_boundary(self.held.len() - n)
                                    && HERMES_OPEN.starts_with(&self.held[self.held.len() - n..])
                            })
                            .unwrap_or(0);
                        let sent: String = self.held.drain(..self.held.len() - keep).collect();
                        self.content(&sent, &mut out);
                        return out;
                    }
                },
                StreamMode::HermesCall => match self.held.find(HERMES_CLOSE) {
                    Some(end) => {
                        let block: String = self.held.drain(..end + HERMES_CLOSE.len()).collect();
                        match call_from_json(&block[..end], new_id) {
                            Some(call) => self.call(call, &mut out),
                            // Malformed: the block goes out as the text it is.
                            None => self.content(&format!("{HERMES_OPEN}{block}"), &mut out),
                        }
                        self.mode = StreamMode::HermesText;
                    }
                    None => return out,
                },
                StreamMode::Llama3Undecided => {
                    let start = self.held.trim_start();
                    if start.is_empty() {
                        return out;
                    }
                    if start.starts_with('{') || start.starts_with(PYTHON_TAG) {
                        self.mode = StreamMode::Llama3Call;
                    } else if PYTHON_TAG.starts_with(start) {
                        return out;
                    } else {
                        self.mode = StreamMode::Text;
                    }
                }
                StreamMode::Llama3Call => return out,
            }
        }
    }

    /// The pieces left when the reply has ended.
    pub fn finish(&mut self, new_id: &mut dyn FnMut() -> String) -> Vec<StreamPiece> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        match self.mode {
            StreamMode::HermesCall => {
                // An unclosed block: a call if its JSON is whole, else text.
                match call_from_json(&held, new_id) {
                    Some(call) => self.call(call, &mut out),
                    None => self.content(&format!("{HERMES_OPEN}{held}"), &mut out),
                }
            }
            StreamMode::Llama3Call => {
                let parsed = parse_reply(ToolFormat::Llama3Json, &held, new_id);
                if parsed.calls.is_empty() {
                    self.content(&held, &mut out);
                }
                for call in parsed.calls {
                    self.call(call, &mut out);
                }
            }
            _ => self.content(&held, &mut out),
        }
        // A reply without calls keeps its trailing whitespace, as the whole reply does.
        if self.calls == 0 && !self.held_space.is_empty() {
            out.push(StreamPiece::Content(std::mem::take(&mut self.held_space)));
        }
        self.mode = StreamMode::Text;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("call_{n}")
        }
    }

    fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    /// Feeds `text` to a [`ToolStream`] in pieces of `step` bytes (at char boundaries) and
    /// joins what comes out: (content, calls).
    fn streamed(format: ToolFormat, text: &str, step: usize) -> (Option<String>, Vec<ToolCall>) {
        let mut stream = ToolStream::new(format);
        let mut new_id = ids();
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = step.min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            pieces.extend(stream.push(&rest[..cut], &mut new_id));
            rest = &rest[cut..];
        }
        pieces.extend(stream.finish(&mut new_id));
        let mut content = String::new();
        let mut calls = Vec::new();
        for piece in pieces {
            match piece {
                StreamPiece::Content(t) => content.push_str(&t),
                StreamPiece::Call { index, call } => {
                    assert_eq!(index, calls.len(), "calls are numbered in order");
                    calls.push(call);
                }
            }
        }
        (content_of(&content), calls)
    }

    /// The whole-reply parse and the streamed one, at several piece sizes, agree on `text`.
    fn parse_both(format: ToolFormat, text: &str) -> ParsedReply {
        let whole = parse_reply(format, text, &mut ids());
        for step in [1, 3, 7, 1000] {
            let (content, calls) = streamed(format, text, step);
            assert_eq!(
                content, whole.content,
                "content of {text:?} in steps of {step}"
            );
            assert_eq!(calls, whole.calls, "calls of {text:?} in steps of {step}");
        }
        whole
    }

    /// The calls of [`parse_both`]'s reply to `text`, which must have no content besides them.
    fn calls_only(format: ToolFormat, text: &str) -> Vec<ToolCall> {
        let reply = parse_both(format, text);
        assert_eq!(reply.content, None, "content of {text:?}");
        reply.calls
    }

    #[test]
    fn formats_are_detected_from_the_template() {
        let hermes = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}\
                      <tool_call>{\"name\": …}</tool_call>{% endif %}";
        assert_eq!(ToolFormat::detect(hermes), Some(ToolFormat::Hermes));
        let llama = "{%- if tools is not none %}{{- '<|start_header_id|>ipython<|end_header_id|>' }}\
                     {{- '<|python_tag|>' }}{% endif %}";
        assert_eq!(ToolFormat::detect(llama), Some(ToolFormat::Llama3Json));
        let plain = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}";
        assert_eq!(ToolFormat::detect(plain), None);
        // Reads tools but writes calls in no format this server parses.
        assert_eq!(
            ToolFormat::detect("{% if tools %}[TOOL_CALLS]{% endif %}"),
            None
        );
    }

    #[test]
    fn hermes_replies_as_qwen_writes_them() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";
        assert_eq!(
            calls_only(ToolFormat::Hermes, text),
            vec![call(
                "call_1",
                "get_weather",
                r#"{"city":"Paris","unit":"celsius"}"#
            )]
        );

        // Content first, two calls, arguments given as a string, one block unclosed at the end.
        let text = "Let me check both.\n<tool_call>\n{\"name\": \"a\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}";
        let r = parse_both(ToolFormat::Hermes, text);
        assert_eq!(r.content.as_deref(), Some("Let me check both."));
        assert_eq!(
            r.calls,
            vec![call("call_1", "a", "{\"x\": 1}"), call("call_2", "b", "{}")]
        );

        // A good call, then a malformed block: the call, and the block as text.
        let text = "<tool_call>{\"name\": \"a\"}</tool_call>\n<tool_call>{oops}</tool_call>";
        let r = parse_both(ToolFormat::Hermes, text);
        assert_eq!(r.content.as_deref(), Some("<tool_call>{oops}</tool_call>"));
        assert_eq!(r.calls, vec![call("call_1", "a", "{}")]);

        // Without calls the streamed text is the reply, whitespace and all.
        let mut stream = ToolStream::new(ToolFormat::Hermes);
        let mut pieces = Vec::new();
        for piece in ["Hello", " ", "world", " \n", " "] {
            pieces.extend(stream.push(piece, &mut ids()));
        }
        pieces.extend(stream.finish(&mut ids()));
        let text: String = pieces
            .iter()
            .map(|p| match p {
                StreamPiece::Content(t) => t.as_str(),
                StreamPiece::Call { .. } => panic!("no call was made"),
            })
            .collect();
        assert_eq!(text, "Hello world \n ");

        // A text that only mentions `<tool` and never calls.
        let r = parse_both(ToolFormat::Hermes, "Use <tool or <tool_ca to mean a tag.");
        assert_eq!(
            r.content.as_deref(),
            Some("Use <tool or <tool_ca to mean a tag.")
        );
        assert!(r.calls.is_empty());
    }

    #[test]
    fn malformed_hermes_blocks_are_plain_content() {
        for text in [
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}\n</tool_call>", // cut JSON
            "<tool_call>not json</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>", // no name
            "<tool_call>{\"name\": \"\"}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
            "<tool_call>{\"name\": 5}</tool_call>",
            "<tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": \"é",
        ] {
            let r = parse_reply(ToolFormat::Hermes, text, &mut ids());
            assert!(r.calls.is_empty(), "{text:?} gave calls {:?}", r.calls);
            assert_eq!(r.content.as_deref(), Some(text.trim()), "{text:?}");
            let (content, calls) = streamed(ToolFormat::Hermes, text, 2);
            assert!(calls.is_empty(), "{text:?} streamed calls {calls:?}");
            assert_eq!(content.as_deref(), Some(text.trim()), "{text:?} streamed");
        }
    }

    #[test]
    fn llama3_json_replies() {
        let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
        assert_eq!(
            calls_only(ToolFormat::Llama3Json, text),
            vec![call("call_1", "get_weather", r#"{"city":"Paris"}"#)]
        );
        let text = "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"s\": \"x;y\"}}; {\"name\": \"b\", \"arguments\": {}}";
        let r = parse_both(ToolFormat::Llama3Json, text);
        assert_eq!(
            r.calls,
            vec![
                call("call_1", "a", r#"{"s":"x;y"}"#),
                call("call_2", "b", "{}")
            ]
        );
        let r = parse_both(ToolFormat::Llama3Json, "  The weather is fine {really}.");
        assert_eq!(r.content.as_deref(), Some("The weather is fine {really}."));
        assert!(r.calls.is_empty());
        for text in [
            "{\"name\": \"a\", \"parameters\": {\"x\": 1}",
            "{\"city\": \"Paris\"}",
            "{\"name\": \"a\"}; nonsense",
            "<|python_tag|>print(1)",
            "<|python",
        ] {
            let r = parse_both(ToolFormat::Llama3Json, text);
            assert!(r.calls.is_empty(), "{text:?} gave calls {:?}", r.calls);
            assert_eq!(r.content.as_deref(), Some(text), "{text:?}");
        }
    }

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}})
    }

    #[test]
    fn tools_and_tool_choice_are_read_and_bad_ones_named() {
        let r = ToolsRequest::from_body(&body(json!({"tools": [weather()]})))
            .unwrap()
            .unwrap();
        assert_eq!(r.choice, ToolChoice::Auto);
        let r = ToolsRequest::from_body(&body(json!({"tools": [weather()],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})))
        .unwrap()
        .unwrap();
        assert_eq!(r.choice, ToolChoice::Named("get_weather".into()));
        for off in [
            json!({"tools": [weather()], "tool_choice": "none"}),
            json!({"tools": []}),
            json!({"tool_choice": "auto"}),
        ] {
            assert_eq!(ToolsRequest::from_body(&body(off)).unwrap(), None);
        }
        for (b, param) in [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [5]}), "tools[0]"),
            (
                json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
                "tools[0].type",
            ),
            (
                json!({"tools": [{"type": "function"}]}),
                "tools[0].function",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [weather(), weather()]}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [weather()], "tool_choice": "always"}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "tool_choice": 1}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
        ] {
            let err = ToolsRequest::from_body(&body(b.clone())).expect_err(&b.to_string());
            assert_eq!(err.param.as_deref(), Some(param), "{b}: {}", err.message);
        }
    }

    #[test]
    fn forced_choices_make_a_grammar_of_the_format() {
        let other = json!({"type": "function", "function": {"name": "noop"}});
        let r = ToolsRequest {
            tools: vec![weather(), other],
            choice: ToolChoice::Required,
        };
        let Some(GrammarSpec::Lark(g)) = r.grammar(ToolFormat::Hermes) else {
            panic!("no grammar");
        };
        assert!(g.starts_with("start: call_0 | call_1\n"), "{g}");
        assert!(
            g.contains(r#"call_0: "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " args_0 "}\n</tool_call>""#),
            "{g}"
        );
        assert!(g.contains(r#"args_1: %json {"type":"object","#), "{g}");
        let named = ToolsRequest {
            choice: ToolChoice::Named("noop".into()),
            ..r.clone()
        };
        let Some(GrammarSpec::Lark(g)) = named.grammar(ToolFormat::Llama3Json) else {
            panic!("no grammar");
        };
        assert!(g.starts_with("start: call_0\n"), "{g}");
        assert!(
            g.contains(r#"call_0: "{\"name\": \"noop\", \"parameters\": " args_0 "}""#),
            "{g}"
        );
        let auto = ToolsRequest {
            choice: ToolChoice::Auto,
            ..r
        };
        assert_eq!(auto.grammar(ToolFormat::Hermes), None);
    }

    #[test]
    fn calls_sent_back_render_their_arguments_as_objects() {
        let c = call("call_9", "f", r#"{"x": [1, 2]}"#);
        assert_eq!(
            c.to_template()["function"]["arguments"],
            json!({"x": [1, 2]})
        );
        assert_eq!(
            c.to_openai()["function"]["arguments"],
            json!(r#"{"x": [1, 2]}"#)
        );
        let bad = call("call_9", "f", "{oops");
        assert_eq!(bad.to_template()["function"]["arguments"], json!("{oops"));
        let err = request_tool_calls(
            "messages[1]",
            &json!([{"id": "c", "function": {"name": "f"}}]),
        )
        .unwrap_err();
        assert_eq!(
            err.param.as_deref(),
            Some("messages[1].tool_calls[0].function.arguments")
        );
    }
}
