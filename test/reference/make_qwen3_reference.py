#!/usr/bin/python3
"""Generate a small Qwen3 reference (an llm5d Qwen3 model file, a debug state and HF directories) for llm5d's tests.

Run with Debian's interpreter, which ships torch and numpy:

    /usr/bin/python3 test/reference/make_qwen3_reference.py --out DIR --kv KV [--tied]

An independent Qwen3 written here from Hugging Face's modeling_qwen3 (Qwen3ForCausalLM, dense): RMSNorm
x·rsqrt(mean(x²) + 1e-6)·w, q/k/v/o projections without biases, NH query heads and KV key/value heads of a head
size HD that is not C/NH, an RMSNorm over each head's HD queries and keys (q_norm, k_norm: one HD-weight shared by
the heads) before RoPE, RoPE θ 1e6 in HF's rotate-half convention (channels i and i + HD/2 turn together), causal
grouped-query softmax attention, the SwiGLU MLP down(silu(gate(x))·up(x)) of intermediate size H, a final norm and
an lm_head of its own or the token embedding's transpose (--tied); computed in float64 from float32 weights.

llm5d's RoPE turns interleaved pairs (2i, 2i+1) of a head, as Meta's Llama does, so llm5d's files hold every q and
k head's rows, and the q_norm and k_norm weights, reordered: llm5d's row r is HF's row hf_rotated_row(r) (r/2 for
an even r, HD/2 + r/2 for an odd one). A norm over a head does not care about the order of its channels, so the
reordered model is the same function; the script asserts it (the interleaved forward's logits equal HF's to 1e-12).

Writes:
- DIR/model.bin: llm.c's Llama 3 file (make_llama_reference.py's layout) with llm5d's Qwen3 fields: int header
  [15] 1 (Qwen3), [16] HD, [17] H, [14] tied; GPT-2's tensor slots with zero biases, lm_head in wpe's slot (wte
  again when tied), qkvw's rows q then k then v ((NH + 2·KV)·HD of them), attprojw C × NH·HD, fcw up's rows then
  gate's (2H), and after lnfb two tensors of its own: qnormw (L × HD) and knormw (L × HD).
- DIR/state.bin: the Llama reference's state format: the first micro-batch's inputs, targets, logits, loss, every
  gradient in llm5d's flat order (model.bin's tensors less the bias slots and, when tied, lm_head; wte and lm_head
  padded to VP rows; qnormw, knormw last), then the losses of 10 AdamW steps (2-D weights decayed, norms not).
- DIR/hf/: config.json as the Hub's Qwen3 checkpoints write it (rope_theta at the top level) and model.safetensors
  (F32, HF's names and row order); DIR/hf5/: the same model with config.json as transformers 5 writes it
  (rope_theta inside rope_parameters) and a copy of the same model.safetensors.
"""

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F

from make_hf_reference import write_safetensors
from make_llama_reference import (B, LLAMA_MAGIC, MAXT, MICRO, SEED, T, V, VP, float32_normal, rope,
                                  run_reference, write_model_file, write_state)

# odd sizes, so that indexing bugs show up: a head size of its own (NH·HD = 64, not C = 48), an H not 8/3·C
L = 2
C = 48
NH = 4
HD = 16
H = 88
NORM_EPS = 1e-6
THETA = 1e6

# llm5d's row r of a q or k head (and of q_norm's and k_norm's weights) is HF's row HF_ROW[r]
HF_ROW = [r // 2 if r % 2 == 0 else HD // 2 + r // 2 for r in range(HD)]


def rmsnorm(x, w):
    """Qwen3RMSNorm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w


def inverse_frequencies():
    """HF's default RoPE: 1/θ^(2i/HD) for i < HD/2 (the same frequencies Meta's pairs (2i, 2i+1) turn by)."""
    return [1.0 / THETA ** (2 * i / HD) for i in range(HD // 2)]


def rope_rotate_half(x, freqs):
    """HF's RoPE on (nb, nt, heads, HD): channels i and i + HD/2 turn together by position · freqs[i]."""
    nt = x.shape[1]
    angle = torch.tensor([[p * f for f in freqs] for p in range(nt)], dtype=torch.float64)
    emb = torch.cat([angle, angle], dim=-1)[None, :, None, :]
    half = HD // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cos(emb) + rotated * torch.sin(emb)


def to_llm5d_rows(w, heads):
    """A q or k projection's rows (heads·HD, C), or a norm weight (HD,), in llm5d's per-head order."""
    index = torch.tensor([h * HD + HF_ROW[r] for h in range(heads) for r in range(HD)])
    return w[index]


def logits_of(p, kv, tied, idx, interleaved):
    """The forward pass over weights p in HF's order (interleaved False: rotate-half RoPE) or in llm5d's
    (interleaved True: each head's rows reordered by to_llm5d_rows, RoPE on the pairs (2i, 2i+1))."""
    freqs = inverse_frequencies()
    turn = rope if interleaved else rope_rotate_half
    nb, nt = idx.shape
    x = p["wte"][idx]
    for l in range(L):
        h = rmsnorm(x, p[f"ln1.{l}"])
        q = (h @ p[f"q.{l}"].t()).view(nb, nt, NH, HD)
        k = (h @ p[f"k.{l}"].t()).view(nb, nt, kv, HD)
        v = (h @ p[f"v.{l}"].t()).view(nb, nt, kv, HD)
        # QK-norm: each head's HD channels, before RoPE
        q = turn(rmsnorm(q, p[f"qnorm.{l}"]), freqs)
        k = turn(rmsnorm(k, p[f"knorm.{l}"]), freqs)
        group = NH // kv  # query head j reads key/value head j // group
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
        scores = scores.masked_fill(~torch.ones(nt, nt, dtype=torch.bool).tril(), float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(nb, nt, NH * HD)
        x = x + y @ p[f"o.{l}"].t()
        h = rmsnorm(x, p[f"ln2.{l}"])
        x = x + (F.silu(h @ p[f"gate.{l}"].t()) * (h @ p[f"up.{l}"].t())) @ p[f"down.{l}"].t()
    return rmsnorm(x, p["lnf"]) @ p["wte" if tied else "lm_head"].t()


class Qwen3:
    """The parameters in HF's order as a dict of float64 leaf tensors, the forward pass, and llm5d's views."""

    def __init__(self, kv, tied, gen):
        self.kv, self.tied = kv, tied

        normal = lambda *shape, std: float32_normal(gen, *shape, std=std)
        resid = 0.02 / math.sqrt(2 * L)  # the projections into the residual stream, as GPT-2 scales them
        p = {name: normal(V, C, std=0.02) for name in (["wte"] if tied else ["wte", "lm_head"])}
        for l in range(L):
            # norm gains away from 1 so that a norm that ignored its weight would show; QK-norm's further still,
            # so that a q_norm and k_norm swapped or left unpermuted would show too
            p[f"ln1.{l}"] = 1.0 + normal(C, std=0.1)
            p[f"q.{l}"] = normal(NH * HD, C, std=0.02)
            p[f"k.{l}"] = normal(kv * HD, C, std=0.02)
            p[f"v.{l}"] = normal(kv * HD, C, std=0.02)
            p[f"o.{l}"] = normal(C, NH * HD, std=resid)
            p[f"qnorm.{l}"] = 1.0 + normal(HD, std=0.3)
            p[f"knorm.{l}"] = 1.0 + normal(HD, std=0.3)
            p[f"ln2.{l}"] = 1.0 + normal(C, std=0.1)
            p[f"gate.{l}"] = normal(H, C, std=0.02)
            p[f"up.{l}"] = normal(H, C, std=0.02)
            p[f"down.{l}"] = normal(C, H, std=resid)
        p["lnf"] = 1.0 + normal(C, std=0.1)
        for t in p.values():
            t.requires_grad_(True)
        self.p = p

    def forward(self, idx, targets):
        """(logits, cross-entropy, 0: no auxiliary loss), as make_llama_reference.run_reference takes them."""
        logits = logits_of(self.p, self.kv, self.tied, idx, interleaved=False)
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1)), 0.0

    def llm5d(self, get):
        """{name: get(tensor)} with q's and k's rows and q_norm's and k_norm's weights in llm5d's order (a
        reordering of a parameter reorders its gradient the same way)."""
        out = {name: get(t) for name, t in self.p.items()}
        for l in range(L):
            for name, heads in (("q", NH), ("k", self.kv), ("qnorm", 1), ("knorm", 1)):
                out[f"{name}.{l}"] = to_llm5d_rows(out[f"{name}.{l}"], heads)
        return out

    def flat(self, grads=False):
        """llm5d's flat order: wte, lm_head (untied), each padded to VP rows with zeros, ln1w, qkvw (q, k, v rows),
        attprojw, ln2w, fcw (up's rows then gate's), fcprojw, lnfw, qnormw, knormw."""
        p = self.llm5d((lambda t: t.grad) if grads else (lambda t: t.detach()))
        per_layer = lambda name: [p[f"{name}.{l}"] for l in range(L)]
        padded = lambda t: torch.cat([t, torch.zeros(VP - V, C, dtype=t.dtype)])
        qkv = [torch.cat([p[f"q.{l}"], p[f"k.{l}"], p[f"v.{l}"]]) for l in range(L)]
        fc = [torch.cat([p[f"up.{l}"], p[f"gate.{l}"]]) for l in range(L)]
        parts = [padded(p["wte"])] + ([] if self.tied else [padded(p["lm_head"])]) + per_layer("ln1") + qkv + \
            per_layer("o") + per_layer("ln2") + fc + per_layer("down") + [p["lnf"]] + \
            per_layer("qnorm") + per_layer("knorm")
        return np.concatenate([t.numpy().astype("<f4").ravel() for t in parts])

    def file_tensors(self):
        """llm5d's Qwen3 file: the Llama file's slots (every bias slot present, zero; lm_head, or wte when tied,
        in wpe's slot), then qnormw and knormw."""
        p = self.llm5d(lambda t: t.detach())
        per_layer = lambda name: [p[f"{name}.{l}"] for l in range(L)]
        zeros = lambda n: [torch.zeros(n, dtype=torch.float64) for _ in range(L)]
        qkv = [torch.cat([p[f"q.{l}"], p[f"k.{l}"], p[f"v.{l}"]]) for l in range(L)]
        fc = [torch.cat([p[f"up.{l}"], p[f"gate.{l}"]]) for l in range(L)]
        out = [p["wte"], p["wte" if self.tied else "lm_head"]]
        out += per_layer("ln1") + zeros(C) + qkv + zeros((NH + 2 * self.kv) * HD) + per_layer("o") + zeros(C)
        out += per_layer("ln2") + zeros(C) + fc + zeros(2 * H) + per_layer("down") + zeros(C)
        out += [p["lnf"], torch.zeros(C, dtype=torch.float64)] + per_layer("qnorm") + per_layer("knorm")
        return np.concatenate([t.numpy().astype("<f4").ravel() for t in out])

    def hf_tensors(self):
        """{HF name: float32 array} in HF's row order."""
        t = lambda name: self.p[name].detach().numpy().astype("<f4")
        out = {"model.embed_tokens.weight": t("wte")}
        for l in range(L):
            a, m = f"model.layers.{l}.self_attn.", f"model.layers.{l}.mlp."
            out[f"model.layers.{l}.input_layernorm.weight"] = t(f"ln1.{l}")
            for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
                out[a + theirs + ".weight"] = t(f"{ours}.{l}")
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = t(f"qnorm.{l}"), t(f"knorm.{l}")
            out[f"model.layers.{l}.post_attention_layernorm.weight"] = t(f"ln2.{l}")
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                out[m + theirs + ".weight"] = t(f"{ours}.{l}")
        out["model.norm.weight"] = t("lnf")
        if not self.tied:
            out["lm_head.weight"] = t("lm_head")
        return out

    def hf_config(self, transformers5):
        """config.json as the Hub's Qwen3 checkpoints write it, or (transformers5) as transformers 5 does."""
        cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": C,
               "intermediate_size": H, "num_hidden_layers": L, "num_attention_heads": NH,
               "num_key_value_heads": self.kv, "head_dim": HD, "rms_norm_eps": NORM_EPS,
               "max_position_embeddings": MAXT, "vocab_size": V, "tie_word_embeddings": self.tied,
               "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
               "use_sliding_window": False, "sliding_window": None, "max_window_layers": L,
               "torch_dtype": "float32"}
        if transformers5:
            cfg["rope_parameters"] = {"rope_theta": THETA, "rope_type": "default"}
        else:
            cfg["rope_theta"], cfg["rope_scaling"] = THETA, None
        return cfg


def write_hf(directory, model, transformers5, weights):
    """config.json and model.safetensors (a copy of `weights` when given, else written)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.hf_config(transformers5), f, indent=2)
    path = os.path.join(directory, "model.safetensors")
    if weights:
        shutil.copyfile(weights, path)
    else:
        write_safetensors(path, model.hf_tensors(), "F32")
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv", type=int, required=True, help="key/value heads (divides %d)" % NH)
    ap.add_argument("--tied", action="store_true", help="the classifier is the token embedding (Qwen3 0.6B-4B)")
    args = ap.parse_args()
    assert NH % args.kv == 0 and NH * HD != C

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(SEED + 100 + args.kv)
    model = Qwen3(args.kv, args.tied, gen)
    x = torch.randint(0, V, (MICRO * B, T), generator=gen, dtype=torch.long)
    y = torch.randint(0, V, (MICRO * B, T), generator=gen, dtype=torch.long)

    # llm5d's reordered weights through the interleaved RoPE are the same model as HF's
    with torch.no_grad():
        ours = logits_of(model.llm5d(lambda t: t.detach()), args.kv, args.tied, x[:B], interleaved=True)
        theirs = logits_of(model.p, args.kv, args.tied, x[:B], interleaved=False)
    reorder_err = float((ours - theirs).abs().max())
    assert reorder_err <= 1e-12, f"llm5d's row order changes the logits by {reorder_err:.3g}"

    os.makedirs(args.out, exist_ok=True)
    write_model_file(os.path.join(args.out, "model.bin"),
                     # Llama's multiple_of and version slots are 0: Qwen3's H is given, and it has no Llama version
                     [LLAMA_MAGIC, 3, MAXT, V, L, NH, args.kv, C, 0, 0, 0, 0, 0, 0, int(args.tied), 1, HD, H],
                     [0.0, NORM_EPS, THETA, 0.0], model.file_tensors())
    weights = write_hf(os.path.join(args.out, "hf"), model, False, None)
    write_hf(os.path.join(args.out, "hf5"), model, True, weights)

    init_logits, init_loss, _, init_grads, losses = run_reference(model, x, y)
    write_state(os.path.join(args.out, "state.bin"), x, y, init_logits, init_loss, init_grads, losses)
    print(f"Qwen3 L={L} C={C} NH={NH} KV={args.kv} HD={HD} H={H} V={V} tied={args.tied}: "
          f"{init_grads.size} parameters, row order check {reorder_err:.3g}, initial loss {init_loss:.6f} "
          f"(ln V = {math.log(V):.6f}), losses {losses[0]:.6f} -> {losses[-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
