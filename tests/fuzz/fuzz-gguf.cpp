// GGUF reader and model loading: the header, every metadata getter, the tokenizer and chat template built from
// the metadata, Model::load and, when a model loads, one forward pass (a model that loads must run).
#include "fuzz-common.h"

#include "arch/arch.h"
#include "format/gguf.h"
#include "runtime/chat-template.h"
#include "runtime/context.h"
#include "runtime/tokenizer.h"

using namespace prescope;

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fuzz::init();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const fuzz::MemFile file(data, size);
    fuzz::expect_clean([&] {
        const GgufFile f(file.path());
        for (const auto &kv : f.metadata()) {
            const std::string &key = kv.first;  // a named reference: clang 14 cannot capture a structured binding
            fuzz::expect_clean([&] { (void)f.get_u64(key); });
            fuzz::expect_clean([&] { (void)f.get_i64(key); });
            fuzz::expect_clean([&] { (void)f.get_f64(key); });
            fuzz::expect_clean([&] { (void)f.get_bool(key); });
            fuzz::expect_clean([&] { (void)f.get_str(key); });
            fuzz::expect_clean([&] { (void)f.get_str_array(key); });
            fuzz::expect_clean([&] { (void)f.get_f32_array(key); });
            fuzz::expect_clean([&] { (void)f.get_i32_array(key); });
        }
        for (const auto &t : f.tensors()) fuzz::expect_clean([&] { (void)f.tensor_view(t.name); });
        fuzz::expect_clean([&] {
            const Tokenizer tok = Tokenizer::from_gguf(f);
            const std::vector<int32_t> ids = tok.encode("Hello, world! <|im_start|>user\n 12 ab", true, true);
            (void)tok.decode(ids);
            fuzz::expect_clean([&] {
                const ChatPrompt p = render_chat(f, {{"system", "s"}, {"user", "<|im_end|>"}}, true);
                (void)tok.encode(p.text, true, true, p.content);
            });
        });
    });
    std::unique_ptr<Model> model;
    fuzz::expect_clean([&] { model = Model::load(file.path()); });
    if (model) {  // a model that loads must run: no Error allowed from here on
        Context ctx(*model, {8, 4});
        const int32_t tokens[2] = {0, int32_t(model->hp().n_vocab - 1)};
        ctx.eval({tokens, 2});
    }
    return 0;
}
