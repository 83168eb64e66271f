// Normalisation and rotary embeddings.

// One block of RMS_THREADS per row, f32 sum of squares. Rows whose width is a multiple of 4
// are read as float4 and kept in registers between the two passes (up to RMS_VEC per thread;
// a 4096-wide row is one load per thread): with one row per block (decoding), the latency of
// dependent loads, not bandwidth, is the cost. When `xq` is given (width a multiple of 32) the
// normalized rows are also written for the quantized matmuls that read them next.
#define RMS_THREADS 1024
#define RMS_VEC 4
// Weights 4c..4c+3 of rmsnorm (zeros past the row's n4 float4s).
__device__ __forceinline__ float4 rmsnorm_weight4(const u8* weight, int dtype, int c, int n4) {
    if (c >= n4) return make_float4(0.f, 0.f, 0.f, 0.f);
    return dtype == 0 ? ((const float4*)weight)[c]
                      : make_float4(load_elem(weight, dtype, 4 * c), load_elem(weight, dtype, 4 * c + 1),
                                    load_elem(weight, dtype, 4 * c + 2), load_elem(weight, dtype, 4 * c + 3));
}
// Values 4c..4c+3 of row r of rmsnorm's output from those of its input `t` and weights `w`.
__device__ __forceinline__ void rmsnorm_store(float4 t, float4 w, int c, int n4, int r, float scale, float* orow,
                                              short* xq, float4* xs) {
    bool live = c < n4;
    float4 o = make_float4(t.x * scale * w.x, t.y * scale * w.y, t.z * scale * w.z, t.w * scale * w.w);
    if (live) ((float4*)orow)[c] = o;
    if (xq) quantize_x16_lanes(o, live, ((u64)r * n4 + c) / 8, xq, xs);
}
// 1 / rms of a row from each thread's share `ss` of its sum of squares: summed over the block
// of RMS_THREADS (through `partial`, RMS_THREADS / 32 floats of shared memory). Every thread
// of the block calls it and gets the result.
__device__ __forceinline__ float rms_scale(float ss, int dim, float eps, float* partial) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float p = lane < RMS_THREADS / 32 ? partial[lane] : 0.f;
        p = warp_sum(p);
        if (lane == 0) partial[0] = p;
    }
    __syncthreads();
    return 1.f / sqrtf(partial[0] / (float)dim + eps);
}

extern "C" __global__ void __launch_bounds__(RMS_THREADS) rmsnorm(const float* x, const u8* weight, int dtype,
                                                                 int dim, float eps, float* out, short* xq,
                                                                 float4* xs) {
    pdl_begin();
    __shared__ float partial[RMS_THREADS / 32];
    int r = blockIdx.x;
    const float* xr = x + (u64)r * dim;
    float* orow = out + (u64)r * dim;
    bool vec = dim % 4 == 0;
    int n4 = vec ? dim / 4 : 0;
    // The weights are loaded with x, before the reduction, so that their latency (they are
    // rarely still in L2 when a whole model streams through it per token) overlaps x's.
    float4 v[RMS_VEC], w[RMS_VEC];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < RMS_VEC; i++) {
        int c = threadIdx.x + i * RMS_THREADS;
        v[i] = c < n4 ? ((const float4*)xr)[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        w[i] = rmsnorm_weight4(weight, dtype, c, n4);
        ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    }
    for (int c = threadIdx.x + RMS_VEC * RMS_THREADS; c < n4; c += RMS_THREADS) {
        float4 t = ((const float4*)xr)[c];
        ss += t.x * t.x + t.y * t.y + t.z * t.z + t.w * t.w;
    }
    for (int j = 4 * n4 + threadIdx.x; j < dim; j += RMS_THREADS) ss += xr[j] * xr[j];
    float scale = rms_scale(ss, dim, eps, partial);
    // Whole warps run every step (quantize_x16_lanes shuffles); `c < n4` says which lanes hold
    // values.
    int n4_warps = (n4 + 31) / 32 * 32;
#pragma unroll
    for (int i = 0; i < RMS_VEC; i++) {
        int c = threadIdx.x + i * RMS_THREADS;
        if (c < n4_warps) rmsnorm_store(v[i], w[i], c, n4, r, scale, orow, xq, xs);
    }
    for (int c = threadIdx.x + RMS_VEC * RMS_THREADS; c < n4_warps; c += RMS_THREADS) {
        float4 t = c < n4 ? ((const float4*)xr)[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        rmsnorm_store(t, rmsnorm_weight4(weight, dtype, c, n4), c, n4, r, scale, orow, xq, xs);
    }
    for (int j = 4 * n4 + threadIdx.x; j < dim; j += RMS_THREADS)
        orow[j] = xr[j] * scale * load_elem(weight, dtype, j);
}

// In-place RMSNorm of `pieces` consecutive pieces of `dim` values (the per-head norms of Q and
// K: pieces = rows · heads, dim = head_dim): one warp per piece, RMS_PIECE_WARPS pieces per
// block of 32·RMS_PIECE_WARPS threads.
#define RMS_PIECE_WARPS 8
extern "C" __global__ void rmsnorm_pieces(float* x, const u8* weight, int dtype, int dim, float eps,
                                          int pieces) {
    pdl_begin();
    int piece = blockIdx.x * RMS_PIECE_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (piece >= pieces) return;  // a whole warp leaves together
    float* xr = x + (u64)piece * dim;
    float ss = 0.f;
    for (int j = lane; j < dim; j += 32) ss += xr[j] * xr[j];
    ss = warp_sum(ss);
    float scale = 1.f / sqrtf(ss / (float)dim + eps);
    for (int j = lane; j < dim; j += 32) xr[j] = xr[j] * scale * load_elem(weight, dtype, j);
}

// out[r, :] += RMSNorm of x[r, :], times weight: the post-norm of a sub-block added to the residual
// stream (Gemma). One block of RMS_THREADS per row.
extern "C" __global__ void __launch_bounds__(RMS_THREADS) add_rmsnorm(const float* x, const u8* weight, int dtype,
                                                                     int dim, float eps, float* out) {
    pdl_begin();
    __shared__ float partial[RMS_THREADS / 32];
    int r = blockIdx.x;
    const float* xr = x + (u64)r * dim;
    float* orow = out + (u64)r * dim;
    float ss = 0.f;
    for (int j = threadIdx.x; j < dim; j += RMS_THREADS) ss += xr[j] * xr[j];
    float scale = rms_scale(ss, dim, eps, partial);
    for (int j = threadIdx.x; j < dim; j += RMS_THREADS) orow[j] += xr[j] * scale * load_elem(weight, dtype, j);
}

// HF rotate_half: the pair (i, i + half) of head h, rotated by pos·inv_freq[i].
__device__ __forceinline__ void rotate_pair(float* head, int i, int half, float pos, const float* inv_freq) {
    float angle = pos * inv_freq[i];
    float c = cosf(angle), s = sinf(angle);
    float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * c - x2 * s;
    head[i + half] = x2 * c + x1 * s;
}

// Rotates the pair i of head h of activation row `r` at position `pos` (q heads first, then k
// heads), and for a k head stores its k and v pair in the caches of `slots` positions at slot
// pos % slots (a sliding-window layer's cache is a ring).
__device__ __forceinline__ void rope_store_pair(float* q, float* k, const float* v, int r, int h, int i, int pos,
                                                int n_heads, int n_kv_heads, int head_dim, const float* inv_freq,
                                                u16* k_cache, u16* v_cache, int slots) {
    int half = head_dim / 2;
    if (h < n_heads) {
        rotate_pair(q + ((u64)r * n_heads + h) * head_dim, i, half, (float)pos, inv_freq);
        return;
    }
    int kvh = h - n_heads;
    u64 row = ((u64)r * n_kv_heads + kvh) * head_dim;
    float* kh = k + row;
    rotate_pair(kh, i, half, (float)pos, inv_freq);
    u64 at = ((u64)(pos % slots) * n_kv_heads + kvh) * head_dim;
    k_cache[at + i] = f2h(kh[i]);
    k_cache[at + i + half] = f2h(kh[i + half]);
    v_cache[at + i] = f2h(v[row + i]);
    v_cache[at + i + half] = f2h(v[row + i + half]);
}

// The rotated pair of this thread, one thread per pair of `rows` rows of `heads` heads (q's,
// then k's) of `half` pairs: row r, head h, pair i; false for a thread past the last pair.
__device__ __forceinline__ bool rope_pair_of_thread(int rows, int heads, int half, int& r, int& h, int& i) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * heads * half) return false;
    i = idx % half;
    h = (idx / half) % heads;
    r = idx / (half * heads);
    return true;
}

// The attention block's position-dependent steps in one launch: q and k rows r roped at
// position p + r (p = start_pos), k and v rows stored in the f16 caches of `slots` positions at
// slot (p + r) % slots. One thread per rotated pair of a q or k head; the k pairs also store
// v's pair.
extern "C" __global__ void rope_store_kv(float* q, float* k, const float* v, int rows, int n_heads,
                                         int n_kv_heads, int head_dim, int pos0, const int* pos_dev,
                                         const float* inv_freq, u16* k_cache, u16* v_cache, int slots) {
    pdl_begin();
    int r, h, i;
    if (!rope_pair_of_thread(rows, n_heads + n_kv_heads, head_dim / 2, r, h, i)) return;
    int pos = start_pos(pos0, pos_dev) + r;
    rope_store_pair(q, k, v, r, h, i, pos, n_heads, n_kv_heads, head_dim, inv_freq, k_cache, v_cache, slots);
}

// `rope_store_kv` for the rows of every sequence of `seqs` (`total_rows` rows, each sequence at
// its own positions, into its own caches) in one launch. Every cache holds all the positions
// stored (slot t for position t): the backend stores into a ring that wrapped with
// `rope_store_kv`.
extern "C" __global__ void rope_store_kv_seqs(float* q, float* k, const float* v, int total_rows, int n_heads,
                                              int n_kv_heads, int head_dim, const float* inv_freq,
                                              const __grid_constant__ SeqTable seqs) {
    pdl_begin();
    int r, h, i;
    if (!rope_pair_of_thread(total_rows, n_heads + n_kv_heads, head_dim / 2, r, h, i)) return;
    int s = seq_of_row(seqs, r);
    int pos = seqs.pos0[s] + (r - seqs.row0[s]);
    const int no_ring = 0x7fffffff;
    rope_store_pair(q, k, v, r, h, i, pos, n_heads, n_kv_heads, head_dim, inv_freq, seqs.k_cache[s], seqs.v_cache[s],
                    no_ring);
}
