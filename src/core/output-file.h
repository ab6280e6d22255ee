// Output files written under a temporary name and renamed into place when complete, so that a full disk,
// an error or an interrupted run never leaves a half-written file under the real name (decision 0103).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace prescope {

/// One output file in the making. The constructor creates DIR/.NAME.tmp-XXXXXX next to `path` (same file
/// system, so the rename is atomic; permissions 0666 minus the umask, as a plain open would give), write()
/// appends to it and commit() flushes it to disk and renames it to `path`, replacing an older file. When
/// commit() has not run (an exception, a failed write), the destructor removes the temporary file. Every
/// failure throws prescope::Error naming `path` and the system's reason ("No space left on device").
/// A path that is a device or pipe (/dev/stdout) is written in place; through a symbolic link, the link's
/// target is replaced.
/// Move-only; not thread-safe.
class OutputFile {
  public:
    explicit OutputFile(std::string path);
    ~OutputFile();
    OutputFile(OutputFile &&other) noexcept;
    OutputFile &operator=(OutputFile &&) = delete;
    OutputFile(const OutputFile &) = delete;
    OutputFile &operator=(const OutputFile &) = delete;

    void write(const void *data, size_t n_bytes);
    void write(std::string_view text) { write(text.data(), text.size()); }
    /// fsync, close, rename to path(). After it, write() and commit() are errors.
    void commit();

    const std::string &path() const { return path_; }
    const std::string &temp_path() const { return temp_; }

  private:
    std::string path_, target_, temp_;  // as given; the file replaced (a symlink's target); the one written
    int fd_ = -1;
    bool direct_ = false;  // a device or pipe, written in place
};

/// Writes `data` to `path` through an OutputFile (temporary name, then rename).
void write_file_atomic(const std::string &path, std::string_view data);

} // namespace prescope
