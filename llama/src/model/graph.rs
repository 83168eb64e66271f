//! The blocks a pass is built from, over [`Backend`] ops: the attention block and the FFN
//! block of a layer, and the LM head (llama.cpp's llama-graph to [`super::arch`]'s llama-model).
//! Each block reads its weights by role from the layer's resolved table, so it serves every
//! family whose layer has those tensors; a family's choices ([`Norm`], [`Activation`]) are
//! matched here, in one place.

use crate::LlamaError;
use crate::backend::{
    AttentionParams, AttentionSeq, AttentionShape, Backend, GatedWeights, KvStoreSeq, NormInto,
    RowGroup,
};
use crate::config::LlamaConfig;
use crate::weights::{WeightBytes, WeightView};

use super::arch::{Activation, LayerRole, LayerTable, ModelTable, Norm};

/// Activation buffers, sized once for `max_rows` positions per pass.
pub(crate) struct State<B: Backend> {
    /// Residual stream `[rows, dim]`.
    pub x: B::Buf,
    /// Normed input of a sub-block `[rows, dim]`.
    pub xb: B::Buf,
    /// Sub-block output before the residual add `[rows, dim]`.
    pub xb2: B::Buf,
    pub q: B::Buf,   // [rows, q_dim]
    pub k: B::Buf,   // [rows, kv_dim]
    pub v: B::Buf,   // [rows, kv_dim]
    pub att: B::Buf, // [rows, q_dim]
    pub hb: B::Buf,  // [rows, ffn_dim]
    pub hb2: B::Buf, // [rows, ffn_dim]
    /// The residual and normed residual of each sequence's last position `[logit_rows, dim]`.
    pub last: B::Buf,
    pub last_norm: B::Buf,
    /// `[logit_rows, vocab]`
    pub logits: B::Buf,
    /// Rows `last`, `last_norm` and `logits` hold: 1 until a batch needs more.
    pub logit_rows: usize,
    /// The RoPE inverse frequencies `[head_dim / 2]` of the layers that see the whole context.
    pub inv_freq: B::Buf,
    /// Those of the sliding-window layers (their own base), when the model has any.
    pub inv_freq_sliding: Option<B::Buf>,
}

impl<B: Backend> State<B> {
    /// Buffers for passes of up to `max_rows` rows of a model opened with `context` positions
    /// (which picks longrope's factors).
    pub fn new(
        be: &B,
        c: &LlamaConfig,
        max_rows: usize,
        context: usize,
    ) -> Result<State<B>, LlamaError> {
        Ok(State {
            x: be.alloc(max_rows * c.dim)?,
            xb: be.alloc(max_rows * c.dim)?,
            xb2: be.alloc(max_rows * c.dim)?,
            q: be.alloc(max_rows * c.q_dim())?,
            k: be.alloc(max_rows * c.kv_dim())?,
            v: be.alloc(max_rows * c.kv_dim())?,
            att: be.alloc(max_rows * c.q_dim())?,
            hb: be.alloc(max_rows * c.ffn_dim)?,
            hb2: be.alloc(max_rows * c.ffn_dim)?,
            last: be.alloc(c.dim)?,
            last_norm: be.alloc(c.dim)?,
            logits: be.alloc(c.vocab_size)?,
            logit_rows: 1,
            inv_freq: be.upload(&c.rope_inv_freq(false, context))?,
            inv_freq_sliding: match c.sliding_window {
                Some(_) => Some(be.upload(&c.rope_inv_freq(true, context))?),
                None => None,
            },
        })
    }
}

/// A sequence's rows in one pass (`row0 .. row0+rows` of the activations, at positions
/// `pos0 ..`), with the cache layers they read and fill.
pub(crate) struct Segment<'a, B: Backend> {
    pub kv: &'a mut [(B::KvBuf, B::KvBuf)],
    pub row0: usize,
    pub rows: usize,
    pub pos0: usize,
    pub solo_rows: usize,
    /// Whether the logits after the last row are wanted.
    pub logits: bool,
}

/// What every block of one pass shares.
pub(crate) struct PassShape {
    /// Rows of all segments together.
    pub rows: usize,
    /// Each segment's rows, for the matmuls (which take all rows at once: that is what shares
    /// the pass over the weights).
    pub groups: Vec<RowGroup>,
    pub attention: AttentionShape,
    /// Each layer's score scale and window.
    pub layer_attention: Vec<AttentionParams>,
    pub dim: usize,
    pub vocab: usize,
    pub eps: f32,
    pub norm: Norm,
    pub activation: Activation,
    /// The embeddings are multiplied by this (when it is not 1).
    pub embedding_scale: f32,
    pub final_logit_softcap: Option<f32>,
}

impl PassShape {
    /// The shape of a pass of `rows` rows in `groups` over a model of config `c` and family
    /// table `table`.
    pub fn of(c: &LlamaConfig, table: &ModelTable, rows: usize, groups: &[RowGroup]) -> PassShape {
        PassShape {
            rows,
            groups: groups.to_vec(),
            attention: AttentionShape {
                n_heads: c.n_heads,
                n_kv_heads: c.n_kv_heads,
                head_dim: c.head_dim,
            },
            layer_attention: (0..c.n_layers)
                .map(|l| AttentionParams {
                    scale: c.attention_scale,
                    window: c.window(l),
                })
                .collect(),
            dim: c.dim,
            vocab: c.vocab_size,
            eps: c.rms_norm_eps,
            norm: table.family.norm,
            activation: table.family.activation,
            embedding_scale: c.embedding_scale,
            final_logit_softcap: c.final_logit_softcap,
        }
    }
}

/// One layer's tensors: its resolved table over the bytes of its acquired blob.
pub(crate) struct Layer<'a> {
    pub table: &'a LayerTable,
    pub bytes: WeightBytes<'a>,
}

impl<'a> Layer<'a> {
    fn w(&self, role: LayerRole) -> Result<WeightView<'a>, LlamaError> {
        self.table.view(role, self.bytes)
    }

    /// The tensor of an optional step, when the family's layer has it.
    fn w_if(&self, role: LayerRole) -> Result<Option<WeightView<'a>>, LlamaError> {
        self.table.view_if(role, self.bytes)
    }
}

/// `out = norm(x)` over `rows` rows with weight `w: [dim]`.
pub(crate) fn norm<B: Backend>(
    be: &B,
    p: &PassShape,
    x: &B::Buf,
    rows: usize,
    w: WeightView<'_>,
    out: &mut B::Buf,
) -> Result<(), LlamaError> {
    match p.norm {
        Norm::Rms => be.rmsnorm(x, rows, w, p.eps, out, NormInto::Write)?,
    }
    Ok(())
}

/// The residual connection after a sub-block: `x += input · wᵀ`, or with a post-norm
/// `x += rmsnorm(input · wᵀ) · post` (Gemma), the product going through `scratch`.
fn residual_add<B: Backend>(
    be: &B,
    p: &PassShape,
    input: &B::Buf,
    w: WeightView<'_>,
    post: Option<WeightView<'_>>,
    scratch: &mut B::Buf,
    x: &mut B::Buf,
) -> Result<(), LlamaError> {
    match post {
        None => be.matmul_add_batch(input, &p.groups, w, scratch, x)?,
        Some(post) => {
            be.matmul_batch(input, &p.groups, &[w], &mut [&mut *scratch])?;
            match p.norm {
                Norm::Rms => be.rmsnorm(scratch, p.rows, post, p.eps, x, NormInto::Add)?,
            }
        }
    }
    Ok(())
}

/// One pass being computed: the backend, the activations, the sequences' rows and what they
/// share.
pub(crate) struct Graph<'g, 'k, B: Backend> {
    pub be: &'g B,
    pub s: &'g mut State<B>,
    pub segs: &'g mut [Segment<'k, B>],
    pub p: &'g PassShape,
}

impl<B: Backend> Graph<'_, '_, B> {
    /// Layer `l`: the attention block, then the FFN block.
    pub fn layer(&mut self, l: usize, w: &Layer<'_>) -> Result<(), LlamaError> {
        self.attention(l, w)?;
        self.ffn(w)
    }

    /// The inputs of the pass scaled, when the config says so (Gemma's √dim).
    pub fn scale_embeddings(&mut self) -> Result<(), LlamaError> {
        let p = self.p;
        if p.embedding_scale != 1.0 {
            self.be
                .scale(&mut self.s.x, p.rows * p.dim, p.embedding_scale)?;
        }
        Ok(())
    }

    /// Attention: `x += post(Wo · attn(rope(qn(Wq·n + bq)), rope(kn(Wk·n + bk)), Wv·n + bv))`,
    /// `n = norm(x)`, each segment at its own positions against its own cache (layer `l` of
    /// it); the biases, the Q/K head norms `qn`, `kn` and the post-norm `post` are steps of the
    /// families whose layer has those tensors.
    fn attention(&mut self, l: usize, w: &Layer<'_>) -> Result<(), LlamaError> {
        let (be, s, p) = (self.be, &mut *self.s, self.p);
        norm(be, p, &s.x, p.rows, w.w(LayerRole::AttnNorm)?, &mut s.xb)?; // [dim]
        let wq = w.w(LayerRole::Q)?; // [n_heads·hd, dim]
        let wk = w.w(LayerRole::K)?; // [n_kv·hd, dim]
        let wv = w.w(LayerRole::V)?; // [n_kv·hd, dim]
        be.matmul_batch(
            &s.xb,
            &p.groups,
            &[wq, wk, wv],
            &mut [&mut s.q, &mut s.k, &mut s.v],
        )?;
        for (role, out) in [
            (LayerRole::QBias, &mut s.q), // [n_heads·hd]
            (LayerRole::KBias, &mut s.k), // [n_kv·hd]
            (LayerRole::VBias, &mut s.v), // [n_kv·hd]
        ] {
            if let Some(bias) = w.w_if(role)? {
                be.add_bias(out, p.rows, bias)?;
            }
        }
        let shape = p.attention;
        for (role, out, heads) in [
            (LayerRole::QNorm, &mut s.q, shape.n_heads),    // [hd]
            (LayerRole::KNorm, &mut s.k, shape.n_kv_heads), // [hd]
        ] {
            if let Some(weight) = w.w_if(role)? {
                be.rmsnorm_pieces(out, p.rows * heads, weight, p.eps)?;
            }
        }
        let params = p.layer_attention[l];
        let inv_freq = match (&s.inv_freq_sliding, params.window) {
            (Some(sliding), Some(_)) => sliding,
            _ => &s.inv_freq,
        };
        // Each sequence's rows at its own positions, into its own cache ([slots, kv_dim]
        // each).
        let mut stores: Vec<KvStoreSeq<'_, B::KvBuf>> = self
            .segs
            .iter_mut()
            .map(|g| {
                let (k_cache, v_cache) = &mut g.kv[l];
                KvStoreSeq {
                    row0: g.row0,
                    rows: g.rows,
                    pos0: g.pos0,
                    k_cache,
                    v_cache,
                }
            })
            .collect();
        be.rope_store_kv_batch(&mut s.q, &mut s.k, &s.v, &mut stores, shape, inv_freq)?;
        let seqs: Vec<AttentionSeq<'_, B::KvBuf>> =
            stores.iter().map(KvStoreSeq::attention).collect();
        be.attention_batch(&s.q, &seqs, shape, params, &mut s.att)?;
        let wo = w.w(LayerRole::AttnOutput)?; // [dim, n_heads·hd]
        let post = w.w_if(LayerRole::AttnPostNorm)?; // [dim]
        residual_add(be, p, &s.att, wo, post, &mut s.xb2, &mut s.x)
    }

    /// FFN: `x += post(W_down · (act(W_gate·n) ⊙ W_up·n))`, `n = norm(x)`; the post-norm when
    /// the family's layer has it.
    fn ffn(&mut self, w: &Layer<'_>) -> Result<(), LlamaError> {
        let (be, s, p) = (self.be, &mut *self.s, self.p);
        norm(be, p, &s.x, p.rows, w.w(LayerRole::FfnNorm)?, &mut s.xb)?; // [dim]
        let w_gate = w.w(LayerRole::Gate)?; // [ffn, dim]
        let w_up = w.w(LayerRole::Up)?; // [ffn, dim]
        let ffn = GatedWeights {
            gate: w_gate,
            up: w_up,
            act: p.activation,
        };
        be.matmul_gated_batch(&s.xb, &p.groups, ffn, &mut s.hb, &mut s.hb2)?;
        let w_down = w.w(LayerRole::Down)?; // [dim, ffn]
        let post = w.w_if(LayerRole::FfnPostNorm)?; // [dim]
        residual_add(be, p, &s.hb, w_down, post, &mut s.xb2, &mut s.x)
    }

    /// The LM head for the last position of each segment that wants logits: those rows of
    /// `x`, normed, times `head: [vocab, dim]`, into `logits` (`[n, vocab]`, in segment
    /// order). Each row is one decode-like position, computed as it is alone.
    pub fn head(
        &mut self,
        output_norm: WeightView<'_>,
        head: WeightView<'_>,
    ) -> Result<(), LlamaError> {
        let (be, s, p) = (self.be, &mut *self.s, self.p);
        let mut n = 0;
        for g in self.segs.iter().filter(|g| g.logits) {
            be.copy_rows(&s.x, g.row0 + g.rows - 1, &mut s.last, n, 1, p.dim)?;
            n += 1;
        }
        norm(be, p, &s.last, n, output_norm, &mut s.last_norm)?;
        be.matmul_batch(
            &s.last_norm,
            &vec![RowGroup::solo(1); n],
            &[head],
            &mut [&mut s.logits],
        )?;
        if let Some(cap) = p.final_logit_softcap {
            be.softcap(&mut s.logits, n * p.vocab, cap)?;
        }
        Ok(())
    }
}
