// Causal self-attention with grouped-query attention (GQA) on a packed qkv tensor (B, T, (NH + 2·KV)·hs): each
// row holds NH query heads, then KV key heads, then KV value heads (llm.c's Llama 3 layout), every head a
// contiguous slice of hs = C/NH channels. Query head h attends with key/value head h / (NH/KV), so the NH/KV query
// heads of a group share one K and one V, which are read where they lie, never repeated. KV = NH is GPT-2's
// multi-head attention (rows 3C wide), KV = 1 multi-query attention. The output is (B, T, C), C = NH·hs. The
// forward keeps the softmax probabilities att (B, NH, T, T) for the backward; entries above the diagonal are zero.
#pragma once

#include <cmath>
#include <cstring>

#include <omp.h>

#include "llmc/utils.h"

// the width of a qkv row: NH query heads and KV key and KV value heads of C/NH channels
inline long attention_qkv_width(int C, int NH, int KV) { return (long)C + 2L * KV * (C / NH); }

// the head layout every entry point accepts: whole heads, and query heads in KV groups of equal size
inline void attention_check_heads(int C, int NH, int KV) {
    if (NH < 1 || C % NH != 0) fail("attention: C=%d is not a multiple of NH=%d", C, NH);
    if (KV < 1 || NH % KV != 0)
        fail("attention: the %d query heads do not split into groups over %d key/value heads (NH %% KV != 0)", NH, KV);
}

inline void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH, int KV) {
    attention_check_heads(C, NH, KV);
    int hs = C / NH, group = NH / KV;
    float scale = 1.0f / sqrtf((float)hs);
    long W = attention_qkv_width(C, NH, KV);
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                int kh = h / group;  // the key/value head of this query head
                const float* q = qkv + ((size_t)b * T + t) * W + h * hs;
                float* row = att + (((size_t)b * NH + h) * T + t) * T;
                float maxv = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = qkv + ((size_t)b * T + t2) * W + C + kh * hs;
                    float s = 0.0f;
                    for (int i = 0; i < hs; i++) s += q[i] * k[i];
                    s *= scale;
                    row[t2] = s;
                    maxv = s > maxv ? s : maxv;
                }
                float sum = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    row[t2] = expf(row[t2] - maxv);
                    sum += row[t2];
                }
                float inv = 1.0f / sum;
                for (int t2 = 0; t2 <= t; t2++) row[t2] *= inv;
                for (int t2 = t + 1; t2 < T; t2++) row[t2] = 0.0f;
                float* o = out + ((size_t)b * T + t) * C + h * hs;
                for (int i = 0; i < hs; i++) o[i] = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* v = qkv + ((size_t)b * T + t2) * W + C + (KV + kh) * hs;
                    for (int i = 0; i < hs; i++) o[i] += row[t2] * v[i];
                }
            }
}

// dqkv (B, T, (NH + 2·KV)·hs) is overwritten. Keys and values receive gradient from every later query of every
// query head of their group, so one thread owns each (batch, key/value head) pair, with its group's query heads,
// and sums in head order, then query order (with KV = NH: per head, in query order). scratch holds T floats per
// thread.
inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                               int NH, int KV, float* scratch) {
    attention_check_heads(C, NH, KV);
    int hs = C / NH, group = NH / KV;
    float scale = 1.0f / sqrtf((float)hs);
    long W = attention_qkv_width(C, NH, KV);
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++)
        for (int kh = 0; kh < KV; kh++) {
            float* dpre = scratch + (size_t)omp_get_thread_num() * T;
            for (int t = 0; t < T; t++) {
                float* base = dqkv + ((size_t)b * T + t) * W;
                memset(base + kh * group * hs, 0, group * hs * sizeof(float));
                memset(base + C + kh * hs, 0, hs * sizeof(float));
                memset(base + C + (KV + kh) * hs, 0, hs * sizeof(float));
            }
            for (int h = kh * group; h < (kh + 1) * group; h++)
                for (int t = 0; t < T; t++) {
                    const float* row = att + (((size_t)b * NH + h) * T + t) * T;
                    const float* d = dout + ((size_t)b * T + t) * C + h * hs;
                    // datt[t2] = d · v[t2]; dpre = att * (datt - Σ att·datt), the softmax backward
                    float dot = 0.0f;
                    for (int t2 = 0; t2 <= t; t2++) {
                        const float* v = qkv + ((size_t)b * T + t2) * W + C + (KV + kh) * hs;
                        float s = 0.0f;
                        for (int i = 0; i < hs; i++) s += d[i] * v[i];
                        dpre[t2] = s;
                        dot += row[t2] * s;
                    }
                    const float* q = qkv + ((size_t)b * T + t) * W + h * hs;
                    float* dq = dqkv + ((size_t)b * T + t) * W + h * hs;
                    for (int t2 = 0; t2 <= t; t2++) {
                        float g = row[t2] * (dpre[t2] - dot) * scale;
                        const float* k = qkv + ((size_t)b * T + t2) * W + C + kh * hs;
                        float* dk = dqkv + ((size_t)b * T + t2) * W + C + kh * hs;
                        float* dv = dqkv + ((size_t)b * T + t2) * W + C + (KV + kh) * hs;
                        for (int i = 0; i < hs; i++) {
                            dq[i] += g * k[i];
                            dk[i] += g * q[i];
                            dv[i] += row[t2] * d[i];
                        }
                    }
                }
        }
}

// ==========================================================================================================
// CUDA: flash attention on the tensor cores (FlashAttention-2's algorithm). The T×T probabilities are never
// stored: the forward streams key/value tiles past a block of queries, keeping a running row maximum, a
// running sum rescaled to it and the unnormalized output (online softmax), and saves only each row's
// log-sum-exp. The backward recomputes the probabilities from it, tile by tile.
// Every product runs on `mma.sync.m16n8k16` (bf16 in, fp32 accumulators): a block of 4 warps owns a block of
// rows (128 queries in the forward, 32 per warp; 64 queries for dQ or 64 keys for dK/dV, 16 per warp), and
// the tiles of the other operand are staged in shared memory by `cp.async`, the next tile loading while the
// current one is used. Tiles entirely above the diagonal are skipped; the diagonal ones are masked element by
// element.
// The backward is deterministic without atomics: one kernel owns a key tile of a key/value head and sums dK
// and dV over the query tiles of each query head of its group, head after head, in order; another owns a query
// tile and sums dQ over key tiles in order. That recomputes QKᵀ and dO·Vᵀ in both (7 tile products where
// FlashAttention-2 has 5 and adds dQ with atomics in arbitrary order).
// With grouped-query attention a block of queries reads its group's key/value head in place: the NH/KV query
// heads of a group stream the same K and V tiles, which L2 serves after the first; nothing is repeated in memory.
// qkv rows are (NH + 2·KV)·hs wide, out is (B, T, C) with head h in channels [h·hs, (h+1)·hs); lse is (B, NH, T)
// natural-log log-sum-exps of the scaled scores; the backward's scratch holds D = rowsum(dO∘O), also (B, NH, T).
// The same kernels serve ring attention's blocks (llmc/cp.cuh): queries and keys in different buffers, each at
// its own strides, under the causal or the full mask, with the output in fp32 and the gradients added to fp32
// accumulators (AttentionBlock below); the layer's call is the whole-sequence causal one.
// qkv, out and dout must be 16-byte aligned (tiles move in 16-byte pieces); B·NH is the grid's second
// dimension (B·KV for dK/dV), at most 65535.
// `cuobjdump -sass dev/cuda/attention | grep HMMA` lists the tensor-core instructions of these kernels.

#include <cuda.h>  // CUtensorMap and its enums (the driver is reached through the runtime: no -lcuda)
#include <cudaTypedefs.h>

#include <string>
#include <type_traits>

#include "llmc/cuda_common.cuh"

constexpr int ATT_WARPS = 4;
constexpr int ATT_ROWS = 16 * ATT_WARPS;  // rows a backward block owns: one m16 slab per warp
// the forward gives each warp two slabs (32 queries), so every K and V fragment read from shared memory
// feeds four mma instead of two: at one slab, ldmatrix traffic (512 bytes per two mma) rather than the tensor
// cores would bound it on Hopper (dev/cuda/attention's variant 3 runs the forward at one slab to compare)
constexpr int ATT_FWD_SLABS = 2;
constexpr int ATT_FWD_COLS = 64;  // keys per tile in the forward
constexpr int ATT_PAD = 8;        // bf16 of padding per shared-memory row (see attention_async_rows)

// keys (dQ kernel) or queries (dK/dV kernel) per tile in the backward: two accumulators of hs/8 fragments
// plus two 16×cols score tiles must fit in the registers, so hs 128 takes narrower tiles
__host__ __device__ constexpr int attention_backward_cols(int hs) { return hs <= 64 ? 64 : 32; }

// ----------------------------------------------------------------------------------------------------------
// What one call of the kernels works on. The model's layer is one call over whole sequences, causal. Ring
// attention (llmc/cp.cuh) calls them once per block of its ring: the n query rows of one of its chunks against
// the n key rows of a chunk whose K and V travelled in from another rank into a buffer of their own; the block
// of a chunk with itself is causal, a block of an earlier chunk full. Each tensor is addressed through its own
// strides, so a block's rows are read and written where they lie, without copies.

// element (i, t) at p[i·batch + t·stride]: a sequence's row t (i = b), or the statistic of query t of the
// (sequence, head) pair i = b·NH + h (stride 1)
template <typename E>
struct AttentionRows {
    E* p;
    long batch, stride;
    __host__ __device__ E* at(long i, int t) const { return p + i * batch + (long)t * stride; }
};

enum class AttentionMask { Causal, Full };

// B sequences of T query rows against T key rows; q points at query head 0 of row 0, kv at key head 0 of row 0,
// value head 0 lying KV·hs further (so in a qkv row and in ring attention's K-then-V rows alike)
struct AttentionBlock {
    int B, T, C, NH, KV;
    AttentionMask mask;  // Causal: query t sees keys 0..t (both are the same positions); Full: every key
    AttentionRows<const bf16> q, kv;
    // the last key query t sees: with the full mask the last of the T, so a ragged last tile is masked too
    __host__ __device__ int last_key(int query) const { return mask == AttentionMask::Causal ? query : T - 1; }
    // the first query that sees key t
    __host__ __device__ int first_query(int key) const { return mask == AttentionMask::Causal ? key : 0; }
};

// the layer's call: whole sequences of qkv (B, T, (NH + 2·KV)·hs), causal
inline AttentionBlock attention_whole_sequences(const bf16* qkv, int B, int T, int C, int NH, int KV) {
    long W = attention_qkv_width(C, NH, KV);
    return {B, T, C, NH, KV, AttentionMask::Causal, {qkv, T * W, W}, {qkv + C, T * W, W}};
}

// ----------------------------------------------------------------------------------------------------------
// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4·g + t:
//   A (16×16, row-major): reg 0 = row g, cols 2t..2t+1; reg 1 = row g+8, same cols; regs 2, 3 = the same rows
//     at cols 8+2t..8+2t+1.
//   B (16×8, k × n): reg 0 = k 2t..2t+1 at n = g; reg 1 = k 8+2t..8+2t+1 at n = g.
//   C/D (16×8 fp32): c[0], c[1] = row g, cols 2t, 2t+1; c[2], c[3] = row g+8, same cols.
// Each register holds two bf16, the lower column (or k) in the low half. ldmatrix.x4 loads four 8×8 bf16
// matrices, lanes 8i..8i+7 giving the addresses of matrix i's rows; register i of lane l holds row l/4,
// elements 2(l%4), 2(l%4)+1 of matrix i (of its transpose with .trans). The two helpers below say which row
// and column of a shared-memory tile each lane points at; test/test_cuda_kernels.cu emulates them on the CPU.

struct FragmentCoord {
    int row, col;
};

// for an A fragment (rows × k, row-major) and for a B fragment pair read with .trans from a k × n row-major
// tile: matrices 0..3 are (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) of the 16×16 block
static __host__ __device__ inline FragmentCoord ldmatrix_rowmajor_coord(int lane) {
    return {lane % 16, 8 * (lane / 16)};
}

// for a pair of B fragments (two n-tiles of 8) read without .trans from an n × k row-major tile (keys by head
// dimension, say): matrices 0..3 are (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15),
// i.e. registers b[0], b[1] of n-tile 0 then b[0], b[1] of n-tile 1
static __host__ __device__ inline FragmentCoord ldmatrix_nk_coord(int lane) {
    return {lane % 8 + 8 * (lane / 16), 8 * (lane / 8 % 2)};
}

// the row and column within the 16×8 tile of accumulator element c[i] held by lane
static __host__ __device__ inline FragmentCoord accumulator_coord(int lane, int i) {
    return {lane / 4 + 8 * (i / 2), 2 * (lane % 4) + i % 2};
}

static __host__ __device__ inline uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return bits;
}

// two adjacent 16×8 accumulator tiles (columns 0-7 and 8-15) as the A fragment of a 16×16 block: the C and A
// layouts put the same (row, col) pairs in the same lane, so this is a conversion, not a shuffle
static __host__ __device__ inline void accumulators_to_a(uint32_t (&a)[4], const float (&left)[4],
                                                         const float (&right)[4]) {
    a[0] = pack_bf16x2(left[0], left[1]);
    a[1] = pack_bf16x2(left[2], left[3]);
    a[2] = pack_bf16x2(right[0], right[1]);
    a[3] = pack_bf16x2(right[2], right[3]);
}

// ----------------------------------------------------------------------------------------------------------
// PTX wrappers

static __device__ __forceinline__ uint32_t shared_address(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

static __device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

// c += a·b on one 16×8×16 block
static __device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                      uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared without passing through registers; src_bytes 0 writes zeros
static __device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(src_bytes));
}

static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// wait until at most `pending` of this thread's committed groups are still in flight
template <int pending>
static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

// ----------------------------------------------------------------------------------------------------------
// tiles and warp-level products

// rows [t0, t0+rows) of one head's slice of a (B·T, row_stride) tensor into a shared tile of HS+ATT_PAD bf16
// per row, asynchronously; rows at or past T become zeros. The padding shifts each row by 16 bytes across the
// banks, so the 8 rows an ldmatrix reads at once fall in 8 different 16-byte bank groups.
template <int HS>
static __device__ __forceinline__ void attention_async_rows(bf16* tile, const bf16* src, long row_stride, int t0,
                                                            int rows, int T) {
    constexpr int CHUNKS = HS / 8;  // 16-byte pieces per row
    for (int i = threadIdx.x; i < rows * CHUNKS; i += blockDim.x) {
        int r = i / CHUNKS, c = 8 * (i % CHUNKS), t = t0 + r;
        bool inside = t < T;
        // a zero-byte copy still needs a mapped address: row 0 always is one (T ≥ 1)
        cp_async_16(tile + r * (HS + ATT_PAD) + c, src + (long)(inside ? t : 0) * row_stride + c, inside ? 16 : 0);
    }
}

// The double-buffered key/value loop of the forward and of the dQ pass: tile kt + 1 starts loading into the
// other buffer, then tile kt (in buffer kt % 2) is waited for by every thread. k_g is the key head's slice of
// the sequence's first row, and the value head's lies v_offset further.
template <int HS, int COLS>
static __device__ __forceinline__ void attention_next_kv_tile(bf16* k_s, bf16* v_s, const bf16* k_g, int v_offset,
                                                              long stride, int kt, int tiles, int T) {
    constexpr int LD = HS + ATT_PAD;
    int buf = kt % 2, k0 = kt * COLS;
    if (kt + 1 < tiles) {
        attention_async_rows<HS>(k_s + (buf ^ 1) * COLS * LD, k_g, stride, k0 + COLS, COLS, T);
        attention_async_rows<HS>(v_s + (buf ^ 1) * COLS * LD, k_g + v_offset, stride, k0 + COLS, COLS, T);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
}

// acc[m] = rows [row0 + 16m, row0 + 16m + 16) of a times the first COLS rows of b, transposed: a warp's
// (16·SLABS)×COLS block of a·bᵀ over the HS columns both tiles hold (QKᵀ, dO·Vᵀ, K·Qᵀ, V·dOᵀ)
template <int HS, int COLS, int SLABS>
static __device__ __forceinline__ void warp_abt(float (&acc)[SLABS][COLS / 8][4], const bf16* a, int row0,
                                                const bf16* b) {
    constexpr int LD = HS + ATT_PAD;
    int lane = threadIdx.x % 32;
    FragmentCoord ac = ldmatrix_rowmajor_coord(lane), bc = ldmatrix_nk_coord(lane);
#pragma unroll
    for (int m = 0; m < SLABS; m++)
#pragma unroll
        for (int j = 0; j < COLS / 8; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;
#pragma unroll
    for (int k0 = 0; k0 < HS; k0 += 16) {
        uint32_t af[SLABS][4];
#pragma unroll
        for (int m = 0; m < SLABS; m++) ldmatrix_x4(af[m], a + (row0 + 16 * m + ac.row) * LD + k0 + ac.col);
#pragma unroll
        for (int n0 = 0; n0 < COLS; n0 += 16) {
            uint32_t bf[4];
            ldmatrix_x4(bf, b + (n0 + bc.row) * LD + k0 + bc.col);
#pragma unroll
            for (int m = 0; m < SLABS; m++) {
                mma_bf16_16816(acc[m][n0 / 8], af[m], bf[0], bf[1]);
                mma_bf16_16816(acc[m][n0 / 8 + 1], af[m], bf[2], bf[3]);
            }
        }
    }
}

// acc[m] += p[m]·mat: p a warp's (16·SLABS)×COLS block held as accumulators (rounded to bf16 here), mat the
// first COLS rows of a COLS×HS tile (PV, dS·K, Pᵀ·dO, dSᵀ·Q)
template <int HS, int COLS, int SLABS>
static __device__ __forceinline__ void warp_pm(float (&acc)[SLABS][HS / 8][4], const float (&p)[SLABS][COLS / 8][4],
                                               const bf16* mat) {
    constexpr int LD = HS + ATT_PAD;
    FragmentCoord mc = ldmatrix_rowmajor_coord(threadIdx.x % 32);
#pragma unroll
    for (int k0 = 0; k0 < COLS; k0 += 16) {
        uint32_t af[SLABS][4];
#pragma unroll
        for (int m = 0; m < SLABS; m++) accumulators_to_a(af[m], p[m][k0 / 8], p[m][k0 / 8 + 1]);
#pragma unroll
        for (int n0 = 0; n0 < HS; n0 += 16) {
            uint32_t bf[4];
            ldmatrix_x4_trans(bf, mat + (k0 + mc.row) * LD + n0 + mc.col);
#pragma unroll
            for (int m = 0; m < SLABS; m++) {
                mma_bf16_16816(acc[m][n0 / 8], af[m], bf[0], bf[1]);
                mma_bf16_16816(acc[m][n0 / 8 + 1], af[m], bf[2], bf[3]);
            }
        }
    }
}

// two adjacent values stored as a bf16 pair (the layer's tensors) or as fp32 (ring attention's block output)
static __device__ __forceinline__ void store_pair(bf16* dst, float x, float y) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(x, y);
}
static __device__ __forceinline__ void store_pair(float* dst, float x, float y) {
    *reinterpret_cast<float2*>(dst) = make_float2(x, y);
}
// two adjacent values added to fp32: ring attention's gradient accumulators, which sum the blocks of the ring
// (one warp owns each row of a launch and the launches follow each other, so no atomics and a fixed order)
static __device__ __forceinline__ void add_pair(float* dst, float x, float y) {
    float2* d = reinterpret_cast<float2*>(dst);
    float2 v = *d;
    *d = make_float2(v.x + x, v.y + y);
}

// a warp's 16×HS accumulator rows, row r scaled by scale[r / 8], at dst + (t0 + r)·row_stride; rows at or past
// T skipped. E is bf16 or fp32 (stored), or ADD: added to fp32.
template <int HS, bool ADD = false, typename E>
static __device__ __forceinline__ void warp_store_rows(E* dst, long row_stride, const float (&acc)[HS / 8][4], int t0,
                                                       int T, const float (&scale)[2]) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int t = t0 + accumulator_coord(lane, 2 * half).row, col = accumulator_coord(lane, 0).col;
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < HS / 8; j++) {
            E* d = dst + (long)t * row_stride + 8 * j + col;
            float x = acc[j][2 * half] * scale[half], y = acc[j][2 * half + 1] * scale[half];
            if constexpr (ADD) add_pair(d, x, y);
            else store_pair(d, x, y);
        }
    }
}

// the backward's gradient rows: into the layer's bf16 dqkv they are stored (overwritten), into fp32 they are
// ring attention's accumulators (llmc/cp.cuh), and added to
template <int HS>
static __device__ __forceinline__ void store_gradient_rows(bf16* dst, long row_stride, const float (&acc)[HS / 8][4],
                                                           int t0, int T, const float (&scale)[2]) {
    warp_store_rows<HS>(dst, row_stride, acc, t0, T, scale);
}
template <int HS>
static __device__ __forceinline__ void store_gradient_rows(float* dst, long row_stride, const float (&acc)[HS / 8][4],
                                                           int t0, int T, const float (&scale)[2]) {
    warp_store_rows<HS, true>(dst, row_stride, acc, t0, T, scale);
}

// The online-softmax step of one m16 slab (queries query0..query0+15) against the key tile from k0: the raw
// scores s become P = exp2(s·scale_log2 - m_new), the running max m and this lane's share of the running sum l
// move to the new maximum, and o is rescaled to it. masked: hide the keys past each query's last_key (under the
// causal mask those after it, which also hides keys past T; under the full one those past T). Shared by the
// mma.sync and the wgmma forward, whose accumulators have the same per-warp layout.
template <int HS, int COLS>
static __device__ __forceinline__ void online_softmax_slab(float (&s)[COLS / 8][4], float (&o)[HS / 8][4],
                                                           float (&m)[2], float (&l)[2], int query0, int k0,
                                                           bool masked, const AttentionBlock& a, float scale_log2) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int query = query0 + accumulator_coord(lane, 2 * half).row;
        float m_new = m[half];
#pragma unroll
        for (int j = 0; j < COLS / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int key = k0 + 8 * j + accumulator_coord(lane, e).col;
                float x = masked && key > a.last_key(query) ? -INFINITY : s[j][2 * half + e] * scale_log2;
                s[j][2 * half + e] = x;
                m_new = fmaxf(m_new, x);
            }
        // the 4 lanes of a quad hold the row between them
        m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 1));
        m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 2));
        // key 0 is visible to every row and every warp takes tile 0, so m_new is finite from there on and the
        // first rescale is exp2(-inf) = 0
        float rescale = exp2f(m[half] - m_new), sum = 0.0f;
        m[half] = m_new;
#pragma unroll
        for (int j = 0; j < COLS / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float p = exp2f(s[j][2 * half + e] - m_new);
                s[j][2 * half + e] = p;
                sum += p;
            }
        l[half] = l[half] * rescale + sum;
#pragma unroll
        for (int j = 0; j < HS / 8; j++) {
            o[j][2 * half] *= rescale;
            o[j][2 * half + 1] *= rescale;
        }
    }
}

// The end of the forward for one m16 slab (queries t0..t0+15 of head bh): the quad's shares of the running sum
// added, the output rows normalized and stored in out_head (row stride out_stride), and each row's log-sum-exp
// saved
template <int HS, typename O>
static __device__ __forceinline__ void attention_store_slab(O* out_head, float* lse_head, const float (&o)[HS / 8][4],
                                                            const float (&m)[2], const float (&l)[2], int t0, int T,
                                                            long out_stride) {
    int lane = threadIdx.x % 32;
    float inv[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
        float sum = l[half];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv[half] = 1.0f / sum;
        int query = t0 + accumulator_coord(lane, 2 * half).row;
        // lse = ln Σ exp(score) = (m + log2 Σ)·ln 2, with m in base 2
        if (lane % 4 == 0 && query < T) lse_head[query] = (m[half] + log2f(sum)) * 0.69314718f;
    }
    warp_store_rows<HS>(out_head, out_stride, o, t0, T, inv);
}

// P and dS of one m16 slab whose rows are the keys key0..key0+15 and whose columns are the queries q0.. of a
// tile, in place of Sᵀ (in p) and dPᵀ (in ds); lse_t and delta_t hold the tile's base-2 log-sum-exps and D per
// query (+inf and 0 past T, which make P and dS exactly 0 there). masked: hide each key from the queries whose
// last_key comes before it.
template <int COLS>
static __device__ __forceinline__ void key_slab_probabilities(float (&p)[COLS / 8][4], float (&ds)[COLS / 8][4],
                                                              int key0, int q0, bool masked, const AttentionBlock& a,
                                                              const float* lse_t, const float* delta_t,
                                                              float scale_log2) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < COLS / 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            FragmentCoord c = accumulator_coord(lane, i);
            int key = key0 + c.row, col = 8 * j + c.col;
            float x = exp2f(p[j][i] * scale_log2 - lse_t[col]);
            p[j][i] = masked && key > a.last_key(q0 + col) ? 0.0f : x;
            ds[j][i] = p[j][i] * (ds[j][i] - delta_t[col]);
        }
}

// P and dS of one m16 slab whose rows are the queries query0..query0+15 and whose columns are the keys k0.. of
// a tile, in place of S (in p) and dP (in ds); row_lse and row_delta are this lane's two rows' base-2
// log-sum-exp and D. masked: hide the keys past each query's last_key.
template <int COLS>
static __device__ __forceinline__ void query_slab_probabilities(float (&p)[COLS / 8][4], float (&ds)[COLS / 8][4],
                                                                int query0, int k0, bool masked,
                                                                const AttentionBlock& a, const float (&row_lse)[2],
                                                                const float (&row_delta)[2], float scale_log2) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < COLS / 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            FragmentCoord c = accumulator_coord(lane, i);
            int query = query0 + c.row, key = k0 + 8 * j + c.col;
            float x = exp2f(p[j][i] * scale_log2 - row_lse[i / 2]);
            p[j][i] = masked && key > a.last_key(query) ? 0.0f : x;
            ds[j][i] = p[j][i] * (ds[j][i] - row_delta[i / 2]);
        }
}

// the base-2 log-sum-exp and D of this lane's two rows of the m16 slab from query0 (any finite value past T)
static __device__ __forceinline__ void slab_row_stats(float (&row_lse)[2], float (&row_delta)[2], const float* lse_head,
                                                      const float* delta_head, int query0, int T) {
    for (int half = 0; half < 2; half++) {
        int query = query0 + accumulator_coord(threadIdx.x % 32, 2 * half).row;
        row_lse[half] = query < T ? lse_head[query] * 1.44269504f : 0.0f;
        row_delta[half] = query < T ? delta_head[query] : 0.0f;
    }
}

// ----------------------------------------------------------------------------------------------------------
// kernels

// one key tile of the forward for a warp's queries, rows [row0, row0 + 16·SLABS) of the block's q_s, query
// q0 + row0 the first: scores, the online softmax of each slab, and o += P·V
template <int HS, int SLABS>
static __device__ __forceinline__ void attention_forward_tile(float (&o)[SLABS][HS / 8][4], float (&m)[SLABS][2],
                                                              float (&l)[SLABS][2], const bf16* q_s, int row0,
                                                              const bf16* k_t, const bf16* v_t, int q0, int k0,
                                                              bool masked, const AttentionBlock& a, float scale_log2) {
    constexpr int COLS = ATT_FWD_COLS;
    float s[SLABS][COLS / 8][4];
    warp_abt<HS, COLS, SLABS>(s, q_s, row0, k_t);
#pragma unroll
    for (int sl = 0; sl < SLABS; sl++)
        online_softmax_slab<HS, COLS>(s[sl], o[sl], m[sl], l[sl], q0 + row0 + 16 * sl, k0, masked, a, scale_log2);
    warp_pm<HS, COLS, SLABS>(o, s, v_t);
}

// grid (query blocks, B·NH); the longest rows (last blocks) start first so the tail of the grid is short.
// Warp w owns queries [16·SLABS·w, 16·SLABS·(w+1)) of the block, as SLABS m16 slabs. scale_log2 = log2(e)/√hs:
// scores are kept in base 2 so each exponential is one exp2. The query heads of a group read the same key and
// value tiles (from L2 after the first). out is bf16 (the layer's) or fp32 (a ring block's, merged in fp32).
template <int HS, int SLABS, typename O>
static __global__ void __launch_bounds__(32 * ATT_WARPS)
    attention_forward_kernel(AttentionBlock a, AttentionRows<O> out, AttentionRows<float> lse, float scale_log2) {
    constexpr int LD = HS + ATT_PAD, COLS = ATT_FWD_COLS, ROWS = 16 * SLABS * ATT_WARPS;
    extern __shared__ __align__(16) unsigned char attention_shared[];
    bf16* q_s = reinterpret_cast<bf16*>(attention_shared);
    bf16* k_s = q_s + ROWS * LD;  // two buffers each
    bf16* v_s = k_s + 2 * COLS * LD;
    int T = a.T, bh = blockIdx.y, b = bh / a.NH, h = bh % a.NH, kh = h / (a.NH / a.KV), warp = threadIdx.x / 32;
    int q0 = (gridDim.x - 1 - blockIdx.x) * ROWS, row0 = warp * 16 * SLABS;
    const bf16* q_g = a.q.at(b, 0) + h * HS;
    const bf16* k_g = a.kv.at(b, 0) + kh * HS;  // the value head's lies KV·HS further
    int tiles = min(a.last_key(q0 + ROWS - 1), T - 1) / COLS + 1;  // key tiles up to the last one a query sees

    attention_async_rows<HS>(q_s, q_g, a.q.stride, q0, ROWS, T);
    attention_async_rows<HS>(k_s, k_g, a.kv.stride, 0, COLS, T);
    attention_async_rows<HS>(v_s, k_g + a.KV * HS, a.kv.stride, 0, COLS, T);
    cp_async_commit();

    // per slab, this lane's two rows (accumulator rows g and g+8): the running max and this lane's share of
    // the running sum (the quad's shares are added at the end)
    float o[SLABS][HS / 8][4] = {}, m[SLABS][2], l[SLABS][2] = {};
#pragma unroll
    for (int sl = 0; sl < SLABS; sl++) m[sl][0] = m[sl][1] = -INFINITY;
    for (int kt = 0; kt < tiles; kt++) {
        int buf = kt % 2, k0 = kt * COLS;
        attention_next_kv_tile<HS, COLS>(k_s, v_s, k_g, a.KV * HS, a.kv.stride, kt, tiles, T);  // landed for all
        // a diagonal tile can lie wholly after this warp's queries (the block's last tile, for its first
        // warps): then the warp has nothing to add
        if (k0 <= a.last_key(q0 + row0 + 16 * SLABS - 1)) {
            attention_forward_tile<HS, SLABS>(o, m, l, q_s, row0, k_s + buf * COLS * LD, v_s + buf * COLS * LD, q0,
                                              k0, k0 + COLS - 1 > a.last_key(q0), a, scale_log2);
        }
        __syncthreads();  // everyone is done with this buffer before the next iteration refills it
    }

#pragma unroll
    for (int sl = 0; sl < SLABS; sl++)
        attention_store_slab<HS>(out.at(b, 0) + h * HS, lse.at(bh, 0), o[sl], m[sl], l[sl], q0 + row0 + 16 * sl, T,
                                 out.stride);
}

// D[b,h,t] = dO·O over the head: Σ_j P·dP for the row, which the softmax backward subtracts. HS/8 lanes
// (aligned within the warp) share a row, 16 bytes each.
template <int HS>
static __global__ void attention_delta_kernel(float* delta, const bf16* dout, const bf16* out, long rows, int T,
                                              int C, int NH) {
    constexpr int LANES = HS / 8;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x, row = i / LANES;  // row = (b, h, t)
    bool inside = row < rows;
    float s = 0.0f;
    if (inside) {
        long b = row / ((long)NH * T);
        int h = (int)(row / T % NH), t = (int)(row % T);
        long offset = ((long)b * T + t) * C + h * HS + 8 * (i % LANES);
        bf16x8 d = *reinterpret_cast<const bf16x8*>(dout + offset), o = *reinterpret_cast<const bf16x8*>(out + offset);
        for (int k = 0; k < 4; k++) {
            float2 dv = __bfloat1622float2(d.h[k]), ov = __bfloat1622float2(o.h[k]);
            s += dv.x * ov.x + dv.y * ov.y;
        }
    }
    for (int offset = LANES / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (inside && i % LANES == 0) delta[row] = s;
}

// dK and dV for a block of keys of one key/value head (grid (key blocks, B·KV); block 0 has the most query
// tiles and starts first): each warp holds 16 keys' dK and dV and walks, for each query head of the group in
// turn, the query tiles that can see them, in order, so the group's contributions add up in one fixed order.
// dkv points at key head 0 of row 0 (value head 0 KV·hs further); G is bf16 (the layer's dqkv, stored) or fp32
// (a ring block's share, added); lse and D are the forward's, over the whole sequence.
template <int HS, typename G>
static __global__ void __launch_bounds__(32 * ATT_WARPS)
    attention_backward_dkdv_kernel(AttentionBlock a, AttentionRows<const bf16> dout, AttentionRows<const float> lse,
                                   AttentionRows<const float> delta, AttentionRows<G> dkv, float scale,
                                   float scale_log2) {
    constexpr int LD = HS + ATT_PAD, COLS = attention_backward_cols(HS);
    extern __shared__ __align__(16) unsigned char attention_shared[];
    bf16* k_s = reinterpret_cast<bf16*>(attention_shared);
    bf16* v_s = k_s + ATT_ROWS * LD;
    bf16* q_s = v_s + ATT_ROWS * LD;  // two buffers each
    bf16* do_s = q_s + 2 * COLS * LD;
    float* lse_s = reinterpret_cast<float*>(do_s + 2 * COLS * LD);  // base-2, two buffers
    float* delta_s = lse_s + 2 * COLS;
    int T = a.T, NH = a.NH, KV = a.KV, group = NH / KV, bk = blockIdx.y, b = bk / KV, kh = bk % KV;
    int k0 = blockIdx.x * ATT_ROWS, row0 = threadIdx.x / 32 * 16;
    const bf16* k_g = a.kv.at(b, 0) + kh * HS;
    const bf16* v_g = k_g + KV * HS;
    // per query head, the query tiles holding a query that sees the first key; step n of the walk is tile
    // first + n % per_head of the group's query head n / per_head
    int first = a.first_query(k0) / COLS, per_head = (T - 1) / COLS + 1 - first, steps = group * per_head;
    auto head_of = [&](int n) { return kh * group + n / per_head; };
    auto tile_start = [&](int n) { return (first + n % per_head) * COLS; };

    // step n's query and output-gradient rows into buffer buf, asynchronously
    auto load_queries = [&](int n, int buf) {
        int h = head_of(n);
        attention_async_rows<HS>(q_s + buf * COLS * LD, a.q.at(b, 0) + h * HS, a.q.stride, tile_start(n), COLS, T);
        attention_async_rows<HS>(do_s + buf * COLS * LD, dout.at(b, 0) + h * HS, dout.stride, tile_start(n), COLS, T);
    };
    // the base-2 lse and D of step n's query tile_start(n) + threadIdx.x (threads < COLS), fetched into
    // registers a step ahead so their latency hides behind the current tile's products; queries past T get
    // lse = +inf, which makes their P, and with it their dS, exactly 0
    float next_lse = INFINITY, next_delta = 0.0f;
    auto fetch_stats = [&](int n) {
        int query = tile_start(n) + threadIdx.x;
        bool inside = threadIdx.x < COLS && query < T;
        long bh = (long)b * NH + head_of(n);
        next_lse = inside ? *lse.at(bh, query) * 1.44269504f : INFINITY;
        next_delta = inside ? *delta.at(bh, query) : 0.0f;
    };
    auto store_stats = [&](int buf) {
        if (threadIdx.x < COLS) {
            lse_s[buf * COLS + threadIdx.x] = next_lse;
            delta_s[buf * COLS + threadIdx.x] = next_delta;
        }
    };
    attention_async_rows<HS>(k_s, k_g, a.kv.stride, k0, ATT_ROWS, T);
    attention_async_rows<HS>(v_s, v_g, a.kv.stride, k0, ATT_ROWS, T);
    load_queries(0, 0);
    cp_async_commit();
    fetch_stats(0);
    store_stats(0);

    float dk[1][HS / 8][4] = {}, dv[1][HS / 8][4] = {};
    for (int n = 0; n < steps; n++) {
        int buf = n % 2, q0 = tile_start(n);
        if (n + 1 < steps) {
            load_queries(n + 1, buf ^ 1);
            cp_async_commit();
            fetch_stats(n + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* q_t = q_s + buf * COLS * LD;
        const bf16* do_t = do_s + buf * COLS * LD;
        const float* lse_t = lse_s + buf * COLS;
        const float* delta_t = delta_s + buf * COLS;

        // a diagonal tile can lie wholly before this warp's keys (hs 128's narrow tiles, for the last warps)
        if (k0 + row0 <= a.last_key(q0 + COLS - 1)) {
            float p[1][COLS / 8][4], ds[1][COLS / 8][4];  // rows: this warp's keys; columns: the tile's queries
            warp_abt<HS, COLS, 1>(p, k_s, row0, q_t);
            warp_abt<HS, COLS, 1>(ds, v_s, row0, do_t);
            bool masked = k0 + ATT_ROWS - 1 > a.last_key(q0);  // some key of the block is hidden from some query
            key_slab_probabilities<COLS>(p[0], ds[0], k0 + row0, q0, masked, a, lse_t, delta_t, scale_log2);
            warp_pm<HS, COLS, 1>(dv, p, do_t);
            warp_pm<HS, COLS, 1>(dk, ds, q_t);
        }
        if (n + 1 < steps) store_stats(buf ^ 1);  // that buffer was last read in the previous iteration
        __syncthreads();
    }
    float dk_scale[2] = {scale, scale}, one[2] = {1.0f, 1.0f};
    G* dkey = dkv.at(b, 0) + kh * HS;
    store_gradient_rows<HS>(dkey, dkv.stride, dk[0], k0 + row0, T, dk_scale);
    store_gradient_rows<HS>(dkey + KV * HS, dkv.stride, dv[0], k0 + row0, T, one);
}

// dQ for a block of queries (grid as the forward's): each warp holds 16 queries' dQ and walks the key tiles
// they can see, in order, recomputing P and dS for them. dq points at query head 0 of row 0, G as the dK/dV
// kernel's.
template <int HS, typename G>
static __global__ void __launch_bounds__(32 * ATT_WARPS)
    attention_backward_dq_kernel(AttentionBlock a, AttentionRows<const bf16> dout, AttentionRows<const float> lse,
                                 AttentionRows<const float> delta, AttentionRows<G> dq_rows, float scale,
                                 float scale_log2) {
    constexpr int LD = HS + ATT_PAD, COLS = attention_backward_cols(HS);
    extern __shared__ __align__(16) unsigned char attention_shared[];
    bf16* q_s = reinterpret_cast<bf16*>(attention_shared);
    bf16* do_s = q_s + ATT_ROWS * LD;
    bf16* k_s = do_s + ATT_ROWS * LD;  // two buffers each
    bf16* v_s = k_s + 2 * COLS * LD;
    int T = a.T, bh = blockIdx.y, b = bh / a.NH, h = bh % a.NH, kh = h / (a.NH / a.KV), warp = threadIdx.x / 32;
    int q0 = (gridDim.x - 1 - blockIdx.x) * ATT_ROWS, row0 = warp * 16;
    const bf16* q_g = a.q.at(b, 0) + h * HS;
    const bf16* k_g = a.kv.at(b, 0) + kh * HS;  // the value head's lies KV·HS further
    int tiles = min(a.last_key(q0 + ATT_ROWS - 1), T - 1) / COLS + 1;

    attention_async_rows<HS>(q_s, q_g, a.q.stride, q0, ATT_ROWS, T);
    attention_async_rows<HS>(do_s, dout.at(b, 0) + h * HS, dout.stride, q0, ATT_ROWS, T);
    attention_async_rows<HS>(k_s, k_g, a.kv.stride, 0, COLS, T);
    attention_async_rows<HS>(v_s, k_g + a.KV * HS, a.kv.stride, 0, COLS, T);
    cp_async_commit();

    float row_lse[2], row_delta[2];
    slab_row_stats(row_lse, row_delta, lse.at(bh, 0), delta.at(bh, 0), q0 + row0, T);

    float dq[1][HS / 8][4] = {};
    for (int kt = 0; kt < tiles; kt++) {
        int buf = kt % 2, k0 = kt * COLS;
        attention_next_kv_tile<HS, COLS>(k_s, v_s, k_g, a.KV * HS, a.kv.stride, kt, tiles, T);
        const bf16* k_t = k_s + buf * COLS * LD;

        // a diagonal tile can lie wholly after this warp's queries (hs 128's narrow tiles, for the first warps)
        if (k0 <= a.last_key(q0 + row0 + 15)) {
            float p[1][COLS / 8][4], ds[1][COLS / 8][4];  // rows: this warp's queries; columns: the tile's keys
            warp_abt<HS, COLS, 1>(p, q_s, row0, k_t);
            warp_abt<HS, COLS, 1>(ds, do_s, row0, v_s + buf * COLS * LD);
            bool masked = k0 + COLS - 1 > a.last_key(q0);
            query_slab_probabilities<COLS>(p[0], ds[0], q0 + row0, k0, masked, a, row_lse, row_delta, scale_log2);
            warp_pm<HS, COLS, 1>(dq, ds, k_t);
        }
        __syncthreads();
    }
    float dq_scale[2] = {scale, scale};
    store_gradient_rows<HS>(dq_rows.at(b, 0) + h * HS, dq_rows.stride, dq[0], q0 + row0, T, dq_scale);
}

// ==========================================================================================================
// CUDA on Hopper: the same algorithms on `wgmma` (FlashAttention-3's shape), for sm_90a. A block is three
// warpgroups: the first is the producer, whose first warp copies tiles global -> shared memory with the tensor
// memory accelerator (TMA, `cp.async.bulk.tensor`) and hands them over on mbarriers; the other two are
// consumers, each owning 64 of the block's 128 rows and running its products as `wgmma.mma_async` m64nNk16
// (a warpgroup-wide matrix product: A 64×16 from shared memory or registers, B 16×N from shared memory,
// fp32 accumulators in registers). `setmaxnreg` moves registers from the producer to the consumers. The
// streamed tiles go through HOPPER_STAGES buffers: the producer refills a buffer once both consumers have
// arrived on its `empty` barrier, and the consumers start on it once its `full` barrier says the bytes landed.
// Per kernel, as in the mma.sync ones: the forward owns 128 queries and streams 128-key tiles of K and V; the
// dK/dV kernel owns 128 keys of a key/value head and streams 64-query tiles of Q and dO (with their lse and D)
// for each query head of the group in turn; the dQ kernel owns 128 queries and streams 64-key tiles of K and V.
// The softmax, the masks and the stores are the mma.sync kernels' helpers above: a wgmma accumulator gives each
// warp 16 of the warpgroup's 64 rows in the layout of an m16n8 accumulator per 8 columns.
// Not done here (FlashAttention-3 has them): overlapping one warpgroup's softmax with the other's products by
// explicit ping-pong barriers, and the next tile's QKᵀ with the current softmax; the two consumers interleave
// only as the warp schedulers let them.
//
// Shared-memory tiles. TMA writes 64-row × 64-column boxes (128 bytes a row) with the 128-byte swizzle: the
// 16-byte chunk c of row r lands at chunk c ^ (r % 8), so the 8 rows that one tensor-core read touches at
// the same chunk fall in 8 different bank groups. A tile of R rows × HS columns is HS/64 column blocks of
// R·128 bytes, the rows of a block back to back; every block starts on a 1024-byte boundary, where the swizzle
// pattern starts for both TMA and wgmma (the descriptors' base offset is then 0).
// Descriptors (PTX ISA, "Matrix Descriptor Format" and "Canonical Layouts"), with the 128-byte swizzle (mode 1
// in bits 62-63) and the start address, leading (LBO) and stride (SBO) byte offsets >> 4 in bits 0-13, 16-29
// and 32-45:
//   K-major (the tile's rows along M or N, the head dimension along K: Q, K, V, dO as the A and B of
//     QKᵀ, dO·Vᵀ, K·Qᵀ, V·dOᵀ): 8-row groups SBO = 1024 bytes apart; the 16 k of a step lie within a 128-byte
//     row, so LBO is unused (1 by convention), and the step k0 starts 2·(k0 % 64) bytes into column block k0/64.
//   MN-major (the tile's rows along K, the head dimension along N: V, dO, Q, K as the B of P·V, Pᵀ·dO, dSᵀ·Q,
//     dS·K, with imm-trans-b = 1): 8-row groups along K SBO = 1024 bytes apart, the 64-column blocks along N
//     LBO = R·128 bytes apart; the step k0 starts k0·128 bytes in.
// test/test_cuda_kernels.cu emulates TMA's placement, these descriptors and the fragment layouts on the CPU.

constexpr int HOPPER_THREADS = 384;   // a producer warpgroup and two consumer warpgroups
constexpr int HOPPER_ROWS = 128;      // rows a block owns, 64 per consumer warpgroup
constexpr int HOPPER_FWD_COLS = 128;  // keys per streamed tile in the forward
constexpr int HOPPER_BWD_COLS = 64;   // queries (dK/dV) or keys (dQ) per streamed tile in the backward: four
                                      // accumulators of 64 rows (dK, dV, Pᵀ, dSᵀ) must fit in the registers
constexpr int HOPPER_STAGES = 2;
constexpr int HOPPER_BOX = 64;  // rows and columns of one TMA box: 64 bf16 are the swizzle's 128 bytes
constexpr uint32_t HOPPER_BOX_BYTES = HOPPER_BOX * HOPPER_BOX * sizeof(bf16);
// registers per thread after setmaxnreg: 128·24 + 256·240 = 64512 of the SM's 65536. The dK/dV kernel at hs 128
// holds 192 accumulator registers (dK, dV, Pᵀ, dSᵀ); at 232 ptxas serializes its wgmma (C7512), at 240 not.
constexpr int HOPPER_PRODUCER_REGS = 24, HOPPER_CONSUMER_REGS = 240;

// the byte offset in a tile of `rows` rows of the TMA box holding rows [64·row_box, +64) and columns
// [64·col_box, +64)
__host__ __device__ constexpr uint32_t hopper_box_offset(int row_box, int col_box, int rows) {
    return (uint32_t)(col_box * rows * 128) + (uint32_t)row_box * HOPPER_BOX_BYTES;
}

// a wgmma shared-memory matrix descriptor with the 128-byte swizzle
__host__ __device__ constexpr uint64_t wgmma_descriptor(uint32_t start, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((start & 0x3FFFF) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(sbo >> 4) << 32 | 1ull << 62;
}

// rows [row0, row0 + 64 or N) of a tile of `rows` rows at shared address `tile`, head dimensions [k0, k0 + 16),
// as a K-major operand
__host__ __device__ constexpr uint64_t hopper_kmajor_desc(uint32_t tile, int rows, int row0, int k0) {
    return wgmma_descriptor(tile + hopper_box_offset(0, k0 / HOPPER_BOX, rows) + row0 * 128 + (k0 % HOPPER_BOX) * 2, 16,
                            1024);
}

// rows [k0, k0 + 16) of a tile of `rows` rows at shared address `tile`, all its head dimensions, as an MN-major
// operand
__host__ __device__ constexpr uint64_t hopper_mnmajor_desc(uint32_t tile, int rows, int k0) {
    return wgmma_descriptor(tile + k0 * 128, rows * 128, 1024);
}

// Where a kernel's tiles lie in its dynamic shared memory, as offsets from a 1024-byte aligned base: OWN tiles
// of HOPPER_ROWS rows that the block keeps, then per stage two streamed tiles of COLS rows, then (STATS) per
// stage the streamed queries' base-2 lse and their D, then the barriers: own_full, full[stage], empty[stage].
template <int HS, int OWN, int COLS, bool STATS>
struct HopperSmem {
    static constexpr uint32_t own_bytes = HOPPER_ROWS * HS * sizeof(bf16), tile_bytes = COLS * HS * sizeof(bf16);
    __host__ __device__ static constexpr uint32_t own(int i) { return i * own_bytes; }
    __host__ __device__ static constexpr uint32_t streamed(int stage, int i) {
        return OWN * own_bytes + (2 * stage + i) * tile_bytes;
    }
    static constexpr uint32_t lse = OWN * own_bytes + 2 * HOPPER_STAGES * tile_bytes;
    static constexpr uint32_t delta = lse + (STATS ? HOPPER_STAGES * COLS * sizeof(float) : 0);
    static constexpr uint32_t barriers = delta + (STATS ? HOPPER_STAGES * COLS * sizeof(float) : 0);
    static constexpr size_t bytes = barriers + 8 * (1 + 2 * HOPPER_STAGES) + 1024;  // with the alignment slack
};

struct HopperBarriers {
    uint32_t base;
    __device__ uint32_t own_full() const { return base; }
    __device__ uint32_t full(int stage) const { return base + 8 + 8 * stage; }
    __device__ uint32_t empty(int stage) const { return base + 8 + 8 * HOPPER_STAGES + 8 * stage; }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ----------------------------------------------------------------------------------------------------------
// PTX wrappers for sm_90a (mbarrier, TMA, wgmma, setmaxnreg); shared-memory operands are 32-bit shared
// addresses

static __device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

// this thread's arrival, which also makes the phase wait for `bytes` more of asynchronous copies
static __device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// this thread's arrival; it releases the thread's earlier memory accesses to whoever waits on the phase
static __device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// waits until the phase of parity `parity` has completed (phases alternate 0, 1, 0, ... from the init)
static __device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
}

// one 64×64 box of a 3-D tensor map (columns, rows, batch) into shared memory, completing on bar
static __device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, int col, int row, int batch,
                                                    uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(batch), "r"(bar)
        : "memory");
}

// rows [t0, t0 + rows) and columns [col, col + HS) of batch b into a tile of `rows` rows; rows past T are zeros
template <int HS>
static __device__ __forceinline__ void tma_load_tile(uint32_t tile, int rows, const CUtensorMap* map, int col, int t0,
                                                     int b, uint32_t bar) {
    for (int cb = 0; cb < HS / HOPPER_BOX; cb++)
        for (int rb = 0; rb < rows / HOPPER_BOX; rb++)
            tma_load_box(tile + hopper_box_offset(rb, cb, rows), map, col + HOPPER_BOX * cb, t0 + HOPPER_BOX * rb, b,
                         bar);
}

template <int REGS>
static __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
static __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// orders this warpgroup's earlier register writes (accumulators, A fragments) before the wgmma that follow
static __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// waits for every committed wgmma of this thread
static __device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// after wgmma_wait: pins acc's registers there, so that the compiler reads them no earlier (it does not know
// that the wait is what writes them)
template <int N>
static __device__ __forceinline__ void wgmma_pin(float (&acc)[N / 8][4]) {
#pragma unroll
    for (int j = 0; j < N / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(acc[j][e])::"memory");
}

#define WGMMA_ACC4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define WGMMA_ACC32(d, j)                                                                                     \
    WGMMA_ACC4(d, j), WGMMA_ACC4(d, j + 1), WGMMA_ACC4(d, j + 2), WGMMA_ACC4(d, j + 3), WGMMA_ACC4(d, j + 4), \
        WGMMA_ACC4(d, j + 5), WGMMA_ACC4(d, j + 6), WGMMA_ACC4(d, j + 7)
#define WGMMA_D64                                                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31}"
#define WGMMA_D128                                                                                                    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
    "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// acc (64×N, this thread's N/2 fp32) = A·B (+ acc when accumulate), A and B K-major in shared memory
template <int N>
static __device__ __forceinline__ void wgmma_smem(float (&acc)[N / 8][4], uint64_t a, uint64_t b, bool accumulate) {
    static_assert(N == 64 || N == 128, "wgmma_smem: N is 64 or 128");
    if constexpr (N == 64)
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_D64 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
            : WGMMA_ACC32(acc, 0)
            : "l"(a), "l"(b), "r"((int)accumulate));
    else
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WGMMA_D128 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
            : WGMMA_ACC32(acc, 0), WGMMA_ACC32(acc, 8)
            : "l"(a), "l"(b), "r"((int)accumulate));
}

// acc (64×N) += A·B, A 64×16 from registers (the m16n8k16 A layout in each warp's 16 rows), B MN-major in
// shared memory (imm-trans-b = 1)
template <int N>
static __device__ __forceinline__ void wgmma_regs(float (&acc)[N / 8][4], const uint32_t (&a)[4], uint64_t b) {
    static_assert(N == 64 || N == 128, "wgmma_regs: N is 64 or 128");
    if constexpr (N == 64)
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_D64
                     ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                     : WGMMA_ACC32(acc, 0)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WGMMA_D128
                     ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                     : WGMMA_ACC32(acc, 0), WGMMA_ACC32(acc, 8)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

#undef WGMMA_ACC4
#undef WGMMA_ACC32
#undef WGMMA_D64
#undef WGMMA_D128

// acc = the 64×N block of a·bᵀ for the warpgroup's 64 rows from row0 of tile a (a_rows rows) and the first N
// rows of tile b (b_rows rows), both K-major over HS: QKᵀ, dO·Vᵀ, K·Qᵀ, V·dOᵀ. The caller commits and waits.
template <int HS, int N>
static __device__ __forceinline__ void warpgroup_abt(float (&acc)[N / 8][4], uint32_t a, int a_rows, int row0,
                                                     uint32_t b, int b_rows) {
    wgmma_fence();
#pragma unroll
    for (int k0 = 0; k0 < HS; k0 += 16)
        wgmma_smem<N>(acc, hopper_kmajor_desc(a, a_rows, row0, k0), hopper_kmajor_desc(b, b_rows, 0, k0), k0 > 0);
}

// acc += p·mat: p the warpgroup's 64×COLS block held as accumulators (rounded to bf16 here), mat a tile of COLS
// rows, MN-major: PV, Pᵀ·dO, dSᵀ·Q, dS·K. The caller commits and waits.
template <int HS, int COLS>
static __device__ __forceinline__ void warpgroup_pm(float (&acc)[HS / 8][4], const float (&p)[COLS / 8][4],
                                                    uint32_t mat) {
    uint32_t a[COLS / 16][4];  // all converted before the fence: the fence orders them before the products
#pragma unroll
    for (int k0 = 0; k0 < COLS; k0 += 16) accumulators_to_a(a[k0 / 16], p[k0 / 8], p[k0 / 8 + 1]);
    wgmma_fence();
#pragma unroll
    for (int k0 = 0; k0 < COLS; k0 += 16) wgmma_regs<HS>(acc, a[k0 / 16], hopper_mnmajor_desc(mat, COLS, k0));
}

// the block's aligned shared-memory base, and thread 0 initializing the barriers (the full ones take the 32
// lanes of the producer warp, the empty ones every consumer thread) before anyone uses them
static __device__ __forceinline__ uint32_t hopper_setup(unsigned char* shared, uint32_t barriers_offset,
                                                        HopperBarriers& bar) {
    uint32_t base = (shared_address(shared) + 1023) & ~1023u;
    bar.base = base + barriers_offset;
    if (threadIdx.x == 0) {
        mbarrier_init(bar.own_full(), 1);
        for (int s = 0; s < HOPPER_STAGES; s++) {
            mbarrier_init(bar.full(s), 32);
            mbarrier_init(bar.empty(s), HOPPER_THREADS - 128);
        }
        // the initialized barriers become visible to the TMA unit (the async proxy) too
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    return base;
}

// The producer warp: the block's own tiles once (load_own(bar), own_bytes in all), then `tiles` stages of
// stage_bytes each (load_stage(n, stage, bar)), each buffer refilled once the consumers have released it.
// fill(n, stage, lane) writes what a stage carries besides its tiles with ordinary stores, before the lane's
// arrival releases them to the consumers.
template <typename LoadOwn, typename LoadStage, typename Fill>
static __device__ __forceinline__ void hopper_produce(const HopperBarriers& bar, int tiles, uint32_t own_bytes,
                                                      uint32_t stage_bytes, LoadOwn load_own, LoadStage load_stage,
                                                      Fill fill) {
    int lane = threadIdx.x % 32;
    if (lane == 0) {
        mbarrier_arrive_expect_tx(bar.own_full(), own_bytes);
        load_own(bar.own_full());
    }
    for (int n = 0; n < tiles; n++) {
        int stage = n % HOPPER_STAGES;
        // the consumers' arrivals on its previous use complete phase n / STAGES - 1 of the empty barrier
        if (n >= HOPPER_STAGES) mbarrier_wait(bar.empty(stage), (n / HOPPER_STAGES - 1) % 2);
        fill(n, stage, lane);
        if (lane == 0) {
            mbarrier_arrive_expect_tx(bar.full(stage), stage_bytes);
            load_stage(n, stage, bar.full(stage));
        } else {
            mbarrier_arrive(bar.full(stage));
        }
    }
}

// The backward kernels' warp specialization (the forward's is the same, written out): the first warpgroup hands
// its registers to the others and its first warp produces (produce()); each consumer warpgroup takes them and
// computes on its 64 of the block's own rows (consume(row0), row0 the first of them)
template <typename Produce, typename Consume>
static __device__ __forceinline__ void hopper_specialize(Produce produce, Consume consume) {
    if (threadIdx.x < 128) {
        setmaxnreg_dec<HOPPER_PRODUCER_REGS>();
        if (threadIdx.x < 32) produce();
    } else {
        setmaxnreg_inc<HOPPER_CONSUMER_REGS>();
        consume(HOPPER_BOX * (threadIdx.x / 128 - 1));
    }
}

// A consumer warpgroup of either backward kernel: the block's two own tiles (K and V for dK/dV, Q and dO for dQ)
// against `steps` streamed stages of two tiles (Q and dO, or K and V), step n's starting at row tile_start(n)
// of the sequence. At each step whose tile it can see (visible(t0)), its 64 rows from row0 against the tile's
// COLS: p = own(0)·streamed(0)ᵀ (the scores) and ds = own(1)·streamed(1)ᵀ (dO·Vᵀ), either way round; step(t0,
// stage, p, ds) turns them into P and dS and issues their products into the gradients, which are then waited
// for and pinned, in the order given. Every stage is released once passed, and with it whatever else the step
// read from the stage (the dK/dV kernel's lse and D).
template <int HS, int COLS, typename Smem, typename TileStart, typename Visible, typename Step, typename... Grads>
static __device__ __forceinline__ void hopper_backward_walk(const HopperBarriers& bar, uint32_t base, int row0,
                                                            int steps, TileStart tile_start, Visible visible, Step step,
                                                            Grads&... grads) {
    mbarrier_wait(bar.own_full(), 0);
    for (int n = 0; n < steps; n++) {
        int stage = n % HOPPER_STAGES, t0 = tile_start(n);
        mbarrier_wait(bar.full(stage), n / HOPPER_STAGES % 2);
        if (visible(t0)) {
            float p[COLS / 8][4], ds[COLS / 8][4];
            warpgroup_abt<HS, COLS>(p, base + Smem::own(0), HOPPER_ROWS, row0, base + Smem::streamed(stage, 0), COLS);
            warpgroup_abt<HS, COLS>(ds, base + Smem::own(1), HOPPER_ROWS, row0, base + Smem::streamed(stage, 1), COLS);
            wgmma_commit();
            wgmma_wait();
            wgmma_pin<COLS>(p);
            wgmma_pin<COLS>(ds);
            step(t0, stage, p, ds);
            wgmma_commit();
            wgmma_wait();
            (wgmma_pin<HS>(grads), ...);
        }
        mbarrier_arrive(bar.empty(stage));
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ----------------------------------------------------------------------------------------------------------
// the sm_90a kernels: grids and arguments as the mma.sync ones'; scale_log2 = log2(e)/√hs. The tensor maps
// span the block's rows: q_map the NH query heads (query head h's columns start at h·HS), kv_map the KV key heads
// and then the KV value heads (key head kh's at kh·HS, its value head's at (KV + kh)·HS, kh = h / (NH/KV)),
// dout_map the NH heads of the output gradient; all multiples of the 64-column box, and rows past T read as
// zeros. Their bodies exist only in the sm_90a machine code; in every other image they are empty, and
// attention_hopper_available says which image the device runs.

template <int HS, typename O>
static __global__ void __launch_bounds__(HOPPER_THREADS, 1)
    attention_forward_hopper_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap kv_map,
                                    AttentionBlock a, AttentionRows<O> out, AttentionRows<float> lse,
                                    float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int COLS = HOPPER_FWD_COLS;
    using Smem = HopperSmem<HS, 1, COLS, false>;
    extern __shared__ __align__(1024) unsigned char hopper_shared[];
    HopperBarriers bar;
    uint32_t base = hopper_setup(hopper_shared, Smem::barriers, bar);
    int T = a.T, KV = a.KV, bh = blockIdx.y, b = bh / a.NH, h = bh % a.NH, kh = h / (a.NH / KV);
    int q0 = (gridDim.x - 1 - blockIdx.x) * HOPPER_ROWS;
    int tiles = min(a.last_key(q0 + HOPPER_ROWS - 1), T - 1) / COLS + 1;  // key tiles up to the last one seen

    if (threadIdx.x < 128) {
        setmaxnreg_dec<HOPPER_PRODUCER_REGS>();
        if (threadIdx.x < 32)
            hopper_produce(
                bar, tiles, Smem::own_bytes, 2 * Smem::tile_bytes,
                [&](uint32_t full) {
                    tma_load_tile<HS>(base + Smem::own(0), HOPPER_ROWS, &q_map, h * HS, q0, b, full);
                },
                [&](int n, int stage, uint32_t full) {
                    tma_load_tile<HS>(base + Smem::streamed(stage, 0), COLS, &kv_map, kh * HS, n * COLS, b, full);
                    tma_load_tile<HS>(base + Smem::streamed(stage, 1), COLS, &kv_map, (KV + kh) * HS, n * COLS, b,
                                      full);
                },
                [](int, int, int) {});
    } else {
        setmaxnreg_inc<HOPPER_CONSUMER_REGS>();
        int row0 = HOPPER_BOX * (threadIdx.x / 128 - 1), query0 = q0 + row0 + 16 * (threadIdx.x / 32 % 4);
        float o[HS / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {};
        mbarrier_wait(bar.own_full(), 0);
        // every tile has keys at or before each of the block's queries, so none is skipped
        static_assert(COLS == HOPPER_ROWS, "a tile of the forward starts at or before every query of the block");
        for (int kt = 0; kt < tiles; kt++) {
            int stage = kt % HOPPER_STAGES, k0 = kt * COLS;
            mbarrier_wait(bar.full(stage), kt / HOPPER_STAGES % 2);
            float s[COLS / 8][4];
            warpgroup_abt<HS, COLS>(s, base + Smem::own(0), HOPPER_ROWS, row0, base + Smem::streamed(stage, 0), COLS);
            wgmma_commit();
            wgmma_wait();
            wgmma_pin<COLS>(s);
            online_softmax_slab<HS, COLS>(s, o, m, l, query0, k0, k0 + COLS - 1 > a.last_key(q0 + row0), a,
                                          scale_log2);
            warpgroup_pm<HS, COLS>(o, s, base + Smem::streamed(stage, 1));
            wgmma_commit();
            wgmma_wait();
            wgmma_pin<HS>(o);
            mbarrier_arrive(bar.empty(stage));
        }
        attention_store_slab<HS>(out.at(b, 0) + h * HS, lse.at(bh, 0), o, m, l, query0, T, out.stride);
    }
#endif
}

// dK and dV for 128 keys of one key/value head (grid as the mma.sync dK/dV kernel's, (key blocks, B·KV)): each
// consumer warpgroup holds 64 keys' dK and dV and walks, for each query head of the group in turn, the query
// tiles that can see them, in order
template <int HS, typename G>
static __global__ void __launch_bounds__(HOPPER_THREADS, 1)
    attention_backward_dkdv_hopper_kernel(const __grid_constant__ CUtensorMap q_map,
                                          const __grid_constant__ CUtensorMap kv_map,
                                          const __grid_constant__ CUtensorMap dout_map, AttentionBlock a,
                                          AttentionRows<const float> lse, AttentionRows<const float> delta,
                                          AttentionRows<G> dkv, float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int COLS = HOPPER_BWD_COLS;
    using Smem = HopperSmem<HS, 2, COLS, true>;
    extern __shared__ __align__(1024) unsigned char hopper_shared[];
    HopperBarriers bar;
    uint32_t base = hopper_setup(hopper_shared, Smem::barriers, bar);
    float* lse_s = reinterpret_cast<float*>(hopper_shared + (base - shared_address(hopper_shared)) + Smem::lse);
    float* delta_s = reinterpret_cast<float*>(hopper_shared + (base - shared_address(hopper_shared)) + Smem::delta);
    int T = a.T, NH = a.NH, KV = a.KV, group = NH / KV, bk = blockIdx.y, b = bk / KV, kh = bk % KV;
    int k0 = blockIdx.x * HOPPER_ROWS;
    // per query head, the query tiles holding a query that sees k0; step n of the walk is tile
    // first + n % per_head of the group's query head n / per_head
    int first = a.first_query(k0) / COLS, per_head = (T - 1) / COLS + 1 - first, steps = group * per_head;
    auto head_of = [&](int n) { return kh * group + n / per_head; };
    auto tile_start = [&](int n) { return (first + n % per_head) * COLS; };

    hopper_specialize(
        [&] {
            hopper_produce(
                bar, steps, 2 * Smem::own_bytes, 2 * Smem::tile_bytes,
                [&](uint32_t full) {
                    tma_load_tile<HS>(base + Smem::own(0), HOPPER_ROWS, &kv_map, kh * HS, k0, b, full);
                    tma_load_tile<HS>(base + Smem::own(1), HOPPER_ROWS, &kv_map, (KV + kh) * HS, k0, b, full);
                },
                [&](int n, int stage, uint32_t full) {
                    int h = head_of(n), q0 = tile_start(n);
                    tma_load_tile<HS>(base + Smem::streamed(stage, 0), COLS, &q_map, h * HS, q0, b, full);
                    tma_load_tile<HS>(base + Smem::streamed(stage, 1), COLS, &dout_map, h * HS, q0, b, full);
                },
                // queries past T get lse = +inf, which makes their P, and with it their dS, exactly 0
                [&](int n, int stage, int lane) {
                    const float* lse_head = lse.at((long)b * NH + head_of(n), 0);
                    const float* delta_head = delta.at((long)b * NH + head_of(n), 0);
                    for (int i = lane; i < COLS; i += 32) {
                        int query = tile_start(n) + i;
                        bool inside = query < T;
                        lse_s[stage * COLS + i] = inside ? lse_head[query] * 1.44269504f : INFINITY;
                        delta_s[stage * COLS + i] = inside ? delta_head[query] : 0.0f;
                    }
                });
        },
        [&](int row0) {
            int key0 = k0 + row0 + 16 * (threadIdx.x / 32 % 4);
            float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
            // p and ds: rows this warpgroup's keys, columns the tile's queries
            hopper_backward_walk<HS, COLS, Smem>(
                bar, base, row0, steps, tile_start,
                // a diagonal tile can lie wholly before this warpgroup's keys (the second one's, on the first tile)
                [&](int q0) { return k0 + row0 <= a.last_key(q0 + COLS - 1); },
                [&](int q0, int stage, float (&p)[COLS / 8][4], float (&ds)[COLS / 8][4]) {
                    key_slab_probabilities<COLS>(p, ds, key0, q0, k0 + row0 + HOPPER_BOX - 1 > a.last_key(q0), a,
                                                 lse_s + stage * COLS, delta_s + stage * COLS, scale_log2);
                    warpgroup_pm<HS, COLS>(dv, p, base + Smem::streamed(stage, 1));
                    warpgroup_pm<HS, COLS>(dk, ds, base + Smem::streamed(stage, 0));
                },
                dv, dk);
            float dk_scale[2] = {scale, scale}, one[2] = {1.0f, 1.0f};
            G* dkey = dkv.at(b, 0) + kh * HS;
            store_gradient_rows<HS>(dkey, dkv.stride, dk, key0, T, dk_scale);
            store_gradient_rows<HS>(dkey + KV * HS, dkv.stride, dv, key0, T, one);
        });
#endif
}

// dQ for 128 queries (grid as the forward's): each consumer warpgroup holds 64 queries' dQ and walks the key
// tiles they can see, in order, recomputing P and dS for them
template <int HS, typename G>
static __global__ void __launch_bounds__(HOPPER_THREADS, 1)
    attention_backward_dq_hopper_kernel(const __grid_constant__ CUtensorMap q_map,
                                        const __grid_constant__ CUtensorMap kv_map,
                                        const __grid_constant__ CUtensorMap dout_map, AttentionBlock a,
                                        AttentionRows<const float> lse, AttentionRows<const float> delta,
                                        AttentionRows<G> dq_rows, float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int COLS = HOPPER_BWD_COLS;
    using Smem = HopperSmem<HS, 2, COLS, false>;
    extern __shared__ __align__(1024) unsigned char hopper_shared[];
    HopperBarriers bar;
    uint32_t base = hopper_setup(hopper_shared, Smem::barriers, bar);
    int T = a.T, KV = a.KV, bh = blockIdx.y, b = bh / a.NH, h = bh % a.NH, kh = h / (a.NH / KV);
    int q0 = (gridDim.x - 1 - blockIdx.x) * HOPPER_ROWS;
    int tiles = min(a.last_key(q0 + HOPPER_ROWS - 1), T - 1) / COLS + 1;

    hopper_specialize(
        [&] {
            hopper_produce(
                bar, tiles, 2 * Smem::own_bytes, 2 * Smem::tile_bytes,
                [&](uint32_t full) {
                    tma_load_tile<HS>(base + Smem::own(0), HOPPER_ROWS, &q_map, h * HS, q0, b, full);
                    tma_load_tile<HS>(base + Smem::own(1), HOPPER_ROWS, &dout_map, h * HS, q0, b, full);
                },
                [&](int n, int stage, uint32_t full) {
                    tma_load_tile<HS>(base + Smem::streamed(stage, 0), COLS, &kv_map, kh * HS, n * COLS, b, full);
                    tma_load_tile<HS>(base + Smem::streamed(stage, 1), COLS, &kv_map, (KV + kh) * HS, n * COLS, b,
                                      full);
                },
                [](int, int, int) {});
        },
        [&](int row0) {
            int query0 = q0 + row0 + 16 * (threadIdx.x / 32 % 4);
            float row_lse[2], row_delta[2];
            slab_row_stats(row_lse, row_delta, lse.at(bh, 0), delta.at(bh, 0), query0, T);
            float dq[HS / 8][4] = {};
            // p and ds: rows this warpgroup's queries, columns the tile's keys
            hopper_backward_walk<HS, COLS, Smem>(
                bar, base, row0, tiles, [](int n) { return n * COLS; },
                // a diagonal tile can lie wholly after this warpgroup's queries (the first one's, on the last tile)
                [&](int k0) { return k0 <= a.last_key(q0 + row0 + HOPPER_BOX - 1); },
                [&](int k0, int stage, float (&p)[COLS / 8][4], float (&ds)[COLS / 8][4]) {
                    query_slab_probabilities<COLS>(p, ds, query0, k0, k0 + COLS - 1 > a.last_key(q0 + row0), a,
                                                   row_lse, row_delta, scale_log2);
                    warpgroup_pm<HS, COLS>(dq, ds, base + Smem::streamed(stage, 0));
                },
                dq);
            float dq_scale[2] = {scale, scale};
            store_gradient_rows<HS>(dq_rows.at(b, 0) + h * HS, dq_rows.stride, dq, query0, T, dq_scale);
        });
#endif
}

static __global__ void attention_hopper_probe_kernel(int* present) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *present = 1;
#else
    *present = 0;
#endif
}

// ----------------------------------------------------------------------------------------------------------
// entry points

// the head sizes compiled in; others are refused rather than silently slow
template <typename F>
inline void attention_dispatch(int C, int NH, int KV, F&& launch) {
    attention_check_heads(C, NH, KV);
    switch (C / NH) {
        case 64: launch(std::integral_constant<int, 64>{}); break;
        case 128: launch(std::integral_constant<int, 128>{}); break;
        default: fail("attention (CUDA): head size %d not supported (64 or 128)", C / NH);
    }
}

// launches a kernel with `bytes` of dynamic shared memory, raising its limit past the default 48 KiB on the
// first launch (the kernel is a template argument, so each kernel has its own flag)
template <auto kernel, typename... Args>
inline void attention_launch(dim3 grid, int threads, size_t bytes, cudaStream_t stream, Args... args) {
    static bool raised = false;
    if (!raised) {
        cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        raised = true;
    }
    kernel<<<grid, threads, bytes, stream>>>(args...);
    cuda_check(cudaGetLastError());
}

// a block's heads, and the 16-byte alignment its tiles need: the row strides are multiples of 8 bf16 whenever hs
// is 64 or 128, so the base pointers are what a caller can get wrong
inline void attention_check_block(const AttentionBlock& a) {
    attention_check_heads(a.C, a.NH, a.KV);
    require_aligned_16("attention: q", a.q.p);
    require_aligned_16("attention: kv", a.kv.p);
}

// the forward of a block with SLABS m16 slabs per warp (blocks of 16·SLABS·ATT_WARPS queries): out (bf16, or fp32
// for a ring block) and lse, the natural-log log-sum-exp of each query's scaled scores over the block's keys
template <int HS, int SLABS, typename O>
inline void attention_forward_launch(const AttentionBlock& a, AttentionRows<O> out, AttentionRows<float> lse,
                                     cudaStream_t stream) {
    constexpr int ROWS = 16 * SLABS * ATT_WARPS;
    size_t bytes = (size_t)(ROWS + 4 * ATT_FWD_COLS) * (HS + ATT_PAD) * sizeof(bf16);
    float scale_log2 = 1.44269504f / sqrtf((float)HS);
    attention_launch<attention_forward_kernel<HS, SLABS, O>>(dim3(cuda_blocks(a.T, ROWS), a.B * a.NH), 32 * ATT_WARPS,
                                                             bytes, stream, a, out, lse, scale_log2);
}

// the layer's forward over whole sequences with SLABS slabs per warp
template <int HS, int SLABS>
inline void attention_forward_launch(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int KV,
                                     cudaStream_t stream) {
    attention_forward_launch<HS, SLABS, bf16>(attention_whole_sequences(qkv, B, T, C, NH, KV), {out, (long)T * C, C},
                                              {lse, T, 1}, stream);
}

// out (B, T, C) and lse (B, NH, T) from qkv (B, T, (NH + 2·KV)·hs), causal, head size hs = C/NH in {64, 128},
// NH a multiple of KV; any T >= 1
inline void attention_forward_cuda(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int KV,
                                   cudaStream_t stream) {
    attention_dispatch(C, NH, KV, [&](auto hs) {
        attention_forward_launch<decltype(hs)::value, ATT_FWD_SLABS>(out, lse, qkv, B, T, C, NH, KV, stream);
    });
}

// fp32 scratch of attention_backward_cuda: D = rowsum(dO∘O), one per (b, h, t) of the NH query heads whatever KV
inline size_t attention_backward_scratch_floats(int B, int T, int C, int NH) {
    (void)C;
    return (size_t)B * NH * T;
}

// D = rowsum(dO∘O) (B, NH, T), the first step of every backward
template <int HS>
inline void attention_delta_cuda(float* delta, const bf16* dout, const bf16* out, int B, int T, int C, int NH,
                                 cudaStream_t stream) {
    long rows = (long)B * NH * T;
    attention_delta_kernel<HS><<<cuda_blocks(rows * (HS / 8), 256), 256, 0, stream>>>(delta, dout, out, rows, T, C, NH);
    cuda_check(cudaGetLastError());
}
inline void attention_delta_cuda(float* delta, const bf16* dout, const bf16* out, int B, int T, int C, int NH,
                                 cudaStream_t stream) {
    attention_dispatch(C, NH, NH, [&](auto hs) {
        attention_delta_cuda<decltype(hs)::value>(delta, dout, out, B, T, C, NH, stream);
    });
}

// the backward of a block from D and the forward's lse over everything the queries see: dQ at dq and dK, dV at
// dkv (key head 0 of row 0, the value heads KV·hs further), stored as bf16 or added to fp32 (G); deterministic
template <int HS, typename G>
inline void attention_backward_launch(const AttentionBlock& a, AttentionRows<const bf16> dout,
                                      AttentionRows<const float> lse, AttentionRows<const float> delta,
                                      AttentionRows<G> dq, AttentionRows<G> dkv, cudaStream_t stream) {
    constexpr int COLS = attention_backward_cols(HS);
    float scale = 1.0f / sqrtf((float)HS), scale_log2 = 1.44269504f * scale;
    int blocks = cuda_blocks(a.T, ATT_ROWS);
    size_t tiles_bytes = (size_t)(2 * ATT_ROWS + 4 * COLS) * (HS + ATT_PAD) * sizeof(bf16);
    size_t stats_bytes = 4 * COLS * sizeof(float);
    attention_launch<attention_backward_dkdv_kernel<HS, G>>(dim3(blocks, a.B * a.KV), 32 * ATT_WARPS,
                                                            tiles_bytes + stats_bytes, stream, a, dout, lse, delta, dkv,
                                                            scale, scale_log2);
    attention_launch<attention_backward_dq_kernel<HS, G>>(dim3(blocks, a.B * a.NH), 32 * ATT_WARPS, tiles_bytes, stream,
                                                          a, dout, lse, delta, dq, scale, scale_log2);
}

// dqkv (B, T, (NH + 2·KV)·hs) overwritten; out and lse are the forward's; deterministic (no atomics): dK and dV
// of a key/value head are summed over its group's query heads by the one block that owns the key block
inline void attention_backward_cuda(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                                    float* scratch, int B, int T, int C, int NH, int KV, cudaStream_t stream) {
    float* delta = scratch;
    attention_dispatch(C, NH, KV, [&](auto hs) {
        constexpr int HS = decltype(hs)::value;
        attention_delta_cuda<HS>(delta, dout, out, B, T, C, NH, stream);
        long W = attention_qkv_width(C, NH, KV);
        attention_backward_launch<HS, bf16>(attention_whole_sequences(qkv, B, T, C, NH, KV), {dout, (long)T * C, C},
                                            {lse, T, 1}, {delta, T, 1}, {dqkv, T * W, W}, {dqkv + C, T * W, W}, stream);
    });
}

// ----------------------------------------------------------------------------------------------------------
// the sm_90a kernels' entry points

// Whether the wgmma kernels run on the current device: a Hopper GPU (compute capability 9.0) and sm_90a
// machine code in this binary, which the probe finds by running on the image the driver picked for the device
// (the sm_90 image of a build without sm_90a has the kernels' empty bodies). why says what is missing.
inline bool attention_hopper_available(std::string* why = nullptr) {
    int dev = 0, major = 0, minor = 0;
    cuda_check(cudaGetDevice(&dev));
    cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major != 9 || minor != 0) {
        if (why)
            *why = strfmt("the GPU has compute capability %d.%d; the wgmma kernels need 9.0 (Hopper)", major, minor);
        return false;
    }
    int *flag, present = 0;
    cuda_check(cudaMalloc(&flag, sizeof(int)));
    attention_hopper_probe_kernel<<<1, 1>>>(flag);
    cudaError_t launched = cudaGetLastError();
    if (launched == cudaSuccess) cuda_check(cudaMemcpy(&present, flag, sizeof(int), cudaMemcpyDeviceToHost));
    cuda_check(cudaFree(flag));
    if (launched != cudaErrorNoKernelImageForDevice) cuda_check(launched);
    if (!present && why)
        *why =
            "this binary has no sm_90a machine code (build with CUDA_ARCH including "
            "-gencode arch=compute_90a,code=sm_90a)";
    return present;
}

// A 3-D TMA map over the rows of a tensor (columns, rows, batch, innermost first): `width` columns of T rows of
// B sequences at rows.p, with its row and batch strides; 64×64 boxes, the 128-byte swizzle, zeros for rows past
// T. The encoder is the driver's, found through the runtime (no -lcuda).
inline CUtensorMap hopper_tensor_map(AttentionRows<const bf16> rows, int B, int T, int width) {
    using Encode = PFN_cuTensorMapEncodeTiled_v12000;
    static Encode encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        cuda_check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || !fn)
            fail("attention (wgmma): the driver has no cuTensorMapEncodeTiled");
        return reinterpret_cast<Encode>(fn);
    }();
    require_aligned_16("attention (wgmma)", rows.p);
    CUtensorMap map;
    cuuint64_t dims[3] = {(cuuint64_t)width, (cuuint64_t)T, (cuuint64_t)B};
    cuuint64_t strides[2] = {(cuuint64_t)rows.stride * sizeof(bf16), (cuuint64_t)rows.batch * sizeof(bf16)};
    cuuint32_t box[3] = {HOPPER_BOX, HOPPER_BOX, 1}, steps[3] = {1, 1, 1};
    CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16*>(rows.p), dims, strides, box, steps,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        fail("attention (wgmma): cuTensorMapEncodeTiled failed (%d) for B=%d T=%d width %d", (int)r, B, T, width);
    return map;
}

// the maps of a block's queries (NH heads) and keys and values (KV heads each)
inline CUtensorMap hopper_query_map(const AttentionBlock& a) { return hopper_tensor_map(a.q, a.B, a.T, a.C); }
inline CUtensorMap hopper_kv_map(const AttentionBlock& a) {
    return hopper_tensor_map(a.kv, a.B, a.T, 2 * a.KV * (a.C / a.NH));
}

// the forward of a block on the wgmma kernels (attention_hopper_available must hold); as attention_forward_launch
template <int HS, typename O>
inline void attention_forward_hopper_launch(const AttentionBlock& a, AttentionRows<O> out, AttentionRows<float> lse,
                                            cudaStream_t stream) {
    float scale_log2 = 1.44269504f / sqrtf((float)HS);
    attention_launch<attention_forward_hopper_kernel<HS, O>>(dim3(cuda_blocks(a.T, HOPPER_ROWS), a.B * a.NH),
                                                             HOPPER_THREADS, HopperSmem<HS, 1, HOPPER_FWD_COLS, false>::bytes,
                                                             stream, hopper_query_map(a), hopper_kv_map(a), a, out, lse,
                                                             scale_log2);
}

// the forward on the wgmma kernels; the arguments as attention_forward_cuda's
inline void attention_forward_hopper(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int KV,
                                     cudaStream_t stream) {
    attention_dispatch(C, NH, KV, [&](auto hs) {
        attention_forward_hopper_launch<decltype(hs)::value, bf16>(attention_whole_sequences(qkv, B, T, C, NH, KV),
                                                                   {out, (long)T * C, C}, {lse, T, 1}, stream);
    });
}

// the backward of a block on the wgmma kernels; as attention_backward_launch
template <int HS, typename G>
inline void attention_backward_hopper_launch(const AttentionBlock& a, AttentionRows<const bf16> dout,
                                             AttentionRows<const float> lse, AttentionRows<const float> delta,
                                             AttentionRows<G> dq, AttentionRows<G> dkv, cudaStream_t stream) {
    CUtensorMap q_map = hopper_query_map(a), kv_map = hopper_kv_map(a),
                dout_map = hopper_tensor_map(dout, a.B, a.T, a.C);
    float scale = 1.0f / sqrtf((float)HS), scale_log2 = 1.44269504f * scale;
    int blocks = cuda_blocks(a.T, HOPPER_ROWS);
    attention_launch<attention_backward_dkdv_hopper_kernel<HS, G>>(
        dim3(blocks, a.B * a.KV), HOPPER_THREADS, HopperSmem<HS, 2, HOPPER_BWD_COLS, true>::bytes, stream, q_map, kv_map,
        dout_map, a, lse, delta, dkv, scale, scale_log2);
    attention_launch<attention_backward_dq_hopper_kernel<HS, G>>(
        dim3(blocks, a.B * a.NH), HOPPER_THREADS, HopperSmem<HS, 2, HOPPER_BWD_COLS, false>::bytes, stream, q_map,
        kv_map, dout_map, a, lse, delta, dq, scale, scale_log2);
}

// the backward on the wgmma kernels: the arguments, the scratch and the determinism as attention_backward_cuda's
inline void attention_backward_hopper(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                                      float* scratch, int B, int T, int C, int NH, int KV, cudaStream_t stream) {
    float* delta = scratch;
    attention_dispatch(C, NH, KV, [&](auto hs) {
        constexpr int HS = decltype(hs)::value;
        attention_delta_cuda<HS>(delta, dout, out, B, T, C, NH, stream);
        long W = attention_qkv_width(C, NH, KV);
        attention_backward_hopper_launch<HS, bf16>(attention_whole_sequences(qkv, B, T, C, NH, KV),
                                                   {dout, (long)T * C, C}, {lse, T, 1}, {delta, T, 1},
                                                   {dqkv, T * W, W}, {dqkv + C, T * W, W}, stream);
    });
}

// ----------------------------------------------------------------------------------------------------------
// which kernels the model's layers run: the wgmma ones where they can (a Hopper, and a binary with its sm_90a
// code: faster there, e.g. a d12 step 126 ms against 136 on an H100), the mma.sync ones everywhere else
// (--attention names one). The model holds its choice (llmc/gpt.cuh) and passes it to every attention it runs,
// the ring's blocks included; the CPU has its own attention and ignores it.

enum class AttentionKernels { MMA, WGMMA };

inline const char* attention_kernels_name(AttentionKernels k) { return k == AttentionKernels::WGMMA ? "wgmma" : "mma"; }

// --attention's value ("" when not given) on a device that can run the wgmma kernels (hopper) or not (why_not
// says why): the default follows the device quietly; wgmma asked for where it cannot run is refused in one line
inline AttentionKernels resolve_attention_kernels(const std::string& flag, bool hopper, const std::string& why_not) {
    if (flag == "mma") return AttentionKernels::MMA;
    if (flag == "wgmma" && !hopper) fail("--attention wgmma: %s", why_not.c_str());
    if (flag == "wgmma" || (flag.empty() && hopper)) return AttentionKernels::WGMMA;
    if (flag.empty()) return AttentionKernels::MMA;
    fail("--attention %s: expected mma or wgmma", flag.c_str());
}

// the kernels --attention names on the current GPU (flag "": this GPU's default), or one line refusing the flag
inline AttentionKernels attention_select(const std::string& flag) {
    std::string why_not;
    bool hopper = attention_hopper_available(&why_not);
    return resolve_attention_kernels(flag, hopper, why_not);
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points. What forward keeps for backward differs by device: the CPU keeps the softmax
// probabilities (B, NH, T, T) in `att`, the GPU only each row's logsumexp (B, NH, T), from which the flash
// backward recomputes them tile by tile; the GPU backward also reads the forward's output `out`. Each device
// ignores what only the other needs: the CPU backward's rows (T floats per thread), the GPU's workspace (D,
// attention_backward_scratch_floats) and its kernels.

#include "llmc/device.cuh"

inline void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH, int KV,
                              AttentionKernels) {
    attention_forward(out, att, qkv, B, T, C, NH, KV);
}
inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float*, const float* att, int B,
                               int T, int C, int NH, int KV, float* rows, Workspace, AttentionKernels) {
    attention_backward(dqkv, dout, qkv, att, B, T, C, NH, KV, rows);
}

inline void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int KV,
                              AttentionKernels kernels) {
    if (kernels == AttentionKernels::WGMMA)
        attention_forward_hopper(out, lse, qkv, B, T, C, NH, KV, main_stream());
    else
        attention_forward_cuda(out, lse, qkv, B, T, C, NH, KV, main_stream());
}
inline void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B,
                               int T, int C, int NH, int KV, float*, Workspace workspace, AttentionKernels kernels) {
    float* scratch = workspace.take(attention_backward_scratch_floats(B, T, C, NH), "attention_backward");
    if (kernels == AttentionKernels::WGMMA)
        attention_backward_hopper(dqkv, dout, qkv, out, lse, scratch, B, T, C, NH, KV, main_stream());
    else
        attention_backward_cuda(dqkv, dout, qkv, out, lse, scratch, B, T, C, NH, KV, main_stream());
}

// ----------------------------------------------------------------------------------------------------------
// ring attention's blocks (llmc/cp.cuh) on the kernels the layers run (--attention), `kernels`: the block's output and
// log-sum-exp in fp32, which the ring merges with its online softmax, and the block's share of dQ, dK and dV
// added to the ring's fp32 accumulators. lse and delta are the global ones (over every key the queries see).

inline void attention_block_forward(const AttentionBlock& a, AttentionRows<float> out, AttentionRows<float> lse,
                                    AttentionKernels kernels) {
    attention_check_block(a);
    attention_dispatch(a.C, a.NH, a.KV, [&](auto hs) {
        constexpr int HS = decltype(hs)::value;
        if (kernels == AttentionKernels::WGMMA)
            attention_forward_hopper_launch<HS, float>(a, out, lse, main_stream());
        else
            attention_forward_launch<HS, ATT_FWD_SLABS, float>(a, out, lse, main_stream());
    });
}

inline void attention_block_backward(const AttentionBlock& a, AttentionRows<const bf16> dout,
                                     AttentionRows<const float> lse, AttentionRows<const float> delta,
                                     AttentionRows<float> dq, AttentionRows<float> dkv, AttentionKernels kernels) {
    attention_check_block(a);
    require_aligned_16("attention: dout", dout.p);
    attention_dispatch(a.C, a.NH, a.KV, [&](auto hs) {
        constexpr int HS = decltype(hs)::value;
        if (kernels == AttentionKernels::WGMMA)
            attention_backward_hopper_launch<HS, float>(a, dout, lse, delta, dq, dkv, main_stream());
        else
            attention_backward_launch<HS, float>(a, dout, lse, delta, dq, dkv, main_stream());
    });
}

// ==========================================================================================================
// Ring attention's blocks (llmc/cp.cuh) on both devices: the ring keeps a rank's queries and passes the keys
// and values around, and what it computes with them is here. The heads and rows a block works on; the block's
// attention (a CPU loop, and on CUDA the kernels the layers run, through attention_block_forward/backward above);
// the copies between qkv rows and the K/V rows that travel; D; and the merge of each block's output into the
// running one (the online softmax across blocks). Each is a CPU loop (fp32, OpenMP) with its CUDA beside it (bf16
// storage, fp32 arithmetic, fp32 running output, log-sum-exp and gradient accumulators). The fp32 buffers exist
// on both devices, so the steps that touch only them take the storage type as a template argument to know where
// they live.

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

// The per-block kernels. A block is n local query rows starting at q0 of qkv (B, Tl, C + 2K) against n key rows
// starting at k0 of kv (B, Tl, 2K: K then V, the layout that travels), per (batch, query head); causal masks key
// j after query i of the block (both chunks are the same n positions of the sequence).
//
// forward: out_blk (B, n, C) = the block's softmax over its keys applied to V, lse_blk (B, NH, n) its
// log-sum-exp (natural log, of the scaled scores).
// backward: with the global lse and D = rowsum(dO∘O) of the query rows (B, NH, Tl), adds the block's share to
// dq (B, Tl, C) at the query rows and to dkv (B, Tl, 2K) at the key rows, all fp32; a key/value head's gradient
// sums its NH/KV query heads, in head order. The GPU's blocks run the model's attention kernels (the CPU ignores
// them).

inline void ring_block_forward(float* out_blk, float* lse_blk, const float* qkv, int q0, const float* kv, int k0, int n,
                               bool causal, int B, int Tl, RingHeads a, AttentionKernels) {
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
inline void ring_block_backward(float* dq, float* dkv, const float* dout, const float* qkv, int q0, const float* kv,
                                int k0, int n, bool causal, const float* lse, const float* delta, int B, int Tl,
                                RingHeads a, AttentionKernels) {
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

// CUDA: the flash kernels above, the ones the layers run (--attention mma or wgmma), on the block's rows where
// they lie: the queries at row q0 of qkv, the keys and values at row k0 of the ring's buffer, each sequence Tl
// rows further; the causal mask for a chunk with itself, the full one for an earlier chunk.
// The forward writes the block's output and log-sum-exp in fp32; the backward adds the block's share to the fp32
// accumulators, each row owned by one warp of a launch, so the sums are deterministic as the CPU's.

inline AttentionBlock ring_attention_block(const bf16* qkv, int q0, const bf16* kv, int k0, int n, bool causal, int B,
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

inline void ring_block_forward(float* out_blk, float* lse_blk, const bf16* qkv, int q0, const bf16* kv, int k0, int n,
                               bool causal, int B, int Tl, RingHeads a, AttentionKernels kernels) {
    attention_block_forward(ring_attention_block(qkv, q0, kv, k0, n, causal, B, Tl, a), {out_blk, (long)n * a.C, a.C},
                            {lse_blk, n, 1}, kernels);
}

inline void ring_block_backward(float* dq, float* dkv, const bf16* dout, const bf16* qkv, int q0, const bf16* kv,
                                int k0, int n, bool causal, const float* lse, const float* delta, int B, int Tl,
                                RingHeads a, AttentionKernels kernels) {
    attention_block_backward(ring_attention_block(qkv, q0, kv, k0, n, causal, B, Tl, a),
                             {dout + (long)q0 * a.C, (long)Tl * a.C, a.C}, {lse + q0, Tl, 1}, {delta + q0, Tl, 1},
                             {dq + (long)q0 * a.C, (long)Tl * a.C, a.C},
                             {dkv + (long)k0 * a.kv_row(), (long)Tl * a.kv_row(), a.kv_row()}, kernels);
}

// kv (rows, 2K) = the K and V columns of qkv (rows, C + 2K): what travels the ring
inline void ring_pack_kv(float* kv, const float* qkv, long rows, RingHeads a) {
#pragma omp parallel for
    for (long r = 0; r < rows; r++)
        memcpy(kv + r * a.kv_row(), qkv + r * a.qkv_row() + a.C, a.kv_row() * sizeof(float));
}
static __global__ void ring_pack_kv_kernel(bf16* kv, const bf16* qkv, long rows, RingHeads a) {
    long width = a.kv_row();
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * width; i += (long)gridDim.x * blockDim.x)
        kv[i] = qkv[i / width * a.qkv_row() + a.C + i % width];
}
inline void ring_pack_kv(bf16* kv, const bf16* qkv, long rows, RingHeads a) {
    launch_elementwise(ring_pack_kv_kernel, rows * a.kv_row(), kv, qkv, rows, a);
}

// dqkv (rows, C + 2K) = dq (rows, C) beside dkv (rows, 2K), in the storage type
inline void ring_store_grads(float* dqkv, const float* dq, const float* dkv, long rows, RingHeads a) {
#pragma omp parallel for
    for (long r = 0; r < rows; r++) {
        memcpy(dqkv + r * a.qkv_row(), dq + r * a.C, a.C * sizeof(float));
        memcpy(dqkv + r * a.qkv_row() + a.C, dkv + r * a.kv_row(), a.kv_row() * sizeof(float));
    }
}
static __global__ void ring_store_grads_kernel(bf16* dqkv, const float* dq, const float* dkv, long rows, RingHeads a) {
    long width = a.qkv_row();
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * width; i += (long)gridDim.x * blockDim.x) {
        long r = i / width;
        int c = (int)(i % width);
        dqkv[i] = __float2bfloat16(c < a.C ? dq[r * a.C + c] : dkv[r * a.kv_row() + c - a.C]);
    }
}
inline void ring_store_grads(bf16* dqkv, const float* dq, const float* dkv, long rows, RingHeads a) {
    launch_elementwise(ring_store_grads_kernel, rows * a.qkv_row(), dqkv, dq, dkv, rows, a);
}

// delta (B, NH, Tl) = dO·O over each head: the softmax backward's Σ_j P·dP of the row
inline void attention_delta(float* delta, const float* dout, const float* out, int B, int Tl, int C, int NH) {
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
inline void attention_delta(float* delta, const bf16* dout, const bf16* out, int B, int Tl, int C, int NH) {
    attention_delta_cuda(delta, dout, out, B, Tl, C, NH, main_stream());  // the flash backward's own first step
}

// One query row's running output (hs wide, normalized over the keys seen so far) and log-sum-exp take in a
// block's: the log-sum-exp of the union, and each output weighted by its share of the new total. A running
// log-sum-exp of -inf (no keys yet) gives the block's own.
static __host__ __device__ inline void ring_merge_row(float* out, float* lse, const float* out_blk, float lse_blk,
                                                      int hs) {
    float hi = fmaxf(*lse, lse_blk), lo = fminf(*lse, lse_blk);
    float merged = hi + log1pf(expf(lo - hi));
    float keep = expf(*lse - merged), take = expf(lse_blk - merged);
    for (int e = 0; e < hs; e++) out[e] = out[e] * keep + out_blk[e] * take;
    *lse = merged;
}
static __global__ void ring_merge_kernel(float* out, float* lse, int q0, const float* out_blk, const float* lse_blk,
                                         int n, long rows, int Tl, int C, int NH) {
    int hs = C / NH;
    for (long r = (long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (long)gridDim.x * blockDim.x) {
        long b = r / ((long)NH * n), h = r / n % NH, i = r % n;
        ring_merge_row(out + (b * Tl + q0 + i) * C + h * hs, lse + (b * NH + h) * Tl + q0 + i,
                       out_blk + (b * n + i) * C + h * hs, lse_blk[r], hs);
    }
}
// the block's rows (B, n) merged into the running ones at local rows q0..q0+n
template <typename floatX>
inline void ring_merge(float* out, float* lse, int q0, const float* out_blk, const float* lse_blk, int n, int B, int Tl,
                       int C, int NH) {
    long rows = (long)B * NH * n;
    if constexpr (device_of<floatX> == Device::CUDA) {
        launch_elementwise(ring_merge_kernel, rows, out, lse, q0, out_blk, lse_blk, n, rows, Tl, C, NH);
    } else {
        int hs = C / NH;
#pragma omp parallel for
        for (long r = 0; r < rows; r++) {
            long b = r / ((long)NH * n), h = r / n % NH, i = r % n;
            ring_merge_row(out + (b * Tl + q0 + i) * C + h * hs, lse + (b * NH + h) * Tl + q0 + i,
                           out_blk + (b * n + i) * C + h * hs, lse_blk[r], hs);
        }
    }
}
