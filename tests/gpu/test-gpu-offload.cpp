// The GPU offloading runtime (runtime/gpu-context.h) on a CUDA device: logits against the HF references of
// the tiny test models, greedy tokens identical to the references and to the CPU engine, and offloading that
// does not change the result (a budget holding every expert against one holding a layer's top-k). Exits 77
// (CTest: skipped) when no CUDA device is usable, so CPU-only machines stay green.
#include "../common/random-trace.h"
#include "../common/reference-files.h"
#include "../common/tiny-model.h"
#include "arch/arch.h"
#include "backend/cuda/cuda-backend.h"
#include "core/error.h"
#include "offload/expert-store.h"
#include "offload/trace.h"
#include "runtime/context.h"
#include "runtime/engine.h"
#include "runtime/gpu-context.h"
#include "runtime/sampler.h"
#include "runtime/tokenizer.h"

#include <unistd.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>

using namespace prescope;
namespace fs = std::filesystem;
using nlohmann::json;
using prescope::test::read_f32;
using prescope::test::read_json;
using prescope::test::reference_files;
using prescope::test::reference_name;

namespace {

/// Bytes of a budget holding `per_layer` slots in every layer.
uint64_t budget_for(const Model &model, int64_t per_layer) {
    uint64_t slot = 0;
    const int64_t first = model.hp().n_layer_dense;  // dense layers have no experts
    for (int64_t l = first; l < model.hp().n_layer; ++l) slot = std::max(slot, ExpertLayout::of(model, l).bytes);
    slot = (slot + 255) / 256 * 256;
    return slot * uint64_t(per_layer) * uint64_t(model.hp().n_layer - first);
}

OffloadConfig offload(const Model &model, int64_t slots_per_layer, int32_t cpu_threshold = 0,
                      const std::string &predictor = "fate") {
    OffloadConfig c;
    c.gpu = true;
    c.gpu_cache_bytes = budget_for(model, slots_per_layer);
    c.cpu_threshold = cpu_threshold;
    c.predictor = predictor;
    c.prefetch_window = predictor == "none" ? 0 : 2;
    c.copy.chunk_bytes = 64 << 10;  // several chunks per expert of the test models
    return c;
}

struct Greedy {
    std::vector<int32_t> tokens;
    std::vector<float> logits;  // every step's logits, concatenated
};

Greedy greedy(Engine &e, const std::vector<int32_t> &prompt, size_t n, int64_t n_vocab) {
    Greedy g;
    e.eval(prompt);
    for (size_t i = 0; i < n; ++i) {
        g.logits.insert(g.logits.end(), e.logits().begin(), e.logits().end());
        const int32_t next = argmax(e.logits().data(), n_vocab);
        g.tokens.push_back(next);
        e.eval({&next, 1});
    }
    return g;
}

double max_abs_diff(const std::vector<float> &a, const std::vector<float> &b) {
    EXPECT_EQ(a.size(), b.size());
    double m = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
        m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
    }
    return m;
}

/// The HF references multiply F32 activations: these tests run with ActivationQuant::NONE on both engines
/// (decision 0060); the demo and mixed-type tests run with the default, INT8.
class GpuReference : public ::testing::TestWithParam<fs::path> {
  protected:
    void SetUp() override { set_activation_quant(ActivationQuant::NONE); }
    void TearDown() override { set_activation_quant(ActivationQuant::INT8); }
};


} // namespace

// Against HF transformers on the same weights (tests/data/models, docs/references.md), with the reference's
// tolerance (1e-4 x the largest |logit|): batches of 7 tokens keep every product on the F32 GEMV kernels.
TEST_P(GpuReference, LogitsAtEveryPositionWithinTheReferenceTolerance) {
    const json ref = read_json(GetParam());
    const auto model = Model::load((GetParam().parent_path() / ref["model"].get<std::string>()).string());
    const auto ids = ref["sequence_ids"].get<std::vector<int32_t>>();
    const std::vector<float> expected = read_f32(GetParam().parent_path() / ref["logits_file"].get<std::string>());
    const auto rows = ref["logits_shape"][0].get<size_t>();
    const double tol = ref["tolerance"]["max_abs_logit_error"].get<double>();
    for (int64_t slots : {model->hp().n_expert, model->hp().n_expert_used}) {
        GpuContext gpu(*model, {int64_t(ids.size()) + 1, 7}, offload(*model, slots));
        gpu.eval({ids.data(), rows}, /*all_logits=*/true);
        const double err = max_abs_diff(gpu.logits(), expected);
        EXPECT_LE(err, tol) << GetParam() << " with " << slots << " slots per layer";
        RecordProperty("max_abs_logit_error_slots_" + std::to_string(slots), std::to_string(err));
    }
}

TEST_P(GpuReference, GreedyTokensIdenticalToTheReferenceAtEveryBudget) {
    const json ref = read_json(GetParam());
    const auto model = Model::load((GetParam().parent_path() / ref["model"].get<std::string>()).string());
    const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
    const auto expected = ref["greedy"].get<std::vector<int32_t>>();
    const int64_t n_ctx = int64_t(prompt.size() + expected.size()) + 1;
    const int64_t n_vocab = model->hp().n_vocab, k = model->hp().n_expert_used;
    GpuContext all(*model, {n_ctx, 512}, offload(*model, model->hp().n_expert));
    const Greedy a = greedy(all, prompt, expected.size(), n_vocab);
    EXPECT_EQ(a.tokens, expected) << GetParam();
    // A layer's top-k only: misses fetched on demand (threshold 0), run on the CPU (threshold 2), or as the
    // cost-model scheduler splits them (-1: split FETCH waves, installs, planned prefetches).
    for (int32_t threshold : {0, 2, -1}) {
        GpuContext few(*model, {n_ctx, 512}, offload(*model, k, threshold));
        const Greedy b = greedy(few, prompt, expected.size(), n_vocab);
        EXPECT_EQ(b.tokens, expected) << GetParam() << " cpu_threshold " << threshold;
        EXPECT_LE(max_abs_diff(a.logits, b.logits), ref["tolerance"]["max_abs_logit_error"].get<double>())
            << "offloading changed the logits beyond the reference tolerance, cpu_threshold " << threshold;
        const LayerStats s = few.cache().total_stats();
        EXPECT_GT(s.demand_misses + s.cpu_runs, 0u);
        if (threshold >= 0) {
            EXPECT_GT(few.copy_engine().stats().bytes_done, 0u);
        }
        EXPECT_EQ(s.steps, uint64_t(model->hp().n_layer - model->hp().n_layer_dense) * (1 + expected.size()));
    }
    // Every expert on the CPU beside GPU attention.
    GpuContext none(*model, {n_ctx, 512}, offload(*model, 0, 0, "none"));
    EXPECT_EQ(greedy(none, prompt, expected.size(), n_vocab).tokens, expected) << "budget 0";
    EXPECT_EQ(none.cache().total_stats().cpu_runs, none.cache().total_stats().accesses());
}

INSTANTIATE_TEST_SUITE_P(Models, GpuReference, ::testing::ValuesIn(reference_files()), reference_name);

// With every miss fetched (cpu_threshold 0), decode steps run the same kernels on the same bytes whatever
// the budget: the offloaded run equals the resident run exactly (docs/style R7's key invariant).
TEST(GpuOffload, DecodeWithFewSlotsEqualsAllResidentBitForBit) {
    const auto model =
        Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models/qwen3moe/tiny-q8_0.gguf").string());
    const std::vector<int32_t> prompt{11};
    GpuContext all(*model, {64, 1}, offload(*model, model->hp().n_expert));
    GpuContext few(*model, {64, 1}, offload(*model, model->hp().n_expert_used, 0, "frequency"));
    const Greedy a = greedy(all, prompt, 40, model->hp().n_vocab);
    const Greedy b = greedy(few, prompt, 40, model->hp().n_vocab);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(max_abs_diff(a.logits, b.logits), 0.0);
    const LayerStats s = few.cache().total_stats();
    EXPECT_EQ(s.cpu_runs, 0u);
    EXPECT_GT(s.hits, 0u);
    EXPECT_GT(s.demand_misses, 0u);
    EXPECT_GT(s.prefetch_loads, 0u);
}

// Issue 14: with device_hits the GPU runs the routed experts its slot table holds before the host reads the
// routing, and the host only the rest; the logits stay those of the host-driven path bit for bit, at a budget
// holding every expert, at one holding a layer's top-k (entries set and cleared as experts come and go), and
// with routing replayed from a trace (the device resolves the trace's experts, not its router's).
TEST(GpuOffload, DeviceResolvedHitsChangeNoLogit) {
    const auto model =
        Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models/qwen3moe/tiny-q8_0.gguf").string());
    const HParams &hp = model->hp();
    RoutingTrace t = test::random_trace(int32_t(hp.n_layer), int32_t(hp.n_expert), int32_t(hp.n_expert_used), {64},
                                        5, [&hp](int32_t) { return 1.0f / float(hp.n_expert_used); });
    t.arch = hp.arch;
    const fs::path trace = fs::temp_directory_path() / ("prescope-test-devhits-" + std::to_string(getpid()) + ".pstrace");
    write_trace(trace.string(), t);
    // Every expert's home a fixed GPU slot: every layer holds all its experts from the start.
    const fs::path fixed = fs::temp_directory_path() / ("prescope-test-fixed-" + std::to_string(getpid()) + ".json");
    PlacementPlan::uniform(int32_t(hp.n_layer), int32_t(hp.n_expert), {HomeTier::GPU, ExecSite::GPU})
        .save(fixed.string());
    const std::vector<int32_t> prompt{11, 12, 13};
    for (int64_t slots : {int64_t(0), hp.n_expert, hp.n_expert_used}) {
        for (bool replay : {false, true}) {
            SCOPED_TRACE(testing::Message() << slots << " slots per layer (0: fixed homes), replay " << replay);
            OffloadConfig c = offload(*model, slots > 0 ? slots : hp.n_expert, 0, "frequency");
            if (slots == 0) c.placement = fixed.string();
            if (replay) c.routing_trace = trace.string();
            c.device_hits = false;
            GpuContext host(*model, {64, 4}, c);
            c.device_hits = true;
            GpuContext dev(*model, {64, 4}, c);
            const Greedy a = greedy(host, prompt, 24, hp.n_vocab);
            const Greedy b = greedy(dev, prompt, 24, hp.n_vocab);
            EXPECT_EQ(a.tokens, b.tokens);
            EXPECT_EQ(max_abs_diff(a.logits, b.logits), 0.0);
            EXPECT_EQ(host.cache().total_stats().device_hits, 0u);
            const LayerStats s = dev.cache().total_stats();
            EXPECT_GT(s.device_hits, 0u);
            if (slots == hp.n_expert) EXPECT_GT(s.device_hits, s.hits / 2) << s.device_hits << " of " << s.hits;
            // Whole device steps (decision 0138) once a layer holds every expert: each step with fixed homes
            // (every pass fits the device path); never with top-k slots.
            if (slots == 0) EXPECT_EQ(s.device_layers, s.steps);
            if (slots == hp.n_expert_used) EXPECT_EQ(s.device_layers, 0u);
            EXPECT_EQ(host.cache().total_stats().device_layers, 0u);
        }
    }
    fs::remove(trace);
    fs::remove(fixed);
}

// Decision 0142: with every expert's home on the GPU a decode pass is captured once as a CUDA graph and replayed.
// The logits and the routing the host accounts afterwards equal those of direct launches bit for bit, across the
// attention's split count changing with the position (read on the device), a cleared context and a second
// sequence; no graph where a layer cannot run whole (gated shared expert) or for MLA.
TEST(GpuOffload, DecodeGraphEqualsDirectLaunches) {
    if (!cuda::StreamGraph::available()) GTEST_SKIP() << "the CUDA runtime captures no graphs (the CPU emulation)";
    for (const char *name : {"qwen3moe/tiny-q8_0", "mixtral/tiny-q8_0", "olmoe/tiny-q8_0", "gptoss/tiny-mxfp4",
                             "qwen2moe/tiny-q8_0", "deepseekv3/tiny-q8_0"}) {
        SCOPED_TRACE(name);
        const auto model = Model::load(
            (fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models" / (std::string(name) + ".gguf")).string());
        const HParams &hp = model->hp();
        const fs::path fixed =
            fs::temp_directory_path() / ("prescope-test-graph-" + std::to_string(getpid()) + ".json");
        PlacementPlan::uniform(int32_t(hp.n_layer), int32_t(hp.n_expert), {HomeTier::GPU, ExecSite::GPU})
            .save(fixed.string());
        struct Run {
            Greedy first, again;
            std::vector<float> seq1;                // the second sequence's decode logits
            std::vector<std::vector<int32_t>> ids;  // every layer's routed experts, in the order the host saw them
            json stats;
        };
        const std::vector<int32_t> prompt{11, 12, 13};
        auto run = [&](bool graphs) {
            OffloadConfig c = offload(*model, hp.n_expert, 0, "frequency");
            c.placement = fixed.string();
            c.cuda_graphs = graphs;
            GpuContext e(*model, {160, 8, 2}, c);
            Run r;
            e.on_routing = [&r](int64_t, const Routing &x) { r.ids.push_back(x.ids); };
            r.first = greedy(e, prompt, 100, hp.n_vocab);  // positions up to 103: the split count changes
            e.clear();
            r.again = greedy(e, prompt, 6, hp.n_vocab);
            const SeqTokens pre[1] = {{1, prompt}};
            e.eval_batch(pre);
            for (int i = 0; i < 6; ++i) {
                const int32_t next = argmax(e.logits().data(), hp.n_vocab);
                const SeqTokens step[1] = {{1, {&next, 1}}};
                e.eval_batch(step);
                r.seq1.insert(r.seq1.end(), e.logits().begin(), e.logits().end());
            }
            r.stats = e.stats_json();
            const LayerStats s = e.cache().total_stats();
            EXPECT_EQ(s.device_layers, s.steps - (hp.shared_expert_gate ? s.steps : 0));
            return r;
        };
        const Run direct = run(false), graph = run(true);
        EXPECT_EQ(direct.first.tokens, graph.first.tokens);
        EXPECT_EQ(max_abs_diff(direct.first.logits, graph.first.logits), 0.0);
        EXPECT_EQ(max_abs_diff(direct.again.logits, graph.again.logits), 0.0);
        EXPECT_EQ(max_abs_diff(direct.seq1, graph.seq1), 0.0);
        EXPECT_EQ(direct.ids, graph.ids);
        EXPECT_EQ(direct.stats["graph_replays"].get<int64_t>(), 0);
        EXPECT_EQ(direct.stats["graph_captures"].get<int64_t>(), 0);
        if (hp.mla || hp.shared_expert_gate) {
            EXPECT_EQ(graph.stats["graph_replays"].get<int64_t>(), 0);
        } else {
            // Captured for the first sequence, again after clear(), again for sequence 1; replayed otherwise, but
            // for a first decode pass that may come before the slot table is complete (the prompt's pass fills it
            // when it fits the device path).
            const int64_t decode = 100 + 6 + 6, replays = graph.stats["graph_replays"].get<int64_t>();
            EXPECT_EQ(graph.stats["graph_captures"].get<int64_t>(), 3);
            EXPECT_GE(replays, decode - 3 - 1);
            EXPECT_LE(replays, decode - 3);
        }
        fs::remove(fixed);
    }
}

// A prefill batch of 64 tokens routes more experts than top-k slots per layer hold: they stream through the
// slots in waves (docs/decisions/0036), on the same kernels and bytes as when every expert is resident.
TEST(GpuOffload, PrefillStreamedThroughFewSlotsEqualsAllResidentBitForBit) {
    const auto model =
        Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models/qwen3moe/tiny-q8_0.gguf").string());
    std::vector<int32_t> prompt;
    for (int i = 0; i < 64; ++i) prompt.push_back(int32_t((i * 37 + 11) % model->hp().n_vocab));
    GpuContext all(*model, {128, 64}, offload(*model, model->hp().n_expert));
    GpuContext few(*model, {128, 64}, offload(*model, model->hp().n_expert_used, 0, "frequency"));
    const Greedy a = greedy(all, prompt, 8, model->hp().n_vocab);
    const Greedy b = greedy(few, prompt, 8, model->hp().n_vocab);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(max_abs_diff(a.logits, b.logits), 0.0);
    EXPECT_EQ(few.cache().total_stats().cpu_runs, 0u);
    EXPECT_GT(few.stats_json()["streamed_experts"].get<uint64_t>(), 0u);
    EXPECT_EQ(all.stats_json()["streamed_experts"].get<uint64_t>(), 0u);
}

// The bundled demo model (models/demo, when present): CPU and GPU engines give the same greedy tokens, and
// so do a full and a small expert budget.
TEST(GpuOffload, DemoModelCpuAndGpuAgree) {
    const fs::path dir = fs::path(PRESCOPE_SOURCE_DIR) / "models/demo";
    std::vector<fs::path> files;
    if (fs::exists(dir)) {
        for (const auto &e : fs::directory_iterator(dir)) {
            if (e.path().extension() == ".gguf") files.push_back(e.path());
        }
    }
    if (files.empty()) GTEST_SKIP() << "no models/demo/*.gguf";
    for (const fs::path &f : files) {
        const auto model = Model::load(f.string());
        const int64_t n_vocab = model->hp().n_vocab;
        std::vector<int32_t> prompt;
        for (int i = 0; i < 40; ++i) prompt.push_back(int32_t((i * 131 + 7) % n_vocab));  // >= 32: streams
        Context cpu(*model, {128, 512});
        std::vector<int32_t> want;
        cpu.eval(prompt);
        for (int i = 0; i < 32; ++i) {
            const int32_t next = argmax(cpu.logits().data(), n_vocab);
            want.push_back(next);
            cpu.eval({&next, 1});
        }
        GpuContext all(*model, {128, 512}, offload(*model, model->hp().n_expert));
        EXPECT_EQ(greedy(all, prompt, 32, n_vocab).tokens, want) << f;
        GpuContext few(*model, {128, 512}, offload(*model, model->hp().n_expert_used + 1, 2));
        EXPECT_EQ(greedy(few, prompt, 32, n_vocab).tokens, want) << f << " with few slots";
        std::fprintf(stderr, "%s, %lld slots per layer:\n%s", f.filename().c_str(),
                     (long long)(model->hp().n_expert_used + 1), few.stats_text().c_str());
    }
}

namespace {

/// Steps of a greedy run whose top-1 logit leads the runner-up by at least `margin`, counted from the first
/// step up to the first that does not (a near-tie there may fall either way on another summation order).
size_t clear_steps(const Greedy &g, int64_t n_vocab, float margin) {
    size_t i = 0;
    for (; i < g.tokens.size(); ++i) {
        const float *l = g.logits.data() + i * size_t(n_vocab);
        float best = -INFINITY, second = -INFINITY;
        for (int64_t v = 0; v < n_vocab; ++v) {
            if (l[v] > best) {
                second = best;
                best = l[v];
            } else if (l[v] > second) {
                second = l[v];
            }
        }
        if (best - second < margin) break;
    }
    return i;
}

} // namespace

// Several sequences in one GpuContext (the server's slots): prefills and decodes of three prompts mixed in
// passes (a prefill split across two passes by -b 40) give each sequence the greedy tokens of the CPU engine
// running it alone, at a full budget and at one where misses are fetched or run on the CPU (the plan sees
// the whole pass). Compared up to the CPU run's first step with a top-1 margin under 0.05: a pass of more
// than 32 tokens takes the cuBLAS path with BF16 activations (decision 0040), which may flip a near-tie.
TEST(GpuOffload, SeveralSequencesEachEqualTheCpuAlone) {
    const fs::path f = fs::path(PRESCOPE_SOURCE_DIR) / "models/demo/demo-q8_0.gguf";
    if (!fs::exists(f)) GTEST_SKIP() << "no " << f;
    const auto model = Model::load(f.string());
    const int64_t n_vocab = model->hp().n_vocab;
    const Tokenizer tok = Tokenizer::from_gguf(model->file());
    const std::vector<std::vector<int32_t>> prompts = {
        tok.encode("The Debian project is", true, false),
        tok.encode("Linux is a family of open-source Unix-like operating systems based on the Linux kernel, an "
                   "operating system kernel", true, false),
        tok.encode("The history of the city begins in the Roman period, when a small settlement grew up on the "
                   "banks of the river. In the Middle Ages the town became an important market", true, false)};
    ASSERT_GT(prompts[2].size() + 2, 40u);  // the second pass is split, its first part over 32 tokens
    const size_t n_gen = 16;
    const float kMargin = 0.05f;
    std::vector<Greedy> want;
    for (const auto &p : prompts) {
        CpuEngine cpu(*model, {128, 512}, OffloadConfig{});
        want.push_back(greedy(cpu, p, n_gen, n_vocab));
    }
    for (int64_t slots : {model->hp().n_expert, model->hp().n_expert_used + 1}) {
        GpuContext gpu(*model, {128, 40, 3}, offload(*model, slots, slots == model->hp().n_expert ? 0 : 2));
        ASSERT_EQ(gpu.n_seq(), 3);
        std::vector<std::vector<int32_t>> got(3);
        auto take = [&](std::span<const int32_t> seqs) {  // one logits row per listed sequence, in order
            for (size_t i = 0; i < seqs.size(); ++i) {
                got[size_t(seqs[i])].push_back(argmax(gpu.logits().data() + int64_t(i) * n_vocab, n_vocab));
            }
        };
        // Pass 1: sequences 0 and 1 prefill. Pass 2: sequence 2 prefills while 0 and 1 decode (more than -b 40
        // tokens: split). Then all three decode together; a sequence that has its n_gen tokens leaves.
        const SeqTokens first[2] = {{0, prompts[0]}, {1, prompts[1]}};
        gpu.eval_batch(first);
        const int32_t s01[2] = {0, 1};
        take(s01);
        const int32_t t0 = got[0].back(), t1 = got[1].back();
        const SeqTokens second[3] = {{2, prompts[2]}, {0, {&t0, 1}}, {1, {&t1, 1}}};
        gpu.eval_batch(second);
        const int32_t s201[3] = {2, 0, 1};
        take(s201);
        while (true) {
            std::vector<SeqTokens> step;
            std::vector<int32_t> seqs;
            for (int32_t s = 0; s < 3; ++s) {
                if (got[size_t(s)].size() < n_gen) {
                    step.push_back({s, {&got[size_t(s)].back(), 1}});
                    seqs.push_back(s);
                }
            }
            if (step.empty()) break;
            gpu.eval_batch(step);
            take(seqs);
        }
        size_t compared = 0;
        for (size_t s = 0; s < 3; ++s) {
            const size_t n_cmp = clear_steps(want[s], n_vocab, kMargin);
            compared += n_cmp;
            EXPECT_GE(n_cmp, 1u) << "sequence " << s << ": the CPU run's first step is a near-tie";
            EXPECT_EQ(std::vector<int32_t>(got[s].begin(), got[s].begin() + ptrdiff_t(n_cmp)),
                      std::vector<int32_t>(want[s].tokens.begin(), want[s].tokens.begin() + ptrdiff_t(n_cmp)))
                << "sequence " << s << ", " << slots << " slots, first " << n_cmp << " steps";
            std::fprintf(stderr, "sequence %zu, %lld slots: %zu of %zu steps above the margin, all equal: %s\n", s,
                         (long long)slots, n_cmp, n_gen, got[s] == want[s].tokens ? "yes" : "no");
        }
        // The CPU runs' margins (11, 16 and 2 of 16 steps on the demo model): most steps are compared.
        EXPECT_GE(compared, 3 * n_gen / 2);
        EXPECT_EQ(gpu.n_past(2), int64_t(prompts[2].size() + n_gen - 1));
        gpu.clear(1);
        EXPECT_EQ(gpu.n_past(1), 0);
        EXPECT_EQ(gpu.n_past(0), int64_t(prompts[0].size() + n_gen - 1));
        const SeqTokens bad[1] = {{3, prompts[0]}};
        EXPECT_THROW(gpu.eval_batch(bad), Error);
    }
}

// DeepSeek's MLA with several sequences in one pass: the new latent rows go through the scatter into each
// sequence's cache and attention runs per sequence; each sequence's logits match the CPU engine running it alone
// (tiny DeepSeek-V3: dense first layer, sigmoid group routing, shared expert) at a budget holding a layer's top-k.
TEST(GpuOffload, MlaSeveralSequencesEachEqualTheCpuAlone) {
    const auto model =
        Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models/deepseekv3/tiny-f32.gguf").string());
    const int64_t n_vocab = model->hp().n_vocab;
    const std::vector<std::vector<int32_t>> prompts = {{5, 6, 7, 8, 9}, {40, 41, 42}};
    const std::vector<std::vector<int32_t>> steps = {{11, 12, 13, 14}, {21, 22, 23, 24}};  // fixed decode inputs
    std::vector<std::vector<float>> want(2);
    for (size_t q = 0; q < 2; ++q) {
        CpuEngine cpu(*model, {64, 16}, OffloadConfig{});
        cpu.eval(prompts[q]);
        want[q] = cpu.logits();
        for (int32_t t : steps[q]) {
            cpu.eval({&t, 1});
            want[q].insert(want[q].end(), cpu.logits().begin(), cpu.logits().end());
        }
    }
    GpuContext gpu(*model, {64, 16, 2}, offload(*model, model->hp().n_expert_used, 0));
    std::vector<std::vector<float>> got(2);
    auto take = [&] {
        for (size_t q = 0; q < 2; ++q) {
            got[q].insert(got[q].end(), gpu.logits().begin() + int64_t(q) * n_vocab,
                          gpu.logits().begin() + int64_t(q + 1) * n_vocab);
        }
    };
    gpu.eval_batch(std::vector<SeqTokens>{{0, prompts[0], true}, {1, prompts[1], true}});
    take();
    for (size_t i = 0; i < steps[0].size(); ++i) {
        gpu.eval_batch(std::vector<SeqTokens>{{0, {&steps[0][i], 1}, true}, {1, {&steps[1][i], 1}, true}});
        take();
    }
    for (size_t q = 0; q < 2; ++q) {
        float top = 0.0f;
        for (float v : want[q]) top = std::max(top, std::fabs(v));
        EXPECT_LE(max_abs_diff(got[q], want[q]), 1e-4 * top) << "sequence " << q;
    }
    EXPECT_GT(gpu.cache().total_stats().demand_misses, 0u);
}

// A file whose tensors mix every weight type (tests/common/tiny-model.h), experts of two sizes: the GPU at a
// full and a small budget (misses fetched or run on the CPU) against the CPU engine. With F32 activations
// both multiply the same dequantized weights (1e-4 of the largest logit); with INT8 activations both
// quantize them by the same rule, so greedy decoding agrees too.
TEST(GpuOffload, MixedTypeFileCpuAndGpuAgree) {
    const std::string path = (fs::temp_directory_path() / ("prescope-gpu-mixed-" + std::to_string(getpid()) + ".gguf"))
                                 .string();
    test::write_tiny_model(path, test::mixed_type_spec(false));
    const auto model = Model::load(path);
    const int64_t n_vocab = model->hp().n_vocab;
    std::vector<int32_t> prompt;
    for (int i = 0; i < 12; ++i) prompt.push_back(int32_t((i * 7 + 3) % n_vocab));
    for (const ActivationQuant act : {ActivationQuant::NONE, ActivationQuant::INT8}) {
        SCOPED_TRACE(act == ActivationQuant::NONE ? "f32 activations" : "int8 activations");
        set_activation_quant(act);
        CpuEngine cpu(*model, {64, 7}, OffloadConfig{});
        const Greedy want = greedy(cpu, prompt, 8, n_vocab);
        double scale = 0.0;
        for (float v : want.logits) scale = std::max(scale, double(std::fabs(v)));
        for (const OffloadConfig &c : {offload(*model, model->hp().n_expert), offload(*model, 2, 0),
                                       offload(*model, 2, 1, "none")}) {
            GpuContext gpu(*model, {64, 7}, c);
            const Greedy got = greedy(gpu, prompt, 8, n_vocab);
            EXPECT_EQ(got.tokens, want.tokens);
            if (act == ActivationQuant::NONE) {
                EXPECT_LE(max_abs_diff(got.logits, want.logits), 1e-4 * scale);
            }
        }
    }
    set_activation_quant(ActivationQuant::INT8);
    fs::remove(path);
}

// --routing-trace: each layer's experts come from the trace, on the GPU as on the CPU.
TEST(GpuOffload, ReplayedRoutingIsWhatTheLayersRun) {
    const auto model =
        Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models/mixtral/tiny-f32.gguf").string());
    const HParams &hp = model->hp();
    const int n_tok = 9;
    RoutingTrace t = test::random_trace(int32_t(hp.n_layer), int32_t(hp.n_expert), int32_t(hp.n_expert_used), {n_tok},
                                        3, [&hp](int32_t) { return 1.0f / float(hp.n_expert_used); });
    t.arch = hp.arch;
    const fs::path path = fs::temp_directory_path() / ("prescope-test-replay-" + std::to_string(getpid()) + ".pstrace");
    write_trace(path.string(), t);

    OffloadConfig c = offload(*model, hp.n_expert_used);
    c.routing_trace = path.string();
    GpuContext gpu(*model, {32, 4}, c);
    std::vector<int32_t> seen;
    gpu.on_routing = [&](int64_t, const Routing &r) { seen.insert(seen.end(), r.ids.begin(), r.ids.end()); };
    std::vector<int32_t> prompt{1, 2, 3, 4, 5};
    gpu.eval(prompt);
    for (int32_t tok : {6, 7, 8, 9}) gpu.eval({&tok, 1});
    // Layer-major per batch: batch [0,4) then [4,5), then single tokens.
    std::vector<int32_t> want;
    auto add_batch = [&](int first, int n) {
        for (int64_t l = 0; l < hp.n_layer; ++l) {
            for (int i = first; i < first + n; ++i) {
                const uint8_t *ids = t.ids(i, int32_t(l));
                want.insert(want.end(), ids, ids + hp.n_expert_used);
            }
        }
    };
    add_batch(0, 4);
    add_batch(4, 1);
    for (int i = 5; i < 9; ++i) add_batch(i, 1);
    EXPECT_EQ(seen, want);
    EXPECT_EQ(gpu.stats_json()["routing"], "replayed:" + path.filename().string());

    // The CPU engine replays the same routing: the same logits within the reference tolerance.
    CpuEngine cpu(*model, {32, 4}, c);
    cpu.eval(prompt);
    GpuContext gpu2(*model, {32, 4}, c);
    gpu2.eval(prompt);
    EXPECT_LE(max_abs_diff(cpu.logits(), gpu2.logits()), 1e-3);
    fs::remove(path);
}

TEST(GpuOffload, BadStatesAreClearErrors) {
    const auto model =
        Model::load((fs::path(PRESCOPE_SOURCE_DIR) / "tests/data/models/qwen3moe/tiny-f32.gguf").string());
    OffloadConfig c = offload(*model, model->hp().n_expert_used);
    c.gpu_cache_bytes -= 1;  // one byte short of a layer's top-k in every layer
    try {
        GpuContext gpu(*model, {32, 4}, c);
        FAIL() << "no error";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("at least"), std::string::npos) << e.what();
    }
    // A budget beyond every expert is an upper bound, as llama.cpp's -ngl 999 is: the pool holds every expert
    // of every layer and no more (the cache caps slots at n_experts), so it fits and is no error.
    c.gpu_cache_bytes = uint64_t(1) << 50;  // 1 PiB
    GpuContext gpu(*model, {32, 4}, c);
    const nlohmann::json cache = gpu.stats_json()["cache"];
    uint64_t all_experts = 0;
    for (int64_t l = 0; l < model->hp().n_layer; ++l) {
        all_experts += uint64_t(model->hp().n_expert) * ExpertLayout::of(*model, int32_t(l)).bytes;
    }
    EXPECT_GE(cache["pool_bytes"].get<uint64_t>(), all_experts);
    EXPECT_LT(cache["pool_bytes"].get<uint64_t>(), uint64_t(1) << 40);
    // --deterministic is the CPU's (decision 0130); a KV cache past int32 rows is refused before allocating.
    for (const ContextParams p : {ContextParams{32, 4, 1, true}, ContextParams{int64_t(1) << 30, 4, 4, false}}) {
        try {
            GpuContext refused(*model, p, c);
            FAIL() << "no error for n_seq " << p.n_seq;
        } catch (const Error &e) {
            EXPECT_NE(std::string(e.what()).find(p.deterministic ? "--deterministic" : "n_seq"), std::string::npos)
                << e.what();
        }
    }
}

int main(int argc, char **argv) {
    std::string why;
    if (cuda_device_count(&why) == 0) {
        std::printf("no CUDA device (%s): GPU tests skipped\n", why.c_str());
        return 77;
    }
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
