// FP8 parameter gathers (--fp8-param-gather 1, Megatron-LM's fp8_param_gather). ZeRO-1 and 2 all-gather the
// parameters after each update, ZeRO-3 gathers each bucket before forward and backward use it: in the storage
// type, two bytes a parameter on the GPU. But the FP8 layers use their weights only through a cast to FP8, so
// here those weights travel as their codes, one byte each: every rank casts the elements it owns (its pieces of
// the buckets, just updated), the gathers carry codes for them and the storage type for everything else (norms,
// biases, embeddings, the first and the last layer, a weight that is not whole tiles), and the FP8 layers take
// the codes as they come instead of casting (Fp8Scaling::ready, llmc/fp8.cuh).
//
// The codes are the single rank's, bit for bit. A cast's scale comes from the amax of what it scales: the whole
// weight under tensorwise (over the tp ranks holding its pieces, as a layer's cast takes it), each 128×128 block
// under blockwise. A rank owns arbitrary element ranges of a bucket, so each rank takes the amax of its own
// elements per scale, the dp group all-gathers those (one float per weight, or per block) and every rank takes
// the largest, then the tp group as a layer's cast would: every rank ends with every scale, casts its own
// elements with them, and the gathers move codes alone. The scales are made once per update.
//
// The experts' weights travel as codes under tensorwise, each expert's weight one scale, made over the group that
// reduces it (the expert replicas, under expert parallelism) and the tp group. Under blockwise they travel as stored:
// an expert's share of the tokens is any number, and a count that is no multiple of 4 runs its matmuls in bf16 from
// the weight's values (Fp8Scaling::runs), which codes cannot give back. Not gathered as codes at all: mxfp8's
// weights, which its input gradient casts again in tiles down the columns (two casts, two bytes a parameter: nothing
// saved; refused with the flag).
//
// A bucket's piece on the wire is its runs: stretches of the piece's elements, each inside one tensor, as codes
// (inside one FP8 weight) or as stored values; pieces differ in bytes, so each rank's is padded to the largest.
// Under ZeRO-1/2 the rank's flat parameters hold the storage-type values of every other tensor, gathered; of
// the FP8 weights only the pieces it owns are current there, the codes of all of them in a buffer of their own,
// which the layers read: refresh_params() (llmc/zero.cuh) gathers the values whole before anything reads them
// whole (a checkpoint).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_map>
#include <vector>

#include "llmc/device.cuh"
#include "llmc/fp8.cuh"
#include "llmc/model_table.h"

// (included by llmc/zero.cuh after its buckets, Bucket and BucketLayout, which the wire layout reads)

// Why --fp8-param-gather 1 cannot run under ZeRO stage `zero` and recipe r with matmuls over `tokens` rows
// (-b × -t / --cp), or "": the planner's check_layout and DataParallel both ask
inline std::string fp8_param_gather_problem(int zero, Fp8Recipe r, long tokens) {
    if (zero == 0) return "ZeRO-0 all-reduces gradients and gathers no parameters (use -z 1, 2 or 3)";
    if (r == Fp8Recipe::Mxfp8)
        return "mxfp8 casts each weight twice (along its rows and down its columns), two bytes a parameter on the "
               "wire, no fewer than bf16's";
    if (r == Fp8Recipe::Blockwise && tokens % 4 != 0)
        return strfmt("blockwise runs a matmul over %ld tokens (-b x -t / --cp) in bf16 from the weight's values, which "
                      "the gathers carry as FP8 codes: make it a multiple of 4", tokens);
    return "";
}

// whether the experts' weights travel as codes under recipe r (the top comment says why blockwise's do not)
inline bool fp8_gathers_experts(Fp8Recipe r) { return r == Fp8Recipe::Tensorwise; }

// The shape of each FP8 weight that tensor t holds in `unit` of a part (each block of the unit's segment is one:
// the experts' stacked weights are one a expert), or {0, 0} where the tensor travels in the storage type: the matmul
// weights of the layers that run in FP8 (all but the model's first and last, llmc/gpt.cuh's fp8_for), when the
// recipe takes their shape
inline std::pair<long, long> fp8_gathered_shape(const GPTConfig& c, const ModelTable& table, const ModelPart& part, int tp,
                                                int unit, int t, Fp8Recipe r) {
    int L = part.layers();
    if (unit < 1 || unit > L) return {0, 0};
    int layer = part.model_layer(L - unit);
    if (layer == 0 || layer == c.num_layers - 1) return {0, 0};
    if (!fp8_matmul_weight(t)) return {0, 0};
    const TensorSpec& s = table[t];
    if (s.expert && c.moe() && !fp8_gathers_experts(r)) return {0, 0};
    long rows = (long)s.local_rows(tp), cols = (long)s.local_cols(tp);
    if (!fp8_recipe_takes(r, rows, cols)) return {0, 0};
    return {rows, cols};
}

// the scales of a weight: one, or one per 128×128 block
inline size_t fp8_gathered_scales(long rows, long cols, Fp8Recipe r) {
    return r == Fp8Recipe::Tensorwise ? 1 : (size_t)(rows / FP8_BLOCK) * (cols / FP8_BLOCK);
}

// one FP8 weight of a bucket: where its elements are in the bucket's packed layout, in the rank's flat share and
// among the bucket's codes; its shape; its first scale among all the rank's
struct Fp8GatheredWeight {
    size_t packed, flat, code, scale;
    long rows, cols;
};
// a stretch of one rank's piece of a bucket: elements [packed, packed + count) (at `flat` in the flat share), from
// byte `wire` of the piece on the wire, as codes of `weight` (an index into the bucket's weights), or -1: as stored
struct Fp8WireRun {
    size_t packed, flat, count, wire;
    int weight;
};
struct Fp8BucketWire {
    std::vector<Fp8GatheredWeight> weights;  // empty: the bucket travels in the storage type, as without the flag
    size_t codes = 0;                        // the FP8 weights' elements
    std::vector<std::vector<Fp8WireRun>> runs;  // per rank of the group
    size_t piece_bytes = 0;                  // the largest rank's piece on the wire, in 16-byte words
};

// the wire layout of every bucket of a group of N ranks; value_bytes: the storage type's size; `scales` counts
// the scales of the weights laid out so far (the groups' buckets share one array of them)
inline std::vector<Fp8BucketWire> fp8_bucket_wires(const GPTConfig& c, const ModelPart& part, int tp, const BucketLayout& lay,
                                                   int N, Fp8Recipe r, size_t value_bytes, size_t& scales) {
    ModelTable table = model_table(c);
    std::vector<Fp8BucketWire> wires(lay.buckets.size());
    for (size_t b = 0; b < lay.buckets.size(); b++) {
        const Bucket& bk = lay.buckets[b];
        Fp8BucketWire& w = wires[b];
        // the bucket's stretches in packed order: a segment, or a weight of one
        struct Stretch {
            size_t packed, flat, count;
            int weight;
        };
        std::vector<Stretch> stretches;
        size_t packed = 0;
        for (int u = bk.first_unit; u <= bk.last_unit; u++)
            for (const Segment& s : lay.unit_segments[u]) {
                auto [rows, cols] = fp8_gathered_shape(c, table, part, tp, u, s.tensor, r);
                size_t block = (size_t)rows * cols;
                if (block == 0) {
                    stretches.push_back({packed, s.offset, s.size, -1});
                } else {
                    for (size_t at = 0; at < s.size; at += block) {
                        stretches.push_back({packed + at, s.offset + at, block, (int)w.weights.size()});
                        w.weights.push_back({packed + at, s.offset + at, w.codes, scales, rows, cols});
                        w.codes += block, scales += fp8_gathered_scales(rows, cols, r);
                    }
                }
                packed += s.size;
            }
        if (w.weights.empty()) continue;
        w.runs.resize(N);
        for (int rank = 0; rank < N; rank++) {
            size_t lo = rank * bk.piece, hi = std::min(lo + bk.piece, bk.size), bytes = 0;
            for (const Stretch& s : stretches) {
                size_t a = std::max(lo, s.packed), e = std::min(hi, s.packed + s.count);
                if (a >= e) continue;
                w.runs[rank].push_back({a, s.flat + (a - s.packed), e - a, bytes, s.weight});
                bytes += (e - a) * (s.weight >= 0 ? 1 : value_bytes);
            }
            w.piece_bytes = std::max(w.piece_bytes, (bytes + 15) / 16 * 16);
        }
    }
    return wires;
}

// ----------------------------------------------------------------------------------------------------------
// the kernels, each a CPU loop beside its CUDA kernel. An element's scale: element e of a weight of `cols`
// columns is scaled by its block's (blocks) or by the weight's one scale.

__host__ __device__ inline long fp8_gathered_scale_of(long e, long cols, bool blocks) {
    return blocks ? (e / cols / FP8_BLOCK) * (cols / FP8_BLOCK) + (e % cols) / FP8_BLOCK : 0;
}

// amaxes[scale of e] = max(itself, |x[i]|) for x holding elements first.. of a weight: a NaN or an infinity makes it
// NaN, so that its scale is NaN and the step is skipped, as a layer's cast would have it
inline void fp8_gathered_amax(float* amaxes, const float* x, long n, long first, long cols, bool blocks, size_t scale) {
    for (long i = 0; i < n; i++) {
        float& m = amaxes[scale + fp8_gathered_scale_of(first + i, cols, blocks)];
        m = std::isfinite(x[i]) && !std::isnan(m) ? std::max(m, std::fabs(x[i])) : NAN;
    }
}
// on the GPU the largest as bits (llmc/fp8.cuh's fp8_amax_kernel: a NaN's bits exceed every finite's, and an
// infinity's exceed those), each element's into its scale's by an atomic: a run holds few scales
static __global__ void fp8_gathered_amax_kernel(float* amaxes, const bf16* x, long n, long first, long cols, bool blocks,
                                                size_t scale) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        unsigned int bits = __float_as_uint(fabsf(__bfloat162float(x[i])));
        atomicMax(reinterpret_cast<unsigned int*>(amaxes) + scale + fp8_gathered_scale_of(first + i, cols, blocks), bits);
    }
}
inline void fp8_gathered_amax(float* amaxes, const bf16* x, long n, long first, long cols, bool blocks, size_t scale) {
    launch_elementwise(fp8_gathered_amax_kernel, n, amaxes, x, n, first, cols, blocks, scale);
}

// x, elements first.. of a weight, cast to E4M3 codes with their scales (pairs: scale and inverse per scale)
inline void fp8_gathered_cast(uint8_t* out, const float* x, long n, long first, long cols, bool blocks, const float* pairs) {
    for (long i = 0; i < n; i++)
        out[i] = fp8_encode(x[i] * pairs[2 * fp8_gathered_scale_of(first + i, cols, blocks)], Fp8Format::E4M3);
}
static __global__ void fp8_gathered_cast_kernel(uint8_t* out, const bf16* x, long n, long first, long cols, bool blocks,
                                                const float* pairs) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = fp8_cast_device(__bfloat162float(x[i]) * pairs[2 * fp8_gathered_scale_of(first + i, cols, blocks)],
                                 Fp8Format::E4M3);
}
inline void fp8_gathered_cast(uint8_t* out, const bf16* x, long n, long first, long cols, bool blocks, const float* pairs) {
    launch_elementwise(fp8_gathered_cast_kernel, n, out, x, n, first, cols, blocks, pairs);
}

// received codes, elements first.. of a weight, into what its layers read: the GPU's codes as they are; on the
// CPU the values the GPU's GEMM makes of them (the code's value times its inverse scale, as a cast leaves them)
inline void fp8_gathered_take(float* out, const uint8_t* codes, long n, long first, long cols, bool blocks, const float* pairs) {
    for (long i = 0; i < n; i++)
        out[i] = fp8_decode(codes[i], Fp8Format::E4M3) * pairs[2 * fp8_gathered_scale_of(first + i, cols, blocks) + 1];
}
inline void fp8_gathered_take(uint8_t* out, const uint8_t* codes, long n, long, long, bool, const float*) {
    device_copy<bf16>(out, codes, (size_t)n);
}

// ----------------------------------------------------------------------------------------------------------
// what a data-parallel group of N ranks keeps for the gathers of one rank: the buckets' wire layouts, the scales
// of every FP8 weight, and the codes the layers read

template <typename floatX>
struct Fp8Gathers {
    using Code = typename Fp8Scaling<floatX>::Code;
    Fp8Recipe recipe = Fp8Recipe::Tensorwise;
    size_t scales = 0;      // the rank's FP8 weights' scales, all groups'
    float* pairs = nullptr;  // each scale and its inverse, on the device of floatX
    Fp8ReadyWeights<Code> ready;  // what the layers look their weights' codes up in
    bool blocks() const { return recipe == Fp8Recipe::Blockwise; }

    // the amax of this rank's elements of bucket w's FP8 weights per scale into amaxes (the rank's scales, zeroed
    // first); source(run): where the values of one of the rank's runs are
    template <typename Source>
    void piece_amaxes(float* amaxes, const Fp8BucketWire& w, int rank, Source&& source) const {
        for (const Fp8WireRun& run : w.runs[rank]) {
            if (run.weight < 0) continue;
            const Fp8GatheredWeight& g = w.weights[run.weight];
            fp8_gathered_amax(amaxes, source(run), (long)run.count, (long)(run.packed - g.packed), g.cols, blocks(),
                              g.scale);
        }
    }

    // One reduction group's scales, [first, first + count) of the rank's: every rank's amaxes of them (host, from
    // piece_amaxes) over the group's ranks (dp, or the expert replicas), then the tp group for tensorwise, into the
    // scale pairs: the largest of each, as a layer's cast of the whole weight takes it
    void make_scales(const float* amaxes, size_t first, size_t count, Comm& dp, Comm* tp) {
        std::vector<float> mine(amaxes + first, amaxes + first + count), all(count * dp.size);
        dp.wait(dp.all_gather(mine.data(), all.data(), count, DType::F32));
        for (size_t s = 0; s < count; s++) {
            float m = 0.0f;
            for (int r = 0; r < dp.size; r++) {
                float a = all[r * count + s];
                m = std::isfinite(a) && std::isfinite(m) ? std::max(m, a) : NAN;
            }
            mine[s] = m;
        }
        std::vector<float> host(2 * count);
        if (recipe == Fp8Recipe::Tensorwise) {
            int T = tp ? tp->size : 1;
            all.assign(count * T, 0.0f);
            if (T > 1) tp->wait(tp->all_gather(mine.data(), all.data(), count, DType::F32));
            else all = mine;
            std::vector<float> pieces(T);
            for (size_t s = 0; s < count; s++) {
                for (int r = 0; r < T; r++) pieces[r] = all[r * count + s];
                fp8_scale_pair(&host[2 * s], pieces.data(), T, Fp8Format::E4M3);
            }
        } else {
            for (size_t s = 0; s < count; s++) fp8_tile_scale(&host[2 * s], &host[2 * s + 1], mine[s], recipe);
        }
        device_upload<floatX>(pairs + 2 * first, host.data(), host.size());
    }

    // this rank's piece of bucket w on the wire: its FP8 weights' elements cast to codes, the rest copied as stored
    template <typename Source>
    void pack(uint8_t* wire, const Fp8BucketWire& w, int rank, Source&& source) const {
        for (const Fp8WireRun& run : w.runs[rank]) {
            const floatX* x = source(run);
            if (run.weight < 0) {
                device_copy<floatX>(wire + run.wire, reinterpret_cast<const uint8_t*>(x), run.count * sizeof(floatX));
                continue;
            }
            const Fp8GatheredWeight& g = w.weights[run.weight];
            fp8_gathered_cast(wire + run.wire, x, (long)run.count, (long)(run.packed - g.packed), g.cols, blocks(),
                              pairs + 2 * g.scale);
        }
    }

    // the gathered pieces (N of piece_bytes each) of bucket w: each FP8 weight's codes into `codes` (the bucket's,
    // in its weights' order), and the stored values through `values(run)`, which says where a run of rank r goes
    // (null: nowhere, it is in place)
    template <typename Values>
    void unpack(const uint8_t* wire, const Fp8BucketWire& w, Code* codes, Values&& values) const {
        for (size_t r = 0; r < w.runs.size(); r++)
            for (const Fp8WireRun& run : w.runs[r]) {
                const uint8_t* from = wire + r * w.piece_bytes + run.wire;
                if (run.weight < 0) {
                    if (floatX* to = values((int)r, run))
                        device_copy<floatX>(reinterpret_cast<uint8_t*>(to), from, run.count * sizeof(floatX));
                    continue;
                }
                const Fp8GatheredWeight& g = w.weights[run.weight];
                size_t e = run.packed - g.packed;
                fp8_gathered_take(codes + g.code + e, from, (long)run.count, (long)e, g.cols, blocks(), pairs + 2 * g.scale);
            }
    }

    // the layers find bucket w's weights at `base` + where each lies (packed or flat), their codes at `codes`
    void offer(const Fp8BucketWire& w, const floatX* base, bool packed, const Code* codes) {
        for (const Fp8GatheredWeight& g : w.weights)
            ready[base + (packed ? g.packed : g.flat)] = {codes + g.code, pairs + 2 * g.scale, g.rows, g.cols};
    }
};
