// Text generation for the periodic samples: start from EOT, run the model on the tokens so far, draw the next
// token from the softmax over the real vocabulary (temperature 1), repeat.
#pragma once

#include <string>
#include <vector>

#include "llmc/gpt.cuh"
#include "llmc/tokenizer.h"

template <typename floatX>
inline std::vector<int> sample_tokens(GPTModel<floatX>& m, int eot, int count, int T, Rng& rng) {
    const GPTConfig& c = m.config;
    if (count > T) fail("sampling: %d tokens need a context of at least %d", count, count);
    // tokens[0] is the start token; the logits at position t-1 < T give token t, so up to T tokens fit
    std::vector<int> tokens(T + 1, eot);
    for (int t = 1; t <= count; t++) {
        // causal attention: positions after t-1 do not influence the logits at t-1, so padding them is harmless
        gpt_forward(m, tokens.data(), nullptr, 1, T);
        std::vector<float> row = gpt_logits_row(m, 0, t - 1);
        const float* logits = row.data();
        float lse = logsumexp_row(logits, c.vocab_size);
        float coin = rng.uniform(), cdf = 0.0f;
        int next = c.vocab_size - 1;
        for (int v = 0; v < c.vocab_size; v++) {
            cdf += expf(logits[v] - lse);
            if (coin < cdf) {
                next = v;
                break;
            }
        }
        tokens[t] = next;
    }
    return std::vector<int>(tokens.begin() + 1, tokens.begin() + count + 1);
}
