// A rank's experts run as one: X experts' MLPs (llmc/mlp.cuh) over their contiguous rows, expert-major, expert x on
// rows first[x] .. first[x+1]-1 with its tensors expert_view(stacked, x, shape). The CPU runs each expert's mlp_*
// calls in turn, as llmc/moe.cuh always has. On the GPU that loop makes 2 cuBLASLt calls per expert forward and 4
// backward (256 and 512 a layer for Qwen3-30B-A3B's 128 experts), each a GEMM of a few hundred to a few thousand
// rows, whose launches and ragged last waves cost what one GEMM over all the experts would not. So each GEMM of the
// MLP is one call for all of a rank's experts, cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx: one group per
// expert that has rows, since their row counts differ), and what cuBLASLt's epilogues did per expert becomes a
// kernel over every row that finds each row's expert in `first`: the biases (added to the GEMM's bf16 output rather
// than in its epilogue), GELU, and the bias gradients (each expert's column sums in a fixed order: deterministic).
// SwiGLU, and GELU without a bias, are the elementwise kernels of llmc/swiglu.cuh and llmc/gelu.cuh over all the
// rows at once. The grouped passes compile for the CPU too, every GEMM and kernel a plain loop there: the model's CPU
// path keeps the mlp_* loop (its numbers unchanged to the bit), and the tests run the grouped passes' descriptors on
// the CPU against it, without a GPU.
//
// The loop stays where the grouped GEMM cannot run, said once per process on stderr: under FP8 (cuBLAS 13's
// grouped GEMM takes bf16, fp16 and fp32 operands, no FP8 ones), where libcublas or its grouped GEMM is missing, and
// once cuBLAS has answered CUBLAS_STATUS_NOT_SUPPORTED (the GEMM it refused, and the others of that call, then run
// one cuBLASLt call per expert, so that no gradient is accumulated twice). libcublas is opened on first use, as
// cuBLASLt is (llmc/cuda_common.cuh), and its handle shares cuBLASLt's workspace: both run on main_stream() only.
#pragma once

#include <dlfcn.h>

#include <algorithm>
#include <string>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/device.cuh"
#include "llmc/gelu.cuh"
#include "llmc/matmul.cuh"
#include "llmc/mlp.cuh"
#include "llmc/profile.h"
#include "llmc/swiglu.cuh"

// expert x's tensors among the stacked ones (null where they are)
template <typename floatX>
inline MlpTensorViews<floatX> expert_view(const MlpTensorViews<floatX>& stacked, int x, const MlpShape& s) {
    auto at = [&](floatX* p, long block) { return p ? p + x * block : nullptr; };
    return {at(stacked.fcw, (long)s.FC() * s.C), at(stacked.fcb, s.FC()), at(stacked.fcprojw, (long)s.C * s.H),
            at(stacked.fcprojb, s.C)};
}

// ==========================================================================================================
// CUDA: cuBLAS's grouped GEMM, opened on first use

struct CublasGrouped {
    decltype(&cublasCreate_v2) create = nullptr;
    decltype(&cublasSetStream_v2) set_stream = nullptr;
    decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
    decltype(&cublasGemmGroupedBatchedEx) gemm = nullptr;
    cublasHandle_t handle = nullptr;
    std::string missing;  // why the grouped GEMM cannot run in this process ("" while it can)
    // first (int64) and the GEMMs' pointer arrays, which cuBLAS reads from device memory: built on the host and
    // copied on main_stream() through pinned memory without waiting (llmc/device.cuh's AsyncUploads), so each
    // call's arrays are in place before its GEMMs run and a later call's copy waits for them
    std::vector<uint64_t> words;
    uint64_t* device = nullptr;
    size_t capacity = 0;
    AsyncUploads<bf16> uploads;
};

// one per process, as cuBLASLt's handle (llmc/cuda_common.cuh says why), created on first use and never freed
inline CublasGrouped& cublas_grouped() {
    static CublasGrouped* grouped = [] {
        auto* g = new CublasGrouped();
        std::string soname;
        void* lib = open_cublas_library("libcublas", soname);
        if (!lib) {
            g->missing = strfmt("%s cannot be opened: %s", soname.c_str(), dlerror());
            return g;
        }
        auto find = [&](auto& function, const char* name) {
            if (!find_symbol(lib, function, name) && g->missing.empty())
                g->missing = strfmt("%s has no %s", soname.c_str(), name);
        };
        find(g->create, "cublasCreate_v2");
        find(g->set_stream, "cublasSetStream_v2");
        find(g->set_workspace, "cublasSetWorkspace_v2");
        find(g->gemm, "cublasGemmGroupedBatchedEx");
        if (!g->missing.empty()) return g;
        cublasStatus_t status = g->create(&g->handle);
        if (status != CUBLAS_STATUS_SUCCESS) {
            g->missing = strfmt("cublasCreate: cuBLAS error %d", (int)status);
            return g;
        }
        // the stream first: setting it puts the handle back on cuBLAS's own workspace pool
        CublasLtContext& lt = cublaslt();
        cublas_check(g->set_stream(g->handle, main_stream()));
        cublas_check(g->set_workspace(g->handle, lt.workspace, lt.workspace_bytes));
        return g;
    }();
    return *grouped;
}

// "" when the grouped GEMMs can run in this process, else why not (the tests and dev/cuda/experts ask, so that a
// comparison of the grouped path with the loop cannot pass by running the loop twice)
inline std::string experts_grouped_missing() { return cublas_grouped().missing; }

// the per-expert loop in place of the grouped GEMMs, said once per reason
inline void experts_say_loop(const char* why) {
    static std::vector<std::string> said;
    for (const std::string& s : said)
        if (s == why) return;
    said.push_back(why);
    fprintf(stderr, "experts: one GEMM per expert (%s)\n", why);
}

// One GEMM of the MLP for every expert with rows, in cuBLAS's column-major terms: C_g = op(A_g)·op(B_g) + beta·C_g,
// the leading dimensions the same for every group, m, n, k each group's. at: where its three pointer arrays (A's,
// B's, C's, a group's each) start among the uploaded words.
struct ExpertsGemm {
    bool transa, transb;
    int lda, ldb, ldc;
    float beta;
    std::vector<int> m, n, k;
    std::vector<const void*> a, b;
    std::vector<void*> c;
    size_t at = 0;
    void add(int m_, int n_, int k_, const void* a_, const void* b_, void* c_) {
        m.push_back(m_), n.push_back(n_), k.push_back(k_), a.push_back(a_), b.push_back(b_), c.push_back(c_);
    }
};

// Where the kernels over every row find each row's expert: first on the host (the CPU's loops) and, on the GPU, the
// same X + 1 values as int64 in device memory
struct ExpertsFirst {
    const std::vector<int>& host;
    const int64_t* device;
    int X() const { return (int)host.size() - 1; }
    long rows() const { return host.back() - host.front(); }
};

// first and the GEMMs' pointer arrays into the device words (on the CPU nothing moves)
template <typename floatX>
inline ExpertsFirst experts_upload(const std::vector<int>& first, std::vector<ExpertsGemm*> gemms) {
    if constexpr (device_of<floatX> != Device::CUDA) {
        return {first, nullptr};
    } else {
        CublasGrouped& g = cublas_grouped();
        g.words.assign(first.begin(), first.end());
        for (ExpertsGemm* e : gemms) {
            e->at = g.words.size();
            for (const void* p : e->a) g.words.push_back((uint64_t)(uintptr_t)p);
            for (const void* p : e->b) g.words.push_back((uint64_t)(uintptr_t)p);
            for (void* p : e->c) g.words.push_back((uint64_t)(uintptr_t)p);
        }
        size_t n = g.words.size();
        if (n > g.capacity) {
            if (g.device) cuda_check(cudaFreeAsync(g.device, main_stream()));
            g.capacity = std::max<size_t>(2 * n, 1024);
            cuda_check(cudaMallocAsync(&g.device, g.capacity * sizeof(uint64_t), main_stream()));
        }
        g.uploads.upload(g.device, g.words.data(), n);
        return {first, reinterpret_cast<const int64_t*>(g.device)};
    }
}

// Runs one ExpertsGemm. CPU: each group's product as cuBLAS defines it, in plain loops (the reference the
// descriptors are tested against without a GPU). GPU: the grouped call, or one cuBLASLt call per group where cuBLAS
// has refused a grouped GEMM (this one, or an earlier one: then the loop of mlp_* calls takes every call from the
// next on) or where a matrix is not 16-byte aligned (cuBLAS wants bf16 matrices so, or as aligned as their rows).
template <typename floatX>
inline void experts_gemm(const ExpertsGemm& e) {
    ProfileScope op("experts matmul");
    int G = (int)e.m.size();
    if (G == 0) return;
    if constexpr (device_of<floatX> != Device::CUDA) {
        for (int i = 0; i < G; i++) {
            const float *A = (const float*)e.a[i], *B = (const float*)e.b[i];
            float* Cm = (float*)e.c[i];
            long m = e.m[i], n = e.n[i], k = e.k[i], lda = e.lda, ldb = e.ldb, ldc = e.ldc;
#pragma omp parallel for
            for (long j = 0; j < n; j++)
                for (long r = 0; r < m; r++) {
                    float sum = 0.0f;
                    for (long p = 0; p < k; p++)
                        sum += (e.transa ? A[p + r * lda] : A[r + p * lda]) * (e.transb ? B[j + p * ldb] : B[p + j * ldb]);
                    Cm[r + j * ldc] = sum + (e.beta != 0.0f ? e.beta * Cm[r + j * ldc] : 0.0f);
                }
        }
    } else {
        CublasGrouped& g = cublas_grouped();
        bool aligned = true;
        for (int i = 0; i < G; i++)
            aligned = aligned && (uintptr_t)e.a[i] % 16 == 0 && (uintptr_t)e.b[i] % 16 == 0 && (uintptr_t)e.c[i] % 16 == 0;
        if (!aligned) experts_say_loop("a grouped GEMM's matrices are not all 16-byte aligned: one cuBLASLt call each");
        if (g.missing.empty() && aligned) {
            std::vector<cublasOperation_t> ta(G, e.transa ? CUBLAS_OP_T : CUBLAS_OP_N),
                tb(G, e.transb ? CUBLAS_OP_T : CUBLAS_OP_N);
            std::vector<int> lda(G, e.lda), ldb(G, e.ldb), ldc(G, e.ldc), size(G, 1);
            std::vector<float> alpha(G, 1.0f), beta(G, e.beta);  // host memory: the handle's pointer mode is the host's
            const void* const* A = reinterpret_cast<const void* const*>(g.device + e.at);
            const void* const* B = reinterpret_cast<const void* const*>(g.device + e.at + G);
            void* const* C = reinterpret_cast<void* const*>(g.device + e.at + 2 * G);
            cublasStatus_t status =
                g.gemm(g.handle, ta.data(), tb.data(), e.m.data(), e.n.data(), e.k.data(), alpha.data(), A, CUDA_R_16BF,
                       lda.data(), B, CUDA_R_16BF, ldb.data(), beta.data(), C, CUDA_R_16BF, ldc.data(), G, size.data(),
                       CUBLAS_COMPUTE_32F);
            if (status == CUBLAS_STATUS_SUCCESS) return;
            if (status != CUBLAS_STATUS_NOT_SUPPORTED)
                fail("cublasGemmGroupedBatchedEx: cuBLAS error %d (%d groups, transa=%d transb=%d, m=%d k=%d first)",
                     (int)status, G, (int)e.transa, (int)e.transb, e.m[0], e.k[0]);
            g.missing = "cuBLAS answered CUBLAS_STATUS_NOT_SUPPORTED to a grouped GEMM";
            experts_say_loop(g.missing.c_str());
        }
        for (int i = 0; i < G; i++)
            cublaslt_matmul((bf16*)e.c[i], e.a[i], e.b[i], nullptr, nullptr, e.transa, e.transb, e.m[i], e.n[i], e.k[i],
                            e.beta, CUBLASLT_EPILOGUE_DEFAULT, main_stream());
    }
}

// ----------------------------------------------------------------------------------------------------------
// The kernels over every row (rows first[0] .. first[X]-1 of `width` values), each row's expert from first: a CPU
// loop and its CUDA kernel for each

// y[r, :] += bias[expert of r, :] (bias null: y as it is), then act = GELU(y) where act is not null
inline void experts_bias_gelu(float* y, float* act, const float* bias, const ExpertsFirst& f, long width) {
    ProfileScope op("gelu forward");
    const std::vector<int>& first = f.host;
    if (bias)
        for (int x = 0; x < f.X(); x++)
#pragma omp parallel for
            for (long r = first[x]; r < first[x + 1]; r++)
                for (long j = 0; j < width; j++) y[r * width + j] += bias[x * width + j];
    if (act) gelu_forward(act + first[0] * width, y + first[0] * width, f.rows() * width);
}

// the expert whose rows hold `row` (first[0] <= row < first[X]): the last x with first[x] <= row, which has rows
static __device__ __forceinline__ int experts_of_row(const int64_t* first, int X, long row) {
    int lo = 0, hi = X - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= row) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// the sum rounded to bf16, GELU from that: a block per row at a time, the threads across the row
static __global__ void experts_bias_gelu_kernel(bf16* y, bf16* act, const bf16* bias, const int64_t* first, int X,
                                                long width) {
    for (long r = first[0] + blockIdx.x; r < first[X]; r += gridDim.x) {
        const bf16* b = bias ? bias + experts_of_row(first, X, r) * width : nullptr;
        for (long j = threadIdx.x; j < width; j += blockDim.x) {
            bf16 v = y[r * width + j];
            if (b) y[r * width + j] = v = __float2bfloat16(__bfloat162float(v) + __bfloat162float(b[j]));
            if (act) act[r * width + j] = __float2bfloat16(gelu_value(__bfloat162float(v)));
        }
    }
}
inline void experts_bias_gelu(bf16* y, bf16* act, const bf16* bias, const ExpertsFirst& f, long width) {
    ProfileScope op("gelu forward");
    long rows = f.rows();
    if (rows == 0 || (!bias && !act)) return;
    int threads = (int)std::min<long>(256, (width + 31) / 32 * 32);
    experts_bias_gelu_kernel<<<(unsigned int)std::min<long>(rows, 65536), threads, 0, main_stream()>>>(
        y, act, bias, f.device, f.X(), width);
    cuda_check(cudaGetLastError());
}

// dbias[x, :] += the column sums of expert x's rows of d (an expert without rows adds nothing); null: none
inline void experts_dbias(float* dbias, const float* d, const ExpertsFirst& f, long width) {
    ProfileScope op("matmul backward");
    if (!dbias) return;
    const std::vector<int>& first = f.host;
    for (int x = 0; x < f.X(); x++)
#pragma omp parallel for
        for (long j = 0; j < width; j++) {
            float sum = 0.0f;
            for (long r = first[x]; r < first[x + 1]; r++) sum += d[r * width + j];
            dbias[x * width + j] += sum;
        }
}

// a block per expert and 64 columns, each lane two adjacent columns, 8 warps over every 8th row; the warps' sums then
// add in warp order, so the sum does not depend on scheduling
constexpr int EXPERTS_DBIAS_WARPS = 8, EXPERTS_DBIAS_COLUMNS = 64;
static __global__ void __launch_bounds__(32 * EXPERTS_DBIAS_WARPS)
    experts_dbias_kernel(bf16* dbias, const bf16* d, const int64_t* first, long width) {
    __shared__ float sums[EXPERTS_DBIAS_WARPS][EXPERTS_DBIAS_COLUMNS];
    int x = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long tile = (long)blockIdx.x * EXPERTS_DBIAS_COLUMNS, col = tile + 2 * lane;
    long r0 = first[x], r1 = first[x + 1];
    if (r0 == r1) return;  // the whole block
    float s0 = 0.0f, s1 = 0.0f;
    for (long r = r0 + warp; r < r1; r += EXPERTS_DBIAS_WARPS) {
        if (col < width) s0 += __bfloat162float(d[r * width + col]);
        if (col + 1 < width) s1 += __bfloat162float(d[r * width + col + 1]);
    }
    sums[warp][2 * lane] = s0, sums[warp][2 * lane + 1] = s1;
    __syncthreads();
    if (threadIdx.x >= EXPERTS_DBIAS_COLUMNS || tile + threadIdx.x >= width) return;
    float s = 0.0f;
    for (int w = 0; w < EXPERTS_DBIAS_WARPS; w++) s += sums[w][threadIdx.x];
    bf16* out = dbias + x * width + tile + threadIdx.x;
    *out = __float2bfloat16(__bfloat162float(*out) + s);
}
inline void experts_dbias(bf16* dbias, const bf16* d, const ExpertsFirst& f, long width) {
    ProfileScope op("matmul backward");
    if (!dbias || f.X() == 0) return;
    dim3 grid(cuda_blocks(width, EXPERTS_DBIAS_COLUMNS), f.X());
    experts_dbias_kernel<<<grid, 32 * EXPERTS_DBIAS_WARPS, 0, main_stream()>>>(dbias, d, f.device, width);
    cuda_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------
// The grouped passes: each builds its GEMMs over the experts that have rows, uploads their pointer arrays with first,
// and runs them in the order of mlp.cuh's calls. The GPU's path; on the CPU they run the same descriptors through
// experts_gemm's loops, so that the tests check them against the mlp_* loop without a GPU (the CPU's entry points
// below run the loop).

// the experts with rows
inline std::vector<int> experts_with_rows(const std::vector<int>& first) {
    std::vector<int> live;
    for (int x = 0; x + 1 < (int)first.size(); x++)
        if (first[x + 1] > first[x]) live.push_back(x);
    return live;
}

template <typename floatX>
inline void experts_forward_grouped(floatX* out, floatX* fch, floatX* act, const floatX* in,
                                    const MlpTensorViews<floatX>& w, const std::vector<int>& first, const MlpShape& s) {
    int C = s.C, H = s.H, FC = s.FC();
    bool gelu = s.activation == Activation::GELU;
    // fchᵀ[FC×n] = (fcw as C×FC)ᵀ·(in as C×n); outᵀ[C×n] = (fcprojw as H×C)ᵀ·(act as H×n)
    ExpertsGemm fc{true, false, C, C, FC, 0.0f}, proj{true, false, H, H, C, 0.0f};
    for (int x : experts_with_rows(first)) {
        long f = first[x];
        int n = first[x + 1] - first[x];
        MlpTensorViews<floatX> v = expert_view(w, x, s);
        fc.add(FC, n, C, v.fcw, in + f * C, fch + f * FC);
        proj.add(C, n, H, v.fcprojw, act + f * H, out + f * C);
    }
    if (fc.m.empty()) return;
    ExpertsFirst rows = experts_upload<floatX>(first, {&fc, &proj});
    long r0 = first.front();
    experts_gemm<floatX>(fc);
    if (gelu && !w.fcb) {
        gelu_forward(act + r0 * H, fch + r0 * FC, rows.rows() * H);
    } else {
        experts_bias_gelu(fch, gelu ? act : nullptr, w.fcb, rows, FC);
        if (!gelu) swiglu_forward(act + r0 * H, fch + r0 * FC, rows.rows(), H);
    }
    experts_gemm<floatX>(proj);
    experts_bias_gelu(out, (floatX*)nullptr, w.fcprojb, rows, C);
}

// dw's null entries are not taken; without input_gradient, the weight gradients alone (experts_weight_grads: dfch is
// given, and din, dact and fch are not read)
template <typename floatX>
inline void experts_backward_grouped(floatX* din, const MlpTensorViews<floatX>& dw, const floatX* dout, floatX* dfch,
                                     floatX* dact, const floatX* fch, const floatX* act, const floatX* in,
                                     const MlpTensorViews<floatX>& w, const std::vector<int>& first, const MlpShape& s,
                                     bool input_gradient) {
    int C = s.C, H = s.H, FC = s.FC();
    bool gelu = s.activation == Activation::GELU;
    floatX* dhidden = gelu ? dfch : dact;  // the gradient of act (GELU's backward then runs in place in dfch)
    if (input_gradient && !dhidden) fail("experts_backward: SwiGLU's experts need dact (rows×H)");
    // dactᵀ[H×n] = (fcprojw as H×C)·(dout as C×n)            dfcprojwᵀ[H×C] += (act as H×n)·(dout as C×n)ᵀ
    // dfcwᵀ[C×FC] += (in as C×n)·(dfch as FC×n)ᵀ              dinᵀ[C×n] = (fcw as C×FC)·(dfch as FC×n)
    ExpertsGemm to_act{false, false, H, C, H, 0.0f}, proj_w{false, true, H, C, H, 1.0f},
        fc_w{false, true, C, FC, C, 1.0f}, to_in{false, false, C, FC, C, 0.0f};
    std::vector<int> live = experts_with_rows(first);
    for (int x : live) {
        long f = first[x];
        int n = first[x + 1] - first[x];
        MlpTensorViews<floatX> v = expert_view(w, x, s), dv = expert_view(dw, x, s);
        if (input_gradient) to_act.add(H, n, C, v.fcprojw, dout + f * C, dhidden + f * H);
        if (dv.fcprojw) proj_w.add(H, C, n, act + f * H, dout + f * C, dv.fcprojw);
        if (dv.fcw) fc_w.add(C, FC, n, in + f * C, dfch + f * FC, dv.fcw);
        if (input_gradient && din) to_in.add(C, n, FC, v.fcw, dfch + f * FC, din + f * C);
    }
    if (live.empty()) return;
    ExpertsFirst rows = experts_upload<floatX>(first, {&to_act, &proj_w, &fc_w, &to_in});
    long r0 = first.front();
    // every read of dout (the first three) before din, which may be dout, is written
    experts_gemm<floatX>(to_act);
    experts_gemm<floatX>(proj_w);
    experts_dbias(dw.fcprojb, dout, rows, C);
    if (input_gradient) {
        if (gelu) gelu_backward(dfch + r0 * FC, fch + r0 * FC, dfch + r0 * FC, rows.rows() * H);
        else swiglu_backward(dfch + r0 * FC, fch + r0 * FC, dact + r0 * H, rows.rows(), H);
    }
    experts_dbias(dw.fcb, dfch, rows, FC);
    experts_gemm<floatX>(fc_w);
    experts_gemm<floatX>(to_in);
}

// ----------------------------------------------------------------------------------------------------------
// The entry points, on both devices: the loop of mlp_* calls on the CPU, the grouped passes on the GPU unless
// grouped = false (the tests and dev/cuda/experts compare the two) or they cannot run there.

// whether this call on the GPU runs the grouped passes (the reasons it does not, said once)
template <typename floatX>
inline bool experts_run_grouped(bool grouped, const Fp8Scaling<floatX>* fp8) {
    if constexpr (device_of<floatX> != Device::CUDA) {
        return false;
    } else {
        if (!grouped) return false;
        if (fp8) {
            experts_say_loop("cuBLAS's grouped GEMM takes no FP8");
            return false;
        }
        const std::string& missing = cublas_grouped().missing;
        if (!missing.empty()) experts_say_loop(missing.c_str());
        return missing.empty();
    }
}

// X experts' MLPs over their contiguous rows: expert x takes rows first[x] .. first[x+1]-1 (first has X+1 entries,
// on the host), its tensors expert_view(stacked, x, s); out (rows×C) from in (rows×C), fch (rows×FC) and act (rows×H)
// kept for backward
template <typename floatX>
inline void experts_forward(floatX* out, floatX* fch, floatX* act, const floatX* in, const MlpTensorViews<floatX>& stacked,
                            const std::vector<int>& first, const MlpShape& s, Workspace ws, const Fp8Scaling<floatX>* fp8,
                            bool grouped = true) {
    if (experts_run_grouped(grouped, fp8)) return experts_forward_grouped(out, fch, act, in, stacked, first, s);
    int C = s.C;
    long FC = s.FC(), H = s.H;
    for (int x = 0; x + 1 < (int)first.size(); x++) {
        long f = first[x], n = first[x + 1] - f;
        if (n == 0) continue;
        mlp_forward(out + f * C, fch + f * FC, act + f * H, in + f * C, expert_view(stacked, x, s), n, s, ws, fp8);
    }
}

// din (rows×C) from dout (rows×C), din may be dout (every read of dout comes first) or null; dfch (rows×FC) and dact
// (rows×H, SwiGLU's; null under GELU) over all the rows; dstacked accumulates the gradients it has entries for (all
// null: a split backward, experts_weight_grads to follow)
template <typename floatX>
inline void experts_backward(floatX* din, const MlpTensorViews<floatX>& dstacked, const floatX* dout, floatX* dfch,
                             floatX* dact, const floatX* fch, const floatX* act, const floatX* in,
                             const MlpTensorViews<floatX>& stacked, const std::vector<int>& first, const MlpShape& s,
                             Workspace ws, const Fp8Scaling<floatX>* fp8, bool grouped = true) {
    if (experts_run_grouped(grouped, fp8))
        return experts_backward_grouped(din, dstacked, dout, dfch, dact, fch, act, in, stacked, first, s, true);
    int C = s.C;
    long FC = s.FC(), H = s.H;
    for (int x = 0; x + 1 < (int)first.size(); x++) {
        long f = first[x], n = first[x + 1] - f;
        if (n == 0) continue;
        mlp_backward(din ? din + f * C : nullptr, expert_view(dstacked, x, s), dout + f * C, dfch + f * FC,
                     dact ? dact + f * H : nullptr, fch + f * FC, act + f * H, in + f * C, expert_view(stacked, x, s), n,
                     s, ws, fp8);
    }
}

// the weight gradients a split backward left, from the output gradients it kept (dout: rows×C, dfch: rows×FC)
template <typename floatX>
inline void experts_weight_grads(const MlpTensorViews<floatX>& dstacked, const floatX* dout, const floatX* dfch,
                                 const floatX* act, const floatX* in, const MlpTensorViews<floatX>& stacked,
                                 const std::vector<int>& first, const MlpShape& s, Workspace ws,
                                 const Fp8Scaling<floatX>* fp8, bool grouped = true) {
    if (experts_run_grouped(grouped, fp8))
        return experts_backward_grouped((floatX*)nullptr, dstacked, dout, const_cast<floatX*>(dfch), (floatX*)nullptr,
                                        (const floatX*)nullptr, act, in, stacked, first, s, false);
    int C = s.C;
    long FC = s.FC(), H = s.H;
    for (int x = 0; x + 1 < (int)first.size(); x++) {
        long f = first[x], n = first[x + 1] - f;
        if (n == 0) continue;
        mlp_weight_grads(expert_view(dstacked, x, s), dout + f * C, dfch + f * FC, act + f * H, in + f * C,
                         expert_view(stacked, x, s), n, s, ws, fp8);
    }
}
