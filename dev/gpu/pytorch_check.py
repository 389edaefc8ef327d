#!/usr/bin/env python3
"""llm5d against PyTorch on the same model file and the same batches: the last rung of the GPU model's check.

`init` writes an llm.c model file (fp32, version 3) in test/reference's initialization: weights N(0, 0.02) (the
residual projections scaled by 1/sqrt(2L)), biases N(0, 0.02), layernorm gains N(1, 0.1) and shifts N(0, 0.1),
so that no layernorm is the identity and a mix-up of gain and shift shows in the losses.

`train` loads a model file into dev/bench/pytorch_gpt2.py's GPT-2 (the benchmark's PyTorch model, so there is
one PyTorch GPT-2 in the project), trains it for --steps AdamW steps as train_gpt does with `--shuffle 0 -k
constant -u 0 -d B*T` on one rank (step k reads tokens [k*B*T, (k+1)*B*T + 1) of the shard, wrapping like
train_gpt's loader; constant learning rate; β (0.9, 0.95), ε 1e-8, weight decay on the 2-D weights; gradients
clipped to a global norm of 1), and prints each step's loss. On the GPU it runs under bf16 autocast with fp32
parameters (the usual PyTorch mixed precision, llm.c's reference for its own bf16 trainer); on the CPU in fp32,
where train_gpt --device cpu must agree to rounding. With --compare MAIN_LOG it compares the losses with a
train_gpt run's "s:STEP trl:LOSS" lines, and exits 1 when any step differs by more than --tol (absolute; llm.c
accepts 0.05 between its bf16 GPU trainer and PyTorch).

    python3 dev/gpu/pytorch_check.py init --out model.bin --layers 12 --channels 768 --heads 12
    ./train_gpt --device cuda -e model.bin -b 4 -t 1024 -x 10 -l 3e-4 -c 0.1 -k constant --shuffle 0 -v 0 -s 0 -o run
    python3 dev/gpu/pytorch_check.py train --model model.bin --batch 4 --seq-len 1024 --steps 10 --lr 3e-4 \\
        --weight-decay 0.1 --compare run/main.log --tol 0.05
"""

import argparse
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from pytorch_gpt2 import GPT, load_tokens, make_optimizer, padded_vocab  # noqa: E402

MODEL_MAGIC = 20240326
MODEL_VERSIONS = {3: np.float32, 5: np.uint16}  # fp32, bf16
HEADER_INTS = 256


# ------------------------------------------------------------------------------------------------------------
# llm.c's model file: 256 int32 header, then the tensors in this order, each layer tensor stacked over layers

def llmc_tensors(model):
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


def read_header(path):
    with open(path, "rb") as f:
        raw = f.read(HEADER_INTS * 4)
    if len(raw) != HEADER_INTS * 4:
        sys.exit(f"pytorch_check: {path}: shorter than the model header")
    h = np.frombuffer(raw, dtype="<i4")
    if h[0] != MODEL_MAGIC or int(h[1]) not in MODEL_VERSIONS:
        sys.exit(f"pytorch_check: {path}: not an llm.c model file (magic {h[0]}, version {h[1]})")
    version, maxT, V, L, NH, C, Vp = (int(x) for x in h[1:8])
    return dict(version=version, maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=Vp)


def load_model(path):
    """A GPT with the file's weights (fp32), and the file's header."""
    hd = read_header(path)
    if padded_vocab(hd["V"]) != hd["Vp"]:
        sys.exit(f"pytorch_check: {path}: padded vocab {hd['Vp']}, the PyTorch model pads {hd['V']} to "
                 f"{padded_vocab(hd['V'])}")
    model = GPT(hd["L"], hd["C"], hd["NH"], hd["V"], hd["maxT"])
    raw = np.fromfile(path, dtype=MODEL_VERSIONS[hd["version"]], offset=HEADER_INTS * 4)
    if hd["version"] == 5:  # bf16: the upper half of an fp32
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    offset = 0
    with torch.no_grad():
        for name, parts in llmc_tensors(model):
            for p in parts:
                n = p.numel()
                if offset + n > raw.size:
                    sys.exit(f"pytorch_check: {path}: ends inside tensor {name}")
                p.copy_(torch.from_numpy(raw[offset: offset + n].copy()).view_as(p))
                offset += n
    if offset != raw.size:
        sys.exit(f"pytorch_check: {path}: {raw.size - offset} values after the last tensor")
    return model, hd


def save_model(model, hd, path):
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = [MODEL_MAGIC, 3, hd["maxT"], hd["V"], hd["L"], hd["NH"], hd["C"], hd["Vp"]]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for _, parts in llmc_tensors(model):
            for p in parts:
                f.write(p.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes())


def reference_init(model, L, V, gen):
    """test/reference's scheme (see the module docstring); the padding rows of wte stay zero, as llm.c's."""
    resid_std = 0.02 / (2 * L) ** 0.5
    with torch.no_grad():
        for name, parts in llmc_tensors(model):
            for p in parts:
                if name.startswith("ln") and name.endswith("w"):
                    mean, std = 1.0, 0.1
                elif name.startswith("ln"):
                    mean, std = 0.0, 0.1
                else:
                    mean, std = 0.0, resid_std if name in ("attprojw", "fcprojw") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std + mean)
        model.wte.weight[V:].zero_()


# ------------------------------------------------------------------------------------------------------------

def cmd_init(args):
    for n in ("layers", "channels", "heads", "vocab", "max_seq_len"):
        if getattr(args, n) <= 0:
            sys.exit(f"pytorch_check: --{n.replace('_', '-')} must be positive")
    if args.channels % args.heads:
        sys.exit(f"pytorch_check: --heads {args.heads} must divide --channels {args.channels}")
    model = GPT(args.layers, args.channels, args.heads, args.vocab, args.max_seq_len)
    reference_init(model, args.layers, args.vocab, torch.Generator().manual_seed(args.seed))
    hd = dict(maxT=args.max_seq_len, V=args.vocab, L=args.layers, NH=args.heads, C=args.channels,
              Vp=padded_vocab(args.vocab))
    save_model(model, hd, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"pytorch_check: wrote {args.out}: L={args.layers} C={args.channels} NH={args.heads} V={args.vocab} "
          f"(Vp {hd['Vp']}) maxT={args.max_seq_len}, {n} parameters")


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
    print(f"pytorch {torch.__version__} on {args.device}, {precision}; model {args.model}: L={hd['L']} C={hd['C']} "
          f"NH={hd['NH']} V={hd['V']} maxT={hd['maxT']}; B={B} T={T}, {args.steps} steps, lr {args.lr} constant, "
          f"weight decay {args.weight_decay}, AdamW{' (fused)' if fused else ''}, clip 1.0")
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
    init.add_argument("--layers", type=int, required=True)
    init.add_argument("--channels", type=int, required=True)
    init.add_argument("--heads", type=int, required=True)
    init.add_argument("--vocab", type=int, default=50257)
    init.add_argument("--max-seq-len", type=int, default=1024)
    init.add_argument("--seed", type=int, default=1234)

    train = sub.add_parser("train", help="train a model file in PyTorch, compare with a train_gpt main.log")
    train.add_argument("--model", required=True, help="llm.c model file (fp32 version 3 or bf16 version 5)")
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
