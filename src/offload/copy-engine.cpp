// CopyQueue (issue order, chunking, cancellation, depth and bandwidth limits) and CopyEngine (its thread).
#include "offload/copy-engine.h"

#include "core/error.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

namespace prescope {

const char *ticket_state_name(TicketState s) {
    switch (s) {
    case TicketState::QUEUED: return "queued";
    case TicketState::ISSUING: return "issuing";
    case TicketState::IN_FLIGHT: return "in-flight";
    case TicketState::DONE: return "done";
    case TicketState::CANCELLED: return "cancelled";
    case TicketState::RETIRED: return "retired";
    }
    return "?";
}

// ==============================================================================================================
// CopyQueue
// ==============================================================================================================

CopyQueue::CopyQueue(const CopyEngineConfig &config) : config_(config) {
    if (config_.chunk_bytes == 0) fail("copy engine: chunk size must be > 0 bytes");
    if (config_.queue_depth < 1) fail("copy engine: queue depth must be >= 1, got {}", config_.queue_depth);
    if (config_.max_requests < 1) fail("copy engine: max_requests must be >= 1, got {}", config_.max_requests);
    if (config_.bandwidth_cap_bytes_per_s < 0) {
        fail("copy engine: bandwidth cap must be >= 0 bytes/s, got {}", config_.bandwidth_cap_bytes_per_s);
    }
    records_.resize(size_t(config_.max_requests));
    free_.resize(records_.size());
    for (size_t i = 0; i < free_.size(); ++i) free_[i] = uint32_t(i);
    free_count_ = free_.size();
    ring_.resize(size_t(config_.queue_depth));
}

CopyQueue::Record *CopyQueue::lookup(Ticket ticket) {
    if (!ticket.valid() || ticket.index >= records_.size()) return nullptr;
    Record &r = records_[ticket.index];
    return r.generation == ticket.generation ? &r : nullptr;
}

const CopyQueue::Record *CopyQueue::lookup(Ticket ticket) const {
    return const_cast<CopyQueue *>(this)->lookup(ticket);
}

void CopyQueue::link(uint32_t index) {
    Record &r = records_[index];
    List &l = list_of(r);
    r.prev = l.tail;
    r.next = -1;
    if (l.tail >= 0) records_[size_t(l.tail)].next = int32_t(index);
    else l.head = int32_t(index);
    l.tail = int32_t(index);
    r.queued = true;
}

void CopyQueue::unlink(uint32_t index) {
    Record &r = records_[index];
    PRESCOPE_ASSERT(r.queued);
    List &l = list_of(r);
    if (r.prev >= 0) records_[size_t(r.prev)].next = r.next;
    else l.head = r.next;
    if (r.next >= 0) records_[size_t(r.next)].prev = r.prev;
    else l.tail = r.prev;
    r.prev = r.next = -1;
    r.queued = false;
}

void CopyQueue::queued_bytes(const Record &r, int64_t delta) {
    uint64_t &b = r.request.priority == CopyPriority::DEMAND ? backlog_.demand_bytes : backlog_.prefetch_bytes;
    b = uint64_t(int64_t(b) + delta);
}

void CopyQueue::release(uint32_t index) {
    PRESCOPE_ASSERT(free_count_ < free_.size());
    free_[(free_head_ + free_count_) % free_.size()] = index;
    ++free_count_;
}

Ticket CopyQueue::push(const CopyRequest &request) {
    PRESCOPE_ASSERT(request.dst && request.src && request.n_bytes > 0);
    if (free_count_ == 0) {
        fail("copy engine: {} copy requests are outstanding, the limit (max_requests) is {}", records_.size(),
             records_.size());
    }
    uint32_t index = free_[free_head_];
    free_head_ = (free_head_ + 1) % free_.size();
    --free_count_;
    Record &r = records_[index];
    r.request = request;
    ++r.generation;
    r.state = TicketState::QUEUED;
    r.issued_bytes = 0;
    r.chunks_in_flight = 0;
    link(index);
    ++stats_.requests_submitted;
    queued_bytes(r, int64_t(request.n_bytes));
    if (request.priority == CopyPriority::PREFETCH) ++backlog_.prefetch_requests;
    return {index, r.generation};
}

bool CopyQueue::cancel(Ticket ticket) {
    Record *r = lookup(ticket);
    if (!r || !r->queued) return false;
    queued_bytes(*r, -int64_t(r->request.n_bytes - r->issued_bytes));
    if (r->request.priority == CopyPriority::PREFETCH) --backlog_.prefetch_requests;
    unlink(ticket.index);
    r->state = TicketState::CANCELLED;
    ++stats_.requests_cancelled;
    if (r->chunks_in_flight == 0) release(ticket.index);
    return true;
}

bool CopyQueue::promote(Ticket ticket) {
    Record *r = lookup(ticket);
    if (!r || !r->queued || r->request.priority != CopyPriority::PREFETCH) return false;
    queued_bytes(*r, -int64_t(r->request.n_bytes - r->issued_bytes));
    --backlog_.prefetch_requests;
    unlink(ticket.index);
    r->request.priority = CopyPriority::DEMAND;
    link(ticket.index);
    queued_bytes(*r, int64_t(r->request.n_bytes - r->issued_bytes));
    ++stats_.requests_promoted;
    return true;
}

int CopyQueue::cancel_all() {
    int n = 0;
    for (List *l : {&demand_, &prefetch_}) {
        while (l->head >= 0) {
            uint32_t index = uint32_t(l->head);
            n += cancel({index, records_[index].generation}) ? 1 : 0;
        }
    }
    return n;
}

TicketState CopyQueue::state(Ticket ticket) const {
    const Record *r = lookup(ticket);
    return r ? r->state : TicketState::RETIRED;
}

bool CopyQueue::next_chunk(int64_t now_ns, CopyChunk *out, int64_t *retry_at_ns) {
    *retry_at_ns = -1;
    if (in_flight_count_ == config_.queue_depth) return false;
    int32_t head = demand_.head >= 0 ? demand_.head : prefetch_.head;
    if (head < 0) return false;
    if (config_.bandwidth_cap_bytes_per_s > 0 && now_ns < next_issue_ns_) {
        *retry_at_ns = next_issue_ns_;
        return false;
    }
    uint32_t index = uint32_t(head);
    Record &r = records_[index];
    CopyChunk c;
    c.request = index;
    c.offset = r.issued_bytes;
    c.n_bytes = std::min(config_.chunk_bytes, r.request.n_bytes - c.offset);
    c.dst = static_cast<uint8_t *>(r.request.dst) + c.offset;
    c.src = static_cast<const uint8_t *>(r.request.src) + c.offset;
    c.first = c.offset == 0;
    c.last = c.offset + c.n_bytes == r.request.n_bytes;
    c.priority = r.request.priority;
    c.after = c.first ? r.request.after : nullptr;
    c.ring = (ring_head_ + in_flight_count_) % config_.queue_depth;

    queued_bytes(r, -int64_t(c.n_bytes));
    if (c.last && r.request.priority == CopyPriority::PREFETCH) --backlog_.prefetch_requests;
    backlog_.in_flight_bytes += c.n_bytes;
    r.issued_bytes += c.n_bytes;
    r.state = TicketState::ISSUING;
    ++r.chunks_in_flight;
    if (c.last) unlink(index);
    ring_[size_t(c.ring)] = c;
    ++in_flight_count_;
    if (config_.bandwidth_cap_bytes_per_s > 0) {
        // Token bucket without burst: idle time earns no credit, so the average never exceeds the cap.
        next_issue_ns_ = std::max(next_issue_ns_, now_ns) +
                         int64_t(double(c.n_bytes) * 1e9 / config_.bandwidth_cap_bytes_per_s);
    }
    *out = c;
    return true;
}

void CopyQueue::chunk_issued(const CopyChunk &chunk) {
    Record &r = records_[chunk.request];
    if (chunk.last && r.state == TicketState::ISSUING) r.state = TicketState::IN_FLIGHT;
}

const CopyChunk &CopyQueue::oldest_in_flight() const {
    PRESCOPE_ASSERT(in_flight_count_ > 0);
    return ring_[size_t(ring_head_)];
}

bool CopyQueue::retire_oldest() {
    const CopyChunk c = oldest_in_flight();
    ring_head_ = (ring_head_ + 1) % config_.queue_depth;
    --in_flight_count_;
    ++stats_.chunks_done;
    stats_.bytes_done += c.n_bytes;
    backlog_.in_flight_bytes -= c.n_bytes;
    (c.priority == CopyPriority::DEMAND ? stats_.bytes_demand : stats_.bytes_prefetch) += c.n_bytes;

    Record &r = records_[c.request];
    --r.chunks_in_flight;
    if (r.state == TicketState::CANCELLED) {
        if (r.chunks_in_flight == 0) release(c.request);
        return false;
    }
    if (!c.last) return false;
    PRESCOPE_ASSERT(r.state == TicketState::IN_FLIGHT && r.chunks_in_flight == 0);
    r.state = TicketState::DONE;
    ++stats_.requests_done;
    release(c.request);
    return true;
}

// ==============================================================================================================
// CopyEngine
// ==============================================================================================================

CopyEngine::CopyEngine(Backend &backend, const CopyEngineConfig &config) : backend_(backend), queue_(config) {
    stream_ = backend_.stream_create();
    request_events_.resize(size_t(config.max_requests));
    for (Event &e : request_events_) e = backend_.event_create();
    chunk_events_.resize(size_t(config.queue_depth));
    for (Event &e : chunk_events_) e = backend_.event_create();
    busy_start_ = backend_.event_create();
    thread_ = std::thread([this] { run(); });
}

CopyEngine::~CopyEngine() {
    {
        std::lock_guard lock(mutex_);
        stop_ = true;
        queue_.cancel_all();
    }
    wake_.notify_all();
    thread_.join();
    for (Event e : request_events_) backend_.event_destroy(e);
    for (Event e : chunk_events_) backend_.event_destroy(e);
    backend_.event_destroy(busy_start_);
    backend_.stream_destroy(stream_);
}

int64_t CopyEngine::now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

void CopyEngine::check_failed_locked() const {
    if (failure_) std::rethrow_exception(failure_);
}

Ticket CopyEngine::submit(const CopyRequest &request) {
    Ticket t;
    {
        std::lock_guard lock(mutex_);
        check_failed_locked();
        t = queue_.push(request);
    }
    wake_.notify_one();
    return t;
}

bool CopyEngine::cancel(Ticket ticket) {
    std::lock_guard lock(mutex_);
    return queue_.cancel(ticket);
}

bool CopyEngine::promote(Ticket ticket) {
    bool promoted;
    {
        std::lock_guard lock(mutex_);
        promoted = queue_.promote(ticket);
    }
    if (promoted) wake_.notify_one();
    return promoted;
}

TicketState CopyEngine::state(Ticket ticket) const {
    std::lock_guard lock(mutex_);
    return queue_.state(ticket);
}

double CopyEngine::stream_wait(Ticket ticket, Stream stream) {
    int64_t t0 = now_ns();
    std::unique_lock lock(mutex_);
    if (queue_.promote(ticket)) wake_.notify_one();
    progress_.wait(lock, [&] {
        TicketState s = queue_.state(ticket);
        return failure_ || (s != TicketState::QUEUED && s != TicketState::ISSUING);
    });
    check_failed_locked();
    TicketState s = queue_.state(ticket);
    PRESCOPE_ASSERT(s != TicketState::CANCELLED);
    // Under the lock the record cannot be recycled, so its event still belongs to this ticket.
    if (s == TicketState::IN_FLIGHT) backend_.stream_wait_event(stream, request_events_[ticket.index]);
    return double(now_ns() - t0) * 1e-3;
}

bool CopyEngine::wait_host(Ticket ticket) {
    std::unique_lock lock(mutex_);
    if (queue_.promote(ticket)) wake_.notify_one();
    progress_.wait(lock, [&] {
        TicketState s = queue_.state(ticket);
        return failure_ || s == TicketState::DONE || s == TicketState::CANCELLED || s == TicketState::RETIRED;
    });
    check_failed_locked();
    return queue_.state(ticket) != TicketState::CANCELLED;
}

void CopyEngine::drain() {
    std::unique_lock lock(mutex_);
    progress_.wait(lock, [&] { return failure_ || queue_.idle(); });
    check_failed_locked();
}

bool CopyEngine::idle() const {
    std::lock_guard lock(mutex_);
    return queue_.idle();
}

CopyBacklog CopyEngine::backlog() const {
    std::lock_guard lock(mutex_);
    return queue_.backlog();
}

CopyStats CopyEngine::stats() const {
    std::lock_guard lock(mutex_);
    CopyStats s = queue_.stats();
    s.busy_us = stats_extra_.busy_us;
    // A busy period still open counts up to now (host time): on a saturated link one period can last for many
    // layers, and the busy share and achieved speed read between them would see nothing, then all of it at once.
    // What was reported stays counted (retire_locked), so that the counter never goes down.
    if (queue_.in_flight() > 0) {
        open_reported_us_ = std::max(open_reported_us_, double(now_ns() - busy_start_host_ns_) * 1e-3);
        s.busy_us += open_reported_us_;
    }
    return s;
}

void CopyEngine::issue(const CopyChunk &chunk, bool opens_busy_period) {
    if (chunk.after) backend_.stream_wait_event(stream_, chunk.after);
    if (opens_busy_period) backend_.event_record(busy_start_, stream_);
    backend_.copy_h2d_async(chunk.dst, chunk.src, chunk.n_bytes, stream_);
    // The ticket's event goes before the chunk's, so a completed chunk event implies a completed ticket.
    if (chunk.last) backend_.event_record(request_events_[chunk.request], stream_);
    backend_.event_record(chunk_events_[size_t(chunk.ring)], stream_);
}

void CopyEngine::retire_locked() {
    Event done = chunk_events_[size_t(queue_.oldest_in_flight().ring)];
    queue_.retire_oldest();
    if (queue_.in_flight() == 0) {
        double us = backend_.event_elapsed_us(busy_start_, done);
        if (us < 0) us = double(now_ns() - busy_start_host_ns_) * 1e-3;
        stats_extra_.busy_us += std::max(us, open_reported_us_);  // stats() may have reported more already
        open_reported_us_ = 0;
    }
}

void CopyEngine::run() {
    std::unique_lock lock(mutex_);
    try {
        backend_.thread_init();
        while (true) {
            bool changed = false;
            while (queue_.in_flight() > 0 &&
                   backend_.event_query(chunk_events_[size_t(queue_.oldest_in_flight().ring)])) {
                retire_locked();
                changed = true;
            }
            if (changed) progress_.notify_all();

            CopyChunk chunk;
            int64_t retry_at = -1;
            if (!stop_ && queue_.next_chunk(now_ns(), &chunk, &retry_at)) {
                bool opens_busy = queue_.in_flight() == 1;
                if (opens_busy) busy_start_host_ns_ = now_ns();  // under the lock: stats() reads it
                // Issue outside the lock: submitters and waiters need not wait for the driver call.
                // Only this thread touches in-flight chunks and their events, so nothing can recycle them.
                lock.unlock();
                issue(chunk, opens_busy);
                lock.lock();
                queue_.chunk_issued(chunk);
                progress_.notify_all();
                continue;
            }
            if (queue_.in_flight() == queue_.config().queue_depth || (stop_ && queue_.in_flight() > 0)) {
                Event oldest = chunk_events_[size_t(queue_.oldest_in_flight().ring)];
                lock.unlock();
                backend_.event_synchronize(oldest);
                lock.lock();
            } else if (stop_) {
                break;
            } else if (retry_at >= 0) {
                wake_.wait_for(lock, std::chrono::nanoseconds(std::max<int64_t>(retry_at - now_ns(), 0)));
            } else if (queue_.in_flight() > 0) {
                wake_.wait_for(lock, std::chrono::microseconds(queue_.config().poll_us));
            } else {
                wake_.wait(lock, [&] { return stop_ || queue_.has_queued(); });
            }
        }
    } catch (...) {
        // The backend failed (driver error): callers get the error on their next call.
        if (!lock.owns_lock()) lock.lock();
        failure_ = std::current_exception();
        spdlog::error("copy engine: copy thread stopped on a backend error");
    }
    progress_.notify_all();
}

} // namespace prescope
