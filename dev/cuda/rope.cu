// rope_forward_cuda and rope_backward_cuda (llmc/rope.cuh), in place on the packed qkv, against the CPU reference on
// GPT-2 124M's attention layout (B=16, T=1024, NH=KV=12, hd=64: qkv 75 MB; theta 10000, no scaling) and Llama 3
// 8B's (B=4, T=1024, NH=32, KV=8, hd=128: 50 MB; theta 500000, Llama 3.1 scaling), the latter also at the
// positions context-parallel rank 1 of 4 holds (zig-zag over 4096 tokens: two runs, 512..1023 and 3072..3583).
// Checks: q and k rotated as on the CPU, the values' bits untouched, both directions; then each is timed against
// the copy bandwidth with the buffers cycled so no call runs from L2. Inputs and the CPU reference: rope_case.h.
// The batches are a quarter of a training step's (B=64 and 16 once): the kernel's time per byte is the same on
// them (timing_sets cycles through copies spanning 4 times the L2), and at full size the inputs, the CPU
// reference and the comparisons (151 million values a tensor, 700 million random draws in all) made this the
// slowest program of dev/cuda, half a minute of host work before its first line showed.
#include "dev/cuda/rope_case.h"

// rank r of R under zig-zag context parallelism: a sequence of R·T tokens cut into 2R chunks of T/2, rank r holding
// chunks r and 2R-1-r (an early and a late one, so causal attention costs every rank the same)
static std::vector<int> zigzag_positions(int T, int r, int R) {
    std::vector<int> p(T);
    int chunk = T / 2;
    for (int i = 0; i < chunk; i++) {
        p[i] = r * chunk + i;
        p[chunk + i] = (2 * R - 1 - r) * chunk + i;
    }
    return p;
}

static void check_and_time(Checks& checks, RopeCase& k, const char* name) {
    if (!have_gpu()) return;
    std::string v = strfmt("%s B=%d T=%d NH=%d KV=%d hd=%d ", name, k.B, k.T, k.NH, k.KV, k.hd);
    k.gpu_forward();
    std::vector<float> out = download(k.d_qkv);
    checks.check(v + "forward", out, k.out, RopeCase::TOL);
    checks.require(v + "forward: values untouched", k.values_untouched(out, k.qkv));
    k.gpu_backward();
    std::vector<float> dinp = download(k.d_dqkv);
    checks.check(v + "backward", dinp, k.dinp, RopeCase::TOL);
    checks.require(v + "backward: dv untouched", k.values_untouched(dinp, k.dqkv));

    int sets = timing_sets(k.bytes());
    TimingCopies<bf16> x(k.d_qkv, sets);
    const int* positions = k.device_positions();
    float forward_ms = median_ms(
        [&](int s) { rope_forward_cuda(x[s], k.d_table.ptr, positions, k.B, k.T, k.NH, k.KV, k.hd, 0); }, sets);
    float backward_ms = median_ms(
        [&](int s) { rope_backward_cuda(x[s], k.d_table.ptr, positions, k.B, k.T, k.NH, k.KV, k.hd, 0); }, sets);
    report_memory_bound(v + "forward", forward_ms, k.bytes());
    report_memory_bound(v + "backward", backward_ms, k.bytes());
}

int main() {
    Program program(
        "rope: RoPE forward and backward against the CPU at GPT-2's and Llama 3 8B's shapes and a cp rank's positions; timed");
    Checks checks;
    {
        RopeCase gpt2(16, 1024, 12, 12, 64, 1024, 10000.0f, 0.0f, {}, 5);
        check_and_time(checks, gpt2, "gpt2");
    }
    {
        RopeCase llama(4, 1024, 32, 8, 128, 8192, 500000.0f, 8.0f, {}, 6);
        check_and_time(checks, llama, "llama3");
    }
    {
        RopeCase cp(4, 1024, 32, 8, 128, 8192, 500000.0f, 8.0f, zigzag_positions(1024, 1, 4), 7);
        check_and_time(checks, cp, "llama3 cp rank 1/4");
    }
    return program.finish(checks);
}
