// Causal multi-head self-attention on a packed qkv tensor (B, T, 3C): q, k, v each C wide, heads contiguous
// slices of hs = C/NH channels. The forward keeps the softmax probabilities att (B, NH, T, T) for the backward;
// entries above the diagonal are zero.
#pragma once

#include <cmath>
#include <cstring>

#include <omp.h>

inline void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    int C3 = 3 * C;
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float* q = qkv + ((size_t)b * T + t) * C3 + h * hs;
                float* row = att + (((size_t)b * NH + h) * T + t) * T;
                float maxv = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = qkv + ((size_t)b * T + t2) * C3 + C + h * hs;
                    float s = 0.0f;
                    for (int i = 0; i < hs; i++) s += q[i] * k[i];
                    s *= scale;
                    row[t2] = s;
                    maxv = s > maxv ? s : maxv;
                }
                float sum = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    row[t2] = expf(row[t2] - maxv);
                    sum += row[t2];
                }
                float inv = 1.0f / sum;
                for (int t2 = 0; t2 <= t; t2++) row[t2] *= inv;
                for (int t2 = t + 1; t2 < T; t2++) row[t2] = 0.0f;
                float* o = out + ((size_t)b * T + t) * C + h * hs;
                for (int i = 0; i < hs; i++) o[i] = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* v = qkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
                    for (int i = 0; i < hs; i++) o[i] += row[t2] * v[i];
                }
            }
}

// dqkv (B, T, 3C) is overwritten. Keys and values receive gradient from every later query, so one thread owns
// each (batch, head) pair and sums in query order. scratch holds T floats per thread.
inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                               int NH, float* scratch) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    int C3 = 3 * C;
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            float* dpre = scratch + (size_t)omp_get_thread_num() * T;
            for (int t = 0; t < T; t++) {
                float* base = dqkv + ((size_t)b * T + t) * C3 + h * hs;
                memset(base, 0, hs * sizeof(float));
                memset(base + C, 0, hs * sizeof(float));
                memset(base + 2 * C, 0, hs * sizeof(float));
            }
            for (int t = 0; t < T; t++) {
                const float* row = att + (((size_t)b * NH + h) * T + t) * T;
                const float* d = dout + ((size_t)b * T + t) * C + h * hs;
                // datt[t2] = d · v[t2]; dpre = att * (datt - Σ att·datt), the softmax backward
                float dot = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* v = qkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
                    float s = 0.0f;
                    for (int i = 0; i < hs; i++) s += d[i] * v[i];
                    dpre[t2] = s;
                    dot += row[t2] * s;
                }
                const float* q = qkv + ((size_t)b * T + t) * C3 + h * hs;
                float* dq = dqkv + ((size_t)b * T + t) * C3 + h * hs;
                for (int t2 = 0; t2 <= t; t2++) {
                    float g = row[t2] * (dpre[t2] - dot) * scale;
                    const float* k = qkv + ((size_t)b * T + t2) * C3 + C + h * hs;
                    float* dk = dqkv + ((size_t)b * T + t2) * C3 + C + h * hs;
                    float* dv = dqkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
                    for (int i = 0; i < hs; i++) {
                        dq[i] += g * k[i];
                        dk[i] += g * q[i];
                        dv[i] += row[t2] * d[i];
                    }
                }
            }
        }
}

// ==========================================================================================================
// CUDA: flash attention. The T×T probabilities are never stored: the forward streams key/value tiles past a
// tile of queries, keeping a running row maximum, a running sum rescaled to it and the unnormalized output
// (online softmax), and saves only each row's log-sum-exp. The backward recomputes the probabilities from it,
// tile by tile. Work is 4·T²·hs FLOPs per head forward (half of it masked away by causality) against
// 3·T·hs·2 bytes read, so it is compute-bound; these kernels run the dot products on the fp32 CUDA cores with
// bf16 tiles in shared memory, which keeps them short and exact enough to trust. A tensor-core (mma/wgmma)
// variant is the way to Hopper's speed and can be checked against these.
// Shape: a block of 4 warps takes a 32-row tile; a warp owns 8 rows and its lanes the 32 columns of the
// current 32-wide tile of the other operand (scores), then the head dimension (lane + 32·i) when
// accumulating. Shared-memory rows are padded by one 4-byte word so that 32 lanes reading 32 different rows
// hit 32 different banks. The backward is deterministic without atomics: one kernel owns a query tile and
// sums dQ over key tiles in order, another owns a key tile and sums dK and dV over query tiles in order.
// out is (B, T, C) with head h in channels [h·hs, (h+1)·hs); lse and delta are (B, NH, T) floats.

#include <type_traits>

#include "llmc/cuda_common.cuh"

constexpr int ATT_TILE = 32, ATT_WARPS = 4, ATT_ROWS = ATT_TILE / ATT_WARPS;

// rows [t0, t0+32) of one head's slice of a (B·T, 3C) tensor into a padded tile; rows past T become zeros
template <int HS>
static __device__ void attention_load_tile(bf16* tile, const bf16* src, long row_stride, int t0, int T) {
    for (int i = threadIdx.x; i < ATT_TILE * HS / 2; i += blockDim.x) {
        int r = i / (HS / 2), c = 2 * (i % (HS / 2));
        __nv_bfloat162 v = __floats2bfloat162_rn(0.0f, 0.0f);
        if (t0 + r < T) v = *reinterpret_cast<const __nv_bfloat162*>(src + (long)(t0 + r) * row_stride + c);
        *reinterpret_cast<__nv_bfloat162*>(tile + r * (HS + 2) + c) = v;
    }
}

// dots[r] = a[row0 + r] · b[lane]: a's rows are broadcast to the warp, b's rows are one per lane
template <int HS>
static __device__ __forceinline__ void attention_row_dots(float (&dots)[ATT_ROWS], const bf16* a, int row0,
                                                          const bf16* b) {
    const __nv_bfloat162* brow = reinterpret_cast<const __nv_bfloat162*>(b + (threadIdx.x % 32) * (HS + 2));
    for (int r = 0; r < ATT_ROWS; r++) dots[r] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < HS / 2; d++) {
        float2 bv = __bfloat1622float2(brow[d]);
        for (int r = 0; r < ATT_ROWS; r++) {
            float2 av = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(a + (row0 + r) * (HS + 2))[d]);
            dots[r] += av.x * bv.x + av.y * bv.y;
        }
    }
}

// acc[r][i] += Σ_j w[r] of lane j · m[j][lane + 32i]: weights held one per lane, applied to m's rows
template <int HS>
static __device__ __forceinline__ void attention_accumulate(float (&acc)[ATT_ROWS][HS / 32],
                                                            const float (&w)[ATT_ROWS], const bf16* m) {
    int lane = threadIdx.x % 32;
    for (int j = 0; j < ATT_TILE; j++) {
        float mv[HS / 32];
        for (int i = 0; i < HS / 32; i++) mv[i] = __bfloat162float(m[j * (HS + 2) + lane + 32 * i]);
        for (int r = 0; r < ATT_ROWS; r++) {
            float wj = __shfl_sync(0xffffffffu, w[r], j);
            for (int i = 0; i < HS / 32; i++) acc[r][i] += wj * mv[i];
        }
    }
}

// grid (query tiles, B·NH); the longest rows (last tiles) start first so the tail of the grid is short
template <int HS>
static __global__ void __launch_bounds__(ATT_TILE * ATT_WARPS)
    attention_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int C, int NH, float scale) {
    __shared__ bf16 q_s[ATT_TILE * (HS + 2)], k_s[ATT_TILE * (HS + 2)], v_s[ATT_TILE * (HS + 2)];
    int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH;
    int lane = threadIdx.x % 32, row0 = (threadIdx.x / 32) * ATT_ROWS, q0 = qt * ATT_TILE;
    long row_stride = 3L * C;
    const bf16* base = qkv + (long)b * T * row_stride + h * HS;
    attention_load_tile<HS>(q_s, base, row_stride, q0, T);
    float m[ATT_ROWS], l[ATT_ROWS], acc[ATT_ROWS][HS / 32];
    for (int r = 0; r < ATT_ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int i = 0; i < HS / 32; i++) acc[r][i] = 0.0f;
    }
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();  // everyone is done with the previous key/value tile
        attention_load_tile<HS>(k_s, base + C, row_stride, kt * ATT_TILE, T);
        attention_load_tile<HS>(v_s, base + 2 * C, row_stride, kt * ATT_TILE, T);
        __syncthreads();
        float p[ATT_ROWS];
        attention_row_dots<HS>(p, q_s, row0, k_s);
        int key = kt * ATT_TILE + lane;
        for (int r = 0; r < ATT_ROWS; r++) {
            bool visible = key <= q0 + row0 + r && key < T;
            float x = visible ? p[r] * scale : -INFINITY;
            // key 0 is visible to every row and comes in the first tile, so m_new is finite
            float m_new = fmaxf(m[r], warp_max(x));
            float e = visible ? __expf(x - m_new) : 0.0f;
            float rescale = __expf(m[r] - m_new);
            l[r] = l[r] * rescale + warp_sum(e);
            for (int i = 0; i < HS / 32; i++) acc[r][i] *= rescale;
            m[r] = m_new;
            p[r] = e;
        }
        attention_accumulate<HS>(acc, p, v_s);
    }
    for (int r = 0; r < ATT_ROWS; r++) {
        int t = q0 + row0 + r;
        if (t >= T) break;
        bf16* o = out + ((long)b * T + t) * C + h * HS;
        for (int i = 0; i < HS / 32; i++) o[lane + 32 * i] = __float2bfloat16(acc[r][i] / l[r]);
        if (lane == 0) lse[(long)bh * T + t] = m[r] + logf(l[r]);
    }
}

// delta[b,h,t] = dout · out over the head: Σ_j P·dP for the row, which the softmax backward subtracts
static __global__ void attention_delta_kernel(float* delta, const bf16* dout, const bf16* out, int B, int T, int C,
                                              int NH) {
    long row = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;  // (b, h, t)
    int lane = threadIdx.x % 32, hs = C / NH;
    if (row >= (long)B * NH * T) return;
    long b = row / ((long)NH * T);
    int h = (int)(row / T % NH), t = (int)(row % T);
    long offset = ((long)b * T + t) * C + h * hs;
    float s = 0.0f;
    for (int d = lane; d < hs; d += 32) s += __bfloat162float(dout[offset + d]) * __bfloat162float(out[offset + d]);
    s = warp_sum(s);
    if (lane == 0) delta[row] = s;
}

// dQ for a query tile: rows are queries, lanes are keys of the current key tile
template <int HS>
static __global__ void __launch_bounds__(ATT_TILE * ATT_WARPS)
    attention_backward_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta,
                                 int T, int C, int NH, float scale) {
    __shared__ bf16 q_s[ATT_TILE * (HS + 2)], do_s[ATT_TILE * (HS + 2)], k_s[ATT_TILE * (HS + 2)],
        v_s[ATT_TILE * (HS + 2)];
    int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH;
    int lane = threadIdx.x % 32, row0 = (threadIdx.x / 32) * ATT_ROWS, q0 = qt * ATT_TILE;
    long row_stride = 3L * C;
    const bf16* base = qkv + (long)b * T * row_stride + h * HS;
    attention_load_tile<HS>(q_s, base, row_stride, q0, T);
    attention_load_tile<HS>(do_s, dout + (long)b * T * C + h * HS, C, q0, T);
    float row_lse[ATT_ROWS], row_delta[ATT_ROWS], acc[ATT_ROWS][HS / 32];
    for (int r = 0; r < ATT_ROWS; r++) {
        int t = q0 + row0 + r;
        row_lse[r] = t < T ? lse[(long)bh * T + t] : 0.0f;
        row_delta[r] = t < T ? delta[(long)bh * T + t] : 0.0f;
        for (int i = 0; i < HS / 32; i++) acc[r][i] = 0.0f;
    }
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();
        attention_load_tile<HS>(k_s, base + C, row_stride, kt * ATT_TILE, T);
        attention_load_tile<HS>(v_s, base + 2 * C, row_stride, kt * ATT_TILE, T);
        __syncthreads();
        float s[ATT_ROWS], dp[ATT_ROWS];
        attention_row_dots<HS>(s, q_s, row0, k_s);
        attention_row_dots<HS>(dp, do_s, row0, v_s);
        int key = kt * ATT_TILE + lane;
        for (int r = 0; r < ATT_ROWS; r++) {
            int t = q0 + row0 + r;
            float p = key <= t && t < T ? __expf(s[r] * scale - row_lse[r]) : 0.0f;
            s[r] = p * (dp[r] - row_delta[r]);
        }
        attention_accumulate<HS>(acc, s, k_s);
    }
    for (int r = 0; r < ATT_ROWS; r++) {
        int t = q0 + row0 + r;
        if (t >= T) break;
        bf16* dq = dqkv + ((long)b * T + t) * row_stride + h * HS;
        for (int i = 0; i < HS / 32; i++) dq[lane + 32 * i] = __float2bfloat16(acc[r][i] * scale);
    }
}

// dK and dV for a key tile: rows are keys, lanes are queries of the current query tile
template <int HS>
static __global__ void __launch_bounds__(ATT_TILE * ATT_WARPS)
    attention_backward_dkdv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta,
                                   int T, int C, int NH, float scale) {
    __shared__ bf16 k_s[ATT_TILE * (HS + 2)], v_s[ATT_TILE * (HS + 2)], q_s[ATT_TILE * (HS + 2)],
        do_s[ATT_TILE * (HS + 2)];
    __shared__ float lse_s[ATT_TILE], delta_s[ATT_TILE];
    int kt = blockIdx.x, tiles = gridDim.x, bh = blockIdx.y, b = bh / NH, h = bh % NH;
    int lane = threadIdx.x % 32, row0 = (threadIdx.x / 32) * ATT_ROWS, k0 = kt * ATT_TILE;
    long row_stride = 3L * C;
    const bf16* base = qkv + (long)b * T * row_stride + h * HS;
    attention_load_tile<HS>(k_s, base + C, row_stride, k0, T);
    attention_load_tile<HS>(v_s, base + 2 * C, row_stride, k0, T);
    float dk[ATT_ROWS][HS / 32], dv[ATT_ROWS][HS / 32];
    for (int r = 0; r < ATT_ROWS; r++)
        for (int i = 0; i < HS / 32; i++) dk[r][i] = dv[r][i] = 0.0f;
    for (int qt = kt; qt < tiles; qt++) {
        int q0 = qt * ATT_TILE;
        __syncthreads();
        attention_load_tile<HS>(q_s, base, row_stride, q0, T);
        attention_load_tile<HS>(do_s, dout + (long)b * T * C + h * HS, C, q0, T);
        if (threadIdx.x < ATT_TILE) {
            int t = q0 + threadIdx.x;
            lse_s[threadIdx.x] = t < T ? lse[(long)bh * T + t] : 0.0f;
            delta_s[threadIdx.x] = t < T ? delta[(long)bh * T + t] : 0.0f;
        }
        __syncthreads();
        float p[ATT_ROWS], ds[ATT_ROWS];
        attention_row_dots<HS>(p, k_s, row0, q_s);
        attention_row_dots<HS>(ds, v_s, row0, do_s);
        int t = q0 + lane;
        for (int r = 0; r < ATT_ROWS; r++) {
            int key = k0 + row0 + r;
            p[r] = key <= t && t < T ? __expf(p[r] * scale - lse_s[lane]) : 0.0f;
            ds[r] = p[r] * (ds[r] - delta_s[lane]);
        }
        attention_accumulate<HS>(dv, p, do_s);
        attention_accumulate<HS>(dk, ds, q_s);
    }
    for (int r = 0; r < ATT_ROWS; r++) {
        int key = k0 + row0 + r;
        if (key >= T) break;
        bf16* dkey = dqkv + ((long)b * T + key) * row_stride + C + h * HS;
        for (int i = 0; i < HS / 32; i++) {
            dkey[lane + 32 * i] = __float2bfloat16(dk[r][i] * scale);
            dkey[C + lane + 32 * i] = __float2bfloat16(dv[r][i]);
        }
    }
}

// the head sizes compiled in; others are refused rather than silently slow
template <typename F>
inline void attention_dispatch(int C, int NH, F&& launch) {
    if (C % NH != 0) fail("attention: C=%d is not a multiple of NH=%d", C, NH);
    switch (C / NH) {
        case 64: launch(std::integral_constant<int, 64>{}); break;
        case 128: launch(std::integral_constant<int, 128>{}); break;
        default: fail("attention (CUDA): head size %d not supported (64 or 128)", C / NH);
    }
}

// out (B, T, C) and lse (B, NH, T) from qkv (B, T, 3C)
inline void attention_forward_cuda(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH,
                                   cudaStream_t stream) {
    attention_dispatch(C, NH, [&](auto hs) {
        dim3 grid(cuda_blocks(T, ATT_TILE), B * NH);
        attention_forward_kernel<hs.value><<<grid, ATT_TILE * ATT_WARPS, 0, stream>>>(out, lse, qkv, T, C, NH,
                                                                                      1.0f / sqrtf((float)hs.value));
        cuda_check(cudaGetLastError());
    });
}

// dqkv (B, T, 3C) is overwritten; out and lse are the forward's; delta is B·NH·T floats of scratch
inline void attention_backward_cuda(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                                    float* delta, int B, int T, int C, int NH, cudaStream_t stream) {
    attention_delta_kernel<<<cuda_blocks((long)B * NH * T * 32, 256), 256, 0, stream>>>(delta, dout, out, B, T, C, NH);
    cuda_check(cudaGetLastError());
    attention_dispatch(C, NH, [&](auto hs) {
        dim3 grid(cuda_blocks(T, ATT_TILE), B * NH);
        float scale = 1.0f / sqrtf((float)hs.value);
        attention_backward_dq_kernel<hs.value>
            <<<grid, ATT_TILE * ATT_WARPS, 0, stream>>>(dqkv, dout, qkv, lse, delta, T, C, NH, scale);
        cuda_check(cudaGetLastError());
        attention_backward_dkdv_kernel<hs.value>
            <<<grid, ATT_TILE * ATT_WARPS, 0, stream>>>(dqkv, dout, qkv, lse, delta, T, C, NH, scale);
        cuda_check(cudaGetLastError());
    });
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points. What forward keeps for backward differs by device: the CPU keeps the softmax
// probabilities (B, NH, T, T) in `att`, the GPU only each row's logsumexp (B, NH, T), from which the flash
// backward recomputes them tile by tile; the GPU backward also reads the forward's output `out`.

#include "llmc/device.cuh"

inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float*, const float* att, int B,
                               int T, int C, int NH, float* scratch) {
    attention_backward(dqkv, dout, qkv, att, B, T, C, NH, scratch);
}

inline void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH) {
    attention_forward_cuda(out, lse, qkv, B, T, C, NH, main_stream());
}
inline void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B,
                               int T, int C, int NH, float*) {
    float* scratch = gpu_scratch((size_t)B * NH * T, "attention_backward");
    attention_backward_cuda(dqkv, dout, qkv, out, lse, scratch, B, T, C, NH, main_stream());
}
