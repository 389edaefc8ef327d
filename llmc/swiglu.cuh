// SwiGLU, Llama 3's MLP activation, forward and backward: the MLP's first matmul writes 2H values per row,
// [up = c_fc·x (H values) | gate = c_fc2·x (H values)], and the activation is out = silu(gate) · up, with
// silu(x) = x·sigmoid(x) (llm.c's llama3 branch: c_proj(F.silu(c_fc2(x)) * c_fc(x)); Hugging Face's
// down_proj(act(gate_proj(x)) * up_proj(x))). Under tensor parallelism a rank holds H/tp of each half, laid out
// the same way, so these functions serve it unchanged with its own H. The pair shares one layer so that one
// matmul produces both halves and one pass over memory consumes them.
#pragma once

#include <cmath>
#include <cstdint>

#include "llmc/profile.h"
#include "llmc/utils.h"

// Each output reads inputs that other outputs' writes would land on (rows of H and of 2H do not line up), so
// no output may overlap an input: checked, here and on the GPU, rather than left to a race.
inline void swiglu_require_disjoint(const char* what, const void* out, size_t out_bytes, const void* in,
                                    size_t in_bytes) {
    uintptr_t o = (uintptr_t)out, i = (uintptr_t)in;
    if (o < i + in_bytes && i < o + out_bytes) fail("%s: the output overlaps an input", what);
}

// out (N × H) = silu(gate) · up, where inp (N × 2H) holds [up | gate] per row
inline void swiglu_forward(float* out, const float* inp, long N, int H) {
    ProfileScope op("swiglu forward");
    swiglu_require_disjoint("swiglu_forward", out, N * H * sizeof(float), inp, 2 * N * H * sizeof(float));
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* up = inp + n * 2 * H;
        const float* gate = up + H;
        for (int j = 0; j < H; j++) {
            float sigmoid = 1.0f / (1.0f + expf(-gate[j]));
            out[n * H + j] = gate[j] * sigmoid * up[j];
        }
    }
}

// dinp (N × 2H) = [dout · silu(gate) | dout · up · silu'(gate)], overwritten, with
// silu'(x) = sigmoid(x) · (1 + x · (1 - sigmoid(x))); dinp may alias neither inp nor dout
inline void swiglu_backward(float* dinp, const float* inp, const float* dout, long N, int H) {
    ProfileScope op("swiglu backward");
    swiglu_require_disjoint("swiglu_backward inp", dinp, 2 * N * H * sizeof(float), inp, 2 * N * H * sizeof(float));
    swiglu_require_disjoint("swiglu_backward dout", dinp, 2 * N * H * sizeof(float), dout, N * H * sizeof(float));
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        const float* up = inp + n * 2 * H;
        const float* gate = up + H;
        float* dup = dinp + n * 2 * H;
        float* dgate = dup + H;
        for (int j = 0; j < H; j++) {
            float x = gate[j], d = dout[n * H + j];
            float sigmoid = 1.0f / (1.0f + expf(-x));
            dup[j] = d * x * sigmoid;
            dgate[j] = d * up[j] * sigmoid * (1.0f + x * (1.0f - sigmoid));
        }
    }
}

// ==========================================================================================================
// CUDA: elementwise and memory-bound (6 bytes moved per output forward, 10 backward, a few dozen FLOPs), so a
// thread moves 8 outputs, 16 bytes per access. That needs H to be a multiple of 8, so that a row's gate half
// starts 16-byte aligned and no group of 8 straddles two rows (checked; Llama's H is a multiple of 1024, and
// of 1024/tp under tensor parallelism), and 16-byte aligned pointers (checked), which every activation in the
// model is. Indices are long: N·2H passes 2^31 on Llama 3 8B's shape at B·T = 75k tokens. One thread per 8
// outputs fits the grid's 2^31 - 1 blocks of 256 threads up to N·H = 2^42 outputs, far beyond any GPU's memory.

#include "llmc/cuda_common.cuh"

static __device__ __forceinline__ float swiglu_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// 16 bytes through int4, as classifier.cuh does: a bf16x8 copied from memory compiles to four 4-byte accesses
// (nvcc 13 copies its __nv_bfloat162 members one by one), an int4 to one 16-byte access (ld/st.global.v4.u32)
static __device__ __forceinline__ void swiglu_load8(const bf16* p, float f[8]) {
    int4 raw = *reinterpret_cast<const int4*>(p);
    unpack_bf16x8(*reinterpret_cast<const bf16x8*>(&raw), f);
}

static __device__ __forceinline__ void swiglu_store8(bf16* p, const float f[8]) {
    bf16x8 v = pack_bf16x8(f);
    *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&v);
}

static __global__ void swiglu_forward_kernel(bf16* out, const bf16* inp, long N, int H) {
    long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x);  // the first of this thread's 8 outputs
    if (i >= N * H) return;
    long n = i / H, j = i - n * H;
    const bf16* up_row = inp + n * 2 * H;
    float up[8], gate[8], y[8];
    swiglu_load8(up_row + j, up);
    swiglu_load8(up_row + H + j, gate);
    for (int k = 0; k < 8; k++) y[k] = gate[k] * swiglu_sigmoid(gate[k]) * up[k];
    swiglu_store8(out + i, y);
}

static __global__ void swiglu_backward_kernel(bf16* dinp, const bf16* inp, const bf16* dout, long N, int H) {
    long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= N * H) return;
    long n = i / H, j = i - n * H;
    const bf16* up_row = inp + n * 2 * H;
    bf16* dup_row = dinp + n * 2 * H;
    float up[8], gate[8], d[8], dup[8], dgate[8];
    swiglu_load8(up_row + j, up);
    swiglu_load8(up_row + H + j, gate);
    swiglu_load8(dout + i, d);
    for (int k = 0; k < 8; k++) {
        float s = swiglu_sigmoid(gate[k]);
        dup[k] = d[k] * gate[k] * s;
        dgate[k] = d[k] * up[k] * s * (1.0f + gate[k] * (1.0f - s));
    }
    swiglu_store8(dup_row + j, dup);
    swiglu_store8(dup_row + H + j, dgate);
}

inline void swiglu_require_shape(const char* what, int H) {
    if (H <= 0 || H % 8) fail("%s: H = %d must be a positive multiple of 8 (8 bf16 values per access)", what, H);
}

inline void swiglu_forward_cuda(bf16* out, const bf16* inp, long N, int H, cudaStream_t stream) {
    swiglu_require_shape("swiglu_forward_cuda", H);
    require_aligned_16("swiglu_forward_cuda out", out);
    require_aligned_16("swiglu_forward_cuda inp", inp);
    swiglu_require_disjoint("swiglu_forward_cuda", out, N * H * sizeof(bf16), inp, 2 * N * H * sizeof(bf16));
    if (N == 0) return;
    swiglu_forward_kernel<<<cuda_blocks(N * H / 8, 256), 256, 0, stream>>>(out, inp, N, H);
    cuda_check(cudaGetLastError());
}

// dinp = [dout · silu(gate) | dout · up · silu'(gate)], overwritten; dinp may alias neither inp nor dout
inline void swiglu_backward_cuda(bf16* dinp, const bf16* inp, const bf16* dout, long N, int H, cudaStream_t stream) {
    swiglu_require_shape("swiglu_backward_cuda", H);
    require_aligned_16("swiglu_backward_cuda dinp", dinp);
    require_aligned_16("swiglu_backward_cuda inp", inp);
    require_aligned_16("swiglu_backward_cuda dout", dout);
    swiglu_require_disjoint("swiglu_backward_cuda inp", dinp, 2 * N * H * sizeof(bf16), inp,
                            2 * N * H * sizeof(bf16));
    swiglu_require_disjoint("swiglu_backward_cuda dout", dinp, 2 * N * H * sizeof(bf16), dout, N * H * sizeof(bf16));
    if (N == 0) return;
    swiglu_backward_kernel<<<cuda_blocks(N * H / 8, 256), 256, 0, stream>>>(dinp, inp, dout, N, H);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points on the GPU: the CPU functions' arguments, bf16 storage

#include "llmc/device.cuh"

inline void swiglu_forward(bf16* out, const bf16* inp, long N, int H) {
    ProfileScope op("swiglu forward");
    swiglu_forward_cuda(out, inp, N, H, main_stream());
}
inline void swiglu_backward(bf16* dinp, const bf16* inp, const bf16* dout, long N, int H) {
    ProfileScope op("swiglu backward");
    swiglu_backward_cuda(dinp, inp, dout, N, H, main_stream());
}
