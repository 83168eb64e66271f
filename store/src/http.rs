//! `gdsllm pull https://HOST/path/file.gguf`: a GGUF from any HTTP(S) server (or every part of
//! a split one, from the URL of its first part), downloaded into
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
use crate::pull::{
    PartsProgress, PullOptions, PullProgress, Pulled, convert_into_store, stored_from,
};

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

/// The files to download for `url`: (URL, file name) of the file, or of every part of a split
/// GGUF when `url` names its first part (`NAME-00001-of-0000N.gguf`; the others are its
/// siblings on the server).
fn files_of(url: &str, options: &PullOptions) -> Result<Vec<(String, String)>, StoreError> {
    let file_name = file_name_of(url)?;
    let Some(split) = gdsllm_convert::gguf::split_name(&file_name) else {
        return Ok(vec![(url.to_string(), file_name)]);
    };
    let error = |reason: String| StoreError::SplitGguf {
        origin: url.to_string(),
        file: file_name.clone(),
        reason,
    };
    if split.number != 1 {
        return Err(error(format!(
            "this is part {} of {}; pull the first part, {}",
            split.number,
            split.count,
            split.part(1)
        )));
    }
    if split.count > 1 && options.sha256.is_some() {
        return Err(error(format!(
            "--sha256 names one file, and this GGUF is split into {} parts (each part is checked \
             against the sha256 the server gives, if any)",
            split.count
        )));
    }
    // `https://HOST/DIR/NAME-00001-of-00003.gguf?QUERY` → the same DIR and QUERY for each part.
    let path_end = url.find(['?', '#']).unwrap_or(url.len());
    let dir = &url[..path_end - file_name.len()];
    let query = &url[path_end..];
    Ok((1..=split.count)
        .map(|number| {
            let name = split.part(number);
            (format!("{dir}{name}{query}"), name)
        })
        .collect())
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
    let files = files_of(url, options)?;
    let file_name = files[0].1.clone();
    let downloads = store.downloads_dir();
    std::fs::create_dir_all(&downloads).map_err(io(&downloads))?;
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
    let label = match files.len() {
        1 => file_name.clone(),
        n => format!("{file_name} ({n} parts)"),
    };
    let bar = PartsProgress::new(progress, &label, 0);
    let mut downloaded: Vec<gdsllm_fetch::Downloaded> = Vec::with_capacity(files.len());
    let mut fetched = 0;
    for (part_url, part_name) in &files {
        let dest = downloads.join(part_name);
        let part = match gdsllm_fetch::download(&client, part_url, &dest, &download_options, &bar) {
            Ok(part) => part,
            Err(err) => {
                // The parts before are complete, but a pull that failed holds nothing.
                for earlier in &downloaded {
                    std::fs::remove_file(&earlier.path).map_err(io(&earlier.path))?;
                }
                bar.finish();
                return Err(err.into());
            }
        };
        match &part.sha256_checked_against {
            Some(who) => tracing::info!("{part_name}: sha256 {} matches {who}", part.sha256),
            None => tracing::warn!(
                "{part_name}: the server gives no sha256 to check against (pass --sha256 HEX); \
                 its length was checked, and its sha256 is {}",
                part.sha256
            ),
        }
        bar.done_with(part.size);
        fetched += part.fetched;
        downloaded.push(part);
    }
    bar.finish();
    let name = options
        .name
        .clone()
        .unwrap_or_else(|| name_for_gguf(&file_name));
    let first = &downloaded[0];
    // A split GGUF has no one sha256; its parts were each checked.
    let sha256 = (downloaded.len() == 1).then(|| first.sha256.clone());
    let record = Record::now(url, sha256, first.etag.clone(), None);
    let converted = convert_into_store(
        store,
        &first.path,
        &name,
        record,
        TargetDType::Keep,
        progress,
    );
    let kept = options.keep_download && converted.is_ok();
    if !kept {
        // Converted, or not convertible: either way the bytes are not needed again (a
        // download that is not a valid GGUF would fail the same way next time).
        for part in &downloaded {
            std::fs::remove_file(&part.path).map_err(io(&part.path))?;
        }
    }
    Ok(Pulled {
        gguf: kept.then(|| first.path.clone()),
        fetched_bytes: fetched,
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
