// A CPU emulator for the CUDA kernels of llama/src/backend/cuda/kernels, so that they can be
// run and checked on a machine without a GPU (the development machines have none). The kernel
// files compile unchanged with a C++17 compiler after this header: every thread of a block runs
// as a fiber (a stack of its own, switched by hand, no system call), and a thread that reaches
// `__syncthreads`, a warp shuffle or a warp-wide matrix instruction waits there until every live
// thread of its block (or warp) has arrived, as on the device. Blocks run one after another, so
// `__shared__` variables become `static` ones.
//
// What it checks: the arithmetic and the indexing of a kernel, its barriers (a barrier that not
// every thread reaches is reported as a deadlock instead of hanging), and that warp-wide
// operations are called by all 32 lanes. What it does not: timing, memory ordering between
// blocks (they run in order), and the exact rounding of the device's `expf`/tensor-core
// accumulation (the host's libm and an f64 sum stand in).
//
// The layouts of the matrix instructions are those of the PTX ISA ("Matrix Fragments for
// mma.m16n8k16 / m16n8k32"): groupID g = lane / 4, threadID_in_group t = lane % 4.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#if !defined(__x86_64__)
#error "the CUDA emulator switches fibers with x86-64 assembly"
#endif

// ---- CUDA vector types and qualifiers -------------------------------------------------------

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct uint3e { unsigned x, y, z; };

inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __grid_constant__
// One block runs at a time, so a block's shared memory is a function's static storage.
#define __shared__ static

// ---- the fibers -------------------------------------------------------------------------------

namespace emu {

// Saves the callee-saved registers and the stack pointer of the running fiber at *from, and
// continues the fiber whose stack pointer is `to`.
extern "C" void emu_switch(void** from, void* to);
asm(R"(
.text
.globl emu_switch
.type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch, .-emu_switch
)");

enum Wait { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER };

struct Thread {
    void* sp = nullptr;
    uint3e tid{};
    int lane = 0, warp = 0;
    bool done = false;
    Wait wait = RUNNABLE;
    unsigned long epoch = 0;  // of the barrier it waits at
};

// What the lanes of a warp hand each other at a warp-wide operation.
struct WarpState {
    unsigned long epoch = 0;
    int arrived = 0, live = 0;
    uint32_t slot[32][16];
};

struct Block {
    uint3e idx{}, dim{}, grid{};
    std::vector<Thread> threads;
    int live = 0;
    unsigned long epoch = 0;
    int arrived = 0;
    WarpState warps[32];
};

inline Block* blk = nullptr;
inline Thread* cur = nullptr;
inline void* scheduler_sp = nullptr;
inline const std::function<void()>* body = nullptr;
inline std::vector<std::vector<char>> stacks;
constexpr size_t STACK_BYTES = 256 * 1024;

[[noreturn]] inline void fail(const char* what) {
    fprintf(stderr, "cuda emulator: %s (block %u,%u,%u thread %u)\n", what, blk ? blk->idx.x : 0,
            blk ? blk->idx.y : 0, blk ? blk->idx.z : 0, cur ? cur->tid.x : 0);
    abort();
}

inline void yield() { emu_switch(&cur->sp, scheduler_sp); }

// Block barrier: the last live thread to arrive releases the others.
inline void block_barrier() {
    Block& b = *blk;
    if (++b.arrived == b.live) {
        b.arrived = 0;
        b.epoch++;
        return;
    }
    cur->wait = AT_BLOCK_BARRIER;
    cur->epoch = b.epoch;
    yield();
}

// Warp barrier for warp-wide operations: every lane of the warp must be live.
inline void warp_barrier() {
    WarpState& w = blk->warps[cur->warp];
    if (w.live != 32) fail("a warp-wide operation with lanes that have exited");
    if (++w.arrived == w.live) {
        w.arrived = 0;
        w.epoch++;
        return;
    }
    cur->wait = AT_WARP_BARRIER;
    cur->epoch = w.epoch;
    yield();
}

inline void thread_exit() {
    Block& b = *blk;
    cur->done = true;
    b.live--;
    b.warps[cur->warp].live--;
    // Threads already waiting at the block barrier no longer wait for this one.
    if (b.arrived > 0 && b.arrived == b.live) {
        b.arrived = 0;
        b.epoch++;
    }
}

[[noreturn]] inline void trampoline() {
    (*body)();
    thread_exit();
    emu_switch(&cur->sp, scheduler_sp);
    fail("a finished fiber was resumed");
}

inline void* fiber_stack(size_t i) {
    while (stacks.size() <= i) stacks.emplace_back(STACK_BYTES);
    // The first switch pops six registers and returns into the trampoline, which then starts
    // with the stack aligned as after a call.
    uintptr_t top = ((uintptr_t)stacks[i].data() + STACK_BYTES) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;               // the trampoline's (never used) return address
    *--sp = (void*)&trampoline;    // where `ret` goes
    for (int r = 0; r < 6; r++) *--sp = nullptr;
    return sp;
}

inline bool runnable(const Thread& t) {
    if (t.done) return false;
    switch (t.wait) {
        case RUNNABLE: return true;
        case AT_BLOCK_BARRIER: return blk->epoch != t.epoch;
        case AT_WARP_BARRIER: return blk->warps[t.warp].epoch != t.epoch;
    }
    return false;
}

// Runs `kernel` (a call of the kernel with its arguments) on a grid of blocks of `block.x`
// threads (1-D blocks), block after block.
inline void launch(uint3e grid, unsigned threads, const std::function<void()>& kernel) {
    if (threads == 0 || threads > 1024 || threads % 32 != 0) {
        fprintf(stderr, "cuda emulator: blocks of %u threads are not supported here\n", threads);
        abort();
    }
    Block b;
    b.dim = {threads, 1, 1};
    b.grid = grid;
    b.threads.resize(threads);
    body = &kernel;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                b.idx = {x, y, z};
                b.live = threads;
                b.arrived = 0;
                for (auto& w : b.warps) {
                    w.arrived = 0;
                    w.live = 32;
                }
                for (unsigned i = 0; i < threads; i++) {
                    Thread& t = b.threads[i];
                    t = Thread{};
                    t.tid = {i, 0, 0};
                    t.lane = i % 32;
                    t.warp = i / 32;
                    t.sp = fiber_stack(i);
                }
                blk = &b;
                for (;;) {
                    bool progressed = false, any = false;
                    for (auto& t : b.threads) {
                        if (t.done) continue;
                        any = true;
                        if (!runnable(t)) continue;
                        t.wait = RUNNABLE;
                        cur = &t;
                        emu_switch(&scheduler_sp, t.sp);
                        progressed = true;
                    }
                    if (!any) break;
                    if (!progressed) fail("deadlock: threads wait at a barrier that the others never reach");
                }
                cur = nullptr;
            }
    blk = nullptr;
}

}  // namespace emu

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::blk->idx)
#define blockDim (emu::blk->dim)
#define gridDim (emu::blk->grid)

// ---- intrinsics -----------------------------------------------------------------------------

inline void __syncthreads() { emu::block_barrier(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier(); }
inline void __threadfence() {}

template <class T>
inline T emu_exchange(T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
    emu::WarpState& w = emu::blk->warps[emu::cur->warp];
    memcpy(w.slot[emu::cur->lane], &v, sizeof(T));
    emu::warp_barrier();
    T r;
    memcpy(&r, w.slot[src & 31], sizeof(T));
    emu::warp_barrier();
    return r;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) { return emu_exchange(v, emu::cur->lane ^ mask); }
template <class T> inline T __shfl_sync(unsigned, T v, int src, int = 32) { return emu_exchange(v, src); }
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
    int src = emu::cur->lane + (int)d;
    return emu_exchange(v, src < 32 ? src : emu::cur->lane);
}

inline int atomicAdd(int* p, int v) { int old = *p; *p += v; return old; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned old = *p; *p += v; return old; }
inline float atomicAdd(float* p, float v) { float old = *p; *p += v; return old; }
inline int atomicExch(int* p, int v) { int old = *p; *p = v; return old; }

template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }

inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// Two 16-bit × two 8-bit signed products plus c (bytes 0-1 of b: `_lo`, 2-3: `_hi`).
inline int __dp2a_lo(int a, int b, int c) {
    return c + (int)(int16_t)(a & 0xFFFF) * (int)(int8_t)(b & 0xFF) +
           (int)(int16_t)((unsigned)a >> 16) * (int)(int8_t)((b >> 8) & 0xFF);
}
inline int __dp2a_hi(int a, int b, int c) {
    return c + (int)(int16_t)(a & 0xFFFF) * (int)(int8_t)((b >> 16) & 0xFF) +
           (int)(int16_t)((unsigned)a >> 16) * (int)(int8_t)((unsigned)b >> 24);
}
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
// Byte i of the result is byte (s >> 4i) & 7 of {y:x} (x bytes 0-3, y bytes 4-7).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}
inline unsigned __vsub4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xFF) << (8 * i);
    return r;
}

// ---- half precision (the kernels use PTX `cvt` on the device) -------------------------------

inline float emu_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t f;
    if (exp == 0) {
        if (man == 0) f = sign;
        else {
            float v = std::ldexp((float)man, -24);
            memcpy(&f, &v, 4);
            f |= sign;
        }
    } else if (exp == 31) f = sign | 0x7F800000 | (man << 13);
    else f = sign | ((exp + 112) << 23) | (man << 13);
    float r;
    memcpy(&r, &f, 4);
    return r;
}

// Round to nearest even, with subnormals and overflow to infinity (as cvt.rn.f16.f32).
inline uint16_t emu_f2h(float v) {
    uint32_t f;
    memcpy(&f, &v, 4);
    uint16_t sign = (uint16_t)((f >> 16) & 0x8000);
    if ((f & 0x7F800000) == 0x7F800000) return sign | 0x7C00 | ((f & 0x7FFFFF) ? 0x200 : 0);
    float a = std::fabs(v);
    if (a >= 65520.f) return sign | 0x7C00;
    if (a < 6.103515625e-05f) {  // subnormal half: a multiple of 2^-24
        float q = std::nearbyint(a * 16777216.f);
        return sign | (uint16_t)q;
    }
    int e;
    float m = std::frexp(a, &e);  // a = m·2^e, m in [0.5, 1)
    float q = std::nearbyint(m * 2048.f);  // 11 significant bits
    if (q == 2048.f) { q = 1024.f; e += 1; }
    int exp = e - 1 + 15;
    if (exp >= 31) return sign | 0x7C00;
    return sign | (uint16_t)(exp << 10) | (uint16_t)((int)q - 1024);
}

// bf16 by rounding the f32 bits to nearest even.
inline uint16_t emu_f2bf(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// ---- warp-wide matrix instructions (mma.sync), by the PTX fragment layouts ------------------

namespace emu {

// Every lane hands in its fragments; each then computes its own part of D from all of them.
// A is 16 x K (row-major fragments), B is K x 8, C and D are 16 x 8. `a_at(lane regs, row, k)`
// and `b_at(lane regs, k, col)` read one element from the fragments of all lanes.
template <class AAt, class BAt>
inline void mma_f64(const uint32_t* a, int na, const uint32_t* b, int nb, int K, AAt a_at, BAt b_at,
                    const double* c, double* d) {
    WarpState& w = blk->warps[cur->warp];
    uint32_t* mine = w.slot[cur->lane];
    for (int i = 0; i < na; i++) mine[i] = a[i];
    for (int i = 0; i < nb; i++) mine[na + i] = b[i];
    warp_barrier();
    int g = cur->lane / 4, t = cur->lane % 4;
    for (int i = 0; i < 4; i++) {
        int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
        double s = c[i];
        for (int k = 0; k < K; k++) s += a_at(w.slot, row, k) * b_at(w.slot, k, col, na);
        d[i] = s;
    }
    warp_barrier();
}

// m16n8k32 with 8-bit integers: A reg0 (row g, k 4t..4t+3), reg1 (row g+8, same k), reg2 (row g,
// k 16+4t..), reg3 (row g+8, k 16+4t..); B reg0 (k 4t..4t+3, col g), reg1 (k 16+4t.., col g).
inline double int8_elem(uint32_t word, int byte, bool is_signed) {
    uint32_t v = (word >> (8 * byte)) & 0xFF;
    return is_signed ? (double)(int8_t)v : (double)v;
}
inline void mma_m16n8k32_i8(const uint32_t a[4], const uint32_t b[2], const int c[4], int d[4],
                            bool a_signed, bool b_signed) {
    auto a_at = [&](uint32_t (*s)[16], int row, int k) {
        int t = (k % 16) / 4, reg = (row >= 8 ? 1 : 0) + (k >= 16 ? 2 : 0);
        return int8_elem(s[(row % 8) * 4 + t][reg], k % 4, a_signed);
    };
    auto b_at = [&](uint32_t (*s)[16], int k, int col, int na) {
        int t = (k % 16) / 4, reg = k >= 16 ? 1 : 0;
        return int8_elem(s[col * 4 + t][na + reg], k % 4, b_signed);
    };
    double cd[4] = {(double)c[0], (double)c[1], (double)c[2], (double)c[3]}, dd[4];
    mma_f64(a, 4, b, 2, 32, a_at, b_at, cd, dd);
    for (int i = 0; i < 4; i++) d[i] = (int)dd[i];
}

// m16n8k16 with 8-bit integers: A reg0 (row g, k 4t..4t+3), reg1 (row g+8, same k); B reg0 (k
// 4t..4t+3, col g).
inline void mma_m16n8k16_i8(const uint32_t a[2], const uint32_t b[1], const int c[4], int d[4],
                            bool a_signed, bool b_signed) {
    auto a_at = [&](uint32_t (*s)[16], int row, int k) {
        return int8_elem(s[(row % 8) * 4 + k / 4][row >= 8 ? 1 : 0], k % 4, a_signed);
    };
    auto b_at = [&](uint32_t (*s)[16], int k, int col, int na) {
        return int8_elem(s[col * 4 + k / 4][na], k % 4, b_signed);
    };
    double cd[4] = {(double)c[0], (double)c[1], (double)c[2], (double)c[3]}, dd[4];
    mma_f64(a, 2, b, 1, 16, a_at, b_at, cd, dd);
    for (int i = 0; i < 4; i++) d[i] = (int)dd[i];
}

// m16n8k16 with 16-bit floats (f16 or bf16): A reg0 (row g, k 2t, 2t+1), reg1 (row g+8, k 2t..),
// reg2 (row g, k 2t+8, 2t+9), reg3 (row g+8, k 2t+8..); B reg0 (k 2t, 2t+1, col g), reg1 (k 2t+8,
// 2t+9); the lower half of a register holds the even k.
inline double half_elem(uint32_t word, int half, bool bf16) {
    uint16_t h = (uint16_t)(word >> (16 * half));
    if (bf16) {
        uint32_t f = (uint32_t)h << 16;
        float v;
        memcpy(&v, &f, 4);
        return v;
    }
    return emu_h2f(h);
}
inline void mma_m16n8k16_f16(const uint32_t a[4], const uint32_t b[2], const float c[4], float d[4],
                             bool bf16) {
    auto a_at = [&](uint32_t (*s)[16], int row, int k) {
        int t = (k % 8) / 2, reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return half_elem(s[(row % 8) * 4 + t][reg], k % 2, bf16);
    };
    auto b_at = [&](uint32_t (*s)[16], int k, int col, int na) {
        int t = (k % 8) / 2, reg = k >= 8 ? 1 : 0;
        return half_elem(s[col * 4 + t][na + reg], k % 2, bf16);
    };
    double cd[4] = {c[0], c[1], c[2], c[3]}, dd[4];
    mma_f64(a, 4, b, 2, 16, a_at, b_at, cd, dd);
    for (int i = 0; i < 4; i++) d[i] = (float)dd[i];
}

}  // namespace emu
