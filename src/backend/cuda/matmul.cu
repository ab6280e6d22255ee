// Matrix products (matmul.cuh): the GEMV kernel for few tokens (any weight dtype, one launch for all
// experts of a layer), the cuBLAS path for many tokens, and the activation quantizer that makes both
// multiply what the CPU's integer dot products multiply. Decisions: docs/decisions/0040-cuda-matmul.md,
// 0062-cuda-weight-types.md, 0143-decode-launch-fusions.md (in-kernel quantization, SwiGLU and residual
// epilogues, integer Q8_0 products).
#include "backend/cuda/matmul.cuh"

#include "backend/cuda/convert.cuh"
#include "backend/cuda/device.cuh"
#include "backend/cuda/elementwise.cuh"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <type_traits>

namespace prescope::cuda {

namespace {

// ---------------------------------------------------------------------------------------------
// GEMV: a block computes 8 output rows (2 per warp; see kMmvShortRowsPerWarp) for up to 8 tokens. The rows are
// streamed through shared memory in slices with 16-byte cp.async copies, two stages deep, so loads stay coalesced and
// in flight whatever the dtype (a Q8_0 block is 34 bytes: 16-byte loads straight into registers
// would straddle blocks). Each lane then converts 8 weights at a time to F32 in registers and
// multiplies them with the tokens' activations (read through L1: all warps of a block share them), or, for one
// token against Q8_0 weights, multiplies the weights' quants with the token's (quantized into shared memory by
// the block) in integers.

constexpr int kMmvThreads = 128;
constexpr int kMmvWarps = kMmvThreads / kWarp;
constexpr int kMmvRowsPerWarp = 2;
constexpr int kMmvRows = kMmvWarps * kMmvRowsPerWarp;
// One token against Q8_0 rows of one slice (the integer path; a Qwen3-30B-A3B expert's down matrix, 768 wide) stages
// 16 rows a block, 4 a warp, in the room of the two stages it does not need: half the blocks and warps, each block
// quantizing the token once, so the launch takes one wave of blocks where it took two (the 64 registers a thread has
// hold 32 warps an SM). The float path's 4 rows of converted weights would not fit those registers.
constexpr int kMmvShortRowsPerWarp = 4;
constexpr int kMmvMaxTokens = 8;  // tokens per pass over the weights
constexpr int kMmvMinBlocks = 8;   // per SM: caps registers at 64, so 32 warps can hide load latency

// Chunks of 8 weights per lane and slice: 1024 weights per slice (512 for F32), about 1-2 KiB per row.
template <DType T> constexpr int kLaneChunks = T == DType::F32 ? 2 : 4;
template <DType T> constexpr int kSliceChunks = kWarp * kLaneChunks<T>;
template <DType T> constexpr int kSliceBytes = int(row_bytes(T, int64_t(kSliceChunks<T>) * kChunk));
// A row's slice may start anywhere in its first 16 bytes of shared memory (the copy keeps the source's
// alignment), hence 16 bytes of slack; the stride is a multiple of 16 because cp.async writes 16-byte
// aligned pieces (a Q3_K or Q6_K slice, 440 or 840 bytes, is not).
template <DType T> constexpr int kRowStride = (kSliceBytes<T> + 15) / 16 * 16 + 16;
static_assert(kRowStride<DType::Q3_K> % 16 == 0 && kRowStride<DType::Q6_K> % 16 == 0);
template <DType T> constexpr int kStageBytes = kMmvRows * kRowStride<T>;
template <DType T> constexpr int kMmvSmemBytes = 2 * kStageBytes<T>;
static_assert(kMmvSmemBytes<DType::F32> <= 48 * 1024 && kMmvSmemBytes<DType::BF16> <= 48 * 1024 &&
              kMmvSmemBytes<DType::Q6_K> <= 48 * 1024, "GEMV stages must fit the default shared memory");
static_assert(kSliceChunks<DType::Q4_K> * kChunk % QK_K == 0, "a slice must be whole super-blocks");

// Up to kMaxParts matrices over the same activations and pairs in one launch (grid.z = part): the q, k and v
// projections, or the gate and up matrices of the same experts. Part z reads w[z] (or w_list[z][group]) and
// writes y[z] ([n_pairs][n_out[z]]); its blocks past n_out[z] rows leave at once.
constexpr int kMaxParts = 3;

struct MmvArgs {
    const void *w[kMaxParts];              // each part's matrix when w_list[0] == nullptr
    const void *const *w_list[kMaxParts];  // each part's [n_group] matrices (experts), or nullptr
    const int32_t *offsets;     // [n_group + 1] pair ranges, or nullptr: one group of pairs [0, n_tok)
    const int32_t *rows;        // [n_pairs] row of x of each pair, or nullptr: row p
    const float *x;             // [..][n_in]
    float *y[kMaxParts];        // [n_pairs][n_out[z]]
    const float *res;           // [n_pairs][n_out[0]] added to part 0's products (may alias y[0]), or nullptr
    int64_t n_in;
    int64_t n_out[kMaxParts];
    int32_t n_tok;              // pairs when offsets == nullptr
    int32_t max_tok;            // groups with more pairs are left to the cuBLAS path
    bool quant_in;              // x is F32: quantize each token's activations here (quantize_chunk)
    bool glu;                   // parts 0 and 1 are gate and up: y[0] = silu(gate) * up (swiglu_kernel's
                                // arithmetic), from one launch of n_out[0] / 4 row blocks
    bool int_dot;               // (set by launch_mmv) Q8_0 weights, one token, quant_in: integer dot products
    const float *norm;          // [n_in] RMSNorm weights: the one token's row is normalised here first, as
                                // rms_norm_kernel with norm_threads threads would (decision 0149), or nullptr
    float eps;
    int32_t norm_threads;
};

// The integer path of one-token Q8_0 products (MmvArgs::int_dot): the block quantizes the token's activations once
// into shared memory, after its weight stages: int8 quants [n_in] then an F32 scale per 32 ([n_in / 32]), so the
// products are dp4a over the stored bytes (ggml's vec_dot_q8_0_q8_0, the CPU's integer kernels).
constexpr int64_t kIntDotMaxIn = 16384;  // shared memory: the stages and 1.125 bytes per input within 48 KiB
constexpr size_t int_dot_smem_bytes(int64_t n_in) { return size_t((n_in + 15) / 16 * 16 + n_in / 32 * 4); }

/// The activation type a weight type's vec-dot type quantizes as (core/dtype.h vec_dot_type; Q8_1's values are
/// Q8_0's): Q8_K for the 256-element super-block types, Q8_0 for the others.
template <DType T> constexpr DType kActType = block_elems(T) == QK_K ? DType::Q8_K : DType::Q8_0;

/// Quantizes to A and back the activation block of which this lane holds 8 consecutive values v, bit for bit
/// core/dtype.h's quantize_row_q8_0 / _q8_K then dequantize_row. A Q8_0 block spans 4 lanes (4i .. 4i + 3), a
/// Q8_K block the whole warp, each lane holding the block's values 8 l .. 8 l + 7 (l = its lane in the block).
/// Every lane of the warp must call it (the reductions shuffle over the warp).
/// quantize_row_q8_0's quants q of this lane's 8 values v of a block of 32 that spans lanes 4i .. 4i + 3 (d = amax /
/// 127, q = roundf(x / d)); returns d rounded to F16, the scale they are dequantized with. Every lane of the warp
/// must call it.
__device__ __forceinline__ float quantize_chunk_q8_0(const float v[kChunk], int q[kChunk]) {
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunk; ++k) amax = fmaxf(amax, fabsf(v[k]));
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
#pragma unroll
    for (int k = 0; k < kChunk; ++k) q[k] = int(roundf(__fmul_rn(v[k], id)));
    return __half2float(__float2half_rn(d));
}

template <DType A>
__device__ __forceinline__ void quantize_chunk(float v[kChunk]) {
    if constexpr (A == DType::Q8_0) {
        // quantize_row_q8_0 / _q8_1, dequantized with d rounded to F16. The quants pass through int, as the
        // CPU's int8 do, so that -0 becomes 0.
        int q[kChunk];
        const float dh = quantize_chunk_q8_0(v, q);
#pragma unroll
        for (int k = 0; k < kChunk; ++k) v[k] = __fmul_rn(float(q[k]), dh);
    } else {
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < kChunk; ++k) amax = fmaxf(amax, fabsf(v[k]));
        amax = warp_max(amax);
        static_assert(A == DType::Q8_K);
        // quantize_row_q8_K: the scale comes from the first element of largest magnitude, with its sign.
        const int lane = int(threadIdx.x) % kWarp;
        int first = INT_MAX;
        float mx = 0.0f;
#pragma unroll
        for (int k = kChunk - 1; k >= 0; --k) {
            if (fabsf(v[k]) == amax) first = lane * kChunk + k, mx = v[k];
        }
#pragma unroll
        for (int o = kWarp / 2; o > 0; o >>= 1) {
            const int of = __shfl_xor_sync(0xffffffffu, first, o);
            const float om = __shfl_xor_sync(0xffffffffu, mx, o);
            if (of < first) first = of, mx = om;
        }
        if (amax == 0.0f) {
#pragma unroll
            for (int k = 0; k < kChunk; ++k) v[k] = 0.0f;
            return;
        }
        const float iscale = -127.0f / mx;
        const float d = 1.0f / iscale;
#pragma unroll
        for (int k = 0; k < kChunk; ++k) v[k] = __fmul_rn(d, float(min(__float2int_rn(__fmul_rn(iscale, v[k])), 127)));
    }
}

/// R: rows a warp computes (kMmvRowsPerWarp, or kMmvShortRowsPerWarp for the integer path's rows of one slice: its
/// 4 * R rows fill both stages' room).
template <DType T, int NT, int R>
__global__ void __launch_bounds__(kMmvThreads, kMmvMinBlocks) mmv_kernel(const MmvArgs a) {
    constexpr int kRows = kMmvWarps * R;
    static_assert(kRows * kRowStride<T> <= kMmvSmemBytes<T>);
    constexpr bool kIntDot = T == DType::Q8_0 && NT == 1;
    constexpr bool kIntDotOnly = R != kMmvRowsPerWarp;  // short rows: launched with int_dot only (no float path)
    static_assert(!kIntDotOnly || kIntDot);
    const bool int_dot = kIntDotOnly || a.int_dot;  // the integer path (taken only where kIntDot)
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ float norm_scratch[kWarp];
    // The block's kRows staged rows: rows row0 .. row0 + kRows - 1 of part z, or (glu) gate and up rows alternating, so
    // that each warp holds the gate and up rows of R / 2 output rows.
    const int z = int(blockIdx.z);
    const int64_t n_out = a.n_out[z];
    const int64_t row0 = int64_t(blockIdx.x) * (a.glu ? kRows / 2 : kRows);
    const auto matrix = [&](int part) {
        return static_cast<const uint8_t *>(a.w_list[0] != nullptr ? a.w_list[part][blockIdx.y] : a.w[part]);
    };
    // Launched by launch_pdl: a product whose matrices and pairs are the launch's own (no expert table, no pair
    // ranges: written by no kernel) stages its first slice before it waits for the kernel before it.
    const bool own_operands = a.w_list[0] == nullptr && a.offsets == nullptr;
    const bool prestage = own_operands && row0 < n_out && a.n_tok > 0 && a.n_tok <= a.max_tok;
    const uint8_t *w0 = own_operands ? matrix(a.glu ? 0 : z) : nullptr;
    const uint8_t *w1 = own_operands && a.glu ? matrix(1) : w0;
    const auto out_row = [&](int r) { return a.glu ? row0 + r / 2 : row0 + r; };  // staged row r's output row
    const size_t rb = row_bytes(T, a.n_in);
    const int64_t n_chunks = a.n_in / kChunk;
    // Short rows (kIntDotOnly) are one slice by launch_mmv's choice; at most one here too, so that no stage is ever
    // written past the room of the two.
    const int n_slices = kIntDotOnly ? 1 : int(ceil_div(n_chunks, kSliceChunks<T>));
    const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp;

    // Slice s of staged row r starts at this address in global memory.
    const auto slice_src = [&](int r, int s) {
        return reinterpret_cast<uintptr_t>((a.glu && (r & 1) ? w1 : w0) + size_t(out_row(r)) * rb +
                                           row_bytes(T, int64_t(s) * kSliceChunks<T> * kChunk));
    };
    // Copies slice s of the block's rows into stage `buf` from 16-byte aligned addresses. Bytes
    // before or after a row that share its aligned 16 bytes are readable, as they lie in the same page.
    const auto stage = [&](int s, int buf) {
        const int64_t nc = min(n_chunks - int64_t(s) * kSliceChunks<T>, int64_t(kSliceChunks<T>));
        const uintptr_t nb = row_bytes(T, nc * kChunk);
        uint8_t *dst = smem + buf * kStageBytes<T>;
        constexpr int kPieces = kRowStride<T> / 16;
        for (int i = int(threadIdx.x); i < kRows * kPieces; i += kMmvThreads) {
            const int r = i / kPieces, j = i % kPieces;
            if (out_row(r) >= n_out) break;  // i ascends, so do the rows
            const uintptr_t src = slice_src(r, s), base = src & ~uintptr_t(15);
            if (uintptr_t(j) * 16 < src - base + nb)
                cp_async_16(dst + r * kRowStride<T> + j * 16, reinterpret_cast<const void *>(base + uintptr_t(j) * 16));
        }
        cp_async_commit();
    };

    if (prestage) stage(0, 0);
    pdl_wait();
    const int32_t p_begin = a.offsets != nullptr ? a.offsets[blockIdx.y] : 0;
    const int32_t p_end = a.offsets != nullptr ? a.offsets[blockIdx.y + 1] : a.n_tok;
    if (p_end <= p_begin || p_end - p_begin > a.max_tok) return;  // uniform over the block
    if (row0 >= n_out) return;  // a shorter part of the launch (uniform over the block)
    if (!own_operands) w0 = matrix(a.glu ? 0 : z), w1 = a.glu ? matrix(1) : w0;  // the expert table, after the wait
    pdl_trigger();  // the next kernel may launch (and wait) once every block got here or returned

    int8_t *const xq = reinterpret_cast<int8_t *>(smem + kMmvSmemBytes<T>);
    float *const xd = reinterpret_cast<float *>(smem + kMmvSmemBytes<T> + (a.n_in + 15) / 16 * 16);

    for (int32_t p0 = p_begin; p0 < p_end; p0 += NT) {
        const float *xr[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int32_t p = p0 + t;
            xr[t] = p < p_end ? a.x + int64_t(a.rows != nullptr ? a.rows[p] : p) * a.n_in : nullptr;
        }
        float acc[R][NT];
#pragma unroll
        for (int j = 0; j < R; ++j)
#pragma unroll
            for (int t = 0; t < NT; ++t) acc[j][t] = 0.0f;

        if (!prestage || p0 != p_begin) stage(0, 0);
        // The row's RMSNorm scale (one token: quant_in), while slice 0 loads; then x[i] is read as norm[i] * (x[i] *
        // scale), rms_norm_kernel's expression.
        const float norm_scale =
            a.norm != nullptr ? rms_scale_as(xr[0], a.n_in, a.eps, a.norm_threads, norm_scratch) : 0.0f;
        const auto normalise = [&](int64_t c, float v[kChunk]) {
            if (a.norm == nullptr) return;
            const float4 *np = reinterpret_cast<const float4 *>(a.norm + c * kChunk);
            const float4 n0 = __ldg(np), n1 = __ldg(np + 1);
            const float nw[kChunk] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
#pragma unroll
            for (int k = 0; k < kChunk; ++k) v[k] = nw[k] * (v[k] * norm_scale);
        };
        if constexpr (kIntDot) {
            // Uniform: the token's quants and scales into shared memory while slice 0 loads.
            if (int_dot) {
                for (int64_t base = 0; base < n_chunks; base += kMmvThreads) {
                    const int64_t c = base + threadIdx.x;
                    const bool on = c < n_chunks;  // whole blocks of 4 lanes (n_in is a multiple of 32)
                    float v[kChunk] = {};
                    if (on) {
                        const float4 *xp = reinterpret_cast<const float4 *>(xr[0] + c * kChunk);
                        const float4 u = __ldg(xp), w = __ldg(xp + 1);
                        v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w, v[4] = w.x, v[5] = w.y, v[6] = w.z, v[7] = w.w;
                        normalise(c, v);
                    }
                    int q[kChunk];
                    const float dh = quantize_chunk_q8_0(v, q);
                    if (!on) continue;
                    uint32_t packed[2] = {0, 0};
#pragma unroll
                    for (int k = 0; k < kChunk; ++k) packed[k / 4] |= uint32_t(uint8_t(int8_t(q[k]))) << (8 * (k % 4));
                    reinterpret_cast<uint2 *>(xq)[c] = make_uint2(packed[0], packed[1]);
                    if ((c & 3) == 0) xd[c >> 2] = dh;
                }
            }
        }
        for (int s = 0; s < n_slices; ++s) {
            if (s + 1 < n_slices) {
                stage(s + 1, (s + 1) & 1);
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            const int64_t c0 = int64_t(s) * kSliceChunks<T>;
            const uint8_t *srow[R];
#pragma unroll
            for (int j = 0; j < R; ++j) {
                const int r = warp * R + j;
                srow[j] = out_row(r) < n_out
                              ? smem + (s & 1) * kStageBytes<T> + r * kRowStride<T> + (slice_src(r, s) & 15)
                              : nullptr;
            }
#pragma unroll
            for (int i = 0; i < kLaneChunks<T>; ++i) {
                // Whole quantization blocks of lanes stop together (n_in is a multiple of the block), but the
                // shuffles of quantize_chunk need every lane: those past the row carry zeros.
                if (c0 + i * kWarp >= n_chunks) break;  // uniform over the warp
                const int cl = i * kWarp + lane;
                const bool on = c0 + cl < n_chunks;
                if constexpr (kIntDot) {
                    if (int_dot) {
                        if (!on) continue;
                        // 8 weight quants (2-byte aligned in their 34-byte block) against 8 activation quants.
                        const int64_t c = c0 + cl;
                        const uint2 xv = reinterpret_cast<const uint2 *>(xq)[c];
                        const float xs = xd[c >> 2];
#pragma unroll
                        for (int j = 0; j < R; ++j) {
                            if (srow[j] == nullptr) continue;
                            const uint8_t *blk = srow[j] + (cl >> 2) * int64_t(sizeof(BlockQ8_0));
                            const uint16_t *q = reinterpret_cast<const uint16_t *>(blk + 2 + (cl & 3) * kChunk);
                            const int w0 = int(uint32_t(q[0]) | uint32_t(q[1]) << 16);
                            const int w1 = int(uint32_t(q[2]) | uint32_t(q[3]) << 16);
                            const int dot = __dp4a(w1, int(xv.y), __dp4a(w0, int(xv.x), 0));
                            acc[j][0] = fmaf(ld_f16(blk) * xs, float(dot), acc[j][0]);
                        }
                        continue;
                    }
                }
                if constexpr (!kIntDotOnly) {  // the float path
                    float wv[R][kChunk];
#pragma unroll
                    for (int j = 0; j < R; ++j) {
                        if (on && srow[j] != nullptr) {
                            load_chunk<T>(srow[j], cl, wv[j]);
                        } else {
#pragma unroll
                            for (int k = 0; k < kChunk; ++k) wv[j][k] = 0.0f;
                        }
                    }
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        if (xr[t] == nullptr) continue;  // uniform over the block
                        float xv[kChunk] = {};
                        if (on) {
                            const float4 *xp = reinterpret_cast<const float4 *>(xr[t] + (c0 + cl) * kChunk);
                            const float4 u = __ldg(xp), v = __ldg(xp + 1);
                            xv[0] = u.x, xv[1] = u.y, xv[2] = u.z, xv[3] = u.w, xv[4] = v.x, xv[5] = v.y, xv[6] = v.z,
                            xv[7] = v.w;
                            normalise(c0 + cl, xv);
                        }
                        if constexpr (T != DType::F32 && T != DType::F16 && T != DType::BF16) {
                            if (a.quant_in) quantize_chunk<kActType<T>>(xv);  // uniform over the block
                        }
                        if (!on) continue;
#pragma unroll
                        for (int j = 0; j < R; ++j)
#pragma unroll
                            for (int k = 0; k < kChunk; ++k) acc[j][t] = fmaf(wv[j][k], xv[k], acc[j][t]);
                    }
                }
            }
            __syncthreads();  // the next stage() overwrites this buffer
        }

#pragma unroll
        for (int t = 0; t < NT; ++t) {
            float v[R];
#pragma unroll
            for (int j = 0; j < R; ++j) v[j] = warp_sum(acc[j][t]);
            if (lane != t || p0 + t >= p_end) continue;
            const int64_t p = p0 + t;
            if (a.glu) {  // staged rows 2i, 2i + 1: output row i's gate and up
#pragma unroll
                for (int j = 0; j < R / 2; ++j) {
                    const int64_t row = row0 + warp * (R / 2) + j;
                    if (row < n_out) a.y[0][p * n_out + row] = v[2 * j] / (1.0f + expf(-v[2 * j])) * v[2 * j + 1];
                }
                continue;
            }
#pragma unroll
            for (int j = 0; j < R; ++j) {
                const int64_t row = row0 + warp * R + j;
                if (row >= n_out) continue;
                float *const y = a.y[z] + p * n_out + row;
                *y = z == 0 && a.res != nullptr ? a.res[p * n_out + row] + v[j] : v[j];
            }
        }
    }
}

template <DType T>
void launch_mmv(MmvArgs a, int n_group, int n_parts, int max_pairs, cudaStream_t stream) {
    int64_t n_out = 0;
    for (int z = 0; z < n_parts; ++z) n_out = a.n_out[z] > n_out ? a.n_out[z] : n_out;
    a.int_dot = T == DType::Q8_0 && max_pairs <= 1 && a.quant_in && a.n_in <= kIntDotMaxIn;
    const bool short_rows = a.int_dot && a.n_in <= int64_t(kSliceChunks<T>) * kChunk;  // one slice
    const int rows = kMmvWarps * (short_rows ? kMmvShortRowsPerWarp : kMmvRowsPerWarp);
    const dim3 grid(unsigned(ceil_div(n_out, a.glu ? rows / 2 : rows)), unsigned(n_group),
                    unsigned(a.glu ? 1 : n_parts));
    const size_t smem = kMmvSmemBytes<T> + (a.int_dot ? int_dot_smem_bytes(a.n_in) : 0);
    if (short_rows) {
        if constexpr (T == DType::Q8_0)
            launch_pdl(mmv_kernel<T, 1, kMmvShortRowsPerWarp>, grid, dim3(kMmvThreads), smem, stream, a);
    } else if (max_pairs <= 1) {
        launch_pdl(mmv_kernel<T, 1, kMmvRowsPerWarp>, grid, dim3(kMmvThreads), smem, stream, a);
    } else if (max_pairs <= 2) {
        launch_pdl(mmv_kernel<T, 2, kMmvRowsPerWarp>, grid, dim3(kMmvThreads), smem, stream, a);
    } else if (max_pairs <= 4) {
        launch_pdl(mmv_kernel<T, 4, kMmvRowsPerWarp>, grid, dim3(kMmvThreads), smem, stream, a);
    } else {
        launch_pdl(mmv_kernel<T, kMmvMaxTokens, kMmvRowsPerWarp>, grid, dim3(kMmvThreads), smem, stream, a);
    }
}

void launch_mmv(DType type, const MmvArgs &a, int n_group, int n_parts, int max_pairs, cudaStream_t stream) {
    dispatch_weight_type(type,
                         [&](auto t) { launch_mmv<decltype(t)::value>(a, n_group, n_parts, max_pairs, stream); });
}

// ---------------------------------------------------------------------------------------------
// Activations quantized to the weights' vec-dot type and back (ActivationQuant::INT8), for the products that do
// not quantize in the GEMV kernel: each lane holds 8 consecutive values of a row (quantize_chunk), so a warp
// covers 8 blocks of 32 (Q8_0, Q8_1) or one of 256 (Q8_K).

constexpr int kQuantThreads = 256;

template <DType A>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_act_kernel(const float *__restrict__ x, const int32_t *__restrict__ rows, int64_t n, int64_t n_rows,
                        float *__restrict__ out) {
    const int64_t per_row = n / kChunk;  // a multiple of the lanes of a block (n of the block size)
    const int64_t c = int64_t(blockIdx.x) * kQuantThreads + threadIdx.x;
    const bool on = c < n_rows * per_row;  // blocks past the last row carry zeros through the shuffles
    const int64_t r = on ? c / per_row : 0, off = (c % per_row) * kChunk;
    float v[kChunk] = {};
    if (on) {
        const float *src = x + (rows != nullptr ? int64_t(rows[r]) : r) * n + off;
#pragma unroll
        for (int k = 0; k < kChunk; ++k) v[k] = src[k];
    }
    quantize_chunk<A>(v);
    if (!on) return;
#pragma unroll
    for (int k = 0; k < kChunk; ++k) out[r * n + off + k] = v[k];
}

// ---------------------------------------------------------------------------------------------
// cuBLAS path. Row-major y[n_tok][n_out] = x[n_tok][n_in] W^T is, in cuBLAS's column-major terms,
// C (n_out x n_tok) = op_T(A: n_in x n_out) * B (n_in x n_tok), lda = ldb = n_in, ldc = n_out.

// Quantized weights are dequantized to BF16 in pieces of at most this many bytes (the workspace's share).
constexpr size_t kDequantChunkBytes = size_t(32) << 20;

bool quantized(DType w) { return w != DType::F32 && w != DType::F16 && w != DType::BF16; }

// Type the activations are converted to: cuBLAS needs both operands of one type.
DType act_type(DType w) { return quantized(w) ? DType::BF16 : w; }

size_t elem_bytes(DType t) { return row_bytes(t, kChunk) / kChunk; }

cudaDataType_t cuda_data_type(DType t) {
    switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::F16: return CUDA_R_16F;
    case DType::BF16: return CUDA_R_16BF;
    default: break;
    }
    cuda_unsupported("cuBLAS has no operand type for block-quantized weights");
}

int64_t dequant_rows(int64_t n_in, int64_t n_out) {
    const int64_t fit = int64_t(kDequantChunkBytes / (size_t(n_in) * 2));
    return fit < 1 ? 1 : (fit < n_out ? fit : n_out);
}

size_t dequant_bytes(DType type, int64_t n_in, int64_t n_out) {
    return quantized(type) ? align_256(size_t(dequant_rows(n_in, n_out)) * size_t(n_in) * 2) : 0;
}

// Workspace for the activations quantized and back: n_rows rows of n_in F32, or nothing.
size_t quant_bytes(DType type, int64_t n_in, int64_t n_rows) {
    return quantizes_activations(type) ? align_256(size_t(n_rows) * size_t(n_in) * 4) : 0;
}

// C[n_tok][ldc] (columns [0, m)) = A (m rows of k elements of type at) times B ([n_tok][k] of type at), plus C's
// old values when `add` (cuBLAS's beta = 1: one rounding of the sum, as add_kernel).
void gemm(DType at, const void *a, int64_t m, int64_t n_tok, int64_t k, const void *b, float *c, int64_t ldc,
          bool add) {
    CUDA_ASSERT(m < INT_MAX && n_tok < INT_MAX && k < INT_MAX && ldc < INT_MAX);
    const float one = 1.0f, beta = add ? 1.0f : 0.0f;
    cublasHandle_t h = cublas_handle();
    if (at == DType::F32) {
        CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(n_tok), int(k), &one,
                                 static_cast<const float *>(a), int(k), static_cast<const float *>(b), int(k), &beta,
                                 c, int(ldc)));
        return;
    }
    const cudaDataType_t dt = cuda_data_type(at);
    CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(n_tok), int(k), &one, a, dt, int(k), b, dt,
                              int(k), &beta, c, CUDA_R_32F, int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// y = W xc (+ y's old values when `add`) for activations already converted to act_type(type); wb:
// dequant_bytes(...) of scratch.
void gemm_converted(DType type, const void *w, int64_t n_in, int64_t n_out, const void *xc, int64_t n_tok, float *y,
                    void *wb, cudaStream_t stream, bool add = false) {
    CUBLAS_CHECK(cublasSetStream(cublas_handle(), stream));
    if (!quantized(type)) {
        gemm(type, w, n_out, n_tok, n_in, xc, y, n_out, add);
        return;
    }
    const int64_t chunk = dequant_rows(n_in, n_out);
    const size_t rb = row_bytes(type, n_in);
    for (int64_t r0 = 0; r0 < n_out; r0 += chunk) {
        const int64_t m = chunk < n_out - r0 ? chunk : n_out - r0;
        convert_rows(type, static_cast<const uint8_t *>(w) + size_t(r0) * rb, n_in, nullptr, m, m, DType::BF16, wb,
                     stream);
        gemm(DType::BF16, wb, m, n_tok, n_in, xc, y + r0, n_out, add);
    }
}

MatmulPath resolve_path(MatmulPath path) {
    if (path != MatmulPath::AUTO) return path;
    static const MatmulPath env = [] {
        const char *v = std::getenv("PRESCOPE_CUDA_MATMUL");
        if (v == nullptr || v[0] == '\0') return MatmulPath::AUTO;
        if (std::strcmp(v, "gemv") == 0) return MatmulPath::GEMV;
        if (std::strcmp(v, "cublas") == 0) return MatmulPath::CUBLAS;
        std::fprintf(stderr, "warning: PRESCOPE_CUDA_MATMUL=%s: expected gemv or cublas; ignored\n", v);
        return MatmulPath::AUTO;
    }();
    return env;
}

void check_weights(DType type, const void *w, int64_t n_in, int64_t n_out) {
    CUDA_ASSERT(n_in > 0 && n_out > 0 && n_in % kChunk == 0 && n_in % block_elems(type) == 0);
    CUDA_ASSERT(reinterpret_cast<uintptr_t>(w) % weight_alignment(type) == 0);
}

// g without its second list, and g's second list as the only one.
ExpertMatmul first_list(const ExpertMatmul &g) {
    ExpertMatmul a = g;
    a.w2_dev = a.w2_host = nullptr;
    a.glu = false;
    return a;
}

ExpertMatmul second_list(const ExpertMatmul &g) {
    ExpertMatmul b = first_list(g);
    b.type = g.type2;
    b.w_dev = g.w2_dev;
    b.w_host = g.w2_host;
    return b;
}

} // namespace

void quantize_activations(DType type, const float *x, const int32_t *rows, int64_t n, int64_t n_rows, float *out,
                          cudaStream_t stream) {
    const DType a = vec_dot_type(type);
    CUDA_ASSERT(a == DType::Q8_0 || a == DType::Q8_1 || a == DType::Q8_K);
    CUDA_ASSERT(n > 0 && n % block_elems(a) == 0 && n_rows >= 0);
    if (n_rows == 0) return;
    const unsigned grid = unsigned(ceil_div(n_rows * (n / kChunk), kQuantThreads));
    if (a == DType::Q8_K) {
        quantize_act_kernel<DType::Q8_K><<<grid, kQuantThreads, 0, stream>>>(x, rows, n, n_rows, out);
    } else {
        // Q8_1 quantizes and dequantizes as Q8_0 (its extra sum is not part of the values).
        quantize_act_kernel<DType::Q8_0><<<grid, kQuantThreads, 0, stream>>>(x, rows, n, n_rows, out);
    }
    launch_check("quantize_activations", stream);
}

int matmul_gemv_max_tokens(DType type) {
    // Quantized weights cost 0.3-1.1 B each to stream and 2 + 2 B more to dequantize for cuBLAS, so GEMV
    // (one pass per 8 tokens, mostly from L2) stays ahead longer than for BF16, which cuBLAS reads directly.
    return quantized(type) ? 32 : kMmvMaxTokens;
}

size_t matmul_workspace_bytes(DType type, int64_t n_in, int64_t n_out, int64_t n_tok, MatmulPath path) {
    path = resolve_path(path);
    const size_t q = quant_bytes(type, n_in, n_tok);
    if (path == MatmulPath::GEMV || (path == MatmulPath::AUTO && n_tok <= matmul_gemv_max_tokens(type))) return q;
    const size_t x_bytes =
        type == DType::F32 ? 0 : align_256(size_t(n_tok) * size_t(n_in) * elem_bytes(act_type(type)));
    return q + x_bytes + dequant_bytes(type, n_in, n_out);
}

bool matmul_parts_fuse_norm(std::span<const MatmulPart> parts, int64_t n_tok, MatmulPath path) {
    if (n_tok != 1 || resolve_path(path) == MatmulPath::CUBLAS) return false;  // one token: AUTO takes the GEMV
    return std::all_of(parts.begin(), parts.end(), [](const MatmulPart &m) { return quantizes_activations(m.type); });
}

void matmul_parts(std::span<const MatmulPart> parts, int64_t n_in, const float *x, int64_t n_tok, Workspace ws,
                  cudaStream_t stream, MatmulPath path, const RowNorm *norm) {
    CUDA_ASSERT(!parts.empty() && parts.size() <= size_t(kMaxParts));
    CUDA_ASSERT(norm == nullptr || (matmul_parts_fuse_norm(parts, n_tok, path) && norm->w != nullptr &&
                                    reinterpret_cast<uintptr_t>(norm->w) % 16 == 0));
    const DType type = parts[0].type;
    if (std::any_of(parts.begin(), parts.end(), [&](const MatmulPart &m) { return m.type != type; })) {
        for (const MatmulPart &m : parts) {
            matmul_parts(std::span<const MatmulPart>(&m, 1), n_in, x, n_tok, ws, stream, path, norm);
        }
        return;
    }
    for (const MatmulPart &m : parts) {
        check_weights(type, m.w, n_in, m.n_out);
        CUDA_ASSERT(reinterpret_cast<uintptr_t>(m.y) % 16 == 0);
    }
    CUDA_ASSERT(n_tok >= 0 && n_tok < INT_MAX);
    CUDA_ASSERT(reinterpret_cast<uintptr_t>(x) % 16 == 0);
    if (n_tok == 0) return;
    path = resolve_path(path);
    if (path == MatmulPath::AUTO) path = n_tok <= matmul_gemv_max_tokens(type) ? MatmulPath::GEMV : MatmulPath::CUBLAS;
    for (const MatmulPart &m : parts) CUDA_ASSERT(ws.bytes >= matmul_workspace_bytes(type, n_in, m.n_out, n_tok, path));
    // Workspace: [activations quantized and back] [activations as act_type] [dequantized weights]; the parts
    // share the first two.
    auto *next = static_cast<uint8_t *>(ws.ptr);
    // One token's activations are quantized in the GEMV kernel itself (a launch less per product at decode).
    const bool quant_in = quantizes_activations(type) && path == MatmulPath::GEMV && n_tok == 1;
    if (quantizes_activations(type) && !quant_in) {
        quantize_activations(type, x, nullptr, n_in, n_tok, reinterpret_cast<float *>(next), stream);
        x = reinterpret_cast<const float *>(next);
        next += quant_bytes(type, n_in, n_tok);
    }
    if (path == MatmulPath::GEMV) {
        // The parts with a residual go first: the kernel adds one to part 0 only.
        const auto res = std::find_if(parts.begin(), parts.end(), [](const MatmulPart &m) { return m.residual; });
        CUDA_ASSERT(std::count_if(parts.begin(), parts.end(), [](const MatmulPart &m) { return m.residual; }) <= 1);
        MatmulPart order[kMaxParts];
        std::copy(parts.begin(), parts.end(), order);
        if (res != parts.end()) std::rotate(order, order + (res - parts.begin()), order + (res - parts.begin()) + 1);
        MmvArgs a{};
        for (size_t z = 0; z < parts.size(); ++z) {
            a.w[z] = order[z].w;
            a.y[z] = order[z].y;
            a.n_out[z] = order[z].n_out;
        }
        a.res = order[0].residual;
        a.x = x;
        if (norm != nullptr) {
            a.norm = norm->w;
            a.eps = norm->eps;
            a.norm_threads = row_threads(n_in);  // rms_norm_kernel's block, for its scale bit for bit
        }
        a.n_in = n_in;
        a.n_tok = int32_t(n_tok);
        a.max_tok = INT32_MAX;
        a.quant_in = quant_in;
        launch_mmv(type, a, 1, int(parts.size()), int(n_tok), stream);
    } else {
        const void *xc = x;
        if (type != DType::F32) {
            convert_rows(DType::F32, x, n_in, nullptr, n_tok, n_tok, act_type(type), next, stream);
            xc = next;
            next += align_256(size_t(n_tok) * size_t(n_in) * elem_bytes(act_type(type)));
        }
        for (const MatmulPart &m : parts) {
            if (m.residual != nullptr && m.residual != m.y) {
                CUDA_CHECK(cudaMemcpyAsync(m.y, m.residual, size_t(n_tok * m.n_out) * 4, cudaMemcpyDeviceToDevice,
                                           stream));
            }
            gemm_converted(type, m.w, n_in, m.n_out, xc, n_tok, m.y, next, stream, m.residual != nullptr);
        }
    }
    launch_check("matmul", stream);
}

void matmul(DType type, const void *w, int64_t n_in, int64_t n_out, const float *x, int64_t n_tok, float *y,
            Workspace ws, cudaStream_t stream, MatmulPath path) {
    const MatmulPart part{type, w, n_out, y};
    matmul_parts(std::span<const MatmulPart>(&part, 1), n_in, x, n_tok, ws, stream, path);
}

int device_resolved_max_pairs(DType type) {
    return resolve_path(MatmulPath::AUTO) == MatmulPath::CUBLAS ? 0 : matmul_gemv_max_tokens(type);
}

int64_t expert_matmul_pairs(const ExpertMatmul &g) {
    if (g.offsets_host == nullptr) return g.n_pairs_max;
    return g.n_expert > 0 ? g.offsets_host[g.n_expert] : 0;
}

size_t expert_matmul_workspace_bytes(const ExpertMatmul &g, MatmulPath path) {
    if (g.w2_dev != nullptr && g.type2 != g.type) {
        const size_t a = expert_matmul_workspace_bytes(first_list(g), path);
        const size_t b = expert_matmul_workspace_bytes(second_list(g), path);
        return a > b ? a : b;
    }
    path = resolve_path(path);
    const size_t q = quant_bytes(g.type, g.n_in, expert_matmul_pairs(g));
    if (path == MatmulPath::GEMV || g.offsets_host == nullptr) return q;
    const int limit = path == MatmulPath::CUBLAS ? 0 : matmul_gemv_max_tokens(g.type);
    bool any_cublas = false;
    for (int32_t e = 0; e < g.n_expert; ++e) any_cublas |= g.offsets_host[e + 1] - g.offsets_host[e] > limit;
    if (!any_cublas) return q;
    return q + align_256(size_t(expert_matmul_pairs(g)) * size_t(g.n_in) * elem_bytes(act_type(g.type))) +
           dequant_bytes(g.type, g.n_in, g.n_out);
}

void expert_matmul(const ExpertMatmul &g, const float *x, float *y, Workspace ws, cudaStream_t stream,
                   MatmulPath path, float *y2) {
    CUDA_ASSERT(g.n_expert >= 0 && g.n_expert <= 65535);
    if (g.n_expert == 0) return;
    const bool resolved = g.offsets_host == nullptr;  // groups known to the device only
    CUDA_ASSERT(resolved ? g.w_host == nullptr && g.w2_host == nullptr && g.max_group_pairs >= 1 &&
                               g.max_group_pairs <= device_resolved_max_pairs(g.type) && g.n_pairs_max >= 0
                         : g.offsets_host[0] == 0 && g.w_host != nullptr);
    CUDA_ASSERT(reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0);
    const bool two = g.w2_dev != nullptr;
    CUDA_ASSERT(resolved || two == (g.w2_host != nullptr));
    CUDA_ASSERT(two == (y2 != nullptr));
    CUDA_ASSERT(reinterpret_cast<uintptr_t>(y2) % 16 == 0);
    CUDA_ASSERT(!g.glu || two);
    if (two && g.type2 != g.type) {  // different activation quantizations: one call per list
        expert_matmul(first_list(g), x, y, ws, stream, path);
        expert_matmul(second_list(g), x, y2, ws, stream, path);
        if (g.glu) swiglu(y, y2, y, expert_matmul_pairs(g) * g.n_out, stream);
        return;
    }
    path = resolve_path(path);
    const int limit = path == MatmulPath::GEMV || resolved ? INT32_MAX
                      : path == MatmulPath::CUBLAS         ? 0
                                                           : matmul_gemv_max_tokens(g.type);
    int max_small = resolved ? g.max_group_pairs : 0;  // most pairs of an expert on the GEMV path
    bool any_cublas = false;
    for (int32_t e = 0; e < (resolved ? 0 : g.n_expert); ++e) {
        const int32_t n = g.offsets_host[e + 1] - g.offsets_host[e];
        CUDA_ASSERT(n >= 0);
        if (n == 0) continue;
        check_weights(g.type, g.w_host[e], g.n_in, g.n_out);
        if (two) check_weights(g.type, g.w2_host[e], g.n_in, g.n_out);
        if (n <= limit) {
            max_small = n > max_small ? n : max_small;
        } else {
            any_cublas = true;
        }
    }
    const int64_t n_pairs = expert_matmul_pairs(g);
    CUDA_ASSERT(ws.bytes >= expert_matmul_workspace_bytes(g, path));
    // Workspace: [pair inputs quantized and back] [pair inputs as act_type] [dequantized weights].
    auto *next = static_cast<uint8_t *>(ws.ptr);
    const int32_t *rows = g.rows_dev;
    // Pairs of one token each, all on the GEMV path (every decode step): the kernel quantizes and gathers them.
    const bool quant_in = quantizes_activations(g.type) && max_small <= 1 && !any_cublas;
    if (quantizes_activations(g.type) && !quant_in) {
        // Gathered into pair order on the way, so the kernels below read row p for pair p.
        quantize_activations(g.type, x, rows, g.n_in, n_pairs, reinterpret_cast<float *>(next), stream);
        x = reinterpret_cast<const float *>(next);
        rows = nullptr;
        next += quant_bytes(g.type, g.n_in, n_pairs);
    }
    if (max_small > 0) {
        MmvArgs a{};
        a.w_list[0] = g.w_dev;
        a.w_list[1] = g.w2_dev;
        a.y[0] = y;
        a.y[1] = y2;
        a.n_out[0] = a.n_out[1] = g.n_out;
        a.offsets = g.offsets_dev;
        a.rows = rows;
        a.x = x;
        a.n_in = g.n_in;
        a.max_tok = limit;
        a.quant_in = quant_in;
        a.glu = g.glu && !any_cublas;
        launch_mmv(g.type, a, g.n_expert, two ? 2 : 1, max_small, stream);
    }
    if (any_cublas) {
        const DType at = act_type(g.type);
        // Gather (and convert) every pair's input once; each expert then reads a contiguous block.
        convert_rows(DType::F32, x, g.n_in, rows, INT64_MAX, n_pairs, at, next, stream);
        const uint8_t *xa = next;
        next += align_256(size_t(n_pairs) * size_t(g.n_in) * elem_bytes(at));
        for (int32_t e = 0; e < g.n_expert; ++e) {
            const int32_t p0 = g.offsets_host[e], n = g.offsets_host[e + 1] - p0;
            if (n <= limit) continue;
            const void *xc = xa + size_t(p0) * size_t(g.n_in) * elem_bytes(at);
            gemm_converted(g.type, g.w_host[e], g.n_in, g.n_out, xc, n, y + int64_t(p0) * g.n_out, next, stream);
            if (two)
                gemm_converted(g.type, g.w2_host[e], g.n_in, g.n_out, xc, n, y2 + int64_t(p0) * g.n_out, next, stream);
        }
        if (g.glu) swiglu(y, y2, y, n_pairs * g.n_out, stream);  // the GEMV groups' products are in y, y2 too
    }
    launch_check("expert_matmul", stream);
}

} // namespace prescope::cuda
