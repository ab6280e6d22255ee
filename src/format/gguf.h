// GGUF reader over a read-only mapping (format: ggml docs/gguf.md; versions 2 and 3, little-endian).
// Every count, length, offset and size is checked against the file before use.
#pragma once

#include "core/dtype.h"
#include "core/mmap.h"
#include "core/tensor.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace prescope {

/// GGUF metadata value types (gguf.md gguf_metadata_value_type).
enum class GgufType : uint32_t {
    UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
    BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};
const char *gguf_type_name(GgufType t);

/// One metadata value. Integers of every width are held widened (unsigned in u64, signed in i64),
/// floats in double; arrays hold their elements (possibly arrays again) and their element type.
struct GgufValue {
    GgufType type = GgufType::UINT8;
    GgufType elem_type = GgufType::UINT8;  // element type when type == ARRAY
    std::variant<uint64_t, int64_t, double, bool, std::string, std::vector<GgufValue>> v;

    bool is_integer() const;
    bool is_float() const;
};

/// A tensor's entry in the header. `dtype` is empty when PreScope cannot compute with the type;
/// the bytes are still located and bounds-checked for every type ggml knows.
struct GgufTensorInfo {
    std::string name;
    uint32_t ggml_type = 0;
    std::optional<DType> dtype;
    std::vector<int64_t> ne;   // ggml order: ne[0] fastest
    uint64_t offset = 0;       // relative to the data section
    uint64_t n_bytes = 0;
    const uint8_t *data = nullptr;
};

/// An opened GGUF file. Construction parses and validates the whole header and tensor table;
/// any malformed or truncated part, tensor data past the end of the file or overlapping another
/// tensor's, and big-endian files throw prescope::Error naming the file, the item and the byte
/// offset. Tensor data stay in the mapping.
class GgufFile {
  public:
    explicit GgufFile(const std::string &path);

    const std::string &path() const { return map_.path(); }
    uint32_t version() const { return version_; }
    uint64_t alignment() const { return alignment_; }
    uint64_t data_offset() const { return data_offset_; }  // start of the tensor data section
    size_t file_size() const { return map_.size(); }

    const std::map<std::string, GgufValue> &metadata() const { return kv_; }
    const std::vector<GgufTensorInfo> &tensors() const { return tensors_; }

    const GgufValue *find(const std::string &key) const;
    bool has(const std::string &key) const { return find(key) != nullptr; }
    // Typed getters: throw Error "<file>: metadata '<key>' ..." when missing or of the wrong type.
    // Integer getters accept any integer type whose value fits.
    uint64_t get_u64(const std::string &key) const;
    int64_t get_i64(const std::string &key) const;
    uint32_t get_u32(const std::string &key) const;
    double get_f64(const std::string &key) const;
    bool get_bool(const std::string &key) const;
    const std::string &get_str(const std::string &key) const;
    std::vector<std::string> get_str_array(const std::string &key) const;
    std::vector<float> get_f32_array(const std::string &key) const;
    std::vector<int32_t> get_i32_array(const std::string &key) const;
    // The same with a default when the key is absent (a present key of the wrong type still throws).
    uint32_t get_u32_or(const std::string &key, uint32_t dflt) const;
    double get_f64_or(const std::string &key, double dflt) const;
    bool get_bool_or(const std::string &key, bool dflt) const;
    std::string get_str_or(const std::string &key, const std::string &dflt) const;

    const GgufTensorInfo *find_tensor(const std::string &name) const;
    /// A view of a tensor whose dtype PreScope supports; throws Error when the tensor is missing
    /// or its dtype is unsupported.
    TensorView tensor_view(const std::string &name) const;

  private:
    MappedFile map_;
    uint32_t version_ = 0;
    uint64_t alignment_ = 32;
    uint64_t data_offset_ = 0;
    std::map<std::string, GgufValue> kv_;
    std::vector<GgufTensorInfo> tensors_;
    std::map<std::string, size_t> tensor_index_;
};

/// Block size (elements) and block bytes of any ggml type id (ggml.c type_traits), or nullopt for
/// ids ggml does not define.
std::optional<std::pair<int64_t, size_t>> ggml_type_block(uint32_t ggml_type);

} // namespace prescope
