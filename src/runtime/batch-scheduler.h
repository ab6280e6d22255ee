// Continuous batching over an Engine's sequences (the server's slots): requests wait in a bounded queue, join
// a free slot at the next step and leave it when done; each step is one Engine::eval_batch with every
// decoding slot's next token first and chunks of the prompts being prefilled after them, up to n_batch
// tokens. Sampling, stop strings, max_tokens, end of generation and UTF-8 hold-back happen here, so the
// HTTP layer (tools/cli/serve.cpp) only parses requests and writes events. Decisions 0115-0119.
#pragma once

#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "runtime/tokenizer.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace prescope {

/// What one request asks to generate.
struct GenerationRequest {
    std::vector<int32_t> prompt;    // token ids: not empty, fewer than the slot's context
    SamplerParams sampling;
    int64_t max_tokens = -1;        // generated tokens at most; -1: until end of generation or a full slot context
    std::vector<std::string> stop;  // the output ends before the first occurrence of any of these (not empty)
    bool ignore_eos = false;        // end-of-generation tokens are never sampled (llama-server's ignore_eos)
};

/// Why a generation ended. stop: an end-of-generation token or a stop string; length: max_tokens or the slot's
/// context is full; cancelled: RequestHandle::cancel(); error: the engine or sampler failed (GenerationEvent::error).
enum class FinishReason { stop, length, cancelled, error };
/// "stop", "length", "cancelled", "error" (OpenAI's finish_reason for the first two).
const char *finish_reason_name(FinishReason r);

/// One message from the engine thread to the request's owner: new text, and at the end done with the counts.
struct GenerationEvent {
    std::string text;  // valid UTF-8 continuing the previous events' text (may be empty)
    bool done = false;
    FinishReason finish = FinishReason::stop;  // when done
    std::string error;                         // when finish == error
    int64_t prompt_tokens = 0;                 // when done
    int64_t completion_tokens = 0;             // when done: tokens sampled, the end-of-generation token not counted
};

class BatchScheduler;

/// The requester's end of one request: a channel of events, and cancel(). Thread-safe.
class RequestHandle {
  public:
    /// The next event, waiting up to `timeout`; nullopt when none came. After the done event there are no more.
    std::optional<GenerationEvent> next(std::chrono::milliseconds timeout);
    /// Drops the request (the client went away): the scheduler frees its slot, or takes it off the queue,
    /// before its next step, and sends one done event with FinishReason::cancelled. No effect once done.
    void cancel();
    bool cancelled() const { return cancelled_.load(); }

  private:
    friend class BatchScheduler;
    explicit RequestHandle(BatchScheduler *owner) : owner_(owner) {}
    void push(GenerationEvent e);

    BatchScheduler *owner_;
    std::atomic<bool> cancelled_{false};
    std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<GenerationEvent> events_;
};

/// A Prometheus histogram: cumulative counts per upper bound (seconds), their sum and count.
struct LatencyHistogram {
    std::vector<double> bounds;    // upper bounds, ascending; +Inf is implied
    std::vector<uint64_t> counts;  // counts[i]: observations <= bounds[i] (cumulative, as Prometheus writes them)
    double sum = 0.0;
    uint64_t count = 0;
    explicit LatencyHistogram(std::vector<double> upper_bounds);
    void observe(double seconds);
};

/// The scheduler's counters since start. Tokens/s are over the time the engine spent in eval_batch.
struct SchedulerMetrics {
    uint64_t requests_finished = 0;   // ended with stop or length
    uint64_t requests_cancelled = 0;  // client gone
    uint64_t requests_failed = 0;     // engine or sampler error
    uint64_t requests_rejected = 0;   // queue full
    uint64_t prompt_tokens = 0;       // prompt tokens evaluated
    uint64_t generated_tokens = 0;    // tokens sampled (end-of-generation tokens not counted)
    uint64_t steps = 0;               // eval_batch calls
    double engine_seconds = 0.0;      // wall time inside eval_batch
    int64_t queue_length = 0;         // requests waiting for a slot now
    int64_t slots_busy = 0;           // slots holding a request now
    int64_t slots_total = 0;
    LatencyHistogram ttft;           // request queued -> first token sampled
    LatencyHistogram inter_token;    // between two tokens of a request
    SchedulerMetrics();
};

/// Settings of the scheduler (the engine's n_seq and n_ctx are the slot count and the context per slot).
struct SchedulerParams {
    int64_t max_queue = 64;  // requests waiting for a slot at most (beyond the free slots); submit() refuses more
    int64_t n_batch = 512;   // tokens per step, all slots together (the engine's ContextParams::n_batch)
};

/// Runs requests on `engine`'s sequences. step() is one scheduling step on the calling thread; start() runs
/// steps on an engine thread of its own until destruction (the only thread that touches the engine then).
class BatchScheduler {
  public:
    /// engine and tokenizer must outlive the scheduler. engine.n_seq() slots of engine.n_ctx() tokens each.
    BatchScheduler(Engine &engine, const Tokenizer &tokenizer, SchedulerParams params = {});
    /// stop().
    ~BatchScheduler();
    BatchScheduler(const BatchScheduler &) = delete;
    BatchScheduler &operator=(const BatchScheduler &) = delete;

    /// Queues a request; nullptr when max_queue requests are already waiting for a slot, not counting those the
    /// free slots take at the next step (the server answers 503; max_queue 0: only when no slot is free). Throws
    /// prescope::Error when the request can never run: empty prompt, a token outside the vocabulary, prompt
    /// not shorter than the slot's context, or prompt + max_tokens beyond it. Thread-safe.
    std::shared_ptr<RequestHandle> submit(GenerationRequest request);

    /// One step: drops cancelled requests, admits queued ones into free slots (first come, first served), then
    /// one eval_batch of every decoding slot's token and prefill chunks filling the rest of n_batch (at least one
    /// prompt token per step, so a prefill always advances), then samples each slot whose logits came back.
    /// Returns false when there was nothing to do. Only without start(), or on the engine thread.
    bool step();
    /// Starts the engine thread (steps while there is work, sleeps otherwise).
    void start();
    /// Stops the engine thread after its current step; requests still queued or running get a done event with
    /// FinishReason::error ("the server is shutting down"). Later steps and submissions do nothing. Thread-safe.
    void stop();

    int64_t n_slots() const { return n_slots_; }
    /// Context per slot in tokens (prompt + generated tokens of one request).
    int64_t slot_ctx() const { return slot_ctx_; }
    SchedulerMetrics metrics() const;
    /// The engine's stats_json(), read between two steps on the engine thread (the engine is not thread-safe);
    /// the last one read when the engine thread does not answer within `wait` (a long prefill step).
    nlohmann::json engine_stats(std::chrono::milliseconds wait = std::chrono::milliseconds(2000));

  private:
    struct Pending {
        std::shared_ptr<RequestHandle> handle;
        GenerationRequest request;
        std::chrono::steady_clock::time_point queued;
    };
    struct Slot;
    friend class RequestHandle;

    void wake();
    void loop();
    void admit();
    void drop_cancelled();
    void on_logits(Slot &slot, const float *row, int64_t row_size, std::chrono::steady_clock::time_point now);
    void finish(Slot &slot, FinishReason reason, std::string error = {});
    void refresh_stats_if_asked();

    Engine &engine_;
    Tokenizer tokenizer_;
    SchedulerParams params_;
    int64_t n_slots_ = 0, slot_ctx_ = 0, n_batch_ = 0;
    std::vector<Slot> slots_;
    std::vector<int32_t> eog_;  // end-of-generation token ids (ignore_eos masks them)
    std::vector<float> masked_;  // [n_vocab] a logits row with eog_ at -inf
    uint64_t admissions_ = 0;  // admission order of the slots, for first-come prefill

    mutable std::mutex mutex_;  // guards queue_, stop_, metrics_, stats_*
    std::condition_variable cv_;
    std::deque<Pending> queue_;
    bool stop_ = false;
    SchedulerMetrics metrics_;
    bool stats_wanted_ = false;
    uint64_t stats_version_ = 0;
    nlohmann::json stats_;
    std::condition_variable stats_cv_;
    std::thread thread_;
};

/// Stop-string matching over streamed text: push() takes each new piece of text and returns what may be sent
/// now, holding back a tail that could still become the start of a stop string (llama-server's partial stop
/// match), so a stop string is never sent, not even in part. Text and stop strings are UTF-8; what is held back
/// starts at a character boundary, so what is returned stays valid UTF-8.
class StopScanner {
  public:
    explicit StopScanner(std::vector<std::string> stop) : stop_(std::move(stop)) {}
    /// The text that can be sent after `piece`; stopped() tells whether a stop string was found (the text up to
    /// it is returned, nothing after it is ever returned).
    std::string push(std::string_view piece);
    /// The held-back tail at the end of generation (it matched no stop string).
    std::string flush();
    bool stopped() const { return stopped_; }

  private:
    std::vector<std::string> stop_;
    std::string held_;
    bool stopped_ = false;
};

} // namespace prescope
