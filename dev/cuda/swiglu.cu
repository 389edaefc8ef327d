// swiglu_forward_cuda and swiglu_backward_cuda against the CPU reference (llmc/swiglu.cuh) on Llama 3 8B's MLP
// (H = 14336, N = B·T = 8·1024: a 470 MB input) and on a small odd shape the kernels allow (N = 7 rows of 17
// groups of 8: rows end mid-block), then timed on the 8B shape against the copy bandwidth, with the buffers
// cycled so no call runs from L2. Reproduce: make -C dev/cuda swiglu && dev/cuda/swiglu
#include "dev/cuda/common.h"
#include "llmc/swiglu.cuh"

// inp holds [up | gate] per row (N × 2H); outputs start poisoned (DeviceArray) so a value not written fails
struct SwigluCase {
    long N;
    int H;
    std::vector<float> inp, dout, out, dinp;
    DeviceArray<bf16> d_inp, d_dout, d_out, d_dinp;
    SwigluCase(long n, int h, uint64_t seed)
        : N(n), H(h), out(n * h), dinp(2 * n * h), d_inp(2 * n * h), d_dout(n * h), d_out(n * h), d_dinp(2 * n * h) {
        Rng rng(seed);
        inp = random_bf16_values(2 * N * H, rng, 2.0f);
        dout = random_bf16_values(N * H, rng);
        upload(d_inp, inp);
        upload(d_dout, dout);
        swiglu_forward(out.data(), inp.data(), N, H);
        swiglu_backward(dinp.data(), inp.data(), dout.data(), N, H);
    }
    void check(Checks& checks) {
        swiglu_forward_cuda(d_out.ptr, d_inp.ptr, N, H, 0);
        checks.check(strfmt("swiglu_forward N=%ld H=%d", N, H), download(d_out), out, 1e-2);
        swiglu_backward_cuda(d_dinp.ptr, d_inp.ptr, d_dout.ptr, N, H, 0);
        checks.check(strfmt("swiglu_backward N=%ld H=%d", N, H), download(d_dinp), dinp, 1e-2);
    }
};

int main() {
    Program program(
        "swiglu: SwiGLU forward and backward against the CPU, Llama 3 8B's H = 14336 and a small shape; timed");
    Checks checks;
    SwigluCase small(7, 136, 3), llama(8L * 1024, 14336, 4);
    if (!program.gpu) return program.finish(checks);
    small.check(checks);
    llama.check(checks);

    const long N = llama.N;
    const int H = llama.H;
    const double forward_bytes = 6.0 * N * H, backward_bytes = 10.0 * N * H;  // bf16: 2H + H, 2H + H + 2H per row
    int sets = timing_sets(forward_bytes);
    TimingCopies<bf16> x(llama.d_inp, sets), y(llama.d_out, sets), d(llama.d_dout, sets), dx(llama.d_dinp, sets);
    report_memory_bound("swiglu_forward N=8192 H=14336",
                        median_ms([&](int s) { swiglu_forward_cuda(y[s], x[s], N, H, 0); }, sets), forward_bytes);
    report_memory_bound("swiglu_backward N=8192 H=14336",
                        median_ms([&](int s) { swiglu_backward_cuda(dx[s], x[s], d[s], N, H, 0); }, sets),
                        backward_bytes);
    return program.finish(checks);
}
