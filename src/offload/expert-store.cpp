// ExpertStore: canonical repacking of GGUF experts into host memory, page-locking, and dropping the mapping's
// copy of the repacked bytes.
#include "offload/expert-store.h"

#include "arch/arch.h"
#include "core/error.h"
#include "core/memory.h"
#include "offload/byte-size.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace prescope {

namespace {

constexpr uint64_t kPartAlign = 256;

uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// Releases the whole pages of [p, p + n) of the read-only file mapping and the page cache's copy of them
// (posix_fadvise on the file). Pages shared with bytes that were not repacked stay.
uint64_t drop_pages(const GgufFile &file, const TensorView &t) {
    const long page = sysconf(_SC_PAGESIZE);
    const auto begin = reinterpret_cast<uintptr_t>(t.data), end = begin + t.n_bytes();
    const uintptr_t a = align_up(begin, uint64_t(page)), b = end / uintptr_t(page) * uintptr_t(page);
    if (b <= a) return 0;
    madvise(reinterpret_cast<void *>(a), b - a, MADV_DONTNEED);
    if (const GgufTensorInfo *info = file.find_tensor(t.name)) {
        const int fd = ::open(file.path().c_str(), O_RDONLY);
        if (fd >= 0) {
            const off_t off = off_t(file.data_offset() + info->offset + (a - begin));
            posix_fadvise(fd, off, off_t(b - a), POSIX_FADV_DONTNEED);
            ::close(fd);
        }
    }
    return b - a;
}

TensorView single_matrix(DType type, int64_t n_in, int64_t n_out, const void *data) {
    TensorView v;
    v.type = type;
    v.ne = {n_in, n_out, 1, 1};
    v.data = data;
    return v;
}

// A view without the name: copying a long name would allocate on the decode path.
TensorView unnamed(const TensorView &t) {
    TensorView v;
    v.type = t.type;
    v.ne = t.ne;
    v.data = t.data;
    return v;
}

} // namespace

ExpertLayout ExpertLayout::of(const Model &model, int64_t layer) {
    const LayerWeights &l = model.weights().layers[size_t(layer)];
    ExpertLayout x;
    x.n_embd = model.hp().n_embd;
    if (l.gate_exps.empty()) return x;  // a dense layer: its empty views would still measure one row of 4 bytes
    x.gate_type = l.gate_exps.type;
    x.up_type = l.up_exps.type;
    x.down_type = l.down_exps.type;
    x.n_ff = l.gate_exps.ne[1];
    x.gate_bytes = l.gate_exps.matrix_bytes();
    x.up_bytes = l.up_exps.matrix_bytes();
    x.down_bytes = l.down_exps.matrix_bytes();
    x.up_offset = align_up(x.gate_bytes, kPartAlign);
    x.down_offset = x.up_offset + align_up(x.up_bytes, kPartAlign);
    x.bytes = x.down_offset + align_up(x.down_bytes, kPartAlign);
    if (l.gate_exps_b) {
        x.bias_offset = x.bytes;
        x.bytes += align_up(uint64_t(2 * x.n_ff + x.n_embd) * 4, kPartAlign);
    }
    return x;
}

ExpertStoreConfig ExpertStoreConfig::cpu_only(const Model &model) {
    ExpertStoreConfig c;
    c.fetchable.assign(size_t(model.hp().n_layer * model.hp().n_expert), 0);
    return c;
}

ExpertStore::ExpertStore(const Model &model, Backend *backend, const ExpertStoreConfig &config)
    : model_(model), backend_(backend) {
    const HParams &hp = model.hp();
    n_layers_ = int32_t(hp.n_layer);
    n_experts_ = int32_t(hp.n_expert);
    const size_t n = size_t(n_layers_) * size_t(n_experts_);
    for (const auto *mask : {&config.fetchable, &config.pinned}) {
        if (!mask->empty() && mask->size() != n) {
            fail("expert store: a mask of {} entries for {} layers x {} experts", mask->size(), n_layers_, n_experts_);
        }
    }
    auto flag = [&](const std::vector<uint8_t> &mask, size_t i) { return mask.empty() || mask[i] != 0; };

    // Offsets of every repacked expert in its region: [0] page-locked, [1] pageable.
    layouts_.reserve(size_t(n_layers_));
    std::vector<int8_t> region(n, -1);
    std::vector<uint64_t> offset(n, 0);
    for (int32_t l = 0; l < n_layers_; ++l) {
        layouts_.push_back(ExpertLayout::of(model, l));
        for (int32_t e = 0; e < n_experts_; ++e) {
            const size_t i = size_t(l) * size_t(n_experts_) + size_t(e);
            if (layouts_.back().bytes == 0 || !flag(config.fetchable, i)) continue;  // no experts, or CPU only
            region[i] = flag(config.pinned, i) ? 0 : 1;
            offset[i] = region_bytes_[region[i]];
            region_bytes_[region[i]] += layouts_.back().bytes;
        }
    }
    check_host_memory(region_bytes_[0] + region_bytes_[1], "the expert store's host copy of the experts");
    for (int r = 0; r < 2; ++r) {
        if (region_bytes_[r] == 0) continue;
        void *p = mmap(nullptr, region_bytes_[r], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            fail("expert store: cannot map {} of host memory for the experts ({})", format_byte_size(region_bytes_[r]),
                 std::strerror(errno));
        }
        // Transparent huge pages where the kernel allows them (THP "madvise" or "always"): the CPU experts'
        // reads and the copies' DMA then walk 2 MiB pages instead of some 1200 4 KiB ones per expert (decision
        // 0146). Advice only: refused (THP "never", no THP in the kernel) it changes nothing.
        madvise(p, region_bytes_[r], MADV_HUGEPAGE);
        region_[r] = static_cast<uint8_t *>(p);
    }

    host_.assign(n, nullptr);
    const auto &layers = model.weights().layers;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < int64_t(n); ++i) {
        if (region[size_t(i)] < 0) continue;
        const int64_t l = i / n_experts_, e = i % n_experts_;
        const ExpertLayout &x = layouts_[size_t(l)];
        uint8_t *dst = region_[region[size_t(i)]] + offset[size_t(i)];
        std::memcpy(dst, layers[size_t(l)].gate_exps.matrix(e), x.gate_bytes);
        std::memcpy(dst + x.up_offset, layers[size_t(l)].up_exps.matrix(e), x.up_bytes);
        std::memcpy(dst + x.down_offset, layers[size_t(l)].down_exps.matrix(e), x.down_bytes);
        if (x.bias_offset > 0) {
            const LayerWeights &lw = layers[size_t(l)];
            auto *b = reinterpret_cast<float *>(dst + x.bias_offset);
            std::copy_n(lw.gate_exps_b + e * x.n_ff, x.n_ff, b);
            std::copy_n(lw.up_exps_b + e * x.n_ff, x.n_ff, b + x.n_ff);
            std::copy_n(lw.down_exps_b + e * x.n_embd, x.n_embd, b + 2 * x.n_ff);
        }
        host_[size_t(i)] = dst;
    }
    if (config.drop_mapped_pages) {
        for (int32_t l = 0; l < n_layers_; ++l) {
            bool all = layouts_[size_t(l)].bytes > 0;
            for (int32_t e = 0; e < n_experts_; ++e) all &= region[size_t(l) * size_t(n_experts_) + size_t(e)] >= 0;
            if (!all) continue;  // the CPU still reads some of this layer's experts from the mapping
            const LayerWeights &lw = layers[size_t(l)];
            for (const TensorView *t : {&lw.gate_exps, &lw.up_exps, &lw.down_exps}) {
                dropped_bytes_ += drop_pages(model.file(), *t);
            }
        }
    }
    if (region_[0]) {
        pinned_ok_ = backend_ && backend_->host_register(region_[0], region_bytes_[0]);
        if (!pinned_ok_) {
            spdlog::warn("could not page-lock {} of expert memory ({}); expert copies run from pageable memory, "
                         "at a fraction of the link's speed (check `ulimit -l`)",
                         format_byte_size(region_bytes_[0]), backend_ ? backend_->name() + " refused" : "no device");
        }
    }
}

ExpertStore::~ExpertStore() {
    if (pinned_ok_) backend_->host_unregister(region_[0]);
    for (int r = 0; r < 2; ++r) {
        if (region_[r]) munmap(region_[r], region_bytes_[r]);
    }
}

std::vector<uint64_t> ExpertStore::expert_bytes() const {
    std::vector<uint64_t> out(size_t(n_layers_) * size_t(n_experts_));
    for (int32_t l = 0; l < n_layers_; ++l) {
        std::fill_n(out.begin() + ptrdiff_t(size_t(l) * size_t(n_experts_)), n_experts_, layouts_[size_t(l)].bytes);
    }
    return out;
}

ExpertViews ExpertStore::cpu_views(int32_t layer, int32_t expert) const {
    ExpertViews v;
    const LayerWeights &l = model_.weights().layers[size_t(layer)];
    const auto *p = static_cast<const uint8_t *>(host_expert(layer, expert));
    if (!p) {
        v.gate = unnamed(l.gate_exps);
        v.up = unnamed(l.up_exps);
        v.down = unnamed(l.down_exps);
        v.index = expert;
    } else {
        v = canonical_views(layouts_[size_t(layer)], p);
    }
    // The biases stay in the model (F32, small): the same rows whichever copy of the matrices runs.
    if (l.gate_exps_b) {
        const int64_t n_ff = l.gate_exps.ne[1], n_embd = l.down_exps.ne[1];
        v.gate_b = l.gate_exps_b + expert * n_ff;
        v.up_b = l.up_exps_b + expert * n_ff;
        v.down_b = l.down_exps_b + expert * n_embd;
    }
    return v;
}

ExpertViews ExpertStore::canonical_views(const ExpertLayout &x, const void *bytes) {
    const auto *p = static_cast<const uint8_t *>(bytes);
    ExpertViews v;
    v.gate = single_matrix(x.gate_type, x.n_embd, x.n_ff, p);
    v.up = single_matrix(x.up_type, x.n_embd, x.n_ff, p + x.up_offset);
    v.down = single_matrix(x.down_type, x.n_ff, x.n_embd, p + x.down_offset);
    v.index = 0;
    return v;
}

std::string ExpertStore::describe() const {
    // Mixed-type files give layers of different expert sizes and gate/up/down types: each combination once,
    // with its expert size and number of layers.
    std::vector<std::pair<const ExpertLayout *, int>> kinds;
    int32_t dense = 0;
    for (const ExpertLayout &x : layouts_) {
        if (x.bytes == 0) {
            ++dense;
            continue;
        }
        auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto &k) {
            return k.first->gate_type == x.gate_type && k.first->up_type == x.up_type &&
                   k.first->down_type == x.down_type && k.first->bytes == x.bytes;
        });
        if (it == kinds.end()) {
            kinds.emplace_back(&x, 1);
        } else {
            ++it->second;
        }
    }
    std::string parts;
    for (const auto &[x, n] : kinds) {
        parts += fmt::format("{}{} ({}/{}/{}){}", parts.empty() ? "" : ", ", format_byte_size(x->bytes),
                             dtype_name(x->gate_type), dtype_name(x->up_type), dtype_name(x->down_type),
                             kinds.size() > 1 ? fmt::format(" in {} layers", n) : "");
    }
    return fmt::format("expert store: {} layers x {} experts of {}{}; {} page-locked, {} pageable, "
                       "{} of the file mapping released{}",
                       n_layers_ - dense, n_experts_, parts,
                       dense > 0 ? fmt::format(" (and {} dense layer{} without experts)", dense, dense == 1 ? "" : "s")
                                 : "", format_byte_size(pinned_bytes()),
                       format_byte_size(pageable_bytes()), format_byte_size(dropped_bytes_),
                       pin_refused() ? " (page-locking refused)" : "");
}

} // namespace prescope
