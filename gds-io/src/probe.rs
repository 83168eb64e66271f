//! Facts about the machine for `gdsllm doctor`: CUDA driver version, where the CUDA libraries
//! are, whether a directory's filesystem takes O_DIRECT.

use std::path::{Path, PathBuf};

use cudarc::driver::sys;

/// The CUDA driver's version as (major, minor), e.g. (13, 0); `None` without libcuda.
pub fn cuda_driver_version() -> Option<(i32, i32)> {
    if !crate::gpu::cuda_driver_present() {
        return None;
    }
    let mut version = 0;
    // SAFETY: libcuda is loadable (checked above); writes one int through a valid pointer.
    let status = unsafe { sys::cuDriverGetVersion(&mut version) };
    (status == sys::CUresult::CUDA_SUCCESS).then_some((version / 1000, version % 1000 / 10))
}

/// Directories searched for CUDA libraries: `LD_LIBRARY_PATH`, `$CUDA_HOME/lib64`, then the
/// usual install locations.
pub fn library_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(root) = std::env::var(var) {
            dirs.push(PathBuf::from(root).join("lib64"));
        }
    }
    for dir in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
    ] {
        dirs.push(PathBuf::from(dir));
    }
    dirs.dedup();
    dirs
}

/// The most specific file named `<stem>.so.<version>` in the first directory that has one
/// (its name carries the library version, e.g. `libcublas.so.13.0.0.19`).
pub fn find_library(stem: &str) -> Option<PathBuf> {
    find_library_in(stem, &library_dirs())
}

/// [`find_library`] over the given directories.
pub fn find_library_in(stem: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    let prefix = format!("{stem}.so");
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut names: Vec<String> = entries
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n == &prefix || n.starts_with(&format!("{prefix}.")))
            .collect();
        names.sort_by_key(|n| (n.len(), n.clone()));
        if let Some(best) = names.pop() {
            return Some(dir.join(best));
        }
    }
    None
}

/// Version suffix of a library file name: `libcublas.so.13.0.0.19` → `13.0.0.19`.
pub fn library_version(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    let (_, version) = name.split_once(".so.")?;
    Some(version.to_string())
}

/// Whether files in `dir` can be read with O_DIRECT: writes a probe file there, opens it with
/// the host path and removes it.
pub fn o_direct_supported(dir: &Path) -> std::io::Result<bool> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".gdsllm-odirect-probe-{}", std::process::id()));
    std::fs::write(&probe, vec![0u8; crate::aligned::IO_ALIGN])?;
    let direct = crate::host::DirectFile::open(&probe).map(|f| f.is_direct());
    let _ = std::fs::remove_file(&probe);
    direct.map_err(std::io::Error::other)
}

/// Asks the kernel to drop the cached pages of `path`, so that a buffered read of it goes to
/// the disk (used for fair `cp`-like reference reads).
pub fn drop_page_cache(path: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path)?;
    // SAFETY: an advisory call on a descriptor we hold open; no memory is passed.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(rc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_versions_come_from_file_names() {
        assert_eq!(
            library_version(Path::new("/x/libcublas.so.13.0.0.19")).as_deref(),
            Some("13.0.0.19")
        );
        assert_eq!(library_version(Path::new("/x/libcufile.so")), None);
    }

    #[test]
    fn find_library_prefers_the_versioned_name() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "libfake.so",
            "libfake.so.1",
            "libfake.so.1.2.3",
            "libfakeother.so.9",
        ] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        let found = find_library_in("libfake", &[dir.path().join("absent"), dir.path().into()]);
        assert_eq!(found, Some(dir.path().join("libfake.so.1.2.3")));
    }

    #[test]
    fn o_direct_probe_answers_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let supported = o_direct_supported(dir.path()).unwrap();
        eprintln!("O_DIRECT on the temp dir: {supported}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
