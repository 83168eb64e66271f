//! The tokenizer built from the SmolLM2 GGUF reproduces the golden token ids.

mod common;

use gdsllm_convert::gguf::GgufFile;
use gdsllm_convert::tokenizer::tokenizer_json_from_gguf;
use tokenizers::Tokenizer;

fn check_cases(tokenizer: &Tokenizer, source: &str) {
    let golden = common::golden();
    let mut cases: Vec<(String, Vec<u32>)> = golden["tokenizer_cases"]
        .as_array()
        .expect("tokenizer_cases")
        .iter()
        .map(|c| {
            let ids = c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32);
            (c["text"].as_str().unwrap().to_string(), ids.collect())
        })
        .collect();
    let chat = &golden["chat"];
    cases.push((
        chat["rendered"].as_str().unwrap().to_string(),
        chat["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect(),
    ));
    assert_eq!(cases.len(), 5);
    for (text, expected) in cases {
        let encoding = tokenizer.encode(text.as_str(), true).unwrap();
        assert_eq!(
            encoding.get_ids(),
            expected.as_slice(),
            "{source}: {text:?}"
        );
        let decoded = tokenizer.decode(&expected, false).unwrap();
        assert_eq!(decoded, text, "{source}: decoding {expected:?}");
    }
}

#[test]
fn tokenizer_built_from_gguf_matches_golden_ids() {
    let Some(path) = common::model_path("GDSLLM_TEST_GGUF") else {
        return;
    };
    let gguf = GgufFile::open(&path).unwrap();
    let json = tokenizer_json_from_gguf(&gguf).unwrap();
    // Written as `serde_json` writes a `Value`: every object's keys sorted, so the bytes do not
    // depend on how the JSON is assembled.
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(serde_json::to_string(&value).unwrap(), json);
    let tokenizer: Tokenizer = json.parse().unwrap();
    check_cases(&tokenizer, &path.display().to_string());
}

#[test]
fn converted_model_tokenizer_matches_golden_ids() {
    let Some(dir) = common::model_path("GDSLLM_TEST_MODEL") else {
        return;
    };
    let path = dir.join("tokenizer.json");
    let tokenizer = Tokenizer::from_file(&path).unwrap();
    check_cases(&tokenizer, &path.display().to_string());
}
