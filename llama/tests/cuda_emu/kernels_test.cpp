// The CUDA kernels run on the CPU emulator (emu.h) against slow references written here, on
// random inputs and random quantized blocks, several shapes including ragged ones; outputs are
// poisoned (NaN) before each run. Every check prints its error and tolerance. Built and run by
// scripts/cuda-emu-check.sh (and the opt-in test llama/tests/cuda_emu.rs); exits non-zero on the
// first failure. `--quick` runs smaller shapes.

#include "emu.h"

// The kernel files, in the order of KERNEL_FILES in llama/src/backend/cuda/compile.rs (a unit
// test there checks that this list matches).
// KERNEL FILES BEGIN
#include "common.cuh"
#include "quant.cu"
#include "norm_rope.cu"
#include "elementwise.cu"
#include "attention.cu"
#include "matmul.cu"
#include "matmul_mma.cu"
#include "kquants.cu"
#include "kquants_mma.cu"
// KERNEL FILES END

#include <memory>
#include <random>
#include <string>

namespace {

bool quick = false;
int failures = 0;

std::mt19937_64 rng(1234);
float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
std::vector<float> random_vec(size_t n, float scale = 1.f) {
    std::vector<float> v(n);
    for (auto& x : v) x = uniform(-scale, scale);
    return v;
}

// Device-like buffers: 256-byte aligned, poisoned with NaN bytes.
template <class T>
struct Buf {
    T* p = nullptr;
    size_t n = 0;
    explicit Buf(size_t count) : n(count) {
        p = (T*)aligned_alloc(256, ((count * sizeof(T) + 255) / 256 + 1) * 256);
        memset((void*)p, 0xFF, count * sizeof(T));
    }
    Buf(const std::vector<T>& v) : Buf(v.size()) { memcpy((void*)p, v.data(), v.size() * sizeof(T)); }
    ~Buf() { free(p); }
    Buf(const Buf&) = delete;
    std::vector<T> vec() const { return std::vector<T>(p, p + n); }
    void poison() { memset((void*)p, 0xFF, n * sizeof(T)); }
};

double max_rel(const std::vector<float>& got, const std::vector<double>& want) {
    double scale = 1e-6, err = 0;
    for (double w : want) scale = std::max(scale, std::fabs(w));
    for (size_t i = 0; i < got.size(); i++) {
        double d = std::fabs((double)got[i] - want[i]);
        if (!(d == d)) return INFINITY;  // NaN: a value that was never written
        err = std::max(err, d);
    }
    return err / scale;
}

void check(const std::string& what, double err, double tol) {
    bool ok = err <= tol;
    printf("%-70s max rel err %.2e (tol %.0e) %s\n", what.c_str(), err, tol, ok ? "ok" : "FAILED");
    fflush(stdout);
    if (!ok) failures++;
}

// ---- weights -------------------------------------------------------------------------------

enum { F32 = 0, F16 = 1, BF16 = 2, Q8_0 = 3, Q4_0 = 4, Q4_1 = 5 };
const char* dtype_name(int d) {
    static const char* names[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"};
    return names[d];
}
size_t row_bytes(int dtype, int k) {
    switch (dtype) {
        case F32: return (size_t)k * 4;
        case F16: case BF16: return (size_t)k * 2;
        case Q8_0: return (size_t)k / 32 * 34;
        case Q4_0: return (size_t)k / 32 * 18;
        default: return (size_t)k / 32 * 20;
    }
}

// Random weights of `dtype` [m, k] and their values as the format defines them.
struct Weights {
    std::vector<uint8_t> bytes;
    std::vector<double> values;
};
Weights random_weights(int dtype, int m, int k) {
    Weights w;
    w.bytes.resize(row_bytes(dtype, k) * m);
    w.values.resize((size_t)m * k);
    auto put16 = [&](size_t at, uint16_t h) { w.bytes[at] = h & 0xFF; w.bytes[at + 1] = h >> 8; };
    for (int i = 0; i < m; i++) {
        size_t row = row_bytes(dtype, k) * i;
        for (int c = 0; c < k; c++) {
            double& v = w.values[(size_t)i * k + c];
            if (dtype == F32) {
                float f = uniform(-1, 1);
                memcpy(&w.bytes[row + 4 * c], &f, 4);
                v = f;
            } else if (dtype == F16) {
                uint16_t h = emu_f2h(uniform(-1, 1));
                put16(row + 2 * c, h);
                v = emu_h2f(h);
            } else if (dtype == BF16) {
                uint16_t h = emu_f2bf(uniform(-1, 1));
                put16(row + 2 * c, h);
                uint32_t f = (uint32_t)h << 16;
                float x;
                memcpy(&x, &f, 4);
                v = x;
            }
        }
        if (dtype >= Q8_0) {
            int bb = dtype == Q8_0 ? 34 : dtype == Q4_0 ? 18 : 20;
            for (int b = 0; b < k / 32; b++) {
                size_t at = row + (size_t)b * bb;
                uint16_t d = emu_f2h(uniform(0.001f, 0.02f) * (uniform(0, 1) < 0.5f ? -1 : 1));
                put16(at, d);
                double dd = emu_h2f(d), mm = 0;
                if (dtype == Q4_1) {
                    uint16_t m16 = emu_f2h(uniform(-0.1f, 0.1f));
                    put16(at + 2, m16);
                    mm = emu_h2f(m16);
                }
                for (int j = 0; j < 32; j++) {
                    double& v = w.values[(size_t)i * k + b * 32 + j];
                    if (dtype == Q8_0) {
                        int8_t q = (int8_t)(rng() & 0xFF);
                        w.bytes[at + 2 + j] = (uint8_t)q;
                        v = dd * q;
                    }
                }
                if (dtype != Q8_0) {
                    size_t qs = at + (dtype == Q4_0 ? 2 : 4);
                    for (int j = 0; j < 16; j++) w.bytes[qs + j] = (uint8_t)(rng() & 0xFF);
                    for (int j = 0; j < 32; j++) {
                        int q = j < 16 ? (w.bytes[qs + j] & 0xF) : (w.bytes[qs + j - 16] >> 4);
                        w.values[(size_t)i * k + b * 32 + j] = dtype == Q4_0 ? (q - 8) * dd : q * dd + mm;
                    }
                }
            }
        }
    }
    return w;
}

// want[r, i] = Σ_c x[r, c] · w[i, c] (+ base) in f64.
std::vector<double> ref_matmul(const std::vector<float>& x, int rows, const Weights& w, int m, int k,
                               const std::vector<float>* base = nullptr) {
    std::vector<double> out((size_t)rows * m);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < m; i++) {
            double s = base ? (*base)[(size_t)r * m + i] : 0;
            for (int c = 0; c < k; c++) s += (double)x[(size_t)r * k + c] * w.values[(size_t)i * k + c];
            out[(size_t)r * m + i] = s;
        }
    return out;
}

uint3e grid3(unsigned x, unsigned y = 1, unsigned z = 1) { return {x, y, z}; }

// ---- the existing matmul kernels (the emulator's own check: they passed on the GPU) ---------

#define KERNEL_TABLE(NAME) \
    {NAME##_r1, NAME##_r8}

void run_matmul_kernel(int dtype, int variant, const float* x, const short* xq, const float4* xs, int rows,
                       int k, MatmulJobs jobs, int n_blocks) {
    int per_block = variant == 0 ? 1 : MM_ROWS;
    uint3e grid = grid3(n_blocks, (rows + per_block - 1) / per_block);
    emu::launch(grid, MM_WARPS * 32, [&] {
        switch (dtype * 2 + variant) {
            case 0: matmul_f32_r1(x, rows, k, jobs); break;
            case 1: matmul_f32_r8(x, rows, k, jobs); break;
            case 2: matmul_f16_r1(x, rows, k, jobs); break;
            case 3: matmul_f16_r8(x, rows, k, jobs); break;
            case 4: matmul_bf16_r1(x, rows, k, jobs); break;
            case 5: matmul_bf16_r8(x, rows, k, jobs); break;
            case 6: matmul_q8_0_r1(xq, xs, rows, k, jobs); break;
            case 7: matmul_q8_0_r8(xq, xs, rows, k, jobs); break;
            case 8: matmul_q4_0_r1(xq, xs, rows, k, jobs); break;
            case 9: matmul_q4_0_r8(xq, xs, rows, k, jobs); break;
            case 10: matmul_q4_1_r1(xq, xs, rows, k, jobs); break;
            default: matmul_q4_1_r8(xq, xs, rows, k, jobs); break;
        }
    });
}

// x (rows·k values) in the 16-bit integer format, by the `quantize_x16` kernel.
struct X16Buf {
    Buf<short> xq;
    Buf<float4> xs;
    X16Buf(const Buf<float>& x, size_t n) : xq(n), xs(n / 32) {
        emu::launch(grid3((unsigned)((n / 4 + 255) / 256)), 256,
                    [&] { quantize_x16(x.p, (u64)n, xq.p, xs.p); });
    }
};

// The outputs and `MatmulJobs` of one launch over weights `wd` of `ms[j]` rows each (sharing x
// of `rows` rows); with `accumulate` each output starts as random values (`base`) that the
// kernel adds to.
struct JobOutputs {
    std::vector<std::vector<float>> base;
    std::vector<std::unique_ptr<Buf<float>>> outs;
    MatmulJobs jobs{};
    JobOutputs(const std::vector<std::unique_ptr<Buf<uint8_t>>>& wd, const std::vector<int>& ms, int rows,
               int accumulate) {
        jobs.n_jobs = (int)ms.size();
        jobs.accumulate = accumulate;
        for (int j = 0; j < jobs.n_jobs; j++) {
            base.push_back(random_vec((size_t)rows * ms[j]));
            outs.emplace_back(accumulate ? new Buf<float>(base.back()) : new Buf<float>((size_t)rows * ms[j]));
            jobs.w[j] = wd[j]->p;
            jobs.out[j] = outs[j]->p;
            jobs.m[j] = ms[j];
        }
    }
    // The same jobs into outputs of their own, holding what `other`'s hold now.
    JobOutputs(const JobOutputs& other) : base(other.base), jobs(other.jobs) {
        for (int j = 0; j < jobs.n_jobs; j++) {
            outs.emplace_back(new Buf<float>(other.outs[j]->vec()));
            jobs.out[j] = outs[j]->p;
        }
    }
    // The largest relative error of any output against the f64 reference.
    double max_err(const std::vector<float>& x, int rows, const std::vector<Weights>& ws, int k) const {
        double err = 0;
        for (int j = 0; j < jobs.n_jobs; j++)
            err = std::max(err, max_rel(outs[j]->vec(), ref_matmul(x, rows, ws[j], jobs.m[j], k,
                                                                    jobs.accumulate ? &base[j] : nullptr)));
        return err;
    }
};

void test_existing_matmul() {
    int shapes[][2] = {{77, 96}, {33, 576}};
    for (int dtype = 0; dtype < 6; dtype++)
        for (auto& s : shapes) {
            int m = s[0], k = s[1];
            Weights w = random_weights(dtype, m, k);
            Buf<uint8_t> wd(w.bytes);
            for (int rows : {1, 3, 9}) {
                auto x = random_vec((size_t)rows * k);
                Buf<float> xd(x);
                X16Buf x16(xd, (size_t)rows * k);
                Buf<float> out((size_t)rows * m);
                MatmulJobs jobs{};
                jobs.w[0] = wd.p;
                jobs.out[0] = out.p;
                jobs.m[0] = m;
                jobs.n_jobs = 1;
                jobs.accumulate = 0;
                run_matmul_kernel(dtype, rows == 1 ? 0 : 1, xd.p, x16.xq.p, x16.xs.p, rows, k, jobs,
                                  (m + MM_WROWS - 1) / MM_WROWS);
                double tol = dtype >= Q8_0 ? 1e-4 : 1e-5;
                check(std::string("existing matmul ") + dtype_name(dtype) + " " + std::to_string(m) + "x" +
                          std::to_string(k) + " rows=" + std::to_string(rows),
                      max_rel(out.vec(), ref_matmul(x, rows, w, m, k)), tol);
            }
        }
}

// ---- the tensor-core batched matmul ---------------------------------------------------------

using MmaKernel = void (*)(const void*, const float4*, int, int, MatmulJobs, float*, int*, int);
// The kernel for `nt` 8-row tiles (1, 2, 4 or 8), or null where the dtype has none that wide:
// matmul_mma.cu stops at 4 tiles, kquants_mma.cu at 8 (as `Kernels::load` finds them).
MmaKernel mma_kernel(int dtype, int nt) {
#define MMA_ROW(NAME) {NAME##_n1, NAME##_n2, NAME##_n4, nullptr}
#define MMA_KQ_ROW(NAME) {NAME##_n1, NAME##_n2, NAME##_n4, NAME##_n8}
    // By dtype code (kquants_mma.cu's from 6 on).
    static const MmaKernel table[15][4] = {{nullptr, nullptr, nullptr, nullptr},
                                           MMA_ROW(matmul_mma_f16),
                                           MMA_ROW(matmul_mma_bf16),
                                           MMA_ROW(matmul_mma_q8_0),
                                           MMA_ROW(matmul_mma_q4_0),
                                           MMA_ROW(matmul_mma_q4_1),
                                           MMA_KQ_ROW(matmul_mma_q5_0),
                                           MMA_KQ_ROW(matmul_mma_q5_1),
                                           MMA_KQ_ROW(matmul_mma_q2_k),
                                           MMA_KQ_ROW(matmul_mma_q3_k),
                                           MMA_KQ_ROW(matmul_mma_q4_k),
                                           MMA_KQ_ROW(matmul_mma_q5_k),
                                           MMA_KQ_ROW(matmul_mma_q6_k),
                                           MMA_KQ_ROW(matmul_mma_iq4_nl),
                                           MMA_KQ_ROW(matmul_mma_iq4_xs)};
    int v = nt <= 1 ? 0 : nt <= 2 ? 1 : nt <= 4 ? 2 : 3;
    return table[dtype][v];
}

// The 8-row tiles a block of `dtype`'s kernel takes for `rows` input rows: enough for them, up to
// the widest kernel the dtype has (`launch_mma` in matmul.rs).
int mma_tiles(int dtype, int rows) {
    int nt = 1;
    while (nt * 8 < rows && nt < 8 && mma_kernel(dtype, nt * 2)) nt *= 2;
    return nt;
}

// One launch of the mma kernel over `jobs` (weights of one dtype sharing x), as the host does:
// with `sum_apart` (the `slicesum` path) its slices summed by `mma_sum_slices`, else by the last
// block of each tile.
void run_mma(int dtype, const Buf<float>& x, const X16Buf* x16, int rows, int k, MatmulJobs jobs, int split,
             bool sum_apart = false) {
    int blocks_x = 0, m_total = 0;
    for (int j = 0; j < jobs.n_jobs; j++) {
        blocks_x += (jobs.m[j] + MMA_BROWS - 1) / MMA_BROWS;
        m_total += jobs.m[j];
    }
    int nt = mma_tiles(dtype, rows);
    int blocks_y = (rows + nt * 8 - 1) / (nt * 8);
    Buf<float> partial(std::max(1, split * rows * m_total));
    std::vector<int> zero(blocks_x * blocks_y, 0);
    Buf<int> counters(zero);
    MmaKernel kernel = mma_kernel(dtype, nt);
    const void* xp = dtype <= BF16 ? (const void*)x.p : (const void*)x16->xq.p;
    const float4* xs = dtype <= BF16 ? nullptr : x16->xs.p;
    sum_apart = sum_apart && split > 1;
    emu::launch(grid3(blocks_x, blocks_y, split), MMA_WARPS * 32,
                [&] { kernel(xp, xs, rows, k, jobs, partial.p, sum_apart ? nullptr : counters.p, split); });
    if (sum_apart)
        emu::launch(grid3((m_total + 255) / 256, rows, 1), 256, [&] { mma_sum_slices(partial.p, rows, split, jobs); });
    for (int c : counters.vec())
        if (c != 0) {
            printf("a split-K counter was left at %d\n", c);
            failures++;
        }
}

// One case of the tensor-core matmul: weights `ws` of `dtype` (`ms[j]` rows each, k columns) in
// one launch, 2-70 input rows (one to three row tiles of 32 or 64, partial 8-row tiles), one and three
// column slices, with and without +=, against the f64 reference within `tol`.
void check_mma_case(int dtype, const std::string& name, const std::vector<int>& ms, int k,
                    const std::vector<Weights>& ws, double tol) {
    std::vector<std::unique_ptr<Buf<uint8_t>>> wd;
    for (auto& w : ws) wd.emplace_back(new Buf<uint8_t>(w.bytes));
    std::string shape;
    for (int m : ms) shape += (shape.empty() ? "" : "+") + std::to_string(m);
    for (int rows : {2, 3, 8, 9, 17, 33, 64, 70}) {
        if (quick && rows > 33) continue;
        auto x = random_vec((size_t)rows * k);
        Buf<float> xd(x);
        X16Buf x16(xd, (size_t)rows * k);
        for (int split : {1, 3}) {
            if (split > k / 32) continue;
            for (int accumulate : {0, 1}) {
                JobOutputs o(wd, ms, rows, accumulate), apart(o);
                run_mma(dtype, xd, &x16, rows, k, o.jobs, split);
                const std::string what = "mma matmul " + name + " [" + shape + "]x" + std::to_string(k) +
                                         " rows=" + std::to_string(rows) + " split=" + std::to_string(split) +
                                         (accumulate ? " +=" : "");
                check(what, o.max_err(x, rows, ws, k), tol);
                if (split == 1) continue;
                // The slices summed by `mma_sum_slices` instead: the same bits.
                run_mma(dtype, xd, &x16, rows, k, apart.jobs, split, true);
                bool same = true;
                for (int j = 0; j < o.jobs.n_jobs; j++) same = same && o.outs[j]->vec() == apart.outs[j]->vec();
                if (!same) {
                    printf("%s: the slice-sum kernel's outputs differ from the last block's\n", what.c_str());
                    failures++;
                }
            }
        }
    }
}

void test_mma_matmul() {
    struct Case {
        std::vector<int> ms;
        int k;
    };
    std::vector<Case> cases = {{{1}, 32}, {{77}, 96}, {{130, 40, 7}, 576}, {{256}, 1536}};
    if (quick) cases.pop_back();
    for (int dtype = F16; dtype <= Q4_1; dtype++)
        for (auto& cs : cases) {
            std::vector<Weights> ws;
            for (int m : cs.ms) ws.push_back(random_weights(dtype, m, cs.k));
            // x as 16-bit integers per block (quantized weights) or as f16/bf16 parts within
            // 2^-22 (2^-24) of x; f32 sums in another order than f64.
            check_mma_case(dtype, dtype_name(dtype), cs.ms, cs.k, ws, dtype >= Q8_0 ? 1e-4 : 1e-5);
        }
}

// A row's result does not depend on the rows it is batched with (rows 0-1 the same bits in
// batches of 64, 9 and 2), and stays within f32 rounding of the one-row kernel's (the same integer
// products for quantized weights): weight `w` of `dtype` [m, k]; `one_row(x, x16, jobs)` runs the
// one-row kernel on one row.
void check_mma_rows_independent(int dtype, const std::string& name, const Weights& w, int m, int k,
                                const std::function<void(const Buf<float>&, const X16Buf&, MatmulJobs)>& one_row) {
    Buf<uint8_t> wd(w.bytes);
    auto x = random_vec((size_t)64 * k);
    std::vector<std::vector<float>> results;
    for (int rows : {64, 9, 2}) {
        Buf<float> xd(std::vector<float>(x.begin(), x.begin() + (size_t)rows * k));
        X16Buf x16(xd, (size_t)rows * k);
        Buf<float> out((size_t)rows * m);
        MatmulJobs jobs{};
        jobs.n_jobs = 1;
        jobs.w[0] = wd.p;
        jobs.out[0] = out.p;
        jobs.m[0] = m;
        run_mma(dtype, xd, &x16, rows, k, jobs, 4);
        results.push_back(std::vector<float>(out.p, out.p + (size_t)2 * m));
    }
    bool same = results[1] == results[0] && results[2] == results[0];
    printf("mma matmul %s: rows 0-1 of batches of 64, 9 and 2 are the same bits: %s\n", name.c_str(),
           same ? "yes" : "NO");
    if (!same) failures++;
    // Against the one-row kernel, row by row.
    std::vector<double> solo((size_t)2 * m);
    for (int r = 0; r < 2; r++) {
        Buf<float> xd(std::vector<float>(x.begin() + (size_t)r * k, x.begin() + (size_t)(r + 1) * k));
        X16Buf x16(xd, k);
        Buf<float> out(m);
        MatmulJobs jobs{};
        jobs.n_jobs = 1;
        jobs.w[0] = wd.p;
        jobs.out[0] = out.p;
        jobs.m[0] = m;
        one_row(xd, x16, jobs);
        for (int i = 0; i < m; i++) solo[(size_t)r * m + i] = out.p[i];
    }
    check("mma matmul " + name + " vs the one-row kernel", max_rel(results[2], solo), 2e-6);
}

void test_mma_rows_independent() {
    int m = 200, k = 1024;
    for (int dtype = F16; dtype <= Q4_1; dtype++)
        check_mma_rows_independent(dtype, dtype_name(dtype), random_weights(dtype, m, k), m, k,
                                   [&](const Buf<float>& xd, const X16Buf& x16, MatmulJobs jobs) {
                                       run_matmul_kernel(dtype, 0, xd.p, x16.xq.p, x16.xs.p, 1, k, jobs,
                                                         (m + MM_WROWS - 1) / MM_WROWS);
                                   });
}

// ---- the attention steps of a batch of sequences in one launch ------------------------------

// f64 attention of the query head `qh` over positions 0 .. len-1 of KV head `kvh` of f16 caches
// (rows of kv_w values): hd values into `out`.
void ref_attention_head(const float* qh, const std::vector<uint16_t>& kc, const std::vector<uint16_t>& vc,
                        int len, int kvh, int kv_w, int hd, double* out) {
    std::vector<double> sc(len);
    double mx = -1e300;
    for (int t = 0; t < len; t++) {
        double s = 0;
        for (int d = 0; d < hd; d++) s += (double)qh[d] * emu_h2f(kc[(size_t)t * kv_w + kvh * hd + d]);
        sc[t] = s / std::sqrt((double)hd);
        mx = std::max(mx, sc[t]);
    }
    double den = 0;
    for (auto& x : sc) den += (x = std::exp(x - mx));
    for (int d = 0; d < hd; d++) {
        double a = 0;
        for (int t = 0; t < len; t++) a += sc[t] * emu_h2f(vc[(size_t)t * kv_w + kvh * hd + d]);
        out[d] = a / den;
    }
}

struct SeqSpec {
    int rows, pos0, capacity;
};

// RoPE + KV stores and decode attention of several sequences through the one-launch kernels,
// against the per-sequence kernels on the same data: the same bits (the same arithmetic).
void test_seq_kernels() {
    const int n_heads = 8, n_kv = 2, hd = 64, half = hd / 2, kv_w = n_kv * hd, q_w = n_heads * hd;
    std::vector<SeqSpec> specs = {{1, 0, 8}, {3, 5, 16}, {1, 200, 260}, {1, 129, 140}, {5, 0, 8}, {1, 17, 32}};
    int total = 0;
    for (auto& sp : specs) total += sp.rows;
    std::vector<float> inv(half);
    for (int i = 0; i < half; i++) inv[i] = (float)std::pow(10000.0, -2.0 * i / hd);
    Buf<float> invd(inv);
    auto q0 = random_vec((size_t)total * q_w, 2.f), k0 = random_vec((size_t)total * kv_w), v0 = random_vec((size_t)total * kv_w);
    // Caches with random earlier positions, the same for both runs.
    std::vector<std::vector<uint16_t>> cache0;
    for (auto& sp : specs)
        for (int kv = 0; kv < 2; kv++) {
            std::vector<uint16_t> c((size_t)sp.capacity * kv_w);
            for (auto& x : c) x = emu_f2h(uniform(-1, 1));
            cache0.push_back(c);
        }
    std::vector<float> q_results[2], k_results[2], att_results[2];
    std::vector<std::vector<uint16_t>> cache_results[2];
    // The one-row decode kernel merges each head in its last chunk (tickets back to 0 after) and
    // quantizes it: the bits of quantize_x16 on its output.
    bool tickets_reset = true, quantized_same = true;
    for (int variant = 0; variant < 2; variant++) {
        Buf<float> q(q0), k(k0), v(v0);
        std::vector<std::unique_ptr<Buf<uint16_t>>> caches;
        for (auto& c : cache0) caches.emplace_back(new Buf<uint16_t>(c));
        SeqTable table{};
        table.n = (int)specs.size();
        int row0 = 0;
        for (size_t z = 0; z < specs.size(); z++) {
            table.k_cache[z] = caches[2 * z]->p;
            table.v_cache[z] = caches[2 * z + 1]->p;
            table.row0[z] = row0;
            table.rows[z] = specs[z].rows;
            table.pos0[z] = specs[z].pos0;
            row0 += specs[z].rows;
        }
        if (variant == 0) {
            for (size_t z = 0; z < specs.size(); z++) {
                int r0 = table.row0[z], rows = specs[z].rows;
                unsigned threads = rows * (n_heads + n_kv) * half;
                emu::launch(grid3((threads + 255) / 256), 256, [&] {
                    rope_store_kv(q.p + (size_t)r0 * q_w, k.p + (size_t)r0 * kv_w, v.p + (size_t)r0 * kv_w, rows,
                                  n_heads, n_kv, hd, specs[z].pos0, nullptr, invd.p, table.k_cache[z], table.v_cache[z],
                                  specs[z].capacity);
                });
            }
        } else {
            unsigned threads = total * (n_heads + n_kv) * half;
            emu::launch(grid3((threads + 255) / 256), 256, [&] {
                rope_store_kv_seqs(q.p, k.p, v.p, total, n_heads, n_kv, hd, invd.p, table);
            });
        }
        // Decode attention of the one-row sequences.
        Buf<float> out((size_t)total * q_w);
        out.poison();
        const int split_len = 128;
        float scale = 1.f / std::sqrt((float)hd);
        if (variant == 0) {
            for (size_t z = 0; z < specs.size(); z++) {
                if (specs[z].rows != 1) continue;
                int n_splits = (specs[z].pos0 + split_len) / split_len;
                Buf<float> part((size_t)n_heads * n_splits * (2 + hd));
                Buf<int> tickets(n_heads);
                for (int h = 0; h < n_heads; h++) tickets.p[h] = 0;
                // The merged head also quantized for the output projection (hd is 64 or 128).
                Buf<short> xq(q_w);
                Buf<float4> xs(q_w / 32);
                float* out_row = out.p + (size_t)table.row0[z] * q_w;
                emu::launch(grid3(n_heads, n_splits), 256, [&] {
                    attention_decode(q.p + (size_t)table.row0[z] * q_w, table.k_cache[z], table.v_cache[z],
                                     specs[z].pos0, nullptr, n_heads, n_kv, hd, scale, specs[z].capacity, /*window=*/0,
                                     split_len, part.p, out_row, tickets.p, xq.p, xs.p);
                });
                for (int h = 0; h < n_heads; h++) tickets_reset &= tickets.p[h] == 0;
                Buf<short> xq_alone(q_w);
                Buf<float4> xs_alone(q_w / 32);
                emu::launch(grid3((q_w / 4 + 255) / 256), 256,
                            [&] { quantize_x16(out_row, (u64)q_w, xq_alone.p, xs_alone.p); });
                quantized_same &= std::memcmp(xq.p, xq_alone.p, sizeof(short) * q_w) == 0 &&
                                  std::memcmp(xs.p, xs_alone.p, sizeof(float4) * (q_w / 32)) == 0;
            }
        } else {
            // Only the one-row sequences, as the host passes them.
            SeqTable ones{};
            int max_splits = 0;
            for (size_t z = 0; z < specs.size(); z++) {
                if (specs[z].rows != 1) continue;
                int i = ones.n++;
                ones.k_cache[i] = table.k_cache[z];
                ones.v_cache[i] = table.v_cache[z];
                ones.row0[i] = table.row0[z];
                ones.rows[i] = 1;
                ones.pos0[i] = specs[z].pos0;
                max_splits = std::max(max_splits, (specs[z].pos0 + split_len) / split_len);
            }
            Buf<float> part((size_t)ones.n * n_heads * max_splits * (2 + hd));
            emu::launch(grid3(n_heads, max_splits, ones.n), 256, [&] {
                attention_decode_seqs(q.p, n_heads, n_kv, hd, scale, split_len, part.p, ones);
            });
            emu::launch(grid3(n_heads, ones.n), 256, [&] {
                attention_combine_seqs(part.p, max_splits, n_heads, hd, split_len, out.p, ones);
            });
        }
        q_results[variant] = q.vec();
        k_results[variant] = k.vec();
        for (auto& c : caches) cache_results[variant].push_back(c->vec());
        // The rows of the one-row sequences only (the others are not computed here).
        for (size_t z = 0; z < specs.size(); z++)
            if (specs[z].rows == 1)
                att_results[variant].insert(att_results[variant].end(), out.p + (size_t)table.row0[z] * q_w,
                                            out.p + (size_t)(table.row0[z] + 1) * q_w);
    }
    auto same = [](const auto& a, const auto& b) { return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0; };
    bool ok = same(q_results[0], q_results[1]) && same(k_results[0], k_results[1]);
    for (size_t i = 0; i < cache_results[0].size(); i++) ok &= same(cache_results[0][i], cache_results[1][i]);
    printf("rope_store_kv_seqs: q, k and every cache the bits of per-sequence rope_store_kv: %s\n", ok ? "yes" : "NO");
    if (!ok) failures++;
    bool att_ok = same(att_results[0], att_results[1]);
    bool finite = true;
    for (float x : att_results[1]) finite &= std::isfinite(x);
    printf("attention_decode_seqs + combine: the bits of the one-row kernel per sequence: %s (all finite: %s)\n",
           att_ok ? "yes" : "NO", finite ? "yes" : "NO");
    if (!att_ok || !finite) failures++;
    printf("attention_decode: tickets back to 0: %s; its quantized output the bits of quantize_x16's: %s\n",
           tickets_reset ? "yes" : "NO", quantized_same ? "yes" : "NO");
    if (!tickets_reset || !quantized_same) failures++;
    // And against an f64 reference, for the one-row sequences.
    std::vector<double> want;
    int row0 = 0;
    for (size_t z = 0; z < specs.size(); z++) {
        const auto& kc = cache_results[1][2 * z];
        const auto& vc = cache_results[1][2 * z + 1];
        if (specs[z].rows == 1) {
            int len = specs[z].pos0 + 1;
            for (int h = 0; h < n_heads; h++) {
                int kvh = h / (n_heads / n_kv);
                const float* qh = q_results[1].data() + ((size_t)row0 * n_heads + h) * hd;
                size_t at = want.size();
                want.resize(at + hd);
                ref_attention_head(qh, kc, vc, len, kvh, kv_w, hd, want.data() + at);
            }
        }
        row0 += specs[z].rows;
    }
    check("attention_decode_seqs vs f64 reference", max_rel(att_results[1], want), 1e-5);
}

// ---- prompt attention on tensor cores ---------------------------------------------------------

// f64 causal attention of `rows` query rows at positions pos0.. over f16 caches.
std::vector<double> ref_attention(const std::vector<float>& q, const std::vector<uint16_t>& kc,
                                  const std::vector<uint16_t>& vc, int rows, int pos0, int n_heads, int n_kv, int hd) {
    int kv_w = n_kv * hd;
    std::vector<double> out((size_t)rows * n_heads * hd);
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < n_heads; h++) {
            int kvh = h / (n_heads / n_kv), len = pos0 + r + 1;
            const float* qh = q.data() + ((size_t)r * n_heads + h) * hd;
            ref_attention_head(qh, kc, vc, len, kvh, kv_w, hd, out.data() + ((size_t)r * n_heads + h) * hd);
        }
    return out;
}

void test_flash_attention() {
    struct Case {
        int hd, n_heads, n_kv, rows, pos0;
    };
    std::vector<Case> cases = {{64, 8, 2, 2, 0},   {64, 8, 2, 17, 5},  {64, 4, 4, 70, 0},
                               {128, 4, 1, 33, 100}, {128, 2, 2, 130, 3}, {64, 9, 3, 64, 31}};
    if (quick) cases.resize(4);
    for (auto& c : cases) {
        int kv_w = c.n_kv * c.hd, ctx = c.pos0 + c.rows;
        auto q = random_vec((size_t)c.rows * c.n_heads * c.hd, 3.f);
        std::vector<uint16_t> kc((size_t)ctx * kv_w), vc((size_t)ctx * kv_w);
        for (auto& x : kc) x = emu_f2h(uniform(-1, 1));
        for (auto& x : vc) x = emu_f2h(uniform(-1, 1));
        Buf<float> qd(q);
        Buf<uint16_t> kd(kc), vd(vc);
        Buf<float> out_flash((size_t)c.rows * c.n_heads * c.hd), out_old((size_t)c.rows * c.n_heads * c.hd);
        float scale = 1.f / std::sqrt((float)c.hd);
        emu::launch(grid3((c.rows + FA_ROWS - 1) / FA_ROWS, c.n_heads), FA_WARPS * 32, [&] {
            if (c.hd == 64) attention_flash_hd64(qd.p, kd.p, vd.p, c.rows, c.pos0, c.n_heads, c.n_kv, scale, out_flash.p);
            else attention_flash_hd128(qd.p, kd.p, vd.p, c.rows, c.pos0, c.n_heads, c.n_kv, scale, out_flash.p);
        });
        emu::launch(grid3(c.rows * c.n_heads), 256, [&] {
            attention(qd.p, kd.p, vd.p, c.pos0, c.n_heads, c.n_kv, c.hd, scale, ctx, /*window=*/0, out_old.p);
        });
        auto want = ref_attention(q, kc, vc, c.rows, c.pos0, c.n_heads, c.n_kv, c.hd);
        std::string what = "flash attention hd=" + std::to_string(c.hd) + " heads " + std::to_string(c.n_heads) + "/" +
                           std::to_string(c.n_kv) + " rows=" + std::to_string(c.rows) + " pos0=" + std::to_string(c.pos0);
        check(what + " vs f64", max_rel(out_flash.vec(), want), 1e-5);
        std::vector<double> old_d(out_old.p, out_old.p + out_old.n);
        check(what + " vs the f32 kernel", max_rel(out_flash.vec(), old_d), 1e-5);
    }
}

// ---- k-quant matvecs: the 32-value-block kernels and the super-block lane kernels ----------

// Dtype codes of kquants.cu (`KQ_*`): the 32-value types q5_0, q5_1, iq4_nl and the
// super-block types q2_k .. q6_k, iq4_xs.
enum { KQ50 = 6, KQ51 = 7, KQ2 = 8, KQ3 = 9, KQ4 = 10, KQ5 = 11, KQ6 = 12, KQNL = 13, KQXS = 14 };
const int KQ_ALL[] = {KQ50, KQ51, KQNL, KQ2, KQ3, KQ4, KQ5, KQ6, KQXS};
const char* kq_name(int d) {
    static const char* names[] = {"q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"};
    return names[d - KQ50];
}
int kq_bytes(int d) {
    static const int bytes[] = {22, 24, 84, 110, 144, 176, 210, 18, 136};
    return bytes[d - KQ50];
}
int kq_len(int d) { return d == KQ50 || d == KQ51 || d == KQNL ? 32 : 256; }
const int IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Random blocks of the dtypes of kquants.cu and their values as weights-format/FORMAT.md
// defines them (written from that text, not from the kernels).
Weights random_kq_weights(int dtype, int m, int k) {
    Weights w;
    int bb = kq_bytes(dtype), len = kq_len(dtype), n_sb = k / len;
    w.bytes.resize((size_t)m * n_sb * bb);
    w.values.resize((size_t)m * k);
    for (auto& b : w.bytes) b = (uint8_t)(rng() & 0xFF);
    auto get16 = [&](size_t at) { return (uint16_t)(w.bytes[at] | (w.bytes[at + 1] << 8)); };
    auto put16 = [&](size_t at, uint16_t h) { w.bytes[at] = h & 0xFF; w.bytes[at + 1] = h >> 8; };
    auto scale16 = [&](float lo, float hi) { return emu_f2h(uniform(lo, hi) * (uniform(0, 1) < 0.5f ? -1 : 1)); };
    for (int i = 0; i < m; i++)
        for (int sb = 0; sb < n_sb; sb++) {
            size_t at = ((size_t)i * n_sb + sb) * bb;
            const uint8_t* blk = &w.bytes[at];
            double* out = &w.values[(size_t)i * k + (size_t)sb * len];
            if (dtype == KQ50 || dtype == KQ51) {
                put16(at, scale16(0.002f, 0.02f));
                if (dtype == KQ51) put16(at + 2, emu_f2h(uniform(-0.1f, 0.1f)));
                double d = emu_h2f(get16(at)), mn = dtype == KQ51 ? emu_h2f(get16(at + 2)) : 0;
                int q0 = dtype == KQ51 ? 8 : 6;
                uint32_t qh = 0;
                for (int b = 0; b < 4; b++) qh |= (uint32_t)blk[q0 - 4 + b] << (8 * b);
                for (int e = 0; e < 32; e++) {
                    int q = (e < 16 ? blk[q0 + e] & 0xF : blk[q0 + e - 16] >> 4) | (((qh >> e) & 1) << 4);
                    out[e] = dtype == KQ51 ? q * d + mn : (q - 16) * d;
                }
            } else if (dtype == KQNL) {
                put16(at, scale16(0.0002f, 0.002f));
                double d = emu_h2f(get16(at));
                for (int e = 0; e < 32; e++)
                    out[e] = d * IQ4_LEVELS[e < 16 ? blk[2 + e] & 0xF : blk[2 + e - 16] >> 4];
            } else if (dtype == KQXS) {
                put16(at, scale16(0.00002f, 0.0001f));
                double d = emu_h2f(get16(at));
                int scales_h = get16(at + 2);
                for (int e = 0; e < 256; e++) {
                    int b = e / 32, j = e % 32;
                    int ls = ((blk[4 + b / 2] >> (4 * (b % 2))) & 0xF) | (((scales_h >> (2 * b)) & 3) << 4);
                    int byte = blk[8 + 16 * b + j % 16];
                    out[e] = d * (ls - 32) * IQ4_LEVELS[j < 16 ? byte & 0xF : byte >> 4];
                }
            } else if (dtype == KQ2) {
                put16(at + 80, scale16(0.002f, 0.01f));
                put16(at + 82, emu_f2h(uniform(0.0005f, 0.004f)));
                double d = emu_h2f(get16(at + 80)), dmin = emu_h2f(get16(at + 82));
                for (int e = 0; e < 256; e++) {
                    int n = e / 128, j = (e % 128) / 32, l = e % 32;
                    int level = (blk[16 + 32 * n + l] >> (2 * j)) & 3;
                    int sc = blk[8 * n + 2 * j + l / 16];
                    out[e] = d * (sc & 0xF) * level - dmin * (sc >> 4);
                }
            } else if (dtype == KQ3) {
                put16(at + 108, scale16(0.0002f, 0.002f));
                double d = emu_h2f(get16(at + 108));
                const uint8_t* scales = blk + 96;
                for (int e = 0; e < 256; e++) {
                    int n = e / 128, j = (e % 128) / 32, l = e % 32;
                    int level = (blk[32 + 32 * n + l] >> (2 * j)) & 3;
                    if (!((blk[l] >> (4 * n + j)) & 1)) level -= 4;
                    int i = 8 * n + 2 * j + l / 16;
                    int low = i < 8 ? scales[i] & 0xF : scales[i - 8] >> 4;
                    int high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
                    out[e] = d * ((low | (high << 4)) - 32) * level;
                }
            } else if (dtype == KQ6) {
                put16(at + 208, emu_f2h(uniform(0.0005f, 0.002f) * (uniform(0, 1) < 0.5f ? -1 : 1)));
                double d = emu_h2f(get16(at + 208));
                for (int e = 0; e < 256; e++) {
                    int n = e / 128, kk = (e % 128) / 32, l = e % 32;
                    int ql = blk[64 * n + 32 * (kk & 1) + l];
                    int low = kk < 2 ? (ql & 0xF) : (ql >> 4);
                    int high = (blk[128 + 32 * n + l] >> (2 * kk)) & 3;
                    int sc = (int8_t)blk[192 + 8 * n + 2 * kk + l / 16];
                    out[e] = d * sc * ((low | (high << 4)) - 32);
                }
            } else {  // q4_k, q5_k
                put16(at, emu_f2h(uniform(0.0005f, 0.002f) * (uniform(0, 1) < 0.5f ? -1 : 1)));
                put16(at + 2, emu_f2h(uniform(0.0005f, 0.004f)));
                double d = emu_h2f(get16(at)), dmin = emu_h2f(get16(at + 2));
                const uint8_t* scales = blk + 4;
                const uint8_t* qs = blk + (dtype == KQ5 ? 48 : 16);
                for (int e = 0; e < 256; e++) {
                    int cc = e / 64, l = e % 64, s = 2 * cc + l / 32;
                    int sc = s < 4 ? scales[s] & 63 : (scales[s + 4] & 0xF) | ((scales[s - 4] >> 6) << 4);
                    int mn = s < 4 ? scales[s + 4] & 63 : (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
                    int byte = qs[32 * cc + l % 32];
                    int level = l < 32 ? (byte & 0xF) : (byte >> 4);
                    if (dtype == KQ5 && ((blk[16 + l % 32] >> s) & 1)) level += 16;
                    out[e] = d * sc * level - dmin * mn;
                }
            }
        }
    return w;
}

using KqKernel = void (*)(const short*, const float4*, int, int, MatmulJobs);
KqKernel kq_kernel(int dtype, bool superblock, bool one_row) {
    static const KqKernel table[3][2][2] = {
        {{matmul_q4_k_r1, matmul_q4_k_r8}, {matmul_sb_q4_k_r1, matmul_sb_q4_k_r8}},
        {{matmul_q5_k_r1, matmul_q5_k_r8}, {matmul_sb_q5_k_r1, matmul_sb_q5_k_r8}},
        {{matmul_q6_k_r1, matmul_q6_k_r8}, {matmul_sb_q6_k_r1, matmul_sb_q6_k_r8}}};
    return table[dtype - KQ4][superblock][one_row ? 0 : 1];
}

// Both kernels of q4_k, q5_k and q6_k against the f64 reference of the format, one and several
// rows, several weights per launch (Q/K/V), += and ragged shapes (a tile's last weight rows, an
// odd number of super-blocks so that half-warps idle); and the super-block kernel's rows equal
// to its one-row results bit for bit (a row's result must not depend on its batch).
void test_kq_matmul() {
    struct Case {
        std::vector<int> ms;
        int k;
    };
    std::vector<Case> cases = {{{5}, 256}, {{77}, 768}, {{9, 4, 13}, 2304}};
    for (int dtype : {KQ4, KQ5, KQ6})
        for (auto& cs : cases) {
            int k = cs.k, n_jobs = (int)cs.ms.size();
            std::vector<Weights> ws;
            std::vector<std::unique_ptr<Buf<uint8_t>>> wd;
            for (int m : cs.ms) {
                ws.push_back(random_kq_weights(dtype, m, k));
                wd.emplace_back(new Buf<uint8_t>(ws.back().bytes));
            }
            std::string ms;
            for (int m : cs.ms) ms += (ms.empty() ? "" : "+") + std::to_string(m);
            for (int rows : {1, 3, 9}) {
                auto x = random_vec((size_t)rows * k);
                Buf<float> xd(x);
                X16Buf x16(xd, (size_t)rows * k);
                int n_blocks = 0;
                for (int m : cs.ms) n_blocks += (m + MM_WROWS - 1) / MM_WROWS;
                std::vector<std::vector<float>> sb_out;
                for (int superblock : {0, 1})
                    for (int accumulate : {0, 1}) {
                        JobOutputs o(wd, cs.ms, rows, accumulate);
                        int per_block = rows == 1 ? 1 : MM_ROWS;
                        KqKernel kernel = kq_kernel(dtype, superblock, rows == 1);
                        emu::launch(grid3(n_blocks, (rows + per_block - 1) / per_block), MM_WARPS * 32,
                                    [&] { kernel(x16.xq.p, x16.xs.p, rows, k, o.jobs); });
                        double err = o.max_err(x, rows, ws, k);
                        if (superblock && !accumulate)
                            for (int j = 0; j < n_jobs; j++) sb_out.push_back(o.outs[j]->vec());
                        // x as 16-bit integers per 32-value block (2^-16 of its largest value),
                        // f32 sums in another order than f64.
                        check(std::string(superblock ? "super-block matmul " : "block matmul ") + kq_name(dtype) +
                                  " [" + ms + "]x" + std::to_string(k) + " rows=" + std::to_string(rows) +
                                  (accumulate ? " +=" : ""),
                              err, 1e-4);
                    }
                // Each row alone through the one-row kernel: the same bits as in the batch.
                if (rows > 1) {
                    size_t mismatches = 0;
                    for (int r = 0; r < rows; r++) {
                        Buf<float> x1(std::vector<float>(x.begin() + (size_t)r * k, x.begin() + (size_t)(r + 1) * k));
                        X16Buf x16r(x1, (size_t)k);
                        for (int j = 0; j < n_jobs; j++) {
                            Buf<float> out1((size_t)cs.ms[j]);
                            MatmulJobs jobs{};
                            jobs.n_jobs = 1;
                            jobs.w[0] = wd[j]->p;
                            jobs.out[0] = out1.p;
                            jobs.m[0] = cs.ms[j];
                            KqKernel kernel = kq_kernel(dtype, true, true);
                            emu::launch(grid3((cs.ms[j] + MM_WROWS - 1) / MM_WROWS), MM_WARPS * 32,
                                        [&] { kernel(x16r.xq.p, x16r.xs.p, 1, k, jobs); });
                            for (int i = 0; i < cs.ms[j]; i++)
                                mismatches += out1.p[i] != sb_out[j][(size_t)r * cs.ms[j] + i];
                        }
                    }
                    printf("%-70s %zu value(s) differ from the one-row kernel %s\n",
                           (std::string("super-block matmul ") + kq_name(dtype) + " [" + ms + "]x" +
                            std::to_string(k) + " rows=" + std::to_string(rows) + " row by row")
                               .c_str(),
                           mismatches, mismatches ? "FAILED" : "ok");
                    if (mismatches) failures++;
                }
            }
        }
}

// The tensor-core matmuls of kquants_mma.cu, every dtype, as `test_mma_matmul` (a partial
// 256-row tile, three weights per launch), blocks of the format's layout.
void test_kq_mma_matmul() {
    struct Case {
        std::vector<int> ms;
        int blocks;  // (super-)blocks per row
    };
    std::vector<Case> cases = {{{1}, 1}, {{77}, 3}, {{130, 40, 7}, 6}};
    for (int dtype : KQ_ALL)
        for (auto& cs : cases) {
            int k = cs.blocks * kq_len(dtype);
            std::vector<Weights> ws;
            for (int m : cs.ms) ws.push_back(random_kq_weights(dtype, m, k));
            // x as 16-bit integers per 32-value block (2^-16 of its largest value), exact integer
            // sums of the levels, f32 sums in another order than f64: the one-row kernels' tol.
            check_mma_case(dtype, kq_name(dtype), cs.ms, k, ws, 1e-4);
        }
}

// The same for kquants_mma.cu's kernels, every dtype (the one-row kernels `matmul_<dtype>_r1`).
void test_kq_mma_rows_independent() {
    using Kernel1 = void (*)(const short*, const float4*, int, int, MatmulJobs);
    static const Kernel1 one_row[9] = {matmul_q5_0_r1, matmul_q5_1_r1, matmul_q2_k_r1,
                                       matmul_q3_k_r1, matmul_q4_k_r1, matmul_q5_k_r1,
                                       matmul_q6_k_r1, matmul_iq4_nl_r1, matmul_iq4_xs_r1};
    int m = 300, k = 1024;
    for (int dtype : KQ_ALL)
        check_mma_rows_independent(dtype, kq_name(dtype), random_kq_weights(dtype, m, k), m, k,
                                   [&](const Buf<float>&, const X16Buf& x16, MatmulJobs jobs) {
                                       emu::launch(grid3((m + MM_WROWS - 1) / MM_WROWS), MM_WARPS * 32, [&] {
                                           one_row[dtype - KQ50](x16.xq.p, x16.xs.p, 1, k, jobs);
                                       });
                                   });
}

}  // namespace

// The prompt path's conversion of q4_k / q5_k / q6_k weights to f16 for cuBLAS: the per-block
// kernel against the format's f64 values (one f16 rounding) and the bits of the eight-values-per-
// thread kernel it replaced.
void test_kq_dequant() {
    for (int dtype : {KQ4, KQ5, KQ6}) {
        int m = 7, k = 768;
        Weights w = random_kq_weights(dtype, m, k);
        Buf<uint8_t> wd(w.bytes);
        u64 n_blocks = (u64)m * k / 32;
        Buf<uint16_t> per_block((size_t)m * k), per8((size_t)m * k);
        emu::launch(grid3((unsigned)((n_blocks + 255) / 256)), 256,
                    [&] { kq_dequant_f16(wd.p, dtype, n_blocks, per_block.p); });
        emu::launch(grid3((unsigned)((n_blocks * 4 + 255) / 256)), 256,
                    [&] { dequant_f16(wd.p, dtype, n_blocks, per8.p); });
        std::vector<float> got((size_t)m * k);
        for (size_t i = 0; i < got.size(); i++) got[i] = emu_h2f(per_block.p[i]);
        check(std::string("kq_dequant_f16 ") + kq_name(dtype) + " vs the format's values", max_rel(got, w.values),
              1e-3);
        bool same = std::memcmp(per_block.p, per8.p, sizeof(uint16_t) * m * k) == 0;
        printf("kq_dequant_f16 %s: the bits of dequant_f16: %s\n", kq_name(dtype), same ? "yes" : "NO");
        if (!same) failures++;
    }
}

// The same for q8_0, q4_0 and q4_1 (dtype codes 3, 4, 5): `dequant_blocks_f16` against the bits of
// `dequant_f16`, random blocks with finite f16 scales and offsets.
void test_block_dequant() {
    const int block_bytes[3] = {34, 18, 20};
    for (int dtype = 3; dtype <= 5; dtype++) {
        int bb = block_bytes[dtype - 3];
        u64 n_blocks = 7 * 24;
        std::vector<uint8_t> bytes(n_blocks * bb);
        for (auto& b : bytes) b = (uint8_t)(rng() & 0xFF);
        for (u64 i = 0; i < n_blocks; i++) {
            uint16_t d = emu_f2h(uniform(-0.01f, 0.01f)), m = emu_f2h(uniform(-0.05f, 0.05f));
            bytes[i * bb] = d & 0xFF;
            bytes[i * bb + 1] = d >> 8;
            if (dtype == 5) {
                bytes[i * bb + 2] = m & 0xFF;
                bytes[i * bb + 3] = m >> 8;
            }
        }
        Buf<uint8_t> wd(bytes);
        Buf<uint16_t> per_block(n_blocks * 32), per8(n_blocks * 32);
        emu::launch(grid3((unsigned)((n_blocks + 255) / 256)), 256,
                    [&] { dequant_blocks_f16(wd.p, dtype, n_blocks, per_block.p); });
        emu::launch(grid3((unsigned)((n_blocks * 4 + 255) / 256)), 256,
                    [&] { dequant_f16(wd.p, dtype, n_blocks, per8.p); });
        bool same = std::memcmp(per_block.p, per8.p, sizeof(uint16_t) * n_blocks * 32) == 0;
        printf("dequant_blocks_f16 dtype %d: the bits of dequant_f16: %s\n", dtype, same ? "yes" : "NO");
        if (!same) failures++;
    }
}

// `write_columns_f32` (a split matmul's share put into its columns, all rows in one launch) against
// a plain loop: written and added, at the left edge, inside and at the right edge of the rows,
// ragged widths; the columns outside the share keep their values, bit for bit.
void test_write_columns() {
    struct Case { int rows, src_cols, dst_cols, col0; };
    const Case cases[] = {{1, 32, 96, 0}, {8, 64, 160, 96}, {5, 37, 101, 30}, {32, 96, 200, 0}, {3, 1, 7, 6}};
    for (const Case& cs : cases) {
        for (int add = 0; add <= 1; add++) {
            size_t n = (size_t)cs.rows * cs.src_cols, total = (size_t)cs.rows * cs.dst_cols;
            std::vector<float> src = random_vec(n), before = random_vec(total);
            Buf<float> s(src), d(before);
            emu::launch(grid3((unsigned)((n + 255) / 256)), 256, [&] {
                write_columns_f32(s.p, (u64)cs.src_cols, d.p, (u64)cs.dst_cols, (u64)cs.col0, (u64)n, add);
            });
            std::vector<float> want = before;
            for (int r = 0; r < cs.rows; r++)
                for (int c = 0; c < cs.src_cols; c++) {
                    float& o = want[(size_t)r * cs.dst_cols + cs.col0 + c];
                    float v = src[(size_t)r * cs.src_cols + c];
                    o = add ? o + v : v;
                }
            bool same = std::memcmp(d.p, want.data(), total * sizeof(float)) == 0;
            printf("write_columns_f32 %s %d rows, %d of %d columns from %d: the loop's bits: %s\n",
                   add ? "add" : "write", cs.rows, cs.src_cols, cs.dst_cols, cs.col0, same ? "yes" : "NO");
            if (!same) failures++;
        }
    }
}

// `argmax_rows` (greedy sampling on the device) against a plain loop with the host's order (the
// largest in `f32::total_cmp`'s order, the lowest index among equal ones): random rows, ties
// spread over threads and warps, ±0, ±inf, NaNs of either sign (the all-ones NaN is the smallest
// key there is), ragged and tiny widths, and no columns at all (0, as the host gives).
void test_argmax_rows() {
    auto key = [](float v) {
        int32_t bits;
        memcpy(&bits, &v, 4);
        return bits ^ (int32_t)((uint32_t)(bits >> 31) >> 1);
    };
    auto nan_bits = [](uint32_t b) { float f; memcpy(&f, &b, 4); return f; };
    struct Case { const char* what; int cols; };
    const Case cases[] = {{"random", 49152}, {"ragged", 1000}, {"one", 1}, {"narrower than a warp", 7},
                          {"ties across warps", 5000}, {"signed zeros", 3000}, {"NaNs", 4097},
                          {"all the smallest NaN", 2500}, {"infinities", 1500}, {"empty", 0}};
    for (const Case& cs : cases) {
        const int rows = 3;
        std::vector<float> x = random_vec((size_t)rows * cs.cols, 10.f);
        std::string what = cs.what;
        for (int r = 0; r < rows && cs.cols > 0; r++) {
            float* row = x.data() + (size_t)r * cs.cols;
            int n = cs.cols;
            if (what == "ties across warps") {
                for (int i : {n - 1, 1500 + r, 40 + 1024 * r}) row[i % n] = 20.f;
            } else if (what == "signed zeros") {
                for (int i = 0; i < n; i++) row[i] = -std::fabs(row[i]) - 1.f;
                row[(7 * r + 900) % n] = -0.f;
                row[(11 * r + 2000) % n] = 0.f;  // +0 is larger than -0 in that order
                row[(13 * r + 100) % n] = -0.f;
            } else if (what == "NaNs") {
                row[(r * 977 + 3) % n] = nan_bits(0x7fc00000u);   // the largest key
                row[(r * 131 + 4000) % n] = nan_bits(0xffc00000u); // a negative NaN: below every number
                row[(r * 57 + 1) % n] = INFINITY;
            } else if (what == "all the smallest NaN") {
                for (int i = 0; i < n; i++) row[i] = nan_bits(0xffffffffu);
            } else if (what == "infinities") {
                for (int i = 0; i < n; i++) row[i] = -INFINITY;
                row[(r * 300 + 700) % n] = INFINITY;
                row[(r * 300 + 1200) % n] = INFINITY;
            }
        }
        std::vector<uint32_t> want(rows, 0);
        for (int r = 0; r < rows; r++) {
            const float* row = x.data() + (size_t)r * cs.cols;
            for (int i = 1; i < cs.cols; i++)
                if (key(row[i]) > key(row[want[r]])) want[r] = i;
        }
        Buf<float> xb(x);
        Buf<uint32_t> out((size_t)rows);
        emu::launch(grid3((unsigned)rows), ARGMAX_THREADS, [&] { argmax_rows(xb.p, (u64)cs.cols, out.p); });
        bool same = std::memcmp(out.p, want.data(), rows * sizeof(uint32_t)) == 0;
        printf("argmax_rows %s (%d columns): the host order's ids %u %u %u: %s\n", cs.what, cs.cols, want[0],
               want[1], want[2], same ? "yes" : "NO");
        if (!same) failures++;
    }
}

int main(int argc, char** argv) {
    for (int i = 1; i < argc; i++)
        if (std::string(argv[i]) == "--quick") quick = true;
    test_existing_matmul();
    test_mma_matmul();
    test_mma_rows_independent();
    test_seq_kernels();
    test_flash_attention();
    test_kq_matmul();
    test_kq_mma_matmul();
    test_kq_mma_rows_independent();
    test_kq_dequant();
    test_block_dequant();
    test_write_columns();
    test_argmax_rows();
    if (failures) {
        printf("%d check(s) FAILED\n", failures);
        return 1;
    }
    printf("all emulated kernel checks passed\n");
    return 0;
}
