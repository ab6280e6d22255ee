// FakeBackend: host-memory streams and events with CUDA's ordering rules, driven by the test.
#include "offload/fake-backend.h"

#include "core/error.h"
#include "core/memory.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace prescope {

namespace {
constexpr size_t kAlignment = 256;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
} // namespace

FakeBackend::FakeBackend(const Config &config) : config_(config) {
    PRESCOPE_ASSERT(config_.link_bytes_per_s > 0);
    if (config_.mode == Mode::THREADED) worker_ = std::thread([this] { worker(); });
}

FakeBackend::~FakeBackend() {
    {
        std::lock_guard lock(mutex_);
        stop_ = true;
    }
    changed_.notify_all();
    if (worker_.joinable()) worker_.join();
    for (auto &[ptr, n] : device_allocs_) std::free(ptr);
}

// --- memory ---------------------------------------------------------------------------------------------------

void *FakeBackend::alloc(MemoryKind kind, size_t n_bytes) {
    PRESCOPE_ASSERT(n_bytes > 0);
    std::lock_guard lock(mutex_);
    if (allocation_failure_due()) {
        fail("fake device: out of memory allocating {} bytes of {} memory (allocation failure injected by a test)",
             n_bytes, kind == MemoryKind::DEVICE ? "device" : "pinned host");
    }
    if (kind == MemoryKind::DEVICE && device_used_ + n_bytes > config_.device_bytes) {
        fail("fake device: out of memory allocating {} bytes ({} of {} bytes free)", n_bytes,
             config_.device_bytes - device_used_, config_.device_bytes);
    }
    void *ptr = std::aligned_alloc(kAlignment, round_up(n_bytes, kAlignment));
    if (!ptr) fail("fake device: host allocation of {} bytes failed", n_bytes);
    if (kind == MemoryKind::DEVICE) {
        device_allocs_[ptr] = n_bytes;
        device_used_ += n_bytes;
    }
    return ptr;
}

void FakeBackend::free(MemoryKind kind, void *ptr) {
    if (!ptr) return;
    std::lock_guard lock(mutex_);
    if (kind == MemoryKind::DEVICE) {
        auto it = device_allocs_.find(ptr);
        PRESCOPE_ASSERT(it != device_allocs_.end());
        device_used_ -= it->second;
        device_allocs_.erase(it);
    }
    std::free(ptr);
}

bool FakeBackend::host_register(const void *ptr, size_t n_bytes) {
    std::lock_guard lock(mutex_);
    if (!config_.allow_host_register) return false;
    registered_[ptr] = n_bytes;
    return true;
}

void FakeBackend::host_unregister(const void *ptr) {
    std::lock_guard lock(mutex_);
    registered_.erase(ptr);
}

MemoryInfo FakeBackend::memory_info() {
    std::lock_guard lock(mutex_);
    return {config_.device_bytes - device_used_, config_.device_bytes};
}

// --- streams and events ---------------------------------------------------------------------------------------

Stream FakeBackend::stream_create() {
    std::lock_guard lock(mutex_);
    auto s = std::make_unique<FakeStream>();
    s->id = streams_.empty() ? 0 : streams_.back()->id + 1;
    streams_.push_back(std::move(s));
    return reinterpret_cast<Stream>(streams_.back().get());
}

void FakeBackend::stream_destroy(Stream stream) {
    std::lock_guard lock(mutex_);
    auto it = std::find_if(streams_.begin(), streams_.end(),
                           [&](const auto &s) { return reinterpret_cast<Stream>(s.get()) == stream; });
    PRESCOPE_ASSERT(it != streams_.end());
    PRESCOPE_ASSERT((*it)->ops.empty());  // destroying a busy stream is a bug of the caller
    streams_.erase(it);
}

Event FakeBackend::event_create() {
    std::lock_guard lock(mutex_);
    events_.push_back(std::make_unique<FakeEvent>());
    return reinterpret_cast<Event>(events_.back().get());
}

void FakeBackend::event_destroy(Event event) {
    std::lock_guard lock(mutex_);
    auto it = std::find_if(events_.begin(), events_.end(),
                           [&](const auto &e) { return reinterpret_cast<Event>(e.get()) == event; });
    PRESCOPE_ASSERT(it != events_.end());
    events_.erase(it);
}

// --- asynchronous work ----------------------------------------------------------------------------------------

void FakeBackend::enqueue(FakeStream *s, Op op) {
    s->ops.push_back(op);
    if (op.kind == Op::COPY) {
        ++copies_issued_;
        ++copies_pending_;
        max_copies_pending_ = std::max(max_copies_pending_, copies_pending_);
        copy_log_.push_back({op.dst, op.src, op.n_bytes, s->id});
    }
    settle(config_.mode == Mode::IMMEDIATE, 1 << 30);
    changed_.notify_all();
}

void FakeBackend::enqueue_copy(void *dst, const void *src, size_t n_bytes, Stream stream) {
    PRESCOPE_ASSERT(dst && src && n_bytes > 0);
    std::lock_guard lock(mutex_);
    Op op;
    op.kind = Op::COPY;
    op.dst = dst;
    op.src = src;
    op.n_bytes = n_bytes;
    enqueue(reinterpret_cast<FakeStream *>(stream), op);
}

void FakeBackend::copy_h2d_async(void *dst, const void *src, size_t n_bytes, Stream stream) {
    enqueue_copy(dst, src, n_bytes, stream);
}

void FakeBackend::copy_d2h_async(void *dst, const void *src, size_t n_bytes, Stream stream) {
    enqueue_copy(dst, src, n_bytes, stream);
}

void FakeBackend::event_record(Event event, Stream stream) {
    std::lock_guard lock(mutex_);
    auto *e = reinterpret_cast<FakeEvent *>(event);
    Op op;
    op.kind = Op::RECORD;
    op.event = e;
    op.target = ++e->records_issued;
    enqueue(reinterpret_cast<FakeStream *>(stream), op);
}

void FakeBackend::stream_wait_event(Stream stream, Event event) {
    std::lock_guard lock(mutex_);
    auto *e = reinterpret_cast<FakeEvent *>(event);
    Op op;
    op.kind = Op::WAIT;
    op.event = e;
    op.target = e->records_issued;  // the capture current at the time of the call, as in CUDA
    enqueue(reinterpret_cast<FakeStream *>(stream), op);
}

bool FakeBackend::event_query(Event event) {
    std::lock_guard lock(mutex_);
    return event_done(reinterpret_cast<FakeEvent *>(event));
}

void FakeBackend::event_synchronize(Event event) {
    std::unique_lock lock(mutex_);
    auto *e = reinterpret_cast<FakeEvent *>(event);
    // In IMMEDIATE mode everything runnable has run, so an incomplete event here can never complete.
    PRESCOPE_ASSERT(config_.mode != Mode::IMMEDIATE || event_done(e));
    bool done = changed_.wait_for(lock, std::chrono::seconds(60), [&] { return event_done(e); });
    PRESCOPE_ASSERT(done && "fake backend: event never completed (MANUAL mode: did the test run the copies?)");
}

void FakeBackend::stream_synchronize(Stream stream) {
    std::unique_lock lock(mutex_);
    auto *s = reinterpret_cast<FakeStream *>(stream);
    PRESCOPE_ASSERT(config_.mode != Mode::IMMEDIATE || s->ops.empty());
    bool done = changed_.wait_for(lock, std::chrono::seconds(60), [&] { return s->ops.empty(); });
    PRESCOPE_ASSERT(done && "fake backend: stream never drained (MANUAL mode: did the test run the copies?)");
}

double FakeBackend::event_elapsed_us(Event start, Event end) {
    std::lock_guard lock(mutex_);
    auto *a = reinterpret_cast<FakeEvent *>(start);
    auto *b = reinterpret_cast<FakeEvent *>(end);
    if (a->records_done == 0 || b->records_done == 0 || !event_done(a) || !event_done(b)) return -1.0;
    return b->time_us - a->time_us;
}

// --- execution ------------------------------------------------------------------------------------------------

bool FakeBackend::op_ready(const Op &op) const {
    return op.kind != Op::WAIT || op.event->records_done >= op.target;
}

void FakeBackend::run_copy_locked(FakeStream *s) {
    const Op &op = s->ops.front();
    std::memcpy(op.dst, op.src, op.n_bytes);
    virtual_time_us_ += double(op.n_bytes) / config_.link_bytes_per_s * 1e6;
    completion_log_.push_back({op.dst, op.src, op.n_bytes, s->id});
    --copies_pending_;
    s->ops.pop_front();
}

int FakeBackend::settle(bool run_copies_too, int max_copies) {
    int copies = 0;
    bool progress = true;
    while (progress) {
        progress = false;
        for (auto &sp : streams_) {
            FakeStream *s = sp.get();
            while (!s->ops.empty() && !s->running && op_ready(s->ops.front())) {
                Op &op = s->ops.front();
                if (op.kind == Op::COPY) {
                    if (!run_copies_too || copies >= max_copies) break;
                    run_copy_locked(s);
                    ++copies;
                } else {
                    if (op.kind == Op::RECORD) {
                        op.event->records_done = std::max(op.event->records_done, op.target);
                        op.event->time_us = virtual_time_us_;
                    }
                    s->ops.pop_front();
                }
                progress = true;
            }
        }
    }
    return copies;
}

int FakeBackend::run_copies(int n) {
    PRESCOPE_ASSERT(config_.mode == Mode::MANUAL);
    int ran;
    {
        std::lock_guard lock(mutex_);
        ran = settle(true, n);
    }
    changed_.notify_all();
    return ran;
}

void FakeBackend::worker() {
    std::unique_lock lock(mutex_);
    while (true) {
        FakeStream *ready = nullptr;
        changed_.wait(lock, [&] {
            if (stop_) return true;
            for (auto &sp : streams_) {
                if (!sp->ops.empty() && sp->ops.front().kind == Op::COPY) {
                    ready = sp.get();
                    return true;
                }
            }
            return false;
        });
        if (stop_) return;
        if (config_.sleep_for_link) {
            // Sleep outside the lock so that issuing threads are not held up; `running` keeps the head.
            ready->running = true;
            auto link_time = std::chrono::duration<double>(double(ready->ops.front().n_bytes) /
                                                           config_.link_bytes_per_s);
            lock.unlock();
            std::this_thread::sleep_for(link_time);
            lock.lock();
            ready->running = false;
        }
        run_copy_locked(ready);
        settle(false, 0);
        changed_.notify_all();
    }
}

// --- observation ----------------------------------------------------------------------------------------------

bool FakeBackend::wait_copies_issued(size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return copies_issued_ >= n; });
}

size_t FakeBackend::copies_issued() const {
    std::lock_guard lock(mutex_);
    return copies_issued_;
}

size_t FakeBackend::copies_pending() const {
    std::lock_guard lock(mutex_);
    return copies_pending_;
}

size_t FakeBackend::max_copies_pending() const {
    std::lock_guard lock(mutex_);
    return max_copies_pending_;
}

std::vector<FakeBackend::CopyRecord> FakeBackend::copy_log() const {
    std::lock_guard lock(mutex_);
    return copy_log_;
}

std::vector<FakeBackend::CopyRecord> FakeBackend::completion_log() const {
    std::lock_guard lock(mutex_);
    return completion_log_;
}

bool FakeBackend::is_host_registered(const void *ptr) const {
    std::lock_guard lock(mutex_);
    return registered_.count(ptr) != 0;
}

double FakeBackend::virtual_time_us() const {
    std::lock_guard lock(mutex_);
    return virtual_time_us_;
}

} // namespace prescope
