#!/usr/bin/env python3
"""The step-time model against published measurements: every row of dev/bench/published_megatron.tsv that gives
a whole layout (Megatron-LM's GPT runs on A100s, Narayanan et al. 2021, and on H100s, its README's table) is
planned with `train_gpt --plan` on the matching hardware profile, and the predicted step is set beside the
published one, row by row, with the median error.

What is compared: the step time. The published rows give throughput, from which the step follows by the paper's
own FLOP count: Narayanan et al. report teraFLOP/s per GPU counting 96·B·s·l·h²·(1 + s/6h + V/16lh) per step
(full activation recomputation: every layer's forward twice); the H100 table reports MFU counting
72·B·s·l·h²·(1 + s/6h + V/12lh) against 989 TFLOP/s. llm5d's layout is the row's: -t s, -d B·s, -b the
micro-batch (1 where unpublished), --tp, --pp (interleaved with --vpp where the paper's script used it),
--world gpus; ZeRO-1 on the H100s (Megatron-Core's distributed optimizer), none on the A100s. llm5d has no full
recomputation, so the A100 rows are predicted with -r 2 and the recomputed forward added: the layers'
forward share of the model's FLOPs (24·B·s·l·h² + 4·B·s²·l·h of 72·B·s·l·h² + 12·B·s²·l·h + 6·B·s·h·V) of the
predicted compute. The H100 rows, whose recomputation is unpublished, are predicted with -r 0 when that fits and
-r 2 when not.

Usage (from the repository root, after make train_gpt):  python3 dev/bench/planner_published_check.py [--markdown FILE]
"""
import csv
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILES = {"A100": "dev/hardware/a100.txt", "H100": "dev/hardware/h100.txt"}
PEAK = {"A100": 312e12, "H100": 989e12}


def rows():
    with open(os.path.join(ROOT, "dev/bench/published_megatron.tsv")) as f:
        lines = [l for l in f if not l.startswith("#")]
    for r in csv.DictReader(lines, delimiter="\t"):
        needed = ["layers", "hidden", "heads", "seq_len", "vocab", "tp", "pp", "dp", "gpus", "global_batch"]
        if all(r[k] != "-" for k in needed) and (r["tflops_per_gpu"] != "-" or r["mfu_percent"] != "-"):
            yield r


def plan(r, recompute, zero):
    l, h, a, s, v = (int(r[k]) for k in ("layers", "hidden", "heads", "seq_len", "vocab"))
    b = 1 if r["micro_batch"] == "-" else int(r["micro_batch"])
    vpp = 1 if r["vpp"] in ("-", "1") else int(r["vpp"])
    args = ["./train_gpt", "-e", f"d{l}c{h}h{a}t{s}v{v}", "-t", str(s), "-b", str(b),
            "-d", str(int(r["global_batch"]) * s), "--tp", r["tp"], "--pp", r["pp"], "--world", r["gpus"],
            "-z", str(zero), "-r", str(recompute), "--device", "cuda", "--plan", "--hardware", PROFILES[r["gpu"]]]
    if vpp > 1:
        args += ["--pp-schedule", "interleaved", "--vpp", str(vpp)]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"planner_published_check: {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
    step = re.search(r"predicted step: ([0-9.]+) ms, [0-9]+ tokens/s, MFU [0-9.]+% \(compute ([0-9.]+) ms", out.stdout)
    fits = "fits " in out.stdout and ": NO" not in out.stdout
    return float(step.group(1)) / 1e3, float(step.group(2)) / 1e3, fits


def plan_bytes(args):
    """--plan --device cuda's categories of its first stage, and the model's parameter count"""
    out = subprocess.run(["./train_gpt", "--plan", "--device", "cuda"] + args, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"planner_published_check: --plan {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
    categories = {}
    for name, value in re.findall(r"^  (\S[\w ]*?) +(\d+) bytes", out.stdout, re.M):
        categories.setdefault(name, int(value))
    return categories, int(re.search(r": (\d+) parameters", out.stdout).group(1))


def memory_tables():
    """The Playbook's memory formulas beside --plan: model states of bf16 mixed precision under ZeRO (2Ψ + 2Ψ +
    12Ψ, then sharded stage by stage over N) and the activations of one layer (Korthikanti et al.'s s·b·h·(34 +
    5·a·s/h) bytes, which the Playbook uses), the latter as the difference between the plans of L+1 and L layers"""
    lines = ["| model | N | ZeRO | Playbook (GiB per rank) | --plan: params + master + grads + optimizer (GiB) | ratio |",
             "|---|---|---|---|---|---|"]
    for name, model in [("GPT-2 1.5B (d48)", "d48"), ("GPT-3 175B shape", "d96c12288h96t2048v51200")]:
        for zero in range(4):
            n = 8
            cats, psi = plan_bytes(["-e", model, "-b", "1", "-t", "1024", "--world", str(n), "-z", str(zero)])
            formula = [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n][zero]
            ours = sum(cats[k] for k in ("params", "master weights", "grads", "optimizer state"))
            lines.append(f"| {name} | {n} | {zero} | {formula / 2**30:.2f} | {ours / 2**30:.2f} | {ours / formula:.4f} |")
    lines += ["", "| shape (s, b, h, a) | Playbook 34·sbh + 5·a·s²·b (MiB per layer) | its 34·sbh alone | --plan, one layer "
              "(MiB) | ratio to 34·sbh |", "|---|---|---|---|---|"]
    for s, b, h, a in [(1024, 4, 768, 12), (1024, 4, 1600, 25), (2048, 1, 12288, 96), (4096, 1, 8192, 64)]:
        per_layer = []
        for layers in (1, 2):
            cats, _ = plan_bytes(["-e", f"d{layers}c{h}h{a}t{s}", "-b", str(b), "-t", str(s)])
            per_layer.append(cats["activations"])
        ours = per_layer[1] - per_layer[0]
        playbook = s * b * h * (34 + 5 * a * s / h)
        lines.append(f"| {s}, {b}, {h}, {a} | {playbook / 2**20:.1f} | {34 * s * b * h / 2**20:.1f} | {ours / 2**20:.1f} | "
                     f"{ours / (34 * s * b * h):.3f} |")
    return "\n".join(lines)


def main():
    markdown = sys.argv[sys.argv.index("--markdown") + 1] if "--markdown" in sys.argv else None
    table = ["| GPU | model | tp × pp × dp (vpp) | batch × mb | llm5d flags | published step (s) | predicted (s) | error |",
             "|---|---|---|---|---|---|---|---|"]
    errors = []
    for r in rows():
        l, h, s, v = (int(r[k]) for k in ("layers", "hidden", "seq_len", "vocab"))
        batch, gpus = int(r["global_batch"]), int(r["gpus"])
        model = 72 * batch * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
        if r["tflops_per_gpu"] != "-" and r["gpu"] == "A100":
            hardware = 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
            published = hardware / (float(r["tflops_per_gpu"]) * 1e12 * gpus)
            step, compute, fits = plan(r, 2, 0)
            forward_share = (24 * batch * s * l * h * h + 4 * batch * s * s * l * h) / model
            predicted, recompute = step + forward_share * compute, "-r 2 + full recompute's forward"
        else:
            published = model / (float(r["mfu_percent"]) / 100 * PEAK[r["gpu"]] * gpus)
            predicted, compute, fits = plan(r, 0, 1)
            recompute = "-r 0"
            if not fits:
                predicted, compute, fits = plan(r, 2, 1)
                recompute = "-r 2"
        error = predicted / published - 1
        errors.append(abs(error))
        mb = r["micro_batch"] if r["micro_batch"] != "-" else "1 (unpublished)"
        vpp = f" (vpp {r['vpp']})" if r["vpp"] not in ("-", "1") else ""
        table.append(f"| {r['gpu']} | {r['params_billion']}B: L={l} h={h} | {r['tp']} × {r['pp']} × {r['dp']}{vpp} | "
                     f"{batch} × {mb} | {recompute}{'' if fits else ', does not fit llm5d'} | {published:.2f} | "
                     f"{predicted:.2f} | {100 * error:+.1f}% |")
    table.append("")
    table.append(f"median |error| over {len(errors)} rows: {100 * statistics.median(errors):.1f}%")
    text = "\n".join(table) + "\n\n" + memory_tables()
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
