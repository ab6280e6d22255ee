// The batch scheduler (runtime/batch-scheduler.h) over a scripted engine: which tokens each step evaluates
// (decodes first, prefill chunks in admission order filling n_batch), what the requests receive (tokens, stop
// strings, UTF-8 held back, max_tokens, a full context, end of generation), cancelling during prefill and the
// bounded queue. The demo model's tokenizer gives the token pieces.
#include "core/error.h"
#include "format/gguf.h"
#include "runtime/batch-scheduler.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>

namespace prescope {
namespace {

// An Engine whose "model" is a function: the next token of sequence seq after `n_past` cached tokens whose last one
// is `last`. Records every eval_batch call as (seq, tokens, logits) triples.
class ScriptedEngine final : public Engine {
  public:
    struct Entry {
        int32_t seq;
        std::vector<int32_t> tokens;
        bool logits;
        bool operator==(const Entry &) const = default;
    };
    ScriptedEngine(int64_t n_seq, int64_t n_ctx, int64_t n_vocab, std::function<int32_t(int32_t, int64_t, int32_t)> next)
        : n_ctx_(n_ctx), n_vocab_(n_vocab), n_past_(size_t(n_seq), 0), last_(size_t(n_seq), -1), next_(std::move(next)) {}

    void eval(std::span<const int32_t> tokens, bool) override { eval_batch(std::vector<SeqTokens>{{0, tokens, true}}); }
    void eval_batch(std::span<const SeqTokens> batch) override {
        if (fail_next) {
            fail_next = false;
            fail("scripted failure");
        }
        std::vector<Entry> step;
        logits_.clear();
        for (const SeqTokens &e : batch) {
            const size_t s = size_t(e.seq);
            if (n_past_[s] + int64_t(e.tokens.size()) > n_ctx_) fail("sequence {} overflows", e.seq);
            step.push_back({e.seq, {e.tokens.begin(), e.tokens.end()}, e.logits});
            n_past_[s] += int64_t(e.tokens.size());
            last_[s] = e.tokens.back();
            if (!e.logits) continue;
            std::vector<float> row(size_t(n_vocab_), -1.0f);
            row[size_t(next_(e.seq, n_past_[s], last_[s]))] = 1.0f;
            logits_.insert(logits_.end(), row.begin(), row.end());
        }
        steps.push_back(std::move(step));
    }
    const std::vector<float> &logits() const override { return logits_; }
    int64_t n_seq() const override { return int64_t(n_past_.size()); }
    int64_t n_past() const override { return n_past_[0]; }
    int64_t n_past(int32_t seq) const override { return n_past_[size_t(seq)]; }
    int64_t n_ctx() const override { return n_ctx_; }
    void clear() override { std::fill(n_past_.begin(), n_past_.end(), 0); }
    void clear(int32_t seq) override {
        n_past_[size_t(seq)] = 0;
        ++clears[seq];
    }
    const char *backend_name() const override { return "scripted"; }
    std::string startup_text() const override { return {}; }
    std::string stats_text() const override { return {}; }
    nlohmann::json stats_json() const override { return {{"routing", "router"}}; }
    void reset_stats() override {}

    std::vector<std::vector<Entry>> steps;
    std::map<int32_t, int> clears;
    bool fail_next = false;  // the next eval_batch throws prescope::Error

  private:
    int64_t n_ctx_, n_vocab_;
    std::vector<int64_t> n_past_;
    std::vector<int32_t> last_;
    std::function<int32_t(int32_t, int64_t, int32_t)> next_;
    std::vector<float> logits_;
};

const Tokenizer &demo_tokenizer() {
    static const GgufFile file(PRESCOPE_SOURCE_DIR "/models/demo/demo-q8_0.gguf");
    static const Tokenizer tok = Tokenizer::from_gguf(file);
    return tok;
}

GenerationRequest greedy(std::vector<int32_t> prompt, int64_t max_tokens = -1) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.sampling.temp = 0.0f;
    r.max_tokens = max_tokens;
    return r;
}

std::vector<int32_t> iota(int32_t from, int32_t n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) v[size_t(i)] = from + i;
    return v;
}

// All events so far; the last is done when the request ended.
std::vector<GenerationEvent> drain(RequestHandle &h) {
    std::vector<GenerationEvent> out;
    while (auto e = h.next(std::chrono::milliseconds(0))) out.push_back(std::move(*e));
    return out;
}

std::string text_of(const std::vector<GenerationEvent> &events) {
    std::string s;
    for (const GenerationEvent &e : events) s += e.text;
    return s;
}

void run_all(BatchScheduler &s) {
    for (int i = 0; i < 10000 && s.step(); ++i) {
    }
}

int32_t word(const char *text) {
    const std::vector<int32_t> ids = demo_tokenizer().encode(text, false, false);
    EXPECT_EQ(ids.size(), 1u) << text;
    return ids.at(0);
}

TEST(BatchScheduler, DecodesFirstThenPrefillChunksInAdmissionOrder) {
    const Tokenizer &tok = demo_tokenizer();
    const int32_t t = word(" the");
    ScriptedEngine eng(3, 64, tok.n_vocab(), [t](int32_t, int64_t, int32_t) { return t; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 8});
    auto a = s.submit(greedy(iota(100, 10), 3));
    auto b = s.submit(greedy(iota(200, 5), 3));
    ASSERT_TRUE(s.step());  // A's first 8 prompt tokens fill the step
    ASSERT_TRUE(s.step());  // A's last 2 (logits) and all of B (logits)
    ASSERT_TRUE(s.step());  // both decode
    auto c = s.submit(greedy(iota(300, 20), 1));
    ASSERT_TRUE(s.step());  // the two decodes first, then 6 of C's prompt
    using E = ScriptedEngine::Entry;
    const std::vector<std::vector<E>> expect = {
        {{0, iota(100, 8), false}},
        {{0, iota(108, 2), true}, {1, iota(200, 5), true}},
        {{0, {t}, true}, {1, {t}, true}},
        {{0, {t}, true}, {1, {t}, true}, {2, iota(300, 6), false}},
    };
    EXPECT_EQ(eng.steps, expect);
    run_all(s);
    for (auto *h : {&a, &b}) {
        const auto ev = drain(**h);
        ASSERT_TRUE(ev.back().done);
        EXPECT_EQ(ev.back().finish, FinishReason::length);
        EXPECT_EQ(ev.back().completion_tokens, 3);
        EXPECT_EQ(text_of(ev), " the the the");
    }
    const auto ev = drain(*c);
    EXPECT_EQ(ev.back().prompt_tokens, 20);
    EXPECT_EQ(text_of(ev), " the");
    const SchedulerMetrics m = s.metrics();
    EXPECT_EQ(m.requests_finished, 3u);
    EXPECT_EQ(m.prompt_tokens, 35u);
    EXPECT_EQ(m.generated_tokens, 7u);
    EXPECT_EQ(m.slots_busy, 0);
    EXPECT_EQ(m.ttft.count, 3u);
    EXPECT_EQ(m.inter_token.count, 4u);
}

TEST(BatchScheduler, PrefillAdvancesWhenDecodesFillTheBatch) {
    const Tokenizer &tok = demo_tokenizer();
    const int32_t t = word(" the");
    ScriptedEngine eng(3, 64, tok.n_vocab(), [t](int32_t, int64_t, int32_t) { return t; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 2});
    auto a = s.submit(greedy({1}, 10));
    auto b = s.submit(greedy({2}, 10));
    s.step();  // both prompts
    auto c = s.submit(greedy(iota(10, 4), 10));
    s.step();  // two decodes fill n_batch; C still gets one prompt token
    ASSERT_EQ(eng.steps[1].size(), 3u);
    EXPECT_EQ(eng.steps[1][2], (ScriptedEngine::Entry{2, {10}, false}));
}

TEST(BatchScheduler, EndOfGenerationAndFullContext) {
    const Tokenizer &tok = demo_tokenizer();
    const int32_t t = word(" the");
    ASSERT_GE(tok.eos(), 0);
    const int32_t eos = tok.eos();
    // Sequence 0 says " the" twice then EOS; sequence 1 never stops.
    ScriptedEngine eng(2, 8, tok.n_vocab(), [=](int32_t seq, int64_t n_past, int32_t) {
        return seq == 0 && n_past >= 4 ? eos : t;
    });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 16});
    auto a = s.submit(greedy({5, 6}));
    auto b = s.submit(greedy({5, 6, 7, 8, 9}));
    run_all(s);
    auto ea = drain(*a);
    EXPECT_EQ(ea.back().finish, FinishReason::stop);
    EXPECT_EQ(ea.back().completion_tokens, 2);  // the EOS is not counted
    EXPECT_EQ(text_of(ea), " the the");
    // A slot of 8 tokens: 5 prompt tokens, then tokens until the cache is full; the last one sampled is not
    // evaluated (as `prescope generate`).
    auto eb = drain(*b);
    EXPECT_EQ(eb.back().finish, FinishReason::length);
    EXPECT_EQ(eb.back().completion_tokens, 4);
    EXPECT_EQ(eng.clears[0], 2);  // at admission and when done
}

TEST(BatchScheduler, IgnoreEosNeverSamplesEndOfGeneration) {
    const Tokenizer &tok = demo_tokenizer();
    const int32_t eos = tok.eos();
    ScriptedEngine eng(1, 64, tok.n_vocab(), [=](int32_t, int64_t, int32_t) { return eos; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 16});
    GenerationRequest r = greedy({5}, 5);
    r.ignore_eos = true;
    auto h = s.submit(r);
    run_all(s);
    const auto ev = drain(*h);
    EXPECT_EQ(ev.back().finish, FinishReason::length);
    EXPECT_EQ(ev.back().completion_tokens, 5);
}

TEST(BatchScheduler, StopStringAcrossTokensIsNeverSent) {
    const Tokenizer &tok = demo_tokenizer();
    const std::vector<int32_t> script = tok.encode(" the package is installed and the package", false, false);
    ScriptedEngine eng(1, 64, tok.n_vocab(),
                       [&](int32_t, int64_t n_past, int32_t) { return script.at(size_t(n_past - 1) % script.size()); });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 16});
    GenerationRequest r = greedy({5}, 30);
    r.stop = {"nothing", "d and t"};
    auto h = s.submit(r);
    std::vector<GenerationEvent> ev;
    while (s.step()) {
        for (auto &e : drain(*h)) {
            // No event ever carries a part of the stop string's start beyond what the final text keeps.
            EXPECT_EQ(e.text.find("d a"), std::string::npos);
            ev.push_back(std::move(e));
        }
    }
    EXPECT_EQ(text_of(ev), " the package is installe");
    EXPECT_EQ(ev.back().finish, FinishReason::stop);
}

TEST(BatchScheduler, SplitUtf8CharacterIsHeldBack) {
    const Tokenizer &tok = demo_tokenizer();
    // GPT-2 byte-level tokens of the two bytes of "é" (C3 A9): "Ã" and "©" in the byte alphabet.
    const int32_t b0 = tok.find_token("Ã"), b1 = tok.find_token("©");
    ASSERT_GE(b0, 0);
    ASSERT_GE(b1, 0);
    ASSERT_EQ(tok.token_to_piece(b0), "\xC3");
    ScriptedEngine eng(1, 64, tok.n_vocab(), [=](int32_t, int64_t n_past, int32_t) { return n_past % 2 ? b0 : b1; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 16});
    auto h = s.submit(greedy({5}, 3));
    s.step();  // samples C3: nothing to send yet
    EXPECT_TRUE(drain(*h).empty());
    s.step();  // A9 completes it
    const auto ev = drain(*h);
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].text, "é");
    s.step();  // C3 again, and max_tokens ends the request: the lone byte can never complete, U+FFFD is sent
    const auto end = drain(*h);
    EXPECT_EQ(text_of(end), "\xEF\xBF\xBD");
    ASSERT_FALSE(end.empty());
    EXPECT_TRUE(end.back().done);
}

TEST(BatchScheduler, CancelDuringPrefillFreesTheSlot) {
    const Tokenizer &tok = demo_tokenizer();
    const int32_t t = word(" the");
    ScriptedEngine eng(1, 64, tok.n_vocab(), [t](int32_t, int64_t, int32_t) { return t; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 4});
    auto a = s.submit(greedy(iota(100, 20), 5));
    auto b = s.submit(greedy(iota(200, 3), 1));
    s.step();  // 4 of A's 20 prompt tokens
    a->cancel();
    s.step();  // A is dropped, B takes the slot from its start
    const auto ea = drain(*a);
    ASSERT_EQ(ea.size(), 1u);
    EXPECT_EQ(ea[0].finish, FinishReason::cancelled);
    EXPECT_EQ(ea[0].completion_tokens, 0);
    ASSERT_EQ(eng.steps.size(), 2u);
    EXPECT_EQ(eng.steps[1], (std::vector<ScriptedEngine::Entry>{{0, iota(200, 3), true}}));
    run_all(s);
    EXPECT_EQ(drain(*b).back().finish, FinishReason::length);
    EXPECT_EQ(s.metrics().requests_cancelled, 1u);
    EXPECT_EQ(s.metrics().prompt_tokens, 7u);
}

TEST(BatchScheduler, CancelWhileQueued) {
    const Tokenizer &tok = demo_tokenizer();
    ScriptedEngine eng(1, 64, tok.n_vocab(), [](int32_t, int64_t, int32_t) { return 300; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 4});
    auto a = s.submit(greedy({1}, 3));
    auto b = s.submit(greedy({2}, 3));
    s.step();
    b->cancel();
    run_all(s);
    EXPECT_EQ(drain(*b).back().finish, FinishReason::cancelled);
    EXPECT_EQ(drain(*a).back().finish, FinishReason::length);
    for (const auto &step : eng.steps) {
        for (const auto &e : step) EXPECT_NE(e.tokens, std::vector<int32_t>{2});
    }
}

TEST(BatchScheduler, EngineFailureEndsTheBatchsRequestsOnly) {
    const Tokenizer &tok = demo_tokenizer();
    ScriptedEngine eng(2, 64, tok.n_vocab(), [](int32_t, int64_t, int32_t) { return 300; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 8});
    auto a = s.submit(greedy({1}, 3));
    auto b = s.submit(greedy({2}, 3));
    eng.fail_next = true;
    EXPECT_TRUE(s.step());
    for (auto *h : {&a, &b}) {
        const auto ev = drain(**h);
        ASSERT_EQ(ev.size(), 1u);
        EXPECT_EQ(ev[0].finish, FinishReason::error);
        EXPECT_EQ(ev[0].error, "scripted failure");
    }
    EXPECT_EQ(s.metrics().requests_failed, 2u);
    EXPECT_EQ(s.metrics().slots_busy, 0);
    auto c = s.submit(greedy({3}, 2));  // the slots serve again
    run_all(s);
    EXPECT_EQ(drain(*c).back().finish, FinishReason::length);
}

TEST(BatchScheduler, QueueBoundCountsOnlyRequestsNoFreeSlotTakes) {
    const Tokenizer &tok = demo_tokenizer();
    ScriptedEngine eng(2, 64, tok.n_vocab(), [](int32_t, int64_t, int32_t) { return 300; });
    BatchScheduler s(eng, tok, {.max_queue = 1, .n_batch = 4});
    auto a = s.submit(greedy({1}, 50));
    auto b = s.submit(greedy({2}, 50));
    auto c = s.submit(greedy({3}, 50));  // waits: both slots will be taken
    EXPECT_TRUE(a && b && c);
    EXPECT_EQ(s.submit(greedy({4}, 50)), nullptr);
    s.step();
    EXPECT_EQ(s.submit(greedy({4}, 50)), nullptr);  // still one waiting
    EXPECT_EQ(s.metrics().requests_rejected, 2u);
    EXPECT_EQ(s.metrics().queue_length, 1);
}

TEST(BatchScheduler, RequestsThatCanNeverRunAreRefused) {
    const Tokenizer &tok = demo_tokenizer();
    ScriptedEngine eng(1, 16, tok.n_vocab(), [](int32_t, int64_t, int32_t) { return 300; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 4});
    EXPECT_THROW(s.submit(greedy({})), Error);
    EXPECT_THROW(s.submit(greedy(iota(1, 16))), Error);     // no room for a generated token
    EXPECT_THROW(s.submit(greedy(iota(1, 10), 7)), Error);  // 10 + 7 > 16
    EXPECT_THROW(s.submit(greedy({tok.n_vocab()})), Error);
    GenerationRequest r = greedy({1}, 2);
    r.stop = {""};
    EXPECT_THROW(s.submit(r), Error);
    EXPECT_NE(s.submit(greedy(iota(1, 10), 6)), nullptr);
}

TEST(BatchScheduler, EngineThreadServesConcurrentRequests) {
    const Tokenizer &tok = demo_tokenizer();
    const int32_t t = word(" the");
    ScriptedEngine eng(2, 64, tok.n_vocab(), [t](int32_t, int64_t, int32_t) { return t; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 8});
    s.start();
    std::vector<std::shared_ptr<RequestHandle>> hs;
    for (int i = 0; i < 5; ++i) hs.push_back(s.submit(greedy(iota(10 * i + 1, 3), 4)));
    for (auto &h : hs) {
        std::string text;
        for (;;) {
            auto e = h->next(std::chrono::seconds(30));
            ASSERT_TRUE(e);
            text += e->text;
            if (e->done) break;
        }
        EXPECT_EQ(text, " the the the the");
    }
    EXPECT_EQ(s.engine_stats()["routing"], "router");
}

TEST(BatchScheduler, StopEndsRunningAndQueuedRequests) {
    const Tokenizer &tok = demo_tokenizer();
    ScriptedEngine eng(1, 64, tok.n_vocab(), [](int32_t, int64_t, int32_t) { return 300; });
    BatchScheduler s(eng, tok, {.max_queue = 8, .n_batch = 8});
    auto a = s.submit(greedy({1}, 50));
    auto b = s.submit(greedy({2}, 50));
    s.step();
    s.stop();
    EXPECT_FALSE(s.step());
    for (auto *h : {&a, &b}) EXPECT_EQ(drain(**h).back().finish, FinishReason::error);
    auto c = s.submit(greedy({3}, 2));
    EXPECT_EQ(drain(*c).back().error, "the server is shutting down");
}

TEST(StopScanner, HoldsBackOnlyPossibleStarts) {
    StopScanner s({"</end>", "STOP"});
    EXPECT_EQ(s.push("abc<"), "abc");
    EXPECT_EQ(s.push("/e"), "");
    EXPECT_EQ(s.push("x S"), "</ex ");
    EXPECT_FALSE(s.stopped());
    EXPECT_EQ(s.push("TO"), "");
    EXPECT_EQ(s.push("P tail"), "");
    EXPECT_TRUE(s.stopped());
    EXPECT_EQ(s.push("more"), "");
    StopScanner t({"ab"});
    EXPECT_EQ(t.push("xa"), "x");
    EXPECT_EQ(t.flush(), "a");
    // The earliest match wins even when a later stop string is found first in the list.
    StopScanner u({"cd", "bc"});
    EXPECT_EQ(u.push("abcd"), "a");
}

} // namespace
} // namespace prescope
