#!/usr/bin/python3
"""Generate a small GPT-2 reference (weights + debug state) for llm5d tests.

Run with Debian's interpreter, which ships torch and numpy:

    /usr/bin/python3 test/reference/make_reference.py --out DIR [--moe [--shared H] [--sigmoid] [--scale F]
        [--bias-rate G]]

Writes DIR/model.bin (llm.c checkpoint layout, fp32) and DIR/state.bin
(inputs, targets, initial logits/loss/gradients, and the losses of a short
AdamW run on the same batch).

With --moe every MLP is a top-K mixture of E experts with a learned router and
a load-balancing auxiliary loss (see Block.moe_mlp). The model file then holds
E and K in header[8], header[9] and the router/expert tensors in place of the
dense fc/fc_proj ones; the state file holds alpha and the initial aux loss in
header[10], header[11]. --shared H adds to every layer an always-on shared expert
(DeepSeek's: GPT-2's MLP of H hidden units on every token, added to the experts'
sum), llm5d's header[14] = H and its tensors last in the file. --sigmoid scores
each expert by the sigmoid of its logit (DeepSeek-V3's router: the gates the
chosen scores over their sum, the aux loss's P the scores over theirs, header[16]
1), and --scale F multiplies the gates by F (routed_scaling_factor, header[17]
its float's bits). --bias-rate G chooses the experts by the scores plus a bias
per expert (DeepSeek-V3's balancing without an auxiliary loss: the gates stay
the scores'), which after each AdamW step moves by G·sign(mean load − load) from
that step's assignments (header[18] 1; the state's header[13] G; the bias last
in the file, zeros, with zero gradients). Losses written
are cross-entropy only; gradients and training use cross-entropy + aux.
"""

import argparse
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------
# configuration (deliberately odd sizes so indexing bugs show up)

L = 3          # layers (2 with --moe)
C = 48         # channels
NH = 4         # heads
V = 397        # vocab
VP = 512       # padded vocab
MAXT = 29      # max sequence length
B = 3          # batch
T = 17         # sequence length
E = 0          # experts per MLP (0: dense MLP)
K = 0          # experts per token (top-K)
ALPHA = 0.0    # weight of the load-balancing loss
SHARED = 0     # the shared expert's hidden units (0: none)
SIGMOID = False  # the router's scores: each expert's sigmoid (else the softmax over the top K, and over all E for P)
SCALE = 1.0    # the gates' factor
BIAS_RATE = 0.0  # the selection bias's step per update (0: no bias)

MOE_CONFIG = dict(L=2, E=4, K=2, ALPHA=0.1)

NSTEPS = 10
LR = 1e-3
WD = 0.1
CLIP = 1.0
BETA1 = 0.9
BETA2 = 0.95
EPS = 1e-8

SEED = 1234

MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3
STATE_MAGIC = 20240327
STATE_VERSION = 3



def configure(moe):
    """Switch the module-level shape to the MoE model (before building it)."""
    if moe:
        globals().update(MOE_CONFIG)

# ----------------------------------------------------------------------------
# model

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.qkv = nn.Linear(C, 3 * C)
        self.attn_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        if E:
            # experts stacked along dim 0, each stored (out, in) like nn.Linear
            self.router = nn.Linear(C, E, bias=False)
            self.fc_w = nn.Parameter(torch.empty(E, 4 * C, C))
            self.fc_b = nn.Parameter(torch.empty(E, 4 * C))
            self.fc_proj_w = nn.Parameter(torch.empty(E, C, 4 * C))
            self.fc_proj_b = nn.Parameter(torch.empty(E, C))
            if SHARED:
                self.shared_fc = nn.Linear(C, SHARED)
                self.shared_fc_proj = nn.Linear(SHARED, C)
            if BIAS_RATE:  # chooses, never trained: a buffer
                self.register_buffer("sel_bias", torch.zeros(E))
        else:
            self.fc = nn.Linear(C, 4 * C)
            self.fc_proj = nn.Linear(4 * C, C)

    def attention(self, h):
        nb, nt, _ = h.shape
        hs = C // NH
        q, k, v = self.qkv(h).split(C, dim=2)
        # (nb, nt, C) -> (nb, NH, nt, hs); head j owns channels [j*hs, (j+1)*hs)
        q = q.view(nb, nt, NH, hs).transpose(1, 2)
        k = k.view(nb, nt, NH, hs).transpose(1, 2)
        v = v.view(nb, nt, NH, hs).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        allowed = torch.ones(nt, nt, dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = (probs @ v).transpose(1, 2).contiguous().view(nb, nt, C)
        return self.attn_proj(out)

    def mlp(self, h):
        return self.fc_proj(F.gelu(self.fc(h), approximate="tanh"))

    def moe_mlp(self, h):
        """Top-K mixture of experts; returns (output, load-balancing loss)."""
        logits = self.router(h)                          # (nb, nt, E)
        top_logits, top_idx = torch.topk(logits, K, dim=-1)
        if BIAS_RATE:  # the K largest scores plus the bias choose; the gates stay the scores'
            choice = torch.sigmoid(logits) if SIGMOID else torch.softmax(logits, dim=-1)
            _, top_idx = torch.topk(choice.detach() + self.sel_bias, K, dim=-1)
            top_logits = torch.gather(logits, 2, top_idx)
        self.last_counts = F.one_hot(top_idx, E).sum(dim=(0, 1, 2)).double()  # this forward's load per expert
        if SIGMOID:
            scores = torch.sigmoid(logits)
            chosen_scores = torch.gather(scores, 2, top_idx)
            gates = chosen_scores / chosen_scores.sum(dim=-1, keepdim=True) * SCALE
        else:
            gates = torch.softmax(top_logits, dim=-1) * SCALE  # (nb, nt, K)
        # every expert on every token (tiny sizes), then keep the chosen ones
        hid = torch.einsum("btc,efc->btef", h, self.fc_w) + self.fc_b
        hid = F.gelu(hid, approximate="tanh")
        out = torch.einsum("btef,ecf->btec", hid, self.fc_proj_w) + self.fc_proj_b
        chosen = torch.gather(out, 2, top_idx.unsqueeze(-1).expand(-1, -1, -1, C))
        y = (gates.unsqueeze(-1) * chosen).sum(dim=2)
        # f_i: share of the sequence's (token, slot) assignments, a constant
        nt = h.shape[1]
        counts = F.one_hot(top_idx, E).sum(dim=(1, 2)).to(h.dtype)  # (nb, E)
        f = (counts / (nt * K)).detach()
        if SIGMOID:
            prob = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)
        else:
            prob = torch.softmax(logits, dim=-1).mean(dim=1)         # (nb, E)
        aux = (ALPHA * E * (f * prob).sum(dim=-1)).mean()
        if SHARED:  # the shared expert: every token, beside the chosen experts
            y = self.shared_fc_proj(F.gelu(self.shared_fc(h), approximate="tanh")) + y
        return y, aux

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        if E:
            y, aux = self.moe_mlp(self.ln_2(x))
            return x + y, aux
        x = x + self.mlp(self.ln_2(x))
        return x, None


class TinyGPT2(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Parameter(torch.empty(V, C))
        self.wpe = nn.Parameter(torch.empty(MAXT, C))
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = nn.LayerNorm(C, eps=1e-5)

    def forward(self, idx, targets):
        nt = idx.shape[1]
        pos = torch.arange(nt, dtype=torch.long)
        x = self.wte[idx] + self.wpe[pos]
        aux = None  # summed over layers; None for the dense model
        for blk in self.blocks:
            x, blk_aux = blk(x)
            if blk_aux is not None:
                aux = blk_aux if aux is None else aux + blk_aux
        logits = self.ln_f(x) @ self.wte.t()
        loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))
        return logits, loss, aux

    def objective(self, idx, targets):
        """(logits, cross-entropy, aux, cross-entropy + aux)."""
        logits, loss, aux = self(idx, targets)
        return logits, loss, aux, (loss if aux is None else loss + aux)


def init_weights(model, gen):
    def normal(t, std, mean=0.0):
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=gen) * std + mean)

    resid_std = 0.02 / math.sqrt(2 * L)
    normal(model.wte, 0.02)
    normal(model.wpe, 0.02)
    for blk in model.blocks:
        for ln in (blk.ln_1, blk.ln_2):
            normal(ln.weight, 0.1, 1.0)
            normal(ln.bias, 0.1)
        mlp = ((blk.fc_w, blk.fc_b, 0.02), (blk.fc_proj_w, blk.fc_proj_b, resid_std)) \
            if E else ((blk.fc.weight, blk.fc.bias, 0.02),
                       (blk.fc_proj.weight, blk.fc_proj.bias, resid_std))
        attn = ((blk.qkv.weight, blk.qkv.bias, 0.02),
                (blk.attn_proj.weight, blk.attn_proj.bias, resid_std))
        if E:
            normal(blk.router.weight, 0.02)
        if E and SHARED:
            mlp += ((blk.shared_fc.weight, blk.shared_fc.bias, 0.02),
                    (blk.shared_fc_proj.weight, blk.shared_fc_proj.bias, resid_std))
        for weight, bias, std in attn + mlp:
            normal(weight, std)
            normal(bias, 0.02)
    normal(model.ln_f.weight, 0.1, 1.0)
    normal(model.ln_f.bias, 0.1)


# ----------------------------------------------------------------------------
# serialization in checkpoint order

def ordered_tensors(model, grads=False):
    """Tensors in checkpoint order; wte padded to VP rows with zeros."""
    get = (lambda p: p.grad) if grads else (lambda p: p)
    blks = model.blocks

    def stack(fn):
        return torch.stack([get(fn(b)).detach() for b in blks])

    wte = torch.zeros(VP, C, dtype=torch.float32)
    wte[:V] = get(model.wte).detach()
    return [
        wte,
        get(model.wpe).detach(),
        stack(lambda b: b.ln_1.weight),
        stack(lambda b: b.ln_1.bias),
        stack(lambda b: b.qkv.weight),
        stack(lambda b: b.qkv.bias),
        stack(lambda b: b.attn_proj.weight),
        stack(lambda b: b.attn_proj.bias),
        stack(lambda b: b.ln_2.weight),
        stack(lambda b: b.ln_2.bias),
    ] + ([
        stack(lambda b: b.router.weight),   # (L, E, C)
        stack(lambda b: b.fc_w),            # (L, E, 4C, C)
        stack(lambda b: b.fc_b),            # (L, E, 4C)
        stack(lambda b: b.fc_proj_w),       # (L, E, C, 4C)
        stack(lambda b: b.fc_proj_b),       # (L, E, C)
    ] if E else [
        stack(lambda b: b.fc.weight),
        stack(lambda b: b.fc.bias),
        stack(lambda b: b.fc_proj.weight),
        stack(lambda b: b.fc_proj.bias),
    ]) + [
        get(model.ln_f.weight).detach(),
        get(model.ln_f.bias).detach(),
    ] + ([
        stack(lambda b: b.shared_fc.weight),       # (L, SHARED, C)
        stack(lambda b: b.shared_fc.bias),         # (L, SHARED)
        stack(lambda b: b.shared_fc_proj.weight),  # (L, C, SHARED)
        stack(lambda b: b.shared_fc_proj.bias),    # (L, C)
    ] if E and SHARED else []) + ([
        torch.stack([b.sel_bias if not grads else torch.zeros(E) for b in blks]),  # (L, E)
    ] if E and BIAS_RATE else [])


def expected_num_params():
    attn_ln = 4 * C * C + 8 * C        # ln_1, qkv, attn_proj, ln_2
    mlp = 8 * C * C + 5 * C            # fc + fc_proj with biases
    shared = 2 * C * SHARED + SHARED + C if SHARED else 0
    per_layer = attn_ln + (E * C + E * mlp + shared + (E if BIAS_RATE else 0) if E else mlp)
    return VP * C + MAXT * C + L * per_layer + 2 * C


def as_f32_bytes(tensors):
    flat = np.concatenate([t.contiguous().numpy().astype("<f4").ravel()
                           for t in tensors])
    return flat.tobytes(), flat.size


def f32_bits(value):
    return struct.unpack("<i", struct.pack("<f", value))[0]


def header(values):
    h = np.zeros(256, dtype="<i4")
    h[:len(values)] = values
    return h.tobytes()


# ----------------------------------------------------------------------------
# training step (llm.c AdamW semantics)

def is_decayed(name, p):
    # matrices, including stacked (E, out, in) expert weights; the stacked
    # expert biases (E, n) are vectors per expert and are not decayed
    per_matrix_dims = p.dim() - (1 if name.endswith(("fc_b", "fc_proj_b")) else 0)
    return per_matrix_dims >= 2


def adamw_step(params, decayed, m_state, v_state, t, grad_scale):
    with torch.no_grad():
        for p, dec, m, v in zip(params, decayed, m_state, v_state):
            g = p.grad * grad_scale
            m.mul_(BETA1).add_(g * (1.0 - BETA1))
            v.mul_(BETA2).add_(g * g * (1.0 - BETA2))
            m_hat = m / (1.0 - BETA1 ** t)
            v_hat = v / (1.0 - BETA2 ** t)
            wd = WD if dec else 0.0
            p.sub_(LR * (m_hat / (v_hat.sqrt() + EPS) + wd * p))


def global_grad_norm(params):
    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        total = total + (p.grad.float() ** 2).sum()
    return float(total.sqrt())


# ----------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--moe", action="store_true",
                    help="mixture-of-experts MLPs (L=%(L)d, E=%(E)d, top-%(K)d)"
                    % MOE_CONFIG)
    ap.add_argument("--shared", type=int, default=0,
                    help="with --moe: a shared expert of this many hidden units")
    ap.add_argument("--sigmoid", action="store_true", help="with --moe: sigmoid scores")
    ap.add_argument("--scale", type=float, default=1.0, help="with --moe: the gates' factor")
    ap.add_argument("--bias-rate", type=float, default=0.0, help="with --moe: a selection bias moving this fast")
    args = ap.parse_args()
    assert args.moe or not (args.shared or args.sigmoid or args.scale != 1.0 or args.bias_rate), \
        "--shared, --sigmoid, --scale, --bias-rate need --moe"
    configure(args.moe)
    globals().update(SHARED=args.shared, SIGMOID=args.sigmoid, SCALE=args.scale, BIAS_RATE=args.bias_rate)

    t0 = time.time()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)

    gen = torch.Generator().manual_seed(SEED)
    model = TinyGPT2()
    init_weights(model, gen)
    x = torch.randint(0, V, (B, T), generator=gen, dtype=torch.long)
    y = torch.randint(0, V, (B, T), generator=gen, dtype=torch.long)

    named = list(model.named_parameters())
    params = [p for _, p in named]
    decayed = [is_decayed(n, p) for n, p in named]
    for p in params:
        assert p.dtype == torch.float32

    # model file (initial weights)
    weight_bytes, nparams = as_f32_bytes(ordered_tensors(model))
    n_decayed = sum(p.numel() for p, d in zip(params, decayed) if d)
    expected_decayed = V * C + MAXT * C + L * (
        4 * C * C + (E * C + E * 8 * C * C + 2 * C * SHARED if E else 8 * C * C))
    assert n_decayed == expected_decayed, (n_decayed, expected_decayed)
    assert nparams == expected_num_params(), (nparams, expected_num_params())

    # forward/backward of the initial model
    model.zero_grad(set_to_none=False)
    logits, loss, aux, objective = model.objective(x, y)
    objective.backward()
    init_logits = logits.detach().clone()
    init_loss = float(loss)
    init_aux = 0.0 if aux is None else float(aux)
    if E:
        # a nearly balanced router gives aux ~ ALPHA per layer
        assert 0.0 < init_aux and abs(init_aux - ALPHA * L) < 0.1 * ALPHA * L, \
            (init_aux, ALPHA * L)
    grad_bytes, ngrads = as_f32_bytes(ordered_tensors(model, grads=True))
    assert ngrads == nparams
    init_norm = global_grad_norm(params)

    # training
    m_state = [torch.zeros_like(p) for p in params]
    v_state = [torch.zeros_like(p) for p in params]
    losses, norms = [], []
    for step in range(NSTEPS):
        for p in params:
            p.grad = None
        _, loss, _, objective = model.objective(x, y)
        losses.append(float(loss))
        objective.backward()
        norm = global_grad_norm(params)
        norms.append(norm)
        scale = CLIP / norm if norm > CLIP else 1.0
        adamw_step(params, decayed, m_state, v_state, step + 1, scale)
        if BIAS_RATE:  # the bias toward balanced loads, from this step's assignments
            with torch.no_grad():
                for b in model.blocks:
                    b.sel_bias += BIAS_RATE * torch.sign(b.last_counts.mean() - b.last_counts).float()
    assert losses[0] == init_loss, (losses[0], init_loss)

    os.makedirs(args.out, exist_ok=True)
    model_path = os.path.join(args.out, "model.bin")
    with open(model_path, "wb") as f:
        f.write(header([MODEL_MAGIC, MODEL_VERSION_FP32, MAXT, V, L, NH, C, VP,
                        E, K, 0, 0, 0, 0, SHARED, 0, int(SIGMOID),
                        0 if SCALE == 1.0 else f32_bits(SCALE), int(BIAS_RATE > 0)]))
        f.write(weight_bytes)

    state_path = os.path.join(args.out, "state.bin")
    with open(state_path, "wb") as f:
        f.write(header([STATE_MAGIC, STATE_VERSION, B, T, V, VP, NSTEPS,
                        f32_bits(LR), f32_bits(WD), f32_bits(CLIP),
                        f32_bits(ALPHA), f32_bits(init_aux), 0, f32_bits(BIAS_RATE)]))
        f.write(x.numpy().astype("<i4").tobytes())
        f.write(y.numpy().astype("<i4").tobytes())
        f.write(init_logits.numpy().astype("<f4").tobytes())
        f.write(np.array([init_loss], dtype="<f4").tobytes())
        f.write(grad_bytes)
        f.write(np.array(losses, dtype="<f4").tobytes())

    model_size = 1024 + 4 * nparams
    state_size = 1024 + 4 * (2 * B * T + B * T * V + 1 + nparams + NSTEPS)
    assert os.path.getsize(model_path) == model_size
    assert os.path.getsize(state_path) == state_size

    print(f"num_params {nparams}")
    print(f"initial loss {init_loss:.6f} (ln V = {math.log(V):.6f})")
    if E:
        print(f"initial aux loss {init_aux:.6f} (alpha * L = {ALPHA * L:.6f})")
    print(f"initial grad norm {init_norm:.6f}")
    for i, (l, n) in enumerate(zip(losses, norms)):
        print(f"step {i}: loss {l:.6f} grad norm {n:.6f}")
    print(f"wrote {model_path} ({model_size} bytes), "
          f"{state_path} ({state_size} bytes) in {time.time() - t0:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
