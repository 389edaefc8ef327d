// The check case of llmc/rope.cuh (dev/cuda/README.md says what a case holds): dev/cuda/rope.cu runs it at GPT-2's
// and Llama 3 8B's attention shapes, test/test_rope.cu at small odd ones.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "dev/cuda/common.h"
#include "llmc/rope.cuh"

// rope_forward on a random qkv and rope_backward on a random dqkv, each in place, with the table of maxT
// positions for (theta, scaling) and the tokens at `positions` (empty: 0..T-1, which the kernels get as null).
// The kernels run in place, so there is no separate output to poison; the checks are the rotated q and k
// against the CPU and the values' bits against the input's.
struct RopeCase {
    // the GPU rounds each fp32 result to bf16 once where the CPU keeps fp32: half an ulp of bf16's 8 significant
    // bits, up to 2^-8 (0.4%) of the value, 0.4 of this tolerance
    static constexpr double TOL = 1e-2;
    int B, T, NH, KV, hd, maxT;
    long N, n;  // rows, values
    std::vector<int> positions;
    std::vector<float> table, qkv, dqkv;  // inputs
    std::vector<float> out, dinp;         // CPU reference
    DeviceArray<bf16> d_qkv, d_dqkv;
    DeviceArray<float> d_table;
    DeviceArray<int> d_positions;

    RopeCase(int B_, int T_, int NH_, int KV_, int hd_, int maxT_, float theta, float scaling,
             std::vector<int> positions_, uint64_t seed)
        : B(B_), T(T_), NH(NH_), KV(KV_), hd(hd_), maxT(maxT_), N((long)B_ * T_), n(N * (NH_ + 2 * KV_) * hd_),
          positions(std::move(positions_)), table((size_t)maxT * hd), d_qkv(n), d_dqkv(n), d_table(table.size()),
          d_positions(positions.size()) {
        Rng rng(seed);
        qkv = random_bf16_values(n, rng);
        dqkv = random_bf16_values(n, rng);
        rope_table(table.data(), maxT, hd, theta, scaling);
        upload(d_table, table);
        upload(d_positions, positions);
        out = qkv;
        rope_forward(out.data(), table.data(), host_positions(), B, T, NH, KV, hd);
        dinp = dqkv;
        rope_backward(dinp.data(), table.data(), host_positions(), B, T, NH, KV, hd);
    }
    const int* host_positions() const { return positions.empty() ? nullptr : positions.data(); }
    const int* device_positions() const { return positions.empty() ? nullptr : d_positions.ptr; }

    // each from the inputs: the in-place kernels overwrite them
    void gpu_forward() {
        upload(d_qkv, qkv);
        rope_forward_cuda(d_qkv.ptr, d_table.ptr, device_positions(), B, T, NH, KV, hd, 0);
    }
    void gpu_backward() {
        upload(d_dqkv, dqkv);
        rope_backward_cuda(d_dqkv.ptr, d_table.ptr, device_positions(), B, T, NH, KV, hd, 0);
    }

    // the last 2·KV heads of every row (the values, or their gradient) of `gpu` equal those of `input`, bit for bit
    bool values_untouched(const std::vector<float>& gpu, const std::vector<float>& input) const {
        long row = (long)(NH + 2 * KV) * hd, first = (long)(NH + KV) * hd;
        for (long r = 0; r < N; r++)
            for (long i = first; i < row; i++)
                if (memcmp(&gpu[r * row + i], &input[r * row + i], sizeof(float)) != 0) return false;
        return true;
    }

    // bytes one call moves: the q and k parts read and written, 2 bytes an element (the table stays in L2)
    double bytes() const { return 4.0 * N * (NH + KV) * hd; }
};
