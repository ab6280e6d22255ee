// The CUDA implementation of the backend boundary (backend/backend.h): one CUDA runtime call per function,
// non-blocking streams, timed events; environment failures (out of memory, driver errors) throw
// prescope::Error with the numbers. Plus the device facts printed at start-up.
#pragma once

#include "backend/backend.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace prescope {

/// Facts about one CUDA device, for the start-up banner (docs/style R14) and the bench JSON.
struct CudaDeviceInfo {
    int device = 0;
    std::string name;              // "NVIDIA H200"
    int cc_major = 0, cc_minor = 0;
    int sm_count = 0;
    uint64_t total_bytes = 0;      // device memory
    uint64_t free_bytes = 0;       // at the time of the query
    double hbm_peak_gb_s = 0;      // 2 x memory clock x bus width (0 when the driver does not say)
    std::string pci_bus_id;        // "0000:18:00.0"
    bool host_register = false;    // cudaHostRegister supported
    bool host_register_read_only = false;  // ... with cudaHostRegisterReadOnly

    /// One line: "cuda:0 NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB, 139.1 free, HBM peak 4.8 TB/s, PCI ...)".
    std::string describe() const;
};

/// CUDA devices visible to this process; 0 when there is no device or no usable driver (never throws).
/// `why` (optional) receives the driver's reason when the answer is 0.
int cuda_device_count(std::string *why = nullptr);
/// Facts of `device`. Throws prescope::Error when the device cannot be queried.
CudaDeviceInfo cuda_device_info(int device);

/// Backend on one CUDA device. Every call sets nothing but what it names: the caller thread's current
/// device is set by the constructor (its thread) and by thread_init() (other threads).
class CudaBackend final : public Backend {
  public:
    /// Makes `device` current on the calling thread and reads its facts. Throws prescope::Error when it
    /// does not exist.
    explicit CudaBackend(int device = 0);

    const CudaDeviceInfo &info() const { return info_; }
    std::string name() const override;
    void thread_init() override;

    /// DEVICE: cudaMalloc; HOST_PINNED: cudaHostAlloc. On failure: prescope::Error "CUDA out of memory:
    /// asked for X MiB of <kind>, Y MiB free of Z MiB" (free/total of the device for DEVICE).
    void *alloc(MemoryKind kind, size_t n_bytes) override;
    void free(MemoryKind kind, void *ptr) override;
    /// cudaHostRegister with cudaHostRegisterReadOnly where the device supports it (plain registration
    /// otherwise). False when refused (limits on locked memory, no support); the error is cleared.
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
    /// cudaEventQuery: true on cudaSuccess, false on cudaErrorNotReady; other errors throw.
    bool event_query(Event event) override;
    void event_synchronize(Event event) override;
    void stream_synchronize(Stream stream) override;
    double event_elapsed_us(Event start, Event end) override;
    /// A device-to-host copy on `side` after the work queued so far on `from` (a fork, also inside a graph
    /// capture of `from`), then `done` recorded on `side` for the host (as event_record: an external node in a
    /// capture) and `join` for streams: a stream that waits for `join` (stream_wait_event) waits for the copy,
    /// and a capture of `from` must do so before it ends. `fork` is scratch, reusable once this returns.
    void copy_d2h_forked(void *dst, const void *src, size_t n_bytes, Stream from, Stream side, Event fork, Event done,
                         Event join);

    /// The handles as the CUDA runtime knows them (for kernel launches on a backend stream).
    static cudaStream_t cuda_stream(Stream s) { return reinterpret_cast<cudaStream_t>(s); }
    static cudaEvent_t cuda_event(Event e) { return reinterpret_cast<cudaEvent_t>(e); }

  private:
    int device_ = 0;
    unsigned register_flags_ = 0;
    CudaDeviceInfo info_;
};

} // namespace prescope
