#include "format/gguf.h"

#include "core/error.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace prescope {

namespace {

constexpr uint64_t kMaxStringBytes = 1ull << 30;  // no key or value string is this long in practice
constexpr int kMaxArrayDepth = 8;

/// Cursor over the mapped header; every read is bounds-checked and errors name what was being read.
class Reader {
  public:
    Reader(const std::string &path, const uint8_t *data, size_t size) : path_(path), data_(data), size_(size) {}

    size_t pos() const { return pos_; }
    size_t remaining() const { return size_ - pos_; }

    void need(uint64_t n, const std::string &what) const {
        if (n > remaining()) {
            fail("{}: truncated file: {} needs {} bytes at offset {}, only {} remain", path_, what, n, pos_,
                 remaining());
        }
    }
    template <typename T>
    T read(const std::string &what) {
        need(sizeof(T), what);
        T v;
        std::memcpy(&v, data_ + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }
    std::string read_string(const std::string &what) {
        const uint64_t n = read<uint64_t>(what + " length");
        if (n > kMaxStringBytes) fail("{}: {} has an implausible length {} at offset {}", path_, what, n, pos_ - 8);
        need(n, what);
        std::string s(reinterpret_cast<const char *>(data_ + pos_), size_t(n));
        pos_ += n;
        return s;
    }

  private:
    const std::string &path_;
    const uint8_t *data_;
    size_t size_;
    size_t pos_ = 0;
};

size_t gguf_scalar_size(GgufType t) {
    switch (t) {
    case GgufType::UINT8: case GgufType::INT8: case GgufType::BOOL: return 1;
    case GgufType::UINT16: case GgufType::INT16: return 2;
    case GgufType::UINT32: case GgufType::INT32: case GgufType::FLOAT32: return 4;
    case GgufType::UINT64: case GgufType::INT64: case GgufType::FLOAT64: return 8;
    case GgufType::STRING: return 8;  // at least its length field
    case GgufType::ARRAY: return 12;  // at least element type + count
    }
    return 0;
}

GgufType read_type(Reader &r, const std::string &what, const std::string &path) {
    const uint32_t t = r.read<uint32_t>(what + " type");
    if (t > uint32_t(GgufType::FLOAT64)) fail("{}: {} has unknown value type {}", path, what, t);
    return GgufType(t);
}

GgufValue read_value(Reader &r, GgufType type, const std::string &what, const std::string &path, int depth) {
    GgufValue v;
    v.type = type;
    switch (type) {
    case GgufType::UINT8: v.v = uint64_t(r.read<uint8_t>(what)); break;
    case GgufType::UINT16: v.v = uint64_t(r.read<uint16_t>(what)); break;
    case GgufType::UINT32: v.v = uint64_t(r.read<uint32_t>(what)); break;
    case GgufType::UINT64: v.v = r.read<uint64_t>(what); break;
    case GgufType::INT8: v.v = int64_t(r.read<int8_t>(what)); break;
    case GgufType::INT16: v.v = int64_t(r.read<int16_t>(what)); break;
    case GgufType::INT32: v.v = int64_t(r.read<int32_t>(what)); break;
    case GgufType::INT64: v.v = r.read<int64_t>(what); break;
    case GgufType::FLOAT32: v.v = double(r.read<float>(what)); break;
    case GgufType::FLOAT64: v.v = r.read<double>(what); break;
    case GgufType::BOOL: {
        const uint8_t b = r.read<uint8_t>(what);
        if (b > 1) fail("{}: {} is a bool with value {}, expected 0 or 1", path, what, b);
        v.v = b != 0;
        break;
    }
    case GgufType::STRING: v.v = r.read_string(what); break;
    case GgufType::ARRAY: {
        if (depth >= kMaxArrayDepth) fail("{}: {} nests arrays deeper than {}", path, what, kMaxArrayDepth);
        v.elem_type = read_type(r, what + " element", path);
        const uint64_t n = r.read<uint64_t>(what + " count");
        // Each element takes at least its minimal encoded size: reject counts the file cannot hold.
        const uint64_t min_bytes = gguf_scalar_size(v.elem_type);
        if (n > r.remaining() / min_bytes) {
            fail("{}: {} claims {} elements of {} but only {} bytes remain", path, what, n,
                 gguf_type_name(v.elem_type), r.remaining());
        }
        std::vector<GgufValue> items;
        items.reserve(size_t(n));
        for (uint64_t i = 0; i < n; ++i) {
            items.push_back(read_value(r, v.elem_type, what, path, depth + 1));
        }
        v.v = std::move(items);
        break;
    }
    }
    return v;
}

} // namespace

const char *gguf_type_name(GgufType t) {
    static const char *names[] = {"uint8", "int8",  "uint16", "int16",  "uint32", "int32",  "float32",
                                  "bool",  "string", "array", "uint64", "int64", "float64"};
    const auto i = uint32_t(t);
    return i < 13 ? names[i] : "unknown";
}

bool GgufValue::is_integer() const {
    return std::holds_alternative<uint64_t>(v) || std::holds_alternative<int64_t>(v);
}

bool GgufValue::is_float() const {
    return std::holds_alternative<double>(v);
}

std::optional<std::pair<int64_t, size_t>> ggml_type_block(uint32_t t) {
    // {block elements, block bytes} from ggml.c type_traits; ids 4, 5, 31-33, 36-38 are retired.
    struct Entry { uint32_t id; int64_t blck; size_t bytes; };
    static const Entry table[] = {
        {0, 1, 4},     {1, 1, 2},     {2, 32, 18},   {3, 32, 20},   {6, 32, 22},   {7, 32, 24},
        {8, 32, 34},   {9, 32, 36},   {10, 256, 84}, {11, 256, 110}, {12, 256, 144}, {13, 256, 176},
        {14, 256, 210}, {15, 256, 292}, {16, 256, 66}, {17, 256, 74}, {18, 256, 98}, {19, 256, 50},
        {20, 32, 18},  {21, 256, 110}, {22, 256, 82}, {23, 256, 136}, {24, 1, 1},   {25, 1, 2},
        {26, 1, 4},    {27, 1, 8},    {28, 1, 8},    {29, 256, 56}, {30, 1, 2},    {34, 256, 54},
        {35, 256, 66}, {39, 32, 17},  {40, 64, 36},
    };
    for (const auto &e : table) {
        if (e.id == t) return std::make_pair(e.blck, e.bytes);
    }
    return std::nullopt;
}

GgufFile::GgufFile(const std::string &path) : map_(path) {
    Reader r(path, map_.data(), map_.size());
    if (map_.size() < 4 || std::memcmp(map_.data(), "GGUF", 4) != 0) {
        fail("{}: not a GGUF file: bad magic, expected 'GGUF' in the first 4 bytes", path);
    }
    r.read<uint32_t>("magic");
    version_ = r.read<uint32_t>("version");
    if (version_ != 2 && version_ != 3) {
        // A big-endian file (gguf-py --bigendian, s390x builds) reads as version 0x03000000 here.
        const uint32_t swapped = __builtin_bswap32(version_);
        if (swapped >= 1 && swapped <= 3) {
            fail("{}: a big-endian GGUF file (version {} stored big-endian); PreScope reads little-endian files: "
                 "convert it with gguf-py's gguf_convert_endian.py FILE little", path, swapped);
        }
        fail("{}: unsupported GGUF version {} (expected 2 or 3)", path, version_);
    }
    const uint64_t n_tensors = r.read<uint64_t>("tensor count");
    const uint64_t n_kv = r.read<uint64_t>("metadata count");
    // A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor info 8 + 4 + 4 + 8.
    if (n_kv > r.remaining() / 13) {
        fail("{}: truncated or corrupt file: metadata count {} needs more than the {} bytes left", path, n_kv,
             r.remaining());
    }
    if (n_tensors > r.remaining() / 24) {
        fail("{}: truncated or corrupt file: tensor count {} needs more than the {} bytes left", path, n_tensors,
             r.remaining());
    }

    for (uint64_t i = 0; i < n_kv; ++i) {
        std::string key = r.read_string(fmt::format("metadata key #{}", i));
        const std::string what = fmt::format("metadata '{}'", key);
        const GgufType type = read_type(r, what, path);
        GgufValue value = read_value(r, type, what, path, 0);
        if (kv_.count(key)) fail("{}: duplicate metadata key '{}'", path, key);
        kv_.emplace(std::move(key), std::move(value));
    }

    if (const GgufValue *a = find("general.alignment")) {
        if (a->type != GgufType::UINT32) {
            fail("{}: metadata 'general.alignment' has type {}, expected uint32", path, gguf_type_name(a->type));
        }
        alignment_ = std::get<uint64_t>(a->v);
        if (alignment_ == 0 || (alignment_ & (alignment_ - 1)) != 0) {
            fail("{}: metadata 'general.alignment' is {}, expected a power of two", path, alignment_);
        }
    }

    tensors_.reserve(size_t(n_tensors));
    for (uint64_t i = 0; i < n_tensors; ++i) {
        GgufTensorInfo t;
        t.name = r.read_string(fmt::format("tensor name #{}", i));
        const std::string what = fmt::format("tensor '{}'", t.name);
        const uint32_t n_dims = r.read<uint32_t>(what + " dimension count");
        if (n_dims == 0 || n_dims > 4) fail("{}: {} has {} dimensions, expected 1 to 4", path, what, n_dims);
        uint64_t n_elements = 1;
        for (uint32_t d = 0; d < n_dims; ++d) {
            const uint64_t ne = r.read<uint64_t>(what + " dimension");
            if (ne == 0 || ne > uint64_t(std::numeric_limits<int64_t>::max())) {
                fail("{}: {} has invalid dimension {} = {}", path, what, d, ne);
            }
            if (n_elements > std::numeric_limits<uint64_t>::max() / ne) {
                fail("{}: {} has too many elements: dimensions 0..{} multiply past 2^64 (dimension {} = {})", path,
                     what, d, d, ne);
            }
            n_elements *= ne;
            t.ne.push_back(int64_t(ne));
        }
        t.ggml_type = r.read<uint32_t>(what + " type");
        const auto block = ggml_type_block(t.ggml_type);
        if (!block) fail("{}: {} has unknown ggml type id {}", path, what, t.ggml_type);
        if (t.ne[0] % block->first != 0) {
            fail("{}: {} row length {} is not a multiple of the {} block size {}", path, what, t.ne[0],
                 ggml_type_name(t.ggml_type), block->first);
        }
        t.dtype = dtype_from_ggml(t.ggml_type);
        const uint64_t n_blocks = n_elements / uint64_t(block->first);
        if (n_blocks > std::numeric_limits<uint64_t>::max() / block->second) {
            fail("{}: {} byte size overflows", path, what);
        }
        t.n_bytes = n_blocks * block->second;
        t.offset = r.read<uint64_t>(what + " offset");
        if (t.offset % alignment_ != 0) {
            fail("{}: {} data offset {} is not a multiple of the alignment {}", path, what, t.offset, alignment_);
        }
        if (tensor_index_.count(t.name)) fail("{}: duplicate tensor '{}'", path, t.name);
        tensor_index_.emplace(t.name, tensors_.size());
        tensors_.push_back(std::move(t));
    }

    data_offset_ = (r.pos() + alignment_ - 1) / alignment_ * alignment_;
    for (auto &t : tensors_) {
        const uint64_t size = map_.size();
        if (data_offset_ > size || t.offset > size - data_offset_ || t.n_bytes > size - data_offset_ - t.offset) {
            fail("{}: tensor '{}' data [{}, {}) ({} bytes of {}) lies past the end of the file ({} bytes)", path,
                 t.name, data_offset_ + t.offset, data_offset_ + t.offset + t.n_bytes, t.n_bytes,
                 ggml_type_name(t.ggml_type), size);
        }
        t.data = map_.data() + data_offset_ + t.offset;
    }
    // Two tensors sharing bytes are a corrupt (or crafted) file: writing one would change the other.
    std::vector<const GgufTensorInfo *> by_offset;
    by_offset.reserve(tensors_.size());
    for (const auto &t : tensors_) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensorInfo *a, const GgufTensorInfo *b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_offset.size(); ++i) {
        const GgufTensorInfo &a = *by_offset[i - 1], &b = *by_offset[i];
        if (a.offset + a.n_bytes > b.offset) {
            fail("{}: tensors '{}' (data bytes [{}, {})) and '{}' ([{}, {})) overlap", path, a.name,
                 data_offset_ + a.offset, data_offset_ + a.offset + a.n_bytes, b.name, data_offset_ + b.offset,
                 data_offset_ + b.offset + b.n_bytes);
        }
    }
}

const GgufValue *GgufFile::find(const std::string &key) const {
    const auto it = kv_.find(key);
    return it == kv_.end() ? nullptr : &it->second;
}

namespace {

const GgufValue &require(const GgufFile &f, const std::string &key) {
    const GgufValue *v = f.find(key);
    if (!v) fail("{}: missing metadata '{}'", f.path(), key);
    return *v;
}

[[noreturn]] void wrong_type(const GgufFile &f, const std::string &key, const GgufValue &v, const char *expected) {
    fail("{}: metadata '{}' has type {}, expected {}", f.path(), key, gguf_type_name(v.type), expected);
}

int64_t as_i64(const GgufFile &f, const std::string &key, const GgufValue &v) {
    if (const auto *u = std::get_if<uint64_t>(&v.v)) {
        if (*u > uint64_t(std::numeric_limits<int64_t>::max())) wrong_type(f, key, v, "an int64-sized integer");
        return int64_t(*u);
    }
    if (const auto *i = std::get_if<int64_t>(&v.v)) return *i;
    wrong_type(f, key, v, "an integer");
}

const std::vector<GgufValue> &as_array(const GgufFile &f, const std::string &key, const GgufValue &v) {
    if (v.type != GgufType::ARRAY) wrong_type(f, key, v, "array");
    return std::get<std::vector<GgufValue>>(v.v);
}

} // namespace

uint64_t GgufFile::get_u64(const std::string &key) const {
    const GgufValue &v = require(*this, key);
    if (const auto *u = std::get_if<uint64_t>(&v.v)) return *u;
    const int64_t i = as_i64(*this, key, v);
    if (i < 0) fail("{}: metadata '{}' is {}, expected a non-negative value", path(), key, i);
    return uint64_t(i);
}

int64_t GgufFile::get_i64(const std::string &key) const {
    return as_i64(*this, key, require(*this, key));
}

uint32_t GgufFile::get_u32(const std::string &key) const {
    const uint64_t u = get_u64(key);
    if (u > std::numeric_limits<uint32_t>::max()) fail("{}: metadata '{}' = {} does not fit 32 bits", path(), key, u);
    return uint32_t(u);
}

double GgufFile::get_f64(const std::string &key) const {
    const GgufValue &v = require(*this, key);
    if (const auto *d = std::get_if<double>(&v.v)) return *d;
    if (v.is_integer()) return double(as_i64(*this, key, v));
    wrong_type(*this, key, v, "a number");
}

bool GgufFile::get_bool(const std::string &key) const {
    const GgufValue &v = require(*this, key);
    if (const auto *b = std::get_if<bool>(&v.v)) return *b;
    wrong_type(*this, key, v, "bool");
}

const std::string &GgufFile::get_str(const std::string &key) const {
    const GgufValue &v = require(*this, key);
    if (const auto *s = std::get_if<std::string>(&v.v)) return *s;
    wrong_type(*this, key, v, "string");
}

std::vector<std::string> GgufFile::get_str_array(const std::string &key) const {
    const auto &a = as_array(*this, key, require(*this, key));
    std::vector<std::string> out;
    out.reserve(a.size());
    for (const auto &e : a) {
        const auto *s = std::get_if<std::string>(&e.v);
        if (!s) fail("{}: metadata '{}' is an array of {}, expected strings", path(), key, gguf_type_name(e.type));
        out.push_back(*s);
    }
    return out;
}

std::vector<float> GgufFile::get_f32_array(const std::string &key) const {
    const auto &a = as_array(*this, key, require(*this, key));
    std::vector<float> out;
    out.reserve(a.size());
    for (const auto &e : a) {
        if (const auto *d = std::get_if<double>(&e.v)) {
            out.push_back(float(*d));
        } else if (e.is_integer()) {
            out.push_back(float(as_i64(*this, key, e)));
        } else {
            fail("{}: metadata '{}' is an array of {}, expected numbers", path(), key, gguf_type_name(e.type));
        }
    }
    return out;
}

std::vector<int32_t> GgufFile::get_i32_array(const std::string &key) const {
    const auto &a = as_array(*this, key, require(*this, key));
    std::vector<int32_t> out;
    out.reserve(a.size());
    for (const auto &e : a) {
        if (!e.is_integer()) {
            fail("{}: metadata '{}' is an array of {}, expected integers", path(), key, gguf_type_name(e.type));
        }
        const int64_t i = as_i64(*this, key, e);
        if (i < std::numeric_limits<int32_t>::min() || i > std::numeric_limits<int32_t>::max()) {
            fail("{}: metadata '{}' holds {} which does not fit int32", path(), key, i);
        }
        out.push_back(int32_t(i));
    }
    return out;
}

uint32_t GgufFile::get_u32_or(const std::string &key, uint32_t dflt) const {
    return has(key) ? get_u32(key) : dflt;
}

double GgufFile::get_f64_or(const std::string &key, double dflt) const {
    return has(key) ? get_f64(key) : dflt;
}

bool GgufFile::get_bool_or(const std::string &key, bool dflt) const {
    return has(key) ? get_bool(key) : dflt;
}

std::string GgufFile::get_str_or(const std::string &key, const std::string &dflt) const {
    return has(key) ? get_str(key) : dflt;
}

const GgufTensorInfo *GgufFile::find_tensor(const std::string &name) const {
    const auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

TensorView GgufFile::tensor_view(const std::string &name) const {
    const GgufTensorInfo *t = find_tensor(name);
    if (!t) fail("{}: missing tensor '{}'", path(), name);
    if (!t->dtype) {
        fail("{}: tensor '{}' has unsupported dtype {} (supported: {})", path(), name, ggml_type_name(t->ggml_type),
             supported_weight_types());
    }
    TensorView v;
    v.name = t->name;
    v.type = *t->dtype;
    for (size_t d = 0; d < t->ne.size(); ++d) v.ne[d] = t->ne[d];
    v.data = t->data;
    return v;
}

} // namespace prescope
