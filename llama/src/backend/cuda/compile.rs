//! NVRTC compilation of the embedded kernel sources for the device's compute capability, with
//! an on-disk PTX cache keyed by source hash + architecture + NVRTC version (compiling costs
//! about a second; loading cached PTX a few milliseconds).
//!
//! The kernels live in one `.cu` file per kind of op ([`KERNEL_FILES`]), each after the shared
//! helpers of `common.cuh`; they are compiled as one program (with `#line` markers, so NVRTC's
//! messages name the right file and line). A new file of kernels is one more line in the list.

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};

use crate::LlamaError;

/// Where the kernel files are, for messages.
const KERNEL_DIR: &str = "llama/src/backend/cuda/kernels";

/// The helpers every kernel file uses (conversions, warp reductions, the quantized-activation
/// format).
const COMMON: (&str, &str) = ("common.cuh", include_str!("kernels/common.cuh"));

/// The kernel files, by kind of op.
pub(super) const KERNEL_FILES: &[(&str, &str)] = &[
    ("quant.cu", include_str!("kernels/quant.cu")),
    ("norm_rope.cu", include_str!("kernels/norm_rope.cu")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("matmul.cu", include_str!("kernels/matmul.cu")),
    ("matmul_mma.cu", include_str!("kernels/matmul_mma.cu")),
    // The dtypes added with the k-quants; after matmul.cu, whose tile and loads they use.
    ("kquants.cu", include_str!("kernels/kquants.cu")),
    // Their tensor-core batched matmuls; after matmul_mma.cu (tiles, store) and kquants.cu
    // (block decoder).
    ("kquants_mma.cu", include_str!("kernels/kquants_mma.cu")),
];

/// The program NVRTC compiles from the built-in files: `common.cuh`, then every kernel file,
/// each from its line 1 (what the tests check).
#[cfg(test)]
pub(super) fn program_source() -> String {
    program_source_from(None)
}

/// For kernel development: `GDSLLM_CUDA_KERNEL_DIR=DIR` compiles the kernel files found in DIR
/// (by name: `matmul_mma.cu`, ...) in place of the ones built into the binary, so that a kernel
/// change runs on the GPU machine without rebuilding the Rust program. Files missing from DIR
/// keep the built-in text. The source is part of the PTX cache key, as with the defines.
pub const KERNEL_DIR_ENV: &str = "GDSLLM_CUDA_KERNEL_DIR";

/// The program: `common.cuh`, then every kernel file, each from its line 1 (from `dir` where it
/// holds the file).
fn program_source_from(dir: Option<&std::path::Path>) -> String {
    let mut src = String::new();
    for &(name, built_in) in std::iter::once(&COMMON).chain(KERNEL_FILES) {
        let replaced = dir.and_then(|d| std::fs::read_to_string(d.join(name)).ok());
        if replaced.is_some() {
            tracing::info!(file = name, "kernel source from {KERNEL_DIR_ENV}");
        }
        let text = replaced.as_deref().unwrap_or(built_in);
        src.push_str(&format!("#line 1 \"{name}\"\n"));
        src.push_str(text);
        if !text.ends_with('\n') {
            src.push('\n');
        }
    }
    src
}

/// For kernel development: `GDSLLM_CUDA_DEFINES=NAME[=VALUE],...` puts a `#define` per item
/// before the program, so that variants of a kernel behind `#ifdef`s are compared in one run of
/// one binary. The defines are part of the source, hence of the PTX cache key.
pub const DEFINES_ENV: &str = "GDSLLM_CUDA_DEFINES";

fn with_defines(source: String, defines: Option<&str>) -> String {
    let Some(defines) = defines.filter(|d| !d.trim().is_empty()) else {
        return source;
    };
    let mut out = String::new();
    for item in defines.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let (name, value) = item.split_once('=').unwrap_or((item, ""));
        out.push_str(&format!("#define {name} {value}\n"));
    }
    tracing::info!(defines, "kernel defines from {DEFINES_ENV}");
    out + &source
}

/// FNV-1a: stable across Rust versions and platforms, unlike `DefaultHasher`, so cache file
/// names stay valid between builds.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The NVRTC library's version, part of the cache key: a newer NVRTC may emit different PTX.
fn nvrtc_version() -> Result<(i32, i32), LlamaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are to live locals; the caller checked that libnvrtc is loadable,
    // so the symbol lookup cannot panic.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(LlamaError::Device {
            message: format!("nvrtcVersion failed: {status:?}"),
        });
    }
    Ok((major, minor))
}

/// `$GDSLLM_HOME/kernels`, else `$XDG_CACHE_HOME/gdsllm/kernels`, else
/// `~/.cache/gdsllm/kernels`; `None` when none of these is set (then nothing is cached).
pub fn kernel_cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(home) = env("GDSLLM_HOME") {
        return Some(home.join("kernels"));
    }
    if let Some(xdg) = env("XDG_CACHE_HOME") {
        return Some(xdg.join("gdsllm").join("kernels"));
    }
    env("HOME").map(|h| h.join(".cache").join("gdsllm").join("kernels"))
}

/// Loads the kernels for `ctx`'s device: from the cache when a PTX file for this exact source,
/// architecture and NVRTC version exists and loads, else compiled now (and cached).
pub(super) fn load_module(ctx: &Arc<CudaContext>) -> Result<Arc<CudaModule>, LlamaError> {
    let dir = std::env::var_os(KERNEL_DIR_ENV).map(PathBuf::from);
    let source = with_defines(
        program_source_from(dir.as_deref()),
        std::env::var(DEFINES_ENV).ok().as_deref(),
    );
    let (major, minor) = ctx.compute_capability().map_err(|e| LlamaError::Device {
        message: format!("cuDeviceGetAttribute(compute capability): {e}"),
    })?;
    let (nv_major, nv_minor) = nvrtc_version()?;
    let arch = format!("compute_{major}{minor}");
    let file_name = format!(
        "kernels-{:016x}-{arch}-nvrtc{nv_major}.{nv_minor}.ptx",
        fnv1a64(source.as_bytes())
    );
    let cached = kernel_cache_dir().map(|d| d.join(&file_name));
    if let Some(path) = &cached
        && let Ok(text) = std::fs::read_to_string(path)
    {
        match ctx.load_module(Ptx::from_src(text)) {
            Ok(module) => {
                tracing::debug!(path = %path.display(), "CUDA kernels loaded from the cache");
                return Ok(module);
            }
            Err(e) => tracing::warn!(
                path = %path.display(),
                "cached PTX does not load ({e}); compiling again"
            ),
        }
    }
    let started = std::time::Instant::now();
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "-std=c++17".into()],
        name: Some("kernels.cu".into()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(source, opts).map_err(|e| LlamaError::Device {
        message: match e {
            CompileError::CompileError { nvrtc, log, .. } => format!(
                "NVRTC {nv_major}.{nv_minor} could not compile the kernels of {KERNEL_DIR} for \
                 {arch} ({nvrtc:?}):\n{}",
                log.to_string_lossy()
            ),
            other => format!("NVRTC {nv_major}.{nv_minor}, {KERNEL_DIR} for {arch}: {other}"),
        },
    })?;
    tracing::info!(
        arch = %arch,
        seconds = started.elapsed().as_secs_f64(),
        "compiled CUDA kernels with NVRTC"
    );
    let text = ptx.to_src();
    if let Some(path) = &cached {
        store(path, &text);
    }
    ctx.load_module(Ptx::from_src(text))
        .map_err(|e| LlamaError::Device {
            message: format!("loading the PTX of {KERNEL_DIR} for {arch}: {e}"),
        })
}

/// Writes the cache file atomically (temp file + rename), so a concurrent process never reads
/// half a file. A cache that cannot be written only costs a compile next time.
fn store(path: &std::path::Path, text: &str) {
    let write = || -> std::io::Result<()> {
        let dir = path.parent().expect("cache paths have a directory");
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(format!(
            ".{}.{}.tmp",
            std::process::id(),
            fnv1a64(text.as_bytes())
        ));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        tracing::warn!(path = %path.display(), "cannot cache compiled kernels: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_published_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn defines_go_before_the_program() {
        let src = with_defines("int x;\n".to_string(), Some("A, B=2,"));
        assert_eq!(src, "#define A \n#define B 2\nint x;\n");
        assert_eq!(with_defines("int x;\n".to_string(), Some(" ")), "int x;\n");
        assert_eq!(with_defines("int x;\n".to_string(), None), "int x;\n");
    }

    #[test]
    fn kernel_sources_are_embedded_with_line_markers() {
        let src = program_source();
        // The matmul kernels are stamped out by a macro, the others written out.
        assert!(src.contains("MATMUL_KERNELS(matmul_f16, 1)"));
        assert!(src.contains("MATMUL_Q_KERNELS(matmul_q4_1, 5)"));
        assert!(src.contains("extern \"C\" __global__ void rope_store_kv("));
        assert!(src.contains("extern \"C\" __global__ void quantize_x16("));
        // The shared helpers come first, then every file from its own line 1.
        assert!(src.starts_with("#line 1 \"common.cuh\"\n"));
        let helpers = src.find("quantize_x16_lanes(float4 v").unwrap();
        for (name, _) in KERNEL_FILES {
            let at = src.find(&format!("#line 1 \"{name}\"\n")).unwrap();
            assert!(at > helpers, "{name} comes after common.cuh");
        }
    }

    /// Every kernel starts with `pdl_begin()`: with programmatic dependent launch (device.rs,
    /// compute capability 9.0) a kernel's blocks may run while the kernel before is still
    /// running, so one that touched memory before that wait would race with it.
    #[test]
    fn every_kernel_waits_for_the_one_before_first() {
        let src = program_source();
        let mut kernels = 0;
        for (at, _) in src.match_indices("extern \"C\" __global__") {
            let body = at + src[at..].find('{').expect("a kernel has a body") + 1;
            // Macro-stamped kernels continue their lines with a backslash.
            let first = src[body..]
                .trim_start_matches(|c: char| c.is_whitespace() || c == '\\')
                .lines()
                .next()
                .unwrap_or("");
            let name = src[at..body].split('(').next().unwrap_or("").trim();
            assert!(
                first.starts_with("pdl_begin();") || first.starts_with("pdl_deferred();"),
                "{name} starts with `{first}`, not pdl_begin() or pdl_deferred()"
            );
            kernels += 1;
        }
        assert!(kernels >= 30, "found {kernels} kernel definitions");
        // The matmul implementations behind `pdl_deferred()` wait themselves, once their
        // first weights are loaded.
        let marker = "// Called after pdl_deferred(): pdl_begin() comes after the first weights";
        let mut deferred = 0;
        for (at, _) in src.match_indices(marker) {
            let body = &src[at..];
            let end = body.find("\n}\n").expect("a function ends");
            let name = body
                .lines()
                .find(|l| l.contains("__device__"))
                .unwrap_or("");
            assert!(
                body[..end].contains("pdl_begin();"),
                "{name} is marked as waiting itself but has no pdl_begin()"
            );
            deferred += 1;
        }
        assert_eq!(
            deferred, 3,
            "the matmul implementations that wait themselves"
        );
    }

    /// Every kernel `Kernels::load` looks up is defined in exactly one file.
    #[test]
    fn every_loaded_kernel_is_defined_once() {
        let loader = include_str!("device.rs");
        let src = program_source();
        let mut names = Vec::new();
        for part in loader.split("f(\"").skip(1) {
            names.push(part.split('"').next().unwrap());
        }
        // The matmul kernels are looked up per dtype by name (below), the others by literal.
        assert!(names.len() >= 15, "{names:?}");
        for name in names {
            // `NAME_r1`/`_r8` come from `…KERNELS(NAME, …)`, `NAME_r1_gated` from
            // `MATMUL_GATED_KERNEL(NAME, …)`, the others are written out.
            let defined = if let Some(stem) = name.strip_suffix("_r1_gated") {
                src.matches(&format!("MATMUL_GATED_KERNEL({stem}, "))
                    .count()
            } else {
                match name.rsplit_once('_') {
                    Some((stem, "r1" | "r8")) => src.matches(&format!("KERNELS({stem}, ")).count(),
                    _ => src.matches(&format!(" {name}(")).count(),
                }
            };
            assert_eq!(defined, 1, "kernel {name}");
        }
        // Kernels looked up per dtype through `lookup("dtype")`, each dtype's stamped out once
        // by one of `macro_names` (`macro_name(prefix_dtype, ...)`); returns how many dtypes
        // the loader names.
        let stamped_once = |lookup: &str, macro_names: &[&str], prefix: &str| {
            let mut dtypes = 0;
            for part in loader.split(&format!("{lookup}(\"")).skip(1) {
                let dtype = part.split('"').next().unwrap();
                let stamps = macro_names
                    .iter()
                    .map(|m| src.matches(&format!("{m}({prefix}_{dtype}, ")).count())
                    .sum::<usize>();
                assert_eq!(stamps, 1, "{prefix}_{dtype} by one of {macro_names:?}");
                dtypes += 1;
            }
            dtypes
        };
        // The tensor-core matmuls, by dtype: `_n1` .. `_n8` stamped out by one macro each
        // (`matmul_mma.cu`'s, or `kquants_mma.cu`'s for the k-quant-era dtypes).
        let mma = stamped_once(
            "mma",
            &["MATMUL_MMA_KERNELS", "MATMUL_MMA_KQ_KERNELS"],
            "matmul_mma",
        );
        assert_eq!(
            mma,
            weights_format::DType::ALL.len() - 1,
            "every dtype but f32"
        );
        // The `superblock` path's k-quant matmuls: `_r1` and `_r8` stamped out by one macro each.
        let superblock = stamped_once("sb", &["MATMUL_KQ_SB_KERNELS"], "matmul_sb");
        assert_eq!(superblock, 3, "q4_k, q5_k, q6_k");
    }

    /// Compiling needs libnvrtc only, no GPU: this catches a kernel source that does not
    /// compile on any machine that has the library (e.g. from the PyPI wheel
    /// nvidia-cuda-nvrtc, on LD_LIBRARY_PATH). Opt-in: `GDSLLM_NVRTC_TESTS=1`, failing when
    /// set without the library.
    #[test]
    fn nvrtc_compiles_the_program_when_asked() {
        if std::env::var("GDSLLM_NVRTC_TESTS").as_deref() != Ok("1") {
            eprintln!("skipped: set GDSLLM_NVRTC_TESTS=1 (and LD_LIBRARY_PATH to libnvrtc)");
            return;
        }
        // SAFETY: only tries to dlopen libnvrtc (cudarc panics on a call into a missing one).
        assert!(
            unsafe { cudarc::nvrtc::sys::is_culib_present() },
            "GDSLLM_NVRTC_TESTS=1 but libnvrtc is not loadable"
        );
        let (major, minor) = nvrtc_version().unwrap();
        for arch in ["compute_75", "compute_80", "compute_90"] {
            let opts = CompileOptions {
                options: vec![format!("--gpu-architecture={arch}"), "-std=c++17".into()],
                name: Some("kernels.cu".into()),
                ..Default::default()
            };
            let ptx = compile_ptx_with_opts(program_source(), opts).unwrap_or_else(|e| match e {
                CompileError::CompileError { log, .. } => {
                    panic!("NVRTC {major}.{minor}, {arch}:\n{}", log.to_string_lossy())
                }
                other => panic!("NVRTC {major}.{minor}, {arch}: {other}"),
            });
            let text = ptx.to_src();
            for entry in [
                "matmul_q4_1_r1",
                "matmul_sb_q6_k_r8",
                "matmul_mma_q4_1_n4",
                "matmul_mma_bf16_n1",
                "matmul_mma_q4_k_n8",
                "matmul_mma_q6_k_n4",
                "attention_flash_hd128",
                "attention_decode_seqs",
                "rope_store_kv_seqs",
                "mma_sum_slices",
            ] {
                assert!(
                    text.contains(&format!(".entry {entry}(")),
                    "{arch}: no {entry}"
                );
            }
            // A matmul kernel for every dtype, the k-quants' included.
            for dtype in weights_format::DType::ALL {
                let entry = format!(".entry matmul_{}_r1(", dtype.name());
                assert!(text.contains(&entry), "{arch}: no {entry} in the PTX");
            }
            // Tensor-core instructions only where the device has them (8.0 on).
            assert_eq!(
                text.contains("mma.sync.aligned.m16n8k32"),
                arch != "compute_75",
                "{arch}"
            );
            println!(
                "NVRTC {major}.{minor} compiled the kernels for {arch}: {} bytes of PTX",
                text.len()
            );
        }
    }

    /// The CPU emulator's test program (llama/tests/cuda_emu) includes the kernel files in this
    /// order too.
    #[test]
    fn the_emulator_tests_include_every_kernel_file_in_order() {
        let harness = include_str!("../../../tests/cuda_emu/kernels_test.cpp");
        let list = harness
            .split("// KERNEL FILES BEGIN")
            .nth(1)
            .and_then(|s| s.split("// KERNEL FILES END").next())
            .expect("markers");
        let included: Vec<&str> = list
            .lines()
            .filter_map(|l| l.strip_prefix("#include \""))
            .map(|l| l.trim_end_matches('"'))
            .collect();
        let want: Vec<&str> = std::iter::once(COMMON.0)
            .chain(KERNEL_FILES.iter().map(|(name, _)| *name))
            .collect();
        assert_eq!(included, want);
    }

    #[test]
    fn every_matmul_kernel_the_backend_loads_is_in_the_source() {
        // `Kernels::load` loads `matmul_<dtype>_r1` and `_r8` for every dtype, by its code;
        // the kernels are stamped out by macros with the same code.
        let program = program_source();
        let kquants = KERNEL_FILES
            .iter()
            .find(|(name, _)| *name == "kquants.cu")
            .unwrap()
            .1;
        for (code, dtype) in weights_format::DType::ALL.iter().enumerate() {
            let name = format!("matmul_{}", dtype.name());
            let stamped = [
                format!("MATMUL_KERNELS({name}, {code})"),
                format!("MATMUL_Q_KERNELS({name}, {code})"),
                format!(
                    "MATMUL_KQ_KERNELS({name}, KQ_{})",
                    dtype.name().to_uppercase()
                ),
                format!(
                    "MATMUL_KQ_R1MIN_KERNELS({name}, KQ_{})",
                    dtype.name().to_uppercase()
                ),
            ];
            assert_eq!(
                stamped
                    .iter()
                    .map(|s| program.matches(s.as_str()).count())
                    .sum::<usize>(),
                1,
                "kernel {name} with code {code}"
            );
            if code >= 6 {
                let define = format!("#define KQ_{} {code}", dtype.name().to_uppercase());
                assert!(kquants.contains(&define), "{define}");
            }
        }
    }
}
