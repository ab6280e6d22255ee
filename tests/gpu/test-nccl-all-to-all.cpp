// NcclAllToAll (backend/cuda/nccl-all-to-all.h) against FakeAllToAll (offload/all-to-all.h), byte for byte: on
// one GPU (a communicator of one rank: each GPU's segment to itself goes through NCCL's send and receive), and on
// every GPU of the machine when it has several. The dispatch and combine of a DispatchPlan move rows of the size
// the expert-parallel executor moves. Exits 77 without a CUDA device (CTest: skipped).
#include "backend/cuda/cuda-backend.h"
#include "backend/cuda/nccl-all-to-all.h"
#include "core/error.h"
#include "offload/all-to-all.h"
#include "offload/expert-dispatch.h"
#include "offload/expert-groups.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>

using namespace prescope;

namespace {

void cuda_ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

// Runs one all-to-all of random bytes on NCCL (device buffers, GPU g on nccl.device(g)) and on FakeAllToAll (host
// buffers), and compares every receive buffer byte for byte; the bytes past the segments must stay untouched.
void expect_same_exchange(NcclAllToAll &nccl, const std::vector<int64_t> &rows, size_t row_bytes, uint32_t seed) {
    const int32_t W = nccl.world();
    std::mt19937 rng(seed);
    const auto n = static_cast<size_t>(W);
    std::vector<std::vector<uint8_t>> send(n), fake_recv(n), nccl_recv(n);
    std::vector<void *> dsend(n), drecv(n);
    for (int32_t g = 0; g < W; ++g) {
        int64_t out = 0, in = 0;
        for (int32_t o = 0; o < W; ++o) out += rows[size_t(g * W + o)], in += rows[size_t(o * W + g)];
        send[size_t(g)].resize(size_t(out) * row_bytes + 1);
        for (uint8_t &b : send[size_t(g)]) b = uint8_t(rng());
        fake_recv[size_t(g)].assign(size_t(in) * row_bytes + 64, 0xA5);  // 64 guard bytes
        nccl_recv[size_t(g)].resize(fake_recv[size_t(g)].size());
        cuda_ok(cudaSetDevice(nccl.device(g)));
        cuda_ok(cudaMalloc(&dsend[size_t(g)], send[size_t(g)].size()));
        cuda_ok(cudaMalloc(&drecv[size_t(g)], fake_recv[size_t(g)].size()));
        cuda_ok(cudaMemcpy(dsend[size_t(g)], send[size_t(g)].data(), send[size_t(g)].size(), cudaMemcpyHostToDevice));
        cuda_ok(cudaMemcpy(drecv[size_t(g)], fake_recv[size_t(g)].data(), fake_recv[size_t(g)].size(),
                           cudaMemcpyHostToDevice));
    }
    std::vector<const void *> dsend_c(dsend.begin(), dsend.end());
    nccl.exchange(dsend_c, drecv, rows, row_bytes);
    nccl.synchronize();

    FakeAllToAll fake(W);
    std::vector<const void *> hsend;
    std::vector<void *> hrecv;
    for (int32_t g = 0; g < W; ++g) {
        hsend.push_back(send[size_t(g)].data());
        hrecv.push_back(fake_recv[size_t(g)].data());
    }
    fake.exchange(hsend, hrecv, rows, row_bytes);

    for (int32_t g = 0; g < W; ++g) {
        cuda_ok(cudaSetDevice(nccl.device(g)));
        cuda_ok(cudaMemcpy(nccl_recv[size_t(g)].data(), drecv[size_t(g)], nccl_recv[size_t(g)].size(),
                           cudaMemcpyDeviceToHost));
        EXPECT_EQ(nccl_recv[size_t(g)], fake_recv[size_t(g)]) << "GPU " << g << "'s receive buffer";
        cuda_ok(cudaFree(dsend[size_t(g)]));
        cuda_ok(cudaFree(drecv[size_t(g)]));
    }
    cuda_ok(cudaSetDevice(nccl.device(0)));
}

// A dispatch plan of random top-k routing over W GPUs with shuffled groups and contiguous homes.
DispatchPlan random_plan(int32_t W, int64_t n_tok, int32_t E, int32_t k, uint32_t seed) {
    std::mt19937 rng(seed);
    ExpertGroups groups = ExpertGroups::contiguous(1, E, W);
    std::shuffle(groups.gpu.begin(), groups.gpu.end(), rng);
    std::vector<int32_t> perm(static_cast<size_t>(E)), ids;
    for (int64_t t = 0; t < n_tok; ++t) {
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        ids.insert(ids.end(), perm.begin(), perm.begin() + k);
    }
    std::vector<int32_t> home(static_cast<size_t>(n_tok));
    contiguous_homes(W, home);
    DispatchPlan p;
    p.reserve(W, n_tok, k, E);
    build_dispatch_plan(ids, k, groups.layer(0), home, p);
    return p;
}

std::vector<int> all_devices() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    std::vector<int> d(size_t(std::min(n, 8)));
    std::iota(d.begin(), d.end(), 0);
    return d;
}

} // namespace

TEST(NcclAllToAll, OneGpuExchangesEqualTheFakeOnes) {
    NcclAllToAll nccl({0});
    EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
    std::printf("NCCL %s, one GPU (CUDA device 0)\n", NcclAllToAll::version().c_str());
    expect_same_exchange(nccl, {5}, 16, 1);
    expect_same_exchange(nccl, {0}, 16, 2);        // nothing to move: nothing moves
    expect_same_exchange(nccl, {1}, 1, 3);         // one byte
    expect_same_exchange(nccl, {3000}, 4096, 4);   // 3000 rows of 4 KiB: 12 MB
}

TEST(NcclAllToAll, OneGpuDispatchAndCombineOfAPlanEqualTheFakeOnes) {
    NcclAllToAll nccl({0});
    const DispatchPlan p = random_plan(1, 64, 128, 8, 5);
    const size_t row_bytes = 2048 * sizeof(float);
    expect_same_exchange(nccl, p.dispatch_rows, row_bytes, 6);
    expect_same_exchange(nccl, p.combine_rows, row_bytes, 7);
}

TEST(NcclAllToAll, EveryGpuOfTheMachineExchangesAsTheFakeDoes) {
    const std::vector<int> devices = all_devices();
    if (devices.size() < 2) GTEST_SKIP() << "one GPU here: the multi-GPU exchange needs a multi-GPU machine";
    NcclAllToAll nccl(devices);
    const auto W = int32_t(devices.size());
    std::printf("NCCL %s, %d GPUs\n", NcclAllToAll::version().c_str(), W);
    std::mt19937 rng(11);
    std::vector<int64_t> rows(size_t(W * W));
    for (int64_t &r : rows) r = int64_t(rng() % 5);  // some segments empty
    expect_same_exchange(nccl, rows, 256, 12);
    const DispatchPlan p = random_plan(W, 96, 128, 8, 13);
    expect_same_exchange(nccl, p.dispatch_rows, 2048 * sizeof(float), 14);
    expect_same_exchange(nccl, p.combine_rows, 2048 * sizeof(float), 15);
}

TEST(NcclAllToAll, BadDeviceListsAreClearErrors) {
    const auto error_of = [](std::vector<int> d) {
        try {
            NcclAllToAll nccl(std::move(d));
        } catch (const Error &e) {
            return std::string(e.what());
        }
        return std::string();
    };
    EXPECT_NE(error_of({0, 0}).find("CUDA device 0 is listed twice"), std::string::npos);
    EXPECT_NE(error_of({4096}).find("GPU 0 is CUDA device 4096, but there are"), std::string::npos);
    EXPECT_NE(error_of({}).find("expected 1 to 8 GPUs, got 0"), std::string::npos);
}

int main(int argc, char **argv) {
    std::string why;
    if (cuda_device_count(&why) == 0) {
        std::printf("no CUDA device (%s): NCCL tests skipped\n", why.c_str());
        return 77;
    }
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
