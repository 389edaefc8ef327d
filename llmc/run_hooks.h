// RunHooks: what the step loop of train_gpt does besides training, at named points (before a step, after it, at
// an eval, at the end of the run), so that the loop reads as the training it is. Two things live here:
//   - the test aids of the --debug-* flags (llmc/options.h), each a fault or a dump the tests need and a run never
//     asks for: a rank that stops answering before the first step (--debug-stall-rank), a SIGTERM to the last
//     rank during a step (--debug-sigterm-step), NaN gradients on rank 0 (--debug-nan-step), every eval
//     example's scores to a file (--debug-eval-scores), and the replicas compared across tp and the pipeline's
//     stages at the end (--debug-check-replicas);
//   - the bytes each process group sent in a step (the counters of llmc/comm.cuh, read before and after it), which
//     the first step prints beside the planner's formulas.
// train() installs one from the options; with no --debug-* flag every hook but the counters does nothing.
#pragma once

#include <math.h>
#include <signal.h>
#include <unistd.h>

#include <string>

#include "llmc/evals.h"
#include "llmc/grid.cuh"
#include "llmc/options.h"
#include "llmc/utils.h"

// what this rank has sent on each group: dp is the gradient reductions' group (dp·cp, and under ep the experts'
// replicas too)
struct BytesSent {
    double dp = 0.0, tp = 0.0, cp = 0.0, pp = 0.0, ep = 0.0;
};

inline BytesSent bytes_sent(Grid& grid) {
    return BytesSent{grid.dp_cp().bytes_sent + (grid.ep > 1 ? grid.expert_replicas().bytes_sent : 0.0),
                     grid.tp_comm.bytes_sent, grid.cp_comm.bytes_sent, grid.pp_comm.bytes_sent, grid.ep_comm.bytes_sent};
}

struct RunHooks {
    const Options& o;
    Grid& grid;
    BytesSent at_start;  // the counters before the step

    // before a step's first micro-batch is read
    void before_step(int step, bool first) {
        if (first && grid.rank == o.debug_stall_rank) sleep(1000000);
        if (step == o.debug_sigterm_step && grid.rank == grid.world - 1) raise(SIGTERM);
        at_start = bytes_sent(grid);
    }
    // the gradient of the loss that backward starts from
    float loss_gradient(int step, float dloss) const {
        return step == o.debug_nan_step && grid.rank == 0 ? NAN : dloss;
    }
    // after the update: what the step sent on each group
    BytesSent after_step() {
        BytesSent now = bytes_sent(grid);
        return BytesSent{now.dp - at_start.dp, now.tp - at_start.tp, now.cp - at_start.cp, now.pp - at_start.pp,
                         now.ep - at_start.ep};
    }
    // on rank 0, after the eval is scored
    void at_eval(const EvalSet& set, const EvalResult& r) const {
        if (o.debug_eval_scores.empty()) return;
        std::string text = eval_score_lines(set, r);
        File f(o.debug_eval_scores, "w");
        f.write(text.data(), text.size());
        f.close();
    }
    // after the last step, on every rank: check_replicas is a collective that fails in one line on a difference
    template <typename Check>
    void at_end(Check check_replicas) const {
        if (o.debug_check_replicas && (grid.tp > 1 || grid.pp > 1)) check_replicas();
    }
};
