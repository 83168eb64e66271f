// Shared by every kernel file of llama's CUDA backend (compile.rs puts it before each of them;
// they are compiled together by NVRTC at run time). No system headers: only built-in types,
// so halves are converted with PTX `cvt` and bf16 by shifting bits.
//
// Weight dtype codes (must match `dtype_code` in cuda/device.rs):
//   0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0, 5 q4_1; 6 and up: the dtypes of kquants.cu.
// Block layouts (32 values): q8_0 = f16 d, i8 qs[32] (34 bytes); q4_0 = f16 d, u8 qs[16]
// (18 bytes, x = (nibble - 8)·d); q4_1 = f16 d, f16 m, u8 qs[16] (20 bytes, x = nibble·d + m);
// low nibbles are values 0..15, high nibbles 16..31.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// On the device (`__CUDA_ARCH__`, NVRTC) PTX instructions; else the CPU emulator's functions
// (llama/tests/cuda_emu/emu.h), which runs these files in tests on machines without a GPU.
__device__ __forceinline__ float h2f(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return emu_h2f(h);
#endif
}

__device__ __forceinline__ u16 f2h(float f) {
#ifdef __CUDA_ARCH__
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return emu_f2h(f);
#endif
}

// Round to nearest even (inputs are finite activations).
__device__ __forceinline__ u16 f2bf(float f) {
    u32 b = __float_as_uint(f);
    return (u16)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Quantized blocks are not 2-byte aligned in general (q8_0 is 34 bytes), so halves are read
// byte by byte.
__device__ __forceinline__ u16 load_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }

// Programmatic dependent launch (compute capability 9.0 and later): the host launches every
// kernel with programmatic stream serialization there (`Queue::pdl` in device.rs), so a kernel's
// blocks may be scheduled while the kernel before it is still running. Every kernel therefore
// calls this first, before it reads or writes any memory: it waits until the kernels before have
// finished and their writes are visible, then lets the next kernel's blocks be scheduled (they
// wait here in turn). The next kernel's launch is thus under way while this one runs, instead of
// starting after it ends: a decode step is ~10 dependent kernels a layer, each of which waited a
// launch latency before. No-op on older devices and in the CPU emulator.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The first statement of a matmul kernel whose implementation calls pdl_begin() itself, after
// loading its first weights: weights are written by copies (uploads, the streamed and host-tier
// slots), never by a kernel, so they can be read while the kernel before is still finishing and
// their load latency overlaps its tail instead of following it. Anything a kernel writes (the
// activations, the outputs) is touched only after pdl_begin().
__device__ __forceinline__ void pdl_deferred() {}
// `GDSLLM_CUDA_DEFINES=PDL_WEIGHTS_AFTER_WAIT` loads them after the wait instead, as every other
// kernel does (to measure what the overlap gives).
#ifdef PDL_WEIGHTS_AFTER_WAIT
#define PDL_EARLY_WEIGHTS 0
#else
#define PDL_EARLY_WEIGHTS 1
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Element j of a row of `dtype` starting at `row` (slow path: embeddings and norms).
__device__ float load_elem(const u8* row, int dtype, int j) {
    switch (dtype) {
        case 0: return ((const float*)row)[j];
        case 1: return h2f(load_u16(row + 2 * j));
        case 2: return bf2f(load_u16(row + 2 * j));
        case 3: {
            const u8* b = row + (j / 32) * 34;
            return h2f(load_u16(b)) * (float)(signed char)b[2 + j % 32];
        }
        case 4: {
            const u8* b = row + (j / 32) * 18;
            int i = j % 32;
            int q = i < 16 ? (b[2 + i] & 0xF) : (b[2 + i - 16] >> 4);
            return (float)(q - 8) * h2f(load_u16(b));
        }
        default: {
            const u8* b = row + (j / 32) * 20;
            int i = j % 32;
            int q = i < 16 ? (b[4 + i] & 0xF) : (b[4 + i - 16] >> 4);
            return (float)q * h2f(load_u16(b)) + h2f(load_u16(b + 2));
        }
    }
}

// Activations of the quantized matmuls: each 32-value block of x as 16-bit integers
// q = rn(x / d) with d = max|x| / 32767, so the products with the weights' 4- and 8-bit integers
// are exact integer dot products (`dp2a`: two 16×8-bit products per instruction) and the only
// rounding is x's, at most 2^-16 of its block's largest value (f16 keeps 2^-11 of each value).
// This replaces a float conversion and an FMA per weight value, which bounded those kernels
// well below the memory bandwidth. Per block, beside the 32 integers (`xq`, 64 bytes): d, Σx
// (exact, for q4_1's offset m) and Σq (for q4_0's −8) in one float4 (`xs`). Blocks of
// consecutive rows are contiguous (rows are whole blocks), so a block is addressed by its index
// in the flat array.
//
// Eight consecutive lanes hold one block, four values each (lane t of the eight: values
// 4t..4t+3); every lane of the warp must call this (it shuffles), `live` says whether the
// lane's block exists. The kernels that produce a matmul's input (rmsnorm, gated_act) write this
// as they write x, and `quantize_x16` does it for any other input, all through this function,
// so the integers and sums are the same bits whichever kernel made them.
__device__ __forceinline__ void quantize_x16_lanes(float4 v, bool live, u64 block, short* xq, float4* xs) {
    int t = threadIdx.x % 8;
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    float sum = ((v.x + v.y) + v.z) + v.w;
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    float inv = amax > 0.f ? 32767.f / amax : 0.f;
    int a = max(-32767, min(32767, __float2int_rn(v.x * inv)));
    int b = max(-32767, min(32767, __float2int_rn(v.y * inv)));
    int c = max(-32767, min(32767, __float2int_rn(v.z * inv)));
    int d = max(-32767, min(32767, __float2int_rn(v.w * inv)));
    int qsum = (a + b) + (c + d);
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) qsum += __shfl_xor_sync(0xffffffffu, qsum, o);
    if (live) {
        ((uint2*)(xq + block * 32))[t] =
            make_uint2(((u32)a & 0xFFFFu) | ((u32)b << 16), ((u32)c & 0xFFFFu) | ((u32)d << 16));
        if (t == 0) xs[block] = make_float4(amax / 32767.f, sum, __int_as_float(qsum), 0.f);
    }
}


// The sequences of a batch whose attention steps run in one launch (`rope_store_kv_seqs`,
// `attention_decode_seqs`): sequence s has rows row0[s] .. row0[s]+rows[s] of the activations
// (ascending row0), at positions pos0[s] .. of its own f16 caches. Passed by value as a
// `__grid_constant__` parameter (indexed in place, not copied per thread). Must match `SeqTable`
// in cuda/attention.rs.
#define SEQS_MAX 64
struct SeqTable {
    u16* k_cache[SEQS_MAX];
    u16* v_cache[SEQS_MAX];
    int row0[SEQS_MAX];
    int rows[SEQS_MAX];
    int pos0[SEQS_MAX];
    int n;
};

// The sequence that activation row r belongs to (the last whose row0 <= r).
__device__ __forceinline__ int seq_of_row(const SeqTable& seqs, int r) {
    int lo = 0, hi = seqs.n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (seqs.row0[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// The position a kernel starts at: `*pos_dev` when given (a recorded decode step reads it from
// the step parameters written before each replay), else `pos0`.
__device__ __forceinline__ int start_pos(int pos0, const int* pos_dev) { return pos_dev ? *pos_dev : pos0; }

// ---- tensor cores: warp-wide matrix products (mma.sync, sm_80 and later) ---------------------
// D = A·B + C for A 16×K (row-major fragments), B K×8, C/D 16×8, in the fragment layouts of the
// PTX ISA, lane = 4·g + t: A reg0 holds row g and reg1 row g+8 for the first k-set of t, reg2 and
// reg3 the same rows for the second; B reg0 the first k-set of t and reg1 the second, column g;
// C/D (c0, c1) row g, columns 2t and 2t+1, (c2, c3) row g+8, the same columns.
//   m16n8k32, 8-bit integers: k-sets 4t..4t+3 and 16+4t..16+4t+3, byte i of a register is k+i.
//   m16n8k16, f16/bf16: k-sets (2t, 2t+1) and (2t+8, 2t+9), the low half of a register the even k.
// Since a dot product does not care in which order its terms are added, a kernel may give each
// lane's k-sets any columns of the matrix, as long as A and B use the same ones.
// The host launches these only on devices of compute capability 8.0 and later; for older ones
// NVRTC still compiles the file, with a trap in their place.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MMA_ASM(shape_types, c_constraint)                                                           \
    asm volatile("mma.sync.aligned." shape_types " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "   \
                 "{%0, %1, %2, %3};"                                                                 \
                 : c_constraint(c[0]), c_constraint(c[1]), c_constraint(c[2]), c_constraint(c[3])    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
#endif

// c += A·B, A signed 8-bit, B signed (`mma_s8s8`) or unsigned (`mma_s8u8`) 8-bit, int32 sums.
__device__ __forceinline__ void mma_s8s8(const u32 (&a)[4], const u32 (&b)[2], int (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    MMA_ASM("m16n8k32.row.col.s32.s8.s8.s32", "+r");
#elif defined(__CUDA_ARCH__)
    __trap();
#else
    emu::mma_m16n8k32_i8(a, b, c, c, true, true);
#endif
}
__device__ __forceinline__ void mma_s8u8(const u32 (&a)[4], const u32 (&b)[2], int (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    MMA_ASM("m16n8k32.row.col.s32.s8.u8.s32", "+r");
#elif defined(__CUDA_ARCH__)
    __trap();
#else
    emu::mma_m16n8k32_i8(a, b, c, c, true, false);
#endif
}

// c += A·B with f16 (`mma_f16`) or bf16 (`mma_bf16`) operands, f32 sums.
__device__ __forceinline__ void mma_f16(const u32 (&a)[4], const u32 (&b)[2], float (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    MMA_ASM("m16n8k16.row.col.f32.f16.f16.f32", "+f");
#elif defined(__CUDA_ARCH__)
    __trap();
#else
    emu::mma_m16n8k16_f16(a, b, c, c, false);
#endif
}
__device__ __forceinline__ void mma_bf16(const u32 (&a)[4], const u32 (&b)[2], float (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    MMA_ASM("m16n8k16.row.col.f32.bf16.bf16.f32", "+f");
#elif defined(__CUDA_ARCH__)
    __trap();
#else
    emu::mma_m16n8k16_f16(a, b, c, c, true);
#endif
}

// Two values as the halves of one register (the first in the low half).
// An asynchronous copy of N bytes (4, 8 or 16; both addresses N-aligned) from global to shared
// memory (`cp.async`, compute capability 8.0 and later): the bytes travel without passing through
// registers, so a block can issue all of a stage's copies at once. `cp_async_wait` waits for
// this thread's copies (`cp_async_commit` closes a group, `cp_async_wait<N>` waits for all but
// the last N groups); a `__syncthreads` after it makes every thread's visible to the block.
// Elsewhere (older devices, the CPU emulator) a plain load and store.
template <int N>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
    static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(smem));
    if constexpr (N == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(s), "l"(gmem), "n"(N));
#else
    if constexpr (N == 16) *(uint4*)smem = *(const uint4*)gmem;
    else if constexpr (N == 8) *(uint2*)smem = *(const uint2*)gmem;
    else *(u32*)smem = *(const u32*)gmem;
#endif
}
// Closes the group of this thread's copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ u32 pack_halves(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }
