//! Hostile inputs against the `gdsllm` binary, as an attacker would send them: corrupted model
//! directories (metadata.json numbers with and without a matching checksum, flipped blob
//! bits, FIFOs, directories and symlinks where files belong), corrupted GGUF tensor tables,
//! and half-open HTTP connections. Every command's outcome is classified as a clear error,
//! the same output as the intact input, an abort (signal or panic), a hang (past a time
//! limit) or a different output; only the first two are allowed.
//!
//! CI runs a few cases per family (deterministic seeds); `scripts/hostile-inputs.sh` runs
//! many with `GDSLLM_HOSTILE_CASES`, `GDSLLM_HOSTILE_SEED` and `GDSLLM_BIN` (the release
//! binary) and collects the `HOSTILE|` table rows this file prints.

use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gdsllm_convert::testing::XorShift;
use serde_json::Value;

/// Longest a command may take before it counts as a hang. Generous: the machine is shared.
const LIMIT: Duration = Duration::from_secs(60);

fn cases() -> u64 {
    std::env::var("GDSLLM_HOSTILE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12)
}

fn base_seed() -> u64 {
    std::env::var("GDSLLM_HOSTILE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn gdsllm() -> Command {
    let bin = std::env::var_os("GDSLLM_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_gdsllm")));
    let mut c = Command::new(bin);
    for (k, _) in std::env::vars() {
        if k.starts_with("GDSLLM_") && k != "GDSLLM_HOME" {
            c.env_remove(k);
        }
    }
    c.env("RUST_LOG", "warn");
    c
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    ClearError,
    Same,
    Abort,
    Hang,
    Different,
}

impl Outcome {
    fn bad(self) -> bool {
        matches!(self, Outcome::Abort | Outcome::Hang | Outcome::Different)
    }
}

/// What a finished (or killed) command left.
struct Ran {
    status: Option<std::process::ExitStatus>,
    stdout: Vec<u8>,
    stderr: String,
}

/// Runs `cmd` with a time limit; a command still running at the limit is killed.
fn run_limited(mut cmd: Command) -> Ran {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning gdsllm");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Ran {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Classifies a run; `same` says whether a successful run's stdout matches the reference.
fn classify(ran: &Ran, same: impl Fn(&[u8]) -> bool) -> Outcome {
    let Some(status) = ran.status else {
        return Outcome::Hang;
    };
    if status.signal().is_some() || ran.stderr.contains("panicked") || status.code() == Some(101) {
        return Outcome::Abort;
    }
    if status.success() {
        return if same(&ran.stdout) {
            Outcome::Same
        } else {
            Outcome::Different
        };
    }
    if ran.stderr.trim().is_empty() {
        // A failure that says nothing is not a clear error.
        return Outcome::Abort;
    }
    Outcome::ClearError
}

/// The worst of several outcomes of one case.
fn worst(outcomes: &[Outcome]) -> Outcome {
    let rank = |o: &Outcome| match o {
        Outcome::Same => 0,
        Outcome::ClearError => 1,
        Outcome::Different => 2,
        Outcome::Hang => 3,
        Outcome::Abort => 4,
    };
    *outcomes.iter().max_by_key(|o| rank(o)).unwrap()
}

/// Counts of one attack family, printed as a table row.
struct Tally {
    family: &'static str,
    counts: [u64; 5],
    failures: Vec<String>,
}

impl Tally {
    fn new(family: &'static str) -> Tally {
        Tally {
            family,
            counts: [0; 5],
            failures: Vec::new(),
        }
    }

    fn add(&mut self, outcome: Outcome, what: impl FnOnce() -> String) {
        let i = match outcome {
            Outcome::ClearError => 0,
            Outcome::Same => 1,
            Outcome::Abort => 2,
            Outcome::Hang => 3,
            Outcome::Different => 4,
        };
        self.counts[i] += 1;
        if outcome.bad() {
            self.failures.push(format!("{outcome:?}: {}", what()));
        }
    }

    /// Prints the row and fails the test on any abort, hang or different output.
    fn finish(self) {
        let [error, same, abort, hang, different] = self.counts;
        println!(
            "HOSTILE| {} | {} | {error} | {same} | {abort} | {hang} | {different} |",
            self.family,
            self.counts.iter().sum::<u64>()
        );
        assert!(
            self.failures.is_empty(),
            "{}: {} bad outcomes:\n{}",
            self.family,
            self.failures.len(),
            self.failures.join("\n")
        );
    }
}

/// A small untied model with random weights (the embedding is read in pieces, every other
/// blob whole), written once per test.
fn tiny_model(tmp: &Path) -> PathBuf {
    let dir = tmp.join("tiny");
    let ran = run_limited({
        let mut c = gdsllm();
        c.args([
            "synth",
            "--shape",
            "custom",
            "--layers",
            "2",
            "--dim",
            "64",
            "--ffn",
            "128",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--vocab",
            "320",
            "--dtype",
            "q8_0",
        ])
        .arg(&dir);
        c
    });
    assert!(
        ran.status.is_some_and(|s| s.success()),
        "synth: {}",
        ran.stderr
    );
    dir
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

fn run_cmd(dir: &Path) -> Command {
    run_cmd_context(dir, "64")
}

fn run_cmd_context(dir: &Path, context: &str) -> Command {
    let mut c = gdsllm();
    c.args(["run", "-m"]).arg(dir).args([
        "-p",
        "hello world",
        "--temp",
        "0",
        "-n",
        "8",
        "-c",
        context,
        "--json",
        "--device",
        "cpu",
    ]);
    c
}

fn verify_cmd(dir: &Path, update: bool) -> Command {
    let mut c = gdsllm();
    c.arg("verify").arg(dir);
    if update {
        c.arg("--update-metadata-checksum");
    }
    c
}

/// What of `gdsllm run --json` must not change: the tokens and the text.
fn run_key(stdout: &[u8]) -> Option<(Value, Value)> {
    let v: Value = serde_json::from_slice(stdout).ok()?;
    Some((v["tokens"].clone(), v["text"].clone()))
}

struct Reference {
    _tmp: tempfile::TempDir,
    model: PathBuf,
    key: (Value, Value),
}

fn reference() -> Reference {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path());
    let ran = run_limited(run_cmd(&model));
    assert!(
        ran.status.is_some_and(|s| s.success()),
        "the intact model does not run: {}",
        ran.stderr
    );
    let key = run_key(&ran.stdout).expect("run --json prints JSON");
    Reference {
        _tmp: tmp,
        model,
        key,
    }
}

/// Runs `run` (and `verify`) on `dir` and classifies both against the reference.
fn judge_model(reference: &Reference, dir: &Path) -> Outcome {
    let run = classify(&run_limited(run_cmd(dir)), |out| {
        run_key(out).as_ref() == Some(&reference.key)
    });
    let verify = classify(&run_limited(verify_cmd(dir, false)), |_| true);
    worst(&[run, verify])
}

/// JSON pointers of every number in `v`.
fn number_pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Number(_) => out.push(at),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                number_pointers(item, format!("{at}/{i}"), out);
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                number_pointers(item, format!("{at}/{k}"), out);
            }
        }
        _ => {}
    }
}

/// Whether a pointer names a size (what a checksum-aware attacker changes to break bounds).
fn is_size(pointer: &str) -> bool {
    let parts: Vec<&str> = pointer.split('/').collect();
    match parts.as_slice() {
        ["", "config", key] => [
            "n_layers",
            "hidden_size",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_dim",
            "vocab_size",
            "context_length",
        ]
        .contains(key),
        ["", "blobs", _, "length"] => true,
        ["", "blobs", _, "tensors", _, "offset" | "length"] => true,
        ["", "blobs", _, "tensors", _, "shape", _] => true,
        _ => false,
    }
}

/// A new value for the number at `pointer`: the extremes that break parsers and allocators
/// most often, more likely than random ones.
fn extreme(rng: &mut XorShift, original: &Value) -> Value {
    let n = original.as_u64().unwrap_or(1);
    let choices = [
        Value::from(0u64),
        Value::from(1u64),
        Value::from(2u64),
        Value::from(4095u64),
        Value::from(4096u64),
        Value::from(4097u64),
        Value::from(u64::from(u32::MAX) - 1),
        Value::from(u32::MAX),
        Value::from(u64::from(u32::MAX) + 1),
        Value::from(i64::MAX),
        Value::from(u64::MAX),
        Value::from(-1i64),
        Value::from(n.wrapping_add(1)),
        Value::from(n.saturating_sub(1)),
        Value::from(n.wrapping_mul(2)),
        Value::from(n / 2),
        Value::from(100_000_000u64),
        serde_json::json!(1e30),
        serde_json::json!(0.5),
        Value::from(rng.next_u64() as u32),
    ];
    choices[rng.below(choices.len() as u64) as usize].clone()
}

/// Writes metadata.json of `dir` with the number at a pointer chosen by `rng` (among those
/// `filter` accepts) replaced; returns a description.
fn mutate_metadata(dir: &Path, rng: &mut XorShift, filter: fn(&str) -> bool) -> String {
    let path = dir.join("metadata.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let mut pointers = Vec::new();
    number_pointers(&v, String::new(), &mut pointers);
    pointers.retain(|p| filter(p));
    let pointer = &pointers[rng.below(pointers.len() as u64) as usize];
    let slot = v.pointer_mut(pointer).unwrap();
    let value = extreme(rng, slot);
    let what = format!("{pointer}: {slot} -> {value}");
    *slot = value;
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    what
}

#[test]
fn metadata_numbers_with_the_checksum_kept() {
    let reference = reference();
    let tmp = tempfile::tempdir().unwrap();
    let mut tally = Tally::new("metadata.json numbers (checksum kept)");
    for case in 0..cases() {
        let seed = base_seed() ^ case;
        let dir = tmp.path().join(format!("a{case}"));
        copy_dir(&reference.model, &dir);
        let what = mutate_metadata(&dir, &mut XorShift::new(seed), |_| true);
        let outcome = judge_model(&reference, &dir);
        tally.add(outcome, || format!("seed {seed}: {what}"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
    tally.finish();
}

#[test]
fn metadata_sizes_with_the_checksum_rewritten() {
    let reference = reference();
    let tmp = tempfile::tempdir().unwrap();
    let mut tally = Tally::new("metadata.json sizes (checksum rewritten)");
    for case in 0..cases() {
        let seed = base_seed() ^ (case << 20);
        let dir = tmp.path().join(format!("b{case}"));
        copy_dir(&reference.model, &dir);
        let what = mutate_metadata(&dir, &mut XorShift::new(seed), is_size);
        // What an attacker who knows the format does: make the side file match again. The
        // command validates the directory first, so it is judged too.
        let update = classify(&run_limited(verify_cmd(&dir, true)), |_| true);
        let outcome = worst(&[update, judge_model(&reference, &dir)]);
        tally.add(outcome, || format!("seed {seed}: {what}"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
    tally.finish();
}

#[test]
fn flipped_blob_bits() {
    let reference = reference();
    let tmp = tempfile::tempdir().unwrap();
    let mut tally = Tally::new("blob bytes (one bit flipped)");
    let blobs: Vec<String> = std::fs::read_dir(&reference.model)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".bin"))
        .collect();
    for case in 0..cases() {
        let seed = base_seed() ^ (case << 40);
        let mut rng = XorShift::new(seed);
        let dir = tmp.path().join(format!("c{case}"));
        copy_dir(&reference.model, &dir);
        let blob = &blobs[rng.below(blobs.len() as u64) as usize];
        let path = dir.join(blob);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = rng.below(bytes.len() as u64) as usize;
        let bit = 1u8 << rng.below(8);
        bytes[at] ^= bit;
        std::fs::write(&path, bytes).unwrap();
        // With checking on, a flipped bit must be an error, never a different text.
        let outcome = judge_model(&reference, &dir);
        let outcome = if outcome == Outcome::Same {
            Outcome::Different
        } else {
            outcome
        };
        tally.add(outcome, || {
            format!("seed {seed}: {blob} byte {at} ^= {bit:#04x}")
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }
    tally.finish();
}

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo").arg(path).status().unwrap().success();
    assert!(ok, "mkfifo {}", path.display());
}

#[test]
fn special_files_and_symlinks() {
    let reference = reference();
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    copy_dir(&reference.model, &outside);
    let mut tally = Tally::new("FIFOs, directories, symlinks out, garbage side files");
    type Attack = Box<dyn Fn(&Path)>;
    let replace = |name: &'static str, make: fn(&Path)| -> (String, Attack) {
        (
            format!("{name}: replaced"),
            Box::new(move |dir: &Path| {
                let path = dir.join(name);
                let _ = std::fs::remove_file(&path);
                make(&path);
            }),
        )
    };
    let mut attacks: Vec<(String, Attack)> = Vec::new();
    for name in [
        "metadata.json",
        "metadata.json.xxh3",
        "tokenizer.json",
        "chat_template.jinja",
        "layer_000.bin",
        "embed.bin",
    ] {
        attacks.push(replace(name, mkfifo));
        attacks.push(replace(name, |p| std::fs::create_dir(p).unwrap()));
        let target = outside.join(name);
        attacks.push((
            format!("{name}: symlink out of the directory"),
            Box::new(move |dir: &Path| {
                let path = dir.join(name);
                std::fs::remove_file(&path).unwrap();
                std::os::unix::fs::symlink(&target, &path).unwrap();
            }),
        ));
        attacks.push(replace(name, |p| {
            std::fs::write(p, b"\xff\xfe garbage").unwrap()
        }));
        attacks.push(replace(name, |p| std::fs::write(p, b"").unwrap()));
    }
    attacks.push(replace("metadata.json.xxh3", |_| {}));
    for (what, attack) in &attacks {
        let dir = tmp.path().join("d");
        copy_dir(&reference.model, &dir);
        attack(&dir);
        let outcome = judge_model(&reference, &dir);
        tally.add(outcome, || what.clone());
        std::fs::remove_dir_all(&dir).unwrap();
    }
    tally.finish();
}

#[test]
fn gguf_tensor_tables_through_convert() {
    use gdsllm_convert::testing::{TableMutation, TinyLlama, dir_files as files, tensor_infos_at};
    let tmp = tempfile::tempdir().unwrap();
    let builder = TinyLlama::new(11, false).gguf(weights_format::DType::Q8_0);
    let bytes = builder.to_bytes();
    let names = builder.tensor_names();
    let infos = tensor_infos_at(&bytes, &names);
    let convert = |input: &Path, out: &Path| {
        let mut c = gdsllm();
        c.arg("convert").arg(input).arg(out);
        run_limited(c)
    };
    let input = tmp.path().join("model.gguf");
    std::fs::write(&input, &bytes).unwrap();
    let reference_dir = tmp.path().join("reference");
    let ran = convert(&input, &reference_dir);
    assert!(ran.status.is_some_and(|s| s.success()), "{}", ran.stderr);
    let reference_files = files(&reference_dir);
    let mut tally = Tally::new("GGUF tensor tables (convert)");
    for case in 0..cases() {
        let seed = base_seed() ^ (case << 50);
        let mutation = TableMutation::from_seed(seed, &infos);
        let mut mutated = bytes.clone();
        mutation.apply(&mut mutated, &infos);
        let case_dir = tmp.path().join(format!("e{case}"));
        std::fs::create_dir(&case_dir).unwrap();
        let input = case_dir.join("model.gguf");
        std::fs::write(&input, &mutated).unwrap();
        let out = case_dir.join("out");
        let ran = convert(&input, &out);
        let outcome = classify(&ran, |_| files(&out) == reference_files);
        tally.add(outcome, || format!("seed {seed}: {mutation:?}"));
        std::fs::remove_dir_all(&case_dir).unwrap();
    }
    tally.finish();
}

/// `gdsllm serve` under an open-file limit of 256 (so that a few hundred sockets would exhaust
/// it), flooded with half-open connections (`GET / HTTP/1.1\r\nX: ` and then silence):
/// `/health` still answers within a second, every time.
#[test]
fn half_open_connections_do_not_starve_health() {
    let half_open: usize = std::env::var("GDSLLM_HALF_OPEN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path());
    let bin = gdsllm().get_program().to_owned();
    let mut serve = Command::new("sh");
    serve
        .arg("-c")
        .arg("ulimit -n 256 && exec \"$0\" serve -m \"$1\" --port 0 --device cpu --max-batch 2")
        .arg(&bin)
        .arg(&model)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = serve.spawn().unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut first).unwrap();
    let base = first.trim().to_string();
    assert!(base.starts_with("http://127.0.0.1:"), "{first:?}");
    let addr = base.trim_start_matches("http://").to_string();
    let health = || -> Result<u16, String> {
        let mut s = std::net::TcpStream::connect(&addr).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .map_err(|e| e.to_string())?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).map_err(|e| e.to_string())?;
        answer
            .get(9..12)
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| format!("no status line in {answer:?}"))
    };
    let ready = Instant::now() + Duration::from_secs(60);
    while health() != Ok(200) {
        assert!(Instant::now() < ready, "the server never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut sockets = Vec::new();
    let mut checked = 0;
    for i in 0..half_open {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        // The write may fail once the server has closed the socket; that is its right.
        let _ = s.write_all(b"GET / HTTP/1.1\r\nX: ");
        sockets.push(s);
        if (i + 1) % 100 == 0 {
            assert_eq!(health(), Ok(200), "after {} half-open connections", i + 1);
            checked += 1;
        }
    }
    assert_eq!(health(), Ok(200), "after {half_open} half-open connections");
    println!(
        "HOSTILE| half-open HTTP connections | {} | 0 | {} | 0 | 0 | 0 |",
        checked + 1,
        checked + 1
    );
    drop(sockets);
    let _ = child.kill();
    let _ = child.wait();
}

/// Sizes no blob bounds: a model claiming an absurd context, run at its full context (`-c 0`).
/// Caches are sized from the context asked for, so this must be a clear error about memory
/// (or work), never an allocation abort.
#[test]
fn absurd_context_lengths_at_full_context() {
    let reference = reference();
    let tmp = tempfile::tempdir().unwrap();
    let mut tally = Tally::new("context_length extremes at -c 0");
    for context in [
        u64::from(u32::MAX),
        u64::from(u32::MAX) - 1,
        1 << 31,
        100_000_000,
        10_000_000,
    ] {
        let dir = tmp.path().join(format!("ctx{context}"));
        copy_dir(&reference.model, &dir);
        let path = dir.join("metadata.json");
        let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        v["config"]["context_length"] = Value::from(context);
        std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
        let update = classify(&run_limited(verify_cmd(&dir, true)), |_| true);
        let run = classify(&run_limited(run_cmd_context(&dir, "0")), |out| {
            run_key(out).as_ref() == Some(&reference.key)
        });
        tally.add(worst(&[update, run]), || {
            format!("context_length {context}")
        });
    }
    tally.finish();
}

/// `verify` loads the tokenizer and renders the chat template as `run` would, naming either
/// when it is broken, and accepts a deliberate metadata edit only when asked to.
#[test]
fn verify_checks_tokenizer_template_and_metadata_edits() {
    let reference = reference();
    let tmp = tempfile::tempdir().unwrap();
    let verify_json = |dir: &Path| -> (bool, Value, String) {
        let mut c = verify_cmd(dir, false);
        c.arg("--json");
        let ran = run_limited(c);
        let ok = ran.status.is_some_and(|s| s.success());
        let v = serde_json::from_slice(&ran.stdout).unwrap_or(Value::Null);
        (ok, v, ran.stderr)
    };
    let (ok, v, stderr) = verify_json(&reference.model);
    assert!(ok, "{stderr}");
    assert_eq!(v["tokenizer"]["ok"], true, "{v}");
    assert_eq!(v["chat_template"]["ok"], true, "{v}");

    let dir = tmp.path().join("tok");
    copy_dir(&reference.model, &dir);
    std::fs::write(
        dir.join("tokenizer.json"),
        br#"{"model": {"type": "Nonsense"}}"#,
    )
    .unwrap();
    let (ok, v, stderr) = verify_json(&dir);
    println!("{stderr}");
    assert!(!ok && stderr.contains("tokenizer"), "{stderr}");
    assert_eq!(v["tokenizer"]["ok"], false, "{v}");
    assert_eq!(v["ok"], false, "{v}");

    let dir = tmp.path().join("template");
    copy_dir(&reference.model, &dir);
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.",
    )
    .unwrap();
    let (ok, v, stderr) = verify_json(&dir);
    println!("{stderr}");
    assert!(!ok && stderr.contains("chat template"), "{stderr}");
    assert_eq!(v["chat_template"]["ok"], false, "{v}");

    let dir = tmp.path().join("edit");
    copy_dir(&reference.model, &dir);
    let path = dir.join("metadata.json");
    let mut meta: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    meta["source"]["note"] = Value::from("edited by hand");
    std::fs::write(&path, serde_json::to_vec_pretty(&meta).unwrap()).unwrap();
    let (ok, _, stderr) = verify_json(&dir);
    assert!(
        !ok && stderr.contains("--update-metadata-checksum"),
        "{stderr}"
    );
    let ran = run_limited(verify_cmd(&dir, true));
    assert!(ran.status.is_some_and(|s| s.success()), "{}", ran.stderr);
    let run = run_limited(run_cmd(&dir));
    assert_eq!(
        run_key(&run.stdout),
        Some(reference.key.clone()),
        "{}",
        run.stderr
    );
}
