// comm_check: every collective of llmc/comm.cuh against a naive reference, a hidden case of build/tests that
// test/test_distributed.cu runs under mpirun on 2, 3 or 4 ranks (a case of the test binary rather than a program
// of its own, so that the build compiles it once). Each rank's input is a pure function of (op, rank, index), so any
// rank can compute what every other rank sent and check its result element by element. Values are small
// integers, so sums are exact whatever order a backend adds them in. Sizes are odd (1, 7, 1001, 65537) to catch
// off-by-one and chunking errors. Each op runs blocking, and asynchronously with compute between start and
// wait; point-to-point runs around the ring in both directions. The counted bytes are checked per op too.
// bf16 moves bit for bit, and its sums (MPI has no bf16: llmc/comm.cuh adds in fp32 and rounds) are checked.
// Last line on rank 0: "comm_check: R ranks, N passed, M failed" (ranks_check.h); the case fails if anything did.
#pragma once

#include <catch.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "llmc/comm.cuh"
#include "ranks_check.h"

namespace comm_check {

static Tally tally;

static void check(Comm& c, bool ok, const std::string& what) {
    if (ok) {
        tally.passes++;
    } else {
        tally.failures++;
        printf("rank %d: FAIL %s\n", c.rank, what.c_str());
    }
}

// the value rank r puts at index i of its input for op k: a small integer, exact in every type
static double value(int op, int r, size_t i) { return (double)((op * 131 + r * 31 + (long)(i % 977) * 7) % 61 - 30); }

template <typename T>
static std::vector<T> input(int op, int r, size_t n) {
    std::vector<T> v(n);
    for (size_t i = 0; i < n; i++) v[i] = (T)value(op, r, i);
    return v;
}

template <typename T>
static DType dtype_of();
template <>
DType dtype_of<float>() { return DType::F32; }
template <>
DType dtype_of<double>() { return DType::F64; }
template <>
DType dtype_of<int>() { return DType::I32; }

// busy work between start and wait, so an async op is known to overlap with something
static double compute_a_little() {
    double s = 0.0;
    for (int i = 1; i < 200000; i++) s += 1.0 / i;
    return s;
}

// starts an op, optionally computes, then waits for it
static void finish(Comm& c, CommRequest r, bool async) {
    if (async) {
        volatile double x = compute_a_little();
        (void)x;
        c.test(r);
    }
    c.wait(r);
}

template <typename T>
static void check_collectives(Comm& c, size_t n, bool async) {
    const int R = c.size, me = c.rank;
    const DType t = dtype_of<T>();
    const size_t es = sizeof(T);
    std::string tag = strfmt("%s n=%zu %s", dtype_name(t), n, async ? "async" : "blocking");

    // all_reduce, out of place and in place
    for (int in_place = 0; in_place < 2; in_place++) {
        std::vector<T> send = input<T>(1, me, n), recv(n, (T)-999);
        double before = c.bytes_sent;
        finish(c, c.all_reduce(send.data(), in_place ? send.data() : recv.data(), n, t), async);
        const std::vector<T>& got = in_place ? send : recv;
        bool ok = true;
        for (size_t i = 0; i < n && ok; i++) {
            double want = 0;
            for (int r = 0; r < R; r++) want += value(1, r, i);
            ok = (double)got[i] == want;
        }
        check(c, ok, "all_reduce " + tag + (in_place ? " in place" : ""));
        check(c, fabs(c.bytes_sent - before - 2.0 * (R - 1) / R * n * es) < 1e-6, "all_reduce bytes " + tag);
    }
    // reduce_scatter: rank r gets the sum of everyone's piece r
    {
        std::vector<T> send = input<T>(2, me, n * R), recv(n, (T)-999);
        double before = c.bytes_sent;
        finish(c, c.reduce_scatter(send.data(), recv.data(), n, t), async);
        bool ok = true;
        for (size_t i = 0; i < n && ok; i++) {
            double want = 0;
            for (int r = 0; r < R; r++) want += value(2, r, me * n + i);
            ok = (double)recv[i] == want;
        }
        check(c, ok, "reduce_scatter " + tag);
        check(c, fabs(c.bytes_sent - before - (double)(R - 1) / R * n * R * es) < 1e-6, "reduce_scatter bytes " + tag);
    }
    // all_gather
    {
        std::vector<T> send = input<T>(3, me, n), recv(n * R, (T)-999);
        finish(c, c.all_gather(send.data(), recv.data(), n, t), async);
        bool ok = true;
        for (int r = 0; r < R; r++)
            for (size_t i = 0; i < n && ok; i++) ok = (double)recv[r * n + i] == value(3, r, i);
        check(c, ok, "all_gather " + tag);
    }
    // broadcast from every root
    for (int root = 0; root < R; root++) {
        std::vector<T> buf = me == root ? input<T>(4, root, n) : std::vector<T>(n, (T)-999);
        finish(c, c.broadcast(buf.data(), n, t, root), async);
        bool ok = true;
        for (size_t i = 0; i < n && ok; i++) ok = (double)buf[i] == value(4, root, i);
        check(c, ok, strfmt("broadcast root %d ", root) + tag);
    }
    // send/recv around the ring, both directions
    for (int dir : {+1, -1}) {
        int to = (me + dir + R) % R, from = (me - dir + R) % R;
        std::vector<T> send = input<T>(5, me, n), recv(n, (T)-999);
        CommRequest rr = c.recv(recv.data(), n, t, from);
        CommRequest sr = c.send(send.data(), n, t, to);
        finish(c, sr, async);
        finish(c, rr, async);
        bool ok = true;
        for (size_t i = 0; i < n && ok; i++) ok = (double)recv[i] == value(5, from, i);
        check(c, ok, strfmt("send/recv direction %+d ", dir) + tag);
    }
    // all_to_all: rank r's piece j goes to rank j's piece r
    {
        std::vector<T> send = input<T>(6, me, n * R), recv(n * R, (T)-999);
        finish(c, c.all_to_all(send.data(), recv.data(), n, t), async);
        bool ok = true;
        for (int r = 0; r < R; r++)
            for (size_t i = 0; i < n && ok; i++) ok = (double)recv[r * n + i] == value(6, r, me * n + i);
        check(c, ok, "all_to_all " + tag);
    }
    // all_to_allv: rank r sends (r + j + 1)·n/3 + 1 elements to rank j, packed in rank order
    {
        auto count = [&](int from, int to) { return (size_t)(from + to + 1) * (n / 3) + 1; };
        std::vector<size_t> sc(R), so(R), rc(R), ro(R);
        size_t stotal = 0, rtotal = 0;
        for (int j = 0; j < R; j++) {
            sc[j] = count(me, j), so[j] = stotal, stotal += sc[j];
            rc[j] = count(j, me), ro[j] = rtotal, rtotal += rc[j];
        }
        // element k of the block for rank j carries value(7, me, j * 100003 + k)
        std::vector<T> send(stotal), recv(rtotal, (T)-999);
        for (int j = 0; j < R; j++)
            for (size_t k = 0; k < sc[j]; k++) send[so[j] + k] = (T)value(7, me, j * 100003 + k);
        finish(c, c.all_to_allv(send.data(), sc.data(), so.data(), recv.data(), rc.data(), ro.data(), t), async);
        bool ok = true;
        for (int j = 0; j < R; j++)
            for (size_t k = 0; k < rc[j] && ok; k++) ok = (double)recv[ro[j] + k] == value(7, j, me * 100003 + k);
        check(c, ok, "all_to_allv " + tag);
    }
}

// several ops in flight at once, waited for in the reverse order of their start
static void check_overlapped(Comm& c, size_t n) {
    const int R = c.size, me = c.rank;
    std::vector<float> a = input<float>(8, me, n), b = input<float>(9, me, n), gathered(n * R);
    std::vector<float> scattered_in = input<float>(10, me, n * R), scattered(n);
    CommRequest r1 = c.all_reduce(a.data(), a.data(), n, DType::F32);
    CommRequest r2 = c.all_gather(b.data(), gathered.data(), n, DType::F32);
    CommRequest r3 = c.reduce_scatter(scattered_in.data(), scattered.data(), n, DType::F32);
    volatile double x = compute_a_little();
    (void)x;
    c.wait(r3);
    c.wait(r2);
    c.wait(r1);
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        double s1 = 0, s3 = 0;
        for (int r = 0; r < R; r++) s1 += value(8, r, i), s3 += value(10, r, me * n + i);
        ok = a[i] == s1 && scattered[i] == s3;
        for (int r = 0; r < R && ok; r++) ok = gathered[r * n + i] == value(9, r, i);
    }
    check(c, ok, strfmt("three ops in flight, n=%zu", n));
}

// bf16 moves as raw 16-bit words: gathered and broadcast bit for bit
static void check_bf16(Comm& c, size_t n) {
    const int R = c.size, me = c.rank;
    std::vector<uint16_t> send(n), recv(n * R);
    for (size_t i = 0; i < n; i++) send[i] = (uint16_t)(me * 40503u + i * 2654435761u);
    c.wait(c.all_gather(send.data(), recv.data(), n, DType::BF16));
    bool ok = true;
    for (int r = 0; r < R; r++)
        for (size_t i = 0; i < n && ok; i++) ok = recv[r * n + i] == (uint16_t)(r * 40503u + i * 2654435761u);
    check(c, ok, strfmt("bf16 all_gather n=%zu", n));

    // sums: small integers are exact in bf16 whatever the order, so all_reduce and reduce_scatter must match
    std::vector<uint16_t> piece(n * R), summed(n * R), mine(n);
    for (size_t i = 0; i < n * R; i++) piece[i] = float_to_bf16_bits((float)value(11, me, i));
    c.wait(c.all_reduce(piece.data(), summed.data(), n * R, DType::BF16));
    c.wait(c.reduce_scatter(piece.data(), mine.data(), n, DType::BF16));
    bool all_ok = true, scatter_ok = true;
    for (size_t i = 0; i < n * R; i++) {
        double want = 0;
        for (int r = 0; r < R; r++) want += value(11, r, i);
        all_ok = all_ok && bf16_bits_to_float(summed[i]) == want;
        if (i / n == (size_t)me) scatter_ok = scatter_ok && mine[i - me * n] == summed[i];
    }
    check(c, all_ok, strfmt("bf16 all_reduce n=%zu", n * R));
    check(c, scatter_ok, strfmt("bf16 reduce_scatter n=%zu", n));
    // with two ranks, a sum that falls halfway between two bf16 values rounds to the even one: 1 + 2^-8 to 1,
    // and (1 + 2^-7) + 2^-8 up to 1 + 2^-6
    if (R == 2) {
        uint16_t tie[2] = {float_to_bf16_bits(me == 0 ? 1.0f : 0.00390625f),
                           float_to_bf16_bits(me == 0 ? 1.0078125f : 0.00390625f)}, got[2];
        c.wait(c.all_reduce(tie, got, 2, DType::BF16));
        check(c, got[0] == float_to_bf16_bits(1.0f) && got[1] == float_to_bf16_bits(1.015625f), "bf16 sums round to nearest even");
    }
}

TEST_CASE("comm_check: the ranks' side, run under mpirun by run_check (mpi_helpers.h)", "[.comm_check]") {
    run_on_ranks("comm_check", tally, [](Comm& world) {
        for (size_t n : {1, 7, 1001, 65537})
            for (bool async : {false, true}) {
                check_collectives<float>(world, n, async);
                check_collectives<double>(world, n, async);
                check_collectives<int>(world, n, async);
            }
        check_overlapped(world, 1001);
        check_bf16(world, 7);
        world.wait(world.barrier());
        // a group: the even and the odd ranks, checked like the world
        Comm half = world.split(world.rank % 2, world.rank, "half");
        check(world, half.size == (world.size + 1 - world.rank % 2) / 2 && half.rank == world.rank / 2, "split sizes");
        if (half.size > 1) check_collectives<float>(half, 1001, true);
    });
}

}  // namespace comm_check
