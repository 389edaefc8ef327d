// The block recipes' GPU side (llmc/fp8_blocks.cuh, and fp8_gemm_plan's tile modes in llmc/fp8.cuh). On the CPU:
// the tile scales' layouts against cuBLASLt's documentation, written here from its text (VEC128_32F M-major,
// BLK128x128_32F K-major with a column stride of a multiple of 4, VEC32_UE8M0's 128x4 tiles and their in-tile
// offsets); the plan's refusals of what cuBLASLt refuses under block scales (m or n not a multiple of 4 under the
// fp32 tiles, scales off 16 bytes, E8M0 beside another mode), and Fp8Scaling::runs, which must send to bf16 every
// layer GEMM the plan would refuse and no other; the CPU's fallback itself (the fp32 bits). On a GPU: each cast
// kernel bit for bit against the CPU's cast (fp8_quantize_tiles), its scales at their layout's indices and mxfp8's
// padding zero; each block-scaled GEMM through fp8_gemm against the CPU emulation; the recipes refused where
// cuBLASLt has no kernels for them.
#include <omp.h>

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

// the plan of a layer GEMM under recipe r as fp8_gemm asks for it (E4M3 operands but tensorwise's gradients,
// aligned pointers)
Fp8GemmPlan layer_plan(Fp8Recipe r, Fp8Operand a, Fp8Operand b, long m, long n, long k, GemmPass pass) {
    Fp8Scaling<bf16> q;
    q.recipe = r;
    cudaDataType_t grad = fp8_cuda_type(q.grad_format());
    return fp8_gemm_plan({CUBLASLT_EPILOGUE_DEFAULT, pass, a == FP8_GRAD ? grad : CUDA_R_8F_E4M3,
                          b == FP8_GRAD || b == FP8_GRAD_T ? grad : CUDA_R_8F_E4M3, true, false, m, n, k, 256, 256, 256,
                          q.mode(a), q.mode(b)});
}

TEST_CASE("fp8 GEMM plan, block scales: m and n multiples of 4 under the fp32 tiles, scales 16-byte aligned, E8M0 with "
          "E8M0 alone; Fp8Scaling::runs sends to bf16 exactly the layer GEMMs the plan refuses",
          "[fp8]") {
    auto plan = [](int mode_a, int mode_b, long m, long n, long k, int align_scale_a = 256, int align_scale_b = 256) {
        Fp8GemmRequest r{CUBLASLT_EPILOGUE_DEFAULT, GemmPass::Forward, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, true, false, m, n, k,
                         256, 256, 256, mode_a, mode_b};
        r.align_scale_a = align_scale_a, r.align_scale_b = align_scale_b;
        return fp8_gemm_plan(r);
    };
    const int VEC128 = FP8_SCALE_VEC128, BLK = FP8_SCALE_BLK128, E8M0 = FP8_SCALE_VEC32_E8M0, TENSOR = FP8_SCALE_TENSOR;
    CHECK(plan(BLK, VEC128, 256, 36, 256).refused.empty());
    CHECK(plan(VEC128, BLK, 256, 36, 256).refused.empty());
    Fp8GemmPlan odd = plan(BLK, VEC128, 256, 38, 256);
    CHECK(odd.refused.find("multiples of 4") != std::string::npos);
    CHECK(!plan(VEC128, VEC128, 256, 38, 256).refused.empty());
    CHECK(plan(E8M0, E8M0, 256, 38, 256).refused.empty());     // E8M0's tiles pad the rows to 128
    CHECK(plan(TENSOR, TENSOR, 256, 38, 256).refused.empty());  // one scale per tensor: no rule on n
    CHECK(plan(BLK, VEC128, 256, 36, 256, 16, 16).refused.empty());
    CHECK(plan(BLK, VEC128, 256, 36, 256, 8, 256).refused.find("16-byte aligned") != std::string::npos);
    CHECK(!plan(E8M0, E8M0, 256, 36, 256, 256, 4).refused.empty());
    CHECK(!plan(E8M0, VEC128, 256, 36, 256).refused.empty());
    CHECK(!plan(VEC128, E8M0, 256, 36, 256).refused.empty());
    // runs against the plans of the layer's three GEMMs (fp8_matmul_forward and _backward on the GPU), for every
    // token count up to 64 and a weight of whole tiles: the fallback is where the plan would stop the run, and only
    // there
    const long C = 256, OC = 384;
    for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise, Fp8Recipe::Mxfp8}) {
        Fp8Scaling<bf16> q;
        q.recipe = r, q.speaks = false;
        long disagree = 0, fallbacks = 0;
        for (long N = 1; N <= 64; N++) {
            bool planned = layer_plan(r, FP8_WEIGHT, FP8_INPUT, OC, N, C, GemmPass::Forward).refused.empty() &&
                           layer_plan(r, FP8_WEIGHT, FP8_GRAD, C, N, OC, GemmPass::Backward).refused.empty() &&
                           layer_plan(r, FP8_INPUT, FP8_GRAD_T, C, OC, q.padded(N), GemmPass::Backward).refused.empty();
            disagree += q.runs(N, OC, C) != planned;
            fallbacks += !q.runs(N, OC, C);
        }
        INFO(fp8_recipe_name(r));
        CHECK(disagree == 0);
        CHECK(fallbacks == (r == Fp8Recipe::Blockwise ? 48 : 0));
        CHECK(!q.runs(64, OC + 16, C) == (r != Fp8Recipe::Tensorwise));  // and a weight of partial tiles, whatever N
    }
}

TEST_CASE("fp8 recipes on the CPU: a blockwise layer over a token count that is no multiple of 4 runs in fp32, its bits "
          "those of the layer without FP8; over a multiple of 4, and under mxfp8 over any, the recipe runs", "[fp8]") {
    const long C = 256, OC = 128;
    std::vector<float> panels(gemm_workspace_floats(omp_get_max_threads()));
    Workspace ws{panels.data(), panels.size()};
    for (Fp8Recipe r : BLOCK_RECIPES)
        for (long N : {6L, 8L}) {
            INFO(fp8_recipe_name(r) << ", " << N << " tokens");
            Rng rng(21 + N);
            std::vector<float> x = random_vector(N * C, rng), w = random_vector(OC * C, rng, 0.2f),
                               bias = random_vector(OC, rng), dout = random_vector(N * OC, rng, 1e-3f),
                               dw0 = random_vector(OC * C, rng);
            std::vector<float> input(N * C), weight(OC * C), grad(N * OC), grad_t(N * OC), scales(FP8_SCALE_FLOATS + 1);
            Fp8Scaling<float> q;
            q.recipe = r, q.speaks = false;
            q.input = input.data(), q.weight = weight.data(), q.grad = grad.data(), q.grad_t = grad_t.data();
            q.scales = scales.data(), q.amaxes = scales.data() + FP8_SCALE_FLOATS;
            std::vector<float> out(N * OC), plain(N * OC), dinp(N * C), plain_dinp(N * C), dw = dw0, plain_dw = dw0;
            matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, C, OC, ws, &q);
            matmul_forward(plain.data(), x.data(), w.data(), bias.data(), N, C, OC, ws);
            matmul_backward(dinp.data(), dw.data(), (float*)nullptr, dout.data(), x.data(), w.data(), N, C, OC, ws, &q);
            matmul_backward(plain_dinp.data(), plain_dw.data(), nullptr, dout.data(), x.data(), w.data(), N, C, OC, ws);
            bool fallback = r == Fp8Recipe::Blockwise && N % 4 != 0;
            CHECK((out == plain) == fallback);
            CHECK((dinp == plain_dinp) == fallback);
            CHECK((dw == plain_dw) == fallback);
        }
}

// ----------------------------------------------------------------------------------------------------------
// on a GPU

// whether the scale the GPU stored at `at` is the one of a tile of amax `amax`: mxfp8's E8M0 byte, blockwise's
// inverse scale (bit for bit, any NaN for a NaN)
bool scale_matches(const std::vector<uint8_t>& scales, long at, float amax, Fp8Recipe r) {
    if (r == Fp8Recipe::Mxfp8) return scales[at] == fp8_e8m0(amax);
    float scale, inverse;
    fp8_tile_scale(&scale, &inverse, amax, r);
    return fp8_same_bits(fp8_stored_inverse(scales, at, r), inverse);
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
                        fp8_stored_inverse(scales, scale_index(i / tile_rows, j / tile_cols), r);
            c.differ += !fp8_same_bits(got, cpu[i * cols + j]);
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

// A layer's GEMMs under recipe r through the model's entry points (fp8_gemm with the recipe's scale modes) against
// the CPU emulation on the same bf16 values: the forward with its bias (a kernel of its own under block scales) and
// with GELU, the input and weight gradients (the weight gradient summed over tokens padded to a whole tile and added
// to what was there), the bias gradient. Both sum the same codes times the same scales in fp32; the GPU's output is
// rounded to bf16 (2^-9), so 1e-2 of each value (and of the reference's RMS) holds it, and GELU's 2e-2 its bf16
// input; the tolerance tells the recipe from bf16, whose GEMMs lie farther from the emulation than that.
void check_block_gemms(Fp8Recipe r) {
    struct Shape {
        long N, C, OC;
    };
    // N: a partial tile of tokens, a multiple of 4 but of no tile, and (blockwise) a count that is no multiple of 4,
    // which runs in bf16 on the GPU and fp32 on the CPU
    for (Shape s : {Shape{40, 256, 128}, Shape{200, 384, 256}, Shape{42, 256, 128}}) {
        const long N = s.N, C = s.C, OC = s.OC;
        INFO(fp8_recipe_name(r) << ": N " << N << " C " << C << " OC " << OC);
        Rng rng(41 + N);
        std::vector<float> x = random_bf16_values(N * C, rng), w = random_bf16_values(OC * C, rng, 0.2f),
                           bias = random_bf16_values(OC, rng), dout = random_bf16_values(N * OC, rng, 1e-3f),
                           dw0 = random_bf16_values(OC * C, rng), db0 = random_bf16_values(OC, rng);
        x[3 * C + 10] = 40.0f, dout[7 * OC + 5] = 0.25f;  // outliers, which the tiles keep to themselves
        // the CPU emulation
        std::vector<float> input(N * C), weight(OC * C), grad(N * OC), grad_t(N * OC), floats(FP8_SCALE_FLOATS + 1);
        Fp8Scaling<float> cpu;
        cpu.recipe = r, cpu.speaks = false;
        cpu.input = input.data(), cpu.weight = weight.data(), cpu.grad = grad.data(), cpu.grad_t = grad_t.data();
        cpu.scales = floats.data(), cpu.amaxes = floats.data() + FP8_SCALE_FLOATS;
        std::vector<float> panels(gemm_workspace_floats(omp_get_max_threads()));
        Workspace ws{panels.data(), panels.size()};
        std::vector<float> out(N * OC), pre(N * OC), act(N * OC), dinp(N * C), dweight = dw0, dbias = db0, plain(N * OC);
        matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, C, OC, ws, &cpu);
        matmul_gelu_forward(act.data(), pre.data(), x.data(), w.data(), bias.data(), N, C, OC, ws, &cpu);
        matmul_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), x.data(), w.data(), N, C, OC, ws, &cpu);
        matmul_forward(plain.data(), x.data(), w.data(), bias.data(), N, C, OC, ws);
        const bool runs = cpu.runs(N, OC, C);
        CHECK(runs == (r != Fp8Recipe::Blockwise || N % 4 == 0));
        if (runs) CHECK(!compare_rms(plain, out, 1e-2).pass());  // the recipe is not the unquantized GEMM
        // the GPU
        Fp8Sizes z = fp8_sizes(N, C, std::max(C, OC), (size_t)OC * C, 1, Device::CUDA, r);
        DeviceArray<uint8_t> d_input(z.input), d_weight(z.weight), d_grad(z.grad), d_grad_t(z.grad_t);
        std::vector<std::unique_ptr<DeviceArray<uint8_t>>> tiles;
        DeviceArray<float> d_floats(z.floats), scratch(matmul_backward_scratch_floats(N, OC));
        Workspace gpu_workspace{scratch.ptr, scratch.n};
        Fp8Scaling<bf16> q;
        q.recipe = r, q.speaks = false;
        q.input = d_input.ptr, q.weight = d_weight.ptr, q.grad = d_grad.ptr, q.grad_t = d_grad_t.ptr;
        q.scales = d_floats.ptr, q.amaxes = d_floats.ptr + FP8_SCALE_FLOATS;
        for (int o = 0; o < 4; o++) {
            REQUIRE(z.tiles[o] > 0);
            tiles.emplace_back(new DeviceArray<uint8_t>(z.tiles[o]));
            q.tiles[o] = tiles.back()->ptr;
        }
        DeviceArray<bf16> d_x(N * C), d_w(OC * C), d_bias(OC), d_dout(N * OC), d_out(N * OC), d_pre(N * OC), d_dinp(N * C),
            d_dw(OC * C), d_db(OC);
        upload(d_x, x), upload(d_w, w), upload(d_bias, bias), upload(d_dout, dout), upload(d_dw, dw0), upload(d_db, db0);
        auto check = [](const char* what, const std::vector<float>& gpu, const std::vector<float>& emulated, double tol) {
            Comparison c = compare_rms(gpu, emulated, tol);
            INFO(what << ": max error " << c.max_abs << ", " << c.worst_ratio << " of tolerance " << tol);
            CHECK(c.pass());
        };
        matmul_forward(d_out.ptr, d_x.ptr, d_w.ptr, d_bias.ptr, N, C, OC, gpu_workspace, &q);
        check("forward with bias", download(d_out), out, 1e-2);
        d_out.poison(), d_pre.poison();
        matmul_gelu_forward(d_out.ptr, d_pre.ptr, d_x.ptr, d_w.ptr, d_bias.ptr, N, C, OC, gpu_workspace, &q);
        check("forward before GELU", download(d_pre), pre, 1e-2);
        check("GELU", download(d_out), act, 2e-2);
        matmul_backward(d_dinp.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_x.ptr, d_w.ptr, N, C, OC, gpu_workspace, &q);
        check("input gradient", download(d_dinp), dinp, 1e-2);
        check("weight gradient (accumulated)", download(d_dw), dweight, 1e-2);
        check("bias gradient (accumulated)", download(d_db), dbias, 1e-2);
    }
}

// the first lines of a block recipe's GPU case: skipped without a GPU, or (one line saying why) where cuBLASLt has
// no kernels for the recipe: blockwise off compute capability 9.0, mxfp8 below 10.0
bool recipe_runs_here(Fp8Recipe r) {
    if (!cuda_device_available()) {
        skip_case("no GPU");
        return false;
    }
    std::string why = fp8_gpu_problem(r);
    if (!why.empty()) skip_case(why);
    return why.empty();
}

TEST_CASE("CUDA fp8 blockwise GEMMs: cuBLASLt's 1x128 and 128x128 scales on Hopper match the CPU emulation, forward "
          "with bias and GELU, input and weight gradients, the bias gradient; a token count that is no multiple of 4 "
          "falls back on both devices", "[cuda][fp8]") {
    if (recipe_runs_here(Fp8Recipe::Blockwise)) check_block_gemms(Fp8Recipe::Blockwise);
}

TEST_CASE("CUDA fp8 mxfp8 GEMMs: cuBLASLt's E8M0 scales per 32 values on Blackwell match the CPU emulation, forward "
          "with bias and GELU, input and weight gradients, the bias gradient", "[cuda][fp8]") {
    if (recipe_runs_here(Fp8Recipe::Mxfp8)) check_block_gemms(Fp8Recipe::Mxfp8);
}

TEST_CASE("CUDA fp8 recipes: refused in one line where cuBLASLt has no kernels for them, blockwise off compute "
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
