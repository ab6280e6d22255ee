// The AsyncIO copy engine: host-to-device expert copies on a dedicated thread and stream, split into
// chunks, demand before prefetch, cancellable, with a queue-depth and bandwidth limit (docs/style R5).
// CopyQueue holds all the policy and no threads, so tests drive it step by step with a fake clock;
// CopyEngine runs it against a Backend.
#pragma once

#include "backend/backend.h"

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace prescope {

enum class CopyPriority : uint8_t {
    DEMAND,    // compute is (or soon will be) waiting for it: issued before any prefetch chunk
    PREFETCH,  // speculative: issued when no demand chunk is queued; may be cancelled or promoted
};

/// One host-to-device copy.
struct CopyRequest {
    void *dst = nullptr;        // device bytes [n_bytes], owned by the caller (a cache slot)
    const void *src = nullptr;  // host bytes [n_bytes], pinned or registered for full speed; valid until done
    size_t n_bytes = 0;         // > 0
    CopyPriority priority = CopyPriority::DEMAND;
    Event after = nullptr;      // optional: the copy stream waits for this event (the last reader of dst)
                                // before writing dst; captured when the first chunk is issued
};

/// Names a request. Tickets are small values; a default ticket is invalid. Owned by the caller; the
/// engine recycles its record once the request has finished, after which the ticket reads RETIRED.
struct Ticket {
    uint32_t index = UINT32_MAX;
    uint32_t generation = 0;
    bool valid() const { return index != UINT32_MAX; }
    bool operator==(const Ticket &) const = default;
};

enum class TicketState : uint8_t {
    QUEUED,     // no chunk issued yet
    ISSUING,    // some chunks issued, others queued or being issued
    IN_FLIGHT,  // every chunk issued (compute can wait on the ticket's event), not yet complete
    DONE,       // bytes are in dst
    CANCELLED,  // dropped before all chunks were issued: dst holds a mix of old and new bytes
    RETIRED,    // finished (done or cancelled) and its record reused, or an invalid ticket
};
const char *ticket_state_name(TicketState s);

struct CopyEngineConfig {
    size_t chunk_bytes = size_t(4) << 20;  // bytes per chunk (> 0); 4 MiB reaches 96% of the H200 host's
                                           // PCIe peak (../shared/design/reference-numbers.md)
    int32_t queue_depth = 4;               // chunks in flight at most (>= 1): the bound on how long a new
                                           // demand request waits behind issued prefetch chunks
    double bandwidth_cap_bytes_per_s = 0;  // average issue rate limit, bytes/s; 0 = no cap
    int32_t max_requests = 4096;           // requests tracked at once (queued, in flight, just finished)
    int32_t poll_us = 20;                  // copy thread: completion poll interval when idle but busy, us
};

/// Counters; bytes and chunks count what went over the link (chunks of cancelled requests included).
struct CopyStats {
    uint64_t requests_submitted = 0;
    uint64_t requests_done = 0;
    uint64_t requests_cancelled = 0;
    uint64_t requests_promoted = 0;  // prefetches turned into demand requests
    uint64_t chunks_done = 0;
    uint64_t bytes_done = 0;
    uint64_t bytes_demand = 0;    // of bytes_done, issued at demand priority
    uint64_t bytes_prefetch = 0;  // of bytes_done, issued at prefetch priority
    double busy_us = 0;           // device time with at least one chunk in flight (event-timed when the
                                  // backend can time events, host-timed otherwise; a period still open
                                  // counts up to now, host-timed)
    /// bytes_done / busy time, in GB/s (1e9 bytes/s); 0 before anything completed.
    double achieved_gb_s() const { return busy_us > 0 ? double(bytes_done) / busy_us * 1e-3 : 0.0; }
};

/// Bytes waiting on the link, by what they wait for (the scheduler's view of the copies in flight).
struct CopyBacklog {
    uint64_t in_flight_bytes = 0;  // chunks handed to the driver, not yet complete
    uint64_t demand_bytes = 0;     // queued demand bytes not yet issued
    uint64_t prefetch_bytes = 0;   // queued prefetch bytes not yet issued
    int32_t prefetch_requests = 0; // prefetch requests not yet fully issued
};

/// One chunk of a request, as handed to the issuer.
struct CopyChunk {
    uint32_t request = 0;  // record index (Ticket::index)
    void *dst = nullptr;
    const void *src = nullptr;
    size_t offset = 0;  // bytes from the request's start
    size_t n_bytes = 0;
    bool first = false;
    bool last = false;
    CopyPriority priority = CopyPriority::DEMAND;
    Event after = nullptr;  // set on the first chunk only
    int32_t ring = 0;       // position in the in-flight ring [0, queue_depth): names the chunk's event
};

/// The request queue without threads or devices. Not thread-safe (CopyEngine guards it). Allocates only
/// in the constructor. Order of issue: demand requests FIFO, then prefetch requests FIFO, chunk by chunk,
/// so a demand request overtakes a prefetch at the next chunk boundary.
class CopyQueue {
  public:
    explicit CopyQueue(const CopyEngineConfig &config);

    /// Queues a request. Throws prescope::Error when max_requests records are in use.
    Ticket push(const CopyRequest &request);
    /// Drops the chunks of a request not yet issued. True if the request was queued or issuing (it will
    /// never complete); false if every chunk was already issued, or it finished. Issued chunks still land.
    bool cancel(Ticket ticket);
    /// Moves a queued prefetch to the back of the demand queue, keeping chunks already issued.
    /// False if it is not a prefetch still waiting for chunks.
    bool promote(Ticket ticket);
    /// Cancels every request not fully issued (shutdown). Returns how many.
    int cancel_all();
    TicketState state(Ticket ticket) const;

    /// The next chunk to issue at time now_ns (any monotonic clock, ns), or false when none may go now:
    /// nothing queued, queue_depth chunks in flight, or the bandwidth cap defers it (then *retry_at_ns is
    /// the earliest time it may go; otherwise it is set to -1). The chunk counts as in flight from here.
    bool next_chunk(int64_t now_ns, CopyChunk *out, int64_t *retry_at_ns);
    /// The issuer has queued the chunk's copy (and, for the last chunk, the ticket's event).
    void chunk_issued(const CopyChunk &chunk);
    /// The oldest chunk in flight completed (a single stream completes in issue order).
    /// Returns true if it finished its request (DONE).
    bool retire_oldest();

    int32_t in_flight() const { return in_flight_count_; }
    const CopyChunk &oldest_in_flight() const;
    bool has_queued() const { return demand_.head >= 0 || prefetch_.head >= 0; }
    bool idle() const { return !has_queued() && in_flight_count_ == 0; }
    const CopyBacklog &backlog() const { return backlog_; }
    const CopyStats &stats() const { return stats_; }
    const CopyEngineConfig &config() const { return config_; }

  private:
    struct Record {
        CopyRequest request;
        uint32_t generation = 0;
        TicketState state = TicketState::RETIRED;
        size_t issued_bytes = 0;      // bytes handed out as chunks so far
        int32_t chunks_in_flight = 0;
        bool queued = false;          // linked into demand_ or prefetch_
        int32_t prev = -1, next = -1; // list links (record indices)
    };
    struct List {
        int32_t head = -1, tail = -1;
    };

    Record *lookup(Ticket ticket);
    const Record *lookup(Ticket ticket) const;
    List &list_of(const Record &r) { return r.request.priority == CopyPriority::DEMAND ? demand_ : prefetch_; }
    void link(uint32_t index);
    void unlink(uint32_t index);
    void release(uint32_t index);
    void queued_bytes(const Record &r, int64_t delta);  // adds delta to the backlog of r's priority

    CopyEngineConfig config_;
    std::vector<Record> records_;  // [max_requests]
    std::vector<uint32_t> free_;   // ring of free record indices [max_requests], oldest freed first
    size_t free_head_ = 0, free_count_ = 0;
    List demand_, prefetch_;
    std::vector<CopyChunk> ring_;  // [queue_depth] chunks in flight, oldest at ring_head_
    int32_t ring_head_ = 0, in_flight_count_ = 0;
    int64_t next_issue_ns_ = INT64_MIN;  // bandwidth cap: earliest time of the next issue
    CopyStats stats_;
    CopyBacklog backlog_;
};

/// The copy engine: one copy thread, one backend stream, events per request and per in-flight chunk, all
/// created in the constructor. Thread-safe. Compute never calls a device-wide sync: it waits on a
/// ticket's event with stream_wait().
class CopyEngine {
  public:
    /// Creates the stream and events and starts the copy thread. `backend` must outlive the engine.
    CopyEngine(Backend &backend, const CopyEngineConfig &config = {});
    /// Cancels queued requests, waits for chunks in flight, stops the thread.
    ~CopyEngine();
    CopyEngine(const CopyEngine &) = delete;
    CopyEngine &operator=(const CopyEngine &) = delete;

    /// Queues a copy; returns at once. Throws prescope::Error if max_requests are outstanding, or if the
    /// copy thread has failed (the backend's error).
    Ticket submit(const CopyRequest &request);
    /// See CopyQueue::cancel. A cancelled ticket must not be waited on.
    bool cancel(Ticket ticket);
    /// See CopyQueue::promote.
    bool promote(Ticket ticket);
    TicketState state(Ticket ticket) const;

    /// Makes `stream` wait (on the device) until the ticket's bytes have landed. A queued prefetch is
    /// promoted to demand first. The host blocks only until the request's last chunk has been issued
    /// (a device wait on an event not yet recorded would not wait at all). Returns the microseconds the
    /// host blocked. PRECONDITION: the ticket was not cancelled.
    double stream_wait(Ticket ticket, Stream stream);
    /// Blocks the host until the request finished; true if done, false if it was cancelled. Promotes a
    /// queued prefetch. For tests, tools and shutdown, not for the decode path.
    bool wait_host(Ticket ticket);
    /// Blocks the host until nothing is queued or in flight.
    void drain();
    /// True when nothing is queued or in flight (completions are noticed within poll_us).
    bool idle() const;

    CopyStats stats() const;
    /// What waits on the link now (CopyQueue::backlog).
    CopyBacklog backlog() const;
    Stream stream() const { return stream_; }
    const CopyEngineConfig &config() const { return queue_.config(); }

  private:
    void run();
    void issue(const CopyChunk &chunk, bool opens_busy_period);
    void retire_locked();
    void check_failed_locked() const;
    static int64_t now_ns();

    Backend &backend_;
    Stream stream_ = nullptr;
    std::vector<Event> request_events_;  // [max_requests] recorded after a request's last chunk
    std::vector<Event> chunk_events_;    // [queue_depth] recorded after each chunk in flight
    Event busy_start_ = nullptr;         // recorded before the chunk that opens a busy period
    int64_t busy_start_host_ns_ = 0;     // host time the busy period opened (guarded by mutex_)
    mutable double open_reported_us_ = 0;  // the open period's busy time stats() has reported (guarded by mutex_)

    mutable std::mutex mutex_;
    std::condition_variable wake_;      // copy thread: new work, promotion, stop
    std::condition_variable progress_;  // callers: chunks issued, requests finished, failure
    CopyQueue queue_;
    CopyStats stats_extra_;  // busy_us (the rest lives in queue_.stats())
    bool stop_ = false;
    std::exception_ptr failure_;
    std::thread thread_;
};

} // namespace prescope
