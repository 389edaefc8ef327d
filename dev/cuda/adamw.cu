// adamw_update_cuda against the CPU reference (llmc/adamw.cuh) on the fp32 master weights and moments, and
// the stochastic rounding of the bf16 parameters: each must be one of the two bf16 values around its master
// weight, the rounding must be unbiased over many elements, and the same seed must give the same bits while
// another seed gives different ones, and the update cut into shards (each with its global offset) gives the
// unsharded bits. Timed against the copy bandwidth. Inputs and the CPU reference: AdamWCase
// in adamw_case.h.
#include "dev/cuda/adamw_case.h"

int main() {
    Program program(
        "adamw: AdamW on 10M parameters against the CPU (master weights, moments, stochastic rounding, shards); timed");
    Checks checks;
    const long n = 10000003;
    AdamWCase k(n, 8, 5);
    if (!program.gpu) return program.finish(checks);

    k.gpu_run(1234);
    std::vector<float> gpu_master = download(k.d_master), params = download(k.d_params);
    checks.check("adamw master weights", gpu_master, k.master, 1e-5);
    checks.check("adamw first moment", download(k.d_m), k.m, 1e-5);
    checks.check("adamw second moment", download(k.d_v), k.v, 1e-5);
    bool neighbours = true;
    double bias = 0.0;
    for (long i = 0; i < n; i++) {
        float lo, hi;
        bf16_neighbours(gpu_master[i], lo, hi);
        neighbours = neighbours && (params[i] == lo || params[i] == hi || params[i] == gpu_master[i]);
        bias += (params[i] - gpu_master[i]) / fabs(hi - lo);
    }
    bias /= n;
    checks.require("adamw params are a bf16 neighbour of master", neighbours);
    printf("mean rounding error: %.2e ulp\n", bias);
    checks.require("adamw stochastic rounding unbiased (|mean| < 2e-3 ulp)", fabs(bias) < 2e-3);
    k.gpu_run(1234);
    checks.require("adamw same seed, same bits", download(k.d_params) == params);
    k.gpu_run(1235);
    checks.require("adamw another seed, other bits", download(k.d_params) != params);
    k.gpu_run(1234, 3);
    checks.require("adamw in 3 shards (global offsets), the unsharded bits", download(k.d_params) == params);

    // 28 bytes per parameter: bf16 gradient and parameter, fp32 master, m and v read and written
    int sets = timing_sets(28.0 * n);
    TimingCopies<bf16> p(k.d_params, sets), g(k.d_grads, sets);
    TimingCopies<float> master(k.d_master, sets), m(k.d_m, sets), v(k.d_v, sets);
    float ms = median_ms(
        [&](int s) {
            adamw_update_cuda(p[s], master[s], g[s], m[s], v[s], n, k.lr, k.wd, k.grad_scale, k.t, 1, 0,
                              AdamWConfig{}, 0);
        },
        sets);
    report_memory_bound("adamw n=10M", ms, 28.0 * n);
    return program.finish(checks);
}
