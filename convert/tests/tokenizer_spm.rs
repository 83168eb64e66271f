//! A SentencePiece-style ("llama") GGUF vocabulary becomes a byte-fallback BPE tokenizer whose
//! merges come from the piece scores.

use gdsllm_convert::gguf::{GgufFile, GgufValue, GgufValueType};
use gdsllm_convert::gguf_writer::GgufBuilder;
use gdsllm_convert::tokenizer::tokenizer_json_from_gguf;
use tokenizers::Tokenizer;

#[test]
fn llama_vocabulary_merges_by_score_and_falls_back_to_bytes() {
    // (piece, score, type): 1 normal, 2 unknown, 3 control, 6 byte.
    let mut vocab: Vec<(String, f32, i32)> = vec![
        ("<unk>".into(), 0.0, 2),
        ("<s>".into(), 0.0, 3),
        ("</s>".into(), 0.0, 3),
    ];
    vocab.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    for (piece, score) in [
        ("ll", -1.0),
        ("\u{2581}h", -2.0),
        ("\u{2581}he", -3.0),
        ("llo", -4.0),
        ("\u{2581}hello", -5.0),
        ("or", -6.0),
        ("\u{2581}w", -7.0),
        ("\u{2581}wor", -8.0),
        ("ld", -9.0),
        ("\u{2581}world", -10.0),
    ] {
        vocab.push((piece.into(), score, 1));
    }
    for c in ["\u{2581}", "h", "e", "l", "o", "w", "r", "d"] {
        vocab.push((c.into(), -100.0, 1));
    }
    let id = |p: &str| vocab.iter().position(|v| v.0 == p).unwrap() as u32;
    let pieces: Vec<(&str, i32)> = vocab.iter().map(|v| (v.0.as_str(), v.2)).collect();
    let scores: Vec<f32> = vocab.iter().map(|v| v.1).collect();
    let json = build(&pieces, Some(&scores)).unwrap();
    // Written as `serde_json` writes a `Value`: every object's keys sorted.
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(serde_json::to_string(&value).unwrap(), json);
    let tokenizer: Tokenizer = json.parse().unwrap();

    let enc = tokenizer.encode("hello world", false).unwrap();
    assert_eq!(
        enc.get_ids(),
        &[id("\u{2581}hello"), id("\u{2581}world")],
        "{:?}",
        enc.get_tokens()
    );
    // "ü" is not a piece: UTF-8 bytes C3 BC.
    let enc = tokenizer.encode("hello ü", false).unwrap();
    assert_eq!(
        enc.get_ids(),
        &[
            id("\u{2581}hello"),
            id("\u{2581}"),
            id("<0xC3>"),
            id("<0xBC>")
        ],
        "{:?}",
        enc.get_tokens()
    );
    assert_eq!(tokenizer.decode(enc.get_ids(), false).unwrap(), "hello ü");
    // Control tokens are special added tokens, matched whole.
    let enc = tokenizer.encode("<s>hello", false).unwrap();
    assert_eq!(enc.get_ids()[0], id("<s>"));
}

/// Writes a llama-model GGUF vocabulary of `(piece, type)` (with the pieces' `scores`, if
/// given) and builds its tokenizer.
fn build(vocab: &[(&str, i32)], scores: Option<&[f32]>) -> Result<String, String> {
    let mut b = GgufBuilder::new();
    b.kv("tokenizer.ggml.model", GgufValue::String("llama".into()))
        .kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(
                GgufValueType::String,
                vocab
                    .iter()
                    .map(|v| GgufValue::String(v.0.into()))
                    .collect(),
            ),
        );
    if let Some(scores) = scores {
        b.kv(
            "tokenizer.ggml.scores",
            GgufValue::Array(
                GgufValueType::F32,
                scores.iter().map(|s| GgufValue::F32(*s)).collect(),
            ),
        );
    }
    b.kv(
        "tokenizer.ggml.token_type",
        GgufValue::Array(
            GgufValueType::I32,
            vocab.iter().map(|v| GgufValue::I32(v.1)).collect(),
        ),
    );
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("vocab.gguf");
    b.write_to(&path).unwrap();
    tokenizer_json_from_gguf(&GgufFile::open(&path).unwrap()).map_err(|e| e.to_string())
}

#[test]
fn repeated_pieces_keep_the_first_id_and_repeated_normal_pieces_are_refused() {
    // A repeat involving a control piece is kept out of the vocabulary: "a" stays id 1.
    let json = build(
        &[("<unk>", 2), ("a", 1), ("b", 1), ("a", 3), ("ab", 1)],
        None,
    )
    .unwrap();
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    let vocab = value["model"]["vocab"].as_object().unwrap();
    assert_eq!(vocab.len(), 4);
    assert_eq!(vocab["a"], 1);
    // Two normal pieces with the same string: the first such repeat in id order is named
    // (not the first in string order).
    let err = build(
        &[("<unk>", 2), ("z", 1), ("z", 1), ("a", 1), ("a", 1)],
        None,
    )
    .unwrap_err();
    assert!(
        err.contains("token \"z\" appears twice") && err.contains("ids 1 and 2"),
        "{err}"
    );
}
