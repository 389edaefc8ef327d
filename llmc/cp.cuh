// Context parallelism: ring attention over a sequence split across the ranks of the cp group (the Playbook's
// "Context Parallelism", "Discovering Ring Attention" and "Zig-Zag Ring Attention" sections).
//
// The split. The T positions of every sequence are cut into 2N chunks of T/(2N) tokens, and each of the N
// ranks holds two of them, in order, as its T/N local rows:
//   zig-zag     rank r holds chunks r and 2N-1-r: a causal mask gives late chunks more keys to look at than
//               early ones, and pairing an early chunk with a late one gives every rank the same work;
//   contiguous  rank r holds chunks 2r and 2r+1 (the plain split, kept to show the imbalance zig-zag removes).
// Layers other than attention treat tokens independently, so the split only has to permute the rows of the
// inputs, targets and positions alike (cp_positions, cp_select): every rank of the group is given the same
// batch and keeps its rows, and the position embedding is read at each row's real position. The ranks of a
// group hold the same parameters; their gradients are partial sums over other tokens, reduced over dp × cp by
// the data-parallel runtime (llmc/grid.cuh). ContextParallel, at the end, is what the model calls.
//
// Ring attention. Each rank keeps the queries of its own tokens; the keys and values travel (under grouped-query
// attention only the KV key/value heads, NH/KV times fewer bytes than the queries' heads). At step s a rank
// holds the K and V of rank r-s, and before it computes with them it posts their send to rank r+1 and the
// receive of the next block from rank r-1 into a second buffer, so the transfer overlaps the compute; after N-1
// transfers every rank has seen every block once. Each (query chunk, key chunk) pair is a block of attention
// whose mask follows from where the chunks sit in the sequence: an earlier key chunk is seen whole, the same
// chunk causally, a later one not at all. With zig-zag that leaves, for a block from an earlier rank, all
// queries against its first chunk, and for a block from a later rank, only the second chunk's queries. A
// block gives its own softmax-weighted output and log-sum-exp; the running output and log-sum-exp are merged
// with them in fp32 (the online softmax across blocks), and the final log-sum-exp is the global one.
//
// The backward makes the same trip. From the global log-sum-exp and D = rowsum(dO∘O) each block recomputes
// its probabilities exactly, so the blocks' gradients simply add: dQ stays home, while the fp32 dK/dV
// accumulators travel the ring with the K and V they belong to, each rank adding its queries' share; one last
// hop brings every accumulator back to the rank that owns the keys. No rank ever holds the whole sequence's K
// and V or a T×T matrix.
//
// Both devices run the same ring code, which is the split and the communication; what it computes with lives
// with attention (llmc/attention.cuh: the per-block attention, the merge, D and the copies between qkv rows and
// the rows that travel) and with the device's memory operations (llmc/device.cuh), each a CPU loop (fp32,
// OpenMP) with CUDA beside it (bf16 storage, fp32 arithmetic and fp32 running output, log-sum-exp and gradient
// accumulators), picked by the storage type's pointers as the layer headers pick theirs. On CUDA a block is a
// call of the flash kernels that the layers run (mma.sync or wgmma, --attention), given the block's rows, its
// mask and fp32 outputs: one GPU attention per instruction set.
#pragma once

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "llmc/attention.cuh"
#include "llmc/comm.cuh"
#include "llmc/device.cuh"
#include "llmc/ledger.h"
#include "llmc/profile.h"
#include "llmc/tp.cuh"
#include "llmc/utils.h"

enum class CPSplit { ZigZag, Contiguous };

// Where the tokens of a sequence of T positions live on a cp group of `size` ranks.
struct CPLayout {
    int size = 1, rank = 0;
    CPSplit split = CPSplit::ZigZag;
    int T = 0;

    int chunk_tokens() const { return T / (2 * size); }
    int local_tokens() const { return T / size; }
    // the sequence chunk (0 .. 2·size-1) held by rank r as its local chunk i (0 or 1)
    int chunk_of(int r, int i) const {
        if (split == CPSplit::ZigZag) return i == 0 ? r : 2 * size - 1 - r;
        return 2 * r + i;
    }
};

inline CPLayout cp_layout(int T, int size, int rank, CPSplit split) {
    if (size < 1 || rank < 0 || rank >= size) fail("context parallelism: rank %d of a group of %d", rank, size);
    // both splits cut the sequence into the same 2N chunks, so a T that one accepts the other accepts too
    if (T < 2 * size || T % (2 * size) != 0)
        fail("context parallelism: the sequence length T=%d must be a multiple of 2·cp = %d (cp=%d ranks, two "
             "chunks of T/(2·cp) tokens each)",
             T, 2 * size, size);
    return CPLayout{size, rank, split, T};
}

// the sequence positions of this rank's local rows, in local order
inline std::vector<int> cp_positions(const CPLayout& l) {
    std::vector<int> pos;
    pos.reserve(l.local_tokens());
    for (int i = 0; i < 2; i++)
        for (int t = 0; t < l.chunk_tokens(); t++) pos.push_back(l.chunk_of(l.rank, i) * l.chunk_tokens() + t);
    return pos;
}

// dst (outer, positions.size(), width) = the rows of src (outer, T, width) at `positions`: a rank's slice of
// token ids, targets, activations or per-token statistics (lse is (B·NH, T, 1))
template <typename E>
inline void cp_select(E* dst, const E* src, long outer, int T, int width, const std::vector<int>& positions) {
    long n = (long)positions.size();
    for (long o = 0; o < outer; o++)
        for (long i = 0; i < n; i++)
            memcpy(dst + (o * n + i) * width, src + (o * T + positions[i]) * width, width * sizeof(E));
}

// how a chunk of queries sees a chunk of keys, from the chunks' places in the sequence
enum class BlockMask { Skip, Full, Causal };
inline BlockMask block_mask(int query_chunk, int key_chunk) {
    return key_chunk < query_chunk ? BlockMask::Full : key_chunk == query_chunk ? BlockMask::Causal : BlockMask::Skip;
}

// the (query, key) pairs a rank scores per sequence and head over the whole ring: its share of attention's work
inline long cp_attention_pairs(const CPLayout& l) {
    long n = l.chunk_tokens(), pairs = 0;
    for (int source = 0; source < l.size; source++)
        for (int qi = 0; qi < 2; qi++)
            for (int ki = 0; ki < 2; ki++) {
                BlockMask m = block_mask(l.chunk_of(l.rank, qi), l.chunk_of(source, ki));
                pairs += m == BlockMask::Full ? n * n : m == BlockMask::Causal ? n * (n + 1) / 2 : 0;
            }
    return pairs;
}

// ==========================================================================================================
// The ring

// One hop around the ring: `send` to the next rank, the previous rank's into `recv`. NCCL runs a rank's
// point-to-point ops in the order they are issued, and a send may not complete before its receive is posted:
// if every rank sent first, each could wait on a neighbour that is itself stuck sending, so odd ranks receive
// first (MPI's nonblocking calls do not mind either order).
struct RingHop {
    CommRequest sent, received;
};
inline RingHop ring_hop(Comm& comm, const void* send, void* recv, size_t count, DType t) {
    int next = (comm.rank + 1) % comm.size, prev = (comm.rank + comm.size - 1) % comm.size;
    RingHop hop;
    if (comm.rank % 2 == 0) {
        hop.sent = comm.send(send, count, t, next);
        hop.received = comm.recv(recv, count, t, prev);
    } else {
        hop.received = comm.recv(recv, count, t, prev);
        hop.sent = comm.send(send, count, t, next);
    }
    return hop;
}
inline void ring_wait(Comm& comm, RingHop& hop) {
    comm.wait(hop.sent);
    comm.wait(hop.received);
}

// What the ring works in, allocated once for the largest batch from the model's list of buffers (which --plan
// reads): the K/V block held and the one arriving, in the storage type; the fp32 dK/dV accumulators (the one
// being added to, the one still on its way to the next rank, and the one arriving); and fp32 scratch, the
// running output (forward) or dQ (backward), one block's output and log-sum-exp, and D. The K/V and
// accumulator buffers are what travels, counted as comm buffers.
template <typename floatX>
struct RingBuffers {
    floatX *kv_held = nullptr, *kv_incoming = nullptr;
    float *acc[2] = {}, *acc_arrived = nullptr;
    float *rows = nullptr, *out_blk = nullptr, *lse_blk = nullptr, *delta = nullptr;
};

// the elements of each buffer for B sequences of Tl local tokens (chunks of Tl/2) and the heads a
struct RingSizes {
    size_t kv, rows, out_blk, lse_blk, delta;
};
inline RingSizes ring_sizes(int B, int Tl, RingHeads a) {
    size_t rows = (size_t)B * Tl, n = (size_t)Tl / 2;
    return {rows * a.kv_row(), rows * a.C, B * n * a.C, B * a.NH * n, rows * a.NH};
}

// the ring's buffers as the list an allocation walks (llmc/ledger.h), into r
template <typename floatX>
inline BufferList ring_buffer_list(RingBuffers<floatX>& r, int B, int Tl, RingHeads a) {
    RingSizes z = ring_sizes(B, Tl, a);
    return {planned("ring kv_held", MEM_COMM, r.kv_held, z.kv),     planned("ring kv_incoming", MEM_COMM, r.kv_incoming, z.kv),
            planned("ring acc[0]", MEM_COMM, r.acc[0], z.kv),       planned("ring acc[1]", MEM_COMM, r.acc[1], z.kv),
            planned("ring acc_arrived", MEM_COMM, r.acc_arrived, z.kv), planned("ring rows", MEM_SCRATCH, r.rows, z.rows),
            planned("ring out_blk", MEM_SCRATCH, r.out_blk, z.out_blk), planned("ring lse_blk", MEM_SCRATCH, r.lse_blk, z.lse_blk),
            planned("ring delta", MEM_SCRATCH, r.delta, z.delta)};
}
template <typename floatX>
inline RingBuffers<floatX> ring_buffers(Ledger& led, int B, int Tl, RingHeads a) {
    RingBuffers<floatX> r;
    led.allocate<floatX>(ring_buffer_list(r, B, Tl, a));
    return r;
}

inline void cp_check_group(const CPLayout& l, const Comm& comm, RingHeads a) {
    if (comm.size != l.size || comm.rank != l.rank)
        fail("ring attention: the layout is rank %d of %d, the group rank %d of %d", l.rank, l.size, comm.rank, comm.size);
    attention_check_heads(a.C, a.NH, a.KV);
}

// out (B, Tl, C) and lse (B, NH, Tl, the global log-sum-exp of each query's scaled scores) of causal attention
// over the whole sequence, for this rank's Tl = T/N local rows of qkv (B, Tl, C + 2K); comm is the cp group, buf
// sized for at least B sequences of Tl tokens; kernels: the GPU's attention kernels (the model's)
template <typename floatX>
void ring_attention_forward(floatX* out, float* lse, const floatX* qkv, int B, RingHeads a, const CPLayout& l, Comm& comm,
                            RingBuffers<floatX>& buf, AttentionKernels kernels) {
    cp_check_group(l, comm, a);
    int N = l.size, Tl = l.local_tokens(), n = l.chunk_tokens(), C = a.C, NH = a.NH;
    size_t kv_count = (size_t)B * Tl * a.kv_row();
    floatX *held = buf.kv_held, *incoming = buf.kv_incoming;
    float* running = buf.rows;
    ring_pack_kv(held, qkv, (long)B * Tl, a);
    device_zero<floatX>(running, (size_t)B * Tl * C);
    device_fill<floatX>(lse, (long)B * NH * Tl, -INFINITY);
    for (int step = 0; step < N; step++) {
        int source = (l.rank + N - step) % N;  // whose keys and values are held now
        bool more = step + 1 < N;
        RingHop hop;
        if (more) hop = ring_hop(comm, held, incoming, kv_count, dtype_of<floatX>());
        for (int qi = 0; qi < 2; qi++)
            for (int ki = 0; ki < 2; ki++) {
                BlockMask mask = block_mask(l.chunk_of(l.rank, qi), l.chunk_of(source, ki));
                if (mask == BlockMask::Skip) continue;
                ring_block_forward(buf.out_blk, buf.lse_blk, qkv, qi * n, held, ki * n, n, mask == BlockMask::Causal,
                                   B, Tl, a, kernels);
                ring_merge<floatX>(running, lse, qi * n, buf.out_blk, buf.lse_blk, n, B, Tl, C, NH);
            }
        if (more) {
            ring_wait(comm, hop);
            std::swap(held, incoming);
        }
    }
    convert_on_device(out, running, (long)B * Tl * C);
}

// dqkv (B, Tl, C + 2K) overwritten with the gradient of this rank's rows, from dout and the forward's out and lse
template <typename floatX>
void ring_attention_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                             int B, RingHeads a, const CPLayout& l, Comm& comm, RingBuffers<floatX>& buf,
                             AttentionKernels kernels) {
    cp_check_group(l, comm, a);
    int N = l.size, Tl = l.local_tokens(), n = l.chunk_tokens(), C = a.C, NH = a.NH;
    size_t kv_count = (size_t)B * Tl * a.kv_row();
    floatX *held = buf.kv_held, *incoming = buf.kv_incoming;
    float *dq = buf.rows, *arrived = buf.acc_arrived;
    ring_pack_kv(held, qkv, (long)B * Tl, a);
    attention_delta(buf.delta, dout, out, B, Tl, C, NH);
    device_zero<floatX>(dq, (size_t)B * Tl * C);
    RingHop grads;  // the accumulator sent on at the end of the previous step
    for (int step = 0; step < N; step++) {
        int source = (l.rank + N - step) % N;
        bool more = step + 1 < N;
        RingHop hop;
        if (more) hop = ring_hop(comm, held, incoming, kv_count, dtype_of<floatX>());
        // the accumulator being added to alternates with the one still on its way to the next rank
        float* acc = buf.acc[step % 2];
        device_zero<floatX>(acc, kv_count);
        for (int qi = 0; qi < 2; qi++)
            for (int ki = 0; ki < 2; ki++) {
                BlockMask mask = block_mask(l.chunk_of(l.rank, qi), l.chunk_of(source, ki));
                if (mask == BlockMask::Skip) continue;
                ring_block_backward(dq, acc, dout, qkv, qi * n, held, ki * n, n, mask == BlockMask::Causal, lse,
                                    buf.delta, B, Tl, a, kernels);
            }
        // the accumulator for the source's keys arrives from the rank that held them a step ago, and leaves with
        // this rank's share added; after the last step's hop every rank holds its own keys' gradient
        if (N > 1) {
            if (step > 0) {
                ring_wait(comm, grads);
                accumulate_floats<floatX>(acc, arrived, (long)kv_count);
            }
            grads = ring_hop(comm, acc, arrived, kv_count, DType::F32);
        }
        if (more) {
            ring_wait(comm, hop);
            std::swap(held, incoming);
        }
    }
    if (N > 1) ring_wait(comm, grads);
    ring_store_grads(dqkv, dq, N > 1 ? arrived : buf.acc[0], (long)B * Tl, a);
}

// ==========================================================================================================
// What the model calls: this rank's place in its cp group, and the few steps cp adds to a forward and a
// backward. With a group of one each step is the plain one (the whole sequence, attention of llmc/attention.cuh).

struct CPSpec {
    int size = 1, rank = 0;
    CPSplit split = CPSplit::ZigZag;
};

template <typename floatX>
struct ContextParallel {
    CPSpec spec;
    Comm* comm = nullptr;  // the cp group; null for a single rank
    CPLayout layout;       // of the last forward's sequence length
    std::vector<int> positions;  // this rank's positions, in local order
    int* device_positions = nullptr;
    floatX *position_table = nullptr, *position_table_grads = nullptr;  // wpe's rows at them, and their gradient (GPT-2)
    RingBuffers<floatX> ring;

    bool on() const { return spec.size > 1; }

    // the buffers for up to B sequences of T tokens, as the list the model's allocation walks (none for a group of
    // one): positions on the GPU, the position table and its gradient when the model has a learned one (C wide; 0:
    // RoPE's positions need none), and the ring's for the rank's heads
    BufferList buffers(int B, int T, int table_width, RingHeads heads) {
        if (!on()) return {};
        int Tl = local_tokens(T);
        BufferList list;
        if (device_of<floatX> == Device::CUDA) list.push_back(planned("cp positions", MEM_ACTIVATIONS, device_positions, Tl));
        if (table_width > 0) {
            list.push_back(planned("cp position_table", MEM_ACTIVATIONS, position_table, (size_t)Tl * table_width));
            list.push_back(planned("cp position_table_grads", MEM_SCRATCH, position_table_grads, (size_t)Tl * table_width));
        }
        append(list, ring_buffer_list(ring, B, Tl, heads));
        return list;
    }
    // the split of T-token sequences, checked with the heads, before the allocation
    void prepare(int T, RingHeads heads) {
        if (!on()) return;
        layout = cp_layout(T, spec.size, spec.rank, spec.split);
        attention_check_heads(heads.C, heads.NH, heads.KV);
    }

    // a forward on sequences of T tokens begins: the split for T, and where the kernels find its positions
    void begin(int T) {
        if (!on() || (T == layout.T && !positions.empty())) return;
        layout = cp_layout(T, spec.size, spec.rank, spec.split);
        positions = cp_positions(layout);
        if constexpr (device_of<floatX> == Device::CUDA) device_upload<floatX>(device_positions, positions.data(), positions.size());
        else device_positions = positions.data();
    }
    int local_tokens(int T) const { return T / spec.size; }

    // this rank's tokens (B sequences of local_tokens(T)) from the whole batch (B sequences of T), on the host
    void select_tokens(int* mine, const int* all, int B, int T) const {
        if (on()) cp_select(mine, all, B, T, 1, positions);
        else std::copy(all, all + (long)B * T, mine);
    }

    // the sequence positions of the local tokens, where the kernels read them (null: 0..T-1), for RoPE
    const int* token_positions() const { return on() ? device_positions : nullptr; }

    // The position embedding at the tokens' real positions. The encoder adds row t of wpe to local row t of each
    // sequence, so a rank hands it the rows of its own positions, gathered into a Tl-row table, and adds the
    // table's gradient back at those positions (each position is held by one rank, so the sums over the group
    // that data parallelism makes see each position's gradient once).
    // the position embedding rows the encoder adds, one per local position
    const floatX* position_rows(const floatX* wpe, int C) {
        if (!on()) return wpe;
        gather_rows(position_table, wpe, device_positions, (long)positions.size(), C);
        return position_table;
    }
    // where the encoder's backward accumulates the gradient of those rows, and then back into dwpe
    floatX* position_grads_begin(floatX* dwpe, int C) {
        if (!on()) return dwpe;
        device_zero<floatX>(position_table_grads, positions.size() * C);
        return position_table_grads;
    }
    void position_grads_end(floatX* dwpe, int C) {
        if (on()) add_rows_at(dwpe, position_table_grads, device_positions, (int)positions.size(), C);
    }

    // attention over the whole sequence for this rank's Tl local rows, NH query heads over KV key/value heads;
    // state is what backward needs (the probabilities or log-sum-exps of llmc/attention.cuh, or the ring's
    // global log-sum-exps (B, NH, Tl)); rows, workspace and kernels as llmc/attention.cuh's entry points take them
    void attention_forward(floatX* out, float* state, const floatX* qkv, int B, int Tl, int C, int NH, int KV,
                           AttentionKernels kernels) {
        ProfileScope op("attention forward");
        if (!on()) return ::attention_forward(out, state, qkv, B, Tl, C, NH, KV, kernels);
        ring_attention_forward(out, state, qkv, B, RingHeads{C, NH, KV}, layout, *comm, ring, kernels);
    }
    void attention_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* state,
                            int B, int Tl, int C, int NH, int KV, float* rows, Workspace workspace,
                            AttentionKernels kernels) {
        ProfileScope op("attention backward");
        if (!on()) return ::attention_backward(dqkv, dout, qkv, out, state, B, Tl, C, NH, KV, rows, workspace, kernels);
        ring_attention_backward(dqkv, dout, qkv, out, state, B, RingHeads{C, NH, KV}, layout, *comm, ring, kernels);
    }

    // which rank holds position t of a sequence, and at which local index
    int owner(int t) const {
        int chunk = t / layout.chunk_tokens();
        for (int r = 0; r < spec.size; r++)
            if (layout.chunk_of(r, 0) == chunk || layout.chunk_of(r, 1) == chunk) return r;
        fail("context parallelism: position %d is outside the sequence of %d", t, layout.T);
    }
    int local_index(int t) const {
        int n = layout.chunk_tokens(), chunk = t / n;
        return (layout.chunk_of(owner(t), 0) == chunk ? 0 : n) + t % n;
    }
};
