#!/usr/bin/python3
"""Write an llm.c model file (GPT-2's, or Llama 3's, fp32) as a Hugging Face directory, independently of llm5d.

    /usr/bin/python3 test/reference/make_hf_reference.py MODEL.bin OUTDIR [--shards N] [--dtype F32|BF16|F16]

config.json (json.dump's formatting) and model.safetensors, or N shards with model.safetensors.index.json, in
HF's names and layouts: GPT-2's Conv1D weights transposed and the padded vocab rows dropped; Llama's q and k rows
reordered per head from the interleaved RoPE pairs to HF's rotate-half halves, c_fc/c_fc2 as up/gate_proj.
The tests import what it writes with `train_gpt -e OUTDIR` and compare with the llm.c file it came from; BF16
is written by truncation and F16 by numpy's rounding, so an import is the file's model only in F32.
"""
import argparse
import json
import os
import struct

import numpy as np

def write_safetensors(path, tensors, dtype):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        if dtype == "BF16":
            b = (np.ascontiguousarray(t, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()  # truncation
        else:
            b = np.ascontiguousarray(t, dtype="<f4" if dtype == "F32" else "<f2").tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b); off += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode(); h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for b in blobs: f.write(b)

def take(flat, pos, *shape):
    n = int(np.prod(shape)); out = flat[pos[0]:pos[0] + n].reshape(shape); pos[0] += n; return out

def gpt2(h, flat):
    maxT, V, L, NH, C, Vp = (int(x) for x in h[2:8])
    pos = [0]
    wte = take(flat, pos, Vp, C); wpe = take(flat, pos, maxT, C)
    ln1w = take(flat, pos, L, C); ln1b = take(flat, pos, L, C)
    qkvw = take(flat, pos, L, 3 * C, C); qkvb = take(flat, pos, L, 3 * C)
    apw = take(flat, pos, L, C, C); apb = take(flat, pos, L, C)
    ln2w = take(flat, pos, L, C); ln2b = take(flat, pos, L, C)
    fcw = take(flat, pos, L, 4 * C, C); fcb = take(flat, pos, L, 4 * C)
    fpw = take(flat, pos, L, C, 4 * C); fpb = take(flat, pos, L, C)
    lnfw = take(flat, pos, C); lnfb = take(flat, pos, C)
    assert pos[0] == flat.size
    T = {"transformer.wte.weight": wte[:V], "transformer.wpe.weight": wpe}
    for i in range(L):
        p = f"transformer.h.{i}."
        T[p + "ln_1.weight"] = ln1w[i]; T[p + "ln_1.bias"] = ln1b[i]
        T[p + "attn.c_attn.weight"] = qkvw[i].T
        T[p + "attn.c_attn.bias"] = qkvb[i]
        T[p + "attn.c_proj.weight"] = apw[i].T; T[p + "attn.c_proj.bias"] = apb[i]
        T[p + "ln_2.weight"] = ln2w[i]; T[p + "ln_2.bias"] = ln2b[i]
        T[p + "mlp.c_fc.weight"] = fcw[i].T; T[p + "mlp.c_fc.bias"] = fcb[i]
        T[p + "mlp.c_proj.weight"] = fpw[i].T; T[p + "mlp.c_proj.bias"] = fpb[i]
    T["transformer.ln_f.weight"] = lnfw; T["transformer.ln_f.bias"] = lnfb
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": C, "n_head": NH, "n_layer": L,
           "n_positions": maxT, "n_ctx": maxT, "vocab_size": V, "layer_norm_epsilon": 1e-5,
           "activation_function": "gelu_new", "tie_word_embeddings": True, "torch_dtype": "float32"}
    return T, cfg

def to_rotate_half(w, heads, hd):
    """Our rows per head are interleaved pairs (2i, 2i+1); HF's row i is our 2i, row hd/2+i is our 2i+1."""
    return w.reshape(heads, hd // 2, 2, -1).transpose(0, 2, 1, 3).reshape(heads * hd, -1)

def llama(h, hf, flat):
    maxT, V, L, NH, KV, C, mult_of, scaled = (int(x) for x in h[2:10])
    ffn_mult, eps, theta, factor = (float(x) for x in hf[:4])
    tied = h[14] == 1  # llm5d's slot: the classifier is wte, which lm_head's slot repeats
    hd = C // NH; Q = (NH + 2 * KV) * hd
    # H from the file size: the rest after the fixed tensors is L*H*(2C + 2 + C)
    fixed = 2 * V * C + L * (6 * C + Q * C + Q + C * C) + 2 * C
    H, r = divmod(flat.size - fixed, L * (3 * C + 2)); assert r == 0
    pos = [0]
    wte = take(flat, pos, V, C); lm_head = take(flat, pos, V, C)
    ln1w = take(flat, pos, L, C); take(flat, pos, L, C)
    qkvw = take(flat, pos, L, Q, C); take(flat, pos, L, Q)
    apw = take(flat, pos, L, C, C); take(flat, pos, L, C)
    ln2w = take(flat, pos, L, C); take(flat, pos, L, C)
    fcw = take(flat, pos, L, 2 * H, C); take(flat, pos, L, 2 * H)
    fpw = take(flat, pos, L, C, H); take(flat, pos, L, C)
    lnfw = take(flat, pos, C); take(flat, pos, C)
    assert pos[0] == flat.size
    T = {"model.embed_tokens.weight": wte}
    for i in range(L):
        p = f"model.layers.{i}."
        T[p + "input_layernorm.weight"] = ln1w[i]
        T[p + "self_attn.q_proj.weight"] = to_rotate_half(qkvw[i][:NH * hd], NH, hd)
        T[p + "self_attn.k_proj.weight"] = to_rotate_half(qkvw[i][NH * hd:(NH + KV) * hd], KV, hd)
        T[p + "self_attn.v_proj.weight"] = qkvw[i][(NH + KV) * hd:]
        T[p + "self_attn.o_proj.weight"] = apw[i]
        T[p + "post_attention_layernorm.weight"] = ln2w[i]
        up, gate = fcw[i][:H], fcw[i][H:]   # c_fc then c_fc2
        T[p + "mlp.gate_proj.weight"] = gate; T[p + "mlp.up_proj.weight"] = up
        T[p + "mlp.down_proj.weight"] = fpw[i]
    T["model.norm.weight"] = lnfw
    if tied: assert (lm_head == wte).all()
    else: T["lm_head.weight"] = lm_head
    rs = {"rope_type": "llama3", "factor": factor or 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192} if scaled else None
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": C, "intermediate_size": H,
           "num_attention_heads": NH, "num_key_value_heads": KV, "num_hidden_layers": L, "head_dim": hd,
           "max_position_embeddings": maxT, "rms_norm_eps": eps, "rope_theta": theta, "rope_scaling": rs,
           "vocab_size": V, "tie_word_embeddings": bool(tied), "hidden_act": "silu", "attention_bias": False,
           "mlp_bias": False, "torch_dtype": "float32"}
    return T, cfg

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model"); ap.add_argument("out")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--dtype", default="F32", choices=["F32", "BF16", "F16"])
    a = ap.parse_args()
    raw = open(a.model, "rb").read()
    h = np.frombuffer(raw, "<i4", 256)
    assert h[1] == 3
    if h[0] == 20240326:
        T, cfg = gpt2(h, np.frombuffer(raw, "<f4", offset=1024))
    elif h[0] == 20240803:
        T, cfg = llama(h, np.frombuffer(raw, "<f4", 256, 1024), np.frombuffer(raw, "<f4", offset=2048))
    os.makedirs(a.out, exist_ok=True)
    for f in os.listdir(a.out): os.remove(os.path.join(a.out, f))
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    if a.shards == 1:
        write_safetensors(os.path.join(a.out, "model.safetensors"), T, a.dtype)
    else:
        names = list(T); per = -(-len(names) // a.shards); wm = {}
        for s in range(a.shards):
            fn = f"model-{s + 1:05d}-of-{a.shards:05d}.safetensors"
            part = {n: T[n] for n in names[s * per:(s + 1) * per]}
            write_safetensors(os.path.join(a.out, fn), part, a.dtype); wm.update({n: fn for n in part})
        json.dump({"metadata": {"total_size": sum(t.size * 4 for t in T.values())}, "weight_map": wm},
                  open(os.path.join(a.out, "model.safetensors.index.json"), "w"), indent=2)
    print(f"{a.model} -> {a.out}: {len(T)} tensors, {sum(t.size for t in T.values())} parameters")

if __name__ == "__main__":
    main()
