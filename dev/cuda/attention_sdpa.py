"""PyTorch's scaled_dot_product_attention (flash backend, bf16, causal) timed on the shapes dev/cuda/attention
times, so the two programs' TFLOP/s can be set side by side from one run: forward, and backward (the gradients of
q, k and v). FLOPs are counted as dev/cuda/attention counts them: 4·B·NH·T²·hs / 2 forward (the causal half),
2.5 times that backward.

    python3 dev/cuda/attention_sdpa.py

Without torch or a CUDA device it prints why and exits 0, like the dev/cuda programs without a GPU.
"""
import sys

# (B, NH, T, hs): GPT-2 124M, GPT-2 1.5B (d48), and a head size of 128
SHAPES = [(64, 12, 1024, 64), (16, 25, 1024, 64), (16, 16, 1024, 128)]


def time_ms(torch, fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


# the shapes dev/cuda/attention checks (B, NH, T, hs), with its tolerances (AttentionCase in
# dev/cuda/kernel_cases.h): forward 3e-2, backward 7.5e-2, each relative to the element and, as a floor, to the
# reference's RMS
ACCURACY_SHAPES = [(4, 12, 1024, 64), (2, 6, 1024, 128), (2, 12, 1000, 64), (2, 6, 1000, 128)]


def worst_ratio(torch, got, ref, tol):
    ref = ref.double()
    rms = ref.pow(2).mean().sqrt()
    return ((got.double() - ref).abs() / (tol * rms + tol * ref.abs())).max().item()


def accuracy(torch, F, generator):
    """SDPA's flash attention against an exact (float64) reference on dev/cuda/attention's inputs, in its
    measure: the tensor-core error a bf16 flash attention has, beside which that program's figures are read."""
    for B, NH, T, hs in ACCURACY_SHAPES:
        q, k, v, dout = (torch.randn(B, NH, T, hs, device="cuda", generator=generator).bfloat16() for _ in range(4))
        exact = [x.double().requires_grad_() for x in (q, k, v)]
        out64 = F.scaled_dot_product_attention(*exact, is_causal=True)
        grads64 = torch.autograd.grad(out64, exact, dout.double())
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            grads = torch.autograd.grad(out, leaves, dout)
        # dev/cuda/attention lays q, k and v side by side per token: one tensor for the three gradients
        cat = lambda gs: torch.cat([g.transpose(1, 2).reshape(B, T, NH * hs) for g in gs], dim=-1)
        shape = f"sdpa B={B} T={T} hs={hs}"
        print(f"{shape + ' forward':<44} {worst_ratio(torch, out, out64, 3e-2):.2f} of tolerance")
        print(f"{shape + ' backward dqkv':<44} {worst_ratio(torch, cat(grads), cat(grads64), 7.5e-2):.2f} of tolerance")


def main():
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        print("skipped: no torch (with torch.nn.attention)")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no GPU")
        return 0
    F = torch.nn.functional
    print(f"PyTorch {torch.__version__} SDPA, flash backend, bf16, causal on {torch.cuda.get_device_name()}")
    generator = torch.Generator(device="cuda").manual_seed(1)
    accuracy(torch, F, generator)
    for B, NH, T, hs in SHAPES:
        q, k, v = (torch.randn(B, NH, T, hs, device="cuda", dtype=torch.bfloat16, generator=generator,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn(B, NH, T, hs, device="cuda", dtype=torch.bfloat16, generator=generator)
        flops = 4.0 * B * NH * T * T * hs / 2
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            with torch.no_grad():
                forward_ms = time_ms(torch, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            # retain_graph: the same graph is differentiated on every repetition, backward alone is timed
            backward_ms = time_ms(torch, lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        shape = f"sdpa B={B} NH={NH} T={T} hs={hs}"
        print(f"{shape + ' forward':<44} {forward_ms:9.4f} ms {flops / forward_ms / 1e9:8.1f} TFLOP/s")
        print(f"{shape + ' backward':<44} {backward_ms:9.4f} ms {2.5 * flops / backward_ms / 1e9:8.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
