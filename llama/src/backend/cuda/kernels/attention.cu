// Causal grouped-query attention over the f16 KV cache.
//
// Every kernel takes the cache's `slots` (position t is in slot t % slots: a sliding-window
// layer's cache is a ring) and the layer's `window` (0: none; else the query at position p sees
// keys p - window + 1 ..= p only).

// The first position the query at `pos` sees.
__device__ __forceinline__ int first_key(int pos, int window) { return window > 0 ? max(0, pos + 1 - window) : 0; }

// The slot of position t0 + t, given s0 = t0 % slots and t < slots: the positions one query
// sees fit the cache (the model sizes rings for it), so a range of them wraps at most once and
// one division per range does.
__device__ __forceinline__ u64 slot_of(int s0, int t, int slots) {
    int s = s0 + t;
    return (u64)(s >= slots ? s - slots : s);
}

// Causal GQA attention over the f16 KV cache, one block per (query row, head), processed in
// tiles of ATT_TILE positions with an online softmax so any context length fits in shared
// memory. Each warp scores whole positions (lanes over head_dim, coalesced); then thread d
// accumulates output dimension d over the tile (prefill: thousands of blocks keep the GPU
// busy). head_dim <= 256 and blockDim.x == 256.
#define ATT_TILE 1024
// Dims of the output a lane of `attention_decode` accumulates: head_dim <= 8 · 32.
// (Positions per chunk of `attention_decode`: ATT_SPLIT in cuda/attention.rs.)
#define ATT_DPL 8
// The largest of p[0..n) (NEG_INF when n is 0), once every thread has written its scores (the
// caller's barrier); `red` holds a float a warp. Every thread of the block calls it and gets it.
__device__ __forceinline__ float attention_block_max(const float* p, int n, float* red) {
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;
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

// Scaled scores of one query head (`qs`, in shared memory) against positions t0..t0+n of the
// f16 K cache of `slots` positions into p[]: each warp scores whole positions (lanes over
// head_dim, coalesced). Returns their maximum (NEG_INF when n is 0). Every thread of the block
// calls it.
__device__ __forceinline__ float attention_scores(const float* qs, const u16* k_cache, int slots, int t0,
                                                  int n, int kv_width, int kvh, int head_dim, float scale,
                                                  float* p, float* red) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    int s0 = t0 % slots;
    for (int t = warp; t < n; t += n_warps) {
        const u16* kt = k_cache + slot_of(s0, t, slots) * kv_width + kvh * head_dim;
        float s = 0.f;
        for (int d = lane; d < head_dim; d += 32) s += qs[d] * h2f(kt[d]);
        s = warp_sum(s);
        if (lane == 0) p[t] = s * scale;
    }
    __syncthreads();
    return attention_block_max(p, n, red);
}

// `attention_scores` for a decode chunk, a pair of threads a position: each thread loads its half
// of the key row in 16-byte loads, all of them issued at once, and the pair adds its two sums.
// The warp-per-position loop above waited one memory round trip and a five-step shuffle per
// position (~16 positions a warp in sequence for a chunk of 128): most of a one-row decode
// attention's ~11 µs on the H200 (ncu, SmolLM2's shape). Needs head_dim a multiple of 16 (at most
// 256) and kv_width of 8, so that each half-row starts on 16 bytes (the caches are allocated
// aligned); else the loop above. `qs` 16-byte aligned. Every thread of the block calls it.
__device__ __forceinline__ float attention_scores_by_key(const float* qs, const u16* k_cache, int slots, int t0,
                                                         int n, int kv_width, int kvh, int head_dim, float scale,
                                                         float* p, float* red) {
    if (head_dim % 16 != 0 || head_dim > 256 || kv_width % 8 != 0)
        return attention_scores(qs, k_cache, slots, t0, n, kv_width, kvh, head_dim, scale, p, red);
    int tid = threadIdx.x;
    const int per = head_dim / 2, vecs = per / 8, half = tid & 1;
    const float4* q4 = (const float4*)(qs + half * per);
    int s0 = t0 % slots;
    // The bound is the same for the whole block, so every lane reaches the shuffle.
    for (int base = 0; base < n; base += blockDim.x / 2) {
        int t = base + tid / 2;
        float s = 0.f;
        if (t < n) {
            const uint4* kt = (const uint4*)(k_cache + slot_of(s0, t, slots) * kv_width + kvh * head_dim + half * per);
            uint4 raw[16];
#pragma unroll
            for (int i = 0; i < 16; i++)
                if (i < vecs) raw[i] = kt[i];
#pragma unroll
            for (int i = 0; i < 16; i++) {
                if (i >= vecs) break;
                float4 qa = q4[2 * i], qb = q4[2 * i + 1];
                u32 w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
                s = fmaf(qa.x, h2f((u16)w[0]), s);
                s = fmaf(qa.y, h2f((u16)(w[0] >> 16)), s);
                s = fmaf(qa.z, h2f((u16)w[1]), s);
                s = fmaf(qa.w, h2f((u16)(w[1] >> 16)), s);
                s = fmaf(qb.x, h2f((u16)w[2]), s);
                s = fmaf(qb.y, h2f((u16)(w[2] >> 16)), s);
                s = fmaf(qb.z, h2f((u16)w[3]), s);
                s = fmaf(qb.w, h2f((u16)(w[3] >> 16)), s);
            }
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        if (t < n && half == 0) p[t] = s * scale;
    }
    __syncthreads();
    return attention_block_max(p, n, red);
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
                                     float scale, int slots, int window, float* out) {
    pdl_begin();
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
    for (int t0 = first_key(len - 1, window); t0 < len; t0 += ATT_TILE) {
        int n = min(ATT_TILE, len - t0);
        float m = attention_scores(qs, k_cache, slots, t0, n, kv_width, kvh, head_dim, scale, p, red);
        float new_max = fmaxf(running_max, m);
        float tile_sum = attention_exp_sum(p, n, new_max, red);
        float rescale = expf(running_max - new_max);  // 0 on the first tile
        running_sum = running_sum * rescale + tile_sum;
        running_max = new_max;
        if (tid < head_dim) {
            float a = acc * rescale;
            const u16* vt = v_cache + kvh * head_dim + tid;
            int s0 = t0 % slots;
#pragma unroll 8
            for (int t = 0; t < n; t++) a += p[t] * h2f(vt[slot_of(s0, t, slots) * kv_width]);
            acc = a;
        }
        __syncthreads();  // p[] and red[] are rewritten by the next tile
    }
    if (tid < head_dim) out[((u64)r * n_heads + h) * head_dim + tid] = acc / running_sum;
}

// The probability-weighted V rows of a decode chunk (positions 0 .. n of p[], the cache from
// slot s0 on), each lane accumulating K = head_dim / 32 consecutive dims: warp w takes positions
// w, w + n_warps, ... in that order (each dim sums the same products in the same order as the
// 2-byte loop of attention_decode_chunk), loading the rows of G of them before any arithmetic.
// With the row width a template parameter the loop has no branches, so all G loads are in flight
// at once: a loop that chose the load width inside its body waited about one memory round trip
// per position, ~70 ns a position and layer on the H200 (a 7B decode step grew by 2.3 µs a
// position of context).
template <int K>
__device__ __forceinline__ void attention_v_rows(const float* p, int n, const u16* vbase, int s0, int slots,
                                                 int kv_width, float (&acc)[ATT_DPL]) {
    constexpr int G = K == 8 ? 8 : 16;  // positions a warp loads at once (32 registers at most)
    constexpr int W = K / 2;             // 32-bit words a row a lane
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    for (int base = warp; base < n; base += n_warps * G) {
        u32 w[G][W];
#pragma unroll
        for (int g = 0; g < G; g++) {
            int t = base + g * n_warps;
            if (t >= n) continue;
            const u16* vt = vbase + slot_of(s0, t, slots) * kv_width + lane * K;
            if constexpr (K == 2) {
                w[g][0] = *(const u32*)vt;
            } else if constexpr (K == 4) {
                uint2 r = *(const uint2*)vt;
                w[g][0] = r.x;
                w[g][1] = r.y;
            } else {
                uint4 r = *(const uint4*)vt;
                w[g][0] = r.x;
                w[g][1] = r.y;
                w[g][2] = r.z;
                w[g][3] = r.w;
            }
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            int t = base + g * n_warps;
            if (t >= n) continue;
            float pt = p[t];
#pragma unroll
            for (int i = 0; i < K; i++) acc[i] += pt * h2f((u16)(w[g][i / 2] >> (16 * (i % 2))));
        }
    }
}

// Decoding (one query row): only n_heads blocks would run, so the positions are split into
// chunks of `split_len` (flash-decoding): block (h, s) scores chunk s of head h, keeps each
// warp's share of the probability-weighted V rows in registers, and writes the chunk's max,
// sum of exponentials and unnormalised output to `part` [n_heads, n_splits, 2 + head_dim];
// `attention_combine` merges the chunks. The chunks cover the positions the query sees, from
// `first_key` on. split_len <= ATT_TILE. A recorded decode step is launched with the chunks of
// the whole cache and reads the position from `pos_dev`: the chunks past it write an empty
// result (max -inf), which the merge skips.
//
// One chunk: positions t0 .. t0+n of KV head kvh (in the cache of `slots` positions) against
// the query head `qh`, into `dst` (max, sum, head_dim unnormalised outputs). Every thread of
// the block calls it.
__device__ __forceinline__ void attention_decode_chunk(const float* qh, const u16* k_cache, const u16* v_cache,
                                                       int slots, int t0, int n, int kv_width, int kvh,
                                                       int head_dim, float scale, float* dst) {
    __shared__ float4 qs4[64];  // the query head, 16-byte aligned for attention_scores_by_key
    __shared__ float p[ATT_TILE];
    __shared__ float red[32];
    __shared__ float partial[8][256];
    float* qs = (float*)qs4;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;
    for (int d = tid; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    __syncthreads();
    float m = attention_scores_by_key(qs, k_cache, slots, t0, n, kv_width, kvh, head_dim, scale, p, red);
    float sum = attention_exp_sum(p, n, m, red);
    float acc[ATT_DPL];
#pragma unroll
    for (int i = 0; i < ATT_DPL; i++) acc[i] = 0.f;
    const u16* vbase = v_cache + kvh * head_dim;
    int s0 = t0 % slots;
    if ((head_dim == 64 || head_dim == 128 || head_dim == 256) && kv_width % 8 == 0) {
        // Each lane takes head_dim / 32 consecutive dims in one 4-, 8- or 16-byte load (each
        // aligned to its width: kv_width is a multiple of 8 and the caches are aligned).
        if (head_dim == 64)
            attention_v_rows<2>(p, n, vbase, s0, slots, kv_width, acc);
        else if (head_dim == 128)
            attention_v_rows<4>(p, n, vbase, s0, slots, kv_width, acc);
        else
            attention_v_rows<8>(p, n, vbase, s0, slots, kv_width, acc);
        const int k = head_dim / 32;
#pragma unroll
        for (int i = 0; i < ATT_DPL; i++) {
            if (i >= k) break;
            partial[warp][lane * k + i] = acc[i];
        }
    } else {
#pragma unroll 4
        for (int t = warp; t < n; t += n_warps) {
            float pt = p[t];
            const u16* vt = vbase + slot_of(s0, t, slots) * kv_width;
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

// One query row's attention, chunk `split` of head h, into `part` [n_heads, n_splits, 2 +
// head_dim]; the last chunk of head h to finish (a ticket per head in `tickets`, which it sets
// back to 0 for the next launch or graph replay) merges the head's chunks into `out` (what a
// launch of `attention_combine` used to do: one launch fewer per layer and token) and, when `xq`
// is given (head_dim a multiple of 32), writes the head's values in the 16-bit form of
// `quantize_x16_lanes` for the output projection that reads them next (one `quantize_x16`
// launch fewer).
extern "C" __global__ void attention_decode(const float* q, const u16* k_cache, const u16* v_cache,
                                            int pos0, const int* pos_dev, int n_heads, int n_kv_heads,
                                            int head_dim, float scale, int slots, int window, int split_len,
                                            float* part, float* out, int* tickets, short* xq, float4* xs) {
    pdl_begin();
    int h = blockIdx.x, split = blockIdx.y, n_splits = gridDim.y;
    int kvh = h / (n_heads / n_kv_heads);
    int len = start_pos(pos0, pos_dev) + 1;
    int t0 = first_key(len - 1, window) + split * split_len;
    int n = max(0, min(split_len, len - t0));
    float* dst = part + ((u64)h * n_splits + split) * (2 + head_dim);
    attention_decode_chunk(q + (u64)h * head_dim, k_cache, v_cache, slots, t0, n, n_kv_heads * head_dim, kvh,
                           head_dim, scale, dst);
    __shared__ int merge;
    __shared__ float merged[256];  // ROW_THREADS (attention.rs) threads, head_dim <= 256
    // This block's partial is visible device-wide before its ticket is.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int done = atomicAdd(tickets + h, 1);
        merge = done == n_splits - 1;
        if (merge) tickets[h] = 0;
    }
    __syncthreads();
    if (!merge) return;  // the whole block
    __threadfence();
    const float* base = part + (u64)h * n_splits * (2 + head_dim);
    int tid = threadIdx.x;
    float mx = NEG_INF;
    // L2 loads (`__ldcg`): the other chunks were written by other blocks during this launch.
    for (int s = 0; s < n_splits; s++) mx = fmaxf(mx, __ldcg(base + (u64)s * (2 + head_dim)));
    float denom = 0.f, num = 0.f;
    for (int s = 0; s < n_splits; s++) {
        const float* c = base + (u64)s * (2 + head_dim);
        float m = __ldcg(c);
        if (m == NEG_INF) continue;
        float w = expf(m - mx);
        denom += w * __ldcg(c + 1);
        if (tid < head_dim) num += w * __ldcg(c + 2 + tid);
    }
    float o = tid < head_dim ? num / denom : 0.f;
    if (tid < head_dim) out[(u64)h * head_dim + tid] = o;
    if (!xq) return;
    merged[tid] = o;
    __syncthreads();
    // Whole warps call quantize_x16_lanes (it shuffles); lane c holds values 4c..4c+3 of the head.
    int c = tid, n4 = head_dim / 4;
    if (c < (n4 + 31) / 32 * 32) {
        bool live = c < n4;
        float4 v = live ? make_float4(merged[4 * c], merged[4 * c + 1], merged[4 * c + 2], merged[4 * c + 3])
                        : make_float4(0.f, 0.f, 0.f, 0.f);
        quantize_x16_lanes(v, live, ((u64)h * head_dim) / 32 + c / 8, xq, xs);
    }
}

// `attention_decode` for the one-row sequences of `seqs` (grid.z), each against its own caches
// up to its own position: block (h, s, z) is chunk s of head h of sequence z, into `part`
// [n_seqs, n_heads, max_splits, 2 + head_dim]. Chunks past a sequence's position do nothing:
// `attention_combine_seqs` reads only those that exist. No window, and every cache holds all
// the positions of its sequence (slot t for position t): the backend sends a sliding-window
// layer's ring caches to `attention_decode`.
extern "C" __global__ void attention_decode_seqs(const float* q, int n_heads, int n_kv_heads, int head_dim,
                                                 float scale, int split_len, float* part,
                                                 const __grid_constant__ SeqTable seqs) {
    pdl_begin();
    int h = blockIdx.x, split = blockIdx.y, max_splits = gridDim.y, z = blockIdx.z;
    int len = seqs.pos0[z] + 1;
    int t0 = split * split_len;
    if (t0 >= len) return;  // the whole block
    int n = min(split_len, len - t0);
    int kvh = h / (n_heads / n_kv_heads);
    float* dst = part + (((u64)z * n_heads + h) * max_splits + split) * (2 + head_dim);
    const float* qh = q + ((u64)seqs.row0[z] * n_heads + h) * head_dim;
    const int no_ring = 0x7fffffff;  // slot t holds position t
    attention_decode_chunk(qh, seqs.k_cache[z], seqs.v_cache[z], no_ring, t0, n, n_kv_heads * head_dim, kvh,
                           head_dim, scale, dst);
}

// out = Σ_s e^(m_s − M) acc_s / Σ_s e^(m_s − M) l_s over the `n_splits` chunks at `base` (each
// 2 + head_dim values), skipping empty ones.
__device__ __forceinline__ void attention_combine_head(const float* base, int n_splits, int head_dim, float* out) {
    int tid = threadIdx.x;
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
    if (tid < head_dim) out[tid] = num / denom;
}

// The chunks of `attention_decode_seqs` merged, block (h, z) for head h of sequence z: the
// chunks up to its position.
extern "C" __global__ void attention_combine_seqs(const float* part, int max_splits, int n_heads, int head_dim,
                                                  int split_len, float* out, const __grid_constant__ SeqTable seqs) {
    pdl_begin();
    int h = blockIdx.x, z = blockIdx.y;
    int n_splits = (seqs.pos0[z] + split_len) / split_len;
    const float* base = part + ((u64)z * n_heads + h) * max_splits * (2 + head_dim);
    attention_combine_head(base, n_splits, head_dim, out + ((u64)seqs.row0[z] * n_heads + h) * head_dim);
}

// Prompt attention on tensor cores (flash attention): causal GQA of `rows` query rows at
// positions pos0 .. against the f16 caches, for head_dim HD (64 or 128). A block of FA_WARPS
// warps takes FA_ROWS query rows of one head, each warp 16 of them; the positions go by in tiles
// of FA_TILE with an online softmax, so any context fits. Scores S = Q·Kᵀ and outputs O += P·V
// are mma m16n8k16 products with f32 sums; Q and P enter as two f16 parts each (x = hi + lo,
// within 2^-22 of x), so the only roundings beyond the f32 kernel's are those of the f16 caches
// themselves, which both share. Q (both parts) is staged once in shared memory and each warp
// keeps its A fragments of every k-step in registers (they never change); the Q staging area
// then holds each K tile (16-byte loads, coalesced), and each V tile is transposed (so that a B
// fragment is one 32-bit load). A grid of these blocks has few warps per multiprocessor (512
// rows of 32 heads: 1024 warps for 132 SMs), so the inner loops must not wait on global loads:
// reading K fragments straight from the cache made a 7B layer's 512-row attention take
// ~320 µs under ncu. A query row's result does not depend on which other rows share its launch:
// the position tiles start at 0 for every block.
// grid = (ceil(rows / FA_ROWS), n_heads), FA_WARPS·32 threads.
#define FA_WARPS 4
#define FA_ROWS (16 * FA_WARPS)
#define FA_TILE 32

template <int HD>
__device__ void attention_flash_impl(const float* q, const u16* k_cache, const u16* v_cache, int rows, int pos0,
                                     int n_heads, int n_kv_heads, float scale, float* out) {
    constexpr int QS = HD + 8;         // row stride of the staged Q parts (no bank conflicts)
    constexpr int VS = FA_TILE + 8;    // row stride of the transposed V tile
    constexpr int DT = HD / 8;         // output tiles of 8 dims
    __shared__ u16 qs[2][FA_ROWS][QS];
    __shared__ u16 vt[HD][VS];
    const int h = blockIdx.y, r0 = blockIdx.x * FA_ROWS;
    const int kvh = h / (n_heads / n_kv_heads), kv_width = n_kv_heads * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int last_row = min(r0 + FA_ROWS, rows) - 1;
    const int len = pos0 + last_row + 1;  // positions any row of the block sees

    // Q rows r0 .. (clamped to the last row) as f16 hi and lo parts.
    for (int e = threadIdx.x; e < FA_ROWS * HD; e += blockDim.x) {
        int rr = e / HD, d = e % HD;
        float x = q[((u64)min(r0 + rr, rows - 1) * n_heads + h) * HD + d];
        u16 hi = f2h(x);
        qs[0][rr][d] = hi;
        qs[1][rr][d] = f2h(x - h2f(hi));
    }

    const int qrow = warp * 16 + g;  // this lane's rows in the block: qrow and qrow + 8
    const int qpos[2] = {pos0 + min(r0 + qrow, rows - 1), pos0 + min(r0 + qrow + 8, rows - 1)};
    float o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const u16* kbase = k_cache + kvh * HD;

    // This warp's A fragments (hi, lo) of Q for every k-step.
    __syncthreads();  // Q is staged
    u32 qa[HD / 16][2][4];
#pragma unroll
    for (int ks = 0; ks < HD / 16; ks++) {
        const int c = ks * 16 + 2 * t;
#pragma unroll
        for (int part = 0; part < 2; part++) {
            qa[ks][part][0] = *(const u32*)&qs[part][qrow][c];
            qa[ks][part][1] = *(const u32*)&qs[part][qrow + 8][c];
            qa[ks][part][2] = *(const u32*)&qs[part][qrow][c + 8];
            qa[ks][part][3] = *(const u32*)&qs[part][qrow + 8][c + 8];
        }
    }
    // The K tile, [FA_TILE][KS] halves, in the Q staging area (the first __syncthreads of the
    // tile loop orders it after every warp's reads of Q).
    constexpr int KS = HD + 8;  // row stride: the 8 rows a fragment load touches hit 32 banks
    static_assert(FA_TILE * KS <= 2 * FA_ROWS * QS, "the K tile fits where Q was staged");
    u16 (*kt)[KS] = reinterpret_cast<u16 (*)[KS]>(&qs[0][0][0]);

    for (int t0 = 0; t0 < len; t0 += FA_TILE) {
        __syncthreads();  // Q's fragments are read; the previous tile's K and V are no longer read
        // The V tile transposed: a thread loads 8 consecutive dims of one position (one 16-byte
        // load: rows of the cache start at multiples of 8 halves of a 256-byte-aligned
        // allocation) and a warp takes one group of 8 dims for the FA_TILE (32) positions, so
        // that its stores to vt[d][0..31] are consecutive halves (no bank conflicts). The
        // scalar version (a thread per half, a warp across dims) cost 8 loads and 4-way bank
        // conflicts for every 8 values.
        for (int e = threadIdx.x; e < FA_TILE * HD / 8; e += blockDim.x) {
            int p = e % FA_TILE, d8 = (e / FA_TILE) * 8;
            int pos = min(t0 + p, len - 1);
            uint4 raw = *(const uint4*)(v_cache + (u64)pos * kv_width + kvh * HD + d8);
            const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                vt[d8 + 2 * j][p] = (u16)(words[j] & 0xFFFFu);
                vt[d8 + 2 * j + 1][p] = (u16)(words[j] >> 16);
            }
        }
        // The K tile as it lies in the cache (positions past the last clamped to it: masked
        // below), 16 bytes per thread, consecutive threads along a row.
        for (int e = threadIdx.x; e < FA_TILE * HD / 8; e += blockDim.x) {
            int p = e / (HD / 8), d8 = (e % (HD / 8)) * 8;
            int pos = min(t0 + p, len - 1);
            *(uint4*)&kt[p][d8] = *(const uint4*)(kbase + (u64)pos * kv_width + d8);
        }
        __syncthreads();

        // S = Q·Kᵀ for this warp's 16 rows and the tile's positions (FA_TILE / 8 n-tiles).
        float s[FA_TILE / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_TILE / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) {
            const int c = ks * 16 + 2 * t;
#pragma unroll
            for (int nt = 0; nt < FA_TILE / 8; nt++) {
                const u16* kr = &kt[nt * 8 + g][0];
                const u32 b[2] = {*(const u32*)(kr + c), *(const u32*)(kr + c + 8)};
                mma_f16(qa[ks][1], b, s[nt]);
                mma_f16(qa[ks][0], b, s[nt]);
            }
        }

        // Online softmax: rows qrow (i = 0) and qrow + 8 (i = 1), columns 2t, 2t+1 of each n-tile;
        // a row's maximum and sum span the four lanes of its group.
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < FA_TILE / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = e / 2, pos = t0 + nt * 8 + 2 * t + (e & 1);
                float v = pos <= qpos[i] ? s[nt][e] * scale : NEG_INF;
                s[nt][e] = v;
                mx[i] = fmaxf(mx[i], v);
            }
        float alpha[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            float m_new = fmaxf(m[i], mx[i]);  // finite: position 0 is in every row's first tile
            alpha[i] = expf(m[i] - m_new);     // 0 on the first tile
            m[i] = m_new;
            l[i] *= alpha[i];
        }
#pragma unroll
        for (int j = 0; j < DT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[j][e] *= alpha[e / 2];
#pragma unroll
        for (int nt = 0; nt < FA_TILE / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = expf(s[nt][e] - m[e / 2]);
                s[nt][e] = p;
                l[e / 2] += p;
            }

        // O += P·V: P (16 rows x FA_TILE positions) from the score fragments, two parts.
#pragma unroll
        for (int ks = 0; ks < FA_TILE / 16; ks++) {
            u32 a[2][4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                // reg r: n-tile 2ks + r / 2, row g (r even) or g+8 (r odd).
                const float* sp = s[2 * ks + r / 2] + 2 * (r % 2);
                u16 h0 = f2h(sp[0]), h1 = f2h(sp[1]);
                a[0][r] = pack_halves(h0, h1);
                a[1][r] = pack_halves(f2h(sp[0] - h2f(h0)), f2h(sp[1] - h2f(h1)));
            }
#pragma unroll
            for (int j = 0; j < DT; j++) {
                const u16* vr = &vt[j * 8 + g][ks * 16 + 2 * t];
                const u32 b[2] = {*(const u32*)vr, *(const u32*)(vr + 8)};
                mma_f16(a[1], b, o[j]);
                mma_f16(a[0], b, o[j]);
            }
        }
    }

    // Each row's sum over the four lanes of its group, then the outputs of the rows that exist.
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = r0 + qrow + 8 * i;
        if (r >= rows) continue;
        float* orow = out + ((u64)r * n_heads + h) * HD;
#pragma unroll
        for (int j = 0; j < DT; j++) {
            orow[j * 8 + 2 * t] = o[j][2 * i] / l[i];
            orow[j * 8 + 2 * t + 1] = o[j][2 * i + 1] / l[i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)
    attention_flash_hd64(const float* q, const u16* k_cache, const u16* v_cache, int rows, int pos0, int n_heads,
                         int n_kv_heads, float scale, float* out) {
    pdl_begin();
    attention_flash_impl<64>(q, k_cache, v_cache, rows, pos0, n_heads, n_kv_heads, scale, out);
}
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)
    attention_flash_hd128(const float* q, const u16* k_cache, const u16* v_cache, int rows, int pos0, int n_heads,
                          int n_kv_heads, float scale, float* out) {
    pdl_begin();
    attention_flash_impl<128>(q, k_cache, v_cache, rows, pos0, n_heads, n_kv_heads, scale, out);
}
