// The ranks' side of the checks that run under mpirun as hidden cases of build/tests (comm_check.h, cp_check.h):
// each rank tallies its checks, and run_on_ranks adds the tallies over the ranks and prints them on rank 0 as
// "NAME: N ranks, P passed, F failed", the line run_check (mpi_helpers.h) reads; the case fails where any check did.
#pragma once

#include <catch.hpp>

#include <cstdio>
#include <exception>

#include "llmc/comm.cuh"

struct Tally {
    int passes = 0, failures = 0;
};

// joins the world (a minute's timeout on every wait), runs body(world), which counts into `tally`, and reports
template <typename Body>
inline void run_on_ranks(const char* name, const Tally& tally, Body body) {
    try {
        CommSettings s;
        s.timeout_s = 60;
        Comm world = comm_world(s);
        body(world);
        int counts[2] = {tally.passes, tally.failures}, totals[2];
        world.wait(world.all_reduce(counts, totals, 2, DType::I32));
        if (world.rank == 0) printf("%s: %d ranks, %d passed, %d failed\n", name, world.size, totals[0], totals[1]);
        comm_finalize(world);
        CHECK(totals[1] == 0);
    } catch (const std::exception& e) {
        fprintf(stderr, "%s: %s\n", name, e.what());
        comm_abort_job(1);  // the other ranks may be waiting on this one: end the job rather than hang it
    }
}
