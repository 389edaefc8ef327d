// LayerNorm over the channel dimension (eps 1e-5, as GPT-2), forward and backward.
// The forward keeps each row's mean and 1/std so the backward need not recompute the statistics.
#pragma once

#include <cmath>

inline void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, long N, int C) {
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* x = inp + n * C;
        float m = 0.0f;
        for (int c = 0; c < C; c++) m += x[c];
        m /= C;
        float v = 0.0f;
        for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
        v /= C;
        float s = 1.0f / sqrtf(v + 1e-5f);
        float* o = out + n * C;
        for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * weight[c] + bias[c];
        mean[n] = m;
        rstd[n] = s;
    }
}

// dinp, dweight and dbias accumulate (+=): dinp is the residual stream's gradient, which the layernorm adds to
inline void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, const float* mean, const float* rstd, long N, int C) {
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* x = inp + n * C;
        const float* d = dout + n * C;
        float m = mean[n], s = rstd[n];
        // dx = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), with dnorm = dout * weight
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (int c = 0; c < C; c++) {
            float dnorm = d[c] * weight[c];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * (x[c] - m) * s;
        }
        dnorm_mean /= C;
        dnorm_norm_mean /= C;
        float* dx = dinp + n * C;
        for (int c = 0; c < C; c++) {
            float norm = (x[c] - m) * s;
            dx[c] += s * (d[c] * weight[c] - dnorm_mean - norm * dnorm_norm_mean);
        }
    }
    // parameter gradients sum over rows: split by channel so each sum has one owner and a fixed order. Each sum is
    // taken whole and then added to the gradient once, as the kernels add their partial sums: a micro-step's
    // gradient reaches the accumulated one in one add, so that one rank accumulating micro-steps adds what dp's
    // ranks reduce (llmc/zero.cuh)
    constexpr int CHUNK = 32;
#pragma omp parallel for
    for (int c0 = 0; c0 < C; c0 += CHUNK) {
        int c1 = c0 + CHUNK < C ? c0 + CHUNK : C;
        float sum_w[CHUNK] = {}, sum_b[CHUNK] = {};
        for (long n = 0; n < N; n++) {
            const float* x = inp + n * C;
            const float* d = dout + n * C;
            for (int c = c0; c < c1; c++) {
                sum_w[c - c0] += d[c] * (x[c] - mean[n]) * rstd[n];
                sum_b[c - c0] += d[c];
            }
        }
        for (int c = c0; c < c1; c++) dweight[c] += sum_w[c - c0], dbias[c] += sum_b[c - c0];
    }
}

// ==========================================================================================================
// CUDA. Both directions are memory-bound (a few FLOPs per byte), so each moves every byte once, 16 bytes per
// access. A warp owns a row and holds it in registers, K bf16x8 vectors per lane (K·256 channels): the forward
// reads the row (and adds the residual) once, takes the mean and then the variance around it from registers
// (no E[x²] - mean² cancellation), and writes; the backward reads x, dout and dinp once and writes dinp. A
// lane writes only the elements it has already read into registers, so an output may alias an input
// (residual == inp1, out == inp, dinp == dout all work).
// The parameter gradients are sums over all rows. Each block of the backward takes a fixed range of rows; each
// of its warps adds its rows' dout·norm and dout into its own slice of shared memory (no atomics), and the block
// adds its warps' slices in warp order into one partial sum per block. A second kernel adds the blocks' partials
// in block order, spread over column groups and row phases so that it does not run on a handful of threads.
// Every sum has a fixed order, so the bits are reproducible. C must be a multiple of 8 and at most
// LAYERNORM_MAX_C, the pointers 16-byte aligned; the entry points check.

#include <type_traits>

#include "llmc/cuda_common.cuh"

constexpr int LAYERNORM_MAX_C = 4096;

// calls launch(std::integral_constant<int, K>) with the fewest vectors per lane K that hold a row of C channels
template <typename Launch>
inline void layernorm_with_row_vectors(int C, Launch&& launch) {
    if (C <= 1024) launch(std::integral_constant<int, 4>{});
    else if (C <= 2048) launch(std::integral_constant<int, 8>{});
    else launch(std::integral_constant<int, 16>{});
}

inline void layernorm_check_shape(const char* what, int C, std::initializer_list<const void*> pointers) {
    if (C <= 0 || C % 8 != 0 || C > LAYERNORM_MAX_C)
        fail("%s: C = %d must be a positive multiple of 8, at most %d", what, C, LAYERNORM_MAX_C);
    for (const void* p : pointers) require_aligned_16(what, p);
}

// inp2 may be null (plain layernorm); residual is written only when inp2 is given
template <int K>
static __global__ void __launch_bounds__(256)
    layernorm_forward_kernel(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1, const bf16* inp2,
                             const bf16* weight, const bf16* bias, long N, int C) {
    long n = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (n >= N) return;
    long row = n * C;
    bf16x8 x[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        int c = (k * 32 + lane) * 8;
        if (c < C) x[k] = *reinterpret_cast<const bf16x8*>(inp1 + row + c);
    }
    if (inp2) {
        bf16x8 y[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c = (k * 32 + lane) * 8;
            if (c < C) y[k] = *reinterpret_cast<const bf16x8*>(inp2 + row + c);
        }
        // the residual stream stores bf16(inp1 + inp2), and that stored value is what the layernorm normalizes
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c = (k * 32 + lane) * 8;
            if (c >= C) continue;
            float a[8], b[8];
            unpack_bf16x8(x[k], a);
            unpack_bf16x8(y[k], b);
            for (int j = 0; j < 8; j++) a[j] += b[j];
            x[k] = pack_bf16x8(a);
            *reinterpret_cast<bf16x8*>(residual + row + c) = x[k];
        }
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        if ((k * 32 + lane) * 8 >= C) continue;
        float f[8];
        unpack_bf16x8(x[k], f);
        for (int j = 0; j < 8; j++) sum += f[j];
    }
    float m = warp_sum(sum) / C;
    float var = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        if ((k * 32 + lane) * 8 >= C) continue;
        float f[8];
        unpack_bf16x8(x[k], f);
        for (int j = 0; j < 8; j++) var += (f[j] - m) * (f[j] - m);
    }
    float s = rsqrtf(warp_sum(var) / C + 1e-5f);
#pragma unroll
    for (int k = 0; k < K; k++) {
        int c = (k * 32 + lane) * 8;
        if (c >= C) continue;
        float f[8], w[8], b[8];
        unpack_bf16x8(x[k], f);
        unpack_bf16x8(*reinterpret_cast<const bf16x8*>(weight + c), w);
        unpack_bf16x8(*reinterpret_cast<const bf16x8*>(bias + c), b);
        for (int j = 0; j < 8; j++) f[j] = (f[j] - m) * s * w[j] + b[j];
        *reinterpret_cast<bf16x8*>(out + row + c) = pack_bf16x8(f);
    }
    if (lane == 0) {
        mean[n] = m;
        rstd[n] = s;
    }
}

inline void layernorm_forward_cuda(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                                   const bf16* bias, long N, int C, cudaStream_t stream) {
    layernorm_check_shape("layernorm_forward_cuda", C, {out, inp, weight, bias});
    if (N == 0) return;
    layernorm_with_row_vectors(C, [&](auto k) {
        layernorm_forward_kernel<decltype(k)::value>
            <<<cuda_blocks(N, 8), 256, 0, stream>>>(nullptr, out, mean, rstd, inp, nullptr, weight, bias, N, C);
    });
    cuda_check(cudaGetLastError());
}

// residual = inp1 + inp2, then out = layernorm(residual): the residual connection and the next layernorm.
// residual may be inp1 or inp2 (the stream updated in place), and out may alias any input.
inline void fused_residual_layernorm_forward_cuda(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1,
                                                  const bf16* inp2, const bf16* weight, const bf16* bias, long N, int C,
                                                  cudaStream_t stream) {
    layernorm_check_shape("fused_residual_layernorm_forward_cuda", C, {residual, out, inp1, inp2, weight, bias});
    if (!residual || !inp2) fail("fused_residual_layernorm_forward_cuda: residual and inp2 are required");
    if (N == 0) return;
    layernorm_with_row_vectors(C, [&](auto k) {
        layernorm_forward_kernel<decltype(k)::value>
            <<<cuda_blocks(N, 8), 256, 0, stream>>>(residual, out, mean, rstd, inp1, inp2, weight, bias, N, C);
    });
    cuda_check(cudaGetLastError());
}

constexpr int LAYERNORM_BWD_WARPS = 4;  // warps per backward block, each with its own 2·C floats of shared memory

// rows per backward block, a function of N alone (so the summation order, and the bits, do not depend on the
// GPU): about 1024 blocks to fill any GPU, and at least 16 rows each so the partial sums stay a small fraction
// of the traffic. RMSNorm's backward (llmc/rmsnorm.cuh) blocks its rows the same way.
inline int norm_backward_rows_per_block(long N) {
    int rows = 16;
    while (rows < 64 && (long)rows * 1024 < N) rows *= 2;
    return rows;
}

inline long layernorm_backward_scratch_floats(long N, int C) {
    long rows = norm_backward_rows_per_block(N);
    return (N + rows - 1) / rows * 2 * (long)C;
}

// partial[block] = (Σ dout·norm, Σ dout) over the block's rows, 2·C floats; dinp += the input gradient
template <int K>
static __global__ void __launch_bounds__(LAYERNORM_BWD_WARPS * 32)
    layernorm_backward_kernel(bf16* dinp, float* partial, const bf16* dout, const bf16* inp, const bf16* weight,
                              const float* mean, const float* rstd, long N, int C, int rows_per_block) {
    extern __shared__ float warp_sums[];  // [warp][2·C]: Σ dout·norm in the first C, Σ dout in the next C
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float* my_sums = warp_sums + (long)warp * 2 * C;
    for (int c = lane; c < 2 * C; c += 32) my_sums[c] = 0.0f;
    __syncwarp();
    long r0 = (long)blockIdx.x * rows_per_block, r1 = min(r0 + rows_per_block, N);
    for (long n = r0 + warp; n < r1; n += LAYERNORM_BWD_WARPS) {
        long row = n * C;
        bf16x8 x[K], d[K], g[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c = (k * 32 + lane) * 8;
            if (c >= C) continue;
            x[k] = *reinterpret_cast<const bf16x8*>(inp + row + c);
            d[k] = *reinterpret_cast<const bf16x8*>(dout + row + c);
            g[k] = *reinterpret_cast<const bf16x8*>(dinp + row + c);
        }
        float m = mean[n], s = rstd[n];
        // dx = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), with dnorm = dout * weight
        float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c = (k * 32 + lane) * 8;
            if (c >= C) continue;
            float xf[8], df[8], wf[8];
            unpack_bf16x8(x[k], xf);
            unpack_bf16x8(d[k], df);
            unpack_bf16x8(*reinterpret_cast<const bf16x8*>(weight + c), wf);
            float4* dw = reinterpret_cast<float4*>(my_sums + c);
            float4* db = reinterpret_cast<float4*>(my_sums + C + c);
            float4 dw0 = dw[0], dw1 = dw[1], db0 = db[0], db1 = db[1];
            float norm[8];
            for (int j = 0; j < 8; j++) {
                norm[j] = (xf[j] - m) * s;
                float dnorm = df[j] * wf[j];
                dnorm_sum += dnorm;
                dnorm_norm_sum += dnorm * norm[j];
            }
            dw0.x += df[0] * norm[0], dw0.y += df[1] * norm[1], dw0.z += df[2] * norm[2], dw0.w += df[3] * norm[3];
            dw1.x += df[4] * norm[4], dw1.y += df[5] * norm[5], dw1.z += df[6] * norm[6], dw1.w += df[7] * norm[7];
            db0.x += df[0], db0.y += df[1], db0.z += df[2], db0.w += df[3];
            db1.x += df[4], db1.y += df[5], db1.z += df[6], db1.w += df[7];
            dw[0] = dw0, dw[1] = dw1, db[0] = db0, db[1] = db1;
        }
        float dnorm_mean = warp_sum(dnorm_sum) / C, dnorm_norm_mean = warp_sum(dnorm_norm_sum) / C;
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c = (k * 32 + lane) * 8;
            if (c >= C) continue;
            float xf[8], df[8], wf[8], gf[8];
            unpack_bf16x8(x[k], xf);
            unpack_bf16x8(d[k], df);
            unpack_bf16x8(*reinterpret_cast<const bf16x8*>(weight + c), wf);
            unpack_bf16x8(g[k], gf);
            for (int j = 0; j < 8; j++) gf[j] += s * (df[j] * wf[j] - dnorm_mean - (xf[j] - m) * s * dnorm_norm_mean);
            *reinterpret_cast<bf16x8*>(dinp + row + c) = pack_bf16x8(gf);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
        float total = 0.0f;
        for (int w = 0; w < LAYERNORM_BWD_WARPS; w++) total += warp_sums[(long)w * 2 * C + c];
        partial[(long)blockIdx.x * 2 * C + c] = total;
    }
}

constexpr int LAYERNORM_PARAM_GRAD_WARPS = 32;

// dweight += Σ over blocks of partial[.][0:C], dbias += Σ of partial[.][C:2C], in block order split in a fixed
// way: a block takes 32 of the 2·C columns (a warp reads them as one 128-byte line), warp w sums the partial
// rows w, w + 32, ... in order, and warp 0 adds the 32 warp sums in warp order
static __global__ void __launch_bounds__(LAYERNORM_PARAM_GRAD_WARPS * 32)
    layernorm_param_grad_kernel(bf16* dweight, bf16* dbias, const float* partial, long blocks, int C) {
    __shared__ float warp_sums[LAYERNORM_PARAM_GRAD_WARPS][33];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int col = blockIdx.x * 32 + lane;
    float s = 0.0f;
    if (col < 2 * C) {
#pragma unroll 8  // eight loads in flight before the adds that wait on them
        for (long b = warp; b < blocks; b += LAYERNORM_PARAM_GRAD_WARPS) s += partial[b * 2 * C + col];
    }
    warp_sums[warp][lane] = s;
    __syncthreads();
    if (warp != 0 || col >= 2 * C) return;
    float total = 0.0f;
    for (int w = 0; w < LAYERNORM_PARAM_GRAD_WARPS; w++) total += warp_sums[w][lane];
    bf16* dst = col < C ? dweight + col : dbias + (col - C);
    *dst = __float2bfloat16(__bfloat162float(*dst) + total);
}

// dinp, dweight and dbias accumulate (+=), as on the CPU; scratch holds layernorm_backward_scratch_floats(N, C)
inline void layernorm_backward_cuda(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                                    const bf16* weight, const float* mean, const float* rstd, long N, int C,
                                    float* scratch, cudaStream_t stream) {
    layernorm_check_shape("layernorm_backward_cuda", C, {dinp, dout, inp, weight});
    if (N == 0) return;
    int rows = norm_backward_rows_per_block(N);
    long blocks = (N + rows - 1) / rows;
    size_t shared_bytes = (size_t)LAYERNORM_BWD_WARPS * 2 * C * sizeof(float);
    layernorm_with_row_vectors(C, [&](auto k) {
        constexpr int K = decltype(k)::value;
        // above 48 KiB a kernel must ask for its shared memory; ask once for the most this K can need
        static bool raised = [] {
            int most = LAYERNORM_BWD_WARPS * 2 * (K * 256) * (int)sizeof(float);
            cuda_check(cudaFuncSetAttribute(layernorm_backward_kernel<K>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, most));
            return true;
        }();
        (void)raised;
        layernorm_backward_kernel<K><<<(unsigned int)blocks, LAYERNORM_BWD_WARPS * 32, shared_bytes, stream>>>(
            dinp, scratch, dout, inp, weight, mean, rstd, N, C, rows);
    });
    cuda_check(cudaGetLastError());
    layernorm_param_grad_kernel<<<cuda_blocks(2L * C, 32), LAYERNORM_PARAM_GRAD_WARPS * 32, 0, stream>>>(
        dweight, dbias, scratch, blocks, C);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points: the CPU functions above and, for bf16, the kernels. GPT-2 adds the residual
// stream right before every layernorm but the first, so both devices offer that pair as one call.

#include "llmc/device.cuh"
#include "llmc/residual.cuh"

// residual = inp1 + inp2, out = layernorm(residual); no output may alias an input
inline void fused_residual_layernorm_forward(float* residual, float* out, float* mean, float* rstd, const float* inp1,
                                             const float* inp2, const float* weight, const float* bias, long N, int C) {
    residual_forward(residual, inp1, inp2, N * C);
    layernorm_forward(out, mean, rstd, residual, weight, bias, N, C);
}

inline void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                              const bf16* bias, long N, int C) {
    layernorm_forward_cuda(out, mean, rstd, inp, weight, bias, N, C, main_stream());
}
inline void fused_residual_layernorm_forward(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1,
                                             const bf16* inp2, const bf16* weight, const bf16* bias, long N, int C) {
    fused_residual_layernorm_forward_cuda(residual, out, mean, rstd, inp1, inp2, weight, bias, N, C, main_stream());
}
inline void layernorm_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                               const bf16* weight, const float* mean, const float* rstd, long N, int C) {
    float* scratch = gpu_scratch((size_t)layernorm_backward_scratch_floats(N, C), "layernorm_backward");
    layernorm_backward_cuda(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, scratch, main_stream());
}
