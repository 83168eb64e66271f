//! `gdsllm serve` on the real SmolLM2 model, through a real HTTP client on loopback: every
//! endpoint streamed and not, greedy output against `gdsllm run`, errors, auth, metrics,
//! concurrency, disconnects and SIGTERM.

mod serve_common;

use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use serve_common::*;

async fn post(client: &reqwest::Client, url: String, body: &Value) -> (u16, Value) {
    let r = client.post(url).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

async fn post_text(client: &reqwest::Client, url: String, body: &Value) -> String {
    let r = client.post(url).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

fn error_message(body: &Value) -> String {
    let e = &body["error"];
    assert!(
        e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some(),
        "{body}"
    );
    e["message"].as_str().unwrap().to_string()
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

const QUESTION: &str = "What is the capital of France? Answer in one sentence.";

#[test]
fn endpoints_match_gdsllm_run_and_errors_are_openai_shaped() {
    let Some(dir) = model_dir() else { return };
    let served = Served::start(&dir, &["-c", "256", "--body-limit", "64KiB"], &[]);
    let rt = runtime();
    let c = reqwest::Client::new();
    let id = dir.file_name().unwrap().to_string_lossy().into_owned();

    // Greedy chat == `gdsllm run` on the same rendered conversation.
    let rendered = render_chat(&dir, &[("user", QUESTION)]);
    let (want, want_prompt, want_finish) = run_greedy(&dir, &rendered, 24);
    let want_finish = if want_finish == "length" {
        "length"
    } else {
        "stop"
    };
    let body = json!({"model": id, "messages": [{"role": "user", "content": QUESTION}],
                      "temperature": 0, "max_tokens": 24});
    let (status, r) = rt.block_on(post(&c, served.url("/v1/chat/completions"), &body));
    assert_eq!(status, 200, "{r}");
    println!(
        "chat: {:?} (gdsllm run: {want:?})",
        r["choices"][0]["message"]["content"]
    );
    assert_eq!(r["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(r["choices"][0]["finish_reason"], want_finish);
    assert_eq!(r["usage"]["prompt_tokens"], want_prompt);

    // Streamed, with usage.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let text = rt.block_on(post_text(&c, served.url("/v1/chat/completions"), &sbody));
    let (streamed, finish, chunks) = streamed_text(&text);
    assert_eq!(streamed, want);
    assert_eq!(finish.as_deref(), Some(want_finish));
    assert_eq!(
        chunks.last().unwrap()["usage"]["prompt_tokens"],
        want_prompt
    );
    assert_eq!(
        chunks.last().unwrap()["usage"]["completion_tokens"],
        r["usage"]["completion_tokens"]
    );

    // Raw completion == `gdsllm run -p`.
    let prompt = "The capital of France is";
    let (want, want_prompt, _) = run_greedy(&dir, prompt, 12);
    let body = json!({"model": id, "prompt": prompt, "temperature": 0, "max_tokens": 12});
    let (status, r) = rt.block_on(post(&c, served.url("/v1/completions"), &body));
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["text"], want.as_str());
    assert_eq!(r["usage"]["prompt_tokens"], want_prompt);
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let text = rt.block_on(post_text(&c, served.url("/v1/completions"), &sbody));
    assert_eq!(streamed_text(&text).0, want);

    // Stop string: the greedy text cut before it, finish_reason stop.
    let cut_at = want.char_indices().nth(want.chars().count() / 2).unwrap().0;
    let stop: String = want[cut_at..].chars().take(3).collect();
    let first = want.find(&stop).unwrap();
    let mut stopped = body.clone();
    stopped["stop"] = json!([stop]);
    let (_, r) = rt.block_on(post(&c, served.url("/v1/completions"), &stopped));
    assert_eq!(r["choices"][0]["text"], &want[..first], "stop {stop:?}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");

    // Logprobs: greedy picks the most likely token, alternatives sorted, all <= 0.
    let body = json!({"messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
                      "max_tokens": 4, "logprobs": true, "top_logprobs": 3});
    let (_, r) = rt.block_on(post(&c, served.url("/v1/chat/completions"), &body));
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4, "{r}");
    for entry in content {
        let top: Vec<f64> = entry["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect();
        assert_eq!(top.len(), 3);
        assert!(
            top.windows(2).all(|w| w[0] >= w[1]) && top[0] <= 0.0,
            "{entry}"
        );
        let chosen = entry["logprob"].as_f64().unwrap();
        println!("chosen logprob {chosen}, best alternative {}", top[0]);
        assert!(
            (chosen - top[0]).abs() < 1e-6,
            "greedy chose the top token: {entry}"
        );
        assert_eq!(entry["token"], entry["top_logprobs"][0]["token"]);
    }

    // Seeded sampling is repeatable.
    let body = json!({"prompt": prompt, "temperature": 0.9, "seed": 7, "max_tokens": 8});
    let (_, a) = rt.block_on(post(&c, served.url("/v1/completions"), &body));
    let (_, b) = rt.block_on(post(&c, served.url("/v1/completions"), &body));
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);

    // Embeddings: unit length, float and base64 agree, a paraphrase is closer than code.
    let body = json!({"model": id, "input": ["Paris is the capital of France.",
                      "The capital city of France is Paris.", "fn main() { println!(\"hi\"); }"]});
    let (status, r) = rt.block_on(post(&c, served.url("/v1/embeddings"), &body));
    assert_eq!(status, 200, "{r}");
    let vecs: Vec<Vec<f32>> = r["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    assert_eq!(vecs[0].len(), 576);
    for v in &vecs {
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "norm {norm}");
    }
    let cos = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    println!(
        "cosine paraphrase {} vs code {}",
        cos(&vecs[0], &vecs[1]),
        cos(&vecs[0], &vecs[2])
    );
    let mut b64 = body.clone();
    b64["encoding_format"] = json!("base64");
    let (_, r) = rt.block_on(post(&c, served.url("/v1/embeddings"), &b64));
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(r["data"][1]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(decoded, vecs[1]);

    // Errors.
    let r = rt
        .block_on(
            c.post(served.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .body("{oops")
                .send(),
        )
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(error_message(&rt.block_on(r.json()).unwrap()).contains("JSON"));
    // A bad value, and a value the server does not support: a 400 naming the field.
    for (field, value) in [("max_tokens", json!("many")), ("n", json!(2))] {
        let mut body = json!({"messages": [{"role": "user", "content": "x"}]});
        body[field] = value;
        let (status, r) = rt.block_on(post(&c, served.url("/v1/chat/completions"), &body));
        assert_eq!(
            (status, r["error"]["param"].as_str()),
            (400, Some(field)),
            "{r}"
        );
    }
    let (status, r) = rt.block_on(post(
        &c,
        served.url("/v1/chat/completions"),
        &json!({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
    ));
    assert_eq!(status, 404, "{r}");
    error_message(&r);
    let long = "Paris is lovely. ".repeat(80);
    let (status, r) = rt.block_on(post(
        &c,
        served.url("/v1/completions"),
        &json!({"prompt": long}),
    ));
    assert_eq!(status, 400);
    let msg = error_message(&r);
    let prompt_len = r["error"]["message"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .filter_map(|w| w.parse::<usize>().ok())
        .collect::<Vec<_>>();
    assert!(
        msg.contains("256") && prompt_len.iter().any(|&n| n > 256),
        "{msg}"
    );
    let big = "word ".repeat(20_000);
    let r = rt
        .block_on(
            c.post(served.url("/v1/completions"))
                .json(&json!({"prompt": big}))
                .send(),
        )
        .unwrap();
    assert_eq!(r.status(), 413);
    error_message(&rt.block_on(r.json()).unwrap());

    // Metrics saw it all, including residency's bytes.
    let text = rt.block_on(async {
        c.get(served.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    assert_eq!(
        metric(
            &text,
            "gdsllm_requests_total{endpoint=\"/v1/chat/completions\",status=\"404\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        metric(
            &text,
            "gdsllm_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}"
        )
        .unwrap()
            >= 3.0
    );
    assert!(
        metric(&text, "gdsllm_generation_tokens_total").unwrap() > 40.0,
        "{text}"
    );
    assert!(
        metric(&text, "gdsllm_weight_bytes_total{tier=\"disk\"}").unwrap() > 1e6,
        "{text}"
    );
    assert!(
        metric(&text, "gdsllm_forward_passes_total").unwrap() > 40.0,
        "{text}"
    );
    let (ok, stderr) = served.terminate();
    assert!(ok, "{stderr}");
}

#[test]
fn auth_aliases_and_system_prompt_from_flags_and_env_then_sigterm() {
    let Some(dir) = model_dir() else { return };
    let keys = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(keys.path(), "# team keys\nsecret-from-file\n").unwrap();
    let served = Served::start(
        &dir,
        &["--api-key", "secret-flag", "--alias", "gpt-4o-mini"],
        &[
            ("GDSLLM_API_KEY_FILE", keys.path().to_str().unwrap()),
            ("GDSLLM_SYSTEM_PROMPT", "Always answer in French."),
            ("GDSLLM_CTX_SIZE", "512"),
        ],
    );
    let rt = runtime();
    let c = reqwest::Client::new();
    rt.block_on(async {
        assert_eq!(c.get(served.url("/health")).send().await.unwrap().status(), 200);
        let r = c.get(served.url("/v1/models")).send().await.unwrap();
        assert_eq!(r.status(), 401);
        let r = c.get(served.url("/v1/models")).bearer_auth("wrong").send().await.unwrap();
        assert_eq!(r.status(), 401);
        for key in ["secret-flag", "secret-from-file"] {
            let r = c.get(served.url("/v1/models")).bearer_auth(key).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["data"][1]["id"], "gpt-4o-mini");
        }
        // The system prompt goes in when the chat has none: same as sending it explicitly.
        let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 12});
        let r: Value = c.post(served.url("/v1/chat/completions")).bearer_auth("secret-flag").json(&body).send().await.unwrap().json().await.unwrap();
        let explicit = json!({"messages": [{"role": "system", "content": "Always answer in French."}, {"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 12});
        let e: Value = c.post(served.url("/v1/chat/completions")).bearer_auth("secret-flag").json(&explicit).send().await.unwrap().json().await.unwrap();
        assert_eq!(r["model"], "gpt-4o-mini");
        assert_eq!(r["choices"][0]["message"]["content"], e["choices"][0]["message"]["content"]);
        assert_eq!(r["usage"]["prompt_tokens"], e["usage"]["prompt_tokens"]);
        // GDSLLM_CTX_SIZE applied: a 600-token prompt is over the 512 context.
        let long = "Paris is lovely. ".repeat(150);
        let r = c.post(served.url("/v1/completions")).bearer_auth("secret-flag").json(&json!({"prompt": long})).send().await.unwrap();
        assert_eq!(r.status(), 400);
        assert!(r.text().await.unwrap().contains("512"));
    });
    let (ok, stderr) = served.terminate();
    assert!(ok, "exit after SIGTERM: {stderr}");
    assert!(stderr.contains("SIGTERM"), "{stderr}");
    for key in ["secret-flag", "secret-from-file", "wrong"] {
        assert!(!stderr.contains(key), "a key leaked into the log: {stderr}");
    }
}

#[test]
fn concurrent_streams_equal_solo_output_and_disconnects_cancel() {
    let Some(dir) = model_dir() else { return };
    let served = Served::start(&dir, &["-c", "256"], &[]);
    let rt = runtime();
    let c = reqwest::Client::new();
    let questions: Vec<String> = (0..16)
        .map(|i| format!("Give me one fact about the number {i}."))
        .collect();
    let body = |q: &str, stream: bool| json!({"messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 6, "stream": stream});
    let solo: Vec<String> = questions
        .iter()
        .map(|q| {
            let (_, r) = rt.block_on(post(
                &c,
                served.url("/v1/chat/completions"),
                &body(q, false),
            ));
            r["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let started = std::time::Instant::now();
    let results: Vec<(usize, Result<String, String>)> = rt.block_on(async {
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let c = c.clone();
                let url = served.url("/v1/chat/completions");
                let b = body(&questions[i % questions.len()], true);
                tokio::spawn(async move {
                    let r = c
                        .post(url)
                        .json(&b)
                        .send()
                        .await
                        .map_err(|e| e.to_string())?;
                    if r.status() != 200 {
                        return Err(format!("status {}", r.status()));
                    }
                    let text = r.text().await.map_err(|e| e.to_string())?;
                    Ok(streamed_text(&text).0)
                })
            })
            .collect();
        let mut out = Vec::new();
        for (i, t) in tasks.into_iter().enumerate() {
            out.push((i, t.await.unwrap()));
        }
        out
    });
    let errors = results.iter().filter(|(_, r)| r.is_err()).count();
    println!(
        "64 concurrent streams: {errors} errors in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(errors, 0, "{results:?}");
    for (i, r) in &results {
        assert_eq!(
            r.as_ref().unwrap(),
            &solo[i % questions.len()],
            "request {i}"
        );
    }

    // A client that hangs up mid-stream: its sequence is cancelled (visible in /metrics).
    rt.block_on(async {
        let mut b = body("Write a long story about a dragon.", true);
        b["max_tokens"] = json!(200);
        let mut r = c
            .post(served.url("/v1/chat/completions"))
            .json(&b)
            .send()
            .await
            .unwrap();
        let mut seen = String::new();
        while !seen.contains("\"content\":\"") || seen.matches("data:").count() < 3 {
            seen.push_str(&String::from_utf8_lossy(&r.chunk().await.unwrap().unwrap()));
        }
        drop(r);
        let mut cancelled = None;
        for _ in 0..200 {
            let text = c
                .get(served.url("/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            cancelled = metric(&text, "gdsllm_requests_cancelled_total");
            if cancelled == Some(1.0) && metric(&text, "gdsllm_requests_running") == Some(0.0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(cancelled, Some(1.0));
        let text = c
            .get(served.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(
            metric(&text, "gdsllm_requests_running"),
            Some(0.0),
            "{text}"
        );
    });
    let (ok, stderr) = served.terminate();
    assert!(ok, "{stderr}");
}
