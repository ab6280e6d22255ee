// A host-memory implementation of the backend boundary (backend/backend.h) for tests and the simulator:
// "device" memory is host memory, copies are memcpy, and the test decides when queued copies run.
#pragma once

#include "backend/backend.h"

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace prescope {

/// Follows the CUDA ordering rules of backend.h exactly (in-order streams, event capture at record time,
/// waits on never-recorded events do not block), so the copy engine's use of them is tested for real.
/// Event timestamps come from a virtual clock that each copy advances by n_bytes / link_bytes_per_s,
/// which makes achieved-bandwidth figures exact and independent of this machine's speed.
class FakeBackend final : public Backend {
  public:
    enum class Mode {
        IMMEDIATE,  // copies run inside copy_*_async, on the calling thread
        MANUAL,     // copies wait until the test calls run_copies()/run_all()
        THREADED,   // a worker thread runs copies as they become ready (optionally sleeping for link time)
    };
    struct Config {
        Mode mode = Mode::IMMEDIATE;
        uint64_t device_bytes = uint64_t(1) << 30;  // capacity reported by memory_info(), bytes
        double link_bytes_per_s = 25e9;             // virtual link speed for event timestamps, bytes/s (> 0)
        bool sleep_for_link = false;                // THREADED: really sleep n_bytes / link_bytes_per_s per copy
        bool allow_host_register = true;            // host_register() result
    };
    /// One copy as issued (copy_log) or executed (completion_log).
    struct CopyRecord {
        void *dst = nullptr;
        const void *src = nullptr;
        size_t n_bytes = 0;
        int stream_id = 0;  // order of stream_create(), from 0
    };

    FakeBackend() : FakeBackend(Config{}) {}
    explicit FakeBackend(const Config &config);
    ~FakeBackend() override;

    std::string name() const override { return "fake"; }
    void *alloc(MemoryKind kind, size_t n_bytes) override;
    void free(MemoryKind kind, void *ptr) override;
    bool host_register(const void *ptr, size_t n_bytes) override;
    void host_unregister(const void *ptr) override;
    MemoryInfo memory_info() override;
    Stream stream_create() override;
    void stream_destroy(Stream stream) override;
    Event event_create() override;
    void event_destroy(Event event) override;
    void copy_h2d_async(void *dst, const void *src, size_t n_bytes, Stream stream) override;
    void copy_d2h_async(void *dst, const void *src, size_t n_bytes, Stream stream) override;
    void event_record(Event event, Stream stream) override;
    void stream_wait_event(Stream stream, Event event) override;
    bool event_query(Event event) override;
    void event_synchronize(Event event) override;
    void stream_synchronize(Stream stream) override;
    double event_elapsed_us(Event start, Event end) override;

    // --- test controls ---------------------------------------------------------------------------------------
    /// MANUAL: runs up to n ready copies (stream heads, lowest stream id first) and everything they unblock.
    /// Returns how many copies ran.
    int run_copies(int n);
    /// MANUAL: runs every copy that can run.
    int run_all() { return run_copies(1 << 30); }
    /// Blocks until at least n copies have been issued in total; false after `timeout` (a hang guard for
    /// tests, not a timing check).
    bool wait_copies_issued(size_t n, std::chrono::milliseconds timeout = std::chrono::seconds(30));
    size_t copies_issued() const;
    /// Copies issued but not yet run, now and at most ever.
    size_t copies_pending() const;
    size_t max_copies_pending() const;
    std::vector<CopyRecord> copy_log() const;
    std::vector<CopyRecord> completion_log() const;
    bool is_host_registered(const void *ptr) const;
    /// Virtual device time, microseconds (sum of the link times of the copies run so far).
    double virtual_time_us() const;

  private:
    struct FakeEvent {
        uint64_t records_issued = 0;  // event_record calls so far
        uint64_t records_done = 0;    // highest capture completed
        double time_us = 0;           // virtual time of the last completed capture
    };
    struct Op {
        enum Kind { COPY, RECORD, WAIT } kind = COPY;
        void *dst = nullptr;
        const void *src = nullptr;
        size_t n_bytes = 0;
        FakeEvent *event = nullptr;
        uint64_t target = 0;  // RECORD: capture number; WAIT: capture waited for
    };
    struct FakeStream {
        int id = 0;
        std::deque<Op> ops;
        bool running = false;  // THREADED: the worker is executing the head copy outside the lock
    };

    void enqueue(FakeStream *s, Op op);
    void enqueue_copy(void *dst, const void *src, size_t n_bytes, Stream stream);
    // Runs RECORD/WAIT heads that are ready (and COPY heads when run_copies_too); returns copies run.
    int settle(bool run_copies_too, int max_copies);
    bool op_ready(const Op &op) const;
    void run_copy_locked(FakeStream *s);
    bool event_done(const FakeEvent *e) const { return e->records_done >= e->records_issued; }
    void worker();

    Config config_;
    mutable std::mutex mutex_;
    std::condition_variable changed_;
    std::vector<std::unique_ptr<FakeStream>> streams_;
    std::vector<std::unique_ptr<FakeEvent>> events_;
    std::unordered_map<void *, size_t> device_allocs_;
    std::unordered_map<const void *, size_t> registered_;
    uint64_t device_used_ = 0;
    double virtual_time_us_ = 0;
    size_t copies_issued_ = 0;
    size_t copies_pending_ = 0;
    size_t max_copies_pending_ = 0;
    std::vector<CopyRecord> copy_log_;
    std::vector<CopyRecord> completion_log_;
    bool stop_ = false;
    std::thread worker_;
};

} // namespace prescope
