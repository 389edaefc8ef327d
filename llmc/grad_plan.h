// What each gradient of a rank's share needs besides data parallelism's reduction, and where the gradient norm
// counts it: read from the model table once, when the runtime starts, so that llmc/zero.cuh's DataParallel
// moves buckets, shards and the optimizer and asks this plan the rest.
//
// A rank's share is its tensor-parallel share of its pipeline stage's part of the model (llmc/model_table.h).
// Its gradients differ in three ways the table says:
//   partial over tp  a tp rank's gradient is only its rows' or heads' contribution, completed by summing over
//                    the tp ranks that hold the tensor before dp reduces it: the tensors TPGrad marks (under
//                    sequence parallelism the norms' and wpe's; QK-norm's always: over the whole group) and the
//                    key/value heads several ranks hold when tp exceeds them (each rank's query heads' share:
//                    over the ranks holding that head);
//   held twice       the same element on several ranks, which the global norm counts once: on the lowest tp
//                    rank holding it (the replicated tensors, the shared key/value heads), and on the first
//                    stage for the tied embeddings the last stage holds a copy of (whose gradients the two sum,
//                    so both copies take one update);
//   an expert's      reduced and sharded over the expert replicas, not the dp group (TensorSpec::expert; the
//                    bucket layout groups them apart).
#pragma once

#include <algorithm>
#include <vector>

#include "llmc/model_table.h"

struct GradientPlan {
    // a range of the share whose gradient is a partial sum over `ranks` consecutive tp ranks (0: the whole group)
    struct Partial {
        size_t offset, count;
        int ranks;
    };
    std::vector<Partial> tp_partials;            // in offset order, disjoint
    std::vector<ShareRange> counted_elsewhere;   // merged, in offset order: what the norm leaves out here

    // calls f(offset, count, ranks) for each part of [offset, offset + count) of the share that is a partial sum
    template <typename F>
    void for_each_partial(size_t offset, size_t count, F&& f) const {
        auto it = std::upper_bound(tp_partials.begin(), tp_partials.end(), offset,
                                   [](size_t x, const Partial& p) { return x < p.offset; });
        if (it != tp_partials.begin()) --it;
        for (; it != tp_partials.end() && it->offset < offset + count; ++it) {
            size_t a = std::max(offset, it->offset), b = std::min(offset + count, it->offset + it->count);
            if (a < b) f(a, b - a, it->ranks);
        }
    }
    // the parts of [offset, offset + count) the gradient norm counts on this rank
    std::vector<ShareRange> counted(size_t offset, size_t count) const {
        std::vector<ShareRange> kept;
        size_t at = offset, end = offset + count;
        auto it = std::upper_bound(counted_elsewhere.begin(), counted_elsewhere.end(), at,
                                   [](size_t x, const ShareRange& r) { return x < r.offset; });
        if (it != counted_elsewhere.begin()) --it;
        for (; at < end && it != counted_elsewhere.end() && it->offset < end; ++it) {
            if (it->offset + it->count <= at) continue;
            if (it->offset > at) kept.push_back({at, it->offset - at});
            at = it->offset + it->count;
        }
        if (at < end) kept.push_back({at, end - at});
        return kept;
    }
};

// The plan of one rank's share: sizes are its tensors' sizes (the share's layout, tensor after tensor), tp and
// tp_rank its tensor-parallel group and place in it, sp whether sequence parallelism is on, embedding_copy
// whether it is a later stage's copy of the tied embeddings.
inline GradientPlan gradient_plan(const ModelTable& table, const size_t sizes[NUM_PARAM_TENSORS], int tp, int tp_rank,
                                  bool sp, bool embedding_copy) {
    GradientPlan plan;
    std::vector<ShareRange> elsewhere = repeated_ranges(table, sizes, tp, tp_rank);
    for (size_t t = 0, offset = 0; t < NUM_PARAM_TENSORS; offset += sizes[t++]) {
        const TensorSpec& s = table[t];
        if (sizes[t] == 0) continue;
        if (tp > 1 && s.partial_over_tp(sp)) plan.tp_partials.push_back({offset, sizes[t], 0});
        if (tp > 1)
            s.for_each_shared(sizes[t], tp, [&](size_t at, size_t count, int ranks) {
                plan.tp_partials.push_back({offset + at, count, ranks});
            });
        if (embedding_copy && s.holder == Holder::Embeddings) elsewhere.push_back({offset, sizes[t]});
    }
    plan.counted_elsewhere = merged_ranges(elsewhere);
    return plan;
}
