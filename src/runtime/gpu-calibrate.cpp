// GPU-side calibration (CUDA builds): pinned host-to-device bandwidth by chunk size, the per-request cost, and
// one expert of the model on the GPU against tokens, run the way GpuContext::launch_gpu runs a wave (grouped
// gate / up products over slot pointers, SwiGLU, down). Event-timed on one stream.
#include "runtime/calibrate.h"

#include "arch/arch.h"
#include "backend/cuda/cuda-backend.h"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/matmul.cuh"
#include "core/error.h"
#include "offload/expert-store.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <tuple>
#include <vector>

namespace prescope {

namespace {

std::string today() {
    const std::time_t t = std::time(nullptr);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
    return buf;
}

/// Device buffers freed on scope exit.
struct DeviceBuffers {
    CudaBackend &backend;
    std::vector<std::pair<MemoryKind, void *>> held;
    void *take(MemoryKind kind, size_t bytes) {
        void *p = backend.alloc(kind, bytes);
        held.emplace_back(kind, p);
        return p;
    }
    ~DeviceBuffers() {
        for (auto [kind, p] : held) backend.free(kind, p);
    }
};

} // namespace

bool calibrate_gpu(CostProfile &p, const Model &model, int32_t device, std::string *why) {
    std::string reason;
    if (cuda_device_count(&reason) == 0) {
        if (why) *why = "no CUDA device (" + reason + ")";
        return false;
    }
    CudaBackend backend(device);
    const Stream stream = backend.stream_create();
    const Event e0 = backend.event_create(), e1 = backend.event_create();
    auto timed_us = [&](auto &&work, int reps) {
        work();  // warm-up
        backend.event_record(e0, stream);
        for (int r = 0; r < reps; ++r) work();
        backend.event_record(e1, stream);
        backend.event_synchronize(e1);
        return backend.event_elapsed_us(e0, e1) / reps;
    };
    {
        DeviceBuffers buf{backend, {}};
        // Link: 64 MiB of pinned host memory copied in chunks of each size, one stream (the copy engine's).
        const size_t total = size_t(64) << 20;
        auto *host = static_cast<uint8_t *>(buf.take(MemoryKind::HOST_PINNED, total));
        auto *dev = static_cast<uint8_t *>(buf.take(MemoryKind::DEVICE, total));
        std::memset(host, 1, total);
        p.h2d_gb_s.clear();
        for (size_t chunk : {size_t(64) << 10, size_t(256) << 10, size_t(1) << 20, size_t(4) << 20, size_t(16) << 20,
                             size_t(64) << 20}) {
            const double us = timed_us(
                [&] {
                    for (size_t off = 0; off < total; off += chunk) {
                        backend.copy_h2d_async(dev + off, host + off, std::min(chunk, total - off), stream);
                    }
                },
                3);
            p.h2d_gb_s.push_back({double(chunk), double(total) / us * 1e-3});
        }
        // Per request: a 4 KiB copy's time beyond its bytes.
        const double small = timed_us([&] { backend.copy_h2d_async(dev, host, 4096, stream); }, 200);
        p.h2d_request_us = std::max(small - 4096.0 / (p.h2d_gb_s.front().value * 1e3), 0.0);
        p.link_source = fmt::format("measured {} on {} (pinned, one stream, 64 MiB per chunk size)", today(),
                                    backend.info().name);
        p.gpu = backend.info().name;

        // Expert 0 of the first layer with experts in a slot, tokens 1 .. 512.
        const auto first = int32_t(model.hp().n_layer_dense);
        ExpertStoreConfig sc;
        sc.fetchable.assign(size_t(model.hp().n_layer * model.hp().n_expert), 0);
        sc.fetchable[size_t(first * model.hp().n_expert)] = 1;
        sc.drop_mapped_pages = false;
        const ExpertStore store(model, nullptr, sc);
        const ExpertLayout &x = store.layout(first);
        auto *slot = static_cast<uint8_t *>(buf.take(MemoryKind::DEVICE, x.bytes));
        backend.copy_h2d_async(slot, store.host_expert(first, 0), x.bytes, stream);
        const int64_t max_tokens = 512, n_embd = model.hp().n_embd;
        auto *act = static_cast<float *>(buf.take(MemoryKind::DEVICE, size_t(max_tokens * (n_embd * 2 + 2 * x.n_ff)) * 4));
        float *xin = act, *gate = act + max_tokens * n_embd, *up = gate + max_tokens * x.n_ff, *y = up + max_tokens * x.n_ff;
        std::vector<int32_t> rows_host(static_cast<size_t>(max_tokens));
        for (int64_t i = 0; i < max_tokens; ++i) rows_host[size_t(i)] = int32_t(i);
        auto *meta = static_cast<uint8_t *>(buf.take(MemoryKind::DEVICE, 4096 + size_t(max_tokens) * 4));
        const void *w_host[3] = {slot, slot + x.up_offset, slot + x.down_offset};
        backend.copy_h2d_async(meta, w_host, sizeof w_host, stream);
        backend.copy_h2d_async(meta + 1024, rows_host.data(), size_t(max_tokens) * 4, stream);
        cuda::ExpertMatmul probe;
        probe.n_expert = 1;
        const int32_t probe_off[2] = {0, int32_t(max_tokens)};
        probe.offsets_host = probe_off;
        size_t ws_bytes = 0;
        for (auto [type, n_in, n_out] : {std::tuple{x.gate_type, n_embd, x.n_ff}, std::tuple{x.down_type, x.n_ff, n_embd}}) {
            probe.type = type;
            probe.n_in = n_in;
            probe.n_out = n_out;
            ws_bytes = std::max(ws_bytes, cuda::expert_matmul_workspace_bytes(probe, cuda::MatmulPath::CUBLAS));
        }
        cuda::Workspace ws{ws_bytes ? buf.take(MemoryKind::DEVICE, ws_bytes) : nullptr, ws_bytes};
        auto *offsets_dev = reinterpret_cast<int32_t *>(meta + 512);
        const cudaStream_t st = CudaBackend::cuda_stream(stream);
        const ExpertShape shape = ExpertShape::of(x);
        ShapeTimings &t = p.shape_entry(shape.key());
        t.gpu_us.clear();
        const auto *w_dev = reinterpret_cast<const void *const *>(meta);
        for (int64_t m = 1; m <= max_tokens; m *= 2) {
            const int32_t offsets[2] = {0, int32_t(m)};
            backend.copy_h2d_async(offsets_dev, offsets, sizeof offsets, stream);
            backend.stream_synchronize(stream);  // the host array above goes out of scope per step
            cuda::ExpertMatmul g;
            g.n_expert = 1;
            g.offsets_dev = offsets_dev;
            g.offsets_host = offsets;
            g.rows_dev = reinterpret_cast<const int32_t *>(meta + 1024);
            const double us = timed_us(
                [&] {
                    g.n_in = n_embd;
                    g.n_out = x.n_ff;
                    g.type = x.gate_type;
                    g.w_dev = w_dev;
                    g.w_host = w_host;
                    g.type2 = x.up_type;
                    g.w2_dev = w_dev + 1;
                    g.w2_host = w_host + 1;
                    cuda::expert_matmul(g, xin, gate, ws, st, cuda::MatmulPath::AUTO, up);
                    cuda::swiglu(gate, up, gate, m * x.n_ff, st);
                    cuda::ExpertMatmul d = g;
                    d.w2_dev = d.w2_host = nullptr;
                    d.type = x.down_type;
                    d.n_in = x.n_ff;
                    d.n_out = n_embd;
                    d.rows_dev = nullptr;
                    d.w_dev = w_dev + 2;
                    d.w_host = w_host + 2;
                    cuda::expert_matmul(d, gate, y, ws, st);
                },
                20);
            t.gpu_us.push_back({double(m), us});
        }
        t.gpu_source = fmt::format("measured {} on {} (one expert per grouped launch, event-timed)", today(),
                                   backend.info().name);
        // One wave's fixed cost: the smallest expert time less its weight read at the device's peak.
        const double read_us = double(x.bytes) / std::max(backend.info().hbm_peak_gb_s, 1.0) * 1e-3;
        p.gpu_wave_us = std::max(t.gpu_us.front().value - read_us, 1.0);
        p.gpu_source = fmt::format("measured {} on {}: wave cost from the 1-token expert time; hbm/tflops terms of "
                                   "shapes without points are the reference's",
                                   today(), backend.info().name);
    }
    backend.event_destroy(e0);
    backend.event_destroy(e1);
    backend.stream_destroy(stream);
    return true;
}

} // namespace prescope
