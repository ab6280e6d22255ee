// CPU ops other than matmul and attention (norms, RoPE, softmax, SwiGLU, top-k, embeddings), plus
// the run-time state the kernels share: thread count and the ISA of the inner loops.
#include "backend/cpu/ops.h"

#include "backend/cpu/kernels.h"
#include "core/error.h"
#include "core/log.h"

#include <cblas.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// Declared by OpenBLAS's cblas.h, but not by the netlib one the alternatives system may select.
extern "C" void openblas_set_num_threads(int num_threads);

namespace prescope::cpu {

namespace {

std::atomic<int> g_threads{0};
std::once_flag g_threads_once;
std::atomic<int> g_isa{-1};
std::once_flag g_isa_once;

// Element count below which an elementwise op runs on one thread: a fork/join costs a few
// microseconds, about what one core needs for this many elements.
constexpr int64_t kParallelMinElems = int64_t(1) << 15;

int read_int_file(const std::string &path) {
    std::ifstream f(path);
    int v = -1;
    if (!(f >> v)) return -1;
    return v;
}

} // namespace

// ---------------------------------------------------------------------------------------------
// threads and ISA

int cgroup_cpu_limit(const std::string &proc_self_cgroup, const std::string &cgroup_root) {
    std::ifstream in(proc_self_cgroup);
    std::string line;
    double limit = 0;  // CPUs; 0: no quota found
    auto lower = [&limit](double quota, double period) {
        if (quota > 0 && period > 0 && (limit == 0 || quota / period < limit)) limit = quota / period;
    };
    while (std::getline(in, line)) {
        // "0::/path" (v2) or "N:cpu,cpuacct:/path" (v1).
        const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos) continue;
        std::string controllers(1, ',');
        controllers.append(line, a + 1, b - a - 1).push_back(',');
        const bool v2 = controllers == ",,";
        if (!v2 && controllers.find(",cpu,") == std::string::npos) continue;
        // The quota of the cgroup and of each parent applies; in a container the path may not exist below the
        // mount (a cgroup namespace shows "/"), then the mount root is the container's own cgroup.
        std::vector<std::string> roots = v2 ? std::vector<std::string>{cgroup_root}
                                            : std::vector<std::string>{cgroup_root + "/cpu,cpuacct", cgroup_root + "/cpu"};
        for (const std::string &root : roots) {
            for (std::string path = line.substr(b + 1);;) {
                const std::string dir = root + (path == "/" ? "" : path);
                if (v2) {
                    std::ifstream f(dir + "/cpu.max");
                    std::string quota;
                    double period = 0;
                    if (f >> quota >> period && quota != "max") lower(std::atof(quota.c_str()), period);
                } else {
                    std::ifstream q(dir + "/cpu.cfs_quota_us"), per(dir + "/cpu.cfs_period_us");
                    double quota = 0, period = 0;
                    if (q >> quota && per >> period) lower(quota, period);
                }
                if (path.empty() || path == "/") break;
                const size_t slash = path.rfind('/');
                path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
            }
        }
    }
    return limit > 0 ? std::max(1, int(std::ceil(limit - 1e-9))) : 0;
}

int physical_cores() {
    static const int n = [] {
        cpu_set_t set;
        CPU_ZERO(&set);
        const bool have_affinity = sched_getaffinity(0, sizeof set, &set) == 0;
        std::set<std::pair<int, int>> cores;  // (package, core) of each CPU we may run on
        int n_cpus = 0;
        bool topology_ok = have_affinity;
        for (int cpu = 0; have_affinity && cpu < CPU_SETSIZE; ++cpu) {
            if (!CPU_ISSET(cpu, &set)) continue;
            ++n_cpus;
            const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
            const int package = read_int_file(dir + "physical_package_id");
            const int core = read_int_file(dir + "core_id");
            if (package < 0 || core < 0) topology_ok = false;
            cores.emplace(package, core);
        }
        int found = topology_ok && !cores.empty() ? int(cores.size())
                    : n_cpus > 0                  ? n_cpus
                                                  : std::max(1, int(std::thread::hardware_concurrency()));
        // A container's CPU quota (docker --cpus, Kubernetes limits) leaves the affinity mask whole: more
        // threads than the quota get throttled in turn, and each barrier waits for the throttled one.
        const int quota = cgroup_cpu_limit();
        return quota > 0 ? std::min(found, quota) : found;
    }();
    return n;
}

void set_threads(int n) {
    const int threads = n > 0 ? n : physical_cores();
    g_threads.store(threads);
    omp_set_num_threads(threads);
    // Our OpenMP threads call sgemm on tiles each; OpenBLAS threads on top would oversubscribe.
    openblas_set_num_threads(1);
}

int get_threads() {
    std::call_once(g_threads_once, [] {
        if (g_threads.load() == 0) set_threads(0);
    });
    return g_threads.load();
}

int threads_here() {
    return omp_in_parallel() ? 1 : get_threads();
}

const char *cpu_isa_name(CpuIsa isa) {
    switch (isa) {
    case CpuIsa::SCALAR: return "scalar";
    case CpuIsa::AVX2: return "avx2";
    case CpuIsa::AVX512: return "avx512";
    }
    return "unknown";
}

CpuIsa cpu_isa_supported() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    // libgcc's checks include the OS's XSAVE support for the ymm / zmm state.
    // F16C from CPUID leaf 1 (ECX bit 29): clang before 15 does not know "f16c" in __builtin_cpu_supports.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    // The AVX-512 kernels' integer dot products use BW, VL and VNNI (vpdpbusd) besides F.
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return CpuIsa::AVX512;
    if (avx2) return CpuIsa::AVX2;
#endif
    return CpuIsa::SCALAR;
}

CpuIsa get_cpu_isa() {
    std::call_once(g_isa_once, [] {
        CpuIsa isa = cpu_isa_supported();
        if (const char *env = std::getenv("PRESCOPE_CPU_ISA")) {
            const std::string want = env;
            bool known = false;
            for (CpuIsa i : {CpuIsa::SCALAR, CpuIsa::AVX2, CpuIsa::AVX512}) {
                if (want != cpu_isa_name(i)) continue;
                known = true;
                if (i <= isa) {
                    isa = i;
                } else {
                    spdlog::warn("PRESCOPE_CPU_ISA={}: this CPU lacks it; using {}", want, cpu_isa_name(isa));
                }
            }
            if (!known) spdlog::warn("PRESCOPE_CPU_ISA={}: expected scalar, avx2 or avx512; ignored", want);
        }
        int expected = -1;
        g_isa.compare_exchange_strong(expected, int(isa));  // set_cpu_isa may have come first
    });
    return CpuIsa(g_isa.load());
}

void set_cpu_isa(CpuIsa isa) {
    if (isa > cpu_isa_supported())
        fail("CPU kernels: this CPU does not support {} (best: {})", cpu_isa_name(isa),
             cpu_isa_name(cpu_isa_supported()));
    get_cpu_isa();  // settle the default first, so it cannot overwrite this choice later
    g_isa.store(int(isa));
}

const KernelTable &kernels() {
    switch (get_cpu_isa()) {
    case CpuIsa::AVX512: return kernels_avx512();
    case CpuIsa::AVX2: return kernels_avx2();
    case CpuIsa::SCALAR: break;
    }
    return kernels_scalar();
}

// ---------------------------------------------------------------------------------------------
// elementwise and row ops

void add_bias(float *y, const float *b, int64_t n_tok, int64_t n_out) {
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t o = 0; o < n_out; ++o) y[t * n_out + o] += b[o];
}

void convert_row_from_f32(DType t, const float *src, void *dst, int64_t n) {
    auto *h = static_cast<uint16_t *>(dst);
    switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * sizeof(float)); return;
    case DType::F16:
        for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(src[i]);
        return;
    case DType::BF16:
        for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(src[i]);
        return;
    case DType::Q8_0: quantize_row_q8_0(src, static_cast<BlockQ8_0 *>(dst), n); return;
    default: break;
    }
    fail("convert_row_from_f32: no quantizer for {} (f32, f16, bf16, q8_0 only)", dtype_name(t));
}

void get_rows(const TensorView &table, const int32_t *ids, int64_t n_tok, float *out) {
    const int64_t n = table.ne[0];
    const KernelTable::ConvertFn convert = kernels().convert[dtype_index(table.type)];
    for (int64_t t = 0; t < n_tok; ++t) {
        PRESCOPE_ASSERT(ids[t] >= 0 && ids[t] < table.ne[1]);
        convert(table.row(ids[t]), table.row_bytes(), 1, n, out + t * n);
    }
}

void rms_norm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y) {
    const int nth = threads_here();
#pragma omp parallel for num_threads(nth) if (nth > 1 && n_rows > 1 && n_rows * n >= kParallelMinElems)
    for (int64_t r = 0; r < n_rows; ++r) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        // Eight partial sums: vectorizable without reassociating a single F32 chain.
        float part[8] = {};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; ++j) part[j] += xr[i + j] * xr[i + j];
        double sum = 0.0;
        for (float p : part) sum += p;
        for (; i < n; ++i) sum += double(xr[i]) * xr[i];
        // HF Qwen3MoeRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)), in F32.
        const float scale = float(1.0 / std::sqrt(sum / double(n) + double(eps)));
        for (int64_t k = 0; k < n; ++k) yr[k] = w[k] * (xr[k] * scale);
    }
}

std::vector<float> rope_inv_freq(int64_t head_dim, float freq_base, const RopeYarn *yarn) {
    PRESCOPE_ASSERT(head_dim % 2 == 0);
    const int64_t half = head_dim / 2;
    // Angles as HF computes them (Qwen3MoeRotaryEmbedding / _compute_default_rope_parameters), in F32:
    // inv_freq = 1 / base^(2i/d), theta = float(pos) * inv_freq, then cos and sin of that F32 angle.
    std::vector<float> inv_freq(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i)
        inv_freq[size_t(i)] = 1.0f / std::pow(freq_base, float(2 * i) / float(head_dim));
    if (yarn) {
        // HF blends the inverse frequencies (inv_freq = interp * (1 - mix) + extrap * mix); ggml the angles.
        const auto corr_dim = [&](float n_rot) {
            return float(head_dim) * std::log(float(yarn->n_ctx_orig) / (n_rot * 2.0f * float(M_PI))) /
                   (2.0f * std::log(freq_base));
        };
        const float low = std::max(0.0f, std::floor(corr_dim(yarn->beta_fast)));
        const float high = std::min(float(head_dim - 1), std::ceil(corr_dim(yarn->beta_slow)));
        for (int64_t i = 0; i < half; ++i) {
            const float ramp = std::clamp((float(i) - low) / std::max(0.001f, high - low), 0.0f, 1.0f);
            const float mix = (1.0f - ramp) * yarn->ext_factor;
            const float f = inv_freq[size_t(i)];
            inv_freq[size_t(i)] = f * yarn->freq_scale * (1.0f - mix) + f * mix;
        }
    }
    return inv_freq;
}

void rope(float *x, int64_t n_tok, int64_t n_head, int64_t head_dim, const int32_t *pos, float freq_base,
          RopeMode mode, const RopeYarn *yarn) {
    const int64_t half = head_dim / 2;
    const std::vector<float> inv_freq = rope_inv_freq(head_dim, freq_base, yarn);
    const float mscale = yarn ? yarn->mscale : 1.0f;
    const int nth = threads_here();
#pragma omp parallel num_threads(nth) if (nth > 1 && n_tok > 1 && n_tok * n_head * head_dim >= kParallelMinElems)
    {
        std::vector<float> cs(static_cast<size_t>(2 * half));  // cos, sin of each pair's angle for one token
#pragma omp for
        for (int64_t t = 0; t < n_tok; ++t) {
            for (int64_t i = 0; i < half; ++i) {
                const float theta = float(pos[t]) * inv_freq[size_t(i)];
                cs[size_t(2 * i)] = std::cos(theta) * mscale;
                cs[size_t(2 * i + 1)] = std::sin(theta) * mscale;
            }
            for (int64_t h = 0; h < n_head; ++h) {
                float *v = x + (t * n_head + h) * head_dim;
                // NORM pairs neighbours (ggml rope_yarn on x[2i], x[2i+1]); NEOX pairs the two halves.
                const int64_t stride = mode == RopeMode::NORM ? 1 : half;
                for (int64_t i = 0; i < half; ++i) {
                    const int64_t i0 = mode == RopeMode::NORM ? 2 * i : i;
                    const float c = cs[size_t(2 * i)], s = cs[size_t(2 * i + 1)];
                    const float a = v[i0], b = v[i0 + stride];
                    v[i0] = a * c - b * s;
                    v[i0 + stride] = a * s + b * c;
                }
            }
        }
    }
}

void softmax(float *x, int64_t n_rows, int64_t n) {
    const int nth = threads_here();
#pragma omp parallel for num_threads(nth) if (nth > 1 && n_rows > 1 && n_rows * n >= kParallelMinElems)
    for (int64_t r = 0; r < n_rows; ++r) {
        float *v = x + r * n;
        const float mx = *std::max_element(v, v + n);
        double sum = 0.0;
        for (int64_t i = 0; i < n; ++i) {
            v[i] = std::exp(v[i] - mx);
            sum += v[i];
        }
        const float inv = float(1.0 / sum);
        for (int64_t i = 0; i < n; ++i) v[i] *= inv;
    }
}

void swiglu(const float *gate, const float *up, float *out, int64_t n) {
    const int nth = threads_here();
#pragma omp parallel for num_threads(nth) if (nth > 1 && n >= kParallelMinElems)
    for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        out[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
}

void swiglu_oai(const float *gate, const float *up, float *out, int64_t n, float alpha, float limit) {
    const int nth = threads_here();
#pragma omp parallel for num_threads(nth) if (nth > 1 && n >= kParallelMinElems)
    for (int64_t i = 0; i < n; ++i) {
        // The clamps are part of the model as trained (HF GptOssExperts): the gate from above only, up both ways.
        const float g = std::min(gate[i], limit);
        const float u = std::clamp(up[i], -limit, limit);
        out[i] = g / (1.0f + std::exp(-alpha * g)) * (u + 1.0f);
    }
}

void top_k(const float *scores, int64_t n, int64_t k, int32_t *ids, float *values) {
    PRESCOPE_ASSERT(k >= 0 && k <= n);
    std::vector<int32_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    // Descending score, ties to the lower index; NaN ranks below every number (a strict weak order).
    const auto before = [scores](int32_t a, int32_t b) {
        const float sa = scores[a], sb = scores[b];
        const bool na = std::isnan(sa), nb = std::isnan(sb);
        if (na != nb) return nb;
        if (!na && sa != sb) return sa > sb;
        return a < b;
    };
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), before);
    for (int64_t i = 0; i < k; ++i) {
        ids[i] = idx[size_t(i)];
        values[i] = scores[idx[size_t(i)]];
    }
}

void route(const RouterSpec &spec, float *logits, int64_t n_tok, int64_t n_expert, int64_t k, int32_t *ids,
           float *weights) {
    constexpr int64_t kMax = 1024;
    PRESCOPE_ASSERT(n_expert <= kMax && k <= n_expert && spec.n_group >= 1 && n_expert % spec.n_group == 0);
    float *probs = logits;
    if (spec.logit_bias) add_bias(probs, spec.logit_bias, n_tok, n_expert);
    if (spec.score == RouterScore::SIGMOID) {
        for (int64_t i = 0; i < n_tok * n_expert; ++i) probs[i] = 1.0f / (1.0f + std::exp(-probs[i]));
    } else if (spec.score == RouterScore::SOFTMAX) {
        softmax(probs, n_tok, n_expert);
    }
    const bool choose_apart = spec.select_bias || spec.n_group > 1;  // choosing scores differ from the weights
    const int64_t per_group = n_expert / spec.n_group;
    std::array<float, kMax> choice, group_score;
    std::array<int32_t, kMax> group_ids;
    for (int64_t t = 0; t < n_tok; ++t) {
        const float *p = probs + t * n_expert;
        int32_t *id = ids + t * k;
        float *w = weights + t * k;
        if (!choose_apart) {
            top_k(p, n_expert, k, id, w);
        } else {
            // DeepSeek-V3 (HF DeepseekV3TopkRouter, llama.cpp build_moe_ffn): choose on score + bias; keep only
            // the groups with the largest sums of their two best choosing scores; the weights are the unbiased
            // scores of the chosen experts.
            for (int64_t e = 0; e < n_expert; ++e)
                choice[size_t(e)] = p[e] + (spec.select_bias ? spec.select_bias[e] : 0.0f);
            if (spec.n_group > 1) {
                for (int64_t g = 0; g < spec.n_group; ++g) {
                    float best[2];
                    int32_t unused[2];
                    top_k(choice.data() + g * per_group, per_group, 2, unused, best);
                    group_score[size_t(g)] = best[0] + best[1];
                }
                std::array<float, kMax> kept;
                top_k(group_score.data(), spec.n_group, spec.n_group_used, group_ids.data(), kept.data());
                std::array<bool, kMax> keep{};
                for (int64_t j = 0; j < spec.n_group_used; ++j) keep[size_t(group_ids[size_t(j)])] = true;
                for (int64_t e = 0; e < n_expert; ++e) {
                    if (!keep[size_t(e / per_group)]) choice[size_t(e)] = -INFINITY;
                }
            }
            top_k(choice.data(), n_expert, k, id, w);
            for (int64_t j = 0; j < k; ++j) w[j] = p[id[j]];
        }
        // HF GptOssTopKRouter, llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT: softmax over the k chosen.
        if (spec.softmax_topk) softmax(w, 1, k);
        if (spec.renorm) {
            float sum = 0.0f;
            for (int64_t j = 0; j < k; ++j) sum += w[j];
            for (int64_t j = 0; j < k; ++j) w[j] /= sum;
        }
        if (spec.scale != 1.0f) {
            for (int64_t j = 0; j < k; ++j) w[j] *= spec.scale;
        }
    }
}

} // namespace prescope::cpu
