// NcclAllToAll: communicators and streams per GPU, grouped point-to-point transfers.
#include "backend/cuda/nccl-all-to-all.h"

#include "core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

namespace prescope {

namespace {

void check_nccl(ncclResult_t r, const char *what) {
    if (r == ncclSuccess) return;
    const char *last = ncclGetLastError(nullptr);
    fail("NCCL: {} failed: {}{}{}", what, ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
}

void check_cuda(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return;
    fail("CUDA: {} failed: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

} // namespace

std::string NcclAllToAll::version() {
    int v = 0;
    check_nccl(ncclGetVersion(&v), "ncclGetVersion");
    // NCCL_VERSION(X, Y, Z) is X * 10000 + Y * 100 + Z since 2.9.
    return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

NcclAllToAll::NcclAllToAll(std::vector<int> devices) : devices_(std::move(devices)) {
    const auto W = int32_t(devices_.size());
    if (W < 1 || W > 8) fail("NCCL all-to-all: expected 1 to 8 GPUs, got {}", W);
    int n_devices = 0;
    check_cuda(cudaGetDeviceCount(&n_devices), "cudaGetDeviceCount");
    for (int32_t g = 0; g < W; ++g) {
        const int d = devices_[size_t(g)];
        if (d < 0 || d >= n_devices) fail("NCCL all-to-all: GPU {} is CUDA device {}, but there are {}", g, d, n_devices);
        if (std::count(devices_.begin(), devices_.end(), d) > 1) {
            fail("NCCL all-to-all: CUDA device {} is listed twice (a communicator holds each device once)", d);
        }
    }
    // NVLink multicast (NVLS) can put the shared GPUs of the machines we run on out of service: off, always.
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    int current = 0;
    check_cuda(cudaGetDevice(&current), "cudaGetDevice");
    comms_.resize(size_t(W));
    check_nccl(ncclCommInitAll(comms_.data(), W, devices_.data()), "ncclCommInitAll");
    streams_.resize(size_t(W), nullptr);
    for (int32_t g = 0; g < W; ++g) {
        check_cuda(cudaSetDevice(devices_[size_t(g)]), "cudaSetDevice");
        check_cuda(cudaStreamCreateWithFlags(&streams_[size_t(g)], cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    }
    check_cuda(cudaSetDevice(current), "cudaSetDevice");
}

NcclAllToAll::~NcclAllToAll() {
    for (ncclComm_t c : comms_) {
        if (c) ncclCommDestroy(c);
    }
    for (cudaStream_t s : streams_) {
        if (s) cudaStreamDestroy(s);
    }
}

void NcclAllToAll::exchange(std::span<const void *const> send, std::span<void *const> recv,
                            std::span<const int64_t> rows, size_t row_bytes) {
    const int32_t W = world();
    PRESCOPE_ASSERT(send.size() == size_t(W) && recv.size() == size_t(W) && rows.size() == size_t(W * W));
    // One thread drives every communicator: the sends and receives of all GPUs form one group, which NCCL
    // schedules together (a blocking pair across two communicators would otherwise deadlock).
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t first = ncclSuccess;
    const char *what = "";
    const auto record = [&](ncclResult_t r, const char *call) {
        if (r != ncclSuccess && first == ncclSuccess) first = r, what = call;
    };
    for (int32_t g = 0; g < W; ++g) {
        for (int32_t o = 0; o < W; ++o) {
            const int64_t out = rows[size_t(g * W + o)], in = rows[size_t(o * W + g)];
            PRESCOPE_ASSERT(out >= 0 && in >= 0);
            if (out > 0) {
                const auto *p = static_cast<const char *>(send[size_t(g)]) + all_to_all_send_offset(rows, W, g, o, row_bytes);
                record(ncclSend(p, size_t(out) * row_bytes, ncclUint8, o, comms_[size_t(g)], streams_[size_t(g)]),
                       "ncclSend");
            }
            if (in > 0) {
                auto *p = static_cast<char *>(recv[size_t(g)]) + all_to_all_recv_offset(rows, W, o, g, row_bytes);
                record(ncclRecv(p, size_t(in) * row_bytes, ncclUint8, o, comms_[size_t(g)], streams_[size_t(g)]),
                       "ncclRecv");
            }
        }
    }
    record(ncclGroupEnd(), "ncclGroupEnd");
    check_nccl(first, what);
}

void NcclAllToAll::synchronize() {
    for (cudaStream_t s : streams_) check_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

} // namespace prescope
