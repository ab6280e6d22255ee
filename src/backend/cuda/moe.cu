// MoE routing kernels (moe.cuh): router top-k (one warp per token) and the expert-output combine.
#include "backend/cuda/moe.cuh"

#include "backend/cuda/common.cuh"
#include "backend/cuda/device.cuh"

#include <climits>
#include <type_traits>

namespace prescope::cuda {

namespace {

// ---------------------------------------------------------------------------------------------
// router top-k: lane l holds experts l, l + 32, ...; k rounds of a warp arg-max pick the experts.

constexpr int kRouterWarps = 4;
constexpr int kRouterMaxK = 32;

// cpu::top_k's order as one unsigned 64-bit key, larger first: the value's order bits (its bits made to sort as
// unsigned: NaN below every number, -0 as +0), then the complement of the id, so that ties go to the lower id. A
// total order, so every lane of a butterfly max ends with the same winner, in two shuffles and one comparison a
// level. Order bits 0 are below every value's (1 is NaN's): an expert already picked, or none.
__device__ __forceinline__ uint32_t order_bits(float x) {
    const uint32_t u = __float_as_uint(x);
    return isnan(x) ? 1u : x == 0.0f ? 0x80000000u : (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

/// The key of expert `id` (0..1023) with order bits `bits` (order_bits, or 0: picked or none).
__device__ __forceinline__ uint64_t rank_key(uint32_t bits, int id) { return uint64_t(bits) << 32 | uint32_t(~id); }

/// The key of expert `id` with value x.
__device__ __forceinline__ uint64_t rank_key(float x, int id) { return rank_key(order_bits(x), id); }

/// The id of a rank_key.
__device__ __forceinline__ int key_id(uint64_t key) { return int(~uint32_t(key)); }

/// The value of a rank_key (NaN as the canonical NaN, -0 as +0).
__device__ __forceinline__ float key_value(uint64_t key) {
    const uint32_t v = uint32_t(key >> 32);
    return v <= 1 ? __uint_as_float(0x7fc00000u) : __uint_as_float(v & 0x80000000u ? v & 0x7fffffffu : ~v);
}

/// The largest key of the warp: every lane ends with it.
__device__ __forceinline__ uint64_t warp_max_key(uint64_t key) {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) {
        const uint64_t other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    return key;
}

/// One lane's share of a token's routing (route_token): lane j < k holds pick j.
struct Pick {
    int id;
    float weight;
};

/// Token t's routing from its logits row, by one warp (lane l holds experts l, l + 32, ...): probs row t (or
/// nullptr), ids and weights rows t; lane j < k also returns pick j. The row is read past L1 (__ldcg): in
/// moe_router it was written by other blocks of the same launch.
template <int L>
__device__ __forceinline__ Pick route_token(const float *__restrict__ row, int64_t t, int n_expert, int k,
                                            const RouterSpec &spec, float *probs, int32_t *ids, float *weights) {
    const int lane = int(threadIdx.x) % kWarp;

    // Scores (the routing weights' source) in v, as moe_route computes them.
    float v[L];
#pragma unroll
    for (int i = 0; i < L; ++i) {
        const int e = i * kWarp + lane;
        v[i] = e < n_expert ? __ldcg(row + e) : -INFINITY;
        if (spec.logit_bias && e < n_expert) v[i] += spec.logit_bias[e];  // not + 0: -0 stays -0, as on the CPU
    }
    if (spec.score == RouterScore::SOFTMAX) {
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < L; ++i) mx = fmaxf(mx, v[i]);
        mx = warp_max(mx);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < L; ++i) {
            const int e = i * kWarp + lane;
            v[i] = e < n_expert ? expf(v[i] - mx) : 0.0f;
            sum += v[i];
        }
        sum = warp_sum(sum);
        const float inv = float(1.0 / double(sum));
#pragma unroll
        for (int i = 0; i < L; ++i) v[i] *= inv;
    } else if (spec.score == RouterScore::SIGMOID) {
#pragma unroll
        for (int i = 0; i < L; ++i) v[i] = 1.0f / (1.0f + expf(-v[i]));
    }
    if (probs != nullptr) {
#pragma unroll
        for (int i = 0; i < L; ++i) {
            const int e = i * kWarp + lane;
            if (e < n_expert) probs[t * n_expert + e] = v[i];
        }
    }

    // Choosing scores c: v plus the selection bias, outside the best groups -inf (DeepSeek-V3).
    float c[L];
#pragma unroll
    for (int i = 0; i < L; ++i) {
        const int e = i * kWarp + lane;
        c[i] = spec.select_bias && e < n_expert ? v[i] + spec.select_bias[e] : v[i];
    }
    if (spec.n_group > 1) {
        const int per_group = n_expert / spec.n_group;
        uint64_t group_key = 0;  // lane g: group g's score (the sum of its two best choosing scores) as a rank_key
        for (int g = 0; g < spec.n_group; ++g) {
            uint64_t b1 = 0, b2 = 0;  // the lane's best two of group g
#pragma unroll
            for (int i = 0; i < L; ++i) {
                const int e = i * kWarp + lane;
                if (e >= n_expert || e / per_group != g) continue;
                const uint64_t key = rank_key(c[i], e);
                if (key > b1) {
                    b2 = b1;
                    b1 = key;
                } else if (key > b2) {
                    b2 = key;
                }
            }
            // The group's best, then its second: the best of what is left once the winner is removed.
            const uint64_t w1 = warp_max_key(b1);
            const uint64_t w2 = warp_max_key(b1 == w1 ? b2 : b1);
            if (lane == g) group_key = rank_key(key_value(w1) + key_value(w2), g);
        }
        uint32_t keep = 0;
        for (int r = 0; r < spec.n_group_used; ++r)
            keep |= 1u << key_id(warp_max_key((keep >> lane) & 1u ? 0 : group_key));
#pragma unroll
        for (int i = 0; i < L; ++i) {
            const int e = i * kWarp + lane;
            if (e < n_expert && !((keep >> (e / per_group)) & 1u)) c[i] = -INFINITY;
        }
    }

    // k rounds of a warp max over the keys of c; the weight is the winner's v, from the winner's lane.
    uint32_t bits[L];  // c's order bits; 0 once picked, and for no expert
#pragma unroll
    for (int i = 0; i < L; ++i) bits[i] = i * kWarp + lane < n_expert ? order_bits(c[i]) : 0u;
    float w = 0.0f;  // lane j < k: the j-th pick's weight
    int pick_id = 0;
    for (int r = 0; r < k; ++r) {
        uint64_t best = 0;
#pragma unroll
        for (int i = 0; i < L; ++i) {
            const uint64_t key = rank_key(bits[i], i * kWarp + lane);
            best = key > best ? key : best;
        }
        best = warp_max_key(best);
        const int id = key_id(best);
        float bw = 0.0f;  // on the winner's lane: its weight
#pragma unroll
        for (int i = 0; i < L; ++i) {
            if (i * kWarp + lane == id) {
                bw = v[i];
                bits[i] = 0;
            }
        }
        bw = __shfl_sync(0xffffffffu, bw, id % kWarp);
        if (lane == r) {
            w = bw;
            pick_id = id;
        }
    }
    if (spec.softmax_topk) {
        // cpu::softmax over the k weights: max-subtracted, the sum in double in top-k order.
        float mx = lane < k ? w : -INFINITY;
        mx = warp_max(mx);
        const float ex = lane < k ? expf(w - mx) : 0.0f;
        double sum = 0.0;
        for (int j = 0; j < k; ++j) sum += double(__shfl_sync(0xffffffffu, ex, j));
        w = ex * float(1.0 / sum);
    }
    if (spec.renorm) {
        float sum = 0.0f;  // in top-k order, as the CPU sums
        for (int j = 0; j < k; ++j) sum += __shfl_sync(0xffffffffu, w, j);
        w /= sum;
    }
    if (spec.scale != 1.0f) w *= spec.scale;
    if (lane < k) {
        ids[t * k + lane] = pick_id;
        weights[t * k + lane] = w;
    }
    return {pick_id, w};
}

template <int L>
__global__ void __launch_bounds__(kRouterWarps *kWarp)
    router_topk_kernel(const float *__restrict__ logits, int64_t n_tok, int n_expert, int k, const RouterSpec spec,
                       float *probs, int32_t *ids, float *weights) {
    const int64_t t = int64_t(blockIdx.x) * kRouterWarps + threadIdx.x / kWarp;
    if (t >= n_tok) return;  // whole warps leave together
    route_token<L>(logits + t * n_expert, t, n_expert, k, spec, probs, ids, weights);
}

// ---------------------------------------------------------------------------------------------
// device-resolved hits: one block of any size; thread i owns experts [i * C, (i + 1) * C), C = ceil(n_expert /
// blockDim.x), and the block scans their pair and group counts (Hillis-Steele) to number groups and pairs in
// ascending expert id; up to 32 pairs (decode), one warp numbers them with shuffles instead.

constexpr int kResolveThreads = 256;       // resolve_device_hits_kernel's block
constexpr int kResolveMaxPerThread = 4;    // experts per thread: 1024 experts in a block of 256
constexpr int kUpdatesPerLaunch = 64;

struct UpdateBatch {
    int32_t n;
    int32_t index[kUpdatesPerLaunch];
    const void *data[kUpdatesPerLaunch];
};

/// Applies u to a.table (thread i of the block applies updates i, i + blockDim.x, ...); the caller syncs the block
/// before the table is read.
__device__ void apply_updates(const DeviceHitsArgs &a, const UpdateBatch &u) {
    for (int i = int(threadIdx.x); i < u.n; i += int(blockDim.x)) a.table[u.index[i]] = u.data[i];
}

/// Fills the tails resolve_device_hits' contract defines past the resolved groups and pairs: offsets [total_groups,
/// n_groups] = total_pairs, rows [total_pairs, n_pairs) = 0, and the combine's shared-expert entries (k_comb > k),
/// thread `i` of `n` writing every n-th entry.
__device__ void resolve_tails(const DeviceHitsArgs &a, int total_groups, int total_pairs, int i, int n) {
    const int n_pairs = int(a.n_tok * a.k);
    if (a.pair_ids && a.k_comb > a.k) {
        for (int t = i; t < a.n_tok; t += n) {
            a.pair_ids[t * a.k_comb + a.k] = n_pairs + t;
            a.weights[t * a.k_comb + a.k] = 1.0f;
        }
    }
    const int n_groups = n_pairs < a.n_expert ? n_pairs : a.n_expert;
    for (int g = total_groups + i; g <= n_groups; g += n) a.offsets[g] = total_pairs;
    for (int q = total_pairs + i; q < n_pairs; q += n) a.rows[q] = 0;
}

/// Expert e's entry in a.table's row of a.layer: its slot bytes, or nullptr (not resident, or e not an expert).
__device__ __forceinline__ const void *table_entry(const DeviceHitsArgs &a, int e) {
    return e >= 0 && e < a.n_expert ? a.table[a.layer * a.n_expert + e] : nullptr;
}

/// Resolves a (resolve_device_hits' contract) with one warp, lane p holding pair p: its expert e (INT_MAX for p >=
/// n_tok * k), routing weight w and table entry slot (table_entry(a, e), read by the caller, which may have it
/// early); for n_tok * k <= 32, the decode case, without the block's scan and its barriers. Pair p's expert is
/// resident when slot is set; the lowest pair of each resident expert leads its group; pair p's number is the count
/// of resident pairs of lower experts and of e's lower pairs, its group's the count of groups of lower experts:
/// resolve_in_block's numbering. Every lane of the warp must call it.
__device__ void resolve_in_warp(const DeviceHitsArgs &a, int e, float w, const void *slot) {
    const int lane = int(threadIdx.x) % kWarp;
    const int n_pairs = int(a.n_tok * a.k);
    const bool resident = slot != nullptr;
    int pair = 0, group = 0, total_pairs = 0, total_groups = 0;
    bool first = true;  // no lower pair has e
    for (int q = 0; q < n_pairs; ++q) {
        const int eq = __shfl_sync(0xffffffffu, e, q);
        const bool rq = __shfl_sync(0xffffffffu, int(resident), q) != 0;
        total_pairs += rq;
        pair += rq && (eq < e || (eq == e && q < lane));
        first = first && !(eq == e && q < lane);
    }
    const bool leader = resident && first;
    for (int q = 0; q < n_pairs; ++q) {
        const int eq = __shfl_sync(0xffffffffu, e, q);
        const bool lq = __shfl_sync(0xffffffffu, int(leader), q) != 0;
        total_groups += lq;
        group += lq && eq < e;
    }
    if (resident) {
        if (leader) {
            const auto *w = static_cast<const uint8_t *>(slot);
            a.gate_w[group] = w;
            a.up_w[group] = w + a.up_offset;
            a.down_w[group] = w + a.down_offset;
            a.offsets[group] = pair;
        }
        const int t = lane / int(a.k), j = lane - t * int(a.k);
        if (a.pair_ids) {
            a.pair_ids[t * a.k_comb + j] = pair;
            a.weights[t * a.k_comb + j] = w;
        }
        a.rows[pair] = int32_t(t);
    }
    resolve_tails(a, total_groups, total_pairs, lane, kWarp);
}

/// Resolves a (resolve_device_hits' contract) with the whole block, its table updates applied and visible. s_pairs,
/// s_groups: shared memory of blockDim.x ints each. Requires n_expert <= blockDim.x * kResolveMaxPerThread. Every
/// thread of the block must call it.
__device__ void resolve_in_block(const DeviceHitsArgs &a, int32_t *s_pairs, int32_t *s_groups) {
    const int tid = int(threadIdx.x), n_threads = int(blockDim.x);
    const int n_pairs = int(a.n_tok * a.k);
    if (n_pairs == 0) return;  // uniform
    if (n_pairs <= kWarp) {
        if (tid < kWarp) {
            const bool have = tid < n_pairs;
            const int e = have ? a.ids[tid] : INT_MAX;
            resolve_in_warp(a, e, have && a.pair_ids ? a.weights_in[tid] : 0.0f, table_entry(a, e));
        }
        return;
    }
    const void *const *row = a.table + a.layer * a.n_expert;
    const int per = (a.n_expert + n_threads - 1) / n_threads, e0 = tid * per;
    int count[kResolveMaxPerThread];
    int my_pairs = 0, my_groups = 0;
    for (int i = 0; i < per; ++i) {
        const int e = e0 + i;
        count[i] = 0;
        if (e >= a.n_expert || row[e] == nullptr) continue;
        for (int p = 0; p < n_pairs; ++p) count[i] += a.ids[p] == e;
        my_pairs += count[i];
        my_groups += count[i] > 0;
    }
    s_pairs[tid] = my_pairs;
    s_groups[tid] = my_groups;
    __syncthreads();
    for (int d = 1; d < n_threads; d *= 2) {
        const int vp = tid >= d ? s_pairs[tid - d] : 0, vg = tid >= d ? s_groups[tid - d] : 0;
        __syncthreads();
        s_pairs[tid] += vp;
        s_groups[tid] += vg;
        __syncthreads();
    }
    int pair = s_pairs[tid] - my_pairs, group = s_groups[tid] - my_groups;
    const int total_pairs = s_pairs[n_threads - 1], total_groups = s_groups[n_threads - 1];
    for (int i = 0; i < per; ++i) {
        if (count[i] == 0) continue;
        const int e = e0 + i;
        const auto *w = static_cast<const uint8_t *>(row[e]);
        a.gate_w[group] = w;
        a.up_w[group] = w + a.up_offset;
        a.down_w[group] = w + a.down_offset;
        a.offsets[group++] = pair;
        for (int p = 0; p < n_pairs; ++p) {
            if (a.ids[p] != e) continue;
            const int t = p / int(a.k), j = p - t * int(a.k);
            if (a.pair_ids) {
                a.pair_ids[t * a.k_comb + j] = pair;
                a.weights[t * a.k_comb + j] = a.weights_in[p];
            }
            a.rows[pair++] = int32_t(t);
        }
    }
    resolve_tails(a, total_groups, total_pairs, tid, n_threads);
}

__global__ void __launch_bounds__(kResolveThreads) resolve_device_hits_kernel(const DeviceHitsArgs a, const UpdateBatch u) {
    __shared__ int32_t s_pairs[kResolveThreads], s_groups[kResolveThreads];
    apply_updates(a, u);
    __syncthreads();  // the block's global writes are visible to the block from here
    resolve_in_block(a, s_pairs, s_groups);
}

/// The slot resolution moe_router's last block runs after the routing (on = false: none). from_routing: one token of
/// at most kFromRoutingMaxExperts experts, and a's ids and weights_in are the router's own (or weights_in unused), so
/// the routing warp resolves its picks from registers, with the table entries of its experts read while it routes.
constexpr int kFromRoutingMaxExperts = 8 * kWarp;  // 8 entries a lane: more would spill
struct RouterResolve {
    bool on, from_routing;
    DeviceHitsArgs a;
    UpdateBatch u;
};

constexpr int kMaxBlockThreads = 512;  // moe_router's block
static_assert(row_threads(int64_t(1) << 40) <= kMaxBlockThreads, "moe_router's block is row_threads(n_embd)");

// moe_router: block (b, t) of row_threads(n_embd) threads normalizes token t's row into shared memory (rms_scale,
// as rms_norm_kernel; block (0, t) also writes it to h) and computes the logits of experts b * W .. b * W + W - 1,
// W = its warps, one warp per expert with the GEMV kernel's F32 chains (lane l: chunks of 8 at l, l + 32, ..., then
// warp_sum), so h and the logits equal rms_norm + matmul bit for bit. A lane loads kRouterBatch chunks of its
// expert's row before it multiplies them (the whole 8 KiB row at n_embd 2048: one latency, not eight), the first
// batch before the norm, whose reductions then hide that load's latency. The last block to finish (a ticket counter,
// reset by it for the next launch) applies the table updates, routes every token, as router_topk, and resolves the
// slots (one token: from the routing warp's registers, RouterResolve::from_routing).
constexpr int kRouterBatch = 8;

template <int L>
__global__ void __launch_bounds__(kMaxBlockThreads)
    moe_router_kernel(const MoeRouterArgs a, const RouterSpec spec, const RouterResolve r) {
    extern __shared__ __align__(16) float hs[];  // [n_embd] token t's normalized row
    __shared__ float scratch[kWarp];
    __shared__ bool last;
    __shared__ int32_t s_pairs[kMaxBlockThreads], s_groups[kMaxBlockThreads];
    const int64_t t = blockIdx.y, n = a.n_embd;
    const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp, n_warps = int(blockDim.x) / kWarp;
    const int e = int(blockIdx.x) * n_warps + warp;
    const auto *w = reinterpret_cast<const float4 *>(a.w + int64_t(e < a.n_expert ? e : 0) * n);
    const int64_t n_chunks = n / kChunk;
    float4 wv[kRouterBatch][2];
    const auto load_batch = [&](int64_t c0) {
#pragma unroll
        for (int b = 0; b < kRouterBatch; ++b) {
            const int64_t c = c0 + int64_t(b) * kWarp;
            if (c < n_chunks) wv[b][0] = __ldg(w + 2 * c), wv[b][1] = __ldg(w + 2 * c + 1);
        }
    };
    if (e < a.n_expert) load_batch(lane);  // the router's weights: written by no kernel
    pdl_wait();
    pdl_trigger();

    const float *xr = a.x + t * n;
    const float scale = rms_scale(xr, n, a.eps, scratch);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = a.norm[i] * (xr[i] * scale);
        hs[i] = v;
        if (blockIdx.x == 0) a.h[t * n + i] = v;
    }
    __syncthreads();
    if (e < a.n_expert) {
        const auto *hv = reinterpret_cast<const float4 *>(hs);
        float acc = 0.0f;
        for (int64_t c0 = lane; c0 < n_chunks; c0 += kRouterBatch * kWarp) {
            if (c0 != lane) load_batch(c0);
#pragma unroll
            for (int b = 0; b < kRouterBatch; ++b) {
                const int64_t c = c0 + int64_t(b) * kWarp;
                if (c >= n_chunks) break;
                const float4 h0 = hv[2 * c], h1 = hv[2 * c + 1];
                const float wk[kChunk] = {wv[b][0].x, wv[b][0].y, wv[b][0].z, wv[b][0].w,
                                          wv[b][1].x, wv[b][1].y, wv[b][1].z, wv[b][1].w};
                const float hk[kChunk] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
                for (int k = 0; k < kChunk; ++k) acc = fmaf(wk[k], hk[k], acc);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) a.logits[t * a.n_expert + e] = acc;
    }
    // The last block routes: every block's logits are visible to it once its ticket is the last one.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.counter, 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (r.on) {
        apply_updates(r.a, r.u);
        __syncthreads();  // the table updates are visible to the block
    }
    if (L * kWarp <= kFromRoutingMaxExperts && r.on && r.from_routing) {
        if (warp == 0) {
            uint64_t slot[L];  // lane l: the table entries of experts l, l + 32, ..., loaded while the warp routes
#pragma unroll
            for (int i = 0; i < L; ++i) slot[i] = reinterpret_cast<uintptr_t>(table_entry(r.a, i * kWarp + lane));
            const Pick p = route_token<L>(a.logits, 0, a.n_expert, a.k, spec, nullptr, a.ids, a.weights);
            uint64_t mine = 0;  // lane j < k: pick j's entry, from the lane that holds it
#pragma unroll
            for (int i = 0; i < L; ++i) {
                const uint64_t got = __shfl_sync(0xffffffffu, slot[i], p.id % kWarp);
                if (p.id / kWarp == i) mine = got;
            }
            const bool have = lane < a.k;
            const void *pick_slot = have ? reinterpret_cast<const void *>(mine) : nullptr;
            resolve_in_warp(r.a, have ? p.id : INT_MAX, p.weight, pick_slot);
        }
    } else {
        for (int64_t tt = warp; tt < a.n_tok; tt += n_warps)
            route_token<L>(a.logits + tt * a.n_expert, tt, a.n_expert, a.k, spec, nullptr, a.ids, a.weights);
        if (r.on) {
            __syncthreads();  // the ids and weights just written are visible to the block
            resolve_in_block(r.a, s_pairs, s_groups);
        }
    }
    if (threadIdx.x == 0) *a.counter = 0;
}

// ---------------------------------------------------------------------------------------------
// combine: one thread per output element, the token's k slots read in order.

constexpr int kCombineThreads = 256;
constexpr int64_t kMaxGridY = 65535;

__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const float *__restrict__ y, const int32_t *__restrict__ pair_ids,
                       const float *__restrict__ weights, int64_t n_tok, int k, int64_t n_embd, const float *residual,
                       float *out) {
    pdl_wait();
    pdl_trigger();
    const int64_t i = int64_t(blockIdx.x) * kCombineThreads + threadIdx.x;
    if (i >= n_embd) return;
    for (int64_t t = blockIdx.y; t < n_tok; t += gridDim.y) {
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
            const int32_t p = pair_ids[t * k + j];
            if (p >= 0) acc += weights[t * k + j] * y[int64_t(p) * n_embd + i];
        }
        out[t * n_embd + i] = residual != nullptr ? residual[t * n_embd + i] + acc : acc;
    }
}

} // namespace

namespace {

void check_resolve(const DeviceHitsArgs &args, int64_t n_updates) {
    CUDA_ASSERT(args.n_expert >= 1 && args.n_expert <= kResolveThreads * kResolveMaxPerThread);
    CUDA_ASSERT(args.n_tok >= 0 && args.k >= 1 && args.n_tok * args.k < INT_MAX && n_updates >= 0);
    CUDA_ASSERT(!args.pair_ids || (args.weights_in && args.weights && (args.k_comb == args.k || args.k_comb == args.k + 1)));
}

/// Updates [begin, begin + n) of the host arrays as one launch's batch (n <= kUpdatesPerLaunch).
UpdateBatch update_batch(const int32_t *index, const void *const *data, int64_t begin, int64_t n) {
    UpdateBatch u{};
    u.n = int32_t(n);
    for (int32_t i = 0; i < u.n; ++i) {
        u.index[i] = index[begin + i];
        u.data[i] = data[begin + i];
    }
    return u;
}

} // namespace

void resolve_device_hits(const DeviceHitsArgs &args, const int32_t *index, const void *const *data, int64_t n_updates,
                         cudaStream_t stream) {
    check_resolve(args, n_updates);
    // Every batch but the last only updates the table; the last one resolves too.
    int64_t done = 0;
    do {
        const int64_t n = n_updates - done < kUpdatesPerLaunch ? n_updates - done : kUpdatesPerLaunch;
        const UpdateBatch u = update_batch(index, data, done, n);
        done += n;
        DeviceHitsArgs a = args;
        if (done < n_updates) a.n_tok = 0;
        resolve_device_hits_kernel<<<1, kResolveThreads, 0, stream>>>(a, u);
    } while (done < n_updates);
    launch_check("resolve_device_hits", stream);
}

namespace {

void check_router(int64_t n_expert, int64_t k, const RouterSpec &spec) {
    if (n_expert < 1 || n_expert > 32 * kWarp) cuda_unsupported("router_topk: n_expert must be 1..1024");
    if (k < 1 || k > kRouterMaxK || k > n_expert) cuda_unsupported("router_topk: k must be 1..min(32, n_expert)");
    if (spec.n_group < 1 || spec.n_group > kWarp || n_expert % spec.n_group != 0 || n_expert / spec.n_group < 2 ||
        spec.n_group_used < 1 || spec.n_group_used > spec.n_group) {
        cuda_unsupported("router_topk: expert groups must be 1..32, divide n_expert into groups of >= 2, and keep "
                         "1..n_group of them");
    }
}

/// run(std::integral_constant<int, L>{}) for the register slots per lane n_expert needs (L * 32 >= n_expert).
template <class F> void dispatch_slots(int64_t n_expert, F &&run) {
    const int slots = int(ceil_div(n_expert, kWarp));
    if (slots <= 1) {
        run(std::integral_constant<int, 1>{});
    } else if (slots <= 2) {
        run(std::integral_constant<int, 2>{});
    } else if (slots <= 4) {
        run(std::integral_constant<int, 4>{});
    } else if (slots <= 8) {
        run(std::integral_constant<int, 8>{});
    } else if (slots <= 16) {
        run(std::integral_constant<int, 16>{});
    } else {
        run(std::integral_constant<int, 32>{});
    }
}

} // namespace

void router_topk(const float *logits, int64_t n_tok, int64_t n_expert, int64_t k, const RouterSpec &spec,
                 float *probs, int32_t *ids, float *weights, cudaStream_t stream) {
    check_router(n_expert, k, spec);
    if (n_tok <= 0) return;
    const unsigned grid = unsigned(ceil_div(n_tok, kRouterWarps));
    const int ne = int(n_expert), kk = int(k);
    const int threads = kRouterWarps * kWarp;
    dispatch_slots(n_expert, [&](auto l) {
        constexpr int L = decltype(l)::value;
        router_topk_kernel<L><<<grid, threads, 0, stream>>>(logits, n_tok, ne, kk, spec, probs, ids, weights);
    });
    launch_check("router_topk", stream);
}

void moe_router(const MoeRouterArgs &a, const RouterSpec &spec, cudaStream_t stream, const DeviceHitsArgs *resolve,
                const int32_t *index, const void *const *data, int64_t n_updates) {
    check_router(a.n_expert, a.k, spec);
    CUDA_ASSERT(a.n_tok >= 1 && a.n_tok <= kMoeRouterMaxTokens && a.n_embd > 0 && a.n_embd % kChunk == 0);
    if (a.n_embd > kMoeRouterMaxEmbd) {
        cuda_unsupported("moe_router: n_embd must be at most 8192 (the row in shared memory)");
    }
    CUDA_ASSERT(reinterpret_cast<uintptr_t>(a.w) % 16 == 0 && a.counter != nullptr);
    const int threads = row_threads(a.n_embd);  // rms_norm_kernel's block, for its scale bit for bit
    RouterResolve r{};
    if (resolve != nullptr) {
        check_resolve(*resolve, n_updates);
        r.on = n_updates <= kUpdatesPerLaunch && resolve->n_expert <= threads * kResolveMaxPerThread;
        if (r.on) {
            r.a = *resolve;
            r.u = update_batch(index, data, 0, n_updates);
            r.from_routing = a.n_tok == 1 && a.n_expert <= kFromRoutingMaxExperts && r.a.n_tok == 1 && r.a.k == a.k &&
                             r.a.n_expert == a.n_expert && r.a.ids == a.ids &&
                             (r.a.pair_ids == nullptr || r.a.weights_in == a.weights);
        }
    }
    const dim3 grid(unsigned(ceil_div(a.n_expert, threads / kWarp)), unsigned(a.n_tok));
    dispatch_slots(a.n_expert, [&](auto l) {
        constexpr int L = decltype(l)::value;
        launch_pdl(moe_router_kernel<L>, grid, dim3(unsigned(threads)), size_t(a.n_embd) * 4, stream, a, spec, r);
    });
    launch_check("moe_router", stream);
    if (resolve != nullptr && !r.on) resolve_device_hits(*resolve, index, data, n_updates, stream);
}

namespace {

__global__ void __launch_bounds__(kCombineThreads)
    add_group_bias_kernel(float *__restrict__ y, int64_t n, const void *const *__restrict__ base, uint64_t bias_offset,
                          const int32_t *__restrict__ offsets) {
    const int64_t i = int64_t(blockIdx.x) * kCombineThreads + threadIdx.x;
    if (i >= n) return;
    const int64_t g = blockIdx.y, p0 = offsets[g], p1 = offsets[g + 1];
    if (p0 == p1) return;  // an empty group's pointer may be unset (device-resolved groups past the last)
    const float b = reinterpret_cast<const float *>(static_cast<const uint8_t *>(base[g]) + bias_offset)[i];
    for (int64_t p = p0; p < p1; ++p) y[p * n + i] += b;
}

} // namespace

void add_group_bias(float *y, int64_t n, const void *const *base, uint64_t bias_offset, const int32_t *offsets,
                    int64_t n_groups, cudaStream_t stream) {
    CUDA_ASSERT(n > 0 && n_groups >= 0 && n_groups <= kMaxGridY && bias_offset % 4 == 0);
    if (n_groups == 0) return;
    const dim3 grid(unsigned(ceil_div(n, kCombineThreads)), unsigned(n_groups));
    add_group_bias_kernel<<<grid, kCombineThreads, 0, stream>>>(y, n, base, bias_offset, offsets);
    launch_check("add_group_bias", stream);
}

void moe_combine(const float *y, const int32_t *pair_ids, const float *weights, int64_t n_tok, int64_t k,
                 int64_t n_embd, const float *residual, float *out, cudaStream_t stream) {
    CUDA_ASSERT(k >= 1 && k < INT_MAX && n_embd > 0 && n_tok >= 0);
    if (n_tok == 0) return;
    const dim3 grid(unsigned(ceil_div(n_embd, kCombineThreads)), unsigned(n_tok < kMaxGridY ? n_tok : kMaxGridY));
    launch_pdl(moe_combine_kernel, grid, dim3(kCombineThreads), 0, stream, y, pair_ids, weights, n_tok, int(k), n_embd,
               residual, out);
    launch_check("moe_combine", stream);
}

} // namespace prescope::cuda
