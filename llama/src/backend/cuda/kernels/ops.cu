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
// accumulates output dimension d over the tile (prefill: thousands of blocks keep the GPU
// busy). head_dim <= 256 and blockDim.x == 256.
#define ATT_TILE 1024
// Dims of the output a lane of `attention_decode` accumulates: head_dim <= 8 · 32.
// (Positions per chunk of `attention_decode`: ATT_SPLIT in cuda/mod.rs.)
#define ATT_DPL 8
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
// `attention_combine` merges the chunks. split_len <= ATT_TILE.
extern "C" __global__ void attention_decode(const float* q, const u16* k_cache, const u16* v_cache,
                                            int pos0, int n_heads, int n_kv_heads, int head_dim,
                                            float scale, int split_len, float* part) {
    __shared__ float qs[256];
    __shared__ float p[ATT_TILE];
    __shared__ float red[32];
    __shared__ float partial[8][256];
    int h = blockIdx.x, split = blockIdx.y, n_splits = gridDim.y;
    int kvh = h / (n_heads / n_kv_heads);
    int kv_width = n_kv_heads * head_dim;
    int len = pos0 + 1;
    int t0 = split * split_len;
    int n = max(0, min(split_len, len - t0));
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;
    float* dst = part + ((u64)h * n_splits + split) * (2 + head_dim);
    for (int d = tid; d < head_dim; d += blockDim.x) qs[d] = q[(u64)h * head_dim + d];
    __syncthreads();
    for (int t = warp; t < n; t += n_warps) {
        const u16* kt = k_cache + (u64)(t0 + t) * kv_width + kvh * head_dim;
        float sc = 0.f;
        for (int d = lane; d < head_dim; d += 32) sc += qs[d] * h2f(kt[d]);
        sc = warp_sum(sc);
        if (lane == 0) p[t] = sc * scale;
    }
    __syncthreads();
    float m = NEG_INF;
    for (int t = tid; t < n; t += blockDim.x) m = fmaxf(m, p[t]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = NEG_INF;
    for (int w = 0; w < n_warps; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    float sum = 0.f;
    for (int t = tid; t < n; t += blockDim.x) {
        float e = expf(p[t] - m);
        p[t] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < n_warps; w++) sum += red[w];
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

// W[m, k] of any dtype as f16 (`out`, m·k values), one thread per 32 values: the operand of a
// tensor-core GEMM for prefill (bf16 included: its 8-bit mantissa fits f16's 11, so only
// weights below f16's normal range lose bits, and x stays in f16 instead of bf16's 8 bits).
// A temporary of one matrix, freed after its GEMM.
extern "C" __global__ void dequant_f32(const u8* w, int dtype, u64 n_blocks, float* out) {
    u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    int bytes = dtype == 3 ? 34 : dtype == 4 ? 18 : dtype == 5 ? 20 : dtype == 0 ? 128 : 64;
    const u8* blk = w + b * bytes;
    float* o = out + b * 32;
    for (int j = 0; j < 32; j++) o[j] = load_elem(blk, dtype, j);
}

extern "C" __global__ void dequant_f16(const u8* w, int dtype, u64 n_blocks, u16* out) {
    u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    int bytes = dtype == 3 ? 34 : dtype == 4 ? 18 : dtype == 5 ? 20 : dtype == 0 ? 128 : 64;
    const u8* blk = w + b * bytes;
    u16* o = out + b * 32;
    for (int j = 0; j < 32; j++) o[j] = f2h(load_elem(blk, dtype, j));
}

// out[r, i] = Σ_c x[r, c] · w[i, c]. A warp per weight row i and up to MM_ROWS input rows, so
// the weight row is read once per MM_ROWS positions; f32 accumulation; quantized blocks are
// decoded in registers (no dequantized copy of the weights). Block = 8 warps = 8 weight rows;
// grid = (ceil(m / 8), ceil(rows / MM_ROWS)).
#define MM_ROWS 8

// x[0..32] of one block as 8 float4 loads (a block's activations are 128-byte aligned).
__device__ __forceinline__ void load_x32(const float* xb, float* v) {
    const float4* x4 = (const float4*)xb;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float4 t = x4[j];
        v[4 * j] = t.x; v[4 * j + 1] = t.y; v[4 * j + 2] = t.z; v[4 * j + 3] = t.w;
    }
}

// Dot product of quantized block b of `wrow` with the block's activations `xv`. Blocks are read in the
// widest words their alignment allows (tensors start 4096-aligned: q4_1's 20-byte blocks are
// 4-aligned, q8_0's 34 and q4_0's 18 only 2-aligned), never byte by byte.
template <int DTYPE>
__device__ __forceinline__ float block_dot(const u8* wrow, int b, const float* xv) {
    if (DTYPE == 3) {
        const u16* blk = (const u16*)(wrow + (u64)b * 34);
        float d = h2f(blk[0]);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u16 q = blk[1 + j];
            s += (float)(signed char)(q & 0xFF) * xv[2 * j] + (float)(signed char)(q >> 8) * xv[2 * j + 1];
        }
        return d * s;
    } else if (DTYPE == 4) {
        const u16* blk = (const u16*)(wrow + (u64)b * 18);
        float d = h2f(blk[0]);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u16 q = blk[1 + j];
            int q0 = q & 0xFF, q1 = q >> 8;
            s += (float)((q0 & 0xF) - 8) * xv[2 * j] + (float)((q0 >> 4) - 8) * xv[2 * j + 16]
               + (float)((q1 & 0xF) - 8) * xv[2 * j + 1] + (float)((q1 >> 4) - 8) * xv[2 * j + 17];
        }
        return d * s;
    } else {
        const u32* blk = (const u32*)(wrow + (u64)b * 20);
        u32 dm = blk[0];
        float d = h2f((u16)(dm & 0xFFFF)), mn = h2f((u16)(dm >> 16));
        float s = 0.f, sx = 0.f;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            u32 q = blk[1 + w];
#pragma unroll
            for (int t = 0; t < 4; t++) {
                int byte = (q >> (8 * t)) & 0xFF;
                int j = 4 * w + t;
                s += (float)(byte & 0xF) * xv[j] + (float)(byte >> 4) * xv[j + 16];
                sx += xv[j] + xv[j + 16];
            }
        }
        return d * s + mn * sx;
    }
}

__device__ __forceinline__ float half_bits(u32 bits, int dtype) {
    return dtype == 1 ? h2f((u16)bits) : bf2f((u16)bits);
}

// MM_WROWS weight rows per warp: the activations a lane loads are used for all of them, so
// x traffic (L1) per weight byte drops by MM_WROWS — for q4_1 a block's 20 bytes of weights
// need 128 bytes of x. grid = (ceil(m / (warps · MM_WROWS)), ceil(rows / MM_ROWS)).
#define MM_WROWS 4

template <int DTYPE>
__device__ void matmul_impl(const float* x, int rows, const u8* w, int m, int k, float* out) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int i0 = (blockIdx.x * (blockDim.x / 32) + warp) * MM_WROWS;
    if (i0 >= m) return;
    int nw = min(MM_WROWS, m - i0);
    int r0 = blockIdx.y * MM_ROWS;
    int nr = min(MM_ROWS, rows - r0);
    float acc[MM_ROWS][MM_WROWS];
#pragma unroll
    for (int r = 0; r < MM_ROWS; r++)
#pragma unroll
        for (int j = 0; j < MM_WROWS; j++) acc[r][j] = 0.f;
    if (DTYPE == 1 || DTYPE == 2) {
        // 16-byte loads: 8 halves per lane per row and step.
        u64 row_bytes = (u64)k * 2;
        const u8* w0 = w + (u64)i0 * row_bytes;
        int k8 = (k % 8 == 0 && ((u64)w0 & 15) == 0) ? k / 8 : 0;
#pragma unroll 2
        for (int c8 = lane; c8 < k8; c8 += 32) {
            float wv[MM_WROWS][8];
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) {
                uint4 v = j < nw ? ((const uint4*)(w0 + j * row_bytes))[c8] : make_uint4(0, 0, 0, 0);
                u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    wv[j][2 * q] = half_bits(words[q] & 0xFFFF, DTYPE);
                    wv[j][2 * q + 1] = half_bits(words[q] >> 16, DTYPE);
                }
            }
#pragma unroll
            for (int r = 0; r < MM_ROWS; r++) {
                if (r < nr) {
                    const float4* xr = (const float4*)(x + (u64)(r0 + r) * k + (u64)c8 * 8);
                    float4 a = xr[0], b = xr[1];
#pragma unroll
                    for (int j = 0; j < MM_WROWS; j++)
                        acc[r][j] += wv[j][0] * a.x + wv[j][1] * a.y + wv[j][2] * a.z + wv[j][3] * a.w
                                   + wv[j][4] * b.x + wv[j][5] * b.y + wv[j][6] * b.z + wv[j][7] * b.w;
                }
            }
        }
        for (int c = k8 * 8 + lane; c < k; c += 32) {
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) {
                if (j >= nw) continue;
                float wv = half_bits(((const u16*)(w0 + j * row_bytes))[c], DTYPE);
#pragma unroll
                for (int r = 0; r < MM_ROWS; r++)
                    if (r < nr) acc[r][j] += wv * x[(u64)(r0 + r) * k + c];
            }
        }
    } else if (DTYPE == 0) {
        for (int c = lane; c < k; c += 32) {
#pragma unroll
            for (int j = 0; j < MM_WROWS; j++) {
                if (j >= nw) continue;
                float wv = ((const float*)(w + ((u64)(i0 + j) * k) * 4))[c];
#pragma unroll
                for (int r = 0; r < MM_ROWS; r++)
                    if (r < nr) acc[r][j] += wv * x[(u64)(r0 + r) * k + c];
            }
        }
    } else {
        int block_bytes = DTYPE == 3 ? 34 : DTYPE == 4 ? 18 : 20;
        int n_blocks = k / 32;
        u64 row_bytes = (u64)n_blocks * block_bytes;
        const u8* w0 = w + (u64)i0 * row_bytes;
        for (int b = lane; b < n_blocks; b += 32) {
#pragma unroll
            for (int r = 0; r < MM_ROWS; r++) {
                if (r >= nr) continue;
                float xv[32];
                load_x32(x + (u64)(r0 + r) * k + b * 32, xv);
#pragma unroll
                for (int j = 0; j < MM_WROWS; j++)
                    if (j < nw) acc[r][j] += block_dot<DTYPE>(w0 + j * row_bytes, b, xv);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MM_ROWS; r++) {
        if (r >= nr) continue;
#pragma unroll
        for (int j = 0; j < MM_WROWS; j++) {
            float v = warp_sum(acc[r][j]);
            if (lane == 0 && j < nw) out[(u64)(r0 + r) * m + i0 + j] = v;
        }
    }
}

extern "C" __global__ void matmul_f32(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<0>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_f16(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<1>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_bf16(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<2>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_q8_0(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<3>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_q4_0(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<4>(x, rows, w, m, k, out); }
extern "C" __global__ void matmul_q4_1(const float* x, int rows, const u8* w, int m, int k, float* out) { matmul_impl<5>(x, rows, w, m, k, out); }
