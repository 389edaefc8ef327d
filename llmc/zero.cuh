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
// Collectives start only at points every rank reaches in the same order (a bucket completing, a bucket being
// needed, the step's end), never when a test happens to succeed, as MPI requires.
//
// On the GPU every buffer here is device memory (the communicator moves it, staging through the host for MPI):
// packing and unpacking are device copies, and the two sums ZeRO adds (a reduced piece into the gradient
// shard, the tp group's partial sums) are small kernels beside their CPU loops. The fp32 master weights, which
// AdamW updates, are sharded like the moments under ZeRO >= 1; each owned segment is updated with its offset
// in the rank's whole share (adamw_update's global_offset), which the stochastic rounding draws its bits from.
#pragma once

#include <cmath>
#include <vector>

#include "llmc/comm.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/gpt.cuh"

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

struct BucketLayout {
    std::vector<Bucket> buckets;  // the embeddings' bucket is the last one
    std::vector<int> unit_bucket;
    std::vector<size_t> unit_offset;  // where a unit starts inside its bucket's packed layout
    size_t shard_size = 0;            // Σ piece
    size_t padded_total = 0;          // Σ padded: what a reduce-scatter or all-gather of every bucket moves
    size_t max_padded = 0, max_piece = 0;  // over the buckets other than the embeddings'
    const Bucket& embeddings() const { return buckets.back(); }
};

// the buckets of one rank's share of the model: its tensor-parallel share of its part. A bucket never spans
// two chunks of a pipeline stage, whose backward passes run at different times.
inline BucketLayout bucket_layout(const GPTConfig& c, int dp, size_t bucket_floats, int tp, const ModelPart& part) {
    BucketLayout lay;
    int L = part.layers(), units = num_units(L), emb = embedding_unit(L);
    lay.unit_bucket.assign(units, 0);
    lay.unit_offset.assign(units, 0);
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
        for (const Segment& s : unit_segments(c, u, tp, part)) b.segments.push_back(s), b.size += s.size;
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
    for (const Segment& s : b.segments) device_copy<floatX>(packed, flat + s.offset, s.size), packed += s.size;
    device_zero<floatX>(packed, b.padded - b.size);
}
template <typename floatX>
inline void unpack_bucket(const Bucket& b, const floatX* packed, floatX* flat) {
    for (const Segment& s : b.segments) device_copy<floatX>(flat + s.offset, packed, s.size), packed += s.size;
}

enum ZeroBuffer { ZB_PARAMS, ZB_GRADS };

// dst += src, n elements (a reduced piece into the gradient shard)
inline void accumulate(float* dst, const float* src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] += src[i];
}
static __global__ void accumulate_kernel(bf16* dst, const bf16* src, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(__bfloat162float(dst[i]) + __bfloat162float(src[i]));
}
inline void accumulate(bf16* dst, const bf16* src, size_t n) { launch_elementwise(accumulate_kernel, (long)n, dst, src, (long)n); }

// Σ x² over spans of a gradient buffer, added in span order in double: the same sums on every rank and stage.
// On the GPU each span's sum is a float on the device (a span may start at any element), read back together.
inline double sum_of_squares_spans(const std::vector<std::pair<const float*, long>>& spans) {
    double total = 0.0;
    for (const auto& [x, n] : spans) total += sum_of_squares(x, n);
    return total;
}
inline double sum_of_squares_spans(const std::vector<std::pair<const bf16*, long>>& spans) {
    if (spans.empty()) return 0.0;
    DeviceTemp<bf16, float> each(spans.size());
    float* partial = gpu_scratch(GLOBAL_NORM_BLOCKS, "gradient norm");
    for (size_t k = 0; k < spans.size(); k++)
        sum_of_squares_cuda_any_offset(each.data + k, spans[k].first, spans[k].second, partial, main_stream());
    std::vector<float> host(spans.size());
    device_download<bf16>(host.data(), each.data, spans.size());
    double total = 0.0;
    for (float v : host) total += v;
    return total;
}

// What crosses pipeline stages here (llmc/pp.cuh): the gradient norm, summed over the stages, and the tied
// embeddings, which the first and the last stage both hold. Their gradients are the embedding's on the first
// stage and the classifier's on the last; once each stage has reduced its embedding bucket over dp, the two
// sum them (a group of those two ranks), so both copies take the same update. The bucket has the same layout
// on both (the last stage holds wpe too, never read), so the reduced pieces line up. Null without pp.
struct StageLinks {
    Comm* stages = nullptr;  // the pp group
    Comm* tied = nullptr;    // the first and the last stage (on those two only)
};

// The runtime is a template over the model's storage type (llmc/device.cuh): the same code on host buffers
// (CPU) and device buffers (GPU).
template <typename floatX>
struct DataParallel : ParamStore<floatX> {
    GPTModel<floatX>& m;
    Comm& comm;
    int stage, N, rank;
    StageLinks links;
    BucketLayout layout;
    std::vector<std::vector<OwnedSegment>> owned;  // per bucket
    float *shard_m = nullptr, *shard_v = nullptr;  // ZeRO >= 1
    float* shard_master = nullptr;                 // ZeRO >= 1 on the GPU (the CPU's parameters are fp32)
    floatX* shard_grads = nullptr;                 // ZeRO >= 2
    floatX* shard_params = nullptr;                // ZeRO 3

    // A staging slot: a packed bucket and its piece, for a reduction in flight (or, in ZeRO-3, a gathered
    // bucket of parameters). The embeddings have slots of their own; the other buckets share two.
    struct Slot {
        floatX *packed = nullptr, *piece = nullptr;
        int bucket = -1;         // the bucket using it; -1 when free
        bool in_flight = false;  // its reduction has started
        CommRequest request;
        uint64_t order = 0;  // when its reduction started, to retire the oldest first
    };
    std::vector<Slot> reduce_slots;  // [0] the embeddings', [1], [2] the rest
    std::vector<Slot> gather_slots;  // ZeRO-3, same arrangement
    std::vector<int> reduce_slot_of;  // per bucket: the slot holding its staging this micro-step, or -1
    std::vector<int> units_done;      // per bucket, this micro-step
    bool last_micro_step = true, backward = false;
    uint64_t started = 0;
    int current_gather = -1;  // ZeRO-3: the non-embedding bucket in use
    int pass_low = 0, pass_high = 0;  // the buckets of the pass under way, besides the embeddings'

    DataParallel(GPTModel<floatX>& model, Comm& dp_comm, int zero_stage, size_t bucket_floats, StageLinks stage_links = {})
        : m(model), comm(dp_comm), stage(zero_stage), N(dp_comm.size), rank(dp_comm.rank), links(stage_links) {
        layout = bucket_layout(m.config, N, bucket_floats, m.tp.size(), m.part);
        size_t nb = layout.buckets.size();
        for (const Bucket& b : layout.buckets) owned.push_back(owned_segments(b, rank));
        reduce_slot_of.assign(nb, -1);
        units_done.assign(nb, 0);
        if (!engaged()) return;
        m.store = this;
        if (N == 1 && stage == 0) return;  // one rank of dp (tp or pp alone): nothing to stage or shard
        Ledger& led = m.ledger;
        if (stage >= 1) {
            if (device_of<floatX> == Device::CUDA) shard_master = led.alloc<floatX, float>(MEM_MASTER_WEIGHTS, layout.shard_size);
            shard_m = led.alloc<floatX, float>(MEM_OPTIMIZER, layout.shard_size);
            shard_v = led.alloc<floatX, float>(MEM_OPTIMIZER, layout.shard_size);
        }
        if (stage >= 2) shard_grads = led.alloc<floatX, floatX>(MEM_GRADS, layout.shard_size);
        if (stage >= 3) shard_params = led.alloc<floatX, floatX>(MEM_PARAMS, layout.shard_size);
        const Bucket& e = layout.embeddings();
        for (int i = 0; i < 3; i++) {
            Slot s;
            s.packed = led.alloc<floatX, floatX>(MEM_COMM, i == 0 ? e.padded : layout.max_padded);
            s.piece = led.alloc<floatX, floatX>(MEM_COMM, i == 0 ? e.piece : layout.max_piece);
            reduce_slots.push_back(s);
            if (stage == 3) {
                Slot g;
                g.packed = led.alloc<floatX, floatX>(MEM_COMM, i == 0 ? e.padded : layout.max_padded);
                gather_slots.push_back(g);
            }
        }
    }

    // one rank without sharding needs none of this: the model runs on its flat buffers
    bool engaged() const { return N > 1 || stage > 0 || m.tp.on() || links.stages; }
    static ModelBuffers model_buffers(int stage) { return ModelBuffers{stage < 3, stage < 2, stage < 1}; }
    int emb_bucket() const { return (int)layout.buckets.size() - 1; }

    // ---- the hooks the model calls (ParamStore) ---------------------------------------------------------------

    void begin_pass(bool is_backward, int low_unit, int high_unit) override {
        backward = is_backward;
        pass_low = layout.unit_bucket[low_unit];
        pass_high = layout.unit_bucket[high_unit];
        if (stage == 3) {
            gather(emb_bucket(), gather_slots[0]);
            gather(backward ? pass_low : pass_high, gather_slots[1]);
            current_gather = -1;
        }
        if (backward) std::fill(units_done.begin(), units_done.end(), 0);
    }

    void end_pass() override {
        for (Slot& g : gather_slots) {
            if (g.bucket >= 0) comm.wait(g.request);
            g.bucket = -1;
        }
        current_gather = -1;
    }

    ParamViews<floatX> params(int unit) override {
        if (stage < 3) return unit_views(m.units[unit], m.params, false);
        int b = layout.unit_bucket[unit];
        Slot* slot = &gather_slots[0];
        if (b != emb_bucket()) {
            if (b != current_gather) {
                if (current_gather >= 0) slot_for_gather(current_gather)->bucket = -1;  // done with it
                current_gather = b;
                int next = backward ? b + 1 : b - 1;
                if (next >= pass_low && next <= pass_high) gather(next, *free_gather_slot(b));
            }
            slot = slot_for_gather(b);
        }
        comm.wait(slot->request);
        return unit_views(m.units[unit], slot->packed + layout.unit_offset[unit], true);
    }

    ParamViews<floatX> grads(int unit) override {
        if (stage < 2) return unit_views(m.units[unit], m.grads, false);
        int b = layout.unit_bucket[unit];
        if (reduce_slot_of[b] < 0) {
            int s = acquire_reduce_slot(b);
            device_zero<floatX>(reduce_slots[s].packed, layout.buckets[b].padded);
        }
        return unit_views(m.units[unit], reduce_slots[reduce_slot_of[b]].packed + layout.unit_offset[unit], true);
    }

    void grads_done(int unit) override {
        int b = layout.unit_bucket[unit];
        const Bucket& bk = layout.buckets[b];
        if (stage >= 2 && reduce_slot_of[b] < 0) grads(unit);  // a unit no one wrote (empty on this stage)
        if (++units_done[b] == bk.last_unit - bk.first_unit + 1 && (stage >= 2 || last_micro_step)) {
            if (stage < 2) {
                sum_sequence_partials(bk, m.grads, false);
                if (N == 1) return;  // one dp rank (tensor parallelism alone): the flat gradients are final
                pack_bucket(bk, m.grads, reduce_slots[acquire_reduce_slot(b)].packed);
            } else {
                sum_sequence_partials(bk, reduce_slots[reduce_slot_of[b]].packed, true);
            }
            Slot& s = reduce_slots[reduce_slot_of[b]];
            s.request = comm.reduce_scatter(s.packed, s.piece, bk.piece, dtype_of<floatX>());
            s.order = ++started;
            s.in_flight = true;
            reduce_slot_of[b] = -1;  // the next micro-step's gradients of this bucket go to a fresh staging
        }
        progress();
    }

    // ---- what the trainer calls ------------------------------------------------------------------------------

    void begin_micro_step(bool last) { last_micro_step = last; }

    void zero_grad() {
        if (stage < 2) gpt_zero_grad(m);
        else device_zero<floatX>(shard_grads, layout.shard_size);
    }

    // finishes the gradient reduction and returns the global gradient norm, the same value on every rank, so
    // that the trainer's decision to take or skip the update (a non-finite norm) is the same everywhere
    double grad_norm() {
        if (!engaged()) return gpt_grad_norm(m);
        finish_reductions();
        sum_tied_gradients();
        // The norm from the owned pieces, summed in bucket order, then over the dp ranks, the tp ranks (a tensor
        // every tp rank holds whole counts once) and the pipeline stages (the tied embeddings count on the first):
        // the same sums in every stage, on every rank.
        bool embedding_copy = links.stages && !m.part.first;
        std::vector<std::pair<const floatX*, long>> spans;
        for (auto& segs : owned)
            for (const OwnedSegment& s : segs)
                if ((m.tp.spec.rank == 0 || !is_replicated(s.tensor)) && !(embedding_copy && (s.tensor == WTE || s.tensor == WPE)))
                    spans.push_back({reduced_grads() + (stage >= 2 ? s.shard_offset : s.flat_offset), (long)s.size});
        double total = sum_in_rank_order(comm, sum_of_squares_spans(spans));
        if (m.tp.on()) total = sum_in_rank_order(*m.tp.comm, total);
        if (links.stages) total = sum_in_rank_order(*links.stages, total);
        return sqrt(total);
    }

    // the optimizer step on the reduced gradients, clipped to a global norm of 1 (norm: from grad_norm())
    void update(float lr, float weight_decay, double norm) {
        float scale = clip_scale(norm, 1.0f);
        if (stage == 0) return gpt_update(m, lr, weight_decay, scale);
        m.adam_step++;
        floatX* p = stage == 3 ? shard_params : m.params;
        const floatX* g = reduced_grads();
        for (auto& segs : owned)
            for (const OwnedSegment& s : segs) {
                size_t pi = stage == 3 ? s.shard_offset : s.flat_offset, gi = stage >= 2 ? s.shard_offset : s.flat_offset;
                adamw_update(p + pi, shard_master ? shard_master + s.shard_offset : nullptr, g + gi, shard_m + s.shard_offset,
                             shard_v + s.shard_offset, (long)s.size, lr, is_decayed(s.tensor) ? weight_decay : 0.0f, scale,
                             m.adam_step, m.seed, (long)s.flat_offset);
            }
        if (stage < 3) all_gather_params(m.params);
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
        for (size_t b = 0; b < layout.buckets.size(); b++) {
            const Bucket& bk = layout.buckets[b];
            Slot& s = reduce_slots[b + 1 == layout.buckets.size() ? 0 : 1];
            const floatX* mine = shard_params ? shard_params + bk.shard_offset : s.piece;
            if (!shard_params)
                for (const OwnedSegment& o : owned[b])
                    device_copy<floatX>(s.piece + (o.shard_offset - bk.shard_offset), flat + o.flat_offset, o.size);
            comm.wait(comm.all_gather(mine, s.packed, bk.piece, dtype_of<floatX>()));
            unpack_bucket(bk, s.packed, flat);
        }
    }

    // ZeRO-3: keep this rank's pieces of full flat parameters (after initialization or loading)
    void scatter_params(const floatX* flat) {
        for (auto& segs : owned)
            for (const OwnedSegment& s : segs) device_copy<floatX>(shard_params + s.shard_offset, flat + s.flat_offset, s.size);
    }

    // ZeRO >= 1 on the GPU: this rank's pieces of the fp32 parameters `share` (its whole tp share, on the host)
    // become its master weights, and under ZeRO-3 its parameter shard, rounded to nearest as gpt_set_params does
    void set_master(const float* share) {
        for (auto& segs : owned)
            for (const OwnedSegment& s : segs) device_upload<floatX>(shard_master + s.shard_offset, share + s.flat_offset, s.size);
        if (shard_params) convert_on_device(shard_params, shard_master, (long)layout.shard_size);
    }

    // ... and back: every rank's pieces of the master weights, gathered bucket by bucket into `share` on the host
    // (the fp32 values a checkpoint saves). Collective.
    void get_master(float* share) {
        std::vector<float> host;
        for (size_t b = 0; b < layout.buckets.size(); b++) {
            const Bucket& bk = layout.buckets[b];
            DeviceTemp<floatX, float> packed(bk.padded);
            comm.wait(comm.all_gather(shard_master + bk.shard_offset, packed.data, bk.piece, DType::F32));
            host.resize(bk.padded);
            device_download<floatX>(host.data(), packed.data, bk.padded);
            size_t at = 0;
            for (const Segment& s : bk.segments) memcpy(share + s.offset, host.data() + at, s.size * sizeof(float)), at += s.size;
        }
    }

   private:
    // where the reduced gradients are: the shard under ZeRO-2/3, the flat buffer otherwise
    const floatX* reduced_grads() const { return stage >= 2 ? shard_grads : m.grads; }

    // The first and the last stage add their reduced gradients of the tied embeddings, as far as this rank
    // reads them: its piece of the shard under ZeRO-2/3; under ZeRO-1 the same piece of the flat tensors (the
    // bucket's packed order is their flat order, wte then wpe); under ZeRO-0 all of them.
    void sum_tied_gradients() {
        if (!links.tied) return;
        const Bucket& e = layout.embeddings();
        size_t begin = stage == 1 ? std::min(rank * e.piece, e.size) : 0;
        size_t n = stage == 0 ? e.size : stage == 1 ? std::min(e.piece, e.size - begin) : e.piece;
        floatX* g = stage >= 2 ? shard_grads + e.shard_offset : m.grads + e.segments.front().offset + begin;
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

    // Under sequence parallelism each tp rank has the layernorm and wpe gradients of its own rows only: the
    // group's sum goes in before the bucket is reduced across dp. grads is the flat buffer or, packed, the
    // bucket's staging.
    void sum_sequence_partials(const Bucket& b, floatX* grads, bool packed) {
        if (!m.tp.spec.sp) return;
        std::vector<std::pair<size_t, size_t>> partials;  // (where in grads, size)
        size_t running = 0, count = 0;
        for (const Segment& s : b.segments) {
            if (is_sequence_partial(s.tensor)) partials.push_back({packed ? running : s.offset, s.size}), count += s.size;
            running += s.size;
        }
        if (count == 0) return;
        DeviceTemp<floatX, floatX> gathered(count);
        size_t at = 0;
        for (const auto& [where, size] : partials) device_copy<floatX>(gathered.data + at, grads + where, size), at += size;
        m.tp.sum_in_rank_order(gathered.data, (long)count);
        at = 0;
        for (const auto& [where, size] : partials) device_copy<floatX>(grads + where, gathered.data + at, size), at += size;
    }

    // let MPI move the operations in flight while compute goes on
    void progress() {
        for (Slot& s : reduce_slots)
            if (s.in_flight) comm.test(s.request);
    }

    void gather(int b, Slot& slot) {
        const Bucket& bk = layout.buckets[b];
        slot.bucket = b;
        slot.request = comm.all_gather(shard_params + bk.shard_offset, slot.packed, bk.piece, dtype_of<floatX>());
    }
    Slot* slot_for_gather(int b) {
        for (Slot& g : gather_slots)
            if (g.bucket == b) return &g;
        gather(b, *free_gather_slot(-1));  // not prefetched (the first of a pass)
        return slot_for_gather(b);
    }
    Slot* free_gather_slot(int keep) {
        for (int i = 1; i <= 2; i++)
            if (gather_slots[i].bucket < 0 || (gather_slots[i].bucket != keep && gather_slots[i].bucket != current_gather)) {
                if (gather_slots[i].bucket >= 0) comm.wait(gather_slots[i].request);
                return &gather_slots[i];
            }
        fail("zero: no free gather slot");
    }

    int acquire_reduce_slot(int b) {
        if (b == emb_bucket()) {
            if (reduce_slots[0].in_flight) retire(reduce_slots[0]);
            reduce_slots[0].bucket = b;
            return reduce_slot_of[b] = 0;
        }
        Slot* pick = nullptr;
        for (int i = 1; i <= 2 && !pick; i++)
            if (reduce_slots[i].bucket < 0) pick = &reduce_slots[i];
        if (!pick) {  // both busy: one may still be staging (ZeRO-2/3), so retire the oldest reduction in flight
            for (int i = 1; i <= 2; i++)
                if (reduce_slots[i].in_flight && (!pick || reduce_slots[i].order < pick->order)) pick = &reduce_slots[i];
            if (!pick) fail("zero: both staging slots are staging at once");
            retire(*pick);
        }
        pick->bucket = b;
        return reduce_slot_of[b] = (int)(pick - reduce_slots.data());
    }

    // finishes a slot's reduction and puts the reduced piece where the stage keeps it
    void retire(Slot& s) {
        const Bucket& bk = layout.buckets[s.bucket];
        comm.wait(s.request);
        if (stage >= 2) {
            accumulate(shard_grads + bk.shard_offset, s.piece, bk.piece);
        } else if (stage == 1) {
            for (const OwnedSegment& o : owned[s.bucket])
                device_copy<floatX>(m.grads + o.flat_offset, s.piece + (o.shard_offset - bk.shard_offset), o.size);
        } else {
            comm.wait(comm.all_gather(s.piece, s.packed, bk.piece, dtype_of<floatX>()));
            unpack_bucket(bk, s.packed, m.grads);
        }
        s.bucket = -1;
        s.in_flight = false;
    }

    void finish_reductions() {
        while (true) {
            Slot* oldest = nullptr;
            for (Slot& s : reduce_slots)
                if (s.in_flight && (!oldest || s.order < oldest->order)) oldest = &s;
            if (!oldest) break;
            retire(*oldest);
        }
    }
};
