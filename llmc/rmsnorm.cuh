// RMSNorm over the channel dimension, Llama 3's norm: out = x · rstd · weight with rstd = 1/sqrt(mean(x²) + eps),
// no mean subtracted and no bias (Meta's reference model, llm.c's llama3 branch). eps comes from the model file
// (norm_eps), so every call takes it. The forward keeps each row's rstd so the backward need not recompute it.
// The same shape as llmc/layernorm.cuh, GPT-2's norm: a CPU reference in fp32 loops, CUDA kernels on bf16 with
// fp32 statistics, and entry points overloaded on the storage type.
#pragma once

#include <cmath>

inline void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, long N, int C, float eps) {
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* x = inp + n * C;
        float sum_sq = 0.0f;
        for (int c = 0; c < C; c++) sum_sq += x[c] * x[c];
        float s = 1.0f / sqrtf(sum_sq / C + eps);
        float* o = out + n * C;
        for (int c = 0; c < C; c++) o[c] = x[c] * s * weight[c];
        rstd[n] = s;
    }
}

// dinp and dweight accumulate (+=): dinp is the residual stream's gradient, which the norm adds to
inline void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const float* rstd, long N, int C) {
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* x = inp + n * C;
        const float* d = dout + n * C;
        float s = rstd[n];
        // dx = s · (g - x · s² · mean(g·x)), with g = dout · weight: the second term is rstd's own dependence on x
        float gx_mean = 0.0f;
        for (int c = 0; c < C; c++) gx_mean += d[c] * weight[c] * x[c];
        gx_mean /= C;
        float* dx = dinp + n * C;
        for (int c = 0; c < C; c++) dx[c] += s * (d[c] * weight[c] - x[c] * s * s * gx_mean);
    }
    // dweight sums over rows: split by channel so each sum has one owner and a fixed order, taken whole and then
    // added once (as layernorm_backward's)
    constexpr int CHUNK = 32;
#pragma omp parallel for
    for (int c0 = 0; c0 < C; c0 += CHUNK) {
        int c1 = c0 + CHUNK < C ? c0 + CHUNK : C;
        float sum[CHUNK] = {};
        for (long n = 0; n < N; n++) {
            const float* x = inp + n * C;
            const float* d = dout + n * C;
            for (int c = c0; c < c1; c++) sum[c - c0] += d[c] * x[c] * rstd[n];
        }
        for (int c = c0; c < c1; c++) dweight[c] += sum[c - c0];
    }
}

// ==========================================================================================================
// CUDA. Both directions are memory-bound, so each moves every byte once, 16 bytes per access, the row held in
// registers as K bf16x8 vectors per thread. Llama's widths run from 2048 to 16384 channels, more than one warp
// can hold without spilling, so a row belongs to a group of W warps (W = 1 up to 2048 channels, then 2, 4, 8:
// at most 8 vectors a thread). Thread t of a group holds the vectors t, t + 32·W, t + 64·W, ..., so a warp's
// accesses are 512 contiguous bytes. The one row statistic, Σx² in the forward and Σ g·x in the backward, is a
// warp sum and then, for W > 1, the group's warps added in warp order through shared memory; that needs a block
// barrier, so no thread of a block leaves before it. A thread writes only the elements it has already read into
// registers, so an output may alias an input (residual == inp1, out == inp, dinp == dout all work).
// dweight sums over all rows. Each block of the backward takes a fixed range of rows; each of its groups adds its
// rows' dout·x·rstd into its own C floats of shared memory (a thread into its own channels: no atomics), and the
// block adds its groups' sums in group order into one partial sum per block. A second kernel adds the blocks'
// partials in block order, spread over column groups and row phases. Every sum has a fixed order, so the bits are
// reproducible. C must be a multiple of 8 and at most RMSNORM_MAX_C, the pointers 16-byte aligned; the entry
// points check.

#include <type_traits>

#include "llmc/cuda_common.cuh"
#include "llmc/layernorm.cuh"

constexpr int RMSNORM_MAX_C = 16384;  // Llama 3.1 405B's width
constexpr int RMSNORM_WARPS = 8;      // warps per block, both directions: 8 / W rows at a time

// calls launch(std::integral_constant<int, K>, std::integral_constant<int, W>) with the row layout for C channels:
// W warps of K vectors per thread, K · W · 256 ≥ C
template <typename Launch>
inline void rmsnorm_with_row_layout(int C, Launch&& launch) {
    using I1 = std::integral_constant<int, 1>;
    using I4 = std::integral_constant<int, 4>;
    using I8 = std::integral_constant<int, 8>;
    if (C <= 1024) launch(I4{}, I1{});
    else if (C <= 2048) launch(I8{}, I1{});
    else if (C <= 4096) launch(I8{}, std::integral_constant<int, 2>{});
    else if (C <= 8192) launch(I8{}, I4{});
    else launch(I8{}, I8{});
}

inline void rmsnorm_check_shape(const char* what, int C, std::initializer_list<const void*> pointers) {
    if (C <= 0 || C % 8 != 0 || C > RMSNORM_MAX_C)
        fail("%s: C = %d must be a positive multiple of 8, at most %d", what, C, RMSNORM_MAX_C);
    for (const void* p : pointers) require_aligned_16(what, p);
}

// Σ v over the W warps of this thread's row group, the same bits in every thread of the group. For W > 1 every
// thread of the block must call it (it holds a block barrier), and the next call must not write `slots` (one
// float per warp of the block) while a slow thread may still read them: callers alternate two, so that the
// barrier of the call in between keeps each write after the reads of the same slots.
template <int W>
static __device__ __forceinline__ float rmsnorm_row_sum(float v, float* slots) {
    v = warp_sum(v);
    if constexpr (W == 1) {
        return v;
    } else {
        int warp = threadIdx.x / 32;
        if (threadIdx.x % 32 == 0) slots[warp] = v;
        __syncthreads();
        int first = warp / W * W;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < W; w++) total += slots[first + w];
        return total;
    }
}

// inp2 may be null (plain rmsnorm); residual is written only when inp2 is given
template <int K, int W>
static __global__ void __launch_bounds__(RMSNORM_WARPS * 32)
    rmsnorm_forward_kernel(bf16* residual, bf16* out, float* rstd, const bf16* inp1, const bf16* inp2,
                           const bf16* weight, long N, int C, float eps) {
    __shared__ float slots[RMSNORM_WARPS];
    int t = threadIdx.x % (32 * W);
    long n = (long)blockIdx.x * (RMSNORM_WARPS / W) + threadIdx.x / (32 * W);
    bool active = n < N;  // the last block's spare groups still join the row sum's barrier
    long row = n * C;
    bf16x8 x[K];
    float sum_sq = 0.0f;
    if (active) {
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c = (k * 32 * W + t) * 8;
            if (c < C) x[k] = *reinterpret_cast<const bf16x8*>(inp1 + row + c);
        }
        if (inp2) {
            // the residual stream stores bf16(inp1 + inp2), and that stored value is what the norm normalizes
#pragma unroll
            for (int k = 0; k < K; k++) {
                int c = (k * 32 * W + t) * 8;
                if (c >= C) continue;
                float a[8], b[8];
                unpack_bf16x8(x[k], a);
                unpack_bf16x8(*reinterpret_cast<const bf16x8*>(inp2 + row + c), b);
                for (int j = 0; j < 8; j++) a[j] += b[j];
                x[k] = pack_bf16x8(a);
                *reinterpret_cast<bf16x8*>(residual + row + c) = x[k];
            }
        }
#pragma unroll
        for (int k = 0; k < K; k++) {
            if ((k * 32 * W + t) * 8 >= C) continue;
            float f[8];
            unpack_bf16x8(x[k], f);
            for (int j = 0; j < 8; j++) sum_sq += f[j] * f[j];
        }
    }
    float s = rsqrtf(rmsnorm_row_sum<W>(sum_sq, slots) / C + eps);
    if (!active) return;
#pragma unroll
    for (int k = 0; k < K; k++) {
        int c = (k * 32 * W + t) * 8;
        if (c >= C) continue;
        float f[8], w[8];
        unpack_bf16x8(x[k], f);
        unpack_bf16x8(*reinterpret_cast<const bf16x8*>(weight + c), w);
        for (int j = 0; j < 8; j++) f[j] = f[j] * s * w[j];
        *reinterpret_cast<bf16x8*>(out + row + c) = pack_bf16x8(f);
    }
    if (t == 0) rstd[n] = s;
}

template <int K, int W>
inline void rmsnorm_forward_launch(bf16* residual, bf16* out, float* rstd, const bf16* inp1, const bf16* inp2,
                                   const bf16* weight, long N, int C, float eps, cudaStream_t stream) {
    rmsnorm_forward_kernel<K, W><<<cuda_blocks(N, RMSNORM_WARPS / W), RMSNORM_WARPS * 32, 0, stream>>>(
        residual, out, rstd, inp1, inp2, weight, N, C, eps);
    cuda_check(cudaGetLastError());
}

inline void rmsnorm_forward_cuda(bf16* out, float* rstd, const bf16* inp, const bf16* weight, long N, int C,
                                 float eps, cudaStream_t stream) {
    rmsnorm_check_shape("rmsnorm_forward_cuda", C, {out, inp, weight});
    if (N == 0) return;
    rmsnorm_with_row_layout(C, [&](auto k, auto w) {
        rmsnorm_forward_launch<decltype(k)::value, decltype(w)::value>(nullptr, out, rstd, inp, nullptr, weight, N, C,
                                                                       eps, stream);
    });
}

// residual = inp1 + inp2, then out = rmsnorm(residual): the residual connection and the next norm. residual may
// be inp1 or inp2 (the stream updated in place), and out may alias either input, but not residual.
inline void fused_residual_rmsnorm_forward_cuda(bf16* residual, bf16* out, float* rstd, const bf16* inp1,
                                                const bf16* inp2, const bf16* weight, long N, int C, float eps,
                                                cudaStream_t stream) {
    rmsnorm_check_shape("fused_residual_rmsnorm_forward_cuda", C, {residual, out, inp1, inp2, weight});
    if (!residual || !inp2) fail("fused_residual_rmsnorm_forward_cuda: residual and inp2 are required");
    if (N == 0) return;
    rmsnorm_with_row_layout(C, [&](auto k, auto w) {
        rmsnorm_forward_launch<decltype(k)::value, decltype(w)::value>(residual, out, rstd, inp1, inp2, weight, N, C,
                                                                       eps, stream);
    });
}

// the backward's partial sums: C floats for each block of norm_backward_rows_per_block rows (llmc/layernorm.cuh)
inline long rmsnorm_backward_scratch_floats(long N, int C) {
    long rows = norm_backward_rows_per_block(N);
    return (N + rows - 1) / rows * (long)C;
}

// the dynamic shared memory of a backward block: one row of dweight sums per row group, (8 / W) · C floats, at
// most 64 KiB (K = 8 vectors of 8 channels for each of the group's 32 · W threads)
template <int K, int W>
constexpr int rmsnorm_backward_max_shared_bytes() {
    return RMSNORM_WARPS / W * (K * 8 * 32 * W) * (int)sizeof(float);
}

// partial[block] = Σ dout·x·rstd over the block's rows, C floats; dinp += the input gradient
template <int K, int W>
static __global__ void __launch_bounds__(RMSNORM_WARPS * 32)
    rmsnorm_backward_kernel(bf16* dinp, float* partial, const bf16* dout, const bf16* inp, const bf16* weight,
                            const float* rstd, long N, int C, int rows_per_block) {
    constexpr int GROUPS = RMSNORM_WARPS / W;
    extern __shared__ float4 group_sums_storage[];  // float4: the 16-byte alignment the vector accesses need
    float* group_sums = reinterpret_cast<float*>(group_sums_storage);  // [group][C]
    __shared__ float slots[2][RMSNORM_WARPS];
    int t = threadIdx.x % (32 * W), group = threadIdx.x / (32 * W);
    float* my_sums = group_sums + (long)group * C;
    // each thread zeroes and then adds into exactly the channels it holds, so no barrier is needed before the end
#pragma unroll
    for (int k = 0; k < K; k++) {
        int c = (k * 32 * W + t) * 8;
        if (c >= C) continue;
        float4* acc = reinterpret_cast<float4*>(my_sums + c);
        acc[0] = acc[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    long r0 = (long)blockIdx.x * rows_per_block, r1 = min(r0 + rows_per_block, N);
    // every group takes the same number of steps, active or not, because the row sum holds a block barrier
    for (int step = 0; step * GROUPS < rows_per_block; step++) {
        long n = r0 + (long)step * GROUPS + group;
        bool active = n < r1;
        long row = n * C;
        float s = active ? rstd[n] : 0.0f;
        bf16x8 x[K], d[K], g[K];
        float gx_sum = 0.0f;  // Σ dout·weight·x over this thread's channels
        if (active) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                int c = (k * 32 * W + t) * 8;
                if (c >= C) continue;
                x[k] = *reinterpret_cast<const bf16x8*>(inp + row + c);
                d[k] = *reinterpret_cast<const bf16x8*>(dout + row + c);
                g[k] = *reinterpret_cast<const bf16x8*>(dinp + row + c);
            }
#pragma unroll
            for (int k = 0; k < K; k++) {
                int c = (k * 32 * W + t) * 8;
                if (c >= C) continue;
                float xf[8], df[8], wf[8];
                unpack_bf16x8(x[k], xf);
                unpack_bf16x8(d[k], df);
                unpack_bf16x8(*reinterpret_cast<const bf16x8*>(weight + c), wf);
                float4* acc = reinterpret_cast<float4*>(my_sums + c);
                float4 a0 = acc[0], a1 = acc[1];
                for (int j = 0; j < 8; j++) gx_sum += df[j] * wf[j] * xf[j];
                a0.x += df[0] * xf[0] * s, a0.y += df[1] * xf[1] * s, a0.z += df[2] * xf[2] * s;
                a0.w += df[3] * xf[3] * s, a1.x += df[4] * xf[4] * s, a1.y += df[5] * xf[5] * s;
                a1.z += df[6] * xf[6] * s, a1.w += df[7] * xf[7] * s;
                acc[0] = a0, acc[1] = a1;
            }
        }
        float gx_mean = rmsnorm_row_sum<W>(gx_sum, slots[step % 2]) / C;
        if (!active) continue;
        // dx = s · (g - x · s² · mean(g·x)), with g = dout · weight
#pragma unroll
        for (int k = 0; k < K; k++) {
            int c = (k * 32 * W + t) * 8;
            if (c >= C) continue;
            float xf[8], df[8], wf[8], gf[8];
            unpack_bf16x8(x[k], xf);
            unpack_bf16x8(d[k], df);
            unpack_bf16x8(*reinterpret_cast<const bf16x8*>(weight + c), wf);
            unpack_bf16x8(g[k], gf);
            for (int j = 0; j < 8; j++) gf[j] += s * (df[j] * wf[j] - xf[j] * s * s * gx_mean);
            *reinterpret_cast<bf16x8*>(dinp + row + c) = pack_bf16x8(gf);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float total = 0.0f;
        for (int gi = 0; gi < GROUPS; gi++) total += group_sums[(long)gi * C + c];
        partial[(long)blockIdx.x * C + c] = total;
    }
}

constexpr int RMSNORM_PARAM_GRAD_WARPS = 32;

// dweight += Σ over blocks of partial[.][0:C], in block order split in a fixed way: a block takes 32 of the C
// columns (a warp reads them as one 128-byte line), warp w sums the partial rows w, w + 32, ... in order, and
// warp 0 adds the 32 warp sums in warp order
static __global__ void __launch_bounds__(RMSNORM_PARAM_GRAD_WARPS * 32)
    rmsnorm_param_grad_kernel(bf16* dweight, const float* partial, long blocks, int C) {
    __shared__ float warp_sums[RMSNORM_PARAM_GRAD_WARPS][33];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int col = blockIdx.x * 32 + lane;
    float s = 0.0f;
    if (col < C) {
#pragma unroll 8  // eight loads in flight before the adds that wait on them
        for (long b = warp; b < blocks; b += RMSNORM_PARAM_GRAD_WARPS) s += partial[b * C + col];
    }
    warp_sums[warp][lane] = s;
    __syncthreads();
    if (warp != 0 || col >= C) return;
    float total = 0.0f;
    for (int w = 0; w < RMSNORM_PARAM_GRAD_WARPS; w++) total += warp_sums[w][lane];
    dweight[col] = __float2bfloat16(__bfloat162float(dweight[col]) + total);
}

// dinp and dweight accumulate (+=), as on the CPU; scratch holds rmsnorm_backward_scratch_floats(N, C)
inline void rmsnorm_backward_cuda(bf16* dinp, bf16* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                                  const float* rstd, long N, int C, float* scratch, cudaStream_t stream) {
    rmsnorm_check_shape("rmsnorm_backward_cuda", C, {dinp, dout, inp, weight});
    if (N == 0) return;
    int rows = norm_backward_rows_per_block(N);
    long blocks = (N + rows - 1) / rows;
    rmsnorm_with_row_layout(C, [&](auto k, auto w) {
        constexpr int K = decltype(k)::value, W = decltype(w)::value;
        // above 48 KiB a kernel must ask for its shared memory; ask once for the most this layout can need
        static bool raised = [] {
            cuda_check(cudaFuncSetAttribute(rmsnorm_backward_kernel<K, W>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            rmsnorm_backward_max_shared_bytes<K, W>()));
            return true;
        }();
        (void)raised;
        size_t shared_bytes = (size_t)(RMSNORM_WARPS / W) * C * sizeof(float);
        rmsnorm_backward_kernel<K, W><<<(unsigned int)blocks, RMSNORM_WARPS * 32, shared_bytes, stream>>>(
            dinp, scratch, dout, inp, weight, rstd, N, C, rows);
    });
    cuda_check(cudaGetLastError());
    rmsnorm_param_grad_kernel<<<cuda_blocks(C, 32), RMSNORM_PARAM_GRAD_WARPS * 32, 0, stream>>>(dweight, scratch,
                                                                                                 blocks, C);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points: the CPU functions above and, for bf16, the kernels. Llama adds the residual stream
// right before every norm but the first, so both devices offer that pair as one call.

#include "llmc/device.cuh"
#include "llmc/residual.cuh"

// residual = inp1 + inp2, out = rmsnorm(residual); residual may be inp1 or inp2, out a buffer of its own
inline void fused_residual_rmsnorm_forward(float* residual, float* out, float* rstd, const float* inp1,
                                           const float* inp2, const float* weight, long N, int C, float eps) {
    residual_forward(residual, inp1, inp2, N * C);
    rmsnorm_forward(out, rstd, residual, weight, N, C, eps);
}

inline void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, long N, int C, float eps) {
    rmsnorm_forward_cuda(out, rstd, inp, weight, N, C, eps, main_stream());
}
inline void fused_residual_rmsnorm_forward(bf16* residual, bf16* out, float* rstd, const bf16* inp1, const bf16* inp2,
                                           const bf16* weight, long N, int C, float eps) {
    fused_residual_rmsnorm_forward_cuda(residual, out, rstd, inp1, inp2, weight, N, C, eps, main_stream());
}
inline void rmsnorm_backward(bf16* dinp, bf16* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                             const float* rstd, long N, int C) {
    float* scratch = gpu_scratch((size_t)rmsnorm_backward_scratch_floats(N, C), "rmsnorm_backward");
    rmsnorm_backward_cuda(dinp, dweight, dout, inp, weight, rstd, N, C, scratch, main_stream());
}
