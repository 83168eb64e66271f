// Kernels for the dtypes added with the k-quants: q5_0, q5_1, iq4_nl (32-value blocks) and
// q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs (256-value super-blocks). Compiled by NVRTC in one
// program after the other kernel files, whose helpers (h2f, f2h, load_u16 of common.cuh, the
// 16-bit activation format of `quantize_x16_lanes`, the matmul tile, store and `x16_block` of
// matmul.cu) they use; `dequant8` of quant.cu calls `kq_values8`. Layouts:
// weights-format/FORMAT.md.
//
// Dtype codes (must match `dtype_code` in cuda/device.rs: the order of `DType::ALL`): 6 q5_0,
// 7 q5_1, 8 q2_k, 9 q3_k, 10 q4_k, 11 q5_k, 12 q6_k, 13 iq4_nl, 14 iq4_xs.
//
// Every kernel works on 32-value blocks: a super-block is 8 of them (its sub-block j = block
// index % 8). `kq_block<DTYPE>` decodes one into 32 signed 8-bit levels (8 words, value 4t..4t+3
// in word t) and an affine map per 16 values, value = a[h]·level + c[h] — the shape the integer
// dot products (`dp2a`, 16-bit activations × 8-bit levels) and the decoders share.

#define KQ_Q5_0 6
#define KQ_Q5_1 7
#define KQ_Q2_K 8
#define KQ_Q3_K 9
#define KQ_Q4_K 10
#define KQ_Q5_K 11
#define KQ_Q6_K 12
#define KQ_IQ4_NL 13
#define KQ_IQ4_XS 14

struct KqBlock {
    int w[8];    // levels, 4 per word (signed bytes)
    float a[2];  // scale of values 0-15 and 16-31
    float c[2];  // offset (the mins), of values 0-15 and 16-31
};

template <int DTYPE> __device__ __forceinline__ constexpr int kq_block_len() {
    return DTYPE == KQ_Q5_0 || DTYPE == KQ_Q5_1 || DTYPE == KQ_IQ4_NL ? 32 : 256;
}
template <int DTYPE> __device__ __forceinline__ constexpr int kq_block_bytes() {
    return DTYPE == KQ_Q5_0 ? 22 : DTYPE == KQ_Q5_1 ? 24 : DTYPE == KQ_IQ4_NL ? 18 : DTYPE == KQ_Q2_K ? 84
         : DTYPE == KQ_Q3_K ? 110 : DTYPE == KQ_Q4_K ? 144 : DTYPE == KQ_Q5_K ? 176 : DTYPE == KQ_Q6_K ? 210 : 136;
}

// A little-endian u32 at p: one load where the layout keeps it 4-aligned (super-blocks whose size
// is a multiple of 4, tensors start 4096-aligned), else two 16-bit loads.
template <bool ALIGNED4>
__device__ __forceinline__ u32 kq_u32(const u8* p) {
    if constexpr (ALIGNED4) return *(const u32*)p;
    else return (u32)load_u16(p) | ((u32)load_u16(p + 2) << 16);
}

// Bits 0-3 of x as the low bit of bytes 0-3.
__device__ __forceinline__ u32 kq_spread4(u32 x) {
    return (x & 1u) | ((x & 2u) << 7) | ((x & 4u) << 14) | ((x & 8u) << 21);
}

// The iq4 levels of four indices (one per byte, 0..15): llama.cpp's `kvalues_iq4nl`, picked
// with two byte permutations of the table's halves and a select on bit 3 of each index.
__device__ __forceinline__ u32 kq_iq4_levels(u32 idx) {
    // kvalues_iq4nl = -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
    const u32 lo0 = 0xBFAD9881u, lo1 = 0xF6EADDCFu, hi0 = 0x26190D01u, hi1 = 0x71594535u;
    u32 sel = (idx & 7u) | ((idx >> 4) & 0x70u) | ((idx >> 8) & 0x700u) | ((idx >> 12) & 0x7000u);
    u32 lo = __byte_perm(lo0, lo1, sel), hi = __byte_perm(hi0, hi1, sel);
    u32 high = ((idx >> 3) & 0x01010101u) * 0xFFu;
    return (lo & ~high) | (hi & high);
}

// The 6-bit scale and min of sub-block j of a q4_k/q5_k super-block from its packed bytes (see
// `k4_scale_min` in weights_format::quant).
__device__ __forceinline__ void kq_scale_min_k4(int j, const u8* s, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// 32-value block `b` of a weight row starting at `row`.
template <int DTYPE>
__device__ __forceinline__ void kq_block(const u8* row, u64 b, KqBlock& q) {
    constexpr int len = kq_block_len<DTYPE>(), bytes = kq_block_bytes<DTYPE>();
    const u8* blk = row + (b * 32 / len) * bytes;
    const int j = (int)(b % (len / 32));  // sub-block of a super-block
    if constexpr (DTYPE == KQ_Q5_0 || DTYPE == KQ_Q5_1) {
        constexpr bool one = DTYPE == KQ_Q5_1;
        constexpr int qs = one ? 8 : 6;
        float d = h2f(load_u16(blk));
        u32 qh = kq_u32<one>(blk + qs - 4);
#pragma unroll
        for (int t = 0; t < 4; t++) {
            u32 v = kq_u32<one>(blk + qs + 4 * t);
            u32 lo = (v & 0x0F0F0F0Fu) | (kq_spread4(qh >> (4 * t)) << 4);
            u32 hi = ((v >> 4) & 0x0F0F0F0Fu) | (kq_spread4(qh >> (16 + 4 * t)) << 4);
            q.w[t] = one ? (int)lo : (int)__vsub4(lo, 0x10101010u);
            q.w[4 + t] = one ? (int)hi : (int)__vsub4(hi, 0x10101010u);
        }
        q.a[0] = q.a[1] = d;
        q.c[0] = q.c[1] = one ? h2f(load_u16(blk + 2)) : 0.f;
    } else if constexpr (DTYPE == KQ_IQ4_NL || DTYPE == KQ_IQ4_XS) {
        constexpr bool xs = DTYPE == KQ_IQ4_XS;
        const u8* qs = xs ? blk + 8 + 16 * j : blk + 2;
        float a = h2f(load_u16(blk));
        if constexpr (xs) {
            int ls = ((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((load_u16(blk + 2) >> (2 * j)) & 3) << 4);
            a *= (float)(ls - 32);
        }
#pragma unroll
        for (int t = 0; t < 4; t++) {
            u32 v = kq_u32<xs>(qs + 4 * t);
            q.w[t] = (int)kq_iq4_levels(v & 0x0F0F0F0Fu);
            q.w[4 + t] = (int)kq_iq4_levels((v >> 4) & 0x0F0F0F0Fu);
        }
        q.a[0] = q.a[1] = a;
        q.c[0] = q.c[1] = 0.f;
    } else if constexpr (DTYPE == KQ_Q4_K || DTYPE == KQ_Q5_K) {
        constexpr bool five = DTYPE == KQ_Q5_K;
        float d = h2f(load_u16(blk)), dmin = h2f(load_u16(blk + 2));
        int sc, m;
        kq_scale_min_k4(j, blk + 4, sc, m);
        const u8* qs = blk + (five ? 48 : 16) + 32 * (j / 2);
        int shift = 4 * (j % 2);
#pragma unroll
        for (int t = 0; t < 8; t++) {
            u32 v = (kq_u32<true>(qs + 4 * t) >> shift) & 0x0F0F0F0Fu;
            if constexpr (five) v |= ((kq_u32<true>(blk + 16 + 4 * t) >> j) & 0x01010101u) << 4;
            q.w[t] = (int)v;
        }
        q.a[0] = q.a[1] = d * (float)sc;
        q.c[0] = q.c[1] = -(dmin * (float)m);
    } else if constexpr (DTYPE == KQ_Q6_K) {
        const int n = j / 4, k = j % 4;
        float d = h2f(load_u16(blk + 208));
        const u8* ql = blk + 64 * n + 32 * (k & 1);
        const u8* qh = blk + 128 + 32 * n;
        int shift = k < 2 ? 0 : 4;
#pragma unroll
        for (int t = 0; t < 8; t++) {
            u32 low = (kq_u32<false>(ql + 4 * t) >> shift) & 0x0F0F0F0Fu;
            u32 high = ((kq_u32<false>(qh + 4 * t) >> (2 * k)) & 0x03030303u) << 4;
            q.w[t] = (int)__vsub4(low | high, 0x20202020u);
        }
        q.a[0] = d * (float)(signed char)blk[192 + 8 * n + 2 * k];
        q.a[1] = d * (float)(signed char)blk[192 + 8 * n + 2 * k + 1];
        q.c[0] = q.c[1] = 0.f;
    } else if constexpr (DTYPE == KQ_Q3_K) {
        const int n = j / 4, k = j % 4;
        float d = h2f(load_u16(blk + 108));
        const u8* scales = blk + 96;
#pragma unroll
        for (int t = 0; t < 8; t++) {
            u32 q2 = (kq_u32<false>(blk + 32 + 32 * n + 4 * t) >> (2 * k)) & 0x03030303u;
            u32 h = (kq_u32<false>(blk + 4 * t) >> (4 * n + k)) & 0x01010101u;
            q.w[t] = (int)__vsub4(q2 | (h << 2), 0x04040404u);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int i = 8 * n + 2 * k + h;
            int low = i < 8 ? (scales[i] & 0xF) : (scales[i - 8] >> 4);
            int high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
            q.a[h] = d * (float)((low | (high << 4)) - 32);
            q.c[h] = 0.f;
        }
    } else {  // KQ_Q2_K
        const int n = j / 4, k = j % 4;
        float d = h2f(load_u16(blk + 80)), dmin = h2f(load_u16(blk + 82));
#pragma unroll
        for (int t = 0; t < 8; t++) q.w[t] = (int)((kq_u32<true>(blk + 16 + 32 * n + 4 * t) >> (2 * k)) & 0x03030303u);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int sc = blk[8 * n + 2 * k + h];
            q.a[h] = d * (float)(sc & 0xF);
            q.c[h] = -(dmin * (float)(sc >> 4));
        }
    }
}

// Value i (0..31) of a decoded block.
__device__ __forceinline__ float kq_value(const KqBlock& q, int i) {
    int level = (int)(signed char)((u32)q.w[i / 4] >> (8 * (i % 4)));
    return fmaf(q.a[i / 16], (float)level, q.c[i / 16]);
}

// The block's weights times its activations (`xw`: the 16-bit activations in pairs, `xs`: the
// block's (d, Σx, Σq) of `quantize_x16_lanes`), added to acc. Levels times activations are
// exact integer sums per 16 values; the offsets multiply Σx (exact) when both halves share one,
// else each half's d·Σq.
__device__ __forceinline__ float kq_block_acc(const KqBlock& q, const int* xw, float4 xs, float acc) {
    int dot[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int s = 0;
#pragma unroll
        for (int t = 4 * h; t < 4 * h + 4; t++) {
            s = __dp2a_lo(xw[2 * t], q.w[t], s);
            s = __dp2a_hi(xw[2 * t + 1], q.w[t], s);
        }
        dot[h] = s;
    }
    acc = fmaf(xs.x, fmaf(q.a[0], (float)dot[0], q.a[1] * (float)dot[1]), acc);
    if (q.c[0] == q.c[1]) return fmaf(q.c[0], xs.y, acc);
    // Σq of the first 16 values (8 pairs), the rest from the block's Σq.
    int s0 = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s0 = __dp2a_lo(xw[i], 0x0101, s0);
    int s1 = __float_as_int(xs.z) - s0;
    return fmaf(q.c[0], xs.x * (float)s0, fmaf(q.c[1], xs.x * (float)s1, acc));
}

// The k-quant-era weights read as stored, with the activations of `quantize_x16_lanes`: lane l
// of warp w takes the 32-value blocks (it·MM_WARPS + w)·32 + l of MM_WROWS weight rows, like
// `matmul_q_impl` (same tiles, same store, same fixed order of the partial sums).
template <int DTYPE, int NR>
__device__ void matmul_kq_impl(const short* xq, const float4* xs, int rows, int k, const MatmulJobs& jobs) {
    MatmulTile t;
    if (!matmul_tile<NR>(jobs, rows, t)) return;
    const int nw = t.nw, nr = t.nr, r0 = t.r0;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float acc[NR][MM_WROWS] = {};
    int n_blocks = k / 32;
    u64 row_bytes = (u64)(k / kq_block_len<DTYPE>()) * kq_block_bytes<DTYPE>();
    const u8* w0 = t.w + (u64)t.i0 * row_bytes;
    for (int b = warp * 32 + lane; b < n_blocks; b += MM_WARPS * 32) {
        KqBlock q[MM_WROWS];
#pragma unroll
        for (int j = 0; j < MM_WROWS; j++) kq_block<DTYPE>(w0 + (j < nw ? j : 0) * row_bytes, b, q[j]);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r >= nr) continue;
            int xw[16];
            float4 s = x16_block(xq, xs, (u64)(r0 + r) * n_blocks + b, xw);
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) acc[r][j] = kq_block_acc(q[j], xw, s, acc[r][j]);
        }
    }
    matmul_store<NR>(acc, t, jobs.accumulate);
}

#define MATMUL_KQ_KERNELS(NAME, DTYPE)                                                                \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r1(const short* xq, const float4* xs, int rows, int k, MatmulJobs jobs) {             \
        matmul_kq_impl<DTYPE, 1>(xq, xs, rows, k, jobs);                                             \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r8(const short* xq, const float4* xs, int rows, int k, MatmulJobs jobs) {             \
        matmul_kq_impl<DTYPE, MM_ROWS>(xq, xs, rows, k, jobs);                                       \
    }
MATMUL_KQ_KERNELS(matmul_q5_0, KQ_Q5_0)
MATMUL_KQ_KERNELS(matmul_q5_1, KQ_Q5_1)
MATMUL_KQ_KERNELS(matmul_iq4_nl, KQ_IQ4_NL)
MATMUL_KQ_KERNELS(matmul_q2_k, KQ_Q2_K)
MATMUL_KQ_KERNELS(matmul_q3_k, KQ_Q3_K)
MATMUL_KQ_KERNELS(matmul_q4_k, KQ_Q4_K)
MATMUL_KQ_KERNELS(matmul_q5_k, KQ_Q5_K)
MATMUL_KQ_KERNELS(matmul_q6_k, KQ_Q6_K)
MATMUL_KQ_KERNELS(matmul_iq4_xs, KQ_IQ4_XS)

// Block `b` of a weight of dtype code `dtype` (uniform across the grid).
__device__ __forceinline__ void kq_block_any(const u8* w, int dtype, u64 b, KqBlock& q) {
    switch (dtype) {
        case KQ_Q5_0: kq_block<KQ_Q5_0>(w, b, q); break;
        case KQ_Q5_1: kq_block<KQ_Q5_1>(w, b, q); break;
        case KQ_IQ4_NL: kq_block<KQ_IQ4_NL>(w, b, q); break;
        case KQ_Q2_K: kq_block<KQ_Q2_K>(w, b, q); break;
        case KQ_Q3_K: kq_block<KQ_Q3_K>(w, b, q); break;
        case KQ_Q4_K: kq_block<KQ_Q4_K>(w, b, q); break;
        case KQ_Q5_K: kq_block<KQ_Q5_K>(w, b, q); break;
        case KQ_Q6_K: kq_block<KQ_Q6_K>(w, b, q); break;
        default: kq_block<KQ_IQ4_XS>(w, b, q); break;
    }
}

// out[r, :] = table[ids[r], :] for a k-quant-era table (as `embed_rows`); one block per row,
// a thread per 32 values.
extern "C" __global__ void kq_embed_rows(const u8* table, u64 row_bytes, int dtype, const u32* ids, int dim,
                                         float* out) {
    int r = blockIdx.x;
    const u8* row = table + (u64)ids[r] * row_bytes;
    for (int b = threadIdx.x; b < dim / 32; b += blockDim.x) {
        KqBlock q;
        kq_block_any(row, dtype, b, q);
#pragma unroll
        for (int i = 0; i < 32; i++) out[(u64)r * dim + 32 * b + i] = kq_value(q, i);
    }
}

// Values 8·i .. 8·i+7 of a weight (the part of `dequant_f32` / `dequant_f16` in quant.cu, which
// decode a matrix for a cuBLAS GEMM, for these dtypes).
__device__ void kq_values8(const u8* w, int dtype, u64 i, float* v) {
    KqBlock q;
    kq_block_any(w, dtype, i / 4, q);
    int p = (int)(i % 4) * 8;
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = kq_value(q, p + j);
}
