// encoder: encoder_forward_cuda, and the deterministic encoder_backward_cuda of llmc/encoder.cuh (variant 2)
// beside the backward it replaced (variant 1), each checked against the CPU reference (outputs poisoned first)
// and timed against the copy bandwidth at GPT-2 124M's B=64, T=1024 (dout 100 MB).
//   variant 1: a 32-bit radix sort; each token's run summed by one thread per channel pair, serially, so a hot
//              token's thousands of positions are one long chain of loads
//   variant 2: a 16-bit sort when V < 65536; short runs summed by a warp, long runs by a 1024-thread block cut
//              into slices that are added in a fixed order; 16-byte accesses
// Tokens are drawn like text: half the positions from a few hot tokens, the rest uniform over the vocabulary,
// so the hot tokens make runs of thousands. The backward must be bit-reproducible. Inputs and the CPU
// reference: EncoderCase in encoder_case.h.
#include "dev/cuda/encoder_case.h"

// ------------------------------------------------------------------------------------------------------------
// variant 1, as llmc/encoder.cuh had it

static __global__ void encoder_iota_kernel_v1(int* positions, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) positions[i] = i;
}

// block (x: a sorted index, y: 64 channels); only the block at the start of a token's run does work
static __global__ void encoder_wte_backward_kernel_v1(bf16* dwte, const bf16* dout, const int* sorted_tokens,
                                                   const int* sorted_positions, int BT, int C) {
    int start = blockIdx.x;
    int token = sorted_tokens[start];
    if (start > 0 && sorted_tokens[start - 1] == token) return;
    int c = 2 * (blockIdx.y * 32 + threadIdx.x);
    if (c >= C) return;
    float s0 = 0.0f, s1 = 0.0f;
    for (int i = start; i < BT && sorted_tokens[i] == token; i++) {
        float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + (long)sorted_positions[i] * C + c));
        s0 += v.x;
        s1 += v.y;
    }
    __nv_bfloat162* w = reinterpret_cast<__nv_bfloat162*>(dwte + (long)token * C + c);
    float2 old = __bfloat1622float2(*w);
    *w = __floats2bfloat162_rn(old.x + s0, old.y + s1);
}

// a thread owns a channel pair of one position and sums over the batch in order
static __global__ void encoder_wpe_backward_kernel_v1(bf16* dwpe, const bf16* dout, int B, int T, int C) {
    long i = 2 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= (long)T * C) return;
    float s0 = 0.0f, s1 = 0.0f;
    for (int b = 0; b < B; b++) {
        float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + (long)b * T * C + i));
        s0 += v.x;
        s1 += v.y;
    }
    __nv_bfloat162* w = reinterpret_cast<__nv_bfloat162*>(dwpe + i);
    float2 old = __bfloat1622float2(*w);
    *w = __floats2bfloat162_rn(old.x + s0, old.y + s1);
}

// the sort's temporary space, after three int arrays of B*T (sorted tokens, positions, sorted positions)
inline size_t encoder_backward_scratch_bytes_v1(int B, int T) {
    int n = B * T;
    size_t cub_bytes = 0;
    cuda_check(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, (const int*)nullptr, (int*)nullptr,
                                               (const int*)nullptr, (int*)nullptr, n));
    return 3 * (size_t)n * sizeof(int) + cub_bytes;
}

// dwte and dwpe accumulate (+=); scratch holds encoder_backward_scratch_bytes_v1(B, T) bytes, 16-byte aligned
inline void encoder_backward_cuda_v1(bf16* dwte, bf16* dwpe, const bf16* dout, const int* tokens, int B, int T, int C,
                                  void* scratch, cudaStream_t stream) {
    int n = B * T;
    int* sorted_tokens = static_cast<int*>(scratch);
    int* positions = sorted_tokens + n;
    int* sorted_positions = positions + n;
    void* cub_space = sorted_positions + n;
    size_t cub_bytes = encoder_backward_scratch_bytes_v1(B, T) - 3 * (size_t)n * sizeof(int);
    encoder_iota_kernel_v1<<<cuda_blocks(n, 256), 256, 0, stream>>>(positions, n);
    cuda_check(cudaGetLastError());
    cuda_check(cub::DeviceRadixSort::SortPairs(cub_space, cub_bytes, tokens, sorted_tokens, positions,
                                               sorted_positions, n, 0, (int)sizeof(int) * 8, stream));
    encoder_wte_backward_kernel_v1<<<dim3(n, cuda_blocks(C, 64)), 32, 0, stream>>>(dwte, dout, sorted_tokens,
                                                                              sorted_positions, n, C);
    cuda_check(cudaGetLastError());
    encoder_wpe_backward_kernel_v1<<<cuda_blocks((long)T * C / 2, 256), 256, 0, stream>>>(dwpe, dout, B, T, C);
    cuda_check(cudaGetLastError());
}

// ------------------------------------------------------------------------------------------------------------

static void backward(int variant, EncoderCase& k, bf16* dwte, bf16* dwpe, const bf16* dout, void* scratch_v1) {
    if (variant == 1)
        encoder_backward_cuda_v1(dwte, dwpe, dout, k.d_tokens.ptr, k.B, k.T, k.C, scratch_v1, 0);
    else
        encoder_backward_cuda(dwte, dwpe, dout, k.d_tokens.ptr, k.B, k.T, k.C, k.V, k.scratch.ptr, 0);
}

static void run_shape(Checks& checks, int B, int T, int C, int V, int hot_tokens) {
    long BT = (long)B * T;
    EncoderCase k(B, T, C, V, 1, hot_tokens, 0.1f);
    if (!have_gpu()) return;  // without a GPU: the inputs and CPU reference alone
    std::string shape = strfmt("B=%d T=%d C=%d V=%d hot=%d ", B, T, C, V, hot_tokens);
    k.gpu_forward();
    checks.check(shape + "forward out", download(k.d_out), k.out, 1e-2);
    DeviceArray<char> scratch_v1(encoder_backward_scratch_bytes_v1(B, T));
    for (int variant = 1; variant <= 2; variant++) {
        std::string v = strfmt("v%d ", variant) + shape;
        k.reset_grads();
        backward(variant, k, k.d_dwte.ptr, k.d_dwpe.ptr, k.d_dout.ptr, scratch_v1.ptr);
        std::vector<float> dwte = download(k.d_dwte), dwpe = download(k.d_dwpe);
        checks.check(v + "backward dwte (+=)", dwte, k.dwte, 2e-2);
        checks.check(v + "backward dwpe (+=)", dwpe, k.dwpe, 2e-2);
        k.reset_grads();
        backward(variant, k, k.d_dwte.ptr, k.d_dwpe.ptr, k.d_dout.ptr, scratch_v1.ptr);
        checks.require(v + "backward bit-reproducible", download(k.d_dwte) == dwte && download(k.d_dwpe) == dwpe);
    }

    // forward: a token row and a position row read and the output row written, 6 bytes per element (repeated
    // token and position rows come from L2, so DRAM moves less: the figure is the kernel's whole traffic)
    double forward_bytes = 3.0 * BT * C * 2;
    // backward: dout read twice (by token, by position), dwpe read and written; dwte's touched rows (fewer
    // than BT) are left out
    double backward_bytes = 2.0 * BT * C * 2 + 4.0 * T * C;
    int sets = timing_sets(BT * C * 2.0);
    TimingCopies<bf16> out(k.d_out, sets), dout(k.d_dout, sets);
    report_memory_bound("forward " + shape,
                        median_ms([&](int s) { encoder_forward_cuda(out[s], k.d_tokens.ptr, k.d_wte.ptr, k.d_wpe.ptr,
                                                                    B, T, C, 0); },
                                  sets),
                        forward_bytes);
    for (int variant = 1; variant <= 2; variant++) {
        float ms = median_ms(
            [&](int s) { backward(variant, k, k.d_dwte.ptr, k.d_dwpe.ptr, dout[s], scratch_v1.ptr); }, sets);
        report_memory_bound(strfmt("v%d backward ", variant) + shape, ms, backward_bytes);
    }
}

int main() {
    Program program(
        "encoder: forward gather and backward dwte/dwpe (variants 1 and 2) against the CPU, with skewed tokens; timed");
    Checks checks;
    run_shape(checks, 64, 1024, 768, 50257, 16);  // 16 hot tokens: runs of ~2000 positions
    run_shape(checks, 8, 1024, 1600, 50257, 5000);  // d48's width, milder skew
    run_shape(checks, 4, 256, 768, 100000, 3);  // a vocabulary past 16-bit keys
    return program.finish(checks);
}
