// CudaBackend: backend/backend.h on the CUDA runtime, one runtime call per function (docs/decisions/0030).
#include "backend/cuda/cuda-backend.h"

#include "core/error.h"
#include "core/memory.h"

#include <fmt/format.h>

namespace prescope {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

/// Environment failures throw (backend.h contract); the copy thread hands them to the next caller.
void check(cudaError_t err, const char *call) {
    if (err == cudaSuccess) return;
    cudaGetLastError();  // clear a non-sticky error so later calls do not report it again
    fail("CUDA error {} ({}) in {}", cudaGetErrorName(err), cudaGetErrorString(err), call);
}

int attribute(cudaDeviceAttr attr, int device) {
    int v = 0;
    return cudaDeviceGetAttribute(&v, attr, device) == cudaSuccess ? v : 0;
}

} // namespace

std::string CudaDeviceInfo::describe() const {
    return fmt::format("cuda:{} {} (sm_{}{}, {} SMs, {:.1f} GiB, {:.1f} GiB free, HBM peak {:.2f} TB/s, PCI {}, "
                       "host register {})",
                       device, name, cc_major, cc_minor, sm_count, double(total_bytes) / (kMiB * 1024),
                       double(free_bytes) / (kMiB * 1024), hbm_peak_gb_s / 1000.0, pci_bus_id,
                       host_register_read_only ? "read-only" : host_register ? "yes" : "no");
}

int cuda_device_count(std::string *why) {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        if (why) *why = fmt::format("{}: {}", cudaGetErrorName(err), cudaGetErrorString(err));
        cudaGetLastError();
        return 0;
    }
    if (n == 0 && why) *why = "the driver reports no devices";
    return n;
}

CudaDeviceInfo cuda_device_info(int device) {
    CudaDeviceInfo d;
    d.device = device;
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    d.name = prop.name;
    d.cc_major = prop.major;
    d.cc_minor = prop.minor;
    d.sm_count = prop.multiProcessorCount;
    // Memory clock in kHz, bus width in bits, double data rate.
    const double clock_khz = attribute(cudaDevAttrMemoryClockRate, device);
    const double bus_bits = attribute(cudaDevAttrGlobalMemoryBusWidth, device);
    d.hbm_peak_gb_s = 2.0 * clock_khz * 1e3 * bus_bits / 8.0 / 1e9;
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) == cudaSuccess) d.pci_bus_id = bus;
    d.host_register = attribute(cudaDevAttrHostRegisterSupported, device) != 0;
    d.host_register_read_only = attribute(cudaDevAttrHostRegisterReadOnlySupported, device) != 0;
    size_t free_b = 0, total_b = 0;
    int current = 0;
    check(cudaGetDevice(&current), "cudaGetDevice");
    if (current == device && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
        d.free_bytes = free_b;
        d.total_bytes = total_b;
    } else {
        d.total_bytes = prop.totalGlobalMem;
    }
    cudaGetLastError();
    return d;
}

CudaBackend::CudaBackend(int device) : device_(device) {
    std::string why;
    const int n = cuda_device_count(&why);
    if (n == 0) fail("no CUDA device: {}", why);
    if (device < 0 || device >= n) fail("CUDA device {} does not exist ({} visible)", device, n);
    check(cudaSetDevice(device), "cudaSetDevice");
    info_ = cuda_device_info(device);
    register_flags_ = info_.host_register_read_only ? cudaHostRegisterReadOnly : cudaHostRegisterDefault;
}

std::string CudaBackend::name() const { return fmt::format("cuda:{} {}", device_, info_.name); }

void CudaBackend::thread_init() { check(cudaSetDevice(device_), "cudaSetDevice"); }

void *CudaBackend::alloc(MemoryKind kind, size_t n_bytes) {
    PRESCOPE_ASSERT(n_bytes > 0);
    void *p = nullptr;
    const cudaError_t err = allocation_failure_due()       ? cudaErrorMemoryAllocation  // a test's injected failure
                            : kind == MemoryKind::DEVICE ? cudaMalloc(&p, n_bytes)
                                                         : cudaHostAlloc(&p, n_bytes, cudaHostAllocPortable);
    if (err == cudaSuccess) return p;
    cudaGetLastError();
    if (kind == MemoryKind::DEVICE) {
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        cudaGetLastError();
        fail("CUDA out of memory: asked for {:.1f} MiB of device memory, {:.1f} MiB free of {:.1f} MiB ({})",
             double(n_bytes) / kMiB, double(free_b) / kMiB, double(total_b) / kMiB, cudaGetErrorName(err));
    }
    fail("CUDA could not allocate {:.1f} MiB of pinned host memory ({}: {})", double(n_bytes) / kMiB,
         cudaGetErrorName(err), cudaGetErrorString(err));
}

void CudaBackend::free(MemoryKind kind, void *ptr) {
    if (!ptr) return;
    check(kind == MemoryKind::DEVICE ? cudaFree(ptr) : cudaFreeHost(ptr),
          kind == MemoryKind::DEVICE ? "cudaFree" : "cudaFreeHost");
}

bool CudaBackend::host_register(const void *ptr, size_t n_bytes) {
    if (!info_.host_register) return false;
    // The runtime takes a non-const pointer; with cudaHostRegisterReadOnly the device never writes it.
    if (cudaHostRegister(const_cast<void *>(ptr), n_bytes, register_flags_) == cudaSuccess) return true;
    cudaGetLastError();
    return false;
}

void CudaBackend::host_unregister(const void *ptr) {
    check(cudaHostUnregister(const_cast<void *>(ptr)), "cudaHostUnregister");
}

MemoryInfo CudaBackend::memory_info() {
    size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    return {free_b, total_b};
}

Stream CudaBackend::stream_create() {
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return reinterpret_cast<Stream>(s);
}

void CudaBackend::stream_destroy(Stream stream) { check(cudaStreamDestroy(cuda_stream(stream)), "cudaStreamDestroy"); }

Event CudaBackend::event_create() {
    cudaEvent_t e = nullptr;
    check(cudaEventCreate(&e), "cudaEventCreate");
    return reinterpret_cast<Event>(e);
}

void CudaBackend::event_destroy(Event event) { check(cudaEventDestroy(cuda_event(event)), "cudaEventDestroy"); }

void CudaBackend::copy_h2d_async(void *dst, const void *src, size_t n_bytes, Stream stream) {
    check(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyHostToDevice, cuda_stream(stream)), "cudaMemcpyAsync(H2D)");
}

void CudaBackend::copy_d2h_async(void *dst, const void *src, size_t n_bytes, Stream stream) {
    check(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToHost, cuda_stream(stream)), "cudaMemcpyAsync(D2H)");
}

void CudaBackend::event_record(Event event, Stream stream) {
    // On a stream being captured into a graph (decision 0142) the record is an external event node: recorded each
    // time the graph runs, so the host may wait for a point inside a replayed graph.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(cuda_stream(stream), &capture), "cudaStreamIsCapturing");
    check(cudaEventRecordWithFlags(cuda_event(event), cuda_stream(stream),
                                   capture == cudaStreamCaptureStatusActive ? cudaEventRecordExternal
                                                                            : cudaEventRecordDefault),
          "cudaEventRecordWithFlags");
}

void CudaBackend::copy_d2h_forked(void *dst, const void *src, size_t n_bytes, Stream from, Stream side, Event fork,
                                  Event done, Event join) {
    // Plain records for the fork and the join: in a capture they are dependencies, not external event nodes.
    check(cudaEventRecord(cuda_event(fork), cuda_stream(from)), "cudaEventRecord(fork)");
    check(cudaStreamWaitEvent(cuda_stream(side), cuda_event(fork), 0), "cudaStreamWaitEvent(fork)");
    copy_d2h_async(dst, src, n_bytes, side);
    event_record(done, side);
    check(cudaEventRecord(cuda_event(join), cuda_stream(side)), "cudaEventRecord(join)");
}

void CudaBackend::stream_wait_event(Stream stream, Event event) {
    check(cudaStreamWaitEvent(cuda_stream(stream), cuda_event(event), 0), "cudaStreamWaitEvent");
}

bool CudaBackend::event_query(Event event) {
    const cudaError_t err = cudaEventQuery(cuda_event(event));
    if (err == cudaErrorNotReady) return false;
    check(err, "cudaEventQuery");
    return true;
}

void CudaBackend::event_synchronize(Event event) {
    check(cudaEventSynchronize(cuda_event(event)), "cudaEventSynchronize");
}

void CudaBackend::stream_synchronize(Stream stream) {
    check(cudaStreamSynchronize(cuda_stream(stream)), "cudaStreamSynchronize");
}

double CudaBackend::event_elapsed_us(Event start, Event end) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, cuda_event(start), cuda_event(end)) != cudaSuccess) {
        cudaGetLastError();  // e.g. an event never recorded: the contract says "cannot time"
        return -1.0;
    }
    return double(ms) * 1000.0;
}

} // namespace prescope
