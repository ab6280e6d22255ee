// Copy engine: the queue's policy step by step with a fake clock (CopyQueue), then the threaded engine
// against the fake backend (CopyEngine), and the fake backend's own CUDA-like ordering rules.
#include "core/error.h"
#include "offload/copy-engine.h"
#include "offload/fake-backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

using namespace prescope;

namespace {

constexpr size_t MiB = size_t(1) << 20;

// Distinct fake addresses for the queue tests (CopyQueue never dereferences them).
CopyRequest request(size_t n_bytes, CopyPriority priority, uintptr_t id) {
    CopyRequest r;
    r.dst = reinterpret_cast<void *>(id << 32);
    r.src = reinterpret_cast<const void *>((id << 32) | 0x8000'0000u);
    r.n_bytes = n_bytes;
    r.priority = priority;
    return r;
}

CopyEngineConfig queue_config(size_t chunk_bytes, int32_t depth) {
    CopyEngineConfig c;
    c.chunk_bytes = chunk_bytes;
    c.queue_depth = depth;
    return c;
}

// Issues one chunk at time `now` and marks it issued, as the engine does; returns its request index.
int64_t issue(CopyQueue &q, int64_t now = 0) {
    CopyChunk c;
    int64_t retry;
    if (!q.next_chunk(now, &c, &retry)) return -1;
    q.chunk_issued(c);
    return c.request;
}

// Runs a queue to the end: issue everything, retiring one chunk whenever the depth is full.
std::vector<uint32_t> issue_all(CopyQueue &q) {
    std::vector<uint32_t> order;
    while (!q.idle()) {
        int64_t r = issue(q);
        if (r >= 0) order.push_back(uint32_t(r));
        else q.retire_oldest();
    }
    return order;
}

} // namespace

// --- CopyQueue --------------------------------------------------------------------------------------------

TEST(CopyQueue, ChunkingSplitsExactly) {
    CopyQueue q(queue_config(4 * MiB, 8));
    CopyRequest r = request(9'400'000, CopyPriority::DEMAND, 1);
    q.push(r);
    std::vector<CopyChunk> chunks;
    CopyChunk c;
    int64_t retry;
    while (q.next_chunk(0, &c, &retry)) chunks.push_back(c);
    ASSERT_EQ(chunks.size(), 3u);
    size_t offset = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
        EXPECT_EQ(chunks[i].offset, offset);
        EXPECT_EQ(chunks[i].dst, static_cast<uint8_t *>(r.dst) + offset);
        EXPECT_EQ(chunks[i].src, static_cast<const uint8_t *>(r.src) + offset);
        EXPECT_EQ(chunks[i].first, i == 0);
        EXPECT_EQ(chunks[i].last, i == 2);
        offset += chunks[i].n_bytes;
    }
    EXPECT_EQ(chunks[0].n_bytes, 4 * MiB);
    EXPECT_EQ(chunks[1].n_bytes, 4 * MiB);
    EXPECT_EQ(chunks[2].n_bytes, 9'400'000 - 8 * MiB);
    EXPECT_EQ(offset, 9'400'000u);

    CopyQueue exact(queue_config(4 * MiB, 8));
    exact.push(request(8 * MiB, CopyPriority::DEMAND, 2));
    int n = 0;
    while (exact.next_chunk(0, &c, &retry)) ++n;
    EXPECT_EQ(n, 2);  // no empty tail chunk
}

TEST(CopyQueue, DemandRequestsOvertakeQueuedPrefetches) {
    CopyQueue q(queue_config(MiB, 1));
    Ticket p1 = q.push(request(2 * MiB, CopyPriority::PREFETCH, 1));
    Ticket p2 = q.push(request(MiB, CopyPriority::PREFETCH, 2));
    EXPECT_EQ(issue(q), p1.index);  // first half of p1 goes out
    Ticket d = q.push(request(MiB, CopyPriority::DEMAND, 3));
    q.retire_oldest();
    // At the next chunk boundary the demand goes first, then p1 resumes, then p2.
    EXPECT_EQ(issue_all(q), (std::vector<uint32_t>{d.index, p1.index, p2.index}));
    EXPECT_EQ(q.state(d), TicketState::DONE);
    EXPECT_EQ(q.state(p1), TicketState::DONE);
}

TEST(CopyQueue, CancelledPrefetchesNeverComplete) {
    CopyQueue q(queue_config(MiB, 1));
    Ticket p1 = q.push(request(MiB, CopyPriority::PREFETCH, 1));
    Ticket p2 = q.push(request(MiB, CopyPriority::PREFETCH, 2));
    Ticket p3 = q.push(request(3 * MiB, CopyPriority::PREFETCH, 3));
    EXPECT_EQ(issue(q), p1.index);
    EXPECT_FALSE(q.cancel(p1));  // fully issued: too late, it will land
    EXPECT_TRUE(q.cancel(p2));
    q.retire_oldest();
    EXPECT_EQ(issue(q), p3.index);  // one chunk of p3 issued, two still queued
    EXPECT_TRUE(q.cancel(p3));
    std::vector<uint32_t> rest = issue_all(q);
    EXPECT_TRUE(rest.empty());
    EXPECT_EQ(q.state(p1), TicketState::DONE);
    EXPECT_EQ(q.state(p2), TicketState::CANCELLED);
    EXPECT_EQ(q.state(p3), TicketState::CANCELLED);
    EXPECT_EQ(q.stats().requests_done, 1u);
    EXPECT_EQ(q.stats().requests_cancelled, 2u);
    EXPECT_EQ(q.stats().bytes_done, 2 * MiB);  // p1 and the chunk of p3 that was in flight
}

TEST(CopyQueue, PromotionMovesAPrefetchIntoTheDemandQueue) {
    CopyQueue q(queue_config(MiB, 4));
    Ticket p1 = q.push(request(MiB, CopyPriority::PREFETCH, 1));
    Ticket p2 = q.push(request(MiB, CopyPriority::PREFETCH, 2));
    EXPECT_TRUE(q.promote(p2));
    EXPECT_FALSE(q.promote(p2));  // already demand
    EXPECT_EQ(issue_all(q), (std::vector<uint32_t>{p2.index, p1.index}));
    EXPECT_EQ(q.stats().bytes_demand, MiB);
    EXPECT_EQ(q.stats().bytes_prefetch, MiB);
}

TEST(CopyQueue, QueueDepthIsRespected) {
    CopyQueue q(queue_config(MiB, 3));
    q.push(request(10 * MiB, CopyPriority::DEMAND, 1));
    for (int i = 0; i < 3; ++i) EXPECT_GE(issue(q), 0);
    CopyChunk c;
    int64_t retry;
    EXPECT_FALSE(q.next_chunk(0, &c, &retry));
    EXPECT_EQ(retry, -1);  // waiting for a completion, not for time
    EXPECT_EQ(q.in_flight(), 3);
    q.retire_oldest();
    EXPECT_GE(issue(q), 0);
    EXPECT_LT(issue(q), 0);
}

TEST(CopyQueue, BandwidthCapThrottlesIssue) {
    CopyEngineConfig cfg = queue_config(1'000'000, 8);
    cfg.bandwidth_cap_bytes_per_s = 1e9;  // 1 MB chunks at 1 GB/s: one per millisecond
    CopyQueue q(cfg);
    q.push(request(5'000'000, CopyPriority::DEMAND, 1));
    CopyChunk c;
    int64_t retry;
    std::vector<int64_t> issued_at;
    int64_t now = 0;
    while (issued_at.size() < 5) {
        if (q.next_chunk(now, &c, &retry)) {
            issued_at.push_back(now);
        } else {
            ASSERT_GT(retry, now);
            now = retry;
        }
    }
    EXPECT_EQ(issued_at, (std::vector<int64_t>{0, 1'000'000, 2'000'000, 3'000'000, 4'000'000}));

    CopyQueue free_running(queue_config(1'000'000, 8));
    free_running.push(request(5'000'000, CopyPriority::DEMAND, 1));
    int n = 0;
    while (free_running.next_chunk(0, &c, &retry)) ++n;
    EXPECT_EQ(n, 5);
}

TEST(CopyQueue, TooManyOutstandingRequestsFailLoudly) {
    CopyEngineConfig cfg = queue_config(MiB, 4);
    cfg.max_requests = 2;
    CopyQueue q(cfg);
    Ticket a = q.push(request(MiB, CopyPriority::DEMAND, 1));
    q.push(request(MiB, CopyPriority::DEMAND, 2));
    EXPECT_THROW(q.push(request(MiB, CopyPriority::DEMAND, 3)), Error);
    issue(q);
    q.retire_oldest();
    EXPECT_EQ(q.state(a), TicketState::DONE);
    Ticket c = q.push(request(MiB, CopyPriority::DEMAND, 3));  // a's record is free again
    EXPECT_EQ(c.index, a.index);
    EXPECT_EQ(q.state(a), TicketState::RETIRED);
    EXPECT_EQ(q.state(c), TicketState::QUEUED);
    EXPECT_EQ(q.state(Ticket{}), TicketState::RETIRED);
}

TEST(CopyQueue, CountersAddUp) {
    CopyQueue q(queue_config(MiB, 3));
    std::mt19937 rng(3);
    std::vector<std::pair<Ticket, size_t>> tickets;
    for (int i = 0; i < 300; ++i) {
        int action = int(rng() % 4);
        if (action == 0 && q.in_flight() > 0) {
            q.retire_oldest();
        } else if (action == 1 && !tickets.empty()) {
            q.cancel(tickets[rng() % tickets.size()].first);
        } else if (action == 2) {
            issue(q);
        } else {
            size_t n = 1 + rng() % (3 * MiB);
            auto prio = rng() % 2 ? CopyPriority::DEMAND : CopyPriority::PREFETCH;
            tickets.push_back({q.push(request(n, prio, uintptr_t(i + 1))), n});
        }
    }
    issue_all(q);
    const CopyStats &s = q.stats();
    EXPECT_EQ(s.requests_done + s.requests_cancelled, s.requests_submitted);
    EXPECT_EQ(s.bytes_done, s.bytes_demand + s.bytes_prefetch);
    uint64_t done_bytes = 0;
    for (auto &[t, n] : tickets) {
        if (q.state(t) == TicketState::DONE) done_bytes += n;
    }
    EXPECT_LE(done_bytes, s.bytes_done);  // plus chunks of cancelled requests that were in flight
    EXPECT_GT(s.requests_cancelled, 0u);
}

// --- FakeBackend ------------------------------------------------------------------------------------------

TEST(FakeBackend, EventsAndStreamWaitsFollowCudaOrdering) {
    FakeBackend::Config cfg;
    cfg.mode = FakeBackend::Mode::MANUAL;
    FakeBackend b(cfg);
    Stream copy = b.stream_create(), compute = b.stream_create();
    Event e = b.event_create(), never = b.event_create();
    EXPECT_TRUE(b.event_query(never));  // never recorded: complete
    std::vector<uint8_t> src(64, 7), dev(64, 0), back(64, 0);
    b.copy_h2d_async(dev.data(), src.data(), 64, copy);
    b.event_record(e, copy);
    b.stream_wait_event(compute, never);  // does not block
    b.stream_wait_event(compute, e);
    b.copy_d2h_async(back.data(), dev.data(), 64, compute);
    EXPECT_FALSE(b.event_query(e));
    EXPECT_EQ(b.copies_pending(), 2u);
    EXPECT_EQ(b.run_copies(1), 1);  // only the h2d can run: the d2h waits for e
    EXPECT_TRUE(b.event_query(e));
    EXPECT_EQ(b.completion_log().at(0).dst, dev.data());
    b.run_all();
    EXPECT_EQ(back, src);
}

TEST(FakeBackend, OutOfDeviceMemoryIsAnErrorWithTheNumbers) {
    FakeBackend::Config cfg;
    cfg.device_bytes = 4096;
    FakeBackend b(cfg);
    void *p = b.alloc(MemoryKind::DEVICE, 3000);
    try {
        b.alloc(MemoryKind::DEVICE, 2000);
        FAIL() << "expected an error";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("2000 bytes (1096 of 4096 bytes free)"), std::string::npos) << e.what();
    }
    b.free(MemoryKind::DEVICE, p);
    EXPECT_EQ(b.memory_info().free_bytes, 4096u);
}

// --- CopyEngine -------------------------------------------------------------------------------------------

namespace {

FakeBackend::Config fake(FakeBackend::Mode mode) {
    FakeBackend::Config c;
    c.mode = mode;
    return c;
}

// MANUAL mode: lets copies run until the engine has nothing left. Sleeps only to let the copy thread move.
void pump_until_idle(FakeBackend &b, CopyEngine &engine) {
    for (int i = 0; i < 200000 && !(engine.idle() && b.copies_pending() == 0); ++i) {
        b.run_all();
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    ASSERT_TRUE(engine.idle());
}

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
    std::vector<uint8_t> v(n);
    std::mt19937 rng(seed);
    for (auto &x : v) x = uint8_t(rng());
    return v;
}

} // namespace

TEST(CopyEngine, CopiedBytesArriveWholeAcrossChunks) {
    for (auto mode : {FakeBackend::Mode::IMMEDIATE, FakeBackend::Mode::THREADED}) {
        FakeBackend b(fake(mode));
        CopyEngineConfig cfg;
        cfg.chunk_bytes = 1000;  // odd chunk size: tails of every length
        CopyEngine engine(b, cfg);
        std::vector<std::vector<uint8_t>> src, dst;
        std::vector<Ticket> tickets;
        for (uint32_t i = 0; i < 20; ++i) {
            src.push_back(pattern(1 + i * 517, i));
            dst.emplace_back(src.back().size(), 0);
            tickets.push_back(engine.submit({dst.back().data(), src.back().data(), src.back().size(),
                                             i % 2 ? CopyPriority::DEMAND : CopyPriority::PREFETCH}));
        }
        for (Ticket t : tickets) EXPECT_TRUE(engine.wait_host(t));
        EXPECT_EQ(dst, src);
        EXPECT_EQ(engine.stats().requests_done, 20u);
    }
}

TEST(CopyEngine, DemandRequestOvertakesQueuedPrefetches) {
    FakeBackend b(fake(FakeBackend::Mode::MANUAL));
    CopyEngineConfig cfg;
    cfg.queue_depth = 1;
    CopyEngine engine(b, cfg);
    std::vector<uint8_t> src(4096, 1), p1(4096), p2(4096), d(4096);
    engine.submit({p1.data(), src.data(), 4096, CopyPriority::PREFETCH});
    engine.submit({p2.data(), src.data(), 4096, CopyPriority::PREFETCH});
    ASSERT_TRUE(b.wait_copies_issued(1));  // p1 is in flight, p2 queued
    engine.submit({d.data(), src.data(), 4096, CopyPriority::DEMAND});
    pump_until_idle(b, engine);
    std::vector<FakeBackend::CopyRecord> log = b.copy_log();
    ASSERT_EQ(log.size(), 3u);
    EXPECT_EQ(log[0].dst, p1.data());
    EXPECT_EQ(log[1].dst, d.data());
    EXPECT_EQ(log[2].dst, p2.data());
}

TEST(CopyEngine, CancelledPrefetchNeverCompletes) {
    FakeBackend b(fake(FakeBackend::Mode::MANUAL));
    CopyEngineConfig cfg;
    cfg.queue_depth = 1;
    CopyEngine engine(b, cfg);
    std::vector<uint8_t> src(4096, 9), p1(4096, 0), p2(4096, 0), p3(4096, 0);
    engine.submit({p1.data(), src.data(), 4096, CopyPriority::PREFETCH});
    Ticket t2 = engine.submit({p2.data(), src.data(), 4096, CopyPriority::PREFETCH});
    Ticket t3 = engine.submit({p3.data(), src.data(), 4096, CopyPriority::PREFETCH});
    ASSERT_TRUE(b.wait_copies_issued(1));
    EXPECT_TRUE(engine.cancel(t2));
    pump_until_idle(b, engine);
    for (const auto &rec : b.copy_log()) EXPECT_NE(rec.dst, p2.data());
    EXPECT_EQ(p2, std::vector<uint8_t>(4096, 0));
    EXPECT_EQ(p3, src);
    EXPECT_EQ(engine.state(t2), TicketState::CANCELLED);
    EXPECT_FALSE(engine.wait_host(t2));
    EXPECT_TRUE(engine.wait_host(t3));
}

TEST(CopyEngine, ChunksInFlightNeverExceedTheQueueDepth) {
    FakeBackend b(fake(FakeBackend::Mode::MANUAL));
    CopyEngineConfig cfg;
    cfg.queue_depth = 2;
    cfg.chunk_bytes = 1024;
    CopyEngine engine(b, cfg);
    std::vector<uint8_t> src(3 * 1024 * 3, 5), dst(src.size(), 0);
    for (int i = 0; i < 3; ++i) {
        engine.submit({dst.data() + i * 3072, src.data() + i * 3072, 3072, CopyPriority::PREFETCH});
    }
    // Release one copy at a time; the engine refills up to the depth each time.
    for (size_t ran = 0; ran < 9;) {
        ASSERT_TRUE(b.wait_copies_issued(std::min<size_t>(ran + 2, 9)));
        ran += size_t(b.run_copies(1));
    }
    pump_until_idle(b, engine);
    EXPECT_EQ(b.max_copies_pending(), 2u);
    EXPECT_EQ(dst, src);
}

TEST(CopyEngine, ComputeStreamWaitsForTheTicketNotTheDevice) {
    FakeBackend b(fake(FakeBackend::Mode::MANUAL));
    Stream compute = b.stream_create();  // created first, so run_copies would prefer it if it were free
    CopyEngine engine(b);
    std::vector<uint8_t> src = pattern(8192, 1), dev(8192, 0), back(8192, 0);
    Ticket t = engine.submit({dev.data(), src.data(), 8192, CopyPriority::PREFETCH});
    engine.stream_wait(t, compute);  // returns once issued; the device wait is queued on `compute`
    b.copy_d2h_async(back.data(), dev.data(), 8192, compute);
    EXPECT_EQ(b.run_copies(1), 1);
    EXPECT_EQ(b.completion_log().at(0).dst, dev.data());  // the h2d ran first
    b.run_all();
    EXPECT_EQ(back, src);
    pump_until_idle(b, engine);
    b.stream_destroy(compute);
}

TEST(CopyEngine, AchievedBandwidthIsBytesOverLinkBusyTime) {
    FakeBackend::Config fc = fake(FakeBackend::Mode::IMMEDIATE);
    fc.link_bytes_per_s = 10e9;  // virtual link: event timestamps advance 0.1 ns per byte
    FakeBackend b(fc);
    CopyEngine engine(b);
    std::vector<uint8_t> src(9 * MiB, 3), dst(9 * MiB, 0);
    engine.wait_host(engine.submit({dst.data(), src.data(), src.size(), CopyPriority::DEMAND}));
    CopyStats s = engine.stats();
    EXPECT_EQ(s.chunks_done, 3u);
    EXPECT_NEAR(s.busy_us, double(9 * MiB) / 10e9 * 1e6, 1e-6);
    EXPECT_NEAR(s.achieved_gb_s(), 10.0, 1e-9);
}

TEST(CopyEngine, AnOpenBusyPeriodCountsAndTheCounterNeverGoesDown) {
    // Decision 0147: busy time is read between layers while a period is still open (host time), and what was
    // reported stays counted when the period closes with a shorter event time (the virtual link's 0.1 ns a byte).
    FakeBackend::Config fc = fake(FakeBackend::Mode::MANUAL);
    fc.link_bytes_per_s = 10e9;
    FakeBackend b(fc);
    CopyEngine engine(b);
    std::vector<uint8_t> src(4096, 3), dst(4096, 0);
    engine.submit({dst.data(), src.data(), src.size(), CopyPriority::DEMAND});
    ASSERT_TRUE(b.wait_copies_issued(1));
    const double before = engine.stats().busy_us;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const double open = engine.stats().busy_us;
    EXPECT_GE(open, before + 2000);  // at least the sleep: the period is open, the copy not run
    pump_until_idle(b, engine);
    EXPECT_GE(engine.stats().busy_us, open);  // the event time (0.4 us) did not replace what was reported
    EXPECT_EQ(engine.stats().bytes_done, 4096u);
}

namespace {

// Forwards to a FakeBackend but fails every host-to-device copy, as a broken driver would.
class FailingBackend final : public Backend {
  public:
    std::string name() const override { return "failing"; }
    void *alloc(MemoryKind k, size_t n) override { return inner.alloc(k, n); }
    void free(MemoryKind k, void *p) override { inner.free(k, p); }
    MemoryInfo memory_info() override { return inner.memory_info(); }
    Stream stream_create() override { return inner.stream_create(); }
    void stream_destroy(Stream s) override { inner.stream_destroy(s); }
    Event event_create() override { return inner.event_create(); }
    void event_destroy(Event e) override { inner.event_destroy(e); }
    void copy_h2d_async(void *, const void *, size_t, Stream) override { fail("device lost"); }
    void copy_d2h_async(void *d, const void *s, size_t n, Stream st) override { inner.copy_d2h_async(d, s, n, st); }
    void event_record(Event e, Stream s) override { inner.event_record(e, s); }
    void stream_wait_event(Stream s, Event e) override { inner.stream_wait_event(s, e); }
    bool event_query(Event e) override { return inner.event_query(e); }
    void event_synchronize(Event e) override { inner.event_synchronize(e); }
    void stream_synchronize(Stream s) override { inner.stream_synchronize(s); }
    FakeBackend inner;
};

} // namespace

TEST(CopyEngine, BackendFailureReachesTheCallerAsAnError) {
    FailingBackend b;
    CopyEngine engine(b);
    std::vector<uint8_t> src(100, 1), dst(100, 0);
    Ticket t = engine.submit({dst.data(), src.data(), 100, CopyPriority::DEMAND});
    EXPECT_THROW(engine.wait_host(t), Error);
    EXPECT_THROW(engine.submit({dst.data(), src.data(), 100, CopyPriority::DEMAND}), Error);
}

TEST(CopyEngine, RandomSubmitsCancelsAndPromotionsLeaveEveryFinishedCopyWhole) {
    FakeBackend b(fake(FakeBackend::Mode::THREADED));
    CopyEngineConfig cfg;
    cfg.chunk_bytes = 4096;
    cfg.queue_depth = 3;
    CopyEngine engine(b, cfg);
    std::mt19937 rng(5);
    const int n = 200;
    std::vector<std::vector<uint8_t>> src(n), dst(n);
    std::vector<Ticket> tickets(n);
    for (int i = 0; i < n; ++i) {
        src[size_t(i)] = pattern(1 + rng() % 20000, uint32_t(i));
        dst[size_t(i)].assign(src[size_t(i)].size(), 0);
        auto prio = rng() % 3 ? CopyPriority::PREFETCH : CopyPriority::DEMAND;
        tickets[size_t(i)] = engine.submit({dst[size_t(i)].data(), src[size_t(i)].data(), src[size_t(i)].size(), prio});
        if (i > 0 && rng() % 4 == 0) engine.cancel(tickets[rng() % size_t(i)]);
        if (i > 0 && rng() % 4 == 0) engine.promote(tickets[rng() % size_t(i)]);
    }
    int done = 0;
    for (int i = 0; i < n; ++i) {
        if (engine.wait_host(tickets[size_t(i)])) {
            ++done;
            EXPECT_EQ(dst[size_t(i)], src[size_t(i)]) << "request " << i;
        }
    }
    engine.drain();
    CopyStats s = engine.stats();
    EXPECT_EQ(uint64_t(done), s.requests_done);
    EXPECT_EQ(s.requests_done + s.requests_cancelled, uint64_t(n));
}
