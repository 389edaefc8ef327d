// FP8 matmuls (--fp8 1), the Hopper recipe of the Ultra-Scale Playbook and Transformer Engine's current
// scaling: a linear layer's three GEMMs take 8-bit operands and accumulate in fp32. Activations and weights are
// E4M3 (3 mantissa bits, up to 448), output gradients E5M2 (2 mantissa bits, up to 57344: gradients need range
// more than precision). Each operand gets one scale per tensor, from the tensor in hand (current scaling, not
// the previous steps' history): scale = the format's largest value / the tensor's absolute maximum, so the
// largest element lands on the format's largest value. The cast saturates and rounds to nearest even; the GEMM
// multiplies the 8-bit values and undoes both scales in its epilogue (D = a⁻¹·b⁻¹·A·B + bias).
//
// What stays bf16 (the model decides, llmc/gpt.cuh): the embeddings, the classifier, attention itself, the
// bias gradients (column sums of the unquantized output gradient), and the first and last transformer layers,
// the ones most sensitive to the lost precision. Master weights and optimizer state do not change.
//
// The same casts on both devices. On the CPU a cast value is kept as its code's value times the inverse scale,
// and the fp32 GEMM of matmul.cuh multiplies those: the GPU's operands, unscaled before the products rather
// than after the sum (the same to fp32 rounding). The emulation is how the recipe's numerics are tested
// without a GPU, and the software cast below is the reference the GPU's cast kernels are tested against, bit
// for bit. On the GPU the operands are codes, cast by the kernels below and
// multiplied by cuBLASLt, whose FP8 kernels want both operands K-major: the cast kernels write the transposed
// copies the backward GEMMs need (Wᵀ for the input gradient; the output gradient's and the input's transposes,
// their rows zero-padded to a multiple of 16, for the weight gradient) instead of separate transposing passes.
//
// A tensor split over ranks must be cast with the scale of the whole: each rank's amax is gathered over the
// group that holds the tensor's pieces (tp × cp for the dense layers: Megatron-LM's amax reduction group) and
// the largest taken, so a layout casts exactly what one rank would.
#pragma once

#include <cuda_fp8.h>

#include <cfloat>
#include <cmath>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "llmc/comm.cuh"
#include "llmc/device.cuh"
#include "llmc/gelu.cuh"
#include "llmc/matmul.cuh"

enum class Fp8Format { E4M3, E5M2 };

// a format's mantissa bits, exponent bias and largest finite value
struct Fp8Grid {
    int mantissa, bias;
    float max;
};
__host__ __device__ constexpr Fp8Grid fp8_grid(Fp8Format f) {
    return f == Fp8Format::E4M3 ? Fp8Grid{3, 7, 448.0f} : Fp8Grid{2, 15, 57344.0f};
}
inline const char* fp8_name(Fp8Format f) { return f == Fp8Format::E4M3 ? "E4M3" : "E5M2"; }

// ----------------------------------------------------------------------------------------------------------
// the software cast: float -> code (saturating, round to nearest even, NaN stays NaN) and code -> float

inline uint8_t fp8_encode(float x, Fp8Format f) {
    Fp8Grid g = fp8_grid(f);
    uint8_t sign = std::signbit(x) ? 0x80 : 0;
    if (std::isnan(x)) return sign | (f == Fp8Format::E4M3 ? 0x7F : 0x7E);  // E4M3's one NaN; E5M2's quiet NaN
    float a = std::fabs(x);
    int emin = 1 - g.bias;  // the smallest normal exponent; below it the spacing stays that of 2^emin
    int e;
    std::frexp(a, &e);  // a = m·2^e with 0.5 <= m < 1
    e = std::max(e - 1, emin);
    float spacing = std::ldexp(1.0f, e - g.mantissa);
    // rintf rounds ties to even; dividing and multiplying by a power of two are exact
    float r = std::isinf(a) ? INFINITY : std::rint(a / spacing) * spacing;
    r = std::min(r, g.max);  // saturate (a tie rounding up past max lands on max too)
    if (r == 0.0f) return sign;
    std::frexp(r, &e);  // the rounding may have carried into the next binade
    e -= 1;
    if (e < emin) return sign | (uint8_t)(r / std::ldexp(1.0f, emin - g.mantissa));  // subnormal: exponent field 0
    int mantissa = (int)(r / std::ldexp(1.0f, e - g.mantissa)) - (1 << g.mantissa);
    return sign | (uint8_t)(((e + g.bias) << g.mantissa) | mantissa);
}

inline float fp8_decode(uint8_t code, Fp8Format f) {
    Fp8Grid g = fp8_grid(f);
    int exponent = (code & 0x7F) >> g.mantissa, mantissa = code & ((1 << g.mantissa) - 1);
    bool negative = code & 0x80;
    if (f == Fp8Format::E4M3 && exponent == 15 && mantissa == 7) return NAN;
    if (f == Fp8Format::E5M2 && exponent == 31) return mantissa ? NAN : negative ? -INFINITY : INFINITY;
    float v = exponent == 0 ? std::ldexp((float)mantissa, 1 - g.bias - g.mantissa)
                            : std::ldexp((float)((1 << g.mantissa) + mantissa), exponent - g.bias - g.mantissa);
    return negative ? -v : v;
}

// x rounded to the format's grid (what the GEMM sees of it, before unscaling)
inline float fp8_round(float x, Fp8Format f) { return fp8_decode(fp8_encode(x, f), f); }

// the block-scaled recipes' casts, which round with fp8_round (the rest of this file dispatches to them)
#include "llmc/fp8_blocks.cuh"

// The scale of a tensor whose pieces' amaxes are given, and its inverse: the format's max over the amax; 1 for
// a tensor of zeros; at most FLT_MAX for a tiny one; NaN when an element is not finite, so that the cast carries
// it on (the step is then skipped, as any other non-finite step) rather than saturating it away
__host__ __device__ inline void fp8_scale_pair(float* pair, const float* amaxes, int pieces, Fp8Format f) {
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < pieces; i++) {
        finite = finite && isfinite(amaxes[i]);
        amax = fmaxf(amax, amaxes[i]);
    }
    float scale = !finite ? NAN : amax > 0.0f ? fminf(fp8_grid(f).max / amax, FLT_MAX) : 1.0f;
    pair[0] = scale;
    pair[1] = 1.0f / scale;
}

// ----------------------------------------------------------------------------------------------------------
// the casts, per device: the amax of x into *amax, then (once the group's amaxes are in and the scale pair
// made) x·scale cast into out (rows×cols) and, on the GPU, its transpose into out_t (cols×ld_t, zero past rows)

inline void fp8_amax(float* amax, const float* x, long n) {
    float m = 0.0f;
    int bad = 0;
#pragma omp parallel for reduction(max : m) reduction(| : bad)
    for (long i = 0; i < n; i++) {
        bad |= !std::isfinite(x[i]);
        m = std::max(m, std::fabs(x[i]));
    }
    *amax = bad ? NAN : m;
}

// the CPU keeps what the GPU's GEMM makes of a code: its value times the inverse scale
inline void fp8_quantize(float* out, float*, const float* x, long rows, long cols, long, const float* pair, Fp8Format f) {
    float scale = pair[0], inverse = pair[1];
#pragma omp parallel for
    for (long i = 0; i < rows * cols; i++) out[i] = fp8_round(x[i] * scale, f) * inverse;
}

inline void fp8_make_scale(float* pair, const float* amaxes, int pieces, Fp8Format f, const float*) {
    fp8_scale_pair(pair, amaxes, pieces, f);
}

__device__ inline uint8_t fp8_cast_device(float v, Fp8Format f) {
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2);
}

// The casts are memory-bound: each kernel reads x in 16-byte vectors (8 values) wherever x's alignment and
// the row length allow, one value at a time elsewhere. Scalar loads of 2 bytes ran at about a third of the
// H100's bandwidth (2026-11-27: the amax and the cast took 62 ms of a 236 ms llama3-1b step at B=16).
constexpr int FP8_VECTOR = 8;

// the largest |x| as its bits: for non-negative floats the integer order is the float order, and a NaN's bits
// exceed infinity's, so a NaN wins and the scale turns NaN (fmaxf would drop it: NaNs are counted apart)
static __global__ void fp8_amax_kernel(float* amax, const bf16* x, long n) {
    unsigned int m = 0;
    long start = (long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
    long vectors = (uintptr_t)x % 16 == 0 ? n / FP8_VECTOR : 0;
    for (long v = start; v < vectors; v += stride) {
        uint4 raw = reinterpret_cast<const uint4*>(x)[v];
        const bf16* e = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
        for (int k = 0; k < FP8_VECTOR; k++) m = max(m, __float_as_uint(fabsf(__bfloat162float(e[k]))));
    }
    for (long i = vectors * FP8_VECTOR + start; i < n; i += stride)
        m = max(m, __float_as_uint(fabsf(__bfloat162float(x[i]))));
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffff, m, offset));
    if (threadIdx.x % 32 == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), m);
}

inline void fp8_amax(float* amax, const bf16* x, long n) {
    cuda_check(cudaMemsetAsync(amax, 0, sizeof(float), main_stream()));
    if (n == 0) return;
    fp8_amax_kernel<<<std::min(grid_stride_blocks(std::max(n / FP8_VECTOR, 1L)), 1024u), 256, 0, main_stream()>>>(amax, x,
                                                                                                              n);
    cuda_check(cudaGetLastError());
}

static __global__ void fp8_scale_kernel(float* pair, const float* amaxes, int pieces, Fp8Format f) {
    fp8_scale_pair(pair, amaxes, pieces, f);
}
inline void fp8_make_scale(float* pair, const float* amaxes, int pieces, Fp8Format f, const bf16*) {
    fp8_scale_kernel<<<1, 1, 0, main_stream()>>>(pair, amaxes, pieces, f);
    cuda_check(cudaGetLastError());
}

// A 64×64 tile per block of 256 threads: each element scaled and cast once, written in place and, through
// shared memory, to the transposed copy, so both copies cost one read of x. A thread takes 8 consecutive values
// of a row (one 16-byte load, one 8-byte store), then 8 consecutive rows of a column of the tile for the
// transposed copy (one 8-byte store). Rows from `rows` to ld_t are the transposed copy's zero padding.
constexpr int FP8_TILE = 64;
constexpr int FP8_TILE_THREADS = 256;

__device__ inline uint2 fp8_pack8(const uint8_t (&q)[FP8_VECTOR]) {
    return make_uint2(q[0] | q[1] << 8 | q[2] << 16 | (unsigned)q[3] << 24,
                      q[4] | q[5] << 8 | q[6] << 16 | (unsigned)q[7] << 24);
}

static __global__ void __launch_bounds__(FP8_TILE_THREADS)
    fp8_quantize_kernel(uint8_t* out, uint8_t* out_t, const bf16* x, long rows, long cols, long ld_t,
                        const float* pair, Fp8Format f) {
    // rows of 72 bytes: 8-byte aligned for the packed stores
    __shared__ __align__(16) uint8_t tile[FP8_TILE][FP8_TILE + FP8_VECTOR];
    constexpr int GROUPS = FP8_TILE * FP8_TILE / FP8_VECTOR;  // 8-value pieces of the tile
    float scale = pair[0];
    long r0 = (long)blockIdx.y * FP8_TILE, c0 = (long)blockIdx.x * FP8_TILE;
    // whole vectors: every row starts on one (cols a multiple of 8) and the buffers are aligned to them
    bool vectors = cols % FP8_VECTOR == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)out % 8 == 0;
    for (int g = threadIdx.x; g < GROUPS; g += FP8_TILE_THREADS) {
        int i = g / (FP8_TILE / FP8_VECTOR), j = g % (FP8_TILE / FP8_VECTOR) * FP8_VECTOR;
        long r = r0 + i, c = c0 + j;
        uint8_t q[FP8_VECTOR];
        if (vectors && r < rows && c < cols) {
            uint4 raw = *reinterpret_cast<const uint4*>(x + r * cols + c);
            const bf16* v = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
            for (int k = 0; k < FP8_VECTOR; k++) q[k] = fp8_cast_device(__bfloat162float(v[k]) * scale, f);
            if (out) *reinterpret_cast<uint2*>(out + r * cols + c) = fp8_pack8(q);
        } else {
#pragma unroll
            for (int k = 0; k < FP8_VECTOR; k++) {
                bool inside = r < rows && c + k < cols;
                q[k] = inside ? fp8_cast_device(__bfloat162float(x[r * cols + c + k]) * scale, f) : 0;
                if (inside && out) out[r * cols + c + k] = q[k];
            }
        }
        *reinterpret_cast<uint2*>(&tile[i][j]) = fp8_pack8(q);
    }
    if (!out_t) return;
    __syncthreads();
    bool vectors_t = ld_t % FP8_VECTOR == 0 && (uintptr_t)out_t % 8 == 0;
    for (int g = threadIdx.x; g < GROUPS; g += FP8_TILE_THREADS) {
        int j = g / (FP8_TILE / FP8_VECTOR), i = g % (FP8_TILE / FP8_VECTOR) * FP8_VECTOR;
        long c = c0 + j, r = r0 + i;
        if (c >= cols || r >= ld_t) continue;
        uint8_t q[FP8_VECTOR];
#pragma unroll
        for (int k = 0; k < FP8_VECTOR; k++) q[k] = tile[i + k][j];
        if (vectors_t) {
            *reinterpret_cast<uint2*>(out_t + c * ld_t + r) = fp8_pack8(q);
        } else {
#pragma unroll
            for (int k = 0; k < FP8_VECTOR; k++)
                if (r + k < ld_t) out_t[c * ld_t + r + k] = q[k];
        }
    }
}

inline void fp8_quantize(uint8_t* out, uint8_t* out_t, const bf16* x, long rows, long cols, long ld_t, const float* pair,
                         Fp8Format f) {
    long tile_rows = std::max(rows, out_t ? ld_t : 0L);
    if (tile_rows == 0 || cols == 0) return;
    dim3 grid((unsigned)((cols + FP8_TILE - 1) / FP8_TILE), (unsigned)((tile_rows + FP8_TILE - 1) / FP8_TILE));
    fp8_quantize_kernel<<<grid, FP8_TILE_THREADS, 0, main_stream()>>>(out, out_t, x, rows, cols, ld_t, pair, f);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// a model's FP8 state: where the cast operands go, their scales, and the group whose amaxes they share

// the transposed copies' rows (the weight gradient's K) padded for cuBLASLt's FP8 kernels
inline long fp8_padded(long rows) { return (rows + 15) / 16 * 16; }

enum Fp8Operand { FP8_INPUT = 0, FP8_WEIGHT = 1, FP8_GRAD = 2, FP8_GRAD_T = 3 };

// Each operand's scale and inverse sit 8 floats apart, the inverse on a 16-byte boundary: the inverses are what
// cuBLASLt's A and B scale pointers read, its documentation states no alignment for them, and so they get the
// 16 bytes FP8 GEMMs ask of every other pointer (TransformerEngine's and PyTorch's are allocations of their own)
constexpr int FP8_SCALE_STRIDE = 8, FP8_SCALE_FLOATS = 3 * FP8_SCALE_STRIDE;

// cuBLASLt's scale modes (cublasLtMatmulMatrixScale_t) by value: one fp32 per tensor, E8M0 per 32, fp32 per 128 and
// per 128×128
enum Fp8ScaleMode { FP8_SCALE_TENSOR = 0, FP8_SCALE_VEC32_E8M0 = 2, FP8_SCALE_VEC128 = 4, FP8_SCALE_BLK128 = 5 };

// A weight cast ahead of its layer (Fp8ReadyWeight below) into the operand buffer `out` for the forward or, `down`,
// the input gradient, with its scales where the GEMM reads them (tensorwise: the operand's pair; blockwise: the
// 128×128 blocks' inverses in cuBLASLt's layout for that orientation, as fp8_quantize_blocks writes them). The
// CPU's values are the same either way round; the GPU transposes the codes for the input gradient.
inline void fp8_take_weight(float* out, bool, const float* codes, const float*, long rows, long cols, void*, Fp8Recipe) {
    memcpy(out, codes, (size_t)rows * cols * sizeof(float));
}

// out (cols×rows) = codesᵀ (rows×cols), through 32×32 tiles in shared memory so that reads and writes are coalesced
static __global__ void fp8_transpose_codes_kernel(uint8_t* out, const uint8_t* codes, long rows, long cols) {
    __shared__ uint8_t tile[32][33];
    long r0 = (long)blockIdx.y * 32, c0 = (long)blockIdx.x * 32;
    for (int i = threadIdx.y; i < 32; i += blockDim.y)
        if (r0 + i < rows && c0 + threadIdx.x < cols) tile[i][threadIdx.x] = codes[(r0 + i) * cols + c0 + threadIdx.x];
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y)
        if (c0 + i < cols && r0 + threadIdx.x < rows) out[(c0 + i) * rows + r0 + threadIdx.x] = tile[threadIdx.x][i];
}
// block (i, j)'s inverse scale (pairs: scale and inverse per block, row-major) at its place in the BLK128x128 layout
static __global__ void fp8_place_block_scales_kernel(float* scales, const float* pairs, long rows, long cols, bool down) {
    long across = cols / FP8_BLOCK, blocks = rows / FP8_BLOCK * across;
    for (long b = (long)blockIdx.x * blockDim.x + threadIdx.x; b < blocks; b += (long)gridDim.x * blockDim.x) {
        long i = b / across, j = b % across;
        long at = down ? fp8_scale_index(Fp8Recipe::Blockwise, true, j * FP8_BLOCK, i, cols, rows / FP8_BLOCK)
                       : fp8_scale_index(Fp8Recipe::Blockwise, true, i * FP8_BLOCK, j, rows, across);
        scales[at] = pairs[2 * b + 1];
    }
}
inline void fp8_take_weight(uint8_t* out, bool down, const uint8_t* codes, const float* pairs, long rows, long cols,
                            void* scales, Fp8Recipe r) {
    if (down) {
        dim3 grid((unsigned)((cols + 31) / 32), (unsigned)((rows + 31) / 32)), block(32, 8);
        fp8_transpose_codes_kernel<<<grid, block, 0, main_stream()>>>(out, codes, rows, cols);
        cuda_check(cudaGetLastError());
    } else {
        device_copy<bf16>(out, codes, (size_t)rows * cols);
    }
    if (r == Fp8Recipe::Tensorwise) device_copy<bf16>(static_cast<float*>(scales), pairs, 2);
    else launch_elementwise(fp8_place_block_scales_kernel, rows / FP8_BLOCK * (cols / FP8_BLOCK), static_cast<float*>(scales),
                            pairs, rows, cols, down);
}

// A weight whose cast arrived ready (--fp8-param-gather, llmc/fp8_gather.cuh): its rows×cols codes (the CPU's
// values, as a cast leaves them), and the scale and inverse of each of its scaled pieces (tensorwise one pair,
// blockwise one per 128×128 block, row-major over the blocks), where the codes' device keeps them
template <typename Code>
struct Fp8ReadyWeight {
    const Code* codes;
    const float* pairs;
    long rows, cols;
};
template <typename Code>
using Fp8ReadyWeights = std::unordered_map<const void*, Fp8ReadyWeight<Code>>;

template <typename floatX>
struct Fp8Scaling {
    // a cast operand: on the GPU the code, on the CPU the value the GPU's GEMM makes of it (llmc/fp8.cuh's top)
    using Code = std::conditional_t<device_of<floatX> == Device::CUDA, uint8_t, float>;
    Fp8Recipe recipe = Fp8Recipe::Tensorwise;
    // grad_t: the output gradient as the weight gradient reads it (the GPU's transposed copy; under a block recipe
    // on the CPU, its tiles down the columns)
    Code *input = nullptr, *weight = nullptr, *grad = nullptr, *grad_t = nullptr;
    float* scales = nullptr;  // tensorwise: per operand (Fp8Operand) its scale and inverse (FP8_SCALE_FLOATS)
    float* amaxes = nullptr;  // tensorwise: the group's amaxes of the operand in hand, after the scales
    Comm* group = nullptr;    // tensorwise: the ranks holding pieces of the same tensors (null: this rank alone)
    void* tiles[4] = {};      // the block recipes on the GPU: each operand's tile scales (llmc/fp8_blocks.cuh)
    bool speaks = true;       // says which weights stay out of a block recipe (one rank of a layout)
    // --fp8-param-gather: the FP8 weights' casts as gathered, by the address of the weight the layer passes (every
    // weight cast here must be one of them); null: each weight is cast from its values
    const Fp8ReadyWeights<Code>* ready = nullptr;

    float* pair(Fp8Operand o) const { return scales + FP8_SCALE_STRIDE * o + 3; }
    const float* inverse(Fp8Operand o) const { return pair(o) + 1; }
    bool tensorwise() const { return recipe == Fp8Recipe::Tensorwise; }
    // the output gradient's format: E5M2 under one scale per tensor, E4M3 where tiles give it range
    Fp8Format grad_format() const { return tensorwise() ? Fp8Format::E5M2 : Fp8Format::E4M3; }
    // the rows of the weight gradient's sum, padded: to 16 for cuBLASLt's FP8 kernels, to a whole tile under a block
    // recipe (zeros change no amax)
    long padded(long rows) const { return tensorwise() ? fp8_padded(rows) : pad_to(rows, fp8_tile(recipe)); }
    // what the GEMM reads to undo operand o's scales, and how (cuBLASLt's scale mode)
    const void* unscale(Fp8Operand o) const { return tensorwise() ? inverse(o == FP8_GRAD_T ? FP8_GRAD : o) : tiles[o]; }
    int mode(Fp8Operand o) const {
        if (tensorwise()) return FP8_SCALE_TENSOR;
        if (recipe == Fp8Recipe::Mxfp8) return FP8_SCALE_VEC32_E8M0;
        return o == FP8_WEIGHT ? FP8_SCALE_BLK128 : FP8_SCALE_VEC128;
    }

    // Whether a weight of rows×cols runs in FP8: always under tensorwise; under a block recipe when its dimensions
    // are whole tiles, the others said once per shape
    bool takes(long rows, long cols) const {
        if (fp8_recipe_takes(recipe, rows, cols)) return true;
        static std::set<std::pair<long, long>> said;
        if (speaks && said.insert({rows, cols}).second)
            printf("fp8: the %ldx%ld weights' matmuls run in %s: --fp8-recipe %s needs dimensions that are multiples of "
                   "%d\n", rows, cols, device_of<floatX> == Device::CUDA ? "bf16" : "fp32", fp8_recipe_name(recipe),
                   fp8_tile(recipe));
        return false;
    }
    // Whether the matmuls of such a weight over n tokens run in FP8: when it takes the weight, and under blockwise
    // when n is a multiple of 4 (the forward's and the input gradient's n, which cuBLASLt's 1x128 and 128x128
    // scales want so: fp8_gemm_plan); the others said once per weight shape. The CPU falls back alike, so that
    // both devices run one numerics (an expert's share of the tokens, a batch of odd length).
    bool runs(long n, long rows, long cols) const {
        if (!takes(rows, cols)) return false;
        if (recipe != Fp8Recipe::Blockwise || n % 4 == 0) return true;
        if (ready)  // the gathered weight is codes: no values to run the fallback on
            fail("--fp8-param-gather 1: a blockwise matmul over %ld tokens (no multiple of 4) would run in bf16 from the "
                 "weight's values, which the gathers carry as FP8 codes", n);
        static std::set<std::pair<long, long>> said;
        if (speaks && said.insert({rows, cols}).second)
            printf("fp8: the %ldx%ld weights' matmuls over %ld tokens (and any count that is no multiple of 4) run in %s: "
                   "--fp8-recipe blockwise needs token counts that are multiples of 4\n", rows, cols, n,
                   device_of<floatX> == Device::CUDA ? "bf16" : "fp32");
        return false;
    }

    // x (rows×cols) cast as tensorwise operand o in format f with a scale shared over the group: into out, and on the
    // GPU its transpose into out_t (cols×ld_t); either may be null
    void cast(Code* out, Code* out_t, const floatX* x, long rows, long cols, long ld_t, Fp8Operand o, Fp8Format f) const {
        int pieces = group ? group->size : 1, mine = group ? group->rank : 0;
        fp8_amax(amaxes + mine, x, rows * cols);
        if (pieces > 1) group->wait(group->all_gather(amaxes + mine, amaxes, 1, DType::F32));
        fp8_make_scale(pair(o), amaxes, pieces, f, x);
        fp8_quantize(out, out_t, x, rows, cols, ld_t, pair(o), f);
    }

    // The weight W (rows×cols) cast for the forward (summed along its rows) or, `down`, the input gradient (down its
    // columns, which the GPU writes transposed) into `weight` and its scales: from W's values, or as gathered
    void cast_weight(const floatX* w, long rows, long cols, bool down) const {
        if (ready) {
            auto it = ready->find(w);
            if (it == ready->end() || it->second.rows != rows || it->second.cols != cols)
                fail("--fp8-param-gather: the %ldx%ld weight of an FP8 matmul came without its FP8 codes", rows, cols);
            const Fp8ReadyWeight<Code>& r = it->second;
            fp8_take_weight(weight, down, r.codes, r.pairs, rows, cols,
                            tensorwise() ? (void*)pair(FP8_WEIGHT) : tiles[FP8_WEIGHT], recipe);
        } else if (tensorwise()) {
            constexpr bool gpu = device_of<floatX> == Device::CUDA;
            cast(gpu && down ? nullptr : weight, gpu && down ? weight : nullptr, w, rows, cols, down ? rows : 0, FP8_WEIGHT,
                 Fp8Format::E4M3);
        } else {
            cast_tiles(weight, w, rows, cols, down ? rows : 0, down, FP8_WEIGHT);
        }
    }

    // x (rows×cols) cast in the block recipe's tiles for a GEMM that sums along x's rows or, `down`, down its
    // columns (the weight gradient's tokens; an mxfp8 weight's output channels for the input gradient), which the GPU
    // writes transposed (cols×ld_t); a blockwise weight in 128×128 blocks either way
    void cast_tiles(Code* out, const floatX* x, long rows, long cols, long ld_t, bool down, Fp8Operand o) const {
        fp8_quantize_tiled(out, tiles[o], x, rows, cols, ld_t, down, o == FP8_WEIGHT && recipe == Fp8Recipe::Blockwise,
                           recipe);
    }
};

// The buffers' sizes for GEMMs of up to `rows` rows, inputs up to `input_cols` wide, weights of up to
// `weight_elements` and outputs up to `output_cols` wide: codes (the CPU's floats), floats for the scales and the
// group's amaxes, and a block recipe's tile scales per operand (bytes, in Fp8Operand's order)
struct Fp8Sizes {
    size_t input, weight, grad, grad_t, floats;
    size_t tiles[4];
};
inline Fp8Sizes fp8_sizes(long rows, long input_cols, long output_cols, size_t weight_elements, int group, Device dev,
                          Fp8Recipe r = Fp8Recipe::Tensorwise) {
    bool gpu = dev == Device::CUDA, tiled = r != Fp8Recipe::Tensorwise;
    size_t padded = gpu ? (tiled ? pad_to(rows, fp8_tile(r)) : fp8_padded(rows)) : rows;
    Fp8Sizes z{padded * input_cols, weight_elements, (size_t)rows * output_cols,
               gpu ? (size_t)output_cols * padded : tiled ? (size_t)rows * output_cols : 0,
               (size_t)FP8_SCALE_FLOATS + group, {0, 0, 0, 0}};
    if (gpu && tiled) {  // each operand in the orientations it is cast in (a weight's dimensions are at most these)
        bool blocks = r == Fp8Recipe::Blockwise;
        z.tiles[FP8_INPUT] = std::max(fp8_scale_bytes(r, false, rows, input_cols), fp8_scale_bytes(r, false, input_cols, padded));
        z.tiles[FP8_WEIGHT] = std::max(fp8_scale_bytes(r, blocks, output_cols, input_cols),
                                       fp8_scale_bytes(r, blocks, input_cols, output_cols));
        z.tiles[FP8_GRAD] = fp8_scale_bytes(r, false, rows, output_cols);
        z.tiles[FP8_GRAD_T] = fp8_scale_bytes(r, false, output_cols, padded);
    }
    return z;
}

// what stops FP8 with recipe r on this GPU ("" when nothing does): FP8 tensor cores need compute capability 8.9
// or later, and the cast kernels code built for them (a build for older GPUs only would emulate the casts);
// cuBLASLt runs blockwise's 128-element scales on compute capability 9.0 only (Hopper: Blackwell's tensor cores
// scale in hardware, by 32) and mxfp8's E8M0 scales from 10.0 (Blackwell)
inline std::string fp8_gpu_problem(Fp8Recipe r = Fp8Recipe::Tensorwise) {
    int gpu = 0;
    cudaDeviceProp prop;
    cuda_check(cudaGetDevice(&gpu));
    cuda_check(cudaGetDeviceProperties(&prop, gpu));
    int cc = prop.major * 10 + prop.minor;
    if (cc < 89)
        return strfmt("needs FP8 tensor cores (compute capability 8.9 or later); %s is %d.%d", prop.name, prop.major,
                      prop.minor);
    if (r == Fp8Recipe::Blockwise && cc != 90)
        return strfmt("--fp8-recipe blockwise runs on compute capability 9.0 (cuBLASLt's 1x128 and 128x128 scales); %s is "
                      "%d.%d", prop.name, prop.major, prop.minor);
    if (r == Fp8Recipe::Mxfp8 && cc < 100)
        return strfmt("--fp8-recipe mxfp8 needs compute capability 10.0 or later (cuBLASLt's E8M0 scales per 32 "
                      "values); %s is %d.%d", prop.name, prop.major, prop.minor);
    cudaFuncAttributes attributes;
    cuda_check(cudaFuncGetAttributes(&attributes, fp8_quantize_kernel));
    int built = r == Fp8Recipe::Mxfp8 ? 100 : 89;
    if (attributes.ptxVersion < built)
        return strfmt("this build has no code for compute capability %d.%d or later (its kernels are compute_%d); "
                      "rebuild with CUDA_ARCH=\"-gencode arch=compute_%s,code=sm_%s\"", built / 10, built % 10,
                      attributes.ptxVersion, built == 100 ? "100a" : "90a", built == 100 ? "100a" : "90a");
    return "";
}
inline void fp8_check_gpu(Fp8Recipe r) {
    std::string why = fp8_gpu_problem(r);
    if (!why.empty()) fail("--fp8 1: %s", why.c_str());
}

// ----------------------------------------------------------------------------------------------------------
// How cuBLASLt runs an FP8 GEMM. One function, fp8_gemm_plan, decides the layout, the types, the epilogue and the
// kernels that run beside it for every FP8 GEMM (a layer's three, the experts', the calibration's), from what the
// bf16 GEMM in its place would ask. Its rules are cuBLASLt's documented requirements for FP8 (cublasLtMatmul) and
// what production FP8 code runs (TransformerEngine's cublaslt_gemm.cu, PyTorch's scaled_gemm):
//   types     A and B E4M3 or E5M2 but not both E5M2 (the table of FP8 type combinations has no E5M2 × E5M2);
//             C = D = bf16, C being D itself (in place: same type, same layout); the bias bf16 (the table's
//             bias type for a bf16 D); fp32 compute and scale types; one fp32 scale per tensor, through the A
//             and B scale pointers (no D scale or amax: D is not FP8)
//   layout    TN only: A transposed and B not, both operands K-major with leading dimension k ("A must be
//             transposed and B non-transposed" on Ada and Hopper); k and m multiples of 16 and every pointer
//             16-byte aligned (16-byte leading dimensions and pointers, which FP8 kernels require where bf16
//             ones only prefer them)
//   epilogue  DEFAULT or BIAS, the two that TransformerEngine's default FP8 path and PyTorch's scaled_mm run.
//             The rest run as separate kernels, from today's bf16 path: the forward's GELU (the GEMM writes the
//             pre-activation, the GELU kernel the activation), the bias gradient that BGRADB would fold in (it
//             would overwrite rather than accumulate, and sum the quantized gradient; the recipe sums dout
//             itself, as TransformerEngine does beside its cast), and the GELU backward of DGELU and DGELU_BGRAD
//   accumulation  fast in the forward, promoted to fp32 periodically in the two gradient GEMMs: the split
//             TransformerEngine's recipes default to (fprop fast, dgrad and wgrad with a split accumulator)
//   tiles     the block recipes' scale modes in the pairs of its "128-element 1D and 128x128 2D block scaling" table
//             (never 128x128 on both), E8M0 per 32 with itself, E4M3 operands, k whole tiles, the scales 16-byte
//             aligned, and under the fp32 tiles m and n multiples of 4 (its "scaling factors layouts" notes)
// The CPU Catch2 case "fp8 GEMM plan" holds the function to this table.

enum class GemmPass { Forward, Backward };  // the forward's GEMM, or one of the two gradient GEMMs

struct Fp8GemmRequest {
    cublasLtEpilogue_t epilogue;  // what the bf16 GEMM in its place would ask cuBLASLt for
    GemmPass pass;
    cudaDataType_t a, b;          // cuBLASLt's A and B
    bool transa, transb;
    long m, n, k;                 // D is m×n, the sum runs over k
    int align_a, align_b, align_d;  // bytes (pointer_alignment)
    int mode_a = FP8_SCALE_TENSOR, mode_b = FP8_SCALE_TENSOR;  // cuBLASLt's scale modes (Fp8ScaleMode)
    int align_scale_a = 256, align_scale_b = 256;               // the tile scales' pointers, bytes
};

struct Fp8GemmPlan {
    std::string refused;  // why cuBLASLt cannot run it; empty when it can
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;  // what cuBLASLt is asked for
    bool fast_accum = false;
    // the separate kernels that run instead of the epilogue: the bias (block scales), GELU of the GEMM's output,
    // GELU's backward, the bias gradient (a column sum of the unquantized output gradient)
    bool bias = false, gelu = false, gelu_backward = false, bias_grad = false;
};

inline Fp8GemmPlan fp8_gemm_plan(const Fp8GemmRequest& r) {
    Fp8GemmPlan p;
    auto refuse = [&](std::string why) {
        p.refused = why;
        return p;
    };
    if (!is_fp8_type(r.a) || !is_fp8_type(r.b))
        return refuse("A and B must both be FP8 (E4M3 or E5M2)");
    if (r.a == CUDA_R_8F_E5M2 && r.b == CUDA_R_8F_E5M2) return refuse("E5M2 x E5M2 is no FP8 type combination of cuBLASLt");
    if (!r.transa || r.transb) return refuse("FP8 GEMMs are TN only: A transposed, B not");
    if (r.m % 16 || r.k % 16) return refuse(strfmt("m %ld and k %ld must be multiples of 16", r.m, r.k));
    if (r.align_a < 16 || r.align_b < 16 || r.align_d < 16)
        return refuse(strfmt("A, B and D must be 16-byte aligned (they are %d, %d and %d)", r.align_a, r.align_b, r.align_d));
    bool tiles = r.mode_a != FP8_SCALE_TENSOR || r.mode_b != FP8_SCALE_TENSOR;
    if (tiles && (r.mode_a == FP8_SCALE_TENSOR || r.mode_b == FP8_SCALE_TENSOR))
        return refuse("a tile-scaled operand pairs with another tile-scaled one only");
    if (r.mode_a == FP8_SCALE_BLK128 && r.mode_b == FP8_SCALE_BLK128)
        return refuse("128x128 blocks on both operands is no scale-mode combination of cuBLASLt");
    if (tiles && (r.a != CUDA_R_8F_E4M3 || r.b != CUDA_R_8F_E4M3)) return refuse("the block recipes are E4M3 x E4M3");
    bool mx = r.mode_a == FP8_SCALE_VEC32_E8M0;
    if (tiles && mx != (r.mode_b == FP8_SCALE_VEC32_E8M0))
        return refuse("E8M0 scales per 32 values pair with E8M0 scales per 32 values only");
    int tile = mx ? FP8_MX_BLOCK : FP8_BLOCK;
    if (tiles && r.k % tile) return refuse(strfmt("k %ld must be a multiple of the scales' %d", r.k, tile));
    // the block scales' layouts: "starting addresses of scaling factors must be 16B aligned", and the fp32 tiles'
    // (VEC128_32F, BLK128x128_32F) want "M and N multiples of 4"
    if (tiles && (r.align_scale_a < 16 || r.align_scale_b < 16))
        return refuse(strfmt("the tile scales must be 16-byte aligned (they are %d and %d)", r.align_scale_a,
                             r.align_scale_b));
    if (tiles && !mx && (r.m % 4 || r.n % 4))
        return refuse(strfmt("m %ld and n %ld must be multiples of 4 under 1x128 and 128x128 scales", r.m, r.n));
    // a block-scaled GEMM accumulates in fp32 throughout (PyTorch's scaled_mm refuses fast accumulation with
    // 1x128 and 128x128 scales) and adds the bias in a kernel of its own, as the GELU
    p.fast_accum = r.pass == GemmPass::Forward && !tiles;
    bool bias_epilogue = !tiles;
    switch (r.epilogue) {
        case CUBLASLT_EPILOGUE_DEFAULT: break;
        case CUBLASLT_EPILOGUE_BIAS: (bias_epilogue ? p.epilogue = CUBLASLT_EPILOGUE_BIAS : p.bias = true); break;
        case CUBLASLT_EPILOGUE_GELU_AUX: p.gelu = true; break;
        case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
            (bias_epilogue ? p.epilogue = CUBLASLT_EPILOGUE_BIAS : p.bias = true), p.gelu = true;
            break;
        case CUBLASLT_EPILOGUE_BGRADB: p.bias_grad = true; break;
        case CUBLASLT_EPILOGUE_DGELU: p.gelu_backward = true; break;
        case CUBLASLT_EPILOGUE_DGELU_BGRAD: p.gelu_backward = true, p.bias_grad = true; break;
        default: return refuse(strfmt("epilogue %d is none a linear layer asks for", (int)r.epilogue));
    }
    return p;
}

inline cudaDataType_t fp8_cuda_type(Fp8Format f) { return f == Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

// an operand of an FP8 GEMM on the GPU: its codes, their format, what undoes their scales (a tensor's inverse
// scale, or the tiles' scales) and how (Fp8ScaleMode)
struct Fp8Matrix {
    const uint8_t* codes;
    Fp8Format format;
    const void* unscale;
    int mode = FP8_SCALE_TENSOR;
};

// out[rows×cols] += bias per column (the bias that a block-scaled GEMM's epilogue does not add)
static __global__ void fp8_add_bias_kernel(bf16* out, const bf16* bias, long rows, long cols) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * cols; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(__bfloat162float(out[i]) + __bfloat162float(bias[i % cols]));
}

// D[m×n] (bf16, ld m) = unscale(A)·unscale(B)·Aᵀ·B + beta·D for codes A (k×m, ld k) and B (k×n, ld k), as
// fp8_gemm_plan runs the GEMM that `wish` describes: the GEMM itself, and the bias (in the epilogue, or after it).
// Returns the plan; the caller, which holds their operands, runs the other separate kernels it lists.
inline Fp8GemmPlan fp8_gemm(bf16* d, Fp8Matrix a, Fp8Matrix b, long m, long n, long k, float beta,
                            cublasLtEpilogue_t wish, GemmPass pass, const bf16* bias = nullptr) {
    Fp8GemmRequest r{wish, pass, fp8_cuda_type(a.format), fp8_cuda_type(b.format), true, false, m, n, k,
                     pointer_alignment(a.codes), pointer_alignment(b.codes), pointer_alignment(d), a.mode, b.mode,
                     pointer_alignment(a.unscale), pointer_alignment(b.unscale)};
    Fp8GemmPlan plan = fp8_gemm_plan(r);
    if (!plan.refused.empty())
        fail("--fp8 1: the GEMM m=%ld n=%ld k=%ld (%s x %s) cannot run in FP8: %s", m, n, k, fp8_name(a.format),
             fp8_name(b.format), plan.refused.c_str());
    GemmOperands operands{r.a, r.b, (const float*)a.unscale, (const float*)b.unscale, plan.fast_accum, a.mode, b.mode};
    cublaslt_matmul(d, a.codes, b.codes, plan.epilogue == CUBLASLT_EPILOGUE_BIAS ? bias : nullptr, nullptr, true, false,
                    m, n, k, beta, plan.epilogue, main_stream(), operands);
    if (plan.bias) launch_elementwise(fp8_add_bias_kernel, n * m, d, bias, n, m);  // D is n rows of m (column-major)
    return plan;
}

// ----------------------------------------------------------------------------------------------------------
// the three GEMMs of a linear layer, as matmul.cuh's entry points take them. The CPU's run through those entry
// points on the cast values; the GPU's through fp8_gemm.

// the forward's casts: the input and the weight, both summed along their rows
template <typename floatX>
void fp8_cast_forward(const Fp8Scaling<floatX>& q, const floatX* inp, const floatX* weight, long N, long C, long OC) {
    if (q.tensorwise()) q.cast(q.input, nullptr, inp, N, C, 0, FP8_INPUT, Fp8Format::E4M3);
    else q.cast_tiles(q.input, inp, N, C, 0, false, FP8_INPUT);
    q.cast_weight(weight, OC, C, false);
}

// The backward's casts, into q.grad and q.weight for the input gradient (dinp), q.grad_t and q.input for the
// weight gradient (dweight). The weight's sum runs down its columns (the output channels), the weight gradient's
// down the tokens, which the GPU writes transposed, the tokens padded (padded: their count). Tensorwise casts the
// output gradient once for both GEMMs (the GPU writes both copies in one pass; the CPU's grad serves both), a block
// recipe twice, in tiles along each GEMM's sum.
template <typename floatX>
void fp8_cast_backward(const Fp8Scaling<floatX>& q, const floatX* dout, const floatX* inp, const floatX* weight, long N,
                       long C, long OC, long padded, bool dinp, bool dweight) {
    constexpr bool gpu = device_of<floatX> == Device::CUDA;
    if (q.tensorwise()) {
        q.cast(q.grad, dweight && gpu ? q.grad_t : nullptr, dout, N, OC, padded, FP8_GRAD, Fp8Format::E5M2);
        if (dinp) q.cast_weight(weight, OC, C, true);
        if (dweight) q.cast(gpu ? nullptr : q.input, gpu ? q.input : nullptr, inp, N, C, padded, FP8_INPUT, Fp8Format::E4M3);
        return;
    }
    if (dinp) {
        q.cast_tiles(q.grad, dout, N, OC, 0, false, FP8_GRAD);
        q.cast_weight(weight, OC, C, true);
    }
    if (dweight) {
        q.cast_tiles(q.grad_t, dout, N, OC, padded, true, FP8_GRAD_T);
        q.cast_tiles(q.input, inp, N, C, padded, true, FP8_INPUT);
    }
}

// out[N×OC] = inp · Wᵀ + bias; with pre_gelu, pre_gelu takes that and out its GELU
inline void fp8_matmul_forward(float* out, float* pre_gelu, const float* inp, const float* weight, const float* bias, long N,
                               long C, long OC, Workspace workspace, const Fp8Scaling<float>& q) {
    fp8_cast_forward(q, inp, weight, N, C, OC);
    if (pre_gelu) matmul_gelu_forward(out, pre_gelu, q.input, q.weight, bias, N, C, OC, workspace);
    else matmul_forward(out, q.input, q.weight, bias, N, C, OC, workspace);
}
inline void fp8_matmul_forward(bf16* out, bf16* pre_gelu, const bf16* inp, const bf16* weight, const bf16* bias, long N,
                               long C, long OC, Workspace, const Fp8Scaling<bf16>& q) {
    fp8_cast_forward(q, inp, weight, N, C, OC);
    cublasLtEpilogue_t wish = pre_gelu ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                                       : (bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
    // outᵀ[OC×N] = (W as C×OC)ᵀ · (inp as C×N); with GELU the GEMM writes pre_gelu, and the GELU kernel out
    Fp8GemmPlan plan = fp8_gemm(pre_gelu ? pre_gelu : out, {q.weight, Fp8Format::E4M3, q.unscale(FP8_WEIGHT), q.mode(FP8_WEIGHT)},
                                {q.input, Fp8Format::E4M3, q.unscale(FP8_INPUT), q.mode(FP8_INPUT)}, OC, N, C, 0.0f, wish,
                                GemmPass::Forward, bias);
    if (plan.gelu) gelu_forward(out, pre_gelu, N * OC);
}

// dinp[N×C] = dout · W (overwritten); dweight[OC×C] += doutᵀ · inp; dbias[OC] += column sums of dout, from
// dout itself, not its cast (any of the three may be null)
inline void fp8_matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                const float* weight, long N, long C, long OC, Workspace workspace,
                                const Fp8Scaling<float>& q) {
    fp8_cast_backward(q, dout, inp, weight, N, C, OC, N, dinp, dweight);
    if (dinp) matmul_backward(dinp, nullptr, nullptr, q.grad, q.input, q.weight, N, C, OC, workspace);
    if (dweight) matmul_backward(nullptr, dweight, nullptr, q.tensorwise() ? q.grad : q.grad_t, q.input, q.weight, N, C, OC,
                                 workspace);
    if (dbias) matmul_backward(nullptr, nullptr, dbias, dout, inp, weight, N, C, OC, workspace);
}
inline void fp8_matmul_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                                const bf16* weight, long N, long C, long OC, Workspace workspace,
                                const Fp8Scaling<bf16>& q) {
    long padded = q.padded(N);
    fp8_cast_backward(q, dout, inp, weight, N, C, OC, padded, dinp, dweight);
    if (dinp)  // dinpᵀ[C×N] = (Wᵀ as OC×C)ᵀ · (dout as OC×N)
        fp8_gemm(dinp, {q.weight, Fp8Format::E4M3, q.unscale(FP8_WEIGHT), q.mode(FP8_WEIGHT)},
                 {q.grad, q.grad_format(), q.unscale(FP8_GRAD), q.mode(FP8_GRAD)}, C, N, OC, 0.0f, CUBLASLT_EPILOGUE_DEFAULT,
                 GemmPass::Backward);
    if (dweight)  // dWᵀ[C×OC] += (inpᵀ as N×C)ᵀ · (doutᵀ as N×OC), over the padded rows
        fp8_gemm(dweight, {q.input, Fp8Format::E4M3, q.unscale(FP8_INPUT), q.mode(FP8_INPUT)},
                 {q.grad_t, q.grad_format(), q.unscale(FP8_GRAD_T), q.mode(FP8_GRAD_T)}, C, OC, padded, 1.0f,
                 dbias ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_DEFAULT, GemmPass::Backward);
    // the bias gradient, which fp8_gemm_plan never folds into an FP8 GEMM (bias_grad): the column sums of dout
    if (dbias) matmul_backward(nullptr, nullptr, dbias, dout, inp, weight, N, C, OC, workspace);
}

// The model's entry points with one more argument: the layer's FP8 state, or null for bf16 (the layers that
// stay bf16, and every layer without --fp8)
template <typename floatX>
inline void matmul_forward(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, long N, long C,
                           long OC, Workspace workspace, const Fp8Scaling<floatX>* fp8) {
    if (fp8 && fp8->runs(N, OC, C)) fp8_matmul_forward(out, (floatX*)nullptr, inp, weight, bias, N, C, OC, workspace, *fp8);
    else matmul_forward(out, inp, weight, bias, N, C, OC, workspace);
}
template <typename floatX>
inline void matmul_gelu_forward(floatX* out, floatX* pre_gelu, const floatX* inp, const floatX* weight, const floatX* bias,
                                long N, long C, long OC, Workspace workspace, const Fp8Scaling<floatX>* fp8) {
    if (fp8 && fp8->runs(N, OC, C)) fp8_matmul_forward(out, pre_gelu, inp, weight, bias, N, C, OC, workspace, *fp8);
    else matmul_gelu_forward(out, pre_gelu, inp, weight, bias, N, C, OC, workspace);
}
template <typename floatX>
inline void matmul_backward(floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                            const floatX* weight, long N, long C, long OC, Workspace workspace,
                            const Fp8Scaling<floatX>* fp8) {
    if (fp8 && fp8->runs(N, OC, C)) fp8_matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC, workspace, *fp8);
    else matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC, workspace);
}
// ... and the MLP projection's backward through GELU (gelu_matmul_backward). An FP8 layer's GEMMs are
// fp8_matmul_backward's, which take no epilogue: GELU's backward and the bias gradient of its input follow them in
// one pass (gelu_backward_dbias).
template <typename floatX>
inline void gelu_matmul_backward(floatX* dpre, floatX* dweight, floatX* dbias, floatX* dpre_bias, const floatX* dout,
                                 const floatX* inp, const floatX* pre_gelu, const floatX* weight, long N, long C,
                                 long OC, Workspace workspace, const Fp8Scaling<floatX>* fp8) {
    if (!fp8 || !fp8->runs(N, OC, C)) {
        gelu_matmul_backward(dpre, dweight, dbias, dpre_bias, dout, inp, pre_gelu, weight, N, C, OC, workspace);
        return;
    }
    fp8_matmul_backward(dpre, dweight, dbias, dout, inp, weight, N, C, OC, workspace, *fp8);
    gelu_backward_dbias(dpre, dpre_bias, pre_gelu, N, C, workspace);
}
