//! Property tests: random corruption and truncation of metadata.json and of blob files never
//! panic the reader, and are always reported as an error by `Model::open` or `Model::verify`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use weights_format::{DType, FormatError, Model};

/// One pristine model, copied for each case (writing it is the expensive part).
fn pristine() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, dir) = DIR.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        common::write_tiny(&dir, DType::Q4_1, false);
        (tmp, dir)
    });
    dir
}

fn fresh_copy() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(pristine()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    (tmp, dir)
}

const BLOBS: [&str; 4] = ["embed.bin", "layer_000.bin", "layer_001.bin", "output.bin"];

/// Flips bits at each `(fraction of length, nonzero xor mask)`.
fn corrupt(path: &Path, flips: &[(f64, u8)]) {
    let mut bytes = std::fs::read(path).unwrap();
    for &(at, mask) in flips {
        let i = ((bytes.len() as f64 * at) as usize).min(bytes.len() - 1);
        bytes[i] ^= mask;
    }
    std::fs::write(path, bytes).unwrap();
}

fn truncate(path: &Path, keep_fraction: f64) -> u64 {
    let len = std::fs::metadata(path).unwrap().len();
    let keep = ((len as f64 * keep_fraction) as u64).min(len - 1);
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(keep)
        .unwrap();
    keep
}

/// The error from open, or else the one from verify; `None` if both pass.
fn open_then_verify(dir: &Path) -> Option<FormatError> {
    match Model::open(dir) {
        Err(e) => Some(e),
        Ok(model) => model.verify().err(),
    }
}

fn flips() -> impl Strategy<Value = Vec<(f64, u8)>> {
    prop::collection::vec((0.0..1.0f64, 1..=255u8), 1..4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn corrupted_metadata_is_always_an_error(flips in flips()) {
        let (_tmp, dir) = fresh_copy();
        corrupt(&dir.join("metadata.json"), &flips);
        let err = open_then_verify(&dir);
        prop_assert!(err.is_some(), "corruption {flips:?} went unnoticed");
    }

    #[test]
    fn truncated_metadata_is_always_an_error(keep in 0.0..1.0f64) {
        let (_tmp, dir) = fresh_copy();
        truncate(&dir.join("metadata.json"), keep);
        prop_assert!(open_then_verify(&dir).is_some());
    }

    #[test]
    fn corrupted_blob_is_flagged_by_verify(blob in 0..BLOBS.len(), flips in flips()) {
        let (_tmp, dir) = fresh_copy();
        corrupt(&dir.join(BLOBS[blob]), &flips);
        // Sizes are unchanged, so open passes; verify must name exactly this blob.
        let model = Model::open(&dir).unwrap();
        let err = model.verify().unwrap_err();
        prop_assert_eq!(err.blobs(), vec![BLOBS[blob]], "{}", err);
    }

    #[test]
    fn truncated_blob_fails_open(blob in 0..BLOBS.len(), keep in 0.0..1.0f64) {
        let (_tmp, dir) = fresh_copy();
        truncate(&dir.join(BLOBS[blob]), keep);
        let err = Model::open(&dir).unwrap_err();
        let is_blob_size = matches!(&err, FormatError::BlobSize { blob: b, .. } if b == BLOBS[blob]);
        prop_assert!(is_blob_size, "{}", err);
    }
}
