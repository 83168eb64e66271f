//! `gdsllm pull https://HOST/path/file.gguf`: a GGUF from any HTTP(S) server, downloaded into
//! `downloads/` with range requests (resuming a partial download of an earlier run), its
//! length and sha256 checked (the user's `--sha256`, else one the server gives in its
//! headers), then converted into the store. The download is removed once converted unless it
//! is to be kept.

use gdsllm_convert::TargetDType;
use gdsllm_fetch::{Client, ClientOptions, DownloadOptions};

use crate::error::{StoreError, io};
use crate::index::Record;
use crate::layout::Store;
use crate::names::name_for_gguf;
use crate::pull::{PullOptions, PullProgress, Pulled, convert_into_store, stored_from};

/// The file name a URL's download gets: its last path segment.
fn file_name_of(url: &str) -> Result<String, StoreError> {
    let path = url.split(['?', '#']).next().unwrap_or(url);
    let name = path.rsplit('/').next().unwrap_or("");
    if !weights_format::is_plain_file_name(name) || name.starts_with('.') {
        return Err(StoreError::Unrecognized {
            spec: url.to_string(),
        });
    }
    Ok(name.to_string())
}

pub(crate) fn pull_url(
    store: &Store,
    url: &str,
    options: &PullOptions,
    progress: &dyn PullProgress,
) -> Result<Pulled, StoreError> {
    if !options.force
        && let Some((name, dir, record)) = stored_from(store, url)?
    {
        tracing::info!("{url} is in the store as {name} already (--force pulls it again)");
        return Ok(Pulled::stored(name, dir, record));
    }
    let file_name = file_name_of(url)?;
    let downloads = store.downloads_dir();
    std::fs::create_dir_all(&downloads).map_err(io(&downloads))?;
    let dest = downloads.join(&file_name);
    let client = Client::new(ClientOptions {
        retries: options.retries,
        ..ClientOptions::default()
    });
    let download_options = DownloadOptions {
        sha256: options
            .sha256
            .as_ref()
            .map(|hex| (hex.trim().to_ascii_lowercase(), "--sha256".to_string())),
        size: None,
        write_limit: options.write_limit,
    };
    progress.phase(&file_name);
    let downloaded = gdsllm_fetch::download(&client, url, &dest, &download_options, progress)?;
    match &downloaded.sha256_checked_against {
        Some(who) => tracing::info!("{file_name}: sha256 {} matches {who}", downloaded.sha256),
        None => tracing::warn!(
            "{file_name}: the server gives no sha256 to check against (pass --sha256 HEX); its \
             length was checked, and its sha256 is {}",
            downloaded.sha256
        ),
    }
    let name = options
        .name
        .clone()
        .unwrap_or_else(|| name_for_gguf(&file_name));
    let record = Record::now(
        url,
        Some(downloaded.sha256.clone()),
        downloaded.etag.clone(),
        None,
    );
    let converted = convert_into_store(store, &dest, &name, record, TargetDType::Keep, progress);
    let kept = options.keep_download && converted.is_ok();
    if !kept {
        // Converted, or not convertible: either way the bytes are not needed again (a
        // download that is not a valid GGUF would fail the same way next time).
        std::fs::remove_file(&dest).map_err(io(&dest))?;
    }
    Ok(Pulled {
        gguf: kept.then_some(dest),
        fetched_bytes: downloaded.fetched,
        ..converted?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downloads_are_named_after_the_last_path_segment() {
        assert_eq!(
            file_name_of("https://h/a/b/M.Q4_1.gguf?download=true").unwrap(),
            "M.Q4_1.gguf"
        );
        assert!(file_name_of("https://h/a/..").is_err());
        assert!(file_name_of("https://h/").is_err());
    }
}
