// Portable inner loops for CPUs without AVX2 (and non-x86 builds): plain C++ over 8-float groups,
// which the compiler vectorizes with the baseline instruction set; integer dot products of the
// quantized types as ggml's generic versions (vec-dot-scalar.h).
#include "backend/cpu/kernels.h"
#include "backend/cpu/vec-dot-scalar.h"
#include "core/dtype.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

namespace {

struct VecScalar {
    using Quant = ScalarQuant;
    static constexpr int N = 8;
    static constexpr int max_tokens = 4;
    static constexpr int gemm_vecs = 2, gemm_row_pad = 4;
    static constexpr int gemm_rows[gemm_vecs] = {4, 4};
    struct V {
        float v[N];
    };
    static V zero() { return V{}; }
    static V set1(float a) {
        V r;
        for (float &e : r.v) e = a;
        return r;
    }
    static V load(const float *p) {
        V r;
        std::memcpy(r.v, p, sizeof r.v);
        return r;
    }
    static void store(float *p, V v) { std::memcpy(p, v.v, sizeof v.v); }
    static V add(V a, V b) {
        for (int i = 0; i < N; ++i) a.v[i] += b.v[i];
        return a;
    }
    static V mul(V a, V b) {
        for (int i = 0; i < N; ++i) a.v[i] *= b.v[i];
        return a;
    }
    static V fmadd(V a, V b, V c) {
        for (int i = 0; i < N; ++i) c.v[i] += a.v[i] * b.v[i];
        return c;
    }
    static float reduce(V v) {
        float s = 0.0f;
        for (float e : v.v) s += e;
        return s;
    }
    static V load_f16(const uint16_t *p) {
        V r;
        for (int i = 0; i < N; ++i) r.v[i] = prescope::fp16_to_fp32(p[i]);
        return r;
    }
    static V load_bf16(const uint16_t *p) {
        V r;
        for (int i = 0; i < N; ++i) r.v[i] = prescope::bf16_to_fp32(p[i]);
        return r;
    }
    static V load_q8(const int8_t *p) {
        V r;
        for (int i = 0; i < N; ++i) r.v[i] = float(p[i]);
        return r;
    }
    static float f16(uint16_t h) { return prescope::fp16_to_fp32(h); }
    static void transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
        for (int r = 0; r < 8; ++r)
            for (int c = 0; c < 8; ++c) dst[c * ldd + r] = src[r * lds + c];
    }
    static void q8_scales(const prescope::BlockQ8_0 *blk, int64_t nb, float *out) {
        for (int64_t b = 0; b < nb; ++b) out[b] = f16(blk[b].d);
    }
};

} // namespace

#include "backend/cpu/kernels-impl.h"

namespace prescope::cpu {

const KernelTable &kernels_scalar() {
    static const KernelTable table = make_kernel_table<VecScalar>();
    return table;
}

} // namespace prescope::cpu
