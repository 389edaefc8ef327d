#!/usr/bin/env python3
"""llm5d's planner beside the Ultra-Scale Playbook's Llama figures: its memory per GPU under each parallelism, and
its single-node benchmark runs (8 H100s, sequence 4096, 1M tokens a step).

1. Memory: every panel of dev/bench/published_playbook_memory.tsv (8B and 70B, Meta's shapes with grouped-query
   attention, micro-batch 1) is planned with `train_gpt --plan --device cuda` on the same layout, and the
   model states (the Playbook draws params, grads and Adam's moments: 12 bytes a parameter) and the activations
   are set beside the figure's.
2. Benchmarks: every run of dev/bench/published_playbook.tsv (nanotron's 1B, 3B, 8B and 80B benchmark models:
   multi-head attention, vocab 131072) is planned on its layout (dp × tp × pp, its micro-batch, ZeRO stage, sp
   with tp, 1F1B, no recomputation) against dev/hardware/h100.txt: the predicted tokens/s per GPU against the
   measured, per model the rank correlation over the runs that ran, and whether llm5d's plan fits where the run
   ran and not where it ran out of memory. Then, per model, the Playbook's best run beside `--search --gpus 8`'s
   first choice, each priced by the step-time model term by term.

Usage (from the repository root, after make train_gpt):  python3 dev/bench/playbook_llama_check.py [--markdown FILE]
"""
import csv
import os
import re
import statistics
import subprocess
import sys

from rank_correlation import spearman

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30

# Meta's Llama 3.1 8B and 70B (the memory figures), with -t set per row
MEMORY_MODELS = {"8B": "l32c4096h32g8f14336t{s}v128256", "70B": "l80c8192h64g8f28672t{s}v128256"}
# nanotron's benchmark models (scripts/scaling_benchmarks.py): multi-head, vocab 131072, tied below 10000 hidden
BENCH_MODELS = {"1B": "l16c2048h32f8192t4096v131072w", "3B": "l28c3072h32f8192t4096v131072w",
                "8B": "l32c4096h32f14336t4096v131072", "80B": "l80c8192h64f28672t4096v131072"}
SEQ, GPUS = 4096, 8
TERMS = ("compute", "dp", "tp", "cp", "pp", "ep", "bubble")


def read_tsv(name):
    with open(os.path.join(ROOT, "dev/bench", name)) as f:
        return list(csv.DictReader([l for l in f if not l.startswith("#")], delimiter="\t"))


def train_gpt(args):
    out = subprocess.run(["./train_gpt", "--device", "cuda"] + args, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"playbook_llama_check: ./train_gpt {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
    return out.stdout


def plan(args):
    """--plan's first stage's categories (bytes), the largest stage's total on the device, whether every stage fits,
    and the predicted step: tokens/s, MFU and its terms in ms"""
    text = train_gpt(args + ["--plan"])
    categories = {}
    for name, value in re.findall(r"^  (\S[\w ]*?) +(\d+) bytes", text, re.M):
        categories.setdefault(name, int(value))
    device = max(int(v) for v in re.findall(r"^  total on device +(\d+) bytes", text, re.M))
    fits = ": NO" not in text and "fits " in text
    step = re.search(r"predicted step: ([0-9.]+) ms, ([0-9]+) tokens/s, MFU ([0-9.]+)% \((.*)\)", text)
    terms = dict((k, float(v)) for v, k in ((m.group(2), m.group(1)) for m in re.finditer(r"(\w+) ([0-9.]+) ms", step.group(4))))
    return categories, device, fits, int(step.group(2)), float(step.group(3)), terms


def memory_table():
    lines = ["| figure | model | llm5d layout | s | Playbook: params + grads + moments (GiB) | --plan: the same | "
             "--plan: + fp32 master | Playbook activations (GiB) | --plan activations | --plan on the device |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in read_tsv("published_playbook_memory.tsv"):
        s = int(r["seq"])
        world, *flags = r["layout"].split()
        # a pipeline keeps as many micro-batches in flight on its first stage as it has stages (the Playbook's
        # "PP × activs/PP"): a step of that many
        if "--pp" in flags:
            flags += ["-d", str(int(flags[flags.index("--pp") + 1]) * s)]
        # under sp llm5d keeps the norms' outputs whole for backward; -r 2 gathers them again instead, as the
        # Playbook's count (everything divided by tp) assumes: both
        for extra in ([], ["-r", "2"]) if "--sp 1" in r["layout"] else ([],):
            cats, device, fits, *_ = plan(["-e", MEMORY_MODELS[r["model"]].format(s=s), "-t", str(s), "-b", "1",
                                           "--world", world] + flags + extra)
            states = sum(cats[k] for k in ("params", "grads", "optimizer state"))
            playbook = sum(float(r[k]) for k in ("params", "grads", "optimizer"))
            layout = f"{world} ranks {' '.join(flags + extra)}".strip()
            lines.append(f"| {r['figure']} | {r['model']} | {layout} | {s} | {playbook:.2f} | {states / GIB:.2f} | "
                         f"{(states + cats['master weights']) / GIB:.2f} | {float(r['activations']):.2f} | "
                         f"{cats['activations'] / GIB:.2f} | {device / GIB:.1f}{'' if fits else ' (does not fit)'} |")
    return "\n".join(lines)


def bench_flags(model, dp, tp, pp, mbs, accumulation, zero):
    return ["-e", BENCH_MODELS[model], "-t", str(SEQ), "-b", str(mbs), "-d", str(dp * mbs * accumulation * SEQ),
            "--world", str(GPUS), "--tp", str(tp), "--sp", "1" if tp > 1 else "0", "--pp", str(pp),
            "--pp-schedule", "1f1b", "-z", str(zero), "-r", "0"]


def terms_text(terms):
    return ", ".join(f"{k} {terms[k]:.0f}" for k in TERMS if terms.get(k, 0) >= 0.5)


def bench_tables():
    runs = read_tsv("published_playbook.tsv")
    per_model = ["| model | runs that ran | rank correlation, predicted vs measured tok/s/GPU | median predicted / measured "
                 "tok/s/GPU | median measured memory (GB) / predicted (GiB) | ran, and --plan fits | crashed or out of "
                 "memory, and --plan does not fit |", "|---|---|---|---|---|---|---|"]
    best = ["| model | layout | source | measured tok/s/GPU, MFU | predicted tok/s/GPU, MFU | predicted memory (GiB) | "
            "predicted step terms (ms) |", "|---|---|---|---|---|---|---|"]
    for model in BENCH_MODELS:
        ran, failed, predicted, measured, memory, fit_ran, unfit_failed = [], 0, [], [], [], 0, 0
        for r in runs:
            if r["model"] != model:
                continue
            layout = tuple(int(r[k]) for k in ("dp", "tp", "pp", "mbs", "grad_acc", "zero"))
            _, device, fits, tokens, mfu, terms = plan(bench_flags(model, *layout))
            if r["tok_s_gpu"] == "-":
                failed += 1
                unfit_failed += not fits
                continue
            fit_ran += fits
            ran.append((float(r["mfu_percent"]), float(r["tok_s_gpu"]), layout, tokens / GPUS, mfu, device, terms))
            predicted.append(tokens / GPUS)
            measured.append(float(r["tok_s_gpu"]))
            memory.append(float(r["gpu_mem_gb"]) / (device / GIB))
        if not ran:
            per_model.append(f"| {model} | 0 | - | - | - | - | {unfit_failed} of {failed} |")
        else:
            ratio = statistics.median(p / m for p, m in zip(predicted, measured))
            per_model.append(f"| {model} | {len(ran)} | {spearman(predicted, measured):.2f} | {ratio:.2f} | "
                             f"{statistics.median(memory):.2f} | {fit_ran} of {len(ran)} | {unfit_failed} of {failed} |")
        # the Playbook's best run (by its MFU, as its heatmap picks) and by tokens/s, and --search's first choice
        shown = []
        for key, source in ((0, "Playbook's best by MFU"), (1, "Playbook's best by tok/s")):
            if not ran:
                break
            top = max(ran, key=lambda x: x[key])
            if top in shown:
                best[-1] = best[-1].replace("best by MFU", "best by MFU and tok/s")
                continue
            shown.append(top)
            mfu_p, tok_p, (dp, tp, pp, mbs, acc, zero), tok, mfu, device, terms = top
            best.append(f"| {model} | dp {dp} tp {tp} pp {pp}, mbs {mbs} × {acc}, ZeRO-{zero} | {source} | "
                        f"{tok_p:,.0f}, {mfu_p:.1f}% | {tok:,.0f}, {mfu:.1f}% | {device / GIB:.1f} | {terms_text(terms)} |")
        text = train_gpt(["-e", BENCH_MODELS[model], "-t", str(SEQ), "-d", str(256 * SEQ), "--search", "--gpus",
                          str(GPUS)])
        first = re.search(r"^ +1 +([0-9.]+) +([0-9]+) +([0-9.]+)% +mpirun -np \d+ \./train_gpt -e \S+ -t \d+ -d \d+ (.*)$",
                          text, re.M)
        if not first:
            best.append(f"| {model} | - | --search: no layout of {GPUS} GPUs fits | - | - | - | - |")
            continue
        flags = first.group(4).split()
        _, device, fits, tokens, mfu, terms = plan(["-e", BENCH_MODELS[model], "-t", str(SEQ), "-d", str(256 * SEQ),
                                                    "--world", str(GPUS)] + flags)
        best.append(f"| {model} | `{first.group(4)}` | --search's first | - | {tokens / GPUS:,.0f}, {mfu:.1f}% | "
                    f"{device / GIB:.1f} | {terms_text(terms)} |")
    return "\n".join(per_model) + "\n\n" + "\n".join(best)


def main():
    markdown = sys.argv[sys.argv.index("--markdown") + 1] if "--markdown" in sys.argv else None
    text = memory_table() + "\n\n" + bench_tables()
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
