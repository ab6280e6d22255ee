#include "runtime/batch-scheduler.h"

#include "core/error.h"
#include "core/log.h"

#include <algorithm>
#include <climits>
#include <limits>
#include <exception>

namespace prescope {

using Clock = std::chrono::steady_clock;

namespace {

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

GenerationEvent text_event(std::string text) {
    GenerationEvent e;
    e.text = std::move(text);
    return e;
}

GenerationEvent done_event(FinishReason reason, std::string error, int64_t prompt_tokens) {
    GenerationEvent e;
    e.done = true;
    e.finish = reason;
    e.error = std::move(error);
    e.prompt_tokens = prompt_tokens;
    return e;
}

// Bucket bounds in seconds: TTFT spans a decode step to a long prefill behind a queue, inter-token latency a
// GPU decode step to a CPU step of a full batch.
std::vector<double> ttft_bounds() { return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}; }
std::vector<double> inter_token_bounds() { return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}; }

} // namespace

const char *finish_reason_name(FinishReason r) {
    switch (r) {
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::cancelled: return "cancelled";
    case FinishReason::error: return "error";
    }
    return "error";
}

LatencyHistogram::LatencyHistogram(std::vector<double> upper_bounds)
    : bounds(std::move(upper_bounds)), counts(bounds.size(), 0) {}

void LatencyHistogram::observe(double seconds) {
    for (size_t i = 0; i < bounds.size(); ++i) {
        if (seconds <= bounds[i]) ++counts[i];
    }
    sum += seconds;
    ++count;
}

SchedulerMetrics::SchedulerMetrics() : ttft(ttft_bounds()), inter_token(inter_token_bounds()) {}

// ---- RequestHandle

std::optional<GenerationEvent> RequestHandle::next(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
    GenerationEvent e = std::move(events_.front());
    events_.pop_front();
    return e;
}

void RequestHandle::cancel() {
    cancelled_.store(true);
    owner_->wake();
}

void RequestHandle::push(GenerationEvent e) {
    {
        std::lock_guard lock(mutex_);
        events_.push_back(std::move(e));
    }
    cv_.notify_all();
}

// ---- StopScanner

std::string StopScanner::push(std::string_view piece) {
    if (stopped_) return {};
    held_ += piece;
    // Earliest full match wins (the text before it is what the model said before stopping).
    size_t cut = std::string::npos;
    for (const std::string &s : stop_) cut = std::min(cut, held_.find(s));
    if (cut != std::string::npos) {
        stopped_ = true;
        std::string out = held_.substr(0, cut);
        held_.clear();
        return out;
    }
    // Longest tail of held_ that is a proper prefix of a stop string stays back. Text before the tail cannot
    // start a match any more: a match starting there would have to fit inside held_ and was not found.
    size_t keep = 0;
    for (const std::string &s : stop_) {
        for (size_t n = std::min(s.size() - 1, held_.size()); n > keep; --n) {
            if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
                keep = n;
                break;
            }
        }
    }
    std::string out = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out;
}

std::string StopScanner::flush() {
    std::string out = std::move(held_);
    held_.clear();
    return out;
}

// ---- BatchScheduler

struct BatchScheduler::Slot {
    std::shared_ptr<RequestHandle> handle;  // null: free
    GenerationRequest request;
    Clock::time_point queued, last_token;
    uint64_t admitted = 0;     // admission number, for first-come prefill order
    size_t n_prefilled = 0;    // prompt tokens evaluated
    int32_t next_token = -1;   // sampled, to be evaluated in the next step (decode)
    int64_t n_generated = 0;
    std::optional<Sampler> sampler;
    std::optional<TokenTextStream> text;
    std::optional<StopScanner> stop;

    bool prefilling() const { return handle && n_prefilled < request.prompt.size(); }
    bool decoding() const { return handle && !prefilling() && next_token >= 0; }
};

BatchScheduler::BatchScheduler(Engine &engine, const Tokenizer &tokenizer, SchedulerParams params)
    : engine_(engine), tokenizer_(tokenizer), params_(params), n_slots_(engine.n_seq()), slot_ctx_(engine.n_ctx()),
      n_batch_(params.n_batch), slots_(size_t(engine.n_seq())) {
    if (params_.max_queue < 0) fail("the request queue size must be >= 0, got {}", params_.max_queue);
    if (n_batch_ < 1) fail("n_batch must be >= 1, got {}", n_batch_);
    metrics_.slots_total = n_slots_;
    for (int32_t t = 0; t < tokenizer_.n_vocab(); ++t) {
        if (tokenizer_.is_eog(t)) eog_.push_back(t);
    }
}

BatchScheduler::~BatchScheduler() { stop(); }

void BatchScheduler::stop() {
    {
        std::lock_guard lock(mutex_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    for (Slot &s : slots_) {
        if (s.handle) finish(s, FinishReason::error, "the server is shutting down");
    }
    std::lock_guard lock(mutex_);
    for (Pending &p : queue_) {
        p.handle->push(done_event(FinishReason::error, "the server is shutting down", int64_t(p.request.prompt.size())));
    }
    queue_.clear();
}

std::shared_ptr<RequestHandle> BatchScheduler::submit(GenerationRequest r) {
    const int64_t n_prompt = int64_t(r.prompt.size());
    if (n_prompt == 0) fail("the prompt is empty");
    for (int32_t t : r.prompt) {
        if (t < 0 || t >= tokenizer_.n_vocab()) fail("prompt token {} is outside the vocabulary [0, {})", t, tokenizer_.n_vocab());
    }
    if (n_prompt >= slot_ctx_) {
        fail("the prompt is {} tokens; a slot's context of {} tokens must also hold the generated ones", n_prompt, slot_ctx_);
    }
    if (r.max_tokens == 0 || r.max_tokens < -1) fail("max_tokens must be -1 (no limit) or >= 1, got {}", r.max_tokens);
    if (r.max_tokens > 0 && n_prompt + r.max_tokens > slot_ctx_) {
        fail("the prompt is {} tokens and max_tokens {}: more than a slot's context of {} tokens", n_prompt,
             r.max_tokens, slot_ctx_);
    }
    for (const std::string &s : r.stop) {
        if (s.empty()) fail("a stop string is empty");
    }
    auto handle = std::shared_ptr<RequestHandle>(new RequestHandle(this));
    {
        std::lock_guard lock(mutex_);
        if (stop_) {
            handle->push(done_event(FinishReason::error, "the server is shutting down", n_prompt));
            return handle;
        }
        // The free slots take queued requests at the next step: those are not waiting.
        const int64_t free_slots = n_slots_ - metrics_.slots_busy;
        if (int64_t(queue_.size()) >= params_.max_queue + std::max<int64_t>(free_slots, 0)) {
            ++metrics_.requests_rejected;
            return nullptr;
        }
        queue_.push_back({handle, std::move(r), Clock::now()});
    }
    cv_.notify_all();
    return handle;
}

void BatchScheduler::wake() {
    // Taking the lock orders this against the engine thread's predicate check: no lost wake-up.
    { std::lock_guard lock(mutex_); }
    cv_.notify_all();
}

void BatchScheduler::start() {
    PRESCOPE_ASSERT(!thread_.joinable());
    thread_ = std::thread([this] { loop(); });
}

void BatchScheduler::loop() {
    for (;;) {
        {
            std::lock_guard lock(mutex_);
            if (stop_) return;
        }
        refresh_stats_if_asked();
        bool worked = false;
        try {
            worked = step();
        } catch (const std::exception &e) {
            // step() fails requests on engine errors itself; anything else is a bug worth a log line, not a hang.
            spdlog::error("scheduler step failed: {}", e.what());
        }
        if (worked) continue;
        std::unique_lock lock(mutex_);
        const auto any_cancelled = [&] {
            for (const Slot &s : slots_) {
                if (s.handle && s.handle->cancelled()) return true;
            }
            return false;
        };
        cv_.wait(lock, [&] { return stop_ || !queue_.empty() || stats_wanted_ || any_cancelled(); });
        if (stop_) return;
    }
}

void BatchScheduler::drop_cancelled() {
    for (Slot &s : slots_) {
        if (s.handle && s.handle->cancelled()) finish(s, FinishReason::cancelled);
    }
    std::lock_guard lock(mutex_);
    for (auto it = queue_.begin(); it != queue_.end();) {
        if (it->handle->cancelled()) {
            it->handle->push(done_event(FinishReason::cancelled, {}, int64_t(it->request.prompt.size())));
            ++metrics_.requests_cancelled;
            it = queue_.erase(it);
        } else {
            ++it;
        }
    }
}

void BatchScheduler::admit() {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < slots_.size() && !queue_.empty(); ++i) {
        Slot &s = slots_[i];
        if (s.handle) continue;
        Pending p = std::move(queue_.front());
        queue_.pop_front();
        s.handle = std::move(p.handle);
        s.request = std::move(p.request);
        s.queued = p.queued;
        s.admitted = admissions_++;
        s.n_prefilled = 0;
        s.next_token = -1;
        s.n_generated = 0;
        SamplerParams sp = s.request.sampling;
        if (sp.repeat_last_n < 0) sp.repeat_last_n = int32_t(std::min<int64_t>(slot_ctx_, INT32_MAX));
        s.sampler.emplace(sp);
        for (int32_t t : s.request.prompt) s.sampler->accept(t);
        s.text.emplace(tokenizer_);
        s.stop.emplace(s.request.stop);
        engine_.clear(int32_t(i));
        ++metrics_.slots_busy;
    }
    metrics_.queue_length = int64_t(queue_.size());
}

bool BatchScheduler::step() {
    {
        std::lock_guard lock(mutex_);
        if (stop_) return false;
    }
    drop_cancelled();
    admit();

    std::vector<SeqTokens> batch;
    std::vector<size_t> row_slot;  // slot of each logits row, in entry order
    int64_t n_decode = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
        Slot &s = slots_[i];
        if (!s.decoding()) continue;
        batch.push_back({int32_t(i), std::span<const int32_t>(&s.next_token, 1), true});
        row_slot.push_back(i);
        ++n_decode;
    }
    // Prefill chunks in admission order fill what the decodes leave of n_batch.
    std::vector<size_t> prefill;
    for (size_t i = 0; i < slots_.size(); ++i) {
        if (slots_[i].prefilling()) prefill.push_back(i);
    }
    std::sort(prefill.begin(), prefill.end(), [&](size_t a, size_t b) { return slots_[a].admitted < slots_[b].admitted; });
    int64_t budget = std::max<int64_t>(n_batch_ - n_decode, 1);
    std::vector<int64_t> chunk(slots_.size(), 0);
    for (size_t i : prefill) {
        if (budget == 0) break;
        Slot &s = slots_[i];
        const int64_t left = int64_t(s.request.prompt.size() - s.n_prefilled);
        const int64_t n = std::min(left, budget);
        const bool last = n == left;
        batch.push_back({int32_t(i), std::span<const int32_t>(s.request.prompt.data() + s.n_prefilled, size_t(n)), last});
        if (last) row_slot.push_back(i);
        chunk[i] = n;
        budget -= n;
    }
    if (batch.empty()) return false;

    const auto t0 = Clock::now();
    try {
        engine_.eval_batch(batch);
    } catch (const std::exception &e) {
        // The batch's sequences are in an unknown state: their requests end with the error, the others go on.
        spdlog::error("eval_batch failed: {}", e.what());
        for (const SeqTokens &st : batch) finish(slots_[size_t(st.seq)], FinishReason::error, e.what());
        return true;
    }
    const auto t1 = Clock::now();
    int64_t n_prompt_tokens = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
        slots_[i].n_prefilled += size_t(chunk[i]);
        n_prompt_tokens += chunk[i];
    }
    {
        std::lock_guard lock(mutex_);
        ++metrics_.steps;
        metrics_.engine_seconds += seconds_between(t0, t1);
        metrics_.prompt_tokens += uint64_t(n_prompt_tokens);
    }
    const std::vector<float> &logits = engine_.logits();
    const int64_t row_size = row_slot.empty() ? 0 : int64_t(logits.size() / row_slot.size());
    for (size_t r = 0; r < row_slot.size(); ++r) {
        on_logits(slots_[row_slot[r]], logits.data() + r * size_t(row_size), row_size, t1);
    }
    return true;
}

void BatchScheduler::on_logits(Slot &s, const float *row, int64_t row_size, Clock::time_point now) {
    // Models may pad the embedding past the tokenizer's vocabulary; padded ids are never sampled.
    const int64_t n_sample = std::min<int64_t>(row_size, tokenizer_.n_vocab());
    if (s.request.ignore_eos) {
        masked_.assign(row, row + n_sample);
        for (int32_t t : eog_) {
            if (t < n_sample) masked_[size_t(t)] = -std::numeric_limits<float>::infinity();
        }
        row = masked_.data();
    }
    int32_t token = -1;
    try {
        token = s.sampler->sample(row, n_sample);
    } catch (const Error &e) {
        finish(s, FinishReason::error, e.what());
        return;
    }
    {
        std::lock_guard lock(mutex_);
        if (s.n_generated == 0)
            metrics_.ttft.observe(seconds_between(s.queued, now));
        else
            metrics_.inter_token.observe(seconds_between(s.last_token, now));
    }
    s.last_token = now;
    if (tokenizer_.is_eog(token)) {
        finish(s, FinishReason::stop);
        return;
    }
    s.sampler->accept(token);
    ++s.n_generated;
    {
        std::lock_guard lock(mutex_);
        ++metrics_.generated_tokens;
    }
    std::string out = s.stop->push(s.text->push(token));
    if (s.stop->stopped()) {
        s.handle->push(text_event(std::move(out)));
        finish(s, FinishReason::stop);
        return;
    }
    if (!out.empty()) s.handle->push(text_event(std::move(out)));
    const int64_t seq = int64_t(&s - slots_.data());
    if (s.n_generated == s.request.max_tokens || engine_.n_past(int32_t(seq)) >= slot_ctx_) {
        finish(s, FinishReason::length);
        return;
    }
    s.next_token = token;
}

void BatchScheduler::finish(Slot &s, FinishReason reason, std::string error) {
    std::string text;
    if ((reason == FinishReason::stop || reason == FinishReason::length) && !s.stop->stopped()) {
        // What the stream and the stop scanner still hold is output that matched no stop string.
        text = s.stop->push(s.text->flush());
        if (s.stop->stopped())
            reason = FinishReason::stop;
        else
            text += s.stop->flush();
    }
    GenerationEvent e = done_event(reason, std::move(error), int64_t(s.request.prompt.size()));
    e.text = std::move(text);
    e.completion_tokens = s.n_generated;
    {
        std::lock_guard lock(mutex_);
        if (reason == FinishReason::cancelled)
            ++metrics_.requests_cancelled;
        else if (reason == FinishReason::error)
            ++metrics_.requests_failed;
        else
            ++metrics_.requests_finished;
        --metrics_.slots_busy;
    }
    s.handle->push(std::move(e));
    s.handle.reset();
    s.sampler.reset();
    s.text.reset();
    s.stop.reset();
    s.next_token = -1;
    engine_.clear(int32_t(&s - slots_.data()));
}

SchedulerMetrics BatchScheduler::metrics() const {
    std::lock_guard lock(mutex_);
    SchedulerMetrics m = metrics_;
    m.queue_length = int64_t(queue_.size());
    return m;
}

void BatchScheduler::refresh_stats_if_asked() {
    {
        std::lock_guard lock(mutex_);
        if (!stats_wanted_) return;
    }
    nlohmann::json j = engine_.stats_json();
    {
        std::lock_guard lock(mutex_);
        stats_ = std::move(j);
        stats_wanted_ = false;
        ++stats_version_;
    }
    stats_cv_.notify_all();
}

nlohmann::json BatchScheduler::engine_stats(std::chrono::milliseconds wait) {
    std::unique_lock lock(mutex_);
    if (!thread_.joinable()) {
        // No engine thread: the caller is the only one touching the engine.
        lock.unlock();
        return engine_.stats_json();
    }
    const uint64_t seen = stats_version_;
    stats_wanted_ = true;
    cv_.notify_all();
    stats_cv_.wait_for(lock, wait, [&] { return stats_version_ != seen; });
    return stats_;
}

} // namespace prescope
