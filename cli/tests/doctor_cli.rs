//! `gdsllm doctor` and `gdsllm bench-io` as a user runs them: exit status and JSON shape.

use std::process::Command;

fn gdsllm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gdsllm"))
}

#[test]
fn doctor_exits_zero_and_reports_json() {
    let home = tempfile::tempdir().unwrap();
    let out = gdsllm()
        .args(["doctor", "--json", "--probe-mib", "4", "--home"])
        .arg(home.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "doctor failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    for key in [
        "summary",
        "gpu",
        "libraries",
        "cufile",
        "nvidia_fs",
        "p2pdma",
        "compat_mode",
        "model_store",
        "backends",
    ] {
        assert!(report.get(key).is_some(), "missing {key} in {report}");
    }
    let gpu = report["gpu"]["available"].as_bool().unwrap();
    if !gpu {
        assert_eq!(report["summary"], "no GPU: CPU backend only");
        assert!(
            report["gpu"]["error"]
                .as_str()
                .unwrap()
                .contains("LD_LIBRARY_PATH")
        );
    }
    assert_eq!(report["model_store"]["path"], home.path().to_str().unwrap());
    assert!(report["model_store"]["o_direct"].is_boolean());
    let backends = report["backends"].as_array().unwrap();
    let host = backends
        .iter()
        .find(|b| b["name"] == "host")
        .expect("host backend row");
    assert_eq!(host["available"], true);
    assert!(host["gbps"].as_f64().unwrap() > 0.0);
    // The probe file is removed again.
    assert_eq!(std::fs::read_dir(home.path()).unwrap().count(), 0);
}

#[test]
fn doctor_text_output_says_what_it_found() {
    let home = tempfile::tempdir().unwrap();
    let out = gdsllm()
        .args(["doctor", "--probe-mib", "0", "--home"])
        .arg(home.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["GPU:", "cuFile:", "nvidia-fs:", "O_DIRECT:"] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
}

#[test]
fn bench_io_reads_a_directory_of_blobs_and_reports_ratios() {
    let dir = tempfile::tempdir().unwrap();
    for (name, len) in [
        ("layer_000.bin", 3 << 20),
        ("layer_001.bin", (2 << 20) + 123),
    ] {
        std::fs::write(dir.path().join(name), vec![0x5au8; len]).unwrap();
    }
    let out = gdsllm()
        .args(["bench-io", "--json", "--io", "host", "-m"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench-io failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["files"], 2);
    assert_eq!(report["bytes"], (3 << 20) + (2 << 20) + 123);
    assert!(report["raw_gbps"].as_f64().unwrap() > 0.0);
    let backends = report["backends"].as_array().unwrap();
    let host = backends
        .iter()
        .find(|b| b["name"] == "host")
        .expect("host row");
    assert!(host["ratio"].as_f64().unwrap() > 0.0);
    assert_eq!(host["per_blob"].as_array().unwrap().len(), 2);
}

#[test]
fn bench_io_rejects_a_bad_backend_name_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = gdsllm()
        .args(["bench-io", "--io", "warp", "-m"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--io") && stderr.contains("warp"),
        "{stderr}"
    );
}
