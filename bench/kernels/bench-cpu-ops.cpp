// Micro-benchmarks of the CPU kernels (backend/cpu/ops.h) at Qwen3-30B-A3B shapes, read against the
// machine's memory bandwidth measured in the same run.
//
//   ninja -C build bench-cpu-ops
//   build/bin/bench-cpu-ops [--threads=N] [--isa=scalar|avx2|avx512] [--activations=int8|f32]
//       --benchmark_min_time=0.2 [--benchmark_filter=REGEX]
//       [--benchmark_out=cpu-ops.json --benchmark_out_format=json]
// --activations: how quantized weights meet activations (core/dtype.h ActivationQuant; default int8).
//
// Rows:
// - mem_read: all threads summing a buffer of twice the L3 size: the bandwidth baseline.
// - matmul/<dtype>/<n_in>x<n_out>/tok:<n>: one expert matrix (2048x768 gate/up, 768x2048 down), the
//   weights cycled through a pool of copies larger than L3 so every call reads them from DRAM, as
//   MoE decode does. GB/s counts weight bytes; of_mem = GB/s / mem_read; GFLOP/s = 2*n_in*n_out*n_tok.
// - matmul_hot/<dtype>/2048x128: one small matrix again and again (in cache): the kernel's compute
//   speed, to set against one core's share of mem_read. Every weight type (the quantized ones other
//   than Q8_0 as random blocks, tests/common/random-blocks.h).
// - quantize/<q8_0|q8_1|q8_K>/2048: one token's activations quantized for the integer dot products.
// - sgemm_openblas: the same product on F32 weights by one multi-threaded OpenBLAS sgemm call (the
//   baseline of the sgemm path).
// - matmul_path/<dtype>/2048x768/tok:<n>/path:<p>: one product forced through GEMV (0), F32 tiles +
//   own register-blocked GEMM (1) or F32 tiles + OpenBLAS sgemm (2): sets the crossover and backend.
// - experts8_batch vs experts8_loop: one matmul_batch over 8 experts vs 8 matmul calls (decode).
// - attention/decode, attention/prefill: Qwen3-30B-A3B heads (32 query, 4 KV, head_dim 128).
#include "../../tests/common/random-blocks.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/ops.h"
#include "core/dtype.h"

#include <benchmark/benchmark.h>
#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

extern "C" void openblas_set_num_threads(int num_threads);

using namespace prescope;
using namespace prescope::cpu;

namespace {

double g_mem_bytes_per_s = 0.0;  // measured by mem_read before the benchmarks run

size_t pool_bytes() {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    const size_t two_l3 = l3 > 0 ? 2 * size_t(l3) : 0;
    return std::clamp<size_t>(two_l3, size_t(256) << 20, size_t(1) << 30);
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (float &e : v) e = dist(rng);
    return v;
}

/// A matrix of the given dtype, made from random F32 with core/dtype.h's conversions (random blocks for
/// the quantized types PreScope does not write).
std::vector<uint8_t> make_matrix(DType type, int64_t n_in, int64_t n_out) {
    if (dtype_is_quantized(type) && type != DType::Q8_0) return test::random_weights(type, n_out, n_in, 42);
    const std::vector<float> f = random_floats(size_t(n_in * n_out), 42);
    const size_t row_bytes = dtype_row_bytes(type, n_in);
    std::vector<uint8_t> m(row_bytes * size_t(n_out));
    for (int64_t r = 0; r < n_out; ++r)
        convert_row_from_f32(type, f.data() + r * n_in, m.data() + size_t(r) * row_bytes, n_in);
    return m;
}

/// Copies of one matrix filling pool_bytes(), so that cycling through them misses every cache. The
/// last pool is kept: benchmarks of one shape and dtype run one after another.
struct Pool {
    DType type;
    int64_t n_in, n_out;
    size_t matrix_bytes, n_copies;
    std::unique_ptr<uint8_t[]> data;
    const uint8_t *matrix(size_t i) const { return data.get() + (i % n_copies) * matrix_bytes; }
};

const Pool &get_pool(DType type, int64_t n_in, int64_t n_out) {
    static Pool pool{DType::F32, 0, 0, 0, 0, nullptr};
    if (pool.data && pool.type == type && pool.n_in == n_in && pool.n_out == n_out) return pool;
    pool.data.reset();
    const std::vector<uint8_t> m = make_matrix(type, n_in, n_out);
    pool = {type, n_in, n_out, m.size(), std::max<size_t>(2, pool_bytes() / m.size()), nullptr};
    pool.data.reset(new uint8_t[pool.matrix_bytes * pool.n_copies]);
    for (size_t c = 0; c < pool.n_copies; ++c) std::memcpy(pool.data.get() + c * pool.matrix_bytes, m.data(), m.size());
    return pool;
}

void set_bandwidth_counters(benchmark::State &state, double bytes_per_iter, double flops_per_iter) {
    const double iters = double(state.iterations());
    state.counters["GB/s"] = benchmark::Counter(bytes_per_iter * iters / 1e9, benchmark::Counter::kIsRate);
    state.counters["of_mem"] = benchmark::Counter(bytes_per_iter * iters / g_mem_bytes_per_s, benchmark::Counter::kIsRate);
    if (flops_per_iter > 0)
        state.counters["GFLOP/s"] = benchmark::Counter(flops_per_iter * iters / 1e9, benchmark::Counter::kIsRate);
}

// ---------------------------------------------------------------------------------------------

/// Sum of a buffer by all threads; returns seconds for one pass.
double read_pass(const float *buf, size_t n, float *sink) {
    const auto t0 = std::chrono::steady_clock::now();
    float total = 0.0f;
#pragma omp parallel for num_threads(get_threads()) reduction(+ : total) schedule(static)
    for (size_t i = 0; i < n; i += 16) {
        float s = 0.0f;
        for (size_t j = 0; j < 16; ++j) s += buf[i + j];
        total += s;
    }
    *sink += total;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct ReadBuffer {
    std::vector<float> v;
    ReadBuffer() : v(pool_bytes() / sizeof(float), 1.0f) {}
};

ReadBuffer &read_buffer() {
    static ReadBuffer b;
    return b;
}

void measure_memory_bandwidth() {
    const auto &v = read_buffer().v;
    float sink = 0.0f;
    double best = 1e30;
    for (int i = 0; i < 5; ++i) best = std::min(best, read_pass(v.data(), v.size(), &sink));
    g_mem_bytes_per_s = double(v.size() * sizeof(float)) / best;
    benchmark::DoNotOptimize(sink);
}

void BM_mem_read(benchmark::State &state) {
    const auto &v = read_buffer().v;
    float sink = 0.0f;
    for (auto _ : state) read_pass(v.data(), v.size(), &sink);
    benchmark::DoNotOptimize(sink);
    set_bandwidth_counters(state, double(v.size() * sizeof(float)), 0);
}

void BM_matmul(benchmark::State &state, DType type, int64_t n_in, int64_t n_out) {
    const int64_t n_tok = state.range(0);
    const Pool &pool = get_pool(type, n_in, n_out);
    const std::vector<float> x = random_floats(size_t(n_tok * n_in), 7);
    std::vector<float> y(size_t(n_tok * n_out));
    size_t i = 0;
    for (auto _ : state) {
        matmul(type, pool.matrix(i++), n_in, n_out, x.data(), n_tok, y.data());
        benchmark::ClobberMemory();
    }
    set_bandwidth_counters(state, double(pool.matrix_bytes), 2.0 * double(n_in * n_out * n_tok));
}

/// One small matrix (2048x128) multiplied again and again, so it stays in cache: the kernel's compute
/// speed without DRAM, to read against one core's share of mem_read (run with --threads=1).
void BM_matmul_hot(benchmark::State &state, DType type) {
    const int64_t n_in = 2048, n_out = 128, n_tok = state.range(0);
    const std::vector<uint8_t> w = make_matrix(type, n_in, n_out);
    const std::vector<float> x = random_floats(size_t(n_tok * n_in), 7);
    std::vector<float> y(size_t(n_tok * n_out));
    for (auto _ : state) {
        matmul(type, w.data(), n_in, n_out, x.data(), n_tok, y.data());
        benchmark::ClobberMemory();
    }
    set_bandwidth_counters(state, double(w.size()), 2.0 * double(n_in * n_out * n_tok));
}

void BM_sgemm_openblas(benchmark::State &state, int64_t n_in, int64_t n_out) {
    const int64_t n_tok = state.range(0);
    const Pool &pool = get_pool(DType::F32, n_in, n_out);
    const std::vector<float> x = random_floats(size_t(n_tok * n_in), 7);
    std::vector<float> y(size_t(n_tok * n_out));
    openblas_set_num_threads(get_threads());
    size_t i = 0;
    for (auto _ : state) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n_tok), int(n_out), int(n_in), 1.0f, x.data(),
                    int(n_in), reinterpret_cast<const float *>(pool.matrix(i++)), int(n_in), 0.0f, y.data(), int(n_out));
        benchmark::ClobberMemory();
    }
    openblas_set_num_threads(1);
    set_bandwidth_counters(state, double(pool.matrix_bytes), 2.0 * double(n_in * n_out * n_tok));
}

/// Same product forced through one path: range(1) = 0 GEMV, 1 tiles + own GEMM, 2 tiles + OpenBLAS.
void BM_matmul_path(benchmark::State &state, DType type) {
    const int64_t n_in = 2048, n_out = 768, n_tok = state.range(0), path = state.range(1);
    const Pool &pool = get_pool(type, n_in, n_out);
    const std::vector<float> x = random_floats(size_t(n_tok * n_in), 7);
    std::vector<float> y(size_t(n_tok * n_out));
    const int64_t saved_min = gemm_min_tokens();
    const GemmBackend saved_backend = gemm_backend();
    set_gemm_min_tokens(path == 0 ? n_tok + 1 : 1);
    set_gemm_backend(path == 2 ? GemmBackend::OPENBLAS : GemmBackend::OWN);
    size_t i = 0;
    for (auto _ : state) {
        matmul(type, pool.matrix(i++), n_in, n_out, x.data(), n_tok, y.data());
        benchmark::ClobberMemory();
    }
    set_gemm_min_tokens(saved_min);
    set_gemm_backend(saved_backend);
    set_bandwidth_counters(state, double(pool.matrix_bytes), 2.0 * double(n_in * n_out * n_tok));
}

/// Decode of one MoE layer's up projections: 8 experts, one token each. range(0) = 1: one
/// matmul_batch; 0: eight matmul calls (one parallel region each).
void BM_experts8(benchmark::State &state, DType type) {
    const int64_t n_in = 2048, n_out = 768, n_exp = 8;
    const Pool &pool = get_pool(type, n_in, n_out);
    const std::vector<float> x = random_floats(size_t(n_exp * n_in), 7);
    std::vector<float> y(size_t(n_exp * n_out));
    size_t i = 0;
    for (auto _ : state) {
        if (state.range(0)) {
            MatmulJob jobs[n_exp];
            for (int64_t e = 0; e < n_exp; ++e) jobs[e] = {pool.matrix(i++), x.data() + e * n_in, 1, y.data() + e * n_out};
            matmul_batch(type, n_in, n_out, jobs, n_exp);
        } else {
            for (int64_t e = 0; e < n_exp; ++e)
                matmul(type, pool.matrix(i++), n_in, n_out, x.data() + e * n_in, 1, y.data() + e * n_out);
        }
        benchmark::ClobberMemory();
    }
    set_bandwidth_counters(state, double(n_exp * pool.matrix_bytes), 2.0 * double(n_exp * n_in * n_out));
}

/// One token's activations (n = 2048) quantized to activation type a with the selected ISA's quantizer.
void BM_quantize(benchmark::State &state, DType a) {
    const int64_t n = 2048;
    const std::vector<float> x = random_floats(size_t(n), 7);
    std::vector<uint8_t> q(dtype_row_bytes(a, n));
    for (auto _ : state) {
        kernels().quantize[act_index(a)](x.data(), q.data(), n);
        benchmark::ClobberMemory();
    }
    set_bandwidth_counters(state, double(n * 4), 0);
}

/// range(0) new tokens after range(1) cached positions; 32 query heads, 4 KV heads, head_dim 128.
void BM_attention(benchmark::State &state) {
    const int64_t n_tok = state.range(0), pos0 = state.range(1), n_head = 32, n_head_kv = 4, hd = 128;
    const int64_t n_pos = pos0 + n_tok;
    const std::vector<float> q = random_floats(size_t(n_tok * n_head * hd), 1);
    const std::vector<float> k = random_floats(size_t(n_pos * n_head_kv * hd), 2);
    const std::vector<float> v = random_floats(size_t(n_pos * n_head_kv * hd), 3);
    std::vector<float> out(q.size());
    for (auto _ : state) {
        attention(q.data(), k.data(), v.data(), n_tok, pos0, n_head, n_head_kv, hd, 1.0f / std::sqrt(float(hd)),
                  out.data());
        benchmark::ClobberMemory();
    }
    // K and V bytes each query token reads (causal), and 4 flops per (query head, position, dim).
    double kv_bytes = 0, flops = 0;
    for (int64_t t = 0; t < n_tok; ++t) {
        kv_bytes += double(pos0 + t + 1) * double(n_head_kv * hd) * 2 * sizeof(float);
        flops += 4.0 * double(pos0 + t + 1) * double(n_head * hd);
    }
    set_bandwidth_counters(state, kv_bytes, flops);
}

/// Adds the fastest repetition to the aggregates (--benchmark_repetitions=N): on a shared machine the
/// minimum is the least disturbed run.
benchmark::internal::Benchmark *with_min(benchmark::internal::Benchmark *b) {
    return b->ComputeStatistics("min", [](const std::vector<double> &v) { return *std::min_element(v.begin(), v.end()); });
}

template <class... A>
benchmark::internal::Benchmark *add(const std::string &name, A &&...args) {
    return with_min(benchmark::RegisterBenchmark(name.c_str(), std::forward<A>(args)...));
}

void register_benchmarks() {
    add("mem_read", BM_mem_read)->UseRealTime()->Unit(benchmark::kMillisecond);
    const struct {
        int64_t n_in, n_out;
    } shapes[] = {{2048, 768}, {768, 2048}};
    const DType types[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_K, DType::Q6_K};
    const DType all_types[] = {DType::F32,  DType::F16,  DType::BF16,   DType::Q8_0,   DType::Q4_0,  DType::Q4_1,
                               DType::Q5_0, DType::Q5_1, DType::Q2_K,   DType::Q3_K,   DType::Q4_K,  DType::Q5_K,
                               DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS, DType::MXFP4};
    for (auto s : shapes) {
        for (DType t : types) {
            const std::string name =
                std::string("matmul/") + dtype_name(t) + "/" + std::to_string(s.n_in) + "x" + std::to_string(s.n_out);
            add(name.c_str(), BM_matmul, t, s.n_in, s.n_out)
                ->ArgName("tok")
                ->Args({1})->Args({4})->Args({8})->Args({32})->Args({512})
                ->UseRealTime()
                ->Unit(benchmark::kMicrosecond);
        }
        const std::string name = "sgemm_openblas/f32/" + std::to_string(s.n_in) + "x" + std::to_string(s.n_out);
        add(name.c_str(), BM_sgemm_openblas, s.n_in, s.n_out)
            ->ArgName("tok")->Args({32})->Args({512})->UseRealTime()->Unit(benchmark::kMicrosecond);
    }
    for (DType t : all_types) {
        add((std::string("matmul_hot/") + dtype_name(t) + "/2048x128").c_str(),
                                     BM_matmul_hot, t)
            ->ArgName("tok")->Args({1})->Args({8})->UseRealTime()->Unit(benchmark::kMicrosecond);
    }
    for (DType a : {DType::Q8_0, DType::Q8_1, DType::Q8_K}) {
        add((std::string("quantize/") + dtype_name(a) + "/2048").c_str(), BM_quantize, a)
            ->UseRealTime()->Unit(benchmark::kMicrosecond);
    }
    for (DType t : {DType::BF16, DType::Q8_0, DType::Q4_K, DType::Q6_K}) {
        add((std::string("matmul_path/") + dtype_name(t) + "/2048x768").c_str(),
                                     BM_matmul_path, t)
            ->ArgNames({"tok", "path"})
            ->ArgsProduct({{4, 8, 12, 16, 24, 32, 64, 512}, {0, 1, 2}})
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
        add((std::string("experts8/") + dtype_name(t) + "/2048x768").c_str(), BM_experts8, t)
            ->ArgName("batch")->Args({0})->Args({1})->UseRealTime()->Unit(benchmark::kMicrosecond);
    }
    add("attention/decode", BM_attention)
        ->ArgNames({"tok", "pos0"})->Args({1, 512})->Args({1, 4096})->UseRealTime()->Unit(benchmark::kMicrosecond);
    add("attention/prefill", BM_attention)
        ->ArgNames({"tok", "pos0"})->Args({512, 0})->UseRealTime()->Unit(benchmark::kMillisecond);
}

} // namespace

int main(int argc, char **argv) {
    // Our flags first (--threads=N, --isa=NAME); the rest goes to Google Benchmark.
    std::vector<char *> rest;
    int threads = 0;
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        if (a.rfind("--threads=", 0) == 0) {
            threads = std::stoi(a.substr(10));
        } else if (a.rfind("--isa=", 0) == 0) {
            const std::string isa = a.substr(6);
            set_cpu_isa(isa == "scalar" ? CpuIsa::SCALAR : isa == "avx2" ? CpuIsa::AVX2 : CpuIsa::AVX512);
        } else if (a.rfind("--activations=", 0) == 0) {
            set_activation_quant(a.substr(14) == "f32" ? ActivationQuant::NONE : ActivationQuant::INT8);
        } else {
            rest.push_back(argv[i]);
        }
    }
    set_threads(threads);
    int rest_argc = int(rest.size());
    benchmark::Initialize(&rest_argc, rest.data());
    measure_memory_bandwidth();
    const char *act = activation_quant() == ActivationQuant::INT8 ? "int8" : "f32";
    std::printf("cpu kernels: isa %s, %d threads (%d physical cores), %s activations; memory read bandwidth "
                "%.1f GB/s (%zu MiB buffer)\n",
                cpu_isa_name(get_cpu_isa()), get_threads(), physical_cores(), act, g_mem_bytes_per_s / 1e9,
                pool_bytes() >> 20);
    benchmark::AddCustomContext("cpu_isa", cpu_isa_name(get_cpu_isa()));
    benchmark::AddCustomContext("activations", act);
    benchmark::AddCustomContext("threads", std::to_string(get_threads()));
    benchmark::AddCustomContext("mem_read_GBps", std::to_string(g_mem_bytes_per_s / 1e9));
    register_benchmarks();
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}
