// Kernels of llama's CUDA backend. Compiled at run time by NVRTC (no system headers: only
// built-in types), so halves are converted with PTX `cvt` and bf16 by shifting bits.
//
// Weight dtype codes (must match `DTYPE_*` in cuda/mod.rs):
//   0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0, 5 q4_1; 6 and up: the dtypes of kquants.cu.
// Block layouts (32 values): q8_0 = f16 d, i8 qs[32] (34 bytes); q4_0 = f16 d, u8 qs[16]
// (18 bytes, x = (nibble - 8)·d); q4_1 = f16 d, f16 m, u8 qs[16] (20 bytes, x = nibble·d + m);
// low nibbles are values 0..15, high nibbles 16..31.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Quantized blocks are not 2-byte aligned in general (q8_0 is 34 bytes), so halves are read
// byte by byte.
__device__ __forceinline__ u16 load_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }

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

// out[r, :] = table[ids[r], :]; one block per row.
extern "C" __global__ void embed_rows(const u8* table, u64 row_bytes, int dtype, const u32* ids,
                                      int dim, float* out) {
    int r = blockIdx.x;
    const u8* row = table + (u64)ids[r] * row_bytes;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) out[(u64)r * dim + j] = load_elem(row, dtype, j);
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
// lane's block exists. The kernels that produce a matmul's input (rmsnorm, swiglu) write this
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

// x (n values, a multiple of 32) in the format above; one float4 per thread.
extern "C" __global__ void quantize_x16(const float* x, u64 n, short* xq, float4* xs) {
    u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    bool live = c < n / 4;
    float4 v = live ? ((const float4*)x)[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    quantize_x16_lanes(v, live, c / 8, xq, xs);
}

// One block of RMS_THREADS per row, f32 sum of squares. Rows whose width is a multiple of 4
// are read as float4 and kept in registers between the two passes (up to RMS_VEC per thread;
// a 4096-wide row is one load per thread): with one row per block (decoding), the latency of
// dependent loads, not bandwidth, is the cost. When `xq` is given (width a multiple of 32) the
// normalized rows are also written for the quantized matmuls that read them next.
#define RMS_THREADS 1024
#define RMS_VEC 4
// Values 4c..4c+3 of row r of rmsnorm's output from those of its input `t`.
__device__ __forceinline__ void rmsnorm_store(float4 t, int c, int n4, int r, float scale, const u8* weight,
                                              int dtype, float* orow, short* xq, float4* xs) {
    bool live = c < n4;
    float4 w = make_float4(0.f, 0.f, 0.f, 0.f);
    if (live) {
        w = dtype == 0 ? ((const float4*)weight)[c]
                       : make_float4(load_elem(weight, dtype, 4 * c), load_elem(weight, dtype, 4 * c + 1),
                                     load_elem(weight, dtype, 4 * c + 2), load_elem(weight, dtype, 4 * c + 3));
    }
    float4 o = make_float4(t.x * scale * w.x, t.y * scale * w.y, t.z * scale * w.z, t.w * scale * w.w);
    if (live) ((float4*)orow)[c] = o;
    if (xq) quantize_x16_lanes(o, live, ((u64)r * n4 + c) / 8, xq, xs);
}
extern "C" __global__ void __launch_bounds__(RMS_THREADS) rmsnorm(const float* x, const u8* weight, int dtype,
                                                                 int dim, float eps, float* out, short* xq,
                                                                 float4* xs) {
    __shared__ float partial[RMS_THREADS / 32];
    int r = blockIdx.x;
    const float* xr = x + (u64)r * dim;
    float* orow = out + (u64)r * dim;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    bool vec = dim % 4 == 0;
    int n4 = vec ? dim / 4 : 0;
    float4 v[RMS_VEC];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < RMS_VEC; i++) {
        int c = threadIdx.x + i * RMS_THREADS;
        v[i] = c < n4 ? ((const float4*)xr)[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    }
    for (int c = threadIdx.x + RMS_VEC * RMS_THREADS; c < n4; c += RMS_THREADS) {
        float4 t = ((const float4*)xr)[c];
        ss += t.x * t.x + t.y * t.y + t.z * t.z + t.w * t.w;
    }
    for (int j = 4 * n4 + threadIdx.x; j < dim; j += RMS_THREADS) ss += xr[j] * xr[j];
    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float p = lane < RMS_THREADS / 32 ? partial[lane] : 0.f;
        p = warp_sum(p);
        if (lane == 0) partial[0] = p;
    }
    __syncthreads();
    float scale = 1.f / sqrtf(partial[0] / (float)dim + eps);
    // Whole warps run every step (quantize_x16_lanes shuffles); `c < n4` says which lanes hold
    // values.
    int n4_warps = (n4 + 31) / 32 * 32;
#pragma unroll
    for (int i = 0; i < RMS_VEC; i++) {
        int c = threadIdx.x + i * RMS_THREADS;
        if (c < n4_warps) rmsnorm_store(v[i], c, n4, r, scale, weight, dtype, orow, xq, xs);
    }
    for (int c = threadIdx.x + RMS_VEC * RMS_THREADS; c < n4_warps; c += RMS_THREADS) {
        float4 t = c < n4 ? ((const float4*)xr)[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        rmsnorm_store(t, c, n4, r, scale, weight, dtype, orow, xq, xs);
    }
    for (int j = 4 * n4 + threadIdx.x; j < dim; j += RMS_THREADS)
        orow[j] = xr[j] * scale * load_elem(weight, dtype, j);
}

// The position a kernel starts at: `*pos_dev` when given (a recorded decode step reads it from
// the step parameters written before each replay), else `pos0`.
__device__ __forceinline__ int start_pos(int pos0, const int* pos_dev) { return pos_dev ? *pos_dev : pos0; }

// HF rotate_half: the pair (i, i + half) of head h, rotated by pos·inv_freq[i].
__device__ __forceinline__ void rotate_pair(float* head, int i, int half, float pos, const float* inv_freq) {
    float angle = pos * inv_freq[i];
    float c = cosf(angle), s = sinf(angle);
    float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * c - x2 * s;
    head[i + half] = x2 * c + x1 * s;
}

// Rows r of x at positions pos0 + r.
extern "C" __global__ void rope(float* x, int rows, int n_heads, int head_dim, int pos0,
                                const float* inv_freq) {
    int half = head_dim / 2;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * n_heads * half) return;
    int i = idx % half;
    int rh = idx / half;  // r * n_heads + h
    rotate_pair(x + (u64)rh * head_dim, i, half, (float)(pos0 + rh / n_heads), inv_freq);
}

// The attention block's position-dependent steps in one launch: q and k rows r roped at
// position p + r (p = start_pos), k and v rows stored in the f16 caches at that position.
// One thread per rotated pair of a q or k head; the k pairs also store v's pair.
extern "C" __global__ void rope_store_kv(float* q, float* k, const float* v, int rows, int n_heads,
                                         int n_kv_heads, int head_dim, int pos0, const int* pos_dev,
                                         const float* inv_freq, u16* k_cache, u16* v_cache) {
    int half = head_dim / 2;
    int heads = n_heads + n_kv_heads;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * heads * half) return;
    int i = idx % half;
    int h = (idx / half) % heads;
    int r = idx / (half * heads);
    int pos = start_pos(pos0, pos_dev) + r;
    if (h < n_heads) {
        rotate_pair(q + ((u64)r * n_heads + h) * head_dim, i, half, (float)pos, inv_freq);
        return;
    }
    int kvh = h - n_heads;
    u64 row = ((u64)r * n_kv_heads + kvh) * head_dim;
    float* kh = k + row;
    rotate_pair(kh, i, half, (float)pos, inv_freq);
    u64 at = ((u64)pos * n_kv_heads + kvh) * head_dim;
    k_cache[at + i] = f2h(kh[i]);
    k_cache[at + i + half] = f2h(kh[i + half]);
    v_cache[at + i] = f2h(v[row + i]);
    v_cache[at + i + half] = f2h(v[row + i + half]);
}

extern "C" __global__ void copy_f32(const float* src, float* dst, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// Into the f16 KV cache.
extern "C" __global__ void copy_f32_to_f16(const float* src, u16* dst, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = f2h(src[i]);
}

extern "C" __global__ void copy_f32_to_bf16(const float* src, u16* dst, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        // Round to nearest even (inputs are finite activations).
        u32 b = __float_as_uint(src[i]);
        dst[i] = (u16)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
    }
}

extern "C" __global__ void copy_f16_to_f32(const u16* src, float* dst, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = h2f(src[i]);
}

// gate = silu(gate) · up over n values, four per thread when n is a multiple of 4 (grid over
// n / 4 threads, else n); with `xq` (n a multiple of 32) also written for the quantized matmul
// that reads it next.
extern "C" __global__ void swiglu(float* gate, const float* up, u64 n, short* xq, float4* xs) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (n % 4 != 0) {
        if (i < n) {
            float g = gate[i];
            gate[i] = g / (1.f + expf(-g)) * up[i];
        }
        return;
    }
    bool live = i < n / 4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (live) {
        float4 g = ((const float4*)gate)[i], u = ((const float4*)up)[i];
        o = make_float4(g.x / (1.f + expf(-g.x)) * u.x, g.y / (1.f + expf(-g.y)) * u.y,
                        g.z / (1.f + expf(-g.z)) * u.z, g.w / (1.f + expf(-g.w)) * u.w);
        ((float4*)gate)[i] = o;
    }
    if (xq) quantize_x16_lanes(o, live, i / 8, xq, xs);
}

extern "C" __global__ void add(float* x, const float* y, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// Causal GQA attention over the f16 KV cache, one block per (query row, head), processed in
// tiles of ATT_TILE positions with an online softmax so any context length fits in shared
// memory. Each warp scores whole positions (lanes over head_dim, coalesced); then thread d
// accumulates output dimension d over the tile (prefill: thousands of blocks keep the GPU
// busy). head_dim <= 256 and blockDim.x == 256.
#define ATT_TILE 1024
// Dims of the output a lane of `attention_decode` accumulates: head_dim <= 8 · 32.
// (Positions per chunk of `attention_decode`: ATT_SPLIT in cuda/mod.rs.)
#define ATT_DPL 8
// Scaled scores of one query head (`qs`, in shared memory) against positions t0..t0+n of the
// f16 K cache into p[]: each warp scores whole positions (lanes over head_dim, coalesced).
// Returns their maximum (NEG_INF when n is 0). Every thread of the block calls it.
__device__ __forceinline__ float attention_scores(const float* qs, const u16* k_cache, int t0, int n,
                                                  int kv_width, int kvh, int head_dim, float scale,
                                                  float* p, float* red) {
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;
    for (int t = warp; t < n; t += n_warps) {
        const u16* kt = k_cache + (u64)(t0 + t) * kv_width + kvh * head_dim;
        float s = 0.f;
        for (int d = lane; d < head_dim; d += 32) s += qs[d] * h2f(kt[d]);
        s = warp_sum(s);
        if (lane == 0) p[t] = s * scale;
    }
    __syncthreads();
    float m = NEG_INF;
    for (int t = tid; t < n; t += blockDim.x) m = fmaxf(m, p[t]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = NEG_INF;
    for (int w = 0; w < n_warps; w++) m = fmaxf(m, red[w]);
    __syncthreads();  // everyone has read red[] before it is reused
    return m;
}

// p[t] = e^(p[t] − ref) for t < n; returns their sum. Every thread of the block calls it.
__device__ __forceinline__ float attention_exp_sum(float* p, int n, float ref, float* red) {
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;
    float sum = 0.f;
    for (int t = tid; t < n; t += blockDim.x) {
        float e = expf(p[t] - ref);
        p[t] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < n_warps; w++) sum += red[w];
    return sum;
}

extern "C" __global__ void attention(const float* q, const u16* k_cache, const u16* v_cache,
                                     int pos0, int n_heads, int n_kv_heads, int head_dim,
                                     float scale, float* out) {
    __shared__ float qs[256];
    __shared__ float p[ATT_TILE];
    __shared__ float red[32];
    int h = blockIdx.x % n_heads;
    int r = blockIdx.x / n_heads;
    int kvh = h / (n_heads / n_kv_heads);
    int kv_width = n_kv_heads * head_dim;
    int len = pos0 + r + 1;
    int tid = threadIdx.x;
    const float* qh = q + ((u64)r * n_heads + h) * head_dim;
    for (int d = tid; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    __syncthreads();

    float running_max = NEG_INF, running_sum = 0.f, acc = 0.f;
    for (int t0 = 0; t0 < len; t0 += ATT_TILE) {
        int n = min(ATT_TILE, len - t0);
        float m = attention_scores(qs, k_cache, t0, n, kv_width, kvh, head_dim, scale, p, red);
        float new_max = fmaxf(running_max, m);
        float tile_sum = attention_exp_sum(p, n, new_max, red);
        float rescale = expf(running_max - new_max);  // 0 on the first tile
        running_sum = running_sum * rescale + tile_sum;
        running_max = new_max;
        if (tid < head_dim) {
            float a = acc * rescale;
            const u16* vt = v_cache + (u64)t0 * kv_width + kvh * head_dim + tid;
#pragma unroll 8
            for (int t = 0; t < n; t++) a += p[t] * h2f(vt[(u64)t * kv_width]);
            acc = a;
        }
        __syncthreads();  // p[] and red[] are rewritten by the next tile
    }
    if (tid < head_dim) out[((u64)r * n_heads + h) * head_dim + tid] = acc / running_sum;
}

// Decoding (one query row): only n_heads blocks would run, so the positions are split into
// chunks of `split_len` (flash-decoding): block (h, s) scores chunk s of head h, keeps each
// warp's share of the probability-weighted V rows in registers, and writes the chunk's max,
// sum of exponentials and unnormalised output to `part` [n_heads, n_splits, 2 + head_dim];
// `attention_combine` merges the chunks. split_len <= ATT_TILE. A recorded decode step is
// launched with the chunks of the whole cache and reads the position from `pos_dev`: the
// chunks past it write an empty result (max -inf), which the merge skips.
extern "C" __global__ void attention_decode(const float* q, const u16* k_cache, const u16* v_cache,
                                            int pos0, const int* pos_dev, int n_heads, int n_kv_heads,
                                            int head_dim, float scale, int split_len, float* part) {
    __shared__ float qs[256];
    __shared__ float p[ATT_TILE];
    __shared__ float red[32];
    __shared__ float partial[8][256];
    int h = blockIdx.x, split = blockIdx.y, n_splits = gridDim.y;
    int kvh = h / (n_heads / n_kv_heads);
    int kv_width = n_kv_heads * head_dim;
    int len = start_pos(pos0, pos_dev) + 1;
    int t0 = split * split_len;
    int n = max(0, min(split_len, len - t0));
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;
    float* dst = part + ((u64)h * n_splits + split) * (2 + head_dim);
    for (int d = tid; d < head_dim; d += blockDim.x) qs[d] = q[(u64)h * head_dim + d];
    __syncthreads();
    float m = attention_scores(qs, k_cache, t0, n, kv_width, kvh, head_dim, scale, p, red);
    float sum = attention_exp_sum(p, n, m, red);
    float acc[ATT_DPL];
#pragma unroll
    for (int i = 0; i < ATT_DPL; i++) acc[i] = 0.f;
    const u16* vbase = v_cache + (u64)t0 * kv_width + kvh * head_dim;
#pragma unroll 4
    for (int t = warp; t < n; t += n_warps) {
        float pt = p[t];
        const u16* vt = vbase + (u64)t * kv_width;
#pragma unroll
        for (int i = 0; i < ATT_DPL; i++) {
            int d = lane + 32 * i;
            if (d < head_dim) acc[i] += pt * h2f(vt[d]);
        }
    }
#pragma unroll
    for (int i = 0; i < ATT_DPL; i++) {
        int d = lane + 32 * i;
        if (d < head_dim) partial[warp][d] = acc[i];
    }
    __syncthreads();
    if (tid < head_dim) {
        float a = 0.f;
        for (int w = 0; w < n_warps; w++) a += partial[w][tid];
        dst[2 + tid] = a;
    }
    if (tid == 0) {
        dst[0] = m;  // -inf for an empty chunk
        dst[1] = sum;
    }
}

// out[h, :] = Σ_s e^(m_s − M) acc_s / Σ_s e^(m_s − M) l_s over the chunks of `attention_decode`.
extern "C" __global__ void attention_combine(const float* part, int n_splits, int head_dim,
                                             float* out) {
    int h = blockIdx.x, tid = threadIdx.x;
    const float* base = part + (u64)h * n_splits * (2 + head_dim);
    float mx = NEG_INF;
    for (int s = 0; s < n_splits; s++) mx = fmaxf(mx, base[(u64)s * (2 + head_dim)]);
    float denom = 0.f, num = 0.f;
    for (int s = 0; s < n_splits; s++) {
        const float* c = base + (u64)s * (2 + head_dim);
        if (c[0] == NEG_INF) continue;
        float w = expf(c[0] - mx);
        denom += w * c[1];
        if (tid < head_dim) num += w * c[2 + tid];
    }
    if (tid < head_dim) out[(u64)h * head_dim + tid] = num / denom;
}

// W[m, k] of any dtype as f32 or f16 (`out`, m·k values), each value of `load_elem` rounded
// once: the operand of a cuBLAS GEMM for prefill (bf16 as f32, quantized weights as f16), a
// temporary of one matrix freed after its GEMM. Eight values per thread (grid over n_blocks·4
// threads), so neighbouring threads read neighbouring bytes and write whole 16-byte words.
__device__ __forceinline__ int block_bytes(int dtype) {
    return dtype == 3 ? 34 : dtype == 4 ? 18 : dtype == 5 ? 20 : dtype == 0 ? 128 : 64;
}

// Values 8·i .. 8·i+7 of a weight of a dtype of kquants.cu (codes 6 and up), defined there.
__device__ void kq_values8(const u8* w, int dtype, u64 i, float* v);

// This thread's eight values (8·(i % 4).. of block i / 4, which start at value 8·i), false
// past the end.
__device__ __forceinline__ bool dequant8(const u8* w, int dtype, u64 n_blocks, float* v, u64& at) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_blocks * 4) return false;
    if (dtype >= 6) {
        kq_values8(w, dtype, i, v);
    } else {
        const u8* blk = w + (i / 4) * block_bytes(dtype);
        int p = (int)(i % 4) * 8;
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = load_elem(blk, dtype, p + j);
    }
    at = i * 8;
    return true;
}

extern "C" __global__ void dequant_f32(const u8* w, int dtype, u64 n_blocks, float* out) {
    float v[8];
    u64 at;
    if (!dequant8(w, dtype, n_blocks, v, at)) return;
    float4* o = (float4*)(out + at);
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
}

extern "C" __global__ void dequant_f16(const u8* w, int dtype, u64 n_blocks, u16* out) {
    float v[8];
    u64 at;
    if (!dequant8(w, dtype, n_blocks, v, at)) return;
    u32 h[4];
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = (u32)f2h(v[2 * j]) | ((u32)f2h(v[2 * j + 1]) << 16);
    *(uint4*)(out + at) = make_uint4(h[0], h[1], h[2], h[3]);
}

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

// Must match `MatmulJobs` in cuda/mod.rs.
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
    float* out;   // the job's output
    int m;        // the job's weight rows
    int i0, nw;   // the block's first weight row, and how many it has (<= MM_WROWS)
    int r0, nr;   // its first input row, and how many (<= NR)
};

// This block's tile; false when it has no weight rows (then the whole block returns, so no
// barrier is skipped by part of it).
template <int NR>
__device__ __forceinline__ bool matmul_tile(const MatmulJobs& jobs, int rows, MatmulTile& t) {
    t.i0 = matmul_job(jobs, t.w, t.out, t.m);
    if (t.i0 >= t.m) return false;
    t.nw = min(MM_WROWS, t.m - t.i0);
    t.r0 = blockIdx.y * NR;
    t.nr = min(NR, rows - t.r0);
    return true;
}

// Warp sums, then the warps' partials in warp order, written (or added) to the outputs.
template <int NR>
__device__ __forceinline__ void matmul_store(float (&acc)[NR][MM_WROWS], const MatmulTile& t, int accumulate) {
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
template <int DTYPE, int NR>
__device__ void matmul_impl(const float* x, int rows, int k, const MatmulJobs& jobs) {
    MatmulTile t;
    if (!matmul_tile<NR>(jobs, rows, t)) return;
    const int nw = t.nw, nr = t.nr, r0 = t.r0;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float acc[NR][MM_WROWS] = {};
    const int step = MM_WARPS * 32;
    if constexpr (DTYPE == 1 || DTYPE == 2) {
        // 16-byte loads: 8 halves per lane per row and step.
        u64 row_bytes = (u64)k * 2;
        const u8* w0 = t.w + (u64)t.i0 * row_bytes;
        int k8 = (k % 8 == 0 && ((u64)w0 & 15) == 0) ? k / 8 : 0;
#pragma unroll 2
        for (int c8 = warp * 32 + lane; c8 < k8; c8 += step) {
            uint4 raw[MM_WROWS];
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++)
                raw[j] = j < nw ? ((const uint4*)(w0 + j * row_bytes))[c8] : make_uint4(0, 0, 0, 0);
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
                if (j >= nw) continue;
                float wv = half_bits(((const u16*)(w0 + j * row_bytes))[c], DTYPE);
#pragma unroll
                for (int r = 0; r < NR; r++)
                    if (r < nr) acc[r][j] = fmaf(wv, x[(u64)(r0 + r) * k + c], acc[r][j]);
            }
        }
    } else {
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
    matmul_store<NR>(acc, t, jobs.accumulate);
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

// q8_0, q4_0 and q4_1 weights read as stored (no dequantized copy), with the activations of
// `quantize_x16_lanes` (`xq`: 32 16-bit integers per block, `xs`: one float4 per block).
template <int DTYPE, int NR>
__device__ void matmul_q_impl(const short* xq, const float4* xs, int rows, int k, const MatmulJobs& jobs) {
    MatmulTile t;
    if (!matmul_tile<NR>(jobs, rows, t)) return;
    const int nw = t.nw, nr = t.nr, r0 = t.r0;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float acc[NR][MM_WROWS] = {};
    int n_blocks = k / 32;
    u64 row_bytes = (u64)n_blocks * qblock_bytes<DTYPE>();
    const u8* w0 = t.w + (u64)t.i0 * row_bytes;
    // Each lane reads its own block straight (staging a warp's blocks through shared memory
    // with coalesced 16-byte loads measured slower on the H200).
    for (int b = warp * 32 + lane; b < n_blocks; b += MM_WARPS * 32) {
        QBlock<DTYPE> q[MM_WROWS];
#pragma unroll
        for (int j = 0; j < MM_WROWS; j++)
            load_qblock<DTYPE>(w0 + (j < nw ? j : 0) * row_bytes + (u64)b * qblock_bytes<DTYPE>(), q[j]);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r >= nr) continue;
            int xw[16];
            float4 s = x16_block(xq, xs, (u64)(r0 + r) * n_blocks + b, xw);
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) acc[r][j] = qblock_acc(q[j], qblock_idot(q[j], xw), s, acc[r][j]);
        }
    }
    matmul_store<NR>(acc, t, jobs.accumulate);
}

// One kernel per weight dtype and row count per block: `_r1` for one input row (decoding one
// sequence), `_r8` for MM_ROWS.
#define MATMUL_KERNELS(NAME, DTYPE)                                                                   \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r1(const float* x, int rows, int k, MatmulJobs jobs) { matmul_impl<DTYPE, 1>(x, rows, k, jobs); } \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r8(const float* x, int rows, int k, MatmulJobs jobs) { matmul_impl<DTYPE, MM_ROWS>(x, rows, k, jobs); }
#define MATMUL_Q_KERNELS(NAME, DTYPE)                                                                 \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r1(const short* xq, const float4* xs, int rows, int k, MatmulJobs jobs) {             \
        matmul_q_impl<DTYPE, 1>(xq, xs, rows, k, jobs);                                              \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                      \
        NAME##_r8(const short* xq, const float4* xs, int rows, int k, MatmulJobs jobs) {             \
        matmul_q_impl<DTYPE, MM_ROWS>(xq, xs, rows, k, jobs);                                        \
    }
MATMUL_KERNELS(matmul_f32, 0)
MATMUL_KERNELS(matmul_f16, 1)
MATMUL_KERNELS(matmul_bf16, 2)
MATMUL_Q_KERNELS(matmul_q8_0, 3)
MATMUL_Q_KERNELS(matmul_q4_0, 4)
MATMUL_Q_KERNELS(matmul_q4_1, 5)
