// prescope inspect: prints a GGUF file's metadata, tensors and, for supported models, the
// hyper-parameters PreScope reads (llama.cpp gguf-dump in spirit).
#include "cli.h"

#include "arch/arch.h"
#include "core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace prescope::cli {

namespace {

std::string value_str(const GgufValue &v) {
    if (const auto *u = std::get_if<uint64_t>(&v.v)) return std::to_string(*u);
    if (const auto *i = std::get_if<int64_t>(&v.v)) return std::to_string(*i);
    if (const auto *d = std::get_if<double>(&v.v)) return fmt::format("{}", *d);
    if (const auto *b = std::get_if<bool>(&v.v)) return *b ? "true" : "false";
    if (const auto *s = std::get_if<std::string>(&v.v)) {
        return s->size() > 60 ? fmt::format("\"{}...\" ({} bytes)", s->substr(0, 60), s->size()) : "\"" + *s + "\"";
    }
    const auto &a = std::get<std::vector<GgufValue>>(v.v);
    std::vector<std::string> head;
    for (size_t i = 0; i < std::min<size_t>(a.size(), 4); ++i) head.push_back(value_str(a[i]));
    return fmt::format("[{}{}] ({} x {})", fmt::join(head, ", "), a.size() > 4 ? ", ..." : "", a.size(),
                       gguf_type_name(v.elem_type));
}

} // namespace

void register_inspect(CLI::App &app) {
    auto *cmd = app.add_subcommand("inspect", "print a GGUF file's metadata, tensors and hyper-parameters");
    auto path = std::make_shared<std::string>();
    cmd->add_option("file", *path, "GGUF file")->required();
    cmd->callback([path]() {
        const GgufFile f(*path);
        fmt::print("{}: GGUF v{}, {} metadata keys, {} tensors, alignment {}, data at byte {}\n", f.path(),
                   f.version(), f.metadata().size(), f.tensors().size(), f.alignment(), f.data_offset());
        for (const auto &[key, v] : f.metadata()) fmt::print("  {:<48} {}\n", key, value_str(v));
        for (const auto &t : f.tensors()) {
            fmt::print("  tensor {:<40} {:<6} [{}] {} bytes\n", t.name, ggml_type_name(t.ggml_type),
                       fmt::join(t.ne, ", "), t.n_bytes);
        }
        const auto m = Model::load(*path);
        const HParams &hp = m->hp();
        fmt::print("model: {} | {} layers | n_embd {} | heads {}/{} x {} | experts {} top-{} | n_ff_exp {} | "
                   "shared expert ff {} | vocab {} | expert {:.2f} MiB\n",
                   hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_expert,
                   hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp, hp.n_vocab,
                   double(m->expert_bytes(hp.n_layer_dense)) / (1 << 20));  // the first layer with experts
    });
}

} // namespace prescope::cli
