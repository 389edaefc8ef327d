#!/usr/bin/python3
"""Checks a `train_gpt --profile FILE` run for dev/gpu/verify.sh's profile phase: prints nothing when every check
holds, else what failed, in parentheses on one line (verify.sh's convention), and always exits 0.

    train_gpt ... -x 8 --profile p.json | dev/gpu/check_profile.py p.json --kernels --overhead 0.02 --bubble

The checks, on every rank's figures the file holds:
  - the ops add up to the step within 15% (the unattributed time), and the components to the step;
  - the live memory's peak stays within the plan, and the activations are all released at the step's end;
  --kernels   CUPTI's kernel table is there (the GPU path), with the step's launches;
  --overhead F  the profiled step took at most 1 + F times the median of the steps after it (from the run's step
              lines on stdin): the profile's own cost;
  --bubble    some rank measured a pipeline bubble.
"""
import argparse
import json
import re
import statistics
import sys


def problems(profile, args, step_lines):
    found = []
    ranks = profile.get("ranks") or [profile]
    for r in ranks:
        name = f"rank {r.get('rank', 0)}"
        step, unattributed = r["step_ms"], r["unattributed_ms"]
        if abs(unattributed) > 0.15 * step:
            found.append(f"{name}: {unattributed:.3f} of {step:.3f} ms unattributed")
        parts = sum(r["components"]["measured"].values())
        if abs(parts - step) > 1e-6 * step:
            found.append(f"{name}: components {parts:.3f} ms, step {step:.3f} ms")
        memory = r["memory"]
        planned = memory.get("planned_total", memory.get("planned", {}).get("total"))
        if memory["peak_live"] > planned:
            found.append(f"{name}: live peak {memory['peak_live']:.0f} bytes over the plan's {planned:.0f}")
    timeline = profile["memory"]["timeline"]
    if timeline[-1]["activations"] != 0:
        found.append(f"{timeline[-1]['activations']:.0f} activation bytes live at the step's end")
    if args.kernels and not profile.get("kernels"):
        found.append("no kernel table (CUPTI)")
    if args.bubble and max(r["components"]["measured"]["bubble"] for r in ranks) <= 0:
        found.append("no bubble measured")
    if args.overhead is not None:
        times = {int(m.group(1)): float(m.group(2)) for m in
                 (re.match(r"^step +(\d+)/\d+ .*\| ([0-9.]+) ms \|", line) for line in step_lines) if m}
        profiled = profile["step"]
        after = [ms for s, ms in times.items() if s > profiled]
        if profiled not in times or not after:
            found.append("no step lines after the profiled step")
        else:
            ratio = times[profiled] / statistics.median(after)
            if ratio > 1 + args.overhead:
                found.append(f"profiled step {times[profiled]:.2f} ms, {ratio:.3f}x the median of the later steps")
    return found


def main():
    parser = argparse.ArgumentParser(description="Check a train_gpt --profile file.")
    parser.add_argument("profile")
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--overhead", type=float)
    parser.add_argument("--bubble", action="store_true")
    args = parser.parse_args()
    try:
        with open(args.profile) as f:
            profile = json.load(f)
        found = problems(profile, args, sys.stdin.read().splitlines() if args.overhead is not None else [])
    except (OSError, ValueError, KeyError, TypeError) as e:
        found = [f"{args.profile}: {e!r}"]
    if found:
        print("(" + "; ".join(found) + ")")


if __name__ == "__main__":
    main()
