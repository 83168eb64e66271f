//! `gdsllm plan` shows the placement (issue 24): measured once per machine into
//! `$GDSLLM_HOME/calibration.json`, used again, measured again with `--calibrate`; on a machine
//! without a GPU every matmul is the CPU's (on one with a GPU, the same test checks the GPU's
//! figures were measured and the plan is for CUDA).

use std::path::Path;
use std::process::Command;

use gdsllm_convert::synth::{SynthOptions, SynthShape, synth};
use weights_format::DType;

fn synth_model(dir: &Path) {
    let shape = SynthShape::new(2, 256, 512, 4, 2, 512, 256);
    let opts = SynthOptions {
        shape,
        dtype: DType::Q8_0,
        seed: 3,
        threads: 1,
        shape_name: "plan-test".into(),
    };
    synth(dir, &opts, &mut |_| {}).expect("synth");
}

/// `gdsllm plan --json` on `model` with `home` as `$GDSLLM_HOME` and 2 CPU threads: its JSON
/// and stderr.
fn plan(home: &Path, model: &Path, extra: &[&str]) -> (serde_json::Value, String) {
    plan_on_threads(home, model, 2, extra)
}

fn plan_on_threads(
    home: &Path,
    model: &Path,
    threads: u32,
    extra: &[&str],
) -> (serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gdsllm"))
        .env("GDSLLM_HOME", home)
        .env("RUST_LOG", "info")
        .args(["plan", "--json", "--probe-mib", "1", "--cpu-threads"])
        .arg(threads.to_string())
        .arg("-m")
        .arg(model)
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    (serde_json::from_slice(&out.stdout).unwrap(), stderr)
}

#[test]
fn plan_places_every_matmul_on_the_cpu_without_a_gpu_and_keeps_its_calibration() {
    let gpu = llama::backend::cuda::cuda_usable().is_ok();
    let tmp = tempfile::tempdir().unwrap();
    let (home, model) = (tmp.path().join("home"), tmp.path().join("m"));
    synth_model(&model);

    let (json, stderr) = plan(&home, &model, &[]);
    assert!(stderr.contains("calibrating"), "{stderr}");
    let cal_path = home.join("calibration.json");
    let stored: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cal_path).unwrap()).unwrap();
    assert_eq!(stored, json["calibration"]);
    assert_eq!(stored["cpu_threads"], 2);
    assert_eq!(stored["gpu"].is_null(), !gpu, "{stored}");
    let rates = stored["cpu"].as_array().unwrap();
    assert_eq!(rates.len(), 1, "{stored}");
    assert_eq!(rates[0]["dtype"], "q8_0", "{stored}");
    assert!(stored["disk_gbps"].as_f64().unwrap() > 0.0);
    // An explicit probe size is the CPU's probe too; the file says so.
    assert_eq!(stored["cpu_probe_bytes"], 1 << 20, "{stored}");
    assert!(rates[0]["gbps_32"].as_f64().unwrap() > 0.0, "{stored}");

    // The residency plan shown is the one a run on the GPU has: it reserves what the loader
    // reserves (KV caches, activations, its margin), not the KV caches alone.
    let config = weights_format::Model::open(&model)
        .unwrap()
        .metadata()
        .config
        .clone();
    let loader = llama::load::gpu_reserved_bytes(&config, 256, 1).unwrap();
    assert_eq!(json["reserved_bytes"], loader, "{json}");
    assert!(loader > residency::kv_cache_bytes(&config, 256, 2));

    let placement = &json["placement"];
    assert_eq!(placement["device"], if gpu { "cuda" } else { "cpu" });
    let passes = placement["passes"].as_array().unwrap();
    let kinds: Vec<&serde_json::Value> = passes.iter().map(|p| &p["pass"]).collect();
    assert_eq!(
        kinds,
        [
            &serde_json::json!({"kind": "decode", "batch": 1}),
            &serde_json::json!({"kind": "decode", "batch": 8}),
            &serde_json::json!({"kind": "decode", "batch": 32}),
            &serde_json::json!({"kind": "prefill", "rows": 512}),
        ],
        "{placement}"
    );
    for p in passes {
        let units = p["units"].as_array().unwrap();
        assert_eq!(units.len(), 3, "2 layers and the head: {p}");
        for u in units.iter().filter(|_| !gpu) {
            assert_eq!(u["tier"], "ram", "{u}");
            assert_eq!(u["cpu_share"], 1.0, "{u}");
            assert_eq!(u["gpu_bytes"], 0, "{u}");
        }
        assert!(p["tokens_per_s"].as_f64().unwrap() > 0.0, "{p}");
    }

    // Kept: the second plan measures nothing.
    let (again, stderr) = plan(&home, &model, &[]);
    assert!(!stderr.contains("calibrating"), "{stderr}");
    assert_eq!(again["calibration"], stored);
    // --calibrate measures again.
    let (measured_again, stderr) = plan(&home, &model, &["--calibrate"]);
    assert!(stderr.contains("calibrating"), "{stderr}");
    let stored = &measured_again["calibration"];
    // Another thread count measures the CPU's figures again and keeps the disk's.
    let (json, stderr) = plan_on_threads(&home, &model, 1, &[]);
    assert!(stderr.contains("calibrating: the CPU"), "{stderr}");
    assert!(!stderr.contains("disk reads"), "{stderr}");
    assert_eq!(json["calibration"]["cpu_threads"], 1);
    assert_eq!(json["calibration"]["disk_gbps"], stored["disk_gbps"]);
    let stored_now: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cal_path).unwrap()).unwrap();
    assert_eq!(stored_now["cpu_threads"], 1);
    assert_eq!(
        stored_now["cpu"].as_array().map(Vec::len),
        Some(1),
        "{stored_now}"
    );
}

#[test]
fn a_broken_calibration_file_is_measured_again() {
    let tmp = tempfile::tempdir().unwrap();
    let (home, model) = (tmp.path().join("home"), tmp.path().join("m"));
    synth_model(&model);
    std::fs::create_dir_all(&home).unwrap();
    std::fs::write(home.join("calibration.json"), "{ not json").unwrap();
    let (json, stderr) = plan(&home, &model, &[]);
    assert!(stderr.contains("measuring again"), "{stderr}");
    assert_eq!(
        json["calibration"]["version"],
        residency::CALIBRATION_VERSION
    );
}
