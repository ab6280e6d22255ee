// Tier-2 op tests (docs/style R7): every CUDA op (src/backend/cuda) against its CPU twin
// (backend/cpu/ops.h) on fresh random inputs, in the shape of ggml's test-backend-ops, scaled down.
//
//   test-backend-ops [test|perf] [-o OP[,OP...]] [-p REGEX] [--json FILE] [--seed N]
//     test (default): every case once, outputs poisoned with NaN before the run, compared with the
//                     CPU by normalised MSE (NaN or inf never passes); one table row per case.
//     perf:           large shapes, timed with CUDA events (L2 flushed before each run), median of
//                     the runs, GB/s against the H200's ~4.3 TB/s HBM; --json writes one row per case.
//     -p REGEX:       only the cases whose parameter string (VARS) the regex finds (std::regex_search).
//   Exit: 0 all passed, 1 a case failed, 2 bad arguments, 77 no CUDA device (CTest SKIP_RETURN_CODE).
//
// Thresholds (normalised MSE = sum (got - ref)^2 / sum ref^2, per case):
// - kExact 1e-8: both sides compute the same F32 arithmetic in a different order (F32 accumulation of
//   up to 4096 terms: NMSE ~1e-11); dropping a single weight of 4096 already gives ~2e-4.
// - kTight 1e-11: norms, softmax, elementwise ops, combine, router weights (a few ulp per element,
//   NMSE ~1e-14); a relative error of 1e-5 in a norm's scale already gives 1e-10.
// - Block-quantized weights (Q8_0, K-quants, ...) under ActivationQuant::INT8 (the default): both sides
//   multiply the same dequantized weights and the same activations quantized to the vec-dot type and
//   back (the CPU as integers), so the GEMV is kExact too (NMSE ~1e-14; ~1e-9 for Q4_1 / Q5_1, whose Q8_1
//   activation blocks carry their sum as F16 for the CPU's min term); quantize_activations is exact.
// - cuBLAS path, activations rounded to BF16 (relative error <= 2^-9, NMSE ~1.3e-6): 1e-5; block-quantized
//   weights, which are rounded to BF16 as well: 2e-5; F16 activations (2^-12): 2e-7.
// - rope 1e-7: a 1-ulp difference of powf for one frequency moves angles near 5000 rad by ~3e-4.
// - get_rows: exact (dequantization is exact in F32 on both sides); router ids: exact.
//
// defines: helpers (Rng, DevBuf, nmse) | Case and one struct per op family | case lists | main
#include "../common/random-blocks.h"
#include "backend/cpu/ops.h"
#include "backend/cuda/attention.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/convert.cuh"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/matmul.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/rope.cuh"
#include "backend/cuda/softmax.cuh"
#include "core/dtype.h"

#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <regex>
#include <string>
#include <utility>
#include <vector>

using namespace prescope;
namespace cu = prescope::cuda;

namespace {

constexpr int kSkipCode = 77;
constexpr double kHbmGBs = 4300.0;  // H200 device-to-device copy, ../shared/design/reference-numbers.md
constexpr double kExact = 1e-8;
constexpr double kTight = 1e-11;  // row and elementwise ops: a few ulp per element, no long sums

cudaStream_t g_stream = nullptr;

// ---------------------------------------------------------------------------------------------
// helpers

/// xoshiro128+ : fast, reproducible uniform floats.
class Rng {
  public:
    explicit Rng(uint64_t seed) {
        for (uint32_t &w : s_) {
            seed += 0x9e3779b97f4a7c15ull;
            uint64_t z = seed;
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
            w = uint32_t(z ^ (z >> 31)) | 1u;
        }
    }
    uint32_t next() {
        const uint32_t r = s_[0] + s_[3], t = s_[1] << 9;
        s_[2] ^= s_[0], s_[3] ^= s_[1], s_[1] ^= s_[2], s_[0] ^= s_[3], s_[2] ^= t;
        s_[3] = (s_[3] << 11) | (s_[3] >> 21);
        return r;
    }
    float uniform(float lo = -1.0f, float hi = 1.0f) { return lo + (hi - lo) * float(next() >> 8) * 0x1p-24f; }
    int below(int n) { return int(uint64_t(next()) * uint64_t(n) >> 32); }
    std::vector<float> floats(size_t n, float lo = -1.0f, float hi = 1.0f) {
        std::vector<float> v(n);
        for (float &x : v) x = uniform(lo, hi);
        return v;
    }

  private:
    uint32_t s_[4];
};

/// Device memory owned by a test case; copies run on g_stream.
class DevBuf {
  public:
    DevBuf() = default;
    explicit DevBuf(size_t bytes) : bytes_(bytes) { CUDA_CHECK(cudaMalloc(&ptr_, bytes ? bytes : 1)); }
    template <class T> explicit DevBuf(const std::vector<T> &v) : DevBuf(v.size() * sizeof(T)) { upload(v.data()); }
    DevBuf(DevBuf &&o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(o.bytes_) {}
    DevBuf &operator=(DevBuf &&o) noexcept {
        std::swap(ptr_, o.ptr_);
        std::swap(bytes_, o.bytes_);
        return *this;
    }
    ~DevBuf() {
        if (ptr_ != nullptr) cudaFree(ptr_);
    }
    template <class T = void> T *as() const { return static_cast<T *>(ptr_); }
    uint8_t *bytes_ptr() const { return static_cast<uint8_t *>(ptr_); }
    size_t size() const { return bytes_; }
    void upload(const void *src) { CUDA_CHECK(cudaMemcpyAsync(ptr_, src, bytes_, cudaMemcpyHostToDevice, g_stream)); }
    /// All bytes 0xff: NaN as F32, -1 as int32.
    void poison() { CUDA_CHECK(cudaMemsetAsync(ptr_, 0xff, bytes_, g_stream)); }
    template <class T> std::vector<T> download() const {
        std::vector<T> v(bytes_ / sizeof(T));
        CUDA_CHECK(cudaMemcpyAsync(v.data(), ptr_, v.size() * sizeof(T), cudaMemcpyDeviceToHost, g_stream));
        CUDA_CHECK(cudaStreamSynchronize(g_stream));
        return v;
    }
    cu::Workspace workspace() const { return {ptr_, bytes_}; }

  private:
    void *ptr_ = nullptr;
    size_t bytes_ = 0;
};

/// Result of one comparison: err against tol; NaN/inf in the output or a NaN error fails.
struct Check {
    std::string what;
    double err = 0.0;
    double tol = 0.0;
    bool ok = false;
};

Check nmse(const std::string &what, const std::vector<float> &got, const std::vector<float> &ref, double tol) {
    Check c{what, 0.0, tol, false};
    if (got.size() != ref.size()) {
        c.err = INFINITY;
        return c;
    }
    double num = 0.0, den = 0.0;
    bool finite = true;
    for (size_t i = 0; i < got.size(); ++i) {
        finite &= std::isfinite(got[i]);
        const double d = double(got[i]) - double(ref[i]);
        num += d * d;
        den += double(ref[i]) * double(ref[i]);
    }
    c.err = finite ? num / std::max(den, 1e-30) : NAN;
    c.ok = finite && c.err <= tol;
    return c;
}

/// Exact equality; err = number of differing elements.
template <class T> Check exact(const std::string &what, const std::vector<T> &got, const std::vector<T> &ref) {
    Check c{what, 0.0, 0.0, false};
    if (got.size() != ref.size()) {
        c.err = INFINITY;
        return c;
    }
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) bad += std::memcmp(&got[i], &ref[i], sizeof(T)) != 0;
    c.err = double(bad);
    c.ok = bad == 0;
    return c;
}

/// printf into a std::string (case descriptions).
template <class... A> std::string strf(const char *f, A... a) {
    char buf[256];
    std::snprintf(buf, sizeof buf, f, a...);
    return buf;
}

const char *path_name(cu::MatmulPath p) {
    return p == cu::MatmulPath::GEMV ? "gemv" : p == cu::MatmulPath::CUBLAS ? "cublas" : "auto";
}

/// n_rows x n weights of `type` from uniform F32 values (Q8_0 through ggml's reference quantizer; the
/// other block types as random blocks, tests/common/random-blocks.h).
std::vector<uint8_t> make_weights(DType type, int64_t n_rows, int64_t n, Rng &rng) {
    if (type != DType::Q8_0 && type != DType::F32 && type != DType::F16 && type != DType::BF16)
        return test::random_weights(type, n_rows, n, rng.next());
    std::vector<uint8_t> out(cu::row_bytes(type, n) * size_t(n_rows));
    const std::vector<float> f = rng.floats(size_t(n_rows * n));
    for (int64_t r = 0; r < n_rows; ++r) {
        const float *src = f.data() + r * n;
        uint8_t *dst = out.data() + size_t(r) * cu::row_bytes(type, n);
        switch (type) {
        case DType::F32: std::memcpy(dst, src, size_t(n) * 4); break;
        case DType::F16:
            for (int64_t i = 0; i < n; ++i) reinterpret_cast<uint16_t *>(dst)[i] = fp32_to_fp16(src[i]);
            break;
        case DType::BF16:
            for (int64_t i = 0; i < n; ++i) reinterpret_cast<uint16_t *>(dst)[i] = fp32_to_bf16(src[i]);
            break;
        default: quantize_row_q8_0(src, reinterpret_cast<BlockQ8_0 *>(dst), n); break;
        }
    }
    return out;
}

/// Tolerance of a product on `path` (resolved: GEMV or CUBLAS) for weights of `type`.
double matmul_tol(DType type, cu::MatmulPath path) {
    if (path == cu::MatmulPath::GEMV || type == DType::F32) return kExact;
    return type == DType::F16 ? 2e-7 : type == DType::BF16 ? 1e-5 : 2e-5;
}

/// Block-quantized weight types other than Q8_0 (the ones this harness makes as random blocks).
constexpr DType kBlockTypes[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K,
                                 DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS, DType::MXFP4};

/// The path a product of n_tok tokens takes (AUTO resolved as the library does, env override included).
cu::MatmulPath resolved_path(DType type, int64_t n_tok, cu::MatmulPath path) {
    if (path == cu::MatmulPath::AUTO) {
        const char *env = std::getenv("PRESCOPE_CUDA_MATMUL");
        if (env != nullptr && std::strcmp(env, "gemv") == 0) return cu::MatmulPath::GEMV;
        if (env != nullptr && std::strcmp(env, "cublas") == 0) return cu::MatmulPath::CUBLAS;
        return n_tok <= cu::matmul_gemv_max_tokens(type) ? cu::MatmulPath::GEMV : cu::MatmulPath::CUBLAS;
    }
    return path;
}

// ---------------------------------------------------------------------------------------------
// cases

/// One op on one set of parameters. The harness calls init, then (test mode) reference, poison, run,
/// compare; (perf mode) run repeatedly.
struct Case {
    virtual ~Case() = default;
    virtual std::string op() const = 0;
    virtual std::string vars() const = 0;
    virtual void init(Rng &rng) = 0;          // host inputs and their device copies
    virtual void reference() = 0;              // CPU outputs
    virtual void poison() = 0;                 // device outputs <- NaN (in-place ops: inputs re-uploaded)
    virtual void run() = 0;                    // the CUDA op(s) on g_stream
    virtual std::vector<Check> compare() = 0;  // device outputs against the CPU's
    virtual double bytes() const = 0;          // least HBM traffic of one run (perf)
    virtual double flops() const { return 0.0; }
    /// How activations meet quantized weights while the case runs (the harness sets it around the case).
    virtual ActivationQuant activations() const { return ActivationQuant::INT8; }
};

struct MatmulCase : Case {
    DType type;
    int64_t n_in, n_out, n_tok;
    cu::MatmulPath path;
    size_t misalign;  // weights start this many bytes after a 256-byte boundary (block types: even, MXFP4: any)
    ActivationQuant act;
    std::vector<uint8_t> w;
    std::vector<float> x, y_ref;
    DevBuf dw, dx, dy, ws;

    MatmulCase(DType t, int64_t ni, int64_t no, int64_t nt, cu::MatmulPath p = cu::MatmulPath::AUTO, size_t mis = 0,
               ActivationQuant a = ActivationQuant::INT8)
        : type(t), n_in(ni), n_out(no), n_tok(nt), path(p), misalign(mis), act(a) {}
    std::string op() const override { return "matmul"; }
    std::string vars() const override {
        return strf("type=%s,n_in=%lld,n_out=%lld,n_tok=%lld,path=%s%s%s", dtype_name(type), (long long)n_in,
                    (long long)n_out, (long long)n_tok, path_name(path), misalign ? ",misaligned" : "",
                    act == ActivationQuant::NONE ? ",f32-activations" : "");
    }
    ActivationQuant activations() const override { return act; }
    void init(Rng &rng) override {
        w = make_weights(type, n_out, n_in, rng);
        x = rng.floats(size_t(n_tok * n_in));
        dw = DevBuf(w.size() + misalign + 16);  // misaligned rows are read in whole 16-byte granules
        CUDA_CHECK(cudaMemcpyAsync(dw.bytes_ptr() + misalign, w.data(), w.size(), cudaMemcpyHostToDevice, g_stream));
        dx = DevBuf(x);
        dy = DevBuf(size_t(n_tok * n_out) * 4);
        ws = DevBuf(cu::matmul_workspace_bytes(type, n_in, n_out, n_tok, path));
    }
    void reference() override {
        y_ref.resize(size_t(n_tok * n_out));
        cpu::matmul(type, w.data(), n_in, n_out, x.data(), n_tok, y_ref.data());
    }
    void poison() override { dy.poison(); }
    void run() override {
        cu::matmul(type, dw.bytes_ptr() + misalign, n_in, n_out, dx.as<float>(), n_tok, dy.as<float>(), ws.workspace(),
                   g_stream, path);
    }
    std::vector<Check> compare() override {
        return {nmse("y", dy.download<float>(), y_ref, matmul_tol(type, resolved_path(type, n_tok, path)))};
    }
    double bytes() const override { return double(w.size() + x.size() * 4 + size_t(n_tok * n_out) * 4); }
    double flops() const override { return 2.0 * double(n_in) * double(n_out) * double(n_tok); }
};

/// matmul_parts: q, k and v style matrices of different heights over the same activations in one call. Each
/// part against cpu::matmul, and bit for bit against cu::matmul of that part alone (the claim of matmul.cuh).
/// With a residual part (index res >= 0): that part's y starts as random values and receives their sum with the
/// product in place (the attention output projection onto the residual stream), against the part alone plus the
/// host's one F32 addition: bit for bit on the GEMV path, within kTight on cuBLAS's (its beta = 1 epilogue).
/// With `norm` (decision 0149): x is the row before an RMSNorm the products apply themselves, against the CPU's
/// rms_norm then matmul, and bit for bit against cu::rms_norm then each part alone.
struct MatmulPartsCase : Case {
    DType type;
    int64_t n_in, n_tok;
    std::vector<int64_t> n_out;
    cu::MatmulPath path;
    int res;
    bool norm;
    std::vector<std::vector<uint8_t>> w;
    std::vector<float> x, y0, norm_w;
    std::vector<std::vector<float>> y_ref;
    std::vector<DevBuf> dw, dy, dy_alone;
    DevBuf dx, ws, dnorm, dh;

    MatmulPartsCase(DType t, int64_t ni, std::vector<int64_t> no, int64_t nt, cu::MatmulPath p = cu::MatmulPath::AUTO,
                    int r = -1, bool nm = false)
        : type(t), n_in(ni), n_tok(nt), n_out(std::move(no)), path(p), res(r), norm(nm) {}
    std::string op() const override { return "matmul_parts"; }
    std::string vars() const override {
        std::string outs;
        for (int64_t o : n_out) outs += strf(outs.empty() ? "%lld" : "/%lld", (long long)o);
        return strf("type=%s,n_in=%lld,n_out=%s,n_tok=%lld,path=%s%s", dtype_name(type), (long long)n_in, outs.c_str(),
                    (long long)n_tok, path_name(path), res >= 0 ? strf(",residual=%d", res).c_str() : "") +
               (norm ? ",norm" : "");
    }
    void init(Rng &rng) override {
        size_t ws_bytes = 0;
        w.clear(), dw.clear(), dy.clear(), dy_alone.clear();
        for (int64_t o : n_out) {
            w.push_back(make_weights(type, o, n_in, rng));
            dw.emplace_back(w.back());
            dy.emplace_back(size_t(n_tok * o) * 4);
            dy_alone.emplace_back(size_t(n_tok * o) * 4);
            ws_bytes = std::max(ws_bytes, cu::matmul_workspace_bytes(type, n_in, o, n_tok, path));
        }
        x = rng.floats(size_t(n_tok * n_in));
        dx = DevBuf(x);
        ws = DevBuf(ws_bytes);
        if (res >= 0) y0 = rng.floats(size_t(n_tok * n_out[size_t(res)]), -4.0f, 4.0f);
        if (norm) {
            norm_w = rng.floats(size_t(n_in), 0.5f, 1.5f);
            dnorm = DevBuf(norm_w);
            dh = DevBuf(x.size() * 4);
        }
    }
    void reference() override {
        y_ref.assign(n_out.size(), {});
        std::vector<float> h = x;
        if (norm) cpu::rms_norm(x.data(), norm_w.data(), n_tok, n_in, 1e-6f, h.data());
        for (size_t z = 0; z < n_out.size(); ++z) {
            y_ref[z].resize(size_t(n_tok * n_out[z]));
            cpu::matmul(type, w[z].data(), n_in, n_out[z], h.data(), n_tok, y_ref[z].data());
            if (int(z) == res) {
                for (size_t i = 0; i < y0.size(); ++i) y_ref[z][i] = y0[i] + y_ref[z][i];
            }
        }
    }
    void poison() override {
        for (size_t z = 0; z < dy.size(); ++z) int(z) == res ? dy[z].upload(y0.data()) : dy[z].poison();
    }
    void run() override {
        std::vector<cu::MatmulPart> parts;
        for (size_t z = 0; z < n_out.size(); ++z) {
            float *y = dy[z].as<float>();
            parts.push_back({type, dw[z].bytes_ptr(), n_out[z], y, int(z) == res ? y : nullptr});
        }
        const cu::RowNorm rn{dnorm.as<float>(), 1e-6f};
        cu::matmul_parts(parts, n_in, dx.as<float>(), n_tok, ws.workspace(), g_stream, path, norm ? &rn : nullptr);
    }
    std::vector<Check> compare() override {
        std::vector<Check> c;
        const float *xin = dx.as<float>();
        if (norm) {
            cu::rms_norm(dx.as<float>(), dnorm.as<float>(), n_tok, n_in, 1e-6f, dh.as<float>(), g_stream);
            xin = dh.as<float>();
        }
        for (size_t z = 0; z < n_out.size(); ++z) {
            const std::vector<float> got = dy[z].download<float>();
            c.push_back(nmse(strf("y%zu", z), got, y_ref[z], matmul_tol(type, resolved_path(type, n_tok, path))));
            cu::matmul(type, dw[z].bytes_ptr(), n_in, n_out[z], xin, n_tok, dy_alone[z].as<float>(), ws.workspace(),
                       g_stream, path);
            std::vector<float> alone = dy_alone[z].download<float>();
            if (int(z) == res) {
                for (size_t i = 0; i < alone.size(); ++i) alone[i] = y0[i] + alone[i];
                if (resolved_path(type, n_tok, path) == cu::MatmulPath::CUBLAS) {  // cuBLAS's beta = 1 epilogue
                    c.push_back(nmse(strf("y%zu=alone+residual", z), got, alone, kTight));
                    continue;
                }
            }
            c.push_back(exact(strf("y%zu=alone", z), got, alone));
        }
        return c;
    }
    double bytes() const override {
        double b = double(x.size() * 4);
        for (size_t z = 0; z < w.size(); ++z) b += double(w[z].size() + size_t(n_tok * n_out[z]) * 4);
        return b;
    }
    double flops() const override {
        double f = 0;
        for (int64_t o : n_out) f += 2.0 * double(n_in) * double(o) * double(n_tok);
        return f;
    }
};

/// Routing of n_tok tokens to k of n_expert experts, as the pair lists expert_matmul consumes.
struct PairLists {
    std::vector<int32_t> active;    // expert id of each group, in group order
    std::vector<int32_t> offsets;   // [n_active + 1]
    std::vector<int32_t> rows;      // [n_pairs] token of each pair
    std::vector<int32_t> pair_of;   // [n_tok][k] pair index of each (token, slot)

    /// ids: [n_tok][k]. Experts in ascending id; with keep_empty, n_empty extra experts with no pairs.
    static PairLists build(const std::vector<int32_t> &ids, int64_t n_tok, int64_t k, int64_t n_expert,
                           int64_t n_empty) {
        PairLists p;
        std::vector<std::vector<std::pair<int32_t, int32_t>>> by(static_cast<size_t>(n_expert));  // (token, slot)
        for (int64_t t = 0; t < n_tok; ++t)
            for (int64_t j = 0; j < k; ++j) by[size_t(ids[size_t(t * k + j)])].push_back({int32_t(t), int32_t(j)});
        p.pair_of.assign(size_t(n_tok * k), -1);
        p.offsets.push_back(0);
        for (int64_t e = 0; e < n_expert; ++e) {
            if (by[size_t(e)].empty()) {
                if (n_empty <= 0) continue;
                --n_empty;
            }
            p.active.push_back(int32_t(e));
            for (auto [t, j] : by[size_t(e)]) {
                p.pair_of[size_t(t * k + j)] = int32_t(p.rows.size());
                p.rows.push_back(t);
            }
            p.offsets.push_back(int32_t(p.rows.size()));
        }
        return p;
    }
};

/// k distinct random experts per token; with skew, expert 0 is in every token's list.
std::vector<int32_t> random_routing(int64_t n_tok, int64_t k, int64_t n_expert, bool skew, Rng &rng) {
    std::vector<int32_t> ids(size_t(n_tok * k));
    std::vector<int32_t> perm(static_cast<size_t>(n_expert));
    for (int64_t t = 0; t < n_tok; ++t) {
        std::iota(perm.begin(), perm.end(), 0);
        for (int64_t j = 0; j < k; ++j) {
            std::swap(perm[size_t(j)], perm[size_t(j + rng.below(int(n_expert - j)))]);
            if (skew && j == 0) std::swap(perm[0], *std::find(perm.begin(), perm.end(), 0));
        }
        std::copy(perm.begin(), perm.begin() + k, ids.begin() + t * k);
    }
    return ids;
}

/// Expert weights of one projection in "GPU slots": one device buffer, matrices at a fixed stride.
struct ExpertSlots {
    std::vector<std::vector<uint8_t>> host;  // [n_active] matrices
    DevBuf buf, ptrs_dev;
    std::vector<const void *> ptrs;

    void init(DType type, int64_t n_in, int64_t n_out, size_t n_active, size_t misalign, Rng &rng) {
        const size_t mb = cu::row_bytes(type, n_in) * size_t(n_out), stride = cu::align_256(mb) + 256;
        host.clear();
        for (size_t e = 0; e < n_active; ++e) host.push_back(make_weights(type, n_out, n_in, rng));
        buf = DevBuf(stride * std::max<size_t>(n_active, 1));
        ptrs.clear();
        for (size_t e = 0; e < n_active; ++e) {
            uint8_t *dst = buf.bytes_ptr() + e * stride + misalign;
            CUDA_CHECK(cudaMemcpyAsync(dst, host[e].data(), mb, cudaMemcpyHostToDevice, g_stream));
            ptrs.push_back(dst);
        }
        ptrs_dev = DevBuf(ptrs);
    }
    cu::ExpertMatmul group(DType type, int64_t n_in, int64_t n_out, const PairLists &p, const DevBuf &offsets_dev,
                           const DevBuf *rows_dev) const {
        cu::ExpertMatmul g;
        g.type = type, g.n_in = n_in, g.n_out = n_out, g.n_expert = int32_t(p.active.size());
        g.w_dev = ptrs_dev.as<const void *const>(), g.w_host = ptrs.data();
        g.offsets_dev = offsets_dev.as<const int32_t>(), g.offsets_host = p.offsets.data();
        g.rows_dev = rows_dev != nullptr ? rows_dev->as<const int32_t>() : nullptr;
        return g;
    }
};

/// CPU reference of a grouped product: y[p] = W_e x[row of p].
void expert_matmul_ref(DType type, int64_t n_in, int64_t n_out, const ExpertSlots &slots, const PairLists &p,
                       const float *x, bool gather, std::vector<float> &y) {
    y.assign(p.rows.size() * size_t(n_out), 0.0f);
    std::vector<float> xg;
    for (size_t g = 0; g + 1 < p.offsets.size(); ++g) {
        const int64_t p0 = p.offsets[g], n = p.offsets[g + 1] - p0;
        if (n == 0) continue;
        xg.resize(size_t(n * n_in));
        for (int64_t i = 0; i < n; ++i) {
            const int64_t src = gather ? p.rows[size_t(p0 + i)] : p0 + i;
            std::copy_n(x + src * n_in, n_in, xg.begin() + i * n_in);
        }
        cpu::matmul(type, slots.host[g].data(), n_in, n_out, xg.data(), n, y.data() + p0 * n_out);
    }
}

/// Loosest tolerance over the experts' paths in one grouped call.
double expert_tol(DType type, const PairLists &p, cu::MatmulPath path) {
    double tol = kExact;
    for (size_t g = 0; g + 1 < p.offsets.size(); ++g) {
        const int64_t n = p.offsets[g + 1] - p.offsets[g];
        if (n > 0) tol = std::max(tol, matmul_tol(type, resolved_path(type, n, path)));
    }
    return tol;
}

struct ExpertMatmulCase : Case {
    DType type;
    int64_t n_in, n_out, n_expert, k, n_tok;
    bool gather, skew;
    cu::MatmulPath path;
    size_t misalign;
    PairLists p;
    ExpertSlots slots;
    std::vector<float> x, y_ref;
    DevBuf dx, dy, doff, drows, ws;

    ExpertMatmulCase(DType t, int64_t ni, int64_t no, int64_t ne, int64_t kk, int64_t nt, bool ga, bool sk = false,
                     cu::MatmulPath pa = cu::MatmulPath::AUTO, size_t mis = 0)
        : type(t), n_in(ni), n_out(no), n_expert(ne), k(kk), n_tok(nt), gather(ga), skew(sk), path(pa), misalign(mis) {}
    std::string op() const override { return "expert_matmul"; }
    std::string vars() const override {
        return strf("type=%s,n_in=%lld,n_out=%lld,experts=%lld,k=%lld,n_tok=%lld,%s%s,path=%s%s",
                    dtype_name(type), (long long)n_in, (long long)n_out, (long long)n_expert,
                    (long long)k, (long long)n_tok, gather ? "gather" : "pair-order",
                    skew ? ",skewed" : "", path_name(path), misalign ? ",misaligned" : "");
    }
    void init(Rng &rng) override {
        p = PairLists::build(random_routing(n_tok, k, n_expert, skew, rng), n_tok, k, n_expert, 2);
        slots.init(type, n_in, n_out, p.active.size(), misalign, rng);
        x = rng.floats(size_t((gather ? n_tok : int64_t(p.rows.size())) * n_in));
        dx = DevBuf(x);
        dy = DevBuf(p.rows.size() * size_t(n_out) * 4);
        doff = DevBuf(p.offsets);
        drows = DevBuf(p.rows);
        ws = DevBuf(cu::expert_matmul_workspace_bytes(group(), path));
    }
    cu::ExpertMatmul group() const { return slots.group(type, n_in, n_out, p, doff, gather ? &drows : nullptr); }
    void reference() override { expert_matmul_ref(type, n_in, n_out, slots, p, x.data(), gather, y_ref); }
    void poison() override { dy.poison(); }
    void run() override { cu::expert_matmul(group(), dx.as<float>(), dy.as<float>(), ws.workspace(), g_stream, path); }
    std::vector<Check> compare() override {
        return {nmse("y", dy.download<float>(), y_ref, expert_tol(type, p, path))};
    }
    double bytes() const override {
        return double(slots.host.size() * cu::row_bytes(type, n_in) * size_t(n_out)) + double(x.size() * 4) +
               double(p.rows.size() * size_t(n_out) * 4);
    }
    double flops() const override { return 2.0 * double(n_in) * double(n_out) * double(p.rows.size()); }
};

/// A whole routed-expert FFN on the GPU (gate and up with gather, SwiGLU, down, combine) against the
/// same composition of CPU ops: checks that the pieces fit (pair order, combine indices).
/// The SwiGLU output is checked against the CPU's, and the output against the CPU's down and combine of the GPU's
/// own SwiGLU output: the down product quantizes its input, and a value the two sides compute a rounding apart can
/// land on either side of a quantization step, a difference of a whole step that is no error of the down product.
/// With glu, gate and up run as one ExpertMatmul with glu set (the SwiGLU in the product's epilogue), and the
/// output must equal the separate product and swiglu bit for bit.
struct MoeFfnCase : Case {
    DType type;
    int64_t n_embd, n_ff, n_expert, k, n_tok;
    bool glu;
    PairLists p;
    std::vector<int32_t> ids;
    std::vector<float> x, wts, g_ref;
    ExpertSlots gate, up, down;
    DevBuf dx, dg, du, dd, dout, doff, drows, dpair, dw, ws;

    MoeFfnCase(DType t, int64_t ne_, int64_t nf, int64_t nexp, int64_t kk, int64_t nt, bool gl = false)
        : type(t), n_embd(ne_), n_ff(nf), n_expert(nexp), k(kk), n_tok(nt), glu(gl) {}
    std::string op() const override { return "moe_ffn"; }
    std::string vars() const override {
        return strf("type=%s,n_embd=%lld,n_ff=%lld,experts=%lld,k=%lld,n_tok=%lld%s", dtype_name(type),
                    (long long)n_embd, (long long)n_ff, (long long)n_expert, (long long)k,
                    (long long)n_tok, glu ? ",glu" : "");
    }
    void init(Rng &rng) override {
        ids = random_routing(n_tok, k, n_expert, false, rng);
        p = PairLists::build(ids, n_tok, k, n_expert, 0);
        gate.init(type, n_embd, n_ff, p.active.size(), 0, rng);
        up.init(type, n_embd, n_ff, p.active.size(), 0, rng);
        down.init(type, n_ff, n_embd, p.active.size(), 0, rng);
        x = rng.floats(size_t(n_tok * n_embd));
        wts = rng.floats(size_t(n_tok * k), 0.0f, 1.0f);
        const size_t np = p.rows.size();
        dx = DevBuf(x), dw = DevBuf(wts), doff = DevBuf(p.offsets), drows = DevBuf(p.rows), dpair = DevBuf(p.pair_of);
        dg = DevBuf(np * size_t(n_ff) * 4), du = DevBuf(np * size_t(n_ff) * 4), dd = DevBuf(np * size_t(n_embd) * 4);
        dout = DevBuf(size_t(n_tok * n_embd) * 4);
        ws = DevBuf(std::max(cu::expert_matmul_workspace_bytes(gate.group(type, n_embd, n_ff, p, doff, &drows)),
                             cu::expert_matmul_workspace_bytes(down.group(type, n_ff, n_embd, p, doff, nullptr))));
    }
    void reference() override {
        std::vector<float> u;
        expert_matmul_ref(type, n_embd, n_ff, gate, p, x.data(), true, g_ref);
        expert_matmul_ref(type, n_embd, n_ff, up, p, x.data(), true, u);
        cpu::swiglu(g_ref.data(), u.data(), g_ref.data(), int64_t(g_ref.size()));
    }
    /// The CPU's down product and combine of the SwiGLU output g ([n_pairs][n_ff]).
    std::vector<float> down_ref(const std::vector<float> &g) {
        std::vector<float> d, out(size_t(n_tok * n_embd), 0.0f);
        expert_matmul_ref(type, n_ff, n_embd, down, p, g.data(), false, d);
        for (int64_t t = 0; t < n_tok; ++t)
            for (int64_t j = 0; j < k; ++j) {
                const float *yr = d.data() + int64_t(p.pair_of[size_t(t * k + j)]) * n_embd;
                for (int64_t i = 0; i < n_embd; ++i) out[size_t(t * n_embd + i)] += wts[size_t(t * k + j)] * yr[i];
            }
        return out;
    }
    void poison() override {
        dg.poison(), du.poison(), dd.poison(), dout.poison();
    }
    void run() override { run_ffn(glu); }
    /// Gate and up in one call, as the runtime makes it (CudaMoeDevice::expert_ffn), the SwiGLU in that call
    /// (fused) or after it.
    void run_ffn(bool fused) {
        const int64_t np = int64_t(p.rows.size());
        cu::ExpertMatmul gu = gate.group(type, n_embd, n_ff, p, doff, &drows);
        gu.type2 = type;
        gu.w2_dev = up.ptrs_dev.as<const void *const>(), gu.w2_host = up.ptrs.data();
        gu.glu = fused;
        cu::expert_matmul(gu, dx.as<float>(), dg.as<float>(), ws.workspace(), g_stream, cu::MatmulPath::AUTO,
                          du.as<float>());
        if (!fused) cu::swiglu(dg.as<float>(), du.as<float>(), dg.as<float>(), np * n_ff, g_stream);
        cu::expert_matmul(down.group(type, n_ff, n_embd, p, doff, nullptr), dg.as<float>(), dd.as<float>(),
                          ws.workspace(), g_stream);
        cu::moe_combine(dd.as<float>(), dpair.as<int32_t>(), dw.as<float>(), n_tok, k, n_embd, nullptr,
                        dout.as<float>(), g_stream);
    }
    std::vector<Check> compare() override {
        const std::vector<float> got = dout.download<float>(), g = dg.download<float>();
        const double tol = expert_tol(type, p, cu::MatmulPath::AUTO);
        std::vector<Check> c{nmse("swiglu", g, g_ref, tol), nmse("out", got, down_ref(g), tol)};
        if (glu) {
            run_ffn(false);
            c.push_back(exact("out=unfused", got, dout.download<float>()));
        }
        return c;
    }
    double bytes() const override {
        return 3.0 * double(p.active.size() * cu::row_bytes(type, n_embd) * size_t(n_ff)) + double(x.size() * 8);
    }
};

struct RmsNormCase : Case {
    int64_t n_rows, n, stride;  // stride > n: the first n floats of each row of `stride` (the rest untouched)
    bool in_place;
    std::vector<float> x, w, y_ref;
    DevBuf dx, dw, dy;
    RmsNormCase(int64_t r, int64_t nn, bool ip = false, int64_t st = 0)
        : n_rows(r), n(nn), stride(st ? st : nn), in_place(ip) {}
    std::string op() const override { return "rms_norm"; }
    std::string vars() const override {
        return strf("n_rows=%lld,n=%lld,stride=%lld%s", (long long)n_rows, (long long)n, (long long)stride,
                    in_place ? ",in-place" : "");
    }
    void init(Rng &rng) override {
        x = rng.floats(size_t(n_rows * stride), -3.0f, 3.0f), w = rng.floats(size_t(n), 0.5f, 1.5f);
        dx = DevBuf(x), dw = DevBuf(w), dy = DevBuf(x.size() * 4);
    }
    void reference() override {
        y_ref = x;
        for (int64_t r = 0; r < n_rows; ++r) {
            cpu::rms_norm(x.data() + r * stride, w.data(), 1, n, 1e-6f, y_ref.data() + r * stride);
        }
    }
    void poison() override { in_place ? dx.upload(x.data()) : dy.poison(); }
    void run() override {
        cu::rms_norm(dx.as<float>(), dw.as<float>(), n_rows, n, 1e-6f, (in_place ? dx : dy).as<float>(), g_stream,
                     stride);
    }
    std::vector<Check> compare() override {
        // The normed parts only: out of place the rest of y is the poison; in place it must be x's.
        const std::vector<float> all = (in_place ? dx : dy).download<float>();
        std::vector<float> got, ref, rest_got, rest_ref;
        for (int64_t r = 0; r < n_rows; ++r) {
            got.insert(got.end(), all.begin() + r * stride, all.begin() + r * stride + n);
            ref.insert(ref.end(), y_ref.begin() + r * stride, y_ref.begin() + r * stride + n);
            rest_got.insert(rest_got.end(), all.begin() + r * stride + n, all.begin() + (r + 1) * stride);
            rest_ref.insert(rest_ref.end(), y_ref.begin() + r * stride + n, y_ref.begin() + (r + 1) * stride);
        }
        std::vector<Check> checks{nmse("y", got, ref, kTight)};
        if (in_place && stride > n) checks.push_back(exact("rest", rest_got, rest_ref));
        return checks;
    }
    double bytes() const override { return double(n_rows * n * 8 + w.size() * 4); }
};

struct RopeCase : Case {
    int64_t n_tok, n_head, head_dim, stride;  // stride > head_dim: the first head_dim floats of longer heads
    cpu::RopeMode mode;
    float freq_base;
    int32_t max_pos;
    bool yarn;  // DeepSeek-V3's tiny model's YaRN (factor 40, 4096 original positions, mscale 1.2)
    std::vector<float> x, y_ref;
    std::vector<int32_t> pos;
    cpu::RopeYarn params;
    DevBuf dx, dpos, dfreq;
    RopeCase(int64_t nt, int64_t nh, int64_t hd, cpu::RopeMode m, float base, int32_t mp, bool y = false,
             int64_t st = 0)
        : n_tok(nt), n_head(nh), head_dim(hd), stride(st ? st : hd), mode(m), freq_base(base), max_pos(mp), yarn(y) {
        params.freq_scale = 1.0f / 40.0f;
        params.n_ctx_orig = 4096;
        params.mscale = 1.2f;
    }
    std::string op() const override { return "rope"; }
    std::string vars() const override {
        return strf("n_tok=%lld,n_head=%lld,head_dim=%lld,stride=%lld,mode=%s,base=%g,max_pos=%d%s", (long long)n_tok,
                    (long long)n_head, (long long)head_dim, (long long)stride,
                    mode == cpu::RopeMode::NORM ? "norm" : "neox", double(freq_base), max_pos, yarn ? ",yarn" : "");
    }
    void init(Rng &rng) override {
        x = rng.floats(size_t(n_tok * n_head * stride));
        pos.resize(size_t(n_tok));
        for (int32_t &q : pos) q = rng.below(max_pos + 1);
        dx = DevBuf(x), dpos = DevBuf(pos), dfreq = DevBuf(cpu::rope_inv_freq(head_dim, freq_base, yarn ? &params : nullptr));
    }
    void reference() override {
        // cpu::rope on packed heads, then put back into the longer rows.
        std::vector<float> packed(size_t(n_tok * n_head * head_dim));
        for (int64_t v = 0; v < n_tok * n_head; ++v)
            std::copy_n(x.data() + v * stride, head_dim, packed.data() + v * head_dim);
        cpu::rope(packed.data(), n_tok, n_head, head_dim, pos.data(), freq_base, mode, yarn ? &params : nullptr);
        y_ref = x;
        for (int64_t v = 0; v < n_tok * n_head; ++v)
            std::copy_n(packed.data() + v * head_dim, head_dim, y_ref.data() + v * stride);
    }
    void poison() override { dx.upload(x.data()); }
    void run() override {
        cu::rope(dx.as<float>(), n_tok, n_head, head_dim, stride, dpos.as<int32_t>(), dfreq.as<float>(),
                 yarn ? params.mscale : 1.0f, mode, g_stream);
    }
    std::vector<Check> compare() override { return {nmse("x", dx.download<float>(), y_ref, 1e-7)}; }
    double bytes() const override { return double(x.size() * 8); }
};

/// qk_norm_rope: a pass's q / k / v heads (optional biases, optional per-head norms) rotated and moved into cache
/// rows (scattered, or in place), against the CPU ops in the runtime's order (add_bias, rms_norm per head, rope),
/// and bit for bit against the CUDA ops it replaces (add_bias, rms_norm, rope, scatter_rows).
struct QkNormRopeCase : Case {
    int64_t n_tok, n_head, n_kv, head_dim;
    cpu::RopeMode mode;
    bool bias, norm, scatter;
    int64_t n_cache = 0;  // rows of the destination cache (scatter)
    std::vector<float> q, k, v, bq, bk, bv, qn, kn, q_ref, k_ref, v_ref, cache0;
    std::vector<int32_t> pos, rows;
    DevBuf dq, dk, dv, dkc, dvc, dbq, dbk, dbv, dqn, dkn, dpos, drows, dfreq;
    QkNormRopeCase(int64_t nt, int64_t nh, int64_t nkv, int64_t hd, cpu::RopeMode m, bool b, bool nm, bool sc)
        : n_tok(nt), n_head(nh), n_kv(nkv), head_dim(hd), mode(m), bias(b), norm(nm), scatter(sc) {}
    std::string op() const override { return "qk_norm_rope"; }
    std::string vars() const override {
        return strf("n_tok=%lld,n_head=%lld,n_head_kv=%lld,head_dim=%lld,mode=%s%s%s%s", (long long)n_tok,
                    (long long)n_head, (long long)n_kv, (long long)head_dim,
                    mode == cpu::RopeMode::NORM ? "norm" : "neox", bias ? ",bias" : "", norm ? ",qk-norm" : "",
                    scatter ? ",scatter" : ",in-place");
    }
    int64_t nq() const { return n_head * head_dim; }
    int64_t nk() const { return n_kv * head_dim; }
    void init(Rng &rng) override {
        q = rng.floats(size_t(n_tok * nq())), k = rng.floats(size_t(n_tok * nk())), v = rng.floats(size_t(n_tok * nk()));
        bq = rng.floats(size_t(nq())), bk = rng.floats(size_t(nk())), bv = rng.floats(size_t(nk()));
        qn = rng.floats(size_t(head_dim), 0.5f, 1.5f), kn = rng.floats(size_t(head_dim), 0.5f, 1.5f);
        pos.resize(size_t(n_tok));
        for (int32_t &p : pos) p = rng.below(4096);
        n_cache = scatter ? n_tok + 5 : n_tok;
        rows.resize(size_t(n_tok));
        std::vector<int32_t> perm(static_cast<size_t>(n_cache));
        std::iota(perm.begin(), perm.end(), 0);
        for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[size_t(rng.below(int(i)))]);
        std::copy_n(perm.begin(), n_tok, rows.begin());
        cache0 = rng.floats(size_t(n_cache * nk()));
        dq = DevBuf(q), dk = DevBuf(k), dv = DevBuf(v), dbq = DevBuf(bq), dbk = DevBuf(bk), dbv = DevBuf(bv);
        dqn = DevBuf(qn), dkn = DevBuf(kn), dpos = DevBuf(pos), drows = DevBuf(rows);
        dkc = DevBuf(cache0), dvc = DevBuf(cache0);
        dfreq = DevBuf(cpu::rope_inv_freq(head_dim, 1e6f));
    }
    void reference() override {
        q_ref = q;
        std::vector<float> kk = k, vv = v;
        if (bias) {
            cpu::add_bias(q_ref.data(), bq.data(), n_tok, nq());
            cpu::add_bias(kk.data(), bk.data(), n_tok, nk());
            cpu::add_bias(vv.data(), bv.data(), n_tok, nk());
        }
        if (norm) {
            cpu::rms_norm(q_ref.data(), qn.data(), n_tok * n_head, head_dim, 1e-6f, q_ref.data());
            cpu::rms_norm(kk.data(), kn.data(), n_tok * n_kv, head_dim, 1e-6f, kk.data());
        }
        cpu::rope(q_ref.data(), n_tok, n_head, head_dim, pos.data(), 1e6f, mode);
        cpu::rope(kk.data(), n_tok, n_kv, head_dim, pos.data(), 1e6f, mode);
        if (scatter) {
            k_ref = v_ref = cache0;
            for (int64_t t = 0; t < n_tok; ++t) {
                std::copy_n(kk.data() + t * nk(), nk(), k_ref.data() + int64_t(rows[size_t(t)]) * nk());
                std::copy_n(vv.data() + t * nk(), nk(), v_ref.data() + int64_t(rows[size_t(t)]) * nk());
            }
        } else {
            k_ref = kk, v_ref = vv;
        }
    }
    void poison() override {
        dq.upload(q.data()), dk.upload(k.data()), dv.upload(v.data());
        dkc.upload(cache0.data()), dvc.upload(cache0.data());
    }
    /// The fused call, or (fused == false) the ops it replaces, as GpuContext ran them before.
    void run_ops(bool fused) {
        float *kout = scatter ? dkc.as<float>() : dk.as<float>(), *vout = scatter ? dvc.as<float>() : dv.as<float>();
        if (fused) {
            cu::QkNormRopeArgs a;
            a.q = dq.as<float>(), a.k = dk.as<float>(), a.k_out = kout;
            if (scatter || bias) a.v = dv.as<float>(), a.v_out = vout;
            if (bias) a.bq = dbq.as<float>(), a.bk = dbk.as<float>(), a.bv = dbv.as<float>();
            if (norm) a.q_norm = dqn.as<float>(), a.k_norm = dkn.as<float>();
            a.rows = scatter ? drows.as<int32_t>() : nullptr;
            a.pos = dpos.as<int32_t>(), a.inv_freq = dfreq.as<float>();
            a.n_head = n_head, a.n_head_kv = n_kv, a.head_dim = head_dim, a.eps = 1e-6f;
            cu::qk_norm_rope(a, n_tok, mode, g_stream);
            return;
        }
        if (bias) {
            cu::add_bias(dq.as<float>(), dbq.as<float>(), n_tok, nq(), g_stream);
            cu::add_bias(dk.as<float>(), dbk.as<float>(), n_tok, nk(), g_stream);
            cu::add_bias(dv.as<float>(), dbv.as<float>(), n_tok, nk(), g_stream);
        }
        if (norm) {
            cu::rms_norm(dq.as<float>(), dqn.as<float>(), n_tok * n_head, head_dim, 1e-6f, dq.as<float>(), g_stream);
            cu::rms_norm(dk.as<float>(), dkn.as<float>(), n_tok * n_kv, head_dim, 1e-6f, dk.as<float>(), g_stream);
        }
        cu::rope(dq.as<float>(), n_tok, n_head, head_dim, head_dim, dpos.as<int32_t>(), dfreq.as<float>(), 1.0f, mode,
                 g_stream);
        cu::rope(dk.as<float>(), n_tok, n_kv, head_dim, head_dim, dpos.as<int32_t>(), dfreq.as<float>(), 1.0f, mode,
                 g_stream);
        if (scatter) {
            cu::scatter_rows(dk.as<float>(), n_tok, nk(), drows.as<int32_t>(), kout, g_stream);
            cu::scatter_rows(dv.as<float>(), n_tok, nk(), drows.as<int32_t>(), vout, g_stream);
        }
    }
    void run() override { run_ops(true); }
    std::vector<Check> compare() override {
        const std::vector<float> gq = dq.download<float>();
        const std::vector<float> gk = (scatter ? dkc : dk).download<float>(), gv = (scatter ? dvc : dv).download<float>();
        std::vector<Check> c{nmse("q", gq, q_ref, 1e-7), nmse("k", gk, k_ref, 1e-7), nmse("v", gv, v_ref, kTight)};
        poison();
        run_ops(false);
        c.push_back(exact("q=ops", gq, dq.download<float>()));
        c.push_back(exact("k=ops", gk, (scatter ? dkc : dk).download<float>()));
        c.push_back(exact("v=ops", gv, (scatter ? dvc : dv).download<float>()));
        return c;
    }
    double bytes() const override { return double((q.size() + k.size() + v.size()) * 8); }
};

/// MLA attention (cu::attention_latent) against cpu::attention over the same rows as keys and values, of which
/// the first dv output columns count (runtime/context.cpp mla_attention_block).
struct LatentAttentionCase : Case {
    int64_t n_tok, pos0, n_head, dk, dv;
    bool split;
    std::vector<float> q, cache, out_ref;
    DevBuf dq, dc, dout, ws;
    LatentAttentionCase(int64_t nt, int64_t p0, int64_t nh, int64_t k, int64_t v, bool sp = true)
        : n_tok(nt), pos0(p0), n_head(nh), dk(k), dv(v), split(sp) {}
    std::string op() const override { return "attention_latent"; }
    std::string vars() const override {
        return strf("n_tok=%lld,pos0=%lld,n_head=%lld,dk=%lld,dv=%lld%s", (long long)n_tok, (long long)pos0,
                    (long long)n_head, (long long)dk, (long long)dv, split ? "" : ",no-split");
    }
    void init(Rng &rng) override {
        q = rng.floats(size_t(n_tok * n_head * dk), -2.0f, 2.0f);
        cache = rng.floats(size_t((pos0 + n_tok) * dk));
        dq = DevBuf(q), dc = DevBuf(cache), dout = DevBuf(size_t(n_tok * n_head * dv) * 4);
        ws = DevBuf(split ? cu::attention_latent_workspace_bytes(n_tok, pos0, n_head, dv) : 0);
    }
    float scale() const { return 1.0f / std::sqrt(float(dk)); }
    void reference() override {
        std::vector<float> full(size_t(n_tok * n_head * dk));
        cpu::attention(q.data(), cache.data(), cache.data(), n_tok, pos0, n_head, 1, dk, scale(), full.data());
        out_ref.resize(size_t(n_tok * n_head * dv));
        for (int64_t v = 0; v < n_tok * n_head; ++v) std::copy_n(full.data() + v * dk, dv, out_ref.data() + v * dv);
    }
    void poison() override { dout.poison(); }
    void run() override {
        cu::attention_latent(dq.as<float>(), dc.as<float>(), n_tok, pos0, n_head, dk, dv, scale(), dout.as<float>(),
                             split ? ws.workspace() : cu::Workspace{}, g_stream);
    }
    std::vector<Check> compare() override { return {nmse("out", dout.download<float>(), out_ref, kExact)}; }
    double bytes() const override { return double(q.size() * 4 + cache.size() * 4 + size_t(n_tok * n_head * dv) * 4); }
};

/// copy_heads between a token-major part of longer rows and a head-major packed layout.
struct CopyHeadsCase : Case {
    int64_t n_tok, n_head, n, row;  // row >= n: floats per head in the token-major source
    std::vector<float> x, y_ref;
    DevBuf dx, dy;
    CopyHeadsCase(int64_t nt, int64_t nh, int64_t nn, int64_t r) : n_tok(nt), n_head(nh), n(nn), row(r) {}
    std::string op() const override { return "copy_heads"; }
    std::string vars() const override {
        return strf("n_tok=%lld,n_head=%lld,n=%lld,row=%lld", (long long)n_tok, (long long)n_head, (long long)n,
                    (long long)row);
    }
    void init(Rng &rng) override {
        x = rng.floats(size_t(n_tok * n_head * row));
        dx = DevBuf(x), dy = DevBuf(size_t(n_tok * n_head * n) * 4);
    }
    void reference() override {
        y_ref.resize(size_t(n_tok * n_head * n));
        for (int64_t t = 0; t < n_tok; ++t)
            for (int64_t h = 0; h < n_head; ++h)
                std::copy_n(x.data() + (t * n_head + h) * row, n, y_ref.data() + (h * n_tok + t) * n);
    }
    void poison() override { dy.poison(); }
    void run() override {
        cu::copy_heads(dx.as<float>(), {n_head * row, row}, dy.as<float>(), {n, n_tok * n}, n_tok, n_head, n, g_stream);
    }
    std::vector<Check> compare() override { return {exact("y", dy.download<float>(), y_ref)}; }
    double bytes() const override { return double(y_ref.size() * 8); }
};

/// Workspace handed to attention: the size it asks for, none (no split), or a quarter (fewer splits).
enum class AttnWs { FULL, NONE, QUARTER };

struct AttentionCase : Case {
    int64_t n_tok, pos0, n_head, n_head_kv, head_dim;
    float q_scale;  // larger queries sharpen the softmax (exercises the running-max rescale)
    AttnWs ws_mode;
    std::vector<float> q, kc, vc, out_ref;
    DevBuf dq, dk, dv, dout, ws;
    bool sinks = false;  // gpt-oss: a sink logit per head
    int64_t window = 0;  // gpt-oss: sliding window
    std::vector<float> sink;
    DevBuf dsink;
    bool device_pos = false;  // the position read on the device (a CUDA graph's launch): equal to the host-planned run
    DevBuf dpos, dout_host;
    AttentionCase(int64_t nt, int64_t p0, int64_t nh, int64_t nkv, int64_t hd, float qs = 1.0f,
                  AttnWs w = AttnWs::FULL, bool sk = false, int64_t win = 0, bool dp = false)
        : n_tok(nt), pos0(p0), n_head(nh), n_head_kv(nkv), head_dim(hd), q_scale(qs), ws_mode(w), sinks(sk),
          window(win), device_pos(dp) {}
    std::string op() const override { return "attention"; }
    std::string vars() const override {
        return strf("n_tok=%lld,pos0=%lld,n_head=%lld,n_head_kv=%lld,head_dim=%lld,q_scale=%g%s%s,window=%lld",
                    (long long)n_tok, (long long)pos0, (long long)n_head, (long long)n_head_kv, (long long)head_dim,
                    double(q_scale), ws_mode == AttnWs::NONE ? ",no-split" : ws_mode == AttnWs::QUARTER ? ",ws/4" : "",
                    sinks ? ",sinks" : "", (long long)window) +
               (device_pos ? ",device_pos" : "");
    }
    void init(Rng &rng) override {
        const size_t n_kv = size_t(pos0 + n_tok);
        q = rng.floats(size_t(n_tok * n_head * head_dim), -q_scale, q_scale);
        kc = rng.floats(n_kv * size_t(n_head_kv * head_dim)), vc = rng.floats(n_kv * size_t(n_head_kv * head_dim));
        dq = DevBuf(q), dk = DevBuf(kc), dv = DevBuf(vc), dout = DevBuf(q.size() * 4);
        sink = rng.floats(size_t(n_head), -2.0f, 3.0f), dsink = DevBuf(sink);
        const size_t full = cu::attention_workspace_bytes(n_tok, pos0, n_head, n_head_kv, head_dim);
        ws = DevBuf(ws_mode == AttnWs::FULL ? full : ws_mode == AttnWs::QUARTER ? full / 4 : 0);
        const std::vector<int32_t> p{int32_t(pos0)};
        if (device_pos) dpos = DevBuf(p), dout_host = DevBuf(q.size() * 4);
    }
    float scale() const { return 1.0f / std::sqrt(float(head_dim)); }
    void reference() override {
        out_ref.resize(q.size());
        cpu::attention(q.data(), kc.data(), vc.data(), n_tok, pos0, n_head, n_head_kv, head_dim, scale(),
                       out_ref.data(), sinks ? sink.data() : nullptr, window);
    }
    void poison() override { dout.poison(); }
    void launch(float *out, const int32_t *pos_dev, int64_t pos) {
        cu::attention(dq.as<float>(), dk.as<float>(), dv.as<float>(), n_tok, pos, n_head, n_head_kv, head_dim, scale(),
                      out, ws_mode == AttnWs::NONE ? cu::Workspace{} : ws.workspace(), g_stream,
                      sinks ? dsink.as<float>() : nullptr, window, pos_dev);
    }
    // The device-position run is given a wrong host position: only the device's may count.
    void run() override {
        if (device_pos) launch(dout.as<float>(), dpos.as<int32_t>(), 0);
        else launch(dout.as<float>(), nullptr, pos0);
    }
    std::vector<Check> compare() override {
        std::vector<Check> c{nmse("out", dout.download<float>(), out_ref, kExact)};
        if (device_pos) {
            launch(dout_host.as<float>(), nullptr, pos0);
            c.push_back(exact("out=host-planned", dout.download<float>(), dout_host.download<float>()));
        }
        return c;
    }
    double bytes() const override { return double(q.size() * 8) + double(kc.size() + vc.size()) * 4.0; }
    double flops() const override {
        return 4.0 * double(n_tok) * double(n_head) * double(head_dim) * double(pos0 + (n_tok + 1) / 2);
    }
};

struct SoftmaxCase : Case {
    int64_t n_rows, n;
    std::vector<float> x, y_ref;
    DevBuf dx;
    SoftmaxCase(int64_t r, int64_t nn) : n_rows(r), n(nn) {}
    std::string op() const override { return "softmax"; }
    std::string vars() const override { return strf("n_rows=%lld,n=%lld", (long long)n_rows, (long long)n); }
    void init(Rng &rng) override { x = rng.floats(size_t(n_rows * n), -8.0f, 8.0f), dx = DevBuf(x); }
    void reference() override { y_ref = x, cpu::softmax(y_ref.data(), n_rows, n); }
    void poison() override { dx.upload(x.data()); }
    void run() override { cu::softmax(dx.as<float>(), n_rows, n, g_stream); }
    std::vector<Check> compare() override { return {nmse("x", dx.download<float>(), y_ref, kTight)}; }
    double bytes() const override { return double(x.size() * 8); }
};

struct RouterCase : Case {
    /// The logits: uniform in [-4, 4]; from {-1, 0, 1, 2} (ties); from {NaN, -inf, -1, -0, +0, 1, 2} (the order's
    /// special values: NaN last, -0 equal to +0; compared bit for bit, as NaN fails a normalised MSE).
    enum LogitSet { kUniform = 0, kTies = 1, kSpecials = 2 };
    int64_t n_tok, n_expert, k;
    cpu::RouterSpec spec;  // bias pointers set from `biased`
    bool biased;  // random logit and selection biases
    int logits_from;  // a LogitSet
    std::vector<float> logits, lbias, sbias, probs_ref, w_ref;
    std::vector<int32_t> ids_ref;
    DevBuf dlogits, dlbias, dsbias, dprobs, dids, dw;
    RouterCase(int64_t nt, int64_t ne, int64_t kk, cpu::RouterSpec sp, bool bi = false, int from = kUniform)
        : n_tok(nt), n_expert(ne), k(kk), spec(sp), biased(bi), logits_from(from) {}
    RouterCase(int64_t nt, int64_t ne, int64_t kk, bool renorm, int from = kUniform)
        : RouterCase(nt, ne, kk, renorm_spec(renorm), false, from) {}
    static cpu::RouterSpec renorm_spec(bool renorm) {
        cpu::RouterSpec s;
        s.renorm = renorm;
        return s;
    }
    std::string op() const override { return "router_topk"; }
    std::string vars() const override {
        const char *score[] = {"softmax", "sigmoid", "logits"};
        return strf("n_tok=%lld,n_expert=%lld,k=%lld,score=%s,groups=%d/%d,renorm=%d,softmax_topk=%d,scale=%g%s%s",
                    (long long)n_tok, (long long)n_expert, (long long)k, score[int(spec.score)], spec.n_group_used,
                    spec.n_group, int(spec.renorm), int(spec.softmax_topk), double(spec.scale),
                    biased ? ",biased" : "",
                    logits_from == kTies ? ",ties" : logits_from == kSpecials ? ",specials" : "");
    }
    void init(Rng &rng) override {
        logits = rng.floats(size_t(n_tok * n_expert), -4.0f, 4.0f);
        const float specials[] = {NAN, -INFINITY, -1.0f, -0.0f, 0.0f, 1.0f, 2.0f};
        for (float &v : logits) {
            if (logits_from == kTies) v = float(rng.below(4) - 1);
            if (logits_from == kSpecials) v = specials[rng.below(7)];
        }
        lbias = rng.floats(size_t(n_expert), -1.0f, 1.0f), sbias = rng.floats(size_t(n_expert), -0.3f, 0.3f);
        dlogits = DevBuf(logits), dprobs = DevBuf(logits.size() * 4), dlbias = DevBuf(lbias), dsbias = DevBuf(sbias);
        dids = DevBuf(size_t(n_tok * k) * 4), dw = DevBuf(size_t(n_tok * k) * 4);
    }
    void reference() override {  // the CPU router's own code
        probs_ref = logits;
        ids_ref.resize(size_t(n_tok * k)), w_ref.resize(size_t(n_tok * k));
        cpu::RouterSpec s = spec;
        s.logit_bias = biased ? lbias.data() : nullptr;
        s.select_bias = biased ? sbias.data() : nullptr;
        cpu::route(s, probs_ref.data(), n_tok, n_expert, k, ids_ref.data(), w_ref.data());
    }
    void poison() override { dprobs.poison(), dids.poison(), dw.poison(); }
    void run() override {
        cpu::RouterSpec s = spec;
        s.logit_bias = biased ? dlbias.as<float>() : nullptr;
        s.select_bias = biased ? dsbias.as<float>() : nullptr;
        cu::router_topk(dlogits.as<float>(), n_tok, n_expert, k, s, dprobs.as<float>(), dids.as<int32_t>(),
                        dw.as<float>(), g_stream);
    }
    std::vector<Check> compare() override {
        if (logits_from == kSpecials) {
            // Bit for bit, but a NaN computed from a NaN (a biased one) may be any NaN: x86 keeps the payload, CUDA
            // does not.
            const auto nan_as_one = [](std::vector<float> v) {
                for (float &x : v) x = std::isnan(x) ? NAN : x;
                return v;
            };
            return {exact("ids", dids.download<int32_t>(), ids_ref),
                    exact("weights", nan_as_one(dw.download<float>()), nan_as_one(w_ref)),
                    exact("probs", nan_as_one(dprobs.download<float>()), nan_as_one(probs_ref))};
        }
        return {exact("ids", dids.download<int32_t>(), ids_ref), nmse("weights", dw.download<float>(), w_ref, kTight),
                nmse("probs", dprobs.download<float>(), probs_ref, kTight)};
    }
    double bytes() const override { return double(logits.size() * 8 + size_t(n_tok * k) * 8); }
};

/// moe_router (norm, F32 router matmul, top-k in one launch) against the CPU's rms_norm, matmul and route, and
/// bit for bit against the three CUDA calls it replaces; twice in a row (its block-ticket counter resets itself).
struct MoeRouterCase : Case {
    int64_t n_tok, n_embd, n_expert, k;
    cpu::RouterSpec spec;
    std::vector<float> x, norm, w, h_ref, w_ref;
    std::vector<int32_t> ids_ref;
    DevBuf dx, dnorm, dw, dh, dlogits, dids, dwts, dcounter, dh2, dlogits2, dids2, dwts2, ws;
    MoeRouterCase(int64_t nt, int64_t ne_, int64_t nexp, int64_t kk, cpu::RouterSpec sp)
        : n_tok(nt), n_embd(ne_), n_expert(nexp), k(kk), spec(sp) {}
    std::string op() const override { return "moe_router"; }
    std::string vars() const override {
        return strf("n_tok=%lld,n_embd=%lld,n_expert=%lld,k=%lld,renorm=%d,softmax_topk=%d", (long long)n_tok,
                    (long long)n_embd, (long long)n_expert, (long long)k, int(spec.renorm), int(spec.softmax_topk));
    }
    void init(Rng &rng) override {
        x = rng.floats(size_t(n_tok * n_embd), -3.0f, 3.0f), norm = rng.floats(size_t(n_embd), 0.5f, 1.5f);
        w = rng.floats(size_t(n_expert * n_embd), -0.2f, 0.2f);
        dx = DevBuf(x), dnorm = DevBuf(norm), dw = DevBuf(w);
        for (DevBuf *b : {&dh, &dh2}) *b = DevBuf(x.size() * 4);
        for (DevBuf *b : {&dlogits, &dlogits2}) *b = DevBuf(size_t(n_tok * n_expert) * 4);
        for (DevBuf *b : {&dids, &dids2, &dwts, &dwts2}) *b = DevBuf(size_t(n_tok * k) * 4);
        dcounter = DevBuf(std::vector<uint32_t>{0});
        ws = DevBuf(cu::matmul_workspace_bytes(DType::F32, n_embd, n_expert, n_tok));
    }
    void reference() override {
        h_ref.resize(x.size());
        cpu::rms_norm(x.data(), norm.data(), n_tok, n_embd, 1e-6f, h_ref.data());
        std::vector<float> logits(size_t(n_tok * n_expert));
        cpu::matmul(DType::F32, w.data(), n_embd, n_expert, h_ref.data(), n_tok, logits.data());
        ids_ref.resize(size_t(n_tok * k)), w_ref.resize(size_t(n_tok * k));
        cpu::route(spec, logits.data(), n_tok, n_expert, k, ids_ref.data(), w_ref.data());
    }
    void poison() override {
        for (DevBuf *b : {&dh, &dlogits, &dids, &dwts}) b->poison();
    }
    /// The launch's arguments over this case's buffers.
    cu::MoeRouterArgs args() const {
        cu::MoeRouterArgs a;
        a.x = dx.as<float>(), a.norm = dnorm.as<float>(), a.eps = 1e-6f, a.h = dh.as<float>(), a.w = dw.as<float>();
        a.logits = dlogits.as<float>(), a.ids = dids.as<int32_t>(), a.weights = dwts.as<float>();
        a.counter = dcounter.as<unsigned>();
        a.n_tok = n_tok, a.n_embd = n_embd, a.n_expert = int32_t(n_expert), a.k = int32_t(k);
        return a;
    }
    void run() override { cu::moe_router(args(), spec, g_stream); }
    std::vector<Check> compare() override {
        const std::vector<float> h = dh.download<float>(), logits = dlogits.download<float>(), wts = dwts.download<float>();
        const std::vector<int32_t> ids = dids.download<int32_t>();
        std::vector<Check> c{nmse("h", h, h_ref, kTight), exact("ids", ids, ids_ref), nmse("weights", wts, w_ref, kTight)};
        cu::rms_norm(dx.as<float>(), dnorm.as<float>(), n_tok, n_embd, 1e-6f, dh2.as<float>(), g_stream);
        cu::matmul(DType::F32, dw.as<float>(), n_embd, n_expert, dh2.as<float>(), n_tok, dlogits2.as<float>(),
                   ws.workspace(), g_stream, cu::MatmulPath::GEMV);
        cu::router_topk(dlogits2.as<float>(), n_tok, n_expert, k, spec, nullptr, dids2.as<int32_t>(), dwts2.as<float>(),
                        g_stream);
        c.push_back(exact("h=ops", h, dh2.download<float>()));
        c.push_back(exact("logits=ops", logits, dlogits2.download<float>()));
        c.push_back(exact("ids=ops", ids, dids2.download<int32_t>()));
        c.push_back(exact("weights=ops", wts, dwts2.download<float>()));
        run();  // again: the counter is back at 0
        c.push_back(exact("again", dwts.download<float>(), wts));
        c.push_back(exact("counter", dcounter.download<uint32_t>(), std::vector<uint32_t>{0}));
        return c;
    }
    double bytes() const override { return double(w.size() * 4 + x.size() * 8); }
};

/// moe_router with the device-resolved slot table (issue 14): the router's own routing resolved into the groups,
/// pairs and (whole) combine arrays of resolve_device_hits against a CPU listing of the same layout; `resident`
/// experts (the first ones of a fixed shuffle) get table entries through updates, so that the resolution runs in the
/// router's launch (at most 64 updates) or after it (more).
struct MoeRouterResolveCase : MoeRouterCase {
    int64_t resident;
    bool whole;
    std::vector<int32_t> index;
    std::vector<const void *> data;
    DevBuf dtable, dptrs, doffsets, drows, dpair_ids, dcomb_w;
    MoeRouterResolveCase(int64_t nt, int64_t ne_, int64_t nexp, int64_t kk, cpu::RouterSpec sp, int64_t res, bool wh)
        : MoeRouterCase(nt, ne_, nexp, kk, sp), resident(res), whole(wh) {}
    std::string op() const override { return "moe_router_resolve"; }
    std::string vars() const override {
        return MoeRouterCase::vars() + strf(",resident=%lld,whole=%d", (long long)resident, int(whole));
    }
    static const uint8_t *slot(int64_t e) { return reinterpret_cast<const uint8_t *>(uintptr_t(0x100000) * (e + 1)); }
    void init(Rng &rng) override {
        MoeRouterCase::init(rng);
        std::vector<int32_t> order(static_cast<size_t>(n_expert));
        for (int64_t e = 0; e < n_expert; ++e) order[size_t(e)] = int32_t(e);
        for (int64_t i = n_expert - 1; i > 0; --i) std::swap(order[size_t(i)], order[size_t(rng.next() % uint32_t(i + 1))]);
        index.clear(), data.clear();
        for (int64_t i = 0; i < resident; ++i) {  // layer 1 of a two-layer table
            index.push_back(int32_t(n_expert + order[size_t(i)]));
            data.push_back(slot(order[size_t(i)]));
        }
        dtable = DevBuf(std::vector<uint64_t>(size_t(2 * n_expert), 0));
        dptrs = DevBuf(size_t(3 * n_expert) * 8), doffsets = DevBuf(size_t(n_expert + 1) * 4);
        drows = DevBuf(size_t(n_tok * k) * 4), dpair_ids = DevBuf(size_t(n_tok * k) * 4), dcomb_w = DevBuf(size_t(n_tok * k) * 4);
    }
    void poison() override {
        MoeRouterCase::poison();
        for (DevBuf *b : {&dptrs, &doffsets, &drows, &dpair_ids, &dcomb_w}) b->poison();
    }
    void run() override {
        cu::DeviceHitsArgs r;
        r.table = dtable.as<const void *>(), r.layer = 1, r.n_expert = int32_t(n_expert), r.ids = dids.as<int32_t>();
        r.n_tok = n_tok, r.k = k, r.up_offset = 16, r.down_offset = 32;
        auto **ptrs = dptrs.as<const void *>();
        r.gate_w = ptrs, r.up_w = ptrs + n_expert, r.down_w = ptrs + 2 * n_expert;
        r.offsets = doffsets.as<int32_t>(), r.rows = drows.as<int32_t>();
        if (whole) {
            r.weights_in = dwts.as<float>(), r.pair_ids = dpair_ids.as<int32_t>(), r.weights = dcomb_w.as<float>();
            r.k_comb = k;
        }
        cu::moe_router(args(), spec, g_stream, &r, index.data(), data.data(), int64_t(index.size()));
    }
    std::vector<Check> compare() override {
        std::vector<Check> c = MoeRouterCase::compare();  // runs it twice: the updates apply again, unchanged
        // The layout on the CPU: resident routed experts ascending, each one's pairs in token order.
        std::vector<uint8_t> held(size_t(n_expert), 0);
        for (int32_t i : index) held[size_t(i - n_expert)] = 1;
        const int64_t n_pairs = n_tok * k, n_groups = std::min(n_expert, n_pairs);
        std::vector<uint64_t> ptrs(size_t(3 * n_expert), 0);
        std::vector<int32_t> offsets(size_t(n_expert + 1), -1), rows(size_t(n_pairs), 0), pair_ids(size_t(n_pairs), -1);
        int32_t g = 0, pair = 0;
        for (int64_t e = 0; e < n_expert; ++e) {
            if (!held[size_t(e)] || std::find(ids_ref.begin(), ids_ref.end(), int32_t(e)) == ids_ref.end()) continue;
            ptrs[size_t(g)] = uint64_t(uintptr_t(slot(e)));
            ptrs[size_t(n_expert + g)] = uint64_t(uintptr_t(slot(e) + 16));
            ptrs[size_t(2 * n_expert + g)] = uint64_t(uintptr_t(slot(e) + 32));
            offsets[size_t(g++)] = pair;
            for (int64_t p = 0; p < n_pairs; ++p) {
                if (ids_ref[size_t(p)] != e) continue;
                pair_ids[size_t(p)] = pair;
                rows[size_t(pair++)] = int32_t(p / k);
            }
        }
        for (int64_t q = g; q <= n_groups; ++q) offsets[size_t(q)] = pair;
        const std::vector<uint64_t> got_ptrs = dptrs.download<uint64_t>();
        const std::vector<int32_t> got_offsets = doffsets.download<int32_t>();
        std::vector<uint64_t> ptrs_used(size_t(3 * n_expert), 0);  // entries past the groups are not written
        std::vector<int32_t> offsets_used(size_t(n_expert + 1), -1);
        for (int64_t part = 0; part < 3; ++part)
            for (int64_t q = 0; q < g; ++q) ptrs_used[size_t(part * n_expert + q)] = got_ptrs[size_t(part * n_expert + q)];
        for (int64_t q = 0; q <= n_groups; ++q) offsets_used[size_t(q)] = got_offsets[size_t(q)];
        c.push_back(exact("slot pointers", ptrs_used, ptrs));
        c.push_back(exact("offsets", offsets_used, offsets));
        c.push_back(exact("rows", drows.download<int32_t>(), rows));
        if (whole) {
            c.push_back(exact("pair_ids", dpair_ids.download<int32_t>(), pair_ids));
            c.push_back(exact("combine weights", dcomb_w.download<float>(), dwts.download<float>()));
        }
        return c;
    }
};

/// Elementwise ops: swiglu, add, scale_add, add_bias (one struct, the op picked by name).
struct EltCase : Case {
    std::string name;
    int64_t n_tok, n;  // add_bias: n_tok rows of n; others: n_tok * n elements
    std::vector<float> a, b, y_ref;
    DevBuf da, db, dy;
    EltCase(std::string nm, int64_t nt, int64_t nn) : name(std::move(nm)), n_tok(nt), n(nn) {}
    std::string op() const override { return name; }
    std::string vars() const override { return strf("n_tok=%lld,n=%lld", (long long)n_tok, (long long)n); }
    int64_t total() const { return n_tok * n; }
    void init(Rng &rng) override {
        a = rng.floats(size_t(total()), name == "swiglu_oai" ? -9.0f : -4.0f, name == "swiglu_oai" ? 9.0f : 4.0f);
        b = name == "swiglu_oai" ? rng.floats(size_t(total()), -9.0f, 9.0f)  // both clamps at +-7 hit
                                 : rng.floats(size_t(name == "add_bias" ? n : total()));
        da = DevBuf(a), db = DevBuf(b), dy = DevBuf(a.size() * 4);
    }
    void reference() override {
        y_ref = a;
        if (name == "swiglu") cpu::swiglu(a.data(), b.data(), y_ref.data(), total());
        if (name == "swiglu_oai")
            cpu::swiglu_oai(a.data(), b.data(), y_ref.data(), total(), cpu::kSwigluOaiAlpha, cpu::kSwigluOaiLimit);
        if (name == "add" || name == "scale_add")
            for (size_t i = 0; i < a.size(); ++i) y_ref[i] = a[i] + (name == "add" ? 1.0f : 0.37f) * b[i];
        if (name == "add_bias") cpu::add_bias(y_ref.data(), b.data(), n_tok, n);
    }
    bool in_place() const { return name == "scale_add" || name == "add_bias"; }
    void poison() override { in_place() ? da.upload(a.data()) : dy.poison(); }
    void run() override {
        if (name == "swiglu") cu::swiglu(da.as<float>(), db.as<float>(), dy.as<float>(), total(), g_stream);
        if (name == "swiglu_oai")
            cu::swiglu_oai(da.as<float>(), db.as<float>(), dy.as<float>(), total(), cpu::kSwigluOaiAlpha,
                           cpu::kSwigluOaiLimit, g_stream);
        if (name == "add") cu::add(da.as<float>(), db.as<float>(), dy.as<float>(), total(), g_stream);
        if (name == "scale_add") cu::scale_add(da.as<float>(), db.as<float>(), 0.37f, total(), g_stream);
        if (name == "add_bias") cu::add_bias(da.as<float>(), db.as<float>(), n_tok, n, g_stream);
    }
    std::vector<Check> compare() override {
        return {nmse("y", (in_place() ? da : dy).download<float>(), y_ref, kTight)};
    }
    double bytes() const override { return double(a.size() * 8 + b.size() * 4); }
};

/// The activations quantized to a weight type's vec-dot type and back: exactly the CPU's values.
struct QuantizeActivationsCase : Case {
    DType type;  // weight type: Q8_0 (Q8_0 activations), Q4_1 (Q8_1), Q4_K (Q8_K)
    int64_t n, n_rows;
    bool gather;
    std::vector<float> x, y_ref;
    std::vector<int32_t> rows;
    DevBuf dx, dy, drows;
    QuantizeActivationsCase(DType t, int64_t nn, int64_t nr, bool g) : type(t), n(nn), n_rows(nr), gather(g) {}
    std::string op() const override { return "quantize_act"; }
    std::string vars() const override {
        return strf("type=%s,act=%s,n=%lld,n_rows=%lld%s", dtype_name(type), dtype_name(vec_dot_type(type)),
                    (long long)n, (long long)n_rows, gather ? ",gather" : "");
    }
    void init(Rng &rng) override {
        x = rng.floats(size_t(n * n_rows), -4.0f, 4.0f);
        // Ties of the rounding rules: blocks whose largest magnitude is 127 (scale 1) hold halves.
        for (int64_t i = 0; i < n * n_rows; i += 64) x[size_t(i)] = i % 128 ? 127.0f : -127.0f;
        for (int64_t i = 5; i < n * n_rows; i += 64) x[size_t(i)] = float(i % 11) - 4.5f;
        std::fill_n(x.begin(), std::min<int64_t>(n, 256), 0.0f);  // an all-zero block
        rows.resize(size_t(n_rows));
        for (int32_t &r : rows) r = rng.below(int(n_rows));
        dx = DevBuf(x), dy = DevBuf(x.size() * 4), drows = DevBuf(rows);
    }
    void reference() override {
        const DType a = vec_dot_type(type);
        std::vector<uint8_t> q(dtype_row_bytes(a, n));
        y_ref.resize(x.size());
        for (int64_t r = 0; r < n_rows; ++r) {
            quantize_activations(a, x.data() + (gather ? rows[size_t(r)] : r) * n, q.data(), n);
            dequantize_row(a, q.data(), y_ref.data() + r * n, n);
        }
    }
    void poison() override { dy.poison(); }
    void run() override {
        cu::quantize_activations(type, dx.as<float>(), gather ? drows.as<int32_t>() : nullptr, n, n_rows,
                                 dy.as<float>(), g_stream);
    }
    std::vector<Check> compare() override { return {exact("y", dy.download<float>(), y_ref)}; }
    double bytes() const override { return double(x.size() * 8); }
};

struct GetRowsCase : Case {
    DType type;
    int64_t n_vocab, n_embd, n_tok;
    std::vector<uint8_t> table;
    std::vector<int32_t> ids;
    std::vector<float> out_ref;
    DevBuf dtable, dids, dout;
    GetRowsCase(DType t, int64_t nv, int64_t ne, int64_t nt) : type(t), n_vocab(nv), n_embd(ne), n_tok(nt) {}
    std::string op() const override { return "get_rows"; }
    std::string vars() const override {
        return strf("type=%s,n_vocab=%lld,n_embd=%lld,n_tok=%lld", dtype_name(type), (long long)n_vocab,
                    (long long)n_embd, (long long)n_tok);
    }
    void init(Rng &rng) override {
        table = make_weights(type, n_vocab, n_embd, rng);
        ids.resize(size_t(n_tok));
        for (int32_t &i : ids) i = rng.below(int(n_vocab));
        ids.push_back(int32_t(n_vocab));  // one id out of range: must come back as a NaN row
        dtable = DevBuf(table), dids = DevBuf(ids), dout = DevBuf(ids.size() * size_t(n_embd) * 4);
    }
    void reference() override {
        out_ref.resize(size_t(n_tok * n_embd));
        TensorView tv;
        tv.type = type, tv.ne = {n_embd, n_vocab, 1, 1}, tv.data = table.data();
        cpu::get_rows(tv, ids.data(), n_tok, out_ref.data());
    }
    void poison() override { dout.poison(); }
    void run() override {
        cu::get_rows(type, dtable.as(), n_embd, n_vocab, dids.as<int32_t>(), int64_t(ids.size()), dout.as<float>(),
                     g_stream);
    }
    std::vector<Check> compare() override {
        std::vector<float> got = dout.download<float>();
        const bool bad_row_nan = std::all_of(got.end() - n_embd, got.end(), [](float v) { return std::isnan(v); });
        got.resize(size_t(n_tok * n_embd));
        return {exact("rows", got, out_ref), Check{"bad-id-row-is-nan", bad_row_nan ? 0.0 : 1.0, 0.0, bad_row_nan}};
    }
    double bytes() const override {
        return double(n_tok) * double(cu::row_bytes(type, n_embd) + size_t(n_embd) * 4);
    }
};

/// add_group_bias: each group's bias read from its expert's bytes at bias_offset, added to its pairs' rows; groups
/// past the last are empty and their pointers unset (null here: a read would fault).
struct GroupBiasCase : Case {
    int64_t n, n_groups, n_empty;  // n_empty trailing empty groups
    std::vector<int32_t> offsets;
    std::vector<float> y, bias, y_ref;  // bias: [n_groups][bias_at + n] (each group's "expert bytes")
    static constexpr int64_t bias_at = 64;  // floats before the bias in an expert's bytes
    DevBuf dy, dbias, dbase, doff;
    GroupBiasCase(int64_t nn, int64_t ng, int64_t ne) : n(nn), n_groups(ng), n_empty(ne) {}
    std::string op() const override { return "add_group_bias"; }
    std::string vars() const override {
        return strf("n=%lld,n_groups=%lld,empty=%lld", (long long)n, (long long)n_groups, (long long)n_empty);
    }
    void init(Rng &rng) override {
        offsets.assign(1, 0);
        for (int64_t g = 0; g < n_groups; ++g) {
            offsets.push_back(offsets.back() + (g < n_groups - n_empty ? 1 + rng.below(5) : 0));
        }
        y = rng.floats(size_t(offsets.back() * n)), bias = rng.floats(size_t(n_groups * (bias_at + n)));
        dy = DevBuf(y), dbias = DevBuf(bias), doff = DevBuf(offsets);
        std::vector<const void *> base(size_t(n_groups), nullptr);
        for (int64_t g = 0; g < n_groups - n_empty; ++g) base[size_t(g)] = dbias.as<float>() + g * (bias_at + n);
        dbase = DevBuf(base);
    }
    void reference() override {
        y_ref = y;
        for (int64_t g = 0; g < n_groups; ++g)
            for (int32_t p = offsets[size_t(g)]; p < offsets[size_t(g) + 1]; ++p)
                for (int64_t i = 0; i < n; ++i) {
                    y_ref[size_t(p * n + i)] += bias[size_t(g * (bias_at + n) + bias_at + i)];
                }
    }
    void poison() override { dy.upload(y.data()); }
    void run() override {
        cu::add_group_bias(dy.as<float>(), n, dbase.as<const void *>(), bias_at * 4, doff.as<int32_t>(), n_groups,
                           g_stream);
    }
    std::vector<Check> compare() override { return {exact("y", dy.download<float>(), y_ref)}; }
    double bytes() const override { return double(y.size() * 8); }
};

/// With `residual`, out starts as random values and the combine adds onto them in place: the sum from 0, then
/// the residual added (bit for bit the host's reference, which sums in the same order).
struct CombineCase : Case {
    int64_t n_tok, k, n_embd;
    bool residual;
    std::vector<float> y, wts, out0, out_ref;
    std::vector<int32_t> pair_of;
    DevBuf dy, dw, dpair, dout;
    CombineCase(int64_t nt, int64_t kk, int64_t ne, bool res) : n_tok(nt), k(kk), n_embd(ne), residual(res) {}
    std::string op() const override { return "moe_combine"; }
    std::string vars() const override {
        return strf("n_tok=%lld,k=%lld,n_embd=%lld,residual=%d", (long long)n_tok, (long long)k,
                    (long long)n_embd, int(residual));
    }
    void init(Rng &rng) override {
        const int64_t n_pairs = n_tok * k;
        y = rng.floats(size_t(n_pairs * n_embd)), wts = rng.floats(size_t(n_pairs), 0.0f, 1.0f);
        out0 = rng.floats(size_t(n_tok * n_embd));
        pair_of.resize(size_t(n_pairs));
        std::iota(pair_of.begin(), pair_of.end(), 0);
        for (size_t i = pair_of.size(); i > 1; --i) std::swap(pair_of[i - 1], pair_of[size_t(rng.below(int(i)))]);
        for (int32_t &v : pair_of)
            if (rng.below(5) == 0) v = -1;  // an expert that ran on the CPU
        dy = DevBuf(y), dw = DevBuf(wts), dpair = DevBuf(pair_of), dout = DevBuf(out0.size() * 4);
    }
    void reference() override {
        out_ref.assign(out0.size(), 0.0f);
        for (int64_t t = 0; t < n_tok; ++t)
            for (int64_t j = 0; j < k; ++j) {
                const int32_t p = pair_of[size_t(t * k + j)];
                if (p < 0) continue;
                for (int64_t i = 0; i < n_embd; ++i)
                    out_ref[size_t(t * n_embd + i)] += wts[size_t(t * k + j)] * y[size_t(p * n_embd + i)];
            }
        if (residual) {
            for (size_t i = 0; i < out_ref.size(); ++i) out_ref[i] = out0[i] + out_ref[i];
        }
    }
    void poison() override { residual ? dout.upload(out0.data()) : dout.poison(); }
    void run() override {
        cu::moe_combine(dy.as<float>(), dpair.as<int32_t>(), dw.as<float>(), n_tok, k, n_embd,
                        residual ? dout.as<float>() : nullptr, dout.as<float>(), g_stream);
    }
    std::vector<Check> compare() override { return {nmse("out", dout.download<float>(), out_ref, kTight)}; }
    double bytes() const override { return double(y.size() * 4 + out0.size() * (residual ? 8 : 4)); }
};

// ---------------------------------------------------------------------------------------------
// case lists

using CaseList = std::vector<std::unique_ptr<Case>>;
constexpr DType kWeightTypes[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0};

template <class T, class... A> void add(CaseList &l, A &&...a) {
    l.push_back(std::make_unique<T>(std::forward<A>(a)...));
}

CaseList test_cases() {
    using P = cu::MatmulPath;
    CaseList l;
    for (DType t : kWeightTypes) {
        // Qwen3-30B-A3B experts (2048 x 768 gate/up, 768 x 2048 down), decode to prefill sizes.
        for (int64_t nt : {1, 3, 8, 32, 77}) add<MatmulCase>(l, t, 2048, 768, nt);
        add<MatmulCase>(l, t, 768, 2048, 1);
        add<MatmulCase>(l, t, 768, 2048, 64);
        // both paths at one size; odd sizes (rows not a multiple of 8, partial slices)
        add<MatmulCase>(l, t, 2048, 768, 5, P::CUBLAS);
        add<MatmulCase>(l, t, 2048, 768, 70, P::GEMV);
        add<MatmulCase>(l, t, 96, 33, 5);
        add<MatmulCase>(l, t, 4160, 130, 2);
        add<MatmulCase>(l, t, 4160, 130, 40, P::CUBLAS);
        // tiny models: demo (256 / 64 / 32 experts), topo (64 / 32), router gate, vocab head
        add<MatmulCase>(l, t, 256, 64, 1);
        add<MatmulCase>(l, t, 64, 256, 9);
        add<MatmulCase>(l, t, 64, 32, 2);
        add<MatmulCase>(l, t, 2048, 128, 1);
        add<MatmulCase>(l, t, 256, 8192, 4);
    }
    add<MatmulCase>(l, DType::Q8_0, 2048, 768, 1, P::GEMV, 2);     // Q8_0 rows off 16-byte alignment
    add<MatmulCase>(l, DType::Q8_0, 256, 37, 1);                   // 16 rows a block: the last one holds 5
    add<MatmulCase>(l, DType::Q8_0, 1024, 33, 1);                  // the widest rows of one slice
    add<MatmulCase>(l, DType::Q8_0, 1056, 33, 1);                  // two slices: 8 rows a block
    add<ExpertMatmulCase>(l, DType::Q8_0, 256, 40, 32, 4, 1, true);  // 16 rows a block through the expert table
    add<MoeFfnCase>(l, DType::Q8_0, 1024, 96, 16, 4, 1, true);       // gate+up and down, both of one slice
    add<MatmulCase>(l, DType::Q8_0, 2048, 768, 100, P::CUBLAS, 6);
    add<MatmulCase>(l, DType::Q8_0, 2048, 16384, 40, P::CUBLAS);   // dequantized in two pieces
    // q/k/v in one call (heights as Qwen3-30B-A3B's 4096 / 512 / 512, scaled), both paths, other dtypes
    add<MatmulPartsCase>(l, DType::Q8_0, 256, std::vector<int64_t>{128, 16, 16}, 1);
    add<MatmulPartsCase>(l, DType::Q8_0, 256, std::vector<int64_t>{128, 16, 16}, 5);
    add<MatmulPartsCase>(l, DType::Q8_0, 256, std::vector<int64_t>{64, 24, 24}, 40);
    add<MatmulPartsCase>(l, DType::Q4_K, 512, std::vector<int64_t>{96, 33}, 3);
    add<MatmulPartsCase>(l, DType::F32, 64, std::vector<int64_t>{32, 8, 8}, 2);
    add<MatmulPartsCase>(l, DType::BF16, 64, std::vector<int64_t>{40, 8}, 12, P::CUBLAS);
    // the output projection onto the residual stream (in place), both paths; a residual part not first
    add<MatmulPartsCase>(l, DType::Q8_0, 256, std::vector<int64_t>{64}, 1, P::AUTO, 0);
    add<MatmulPartsCase>(l, DType::Q4_K, 512, std::vector<int64_t>{96}, 3, P::AUTO, 0);
    add<MatmulPartsCase>(l, DType::Q8_0, 256, std::vector<int64_t>{64}, 40, P::CUBLAS, 0);
    add<MatmulPartsCase>(l, DType::F32, 64, std::vector<int64_t>{32, 8, 8}, 1, P::AUTO, 2);
    // The attention norm in the products (decision 0149): the integer Q8_0 path, the F32 path of a K-quant, a norm
    // block smaller than the GEMV's (n_in 64: 64 threads) and larger (n_in 4096: 512).
    add<MatmulPartsCase>(l, DType::Q8_0, 256, std::vector<int64_t>{128, 16, 16}, 1, P::AUTO, -1, true);
    add<MatmulPartsCase>(l, DType::Q4_K, 512, std::vector<int64_t>{96, 33}, 1, P::AUTO, -1, true);
    add<MatmulPartsCase>(l, DType::Q8_0, 64, std::vector<int64_t>{32, 8}, 1, P::AUTO, -1, true);
    add<MatmulPartsCase>(l, DType::Q8_0, 4096, std::vector<int64_t>{64, 16}, 1, P::AUTO, -1, true);

    for (DType t : {DType::Q8_0, DType::BF16, DType::F16, DType::F32}) {
        add<ExpertMatmulCase>(l, t, 2048, 768, 128, 8, 1, true);        // decode: 8 experts, 1 token
        add<ExpertMatmulCase>(l, t, 768, 2048, 128, 8, 1, false);
        add<ExpertMatmulCase>(l, t, 2048, 768, 128, 8, 4, true);
        add<ExpertMatmulCase>(l, t, 2048, 768, 128, 8, 64, true);      // prefill: ~4 tokens per expert
        add<ExpertMatmulCase>(l, t, 2048, 768, 128, 8, 64, true, true); // one expert with 64: both paths
        add<ExpertMatmulCase>(l, t, 768, 2048, 128, 8, 40, false, false, P::CUBLAS);
        add<ExpertMatmulCase>(l, t, 256, 64, 32, 4, 9, true);          // demo
        add<ExpertMatmulCase>(l, t, 32, 64, 128, 8, 5, false);         // topo down
    }
    add<ExpertMatmulCase>(l, DType::Q8_0, 2048, 768, 128, 8, 3, true, false, P::GEMV, 2);
    add<ExpertMatmulCase>(l, DType::Q8_0, 768, 2048, 128, 8, 50, false, true, P::AUTO, 10);

    // Every other block type (rows of multiples of 256 for the K-quants): decode and prefill sizes, both
    // paths, misaligned rows, F32 activations; the grouped expert product and the whole FFN.
    for (DType t : kBlockTypes) {
        add<MatmulCase>(l, t, 2048, 768, 1);
        add<MatmulCase>(l, t, 768, 2048, 3);
        add<MatmulCase>(l, t, 256, 64, 9);                                    // demo
        add<MatmulCase>(l, t, 2048, 768, 40);                                 // AUTO: cuBLAS
        add<MatmulCase>(l, t, 512, 96, 5, P::CUBLAS);
        add<MatmulCase>(l, t, 512, 96, 2, P::GEMV, t == DType::MXFP4 ? 1 : 2);
        add<MatmulCase>(l, t, 512, 96, 3, P::GEMV, 0, ActivationQuant::NONE);
        add<ExpertMatmulCase>(l, t, 2048, 768, 128, 8, 1, true);
        add<ExpertMatmulCase>(l, t, 768, 2048, 128, 8, 1, false);
        add<ExpertMatmulCase>(l, t, 512, 256, 16, 4, 48, true, true);       // one expert on cuBLAS
    }
    add<MoeFfnCase>(l, DType::Q4_K, 2048, 768, 128, 8, 1);
    add<MoeFfnCase>(l, DType::Q6_K, 2048, 768, 128, 8, 1);
    add<MoeFfnCase>(l, DType::Q4_K, 256, 256, 32, 4, 17);
    add<MoeFfnCase>(l, DType::MXFP4, 512, 256, 32, 4, 9);
    for (DType t : {DType::Q8_0, DType::Q4_1, DType::Q4_K}) {
        add<QuantizeActivationsCase>(l, t, 2048, 7, false);
        add<QuantizeActivationsCase>(l, t, 768, 33, true);
    }

    add<MoeFfnCase>(l, DType::Q8_0, 2048, 768, 128, 8, 1);
    add<MoeFfnCase>(l, DType::BF16, 2048, 768, 128, 8, 1);
    add<MoeFfnCase>(l, DType::Q8_0, 2048, 768, 128, 8, 48);
    add<MoeFfnCase>(l, DType::Q8_0, 256, 64, 32, 4, 17);
    add<MoeFfnCase>(l, DType::F32, 64, 32, 128, 8, 6);
    // the SwiGLU in the gate/up product's epilogue: decode, a few tokens per expert, some experts on cuBLAS
    add<MoeFfnCase>(l, DType::Q8_0, 2048, 768, 128, 8, 1, true);
    add<MoeFfnCase>(l, DType::Q8_0, 512, 256, 32, 4, 1, true);  // gate+up of one slice: 8 output rows a block
    add<MoeFfnCase>(l, DType::Q4_K, 256, 256, 32, 4, 17, true);
    add<MoeFfnCase>(l, DType::Q8_0, 2048, 768, 128, 8, 48, true);
    add<MoeFfnCase>(l, DType::F32, 64, 32, 128, 8, 6, true);

    for (auto [r, n] : {std::pair<int64_t, int64_t>{1, 2048}, {7, 2048}, {5 * 32, 128}, {3, 256}, {5, 100}, {2, 8192}})
        add<RmsNormCase>(l, r, n);
    add<RmsNormCase>(l, 4, 2048, true);
    add<RmsNormCase>(l, 5, 32, false, 40);   // MLA: the latent part of each cached row (tiny DeepSeek)
    add<RmsNormCase>(l, 3, 512, true, 576);  // DeepSeek-V2-Lite

    for (cpu::RopeMode m : {cpu::RopeMode::NORM, cpu::RopeMode::NEOX}) {
        add<RopeCase>(l, 1, 32, 128, m, 1e6f, 5000);
        add<RopeCase>(l, 37, 4, 128, m, 1e6f, 4096);
        add<RopeCase>(l, 7, 4, 64, m, 1e4f, 300);
        add<RopeCase>(l, 16, 2, 16, m, 1e6f, 4096);
        add<RopeCase>(l, 9, 4, 8, m, 1e4f, 3000, true, 24);   // MLA query rope parts, YaRN (tiny DeepSeek-V3)
        add<RopeCase>(l, 9, 1, 8, m, 1e4f, 3000, true, 40);   // MLA key rope part of the cached row
        add<RopeCase>(l, 5, 16, 64, m, 1e4f, 4000, true, 192);  // DeepSeek-V2-Lite queries
    }

    for (cpu::RopeMode m : {cpu::RopeMode::NORM, cpu::RopeMode::NEOX}) {
        add<QkNormRopeCase>(l, 1, 32, 4, 128, m, false, true, false);   // Qwen3 decode, keys in place
        add<QkNormRopeCase>(l, 1, 32, 4, 128, m, false, true, true);    // a captured decode pass
        add<QkNormRopeCase>(l, 5, 8, 2, 64, m, true, false, true);      // biases (Qwen2-MoE, gpt-oss), no norm
        add<QkNormRopeCase>(l, 3, 4, 4, 256, m, true, true, false);     // values biased in place
    }

    // A block takes 4, 8 or 16 query rows (tokens x heads of one KV head) and a split of the keys,
    // in tiles of 32 keys (head_dim 128), 16 (256) or 64 (<= 64); decode splits the keys over ~2 waves.
    add<AttentionCase>(l, 1, 0, 32, 4, 128);         // first decode step: one key, no split
    add<AttentionCase>(l, 1, 200, 32, 4, 128);
    add<AttentionCase>(l, 1, 511, 32, 4, 128);       // 16 splits of one tile each
    add<AttentionCase>(l, 1, 1000, 32, 4, 128);      // last split and tile partly filled
    add<AttentionCase>(l, 1, 4095, 32, 4, 128);      // 64 splits of two tiles
    add<AttentionCase>(l, 1, 4095, 32, 4, 128, 1.0f, AttnWs::NONE);
    add<AttentionCase>(l, 1, 4095, 32, 4, 128, 4.0f, AttnWs::QUARTER);  // fewer, longer splits
    add<AttentionCase>(l, 4, 1000, 32, 4, 128, 4.0f);  // two tokens per block, split
    add<AttentionCase>(l, 3, 500, 32, 4, 128);       // a full and a half-full row block
    add<AttentionCase>(l, 64, 0, 32, 4, 128);        // prefill (splits: few row blocks)
    add<AttentionCase>(l, 100, 20, 32, 4, 128, 4.0f);
    add<AttentionCase>(l, 1, 2047, 28, 4, 128);      // 7 heads per KV head (Qwen2-MoE 57B): 8-row block
    add<AttentionCase>(l, 9, 300, 28, 4, 128);       // 2 tokens x 7 heads per block
    add<AttentionCase>(l, 17, 100, 4, 2, 64, 4.0f);  // demo
    add<AttentionCase>(l, 1, 3000, 8, 2, 64);        // head_dim 64 decode, 4-row blocks, split
    add<AttentionCase>(l, 33, 0, 4, 2, 16);          // topo
    add<AttentionCase>(l, 1, 500, 4, 2, 16);
    add<AttentionCase>(l, 5, 3, 2, 1, 32);           // smoke
    add<AttentionCase>(l, 40, 7, 8, 8, 32);          // 16 tokens per block
    add<AttentionCase>(l, 3, 10, 16, 16, 128);       // no GQA (OLMoE)
    add<AttentionCase>(l, 1, 2047, 16, 16, 128);     // no GQA decode: one row of a 4-row block
    add<AttentionCase>(l, 2, 50, 32, 2, 256);        // 16 heads per KV head, head_dim 256
    add<AttentionCase>(l, 1, 700, 16, 4, 256, 4.0f); // head_dim 256 decode, split
    add<AttentionCase>(l, 1, 70000, 8, 1, 64);       // long context, 8 queries over one KV head
    // gpt-oss: sinks and a sliding window (tiny model: 4 / 2 heads of 16, window 5; gpt-oss-20b: 64 / 8 of 64, 128)
    add<AttentionCase>(l, 9, 0, 4, 2, 16, 1.0f, AttnWs::FULL, true, 5);
    add<AttentionCase>(l, 1, 30, 4, 2, 16, 4.0f, AttnWs::FULL, true, 5);
    add<AttentionCase>(l, 1, 30, 4, 2, 16, 4.0f, AttnWs::FULL, true, 0);   // a full layer's sinks
    add<AttentionCase>(l, 1, 3000, 64, 8, 64, 4.0f, AttnWs::FULL, true, 128);  // split, most splits see no key
    // The position read on the device (CUDA graph decode): no split, split, fewer splits, sinks and window, rows.
    add<AttentionCase>(l, 1, 0, 32, 4, 128, 1.0f, AttnWs::FULL, false, 0, true);
    add<AttentionCase>(l, 1, 1000, 32, 4, 128, 1.0f, AttnWs::FULL, false, 0, true);
    add<AttentionCase>(l, 1, 4095, 32, 4, 128, 4.0f, AttnWs::QUARTER, false, 0, true);
    add<AttentionCase>(l, 1, 2047, 16, 16, 128, 1.0f, AttnWs::FULL, false, 0, true);
    add<AttentionCase>(l, 4, 1000, 32, 4, 128, 4.0f, AttnWs::FULL, false, 0, true);
    add<AttentionCase>(l, 1, 3000, 64, 8, 64, 4.0f, AttnWs::FULL, true, 128, true);
    add<AttentionCase>(l, 1, 3000, 64, 8, 64, 4.0f, AttnWs::FULL, true, 0);
    add<AttentionCase>(l, 40, 200, 64, 8, 64, 4.0f, AttnWs::FULL, true, 128);
    add<AttentionCase>(l, 1, 3000, 64, 8, 64, 4.0f, AttnWs::NONE, false, 128);
    add<LatentAttentionCase>(l, 7, 0, 4, 40, 32);     // tiny DeepSeek prefill
    add<LatentAttentionCase>(l, 1, 30, 4, 40, 32);    // tiny DeepSeek decode (split)
    add<LatentAttentionCase>(l, 1, 30, 4, 40, 32, false);
    add<LatentAttentionCase>(l, 1, 1000, 16, 576, 512);  // DeepSeek-V2-Lite decode, split
    add<LatentAttentionCase>(l, 20, 100, 16, 576, 512);  // prefill
    add<LatentAttentionCase>(l, 2, 300, 40, 576, 512);   // 3 head groups, one partly filled
    add<CopyHeadsCase>(l, 5, 4, 16, 24);
    add<CopyHeadsCase>(l, 3, 16, 128, 192);

    for (auto [r, n] : {std::pair<int64_t, int64_t>{1, 128}, {64, 128}, {5, 7}, {3, 151936}}) add<SoftmaxCase>(l, r, n);

    add<RouterCase>(l, 1, 128, 8, true);   // Qwen3-30B-A3B
    add<RouterCase>(l, 64, 128, 8, true);
    add<RouterCase>(l, 5, 60, 4, false);   // Qwen2-MoE
    add<RouterCase>(l, 3, 8, 2, true);     // Mixtral
    add<RouterCase>(l, 7, 64, 8, false);   // OLMoE
    add<RouterCase>(l, 9, 32, 4, true);    // demo
    add<RouterCase>(l, 2, 256, 8, true);
    add<RouterCase>(l, 2, 1024, 32, false);
    add<RouterCase>(l, 16, 128, 8, true, true);  // equal probabilities: lower id first
    {
        cpu::RouterSpec renorm, mixtral, topk_softmax;
        renorm.renorm = true;
        topk_softmax.softmax_topk = true;  // gpt-oss's order of softmax and top-k
        add<MoeRouterCase>(l, 1, 2048, 128, 8, renorm);   // Qwen3-30B-A3B decode
        add<MoeRouterCase>(l, 1, 4096, 8, 2, renorm);     // Mixtral: one block
        add<MoeRouterCase>(l, 3, 256, 32, 4, mixtral);    // demo-sized, several tokens
        add<MoeRouterCase>(l, 8, 512, 60, 4, topk_softmax);
        // With the slot resolution: in the router's launch (<= 64 updates), or after it (more).
        add<MoeRouterResolveCase>(l, 1, 2048, 128, 8, renorm, 64, false);  // Qwen3 decode, half the experts held
        add<MoeRouterResolveCase>(l, 1, 2048, 128, 8, renorm, 128, true);  // every expert: a whole step, 2 launches
        add<MoeRouterResolveCase>(l, 3, 256, 32, 4, mixtral, 32, true);    // several tokens (12 pairs), a block of 128
        add<MoeRouterResolveCase>(l, 8, 512, 60, 4, topk_softmax, 20, false);  // 32 pairs: the last of one warp
        add<MoeRouterResolveCase>(l, 8, 512, 64, 8, renorm, 40, false);       // 64 pairs: the block's scan
        add<MoeRouterResolveCase>(l, 1, 4096, 8, 2, renorm, 8, true);         // Mixtral decode: a whole step
        // The register resolution at its edges: 8 experts a lane, lanes past the last expert, k = 32; then more
        // experts than it takes, and nothing resident.
        cpu::RouterSpec v3;  // DeepSeek-V3's router (groups, sigmoid, scale)
        v3.score = cpu::RouterScore::SIGMOID, v3.n_group = 8, v3.n_group_used = 4, v3.renorm = true, v3.scale = 2.5f;
        add<MoeRouterResolveCase>(l, 1, 256, 256, 8, v3, 64, false);
        add<MoeRouterResolveCase>(l, 1, 256, 60, 4, renorm, 60, true);
        add<MoeRouterResolveCase>(l, 1, 256, 32, 32, renorm, 32, true);
        add<MoeRouterResolveCase>(l, 1, 256, 288, 8, renorm, 64, false);
        add<MoeRouterResolveCase>(l, 1, 256, 8, 2, renorm, 0, false);
    }
    {
        cpu::RouterSpec v3;  // DeepSeek-V3: sigmoid, selection bias, 8 groups keep 4, renorm, scale 2.5
        v3.score = cpu::RouterScore::SIGMOID, v3.n_group = 8, v3.n_group_used = 4, v3.renorm = true, v3.scale = 2.5f;
        add<RouterCase>(l, 5, 256, 8, v3, true);
        add<RouterCase>(l, 5, 256, 8, v3, true, true);
        cpu::RouterSpec tiny = v3;  // the tiny DeepSeek-V3 model: 8 experts in 4 groups keep 2
        tiny.n_group = 4, tiny.n_group_used = 2;
        add<RouterCase>(l, 9, 8, 2, tiny, true);
        cpu::RouterSpec lite;  // DeepSeek-V2-Lite: softmax, no groups, no renorm
        add<RouterCase>(l, 3, 64, 6, lite);
        cpu::RouterSpec oss;  // gpt-oss: logit bias, top-k of the logits, softmax over them
        oss.score = cpu::RouterScore::LOGITS, oss.softmax_topk = true;
        add<RouterCase>(l, 7, 32, 4, oss, true);
        add<RouterCase>(l, 2, 128, 4, oss, true, true);
        cpu::RouterSpec raw;  // the logits themselves: every pick's value compared bit for bit
        raw.score = cpu::RouterScore::LOGITS;
        add<RouterCase>(l, 6, 32, 32, raw, false, RouterCase::kSpecials);   // every rank: NaN last, -0 = +0
        add<RouterCase>(l, 3, 256, 16, raw, false, RouterCase::kSpecials);  // 8 a lane
        cpu::RouterSpec raw_groups = raw;  // the special values through the group choice
        raw_groups.n_group = 8, raw_groups.n_group_used = 4;
        add<RouterCase>(l, 6, 256, 8, raw_groups, true, RouterCase::kSpecials);
        raw_groups.n_group = 4, raw_groups.n_group_used = 2;
        add<RouterCase>(l, 9, 8, 8, raw_groups, true, RouterCase::kSpecials);
        raw_groups.n_group = 32, raw_groups.n_group_used = 7;
        add<RouterCase>(l, 5, 1024, 32, raw_groups, false, RouterCase::kSpecials);
    }

    for (const char *name : {"swiglu", "swiglu_oai", "add", "scale_add", "add_bias"}) {
        add<EltCase>(l, name, 1, 768);
        add<EltCase>(l, name, 64, 2048);
        add<EltCase>(l, name, 3, 1001);
    }
    for (DType t : kWeightTypes) {
        add<GetRowsCase>(l, t, 8192, 256, 7);
        add<GetRowsCase>(l, t, 32000, 2048, 5);
    }
    for (DType t : kBlockTypes) add<GetRowsCase>(l, t, 1000, 512, 6);
    add<CombineCase>(l, 1, 8, 2048, false);
    add<GroupBiasCase>(l, 32, 8, 0);     // tiny gpt-oss: 8 experts of 32
    add<GroupBiasCase>(l, 2880, 24, 6);  // gpt-oss-20b's n_embd, device-resolved groups past the last
    add<CombineCase>(l, 64, 8, 2048, true);
    add<CombineCase>(l, 9, 4, 256, false);
    return l;
}

CaseList perf_cases() {
    CaseList l;
    for (DType t : {DType::Q4_K, DType::Q6_K, DType::Q5_K, DType::IQ4_XS, DType::MXFP4}) {
        add<MatmulCase>(l, t, 2048, 768, 1);
        add<ExpertMatmulCase>(l, t, 2048, 768, 128, 8, 1, true);
        add<ExpertMatmulCase>(l, t, 768, 2048, 128, 8, 1, false);
        add<ExpertMatmulCase>(l, t, 2048, 768, 128, 8, 512, true);
    }
    add<QuantizeActivationsCase>(l, DType::Q4_K, 2048, 4096, true);
    for (DType t : {DType::Q8_0, DType::BF16}) {
        add<MatmulCase>(l, t, 2048, 768, 1);                    // one expert matrix
        add<ExpertMatmulCase>(l, t, 2048, 768, 128, 8, 1, true); // decode, 8 experts (gate or up)
        add<ExpertMatmulCase>(l, t, 768, 2048, 128, 8, 1, false);
        add<ExpertMatmulCase>(l, t, 2048, 768, 128, 8, 512, true); // prefill 512 tokens
        add<MatmulCase>(l, t, 2048, 4096, 1);                   // q projection (32 x 128)
        add<MatmulCase>(l, t, 4096, 2048, 512);                 // o projection, prefill
        add<MatmulCase>(l, t, 2048, 151936, 1);                 // output head, decode
    }
    add<MoeFfnCase>(l, DType::Q8_0, 2048, 768, 128, 8, 1);
    add<MatmulPartsCase>(l, DType::Q8_0, 2048, std::vector<int64_t>{4096, 512, 512}, 1);  // q, k, v, decode
    add<MatmulCase>(l, DType::F32, 2048, 128, 1);               // router gate (F32 in GGUFs)
    for (int64_t ctx : {512, 4096, 32768}) add<AttentionCase>(l, 1, ctx - 1, 32, 4, 128);
    add<AttentionCase>(l, 512, 0, 32, 4, 128);
    add<RouterCase>(l, 1, 128, 8, true);
    add<RouterCase>(l, 512, 128, 8, true);
    {
        cpu::RouterSpec renorm;
        renorm.renorm = true;
        add<MoeRouterCase>(l, 1, 2048, 128, 8, renorm);                // Qwen3-30B-A3B decode: norm, router, top-k
        add<MoeRouterResolveCase>(l, 1, 2048, 128, 8, renorm, 64, false);  // and the slots resolved in the launch
    }
    add<RmsNormCase>(l, 1, 2048);
    add<RmsNormCase>(l, 512, 2048);
    add<RopeCase>(l, 512, 32, 128, cpu::RopeMode::NEOX, 1e6f, 4096);
    add<SoftmaxCase>(l, 1, 151936);
    add<EltCase>(l, "swiglu", 4096, 768);
    add<GetRowsCase>(l, DType::Q8_0, 151936, 2048, 512);
    add<CombineCase>(l, 512, 8, 2048, false);
    return l;
}

// ---------------------------------------------------------------------------------------------
// main

struct Filter {
    std::vector<std::string> ops;  // empty: every op
    std::string vars;              // regex on Case::vars(); empty: every case
    bool operator()(const Case &c) const {
        return (ops.empty() || std::find(ops.begin(), ops.end(), c.op()) != ops.end()) &&
               (vars.empty() || std::regex_search(c.vars(), std::regex(vars)));
    }
};

/// Sets the case's activation mode for its lifetime in the harness.
struct ScopedActivations {
    explicit ScopedActivations(const Case &c) { set_activation_quant(c.activations()); }
    ~ScopedActivations() { set_activation_quant(ActivationQuant::INT8); }
};

int run_tests(CaseList &cases, const Filter &filter, uint64_t seed) {
    int n_run = 0, n_ok = 0;
    std::printf("%-14s %-78s %-9s %10s %10s  %s\n", "OP", "VARS", "CHECK", "ERR", "TOL", "RESULT");
    for (size_t i = 0; i < cases.size(); ++i) {
        Case &c = *cases[i];
        if (!filter(c)) continue;
        const ScopedActivations act(c);
        Rng rng(seed + i);
        c.init(rng);
        c.reference();
        c.poison();
        c.run();
        CUDA_CHECK(cudaStreamSynchronize(g_stream));
        bool ok = true;
        for (const Check &k : c.compare()) {
            ok &= k.ok;
            std::printf("%-14s %-78s %-9s %10.2e %10.2e  %s\n", c.op().c_str(), c.vars().c_str(), k.what.c_str(), k.err,
                        k.tol, k.ok ? "OK" : "FAIL");
        }
        ++n_run, n_ok += ok;
        cases[i].reset();  // frees the case's device memory
    }
    std::printf("\n%d/%d cases passed%s\n", n_ok, n_run, n_ok == n_run ? "" : "  <-- FAILURES");
    return n_ok == n_run ? 0 : 1;
}

int run_perf(CaseList &cases, const Filter &filter, uint64_t seed, const std::string &json_path) {
    DevBuf flush(size_t(256) << 20);  // several times the 60 MB L2
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    nlohmann::json rows = nlohmann::json::array();
    std::printf("%-14s %-78s %6s %10s %10s %8s %9s\n", "OP", "VARS", "RUNS", "US", "GB/S", "%HBM", "TFLOP/S");
    for (size_t i = 0; i < cases.size(); ++i) {
        Case &c = *cases[i];
        if (!filter(c)) continue;
        const ScopedActivations act(c);
        Rng rng(seed + i);
        c.init(rng);
        for (int w = 0; w < 2; ++w) c.run();  // warm-up (cuBLAS handles, first-launch costs)
        std::vector<float> us;
        float total_ms = 0.0f;
        while (us.size() < 5 || (us.size() < 50 && total_ms < 200.0f)) {
            CUDA_CHECK(cudaMemsetAsync(flush.as(), int(us.size() & 0xff), flush.size(), g_stream));
            CUDA_CHECK(cudaEventRecord(e0, g_stream));
            c.run();
            CUDA_CHECK(cudaEventRecord(e1, g_stream));
            CUDA_CHECK(cudaEventSynchronize(e1));
            float ms = 0.0f;
            CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            us.push_back(ms * 1000.0f), total_ms += ms;
        }
        std::sort(us.begin(), us.end());
        const double med = us[us.size() / 2], gbs = c.bytes() / (med * 1e3), tflops = c.flops() / (med * 1e6);
        std::printf("%-14s %-78s %6zu %10.2f %10.1f %7.1f%% %9.2f\n", c.op().c_str(), c.vars().c_str(), us.size(), med,
                    gbs, 100.0 * gbs / kHbmGBs, tflops);
        rows.push_back({{"op", c.op()}, {"vars", c.vars()}, {"runs", us.size()}, {"median_us", med},
                        {"min_us", us.front()}, {"bytes", c.bytes()}, {"gb_s", gbs}, {"hbm_share", gbs / kHbmGBs},
                        {"tflop_s", tflops}});
        cases[i].reset();
    }
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    if (!json_path.empty()) {
        std::ofstream f(json_path);
        for (const auto &r : rows) f << r.dump() << "\n";
        std::printf("\nwrote %zu rows to %s\n", rows.size(), json_path.c_str());
    }
    return 0;
}

} // namespace

int main(int argc, char **argv) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // rows reach the log even if a later case aborts
    std::string mode = "test", json_path;
    Filter filter;
    uint64_t seed = 1234;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "test" || a == "perf") {
            mode = a;
        } else if ((a == "-o" || a == "-p" || a == "--json" || a == "--seed") && i + 1 < argc) {
            const std::string v = argv[++i];
            if (a == "--json") json_path = v;
            if (a == "--seed") seed = std::stoull(v);
            if (a == "-p") filter.vars = v;
            for (size_t p = 0; a == "-o" && p <= v.size();) {
                const size_t q = std::min(v.find(',', p), v.size());
                filter.ops.push_back(v.substr(p, q - p));
                p = q + 1;
            }
        } else {
            std::fprintf(stderr, "usage: %s [test|perf] [-o OP[,OP...]] [-p REGEX] [--json FILE] [--seed N]\n",
                         argv[0]);
            return 2;
        }
    }

    int n_dev = 0;
    const cudaError_t err = cudaGetDeviceCount(&n_dev);
    if (err != cudaSuccess || n_dev == 0) {
        std::printf("test-backend-ops: no CUDA device (%s); skipping\n",
                    err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return kSkipCode;
    }
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("test-backend-ops %s: %s, %d SMs, %.1f GiB, cc %d.%d, seed %llu, %d CPU threads, CPU ISA %s\n\n",
                mode.c_str(), prop.name, prop.multiProcessorCount, double(prop.totalGlobalMem) / (1 << 30), prop.major,
                prop.minor, (unsigned long long)seed, cpu::get_threads(), cpu::cpu_isa_name(cpu::get_cpu_isa()));
    CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    cu::cublas_handle();

    CaseList cases = mode == "perf" ? perf_cases() : test_cases();
    const int rc = mode == "perf" ? run_perf(cases, filter, seed, json_path) : run_tests(cases, filter, seed);
    CUDA_CHECK(cudaStreamDestroy(g_stream));
    return rc;
}
