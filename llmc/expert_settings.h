// The experts' training settings (--moe-aux, --moe-bias-rate, --moe-aux-scope) and their defaults, written once:
// the options start from them (llmc/options.h) and the routing holds them (llmc/moe.cuh), so a model the tests
// build without options trains as the trainer's defaults do. A header of its own because the options are
// host-only and the routing is CUDA: both include this.
#pragma once

// where the aux loss's f comes from: each sequence's assignments, or the batch's (llmc/moe.cuh's top says how)
enum class AuxScope { Sequence, Batch };

struct ExpertSettings {
    float aux_weight = 0.01f;  // α: the load-balancing loss's weight
    float bias_rate = 0.001f;  // γ: the selection bias's step per update (DeepSeek-V3's)
    AuxScope aux_scope = AuxScope::Sequence;
};
