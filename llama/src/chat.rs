//! Chat templates: the model's Jinja template rendered with minijinja the way Hugging Face
//! transformers renders it (`apply_chat_template`): blocks trimmed (`trim_blocks`,
//! `lstrip_blocks`), the Python string and dict methods templates call (minijinja-contrib
//! `pycompat`), `raise_exception`, `strftime_now`, and a `tojson` that writes what Python's
//! `json.dumps` writes (`", "`/`": "` separators, `indent`, non-ASCII kept).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::LlamaError;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A JSON value handed to a chat template (messages, tools), its object keys kept in the
/// order they were written, as Python keeps them: a tool's schema renders through `tojson`
/// exactly as transformers renders it.
#[derive(Debug, Clone)]
pub struct ChatValue(minijinja::Value);

impl<'de> Deserialize<'de> for ChatValue {
    /// Any self-describing format (JSON ...), keys in document order.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        minijinja::Value::deserialize(deserializer).map(ChatValue)
    }
}

impl ChatValue {
    /// Parses JSON text.
    pub fn from_json(text: &str) -> Result<ChatValue, serde_json::Error> {
        serde_json::from_str(text).map(ChatValue)
    }

    /// Any serializable value (a `serde_json::Value` keeps its own key order: sorted).
    pub fn from_serialize(value: &impl Serialize) -> ChatValue {
        ChatValue(minijinja::Value::from(minijinja::value::Serde(value)))
    }
}

/// A parsed chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    path: PathBuf,
    source: String,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Reads and compiles the template file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<ChatTemplate, LlamaError> {
        let path = path.as_ref().to_path_buf();
        let source = std::fs::read_to_string(&path).map_err(|source| LlamaError::Io {
            path: path.clone(),
            source,
        })?;
        ChatTemplate::from_source(source, path)
    }

    /// Compiles `source`; `path` names it in errors.
    pub fn from_source(source: String, path: PathBuf) -> Result<ChatTemplate, LlamaError> {
        let mut env = minijinja::Environment::new();
        // transformers compiles templates with trim_blocks and lstrip_blocks.
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_function("strftime_now", |format: String| {
            strftime(&format, std::time::SystemTime::now())
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| LlamaError::ChatTemplate {
                path: path.clone(),
                message: format!("{e:#}"),
            })?;
        Ok(ChatTemplate { env, path, source })
    }

    /// The template's Jinja source (servers read the tool-call format off it).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(
        &self,
        messages: &[Message],
        bos_token: &str,
        eos_token: &str,
        add_generation_prompt: bool,
    ) -> Result<String, LlamaError> {
        let variables = [("bos_token", bos_token), ("eos_token", eos_token)];
        self.render_conversation(
            &ChatValue::from_serialize(&messages),
            None,
            &variables,
            add_generation_prompt,
        )
    }

    /// Renders a conversation of any shape Hugging Face templates accept: messages as JSON
    /// objects (`role`, `content` as a string or a list of parts, `tool_calls`, `name`, ...),
    /// the `tools` offered (JSON schemas), and further template variables (`bos_token`,
    /// `eos_token`, `date_string`, ...).
    pub fn render_conversation(
        &self,
        messages: &ChatValue,
        tools: Option<&ChatValue>,
        variables: &[(&str, &str)],
        add_generation_prompt: bool,
    ) -> Result<String, LlamaError> {
        let err = |e: minijinja::Error| LlamaError::ChatTemplate {
            path: self.path.clone(),
            message: format!("{e:#}"),
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(err)?;
        let mut context: std::collections::BTreeMap<String, minijinja::Value> = variables
            .iter()
            .map(|&(k, v)| (k.to_string(), minijinja::Value::from(v)))
            .collect();
        context.insert("messages".into(), messages.0.clone());
        context.insert(
            "tools".into(),
            match tools {
                Some(tools) => tools.0.clone(),
                None => minijinja::Value::from(()),
            },
        );
        context.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(add_generation_prompt),
        );
        template.render(context).map_err(err)
    }
}

/// `value | tojson(indent=None, sort_keys=False, ensure_ascii=False)` as transformers defines
/// it: Python's `json.dumps`, so `{"a": 1, "b": [1, 2]}` with spaces after `,` and `:`, or
/// one item per line with `indent`; object keys in their order (sorted with `sort_keys`).
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        sort_keys: sort_keys == Some(true),
        ensure_ascii: ensure_ascii == Some(true),
    };
    let mut out = String::new();
    write_python_json(&value, style, 0, &mut out)?;
    Ok(minijinja::Value::from_safe_string(out))
}

#[derive(Clone, Copy)]
struct JsonStyle {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// Python's `json.dumps(value, indent=..., sort_keys=..., ensure_ascii=...)`.
fn write_python_json(
    value: &minijinja::Value,
    style: JsonStyle,
    depth: usize,
    out: &mut String,
) -> Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = style.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    // Python puts ", " between items without indent and "," (then a newline) with it.
    let separator = if style.indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::String => write_json_string(value.as_str().unwrap_or_default(), style, out),
        ValueKind::Number => match serde_json::to_value(value) {
            Ok(n) => out.push_str(&n.to_string()),
            Err(e) => {
                return Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!("tojson: {e}"),
                ));
            }
        },
        ValueKind::Map => {
            let mut keys: Vec<minijinja::Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_json_string(&key.to_string(), style, out);
                out.push_str(": ");
                write_python_json(&value.get_item(key)?, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<minijinja::Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_python_json(item, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        other => {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("tojson: a {other} has no JSON form"),
            ));
        }
    }
    Ok(())
}

fn write_json_string(s: &str, style: JsonStyle, out: &mut String) {
    let quoted = serde_json::Value::String(s.to_string()).to_string();
    if !style.ensure_ascii {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
}

/// `strftime_now(format)`: the current UTC time through the C `strftime` codes templates use
/// (`%Y %m %d %e %b %B %a %A %H %M %S %y %j %%`); another code is an error.
fn strftime(format: &str, now: std::time::SystemTime) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    let (year, month, day) = civil_from_days(days);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (h, m, s) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('a') => out.push_str(&DAYS[days.rem_euclid(7) as usize][..3]),
            Some('A') => out.push_str(DAYS[days.rem_euclid(7) as usize]),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: %{} is not supported",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Days since 1970-01-01 of a date (the inverse of [`civil_from_days`]).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_known_dates() {
        let at = |secs: u64| std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        // 2024-07-26 13:05:09 UTC, a Friday, day 208.
        let t = at(1_721_999_109);
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %e %H:%M:%S %j %y %%", t).unwrap(),
            "Friday July 26 13:05:09 208 24 %"
        );
        assert_eq!(strftime("%Y-%m-%d %a", at(0)).unwrap(), "1970-01-01 Thu");
        // 2000-02-29 (leap day), a Tuesday.
        assert_eq!(
            strftime("%Y-%m-%d %a %j", at(951_782_400)).unwrap(),
            "2000-02-29 Tue 060"
        );
        assert!(strftime("%Q", t).is_err());
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let env = {
            let mut env = minijinja::Environment::new();
            env.add_filter("tojson", tojson);
            env
        };
        let render = |template: &str, value: &ChatValue| {
            env.render_str(template, minijinja::context! { v => value.0.clone() })
                .unwrap()
        };
        let v =
            ChatValue::from_json(r#"{"b": [1, 2.5, true, null], "a": "é\"\n<", "c": {}, "d": []}"#)
                .unwrap();
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            render("{{ v | tojson }}", &v),
            r#"{"b": [1, 2.5, true, null], "a": "é\"\n<", "c": {}, "d": []}"#
        );
        // json.dumps(v, indent=2, sort_keys=True, ensure_ascii=True)
        assert_eq!(
            render(
                "{{ v | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}",
                &v
            ),
            "{\n  \"a\": \"\\u00e9\\\"\\n<\",\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"c\": {},\n  \"d\": []\n}"
        );
    }
}
