// Attention kernels (attention.cuh). A block takes a run of query rows (one or more tokens times the
// query heads of one KV head, up to 16 rows) and a range of keys, streamed through shared memory in
// tiles with double-buffered cp.async copies; scores, online softmax and P.V are spread over all 128
// threads. When the keys are split, each split writes an unnormalised partial output plus its running
// max and sum, and a second kernel merges them (flash-decoding).
#include "backend/cuda/attention.cuh"

#include "backend/cuda/device.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>

namespace prescope::cuda {

namespace {

constexpr int kAttnThreads = 128;
constexpr int kAttnMaxGroup = 16;  // query heads per KV head
constexpr int kAttnMaxRows = 16;   // query rows per block (tokens x heads of the group)
constexpr int kAttnMaxSplits = 64;

/// Keys per tile: 32 KB of K and V per stage (4096 floats of each), at most 64 keys.
constexpr int attn_tile(int64_t hd) { return hd >= 128 ? int(4096 / hd) : 64; }

/// Query rows per block for `rows` rows in all (n_tok x group): 4, 8 or 16.
constexpr int attn_rows(int64_t rows) { return rows <= 4 ? 4 : rows <= 8 ? 8 : kAttnMaxRows; }

// Work split of one block, all compile-time (HD: head_dim, RP: query rows, padded):
// - scores: LPK adjacent lanes share a key, each summing every LPK-th float4 of head_dim for all rows
//   (K read once from shared memory, Q broadcast); KPT keys per thread; the LPK partial sums are
//   reduced by halving exchanges, after which each lane owns RP / LPK rows of its key.
// - softmax: TPR adjacent lanes per row, over the tile's keys.
// - P.V: a thread owns one float4 column of V and every KG-th key of the tile, for all rows; the KG
//   partial outputs are summed once, after the last tile.
template <int HD, int RP>
struct AttnShape {
    static constexpr int C = HD / 4;  // float4 chunks per row
    static constexpr int T = attn_tile(HD);
    static constexpr int LPK = 128 / T > 4 ? 128 / T : 4;
    static constexpr int KSLOTS = kAttnThreads / LPK;
    static constexpr int KPT = T / KSLOTS;
    static constexpr int CPL = C / LPK;
    static constexpr int NF = RP / LPK > 0 ? RP / LPK : 1;  // rows a lane owns after the reduction
    static constexpr int TPR = kAttnThreads / RP;
    static constexpr int KG = kAttnThreads / C;
    static constexpr int PP = RP + 4;  // pitch of P rows in floats: float4-aligned, fewer bank conflicts
    static constexpr int STAGE = 2 * T * HD;  // floats of one K + V stage
    static constexpr int RED = kAttnThreads * RP * 4;  // floats of the final cross-thread sum
    static constexpr int BIG = 2 * STAGE > RED ? 2 * STAGE : RED;
    // floats: stages (or the final sum) | Q [RP][HD] | P [T][PP] | alpha [RP] | m, l [RP] | limits, lower limits
    // (int64) [RP] each
    static constexpr size_t smem_bytes() { return sizeof(float) * size_t(BIG + RP * HD + T * PP + 3 * RP) + 16 * RP; }
    static_assert(LPK * CPL == C && KSLOTS * KPT == T && KG * C == kAttnThreads && TPR <= kWarp);
    static_assert(RP % 4 == 0 && RP <= kAttnMaxRows);
};

struct AttnArgs {
    const float *q, *k, *v;
    float *out;      // [n_tok][n_head][HD] when n_split == 1
    float *part_o;   // [n_split][n_tok][n_head][HD] unnormalised partial outputs when n_split > 1
    float *part_ml;  // [n_split][n_tok][n_head][2]: running max and sum of each partial
    int64_t n_tok, pos0, n_head, n_head_kv;
    int64_t split_len;  // keys per split, a multiple of the tile
    int group;          // n_head / n_head_kv
    int tok_per_block;  // RP / group
    int n_split;        // with pos0_dev: the cap, each block's plan made from the position (splits_of)
    float scale;
    const float *sinks;  // [n_head] or null (gpt-oss)
    int64_t window;      // > 0: row at position p sees (p - window, p]
    const int32_t *pos0_dev;  // non-null: pos0 is read here, so that one launch serves every position (a CUDA
                              // graph's decode pass)
};

struct SplitPlan {
    int n_split = 1;
    int64_t split_len = 0;
};

/// The split of n_kv keys into at most `cap` splits of whole tiles of `tile` keys, none empty: as few keys per
/// split as the cap allows. The same on the host and, for a position known there only, on the device.
PRESCOPE_HOST_DEVICE inline SplitPlan splits_of(int64_t n_kv, int64_t cap, int64_t tile) {
    const int64_t tiles = ceil_div(n_kv, tile), n = cap < tiles ? cap : tiles;
    SplitPlan p;
    p.split_len = ceil_div(ceil_div(n_kv, n), tile) * tile;
    p.n_split = int(ceil_div(n_kv, p.split_len));
    return p;
}

/// Position of float4 chunk c of key row k in the K tile: odd rows swap the halves of each 128-byte
/// line, so the two keys a quarter-warp reads (64 bytes each) fall on different banks.
template <int C>
__device__ __forceinline__ int k_slot(int k, int c) {
    if constexpr (C >= 8) return k * C + (c ^ ((k & 1) << 2));
    return k * C + c;
}

/// Sums N partial values over the LPK adjacent lanes that share a key (lanes at distance O and up), by
/// halving exchanges: each step keeps the half of the values chosen by the lane's bit O and adds the
/// partner's partial of that half. On return v[0, max(1, N / (LPK / O))) holds full sums of the values
/// that started at [base, ...). Recursive so that every loop bound is a compile-time constant (a loop
/// over the steps left v in local memory).
template <int R, int N, int O, int LPK>
__device__ __forceinline__ void reduce_key_lanes(float (&v)[R], int j, int &base) {
    if constexpr (O < LPK) {
        if constexpr (N > 1) {
            const bool hi = (j & O) != 0;
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                const float send = hi ? v[i] : v[i + N / 2];
                const float keep = hi ? v[i + N / 2] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
            }
            if (hi) base += N / 2;
            reduce_key_lanes<R, N / 2, 2 * O, LPK>(v, j, base);
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
            reduce_key_lanes<R, 1, 2 * O, LPK>(v, j, base);
        }
    }
}

template <int HD, int RP>
__global__ void __launch_bounds__(kAttnThreads, 2) attention_kernel(const AttnArgs a) {
    using S = AttnShape<HD, RP>;
    constexpr int C = S::C, T = S::T, LPK = S::LPK, KPT = S::KPT, PP = S::PP;
    extern __shared__ __align__(16) float sm[];
    float *stage = sm, *qs = sm + S::BIG, *ps = qs + RP * HD, *al = ps + T * PP, *ml = al + RP, *ll = ml + RP;
    int64_t *lim = reinterpret_cast<int64_t *>(ll + RP);  // 8-byte aligned: every part above is a multiple of 8 B
    pdl_wait();  // launched by launch_pdl
    pdl_trigger();
    const int tid = int(threadIdx.x);
    const int G = a.group, kvh = int(blockIdx.y), split = int(blockIdx.z);
    const int64_t pos0 = a.pos0_dev != nullptr ? int64_t(*a.pos0_dev) : a.pos0;
    const SplitPlan plan =
        a.pos0_dev != nullptr ? splits_of(pos0 + a.n_tok, a.n_split, T) : SplitPlan{a.n_split, a.split_len};
    if (split >= plan.n_split) return;  // a launch sized for the cap (uniform over the block)
    const int64_t t0 = int64_t(blockIdx.x) * a.tok_per_block;
    const int64_t n_tok_blk = min(int64_t(a.tok_per_block), a.n_tok - t0);
    const int rows = int(n_tok_blk) * G;  // valid rows; row r is token t0 + r / G, head kvh * G + r % G
    const int64_t k_begin = int64_t(split) * plan.split_len;
    const int64_t k_end = min(pos0 + t0 + n_tok_blk, k_begin + plan.split_len);  // causal bound of the last row
    const int64_t n_tiles = k_end > k_begin ? ceil_div(k_end - k_begin, T) : 0;
    const int64_t kv_stride = a.n_head_kv * HD;  // floats from one position to the next

    // K and V tile: n_keys rows from position k0 into stage buffer `buf`, 16 bytes per copy.
    auto load_tile = [&](int64_t k0, int n_keys, int buf) {
        float4 *kd = reinterpret_cast<float4 *>(stage + buf * S::STAGE), *vd = kd + T * C;
        for (int e = tid; e < n_keys * C; e += kAttnThreads) {
            const int k = e / C, c = e % C;
            const int64_t off = (k0 + k) * kv_stride + int64_t(kvh) * HD + 4 * c;
            cp_async_16(kd + k_slot<C>(k, c), a.k + off);
            cp_async_16(vd + k * C + c, a.v + off);
        }
        cp_async_commit();
    };
    if (n_tiles > 0) load_tile(k_begin, int(min(int64_t(T), k_end - k_begin)), 0);

    // Q rows, pre-scaled (zero for padding rows), and each row's causal limit.
    for (int e = tid; e < RP * C; e += kAttnThreads) {
        const int r = e / C, c = e % C;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < rows) {
            const int64_t row = (t0 + r / G) * a.n_head + int64_t(kvh) * G + r % G;
            v = reinterpret_cast<const float4 *>(a.q + row * HD)[c];
            v.x *= a.scale, v.y *= a.scale, v.z *= a.scale, v.w *= a.scale;
        }
        reinterpret_cast<float4 *>(qs)[e] = v;
    }
    if (tid < RP) lim[tid] = tid < rows ? pos0 + t0 + tid / G + 1 : 0;
    int64_t *lo = lim + RP;  // first position each row sees (sliding window)
    if (tid < RP) lo[tid] = a.window > 0 && tid < rows ? max(int64_t(0), lim[tid] - a.window) : 0;

    const int srow = tid / S::TPR, skk = tid % S::TPR;  // softmax: row and lane within the row's group
    // A sink joins its row's denominator once, in split 0: the row starts as if it had seen a score of sink with
    // weight exp(0) and no value (cpu::attention).
    const bool sink = a.sinks != nullptr && split == 0 && srow < rows;
    float m_run = sink ? a.sinks[int64_t(kvh) * G + srow % G] : -INFINITY, l_run = sink ? 1.0f : 0.0f;
    const int pc = tid % C, pkg = tid / C;  // P.V: float4 column and key group
    float4 acc[RP];
#pragma unroll
    for (int r = 0; r < RP; ++r) acc[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    for (int64_t it = 0; it < n_tiles; ++it) {
        const int64_t k0 = k_begin + it * T;
        const int n_keys = int(min(int64_t(T), k_end - k0));
        const bool more = it + 1 < n_tiles;
        if (more) load_tile(k0 + T, int(min(int64_t(T), k_end - k0 - T)), int((it + 1) & 1));
        if (more) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();  // tile `it` (and on the first pass Q and the limits) visible to all
        const float4 *ks = reinterpret_cast<const float4 *>(stage + (it & 1) * S::STAGE), *vs = ks + T * C;

        // Scores S[k][r] = q_r . k_k, masked to -inf past the split or the row's causal limit.
        {
            const int j = tid % LPK, kslot = tid / LPK;
            float s[KPT][RP];
#pragma unroll
            for (int u = 0; u < KPT; ++u)
#pragma unroll
                for (int r = 0; r < RP; ++r) s[u][r] = 0.0f;
            const float4 *q4 = reinterpret_cast<const float4 *>(qs);
#pragma unroll
            for (int i = 0; i < S::CPL; ++i) {
                const int c = i * LPK + j;
                float4 kv[KPT];
#pragma unroll
                for (int u = 0; u < KPT; ++u) kv[u] = ks[k_slot<C>(kslot + u * S::KSLOTS, c)];
#pragma unroll
                for (int r = 0; r < RP; ++r) {
                    const float4 qv = q4[r * C + c];
#pragma unroll
                    for (int u = 0; u < KPT; ++u) {
                        s[u][r] = fmaf(qv.x, kv[u].x, s[u][r]);
                        s[u][r] = fmaf(qv.y, kv[u].y, s[u][r]);
                        s[u][r] = fmaf(qv.z, kv[u].z, s[u][r]);
                        s[u][r] = fmaf(qv.w, kv[u].w, s[u][r]);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < KPT; ++u) {
                int base = 0;
                reduce_key_lanes<RP, RP, 1, LPK>(s[u], j, base);
                const int k = kslot + u * S::KSLOTS;
#pragma unroll
                for (int i = 0; i < S::NF; ++i) {
                    const int r = base + i;
                    ps[k * PP + r] = k < n_keys && k0 + k < lim[r] && k0 + k >= lo[r] ? s[u][i] : -INFINITY;
                }
            }
        }
        __syncthreads();

        // Online softmax per row: new running max, P = exp(S - max) in place, rescale factor alpha.
        {
            float mx = -INFINITY;
            for (int k = skk; k < T; k += S::TPR) mx = fmaxf(mx, ps[k * PP + srow]);
#pragma unroll
            for (int o = S::TPR / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m_run, mx);
            const bool none = m_new == -INFINITY;  // no key of this row yet: P = 0, nothing to rescale
            const float alpha = none ? 1.0f : expf(m_run - m_new);
            float sum = 0.0f;
            for (int k = skk; k < T; k += S::TPR) {
                const float p = none ? 0.0f : expf(ps[k * PP + srow] - m_new);
                ps[k * PP + srow] = p;
                sum += p;
            }
#pragma unroll
            for (int o = S::TPR / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l_run = l_run * alpha + sum;
            m_run = m_new;
            if (skk == 0) al[srow] = alpha;
        }
        __syncthreads();

        // O = O * alpha + P V over this thread's keys.
        {
#pragma unroll
            for (int r = 0; r < RP; ++r) {
                const float f = al[r];
                acc[r].x *= f, acc[r].y *= f, acc[r].z *= f, acc[r].w *= f;
            }
            for (int k = pkg; k < n_keys; k += S::KG) {
                const float4 v = vs[k * C + pc];
                const float4 *p4 = reinterpret_cast<const float4 *>(ps + k * PP);
#pragma unroll
                for (int q = 0; q < RP / 4; ++q) {
                    const float4 p = p4[q];
                    const float pr[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float4 &o = acc[4 * q + i];
                        o.x = fmaf(pr[i], v.x, o.x), o.y = fmaf(pr[i], v.y, o.y);
                        o.z = fmaf(pr[i], v.z, o.z), o.w = fmaf(pr[i], v.w, o.w);
                    }
                }
            }
        }
        __syncthreads();  // the next tile overwrites P and alpha, and its copies refill this stage
    }

    // Sum the key groups' partial outputs (the stage buffers are free now), then write.
    __syncthreads();
    float4 *red = reinterpret_cast<float4 *>(stage);
#pragma unroll
    for (int r = 0; r < RP; ++r) red[(pkg * RP + r) * C + pc] = acc[r];
    if (skk == 0) ml[srow] = m_run, ll[srow] = l_run;
    __syncthreads();
    for (int e = tid; e < RP * C; e += kAttnThreads) {
        const int r = e / C, c = e % C;
        if (r >= rows) continue;
        float4 o = red[r * C + c];
        for (int g = 1; g < S::KG; ++g) {
            const float4 x = red[(g * RP + r) * C + c];
            o.x += x.x, o.y += x.y, o.z += x.z, o.w += x.w;
        }
        const int64_t row = (t0 + r / G) * a.n_head + int64_t(kvh) * G + r % G;  // t * n_head + h
        if (plan.n_split == 1) {
            const float inv = 1.0f / ll[r];
            o.x *= inv, o.y *= inv, o.z *= inv, o.w *= inv;
            reinterpret_cast<float4 *>(a.out + row * HD)[c] = o;
        } else {
            const int64_t prow = int64_t(split) * a.n_tok * a.n_head + row;
            reinterpret_cast<float4 *>(a.part_o + prow * HD)[c] = o;
            if (c == 0) a.part_ml[prow * 2] = ml[r], a.part_ml[prow * 2 + 1] = ll[r];
        }
    }
}

// Merges the splits of one (token, head): out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M). Warp 0
// turns the splits' (m, l) into weights; then the threads sum the partials, one element of head_dim each in turn.
// Splits that saw no key (m = -inf, l = 0, o = 0) weigh 0; split 0 always holds key 0, so M is finite.
// With pos0_dev, n_split is the cap and the count comes from the position (splits_of); one split wrote out itself.
__global__ void __launch_bounds__(256) attention_merge_kernel(const float *__restrict__ part_o,
                                                              const float *__restrict__ part_ml, int64_t n_tok,
                                                              int64_t n_head, int hd, int n_split, float *out,
                                                              const int32_t *pos0_dev, int tile) {
    static_assert(kAttnMaxSplits <= 2 * kWarp);
    pdl_wait();  // launched by launch_pdl
    pdl_trigger();
    if (pos0_dev != nullptr) n_split = splits_of(int64_t(*pos0_dev) + n_tok, n_split, tile).n_split;
    if (n_split == 1) return;
    __shared__ float w[kAttnMaxSplits];
    const int64_t th = int64_t(blockIdx.x);  // t * n_head + h
    const int64_t stride = n_tok * n_head;   // from one split's partial to the next
    if (threadIdx.x < kWarp) {
        const int s0 = int(threadIdx.x), s1 = s0 + kWarp;
        const float m0 = s0 < n_split ? part_ml[(s0 * stride + th) * 2] : -INFINITY;
        const float m1 = s1 < n_split ? part_ml[(s1 * stride + th) * 2] : -INFINITY;
        const float mx = warp_max(fmaxf(m0, m1));
        const float w0 = m0 == -INFINITY ? 0.0f : expf(m0 - mx) * part_ml[(s0 * stride + th) * 2 + 1];
        const float w1 = m1 == -INFINITY ? 0.0f : expf(m1 - mx) * part_ml[(s1 * stride + th) * 2 + 1];
        const float l = warp_sum(w0 + w1);
        if (s0 < n_split) w[s0] = m0 == -INFINITY ? 0.0f : expf(m0 - mx) / l;
        if (s1 < n_split) w[s1] = m1 == -INFINITY ? 0.0f : expf(m1 - mx) / l;
    }
    __syncthreads();
    for (int d = int(threadIdx.x); d < hd; d += int(blockDim.x)) {
        float o = 0.0f;
#pragma unroll 8
        for (int s = 0; s < n_split; ++s) o = fmaf(w[s], part_o[(s * stride + th) * hd + d], o);
        out[th * hd + d] = o;
    }
}

/// Threads of a merge block for rows of hd floats: one per float, at least a warp, at most 256.
unsigned merge_threads(int64_t hd) { return unsigned(hd < kWarp ? kWarp : hd > 256 ? 256 : hd); }

size_t split_bytes(int n_split, int64_t n_tok, int64_t n_head, int64_t head_dim) {
    if (n_split <= 1) return 0;
    const size_t per = size_t(n_tok * n_head);
    return align_256(sizeof(float) * per * size_t(n_split) * size_t(head_dim)) +
           align_256(sizeof(float) * per * size_t(n_split) * 2);
}

// Splits the keys when the (row block, KV head) blocks alone would fill less than two waves of the GPU:
// enough splits for two waves, at most kAttnMaxSplits, and no more than fit in `ws_bytes` (SIZE_MAX: no limit);
// splits_of then keeps at least one tile in each. The cap does not depend on the position.
int64_t split_cap(int64_t n_tok, int64_t n_head, int64_t n_head_kv, int64_t head_dim, size_t ws_bytes) {
    const int64_t group = n_head / n_head_kv;
    const int64_t tok_per_block = attn_rows(n_tok * group) / group;
    const int64_t blocks = ceil_div(n_tok, tok_per_block) * n_head_kv;
    const int64_t want = 2 * int64_t(sm_count());
    int64_t n = std::min(blocks < want ? ceil_div(want, blocks) : 1, int64_t(kAttnMaxSplits));
    while (n > 1 && split_bytes(int(n), n_tok, n_head, head_dim) > ws_bytes) --n;
    return n;
}

SplitPlan plan_splits(int64_t n_tok, int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                      size_t ws_bytes) {
    return splits_of(pos0 + n_tok, split_cap(n_tok, n_head, n_head_kv, head_dim, ws_bytes), attn_tile(head_dim));
}

template <int HD, int RP>
void launch_attention(const AttnArgs &a, cudaStream_t stream) {
    constexpr size_t smem = AttnShape<HD, RP>::smem_bytes();
    if constexpr (smem > 48 * 1024) raise_dynamic_smem(reinterpret_cast<const void *>(attention_kernel<HD, RP>), smem);
    const dim3 grid(unsigned(ceil_div(a.n_tok, a.tok_per_block)), unsigned(a.n_head_kv), unsigned(a.n_split));
    launch_pdl(attention_kernel<HD, RP>, grid, dim3(kAttnThreads), smem, stream, a);
}

template <int HD>
void launch_attention_rows(const AttnArgs &a, cudaStream_t stream) {
    switch (attn_rows(a.n_tok * a.group)) {
    case 4: launch_attention<HD, 4>(a, stream); break;
    case 8: launch_attention<HD, 8>(a, stream); break;
    default: launch_attention<HD, kAttnMaxRows>(a, stream); break;
    }
}

// ---------------------------------------------------------------------------------------------
// Latent (MLA) attention: a block takes one token, up to kLatHeads query heads and one split of its keys; tiles
// of kLatKeys cached rows go through shared memory (rows padded by one float, so the keys one warp scores fall on
// distinct banks); thread (head, key) scores, a warp per head updates the online softmax, and thread i owns value
// columns i, i + 256, ... of every head.

constexpr int kLatThreads = 256;
constexpr int kLatHeads = 16;
constexpr int kLatKeys = 16;
constexpr int64_t kLatMaxDk = 1024;

struct LatentArgs {
    const float *q, *cache;
    float *out, *part_o, *part_ml;
    int64_t n_tok, pos0, n_head, dk, dv, split_len;
    int n_split;
    float scale;
};

size_t latent_smem_bytes(int64_t dk) {
    return sizeof(float) * size_t((kLatHeads + kLatKeys) * (dk + 1) + kLatHeads * kLatKeys + 3 * kLatHeads);
}

template <int NC>
__global__ void __launch_bounds__(kLatThreads) attention_latent_kernel(const LatentArgs a) {
    extern __shared__ __align__(16) float sm[];
    const int64_t dkp = a.dk + 1;
    float *qs = sm, *ks = qs + kLatHeads * dkp, *ps = ks + kLatKeys * dkp, *mh = ps + kLatHeads * kLatKeys;
    float *lh = mh + kLatHeads, *al = lh + kLatHeads;
    const int tid = int(threadIdx.x), lane = tid % kWarp, warp = tid / kWarp;
    const int64_t t = blockIdx.x, h0 = int64_t(blockIdx.y) * kLatHeads;
    const int nh = int(min(int64_t(kLatHeads), a.n_head - h0));
    const int split = int(blockIdx.z);
    const int64_t n_kv = a.pos0 + t + 1;  // causal: positions 0 ..= pos0 + t
    const int64_t k_begin = int64_t(split) * a.split_len, k_end = min(n_kv, k_begin + a.split_len);

    for (int64_t i = tid; i < int64_t(nh) * a.dk; i += kLatThreads) {
        const int64_t h = i / a.dk, c = i % a.dk;
        qs[h * dkp + c] = a.q[(t * a.n_head + h0 + h) * a.dk + c];
    }
    if (tid < kLatHeads) {
        mh[tid] = -INFINITY;
        lh[tid] = 0.0f;
    }
    float acc[NC][kLatHeads];
#pragma unroll
    for (int ci = 0; ci < NC; ++ci)
#pragma unroll
        for (int h = 0; h < kLatHeads; ++h) acc[ci][h] = 0.0f;

    for (int64_t k0 = k_begin; k0 < k_end; k0 += kLatKeys) {
        const int nk = int(min(int64_t(kLatKeys), k_end - k0));
        __syncthreads();  // the previous tile's readers are done (and q is in place)
        for (int64_t i = tid; i < int64_t(nk) * a.dk; i += kLatThreads) {
            ks[(i / a.dk) * dkp + i % a.dk] = a.cache[k0 * a.dk + i];
        }
        __syncthreads();
        for (int idx = tid; idx < nh * kLatKeys; idx += kLatThreads) {
            const int h = idx / kLatKeys, j = idx % kLatKeys;
            float dot = 0.0f;
            if (j < nk) {
                const float *qr = qs + h * dkp, *kr = ks + j * dkp;
                for (int64_t c = 0; c < a.dk; ++c) dot = fmaf(qr[c], kr[c], dot);
            }
            ps[h * kLatKeys + j] = j < nk ? dot * a.scale : -INFINITY;
        }
        __syncthreads();
        for (int h = warp; h < nh; h += kLatThreads / kWarp) {
            const float sc = lane < kLatKeys ? ps[h * kLatKeys + lane] : -INFINITY;
            const float m_old = mh[h], m_new = fmaxf(m_old, warp_max(sc));
            const float p = lane < nk ? expf(sc - m_new) : 0.0f;
            const float sum = warp_sum(p);
            if (lane < kLatKeys) ps[h * kLatKeys + lane] = p;
            if (lane == 0) {
                const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                al[h] = alpha;
                lh[h] = lh[h] * alpha + sum;
                mh[h] = m_new;
            }
        }
        __syncthreads();
#pragma unroll
        for (int ci = 0; ci < NC; ++ci) {
            const int64_t d = tid + ci * kLatThreads;
            if (d >= a.dv) continue;
#pragma unroll
            for (int h = 0; h < kLatHeads; ++h) acc[ci][h] *= h < nh ? al[h] : 0.0f;
            for (int j = 0; j < nk; ++j) {
                const float v = ks[j * dkp + d];
#pragma unroll
                for (int h = 0; h < kLatHeads; ++h) {  // rows past nh were never scored: not read
                    acc[ci][h] = fmaf(h < nh ? ps[h * kLatKeys + j] : 0.0f, v, acc[ci][h]);
                }
            }
        }
    }
    __syncthreads();  // lh / mh final
#pragma unroll
    for (int ci = 0; ci < NC; ++ci) {
        const int64_t d = tid + ci * kLatThreads;
        if (d >= a.dv) continue;
#pragma unroll
        for (int h = 0; h < kLatHeads; ++h) {
            if (h >= nh) continue;
            const int64_t th = t * a.n_head + h0 + h;
            if (a.n_split == 1) {
                a.out[th * a.dv + d] = acc[ci][h] / lh[h];
            } else {
                const int64_t row = int64_t(split) * a.n_tok * a.n_head + th;
                a.part_o[row * a.dv + d] = acc[ci][h];
                if (d == 0) {
                    a.part_ml[row * 2] = mh[h];
                    a.part_ml[row * 2 + 1] = lh[h];
                }
            }
        }
    }
}

/// Splits a latent attention's keys until the (token, head group) blocks fill two waves of the GPU (as
/// plan_splits), at most kAttnMaxSplits and as many as fit in ws_bytes.
SplitPlan latent_splits(int64_t n_tok, int64_t pos0, int64_t n_head, int64_t dv, size_t ws_bytes) {
    const int64_t n_kv = pos0 + n_tok, blocks = n_tok * ceil_div(n_head, kLatHeads);
    const int64_t want = 2 * int64_t(sm_count());
    int64_t n = blocks < want ? ceil_div(want, blocks) : 1;
    n = std::min({n, ceil_div(n_kv, kLatKeys), int64_t(kAttnMaxSplits)});
    while (n > 1 && split_bytes(int(n), n_tok, n_head, dv) > ws_bytes) --n;
    SplitPlan p;
    p.split_len = ceil_div(ceil_div(n_kv, n), kLatKeys) * kLatKeys;
    p.n_split = int(ceil_div(n_kv, p.split_len));
    return p;
}

} // namespace

size_t attention_workspace_bytes(int64_t n_tok, int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim) {
    if (n_tok <= 0 || n_head_kv < 1 || n_head % n_head_kv != 0 || n_head / n_head_kv > kAttnMaxGroup) return 0;
    switch (head_dim) {
    case 16: case 32: case 64: case 128: case 256: break;
    default: return 0;
    }
    return split_bytes(plan_splits(n_tok, pos0, n_head, n_head_kv, head_dim, SIZE_MAX).n_split, n_tok, n_head,
                       head_dim);
}

void attention(const float *q, const float *k_cache, const float *v_cache, int64_t n_tok, int64_t pos0, int64_t n_head,
               int64_t n_head_kv, int64_t head_dim, float scale, float *out, Workspace ws, cudaStream_t stream,
               const float *sinks, int64_t window, const int32_t *pos0_dev) {
    if (n_head_kv < 1 || n_head % n_head_kv != 0 || n_head / n_head_kv > kAttnMaxGroup || n_head_kv > 65535) {
        char msg[160];
        std::snprintf(msg, sizeof msg, "attention: %lld query heads over %lld KV heads (at most %d per KV head)",
                      (long long)n_head, (long long)n_head_kv, kAttnMaxGroup);
        cuda_unsupported(msg);
    }
    CUDA_ASSERT(n_tok >= 0 && n_tok < (int64_t(1) << 31) && pos0 >= 0);
    for (const void *p : {static_cast<const void *>(q), static_cast<const void *>(k_cache),
                          static_cast<const void *>(v_cache), static_cast<const void *>(out)})
        CUDA_ASSERT(reinterpret_cast<uintptr_t>(p) % 16 == 0);
    if (n_tok == 0) return;
    if (head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 128 && head_dim != 256) {
        char msg[96];
        std::snprintf(msg, sizeof msg, "attention: head_dim %lld has no kernel (16, 32, 64, 128, 256)",
                      (long long)head_dim);
        cuda_unsupported(msg);
    }

    const int group = int(n_head / n_head_kv);
    const size_t ws_bytes = ws.ptr != nullptr ? ws.bytes : 0;
    // A position read on the device: the launch is sized for the cap and each block finds its plan.
    const SplitPlan plan = pos0_dev != nullptr
                               ? SplitPlan{int(split_cap(n_tok, n_head, n_head_kv, head_dim, ws_bytes)), 0}
                               : plan_splits(n_tok, pos0, n_head, n_head_kv, head_dim, ws_bytes);
    CUDA_ASSERT(window >= 0);
    AttnArgs a{q, k_cache, v_cache, out, nullptr, nullptr, n_tok, pos0, n_head, n_head_kv, plan.split_len, group,
               attn_rows(n_tok * group) / group, plan.n_split, scale, sinks, window, pos0_dev};
    if (plan.n_split > 1) {
        a.part_o = static_cast<float *>(ws.ptr);
        a.part_ml = reinterpret_cast<float *>(static_cast<uint8_t *>(ws.ptr) +
                                              align_256(sizeof(float) * size_t(n_tok * n_head) * size_t(plan.n_split) *
                                                        size_t(head_dim)));
    }
    switch (head_dim) {
    case 16: launch_attention_rows<16>(a, stream); break;
    case 32: launch_attention_rows<32>(a, stream); break;
    case 64: launch_attention_rows<64>(a, stream); break;
    case 128: launch_attention_rows<128>(a, stream); break;
    default: launch_attention_rows<256>(a, stream); break;
    }
    if (plan.n_split > 1)
        launch_pdl(attention_merge_kernel, dim3(unsigned(n_tok * n_head)), dim3(unsigned(merge_threads(head_dim))), 0,
                   stream, a.part_o, a.part_ml, n_tok, n_head, int(head_dim), plan.n_split, out, pos0_dev,
                   attn_tile(head_dim));
    launch_check("attention", stream);
}

size_t attention_latent_workspace_bytes(int64_t n_tok, int64_t pos0, int64_t n_head, int64_t dv) {
    if (n_tok <= 0 || n_head <= 0 || dv <= 0) return 0;
    return split_bytes(latent_splits(n_tok, pos0, n_head, dv, SIZE_MAX).n_split, n_tok, n_head, dv);
}

void attention_latent(const float *q, const float *cache, int64_t n_tok, int64_t pos0, int64_t n_head, int64_t dk,
                      int64_t dv, float scale, float *out, Workspace ws, cudaStream_t stream) {
    if (dk < 1 || dk > kLatMaxDk || dv < 1 || dv > dk || dv > 4 * kLatThreads || n_head < 1 ||
        ceil_div(n_head, kLatHeads) > 65535) {
        char msg[160];
        std::snprintf(msg, sizeof msg, "attention_latent: rows of %lld with values of %lld, %lld heads (rows up to %lld, "
                      "values up to the row and 1024)", (long long)dk, (long long)dv, (long long)n_head,
                      (long long)kLatMaxDk);
        cuda_unsupported(msg);
    }
    CUDA_ASSERT(n_tok >= 0 && n_tok < (int64_t(1) << 31) && pos0 >= 0);
    if (n_tok == 0) return;
    const SplitPlan plan = latent_splits(n_tok, pos0, n_head, dv, ws.ptr != nullptr ? ws.bytes : 0);
    LatentArgs a{q, cache, out, nullptr, nullptr, n_tok, pos0, n_head, dk, dv, plan.split_len, plan.n_split, scale};
    if (plan.n_split > 1) {
        a.part_o = static_cast<float *>(ws.ptr);
        a.part_ml = reinterpret_cast<float *>(static_cast<uint8_t *>(ws.ptr) +
                                              align_256(sizeof(float) * size_t(n_tok * n_head) * size_t(plan.n_split) *
                                                        size_t(dv)));
    }
    const size_t smem = latent_smem_bytes(dk);
    const dim3 grid(unsigned(n_tok), unsigned(ceil_div(n_head, kLatHeads)), unsigned(plan.n_split));
    auto launch = [&](auto nc) {
        constexpr int NC = decltype(nc)::value;
        if (smem > 48 * 1024) raise_dynamic_smem(reinterpret_cast<const void *>(attention_latent_kernel<NC>), smem);
        attention_latent_kernel<NC><<<grid, kLatThreads, smem, stream>>>(a);
    };
    if (dv <= kLatThreads) {
        launch(std::integral_constant<int, 1>{});
    } else if (dv <= 2 * kLatThreads) {
        launch(std::integral_constant<int, 2>{});
    } else {
        launch(std::integral_constant<int, 4>{});
    }
    if (plan.n_split > 1)
        launch_pdl(attention_merge_kernel, dim3(unsigned(n_tok * n_head)), dim3(unsigned(merge_threads(dv))), 0, stream,
                   a.part_o, a.part_ml, n_tok, n_head, int(dv), plan.n_split, out, nullptr, 0);
    launch_check("attention_latent", stream);
}

} // namespace prescope::cuda
