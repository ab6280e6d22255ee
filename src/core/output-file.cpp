#include "core/output-file.h"

#include "core/error.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

namespace prescope {

OutputFile::OutputFile(std::string path) : path_(std::move(path)) {
    namespace fs = std::filesystem;
    if (path_.empty()) fail("cannot write a file without a name");
    std::error_code ec;
    const fs::file_status st = fs::status(path_, ec);
    if (fs::exists(st) && !fs::is_regular_file(st)) {
        // A device or pipe (/dev/stdout, a FIFO): there is nothing to rename, write to it directly.
        if (fs::is_directory(st)) fail("{}: cannot write there: it is a directory", path_);
        temp_ = path_;
        fd_ = ::open(path_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
        if (fd_ < 0) fail("{}: cannot open for writing: {}", path_, std::strerror(errno));
        direct_ = true;
        return;
    }
    // Through a symbolic link, the file it points to is the one replaced (the link stays).
    const fs::path target = fs::is_symlink(fs::symlink_status(path_, ec)) ? fs::weakly_canonical(path_, ec) : fs::path(path_);
    target_ = target.empty() ? path_ : target.string();
    const fs::path p(target_);
    if (p.filename().empty()) fail("{}: cannot write there: the path names a directory", path_);
    std::random_device rd;
    for (int attempt = 0; attempt < 16 && fd_ < 0; ++attempt) {
        const std::string tail = fmt::format(".{}.tmp-{:06x}", p.filename().string(), rd() & 0xffffff);
        temp_ = (p.parent_path() / tail).string();
        fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd_ < 0 && errno != EEXIST) break;
    }
    if (fd_ < 0) {
        const int err = errno;
        const fs::path dir = fs::absolute(p, ec).parent_path();
        fail("{}: cannot write there: cannot create a file in {} ({})", path_, dir.string(), std::strerror(err));
    }
}

OutputFile::~OutputFile() {
    if (fd_ >= 0) {
        ::close(fd_);
        if (!direct_) ::unlink(temp_.c_str());
    }
}

OutputFile::OutputFile(OutputFile &&other) noexcept
    : path_(std::move(other.path_)), target_(std::move(other.target_)), temp_(std::move(other.temp_)),
      fd_(other.fd_), direct_(other.direct_) {
    other.fd_ = -1;
}

void OutputFile::write(const void *data, size_t n_bytes) {
    if (fd_ < 0) fail("{}: write after the file was closed", path_);
    const auto *p = static_cast<const char *>(data);
    while (n_bytes > 0) {
        const ssize_t n = ::write(fd_, p, n_bytes);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fail("{}: write error: {}", path_, n < 0 ? std::strerror(errno) : "nothing written");
        p += n;
        n_bytes -= size_t(n);
    }
}

void OutputFile::commit() {
    if (fd_ < 0) fail("{}: committed twice", path_);
    if (direct_) {
        const int fd = fd_;
        fd_ = -1;
        if (::close(fd) != 0) fail("{}: write error: {}", path_, std::strerror(errno));
        return;
    }
    // fsync first: a rename that reaches the disk before the data would leave an empty file after a crash.
    if (::fsync(fd_) != 0 && errno != EINVAL) fail("{}: write error: {}", path_, std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
        const int err = errno;
        ::unlink(temp_.c_str());
        fail("{}: write error: {}", path_, std::strerror(err));
    }
    if (std::rename(temp_.c_str(), target_.c_str()) != 0) {
        const int err = errno;
        ::unlink(temp_.c_str());
        fail("{}: cannot rename {} to it: {}", path_, temp_, std::strerror(err));
    }
}

void write_file_atomic(const std::string &path, std::string_view data) {
    OutputFile out(path);
    out.write(data);
    out.commit();
}

} // namespace prescope
