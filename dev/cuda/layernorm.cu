// layernorm: the LayerNorm kernels of llmc/norm.cuh (variant 2) beside the ones they replaced (variant 1), each checked
// against the CPU reference (outputs poisoned first) and timed against the copy bandwidth on GPT-2 124M's shape at
// B=64, T=1024 (each activation 100 MB, twice the H100's L2) and on d48's width, 1600.
//   variant 1: a warp per row, three passes over the row with 4-byte accesses (L1 serves the second and third
//              reads); the backward's parameter gradients summed by C threads over N/64 partial rows each
//   variant 2: a warp per row held in registers, one pass, 16-byte accesses; the parameter-gradient partials
//              summed per block in shared memory, and their final sum spread over column groups and row phases
// Checks: fused residual + layernorm (residual, out, mean, rstd), the same with the residual stream updated in
// place, plain forward, backward (dinp, dweight, dbias accumulated into random values), the backward's bits
// reproducible. Inputs and the CPU reference: NormCase in norm_case.h.
#include "dev/cuda/norm_case.h"

// ------------------------------------------------------------------------------------------------------------
// variant 1, as llmc/layernorm.cuh (now llmc/norm.cuh) had it

// x = inp1 + inp2 rounded to bf16 (the value the residual stream stores, which the backward will see), or inp1
static __device__ __forceinline__ float2 layernorm_input_v1(const bf16* inp1, const bf16* inp2, long i) {
    float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(inp1 + i));
    if (!inp2) return a;
    float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(inp2 + i));
    return __bfloat1622float2(__floats2bfloat162_rn(a.x + b.x, a.y + b.y));
}

static __global__ void layernorm_forward_kernel_v1(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1,
                                                const bf16* inp2, const bf16* weight, const bf16* bias, long N, int C) {
    long n = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (n >= N) return;
    const bf16* a = inp1 + n * C;
    const bf16* b = inp2 ? inp2 + n * C : nullptr;
    float sum = 0.0f;
    for (int c = 2 * lane; c < C; c += 64) {
        float2 x = layernorm_input_v1(a, b, c);
        if (residual) *reinterpret_cast<__nv_bfloat162*>(residual + n * C + c) = __floats2bfloat162_rn(x.x, x.y);
        sum += x.x + x.y;
    }
    float m = warp_sum(sum) / C;
    float var = 0.0f;
    for (int c = 2 * lane; c < C; c += 64) {
        float2 x = layernorm_input_v1(a, b, c);
        var += (x.x - m) * (x.x - m) + (x.y - m) * (x.y - m);
    }
    float s = rsqrtf(warp_sum(var) / C + 1e-5f);
    for (int c = 2 * lane; c < C; c += 64) {
        float2 x = layernorm_input_v1(a, b, c);
        float2 w = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(weight + c));
        float2 bi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + c));
        *reinterpret_cast<__nv_bfloat162*>(out + n * C + c) =
            __floats2bfloat162_rn((x.x - m) * s * w.x + bi.x, (x.y - m) * s * w.y + bi.y);
    }
    if (lane == 0) {
        mean[n] = m;
        rstd[n] = s;
    }
}

inline void layernorm_forward_cuda_v1(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                                   const bf16* bias, long N, int C, cudaStream_t stream) {
    layernorm_forward_kernel_v1<<<cuda_blocks(N, 8), 256, 0, stream>>>(nullptr, out, mean, rstd, inp, nullptr, weight,
                                                                   bias, N, C);
    cuda_check(cudaGetLastError());
}

// residual = inp1 + inp2, then out = layernorm(residual): the residual connection and the next layernorm
inline void fused_residual_layernorm_forward_cuda_v1(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* inp1,
                                                  const bf16* inp2, const bf16* weight, const bf16* bias, long N, int C,
                                                  cudaStream_t stream) {
    layernorm_forward_kernel_v1<<<cuda_blocks(N, 8), 256, 0, stream>>>(residual, out, mean, rstd, inp1, inp2, weight,
                                                                   bias, N, C);
    cuda_check(cudaGetLastError());
}

constexpr int LAYERNORM_BWD_ROWS_v1 = 64;  // rows per block: the granularity of the parameter-gradient partial sums

inline long layernorm_backward_scratch_floats_v1(long N, int C) {
    return (N + LAYERNORM_BWD_ROWS_v1 - 1) / LAYERNORM_BWD_ROWS_v1 * 2 * (long)C;
}

// 256 threads. First each warp takes rows and adds their input gradient into dinp; then the block turns to
// channels, each thread summing its channel pairs over the block's rows in row order into `partial`.
static __global__ void layernorm_backward_kernel_v1(bf16* dinp, float* partial, const bf16* dout, const bf16* inp,
                                                 const bf16* weight, const float* mean, const float* rstd, long N,
                                                 int C) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    long r0 = (long)blockIdx.x * LAYERNORM_BWD_ROWS_v1, r1 = min(r0 + LAYERNORM_BWD_ROWS_v1, N);
    for (long n = r0 + warp; n < r1; n += warps) {
        const bf16* x = inp + n * C;
        const bf16* d = dout + n * C;
        float m = mean[n], s = rstd[n];
        float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
        for (int c = 2 * lane; c < C; c += 64) {
            float2 xv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x + c));
            float2 dv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(d + c));
            float2 wv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(weight + c));
            dnorm_sum += dv.x * wv.x + dv.y * wv.y;
            dnorm_norm_sum += dv.x * wv.x * (xv.x - m) * s + dv.y * wv.y * (xv.y - m) * s;
        }
        float dnorm_mean = warp_sum(dnorm_sum) / C, dnorm_norm_mean = warp_sum(dnorm_norm_sum) / C;
        for (int c = 2 * lane; c < C; c += 64) {
            float2 xv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x + c));
            float2 dv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(d + c));
            float2 wv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(weight + c));
            __nv_bfloat162* dx = reinterpret_cast<__nv_bfloat162*>(dinp + n * C + c);
            float2 old = __bfloat1622float2(*dx);
            float gx = s * (dv.x * wv.x - dnorm_mean - (xv.x - m) * s * dnorm_norm_mean);
            float gy = s * (dv.y * wv.y - dnorm_mean - (xv.y - m) * s * dnorm_norm_mean);
            *dx = __floats2bfloat162_rn(old.x + gx, old.y + gy);
        }
    }
    float* dw_partial = partial + (long)blockIdx.x * 2 * C;
    float* db_partial = dw_partial + C;
    for (int c = 2 * threadIdx.x; c < C; c += 2 * blockDim.x) {
        float dw0 = 0.0f, dw1 = 0.0f, db0 = 0.0f, db1 = 0.0f;
        for (long n = r0; n < r1; n++) {
            float2 xv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(inp + n * C + c));
            float2 dv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + n * C + c));
            float m = mean[n], s = rstd[n];
            dw0 += dv.x * (xv.x - m) * s;
            dw1 += dv.y * (xv.y - m) * s;
            db0 += dv.x;
            db1 += dv.y;
        }
        dw_partial[c] = dw0;
        dw_partial[c + 1] = dw1;
        db_partial[c] = db0;
        db_partial[c + 1] = db1;
    }
}

static __global__ void layernorm_param_grad_kernel_v1(bf16* dweight, bf16* dbias, const float* partial, long blocks,
                                                   int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dw = 0.0f, db = 0.0f;
    for (long b = 0; b < blocks; b++) {
        dw += partial[b * 2 * C + c];
        db += partial[b * 2 * C + C + c];
    }
    dweight[c] = __float2bfloat16(__bfloat162float(dweight[c]) + dw);
    dbias[c] = __float2bfloat16(__bfloat162float(dbias[c]) + db);
}

// dinp, dweight and dbias accumulate (+=), as on the CPU; scratch holds layernorm_backward_scratch_floats_v1(N, C)
inline void layernorm_backward_cuda_v1(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                                    const bf16* weight, const float* mean, const float* rstd, long N, int C,
                                    float* scratch, cudaStream_t stream) {
    long blocks = (N + LAYERNORM_BWD_ROWS_v1 - 1) / LAYERNORM_BWD_ROWS_v1;
    layernorm_backward_kernel_v1<<<(unsigned int)blocks, 256, 0, stream>>>(dinp, scratch, dout, inp, weight, mean, rstd,
                                                                       N, C);
    cuda_check(cudaGetLastError());
    layernorm_param_grad_kernel_v1<<<cuda_blocks(C, 256), 256, 0, stream>>>(dweight, dbias, scratch, blocks, C);
    cuda_check(cudaGetLastError());
}

// ------------------------------------------------------------------------------------------------------------

static void check_variant(Checks& checks, NormCase& k, int variant) {
    if (!have_gpu()) return;
    std::string v = strfmt("v%d N=%ld C=%d ", variant, k.N, k.C);
    for (auto* buffer : {&k.d_res, &k.d_out}) buffer->poison();
    for (auto* buffer : {&k.d_mean, &k.d_rstd}) buffer->poison();
    if (variant == 1)
        fused_residual_layernorm_forward_cuda_v1(k.d_res.ptr, k.d_out.ptr, k.d_mean.ptr, k.d_rstd.ptr, k.d_a.ptr,
                                                 k.d_b.ptr, k.d_w.ptr, k.d_bias.ptr, k.N, k.C, 0);
    else
        k.gpu_fused_forward();
    checks.check(v + "fused: residual", download(k.d_res), k.res, 1e-2);
    checks.check(v + "fused: out", download(k.d_out), k.out, 2e-2);
    checks.check(v + "fused: mean", download(k.d_mean), k.mean, 1e-3);
    checks.check(v + "fused: rstd", download(k.d_rstd), k.rstd, 1e-3);
    if (variant == 2) {
        k.d_out.poison();
        for (auto* buffer : {&k.d_mean, &k.d_rstd}) buffer->poison();
        k.gpu_fused_forward_in_place();
        checks.check(v + "fused in place: residual", download(k.d_res), k.res, 1e-2);
        checks.check(v + "fused in place: out", download(k.d_out), k.out, 2e-2);
    }
    k.d_out.poison();
    if (variant == 1)
        layernorm_forward_cuda_v1(k.d_out.ptr, k.d_mean.ptr, k.d_rstd.ptr, k.d_res.ptr, k.d_w.ptr, k.d_bias.ptr, k.N,
                                  k.C, 0);
    else
        k.gpu_forward();
    checks.check(v + "forward: out", download(k.d_out), k.out, 2e-2);

    k.use_cpu_stats();
    DeviceArray<float> scratch_v1(layernorm_backward_scratch_floats_v1(k.N, k.C));
    auto backward = [&] {
        k.reset_grads();
        if (variant == 1)
            layernorm_backward_cuda_v1(k.d_dinp.ptr, k.d_dw.ptr, k.d_db.ptr, k.d_dout.ptr, k.d_res.ptr, k.d_w.ptr,
                                       k.d_mean.ptr, k.d_rstd.ptr, k.N, k.C, scratch_v1.ptr, 0);
        else
            k.gpu_backward();
    };
    backward();
    std::vector<float> dinp = download(k.d_dinp), dw = download(k.d_dw), db = download(k.d_db);
    checks.check(v + "backward: dinp (+=)", dinp, k.dinp, 2e-2);
    checks.check(v + "backward: dweight (+=)", dw, k.dweight, 2e-2);
    checks.check(v + "backward: dbias (+=)", db, k.dbias, 2e-2);
    backward();
    checks.require(v + "backward bit-reproducible",
                   download(k.d_dinp) == dinp && download(k.d_dw) == dw && download(k.d_db) == db);
}

// each timed call cycles through its own copies of the activations; weights and statistics are shared
static void time_variant(NormCase& k, int variant) {
    if (!have_gpu()) return;
    long N = k.N;
    int C = k.C;
    double forward_bytes = 8.0 * N * C, backward_bytes = 8.0 * N * C;  // 2-byte elements: 2 read + 2 written, 3 + 1
    int sets = timing_sets(forward_bytes);
    TimingCopies<bf16> a(k.d_a, sets), b(k.d_b, sets), res(k.d_res, sets), out(k.d_out, sets), dout(k.d_dout, sets),
        dinp(k.d_dinp, sets);
    DeviceArray<float> scratch_v1(layernorm_backward_scratch_floats_v1(N, C));
    float fused_ms = median_ms(
        [&](int s) {
            if (variant == 1)
                fused_residual_layernorm_forward_cuda_v1(res[s], out[s], k.d_mean.ptr, k.d_rstd.ptr, a[s], b[s],
                                                         k.d_w.ptr, k.d_bias.ptr, N, C, 0);
            else
                fused_residual_norm_forward_cuda(Norm::LayerNorm, res[s], out[s], k.d_mean.ptr, k.d_rstd.ptr, a[s], b[s],
                                                 k.d_w.ptr, k.d_bias.ptr, N, C, k.eps, 0);
        },
        sets);
    float backward_ms = median_ms(
        [&](int s) {
            if (variant == 1)
                layernorm_backward_cuda_v1(dinp[s], k.d_dw.ptr, k.d_db.ptr, dout[s], res[s], k.d_w.ptr, k.d_mean.ptr,
                                           k.d_rstd.ptr, N, C, scratch_v1.ptr, 0);
            else
                norm_backward_cuda(Norm::LayerNorm, dinp[s], k.d_dw.ptr, k.d_db.ptr, dout[s], res[s], k.d_w.ptr, k.d_mean.ptr,
                                   k.d_rstd.ptr, N, C, k.scratch.ptr, 0);
        },
        sets);
    report_memory_bound(strfmt("v%d fused residual+layernorm N=%ld C=%d", variant, N, C), fused_ms, forward_bytes);
    report_memory_bound(strfmt("v%d layernorm backward N=%ld C=%d", variant, N, C), backward_ms, backward_bytes);
}

int main() {
    Program program(
        "layernorm: fused residual + layernorm forward and backward (variants 1 and 2) against the CPU, C = 768 and 1600; timed");
    Checks checks;
    const long shapes[][2] = {{64L * 1024, 768}, {16L * 1024, 1600}};
    for (auto& shape : shapes) {
        NormCase k(Norm::LayerNorm, shape[0], (int)shape[1], 1e-5f, 3);  // GPT-2's eps
        for (int variant = 1; variant <= 2; variant++) check_variant(checks, k, variant);
        for (int variant = 1; variant <= 2; variant++) time_variant(k, variant);
    }
    return program.finish(checks);
}
