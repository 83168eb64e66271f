//! Where each family keeps each of our tensors: one table per family and source format
//! (llama.cpp's GGUF names, Hugging Face's safetensors names). The converters look our
//! canonical names up here; nothing else in them depends on the family's tensor names.
//!
//! Names are written with `{l}` for the layer index. Phi-3 stores Q, K and V as one fused
//! matrix and the FFN gate and up projections as another; we split them on conversion (rows
//! are contiguous, so a part is a byte range of the fused tensor and quantized blocks stay
//! whole), so every family's layer has the same separate matrices and the forward pass needs
//! no fused variant.

use weights_format::{Architecture, ModelConfig, names::*};

/// Which rows of a source tensor are ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// The whole tensor.
    All,
    /// Of a fused `[q; k; v]` projection: the query rows (`n_heads·head_dim`).
    FusedQ,
    /// The key rows (`n_kv_heads·head_dim`, after the query rows).
    FusedK,
    /// The value rows (the last `n_kv_heads·head_dim`).
    FusedV,
    /// Of a fused `[gate; up]` projection: the first `ffn_dim` rows.
    FusedGate,
    /// The last `ffn_dim` rows.
    FusedUp,
}

impl Rows {
    /// The row range `(first, count)` of this part for `config`, or None for [`Rows::All`].
    pub fn range(self, config: &ModelConfig) -> Option<(u64, u64)> {
        let q = u64::from(config.n_heads) * u64::from(config.head_dim);
        let kv = u64::from(config.n_kv_heads) * u64::from(config.head_dim);
        let ffn = u64::from(config.ffn_dim);
        match self {
            Rows::All => None,
            Rows::FusedQ => Some((0, q)),
            Rows::FusedK => Some((q, kv)),
            Rows::FusedV => Some((q + kv, kv)),
            Rows::FusedGate => Some((0, ffn)),
            Rows::FusedUp => Some((ffn, ffn)),
        }
    }

    /// How many rows the fused source tensor has in all, or None for [`Rows::All`].
    pub fn fused_rows(self, config: &ModelConfig) -> Option<u64> {
        let q = u64::from(config.n_heads) * u64::from(config.head_dim);
        let kv = u64::from(config.n_kv_heads) * u64::from(config.head_dim);
        match self {
            Rows::All => None,
            Rows::FusedQ | Rows::FusedK | Rows::FusedV => Some(q + 2 * kv),
            Rows::FusedGate | Rows::FusedUp => Some(2 * u64::from(config.ffn_dim)),
        }
    }
}

/// One of our tensors in a source: its name there (`{l}` = layer) and which of its rows.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub ours: &'static str,
    pub theirs: &'static str,
    pub rows: Rows,
}

const fn e(ours: &'static str, theirs: &'static str) -> Entry {
    Entry {
        ours,
        theirs,
        rows: Rows::All,
    }
}

const fn part(ours: &'static str, theirs: &'static str, rows: Rows) -> Entry {
    Entry { ours, theirs, rows }
}

/// A family's names in both source formats and how its tensors differ from ours.
#[derive(Debug, Clone, Copy)]
pub struct FamilyTable {
    pub arch: Architecture,
    pub gguf: &'static [Entry],
    pub hf: &'static [Entry],
    /// llama.cpp stores `attn_q`/`attn_k` rows permuted for its interleaved RoPE (only for
    /// the `llama` architecture; the others use NEOX-style RoPE, which is our order).
    pub gguf_permutes_qk: bool,
    /// The checkpoint's norm weights are `w − 1` (Gemma); the converter stores `1 + w`.
    /// llama.cpp's GGUF files already hold `1 + w`.
    pub hf_norms_minus_one: bool,
    /// Hugging Face `architectures` names of this family.
    pub hf_classes: &'static [&'static str],
}

impl FamilyTable {
    /// The entry for one of our tensors in the GGUF or Hugging Face table.
    pub fn find(entries: &'static [Entry], ours: &str) -> Option<&'static Entry> {
        entries.iter().find(|e| e.ours == ours)
    }
}

/// The name in a source for `layer` (`{l}` replaced).
pub fn source_name(theirs: &str, layer: Option<u32>) -> String {
    match layer {
        Some(l) => theirs.replace("{l}", &l.to_string()),
        None => theirs.to_string(),
    }
}

const GGUF_GLOBAL: [Entry; 3] = [
    e(TOKEN_EMBD, "token_embd.weight"),
    e(OUTPUT_NORM, "output_norm.weight"),
    e(OUTPUT, "output.weight"),
];
const HF_GLOBAL: [Entry; 3] = [
    e(TOKEN_EMBD, "model.embed_tokens.weight"),
    e(OUTPUT_NORM, "model.norm.weight"),
    e(OUTPUT, "lm_head.weight"),
];

/// LLaMA's layer, which the other families extend (or, where they store it otherwise, write
/// out in full).
const GGUF_LLAMA_LAYER: [Entry; 9] = [
    e(ATTN_NORM, "blk.{l}.attn_norm.weight"),
    e(ATTN_Q, "blk.{l}.attn_q.weight"),
    e(ATTN_K, "blk.{l}.attn_k.weight"),
    e(ATTN_V, "blk.{l}.attn_v.weight"),
    e(ATTN_OUTPUT, "blk.{l}.attn_output.weight"),
    e(FFN_NORM, "blk.{l}.ffn_norm.weight"),
    e(FFN_GATE, "blk.{l}.ffn_gate.weight"),
    e(FFN_UP, "blk.{l}.ffn_up.weight"),
    e(FFN_DOWN, "blk.{l}.ffn_down.weight"),
];
const HF_LLAMA_LAYER: [Entry; 9] = [
    e(ATTN_NORM, "model.layers.{l}.input_layernorm.weight"),
    e(ATTN_Q, "model.layers.{l}.self_attn.q_proj.weight"),
    e(ATTN_K, "model.layers.{l}.self_attn.k_proj.weight"),
    e(ATTN_V, "model.layers.{l}.self_attn.v_proj.weight"),
    e(ATTN_OUTPUT, "model.layers.{l}.self_attn.o_proj.weight"),
    e(FFN_NORM, "model.layers.{l}.post_attention_layernorm.weight"),
    e(FFN_GATE, "model.layers.{l}.mlp.gate_proj.weight"),
    e(FFN_UP, "model.layers.{l}.mlp.up_proj.weight"),
    e(FFN_DOWN, "model.layers.{l}.mlp.down_proj.weight"),
];

/// `parts` one after the other, as an array of `N` entries (a const, so that a table is
/// `'static`).
const fn concat<const N: usize>(parts: &[&[Entry]]) -> [Entry; N] {
    let mut out = [e("", ""); N];
    let (mut n, mut p) = (0, 0);
    while p < parts.len() {
        let mut i = 0;
        while i < parts[p].len() {
            out[n] = parts[p][i];
            n += 1;
            i += 1;
        }
        p += 1;
    }
    assert!(n == N, "the parts fill the table");
    out
}

/// A table of the given parts (arrays of entries; the order does not matter).
macro_rules! table {
    ($($part:expr),+ $(,)?) => {{
        const PARTS: &[&[Entry]] = &[$(&$part),+];
        const N: usize = {
            let (mut n, mut p) = (0, 0);
            while p < PARTS.len() {
                n += PARTS[p].len();
                p += 1;
            }
            n
        };
        const T: [Entry; N] = concat::<N>(PARTS);
        &T
    }};
}

pub const LLAMA: FamilyTable = FamilyTable {
    arch: Architecture::Llama,
    gguf: table!(GGUF_GLOBAL, GGUF_LLAMA_LAYER),
    hf: table!(HF_GLOBAL, HF_LLAMA_LAYER),
    gguf_permutes_qk: true,
    hf_norms_minus_one: false,
    hf_classes: &["LlamaForCausalLM", "MistralForCausalLM"],
};

/// LLaMA's layer with biases on the Q, K and V projections.
pub const QWEN2: FamilyTable = FamilyTable {
    arch: Architecture::Qwen2,
    gguf: table!(
        GGUF_GLOBAL,
        GGUF_LLAMA_LAYER,
        [
            e(ATTN_Q_BIAS, "blk.{l}.attn_q.bias"),
            e(ATTN_K_BIAS, "blk.{l}.attn_k.bias"),
            e(ATTN_V_BIAS, "blk.{l}.attn_v.bias"),
        ]
    ),
    hf: table!(
        HF_GLOBAL,
        HF_LLAMA_LAYER,
        [
            e(ATTN_Q_BIAS, "model.layers.{l}.self_attn.q_proj.bias"),
            e(ATTN_K_BIAS, "model.layers.{l}.self_attn.k_proj.bias"),
            e(ATTN_V_BIAS, "model.layers.{l}.self_attn.v_proj.bias"),
        ]
    ),
    gguf_permutes_qk: false,
    hf_norms_minus_one: false,
    hf_classes: &["Qwen2ForCausalLM"],
};

/// LLaMA's layer with a norm of each Q and K head.
pub const QWEN3: FamilyTable = FamilyTable {
    arch: Architecture::Qwen3,
    gguf: table!(
        GGUF_GLOBAL,
        GGUF_LLAMA_LAYER,
        [
            e(ATTN_Q_NORM, "blk.{l}.attn_q_norm.weight"),
            e(ATTN_K_NORM, "blk.{l}.attn_k_norm.weight"),
        ]
    ),
    hf: table!(
        HF_GLOBAL,
        HF_LLAMA_LAYER,
        [
            e(ATTN_Q_NORM, "model.layers.{l}.self_attn.q_norm.weight"),
            e(ATTN_K_NORM, "model.layers.{l}.self_attn.k_norm.weight"),
        ]
    ),
    gguf_permutes_qk: false,
    hf_norms_minus_one: false,
    hf_classes: &["Qwen3ForCausalLM"],
};

/// Gemma 3: in GGUF, LLaMA's layer with Q/K head norms and norms of the attention and FFN
/// outputs. Its Hugging Face names differ: its `post_attention_layernorm` is the norm of the
/// attention output, and `pre_feedforward_layernorm` the FFN's input norm.
pub const GEMMA3: FamilyTable = FamilyTable {
    arch: Architecture::Gemma3,
    gguf: table!(
        GGUF_GLOBAL,
        GGUF_LLAMA_LAYER,
        [
            e(ATTN_Q_NORM, "blk.{l}.attn_q_norm.weight"),
            e(ATTN_K_NORM, "blk.{l}.attn_k_norm.weight"),
            e(ATTN_POST_NORM, "blk.{l}.post_attention_norm.weight"),
            e(FFN_POST_NORM, "blk.{l}.post_ffw_norm.weight"),
        ]
    ),
    hf: table!(
        HF_GLOBAL,
        [
            e(ATTN_NORM, "model.layers.{l}.input_layernorm.weight"),
            e(ATTN_Q, "model.layers.{l}.self_attn.q_proj.weight"),
            e(ATTN_K, "model.layers.{l}.self_attn.k_proj.weight"),
            e(ATTN_V, "model.layers.{l}.self_attn.v_proj.weight"),
            e(ATTN_Q_NORM, "model.layers.{l}.self_attn.q_norm.weight"),
            e(ATTN_K_NORM, "model.layers.{l}.self_attn.k_norm.weight"),
            e(ATTN_OUTPUT, "model.layers.{l}.self_attn.o_proj.weight"),
            e(
                ATTN_POST_NORM,
                "model.layers.{l}.post_attention_layernorm.weight"
            ),
            e(
                FFN_NORM,
                "model.layers.{l}.pre_feedforward_layernorm.weight"
            ),
            e(FFN_GATE, "model.layers.{l}.mlp.gate_proj.weight"),
            e(FFN_UP, "model.layers.{l}.mlp.up_proj.weight"),
            e(FFN_DOWN, "model.layers.{l}.mlp.down_proj.weight"),
            e(
                FFN_POST_NORM,
                "model.layers.{l}.post_feedforward_layernorm.weight"
            ),
        ]
    ),
    gguf_permutes_qk: false,
    hf_norms_minus_one: true,
    hf_classes: &["Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"],
};

pub const PHI3: FamilyTable = FamilyTable {
    arch: Architecture::Phi3,
    gguf: table!(
        GGUF_GLOBAL,
        [
            e(ATTN_NORM, "blk.{l}.attn_norm.weight"),
            part(ATTN_Q, "blk.{l}.attn_qkv.weight", Rows::FusedQ),
            part(ATTN_K, "blk.{l}.attn_qkv.weight", Rows::FusedK),
            part(ATTN_V, "blk.{l}.attn_qkv.weight", Rows::FusedV),
            e(ATTN_OUTPUT, "blk.{l}.attn_output.weight"),
            e(FFN_NORM, "blk.{l}.ffn_norm.weight"),
            part(FFN_GATE, "blk.{l}.ffn_up.weight", Rows::FusedGate),
            part(FFN_UP, "blk.{l}.ffn_up.weight", Rows::FusedUp),
            e(FFN_DOWN, "blk.{l}.ffn_down.weight"),
        ]
    ),
    hf: table!(
        HF_GLOBAL,
        [
            e(ATTN_NORM, "model.layers.{l}.input_layernorm.weight"),
            part(
                ATTN_Q,
                "model.layers.{l}.self_attn.qkv_proj.weight",
                Rows::FusedQ
            ),
            part(
                ATTN_K,
                "model.layers.{l}.self_attn.qkv_proj.weight",
                Rows::FusedK
            ),
            part(
                ATTN_V,
                "model.layers.{l}.self_attn.qkv_proj.weight",
                Rows::FusedV
            ),
            e(ATTN_OUTPUT, "model.layers.{l}.self_attn.o_proj.weight"),
            e(FFN_NORM, "model.layers.{l}.post_attention_layernorm.weight"),
            part(
                FFN_GATE,
                "model.layers.{l}.mlp.gate_up_proj.weight",
                Rows::FusedGate
            ),
            part(
                FFN_UP,
                "model.layers.{l}.mlp.gate_up_proj.weight",
                Rows::FusedUp
            ),
            e(FFN_DOWN, "model.layers.{l}.mlp.down_proj.weight"),
        ]
    ),
    gguf_permutes_qk: false,
    hf_norms_minus_one: false,
    hf_classes: &["Phi3ForCausalLM"],
};

/// Every family's table.
pub const FAMILIES: [FamilyTable; 5] = [LLAMA, QWEN2, QWEN3, GEMMA3, PHI3];

/// The table of `arch`.
pub fn table(arch: Architecture) -> &'static FamilyTable {
    FAMILIES
        .iter()
        .find(|t| t.arch == arch)
        .expect("every architecture has a table")
}

/// The family of a Hugging Face `architectures` class name.
pub fn from_hf_class(class: &str) -> Option<&'static FamilyTable> {
    FAMILIES.iter().find(|t| t.hf_classes.contains(&class))
}

#[cfg(test)]
mod tests {
    use super::*;
    use weights_format::layout::{self, BlobKind};

    /// Every tensor the layout asks of a family has an entry in both of its tables, and no
    /// entry names a tensor the family does not have.
    #[test]
    fn tables_cover_exactly_the_layout() {
        for t in FAMILIES {
            let config = ModelConfig::of_family(t.arch);
            let mut needed: Vec<&str> = [BlobKind::Embed, BlobKind::Layer(0), BlobKind::Output]
                .into_iter()
                .flat_map(|k| layout::blob_tensors(&config, k))
                .map(|s| s.name)
                .collect();
            needed.push(OUTPUT);
            needed.sort();
            needed.dedup();
            for entries in [t.gguf, t.hf] {
                let mut have: Vec<&str> = entries.iter().map(|e| e.ours).collect();
                have.sort();
                assert_eq!(have, needed, "{}", t.arch);
            }
        }
    }
}
