//! GB/s of one layer-sized blob read per I/O path (criterion reports bytes/s).
//!
//! Without a GPU only the `host` I/O path (O_DIRECT into aligned host memory) is measured; with
//! one, `bounce`, `host_to_gpu` and, when cuFile registers the file, `cufile` too. Device reads
//! are timed to completion: the async form's ticket is waited on before the clock is read.
//! `GDSLLM_BENCH_DIR` picks a disk-backed directory for the blob (default: the temp dir),
//! `GDSLLM_BENCH_BLOB_MIB` its size (default 256; a 7B bf16 layer is ~386).

use std::io::Write;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gds_io::{DeviceReader, DirectFile, Driver, GdsBuffer, GdsFile, Gpu, IoPath, ParallelRead};

fn blob_file() -> (tempfile::TempDir, std::path::PathBuf, usize) {
    let base = std::env::var_os("GDSLLM_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let mib: usize = std::env::var("GDSLLM_BENCH_BLOB_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let dir = tempfile::tempdir_in(base).expect("bench dir");
    let path = dir.path().join("layer.bin");
    let chunk: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let mut out = std::fs::File::create(&path).expect("bench blob");
    for _ in 0..mib {
        out.write_all(&chunk).expect("write bench blob");
    }
    out.sync_all().expect("sync bench blob");
    (dir, path, mib << 20)
}

fn io(c: &mut Criterion) {
    let (_dir, path, len) = blob_file();
    let mut group = c.benchmark_group("io_blob");
    group.throughput(Throughput::Bytes(len as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));

    let direct = DirectFile::open(&path).expect("open blob");
    let mut host = gds_io::AlignedBuf::zeroed(len).expect("host buffer");
    group.bench_function("host", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                direct
                    .read_into_parallel(0, &mut host, ParallelRead::default())
                    .expect("host read");
            }
            start.elapsed()
        })
    });

    match Gpu::open(0) {
        Err(err) => eprintln!("io bench: device I/O paths skipped: {err}"),
        Ok(gpu) => {
            let driver = Driver::open().ok();
            let buffer = GdsBuffer::alloc(&gpu, len).expect("device buffer");
            let stream = gpu.new_stream().expect("stream");
            for kind in [IoPath::Bounce, IoPath::Host, IoPath::Cufile] {
                let mut file = GdsFile::open(&path).expect("open blob");
                if kind == IoPath::Cufile {
                    let registered = driver.as_ref().map(|d| file.register(d));
                    if !matches!(registered, Some(Ok(()))) {
                        eprintln!("io bench: cufile skipped: {registered:?}");
                        continue;
                    }
                }
                let reader: Box<dyn DeviceReader> =
                    gds_io::build_reader(kind, &gpu, driver.as_ref()).expect("I/O path");
                let name = if kind == IoPath::Host {
                    "host_to_gpu"
                } else {
                    kind.name()
                };
                group.bench_function(name, |b| {
                    b.iter_custom(|iters| {
                        let start = Instant::now();
                        for _ in 0..iters {
                            reader
                                .read_async(&file, 0, len, &buffer, 0, &stream)
                                .expect("device read")
                                .wait()
                                .expect("read landed");
                        }
                        stream.synchronize().expect("stream");
                        start.elapsed()
                    })
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, io);
criterion_main!(benches);
