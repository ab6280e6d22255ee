// The default thread count (backend/cpu/ops.h): physical cores in the affinity mask, capped by the cgroup CPU
// quota, read here from made-up cgroup trees (v2 and v1, nested, containers).
#include "backend/cpu/ops.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

using namespace prescope::cpu;
namespace fs = std::filesystem;

namespace {

struct FakeCgroups {
    fs::path root = fs::temp_directory_path() / ("prescope-cgroup-" + std::to_string(getpid()));
    FakeCgroups() {
        fs::remove_all(root);
        fs::create_directories(root / "sys");
    }
    ~FakeCgroups() { fs::remove_all(root); }
    void file(const std::string &rel, const std::string &text) {
        const fs::path p = root / "sys" / rel;
        fs::create_directories(p.parent_path());
        std::ofstream(p) << text;
    }
    int limit(const std::string &proc_self_cgroup) {
        std::ofstream(root / "cgroup") << proc_self_cgroup;
        return cgroup_cpu_limit((root / "cgroup").string(), (root / "sys").string());
    }
};

} // namespace

TEST(Threads, CgroupV2Quota) {
    FakeCgroups c;
    c.file("cpu.max", "max 100000\n");
    EXPECT_EQ(c.limit("0::/\n"), 0);  // no quota
    c.file("user.slice/job/cpu.max", "150000 100000\n");
    EXPECT_EQ(c.limit("0::/user.slice/job\n"), 2);  // 1.5 CPUs round up
    c.file("user.slice/cpu.max", "50000 100000\n");
    EXPECT_EQ(c.limit("0::/user.slice/job\n"), 1);  // a parent's quota is lower: it applies
    // A container: /proc/self/cgroup says "/" and the mount root is its own cgroup.
    c.file("cpu.max", "400000 100000\n");
    EXPECT_EQ(c.limit("0::/\n"), 4);
}

TEST(Threads, CgroupV1Quota) {
    FakeCgroups c;
    c.file("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000\n");
    c.file("cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
    EXPECT_EQ(c.limit("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"), 3);
    c.file("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n");  // v1's "no quota"
    EXPECT_EQ(c.limit("4:cpu,cpuacct:/docker/abc\n"), 0);
    EXPECT_EQ(c.limit("garbage\n"), 0);
}

TEST(Threads, DefaultIsAtLeastOneAndAtMostTheCpusWeMayUse) {
    const int n = physical_cores();
    EXPECT_GE(n, 1);
    cpu_set_t set;
    ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
    EXPECT_LE(n, CPU_COUNT(&set));
    const int quota = cgroup_cpu_limit();
    if (quota > 0) EXPECT_LE(n, quota);
}
