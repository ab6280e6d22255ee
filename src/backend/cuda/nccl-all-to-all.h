// The all-to-all of expert parallelism on NCCL (offload/all-to-all.h; issue 16): one communicator per GPU of
// this process (ncclCommInitAll), one stream per GPU, every exchange one group of ncclSend / ncclRecv driven by
// the one host thread. NVLink multicast stays off (NCCL_NVLS_ENABLE=0): the GPU machines require it.
#pragma once

#include "offload/all-to-all.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <vector>

namespace prescope {

class NcclAllToAll final : public AllToAll {
  public:
    /// devices: the CUDA device of each GPU (rank g = devices[g]), 1 to 8 of them, each once (NCCL refuses a
    /// communicator with a device twice; a world of one GPU is allowed). Sets NCCL_NVLS_ENABLE=0 in the
    /// environment before NCCL reads it, whatever it was. Leaves the calling thread's current device as it found it.
    /// Throws prescope::Error with CUDA's or NCCL's message (a device that does not exist, a failed init).
    explicit NcclAllToAll(std::vector<int> devices);
    ~NcclAllToAll() override;
    NcclAllToAll(const NcclAllToAll &) = delete;
    NcclAllToAll &operator=(const NcclAllToAll &) = delete;

    int32_t world() const override { return int32_t(devices_.size()); }
    /// AllToAll::exchange over device memory: send[g] and recv[g] on GPU g's device. Queues the transfers on each
    /// GPU's stream (ncclUint8, row_bytes x rows per segment; a GPU's segment to itself goes through NCCL too) and
    /// returns; work queued after it on stream(g) sees GPU g's rows.
    void exchange(std::span<const void *const> send, std::span<void *const> recv, std::span<const int64_t> rows,
                  size_t row_bytes) override;
    /// cudaStreamSynchronize on every GPU's stream.
    void synchronize() override;

    /// GPU g's stream (non-blocking, on devices[g]), where the exchanges are queued.
    cudaStream_t stream(int32_t g) const { return streams_[size_t(g)]; }
    /// The CUDA device index of GPU (rank) g.
    int device(int32_t g) const { return devices_[size_t(g)]; }
    /// The NCCL library's version as "2.28.9" (ncclGetVersion).
    static std::string version();

  private:
    std::vector<int> devices_;
    std::vector<ncclComm_t> comms_;       // [world], rank g on devices_[g]
    std::vector<cudaStream_t> streams_;   // [world]
};

} // namespace prescope
