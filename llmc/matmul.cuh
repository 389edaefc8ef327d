// Matrix multiplication for the linear layers: out = inp · Wᵀ + bias, and its backward.
// CPU: one packed, blocked GEMM (the BLIS scheme: pack a block of A into MR-row panels and a block of B into
// NR-column panels, then a register-tiled micro-kernel sweeps them), OpenMP over output tiles. Every output
// element is summed in the same order whatever the thread count, so results are bit-reproducible.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>

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
                           long OC, float* workspace) {
    if (bias) {
#pragma omp parallel for
        for (long n = 0; n < N; n++) memcpy(out + n * OC, bias, OC * sizeof(float));
    }
    gemm(N, OC, C, MatView{inp, C, 1}, MatView{weight, 1, C}, out, OC, bias != nullptr, workspace);
}

// dinp[N×C] = dout · weight (overwritten); dweight[OC×C] += doutᵀ · inp; dbias[OC] += column sums of dout
inline void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, long N, long C, long OC, float* workspace) {
    gemm(N, C, OC, MatView{dout, OC, 1}, MatView{weight, C, 1}, dinp, C, false, workspace);
    gemm(OC, C, N, MatView{dout, 1, OC}, MatView{inp, C, 1}, dweight, C, true, workspace);
    if (dbias) {
#pragma omp parallel for
        for (long o = 0; o < OC; o++) {
            float sum = 0.0f;
            for (long n = 0; n < N; n++) sum += dout[n * OC + o];
            dbias[o] += sum;
        }
    }
}
