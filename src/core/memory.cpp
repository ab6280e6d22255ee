#include "core/memory.h"

#include "core/error.h"

#include <sys/resource.h>

#include <fstream>
#include <limits>
#include <sstream>

namespace prescope {

namespace {

constexpr uint64_t kUnlimited = std::numeric_limits<uint64_t>::max();

// Value in bytes of a "Key:   123 kB" line of /proc/meminfo or /proc/self/status; kUnlimited when absent.
uint64_t proc_kib_field(const char *path, std::string_view key) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        if (line.compare(0, key.size(), key) != 0 || line.size() <= key.size() || line[key.size()] != ':') continue;
        std::istringstream fields(line.substr(key.size() + 1));
        uint64_t kib = 0;
        if (fields >> kib) return kib * 1024;
    }
    return kUnlimited;
}

// A number from a one-line cgroup file; kUnlimited for "max", a missing file or one that does not parse.
uint64_t cgroup_number(const std::string &path) {
    std::ifstream in(path);
    std::string text;
    if (!(in >> text) || text == "max") return kUnlimited;
    try {
        size_t used = 0;
        const uint64_t v = std::stoull(text, &used);
        return used == text.size() ? v : kUnlimited;
    } catch (const std::exception &) {
        return kUnlimited;
    }
}

// Memory left under this process's cgroup limits (v2 memory.max - memory.current, v1 memory.limit_in_bytes -
// memory.usage_in_bytes), over the cgroup and its parents up to the mount root.
uint64_t cgroup_memory_left() {
    std::ifstream in("/proc/self/cgroup");
    std::string line;
    uint64_t left = kUnlimited;
    while (std::getline(in, line)) {
        // "0::/path" (v2) or "N:memory:/path" (v1, possibly "N:memory,other:/path").
        const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos) continue;
        const std::string controllers = line.substr(a + 1, b - a - 1);
        std::string path = line.substr(b + 1);
        const bool v2 = controllers.empty();
        if (!v2 && ("," + controllers + ",").find(",memory,") == std::string::npos) continue;
        const std::string root = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
        const char *limit_file = v2 ? "/memory.max" : "/memory.limit_in_bytes";
        const char *usage_file = v2 ? "/memory.current" : "/memory.usage_in_bytes";
        for (;;) {
            const std::string dir = root + (path == "/" ? "" : path);
            const uint64_t limit = cgroup_number(dir + limit_file), usage = cgroup_number(dir + usage_file);
            if (limit != kUnlimited && usage != kUnlimited) left = std::min(left, limit > usage ? limit - usage : 0);
            if (path.empty() || path == "/") break;
            const size_t slash = path.rfind('/');
            path = slash == 0 ? "/" : path.substr(0, slash);
        }
    }
    return left;
}

// "1.5 GiB" or "12.0 MiB": the byte count is printed too, this is for reading.
std::string approx(uint64_t n) {
    return n >= (uint64_t(1) << 30) ? fmt::format("{:.1f} GiB", double(n) / double(uint64_t(1) << 30))
                                    : fmt::format("{:.1f} MiB", double(n) / double(uint64_t(1) << 20));
}

} // namespace

HostMemory host_memory_available() {
    HostMemory m{kUnlimited, "nothing"};
    auto lower = [&m](uint64_t v, const char *why) {
        if (v < m.available_bytes) m = {v, why};
    };
    const uint64_t avail = proc_kib_field("/proc/meminfo", "MemAvailable");
    const uint64_t swap = proc_kib_field("/proc/meminfo", "SwapFree");
    if (avail != kUnlimited) lower(avail + (swap != kUnlimited ? swap : 0), "MemAvailable + SwapFree");
    lower(cgroup_memory_left(), "the cgroup's memory.max");
    const uint64_t vm_size = proc_kib_field("/proc/self/status", "VmSize");
    for (const auto &[resource, why] : {std::pair{RLIMIT_AS, "RLIMIT_AS (ulimit -v)"},
                                        std::pair{RLIMIT_DATA, "RLIMIT_DATA (ulimit -d)"}}) {
        struct rlimit rl {};
        if (getrlimit(resource, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY || vm_size == kUnlimited) continue;
        lower(uint64_t(rl.rlim_cur) > vm_size ? uint64_t(rl.rlim_cur) - vm_size : 0, why);
    }
    return m;
}

void check_host_memory(uint64_t n_bytes, std::string_view what) {
    const bool injected = allocation_failure_due();
    const HostMemory m = host_memory_available();
    if (!injected && n_bytes <= m.available_bytes) return;
    if (injected) {
        fail("out of memory: {}: {} bytes ({}) needed (allocation failure injected by a test)", what, n_bytes,
             approx(n_bytes));
    }
    fail("out of memory: {}: {} bytes ({}) needed, {} bytes ({}) available (limited by {})", what, n_bytes,
         approx(n_bytes), m.available_bytes, approx(m.available_bytes), m.limited_by);
}

} // namespace prescope
