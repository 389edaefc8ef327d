// GPT-2's parameter counts in closed form, written from the architecture apart from the model's table of tensors
// (llmc/model_table.h), so that tests comparing the two check one against the other.
#pragma once

#include "llmc/model_table.h"

// Ψ = Vp·C + maxT·C + L·(12C² + 13C) + 2C: embeddings, per layer 4C² attention + 8C² MLP weights with their
// 9C biases and 4C layernorm parameters, and the final layernorm. With E experts each sparse layer has E MLPs
// (2CH + H + C each, H the experts' width: 8C² + 5C at 4C) and the router's E·C weight in place of the one MLP:
// L·(4C² + 8C + E·(8C² + 6C)) when every layer is sparse; a dense layer keeps the 4C MLP. A shared expert of Hs
// adds its MLP (2C·Hs + Hs + C) to each sparse layer, and its gate C more; a router's selection bias E.
inline size_t gpt2_parameter_count(const GPTConfig& c) {
    size_t C = c.channels, E = c.num_experts, layers = 0;
    auto mlp = [&](size_t H) { return 2 * C * H + H + C; };  // fc's weight and bias, fc_proj's
    for (int l = 0; l < c.num_layers; l++)  // attention and the norms; a sparse layer's router and E experts
        layers += 4 * C * C + 8 * C + (c.sparse_layer(l) ? E * C + E * mlp(c.expert_hidden()) : mlp(c.hidden())) +
                  (c.sparse_layer(l) && c.shared_size > 0 ? mlp(c.shared_size) + c.shared_gate * C : 0) +
                  (c.sparse_layer(l) ? c.router_bias * E : 0);
    return (size_t)c.padded_vocab_size * C + (size_t)c.max_seq_len * C + layers + 2 * C;
}

// one rank's share under tensor parallelism over t ranks, of a pipeline stage's L layers: ⌈Vp/t⌉ vocab rows
// and maxT·C positions on the first and the last stage; per layer the 4C² weights and 4C biases of QKV and the
// attention projection split t ways but for the projection's bias, the 4C of layernorms whole, and an MLP of H
// hidden units (2CH/t + H/t + C: fc_proj's bias whole); the final layernorm's 2C on the last stage. A sparse layer
// holds the whole router (E·C) and E/ep experts, each split over tp as a dense layer's MLP is, and the shared
// expert split so too, whole on every ep rank (its gate whole), and the whole selection bias.
inline size_t gpt2_parameter_count_per_rank(const GPTConfig& c, int t, const ModelPart& part, int ep = 1) {
    size_t C = c.channels, Vl = (c.padded_vocab_size + t - 1) / t, X = c.num_experts / ep, layers = 0;
    size_t embeddings = part.embeddings() ? Vl * C + (size_t)c.max_seq_len * C : 0;
    auto mlp = [&](size_t H) { return 2 * C * H / t + H / t + C; };
    for (int l = 0; l < part.layers(); l++)
        layers += 4 * C * C / t + 3 * C / t + 5 * C +
                  (c.sparse_layer(part.model_layer(l)) ? c.num_experts * C + X * mlp(c.expert_hidden()) : mlp(c.hidden())) +
                  (c.sparse_layer(part.model_layer(l)) && c.shared_size > 0 ? mlp(c.shared_size) + c.shared_gate * C : 0) +
                  (c.sparse_layer(part.model_layer(l)) ? c.router_bias * c.num_experts : 0);
    return embeddings + layers + (part.last ? 2 * C : 0);
}
