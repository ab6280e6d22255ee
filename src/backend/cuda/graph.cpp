#include "backend/cuda/graph.h"

#include "backend/cuda/common.cuh"

namespace prescope::cuda {

bool StreamGraph::available() {
    static const bool ok = [] {
        cudaStream_t s = nullptr;
        if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return false;
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        bool captured = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
        captured = captured && cudaStreamEndCapture(s, &graph) == cudaSuccess;
        const bool run = captured && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess &&
                         cudaGraphLaunch(exec, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess;
        if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
        if (graph != nullptr) (void)cudaGraphDestroy(graph);
        (void)cudaStreamDestroy(s);
        (void)cudaGetLastError();  // a refusal is not an error of the next call
        return run;
    }();
    return ok;
}

void StreamGraph::begin_capture(cudaStream_t stream) {
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
}

void StreamGraph::end_capture(cudaStream_t stream) {
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    if (exec_ != nullptr) {
        cudaGraphExecUpdateResultInfo info{};
        if (cudaGraphExecUpdate(exec_, graph, &info) != cudaSuccess) {
            (void)cudaGetLastError();  // the refusal is not an error of the next call
            reset();
        }
    }
    if (exec_ == nullptr) CUDA_CHECK(cudaGraphInstantiate(&exec_, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
}

void StreamGraph::abandon_capture(cudaStream_t stream) noexcept {
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    reset();
}

void StreamGraph::launch(cudaStream_t stream) const { CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

void StreamGraph::reset() noexcept {
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
    exec_ = nullptr;
}

} // namespace prescope::cuda
