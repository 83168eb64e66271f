// Batched matmuls on tensor cores: out[r, i] (+)= Σ_c x[r, c] · w[i, c] for several input rows
// (batched decoding: one row per sequence), each weight byte read once for up to 8·NT rows.
//
// A block of MMA_WARPS warps owns MMA_BROWS weight rows, MMA_MT 16-row tiles per warp, and up to
// 8·NT input rows (NT tiles of 8; a kernel per NT, the host picks the one for its rows). Each warp loads an input tile's fragments once for its
// MMA_MT weight tiles (with one tile per warp, loading the input rows from L1 took most of the
// kernel's time at 8-32 rows: ncu showed L1 ~60-75 % busy and DRAM ~20 %). Its warps walk the
// same 32-column chunks, so the input rows they all read come from L1; the chunks of a row are split into `split` contiguous slices
// over grid.z (split-K), so that a few thousand weight rows still fill the GPU. With one slice
// a block writes its outputs; with more, each writes its partial sums, which `mma_sum_slices`
// adds in slice order (or, given counters, the last block of a tile to finish adds them). Every output is thus computed in
// an order fixed by the weight's shape alone: a row's result does not depend on the other rows
// of the batch (it differs from the one-row kernel of matmul.cu in the last bits only, f32
// summation order).
//
// Quantized weights (q8_0, q4_0, q4_1) take x in the 16-bit integer format of
// `quantize_x16_lanes`, split into its high (signed) and low (unsigned) bytes: two 8-bit
// integer products (mma m16n8k32, exact int32 sums) give exactly the integer dot products of the
// one-row kernel, scaled the same way. f16 and bf16 weights take x as f32 split into two f16
// (x ≈ hi + lo, within 2^-22 of x) or three bf16 parts, each multiplied on the tensor cores with
// f32 sums: products as exact as the f32 kernel's up to the summation order.
// grid = (Σ_jobs ceil(m_j / MMA_BROWS), ceil(rows / (8·NT)), split), MMA_WARPS·32 threads.
// The geometry can be changed for experiments (GDSLLM_CUDA_DEFINES=MMA_WARPS=4, with
// GDSLLM_CUDA_KERNEL_DIR for other edits): the host reads it from `mma_geometry` at load. The
// staged path copies one weight row a thread, so MMA_MT stays 2.
#ifndef MMA_WARPS
#define MMA_WARPS 8
#endif
#define MMA_MT 2
#define MMA_BROWS (16 * MMA_MT * MMA_WARPS)
// Blocks a multiprocessor the kernels are compiled for (`__launch_bounds__`): 16 warps.
#define MMA_MIN_BLOCKS (16 / MMA_WARPS)
// Most column slices a launch is split into (`mma_split` in matmul.rs clamps to it); a define for
// experiments, as MMA_WARPS.
#ifndef MMA_SPLIT_MAX
#define MMA_SPLIT_MAX 16
#endif
// What the host needs of the above: threads a block, weight rows a block, blocks a
// multiprocessor, most slices (`launch_mma` and `mma_split` in matmul.rs).
extern "C" __device__ const int mma_geometry[4] = {MMA_WARPS * 32, MMA_BROWS, MMA_MIN_BLOCKS, MMA_SPLIT_MAX};
// Outputs a thread of the last block of a tile adds up at once (`mma_store`).
#define MMA_FIX_OUTPUTS 4
// Chunks whose weights a warp loads before multiplying any of them (loads in flight: times
// MMA_MT tiles of two 8-row halves).
#define MMA_QUNROLL 2
#define MMA_FUNROLL 2

// The job (weight, output, rows) of this block, its first weight row, its input rows, and the
// job's first column in the partial sums ([split][rows][Σ m_j]).
struct MmaTile {
    const u8* w;
    float* out;
    int m, i0;
    int r0, nr;
    int col0, m_total;
};

template <int NT>
__device__ __forceinline__ bool mma_tile(const MatmulJobs& jobs, int rows, MmaTile& t) {
    // Selected with unrolled conditional moves (an index into the by-value parameter would copy
    // it to local memory).
    int cta = blockIdx.x, col0 = 0, m_total = jobs.m[0];
    t.w = jobs.w[0];
    t.out = jobs.out[0];
    t.m = jobs.m[0];
    bool found = cta < (t.m + MMA_BROWS - 1) / MMA_BROWS;
    if (!found) cta -= (t.m + MMA_BROWS - 1) / MMA_BROWS;
#pragma unroll
    for (int j = 1; j < MM_MAX_JOBS; j++) {
        if (j >= jobs.n_jobs) break;
        int m = jobs.m[j], tiles = (m + MMA_BROWS - 1) / MMA_BROWS;
        if (!found) {
            if (cta < tiles) {
                found = true;
                t.w = jobs.w[j];
                t.out = jobs.out[j];
                t.m = m;
                col0 = m_total;
            } else {
                cta -= tiles;
            }
        }
        m_total += m;
    }
    if (!found) return false;
    t.i0 = cta * MMA_BROWS;
    t.r0 = blockIdx.y * NT * 8;
    t.nr = min(NT * 8, rows - t.r0);
    t.col0 = col0;
    t.m_total = m_total;
    return true;
}

// One 32-value block of a quantized weight row as this lane's two k-sets: w0 holds values
// 4t..4t+3, w1 values 16+4t..16+4t+3, as signed 8-bit levels; value = a·level (+ c for q4_1).
struct MmaQ {
    u32 w0, w1;
    float a, c;
};

template <int DTYPE> __device__ __forceinline__ void mma_qload(const u8* row, int chunk, int t, MmaQ& q);
template <> __device__ __forceinline__ void mma_qload<3>(const u8* row, int chunk, int t, MmaQ& q) {
    const u16* h = (const u16*)(row + (u64)chunk * 34);  // 2-aligned
    q.a = h2f(h[0]);
    q.c = 0.f;
    q.w0 = pack_halves(h[1 + 2 * t], h[2 + 2 * t]);
    q.w1 = pack_halves(h[9 + 2 * t], h[10 + 2 * t]);
}
template <> __device__ __forceinline__ void mma_qload<4>(const u8* row, int chunk, int t, MmaQ& q) {
    const u16* h = (const u16*)(row + (u64)chunk * 18);  // 2-aligned
    q.a = h2f(h[0]);
    q.c = 0.f;
    u32 v = pack_halves(h[1 + 2 * t], h[2 + 2 * t]);
    q.w0 = __vsub4(v & 0x0F0F0F0Fu, 0x08080808u);
    q.w1 = __vsub4((v >> 4) & 0x0F0F0F0Fu, 0x08080808u);
}
template <> __device__ __forceinline__ void mma_qload<5>(const u8* row, int chunk, int t, MmaQ& q) {
    const u32* p = (const u32*)(row + (u64)chunk * 20);  // 4-aligned
    u32 hdr = p[0], v = p[1 + t];
    q.a = h2f((u16)(hdr & 0xFFFF));
    q.c = h2f((u16)(hdr >> 16));
    q.w0 = v & 0x0F0F0F0Fu;
    q.w1 = (v >> 4) & 0x0F0F0F0Fu;
}

// acc + the block's products from their integer dot product `dot` and the activations' record
// `s` (its scale and Σx; Σq is not needed here): the expressions of `qblock_acc` in matmul.cu (q4_0's levels already
// have the −8, which the one-row kernel subtracts through Σq: the same integer).
template <int DTYPE>
__device__ __forceinline__ float mma_qacc(const MmaQ& q, int dot, float2 s, float acc) {
    acc = fmaf(q.a, s.x * (float)dot, acc);
    if constexpr (DTYPE == 5) acc = fmaf(q.c, s.y, acc);
    return acc;
}

// An 8-row input tile's B fragments from this lane's 16-bit levels (v0: values 4t..4t+3 of the
// chunk, v1: 16+4t..16+4t+3): x = 256·hi + lo, hi the signed high bytes, lo the unsigned low ones.
__device__ __forceinline__ void mma_xfrag(uint2 v0, uint2 v1, u32 (&bh)[2], u32 (&bl)[2]) {
    bh[0] = __byte_perm(v0.x, v0.y, 0x7531);
    bh[1] = __byte_perm(v1.x, v1.y, 0x7531);
    bl[0] = __byte_perm(v0.x, v0.y, 0x6420);
    bl[1] = __byte_perm(v1.x, v1.y, 0x6420);
}

// d = A·x over a 32-value chunk, exactly: two 8-bit integer products (the high bytes, signed,
// times 256, plus the low bytes, unsigned), the integers of the one-row kernel's `dp2a`.
__device__ __forceinline__ void mma_dot16(const u32 (&A)[4], const u32 (&bh)[2], const u32 (&bl)[2], int (&d)[4]) {
#pragma unroll
    for (int e = 0; e < 4; e++) d[e] = 0;
    mma_s8s8(A, bh, d);
#pragma unroll
    for (int e = 0; e < 4; e++) d[e] *= 256;
    mma_s8u8(A, bl, d);
}

// Input tile j (this lane's levels v0, v1 and the scale and Σx s0, s1 of columns 2t and 2t+1)
// times the warp's MMA_MT weight tiles `a`, added to acc[..][j].
template <int DTYPE, int NT>
__device__ __forceinline__ void mma_q_tile(const MmaQ (&a)[MMA_MT][2], uint2 v0, uint2 v1, float2 s0, float2 s1, int j,
                                           float (&acc)[MMA_MT][NT][4]) {
    u32 bh[2], bl[2];
    mma_xfrag(v0, v1, bh, bl);
#pragma unroll
    for (int mt = 0; mt < MMA_MT; mt++) {
        const MmaQ(&q)[2] = a[mt];
        const u32 A[4] = {q[0].w0, q[1].w0, q[0].w1, q[1].w1};
        int d[4];
        mma_dot16(A, bh, bl, d);
        // d: (row g, col 2t), (row g, col 2t+1), (row g+8, col 2t), (row g+8, col 2t+1).
        acc[mt][j][0] = mma_qacc<DTYPE>(q[0], d[0], s0, acc[mt][j][0]);
        acc[mt][j][1] = mma_qacc<DTYPE>(q[0], d[1], s1, acc[mt][j][1]);
        acc[mt][j][2] = mma_qacc<DTYPE>(q[1], d[2], s0, acc[mt][j][2]);
        acc[mt][j][3] = mma_qacc<DTYPE>(q[1], d[3], s1, acc[mt][j][3]);
    }
}

template <int DTYPE> __device__ __forceinline__ constexpr int mma_block_bytes() {
    return DTYPE == 1 || DTYPE == 2 ? 64 : DTYPE == 3 ? 34 : DTYPE == 4 ? 18 : 20;
}

// x row (clamped to the block's rows: the extra columns of a partial tile repeat the last row and
// are never stored) of B column `col` of input tile j.
__device__ __forceinline__ int mma_xrow(const MmaTile& t, int j, int col) { return t.r0 + min(j * 8 + col, t.nr - 1); }

// Chunks c0..c1 of the warp's MMA_MT weight tiles, UNROLL at a time: first this lane's fragments
// of both 8-row halves of every tile for all UNROLL chunks (`load(row, chunk, fragment)`; past c1
// the last chunk again, so that the loads need no branch), then `multiply(chunk, fragments)` for
// each chunk in order. The loop of every path that loads its fragments straight from global
// memory (f16/bf16, and the quantized dtypes of this file and of kquants_mma.cu).
template <typename Frag, int UNROLL, typename Load, typename Multiply>
__device__ __forceinline__ void mma_chunk_loop(const u8* const (&wg)[MMA_MT][2], int c0, int c1, Load load,
                                               Multiply multiply) {
    for (int c = c0; c < c1; c += UNROLL) {
        Frag a[UNROLL][MMA_MT][2];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int cu = min(c + u, c1 - 1);
#pragma unroll
            for (int mt = 0; mt < MMA_MT; mt++) {
                load(wg[mt][0], cu, a[u][mt][0]);
                load(wg[mt][1], cu, a[u][mt][1]);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (c + u >= c1) break;  // the same for the whole warp
            multiply(c + u, a[u]);
        }
    }
}

// The dtypes of kquants.cu (codes 6 on): their fragment, its loader and an input tile's products,
// in kquants_mma.cu.
struct MmaKq;
template <int DTYPE> __device__ __forceinline__ void mma_kq_load(const u8* row, int chunk, int t, MmaKq& q);
template <int DTYPE, int NT>
__device__ __forceinline__ void mma_kq_tile(const MmaKq (&a)[MMA_MT][2], uint2 v0, uint2 v1, float2 s0, float2 s1,
                                            int j, float (&acc)[MMA_MT][NT][4]);
// A lane's part of one 32-value block of a quantized weight row: `MmaQ` for q8_0, q4_0 and q4_1,
// `MmaKq` for the dtypes of kquants.cu.
template <bool KQ> struct MmaQFrag {
    using type = MmaQ;
};
template <> struct MmaQFrag<true> {
    using type = MmaKq;
};

// Quantized weights (q8_0, q4_0, q4_1, and from code 6 the dtypes of kquants.cu): each chunk's
// fragments times the input tiles' 16-bit levels (`xq`) and records (`xs`).
template <int DTYPE, int NT>
__device__ __forceinline__ void mma_chunks_q(const MmaTile& t, const u8* const (&wg)[MMA_MT][2], const short* xq,
                                             const float4* xs, int n_chunks, int c0, int c1,
                                             float (&acc)[MMA_MT][NT][4]) {
    constexpr bool KQ = DTYPE >= 6;
    using Frag = typename MmaQFrag<KQ>::type;
    const int lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    auto load = [&](const u8* row, int chunk, Frag& q) {
        if constexpr (KQ) mma_kq_load<DTYPE>(row, chunk, tq, q);
        else mma_qload<DTYPE>(row, chunk, tq, q);
    };
    auto multiply = [&](int c, const Frag (&a)[MMA_MT][2]) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (j * 8 >= t.nr) break;
            const short* xp = xq + ((u64)mma_xrow(t, j, g) * n_chunks + c) * 32;
            uint2 v0 = *(const uint2*)(xp + 4 * tq), v1 = *(const uint2*)(xp + 16 + 4 * tq);
            // Only the scale and Σx of each record: half the bytes of the float4.
            float2 s0 = *(const float2*)&xs[(u64)mma_xrow(t, j, 2 * tq) * n_chunks + c];
            float2 s1 = *(const float2*)&xs[(u64)mma_xrow(t, j, 2 * tq + 1) * n_chunks + c];
            if constexpr (KQ) mma_kq_tile<DTYPE, NT>(a, v0, v1, s0, s1, j, acc);
            else mma_q_tile<DTYPE, NT>(a, v0, v1, s0, s1, j, acc);
        }
    };
    mma_chunk_loop<Frag, MMA_QUNROLL>(wg, c0, c1, load, multiply);
}

// The staged path of quantized weights, taken when the row's chunks split into whole stages: a
// stage is G chunks (`mma_stage_chunks`) of all MMA_BROWS weight rows and of all the block's
// input rows (levels and the scale and Σx of their records), copied into shared memory by the
// whole block with `cp_async` (consecutive threads take consecutive 4-16 byte pieces of a row),
// then every warp reads its fragments from there. With two buffers (`mma_stage_buffers`) the
// next stage's copies are in flight while the warps multiply the current one. Loading the
// fragments straight from global memory (the loop above) made each warp issue 8-row gathers for
// its weights and load every input fragment itself: ncu showed that kernel stalled on L1 (54 %
// of its cycles waiting for loads, L1 57 % busy, DRAM 16 %) at 32 rows. Same products, same
// order per output.
// Two buffers of 2 chunks fit the 48 KB of static shared memory for the 4-bit types (q8_0's
// 34-byte blocks do not: one buffer). One buffer of 4 chunks measured the same on the H100
// (BENCHMARKS.md, 2026-11-25).
template <int DTYPE> __device__ __forceinline__ constexpr int mma_stage_chunks() { return 2; }
template <int DTYPE> __device__ __forceinline__ constexpr int mma_stage_buffers() { return DTYPE == 3 ? 1 : 2; }
// Bytes of a weight row's stage: its G blocks, padded to a multiple of 16 (48 or 80): 16-byte
// aligned, and the 8 rows a fragment load reads fall in distinct banks.
template <int DTYPE> __device__ __forceinline__ constexpr int mma_stage_wrow() {
    return (mma_stage_chunks<DTYPE>() * mma_block_bytes<DTYPE>() + 15) / 16 * 16;
}
// The copy size: the largest that divides a stage's bytes, so that the stage's offset (c·block
// bytes, c a multiple of G) and the row's length (n_chunks a multiple of G) keep it aligned.
template <int DTYPE> __device__ __forceinline__ constexpr int mma_stage_copy() {
    constexpr int b = mma_stage_chunks<DTYPE>() * mma_block_bytes<DTYPE>();
    return b % 16 == 0 ? 16 : b % 8 == 0 ? 8 : 4;
}

template <int DTYPE, int NT>
__device__ __forceinline__ void mma_chunks_q_staged(const MmaTile& t, int wr, const short* xq, const float4* xs,
                                                    int n_chunks, int c0, int c1, float (&acc)[MMA_MT][NT][4]) {
    constexpr int G = mma_stage_chunks<DTYPE>(), NB = mma_stage_buffers<DTYPE>(), BB = mma_block_bytes<DTYPE>();
    constexpr int CP = mma_stage_copy<DTYPE>(), WROW = mma_stage_wrow<DTYPE>();
    constexpr int W_COPIES = G * BB / CP;  // per weight row
    // An input row's G chunks (64·G bytes) plus 32: the 8 rows of a fragment load in distinct banks.
    constexpr int XROW = G * 64 + 32, XR = NT * 8;
    constexpr int W_BYTES = MMA_BROWS * WROW, X_BYTES = XR * XROW;
    __shared__ uint4 sw4[NB * W_BYTES / 16];
    __shared__ uint4 sx4[NB * X_BYTES / 16];
    __shared__ float2 sr[NB * XR * G];
    const int lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4, warp = threadIdx.x / 32;
    const u64 row_bytes = (u64)n_chunks * BB;
    // Stage c's copies into buffer b.
    // Every thread's share of a stage's copies is the same at every stage but for the column
    // (`c`): loops of a fixed trip count (MMA_BROWS is the block's thread count, so the weight
    // rows' copies are exactly W_COPIES a thread), unrolled where that is at most 8 copies
    // (then the compiler keeps their row pointers across stages instead of recomputing them;
    // q8_0's 17 four-byte copies would take as many pointers and spill).
    static_assert(MMA_BROWS == MMA_WARPS * 32, "one weight row a thread");
    constexpr int X_COPIES = XR * G * 4, R_COPIES = XR * G, THREADS = MMA_WARPS * 32;
    constexpr int W_UNROLL = W_COPIES <= 8 ? W_COPIES : 1;
    auto copy_stage = [&](int c, int b) {
        u8* sw = (u8*)sw4 + b * W_BYTES;
        u8* sx = (u8*)sx4 + b * X_BYTES;
#pragma unroll W_UNROLL
        for (int q = 0; q < W_COPIES; q++) {
            const int i = threadIdx.x + q * THREADS, r = i / W_COPIES, p = i % W_COPIES;
            // Rows past the weight's last (a partial tile) copy its last row; never stored.
            const u8* src = t.w + (u64)min(t.i0 + r, t.m - 1) * row_bytes + (u64)c * BB + p * CP;
            cp_async<CP>(sw + r * WROW + p * CP, src);
        }
#pragma unroll
        for (int q = 0; q < (X_COPIES + THREADS - 1) / THREADS; q++) {
            const int i = threadIdx.x + q * THREADS, r = i / (G * 4), p = i % (G * 4);
            if (X_COPIES % THREADS != 0 && i >= X_COPIES) break;
            const short* src = xq + ((u64)(t.r0 + min(r, t.nr - 1)) * n_chunks + c) * 32 + p * 8;
            cp_async<16>(sx + r * XROW + p * 16, src);
        }
#pragma unroll
        for (int q = 0; q < (R_COPIES + THREADS - 1) / THREADS; q++) {
            const int i = threadIdx.x + q * THREADS, r = i / G, u = i % G;
            if (R_COPIES % THREADS != 0 && i >= R_COPIES) break;
            cp_async<8>(&sr[b * XR * G + i], &xs[(u64)(t.r0 + min(r, t.nr - 1)) * n_chunks + c + u]);
        }
        cp_async_commit();
    };
    if (c0 < c1) copy_stage(c0, 0);  // an empty slice (more slices than stages) copies nothing
    for (int c = c0, s = 0; c < c1; c += G, s++) {
        const int b = NB == 1 ? 0 : s & 1;
        if (NB == 2 && c + G < c1) {
            copy_stage(c + G, b ^ 1);  // its buffer was last read before the barrier that ended stage s-1
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u8* sw = (const u8*)sw4 + b * W_BYTES;
        const u8* sx = (const u8*)sx4 + b * X_BYTES;
        const float2* srb = sr + b * XR * G;
        if (wr < t.m) {  // the same for the whole warp
#pragma unroll
            for (int u = 0; u < G; u++) {
                MmaQ a[MMA_MT][2];
#pragma unroll
                for (int mt = 0; mt < MMA_MT; mt++) {
                    const u8* row = sw + ((warp * MMA_MT + mt) * 16 + g) * WROW;
                    mma_qload<DTYPE>(row, u, tq, a[mt][0]);
                    mma_qload<DTYPE>(row + 8 * WROW, u, tq, a[mt][1]);
                }
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    if (j * 8 >= t.nr) break;
                    const u8* xp = sx + (j * 8 + g) * XROW + u * 64;
                    uint2 v0 = *(const uint2*)(xp + 8 * tq), v1 = *(const uint2*)(xp + 32 + 8 * tq);
                    const float2 s0 = srb[(j * 8 + 2 * tq) * G + u], s1 = srb[(j * 8 + 2 * tq + 1) * G + u];
                    mma_q_tile<DTYPE, NT>(a, v0, v1, s0, s1, j, acc);
                }
            }
        }
        __syncthreads();  // the buffer is read before a later stage's copies overwrite it
        if (NB == 1 && c + G < c1) copy_stage(c + G, 0);
    }
}

// f16 (DTYPE 1) or bf16 (2) weights: lane t takes values 8t..8t+7 of each 32-value chunk (one
// 16-byte load per row), two k16 steps: values 8t+4s, +1 as k-set (2t, 2t+1) and 8t+4s+2, +3 as
// (2t+8, 2t+9) of step s, for A and B alike.
template <int DTYPE, int NT>
__device__ __forceinline__ void mma_chunks_f(const MmaTile& t, const u8* const (&wg)[MMA_MT][2], const float* x, int k,
                                             int c0, int c1, float (&acc)[MMA_MT][NT][4]) {
    const int lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    constexpr int PARTS = DTYPE == 1 ? 2 : 3;
    auto load = [&](const u8* row, int chunk, uint4& w) { w = *(const uint4*)(row + (u64)chunk * 64 + 16 * tq); };
    auto multiply = [&](int c, const uint4 (&a)[MMA_MT][2]) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (j * 8 >= t.nr) break;
            const float* xp = x + (u64)mma_xrow(t, j, g) * k + (u64)c * 32 + 8 * tq;
            float4 p = *(const float4*)xp, q = *(const float4*)(xp + 4);
            float v[8] = {p.x, p.y, p.z, p.w, q.x, q.y, q.z, q.w};
            u16 part[PARTS][8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float rest = v[e];
#pragma unroll
                for (int s = 0; s < PARTS; s++) {
                    u16 h = DTYPE == 1 ? f2h(rest) : f2bf(rest);
                    part[s][e] = h;
                    rest -= DTYPE == 1 ? h2f(h) : bf2f(h);
                }
            }
            // The smallest parts first.
#pragma unroll
            for (int s = PARTS - 1; s >= 0; s--) {
                const u32 B0[2] = {pack_halves(part[s][0], part[s][1]), pack_halves(part[s][2], part[s][3])};
                const u32 B1[2] = {pack_halves(part[s][4], part[s][5]), pack_halves(part[s][6], part[s][7])};
#pragma unroll
                for (int mt = 0; mt < MMA_MT; mt++) {
                    const uint4(&w)[2] = a[mt];
                    const u32 A0[4] = {w[0].x, w[1].x, w[0].y, w[1].y};
                    const u32 A1[4] = {w[0].z, w[1].z, w[0].w, w[1].w};
                    if constexpr (DTYPE == 1) {
                        mma_f16(A0, B0, acc[mt][j]);
                        mma_f16(A1, B1, acc[mt][j]);
                    } else {
                        mma_bf16(A0, B0, acc[mt][j]);
                        mma_bf16(A1, B1, acc[mt][j]);
                    }
                }
            }
        }
    };
    mma_chunk_loop<uint4, MMA_FUNROLL>(wg, c0, c1, load, multiply);
}

// The block's outputs: written (or added) directly with one slice; with more, the partial sums,
// then the last block of the tile adds every slice's in order.
template <int NT>
__device__ __forceinline__ void mma_store(const float (&acc)[MMA_MT][NT][4], const MmaTile& t, int rows,
                                          int accumulate, float* partial, int* counters, int split) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MMA_MT; mt++) {
        const int wr = t.i0 + (warp * MMA_MT + mt) * 16;
        if (wr >= t.m) break;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = j * 8 + 2 * tq + (e & 1), i = wr + g + (e >= 2 ? 8 : 0);
                if (r >= t.nr || i >= t.m) continue;
                if (split == 1) {
                    float* o = t.out + (u64)(t.r0 + r) * t.m + i;
                    *o = accumulate ? *o + acc[mt][j][e] : acc[mt][j][e];
                } else {
                    partial[((u64)blockIdx.z * rows + t.r0 + r) * t.m_total + t.col0 + i] = acc[mt][j][e];
                }
            }
    }
    // Without counters the slices are summed by `mma_sum_slices`, launched after this kernel.
    if (split == 1 || counters == nullptr) return;
    __shared__ int last;
    __threadfence();  // this thread's partial sums are visible to the block that adds them
    __syncthreads();
    int* counter = counters + blockIdx.x + gridDim.x * blockIdx.y;
    if (threadIdx.x == 0) last = atomicAdd(counter, 1) == split - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int cols = min(MMA_BROWS, t.m - t.i0), n = t.nr * cols;
    // MMA_FIX_OUTPUTS outputs a thread, every slice's partial of each loaded before any is
    // added (split <= MMA_SPLIT_MAX): this block alone walks up to 32 rows x 256 columns of
    // them, the tail of the whole launch, and each round of loads waits one L2 round trip (one
    // output a round took ~32 round trips at 32 rows; ncu, H100). Consecutive threads take
    // consecutive columns: coalesced.
    for (int e0 = threadIdx.x; e0 < n; e0 += MMA_FIX_OUTPUTS * blockDim.x) {
        float parts[MMA_FIX_OUTPUTS][MMA_SPLIT_MAX];
#pragma unroll
        for (int q = 0; q < MMA_FIX_OUTPUTS; q++) {
            const int e = e0 + q * blockDim.x, r = e / cols, i = t.i0 + e % cols;
#pragma unroll
            for (int s = 0; s < MMA_SPLIT_MAX; s++)
                parts[q][s] = e < n && s < split
                                  ? __ldcg(partial + ((u64)s * rows + t.r0 + r) * t.m_total + t.col0 + i)
                                  : 0.f;
        }
#pragma unroll
        for (int q = 0; q < MMA_FIX_OUTPUTS; q++) {
            const int e = e0 + q * blockDim.x, r = e / cols, i = t.i0 + e % cols;
            if (e >= n) break;
            float v = 0.f;
#pragma unroll
            for (int s = 0; s < MMA_SPLIT_MAX; s++)
                if (s < split) v += parts[q][s];  // in slice order, as before
            float* o = t.out + (u64)(t.r0 + r) * t.m + i;
            *o = accumulate ? *o + v : v;
        }
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
}

// The column slices of a split launch summed over the whole GPU, one output a thread: out[r, i]
// (+)= Σ_s partial[s][r][col0 + i], in slice order from 0 (the same bits as the last-block sum
// of `mma_store`). Why a kernel of its own: in that sum only the last block of each tile works,
// so the launch ended in a tail where most multiprocessors idled. ncu of a 32-row decode step of
// a 7B q4_1 (H200): the O projection (16 tiles of 16 slices) took 65 µs, its multiprocessors
// active 30 % of it, the tail's 16 blocks a fifth of all warp samples; QKV and gate+up (5 and 3
// slices) a quarter. grid = (ceil(Σ m_j / 256), rows), 256 threads; consecutive threads read
// consecutive columns of every slice.
extern "C" __global__ void __launch_bounds__(256) mma_sum_slices(const float* partial, int rows, int split,
                                                                 MatmulJobs jobs) {
    pdl_begin();
    const int col = blockIdx.x * 256 + threadIdx.x, r = blockIdx.y;
    // The job of this column, by unrolled conditional moves (as `mma_tile`).
    float* out = jobs.out[0];
    int m = jobs.m[0], i = col, m_total = jobs.m[0];
#pragma unroll
    for (int j = 1; j < MM_MAX_JOBS; j++) {
        if (j >= jobs.n_jobs) break;
        if (i >= m) {
            i -= m;
            out = jobs.out[j];
            m = jobs.m[j];
        }
        m_total += jobs.m[j];
    }
    if (col >= m_total) return;
    float parts[MMA_SPLIT_MAX];
#pragma unroll
    for (int s = 0; s < MMA_SPLIT_MAX; s++)
        parts[s] = s < split ? __ldcg(partial + ((u64)s * rows + r) * m_total + col) : 0.f;
    float v = 0.f;
#pragma unroll
    for (int s = 0; s < MMA_SPLIT_MAX; s++)
        if (s < split) v += parts[s];
    float* o = out + (u64)r * m + i;
    *o = jobs.accumulate ? *o + v : v;
}

// The dtypes of kquants.cu (codes 6 on): their row size, in kquants_mma.cu.
template <int DTYPE> __device__ __forceinline__ u64 mma_kq_row_bytes(int n_chunks);

// `x` is f32 rows for f16/bf16 weights, the 16-bit integers of `quantize_x16` (with their
// records `xs`) for quantized ones; rows of whole 32-value chunks.
template <int DTYPE, int NT>
__device__ void matmul_mma_impl(const void* x, const float4* xs, int rows, int k, const MatmulJobs& jobs,
                                float* partial, int* counters, int split) {
    MmaTile t;
    if (!mma_tile<NT>(jobs, rows, t)) return;  // the whole block, before any barrier
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    const int n_chunks = k / 32;
    // q8_0/q4_0/q4_1 rows of whole stages take the staged path, its slices made of whole stages.
    constexpr bool STAGED_DTYPE = DTYPE >= 3 && DTYPE <= 5;
    constexpr int G = STAGED_DTYPE ? mma_stage_chunks<DTYPE>() : 1;
    const bool staged = G > 1 && n_chunks % G == 0;
    const int unit = staged ? G : 1, n_units = n_chunks / unit;
    const int c0 = unit * (int)((long long)n_units * blockIdx.z / split);
    const int c1 = unit * (int)((long long)n_units * (blockIdx.z + 1) / split);
    float acc[MMA_MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MMA_MT; mt++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][j][e] = 0.f;
    const int wr = t.i0 + warp * MMA_MT * 16;
    if constexpr (STAGED_DTYPE) {
        if (staged) {  // the same for the whole block: every thread reaches the stage barriers
            mma_chunks_q_staged<DTYPE, NT>(t, wr, (const short*)x, xs, n_chunks, c0, c1, acc);
            mma_store<NT>(acc, t, rows, jobs.accumulate, partial, counters, split);
            return;
        }
    }
    if (wr < t.m) {  // the same for the whole warp
        u64 row_bytes;
        if constexpr (DTYPE >= 6) row_bytes = mma_kq_row_bytes<DTYPE>(n_chunks);
        else row_bytes = (u64)n_chunks * mma_block_bytes<DTYPE>();
        // Rows past the weight's last (a partial tile) read its last row and are never stored.
        const u8* wg[MMA_MT][2];
#pragma unroll
        for (int mt = 0; mt < MMA_MT; mt++) {
            wg[mt][0] = t.w + (u64)min(wr + mt * 16 + g, t.m - 1) * row_bytes;
            wg[mt][1] = t.w + (u64)min(wr + mt * 16 + g + 8, t.m - 1) * row_bytes;
        }
        if constexpr (DTYPE == 1 || DTYPE == 2)
            mma_chunks_f<DTYPE, NT>(t, wg, (const float*)x, k, c0, c1, acc);
        else
            mma_chunks_q<DTYPE, NT>(t, wg, (const short*)x, xs, n_chunks, c0, c1, acc);
    }
    mma_store<NT>(acc, t, rows, jobs.accumulate, partial, counters, split);
}

// `_n1`, `_n2`, `_n4`: up to 8, 16 or 32 input rows per block; more rows take more blocks
// (grid.y). The kernels ask ptxas for MMA_MIN_BLOCKS blocks per multiprocessor (16 warps): left alone they took
// 162-168 registers (sm_90), one block of 8 warps per multiprocessor, too few to hide the
// latency of the staged loads and barriers (ncu, H100, q4_1 at 32 rows: 12.5 % occupancy, issue
// slots 25 % busy); asked, q4_1 spills 40 bytes, q4_0 24. A 64-row variant would take 158-236
// registers and keep one block.
#define MATMUL_MMA_KERNEL(NAME, DTYPE, NT)                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, MMA_MIN_BLOCKS)                      \
        NAME##_n##NT(const void* x, const float4* xs, int rows, int k, MatmulJobs jobs, float* partial, \
                     int* counters, int split) {                                                       \
        pdl_begin();                                                                                   \
        matmul_mma_impl<DTYPE, NT>(x, xs, rows, k, jobs, partial, counters, split);                    \
    }
#define MATMUL_MMA_KERNELS(NAME, DTYPE) \
    MATMUL_MMA_KERNEL(NAME, DTYPE, 1)   \
    MATMUL_MMA_KERNEL(NAME, DTYPE, 2)   \
    MATMUL_MMA_KERNEL(NAME, DTYPE, 4)
MATMUL_MMA_KERNELS(matmul_mma_f16, 1)
MATMUL_MMA_KERNELS(matmul_mma_bf16, 2)
MATMUL_MMA_KERNELS(matmul_mma_q8_0, 3)
MATMUL_MMA_KERNELS(matmul_mma_q4_0, 4)
MATMUL_MMA_KERNELS(matmul_mma_q4_1, 5)
