// The FP8 block recipes (llmc/fp8_blocks.cuh, llmc/fp8.cuh) at llama3-1b's shapes: C = 2048, the MLP's hidden
// 8192, 16384 tokens a step (B=16, T=1024). First the casts: along the rows, down the columns (transposed, the
// weight gradient's operands, zero past the rows) and in 128x128 blocks (blockwise's weights, in place and
// transposed), under blockwise and mxfp8, bit for bit against the CPU's fp8_quantize_tiles (codes decoded and
// unscaled at their scales' layout indices; on the first 2048 tokens of each activation, the whole weights), then
// timed against the copy bandwidth, beside tensorwise's cast of the same tensor (its amax, then the codes and their
// transposed copy). Then the GEMMs of the MLP's two matmuls under each recipe this GPU runs (tensorwise from compute
// capability 8.9, blockwise on 9.0, mxfp8 from 10.0): the layer through the model's entry points against the CPU
// emulation on 256 tokens, then each GEMM alone (forward, input gradient, weight gradient) timed against bf16's, and
// the layer each way with its casts against bf16's.
#include <omp.h>

#include "dev/cuda/common.h"
#include "llmc/fp8.cuh"

constexpr long C = 2048, H = 8192, TOKENS = 16384, CHECK_TOKENS = 2048, GEMM_CHECK_TOKENS = 256;
const Fp8Recipe BLOCK_RECIPES[] = {Fp8Recipe::Blockwise, Fp8Recipe::Mxfp8};

long ceil_div(long a, long b) { return (a + b - 1) / b; }

// how many of x's values the GPU's codes (at code_at(i, j), unscaled by the inverse at scale_at(tile row, tile
// column)) do not give bit for bit as the CPU's cast in tiles of tile_rows × tile_cols does
template <typename CodeAt, typename ScaleAt>
long cast_differences(const std::vector<float>& x, long rows, long cols, long tile_rows, long tile_cols,
                      const std::vector<uint8_t>& codes, const std::vector<uint8_t>& scales, Fp8Recipe r, CodeAt code_at,
                      ScaleAt scale_at) {
    std::vector<float> cpu(rows * cols);
    fp8_quantize_tiles(cpu.data(), x.data(), rows, cols, tile_rows, tile_cols, r);
    long differ = 0;
#pragma omp parallel for reduction(+ : differ)
    for (long i = 0; i < rows; i++)
        for (long j = 0; j < cols; j++) {
            float got = fp8_decode(codes[code_at(i, j)], Fp8Format::E4M3) *
                        fp8_stored_inverse(scales, scale_at(i / tile_rows, j / tile_cols), r);
            differ += !fp8_same_bits(got, cpu[i * cols + j]);
        }
    return differ;
}

// ------------------------------------------------------------------------------------------------------------
// the casts

// an activation of TOKENS × cols (the first CHECK_TOKENS rows checked) cast along its rows and down its columns
void activation_casts(Checks& checks, const Program& program, const std::vector<float>& x, const DeviceArray<bf16>& d_x,
                      long cols) {
    const long n = TOKENS * cols;
    // tensorwise, the reference: the amax, then the codes and their transposed copy in one pass
    DeviceArray<float> amax(1), pair(2);
    DeviceArray<uint8_t> out(n), out_t(n);
    if (program.gpu) {
        TimingCopies<bf16> inputs(d_x, timing_sets(4.0 * n));
        float ms = median_ms(
            [&](int s) {
                fp8_amax(amax.ptr, inputs[s], n);
                fp8_make_scale(pair.ptr, amax.ptr, 1, Fp8Format::E4M3, inputs[s]);
                fp8_quantize(out.ptr, out_t.ptr, inputs[s], TOKENS, cols, TOKENS, pair.ptr, Fp8Format::E4M3);
            },
            inputs.copies.size());
        report_memory_bound(strfmt("tensorwise amax + cast + transposed %ldx%ld", TOKENS, cols), ms, 6.0 * n);
    }
    for (Fp8Recipe r : BLOCK_RECIPES) {
        const long L = fp8_tile(r), ktiles = ceil_div(cols, L), ktiles_t = ceil_div(TOKENS, L);
        const char* name = fp8_recipe_name(r);
        DeviceArray<uint8_t> scales(fp8_scale_bytes(r, false, TOKENS, cols)), scales_t(fp8_scale_bytes(r, false, cols, TOKENS));
        if (!program.gpu) {  // the CPU side alone: the references the checks compare with
            std::vector<float> cpu(CHECK_TOKENS * cols);
            fp8_quantize_tiles(cpu.data(), x.data(), CHECK_TOKENS, cols, 1, L, r);
            fp8_quantize_tiles(cpu.data(), x.data(), CHECK_TOKENS, cols, L, 1, r);
            continue;
        }
        // checked on the first CHECK_TOKENS rows (the same kernels; the CPU's cast of all 16384 would be most of
        // the program's time)
        fp8_quantize_rows(out.ptr, scales.ptr, d_x.ptr, CHECK_TOKENS, cols, r);
        long differ = cast_differences(
            x, CHECK_TOKENS, cols, 1, L, download(out), download(scales), r, [&](long i, long j) { return i * cols + j; },
            [&](long ti, long tj) { return fp8_scale_index(r, false, ti, tj, CHECK_TOKENS, ktiles); });
        checks.require(strfmt("%s rows %ldx%ld: %ld values differ", name, CHECK_TOKENS, cols, differ), differ == 0);
        fp8_quantize_cols(out_t.ptr, scales_t.ptr, d_x.ptr, CHECK_TOKENS, cols, CHECK_TOKENS, r);
        differ = cast_differences(
            x, CHECK_TOKENS, cols, L, 1, download(out_t), download(scales_t), r,
            [&](long i, long j) { return j * CHECK_TOKENS + i; },
            [&](long ti, long tj) { return fp8_scale_index(r, false, tj, ti, cols, ceil_div(CHECK_TOKENS, L)); });
        checks.require(strfmt("%s columns %ldx%ld: %ld values differ", name, CHECK_TOKENS, cols, differ), differ == 0);
        // timed on all the tokens: 2 bytes read and 1 written a value, and the scales
        TimingCopies<bf16> inputs(d_x, timing_sets(3.0 * n));
        float ms = median_ms([&](int s) { fp8_quantize_rows(out.ptr, scales.ptr, inputs[s], TOKENS, cols, r); },
                             inputs.copies.size());
        report_memory_bound(strfmt("%s rows %ldx%ld (%ld tiles a row)", name, TOKENS, cols, ktiles), ms,
                            3.0 * n + scales.bytes());
        ms = median_ms([&](int s) { fp8_quantize_cols(out_t.ptr, scales_t.ptr, inputs[s], TOKENS, cols, TOKENS, r); },
                       inputs.copies.size());
        report_memory_bound(strfmt("%s columns %ldx%ld (%ld tiles a column)", name, TOKENS, cols, ktiles_t), ms,
                            3.0 * n + scales_t.bytes());
    }
}

// blockwise's weight of rows × cols in 128x128 blocks: in place (the forward) and transposed (the input gradient)
void weight_casts(Checks& checks, const Program& program, const std::vector<float>& w, const DeviceArray<bf16>& d_w,
                  long rows, long cols) {
    const Fp8Recipe r = Fp8Recipe::Blockwise;
    const long n = rows * cols, block_rows = ceil_div(rows, FP8_BLOCK), block_cols = ceil_div(cols, FP8_BLOCK);
    DeviceArray<uint8_t> out(n), out_t(n), scales(fp8_scale_bytes(r, true, rows, cols)),
        scales_t(fp8_scale_bytes(r, true, cols, rows));
    float* s = reinterpret_cast<float*>(scales.ptr);
    float* s_t = reinterpret_cast<float*>(scales_t.ptr);
    if (!program.gpu) {
        std::vector<float> cpu(n);
        fp8_quantize_tiles(cpu.data(), w.data(), rows, cols, FP8_BLOCK, FP8_BLOCK, r);
        return;
    }
    fp8_quantize_blocks(out.ptr, s, out_t.ptr, s_t, d_w.ptr, rows, cols);
    std::vector<uint8_t> codes = download(out), codes_t = download(out_t);
    long differ = cast_differences(
        w, rows, cols, FP8_BLOCK, FP8_BLOCK, codes, download(scales), r, [&](long i, long j) { return i * cols + j; },
        [&](long ti, long tj) { return fp8_scale_index(r, true, ti * FP8_BLOCK, tj, rows, block_cols); });
    differ += cast_differences(
        w, rows, cols, FP8_BLOCK, FP8_BLOCK, codes_t, download(scales_t), r, [&](long i, long j) { return j * rows + i; },
        [&](long ti, long tj) { return fp8_scale_index(r, true, tj * FP8_BLOCK, ti, cols, block_rows); });
    checks.require(strfmt("blockwise blocks %ldx%ld and transposed: %ld values differ", rows, cols, differ), differ == 0);
    TimingCopies<bf16> inputs(d_w, timing_sets(3.0 * n));
    float ms = median_ms([&](int k) { fp8_quantize_blocks(out.ptr, s, nullptr, nullptr, inputs[k], rows, cols); },
                         inputs.copies.size());
    report_memory_bound(strfmt("blockwise blocks %ldx%ld", rows, cols), ms, 3.0 * n);
    ms = median_ms([&](int k) { fp8_quantize_blocks(nullptr, nullptr, out_t.ptr, s_t, inputs[k], rows, cols); },
                   inputs.copies.size());
    report_memory_bound(strfmt("blockwise blocks %ldx%ld, transposed", rows, cols), ms, 3.0 * n);
}

// ------------------------------------------------------------------------------------------------------------
// the GEMMs

// a recipe's FP8 state on the GPU for layers of up to TOKENS tokens and widths up to H, its buffers with it
struct GpuFp8 {
    Fp8Sizes z;
    DeviceArray<uint8_t> input, weight, grad, grad_t, tiles0, tiles1, tiles2, tiles3;
    DeviceArray<float> floats;
    Fp8Scaling<bf16> q;
    explicit GpuFp8(Fp8Recipe r)
        : z(fp8_sizes(TOKENS, H, H, (size_t)H * C, 1, Device::CUDA, r)), input(z.input), weight(z.weight), grad(z.grad),
          grad_t(z.grad_t), tiles0(z.tiles[0]), tiles1(z.tiles[1]), tiles2(z.tiles[2]), tiles3(z.tiles[3]),
          floats(z.floats) {
        q.recipe = r;
        q.input = input.ptr, q.weight = weight.ptr, q.grad = grad.ptr, q.grad_t = grad_t.ptr;
        q.scales = floats.ptr, q.amaxes = floats.ptr + FP8_SCALE_FLOATS;
        if (r == Fp8Recipe::Tensorwise) return;
        q.tiles[0] = tiles0.ptr, q.tiles[1] = tiles1.ptr, q.tiles[2] = tiles2.ptr, q.tiles[3] = tiles3.ptr;
    }
};

// the layer out[N×OC] = inp · Wᵀ (the MLP's up projection, C → H) and its gradients on GEMM_CHECK_TOKENS tokens
// through the model's entry points, against the CPU emulation: both sum the same codes times the same scales in
// fp32, the GPU's outputs rounded to bf16, so 1e-2 holds them (as test/test_fp8_recipes.cu)
void check_layer(Checks& checks, const Program& program, Fp8Recipe r) {
    if (program.gpu && !fp8_gpu_problem(r).empty()) return;  // (time_layer says why)
    const long N = GEMM_CHECK_TOKENS, OC = H;
    Rng rng(61);
    std::vector<float> x = random_bf16_values(N * C, rng), w = random_bf16_values(OC * C, rng, 0.02f),
                       dout = random_bf16_values(N * OC, rng, 1e-3f), dw0 = random_bf16_values(OC * C, rng, 1e-3f);
    std::vector<float> input(N * std::max(C, OC)), weight(OC * C), grad(N * OC), grad_t(N * OC), floats(FP8_SCALE_FLOATS + 1);
    Fp8Scaling<float> cpu;
    cpu.recipe = r;
    cpu.input = input.data(), cpu.weight = weight.data(), cpu.grad = grad.data(), cpu.grad_t = grad_t.data();
    cpu.scales = floats.data(), cpu.amaxes = floats.data() + FP8_SCALE_FLOATS;
    std::vector<float> panels(gemm_workspace_floats(omp_get_max_threads()));
    Workspace ws{panels.data(), panels.size()};
    std::vector<float> out(N * OC), dinp(N * C), dweight = dw0;
    matmul_forward(out.data(), x.data(), w.data(), (const float*)nullptr, N, C, OC, ws, &cpu);
    matmul_backward(dinp.data(), dweight.data(), (float*)nullptr, dout.data(), x.data(), w.data(), N, C, OC, ws, &cpu);
    if (!program.gpu) return;
    GpuFp8 g(r);
    DeviceArray<bf16> d_x(N * C), d_w(OC * C), d_dout(N * OC), d_out(N * OC), d_dinp(N * C), d_dw(OC * C);
    upload(d_x, x), upload(d_w, w), upload(d_dout, dout), upload(d_dw, dw0);
    matmul_forward(d_out.ptr, d_x.ptr, d_w.ptr, (const bf16*)nullptr, N, C, OC, Workspace{}, &g.q);
    matmul_backward(d_dinp.ptr, d_dw.ptr, (bf16*)nullptr, d_dout.ptr, d_x.ptr, d_w.ptr, N, C, OC, Workspace{}, &g.q);
    const char* name = fp8_recipe_name(r);
    checks.check(strfmt("%s forward N=%ld C=%ld OC=%ld", name, N, C, OC), download(d_out), out, 1e-2);
    checks.check(strfmt("%s input gradient", name), download(d_dinp), dinp, 1e-2);
    checks.check(strfmt("%s weight gradient (+=)", name), download(d_dw), dweight, 1e-2);
}

// the layer inp[TOKENS×IC] → out[TOKENS×OC] timed: each of its three GEMMs alone (the operands cast once
// beforehand, the calls fp8_matmul_forward and _backward make), then the layer forward and backward with its casts,
// under each recipe this GPU runs and in bf16
void time_layer(long IC, long OC, const DeviceArray<bf16>& inp, const DeviceArray<bf16>& w, const DeviceArray<bf16>& dout,
                DeviceArray<bf16>& out, DeviceArray<bf16>& dinp, DeviceArray<bf16>& dw) {
    const long N = TOKENS;
    const double flops = 2.0 * N * IC * OC;
    printf("-- %ld tokens, %ld -> %ld\n", N, IC, OC);
    float bf16_forward = time_ms([&] { matmul_forward(out.ptr, inp.ptr, w.ptr, nullptr, N, IC, OC, Workspace{}); });
    float bf16_dinp = time_ms([&] { matmul_backward(dinp.ptr, nullptr, nullptr, dout.ptr, inp.ptr, w.ptr, N, IC, OC, Workspace{}); });
    float bf16_dweight = time_ms([&] { matmul_backward(nullptr, dw.ptr, nullptr, dout.ptr, inp.ptr, w.ptr, N, IC, OC, Workspace{}); });
    report_compute_bound("bf16 forward", bf16_forward, flops);
    report_compute_bound("bf16 input gradient", bf16_dinp, flops);
    report_compute_bound("bf16 weight gradient", bf16_dweight, flops);
    for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise, Fp8Recipe::Mxfp8}) {
        const char* name = fp8_recipe_name(r);
        std::string why = fp8_gpu_problem(r);
        if (!why.empty()) {
            printf("%s: not on this GPU (%s)\n", name, why.c_str());
            continue;
        }
        GpuFp8 g(r);
        const Fp8Scaling<bf16>& q = g.q;
        long padded = q.padded(N);
        fp8_cast_forward(q, inp.ptr, w.ptr, N, IC, OC);
        float ms = time_ms([&] {
            fp8_gemm(out.ptr, {q.weight, Fp8Format::E4M3, q.unscale(FP8_WEIGHT), q.mode(FP8_WEIGHT)},
                     {q.input, Fp8Format::E4M3, q.unscale(FP8_INPUT), q.mode(FP8_INPUT)}, OC, N, IC, 0.0f,
                     CUBLASLT_EPILOGUE_DEFAULT, GemmPass::Forward);
        });
        report_compute_bound(strfmt("%s forward GEMM (%.2fx bf16)", name, bf16_forward / ms), ms, flops);
        fp8_cast_backward(q, dout.ptr, inp.ptr, w.ptr, N, IC, OC, padded, true, true);
        ms = time_ms([&] {
            fp8_gemm(dinp.ptr, {q.weight, Fp8Format::E4M3, q.unscale(FP8_WEIGHT), q.mode(FP8_WEIGHT)},
                     {q.grad, q.grad_format(), q.unscale(FP8_GRAD), q.mode(FP8_GRAD)}, IC, N, OC, 0.0f,
                     CUBLASLT_EPILOGUE_DEFAULT, GemmPass::Backward);
        });
        report_compute_bound(strfmt("%s input gradient GEMM (%.2fx bf16)", name, bf16_dinp / ms), ms, flops);
        ms = time_ms([&] {
            fp8_gemm(dw.ptr, {q.input, Fp8Format::E4M3, q.unscale(FP8_INPUT), q.mode(FP8_INPUT)},
                     {q.grad_t, q.grad_format(), q.unscale(FP8_GRAD_T), q.mode(FP8_GRAD_T)}, IC, OC, padded, 1.0f,
                     CUBLASLT_EPILOGUE_DEFAULT, GemmPass::Backward);
        });
        report_compute_bound(strfmt("%s weight gradient GEMM (%.2fx bf16)", name, bf16_dweight / ms), ms, flops);
        // the layer with its casts, as a step runs it
        float forward =
            time_ms([&] { matmul_forward(out.ptr, inp.ptr, w.ptr, (const bf16*)nullptr, N, IC, OC, Workspace{}, &q); });
        float backward = time_ms(
            [&] { matmul_backward(dinp.ptr, dw.ptr, (bf16*)nullptr, dout.ptr, inp.ptr, w.ptr, N, IC, OC, Workspace{}, &q); });
        report_compute_bound(strfmt("%s layer forward, casts in (%.2fx bf16)", name, bf16_forward / forward), forward, flops);
        report_compute_bound(strfmt("%s layer backward, casts in (%.2fx bf16)", name, (bf16_dinp + bf16_dweight) / backward),
                             backward, 2.0 * flops);
    }
}

int main() {
    Program program(
        "fp8_blocks: the FP8 block recipes' casts (rows, columns, 128x128 blocks) bit for bit against the CPU and timed "
        "beside tensorwise's; their GEMMs against the CPU emulation and timed against bf16, at llama3-1b's shapes");
    Checks checks;
    Rng rng(60);
    // the activations (C and H wide) and the MLP's weights, with an outlier and a zero row in the checked rows
    std::vector<float> x = random_bf16_values(TOKENS * C, rng), h = random_bf16_values(TOKENS * H, rng),
                       w_up = random_bf16_values(H * C, rng, 0.02f), w_down = random_bf16_values(C * H, rng, 0.02f),
                       dout_up = random_bf16_values(TOKENS * H, rng, 1e-3f),
                       dout_down = random_bf16_values(TOKENS * C, rng, 1e-3f);
    x[100 * C + 7] = 1024.0f, h[200 * H + 300] = -4096.0f;
    for (long j = 0; j < C; j++) x[5 * C + j] = 0.0f;
    DeviceArray<bf16> d_x(TOKENS * C), d_h(TOKENS * H), d_up(H * C), d_down(C * H), d_dout_up(TOKENS * H),
        d_dout_down(TOKENS * C);
    upload(d_x, x), upload(d_h, h), upload(d_up, w_up), upload(d_down, w_down), upload(d_dout_up, dout_up),
        upload(d_dout_down, dout_down);
    activation_casts(checks, program, x, d_x, C);
    activation_casts(checks, program, h, d_h, H);
    weight_casts(checks, program, w_up, d_up, H, C);
    weight_casts(checks, program, w_down, d_down, C, H);
    for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise, Fp8Recipe::Mxfp8}) check_layer(checks, program, r);
    if (program.gpu) {
        DeviceArray<bf16> out_up(TOKENS * H), dinp_up(TOKENS * C), dw_up(H * C), out_down(TOKENS * C),
            dinp_down(TOKENS * H), dw_down(C * H);
        time_layer(C, H, d_x, d_up, d_dout_up, out_up, dinp_up, dw_up);
        time_layer(H, C, d_h, d_down, d_dout_down, out_down, dinp_down, dw_down);
    }
    return program.finish(checks);
}
