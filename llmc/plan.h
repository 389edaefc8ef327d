// --plan: the memory a run will need, per ledger category, predicted from the flags alone with closed-form
// counts (no allocation). Written from the model's arithmetic, not from the allocation code, so that the test
// comparing it with the Ledger checks one against the other.
//
// Notation as in the Ultra-Scale Playbook: Ψ parameters, L layers, C channels (h), NH heads (a), B×T tokens
// (b, s), Vp padded vocab. On the CPU everything is fp32 (4 bytes), the parameters are their own master copy,
// and AdamW keeps two moments, so the model states are 4Ψ + 4Ψ + 8Ψ = 16Ψ bytes.
//
// Under data parallelism over N ranks, ZeRO divides model states by N stage by stage (the Playbook's
// formulas, per rank): ZeRO-1 4Ψ + 4Ψ + 8Ψ/N, ZeRO-2 4Ψ + (4+8)Ψ/N, ZeRO-3 (4+4+8)Ψ/N; with bf16 mixed
// precision (2-byte parameters and gradients, a 4-byte master copy and two 4-byte moments) the same stages
// give 2Ψ + 2Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N. Here Ψ/N is a rank's shard: the buckets of llmc/zero.cuh
// padded to multiples of N, divided by N.
#pragma once

#include <cstdio>

#include "llmc/gpt.cuh"
#include "llmc/ledger.h"
#include "llmc/zero.cuh"

constexpr size_t DEFAULT_BUCKET_FLOATS = 25 * 1048576 / 4;  // --bucket-mb 25

// the parallel layout a plan is for
struct ParallelPlan {
    int dp = 1, zero = 0;
    size_t bucket_floats = DEFAULT_BUCKET_FLOATS;
    int accumulation = 1;  // micro-steps per optimizer step
};

struct MemoryPlan {
    size_t bytes[MEM_CATEGORIES] = {};
    size_t total() const {
        size_t t = 0;
        for (size_t b : bytes) t += b;
        return t;
    }
};

// Ψ = Vp·C + maxT·C + L·(12C² + 13C) + 2C: embeddings, per layer 4C² attention + 8C² MLP weights with their
// 9C biases and 4C layernorm parameters, and the final layernorm
inline size_t count_parameters(const GPTConfig& c) {
    size_t C = c.channels, L = c.num_layers;
    return (size_t)c.padded_vocab_size * C + (size_t)c.max_seq_len * C + L * (12 * C * C + 13 * C) + 2 * C;
}

// bytes per element of each model state: fp32 on the CPU; bf16 mixed precision on a GPU
struct StatePrecision {
    size_t params, master, grads, optimizer;
};
constexpr StatePrecision CPU_FP32 = {4, 0, 4, 8};
constexpr StatePrecision BF16_MIXED = {2, 4, 2, 8};

// one rank's model states: whole (psi elements) or sharded (shard elements) as the ZeRO stage says
inline void plan_model_states(size_t bytes[MEM_CATEGORIES], size_t psi, size_t shard, int zero, StatePrecision e) {
    bytes[MEM_PARAMS] = e.params * (zero >= 3 ? shard : psi);
    bytes[MEM_MASTER_WEIGHTS] = e.master * (zero >= 1 ? shard : psi);
    bytes[MEM_GRADS] = e.grads * (zero >= 2 ? shard : psi);
    bytes[MEM_OPTIMIZER] = e.optimizer * (zero >= 1 ? shard : psi);
}

inline MemoryPlan plan_memory(const GPTConfig& c, int B, int T, int threads, const ParallelPlan& par = {}) {
    const size_t F = sizeof(float);
    size_t psi = count_parameters(c);
    size_t L = c.num_layers, C = c.channels, NH = c.num_heads, BT = (size_t)B * T;
    MemoryPlan p;
    if (par.dp == 1 && par.zero == 0) {
        plan_model_states(p.bytes, psi, psi, 0, CPU_FP32);
    } else {
        BucketLayout lay = bucket_layout(c, par.dp, par.bucket_floats);
        plan_model_states(p.bytes, psi, lay.shard_size, par.zero, CPU_FP32);
        // staging for reductions in flight: the embeddings' bucket and two others, each with its piece; under
        // ZeRO-3 also the gathered parameters: the embeddings' bucket, the bucket in use and the next one
        const Bucket& e = lay.embeddings();
        size_t staging = e.padded + e.piece + 2 * (lay.max_padded + lay.max_piece);
        if (par.zero == 3) staging += e.padded + 2 * lay.max_padded;
        p.bytes[MEM_COMM] = F * staging;
    }
    // What forward keeps for backward. Per layer, in units of B·T·C: ln1 1, qkv 3, attention output 1,
    // its projection 1, residual 1, ln2 1, MLP hidden 4 before and 4 after GELU, its projection 1, residual 1
    // (18 in all), plus mean and 1/std for two layernorms (4·B·T) and the softmax probabilities NH·B·T².
    // Around the layers: the embedding output (BTC), the final layernorm (BTC + 2BT), the logits (BT·Vp) and
    // the per-token losses (BT).
    size_t per_layer = 18 * BT * C + 4 * BT + NH * B * (size_t)T * T;
    p.bytes[MEM_ACTIVATIONS] = F * (L * per_layer + BT * C + BT * C + 2 * BT + BT * c.padded_vocab_size + BT);
    // Backward's activation gradients, reused by every layer: the residual stream, a layernorm input, qkv (3),
    // attention output and MLP hidden (4), i.e. 10·BTC; T floats per thread for attention; the GEMM's packing
    // panels per thread.
    p.bytes[MEM_SCRATCH] = F * (10 * BT * C + (size_t)threads * T + gemm_workspace_floats(threads));
    return p;
}

inline void print_memory(const char* title, const size_t bytes[MEM_CATEGORIES], size_t total) {
    printf("%s\n", title);
    for (int i = 0; i < MEM_CATEGORIES; i++) printf("  %-16s %14zu bytes %10.1f MiB\n", mem_category_name(i), bytes[i], bytes[i] / 1048576.0);
    printf("  %-16s %14zu bytes %10.1f MiB\n", "total", total, total / 1048576.0);
}

// Bytes one rank sends per optimizer step, counted as a ring algorithm sends them: (N-1)/N of every buffer
// reduce-scattered or all-gathered, where a full pass over the model moves P = the padded parameter count.
// ZeRO-0 and 1 reduce-scatter the gradients once and all-gather once (the gradients, or the updated
// parameters): 2P, the all-reduce's volume. ZeRO-2 reduce-scatters in each of k micro-steps: (k+1)P. ZeRO-3
// gathers the parameters for forward and again for backward and reduce-scatters, each micro-step: 3kP. Two
// all-reduces of one double (the loss and the gradient norm) add 2·2(N-1)/N·8 bytes.
inline double planned_comm_bytes(const GPTConfig& c, const ParallelPlan& par) {
    if (par.dp == 1 && par.zero == 0) return 0.0;
    double ring = (double)(par.dp - 1) / par.dp, P = (double)bucket_layout(c, par.dp, par.bucket_floats).padded_total;
    double k = par.accumulation;
    double passes = par.zero <= 1 ? 2.0 : par.zero == 2 ? k + 1.0 : 3.0 * k;
    return ring * (passes * P * sizeof(float) + 2 * 2 * sizeof(double));
}
