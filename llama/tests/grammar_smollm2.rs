//! Structured output and logit biases on SmolLM2-135M (CPU): a grammar's mask makes greedy and
//! sampled output follow a JSON schema or a Lark grammar, a bad grammar is an error, and a
//! logit bias bans or forces a token.
mod common;

use std::ops::ControlFlow;

use common::*;
use llama::{
    Device, FinishReason, GenerateOptions, GrammarCompiler, GrammarSpec, LlamaError, Message,
    OpenOptions, SamplerConfig,
};
use serde_json::{Value, json};

fn open() -> Option<llama::CpuModel> {
    let dir = model_dir()?;
    let options = OpenOptions {
        context: 512,
        ..OpenOptions::default()
    };
    Some(
        llama::open(&dir, Device::Cpu, &options)
            .unwrap()
            .into_cpu()
            .unwrap(),
    )
}

fn compiler(m: &llama::CpuModel) -> GrammarCompiler {
    let model = m.session.model();
    GrammarCompiler::new(
        m.session.tokenizer(),
        model.config().vocab_size,
        &model.config().eos_token_ids,
    )
    .unwrap()
}

fn chat_prompt(m: &llama::CpuModel, user: &str) -> Vec<u32> {
    let template = m.chat_template.as_ref().unwrap();
    let text = template
        .render(
            &[Message::new("user", user)],
            &m.bos_token,
            &m.eos_token,
            true,
        )
        .unwrap();
    m.session.tokenizer().encode(&text).unwrap()
}

/// Generates after `prompt` with `sampler`, the grammar `spec` and `bias`.
fn generate(
    m: &mut llama::CpuModel,
    prompt: &[u32],
    sampler: SamplerConfig,
    spec: Option<&GrammarSpec>,
    bias: Vec<(u32, f32)>,
    max_tokens: usize,
) -> llama::Generation {
    let constraint = spec.map(|s| compiler(m).compile(s).unwrap());
    let options = GenerateOptions {
        max_tokens,
        sampler,
        stop: vec![],
    };
    let step = m
        .session
        .step_for(prompt, &options)
        .unwrap()
        .with_logit_bias(bias)
        .with_constraint(constraint);
    let (generation, _) = m
        .session
        .generate_with(prompt, step, max_tokens, |_| ControlFlow::Continue(()))
        .unwrap();
    generation
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "student": {"type": "boolean"},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
        },
        "required": ["name", "age", "student", "color", "tags"],
        "additionalProperties": false
    })
}

/// Checks `v` against [`person_schema`] by hand (the schema is small and fixed).
fn check_person(v: &Value) {
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["age", "color", "name", "student", "tags"], "{v}");
    assert!(
        obj["name"]
            .as_str()
            .is_some_and(|s| s.chars().count() <= 20),
        "{v}"
    );
    assert!(obj["age"].is_i64() || obj["age"].is_u64(), "{v}");
    assert!(obj["student"].is_boolean(), "{v}");
    assert!(
        ["red", "green", "blue"].contains(&obj["color"].as_str().unwrap_or("")),
        "{v}"
    );
    let tags = obj["tags"]
        .as_array()
        .unwrap_or_else(|| panic!("tags: {v}"));
    assert!(tags.len() <= 3, "{v}");
    assert!(
        tags.iter()
            .all(|t| t.as_str().is_some_and(|s| s.chars().count() <= 8)),
        "{v}"
    );
}

#[test]
fn json_schema_output_is_valid_greedy_and_sampled() {
    let Some(mut m) = open() else { return };
    let prompt = chat_prompt(&m, "Describe a person as JSON.");
    let spec = GrammarSpec::JsonSchema(person_schema());
    let g = generate(
        &mut m,
        &prompt,
        SamplerConfig::greedy(),
        Some(&spec),
        vec![],
        120,
    );
    println!("greedy: {}", g.text);
    assert_eq!(g.finish_reason, FinishReason::Eos, "{}", g.text);
    check_person(&serde_json::from_str(&g.text).unwrap());
    // The cost of the mask (printed for BENCHMARKS.md, not asserted): decode speed of the
    // same prompt free and under a schema whose answer is long.
    let list = GrammarSpec::JsonSchema(json!({
        "type": "object",
        "properties": {"names": {"type": "array", "items": {"type": "string", "maxLength": 40}}},
        "required": ["names"]
    }));
    let list_prompt = chat_prompt(&m, "List twenty first names as JSON.");
    let constrained = generate(
        &mut m,
        &list_prompt,
        SamplerConfig::greedy(),
        Some(&list),
        vec![],
        64,
    );
    let free = generate(
        &mut m,
        &list_prompt,
        SamplerConfig::greedy(),
        None,
        vec![],
        64,
    );
    // The mask's own time, replaying the constrained tokens through a fresh constraint.
    let mut constraint = compiler(&m).compile(&list).unwrap();
    let mut logits = vec![0f32; m.session.model().config().vocab_size];
    let started = std::time::Instant::now();
    for &token in &constrained.tokens {
        // Fresh logits each step, as the real step copies them.
        logits.fill(0.0);
        constraint.mask(&mut logits).unwrap();
        assert!(
            logits[token as usize].is_finite(),
            "the mask bans a token it chose"
        );
        constraint.accept(token).unwrap();
    }
    let mask_seconds = started.elapsed().as_secs_f64() / constrained.tokens.len() as f64;
    println!(
        "decode: {:.1} tok/s free ({} tokens), {:.1} tok/s under a JSON schema ({} tokens); \
         mask + advance {:.0} us per token = {:.2}% of a free decode step",
        free.generation_tokens_per_second(),
        free.tokens.len(),
        constrained.generation_tokens_per_second(),
        constrained.tokens.len(),
        mask_seconds * 1e6,
        100.0 * mask_seconds * free.generation_tokens_per_second()
    );
    for seed in 0..3 {
        let sampler = SamplerConfig {
            temperature: 1.0,
            seed,
            ..SamplerConfig::default()
        };
        let g = generate(&mut m, &prompt, sampler, Some(&spec), vec![], 120);
        println!("seed {seed}: {}", g.text);
        assert_eq!(g.finish_reason, FinishReason::Eos, "{}", g.text);
        check_person(&serde_json::from_str(&g.text).unwrap());
    }
}

#[test]
fn json_object_and_lark_grammars_constrain_the_output() {
    let Some(mut m) = open() else { return };
    let prompt = chat_prompt(&m, "Say something.");
    // Unconstrained, the model answers in prose.
    let free = generate(&mut m, &prompt, SamplerConfig::greedy(), None, vec![], 16);
    assert!(
        serde_json::from_str::<Value>(&free.text).is_err(),
        "{}",
        free.text
    );
    let g = generate(
        &mut m,
        &prompt,
        SamplerConfig::greedy(),
        Some(&GrammarSpec::JsonObject),
        vec![],
        60,
    );
    println!("json_object: {}", g.text);
    assert_eq!(g.finish_reason, FinishReason::Eos, "{}", g.text);
    assert!(serde_json::from_str::<Value>(&g.text).unwrap().is_object());
    let lark = GrammarSpec::Lark(r#"start: ("yes" | "no") "." "#.into());
    let g = generate(
        &mut m,
        &prompt,
        SamplerConfig::greedy(),
        Some(&lark),
        vec![],
        10,
    );
    assert!(["yes.", "no."].contains(&g.text.as_str()), "{:?}", g.text);
    assert_eq!(g.finish_reason, FinishReason::Eos);
}

#[test]
fn bad_grammars_are_errors_that_say_why() {
    let Some(m) = open() else { return };
    let c = compiler(&m);
    for (spec, needle) in [
        (
            GrammarSpec::JsonSchema(json!({"type": "no-such-type"})),
            "no-such-type",
        ),
        (GrammarSpec::Lark("start: (".into()), ""),
        (
            GrammarSpec::Lark("start: undefined_rule".into()),
            "undefined_rule",
        ),
    ] {
        match c.compile(&spec) {
            Err(LlamaError::Grammar { message }) => {
                println!("{spec:?}: {message}");
                assert!(message.contains(needle), "{message}");
            }
            Err(other) => panic!("{spec:?}: wrong error {other}"),
            Ok(_) => panic!("{spec:?} compiled"),
        }
    }
}

#[test]
fn logit_bias_bans_and_forces_tokens() {
    let Some(mut m) = open() else { return };
    let prompt = chat_prompt(&m, "What is the capital of France?");
    let plain = generate(&mut m, &prompt, SamplerConfig::greedy(), None, vec![], 4);
    let first = plain.tokens[0];
    let banned = generate(
        &mut m,
        &prompt,
        SamplerConfig::greedy(),
        None,
        vec![(first, -100.0)],
        4,
    );
    assert_ne!(banned.tokens[0], first, "{:?}", banned.text);
    assert!(!banned.tokens.contains(&first), "{:?}", banned.tokens);
    let forced_id = m.session.tokenizer().encode(" banana").unwrap()[0];
    let forced = generate(
        &mut m,
        &prompt,
        SamplerConfig::greedy(),
        None,
        vec![(forced_id, 100.0)],
        3,
    );
    assert!(
        forced.tokens.iter().all(|&t| t == forced_id),
        "{:?}",
        forced.tokens
    );
    println!(
        "plain {:?}, banned {:?}, forced {:?}",
        plain.text, banned.text, forced.text
    );
}
