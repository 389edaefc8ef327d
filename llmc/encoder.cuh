// Token + position embedding: out[b,t,:] = wte[token[b,t],:] + wpe[t,:], and its backward.
// The backward scatters into the embedding tables; it is split across threads by channel ranges so that every
// table entry is summed in token order by one thread, which keeps the result bit-reproducible.
#pragma once

#include <omp.h>

inline void encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C) {
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float* o = out + ((size_t)b * T + t) * C;
            const float* tok = wte + (size_t)tokens[b * T + t] * C;
            const float* pos = wpe + (size_t)t * C;
            for (int c = 0; c < C; c++) o[c] = tok[c] + pos[c];
        }
}

// dwte (V rows) and dwpe accumulate (+=); the CUDA kernel sizes its sort keys by V
inline void encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C, int V) {
    constexpr int CHUNK = 64;
#pragma omp parallel for
    for (int c0 = 0; c0 < C; c0 += CHUNK) {
        int c1 = c0 + CHUNK < C ? c0 + CHUNK : C;
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                const float* d = dout + ((size_t)b * T + t) * C;
                float* tok = dwte + (size_t)tokens[b * T + t] * C;
                float* pos = dwpe + (size_t)t * C;
                for (int c = c0; c < c1; c++) {
                    tok[c] += d[c];
                    pos[c] += d[c];
                }
            }
    }
}

// ==========================================================================================================
// CUDA. The forward is a gather, memory-bound at 6 bytes per output element; a thread moves 16 bytes.
// The backward must add each position's gradient row into its token's row of dwte. Atomic adds would make the
// sum's order, and so its bits, vary from run to run; instead the positions are stably sorted by token (CUB's
// radix sort is deterministic), so each token's occurrences form a run in position order, and one thread per
// channel pair sums a run in that order and owns the result. A very frequent token makes a long serial run;
// the channel dimension is cut into 64-wide blocks so that such a run is at least spread over C/64 warps.
// C must be a multiple of 8 (and of 2 for the backward).

#include <cub/device/device_radix_sort.cuh>

#include "llmc/cuda_common.cuh"

static __global__ void encoder_forward_kernel(bf16* out, const int* tokens, const bf16* wte, const bf16* wpe, int B,
                                              int T, int C) {
    long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= (long)B * T * C) return;
    long bt = i / C;
    int c = (int)(i % C), t = (int)(bt % T);
    bf16x8 tok = *reinterpret_cast<const bf16x8*>(wte + (long)tokens[bt] * C + c);
    bf16x8 pos = *reinterpret_cast<const bf16x8*>(wpe + (long)t * C + c), o;
    for (int j = 0; j < 4; j++) {
        float2 a = __bfloat1622float2(tok.h[j]), b = __bfloat1622float2(pos.h[j]);
        o.h[j] = __floats2bfloat162_rn(a.x + b.x, a.y + b.y);
    }
    *reinterpret_cast<bf16x8*>(out + i) = o;
}

inline void encoder_forward_cuda(bf16* out, const int* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                                 cudaStream_t stream) {
    encoder_forward_kernel<<<cuda_blocks((long)B * T * C / 8, 256), 256, 0, stream>>>(out, tokens, wte, wpe, B, T, C);
    cuda_check(cudaGetLastError());
}

static __global__ void encoder_iota_kernel(int* positions, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) positions[i] = i;
}

// block (x: a sorted index, y: 64 channels); only the block at the start of a token's run does work
static __global__ void encoder_wte_backward_kernel(bf16* dwte, const bf16* dout, const int* sorted_tokens,
                                                   const int* sorted_positions, int BT, int C) {
    int start = blockIdx.x;
    int token = sorted_tokens[start];
    if (start > 0 && sorted_tokens[start - 1] == token) return;
    int c = 2 * (blockIdx.y * 32 + threadIdx.x);
    if (c >= C) return;
    float s0 = 0.0f, s1 = 0.0f;
    for (int i = start; i < BT && sorted_tokens[i] == token; i++) {
        float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + (long)sorted_positions[i] * C + c));
        s0 += v.x;
        s1 += v.y;
    }
    __nv_bfloat162* w = reinterpret_cast<__nv_bfloat162*>(dwte + (long)token * C + c);
    float2 old = __bfloat1622float2(*w);
    *w = __floats2bfloat162_rn(old.x + s0, old.y + s1);
}

// a thread owns a channel pair of one position and sums over the batch in order
static __global__ void encoder_wpe_backward_kernel(bf16* dwpe, const bf16* dout, int B, int T, int C) {
    long i = 2 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= (long)T * C) return;
    float s0 = 0.0f, s1 = 0.0f;
    for (int b = 0; b < B; b++) {
        float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + (long)b * T * C + i));
        s0 += v.x;
        s1 += v.y;
    }
    __nv_bfloat162* w = reinterpret_cast<__nv_bfloat162*>(dwpe + i);
    float2 old = __bfloat1622float2(*w);
    *w = __floats2bfloat162_rn(old.x + s0, old.y + s1);
}

// the sort's temporary space, after three int arrays of B*T (sorted tokens, positions, sorted positions)
inline size_t encoder_backward_scratch_bytes(int B, int T) {
    int n = B * T;
    size_t cub_bytes = 0;
    cuda_check(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, (const int*)nullptr, (int*)nullptr,
                                               (const int*)nullptr, (int*)nullptr, n));
    return 3 * (size_t)n * sizeof(int) + cub_bytes;
}

// dwte and dwpe accumulate (+=); scratch holds encoder_backward_scratch_bytes(B, T) bytes, 16-byte aligned
inline void encoder_backward_cuda(bf16* dwte, bf16* dwpe, const bf16* dout, const int* tokens, int B, int T, int C,
                                  void* scratch, cudaStream_t stream) {
    int n = B * T;
    int* sorted_tokens = static_cast<int*>(scratch);
    int* positions = sorted_tokens + n;
    int* sorted_positions = positions + n;
    void* cub_space = sorted_positions + n;
    size_t cub_bytes = encoder_backward_scratch_bytes(B, T) - 3 * (size_t)n * sizeof(int);
    encoder_iota_kernel<<<cuda_blocks(n, 256), 256, 0, stream>>>(positions, n);
    cuda_check(cudaGetLastError());
    cuda_check(cub::DeviceRadixSort::SortPairs(cub_space, cub_bytes, tokens, sorted_tokens, positions,
                                               sorted_positions, n, 0, (int)sizeof(int) * 8, stream));
    encoder_wte_backward_kernel<<<dim3(n, cuda_blocks(C, 64)), 32, 0, stream>>>(dwte, dout, sorted_tokens,
                                                                              sorted_positions, n, C);
    cuda_check(cudaGetLastError());
    encoder_wpe_backward_kernel<<<cuda_blocks((long)T * C / 2, 256), 256, 0, stream>>>(dwpe, dout, B, T, C);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points on the GPU: the CPU functions' arguments, bf16 storage, tokens in device memory

#include "llmc/device.cuh"

inline void encoder_forward(bf16* out, const int* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C) {
    encoder_forward_cuda(out, tokens, wte, wpe, B, T, C, main_stream());
}
inline void encoder_backward(bf16* dwte, bf16* dwpe, const bf16* dout, const int* tokens, int B, int T, int C, int V) {
    size_t floats = (encoder_backward_scratch_bytes(B, T) + sizeof(float) - 1) / sizeof(float);
    encoder_backward_cuda(dwte, dwpe, dout, tokens, B, T, C, gpu_scratch(floats, "encoder_backward"), main_stream());
    (void)V;
}
