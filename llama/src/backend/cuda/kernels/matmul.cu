// Matrix-vector and small matrix-matrix products over the stored weight blocks.

// out[r, i] (+)= Σ_c x[r, c] · w[i, c] for up to MM_MAX_JOBS weights of one dtype read with the
// same x (Q/K/V, gate/up), f32 accumulation. A block of MM_WARPS warps owns MM_WROWS weight rows
// of one job and up to NR input rows (1 when decoding one sequence, so the accumulators of unused
// rows take no registers; MM_ROWS for batches); its warps split the columns (warp w, lane l take
// the 8-value groups or 32-value blocks (it·MM_WARPS + w)·32 + l), so a 4096-column row is one
// step per lane with every load issued at once. Each row's partial sums are added in a fixed
// order and with explicit fmaf, the same in every NR variant: a row's result does not depend on
// how many rows are computed with it (batched decoding gives the solo result).
// grid = (Σ_jobs ceil(m_j / MM_WROWS), ceil(rows / NR)).
#define MM_ROWS 8
#define MM_WARPS 4
#define MM_WROWS 4
#define MM_MAX_JOBS 3
// Gate (and up) rows a block of a gated one-row kernel (`_r1_gated`): it computes MM_GROWS rows of
// the gate and the same rows of up, MM_WROWS in all, and writes act(gate) · up.
#define MM_GROWS (MM_WROWS / 2)

// Must match `MatmulJobs` in cuda/matmul.rs.
struct MatmulJobs {
    const u8* w[MM_MAX_JOBS];
    float* out[MM_MAX_JOBS];
    int m[MM_MAX_JOBS];
    int n_jobs;
    int accumulate;  // out += x·Wᵀ (residual connections) instead of out = x·Wᵀ
};

// The weight, output and row count of this block's job; returns its first weight row.
__device__ __forceinline__ int matmul_job(const MatmulJobs& jobs, const u8*& w, float*& out, int& m) {
    int cta = blockIdx.x;
    w = jobs.w[0];
    out = jobs.out[0];
    m = jobs.m[0];
#pragma unroll
    for (int j = 1; j < MM_MAX_JOBS; j++) {
        int ctas = (m + MM_WROWS - 1) / MM_WROWS;
        if (j < jobs.n_jobs && cta >= ctas) {
            cta -= ctas;
            w = jobs.w[j];
            out = jobs.out[j];
            m = jobs.m[j];
        }
    }
    return cta * MM_WROWS;
}

// The weight rows and input rows one block of a matmul kernel owns.
struct MatmulTile {
    const u8* w;  // the job's weight
    const u8* w2; // a gated kernel's up weight (w is the gate's)
    float* out;   // the job's output
    int m;        // the job's weight rows
    int i0, nw;   // the block's first weight row, and how many it has (<= MM_WROWS)
    int r0, nr;   // its first input row, and how many (<= NR)
};

// This block's tile; false when it has no weight rows (then the whole block returns, so no
// barrier is skipped by part of it). GATED: jobs 0 and 1 are the gate and up weights (same shape)
// and the block takes rows i0 .. i0 + MM_GROWS of both (nw counts the rows of each).
template <int NR, bool GATED = false>
__device__ __forceinline__ bool matmul_tile(const MatmulJobs& jobs, int rows, MatmulTile& t) {
    if constexpr (GATED) {
        t.w = jobs.w[0];
        t.w2 = jobs.w[1];
        t.out = jobs.out[0];
        t.m = jobs.m[0];
        t.i0 = blockIdx.x * MM_GROWS;
        if (t.i0 >= t.m) return false;
        t.nw = min(MM_GROWS, t.m - t.i0);
    } else {
        t.i0 = matmul_job(jobs, t.w, t.out, t.m);
        if (t.i0 >= t.m) return false;
        t.nw = min(MM_WROWS, t.m - t.i0);
    }
    t.r0 = blockIdx.y * NR;
    t.nr = min(NR, rows - t.r0);
    return true;
}

// Warp sums, then the warps' partials in warp order, written (or added) to the outputs. GATED:
// rows j and j + MM_GROWS are the gate's and up's row i0 + j, summed in the same order and
// written as gate_act(gate, act) · up, the bits of `gated_act` over the two outputs.
template <int NR, bool GATED = false>
__device__ __forceinline__ void matmul_store(float (&acc)[NR][MM_WROWS], const MatmulTile& t, int accumulate,
                                             int act = 0) {
    int nr = t.nr, nw = t.nw;
    __shared__ float red[MM_WARPS][NR][MM_WROWS];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < NR; r++) {
        if (r >= nr) continue;  // the same for the whole block
#pragma unroll
        for (int j = 0; j < MM_WROWS; j++) {
            float v = warp_sum(acc[r][j]);
            if (lane == 0) red[warp][r][j] = v;
        }
    }
    __syncthreads();
    int tid = threadIdx.x;
    if constexpr (GATED) {
        if (tid < NR * MM_GROWS) {
            int r = tid / MM_GROWS, j = tid % MM_GROWS;
            if (r < nr && j < nw) {
                float g = 0.f, u = 0.f;
#pragma unroll
                for (int wi = 0; wi < MM_WARPS; wi++) g += red[wi][r][j];
#pragma unroll
                for (int wi = 0; wi < MM_WARPS; wi++) u += red[wi][r][j + MM_GROWS];
                t.out[(u64)(t.r0 + r) * t.m + t.i0 + j] = gate_act(g, act) * u;
            }
        }
        return;
    }
    if (tid < NR * MM_WROWS) {
        int r = tid / MM_WROWS, j = tid % MM_WROWS;
        if (r < nr && j < nw) {
            float v = 0.f;
#pragma unroll
            for (int wi = 0; wi < MM_WARPS; wi++) v += red[wi][r][j];
            float* o = t.out + (u64)(t.r0 + r) * t.m + t.i0 + j;
            *o = accumulate ? *o + v : v;
        }
    }
}

__device__ __forceinline__ float half_bits(u32 bits, int dtype) {
    return dtype == 1 ? h2f((u16)bits) : bf2f((u16)bits);
}

// f32, f16 and bf16 weights with f32 activations.
// Called after pdl_deferred(): pdl_begin() comes after the first weights are loaded.
// GATED (f16 and bf16, one row): the gate and up products of `matmul_tile<NR, true>`'s rows,
// stored as act(gate) · up (`act` as `gate_act`).
template <int DTYPE, int NR, bool GATED = false>
__device__ void matmul_impl(const float* x, int rows, int k, const MatmulJobs& jobs, int act = 0) {
    static_assert(!GATED || DTYPE == 1 || DTYPE == 2, "gated kernels read 16-bit weights");
    MatmulTile t;
    if (!matmul_tile<NR, GATED>(jobs, rows, t)) return;
    const int nw = t.nw, nr = t.nr, r0 = t.r0;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float acc[NR][MM_WROWS] = {};
    const int step = MM_WARPS * 32;
    if constexpr (DTYPE == 1 || DTYPE == 2) {
        // 16-byte loads: 8 halves per lane per row and step.
        u64 row_bytes = (u64)k * 2;
        const u8* w0 = t.w + (u64)t.i0 * row_bytes;
        const u8* w1 = GATED ? t.w2 + (u64)t.i0 * row_bytes : w0;  // up's rows (GATED)
        // Weight row j of the block, and whether it exists.
        auto row = [&](int j) -> const u8* {
            if constexpr (GATED) return (j < MM_GROWS ? w0 : w1) + (j % MM_GROWS) * row_bytes;
            return w0 + j * row_bytes;
        };
        auto has = [&](int j) { return GATED ? j % MM_GROWS < nw : j < nw; };
        int k8 = (k % 8 == 0 && (((u64)w0 | (u64)w1) & 15) == 0) ? k / 8 : 0;
        const int first = warp * 32 + lane;
        auto load = [&](int c8, uint4 (&raw)[MM_WROWS]) {
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++)
                raw[j] = has(j) ? ((const uint4*)row(j))[c8] : make_uint4(0, 0, 0, 0);
        };
        uint4 raw[MM_WROWS];
        if (PDL_EARLY_WEIGHTS && first < k8) load(first, raw);  // before the wait: see pdl_deferred
        pdl_begin();
#pragma unroll 2
        for (int c8 = first; c8 < k8; c8 += step) {
            if (!PDL_EARLY_WEIGHTS || c8 != first) load(c8, raw);
            float wv[MM_WROWS][8];
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) {
                u32 words[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    wv[j][2 * q] = half_bits(words[q] & 0xFFFF, DTYPE);
                    wv[j][2 * q + 1] = half_bits(words[q] >> 16, DTYPE);
                }
            }
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (r < nr) {
                    const float4* xr = (const float4*)(x + (u64)(r0 + r) * k + (u64)c8 * 8);
                    float4 a = xr[0], b = xr[1];
#pragma unroll
                    for (int j = 0; j < MM_WROWS; j++) {
                        float s = wv[j][0] * a.x;
                        s = fmaf(wv[j][1], a.y, s);
                        s = fmaf(wv[j][2], a.z, s);
                        s = fmaf(wv[j][3], a.w, s);
                        s = fmaf(wv[j][4], b.x, s);
                        s = fmaf(wv[j][5], b.y, s);
                        s = fmaf(wv[j][6], b.z, s);
                        s = fmaf(wv[j][7], b.w, s);
                        acc[r][j] += s;
                    }
                }
            }
        }
        for (int c = k8 * 8 + warp * 32 + lane; c < k; c += step) {
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) {
                if (!has(j)) continue;
                float wv = half_bits(((const u16*)row(j))[c], DTYPE);
#pragma unroll
                for (int r = 0; r < NR; r++)
                    if (r < nr) acc[r][j] = fmaf(wv, x[(u64)(r0 + r) * k + c], acc[r][j]);
            }
        }
    } else if constexpr (!GATED) {
        pdl_begin();
        for (int c = warp * 32 + lane; c < k; c += step) {
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) {
                if (j >= nw) continue;
                float wv = ((const float*)(t.w + ((u64)(t.i0 + j) * k) * 4))[c];
#pragma unroll
                for (int r = 0; r < NR; r++)
                    if (r < nr) acc[r][j] = fmaf(wv, x[(u64)(r0 + r) * k + c], acc[r][j]);
            }
        }
    }
    matmul_store<NR, GATED>(acc, t, jobs.accumulate, act);
}

// A quantized block's raw words, loaded before any arithmetic so that every weight row's loads
// are in flight together. Blocks are read in the widest words their alignment allows (tensors
// start 4096-aligned: q4_1's 20-byte blocks are 4-aligned, q8_0's 34 and q4_0's 18 only
// 2-aligned), never byte by byte.
template <int DTYPE> struct QBlock;
template <> struct QBlock<3> { u16 h[17]; };
template <> struct QBlock<4> { u16 h[9]; };
template <> struct QBlock<5> { u32 w[5]; };

template <int DTYPE> __device__ __forceinline__ constexpr int qblock_bytes() { return DTYPE == 3 ? 34 : DTYPE == 4 ? 18 : 20; }

template <int DTYPE>
__device__ __forceinline__ void load_qblock(const u8* p, QBlock<DTYPE>& q) {
    if constexpr (DTYPE == 5) {
#pragma unroll
        for (int i = 0; i < 5; i++) q.w[i] = ((const u32*)p)[i];
    } else {
        constexpr int n = DTYPE == 3 ? 17 : 9;
#pragma unroll
        for (int i = 0; i < n; i++) q.h[i] = ((const u16*)p)[i];
    }
}

// Σ_i q_i · xq_i over a block, exactly: `xw` holds the block's 16-bit activations in pairs
// (value 2i low, 2i+1 high); q8_0's bytes are signed, q4's nibbles 0..15 as stored (q4_0's −8
// is applied by the caller). A q4 word t holds values 4t..4t+3 in its low nibbles and
// 16+4t..16+4t+3 in its high ones.
__device__ __forceinline__ int q4_word_idot(u32 v, int t, const int* xw, int s) {
    u32 lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
    s = __dp2a_lo(xw[2 * t], (int)lo, s);
    s = __dp2a_hi(xw[2 * t + 1], (int)lo, s);
    s = __dp2a_lo(xw[8 + 2 * t], (int)hi, s);
    return __dp2a_hi(xw[9 + 2 * t], (int)hi, s);
}
__device__ __forceinline__ int qblock_idot(const QBlock<3>& q, const int* xw) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) s = __dp2a_lo(xw[i], (int)q.h[1 + i], s);
    return s;
}
__device__ __forceinline__ int qblock_idot(const QBlock<4>& q, const int* xw) {
    int s = 0;
#pragma unroll
    for (int t = 0; t < 4; t++) s = q4_word_idot((u32)q.h[1 + 2 * t] | ((u32)q.h[2 + 2 * t] << 16), t, xw, s);
    return s;
}
__device__ __forceinline__ int qblock_idot(const QBlock<5>& q, const int* xw) {
    int s = 0;
#pragma unroll
    for (int t = 0; t < 4; t++) s = q4_word_idot(q.w[1 + t], t, xw, s);
    return s;
}

// acc + (the block's weights) · (its activations), from the integer dot product: `xs` is the
// block's (d, Σx, Σq as int bits) of `quantize_x16_lanes`.
__device__ __forceinline__ float qblock_acc(const QBlock<3>& q, int dot, float4 xs, float acc) {
    return fmaf(h2f(q.h[0]), xs.x * (float)dot, acc);
}
__device__ __forceinline__ float qblock_acc(const QBlock<4>& q, int dot, float4 xs, float acc) {
    return fmaf(h2f(q.h[0]), xs.x * (float)(dot - 8 * __float_as_int(xs.z)), acc);
}
__device__ __forceinline__ float qblock_acc(const QBlock<5>& q, int dot, float4 xs, float acc) {
    acc = fmaf(h2f((u16)(q.w[0] & 0xFFFF)), xs.x * (float)dot, acc);
    return fmaf(h2f((u16)(q.w[0] >> 16)), xs.y, acc);
}

// Activation block `xb` in the format of `quantize_x16_lanes`: its 32 16-bit integers as 16
// pairs (`xw`, four 16-byte loads), and its (d, Σx, Σq) record.
__device__ __forceinline__ float4 x16_block(const short* xq, const float4* xs, u64 xb, int* xw) {
    const uint4* xp = (const uint4*)(xq + xb * 32);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 t = xp[i];
        xw[4 * i] = t.x; xw[4 * i + 1] = t.y; xw[4 * i + 2] = t.z; xw[4 * i + 3] = t.w;
    }
    return xs[xb];
}

// Called after pdl_deferred(): pdl_begin() comes after the first weights are loaded when EARLY,
// else before any load.
// Quantized weights read as stored (no dequantized copy), `row_bytes` a row, with the activations
// of `quantize_x16_lanes` (`xq`: 32 16-bit integers per block, `xs`: one float4 per block): lane
// l of warp w takes the 32-value blocks (it·MM_WARPS + w)·32 + l of MM_WROWS weight rows,
// `load(row, b, block)` decoding block b of a row and `block_acc(block, xw, s, acc)` adding its
// products with an input block to acc. The loop of q8_0, q4_0 and q4_1 (`matmul_q_impl`) and of
// the dtypes of kquants.cu (`matmul_kq_impl`).
template <typename Block, int NR, bool EARLY, typename Load, typename BlockAcc>
__device__ __forceinline__ void matmul_x16_impl(const short* xq, const float4* xs, int rows, int k,
                                                const MatmulJobs& jobs, u64 row_bytes, Load load,
                                                BlockAcc block_acc) {
    MatmulTile t;
    if (!matmul_tile<NR>(jobs, rows, t)) return;
    const int nw = t.nw, nr = t.nr, r0 = t.r0;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float acc[NR][MM_WROWS] = {};
    int n_blocks = k / 32;
    const u8* w0 = t.w + (u64)t.i0 * row_bytes;
    const int first = warp * 32 + lane;
    Block q[MM_WROWS];
    auto load_rows = [&](int b) {
#pragma unroll
        for (int j = 0; j < MM_WROWS; j++) load(w0 + (j < nw ? j : 0) * row_bytes, b, q[j]);
    };
    constexpr bool early = EARLY && PDL_EARLY_WEIGHTS;
    if (early && first < n_blocks) load_rows(first);  // before the wait: see pdl_deferred
    pdl_begin();
    // Each lane reads its own block straight (staging a warp's blocks through shared memory
    // with coalesced 16-byte loads measured slower on the H200).
    for (int b = first; b < n_blocks; b += MM_WARPS * 32) {
        if (!early || b != first) load_rows(b);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r >= nr) continue;
            int xw[16];
            float4 s = x16_block(xq, xs, (u64)(r0 + r) * n_blocks + b, xw);
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) acc[r][j] = block_acc(q[j], xw, s, acc[r][j]);
        }
    }
    matmul_store<NR>(acc, t, jobs.accumulate);
}

// q8_0, q4_0 and q4_1 weights.
template <int DTYPE, int NR>
__device__ void matmul_q_impl(const short* xq, const float4* xs, int rows, int k, const MatmulJobs& jobs) {
    auto load = [](const u8* row, int b, QBlock<DTYPE>& q) {
        load_qblock<DTYPE>(row + (u64)b * qblock_bytes<DTYPE>(), q);
    };
    auto block_acc = [](const QBlock<DTYPE>& q, const int* xw, float4 s, float acc) {
        return qblock_acc(q, qblock_idot(q, xw), s, acc);
    };
    u64 row_bytes = (u64)(k / 32) * qblock_bytes<DTYPE>();
    // q8_0 and q4_0 (16-bit loads) load their weights after the wait: before it, the 7B tg128
    // on the H200 went 308 -> 294 (q8_0) and 428 -> 411 tok/s (q4_0) where q4_1 went 456 -> 467
    // and a SmolLM2-shaped q4_1 1,028 -> 1,203 (BENCHMARKS.md, 2026-11-28).
    constexpr bool early = DTYPE == 5;
    matmul_x16_impl<QBlock<DTYPE>, NR, early>(xq, xs, rows, k, jobs, row_bytes, load, block_acc);
}

// One kernel per weight dtype and row count per block: `_r1` for one input row (decoding one
// sequence), `_r8` for MM_ROWS.
#define MATMUL_KERNELS(NAME, DTYPE)                                                                   \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r1(const float* x, int rows, int k, MatmulJobs jobs) {                               \
        pdl_deferred();                                                                              \
        matmul_impl<DTYPE, 1>(x, rows, k, jobs);                                                     \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r8(const float* x, int rows, int k, MatmulJobs jobs) {                               \
        pdl_deferred();                                                                              \
        matmul_impl<DTYPE, MM_ROWS>(x, rows, k, jobs);                                               \
    }
// The kernels of an implementation `IMPL<DTYPE, NR>` over the 16-bit activations, the one-row
// kernel with the launch bounds `R1_BOUNDS`.
#define MATMUL_X16_KERNELS_BOUNDED(NAME, IMPL, DTYPE, R1_BOUNDS)                                      \
    extern "C" __global__ void R1_BOUNDS                                                             \
        NAME##_r1(const short* xq, const float4* xs, int rows, int k, MatmulJobs jobs) {             \
        pdl_deferred();                                                                              \
        IMPL<DTYPE, 1>(xq, xs, rows, k, jobs);                                                       \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r8(const short* xq, const float4* xs, int rows, int k, MatmulJobs jobs) {             \
        pdl_deferred();                                                                              \
        IMPL<DTYPE, MM_ROWS>(xq, xs, rows, k, jobs);                                                 \
    }
#define MATMUL_X16_KERNELS(NAME, IMPL, DTYPE) \
    MATMUL_X16_KERNELS_BOUNDED(NAME, IMPL, DTYPE, __launch_bounds__(MM_WARPS * 32))
#define MATMUL_Q_KERNELS(NAME, DTYPE) MATMUL_X16_KERNELS(NAME, matmul_q_impl, DTYPE)
MATMUL_KERNELS(matmul_f32, 0)
MATMUL_KERNELS(matmul_f16, 1)
MATMUL_KERNELS(matmul_bf16, 2)
// A decoding row's FFN gate and up products and its gated activation in one launch, for 16-bit
// weights (whose down projection reads f32 activations, so nothing needs the quantized form that
// `gated_act` also writes): out = act(x·gateᵀ) · (x·upᵀ), jobs 0 and 1 the gate and up weights,
// grid ceil(m / MM_GROWS).
#define MATMUL_GATED_KERNEL(NAME, DTYPE)                                                              \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r1_gated(const float* x, int rows, int k, MatmulJobs jobs, int act) {                \
        pdl_deferred();                                                                              \
        matmul_impl<DTYPE, 1, true>(x, rows, k, jobs, act);                                          \
    }
MATMUL_GATED_KERNEL(matmul_f16, 1)
MATMUL_GATED_KERNEL(matmul_bf16, 2)
MATMUL_Q_KERNELS(matmul_q8_0, 3)
MATMUL_Q_KERNELS(matmul_q4_0, 4)
MATMUL_Q_KERNELS(matmul_q4_1, 5)
