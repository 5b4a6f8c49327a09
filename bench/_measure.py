"""The measurement helper every benchmark uses.

* :func:`plan_iters`: warm-up, then at least 5 timed iterations (3 with ``--quick``).
* :func:`figure` / :func:`ratio`: the median of the samples and their min-max spread; a
  ratio of two schedules timed in the same rounds is taken per round (paired), otherwise
  the spread is the widest the samples allow.
* :func:`fit_dispatch` and :func:`ping`: a runtime's own overheads, measured once per
  runtime and fed to the simulator (``schedule.Overheads``).
* :class:`Breakdown`: a runtime's own time in one iteration by what it is spent on
  (wrapped calls, exclusive of the wrapped calls inside them).
* :func:`publish`: the last line (the summary JSON) and, with ``--json``, summary + rows.
* :func:`device_check`: the command line of a GPU check (``measure`` there, ``compare`` here).
* :class:`Report`: the JSON line -- each figure's median, ``"spread"`` per figure, the
  simulator's ``"bounds"``, ``"flags"`` for a figure beyond its physical bound (which fails
  the benchmark's own ``goals_met``) and ``"max_sim_error"``.

The compute stand-in (calibrated sleep layers) is :mod:`ds_autoplan.models.sleep`.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from typing import Callable, Sequence

WARMUP = 1
SLACK = 0.05       # a measured ratio may pass the simulator's bound by this much (noise)


def plan_iters(quick: bool, iters: int | None = None) -> int:
    """Timed iterations: ``iters`` if given (at least 3), else 3 with --quick, 5 otherwise."""
    n = iters if iters is not None else (3 if quick else 5)
    if n < 3:
        raise SystemExit("error: at least 3 timed iterations are needed for a median and a spread")
    return n


def timed(step: Callable[[], None], iters: int, warmup: int = WARMUP,
          sync: Callable[[], None] | None = None, null: list | None = None) -> list[float]:
    """Run ``step`` ``warmup + iters`` times; the wall seconds of the timed ones (``sync``,
    e.g. a barrier, runs before each start).  With a ``null`` list, each iteration is
    preceded by one with every sleep layer at zero (``models.sleep.scaled(0)``, the
    runtime's own time only) whose seconds are appended to ``null``: interleaved, the null
    model and the measurement see the same load on a shared machine."""
    from ds_autoplan.models.sleep import scaled
    out = []

    def once():
        if sync:
            sync()
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0
    for i in range(warmup + iters):
        if null is not None:
            with scaled(0.0):
                t = once()
            if i >= warmup:
                null.append(t)
        t = once()
        if i >= warmup:
            out.append(t)
    return out


def figure(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of a figure's samples."""
    if not samples:
        raise ValueError("no samples")
    return statistics.median(samples), min(samples), max(samples)


def ratio(num: Sequence[float], den: Sequence[float], paired: bool = False):
    """num/den as (median, min, max).  Paired (the same rounds): per-round ratios; else the
    ratio of medians with the extreme ratios the samples allow as spread."""
    if paired:
        if len(num) != len(den):
            raise ValueError("paired ratios need as many samples on both sides")
        return figure([a / b for a, b in zip(num, den)])
    return statistics.median(num) / statistics.median(den), min(num) / max(den), max(num) / min(den)


def sim_error(samples: Sequence[float], predicted: float) -> float:
    """Relative error of the simulator's prediction against the measured median."""
    return abs(statistics.median(samples) - predicted) / predicted


# ----------------------------------------------------------------------------- overheads
def fit_dispatch(runs, overheads=None, tol: float = 1e-6) -> float:
    """A runtime's launch cost per compute action: for each ``(sched, costs, measured)`` of
    ``runs`` (its reference schedules), the ``dispatch`` for which the simulator reproduces
    ``measured`` seconds with the other ``overheads`` (p2p, send, step); their mean.  The
    makespan grows monotonically with ``dispatch``: bisection."""
    from dataclasses import replace

    from ds_autoplan.schedule import Overheads, simulate
    ov = overheads or Overheads()

    def one(sched, costs, measured):
        def span(dispatch):
            return simulate(sched, costs.with_overheads(replace(ov, dispatch=dispatch)),
                            check=False).makespan
        lo, hi = 0.0, max(measured, tol)
        if span(lo) >= measured:
            return 0.0
        while hi - lo > tol * max(1.0, measured):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if span(mid) < measured else (lo, mid)
        return (lo + hi) / 2
    return statistics.mean(one(*r) for r in runs)


def ping(tensor, a: int = 0, b: int = 1, k: int = 20) -> float:
    """One-way seconds of ``tensor`` between ranks ``a`` and ``b`` (round trip / 2, median
    of ``k``); every rank of the default group must call it."""
    import torch.distributed as dist
    rank, out = dist.get_rank(), []
    dist.barrier()
    for _ in range(k + 1):
        t0 = time.perf_counter()
        if rank == a:
            dist.send(tensor, b)
            dist.recv(tensor, b)
        elif rank == b:
            dist.recv(tensor, a)
            dist.send(tensor, a)
        out.append((time.perf_counter() - t0) / 2)
    dist.barrier()
    return statistics.median(out[1:])


def prebuild_ops() -> None:
    """Build DeepSpeed's CPU communication op once, here, before any rank starts and outside
    any kill timeout (a rank killed mid-build leaves a lock every later run hangs on).  Only
    when the runtime keeps the op (DS_AUTOPLAN_SHM=1); otherwise no rank builds it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ds_autoplan.runtime.launch import prebuild_ops as build
    build(os.environ)


class Breakdown:
    """Exclusive wall seconds per category of the calls it wraps (a call's time less that
    of the wrapped calls inside it) and their count; ``total()`` times the whole iteration,
    whose unwrapped rest is ``other``."""

    def __init__(self):
        self.sec: dict = {}
        self.calls: dict = {}
        self._stack: list = []
        self._undo: list = []
        self._total = 0.0

    def timed(self, fn, category: str):
        """``fn`` counted under ``category``."""
        def timed(*a, **kw):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                inner = self._stack.pop()
                self.sec[category] = self.sec.get(category, 0.0) + dt - inner
                self.calls[category] = self.calls.get(category, 0) + 1
                if self._stack:
                    self._stack[-1] += dt
        return timed

    def patch(self, obj, name: str, category: str | None, value=None) -> None:
        """Replace ``obj.name`` by its timed version (or by ``value``) until :meth:`unpatch`."""
        own = name in getattr(obj, "__dict__", {})
        old = getattr(obj, name)
        setattr(obj, name, value if category is None else self.timed(old, category))
        self._undo.append((obj, name, own, old))

    def unpatch(self) -> None:
        for obj, name, own, old in reversed(self._undo):
            if own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo.clear()

    @contextlib.contextmanager
    def total(self):
        t0 = time.perf_counter()
        yield
        self._total += time.perf_counter() - t0

    def result(self) -> dict:
        """Seconds per category, ``other`` (the iteration's unwrapped time) and ``total``."""
        out = dict(sorted(self.sec.items()))
        out["other"] = self._total - sum(self.sec.values())
        out["total"] = self._total
        return out


# ----------------------------------------------------------------------------- report
def publish(summary: dict, rows: list | None = None, path: str | None = None) -> int:
    """Write ``{"summary", "rows"}`` to ``path`` (a benchmark's ``--json``) when given, then
    print the summary as the benchmark's last line; returns 0 (the exit status)."""
    if path:
        with open(path, "w") as f:
            json.dump({"summary": summary, "rows": rows or []}, f, indent=1)
    print(json.dumps(summary), flush=True)
    return 0


def device_check(measure: Callable[[str], None], compare: Callable[[list], dict], name: str,
                 argv: Sequence[str] | None = None) -> None:
    """``NAME measure OUT.json`` (on the GPU) or ``NAME compare FILE.json [...]`` (here: one
    JSON line); anything else exits with the usage."""
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["measure"] and len(argv) == 2:
        measure(argv[1])
    elif argv[:1] == ["compare"] and len(argv) > 1:
        print(json.dumps(compare(argv[1:])))
    else:
        sys.exit(f"usage: {name} measure OUT.json | compare FILE.json [...]")


class Report:
    """Figures of one benchmark run, as the last line's JSON object."""

    def __init__(self, iters: int):
        self.out: dict = {"iters": iters}
        self.spread: dict = {}
        self.bounds: dict = {}
        self.flags: list[str] = []
        self.errors: dict = {}

    def add(self, key: str, fig, bound: tuple | None = None, digits: int = 3) -> float:
        """A figure (median, min, max); ``bound`` = (lo, hi) the simulator allows (None for
        an open side): a median beyond it by more than SLACK is flagged."""
        med, lo, hi = fig
        self.out[key] = round(med, digits)
        self.spread[key] = [round(lo, digits), round(hi, digits)]
        if bound is not None:
            b_lo, b_hi = bound
            self.bounds[key] = [None if b_lo is None else round(b_lo, digits),
                                None if b_hi is None else round(b_hi, digits)]
            if b_hi is not None and med > b_hi * (1 + SLACK):
                self.flags.append(f"{key} {med:.3f} above the simulator's ceiling {b_hi:.3f}")
            if b_lo is not None and med < b_lo * (1 - SLACK):
                self.flags.append(f"{key} {med:.3f} below the simulator's floor {b_lo:.3f}")
        return med

    def sim_error(self, label: str, samples: Sequence[float], predicted: float) -> float:
        e = sim_error(samples, predicted)
        self.errors[label] = round(e, 3)
        return e

    def finish(self, goals: dict[str, bool], **extra) -> dict:
        """The JSON object: figures, spread, bounds, flags, sim errors, goals_met."""
        out = dict(self.out)
        if self.errors:
            out["max_sim_error"] = max(self.errors.values())
            out["sim_error"] = self.errors
        out.update(extra)
        out["spread"], out["bounds"], out["flags"] = self.spread, self.bounds, self.flags
        out["goals"] = {k: bool(v) for k, v in goals.items()}
        out["goals_met"] = all(goals.values()) and not self.flags
        return out
