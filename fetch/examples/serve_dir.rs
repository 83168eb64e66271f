//! Serves a directory over loopback HTTP with the test server (Range support, no faults) until
//! killed, printing its URL first: a model directory for `gdsllm run -m http://…/` in the
//! BENCHMARKS.md figures.
//! `cargo run --release -p gdsllm-fetch --features testing --example serve_dir -- DIR`

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: serve_dir DIR")?;
    let server = gdsllm_fetch::testing::TestServer::start();
    server.add_dir("model", std::path::Path::new(&dir));
    println!("{}/model/", server.url());
    loop {
        std::thread::park();
    }
}
