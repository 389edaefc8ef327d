// Text generation for the periodic samples: start from the token a document follows (the tokenizer's start: EOT
// for GPT-2, <|begin_of_text|> for Llama 3), run the model on the tokens so far, draw the next
// token from the softmax over the real vocabulary (temperature 1), repeat.
#pragma once

#include <string>
#include <vector>

#include "llmc/gpt.cuh"
#include "llmc/tokenizer.h"

// logits_at(tokens, t): the logits over the vocab at position t of the model run on T tokens (every rank gets
// them, whatever the layout)
template <typename LogitsAt>
inline std::vector<int> sample_tokens(LogitsAt logits_at, int vocab_size, int start, int count, int T, Rng& rng) {
    if (count > T) fail("sampling: %d tokens need a context of at least %d", count, count);
    // tokens[0] is the start token; the logits at position t-1 < T give token t, so up to T tokens fit
    std::vector<int> tokens(T + 1, start);
    for (int t = 1; t <= count; t++) {
        // causal attention: positions after t-1 do not influence the logits at t-1, so padding them is harmless
        std::vector<float> row = logits_at(tokens.data(), t - 1);
        const float* logits = row.data();
        float lse = logsumexp_row(logits, vocab_size);
        float coin = rng.uniform(), cdf = 0.0f;
        int next = vocab_size - 1;
        for (int v = 0; v < vocab_size; v++) {
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
