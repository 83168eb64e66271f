//! Opening the files of a model directory as an untrusted directory deserves: only regular
//! files (a FIFO named `metadata.json` must not block a reader forever), and nothing a symlink
//! would take outside the directory.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::FormatError;

/// What a non-regular file is, for messages.
fn kind_of(file_type: std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_socket() {
        "a socket"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_char_device() {
        "a character device"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading if it is a regular file. The open itself never blocks: it is made
/// with `O_NONBLOCK` (which regular files ignore), so a FIFO is reported instead of waited on.
/// `what` names the file in the error when it is missing.
pub(crate) fn open_regular(path: &Path, what: &str) -> Result<File, FormatError> {
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(FormatError::MissingFile {
                path: path.to_path_buf(),
                what: what.to_string(),
            });
        }
        Err(e) => return Err(FormatError::io(path, e)),
    };
    let file_type = file
        .metadata()
        .map_err(|e| FormatError::io(path, e))?
        .file_type();
    if !file_type.is_file() {
        return Err(FormatError::NotRegularFile {
            path: path.to_path_buf(),
            found: kind_of(file_type),
        });
    }
    Ok(file)
}

/// Reads a regular file of at most `limit` bytes; a larger one is an error naming the limit.
pub(crate) fn read_regular(path: &Path, what: &str, limit: u64) -> Result<Vec<u8>, FormatError> {
    let file = open_regular(path, what)?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| FormatError::io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(FormatError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    Ok(bytes)
}

/// `dir/name`, checked to be a regular file that stays inside `dir` once symlinks are
/// resolved (a symlink to another file of the same directory is fine).
pub(crate) fn file_inside(dir: &Path, name: &str, what: &str) -> Result<PathBuf, FormatError> {
    let path = dir.join(name);
    let link = match std::fs::symlink_metadata(&path) {
        Ok(md) => md.file_type().is_symlink(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(FormatError::MissingFile {
                path,
                what: what.to_string(),
            });
        }
        Err(e) => return Err(FormatError::io(&path, e)),
    };
    if link {
        let target = std::fs::canonicalize(&path).map_err(|e| FormatError::io(&path, e))?;
        let root = std::fs::canonicalize(dir).map_err(|e| FormatError::io(dir, e))?;
        if !target.starts_with(&root) {
            return Err(FormatError::OutsideModelDir { path, target });
        }
    }
    let md = std::fs::metadata(&path).map_err(|e| FormatError::io(&path, e))?;
    if !md.file_type().is_file() {
        return Err(FormatError::NotRegularFile {
            path,
            found: kind_of(md.file_type()),
        });
    }
    Ok(path)
}

/// Whether process `pid` is still running (Linux: `/proc/<pid>` exists). A recycled pid makes
/// a dead writer look alive, which only means its leftovers are kept a while longer.
pub(crate) fn process_alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Work directories next to an output that interrupted writers left behind: the entries of
/// `parent` named `<prefix><pid>…` whose process `pid` is gone (ours and live ones are left
/// alone). Used for `.<name>.partial-<pid>` here and for the converter's own staging names.
pub fn stale_work_dirs(parent: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut stale: Vec<PathBuf> = entries
        .flatten()
        .filter(|entry| {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
                return false;
            };
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            match digits.parse::<u32>() {
                Ok(pid) => pid != std::process::id() && !process_alive(pid),
                Err(_) => false,
            }
        })
        .map(|entry| entry.path())
        .collect();
    stale.sort();
    stale
}

/// Removes the `.<name>.partial-<pid>` work directories that writers killed before they could
/// clean up left next to `name` in `parent`. Returns the directories removed.
pub fn remove_stale_partials(parent: &Path, name: &str) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    for path in stale_work_dirs(parent, &format!(".{name}.partial-")) {
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {
                tracing::info!(
                    "removed {}, left by an interrupted write (its process is gone)",
                    path.display()
                );
                removed.push(path);
            }
            Err(e) => tracing::warn!("cannot remove stale {}: {e}", path.display()),
        }
    }
    removed
}
