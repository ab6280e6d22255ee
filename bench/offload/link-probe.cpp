// Host-to-device copy speed of expert-sized copies, alone and beside CPU threads that read host memory as the CPU
// experts do (decision 0146 left open why the H100 host's decode copies reached 13-18 GB/s where its prefill got
// 49). For each host memory kind (pinned: cudaHostAlloc; registered: anonymous mmap with MADV_HUGEPAGE, then
// cudaHostRegister, as the expert store does) and order of the copied experts (sequential, random), it times
// `--seconds` of back-to-back copies of `--expert-mib` from a `--gib` buffer, issued in `--chunk-mib` pieces on one
// stream with `--depth` experts in flight (the copy engine's shape), while 0 or `--threads` CPU threads stream
// through a second buffer of the same kind; then the CPU threads alone. Prints a table and, with --json, writes
// the rows: copy GB/s (bytes over wall time, event-synchronised) and CPU read GB/s.
//
//   prescope-link-probe [--gib 8] [--expert-mib 4.78] [--chunk-mib 4] [--depth 4] [--threads 16] [--seconds 1.5]
//       [--json out.json]
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

volatile uint64_t g_sink = 0;  // the readers' sums end here, so that their loads are not optimised away

void check(cudaError_t e, const char *what) {
    if (e != cudaSuccess) throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

/// Host memory of one kind: pinned (cudaHostAlloc) or registered (mmap + MADV_HUGEPAGE + cudaHostRegister).
struct HostBuffer {
    uint8_t *p = nullptr;
    size_t n_bytes = 0;
    bool pinned = false;
    HostBuffer(size_t n, bool pinned_alloc) : n_bytes(n), pinned(pinned_alloc) {
        if (pinned) {
            check(cudaHostAlloc(reinterpret_cast<void **>(&p), n, cudaHostAllocDefault), "cudaHostAlloc");
        } else {
            void *m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) throw std::runtime_error(fmt::format("mmap of {} bytes failed", n));
            madvise(m, n, MADV_HUGEPAGE);
            p = static_cast<uint8_t *>(m);
        }
        // Touch every page (the expert store fills its regions before registering them).
        for (size_t i = 0; i < n; i += 4096) p[i] = uint8_t(i >> 12);
        if (!pinned) check(cudaHostRegister(p, n, cudaHostRegisterReadOnly), "cudaHostRegister");
    }
    ~HostBuffer() {
        if (pinned) {
            cudaFreeHost(p);
        } else {
            cudaHostUnregister(p);
            munmap(p, n_bytes);
        }
    }
    HostBuffer(const HostBuffer &) = delete;
    HostBuffer &operator=(const HostBuffer &) = delete;
};

/// Threads that read `buf` over and over (64-bit sums, as a GEMV streams its weights) until `stop`; returns
/// the bytes read per second.
double read_while(const HostBuffer &buf, int n_threads, const std::atomic<bool> &stop) {
    std::vector<std::thread> pool;
    std::vector<uint64_t> bytes(size_t(n_threads), 0), sink(size_t(n_threads), 0);
    const size_t part = buf.n_bytes / size_t(n_threads) / 64 * 64;
    const auto t0 = Clock::now();
    for (int t = 0; t < n_threads; ++t) {
        pool.emplace_back([&, t] {
            const auto *w = reinterpret_cast<const uint64_t *>(buf.p + size_t(t) * part);
            const size_t n = part / 8;
            uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            while (!stop.load(std::memory_order_relaxed)) {
                for (size_t i = 0; i + 4 <= n; i += 4) s0 += w[i], s1 += w[i + 1], s2 += w[i + 2], s3 += w[i + 3];
                bytes[size_t(t)] += n * 8;
            }
            sink[size_t(t)] = s0 + s1 + s2 + s3;
        });
    }
    for (auto &th : pool) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    uint64_t total = 0;
    for (size_t t = 0; t < bytes.size(); ++t) {
        total += bytes[t];
        g_sink = g_sink ^ sink[t];
    }
    return double(total) / s;
}

struct Row {
    std::string memory, order;
    int cpu_threads = 0;
    double copy_gb_s = 0, cpu_read_gb_s = 0;
};

} // namespace

int main(int argc, char **argv) {
    CLI::App app{"Host-to-device copy speed of expert-sized copies, idle and beside CPU reads"};
    double gib = 8, expert_mib = 4.78, chunk_mib = 4, seconds = 1.5;
    int depth = 4, threads = int(std::max(1u, std::thread::hardware_concurrency()));
    std::string json_path;
    app.add_option("--gib", gib, "host buffer to copy from, GiB (each of two)")->check(CLI::PositiveNumber);
    app.add_option("--expert-mib", expert_mib, "bytes of one copied expert, MiB")->check(CLI::PositiveNumber);
    app.add_option("--chunk-mib", chunk_mib, "copy request size, MiB")->check(CLI::PositiveNumber);
    app.add_option("--depth", depth, "experts in flight")->check(CLI::Range(1, 64));
    app.add_option("--threads", threads, "CPU reader threads")->check(CLI::Range(1, 1024));
    app.add_option("--seconds", seconds, "time per case")->check(CLI::PositiveNumber);
    app.add_option("--json", json_path, "write the rows here");
    CLI11_PARSE(app, argc, argv);

    try {
        const size_t expert = size_t(expert_mib * (1 << 20)), chunk = size_t(chunk_mib * (1 << 20));
        const size_t buf_bytes = size_t(gib * double(size_t(1) << 30)) / expert * expert;
        if (buf_bytes < expert * size_t(depth)) throw std::runtime_error("--gib holds fewer experts than --depth");
        const size_t n_experts = buf_bytes / expert;
        uint8_t *dev = nullptr;
        check(cudaMalloc(reinterpret_cast<void **>(&dev), expert * size_t(depth)), "cudaMalloc");
        cudaStream_t stream;
        check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        std::vector<cudaEvent_t> done(static_cast<size_t>(depth));
        for (auto &e : done) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
        cudaDeviceProp prop{};
        check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

        std::vector<Row> rows;
        for (const bool pinned : {true, false}) {
            const HostBuffer src(buf_bytes, pinned), other(buf_bytes, pinned);
            const char *memory = pinned ? "pinned" : "registered";
            for (const bool random : {false, true}) {
                for (const int cpu : {0, threads}) {
                    std::mt19937_64 rng(42);
                    std::atomic<bool> stop{false};
                    double cpu_gb_s = 0;
                    std::thread readers;
                    if (cpu > 0) readers = std::thread([&] { cpu_gb_s = read_while(other, cpu, stop) * 1e-9; });
                    size_t copies = 0, next = 0;
                    const auto t0 = Clock::now();
                    double s = 0;
                    while ((s = std::chrono::duration<double>(Clock::now() - t0).count()) < seconds) {
                        const size_t slot = copies % size_t(depth);
                        if (copies >= size_t(depth)) check(cudaEventSynchronize(done[slot]), "cudaEventSynchronize");
                        const size_t e = random ? size_t(rng() % n_experts) : next++ % n_experts;
                        for (size_t off = 0; off < expert; off += chunk) {
                            check(cudaMemcpyAsync(dev + slot * expert + off, src.p + e * expert + off,
                                                  std::min(chunk, expert - off), cudaMemcpyHostToDevice, stream),
                                  "cudaMemcpyAsync");
                        }
                        check(cudaEventRecord(done[slot], stream), "cudaEventRecord");
                        ++copies;
                    }
                    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
                    s = std::chrono::duration<double>(Clock::now() - t0).count();
                    stop = true;
                    if (readers.joinable()) readers.join();
                    rows.push_back({memory, random ? "random" : "sequential", cpu, double(copies * expert) / s * 1e-9,
                                    cpu_gb_s});
                }
            }
            std::atomic<bool> stop{false};
            double cpu_gb_s = 0;
            std::thread readers([&] { cpu_gb_s = read_while(other, threads, stop) * 1e-9; });
            std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
            stop = true;
            readers.join();
            rows.push_back({memory, "none", threads, 0.0, cpu_gb_s});
        }

        fmt::print("{} | {:.2f} MiB experts in {:.2f} MiB copies, {} in flight, {} GiB buffers, {} CPU threads\n",
                   prop.name, expert_mib, chunk_mib, depth, gib, threads);
        fmt::print("| memory | order | CPU threads | copy GB/s | CPU read GB/s |\n| --- | --- | ---: | ---: | ---: |\n");
        nlohmann::json out = {{"device", prop.name}, {"expert_mib", expert_mib}, {"chunk_mib", chunk_mib},
                              {"depth", depth}, {"gib", gib}, {"threads", threads}, {"rows", nlohmann::json::array()}};
        for (const Row &r : rows) {
            fmt::print("| {} | {} | {} | {:.1f} | {:.1f} |\n", r.memory, r.order, r.cpu_threads, r.copy_gb_s,
                       r.cpu_read_gb_s);
            out["rows"].push_back({{"memory", r.memory}, {"order", r.order}, {"cpu_threads", r.cpu_threads},
                                   {"copy_gb_s", r.copy_gb_s}, {"cpu_read_gb_s", r.cpu_read_gb_s}});
        }
        if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
        for (auto &e : done) cudaEventDestroy(e);
        cudaStreamDestroy(stream);
        cudaFree(dev);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "prescope-link-probe: %s\n", e.what());
        return 1;
    }
    return 0;
}
