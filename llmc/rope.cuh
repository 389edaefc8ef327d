// Rotary position embeddings (RoPE) as Llama 3 has them, forward and backward: Llama's attention sees where a
// token is only through these rotations of its query and key heads (GPT-2 adds a learned position embedding
// instead, llmc/encoder.cuh). Pairs are interleaved, as in Meta's reference code and llm.c's Llama 3 work:
// elements (2i, 2i+1) of a head are one complex number, turned by the angle pos·freq[i], i in [0, hd/2),
// freq[i] = 1 / theta^(2i/hd), with Llama 3's stretching of the low frequencies by a factor `scaling` (0: none).
//
// The rotation works in place on the packed qkv activation: N = B·T rows of (NH + 2·KV)·hd values, NH query
// heads, then KV key heads, then KV value heads (grouped-query attention; KV = NH for GPT-2-style attention),
// each head hd contiguous values. The NH + KV query and key heads of a row turn by its token's position; the
// values are never read nor written. Positions come per token of a sequence (T ints, the same for each of the
// B sequences), because under context parallelism a rank holds non-contiguous pieces of the sequence; null
// means 0..T-1. A position must be below the maxT its table was made for.
//
// The angles come from a table of (cos, sin) per position and frequency, made once on the host in fp32 in
// the order of llm.c's PyTorch reference (precompute_freqs_cis, apply_scaling), so that the model and a
// PyTorch run of it rotate by the same fp32 numbers.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "llmc/profile.h"
#include "llmc/utils.h"

// Llama 3's frequency scaling (apply_scaling): wavelengths below 8192/4 tokens keep their frequency, those
// above 8192/1 are stretched `scaling` times (Llama 3.1: 8, Llama 3.2: 32), and those between are blended
constexpr float ROPE_LOW_FREQ_FACTOR = 1.0f, ROPE_HIGH_FREQ_FACTOR = 4.0f;
constexpr float ROPE_OLD_CONTEXT = 8192.0f;

inline void rope_check_head_size(const char* what, int hd) {
    if (hd <= 0 || hd % 2) fail("%s: head size hd = %d must be positive and even (it holds hd/2 pairs)", what, hd);
}

// freq[i] for i in [0, hd/2), rounded op by op in fp32 as PyTorch does it (gcc under -std=c++17 fuses no
// a·b + c, so each line rounds where PyTorch's ops do). Where PyTorch writes `a / tensor` it computes
// reciprocal(tensor) · a (Tensor.__rtruediv__), so wavelen = 2π/freq and 8192/wavelen below are products with
// a reciprocal. pow has no fp32 result every library agrees on: here it is the correctly rounded one (the
// double result rounded once), which PyTorch's pow (within an ulp) returns but for rare near-ties.
inline void rope_frequencies(float* freq, int hd, float theta, float scaling) {
    rope_check_head_size("rope_frequencies", hd);
    const float two_pi = (float)6.283185307179586;  // Python's 2 * math.pi, rounded to fp32 as torch does
    const float low_freq_wavelen = ROPE_OLD_CONTEXT / ROPE_LOW_FREQ_FACTOR;
    const float high_freq_wavelen = ROPE_OLD_CONTEXT / ROPE_HIGH_FREQ_FACTOR;
    for (int i = 0; i < hd / 2; i++) {
        float exponent = (float)(2 * i) / (float)hd;
        float f = 1.0f / (float)pow((double)theta, (double)exponent);
        if (scaling > 0) {
            float wavelen = (1.0f / f) * two_pi;  // below high_freq_wavelen the frequency stays
            if (wavelen > low_freq_wavelen) {
                f = f / scaling;
            } else if (wavelen >= high_freq_wavelen) {
                float smooth = ((1.0f / wavelen) * ROPE_OLD_CONTEXT - ROPE_LOW_FREQ_FACTOR) /
                               (ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR);
                f = (1.0f - smooth) * f / scaling + smooth * f;
            }
        }
        freq[i] = f;
    }
}

// table[(pos·hd/2 + i)·2 + {0, 1}] = (cos, sin) of the angle pos·freq[i] for pos in [0, maxT): the fp32
// product (torch.outer of fp32 positions and frequencies), then cos and sin of that fp32 angle, correctly
// rounded (computed in double and rounded once; torch.polar's cosf and sinf are within an ulp of it). On the
// GPU the model uploads it once.
inline void rope_table(float* table, int maxT, int hd, float theta, float scaling) {
    rope_check_head_size("rope_table", hd);
    const int half = hd / 2;
    std::vector<float> freq(half);
    rope_frequencies(freq.data(), hd, theta, scaling);
#pragma omp parallel for
    for (int pos = 0; pos < maxT; pos++)
        for (int i = 0; i < half; i++) {
            float angle = (float)pos * freq[i];
            float* cs = table + ((long)pos * half + i) * 2;
            cs[0] = (float)cos((double)angle);
            cs[1] = (float)sin((double)angle);
        }
}

inline void rope_check_shape(const char* what, int B, int T, int NH, int KV, int hd) {
    rope_check_head_size(what, hd);
    if (B < 0 || T < 0 || NH <= 0 || KV <= 0)
        fail("%s: B = %d, T = %d, NH = %d, KV = %d: sizes must not be negative, head counts positive", what, B, T,
             NH, KV);
}

// (x0, x1) becomes (x0·cos - x1·sin, x0·sin + x1·cos), the complex product (x0 + i·x1)·e^(i·angle) as
// PyTorch's apply_rotary_emb computes it; `inverse` turns by -angle
inline void rope_rotate(float* qkv, const float* table, const int* positions, int B, int T, int NH, int KV, int hd,
                        bool inverse) {
    const long N = (long)B * T;
    const int row_values = (NH + 2 * KV) * hd, half = hd / 2;
#pragma omp parallel for
    for (long n = 0; n < N; n++) {
        int t = (int)(n % T);
        const float* cs = table + (long)(positions ? positions[t] : t) * hd;
        float* row = qkv + n * row_values;
        for (int h = 0; h < NH + KV; h++) {
            float* x = row + h * hd;
            for (int i = 0; i < half; i++) {
                float c = cs[2 * i], s = inverse ? -cs[2 * i + 1] : cs[2 * i + 1];
                float x0 = x[2 * i], x1 = x[2 * i + 1];
                x[2 * i] = x0 * c - x1 * s;
                x[2 * i + 1] = x0 * s + x1 * c;
            }
        }
    }
}

// qkv's query and key heads turned by their token's position, in place
inline void rope_forward(float* qkv, const float* table, const int* positions, int B, int T, int NH, int KV,
                         int hd) {
    ProfileScope op("rope");
    rope_check_shape("rope_forward", B, T, NH, KV, hd);
    rope_rotate(qkv, table, positions, B, T, NH, KV, hd, false);
}

// in place: a rotation's transpose is its inverse, so dq and dk turn back by the same angles; dv is untouched
// (the values pass the rotation by unchanged, so their gradient does too)
inline void rope_backward(float* dqkv, const float* table, const int* positions, int B, int T, int NH, int KV,
                          int hd) {
    ProfileScope op("rope");
    rope_check_shape("rope_backward", B, T, NH, KV, hd);
    rope_rotate(dqkv, table, positions, B, T, NH, KV, hd, true);
}

// ==========================================================================================================
// CUDA: memory-bound (the q and k parts read and written once, 4 bytes per element, 6 FLOPs per pair), so a
// thread moves 16 bytes per access: 8 values, 4 pairs of one head, with their 4 (cos, sin) from the table in
// two 16-byte loads (the table, maxT·hd floats, sits in L2: every head and sequence reuses a position's row).
// A block takes a row at a time, its threads the row's q and k vectors in order (a warp: 512 contiguous
// bytes); the blocks are one wave of what the GPU holds resident and stride over the rows, so N up to millions
// of rows needs no more blocks than the GPU can run. hd must be a multiple of 8 (a vector never straddles two
// heads, and every row and head starts on a 16-byte boundary) and qkv and table 16-byte aligned: the entry
// points check. bf16 in, fp32 arithmetic, bf16 out (as apply_rotary_emb: .float(), then type_as); the
// values' bytes are never touched.

#include "llmc/cuda_common.cuh"

// a block's threads share a row: GPT-2's 192 q and k vectors and Llama 3 8B's 640 are whole multiples of 64
constexpr int ROPE_THREADS = 64;

template <bool INVERSE>
static __global__ void __launch_bounds__(ROPE_THREADS)
    rope_kernel(bf16* qkv, const float* table, const int* positions, long N, int T, int row_values,
                int rotated_vectors, int head_vectors, int hd) {
    for (long n = blockIdx.x; n < N; n += gridDim.x) {
        int t = (int)(n % T);
        const float* cs = table + (long)(positions ? positions[t] : t) * hd;
        bf16* row = qkv + n * row_values;
        for (int v = threadIdx.x; v < rotated_vectors; v += ROPE_THREADS) {
            bf16x8* p = reinterpret_cast<bf16x8*>(row + 8L * v);
            const float4* pairs = reinterpret_cast<const float4*>(cs + 8 * (v % head_vectors));
            float4 a = pairs[0], b = pairs[1];  // (cos, sin) of the vector's 4 pairs
            float c[4] = {a.x, a.z, b.x, b.z}, s[4] = {a.y, a.w, b.y, b.w};
            float x[8];
            unpack_bf16x8(*p, x);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float sj = INVERSE ? -s[j] : s[j];
                float x0 = x[2 * j], x1 = x[2 * j + 1];
                x[2 * j] = x0 * c[j] - x1 * sj;
                x[2 * j + 1] = x0 * sj + x1 * c[j];
            }
            *p = pack_bf16x8(x);
        }
    }
}

template <bool INVERSE>
inline void rope_launch(const char* what, bf16* qkv, const float* table, const int* positions, int B, int T, int NH,
                        int KV, int hd, cudaStream_t stream) {
    rope_check_shape(what, B, T, NH, KV, hd);
    if (hd % 8) fail("%s: head size hd = %d must be a multiple of 8 (16-byte accesses within a head)", what, hd);
    require_aligned_16(what, qkv);
    require_aligned_16(what, table);
    long N = (long)B * T;
    if (N == 0) return;
    // as many blocks as the GPU keeps resident (2048 threads an SM), and never more than rows
    long blocks = std::min(N, (long)cuda_sm_count() * (2048 / ROPE_THREADS));
    rope_kernel<INVERSE><<<(unsigned int)blocks, ROPE_THREADS, 0, stream>>>(
        qkv, table, positions, N, T, (NH + 2 * KV) * hd, (NH + KV) * hd / 8, hd / 8, hd);
    cuda_check(cudaGetLastError());
}

// table and positions are device pointers, as qkv
inline void rope_forward_cuda(bf16* qkv, const float* table, const int* positions, int B, int T, int NH, int KV,
                              int hd, cudaStream_t stream) {
    rope_launch<false>("rope_forward_cuda", qkv, table, positions, B, T, NH, KV, hd, stream);
}

inline void rope_backward_cuda(bf16* dqkv, const float* table, const int* positions, int B, int T, int NH, int KV,
                               int hd, cudaStream_t stream) {
    rope_launch<true>("rope_backward_cuda", dqkv, table, positions, B, T, NH, KV, hd, stream);
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points on the GPU: the CPU functions' arguments, bf16 storage, table and positions on
// the device

#include "llmc/device.cuh"

inline void rope_forward(bf16* qkv, const float* table, const int* positions, int B, int T, int NH, int KV, int hd) {
    ProfileScope op("rope");
    rope_forward_cuda(qkv, table, positions, B, T, NH, KV, hd, main_stream());
}
inline void rope_backward(bf16* dqkv, const float* table, const int* positions, int B, int T, int NH, int KV,
                          int hd) {
    ProfileScope op("rope");
    rope_backward_cuda(dqkv, table, positions, B, T, NH, KV, hd, main_stream());
}
