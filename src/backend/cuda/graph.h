// A CUDA graph captured from a stream and replayed on it, as llama.cpp's ggml-cuda does for its decode graphs
// (ggml-cuda.cu: capture, cudaGraphExecUpdate, re-instantiate only when the update is refused). The GPU runs a
// replayed sequence back to back, without the host's launch rate between its kernels (decision 0142).
#pragma once

#include <cuda_runtime_api.h>

namespace prescope::cuda {

/// PRECONDITIONS: one thread; the stream outlives it. Errors of the runtime abort (CUDA_CHECK), as elsewhere.
class StreamGraph {
  public:
    /// True when the current device's runtime captures and runs graphs (probed once: an empty capture on a
    /// stream of its own). The CPU emulation of the tests (tests/gpu/emu) refuses capture.
    static bool available();

    StreamGraph() = default;
    StreamGraph(const StreamGraph &) = delete;
    StreamGraph &operator=(const StreamGraph &) = delete;
    ~StreamGraph() { reset(); }

    /// Starts capturing `stream` (cudaStreamCaptureModeThreadLocal: other threads' CUDA calls, such as the copy
    /// engine's, are not affected). Until end_capture, work queued on it is recorded, not run: the host must not
    /// wait for it (event or stream queries and syncs fail), and host buffers read by captured copies must be
    /// page-locked; they are read when the graph runs.
    void begin_capture(cudaStream_t stream);
    /// Ends the capture begun on `stream` and makes it the executable graph: updated in place when the old one has
    /// the same topology (only kernel and copy parameters changed), else instantiated anew.
    void end_capture(cudaStream_t stream);
    /// Ends a capture begun on `stream` and drops what it recorded and the executable graph (an error while
    /// capturing: the stream is usable again).
    void abandon_capture(cudaStream_t stream) noexcept;
    /// Queues the executable graph on `stream` (ready() must hold).
    void launch(cudaStream_t stream) const;
    bool ready() const { return exec_ != nullptr; }
    /// Drops the executable graph.
    void reset() noexcept;

  private:
    cudaGraphExec_t exec_ = nullptr;
};

} // namespace prescope::cuda
