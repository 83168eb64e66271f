//! Model names (`NAME[:TAG]`), the names given to pulled models when the user gives none, and
//! the quantization a GGUF file's name announces.

use crate::error::StoreError;

fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// Whether `name` is a valid model name: `NAME` or `NAME:TAG`, each part starting with a letter
/// or digit and made of letters, digits, `.`, `_` and `-`.
pub fn check_name(name: &str) -> Result<(), StoreError> {
    let part_ok = |part: &str| {
        part.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
            && part.chars().all(name_char)
    };
    let ok = name.len() <= 128
        && match name.split_once(':') {
            Some((base, tag)) => part_ok(base) && part_ok(tag),
            None => part_ok(name),
        };
    if ok {
        Ok(())
    } else {
        Err(StoreError::BadName {
            name: name.to_string(),
        })
    }
}

/// Whether `text` could be a model name (so that `-m` looks it up instead of calling it an
/// unknown form).
pub fn looks_like_name(text: &str) -> bool {
    check_name(text).is_ok()
}

/// `text` lowercased with every character a name cannot have turned into `-`.
fn sanitize(text: &str) -> String {
    let cleaned: String = text
        .to_ascii_lowercase()
        .chars()
        .map(|c| if name_char(c) { c } else { '-' })
        .collect();
    let trimmed = cleaned.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if trimmed.is_empty() {
        "model".to_string()
    } else {
        trimmed.to_string()
    }
}

/// `base:tag` from free text, sanitized.
pub fn name_with_tag(base: &str, tag: Option<&str>) -> String {
    match tag {
        Some(tag) => format!("{}:{}", sanitize(base), sanitize(tag)),
        None => sanitize(base),
    }
}

/// The directory name for a model named `name` (`:` is awkward in paths).
pub fn dir_for(name: &str) -> String {
    name.replace(':', "-")
}

/// Whether one `-`/`.`-separated token of a GGUF file name is a quantization (`Q4_K_M`,
/// `IQ4_XS`, `Q8_0`, `F16`, `BF16`, `TQ1_0`, `MXFP4`...).
fn is_quant_token(token: &str) -> bool {
    let t = token.to_ascii_uppercase();
    if matches!(t.as_str(), "F16" | "F32" | "BF16" | "FP16" | "FP32") || t.starts_with("MXFP4") {
        return true;
    }
    let rest = t
        .strip_prefix("TQ")
        .or_else(|| t.strip_prefix("IQ"))
        .or_else(|| t.strip_prefix('Q'));
    let Some(rest) = rest else {
        return false;
    };
    let mut parts = rest.split('_');
    let bits = parts.next().unwrap_or("");
    !bits.is_empty()
        && bits.chars().all(|c| c.is_ascii_digit())
        && parts.all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric()))
}

/// `name-00001-of-00003.gguf` → (`name.gguf`, Some((1, 3))); other names unchanged.
pub fn split_part(file_name: &str) -> (String, Option<(u32, u32)>) {
    match gdsllm_convert::gguf::split_name(file_name) {
        Some(split) => (split.merged(), Some((split.number, split.count))),
        None => (file_name.to_string(), None),
    }
}

/// The quantization a GGUF file name announces: its last token that is one
/// (`SmolLM2-135M-Instruct.Q4_1.gguf` → `Q4_1`), upper case.
pub fn quant_of_file_name(file_name: &str) -> Option<String> {
    let base = file_name.rsplit('/').next().unwrap_or(file_name);
    let (whole, _) = split_part(base);
    let stem = whole.strip_suffix(".gguf").unwrap_or(&whole);
    stem.rsplit(['-', '.'])
        .find(|t| is_quant_token(t))
        .map(str::to_ascii_uppercase)
}

/// The name a GGUF file is stored under when the user gives none:
/// `SmolLM2-135M-Instruct.Q4_1.gguf` → `smollm2-135m-instruct:q4_1`.
pub fn name_for_gguf(file_name: &str) -> String {
    let base = file_name.rsplit('/').next().unwrap_or(file_name);
    let (whole, _) = split_part(base);
    let stem = whole.strip_suffix(".gguf").unwrap_or(&whole);
    match quant_of_file_name(base) {
        Some(quant) => {
            // The model part: the stem without the quant token and its separator.
            let upper = stem.to_ascii_uppercase();
            let model = upper
                .rfind(&quant)
                .map(|at| &stem[..at])
                .unwrap_or(stem)
                .trim_end_matches(['-', '.', '_']);
            name_with_tag(model, Some(&quant))
        }
        None => sanitize(stem),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tags() {
        for ok in ["smollm2", "qwen2.5:7b-q4_k_m", "a", "Llama-3.1_8B:Q4_K_M"] {
            check_name(ok).unwrap();
        }
        for bad in [
            "", ":x", "x:", "a:b:c", "-a", "a/b", "a b", ".hidden", "x:.y",
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(dir_for("qwen2.5:7b"), "qwen2.5-7b");
        assert_eq!(
            name_with_tag("Qwen2.5 7B!", Some("Q4_K_M")),
            "qwen2.5-7b:q4_k_m"
        );
    }

    #[test]
    fn quant_tokens_are_found_at_the_end_of_file_names() {
        for (file, quant) in [
            ("SmolLM2-135M-Instruct.Q4_1.gguf", Some("Q4_1")),
            ("Qwen2.5-7B-Instruct-Q4_K_M.gguf", Some("Q4_K_M")),
            ("Meta-Llama-3.1-8B-Instruct-IQ4_XS.gguf", Some("IQ4_XS")),
            ("model-bf16-00001-of-00002.gguf", Some("BF16")),
            ("sub/dir/llama-f16.gguf", Some("F16")),
            ("Q4_K_M/Model-Q4_K_M-00002-of-00003.gguf", Some("Q4_K_M")),
            ("ggml-model.gguf", None),
            ("Model-7B-Instruct.gguf", None),
        ] {
            assert_eq!(quant_of_file_name(file).as_deref(), quant, "{file}");
        }
    }

    #[test]
    fn split_parts_are_recognised() {
        assert_eq!(
            split_part("m-Q4_K_M-00002-of-00003.gguf"),
            ("m-Q4_K_M.gguf".to_string(), Some((2, 3)))
        );
        assert_eq!(
            split_part("m-Q4_K_M.gguf"),
            ("m-Q4_K_M.gguf".to_string(), None)
        );
        assert_eq!(
            split_part("m-1-of-2.gguf"),
            ("m-1-of-2.gguf".to_string(), None)
        );
    }

    #[test]
    fn pulled_files_get_names_with_their_quant_as_tag() {
        assert_eq!(
            name_for_gguf("SmolLM2-135M-Instruct.Q4_1.gguf"),
            "smollm2-135m-instruct:q4_1"
        );
        assert_eq!(name_for_gguf("Qwen2.5-7B-Q4_K_M.gguf"), "qwen2.5-7b:q4_k_m");
        assert_eq!(name_for_gguf("ggml-model.gguf"), "ggml-model");
    }
}
