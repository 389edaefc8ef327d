#!/usr/bin/env python3
"""Where one training step's GPU time goes: reads Nsight Compute's raw CSV of a train_gpt run and prints, for the
last complete step, each kernel's time (summed over its launches) and the time of each phase of the step.

The run is profiled with one metric, each kernel's duration, and train_gpt's NVTX ranges ("forward",
"backward", "layer N" inside them, "optimizer step"):

    ncu --csv --page raw --nvtx --print-units base --metrics gpu__time_duration.sum --log-file prof.csv \\
        ./train_gpt --device cuda -e d12 -b 64 -t 1024 -x 2 -r 0 -v 0 -s 0
    python3 dev/gpu/kernel_breakdown.py prof.csv --step-ms 180.5

A step ends with the kernels of its "optimizer step" range (without NVTX columns in the CSV: with the AdamW
kernels), so the last complete step is the kernels after the previous step's optimizer through the last
optimizer kernel. Nsight Compute runs the kernels one at a time, so the sum is GPU busy time without overlap;
--step-ms (the step's time measured without the profiler) turns it into the share of the step the GPU is busy,
and the rest is launch gaps, host work and the clock: Nsight Compute's kernels run one at a time on a cool GPU,
while a training run holds an H100 at its power limit, where its SM clock falls from 1980 MHz to 1400-1800
(dev/bench/RESULTS.md), so the same kernels take longer in the run than in the profile.
"""

import argparse
import csv
import re
import sys
from collections import defaultdict

TIME_METRIC = "gpu__time_duration.sum"
UNIT_TO_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
              "second": 1e3, "s": 1e3}


def short_name(name):
    """A kernel's name without its parameter list and template arguments: 'adamw_kernel', 'sm90_xmma_gemm...'."""
    name = re.sub(r"\(.*$", "", name.strip())
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    name = "".join(out).strip()
    return name.split()[-1] if name else "?"


def read_rows(path):
    """(kernel name, duration in ms, NVTX text) per launch, in launch order."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not CSV rows
    rows = list(csv.reader(lines))
    if not rows:
        sys.exit(f"kernel_breakdown: {path}: no CSV rows (was ncu run with --csv --page raw?)")
    header = rows[0]
    try:
        name_col, time_col = header.index("Kernel Name"), header.index(TIME_METRIC)
    except ValueError:
        sys.exit(f"kernel_breakdown: {path}: needs the columns 'Kernel Name' and '{TIME_METRIC}'")
    id_col = header.index("ID") if "ID" in header else None
    nvtx_cols = [i for i, h in enumerate(header) if "nvtx" in h.lower() or "push/pop" in h.lower()]
    body = rows[1:]
    scale = 1e-6  # --print-units base: nanoseconds
    if body and id_col is not None and not re.match(r"^\d+$", body[0][id_col]):
        scale = UNIT_TO_MS.get(body[0][time_col].strip(), scale)  # the units row
        body = body[1:]
    launches = []
    for r in body:
        if len(r) <= max(name_col, time_col):
            continue
        try:
            ms = float(r[time_col].replace(",", "")) * scale
        except ValueError:
            continue
        launches.append((short_name(r[name_col]), ms, " ".join(r[i] for i in nvtx_cols)))
    return launches, bool(nvtx_cols)


def phase_of(nvtx):
    if "optimizer step" in nvtx:
        return "optimizer"
    for pass_name in ("backward", "forward"):
        if pass_name in nvtx:
            return pass_name + (" layers" if re.search(r"layer \d+", nvtx) else ", outside the layers")
    return "other (no range)"


def last_step(launches, has_nvtx):
    """The launches of the last complete step, and how the step was found."""
    is_update = (lambda l: "optimizer step" in l[2]) if has_nvtx else (lambda l: "adamw" in l[0].lower())
    ends = [i for i, l in enumerate(launches) if is_update(l)]
    if not ends:
        return launches, "no optimizer kernels found: the whole run"
    last = ends[-1]
    start = last
    while start > 0 and is_update(launches[start - 1]):
        start -= 1
    previous = start - 1
    while previous >= 0 and not is_update(launches[previous]):
        previous -= 1
    how = "NVTX 'optimizer step'" if has_nvtx else "the AdamW kernels (no NVTX columns in the CSV)"
    if previous < 0:
        return launches[: last + 1], f"one step only, delimited by {how} (it includes the first step's set-up)"
    return launches[previous + 1: last + 1], f"the last of several steps, delimited by {how}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("csv", help="ncu --csv --page raw output")
    ap.add_argument("--step-ms", type=float, help="the step's wall-clock time without the profiler")
    ap.add_argument("--top", type=int, default=25, help="kernels listed")
    args = ap.parse_args()

    launches, has_nvtx = read_rows(args.csv)
    if not launches:
        sys.exit(f"kernel_breakdown: {args.csv}: no kernel rows")
    step, how = last_step(launches, has_nvtx)
    total = sum(ms for _, ms, _ in step)
    print(f"kernel time of one step: {total:.3f} ms in {len(step)} launches ({how})")
    if args.step_ms:
        print(f"step time without the profiler: {args.step_ms:.3f} ms: the GPU busy {100 * total / args.step_ms:.1f}% "
              f"of it (the rest: launch gaps, host work, and a clock lower than the profile's)")

    kernels = defaultdict(lambda: [0, 0.0])
    phases = defaultdict(float)
    for name, ms, nvtx in step:
        kernels[name][0] += 1
        kernels[name][1] += ms
        phases[phase_of(nvtx) if has_nvtx else "(no NVTX columns)"] += ms
    print()
    print(f"{'phase':<34} {'ms':>10} {'%':>6}")
    for phase, ms in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"{phase:<34} {ms:10.3f} {100 * ms / total:6.1f}")
    print()
    print(f"{'kernel':<60} {'calls':>6} {'ms':>10} {'%':>6}")
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    for name, (calls, ms) in ranked[: args.top]:
        print(f"{name[:60]:<60} {calls:6d} {ms:10.3f} {100 * ms / total:6.1f}")
    if len(ranked) > args.top:
        rest = sum(ms for _, (_, ms) in ranked[args.top:])
        print(f"{f'({len(ranked) - args.top} more kernels)':<60} {'':6} {rest:10.3f} {100 * rest / total:6.1f}")


if __name__ == "__main__":
    main()
