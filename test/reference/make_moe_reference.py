#!/usr/bin/python3
"""Generate a small Hugging Face mixture-of-experts reference (Qwen3-MoE, Qwen2-MoE or Mixtral) for llm5d's tests.

Run with Debian's interpreter, which ships torch and numpy:

    /usr/bin/python3 test/reference/make_moe_reference.py --out DIR --arch qwen3_moe|qwen2_moe|mixtral
        [--unnormalized] [--layers L --dense-layers N --sparse-step S] [--aux-batch]

An independent model written here from Hugging Face's modeling_qwen3_moe (Qwen3MoeForCausalLM),
modeling_qwen2_moe (Qwen2MoeForCausalLM) and modeling_mixtral (MixtralForCausalLM), its parameters kept under
HF's own tensor names, computed in float64 from float32 weights. Attention is Qwen3's (QK-norm before
rotate-half RoPE, heads of HD channels that need not make C), Qwen2's (q, k and v with biases, HD = C/NH) or
Llama's (Mixtral: neither, HD = C/NH); a layer's MLP is a sparse block (Qwen-MoE: unless the layer is in
mlp_only_layers, the first N here, or off decoder_sparse_step, (l + 1) % S != 0; those are the dense MLP of
intermediate_size hidden units): router logits = x·gateᵀ,
routing weights = softmax over all E experts, the top K of them, divided by their sum when norm_topk_prob
(Mixtral always; Qwen-MoE as its config says: --unnormalized keeps them as they are), each chosen expert
down(silu(gate(x))·up(x)) of moe_intermediate_size hidden units (Mixtral: w2(silu(w1(x))·w3(x)) of
intermediate_size), weighted and summed; Qwen2-MoE adds sigmoid(x·shared_expert_gateᵀ) times its shared expert,
an MLP of shared_expert_intermediate_size hidden units over every token.

The objective is llm5d's: the mean cross-entropy plus ALPHA times its load-balancing loss, E·Σ_i f_i·P_i per
sequence and layer (f_i the share of the sequence's K·T assignments that went to expert i, a constant; P_i the
mean over its tokens of the softmax over all E), averaged over the sequences and summed over the sparse layers. (HF adds
no auxiliary loss unless output_router_logits is set, and then a different one; the trainer's is --moe-aux.)
With --aux-batch it is llm5d's --moe-aux-scope batch (Megatron-LM's global aux loss) instead: per layer and
micro-batch E·Σ_i f_i·P_i, f_i the share of the assignments over the step's micro-batches so far, P_i the mean over
the micro-batch's tokens; the objective's mean over the micro-batches is run_reference's.

Writes:
- DIR/hf/: config.json as the Hub's checkpoints write it and model.safetensors (F32, HF's names and row order,
  the experts one tensor each as on the Hub).
- DIR/state.bin: make_llama_reference.py's state format (ALPHA and the first micro-batch's aux loss in header
  [10] and [11]): the inputs and targets of every micro-batch, the first one's logits, loss and every gradient in
  llm5d's flat order (wte and lm_head padded to VP rows; each q and k head's rows, and QK-norm's weights, in
  llm5d's order for RoPE on interleaved pairs, q, k and v's biases so too; routerw, then fcw stacking each expert's
  up rows then gate rows, fcprojw, of the sparse layers; qnormw and knormw; the dense layers' dense_fcw, up rows
  then gate rows, and dense_fcprojw; last the sparse layers' shared_fcw, shared_fcprojw and shared_gatew), then
  the losses of 10 AdamW steps of MICRO micro-batches.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

from make_hf_reference import write_safetensors
from make_llama_reference import B, MAXT, MICRO, SEED, T, V, VP, f32_bits, float32_normal, run_reference, write_state

# odd sizes, so that indexing bugs show up: Qwen3-MoE's heads of 16 in 48 channels, an expert width that is
# neither the dense MLP's nor a power of two, 4 experts of which 2 per token
L = 2
C = 48
NH = 4
KV = 2
E = 4
K = 2
H_EXPERT = 40  # moe_intermediate_size (Mixtral: intermediate_size)
H_DENSE = 88   # Qwen-MoE's intermediate_size, for its dense layers
H_SHARED = 56  # Qwen2-MoE's shared_expert_intermediate_size
ALPHA = 0.05
ARCHS = {
    # HD, norm eps, RoPE theta, QK-norm, q/k/v biases and a gated shared expert, the MLP block's name and the names
    # of its experts' gate, up and down
    "qwen3_moe": dict(hd=16, eps=1e-6, theta=1e6, qk_norm=True, qwen2=False, block="mlp",
                      names=("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": dict(hd=C // NH, eps=1e-6, theta=1e6, qk_norm=False, qwen2=True, block="mlp",
                      names=("gate_proj", "up_proj", "down_proj")),
    "mixtral": dict(hd=C // NH, eps=1e-5, theta=1e6, qk_norm=False, qwen2=False, block="block_sparse_moe",
                    names=("w1", "w3", "w2")),
}


class MoEModel:
    """The parameters as {HF name: float64 leaf tensor}, the forward pass in HF's conventions, llm5d's order."""

    def __init__(self, arch, normalize, gen, layers=L, dense_layers=0, sparse_step=1, aux_batch=False):
        self.arch, self.normalize, self.aux_batch = arch, normalize, aux_batch
        self.start_step()
        self.L, self.mlp_only_layers, self.sparse_step = layers, list(range(dense_layers)), sparse_step
        # HF's Qwen3MoeDecoderLayer: which layers hold a sparse block
        self.sparse = [l not in self.mlp_only_layers and (l + 1) % sparse_step == 0 for l in range(layers)]
        a = ARCHS[arch]
        self.hd, self.eps, self.theta, self.qk_norm, self.qwen2 = a["hd"], a["eps"], a["theta"], a["qk_norm"], a["qwen2"]
        self.block, (self.gate_name, self.up_name, self.down_name) = a["block"], a["names"]
        hd = self.hd
        normal = lambda *shape, std: float32_normal(gen, *shape, std=std)
        resid = 0.02 / math.sqrt(2 * self.L)
        p = {"model.embed_tokens.weight": normal(V, C, std=0.02)}
        for l in range(self.L):
            at, mlp = f"model.layers.{l}.self_attn.", f"model.layers.{l}.{self.block}."
            # norm gains away from 1, so that a norm that ignored its weight would show
            p[f"model.layers.{l}.input_layernorm.weight"] = 1.0 + normal(C, std=0.1)
            p[at + "q_proj.weight"] = normal(NH * hd, C, std=0.02)
            p[at + "k_proj.weight"] = normal(KV * hd, C, std=0.02)
            p[at + "v_proj.weight"] = normal(KV * hd, C, std=0.02)
            if self.qwen2:  # biases away from 0, so that a model that dropped them would show
                p[at + "q_proj.bias"] = normal(NH * hd, std=0.1)
                p[at + "k_proj.bias"] = normal(KV * hd, std=0.1)
                p[at + "v_proj.bias"] = normal(KV * hd, std=0.1)
            p[at + "o_proj.weight"] = normal(C, NH * hd, std=resid)
            if self.qk_norm:
                p[at + "q_norm.weight"] = 1.0 + normal(hd, std=0.3)
                p[at + "k_norm.weight"] = 1.0 + normal(hd, std=0.3)
            p[f"model.layers.{l}.post_attention_layernorm.weight"] = 1.0 + normal(C, std=0.1)
            if not self.sparse[l]:  # Qwen3MoeMLP of intermediate_size
                p[mlp + "gate_proj.weight"] = normal(H_DENSE, C, std=0.02)
                p[mlp + "up_proj.weight"] = normal(H_DENSE, C, std=0.02)
                p[mlp + "down_proj.weight"] = normal(C, H_DENSE, std=resid)
                continue
            # a router of larger weights than initialization's, so that the routing is decided, not near-even
            p[mlp + "gate.weight"] = normal(E, C, std=0.3)
            for e in range(E):
                p[mlp + f"experts.{e}.{self.gate_name}.weight"] = normal(H_EXPERT, C, std=0.02)
                p[mlp + f"experts.{e}.{self.up_name}.weight"] = normal(H_EXPERT, C, std=0.02)
                p[mlp + f"experts.{e}.{self.down_name}.weight"] = normal(C, H_EXPERT, std=resid)
            if self.qwen2:  # the shared expert, and its gate large enough to matter
                p[mlp + "shared_expert.gate_proj.weight"] = normal(H_SHARED, C, std=0.02)
                p[mlp + "shared_expert.up_proj.weight"] = normal(H_SHARED, C, std=0.02)
                p[mlp + "shared_expert.down_proj.weight"] = normal(C, H_SHARED, std=resid)
                p[mlp + "shared_expert_gate.weight"] = normal(1, C, std=0.3)
        p["model.norm.weight"] = 1.0 + normal(C, std=0.1)
        p["lm_head.weight"] = normal(V, C, std=0.02)
        for t in p.values():
            t.requires_grad_(True)
        self.p = p

    def rmsnorm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x):
        """HF's rotate-half RoPE on (nb, nt, heads, hd): channels i and i + hd/2 turn together."""
        hd, nt = self.hd, x.shape[1]
        freqs = [1.0 / self.theta ** (2 * i / hd) for i in range(hd // 2)]
        angle = torch.tensor([[p * f for f in freqs] for p in range(nt)], dtype=torch.float64)
        emb = torch.cat([angle, angle], dim=-1)[None, :, None, :]
        rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1)
        return x * torch.cos(emb) + rotated * torch.sin(emb)

    def attention(self, x, l):
        p, hd, at = self.p, self.hd, f"model.layers.{l}.self_attn."
        nb, nt, _ = x.shape
        proj = lambda name: x @ p[at + name + ".weight"].t() + (p[at + name + ".bias"] if self.qwen2 else 0)
        q = proj("q_proj").view(nb, nt, NH, hd)
        k = proj("k_proj").view(nb, nt, KV, hd)
        v = proj("v_proj").view(nb, nt, KV, hd)
        if self.qk_norm:
            q, k = self.rmsnorm(q, p[at + "q_norm.weight"]), self.rmsnorm(k, p[at + "k_norm.weight"])
        q, k = self.rope(q), self.rope(k)
        k, v = k.repeat_interleave(NH // KV, dim=2), v.repeat_interleave(NH // KV, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        scores = scores.masked_fill(~torch.ones(nt, nt, dtype=torch.bool).tril(), float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(nb, nt, NH * hd)
        return y @ p[at + "o_proj.weight"].t()

    def sparse_block(self, x, l):
        """HF's sparse MoE block, token by token; returns (output, llm5d's load-balancing loss of the layer)."""
        p, mlp = self.p, f"model.layers.{l}.{self.block}."
        nb, nt, _ = x.shape
        flat = x.reshape(nb * nt, C)
        router_logits = flat @ p[mlp + "gate.weight"].t()
        probs = F.softmax(router_logits, dim=-1)
        weights, chosen = torch.topk(probs, K, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(E):
            token, slot = torch.where(chosen == e)
            if len(token) == 0:
                continue
            w = lambda name: p[mlp + f"experts.{e}.{name}.weight"]
            h = flat[token]
            y = (F.silu(h @ w(self.gate_name).t()) * (h @ w(self.up_name).t())) @ w(self.down_name).t()
            out = out.index_add(0, token, y * weights[token, slot, None])
        if self.qwen2:  # Qwen2MoeSparseMoeBlock: the shared expert, scaled by its gate, added to the experts' sum
            gate = torch.sigmoid(flat @ p[mlp + "shared_expert_gate.weight"].t())
            out = out + gate * self.mlp(flat, mlp + "shared_expert.")
        counts = F.one_hot(chosen.view(nb, nt * K), E).sum(dim=1).to(x.dtype)    # (nb, E)
        if self.aux_batch:  # f over the step's micro-batches so far, P over this one's tokens
            self.so_far[l] = self.so_far.get(l, 0.0) + counts.sum(dim=0)
            f = (self.so_far[l] / self.so_far[l].sum()).detach()
            return out.view(nb, nt, C), ALPHA * E * (f * probs.mean(dim=0)).sum()
        f = (counts / (nt * K)).detach()
        prob = probs.view(nb, nt, E).mean(dim=1)
        return out.view(nb, nt, C), (ALPHA * E * (f * prob).sum(dim=-1)).mean()

    def start_step(self):
        """A new optimizer step: the batch scope's counts start again."""
        self.so_far = {}

    def mlp(self, x, prefix):
        """Qwen-MoE's MLP (a dense layer's, or the shared expert): down(silu(gate(x))·up(x))."""
        w = lambda name: self.p[f"{prefix}{name}.weight"]
        return (F.silu(x @ w("gate_proj").t()) * (x @ w("up_proj").t())) @ w("down_proj").t()

    def dense_mlp(self, x, l):
        return self.mlp(x, f"model.layers.{l}.mlp.")

    def forward(self, idx, targets):
        """(logits, cross-entropy, the load-balancing loss summed over the layers), as run_reference takes them."""
        p, x, aux = self.p, self.p["model.embed_tokens.weight"][idx], 0.0
        for l in range(self.L):
            x = x + self.attention(self.rmsnorm(x, p[f"model.layers.{l}.input_layernorm.weight"]), l)
            h = self.rmsnorm(x, p[f"model.layers.{l}.post_attention_layernorm.weight"])
            y, layer_aux = self.sparse_block(h, l) if self.sparse[l] else (self.dense_mlp(h, l), 0.0)
            x, aux = x + y, aux + layer_aux
        logits = self.rmsnorm(x, p["model.norm.weight"]) @ p["lm_head.weight"].t()
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1)), aux

    def flat(self, grads=False):
        """llm5d's flat order (see the module's docstring), float32."""
        get = (lambda t: t.grad) if grads else (lambda t: t.detach())
        p = {name: get(t) for name, t in self.p.items()}
        hd = self.hd
        hf_row = [r // 2 if r % 2 == 0 else hd // 2 + r // 2 for r in range(hd)]  # llm5d's row r is HF's hf_row[r]
        llm5d_rows = lambda w, heads: w[torch.tensor([h * hd + hf_row[r] for h in range(heads) for r in range(hd)])]
        padded = lambda t: torch.cat([t, torch.zeros(VP - V, C, dtype=t.dtype)])
        layer = lambda l, name: p[f"model.layers.{l}.{name}"]
        at = lambda l, name: layer(l, f"self_attn.{name}.weight")
        expert = lambda l, e, name: layer(l, f"{self.block}.experts.{e}.{name}.weight")
        parts = [padded(p["model.embed_tokens.weight"]), padded(p["lm_head.weight"])]
        every, sparse = range(self.L), [l for l in range(self.L) if self.sparse[l]]
        dense = [l for l in range(self.L) if not self.sparse[l]]
        parts += [layer(l, "input_layernorm.weight") for l in every]
        parts += [torch.cat([llm5d_rows(at(l, "q_proj"), NH), llm5d_rows(at(l, "k_proj"), KV), at(l, "v_proj")])
                  for l in every]
        if self.qwen2:
            bias = lambda l, name: layer(l, f"self_attn.{name}.bias")
            parts += [torch.cat([llm5d_rows(bias(l, "q_proj"), NH), llm5d_rows(bias(l, "k_proj"), KV),
                                 bias(l, "v_proj")]) for l in every]
        parts += [at(l, "o_proj") for l in every]
        parts += [layer(l, "post_attention_layernorm.weight") for l in every]
        parts += [layer(l, f"{self.block}.gate.weight") for l in sparse]
        parts += [torch.cat([expert(l, e, self.up_name), expert(l, e, self.gate_name)]) for l in sparse
                  for e in range(E)]
        parts += [expert(l, e, self.down_name) for l in sparse for e in range(E)]
        parts += [p["model.norm.weight"]]
        if self.qk_norm:
            parts += [llm5d_rows(at(l, "q_norm"), 1) for l in every]
            parts += [llm5d_rows(at(l, "k_norm"), 1) for l in every]
        parts += [torch.cat([layer(l, "mlp.up_proj.weight"), layer(l, "mlp.gate_proj.weight")]) for l in dense]
        parts += [layer(l, "mlp.down_proj.weight") for l in dense]
        if self.qwen2:
            shared = lambda l, name: layer(l, f"mlp.shared_expert.{name}.weight")
            parts += [torch.cat([shared(l, "up_proj"), shared(l, "gate_proj")]) for l in sparse]
            parts += [shared(l, "down_proj") for l in sparse]
            parts += [layer(l, "mlp.shared_expert_gate.weight") for l in sparse]
        return np.concatenate([t.numpy().astype("<f4").ravel() for t in parts])

    def hf_config(self):
        common = {"hidden_size": C, "num_hidden_layers": self.L, "num_attention_heads": NH, "num_key_value_heads": KV,
                  "head_dim": self.hd, "rms_norm_eps": self.eps, "rope_theta": self.theta, "rope_scaling": None,
                  "max_position_embeddings": MAXT, "vocab_size": V, "tie_word_embeddings": False,
                  "hidden_act": "silu", "attention_dropout": 0.0, "num_experts_per_tok": K,
                  "output_router_logits": False, "router_aux_loss_coef": 0.001, "sliding_window": None,
                  "torch_dtype": "float32"}
        if self.arch == "mixtral":
            return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": E,
                    "intermediate_size": H_EXPERT, "router_jitter_noise": 0.0, **common}
        qwen_moe = {"num_experts": E, "moe_intermediate_size": H_EXPERT, "intermediate_size": H_DENSE,
                    "norm_topk_prob": self.normalize, "decoder_sparse_step": self.sparse_step,
                    "mlp_only_layers": self.mlp_only_layers, "use_sliding_window": False, "max_window_layers": self.L}
        if self.arch == "qwen2_moe":  # Qwen2MoeConfig: no head_dim, no attention_bias (q, k, v always have biases)
            del common["head_dim"]
            return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                    "shared_expert_intermediate_size": H_SHARED, **qwen_moe, **common}
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                **qwen_moe, **common}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", required=True, choices=sorted(ARCHS))
    ap.add_argument("--unnormalized", action="store_true", help="Qwen-MoE with norm_topk_prob false")
    ap.add_argument("--layers", type=int, default=L)
    ap.add_argument("--dense-layers", type=int, default=0, help="Qwen-MoE: mlp_only_layers [0, N)")
    ap.add_argument("--sparse-step", type=int, default=1, help="Qwen-MoE: decoder_sparse_step")
    ap.add_argument("--aux-batch", action="store_true", help="the load-balancing loss's f over the step's batch")
    args = ap.parse_args()
    assert not (args.unnormalized and args.arch == "mixtral"), "Mixtral always renormalizes its gates"
    assert args.arch != "mixtral" or (args.dense_layers, args.sparse_step) == (0, 1), "Mixtral's layers are all sparse"

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(SEED + 200 + int(args.unnormalized) + 2 * (args.arch == "mixtral") +
                                        4 * args.dense_layers + 8 * args.sparse_step + 32 * (args.arch == "qwen2_moe"))
    model = MoEModel(args.arch, not args.unnormalized, gen, args.layers, args.dense_layers, args.sparse_step,
                     args.aux_batch)
    x = torch.randint(0, V, (MICRO * B, T), generator=gen, dtype=torch.long)
    y = torch.randint(0, V, (MICRO * B, T), generator=gen, dtype=torch.long)

    hf = os.path.join(args.out, "hf")
    os.makedirs(hf, exist_ok=True)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(model.hf_config(), f, indent=2)
    write_safetensors(os.path.join(hf, "model.safetensors"),
                      {name: t.detach().numpy().astype("<f4") for name, t in model.p.items()}, "F32")
    init_logits, init_loss, init_aux, init_grads, losses = run_reference(model, x, y)
    write_state(os.path.join(args.out, "state.bin"), x, y, init_logits, init_loss, init_grads, losses,
                (f32_bits(ALPHA), f32_bits(init_aux)), args.aux_batch)
    dense = [l for l in range(model.L) if not model.sparse[l]]
    print(f"{args.arch} L={model.L} dense layers {dense} C={C} NH={NH} KV={KV} HD={model.hd} E={E} K={K} "
          f"expert H={H_EXPERT} normalized={model.normalize}: {init_grads.size} parameters, initial loss {init_loss:.6f}, aux "
          f"{init_aux:.6f}, losses {losses[0]:.6f} -> {losses[-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
