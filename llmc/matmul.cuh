// Matrix multiplication for the linear layers: out = inp · Wᵀ + bias, and its backward.
// CPU: one packed, blocked GEMM (the BLIS scheme: pack a block of A into MR-row panels and a block of B into
// NR-column panels, then a register-tiled micro-kernel sweeps them), OpenMP over output tiles. Every output
// element is summed in the same order whatever the thread count, so results are bit-reproducible.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>

#include "llmc/device.cuh"
#include "llmc/profile.h"
#include "llmc/utils.h"

#if defined(__AVX512F__)
#define GEMM_VEC_FLOATS 16
constexpr int GEMM_MR = 8;
#else
#define GEMM_VEC_FLOATS 8
constexpr int GEMM_MR = 6;
#endif
typedef float gemm_vec __attribute__((vector_size(GEMM_VEC_FLOATS * 4)));

// one float copied to every lane, loaded straight from memory so it costs a load, not a shuffle
inline gemm_vec gemm_broadcast(const float* p) {
#if defined(__AVX512F__)
    return (gemm_vec)_mm512_set1_ps(*p);
#else
    return (gemm_vec)_mm256_broadcast_ss(p);
#endif
}
constexpr int GEMM_VEC = GEMM_VEC_FLOATS;
constexpr int GEMM_NR = 2 * GEMM_VEC;
// A's block (MC×KC, 128 KiB) stays in L2 while B's micro-panels (KC×NR) stream through L1
constexpr int GEMM_MC = GEMM_MR * 16;
constexpr int GEMM_KC = 256;
constexpr int GEMM_NC = 256;

// packing space for one thread; the model owns one per OpenMP thread so the ledger sees it
inline size_t gemm_workspace_floats(int threads) {
    return (size_t)threads * ((size_t)GEMM_MC * GEMM_KC + (size_t)GEMM_KC * GEMM_NC);
}

// A strided view: element (i, k) of A is a[i*row_stride + k*col_stride]
struct MatView {
    const float* p;
    long row_stride, col_stride;
    float at(long i, long j) const { return p[i * row_stride + j * col_stride]; }
};

// packs rows [i0, i0+mc) and columns [k0, k0+kc) of A into MR-row panels, zero-padding the last panel
inline void gemm_pack_a(float* dst, MatView a, long i0, int mc, long k0, int kc) {
    for (int p = 0; p < mc; p += GEMM_MR) {
        int rows = std::min(GEMM_MR, mc - p);
        float* panel = dst + (size_t)p * kc;
        for (int k = 0; k < kc; k++) {
            for (int i = 0; i < rows; i++) panel[k * GEMM_MR + i] = a.at(i0 + p + i, k0 + k);
            for (int i = rows; i < GEMM_MR; i++) panel[k * GEMM_MR + i] = 0.0f;
        }
    }
}

// packs rows [k0, k0+kc) and columns [j0, j0+nc) of B into NR-column panels, zero-padding the last panel
inline void gemm_pack_b(float* dst, MatView b, long k0, int kc, long j0, int nc) {
    for (int q = 0; q < nc; q += GEMM_NR) {
        int cols = std::min(GEMM_NR, nc - q);
        float* panel = dst + (size_t)q * kc;
        for (int k = 0; k < kc; k++) {
            for (int j = 0; j < cols; j++) panel[k * GEMM_NR + j] = b.at(k0 + k, j0 + q + j);
            for (int j = cols; j < GEMM_NR; j++) panel[k * GEMM_NR + j] = 0.0f;
        }
    }
}

// C[0:rows, 0:cols] (+)= packed A panel · packed B panel; a full MR×NR tile lives in registers
inline void gemm_micro_kernel(int kc, const float* __restrict__ a, const float* __restrict__ b, float* c,
                              long ldc, int rows, int cols, bool accumulate) {
    gemm_vec acc0[GEMM_MR], acc1[GEMM_MR];
    for (int i = 0; i < GEMM_MR; i++) acc0[i] = acc1[i] = gemm_vec{};
    for (int k = 0; k < kc; k++) {
        gemm_vec b0, b1;
        memcpy(&b0, b + k * GEMM_NR, sizeof(b0));
        memcpy(&b1, b + k * GEMM_NR + GEMM_VEC, sizeof(b1));
        for (int i = 0; i < GEMM_MR; i++) {
            gemm_vec ai = gemm_broadcast(a + k * GEMM_MR + i);
            acc0[i] += ai * b0;
            acc1[i] += ai * b1;
        }
    }
    if (rows == GEMM_MR && cols == GEMM_NR) {
        for (int i = 0; i < GEMM_MR; i++) {
            float* row = c + i * ldc;
            gemm_vec c0 = acc0[i], c1 = acc1[i];
            if (accumulate) {
                gemm_vec old0, old1;
                memcpy(&old0, row, sizeof(old0));
                memcpy(&old1, row + GEMM_VEC, sizeof(old1));
                c0 = old0 + c0;
                c1 = old1 + c1;
            }
            memcpy(row, &c0, sizeof(c0));
            memcpy(row + GEMM_VEC, &c1, sizeof(c1));
        }
        return;
    }
    for (int i = 0; i < rows; i++) {
        float tile[GEMM_NR];
        memcpy(tile, &acc0[i], sizeof(acc0[i]));
        memcpy(tile + GEMM_VEC, &acc1[i], sizeof(acc1[i]));
        for (int j = 0; j < cols; j++) c[i * ldc + j] = accumulate ? c[i * ldc + j] + tile[j] : tile[j];
    }
}

// C[M×N] (row-major, leading dimension ldc) = (accumulate ? C : 0) + A[M×K] · B[K×N]
inline void gemm(long M, long N, long K, MatView a, MatView b, float* c, long ldc, bool accumulate,
                 float* workspace) {
    long m_tiles = (M + GEMM_MC - 1) / GEMM_MC, n_tiles = (N + GEMM_NC - 1) / GEMM_NC;
#pragma omp parallel for schedule(dynamic)
    for (long tile = 0; tile < m_tiles * n_tiles; tile++) {
        float* pack_a = workspace + (size_t)omp_get_thread_num() * ((size_t)GEMM_MC * GEMM_KC + (size_t)GEMM_KC * GEMM_NC);
        float* pack_b = pack_a + (size_t)GEMM_MC * GEMM_KC;
        long i0 = (tile / n_tiles) * GEMM_MC, j0 = (tile % n_tiles) * GEMM_NC;
        int mc = (int)std::min<long>(GEMM_MC, M - i0), nc = (int)std::min<long>(GEMM_NC, N - j0);
        for (long k0 = 0; k0 < K; k0 += GEMM_KC) {
            int kc = (int)std::min<long>(GEMM_KC, K - k0);
            gemm_pack_a(pack_a, a, i0, mc, k0, kc);
            gemm_pack_b(pack_b, b, k0, kc, j0, nc);
            bool acc = accumulate || k0 > 0;
            for (int q = 0; q < nc; q += GEMM_NR)
                for (int p = 0; p < mc; p += GEMM_MR)
                    gemm_micro_kernel(kc, pack_a + (size_t)p * kc, pack_b + (size_t)q * kc,
                                      c + (i0 + p) * ldc + j0 + q, ldc, std::min(GEMM_MR, mc - p),
                                      std::min(GEMM_NR, nc - q), acc);
        }
    }
    if (K == 0 && !accumulate)
        for (long i = 0; i < M; i++) memset(c + i * ldc, 0, N * sizeof(float));
}

// out[N×OC] = inp[N×C] · weight[OC×C]ᵀ + bias[OC] (bias may be null)
inline void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, long N, long C,
                           long OC, Workspace workspace) {
    ProfileScope op("matmul forward");
    if (bias) {
#pragma omp parallel for
        for (long n = 0; n < N; n++) memcpy(out + n * OC, bias, OC * sizeof(float));
    }
    gemm(N, OC, C, MatView{inp, C, 1}, MatView{weight, 1, C}, out, OC, bias != nullptr, workspace.floats);
}

// dinp[N×C] = dout · weight (overwritten); dweight[OC×C] += doutᵀ · inp; dbias[OC] += column sums of dout. Any
// of the three may be null: a split backward (the zero-bubble pipeline) computes dinp first and the weight's
// gradients later.
inline void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, long N, long C, long OC, Workspace workspace) {
    ProfileScope op("matmul backward");
    if (dinp) gemm(N, C, OC, MatView{dout, OC, 1}, MatView{weight, C, 1}, dinp, C, false, workspace.floats);
    if (dweight) gemm(OC, C, N, MatView{dout, 1, OC}, MatView{inp, C, 1}, dweight, C, true, workspace.floats);
    if (dbias) {
#pragma omp parallel for
        for (long o = 0; o < OC; o++) {
            float sum = 0.0f;
            for (long n = 0; n < N; n++) sum += dout[n * OC + o];
            dbias[o] += sum;
        }
    }
}

// ==========================================================================================================
// CUDA: bf16 GEMMs through cuBLASLt with fp32 accumulation.
// The matmuls are nearly all of a step's FLOPs and are compute-bound (2·N·C·OC FLOPs against
// 2·(N·C + C·OC + N·OC) bytes), so they go to cuBLASLt, whose Hopper kernels use the tensor cores far better
// than anything hand-written here would; its epilogues add the bias and apply GELU (forward), or take GELU's
// backward and the bias gradients (backward), while the tile is still in registers, so the output is written
// once and nothing is read again for them. Creating descriptors and running the heuristic costs tens of
// microseconds per call, so both are cached per shape. Row-major X[r×c] is column-major Xᵀ[c×r], so every
// product below is written as the column-major product of the transposes.

#include <array>
#include <initializer_list>
#include <map>

#include "llmc/cuda_common.cuh"
#include "llmc/gelu.cuh"

struct MatmulPlan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
    bool usable = true;  // false: cuBLASLt refused this GEMM, and a caller that may fall back is told so
};

// the largest power of two (up to 256) dividing the address: the heuristic must only offer kernels whose
// vector loads this alignment allows, and views into the flat parameter buffer are not always 256-aligned
inline int pointer_alignment(const void* p) {
    int align = 256;
    while (align > 2 && (uintptr_t)p % align) align /= 2;
    return align;
}

// What A and B hold: bf16, or FP8 codes with the device pointers to the factors that turn them back into values
// (llmc/fp8.cuh, whose fp8_gemm_plan decides every field of an FP8 GEMM); D = alpha·a_scale·b_scale·op(A)·op(B).
// fast_accum: FP8 only, accumulate in the tensor cores' own precision without periodic promotion to fp32.
// a_mode, b_mode: FP8 only, how the scales apply (cuBLASLt's cublasLtMatmulMatrixScale_t: 0 one fp32 per tensor, the
// default; the block recipes' per-tile scales, llmc/fp8_blocks.cuh).
struct GemmOperands {
    cudaDataType_t a = CUDA_R_16BF, b = CUDA_R_16BF;
    const float *a_scale = nullptr, *b_scale = nullptr;
    bool fast_accum = false;
    int a_mode = 0, b_mode = 0;
};

inline bool is_fp8_type(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

// D[m×n] (column-major, ld m) = op(A)·op(B) + beta·D, op(X) = Xᵀ when trans; leading dimensions follow from
// the shapes. bias (length m) and aux (m×n, ld m, the pre-GELU values) are used as the epilogue asks; the
// bias-gradient epilogue BGRADB writes its n values through bias instead (bf16, D's type). C is D
// itself (same type, same layout: cuBLASLt allows it in place), always bf16.
// A GEMM that cuBLASLt refuses (no usable algorithm, or the call itself refused) stops the run, unless the
// caller has a fallback (may_refuse: an epilogue that kernels of its own can replace): then it returns false
// having written nothing, says so once per shape on stderr, and the shape is not tried again.
inline bool cublaslt_matmul(bf16* d, const void* a, const void* b, const bf16* bias, bf16* aux, bool transa,
                            bool transb, long m, long n, long k, float beta, cublasLtEpilogue_t epilogue,
                            cudaStream_t stream, GemmOperands in = {}, bool may_refuse = false) {
    // the key holds everything the descriptor and the heuristic see: the shapes, the types, the epilogue, fast
    // accumulation, and the alignment of every pointer set before it runs (a, b, d, and the epilogue's bias and
    // aux), so no plan is reused on a less-aligned pointer
    static std::map<std::array<long, 17>, MatmulPlan> plans;
    CublasLtContext& ctx = cublaslt();
    const CublasLtApi& lt = ctx.api;
    // the pointers the epilogue and the FP8 scales read, set on the plan's descriptor before every call (and
    // before the heuristic, which may look at them)
    auto set_pointers = [&](MatmulPlan& p) {
        if (bias)
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
        if (aux)
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                                      sizeof(aux)));
        if (in.a_scale)
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &in.a_scale,
                                                      sizeof(in.a_scale)));
        if (in.b_scale)
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &in.b_scale,
                                                      sizeof(in.b_scale)));
    };
    std::array<long, 17> key{transa,
                             transb,
                             m,
                             n,
                             k,
                             beta != 0.0f,
                             (long)epilogue,
                             pointer_alignment(a),
                             pointer_alignment(b),
                             pointer_alignment(d),
                             aux ? pointer_alignment(aux) : 0,
                             bias ? pointer_alignment(bias) : 0,
                             (long)in.a,
                             (long)in.b,
                             in.fast_accum,
                             in.a_mode,
                             in.b_mode};
    auto describe = [&]() {
        return strfmt("m=%ld n=%ld k=%ld transa=%d transb=%d epilogue=%d types A=%d B=%d C=D=bf16 fast_accum=%d "
                      "scale modes A=%d B=%d alignment A=%ld B=%ld D=%ld aux=%ld bias=%ld",
                      m, n, k, (int)transa, (int)transb, (int)epilogue, (int)in.a, (int)in.b, (int)in.fast_accum,
                      in.a_mode, in.b_mode, key[7], key[8], key[9], key[10], key[11]);
    };
    auto it = plans.find(key);
    if (it == plans.end()) {
        MatmulPlan p;
        cublas_check(lt.matmul_desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t opa = transa ? CUBLAS_OP_T : CUBLAS_OP_N, opb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
        cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
        cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
        cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                  sizeof(epilogue)));
        cudaDataType_t bf16_type = CUDA_R_16BF;
        // the bias's and the aux matrix's types only when the epilogue has them, as TransformerEngine and
        // PyTorch set them (a type attribute set for a vector the epilogue lacks is one more field the FP8
        // kernels' checks see)
        if (bias)
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bf16_type,
                                                      sizeof(bf16_type)));
        if (aux) {
            int64_t ld = m;
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                                      &bf16_type, sizeof(bf16_type)));
        }
        if (is_fp8_type(in.a) || is_fp8_type(in.b)) {
            // FP8: both fields explicit, as TransformerEngine sets them: fast accumulation on or off, and the scale
            // modes (cuBLAS 12.8 added them; one fp32 per tensor is the default, the per-tile modes came in 12.9)
            int8_t fast = in.fast_accum;
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
#if CUBLAS_VERSION >= 120900
            cublasLtMatmulMatrixScale_t mode_a = (cublasLtMatmulMatrixScale_t)in.a_mode,
                                        mode_b = (cublasLtMatmulMatrixScale_t)in.b_mode;
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
            cublas_check(lt.matmul_desc_set_attribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
#else
            if (in.a_mode || in.b_mode) fail("FP8 block scales need cuBLAS 12.9 or later (this build has %d)", CUBLAS_VERSION);
#endif
        }
        cublas_check(lt.matrix_layout_create(&p.a, in.a, transa ? k : m, transa ? m : k, transa ? k : m));
        cublas_check(lt.matrix_layout_create(&p.b, in.b, transb ? n : k, transb ? k : n, transb ? n : k));
        cublas_check(lt.matrix_layout_create(&p.d, CUDA_R_16BF, m, n, m));

        cublasLtMatmulPreference_t pref;
        cublas_check(lt.preference_create(&pref));
        uint64_t ws = ctx.workspace_bytes;
        cublas_check(lt.preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        uint32_t align_a = (uint32_t)key[7], align_b = (uint32_t)key[8], align_d = (uint32_t)key[9];
        cublas_check(lt.preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                 sizeof(align_a)));
        cublas_check(lt.preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                 sizeof(align_b)));
        cublas_check(lt.preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                                 sizeof(align_d)));
        cublas_check(lt.preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                                 sizeof(align_d)));
        set_pointers(p);
        // A result is usable only when its state says so (the other fields are undefined otherwise), its workspace
        // fits, and cublasLtMatmulAlgoCheck accepts it for these exact descriptors: the first of the heuristic's
        // candidates that passes all three, rather than its first one unchecked
        constexpr int CANDIDATES = 8;
        cublasLtMatmulHeuristicResult_t results[CANDIDATES];
        int found = 0, usable = -1;
        cublas_check(lt.algo_get_heuristic(ctx.handle, p.desc, p.a, p.b, p.d, p.d, pref, CANDIDATES, results,
                                           &found));
        cublas_check(lt.preference_destroy(pref));
        for (int i = 0; i < found && usable < 0; i++) {
            cublasLtMatmulHeuristicResult_t checked;
            if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= ctx.workspace_bytes &&
                lt.algo_check(ctx.handle, p.desc, p.a, p.b, p.d, p.d, &results[i].algo, &checked) ==
                    CUBLAS_STATUS_SUCCESS &&
                checked.workspaceSize <= ctx.workspace_bytes)
                usable = i;
        }
        if (usable < 0 && !may_refuse)
            fail("cuBLASLt has no usable algorithm (%d candidates) for %s", found, describe().c_str());
        if (usable < 0) {
            p.usable = false;
            fprintf(stderr, "cuBLASLt has no usable algorithm for %s: its fallback kernels run instead\n",
                    describe().c_str());
        } else {
            p.algo = results[usable].algo;
        }
        it = plans.emplace(key, p).first;
    }
    MatmulPlan& p = it->second;
    if (!p.usable) {
        if (!may_refuse) fail("cuBLASLt refused %s before, and this caller has no fallback", describe().c_str());
        return false;
    }
    set_pointers(p);
    float alpha = 1.0f;
    cublasStatus_t status = lt.matmul(ctx.handle, p.desc, &alpha, a, p.a, b, p.b, &beta, d, p.d, d, p.d, &p.algo,
                                      ctx.workspace, ctx.workspace_bytes, stream);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED && may_refuse) {
        p.usable = false;
        fprintf(stderr, "cublasLtMatmul refused %s: its fallback kernels run instead\n", describe().c_str());
        return false;
    }
    if (status != CUBLAS_STATUS_SUCCESS)
        fail("cublasLtMatmul: cuBLAS error %d for %s (CUBLASLT_LOG_LEVEL=4 has cuBLASLt say more)", (int)status,
             describe().c_str());
    return true;
}

// out[N×OC] = inp[N×C] · weight[OC×C]ᵀ + bias[OC] (bias may be null). When pre_gelu is not null the GELU is
// fused: pre_gelu receives inp·Wᵀ + bias and out its GELU (cuBLASLt's tanh approximation, as GPT-2's). bf16
// (FP8 GEMMs go through llmc/fp8.cuh's fp8_gemm).
inline void matmul_forward_cuda(bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, long N, long C,
                                long OC, bf16* pre_gelu, cudaStream_t stream) {
    cublasLtEpilogue_t epilogue = pre_gelu ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                                           : (bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
    // outᵀ[OC×N] = (W as C×OC)ᵀ · (inp as C×N)
    cublaslt_matmul(out, weight, inp, bias, pre_gelu, true, false, OC, N, C, 0.0f, epilogue, stream);
}

// ----------------------------------------------------------------------------------------------------------
// The backward. The weight-gradient GEMM takes the bias gradient into cuBLASLt's epilogue: BGRADB also sums
// op(B) = doutᵀ over the GEMM's k = N rows (OC values, D's type) while the tile is in registers:
//   the weight gradient  dWᵀ[C×OC] += (inp as C×N)·(dout as OC×N)ᵀ;
//   the input gradient   dinpᵀ[C×N] = (W as C×OC)·(dout as OC×N), then, where the matmul's input is GELU's output
//                        (the MLP's projection), GELU's backward dinp ∘= GELU'(pre_gelu) and the column sums of
//                        that, the bias gradient of the matmul whose output GELU took, in one kernel's pass.
// GELU's backward stays out of the epilogue by measurement: on an H100 (2026-11-27) cuBLASLt ran DGELU_BGRAD as
// a separate pass (epilogue::globalKernel) of 1.3 ms a layer at d12 B=64, 15.6 ms of a 134 ms step, where
// GELU's backward and the column sums read and write the same bytes as kernels in about half that; below they
// are one pass (gelu_backward_dbias_cuda).
// The epilogue overwrites its bias vector while the model's gradients accumulate over micro-steps, so it writes
// to scratch and a small kernel adds that to the gradient (OC values, against the N·OC the column sums read).
// cuBLASLt refuses BGRADB unless op(B) is transposed (ours is); the epilogue kernels read and write whole
// 16-byte vectors. Whatever falls outside (other shapes, and a bias gradient without its weight GEMM: FP8
// layers compute the bias gradient here alone) runs on the column sums below.

// The column sums: memory-bound (N·OC bf16 read once). Rows are cut into fixed chunks whose fp32 partial sums a
// second pass adds in chunk order, so the sum does not depend on scheduling.
constexpr int MATMUL_DBIAS_ROWS = 256;

// the fp32 scratch of a backward with an OC-wide bias gradient: the column sums' partials, or an epilogue's
// OC bf16 values
inline long matmul_backward_scratch_floats(long N, long OC) {
    return std::max((N + MATMUL_DBIAS_ROWS - 1) / MATMUL_DBIAS_ROWS * OC, (OC + 1) / 2);
}

// a thread owns two adjacent columns of one chunk: a warp reads 128 contiguous bytes of each row
static __global__ void matmul_dbias_partial_kernel(float* partial, const bf16* dout, long N, long OC) {
    long col = 2 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (col >= OC) return;
    long r0 = (long)blockIdx.y * MATMUL_DBIAS_ROWS, r1 = min(r0 + MATMUL_DBIAS_ROWS, N);
    float s0 = 0.0f, s1 = 0.0f;
    for (long r = r0; r < r1; r++) {
        float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + r * OC + col));
        s0 += v.x;
        s1 += v.y;
    }
    partial[blockIdx.y * OC + col] = s0;
    partial[blockIdx.y * OC + col + 1] = s1;
}

static __global__ void matmul_dbias_finish_kernel(bf16* dbias, const float* partial, long chunks, long OC) {
    long col = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= OC) return;
    float s = 0.0f;
    for (long c = 0; c < chunks; c++) s += partial[c * OC + col];
    dbias[col] = __float2bfloat16(__bfloat162float(dbias[col]) + s);
}

// GELU's backward and the bias gradient of its input in one pass over the MLP's widest tensor: dpre = d ∘
// GELU'(pre) in bf16 (d may be dpre: in place), and the fp32 sums of those bf16 values over each chunk of
// MATMUL_DBIAS_ROWS rows, for matmul_dbias_finish_kernel; the bytes moved are GELU's backward's alone (the column
// sums re-read dpre: a third more). A block takes a tile of one chunk's rows and 256 columns: each warp every
// GELU_DBIAS_WARPS-th row of the chunk, each lane 8 adjacent columns (16-byte accesses where C is a multiple of
// 8, else one value at a time); the warps' sums then add up in shared memory in warp order, so the bias
// gradient does not depend on scheduling. A lane loads GELU_DBIAS_AHEAD rows before it writes any, so that
// loads stay in flight although dpre may be d.
constexpr int GELU_DBIAS_WARPS = 8, GELU_DBIAS_AHEAD = 4, GELU_DBIAS_COLUMNS = 8 * 32;

static __global__ void __launch_bounds__(32 * GELU_DBIAS_WARPS)
    gelu_backward_dbias_partial_kernel(bf16* dpre, float* partial, const bf16* pre, const bf16* d, long N, long C) {
    __shared__ float warp_sums[GELU_DBIAS_WARPS][GELU_DBIAS_COLUMNS];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long tile = (long)blockIdx.x * GELU_DBIAS_COLUMNS, col = tile + 8 * lane;
    long r0 = (long)blockIdx.y * MATMUL_DBIAS_ROWS, r1 = min(r0 + MATMUL_DBIAS_ROWS, N);
    const long stride = GELU_DBIAS_WARPS;
    float sum[8] = {};
    if (C % 8 == 0 && col < C) {
        for (long r = r0 + warp; r < r1; r += stride * GELU_DBIAS_AHEAD) {
            bf16x8 x[GELU_DBIAS_AHEAD], g[GELU_DBIAS_AHEAD];
#pragma unroll
            for (int u = 0; u < GELU_DBIAS_AHEAD; u++) {
                if (r + u * stride >= r1) break;
                x[u] = *reinterpret_cast<const bf16x8*>(pre + (r + u * stride) * C + col);
                g[u] = *reinterpret_cast<const bf16x8*>(d + (r + u * stride) * C + col);
            }
#pragma unroll
            for (int u = 0; u < GELU_DBIAS_AHEAD; u++) {
                if (r + u * stride >= r1) break;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float2 xv = __bfloat1622float2(x[u].h[j]), dv = __bfloat1622float2(g[u].h[j]);
                    g[u].h[j] = __floats2bfloat162_rn(gelu_derivative(xv.x) * dv.x, gelu_derivative(xv.y) * dv.y);
                    float2 out = __bfloat1622float2(g[u].h[j]);
                    sum[2 * j] += out.x;
                    sum[2 * j + 1] += out.y;
                }
                *reinterpret_cast<bf16x8*>(dpre + (r + u * stride) * C + col) = g[u];
            }
        }
    } else if (C % 8 != 0) {
        for (long r = r0 + warp; r < r1; r += stride) {
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (col + j >= C) break;
                long i = r * C + col + j;
                bf16 g = __float2bfloat16(gelu_derivative(__bfloat162float(pre[i])) * __bfloat162float(d[i]));
                dpre[i] = g;
                sum[j] += __bfloat162float(g);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 8; j++) warp_sums[warp][8 * lane + j] = sum[j];
    __syncthreads();
    for (int c = threadIdx.x; c < GELU_DBIAS_COLUMNS && tile + c < C; c += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < GELU_DBIAS_WARPS; w++) s += warp_sums[w][c];
        partial[blockIdx.y * C + tile + c] = s;
    }
}

// dpre[N×C] = d ∘ GELU'(pre) (d may be dpre), and dpre_bias[C] += its column sums when dpre_bias is not null;
// C even, scratch matmul_backward_scratch_floats(N, C)
inline void gelu_backward_dbias_cuda(bf16* dpre, bf16* dpre_bias, const bf16* pre, const bf16* d, long N, long C,
                                     float* scratch, cudaStream_t stream) {
    if (!dpre_bias) {
        gelu_backward_cuda(dpre, pre, d, N * C, stream);
        return;
    }
    if (N == 0) return;
    require_aligned_16("gelu_backward_dbias_cuda dpre", dpre);
    require_aligned_16("gelu_backward_dbias_cuda pre", pre);
    require_aligned_16("gelu_backward_dbias_cuda d", d);
    long chunks = (N + MATMUL_DBIAS_ROWS - 1) / MATMUL_DBIAS_ROWS;
    dim3 grid(cuda_blocks(C, GELU_DBIAS_COLUMNS), (unsigned int)chunks);
    gelu_backward_dbias_partial_kernel<<<grid, 32 * GELU_DBIAS_WARPS, 0, stream>>>(dpre, scratch, pre, d, N, C);
    cuda_check(cudaGetLastError());
    matmul_dbias_finish_kernel<<<cuda_blocks(C, 256), 256, 0, stream>>>(dpre_bias, scratch, chunks, C);
    cuda_check(cudaGetLastError());
}

// dbias += the bias gradient an epilogue wrote (bf16 already there: one rounding more than the column sums')
static __global__ void matmul_dbias_add_kernel(bf16* dbias, const bf16* grad, long OC) {
    long col = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (col < OC) dbias[col] = __float2bfloat16(__bfloat162float(dbias[col]) + __bfloat162float(grad[col]));
}

// dbias[OC] += column sums of dout[N×OC] on the kernels; OC even, scratch matmul_backward_scratch_floats(N, OC)
inline void matmul_dbias_cuda(bf16* dbias, const bf16* dout, long N, long OC, float* scratch, cudaStream_t stream) {
    if (N == 0) return;
    long chunks = (N + MATMUL_DBIAS_ROWS - 1) / MATMUL_DBIAS_ROWS;
    dim3 grid(cuda_blocks(OC / 2, 128), (unsigned int)chunks);
    matmul_dbias_partial_kernel<<<grid, 128, 0, stream>>>(scratch, dout, N, OC);
    cuda_check(cudaGetLastError());
    matmul_dbias_finish_kernel<<<cuda_blocks(OC, 256), 256, 0, stream>>>(dbias, scratch, chunks, OC);
    cuda_check(cudaGetLastError());
}

// What one bf16 backward runs: the weight GEMM's epilogue, or the column sums as kernels. A function of the call
// alone, so that a test without a GPU holds it to its one rule: the bias gradient happens exactly once, in the
// epilogue where cuBLASLt takes the shape, else in the kernels.
struct MatmulBackwardPlan {
    cublasLtEpilogue_t weight = CUBLASLT_EPILOGUE_DEFAULT;  // the weight-gradient GEMM's: BGRADB or none
    bool bias_kernels = false;                              // dbias from the column sums
};

// whether the epilogue takes a backward of this shape: rows to reduce, the leading dimensions C and OC whole
// 16-byte vectors of bf16, every pointer given 16-byte aligned
inline bool matmul_epilogues_fit(long N, long C, long OC, std::initializer_list<const void*> pointers) {
    if (N < 1 || C % 8 != 0 || OC % 8 != 0) return false;
    for (const void* p : pointers)
        if ((uintptr_t)p % 16 != 0) return false;
    return true;
}

// the plan of a backward with a weight gradient (dweight) and a bias gradient (dbias) or not, on a shape the
// epilogue takes (fits) or not
inline MatmulBackwardPlan plan_matmul_backward(bool dweight, bool dbias, bool fits) {
    MatmulBackwardPlan p;
    if (dweight && dbias && fits) p.weight = CUBLASLT_EPILOGUE_BGRADB;
    else p.bias_kernels = dbias;
    return p;
}

// dinp[N×C] = dout · weight (overwritten); dweight[OC×C] += doutᵀ · inp; dbias[OC] += column sums of dout (any
// of the three may be null). With pre_gelu (N×C: GELU's input, whose output is inp) the input gradient goes on
// through GELU, dinp = (dout · weight) ∘ GELU'(pre_gelu), and dpre_bias[C] (may be null) += the column sums of
// that, the bias gradient of the matmul whose output GELU took. scratch holds matmul_backward_scratch_floats(N,
// OC) floats, (N, max(OC, C)) with dpre_bias; the column sums want OC (C) even.
inline void matmul_backward_cuda(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                                 const bf16* weight, long N, long C, long OC, float* scratch, cudaStream_t stream,
                                 const bf16* pre_gelu = nullptr, bf16* dpre_bias = nullptr) {
    if (pre_gelu && !dinp) fail("matmul backward: GELU's backward goes with the input gradient, and there is none");
    if (dpre_bias && !pre_gelu) fail("matmul backward: the bias gradient of GELU's input without GELU's backward");
    bool fits = matmul_epilogues_fit(N, C, OC, {dweight, dout, inp});
    MatmulBackwardPlan plan = plan_matmul_backward(dweight, dbias, fits);
    bf16* epilogue_dbias = reinterpret_cast<bf16*>(scratch);  // the epilogue's bias gradient, until it is added
    if (dinp) {
        // dinpᵀ[C×N] = (W as C×OC) · (dout as OC×N)
        cublaslt_matmul(dinp, weight, dout, nullptr, nullptr, false, false, C, N, OC, 0.0f, CUBLASLT_EPILOGUE_DEFAULT,
                        stream);
        if (pre_gelu) gelu_backward_dbias_cuda(dinp, dpre_bias, pre_gelu, dinp, N, C, scratch, stream);
    }
    if (dweight) {
        // dWᵀ[C×OC] += (inp as C×N) · (dout as OC×N)ᵀ
        auto weight_gemm = [&](cublasLtEpilogue_t e) {
            bool bgrad = e == CUBLASLT_EPILOGUE_BGRADB;
            return cublaslt_matmul(dweight, inp, dout, bgrad ? epilogue_dbias : nullptr, nullptr, false, true, C, OC,
                                   N, 1.0f, e, stream, {}, bgrad);
        };
        if (!weight_gemm(plan.weight)) {
            plan.weight = CUBLASLT_EPILOGUE_DEFAULT;
            plan.bias_kernels = true;
            weight_gemm(plan.weight);
        }
        if (plan.weight == CUBLASLT_EPILOGUE_BGRADB) {
            matmul_dbias_add_kernel<<<cuda_blocks(OC, 256), 256, 0, stream>>>(dbias, epilogue_dbias, OC);
            cuda_check(cudaGetLastError());
        }
    }
    if (plan.bias_kernels) matmul_dbias_cuda(dbias, dout, N, OC, scratch, stream);
}

// ----------------------------------------------------------------------------------------------------------
// the model's entry points: the CPU functions above and, for bf16, cuBLASLt (which keeps its own workspace, so
// the model's `workspace` is the CPU's packing panels and, on the GPU, the bias gradients' partial sums). The
// MLP's matmuls and its GELU are one call on both devices each way: forward the first matmul and GELU, backward
// the second matmul and GELU (cuBLASLt epilogues on the GPU).

// pre_gelu = inp · Wᵀ + bias, out = GELU(pre_gelu)
inline void matmul_gelu_forward(float* out, float* pre_gelu, const float* inp, const float* weight, const float* bias,
                                long N, long C, long OC, Workspace workspace) {
    ProfileScope op("matmul forward");
    matmul_forward(pre_gelu, inp, weight, bias, N, C, OC, workspace);
    gelu_forward(out, pre_gelu, N * OC);
}

// dpre[N×C] ∘= GELU'(pre) (dpre holds the gradient of GELU's output), and dpre_bias[C] += the column sums of that
// (may be null): GELU's backward with the bias gradient of the matmul whose output GELU took
inline void gelu_backward_dbias(float* dpre, float* dpre_bias, const float* pre, long N, long C, Workspace workspace) {
    ProfileScope op("gelu backward");
    gelu_backward(dpre, pre, dpre, N * C);
    if (dpre_bias) matmul_backward(nullptr, nullptr, dpre_bias, dpre, nullptr, nullptr, N, 0, C, workspace);
}

// The backward of out[N×OC] = GELU(pre_gelu) · weightᵀ + bias, with inp[N×C] = GELU(pre_gelu) as forward kept
// it: matmul_backward's gradients (dweight, dbias may be null), the input's carried on through GELU into
// dpre[N×C] = dL/dpre_gelu (overwritten), and dpre_bias[C] += its column sums, the bias gradient of the matmul
// that made pre_gelu (may be null: a split backward leaves it to that matmul's weight-gradient step).
inline void gelu_matmul_backward(float* dpre, float* dweight, float* dbias, float* dpre_bias, const float* dout,
                                 const float* inp, const float* pre_gelu, const float* weight, long N, long C, long OC,
                                 Workspace workspace) {
    ProfileScope op("matmul backward");
    matmul_backward(dpre, dweight, dbias, dout, inp, weight, N, C, OC, workspace);
    gelu_backward_dbias(dpre, dpre_bias, pre_gelu, N, C, workspace);
}

inline void matmul_forward(bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, long N, long C, long OC,
                           Workspace) {
    ProfileScope op("matmul forward");
    matmul_forward_cuda(out, inp, weight, bias, N, C, OC, nullptr, main_stream());
}
inline void matmul_gelu_forward(bf16* out, bf16* pre_gelu, const bf16* inp, const bf16* weight, const bf16* bias,
                                long N, long C, long OC, Workspace) {
    ProfileScope op("matmul forward");
    matmul_forward_cuda(out, inp, weight, bias, N, C, OC, pre_gelu, main_stream());
}
inline void matmul_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                            const bf16* weight, long N, long C, long OC, Workspace workspace) {
    ProfileScope op("matmul backward");
    // the scratch holds the bias gradient: none without a bias (the classifier's 50304 columns)
    float* scratch = dbias ? workspace.take((size_t)matmul_backward_scratch_floats(N, OC), "matmul_backward") : nullptr;
    matmul_backward_cuda(dinp, dweight, dbias, dout, inp, weight, N, C, OC, scratch, main_stream());
}
inline void gelu_backward_dbias(bf16* dpre, bf16* dpre_bias, const bf16* pre, long N, long C, Workspace workspace) {
    ProfileScope op("gelu backward");
    float* scratch =
        dpre_bias ? workspace.take((size_t)matmul_backward_scratch_floats(N, C), "gelu_backward_dbias") : nullptr;
    gelu_backward_dbias_cuda(dpre, dpre_bias, pre, dpre, N, C, scratch, main_stream());
}
inline void gelu_matmul_backward(bf16* dpre, bf16* dweight, bf16* dbias, bf16* dpre_bias, const bf16* dout,
                                 const bf16* inp, const bf16* pre_gelu, const bf16* weight, long N, long C, long OC,
                                 Workspace workspace) {
    ProfileScope op("matmul backward");
    long widest = dpre_bias ? std::max(OC, C) : OC;
    float* scratch = dbias || dpre_bias
                         ? workspace.take((size_t)matmul_backward_scratch_floats(N, widest), "gelu_matmul_backward")
                         : nullptr;
    matmul_backward_cuda(dpre, dweight, dbias, dout, inp, weight, N, C, OC, scratch, main_stream(), pre_gelu,
                         dpre_bias);
}

// out (R×OC) = sum + bias on every row (sum may be out): a row-parallel layer's bias (llmc/tp.cuh), added once
// the group has summed the partial products
inline void add_bias_rows(float* out, const float* sum, const float* bias, long R, int OC) {
#pragma omp parallel for
    for (long r = 0; r < R; r++)
        for (int o = 0; o < OC; o++) out[r * OC + o] = sum[r * OC + o] + bias[o];
}
static __global__ void add_bias_rows_kernel(bf16* out, const bf16* sum, const bf16* bias, long R, int OC) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < R * OC; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(__bfloat162float(sum[i]) + __bfloat162float(bias[i % OC]));
}
inline void add_bias_rows(bf16* out, const bf16* sum, const bf16* bias, long R, int OC) {
    launch_elementwise(add_bias_rows_kernel, R * OC, out, sum, bias, R, OC);
}
