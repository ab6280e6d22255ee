// Read-only memory mapping of a whole file (weights are read in place, never copied whole).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace prescope {

/// A read-only, private mapping of a file. Throws prescope::Error naming the file when it cannot be
/// opened or mapped. Empty files map to data() == nullptr, size() == 0. Move-only.
class MappedFile {
  public:
    explicit MappedFile(const std::string &path);
    ~MappedFile();
    MappedFile(MappedFile &&other) noexcept;
    MappedFile &operator=(MappedFile &&other) noexcept;
    MappedFile(const MappedFile &) = delete;
    MappedFile &operator=(const MappedFile &) = delete;

    const std::string &path() const { return path_; }
    const uint8_t *data() const { return data_; }
    size_t size() const { return size_; }

  private:
    std::string path_;
    const uint8_t *data_ = nullptr;
    size_t size_ = 0;
};

} // namespace prescope
