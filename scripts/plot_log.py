#!/usr/bin/python3
"""Plots the loss curves of one or more train_gpt runs into a PNG: train loss (line) and validation loss (dots
joined by a dashed line) against the step, one colour per run, with a legend. Reads the main.log files that
`train_gpt -o DIR` writes (lines `s:STEP trl:LOSS lr:LR norm:NORM` and `s:STEP tel:LOSS`); where a step appears
twice (a log concatenated by hand, or written before resumed runs cut theirs back), the last value is plotted.

    scripts/plot_log.py build/demo/main.log                       # writes build/demo/loss.png
    scripts/plot_log.py runA/main.log runB/main.log -o cmp.png --labels "b=8,b=16"

Needs Matplotlib (Debian's python3-matplotlib, which scripts/install_deps.sh installs).
"""
import argparse
import os
import sys


def read_log(path):
    """The train and validation losses of one main.log, each a sorted list of (step, loss)."""
    curves = {"trl": {}, "tel": {}}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = dict(field.split(":", 1) for field in line.split() if ":" in field)
            kinds = [k for k in curves if k in fields]
            if "s" not in fields or len(kinds) != 1:
                sys.exit(f"plot_log.py: {path}:{number}: not a main.log line: {line.rstrip()!r}")
            try:
                curves[kinds[0]][int(fields["s"])] = float(fields[kinds[0]])
            except ValueError:
                sys.exit(f"plot_log.py: {path}:{number}: bad step or loss: {line.rstrip()!r}")
    if not curves["trl"] and not curves["tel"]:
        sys.exit(f"plot_log.py: {path}: no loss lines")
    return {kind: sorted(points.items()) for kind, points in curves.items()}


def run_label(path):
    """A run's name in the legend: the directory that holds its main.log."""
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def main():
    parser = argparse.ArgumentParser(description="Plot train and validation loss of train_gpt main.log files.")
    parser.add_argument("logs", nargs="+", help="main.log files, one per run")
    parser.add_argument("-o", "--out", help="the PNG to write (default: loss.png beside the first log)")
    parser.add_argument("--labels", help="comma-separated legend names, one per log (default: the logs' directories)")
    parser.add_argument("--title", default="train_gpt loss", help="the plot's title")
    args = parser.parse_args()

    labels = args.labels.split(",") if args.labels else [run_label(p) for p in args.logs]
    if len(labels) != len(args.logs):
        sys.exit(f"plot_log.py: --labels names {len(labels)} runs, but {len(args.logs)} logs are given")
    out = args.out or os.path.join(os.path.dirname(args.logs[0]), "loss.png")
    runs = [read_log(p) for p in args.logs]

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (run, label) in enumerate(zip(runs, labels)):
        colour = colours[i % len(colours)]
        if run["trl"]:
            steps, losses = zip(*run["trl"])
            ax.plot(steps, losses, color=colour, linewidth=1.2, label=f"{label} train")
        if run["tel"]:
            steps, losses = zip(*run["tel"])
            ax.plot(steps, losses, color=colour, linestyle="--", marker="o", markersize=4, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.set_title(args.title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    print(f"plot_log.py: wrote {out} ({len(runs)} run{'s' if len(runs) != 1 else ''})")


if __name__ == "__main__":
    main()
