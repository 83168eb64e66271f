//! The servers running on this machine, for `gdsllm ps`: `gdsllm serve` writes
//! `$GDSLLM_HOME/run/<pid>.json` ({pid, url, model, dir}) once it listens and removes it when
//! it stops; a file whose process is gone is ignored and removed.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One running server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningServer {
    pub pid: u32,
    pub url: String,
    pub model: String,
    pub dir: PathBuf,
}

fn run_dir() -> anyhow::Result<PathBuf> {
    Ok(gdsllm_store::gdsllm_home()?.join("run"))
}

/// Removes the server's file when dropped.
pub struct Registration {
    path: PathBuf,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Records this process's server. A failure only costs `gdsllm ps` its entry, so it is logged,
/// not fatal.
pub fn register(url: &str, model: &str, dir: &Path) -> Option<Registration> {
    let entry = RunningServer {
        pid: std::process::id(),
        url: url.to_string(),
        model: model.to_string(),
        dir: dir.to_path_buf(),
    };
    let written = run_dir().and_then(|run| {
        std::fs::create_dir_all(&run)?;
        let path = run.join(format!("{}.json", entry.pid));
        let temp = run.join(format!(".{}.json", entry.pid));
        std::fs::write(&temp, serde_json::to_vec(&entry)?)?;
        std::fs::rename(&temp, &path)?;
        Ok(path)
    });
    match written {
        Ok(path) => Some(Registration { path }),
        Err(err) => {
            tracing::warn!("cannot record this server for `gdsllm ps`: {err:#}");
            None
        }
    }
}

/// The servers whose process is alive, by pid.
pub fn running() -> anyhow::Result<Vec<RunningServer>> {
    let run = run_dir()?;
    let entries = match std::fs::read_dir(&run) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut servers = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json")
            || entry.file_name().to_string_lossy().starts_with('.')
        {
            continue;
        }
        let Ok(server) = std::fs::read(&path)
            .map_err(anyhow::Error::from)
            .and_then(|b| Ok(serde_json::from_slice::<RunningServer>(&b)?))
        else {
            continue;
        };
        if Path::new(&format!("/proc/{}", server.pid)).exists() {
            servers.push(server);
        } else {
            let _ = std::fs::remove_file(&path);
        }
    }
    servers.sort_by_key(|s| s.pid);
    Ok(servers)
}
