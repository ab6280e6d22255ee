// Memory checks before large allocations: a request the machine cannot hold ends in one error line giving
// the bytes needed and available, instead of an OOM kill half-way through touching it (decision 0101).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace prescope {

/// Host memory this process can still take, in bytes, and what bounds it.
struct HostMemory {
    uint64_t available_bytes = 0;
    std::string limited_by;  // "MemAvailable + SwapFree", "cgroup memory.max", "RLIMIT_AS (ulimit -v)", ...
};

/// The smallest of: MemAvailable + SwapFree (/proc/meminfo), the cgroup's memory.max - memory.current of
/// this process's cgroup and each of its parents (v2; memory.limit_in_bytes - usage for v1), and the
/// address-space and data-segment limits (RLIMIT_AS, RLIMIT_DATA) minus the current virtual size. Sources
/// that cannot be read are skipped; when none can, available_bytes is UINT64_MAX.
HostMemory host_memory_available();

/// Throws prescope::Error "out of memory: WHAT: N bytes (X GiB) needed, M bytes (Y GiB) available (limited
/// by ...)" when n_bytes exceed host_memory_available(). Call before allocating and touching a
/// buffer whose size the input decides (KV cache, activations, expert copies). Also an injection point of
/// inject_allocation_failure().
void check_host_memory(uint64_t n_bytes, std::string_view what);

/// Fault injection for tests: the allocation check number `n` from now (0: the next one) fails as if the
/// memory were not there, once; n < 0 turns injection off. The checks counted are check_host_memory() and
/// the device and pinned allocations of the backends (allocation_failure_due()). Thread-safe. Header-only,
/// so that the CUDA backend's library can call it without linking the engine's.
namespace detail {
inline std::atomic<int64_t> alloc_fail_countdown{-1};  // checks left before the injected failure; -1: none
inline std::atomic<bool> alloc_fail_fired{false};
} // namespace detail

inline void inject_allocation_failure(int64_t n) {
    detail::alloc_fail_fired.store(false);
    detail::alloc_fail_countdown.store(n < 0 ? -1 : n);
}

/// Whether the failure set by inject_allocation_failure() has fired.
inline bool injected_allocation_failure_fired() { return detail::alloc_fail_fired.load(); }

/// Counts one allocation check; true when it is the one inject_allocation_failure() chose. Backends call it
/// at the top of alloc() and throw their usual out-of-memory error when it returns true.
inline bool allocation_failure_due() {
    int64_t left = detail::alloc_fail_countdown.load();
    while (left >= 0) {
        if (detail::alloc_fail_countdown.compare_exchange_weak(left, left - 1)) {
            if (left != 0) return false;
            detail::alloc_fail_fired.store(true);
            return true;
        }
    }
    return false;
}

} // namespace prescope
