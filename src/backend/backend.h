// The backend boundary for memory and data movement (docs/style R3): buffers, streams, async copies, events.
// The offload machinery (src/offload) is built only on these primitives, so a fake backend can run it
// without a GPU. Compute (ops, graphs) stays behind backend/cpu/ops.h and its CUDA twin.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace prescope {

/// Opaque stream and event handles. Each backend gives them meaning; the CUDA backend casts
/// cudaStream_t / cudaEvent_t to these, so every call below maps onto one CUDA runtime call.
struct BackendStream;
struct BackendEvent;
using Stream = BackendStream *;
using Event = BackendEvent *;

/// Where a buffer lives.
enum class MemoryKind : uint8_t {
    DEVICE,       // accelerator memory (cudaMalloc)
    HOST_PINNED,  // page-locked host memory the device can DMA from (cudaHostAlloc)
};

/// Device memory as the backend reports it (cudaMemGetInfo), in bytes.
struct MemoryInfo {
    uint64_t free_bytes = 0;
    uint64_t total_bytes = 0;
};

/// A device plus its copy and synchronisation primitives. Calls marked (optional) have a default that
/// states "not supported"; every other call must be implemented. Calls may be made from any thread
/// (the copy engine issues from its own thread); handles are created and destroyed outside the hot path.
/// Errors of the environment (out of memory, driver failure) throw prescope::Error with the numbers.
///
/// Ordering rules, as in CUDA: operations on one stream run in issue order; an event completes when all
/// work issued to its stream before event_record() has completed; stream_wait_event() waits for the
/// event's most recent record at the time of the call (an event never recorded does not block).
class Backend {
  public:
    virtual ~Backend() = default;

    /// Short name for logs ("cuda:0 NVIDIA H200", "fake").
    virtual std::string name() const = 0;
    /// (optional) Called once by every thread the offload code starts (the copy thread) before its first
    /// call, so that per-thread driver state points at this device. cudaSetDevice.
    virtual void thread_init() {}

    // --- memory -------------------------------------------------------------------------------------------
    /// Allocates n_bytes (> 0) of `kind`, aligned to at least 256 bytes. Throws prescope::Error when the
    /// memory is not there (message: what was asked, what is free). cudaMalloc / cudaHostAlloc.
    virtual void *alloc(MemoryKind kind, size_t n_bytes) = 0;
    /// Frees a pointer returned by alloc() with the same kind; nullptr is ignored. cudaFree / cudaFreeHost.
    virtual void free(MemoryKind kind, void *ptr) = 0;
    /// (optional) Page-locks an existing host range (e.g. a read-only file mapping) so the device can DMA
    /// from it without a staging copy. Returns false when not supported or refused; callers then copy
    /// from pageable memory and warn. cudaHostRegister(..., cudaHostRegisterReadOnly).
    virtual bool host_register(const void *ptr, size_t n_bytes) { return false; }
    /// (optional) Undoes host_register(). cudaHostUnregister.
    virtual void host_unregister(const void *ptr) {}
    /// Free and total device memory. cudaMemGetInfo.
    virtual MemoryInfo memory_info() = 0;

    // --- streams and events -------------------------------------------------------------------------------
    /// A new in-order queue of device work. cudaStreamCreateWithFlags(cudaStreamNonBlocking).
    virtual Stream stream_create() = 0;
    virtual void stream_destroy(Stream stream) = 0;
    /// A new event (timing enabled, so event_elapsed_us works). cudaEventCreate.
    virtual Event event_create() = 0;
    virtual void event_destroy(Event event) = 0;

    // --- asynchronous work ----------------------------------------------------------------------------------
    /// Queues a copy of n_bytes from host memory `src` to device memory `dst` on `stream` and returns at
    /// once. `src` must stay valid and unchanged until the copy completes (observe it with an event).
    /// Full overlap with compute needs `src` pinned or registered. cudaMemcpyAsync(H2D).
    virtual void copy_h2d_async(void *dst, const void *src, size_t n_bytes, Stream stream) = 0;
    /// Queues a device-to-host copy; same rules as copy_h2d_async. cudaMemcpyAsync(D2H).
    virtual void copy_d2h_async(void *dst, const void *src, size_t n_bytes, Stream stream) = 0;
    /// Captures the work queued on `stream` so far into `event` (re-recording replaces the capture).
    /// cudaEventRecord.
    virtual void event_record(Event event, Stream stream) = 0;
    /// Makes later work on `stream` wait for `event`'s current capture; the host does not block.
    /// cudaStreamWaitEvent.
    virtual void stream_wait_event(Stream stream, Event event) = 0;
    /// True when the event's captured work has completed (or it was never recorded); never blocks.
    /// cudaEventQuery.
    virtual bool event_query(Event event) = 0;
    /// Blocks the calling host thread until the event completes. cudaEventSynchronize.
    virtual void event_synchronize(Event event) = 0;
    /// Blocks the calling host thread until all work queued on `stream` completes. Not for the decode
    /// path: there the host waits on events only. cudaStreamSynchronize.
    virtual void stream_synchronize(Stream stream) = 0;
    /// (optional) Microseconds of device time between two completed events, or a negative number when
    /// the backend cannot time events. cudaEventElapsedTime (in ms, times 1000).
    virtual double event_elapsed_us(Event start, Event end) { return -1.0; }
};

} // namespace prescope
