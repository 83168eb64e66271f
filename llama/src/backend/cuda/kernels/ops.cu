// Kernels of llama's CUDA backend. Compiled at run time by NVRTC (no system headers: only
// built-in types), so halves are converted with PTX `cvt` and bf16 by shifting bits.
//
// Weight dtype codes (must match `DTYPE_*` in cuda/mod.rs):
//   0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0, 5 q4_1.
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

// One block (256 threads) per row; f32 sum of squares as the CPU backend.
extern "C" __global__ void rmsnorm(const float* x, const u8* weight, int dtype, int dim, float eps,
                                   float* out) {
    __shared__ float partial[32];
    int r = blockIdx.x;
    const float* xr = x + (u64)r * dim;
    float ss = 0.f;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) ss += xr[j] * xr[j];
    ss = warp_sum(ss);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float v = lane < (int)(blockDim.x / 32) ? partial[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    float scale = 1.f / sqrtf(partial[0] / (float)dim + eps);
    for (int j = threadIdx.x; j < dim; j += blockDim.x)
        out[(u64)r * dim + j] = xr[j] * scale * load_elem(weight, dtype, j);
}

// HF rotate_half: pair (i, i + half) of each head rotated by (pos0 + r)·inv_freq[i].
extern "C" __global__ void rope(float* x, int rows, int n_heads, int head_dim, int pos0,
                                const float* inv_freq) {
    int half = head_dim / 2;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    int total = rows * n_heads * half;
    if (idx >= total) return;
    int i = idx % half;
    int rh = idx / half;  // r * n_heads + h
    int r = rh / n_heads;
    float angle = (float)(pos0 + r) * inv_freq[i];
    float c = cosf(angle), s = sinf(angle);
    float* head = x + (u64)rh * head_dim;
    float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * c - x2 * s;
    head[i + half] = x2 * c + x1 * s;
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

extern "C" __global__ void copy_f16_to_f32(const u16* src, float* dst, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = h2f(src[i]);
}

extern "C" __global__ void swiglu(float* gate, const float* up, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        gate[i] = g / (1.f + expf(-g)) * up[i];
    }
}

extern "C" __global__ void add(float* x, const float* y, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// Causal GQA attention over the f16 KV cache, one block per (query row, head), processed in
// tiles of ATT_TILE positions with an online softmax so any context length fits in shared
// memory. Each warp scores whole positions (lanes over head_dim, coalesced); then thread d
// accumulates output dimension d. head_dim <= 256 and blockDim.x == 256.
#define ATT_TILE 1024
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
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;
    const float* qh = q + ((u64)r * n_heads + h) * head_dim;
    for (int d = tid; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    __syncthreads();

    float running_max = NEG_INF, running_sum = 0.f, acc = 0.f;
    for (int t0 = 0; t0 < len; t0 += ATT_TILE) {
        int n = min(ATT_TILE, len - t0);
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
        float new_max = fmaxf(running_max, m);
        __syncthreads();  // everyone has read red[] before it is reused
        float tile_sum = 0.f;
        for (int t = tid; t < n; t += blockDim.x) {
            float e = expf(p[t] - new_max);
            p[t] = e;
            tile_sum += e;
        }
        tile_sum = warp_sum(tile_sum);
        if (lane == 0) red[warp] = tile_sum;
        __syncthreads();
        tile_sum = 0.f;
        for (int w = 0; w < n_warps; w++) tile_sum += red[w];
        float rescale = expf(running_max - new_max);  // 0 on the first tile
        running_sum = running_sum * rescale + tile_sum;
        running_max = new_max;
        if (tid < head_dim) {
            float a = acc * rescale;
            const u16* vt = v_cache + (u64)t0 * kv_width + kvh * head_dim + tid;
            for (int t = 0; t < n; t++) a += p[t] * h2f(vt[(u64)t * kv_width]);
            acc = a;
        }
        __syncthreads();  // p[] and red[] are rewritten by the next tile
    }
    if (tid < head_dim) out[((u64)r * n_heads + h) * head_dim + tid] = acc / running_sum;
}

// out[r, i] = Σ_c x[r, c] · w[i, c]. A warp per weight row i and up to MM_ROWS input rows, so
// the weight row is read once per MM_ROWS positions; f32 accumulation; quantized blocks are
// decoded in registers (no dequantized copy of the weights). Block = 8 warps = 8 weight rows;
// grid = (ceil(m / 8), ceil(rows / MM_ROWS)).
#define MM_ROWS 8

template <int DTYPE>
__device__ __forceinline__ void block_dot(const u8* wrow, int b, const float* xr, float* acc_out) {
    // Dot product of quantized block b of `wrow` with x[b*32 .. b*32+32].
    const float* xb = xr + b * 32;
    if (DTYPE == 3) {
        const u8* blk = wrow + (u64)b * 34;
        float d = h2f(load_u16(blk));
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 32; j++) s += (float)(signed char)blk[2 + j] * xb[j];
        *acc_out += d * s;
    } else if (DTYPE == 4) {
        const u8* blk = wrow + (u64)b * 18;
        float d = h2f(load_u16(blk));
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            int q = blk[2 + j];
            s += (float)((q & 0xF) - 8) * xb[j] + (float)((q >> 4) - 8) * xb[j + 16];
        }
        *acc_out += d * s;
    } else {
        const u8* blk = wrow + (u64)b * 20;
        float d = h2f(load_u16(blk)), mn = h2f(load_u16(blk + 2));
        float s = 0.f, sx = 0.f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            int q = blk[4 + j];
            s += (float)(q & 0xF) * xb[j] + (float)(q >> 4) * xb[j + 16];
            sx += xb[j] + xb[j + 16];
        }
        *acc_out += d * s + mn * sx;
    }
}

template <int DTYPE>
__device__ void matmul_impl(const float* x, int rows, const u8* w, int m, int k, float* out) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int i = blockIdx.x * (blockDim.x / 32) + warp;
    if (i >= m) return;
    int r0 = blockIdx.y * MM_ROWS;
    int nr = min(MM_ROWS, rows - r0);
    float acc[MM_ROWS];
#pragma unroll
    for (int r = 0; r < MM_ROWS; r++) acc[r] = 0.f;
    if (DTYPE <= 2) {
        u64 row_bytes = (u64)k * (DTYPE == 0 ? 4 : 2);
        const u8* wrow = w + (u64)i * row_bytes;
        for (int c = lane; c < k; c += 32) {
            float wv = DTYPE == 0 ? ((const float*)wrow)[c]
                     : DTYPE == 1 ? h2f(((const u16*)wrow)[c])
                                  : bf2f(((const u16*)wrow)[c]);
#pragma unroll
            for (int r = 0; r < MM_ROWS; r++)
                if (r < nr) acc[r] += wv * x[(u64)(r0 + r) * k + c];
        }
    } else {
        int block_bytes = DTYPE == 3 ? 34 : DTYPE == 4 ? 18 : 20;
        int n_blocks = k / 32;
        const u8* wrow = w + (u64)i * n_blocks * block_bytes;
        for (int b = lane; b < n_blocks; b += 32) {
#pragma unroll
            for (int r = 0; r < MM_ROWS; r++)
                if (r < nr) block_dot<DTYPE>(wrow, b, x + (u64)(r0 + r) * k, &acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < MM_ROWS; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0 && r < nr) out[(u64)(r0 + r) * m + i] = v;
    }
}

extern "C" __global__ void matmul_f32(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<0>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_f16(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<1>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_bf16(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<2>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_q8_0(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<3>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_q4_0(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<4>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_q4_1(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<5>(x, rows, w, m, k, out); }
