// sum_of_squares_cuda against the CPU reference (llmc/global_norm.cuh) on a length that is not a multiple of
// 8 (the vector width), bit-reproducibility, then timed against the copy bandwidth (the 249 MB input cycled over copies).
#include "dev/cuda/common.h"
#include "llmc/global_norm.cuh"

int main() {
    Program program(
        "global_norm: the sum of squares of 124M bf16 values against the CPU, bit-reproducible; timed");
    Checks checks;
    const long n = 124475904L + 5;  // GPT-2 124M's parameter count, plus a tail
    Rng rng(5);
    std::vector<float> x = random_bf16_values(n, rng, 0.01f);
    DeviceArray<bf16> d_x(n);
    DeviceArray<float> d_out(1), partial(GLOBAL_NORM_BLOCKS);
    upload(d_x, x);
    std::vector<float> ref{(float)sum_of_squares(x.data(), n)};
    if (!program.gpu) return program.finish(checks);
    sum_of_squares_cuda(d_out.ptr, d_x.ptr, n, partial.ptr, 0);
    std::vector<float> first = download(d_out);
    checks.check("sum_of_squares", first, ref, 1e-4);
    sum_of_squares_cuda(d_out.ptr, d_x.ptr, n, partial.ptr, 0);
    checks.require("sum_of_squares bit-reproducible", download(d_out) == first);
    int sets = timing_sets(2.0 * n);
    TimingCopies<bf16> xs(d_x, sets);
    report_memory_bound("sum_of_squares n=124M",
                        median_ms([&](int s) { sum_of_squares_cuda(d_out.ptr, xs[s], n, partial.ptr, 0); }, sets),
                        2.0 * n);
    return program.finish(checks);
}
