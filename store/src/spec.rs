//! What `gdsllm pull SPEC` and `-m SPEC` may name, told apart by its form.

use std::path::{Path, PathBuf};

use crate::error::StoreError;
use crate::names::looks_like_name;

/// A parsed model reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    /// A GdsLLM model directory on disk, used where it is.
    Dir(PathBuf),
    /// A GGUF file on disk, converted into the store once.
    GgufFile(PathBuf),
    /// A Hugging Face directory on disk (config.json + safetensors), converted once.
    HfDir(PathBuf),
    /// A Hugging Face repository, `OWNER/REPO`, with an optional quant (GGUF repositories) or
    /// storage type (safetensors repositories).
    HuggingFace { repo: String, tag: Option<String> },
    /// A GGUF file on any HTTP(S) server.
    GgufUrl(String),
    /// A GdsLLM model directory served over HTTP(S) (its URL, ending in `/`).
    RemoteDir(String),
    /// A name in the store or in the catalog of known models.
    Name(String),
}

impl ModelSpec {
    /// Tells the forms apart (see [`crate::error::ACCEPTED_FORMS`]). Paths that exist win
    /// over the other readings of the same text.
    pub fn parse(text: &str) -> Result<ModelSpec, StoreError> {
        let text = text.trim();
        if let Some(rest) = text
            .strip_prefix("https://")
            .or_else(|| text.strip_prefix("http://"))
        {
            return Ok(parse_url(text, rest));
        }
        for prefix in ["hf.co/", "huggingface.co/", "hf://"] {
            if let Some(rest) = text.strip_prefix(prefix) {
                return parse_repo(rest).ok_or_else(|| StoreError::Unrecognized {
                    spec: text.to_string(),
                });
            }
        }
        let path = Path::new(text);
        if let Ok(meta) = std::fs::metadata(path) {
            return classify_path(path, meta.is_dir());
        }
        let looks_like_path = text.starts_with(['/', '.', '~'])
            || text.to_ascii_lowercase().ends_with(".gguf")
            || text.matches('/').count() > 1;
        if looks_like_path {
            return Err(StoreError::NoSuchPath {
                spec: text.to_string(),
            });
        }
        if text.contains('/') {
            return parse_repo(text).ok_or_else(|| StoreError::Unrecognized {
                spec: text.to_string(),
            });
        }
        if looks_like_name(text) {
            return Ok(ModelSpec::Name(text.to_string()));
        }
        Err(StoreError::Unrecognized {
            spec: text.to_string(),
        })
    }

    /// The canonical text of a source, as recorded in the index (`None` for a directory or a
    /// name, which are not sources).
    pub fn source_key(&self) -> Option<String> {
        match self {
            ModelSpec::HuggingFace { repo, tag } => Some(match tag {
                Some(tag) => format!("hf.co/{repo}:{}", tag.to_ascii_uppercase()),
                None => format!("hf.co/{repo}"),
            }),
            ModelSpec::GgufUrl(url) | ModelSpec::RemoteDir(url) => Some(url.clone()),
            ModelSpec::GgufFile(path) | ModelSpec::HfDir(path) => Some(format!(
                "file:{}",
                std::fs::canonicalize(path)
                    .unwrap_or_else(|_| path.clone())
                    .display()
            )),
            ModelSpec::Dir(_) | ModelSpec::Name(_) => None,
        }
    }
}

fn repo_part_ok(part: &str) -> bool {
    part.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric())
        && part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// `OWNER/REPO[:TAG]`
fn parse_repo(text: &str) -> Option<ModelSpec> {
    let text = text.trim_end_matches('/');
    let (path, tag) = match text.rsplit_once(':') {
        Some((path, tag)) if !tag.is_empty() && !tag.contains('/') => (path, Some(tag)),
        Some(_) => return None,
        None => (text, None),
    };
    let (owner, repo) = path.split_once('/')?;
    if !repo_part_ok(owner) || !repo_part_ok(repo) {
        return None;
    }
    Some(ModelSpec::HuggingFace {
        repo: format!("{owner}/{repo}"),
        tag: tag.map(str::to_string),
    })
}

/// An http(s) URL (`rest` is what follows the scheme).
fn parse_url(url: &str, rest: &str) -> ModelSpec {
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    if matches!(host, "huggingface.co" | "hf.co" | "www.huggingface.co")
        && let Some(spec) = parse_repo(path)
    {
        return spec;
    }
    let path_only = path.split(['?', '#']).next().unwrap_or("");
    if path_only.to_ascii_lowercase().ends_with(".gguf") {
        return ModelSpec::GgufUrl(url.to_string());
    }
    let dir = url
        .strip_suffix(weights_format::METADATA_FILE)
        .unwrap_or(url);
    let mut dir = dir.to_string();
    if !dir.ends_with('/') {
        dir.push('/');
    }
    ModelSpec::RemoteDir(dir)
}

fn classify_path(path: &Path, is_dir: bool) -> Result<ModelSpec, StoreError> {
    if is_dir {
        if path.join(weights_format::METADATA_FILE).is_file() {
            return Ok(ModelSpec::Dir(path.to_path_buf()));
        }
        if path.join("config.json").is_file() {
            return Ok(ModelSpec::HfDir(path.to_path_buf()));
        }
        return Err(StoreError::NotAModel {
            path: path.to_path_buf(),
            reason: "a directory with neither metadata.json (a GdsLLM model) nor config.json (a \
                     Hugging Face model)"
                .into(),
        });
    }
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return Ok(ModelSpec::GgufFile(path.to_path_buf()));
    }
    Err(StoreError::NotAModel {
        path: path.to_path_buf(),
        reason: "a file that is not a .gguf; convert other formats with `gdsllm convert`".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(repo: &str, tag: Option<&str>) -> ModelSpec {
        ModelSpec::HuggingFace {
            repo: repo.into(),
            tag: tag.map(Into::into),
        }
    }

    #[test]
    fn each_form_is_told_apart() {
        let cases = [
            (
                "hf.co/bartowski/Qwen2.5-7B-GGUF:Q4_K_M",
                hf("bartowski/Qwen2.5-7B-GGUF", Some("Q4_K_M")),
            ),
            ("huggingface.co/o/r", hf("o/r", None)),
            ("hf://o/r:q8_0", hf("o/r", Some("q8_0"))),
            (
                "HuggingFaceTB/SmolLM2-135M-Instruct",
                hf("HuggingFaceTB/SmolLM2-135M-Instruct", None),
            ),
            ("https://huggingface.co/o/r", hf("o/r", None)),
            (
                "https://host:8080/m/x.Q4_1.gguf",
                ModelSpec::GgufUrl("https://host:8080/m/x.Q4_1.gguf".into()),
            ),
            (
                "http://127.0.0.1:9/models/smollm2",
                ModelSpec::RemoteDir("http://127.0.0.1:9/models/smollm2/".into()),
            ),
            (
                "http://h/models/s/metadata.json",
                ModelSpec::RemoteDir("http://h/models/s/".into()),
            ),
            ("smollm2", ModelSpec::Name("smollm2".into())),
            (
                "qwen2.5:7b-q4_k_m",
                ModelSpec::Name("qwen2.5:7b-q4_k_m".into()),
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(ModelSpec::parse(text).unwrap(), expected, "{text}");
        }
    }

    #[test]
    fn missing_paths_and_nonsense_say_what_is_accepted() {
        for text in ["./model.gguf", "/nonexistent/dir", "model.gguf", "a/b/c"] {
            let err = ModelSpec::parse(text).unwrap_err().to_string();
            assert!(
                err.contains("no such file") && err.contains("hf.co/OWNER/REPO"),
                "{text}: {err}"
            );
        }
        for text in ["what is this?", "o/r:", "hf.co/just-one"] {
            let err = ModelSpec::parse(text).unwrap_err().to_string();
            assert!(err.contains("accepts"), "{text}: {err}");
        }
    }

    #[test]
    fn existing_paths_win() {
        let dir = tempfile::tempdir().unwrap();
        let gguf = dir.path().join("x.gguf");
        std::fs::write(&gguf, b"GGUF").unwrap();
        assert_eq!(
            ModelSpec::parse(gguf.to_str().unwrap()).unwrap(),
            ModelSpec::GgufFile(gguf.clone())
        );
        std::fs::write(dir.path().join("config.json"), b"{}").unwrap();
        assert_eq!(
            ModelSpec::parse(dir.path().to_str().unwrap()).unwrap(),
            ModelSpec::HfDir(dir.path().to_path_buf())
        );
        let other = dir.path().join("notes.txt");
        std::fs::write(&other, b"").unwrap();
        let err = ModelSpec::parse(other.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("gdsllm convert"), "{err}");
    }
}
