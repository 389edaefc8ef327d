#!/usr/bin/env python3
"""llm5d against PyTorch on the same model file and the same batches: the last rung of the GPU model's check.

`init` writes an llm.c model file (fp32, version 3) in test/reference's initialization: weights N(0, 0.02) (the
residual projections scaled by 1/sqrt(2L)), biases N(0, 0.02), norm gains N(1, 0.1) and layernorm shifts
N(0, 0.1), so that no norm is the identity and a mix-up of gain and shift shows in the losses. With --arch
llama3 it writes llm.c's Llama 3 file instead (256 int32 + 256 float32 header, GPT-2's tensor slots with lm_head
in wpe's and every bias slot zero, the vocab unpadded; docs/file-formats.md): the same scheme, no biases.

`train` loads a model file, GPT-2 or Llama 3 as its magic says, into a PyTorch model: dev/bench/pytorch_gpt2.py's
GPT-2 (the benchmark's PyTorch model, so there is one PyTorch GPT-2 in the project), or the Llama 3 below
(RMSNorm, RoPE on interleaved pairs with Llama 3's frequency scaling when the file asks for it, grouped-query
attention, SwiGLU, an lm_head of its own or tied to wte as the file says, no biases; written after test/reference/make_llama_reference.py and llm.c's
train_llama3.py). It trains it for --steps AdamW steps as train_gpt does with `--shuffle 0 -k constant -u 0 -d
B*T` on one rank (step k reads tokens [k*B*T, (k+1)*B*T + 1) of the shard, wrapping like train_gpt's loader;
constant learning rate; β (0.9, 0.95), ε 1e-8, weight decay on the 2-D weights; gradients clipped to a global
norm of 1), and prints each step's loss. On the GPU it runs under bf16 autocast with fp32 parameters (the usual
PyTorch mixed precision, llm.c's reference for its own bf16 trainer); on the CPU in fp32, where train_gpt
--device cpu must agree to rounding. With --compare MAIN_LOG it compares the losses with a train_gpt run's
"s:STEP trl:LOSS" lines, and exits 1 when any step differs by more than --tol (absolute; llm.c accepts 0.05
between its bf16 GPU trainer and PyTorch).

    python3 dev/gpu/pytorch_check.py init --out model.bin --layers 12 --channels 768 --heads 12
    python3 dev/gpu/pytorch_check.py init --arch llama3 --out model.bin --layers 4 --channels 256 --heads 4 \\
        --kv-heads 2 --hidden 688 --rope-scaling 8
    ./train_gpt --device cuda -e model.bin -b 4 -t 1024 -x 10 -l 3e-4 -c 0.1 -k constant --shuffle 0 -v 0 -s 0 -o run
    python3 dev/gpu/pytorch_check.py train --model model.bin --batch 4 --seq-len 1024 --steps 10 --lr 3e-4 \\
        --weight-decay 0.1 --compare run/main.log --tol 0.05
"""

import argparse
import math
import os
import re
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from pytorch_gpt2 import GPT, causal_attention, load_tokens, make_optimizer, padded_vocab  # noqa: E402

GPT2_MAGIC = 20240326
LLAMA_MAGIC = 20240803
MODEL_VERSIONS = {3: np.float32, 5: np.uint16}  # fp32, bf16
HEADER_INTS = 256  # a GPT-2 file's header; a Llama 3 file's adds 256 float32
LLAMA_VERSION = (3, 1)  # the major and minor a Llama file names: 3.1, whose RoPE scaling the header may ask for
# the bias slots of GPT-2's layout, which a Llama 3 file keeps, all zero, for a model that has no biases
LLAMA_BIAS_SLOTS = ("ln1b", "qkvb", "attprojb", "ln2b", "fcb", "fcprojb", "lnfb")


# ------------------------------------------------------------------------------------------------------------
# Llama 3 in PyTorch

def llama_hidden(C, multiple_of, ffn_dim_multiplier):
    """Meta's MLP size as train_gpt computes it (GPTConfig::hidden): 2/3 of 4C, times the multiplier (0: none;
    the file's float32, widened), rounded up to a multiple of multiple_of."""
    h = int(2.0 * (4 * C) / 3)
    if ffn_dim_multiplier > 0:
        h = int(float(np.float32(ffn_dim_multiplier)) * h)
    return (h + multiple_of - 1) // multiple_of * multiple_of


def exact_multiplier(C, H):
    """The float32 multiplier that, with multiple_of = H, makes Meta's rule give H exactly: it brings 2/3 of 4C to
    H + 1/2, which truncates to H whatever the rounding (train_gpt's l...f<H> descriptors do the same)."""
    return float(np.float32(H + 0.5) / np.float32(int(2.0 * (4 * C) / 3)))


def llama3_scaling(freqs, factor):
    """Llama 3's stretch of the low frequencies (llm.c's apply_scaling): wavelengths below 8192/4 tokens keep
    their frequency, those above 8192 are slowed `factor` times (3.1: 8, 3.2: 32), those between are blended."""
    low, high, old_context = 1.0, 4.0, 8192.0
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(wavelen < old_context / high, freqs,
                       torch.where(wavelen > old_context / low, freqs / factor, blended))


def rope_angles(head_size, max_seq_len, theta, scaling):
    """cos and sin of pos·freq[i], (maxT, hd/2), in fp32 as llm.c's precompute_freqs_cis computes them, which is
    the table train_gpt's RoPE reads (llmc/rope.cuh)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_size, 2)[: head_size // 2].float() / head_size))
    if scaling:
        freqs = llama3_scaling(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def rope(x, cos, sin):
    """x (B, T, heads, hd) with each pair (2i, 2i+1) of a head turned by the angle pos·freq[i]; in fp32 under
    autocast too (llm.c's apply_rotary_emb), then back to x's type."""
    T = x.size(1)
    c, s = cos[:T, None, :], sin[:T, None, :]
    x32 = x.float()
    x0, x1 = x32[..., 0::2], x32[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(C))

    def forward(self, x):  # x is the fp32 residual stream, also under autocast
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """GPT-2's Block's names where the roles match, so that llama_tensors reads like gpt2_tensors."""

    def __init__(self, C, NH, KV, H, eps):
        super().__init__()
        self.NH, self.KV, self.hd = NH, KV, C // NH
        self.ln_1 = RMSNorm(C, eps)
        self.c_attn = nn.Linear(C, (NH + 2 * KV) * self.hd, bias=False)  # q, then k, then v
        self.attn_proj = nn.Linear(C, C, bias=False)
        self.ln_2 = RMSNorm(C, eps)
        self.c_fc = nn.Linear(C, H, bias=False)   # the up projection
        self.c_fc2 = nn.Linear(C, H, bias=False)  # the gate, through silu
        self.mlp_proj = nn.Linear(H, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split([self.NH * self.hd, self.KV * self.hd, self.KV * self.hd], dim=2)
        q = rope(q.view(B, T, self.NH, self.hd), cos, sin)
        k = rope(k.view(B, T, self.KV, self.hd), cos, sin)
        v = v.view(B, T, self.KV, self.hd)
        # grouped-query: query head h reads key/value head h // (NH/KV)
        k, v = (t.repeat_interleave(self.NH // self.KV, dim=2) for t in (k, v))
        y = causal_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        h = self.ln_2(x)
        return x + self.mlp_proj(F.silu(self.c_fc2(h)) * self.c_fc(h))


class Llama(nn.Module):
    """The model a Llama 3 header (read_header's dict) describes, with PyTorch's default weights until a file's
    are loaded or reference_init's drawn."""

    def __init__(self, hd):
        super().__init__()
        self.wte = nn.Embedding(hd["V"], hd["C"])
        self.blocks = nn.ModuleList(LlamaBlock(hd["C"], hd["NH"], hd["KV"], hd["H"], hd["norm_eps"])
                                    for _ in range(hd["L"]))
        self.ln_f = RMSNorm(hd["C"], hd["norm_eps"])
        self.lm_head = nn.Linear(hd["C"], hd["V"], bias=False)
        if hd["tied"]:  # the classifier is the token embedding (Llama 3.2 1B and 3B)
            self.lm_head.weight = self.wte.weight
        cos, sin = rope_angles(hd["C"] // hd["NH"], hd["maxT"], hd["rope_theta"], hd["rope_scaling"])
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------------------------------------------------
# llm.c's model files: a header, then the tensors in this order, each layer tensor stacked over layers

def gpt2_tensors(model):
    """(name, [the PyTorch tensors it stacks]) in llm.c's file order; wte has all Vp rows."""
    blocks = model.blocks
    per_layer = lambda get: [get(b) for b in blocks]  # noqa: E731
    return [
        ("wte", [model.wte.weight]),
        ("wpe", [model.wpe.weight]),
        ("ln1w", per_layer(lambda b: b.ln_1.weight)),
        ("ln1b", per_layer(lambda b: b.ln_1.bias)),
        ("qkvw", per_layer(lambda b: b.c_attn.weight)),
        ("qkvb", per_layer(lambda b: b.c_attn.bias)),
        ("attprojw", per_layer(lambda b: b.attn_proj.weight)),
        ("attprojb", per_layer(lambda b: b.attn_proj.bias)),
        ("ln2w", per_layer(lambda b: b.ln_2.weight)),
        ("ln2b", per_layer(lambda b: b.ln_2.bias)),
        ("fcw", per_layer(lambda b: b.c_fc.weight)),
        ("fcb", per_layer(lambda b: b.c_fc.bias)),
        ("fcprojw", per_layer(lambda b: b.mlp_proj.weight)),
        ("fcprojb", per_layer(lambda b: b.mlp_proj.bias)),
        ("lnfw", [model.ln_f.weight]),
        ("lnfb", [model.ln_f.bias]),
    ]


def llama_tensors(model):
    """The same for a Llama 3 file: GPT-2's slots with lm_head in wpe's (a tied model's wte, the same tensor
    twice), each layer's fcw its c_fc then its c_fc2,
    and in every bias slot (LLAMA_BIAS_SLOTS) zero tensors of the slot's size, which are no parameters."""
    blocks = model.blocks
    per_layer = lambda get: [get(b) for b in blocks]  # noqa: E731
    zeros = lambda n: [torch.zeros(n) for _ in blocks]  # noqa: E731
    C, QKV, H = model.wte.embedding_dim, blocks[0].c_attn.out_features, blocks[0].c_fc.out_features
    return [
        ("wte", [model.wte.weight]),
        ("lm_head", [model.lm_head.weight]),
        ("ln1w", per_layer(lambda b: b.ln_1.weight)),
        ("ln1b", zeros(C)),
        ("qkvw", per_layer(lambda b: b.c_attn.weight)),
        ("qkvb", zeros(QKV)),
        ("attprojw", per_layer(lambda b: b.attn_proj.weight)),
        ("attprojb", zeros(C)),
        ("ln2w", per_layer(lambda b: b.ln_2.weight)),
        ("ln2b", zeros(C)),
        ("fcw", [w for b in blocks for w in (b.c_fc.weight, b.c_fc2.weight)]),
        ("fcb", zeros(2 * H)),
        ("fcprojw", per_layer(lambda b: b.mlp_proj.weight)),
        ("fcprojb", zeros(C)),
        ("lnfw", [model.ln_f.weight]),
        ("lnfb", [torch.zeros(C)]),
    ]


def check_llama_shape(hd, where):
    """The shapes train_gpt accepts (validate_config): KV divides NH, NH divides C, pairs for RoPE."""
    C, NH, KV = hd["C"], hd["NH"], hd["KV"]
    if min(C, NH, KV, hd["H"]) <= 0 or NH % KV or C % NH or (C // NH) % 2:
        sys.exit(f"pytorch_check: {where}: C={C} NH={NH} KV={KV} H={hd['H']}: need KV dividing NH, NH dividing C, "
                 f"an even head size and a positive H")


def read_header(path):
    """The file's header as a dict; `arch` (gpt2 or llama3) follows the magic."""
    with open(path, "rb") as f:
        raw = f.read(2 * HEADER_INTS * 4)
    if len(raw) < HEADER_INTS * 4:
        sys.exit(f"pytorch_check: {path}: shorter than the model header")
    h = np.frombuffer(raw[: HEADER_INTS * 4], dtype="<i4")
    if h[0] not in (GPT2_MAGIC, LLAMA_MAGIC) or int(h[1]) not in MODEL_VERSIONS:
        sys.exit(f"pytorch_check: {path}: not an llm.c model file (magic {h[0]}, version {h[1]})")
    if h[0] == GPT2_MAGIC:
        version, maxT, V, L, NH, C, Vp = (int(x) for x in h[1:8])
        return dict(arch="gpt2", header_bytes=HEADER_INTS * 4, version=version, maxT=maxT, V=V, L=L, NH=NH, C=C,
                    Vp=Vp)
    if len(raw) < 2 * HEADER_INTS * 4:
        sys.exit(f"pytorch_check: {path}: shorter than the Llama 3 model header")
    version, maxT, V, L, NH, KV, C, multiple_of, scaled = (int(x) for x in h[1:10])
    floats = np.frombuffer(raw[HEADER_INTS * 4:], "<f4")
    ffn_dim_multiplier, norm_eps, rope_theta, factor = (float(x) for x in floats[:4])
    # llm5d's slots: int [14] 1 when the classifier is tied to wte, float [3] a scaling factor other than 8
    hd = dict(arch="llama3", header_bytes=2 * HEADER_INTS * 4, version=version, maxT=maxT, V=V, L=L, NH=NH, KV=KV,
              C=C, multiple_of=multiple_of, ffn_dim_multiplier=ffn_dim_multiplier, norm_eps=norm_eps,
              rope_theta=rope_theta, rope_scaling=(factor or 8.0) if scaled else 0.0, tied=int(h[14]) == 1,
              H=llama_hidden(C, multiple_of, ffn_dim_multiplier))
    check_llama_shape(hd, path)
    return hd


def header_bytes(hd):
    """The header of a file holding hd's model, fp32 (version 3)."""
    ints = np.zeros(HEADER_INTS, dtype="<i4")
    if hd["arch"] == "gpt2":
        ints[:8] = [GPT2_MAGIC, 3, hd["maxT"], hd["V"], hd["L"], hd["NH"], hd["C"], hd["Vp"]]
        return ints.tobytes()
    ints[:15] = [LLAMA_MAGIC, 3, hd["maxT"], hd["V"], hd["L"], hd["NH"], hd["KV"], hd["C"], hd["multiple_of"],
                 int(hd["rope_scaling"] > 0), *LLAMA_VERSION, 0, 0, int(hd["tied"])]
    floats = np.zeros(HEADER_INTS, dtype="<f4")
    floats[:4] = [hd["ffn_dim_multiplier"], hd["norm_eps"], hd["rope_theta"],
                  hd["rope_scaling"] if hd["rope_scaling"] != 8 else 0.0]
    return ints.tobytes() + floats.tobytes()


def describe(hd):
    shape = f"L={hd['L']} C={hd['C']} NH={hd['NH']}"
    if hd["arch"] == "gpt2":
        return f"{shape} V={hd['V']} (Vp {hd['Vp']}) maxT={hd['maxT']}"
    rope_scaling = f" (scaled by {hd['rope_scaling']:g})" if hd["rope_scaling"] else ""
    tied = ", tied to wte" if hd["tied"] else ""
    return (f"Llama 3 {shape} KV={hd['KV']} H={hd['H']} V={hd['V']} maxT={hd['maxT']} eps={hd['norm_eps']:g} "
            f"theta={hd['rope_theta']:g}{rope_scaling}{tied}")


def model_and_tensors(hd, where):
    """A PyTorch model of hd's shape (PyTorch's default weights) and its tensors in file order."""
    if hd["arch"] == "llama3":
        model = Llama(hd)
        return model, llama_tensors(model)
    if padded_vocab(hd["V"]) != hd["Vp"]:
        sys.exit(f"pytorch_check: {where}: padded vocab {hd['Vp']}, the PyTorch model pads {hd['V']} to "
                 f"{padded_vocab(hd['V'])}")
    model = GPT(hd["L"], hd["C"], hd["NH"], hd["V"], hd["maxT"])
    return model, gpt2_tensors(model)


def read_values(path, hd):
    """Every value after the header, as fp32 (a bf16 value is the upper half of an fp32)."""
    raw = np.fromfile(path, dtype=MODEL_VERSIONS[hd["version"]], offset=hd["header_bytes"])
    if hd["version"] == 5:
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return raw


def load_model(path):
    """The file's model with its weights (fp32), GPT-2 or Llama 3, and the file's header."""
    hd = read_header(path)
    model, tensors = model_and_tensors(hd, path)
    values = read_values(path, hd)
    offset = 0
    with torch.no_grad():
        for name, parts in tensors:
            for p in parts:
                n = p.numel()
                if offset + n > values.size:
                    sys.exit(f"pytorch_check: {path}: ends inside tensor {name}")
                p.copy_(torch.from_numpy(values[offset: offset + n].copy()).view_as(p))
                offset += n
            # as train_gpt does: a Llama has nowhere to hold a bias, so a file with one is another model
            if hd["arch"] == "llama3" and name in LLAMA_BIAS_SLOTS and any(bool(p.any()) for p in parts):
                sys.exit(f"pytorch_check: {path}: tensor {name} is not zero, and a Llama has no biases")
    if offset != values.size:
        sys.exit(f"pytorch_check: {path}: {values.size - offset} values after the last tensor")
    return model, hd


def save_model(hd, tensors, path):
    with open(path, "wb") as f:
        f.write(header_bytes(hd))
        for _, parts in tensors:
            for p in parts:
                f.write(p.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes())


def reference_init(tensors, L, gen, absent=()):
    """test/reference's scheme (see the module docstring); the slots named in `absent` (a Llama's biases) keep
    their zeros."""
    resid_std = 0.02 / (2 * L) ** 0.5
    with torch.no_grad():
        for name, parts in tensors:
            if name in absent:
                continue
            for p in parts:
                if name.startswith("ln") and name.endswith("w"):
                    mean, std = 1.0, 0.1
                elif name.startswith("ln"):
                    mean, std = 0.0, 0.1
                else:
                    mean, std = 0.0, resid_std if name in ("attprojw", "fcprojw") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std + mean)


# ------------------------------------------------------------------------------------------------------------

LLAMA_OPTIONS = ("kv_heads", "hidden", "rope_theta", "norm_eps", "rope_scaling", "tied")


def init_header(args):
    """The header the init command's arguments describe."""
    hd = dict(arch=args.arch, maxT=args.max_seq_len, V=args.vocab, L=args.layers, NH=args.heads, C=args.channels)
    if args.arch == "gpt2":
        given = [n for n in LLAMA_OPTIONS if getattr(args, n) not in (None, False)]
        if given:
            sys.exit(f"pytorch_check: --{given[0].replace('_', '-')} describes a Llama (--arch llama3)")
        if args.channels % args.heads:
            sys.exit(f"pytorch_check: --heads {args.heads} must divide --channels {args.channels}")
        hd["Vp"] = padded_vocab(args.vocab)
        return hd
    # without --hidden, Meta's rule with multiple_of 256 and no multiplier, as train_gpt's descriptors
    multiple_of, multiplier = (args.hidden, exact_multiplier(args.channels, args.hidden)) if args.hidden else (256, 0.0)
    hd.update(KV=args.kv_heads or args.heads, multiple_of=multiple_of, ffn_dim_multiplier=multiplier,
              norm_eps=args.norm_eps or 1e-5, rope_theta=args.rope_theta or 500000.0,
              rope_scaling=args.rope_scaling or 0.0, tied=args.tied,
              H=llama_hidden(args.channels, multiple_of, multiplier))
    if args.hidden and hd["H"] != args.hidden:
        sys.exit(f"pytorch_check: no multiplier gives --hidden {args.hidden} by Meta's rule for C={args.channels}")
    check_llama_shape(hd, "init")
    return hd


def cmd_init(args):
    for n in ("layers", "channels", "heads", "vocab", "max_seq_len"):
        if getattr(args, n) <= 0:
            sys.exit(f"pytorch_check: --{n.replace('_', '-')} must be positive")
    hd = init_header(args)
    model, tensors = model_and_tensors(hd, "init")
    gen = torch.Generator().manual_seed(args.seed)
    if hd["arch"] == "gpt2":
        reference_init(tensors, args.layers, gen)
        with torch.no_grad():
            model.wte.weight[args.vocab:].zero_()  # the padding rows, as llm.c's
    else:
        reference_init(tensors, args.layers, gen, absent=LLAMA_BIAS_SLOTS)
    save_model(hd, tensors, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"pytorch_check: wrote {args.out}: {describe(hd)}, {n} parameters")


def read_main_log(path):
    """step -> training loss from a train_gpt main.log."""
    losses = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"s:(\d+) trl:(\S+)", line)
            if m:
                losses[int(m.group(1))] = float(m.group(2))
    return losses


def cmd_train(args):
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("pytorch_check: no CUDA device visible (--device cpu runs the fp32 check on the CPU)")
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    device = torch.device(args.device)
    B, T = args.batch, args.seq_len
    torch.manual_seed(0)  # nothing here is random after loading; fixed anyway, so reruns print the same bits
    model, hd = load_model(args.model)
    if T > hd["maxT"]:
        sys.exit(f"pytorch_check: --seq-len {T} exceeds the model's maximum sequence length {hd['maxT']}")
    model.to(device)
    tokens = load_tokens(args.data)
    if int(tokens.max()) >= hd["V"]:
        sys.exit(f"pytorch_check: {args.data}: token {int(tokens.max())} outside the model's vocabulary {hd['V']}")
    samples = (tokens.numel() - 1) // (B * T)  # train_gpt's global batches per shard (one rank, --shuffle 0)
    if samples < 1:
        sys.exit(f"pytorch_check: {args.data}: {tokens.numel()} tokens, a batch needs {B * T + 1}")
    tokens = tokens.to(device)
    optimizer, fused = make_optimizer(model, args.lr, args.weight_decay, device)
    print(f"pytorch {torch.__version__} on {args.device}, {precision}; model {args.model}: {describe(hd)}; "
          f"B={B} T={T}, {args.steps} steps, lr {args.lr} constant, weight decay {args.weight_decay}, "
          f"AdamW{' (fused)' if fused else ''}, clip 1.0")
    if args.device == "cuda":
        # bf16 autocast keeps its matmuls in bf16; tf32 would only touch fp32 leftovers, so keep those exact
        torch.backends.cuda.matmul.allow_tf32 = False

    losses = []
    for step in range(args.steps):
        start = (step % samples) * B * T
        chunk = tokens[start: start + B * T + 1]
        x, y = chunk[:-1].view(B, T), chunk[1:].view(B, T)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss))
        print(f"step {step}: loss {losses[-1]:.6f} norm {float(norm):.6f}")
        sys.stdout.flush()

    if not args.compare:
        return 0
    ours = read_main_log(args.compare)
    missing = [s for s in range(args.steps) if s not in ours]
    if missing:
        print(f"pytorch_check: {args.compare} has no training loss for steps {missing}")
        print(f"pytorch_check: FAIL: steps missing from {args.compare}")
        return 1
    print(f"{'step':>4} {'train_gpt':>12} {'pytorch':>12} {'difference':>12}")
    worst = 0.0
    for s in range(args.steps):
        diff = abs(ours[s] - losses[s])
        worst = max(worst, diff) if diff == diff else float("inf")  # NaN never passes
        print(f"{s:4d} {ours[s]:12.6f} {losses[s]:12.6f} {diff:12.3e}")
    verdict = "PASS" if worst <= args.tol else "FAIL"
    print(f"pytorch_check: max |loss difference| {worst:.3e} over {args.steps} steps "
          f"(tolerance {args.tol:g}): {verdict}")
    return 0 if verdict == "PASS" else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init", help="write a model file in test/reference's initialization")
    init.add_argument("--out", required=True)
    init.add_argument("--arch", choices=["gpt2", "llama3"], default="gpt2",
                      help="llm.c's GPT-2 file, or its Llama 3 file (the options below)")
    init.add_argument("--layers", type=int, required=True)
    init.add_argument("--channels", type=int, required=True)
    init.add_argument("--heads", type=int, required=True)
    init.add_argument("--vocab", type=int, default=50257)
    init.add_argument("--max-seq-len", type=int, default=1024)
    init.add_argument("--seed", type=int, default=1234)
    init.add_argument("--kv-heads", type=int, help="llama3: key/value heads (default --heads)")
    init.add_argument("--hidden", type=int,
                      help="llama3: the MLP's hidden size exactly (default Meta's rule with multiple_of 256)")
    init.add_argument("--rope-theta", type=float, help="llama3: RoPE's theta (default 500000)")
    init.add_argument("--rope-scaling", type=float,
                      help="llama3: Llama 3's RoPE frequency scaling factor (3.1: 8, 3.2: 32; default none)")
    init.add_argument("--tied", action="store_true", help="llama3: the classifier tied to wte (Llama 3.2 1B, 3B)")
    init.add_argument("--norm-eps", type=float, help="llama3: RMSNorm's eps (default 1e-5)")

    train = sub.add_parser("train", help="train a model file in PyTorch, compare with a train_gpt main.log")
    train.add_argument("--model", required=True,
                       help="llm.c model file, GPT-2 or Llama 3 (fp32 version 3 or bf16 version 5)")
    train.add_argument("--data", default="data/sotu/train.bin", help="llm.c token shard (train_gpt's -i)")
    train.add_argument("--batch", type=int, required=True, help="B (train_gpt's -b)")
    train.add_argument("--seq-len", type=int, required=True, help="T (train_gpt's -t)")
    train.add_argument("--steps", type=int, default=10)
    train.add_argument("--lr", type=float, default=3e-4, help="constant learning rate (train_gpt's -l, -k constant)")
    train.add_argument("--weight-decay", type=float, default=0.1, help="train_gpt's -c")
    train.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    train.add_argument("--precision", choices=["bf16", "fp32"], help="default: bf16 autocast on cuda, fp32 on cpu")
    train.add_argument("--compare", metavar="MAIN_LOG", help="train_gpt's main.log of the same run")
    train.add_argument("--tol", type=float, default=0.05, help="largest absolute loss difference accepted")
    args = ap.parse_args()
    if args.command == "init":
        return cmd_init(args)
    if min(args.batch, args.seq_len, args.steps) <= 0:
        sys.exit("pytorch_check: --batch, --seq-len and --steps must be positive")
    return cmd_train(args)


if __name__ == "__main__":
    sys.exit(main())
