// Each CUDA kernel against the CPU reference in the same llmc header, on random bf16 inputs with the outputs
// poisoned (NaN bytes) beforehand, on small and odd shapes, so that rows, tiles and vector widths do not line
// up, and the deterministic kernels run twice for the same bits. Tolerances are bf16's. Without a GPU every
// case says "skipped: no GPU" and counts as skipped (the wgmma attention's, on a GPU other than Hopper, "skipped: not
// Hopper"), except the host-side precondition checks, the emulations of the attention's mma and wgmma fragment
// and shared-memory layouts on the CPU, the choices of the matmul backward's epilogues and of the attention
// kernels, and the experts' grouped GEMM descriptors run on the CPU, which run anywhere.
// dev/cuda/ runs the same checks on GPT-2-sized shapes and times them; the inputs and CPU reference runs they share
// are dev/cuda/*_case.h's.
#include <array>
#include <utility>

#include "dev/cuda/adamw_case.h"
#include "dev/cuda/attention_case.h"
#include "dev/cuda/classifier_case.h"
#include "dev/cuda/encoder_case.h"
#include "dev/cuda/experts_case.h"
#include "dev/cuda/norm_case.h"
#include "dev/cuda/matmul_case.h"
#include "llmc/gelu.cuh"
#include "llmc/global_norm.cuh"
#include "test/test_helpers.h"

namespace test_cuda_kernels {

void require_close(const char* what, const std::vector<float>& gpu, const std::vector<float>& cpu, double tol) {
    Comparison c = compare_rms(gpu, cpu, tol);
    INFO(what << ": max error " << c.max_abs << ", " << c.worst_ratio << " of tolerance");
    REQUIRE(c.pass());
}

void check_encoder(int B, int T, int C, int V) {
    EncoderCase k(B, T, C, V, 11, 3, 1.0f);  // three hot tokens: many repeats
    k.gpu_forward();
    require_close("encoder out", download(k.d_out), k.out, 1e-2);
    k.gpu_backward();
    std::vector<float> dwte = download(k.d_dwte), dwpe = download(k.d_dwpe);
    require_close("encoder dwte", dwte, k.dwte, 2e-2);
    require_close("encoder dwpe", dwpe, k.dwpe, 2e-2);
    k.reset_grads();
    k.gpu_backward();
    REQUIRE(download(k.d_dwte) == dwte);  // bit-reproducible
    REQUIRE(download(k.d_dwpe) == dwpe);
}

void check_layernorm(long N, int C) {
    NormCase k(Norm::LayerNorm, N, C, 1e-5f, 12);
    k.gpu_fused_forward();
    require_close("residual", download(k.d_res), k.res, 1e-2);
    require_close("layernorm out", download(k.d_out), k.out, 2e-2);
    require_close("mean", download(k.d_mean), k.mean, 1e-3);
    require_close("rstd", download(k.d_rstd), k.rstd, 1e-3);
    k.d_out.poison();
    k.gpu_fused_forward_in_place();
    require_close("residual updated in place", download(k.d_res), k.res, 1e-2);
    require_close("layernorm out, residual in place", download(k.d_out), k.out, 2e-2);
    k.d_out.poison();
    k.gpu_forward();
    require_close("plain layernorm out", download(k.d_out), k.out, 2e-2);
    k.use_cpu_stats();
    k.gpu_backward();
    std::vector<float> dinp = download(k.d_dinp), dw = download(k.d_dw), db = download(k.d_db);
    require_close("layernorm dinp", dinp, k.dinp, 2e-2);
    require_close("layernorm dweight", dw, k.dweight, 2e-2);
    require_close("layernorm dbias", db, k.dbias, 2e-2);
    k.reset_grads();
    k.gpu_backward();
    REQUIRE(download(k.d_dinp) == dinp);  // bit-reproducible
    REQUIRE(download(k.d_dw) == dw);
    REQUIRE(download(k.d_db) == db);
}

void check_matmul(long N, long C, long OC) {
    MatmulCase k(N, C, OC, 13, 0.1f);
    k.gpu_forward();
    require_close("matmul out", download(k.d_out), k.out, 2e-2);
    k.d_out.poison();
    k.gpu_forward_gelu();
    require_close("matmul pre-GELU", download(k.d_pre), k.out, 2e-2);
    require_close("matmul GELU out", download(k.d_out), k.act, 3e-2);
    k.gpu_backward();
    require_close("matmul dinp", download(k.d_dinp), k.dinp, 2e-2);
    require_close("matmul dweight", download(k.d_dw), k.dweight, 2e-2);
    require_close("matmul dbias", download(k.d_db), k.dbias, 2e-2);
}

// gelu_matmul_backward's two micro-steps with the bias gradient in cuBLASLt's BGRADB epilogue or, where the shape
// does not take it, in the column sums; GELU's backward and its input's bias gradient in one kernel's pass. The
// case's shape must take the path the caller names, or the check proves the other one
void check_gelu_matmul(long N, long C, long OC, bool epilogues) {
    INFO("gelu_matmul_backward N=" << N << " C=" << C << " OC=" << OC);
    GeluMatmulCase k(N, C, OC, 17, 0.1f);
    REQUIRE(k.takes_epilogues() == epilogues);
    k.gpu_backward();
    std::vector<float> dpre = download(k.d_dpre), dw = download(k.d_dw), db = download(k.d_db),
                       dpb = download(k.d_dpb);
    require_close("dpre through GELU", dpre, k.dpre, 3e-2);
    require_close("dweight (+= twice)", dw, k.dweight, 2e-2);
    require_close("dbias (+= twice)", db, k.dbias, 2e-2);
    require_close("the bias gradient of GELU's input (+= twice)", dpb, k.dpre_bias, 3e-2);
    k.reset_grads();
    k.gpu_backward();
    REQUIRE(download(k.d_dpre) == dpre);  // bit-reproducible
    REQUIRE(download(k.d_dw) == dw);
    REQUIRE(download(k.d_db) == db);
    REQUIRE(download(k.d_dpb) == dpb);
}

// llmc/experts.cuh's grouped passes run on the CPU (their GEMM descriptors through experts_gemm's loops, the
// per-row kernels' CPU loops) against the mlp_* loop the CPU's entry points run, din == dout, whole and split: the
// same fp32 arithmetic in the same order but for the bias added after the sum, identical bits on this project's
// builds; 1e-5 leaves the order free. A GEMM given another expert's weights or rows, or a bias gradient that drops
// a row, is an O(1) error.
void check_experts_on_cpu(const MlpShape& s, bool bias, const std::vector<int>& counts) {
    INFO("experts C=" << s.C << " H=" << s.H << (s.activation == Activation::GELU ? " GELU" : " SwiGLU")
                      << (bias ? " with biases" : ""));
    ExpertsCase k(s, bias, experts_first(counts), 23, true);
    for (bool split : {false, true}) {
        INFO((split ? "split backward" : "backward"));
        ExpertsCase::HostRun g = k.run_on_cpu(true, split);
        const ExpertsCase::HostRun& l = k.cpu;
        std::pair<const char*, std::pair<const std::vector<float>*, const std::vector<float>*>> all[] = {
            {"out", {&g.out, &l.out}},       {"fch", {&g.fch, &l.fch}},
            {"act", {&g.act, &l.act}},       {"din", {&g.din, &l.din}},
            {"dfch", {&g.dfch, &l.dfch}},    {"dact", {&g.dact, &l.dact}},
            {"dfcw", {&g.dfcw, &l.dfcw}},    {"dfcb", {&g.dfcb, &l.dfcb}},
            {"dfcprojw", {&g.dfcprojw, &l.dfcprojw}}, {"dfcprojb", {&g.dfcprojb, &l.dfcprojb}}};
        for (auto& [name, v] : all) require_close(name, *v.first, *v.second, 1e-5);
    }
}

// The GPU's grouped passes against its loop of mlp_* calls (cuBLASLt per expert) and against the CPU, din == dout
// for the grouped backward (the loop's din a buffer of its own), then the split backward, and the grouped backward
// again for the same bits. Grouped against the loop: 1e-2 forward, 2e-2 gradients (one or two bf16 roundings apart
// per stage: the bias after the GEMM's rounding rather than in its epilogue, other GEMM kernels' summation orders;
// dev/cuda/experts.cu says more); against the CPU 2e-2 and 3e-2, as the matmul's checks.
void check_experts(const MlpShape& s, bool bias, const std::vector<int>& counts) {
    INFO("experts C=" << s.C << " H=" << s.H << (s.activation == Activation::GELU ? " GELU" : " SwiGLU")
                      << (bias ? " with biases" : ""));
    REQUIRE(experts_grouped_missing() == "");
    ExpertsCase k(s, bias, experts_first(counts), 24, true);
    struct Output {
        const char* name;
        DeviceArray<bf16>*grouped, *loop;
        const std::vector<float>* cpu;
    };
    ExpertsCase::Run &g = k.grouped, &l = k.loop;
    std::vector<Output> forward = {{"out", &g.out, &l.out, &k.cpu.out},
                                   {"fch", &g.fch, &l.fch, &k.cpu.fch},
                                   {"act", &g.act, &l.act, &k.cpu.act}};
    std::vector<Output> backward = {{"din", &g.din, &l.din, &k.cpu.din},
                                    {"dfch", &g.dfch, &l.dfch, &k.cpu.dfch},
                                    {"dfcw (+=)", &g.dfcw, &l.dfcw, &k.cpu.dfcw},
                                    {"dfcprojw (+=)", &g.dfcprojw, &l.dfcprojw, &k.cpu.dfcprojw}};
    if (k.swiglu()) backward.push_back({"dact", &g.dact, &l.dact, &k.cpu.dact});
    if (bias) {
        backward.push_back({"dfcb (+=)", &g.dfcb, &l.dfcb, &k.cpu.dfcb});
        backward.push_back({"dfcprojb (+=)", &g.dfcprojb, &l.dfcprojb, &k.cpu.dfcprojb});
    }
    auto compare = [&](const std::vector<Output>& outputs, double tol, double cpu_tol, bool with_cpu) {
        for (const Output& o : outputs) {
            INFO(o.name);
            std::vector<float> grouped = download(*o.grouped);
            require_close("grouped against the loop", grouped, download(*o.loop), tol);
            if (with_cpu) require_close("grouped against the CPU", grouped, *o.cpu, cpu_tol);
        }
    };
    on_main_stream([&] { k.forward(k.loop, false); });
    on_main_stream([&] { k.forward(k.grouped, true); });
    compare(forward, 1e-2, 2e-2, true);
    on_main_stream([&] { k.backward(k.loop, false, false); });
    on_main_stream([&] { k.backward(k.grouped, true, true); });
    compare(backward, 2e-2, 3e-2, true);
    std::vector<std::vector<float>> first_run;
    for (const Output& o : backward) first_run.push_back(download(*o.grouped));
    {
        INFO("split backward");
        on_main_stream([&] { g.din.poison(), g.dfch.poison(), k.reset_grads(g); });
        on_main_stream([&] { k.split_backward(g, true); });
        compare(backward, 2e-2, 3e-2, false);
    }
    {
        INFO("the grouped backward again: the same bits");
        on_main_stream([&] { k.reset_grads(g); });
        on_main_stream([&] { k.backward(g, true, true); });
        for (size_t i = 0; i < backward.size(); i++) {
            INFO(backward[i].name);
            REQUIRE(download(*backward[i].grouped) == first_run[i]);
        }
    }
    REQUIRE(experts_grouped_missing() == "");  // the grouped GEMMs ran throughout
}

// the mma.sync kernels, or the wgmma ones (hopper); NH query heads over KV key/value heads
void check_attention(int B, int T, int C, int NH, int KV, bool hopper = false) {
    INFO("attention B=" << B << " T=" << T << " hs=" << C / NH << " NH=" << NH << " KV=" << KV);
    AttentionCase k(B, T, C, NH, KV, 14);
    auto forward = [&] { hopper ? k.gpu_forward_hopper() : k.gpu_forward(); };
    auto backward = [&] { hopper ? k.gpu_backward_hopper() : k.gpu_backward(); };
    forward();
    require_close("attention out", download(k.d_out), k.out, AttentionCase::OUT_TOL);
    require_close("attention lse", download(k.d_lse), k.lse, 1e-3);
    backward();
    std::vector<float> dqkv = download(k.d_dqkv);
    require_close("attention dqkv", dqkv, k.dqkv_for_out(download(k.d_out)), AttentionCase::DQKV_TOL);
    k.d_dqkv.poison();
    backward();
    REQUIRE(download(k.d_dqkv) == dqkv);  // deterministic: same inputs, same bits
}

// The tensor-core attention's fragment bookkeeping, emulated on the CPU from the PTX ISA's rules: ldmatrix.x4
// (lanes 8i..8i+7 address the rows of matrix i; lane l receives row l/4, elements 2(l%4) and 2(l%4)+1, of
// matrix i or of its transpose) and mma.m16n8k16's A, B and C layouts, written out here independently of
// llmc/attention.cuh's helpers, which must then multiply like a matmul.
using WarpRegs = std::array<std::array<uint32_t, 4>, 32>;

// half e of a register holding two bf16: a bf16 is the upper 16 bits of the fp32 it stands for
float bf16_half(uint32_t reg, int e) {
    uint32_t bits = (reg >> (16 * e) & 0xffffu) << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

// tile is row-major with ld floats per row (values exact in bf16); coord says where lane points
WarpRegs emulate_ldmatrix_x4(const std::vector<float>& tile, int ld, FragmentCoord (*coord)(int), bool trans) {
    WarpRegs regs;
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) {
            float e[2];
            for (int k = 0; k < 2; k++) {
                int r = lane / 4, c = 2 * (lane % 4) + k;  // element of the 8×8 matrix as delivered
                if (trans) std::swap(r, c);
                FragmentCoord row = coord(8 * i + r);  // the lane that addressed matrix i's row r
                e[k] = tile[row.row * ld + row.col + c];
            }
            regs[lane][i] = pack_bf16x2(e[0], e[1]);
        }
    return regs;
}

// c[lane] += A·B for one m16n8k16 with A in a's four registers per lane and B in b[lane][b_first..b_first+1]
void emulate_mma(float (&c)[32][4], const WarpRegs& a, const WarpRegs& b, int b_first) {
    float A[16][16], Bm[16][8];
    for (int lane = 0; lane < 32; lane++) {
        int g = lane / 4, t = lane % 4;
        for (int e = 0; e < 2; e++) {
            A[g][2 * t + e] = bf16_half(a[lane][0], e);
            A[g + 8][2 * t + e] = bf16_half(a[lane][1], e);
            A[g][8 + 2 * t + e] = bf16_half(a[lane][2], e);
            A[g + 8][8 + 2 * t + e] = bf16_half(a[lane][3], e);
            Bm[2 * t + e][g] = bf16_half(b[lane][b_first], e);
            Bm[8 + 2 * t + e][g] = bf16_half(b[lane][b_first + 1], e);
        }
    }
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) {
            int row = lane / 4 + 8 * (i / 2), col = 2 * (lane % 4) + i % 2;
            for (int k = 0; k < 16; k++) c[lane][i] += A[row][k] * Bm[k][col];
        }
}

// the two 16×8 accumulator tiles side by side as a 16×16 matrix, read through accumulator_coord
std::vector<float> gather_accumulators(const float (&left)[32][4], const float (&right)[32][4]) {
    std::vector<float> m(16 * 16);
    for (int lane = 0; lane < 32; lane++)
        for (int i = 0; i < 4; i++) {
            FragmentCoord c = accumulator_coord(lane, i);
            m[c.row * 16 + c.col] = left[lane][i];
            m[c.row * 16 + 8 + c.col] = right[lane][i];
        }
    return m;
}

TEST_CASE("attention mma fragments: ldmatrix addressing and m16n8k16 layouts emulated on the CPU", "[cuda]") {
    Rng rng(19);
    const int ld = 24;  // padded rows, as in shared memory
    std::vector<float> q = random_bf16_values(16 * ld, rng), k = random_bf16_values(16 * ld, rng),
                       v = random_bf16_values(16 * ld, rng);
    // S = Q·Kᵀ: A from Q (16 queries × 16 dims), B from K stored keys × dims, two n-tiles of 8 keys
    WarpRegs qa = emulate_ldmatrix_x4(q, ld, ldmatrix_rowmajor_coord, false);
    WarpRegs kb = emulate_ldmatrix_x4(k, ld, ldmatrix_nk_coord, false);
    float s_left[32][4] = {}, s_right[32][4] = {};
    emulate_mma(s_left, qa, kb, 0);
    emulate_mma(s_right, qa, kb, 2);
    std::vector<float> s = gather_accumulators(s_left, s_right), s_ref(16 * 16), p(16 * 16);
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) {
            for (int d = 0; d < 16; d++) s_ref[r * 16 + c] += q[r * ld + d] * k[c * ld + d];
            p[r * 16 + c] = __bfloat162float(__float2bfloat16(s[r * 16 + c]));  // P enters the next mma as bf16
        }
    require_close("Q·Kᵀ through the fragments", s, s_ref, 1e-5);

    // O = S·V: A from the accumulators (accumulators_to_a), B from V stored keys × dims, read with .trans
    WarpRegs sa;
    for (int lane = 0; lane < 32; lane++) {
        uint32_t a[4];
        accumulators_to_a(a, s_left[lane], s_right[lane]);
        for (int i = 0; i < 4; i++) sa[lane][i] = a[i];
    }
    WarpRegs vb = emulate_ldmatrix_x4(v, ld, ldmatrix_rowmajor_coord, true);
    float o_left[32][4] = {}, o_right[32][4] = {};
    emulate_mma(o_left, sa, vb, 0);
    emulate_mma(o_right, sa, vb, 2);
    std::vector<float> o_ref(16 * 16);
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++)
            for (int key = 0; key < 16; key++) o_ref[r * 16 + c] += p[r * 16 + key] * v[key * ld + c];
    require_close("S·V through the fragments", gather_accumulators(o_left, o_right), o_ref, 1e-5);
}

// The wgmma attention's shared-memory bookkeeping, emulated on the CPU from the rules of the CUDA driver API
// (TMA's 128-byte swizzle: the 16-byte chunk c of a 128-byte row r lands at chunk c ^ (r % 8) within each 1024
// bytes) and of the PTX ISA (the matrix descriptor's fields; the canonical K-major and MN-major layouts with the
// 128-byte swizzle; the m64nNk16 A-in-registers and accumulator layouts), written out here independently of
// llmc/attention.cuh's helpers, which must then multiply like a matmul.
struct SharedMemory {
    std::vector<uint16_t> bytes2 = std::vector<uint16_t>(1 << 16);  // 128 KiB of bf16 bit patterns
    static uint32_t swizzle(uint32_t address) { return address ^ ((address >> 7) & 7) << 4; }
    void store(uint32_t address, float v) {
        __nv_bfloat16 b = __float2bfloat16(v);
        memcpy(&bytes2[swizzle(address) / 2], &b, 2);
    }
    float load(uint32_t address) const {
        uint32_t bits = (uint32_t)bytes2[swizzle(address) / 2] << 16;
        float v;
        memcpy(&v, &bits, 4);
        return v;
    }
};

// TMA: rows [t0, t0 + rows) of a row-major matrix (width columns, T rows, zeros past T), columns [0, hs), as
// the 64×64 boxes a kernel's tma_load_tile issues, box (rb, cb) at tile + hopper_box_offset(rb, cb, rows)
void emulate_tma_tile(SharedMemory& smem, uint32_t tile, int rows, int hs, const std::vector<float>& m, int width,
                      int t0, int T) {
    for (int cb = 0; cb < hs / 64; cb++)
        for (int rb = 0; rb < rows / 64; rb++)
            for (int r = 0; r < 64; r++)
                for (int c = 0; c < 64; c++) {
                    int t = t0 + 64 * rb + r;
                    float v = t < T ? m[(size_t)t * width + 64 * cb + c] : 0.0f;
                    smem.store(tile + hopper_box_offset(rb, cb, rows) + r * 128 + 2 * c, v);
                }
}

// a matrix descriptor's fields: start address, leading and stride byte offsets
struct Descriptor {
    uint32_t start, lbo, sbo;
};

Descriptor decode(uint64_t desc) {
    REQUIRE(desc >> 62 == 1);        // the 128-byte swizzle
    REQUIRE((desc >> 49 & 7) == 0);  // base offset 0: the tiles start on 1024-byte boundaries
    return {(uint32_t)(desc & 0x3FFF) << 4, (uint32_t)(desc >> 16 & 0x3FFF) << 4, (uint32_t)(desc >> 32 & 0x3FFF) << 4};
}

// the element (mn, k) of a wgmma operand read through a descriptor, k < 16. In bf16 elements (T = 8), K-major
// is ((8,m),(T,2k)):((8T,SBO),(1,T)) and MN-major ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)).
float descriptor_element(const SharedMemory& smem, Descriptor d, bool k_major, int mn, int k) {
    uint32_t offset = k_major ? (mn % 8) * 128 + (mn / 8) * d.sbo + 2 * k
                              : (mn % 64) * 2 + (mn / 64) * d.lbo + (k % 8) * 128 + (k / 8) * d.sbo;
    return smem.load(d.start + offset);
}

// a warpgroup's accumulators: thread (0..127), then the kernel's [N/8][4] array flattened (register i = 4j + e)
using WarpgroupAcc = std::vector<std::vector<float>>;

// d (+)= A·B for one m64nNk16: A from a K-major descriptor, or from the threads' registers when a_regs is given;
// B from a descriptor, K-major or MN-major; the accumulator layout is register i of thread 32w + 4g + t at row
// 16w + g + 8·(i/2 % 2), column 8·(i/4) + 2t + i % 2
void emulate_wgmma(WarpgroupAcc& d, int N, const SharedMemory& smem, uint64_t a_desc,
                   const std::vector<std::array<uint32_t, 4>>* a_regs, uint64_t b_desc, bool b_k_major,
                   bool accumulate) {
    std::vector<float> A(64 * 16), B(16 * N);
    if (!a_regs) {
        Descriptor a = decode(a_desc);
        for (int m = 0; m < 64; m++)
            for (int k = 0; k < 16; k++) A[m * 16 + k] = descriptor_element(smem, a, true, m, k);
    }
    if (a_regs)
        for (int thread = 0; thread < 128; thread++)
            for (int r = 0; r < 4; r++)
                for (int e = 0; e < 2; e++) {
                    int lane = thread % 32, row = 16 * (thread / 32) + lane / 4 + 8 * (r % 2);
                    A[row * 16 + 8 * (r / 2) + 2 * (lane % 4) + e] = bf16_half((*a_regs)[thread][r], e);
                }
    Descriptor b = decode(b_desc);
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < N; n++) B[k * N + n] = descriptor_element(smem, b, b_k_major, n, k);
    for (int thread = 0; thread < 128; thread++)
        for (int i = 0; i < N / 2; i++) {
            int lane = thread % 32, row = 16 * (thread / 32) + lane / 4 + 8 * (i / 2 % 2),
                col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
            float sum = accumulate ? d[thread][i] : 0.0f;
            for (int k = 0; k < 16; k++) sum += A[row * 16 + k] * B[k * N + col];
            d[thread][i] = sum;
        }
}

// the warpgroup's 64×N block as the kernels read it: warp w's slab is rows 16w.., its [j][e] at
// accumulator_coord(lane, e) in columns 8j..
std::vector<float> gather_warpgroup(const WarpgroupAcc& d, int N) {
    std::vector<float> m(64 * N);
    for (int thread = 0; thread < 128; thread++)
        for (int j = 0; j < N / 8; j++)
            for (int e = 0; e < 4; e++) {
                FragmentCoord c = accumulator_coord(thread % 32, e);
                m[(16 * (thread / 32) + c.row) * N + 8 * j + c.col] = d[thread][4 * j + e];
            }
    return m;
}

// One consumer warpgroup's S = Q·Kᵀ and O = P·V as the forward runs them (warpgroup_abt, warpgroup_pm), and the
// dQ kernel's dQ += dS·K's operands alike: Q a tile of HOPPER_ROWS rows, K and V tiles of cols rows, of which
// the rows past T are zeros
void check_wgmma_layouts(int hs, int cols, int wg) {
    const int T = cols - 5, width = 3 * hs;
    Rng rng(23 + hs + cols + wg);
    std::vector<float> qkv = random_bf16_values((size_t)HOPPER_ROWS * width, rng);
    SharedMemory smem;
    uint32_t q_s = 0, k_s = HOPPER_ROWS * hs * 2, v_s = k_s + cols * hs * 2;
    emulate_tma_tile(smem, q_s, HOPPER_ROWS, hs, qkv, width, 0, HOPPER_ROWS);
    std::vector<float> k_m((size_t)HOPPER_ROWS * hs), v_m((size_t)HOPPER_ROWS * hs);
    for (int t = 0; t < HOPPER_ROWS; t++)
        for (int c = 0; c < hs; c++) {
            k_m[(size_t)t * hs + c] = qkv[(size_t)t * width + hs + c];
            v_m[(size_t)t * hs + c] = qkv[(size_t)t * width + 2 * hs + c];
        }
    emulate_tma_tile(smem, k_s, cols, hs, k_m, hs, 0, T);
    emulate_tma_tile(smem, v_s, cols, hs, v_m, hs, 0, T);

    int row0 = 64 * wg;
    WarpgroupAcc s(128, std::vector<float>(cols / 2));
    for (int k0 = 0; k0 < hs; k0 += 16)
        emulate_wgmma(s, cols, smem, hopper_kmajor_desc(q_s, HOPPER_ROWS, row0, k0), nullptr,
                      hopper_kmajor_desc(k_s, cols, 0, k0), true, k0 > 0);
    std::vector<float> s_ref(64 * cols), p(64 * cols);
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < cols; c++) {
            double dot = 0.0;
            for (int d = 0; d < hs && c < T; d++)
                dot += (double)qkv[(size_t)(row0 + r) * width + d] * k_m[(size_t)c * hs + d];
            s_ref[r * cols + c] = (float)dot;
        }
    std::vector<float> s_got = gather_warpgroup(s, cols);
    require_close("S = Q·Kᵀ through TMA, the descriptors and the accumulators", s_got, s_ref, 1e-5);
    for (int i = 0; i < 64 * cols; i++) p[i] = __bfloat162float(__float2bfloat16(s_got[i]));  // P enters as bf16

    // P·V: A from the accumulators (accumulators_to_a, 16 columns of P per step), B = V MN-major
    WarpgroupAcc o(128, std::vector<float>(hs / 2, 0.0f));
    for (int k0 = 0; k0 < cols; k0 += 16) {
        std::vector<std::array<uint32_t, 4>> a(128);
        for (int thread = 0; thread < 128; thread++) {
            float left[4], right[4];
            for (int e = 0; e < 4; e++)
                left[e] = s[thread][4 * (k0 / 8) + e], right[e] = s[thread][4 * (k0 / 8 + 1) + e];
            uint32_t regs[4];
            accumulators_to_a(regs, left, right);
            for (int r = 0; r < 4; r++) a[thread][r] = regs[r];
        }
        emulate_wgmma(o, hs, smem, 0, &a, hopper_mnmajor_desc(v_s, cols, k0), false, true);
    }
    std::vector<float> o_ref(64 * hs);
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < hs; c++) {
            double sum = 0.0;
            for (int key = 0; key < T; key++) sum += (double)p[r * cols + key] * v_m[(size_t)key * hs + c];
            o_ref[r * hs + c] = (float)sum;
        }
    require_close("O = P·V through the registers and an MN-major descriptor", gather_warpgroup(o, hs), o_ref, 1e-5);
}

TEST_CASE("attention wgmma: TMA's swizzle, the matrix descriptors and the m64nNk16 fragments emulated on the CPU",
          "[cuda]") {
    for (int hs : {64, 128})
        for (int cols : {HOPPER_BWD_COLS, HOPPER_FWD_COLS})
            for (int wg : {0, 1}) {
                INFO("hs " << hs << ", tile of " << cols << " rows, warpgroup " << wg);
                check_wgmma_layouts(hs, cols, wg);
            }
}

void check_gelu(long N) {
    Rng rng(15);
    std::vector<float> inp = random_bf16_values(N, rng, 2.0f), dout = random_bf16_values(N, rng), out(N), dinp(N);
    DeviceArray<bf16> d_inp(N), d_out(N), d_dout(N);
    upload(d_inp, inp);
    upload(d_dout, dout);
    gelu_forward(out.data(), inp.data(), N);
    gelu_backward(dinp.data(), inp.data(), dout.data(), N);
    gelu_forward_cuda(d_out.ptr, d_inp.ptr, N, 0);
    require_close("gelu out", download(d_out), out, 1e-2);
    gelu_backward_cuda(d_dout.ptr, d_inp.ptr, d_dout.ptr, N, 0);  // in place
    require_close("gelu dinp", download(d_dout), dinp, 1e-2);
}

void check_classifier(long N, int V, int Vp) {
    ClassifierCase k(N, V, Vp, 16);
    k.gpu_forward();
    require_close("losses", download(k.d_losses), k.losses, 1e-3);
    k.d_losses.poison();
    k.gpu_backward_inplace();
    require_close("fused losses", download(k.d_losses), k.losses, 1e-3);
    std::vector<float> grad = download(k.d_logits);
    require_close("dlogits", grad, k.grad, 2e-2);
    REQUIRE(k.padding_zero(grad));
    k.reset_logits();
    k.gpu_backward_inplace();
    REQUIRE(download(k.d_logits) == grad);  // bit-reproducible
}

void check_adamw(long n) {
    AdamWCase k(n, 17, 3);
    k.gpu_run(99);
    std::vector<float> gpu_master = download(k.d_master), params = download(k.d_params);
    require_close("master", gpu_master, k.master, 1e-5);
    require_close("m", download(k.d_m), k.m, 1e-5);
    require_close("v", download(k.d_v), k.v, 1e-5);
    for (long i = 0; i < n; i++) {
        // the parameter is the master weight truncated to bf16, or one bf16 step further from zero
        float lo, hi;
        bf16_neighbours(gpu_master[i], lo, hi);
        INFO("element " << i);
        REQUIRE((params[i] == lo || params[i] == hi));
    }
    // the rounding bits follow the element's global index: a sharded update draws the unsharded bits
    k.gpu_run(99, 3);
    REQUIRE(download(k.d_params) == params);
    k.gpu_run(100);
    REQUIRE(download(k.d_params) != params);
}

void check_global_norm(long n) {
    Rng rng(18);
    std::vector<float> x = random_bf16_values(n, rng, 0.1f);
    DeviceArray<bf16> d_x(n);
    DeviceArray<float> d_out(1), partial(GLOBAL_NORM_BLOCKS);
    upload(d_x, x);
    sum_of_squares_cuda(d_out.ptr, d_x.ptr, n, partial.ptr, 0);
    require_close("sum of squares", download(d_out), {(float)sum_of_squares(x.data(), n)}, 1e-4);
}

TEST_CASE("CUDA encoder forward and deterministic backward match the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_encoder(2, 64, 64, 100);
    check_encoder(3, 33, 200, 1000);
    check_encoder(4, 128, 1600, 3000);   // runs of ~85 positions: the long-run path, C past one lane's reach
    check_encoder(2, 100, 64, 70000);    // past 16-bit keys
}

TEST_CASE("CUDA fused residual + layernorm and layernorm backward match the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_layernorm(64, 64);
    check_layernorm(130, 200);
    check_layernorm(37, 1600);  // 8 vectors a lane
    check_layernorm(9, 4096);   // 16 vectors a lane, the widest row held in registers
    check_layernorm(3000, 96);  // more rows per backward block than the minimum
}

TEST_CASE("CUDA cuBLASLt matmul forward (bias, GELU) and backward match the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_matmul(64, 64, 96);  // the backward's bias gradient in the weight GEMM's epilogue (BGRADB)
    check_matmul(100, 72, 40);
}

TEST_CASE("CUDA matmul backward through GELU: GELU's backward and both bias gradients (one in cuBLASLt's BGRADB "
          "epilogue), accumulated over two micro-steps, match the CPU, and so do the kernels that replace the "
          "epilogue on the shapes it does not take",
          "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_gelu_matmul(256, 512, 128, true);  // the GPU model test's MLP projection
    check_gelu_matmul(100, 72, 40, true);    // N a multiple of no tile
    check_gelu_matmul(37, 200, 24, true);
    check_gelu_matmul(50, 36, 42, false);    // C and OC not whole 16-byte vectors
    check_gelu_matmul(64, 64, 90, false);    // OC alone
    check_gelu_matmul(600, 136, 64, true);   // three chunks of the column sums, the last one partial
    check_gelu_matmul(300, 38, 42, false);   // two chunks, C no whole vector
}

// Where a backward's bias gradient goes is a function of the call alone (plan_matmul_backward): checked here
// without a GPU over every combination of a weight gradient, a bias gradient and a shape that fits or not.
TEST_CASE("matmul backward plan: the bias gradient exactly once, in cuBLASLt's BGRADB epilogue wherever the "
          "shape takes it, else in the column-sum kernels",
          "[cuda]") {
    for (int bits = 0; bits < 8; bits++) {
        bool dweight = bits & 1, dbias = bits & 2, fits = bits & 4;
        INFO("dweight " << dweight << " dbias " << dbias << " fits " << fits);
        MatmulBackwardPlan p = plan_matmul_backward(dweight, dbias, fits);
        bool bgradb = p.weight == CUBLASLT_EPILOGUE_BGRADB;
        CHECK((p.weight == CUBLASLT_EPILOGUE_DEFAULT || bgradb));
        // exactly once: the epilogue or the kernels, and neither when there is nothing to compute
        CHECK((int)bgradb + (int)p.bias_kernels == (int)dbias);
        // the epilogue only on the weight GEMM and a shape that fits, and always there
        CHECK(bgradb == (fits && dweight && dbias));
    }
    // the shapes: GPT-2 124M's matmuls take the epilogues; a dimension short of a 16-byte vector, no rows, or a
    // misaligned pointer does not
    const void* aligned = reinterpret_cast<const void*>(uintptr_t{0x1000});
    const void* misaligned = reinterpret_cast<const void*>(uintptr_t{0x1008});
    for (auto [C, OC] : {std::pair{768L, 2304L}, {768L, 768L}, {768L, 3072L}, {3072L, 768L}})
        CHECK(matmul_epilogues_fit(8192, C, OC, {aligned, aligned, nullptr}));
    CHECK(matmul_epilogues_fit(37, 200, 24, {aligned}));
    CHECK_FALSE(matmul_epilogues_fit(8192, 768, 42, {aligned}));
    CHECK_FALSE(matmul_epilogues_fit(8192, 36, 768, {aligned}));
    CHECK_FALSE(matmul_epilogues_fit(0, 768, 768, {aligned}));
    CHECK_FALSE(matmul_epilogues_fit(8192, 768, 768, {aligned, misaligned}));
}

// --attention's resolution (llmc/attention.cuh), without a GPU: the default is wgmma where its kernels can run and
// mma elsewhere, quietly; wgmma asked for where it cannot run is refused in one line that says why
TEST_CASE("attention kernels: wgmma by default where they can run, else mma; an explicit wgmma refused elsewhere",
          "[cuda]") {
    CHECK(resolve_attention_kernels("", true, "") == AttentionKernels::WGMMA);
    CHECK(resolve_attention_kernels("", false, "the GPU has compute capability 8.0") == AttentionKernels::MMA);
    CHECK(resolve_attention_kernels("mma", true, "") == AttentionKernels::MMA);
    CHECK(resolve_attention_kernels("mma", false, "no sm_90a") == AttentionKernels::MMA);
    CHECK(resolve_attention_kernels("wgmma", true, "") == AttentionKernels::WGMMA);
    REQUIRE_THROWS_WITH(resolve_attention_kernels("wgmma", false, "this binary has no sm_90a machine code"),
                        "--attention wgmma: this binary has no sm_90a machine code");
    REQUIRE_THROWS_WITH(resolve_attention_kernels("flash", true, ""), Catch::Contains("expected mma or wgmma"));
    CHECK(std::string(attention_kernels_name(AttentionKernels::WGMMA)) == "wgmma");
    CHECK(std::string(attention_kernels_name(AttentionKernels::MMA)) == "mma");
}

// Grouped-query shapes: 8 query heads over 2 key/value heads (groups of 4) and over 1 (multi-query), so that a
// wrong key/value head, a group's dK/dV contributions lost or counted twice, or a walk that stops at the first
// query head of a group shows against the CPU; T crosses tile and block boundaries.
TEST_CASE("CUDA flash attention forward and deterministic backward match the CPU for head sizes 64 and 128, "
          "multi-head and grouped-query",
          "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_attention(2, 64, 128, 2, 2);    // hs 64, one tile
    check_attention(1, 77, 256, 2, 2);    // hs 128, T not a multiple of the tile
    check_attention(2, 200, 192, 3, 3);   // hs 64, several tiles and a ragged last one
    check_attention(2, 200, 512, 8, 2);   // hs 64, groups of 4
    check_attention(1, 77, 512, 8, 1);    // hs 64, multi-query
    check_attention(1, 150, 1024, 8, 2);  // hs 128, groups of 4, ragged
    check_attention(2, 64, 1024, 8, 1);   // hs 128, multi-query, one tile
}

TEST_CASE("CUDA wgmma flash attention (Hopper) forward and deterministic backward match the CPU for head sizes 64 "
          "and 128, multi-head and grouped-query",
          "[cuda]") {
    SKIP_WITHOUT_HOPPER_ATTENTION_CASE();
    check_attention(2, 64, 128, 2, 2, true);    // hs 64, less than one block
    check_attention(1, 77, 256, 2, 2, true);    // hs 128, T not a multiple of the tile
    check_attention(2, 200, 192, 3, 3, true);   // hs 64, two blocks, the second ragged
    check_attention(1, 333, 1024, 8, 8, true);  // hs 128, three blocks and a ragged last tile
    check_attention(2, 200, 512, 8, 2, true);   // hs 64, groups of 4, two blocks
    check_attention(1, 77, 512, 8, 1, true);    // hs 64, multi-query
    check_attention(1, 333, 1024, 8, 2, true);  // hs 128, groups of 4, three blocks
    check_attention(2, 64, 1024, 8, 1, true);   // hs 128, multi-query, less than one block
}

// experts of odd row counts, one without rows in the middle and one at each end (the SwiGLU case), C and H whole
// 16-byte vectors as the model's are
TEST_CASE("experts' grouped passes on the CPU equal the per-expert loop", "[experts]") {
    check_experts_on_cpu(MlpShape{64, 96, Activation::GELU}, true, {37, 0, 64, 1, 129});
    check_experts_on_cpu(MlpShape{128, 48, Activation::SwiGLU}, false, {0, 13, 5, 41, 0});
    check_experts_on_cpu(MlpShape{64, 40, Activation::SwiGLU}, true, {3, 0, 0, 17});
}

TEST_CASE("CUDA grouped expert GEMMs match the per-expert loop and the CPU", "[cuda][experts]") {
    SKIP_WITHOUT_GPU_CASE();
    check_experts(MlpShape{64, 96, Activation::GELU}, true, {37, 0, 64, 1, 129});
    check_experts(MlpShape{128, 48, Activation::SwiGLU}, false, {0, 13, 5, 41, 0});
    check_experts(MlpShape{64, 40, Activation::SwiGLU}, true, {3, 0, 0, 17});
    check_experts(MlpShape{256, 512, Activation::SwiGLU}, false, {300, 517, 1, 0, 290, 1000, 7, 900});
}

TEST_CASE("CUDA GELU forward and backward match the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_gelu(1024);
    check_gelu(8 * 1001);
    check_gelu(1001);  // a tail past the vector width
    check_gelu(5);     // only a tail
}

TEST_CASE("CUDA fused classifier matches the CPU and zeroes the padding columns", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_classifier(8, 1000, 1024);
    check_classifier(5, 77, 128);  // V not a multiple of 128
}

TEST_CASE("CUDA AdamW matches the CPU and rounds parameters to a bf16 neighbour", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_adamw(1000);
    check_adamw(4099);
}

TEST_CASE("CUDA sum of squares matches the CPU", "[cuda]") {
    SKIP_WITHOUT_GPU_CASE();
    check_global_norm(1000);
    check_global_norm(100003);
}

// The preconditions are checked on the host before anything reaches the device, so these run without a GPU;
// the pointers are never dereferenced.
TEST_CASE("CUDA entry points refuse shapes and pointers their 16-byte accesses cannot serve", "[cuda]") {
    bf16* aligned = reinterpret_cast<bf16*>(uintptr_t{0x1000});
    bf16* misaligned = reinterpret_cast<bf16*>(uintptr_t{0x1002});
    float* stats = reinterpret_cast<float*>(uintptr_t{0x2000});
    REQUIRE_THROWS_WITH(
        norm_forward_cuda(Norm::LayerNorm, aligned, stats, stats, aligned, aligned, aligned, 4, 100, 1e-5f, 0),
                        Catch::Contains("C = 100"));
    REQUIRE_THROWS_WITH(
        norm_forward_cuda(Norm::LayerNorm, aligned, stats, stats, aligned, aligned, aligned, 4, 8192, 1e-5f, 0),
                        Catch::Contains("at most 4096"));
    REQUIRE_THROWS_WITH(fused_residual_norm_forward_cuda(Norm::LayerNorm, aligned, aligned, stats, stats, misaligned,
                                                         aligned, aligned, aligned, 4, 64, 1e-5f, 0),
                        Catch::Contains("not 16-byte aligned"));
    REQUIRE_THROWS_WITH(norm_backward_cuda(Norm::LayerNorm, aligned, aligned, aligned, aligned, aligned, aligned, stats,
                                           stats, 4, 36, stats, 0),
                        Catch::Contains("C = 36"));
    REQUIRE_THROWS_WITH(gelu_forward_cuda(misaligned, aligned, 16, 0), Catch::Contains("not 16-byte aligned"));
    REQUIRE_THROWS_WITH(encoder_forward_cuda(aligned, nullptr, aligned, aligned, 1, 4, 12, 0),
                        Catch::Contains("C = 12"));
    REQUIRE_THROWS_WITH(crossentropy_forward_cuda(stats, aligned, nullptr, 4, 77, 100, 0),
                        Catch::Contains("Vp = 100"));
    // 8 query heads do not split into groups over 3 key/value heads
    REQUIRE_THROWS_WITH(attention_forward_cuda(aligned, stats, aligned, 1, 4, 512, 8, 3, 0),
                        Catch::Contains("NH % KV != 0"));
    REQUIRE_THROWS_WITH(attention_backward_cuda(aligned, aligned, aligned, aligned, stats, stats, 1, 4, 512, 8, 3, 0),
                        Catch::Contains("NH % KV != 0"));
}

}  // namespace test_cuda_kernels
