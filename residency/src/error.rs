//! Typed errors of the residency cache; each names the setting, file or numbers involved.

use std::path::PathBuf;

/// Everything that can go wrong while planning, allocating or reading.
#[derive(Debug, thiserror::Error)]
pub enum ResidencyError {
    #[error("invalid residency setting {setting}: {reason}")]
    InvalidOption {
        setting: &'static str,
        reason: String,
    },
    #[error("model layout: {file}: {reason}")]
    Layout { file: String, reason: String },
    #[error(
        "device budget too small: {budget} bytes minus {reserved} reserved for KV cache, \
         activations and margin leaves {available} bytes, but the smallest plan needs \
         {needed} bytes: a ring of {slots} staging slots of {slot_bytes} bytes (the largest \
         streamed blob, {largest_file}) = {ring_bytes} bytes, plus {resident_bytes} bytes kept \
         resident so that the slots need not be larger"
    )]
    BudgetTooSmall {
        budget: u64,
        reserved: u64,
        available: u64,
        needed: u64,
        slots: usize,
        slot_bytes: u64,
        ring_bytes: u64,
        resident_bytes: u64,
        largest_file: String,
    },
    #[error(
        "reserved bytes ({reserved}) for KV cache, activations and margin exceed the device \
         budget ({budget})"
    )]
    ReservedExceedsBudget { budget: u64, reserved: u64 },
    #[error(
        "--resident-layers {requested}: {needed} bytes (resident set plus staging ring) do not \
         fit in the {available} usable bytes of the device budget (the model has {n_layers} layers)"
    )]
    ResidentLayersDoNotFit {
        requested: usize,
        n_layers: usize,
        needed: u64,
        available: u64,
    },
    #[error("blob index {blob} out of range: the model has {count} blobs")]
    UnknownBlob { blob: usize, count: usize },
    #[error(
        "{file} ({length} bytes) is not in the plan's pass order and is larger than a staging \
         slot ({slot_bytes} bytes); read it with read_range instead"
    )]
    BlobLargerThanSlot {
        file: String,
        length: u64,
        slot_bytes: u64,
    },
    #[error(
        "all {slots} staging slots are held by live guards; drop a guard before acquiring \
         another streamed blob, or raise --prefetch"
    )]
    AllSlotsPinned { slots: usize },
    #[error("range {offset}..{end} is outside {file} ({length} bytes)")]
    RangeOutOfBounds {
        file: String,
        offset: u64,
        end: u64,
        length: u64,
    },
    #[error("{path}: file is {actual} bytes but metadata.json says {expected}")]
    BlobLength {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error(transparent)]
    Io(#[from] gds_io::HostIoError),
    #[error("reading {file} failed: {message}")]
    ReadFailed { file: String, message: String },
    #[error("could not allocate {bytes} bytes of device memory for {what}")]
    Alloc { bytes: u64, what: String },
    #[error(
        "{file}: checksum mismatch on its first read: metadata.json says xxh3:{expected:016x}, \
         the bytes read hash to xxh3:{actual:016x} (the file is corrupt; `gdsllm verify` checks \
         every blob)"
    )]
    Checksum {
        file: String,
        expected: u64,
        actual: u64,
    },
    #[error("{file}: fetching it from {url} failed: {message}")]
    Fetch {
        file: String,
        url: String,
        message: String,
    },
    #[error(
        "{file} fetched from {url}: checksum mismatch: metadata.json says \
         xxh3:{expected:016x}, the bytes hash to xxh3:{actual:016x} (the served copy is corrupt \
         or changed); they are not kept"
    )]
    FetchedChecksum {
        file: String,
        url: String,
        expected: u64,
        actual: u64,
    },
    #[error("{path}: {reason}")]
    Origin { path: PathBuf, reason: String },
    #[error("the residency reader thread has stopped")]
    ReaderStopped,
}
