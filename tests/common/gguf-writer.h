// Test-only GGUF v2/v3 writer (gguf.md layout), to build valid and deliberately broken files in tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace prescope::test {

/// Serialises metadata and tensors in GGUF order: header, key-value pairs, tensor infos, padding,
/// data. Values are written as given; nothing is validated (tests write broken files on purpose).
class GgufWriter {
  public:
    explicit GgufWriter(uint32_t version = 3, uint64_t alignment = 32) : version_(version), alignment_(alignment) {}

    void kv_u32(const std::string &k, uint32_t v) { key(k, 4); pod(kv_, v); }
    void kv_i32(const std::string &k, int32_t v) { key(k, 5); pod(kv_, v); }
    void kv_f32(const std::string &k, float v) { key(k, 6); pod(kv_, v); }
    void kv_bool(const std::string &k, bool v) { key(k, 7); pod(kv_, uint8_t(v)); }
    void kv_str(const std::string &k, const std::string &v) { key(k, 8); str(kv_, v); }
    void kv_u64(const std::string &k, uint64_t v) { key(k, 10); pod(kv_, v); }
    void kv_i64(const std::string &k, int64_t v) { key(k, 11); pod(kv_, v); }
    void kv_f64(const std::string &k, double v) { key(k, 12); pod(kv_, v); }
    void kv_u8(const std::string &k, uint8_t v) { key(k, 0); pod(kv_, v); }
    void kv_i8(const std::string &k, int8_t v) { key(k, 1); pod(kv_, v); }
    void kv_u16(const std::string &k, uint16_t v) { key(k, 2); pod(kv_, v); }
    void kv_i16(const std::string &k, int16_t v) { key(k, 3); pod(kv_, v); }
    void kv_str_array(const std::string &k, const std::vector<std::string> &v) {
        key(k, 9);
        pod(kv_, uint32_t(8));
        pod(kv_, uint64_t(v.size()));
        for (const auto &s : v) str(kv_, s);
    }
    template <typename T>
    void kv_array(const std::string &k, uint32_t elem_type, const std::vector<T> &v) {
        key(k, 9);
        pod(kv_, elem_type);
        pod(kv_, uint64_t(v.size()));
        for (const auto &x : v) pod(kv_, x);
    }
    /// Raw bytes appended to the metadata section (for nested arrays and broken encodings).
    void kv_raw(const std::string &k, uint32_t type, const std::vector<uint8_t> &bytes) {
        key(k, type);
        kv_.insert(kv_.end(), bytes.begin(), bytes.end());
    }

    /// Adds a tensor; `data` must hold its bytes for ggml_type. `offset` overrides the data offset.
    void tensor(const std::string &name, uint32_t ggml_type, std::vector<uint64_t> ne, const std::vector<uint8_t> &data,
                int64_t offset = -1) {
        while (data_.size() % alignment_) data_.push_back(0);
        str(ti_, name);
        pod(ti_, uint32_t(ne.size()));
        for (uint64_t d : ne) pod(ti_, d);
        pod(ti_, ggml_type);
        pod(ti_, uint64_t(offset >= 0 ? uint64_t(offset) : data_.size()));
        data_.insert(data_.end(), data.begin(), data.end());
        ++n_tensors_;
    }

    std::vector<uint8_t> bytes() const {
        std::vector<uint8_t> out = {'G', 'G', 'U', 'F'};
        pod(out, version_);
        pod(out, n_tensors_);
        pod(out, n_kv_);
        out.insert(out.end(), kv_.begin(), kv_.end());
        out.insert(out.end(), ti_.begin(), ti_.end());
        while (out.size() % alignment_) out.push_back(0);
        out.insert(out.end(), data_.begin(), data_.end());
        return out;
    }
    void write(const std::string &path) const { write_bytes(path, bytes()); }

    static void write_bytes(const std::string &path, const std::vector<uint8_t> &b) {
        std::ofstream f(path, std::ios::binary);
        f.write(reinterpret_cast<const char *>(b.data()), std::streamsize(b.size()));
    }
    template <typename T>
    static void pod(std::vector<uint8_t> &out, const T &v) {
        uint8_t b[sizeof(T)];
        std::memcpy(b, &v, sizeof(T));
        out.insert(out.end(), b, b + sizeof(T));
    }
    static void str(std::vector<uint8_t> &out, const std::string &s) {
        pod(out, uint64_t(s.size()));
        out.insert(out.end(), s.begin(), s.end());
    }

  private:
    void key(const std::string &k, uint32_t type) {
        str(kv_, k);
        pod(kv_, type);
        ++n_kv_;
    }
    uint32_t version_;
    uint64_t alignment_;
    uint64_t n_tensors_ = 0, n_kv_ = 0;
    std::vector<uint8_t> kv_, ti_, data_;
};

} // namespace prescope::test
