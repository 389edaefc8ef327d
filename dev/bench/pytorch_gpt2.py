#!/usr/bin/env python3
"""PyTorch reference for the GPU benchmark (dev/bench/gpu_bench.sh): trains a GPT-2 of a given shape the way a
PyTorch user would write it today, and reports tokens/s and MFU computed exactly as llm5d and llm.c compute them.

The model is llm.c's GPT-2: token and position embeddings (the vocabulary padded to a multiple of 128, 50257 ->
50304, the token embedding tied to the classifier), pre-norm blocks with fused QKV, GELU (tanh), a final
layernorm; the padding logits are left out of the loss, as in llm.c's fused classifier. Training: bf16 autocast
over fp32 parameters, F.scaled_dot_product_attention(is_causal=True) (flash attention), torch.compile, AdamW
(fused when this PyTorch has it; lr 6e-4 constant, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on the 2-D
weights only), gradients clipped to a global norm of 1.0. Each step reads the next B x (T+1) tokens of an llm.c
token shard (256 int32 header, magic 20240520, then uint16 tokens), wrapping around at the end.

The first --warmup steps (compilation, allocator warm-up) are not timed; each of the next --steps is timed from
its start to a torch.cuda.synchronize() after the optimizer step. One line per step, then:

    peak memory: <bytes allocated at the peak> (torch.cuda.max_memory_allocated)
    pytorch: tokens/s <X> MFU <Y>%

tokens/s is all timed tokens over all timed seconds; MFU = tokens/s x FLOPs per token / peak, with llm.c's
FLOPs per token = 6N + 6*L*C*T, N counting every parameter (the padded vocabulary's embedding included, once),
against --peak-tflops (988.8: an H100 SXM's dense bf16 peak, llm.c's figure).

    python3 dev/bench/pytorch_gpt2.py --layers 12 --channels 768 --heads 12 --seq-len 1024 --batch 64

--device cpu runs the same code on the CPU (a smoke test: no flash attention kernel, the MFU meaningless).
"""

import argparse
import inspect
import math
import os
import statistics
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SHARD_MAGIC = 20240520
HEADER_INTS = 256


def padded_vocab(vocab):
    return (vocab + 127) // 128 * 128


def load_tokens(path):
    """The tokens of an llm.c token shard (int64 on the CPU), checked against its header."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_INTS * 4)
        if len(raw) != HEADER_INTS * 4:
            sys.exit(f"pytorch_gpt2: {path}: shorter than the 1024-byte header")
        magic, version, count = struct.unpack("<3i", raw[:12])
        if magic != SHARD_MAGIC:
            sys.exit(f"pytorch_gpt2: {path}: not an llm.c token shard (magic {magic}, expected {SHARD_MAGIC})")
        if version != 1:
            sys.exit(f"pytorch_gpt2: {path}: shard version {version}, expected 1")
        data = bytearray(f.read(count * 2))
    if len(data) != count * 2:
        sys.exit(f"pytorch_gpt2: {path}: header says {count} tokens, file holds {len(data) // 2}")
    # uint16 little-endian, read as int16 and masked (older PyTorch has no uint16)
    return torch.frombuffer(data, dtype=torch.int16).to(torch.int64) & 0xFFFF


# ------------------------------------------------------------------------------------------------------------
# the model (llm.c's GPT-2; parameter count Vp*C + maxT*C + L*(12C^2 + 13C) + 2C)

def causal_attention(q, k, v):
    """q, k, v: (B, NH, T, HS). Flash attention where PyTorch has it; the plain masked softmax otherwise."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return att @ v


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.attn_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.attn_proj(y)
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x


class GPT(nn.Module):
    def __init__(self, L, C, NH, vocab, max_seq_len):
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(padded_vocab(vocab), C)
        self.wpe = nn.Embedding(max_seq_len, C)
        self.blocks = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        # GPT-2's initialization: N(0, 0.02), the residual projections scaled by 1/sqrt(2L), biases zero
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, Vp): the classifier tied to wte
        # the padding columns never enter the softmax
        return F.cross_entropy(logits[..., : self.vocab].flatten(0, 1), targets.flatten())


def make_optimizer(model, lr, weight_decay, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    fused = device.type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    if fused:
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs), fused


# ------------------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257, help="padded to a multiple of 128 for the embedding")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="rows of the position embedding (counted in N)")
    ap.add_argument("--seq-len", type=int, default=1024, help="T")
    ap.add_argument("--batch", type=int, default=64, help="B: sequences per step")
    ap.add_argument("--steps", type=int, default=50, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them (compilation happens here)")
    ap.add_argument("--data", default="data/sotu/train.bin", help="llm.c token shard")
    ap.add_argument("--synthetic", action="store_true",
                    help="random tokens instead of --data (the step time does not depend on the token values)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--peak-tflops", type=float, default=988.8,
                    help="the device's dense bf16 peak (988.8: H100 SXM)")
    ap.add_argument("--no-compile", action="store_true", help="eager mode (no torch.compile)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    L, C, NH, T, B = args.layers, args.channels, args.heads, args.seq_len, args.batch
    if min(L, C, NH, T, B, args.vocab) <= 0 or args.steps <= 0 or args.warmup < 0:
        sys.exit("pytorch_gpt2: shapes and --steps must be positive, --warmup non-negative")
    if C % NH:
        sys.exit(f"pytorch_gpt2: --heads {NH} must divide --channels {C}")
    if T > args.max_seq_len:
        sys.exit(f"pytorch_gpt2: --seq-len {T} exceeds --max-seq-len {args.max_seq_len}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("pytorch_gpt2: no CUDA device visible (use --device cpu for a smoke test)")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    # data: the whole shard on the device (a few MB), consecutive batches wrapping around
    if args.synthetic:
        tokens = torch.randint(0, args.vocab, (max(B * T + 1, 1 << 20),), dtype=torch.int64)
        source = "random tokens"
    else:
        if not os.path.exists(args.data):
            sys.exit(f"pytorch_gpt2: {args.data}: no such token shard (make data, or --synthetic)")
        tokens = load_tokens(args.data)
        source = f"{args.data} ({tokens.numel()} tokens)"
        if tokens.numel() < B * T + 1:
            sys.exit(f"pytorch_gpt2: {args.data}: {tokens.numel()} tokens, a batch needs {B * T + 1}")
        if int(tokens.max()) >= args.vocab:
            sys.exit(f"pytorch_gpt2: {args.data}: token {int(tokens.max())} outside --vocab {args.vocab}")
    tokens = tokens.to(device)
    position = 0

    def next_batch():
        nonlocal position
        if position + B * T + 1 > tokens.numel():
            position = 0
        chunk = tokens[position: position + B * T + 1]
        position += B * T
        return chunk[:-1].view(B, T), chunk[1:].view(B, T)

    model = GPT(L, C, NH, args.vocab, args.max_seq_len).to(device)
    Vp = padded_vocab(args.vocab)
    N = sum(p.numel() for p in model.parameters())
    assert N == Vp * C + args.max_seq_len * C + L * (12 * C * C + 13 * C) + 2 * C
    flops_per_token = 6 * N + 6 * L * C * T  # llm.c's estimate
    optimizer, fused = make_optimizer(model, args.lr, args.weight_decay, device)

    compiled = hasattr(torch, "compile") and not args.no_compile
    step_model = torch.compile(model) if compiled else model
    if args.device == "cuda":
        gpu = torch.cuda.get_device_properties(device)
        where = f"{gpu.name}, {gpu.total_memory / 2**30:.1f} GiB"
    else:
        where = f"cpu, {torch.get_num_threads()} threads"
    print(f"pytorch {torch.__version__} on {where}")
    print(f"model: L={L} C={C} NH={NH} V={args.vocab} (Vp {Vp}) maxT={args.max_seq_len}: N={N} parameters; "
          f"B={B} T={T}: {B * T} tokens/step, {flops_per_token} FLOPs/token (6N + 6LCT)")
    print(f"data: {source}")
    print("bf16 autocast; attention: " + ("F.scaled_dot_product_attention(is_causal=True)"
          if hasattr(F, "scaled_dot_product_attention") else "masked softmax (no F.scaled_dot_product_attention in this PyTorch)"))
    print("torch.compile: " + ("yes" if compiled else "no (--no-compile)" if args.no_compile
                                else "no (this PyTorch has no torch.compile)")
          + f"; AdamW: {'fused' if fused else 'not fused (this PyTorch or device has no fused AdamW)'}")
    print(f"{args.warmup} warm-up steps (not timed), then {args.steps} timed steps; peak {args.peak_tflops} TFLOP/s")
    sys.stdout.flush()

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def train_step():
        x, y = next_batch()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=args.device, dtype=torch.bfloat16):
            loss = step_model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss, norm

    timed_ms = []
    total = args.warmup + args.steps
    for step in range(total):
        sync()
        t0 = time.perf_counter()
        loss, norm = train_step()
        sync()
        ms = (time.perf_counter() - t0) * 1000.0
        tok_s = B * T / (ms / 1000.0)
        mfu = 100.0 * tok_s * flops_per_token / (args.peak_tflops * 1e12)
        timed = step >= args.warmup
        if timed:
            timed_ms.append(ms)
        print(f"step {step + 1:4d}/{total} | loss {loss.item():.6f} | norm {norm.item():.4f} | {ms:.1f} ms | "
              f"{tok_s:.0f} tok/s | MFU {mfu:.1f}%" + ("" if timed else " (warm-up)"))
        sys.stdout.flush()

    tokens_per_s = B * T * len(timed_ms) / (sum(timed_ms) / 1000.0)
    mfu = 100.0 * tokens_per_s * flops_per_token / (args.peak_tflops * 1e12)
    print(f"timed steps: {len(timed_ms)}, median {statistics.median(timed_ms):.1f} ms, "
          f"min {min(timed_ms):.1f} ms, max {max(timed_ms):.1f} ms")
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        print(f"peak memory: {peak} bytes ({peak / 2**30:.2f} GiB) (torch.cuda.max_memory_allocated)")
    print(f"pytorch: tokens/s {tokens_per_s:.0f} MFU {mfu:.2f}%")


if __name__ == "__main__":
    main()
