// Attention kernels (attention.cuh). A block handles one query token and one KV head with all the
// query heads that share it (GQA: each K/V tile is read once for the group), walking its keys in tiles
// of 32 through shared memory with an online softmax. When the keys are split, each split writes an
// unnormalised partial output plus its running max and sum, and a second kernel merges them.
#include "backend/cuda/attention.cuh"

#include "backend/cuda/device.cuh"

#include <cstdio>

namespace prescope::cuda {

namespace {

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / kWarp;
constexpr int kAttnTile = kWarp;    // keys per tile: one per lane when scoring
constexpr int kAttnMaxGroup = 16;   // query heads per KV head
constexpr int kAttnMaxSplits = 64;
constexpr int64_t kAttnMinSplitKeys = 128;

struct AttnArgs {
    const float *q, *k, *v;
    float *out;      // [n_tok][n_head][HD] when n_split == 1
    float *part_o;   // [n_split][n_tok][n_head][HD] unnormalised partial outputs when n_split > 1
    float *part_ml;  // [n_split][n_tok][n_head][2]: running max and sum of each partial
    int64_t n_tok, pos0, n_head, n_head_kv;
    int64_t split_len;  // keys per split, a multiple of kAttnTile
    int group;          // n_head / n_head_kv
    int n_split;
    float scale;
};

// Shared memory, in floats: Q [group][HD], K tile [32][HD + 1] (padded: lanes read different keys at the
// same column), V tile [32][HD], P [group][32], then running max, sum and rescale factor per head.
size_t attn_smem_bytes(int hd, int group) {
    return sizeof(float) * size_t(group * hd + kAttnTile * (hd + 1) + kAttnTile * hd + group * kAttnTile + 3 * group);
}

template <int HD>
__global__ void __launch_bounds__(kAttnThreads, 2) attention_kernel(const AttnArgs a) {
    extern __shared__ __align__(16) float sm[];
    const int G = a.group;
    float *qs = sm, *ks = qs + G * HD, *vs = ks + kAttnTile * (HD + 1), *ps = vs + kAttnTile * HD;
    float *ms = ps + G * kAttnTile, *ls = ms + G, *as = ls + G;
    const int tid = int(threadIdx.x), warp = tid / kWarp, lane = tid % kWarp;
    const int64_t t = blockIdx.x;
    const int kvh = int(blockIdx.y), split = int(blockIdx.z);
    const int64_t n_kv = a.pos0 + t + 1;  // causal: this token sees keys [0, n_kv)
    const int64_t k_begin = int64_t(split) * a.split_len;
    const int64_t k_end = min(n_kv, k_begin + a.split_len);
    const int64_t kv_stride = a.n_head_kv * HD;  // floats from one position to the next
    const int64_t h0 = int64_t(kvh) * G;         // first query head of the group

    const float *qt = a.q + (t * a.n_head + h0) * HD;
    for (int i = tid; i < G * HD; i += kAttnThreads) qs[i] = qt[i] * a.scale;
    for (int g = tid; g < G; g += kAttnThreads) {
        ms[g] = -INFINITY;
        ls[g] = 0.0f;
    }
    constexpr int kElems = kAttnMaxGroup * HD / kAttnThreads;  // output elements per thread, at most
    float acc[kElems];
#pragma unroll
    for (int j = 0; j < kElems; ++j) acc[j] = 0.0f;
    __syncthreads();

    for (int64_t k0 = k_begin; k0 < k_end; k0 += kAttnTile) {
        const int n_keys = int(min(int64_t(kAttnTile), k_end - k0));
        constexpr int kVecs = HD / 4;
        for (int i = tid; i < n_keys * kVecs; i += kAttnThreads) {
            const int r = i / kVecs, c = i % kVecs;
            const int64_t off = (k0 + r) * kv_stride + int64_t(kvh) * HD + c * 4;
            const float4 kv = __ldg(reinterpret_cast<const float4 *>(a.k + off));
            const float4 vv = __ldg(reinterpret_cast<const float4 *>(a.v + off));
            float *kd = ks + r * (HD + 1) + c * 4;
            kd[0] = kv.x, kd[1] = kv.y, kd[2] = kv.z, kd[3] = kv.w;
            reinterpret_cast<float4 *>(vs + r * HD)[c] = vv;
        }
        __syncthreads();

        for (int g = warp; g < G; g += kAttnWarps) {
            float s = -INFINITY;
            if (lane < n_keys) {
                const float *qg = qs + g * HD, *kr = ks + lane * (HD + 1);
                float d = 0.0f;
#pragma unroll 16
                for (int i = 0; i < HD; ++i) d = fmaf(qg[i], kr[i], d);
                s = d;
            }
            const float m_old = ms[g];
            const float m_new = fmaxf(m_old, warp_max(s));
            const float p = lane < n_keys ? expf(s - m_new) : 0.0f;
            const float alpha = expf(m_old - m_new);  // 0 on the first tile (m_old = -inf)
            const float l_new = ls[g] * alpha + warp_sum(p);
            ps[g * kAttnTile + lane] = p;
            __syncwarp();  // every lane has read ms[g], ls[g] before lane 0 replaces them
            if (lane == 0) {
                ms[g] = m_new;
                ls[g] = l_new;
                as[g] = alpha;
            }
        }
        __syncthreads();

        // O = O * alpha + P V; key-outer so that elements of one column share their V load.
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
            const int e = tid + j * kAttnThreads;
            if (e < G * HD) acc[j] *= as[e / HD];
        }
        for (int r = 0; r < n_keys; ++r) {
#pragma unroll
            for (int j = 0; j < kElems; ++j) {
                const int e = tid + j * kAttnThreads;
                if (e < G * HD) acc[j] = fmaf(ps[(e / HD) * kAttnTile + r], vs[r * HD + e % HD], acc[j]);
            }
        }
        __syncthreads();  // the next tile overwrites K, V, P and the rescale factors
    }

    if (a.n_split == 1) {
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
            const int e = tid + j * kAttnThreads;
            if (e < G * HD) a.out[(t * a.n_head + h0) * HD + e] = acc[j] / ls[e / HD];
        }
        return;
    }
    const int64_t base = (int64_t(split) * a.n_tok + t) * a.n_head + h0;  // partial of head h0
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
        const int e = tid + j * kAttnThreads;
        if (e < G * HD) a.part_o[base * HD + e] = acc[j];
    }
    for (int g = tid; g < G; g += kAttnThreads) {
        a.part_ml[(base + g) * 2] = ms[g];
        a.part_ml[(base + g) * 2 + 1] = ls[g];
    }
}

// Merges the splits of one (token, head): out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M).
// One thread per element of head_dim; splits that saw no key (m = -inf, l = 0) weigh 0.
__global__ void attention_merge_kernel(const float *__restrict__ part_o, const float *__restrict__ part_ml,
                                       int64_t n_tok, int64_t n_head, int hd, int n_split, float *out) {
    const int64_t th = int64_t(blockIdx.x);  // t * n_head + h
    const int d = int(threadIdx.x);
    const int64_t stride = n_tok * n_head;   // from one split's partial to the next
    float mx = -INFINITY;
    for (int s = 0; s < n_split; ++s) mx = fmaxf(mx, part_ml[(s * stride + th) * 2]);
    float l = 0.0f, o = 0.0f;
    for (int s = 0; s < n_split; ++s) {
        const float m = part_ml[(s * stride + th) * 2];
        if (m == -INFINITY) continue;
        const float w = expf(m - mx);
        l += part_ml[(s * stride + th) * 2 + 1] * w;
        o += part_o[(s * stride + th) * hd + d] * w;
    }
    out[th * hd + d] = o / l;
}

struct SplitPlan {
    int n_split = 1;
    int64_t split_len = 0;
};

// Splits the keys when (token, KV head) blocks alone would fill less than two waves of the GPU.
SplitPlan plan_splits(int64_t n_tok, int64_t pos0, int64_t n_head_kv) {
    const int64_t n_kv = pos0 + n_tok, blocks = n_tok * n_head_kv, want = 2 * int64_t(sm_count());
    int64_t n = 1;
    if (blocks < want) n = ceil_div(want, blocks);
    const int64_t by_keys = ceil_div(n_kv, kAttnMinSplitKeys);
    n = n < by_keys ? n : by_keys;
    n = n < kAttnMaxSplits ? n : kAttnMaxSplits;
    SplitPlan p;
    p.split_len = ceil_div(ceil_div(n_kv, n), kAttnTile) * kAttnTile;
    p.n_split = int(ceil_div(n_kv, p.split_len));
    return p;
}

size_t split_bytes(int n_split, int64_t n_tok, int64_t n_head, int64_t head_dim) {
    if (n_split <= 1) return 0;
    const size_t per = size_t(n_tok * n_head);
    return align_256(sizeof(float) * per * size_t(n_split) * size_t(head_dim)) +
           align_256(sizeof(float) * per * size_t(n_split) * 2);
}

template <int HD>
void launch_attention(const AttnArgs &a, cudaStream_t stream) {
    const size_t smem = attn_smem_bytes(HD, a.group);
    if (smem > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(attention_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const dim3 grid(unsigned(a.n_tok), unsigned(a.n_head_kv), unsigned(a.n_split));
    attention_kernel<HD><<<grid, kAttnThreads, smem, stream>>>(a);
}

} // namespace

size_t attention_workspace_bytes(int64_t n_tok, int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim) {
    return split_bytes(plan_splits(n_tok, pos0, n_head_kv).n_split, n_tok, n_head, head_dim);
}

void attention(const float *q, const float *k_cache, const float *v_cache, int64_t n_tok, int64_t pos0, int64_t n_head,
               int64_t n_head_kv, int64_t head_dim, float scale, float *out, Workspace ws, cudaStream_t stream) {
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

    SplitPlan plan = plan_splits(n_tok, pos0, n_head_kv);
    if (ws.bytes < split_bytes(plan.n_split, n_tok, n_head, head_dim)) plan = SplitPlan{1, pos0 + n_tok};
    AttnArgs a{q, k_cache, v_cache, out, nullptr, nullptr, n_tok, pos0, n_head, n_head_kv,
               plan.split_len, int(n_head / n_head_kv), plan.n_split, scale};
    if (plan.n_split > 1) {
        a.part_o = static_cast<float *>(ws.ptr);
        a.part_ml = reinterpret_cast<float *>(static_cast<uint8_t *>(ws.ptr) +
                                              align_256(sizeof(float) * size_t(n_tok * n_head) * size_t(plan.n_split) *
                                                        size_t(head_dim)));
    }
    switch (head_dim) {
    case 16: launch_attention<16>(a, stream); break;
    case 32: launch_attention<32>(a, stream); break;
    case 64: launch_attention<64>(a, stream); break;
    case 128: launch_attention<128>(a, stream); break;
    case 256: launch_attention<256>(a, stream); break;
    default: {
        char msg[96];
        std::snprintf(msg, sizeof msg, "attention: head_dim %lld has no kernel (16, 32, 64, 128, 256)",
                      (long long)head_dim);
        cuda_unsupported(msg);
    }
    }
    if (plan.n_split > 1)
        attention_merge_kernel<<<unsigned(n_tok * n_head), unsigned(head_dim), 0, stream>>>(
            a.part_o, a.part_ml, n_tok, n_head, int(head_dim), plan.n_split, out);
    launch_check("attention", stream);
}

} // namespace prescope::cuda
