// The process grid: how the world's ranks are laid out over the five kinds of parallelism, and a communicator
// for each. tp is fastest (the ranks of a tensor-parallel group share a node), then cp, then dp, then pp:
//
//     world rank = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank)),   dp = world / (tp·cp·pp)
//
// Expert parallelism is carved out of dp: the dp ranks of one pipeline stage form dp/ep groups of ep
// consecutive dp ranks each (ep_rank = dp_rank mod ep).
//
// The ranks of a cp group hold the same parameters and see other tokens of the same sequences, so the
// gradients are reduced (and ZeRO shards its states) over dp × cp: the ranks that share tp and pp coordinates,
// numbered cp fastest (Megatron-LM's data-parallel group with context parallelism). Under expert parallelism a
// rank holds only E/ep of each layer's experts, so the expert tensors' gradients are reduced (and sharded) over
// the expert replicas alone: the dp × cp ranks that share tp, pp and ep_rank (dp/ep · cp ranks, cp fastest).
#pragma once

#include <string>

#include "llmc/comm.cuh"

struct GridShape {
    int tp = 1, cp = 1, pp = 1, ep = 1;
};

struct GridCoords {
    int tp, cp, dp, pp, ep;
};

struct Grid {
    int world = 1, rank = 0;
    int tp = 1, cp = 1, dp = 1, pp = 1, ep = 1;
    GridCoords at;  // this rank's coordinates
    Comm world_comm, tp_comm, cp_comm, dp_comm, pp_comm, ep_comm;
    Comm dp_cp_comm;  // only with cp > 1: without, dp_cp() is the dp group itself
    Comm tp_cp_comm;  // only with tp > 1 and cp > 1: without, tp_cp() is the tp or the cp group itself
    Comm tied_comm;   // only with pp > 1, on the first and the last pp rank: the two that hold the embeddings, looped
    Comm expert_dp_comm;  // only with ep > 1: the ranks that hold the same experts

    // the group that reduces gradients and shards the optimizer: dp × cp
    Comm& dp_cp() { return cp > 1 ? dp_cp_comm : dp_comm; }
    int dp_cp_rank() const { return at.cp + cp * at.dp; }
    // the ranks that hold pieces of the same micro-batch's tensors: tp × cp, tp fastest (FP8's amax group)
    Comm& tp_cp() { return tp > 1 && cp > 1 ? tp_cp_comm : cp > 1 ? cp_comm : tp_comm; }
    // the group that reduces the expert tensors' gradients: dp × cp itself without expert parallelism
    Comm& expert_replicas() { return ep > 1 ? expert_dp_comm : dp_cp(); }
};

// dp for a world size, or one line naming the flag that does not fit
inline int grid_dp(int world, const GridShape& s) {
    if (s.tp < 1 || s.cp < 1 || s.pp < 1 || s.ep < 1) fail("--tp --cp --pp --ep: every size must be at least 1");
    long model_ranks = (long)s.tp * s.cp * s.pp;
    if (world % model_ranks != 0)
        fail("--tp %d --cp %d --pp %d: the world of %d ranks is not divisible by tp·cp·pp = %ld", s.tp, s.cp, s.pp, world,
             model_ranks);
    int dp = (int)(world / model_ranks);
    if (dp % s.ep != 0) fail("--ep %d: must divide the data-parallel size %d (world %d / tp·cp·pp %ld)", s.ep, dp, world, model_ranks);
    return dp;
}

inline GridCoords grid_coords(int rank, const GridShape& s, int dp) {
    GridCoords c;
    c.tp = rank % s.tp;
    c.cp = rank / s.tp % s.cp;
    c.dp = rank / (s.tp * s.cp) % dp;
    c.pp = rank / (s.tp * s.cp * dp);
    c.ep = c.dp % s.ep;
    return c;
}

inline int grid_rank(const GridCoords& c, const GridShape& s, int dp) {
    return c.tp + s.tp * (c.cp + s.cp * (c.dp + dp * c.pp));
}

// A rank's place among its expert replicas: the group's color (the world rank of its first member: dp_rank =
// ep_rank, cp_rank 0) and the rank's key in it (cp fastest, then dp_rank / ep)
struct GroupPlace {
    int color, key;
};
inline GroupPlace expert_replica_place(const GridCoords& c, const GridShape& s, int dp) {
    GridCoords first = c;
    first.cp = 0, first.dp = c.ep;
    return {grid_rank(first, s, dp), c.cp + s.cp * (c.dp / s.ep)};
}

// Splits the world into its groups. Each group's color is the rank's position along every other dimension,
// and its key the position along its own, so a group's ranks are numbered by that coordinate.
inline Grid make_grid(Comm& world, const GridShape& s) {
    Grid g;
    g.world = world.size;
    g.rank = world.rank;
    g.tp = s.tp, g.cp = s.cp, g.pp = s.pp, g.ep = s.ep;
    g.dp = grid_dp(world.size, s);
    GridCoords c = g.at = grid_coords(world.rank, s, g.dp);
    auto without = [&](GridCoords x, int GridCoords::*field) {
        x.*field = 0;
        return grid_rank(x, s, g.dp);
    };
    g.world_comm = world;
    g.tp_comm = world.split(without(c, &GridCoords::tp), c.tp, "tp");
    g.cp_comm = world.split(without(c, &GridCoords::cp), c.cp, "cp");
    g.dp_comm = world.split(without(c, &GridCoords::dp), c.dp, "dp");
    g.pp_comm = world.split(without(c, &GridCoords::pp), c.pp, "pp");
    if (s.cp > 1) {
        GridCoords first = c;
        first.cp = first.dp = 0;
        g.dp_cp_comm = world.split(grid_rank(first, s, g.dp), g.dp_cp_rank(), "dp_cp");
    }
    if (s.tp > 1 && s.cp > 1) {
        GridCoords first = c;
        first.tp = first.cp = 0;
        g.tp_cp_comm = world.split(grid_rank(first, s, g.dp), c.tp + s.tp * c.cp, "tp_cp");
    }
    // the tied embeddings' pair: the first and the last pp rank, the first and the last stage of a looped
    // schedule (the middle stages, each alone, never use theirs; under DualPipeV's V rank 0 runs both ends with
    // one copy, and no rank uses it)
    if (s.pp > 1) {
        bool holds_embeddings = c.pp == 0 || c.pp == s.pp - 1;
        g.tied_comm = world.split(holds_embeddings ? without(c, &GridCoords::pp) : world.size + world.rank, c.pp, "tied");
    }
    // an ep group: the dp ranks that share dp_rank / ep
    GridCoords e = c;
    e.dp = c.dp / s.ep * s.ep;
    g.ep_comm = world.split(grid_rank(e, s, g.dp), c.ep, "ep");
    if (s.ep > 1) {
        GroupPlace x = expert_replica_place(c, s, g.dp);
        g.expert_dp_comm = world.split(x.color, x.key, "expert_dp");
    }
    return g;
}
