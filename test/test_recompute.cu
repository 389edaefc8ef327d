// Tests of activation recomputation (-r): recomputing GELU (-r 1) and also the layernorms (-r 2) must give the
// same loss and gradients bit for bit as keeping them (the recomputation repeats forward's arithmetic exactly),
// with less activation memory, exactly as --plan predicts; under tensor and sequence parallelism too, where
// backward gathers each rank's rows of the norm outputs again, recomputed or kept.
#include <cstring>

#include "llmc/gpt.cuh"
#include "llmc/plan.h"
#include "mpi_helpers.h"
#include "test_helpers.h"

namespace test_recompute {

struct Pass {
    float loss;
    std::vector<float> grads;
    size_t activation_bytes;
};

// one forward and backward of a random model on a random batch, keeping (-r 0) or recomputing activations
Pass forward_backward(int recompute) {
    GPTConfig c = parse_model_descriptor("d3c33h3t32v301");
    const int B = 3, T = 13;
    GPT m;
    ModelLayout layout;
    layout.recompute = recompute;
    gpt_allocate(m, c, B, T, layout);
    gpt_init_random(c, m.params, 5);
    Rng rng(17);
    std::vector<int> in(B * T), out(B * T);
    for (int i = 0; i < B * T; i++) in[i] = (int)rng.below(301), out[i] = (int)rng.below(301);
    gpt_zero_grad(m);
    Pass p;
    p.loss = gpt_forward(m, in.data(), out.data(), B, T);
    gpt_backward(m, 1.0f / (B * T));
    p.grads.assign(m.grads, m.grads + m.num_parameters);
    p.activation_bytes = m.ledger.bytes[MEM_ACTIVATIONS];

    MemoryPlan plan = plan_memory(c, B, T, omp_get_max_threads(), ParallelPlan{1, 0, DEFAULT_BUCKET_FLOATS, 1, 1, false, recompute});
    for (int i = 0; i < MEM_CATEGORIES; i++) {
        INFO("-r " << recompute << ", " << mem_category_name(i));
        CHECK(plan.bytes[i] == m.ledger.bytes[i]);
    }
    return p;
}

TEST_CASE("-r 1 and -r 2 give -r 0's loss and gradients bit for bit, in less memory, as planned", "[recompute]") {
    Pass keep = forward_backward(0), gelu = forward_backward(1), both = forward_backward(2);
    CHECK(keep.loss > 0);
    CHECK(memcmp(&keep.loss, &gelu.loss, sizeof(float)) == 0);
    CHECK(memcmp(&keep.loss, &both.loss, sizeof(float)) == 0);
    REQUIRE(keep.grads.size() == gelu.grads.size());
    CHECK(memcmp(keep.grads.data(), gelu.grads.data(), keep.grads.size() * sizeof(float)) == 0);
    CHECK(memcmp(keep.grads.data(), both.grads.data(), keep.grads.size() * sizeof(float)) == 0);
    // per layer, -r 1 drops GELU's output (B·T·4C floats) and -r 2 both layernorm outputs (2·B·T·C), each kept
    // once for the layer in use: with L = 3 layers, C = 33, B·T = 39
    CHECK(keep.activation_bytes - gelu.activation_bytes == 4 * (3 - 1) * 39 * 4 * 33);
    CHECK(gelu.activation_bytes - both.activation_bytes == 4 * (2 * 3 - 1) * 39 * 33);
}

TEST_CASE("recomputation under tensor and sequence parallelism: the single-rank run's losses, -r 0, 1 and 2 bit for "
          "bit alike, the norm outputs gathered again in backward whatever -r", "[recompute]") {
    Data data;
    TempDir out;
    std::string flags = data.flags(2, 64, EQUIVALENCE_STEPS, "d3c36h4t32v301");
    REQUIRE(single_ok(flags, out / "one"));
    std::string runs[3];
    for (int r : {0, 1, 2}) {
        INFO("--tp 2 -r " << r);
        runs[r] = train(2, flags + strfmt(" --tp 2 -r %d", r), out / strfmt("r%d", r));
        check_close(losses(out / strfmt("r%d", r)), losses(out / "one"), 1e-5);
        CHECK(losses(out / strfmt("r%d", r)) == losses(out / "r0"));
        require_tp_counted_equals_formula(runs[r], 2, 1);
    }
    // each rank keeps its rows of the norm outputs and backward gathers them again, recomputed (-r 2) or kept
    CHECK(tp_comm_line(runs[2]).sent == tp_comm_line(runs[0]).sent);
}

}  // namespace test_recompute
