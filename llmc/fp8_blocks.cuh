// The block-scaled FP8 recipes (--fp8-recipe blockwise|mxfp8): one scale per small tile of an operand instead of
// one per tensor, so that an outlier costs the precision of its own tile only. All three operands are E4M3 (the
// tiles give the gradients the range E5M2 gave them under one scale per tensor).
//   blockwise  DeepSeek-V3's recipe (NVIDIA's "subchannel" scaling, Hopper): activations and output gradients in
//              1×128 tiles along the GEMM's sum, weights in 128×128 blocks; fp32 scales (the format's max / the
//              tile's amax, as tensorwise computes its one). cuBLASLt 12.9 and later runs it on compute capability
//              9.0 (VEC128_32F and BLK128x128_32F scale modes).
//   mxfp8      the OCP microscaling format (Blackwell): 1×32 tiles for all three operands, each scale a power of
//              two stored as an E8M0 byte, the smallest that keeps the tile's amax within the format's max (so no
//              value saturates); cuBLASLt's VEC32_UE8M0 on compute capability 10.0 and later.
// A tile runs along the sum of the GEMM that reads it, and the sum is not the same dimension in a linear layer's
// three GEMMs: the forward sums over the input's channels, the input gradient over the output's, the weight
// gradient over the tokens. So an activation and an output gradient are cast twice, once in tiles along their
// rows and once in tiles down their columns (the transposed copy that the weight gradient reads), and an mxfp8
// weight twice (along its rows for the forward, down its columns for the input gradient). A 128×128 block serves
// both directions, which is why blockwise casts weights in blocks: the forward and the input gradient see the same
// values. The tokens of the weight gradient's sum are padded with zeros to a whole tile, which changes no amax.
//
// A linear layer runs in its recipe when its weight's two dimensions are multiples of the tile (128, 32); the
// others run in bf16 (the CPU's fp32), said once per shape. Each tile's scale comes from the tile alone, so no
// amax crosses ranks; a layout casts the single rank's tiles when its pieces are whole tiles, which gpt.cuh's
// fp8_recipe_problem checks for tp (the weights' pieces) and cp (the sequence's chunks).
//
// As for tensorwise (llmc/fp8.cuh), the CPU keeps each code as the value the GPU's GEMM makes of it (its value
// times its tile's inverse scale), and the GPU's cast kernels are tested against the CPU's casts bit for bit.
// On the GPU the codes are written K-major and the scales in the layout cuBLASLt documents for each mode (its
// "scaling factors layout"; TransformerEngine writes the same):
//   VEC128_32F    an operand of R rows (K-major, K = the sum) has a scale per row and 128-tile of K, stored tile
//                 of K by tile of K, the rows of one tile together: scales[(k / 128) · pad4(R) + r]. Not the order
//                 a row-by-row quantizer writes naturally (a row's tiles together); the wrong order runs, fast and
//                 wrong.
//   BLK128x128_32F  a scale per 128×128 block, the blocks of a row of blocks together, each such row padded to a
//                 multiple of 4: scales[(r / 128) · pad4(⌈K / 128⌉) + k / 128].
//   VEC32_UE8M0   a byte per row and 32-tile of K, in 128×4 tiles of 512 bytes (128 rows, 4 K-tiles), the tiles of a
//                 row of tiles together; inside one, row r and K-tile c sit at (r % 32)·16 + (r % 128)/32·4 + c % 4.
#pragma once

#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "llmc/device.cuh"

// (included by llmc/fp8.cuh after its software cast, fp8_round, which the CPU's tiles use)

enum class Fp8Recipe { Tensorwise, Blockwise, Mxfp8 };
inline const char* fp8_recipe_name(Fp8Recipe r) {
    return r == Fp8Recipe::Tensorwise ? "tensorwise" : r == Fp8Recipe::Blockwise ? "blockwise" : "mxfp8";
}
inline Fp8Recipe fp8_recipe_named(const std::string& name) {
    return name == "blockwise" ? Fp8Recipe::Blockwise : name == "mxfp8" ? Fp8Recipe::Mxfp8 : Fp8Recipe::Tensorwise;
}

// what a recipe casts to, in words (the run's log)
inline const char* fp8_recipe_terms(Fp8Recipe r) {
    return r == Fp8Recipe::Tensorwise ? "E4M3 (activations, weights) and E5M2 (gradients), a scale per tensor"
           : r == Fp8Recipe::Blockwise ? "E4M3, a scale per 1x128 tile of activations and gradients and per 128x128 "
                                         "block of weights (blockwise)"
                                       : "E4M3, a power-of-two scale per 32 values (mxfp8)";
}

// the tile's length along the sum (the block's side for blockwise weights)
constexpr int FP8_BLOCK = 128, FP8_MX_BLOCK = 32;
__host__ __device__ constexpr int fp8_tile(Fp8Recipe r) { return r == Fp8Recipe::Mxfp8 ? FP8_MX_BLOCK : FP8_BLOCK; }

// a weight of rows × cols runs in the recipe when both are whole tiles
inline bool fp8_recipe_takes(Fp8Recipe r, long rows, long cols) {
    return r == Fp8Recipe::Tensorwise || (rows % fp8_tile(r) == 0 && cols % fp8_tile(r) == 0);
}

constexpr float FP8_E4M3_MAX = 448.0f;

// A tile's scale (what multiplies x before the cast) and its inverse (what multiplies the code after) from the
// tile's amax. blockwise: the format's max / amax, as tensorwise's; 1 for a tile of zeros; at most FLT_MAX; NaN for
// a tile with a value that is not finite, so that the cast carries it on (the step is then skipped).
// mxfp8: 2^-k and 2^k for the smallest k with amax <= 448 · 2^k, k within E8M0's -127..127; amax = m·2^E with
// 0.5 <= m < 1 and 448 = 0.875·2^9 give k = E - 9 when m <= 0.875 and E - 8 above, in integers (no division to
// round). Its E8M0 byte is k + 127 (255: NaN).
__host__ __device__ inline int fp8_mx_exponent(float amax) {
    if (!(amax > 0.0f)) return 0;
    int E;
    float m = frexpf(amax, &E);
    int k = m <= 0.875f ? E - 9 : E - 8;
    return k < -127 ? -127 : k > 127 ? 127 : k;
}
__host__ __device__ inline void fp8_tile_scale(float* scale, float* inverse, float amax, Fp8Recipe r) {
    if (!isfinite(amax)) {
        *scale = *inverse = NAN;
    } else if (r == Fp8Recipe::Mxfp8) {
        int k = fp8_mx_exponent(amax);
        *scale = ldexpf(1.0f, -k), *inverse = ldexpf(1.0f, k);
    } else {
        *scale = amax > 0.0f ? fminf(FP8_E4M3_MAX / amax, FLT_MAX) : 1.0f;
        *inverse = 1.0f / *scale;
    }
}
__host__ __device__ inline uint8_t fp8_e8m0(float amax) { return isfinite(amax) ? fp8_mx_exponent(amax) + 127 : 0xFF; }

// ----------------------------------------------------------------------------------------------------------
// the CPU: x (rows×cols, row-major) cast in tiles of tile_rows × tile_cols (a partial tile at the edges), each
// with its own scale, into out (x's layout) as the values the GPU's GEMM makes of the codes

inline void fp8_quantize_tiles(float* out, const float* x, long rows, long cols, long tile_rows, long tile_cols,
                               Fp8Recipe r) {
    long down = (rows + tile_rows - 1) / tile_rows, across = (cols + tile_cols - 1) / tile_cols;
#pragma omp parallel for collapse(2)
    for (long ti = 0; ti < down; ti++)
        for (long tj = 0; tj < across; tj++) {
            long r0 = ti * tile_rows, r1 = std::min(rows, r0 + tile_rows);
            long c0 = tj * tile_cols, c1 = std::min(cols, c0 + tile_cols);
            float amax = 0.0f;
            bool finite = true;
            for (long i = r0; i < r1; i++)
                for (long j = c0; j < c1; j++) {
                    finite = finite && std::isfinite(x[i * cols + j]);
                    amax = std::max(amax, std::fabs(x[i * cols + j]));
                }
            float scale, inverse;
            fp8_tile_scale(&scale, &inverse, finite ? amax : NAN, r);
            for (long i = r0; i < r1; i++)
                for (long j = c0; j < c1; j++)
                    out[i * cols + j] = fp8_round(x[i * cols + j] * scale, Fp8Format::E4M3) * inverse;
        }
}

// ----------------------------------------------------------------------------------------------------------
// the scale tensors' layouts on the GPU (the top comment): the byte offset of the scale of row r, K-tile c of an
// operand of `rows` rows and `k` sums (ktiles = ⌈k / tile⌉), and the bytes a whole operand's scales take

inline long pad_to(long n, long m) { return (n + m - 1) / m * m; }

__host__ __device__ inline long fp8_scale_index(Fp8Recipe r, bool blocks, long row, long ktile, long rows, long ktiles) {
    if (r == Fp8Recipe::Mxfp8) {
        long tiles_across = (ktiles + 3) / 4;
        return ((row / 128) * tiles_across + ktile / 4) * 512 + (row % 32) * 16 + (row % 128) / 32 * 4 + ktile % 4;
    }
    if (blocks) return (row / FP8_BLOCK) * (((ktiles + 3) / 4) * 4) + ktile;  // row: the block row
    return ktile * (((rows + 3) / 4) * 4) + row;
}
inline size_t fp8_scale_bytes(Fp8Recipe r, bool blocks, long rows, long k) {
    long ktiles = (k + fp8_tile(r) - 1) / fp8_tile(r);
    if (r == Fp8Recipe::Mxfp8) return (size_t)pad_to(rows, 128) * pad_to(ktiles, 4);
    if (blocks) return sizeof(float) * (size_t)((rows + FP8_BLOCK - 1) / FP8_BLOCK) * pad_to(ktiles, 4);
    return sizeof(float) * (size_t)ktiles * pad_to(rows, 4);
}

// For the checks that read a GPU's casts back (test/, dev/cuda/fp8_blocks.cu): whether two values are the same
// bits (any NaN the same as any NaN), and the inverse scale a GEMM reads at index `at` of a scale tensor's bytes
// (mxfp8's E8M0 byte as its power of two, 0xFF a NaN; the others' fp32)
inline bool fp8_same_bits(float a, float b) {
    return memcmp(&a, &b, sizeof(float)) == 0 || (std::isnan(a) && std::isnan(b));
}
inline float fp8_stored_inverse(const std::vector<uint8_t>& scales, long at, Fp8Recipe r) {
    if (r == Fp8Recipe::Mxfp8) return scales[at] == 0xFF ? NAN : std::ldexp(1.0f, (int)scales[at] - 127);
    float inverse;
    memcpy(&inverse, scales.data() + at * sizeof(float), sizeof(float));
    return inverse;
}

// ----------------------------------------------------------------------------------------------------------
// the GPU's casts, each kernel beside the CPU's fp8_quantize_tiles, which it equals bit for bit: one scale per
// tile written as the top comment's layout says (an fp32 inverse scale, or mxfp8's E8M0 byte). The casts are
// memory-bound, and each kernel reads x in 16-byte vectors (8 values) where the row length and x's alignment allow
// (one value at a time elsewhere) and writes its codes in runs of 8 or 16 bytes; the copies written transposed
// go through shared memory, so that a warp's stores land on whole rows of the copy rather than one byte in each
// of 32 rows.

__device__ inline void fp8_store_scale(void* scales, long at, float amax, float inverse, Fp8Recipe r) {
    if (r == Fp8Recipe::Mxfp8) static_cast<uint8_t*>(scales)[at] = fp8_e8m0(amax);
    else static_cast<float*>(scales)[at] = inverse;
}

// value k of 8 bf16 held in a 16-byte vector (a bf16 is the top half of its float's bits)
__device__ inline float fp8_bf16_at(const uint4& raw, int k) {
    unsigned int w = k < 2 ? raw.x : k < 4 ? raw.y : k < 6 ? raw.z : raw.w;
    return __uint_as_float(k % 2 ? w & 0xFFFF0000u : w << 16);
}

// |v|'s bits: for non-negative floats the integer order is the float order, and a NaN's bits exceed infinity's, so
// the largest of them is the amax with a NaN winning (as fp8_amax_kernel's)
__device__ inline unsigned int fp8_abs_bits(float v) { return __float_as_uint(fabsf(v)); }

// four codes in one word, the first in the lowest byte (memory order)
__device__ inline unsigned int fp8_word(const uint8_t* q) {
    return q[0] | q[1] << 8 | q[2] << 16 | (unsigned int)q[3] << 24;
}

// x's values c .. c+7 of row `row` as bf16 bits (zeros past cols): one 16-byte load when `vectors` (cols a
// multiple of 8, x 16-byte aligned)
__device__ inline uint4 fp8_load8(const bf16* x, long row, long c, long cols, bool vectors) {
    if (vectors && c < cols) return *reinterpret_cast<const uint4*>(x + row * cols + c);
    unsigned short h[8];
#pragma unroll
    for (int k = 0; k < 8; k++) h[k] = c + k < cols ? __bfloat16_as_ushort(x[row * cols + c + k]) : 0;
    return make_uint4(h[0] | (unsigned int)h[1] << 16, h[2] | (unsigned int)h[3] << 16, h[4] | (unsigned int)h[5] << 16,
                      h[6] | (unsigned int)h[7] << 16);
}

constexpr int FP8_CAST_THREADS = 256;

// Tiles along the rows (1×L): L/8 consecutive threads per tile, 8 consecutive values each, the tile's amax taken
// over them by shuffles; a row's consecutive tiles to consecutive threads, so a warp reads 512 contiguous bytes.
// Codes into out (rows×cols, K = cols).
template <int L>
__global__ void __launch_bounds__(FP8_CAST_THREADS)
    fp8_quantize_rows_kernel(uint8_t* out, void* scales, const bf16* x, long rows, long cols, Fp8Recipe r) {
    constexpr int LANES = L / 8;
    long ktiles = (cols + L - 1) / L;
    long thread = (long)blockIdx.x * blockDim.x + threadIdx.x, tile = thread / LANES;
    int lane = (int)(thread % LANES);
    // every thread reaches the shuffles; those past the last tile carry zeros
    bool inside = tile < rows * ktiles;
    long row = inside ? tile / ktiles : 0, c0 = inside ? tile % ktiles * L : 0, c = c0 + lane * 8;
    bool vectors = cols % 8 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)out % 8 == 0;
    uint4 raw = fp8_load8(x, row, inside ? c : cols, cols, vectors);
    unsigned int m = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) m = max(m, fp8_abs_bits(fp8_bf16_at(raw, k)));
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffff, m, offset));
    if (!inside) return;
    float amax = __uint_as_float(m), scale, inverse;
    fp8_tile_scale(&scale, &inverse, amax, r);
    if (lane == 0) fp8_store_scale(scales, fp8_scale_index(r, false, row, c0 / L, rows, ktiles), amax, inverse, r);
    if (c >= cols) return;
    uint8_t q[8];
#pragma unroll
    for (int k = 0; k < 8; k++) q[k] = __nv_cvt_float_to_fp8(fp8_bf16_at(raw, k) * scale, __NV_SATFINITE, __NV_E4M3);
    if (vectors) {
        *reinterpret_cast<uint2*>(out + row * cols + c) = make_uint2(fp8_word(q), fp8_word(q + 4));
    } else {
        for (int k = 0; k < 8 && c + k < cols; k++) out[row * cols + c + k] = q[k];
    }
}

// A block's codes of x's rows r0.. and columns c0.. (codes[j][i]: x[r0 + i][c0 + j]'s, WIDTH columns of HEIGHT
// rows, each padded by 4 bytes) out to xᵀ (cols×ld_t) as 16-byte runs of its rows, or a byte at a time where ld_t
// or out_t is not aligned for them
template <int WIDTH, int HEIGHT>
__device__ void fp8_store_transposed(uint8_t* out_t, const uint8_t (*codes)[HEIGHT + 4], long r0, long c0, long cols,
                                     long ld_t) {
    constexpr int SEGMENTS = HEIGHT / 16;
    bool vectors = ld_t % 16 == 0 && (uintptr_t)out_t % 16 == 0;
    for (int g = threadIdx.x; g < WIDTH * SEGMENTS; g += blockDim.x) {
        int j = g / SEGMENTS, i = g % SEGMENTS * 16;
        long c = c0 + j, at = c * ld_t + r0 + i;
        if (c >= cols || r0 + i >= ld_t) continue;
        const unsigned int* w = reinterpret_cast<const unsigned int*>(&codes[j][i]);
        if (vectors) *reinterpret_cast<uint4*>(out_t + at) = make_uint4(w[0], w[1], w[2], w[3]);
        else
            for (int k = 0; k < 16 && r0 + i + k < ld_t; k++) out_t[at + k] = codes[j][i + k];
    }
}

// Tiles down the columns (L×1), written transposed: out_t (cols×ld_t) holds xᵀ, K = x's rows, zero from rows to
// ld_t. A block per L rows × 64 columns of x: the rows come into shared memory as 16-byte vectors (a warp reads 4
// rows of 128 bytes), 4 threads per column take its tile's amax and cast L/4 values each into a shared tile of
// codes transposed, which leaves as 16-byte runs of xᵀ's rows (a thread per column reading down it, and writing its
// row of xᵀ a byte at a time, touched 32 rows of xᵀ with each store).
constexpr int FP8_COLS_WIDTH = 64;
template <int L>
__global__ void __launch_bounds__(FP8_CAST_THREADS)
    fp8_quantize_cols_kernel(uint8_t* out_t, void* scales, const bf16* x, long rows, long cols, long ld_t, Fp8Recipe r) {
    constexpr int W = FP8_COLS_WIDTH, PARTS = FP8_CAST_THREADS / W, RUN = L / PARTS;
    __shared__ __align__(16) bf16 xs[L][W];
    // codes[j][i]: the code of x[r0 + i][c0 + j]; rows of L + 4 bytes put a warp's 32 columns in 32 banks
    __shared__ __align__(16) uint8_t codes[W][L + 4];
    __shared__ unsigned int part_max[PARTS][W];
    long ktiles = (ld_t + L - 1) / L, r0 = (long)blockIdx.y * L, c0 = (long)blockIdx.x * W;
    bool vectors = cols % 8 == 0 && (uintptr_t)x % 16 == 0;
    for (int g = threadIdx.x; g < L * W / 8; g += FP8_CAST_THREADS) {
        int i = g / (W / 8), j = g % (W / 8) * 8;
        *reinterpret_cast<uint4*>(&xs[i][j]) = r0 + i < rows ? fp8_load8(x, r0 + i, c0 + j, cols, vectors) : uint4{};
    }
    __syncthreads();
    int j = threadIdx.x % W, part = threadIdx.x / W;
    unsigned int m = 0;
    for (int s = 0; s < RUN; s++) m = max(m, fp8_abs_bits(__bfloat162float(xs[part * RUN + s][j])));
    part_max[part][j] = m;
    __syncthreads();
    for (int p = 0; p < PARTS; p++) m = max(m, part_max[p][j]);
    float amax = __uint_as_float(m), scale, inverse;
    fp8_tile_scale(&scale, &inverse, amax, r);
    for (int s = 0; s < RUN; s += 4) {
        uint8_t q[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int i = part * RUN + s + k;
            q[k] = r0 + i < rows ? __nv_cvt_float_to_fp8(__bfloat162float(xs[i][j]) * scale, __NV_SATFINITE, __NV_E4M3) : 0;
        }
        *reinterpret_cast<unsigned int*>(&codes[j][part * RUN + s]) = fp8_word(q);
    }
    if (part == 0 && c0 + j < cols)
        fp8_store_scale(scales, fp8_scale_index(r, false, c0 + j, blockIdx.y, cols, ktiles), amax, inverse, r);
    __syncthreads();
    fp8_store_transposed<W, L>(out_t, codes, r0, c0, cols, ld_t);
}

// blockwise weights: a block per 128×128 block of x, each thread holding 8 vectors of 8 values from the amax to the
// cast; the codes into out (rows×cols) and the transposed copy out_t (cols×rows), the latter through shared memory
// and out as 16-byte runs of its rows, with the scale in each one's BLK128x128 layout (either may be null)
__global__ void __launch_bounds__(FP8_CAST_THREADS)
    fp8_quantize_blocks_kernel(uint8_t* out, float* scales, uint8_t* out_t, float* scales_t, const bf16* x, long rows,
                               long cols) {
    constexpr int VECTORS = FP8_BLOCK * FP8_BLOCK / 8 / FP8_CAST_THREADS, WARPS = FP8_CAST_THREADS / 32;
    __shared__ unsigned int warp_max[WARPS];
    __shared__ __align__(16) uint8_t codes[FP8_BLOCK][FP8_BLOCK + 4];  // codes[j][i]: x[r0 + i][c0 + j]'s
    long r0 = (long)blockIdx.y * FP8_BLOCK, c0 = (long)blockIdx.x * FP8_BLOCK;
    bool vectors = cols % 8 == 0 && (uintptr_t)x % 16 == 0 && (!out || (uintptr_t)out % 8 == 0);
    uint4 raw[VECTORS];
    unsigned int m = 0;
#pragma unroll
    for (int s = 0; s < VECTORS; s++) {
        int g = threadIdx.x + s * FP8_CAST_THREADS, i = g / (FP8_BLOCK / 8), j = g % (FP8_BLOCK / 8) * 8;
        raw[s] = r0 + i < rows ? fp8_load8(x, r0 + i, c0 + j, cols, vectors) : uint4{};
#pragma unroll
        for (int k = 0; k < 8; k++) m = max(m, fp8_abs_bits(fp8_bf16_at(raw[s], k)));
    }
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffff, m, offset));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0;
    for (int w = 0; w < WARPS; w++) m = max(m, warp_max[w]);
    float amax = __uint_as_float(m), scale, inverse;
    fp8_tile_scale(&scale, &inverse, amax, Fp8Recipe::Blockwise);
#pragma unroll
    for (int s = 0; s < VECTORS; s++) {
        int g = threadIdx.x + s * FP8_CAST_THREADS, i = g / (FP8_BLOCK / 8), j = g % (FP8_BLOCK / 8) * 8;
        long r = r0 + i, c = c0 + j;
        uint8_t q[8];
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = __nv_cvt_float_to_fp8(fp8_bf16_at(raw[s], k) * scale, __NV_SATFINITE, __NV_E4M3);
        if (out && r < rows && c < cols) {
            if (vectors) *reinterpret_cast<uint2*>(out + r * cols + c) = make_uint2(fp8_word(q), fp8_word(q + 4));
            else
                for (int k = 0; k < 8 && c + k < cols; k++) out[r * cols + c + k] = q[k];
        }
        if (out_t)
#pragma unroll
            for (int k = 0; k < 8; k++) codes[j + k][i] = q[k];
    }
    if (threadIdx.x == 0) {
        long block_rows = (rows + FP8_BLOCK - 1) / FP8_BLOCK, block_cols = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
        if (scales) scales[fp8_scale_index(Fp8Recipe::Blockwise, true, r0, blockIdx.x, rows, block_cols)] = inverse;
        if (scales_t) scales_t[fp8_scale_index(Fp8Recipe::Blockwise, true, c0, blockIdx.y, cols, block_rows)] = inverse;
    }
    if (!out_t) return;
    __syncthreads();
    fp8_store_transposed<FP8_BLOCK, FP8_BLOCK>(out_t, codes, r0, c0, cols, rows);
}

// cuBLASLt reads mxfp8's scales in whole tiles of 128 rows × 4 K-tiles and asks that the bytes past the operand's
// rows and K-tiles be zero (its "1D block scaling factors layout"); the kernels write the operand's own scales, so
// where the tiles have such bytes the whole tensor is cleared first
inline void fp8_clear_scale_padding(void* scales, Fp8Recipe r, long rows, long k) {
    long ktiles = (k + fp8_tile(r) - 1) / fp8_tile(r);
    if (r == Fp8Recipe::Mxfp8 && (rows % 128 || ktiles % 4))
        cuda_check(cudaMemsetAsync(scales, 0, fp8_scale_bytes(r, false, rows, k), main_stream()));
}

inline void fp8_quantize_rows(uint8_t* out, void* scales, const bf16* x, long rows, long cols, Fp8Recipe r) {
    long threads = rows * ((cols + fp8_tile(r) - 1) / fp8_tile(r)) * (fp8_tile(r) / 8);
    if (threads == 0) return;
    fp8_clear_scale_padding(scales, r, rows, cols);
    unsigned blocks = (unsigned)((threads + FP8_CAST_THREADS - 1) / FP8_CAST_THREADS);
    if (r == Fp8Recipe::Mxfp8)
        fp8_quantize_rows_kernel<FP8_MX_BLOCK><<<blocks, FP8_CAST_THREADS, 0, main_stream()>>>(out, scales, x, rows, cols, r);
    else fp8_quantize_rows_kernel<FP8_BLOCK><<<blocks, FP8_CAST_THREADS, 0, main_stream()>>>(out, scales, x, rows, cols, r);
    cuda_check(cudaGetLastError());
}
inline void fp8_quantize_cols(uint8_t* out_t, void* scales, const bf16* x, long rows, long cols, long ld_t, Fp8Recipe r) {
    if (cols == 0 || ld_t == 0) return;
    fp8_clear_scale_padding(scales, r, cols, ld_t);
    dim3 grid((unsigned)((cols + FP8_COLS_WIDTH - 1) / FP8_COLS_WIDTH), (unsigned)((ld_t + fp8_tile(r) - 1) / fp8_tile(r)));
    if (r == Fp8Recipe::Mxfp8)
        fp8_quantize_cols_kernel<FP8_MX_BLOCK><<<grid, FP8_CAST_THREADS, 0, main_stream()>>>(out_t, scales, x, rows, cols,
                                                                                             ld_t, r);
    else
        fp8_quantize_cols_kernel<FP8_BLOCK><<<grid, FP8_CAST_THREADS, 0, main_stream()>>>(out_t, scales, x, rows, cols, ld_t,
                                                                                          r);
    cuda_check(cudaGetLastError());
}
inline void fp8_quantize_blocks(uint8_t* out, float* scales, uint8_t* out_t, float* scales_t, const bf16* x, long rows,
                                long cols) {
    if (rows == 0 || cols == 0) return;
    dim3 grid((unsigned)((cols + FP8_BLOCK - 1) / FP8_BLOCK), (unsigned)((rows + FP8_BLOCK - 1) / FP8_BLOCK));
    fp8_quantize_blocks_kernel<<<grid, FP8_CAST_THREADS, 0, main_stream()>>>(out, scales, out_t, scales_t, x, rows, cols);
    cuda_check(cudaGetLastError());
}

// The recipe's cast of x (rows×cols) for a GEMM that sums along its rows (1×L tiles) or `down` its columns (L×1,
// the GPU's copy transposed into cols×ld_t); `blocks`: blockwise's 128×128 blocks either way. The CPU writes values
// in x's layout; the GPU codes, and the tiles' scales into `tiles`.
inline void fp8_quantize_tiled(float* out, void*, const float* x, long rows, long cols, long, bool down, bool blocks,
                               Fp8Recipe r) {
    long L = fp8_tile(r);
    fp8_quantize_tiles(out, x, rows, cols, blocks || down ? L : 1, blocks || !down ? L : 1, r);
}
inline void fp8_quantize_tiled(uint8_t* out, void* tiles, const bf16* x, long rows, long cols, long ld_t, bool down,
                               bool blocks, Fp8Recipe r) {
    float* block_scales = static_cast<float*>(tiles);
    if (blocks && down) fp8_quantize_blocks(nullptr, nullptr, out, block_scales, x, rows, cols);
    else if (blocks) fp8_quantize_blocks(out, block_scales, nullptr, nullptr, x, rows, cols);
    else if (down) fp8_quantize_cols(out, tiles, x, rows, cols, ld_t, r);
    else fp8_quantize_rows(out, tiles, x, rows, cols, r);
}
