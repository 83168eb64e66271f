//! Pull throughput from the loopback test server against `curl` of the same file, in one run:
//! `cargo run --release -p gdsllm-fetch --features testing --example loopback_pull -- FILE [ROUNDS]`.
//! Both write the file into a temporary directory beside FILE's (curl with `-o`, ours through
//! `download`, which also hashes it with sha256 and checks the server's Repr-Digest); the best
//! of ROUNDS (default 3) runs each is printed, and their ratio, then the same as one line of
//! `key=value` for scripts (`pull-bench bytes=… curl_gbps=… ours_gbps=… ratio=…`).
//!
//! `loopback_pull --stages FILE [ROUNDS]` times each stage of a download alone instead (best
//! of ROUNDS each): sha256 of the file in memory, sha256 of as many bytes from one piece that
//! stays in the CPU's cache, writing the file to a new file, the socket read (`Client::transfer` into a sink that drops the bytes) and `curl -o
//! /dev/null` of the same URL.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use gdsllm_fetch::testing::{Content, TestServer};
use gdsllm_fetch::{Client, ClientOptions, DownloadOptions, NoProgress, Sink, download};
use sha2::Digest;

const USAGE: &str = "usage: loopback_pull [--stages] FILE [ROUNDS]";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let stages = args.first().is_some_and(|a| a == "--stages");
    if stages {
        args.remove(0);
    }
    let file = PathBuf::from(args.first().ok_or(USAGE)?);
    let rounds: usize = args.get(1).map_or(Ok(3), |r| r.parse())?;
    if rounds == 0 {
        return Err(USAGE.into());
    }
    let size = std::fs::metadata(&file)?.len();
    let server = TestServer::start();
    server.add_file_with_digest("file", Content::File(file.clone()));
    let url = format!("{}/file", server.url());
    let out = tempfile::tempdir_in(file.parent().unwrap_or(Path::new(".")))?;
    let gbps = |seconds: f64| size as f64 / seconds / 1e9;
    if stages {
        return time_stages(&file, &url, out.path(), rounds, gbps);
    }
    let dest = out.path().join("pulled");
    let (mut best_curl, mut best_ours) = (f64::INFINITY, f64::INFINITY);
    let client = Client::new(ClientOptions::default());
    for _ in 0..rounds {
        let _ = std::fs::remove_file(&dest);
        best_curl = best_curl.min(curl(&url, &dest)?);
        std::fs::remove_file(&dest)?;
        let started = Instant::now();
        download(
            &client,
            &url,
            &dest,
            &DownloadOptions::default(),
            &NoProgress,
        )?;
        best_ours = best_ours.min(started.elapsed().as_secs_f64());
    }
    println!(
        "{} bytes, best of {rounds}: curl {:.2} GB/s, gdsllm download {:.2} GB/s ({:.2}x curl)",
        size,
        gbps(best_curl),
        gbps(best_ours),
        best_curl / best_ours
    );
    println!(
        "pull-bench bytes={size} rounds={rounds} curl_gbps={:.3} ours_gbps={:.3} ratio={:.3}",
        gbps(best_curl),
        gbps(best_ours),
        best_curl / best_ours
    );
    Ok(())
}

/// Seconds `curl -s -f -o dest url` took.
fn curl(url: &str, dest: &Path) -> Result<f64, Box<dyn std::error::Error>> {
    let started = Instant::now();
    let status = std::process::Command::new("curl")
        .args(["-s", "-f", "-o"])
        .arg(dest)
        .arg(url)
        .status()?;
    if !status.success() {
        return Err(format!("curl failed: {status}").into());
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Each stage of a download alone, best of `rounds`, printed as GB/s.
fn time_stages(
    file: &Path,
    url: &str,
    dir: &Path,
    rounds: usize,
    gbps: impl Fn(f64) -> f64,
) -> Result<(), Box<dyn std::error::Error>> {
    const PIECE: usize = 256 << 10;
    let bytes = std::fs::read(file)?;
    let best = |stage: &mut dyn FnMut() -> Result<(), Box<dyn std::error::Error>>| {
        let mut best = f64::INFINITY;
        for _ in 0..rounds {
            let started = Instant::now();
            stage()?;
            best = best.min(started.elapsed().as_secs_f64());
        }
        Ok::<f64, Box<dyn std::error::Error>>(best)
    };
    let mut digest = String::new();
    let sha = best(&mut || {
        let mut hasher = sha2::Sha256::new();
        for piece in bytes.chunks(PIECE) {
            hasher.update(piece);
        }
        digest = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(())
    })?;
    // The same bytes again from a piece that stays in the cache: what the hasher can do at
    // best, the memory aside.
    let piece = &bytes[..PIECE.min(bytes.len())];
    let hot = best(&mut || {
        let mut hasher = sha2::Sha256::new();
        for _ in 0..bytes.len() / piece.len().max(1) {
            hasher.update(piece);
        }
        std::hint::black_box(hasher.finalize());
        Ok(())
    })?;
    let target = dir.join("written");
    let write = best(&mut || {
        let _ = std::fs::remove_file(&target);
        let mut out = std::fs::File::create(&target)?;
        for piece in bytes.chunks(PIECE) {
            out.write_all(piece)?;
        }
        Ok(())
    })?;
    let _ = std::fs::remove_file(&target);
    drop(bytes);
    struct Discard(u64);
    impl Sink for Discard {
        fn restart(&mut self) -> std::io::Result<()> {
            self.0 = 0;
            Ok(())
        }
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            self.0 += bytes.len() as u64;
            Ok(())
        }
    }
    let client = Client::new(ClientOptions::default());
    let socket = best(&mut || {
        client.transfer(url, 0, None, None, &mut Discard(0))?;
        Ok(())
    })?;
    let curl_null = best(&mut || {
        curl(url, Path::new("/dev/null"))?;
        Ok(())
    })?;
    println!(
        "sha256 (sha2, 256 KiB updates)   {:6.2} GB/s  {digest}",
        gbps(sha)
    );
    for (stage, seconds) in [
        ("sha256 of one 256 KiB, in cache", hot),
        ("write to a new file (256 KiB)", write),
        ("socket read (Client::transfer)", socket),
        ("curl -o /dev/null", curl_null),
    ] {
        println!("{stage:<32} {:6.2} GB/s", gbps(seconds));
    }
    println!(
        "pull-stages sha256_gbps={:.3} sha256_hot_gbps={:.3} write_gbps={:.3} socket_gbps={:.3} \
         curl_null_gbps={:.3}",
        gbps(sha),
        gbps(hot),
        gbps(write),
        gbps(socket),
        gbps(curl_null)
    );
    Ok(())
}
