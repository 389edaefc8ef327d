#!/usr/bin/python3
"""Draws the pipeline of one training step from the trace `train_gpt --pp N --trace FILE` writes, in the style of
the Ultra-Scale Playbook's schedule diagrams: one row per rank (stage), time to the right, each forward (blue),
backward (green) and weight-gradient step (orange) a box numbered with its micro-batch, a chunk's boxes shaded
lighter for later virtual stages, the exchanges with the neighbours as thin grey bars, and idle time left blank.
The title gives the schedule and its bubble: the ranks' idle time over their compute time, the Playbook's measure
(the schedules' formulas, (p-1)/m for 1F1B, are this ratio).

    scripts/plot_pipeline.py build/pp/trace.json                  # writes build/pp/trace.png
    scripts/plot_pipeline.py trace.json -o 1f1b.png --title "1F1B, 4 stages"

The trace is a Chrome trace (chrome://tracing and ui.perfetto.dev open it too) with one process per rank: "pid"
the rank, its process_name metadata naming the row. Drawn are the complete events ("ph": "X") of the pipeline's
actions, "cat" forward, backward, weight or p2p, on each rank's compute thread (tid 0); the ops nested in them
(cat compute, optimizer, other, span) and the communication thread (tid 1: dp, tp, cp, pp, ep) are not.
Needs Matplotlib (Debian's python3-matplotlib, which scripts/install_deps.sh installs).
"""
import argparse
import json
import os
import sys

COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "weight": "#dd8452"}
ACTIONS = (*COLOURS, "p2p")  # the pipeline's actions: the events drawn


def read_trace(path):
    """The trace's pipeline actions by rank, each (category, micro-batch, chunk, start ms, end ms), the rows' names
    and the schedule's name."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"plot_pipeline.py: {path}: {e}")
    # the Chrome trace format's two forms: an object holding "traceEvents", or the bare array of events
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        sys.exit(f"plot_pipeline.py: {path}: not a Chrome trace (an array of events, or an object with traceEvents)")
    rows, names = {}, {}
    for event in events:
        rank = event.get("pid")
        if event.get("ph") == "M" and event.get("name") == "process_name":
            names[rank] = event.get("args", {}).get("name", f"rank {rank}")
        elif event.get("ph") == "X" and event.get("cat") in ACTIONS:
            if not all(isinstance(event.get(k), (int, float)) for k in ("ts", "dur")):
                sys.exit(f"plot_pipeline.py: {path}: a {event['cat']} event without a numeric ts and dur: {event}")
            args = event.get("args", {})
            start = event["ts"] / 1000.0
            rows.setdefault(rank, []).append(
                (event["cat"], args.get("micro", 0), args.get("chunk", 0), start, start + event["dur"] / 1000.0))
    if not rows:
        sys.exit(f"plot_pipeline.py: {path}: no pipeline actions (was it a run with --pp > 1?)")
    schedule = trace.get("otherData", {}).get("schedule", "") if isinstance(trace, dict) else ""
    return rows, names, schedule


def bubble(rows):
    """The ranks' idle time in the step over their compute time."""
    span = max(e[4] for events in rows.values() for e in events) - min(e[3] for events in rows.values() for e in events)
    busy = sum(e[4] - e[3] for events in rows.values() for e in events if e[0] in COLOURS)
    return (span * len(rows) - busy) / busy if busy > 0 else 0.0


def main():
    parser = argparse.ArgumentParser(description="Draw a train_gpt pipeline trace as a schedule diagram.")
    parser.add_argument("trace", help="the JSON file train_gpt --trace wrote")
    parser.add_argument("-o", "--out", help="the PNG to write (default: the trace's name with .png)")
    parser.add_argument("--title", help="the plot's title (default: the schedule and its bubble)")
    args = parser.parse_args()
    rows, names, schedule = read_trace(args.trace)
    out = args.out or os.path.splitext(args.trace)[0] + ".png"

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    ranks = sorted(rows)
    start = min(e[3] for events in rows.values() for e in events)
    end = max(e[4] for events in rows.values() for e in events)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.5), dpi=100)
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row  # rank 0 on top
        for category, micro, chunk, t0, t1 in rows[rank]:
            if category not in COLOURS:  # an exchange: a thin bar under the row
                ax.barh(y - 0.38, t1 - t0, left=t0 - start, height=0.08, color="#999999")
                continue
            r, g, b = to_rgb(COLOURS[category])
            light = 0.35 * chunk / (chunk + 1)  # later chunks lighter
            colour = (r + (1 - r) * light, g + (1 - g) * light, b + (1 - b) * light)
            ax.barh(y, t1 - t0, left=t0 - start, height=0.7, color=colour, edgecolor="white", linewidth=0.5)
            ax.text((t0 + t1) / 2 - start, y, str(micro), ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([names.get(r, f"rank {r}") for r in reversed(ranks)])
    ax.set_xlim(0, end - start)
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(args.title or f"{schedule or 'pipeline'}: bubble {bubble(rows):.2f} (idle time over compute time)",
                 loc="left")
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()] + [Patch(color="#999999", label="exchange")]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    print(f"plot_pipeline.py: wrote {out} ({len(ranks)} ranks)")


if __name__ == "__main__":
    main()
