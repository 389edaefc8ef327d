// adamw_update_cuda against the CPU reference (llmc/adamw.cuh) on the fp32 master weights and moments, and
// the stochastic rounding of the bf16 parameters: each must be one of the two bf16 values around its master
// weight, the rounding must be unbiased over many elements, and the same seed must give the same bits while
// another seed gives different ones. Timed against the copy bandwidth.
#include "dev/cuda/common.h"
#include "llmc/adamw.cuh"

// the bf16 neighbours of x: truncation toward zero, and the next value away from zero
static void bf16_neighbours(float x, float& lo, float& hi) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint32_t down = bits & 0xffff0000u, up = down + 0x10000u;
    memcpy(&lo, &down, 4);
    memcpy(&hi, &up, 4);
}

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    const long n = 10000003;
    const float lr = 1e-3f, wd = 0.1f, grad_scale = 0.7f;
    const int t = 5;
    Rng rng(8);
    std::vector<float> master = random_bf16_values(n, rng, 0.1f), grads = random_bf16_values(n, rng, 0.01f),
                       m = random_bf16_values(n, rng, 0.01f), v = random_bf16_values(n, rng, 1e-3f);
    for (auto& x : v) x = x * x;
    // a master weight that is not a bf16 value, so the rounding has something to decide
    for (auto& x : master) x *= 1.0f + 1e-3f * rng.uniform();
    DeviceArray<bf16> d_params(n), d_grads(n);
    DeviceArray<float> d_master(n), d_m(n), d_v(n);
    auto run = [&](uint32_t seed) {
        upload(d_master, master);
        upload(d_m, m);
        upload(d_v, v);
        upload(d_grads, grads);
        d_params.poison();
        adamw_update_cuda(d_params.ptr, d_master.ptr, d_grads.ptr, d_m.ptr, d_v.ptr, n, lr, wd, grad_scale, t, seed,
                          AdamWConfig{}, 0);
    };
    std::vector<float> ref_master = master, ref_m = m, ref_v = v;
    adamw_update(ref_master.data(), grads.data(), ref_m.data(), ref_v.data(), n, lr, wd, grad_scale, t);

    run(1234);
    std::vector<float> gpu_master = download(d_master), params = download(d_params);
    checks.check("adamw master weights", gpu_master, ref_master, 1e-5);
    checks.check("adamw first moment", download(d_m), ref_m, 1e-5);
    checks.check("adamw second moment", download(d_v), ref_v, 1e-5);
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
    run(1234);
    checks.require("adamw same seed, same bits", download(d_params) == params);
    run(1235);
    checks.require("adamw another seed, other bits", download(d_params) != params);

    report_memory_bound("adamw n=10M", time_ms([&] {
                            adamw_update_cuda(d_params.ptr, d_master.ptr, d_grads.ptr, d_m.ptr, d_v.ptr, n, lr, wd,
                                              grad_scale, t, 1, AdamWConfig{}, 0);
                        }),
                        28.0 * n);
    return checks.exit_code();
}
