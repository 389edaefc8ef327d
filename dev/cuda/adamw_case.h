// The check case of llmc/adamw.cuh (dev/cuda/README.md says what a case holds): dev/cuda/adamw.cu runs it at GPT-2
// sizes, test/test_cuda_kernels.cu at small odd ones.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "dev/cuda/common.h"
#include "llmc/adamw.cuh"

// the bf16 neighbours of x: truncation toward zero, and the next value away from zero
inline void bf16_neighbours(float x, float& lo, float& hi) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint32_t down = bits & 0xffff0000u, up = down + 0x10000u;
    memcpy(&lo, &down, 4);
    memcpy(&hi, &up, 4);
}

// one adamw_update step on the fp32 master weights and moments (lr 1e-3, weight decay 0.1, gradient scale 0.7,
// step t), the bf16 parameters rounded stochastically from the master weights on the GPU. The master weights
// are scaled off the bf16 grid so the rounding has something to decide.
struct AdamWCase {
    long n;
    int t;
    float lr = 1e-3f, wd = 0.1f, grad_scale = 0.7f;
    std::vector<float> master0, grads, m0, v0;  // inputs
    std::vector<float> master, m, v;            // CPU reference
    DeviceArray<bf16> d_params, d_grads;
    DeviceArray<float> d_master, d_m, d_v;

    AdamWCase(long n_, uint64_t seed, int t_)
        : n(n_), t(t_), d_params(n), d_grads(n), d_master(n), d_m(n), d_v(n) {
        Rng rng(seed);
        master0 = random_bf16_values(n, rng, 0.1f);
        grads = random_bf16_values(n, rng, 0.01f);
        m0 = random_bf16_values(n, rng, 0.01f);
        v0 = random_bf16_values(n, rng, 1e-3f);
        for (auto& x : v0) x = x * x;
        for (auto& x : master0) x *= 1.0f + 1e-3f * rng.uniform();
        master = master0;
        m = m0;
        v = v0;
        adamw_update(master.data(), grads.data(), m.data(), v.data(), n, lr, wd, grad_scale, t);
    }
    // from the inputs, parameters poisoned: one update with this rounding seed, as one call or cut into `shards`
    // contiguous calls (a ZeRO shard's view: each call's global_offset is its first element's index)
    void gpu_run(uint64_t seed, int shards = 1) {
        upload(d_master, master0);
        upload(d_m, m0);
        upload(d_v, v0);
        upload(d_grads, grads);
        d_params.poison();
        for (int s = 0; s < shards; s++) {
            long begin = n * s / shards, end = n * (s + 1) / shards;
            gpu_update(seed, begin, end - begin);
        }
    }
    void gpu_update(uint64_t seed, long begin, long count) {
        adamw_update_cuda(d_params.ptr + begin, d_master.ptr + begin, d_grads.ptr + begin, d_m.ptr + begin,
                          d_v.ptr + begin, count, lr, wd, grad_scale, t, seed, begin, AdamWConfig{}, 0);
    }
};
