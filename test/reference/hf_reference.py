#!/usr/bin/python3
"""Check a Hugging Face model directory (llm5d's --format hf export) against a reference state file.

    /usr/bin/python3 test/reference/hf_reference.py --hf DIR --state STATE.bin [--tol 1e-5]
        [--hf DIR2 --state STATE2.bin [--tol T2] ...]

An independent float64 forward pass of transformers' GPT2LMHeadModel, LlamaForCausalLM and Qwen3ForCausalLM,
written from Hugging Face's names and conventions (not llm5d's) with nothing beyond torch and numpy. It reads
DIR/config.json (RoPE's settings at the top level as transformers 4 writes them, or in rope_parameters as
transformers 5 does) and the weights (DIR/model.safetensors, or the shards DIR/model.safetensors.index.json
names), runs the first micro-batch of STATE.bin (from make_reference.py, make_llama_reference.py or
make_qwen3_reference.py), and compares the logits (max abs error over the largest |logit|) and the mean
cross-entropy (relative). Exit 0: PASS, 1: FAIL, 2: a bad input (one line). Several --hf and --state pairs
are checked one after another in one process (torch takes most of a check's time to load), a line each, in
order; one --tol is every pair's, else one per pair; the exit status is the worst.
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

STATE_MAGIC, STATE_VERSION = 20240327, 3
# safetensors dtype -> (numpy dtype of the stored bits, bytes per element)
DTYPES = {"F32": (np.dtype("<f4"), 4), "F16": (np.dtype("<f2"), 2), "BF16": (np.dtype("<u2"), 2)}


class BadInput(Exception):
    """A file that is not what it should be; main prints the message as one line and exits 2."""


def read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise BadInput(f"{path}: {e.strerror}")


def read_json(path):
    try:
        value = json.loads(read_bytes(path))
    except ValueError as e:
        raise BadInput(f"{path}: not JSON ({e})")
    if not isinstance(value, dict):
        raise BadInput(f"{path}: not a JSON object")
    return value


def read_safetensors(path, wanted=None):
    """{name: float64 tensor} of one safetensors file (only `wanted`'s names when given), offsets checked."""
    data = read_bytes(path)
    if len(data) < 8:
        raise BadInput(f"{path}: {len(data)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise BadInput(f"{path}: header length {n} runs past the end of the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n])
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        raise BadInput(f"{path}: the header is not a JSON object")
    start, size = 8 + n, len(data) - 8 - n  # data_offsets count from the end of the header
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or (wanted is not None and name not in wanted):
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{path}: tensor {name}: a header entry without dtype, shape and data_offsets [b, e]")
        if dtype not in DTYPES:
            raise BadInput(f"{path}: tensor {name}: dtype {dtype} (expected one of {', '.join(DTYPES)})")
        bits, width = DTYPES[dtype]
        count = math.prod(shape)
        if not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= size) or e - b != count * width:
            raise BadInput(f"{path}: tensor {name}: data_offsets [{b}, {e}] do not hold {dtype} {shape} "
                           f"within the {size} data bytes")
        raw = np.frombuffer(data, dtype=bits, count=count, offset=start + b)
        if dtype == "BF16":  # a bf16 is the top half of a float32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = torch.from_numpy(raw.astype(np.float64).reshape(shape))
    return out


def read_weights(d):
    """Every tensor of the model, from model.safetensors or from the shards the index's weight_map names."""
    index = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(d, "model.safetensors"))
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInput(f"{index}: no weight_map object")
    weights = {}
    for shard in sorted(set(weight_map.values())):
        names = {n for n, s in weight_map.items() if s == shard}
        got = read_safetensors(os.path.join(d, shard), names)
        missing = sorted(names - got.keys())
        if missing:
            raise BadInput(f"{os.path.join(d, shard)}: no tensor {missing[0]}, which {index} maps to it")
        weights.update(got)
    return weights


def read_headed(path, magic, version, kind):
    """The bytes of a file that starts with llm.c's header of 256 int32, magic and version first, and the header."""
    data = read_bytes(path)
    if len(data) < 1024:
        raise BadInput(f"{path}: {len(data)} bytes, shorter than the 256-int32 header")
    h = np.frombuffer(data, dtype="<i4", count=256)
    if h[0] != magic or h[1] != version:
        raise BadInput(f"{path}: magic {h[0]} version {h[1]}, not {kind} ({magic}, {version})")
    return data, h


def read_state(path):
    """The first micro-batch of a reference state file: inputs and targets (B, T), logits (B, T, V), loss."""
    data, h = read_headed(path, STATE_MAGIC, STATE_VERSION, "a state file")
    B, T, V, micro = int(h[2]), int(h[3]), int(h[4]), int(h[12]) or 1  # GPT-2's writer leaves h[12] at 0
    n = micro * B * T  # inputs and targets of every micro-batch are stored, logits and loss of the first only
    if min(B, T, V, micro) <= 0 or len(data) < 1024 + 4 * (2 * n + B * T * V + 1):
        raise BadInput(f"{path}: {len(data)} bytes cannot hold B={B} T={T} V={V} micro-batches={micro}")
    at = lambda k: 1024 + 4 * k
    tokens = lambda k: torch.from_numpy(np.frombuffer(data, "<i4", B * T, at(k)).astype(np.int64).reshape(B, T))
    logits = np.frombuffer(data, "<f4", B * T * V, at(2 * n)).astype(np.float64).reshape(B, T, V)
    loss = float(np.frombuffer(data, "<f4", 1, at(2 * n + B * T * V))[0])
    return tokens(0), tokens(n), torch.from_numpy(logits), loss


class Config(dict):
    """config.json; need() names the file and the key when a value is absent (without a default) or no number."""

    def __init__(self, path):
        super().__init__(read_json(path))
        self.path = path

    def need(self, key, kind=int, default=None, within=None):
        value = (self if within is None else within).get(key)
        if value is None and default is not None:
            return default
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise BadInput(f"{self.path}: {key} is {json.dumps(value)}, expected a number")


class Weights:
    """The model's tensors; tensor() names the file and the tensor when it is absent or shaped unlike the config."""

    def __init__(self, tensors, source):
        self.tensors, self.source = tensors, source

    def tensor(self, name, *shape):
        t = self.tensors.get(name)
        if t is None:
            raise BadInput(f"{self.source}: no tensor {name}")
        if list(t.shape) != list(shape):
            raise BadInput(f"{self.source}: {name} is {list(t.shape)}, the config says {list(shape)}")
        return t


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(hd)) v over (B, heads, T, hd), each position seeing itself and the ones before."""
    T = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def split_heads(x, heads):
    """(B, T, heads*hd) -> (B, heads, T, hd): head j owns channels [j*hd, (j+1)*hd)."""
    return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def gelu_new(x):
    """GPT-2's activation_function "gelu_new": the tanh approximation."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def inverse_frequencies(cfg, hd):
    """1/theta^(2i/hd), i < hd/2, then Llama 3.1's scaling as transformers' _compute_llama3_parameters does it.

    RoPE's settings are where transformers 4 writes them (rope_theta at the top level, the scaling in
    rope_scaling) or where transformers 5 does (both in rope_parameters)."""
    parameters = cfg.get("rope_parameters")
    parameters = parameters if isinstance(parameters, dict) else {}
    within = None if "rope_theta" in cfg else parameters
    inv = 1.0 / cfg.need("rope_theta", float, within=within) ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    scaling = cfg.get("rope_scaling") or parameters
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    if kind == "default":
        return inv
    if kind != "llama3":
        raise BadInput(f"{cfg.path}: rope_scaling {json.dumps(scaling)} (only llama3's is known here)")
    factor, low, high, old = (cfg.need(k, float, within=scaling) for k in (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv
    # wavelengths longer than old/low are slowed by factor, shorter than old/high kept, those between blended
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x, inv_freq):
    """HF's RoPE on (B, heads, T, hd): channels i and i + hd/2 turn together by position * inv_freq[i]."""
    angle = torch.arange(x.shape[2], dtype=torch.float64)[:, None] * inv_freq[None, :]  # (T, hd/2)
    emb = torch.cat([angle, angle], dim=-1)
    half = x.shape[-1] // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cos(emb) + rotate_half * torch.sin(emb)


def gpt2_logits(cfg, weights, idx):
    C, NH, L, V, P = (cfg.need(k) for k in ("n_embd", "n_head", "n_layer", "vocab_size", "n_positions"))
    inner, eps = cfg.need("n_inner", default=4 * C), cfg.need("layer_norm_epsilon", float, default=1e-5)
    if cfg.get("activation_function", "gelu_new") != "gelu_new":
        raise BadInput(f"{cfg.path}: activation_function {cfg['activation_function']} (expected gelu_new)")
    if idx.shape[1] > P:
        raise BadInput(f"{cfg.path}: n_positions {P}, fewer than the state's {idx.shape[1]} tokens a row")
    # save_pretrained writes transformer.h.0...; the hub's original gpt2 files have no prefix; HF loads both
    prefix = "transformer." if "transformer.wte.weight" in weights.tensors else ""
    w = lambda name, *shape: weights.tensor(prefix + name, *shape)
    ln = lambda x, name: F.layer_norm(x, (C,), w(name + ".weight", C), w(name + ".bias", C), eps)
    x = w("wte.weight", V, C)[idx] + w("wpe.weight", P, C)[:idx.shape[1]]
    for i in range(L):
        p = f"h.{i}."
        # Conv1D stores its weight [in, out]: y = x @ W + b
        qkv = ln(x, p + "ln_1") @ w(p + "attn.c_attn.weight", C, 3 * C) + w(p + "attn.c_attn.bias", 3 * C)
        q, k, v = (split_heads(t, NH) for t in qkv.split(C, dim=-1))
        y = causal_attention(q, k, v).transpose(1, 2).flatten(2)  # the heads side by side again
        x = x + y @ w(p + "attn.c_proj.weight", C, C) + w(p + "attn.c_proj.bias", C)
        h = gelu_new(ln(x, p + "ln_2") @ w(p + "mlp.c_fc.weight", C, inner) + w(p + "mlp.c_fc.bias", inner))
        x = x + h @ w(p + "mlp.c_proj.weight", inner, C) + w(p + "mlp.c_proj.bias", C)
    x = ln(x, "ln_f")
    tied = cfg.get("tie_word_embeddings", True)  # GPT2Config's default
    return x @ (w("wte.weight", V, C) if tied else weights.tensor("lm_head.weight", V, C)).t()


def decoder_logits(cfg, weights, idx, qk_norm, default_head_dim):
    """Llama's decoder, and with qk_norm Qwen3's: an RMSNorm over each head's queries and keys before RoPE."""
    C, NH, L, V, H = (cfg.need(k) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                             "vocab_size", "intermediate_size"))
    KV, hd = cfg.need("num_key_value_heads", default=NH), cfg.need("head_dim", default=default_head_dim(C, NH))
    eps = cfg.need("rms_norm_eps", float)
    if KV <= 0 or NH % KV:
        raise BadInput(f"{cfg.path}: num_key_value_heads {KV} does not divide num_attention_heads {NH}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise BadInput(f"{cfg.path}: attention_bias or mlp_bias is set (only bias-free projections are known here)")
    if cfg.get("use_sliding_window"):
        raise BadInput(f"{cfg.path}: use_sliding_window is set (only full causal attention is known here)")
    inv_freq = inverse_frequencies(cfg, hd)
    w = weights.tensor
    x = w("model.embed_tokens.weight", V, C)[idx]
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms_norm(x, w(p + "input_layernorm.weight", C), eps)
        # nn.Linear stores its weight [out, in]: y = x @ W^T
        q = split_heads(h @ w(p + "self_attn.q_proj.weight", NH * hd, C).t(), NH)
        k = split_heads(h @ w(p + "self_attn.k_proj.weight", KV * hd, C).t(), KV)
        if qk_norm:  # one hd-weight each, shared by the heads
            q = rms_norm(q, w(p + "self_attn.q_norm.weight", hd), eps)
            k = rms_norm(k, w(p + "self_attn.k_norm.weight", hd), eps)
        q, k = apply_rope(q, inv_freq), apply_rope(k, inv_freq)
        v = split_heads(h @ w(p + "self_attn.v_proj.weight", KV * hd, C).t(), KV)
        # grouped-query attention: query head j reads key/value head j // (NH/KV)
        k, v = k.repeat_interleave(NH // KV, dim=1), v.repeat_interleave(NH // KV, dim=1)
        y = causal_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + y @ w(p + "self_attn.o_proj.weight", C, NH * hd).t()
        h = rms_norm(x, w(p + "post_attention_layernorm.weight", C), eps)
        gate, up = h @ w(p + "mlp.gate_proj.weight", H, C).t(), h @ w(p + "mlp.up_proj.weight", H, C).t()
        x = x + (F.silu(gate) * up) @ w(p + "mlp.down_proj.weight", C, H).t()
    x = rms_norm(x, w("model.norm.weight", C), eps)
    tied = cfg.get("tie_word_embeddings", False)  # LlamaConfig's and Qwen3Config's default
    return x @ w("model.embed_tokens.weight" if tied else "lm_head.weight", V, C).t()


def llama_logits(cfg, weights, idx):
    return decoder_logits(cfg, weights, idx, qk_norm=False, default_head_dim=lambda C, NH: C // NH)


def qwen3_logits(cfg, weights, idx):
    # Qwen3Config's head_dim defaults to 128 whatever C/NH is
    return decoder_logits(cfg, weights, idx, qk_norm=True, default_head_dim=lambda C, NH: 128)


ARCHITECTURES = {"GPT2LMHeadModel": ("gpt2", gpt2_logits), "LlamaForCausalLM": ("llama", llama_logits),
                 "Qwen3ForCausalLM": ("qwen3", qwen3_logits)}


def check(hf_dir, state_path):
    """(arch, logit error, loss error) of the model in hf_dir on the state's first micro-batch."""
    cfg = Config(os.path.join(hf_dir, "config.json"))
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise BadInput(f"{cfg.path}: architectures {json.dumps(cfg.get('architectures'))} "
                       f"(expected one of {', '.join(ARCHITECTURES)})")
    idx, targets, ref_logits, ref_loss = read_state(state_path)
    vocab = cfg.need("vocab_size")
    if vocab != ref_logits.shape[-1]:
        raise BadInput(f"{cfg.path}: vocab_size {vocab}, but {state_path} holds logits over {ref_logits.shape[-1]}")
    if int(torch.cat([idx, targets]).min()) < 0 or int(torch.cat([idx, targets]).max()) >= vocab:
        raise BadInput(f"{state_path}: a token outside the vocabulary of {vocab}")
    source = os.path.join(hf_dir, "model.safetensors")  # named in complaints about the tensors
    source += ".index.json" if os.path.exists(source + ".index.json") else ""
    name, forward = ARCHITECTURES[arch]
    with torch.no_grad():
        logits = forward(cfg, Weights(read_weights(hf_dir), source), idx)
        loss = float(F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)))
    logit_err = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    return name, logit_err, abs(loss - ref_loss) / abs(ref_loss)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True, action="append",
                    help="a Hugging Face model directory (config.json, model.safetensors)")
    ap.add_argument("--state", required=True, action="append",
                    help="a state.bin from make_reference.py, make_llama_reference.py or make_qwen3_reference.py")
    ap.add_argument("--tol", type=float, action="append",
                    help="largest relative logit and loss error that passes [1e-5]")
    args = ap.parse_args()
    tols = args.tol or [1e-5]
    if len(tols) == 1:
        tols = tols * len(args.hf)
    if len(args.state) != len(args.hf) or len(tols) != len(args.hf):
        ap.error("--hf and --state come in pairs, with one --tol for all or one per pair")
    status = 0
    for hf, state, tol in zip(args.hf, args.state, tols):
        try:
            arch, logit_err, loss_err = check(hf, state)
        except BadInput as e:
            print(f"hf_reference: {e}")
            status = 2
            continue
        ok = logit_err <= tol and loss_err <= tol  # a NaN fails
        print(f"hf_reference: {arch} max logit error {logit_err:.3g}, loss error {loss_err:.3g}: "
              f"{'PASS' if ok else 'FAIL'}")
        status = max(status, 0 if ok else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
