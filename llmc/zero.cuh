// Data parallelism and ZeRO-1/2/3 over the dp group.
//
// Buckets. The model's units (llmc/gpt.cuh: the final layernorm, the layers from last to first, the
// embeddings) are packed, in the order backward finishes them, into buckets of at least --bucket-mb each; the
// embeddings always form a bucket of their own (their gradient is final only when backward ends). A bucket's
// packed layout is its units' tensor slices back to back, zero-padded to a multiple of the dp size N, and it
// splits into N equal contiguous pieces: rank r owns piece r of every bucket. A rank's shard is its pieces
// of all buckets, back to back. No tensor has to divide by N.
//
// Every stage reduces a bucket the same way: one reduce-scatter of the packed bucket, so each element's sum
// runs in the same order whatever the stage, and stages give identical bits. What differs is what is kept:
//   ZeRO-0  full gradients, parameters and optimizer state; the reduced pieces are all-gathered back
//           (reduce-scatter + all-gather is the all-reduce) and every rank takes the same full step.
//   ZeRO-1  optimizer state sharded: each rank updates its pieces, then the parameters are all-gathered.
//   ZeRO-2  gradients sharded too: backward writes each bucket into a staging buffer that is reduce-scattered
//           into the owner's piece as soon as the bucket is complete; no full gradient buffer exists.
//   ZeRO-3  parameters sharded too: forward and backward all-gather each bucket just before its units run,
//           prefetch the next, and drop it after use.
// ZeRO-0 and ZeRO-1 reduce only in the last micro-step of an accumulation (gradients accumulate locally
// before); ZeRO-2 and ZeRO-3 hold no full gradient, so they reduce every micro-step and accumulate the
// reduced pieces. With one micro-step all four stages agree bit for bit; with more, ZeRO-0/1 and ZeRO-2/3
// sum the same numbers in a different order (micro-steps first, or ranks first).
//
// Expert parallelism (--ep) adds a second reduction group. A rank holds E/ep experts of each layer, the same
// ones as its expert replicas (llmc/grid.cuh) and other ones than the rest of its ep group, so the expert
// tensors' gradients are reduced and sharded over the replicas only, everything else over dp as before. Each
// group packs its own tensors into its own buckets by the rules above, and keeps its own staging; a rank's
// shards hold the first group's pieces, then the second's. Without expert parallelism one group holds every
// tensor, which is the layout and the arithmetic described above.
//
// Collectives start only at points every rank reaches in the same order (a bucket completing, a bucket being
// needed, the step's end), never when a test happens to succeed, as MPI requires.
//
// On the GPU every buffer here is device memory (the communicator moves it, staging through the host for MPI):
// packing and unpacking are device copies, and the two sums ZeRO adds (a reduced piece into the gradient
// shard, the tp group's partial sums) are small kernels beside their CPU loops. The fp32 master weights, which
// AdamW updates, are sharded like the moments under ZeRO >= 1; each owned segment is updated with its offset
// in the rank's whole share (adamw_update's global_offset), which the stochastic rounding draws its bits from.
// Every buffer of the runtime (the shards, the staging, the FP8 gathers') is one list made from the groups' sizes
// (DataParallel::buffers), which the ledger allocates and --plan reads (llmc/plan.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "llmc/comm.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/gpt.cuh"
#include "llmc/grad_plan.h"

struct Bucket {
    int first_unit = 0, last_unit = 0;  // units [first, last]
    std::vector<Segment> segments;      // in packed order
    size_t size = 0;                    // packed elements
    size_t padded = 0;                  // a multiple of the dp size
    size_t piece = 0;                   // padded / dp
    size_t shard_offset = 0;            // where this rank's piece sits in its shard
};

// where one owned element range sits in the flat buffers and in the shard
struct OwnedSegment {
    int tensor;
    size_t flat_offset, shard_offset, size;
};

// which tensors a bucket layout packs: all of them (one reduction group), or the expert tensors and the others
// apart (two groups, under expert parallelism)
enum class TensorGroup { All, Dense, Experts };
inline bool in_group(TensorGroup g, const TensorSpec& tensor) {
    return g == TensorGroup::All || (g == TensorGroup::Experts) == tensor.expert;
}

struct BucketLayout {
    std::vector<Bucket> buckets;  // the embeddings' bucket is the last one (empty for the experts)
    std::vector<int> unit_bucket;
    std::vector<size_t> unit_offset;  // where a unit starts inside its bucket's packed layout
    std::vector<std::vector<Segment>> unit_segments;  // the segments of each unit that the layout packs
    size_t shard_size = 0;            // Σ piece
    size_t padded_total = 0;          // Σ padded: what a reduce-scatter or all-gather of every bucket moves
    size_t max_padded = 0, max_piece = 0;  // over the buckets other than the embeddings'
    const Bucket& embeddings() const { return buckets.back(); }
};

// the buckets of one rank's share of the model: its tensor-parallel share of its part. A bucket never spans
// two chunks of a pipeline stage, whose backward passes run at different times. Only the tensors of `group`
// (the rank holding E/ep experts): a unit without any keeps its place in the buckets, empty, so every group
// has the same unit order and the embeddings' bucket last.
inline BucketLayout bucket_layout(const GPTConfig& c, int dp, size_t bucket_floats, int tp, const ModelPart& part,
                                  int ep = 1, TensorGroup group = TensorGroup::All) {
    BucketLayout lay;
    ModelTable table = model_table(c);
    int L = part.layers(), units = num_units(L), emb = embedding_unit(L);
    std::vector<std::vector<Segment>> unit_slices = unit_segments(c, tp, part, ep);
    lay.unit_bucket.assign(units, 0);
    lay.unit_offset.assign(units, 0);
    lay.unit_segments.resize(units);
    std::vector<bool> chunk_top(units, false);  // the unit of a chunk's last layer, where its backward begins
    for (int k = 0; k + 1 < part.chunks(); k++) chunk_top[layer_unit(L, part.chunk_begin(k + 1) - 1)] = true;
    for (int u = 0; u < units; u++) {
        bool fresh = lay.buckets.empty() || u == emb || chunk_top[u] || lay.buckets.back().size >= bucket_floats;
        if (fresh) {
            lay.buckets.emplace_back();
            lay.buckets.back().first_unit = u;
        }
        Bucket& b = lay.buckets.back();
        lay.unit_bucket[u] = (int)lay.buckets.size() - 1;
        lay.unit_offset[u] = b.size;
        for (const Segment& s : unit_slices[u])
            if (in_group(group, table[s.tensor])) b.segments.push_back(s), b.size += s.size, lay.unit_segments[u].push_back(s);
        b.last_unit = u;
    }
    for (size_t i = 0; i < lay.buckets.size(); i++) {
        Bucket& b = lay.buckets[i];
        b.padded = (b.size + dp - 1) / dp * dp;
        b.piece = b.padded / dp;
        b.shard_offset = lay.shard_size;
        lay.shard_size += b.piece;
        lay.padded_total += b.padded;
        if (i + 1 < lay.buckets.size()) {
            lay.max_padded = std::max(lay.max_padded, b.padded);
            lay.max_piece = std::max(lay.max_piece, b.piece);
        }
    }
    return lay;
}
inline BucketLayout bucket_layout(const GPTConfig& c, int dp, size_t bucket_floats, int tp = 1) {
    return bucket_layout(c, dp, bucket_floats, tp, whole_part(c));
}

// the element ranges of bucket b that piece `rank` covers (the padding belongs to no tensor)
inline std::vector<OwnedSegment> owned_segments(const Bucket& b, int rank) {
    std::vector<OwnedSegment> owned;
    size_t lo = rank * b.piece, hi = lo + b.piece, packed = 0;
    for (const Segment& s : b.segments) {
        size_t a = std::max(lo, packed), e = std::min(hi, packed + s.size);
        if (a < e) owned.push_back({s.tensor, s.offset + (a - packed), b.shard_offset + (a - lo), e - a});
        packed += s.size;
    }
    return owned;
}

// flat buffer <-> a bucket's packed layout
template <typename floatX>
inline void pack_bucket(const Bucket& b, const floatX* flat, floatX* packed) {
    ProfileScope op("bucket copies", OpKind::DP);  // the copies dp's collectives need, charged to dp
    for (const Segment& s : b.segments) device_copy<floatX>(packed, flat + s.offset, s.size), packed += s.size;
    device_zero<floatX>(packed, b.padded - b.size);
}
template <typename floatX>
inline void unpack_bucket(const Bucket& b, const floatX* packed, floatX* flat) {
    ProfileScope op("bucket copies", OpKind::DP);
    for (const Segment& s : b.segments) device_copy<floatX>(flat + s.offset, packed, s.size), packed += s.size;
}

// --fp8-param-gather's wire layout of these buckets, and its casts (they read the bucket layout above)
#include "llmc/fp8_gather.cuh"

enum ZeroBuffer { ZB_PARAMS, ZB_GRADS };

// What crosses pipeline stages here (llmc/pp.cuh): the gradient norm, summed over the stages, and the tied
// embeddings, which the first and the last stage both hold when they are two ranks (not in DualPipeV's V,
// whose rank 0 runs both ends with one copy). Their gradients are the embedding's on the first stage and the
// classifier's on the last; once each stage has reduced its embedding bucket over dp, the two sum them (a group
// of those two ranks), so both copies take the same update. The bucket has the same layout on both (the last
// stage holds wpe too, never read), so the reduced pieces line up. Null without pp.
struct StageLinks {
    Comm* stages = nullptr;  // the pp group
    Comm* tied = nullptr;    // the first and the last stage (on those two only)
};

// Expert parallelism's groups (llmc/grid.cuh): the expert replicas, which reduce and shard the expert tensors'
// gradients, and the ep group, whose ranks hold different experts (the gradient norm sums over it). Null
// without expert parallelism.
struct ExpertLinks {
    Comm* replicas = nullptr;
    Comm* ep = nullptr;
};

// this rank's shards of the model states: its pieces of every bucket, back to back (null where the stage keeps
// the state whole in the model)
template <typename floatX>
struct ZeroShards {
    float *m = nullptr, *v = nullptr;  // AdamW's moments: ZeRO >= 1
    float* master = nullptr;           // ZeRO >= 1 on the GPU (the CPU's parameters are fp32)
    floatX* grads = nullptr;           // ZeRO >= 2
    floatX* params = nullptr;          // ZeRO 3
};

// The runtime is a template over the model's storage type (llmc/device.cuh): the same code on host buffers
// (CPU) and device buffers (GPU).
template <typename floatX>
struct DataParallel : ParamStore<floatX> {
    // A bucket's staging: its packed copy and this rank's piece of it, for a reduction in flight (or, in ZeRO-3,
    // its gathered parameters). The embeddings have a staging of their own; the other buckets share two.
    using Code = typename Fp8Scaling<floatX>::Code;
    struct Staging {
        floatX *packed = nullptr, *piece = nullptr;
        // --fp8-param-gather, ZeRO-3: this rank's piece on the wire, every rank's, and the codes taken from them
        uint8_t *wire_piece = nullptr, *wire = nullptr;
        Code* codes = nullptr;
        bool taken = false;  // the gathered wire is unpacked
        int bucket = -1;         // the bucket using it; -1 when free
        bool in_flight = false;  // its reduction has started
        CommRequest request;
        uint64_t order = 0;  // when its reduction started, to retire the oldest first
    };

    // A reduction group: the ranks that reduce and shard some of the tensors, those tensors' buckets, this
    // rank's pieces of them and the staging of its collectives. Every hook below runs on each group in turn,
    // always in the same order, so the collectives of every group start in the same order on all its ranks.
    struct Group {
        Comm* comm = nullptr;
        int N = 1, rank = 0;
        bool experts = false;  // the expert tensors, over the expert replicas
        BucketLayout layout;   // its buckets' shard offsets count from the start of the rank's shards
        std::vector<std::vector<OwnedSegment>> owned;  // per bucket
        std::vector<Staging> reduce_staging;  // [0] the embeddings', [1], [2] the rest
        std::vector<Staging> gather_staging;  // ZeRO-3, same arrangement
        std::vector<int> reduce_staging_of;  // per bucket: the reduce staging holding it this micro-step, or -1
        std::vector<int> units_done;      // per bucket, this micro-step
        int current_gather = -1;          // ZeRO-3: the non-embedding bucket in use
        // --fp8-param-gather (llmc/fp8_gather.cuh): each bucket's wire layout; under ZeRO-1/2 every FP8 weight's
        // codes (bucket b's from codes_at[b]) and the staging of one gather
        std::vector<Fp8BucketWire> wires;
        size_t scales_first = 0, scales = 0;  // its FP8 weights' scales among the rank's
        Code* codes = nullptr;
        std::vector<size_t> codes_at;
        uint8_t *wire_piece = nullptr, *wire = nullptr;
        int pass_low = 0, pass_high = 0;  // the buckets of the pass under way, besides the embeddings'
        int emb_bucket() const { return (int)layout.buckets.size() - 1; }
    };

    GPTModel<floatX>& m;
    Comm& comm;  // the dp group: every tensor's gradients without expert parallelism, the others' with it
    int stage, N, rank;
    StageLinks links;
    ExpertLinks expert_links;
    std::vector<Group> groups;  // [0] over comm; [1] the experts over their replicas, under expert parallelism
    ZeroShards<floatX> shard;
    bool last_micro_step = true, backward = false;
    uint64_t started = 0;
    GradientPlan plan;  // which gradients are partial sums over tp, and which the norm counts on another rank
    std::unique_ptr<Fp8Gathers<floatX>> fp8;  // --fp8-param-gather: the FP8 weights travel as codes

    DataParallel(GPTModel<floatX>& model, Comm& dp_comm, int zero_stage, size_t bucket_floats, StageLinks stage_links = {},
                 ExpertLinks experts = {}, bool fp8_param_gather = false)
        : m(model), comm(dp_comm), stage(zero_stage), N(dp_comm.size), rank(dp_comm.rank), links(stage_links),
          expert_links(experts) {
        int ep = experts.replicas && experts.ep ? experts.ep->size : 1;
        if (ep > 1) {
            add_group(comm, false, bucket_floats, ep, TensorGroup::Dense);
            add_group(*experts.replicas, true, bucket_floats, ep, TensorGroup::Experts);
        } else {
            add_group(comm, false, bucket_floats, 1, TensorGroup::All);
        }
        if (!engaged()) return;
        m.store = this;
        plan = gradient_plan(m.table, m.param_sizes, m.tp.size(), m.tp.spec.rank, m.tp.spec.sp,
                             m.part.tied_across_stages() && !m.part.first);
        if (fp8_param_gather) lay_fp8_wires();
        m.ledger.template allocate<floatX>(buffers(shard, groups, stage, fp8.get()));
        if (fp8) offer_fp8_codes();
    }

    // The runtime's memory, as the list the constructor allocates and --plan reads (llmc/plan.h): made from the
    // sizes alone (each group's ranks, buckets and, with fp8, wires; fp8's count of scales), so the shards and
    // the groups may be ones never allocated. In order: the shards the stage keeps (from ZeRO-1 the moments and on
    // the GPU the master weights, from ZeRO-2 the gradients, at ZeRO-3 the parameters); each group's staging for
    // its reductions in flight, the embeddings' bucket and two others, each with its piece, and under ZeRO-3 for
    // its gathers, the embeddings' bucket, the bucket in use and the next one (a group of one rank without ZeRO
    // stages nothing); and under --fp8-param-gather the buffers of the gathers (fp8_gather_buffers).
    static BufferList buffers(ZeroShards<floatX>& shard, std::vector<Group>& groups, int stage, Fp8Gathers<floatX>* fp8) {
        size_t n = 0;
        for (const Group& g : groups) n += g.layout.shard_size;
        BufferList list;
        if (stage >= 1) {
            if (device_of<floatX> == Device::CUDA) list.push_back(planned("zero master", MEM_MASTER_WEIGHTS, shard.master, n));
            list.push_back(planned("zero adam_m", MEM_OPTIMIZER, shard.m, n));
            list.push_back(planned("zero adam_v", MEM_OPTIMIZER, shard.v, n));
        }
        if (stage >= 2) list.push_back(planned("zero grads", MEM_GRADS, shard.grads, n));
        if (stage >= 3) list.push_back(planned("zero params", MEM_PARAMS, shard.params, n));
        for (Group& g : groups) {
            if (g.N == 1 && stage == 0) continue;  // one rank of the group (tp or pp alone): nothing to stage
            const Bucket& e = g.layout.embeddings();
            g.reduce_staging.resize(3);
            if (stage == 3) g.gather_staging.resize(3);
            for (int i = 0; i < 3; i++) {
                size_t padded = i == 0 ? e.padded : g.layout.max_padded, piece = i == 0 ? e.piece : g.layout.max_piece;
                list.push_back(planned("reduce staging", MEM_COMM, g.reduce_staging[i].packed, padded));
                list.push_back(planned("reduce staging piece", MEM_COMM, g.reduce_staging[i].piece, piece));
                if (stage == 3) list.push_back(planned("gather staging", MEM_COMM, g.gather_staging[i].packed, padded));
            }
        }
        if (fp8) append(list, fp8_gather_buffers(groups, stage, *fp8));
        return list;
    }

    // --fp8-param-gather's buffers: every FP8 weight's scales, and in each group with FP8 weights the codes the layers
    // read (ZeRO-1/2: every FP8 weight's, kept; ZeRO-3: a gathered bucket's, in each of its three gather stagings)
    // and the wire's staging (ZeRO-1/2: the rank's piece and the gathered pieces; ZeRO-3: both in each staging)
    static BufferList fp8_gather_buffers(std::vector<Group>& groups, int stage, Fp8Gathers<floatX>& fp8) {
        BufferList list{planned("fp8 gather scales", MEM_PARAMS, fp8.pairs, 2 * fp8.scales)};
        for (Group& g : groups) {
            size_t codes = 0, max_codes = 0, max_piece = 0;
            for (const Fp8BucketWire& w : g.wires)
                codes += w.codes, max_codes = std::max(max_codes, w.codes), max_piece = std::max(max_piece, w.piece_bytes);
            if (max_codes == 0) continue;
            if (stage == 3) {
                for (Staging& s : g.gather_staging) {
                    list.push_back(planned("fp8 gather codes", MEM_COMM, s.codes, max_codes));
                    list.push_back(planned("fp8 wire piece", MEM_COMM, s.wire_piece, max_piece));
                    list.push_back(planned("fp8 wire", MEM_COMM, s.wire, g.N * max_piece));
                }
            } else {
                list.push_back(planned("fp8 gather codes", MEM_PARAMS, g.codes, codes));
                list.push_back(planned("fp8 wire piece", MEM_COMM, g.wire_piece, max_piece));
                list.push_back(planned("fp8 wire", MEM_COMM, g.wire, g.N * max_piece));
            }
        }
        return list;
    }

    // --fp8-param-gather: each group's wire layouts, laid out before the buffers of its gathers are allocated
    void lay_fp8_wires() {
        std::string why = fp8_param_gather_problem(stage, m.fp8.recipe, (long)m.B * m.T / m.cp.spec.size);
        if (!why.empty()) fail("--fp8-param-gather 1: %s", why.c_str());
        fp8.reset(new Fp8Gathers<floatX>());
        fp8->recipe = m.fp8.recipe;
        for (Group& g : groups) {
            g.scales_first = fp8->scales;
            g.wires = fp8_bucket_wires(m.config, m.part, m.tp.size(), g.layout, g.N, fp8->recipe, sizeof(floatX), fp8->scales);
            g.scales = fp8->scales - g.scales_first;
            size_t codes = 0;
            for (const Fp8BucketWire& w : g.wires) g.codes_at.push_back(codes), codes += w.codes;
        }
    }
    // ... and once they are: under ZeRO-1/2 the codes each bucket's FP8 weights keep offered; the FP8 layers then
    // look their weights up in fp8->ready
    void offer_fp8_codes() {
        if (stage < 3)
            for (Group& g : groups)
                for (size_t b = 0; b < g.wires.size(); b++) fp8->offer(g.wires[b], m.params, false, g.codes + g.codes_at[b]);
        m.fp8.ready = &fp8->ready;
        if (fp8_gathers_experts(fp8->recipe)) m.fp8_experts.ready = &fp8->ready;
    }

    // one rank without sharding needs none of this: the model runs on its flat buffers
    bool engaged() const { return N > 1 || stage > 0 || m.tp.on() || links.stages; }
    static ModelBuffers model_buffers(int stage) { return ModelBuffers{stage < 3, stage < 2, stage < 1}; }
    // the elements of a rank's shards (its moments, and its master weights, gradients and parameters as the
    // stage shards them): every group's pieces
    size_t shard_size() const {
        size_t n = 0;
        for (const Group& g : groups) n += g.layout.shard_size;
        return n;
    }
    // where each element of this rank's shards lies in the whole model, given where its share does (share_runs,
    // in the share's order); the padding of the buckets lies nowhere
    std::vector<ShareRun> shard_runs(const std::vector<ShareRun>& share) const {
        std::vector<ShareRun> runs;
        for (const Group& g : groups)
            for (const std::vector<OwnedSegment>& owned : g.owned)
                for (const OwnedSegment& s : owned) {
                    size_t lo = s.flat_offset, hi = lo + s.size;
                    auto it = std::upper_bound(share.begin(), share.end(), lo,
                                               [](size_t at, const ShareRun& r) { return at < r.local; });
                    if (it != share.begin()) --it;
                    for (; it != share.end() && it->local < hi; ++it) {
                        size_t a = std::max(lo, it->local), b = std::min(hi, it->local + it->count);
                        if (a < b) runs.push_back({it->whole + (a - it->local), s.shard_offset + (a - lo), b - a});
                    }
                }
        return runs;
    }
    size_t num_buckets() const {
        size_t n = 0;
        for (const Group& g : groups) n += g.layout.buckets.size();
        return n;
    }

    // ---- the hooks the model calls (ParamStore) ---------------------------------------------------------------

    void begin_pass(bool is_backward, int low_unit, int high_unit) override {
        backward = is_backward;
        for (Group& g : groups) {
            g.pass_low = g.layout.unit_bucket[low_unit];
            g.pass_high = g.layout.unit_bucket[high_unit];
            if (stage == 3) {
                gather(g, g.emb_bucket(), g.gather_staging[0]);
                gather(g, backward ? g.pass_low : g.pass_high, g.gather_staging[1]);
                g.current_gather = -1;
            }
            if (backward) std::fill(g.units_done.begin(), g.units_done.end(), 0);
        }
    }

    void end_pass() override {
        for (Group& g : groups) {
            for (Staging& s : g.gather_staging) {
                if (s.bucket >= 0) g.comm->wait(s.request);
                s.bucket = -1;
            }
            g.current_gather = -1;
        }
    }

    // a unit's tensors sit in the buckets of each group: one view holding them all
    ParamViews<floatX> params(int unit) override {
        if (stage < 3) return unit_views(m.units[unit], m.params, false);
        ParamViews<floatX> v;
        for (Group& g : groups) merge_views(v, g, unit, gathered_params(g, unit));
        return v;
    }

    ParamViews<floatX> grads(int unit) override {
        if (stage < 2) return unit_views(m.units[unit], m.grads, false);
        ParamViews<floatX> v;
        for (Group& g : groups) merge_views(v, g, unit, grad_staging(g, unit));
        return v;
    }

    void grads_done(int unit) override {
        for (Group& g : groups) {
            int b = g.layout.unit_bucket[unit];
            const Bucket& bk = g.layout.buckets[b];
            if (stage >= 2) grad_staging(g, unit);  // a unit no one wrote (empty on this stage) still needs one
            if (++g.units_done[b] == bk.last_unit - bk.first_unit + 1 && (stage >= 2 || last_micro_step)) {
                if (stage < 2) {
                    sum_partials(bk, m.grads, false);
                    if (g.N == 1) continue;  // one rank in the group (tp alone): the flat gradients are final
                    pack_bucket(bk, m.grads, g.reduce_staging[acquire_reduce_staging(g, b)].packed);
                } else {
                    sum_partials(bk, g.reduce_staging[g.reduce_staging_of[b]].packed, true);
                }
                Staging& s = g.reduce_staging[g.reduce_staging_of[b]];
                s.request = g.comm->reduce_scatter(s.packed, s.piece, bk.piece, dtype_of<floatX>());
                s.order = ++started;
                s.in_flight = true;
                g.reduce_staging_of[b] = -1;  // the next micro-step's gradients of this bucket go to a fresh staging
            }
        }
        progress();
    }

    // ---- what the trainer calls ------------------------------------------------------------------------------

    void begin_micro_step(bool last) { last_micro_step = last; }

    void zero_grad() {
        ProfileScope op("zero gradients", OpKind::Optimizer);
        if (stage < 2) gpt_zero_grad(m);
        else device_zero<floatX>(shard.grads, shard_size());
    }

    // finishes the gradient reduction and returns the global gradient norm, the same value on every rank, so
    // that the trainer's decision to take or skip the update (a non-finite norm) is the same everywhere
    double grad_norm() {
        if (!engaged()) return gpt_grad_norm(m);
        for (Group& g : groups) finish_reductions(g);
        sum_tied_gradients();
        // The norm from the owned pieces the plan counts here, summed in bucket order, then over the group's ranks
        // (the experts' also over the ep group, whose ranks hold different experts), the groups added in order;
        // then over the tp ranks and the pipeline stages: the same sums in every stage, on every rank.
        double total = 0.0;
        for (Group& g : groups) {
            Spans<floatX> spans;
            for (auto& segs : g.owned)
                for (const OwnedSegment& s : segs) {
                    const floatX* base = reduced_grads() + (stage >= 2 ? s.shard_offset : s.flat_offset);
                    for (const ShareRange& r : plan.counted(s.flat_offset, s.size))
                        spans.push_back({base + (r.offset - s.flat_offset), (long)r.count});
                }
            double group_total = sum_in_rank_order(*g.comm, sum_of_squares_spans(spans, m.workspace));
            if (g.experts) group_total = sum_in_rank_order(*expert_links.ep, group_total);
            total += group_total;
        }
        if (m.tp.on()) total = sum_in_rank_order(*m.tp.comm, total);
        if (links.stages) total = sum_in_rank_order(*links.stages, total);
        return sqrt(total);
    }

    // the optimizer step on the reduced gradients, clipped to a global norm of 1 (norm: from grad_norm())
    void update(float lr, float weight_decay, double norm) {
        float scale = clip_scale(norm, 1.0f);
        if (stage == 0) return gpt_update(m, lr, weight_decay, scale);
        m.adam_step++;
        floatX* p = stage == 3 ? shard.params : m.params;
        const floatX* g = reduced_grads();
        for (const OwnedSegment& s : all_owned()) {
            if (!m.table[s.tensor].trained) continue;  // the router's selection bias: set_values moves it
            size_t pi = stage == 3 ? s.shard_offset : s.flat_offset, gi = stage >= 2 ? s.shard_offset : s.flat_offset;
            adamw_update(p + pi, shard.master ? shard.master + s.shard_offset : nullptr, g + gi, shard.m + s.shard_offset,
                         shard.v + s.shard_offset, (long)s.size, lr, m.table[s.tensor].decayed ? weight_decay : 0.0f, scale,
                         m.adam_step, m.seed, (long)s.flat_offset);
        }
        if (fp8) params_changed();
        else if (stage < 3) all_gather_params(m.params);
    }

    // The parameters changed on every rank (an update, or a model installed): under --fp8-param-gather the FP8
    // weights' scales are made anew from the owned elements, and under ZeRO-1/2 the updated pieces gathered, the FP8
    // weights as codes. Collective.
    void params_changed() {
        if (!fp8) return;
        DeviceTemp<floatX, float> amaxes(fp8->scales);
        device_zero<floatX>(amaxes.data, fp8->scales);
        for (Group& g : groups)
            for (size_t b = 0; b < g.wires.size(); b++)
                if (!g.wires[b].weights.empty()) fp8->piece_amaxes(amaxes.data, g.wires[b], g.rank, owned_values(g, (int)b));
        std::vector<float> host(fp8->scales);
        device_download<floatX>(host.data(), amaxes.data, fp8->scales);
        for (Group& g : groups)  // the experts' scales are shared over tp alone, as their layers' casts share them
            if (g.scales)
                fp8->make_scales(host.data(), g.scales_first, g.scales, *g.comm,
                                 g.experts ? m.fp8_experts.group : m.fp8.group);
        if (stage == 3) return;  // the gathers cast the pieces they send
        for (Group& g : groups)
            for (size_t b = 0; b < g.layout.buckets.size(); b++) {
                const Fp8BucketWire& w = g.wires[b];
                if (w.weights.empty()) {
                    all_gather_bucket(g, (int)b, m.params);
                    continue;
                }
                fp8->pack(g.wire_piece, w, g.rank, owned_values(g, (int)b));
                g.comm->wait(g.comm->all_gather(g.wire_piece, g.wire, w.piece_bytes, DType::U8));
                fp8->unpack(g.wire, w, g.codes + g.codes_at[b],
                            [&](int r, const Fp8WireRun& run) { return r == g.rank ? nullptr : m.params + run.flat; });
            }
    }

    // Under --fp8-param-gather with ZeRO-1/2, the flat parameters' values made whole (the FP8 weights' elements
    // this rank does not own arrive as codes only): before anything reads them whole. Collective.
    void refresh_params() {
        if (fp8 && stage < 3) all_gather_params(m.params);
    }

    // the mean of a value over the dp group (the loss, for logging)
    double mean(double local) {
        if (N == 1) return local;
        double total = 0.0;
        comm.wait(comm.all_reduce(&local, &total, 1, DType::F64));
        return total / N;
    }

    // Every rank's pieces of the parameters, gathered into the flat buffer `flat`: from the shards under ZeRO-3
    // (to save a checkpoint), or, under ZeRO-1 and 2, from the pieces each rank has just updated in its own
    // flat buffer. Collective.
    void all_gather_params(floatX* flat) {
        for (Group& g : groups)
            for (size_t b = 0; b < g.layout.buckets.size(); b++) all_gather_bucket(g, (int)b, flat);
    }

    // fp32 values of elements [at, at + n) of this rank's share, wherever it keeps them: its flat parameters and
    // master weights where they are whole (gpt_set_values), and the pieces it owns of its shards (the master
    // weights under ZeRO >= 1 on the GPU, the parameters under ZeRO-3). Each rank that holds the elements writes
    // the same values (the router's selection bias), so the copies stay equal without a collective.
    void set_values(size_t at, const float* values, size_t n) {
        if (stage < 3) gpt_set_values(m, at, values, n);
        for (const OwnedSegment& s : all_owned()) {
            size_t lo = std::max(at, s.flat_offset), hi = std::min(at + n, s.flat_offset + s.size);
            if (lo >= hi) continue;
            size_t into = s.shard_offset + (lo - s.flat_offset);
            if (shard.master) device_upload<floatX>(shard.master + into, values + (lo - at), hi - lo);
            if (shard.params) upload_from_float(shard.params + into, values + (lo - at), hi - lo);
        }
    }

    // ZeRO-3: keep this rank's pieces of full flat parameters (after initialization or loading)
    void scatter_params(const floatX* flat) {
        for (const OwnedSegment& s : all_owned())
            device_copy<floatX>(shard.params + s.shard_offset, flat + s.flat_offset, s.size);
    }

    // ZeRO >= 1 on the GPU: this rank's pieces of the fp32 parameters `share` (its whole tp share, on the host)
    // become its master weights, and under ZeRO-3 its parameter shard, rounded to nearest as gpt_set_params does
    void set_master(const float* share) {
        for (const OwnedSegment& s : all_owned())
            device_upload<floatX>(shard.master + s.shard_offset, share + s.flat_offset, s.size);
        if (shard.params) convert_on_device(shard.params, shard.master, (long)shard_size());
    }

    // ... and back: every rank's pieces of the master weights, gathered bucket by bucket into `share` on the host
    // (the fp32 values a checkpoint saves). Collective.
    void get_master(float* share) {
        std::vector<float> host;
        for (Group& g : groups)
            for (const Bucket& bk : g.layout.buckets) {
                DeviceTemp<floatX, float> packed(bk.padded);
                g.comm->wait(g.comm->all_gather(shard.master + bk.shard_offset, packed.data, bk.piece, DType::F32));
                host.resize(bk.padded);
                device_download<floatX>(host.data(), packed.data, bk.padded);
                size_t at = 0;
                for (const Segment& s : bk.segments)
                    memcpy(share + s.offset, host.data() + at, s.size * sizeof(float)), at += s.size;
            }
    }

   private:
    // bucket b of group g gathered into `flat`, each rank's piece as stored
    void all_gather_bucket(Group& g, int b, floatX* flat) {
        const Bucket& bk = g.layout.buckets[b];
        Staging& s = g.reduce_staging[b == g.emb_bucket() ? 0 : 1];
        const floatX* mine = shard.params ? shard.params + bk.shard_offset : s.piece;
        if (!shard.params)
            for (const OwnedSegment& o : g.owned[b])
                device_copy<floatX>(s.piece + (o.shard_offset - bk.shard_offset), flat + o.flat_offset, o.size);
        g.comm->wait(g.comm->all_gather(mine, s.packed, bk.piece, dtype_of<floatX>()));
        unpack_bucket(bk, s.packed, flat);
    }

    // where this rank's current values of a run of its piece of bucket b are: its parameter shard (ZeRO-3), or
    // the flat parameters, whose owned elements it has just updated
    auto owned_values(const Group& g, int b) const {
        size_t piece_start = g.rank * g.layout.buckets[b].piece, shard_at = g.layout.buckets[b].shard_offset;
        return [this, piece_start, shard_at](const Fp8WireRun& run) -> const floatX* {
            return shard.params ? shard.params + shard_at + (run.packed - piece_start) : m.params + run.flat;
        };
    }

    // a group of the tensors `which`, reduced over `over`; its pieces follow the previous groups' in the shards
    void add_group(Comm& over, bool experts, size_t bucket_floats, int ep, TensorGroup which) {
        Group g;
        g.comm = &over, g.N = over.size, g.rank = over.rank, g.experts = experts;
        g.layout = bucket_layout(m.config, g.N, bucket_floats, m.tp.size(), m.part, ep, which);
        size_t before = shard_size();
        for (Bucket& b : g.layout.buckets) b.shard_offset += before;
        for (const Bucket& b : g.layout.buckets) g.owned.push_back(owned_segments(b, g.rank));
        g.reduce_staging_of.assign(g.layout.buckets.size(), -1);
        g.units_done.assign(g.layout.buckets.size(), 0);
        groups.push_back(std::move(g));
    }

    // every owned segment of every group, in group and bucket order
    std::vector<OwnedSegment> all_owned() const {
        std::vector<OwnedSegment> all;
        for (const Group& g : groups)
            for (const auto& segs : g.owned) all.insert(all.end(), segs.begin(), segs.end());
        return all;
    }

    // the views of a unit's tensors in group g, packed from `packed`, into v (the other groups' stay as they are)
    static void merge_views(ParamViews<floatX>& v, const Group& g, int unit, floatX* packed) {
        ParamViews<floatX> mine = unit_views(g.layout.unit_segments[unit], packed + g.layout.unit_offset[unit], true);
        for (const Segment& s : g.layout.unit_segments[unit]) v.t[s.tensor] = mine[s.tensor];
    }

    // ZeRO-3: the gathered bucket of group g holding the unit, ready to read; the next one of the pass prefetched
    floatX* gathered_params(Group& g, int unit) {
        int b = g.layout.unit_bucket[unit];
        Staging* st = &g.gather_staging[0];
        if (b != g.emb_bucket()) {
            if (b != g.current_gather) {
                if (g.current_gather >= 0) gather_staging_for(g, g.current_gather)->bucket = -1;  // done with it
                g.current_gather = b;
                int next = backward ? b + 1 : b - 1;
                if (next >= g.pass_low && next <= g.pass_high) gather(g, next, *free_gather_staging(g, b));
            }
            st = gather_staging_for(g, b);
        }
        g.comm->wait(st->request);
        take(g, *st);
        return st->packed;
    }

    // ZeRO-2/3: the staging of group g's bucket holding the unit, zeroed when the micro-step first touches it
    floatX* grad_staging(Group& g, int unit) {
        int b = g.layout.unit_bucket[unit];
        if (g.reduce_staging_of[b] < 0) {
            int s = acquire_reduce_staging(g, b);
            device_zero<floatX>(g.reduce_staging[s].packed, g.layout.buckets[b].padded);
        }
        return g.reduce_staging[g.reduce_staging_of[b]].packed;
    }

    // where the reduced gradients are: the shard under ZeRO-2/3, the flat buffer otherwise
    const floatX* reduced_grads() const { return stage >= 2 ? shard.grads : m.grads; }

    // The first and the last stage add their reduced gradients of the tied embeddings, as far as this rank
    // reads them: its piece of the shard under ZeRO-2/3; under ZeRO-1 the same piece of the flat tensors (the
    // bucket's packed order is their flat order, wte then wpe); under ZeRO-0 all of them. The embeddings are
    // never expert tensors: they are the first group's.
    void sum_tied_gradients() {
        if (!links.tied) return;
        const Bucket& e = groups[0].layout.embeddings();
        size_t begin = stage == 1 ? std::min(groups[0].rank * e.piece, e.size) : 0;
        size_t n = stage == 0 ? e.size : stage == 1 ? std::min(e.piece, e.size - begin) : e.piece;
        floatX* g = stage >= 2 ? shard.grads + e.shard_offset : m.grads + e.segments.front().offset + begin;
        links.tied->wait(links.tied->all_reduce(g, g, n, dtype_of<floatX>()));
    }

    // x summed over a group in rank order, the same bits on every rank
    static double sum_in_rank_order(Comm& group, double x) {
        if (group.size == 1) return x;
        std::vector<double> all(group.size);
        group.wait(group.all_gather(&x, all.data(), 1, DType::F64));
        double total = 0.0;
        for (double v : all) total += v;
        return total;
    }

    // Completes the gradients of bucket b that a tp rank holds only partial sums of (the plan's), over the tp
    // ranks holding them, before the bucket is reduced across dp. grads is the flat buffer or, packed, the
    // bucket's staging.
    void sum_partials(const Bucket& b, floatX* grads, bool packed) {
        std::map<int, std::vector<ShareRange>> partials;  // per group size (0: the whole group), where in grads
        size_t running = 0;
        for (const Segment& s : b.segments) {
            size_t at = packed ? running : s.offset;
            plan.for_each_partial(s.offset, s.size, [&](size_t offset, size_t count, int ranks) {
                partials[ranks].push_back({at + (offset - s.offset), count});
            });
            running += s.size;
        }
        for (const auto& [ranks, ranges] : partials) {
            size_t count = 0;
            for (const ShareRange& r : ranges) count += r.count;
            DeviceTemp<floatX, floatX> gathered(count);
            size_t at = 0;
            for (const ShareRange& r : ranges) device_copy<floatX>(gathered.data + at, grads + r.offset, r.count), at += r.count;
            m.tp.sum_in_rank_order(gathered.data, (long)count, ranks);
            at = 0;
            for (const ShareRange& r : ranges) device_copy<floatX>(grads + r.offset, gathered.data + at, r.count), at += r.count;
        }
    }

    // let MPI move the operations in flight while compute goes on
    void progress() {
        for (Group& g : groups)
            for (Staging& s : g.reduce_staging)
                if (s.in_flight) g.comm->test(s.request);
    }

    void gather(Group& g, int b, Staging& st) {
        const Bucket& bk = g.layout.buckets[b];
        st.bucket = b;
        if (fp8 && !g.wires[b].weights.empty()) {
            const Fp8BucketWire& w = g.wires[b];
            fp8->pack(st.wire_piece, w, g.rank, owned_values(g, b));
            st.request = g.comm->all_gather(st.wire_piece, st.wire, w.piece_bytes, DType::U8);
            st.taken = false;
            return;
        }
        st.request = g.comm->all_gather(shard.params + bk.shard_offset, st.packed, bk.piece, dtype_of<floatX>());
    }
    // ... and under --fp8-param-gather, once it has arrived: its pieces unpacked, the FP8 weights' codes offered
    void take(Group& g, Staging& st) {
        if (!fp8 || st.taken || g.wires[st.bucket].weights.empty()) return;
        const Fp8BucketWire& w = g.wires[st.bucket];
        fp8->unpack(st.wire, w, st.codes, [&](int, const Fp8WireRun& run) { return st.packed + run.packed; });
        fp8->offer(w, st.packed, true, st.codes);
        st.taken = true;
    }
    Staging* gather_staging_for(Group& g, int b) {
        for (Staging& s : g.gather_staging)
            if (s.bucket == b) return &s;
        gather(g, b, *free_gather_staging(g, -1));  // not prefetched (the first of a pass)
        return gather_staging_for(g, b);
    }
    Staging* free_gather_staging(Group& g, int keep) {
        for (int i = 1; i <= 2; i++) {
            Staging& s = g.gather_staging[i];
            if (s.bucket < 0 || (s.bucket != keep && s.bucket != g.current_gather)) {
                if (s.bucket >= 0) g.comm->wait(s.request);
                return &s;
            }
        }
        fail("zero: no free gather staging");
    }

    int acquire_reduce_staging(Group& g, int b) {
        std::vector<Staging>& staging = g.reduce_staging;
        if (b == g.emb_bucket()) {
            if (staging[0].in_flight) retire(g, staging[0]);
            staging[0].bucket = b;
            return g.reduce_staging_of[b] = 0;
        }
        Staging* pick = nullptr;
        for (int i = 1; i <= 2 && !pick; i++)
            if (staging[i].bucket < 0) pick = &staging[i];
        if (!pick) {  // both busy: one may still be staging (ZeRO-2/3), so retire the oldest reduction in flight
            for (int i = 1; i <= 2; i++)
                if (staging[i].in_flight && (!pick || staging[i].order < pick->order)) pick = &staging[i];
            if (!pick) fail("zero: both shared reduce stagings are still being filled");
            retire(g, *pick);
        }
        pick->bucket = b;
        return g.reduce_staging_of[b] = (int)(pick - staging.data());
    }

    // finishes a staging's reduction and puts the reduced piece where the stage keeps it
    void retire(Group& g, Staging& s) {
        const Bucket& bk = g.layout.buckets[s.bucket];
        g.comm->wait(s.request);
        if (stage >= 2) {
            accumulate(shard.grads + bk.shard_offset, s.piece, bk.piece);
        } else if (stage == 1) {
            for (const OwnedSegment& o : g.owned[s.bucket])
                device_copy<floatX>(m.grads + o.flat_offset, s.piece + (o.shard_offset - bk.shard_offset), o.size);
        } else {
            g.comm->wait(g.comm->all_gather(s.piece, s.packed, bk.piece, dtype_of<floatX>()));
            unpack_bucket(bk, s.packed, m.grads);
        }
        s.bucket = -1;
        s.in_flight = false;
    }

    void finish_reductions(Group& g) {
        while (true) {
            Staging* oldest = nullptr;
            for (Staging& s : g.reduce_staging)
                if (s.in_flight && (!oldest || s.order < oldest->order)) oldest = &s;
            if (!oldest) break;
            retire(g, *oldest);
        }
    }
};
