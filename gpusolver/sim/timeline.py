"""A simulated layer's timeline as a PNG: per rank, Gantt rows of compute and of each link side."""
from __future__ import annotations

from gpusolver.sim.layer import LayerTime

LANES = ("compute", "nvlink send", "nvlink recv", "ib send", "ib recv")
_KIND_COLOURS = {"stage 0": "#2b8cbe", "stage": "#08519c", "ring step": "#08519c", "qo": "#e6550d",
                 "kv": "#31a354", "o": "#fd8d3c", "dq": "#fd8d3c", "dkv": "#74c476", "a2a": "#9e9ac8"}


def _colour(label: str) -> str:
    for key in ("stage 0", "ring step", "stage", "dkv", "dq", "qo", "kv", "a2a"):
        if key in label:
            return _KIND_COLOURS[key]
    return _KIND_COLOURS["o"] if label.endswith(".o") else "#969696"


def draw_timeline(layer: LayerTime, path, *, title: str = "", max_ranks: int = 16) -> None:
    """Write ``layer``'s forward and backward timelines to ``path`` (PNG), the first ``max_ranks`` ranks.

    Rows per rank: compute, NVLink send / receive, InfiniBand send / receive (a NIC's bars on each
    GPU that uses it). Times are simulated, in ms from the start of each pass. A red line traces each
    pass's critical path (``PassTime.critical``): compute on the rank's compute row, a transfer on
    its destination's receive row, a latency dotted on the later poster's compute row.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    P = len(layer.fwd.pair_bytes)
    ranks = min(P, max_ranks)
    fig, axes = plt.subplots(1, 2, figsize=(15, 1.2 + 0.9 * ranks), sharey=True,
                             gridspec_kw={"width_ratios": [max(layer.fwd_ms, 1e-9), max(layer.bwd_ms, 1e-9)]})
    for ax, (name, pt) in zip(axes, (("forward", layer.fwd), ("backward", layer.bwd))):
        for iv in pt.timeline:
            if iv.rank >= ranks or iv.lane not in LANES and not iv.lane.startswith("compute"):
                continue
            lane = LANES.index(iv.lane) if iv.lane in LANES else 0
            y = iv.rank * (len(LANES) + 1) + lane
            ax.barh(y, (iv.end - iv.start) * 1e3, left=iv.start * 1e3, height=0.8, color=_colour(iv.label),
                    edgecolor="none")
        for seg in pt.critical:
            if not 0 <= seg.rank < ranks:
                continue
            lane = LANES.index(f"{seg.link} recv") if seg.kind == "transfer" and seg.link else 0
            y = seg.rank * (len(LANES) + 1) + lane
            ax.plot([seg.start * 1e3, seg.end * 1e3], [y, y], color="#d62728", linewidth=1.6,
                    linestyle=":" if seg.kind == "latency" else "-")
        ax.set_title(f"{name}: {pt.ms:.2f} ms simulated (ideal {pt.ideal_ms:.2f})", fontsize=10)
        ax.set_xlabel("ms (simulated)")
        ax.grid(axis="x", alpha=0.3)
    ticks = [r * (len(LANES) + 1) + k for r in range(ranks) for k in range(len(LANES))]
    labels = [f"r{r} {lane}" if k == 0 else lane for r in range(ranks) for k, lane in enumerate(LANES)]
    axes[0].set_yticks(ticks, labels, fontsize=6)
    axes[0].invert_yaxis()
    names = {"stage 0": "stage 0", "stage": "remote stage / ring step", "qo": "Q (dO) cast", "kv": "K, V cast",
             "o": "O / dQ back", "dkv": "dK, dV back", "a2a": "Ulysses all-to-all"}
    legend = [Patch(color=_KIND_COLOURS[k], label=v) for k, v in names.items()]
    legend.append(Patch(color="#d62728", label="critical path"))
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8)
    shown = "" if ranks == P else f" (first {ranks} of {P} ranks)"
    fig.suptitle((title or "layer timeline") + shown + " — simulated, not measured", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
