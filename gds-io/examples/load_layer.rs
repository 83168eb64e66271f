//! Reads one layer blob into GPU memory: `cargo run -p gds-io --example load_layer -- FILE [BYTES]`.
//!
//! The I/O path is chosen automatically (`cufile` with real GDS DMA, else the bounce ring);
//! set `GDSLLM_IO=cufile|bounce|host` to force one.

use gds_io::{DeviceIo, GdsBuffer, GdsError, io_choice_from_env};

/// Loads the first `size` bytes of `path` into a new device buffer.
fn load_layer(io: &mut DeviceIo, path: &str, size: usize) -> Result<GdsBuffer, GdsError> {
    let file = io.open_file(path)?;
    let buffer = io.alloc(size)?;
    let record = io.read(&file, 0, size, &buffer, 0)?;
    eprintln!(
        "{path}: {} bytes via {} in {:?} ({:.2} GB/s, through host memory: {})",
        record.bytes,
        record.io_path,
        record.elapsed,
        record.gbps(),
        record.via_host_memory
    );
    Ok(buffer)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: load_layer FILE [BYTES]")?;
    let size = match args.next() {
        Some(bytes) => bytes.parse()?,
        None => std::fs::metadata(&path)?.len() as usize,
    };
    let mut io = DeviceIo::open(0, io_choice_from_env(None)?)?;
    let buffer = load_layer(&mut io, &path, size)?;
    let head = buffer.copy_to_host(0..size.min(16))?;
    println!("first bytes on the GPU: {head:02x?}");
    Ok(())
}
