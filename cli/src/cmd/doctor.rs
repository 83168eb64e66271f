//! `gdsllm doctor`: what this machine offers for streaming weights to a GPU, and what to fix.

use std::path::{Path, PathBuf};

use anyhow::Context;
use gds_io::probe;
use gds_io::{
    DeviceRead, DeviceReader, Driver, DriverProperties, GdsBuffer, GdsFile, Gpu, IoPath, UdevCheck,
};
use serde::Serialize;

/// Check GPU, driver, CUDA libraries, cuFile/GDS, the udev record cuFile needs and the model
/// store's filesystem, then measure a short read with every available I/O path.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Model store directory to check (O_DIRECT, udev record) and to write the probe file in.
    #[arg(long, env = "GDSLLM_HOME")]
    pub home: Option<PathBuf>,
    /// Size of the probe file for the read measurement, in MiB (0 skips the measurement).
    #[arg(long, default_value_t = 256)]
    pub probe_mib: usize,
}

#[derive(Serialize)]
struct Report {
    summary: String,
    gpu: GpuReport,
    libraries: Vec<LibraryReport>,
    cufile: CufileReport,
    nvidia_fs: bool,
    p2pdma: bool,
    /// `null` when cuFile is not loaded.
    compat_mode: Option<bool>,
    model_store: StoreReport,
    /// cuFileHandleRegister of a small file in the model store (null without cuFile).
    cufile_registration: Option<RegistrationReport>,
    /// Named `backends` in the JSON for compatibility with scripts written before the rename.
    #[serde(rename = "backends")]
    io_paths: Vec<IoPathReport>,
}

#[derive(Serialize)]
struct RegistrationReport {
    file: PathBuf,
    ok: bool,
    error: Option<String>,
}

#[derive(Serialize)]
struct GpuReport {
    available: bool,
    name: Option<String>,
    cuda_driver_version: Option<String>,
    error: Option<String>,
}

#[derive(Serialize)]
struct LibraryReport {
    name: &'static str,
    path: Option<PathBuf>,
    version: Option<String>,
}

#[derive(Serialize)]
struct CufileReport {
    loaded: bool,
    properties: Option<DriverProperties>,
    error: Option<String>,
}

#[derive(Serialize)]
struct StoreReport {
    path: PathBuf,
    o_direct: Option<bool>,
    udev: Option<UdevCheck>,
    udev_fix: Option<String>,
    error: Option<String>,
}

#[derive(Serialize)]
struct IoPathReport {
    name: &'static str,
    available: bool,
    gbps: Option<f64>,
    via_host_memory: Option<bool>,
    note: Option<String>,
}

pub fn default_home() -> PathBuf {
    std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".cache").join("gdsllm"))
        .unwrap_or_else(|| PathBuf::from(".gdsllm"))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let home = args.home.clone().unwrap_or_else(default_home);
    let gpu = Gpu::open(0);
    let gpu_report = GpuReport {
        available: gpu.is_ok(),
        name: gpu.as_ref().ok().and_then(|g| g.name().ok()),
        cuda_driver_version: probe::cuda_driver_version().map(|(a, b)| format!("{a}.{b}")),
        error: gpu.as_ref().err().map(|e| e.to_string()),
    };
    let libraries = ["libcuda", "libcudart", "libcufile", "libnvrtc", "libcublas"]
        .into_iter()
        .map(|name| {
            let path = probe::find_library(name);
            LibraryReport {
                name,
                version: path.as_deref().and_then(probe::library_version),
                path,
            }
        })
        .collect();
    let driver = match &gpu {
        Ok(_) => Driver::open().map_err(|e| e.to_string()),
        Err(_) => Err("not tried: no GPU".to_string()),
    };
    let cufile = CufileReport {
        loaded: driver.is_ok(),
        properties: driver.as_ref().ok().map(|d| d.properties().clone()),
        error: driver.as_ref().err().cloned(),
    };
    let props = cufile.properties.clone();
    let store = check_store(&home);
    let cufile_registration = driver.as_ref().ok().map(|d| check_registration(&home, d));
    let io_paths = measure_io_paths(
        &home,
        args.probe_mib,
        gpu.as_ref().ok(),
        driver.as_ref().ok(),
    )
    .unwrap_or_else(|err| {
        vec![IoPathReport {
            name: "probe",
            available: false,
            gbps: None,
            via_host_memory: None,
            note: Some(format!("read measurement failed: {err:#}")),
        }]
    });
    let summary = match (&gpu, &props) {
        (Err(_), _) => "no GPU: CPU backend only".to_string(),
        (Ok(_), Some(p)) if p.gds_dma() => "GPU with GPUDirect Storage DMA: cufile path".into(),
        (Ok(_), Some(_)) => {
            "GPU, cuFile in compatibility mode (no nvidia-fs/P2PDMA): bounce path".into()
        }
        (Ok(_), None) => "GPU without cuFile: bounce path".into(),
    };
    let report = Report {
        summary,
        gpu: gpu_report,
        libraries,
        nvidia_fs: props
            .as_ref()
            .map_or_else(gds_io::driver::nvidia_fs_loaded, |p| p.nvidia_fs),
        p2pdma: props
            .as_ref()
            .map_or_else(gds_io::driver::pci_p2pdma_present, |p| p.p2pdma),
        compat_mode: props.as_ref().map(|p| p.compat_mode),
        cufile,
        model_store: store,
        cufile_registration,
        io_paths,
    };
    crate::output::print_report(args.json, &report, print_text)
}

fn check_store(home: &Path) -> StoreReport {
    let o_direct = probe::o_direct_supported(home);
    let udev = UdevCheck::for_path(home);
    StoreReport {
        path: home.to_path_buf(),
        o_direct: o_direct.as_ref().ok().copied(),
        udev_fix: udev.as_ref().ok().and_then(|u| u.fix()),
        error: o_direct
            .as_ref()
            .err()
            .map(|e| format!("cannot probe {}: {e}", home.display())),
        udev: udev.ok(),
    }
}

/// Registers a 1 MiB file in the store with cuFile: the step that fails with error 5027 when
/// cuFile cannot identify the volume (see the udev record above).
fn check_registration(home: &Path, driver: &std::sync::Arc<Driver>) -> RegistrationReport {
    let file = home.join(format!(
        ".gdsllm-doctor-register-{}.bin",
        std::process::id()
    ));
    let outcome = (|| -> anyhow::Result<()> {
        std::fs::create_dir_all(home)?;
        write_probe(&file, 1 << 20)?;
        GdsFile::open_registered(&file, driver)?;
        Ok(())
    })();
    let _ = std::fs::remove_file(&file);
    RegistrationReport {
        ok: outcome.is_ok(),
        error: outcome.err().map(|e| format!("{e:#}")),
        file,
    }
}

/// Writes a probe file in the store and reads it back with each I/O path that can run.
fn measure_io_paths(
    home: &Path,
    probe_mib: usize,
    gpu: Option<&Gpu>,
    driver: Option<&std::sync::Arc<Driver>>,
) -> anyhow::Result<Vec<IoPathReport>> {
    let mut reports = Vec::new();
    if probe_mib == 0 {
        return Ok(reports);
    }
    let len = probe_mib << 20;
    std::fs::create_dir_all(home).with_context(|| format!("cannot create {}", home.display()))?;
    let path = home.join(format!(".gdsllm-doctor-probe-{}.bin", std::process::id()));
    write_probe(&path, len)?;
    let result = (|| -> anyhow::Result<()> {
        // Host: O_DIRECT into aligned host memory (what the CPU backend uses).
        let direct = gds_io::DirectFile::open(&path)?;
        let (_, record) = direct.read_range_parallel(0, len as u64, Default::default())?;
        reports.push(IoPathReport {
            name: "host",
            available: true,
            gbps: Some(record.gbps()),
            via_host_memory: Some(true),
            note: Some(format!("O_DIRECT: {}", direct.is_direct())),
        });
        let Some(gpu) = gpu else {
            for kind in [IoPath::Cufile, IoPath::Bounce] {
                reports.push(IoPathReport {
                    name: kind.name(),
                    available: false,
                    gbps: None,
                    via_host_memory: None,
                    note: Some("no GPU".into()),
                });
            }
            return Ok(());
        };
        let buffer = GdsBuffer::alloc(gpu, len)?;
        for kind in [IoPath::Cufile, IoPath::Bounce, IoPath::Host] {
            let name = match kind {
                IoPath::Host => "host_to_gpu",
                other => other.name(),
            };
            let outcome = (|| -> Result<gds_io::ReadRecord, gds_io::GdsError> {
                let file = GdsFile::open_for(&path, kind, driver)?;
                let reader: Box<dyn DeviceReader> = gds_io::build_reader(kind, gpu, driver)?;
                reader.read(&DeviceRead::from_start(&file, len, &buffer))
            })();
            reports.push(match outcome {
                Ok(record) => IoPathReport {
                    name,
                    available: true,
                    gbps: Some(record.gbps()),
                    via_host_memory: Some(record.via_host_memory),
                    note: None,
                },
                Err(err) => IoPathReport {
                    name,
                    available: false,
                    gbps: None,
                    via_host_memory: None,
                    note: Some(err.to_string()),
                },
            });
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&path);
    result?;
    Ok(reports)
}

/// Writes a `len`-byte file of a fixed pattern at `path` (the read probes of `doctor` and of
/// the calibration).
pub(crate) fn write_probe(path: &Path, len: usize) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::fs::File::create(path)
        .with_context(|| format!("cannot create probe file {}", path.display()))?;
    let chunk: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    for _ in 0..len / chunk.len() {
        out.write_all(&chunk)?;
    }
    out.sync_all()?;
    Ok(())
}

fn yes_no(value: bool) -> &'static str {
    if value { "yes" } else { "no" }
}

fn print_text(report: &Report) {
    println!("{}", report.summary);
    println!();
    match (&report.gpu.name, &report.gpu.error) {
        (Some(name), _) => println!("GPU:            {name}"),
        (None, Some(err)) => println!("GPU:            none ({err})"),
        (None, None) => println!("GPU:            none"),
    }
    println!(
        "CUDA driver:    {}",
        report
            .gpu
            .cuda_driver_version
            .as_deref()
            .unwrap_or("not found")
    );
    for lib in &report.libraries {
        println!(
            "{:<15} {}",
            format!("{}:", lib.name),
            match (&lib.path, &lib.version) {
                (Some(path), Some(v)) => format!("{v} ({})", path.display()),
                (Some(path), None) => path.display().to_string(),
                _ => "not found".into(),
            }
        );
    }
    match (&report.cufile.properties, &report.cufile.error) {
        (Some(p), _) => println!(
            "cuFile:         {} (version {:?}), compat mode: {}",
            p.library,
            p.library_version,
            yes_no(p.compat_mode)
        ),
        (None, Some(err)) => println!("cuFile:         unavailable: {err}"),
        (None, None) => println!("cuFile:         unavailable"),
    }
    println!("nvidia-fs:      {}", yes_no(report.nvidia_fs));
    println!("PCI P2PDMA:     {}", yes_no(report.p2pdma));
    let store = &report.model_store;
    println!("model store:    {}", store.path.display());
    match store.o_direct {
        Some(direct) => println!("  O_DIRECT:     {}", yes_no(direct)),
        None => println!(
            "  O_DIRECT:     unknown ({})",
            store.error.as_deref().unwrap_or("?")
        ),
    }
    if let Some(udev) = &store.udev {
        println!(
            "  udev record:  {} {:?}",
            udev.record.display(),
            udev.status
        );
    }
    if let Some(fix) = &store.udev_fix {
        println!("  fix:          {fix}");
    }
    if let Some(udev) = &store.udev
        && let (Some(fs_type), Some(source)) = (&udev.fs_type, &udev.mount_source)
    {
        println!("  mount:        {fs_type} from {source}");
    }
    if let Some(reg) = &report.cufile_registration {
        match &reg.error {
            None => println!("  cuFile registration: ok"),
            Some(err) => println!("  cuFile registration: FAILED: {err}"),
        }
    }
    println!("read speed (probe file in the store):");
    for row in &report.io_paths {
        match row.gbps {
            Some(gbps) => println!(
                "  {:<12} {gbps:6.2} GB/s{}",
                row.name,
                row.note
                    .as_deref()
                    .map(|n| format!("  ({n})"))
                    .unwrap_or_default()
            ),
            None => println!(
                "  {:<12} unavailable: {}",
                row.name,
                row.note.as_deref().unwrap_or("?")
            ),
        }
    }
}
