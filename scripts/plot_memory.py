#!/usr/bin/python3
"""Draws the memory of one training step from the profile `train_gpt --profile FILE` writes, as the Ultra-Scale
Playbook draws it: the bytes live on rank 0 (MiB) against the time in the step (ms), a stacked area whose bottom
bands are the states that stay for the whole step (parameters, master weights where there are any, gradients,
optimizer state, and comm buffers plus scratch as "other") and whose top is the live activations, rising through
the forward and falling through the backward; the plan's total (`--plan`) is a dashed line, so that the picture
shows how close the step came to what was planned for it. The phases (forward, backward, optimizer) are shaded.

    scripts/plot_memory.py build/profile.json                     # writes build/profile_memory.png
    scripts/plot_memory.py profile.json -o memory.png --title "d12, ZeRO-1"

The profile is a JSON object; this reads "step" and "memory": "planned" (bytes by category, with "total"),
"timeline" (points {"ms", "activations" (live bytes), "phase"}, the live bytes holding until the next point) and
"peak_live" (bytes: the fixed states plus the most activations live at once).
Needs Matplotlib (Debian's python3-matplotlib, which scripts/install_deps.sh installs).
"""
import argparse
import os
import sys

from profile_file import read_profile_file

MIB = 2**20
# the fixed states from the bottom up; every other planned category but activations and total goes into "other"
BANDS = {"params": "#4c72b0", "master weights": "#8172b3", "grads": "#55a868", "optimizer state": "#dd8452"}
OTHER_COLOUR, ACTIVATIONS_COLOUR = "#999999", "#c44e52"
PHASE_COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "weight gradients": "#937860", "optimizer step": "#dd8452"}


def read_profile(path):
    """The profile's step, its fixed states as (name, MiB) from the bottom band up, the planned total (MiB), the
    peak of live memory (MiB) and the timeline as (ms, activation MiB, phase)."""

    def extract(profile):
        memory = profile["memory"]
        planned = {name: float(size) / MIB for name, size in memory["planned"].items()}
        bands = [(name, planned[name]) for name in BANDS if name != "master weights" or planned.get(name, 0) > 0]
        other = [name for name in planned if name not in BANDS and name not in ("activations", "total")]
        bands.append(("other (" + ", ".join(other) + ")" if other else "other", sum(planned[n] for n in other)))
        timeline = [(float(p["ms"]), float(p["activations"]) / MIB, str(p["phase"])) for p in memory["timeline"]]
        return profile["step"], bands, planned["total"], float(memory["peak_live"]) / MIB, timeline

    return read_profile_file("plot_memory.py", path, extract)


def phase_runs(timeline):
    """The contiguous runs of one phase as (phase, start ms, end ms); a run ends where the next one starts."""
    runs = []
    for ms, _, phase in timeline:
        if runs and runs[-1][0] == phase:
            continue
        if runs:
            runs[-1][2] = ms
        runs.append([phase, ms, ms])
    runs[-1][2] = timeline[-1][0]
    return runs


def main():
    parser = argparse.ArgumentParser(description="Draw the memory of a train_gpt --profile step over time.")
    parser.add_argument("profile", help="the JSON file train_gpt --profile wrote")
    parser.add_argument("-o", "--out", help="the PNG to write (default: the profile's name with _memory.png)")
    parser.add_argument("--title", help="the plot's title (default: the step, its peak and the planned total)")
    args = parser.parse_args()
    step, bands, planned_total, peak_live, timeline = read_profile(args.profile)
    if not timeline:
        sys.exit(f"plot_memory.py: {args.profile}: the memory timeline is empty")
    timeline.sort(key=lambda point: point[0])
    out = args.out or os.path.splitext(args.profile)[0] + "_memory.png"

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    times = [ms for ms, _, _ in timeline]
    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    bottom = 0.0
    for name, size in bands:
        if size > 0:
            ax.fill_between([times[0], times[-1]], bottom, bottom + size, color=BANDS.get(name, OTHER_COLOUR),
                            linewidth=0, label=f"{name} {size:.1f} MiB")
            bottom += size
    activations = [bottom + mib for _, mib, _ in timeline]
    # step="post": the bytes of a point stay live until the next point
    ax.fill_between(times, bottom, activations, step="post", color=ACTIVATIONS_COLOUR, linewidth=0,
                    label=f"activations (peak {max(mib for _, mib, _ in timeline):.1f} MiB)")
    ax.axhline(planned_total, color="black", linestyle="--", linewidth=1)
    ax.text(times[0], planned_total, f" planned {planned_total:.1f} MiB", va="bottom", fontsize=8)
    top = 1.15 * max(planned_total, peak_live, max(activations))  # room for the phase names above the area
    for phase, t0, t1 in phase_runs(timeline):
        ax.axvspan(t0, t1, color=PHASE_COLOURS.get(phase, "#cccccc"), alpha=0.08, linewidth=0, zorder=0)  # behind
        ax.text((t0 + t1) / 2, 0.98, phase, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=8)
        ax.axvline(t0, color="#666666", linewidth=0.5, linestyle=":")
    ax.set_xlim(times[0], times[-1] if times[-1] > times[0] else times[0] + 1)
    ax.set_ylim(0, top if top > 0 else 1)
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel("live memory on rank 0 (MiB)")
    ax.set_title(args.title or f"step {step}: peak {peak_live:.1f} MiB of {planned_total:.1f} MiB planned", loc="left")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    print(f"plot_memory.py: wrote {out} ({len(timeline)} points)")


if __name__ == "__main__":
    main()
