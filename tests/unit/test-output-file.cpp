// Output files (core/output-file.h): written under a temporary name, renamed when complete; a failure at any
// point, a full disk included, leaves neither a partial file nor the temporary behind.
#include "core/error.h"
#include "core/output-file.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>

using namespace prescope;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string &name) {
    const fs::path d = fs::temp_directory_path() / ("prescope-out-" + std::to_string(getpid()) + "-" + name);
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
}

std::string read(const fs::path &p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
}

size_t entries(const fs::path &d) { return size_t(std::distance(fs::directory_iterator(d), fs::directory_iterator())); }

} // namespace

TEST(OutputFile, AppearsOnlyWhenCommitted) {
    const fs::path d = fresh_dir("commit");
    const fs::path p = d / "out.bin";
    {
        OutputFile f(p.string());
        f.write("hello ");
        EXPECT_FALSE(fs::exists(p));
        EXPECT_TRUE(fs::exists(f.temp_path()));
        EXPECT_EQ(fs::path(f.temp_path()).parent_path(), d);  // same directory: the rename is atomic
        f.write("world");
        f.commit();
        EXPECT_FALSE(fs::exists(f.temp_path()));
    }
    EXPECT_EQ(read(p), "hello world");
    EXPECT_EQ(entries(d), 1u);
}

TEST(OutputFile, AbandonedFileLeavesNothingAndKeepsTheOldOne) {
    const fs::path d = fresh_dir("abandon");
    const fs::path p = d / "out.bin";
    std::ofstream(p) << "old";
    try {
        OutputFile f(p.string());
        f.write("half of the new one");
        throw std::runtime_error("the writer failed");
    } catch (const std::runtime_error &) {
    }
    EXPECT_EQ(read(p), "old");
    EXPECT_EQ(entries(d), 1u);
    write_file_atomic(p.string(), "new");
    EXPECT_EQ(read(p), "new");
    EXPECT_EQ(entries(d), 1u);
}

TEST(OutputFile, UnwritableDirectoryIsOneErrorNamingThePath) {
    try {
        OutputFile f("/nonexistent-dir/out.bin");
        FAIL();
    } catch (const Error &e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("/nonexistent-dir/out.bin: cannot write there"), std::string::npos) << msg;
    }
    const fs::path d = fresh_dir("isdir");
    EXPECT_THROW(OutputFile f(d.string()), Error);
}

// Through a symbolic link the target is replaced and the link stays; a device is written in place.
TEST(OutputFile, SymlinksAndDevices) {
    const fs::path d = fresh_dir("links");
    std::ofstream(d / "target") << "old";
    fs::create_symlink(d / "target", d / "link");
    write_file_atomic((d / "link").string(), "new");
    EXPECT_TRUE(fs::is_symlink(d / "link"));
    EXPECT_EQ(read(d / "target"), "new");
    EXPECT_NO_THROW(write_file_atomic("/dev/null", "discarded"));
    EXPECT_TRUE(fs::is_character_file("/dev/null"));
}

// A full disk, made with a file-size limit (ulimit -f) in a child: the write fails with the system's reason
// and the directory stays empty.
TEST(OutputFile, FullDiskLeavesNothingBehind) {
    const fs::path d = fresh_dir("full");
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        std::signal(SIGXFSZ, SIG_IGN);  // get EFBIG from write() instead of the signal
        struct rlimit rl {4096, 4096};
        if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(2);
        try {
            write_file_atomic((d / "big.bin").string(), std::string(100000, 'x'));
        } catch (const Error &e) {
            const std::string msg = e.what();
            _exit(msg.find("big.bin: write error: File too large") != std::string::npos ? 0 : 3);
        }
        _exit(4);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
    EXPECT_EQ(entries(d), 0u);
}
