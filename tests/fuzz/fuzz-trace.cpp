// Routing traces (.pstrace), their hidden-state sidecars (.hidden.zst) and `prescope trace` prompt files: the
// three readers of docs/trace-format.md, on the same bytes (the magic picks who gets further). A trace that
// reads is written and read back: the writer must accept what the reader accepts, with the same content.
#include "fuzz-common.h"

#include "offload/trace.h"

#include <optional>

using namespace prescope;

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fuzz::init();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const fuzz::MemFile file(data, size);
    std::optional<RoutingTrace> t;
    fuzz::expect_clean([&] { t = read_trace(file.path()); });
    if (t) {
        (void)t->sequence_bounds();
        fuzz::expect_clean([&] { (void)split_sequences(*t, "test", 3); });
        const std::string bytes = encode_trace("roundtrip", *t, 1);  // no Error allowed here
        const fuzz::MemFile again(reinterpret_cast<const uint8_t *>(bytes.data()), bytes.size());
        const RoutingTrace u = read_trace(again.path());
        if (u.token_ids != t->token_ids || u.expert_ids != t->expert_ids || u.gate_q != t->gate_q) std::abort();
    }
    fuzz::expect_clean([&] {
        const HiddenTrace h = read_hidden(file.path());
        if (h.n_tokens() > 0) {
            std::vector<float> x(size_t(h.dim));
            h.dequantize(h.n_tokens() - 1, h.n_layer - 1, x.data());
        }
    });
    fuzz::expect_clean([&] { (void)read_prompt_file(file.path(), "prompts"); });
    return 0;
}
