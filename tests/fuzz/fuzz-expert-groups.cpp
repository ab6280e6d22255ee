// The expert groups JSON (--expert-groups FILE, offload/expert-groups.h): every field, count and character. A file
// that loads passes the check against its own shape and is written and read back to the same groups.
#include "fuzz-common.h"

#include "offload/expert-groups.h"

#include <nlohmann/json.hpp>

#include <optional>

using namespace prescope;

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fuzz::init();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const fuzz::MemFile file(data, size);
    std::optional<ExpertGroups> g;
    fuzz::expect_clean([&] { g = ExpertGroups::load(file.path()); });
    if (!g) return 0;
    g->check_shape(g->n_layers, g->n_experts, g->n_gpus, "fuzz");  // no Error allowed: its own shape
    const ExpertGroups back = ExpertGroups::from_json(g->to_json(), "roundtrip");
    if (back.gpu != g->gpu || back.n_gpus != g->n_gpus || back.tolerance != g->tolerance) std::abort();
    return 0;
}
