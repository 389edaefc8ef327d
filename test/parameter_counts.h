// GPT-2's parameter counts in closed form, written from the architecture apart from the model's table of tensors
// (llmc/model_table.h), so that tests comparing the two check one against the other.
#pragma once

#include "llmc/model_table.h"

// Ψ = Vp·C + maxT·C + L·(12C² + 13C) + 2C: embeddings, per layer 4C² attention + 8C² MLP weights with their
// 9C biases and 4C layernorm parameters, and the final layernorm. With E experts each layer has E MLPs
// (8C² + 5C each) and the router's E·C weight in place of the one MLP: L·(4C² + 8C + E·(8C² + 6C)).
inline size_t gpt2_parameter_count(const GPTConfig& c) {
    size_t C = c.channels, L = c.num_layers, E = c.num_experts;
    size_t layer = c.moe() ? 4 * C * C + 8 * C + E * (8 * C * C + 6 * C) : 12 * C * C + 13 * C;
    return (size_t)c.padded_vocab_size * C + (size_t)c.max_seq_len * C + L * layer + 2 * C;
}

// one rank's share under tensor parallelism over t ranks, of a pipeline stage's L layers: ⌈Vp/t⌉ vocab rows
// and maxT·C positions on the first and the last stage; per layer the 12C² weights and 7C biases of QKV, fc
// and the projections split t ways, the 6C of layernorms and row-parallel biases whole; the final layernorm's
// 2C on the last stage. With experts split over ep ranks, a layer holds the whole router (E·C) and E/ep
// experts, each split over tp as the dense MLP is (8C²/t + 4C/t, and fc_proj's bias whole).
inline size_t gpt2_parameter_count_per_rank(const GPTConfig& c, int t, const ModelPart& part, int ep = 1) {
    size_t C = c.channels, L = part.layers(), Vl = (c.padded_vocab_size + t - 1) / t, X = c.num_experts / ep;
    size_t embeddings = part.embeddings() ? Vl * C + (size_t)c.max_seq_len * C : 0;
    size_t attention = 4 * C * C / t + 3 * C / t + 5 * C, mlp = 8 * C * C / t + 4 * C / t + C;
    size_t layer = c.moe() ? attention + c.num_experts * C + X * mlp : attention + mlp;
    return embeddings + L * layer + (part.last ? 2 * C : 0);
}
