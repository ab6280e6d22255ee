// Routing trace and hidden-state sidecar I/O (docs/trace-format.md), and the recorder behind `prescope trace`.
#include "offload/trace.h"

#include "core/error.h"
#include "core/memory.h"
#include "core/output-file.h"
#include "runtime/context.h"

#include <nlohmann/json.hpp>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>

namespace prescope {

namespace {

constexpr char TRACE_MAGIC[8] = {'P', 'S', 'T', 'R', 'A', 'C', 'E', '1'};
constexpr char HIDDEN_MAGIC[8] = {'P', 'S', 'H', 'I', 'D', 'D', 'N', '1'};
constexpr int FORMAT_VERSION = 1;
constexpr uint64_t MAX_HEADER_BYTES = 64ull << 20;
constexpr uint64_t MAX_RAW_BYTES = 64ull << 30;  // refuse to inflate more than this
const char *HIDDEN_ENCODING = "int8_absmax";

using json = nlohmann::json;

std::string read_bytes(const std::string &path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("{}: cannot open the file", path);
    std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) fail("{}: read error", path);
    return data;
}

// Decompresses exactly one zstd frame; anything after it, a truncated frame or a corrupt one is an error. The
// frame is inflated in pieces whatever its header claims, so a small file cannot make us allocate what its
// header says before the data are there.
std::string decompress_one_frame(const std::string &path, const std::string &data) {
    const size_t frame = ZSTD_findFrameCompressedSize(data.data(), data.size());
    if (ZSTD_isError(frame)) fail("{}: not a valid zstd frame ({})", path, ZSTD_getErrorName(frame));
    if (frame != data.size()) {
        fail("{}: {} bytes after the zstd frame (expected exactly one frame)", path, data.size() - frame);
    }
    const unsigned long long size = ZSTD_getFrameContentSize(data.data(), data.size());
    if (size == ZSTD_CONTENTSIZE_ERROR) fail("{}: not a valid zstd frame", path);
    const bool known = size != ZSTD_CONTENTSIZE_UNKNOWN;
    if (known && size > MAX_RAW_BYTES) fail("{}: zstd frame would inflate to {} bytes (too large)", path, size);
    if (known) check_host_memory(size, path + ": the decompressed file");
    std::string raw;
    raw.reserve(size_t(known ? std::min<uint64_t>(size, 16 * uint64_t(data.size()) + 4096) : 4 * data.size()));
    std::unique_ptr<ZSTD_DStream, size_t (*)(ZSTD_DStream *)> ds(ZSTD_createDStream(), ZSTD_freeDStream);
    std::string chunk(ZSTD_DStreamOutSize(), '\0');
    ZSTD_inBuffer in{data.data(), data.size(), 0};
    size_t ret = 1;
    while (in.pos < in.size) {
        ZSTD_outBuffer out{chunk.data(), chunk.size(), 0};
        ret = ZSTD_decompressStream(ds.get(), &out, &in);
        if (ZSTD_isError(ret)) fail("{}: corrupt zstd frame ({})", path, ZSTD_getErrorName(ret));
        raw.append(chunk.data(), out.pos);
        if (known && raw.size() > size) fail("{}: zstd frame holds more than the {} bytes its header says", path, size);
        if (raw.size() > MAX_RAW_BYTES) {
            fail("{}: zstd frame inflates to more than {} bytes (too large)", path, MAX_RAW_BYTES);
        }
        if (ret == 0) break;
    }
    if (ret != 0) fail("{}: zstd frame is truncated", path);
    if (known && raw.size() != size) fail("{}: zstd frame holds {} bytes, its header says {}", path, raw.size(), size);
    return raw;
}

std::string compress(const std::string &path, const std::string &raw, int level) {
    std::string out(ZSTD_compressBound(raw.size()), '\0');
    const size_t n = ZSTD_compress(out.data(), out.size(), raw.data(), raw.size(), std::clamp(level, 1, 19));
    if (ZSTD_isError(n)) fail("{}: zstd compression failed ({})", path, ZSTD_getErrorName(n));
    out.resize(n);
    return out;
}

// Splits magic + uint32 LE header length + JSON header; returns the header and the body offset.
json split_header(const std::string &path, const std::string &raw, const char (&magic)[8], size_t *body) {
    if (raw.size() < 12 || std::memcmp(raw.data(), magic, 8) != 0) {
        fail("{}: bad magic, expected \"{}\"", path, std::string(magic, 8));
    }
    uint32_t hlen = 0;
    for (int i = 0; i < 4; ++i) hlen |= uint32_t(uint8_t(raw[size_t(8 + i)])) << (8 * i);
    if (hlen > MAX_HEADER_BYTES || 12 + uint64_t(hlen) > raw.size()) {
        fail("{}: header length {} exceeds the {} bytes after it", path, hlen, raw.size() - 12);
    }
    json h;
    try {
        h = json::parse(raw.begin() + 12, raw.begin() + 12 + hlen);
    } catch (const json::exception &e) {
        fail("{}: header is not valid JSON ({})", path, e.what());
    }
    if (!h.is_object()) fail("{}: header is not a JSON object", path);
    if (!h.contains("format_version") || h["format_version"] != FORMAT_VERSION) {
        fail("{}: format_version {}, expected {}", path, h.value("format_version", json()).dump(), FORMAT_VERSION);
    }
    *body = 12 + hlen;
    return h;
}

int64_t int_field(const std::string &path, const json &h, const char *key, int64_t lo, int64_t hi) {
    if (!h.contains(key) || !h[key].is_number_integer()) {
        fail("{}: header field {} is missing or not an integer (expected an integer in [{}, {}])", path, key, lo, hi);
    }
    const int64_t v = h[key].get<int64_t>();
    if (v < lo || v > hi) fail("{}: header field {}={}, expected an integer in [{}, {}]", path, key, v, lo, hi);
    return v;
}

std::string str_field(const std::string &path, const json &h, const char *key) {
    if (!h.contains(key) || !h[key].is_string()) fail("{}: header field {} is missing or not a string", path, key);
    return h[key].get<std::string>();
}

std::string header_bytes(const char (&magic)[8], const json &h) {
    const std::string hs = h.dump();
    std::string raw(magic, 8);
    const auto n = uint32_t(hs.size());
    for (int i = 0; i < 4; ++i) raw.push_back(char((n >> (8 * i)) & 0xff));
    raw += hs;
    return raw;
}

} // namespace

// ---------------------------------------------------------------------------------------------------------
// Routing trace

std::vector<std::array<int64_t, 2>> RoutingTrace::sequence_bounds() const {
    std::vector<std::array<int64_t, 2>> out;
    int64_t pos = 0;
    for (const auto &s : sequences) {
        out.push_back({pos, pos + s.n_tokens});
        pos += s.n_tokens;
    }
    return out;
}

void RoutingTrace::append_token(uint32_t token, std::span<const int32_t> ids, std::span<const float> weights) {
    const size_t n = size_t(n_layer) * size_t(top_k);
    PRESCOPE_ASSERT(ids.size() == n && weights.size() == n);
    token_ids.push_back(token);
    for (size_t i = 0; i < n; ++i) {
        PRESCOPE_ASSERT(ids[i] >= 0 && ids[i] < n_expert);
        expert_ids.push_back(uint8_t(ids[i]));
        const float q = std::round(weights[i] * float(GATE_WEIGHT_SCALE));
        gate_q.push_back(uint8_t(std::clamp(q, 0.0f, float(GATE_WEIGHT_SCALE))));
    }
}

RoutingTrace read_trace(const std::string &path) {
    const std::string raw = decompress_one_frame(path, read_bytes(path));
    size_t body = 0;
    const json h = split_header(path, raw, TRACE_MAGIC, &body);
    RoutingTrace t;
    t.model = str_field(path, h, "model");
    t.arch = str_field(path, h, "arch");
    t.created_by = str_field(path, h, "created_by");
    t.n_layer = int32_t(int_field(path, h, "n_layer", 1, 4096));
    if (h.contains("first_moe_layer")) t.first_moe_layer = int32_t(int_field(path, h, "first_moe_layer", 0, 4095));
    t.n_expert = int32_t(int_field(path, h, "n_expert", 1, 256));
    t.top_k = int32_t(int_field(path, h, "top_k", 1, t.n_expert));
    int_field(path, h, "gate_weight_scale", RoutingTrace::GATE_WEIGHT_SCALE, RoutingTrace::GATE_WEIGHT_SCALE);
    const int64_t n_tokens = int_field(path, h, "n_tokens", 0, int64_t(1) << 40);
    if (!h.contains("sequences") || !h["sequences"].is_array()) fail("{}: header field sequences is not a list", path);
    int64_t total = 0;
    for (size_t i = 0; i < h["sequences"].size(); ++i) {
        const json &s = h["sequences"][i];
        if (!s.is_object() || !s.contains("name") || !s.contains("source") || !s.contains("n_tokens")) {
            fail("{}: sequences[{}] lacks name/source/n_tokens", path, i);
        }
        TraceSequence seq;
        seq.name = s["name"].is_string() ? s["name"].get<std::string>() : s["name"].dump();
        seq.source = s["source"].is_string() ? s["source"].get<std::string>() : s["source"].dump();
        seq.n_tokens = int_field(path, s, "n_tokens", 0, int64_t(1) << 40);
        if (s.contains("n_prompt")) seq.n_prompt = int_field(path, s, "n_prompt", 0, seq.n_tokens);
        total += seq.n_tokens;
        t.sequences.push_back(std::move(seq));
    }
    if (total != n_tokens) fail("{}: sequences hold {} tokens but header n_tokens is {}", path, total, n_tokens);
    const uint64_t rec = 4 + uint64_t(t.n_layer) * 2 * uint64_t(t.top_k);
    const uint64_t have = raw.size() - body;
    if (have != uint64_t(n_tokens) * rec) {
        fail("{}: body has {} bytes, expected n_tokens {} x record {} = {}", path, have, n_tokens, rec,
             uint64_t(n_tokens) * rec);
    }
    const size_t lk = size_t(t.n_layer) * size_t(t.top_k);
    t.token_ids.resize(size_t(n_tokens));
    t.expert_ids.resize(size_t(n_tokens) * lk);
    t.gate_q.resize(size_t(n_tokens) * lk);
    const auto *p = reinterpret_cast<const uint8_t *>(raw.data() + body);
    for (int64_t i = 0; i < n_tokens; ++i, p += rec) {
        t.token_ids[size_t(i)] = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
        for (int32_t l = 0; l < t.n_layer; ++l) {
            const uint8_t *ids = p + 4 + size_t(l) * 2 * size_t(t.top_k);
            uint8_t *dst_ids = t.expert_ids.data() + size_t(i) * lk + size_t(l) * size_t(t.top_k);
            uint8_t *dst_q = t.gate_q.data() + size_t(i) * lk + size_t(l) * size_t(t.top_k);
            for (int32_t j = 0; j < t.top_k; ++j) {
                if (ids[j] >= t.n_expert) {
                    fail("{}: token {} layer {} has expert id {} >= n_expert {}", path, i, l, ids[j], t.n_expert);
                }
                dst_ids[j] = ids[j];
                dst_q[j] = ids[t.top_k + j];
            }
        }
    }
    return t;
}

std::string encode_trace(const std::string &path, const RoutingTrace &t, int level) {
    const int64_t n = t.n_tokens();
    const size_t lk = size_t(t.n_layer) * size_t(t.top_k);
    if (t.n_layer < 1 || t.n_expert < 1 || t.n_expert > 256 || t.top_k < 1 || t.top_k > t.n_expert ||
        t.first_moe_layer < 0 || t.first_moe_layer > 4095) {
        fail("{}: cannot write a trace with n_layer {}, n_expert {} (at most 256), top_k {}, first_moe_layer {}", path,
             t.n_layer, t.n_expert, t.top_k, t.first_moe_layer);
    }
    if (t.expert_ids.size() != size_t(n) * lk || t.gate_q.size() != size_t(n) * lk) {
        fail("{}: trace arrays hold {} ids and {} gates, expected {} tokens x {}", path, t.expert_ids.size(),
             t.gate_q.size(), n, lk);
    }
    int64_t total = 0;
    json seqs = json::array();
    for (const auto &s : t.sequences) {
        total += s.n_tokens;
        json js = {{"name", s.name}, {"source", s.source}, {"n_tokens", s.n_tokens}};
        if (s.n_prompt >= 0) {
            if (s.n_prompt > s.n_tokens) fail("{}: sequence {} has n_prompt {} > n_tokens {}", path, s.name, s.n_prompt,
                                              s.n_tokens);
            js["n_prompt"] = s.n_prompt;
        }
        seqs.push_back(std::move(js));
    }
    if (total != n) fail("{}: sequences hold {} tokens, the arrays {}", path, total, n);
    for (uint8_t id : t.expert_ids) {
        if (id >= t.n_expert) fail("{}: expert id {} >= n_expert {}", path, id, t.n_expert);
    }
    json h = {{"format_version", FORMAT_VERSION}, {"model", t.model}, {"arch", t.arch},
              {"n_layer", t.n_layer}, {"n_expert", t.n_expert}, {"top_k", t.top_k},
              {"gate_weight_scale", RoutingTrace::GATE_WEIGHT_SCALE}, {"sequences", seqs},
              {"n_tokens", n}, {"created_by", t.created_by}};
    // Absent means 0: traces of models without dense layers keep the bytes they always had.
    if (t.first_moe_layer > 0) h["first_moe_layer"] = t.first_moe_layer;
    std::string raw = header_bytes(TRACE_MAGIC, h);
    raw.reserve(raw.size() + size_t(n) * (4 + 2 * lk));
    for (int64_t i = 0; i < n; ++i) {
        for (int b = 0; b < 4; ++b) raw.push_back(char((t.token_ids[size_t(i)] >> (8 * b)) & 0xff));
        for (int32_t l = 0; l < t.n_layer; ++l) {
            raw.append(reinterpret_cast<const char *>(t.ids(i, l)), size_t(t.top_k));
            raw.append(reinterpret_cast<const char *>(t.gates(i, l)), size_t(t.top_k));
        }
    }
    return compress(path, raw, level);
}

void write_trace(const std::string &path, const RoutingTrace &t, int level) {
    write_file_atomic(path, encode_trace(path, t, level));
}

std::string hidden_path_for(const std::string &trace_path) {
    const std::string ext = ".pstrace";
    std::string base = trace_path;
    if (base.size() > ext.size() && base.compare(base.size() - ext.size(), ext.size(), ext) == 0) {
        base.resize(base.size() - ext.size());
    }
    return base + ".hidden.zst";
}

// ---------------------------------------------------------------------------------------------------------
// Hidden-state sidecar

void quantize_int8_absmax(const float *x, int64_t dim, float *scale, int8_t *q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
    *scale = amax / 127.0f;
    const float inv = *scale > 0.0f ? 1.0f / *scale : 0.0f;
    for (int64_t i = 0; i < dim; ++i) q[i] = int8_t(std::clamp(std::nearbyint(x[i] * inv), -127.0f, 127.0f));
}

void HiddenTrace::dequantize(int64_t i, int32_t layer, float *out) const {
    const size_t row = size_t(i) * size_t(n_layer) + size_t(layer);
    const float s = scale[row];
    const int8_t *src = q.data() + row * size_t(dim);
    for (int64_t c = 0; c < dim; ++c) out[c] = float(src[c]) * s;
}

void HiddenTrace::append_token(const float *x) {
    for (int32_t l = 0; l < n_layer; ++l) {
        float s = 0.0f;
        const size_t off = q.size();
        q.resize(off + size_t(dim));
        quantize_int8_absmax(x + size_t(l) * size_t(dim), dim, &s, q.data() + off);
        scale.push_back(s);
    }
}

std::vector<int64_t> HiddenTrace::flat_token_indices(const RoutingTrace &t) const {
    const auto bounds = t.sequence_bounds();
    std::vector<int64_t> out;
    out.reserve(size_t(n_tokens()));
    for (const auto &r : token_ranges) {
        for (int64_t j = 0; j < r[2]; ++j) out.push_back(bounds[size_t(r[0])][0] + r[1] + j);
    }
    return out;
}

HiddenTrace read_hidden(const std::string &path, const RoutingTrace *trace, const std::string &trace_path) {
    const std::string raw = decompress_one_frame(path, read_bytes(path));
    size_t body = 0;
    const json h = split_header(path, raw, HIDDEN_MAGIC, &body);
    HiddenTrace out;
    out.trace = str_field(path, h, "trace");
    if (!trace_path.empty() && out.trace != std::filesystem::path(trace_path).filename().string()) {
        fail("{}: this sidecar was recorded with the trace '{}', not with {} (pass the sidecar `prescope trace "
             "--hidden` wrote next to that trace)",
             path, out.trace, trace_path);
    }
    if (str_field(path, h, "encoding") != HIDDEN_ENCODING) {
        fail("{}: encoding {}, expected {}", path, h["encoding"].dump(), HIDDEN_ENCODING);
    }
    out.n_layer = int32_t(int_field(path, h, "n_layer", 1, 4096));
    out.dim = int_field(path, h, "dim", 1, int64_t(1) << 20);
    const int64_t n_tokens = int_field(path, h, "n_tokens", 0, int64_t(1) << 40);
    if (!h.contains("token_ranges") || !h["token_ranges"].is_array()) {
        fail("{}: token_ranges must be a list of [seq_index, first_token, n_tokens]", path);
    }
    int64_t covered = 0;
    for (const json &r : h["token_ranges"]) {
        if (!r.is_array() || r.size() != 3 || !r[0].is_number_integer() || !r[1].is_number_integer() ||
            !r[2].is_number_integer()) {
            fail("{}: token_ranges must be a list of [seq_index, first_token, n_tokens]", path);
        }
        const std::array<int64_t, 3> v{r[0].get<int64_t>(), r[1].get<int64_t>(), r[2].get<int64_t>()};
        if (v[0] < 0 || v[1] < 0 || v[2] < 0) fail("{}: token range {} has a negative entry", path, r.dump());
        covered += v[2];
        out.token_ranges.push_back(v);
    }
    if (covered != n_tokens) fail("{}: token_ranges cover {} tokens, header n_tokens is {}", path, covered, n_tokens);
    const uint64_t rec = 4 + uint64_t(out.dim);
    const uint64_t want = uint64_t(n_tokens) * uint64_t(out.n_layer) * rec;
    if (raw.size() - body != want) {
        fail("{}: body has {} bytes, expected {} tokens x {} layers x {} = {}", path, raw.size() - body, n_tokens,
             out.n_layer, rec, want);
    }
    if (trace) {
        if (trace->n_layer != out.n_layer) {
            fail("{}: n_layer {} but the trace has {}", path, out.n_layer, trace->n_layer);
        }
        for (const auto &r : out.token_ranges) {
            if (r[0] >= int64_t(trace->sequences.size()) || r[1] + r[2] > trace->sequences[size_t(r[0])].n_tokens) {
                fail("{}: token range [{}, {}, {}] lies outside the trace's sequences", path, r[0], r[1], r[2]);
            }
        }
    }
    const size_t rows = size_t(n_tokens) * size_t(out.n_layer);
    out.scale.resize(rows);
    out.q.resize(rows * size_t(out.dim));
    const char *p = raw.data() + body;
    for (size_t i = 0; i < rows; ++i, p += rec) {
        std::memcpy(&out.scale[i], p, 4);  // little-endian host (x86-64, aarch64)
        if (!std::isfinite(out.scale[i]) || out.scale[i] < 0) {
            fail("{}: token row {} has scale {}, expected a finite non-negative number", path, i / size_t(out.n_layer),
                 out.scale[i]);
        }
        std::memcpy(out.q.data() + i * size_t(out.dim), p + 4, size_t(out.dim));
    }
    return out;
}

std::string encode_hidden(const std::string &path, const HiddenTrace &h, int level) {
    const int64_t n = h.n_tokens();
    int64_t covered = 0;
    json ranges = json::array();
    for (const auto &r : h.token_ranges) {
        covered += r[2];
        ranges.push_back({r[0], r[1], r[2]});
    }
    if (covered != n || h.q.size() != size_t(n) * size_t(h.n_layer) * size_t(h.dim)) {
        fail("{}: sidecar arrays ({} scales, {} values) disagree with token_ranges ({} tokens), n_layer {}, dim {}",
             path, h.scale.size(), h.q.size(), covered, h.n_layer, h.dim);
    }
    const json hd = {{"format_version", FORMAT_VERSION}, {"trace", h.trace}, {"n_layer", h.n_layer},
                     {"dim", h.dim}, {"encoding", HIDDEN_ENCODING}, {"n_tokens", n}, {"token_ranges", ranges}};
    std::string raw = header_bytes(HIDDEN_MAGIC, hd);
    const size_t rows = size_t(n) * size_t(h.n_layer);
    raw.reserve(raw.size() + rows * (4 + size_t(h.dim)));
    for (size_t i = 0; i < rows; ++i) {
        raw.append(reinterpret_cast<const char *>(&h.scale[i]), 4);
        raw.append(reinterpret_cast<const char *>(h.q.data() + i * size_t(h.dim)), size_t(h.dim));
    }
    return compress(path, raw, level);
}

void write_hidden(const std::string &path, const HiddenTrace &h, int level) {
    write_file_atomic(path, encode_hidden(path, h, level));
}

// ---------------------------------------------------------------------------------------------------------
// Splits

RoutingTrace select_sequences(const RoutingTrace &t, std::span<const int64_t> seq_indices) {
    RoutingTrace out;
    out.model = t.model;
    out.arch = t.arch;
    out.created_by = t.created_by;
    out.n_layer = t.n_layer;
    out.first_moe_layer = t.first_moe_layer;
    out.n_expert = t.n_expert;
    out.top_k = t.top_k;
    const auto bounds = t.sequence_bounds();
    const size_t lk = size_t(t.n_layer) * size_t(t.top_k);
    for (int64_t s : seq_indices) {
        PRESCOPE_ASSERT(s >= 0 && s < int64_t(t.sequences.size()));
        out.sequences.push_back(t.sequences[size_t(s)]);
        const auto [a, b] = bounds[size_t(s)];
        out.token_ids.insert(out.token_ids.end(), t.token_ids.begin() + a, t.token_ids.begin() + b);
        out.expert_ids.insert(out.expert_ids.end(), t.expert_ids.begin() + a * int64_t(lk),
                              t.expert_ids.begin() + b * int64_t(lk));
        out.gate_q.insert(out.gate_q.end(), t.gate_q.begin() + a * int64_t(lk), t.gate_q.begin() + b * int64_t(lk));
    }
    return out;
}

HiddenTrace select_hidden(const HiddenTrace &h, std::span<const int64_t> seq_indices) {
    HiddenTrace out;
    out.trace = h.trace;
    out.n_layer = h.n_layer;
    out.dim = h.dim;
    const size_t row = size_t(h.n_layer) * size_t(h.dim);
    // Start of each range in sidecar rows.
    std::vector<int64_t> start(h.token_ranges.size());
    int64_t pos = 0;
    for (size_t i = 0; i < h.token_ranges.size(); ++i) {
        start[i] = pos;
        pos += h.token_ranges[i][2];
    }
    for (size_t k = 0; k < seq_indices.size(); ++k) {
        for (size_t i = 0; i < h.token_ranges.size(); ++i) {
            const auto &r = h.token_ranges[i];
            if (r[0] != seq_indices[k]) continue;
            out.token_ranges.push_back({int64_t(k), r[1], r[2]});
            out.scale.insert(out.scale.end(), h.scale.begin() + start[i] * h.n_layer,
                             h.scale.begin() + (start[i] + r[2]) * h.n_layer);
            out.q.insert(out.q.end(), h.q.begin() + start[i] * int64_t(row), h.q.begin() + (start[i] + r[2]) * int64_t(row));
        }
    }
    return out;
}

std::vector<int64_t> split_sequences(const RoutingTrace &t, const std::string &split, int64_t holdout_every) {
    if (split != "train" && split != "test" && split != "all") {
        fail("split '{}': expected train, test or all", split);
    }
    if (holdout_every < 2) fail("--holdout-every {}: expected at least 2", holdout_every);
    std::vector<int64_t> out;
    for (int64_t i = 0; i < int64_t(t.sequences.size()); ++i) {
        const bool test = i % holdout_every == holdout_every - 1;
        if (split == "all" || (split == "test") == test) out.push_back(i);
    }
    return out;
}

// ---------------------------------------------------------------------------------------------------------
// Prompts

std::vector<TracePrompt> read_prompt_file(const std::string &path, const std::string &default_source) {
    std::ifstream in(path);
    if (!in) fail("{}: cannot open the prompt file", path);
    std::vector<TracePrompt> out;
    std::string line;
    for (int64_t no = 1; std::getline(in, line); ++no) {
        if (!line.empty() && line.back() == '\r') line.pop_back();
        const size_t first = line.find_first_not_of(" \t");
        if (first == std::string::npos) continue;
        TracePrompt p{fmt::format("{}:{}", path, no), default_source, line};
        if (line[first] == '{') {
            json j;
            try {
                j = json::parse(line);
            } catch (const json::exception &e) {
                fail("{}:{}: not valid JSON ({})", path, no, e.what());
            }
            const char *key = j.contains("text") ? "text" : "prompt";
            if (!j.is_object() || !j.contains(key) || !j[key].is_string()) {
                fail("{}:{}: a JSON line needs a \"text\" or \"prompt\" string", path, no);
            }
            p.text = j[key].get<std::string>();
            if (j.contains("name") && j["name"].is_string()) p.name = j["name"].get<std::string>();
            if (j.contains("source") && j["source"].is_string()) p.source = j["source"].get<std::string>();
        }
        out.push_back(std::move(p));
    }
    if (in.bad()) fail("{}: read error", path);
    return out;
}

// ---------------------------------------------------------------------------------------------------------
// Recorder

TraceRecorder::TraceRecorder(Context &ctx, std::string model_name, std::string created_by, bool with_hidden)
    : ctx_(ctx), with_hidden_(with_hidden) {
    const HParams &hp = ctx.model().hp();
    if (hp.n_expert > 256) fail("the trace format stores expert ids as uint8; this model has {} experts", hp.n_expert);
    trace_.model = std::move(model_name);
    trace_.arch = hp.arch;
    trace_.created_by = std::move(created_by);
    // The MoE layers only: the hooks fire for them alone (Context::moe_block).
    const int64_t L = hp.n_layer_moe(), dense = hp.n_layer_dense;
    trace_.n_layer = int32_t(L);
    trace_.first_moe_layer = int32_t(dense);
    trace_.n_expert = int32_t(hp.n_expert);
    trace_.top_k = int32_t(hp.n_expert_used);
    hidden_.n_layer = trace_.n_layer;
    hidden_.dim = hp.n_embd;
    ids_.resize(size_t(L));
    w_.resize(size_t(L));
    x_.resize(size_t(L));
    tok_ids_.resize(size_t(L * hp.n_expert_used));
    tok_w_.resize(tok_ids_.size());
    tok_x_.resize(size_t(L * hp.n_embd));
    ctx_.on_routing = [this, dense](int64_t layer, const Routing &r) {
        auto &ids = ids_[size_t(layer - dense)];
        auto &w = w_[size_t(layer - dense)];
        ids.insert(ids.end(), r.ids.begin(), r.ids.begin() + r.n_tok * r.k);
        w.insert(w.end(), r.weights.begin(), r.weights.begin() + r.n_tok * r.k);
    };
    if (with_hidden_) {
        ctx_.on_router_input = [this, dense](int64_t layer, const float *x, int64_t n_tok) {
            auto &dst = x_[size_t(layer - dense)];
            dst.insert(dst.end(), x, x + n_tok * hidden_.dim);
        };
    }
}

TraceRecorder::~TraceRecorder() {
    ctx_.on_routing = nullptr;
    ctx_.on_router_input = nullptr;
}

void TraceRecorder::begin_sequence(std::string name, std::string source) {
    trace_.sequences.push_back({std::move(name), std::move(source), 0});
}

void TraceRecorder::add_tokens(std::span<const int32_t> tokens) {
    PRESCOPE_ASSERT(!trace_.sequences.empty());
    const auto n = int64_t(tokens.size());
    const int64_t k = trace_.top_k, L = trace_.n_layer, d = hidden_.dim;
    for (int64_t l = 0; l < L; ++l) {
        if (int64_t(ids_[size_t(l)].size()) != n * k || (with_hidden_ && int64_t(x_[size_t(l)].size()) != n * d)) {
            fail("trace recorder: layer {} routed {} tokens, expected {}", l + trace_.first_moe_layer,
                 ids_[size_t(l)].size() / size_t(k), n);
        }
    }
    TraceSequence &seq = trace_.sequences.back();
    if (with_hidden_) {
        if (hidden_.token_ranges.empty() || hidden_.token_ranges.back()[0] != int64_t(trace_.sequences.size()) - 1) {
            hidden_.token_ranges.push_back({int64_t(trace_.sequences.size()) - 1, seq.n_tokens, 0});
        }
        hidden_.token_ranges.back()[2] += n;
    }
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t l = 0; l < L; ++l) {
            std::copy_n(ids_[size_t(l)].begin() + t * k, k, tok_ids_.begin() + l * k);
            std::copy_n(w_[size_t(l)].begin() + t * k, k, tok_w_.begin() + l * k);
            if (with_hidden_) std::copy_n(x_[size_t(l)].begin() + t * d, d, tok_x_.begin() + l * d);
        }
        trace_.append_token(uint32_t(tokens[size_t(t)]), tok_ids_, tok_w_);
        if (with_hidden_) hidden_.append_token(tok_x_.data());
    }
    seq.n_tokens += n;
    for (int64_t l = 0; l < L; ++l) {
        ids_[size_t(l)].clear();
        w_[size_t(l)].clear();
        x_[size_t(l)].clear();
    }
}

} // namespace prescope
