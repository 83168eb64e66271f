//! The blocks a pass is built from, over [`Backend`] ops: the attention block and the FFN
//! block of a layer, and the LM head (llama.cpp's llama-graph to [`super::arch`]'s llama-model).
//! Each block reads its weights by role from the layer's resolved table, so it serves every
//! family whose layer has those tensors; a family's choices ([`Norm`], [`Activation`]) are
//! matched here, in one place.

use crate::LlamaError;
use crate::backend::{AttentionSeq, AttentionShape, Backend, KvStoreSeq, RowGroup};
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
    /// The RoPE inverse frequencies `[head_dim / 2]`.
    pub inv_freq: B::Buf,
}

impl<B: Backend> State<B> {
    pub fn new(be: &B, c: &LlamaConfig, max_rows: usize) -> Result<State<B>, LlamaError> {
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
            inv_freq: be.upload(&c.rope_inv_freq)?,
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
    pub dim: usize,
    pub ffn_dim: usize,
    pub eps: f32,
    pub norm: Norm,
    pub activation: Activation,
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
            dim: c.dim,
            ffn_dim: c.ffn_dim,
            eps: c.rms_norm_eps,
            norm: table.family.norm,
            activation: table.family.activation,
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
        Norm::Rms => be.rmsnorm(x, rows, w, p.eps, out)?,
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

    /// Attention: `x += Wo · attn(rope(Wq·n), rope(Wk·n), Wv·n)`, `n = norm(x)`, each segment
    /// at its own positions against its own cache (layer `l` of it).
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
        // Each sequence's rows at its own positions, into its own cache ([capacity, kv_dim]
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
        be.rope_store_kv_batch(
            &mut s.q,
            &mut s.k,
            &s.v,
            &mut stores,
            p.attention,
            &s.inv_freq,
        )?;
        drop(stores);
        let seqs: Vec<AttentionSeq<'_, B::KvBuf>> = self
            .segs
            .iter()
            .map(|g| AttentionSeq {
                row0: g.row0,
                rows: g.rows,
                pos0: g.pos0,
                k_cache: &g.kv[l].0,
                v_cache: &g.kv[l].1,
            })
            .collect();
        be.attention_batch(&s.q, &seqs, p.attention, &mut s.att)?;
        let wo = w.w(LayerRole::AttnOutput)?; // [dim, n_heads·hd]
        be.matmul_add_batch(&s.att, &p.groups, wo, &mut s.xb2, &mut s.x)?;
        Ok(())
    }

    /// FFN: `x += W_down · (act(W_gate·n) ⊙ W_up·n)`, `n = norm(x)`.
    fn ffn(&mut self, w: &Layer<'_>) -> Result<(), LlamaError> {
        let (be, s, p) = (self.be, &mut *self.s, self.p);
        norm(be, p, &s.x, p.rows, w.w(LayerRole::FfnNorm)?, &mut s.xb)?; // [dim]
        let w_gate = w.w(LayerRole::Gate)?; // [ffn, dim]
        let w_up = w.w(LayerRole::Up)?; // [ffn, dim]
        be.matmul_batch(
            &s.xb,
            &p.groups,
            &[w_gate, w_up],
            &mut [&mut s.hb, &mut s.hb2],
        )?;
        match p.activation {
            Activation::Silu => be.swiglu(&mut s.hb, &s.hb2, p.rows * p.ffn_dim)?,
        }
        let w_down = w.w(LayerRole::Down)?; // [dim, ffn]
        be.matmul_add_batch(&s.hb, &p.groups, w_down, &mut s.xb2, &mut s.x)?;
        Ok(())
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
        Ok(())
    }
}
