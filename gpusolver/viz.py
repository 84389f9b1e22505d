"""Pictures of a plan (matplotlib, Agg backend: no display needed).

``draw_plan(plan, config, path)`` writes one PNG:

- top row: the task grid ``assignment[g]`` of each head group (query unit i
  down, key unit j across), each task coloured by the rank that computes it,
  empty tasks white; a dot marks a *local* task (the computing rank hosts both
  its query and its key unit, so it runs in stage 0 with no transfer);
- bottom row: per-rank load (area) with the mean and the balance cap
  ``mu * mean``, then the forward and the backward bytes each rank sends and
  receives, next to USP's (uniform per rank) for the same shapes.

Host-side: it reads the plan's tensors.
"""
from __future__ import annotations

import math
import os

import torch

from gpusolver.baselines import ring_attention, usp
from gpusolver.config import SolverConfig
from gpusolver.plan import Plan, status_names

__all__ = ["draw_plan", "MAX_GROUPS_DRAWN"]

MAX_GROUPS_DRAWN = 4  # more grids than this would shrink each one past reading


def _rank_colours(P: int):
    """A ListedColormap with one colour per rank (qualitative up to 20, then a cyclic map)."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    if P <= 10:
        base = colormaps["tab10"].colors[:P]
    elif P <= 20:
        base = colormaps["tab20"].colors[:P]
    else:
        hsv = colormaps["hsv"]
        base = [hsv(r / P) for r in range(P)]
    return ListedColormap(list(base))


def _scale(values) -> tuple[float, str]:
    """A divisor and unit name for byte values (KiB, MiB or GiB)."""
    top = max([1, *values])
    for div, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if top >= div:
            return float(div), name
    return 1.0, "B"


def _grid(ax, assignment: torch.Tensor, g: int, P: int, tiles: int, cmap) -> None:
    a = assignment[g].long()
    U = a.shape[0]
    img = torch.full((U, U, 4), 1.0)  # white for empty tasks
    live = a >= 0
    colours = torch.tensor([cmap(r) for r in range(P)], dtype=torch.float32)
    img[live] = colours[a[live].clamp(max=P - 1)]
    ax.imshow(img.numpy(), interpolation="nearest")
    host = torch.arange(U) // tiles
    local = live & (a == host[:, None]) & (a == host[None, :])
    ii, jj = local.nonzero(as_tuple=True)
    if ii.numel():
        size = max(2.0, 600.0 / U)  # marker area in points^2: shrinks with the grid
        ax.scatter(jj.numpy(), ii.numpy(), s=size, c="black", marker="o", linewidths=0)
    ax.set_title(f"head group {g}", fontsize=9)
    ax.set_xlabel("key unit j", fontsize=8)
    ax.set_ylabel("query unit i", fontsize=8)
    step = max(1, U // 8)
    ax.set_xticks(range(0, U, step))
    ax.set_yticks(range(0, U, step))
    ax.tick_params(labelsize=7)


def _bars(ax, send, recv, usp_bytes: int, ring_bytes: int, title: str) -> None:
    P = len(send)
    div, unit = _scale([*send, *recv, usp_bytes])
    x = torch.arange(P).float()
    w = 0.28
    ax.bar((x - w).numpy(), [s / div for s in send], w, label="send")
    ax.bar(x.numpy(), [r / div for r in recv], w, label="recv")
    ax.bar((x + w).numpy(), [usp_bytes / div] * P, w, label="USP", color="0.6")
    top = max([usp_bytes, *send, *recv])
    if ring_bytes <= 3 * top:  # ring far off the scale would flatten the bars
        ax.axhline(ring_bytes / div, color="0.3", ls=":", lw=1, label="ring")
        top = max(top, ring_bytes)
    ax.set_ylim(0, 1.45 * top / div)  # headroom for the legend above the bars
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("rank", fontsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.set_xticks(range(0, P, max(1, P // 8)))
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, loc="upper center", ncol=4, framealpha=0.8)


def _rank_legend(fig, ax, P: int, cmap) -> None:
    """A colour bar naming the rank of each colour."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import BoundaryNorm

    norm = BoundaryNorm([r - 0.5 for r in range(P + 1)], P)
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.08, pad=0.04)
    bar.set_ticks(range(0, P, max(1, P // 8)))
    bar.set_label("computing rank", fontsize=8)
    bar.ax.tick_params(labelsize=7)


def draw_plan(plan: Plan, config: SolverConfig, path, *, title: str | None = None, dpi: int = 110) -> str:
    """Write the picture of ``plan`` (solved with ``config``) to ``path`` as a PNG; returns the path.

    plan:   a ``Plan`` (assignment ``[G, U, U]`` int32, metrics, comm); any device.
    config: the ``SolverConfig`` it was solved with (P, heads, D, dtype, mu) for
            USP's and ring's per-rank bytes.
    title:  first line of the figure title (default: P, G and S).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    assignment = plan.assignment.detach().cpu()
    G, U, _ = assignment.shape
    P, c, tiles = plan.comm.cp_size, plan.comm.chunk, plan.comm.tiles
    if P != config.cp_size:
        raise ValueError(f"the plan is for P = {P} ranks but config.cp_size = {config.cp_size}")
    m = plan.metrics.to_dict()
    S = P * c
    dims = dict(seqlen=S, cp_size=P, num_heads_q=config.num_heads_q, num_heads_kv=config.num_heads_kv,
                head_dim=config.head_dim, dtype_bytes=config.dtype_bytes)
    base_usp, base_ring = usp(**dims), ring_attention(**dims)
    shown = min(G, MAX_GROUPS_DRAWN)

    cols = max(shown, 3)
    fig = plt.figure(figsize=(3.2 * cols, 6.6))
    gs = fig.add_gridspec(2, cols, height_ratios=[1.15, 1.0], hspace=0.45, wspace=0.35)
    cmap = _rank_colours(P)
    for g in range(shown):
        ax = fig.add_subplot(gs[0, g])
        _grid(ax, assignment, g, P, tiles, cmap)
    _rank_legend(fig, ax, P, cmap)
    if shown < G:
        fig.text(0.99, 0.52, f"(first {shown} of {G} head groups)", ha="right", fontsize=8)

    ax = fig.add_subplot(gs[1, 0])
    load = m["load"]
    mean = sum(load) / max(1, len(load))
    ax.bar(range(P), load, color=[cmap(r) for r in range(P)])
    ax.set_ylim(0, 1.45 * max(max(load), 1))
    ax.axhline(mean, color="black", lw=1, label="mean")
    ax.axhline(plan.imbalance_tol * mean, color="red", ls="--", lw=1, label=f"mu x mean (mu={plan.imbalance_tol:g})")
    ax.set_title(f"load per rank (imbalance {m['imbalance']:.3f})", fontsize=9)
    ax.set_xlabel("rank", fontsize=8)
    ax.set_ylabel("area (q,k pairs x groups)", fontsize=8)
    ax.set_xticks(range(0, P, max(1, P // 8)))
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, loc="upper center", ncol=2, framealpha=0.8)
    _bars(fig.add_subplot(gs[1, 1]), m["fwd_send"], m["fwd_recv"], base_usp.fwd_bottleneck,
          base_ring.fwd_bottleneck, "forward bytes per rank")
    _bars(fig.add_subplot(gs[1, 2]), m["bwd_send"], m["bwd_recv"], base_usp.bwd_bottleneck,
          base_ring.bwd_bottleneck, "backward bytes per rank")

    status = status_names(int(plan.status.item()))
    head = title or f"plan: P={P}, G={G}, S={S}" + (f", {tiles} tiles per chunk" if tiles > 1 else "")
    fwd_pct = 100.0 * (m["fwd_bottleneck"] / base_usp.fwd_bottleneck - 1) if base_usp.fwd_bottleneck else math.nan
    bwd_pct = 100.0 * (m["bwd_bottleneck"] / base_usp.bwd_bottleneck - 1) if base_usp.bwd_bottleneck else math.nan
    sub = (f"Hq:Hkv={config.num_heads_q}:{config.num_heads_kv}, D={config.head_dim}, {config.dtype}; "
           f"bottleneck vs USP: fwd {fwd_pct:+.0f} %, bwd {bwd_pct:+.0f} %; "
           f"colour = computing rank, dot = local task; status {'OK' if not status else ' | '.join(status)}")
    fig.suptitle(head + "\n" + sub, fontsize=9)
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    plt.close(fig)
    return str(path)
