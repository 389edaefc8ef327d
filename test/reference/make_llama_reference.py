#!/usr/bin/python3
"""Generate a small Llama 3 reference (an llm.c Llama 3 model file + debug state) for llm5d's tests.

Run with Debian's interpreter, which ships torch and numpy:

    /usr/bin/python3 test/reference/make_llama_reference.py --out DIR --kv KV [--rope-scaling F] [--tied]

An independent Llama 3 written here from Meta's reference model (RMSNorm, RoPE on interleaved pairs with
Llama 3's frequency scaling by a factor F when asked, SwiGLU, grouped-query attention with KV key/value heads,
an lm_head of its own or the token embedding's transpose when tied, no biases), computed in float64 from float32
weights. Writes DIR/model.bin in llm.c's Llama 3 layout (the llama3 branch's write_model: 256 int32 + 256
float32 header, GPT-2's tensor slots, zero biases, lm_head in wpe's slot; llm5d's additions: int [14] 1 when
tied, with wte repeated in lm_head's slot, and float [3] the scaling factor when it is not 8) and DIR/state.bin
in the GPT-2 reference's state format: the first micro-batch's inputs,
targets, logits, loss and every gradient (in llm5d's flat order, which has no bias slots), then the losses of
10 AdamW steps with weight decay, each accumulating MICRO micro-batches (header[12]).
"""

import argparse
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

# odd sizes, so that indexing bugs show up: head size 8, 6 query heads, a hidden size that is not a power of two
L = 2
C = 48
NH = 6
HD = C // NH
MULTIPLE_OF = 20
FFN_DIM_MULTIPLIER = 1.3
V = 397
MAXT = 29
B = 2          # sequences per micro-batch
MICRO = 2      # micro-batches per step
T = 17
NORM_EPS = 1e-5

NSTEPS = 10
LR = 1e-3
WD = 0.1
CLIP = 1.0
BETA1, BETA2, EPS = 0.9, 0.95, 1e-8
SEED = 4321

LLAMA_MAGIC = 20240803
STATE_MAGIC = 20240327
STATE_VERSION = 3


def hidden_size():
    """Meta's rule (llm.c's MLP): 2/3 of 4C, times the multiplier, rounded up to a multiple of multiple_of."""
    h = int(2 * (4 * C) / 3)
    h = int(np.float32(FFN_DIM_MULTIPLIER) * h)  # the file stores the multiplier as float32
    return MULTIPLE_OF * ((h + MULTIPLE_OF - 1) // MULTIPLE_OF)


H = hidden_size()


def rope_frequencies(theta, factor):
    """Meta's frequencies, in float64; with Llama 3's scaling by factor (low 1, high 4, context 8192) unless 0."""
    freqs = [1.0 / theta ** (2 * i / HD) for i in range(HD // 2)]
    if factor == 0:
        return freqs
    low, high, old = 1.0, 4.0, 8192.0
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def rope(x, freqs):
    """Turns each pair (2i, 2i+1) of every head of x (nb, nt, heads, HD) by position * freqs[i]."""
    nt = x.shape[1]
    angle = torch.tensor([[p * f for f in freqs] for p in range(nt)], dtype=torch.float64)  # (nt, HD/2)
    cos, sin = torch.cos(angle)[None, :, None, :], torch.sin(angle)[None, :, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w


class Llama:
    """The parameters as a dict of float64 leaf tensors, and the forward pass."""

    def __init__(self, kv, theta, scaling, tied, gen):
        self.kv, self.theta, self.tied = kv, theta, tied
        self.freqs = rope_frequencies(theta, scaling)

        def normal(*shape, std):  # drawn in float32, as the model file stores them
            return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).double()

        resid = 0.02 / math.sqrt(2 * L)
        p = {"wte": normal(V, C, std=0.02)}
        if not tied:
            p["lm_head"] = normal(V, C, std=0.02)
        for l in range(L):
            # norm gains away from 1 so that a norm that ignored its weight would show
            p[f"ln1.{l}"] = 1.0 + normal(C, std=0.1)
            p[f"qkv.{l}"] = normal((NH + 2 * kv) * HD, C, std=0.02)
            p[f"attproj.{l}"] = normal(C, C, std=resid)
            p[f"ln2.{l}"] = 1.0 + normal(C, std=0.1)
            p[f"fc.{l}"] = normal(H, C, std=0.02)
            p[f"fc2.{l}"] = normal(H, C, std=0.02)
            p[f"fcproj.{l}"] = normal(C, H, std=resid)
        p["lnf"] = 1.0 + normal(C, std=0.1)
        for t in p.values():
            t.requires_grad_(True)
        self.p = p

    def attention(self, x, l):
        nb, nt, _ = x.shape
        q, k, v = (x @ self.p[f"qkv.{l}"].t()).split([NH * HD, self.kv * HD, self.kv * HD], dim=-1)
        q = rope(q.view(nb, nt, NH, HD), self.freqs)
        k = rope(k.view(nb, nt, self.kv, HD), self.freqs)
        v = v.view(nb, nt, self.kv, HD)
        group = NH // self.kv  # query head h reads key/value head h // group
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
        scores = scores.masked_fill(~torch.ones(nt, nt, dtype=torch.bool).tril(), float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(nb, nt, C)
        return y @ self.p[f"attproj.{l}"].t()

    def mlp(self, x, l):
        return (F.silu(x @ self.p[f"fc2.{l}"].t()) * (x @ self.p[f"fc.{l}"].t())) @ self.p[f"fcproj.{l}"].t()

    def forward(self, idx, targets):
        x = self.p["wte"][idx]
        for l in range(L):
            x = x + self.attention(rmsnorm(x, self.p[f"ln1.{l}"]), l)
            x = x + self.mlp(rmsnorm(x, self.p[f"ln2.{l}"]), l)
        logits = rmsnorm(x, self.p["lnf"]) @ self.p["wte" if self.tied else "lm_head"].t()
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1))

    def flat(self, grads=False):
        """llm5d's flat order: wte, lm_head (untied), ln1w, qkvw, attprojw, ln2w, fcw (c_fc, c_fc2), fcprojw, lnfw."""
        get = (lambda t: t.grad) if grads else (lambda t: t.detach())
        per_layer = lambda name: [get(self.p[f"{name}.{l}"]) for l in range(L)]
        fcw = [torch.cat([get(self.p[f"fc.{l}"]), get(self.p[f"fc2.{l}"])]) for l in range(L)]
        parts = [get(self.p["wte"])] + ([] if self.tied else [get(self.p["lm_head"])]) + per_layer("ln1") + per_layer("qkv") + \
            per_layer("attproj") + per_layer("ln2") + fcw + per_layer("fcproj") + [get(self.p["lnf"])]
        return np.concatenate([t.numpy().astype("<f4").ravel() for t in parts])

    def file_tensors(self):
        """llm.c's Llama 3 file: GPT-2's slots, lm_head (wte when tied) in wpe's, every bias slot present, zero."""
        t = lambda name, l: self.p[f"{name}.{l}"].detach()
        zeros = lambda n: torch.zeros(n, dtype=torch.float64)
        out = [self.p["wte"].detach(), self.p["wte" if self.tied else "lm_head"].detach()]
        out += [t("ln1", l) for l in range(L)] + [zeros(C) for _ in range(L)]
        out += [t("qkv", l) for l in range(L)] + [zeros((NH + 2 * self.kv) * HD) for _ in range(L)]
        out += [t("attproj", l) for l in range(L)] + [zeros(C) for _ in range(L)]
        out += [t("ln2", l) for l in range(L)] + [zeros(C) for _ in range(L)]
        out += [torch.cat([t("fc", l), t("fc2", l)]) for l in range(L)] + [zeros(2 * H) for _ in range(L)]
        out += [t("fcproj", l) for l in range(L)] + [zeros(C) for _ in range(L)]
        out += [self.p["lnf"].detach(), zeros(C)]
        return np.concatenate([x.numpy().astype("<f4").ravel() for x in out])


def header_ints(values):
    h = np.zeros(256, dtype="<i4")
    h[:len(values)] = values
    return h.tobytes()


def f32_bits(value):
    return struct.unpack("<i", struct.pack("<f", value))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv", type=int, required=True, help="key/value heads (divides %d)" % NH)
    ap.add_argument("--rope-scaling", type=float, default=0.0,
                    help="Llama 3's RoPE frequency scaling factor (3.1: 8, 3.2: 32; 0: none)")
    ap.add_argument("--tied", action="store_true", help="the classifier is the token embedding (Llama 3.2 1B, 3B)")
    args = ap.parse_args()
    assert NH % args.kv == 0
    theta = 500000.0 if args.rope_scaling else 10000.0

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(SEED + args.kv)
    model = Llama(args.kv, theta, args.rope_scaling, args.tied, gen)
    params = list(model.p.values())
    x = torch.randint(0, V, (MICRO * B, T), generator=gen, dtype=torch.long)
    y = torch.randint(0, V, (MICRO * B, T), generator=gen, dtype=torch.long)
    file_values = model.file_tensors()

    # the first micro-batch alone: logits, loss and every gradient of its mean loss
    logits, loss = model.forward(x[:B], y[:B])
    loss.backward()
    init_logits, init_loss, init_grads = logits.detach().clone(), float(loss), model.flat(grads=True)

    # 10 steps, each the mean loss of MICRO micro-batches (their gradients summed, each weighted 1/MICRO)
    m_state = [torch.zeros_like(p) for p in params]
    v_state = [torch.zeros_like(p) for p in params]
    losses = []
    for step in range(1, NSTEPS + 1):
        for p in params:
            p.grad = None
        total = 0.0
        for k in range(MICRO):
            _, loss = model.forward(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
            (loss / MICRO).backward()
            total += float(loss) / MICRO
        losses.append(total)
        norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in params))
        scale = CLIP / norm if norm > CLIP else 1.0
        with torch.no_grad():
            for p, m, v in zip(params, m_state, v_state):
                g = p.grad * scale
                m.mul_(BETA1).add_(g * (1 - BETA1))
                v.mul_(BETA2).add_(g * g * (1 - BETA2))
                m_hat, v_hat = m / (1 - BETA1 ** step), v / (1 - BETA2 ** step)
                decay = WD if p.dim() >= 2 else 0.0  # the 2-D weights
                p.sub_(LR * (m_hat / (v_hat.sqrt() + EPS) + decay * p))

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "model.bin"), "wb") as f:
        scaled = args.rope_scaling > 0
        f.write(header_ints([LLAMA_MAGIC, 3, MAXT, V, L, NH, args.kv, C, MULTIPLE_OF, int(scaled), 3, 2 if args.tied else 1,
                             0, 0, int(args.tied)]))
        hf = np.zeros(256, dtype="<f4")
        hf[:4] = [FFN_DIM_MULTIPLIER, NORM_EPS, theta, args.rope_scaling if args.rope_scaling != 8 else 0]
        f.write(hf.tobytes())
        f.write(file_values.tobytes())
    with open(os.path.join(args.out, "state.bin"), "wb") as f:
        f.write(header_ints([STATE_MAGIC, STATE_VERSION, B, T, V, V, NSTEPS, f32_bits(LR), f32_bits(WD),
                             f32_bits(CLIP), 0, 0, MICRO]))
        f.write(x.numpy().astype("<i4").tobytes())
        f.write(y.numpy().astype("<i4").tobytes())
        f.write(init_logits.numpy().astype("<f4").tobytes())
        f.write(np.array([init_loss], dtype="<f4").tobytes())
        f.write(init_grads.tobytes())
        f.write(np.array(losses, dtype="<f4").tobytes())
    print(f"Llama L={L} C={C} NH={NH} KV={args.kv} H={H} V={V} theta={theta:g} scaling={args.rope_scaling:g} "
          f"tied={args.tied}: "
          f"{init_grads.size} parameters, initial loss {init_loss:.6f} (ln V = {math.log(V):.6f}), "
          f"losses {losses[0]:.6f} -> {losses[-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
