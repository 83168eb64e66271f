// Elementwise kernels: conversions between f32 and 16-bit floats, the gated activations, the
// bias add, scaling and soft-capping, and the columns of a split matmul's share put in place.

extern "C" __global__ void copy_f32(const float* src, float* dst, u64 n) {
    pdl_begin();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// dst[r·dst_cols + col0 + c] = src[r·src_cols + c] (`add`: +=) for r < n / src_cols, c < src_cols,
// one thread per source value: a share of a split matmul's output rows (columns of the
// activations) put into place in one launch for all rows (`split.rs`). `src` may be mapped
// pinned host memory that the threads read over PCIe.
extern "C" __global__ void write_columns_f32(const float* src, u64 src_cols, float* dst, u64 dst_cols,
                                             u64 col0, u64 n, int add) {
    pdl_begin();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 r = i / src_cols, c = i - r * src_cols;
    float v = src[i];
    float* d = dst + r * dst_cols + col0 + c;
    if (add) *d += v; else *d = v;
}

// Into the f16 KV cache.
extern "C" __global__ void copy_f32_to_f16(const float* src, u16* dst, u64 n) {
    pdl_begin();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = f2h(src[i]);
}

extern "C" __global__ void copy_f16_to_f32(const u16* src, float* dst, u64 n) {
    pdl_begin();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = h2f(src[i]);
}

// The gate's activation: 0 silu, 1 GeLU with the tanh approximation.
__device__ __forceinline__ float gate_act(float g, int act) {
    if (act == 0) return g / (1.f + expf(-g));
    return 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
}

// gate = act(gate) · up over n values (act as `gate_act`), four per thread when n is a multiple
// of 4 (grid over n / 4 threads, else n); with `xq` (n a multiple of 32) also written for the
// quantized matmul that reads it next.
extern "C" __global__ void gated_act(float* gate, const float* up, u64 n, int act, short* xq, float4* xs) {
    pdl_begin();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (n % 4 != 0) {
        if (i < n) gate[i] = gate_act(gate[i], act) * up[i];
        return;
    }
    bool live = i < n / 4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (live) {
        float4 g = ((const float4*)gate)[i], u = ((const float4*)up)[i];
        o = make_float4(gate_act(g.x, act) * u.x, gate_act(g.y, act) * u.y, gate_act(g.z, act) * u.z,
                        gate_act(g.w, act) * u.w);
        ((float4*)gate)[i] = o;
    }
    if (xq) quantize_x16_lanes(o, live, i / 8, xq, xs);
}

// x[r, c] += bias[c] over rows·width values (the Q/K/V biases; bias of weight `dtype`).
extern "C" __global__ void add_bias(float* x, const u8* bias, int dtype, int width, u64 n) {
    pdl_begin();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += load_elem(bias, dtype, (int)(i % width));
}

// x = factor · x over n values (an embedding scale).
extern "C" __global__ void scale_f32(float* x, u64 n, float factor) {
    pdl_begin();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= factor;
}

// x = cap · tanh(x / cap) over n values (a final logit soft-cap).
extern "C" __global__ void softcap(float* x, u64 n, float cap) {
    pdl_begin();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// out[r] = the greedy choice of row r of x ([rows, cols], one block of ARGMAX_THREADS a row): the
// index of the largest value in the order of `f32::total_cmp` (a NaN with the sign bit clear
// counts as the largest), the lowest index among equal ones — `sampling::argmax` of the host,
// bit for bit — so that a decode step of greedy sequences reads back one id a row instead of
// the row (6.3 MB at 32 rows of a 49,152-token vocabulary) and spends no host time on it.
#define ARGMAX_THREADS 1024

// `f32::total_cmp`'s key: the bits as a signed integer, the magnitude bits flipped for negative
// values.
__device__ __forceinline__ int total_order_key(float v) {
    int bits = __float_as_int(v);
    return bits ^ (int)((u32)(bits >> 31) >> 1);
}

// Whether (key a, index ia) comes before (key b, index ib): larger key, then lower index.
__device__ __forceinline__ bool argmax_before(int a, u32 ia, int b, u32 ib) {
    return a > b || (a == b && ia < ib);
}

// The warp's first (key, index) in that order, in every lane.
__device__ __forceinline__ void argmax_warp(int& best, u32& at) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
        int kb = __shfl_xor_sync(0xffffffffu, best, o);
        u32 ib = __shfl_xor_sync(0xffffffffu, at, o);
        if (argmax_before(kb, ib, best, at)) {
            best = kb;
            at = ib;
        }
    }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows(const float* x, u64 cols, u32* out) {
    pdl_begin();
    const float* row = x + (u64)blockIdx.x * cols;
    // Each thread's first element stands for it until a larger key comes: a thread walks its
    // elements in index order, so on equal keys it keeps the first. A thread with none has
    // the largest index and the smallest key, and never wins.
    int best = -2147483647 - 1;
    u32 at = 0xffffffffu;
    for (u64 i = threadIdx.x; i < cols; i += ARGMAX_THREADS) {
        int k = total_order_key(row[i]);
        if (k > best || at == 0xffffffffu) {
            best = k;
            at = (u32)i;
        }
    }
    argmax_warp(best, at);
    __shared__ int keys[ARGMAX_THREADS / 32];
    __shared__ u32 ids[ARGMAX_THREADS / 32];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        keys[warp] = best;
        ids[warp] = at;
    }
    __syncthreads();
    if (warp == 0) {
        best = keys[lane];
        at = ids[lane];
        argmax_warp(best, at);
        // No logits (cols 0): 0, as on the host.
        if (lane == 0) out[blockIdx.x] = cols == 0 ? 0u : at;
    }
}
