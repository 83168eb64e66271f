//! Pull throughput from the loopback test server against `curl` of the same file, in one run:
//! `cargo run --release -p gdsllm-fetch --features testing --example loopback_pull -- FILE [ROUNDS]`.
//! Both write the file into a temporary directory beside FILE's (curl with `-o`, ours through
//! `download`, which also hashes it with sha256 and checks the server's Repr-Digest); the best
//! of ROUNDS (default 3) runs each is printed, and their ratio.

use std::path::PathBuf;
use std::time::Instant;

use gdsllm_fetch::testing::{Content, TestServer};
use gdsllm_fetch::{Client, ClientOptions, DownloadOptions, NoProgress, download};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let file = PathBuf::from(args.next().ok_or("usage: loopback_pull FILE [ROUNDS]")?);
    let rounds: usize = args.next().map_or(Ok(3), |r| r.parse())?;
    let size = std::fs::metadata(&file)?.len();
    let server = TestServer::start();
    server.add_file_with_digest("file", Content::File(file.clone()));
    let url = format!("{}/file", server.url());
    let out = tempfile::tempdir_in(file.parent().unwrap_or(std::path::Path::new(".")))?;
    let dest = out.path().join("pulled");
    let gbps = |seconds: f64| size as f64 / seconds / 1e9;
    let (mut best_curl, mut best_ours) = (f64::INFINITY, f64::INFINITY);
    let client = Client::new(ClientOptions::default());
    for _ in 0..rounds {
        let _ = std::fs::remove_file(&dest);
        let started = Instant::now();
        let status = std::process::Command::new("curl")
            .args(["-s", "-f", "-o"])
            .arg(&dest)
            .arg(&url)
            .status()?;
        if !status.success() {
            return Err(format!("curl failed: {status}").into());
        }
        best_curl = best_curl.min(started.elapsed().as_secs_f64());
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
    Ok(())
}
