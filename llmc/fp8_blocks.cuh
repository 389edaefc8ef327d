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

// ----------------------------------------------------------------------------------------------------------
// the GPU's casts, each kernel beside the CPU's fp8_quantize_tiles, which it equals bit for bit: one scale per
// tile written as the top comment's layout says (an fp32 inverse scale, or mxfp8's E8M0 byte)

__device__ inline void fp8_store_scale(void* scales, long at, float amax, float inverse, Fp8Recipe r) {
    if (r == Fp8Recipe::Mxfp8) static_cast<uint8_t*>(scales)[at] = fp8_e8m0(amax);
    else static_cast<float*>(scales)[at] = inverse;
}

// the largest |value| of a warp's values, a NaN winning (as fp8_amax_kernel: the bits' order is the order of
// non-negative floats, and a NaN's bits exceed infinity's)
__device__ inline float fp8_warp_amax(float v) {
    unsigned int m = __float_as_uint(fabsf(v));
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffff, m, offset));
    return __uint_as_float(m);
}

// Tiles along the rows (1×L): a warp per tile, each lane a strided L/32 of its values (consecutive lanes read
// consecutive values). Codes into out (rows×cols, K = cols).
template <int L>
__global__ void fp8_quantize_rows_kernel(uint8_t* out, void* scales, const bf16* x, long rows, long cols, Fp8Recipe r) {
    long ktiles = (cols + L - 1) / L;
    long tile = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (tile >= rows * ktiles) return;  // whole warps leave together: a tile is a warp's
    long row = tile / ktiles, c0 = (tile % ktiles) * L;
    constexpr int PER = L / 32;
    float v[PER];
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        long c = c0 + lane + 32 * i;
        v[i] = c < cols ? __bfloat162float(x[row * cols + c]) : 0.0f;
        m = __uint_as_float(max(__float_as_uint(m), __float_as_uint(fabsf(v[i]))));
    }
    float amax = fp8_warp_amax(m);
    float scale, inverse;
    fp8_tile_scale(&scale, &inverse, amax, r);
#pragma unroll
    for (int i = 0; i < PER; i++) {
        long c = c0 + lane + 32 * i;
        if (c < cols) out[row * cols + c] = __nv_cvt_float_to_fp8(v[i] * scale, __NV_SATFINITE, __NV_E4M3);
    }
    if (lane == 0) fp8_store_scale(scales, fp8_scale_index(r, false, row, c0 / L, rows, ktiles), amax, inverse, r);
}

// Tiles down the columns (L×1), written transposed: out_t (cols×ld_t) holds xᵀ, K = x's rows, zero from rows to
// ld_t. A thread per tile: consecutive threads take consecutive columns, so each of the L reads is coalesced.
template <int L>
__global__ void fp8_quantize_cols_kernel(uint8_t* out_t, void* scales, const bf16* x, long rows, long cols, long ld_t,
                                         Fp8Recipe r) {
    long ktiles = (ld_t + L - 1) / L;
    long c = (long)blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= cols || t >= ktiles) return;
    long r0 = t * L, end = r0 + L < rows ? r0 + L : rows, end_t = r0 + L < ld_t ? r0 + L : ld_t;
    unsigned int m = 0;
    for (long i = r0; i < end; i++) m = max(m, __float_as_uint(fabsf(__bfloat162float(x[i * cols + c]))));
    float amax = __uint_as_float(m), scale, inverse;
    fp8_tile_scale(&scale, &inverse, amax, r);
    for (long i = r0; i < end_t; i++)
        out_t[c * ld_t + i] =
            i < rows ? __nv_cvt_float_to_fp8(__bfloat162float(x[i * cols + c]) * scale, __NV_SATFINITE, __NV_E4M3) : 0;
    fp8_store_scale(scales, fp8_scale_index(r, false, c, t, cols, ktiles), amax, inverse, r);
}

// blockwise weights: a block of 256 threads per 128×128 block; its amax, then the codes into out (rows×cols) and
// the transposed copy out_t (cols×rows), with the scale in each one's BLK128x128 layout (either may be null)
__global__ void fp8_quantize_blocks_kernel(uint8_t* out, float* scales, uint8_t* out_t, float* scales_t, const bf16* x,
                                           long rows, long cols) {
    __shared__ unsigned int warp_max[8];
    long r0 = (long)blockIdx.y * FP8_BLOCK, c0 = (long)blockIdx.x * FP8_BLOCK;
    unsigned int m = 0;
    for (int e = threadIdx.x; e < FP8_BLOCK * FP8_BLOCK; e += blockDim.x) {
        long i = r0 + e / FP8_BLOCK, j = c0 + e % FP8_BLOCK;
        if (i < rows && j < cols) m = max(m, __float_as_uint(fabsf(__bfloat162float(x[i * cols + j]))));
    }
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffff, m, offset));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0;
    for (int w = 0; w < 8; w++) m = max(m, warp_max[w]);
    float amax = __uint_as_float(m), scale, inverse;
    fp8_tile_scale(&scale, &inverse, amax, Fp8Recipe::Blockwise);
    for (int e = threadIdx.x; e < FP8_BLOCK * FP8_BLOCK; e += blockDim.x) {
        long i = r0 + e / FP8_BLOCK, j = c0 + e % FP8_BLOCK;
        if (i >= rows || j >= cols) continue;
        uint8_t q = __nv_cvt_float_to_fp8(__bfloat162float(x[i * cols + j]) * scale, __NV_SATFINITE, __NV_E4M3);
        if (out) out[i * cols + j] = q;
        if (out_t) out_t[j * rows + i] = q;
    }
    if (threadIdx.x != 0) return;
    long block_rows = (rows + FP8_BLOCK - 1) / FP8_BLOCK, block_cols = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
    if (scales) scales[fp8_scale_index(Fp8Recipe::Blockwise, true, r0, blockIdx.x, rows, block_cols)] = inverse;
    if (scales_t) scales_t[fp8_scale_index(Fp8Recipe::Blockwise, true, c0, blockIdx.y, cols, block_rows)] = inverse;
}

inline void fp8_quantize_rows(uint8_t* out, void* scales, const bf16* x, long rows, long cols, Fp8Recipe r) {
    long warps = rows * ((cols + fp8_tile(r) - 1) / fp8_tile(r));
    if (warps == 0) return;
    unsigned blocks = (unsigned)((warps * 32 + 255) / 256);
    if (r == Fp8Recipe::Mxfp8)
        fp8_quantize_rows_kernel<FP8_MX_BLOCK><<<blocks, 256, 0, main_stream()>>>(out, scales, x, rows, cols, r);
    else fp8_quantize_rows_kernel<FP8_BLOCK><<<blocks, 256, 0, main_stream()>>>(out, scales, x, rows, cols, r);
    cuda_check(cudaGetLastError());
}
inline void fp8_quantize_cols(uint8_t* out_t, void* scales, const bf16* x, long rows, long cols, long ld_t, Fp8Recipe r) {
    if (cols == 0 || ld_t == 0) return;
    dim3 grid((unsigned)((cols + 127) / 128), (unsigned)((ld_t + fp8_tile(r) - 1) / fp8_tile(r)));
    if (r == Fp8Recipe::Mxfp8)
        fp8_quantize_cols_kernel<FP8_MX_BLOCK><<<grid, 128, 0, main_stream()>>>(out_t, scales, x, rows, cols, ld_t, r);
    else fp8_quantize_cols_kernel<FP8_BLOCK><<<grid, 128, 0, main_stream()>>>(out_t, scales, x, rows, cols, ld_t, r);
    cuda_check(cudaGetLastError());
}
inline void fp8_quantize_blocks(uint8_t* out, float* scales, uint8_t* out_t, float* scales_t, const bf16* x, long rows,
                                long cols) {
    if (rows == 0 || cols == 0) return;
    dim3 grid((unsigned)((cols + FP8_BLOCK - 1) / FP8_BLOCK), (unsigned)((rows + FP8_BLOCK - 1) / FP8_BLOCK));
    fp8_quantize_blocks_kernel<<<grid, 256, 0, main_stream()>>>(out, scales, out_t, scales_t, x, rows, cols);
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
