// gelu_forward_cuda and gelu_backward_cuda (also in place, dinp = dout) against the CPU reference
// (llmc/gelu.cuh), on the MLP activation of B=16, T=1024, C=768 (100 MB) plus 5 elements past the vector
// width, then timed against the copy bandwidth with the buffers cycled so no call runs from L2.
#include "dev/cuda/common.h"
#include "llmc/gelu.cuh"

int main() {
    Program program(
        "gelu: GELU forward and backward on 50.3M values against the CPU; timed");
    Checks checks;
    const long N = 16L * 1024 * 4 * 768 + 5;
    Rng rng(2);
    std::vector<float> inp = random_bf16_values(N, rng, 2.0f), dout = random_bf16_values(N, rng);
    DeviceArray<bf16> d_inp(N), d_out(N), d_dout(N), d_dinp(N);
    upload(d_inp, inp);
    upload(d_dout, dout);

    std::vector<float> out(N), dinp(N);
    gelu_forward(out.data(), inp.data(), N);
    gelu_backward(dinp.data(), inp.data(), dout.data(), N);
    if (!program.gpu) return program.finish(checks);
    gelu_forward_cuda(d_out.ptr, d_inp.ptr, N, 0);
    checks.check("gelu_forward", download(d_out), out, 1e-2);
    gelu_backward_cuda(d_dinp.ptr, d_inp.ptr, d_dout.ptr, N, 0);
    std::vector<float> gpu_dinp = download(d_dinp);
    checks.check("gelu_backward", gpu_dinp, dinp, 1e-2);
    gelu_backward_cuda(d_dout.ptr, d_inp.ptr, d_dout.ptr, N, 0);
    checks.require("gelu_backward in place, the same bits", download(d_dout) == gpu_dinp);

    int sets = timing_sets(4.0 * N);
    TimingCopies<bf16> x(d_inp, sets), y(d_out, sets), d(d_dinp, sets);
    report_memory_bound("gelu_forward N=50.3M",
                        median_ms([&](int s) { gelu_forward_cuda(y[s], x[s], N, 0); }, sets), 4.0 * N);
    // in place, as the model runs it: inp and dout read, dinp written over dout
    report_memory_bound("gelu_backward N=50.3M",
                        median_ms([&](int s) { gelu_backward_cuda(d[s], x[s], d[s], N, 0); }, sets), 6.0 * N);
    return program.finish(checks);
}
