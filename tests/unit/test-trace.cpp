// Routing traces (docs/trace-format.md): round trips, the byte layout, rejection of damaged files, prompt files,
// splits, and the recorder on a tiny model (the recorded router inputs reproduce the recorded routing).
#include "../common/random-trace.h"
#include "arch/arch.h"
#include "core/error.h"
#include "offload/trace.h"
#include "runtime/context.h"
#include "runtime/moe.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <zstd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <unistd.h>

using namespace prescope;
namespace fs = std::filesystem;

namespace {

fs::path tmp_dir() {
    fs::path d = fs::temp_directory_path() / ("prescope-test-trace-" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
}

// Random routing with gate weights decreasing over the top-k, as a router's are.
RoutingTrace random_trace(int32_t L, int32_t E, int32_t K, const std::vector<int64_t> &seq_lens, uint32_t seed) {
    return test::random_trace(L, E, K, seq_lens, seed,
                              [K](int32_t j) { return float(K - j) / float(K * (K + 1) / 2); });
}

std::string raw_of(const fs::path &p) {
    std::ifstream in(p, std::ios::binary);
    std::string c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::string raw(ZSTD_getFrameContentSize(c.data(), c.size()), '\0');
    EXPECT_EQ(ZSTD_decompress(raw.data(), raw.size(), c.data(), c.size()), raw.size());
    return raw;
}

void write_frame(const fs::path &p, const std::string &raw) {
    std::string c(ZSTD_compressBound(raw.size()), '\0');
    c.resize(ZSTD_compress(c.data(), c.size(), raw.data(), raw.size(), 3));
    std::ofstream(p, std::ios::binary).write(c.data(), std::streamsize(c.size()));
}

// Expects read_trace(p) to throw an Error naming the file and containing `what`.
void expect_rejected(const fs::path &p, const std::string &what) {
    try {
        read_trace(p.string());
        ADD_FAILURE() << "accepted a damaged trace (" << what << ")";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
}

} // namespace

TEST(Trace, RoundTripKeepsEverything) {
    const fs::path p = tmp_dir() / "rt.pstrace";
    const RoutingTrace t = random_trace(5, 40, 4, {7, 1, 12}, 1);
    write_trace(p.string(), t);
    const RoutingTrace r = read_trace(p.string());
    EXPECT_EQ(r.model, t.model);
    EXPECT_EQ(r.arch, t.arch);
    EXPECT_EQ(r.created_by, t.created_by);
    EXPECT_EQ(r.n_layer, 5);
    EXPECT_EQ(r.n_expert, 40);
    EXPECT_EQ(r.top_k, 4);
    ASSERT_EQ(r.sequences.size(), 3u);
    EXPECT_EQ(r.sequences[1].source, "gsm8k");
    EXPECT_EQ(r.sequences[2].n_tokens, 12);
    EXPECT_EQ(r.token_ids, t.token_ids);
    EXPECT_EQ(r.expert_ids, t.expert_ids);
    EXPECT_EQ(r.gate_q, t.gate_q);
    EXPECT_EQ(r.sequence_bounds()[2][0], 8);
    EXPECT_EQ(r.sequences[0].n_prompt, -1);  // absent: every token given
}

TEST(Trace, KeepsThePromptLengthOfDecodedSequences) {
    const fs::path p = tmp_dir() / "decoded.pstrace";
    RoutingTrace t = random_trace(2, 8, 2, {6, 3}, 4);
    t.sequences[0].n_prompt = 4;  // 4 given tokens, then 2 decoded by the model
    write_trace(p.string(), t);
    const RoutingTrace r = read_trace(p.string());
    EXPECT_EQ(r.sequences[0].n_prompt, 4);
    EXPECT_EQ(r.sequences[1].n_prompt, -1);
    t.sequences[1].n_prompt = 4;  // more than its 3 tokens
    try {
        write_trace(p.string(), t);
        ADD_FAILURE() << "wrote n_prompt > n_tokens";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("n_prompt 4 > n_tokens 3"), std::string::npos) << e.what();
    }
}

TEST(Trace, ByteLayoutFollowsTheSpec) {
    const fs::path p = tmp_dir() / "layout.pstrace";
    RoutingTrace t = random_trace(2, 8, 2, {}, 2);
    t.sequences.push_back({"one", "test-split", 1});
    t.append_token(0x01020304u, std::vector<int32_t>{5, 3, 7, 0}, std::vector<float>{0.75f, 0.25f, 1.0f, 0.0f});
    write_trace(p.string(), t);
    const std::string raw = raw_of(p);
    ASSERT_EQ(raw.substr(0, 8), "PSTRACE1");
    uint32_t hlen = 0;
    std::memcpy(&hlen, raw.data() + 8, 4);
    const auto h = nlohmann::json::parse(raw.substr(12, hlen));
    EXPECT_EQ(h["format_version"], 1);
    EXPECT_EQ(h["gate_weight_scale"], 255);
    EXPECT_EQ(h["n_tokens"], 1);
    EXPECT_FALSE(h.contains("first_moe_layer"));  // 0: left out, so such traces keep their old bytes
    const std::string body = raw.substr(12 + hlen);
    // token id LE, then per layer: k ids, k weights round(w * 255)
    const std::string want = std::string("\x04\x03\x02\x01", 4) + std::string("\x05\x03", 2) +
                             std::string("\xbf\x40", 2) + std::string("\x07\x00", 2) + std::string("\xff\x00", 2);
    EXPECT_EQ(body, want);
}

TEST(Trace, RejectsDamagedFiles) {
    const fs::path dir = tmp_dir();
    const fs::path good = dir / "good.pstrace";
    write_trace(good.string(), random_trace(3, 16, 2, {4, 5}, 3));
    const std::string raw = raw_of(good);
    uint32_t hlen = 0;
    std::memcpy(&hlen, raw.data() + 8, 4);
    const fs::path bad = dir / "bad.pstrace";

    write_frame(bad, "XSTRACE1" + raw.substr(8));
    expect_rejected(bad, "bad magic");
    write_frame(bad, raw.substr(0, raw.size() - 1));
    expect_rejected(bad, "body has");
    std::string id = raw;
    id[12 + hlen + 4] = char(16);  // first expert id == n_expert
    write_frame(bad, id);
    expect_rejected(bad, "expert id 16 >= n_expert 16");
    auto h = nlohmann::json::parse(raw.substr(12, hlen));
    const auto with_header = [&](const nlohmann::json &j) {
        const std::string hs = j.dump();
        const auto n = uint32_t(hs.size());
        return std::string("PSTRACE1") + std::string(reinterpret_cast<const char *>(&n), 4) + hs + raw.substr(12 + hlen);
    };
    auto h2 = h;
    h2["format_version"] = 2;
    write_frame(bad, with_header(h2));
    expect_rejected(bad, "format_version");
    h2 = h;
    h2["n_expert"] = 300;
    write_frame(bad, with_header(h2));
    expect_rejected(bad, "n_expert");
    h2 = h;
    h2["sequences"][0]["n_tokens"] = 3;
    write_frame(bad, with_header(h2));
    expect_rejected(bad, "sequences hold 8 tokens but header n_tokens is 9");
    h2 = h;
    h2["sequences"][0]["n_prompt"] = 5;  // the sequence has 4 tokens
    write_frame(bad, with_header(h2));
    expect_rejected(bad, "n_prompt");
    h2 = h;
    h2["first_moe_layer"] = -1;
    write_frame(bad, with_header(h2));
    expect_rejected(bad, "first_moe_layer");
    h2 = h;
    h2.erase("top_k");
    write_frame(bad, with_header(h2));
    expect_rejected(bad, "top_k");
    write_frame(bad, raw.substr(0, 12) + "{not json" + raw.substr(12 + 9));
    expect_rejected(bad, "header is not valid JSON");

    // Two frames, a truncated frame, no frame at all, a missing file.
    std::ifstream in(good, std::ios::binary);
    const std::string c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(bad, std::ios::binary) << c << c;
    expect_rejected(bad, "after the zstd frame");
    std::ofstream(bad, std::ios::binary) << c.substr(0, c.size() - 5);
    expect_rejected(bad, "zstd");
    std::ofstream(bad, std::ios::binary) << "plain text, not zstd";
    expect_rejected(bad, "not a valid zstd frame");
    expect_rejected(dir / "missing.pstrace", "cannot open");
}

// A trace of a model with leading dense layers holds its MoE layers only (decision 0134): the header says where
// they start; a trace without the field (every trace of an all-MoE model) starts at 0.
TEST(Trace, FirstMoeLayerRoundTripsAndIsWrittenOnlyWhenNotZero) {
    const fs::path p = tmp_dir() / "first-moe.pstrace";
    RoutingTrace t = random_trace(4, 16, 2, {3}, 7);
    t.first_moe_layer = 3;
    write_trace(p.string(), t);
    const std::string raw = raw_of(p);
    uint32_t hlen = 0;
    std::memcpy(&hlen, raw.data() + 8, 4);
    EXPECT_EQ(nlohmann::json::parse(raw.substr(12, hlen))["first_moe_layer"], 3);
    const RoutingTrace r = read_trace(p.string());
    EXPECT_EQ(r.first_moe_layer, 3);
    EXPECT_EQ(r.n_layer, 4);
    EXPECT_EQ(r.expert_ids, t.expert_ids);
    EXPECT_EQ(select_sequences(r, std::vector<int64_t>{0}).first_moe_layer, 3);
    t.first_moe_layer = 0;
    write_trace(p.string(), t);
    EXPECT_EQ(read_trace(p.string()).first_moe_layer, 0);
}

TEST(Trace, HiddenSidecarRoundTripAndChecks) {
    const fs::path dir = tmp_dir();
    const RoutingTrace t = random_trace(3, 8, 2, {4, 6}, 4);
    HiddenTrace h;
    h.trace = "x.pstrace", h.n_layer = 3, h.dim = 5;
    h.token_ranges = {{1, 2, 3}};
    std::mt19937 rng(5);
    std::normal_distribution<float> nd;
    std::vector<std::vector<float>> xs;
    for (int i = 0; i < 3; ++i) {
        std::vector<float> x(15);
        for (auto &v : x) v = nd(rng);
        if (i == 0) std::fill(x.begin(), x.begin() + 5, 0.0f);  // an all-zero row keeps scale 0
        h.append_token(x.data());
        xs.push_back(x);
    }
    const fs::path p = dir / "x.hidden.zst";
    write_hidden(p.string(), h);
    const HiddenTrace r = read_hidden(p.string(), &t, (dir / "x.pstrace").string());
    EXPECT_EQ(r.n_tokens(), 3);
    try {
        read_hidden(p.string(), &t, "other/y.pstrace");  // same shape, another trace
        ADD_FAILURE() << "a sidecar of another trace accepted";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("recorded with the trace 'x.pstrace', not with other/y.pstrace"),
                  std::string::npos)
            << e.what();
    }
    EXPECT_EQ(r.flat_token_indices(t), (std::vector<int64_t>{6, 7, 8}));
    EXPECT_EQ(r.scale[0], 0.0f);
    std::vector<float> y(5);
    for (int i = 0; i < 3; ++i) {
        for (int32_t l = 0; l < 3; ++l) {
            r.dequantize(i, l, y.data());
            for (int c = 0; c < 5; ++c) EXPECT_LE(std::fabs(y[size_t(c)] - xs[size_t(i)][size_t(l * 5 + c)]), 0.5f * r.scale[size_t(i * 3 + l)] + 1e-6f);
        }
    }
    h.token_ranges = {{1, 4, 3}};  // runs past sequence 1's 6 tokens
    write_hidden(p.string(), h);
    EXPECT_THROW(read_hidden(p.string(), &t), Error);
    EXPECT_NO_THROW(read_hidden(p.string()));  // without the trace the ranges cannot be checked
    const RoutingTrace t4 = random_trace(4, 8, 2, {4, 6}, 4);
    h.token_ranges = {{1, 2, 3}};
    write_hidden(p.string(), h);
    try {
        read_hidden(p.string(), &t4);
        ADD_FAILURE() << "layer mismatch accepted";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("n_layer 3 but the trace has 4"), std::string::npos) << e.what();
    }
    EXPECT_EQ(hidden_path_for("dir/topo.pstrace"), "dir/topo.hidden.zst");
}

TEST(Trace, SplitsBySequence) {
    const RoutingTrace t = random_trace(2, 8, 2, {1, 2, 3, 4, 5, 6}, 6);
    EXPECT_EQ(split_sequences(t, "test", 3), (std::vector<int64_t>{2, 5}));
    EXPECT_EQ(split_sequences(t, "train", 3), (std::vector<int64_t>{0, 1, 3, 4}));
    EXPECT_EQ(split_sequences(t, "all", 3).size(), 6u);
    EXPECT_THROW(split_sequences(t, "dev", 3), Error);
    EXPECT_THROW(split_sequences(t, "test", 1), Error);
    const std::vector<int64_t> pick{5, 2};
    const RoutingTrace s = select_sequences(t, pick);
    ASSERT_EQ(s.n_tokens(), 9);
    EXPECT_EQ(s.sequences[0].name, "s5");
    EXPECT_EQ(s.token_ids[0], t.token_ids[15]);  // sequence 5 starts at 1+2+3+4+5
    EXPECT_EQ(std::memcmp(s.ids(6, 1), t.ids(3, 1), 2), 0);
}

TEST(Trace, PromptFileReadsJsonlAndPlainLines) {
    const fs::path p = tmp_dir() / "prompts.jsonl";
    std::ofstream(p) << "{\"text\": \"first\", \"source\": \"gsm8k\", \"name\": \"q1\"}\n\n"
                        "{\"prompt\": \"second\"}\r\n"
                        "a plain line\n";
    const auto v = read_prompt_file(p.string(), "prompts");
    ASSERT_EQ(v.size(), 3u);
    EXPECT_EQ(v[0].text, "first");
    EXPECT_EQ(v[0].source, "gsm8k");
    EXPECT_EQ(v[0].name, "q1");
    EXPECT_EQ(v[1].text, "second");
    EXPECT_EQ(v[1].source, "prompts");
    EXPECT_EQ(v[1].name, p.string() + ":3");
    EXPECT_EQ(v[2].text, "a plain line");
    std::ofstream(p) << "{\"txt\": \"x\"}\n";
    try {
        read_prompt_file(p.string(), "prompts");
        ADD_FAILURE() << "JSON line without text accepted";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find(p.string() + ":1"), std::string::npos) << e.what();
    }
    std::ofstream(p) << "{broken\n";
    EXPECT_THROW(read_prompt_file(p.string(), "prompts"), Error);
}

// The recorder on a real (tiny) model: the recorded router input of each layer, routed again with that layer's
// router, gives the recorded experts; recording in small chunks gives the same trace as one batch.
TEST(TraceRecorder, RouterInputsReproduceTheRouting) {
    const std::string path = std::string(PRESCOPE_SOURCE_DIR) + "/tests/data/models/qwen3moe/tiny-f32.gguf";
    const auto model = Model::load(path);
    const HParams &hp = model->hp();
    std::vector<int32_t> tokens;
    for (int i = 0; i < 21; ++i) tokens.push_back((i * 37 + 11) % int32_t(hp.n_vocab));

    auto record = [&](int64_t n_batch, int64_t chunk) {
        Context ctx(*model, {64, n_batch});
        TraceRecorder rec(ctx, "tiny", "test", true);
        rec.begin_sequence("a", "test");
        for (size_t i = 0; i < tokens.size(); i += size_t(chunk)) {
            const std::span<const int32_t> c(tokens.data() + i, std::min(tokens.size() - i, size_t(chunk)));
            ctx.eval(c);
            rec.add_tokens(c);
        }
        return std::make_pair(rec.trace(), rec.hidden());
    };
    const auto [t, h] = record(64, 64);
    const auto [t2, h2] = record(4, 5);
    EXPECT_EQ(t.expert_ids, t2.expert_ids);
    EXPECT_EQ(t.gate_q, t2.gate_q);
    ASSERT_EQ(t.n_tokens(), 21);
    ASSERT_EQ(h.n_tokens(), 21);
    EXPECT_EQ(h.token_ranges, (std::vector<std::array<int64_t, 3>>{{0, 0, 21}}));

    std::vector<float> x(size_t(hp.n_embd)), probs(size_t(hp.n_expert));
    int64_t agree = 0, total = 0;
    for (int64_t i = 0; i < t.n_tokens(); ++i) {
        for (int32_t l = 0; l < t.n_layer; ++l) {
            h.dequantize(i, l, x.data());
            Routing r;
            moe_route(hp, model->weights().layers[size_t(l)], x.data(), 1, probs.data(), r);
            for (int32_t j = 0; j < t.top_k; ++j) agree += r.ids[size_t(j)] == t.ids(i, l)[j], ++total;
        }
    }
    // int8 quantisation of the router input may swap near-ties only.
    EXPECT_GE(double(agree) / double(total), 0.97);
}

// deepseek2 (one dense layer, then MoE layers): the recorder keeps model layer il as trace layer il - n_layer_dense,
// exactly the routing and router inputs the context's hooks see there.
TEST(TraceRecorder, RecordsTheMoeLayersOfAModelWithLeadingDenseLayers) {
    const std::string path = std::string(PRESCOPE_SOURCE_DIR) + "/tests/data/models/deepseekv3/tiny-f32.gguf";
    const auto model = Model::load(path);
    const HParams &hp = model->hp();
    ASSERT_GT(hp.n_layer_dense, 0);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 9; ++i) tokens.push_back((i * 37 + 11) % int32_t(hp.n_vocab));

    // What the router chooses at each model layer, seen directly.
    std::vector<std::vector<int32_t>> ids(size_t(hp.n_layer));
    std::vector<std::vector<float>> x(size_t(hp.n_layer));
    {
        Context ctx(*model, {64, 64});
        ctx.on_routing = [&](int64_t l, const Routing &r) { ids[size_t(l)] = r.ids; };
        ctx.on_router_input = [&](int64_t l, const float *h, int64_t n) { x[size_t(l)].assign(h, h + n * hp.n_embd); };
        ctx.eval(tokens);
    }
    Context ctx(*model, {64, 64});
    TraceRecorder rec(ctx, "tiny", "test", true);
    rec.begin_sequence("a", "test");
    ctx.eval(tokens);
    rec.add_tokens(tokens);
    const RoutingTrace &t = rec.trace();
    const HiddenTrace &h = rec.hidden();
    EXPECT_EQ(t.n_layer, hp.n_layer_moe());
    EXPECT_EQ(t.first_moe_layer, hp.n_layer_dense);
    EXPECT_EQ(h.n_layer, t.n_layer);
    ASSERT_EQ(t.n_tokens(), int64_t(tokens.size()));
    std::vector<float> xq(size_t(hp.n_embd));
    for (int64_t i = 0; i < t.n_tokens(); ++i) {
        for (int32_t l = 0; l < t.n_layer; ++l) {
            const size_t il = size_t(l + hp.n_layer_dense);
            for (int32_t j = 0; j < t.top_k; ++j) EXPECT_EQ(t.ids(i, l)[j], ids[il][size_t(i * t.top_k + j)]);
            h.dequantize(i, l, xq.data());
            for (int64_t c = 0; c < hp.n_embd; ++c) {
                EXPECT_NEAR(xq[size_t(c)], x[il][size_t(i * hp.n_embd + c)], h.scale[size_t(i * h.n_layer + l)]);
            }
        }
    }
    const fs::path p = tmp_dir() / "deepseek.pstrace";
    write_trace(p.string(), t);
    EXPECT_EQ(read_trace(p.string()).first_moe_layer, hp.n_layer_dense);
}
