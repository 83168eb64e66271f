// Elementwise kernels: conversions between f32 and 16-bit floats, the gated activation.

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
    if (i < n) dst[i] = f2bf(src[i]);
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
