// Causal grouped-query attention over the f16 KV cache.

// Causal GQA attention over the f16 KV cache, one block per (query row, head), processed in
// tiles of ATT_TILE positions with an online softmax so any context length fits in shared
// memory. Each warp scores whole positions (lanes over head_dim, coalesced); then thread d
// accumulates output dimension d over the tile (prefill: thousands of blocks keep the GPU
// busy). head_dim <= 256 and blockDim.x == 256.
#define ATT_TILE 1024
// Dims of the output a lane of `attention_decode` accumulates: head_dim <= 8 · 32.
// (Positions per chunk of `attention_decode`: ATT_SPLIT in cuda/attention.rs.)
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
