// Memory checks (core/memory.h): the available-memory estimate, the one-line error, and fault injection
// through every large allocation of the CPU engine and of the offload machinery: each failure is a
// prescope::Error saying "out of memory", never a crash or a leak (the sanitizer build checks the latter).
#include "arch/arch.h"
#include "core/error.h"
#include "core/memory.h"
#include "offload/expert-cache.h"
#include "offload/expert-store.h"
#include "offload/fake-backend.h"
#include "runtime/context.h"
#include "../common/tiny-model.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

using namespace prescope;

namespace {

std::string tiny_model() {
    const std::string p =
        (std::filesystem::temp_directory_path() / ("prescope-memory-" + std::to_string(getpid()) + ".gguf")).string();
    test::write_tiny_model(p, {});
    return p;
}

// Runs f with the allocation check number n failing; true when that check was reached (f then threw the
// out-of-memory Error, which is what the test checks), false when f completed with fewer checks.
template <typename F>
bool fails_cleanly_at(int64_t n, F &&f) {
    inject_allocation_failure(n);
    try {
        f();
    } catch (const Error &e) {
        const bool fired = injected_allocation_failure_fired();
        inject_allocation_failure(-1);
        EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << "check " << n << ": " << e.what();
        EXPECT_TRUE(fired) << "check " << n << ": an Error that was not injected: " << e.what();
        return true;
    }
    const bool fired = injected_allocation_failure_fired();
    inject_allocation_failure(-1);
    EXPECT_FALSE(fired) << "check " << n << " fired but nothing failed";
    return false;
}

} // namespace

TEST(Memory, AvailableIsPositiveAndNamesItsSource) {
    const HostMemory m = host_memory_available();
    EXPECT_GT(m.available_bytes, uint64_t(16) << 20);
    EXPECT_FALSE(m.limited_by.empty());
    EXPECT_NO_THROW(check_host_memory(1 << 20, "a small buffer"));
}

TEST(Memory, TooLargeIsOneLineWithBothNumbers) {
    try {
        check_host_memory(uint64_t(1) << 60, "the test buffer");
        FAIL() << "2^60 bytes were available";
    } catch (const Error &e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("out of memory: the test buffer: 1152921504606846976 bytes (1073741824.0 GiB) needed, "),
                  std::string::npos) << msg;
        EXPECT_NE(msg.find("available (limited by "), std::string::npos) << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
}

// ulimit -v is one of the limits: a child with a small address-space limit sees it as the bound.
TEST(Memory, AddressSpaceLimitBounds) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        const HostMemory before = host_memory_available();
        struct rlimit rl {};
        getrlimit(RLIMIT_AS, &rl);
        // Current size plus 256 MiB (under the sanitizers the address space is huge; skip there).
        std::ifstream status("/proc/self/status");
        std::string line;
        uint64_t vm_kib = 0;
        while (std::getline(status, line)) {
            if (line.rfind("VmSize:", 0) == 0) vm_kib = std::stoull(line.substr(7));
        }
        const uint64_t limit = vm_kib * 1024 + (uint64_t(256) << 20);
        if (vm_kib == 0 || vm_kib > (uint64_t(1) << 32)) _exit(0);
        rl.rlim_cur = limit;
        if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(0);
        const HostMemory after = host_memory_available();
        const bool ok = after.limited_by.find("RLIMIT_AS") != std::string::npos &&
                        after.available_bytes <= (uint64_t(256) << 20) && after.available_bytes < before.available_bytes;
        bool threw = false;
        try {
            check_host_memory(uint64_t(512) << 20, "half a GiB");
        } catch (const Error &e) {
            threw = std::string(e.what()).find("RLIMIT_AS (ulimit -v)") != std::string::npos;
        }
        _exit(ok && threw ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(Memory, InjectionCountsChecksAndFiresOnce) {
    inject_allocation_failure(2);
    EXPECT_FALSE(allocation_failure_due());
    EXPECT_FALSE(allocation_failure_due());
    EXPECT_FALSE(injected_allocation_failure_fired());
    EXPECT_TRUE(allocation_failure_due());
    EXPECT_TRUE(injected_allocation_failure_fired());
    EXPECT_FALSE(allocation_failure_due());
    inject_allocation_failure(-1);
    EXPECT_FALSE(allocation_failure_due());
}

// The CPU engine: KV cache and activations, the expert buffers, the logits.
TEST(Memory, EveryCpuEngineAllocationFailsCleanly) {
    const std::string path = tiny_model();
    int64_t checks = 0;
    while (fails_cleanly_at(checks, [&] {
        const auto model = Model::load(path);
        Context ctx(*model, {64, 16});
        const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
        ctx.eval(tokens, /*all_logits=*/true);
    })) {
        ++checks;
        ASSERT_LT(checks, 100);
    }
    EXPECT_GE(checks, 3);  // KV cache + activations, CPU expert buffers, the logits of 5 tokens
}

// The offload machinery: the expert store's host copy, the hot-expert table's device pool.
TEST(Memory, EveryOffloadAllocationFailsCleanly) {
    const auto model = Model::load(tiny_model());
    FakeBackend backend(FakeBackend::Config{});
    int64_t checks = 0;
    while (fails_cleanly_at(checks, [&] {
        ExpertStoreConfig sc;
        sc.drop_mapped_pages = false;
        ExpertStore store(*model, &backend, sc);
        ExpertCacheConfig cc;
        cc.n_layers = store.n_layers(), cc.n_experts = store.n_experts(), cc.top_k = int32_t(model->hp().n_expert_used);
        cc.expert_bytes = store.expert_bytes();
        cc.budget_bytes = 2 * uint64_t(cc.n_layers) * ExpertCache::slot_bytes_for(cc);
        ExpertCache cache(cc, &backend);
    })) {
        ++checks;
        ASSERT_LT(checks, 100);
    }
    EXPECT_GE(checks, 2);
    EXPECT_EQ(backend.memory_info().free_bytes, backend.memory_info().total_bytes);  // nothing left allocated
}
