// The block recipes' GPU side (llmc/fp8_blocks.cuh). On the CPU: the tile scales' layouts against cuBLASLt's
// documentation, written here from its text (VEC128_32F M-major, BLK128x128_32F K-major with a column stride of a
// multiple of 4, VEC32_UE8M0's 128x4 tiles and their in-tile offsets). On a GPU: each cast kernel bit for bit
// against the CPU's cast (fp8_quantize_tiles), its scales at their layout's indices and mxfp8's padding zero; the
// recipes refused where cuBLASLt has no kernels for them.
#include "dev/cuda/common.h"
#include "llmc/fp8.cuh"

namespace test_fp8_recipes {

const Fp8Recipe BLOCK_RECIPES[] = {Fp8Recipe::Blockwise, Fp8Recipe::Mxfp8};

long ceil_div(long a, long b) { return (a + b - 1) / b; }
long round_up(long a, long b) { return ceil_div(a, b) * b; }

// ----------------------------------------------------------------------------------------------------------
// on the CPU

// cuBLASLt's documentation, "128-element 1D and 128x128 2D block scaling", scaling factors layouts: VEC128_32F's
// scales are "M-major for A with shape M × L" (L = ⌈K/128⌉; M a multiple of 4); BLK128x128_32F's "K-major and the
// stride between the consecutive columns must be a multiple of 4", shape L4 × ⌈M/128⌉
long documented_vec128(long m, long kt, long M) { return kt * M + m; }
long documented_blk128(long m, long kb, long L) { return m / 128 * round_up(L, 4) + kb; }
// "1D block scaling factors layout": a 128x4 tile at offset (sf_inner + sf_outer · sf_inner_dim) · 128 (sf_inner
// the tile's first K-tile, a multiple of 4; sf_outer its row of tiles; sf_inner_dim the K-tiles padded to 4), and in
// it "offset = (outer % 32) * 16 + (outer / 32) * 4 + inner" (outer the row in the tile, inner the K-tile)
long documented_vec32(long m, long kt, long ktiles) {
    long sf_inner = kt / 4 * 4, sf_outer = m / 128, sf_inner_dim = round_up(ktiles, 4), outer = m % 128, inner = kt % 4;
    return (sf_inner + sf_outer * sf_inner_dim) * 128 + (outer % 32) * 16 + (outer / 32) * 4 + inner;
}

TEST_CASE("fp8 recipes: the tile scales' layouts are cuBLASLt's documented ones (VEC128_32F M-major, BLK128x128_32F "
          "K-major with columns padded to 4, VEC32_UE8M0 in 128x4 tiles), each scale at its own index, the sizes tight",
          "[fp8]") {
    for (long M : {4L, 36L, 260L, 1024L})
        for (long K : {128L, 384L, 1000L, 2048L}) {
            INFO("M " << M << " K " << K);
            long L = ceil_div(K, FP8_BLOCK), T = ceil_div(K, FP8_MX_BLOCK);
            long wrong = 0;
            for (long m = 0; m < M; m++)
                for (long kt = 0; kt < L; kt++)
                    wrong += fp8_scale_index(Fp8Recipe::Blockwise, false, m, kt, M, L) != documented_vec128(m, kt, M);
            CHECK(wrong == 0);
            CHECK(fp8_scale_bytes(Fp8Recipe::Blockwise, false, M, K) == sizeof(float) * M * L);
            // a block's scale, from any of its rows (the kernel passes the block's first)
            for (long m = 0; m < M; m++)
                for (long kb = 0; kb < L; kb++)
                    wrong += fp8_scale_index(Fp8Recipe::Blockwise, true, m, kb, M, L) != documented_blk128(m, kb, L);
            CHECK(wrong == 0);
            CHECK(fp8_scale_bytes(Fp8Recipe::Blockwise, true, M, K) == sizeof(float) * ceil_div(M, 128) * round_up(L, 4));
            std::vector<int> hits(fp8_scale_bytes(Fp8Recipe::Mxfp8, false, M, K));
            for (long m = 0; m < M; m++)
                for (long kt = 0; kt < T; kt++) {
                    long at = fp8_scale_index(Fp8Recipe::Mxfp8, false, m, kt, M, T);
                    wrong += at != documented_vec32(m, kt, T);
                    if (at >= 0 && at < (long)hits.size()) hits[at]++;
                }
            CHECK(wrong == 0);
            CHECK(hits.size() == (size_t)(round_up(M, 128) * round_up(T, 4)));  // whole tiles
            CHECK(std::count(hits.begin(), hits.end(), 1) == M * T);              // one scale per index
        }
}

// ----------------------------------------------------------------------------------------------------------
// on a GPU

bool same_bits(float a, float b) { return memcmp(&a, &b, sizeof(float)) == 0 || (std::isnan(a) && std::isnan(b)); }

// the inverse scale a GEMM reads for the tile at `at` of a scale tensor
float tile_inverse(const std::vector<uint8_t>& scales, long at, Fp8Recipe r) {
    if (r == Fp8Recipe::Mxfp8) return scales[at] == 0xFF ? NAN : std::ldexp(1.0f, (int)scales[at] - 127);
    float inverse;
    memcpy(&inverse, scales.data() + at * sizeof(float), sizeof(float));
    return inverse;
}

// whether the scale the GPU stored at `at` is the one of a tile of amax `amax`: mxfp8's E8M0 byte, blockwise's
// inverse scale (bit for bit, any NaN for a NaN)
bool scale_matches(const std::vector<uint8_t>& scales, long at, float amax, Fp8Recipe r) {
    if (r == Fp8Recipe::Mxfp8) return scales[at] == fp8_e8m0(amax);
    float scale, inverse;
    fp8_tile_scale(&scale, &inverse, amax, r);
    return same_bits(tile_inverse(scales, at, r), inverse);
}

// the amax of x's tile (rows i0.., columns j0..; a NaN wins), as the CPU's cast takes it
float tile_amax(const std::vector<float>& x, long rows, long cols, long i0, long j0, long tile_rows, long tile_cols) {
    float amax = 0.0f;
    for (long i = i0; i < std::min(rows, i0 + tile_rows); i++)
        for (long j = j0; j < std::min(cols, j0 + tile_cols); j++) {
            if (std::isnan(x[i * cols + j])) return NAN;
            amax = std::max(amax, std::fabs(x[i * cols + j]));
        }
    return amax;
}

// one cast's comparison: codes the GPU wrote, read at (i, j) of x through `code_at`, decoded and unscaled by the
// inverse at the tile's layout index, against the CPU's values bit for bit; each tile's stored scale against the
// CPU's amax; under mxfp8 every byte of the scale tensor that is no tile's zero
struct CastCheck {
    long differ = 0, scales_differ = 0, padding_not_zero = 0;
};
template <typename CodeAt, typename ScaleAt>
CastCheck check_cast(const std::vector<float>& x, const std::vector<float>& cpu, long rows, long cols, long tile_rows,
                     long tile_cols, const std::vector<uint8_t>& codes, const std::vector<uint8_t>& scales, Fp8Recipe r,
                     CodeAt code_at, ScaleAt scale_index) {
    CastCheck c;
    for (long i = 0; i < rows; i++)
        for (long j = 0; j < cols; j++) {
            float got = fp8_decode(codes[code_at(i, j)], Fp8Format::E4M3) *
                        tile_inverse(scales, scale_index(i / tile_rows, j / tile_cols), r);
            c.differ += !same_bits(got, cpu[i * cols + j]);
        }
    std::vector<bool> used(r == Fp8Recipe::Mxfp8 ? scales.size() : 0);
    for (long ti = 0; ti < ceil_div(rows, tile_rows); ti++)
        for (long tj = 0; tj < ceil_div(cols, tile_cols); tj++) {
            long at = scale_index(ti, tj);
            float amax = tile_amax(x, rows, cols, ti * tile_rows, tj * tile_cols, tile_rows, tile_cols);
            c.scales_differ += !scale_matches(scales, at, amax, r);
            if (!used.empty()) used[at] = true;
        }
    for (size_t b = 0; b < used.size(); b++) c.padding_not_zero += !used[b] && scales[b] != 0;
    return c;
}

TEST_CASE("CUDA fp8 block casts equal the CPU's casts bit for bit: rows, columns (transposed, zero past the rows) and "
          "128x128 blocks, under blockwise and mxfp8, on 16-byte vectors and off them, with partial tiles, zeros, an "
          "outlier and a NaN tile; each scale at its layout index, mxfp8's padding zero", "[cuda][fp8]") {
    SKIP_WITHOUT_GPU_CASE();
    // 300 columns take the one-value paths; 256 and 200 the vectors (200 and 130 rows: partial tiles, blocks and
    // 64-column slabs; 256 rows: whole 16-byte runs of the transposed copies)
    struct Shape {
        long rows, cols;
    };
    for (Shape shape : {Shape{37, 300}, Shape{130, 256}, Shape{256, 200}}) {
        const long rows = shape.rows, cols = shape.cols;
        INFO(rows << " x " << cols);
        Rng rng(31 + rows);
        std::vector<float> x = random_bf16_values(rows * cols, rng, 2.0f);
        for (long j = 0; j < 40 && j < cols; j++) x[5 * cols + j] = 0.0f;  // a row whose first tile is zero but for its end
        x[9 * cols + 3] = 1e-30f, x[20 * cols + 150] = 1e6f;                 // a tiny value, an outlier
        x[33 * cols + 70] = NAN;                                             // a NaN: its tiles turn NaN
        x = round_to_bf16(x);
        DeviceArray<bf16> d_x(rows * cols);
        upload(d_x, x);
        for (Fp8Recipe r : BLOCK_RECIPES) {
            INFO(fp8_recipe_name(r));
            const long L = fp8_tile(r), ld_t = round_up(rows, L), ktiles = ceil_div(cols, L), ktiles_t = ceil_div(ld_t, L);
            std::vector<float> cpu(rows * cols);
            // along the rows
            DeviceArray<uint8_t> out(rows * cols), scales(fp8_scale_bytes(r, false, rows, cols));
            fp8_quantize_rows(out.ptr, scales.ptr, d_x.ptr, rows, cols, r);
            fp8_quantize_tiles(cpu.data(), x.data(), rows, cols, 1, L, r);
            CastCheck along = check_cast(
                x, cpu, rows, cols, 1, L, download(out), download(scales), r, [&](long i, long j) { return i * cols + j; },
                [&](long ti, long tj) { return fp8_scale_index(r, false, ti, tj, rows, ktiles); });
            CHECK(along.differ == 0);
            CHECK(along.scales_differ == 0);
            CHECK(along.padding_not_zero == 0);
            // down the columns, transposed: the weight gradient's operands, and an mxfp8 weight's for the input gradient
            DeviceArray<uint8_t> out_t(cols * ld_t), scales_t(fp8_scale_bytes(r, false, cols, ld_t));
            fp8_quantize_cols(out_t.ptr, scales_t.ptr, d_x.ptr, rows, cols, ld_t, r);
            fp8_quantize_tiles(cpu.data(), x.data(), rows, cols, L, 1, r);
            std::vector<uint8_t> codes_t = download(out_t);
            CastCheck down = check_cast(
                x, cpu, rows, cols, L, 1, codes_t, download(scales_t), r, [&](long i, long j) { return j * ld_t + i; },
                [&](long ti, long tj) { return fp8_scale_index(r, false, tj, ti, cols, ktiles_t); });
            CHECK(down.differ == 0);
            CHECK(down.scales_differ == 0);
            CHECK(down.padding_not_zero == 0);
            long padding = 0;
            for (long j = 0; j < cols; j++)
                for (long i = rows; i < ld_t; i++) padding += codes_t[j * ld_t + i] != 0;
            CHECK(padding == 0);
            if (r != Fp8Recipe::Blockwise) continue;
            // blockwise's weights: 128x128 blocks, in place and transposed
            const long block_rows = ceil_div(rows, L), block_cols = ceil_div(cols, L);
            DeviceArray<uint8_t> w(rows * cols), w_t(cols * rows), w_scales(fp8_scale_bytes(r, true, rows, cols)),
                w_scales_t(fp8_scale_bytes(r, true, cols, rows));
            fp8_quantize_blocks(w.ptr, reinterpret_cast<float*>(w_scales.ptr), w_t.ptr, reinterpret_cast<float*>(w_scales_t.ptr),
                                d_x.ptr, rows, cols);
            fp8_quantize_tiles(cpu.data(), x.data(), rows, cols, L, L, r);
            CastCheck blocks = check_cast(
                x, cpu, rows, cols, L, L, download(w), download(w_scales), r, [&](long i, long j) { return i * cols + j; },
                [&](long ti, long tj) { return fp8_scale_index(r, true, ti * L, tj, rows, block_cols); });
            CastCheck blocks_t = check_cast(
                x, cpu, rows, cols, L, L, download(w_t), download(w_scales_t), r, [&](long i, long j) { return j * rows + i; },
                [&](long ti, long tj) { return fp8_scale_index(r, true, tj * L, ti, cols, block_rows); });
            CHECK(blocks.differ == 0);
            CHECK(blocks.scales_differ == 0);
            CHECK(blocks_t.differ == 0);
            CHECK(blocks_t.scales_differ == 0);
        }
    }
}

TEST_CASE("CUDA fp8 recipes are refused in one line where cuBLASLt has no kernels for them: blockwise off compute "
          "capability 9.0, mxfp8 below 10.0, tensorwise below 8.9", "[cuda][fp8]") {
    SKIP_WITHOUT_GPU_CASE();
    cudaDeviceProp prop;
    cuda_check(cudaGetDeviceProperties(&prop, 0));
    const int cc = prop.major * 10 + prop.minor;
    INFO(prop.name << ", compute capability " << cc);
    struct Expected {
        Fp8Recipe recipe;
        bool runs;
        const char* says;
    } expected[] = {{Fp8Recipe::Tensorwise, cc >= 89, "compute capability 8.9"},
                    {Fp8Recipe::Blockwise, cc == 90, cc < 89 ? "compute capability 8.9" : "compute capability 9.0"},
                    {Fp8Recipe::Mxfp8, cc >= 100, cc < 89 ? "compute capability 8.9" : "compute capability 10.0"}};
    for (const Expected& e : expected) {
        std::string why = fp8_gpu_problem(e.recipe);
        INFO(fp8_recipe_name(e.recipe) << ": \"" << why << "\"");
        CHECK(why.empty() == e.runs);
        if (e.runs) continue;
        CHECK(why.find(e.says) != std::string::npos);
        CHECK(why.find('\n') == std::string::npos);
    }
}

}  // namespace test_fp8_recipes
