// prescope train-predictor / eval-predictor: LLaPor training on a routing trace, and the evaluation of any
// predictor (none, frequency, recency, fate, oracle, a LLaPor file) on held-out sequences (docs/predictors.md).
#include "cli.h"

#include "arch/arch.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/log.h"
#include "core/output-file.h"
#include "offload/predictor-baselines.h"
#include "offload/predictor-eval.h"
#include "offload/predictor-llapor.h"
#include "offload/predictor-train.h"
#include "offload/trace.h"

#include <cstdio>
#include <filesystem>
#include <limits>

extern "C" void openblas_set_num_threads(int num_threads);

namespace prescope::cli {

namespace {

struct SplitArgs {
    std::string trace, hidden;
    std::string split;
    int64_t holdout_every = 5;
};

void add_split_flags(CLI::App &cmd, SplitArgs &s, const char *default_split) {
    s.split = default_split;
    cmd.add_option("--trace", s.trace, "routing trace (.pstrace)")->required()->check(CLI::ExistingFile);
    cmd.add_option("--hidden", s.hidden, "its hidden-state sidecar (.hidden.zst)")->check(CLI::ExistingFile);
    cmd.add_option("--split", s.split, "sequences to use: train, test (held out) or all")->capture_default_str();
    cmd.add_option("--holdout-every", s.holdout_every, "sequence i is held out when i % N == N - 1")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(2), std::numeric_limits<int64_t>::max()));
}

struct Loaded {
    RoutingTrace full, part;
    std::unique_ptr<HiddenTrace> hidden;  // rows of `part`
};

Loaded load_split(const SplitArgs &s) {
    Loaded d;
    d.full = read_trace(s.trace);
    const std::vector<int64_t> seqs = split_sequences(d.full, s.split, s.holdout_every);
    if (seqs.empty()) fail("{}: the {} split holds no sequences (holdout-every {})", s.trace, s.split, s.holdout_every);
    d.part = select_sequences(d.full, seqs);
    if (!s.hidden.empty()) {
        const HiddenTrace h = read_hidden(s.hidden, &d.full, s.trace);
        d.hidden = std::make_unique<HiddenTrace>(select_hidden(h, seqs));
    }
    spdlog::info("{}: {} split, {} sequences, {} tokens", s.trace, s.split, d.part.sequences.size(), d.part.n_tokens());
    return d;
}

// The predictor column of eval-predictor's results: the kind, then what sets this file apart from the default.
std::string predictor_label(const LlaporConfig &cfg) {
    std::string s = cfg.kind;
    if (cfg.has_prior()) {
        s += cfg.drift == "previous" ? "" : "-drift-" + cfg.drift;
        s += cfg.correction ? "" : "-alone";
    }
    return s + (cfg.n_groups() == 1 ? "-1group" : "");
}

} // namespace

void register_train_predictor(CLI::App &app) {
    struct Args {
        SplitArgs split;
        TrainOptions opt;
        std::string out, model, routers, correction = "mlp";
        int threads = 0;
        int verbosity = 0;
    };
    auto a = std::make_shared<Args>();
    auto *cmd = app.add_subcommand("train-predictor", "train a LLaPor expert predictor on a routing trace");
    add_split_flags(*cmd, a->split, "train");
    TrainOptions &o = a->opt;
    cmd->add_option("--kind", o.kind,
                    "llapor-lstm (gating history), llapor-mlp (hidden states) or llapor-mlp-prior (hidden states "
                    "with the later layers' routers as a prior)")
        ->required()->check(CLI::IsMember({"llapor-lstm", "llapor-mlp", "llapor-mlp-prior"}));
    cmd->add_option("-m,--model", a->model, "llapor-mlp-prior: model GGUF to read the routers from")
        ->check(CLI::ExistingFile);
    cmd->add_option("--routers", a->routers, "llapor-mlp-prior: HF safetensors with layers.N.mlp.gate.weight")
        ->check(CLI::ExistingFile);
    cmd->add_option("--drift", o.drift, "llapor-mlp-prior: router-input drift map: none (Fate), current, previous")
        ->check(CLI::IsMember({"none", "current", "previous"}))->capture_default_str();
    cmd->add_option("--correction", a->correction, "llapor-mlp-prior: mlp (train a correction) or none")
        ->check(CLI::IsMember({"mlp", "none"}))->capture_default_str();
    cmd->add_option("--ridge", o.ridge, "llapor-mlp-prior: ridge penalty of the drift fit")
        ->capture_default_str()
        ->check(finite_range(0, 1e12));
    cmd->add_option("--loss", o.loss, "khot or negatives (default: negatives for llapor-mlp-prior, else khot)")
        ->check(CLI::IsMember({"khot", "negatives"}));
    cmd->add_option("--val-every", o.val_every, "every N-th training sequence is kept aside for model selection")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(2), std::numeric_limits<int64_t>::max()));
    cmd->add_option("--out", a->out, "predictor file to write")->required();
    cmd->add_option("--window", o.window, "predict layers l+1 .. l+window")->capture_default_str()->check(CLI::Range(1, 64));
    cmd->add_option("--groups", o.groups, "auto (measured), 1 (one predictor for all layers), or A,B")
        ->capture_default_str();
    cmd->add_option("--width", o.hidden, "LSTM state / MLP width (0: 64 / 128)")
        ->capture_default_str()
        ->check(CLI::Range(0, 1 << 16));
    cmd->add_option("--pca-dim", o.pca_dim, "MLP: principal components per layer")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 16));
    cmd->add_option("--epochs", o.epochs, "passes over the training tokens (llapor-mlp-prior: may be 0)")
        ->capture_default_str()
        ->check(CLI::Range(0, 1 << 20));
    cmd->add_option("--batch", o.batch, "tokens (LSTM) or rows (MLP) per step")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 24));
    cmd->add_option("--lr", o.lr, "Adam learning rate")
        ->capture_default_str()
        ->check(finite_range(0, std::numeric_limits<float>::max()));
    cmd->add_option("--weight-decay", o.weight_decay, "AdamW weight decay")
        ->capture_default_str()
        ->check(finite_range(0, 1e3));
    cmd->add_option("--dropout", o.dropout, "MLP dropout probability, in [0, 1)")
        ->capture_default_str()
        ->check(finite_range(0, 1, /*hi_open=*/true));
    cmd->add_option("--max-tokens", o.max_tokens, "train on at most this many tokens (0: all)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()));
    cmd->add_option("--seed", o.seed, "initialisation and shuffling seed")->capture_default_str();
    cmd->add_option("-t,--threads", a->threads, "CPU threads for BLAS (default: physical cores)")->check(CLI::Range(1, 1024));
    cmd->add_flag("-v,--verbose", a->verbosity, "more logging");
    cmd->callback([a]() {
        log_init(std::max(a->verbosity, 1));
        cpu::set_threads(a->threads);
        openblas_set_num_threads(cpu::get_threads());  // training is all BLAS: let OpenBLAS use every thread
        Loaded d = load_split(a->split);
        std::vector<std::vector<float>> routers;
        if (a->opt.kind == "llapor-mlp-prior") {
            if (!d.hidden) fail("--kind llapor-mlp-prior trains on hidden states: pass --hidden");
            const RoutingTrace &t = d.part;
            if (!a->routers.empty()) {
                routers = FatePredictor::read_routers_safetensors(a->routers, t.first_moe_layer, t.n_layer, t.n_expert,
                                                                  d.hidden->dim);
            } else if (!a->model.empty()) {
                const auto model = Model::load(a->model);
                if (model->hp().n_layer_moe() != t.n_layer || model->hp().n_expert != t.n_expert ||
                    model->hp().n_embd != d.hidden->dim) {
                    fail("{}: {} MoE layers, {} experts, width {}, but the trace has {} and {} and the sidecar {}",
                         a->model, model->hp().n_layer_moe(), model->hp().n_expert, model->hp().n_embd, t.n_layer,
                         t.n_expert, d.hidden->dim);
                }
                routers = FatePredictor::read_routers(*model);
            } else {
                fail("--kind llapor-mlp-prior reads the routers: pass -m MODEL.gguf or --routers FILE.safetensors");
            }
            a->opt.routers = &routers;
            a->opt.correction = a->correction == "mlp";
        }
        TrainResult r = train_llapor(d.part, d.hidden.get(), a->opt,
                                     [](const std::string &line) { std::fprintf(stderr, "train: %s\n", line.c_str()); });
        r.config.notes["trained_on"]["trace"] = std::filesystem::path(a->split.trace).filename().string();
        r.config.notes["trained_on"]["split"] = a->split.split;
        r.config.notes["trained_on"]["holdout_every"] = a->split.holdout_every;
        save_llapor(a->out, r.config, r.params);
        std::string groups;
        for (int32_t g : r.config.group_start) groups += (groups.empty() ? "" : ",") + std::to_string(g);
        std::fprintf(stderr, "%s: %s, %lld parameters, groups start at layers %s\n", a->out.c_str(),
                     r.config.kind.c_str(), (long long)r.params.n_values(), groups.c_str());
    });
}

void register_eval_predictor(CLI::App &app) {
    struct Args {
        SplitArgs split;
        std::string predictor, model, routers, json_out, metric = "topk_accuracy", groups = "auto", policy = "lru",
            label;
        EvalOptions opt;
        double decay = kRecencyDecay;
        int threads = 1;
        int verbosity = 0;
    };
    auto a = std::make_shared<Args>();
    auto *cmd = app.add_subcommand("eval-predictor", "evaluate an expert predictor on held-out routing");
    add_split_flags(*cmd, a->split, "test");
    cmd->add_option("--predictor", a->predictor, "none, frequency, recency, fate, oracle, or a LLaPor file")
        ->required();
    cmd->add_option("-m,--model", a->model, "model GGUF (fate reads its routers)")->check(CLI::ExistingFile);
    cmd->add_option("--routers", a->routers, "fate without a GGUF: HF safetensors with layers.N.mlp.gate.weight")
        ->check(CLI::ExistingFile);
    cmd->add_option("--metric", a->metric, "topk_accuracy: recall@k, precision@k, exact top-k match")
        ->check(CLI::IsMember({"topk_accuracy"}))->capture_default_str();
    cmd->add_option("--window", a->opt.window, "distances 1..window")->capture_default_str()->check(CLI::Range(1, 64));
    cmd->add_option("--k", a->opt.k_pred, "predicted set size (0: the trace's top_k)")
        ->capture_default_str()
        ->check(CLI::Range(0, std::numeric_limits<int32_t>::max()));
    cmd->add_option("--groups", a->groups, "layer groups of the report: auto or A,B")->capture_default_str();
    cmd->add_option("--cache-slots", a->opt.cache_slots, "replay a hot-expert table of N slots per layer (0: off)")
        ->capture_default_str()
        ->check(CLI::Range(0, std::numeric_limits<int32_t>::max()));
    cmd->add_option("--cache-policy", a->policy, "lru, lfu or arc")->capture_default_str();
    cmd->add_option("--prefetch", a->opt.prefetch_per_layer, "experts prefetched per predicted layer (0: top_k)")
        ->capture_default_str()
        ->check(CLI::Range(0, std::numeric_limits<int32_t>::max()));
    cmd->add_option("--decay", a->decay, "recency: per-token decay of the popularity counts")
        ->capture_default_str()
        ->check(finite_range(0, 1));
    cmd->add_option("--json", a->json_out, "write the result as JSON to this file");
    cmd->add_option("--label", a->label, "name of the predictor in the table and JSON (default: from the predictor)");
    cmd->add_option("-t,--threads", a->threads, "CPU threads for BLAS")->capture_default_str()->check(CLI::Range(1, 1024));
    cmd->add_flag("-v,--verbose", a->verbosity, "more logging");
    cmd->callback([a]() {
        log_init(a->verbosity);
        cpu::set_threads(a->threads);
        Loaded d = load_split(a->split);
        const RoutingTrace &t = d.part;
        const PredictorShape shape{t.n_layer, t.n_expert, t.top_k};
        a->opt.policy = parse_eviction_policy(a->policy);
        std::unique_ptr<ScoringPredictor> p;
        LlaporConfig cfg;
        const std::string &spec = a->predictor;
        if (spec == "frequency" || spec == "recency") {
            p = std::make_unique<FrequencyPredictor>(shape, spec == "recency" ? a->decay : 1.0);
            // Popularity is learnt from the training sequences first (they are not scored).
            if (a->split.split == "test") {
                const RoutingTrace train = select_sequences(d.full, split_sequences(d.full, "train", a->split.holdout_every));
                EvalOptions warm;
                warm.window = a->opt.window;
                evaluate_predictor(p.get(), train, nullptr, warm, "warm-up");
            }
        } else if (spec == "fate" && !a->routers.empty()) {
            if (!d.hidden) fail("--predictor fate needs the router inputs: pass --hidden");
            p = std::make_unique<FatePredictor>(shape, d.hidden->dim,
                                                FatePredictor::read_routers_safetensors(
                                                    a->routers, t.first_moe_layer, t.n_layer, t.n_expert, d.hidden->dim));
        } else if (spec == "fate") {
            if (a->model.empty()) {
                fail("--predictor fate reads the routers: pass -m MODEL.gguf or --routers FILE.safetensors");
            }
            const auto model = Model::load(a->model);
            if (model->hp().n_layer_moe() != t.n_layer || model->hp().n_expert != t.n_expert) {
                fail("{}: {} MoE layers and {} experts, but the trace has {} and {}", a->model,
                     model->hp().n_layer_moe(), model->hp().n_expert, t.n_layer, t.n_expert);
            }
            p = std::make_unique<FatePredictor>(shape, model->hp().n_embd, FatePredictor::read_routers(*model));
        } else if (spec == "oracle") {
            p = std::make_unique<OraclePredictor>(t);
        } else if (spec != "none") {
            if (!std::filesystem::exists(spec)) {
                fail("--predictor {}: expected none, frequency, recency, fate, oracle or a predictor file", spec);
            }
            p = load_llapor(spec, 1, &cfg);
        }
        if (a->groups == "auto") {
            if (cfg.n_groups() == 3) {
                a->opt.group_start = cfg.group_start;
            } else {
                // Measured on the training sequences, as train-predictor --groups auto does.
                const RoutingTrace train = select_sequences(d.full, split_sequences(d.full, "train", a->split.holdout_every));
                a->opt.group_start = measure_groups(train).group_start;
            }
        } else {
            GroupMeasurement unused;
            a->opt.group_start = parse_groups(a->groups, t, &unused);
        }
        // name:split, "+hidden" when only the sidecar's tokens were replayed.
        const std::string name = std::filesystem::path(a->split.trace).filename().string() + ":" + a->split.split +
                                 (d.hidden ? "+hidden" : "");
        EvalResult r = evaluate_predictor(p.get(), t, d.hidden.get(), a->opt, name);
        if (!p && spec == "none") r.predictor = "none";
        else if (cfg.n_groups() > 0) r.predictor = predictor_label(cfg);
        if (!a->label.empty()) r.predictor = a->label;
        std::fputs(r.table().c_str(), stdout);
        if (!a->json_out.empty()) {
            nlohmann::json j = r.to_json();
            j["predictor_spec"] = spec;
            write_file_atomic(a->json_out, j.dump(1) + "\n");
        }
    });
}

} // namespace prescope::cli
