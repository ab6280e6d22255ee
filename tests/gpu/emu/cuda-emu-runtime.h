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

// Stream capture (backend/cuda/graph.h): the emulation runs each launch when it is made, so it cannot defer a
// graph; capture is refused (cudaStreamBeginCapture fails) and StreamGraph::available() reports no graphs.
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone, cudaStreamCaptureStatusActive };
enum cudaStreamCaptureMode { cudaStreamCaptureModeThreadLocal };
constexpr unsigned cudaEventRecordDefault = 0, cudaEventRecordExternal = 1;
struct CUgraph_st;
struct CUgraphExec_st;
using cudaGraph_t = CUgraph_st *;
using cudaGraphExec_t = CUgraphExec_st *;
struct cudaGraphExecUpdateResultInfo {};
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus *status);
cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned flags);
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo *info);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
