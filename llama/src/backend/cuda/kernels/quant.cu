// Dequantization and the integer activations of the quantized matmuls.

// out[r, :] = table[ids[r], :]; one block per row.
extern "C" __global__ void embed_rows(const u8* table, u64 row_bytes, int dtype, const u32* ids,
                                      int dim, float* out) {
    pdl_begin();
    int r = blockIdx.x;
    const u8* row = table + (u64)ids[r] * row_bytes;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) out[(u64)r * dim + j] = load_elem(row, dtype, j);
}

// x (n values, a multiple of 32) in the format above; one float4 per thread.
extern "C" __global__ void quantize_x16(const float* x, u64 n, short* xq, float4* xs) {
    pdl_begin();
    u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    bool live = c < n / 4;
    float4 v = live ? ((const float4*)x)[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    quantize_x16_lanes(v, live, c / 8, xq, xs);
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
    pdl_begin();
    float v[8];
    u64 at;
    if (!dequant8(w, dtype, n_blocks, v, at)) return;
    float4* o = (float4*)(out + at);
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
}

extern "C" __global__ void dequant_f16(const u8* w, int dtype, u64 n_blocks, u16* out) {
    pdl_begin();
    float v[8];
    u64 at;
    if (!dequant8(w, dtype, n_blocks, v, at)) return;
    u32 h[4];
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = (u32)f2h(v[2 * j]) | ((u32)f2h(v[2 * j + 1]) << 16);
    *(uint4*)(out + at) = make_uint4(h[0], h[1], h[2], h[3]);
}

// `dequant_f16` for q8_0 (3), q4_0 (4) and q4_1 (5) with a thread per 32-value block: the scale
// (and q4_1's offset) read once, the quant bytes as 16-bit words, the same expressions as
// `load_elem` (so the same bits), four 16-byte stores.
extern "C" __global__ void dequant_blocks_f16(const u8* w, int dtype, u64 n_blocks, u16* out) {
    pdl_begin();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_blocks) return;
    int bytes = dtype == 3 ? 34 : dtype == 4 ? 18 : 20;
    const u8* b = w + i * bytes;
    float d = h2f(load_u16(b)), m = dtype == 5 ? h2f(load_u16(b + 2)) : 0.f;
    const u8* qs = b + (dtype == 5 ? 4 : 2);
    u16 vals[32];
    if (dtype == 3) {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u32 two = load_u16(qs + 2 * j);
            vals[2 * j] = f2h(d * (float)(signed char)(two & 0xFF));
            vals[2 * j + 1] = f2h(d * (float)(signed char)(two >> 8));
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 two = load_u16(qs + 2 * j);
#pragma unroll
            for (int k = 0; k < 2; k++) {
                int byte = (two >> (8 * k)) & 0xFF, lo = byte & 0xF, hi = byte >> 4;
                vals[2 * j + k] = f2h(dtype == 4 ? (float)(lo - 8) * d : (float)lo * d + m);
                vals[16 + 2 * j + k] = f2h(dtype == 4 ? (float)(hi - 8) * d : (float)hi * d + m);
            }
        }
    }
    uint4* o = (uint4*)(out + i * 32);
#pragma unroll
    for (int s = 0; s < 4; s++)
        o[s] = make_uint4((u32)vals[8 * s] | ((u32)vals[8 * s + 1] << 16), (u32)vals[8 * s + 2] | ((u32)vals[8 * s + 3] << 16),
                          (u32)vals[8 * s + 4] | ((u32)vals[8 * s + 5] << 16), (u32)vals[8 * s + 6] | ((u32)vals[8 * s + 7] << 16));
}
