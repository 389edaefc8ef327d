// --plan: the memory a run will need, per ledger category, predicted from the flags alone with closed-form
// counts (no allocation). Written from the model's arithmetic, not from the allocation code, so that the test
// comparing it with the Ledger checks one against the other.
//
// Notation as in the Ultra-Scale Playbook: Ψ parameters, L layers, C channels (h), NH heads (a), B×T tokens
// (b, s), Vp padded vocab. On the CPU everything is fp32 (4 bytes), the parameters are their own master copy,
// and AdamW keeps two moments, so the model states are 4Ψ + 4Ψ + 8Ψ = 16Ψ bytes.
#pragma once

#include <cstdio>

#include "llmc/gpt.cuh"
#include "llmc/ledger.h"

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

inline MemoryPlan plan_memory(const GPTConfig& c, int B, int T, int threads) {
    const size_t F = sizeof(float);
    size_t psi = count_parameters(c);
    size_t L = c.num_layers, C = c.channels, NH = c.num_heads, BT = (size_t)B * T;
    MemoryPlan p;
    p.bytes[MEM_PARAMS] = F * psi;
    p.bytes[MEM_GRADS] = F * psi;
    p.bytes[MEM_OPTIMIZER] = 2 * F * psi;
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
