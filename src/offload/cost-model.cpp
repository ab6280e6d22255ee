// CostProfile (the H200 reference, JSON) and CostModel (per-expert times from a profile).
#include "offload/cost-model.h"

#include "core/error.h"
#include "core/json-file.h"
#include "core/output-file.h"
#include "offload/byte-size.h"
#include "offload/expert-store.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

namespace prescope {

namespace {

constexpr double kMiB = double(1 << 20);

nlohmann::json points_json(const std::vector<CostPoint> &p) {
    nlohmann::json a = nlohmann::json::array();
    for (const CostPoint &c : p) a.push_back({c.x, c.value});
    return a;
}

std::vector<CostPoint> points_from(const nlohmann::json &j, std::string_view source, std::string_view field) {
    std::vector<CostPoint> out;
    if (!j.is_array()) fail("{}: '{}' must be an array of [x, value] pairs", source, field);
    for (const nlohmann::json &e : j) {
        if (!e.is_array() || e.size() != 2 || !e[0].is_number() || !e[1].is_number() || !(e[1].get<double>() > 0) ||
            !std::isfinite(e[0].get<double>()) || !std::isfinite(e[1].get<double>())) {
            fail("{}: '{}' must hold [x, value] pairs of finite numbers with value > 0", source, field);
        }
        out.push_back({e[0].get<double>(), e[1].get<double>()});
    }
    std::sort(out.begin(), out.end(), [](const CostPoint &a, const CostPoint &b) { return a.x < b.x; });
    return out;
}

double positive(const nlohmann::json &j, const char *key, double fallback, std::string_view source) {
    if (!j.contains(key)) return fallback;
    if (!j[key].is_number() || !std::isfinite(j[key].get<double>()) || j[key].get<double>() < 0) {
        fail("{}: '{}' must be a finite number >= 0", source, key);
    }
    return j[key].get<double>();
}

std::string text(const nlohmann::json &j, const char *key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
}

} // namespace

// ---------------------------------------------------------------------------------------------------------------
// shapes

std::string ExpertShape::key() const { return fmt::format("{}x{}:{}", n_embd, n_ff, dtype); }

ExpertShape ExpertShape::of(const ExpertLayout &layout) {
    ExpertShape s;
    s.n_embd = layout.n_embd;
    s.n_ff = layout.n_ff;
    s.bytes = layout.bytes;
    const bool same = layout.gate_type == layout.up_type && layout.up_type == layout.down_type;
    s.dtype = same ? dtype_name(layout.gate_type) : "mixed";
    return s;
}

ExpertShape ExpertShape::named(std::string_view name) {
    ExpertShape s;
    if (name == "qwen3-30b-a3b") {
        s.n_embd = 2048;
        s.n_ff = 768;
    } else if (name == "mixtral-8x7b") {
        s.n_embd = 4096;
        s.n_ff = 14336;
    } else {
        fail("unknown expert shape '{}' (known: qwen3-30b-a3b, mixtral-8x7b)", name);
    }
    s.dtype = "q8_0";
    // Q8_0: 34 bytes per 32 weights; each of the three parts padded to 256 bytes (ExpertLayout).
    const auto part = [](uint64_t n) { return (n / 32 * 34 + 255) / 256 * 256; };
    s.bytes = 3 * part(uint64_t(s.n_embd) * uint64_t(s.n_ff));
    return s;
}

double interpolate(const std::vector<CostPoint> &p, double x) {
    if (p.empty()) return 0;
    if (p.size() == 1) return p[0].value;
    size_t i = 1;
    while (i + 1 < p.size() && x > p[i].x) ++i;
    const CostPoint &a = p[i - 1], &b = p[i];
    if (b.x == a.x) return b.value;
    return a.value + (b.value - a.value) * (x - a.x) / (b.x - a.x);
}

// ---------------------------------------------------------------------------------------------------------------
// profile

CostProfile CostProfile::h200_reference() {
    CostProfile p;
    p.source = "reference: the H200 host of ../shared/design/reference-numbers.md (measured there 2026-11-29 and "
               "2026-12-01) and the issue-10 runs; derived, not measured on this machine";
    p.gpu = "NVIDIA H200 (reference)";
    p.cpu = "16-core Xeon, Sapphire Rapids class (reference)";
    p.h2d_gb_s = {{64.0 * 1024, 17.9},   {256.0 * 1024, 36.5}, {1.0 * kMiB, 48.5},
                  {4.0 * kMiB, 53.6},    {16.0 * kMiB, 55.0},  {256.0 * kMiB, 55.5}};
    p.h2d_request_us = 10;
    p.link_source = "reference: pinned H2D by chunk size, PCIe Gen5 x16; ~10 us launch latency per request";
    p.gpu_hbm_gb_s = 3700;
    p.gpu_tflops = 760;
    p.gpu_expert_us = 1;
    p.gpu_wave_us = 22;
    p.gpu_layer_us = 140;
    p.gpu_layer_us_per_token = 9;
    p.gpu_source = "reference: fitted to cuBLAS BF16 expert FFNs (Qwen3 shape 0.022 ms launch-bound; Mixtral shape "
                   "0.095/0.107/0.140 ms at 1/64/256 tokens) and PreScope's decode 7.8 ms/token and prefill 2,221 "
                   "tok/s at full residency (Qwen3 shape); the Q8_0 kernels themselves are not measured";
    p.cpu_threads = 16;
    p.host_read_gb_s = {{1, 7.6}, {4, 27}, {8, 52}, {16, 92}};
    p.cpu_bw_fraction = 0.73;
    p.cpu_gflops = 450;
    p.cpu_expert_us = 25;
    p.cpu_layer_us = 10;
    p.cpu_source = "reference: host read 7.6/27/52/92 GB/s at 1/4/8/16 threads; Mixtral-shape Q8_0 experts at "
                   "~67 GB/s (issue 10); fixed and FLOP terms fitted to the CPU engine's Qwen3-shape Q8_0 decode "
                   "17.2 and prefill 124 tok/s (bench/results/cpu-q30b-h200host-t16.json)";
    p.numa_nodes = 1;
    p.numa_remote_factor = 1.0;
    return p;
}

const ShapeTimings *CostProfile::find_shape(const std::string &key) const {
    for (const ShapeTimings &s : shapes) {
        if (s.shape == key) return &s;
    }
    return nullptr;
}

ShapeTimings &CostProfile::shape_entry(const std::string &key) {
    for (ShapeTimings &s : shapes) {
        if (s.shape == key) return s;
    }
    shapes.push_back({});
    shapes.back().shape = key;
    return shapes.back();
}

nlohmann::json CostProfile::to_json() const {
    nlohmann::json sh = nlohmann::json::array();
    for (const ShapeTimings &s : shapes) {
        sh.push_back({{"shape", s.shape},
                      {"gpu_us_by_tokens", points_json(s.gpu_us)},
                      {"cpu_us_by_tokens", points_json(s.cpu_us)},
                      {"gpu_source", s.gpu_source},
                      {"cpu_source", s.cpu_source}});
        if (s.cpu_layer_us >= 0) sh.back()["cpu_layer_us"] = s.cpu_layer_us;
    }
    return {{"format", "prescope-cost-profile"},
            {"version", 1},
            {"source", source},
            {"gpu", gpu},
            {"cpu", cpu},
            {"link", {{"h2d_gb_s_by_chunk_bytes", points_json(h2d_gb_s)},
                      {"h2d_request_us", h2d_request_us},
                      {"source", link_source}}},
            {"gpu_terms", {{"hbm_gb_s", gpu_hbm_gb_s},
                           {"tflops", gpu_tflops},
                           {"expert_us", gpu_expert_us},
                           {"wave_us", gpu_wave_us},
                           {"layer_us", gpu_layer_us},
                           {"layer_us_per_token", gpu_layer_us_per_token},
                           {"source", gpu_source}}},
            {"cpu_terms", {{"threads", cpu_threads},
                           {"host_read_gb_s_by_threads", points_json(host_read_gb_s)},
                           {"bw_fraction", cpu_bw_fraction},
                           {"gflops", cpu_gflops},
                           {"expert_us", cpu_expert_us},
                           {"layer_us", cpu_layer_us},
                           {"source", cpu_source}}},
            {"numa", {{"nodes", numa_nodes}, {"remote_factor", numa_remote_factor}}},
            {"shapes", std::move(sh)}};
}

CostProfile CostProfile::from_json(const nlohmann::json &j, std::string_view src) {
    check_json_header(j, src, "prescope-cost-profile", "a cost profile");
    CostProfile p;
    p.source = text(j, "source");
    p.gpu = text(j, "gpu");
    p.cpu = text(j, "cpu");
    for (const char *group : {"link", "gpu_terms", "cpu_terms"}) {
        if (!j.contains(group) || !j[group].is_object()) fail("{}: '{}' must be an object", src, group);
    }
    const nlohmann::json &l = j["link"], &g = j["gpu_terms"], &c = j["cpu_terms"];
    if (!l.contains("h2d_gb_s_by_chunk_bytes")) fail("{}: 'link.h2d_gb_s_by_chunk_bytes' is missing", src);
    p.h2d_gb_s = points_from(l["h2d_gb_s_by_chunk_bytes"], src, "link.h2d_gb_s_by_chunk_bytes");
    if (p.h2d_gb_s.empty()) fail("{}: 'link.h2d_gb_s_by_chunk_bytes' needs at least one point", src);
    p.h2d_request_us = positive(l, "h2d_request_us", p.h2d_request_us, src);
    p.link_source = text(l, "source");
    p.gpu_hbm_gb_s = positive(g, "hbm_gb_s", p.gpu_hbm_gb_s, src);
    p.gpu_tflops = positive(g, "tflops", p.gpu_tflops, src);
    p.gpu_expert_us = positive(g, "expert_us", p.gpu_expert_us, src);
    p.gpu_wave_us = positive(g, "wave_us", p.gpu_wave_us, src);
    p.gpu_layer_us = positive(g, "layer_us", p.gpu_layer_us, src);
    p.gpu_layer_us_per_token = positive(g, "layer_us_per_token", p.gpu_layer_us_per_token, src);
    p.gpu_source = text(g, "source");
    if (!(p.gpu_hbm_gb_s > 0) || !(p.gpu_tflops > 0)) fail("{}: 'gpu_terms.hbm_gb_s' and 'tflops' must be > 0", src);
    p.cpu_threads = int32_t(positive(c, "threads", p.cpu_threads, src));
    if (p.cpu_threads < 1) fail("{}: 'cpu_terms.threads' must be >= 1", src);
    if (!c.contains("host_read_gb_s_by_threads")) fail("{}: 'cpu_terms.host_read_gb_s_by_threads' is missing", src);
    p.host_read_gb_s = points_from(c["host_read_gb_s_by_threads"], src, "cpu_terms.host_read_gb_s_by_threads");
    if (p.host_read_gb_s.empty()) fail("{}: 'cpu_terms.host_read_gb_s_by_threads' needs a point", src);
    p.cpu_bw_fraction = positive(c, "bw_fraction", p.cpu_bw_fraction, src);
    p.cpu_gflops = positive(c, "gflops", p.cpu_gflops, src);
    p.cpu_expert_us = positive(c, "expert_us", p.cpu_expert_us, src);
    p.cpu_layer_us = positive(c, "layer_us", p.cpu_layer_us, src);
    p.cpu_source = text(c, "source");
    if (!(p.cpu_bw_fraction > 0) || !(p.cpu_gflops > 0)) fail("{}: 'cpu_terms.bw_fraction' and 'gflops' must be > 0", src);
    if (j.contains("numa")) {
        p.numa_nodes = int32_t(positive(j["numa"], "nodes", 1, src));
        p.numa_remote_factor = positive(j["numa"], "remote_factor", 1, src);
        if (p.numa_remote_factor < 1) fail("{}: 'numa.remote_factor' must be >= 1", src);
    }
    if (j.contains("shapes")) {
        if (!j["shapes"].is_array()) fail("{}: 'shapes' must be an array", src);
        for (const nlohmann::json &s : j["shapes"]) {
            if (!s.is_object() || !s.contains("shape") || !s["shape"].is_string()) {
                fail("{}: every 'shapes' entry needs a 'shape' string", src);
            }
            ShapeTimings t;
            t.shape = s["shape"].get<std::string>();
            if (s.contains("gpu_us_by_tokens")) t.gpu_us = points_from(s["gpu_us_by_tokens"], src, t.shape + ".gpu_us_by_tokens");
            if (s.contains("cpu_us_by_tokens")) t.cpu_us = points_from(s["cpu_us_by_tokens"], src, t.shape + ".cpu_us_by_tokens");
            if (s.contains("cpu_layer_us")) {  // absent in profiles written before it was measured
                if (!s["cpu_layer_us"].is_number() || !std::isfinite(s["cpu_layer_us"].get<double>())) {
                    fail("{}: {}.cpu_layer_us must be a number (negative: not measured)", src, t.shape);
                }
                t.cpu_layer_us = s["cpu_layer_us"].get<double>();
            }
            t.gpu_source = text(s, "gpu_source");
            t.cpu_source = text(s, "cpu_source");
            p.shapes.push_back(std::move(t));
        }
    }
    return p;
}

CostProfile CostProfile::load(const std::string &path) {
    return from_json(read_json_file(path, "the cost profile"), path);
}

void CostProfile::save(const std::string &path) const {
    write_file_atomic(path, to_json().dump(1) + "\n");
}

// ---------------------------------------------------------------------------------------------------------------
// model

CostModel::CostModel(const CostProfile &profile, const ExpertShape &shape, int32_t threads, uint64_t chunk_bytes,
                     bool numa_remote)
    : profile_(profile), shape_(shape), threads_(std::max(threads, 1)), chunk_bytes_(std::max<uint64_t>(chunk_bytes, 1)),
      numa_remote_(numa_remote) {
    PRESCOPE_ASSERT(!profile_.h2d_gb_s.empty() && !profile_.host_read_gb_s.empty());
    for (size_t i = 0; i < profile_.shapes.size(); ++i) {
        if (profile_.shapes[i].shape == shape_.key()) measured_ = int32_t(i);
    }
}

double CostModel::link_gb_s() const {
    const double chunk = double(std::min<uint64_t>(chunk_bytes_, std::max<uint64_t>(shape_.bytes, 1)));
    return std::max(interpolate(profile_.h2d_gb_s, chunk), 0.01) / corrections.link;
}

double CostModel::h2d_us(uint64_t bytes) const {
    const double chunk = double(std::min<uint64_t>(chunk_bytes_, std::max<uint64_t>(bytes, 1)));
    const double gb_s = std::max(interpolate(profile_.h2d_gb_s, chunk), 0.01);
    return (profile_.h2d_request_us + double(bytes) / (gb_s * 1e3)) * corrections.link;
}

double CostModel::link_us(uint64_t bytes, uint64_t requests) const {
    return double(requests) * profile_.h2d_request_us * corrections.link + double(bytes) / (link_gb_s() * 1e3);
}

double CostModel::gpu_us(int64_t tokens) const {
    double us;
    if (measured_ >= 0 && !profile_.shapes[size_t(measured_)].gpu_us.empty()) {
        us = interpolate(profile_.shapes[size_t(measured_)].gpu_us, double(tokens));
    } else {
        const double read = double(shape_.bytes) / (profile_.gpu_hbm_gb_s * 1e3);
        const double math = double(tokens) * shape_.flops_per_token() / (profile_.gpu_tflops * 1e6);
        us = profile_.gpu_expert_us + std::max(read, math);
    }
    return std::max(us, 0.0) * corrections.gpu;
}

double CostModel::host_read_gb_s() const {
    const double bw = std::max(interpolate(profile_.host_read_gb_s, double(threads_)), 0.01);
    return numa_remote_ ? bw / profile_.numa_remote_factor : bw;
}

double CostModel::cpu_layer_us() const {
    const bool measured = measured_ >= 0 && profile_.shapes[size_t(measured_)].cpu_layer_us >= 0 &&
                          threads_ == profile_.cpu_threads;
    return (measured ? profile_.shapes[size_t(measured_)].cpu_layer_us : profile_.cpu_layer_us) * corrections.cpu;
}

double CostModel::cpu_us(int64_t tokens) const {
    double us;
    if (measured_ >= 0 && !profile_.shapes[size_t(measured_)].cpu_us.empty() && threads_ == profile_.cpu_threads) {
        us = interpolate(profile_.shapes[size_t(measured_)].cpu_us, double(tokens));
    } else {
        const double read = double(shape_.bytes) / (host_read_gb_s() * profile_.cpu_bw_fraction * 1e3);
        const double gflops = profile_.cpu_gflops * double(threads_) / double(profile_.cpu_threads);
        const double math = double(tokens) * shape_.flops_per_token() / (gflops * 1e3);
        us = profile_.cpu_expert_us + std::max(read, math);  // the products stream the weights once
    }
    return std::max(us, 0.0) * corrections.cpu;
}

std::string CostModel::describe() const {
    const ShapeTimings *m = measured_ >= 0 ? &profile_.shapes[size_t(measured_)] : nullptr;
    const bool gpu_measured = m && !m->gpu_us.empty();
    const bool cpu_measured = m && !m->cpu_us.empty() && threads_ == profile_.cpu_threads;
    std::string out = fmt::format("cost model: expert {} ({}), {} CPU threads, copy chunk {}\n", shape_.key(),
                                  format_byte_size(shape_.bytes), threads_, format_byte_size(chunk_bytes_));
    out += fmt::format("  profile: {}\n", profile_.source);
    out += fmt::format("  link: fetch {:.1f} us per expert ({:.1f} GB/s at the chunk size, {:.0f} us per request) [{}]\n",
                       fetch_us(), link_gb_s(), profile_.h2d_request_us, profile_.link_source);
    out += fmt::format("  GPU: expert {:.1f} / {:.1f} / {:.1f} us at 1 / 64 / 512 tokens, {:.0f} us per grouped launch, "
                       "{:.0f} us + {:.1f} us/token per layer outside the experts [{}]\n",
                       gpu_us(1), gpu_us(64), gpu_us(512), gpu_wave_us(), profile_.gpu_layer_us,
                       profile_.gpu_layer_us_per_token, gpu_measured ? m->gpu_source : profile_.gpu_source);
    out += fmt::format("  CPU: expert {:.1f} / {:.1f} / {:.1f} us at 1 / 64 / 512 tokens + {:.1f} us per layer with CPU "
                       "experts; host read {:.1f} GB/s at {} threads{} [{}]\n",
                       cpu_us(1), cpu_us(64), cpu_us(512), cpu_layer_us(), host_read_gb_s(), threads_,
                       numa_remote_ ? fmt::format(" (remote NUMA node, x{:.2f})", profile_.numa_remote_factor) : "",
                       cpu_measured ? m->cpu_source : profile_.cpu_source);
    if (corrections.cpu != 1 || corrections.gpu != 1 || corrections.link != 1) {
        out += fmt::format("  corrections: cpu x{:.3f}, gpu x{:.3f}, link x{:.3f}\n", corrections.cpu,
                           corrections.gpu, corrections.link);
    }
    return out;
}

nlohmann::json CostModel::to_json() const {
    return {{"shape", shape_.key()},
            {"expert_bytes", shape_.bytes},
            {"threads", threads_},
            {"chunk_bytes", chunk_bytes_},
            {"fetch_us", fetch_us()},
            {"gpu_us_1", gpu_us(1)},
            {"cpu_us_1", cpu_us(1)},
            {"cpu_layer_us", cpu_layer_us()},
            {"corrections", {{"cpu", corrections.cpu}, {"gpu", corrections.gpu}, {"link", corrections.link}}},
            {"profile_source", profile_.source}};
}

} // namespace prescope
