// Causal multi-head self-attention on a packed qkv tensor (B, T, 3C): q, k, v each C wide, heads contiguous
// slices of hs = C/NH channels. The forward keeps the softmax probabilities att (B, NH, T, T) for the backward;
// entries above the diagonal are zero.
#pragma once

#include <cmath>
#include <cstring>

#include <omp.h>

inline void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    int C3 = 3 * C;
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float* q = qkv + ((size_t)b * T + t) * C3 + h * hs;
                float* row = att + (((size_t)b * NH + h) * T + t) * T;
                float maxv = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = qkv + ((size_t)b * T + t2) * C3 + C + h * hs;
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
                    const float* v = qkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
                    for (int i = 0; i < hs; i++) o[i] += row[t2] * v[i];
                }
            }
}

// dqkv (B, T, 3C) is overwritten. Keys and values receive gradient from every later query, so one thread owns
// each (batch, head) pair and sums in query order. scratch holds T floats per thread.
inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C,
                               int NH, float* scratch) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    int C3 = 3 * C;
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            float* dpre = scratch + (size_t)omp_get_thread_num() * T;
            for (int t = 0; t < T; t++) {
                float* base = dqkv + ((size_t)b * T + t) * C3 + h * hs;
                memset(base, 0, hs * sizeof(float));
                memset(base + C, 0, hs * sizeof(float));
                memset(base + 2 * C, 0, hs * sizeof(float));
            }
            for (int t = 0; t < T; t++) {
                const float* row = att + (((size_t)b * NH + h) * T + t) * T;
                const float* d = dout + ((size_t)b * T + t) * C + h * hs;
                // datt[t2] = d · v[t2]; dpre = att * (datt - Σ att·datt), the softmax backward
                float dot = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* v = qkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
                    float s = 0.0f;
                    for (int i = 0; i < hs; i++) s += d[i] * v[i];
                    dpre[t2] = s;
                    dot += row[t2] * s;
                }
                const float* q = qkv + ((size_t)b * T + t) * C3 + h * hs;
                float* dq = dqkv + ((size_t)b * T + t) * C3 + h * hs;
                for (int t2 = 0; t2 <= t; t2++) {
                    float g = row[t2] * (dpre[t2] - dot) * scale;
                    const float* k = qkv + ((size_t)b * T + t2) * C3 + C + h * hs;
                    float* dk = dqkv + ((size_t)b * T + t2) * C3 + C + h * hs;
                    float* dv = dqkv + ((size_t)b * T + t2) * C3 + 2 * C + h * hs;
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
// The backward is deterministic without atomics: one kernel owns a key tile and sums dK and dV over query
// tiles in order, another owns a query tile and sums dQ over key tiles in order. That recomputes QKᵀ and
// dO·Vᵀ in both (7 tile products where FlashAttention-2 has 5 and adds dQ with atomics in arbitrary order).
// out is (B, T, C) with head h in channels [h·hs, (h+1)·hs); lse is (B, NH, T) natural-log log-sum-exps of
// the scaled scores; the backward's scratch holds D = rowsum(dO∘O), also (B, NH, T). qkv, out and dout must be
// 16-byte aligned (tiles move in 16-byte pieces); B·NH is the grid's second dimension, at most 65535.
// `cuobjdump -sass dev/cuda/attention | grep HMMA` lists the tensor-core instructions of these kernels.

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
// other buffer, then tile kt (in buffer kt % 2) is waited for by every thread.
template <int HS, int COLS>
static __device__ __forceinline__ void attention_next_kv_tile(bf16* k_s, bf16* v_s, const bf16* q_g, int C, long stride,
                                                              int kt, int tiles, int T) {
    constexpr int LD = HS + ATT_PAD;
    int buf = kt % 2, k0 = kt * COLS;
    if (kt + 1 < tiles) {
        attention_async_rows<HS>(k_s + (buf ^ 1) * COLS * LD, q_g + C, stride, k0 + COLS, COLS, T);
        attention_async_rows<HS>(v_s + (buf ^ 1) * COLS * LD, q_g + 2 * C, stride, k0 + COLS, COLS, T);
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

// a warp's (16·SLABS)×HS accumulator rows, row r scaled by scale[r / 16][r % 16 / 8], as bf16 pairs at
// dst + (t0 + r)·row_stride; rows at or past T skipped
template <int HS, int SLABS>
static __device__ __forceinline__ void warp_store_rows(bf16* dst, long row_stride,
                                                       const float (&acc)[SLABS][HS / 8][4], int t0, int T,
                                                       const float (&scale)[SLABS][2]) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < SLABS; m++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int t = t0 + 16 * m + accumulator_coord(lane, 2 * half).row, col = accumulator_coord(lane, 0).col;
            if (t >= T) continue;
#pragma unroll
            for (int j = 0; j < HS / 8; j++)
                *reinterpret_cast<__nv_bfloat162*>(dst + (long)t * row_stride + 8 * j + col) = __floats2bfloat162_rn(
                    acc[m][j][2 * half] * scale[m][half], acc[m][j][2 * half + 1] * scale[m][half]);
        }
}

// ----------------------------------------------------------------------------------------------------------
// kernels

// one key tile of the forward for a warp's queries, rows [row0, row0 + 16·SLABS) of the block's q_s, query
// q0 + row0 the first: scores, the online softmax
// update of the running max m and sum l (this lane's share), and o rescaled then += P·V. diagonal: mask keys
// after their query (this also hides keys past T, which are after every query).
template <int HS, int SLABS>
static __device__ __forceinline__ void attention_forward_tile(float (&o)[SLABS][HS / 8][4], float (&m)[SLABS][2],
                                                              float (&l)[SLABS][2], const bf16* q_s, int row0,
                                                              const bf16* k_t, const bf16* v_t, int q0, int k0,
                                                              bool diagonal, float scale_log2) {
    constexpr int COLS = ATT_FWD_COLS;
    int lane = threadIdx.x % 32;
    float s[SLABS][COLS / 8][4];
    warp_abt<HS, COLS, SLABS>(s, q_s, row0, k_t);
#pragma unroll
    for (int sl = 0; sl < SLABS; sl++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int query = q0 + row0 + 16 * sl + accumulator_coord(lane, 2 * half).row;
            float m_new = m[sl][half];
#pragma unroll
            for (int j = 0; j < COLS / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int key = k0 + 8 * j + accumulator_coord(lane, e).col;
                    float x = diagonal && key > query ? -INFINITY : s[sl][j][2 * half + e] * scale_log2;
                    s[sl][j][2 * half + e] = x;
                    m_new = fmaxf(m_new, x);
                }
            // the 4 lanes of a quad hold the row between them
            m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 1));
            m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 2));
            // key 0 is visible to every row and every warp takes tile 0, so m_new is finite from there on
            // and the first rescale is exp2(-inf) = 0
            float rescale = exp2f(m[sl][half] - m_new), sum = 0.0f;
            m[sl][half] = m_new;
#pragma unroll
            for (int j = 0; j < COLS / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float p = exp2f(s[sl][j][2 * half + e] - m_new);
                    s[sl][j][2 * half + e] = p;
                    sum += p;
                }
            l[sl][half] = l[sl][half] * rescale + sum;
#pragma unroll
            for (int j = 0; j < HS / 8; j++) {
                o[sl][j][2 * half] *= rescale;
                o[sl][j][2 * half + 1] *= rescale;
            }
        }
    warp_pm<HS, COLS, SLABS>(o, s, v_t);
}

// grid (query blocks, B·NH); the longest rows (last blocks) start first so the tail of the grid is short.
// Warp w owns queries [16·SLABS·w, 16·SLABS·(w+1)) of the block, as SLABS m16 slabs. scale_log2 = log2(e)/√hs:
// scores are kept in base 2 so each exponential is one exp2.
template <int HS, int SLABS>
static __global__ void __launch_bounds__(32 * ATT_WARPS)
    attention_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int C, int NH, float scale_log2) {
    constexpr int LD = HS + ATT_PAD, COLS = ATT_FWD_COLS, ROWS = 16 * SLABS * ATT_WARPS;
    extern __shared__ __align__(16) unsigned char attention_shared[];
    bf16* q_s = reinterpret_cast<bf16*>(attention_shared);
    bf16* k_s = q_s + ROWS * LD;  // two buffers each
    bf16* v_s = k_s + 2 * COLS * LD;
    int bh = blockIdx.y, b = bh / NH, h = bh % NH, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int q0 = (gridDim.x - 1 - blockIdx.x) * ROWS, row0 = warp * 16 * SLABS;
    long stride = 3L * C;
    const bf16* q_g = qkv + (long)b * T * stride + h * HS;
    int tiles = (min(q0 + ROWS, T) - 1) / COLS + 1;  // key tiles up to the block's last query

    attention_async_rows<HS>(q_s, q_g, stride, q0, ROWS, T);
    attention_async_rows<HS>(k_s, q_g + C, stride, 0, COLS, T);
    attention_async_rows<HS>(v_s, q_g + 2 * C, stride, 0, COLS, T);
    cp_async_commit();

    // per slab, this lane's two rows (accumulator rows g and g+8): the running max and this lane's share of
    // the running sum (the quad's shares are added at the end)
    float o[SLABS][HS / 8][4] = {}, m[SLABS][2], l[SLABS][2] = {};
#pragma unroll
    for (int sl = 0; sl < SLABS; sl++) m[sl][0] = m[sl][1] = -INFINITY;
    for (int kt = 0; kt < tiles; kt++) {
        int buf = kt % 2, k0 = kt * COLS;
        attention_next_kv_tile<HS, COLS>(k_s, v_s, q_g, C, stride, kt, tiles, T);  // this tile has landed for every thread
        // a diagonal tile can lie wholly after this warp's queries (the block's last tile, for its first
        // warps): then the warp has nothing to add
        if (k0 <= q0 + row0 + 16 * SLABS - 1) {
            attention_forward_tile<HS, SLABS>(o, m, l, q_s, row0, k_s + buf * COLS * LD, v_s + buf * COLS * LD, q0,
                                              k0, k0 + COLS - 1 > q0, scale_log2);
        }
        __syncthreads();  // everyone is done with this buffer before the next iteration refills it
    }

    float inv[SLABS][2];
#pragma unroll
    for (int sl = 0; sl < SLABS; sl++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            float sum = l[sl][half];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            inv[sl][half] = 1.0f / sum;
            int query = q0 + row0 + 16 * sl + accumulator_coord(lane, 2 * half).row;
            // lse = ln Σ exp(score) = (m + log2 Σ)·ln 2, with m in base 2
            if (lane % 4 == 0 && query < T) lse[(long)bh * T + query] = (m[sl][half] + log2f(sum)) * 0.69314718f;
        }
    warp_store_rows<HS, SLABS>(out + (long)b * T * C + h * HS, C, o, q0 + row0, T, inv);
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

// dK and dV for a block of keys (grid (key blocks, B·NH); block 0 has the most query tiles and starts first):
// each warp holds 16 keys' dK and dV and walks the query tiles that can see them, in order.
template <int HS>
static __global__ void __launch_bounds__(32 * ATT_WARPS)
    attention_backward_dkdv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                   const float* delta, int T, int C, int NH, float scale, float scale_log2) {
    constexpr int LD = HS + ATT_PAD, COLS = attention_backward_cols(HS);
    extern __shared__ __align__(16) unsigned char attention_shared[];
    bf16* k_s = reinterpret_cast<bf16*>(attention_shared);
    bf16* v_s = k_s + ATT_ROWS * LD;
    bf16* q_s = v_s + ATT_ROWS * LD;  // two buffers each
    bf16* do_s = q_s + 2 * COLS * LD;
    float* lse_s = reinterpret_cast<float*>(do_s + 2 * COLS * LD);  // base-2, two buffers
    float* delta_s = lse_s + 2 * COLS;
    int bh = blockIdx.y, b = bh / NH, h = bh % NH, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int k0 = blockIdx.x * ATT_ROWS, row0 = warp * 16;
    long stride = 3L * C;
    const bf16* q_g = qkv + (long)b * T * stride + h * HS;
    const bf16* do_g = dout + (long)b * T * C + h * HS;
    int first = k0 / COLS, last = (T - 1) / COLS;  // query tiles holding a query at or after the first key

    // query tile qt's rows into buffer buf, asynchronously
    auto load_queries = [&](int qt, int buf) {
        attention_async_rows<HS>(q_s + buf * COLS * LD, q_g, stride, qt * COLS, COLS, T);
        attention_async_rows<HS>(do_s + buf * COLS * LD, do_g, C, qt * COLS, COLS, T);
    };
    // the base-2 lse and D of query qt·COLS + threadIdx.x (threads < COLS), fetched into registers a tile
    // ahead so their latency hides behind the current tile's products; queries past T get lse = +inf, which
    // makes their P, and with it their dS, exactly 0
    float next_lse = INFINITY, next_delta = 0.0f;
    auto fetch_stats = [&](int qt) {
        int query = qt * COLS + threadIdx.x;
        bool inside = threadIdx.x < COLS && query < T;
        next_lse = inside ? lse[(long)bh * T + query] * 1.44269504f : INFINITY;
        next_delta = inside ? delta[(long)bh * T + query] : 0.0f;
    };
    auto store_stats = [&](int buf) {
        if (threadIdx.x < COLS) {
            lse_s[buf * COLS + threadIdx.x] = next_lse;
            delta_s[buf * COLS + threadIdx.x] = next_delta;
        }
    };
    attention_async_rows<HS>(k_s, q_g + C, stride, k0, ATT_ROWS, T);
    attention_async_rows<HS>(v_s, q_g + 2 * C, stride, k0, ATT_ROWS, T);
    load_queries(first, 0);
    cp_async_commit();
    fetch_stats(first);
    store_stats(0);

    float dk[1][HS / 8][4] = {}, dv[1][HS / 8][4] = {};
    for (int qt = first; qt <= last; qt++) {
        int buf = (qt - first) % 2, q0 = qt * COLS;
        if (qt < last) {
            load_queries(qt + 1, buf ^ 1);
            cp_async_commit();
            fetch_stats(qt + 1);
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
        if (k0 + row0 <= q0 + COLS - 1) {
            float p[1][COLS / 8][4], ds[1][COLS / 8][4];  // rows: this warp's keys; columns: the tile's queries
            warp_abt<HS, COLS, 1>(p, k_s, row0, q_t);
            warp_abt<HS, COLS, 1>(ds, v_s, row0, do_t);
            bool diagonal = q0 < k0 + ATT_ROWS - 1;  // some query of the tile comes before some key of the block
#pragma unroll
            for (int j = 0; j < COLS / 8; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    FragmentCoord c = accumulator_coord(lane, i);
                    int key = k0 + row0 + c.row, col = 8 * j + c.col;
                    float x = exp2f(p[0][j][i] * scale_log2 - lse_t[col]);
                    p[0][j][i] = diagonal && key > q0 + col ? 0.0f : x;
                    ds[0][j][i] = p[0][j][i] * (ds[0][j][i] - delta_t[col]);
                }
            warp_pm<HS, COLS, 1>(dv, p, do_t);
            warp_pm<HS, COLS, 1>(dk, ds, q_t);
        }
        if (qt < last) store_stats(buf ^ 1);  // that buffer was last read in the previous iteration
        __syncthreads();
    }
    float dk_scale[1][2] = {{scale, scale}}, one[1][2] = {{1.0f, 1.0f}};
    bf16* dkey = dqkv + (long)b * T * stride + C + h * HS;
    warp_store_rows<HS, 1>(dkey, stride, dk, k0 + row0, T, dk_scale);
    warp_store_rows<HS, 1>(dkey + C, stride, dv, k0 + row0, T, one);
}

// dQ for a block of queries (grid as the forward's): each warp holds 16 queries' dQ and walks the key tiles
// they can see, in order, recomputing P and dS for them.
template <int HS>
static __global__ void __launch_bounds__(32 * ATT_WARPS)
    attention_backward_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta,
                                 int T, int C, int NH, float scale, float scale_log2) {
    constexpr int LD = HS + ATT_PAD, COLS = attention_backward_cols(HS);
    extern __shared__ __align__(16) unsigned char attention_shared[];
    bf16* q_s = reinterpret_cast<bf16*>(attention_shared);
    bf16* do_s = q_s + ATT_ROWS * LD;
    bf16* k_s = do_s + ATT_ROWS * LD;  // two buffers each
    bf16* v_s = k_s + 2 * COLS * LD;
    int bh = blockIdx.y, b = bh / NH, h = bh % NH, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int q0 = (gridDim.x - 1 - blockIdx.x) * ATT_ROWS, row0 = warp * 16;
    long stride = 3L * C;
    const bf16* q_g = qkv + (long)b * T * stride + h * HS;
    int tiles = (min(q0 + ATT_ROWS, T) - 1) / COLS + 1;

    attention_async_rows<HS>(q_s, q_g, stride, q0, ATT_ROWS, T);
    attention_async_rows<HS>(do_s, dout + (long)b * T * C + h * HS, C, q0, ATT_ROWS, T);
    attention_async_rows<HS>(k_s, q_g + C, stride, 0, COLS, T);
    attention_async_rows<HS>(v_s, q_g + 2 * C, stride, 0, COLS, T);
    cp_async_commit();

    float row_lse[2], row_delta[2];  // base-2 log-sum-exp and D of this lane's two rows (any finite value past T)
    for (int half = 0; half < 2; half++) {
        int query = q0 + row0 + accumulator_coord(lane, 2 * half).row;
        row_lse[half] = query < T ? lse[(long)bh * T + query] * 1.44269504f : 0.0f;
        row_delta[half] = query < T ? delta[(long)bh * T + query] : 0.0f;
    }

    float dq[1][HS / 8][4] = {};
    for (int kt = 0; kt < tiles; kt++) {
        int buf = kt % 2, k0 = kt * COLS;
        attention_next_kv_tile<HS, COLS>(k_s, v_s, q_g, C, stride, kt, tiles, T);
        const bf16* k_t = k_s + buf * COLS * LD;

        // a diagonal tile can lie wholly after this warp's queries (hs 128's narrow tiles, for the first warps)
        if (k0 <= q0 + row0 + 15) {
            float p[1][COLS / 8][4], ds[1][COLS / 8][4];  // rows: this warp's queries; columns: the tile's keys
            warp_abt<HS, COLS, 1>(p, q_s, row0, k_t);
            warp_abt<HS, COLS, 1>(ds, do_s, row0, v_s + buf * COLS * LD);
            bool diagonal = k0 + COLS - 1 > q0;
#pragma unroll
            for (int j = 0; j < COLS / 8; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    FragmentCoord c = accumulator_coord(lane, i);
                    int query = q0 + row0 + c.row, key = k0 + 8 * j + c.col;
                    float x = exp2f(p[0][j][i] * scale_log2 - row_lse[i / 2]);
                    p[0][j][i] = diagonal && key > query ? 0.0f : x;
                    ds[0][j][i] = p[0][j][i] * (ds[0][j][i] - row_delta[i / 2]);
                }
            warp_pm<HS, COLS, 1>(dq, ds, k_t);
        }
        __syncthreads();
    }
    float dq_scale[1][2] = {{scale, scale}};
    warp_store_rows<HS, 1>(dqkv + (long)b * T * stride + h * HS, stride, dq, q0 + row0, T, dq_scale);
}

// ----------------------------------------------------------------------------------------------------------
// entry points

// the head sizes compiled in; others are refused rather than silently slow
template <typename F>
inline void attention_dispatch(int C, int NH, F&& launch) {
    if (C % NH != 0) fail("attention: C=%d is not a multiple of NH=%d", C, NH);
    switch (C / NH) {
        case 64: launch(std::integral_constant<int, 64>{}); break;
        case 128: launch(std::integral_constant<int, 128>{}); break;
        default: fail("attention (CUDA): head size %d not supported (64 or 128)", C / NH);
    }
}

// launches a kernel with `bytes` of dynamic shared memory, raising its limit past the default 48 KiB on the
// first launch (the kernel is a template argument, so each kernel has its own flag)
template <auto kernel, typename... Args>
inline void attention_launch(dim3 grid, size_t bytes, cudaStream_t stream, Args... args) {
    static bool raised = false;
    if (!raised) {
        cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        raised = true;
    }
    kernel<<<grid, 32 * ATT_WARPS, bytes, stream>>>(args...);
    cuda_check(cudaGetLastError());
}

// the forward with SLABS m16 slabs per warp (blocks of 16·SLABS·ATT_WARPS queries)
template <int HS, int SLABS>
inline void attention_forward_launch(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH,
                                     cudaStream_t stream) {
    constexpr int ROWS = 16 * SLABS * ATT_WARPS;
    size_t bytes = (size_t)(ROWS + 4 * ATT_FWD_COLS) * (HS + ATT_PAD) * sizeof(bf16);
    float scale_log2 = 1.44269504f / sqrtf((float)HS);
    attention_launch<attention_forward_kernel<HS, SLABS>>(dim3(cuda_blocks(T, ROWS), B * NH), bytes, stream, out,
                                                          lse, qkv, T, C, NH, scale_log2);
}

// out (B, T, C) and lse (B, NH, T) from qkv (B, T, 3C), causal, head size C/NH in {64, 128}; any T >= 1
inline void attention_forward_cuda(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH,
                                   cudaStream_t stream) {
    attention_dispatch(C, NH, [&](auto hs) {
        attention_forward_launch<decltype(hs)::value, ATT_FWD_SLABS>(out, lse, qkv, B, T, C, NH, stream);
    });
}

// fp32 scratch of attention_backward_cuda: D = rowsum(dO∘O), one per (b, h, t)
inline size_t attention_backward_scratch_floats(int B, int T, int C, int NH) {
    (void)C;
    return (size_t)B * NH * T;
}

// dqkv (B, T, 3C) overwritten; out and lse are the forward's; deterministic (no atomics)
inline void attention_backward_cuda(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                                    float* scratch, int B, int T, int C, int NH, cudaStream_t stream) {
    float* delta = scratch;
    attention_dispatch(C, NH, [&](auto hs) {
        constexpr int HS = decltype(hs)::value, COLS = attention_backward_cols(HS);
        long rows = (long)B * NH * T;
        attention_delta_kernel<HS><<<cuda_blocks(rows * (HS / 8), 256), 256, 0, stream>>>(delta, dout, out, rows, T,
                                                                                          C, NH);
        cuda_check(cudaGetLastError());
        float scale = 1.0f / sqrtf((float)HS), scale_log2 = 1.44269504f * scale;
        dim3 grid(cuda_blocks(T, ATT_ROWS), B * NH);
        size_t tiles_bytes = (size_t)(2 * ATT_ROWS + 4 * COLS) * (HS + ATT_PAD) * sizeof(bf16);
        attention_launch<attention_backward_dkdv_kernel<HS>>(grid, tiles_bytes + 4 * COLS * sizeof(float), stream,
                                                             dqkv, dout, qkv, lse, delta, T, C, NH, scale, scale_log2);
        attention_launch<attention_backward_dq_kernel<HS>>(grid, tiles_bytes, stream, dqkv, dout, qkv, lse, delta, T, C,
                                                           NH, scale, scale_log2);
    });
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points. What forward keeps for backward differs by device: the CPU keeps the softmax
// probabilities (B, NH, T, T) in `att`, the GPU only each row's logsumexp (B, NH, T), from which the flash
// backward recomputes them tile by tile; the GPU backward also reads the forward's output `out`.

#include "llmc/device.cuh"

inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float*, const float* att, int B,
                               int T, int C, int NH, float* scratch) {
    attention_backward(dqkv, dout, qkv, att, B, T, C, NH, scratch);
}

inline void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH) {
    attention_forward_cuda(out, lse, qkv, B, T, C, NH, main_stream());
}
inline void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B,
                               int T, int C, int NH, float*) {
    float* scratch = gpu_scratch(attention_backward_scratch_floats(B, T, C, NH), "attention_backward");
    attention_backward_cuda(dqkv, dout, qkv, out, lse, scratch, B, T, C, NH, main_stream());
}
