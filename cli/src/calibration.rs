//! The machine's figures for the placement planner (`residency::placement`), measured once and
//! kept in `$GDSLLM_HOME/calibration.json`: the disk's O_DIRECT reads, the CPU's matmul speed
//! per weight dtype at this many threads, and on a GPU its matmuls, pinned host→device copies,
//! the handoff between the two, and the CPU's matmuls and the copies at the same time
//! (`gpu.concurrent`, version 4: on one DRAM they do not add up; without a GPU there is nothing
//! to measure, and the planner then has the CPU compute everything). A dtype not measured yet
//! is measured when a model needs it; `--calibrate` measures everything again; a file of
//! another version is measured again, and of another thread count its CPU figures (the disk's
//! and the GPU's are kept). The CPU's probe is four times its last-level caches or more
//! (`llama::hybrid::calibrate::cpu_probe_bytes`: a fixed 256 MiB one was read from a server's
//! cache), and the file says how large it was.

use std::path::{Path, PathBuf};

use anyhow::Context;
use residency::{CALIBRATION_VERSION, Calibration};
use weights_format::DType;

/// MiB of the probes by default: the disk's probe file (written, read with O_DIRECT,
/// removed) and the least the CPU's probe weight is (more on a CPU whose last-level caches
/// are larger than a quarter of it); the GPU's weight is twice that (far above its L2).
pub const DEFAULT_PROBE_MIB: usize = 256;

/// The store's home: `$GDSLLM_HOME`, or the default one.
pub fn home() -> PathBuf {
    std::env::var_os("GDSLLM_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(crate::cmd::doctor::default_home)
}

pub fn path(home: &Path) -> PathBuf {
    home.join("calibration.json")
}

/// The stored calibration, if there is a readable one of this version, for `threads` threads:
/// one measured with another thread count keeps what does not depend on the CPU's threads
/// (the disk's reads, the GPU's matmuls, copies and handoff) and loses the rest (the CPU's
/// matmuls, and the CPU's matmuls beside the copies), which are measured again. Switching
/// between `--placement gpu` (every thread) and `auto` (some kept for the GPU's work) in one
/// home measured everything again at each switch.
fn load(home: &Path, threads: usize) -> Option<Calibration> {
    let path = path(home);
    let text = std::fs::read_to_string(&path).ok()?;
    match serde_json::from_str::<Calibration>(&text) {
        Ok(c) if c.version == CALIBRATION_VERSION && c.cpu_threads == threads => Some(c),
        Ok(mut c) if c.version == CALIBRATION_VERSION => {
            tracing::info!(
                "{}: the CPU measured with {} threads; measuring its figures again for {threads}",
                path.display(),
                c.cpu_threads
            );
            c.cpu_threads = threads;
            c.cpu.clear();
            if let Some(gpu) = c.gpu.as_mut() {
                gpu.concurrent.clear();
            }
            Some(c)
        }
        Ok(c) => {
            tracing::info!(
                "{}: measured for version {}; measuring again",
                path.display(),
                c.version
            );
            None
        }
        Err(err) => {
            tracing::warn!("{}: {err}; measuring again", path.display());
            None
        }
    }
}

fn save(home: &Path, cal: &Calibration) -> anyhow::Result<()> {
    std::fs::create_dir_all(home).with_context(|| format!("cannot create {}", home.display()))?;
    let path = path(home);
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(cal)?)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// O_DIRECT read speed of a probe file written in `home`, GB/s.
fn measure_disk_gbps(home: &Path, len: usize) -> anyhow::Result<f64> {
    std::fs::create_dir_all(home).with_context(|| format!("cannot create {}", home.display()))?;
    let probe = home.join(format!(
        ".gdsllm-calibrate-probe-{}.bin",
        std::process::id()
    ));
    crate::cmd::doctor::write_probe(&probe, len)?;
    let read = (|| -> anyhow::Result<f64> {
        let file = gds_io::DirectFile::open(&probe)?;
        let (_, record) = file.read_range_parallel(0, len as u64, Default::default())?;
        Ok(record.gbps())
    })();
    let _ = std::fs::remove_file(&probe);
    read.with_context(|| format!("reading the probe file {}", probe.display()))
}

/// The calibration for planning a model of `dtypes` on this machine (`gpu`: the GPU to
/// measure when the stored figures have none), measuring what is missing (everything when
/// `refresh`) and storing the result. `probe_mib`: the probes' size ([`DEFAULT_PROBE_MIB`]
/// when `None`, the CPU's then sized from its caches; given, the CPU's is that too).
pub fn ensure(
    home: &Path,
    dtypes: &[DType],
    gpu: Option<&llama::CudaBackend>,
    refresh: bool,
    probe_mib: Option<usize>,
) -> anyhow::Result<Calibration> {
    let probe = probe_mib.unwrap_or(DEFAULT_PROBE_MIB).max(1) << 20;
    let (sized, cpu_cache) = llama::hybrid::calibrate::cpu_probe_bytes(probe);
    let cpu_probe = if probe_mib.is_some() { probe } else { sized };
    let threads = rayon::current_num_threads();
    let stored = if refresh { None } else { load(home, threads) };
    // A calibration of another thread count comes back with its CPU figures cleared: saved
    // again once they are measured.
    let mut changed = stored.as_ref().is_none_or(|c| c.cpu.is_empty());
    let mut cal = match stored {
        Some(cal) => cal,
        None => {
            tracing::info!("calibrating: disk reads ({} MiB probe)", probe >> 20);
            Calibration {
                version: CALIBRATION_VERSION,
                disk_gbps: measure_disk_gbps(home, probe)?,
                cpu_threads: threads,
                cpu_probe_bytes: cpu_probe as u64,
                cpu_cache_bytes: cpu_cache,
                cpu: Vec::new(),
                gpu: None,
            }
        }
    };
    for dtype in cal.missing_dtypes(dtypes) {
        tracing::info!(
            "calibrating: the CPU's {dtype:?} matmuls on {threads} threads ({} MiB probe; \
             last-level caches {})",
            cpu_probe >> 20,
            cpu_cache.map_or("unknown".into(), |c| format!("{} MiB", c >> 20))
        );
        cal.cpu
            .push(llama::hybrid::calibrate::measure_cpu(dtype, cpu_probe)?);
        cal.cpu_probe_bytes = cpu_probe as u64;
        cal.cpu_cache_bytes = cpu_cache.or(cal.cpu_cache_bytes);
        changed = true;
    }
    if let Some(be) = gpu {
        match &mut cal.gpu {
            None => {
                tracing::info!(
                    "calibrating: the GPU's {dtypes:?} matmuls, host→device copies, handoffs"
                );
                cal.gpu = Some(llama::hybrid::calibrate::measure_gpu(
                    be,
                    dtypes,
                    2 * probe,
                )?);
                changed = true;
            }
            Some(rates) => {
                for dtype in rates.missing_dtypes(dtypes) {
                    tracing::info!("calibrating: the GPU's {dtype:?} matmuls");
                    rates
                        .matmul
                        .extend(llama::hybrid::calibrate::measure_gpu_matmuls(be, dtype)?);
                    changed = true;
                }
            }
        }
        let missing = cal
            .gpu
            .as_ref()
            .map_or_else(|| dtypes.to_vec(), |rates| rates.missing_concurrent(dtypes));
        for dtype in missing {
            tracing::info!(
                "calibrating: the CPU's {dtype:?} matmuls and host→device copies at the same \
                 time ({} MiB each)",
                cpu_probe >> 20
            );
            let measured = llama::hybrid::calibrate::measure_concurrent(be, dtype, cpu_probe)?;
            if let Some(rates) = cal.gpu.as_mut() {
                rates.concurrent.extend(measured);
            }
            changed = true;
        }
    }
    if changed {
        save(home, &cal)?;
        tracing::info!("calibration kept in {}", path(home).display());
    }
    Ok(cal)
}

/// The placement planner's tok/s for a pass of a model of `meta` run on residency plan `plan`
/// on GPU `gpu` with `mode` (what `bench` prints beside what it achieves), from this
/// machine's figures (what is missing is measured now, before anything is timed). `None` for
/// every pass, with a warning, when the figures cannot be had.
pub fn predictor(
    meta: &weights_format::Metadata,
    plan: &residency::Plan,
    gpu: &llama::CudaBackend,
    mode: residency::PlacementMode,
) -> Box<dyn Fn(residency::PassKind) -> Option<f64>> {
    let prepared = (|| -> anyhow::Result<_> {
        let layout = residency::ModelLayout::from_metadata(meta)?;
        let units = residency::units(meta, &layout);
        let dtypes = residency::placement::dtypes_by_bytes(&units);
        let cal = ensure(&home(), &dtypes, Some(gpu), false, None)?;
        Ok((units, cal))
    })();
    match prepared {
        Ok((units, cal)) => {
            let plan = plan.clone();
            Box::new(move |pass| {
                residency::plan_placement(&units, &cal, mode, &[(pass, Some(&plan))])
                    .ok()
                    .map(|p| p.passes[0].tokens_per_s)
            })
        }
        Err(err) => {
            tracing::warn!("no predicted tok/s: {err:#}");
            Box::new(|_| None)
        }
    }
}
