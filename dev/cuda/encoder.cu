// encoder_forward_cuda and encoder_backward_cuda against the CPU reference (llmc/encoder.cuh), then timed.
// Tokens are drawn so that a tenth of the vocabulary takes half the positions: long runs of one token are the
// backward's hard case. The backward must also be bit-reproducible: two runs are compared bit for bit.
// Inputs and the CPU reference: EncoderCase in kernel_cases.h.
#include "dev/cuda/kernel_cases.h"

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    const int B = 8, T = 1024, C = 768, V = 50257;
    const long BT = (long)B * T;
    EncoderCase k(B, T, C, V, 1, V / 10, 0.1f);

    k.gpu_forward();
    checks.check("encoder_forward out", download(k.d_out), k.out, 1e-2);
    k.gpu_backward();
    std::vector<float> gpu_dwte = download(k.d_dwte);
    checks.check("encoder_backward dwte (+=)", gpu_dwte, k.dwte, 2e-2);
    checks.check("encoder_backward dwpe (+=)", download(k.d_dwpe), k.dwpe, 2e-2);
    k.reset_grads();
    k.gpu_backward();
    checks.require("encoder_backward dwte bit-reproducible", download(k.d_dwte) == gpu_dwte);

    report_memory_bound("encoder_forward B=8 T=1024 C=768", time_ms([&] { k.gpu_forward(); }), 3.0 * BT * C * 2);
    // dout read twice, and each touched dwte row and every dwpe row read and written
    report_memory_bound("encoder_backward B=8 T=1024 C=768", time_ms([&] { k.gpu_backward(); }),
                        2.0 * BT * C * 2 + 4.0 * BT * C * 2);
    return checks.exit_code();
}
