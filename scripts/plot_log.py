#!/usr/bin/python3
"""Plots the curves of one or more train_gpt runs into a PNG against the step, one colour per run, with legends:
train loss (a line, with an 'x' on each step whose update was skipped; a non-finite loss leaves a gap) and
validation loss (dots joined by a dashed line); when any log has multiple-choice eval results (e.g. HellaSwag),
their accuracy in a second panel below. Reads the main.log files that `train_gpt -o DIR` writes: lines
`s:STEP trl:LOSS lr:LR norm:NORM [aux:X] [skipped:1 ...]`, `s:STEP tel:LOSS` and `s:STEP eval:ACC`; expert load
lines (`s:STEP load:...`) are not drawn. Where a step appears twice (a log concatenated by hand, or written before
resumed runs cut theirs back), the last value is plotted.

    scripts/plot_log.py build/demo/main.log                       # writes build/demo/loss.png
    scripts/plot_log.py runA/main.log runB/main.log -o cmp.png --labels "b=8,b=16"

Needs Matplotlib (Debian's python3-matplotlib, which scripts/install_deps.sh installs).
"""
import argparse
import os
import sys

KINDS = ("trl", "tel", "eval")  # train loss, validation loss, eval accuracy: one of them on each line drawn


def read_log(path):
    """The curves of one main.log, each a sorted list of (step, value): train and validation loss, eval accuracy,
    and "skipped", the (step, train loss) of the steps whose update was skipped."""
    curves, skipped = {kind: {} for kind in KINDS}, {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = dict(field.split(":", 1) for field in line.split() if ":" in field)
            kinds = [k for k in KINDS if k in fields]
            if "s" in fields and "load" in fields and not kinds:
                continue  # an expert load line
            if "s" not in fields or len(kinds) != 1:
                sys.exit(f"plot_log.py: {path}:{number}: not a main.log line: {line.rstrip()!r}")
            try:
                step = int(fields["s"])
                curves[kinds[0]][step] = float(fields[kinds[0]])
            except ValueError:
                sys.exit(f"plot_log.py: {path}:{number}: bad step or value: {line.rstrip()!r}")
            if kinds[0] == "trl":
                skipped[step] = fields.get("skipped") == "1"
    if not any(curves.values()):
        sys.exit(f"plot_log.py: {path}: no loss or eval lines")
    run = {kind: sorted(points.items()) for kind, points in curves.items()}
    run["skipped"] = [(step, loss) for step, loss in run["trl"] if skipped[step]]
    return run


def run_label(path):
    """A run's name in the legend: the directory that holds its main.log."""
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def main():
    parser = argparse.ArgumentParser(description="Plot the losses and eval accuracy of train_gpt main.log files.")
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

    if any(run["eval"] for run in runs):  # losses above, eval accuracy in a shorter panel below, steps shared
        fig, (ax, ax_eval) = plt.subplots(2, 1, figsize=(8, 7), dpi=100, sharex=True,
                                          gridspec_kw={"height_ratios": [2, 1]})
    else:
        fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
        ax_eval = None
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (run, label) in enumerate(zip(runs, labels)):
        colour = colours[i % len(colours)]
        if run["trl"]:
            ax.plot(*zip(*run["trl"]), color=colour, linewidth=1.2, label=f"{label} train")
        if run["tel"]:
            ax.plot(*zip(*run["tel"]), color=colour, linestyle="--", marker="o", markersize=4, label=f"{label} val")
        if run["eval"]:
            ax_eval.plot(*zip(*run["eval"]), color=colour, marker="s", markersize=4, label=f"{label} eval")
    skipped = [point for run in runs for point in run["skipped"]]
    if skipped:  # every run's marks under one legend entry
        ax.plot(*zip(*skipped), color="black", linestyle="none", marker="x", markersize=7, zorder=3,
                label="skipped update")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.set_title(args.title)
    if ax_eval is not None:
        ax_eval.set_ylabel("eval accuracy")
    for a in fig.axes:
        a.grid(True, alpha=0.3)
        a.legend()
    fig.axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out)
    print(f"plot_log.py: wrote {out} ({len(runs)} run{'s' if len(runs) != 1 else ''})")


if __name__ == "__main__":
    main()
