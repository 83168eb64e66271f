//! `gdsllm bench-io`: reads every blob of a model with each available I/O path and compares
//! with a raw multi-threaded O_DIRECT read and a `cp`-like buffered read of the same files,
//! measured in the same run.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use gds_io::{
    BounceConfig, BounceReader, DeviceRead, DeviceReader, DirectFile, Driver, GdsBuffer, GdsFile,
    Gpu, IoChoice, IoPath, ParallelRead,
};
use serde::Serialize;

/// Measure read throughput of a model's blobs per I/O path (GB/s = 10^9 bytes/s).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (with metadata.json; without it every *.bin file in it is read).
    #[arg(short, long)]
    pub model: PathBuf,
    /// I/O path to measure: cufile, bounce, host or auto (auto = every available one).
    /// Overrides $GDSLLM_IO.
    #[arg(long)]
    pub io: Option<String>,
    /// Threads and request size of the raw O_DIRECT reference read.
    #[arg(long, default_value_t = 8)]
    pub raw_threads: usize,
    #[arg(long, default_value_t = 16)]
    pub raw_request_mib: usize,
    /// Skip the buffered (`cp`-like) reference read.
    #[arg(long)]
    pub no_buffered: bool,
    /// Request sizes (MiB) of the bounce path to measure, comma separated: one row each.
    #[arg(long, value_delimiter = ',', default_values_t = vec![4usize])]
    pub bounce_request_mib: Vec<usize>,
    /// Reader threads (disk queue depth) of the bounce path.
    #[arg(long, default_value_t = 8)]
    pub bounce_threads: usize,
    /// Drop the whole page cache (`echo 3 > /proc/sys/vm/drop_caches`, needs root) before
    /// each measurement, so no I/O path reads from RAM; without root only the model's files
    /// are evicted (posix_fadvise).
    #[arg(long)]
    pub drop_caches: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report {
    model: PathBuf,
    files: usize,
    bytes: u64,
    /// Raw multi-threaded O_DIRECT read into host memory, file after file: the mean of
    /// `raw_runs` (one at the start, one at the end of the run, since the machine is noisy).
    raw_gbps: f64,
    raw_runs: Vec<f64>,
    raw_threads: usize,
    raw_request_mib: usize,
    /// Buffered read with the page cache dropped for the files first (like `cp`).
    buffered_gbps: Option<f64>,
    /// Which path cuFile took: "gds" (DMA), "compat" or null when not loaded.
    cufile_path: Option<&'static str>,
    /// Named `backends` in the JSON for compatibility with scripts written before the rename.
    #[serde(rename = "backends")]
    io_paths: Vec<IoPathResult>,
}

#[derive(Serialize)]
struct IoPathResult {
    /// `host` (O_DIRECT into host memory), `host_to_gpu`, `cufile`, `bounce_<N>mib`.
    name: String,
    /// Request size of the row, in MiB.
    request_mib: Option<usize>,
    /// How the blobs were read: "file after file" or "double-buffered pipeline".
    pattern: &'static str,
    gbps: Option<f64>,
    /// gbps / raw_gbps.
    ratio: Option<f64>,
    via_host_memory: Option<bool>,
    error: Option<String>,
    per_blob: Vec<BlobResult>,
}

#[derive(Serialize)]
struct BlobResult {
    file: String,
    bytes: u64,
    gbps: f64,
}

struct Blob {
    name: String,
    path: PathBuf,
    len: u64,
}

fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

fn list_blobs(dir: &Path) -> anyhow::Result<Vec<Blob>> {
    if !dir.is_dir() {
        bail!("{} is not a model directory", dir.display());
    }
    let blobs = if dir.join("metadata.json").exists() {
        let model = weights_format::Model::open(dir)
            .with_context(|| format!("cannot open model {}", dir.display()))?;
        (0..model.metadata().blobs.len())
            .map(|i| Blob {
                name: model.metadata().blobs[i].file.clone(),
                path: model.blob_path(i),
                len: model.metadata().blobs[i].length,
            })
            .collect()
    } else {
        let mut blobs = Vec::new();
        for entry in
            std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?
        {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "bin") {
                blobs.push(Blob {
                    name: path
                        .file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .into_owned(),
                    len: std::fs::metadata(&path)?.len(),
                    path,
                });
            }
        }
        blobs.sort_by(|a, b| a.name.cmp(&b.name));
        blobs
    };
    let blobs: Vec<Blob> = blobs.into_iter().filter(|b| b.len > 0).collect();
    if blobs.is_empty() {
        bail!("{} holds no blobs (*.bin) to read", dir.display());
    }
    Ok(blobs)
}

/// Empties the page cache before a measurement: everything when root (`drop_all`), otherwise
/// (or when that fails) the model's files only.
fn drop_caches(blobs: &[Blob], drop_all: bool) {
    if drop_all {
        // sync first: only clean pages can be dropped.
        let synced = std::process::Command::new("sync").status();
        match std::fs::write("/proc/sys/vm/drop_caches", "3\n") {
            Ok(()) => return,
            Err(err) => tracing::warn!(
                "cannot drop the page cache ({err}; sync: {synced:?}); evicting the model's \
                 files only"
            ),
        }
    }
    for blob in blobs {
        if let Err(err) = gds_io::probe::drop_page_cache(&blob.path) {
            tracing::warn!("cannot drop cached pages of {}: {err}", blob.path.display());
        }
    }
}

fn buffered_read(blobs: &[Blob]) -> anyhow::Result<f64> {
    let mut buf = vec![0u8; 1 << 20];
    let start = Instant::now();
    let mut total = 0u64;
    for blob in blobs {
        let mut file = std::fs::File::open(&blob.path)?;
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    Ok(gbps(total, start.elapsed()))
}

/// O_DIRECT into aligned host memory, file after file, each file split into `how` requests.
/// This is both the raw reference and the `host` I/O path (what the CPU backend does).
fn host_read(blobs: &[Blob], how: ParallelRead) -> anyhow::Result<(f64, Vec<BlobResult>)> {
    let largest = blobs.iter().map(|b| b.len).max().unwrap_or(0);
    let mut buf = gds_io::AlignedBuf::zeroed(largest as usize)?;
    let mut per_blob = Vec::with_capacity(blobs.len());
    let start = Instant::now();
    let mut total = 0u64;
    for blob in blobs {
        let file = DirectFile::open(&blob.path)?;
        let aligned = (blob.len as usize).next_multiple_of(gds_io::IO_ALIGN);
        let record = file.read_into_parallel(0, &mut buf[..aligned], how)?;
        total += record.bytes;
        per_blob.push(BlobResult {
            file: blob.name.clone(),
            bytes: record.bytes,
            gbps: record.gbps(),
        });
    }
    Ok((gbps(total, start.elapsed()), per_blob))
}

fn open_files(
    kind: IoPath,
    driver: Option<&std::sync::Arc<Driver>>,
    blobs: &[Blob],
) -> Result<Vec<GdsFile>, gds_io::GdsError> {
    blobs
        .iter()
        .map(|blob| GdsFile::open_for(&blob.path, kind, driver))
        .collect()
}

type Measured = (f64, bool, Vec<BlobResult>);

/// One I/O path reading blob after blob into one device buffer (cufile, host_to_gpu).
fn device_io_path(
    kind: IoPath,
    gpu: &Gpu,
    driver: Option<&std::sync::Arc<Driver>>,
    blobs: &[Blob],
    buffer: &GdsBuffer,
) -> Result<Measured, gds_io::GdsError> {
    let reader: Box<dyn DeviceReader> = gds_io::build_reader(kind, gpu, driver)?;
    let files = open_files(kind, driver, blobs)?;
    let mut per_blob = Vec::with_capacity(blobs.len());
    let mut via_host = false;
    let start = Instant::now();
    for (blob, file) in blobs.iter().zip(&files) {
        let record = reader.read(&DeviceRead::from_start(file, blob.len as usize, buffer))?;
        via_host |= record.via_host_memory;
        per_blob.push(BlobResult {
            file: blob.name.clone(),
            bytes: record.bytes,
            gbps: record.gbps(),
        });
    }
    let total: u64 = blobs.iter().map(|b| b.len).sum();
    Ok((gbps(total, start.elapsed()), via_host, per_blob))
}

/// The bounce path streaming the blobs the way residency does: two device buffers, blob
/// i+1 queued before blob i is waited for, so the disk queue never drains between blobs.
/// Per-blob GB/s counts from submission (queued time included).
fn bounce_streaming(
    config: BounceConfig,
    gpu: &Gpu,
    blobs: &[Blob],
    buffers: &[GdsBuffer; 2],
) -> Result<Measured, gds_io::GdsError> {
    let bounce = BounceReader::new(gpu, config)?;
    let files = open_files(IoPath::Bounce, None, blobs)?;
    let start = Instant::now();
    let per_blob = bounce.pipeline(|p| {
        let mut per_blob = Vec::with_capacity(blobs.len());
        let mut pending = std::collections::VecDeque::new();
        let mut finish = |ticket, index: usize| -> Result<(), gds_io::GdsError> {
            let record = p.wait(ticket)?;
            per_blob.push(BlobResult {
                file: blobs[index].name.clone(),
                bytes: record.bytes,
                gbps: record.gbps(),
            });
            Ok(())
        };
        for (index, (blob, file)) in blobs.iter().zip(&files).enumerate() {
            if pending.len() == 2 {
                let (ticket, i) = pending.pop_front().expect("two reads are pending");
                finish(ticket, i)?;
            }
            let ticket = p.submit(DeviceRead::from_start(
                file,
                blob.len as usize,
                &buffers[index % 2],
            ))?;
            pending.push_back((ticket, index));
        }
        for (ticket, i) in pending {
            finish(ticket, i)?;
        }
        Ok(per_blob)
    })?;
    let total: u64 = blobs.iter().map(|b| b.len).sum();
    Ok((gbps(total, start.elapsed()), true, per_blob))
}

fn row(
    name: String,
    request_mib: Option<usize>,
    pattern: &'static str,
    outcome: Result<Measured, gds_io::GdsError>,
    raw_gbps: f64,
) -> IoPathResult {
    match outcome {
        Ok((g, via_host, per_blob)) => IoPathResult {
            name,
            request_mib,
            pattern,
            gbps: Some(g),
            ratio: Some(g / raw_gbps),
            via_host_memory: Some(via_host),
            error: None,
            per_blob,
        },
        Err(err) => IoPathResult {
            name,
            request_mib,
            pattern,
            gbps: None,
            ratio: None,
            via_host_memory: None,
            error: Some(err.to_string()),
            per_blob: Vec::new(),
        },
    }
}

const FILE_AFTER_FILE: &str = "file after file";
const STREAMING: &str = "double-buffered pipeline";

pub fn run(args: Args) -> anyhow::Result<()> {
    let choice = gds_io::io_choice_from_env(args.io.as_deref())?;
    let blobs = list_blobs(&args.model)?;
    let bytes: u64 = blobs.iter().map(|b| b.len).sum();
    tracing::info!(
        files = blobs.len(),
        bytes,
        "reading {}",
        args.model.display()
    );
    let raw_how = ParallelRead {
        request_bytes: args.raw_request_mib.max(1) << 20,
        threads: args.raw_threads.max(1),
    };
    let mut raw_runs = Vec::new();
    drop_caches(&blobs, args.drop_caches);
    raw_runs.push(host_read(&blobs, raw_how)?.0);
    // Until the second raw run, ratios use the first; they are recomputed at the end.
    let first_raw = raw_runs[0];

    let buffered_gbps = if args.no_buffered {
        None
    } else {
        drop_caches(&blobs, args.drop_caches);
        Some(buffered_read(&blobs)?)
    };

    let gpu = Gpu::open(0);
    let driver = gpu.as_ref().ok().and_then(|_| match Driver::open() {
        Ok(driver) => Some(driver),
        Err(err) => {
            tracing::warn!("cuFile unavailable: {err}");
            None
        }
    });
    let cufile_path = driver.as_ref().map(|d| {
        if d.properties().gds_dma() {
            "gds"
        } else {
            "compat"
        }
    });
    let kinds: Vec<IoPath> = match choice {
        IoChoice::Force(kind) => vec![kind],
        IoChoice::Auto => IoPath::ALL.to_vec(),
    };
    let mut io_paths = Vec::new();
    if kinds.contains(&IoPath::Host) {
        // The host path proper: O_DIRECT into aligned host memory, as parallel as raw.
        drop_caches(&blobs, args.drop_caches);
        let outcome = host_read(&blobs, raw_how)
            .map(|(g, per_blob)| (g, true, per_blob))
            .map_err(|err| gds_io::GdsError::IoPathUnavailable {
                io_path: "host",
                reason: format!("{err:#}"),
            });
        io_paths.push(row(
            "host".into(),
            Some(args.raw_request_mib),
            FILE_AFTER_FILE,
            outcome,
            first_raw,
        ));
    }
    match &gpu {
        Err(err) => tracing::warn!("{err}; measured the host path into host memory only"),
        Ok(gpu) => {
            let largest = blobs.iter().map(|b| b.len).max().unwrap_or(0) as usize;
            let buffers = [
                GdsBuffer::alloc(gpu, largest)?,
                GdsBuffer::alloc(gpu, largest)?,
            ];
            for kind in kinds {
                match kind {
                    IoPath::Cufile => {
                        drop_caches(&blobs, args.drop_caches);
                        let outcome =
                            device_io_path(kind, gpu, driver.as_ref(), &blobs, &buffers[0]);
                        let mib = gds_io::CufileConfig::default().request_bytes >> 20;
                        io_paths.push(row(
                            "cufile".into(),
                            Some(mib),
                            FILE_AFTER_FILE,
                            outcome,
                            first_raw,
                        ));
                    }
                    IoPath::Bounce => {
                        for &mib in &args.bounce_request_mib {
                            drop_caches(&blobs, args.drop_caches);
                            let config =
                                BounceConfig::with_request(mib.max(1) << 20, args.bounce_threads);
                            let outcome = bounce_streaming(config, gpu, &blobs, &buffers);
                            io_paths.push(row(
                                format!("bounce_{mib}mib"),
                                Some(mib),
                                STREAMING,
                                outcome,
                                first_raw,
                            ));
                        }
                    }
                    IoPath::Host => {
                        drop_caches(&blobs, args.drop_caches);
                        let outcome = device_io_path(kind, gpu, None, &blobs, &buffers[0]);
                        let mib = gds_io::HostStagedConfig::default().window_bytes >> 20;
                        io_paths.push(row(
                            "host_to_gpu".into(),
                            Some(mib),
                            FILE_AFTER_FILE,
                            outcome,
                            first_raw,
                        ));
                    }
                }
            }
        }
    }
    drop_caches(&blobs, args.drop_caches);
    raw_runs.push(host_read(&blobs, raw_how)?.0);
    let raw_gbps = raw_runs.iter().sum::<f64>() / raw_runs.len() as f64;
    for row in &mut io_paths {
        row.ratio = row.gbps.map(|g| g / raw_gbps);
    }

    let report = Report {
        model: args.model.clone(),
        files: blobs.len(),
        bytes,
        raw_gbps,
        raw_runs,
        raw_threads: raw_how.threads,
        raw_request_mib: args.raw_request_mib,
        buffered_gbps,
        cufile_path,
        io_paths,
    };
    crate::output::print_report(args.json, &report, print_table)
}

fn print_table(report: &Report) {
    println!(
        "{}: {} files, {:.2} GB; cuFile path: {}",
        report.model.display(),
        report.files,
        report.bytes as f64 / 1e9,
        report.cufile_path.unwrap_or("not loaded")
    );
    println!("{:<22} {:>8} {:>8}", "read", "GB/s", "× raw");
    println!(
        "{:<22} {:>8.2} {:>8.2}   ({} threads x {} MiB; runs {:?})",
        "raw O_DIRECT (ref)",
        report.raw_gbps,
        1.0,
        report.raw_threads,
        report.raw_request_mib,
        report
            .raw_runs
            .iter()
            .map(|g| format!("{g:.2}"))
            .collect::<Vec<_>>()
    );
    if let Some(b) = report.buffered_gbps {
        println!(
            "{:<22} {:>8.2} {:>8.2}",
            "buffered, cp-like",
            b,
            b / report.raw_gbps
        );
    }
    for row in &report.io_paths {
        match (row.gbps, row.ratio) {
            (Some(g), Some(r)) => {
                println!("{:<22} {g:>8.2} {r:>8.2}   ({})", row.name, row.pattern)
            }
            _ => println!(
                "{:<22} unavailable: {}",
                row.name,
                row.error.as_deref().unwrap_or("?")
            ),
        }
    }
    for row in &report.io_paths {
        if row.per_blob.is_empty() {
            continue;
        }
        let speeds: Vec<f64> = row.per_blob.iter().map(|b| b.gbps).collect();
        let min = speeds.iter().copied().fold(f64::INFINITY, f64::min);
        let max = speeds.iter().copied().fold(0.0, f64::max);
        println!(
            "{}: per blob {min:.2}–{max:.2} GB/s over {} blobs",
            row.name,
            speeds.len()
        );
    }
}
