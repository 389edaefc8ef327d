// The mixture-of-experts MLP: a router picks K of E experts for every token, each expert is the model's MLP
// (llmc/mlp.cuh: GPT-2's, or Llama's SwiGLU, as Mixtral's and Qwen3-MoE's experts are) of its own hidden units
// over the rows routed to it, and the layer's output is the gate-weighted sum of the K expert outputs, plus, where
// the model has one, a shared expert's output over every row.
//
//   router   logits = ln2(x) · Wrᵀ in fp32 (Wr is E×C, no bias), the scores S = softmax over all E (Mixtral's,
//            Qwen's) or sigmoid of each (DeepSeek-V3's); the K largest logits are chosen (ties go to the lower
//            expert), and their gates are S at those K, renormalized to sum to one (HF's norm_topk_prob: Mixtral's,
//            Qwen3-MoE's, DeepSeek-V3's; under softmax the same as a softmax over the K logits) or as they are,
//            times the routed scaling factor (DeepSeek-V3's 2.5; 1 elsewhere). With a selection bias (DeepSeek-V3's
//            balancing without an auxiliary loss) the K chosen are those of the largest S + b instead, b a vector
//            of the layer's that only chooses: the gates are S's. After each step b_i += γ·sign(mean − load_i),
//            from the loads of the whole global batch (balance), the same on every rank. Dropless by default:
//            every token reaches all K of its experts, so the experts see K·BT rows in all.
//   capacity (--moe-capacity F) an expert takes at most ceil(F·K·T/E) of a sequence's assignments, the first in
//            token and slot order; the others are dropped (their slot adds nothing, their gate gets no gradient).
//            Decided per sequence (under cp over the whole sequence's choices), so every layout drops alike.
//   dispatch the (token, slot) pairs kept are sorted by expert, token and slot ("dispatch order"); under expert
//            parallelism (--ep N, each rank holding E/N experts) the rows travel to the ranks of their experts
//            with an all-to-all-v, the counts exchanged first, and come back the same way.
//   experts  the MLP of llmc/mlp.cuh on each expert's contiguous rows, all of a rank's experts in one grouped
//            GEMM per matmul on the GPU (llmc/experts.cuh).
//   combine  out[t] = Σ_k gate[t,k] · y[t,k], in slot order, so the sum is the same on every layout.
//   shared   DeepSeek's shared expert, an MLP over every row that every rank of an ep group holds whole, is the
//            sum's first term: out[t] = s[t] + Σ_k ...; Qwen2-MoE's is scaled by its gate and added last:
//            out[t] = Σ_k ... + sigmoid(ln2(x)·wgᵀ) · s[t] (wg a C-vector, the gate's logit in fp32 as the router's).
//   aux loss per sequence and layer, α·E·Σ_i f_i·P_i, f_i the share of the sequence's K·T assignments that went
//            to expert i (a constant), P_i the mean over its tokens of the scores normalized to sum to one (the
//            softmax itself; DeepSeek-V3's sequence-wise loss under sigmoid scores).
//            The trainer's objective adds its mean over the global batch's sequences, summed over layers.
//            Or over the batch (Megatron-LM's global aux loss): f is the layer's share over every sequence of the
//            step's micro-batches so far on all dp·cp ranks (the global batch's at the last micro-batch; one
//            all-reduce of E counts per layer and micro-batch), P the mean over the micro-batch's tokens on all of
//            them, and the objective adds the mean over micro-batches. Every sequence then shares f, so the
//            per-sequence sums below serve both: the mean of Σ_i f_i·P_i over the sequences is Σ_i f_i·P_i.
//
// The routing runs where the rows are: the scores, the top-K, the gates, the capacity's drops, the sort into
// dispatch order and the aux loss's statistics are kernels on the GPU and loops over the same bodies on the CPU,
// which are their reference (the GPU's decisions are the CPU's to the bit). Only the counts go to the host, one
// copy per layer, for the all-to-all's sizes and the experts' row ranges; forward keeps the decisions on the
// device (ExpertActivations) and the counts on the host (MoERoute) for backward, whose router gradient is a
// kernel too. Under tensor parallelism each expert, and the shared expert, is
// split as the dense MLP is (fc by rows, fc_proj by columns): every tp rank routes the same whole rows the same
// way, the combined partial outputs are reduced over the group, and fc_proj's bias is added on tp rank 0 alone
// so that the reduction adds it once. Under --fp8 the experts' matmuls are FP8 too (llmc/fp8.cuh), each scaled
// over its expert's rows on the rank, whose count differs between the ranks of a cp group: their scales are
// shared over tp alone, so cp and ep runs with experts agree with one rank to FP8's precision rather than exactly.
// The shared expert sees every row, as a dense MLP does, and shares the dense layers' scales.
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "llmc/comm.cuh"
#include "llmc/cp.cuh"
#include "llmc/device.cuh"
#include "llmc/experts.cuh"
#include "llmc/expert_settings.h"
#include "llmc/ledger.h"
#include "llmc/fp8.cuh"
#include "llmc/matmul.cuh"
#include "llmc/mlp.cuh"
#include "llmc/model_table.h"
#include "llmc/profile.h"
#include "llmc/tp.cuh"

// ----------------------------------------------------------------------------------------------------------
// The layer's data movement: a CPU loop and its CUDA kernel for each, fp32 arithmetic on the storage type

// logits[t, e] = Σ_c x[t, c] · w[e, c]
inline void router_forward(float* logits, const float* x, const float* w, long BT, int C, int E) {
    ProfileScope op("router forward");
#pragma omp parallel for
    for (long t = 0; t < BT; t++)
        for (int e = 0; e < E; e++) {
            float sum = 0.0f;
            for (int c = 0; c < C; c++) sum += x[t * C + c] * w[(long)e * C + c];
            logits[t * E + e] = sum;
        }
}
// one warp per (token, expert), the lanes over the channels
static __global__ void router_forward_kernel(float* logits, const bf16* x, const bf16* w, long BT, int C, int E) {
    long pair = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (pair >= BT * E) return;
    long t = pair / E;
    int e = (int)(pair % E);
    float sum = 0.0f;
    for (int c = lane; c < C; c += 32) sum += __bfloat162float(x[t * C + c]) * __bfloat162float(w[(long)e * C + c]);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) logits[pair] = sum;
}
inline void router_forward(float* logits, const bf16* x, const bf16* w, long BT, int C, int E) {
    ProfileScope op("router forward");
    router_forward_kernel<<<cuda_blocks(BT * E * 32, 256), 256, 0, main_stream()>>>(logits, x, w, BT, C, E);
    cuda_check(cudaGetLastError());
}

// dx[t, c] += Σ_e dlogits[t, e] · w[e, c] (dx may be null); dw[e, c] += Σ_t dlogits[t, e] · x[t, c], summed over
// t in order
inline void router_backward(float* dx, float* dw, const float* dlogits, const float* x, const float* w, long BT, int C,
                            int E) {
    ProfileScope op("router backward");
    if (dx) {
#pragma omp parallel for
        for (long t = 0; t < BT; t++)
            for (int e = 0; e < E; e++)
                for (int c = 0; c < C; c++) dx[t * C + c] += dlogits[t * E + e] * w[(long)e * C + c];
    }
#pragma omp parallel for
    for (long ec = 0; ec < (long)E * C; ec++) {
        long e = ec / C, c = ec % C;
        float sum = 0.0f;
        for (long t = 0; t < BT; t++) sum += dlogits[t * E + e] * x[t * C + c];
        dw[ec] += sum;
    }
}
static __global__ void router_dinp_kernel(bf16* dx, const float* dlogits, const bf16* w, long BT, int C, int E) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < BT * C; i += (long)gridDim.x * blockDim.x) {
        long t = i / C, c = i % C;
        float sum = __bfloat162float(dx[i]);
        for (int e = 0; e < E; e++) sum += dlogits[t * E + e] * __bfloat162float(w[(long)e * C + c]);
        dx[i] = __float2bfloat16(sum);
    }
}
// a block per (expert, 32 channels): 8 rows of threads stride over the tokens, then their sums add in row order
static __global__ void router_dweight_kernel(bf16* dw, const float* dlogits, const bf16* x, long BT, int C, int E) {
    __shared__ float partial[8][32];
    int e = blockIdx.y, c = blockIdx.x * 32 + threadIdx.x;
    float sum = 0.0f;
    if (c < C)
        for (long t = threadIdx.y; t < BT; t += 8) sum += dlogits[t * E + e] * __bfloat162float(x[t * C + c]);
    partial[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y != 0 || c >= C) return;
    for (int r = 1; r < 8; r++) sum += partial[r][threadIdx.x];
    dw[(long)e * C + c] = __float2bfloat16(__bfloat162float(dw[(long)e * C + c]) + sum);
}
inline void router_backward(bf16* dx, bf16* dw, const float* dlogits, const bf16* x, const bf16* w, long BT, int C,
                            int E) {
    ProfileScope op("router backward");
    if (dx) launch_elementwise(router_dinp_kernel, BT * C, dx, dlogits, w, BT, C, E);
    router_dweight_kernel<<<dim3(cuda_blocks(C, 32), E), dim3(32, 8), 0, main_stream()>>>(dw, dlogits, x, BT, C, E);
    cuda_check(cudaGetLastError());
}

// out[t] = Σ_k weight[t, k] · rows[row_of[t, k]] for BT tokens of K slots, in slot order (weight null: 1), the
// slots dropped at capacity (row -1) left out; with accumulate the sum starts from out[t]
inline void moe_combine(float* out, const float* rows, const int* row_of, const float* weight, long BT, int K, int C,
                        bool accumulate = false) {
    ProfileScope op("experts combine");
#pragma omp parallel for
    for (long t = 0; t < BT; t++)
        for (int c = 0; c < C; c++) {
            float sum = accumulate ? out[t * C + c] : 0.0f;
            for (int k = 0; k < K; k++)
                if (row_of[t * K + k] >= 0) sum += (weight ? weight[t * K + k] : 1.0f) * rows[(long)row_of[t * K + k] * C + c];
            out[t * C + c] = sum;
        }
}
static __global__ void moe_combine_kernel(bf16* out, const bf16* rows, const int* row_of, const float* weight, long BT,
                                          int K, int C, bool accumulate) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < BT * C; i += (long)gridDim.x * blockDim.x) {
        long t = i / C, c = i % C;
        float sum = accumulate ? __bfloat162float(out[i]) : 0.0f;
        for (int k = 0; k < K; k++)
            if (row_of[t * K + k] >= 0)
                sum += (weight ? weight[t * K + k] : 1.0f) * __bfloat162float(rows[(long)row_of[t * K + k] * C + c]);
        out[i] = __float2bfloat16(sum);
    }
}
inline void moe_combine(bf16* out, const bf16* rows, const int* row_of, const float* weight, long BT, int K, int C,
                        bool accumulate = false) {
    ProfileScope op("experts combine");
    launch_elementwise(moe_combine_kernel, BT * C, out, rows, row_of, weight, BT, K, C, accumulate);
}

// the combine's backward to the rows: rows[row_of[t, k]] = weight[t, k] · dout[t] (row_of null: row t·K + k; a
// dropped slot has none)
inline void moe_spread(float* rows, const float* dout, const int* row_of, const float* weight, long BT, int K, int C) {
    ProfileScope op("experts combine");
#pragma omp parallel for
    for (long tk = 0; tk < BT * K; tk++) {
        long row = row_of ? row_of[tk] : tk;
        if (row >= 0)
            for (int c = 0; c < C; c++) rows[row * C + c] = weight[tk] * dout[tk / K * C + c];
    }
}
static __global__ void moe_spread_kernel(bf16* rows, const bf16* dout, const int* row_of, const float* weight, long BT,
                                         int K, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < BT * K * C; i += (long)gridDim.x * blockDim.x) {
        long tk = i / C, c = i % C, row = row_of ? row_of[tk] : tk;
        if (row >= 0) rows[row * C + c] = __float2bfloat16(weight[tk] * __bfloat162float(dout[tk / K * C + c]));
    }
}
inline void moe_spread(bf16* rows, const bf16* dout, const int* row_of, const float* weight, long BT, int K, int C) {
    ProfileScope op("experts combine");
    launch_elementwise(moe_spread_kernel, BT * K * C, rows, dout, row_of, weight, BT, K, C);
}

// ... and to the gates: dgate[t, k] = dout[t] · rows[row_of[t, k]] (row_of null: row t·K + k; 0 for a dropped slot,
// whose gate the output does not see)
inline void moe_gate_grads(float* dgate, const float* dout, const float* rows, const int* row_of, long BT, int K, int C) {
    ProfileScope op("experts combine");
#pragma omp parallel for
    for (long tk = 0; tk < BT * K; tk++) {
        long row = row_of ? row_of[tk] : tk;
        float sum = 0.0f;
        for (int c = 0; c < C && row >= 0; c++) sum += dout[tk / K * C + c] * rows[row * C + c];
        dgate[tk] = sum;
    }
}
static __global__ void moe_gate_grads_kernel(float* dgate, const bf16* dout, const bf16* rows, const int* row_of, long BT,
                                             int K, int C) {
    long tk = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (tk >= BT * K) return;
    float sum = 0.0f;
    long row = row_of ? row_of[tk] : tk;
    for (int c = lane; c < C && row >= 0; c += 32) sum += __bfloat162float(dout[tk / K * C + c]) * __bfloat162float(rows[row * C + c]);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) dgate[tk] = sum;
}
inline void moe_gate_grads(float* dgate, const bf16* dout, const bf16* rows, const int* row_of, long BT, int K, int C) {
    ProfileScope op("experts combine");
    moe_gate_grads_kernel<<<cuda_blocks(BT * K * 32, 256), 256, 0, main_stream()>>>(dgate, dout, rows, row_of, BT, K, C);
    cuda_check(cudaGetLastError());
}

// out[t] += scale[t] · rows[t] for BT rows of C (the shared expert's output added under its gate)
inline void add_scaled_rows(float* out, const float* rows, const float* scale, long BT, int C) {
    ProfileScope op("experts combine");
#pragma omp parallel for
    for (long i = 0; i < BT * C; i++) out[i] += scale[i / C] * rows[i];
}
static __global__ void add_scaled_rows_kernel(bf16* out, const bf16* rows, const float* scale, long BT, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < BT * C; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(__bfloat162float(out[i]) + scale[i / C] * __bfloat162float(rows[i]));
}
inline void add_scaled_rows(bf16* out, const bf16* rows, const float* scale, long BT, int C) {
    ProfileScope op("experts combine");
    launch_elementwise(add_scaled_rows_kernel, BT * C, out, rows, scale, BT, C);
}

// A sparse layer's tensors (its parameters, or their gradients): the router's E×C weight, each tensor of the MLP
// with the rank's experts stacked, the shared expert's (fcw null: none) and its gate's C-vector (null: none)
template <typename floatX>
struct ExpertTensors {
    floatX* router;
    MlpTensorViews<floatX> experts, shared;
    floatX* shared_gate;
};
// What a sparse layer keeps for backward: the routing (the router's logits, BT·E; each slot's expert, gate and
// row in dispatch order, -1 where dropped, BT·K; each sequence's f of the aux loss, B·E; a gated shared expert's
// scales, BT), the rows the experts took (expert-major), their hidden layer before and after the activation, the
// rows they gave back (dispatch order); the shared expert's hidden layer and, where a gate scales it, its output;
// and under a split backward (the zero-bubble pipeline's) the experts' and the shared expert's output gradients,
// for the weight-gradient step (null otherwise)
template <typename floatX>
struct ExpertActivations {
    float *logits, *gate, *freq, *shared_scale;
    int *expert, *row_of;
    floatX *inputs, *fch, *act, *outputs;
    floatX *shared_fch, *shared_act, *shared_out;
    floatX *kept_dout, *kept_dfch, *kept_shared_dout, *kept_shared_dfch;
};

// ----------------------------------------------------------------------------------------------------------
// Routing: the decisions for one layer and one micro-batch, made where the rows are. Each step is a CPU loop and
// a kernel over one body (__host__ __device__), chosen by the model's storage type, so the GPU's choices are the
// CPU's bit for bit: the scores' exponentials are taken in double and rounded once to float, on which the host's
// and the device's exp agree (each within an ulp of double: they round apart only within 2⁻²⁹ of a float's
// rounding boundary), and the sorts are integer counts. The decisions stay on the device, kept per layer for
// backward (ExpertActivations); the host gets the counts alone, one copy per layer, which the all-to-all needs.

// How a router turns logits into gates (GPTConfig's): the score function, the K gates renormalized to sum to
// one, and the factor that scales them
struct Routing {
    bool sigmoid = false, normalize = true;
    float scale = 1.0f;
};

__host__ __device__ inline float route_exp(float x) { return (float)exp((double)x); }

// One token's scores from its E logits l: P (the scores normalized to sum to one: the softmax, or the sigmoids s
// over their sum), s itself under sigmoid scoring (s null otherwise)
__host__ __device__ inline void token_scores(float* p, float* s, const float* l, int E, bool sigmoid) {
    float total = 0.0f;
    if (sigmoid) {
        for (int e = 0; e < E; e++) total += s[e] = 1.0f / (1.0f + route_exp(-l[e]));
        for (int e = 0; e < E; e++) p[e] = s[e] / total;
        return;
    }
    float top = l[0];
    for (int e = 1; e < E; e++) top = l[e] > top ? l[e] : top;
    for (int e = 0; e < E; e++) total += p[e] = route_exp(l[e] - top);
    for (int e = 0; e < E; e++) p[e] /= total;
}

// ... its K experts, largest logit first (or largest score plus bias, bias an E-vector or null; a strict
// comparison keeps the lower expert on a tie), and their gates: the chosen scores, renormalized or not, scaled
__host__ __device__ inline void token_route(int* expert, float* gate, float* p, float* s, const float* l,
                                            const float* bias, int E, int K, Routing how) {
    token_scores(p, s, l, E, how.sigmoid);
    const float* score = how.sigmoid ? s : p;
    for (int k = 0; k < K; k++) {
        int best = -1;
        float best_key = 0.0f;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int j = 0; j < k; j++) taken |= expert[j] == e;
            float key = bias ? score[e] + bias[e] : l[e];
            if (!taken && (best < 0 || key > best_key)) best = e, best_key = key;
        }
        expert[k] = best;
    }
    float chosen_total = 0.0f;
    for (int k = 0; k < K; k++) chosen_total += gate[k] = score[expert[k]];
    for (int k = 0; k < K; k++) gate[k] = (how.normalize ? gate[k] / chosen_total : gate[k]) * how.scale;
}
static __global__ void route_tokens_kernel(int* expert, float* gate, float* probs, float* scores, const float* logits,
                                           const float* bias, long BT, int E, int K, Routing how) {
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < BT)
        token_route(expert + t * K, gate + t * K, probs + t * E, scores ? scores + t * E : nullptr, logits + t * E, bias, E,
                    K, how);
}
// BT tokens: expert and gate (BT·K), probs (BT·E: P) and, under sigmoid scoring, scores (BT·E: s; else null)
template <typename floatX>
inline void route_tokens(int* expert, float* gate, float* probs, float* scores, const float* logits, const float* bias,
                         long BT, int E, int K, const Routing& how) {
    ProfileScope op("routing");
    if constexpr (device_of<floatX> == Device::CPU) {
#pragma omp parallel for
        for (long t = 0; t < BT; t++)
            token_route(expert + t * K, gate + t * K, probs + t * E, scores ? scores + t * E : nullptr, logits + t * E, bias,
                        E, K, how);
    } else {
        route_tokens_kernel<<<cuda_blocks(BT, 128), 128, 0, main_stream()>>>(expert, gate, probs, scores, logits, bias, BT, E,
                                                                            K, how);
        cuda_check(cudaGetLastError());
    }
}

// The aux loss's statistics of the B sequences of Tl tokens: sums[b·E + e] the assignments of sequence b that
// chose e, sums[(B + b)·E + e] their P summed. The CPU adds in token order; the GPU's warp per (b, e) adds its
// lanes' strided partial sums, so the sums of P differ in the last bits (the counts, whole numbers, do not).
static __global__ void route_statistics_kernel(float* sums, const int* expert, const float* probs, int B, long Tl, int E,
                                               int K) {
    long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (warp >= (long)B * E) return;
    int b = (int)(warp / E), e = (int)(warp % E);
    float n = 0.0f, p = 0.0f;
    for (long t = b * Tl + lane; t < (b + 1) * Tl; t += 32) {
        for (int k = 0; k < K; k++) n += expert[t * K + k] == e ? 1.0f : 0.0f;
        p += probs[t * E + e];
    }
    for (int o = 16; o > 0; o /= 2) n += __shfl_xor_sync(0xffffffff, n, o), p += __shfl_xor_sync(0xffffffff, p, o);
    if (lane == 0) sums[warp] = n, sums[(long)B * E + warp] = p;
}
template <typename floatX>
inline void route_statistics(float* sums, const int* expert, const float* probs, int B, long Tl, int E, int K) {
    ProfileScope op("routing");
    if constexpr (device_of<floatX> == Device::CPU) {
        std::fill(sums, sums + 2 * (size_t)B * E, 0.0f);
        for (long t = 0; t < (long)B * Tl; t++) {
            long b = t / Tl;
            for (int k = 0; k < K; k++) sums[b * E + expert[t * K + k]] += 1.0f;
            for (int e = 0; e < E; e++) sums[((long)B + b) * E + e] += probs[t * E + e];
        }
    } else {
        route_statistics_kernel<<<cuda_blocks((long)B * E * 32, 256), 256, 0, main_stream()>>>(sums, expert, probs, B, Tl,
                                                                                               E, K);
        cuda_check(cudaGetLastError());
    }
}

// Stable counting sorts of assignments by expert, for the capacity (each expert's rank among a sequence's
// assignments) and the dispatch order (each kept assignment's row: by expert, then token, then slot). The CPU
// walks the assignments in order. The GPU splits each segment (a sequence, or the whole micro-batch) into chunks
// of ROUTE_CHUNK: a warp per (chunk, expert) counts the chunk's assignments of its expert, one block turns the
// counts into each (chunk, expert)'s first rank, and a warp per (chunk, expert) walks the chunk again, ranking
// its expert's assignments in order with a ballot.
constexpr int ROUTE_CHUNK = 1024;
inline long route_chunks(long assignments, int segments) {
    return segments * ((assignments / segments + ROUTE_CHUNK - 1) / ROUTE_CHUNK);
}
// the GPU's scratch (ints) for sorting n assignments in `segments` segments among E experts
inline size_t route_sort_ints(long n, int segments, int E) { return 2 * (size_t)E * route_chunks(n, segments); }

struct ChunkRange {
    long from, to;
};
__device__ inline ChunkRange route_chunk(long chunk, long segment) {
    long per = (segment + ROUTE_CHUNK - 1) / ROUTE_CHUNK, seg = chunk / per;
    long from = seg * segment + chunk % per * ROUTE_CHUNK;
    return {from, from + ROUTE_CHUNK < (seg + 1) * segment ? from + ROUTE_CHUNK : (seg + 1) * segment};
}
// counts[chunk·E + e]: the chunk's assignments of e (those keep marks, keep null: all)
static __global__ void count_assignments_kernel(int* counts, const int* choices, const int* keep, long segment, long chunks,
                                                int E) {
    long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (warp >= chunks * E) return;
    int e = (int)(warp % E);
    ChunkRange c = route_chunk(warp / E, segment);
    int n = 0;
    for (long i = c.from + lane; i < c.to; i += 32) n += choices[i] == e && (!keep || keep[i]);
    for (int o = 16; o > 0; o /= 2) n += __shfl_xor_sync(0xffffffff, n, o);
    if (lane == 0) counts[warp] = n;
}
// first[chunk·E + e]: the assignments of e before the chunk in its segment; over one segment (totals non-null)
// also after all those of the experts before e, whose counts go to totals
static __global__ void first_ranks_kernel(int* first, int* totals, const int* counts, long chunks, int segments, int E) {
    long per = chunks / segments;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        for (int s = 0; s < segments; s++) {
            int running = 0;
            for (long c = s * per; c < (s + 1) * per; c++) first[c * E + e] = running, running += counts[c * E + e];
            if (totals) totals[e] = running;
        }
    if (!totals) return;
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int before = 0;
        for (int j = 0; j < e; j++) before += totals[j];
        for (long c = 0; c < chunks; c++) first[c * E + e] += before;
    }
}
// each of the chunk's assignments of e in order, ranked from first: with keep_out, kept when its rank is under
// cap; with row_of, its row (the rank; -1 where keep says dropped) and that row's token
static __global__ void rank_assignments_kernel(int* keep_out, int* row_of, int* token_of_row, const int* choices,
                                               const int* keep, const int* first, long segment, long chunks, int E,
                                               int K, long cap) {
    long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (warp >= chunks * E) return;
    int e = (int)(warp % E), rank = first[warp];
    ChunkRange c = route_chunk(warp / E, segment);
    for (long at = c.from; at < c.to; at += 32) {
        long i = at + lane;
        bool mine = i < c.to && choices[i] == e, counted = mine && (!keep || keep[i]);
        unsigned ballot = __ballot_sync(0xffffffff, counted);
        int r = rank + __popc(ballot & ((1u << lane) - 1));
        if (mine && keep_out) keep_out[i] = r < cap;
        if (mine && row_of) {
            row_of[i] = counted ? r : -1;
            if (counted) token_of_row[r] = (int)(i / K);
        }
        rank += __popc(ballot);
    }
}
static void rank_on_gpu(int* keep_out, int* row_of, int* token_of_row, int* totals, const int* choices, const int* keep,
                        long n, int segments, int E, int K, long cap, int* scratch) {
    long chunks = route_chunks(n, segments), warps = chunks * E;
    int *counts = scratch, *first = scratch + chunks * E;
    count_assignments_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, main_stream()>>>(counts, choices, keep, n / segments,
                                                                                     chunks, E);
    first_ranks_kernel<<<1, 256, 0, main_stream()>>>(first, totals, counts, chunks, segments, E);
    rank_assignments_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, main_stream()>>>(
        keep_out, row_of, token_of_row, choices, keep, first, n / segments, chunks, E, K, cap);
    cuda_check(cudaGetLastError());
}

// Which assignments of B whole sequences (choices: each one's T positions in order, K experts each) their
// experts take under a capacity of `cap` per expert and sequence: in token order, then slot order, an expert takes
// the first cap it was chosen for (GShard's and Switch Transformer's rule) and the rest are dropped (keep 0).
// Decided per sequence, so that every layout drops the same ones.
template <typename floatX>
inline void within_capacity(int* keep, const int* choices, int B, long T, int K, int E, long cap, int* scratch) {
    ProfileScope op("routing");
    if constexpr (device_of<floatX> == Device::CPU) {
        std::vector<long> taken(E);
        for (int b = 0; b < B; b++) {
            std::fill(taken.begin(), taken.end(), 0);
            for (long tk = (long)b * T * K; tk < (long)(b + 1) * T * K; tk++) keep[tk] = taken[choices[tk]]++ < cap;
        }
    } else {
        rank_on_gpu(keep, nullptr, nullptr, nullptr, choices, nullptr, (long)B * T * K, B, E, K, cap, scratch);
    }
}

// The dispatch order of the assignments kept (keep: one per (t, k), or null: all): by expert, then token, then
// slot; row_of[t·K + k] its row (-1: dropped), token_of_row each row's token, counts[e] the rows of expert e
template <typename floatX>
inline void dispatch_order(int* row_of, int* token_of_row, int* counts, const int* expert, const int* keep, long BT, int E,
                           int K, int* scratch) {
    ProfileScope op("routing");
    if constexpr (device_of<floatX> == Device::CPU) {
        std::fill(counts, counts + E, 0);
        for (long tk = 0; tk < BT * K; tk++)
            if (!keep || keep[tk]) counts[expert[tk]]++;
        std::vector<int> next(E, 0);
        for (int e = 1; e < E; e++) next[e] = next[e - 1] + counts[e - 1];
        for (long tk = 0; tk < BT * K; tk++) {
            bool kept = !keep || keep[tk];
            row_of[tk] = kept ? next[expert[tk]]++ : -1;
            if (kept) token_of_row[row_of[tk]] = (int)(tk / K);
        }
    } else {
        rank_on_gpu(nullptr, row_of, token_of_row, counts, expert, keep, BT * K, 1, E, K, 0, scratch);
    }
}

// n rows of K ints: dst[i] = src[index[i]] (gather), or dst[index[i]] = src[i] (scatter); element i of the n·K
__host__ __device__ inline void move_int(int* dst, const int* src, const int* index, long i, int K, bool scatter) {
    long row = i / K, k = i % K;
    if (scatter) dst[(long)index[row] * K + k] = src[i];
    else dst[i] = src[(long)index[row] * K + k];
}
static __global__ void move_int_rows_kernel(int* dst, const int* src, const int* index, long n, int K, bool scatter) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n * K; i += (long)gridDim.x * blockDim.x)
        move_int(dst, src, index, i, K, scatter);
}
template <typename floatX>
inline void move_int_rows(int* dst, const int* src, const int* index, long n, int K, bool scatter) {
    if constexpr (device_of<floatX> == Device::CPU) {
        for (long i = 0; i < n * K; i++) move_int(dst, src, index, i, K, scatter);
    } else {
        launch_elementwise(move_int_rows_kernel, n * K, dst, src, index, n, K, scatter);
    }
}

// Under expert parallelism the rows a rank's experts take arrive source-major (rank s's rows for its expert x,
// in s's dispatch order) and the experts take them expert-major (within an expert by source). blocks[j], j =
// s·X + x, is where block j starts in the arrival order, blocks[n + j] where among the experts' rows, blocks[2n +
// j] its rows. permuted_row gives, for a row of one order, the row of the other that holds the same token.
__host__ __device__ inline int permuted_row(long row, const int* blocks, int n, bool expert_row) {
    const int *from = blocks + (expert_row ? n : 0), *to = blocks + (expert_row ? 0 : n), *rows = blocks + 2 * n;
    for (int j = 0; j < n; j++)
        if (row >= from[j] && row < from[j] + rows[j]) return to[j] + (int)(row - from[j]);
    return -1;
}
static __global__ void permutation_kernel(int* index, const int* blocks, int n, long rows, bool expert_row) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += (long)gridDim.x * blockDim.x)
        index[i] = permuted_row(i, blocks, n, expert_row);
}
// index[i] for each of `rows` rows: with expert_row, the arrival row of expert row i; else the expert row of
// arrival row i
template <typename floatX>
inline void permutation(int* index, const int* blocks, int n, long rows, bool expert_row) {
    if constexpr (device_of<floatX> == Device::CPU) {
        for (long i = 0; i < rows; i++) index[i] = permuted_row(i, blocks, n, expert_row);
    } else {
        launch_elementwise(permutation_kernel, rows, index, blocks, n, rows, expert_row);
    }
}

// Backward to the router: one token's logit gradients dl (E) from its gates' gradients dg (K) and the aux loss.
// The gates' part goes to the chosen scores (g_k = c·v_k / V under renormalization, v the chosen scores, V their
// sum, c the scale: dv_k = (c·dg_k - Σ_j g_j·dg_j) / V; else c·dg_k), the aux loss's to P (α·E·f_i per sequence,
// each sequence weighing dloss·T in the objective: dloss·α·E·f_i per token), then through the score function.
// p and s: scratch rows (E) for the token's P and s.
__host__ __device__ inline void token_router_grad(float* dl, float* p, float* s, const float* l, const int* expert,
                                                  const float* g, const float* dg, const float* f, int E, int K,
                                                  Routing how, float alpha, float dloss) {
    token_scores(p, s, l, E, how.sigmoid);
    const float* score = how.sigmoid ? s : p;
    // dl holds dP under softmax, ds under sigmoid (whose dP is the aux part alone: recomputed below)
    for (int e = 0; e < E; e++) dl[e] = how.sigmoid ? 0.0f : alpha * E * f[e] * dloss;
    float gdg = 0.0f, chosen_total = 0.0f;
    for (int k = 0; k < K; k++) gdg += g[k] * dg[k], chosen_total += score[expert[k]];
    for (int k = 0; k < K; k++)
        dl[expert[k]] += how.normalize ? (how.scale * dg[k] - gdg) / chosen_total : how.scale * dg[k];
    float pdp = 0.0f;
    for (int e = 0; e < E; e++) pdp += p[e] * (how.sigmoid ? alpha * E * f[e] * dloss : dl[e]);
    if (!how.sigmoid) {  // through the softmax
        for (int e = 0; e < E; e++) dl[e] = p[e] * (dl[e] - pdp);
        return;
    }
    // through P = s / Σs, then the sigmoid
    float total = 0.0f;
    for (int e = 0; e < E; e++) total += s[e];
    for (int e = 0; e < E; e++) dl[e] = (dl[e] + (alpha * E * f[e] * dloss - pdp) / total) * s[e] * (1.0f - s[e]);
}
static __global__ void router_grads_kernel(float* dlogits, float* probs, float* scores, const float* logits,
                                           const int* expert, const float* gate, const float* dgate, const float* freq,
                                           long BT, long Tl, int E, int K, Routing how, float alpha, float dloss) {
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < BT)
        token_router_grad(dlogits + t * E, probs + t * E, scores ? scores + t * E : nullptr, logits + t * E, expert + t * K,
                          gate + t * K, dgate + t * K, freq + t / Tl * E, E, K, how, alpha, dloss);
}
// BT tokens of B sequences of Tl (freq: f, B·E); probs and scores: scratch as route_tokens'
template <typename floatX>
inline void router_grads(float* dlogits, float* probs, float* scores, const float* logits, const int* expert,
                         const float* gate, const float* dgate, const float* freq, long BT, long Tl, int E, int K,
                         const Routing& how, float alpha, float dloss) {
    if constexpr (device_of<floatX> == Device::CPU) {
#pragma omp parallel for
        for (long t = 0; t < BT; t++)
            token_router_grad(dlogits + t * E, probs + t * E, scores ? scores + t * E : nullptr, logits + t * E,
                              expert + t * K, gate + t * K, dgate + t * K, freq + t / Tl * E, E, K, how, alpha, dloss);
    } else {
        router_grads_kernel<<<cuda_blocks(BT, 128), 128, 0, main_stream()>>>(dlogits, probs, scores, logits, expert, gate,
                                                                            dgate, freq, BT, Tl, E, K, how, alpha, dloss);
        cuda_check(cudaGetLastError());
    }
}

// A gated shared expert's gate: forward scale = sigmoid(logit); backward the logit's gradient from the output's
// dot (d, in place): d·s·(1 - s)
__host__ __device__ inline float shared_gate_value(float logit, float scale, float d, bool backward) {
    return backward ? d * scale * (1.0f - scale) : 1.0f / (1.0f + route_exp(-logit));
}
static __global__ void shared_gate_kernel(float* out, const float* logits, const float* scales, long BT, bool backward) {
    for (long t = (long)blockIdx.x * blockDim.x + threadIdx.x; t < BT; t += (long)gridDim.x * blockDim.x)
        out[t] = shared_gate_value(logits[t], backward ? scales[t] : 0.0f, backward ? out[t] : 0.0f, backward);
}
// forward: out = the scales from logits; backward: out (the dots) becomes the logits' gradient, scales forward's
template <typename floatX>
inline void shared_gate(float* out, const float* logits, const float* scales, long BT, bool backward) {
    if constexpr (device_of<floatX> == Device::CPU) {
        for (long t = 0; t < BT; t++)
            out[t] = shared_gate_value(logits[t], backward ? scales[t] : 0.0f, backward ? out[t] : 0.0f, backward);
    } else {
        launch_elementwise(shared_gate_kernel, BT, out, logits, scales, BT, backward);
    }
}

// What the host keeps of one layer's routing of a micro-batch, for its forward's exchanges and its backward:
// counts only (the decisions themselves stay on the device, ExpertActivations)
struct MoERoute {
    std::vector<int> send_counts;   // E: rows to each expert, in dispatch order (rank j's experts: j·X .. j·X+X-1)
    long dispatched = 0;            // the rows that go to experts: K·BT less the drops
    std::vector<int> recv_counts;   // ep·X: rows from each rank of the ep group, per local expert
    std::vector<int> expert_first;  // X + 1: where each local expert's rows start in expert-major order
    std::vector<int> blocks;        // 3·ep·X: the permutation between the arrival and the experts' orders (ep > 1)
    long rows = 0;                  // rows on this rank's experts
};

// ----------------------------------------------------------------------------------------------------------

template <typename floatX>
struct MixtureOfExperts {
    int E = 1, K = 1, X = 1;  // experts, chosen per token, held by this rank
    Routing routing;          // the score function, the gates' normalization and scale
    // each model layer's selection bias (L·E, or empty: none), the same on every rank, and how fast it moves (γ)
    std::vector<float> bias;
    ExpertSettings settings;  // the aux loss's weight and scope, the bias's rate
    float capacity = 0.0f;    // F: an expert takes at most ceil(F·K·T/E) of a sequence's assignments (0: all)
    Comm* ep = nullptr;       // the expert-parallel group; null for a single rank
    Comm* batch = nullptr;    // the dp·cp group, whose tokens make the batch of the batch scope; null for one rank
    int ep_size = 1, ep_rank = 0;
    // scratch shared by the layers: rows in dispatch order and on the experts' side (and under ep as they
    // arrive); the routing's fp32 and int32 buffers (buffers())
    floatX *dispatch = nullptr, *received = nullptr, *expert_rows = nullptr;
    float *probs = nullptr, *scores = nullptr, *dlogits = nullptr, *dgates = nullptr, *shared_logits = nullptr,
          *layer_bias = nullptr;
    int *token_of_row = nullptr, *permutation_index = nullptr, *blocks = nullptr, *report = nullptr, *sort = nullptr,
        *keep = nullptr, *gathered = nullptr, *ordered = nullptr, *kept_whole = nullptr, *whole_of = nullptr;
    std::vector<int> host_report;
    bool whole_of_ready = false;  // the cp layout's index, uploaded once
    AsyncUploads<floatX> uploads;
    // what the step's forward passes saw, for the log: Σ over sequences and layers of the aux loss, and the
    // assignments per (model layer, expert)
    double aux_sum = 0.0;
    std::vector<double> load;
    long dropped = 0;  // ... and the assignments dropped at capacity (counted on tp rank 0)
    // under the batch scope: each layer's assignments per expert over the step's micro-batches so far, summed over
    // the batch group (L·E)
    std::vector<double> batch_load;
    // ... and what crossed ranks: the rows sent to other ranks' experts and received from other ranks, and the
    // count exchanges (one per layer and micro-batch), from which llmc/plan.h's ep_bytes_sent counts the bytes
    long rows_crossing = 0, count_exchanges = 0;

    bool on() const { return E > 1; }
    void reset_statistics() {
        aux_sum = 0.0;
        std::fill(load.begin(), load.end(), 0.0);
        std::fill(batch_load.begin(), batch_load.end(), 0.0);
        dropped = rows_crossing = count_exchanges = 0;
    }

    // The buffers the layers share, for B sequences of BT/B tokens a micro-batch on this rank, `rows` the most its
    // experts may receive (LocalDims::expert_rows), cp the context-parallel group's size: the list the allocation
    // walks and --plan reads (none without experts). The rows in dispatch order, on the experts' side and, under
    // ep, as they arrive; then the routing's scratch, fp32 or int32 words each (those of no words are left out).
    // fp32: the scores (P; s under sigmoid scoring), the logits' and the gates' gradients, a gated shared
    // expert's logits, the layer's selection bias. int32: each row's token, the permutation of the experts' rows
    // and its blocks (under ep), the counts and statistics the host reads (E counts, then 2·B·E statistics as
    // fp32), the sorts' scratch; under a capacity the kept flags, and under cp the whole sequences' choices
    // gathered, in position order and decided, and the layout's index into them. Reads ep_size and capacity.
    BufferList buffers(const GPTConfig& c, int B, long BT, long rows, int cp) {
        E = c.num_experts, K = c.top_k, X = E / ep_size;
        if (!on()) return {};
        size_t C = c.channels, n = (size_t)BT * K, whole = (size_t)cp * n;
        bool capped = capacity > 0.0f, gathers = capped && cp > 1, across = ep_size > 1;
        size_t sorting = std::max(route_sort_ints(n, 1, E), capped ? route_sort_ints(whole, B, E) : 0);
        BufferList list = {planned("moe dispatch", MEM_SCRATCH, dispatch, n * C)};
        if (across) list.push_back(planned("moe received", MEM_SCRATCH, received, (size_t)rows * C));
        list.push_back(planned("moe expert_rows", MEM_SCRATCH, expert_rows, (size_t)rows * C));
        for (const PlannedBuffer& b :
             {planned("moe probs", MEM_SCRATCH, probs, BT * E), planned("moe scores", MEM_SCRATCH, scores, c.sigmoid_scores ? BT * E : 0),
              planned("moe dlogits", MEM_SCRATCH, dlogits, BT * E), planned("moe dgates", MEM_SCRATCH, dgates, n),
              planned("moe shared_logits", MEM_SCRATCH, shared_logits, c.shared_gate ? BT : 0),
              planned("moe layer_bias", MEM_SCRATCH, layer_bias, c.router_bias ? E : 0),
              planned("moe token_of_row", MEM_SCRATCH, token_of_row, n),
              planned("moe permutation_index", MEM_SCRATCH, permutation_index, across ? rows : 0),
              planned("moe blocks", MEM_SCRATCH, blocks, across ? 3 * E : 0),
              planned("moe report", MEM_SCRATCH, report, E + 2 * (size_t)B * E), planned("moe sort", MEM_SCRATCH, sort, sorting),
              planned("moe keep", MEM_SCRATCH, keep, capped ? n : 0), planned("moe gathered", MEM_SCRATCH, gathered, gathers ? whole : 0),
              planned("moe ordered", MEM_SCRATCH, ordered, gathers ? whole : 0),
              planned("moe kept_whole", MEM_SCRATCH, kept_whole, gathers ? whole : 0),
              planned("moe whole_of", MEM_SCRATCH, whole_of, gathers ? (size_t)cp * BT : 0)})
            if (b.bytes) list.push_back(b);
        return list;
    }

    // what the routing keeps on the host: the routing's form, the selection bias and the statistics' counters
    void prepare(const GPTConfig& c) {
        routing = {c.sigmoid_scores, c.norm_topk, c.routed_scale};
        size_t per_layer = (size_t)c.num_layers * c.num_experts;
        bias.assign(c.router_bias ? per_layer : 0, 0.0f);
        load.assign(per_layer, 0.0);
        batch_load.assign(per_layer, 0.0);
    }

    // rows between dispatch order (here) and the ranks of their experts (source-major there), either way
    void exchange(const floatX* from, floatX* to, const MoERoute& r, bool to_experts, int C) {
        std::vector<size_t> out(ep_size, 0), in(ep_size, 0), out_at(ep_size, 0), in_at(ep_size, 0);
        for (int j = 0; j < ep_size; j++)
            for (int x = 0; x < X; x++) out[j] += (size_t)r.send_counts[j * X + x] * C, in[j] += (size_t)r.recv_counts[j * X + x] * C;
        for (int j = 1; j < ep_size; j++) out_at[j] = out_at[j - 1] + out[j - 1], in_at[j] = in_at[j - 1] + in[j - 1];
        if (to_experts) ep->wait(ep->all_to_allv(from, out.data(), out_at.data(), to, in.data(), in_at.data(), dtype_of<floatX>()));
        else ep->wait(ep->all_to_allv(from, in.data(), in_at.data(), to, out.data(), out_at.data(), dtype_of<floatX>()));
    }
    // ... and on this rank between their arrival order and the experts' (to_experts: into the experts' order)
    void reorder(floatX* to, const floatX* from, const MoERoute& r, bool to_experts, int C) {
        uploads.upload(blocks, r.blocks.data(), r.blocks.size());
        permutation<floatX>(permutation_index, blocks, ep_size * X, r.rows, to_experts);
        gather_rows(to, from, permutation_index, r.rows, C);
    }

    // The layer's routing, on the device: the router's logits, each token's experts and gates, the drops at
    // capacity, the dispatch order and the aux loss's statistics; then the counts to the host (the layer's one
    // wait for the device), the statistics summed over cp, each sequence's f kept (a.freq), and the exchange of
    // the counts over the ep group
    void route(MoERoute& r, const ExpertActivations<floatX>& a, const floatX* ln2, const floatX* router, int B, int Tl,
               int C, TensorParallel& tp, ContextParallel<floatX>& cp, int layer) {
        long BT = (long)B * Tl;
        router_forward(a.logits, ln2, router, BT, C, E);
        if (!bias.empty()) uploads.upload(layer_bias, &bias[(size_t)layer * E], E);
        route_tokens<floatX>(a.expert, a.gate, probs, scores, a.logits, bias.empty() ? nullptr : layer_bias, BT, E, K,
                             routing);
        const int* kept = capacity > 0.0f ? decide_capacity(a.expert, cp, B, Tl) : nullptr;
        dispatch_order<floatX>(a.row_of, token_of_row, report, a.expert, kept, BT, E, K, sort);
        route_statistics<floatX>(reinterpret_cast<float*>(report + E), a.expert, probs, B, Tl, E, K);
        host_report.resize(E + 2 * (size_t)B * E);
        device_download<floatX>(host_report.data(), report, host_report.size());
        r.send_counts.assign(host_report.begin(), host_report.begin() + E);
        r.dispatched = std::accumulate(r.send_counts.begin(), r.send_counts.end(), 0L);
        std::vector<float> sums(2 * (size_t)B * E);
        memcpy(sums.data(), host_report.data() + E, sums.size() * sizeof(float));
        std::vector<double> chosen(E, 0.0);  // this rank's assignments per expert, before any drops
        for (size_t i = 0; i < (size_t)B * E; i++) chosen[i % E] += sums[i];
        aux_statistics(a.freq, sums, chosen, cp, B, Tl, layer);
        if (tp.spec.rank == 0) {
            for (int e = 0; e < E; e++) load[(size_t)layer * E + e] += chosen[e];
            dropped += BT * K - r.dispatched;
        }
        plan_receive(r);
    }

    // Forward of one sparse layer's MLP. ln2: the norm's output, every row (BT×C); out: this rank's rows of the
    // MLP's output (R×C), with `partial` BT×C scratch under sequence parallelism; w: the layer's parameters; a: what
    // the layer keeps (the routing; inputs: rows×C, fch: rows×FC, act: rows×H; outputs K·BT×C, dispatch order; the
    // shared expert's on BT rows). B sequences of Tl tokens each on this rank; `experts` and `shared` the MLPs'
    // shapes on this rank; layer is the layer's index in the model (for the load); fp8 the experts' FP8 state,
    // fp8_shared the shared expert's.
    void forward(floatX* out, floatX* partial, MoERoute& r, const ExpertActivations<floatX>& a, const floatX* ln2,
                 const ExpertTensors<floatX>& w, int B, int Tl, const MlpShape& experts, const MlpShape& shared,
                 TensorParallel& tp, ContextParallel<floatX>& cp, int layer, Workspace ws, const Fp8Scaling<floatX>* fp8,
                 const Fp8Scaling<floatX>* fp8_shared) {
        long BT = (long)B * Tl;
        int C = experts.C;
        route(r, a, ln2, w.router, B, Tl, C, tp, cp, layer);

        // the rows to the experts, the experts, the rows back
        gather_rows(ep_size > 1 ? dispatch : a.inputs, ln2, token_of_row, r.dispatched, C);
        if (ep_size > 1) {
            exchange(dispatch, received, r, true, C);
            reorder(a.inputs, received, r, true, C);
        }
        floatX* expert_out = ep_size > 1 ? expert_rows : a.outputs;
        experts_forward(expert_out, a.fch, a.act, a.inputs, on_first_tp_rank(w.experts, tp), r.expert_first, experts, ws,
                        fp8);
        if (ep_size > 1) {
            reorder(received, expert_rows, r, false, C);
            exchange(received, a.outputs, r, false, C);
        }
        floatX* whole = tp.spec.sp ? partial : out;
        bool has_shared = w.shared.fcw != nullptr, gated = w.shared_gate != nullptr;
        if (has_shared)  // the sum's first term, or (gated) its own buffer
            mlp_forward(gated ? a.shared_out : whole, a.shared_fch, a.shared_act, ln2, on_first_tp_rank(w.shared, tp), BT,
                        shared, ws, fp8_shared);
        moe_combine(whole, a.outputs, a.row_of, a.gate, BT, K, C, has_shared && !gated);
        if (gated) {
            router_forward(shared_logits, ln2, w.shared_gate, BT, C, 1);
            shared_gate<floatX>(a.shared_scale, shared_logits, nullptr, BT, false);
            add_scaled_rows(whole, a.shared_out, a.shared_scale, BT, C);
        }
        tp.reduce_rows(whole, out, BT, C);
    }

    // Backward of the layer: dln (BT×C) is overwritten with the gradient of ln2's output (this rank's partial
    // sum under tp), dw accumulates the layer's gradients (the MLPs' entries null under a split backward, which
    // keeps their output gradients in a.kept_*: weight_grads takes them). dout: the gradient of the MLP's output
    // for every row; dfch (rows×FC) and dact (rows×H, SwiGLU's) scratch; dloss: each token's weight in the
    // objective (the aux loss's gradient is that of its per-sequence mean, scaled alike); recompute: the MLPs'
    // activations are computed again from their inputs (-r 1).
    void backward(floatX* dln, const ExpertTensors<floatX>& dw, const floatX* dout, floatX* dfch, floatX* dact,
                  const MoERoute& r, const ExpertActivations<floatX>& a, const floatX* ln2, const ExpertTensors<floatX>& w,
                  int B, int Tl, const MlpShape& experts, const MlpShape& shared, TensorParallel& tp, float dloss,
                  bool recompute, Workspace ws, const Fp8Scaling<floatX>* fp8, const Fp8Scaling<floatX>* fp8_shared) {
        long BT = (long)B * Tl;
        int C = experts.C;
        bool split = a.kept_dout != nullptr, has_shared = w.shared.fcw != nullptr, gated = w.shared_gate != nullptr;
        // the shared expert first: its input gradient starts dln, to which the experts' combine adds
        if (has_shared) {
            const floatX* sdout = dout;
            if (gated) {
                // the gate's logit: dl = s·(1 - s) · dout·out, the dot summed over the tp ranks' partial outputs
                moe_gate_grads(shared_logits, dout, a.shared_out, (const int*)nullptr, BT, 1, C);
                tp.sum_floats_in_rank_order<floatX>(shared_logits, BT);
                shared_gate<floatX>(shared_logits, nullptr, a.shared_scale, BT, true);
                // the output's gradient, scaled (dispatch's rows are free until the experts' backward)
                floatX* scaled = split ? a.kept_shared_dout : dispatch;
                moe_spread(scaled, dout, (const int*)nullptr, a.shared_scale, BT, 1, C);
                sdout = scaled;
            } else if (split) {
                device_copy<floatX>(a.kept_shared_dout, dout, BT * C);
            }
            if (recompute) mlp_activation_again(a.shared_act, a.shared_fch, BT, shared);
            mlp_backward(dln, dw.shared, sdout, split ? a.kept_shared_dfch : dfch, dact, a.shared_fch, a.shared_act, ln2,
                         w.shared, BT, shared, ws, fp8_shared);
        }

        // the gates: dgate = dout · y, summed over the tp ranks' partial outputs
        moe_gate_grads(dgates, dout, a.outputs, a.row_of, BT, K, C);
        tp.sum_floats_in_rank_order<floatX>(dgates, BT * K);

        // the rows: to the experts, through them, back
        floatX* drows = ep_size > 1 ? dispatch : expert_rows;
        moe_spread(drows, dout, a.row_of, a.gate, BT, K, C);
        floatX* dexpert = drows;  // the experts' output gradients, expert-major
        if (ep_size > 1) {
            exchange(dispatch, received, r, true, C);
            reorder(expert_rows, received, r, true, C);
            dexpert = expert_rows;
        }
        if (split) device_copy<floatX>(a.kept_dout, dexpert, r.rows * C);
        if (recompute) mlp_activation_again(a.act, a.fch, r.rows, experts);
        // dexpert turns into the experts' input gradients, once they have read it
        experts_backward(dexpert, dw.experts, dexpert, split ? a.kept_dfch : dfch, dact, a.fch, a.act, a.inputs, w.experts,
                         r.expert_first, experts, ws, fp8);
        const floatX* dinputs = dexpert;  // dispatch order, once back
        if (ep_size > 1) {
            reorder(received, expert_rows, r, false, C);
            exchange(received, dispatch, r, false, C);
            dinputs = dispatch;
        }
        moe_combine(dln, dinputs, a.row_of, (const float*)nullptr, BT, K, C, has_shared);

        // the router: its logits' gradients from the gates' and the aux loss (token_router_grad)
        router_grads<floatX>(dlogits, probs, scores, a.logits, a.expert, a.gate, dgates, a.freq, BT, Tl, E, K, routing,
                             settings.aux_weight, dloss);
        // every tp rank holds the same router gradient; its part of dln is added once, before the tp reduction
        router_backward(tp.spec.rank == 0 ? dln : nullptr, dw.router, dlogits, ln2, w.router, BT, C, E);
        if (gated)  // ... and so the shared expert's gate's
            router_backward(tp.spec.rank == 0 ? dln : nullptr, dw.shared_gate, shared_logits, ln2, w.shared_gate, BT, C,
                            1);
    }

    // Which of this rank's B sequences of Tl tokens' assignments the capacity keeps (within_capacity), as flags
    // in `keep`: under cp each sequence's choices are gathered from the group and put in position order, so that
    // every rank decides over the whole sequence as one rank would, and takes its own positions' flags back
    const int* decide_capacity(const int* expert, ContextParallel<floatX>& cp, int B, int Tl) {
        int N = cp.spec.size;
        long T = (long)Tl * N, cap = expert_capacity(capacity, K, E, T), BTl = (long)B * Tl;
        if (!cp.on()) {
            within_capacity<floatX>(keep, expert, B, T, K, E, cap, sort);
            return keep;
        }
        if (!whole_of_ready) {  // where rank s's row (b, t) sits among the whole sequences: the same every layer
            std::vector<int> index((size_t)N * BTl);
            int n = cp.layout.chunk_tokens();
            for (int s = 0; s < N; s++)
                for (int b = 0; b < B; b++)
                    for (int t = 0; t < Tl; t++)
                        index[((size_t)s * B + b) * Tl + t] = (int)((long)b * T + (long)cp.layout.chunk_of(s, t / n) * n + t % n);
            device_upload<floatX>(whole_of, index.data(), index.size());
            whole_of_ready = true;
        }
        cp.comm->wait(cp.comm->all_gather(expert, gathered, BTl * K, DType::I32));
        move_int_rows<floatX>(ordered, gathered, whole_of, N * BTl, K, true);
        within_capacity<floatX>(kept_whole, ordered, B, T, K, E, cap, sort);
        move_int_rows<floatX>(keep, kept_whole, whole_of + (long)cp.spec.rank * BTl, BTl, K, false);
        return keep;
    }

    // The aux loss's statistics from each sequence's sums (route_statistics: B·E counts, then B·E sums of P; this
    // rank's tokens), which under cp are a sequence's partial sums and are summed over the group: each
    // sequence's f, kept in freq for backward, and the loss's value added to aux_sum. Under the batch scope every
    // sequence's f is the layer's share of the step's assignments so far, this micro-batch's (chosen: this rank's
    // per expert) summed over the batch group.
    void aux_statistics(float* freq, std::vector<float>& sums, const std::vector<double>& chosen,
                        ContextParallel<floatX>& cp, int B, int Tl, int layer) {
        if (cp.on()) cp.comm->wait(cp.comm->all_reduce(sums.data(), sums.data(), sums.size(), DType::F32));
        const float* prob_sums = sums.data() + (size_t)B * E;
        std::vector<float> f((size_t)B * E);
        if (settings.aux_scope == AuxScope::Sequence) {
            float T = (float)Tl * cp.spec.size;
            for (size_t i = 0; i < f.size(); i++) f[i] = sums[i] / (T * K);
        } else {
            std::vector<double> counts = chosen;
            if (batch) batch->wait(batch->all_reduce(counts.data(), counts.data(), E, DType::F64));
            double* so_far = &batch_load[(size_t)layer * E];
            double total = 0.0;
            for (int e = 0; e < E; e++) so_far[e] += counts[e], total += so_far[e];
            for (size_t i = 0; i < f.size(); i++) f[i] = (float)(so_far[i % E] / total);
        }
        uploads.upload(freq, f.data(), f.size());
        if (cp.spec.rank == 0)  // the statistics are whole sequences', the same on every cp rank: count them once
            for (int b = 0; b < B; b++) {
                double sum = 0.0;
                for (int e = 0; e < E; e++) sum += (double)f[(size_t)b * E + e] * prob_sums[(size_t)b * E + e];
                aux_sum += settings.aux_weight * E * sum / ((double)Tl * cp.spec.size);
            }
    }

    // The counts of rows each rank of the ep group sends to this one's experts, and the order in which the
    // experts take them: expert-major, and within an expert by source rank, then the source's dispatch order
    // (the blocks permuted_row reads)
    void plan_receive(MoERoute& r) {
        r.recv_counts.assign((size_t)ep_size * X, 0);
        if (ep_size > 1) ep->wait(ep->all_to_all(r.send_counts.data(), r.recv_counts.data(), X, DType::I32));
        else r.recv_counts = r.send_counts;
        if (ep_size > 1) {
            count_exchanges++;
            for (int j = 0; j < ep_size; j++)
                for (int x = 0; x < X && j != ep_rank; x++) rows_crossing += r.send_counts[j * X + x] + r.recv_counts[j * X + x];
        }
        r.expert_first.assign(X + 1, 0);
        for (int x = 0; x < X; x++) {
            r.expert_first[x + 1] = r.expert_first[x];
            for (int s = 0; s < ep_size; s++) r.expert_first[x + 1] += r.recv_counts[s * X + x];
        }
        r.rows = r.expert_first[X];
        if (ep_size == 1) return;
        int n = ep_size * X;
        r.blocks.assign(3 * (size_t)n, 0);
        std::vector<int> next(r.expert_first.begin(), r.expert_first.end() - 1);
        for (int j = 0, arrival = 0; j < n; j++) {
            int x = j % X;
            r.blocks[j] = arrival, r.blocks[n + j] = next[x], r.blocks[2 * n + j] = r.recv_counts[j];
            arrival += r.recv_counts[j], next[x] += r.recv_counts[j];
        }
    }

    // The MLPs' weight gradients a split backward left, from the output gradients it kept
    void weight_grads(const ExpertTensors<floatX>& dw, const MoERoute& r, const ExpertActivations<floatX>& a,
                      const floatX* ln2, const ExpertTensors<floatX>& w, long BT, const MlpShape& experts,
                      const MlpShape& shared, bool recompute, Workspace ws, const Fp8Scaling<floatX>* fp8,
                      const Fp8Scaling<floatX>* fp8_shared) {
        if (w.shared.fcw) {
            if (recompute) mlp_activation_again(a.shared_act, a.shared_fch, BT, shared);
            mlp_weight_grads(dw.shared, a.kept_shared_dout, a.kept_shared_dfch, a.shared_act, ln2, w.shared, BT, shared,
                             ws, fp8_shared);
        }
        if (recompute) mlp_activation_again(a.act, a.fch, r.rows, experts);
        experts_weight_grads(dw.experts, a.kept_dout, a.kept_dfch, a.act, a.inputs, w.experts, r.expert_first, experts, ws,
                             fp8);
    }

    // After a step, each sparse layer's selection bias toward balanced loads: b_i += γ·sign(mean − load_i), load:
    // the step's assignments per (model layer, expert) over the whole global batch
    void balance(const std::vector<double>& global_load) {
        for (size_t l = 0; l < bias.size() / E; l++) {
            const double* n = &global_load[l * E];
            double mean = std::accumulate(n, n + E, 0.0) / E;
            if (mean == 0) continue;  // a layer no token reached (a dense one)
            for (int e = 0; e < E; e++) bias[l * E + e] += settings.bias_rate * (float)((n[e] < mean) - (n[e] > mean));
        }
    }

   private:
    // an MLP's tensors with fc_proj's bias on tp rank 0 alone, so that the reduction over the group adds it once
    static MlpTensorViews<floatX> on_first_tp_rank(MlpTensorViews<floatX> w, const TensorParallel& tp) {
        if (tp.spec.rank != 0) w.fcprojb = nullptr;
        return w;
    }
};
