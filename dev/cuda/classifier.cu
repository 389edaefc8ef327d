// classifier: the fused softmax + cross-entropy of llmc/classifier.cuh (variant 2) beside the one it replaced
// (variant 1), each checked against the CPU reference (outputs poisoned first) and timed against the copy
// bandwidth: GPT-2's padded vocabulary (50257 of 50304) on 4096 rows (412 MB of logits), and a small vocabulary
// not a multiple of 8 (V = 1001 of Vp = 1024); the padding columns' gradient must be exactly 0.
//   variant 1: 2-byte loads, two exponentials per element in the first pass (a running max and sum merged per
//              element)
//   variant 2: 16-byte loads, one exponential per element per pass, the second pass streaming
// Inputs and the CPU reference: ClassifierCase in classifier_case.h.
#include "dev/cuda/classifier_case.h"

// ------------------------------------------------------------------------------------------------------------
// variant 1, as llmc/classifier.cuh had it (softmax_merge and CLASSIFIER_THREADS are still the header's)

template <bool WRITE_GRAD>
static __global__ void __launch_bounds__(CLASSIFIER_THREADS)
    crossentropy_kernel_v1(bf16* logits, float* losses, const int* targets, int V, int Vp, float dloss) {
    __shared__ float shared_m[32], shared_s[32];
    long n = blockIdx.x;
    bf16* row = logits + n * Vp;
    int target = targets[n];
    float target_logit = __bfloat162float(row[target]);
    float m = -INFINITY, s = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) softmax_merge(m, s, __bfloat162float(row[v]), 1.0f);
    for (int offset = 16; offset > 0; offset >>= 1)
        softmax_merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        shared_m[warp] = m;
        shared_s[warp] = s;
    }
    __syncthreads();
    m = lane < blockDim.x / 32 ? shared_m[lane] : -INFINITY;
    s = lane < blockDim.x / 32 ? shared_s[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1)
        softmax_merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    float lse = m + logf(s);
    if (losses && threadIdx.x == 0) losses[n] = lse - target_logit;
    if constexpr (WRITE_GRAD) {
        for (int v = threadIdx.x; v < Vp; v += blockDim.x) {
            float g = 0.0f;
            if (v < V) g = __expf(__bfloat162float(row[v]) - lse) * dloss - (v == target ? dloss : 0.0f);
            row[v] = __float2bfloat16(g);
        }
    }
}

// losses[n] = -log softmax(logits[n])[targets[n]]; the mean is left to the caller (returning it would
// synchronize the stream)
inline void crossentropy_forward_cuda_v1(float* losses, const bf16* logits, const int* targets, long N, int V, int Vp,
                                      cudaStream_t stream) {
    crossentropy_kernel_v1<false><<<(unsigned int)N, CLASSIFIER_THREADS, 0, stream>>>(const_cast<bf16*>(logits), losses,
                                                                                  targets, V, Vp, 0.0f);
    cuda_check(cudaGetLastError());
}

// logits become dloss/dlogits in place, padding columns 0; losses (may be null) receives the forward's losses
// from the same pass
inline void crossentropy_backward_inplace_cuda_v1(bf16* logits, float* losses, const int* targets, long N, int V, int Vp,
                                               float dloss, cudaStream_t stream) {
    crossentropy_kernel_v1<true><<<(unsigned int)N, CLASSIFIER_THREADS, 0, stream>>>(logits, losses, targets, V, Vp, dloss);
    cuda_check(cudaGetLastError());
}

// ------------------------------------------------------------------------------------------------------------

static void forward(int variant, float* losses, const bf16* logits, const int* targets, long N, int V, int Vp) {
    if (variant == 1) crossentropy_forward_cuda_v1(losses, logits, targets, N, V, Vp, 0);
    else crossentropy_forward_cuda(losses, logits, targets, N, V, Vp, 0);
}

static void backward(int variant, bf16* logits, float* losses, const int* targets, long N, int V, int Vp,
                     float dloss) {
    if (variant == 1) crossentropy_backward_inplace_cuda_v1(logits, losses, targets, N, V, Vp, dloss, 0);
    else crossentropy_backward_inplace_cuda(logits, losses, targets, N, V, Vp, dloss, 0);
}

static void check_shape(Checks& checks, long N, int V, int Vp) {
    ClassifierCase k(N, V, Vp, 7 + V);
    if (!have_gpu()) return;  // without a GPU: the inputs and CPU reference alone
    for (int variant = 1; variant <= 2; variant++) {
        std::string v = strfmt("v%d N=%ld V=%d Vp=%d ", variant, N, V, Vp);
        k.reset_logits();
        k.d_losses.poison();
        forward(variant, k.d_losses.ptr, k.d_logits.ptr, k.d_targets.ptr, N, V, Vp);
        checks.check(v + "losses", download(k.d_losses), k.losses, 1e-3);
        k.d_losses.poison();
        backward(variant, k.d_logits.ptr, k.d_losses.ptr, k.d_targets.ptr, N, V, Vp, k.dloss);
        std::vector<float> gpu_grad = download(k.d_logits);
        checks.check(v + "fused losses", download(k.d_losses), k.losses, 1e-3);
        checks.check(v + "fused dlogits", gpu_grad, k.grad, 2e-2);
        checks.require(v + "fused dlogits padding exactly 0", k.padding_zero(gpu_grad));
        k.reset_logits();
        backward(variant, k.d_logits.ptr, k.d_losses.ptr, k.d_targets.ptr, N, V, Vp, k.dloss);
        checks.require(v + "fused dlogits bit-reproducible", download(k.d_logits) == gpu_grad);
    }
    // the forward reads the logits once; the fused backward reads them, reads them again (from L2 when the
    // first read left them there) and writes them: DRAM's share is one read and one write
    double forward_bytes = 2.0 * N * Vp, backward_bytes = 2.0 * 2.0 * N * Vp;
    k.reset_logits();
    int sets = timing_sets(forward_bytes);
    TimingCopies<bf16> logits(k.d_logits, sets);
    for (int variant = 1; variant <= 2; variant++) {
        float forward_ms = median_ms(
            [&](int s) { forward(variant, k.d_losses.ptr, logits[s], k.d_targets.ptr, N, V, Vp); }, sets);
        // repeated in place on its own output: the values change, the work does not
        float backward_ms = median_ms(
            [&](int s) { backward(variant, logits[s], k.d_losses.ptr, k.d_targets.ptr, N, V, Vp, k.dloss); }, sets);
        report_memory_bound(strfmt("v%d forward N=%ld Vp=%d", variant, N, Vp), forward_ms, forward_bytes);
        report_memory_bound(strfmt("v%d fused forward+backward N=%ld Vp=%d", variant, N, Vp), backward_ms,
                            backward_bytes);
    }
}

int main() {
    Program program(
        "classifier: cross-entropy forward and fused backward (variants 1 and 2) against the CPU; timed");
    Checks checks;
    check_shape(checks, 4096, 50257, 50304);
    check_shape(checks, 8192, 1001, 1024);
    return program.finish(checks);
}
