// The CUDA runtime calls the offloading runtime makes beyond those tests/ops/emu/cuda-emu.h emulates
// (host memory registration, memory info, stream waits, event queries), for tests/gpu/emu/run.sh.
// Everything stays synchronous: a copy has landed when its call returns, every event is complete.
#pragma once

// Error and attribute names the CPU emulation's enums lack; values inside those enums' ranges.
#define cudaErrorNotReady cudaError_t(1)
#define cudaErrorMemoryAllocation cudaError_t(1)
#define cudaDevAttrMemoryClockRate cudaDevAttrMultiProcessorCount
#define cudaDevAttrGlobalMemoryBusWidth cudaDevAttrMultiProcessorCount
#define cudaDevAttrHostRegisterSupported cudaDevAttrMultiProcessorCount
#define cudaDevAttrHostRegisterReadOnlySupported cudaDevAttrMultiProcessorCount
constexpr unsigned cudaHostRegisterDefault = 0, cudaHostRegisterReadOnly = 8, cudaHostAllocPortable = 1;

cudaError_t cudaSetDevice(int device);
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaHostRegister(void *p, size_t n, unsigned flags);
cudaError_t cudaHostUnregister(void *p);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaDeviceGetPCIBusId(char *bus, int len, int device);
