#!/usr/bin/python3
"""Generate a small Llama 3 reference (an llm.c Llama 3 model file + debug state) for llm5d's tests.

Run with Debian's interpreter, which ships torch and numpy:

    /usr/bin/python3 test/reference/make_llama_reference.py --out DIR --kv KV [--rope-scaling F] [--tied]
        [--experts E --top-k K]

An independent Llama 3 written here from Meta's reference model (RMSNorm, RoPE on interleaved pairs with
Llama 3's frequency scaling by a factor F when asked, SwiGLU, grouped-query attention with KV key/value heads,
an lm_head of its own or the token embedding's transpose when tied, no biases; with --experts, Mixtral's MLP:
a router picking the top K of E SwiGLU experts per token, gates the softmax over the K chosen logits, and a
load-balancing loss ALPHA·E·Σ f_i·P_i per sequence and layer added to the objective as its mean over the
sequences), computed in float64 from float32 weights. Writes DIR/model.bin in llm.c's Llama 3 layout (the llama3 branch's write_model: 256 int32 + 256
float32 header, GPT-2's tensor slots, zero biases, lm_head in wpe's slot; llm5d's additions: int [14] 1 when
tied, with wte repeated in lm_head's slot, float [3] the scaling factor when it is not 8, and int [12], [13]
E and K with experts, whose router follows ln2's slots and whose tensors stack the experts per layer) and
DIR/state.bin in the GPT-2 reference's state format (with experts ALPHA and the first micro-batch's aux loss in
header [10] and [11]): the first micro-batch's inputs,
targets, logits, loss and every gradient (in llm5d's flat order, which has no bias slots and pads the vocab rows
of wte and lm_head with zeros to VP, as memory holds them; the model file holds V rows), then the losses of
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
VP = 512       # the vocab rounded up to a multiple of 128, as llm5d pads every model's in memory
MAXT = 29
B = 2          # sequences per micro-batch
MICRO = 2      # micro-batches per step
T = 17
NORM_EPS = 1e-5

NSTEPS = 10
ALPHA = 0.1    # the load-balancing loss's weight, with experts
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


def float32_normal(gen, *shape, std):
    """A float64 tensor of normal values drawn in float32, as the model file stores them."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).double()


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w


class Llama:
    """The parameters as a dict of float64 leaf tensors, and the forward pass."""

    def __init__(self, kv, theta, scaling, tied, experts, top_k, gen):
        self.kv, self.theta, self.tied, self.E, self.K = kv, theta, tied, experts, top_k
        self.freqs = rope_frequencies(theta, scaling)

        normal = lambda *shape, std: float32_normal(gen, *shape, std=std)

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
            experts = (experts,) if experts else ()  # with experts every MLP tensor stacks them first
            if experts:
                p[f"router.{l}"] = normal(experts[0], C, std=0.02)
            p[f"fc.{l}"] = normal(*experts, H, C, std=0.02)
            p[f"fc2.{l}"] = normal(*experts, H, C, std=0.02)
            p[f"fcproj.{l}"] = normal(*experts, C, H, std=resid)
            experts = experts[0] if experts else 0
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
        """SwiGLU, or with experts the mixture of SwiGLU experts; returns (output, load-balancing loss)."""
        fc, fc2, fcproj = (self.p[f"{name}.{l}"] for name in ("fc", "fc2", "fcproj"))
        if not self.E:
            return (F.silu(x @ fc2.t()) * (x @ fc.t())) @ fcproj.t(), 0.0
        logits = x @ self.p[f"router.{l}"].t()                      # (nb, nt, E)
        top_logits, top_idx = torch.topk(logits, self.K, dim=-1)
        gates = torch.softmax(top_logits, dim=-1)                    # (nb, nt, K)
        # every expert on every token (tiny sizes), then keep the chosen ones
        hidden = F.silu(torch.einsum("btc,ehc->bteh", x, fc2)) * torch.einsum("btc,ehc->bteh", x, fc)
        out = torch.einsum("bteh,ech->btec", hidden, fcproj)
        chosen = torch.gather(out, 2, top_idx.unsqueeze(-1).expand(-1, -1, -1, C))
        y = (gates.unsqueeze(-1) * chosen).sum(dim=2)
        # f_i: the share of the sequence's K·T assignments that went to expert i, a constant
        counts = F.one_hot(top_idx, self.E).sum(dim=(1, 2)).to(x.dtype)    # (nb, E)
        f = (counts / (x.shape[1] * self.K)).detach()
        prob = torch.softmax(logits, dim=-1).mean(dim=1)                    # (nb, E)
        return y, (ALPHA * self.E * (f * prob).sum(dim=-1)).mean()

    def forward(self, idx, targets):
        """(logits, cross-entropy, the load-balancing loss summed over the layers)."""
        x, aux = self.p["wte"][idx], 0.0
        for l in range(L):
            x = x + self.attention(rmsnorm(x, self.p[f"ln1.{l}"]), l)
            y, layer_aux = self.mlp(rmsnorm(x, self.p[f"ln2.{l}"]), l)
            x, aux = x + y, aux + layer_aux
        logits = rmsnorm(x, self.p["lnf"]) @ self.p["wte" if self.tied else "lm_head"].t()
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1)), aux

    def flat(self, grads=False):
        """llm5d's flat order: wte, lm_head (untied), each padded to VP rows with zeros, ln1w, qkvw, attprojw,
        ln2w, routerw (with experts), fcw (c_fc then c_fc2, per expert), fcprojw, lnfw."""
        get = (lambda t: t.grad) if grads else (lambda t: t.detach())
        per_layer = lambda name: [get(self.p[f"{name}.{l}"]) for l in range(L)]
        padded = lambda t: torch.cat([t, torch.zeros(VP - V, C, dtype=t.dtype)])
        parts = [padded(get(self.p["wte"]))] + ([] if self.tied else [padded(get(self.p["lm_head"]))]) + \
            per_layer("ln1") + per_layer("qkv") + per_layer("attproj") + per_layer("ln2") + \
            (per_layer("router") if self.E else []) + self.fcw(get) + per_layer("fcproj") + [get(self.p["lnf"])]
        return np.concatenate([t.numpy().astype("<f4").ravel() for t in parts])

    def fcw(self, get):
        """Each layer's fcw: c_fc's rows then c_fc2's, of each expert in turn."""
        stack = lambda l: torch.cat([get(self.p[f"fc.{l}"]), get(self.p[f"fc2.{l}"])], dim=-2)
        return [stack(l) for l in range(L)]

    def file_tensors(self):
        """llm.c's Llama 3 file: GPT-2's slots, lm_head (wte when tied) in wpe's, every bias slot present, zero."""
        t = lambda name, l: self.p[f"{name}.{l}"].detach()
        zeros = lambda n: torch.zeros(n, dtype=torch.float64)
        out = [self.p["wte"].detach(), self.p["wte" if self.tied else "lm_head"].detach()]
        out += [t("ln1", l) for l in range(L)] + [zeros(C) for _ in range(L)]
        out += [t("qkv", l) for l in range(L)] + [zeros((NH + 2 * self.kv) * HD) for _ in range(L)]
        out += [t("attproj", l) for l in range(L)] + [zeros(C) for _ in range(L)]
        out += [t("ln2", l) for l in range(L)] + [zeros(C) for _ in range(L)]
        out += [t("router", l) for l in range(L)] if self.E else []
        experts = max(self.E, 1)
        out += self.fcw(lambda x: x.detach()) + [zeros(experts * 2 * H) for _ in range(L)]
        out += [t("fcproj", l) for l in range(L)] + [zeros(experts * C) for _ in range(L)]
        out += [self.p["lnf"].detach(), zeros(C)]
        return np.concatenate([x.numpy().astype("<f4").ravel() for x in out])


def header_ints(values):
    h = np.zeros(256, dtype="<i4")
    h[:len(values)] = values
    return h.tobytes()


def f32_bits(value):
    return struct.unpack("<i", struct.pack("<f", value))[0]


def run_reference(model, x, y):
    """The first micro-batch's (logits, loss, aux loss, flat gradients), then the losses of NSTEPS AdamW steps.

    model: .p (a dict of float64 leaf tensors), .forward(idx, targets) -> (logits, loss, aux) and
    .flat(grads=True) -> the gradients in llm5d's flat order, float32."""
    params = list(model.p.values())
    start_step = getattr(model, "start_step", lambda: None)  # a model that keeps statistics over a step's micro-batches
    # the first micro-batch alone: logits, loss and every gradient of its objective (the mean loss, plus with
    # experts the load-balancing loss)
    logits, loss, aux = model.forward(x[:B], y[:B])
    (loss + aux).backward()
    first = (logits.detach().clone(), float(loss), float(aux), model.flat(grads=True))

    # 10 steps, each the mean loss of MICRO micro-batches (their gradients summed, each weighted 1/MICRO)
    m_state = [torch.zeros_like(p) for p in params]
    v_state = [torch.zeros_like(p) for p in params]
    losses = []
    for step in range(1, NSTEPS + 1):
        for p in params:
            p.grad = None
        start_step()
        total = 0.0
        for k in range(MICRO):
            _, loss, aux = model.forward(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
            ((loss + aux) / MICRO).backward()
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
    return (*first, losses)


def write_model_file(path, ints, floats, values):
    """llm.c's Llama 3 file: 256 int32 (ints first), 256 float32 (floats first), then the float32 values."""
    with open(path, "wb") as f:
        f.write(header_ints(ints))
        hf = np.zeros(256, dtype="<f4")
        hf[:len(floats)] = floats
        f.write(hf.tobytes())
        f.write(values.tobytes())


def write_state(path, x, y, logits, loss, grads, losses, moe=(0, 0), aux_batch=False):
    """The state file: header (moe: header [10], [11]; [14] 1 for the load-balancing loss over the batch), every
    micro-batch's inputs and targets, the first one's logits, loss and gradients, then the steps' losses."""
    with open(path, "wb") as f:
        f.write(header_ints([STATE_MAGIC, STATE_VERSION, B, T, V, VP, NSTEPS, f32_bits(LR), f32_bits(WD),
                             f32_bits(CLIP), *moe, MICRO, 0, int(aux_batch)]))
        f.write(x.numpy().astype("<i4").tobytes())
        f.write(y.numpy().astype("<i4").tobytes())
        f.write(logits.numpy().astype("<f4").tobytes())
        f.write(np.array([loss], dtype="<f4").tobytes())
        f.write(grads.tobytes())
        f.write(np.array(losses, dtype="<f4").tobytes())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv", type=int, required=True, help="key/value heads (divides %d)" % NH)
    ap.add_argument("--rope-scaling", type=float, default=0.0,
                    help="Llama 3's RoPE frequency scaling factor (3.1: 8, 3.2: 32; 0: none)")
    ap.add_argument("--tied", action="store_true", help="the classifier is the token embedding (Llama 3.2 1B, 3B)")
    ap.add_argument("--experts", type=int, default=0, help="E SwiGLU experts in every MLP (0: dense)")
    ap.add_argument("--top-k", type=int, default=0, help="experts per token, with --experts")
    args = ap.parse_args()
    assert NH % args.kv == 0
    assert (args.experts > 1) == (args.top_k > 0) and args.top_k <= args.experts
    theta = 500000.0 if args.rope_scaling else 10000.0

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(SEED + args.kv)
    model = Llama(args.kv, theta, args.rope_scaling, args.tied, args.experts, args.top_k, gen)
    x = torch.randint(0, V, (MICRO * B, T), generator=gen, dtype=torch.long)
    y = torch.randint(0, V, (MICRO * B, T), generator=gen, dtype=torch.long)
    file_values = model.file_tensors()
    init_logits, init_loss, init_aux, init_grads, losses = run_reference(model, x, y)

    os.makedirs(args.out, exist_ok=True)
    write_model_file(os.path.join(args.out, "model.bin"),
                     [LLAMA_MAGIC, 3, MAXT, V, L, NH, args.kv, C, MULTIPLE_OF, int(args.rope_scaling > 0), 3,
                      2 if args.tied else 1, args.experts, args.top_k, int(args.tied)],
                     [FFN_DIM_MULTIPLIER, NORM_EPS, theta, args.rope_scaling if args.rope_scaling != 8 else 0],
                     file_values)
    moe = (f32_bits(ALPHA), f32_bits(init_aux)) if args.experts else (0, 0)
    write_state(os.path.join(args.out, "state.bin"), x, y, init_logits, init_loss, init_grads, losses, moe)
    print(f"Llama L={L} C={C} NH={NH} KV={args.kv} H={H} V={V} theta={theta:g} scaling={args.rope_scaling:g} "
          f"tied={args.tied} experts={args.experts} top-k={args.top_k}: "
          f"{init_grads.size} parameters, initial loss {init_loss:.6f} (ln V = {math.log(V):.6f}), "
          f"losses {losses[0]:.6f} -> {losses[-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
