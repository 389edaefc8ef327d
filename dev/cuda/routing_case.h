// routing_case: llmc/moe.cuh's routing on the device against its CPU loops, on random logits with ties planted.
// The GPU must make the CPU's decisions to the bit: each token's experts, the capacity's kept flags, the
// dispatch order (each slot's row, each row's token, the counts) and the ep permutation are compared exactly;
// the gates and P too, since both sides run the same arithmetic (route_exp rounds a double exp once), and the
// statistics' counts (whole numbers). The statistics' sums of P (a warp's strided partial sums on the GPU, token
// order on the CPU) and the router's logit gradients (the same order, but the device may fuse a multiply and an
// add that the host rounds twice) to 1e-5 of their RMS: one token's P missed, or one expert's share of the
// gradient, would be ~1/T or ~1/E of it. Used by test/test_moe.cu ([cuda]) and dev/cuda/moe.cu.
#pragma once

#include <string>
#include <vector>

#include "dev/cuda/common.h"
#include "llmc/moe.cuh"

struct RoutingCase {
    int B;          // sequences of the micro-batch
    long Tl;        // tokens of each
    int E, K;
    Routing how;
    bool bias;      // a selection bias (DeepSeek-V3's)
    float capacity;  // F (0: dropless)
    uint64_t seed;
};

// what differs between the devices, one line each (empty: all agree)
inline std::vector<std::string> routing_differences(const RoutingCase& c) {
    const int B = c.B, E = c.E, K = c.K;
    const long BT = B * c.Tl, n = BT * K;
    std::vector<std::string> out;
    if (!have_gpu()) return out;
    Rng rng(c.seed);
    std::vector<float> logits(BT * E), bias(c.bias ? E : 0), dgate(n), freq((size_t)B * E);
    for (float& l : logits) l = rng.normal(0.0f, 1.5f);
    for (long t = 0; t < BT; t += 7) logits[t * E + 1] = logits[t * E + E - 1] = 9.0f;  // ties at the top
    for (float& b : bias) b = rng.normal(0.0f, 0.1f);
    for (float& d : dgate) d = rng.normal(0.0f, 1.0f);
    for (float& f : freq) f = rng.uniform() / E;
    const float* host_bias = c.bias ? bias.data() : nullptr;
    long cap = c.capacity > 0.0f ? expert_capacity(c.capacity, K, E, c.Tl) : 0;

    // the CPU
    std::vector<int> expert(n), keep(n), row_of(n), token_of_row(n), counts(E);
    std::vector<float> gate(n), probs(BT * E), scores(c.how.sigmoid ? BT * E : 0), sums(2 * (size_t)B * E),
        dlogits(BT * E), scratch_p(BT * E), scratch_s(BT * E);
    float* s = c.how.sigmoid ? scores.data() : nullptr;
    route_tokens<float>(expert.data(), gate.data(), probs.data(), s, logits.data(), host_bias, BT, E, K, c.how);
    if (cap) within_capacity<float>(keep.data(), expert.data(), B, c.Tl, K, E, cap, nullptr);
    dispatch_order<float>(row_of.data(), token_of_row.data(), counts.data(), expert.data(), cap ? keep.data() : nullptr,
                          BT, E, K, nullptr);
    route_statistics<float>(sums.data(), expert.data(), probs.data(), B, c.Tl, E, K);
    router_grads<float>(dlogits.data(), scratch_p.data(), c.how.sigmoid ? scratch_s.data() : nullptr, logits.data(),
                        expert.data(), gate.data(), dgate.data(), freq.data(), BT, c.Tl, E, K, c.how, 0.01f, 1.0f / BT);
    long dispatched = 0;
    for (int e = 0; e < E; e++) dispatched += counts[e];
    // a permutation of four ranks' arrivals for E/4 experts each (plan_receive's blocks, random counts)
    const int ranks = 4, X = std::max(1, E / ranks), blocks_n = ranks * X;
    std::vector<int> blocks(3 * blocks_n), recv(blocks_n);
    for (int& r : recv) r = (int)(rng.uniform() * 50);
    std::vector<int> first(X + 1, 0);
    for (int x = 0; x < X; x++) {
        first[x + 1] = first[x];
        for (int r = 0; r < ranks; r++) first[x + 1] += recv[r * X + x];
    }
    std::vector<int> next(first.begin(), first.end() - 1);
    for (int j = 0, arrival = 0; j < blocks_n; j++)
        blocks[j] = arrival, blocks[blocks_n + j] = next[j % X], blocks[2 * blocks_n + j] = recv[j],
        arrival += recv[j], next[j % X] += recv[j];
    long rows = first[X];
    std::vector<int> to_experts(rows), from_experts(rows);
    permutation<float>(to_experts.data(), blocks.data(), blocks_n, rows, true);
    permutation<float>(from_experts.data(), blocks.data(), blocks_n, rows, false);

    // the GPU
    DeviceArray<float> d_logits(BT * E), d_bias(std::max(1, (int)bias.size())), d_gate(n), d_probs(BT * E),
        d_scores(BT * E), d_sums(2 * (size_t)B * E), d_dgate(n), d_freq((size_t)B * E), d_dlogits(BT * E);
    DeviceArray<int> d_expert(n), d_keep(n), d_row_of(n), d_token_of_row(n), d_counts(E),
        d_sort(std::max(route_sort_ints(n, 1, E), route_sort_ints(n, B, E))), d_blocks(blocks.size()),
        d_to(std::max(1L, rows)), d_from(std::max(1L, rows));
    upload(d_logits, logits);
    if (c.bias) upload(d_bias, bias);
    upload(d_dgate, dgate);
    upload(d_freq, freq);
    upload(d_blocks, blocks);
    float* ds = c.how.sigmoid ? d_scores.ptr : nullptr;
    route_tokens<bf16>(d_expert.ptr, d_gate.ptr, d_probs.ptr, ds, d_logits.ptr, c.bias ? d_bias.ptr : nullptr, BT, E, K,
                       c.how);
    if (cap) within_capacity<bf16>(d_keep.ptr, d_expert.ptr, B, c.Tl, K, E, cap, d_sort.ptr);
    dispatch_order<bf16>(d_row_of.ptr, d_token_of_row.ptr, d_counts.ptr, d_expert.ptr, cap ? d_keep.ptr : nullptr, BT, E,
                         K, d_sort.ptr);
    route_statistics<bf16>(d_sums.ptr, d_expert.ptr, d_probs.ptr, B, c.Tl, E, K);
    router_grads<bf16>(d_dlogits.ptr, d_probs.ptr, ds, d_logits.ptr, d_expert.ptr, d_gate.ptr, d_dgate.ptr, d_freq.ptr, BT,
                       c.Tl, E, K, c.how, 0.01f, 1.0f / BT);
    permutation<bf16>(d_to.ptr, d_blocks.ptr, blocks_n, rows, true);
    permutation<bf16>(d_from.ptr, d_blocks.ptr, blocks_n, rows, false);
    cuda_check(cudaStreamSynchronize(main_stream()));

    auto same = [&](const char* what, auto gpu, const auto& cpu, size_t count) {
        gpu.resize(count);
        if (!std::equal(cpu.begin(), cpu.begin() + count, gpu.begin())) out.push_back(strfmt("%s differ", what));
    };
    auto close = [&](const char* what, const std::vector<float>& gpu, const std::vector<float>& cpu) {
        Comparison cmp = compare_rms(gpu, cpu, 1e-5);
        if (!cmp.pass()) out.push_back(strfmt("%s: max error %g", what, cmp.max_abs));
    };
    same("experts", download(d_expert), expert, n);
    same("gates", download(d_gate), gate, n);
    same("P", download(d_probs), probs, BT * E);
    if (cap) same("kept flags", download(d_keep), keep, n);
    same("counts", download(d_counts), counts, E);
    same("rows of the slots", download(d_row_of), row_of, n);
    same("tokens of the rows", download(d_token_of_row), token_of_row, dispatched);
    std::vector<float> gpu_sums = download(d_sums);
    same("statistics' counts", gpu_sums, sums, (size_t)B * E);
    close("statistics' sums of P", gpu_sums, sums);
    close("router's logit gradients", download(d_dlogits), dlogits);
    same("permutation into the experts' order", download(d_to), to_experts, rows);
    same("permutation out of it", download(d_from), from_experts, rows);
    return out;
}
