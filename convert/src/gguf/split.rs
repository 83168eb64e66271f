//! Split GGUFs, in the layout of llama.cpp's `gguf-split`: `NAME-00001-of-0000N.gguf` to
//! `NAME-0000N-of-0000N.gguf`, each part a complete GGUF with its own tensor infos and data
//! section. The first part carries the model's metadata and `split.no` = 0, `split.count` = N
//! and `split.tensors.count` (the tensors of all parts); the others carry only the three
//! `split.*` keys. The checks are llama-model-loader's (each part's `split.no` is its
//! position, no tensor appears twice, the tensors add up to `split.tensors.count`), plus two
//! that tell parts of different splits apart: every part repeats the first's `split.count`
//! and `split.tensors.count`.

use std::path::{Path, PathBuf};

use super::{GgufError, GgufFile};

/// The part's position, from 0 (`LLM_KV_SPLIT_NO`).
pub const SPLIT_NO: &str = "split.no";
/// How many parts there are (`LLM_KV_SPLIT_COUNT`).
pub const SPLIT_COUNT: &str = "split.count";
/// How many tensors all parts hold together (`LLM_KV_SPLIT_TENSORS_COUNT`).
pub const SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// A part's file name taken apart: `NAME-00002-of-00003.gguf`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitName<'a> {
    /// What precedes `-00002-of-00003.gguf`.
    pub prefix: &'a str,
    /// The part's number, from 1, as in the name.
    pub number: u32,
    /// How many parts the name says there are.
    pub count: u32,
}

impl SplitName<'_> {
    /// The file name of part `number` (from 1) of the same split.
    pub fn part(&self, number: u32) -> String {
        format!("{}-{number:05}-of-{:05}.gguf", self.prefix, self.count)
    }

    /// The file name of the parts merged into one: `NAME.gguf`.
    pub fn merged(&self) -> String {
        format!("{}.gguf", self.prefix)
    }
}

/// `NAME-00002-of-00003.gguf` taken apart; None for a name without that ending (five digits
/// each, llama.cpp's `%05d`).
pub fn split_name(file_name: &str) -> Option<SplitName<'_>> {
    let stem = file_name.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, number) = head.rsplit_once('-')?;
    let five_digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !five_digits(number) || !five_digits(count) {
        return None;
    }
    Some(SplitName {
        prefix,
        number: number.parse().ok()?,
        count: count.parse().ok()?,
    })
}

fn split_error(path: &Path, reason: String) -> GgufError {
    GgufError::Split {
        path: path.to_path_buf(),
        reason,
    }
}

impl GgufFile {
    /// Opens a model's GGUF: a single file as [`GgufFile::open`] does, or, when `path` is the
    /// first part of a split GGUF, every part (found beside it by name) as one file whose
    /// tensors lie in their parts ([`GgufTensorInfo::part`](super::GgufTensorInfo::part)).
    /// The metadata is the first part's.
    pub fn open_model(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let mut first = GgufFile::open(path)?;
        let count = match first.split_key(SPLIT_COUNT)? {
            None | Some(0 | 1) => return Ok(first),
            Some(n) => n,
        };
        let file_name = first
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("")
            .to_string();
        let name = split_name(&file_name);
        let number = first.required_split_key(SPLIT_NO)?;
        if number != 0 {
            let hint = name
                .map(|n| format!("; convert the first part, {}", n.part(1)))
                .unwrap_or_default();
            return Err(split_error(
                &first.path,
                format!(
                    "this is part {} of {count} ({SPLIT_NO} = {number}), not the first{hint}",
                    number + 1
                ),
            ));
        }
        let Some(name) = name.filter(|n| n.number == 1 && u64::from(n.count) == count) else {
            return Err(split_error(
                &first.path,
                format!(
                    "{SPLIT_COUNT} is {count}, but the file name does not end in \
                     -00001-of-{count:05}.gguf, so its other parts cannot be found (keep the \
                     names llama.cpp's gguf-split gives the parts)"
                ),
            ));
        };
        let tensors_count = first.required_split_key(SPLIT_TENSORS_COUNT)?;
        let dir = first
            .path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        for number in 2..=name.count {
            let part_path: PathBuf = dir.join(name.part(number));
            if !part_path.is_file() {
                return Err(split_error(
                    &part_path,
                    format!(
                        "part {number} of {count} of {} is missing (all parts must be in one \
                         directory, named as gguf-split names them)",
                        name.merged()
                    ),
                ));
            }
            let part = GgufFile::open(&part_path)?;
            let index = (number - 1) as usize;
            let part_no = part.required_split_key(SPLIT_NO)?;
            if part_no != index as u64 {
                return Err(split_error(
                    &part_path,
                    format!(
                        "{SPLIT_NO} is {part_no}, but part {number} of {count} must say {index}: \
                         the parts are from different splits, or were renamed"
                    ),
                ));
            }
            for (key, expected) in [(SPLIT_COUNT, count), (SPLIT_TENSORS_COUNT, tensors_count)] {
                let found = part.split_key(key)?;
                if found != Some(expected) {
                    return Err(split_error(
                        &part_path,
                        format!(
                            "{key} is {} where the first part ({file_name}) says {expected}: \
                             the parts are from different splits",
                            found.map_or_else(|| "missing".to_string(), |f| f.to_string())
                        ),
                    ));
                }
            }
            let GgufFile {
                path,
                file,
                tensors,
                unsupported,
                ..
            } = part;
            for mut tensor in tensors {
                if let Some(&other) = first.tensor_index.get(&tensor.name) {
                    return Err(split_error(
                        &path,
                        format!(
                            "tensor {} is in part {} too: a tensor appears twice",
                            tensor.name,
                            first.tensors[other].part + 1
                        ),
                    ));
                }
                tensor.part = index;
                first
                    .tensor_index
                    .insert(tensor.name.clone(), first.tensors.len());
                first.tensors.push(tensor);
            }
            first.unsupported.extend(unsupported);
            first.other_parts.push((path, file));
        }
        let found = (first.tensors.len() + first.unsupported.len()) as u64;
        if found != tensors_count {
            return Err(split_error(
                &first.path,
                format!(
                    "{SPLIT_TENSORS_COUNT} is {tensors_count}, but the {count} parts hold \
                     {found} tensors: a part is damaged or from another split"
                ),
            ));
        }
        Ok(first)
    }

    /// The files of the model, the first part (or the only file) first.
    pub fn part_paths(&self) -> impl Iterator<Item = &Path> {
        std::iter::once(self.path.as_path())
            .chain(self.other_parts.iter().map(|(p, _)| p.as_path()))
    }

    /// Whether the model was opened from several parts.
    pub fn is_split(&self) -> bool {
        !self.other_parts.is_empty()
    }

    fn split_key(&self, key: &str) -> Result<Option<u64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => value
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.wrong(key, value, "a non-negative integer")),
        }
    }

    fn required_split_key(&self, key: &str) -> Result<u64, GgufError> {
        self.split_key(key)?.ok_or_else(|| self.missing(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_names_are_taken_apart_and_made_again() {
        let name = split_name("m-Q4_K_M-00002-of-00003.gguf").unwrap();
        assert_eq!((name.prefix, name.number, name.count), ("m-Q4_K_M", 2, 3));
        assert_eq!(name.part(1), "m-Q4_K_M-00001-of-00003.gguf");
        assert_eq!(name.merged(), "m-Q4_K_M.gguf");
        for other in [
            "m.gguf",
            "m-1-of-2.gguf",
            "m-00001-of-00002.bin",
            "m-0001a-of-00002.gguf",
        ] {
            assert_eq!(split_name(other), None, "{other}");
        }
    }
}
