//! Building a Hugging Face `tokenizer.json` from GGUF tokenizer metadata, and finding chat
//! templates.
//!
//! The JSON is written with `serde_json`, every object's keys in sorted order, so the output is
//! deterministic; it is checked by loading it with the `tokenizers` crate in the tests.

use std::collections::HashMap;

use serde::{Serialize, Serializer};
use serde_json::{Value, json};

use crate::gguf::{GgufError, GgufFile};

/// GGUF `tokenizer.ggml.token_type` values that become special added tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
const TOKEN_TYPE_UNKNOWN: i64 = 2;

/// The regex llama.cpp calls `llama-bpe` (Llama 3's pre-tokenizer).
const LLAMA3_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's (llama.cpp's `qwen2`, also used for `deepseek-r1-qwen`): Llama 3's with digits
/// split one by one.
const QWEN2_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: tokenizer.ggml.model {model:?} is not supported (supported: gpt2, llama)")]
    UnsupportedModel { path: String, model: String },
    #[error(
        "{path}: tokenizer.ggml.pre {pre:?} is not supported (supported: smollm, gpt2, default, llama-bpe, llama3, qwen2, deepseek-r1-qwen)"
    )]
    UnsupportedPreTokenizer { path: String, pre: String },
    #[error("{path}: {key} has {found} entries but tokenizer.ggml.tokens has {tokens}")]
    LengthMismatch {
        path: String,
        key: &'static str,
        found: usize,
        tokens: usize,
    },
    #[error(
        "{path}: token {token:?} appears twice in tokenizer.ggml.tokens (ids {first} and {second})"
    )]
    DuplicateToken {
        path: String,
        token: String,
        first: usize,
        second: usize,
    },
}

/// Builds the text of a `tokenizer.json` equivalent to the GGUF's embedded tokenizer.
///
/// BOS is never added by the post-processor: whether to prepend it is recorded in the model
/// config (`add_bos_token`), so that a prompt never gets it twice.
pub fn tokenizer_json_from_gguf(gguf: &GgufFile) -> Result<String, TokenizerError> {
    Ok(GgufTokenizer::from_gguf(gguf)?.to_json())
}

/// A GGUF tokenizer whose metadata has been checked: [`GgufTokenizer::to_json`] cannot fail.
/// Checking is the cheap part, so a converter can refuse a bad tokenizer before writing
/// anything and build the JSON while the weights are being written.
pub struct GgufTokenizer<'g> {
    tokens: Vec<&'g str>,
    token_types: Option<Vec<i64>>,
    /// Every distinct token string with its first id, sorted by string.
    vocab: Vec<(&'g str, u32)>,
    model: TokenizerModel<'g>,
}

enum TokenizerModel<'g> {
    /// Byte-level BPE with its merge list (`"left right"` strings).
    Gpt2 {
        merges: Vec<&'g str>,
        pre: PreTokenizer,
    },
    /// SentencePiece pieces with scores, turned into byte-fallback BPE.
    Llama {
        scores: Vec<f32>,
        unk: Option<&'g str>,
        /// `tokenizer.ggml.add_space_prefix` (llama.cpp's default for SentencePiece: true;
        /// Gemma's files say false).
        add_space_prefix: bool,
    },
}

/// An optional array of one value per token (`key` of the GGUF at `path`): an error when it is
/// not as long as the vocabulary.
fn per_token<T>(
    values: Option<Vec<T>>,
    key: &'static str,
    path: &str,
    tokens: &[&str],
) -> Result<Option<Vec<T>>, TokenizerError> {
    match values {
        Some(v) if v.len() != tokens.len() => Err(TokenizerError::LengthMismatch {
            path: path.to_string(),
            key,
            found: v.len(),
            tokens: tokens.len(),
        }),
        values => Ok(values),
    }
}

enum PreTokenizer {
    /// `smollm`: digits split one by one, then GPT-2 byte level.
    Smollm,
    /// `gpt2`, `default`: GPT-2 byte level.
    Gpt2,
    /// `llama-bpe`, `llama3`: Llama 3's split regex, then byte level without its regex; a
    /// word that is itself a token is taken whole (llama.cpp's `ignore_merges`).
    Llama3,
    /// `qwen2`, `deepseek-r1-qwen`: Qwen2's split regex, then byte level without its regex.
    Qwen2,
}

impl<'g> GgufTokenizer<'g> {
    /// Reads and checks the `tokenizer.ggml.*` keys.
    pub fn from_gguf(gguf: &'g GgufFile) -> Result<GgufTokenizer<'g>, TokenizerError> {
        let path = gguf.path().display().to_string();
        let model = gguf.require_str("tokenizer.ggml.model")?;
        let tokens = gguf.require_str_array("tokenizer.ggml.tokens")?;
        const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
        let token_types = per_token(gguf.opt_int_array(TOKEN_TYPE)?, TOKEN_TYPE, &path, &tokens)?;
        let type_of = |id: usize| token_types.as_ref().map_or(1, |t| t[id]);

        // A few GGUF vocabularies repeat unused placeholder pieces; the tokenizer can only map
        // a string to one id, so keep the first like Hugging Face does. Two normal tokens with
        // the same string are an error; the one reported is the first such repeat in id order.
        let mut by_token: Vec<(u64, &str, u32)> = tokens
            .iter()
            .enumerate()
            .map(|(id, &t)| (sort_prefix(t), t, id as u32))
            .collect();
        // The 8-byte prefix settles most comparisons without comparing whole strings.
        by_token.sort_unstable_by(|a, b| (a.0, a.1, a.2).cmp(&(b.0, b.1, b.2)));
        let mut vocab: Vec<(&str, u32)> = Vec::with_capacity(tokens.len());
        let mut repeat: Option<(usize, usize)> = None;
        for &(_, token, id) in &by_token {
            match vocab.last() {
                Some(&(last, first)) if last == token => {
                    let (first, id) = (first as usize, id as usize);
                    if type_of(id) == 1
                        && type_of(first) == 1
                        && repeat.is_none_or(|(_, second)| id < second)
                    {
                        repeat = Some((first, id));
                    }
                }
                _ => vocab.push((token, id)),
            }
        }
        if let Some((first, second)) = repeat {
            return Err(TokenizerError::DuplicateToken {
                path,
                token: tokens[second].to_string(),
                first,
                second,
            });
        }

        let model = match model {
            "gpt2" => {
                let merges = gguf.require_str_array("tokenizer.ggml.merges")?;
                let pre = match gguf.opt_str("tokenizer.ggml.pre")?.unwrap_or("default") {
                    "smollm" => PreTokenizer::Smollm,
                    "gpt2" | "default" => PreTokenizer::Gpt2,
                    "llama-bpe" | "llama3" => PreTokenizer::Llama3,
                    "qwen2" | "deepseek-r1-qwen" => PreTokenizer::Qwen2,
                    other => {
                        return Err(TokenizerError::UnsupportedPreTokenizer {
                            path,
                            pre: other.to_string(),
                        });
                    }
                };
                TokenizerModel::Gpt2 { merges, pre }
            }
            "llama" => {
                const SCORES: &str = "tokenizer.ggml.scores";
                let scores = per_token(gguf.opt_f32_array(SCORES)?, SCORES, &path, &tokens)?;
                let scores = scores.unwrap_or_else(|| vec![0.0; tokens.len()]);
                let unk = (0..tokens.len())
                    .find(|&id| type_of(id) == TOKEN_TYPE_UNKNOWN)
                    .or(gguf
                        .opt_u32("tokenizer.ggml.unknown_token_id")?
                        .map(|u| u as usize))
                    .and_then(|id| tokens.get(id))
                    .copied();
                let add_space_prefix = gguf
                    .opt_bool("tokenizer.ggml.add_space_prefix")?
                    .unwrap_or(true);
                TokenizerModel::Llama {
                    scores,
                    unk,
                    add_space_prefix,
                }
            }
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    path,
                    model: other.to_string(),
                });
            }
        };
        Ok(GgufTokenizer {
            tokens,
            token_types,
            vocab,
            model,
        })
    }

    /// The text of `tokenizer.json`.
    pub fn to_json(&self) -> String {
        let type_of = |id: usize| self.token_types.as_ref().map_or(1, |t| t[id]);
        let vocab = &self.vocab;

        let added_tokens: Vec<Value> = self
            .tokens
            .iter()
            .enumerate()
            .filter(|&(id, _)| matches!(type_of(id), TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .map(|(id, content)| {
                json!({
                    "id": id,
                    "content": content,
                    "single_word": false,
                    "lstrip": false,
                    "rstrip": false,
                    "normalized": false,
                    "special": true,
                })
            })
            .collect();

        let mut normalizer = None;
        let (pre_tokenizer, decoder, model) = match &self.model {
            TokenizerModel::Gpt2 { merges, pre } => {
                let byte_level = |use_regex: bool| {
                    json!({
                        "type": "ByteLevel",
                        "add_prefix_space": false,
                        "trim_offsets": true,
                        "use_regex": use_regex,
                    })
                };
                let pre_tokenizer = match pre {
                    PreTokenizer::Smollm => json!({
                        "type": "Sequence",
                        "pretokenizers": [
                            {"type": "Digits", "individual_digits": true},
                            byte_level(true),
                        ],
                    }),
                    PreTokenizer::Gpt2 => byte_level(true),
                    PreTokenizer::Llama3 | PreTokenizer::Qwen2 => json!({
                        "type": "Sequence",
                        "pretokenizers": [
                            {
                                "type": "Split",
                                "pattern": {"Regex": match pre {
                                    PreTokenizer::Qwen2 => QWEN2_SPLIT_REGEX,
                                    _ => LLAMA3_SPLIT_REGEX,
                                }},
                                "behavior": "Isolated",
                                "invert": false,
                            },
                            byte_level(false),
                        ],
                    }),
                };
                let decoder = json!({
                    "type": "ByteLevel",
                    "add_prefix_space": true,
                    "trim_offsets": true,
                    "use_regex": true,
                });
                let model = BpeModel {
                    byte_fallback: false,
                    continuing_subword_prefix: None,
                    dropout: None,
                    end_of_word_suffix: None,
                    fuse_unk: false,
                    ignore_merges: matches!(pre, PreTokenizer::Llama3),
                    merges: Merges::Joined(merges),
                    kind: "BPE",
                    unk_token: None,
                    vocab: Vocab(vocab),
                };
                (pre_tokenizer, decoder, model)
            }
            TokenizerModel::Llama {
                scores,
                unk,
                add_space_prefix,
            } => {
                let first_id: HashMap<&str, u32> = vocab.iter().copied().collect();
                let merges = merges_from_scores(&self.tokens, scores, &first_id);
                // llama.cpp's SentencePiece path: a space before every piece of text that
                // starts the input or follows a special token (when add_space_prefix), even
                // one that already starts with a space, then every space as U+2581. The
                // `tokenizers` normalizers run on exactly those pieces; its Metaspace
                // pre-tokenizer would skip the space before text that starts with one.
                let mut normalizers = Vec::new();
                if *add_space_prefix {
                    normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
                }
                normalizers.push(json!({
                    "type": "Replace",
                    "pattern": {"String": " "},
                    "content": "\u{2581}",
                }));
                normalizer = Some(json!({"type": "Sequence", "normalizers": normalizers}));
                let pre_tokenizer = Value::Null;
                let mut decoders = vec![
                    json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                    json!({"type": "ByteFallback"}),
                    json!({"type": "Fuse"}),
                ];
                if *add_space_prefix {
                    decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                }
                let decoder = json!({"type": "Sequence", "decoders": decoders});
                let model = BpeModel {
                    byte_fallback: true,
                    continuing_subword_prefix: None,
                    dropout: None,
                    end_of_word_suffix: None,
                    fuse_unk: true,
                    ignore_merges: false,
                    merges: Merges::Pairs(merges),
                    kind: "BPE",
                    unk_token: *unk,
                    vocab: Vocab(vocab),
                };
                (pre_tokenizer, decoder, model)
            }
        };

        let tokenizer = TokenizerJson {
            added_tokens,
            decoder,
            model,
            normalizer,
            padding: None,
            post_processor: None,
            pre_tokenizer,
            truncation: None,
            version: "1.0",
        };
        serde_json::to_string(&tokenizer).expect("the tokenizer always serialises")
    }
}

// The structs below serialize exactly like the `serde_json::Value` objects they stand for, whose
// keys are sorted: their fields must stay in sorted key order (a test re-sorts the output and
// compares). They exist so that the 50k-entry vocabulary and merge list are written straight
// from the GGUF strings instead of being copied into a tree of `Value`s first.

#[derive(Serialize)]
struct TokenizerJson<'a> {
    added_tokens: Vec<Value>,
    decoder: Value,
    model: BpeModel<'a>,
    normalizer: Option<Value>,
    padding: Option<()>,
    post_processor: Option<()>,
    pre_tokenizer: Value,
    truncation: Option<()>,
    version: &'static str,
}

#[derive(Serialize)]
struct BpeModel<'a> {
    byte_fallback: bool,
    continuing_subword_prefix: Option<()>,
    dropout: Option<()>,
    end_of_word_suffix: Option<()>,
    fuse_unk: bool,
    ignore_merges: bool,
    merges: Merges<'a>,
    #[serde(rename = "type")]
    kind: &'static str,
    unk_token: Option<&'a str>,
    vocab: Vocab<'a>,
}

/// Token → id, sorted by token.
struct Vocab<'a>(&'a [(&'a str, u32)]);

impl Serialize for Vocab<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|&(token, id)| (token, id)))
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum Merges<'a> {
    /// GGUF's `"left right"` strings, as they are.
    Joined(&'a [&'a str]),
    /// `[left, right]` pairs.
    Pairs(Vec<[&'a str; 2]>),
}

/// The first 8 bytes of `s`, zero-padded, as a number that orders like the bytes do.
fn sort_prefix(s: &str) -> u64 {
    let mut prefix = [0u8; 8];
    let n = s.len().min(8);
    prefix[..n].copy_from_slice(&s.as_bytes()[..n]);
    u64::from_be_bytes(prefix)
}

/// SentencePiece BPE has no merge list, only a score per piece. The merges are every split of
/// a piece into two pieces that are both in the vocabulary, ranked by the score of the merged
/// piece (higher first), ties broken by the ids of the parts: the rule Hugging Face's
/// `SentencePieceExtractor` uses, so the result matches their converted tokenizers.
fn merges_from_scores<'a>(
    tokens: &[&'a str],
    scores: &[f32],
    first_id: &HashMap<&str, u32>,
) -> Vec<[&'a str; 2]> {
    let mut merges: Vec<(f32, u32, u32, [&'a str; 2])> = Vec::new();
    for (&token, &score) in tokens.iter().zip(scores) {
        for (cut, _) in token.char_indices().skip(1) {
            let (left, right) = token.split_at(cut);
            if let (Some(&l), Some(&r)) = (first_id.get(left), first_id.get(right)) {
                merges.push((score, l, r, [left, right]));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    merges.into_iter().map(|(_, _, _, pair)| pair).collect()
}

/// The chat template of a `tokenizer_config.json`: either a string, or a list of
/// `{name, template}` from which the one named "default" is taken.
pub fn chat_template_from_tokenizer_config(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// Loads `json` with the `tokenizers` crate, as the runtime does, so that a conversion never
/// writes a tokenizer.json that `gdsllm run` would then refuse.
pub fn check_tokenizer_json(json: &[u8]) -> Result<(), String> {
    tokenizers::Tokenizer::from_bytes(json)
        .map(|_| ())
        .map_err(|e| format!("tokenizer.json does not load: {e}"))
}

/// Compiles a chat template with minijinja, as the runtime does (functions such as
/// `raise_exception` are looked up when rendering, so they do not matter here).
pub fn check_chat_template(source: &str) -> Result<(), String> {
    let mut env = minijinja::Environment::new();
    env.add_template("chat_template", source)
        .map(|_| ())
        .map_err(|e| format!("the chat template does not compile: {e:#}"))
}
