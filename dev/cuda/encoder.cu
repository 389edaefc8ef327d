// encoder_forward_cuda and encoder_backward_cuda against the CPU reference (llmc/encoder.cuh), then timed.
// Tokens are drawn so that a tenth of the vocabulary takes half the positions: long runs of one token are the
// backward's hard case. The backward must also be bit-reproducible: two runs are compared bit for bit.
#include "dev/cuda/common.h"
#include "llmc/encoder.cuh"

int main() {
    SKIP_WITHOUT_GPU();
    Checks checks;
    const int B = 8, T = 1024, C = 768, V = 50257;
    const long BT = (long)B * T;
    Rng rng(1);
    std::vector<int> tokens(BT);
    for (auto& t : tokens) t = (int)(rng.uniform() < 0.5f ? rng.below(V / 10) : rng.below(V));
    std::vector<float> wte = random_bf16_values((size_t)V * C, rng), wpe = random_bf16_values((size_t)T * C, rng);
    std::vector<float> dout = random_bf16_values(BT * C, rng), dwte0 = random_bf16_values((size_t)V * C, rng, 0.1f),
                       dwpe0 = random_bf16_values((size_t)T * C, rng, 0.1f);

    DeviceArray<int> d_tokens(BT);
    DeviceArray<bf16> d_wte(wte.size()), d_wpe(wpe.size()), d_out(BT * C), d_dout(BT * C), d_dwte(wte.size()),
        d_dwpe(wpe.size());
    DeviceArray<char> scratch(encoder_backward_scratch_bytes(B, T));
    upload(d_tokens, tokens);
    upload(d_wte, wte);
    upload(d_wpe, wpe);
    upload(d_dout, dout);

    std::vector<float> out(BT * C);
    encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    encoder_forward_cuda(d_out.ptr, d_tokens.ptr, d_wte.ptr, d_wpe.ptr, B, T, C, 0);
    checks.check("encoder_forward out", download(d_out), out, 1e-2);

    std::vector<float> dwte = dwte0, dwpe = dwpe0;
    encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
    upload(d_dwte, dwte0);
    upload(d_dwpe, dwpe0);
    encoder_backward_cuda(d_dwte.ptr, d_dwpe.ptr, d_dout.ptr, d_tokens.ptr, B, T, C, scratch.ptr, 0);
    std::vector<float> gpu_dwte = download(d_dwte);
    checks.check("encoder_backward dwte (+=)", gpu_dwte, dwte, 2e-2);
    checks.check("encoder_backward dwpe (+=)", download(d_dwpe), dwpe, 2e-2);
    upload(d_dwte, dwte0);
    encoder_backward_cuda(d_dwte.ptr, d_dwpe.ptr, d_dout.ptr, d_tokens.ptr, B, T, C, scratch.ptr, 0);
    checks.require("encoder_backward dwte bit-reproducible", download(d_dwte) == gpu_dwte);

    float ms = time_ms([&] { encoder_forward_cuda(d_out.ptr, d_tokens.ptr, d_wte.ptr, d_wpe.ptr, B, T, C, 0); });
    report_memory_bound("encoder_forward B=8 T=1024 C=768", ms, 3.0 * BT * C * 2);
    ms = time_ms([&] { encoder_backward_cuda(d_dwte.ptr, d_dwpe.ptr, d_dout.ptr, d_tokens.ptr, B, T, C, scratch.ptr, 0); });
    // dout read twice, and each touched dwte row and every dwpe row read and written
    report_memory_bound("encoder_backward B=8 T=1024 C=768", ms, 2.0 * BT * C * 2 + 4.0 * BT * C * 2);
    return checks.exit_code();
}
