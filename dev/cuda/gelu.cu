// gelu_forward_cuda and gelu_backward_cuda (also in place, dinp = dout) against the CPU reference
// (llmc/gelu.cuh), on the MLP activation of B=16, T=1024, C=768 (100 MB) plus 5 elements past the vector
// width; then GELU's backward with the bias gradient of its input in one pass (gelu_backward_dbias_cuda, as
// the MLP's backward runs it) against the CPU and against the two passes it replaced (GELU's backward, bit for
// bit; then the column sums, the same sums in another order), and itself run again in place (the same bits);
// all timed against the copy bandwidth with the buffers cycled so no call runs from L2.
#include "dev/cuda/common.h"
#include "llmc/gelu.cuh"
#include "llmc/matmul.cuh"

int main() {
    Program program(
        "gelu: GELU forward and backward on 50.3M values, and backward with its input's bias gradient, against the CPU; timed");
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

    // the MLP's hidden activation as rows: d12's 3072 wide at B=16 and B=64 (T=1024), and a width that is no
    // multiple of 8
    const std::pair<long, long> shapes[] = {{16L * 1024, 3072}, {64L * 1024, 3072}, {1000, 774}};
    for (const std::pair<long, long>& shape_of : shapes) {
        long rows = shape_of.first, C = shape_of.second, n = rows * C;
        std::string shape = " " + std::to_string(rows) + "x" + std::to_string(C);
        std::vector<float> pre = random_bf16_values(n, rng, 2.0f), d = random_bf16_values(n, rng);
        std::vector<float> dpre = d, dbias(C, 0.0f), workspace(gemm_workspace_floats(omp_get_max_threads()));
        gelu_backward_dbias(dpre.data(), dbias.data(), pre.data(), rows, C, {workspace.data(), workspace.size()});
        DeviceArray<bf16> d_pre(n), d_d(n), d_g(n), d_bias(C), d_bias2(C);
        DeviceArray<float> scratch(matmul_backward_scratch_floats(rows, C));
        upload(d_pre, pre);
        upload(d_d, d);
        upload(d_bias, std::vector<float>(C, 0.0f));
        upload(d_bias2, std::vector<float>(C, 0.0f));
        gelu_backward_dbias_cuda(d_g.ptr, d_bias.ptr, d_pre.ptr, d_d.ptr, rows, C, scratch.ptr, 0);
        std::vector<float> g = download(d_g), bias = download(d_bias);
        checks.check("gelu_backward_dbias dpre" + shape, g, dpre, 1e-2);
        checks.check("gelu_backward_dbias dbias" + shape, bias, dbias, 1e-2);
        // the two passes it replaced: GELU's backward's bits, and the column sums' sums in their order
        gelu_backward_cuda(d_g.ptr, d_pre.ptr, d_d.ptr, n, 0);
        checks.require("gelu_backward_dbias" + shape + ": the bits of GELU's backward", download(d_g) == g);
        matmul_dbias_cuda(d_bias2.ptr, d_g.ptr, rows, C, scratch.ptr, 0);
        checks.check("gelu_backward_dbias dbias against the column sums" + shape, bias, download(d_bias2), 1e-3);
        // in place, as the model runs it: the same bits
        upload(d_g, d);
        upload(d_bias2, std::vector<float>(C, 0.0f));
        gelu_backward_dbias_cuda(d_g.ptr, d_bias2.ptr, d_pre.ptr, d_g.ptr, rows, C, scratch.ptr, 0);
        checks.require("gelu_backward_dbias" + shape + " in place: the same bits",
                       download(d_g) == g && download(d_bias2) == bias);
        if (C % 8 != 0) continue;
        int sets = timing_sets(6.0 * n);
        TimingCopies<bf16> x(d_pre, sets), gs(d_g, sets);
        // the two passes move 8 bytes an element: GELU's backward 6, the column sums' re-read 2
        report_memory_bound("GELU backward, then column sums" + shape, median_ms([&](int s) {
            gelu_backward_cuda(gs[s], x[s], gs[s], n, 0);
            matmul_dbias_cuda(d_bias.ptr, gs[s], rows, C, scratch.ptr, 0);
        }, sets), 8.0 * n);
        report_memory_bound("gelu_backward_dbias (one pass)" + shape, median_ms([&](int s) {
            gelu_backward_dbias_cuda(gs[s], d_bias.ptr, x[s], gs[s], rows, C, scratch.ptr, 0);
        }, sets), 6.0 * n);
    }
    return program.finish(checks);
}
