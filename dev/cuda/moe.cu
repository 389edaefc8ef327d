// moe: the mixture-of-experts layer's kernels of llmc/moe.cuh, each checked against the header's CPU overload of
// the same name. First the routing (dev/cuda/routing_case.h: the experts, gates, capacity flags, dispatch order
// and ep permutation equal to the CPU's bit for bit, the router's logit gradients to 1e-5), then the data
// movement (outputs poisoned first) on d12's layer (BT = 4096 tokens, C = 768, E = 8 experts, top K = 2) and an
// odd one (BT = 77, C = 48, E = 4, K = 3), timed on the first against the copy bandwidth:
//   router_forward   logits (fp32) = x · Wrᵀ
//   router_backward  dx += dlogits · Wr (bf16, and with dx null), dWr += dlogitsᵀ · x (bf16)
//   gather_rows      the tokens' rows into dispatch order (token_of_row)
//   moe_combine      out[t] = Σ_k gate[t,k] · rows[row_of[t,k]] (with the gates, and with weight null: 1; and
//                    accumulating: the sum starts from out[t], as a shared expert's output)
//   moe_spread       rows[row_of[t,k]] = gate[t,k] · dout[t] (and with row_of null: row t, the shared expert's
//                    gate scaling its output gradient)
//   moe_gate_grads   dgate[t,k] = dout[t] · rows[row_of[t,k]] (fp32; and with row_of null, the shared gate's dot)
//   add_scaled_rows  out[t] += scale[t] · rows[t] (the gated shared expert's output added)
// The routing (row_of, token_of_row, the gates) is llmc/moe.cuh's own route_tokens() on random logits, so
// row_of and token_of_row are a real permutation of the K·BT rows (checked first), as in training.
//
// Tolerances (compare_rms: relative to each element, with the reference's RMS as the absolute floor):
//   bf16 outputs, 1e-2: the kernels compute in fp32 on the same bf16 inputs the CPU sees and round once to
//     bf16 (half an ulp: relative error ≤ 2⁻⁸ ≈ 4e-3); the fp32 sums in another order differ by ~1e-6
//     relative. So a correct kernel uses ≤ 0.4 of the allowance (0.3 in a host emulation of the kernels' order
//     and rounding on these inputs), while a wrong row, a missed slot or a lost += is an O(1) error.
//   fp32 outputs (logits, dgate), 1e-4: bf16·bf16 products are exact in fp32, so only the order of the C-term
//     sums differs (a warp's strided partials and a shuffle tree against the CPU's serial loop): ~√C·2⁻²⁴ of
//     the terms' scale, ~1e-6 of the RMS at C = 768 (0.007 of the allowance in the host emulation). One channel
//     missed out of 768 is ~3e-2.
//   gather_rows is a copy: exact.
// The accumulated (+=) gradients start from random values of the increments' scale, so a lost or doubled
// increment shows.
//
// The header's kernels run on main_stream() (llmc/device.cuh), a non-blocking stream that the legacy default
// stream (common.h's cudaMemset poisoning, cudaMemcpy up- and downloads) does not order against: every launch
// here is bracketed by device synchronizations, and the timings record their events on main_stream().
#include "dev/cuda/common.h"
#include "dev/cuda/routing_case.h"
#include "llmc/moe.cuh"

// ------------------------------------------------------------------------------------------------------------
// common.h's median_ms with the events on main_stream(), where llmc's kernels run (a non-blocking stream, which
// the legacy default stream does not wait for)
template <typename F>
static float median_ms_main(F&& f, int sets) {
    cuda_check(cudaDeviceSynchronize());
    return median_ms(f, sets, 30, main_stream());
}

// report_memory_bound's line, the time in µs (these kernels take a few to a few tens of them)
static void report_us(const std::string& what, float ms, double bytes) {
    double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("%-44s %9.2f us %8.1f GB/s  %5.1f%% of copy bandwidth (%.0f GB/s)\n", what.c_str(), ms * 1e3, gbs,
           100.0 * gbs / copy_bandwidth_gbs(), copy_bandwidth_gbs());
}

// ------------------------------------------------------------------------------------------------------------
// one layer's inputs, routing and CPU reference

struct MoECase {
    long BT;
    int C, E, K;
    long R;  // K·BT rows in dispatch order
    struct {
        std::vector<int> expert, row_of, token_of_row, counts;
        std::vector<float> gate, probs;
    } route;  // the CPU model's routing of random logits
    // inputs: x (ln2's output), the router weight, dlogits, the accumulated gradients' starting values, the
    // experts' output rows (dispatch order) and the layer's output gradient
    std::vector<float> x, w, dlogits, dx0, dw0, rows, dout;
    // CPU reference
    std::vector<float> logits, dx, dw, gathered, combined, summed, spread, dgate;
    // ... of the shared expert's uses: the combine on top of dout, dout spread and dotted with x row for row under
    // the first BT gates as one gate per token, and x added to dout under them
    std::vector<float> accumulated, spread_rows, dot_rows, scaled_added;
    DeviceArray<bf16> d_x, d_w, d_dx, d_dw, d_gathered, d_rows, d_out, d_dout, d_spread;
    DeviceArray<float> d_logits, d_dlogits, d_gates, d_dgate;
    DeviceArray<int> d_row_of, d_token_of_row;

    MoECase(long BT_, int C_, int E_, int K_, uint64_t seed)
        : BT(BT_), C(C_), E(E_), K(K_), R((long)K_ * BT_), d_x(BT * C), d_w((size_t)E * C), d_dx(BT * C),
          d_dw((size_t)E * C), d_gathered(R * C), d_rows(R * C), d_out(BT * C), d_dout(BT * C), d_spread(R * C),
          d_logits(BT * E), d_dlogits(BT * E), d_gates(R), d_dgate(R), d_row_of(R), d_token_of_row(R) {
        Rng rng(seed);
        std::vector<float> routing_logits(BT * E);
        for (float& l : routing_logits) l = rng.normal(0.0f, 1.0f);
        route.expert.resize(R), route.gate.resize(R), route.probs.resize(BT * E), route.row_of.resize(R);
        route.token_of_row.resize(R), route.counts.resize(E);
        route_tokens<float>(route.expert.data(), route.gate.data(), route.probs.data(), nullptr, routing_logits.data(),
                            nullptr, BT, E, K, Routing{});
        dispatch_order<float>(route.row_of.data(), route.token_of_row.data(), route.counts.data(), route.expert.data(),
                              nullptr, BT, E, K, nullptr);

        x = random_bf16_values(BT * C, rng);
        w = random_bf16_values((size_t)E * C, rng, 0.05f);
        dlogits.resize(BT * E);
        for (float& d : dlogits) d = rng.normal(0.0f, 0.1f);  // fp32 on both sides
        // of the increments' scale: dx's is √E·0.1·0.05 ≈ 0.014, dw's √BT·0.1 (6.4 at BT = 4096)
        dx0 = random_bf16_values(BT * C, rng, 0.014f);
        dw0 = random_bf16_values((size_t)E * C, rng, 0.1f * sqrtf((float)BT));
        rows = random_bf16_values(R * C, rng);
        dout = random_bf16_values(BT * C, rng);

        upload(d_x, x);
        upload(d_w, w);
        upload(d_dlogits, dlogits);
        upload(d_rows, rows);
        upload(d_dout, dout);
        upload(d_gates, route.gate);
        upload(d_row_of, route.row_of);
        upload(d_token_of_row, route.token_of_row);
        reset_grads();

        logits.resize(BT * E);
        router_forward(logits.data(), x.data(), w.data(), BT, C, E);
        dx = dx0, dw = dw0;
        router_backward(dx.data(), dw.data(), dlogits.data(), x.data(), w.data(), BT, C, E);
        gathered.resize(R * C);
        gather_rows(gathered.data(), x.data(), route.token_of_row.data(), R, C);
        combined.resize(BT * C), summed.resize(BT * C);
        moe_combine(combined.data(), rows.data(), route.row_of.data(), route.gate.data(), BT, K, C);
        moe_combine(summed.data(), rows.data(), route.row_of.data(), (const float*)nullptr, BT, K, C);
        spread.resize(R * C);
        moe_spread(spread.data(), dout.data(), route.row_of.data(), route.gate.data(), BT, K, C);
        dgate.resize(R);
        moe_gate_grads(dgate.data(), dout.data(), rows.data(), route.row_of.data(), BT, K, C);
        accumulated = dout;
        moe_combine(accumulated.data(), rows.data(), route.row_of.data(), route.gate.data(), BT, K, C, true);
        spread_rows.resize(BT * C);
        moe_spread(spread_rows.data(), dout.data(), (const int*)nullptr, route.gate.data(), BT, 1, C);
        dot_rows.resize(BT);
        moe_gate_grads(dot_rows.data(), dout.data(), x.data(), (const int*)nullptr, BT, 1, C);
        scaled_added = dout;
        add_scaled_rows(scaled_added.data(), x.data(), route.gate.data(), BT, C);
    }
    void reset_grads() {
        upload(d_dx, dx0);
        upload(d_dw, dw0);
    }
    // row_of and token_of_row: each (t, k) has its own row, which carries token t
    bool routing_is_a_permutation() const {
        std::vector<int> seen(R, 0);
        for (long tk = 0; tk < R; tk++) {
            int row = route.row_of[tk];
            if (row < 0 || row >= R || seen[row]++ || route.token_of_row[row] != tk / K) return false;
        }
        return true;
    }
};

static void check_shape(Checks& checks, MoECase& k) {
    if (!have_gpu()) return;
    long BT = k.BT, R = k.R;
    int C = k.C, E = k.E, K = k.K;
    std::string v = strfmt("BT=%ld C=%d E=%d K=%d ", BT, C, E, K);
    checks.require(v + "route_tokens: row_of a permutation", k.routing_is_a_permutation());

    on_main_stream([&] { router_forward(k.d_logits.ptr, k.d_x.ptr, k.d_w.ptr, BT, C, E); });
    checks.check(v + "router_forward logits", download(k.d_logits), k.logits, 1e-4);

    k.reset_grads();
    on_main_stream([&] { router_backward(k.d_dx.ptr, k.d_dw.ptr, k.d_dlogits.ptr, k.d_x.ptr, k.d_w.ptr, BT, C, E); });
    std::vector<float> dw = download(k.d_dw);
    checks.check(v + "router_backward dx (+=)", download(k.d_dx), k.dx, 1e-2);
    checks.check(v + "router_backward dw (+=)", dw, k.dw, 1e-2);
    k.reset_grads();
    on_main_stream([&] { router_backward((bf16*)nullptr, k.d_dw.ptr, k.d_dlogits.ptr, k.d_x.ptr, k.d_w.ptr, BT, C, E); });
    std::vector<float> dw_alone = download(k.d_dw);
    checks.check(v + "router_backward dx null: dw (+=)", dw_alone, k.dw, 1e-2);
    checks.require(v + "router_backward dx null: dw, the same bits", dw_alone == dw);
    checks.require(v + "router_backward dx null: dx untouched", download(k.d_dx) == k.dx0);

    k.d_gathered.poison();
    on_main_stream([&] { gather_rows(k.d_gathered.ptr, k.d_x.ptr, k.d_token_of_row.ptr, R, C); });
    checks.check(v + "gather_rows (exact)", download(k.d_gathered), k.gathered, 0.0);

    k.d_out.poison();
    on_main_stream([&] { moe_combine(k.d_out.ptr, k.d_rows.ptr, k.d_row_of.ptr, k.d_gates.ptr, BT, K, C); });
    checks.check(v + "moe_combine with gates", download(k.d_out), k.combined, 1e-2);
    k.d_out.poison();
    on_main_stream([&] { moe_combine(k.d_out.ptr, k.d_rows.ptr, k.d_row_of.ptr, (const float*)nullptr, BT, K, C); });
    checks.check(v + "moe_combine weight null", download(k.d_out), k.summed, 1e-2);

    k.d_spread.poison();  // every row must be written: a row left out stays NaN
    on_main_stream([&] { moe_spread(k.d_spread.ptr, k.d_dout.ptr, k.d_row_of.ptr, k.d_gates.ptr, BT, K, C); });
    checks.check(v + "moe_spread", download(k.d_spread), k.spread, 1e-2);

    k.d_dgate.poison();
    on_main_stream([&] { moe_gate_grads(k.d_dgate.ptr, k.d_dout.ptr, k.d_rows.ptr, k.d_row_of.ptr, BT, K, C); });
    checks.check(v + "moe_gate_grads dgate", download(k.d_dgate), k.dgate, 1e-4);

    // the shared expert's: the first BT of the K·BT gates stand for one gate per token
    upload(k.d_out, k.dout);
    on_main_stream([&] { moe_combine(k.d_out.ptr, k.d_rows.ptr, k.d_row_of.ptr, k.d_gates.ptr, BT, K, C, true); });
    checks.check(v + "moe_combine accumulating", download(k.d_out), k.accumulated, 1e-2);
    k.d_spread.poison();
    on_main_stream([&] { moe_spread(k.d_spread.ptr, k.d_dout.ptr, (const int*)nullptr, k.d_gates.ptr, BT, 1, C); });
    std::vector<float> spread_rows = download(k.d_spread);
    spread_rows.resize(BT * C);
    checks.check(v + "moe_spread row_of null", spread_rows, k.spread_rows, 1e-2);
    k.d_dgate.poison();
    on_main_stream([&] { moe_gate_grads(k.d_dgate.ptr, k.d_dout.ptr, k.d_x.ptr, (const int*)nullptr, BT, 1, C); });
    std::vector<float> dots = download(k.d_dgate);
    dots.resize(BT);
    checks.check(v + "moe_gate_grads row_of null", dots, k.dot_rows, 1e-4);
    upload(k.d_out, k.dout);
    on_main_stream([&] { add_scaled_rows(k.d_out.ptr, k.d_x.ptr, k.d_gates.ptr, BT, C); });
    checks.check(v + "add_scaled_rows", download(k.d_out), k.scaled_added, 1e-2);
}

// Each timed call cycles through its own copies of the BT×C and K·BT×C activations (the router weight, its
// gradient and the routing are small and shared). The bytes are those the kernel must move at the least: each
// input row read once, each output written once (read too where it accumulates), the fp32 logits, gates and
// int indices included; what a kernel reads again (x by each expert's warps in router_forward, a token's row
// by its K slots in gather_rows and moe_spread) comes from L2 and is not counted.
static void time_shape(MoECase& k) {
    if (!have_gpu()) return;
    long BT = k.BT, R = k.R;
    int C = k.C, E = k.E, K = k.K;
    std::string v = strfmt("BT=%ld C=%d E=%d K=%d", BT, C, E, K);
    const double act = 2.0 * BT * C, rows = 2.0 * R * C;  // bf16 bytes of a BT×C and a K·BT×C tensor
    const double router_w = 2.0 * E * C, logits = 4.0 * BT * E, index = 4.0 * R, gates = 4.0 * R;
    double forward_bytes = act + router_w + logits;
    double backward_bytes = 2.0 * act + act + logits + router_w + 2.0 * router_w;  // dx read + written, x, dlogits, w, dw
    double backward_dw_bytes = act + logits + 2.0 * router_w;
    double gather_bytes = act + rows + index;
    double combine_bytes = rows + act + index + gates, sum_bytes = rows + act + index;
    double spread_bytes = act + rows + index + gates, gate_grad_bytes = act + rows + index + 4.0 * R;
    int sets = timing_sets(2.0 * rows);
    TimingCopies<bf16> x(k.d_x, sets), dx(k.d_dx, sets), gathered(k.d_gathered, sets), rows_in(k.d_rows, sets),
        out(k.d_out, sets), dout(k.d_dout, sets), spread(k.d_spread, sets);
    TimingCopies<float> logit(k.d_logits, sets), dlogit(k.d_dlogits, sets), dgate(k.d_dgate, sets);
    const int *row_of = k.d_row_of.ptr, *token_of_row = k.d_token_of_row.ptr;
    const float* gate = k.d_gates.ptr;

    report_us("router_forward " + v,
              median_ms_main([&](int s) { router_forward(logit[s], x[s], k.d_w.ptr, BT, C, E); }, sets), forward_bytes);
    report_us("router_backward " + v,
              median_ms_main([&](int s) { router_backward(dx[s], k.d_dw.ptr, dlogit[s], x[s], k.d_w.ptr, BT, C, E); },
                             sets),
              backward_bytes);
    report_us("router_backward dx null " + v,
              median_ms_main(
                  [&](int s) { router_backward((bf16*)nullptr, k.d_dw.ptr, dlogit[s], x[s], k.d_w.ptr, BT, C, E); },
                  sets),
              backward_dw_bytes);
    report_us("gather_rows " + v,
              median_ms_main([&](int s) { gather_rows(gathered[s], x[s], token_of_row, R, C); }, sets), gather_bytes);
    report_us("moe_combine with gates " + v,
              median_ms_main([&](int s) { moe_combine(out[s], rows_in[s], row_of, gate, BT, K, C); }, sets),
              combine_bytes);
    report_us("moe_combine weight null " + v,
              median_ms_main([&](int s) { moe_combine(out[s], rows_in[s], row_of, (const float*)nullptr, BT, K, C); },
                             sets),
              sum_bytes);
    report_us("moe_spread " + v,
              median_ms_main([&](int s) { moe_spread(spread[s], dout[s], row_of, gate, BT, K, C); }, sets),
              spread_bytes);
    report_us("moe_gate_grads " + v,
              median_ms_main([&](int s) { moe_gate_grads(dgate[s], dout[s], rows_in[s], row_of, BT, K, C); }, sets),
              gate_grad_bytes);
}

int main() {
    Program program(
        "moe: routing, router, gather, combine, spread and gate gradients of llmc/moe.cuh against the CPU; timed");
    Checks checks;
    // the routing's kernels make the CPU's decisions (dev/cuda/routing_case.h): d12's router, under a capacity
    // of 1.25, and Qwen3-30B-A3B's (128 experts, top 8) with DeepSeek-V3's sigmoid scores and selection bias
    for (const RoutingCase& c : {RoutingCase{4, 1024, 8, 2, Routing{}, false, 1.25f, 1},
                                 RoutingCase{1, 4096, 128, 8, Routing{true, true, 2.5f}, true, 0.0f, 2}}) {
        std::vector<std::string> differences = routing_differences(c);
        for (const std::string& d : differences) printf("  %s\n", d.c_str());
        checks.require(strfmt("routing B=%d T=%ld E=%d K=%d: the CPU's decisions", c.B, c.Tl, c.E, c.K),
                       differences.empty());
    }
    MoECase d12(4096, 768, 8, 2, 11);
    check_shape(checks, d12);
    {
        MoECase odd(77, 48, 4, 3, 12);
        check_shape(checks, odd);
    }
    time_shape(d12);
    return program.finish(checks);
}
