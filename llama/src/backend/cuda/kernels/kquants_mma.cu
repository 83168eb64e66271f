// Batched matmuls on tensor cores for the dtypes of kquants.cu (q5_0, q5_1, iq4_nl, q2_k, q3_k,
// q4_k, q5_k, q6_k, iq4_xs): the design of matmul_mma.cu's quantized path — the same tiles
// (`mma_tile`), column slices and store (`mma_store`), the activations of `quantize_x16` split
// into their signed high and unsigned low bytes, 8-bit integer MMAs with exact int32 sums — fed
// by the 32-value block decoder of kquants.cu: each lane decodes only the two words of levels
// its fragment holds (`kq_block_words`, values 4t..4t+3 and 16+4t..16+4t+3 of rows g and g+8)
// and the block's affine maps (`kq_block_scales`, value = a[h]·level + c[h] per 16 values).
// `mma_chunks_q` (matmul_mma.cu) calls `mma_kq_load` and `mma_kq_tile` for dtype codes 6 on.
//
// Where both halves of a block share one map (q5_0, q5_1, iq4_nl, q4_k, q5_k, iq4_xs), one
// m16n8k32 pair gives the block's integer dot product, scaled as in `qblock_acc`: a·d·dot, plus
// c·Σx (the record's exact sum) where the type has offsets. Where each 16 values have their own
// scale (q2_k, q3_k, q6_k), each half is an m16n8k16 pair, scaled by its own a[h] in the
// expression of the one-row kernel (`kq_block_acc`); q2_k's offsets, where its halves' differ,
// multiply each half's Σ of the activations' integers (else the record's Σx, as that kernel
// does), which one more m16n8k32 pair gives for all 8 columns at once (A: ones in the first half
// of rows 0-7 and in the second half of rows 8-15). Every integer is the
// one-row kernel's, so a row's result differs from it in f32 summation order only, and (split
// and order fixed by the weight's shape) not at all with the batch.

// c += A·B for m16n8k16 8-bit integers: A reg0 (row g, k 4t..4t+3), reg1 (row g+8, same k),
// B (k 4t..4t+3, column g), signed (`B_SIGNED`) or not.
template <bool B_SIGNED>
__device__ __forceinline__ void mma_k16_s8(const u32 (&a)[2], u32 b, int (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (B_SIGNED)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                     "{%0, %1, %2, %3};"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(b));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.u8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                     "{%0, %1, %2, %3};"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(b));
#elif defined(__CUDA_ARCH__)
    __trap();
#else
    const u32 bb[1] = {b};
    emu::mma_m16n8k16_i8(a, bb, c, c, true, B_SIGNED);
#endif
}

// Whether the dtype's blocks have a scale per 16 values (else one per 32), and offsets (c ≠ 0).
template <int DTYPE> __device__ __forceinline__ constexpr bool kq_mma_halves() {
    return DTYPE == KQ_Q2_K || DTYPE == KQ_Q3_K || DTYPE == KQ_Q6_K;
}
template <int DTYPE> __device__ __forceinline__ constexpr bool kq_mma_offsets() {
    return DTYPE == KQ_Q5_1 || DTYPE == KQ_Q4_K || DTYPE == KQ_Q5_K || DTYPE == KQ_Q2_K;
}

template <int DTYPE> __device__ __forceinline__ u64 mma_kq_row_bytes(int n_chunks) {
    return (u64)n_chunks * 32 / kq_block_len<DTYPE>() * kq_block_bytes<DTYPE>();
}

// A lane's part of one 32-value block of a weight row: its two words of levels and the maps.
struct MmaKq {
    u32 w0, w1;
    float a[2], c[2];
};

template <int DTYPE>
__device__ __forceinline__ void mma_kq_load(const u8* row, int chunk, int t, MmaKq& q) {
    int j;
    const u8* blk = kq_block_at<DTYPE>(row, (u64)chunk, j);
    kq_block_words<DTYPE>(blk, j, t, q.w0, q.w1);
    kq_block_scales<DTYPE>(blk, j, q.a, q.c);
}

// Input tile j (this lane's levels v0, v1 and the scale and Σx s0, s1 of columns 2t and 2t+1)
// times the warp's MMA_MT weight tiles `a`, added to acc[..][j]: `mma_q_tile` of matmul_mma.cu
// for these dtypes (its chunk loop, `mma_chunks_q`, serves them too).
template <int DTYPE, int NT>
__device__ __forceinline__ void mma_kq_tile(const MmaKq (&a)[MMA_MT][2], uint2 v0, uint2 v1, float2 s0, float2 s1,
                                            int j, float (&acc)[MMA_MT][NT][4]) {
    u32 bh[2], bl[2];
    mma_xfrag(v0, v1, bh, bl);
    // q2_k: Σ of x's integers over values 0-15 (xsum[0], [1]: columns 2t, 2t+1) and
    // 16-31 (xsum[2], [3]).
    int xsum[4] = {0, 0, 0, 0};
    if constexpr (DTYPE == KQ_Q2_K) {
        const u32 ones[4] = {0x01010101u, 0u, 0u, 0x01010101u};
        mma_dot16(ones, bh, bl, xsum);
    }
#pragma unroll
    for (int mt = 0; mt < MMA_MT; mt++) {
        const MmaKq(&q)[2] = a[mt];
        // d: (row g, col 2t), (row g, col 2t+1), (row g+8, col 2t), (row g+8, col 2t+1).
        if constexpr (kq_mma_halves<DTYPE>()) {
            int d[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u32 A[2] = {h ? q[0].w1 : q[0].w0, h ? q[1].w1 : q[1].w0};
                mma_k16_s8<true>(A, bh[h], d[h]);
#pragma unroll
                for (int e = 0; e < 4; e++) d[h][e] *= 256;
                mma_k16_s8<false>(A, bl[h], d[h]);
            }
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const MmaKq& r = q[e / 2];
                const float2 s = e & 1 ? s1 : s0;
                float v = fmaf(s.x, fmaf(r.a[0], (float)d[0][e], r.a[1] * (float)d[1][e]), acc[mt][j][e]);
                // As `kq_block_acc`: one offset times Σx where both halves share it.
                if constexpr (kq_mma_offsets<DTYPE>())
                    v = r.c[0] == r.c[1] ? fmaf(r.c[0], s.y, v)
                                         : fmaf(r.c[0], s.x * (float)xsum[e & 1],
                                                fmaf(r.c[1], s.x * (float)xsum[2 + (e & 1)], v));
                acc[mt][j][e] = v;
            }
        } else {
            const u32 A[4] = {q[0].w0, q[1].w0, q[0].w1, q[1].w1};
            int d[4];
            mma_dot16(A, bh, bl, d);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const MmaKq& r = q[e / 2];
                const float2 s = e & 1 ? s1 : s0;
                float v = fmaf(r.a[0], s.x * (float)d[e], acc[mt][j][e]);
                if constexpr (kq_mma_offsets<DTYPE>()) v = fmaf(r.c[0], s.y, v);
                acc[mt][j][e] = v;
            }
        }
    }
}

// `MATMUL_MMA_KERNELS` of matmul_mma.cu plus 64-row variants (`_n8`, which matmul_mma.cu's
// dtypes lack: they would take 158-236 registers there); these ask ptxas for two blocks per
// multiprocessor (at most 128 registers a thread, as the q4_1 kernel uses unasked): left alone
// they took 172-182 registers (sm_90; one block, 8 warps, per multiprocessor), asked they spill
// 0-24 bytes. q2_k and q3_k would spill 200-400 bytes and keep one block.
#define KQ_MMA_N8_MIN_BLOCKS(DTYPE) (DTYPE == KQ_Q2_K || DTYPE == KQ_Q3_K ? MMA_MIN_BLOCKS / 2 : MMA_MIN_BLOCKS)
#define MATMUL_MMA_KQ_KERNEL(NAME, DTYPE, NT, BOUNDS)                                                  \
    extern "C" __global__ void BOUNDS NAME##_n##NT(const void* x, const float4* xs, int rows, int k,    \
                                                   MatmulJobs jobs, float* partial, int* counters,     \
                                                   int split) {                                        \
        pdl_begin();                                                                                   \
        matmul_mma_impl<DTYPE, NT>(x, xs, rows, k, jobs, partial, counters, split);                    \
    }
#define MATMUL_MMA_KQ_KERNELS(NAME, DTYPE)                                                               \
    MATMUL_MMA_KQ_KERNEL(NAME, DTYPE, 1, __launch_bounds__(MMA_WARPS * 32))                            \
    MATMUL_MMA_KQ_KERNEL(NAME, DTYPE, 2, __launch_bounds__(MMA_WARPS * 32))                            \
    MATMUL_MMA_KQ_KERNEL(NAME, DTYPE, 4, __launch_bounds__(MMA_WARPS * 32))                            \
    MATMUL_MMA_KQ_KERNEL(NAME, DTYPE, 8, __launch_bounds__(MMA_WARPS * 32, KQ_MMA_N8_MIN_BLOCKS(DTYPE)))
MATMUL_MMA_KQ_KERNELS(matmul_mma_q5_0, KQ_Q5_0)
MATMUL_MMA_KQ_KERNELS(matmul_mma_q5_1, KQ_Q5_1)
MATMUL_MMA_KQ_KERNELS(matmul_mma_iq4_nl, KQ_IQ4_NL)
MATMUL_MMA_KQ_KERNELS(matmul_mma_q2_k, KQ_Q2_K)
MATMUL_MMA_KQ_KERNELS(matmul_mma_q3_k, KQ_Q3_K)
MATMUL_MMA_KQ_KERNELS(matmul_mma_q4_k, KQ_Q4_K)
MATMUL_MMA_KQ_KERNELS(matmul_mma_q5_k, KQ_Q5_K)
MATMUL_MMA_KQ_KERNELS(matmul_mma_q6_k, KQ_Q6_K)
MATMUL_MMA_KQ_KERNELS(matmul_mma_iq4_xs, KQ_IQ4_XS)
