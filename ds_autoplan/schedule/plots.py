"""Matplotlib plots of a simulated schedule: Gantt chart and activation memory over time."""
from __future__ import annotations

from .ir import Kind, Schedule
from .simulator import SimResult

COLORS = {Kind.F: "#4C72B0", Kind.B: "#DD8452", Kind.W: "#55A868", Kind.BW: "#C44E52",
          Kind.R: "#8172B3"}

# what each kind of action is, for the legend
MEANING = {Kind.F: "forward", Kind.B: "backward, input grad", Kind.W: "backward, weight grad",
           Kind.BW: "backward", Kind.R: "recompute"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_gantt(sched: Schedule, res: SimResult, path: str, title: str | None = None,
               fmt: str | None = None) -> str:
    """One row per rank; colour = F/B/W/BW/R, label = micro-batch id (chunk shown by shade).
    The legend lies outside the axes, right of them, so that no bar is hidden."""
    plt = _pyplot()
    d = sched.num_ranks
    fig, ax = plt.subplots(figsize=(max(8.0, res.makespan * 0.12 + 2), 0.5 * d + 1.4),
                           layout="constrained")
    bars: dict = {}                       # (rank, kind, first chunk?) -> [(start, width)]
    acts = [(a, st, res.end[a]) for a, st in res.start.items() if not a.kind.is_comm]
    for a, st, en in acts:
        bars.setdefault((a.rank, a.kind, sched.chunk_of(a.stage) == 0), []).append((st, en - st))
    for (r, kind, first), xr in bars.items():     # one collection per group: fast to draw
        ax.broken_barh(xr, (r - 0.4, 0.8), facecolors=COLORS[kind], alpha=1.0 if first else 0.6,
                       edgecolor="black", linewidth=0.3)
    wide = [x for x in acts if x[2] - x[1] > 0.02 * res.makespan or res.makespan < 80]
    if len(wide) <= 400:                  # micro-batch ids where they stay legible
        for a, st, en in wide:
            ax.text((st + en) / 2, a.rank, str(a.mb), ha="center", va="center", fontsize=6)
    ax.set_xlim(0, max(res.makespan, 1e-12) * 1.01)
    ax.set_yticks(range(d), [f"rank {r}" for r in range(d)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    drawn = {kind for _, kind, _ in bars}
    entries = [(plt.Rectangle((0, 0), 1, 1, color=c),
                f"{k.value}: {MEANING[k]}" if k in MEANING else k.value)
               for k, c in COLORS.items() if k in drawn]
    if any(not first for _, _, first in bars):       # the shade tells a rank's chunks apart
        entries += [(plt.Rectangle((0, 0), 1, 1, color="0.45", alpha=a), label) for a, label in
                    ((1.0, "first chunk"), (0.6, "later chunks (lighter)"))]
    fig.legend(*zip(*entries), fontsize=7, loc="outside right upper")
    ax.set_title(title or f"{sched.name}: d={d}, n={sched.num_microbatches}, "
                 f"makespan {res.makespan:g}, bubble {res.bubble_ratio:.1%}")
    fig.savefig(path, dpi=120, format=fmt)
    plt.close(fig)
    return path


def plot_memory(sched: Schedule, res: SimResult, path: str, title: str | None = None,
                fmt: str | None = None) -> str:
    """Activation memory (units of one micro-batch over 1/d of the model) per rank over time."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for r, curve in enumerate(res.mem_curve):
        xs = [p[0] for p in curve] + [res.makespan]
        ys = [p[1] / res.unit for p in curve] + [curve[-1][1] / res.unit]
        ax.step(xs, ys, where="post", label=f"rank {r} (peak {res.peak_units[r]:g})")
    ax.set_xlabel("time")
    ax.set_ylabel("activation (micro-batch × 1/d model)")
    ax.legend(fontsize=7)
    ax.set_title(title or f"{sched.name}: activation memory per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=fmt)
    plt.close(fig)
    return path
