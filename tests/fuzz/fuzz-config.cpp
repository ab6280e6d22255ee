// The YAML offload config (--config FILE, offload/offload-config.h): every key, value and malformed document.
#include "fuzz-common.h"

#include "offload/offload-config.h"

using namespace prescope;

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fuzz::init();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const fuzz::MemFile file(data, size);
    fuzz::expect_clean([&] {
        OffloadConfig c;
        c.load_yaml(file.path());
        (void)c.describe();
    });
    return 0;
}
