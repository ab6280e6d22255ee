// The all-to-all of expert parallelism (issue 16): every GPU sends each other GPU a variable number of rows, as
// MPI_Alltoallv does, driven by the one host thread that drives every GPU. FakeAllToAll moves host memory in
// process (tests, and the CPU executor of --gpus N); NcclAllToAll (backend/cuda/nccl-all-to-all.h) moves device
// memory with NCCL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace prescope {

/// Byte offset of segment (sender s -> receiver d) in s's send buffer (the receivers before d come first) and in
/// d's receive buffer (the senders before s come first). rows: [world][world] rows sender -> receiver.
size_t all_to_all_send_offset(std::span<const int64_t> rows, int32_t world, int32_t s, int32_t d, size_t row_bytes);
size_t all_to_all_recv_offset(std::span<const int64_t> rows, int32_t world, int32_t s, int32_t d, size_t row_bytes);

class AllToAll {
  public:
    virtual ~AllToAll() = default;
    /// GPUs (ranks) taking part.
    virtual int32_t world() const = 0;
    /// One all-to-all: for every sender s and receiver d, rows[s * world + d] rows of row_bytes bytes go from
    /// send[s] + all_to_all_send_offset(...) to recv[d] + all_to_all_recv_offset(...). send and recv: [world]
    /// buffers in the memory the implementation moves (host for FakeAllToAll, GPU g's memory for NcclAllToAll);
    /// segments of 0 rows are not touched. The buffers must hold their segments and not overlap. FakeAllToAll has
    /// finished on return; NcclAllToAll has queued the transfers on each GPU's stream (see synchronize()).
    /// Throws prescope::Error when the transport fails (NCCL's message).
    virtual void exchange(std::span<const void *const> send, std::span<void *const> recv, std::span<const int64_t> rows,
                          size_t row_bytes) = 0;
    /// Blocks until every exchange queued so far has completed (nothing to wait for in FakeAllToAll).
    virtual void synchronize() = 0;
};

/// The all-to-all in one process, on host memory: one memcpy per segment, in sender then receiver order. Counts
/// the exchanges and the bytes that crossed between different GPUs (a GPU's segment to itself stays local).
class FakeAllToAll final : public AllToAll {
  public:
    /// PRECONDITION: 1 <= world <= 8.
    explicit FakeAllToAll(int32_t world);
    int32_t world() const override { return world_; }
    void exchange(std::span<const void *const> send, std::span<void *const> recv, std::span<const int64_t> rows,
                  size_t row_bytes) override;
    void synchronize() override {}

    int64_t exchanges() const { return exchanges_; }
    uint64_t bytes_between_gpus() const { return bytes_between_; }

  private:
    int32_t world_;
    int64_t exchanges_ = 0;
    uint64_t bytes_between_ = 0;
};

} // namespace prescope
