//! Structured output: a grammar (a JSON schema, any JSON object, or a Lark grammar) enforced
//! while sampling, with `llguidance` (the constrained-decoding library llama.cpp uses) doing
//! all the grammar work.
//!
//! Before each token, the sequence's [`Constraint`] computes the set of tokens that keep the
//! output a prefix of the grammar's language and sets every other logit to −∞; after sampling
//! it advances by the chosen token. The mask is applied to the logits on the host after the
//! forward pass hands them back, so it is the same on every backend (CPU and CUDA alike) and
//! per sequence in a batch. An end-of-sequence token is allowed only where the grammar may end,
//! and once it must end, nothing else is.
//!
//! [`GrammarCompiler`] binds `llguidance`'s token trie to the model's tokenizer once (the
//! bytes of every token from `tokenizer.json`, our `tokenizers` tokenizer for re-tokenizing
//! text); compiling a request's grammar is then cheap, and a grammar that does not compile (an
//! invalid schema, a Lark syntax error) is a [`LlamaError::Grammar`] naming the problem.
//!
//! Not for: choosing what to constrain (the server maps `response_format`, `grammar` and
//! forced tool calls to a [`GrammarSpec`]).

use std::sync::Arc;

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::LlamaError;
use crate::tokenizer::Tokenizer;

/// What a sequence's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON document valid against this JSON schema.
    JsonSchema(Value),
    /// A grammar in `llguidance`'s Lark syntax (its `%json` and regex terminals included).
    Lark(String),
}

impl GrammarSpec {
    /// JSON written compactly (`{"a":1,"b":[2,3]}`, as OpenAI's structured outputs write it)
    /// unless the schema sets its own `x-guidance` options: a small model allowed free
    /// whitespace can fill its whole token budget with newlines.
    fn to_llguidance(&self) -> TopLevelGrammar {
        let compact = |mut schema: Value| {
            if let Value::Object(map) = &mut schema
                && !map.contains_key("x-guidance")
            {
                map.insert(
                    "x-guidance".into(),
                    json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"}),
                );
            }
            schema
        };
        match self {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            GrammarSpec::Lark(text) => TopLevelGrammar::from_grammar(GrammarWithLexer {
                name: Some("grammar".into()),
                ..GrammarWithLexer::from_lark(text.clone())
            }),
        }
    }
}

/// `llguidance`'s view of the model's tokenizer: its token trie from `tokenizer.json`, and
/// our tokenizer for turning text into tokens.
struct ModelTokEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for ModelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<toktrie::TokenId> {
        self.trie.tokenize_with_greedy_fallback(bytes, |text| {
            // The trait has no error path; the trie's greedy tokenization is a valid (if not
            // the canonical) tokenization of the same bytes.
            self.tokenizer
                .encode(text)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}

/// Compiles grammars for one model's tokenizer; clones share it.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    eos: Vec<u32>,
}

fn grammar_error(message: impl std::fmt::Display) -> LlamaError {
    LlamaError::Grammar {
        message: message.to_string(),
    }
}

impl GrammarCompiler {
    /// Binds `tokenizer` (its `tokenizer.json` gives each token's bytes) for a model with
    /// `vocab` logits whose sequences end with any of `eos`.
    pub fn new(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Self, LlamaError> {
        let path = tokenizer.path();
        let tokenizer_error = |message: String| LlamaError::Tokenizer {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|source| LlamaError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| tokenizer_error(format!("not valid JSON: {e}")))?;
        let mut token_bytes = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| tokenizer_error(format!("token bytes for structured output: {e:#}")))?;
        if token_bytes.len() > vocab {
            return Err(tokenizer_error(format!(
                "it has {} tokens but the model has {vocab} logits",
                token_bytes.len()
            )));
        }
        // Padding rows of the output matrix: tokens that match nothing.
        token_bytes.resize(vocab, Vec::new());
        let Some(&first_eos) = eos.first() else {
            return Err(grammar_error(
                "the model has no end-of-sequence token, so a grammar could never end",
            ));
        };
        if let Some(&bad) = eos.iter().find(|&&id| id as usize >= vocab) {
            return Err(LlamaError::TokenOutOfRange { id: bad, vocab });
        }
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &token_bytes).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(ModelTokEnv {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(grammar_error)?;
        // Errors come back as values; nothing is printed.
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
            eos: eos.to_vec(),
        })
    }

    /// A fresh constraint for one sequence, or why `spec` does not compile.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, LlamaError> {
        let parser = self
            .factory
            .create_parser(spec.to_llguidance())
            .map_err(|e| grammar_error(format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(message) = matcher.get_error() {
            return Err(grammar_error(message));
        }
        Ok(Constraint {
            matcher,
            eos: self.eos.clone(),
        })
    }
}

/// One sequence's grammar state: which tokens may come next.
pub struct Constraint {
    matcher: Matcher,
    eos: Vec<u32>,
}

impl Constraint {
    /// Sets the logit of every token the grammar does not allow next to −∞. Fails when the
    /// grammar allows nothing (the sequence cannot go on).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), LlamaError> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(grammar_error)?;
        if allowed.is_zero() {
            return Err(grammar_error(
                "no token can continue the output under the grammar",
            ));
        }
        let vocab = allowed.len().min(logits.len());
        for (id, logit) in logits.iter_mut().enumerate() {
            if id >= vocab || !allowed.is_allowed(id as u32) {
                *logit = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past the sampled `token` (an end-of-sequence token ends the grammar).
    pub fn accept(&mut self, token: u32) -> Result<(), LlamaError> {
        if self.eos.contains(&token) {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(grammar_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_write_compact_json_unless_the_schema_says_otherwise() {
        let TopLevelGrammar { grammars, .. } = GrammarSpec::JsonObject.to_llguidance();
        let schema = grammars[0].json_schema.as_ref().unwrap();
        assert_eq!(schema["type"], "object");
        assert_eq!(schema["x-guidance"]["whitespace_flexible"], false);
        let own = json!({"type": "string", "x-guidance": {"whitespace_flexible": true}});
        let TopLevelGrammar { grammars, .. } = GrammarSpec::JsonSchema(own.clone()).to_llguidance();
        assert_eq!(grammars[0].json_schema.as_ref(), Some(&own));
        let TopLevelGrammar { grammars, .. } =
            GrammarSpec::Lark("start: \"a\"".into()).to_llguidance();
        assert_eq!(grammars[0].lark_grammar.as_deref(), Some("start: \"a\""));
    }
}
