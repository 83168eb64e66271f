//! Split GGUFs (llama.cpp's gguf-split layout), written by the test from a tiny model with the
//! crate's own GGUF writer: the first part converts, with its siblings, to the same bytes as
//! the file they split; a missing part, parts of different splits and wrong counts are errors
//! that name the part, and leave no output behind.

use std::path::{Path, PathBuf};

use gdsllm_convert::convert::{ConvertOptions, NoProgress, convert};
use gdsllm_convert::gguf::GgufValue;
use gdsllm_convert::gguf_writer::GgufBuilder;
use gdsllm_convert::testing::{TinyLlama, dir_files};
use weights_format::DType;

const PARTS: usize = 3;

fn part_name(number: usize, count: usize) -> String {
    format!("tiny-Q8_0-{number:05}-of-{count:05}.gguf")
}

/// Writes `parts` as gguf-split names them into `dir`; returns the first part's path.
fn write_parts(dir: &Path, parts: &[GgufBuilder]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for (i, part) in parts.iter().enumerate() {
        part.write_to(&dir.join(part_name(i + 1, parts.len())))
            .unwrap();
    }
    dir.join(part_name(1, parts.len()))
}

/// The error converting `input` into `out` gives, as text; `out` must not exist afterwards.
fn convert_error(input: &Path, out: &Path) -> String {
    let err = convert(input, out, &ConvertOptions::default(), &NoProgress)
        .expect_err("the conversion must fail")
        .to_string();
    assert!(!out.exists(), "{err}: {} was left behind", out.display());
    err
}

/// Asserts that `err` says each of `needles`.
fn assert_says(err: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            err.contains(needle),
            "{err}\n(expected it to say {needle:?})"
        );
    }
}

#[test]
fn a_split_gguf_converts_to_the_same_bytes_as_the_file_it_splits() {
    let root = tempfile::tempdir().unwrap();
    let whole = TinyLlama::new(11, false).gguf(DType::Q8_0);
    let merged = root.path().join("merged/tiny-Q8_0.gguf");
    std::fs::create_dir_all(merged.parent().unwrap()).unwrap();
    whole.write_to(&merged).unwrap();
    let parts = whole.split(PARTS);
    assert!(parts.iter().all(|p| !p.tensor_names().is_empty()));
    let first = write_parts(&root.path().join("split"), &parts);

    let options = ConvertOptions::default();
    let from_merged = root.path().join("from-merged");
    let from_split = root.path().join("from-split");
    convert(&merged, &from_merged, &options, &NoProgress).unwrap();
    let report = convert(&first, &from_split, &options, &NoProgress).unwrap();
    assert!(report.tensors > 0);
    let (a, b) = (dir_files(&from_merged), dir_files(&from_split));
    assert_eq!(
        a.iter().map(|f| &f.0).collect::<Vec<_>>(),
        b.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(
            x == y,
            "{name} differs between the merged and the split conversion"
        );
    }
}

#[test]
fn bad_split_gguf_parts_are_errors_that_name_the_part() {
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("out");
    let whole = TinyLlama::new(12, false).gguf(DType::Q8_0);
    let parts = whole.split(PARTS);

    // A missing part.
    let dir = root.path().join("missing");
    let first = write_parts(&dir, &parts);
    std::fs::remove_file(dir.join(part_name(3, PARTS))).unwrap();
    let err = convert_error(&first, &out);
    assert_says(&err, &[&part_name(3, PARTS), "part 3 of 3", "missing"]);

    // Not the first part.
    let dir = root.path().join("second");
    write_parts(&dir, &parts);
    let err = convert_error(&dir.join(part_name(2, PARTS)), &out);
    assert_says(
        &err,
        &[
            "part 2 of 3",
            &format!("convert the first part, {}", part_name(1, PARTS)),
        ],
    );

    // Part 2 of a split in two, renamed into a split in three: parts of different splits.
    let dir = root.path().join("mixed");
    let first = write_parts(&dir, &parts);
    whole.split(2)[1]
        .write_to(&dir.join(part_name(2, PARTS)))
        .unwrap();
    let err = convert_error(&first, &out);
    assert_says(
        &err,
        &[&part_name(2, PARTS), "split.count is 2", "different splits"],
    );

    // Two parts swapped by name: each one's split.no gives it away.
    let dir = root.path().join("swapped");
    let first = write_parts(&dir, &parts);
    parts[2].write_to(&dir.join(part_name(2, PARTS))).unwrap();
    parts[1].write_to(&dir.join(part_name(3, PARTS))).unwrap();
    let err = convert_error(&first, &out);
    assert_says(&err, &[&part_name(2, PARTS), "split.no is 2"]);

    // A tensor count that does not add up (in every part, so that they agree with each other).
    let dir = root.path().join("count");
    let mut miscounted = whole.split(PARTS);
    let wrong = whole.tensor_names().len() as i32 + 1;
    for part in &mut miscounted {
        part.set_kv("split.tensors.count", GgufValue::I32(wrong));
    }
    let err = convert_error(&write_parts(&dir, &miscounted), &out);
    assert_says(
        &err,
        &[
            &part_name(1, PARTS),
            &format!("split.tensors.count is {wrong}"),
            &format!("hold {} tensors", wrong - 1),
        ],
    );

    // A tensor in two parts.
    let dir = root.path().join("twice");
    let mut doubled = whole.split(PARTS);
    let name = doubled[0].tensor_names()[0].clone();
    doubled[1].tensor(&name, DType::F32, &[4], vec![0; 16]);
    let err = convert_error(&write_parts(&dir, &doubled), &out);
    assert_says(
        &err,
        &[
            &part_name(2, PARTS),
            &format!("tensor {name} is in part 1 too"),
        ],
    );

    // A first part whose name does not say which split it belongs to.
    let dir = root.path().join("renamed");
    let first = write_parts(&dir, &parts);
    let renamed = dir.join("tiny.gguf");
    std::fs::rename(&first, &renamed).unwrap();
    let err = convert_error(&renamed, &out);
    assert_says(&err, &["tiny.gguf", "-00001-of-00003.gguf"]);
}
