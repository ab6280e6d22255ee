// Definitions of cuda-emu-runtime.h: host memory is plain memory, registration always succeeds, the
// emulated device reports 16 GiB free, waits and queries are immediate (the emulation is synchronous).
#include <cstdio>
#include <cstdlib>

cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned) {
    *p = std::aligned_alloc(256, (n + 255) / 256 * 256);
    return cudaSuccess;
}
cudaError_t cudaFreeHost(void *p) {
    std::free(p);
    return cudaSuccess;
}
cudaError_t cudaHostRegister(void *, size_t, unsigned) { return cudaSuccess; }
cudaError_t cudaHostUnregister(void *) { return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = size_t(16) << 30;
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaDeviceGetPCIBusId(char *bus, int len, int) {
    std::snprintf(bus, size_t(len), "emulation");
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus *status) {
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned) {
    return cudaEventRecord(event, stream);
}
cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) { return cudaErrorNotReady; }
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *) { return cudaErrorNotReady; }
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *, cudaGraph_t, unsigned long long) { return cudaErrorNotReady; }
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t, cudaGraph_t, cudaGraphExecUpdateResultInfo *) {
    return cudaErrorNotReady;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t) { return cudaErrorNotReady; }
cudaError_t cudaGraphDestroy(cudaGraph_t) { return cudaErrorNotReady; }
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t) { return cudaErrorNotReady; }
