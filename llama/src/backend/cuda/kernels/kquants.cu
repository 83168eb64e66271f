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
// dot products (`dp2a`, 16-bit activations × 8-bit levels) and the decoders share. It is made of
// `kq_block_words` (words t and 4 + t) and `kq_block_scales`, which the tensor-core kernels of
// kquants_mma.cu call directly (a lane holds only words t and 4 + t of a fragment's rows).

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

// q4_k/q5_k: the affine map of sub-block j from the super-block's first 16 bytes in one 16-byte
// load (d, dmin and the 12 packed scale bytes; super-blocks of 144 and 176 bytes in 16-aligned
// rows keep it aligned), the scale and min picked without a branch on j (the lanes of a warp
// hold all eight sub-blocks), as `k4_scale_min` in weights_format::quant unpacks them: the low
// six bits of bytes 4 + j (scale) and 8 + j (min) for j < 4, else the nibbles of byte 12 + j - 4
// with the top two bits of bytes 4 + j - 4 and 8 + j - 4. Every q4_k/q5_k kernel reads its
// scales here (`kq_block_scales`). Against two 16-bit loads of d and dmin and two to four byte
// loads with a divergent branch, it took the one-row kernels' registers from 87 to 72 (q5_k)
// and Q5_K_M 7B tg128 from 261 to 276-282 tok/s (H200, with `kq_block_acc_one_scale`; alone
// 280).
__device__ __forceinline__ void kq_scales_k4_wide(const u8* blk, int j, float (&a)[2], float (&c)[2]) {
    const uint4 h = *(const uint4*)blk;
    const int sh = 8 * (j & 3);
    const u32 b0 = (h.y >> sh) & 0xFFu, b1 = (h.z >> sh) & 0xFFu, b2 = (h.w >> sh) & 0xFFu;
    const bool low = j < 4;
    const int sc = (int)(low ? (b0 & 63u) : ((b2 & 0xFu) | ((b0 >> 6) << 4)));
    const int m = (int)(low ? (b1 & 63u) : ((b2 >> 4) | ((b1 >> 6) << 4)));
    const float d = h2f((u16)(h.x & 0xFFFFu)), dmin = h2f((u16)(h.x >> 16));
    a[0] = a[1] = d * (float)sc;
    c[0] = c[1] = -(dmin * (float)m);
}

// Block `b` of a weight row starting at `row`: the bytes of its (super-)block, and `j`, its
// sub-block there (0 for the 32-value types).
template <int DTYPE>
__device__ __forceinline__ const u8* kq_block_at(const u8* row, u64 b, int& j) {
    constexpr int len = kq_block_len<DTYPE>(), bytes = kq_block_bytes<DTYPE>();
    j = (int)(b % (len / 32));
    return row + (b * 32 / len) * bytes;
}

// The affine maps of sub-block j of `blk`: value = a[h]·level + c[h] for values 16h..16h+15.
template <int DTYPE>
__device__ __forceinline__ void kq_block_scales(const u8* blk, int j, float (&a)[2], float (&c)[2]) {
    if constexpr (DTYPE == KQ_Q5_0 || DTYPE == KQ_Q5_1) {
        a[0] = a[1] = h2f(load_u16(blk));
        c[0] = c[1] = DTYPE == KQ_Q5_1 ? h2f(load_u16(blk + 2)) : 0.f;
    } else if constexpr (DTYPE == KQ_IQ4_NL || DTYPE == KQ_IQ4_XS) {
        float d = h2f(load_u16(blk));
        if constexpr (DTYPE == KQ_IQ4_XS) {
            int ls = ((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((load_u16(blk + 2) >> (2 * j)) & 3) << 4);
            d *= (float)(ls - 32);
        }
        a[0] = a[1] = d;
        c[0] = c[1] = 0.f;
    } else if constexpr (DTYPE == KQ_Q4_K || DTYPE == KQ_Q5_K) {
        kq_scales_k4_wide(blk, j, a, c);
    } else if constexpr (DTYPE == KQ_Q6_K) {
        const int n = j / 4, k = j % 4;
        float d = h2f(load_u16(blk + 208));
        a[0] = d * (float)(signed char)blk[192 + 8 * n + 2 * k];
        a[1] = d * (float)(signed char)blk[192 + 8 * n + 2 * k + 1];
        c[0] = c[1] = 0.f;
    } else if constexpr (DTYPE == KQ_Q3_K) {
        const int n = j / 4, k = j % 4;
        float d = h2f(load_u16(blk + 108));
        const u8* scales = blk + 96;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int i = 8 * n + 2 * k + h;
            int low = i < 8 ? (scales[i] & 0xF) : (scales[i - 8] >> 4);
            int high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
            a[h] = d * (float)((low | (high << 4)) - 32);
            c[h] = 0.f;
        }
    } else {  // KQ_Q2_K
        const int n = j / 4, k = j % 4;
        float d = h2f(load_u16(blk + 80)), dmin = h2f(load_u16(blk + 82));
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int sc = blk[8 * n + 2 * k + h];
            a[h] = d * (float)(sc & 0xF);
            c[h] = -(dmin * (float)(sc >> 4));
        }
    }
}

// Words t and 4 + t (t < 4) of sub-block j's levels: values 4t..4t+3 (`lo`) and 16+4t..16+4t+3
// (`hi`) as signed bytes — the two k-sets a lane holds in a tensor-core fragment, and half of
// what `kq_block` decodes.
template <int DTYPE>
__device__ __forceinline__ void kq_block_words(const u8* blk, int j, int t, u32& lo, u32& hi) {
    if constexpr (DTYPE == KQ_Q5_0 || DTYPE == KQ_Q5_1) {
        constexpr bool one = DTYPE == KQ_Q5_1;
        constexpr int qs = one ? 8 : 6;
        u32 qh = kq_u32<one>(blk + qs - 4);
        u32 v = kq_u32<one>(blk + qs + 4 * t);
        lo = (v & 0x0F0F0F0Fu) | (kq_spread4(qh >> (4 * t)) << 4);
        hi = ((v >> 4) & 0x0F0F0F0Fu) | (kq_spread4(qh >> (16 + 4 * t)) << 4);
        if constexpr (!one) {
            lo = __vsub4(lo, 0x10101010u);
            hi = __vsub4(hi, 0x10101010u);
        }
    } else if constexpr (DTYPE == KQ_IQ4_NL || DTYPE == KQ_IQ4_XS) {
        constexpr bool xs = DTYPE == KQ_IQ4_XS;
        const u8* qs = xs ? blk + 8 + 16 * j : blk + 2;
        u32 v = kq_u32<xs>(qs + 4 * t);
        lo = kq_iq4_levels(v & 0x0F0F0F0Fu);
        hi = kq_iq4_levels((v >> 4) & 0x0F0F0F0Fu);
    } else if constexpr (DTYPE == KQ_Q4_K || DTYPE == KQ_Q5_K) {
        constexpr bool five = DTYPE == KQ_Q5_K;
        const u8* qs = blk + (five ? 48 : 16) + 32 * (j / 2);
        int shift = 4 * (j % 2);
        lo = (kq_u32<true>(qs + 4 * t) >> shift) & 0x0F0F0F0Fu;
        hi = (kq_u32<true>(qs + 16 + 4 * t) >> shift) & 0x0F0F0F0Fu;
        if constexpr (five) {
            lo |= ((kq_u32<true>(blk + 16 + 4 * t) >> j) & 0x01010101u) << 4;
            hi |= ((kq_u32<true>(blk + 32 + 4 * t) >> j) & 0x01010101u) << 4;
        }
    } else if constexpr (DTYPE == KQ_Q6_K) {
        const int n = j / 4, k = j % 4;
        const u8* ql = blk + 64 * n + 32 * (k & 1);
        const u8* qh = blk + 128 + 32 * n;
        int shift = k < 2 ? 0 : 4;
        u32 w[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 low = (kq_u32<false>(ql + 16 * h + 4 * t) >> shift) & 0x0F0F0F0Fu;
            u32 high = ((kq_u32<false>(qh + 16 * h + 4 * t) >> (2 * k)) & 0x03030303u) << 4;
            w[h] = __vsub4(low | high, 0x20202020u);
        }
        lo = w[0];
        hi = w[1];
    } else if constexpr (DTYPE == KQ_Q3_K) {
        const int n = j / 4, k = j % 4;
        u32 w[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 q2 = (kq_u32<false>(blk + 32 + 32 * n + 16 * h + 4 * t) >> (2 * k)) & 0x03030303u;
            u32 m = (kq_u32<false>(blk + 16 * h + 4 * t) >> (4 * n + k)) & 0x01010101u;
            w[h] = __vsub4(q2 | (m << 2), 0x04040404u);
        }
        lo = w[0];
        hi = w[1];
    } else {  // KQ_Q2_K
        const int n = j / 4, k = j % 4;
        lo = (kq_u32<true>(blk + 16 + 32 * n + 4 * t) >> (2 * k)) & 0x03030303u;
        hi = (kq_u32<true>(blk + 16 + 32 * n + 16 + 4 * t) >> (2 * k)) & 0x03030303u;
    }
}

// 32-value block `b` of a weight row starting at `row`.
template <int DTYPE>
__device__ __forceinline__ void kq_block(const u8* row, u64 b, KqBlock& q) {
    int j;
    const u8* blk = kq_block_at<DTYPE>(row, b, j);
    // q5_k: its 32 high-bit bytes as two 16-byte loads a lane instead of eight 4-byte ones
    // (super-blocks are 176 bytes and rows start 16-aligned, so blk + 16 and blk + 32 are).
    // Measured on the H200 (Q5_K_M 7B tg128, two rounds): 265.0 / 265.9 against 257.7 / 254.1
    // tok/s; the low-bit bytes as 16-byte loads too were no faster (261.8 / 265.5).
    if constexpr (DTYPE == KQ_Q5_K) {
        const uint4 h0 = *(const uint4*)(blk + 16), h1 = *(const uint4*)(blk + 32);
        const u32 hl[4] = {h0.x, h0.y, h0.z, h0.w}, hh[4] = {h1.x, h1.y, h1.z, h1.w};
        const u8* qs = blk + 48 + 32 * (j / 2);
        const int shift = 4 * (j % 2);
#pragma unroll
        for (int t = 0; t < 4; t++) {
            u32 lo = (kq_u32<true>(qs + 4 * t) >> shift) & 0x0F0F0F0Fu;
            u32 hi = (kq_u32<true>(qs + 16 + 4 * t) >> shift) & 0x0F0F0F0Fu;
            q.w[t] = (int)(lo | (((hl[t] >> j) & 0x01010101u) << 4));
            q.w[4 + t] = (int)(hi | (((hh[t] >> j) & 0x01010101u) << 4));
        }
        kq_block_scales<DTYPE>(blk, j, q.a, q.c);
        return;
    }
#pragma unroll
    for (int t = 0; t < 4; t++) {
        u32 lo, hi;
        kq_block_words<DTYPE>(blk, j, t, lo, hi);
        q.w[t] = (int)lo;
        q.w[4 + t] = (int)hi;
    }
    kq_block_scales<DTYPE>(blk, j, q.a, q.c);
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

// q4_k/q5_k (one scale and one offset a 32-value block): the 32 products in one exact integer
// sum, one conversion and one scale (`kq_block_acc` keeps two halves for the types whose halves
// have their own).
__device__ __forceinline__ float kq_block_acc_one_scale(const KqBlock& q, const int* xw, float4 xs, float acc) {
    int s = 0;
#pragma unroll
    for (int t = 0; t < 8; t++) {
        s = __dp2a_lo(xw[2 * t], q.w[t], s);
        s = __dp2a_hi(xw[2 * t + 1], q.w[t], s);
    }
    acc = fmaf(xs.x * q.a[0], (float)s, acc);
    return fmaf(q.c[0], xs.y, acc);
}

// The k-quant-era weights read as stored, with the activations of `quantize_x16_lanes`: the loop
// of `matmul_q_impl` (matmul.cu: same tiles, same store, same fixed order of the partial sums)
// over these dtypes' 32-value blocks.
template <int DTYPE, int NR>
__device__ void matmul_kq_impl(const short* xq, const float4* xs, int rows, int k, const MatmulJobs& jobs) {
    auto load = [](const u8* row, int b, KqBlock& q) { kq_block<DTYPE>(row, (u64)b, q); };
    auto block_acc = [](const KqBlock& q, const int* xw, float4 s, float acc) {
        if constexpr (DTYPE == KQ_Q4_K || DTYPE == KQ_Q5_K) return kq_block_acc_one_scale(q, xw, s, acc);
        return kq_block_acc(q, xw, s, acc);
    };
    u64 row_bytes = (u64)(k / kq_block_len<DTYPE>()) * kq_block_bytes<DTYPE>();
    matmul_x16_impl<KqBlock, NR, true>(xq, xs, rows, k, jobs, row_bytes, load, block_acc);
}

#define MATMUL_KQ_KERNELS(NAME, DTYPE) MATMUL_X16_KERNELS(NAME, matmul_kq_impl, DTYPE)
// The one-row kernels of the 7B-era k-quant files (q4_k, q5_k and the `superblock` path, whose
// q6_k is the default) compiled for 8 blocks a multiprocessor, 64 registers: a 4096-row matrix's
// 1,024 blocks then fit one wave of an H100's 132 multiprocessors instead of 1.1-1.6. Measured
// on the H200, tg128 of the random 7B: Q5_K_M 276-282 → 291-296 tok/s (q5_k spills 4 bytes),
// Q6_K 240 → 263, Q4_K_M unchanged (285). The other dtypes' kernels keep the compiler's choice.
#define KQ_R1_BOUNDS __launch_bounds__(MM_WARPS * 32, 8)
#define MATMUL_KQ_R1MIN_KERNELS(NAME, DTYPE) MATMUL_X16_KERNELS_BOUNDED(NAME, matmul_kq_impl, DTYPE, KQ_R1_BOUNDS)
MATMUL_KQ_KERNELS(matmul_q5_0, KQ_Q5_0)
MATMUL_KQ_KERNELS(matmul_q5_1, KQ_Q5_1)
MATMUL_KQ_KERNELS(matmul_iq4_nl, KQ_IQ4_NL)
MATMUL_KQ_KERNELS(matmul_q2_k, KQ_Q2_K)
MATMUL_KQ_KERNELS(matmul_q3_k, KQ_Q3_K)
MATMUL_KQ_R1MIN_KERNELS(matmul_q4_k, KQ_Q4_K)
MATMUL_KQ_R1MIN_KERNELS(matmul_q5_k, KQ_Q5_K)
MATMUL_KQ_KERNELS(matmul_q6_k, KQ_Q6_K)
MATMUL_KQ_KERNELS(matmul_iq4_xs, KQ_IQ4_XS)

// ---- q4_k, q5_k and q6_k with 16 lanes per super-block (path `superblock`) ------------------
// `matmul_kq_impl` gives each lane one 32-value block, so the eight lanes of a super-block each
// decode its scales again, and each reads its own 16-32 quant bytes: the words one load
// instruction fetches across the warp lie 32 bytes apart (q6_k's, not 4-aligned, as two 16-bit
// halves). Here 16 lanes share a super-block (a warp takes two) and lane l reads words c and
// c + 4 (c = l % 4) of the 32-byte chunk q = l / 4 of its quant bytes, so one load instruction
// of a half-warp covers a whole 64-byte span of words and the two loads read the 128 quant bytes
// once, side by side. A chunk's low and high nibbles are two sub-blocks (q4_k, q5_k: 2q and
// 2q + 1; q6_k: 4n + m and 4n + m + 2 with n = q / 2, m = q % 2) at the same positions, so each
// lane's 16 values are positions 4c..4c+3 and 16+4c..16+4c+3 of two sub-blocks: it reads two
// 8-byte pieces of two activation blocks and the scales of two sub-blocks (the 4 lanes of a
// chunk read the same scale bytes, one broadcast). Same tiles, activations (`quantize_x16_lanes`,
// exact 16×8-bit dot products with `dp2a`) and store as the kernels above; the offsets
// (−dmin·mn) multiply the activation block's exact Σx once, by the chunk's lane c = 0.

// A lane's raw words of one super-block, loaded before any arithmetic so that the loads of every
// weight row are in flight together: the two quant words (q6_k: of ql), q5_k's and q6_k's two
// high-bit words, and the scales (q4_k, q5_k: d and dmin, and the three pairs of scale bytes the
// two sub-blocks' 6-bit scales and mins are made of; q6_k: the four i8 scales of the lane's
// halves, and d).
struct KqLaneRaw {
    u32 q[2], h[2], s[3], d;
};

// A 16-bit word at a 2-aligned address, and a 32-bit one from two of them (q6_k's 210-byte
// super-blocks keep only 2-alignment; every offset read here is even).
__device__ __forceinline__ u32 kq_u16_at(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 kq_u32_at2(const u8* p) { return kq_u16_at(p) | (kq_u16_at(p + 2) << 16); }

template <int DTYPE>
__device__ __forceinline__ void kq_lane_load(const u8* blk, int q, int c, KqLaneRaw& r) {
    if constexpr (DTYPE == KQ_Q6_K) {
        r.q[0] = kq_u32_at2(blk + 32 * q + 4 * c);
        r.q[1] = kq_u32_at2(blk + 32 * q + 16 + 4 * c);
        const u8* qh = blk + 128 + 32 * (q / 2);
        r.h[0] = kq_u32_at2(qh + 4 * c);
        r.h[1] = kq_u32_at2(qh + 16 + 4 * c);
        // scales[8n + 2k + half] for k = m (low nibbles) and k = m + 2 (high nibbles).
        const u8* sc = blk + 192 + 8 * (q / 2) + 2 * (q % 2);
        r.s[0] = kq_u16_at(sc);
        r.s[1] = kq_u16_at(sc + 4);
        r.d = kq_u16_at(blk + 208);
    } else {
        constexpr bool five = DTYPE == KQ_Q5_K;
        const u8* qs = blk + (five ? 48 : 16) + 32 * q;
        r.q[0] = kq_u32<true>(qs + 4 * c);
        r.q[1] = kq_u32<true>(qs + 16 + 4 * c);
        if constexpr (five) {
            r.h[0] = kq_u32<true>(blk + 16 + 4 * c);
            r.h[1] = kq_u32<true>(blk + 32 + 4 * c);
        }
        // The scale bytes of sub-blocks 2q and 2q + 1 (see `kq_scales_k4_wide`): scales[2q..],
        // scales[2q+4..] and, for q >= 2, scales[2q-4..], as pairs.
        const u8* sc = blk + 4;
        r.s[0] = kq_u16_at(sc + 2 * q);
        r.s[1] = kq_u16_at(sc + 2 * q + 4);
        r.s[2] = kq_u16_at(sc + (q >= 2 ? 2 * q - 4 : 2 * q));
        r.d = kq_u32<true>(blk);
    }
}

// Σ level·xq over 4 positions of each half of a sub-block: `lv` holds the levels of positions
// 4c..4c+3 (lv[0]) and 16+4c..16+4c+3 (lv[1]), `xa` the activation pairs of the same positions.
__device__ __forceinline__ int kq_lane_dot_half(u32 lv, const uint2& x) {
    return __dp2a_hi((int)x.y, (int)lv, __dp2a_lo((int)x.x, (int)lv, 0));
}

// acc + this lane's 16 weights of one row times their activations: `xa`/`xb` the activation
// pairs of sub-blocks ja/jb at positions 4c.. (index 0) and 16+4c.. (index 1), `sa`/`sb` their
// blocks' (d, Σx, Σq).
template <int DTYPE>
__device__ __forceinline__ float kq_lane_acc(const KqLaneRaw& r, int q, int c, const uint2 (&xa)[2],
                                             const uint2 (&xb)[2], float4 sa, float4 sb, float acc) {
    if constexpr (DTYPE == KQ_Q6_K) {
        const int m = q % 2;
        float d = h2f((u16)r.d);
        int dot[2][2];  // [sub-block a/b][half]
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 ql = r.q[h], qh = r.h[h];
            u32 a = (ql & 0x0F0F0F0Fu) | (((qh >> (2 * m)) & 0x03030303u) << 4);
            u32 b = ((ql >> 4) & 0x0F0F0F0Fu) | (((qh >> (2 * m + 4)) & 0x03030303u) << 4);
            dot[0][h] = kq_lane_dot_half(__vsub4(a, 0x20202020u), xa[h]);
            dot[1][h] = kq_lane_dot_half(__vsub4(b, 0x20202020u), xb[h]);
        }
        float sa0 = (float)(signed char)(r.s[0] & 0xFF), sa1 = (float)(signed char)(r.s[0] >> 8);
        float sb0 = (float)(signed char)(r.s[1] & 0xFF), sb1 = (float)(signed char)(r.s[1] >> 8);
        float part = sa.x * fmaf(sa0, (float)dot[0][0], sa1 * (float)dot[0][1]);
        part = fmaf(sb.x, fmaf(sb0, (float)dot[1][0], sb1 * (float)dot[1][1]), part);
        return fmaf(d, part, acc);
    } else {
        constexpr bool five = DTYPE == KQ_Q5_K;
        const int ja = 2 * q, jb = 2 * q + 1;
        int dot_a = 0, dot_b = 0;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 a = r.q[h] & 0x0F0F0F0Fu, b = (r.q[h] >> 4) & 0x0F0F0F0Fu;
            if constexpr (five) {
                a |= ((r.h[h] >> ja) & 0x01010101u) << 4;
                b |= ((r.h[h] >> jb) & 0x01010101u) << 4;
            }
            dot_a += kq_lane_dot_half(a, xa[h]);
            dot_b += kq_lane_dot_half(b, xb[h]);
        }
        // The 6-bit scales and mins of sub-blocks ja (low byte) and jb (high byte), both bytes at
        // once: `kq_scales_k4_wide`'s unpacking for j = 2q and 2q + 1.
        u32 scs, mns;
        if (q < 2) {
            scs = r.s[0] & 0x3F3Fu;
            mns = r.s[1] & 0x3F3Fu;
        } else {
            scs = (r.s[1] & 0x0F0Fu) | ((r.s[2] >> 2) & 0x3030u);
            mns = ((r.s[1] >> 4) & 0x0F0Fu) | ((r.s[0] >> 2) & 0x3030u);
        }
        int sc_a = (int)(scs & 0xFF), sc_b = (int)(scs >> 8);
        int mn_a = (int)(mns & 0xFF), mn_b = (int)(mns >> 8);
        float d = h2f((u16)(r.d & 0xFFFF)), dmin = h2f((u16)(r.d >> 16));
        float part = sa.x * (float)(sc_a * dot_a);
        part = fmaf(sb.x, (float)(sc_b * dot_b), part);
        acc = fmaf(d, part, acc);
        if (c == 0) acc = fmaf(-dmin, fmaf((float)mn_a, sa.y, (float)mn_b * sb.y), acc);
        return acc;
    }
}

// Called after pdl_deferred(): pdl_begin() comes after the first weights are loaded.
template <int DTYPE, int NR>
__device__ void matmul_kq_sb_impl(const short* xq, const float4* xs, int rows, int k, const MatmulJobs& jobs) {
    MatmulTile t;
    if (!matmul_tile<NR>(jobs, rows, t)) return;
    const int nw = t.nw, nr = t.nr, r0 = t.r0;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q = (lane % 16) / 4, c = lane % 4;
    // The chunk's two sub-blocks: low nibbles ja, high nibbles jb.
    const int ja = DTYPE == KQ_Q6_K ? 4 * (q / 2) + q % 2 : 2 * q;
    const int jb = DTYPE == KQ_Q6_K ? ja + 2 : ja + 1;
    float acc[NR][MM_WROWS] = {};
    constexpr int bytes = kq_block_bytes<DTYPE>();
    const int n_sb = k / 256, n_blocks = k / 32;
    const u64 row_bytes = (u64)n_sb * bytes;
    const u8* w0 = t.w + (u64)t.i0 * row_bytes;
    const int first = 2 * warp + lane / 16;
    KqLaneRaw raw[MM_WROWS];
    auto load_rows = [&](int s) {
#pragma unroll
        for (int j = 0; j < MM_WROWS; j++)
            kq_lane_load<DTYPE>(w0 + (j < nw ? j : 0) * row_bytes + (u64)s * bytes, q, c, raw[j]);
    };
    if (PDL_EARLY_WEIGHTS && first < n_sb) load_rows(first);  // before the wait: see pdl_deferred (common.cuh)
    pdl_begin();
    for (int s = first; s < n_sb; s += 2 * MM_WARPS) {
        if (!PDL_EARLY_WEIGHTS || s != first) load_rows(s);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r >= nr) continue;
            const u64 xb = (u64)(r0 + r) * n_blocks + 8 * (u64)s;
            const uint2* pa = (const uint2*)(xq + (xb + ja) * 32);
            const uint2* pb = (const uint2*)(xq + (xb + jb) * 32);
            const uint2 xa[2] = {pa[c], pa[4 + c]}, xbv[2] = {pb[c], pb[4 + c]};
            const float4 sa = xs[xb + ja], sb = xs[xb + jb];
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) acc[r][j] = kq_lane_acc<DTYPE>(raw[j], q, c, xa, xbv, sa, sb, acc[r][j]);
        }
    }
    matmul_store<NR>(acc, t, jobs.accumulate);
}

#define MATMUL_KQ_SB_KERNELS(NAME, DTYPE) MATMUL_X16_KERNELS_BOUNDED(NAME, matmul_kq_sb_impl, DTYPE, KQ_R1_BOUNDS)
MATMUL_KQ_SB_KERNELS(matmul_sb_q4_k, KQ_Q4_K)
MATMUL_KQ_SB_KERNELS(matmul_sb_q5_k, KQ_Q5_K)
MATMUL_KQ_SB_KERNELS(matmul_sb_q6_k, KQ_Q6_K)

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
    pdl_begin();
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

// A whole weight of these dtypes as f16 for a cuBLAS GEMM (prompts): one thread per 32-value
// block, which it decodes once and writes as four 16-byte stores. `dequant_f16` gives each thread
// 8 values, so each block was decoded four times over (on the H100 that kernel wrote a 7B q4_k
// matrix at ~1.1 TB/s and took longer than the GEMM that read it).
extern "C" __global__ void kq_dequant_f16(const u8* w, int dtype, u64 n_blocks, u16* out) {
    pdl_begin();
    u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    KqBlock q;
    kq_block_any(w, dtype, b, q);
    uint4* o = (uint4*)(out + b * 32);
#pragma unroll
    for (int s = 0; s < 4; s++) {
        u32 h[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            h[j] = (u32)f2h(kq_value(q, 8 * s + 2 * j)) | ((u32)f2h(kq_value(q, 8 * s + 2 * j + 1)) << 16);
        o[s] = make_uint4(h[0], h[1], h[2], h[3]);
    }
}
