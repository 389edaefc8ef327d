// Learning-rate schedules: linear warmup over the first `warmup` steps, then cosine (llm.c's default), linear,
// or constant, decaying from lr to lr * final_fraction at step total_steps (steps run 0 .. total_steps-1, so
// the last one trains just above the floor, as in llm.c).
#pragma once

#include <cmath>
#include <string>

#include "llmc/utils.h"

struct LRSchedule {
    std::string kind = "cosine";
    float lr = 3e-4f;
    int warmup = 0;
    int total_steps = 1;
    float final_fraction = 1.0f;

    static bool known(const std::string& k) { return k == "cosine" || k == "linear" || k == "constant"; }

    float at(int step) const {
        if (step < warmup) return lr * (step + 1) / warmup;
        if (kind == "constant") return lr;
        float min_lr = lr * final_fraction;
        float progress = total_steps > warmup ? (float)(step - warmup) / (float)(total_steps - warmup) : 1.0f;
        if (progress > 1.0f) progress = 1.0f;
        float coeff = kind == "cosine" ? 0.5f * (1.0f + cosf((float)M_PI * progress)) : 1.0f - progress;
        return min_lr + coeff * (lr - min_lr);
    }
};
