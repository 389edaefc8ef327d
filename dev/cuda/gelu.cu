// gelu_forward_cuda and gelu_backward_cuda (also in place, dinp = dout) against the CPU reference
// (llmc/gelu.cuh), then timed against the copy bandwidth.
#include "dev/cuda/common.h"
#include "llmc/gelu.cuh"

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    const long N = 8L * 1024 * 4 * 768;  // the MLP activation of B=8, T=1024, C=768
    Rng rng(2);
    std::vector<float> inp = random_bf16_values(N, rng, 2.0f), dout = random_bf16_values(N, rng);
    DeviceArray<bf16> d_inp(N), d_out(N), d_dout(N), d_dinp(N);
    upload(d_inp, inp);
    upload(d_dout, dout);

    std::vector<float> out(N), dinp(N);
    gelu_forward(out.data(), inp.data(), N);
    gelu_backward(dinp.data(), inp.data(), dout.data(), N);
    gelu_forward_cuda(d_out.ptr, d_inp.ptr, N, 0);
    checks.check("gelu_forward", download(d_out), out, 1e-2);
    gelu_backward_cuda(d_dinp.ptr, d_inp.ptr, d_dout.ptr, N, 0);
    checks.check("gelu_backward", download(d_dinp), dinp, 1e-2);
    gelu_backward_cuda(d_dout.ptr, d_inp.ptr, d_dout.ptr, N, 0);
    checks.check("gelu_backward in place", download(d_dout), dinp, 1e-2);

    report_memory_bound("gelu_forward N=25.2M", time_ms([&] { gelu_forward_cuda(d_out.ptr, d_inp.ptr, N, 0); }), 4.0 * N);
    report_memory_bound("gelu_backward N=25.2M",
                        time_ms([&] { gelu_backward_cuda(d_dinp.ptr, d_inp.ptr, d_out.ptr, N, 0); }), 6.0 * N);
    return checks.exit_code();
}
