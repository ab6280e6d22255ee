// Segment offsets of the all-to-all and its in-process implementation.
#include "offload/all-to-all.h"

#include "core/error.h"

#include <cstring>

namespace prescope {

size_t all_to_all_send_offset(std::span<const int64_t> rows, int32_t world, int32_t s, int32_t d, size_t row_bytes) {
    int64_t n = 0;
    for (int32_t o = 0; o < d; ++o) n += rows[size_t(s * world + o)];
    return size_t(n) * row_bytes;
}

size_t all_to_all_recv_offset(std::span<const int64_t> rows, int32_t world, int32_t s, int32_t d, size_t row_bytes) {
    int64_t n = 0;
    for (int32_t o = 0; o < s; ++o) n += rows[size_t(o * world + d)];
    return size_t(n) * row_bytes;
}

FakeAllToAll::FakeAllToAll(int32_t world) : world_(world) { PRESCOPE_ASSERT(world >= 1 && world <= 8); }

void FakeAllToAll::exchange(std::span<const void *const> send, std::span<void *const> recv,
                            std::span<const int64_t> rows, size_t row_bytes) {
    const auto W = size_t(world_);
    PRESCOPE_ASSERT(send.size() == W && recv.size() == W && rows.size() == W * W);
    for (int32_t s = 0; s < world_; ++s) {
        for (int32_t d = 0; d < world_; ++d) {
            const int64_t n = rows[size_t(s) * W + size_t(d)];
            PRESCOPE_ASSERT(n >= 0);
            if (n == 0) continue;
            const size_t bytes = size_t(n) * row_bytes;
            char *to = static_cast<char *>(recv[size_t(d)]) + all_to_all_recv_offset(rows, world_, s, d, row_bytes);
            const char *from =
                static_cast<const char *>(send[size_t(s)]) + all_to_all_send_offset(rows, world_, s, d, row_bytes);
            std::memcpy(to, from, bytes);
            if (s != d) bytes_between_ += bytes;
        }
    }
    ++exchanges_;
}

} // namespace prescope
