#!/usr/bin/python3
"""Draws where the time of one training step went, from the profile `train_gpt --profile FILE` writes: for each
component of the step (compute, the dp, tp, cp, pp and ep communication, the pipeline bubble, the optimizer and
the rest) the milliseconds measured beside the ones the hardware profile predicts, so that the component the model
gets wrong stands out. The prediction is its critical stage's, so with several ranks the measured bars are the rank
with the most compute (a pipeline's busiest stage; otherwise ranks differ little). Measured communication is the
exposed part, the step's time starting it and waiting for it; the part that ran behind compute is stacked on it,
hatched. Components that are zero throughout are left out. With several
ranks a second panel stacks each rank's measured components into one bar, which shows a pipeline's stages
differing (the last stage's loss, the first one's bubble).

    scripts/plot_profile.py build/profile.json                    # writes build/profile_components.png
    scripts/plot_profile.py profile.json -o step.png --title "d12 on 8 GPUs"

The profile is a JSON object; this reads "step", "device", "layout", "step_ms" and "components": "measured" (ms
by component, adding up to step_ms), "hidden" (ms of communication behind compute) and "predicted" (ms by
component and "step", or null without a hardware profile); and where present "ranks", each with "rank", "step_ms"
and "components": {"measured", "hidden"}.
Needs Matplotlib (Debian's python3-matplotlib, which scripts/install_deps.sh installs).
"""
import argparse
import os
import sys

from profile_file import read_profile_file

COMPONENTS = {"compute": "#4c72b0", "dp": "#55a868", "tp": "#c44e52", "cp": "#8172b3", "pp": "#937860",
              "ep": "#da8bc3", "bubble": "#cccccc", "optimizer": "#dd8452", "other": "#8c8c8c"}
MEASURED, PREDICTED = "#4c72b0", "#dd8452"


def by_component(ms):
    """ms by component, 0 for one the file leaves out ("hidden" names only communication, "predicted" no "other")."""
    return {name: float(ms.get(name, 0.0)) for name in COMPONENTS}


def read_profile(path):
    """The profile's title fields (step, device, layout, step ms), its measured, hidden and predicted ms by
    component (predicted: the ones it names and "step"; None without a hardware profile) and the ranks as (rank,
    step ms, measured ms by component, hidden ms by component)."""

    def extract(profile):
        components = profile["components"]
        predicted = components["predicted"]
        if predicted is not None:  # only the components it names are drawn: it has no "other"
            step_predicted = float(predicted["step"])
            predicted = dict({c: float(ms) for c, ms in predicted.items() if c in COMPONENTS}, step=step_predicted)
        ranks = [(r["rank"], float(r["step_ms"]), by_component(r["components"]["measured"]),
                  by_component(r["components"]["hidden"])) for r in profile.get("ranks", [])]
        return ((profile["step"], profile["device"], profile["layout"], float(profile["step_ms"])),
                by_component(components["measured"]), by_component(components["hidden"]), predicted, ranks)

    return read_profile_file("plot_profile.py", path, extract)


def main():
    parser = argparse.ArgumentParser(description="Draw the measured and predicted components of a train_gpt step.")
    parser.add_argument("profile", help="the JSON file train_gpt --profile wrote")
    parser.add_argument("-o", "--out", help="the PNG to write (default: the profile's name with _components.png)")
    parser.add_argument("--title", help="the plot's title (default: the step, device, layout and both step times)")
    args = parser.parse_args()
    (step, device, layout, step_ms), measured, hidden, predicted, ranks = read_profile(args.profile)
    out = args.out or os.path.splitext(args.profile)[0] + "_components.png"

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    who = "rank 0"
    if len(ranks) > 1:  # the busiest rank, as the prediction is the critical stage's
        busiest = max(ranks, key=lambda r: r[2]["compute"])
        who, measured, hidden = f"rank {busiest[0]}, the most compute", busiest[2], busiest[3]
    shown = [c for c in COMPONENTS if measured[c] or hidden[c] or (predicted and predicted.get(c))]
    if len(ranks) > 1:  # the components above, the ranks in a panel below
        fig, (ax, ax_ranks) = plt.subplots(2, 1, figsize=(10, 7.5 + 0.3 * len(ranks)), dpi=100,
                                           gridspec_kw={"height_ratios": [3, 1 + 0.15 * len(ranks)]})
    else:
        fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    width = 0.4 if predicted else 0.6
    for x, c in enumerate(shown):
        left = x - width / 2 if predicted else x
        ax.bar(left, measured[c], width, color=MEASURED)
        if hidden[c]:  # communication that overlapped compute: drawn, but not part of the step time
            ax.bar(left, hidden[c], width, bottom=measured[c], color="white", edgecolor=MEASURED, hatch="//")
        label = f"{measured[c]:.1f}+{hidden[c]:.1f}" if hidden[c] else f"{measured[c]:.1f}"
        ax.text(left, measured[c] + hidden[c], label, ha="center", va="bottom", fontsize=8)
        if predicted and c in predicted:
            ax.bar(x + width / 2, predicted[c], width, color=PREDICTED)
            ax.text(x + width / 2, predicted[c], f"{predicted[c]:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels(shown)
    ax.set_ylabel("ms in the step")
    ax.grid(True, axis="y", alpha=0.3)
    handles = [Patch(color=MEASURED, label=f"measured (exposed), {who}")]
    if any(hidden[c] for c in shown):
        handles.append(Patch(facecolor="white", edgecolor=MEASURED, hatch="//", label="hidden behind compute"))
    if predicted:
        handles.append(Patch(color=PREDICTED, label="predicted"))
    ax.legend(handles=handles, fontsize=8)
    prediction = f"predicted {predicted['step']:.1f} ms" if predicted else "no prediction (no hardware profile)"
    ax.set_title(args.title or f"step {step} on {device} ({layout}): measured {step_ms:.1f} ms, {prediction}",
                 loc="left", fontsize=10)

    if len(ranks) > 1:
        ranks.sort(key=lambda r: r[0])
        rank_shown = [c for c in COMPONENTS if any(by_name[c] for _, _, by_name, _ in ranks)]
        for row, (rank, rank_ms, by_name, _) in enumerate(ranks):
            y = len(ranks) - 1 - row  # rank 0 on top
            left = 0.0
            for c in rank_shown:
                ax_ranks.barh(y, by_name[c], left=left, height=0.7, color=COMPONENTS[c])
                left += by_name[c]
            ax_ranks.text(left, y, f" {rank_ms:.1f} ms", va="center", fontsize=8)
        ax_ranks.set_yticks(range(len(ranks)))
        ax_ranks.set_yticklabels([f"rank {rank}" for rank, _, _, _ in reversed(ranks)])
        ax_ranks.set_xlim(0, 1.12 * max(max(sum(b.values()), r_ms) for _, r_ms, b, _ in ranks) or 1)
        ax_ranks.set_xlabel("measured ms in the step, by rank")
        ax_ranks.legend(handles=[Patch(color=COMPONENTS[c], label=c) for c in rank_shown], loc="lower right",
                        bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=len(rank_shown), frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    print(f"plot_profile.py: wrote {out} ({len(shown)} components, {max(len(ranks), 1)} rank(s))")


if __name__ == "__main__":
    main()
