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
// Both devices run the same ring code: the per-block attention, the merge and the small element-wise steps are
// each a CPU loop (fp32, OpenMP) with CUDA beside it (bf16 storage, fp32 arithmetic and fp32 running output,
// log-sum-exp and gradient accumulators), picked by the storage type's pointers as the layer headers pick
// theirs. On CUDA a block is a call of the flash kernels of llmc/attention.cuh that the layers run (mma.sync or
// wgmma, --attention), given the block's rows, its mask and fp32 outputs: one GPU attention per instruction set.
#pragma once

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "llmc/attention.cuh"
#include "llmc/comm.cuh"
#include "llmc/device.cuh"
#include "llmc/ledger.h"
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
// The heads a rank's attention has: NH query heads over KV key/value heads of hs channels (grouped-query
// attention: query head h reads key/value head h / (NH/KV); KV = NH is multi-head attention). C = NH·hs is the
// width of the queries and of the output, K = KV·hs that of the keys and of the values: a row of qkv holds
// C + 2K values (q, then k, then v), a row of what travels the ring 2K (k, then v).
struct RingHeads {
    int C, NH, KV;
    __host__ __device__ int hs() const { return C / NH; }
    __host__ __device__ int K() const { return KV * (C / NH); }
    __host__ __device__ int qkv_row() const { return C + 2 * K(); }
    __host__ __device__ int kv_row() const { return 2 * K(); }
    __host__ __device__ int kv_head(int h) const { return h / (NH / KV); }
};

// ==========================================================================================================
// The per-block kernels. A block is n local query rows starting at q0 of qkv (B, Tl, C + 2K) against n key rows
// starting at k0 of kv (B, Tl, 2K: K then V, the layout that travels), per (batch, query head); causal masks key
// j after query i of the block (both chunks are the same n positions of the sequence).
//
// forward: out_blk (B, n, C) = the block's softmax over its keys applied to V, lse_blk (B, NH, n) its
// log-sum-exp (natural log, of the scaled scores).
// backward: with the global lse and D = rowsum(dO∘O) of the query rows (B, NH, Tl), adds the block's share to
// dq (B, Tl, C) at the query rows and to dkv (B, Tl, 2K) at the key rows, all fp32; a key/value head's gradient
// sums its NH/KV query heads, in head order.

inline void cp_block_forward(float* out_blk, float* lse_blk, const float* qkv, int q0, const float* kv, int k0, int n,
                             bool causal, int B, int Tl, RingHeads a) {
    int hs = a.hs(), C = a.C, NH = a.NH;
    float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < n; i++) {
                const float* q = qkv + ((size_t)b * Tl + q0 + i) * a.qkv_row() + h * hs;
                float* o = out_blk + ((size_t)b * n + i) * C + h * hs;
                for (int d = 0; d < hs; d++) o[d] = 0.0f;
                // one pass of the online softmax: o and sum stay scaled to the running maximum
                float maxv = -INFINITY, sum = 0.0f;
                int keys = causal ? i + 1 : n;
                for (int j = 0; j < keys; j++) {
                    const float* k = kv + ((size_t)b * Tl + k0 + j) * a.kv_row() + a.kv_head(h) * hs;
                    const float* v = k + a.K();
                    float s = 0.0f;
                    for (int d = 0; d < hs; d++) s += q[d] * k[d];
                    s *= scale;
                    float m = fmaxf(maxv, s), rescale = expf(maxv - m), p = expf(s - m);
                    sum = sum * rescale + p;
                    for (int d = 0; d < hs; d++) o[d] = o[d] * rescale + p * v[d];
                    maxv = m;
                }
                for (int d = 0; d < hs; d++) o[d] /= sum;
                lse_blk[((size_t)b * NH + h) * n + i] = maxv + logf(sum);
            }
}

// Two passes, one owning the query rows (dQ) and one the key rows (dK, dV), so no two threads add to the same
// entry; each recomputes the probabilities it needs.
inline void cp_block_backward(float* dq, float* dkv, const float* dout, const float* qkv, int q0, const float* kv, int k0,
                              int n, bool causal, const float* lse, const float* delta, int B, int Tl, RingHeads a) {
    int hs = a.hs(), C = a.C, NH = a.NH, group = a.NH / a.KV;
    float scale = 1.0f / sqrtf((float)hs);
    // key j's K and V (local row k0 + j) as query head h reads them
    auto key = [&](int b, int h, int j) { return kv + ((size_t)b * Tl + k0 + j) * a.kv_row() + a.kv_head(h) * hs; };
    // P and dS = P·(dO·v - D) of query i (local row q0 + i) and key j (local row k0 + j)
    auto scores = [&](int b, int h, int i, int j, float* p, float* ds) {
        const float* q = qkv + ((size_t)b * Tl + q0 + i) * a.qkv_row() + h * hs;
        const float* k = key(b, h, j);
        const float* v = k + a.K();
        const float* d = dout + ((size_t)b * Tl + q0 + i) * C + h * hs;
        float s = 0.0f, dp = 0.0f;
        for (int e = 0; e < hs; e++) s += q[e] * k[e], dp += d[e] * v[e];
        size_t row = ((size_t)b * NH + h) * Tl + q0 + i;
        *p = expf(s * scale - lse[row]);
        *ds = *p * (dp - delta[row]);
    };
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < n; i++) {
                float* g = dq + ((size_t)b * Tl + q0 + i) * C + h * hs;
                for (int j = 0; j < (causal ? i + 1 : n); j++) {
                    float p, ds;
                    scores(b, h, i, j, &p, &ds);
                    const float* k = key(b, h, j);
                    for (int e = 0; e < hs; e++) g[e] += ds * scale * k[e];
                }
            }
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int g = 0; g < a.KV; g++)
            for (int j = 0; j < n; j++) {
                float* dk = dkv + ((size_t)b * Tl + k0 + j) * a.kv_row() + g * hs;
                float* dv = dk + a.K();
                for (int h = g * group; h < (g + 1) * group; h++)
                    for (int i = causal ? j : 0; i < n; i++) {
                        float p, ds;
                        scores(b, h, i, j, &p, &ds);
                        const float* q = qkv + ((size_t)b * Tl + q0 + i) * a.qkv_row() + h * hs;
                        const float* d = dout + ((size_t)b * Tl + q0 + i) * C + h * hs;
                        for (int e = 0; e < hs; e++) dk[e] += ds * scale * q[e], dv[e] += p * d[e];
                    }
            }
}

// CUDA: the flash kernels of llmc/attention.cuh, the ones the layers run (--attention mma or wgmma), on the
// block's rows where they lie: the queries at row q0 of qkv, the keys and values at row k0 of the ring's buffer,
// each sequence Tl rows further; the causal mask for a chunk with itself, the full one for an earlier chunk.
// The forward writes the block's output and log-sum-exp in fp32; the backward adds the block's share to the fp32
// accumulators, each row owned by one warp of a launch, so the sums are deterministic as the CPU's.

// heads ring attention can run: KV dividing NH (the CUDA kernels refuse a head size they were not compiled for)
inline void cp_check_heads(RingHeads a) {
    if (a.NH < 1 || a.C % a.NH != 0) fail("ring attention: C=%d is not a multiple of NH=%d", a.C, a.NH);
    if (a.KV < 1 || a.NH % a.KV != 0) fail("ring attention: %d key/value heads must divide the %d query heads", a.KV, a.NH);
}

inline AttentionBlock cp_attention_block(const bf16* qkv, int q0, const bf16* kv, int k0, int n, bool causal, int B,
                                         int Tl, RingHeads a) {
    AttentionMask mask = causal ? AttentionMask::Causal : AttentionMask::Full;
    return {B,
            n,
            a.C,
            a.NH,
            a.KV,
            mask,
            {qkv + (long)q0 * a.qkv_row(), (long)Tl * a.qkv_row(), a.qkv_row()},
            {kv + (long)k0 * a.kv_row(), (long)Tl * a.kv_row(), a.kv_row()}};
}

inline void cp_block_forward(float* out_blk, float* lse_blk, const bf16* qkv, int q0, const bf16* kv, int k0, int n,
                             bool causal, int B, int Tl, RingHeads a) {
    attention_block_forward(cp_attention_block(qkv, q0, kv, k0, n, causal, B, Tl, a), {out_blk, (long)n * a.C, a.C},
                            {lse_blk, n, 1});
}

inline void cp_block_backward(float* dq, float* dkv, const bf16* dout, const bf16* qkv, int q0, const bf16* kv, int k0,
                              int n, bool causal, const float* lse, const float* delta, int B, int Tl, RingHeads a) {
    attention_block_backward(cp_attention_block(qkv, q0, kv, k0, n, causal, B, Tl, a),
                             {dout + (long)q0 * a.C, (long)Tl * a.C, a.C}, {lse + q0, Tl, 1}, {delta + q0, Tl, 1},
                             {dq + (long)q0 * a.C, (long)Tl * a.C, a.C},
                             {dkv + (long)k0 * a.kv_row(), (long)Tl * a.kv_row(), a.kv_row()});
}

// ==========================================================================================================
// The element-wise steps around the blocks, each a CPU loop and its CUDA kernel. The fp32 buffers exist on
// both devices, so the steps that touch only them take the storage type as a template argument to know where
// they live.

// kv (rows, 2K) = the K and V columns of qkv (rows, C + 2K): what travels the ring
inline void cp_pack_kv(float* kv, const float* qkv, long rows, RingHeads a) {
#pragma omp parallel for
    for (long r = 0; r < rows; r++) memcpy(kv + r * a.kv_row(), qkv + r * a.qkv_row() + a.C, a.kv_row() * sizeof(float));
}
static __global__ void cp_pack_kv_kernel(bf16* kv, const bf16* qkv, long rows, RingHeads a) {
    long width = a.kv_row();
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * width; i += (long)gridDim.x * blockDim.x)
        kv[i] = qkv[i / width * a.qkv_row() + a.C + i % width];
}
inline void cp_pack_kv(bf16* kv, const bf16* qkv, long rows, RingHeads a) {
    launch_elementwise(cp_pack_kv_kernel, rows * a.kv_row(), kv, qkv, rows, a);
}

// dqkv (rows, C + 2K) = dq (rows, C) beside dkv (rows, 2K), in the storage type
inline void cp_store_grads(float* dqkv, const float* dq, const float* dkv, long rows, RingHeads a) {
#pragma omp parallel for
    for (long r = 0; r < rows; r++) {
        memcpy(dqkv + r * a.qkv_row(), dq + r * a.C, a.C * sizeof(float));
        memcpy(dqkv + r * a.qkv_row() + a.C, dkv + r * a.kv_row(), a.kv_row() * sizeof(float));
    }
}
static __global__ void cp_store_grads_kernel(bf16* dqkv, const float* dq, const float* dkv, long rows, RingHeads a) {
    long width = a.qkv_row();
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * width; i += (long)gridDim.x * blockDim.x) {
        long r = i / width;
        int c = (int)(i % width);
        dqkv[i] = __float2bfloat16(c < a.C ? dq[r * a.C + c] : dkv[r * a.kv_row() + c - a.C]);
    }
}
inline void cp_store_grads(bf16* dqkv, const float* dq, const float* dkv, long rows, RingHeads a) {
    launch_elementwise(cp_store_grads_kernel, rows * a.qkv_row(), dqkv, dq, dkv, rows, a);
}

// delta (B, NH, Tl) = dO·O over each head: the softmax backward's Σ_j P·dP of the row
inline void cp_delta(float* delta, const float* dout, const float* out, int B, int Tl, int C, int NH) {
    int hs = C / NH;
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < Tl; t++) {
                size_t at = ((size_t)b * Tl + t) * C + h * hs;
                float s = 0.0f;
                for (int e = 0; e < hs; e++) s += dout[at + e] * out[at + e];
                delta[((size_t)b * NH + h) * Tl + t] = s;
            }
}
inline void cp_delta(float* delta, const bf16* dout, const bf16* out, int B, int Tl, int C, int NH) {
    attention_delta_cuda(delta, dout, out, B, Tl, C, NH, main_stream());  // the flash backward's own first step
}

// One query row's running output (hs wide, normalized over the keys seen so far) and log-sum-exp take in a
// block's: the log-sum-exp of the union, and each output weighted by its share of the new total. A running
// log-sum-exp of -inf (no keys yet) gives the block's own.
static __host__ __device__ inline void cp_merge_row(float* out, float* lse, const float* out_blk, float lse_blk, int hs) {
    float hi = fmaxf(*lse, lse_blk), lo = fminf(*lse, lse_blk);
    float merged = hi + log1pf(expf(lo - hi));
    float keep = expf(*lse - merged), take = expf(lse_blk - merged);
    for (int e = 0; e < hs; e++) out[e] = out[e] * keep + out_blk[e] * take;
    *lse = merged;
}
static __global__ void cp_merge_kernel(float* out, float* lse, int q0, const float* out_blk, const float* lse_blk, int n,
                                       long rows, int Tl, int C, int NH) {
    int hs = C / NH;
    for (long r = (long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (long)gridDim.x * blockDim.x) {
        long b = r / ((long)NH * n), h = r / n % NH, i = r % n;
        cp_merge_row(out + (b * Tl + q0 + i) * C + h * hs, lse + (b * NH + h) * Tl + q0 + i,
                     out_blk + (b * n + i) * C + h * hs, lse_blk[r], hs);
    }
}
// the block's rows (B, n) merged into the running ones at local rows q0..q0+n
template <typename floatX>
inline void cp_merge(float* out, float* lse, int q0, const float* out_blk, const float* lse_blk, int n, int B, int Tl,
                     int C, int NH) {
    long rows = (long)B * NH * n;
    if constexpr (device_of<floatX> == Device::CUDA) {
        launch_elementwise(cp_merge_kernel, rows, out, lse, q0, out_blk, lse_blk, n, rows, Tl, C, NH);
    } else {
        int hs = C / NH;
#pragma omp parallel for
        for (long r = 0; r < rows; r++) {
            long b = r / ((long)NH * n), h = r / n % NH, i = r % n;
            cp_merge_row(out + (b * Tl + q0 + i) * C + h * hs, lse + (b * NH + h) * Tl + q0 + i,
                         out_blk + (b * n + i) * C + h * hs, lse_blk[r], hs);
        }
    }
}

static __global__ void cp_fill_kernel(float* x, long n, float value) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) x[i] = value;
}
template <typename floatX>
inline void cp_fill(float* x, long n, float value) {
    if constexpr (device_of<floatX> == Device::CUDA) launch_elementwise(cp_fill_kernel, n, x, n, value);
    else std::fill(x, x + n, value);
}

static __global__ void cp_accumulate_kernel(float* acc, const float* x, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) acc[i] += x[i];
}
template <typename floatX>
inline void cp_accumulate(float* acc, const float* x, long n) {
    if constexpr (device_of<floatX> == Device::CUDA) {
        launch_elementwise(cp_accumulate_kernel, n, acc, x, n);
    } else {
#pragma omp parallel for
        for (long i = 0; i < n; i++) acc[i] += x[i];
    }
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
    cp_check_heads(a);
}

// out (B, Tl, C) and lse (B, NH, Tl, the global log-sum-exp of each query's scaled scores) of causal attention
// over the whole sequence, for this rank's Tl = T/N local rows of qkv (B, Tl, C + 2K); comm is the cp group, buf
// sized for at least B sequences of Tl tokens
template <typename floatX>
void ring_attention_forward(floatX* out, float* lse, const floatX* qkv, int B, RingHeads a, const CPLayout& l, Comm& comm,
                            RingBuffers<floatX>& buf) {
    cp_check_group(l, comm, a);
    int N = l.size, Tl = l.local_tokens(), n = l.chunk_tokens(), C = a.C, NH = a.NH;
    size_t kv_count = (size_t)B * Tl * a.kv_row();
    floatX *held = buf.kv_held, *incoming = buf.kv_incoming;
    float* running = buf.rows;
    cp_pack_kv(held, qkv, (long)B * Tl, a);
    device_zero<floatX>(running, (size_t)B * Tl * C);
    cp_fill<floatX>(lse, (long)B * NH * Tl, -INFINITY);
    for (int step = 0; step < N; step++) {
        int source = (l.rank + N - step) % N;  // whose keys and values are held now
        bool more = step + 1 < N;
        RingHop hop;
        if (more) hop = ring_hop(comm, held, incoming, kv_count, dtype_of<floatX>());
        for (int qi = 0; qi < 2; qi++)
            for (int ki = 0; ki < 2; ki++) {
                BlockMask mask = block_mask(l.chunk_of(l.rank, qi), l.chunk_of(source, ki));
                if (mask == BlockMask::Skip) continue;
                cp_block_forward(buf.out_blk, buf.lse_blk, qkv, qi * n, held, ki * n, n, mask == BlockMask::Causal, B,
                                 Tl, a);
                cp_merge<floatX>(running, lse, qi * n, buf.out_blk, buf.lse_blk, n, B, Tl, C, NH);
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
                             int B, RingHeads a, const CPLayout& l, Comm& comm, RingBuffers<floatX>& buf) {
    cp_check_group(l, comm, a);
    int N = l.size, Tl = l.local_tokens(), n = l.chunk_tokens(), C = a.C, NH = a.NH;
    size_t kv_count = (size_t)B * Tl * a.kv_row();
    floatX *held = buf.kv_held, *incoming = buf.kv_incoming;
    float *dq = buf.rows, *arrived = buf.acc_arrived;
    cp_pack_kv(held, qkv, (long)B * Tl, a);
    cp_delta(buf.delta, dout, out, B, Tl, C, NH);
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
                cp_block_backward(dq, acc, dout, qkv, qi * n, held, ki * n, n, mask == BlockMask::Causal, lse, buf.delta,
                                  B, Tl, a);
            }
        // the accumulator for the source's keys arrives from the rank that held them a step ago, and leaves with
        // this rank's share added; after the last step's hop every rank holds its own keys' gradient
        if (N > 1) {
            if (step > 0) {
                ring_wait(comm, grads);
                cp_accumulate<floatX>(acc, arrived, (long)kv_count);
            }
            grads = ring_hop(comm, acc, arrived, kv_count, DType::F32);
        }
        if (more) {
            ring_wait(comm, hop);
            std::swap(held, incoming);
        }
    }
    if (N > 1) ring_wait(comm, grads);
    cp_store_grads(dqkv, dq, N > 1 ? arrived : buf.acc[0], (long)B * Tl, a);
}

// ==========================================================================================================
// The position embedding at the tokens' real positions. The encoder adds row t of wpe to local row t of each
// sequence, so a rank hands it the rows of its own positions, gathered into a Tl-row table, and adds the
// table's gradient back at those positions (each position is held by one rank, so the sums over the group
// that data parallelism makes see each position's gradient once).

// dst (n rows of C) = the rows of src at positions
inline void gather_position_rows(float* dst, const float* src, const int* positions, int n, int C) {
#pragma omp parallel for
    for (int i = 0; i < n; i++) memcpy(dst + (size_t)i * C, src + (size_t)positions[i] * C, C * sizeof(float));
}
static __global__ void gather_position_rows_kernel(bf16* dst, const bf16* src, const int* positions, int n, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (long)n * C; i += (long)gridDim.x * blockDim.x)
        dst[i] = src[(long)positions[i / C] * C + i % C];
}
inline void gather_position_rows(bf16* dst, const bf16* src, const int* positions, int n, int C) {
    launch_elementwise(gather_position_rows_kernel, (long)n * C, dst, src, positions, n, C);
}

// the rows of dst at positions += src (n rows of C); positions are distinct
inline void add_position_rows(float* dst, const float* src, const int* positions, int n, int C) {
#pragma omp parallel for
    for (int i = 0; i < n; i++)
        for (int c = 0; c < C; c++) dst[(size_t)positions[i] * C + c] += src[(size_t)i * C + c];
}
static __global__ void add_position_rows_kernel(bf16* dst, const bf16* src, const int* positions, int n, int C) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (long)n * C; i += (long)gridDim.x * blockDim.x) {
        bf16* d = dst + (long)positions[i / C] * C + i % C;
        *d = __float2bfloat16(__bfloat162float(*d) + __bfloat162float(src[i]));
    }
}
inline void add_position_rows(bf16* dst, const bf16* src, const int* positions, int n, int C) {
    launch_elementwise(add_position_rows_kernel, (long)n * C, dst, src, positions, n, C);
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
        cp_check_heads(heads);
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

    // the position embedding rows the encoder adds, one per local position
    const floatX* position_rows(const floatX* wpe, int C) {
        if (!on()) return wpe;
        gather_position_rows(position_table, wpe, device_positions, (int)positions.size(), C);
        return position_table;
    }
    // where the encoder's backward accumulates the gradient of those rows, and then back into dwpe
    floatX* position_grads_begin(floatX* dwpe, int C) {
        if (!on()) return dwpe;
        device_zero<floatX>(position_table_grads, positions.size() * C);
        return position_table_grads;
    }
    void position_grads_end(floatX* dwpe, int C) {
        if (on()) add_position_rows(dwpe, position_table_grads, device_positions, (int)positions.size(), C);
    }

    // attention over the whole sequence for this rank's Tl local rows, NH query heads over KV key/value heads;
    // state is what backward needs (the probabilities or log-sum-exps of llmc/attention.cuh, or the ring's
    // global log-sum-exps (B, NH, Tl))
    void attention_forward(floatX* out, float* state, const floatX* qkv, int B, int Tl, int C, int NH, int KV) {
        if (!on()) return ::attention_forward(out, state, qkv, B, Tl, C, NH, KV);
        ring_attention_forward(out, state, qkv, B, RingHeads{C, NH, KV}, layout, *comm, ring);
    }
    void attention_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* state,
                            int B, int Tl, int C, int NH, int KV, float* scratch) {
        if (!on()) return ::attention_backward(dqkv, dout, qkv, out, state, B, Tl, C, NH, KV, scratch);
        ring_attention_backward(dqkv, dout, qkv, out, state, B, RingHeads{C, NH, KV}, layout, *comm, ring);
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
