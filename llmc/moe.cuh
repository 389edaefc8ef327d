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
//   experts  the MLP of llmc/mlp.cuh on each expert's contiguous rows.
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
// The routing decisions are small (K numbers per token) and made on the host, from the logits the router
// kernel leaves in fp32, by the same code for both devices; the rows themselves move with kernels. Forward
// keeps the decisions (MoERoute) for backward. Under tensor parallelism each expert, and the shared expert, is
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
#include "llmc/ledger.h"
#include "llmc/fp8.cuh"
#include "llmc/matmul.cuh"
#include "llmc/mlp.cuh"
#include "llmc/model_table.h"
#include "llmc/tp.cuh"

// ----------------------------------------------------------------------------------------------------------
// The layer's data movement: a CPU loop and its CUDA kernel for each, fp32 arithmetic on the storage type

// logits[t, e] = Σ_c x[t, c] · w[e, c]
inline void router_forward(float* logits, const float* x, const float* w, long BT, int C, int E) {
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
    router_forward_kernel<<<cuda_blocks(BT * E * 32, 256), 256, 0, main_stream()>>>(logits, x, w, BT, C, E);
    cuda_check(cudaGetLastError());
}

// dx[t, c] += Σ_e dlogits[t, e] · w[e, c] (dx may be null); dw[e, c] += Σ_t dlogits[t, e] · x[t, c], summed over
// t in order
inline void router_backward(float* dx, float* dw, const float* dlogits, const float* x, const float* w, long BT, int C,
                            int E) {
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
    if (dx) launch_elementwise(router_dinp_kernel, BT * C, dx, dlogits, w, BT, C, E);
    router_dweight_kernel<<<dim3(cuda_blocks(C, 32), E), dim3(32, 8), 0, main_stream()>>>(dw, dlogits, x, BT, C, E);
    cuda_check(cudaGetLastError());
}

// dst[i, :] = src[index[i], :] for n rows of C
inline void gather_rows(float* dst, const float* src, const int* index, long n, int C) {
#pragma omp parallel for
    for (long i = 0; i < n; i++) memcpy(dst + i * C, src + (long)index[i] * C, C * sizeof(float));
}
static __global__ void gather_rows_kernel(bf16* dst, const bf16* src, const int* index, long n, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n * C; i += (long)gridDim.x * blockDim.x)
        dst[i] = src[(long)index[i / C] * C + i % C];
}
inline void gather_rows(bf16* dst, const bf16* src, const int* index, long n, int C) {
    launch_elementwise(gather_rows_kernel, n * C, dst, src, index, n, C);
}

// out[t] = Σ_k weight[t, k] · rows[row_of[t, k]] for BT tokens of K slots, in slot order (weight null: 1), the
// slots dropped at capacity (row -1) left out; with accumulate the sum starts from out[t]
inline void moe_combine(float* out, const float* rows, const int* row_of, const float* weight, long BT, int K, int C,
                        bool accumulate = false) {
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
    launch_elementwise(moe_combine_kernel, BT * C, out, rows, row_of, weight, BT, K, C, accumulate);
}

// the combine's backward to the rows: rows[row_of[t, k]] = weight[t, k] · dout[t] (row_of null: row t·K + k; a
// dropped slot has none)
inline void moe_spread(float* rows, const float* dout, const int* row_of, const float* weight, long BT, int K, int C) {
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
    launch_elementwise(moe_spread_kernel, BT * K * C, rows, dout, row_of, weight, BT, K, C);
}

// ... and to the gates: dgate[t, k] = dout[t] · rows[row_of[t, k]] (row_of null: row t·K + k; 0 for a dropped slot,
// whose gate the output does not see)
inline void moe_gate_grads(float* dgate, const float* dout, const float* rows, const int* row_of, long BT, int K, int C) {
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
    moe_gate_grads_kernel<<<cuda_blocks(BT * K * 32, 256), 256, 0, main_stream()>>>(dgate, dout, rows, row_of, BT, K, C);
    cuda_check(cudaGetLastError());
}

// out[t] += scale[t] · rows[t] for BT rows of C (the shared expert's output added under its gate)
inline void add_scaled_rows(float* out, const float* rows, const float* scale, long BT, int C) {
#pragma omp parallel for
    for (long i = 0; i < BT * C; i++) out[i] += scale[i / C] * rows[i];
}
static __global__ void add_scaled_rows_kernel(bf16* out, const bf16* rows, const float* scale, long BT, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < BT * C; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(__bfloat162float(out[i]) + scale[i / C] * __bfloat162float(rows[i]));
}
inline void add_scaled_rows(bf16* out, const bf16* rows, const float* scale, long BT, int C) {
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
// What a sparse layer keeps for backward: the rows the experts took (expert-major), their hidden layer before and
// after the activation, the rows they gave back (dispatch order); the shared expert's hidden layer and, where a
// gate scales it, its output; and under a split backward (the zero-bubble pipeline's) the experts' and the shared
// expert's output gradients, for the weight-gradient step (null otherwise)
template <typename floatX>
struct ExpertActivations {
    floatX *inputs, *fch, *act, *outputs;
    floatX *shared_fch, *shared_act, *shared_out;
    floatX *kept_dout, *kept_dfch, *kept_shared_dout, *kept_shared_dfch;
};

// ----------------------------------------------------------------------------------------------------------
// Routing: the decisions for one layer and one micro-batch, on the host

struct MoERoute {
    std::vector<int> expert;        // BT·K: each token's experts, largest logit first
    std::vector<float> gate;        // BT·K
    std::vector<float> probs;       // BT·E: the scores normalized to sum to one (the aux loss's P)
    std::vector<float> scores;      // BT·E: the sigmoid scores (sigmoid scoring)
    std::vector<float> freq;        // B·E: f_i of each sequence (of the whole sequence under cp)
    std::vector<int> chosen;        // E: the assignments each expert was chosen for, before any capacity drops
    std::vector<int> row_of;        // BT·K: where (t, k)'s row is in dispatch order (-1: dropped at capacity)
    std::vector<int> token_of_row;  // the token of each row in dispatch order (dispatched of them)
    long dispatched = 0;            // the rows that go to experts: K·BT less the drops
    std::vector<int> send_counts;   // E: rows to each expert, in dispatch order (rank j's experts: j·X .. j·X+X-1)
    std::vector<int> recv_counts;   // ep·X: rows from each rank of the ep group, per local expert
    std::vector<int> expert_first;  // X + 1: where each local expert's rows start in expert-major order
    std::vector<int> recv_of_expert_row, expert_row_of_recv;  // the permutation between the two orders (ep > 1)
    long rows = 0;                  // rows on this rank's experts
    std::vector<float> shared_scale;  // BT: the shared expert's gate, sigmoid of its logit (a gated one)
};

// How a router turns logits into gates (GPTConfig's): the score function, the K gates renormalized to sum to
// one, and the factor that scales them
struct Routing {
    bool sigmoid = false, normalize = true;
    float scale = 1.0f;
};

// The dispatch order of the assignments kept (keep: one per (t, k), or null: all): by expert, then token, then
// slot (a counting sort that keeps the (t, k) order); a dropped one's row is -1
inline void dispatch_order(MoERoute& r, long BT, int E, int K, const char* keep = nullptr) {
    r.send_counts.assign(E, 0);
    for (long tk = 0; tk < BT * K; tk++)
        if (!keep || keep[tk]) r.send_counts[r.expert[tk]]++;
    std::vector<int> next(E, 0);
    for (int e = 1; e < E; e++) next[e] = next[e - 1] + r.send_counts[e - 1];
    r.dispatched = next[E - 1] + r.send_counts[E - 1];
    r.row_of.resize(BT * K), r.token_of_row.resize(r.dispatched);
    for (long tk = 0; tk < BT * K; tk++) {
        if (keep && !keep[tk]) {
            r.row_of[tk] = -1;
            continue;
        }
        int row = next[r.expert[tk]]++;
        r.row_of[tk] = row;
        r.token_of_row[row] = (int)(tk / K);
    }
}

// The top-K experts and gates of each of BT tokens and the normalized scores (dispatch_order then sorts the
// assignments kept); bias (E, or null): added to the scores to choose
inline void route_tokens(MoERoute& r, const float* logits, long BT, int E, int K, const Routing& how,
                         const float* bias = nullptr) {
    r.expert.resize(BT * K), r.gate.resize(BT * K), r.probs.resize(BT * E);
    r.scores.resize(how.sigmoid ? BT * E : 0);
    r.chosen.assign(E, 0);
    for (long t = 0; t < BT; t++) {
        const float* l = logits + t * E;
        float* p = &r.probs[t * E];
        if (how.sigmoid) {
            float* s = &r.scores[t * E];
            float total = 0.0f;
            for (int e = 0; e < E; e++) total += s[e] = 1.0f / (1.0f + expf(-l[e]));
            for (int e = 0; e < E; e++) p[e] = s[e] / total;
        } else {
            float top = *std::max_element(l, l + E), total = 0.0f;
            for (int e = 0; e < E; e++) total += p[e] = expf(l[e] - top);
            for (int e = 0; e < E; e++) p[e] /= total;
        }
        const float* score = how.sigmoid ? &r.scores[t * E] : p;
        // the K largest logits in turn (or scores plus bias); a strict comparison keeps the lower expert on a tie
        auto key = [&](int e) { return bias ? score[e] + bias[e] : l[e]; };
        int* chosen = &r.expert[t * K];
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (std::find(chosen, chosen + k, e) == chosen + k && (best < 0 || key(e) > key(best))) best = e;
            chosen[k] = best;
        }
        float chosen_total = 0.0f;
        for (int k = 0; k < K; k++) chosen_total += r.gate[t * K + k] = score[chosen[k]];
        for (int k = 0; k < K; k++) r.chosen[chosen[k]]++;
        for (int k = 0; k < K; k++) r.gate[t * K + k] = (how.normalize ? r.gate[t * K + k] / chosen_total : r.gate[t * K + k]) * how.scale;
    }
}

// Which assignments of B whole sequences (choices: each one's T positions in order, K experts each) their
// experts take under a capacity of `cap` per expert and sequence: in token order, then slot order, an expert takes
// the first cap it was chosen for (GShard's and Switch Transformer's rule) and the rest are dropped. Decided per
// sequence, so that every layout drops the same ones.
inline std::vector<char> within_capacity(const int* choices, int B, long T, int K, int E, long cap) {
    std::vector<char> keep((size_t)B * T * K);
    std::vector<long> taken(E);
    for (int b = 0; b < B; b++) {
        std::fill(taken.begin(), taken.end(), 0);
        for (long tk = (long)b * T * K; tk < (long)(b + 1) * T * K; tk++) keep[tk] = taken[choices[tk]]++ < cap;
    }
    return keep;
}

// Where the aux loss's f comes from: each sequence's assignments, or the batch's (see the top)
enum class AuxScope { Sequence, Batch };

// ----------------------------------------------------------------------------------------------------------

template <typename floatX>
struct MixtureOfExperts {
    int E = 1, K = 1, X = 1;  // experts, chosen per token, held by this rank
    Routing routing;          // the score function, the gates' normalization and scale
    // each model layer's selection bias (L·E, or empty: none), the same on every rank, and how fast it moves (γ)
    std::vector<float> bias;
    float bias_rate = 0.001f;
    float alpha = 0.01f;      // the aux loss's weight
    AuxScope aux_scope = AuxScope::Sequence;
    float capacity = 0.0f;    // F: an expert takes at most ceil(F·K·T/E) of a sequence's assignments (0: all)
    Comm* ep = nullptr;       // the expert-parallel group; null for a single rank
    Comm* batch = nullptr;    // the dp·cp group, whose tokens make the batch of the batch scope; null for one rank
    int ep_size = 1, ep_rank = 0;
    // scratch shared by the layers: rows in dispatch order and on the experts' side, the router's fp32
    // buffers, and (on the GPU) the routing decisions uploaded for the kernels
    floatX *dispatch = nullptr, *received = nullptr, *expert_rows = nullptr;
    float *logits = nullptr, *gates = nullptr, *dgates = nullptr, *dlogits = nullptr;
    int *row_of = nullptr, *token_of_row = nullptr, *permutation = nullptr;
    // ... and the shared expert's gate: its logits (backward: their gradients) and its scales, fp32
    float *shared_logits = nullptr, *shared_scales = nullptr;
    std::vector<float> host_logits, host_dgates, host_dlogits, prob_sums, host_shared;
    // what the step's forward passes saw, for the log: Σ over sequences and layers of the aux loss, and the
    // assignments per (model layer, expert)
    double aux_sum = 0.0;
    std::vector<double> load;
    long dropped = 0;  // ... and the assignments dropped at capacity (counted on tp rank 0)
    // under the batch scope: each layer's assignments per expert over the step's micro-batches so far, summed over
    // the batch group (L·E)
    std::vector<double> batch_load;
    // ... and what crossed ranks: the rows sent to other ranks' experts and received from other ranks, and the
    // count exchanges (one per layer and micro-batch)
    long rows_crossing = 0, count_exchanges = 0;

    bool on() const { return E > 1; }
    void reset_statistics() {
        aux_sum = 0.0;
        std::fill(load.begin(), load.end(), 0.0);
        std::fill(batch_load.begin(), batch_load.end(), 0.0);
        dropped = rows_crossing = count_exchanges = 0;
    }
    // The bytes this rank sends over the ep group, by the formula: per layer and micro-batch, forward's dispatch
    // and return and backward's two, each row of C elements sent once by dispatch or return (the rows it sends
    // away go out in both dispatches, the rows it received come back in both returns), the counts, and once a
    // step the gradient norm's partial sum (one double to each other rank: llmc/zero.cuh)
    double formula_bytes(int C) const {
        return 2.0 * rows_crossing * C * sizeof(floatX) + (double)count_exchanges * (ep_size - 1) * X * sizeof(int) +
               (ep_size - 1) * sizeof(double);
    }
    // BT rows a micro-batch, and the most this rank's experts may receive (LocalDims::expert_rows)
    void allocate(Ledger& led, const GPTConfig& c, long BT, long rows) {
        E = c.num_experts, K = c.top_k, X = E / ep_size;
        routing = {c.sigmoid_scores, c.norm_topk, c.routed_scale};
        bias.assign(c.router_bias ? (size_t)c.num_layers * E : 0, 0.0f);
        int layers = c.num_layers, C = c.channels;
        load.assign((size_t)layers * E, 0.0);
        batch_load.assign((size_t)layers * E, 0.0);
        if (!on()) return;
        auto scr = [&](size_t n) { return led.alloc<floatX, floatX>(MEM_SCRATCH, n); };
        auto scr_f = [&](size_t n) { return led.alloc<floatX, float>(MEM_SCRATCH, n); };
        dispatch = scr((size_t)BT * K * C);
        if (ep_size > 1) received = scr((size_t)rows * C);
        expert_rows = scr((size_t)rows * C);
        logits = scr_f((size_t)BT * E), dlogits = scr_f((size_t)BT * E);
        gates = scr_f((size_t)BT * K), dgates = scr_f((size_t)BT * K);
        if (c.shared_gate) shared_logits = scr_f((size_t)BT), shared_scales = scr_f((size_t)BT);
        if (device_of<floatX> == Device::CUDA) {
            auto scr_i = [&](size_t n) { return led.alloc<floatX, int>(MEM_SCRATCH, n); };
            row_of = scr_i((size_t)BT * K), token_of_row = scr_i((size_t)BT * K), permutation = scr_i((size_t)rows);
        }
    }

    // the host's numbers where the kernels read them: the host vector itself on the CPU, else uploaded
    template <typename V>
    const V* on_device(V* device, const std::vector<V>& host) {
        if constexpr (device_of<floatX> == Device::CPU) return host.data();
        device_upload<floatX>(device, host.data(), host.size());
        return device;
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

    // Which of this rank's B sequences of Tl tokens' assignments the capacity keeps (within_capacity): under cp
    // each sequence's choices are gathered from the group and put in position order, so that every rank decides
    // over the whole sequence as one rank would
    std::vector<char> kept_within_capacity(const MoERoute& r, ContextParallel<floatX>& cp, int B, int Tl) {
        int N = cp.spec.size;
        long T = (long)Tl * N, cap = expert_capacity(capacity, K, E, T);
        std::vector<char> keep;
        if (!cp.on()) {
            keep = within_capacity(r.expert.data(), B, T, K, E, cap);
        } else {
            std::vector<int> all((size_t)N * B * Tl * K), whole((size_t)B * T * K);
            cp.comm->wait(cp.comm->all_gather(r.expert.data(), all.data(), r.expert.size(), DType::I32));
            int n = cp.layout.chunk_tokens();
            for (int s = 0; s < N; s++)
                for (int b = 0; b < B; b++)
                    for (int t = 0; t < Tl; t++) {
                        long at = ((long)b * T + (long)cp.layout.chunk_of(s, t / n) * n + t % n) * K;
                        std::copy_n(&all[(((size_t)s * B + b) * Tl + t) * K], K, &whole[at]);
                    }
            std::vector<char> decided = within_capacity(whole.data(), B, T, K, E, cap);
            keep.resize((size_t)B * Tl * K);
            for (int b = 0; b < B; b++)
                for (int t = 0; t < Tl; t++)
                    std::copy_n(&decided[((long)b * T + cp.positions[t]) * K], K, &keep[((long)b * Tl + t) * K]);
        }
        return keep;
    }

    // The aux loss's statistics: each sequence's f (r.freq, B·E), which its gradient wants, and Σ_t P (prob_sums,
    // B·E), which its value adds. Under cp a sequence's tokens are spread over the group, so its sums are taken
    // over it. Under the batch scope every sequence's f is the layer's share of the step's assignments so far,
    // this micro-batch's (this rank's: chosen) summed over the batch group.
    void aux_statistics(MoERoute& r, ContextParallel<floatX>& cp, int B, int Tl, int layer) {
        std::vector<float> sums(2 * (size_t)B * E, 0.0f);  // the counts, then Σ_t P, per sequence and expert
        for (long t = 0; t < (long)B * Tl; t++) {
            long b = t / Tl;
            for (int k = 0; k < K; k++) sums[b * E + r.expert[t * K + k]] += 1.0f;
            for (int e = 0; e < E; e++) sums[((long)B + b) * E + e] += r.probs[t * E + e];
        }
        if (cp.on()) cp.comm->wait(cp.comm->all_reduce(sums.data(), sums.data(), sums.size(), DType::F32));
        prob_sums.assign(sums.begin() + (long)B * E, sums.end());
        r.freq.resize((size_t)B * E);
        if (aux_scope == AuxScope::Sequence) {
            float T = (float)Tl * cp.spec.size;
            for (size_t i = 0; i < r.freq.size(); i++) r.freq[i] = sums[i] / (T * K);
            return;
        }
        std::vector<double> counts(r.chosen.begin(), r.chosen.end());
        if (batch) batch->wait(batch->all_reduce(counts.data(), counts.data(), E, DType::F64));
        double* so_far = &batch_load[(size_t)layer * E];
        double total = 0.0;
        for (int e = 0; e < E; e++) so_far[e] += counts[e], total += so_far[e];
        for (size_t i = 0; i < r.freq.size(); i++) r.freq[i] = (float)(so_far[i % E] / total);
    }

    // The counts of rows each rank of the ep group sends to this one's experts, and the order in which the
    // experts take them: expert-major, and within an expert by source rank, then the source's dispatch order
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
        r.recv_of_expert_row.resize(r.rows), r.expert_row_of_recv.resize(r.rows);
        std::vector<int> next(r.expert_first.begin(), r.expert_first.end() - 1);
        int recv_row = 0;
        for (int s = 0; s < ep_size; s++)
            for (int x = 0; x < X; x++)
                for (int i = 0; i < r.recv_counts[s * X + x]; i++, recv_row++) {
                    int er = next[x]++;
                    r.recv_of_expert_row[er] = recv_row, r.expert_row_of_recv[recv_row] = er;
                }
    }

    // Forward of one sparse layer's MLP. ln2: the norm's output, every row (BT×C); out: this rank's rows of the
    // MLP's output (R×C), with `partial` BT×C scratch under sequence parallelism; w: the layer's parameters; a: what
    // the layer keeps (inputs: rows×C, fch: rows×FC, act: rows×H; outputs K·BT×C, dispatch order; the shared
    // expert's on BT rows). B sequences of Tl tokens each on this rank; `experts` and `shared` the MLPs' shapes on
    // this rank; layer is the layer's index in the model (for the load); fp8 the experts' FP8 state, fp8_shared
    // the shared expert's.
    void forward(floatX* out, floatX* partial, MoERoute& r, const ExpertActivations<floatX>& a, const floatX* ln2,
                 const ExpertTensors<floatX>& w, int B, int Tl, const MlpShape& experts, const MlpShape& shared,
                 TensorParallel& tp, ContextParallel<floatX>& cp, int layer, float* ws, const Fp8Scaling<floatX>* fp8,
                 const Fp8Scaling<floatX>* fp8_shared) {
        long BT = (long)B * Tl;
        int C = experts.C;
        router_forward(logits, ln2, w.router, BT, C, E);
        host_logits.resize((size_t)BT * E);
        device_download<floatX>(host_logits.data(), logits, host_logits.size());
        route_tokens(r, host_logits.data(), BT, E, K, routing, bias.empty() ? nullptr : &bias[(size_t)layer * E]);
        std::vector<char> keep = capacity > 0.0f ? kept_within_capacity(r, cp, B, Tl) : std::vector<char>();
        dispatch_order(r, BT, E, K, keep.empty() ? nullptr : keep.data());
        aux_statistics(r, cp, B, Tl, layer);
        if (cp.spec.rank == 0)  // the statistics are whole sequences', the same on every cp rank: count them once
            for (int b = 0; b < B; b++) {
                double sum = 0.0;
                for (int e = 0; e < E; e++) sum += (double)r.freq[(size_t)b * E + e] * prob_sums[(size_t)b * E + e];
                aux_sum += alpha * E * sum / ((double)Tl * cp.spec.size);
            }
        if (tp.spec.rank == 0) {
            for (int e = 0; e < E; e++) load[(size_t)layer * E + e] += r.chosen[e];
            dropped += BT * K - r.dispatched;
        }
        plan_receive(r);

        // the rows to the experts, the experts, the rows back
        const int* token_of = on_device(token_of_row, r.token_of_row);
        gather_rows(ep_size > 1 ? dispatch : a.inputs, ln2, token_of, r.dispatched, C);
        if (ep_size > 1) {
            exchange(dispatch, received, r, true, C);
            gather_rows(a.inputs, received, on_device(permutation, r.recv_of_expert_row), r.rows, C);
        }
        floatX* expert_out = ep_size > 1 ? expert_rows : a.outputs;
        MlpTensorViews<floatX> ew = on_first_tp_rank(w.experts, tp);
        long FC = experts.FC(), H = experts.H;
        for (int x = 0; x < X; x++) {
            long first = r.expert_first[x], n = r.expert_first[x + 1] - first;
            if (n == 0) continue;
            mlp_forward(expert_out + first * C, a.fch + first * FC, a.act + first * H, a.inputs + first * C,
                        expert_view(ew, x, experts), n, experts, ws, fp8);
        }
        if (ep_size > 1) {
            gather_rows(received, expert_rows, on_device(permutation, r.expert_row_of_recv), r.rows, C);
            exchange(received, a.outputs, r, false, C);
        }
        floatX* whole = tp.spec.sp ? partial : out;
        bool has_shared = w.shared.fcw != nullptr, gated = w.shared_gate != nullptr;
        if (has_shared)  // the sum's first term, or (gated) its own buffer
            mlp_forward(gated ? a.shared_out : whole, a.shared_fch, a.shared_act, ln2, on_first_tp_rank(w.shared, tp), BT,
                        shared, ws, fp8_shared);
        moe_combine(whole, a.outputs, on_device(row_of, r.row_of), on_device(gates, r.gate), BT, K, C,
                    has_shared && !gated);
        if (gated) {
            router_forward(shared_logits, ln2, w.shared_gate, BT, C, 1);
            r.shared_scale.resize(BT);
            device_download<floatX>(r.shared_scale.data(), shared_logits, BT);
            for (float& g : r.shared_scale) g = 1.0f / (1.0f + expf(-g));
            add_scaled_rows(whole, a.shared_out, on_device(shared_scales, r.shared_scale), BT, C);
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
                  bool recompute, float* ws, const Fp8Scaling<floatX>* fp8, const Fp8Scaling<floatX>* fp8_shared) {
        long BT = (long)B * Tl;
        int C = experts.C;
        bool split = a.kept_dout != nullptr, has_shared = w.shared.fcw != nullptr, gated = w.shared_gate != nullptr;
        const int* rows_of = on_device(row_of, r.row_of);
        // the shared expert first: its input gradient starts dln, to which the experts' combine adds
        if (has_shared) {
            const floatX* sdout = dout;
            if (gated) {
                // the gate's logit: dl = s·(1 - s) · dout·out, the dot summed over the tp ranks' partial outputs
                host_shared.resize(BT);
                moe_gate_grads(shared_logits, dout, a.shared_out, (const int*)nullptr, BT, 1, C);
                device_download<floatX>(host_shared.data(), shared_logits, BT);
                tp.sum_in_rank_order(host_shared.data(), BT);
                for (long t = 0; t < BT; t++) host_shared[t] *= r.shared_scale[t] * (1.0f - r.shared_scale[t]);
                // the output's gradient, scaled (dispatch's rows are free until the experts' backward)
                floatX* scaled = split ? a.kept_shared_dout : dispatch;
                moe_spread(scaled, dout, (const int*)nullptr, on_device(shared_scales, r.shared_scale), BT, 1, C);
                sdout = scaled;
            } else if (split) {
                device_copy<floatX>(a.kept_shared_dout, dout, BT * C);
            }
            if (recompute) mlp_activation_again(a.shared_act, a.shared_fch, BT, shared);
            mlp_backward(dln, dw.shared, sdout, split ? a.kept_shared_dfch : dfch, dact, a.shared_fch, a.shared_act, ln2,
                         w.shared, BT, shared, ws, fp8_shared);
        }

        // the gates: dgate = dout · y, summed over the tp ranks' partial outputs
        host_dgates.resize((size_t)BT * K);
        moe_gate_grads(dgates, dout, a.outputs, rows_of, BT, K, C);
        device_download<floatX>(host_dgates.data(), dgates, host_dgates.size());
        tp.sum_in_rank_order(host_dgates.data(), BT * K);

        // the rows: to the experts, through them, back
        floatX* drows = ep_size > 1 ? dispatch : expert_rows;
        moe_spread(drows, dout, rows_of, on_device(gates, r.gate), BT, K, C);
        floatX* dexpert = drows;  // the experts' output gradients, expert-major
        if (ep_size > 1) {
            exchange(dispatch, received, r, true, C);
            gather_rows(expert_rows, received, on_device(permutation, r.recv_of_expert_row), r.rows, C);
            dexpert = expert_rows;
        }
        if (split) device_copy<floatX>(a.kept_dout, dexpert, r.rows * C);
        if (recompute) mlp_activation_again(a.act, a.fch, r.rows, experts);
        // dexpert turns into the experts' input gradients row by row, each expert's rows once it is done with them
        long FC = experts.FC(), H = experts.H;
        for (int x = 0; x < X; x++) {
            long first = r.expert_first[x], n = r.expert_first[x + 1] - first;
            if (n == 0) continue;
            mlp_backward(dexpert + first * C, expert_view(dw.experts, x, experts), dexpert + first * C,
                         split ? a.kept_dfch + first * FC : dfch, dact, a.fch + first * FC, a.act + first * H,
                         a.inputs + first * C, expert_view(w.experts, x, experts), n, experts, ws, fp8);
        }
        const floatX* dinputs = dexpert;  // dispatch order, once back
        if (ep_size > 1) {
            gather_rows(received, expert_rows, on_device(permutation, r.expert_row_of_recv), r.rows, C);
            exchange(received, dispatch, r, false, C);
            dinputs = dispatch;
        }
        moe_combine(dln, dinputs, rows_of, (const float*)nullptr, BT, K, C, has_shared);

        // the router: the gradient of the scores, from the gates (g_k = c·v_k / V under renormalization, v the
        // chosen scores, V their sum, c the scale: dv_k = (c·dg_k - Σ_j g_j·dg_j) / V; else c·dg_k) and from the
        // aux loss through the normalized scores P, then through the score function
        host_dlogits.assign((size_t)BT * E, 0.0f);
        std::vector<float> dp(E), ds(E);
        const float c = routing.scale;
        for (long t = 0; t < BT; t++) {
            const float *g = &r.gate[t * K], *dg = &host_dgates[t * K], *p = &r.probs[t * E];
            const float* score = routing.sigmoid ? &r.scores[t * E] : p;
            const float* f = &r.freq[(t / Tl) * E];
            float* dl = &host_dlogits[t * E];
            // d aux / d P_i of the token: α·E·f_i per sequence, each sequence weighing dloss·T in the objective
            for (int e = 0; e < E; e++) dp[e] = alpha * E * f[e] * dloss;
            float gdg = 0.0f, chosen_total = 0.0f;
            for (int k = 0; k < K; k++) gdg += g[k] * dg[k], chosen_total += score[r.expert[t * K + k]];
            // the gates' part, to the chosen scores: P itself under softmax, the sigmoid scores else
            float* dv = routing.sigmoid ? ds.data() : dp.data();
            if (routing.sigmoid) std::fill(ds.begin(), ds.end(), 0.0f);
            for (int k = 0; k < K; k++)
                dv[r.expert[t * K + k]] += routing.normalize ? (c * dg[k] - gdg) / chosen_total : c * dg[k];
            float pdp = 0.0f;
            for (int e = 0; e < E; e++) pdp += p[e] * dp[e];
            if (!routing.sigmoid) {  // through the softmax
                for (int e = 0; e < E; e++) dl[e] = p[e] * (dp[e] - pdp);
                continue;
            }
            // through P = s / Σs, then the sigmoid
            float total = 0.0f;
            for (int e = 0; e < E; e++) total += score[e];
            for (int e = 0; e < E; e++) dl[e] = (ds[e] + (dp[e] - pdp) / total) * score[e] * (1.0f - score[e]);
        }
        const float* dl = on_device(dlogits, host_dlogits);
        // every tp rank holds the same router gradient; its part of dln is added once, before the tp reduction
        router_backward(tp.spec.rank == 0 ? dln : nullptr, dw.router, dl, ln2, w.router, BT, C, E);
        if (gated)  // ... and so the shared expert's gate's
            router_backward(tp.spec.rank == 0 ? dln : nullptr, dw.shared_gate, on_device(shared_logits, host_shared),
                            ln2, w.shared_gate, BT, C, 1);
    }

    // The MLPs' weight gradients a split backward left, from the output gradients it kept
    void weight_grads(const ExpertTensors<floatX>& dw, const MoERoute& r, const ExpertActivations<floatX>& a,
                      const floatX* ln2, const ExpertTensors<floatX>& w, long BT, const MlpShape& experts,
                      const MlpShape& shared, bool recompute, float* ws, const Fp8Scaling<floatX>* fp8,
                      const Fp8Scaling<floatX>* fp8_shared) {
        if (w.shared.fcw) {
            if (recompute) mlp_activation_again(a.shared_act, a.shared_fch, BT, shared);
            mlp_weight_grads(dw.shared, a.kept_shared_dout, a.kept_shared_dfch, a.shared_act, ln2, w.shared, BT, shared,
                             ws, fp8_shared);
        }
        if (recompute) mlp_activation_again(a.act, a.fch, r.rows, experts);
        int C = experts.C;
        long FC = experts.FC(), H = experts.H;
        for (int x = 0; x < X; x++) {
            long first = r.expert_first[x], n = r.expert_first[x + 1] - first;
            if (n == 0) continue;
            mlp_weight_grads(expert_view(dw.experts, x, experts), a.kept_dout + first * C, a.kept_dfch + first * FC,
                             a.act + first * H, a.inputs + first * C, expert_view(w.experts, x, experts), n, experts, ws,
                             fp8);
        }
    }

    // After a step, each sparse layer's selection bias toward balanced loads: b_i += γ·sign(mean − load_i), load:
    // the step's assignments per (model layer, expert) over the whole global batch
    void balance(const std::vector<double>& global_load) {
        for (size_t l = 0; l < bias.size() / E; l++) {
            const double* n = &global_load[l * E];
            double mean = std::accumulate(n, n + E, 0.0) / E;
            if (mean == 0) continue;  // a layer no token reached (a dense one)
            for (int e = 0; e < E; e++) bias[l * E + e] += bias_rate * (float)((n[e] < mean) - (n[e] > mean));
        }
    }

   private:
    // an MLP's tensors with fc_proj's bias on tp rank 0 alone, so that the reduction over the group adds it once
    static MlpTensorViews<floatX> on_first_tp_rank(MlpTensorViews<floatX> w, const TensorParallel& tp) {
        if (tp.spec.rank != 0) w.fcprojb = nullptr;
        return w;
    }
};
