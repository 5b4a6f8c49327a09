"""Fit a cluster's figures to the records of runs on it (``ds-autoplan calibrate``,
docs/calibration.md).

A record (``measured.json``, runtime/common/record.py) holds, per cost-model component
(cost/components.py) and pipeline rank, the seconds the plan predicted and the run measured.
The fit moves the figures the components depend on, in this order:

1. compute: every rank's measured compute actions (F, B/BW, W, R) against the predicted
   ones, least squares over (run, rank, component) of ``measured = a * modelled + n * c``:
   ``a`` scales the compute rate (``compute_efficiency``, or ``compute_scale`` where a GPU
   kind models the kernels), ``c`` is the fixed cost of one action (``action_overhead_us``,
   from ``n`` actions of the component).  Only runs of different micro-batch sizes tell the
   two apart; from runs of one size only ``a`` moves (the fixed cost folds into the rate).
2. ``step_overhead_ms``: the measured step tails (after the last action: gradient reduction,
   optimizer step) over the re-predicted ones.
3. links: one factor on every link's latency and 1/bandwidth (a run exercises the links its
   plan uses: pipeline sends, the data-parallel reduction), chosen so the re-predicted
   iteration times of the runs match the measured ones (a geometric bisection of the
   cost model's prediction; ``predict`` is the search, given by the caller: nothing here
   imports it).  A run whose prediction does not move with the factor did not exercise them.
4. ``memory_overhead_gb``: the median of the measured peaks over the predicted ones.

Components whose measured/predicted ratio differs among the runs by more than the fit's own
spread are named in :attr:`Fit.disagree`, not averaged away.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

import numpy as np

from ..spec.cluster import ClusterSpec
from .components import COMPUTE, MEASURED_FORMAT, NAMES

LINK_FIELDS = ("intra_node_GBps", "inter_node_GBps", "p2p_GBps", "nic_GBps")
LATENCY_FIELDS = ("intra_latency_us", "inter_latency_us")
GB = 1024 ** 3


class RecordError(ValueError):
    """A record that cannot be used (one line, naming the file)."""


@dataclass
class Fit:
    cluster: ClusterSpec
    moved: list = field(default_factory=list)         # (figure, before, after, why)
    unchanged: list = field(default_factory=list)     # (figure, why)
    disagree: list = field(default_factory=list)      # (component, ratios per run)
    residuals: list = field(default_factory=list)     # per run: predicted/measured - 1 after


def _num(x, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 or x > 1e6:
        raise RecordError(f"{where}: {x!r} is not a time or size (a finite number in [0, 1e6])")
    return float(x)


def check_record(rec, src: str, pp: int | None = None) -> dict:
    """``rec`` (a parsed ``measured.json``) checked: format, every figure a finite,
    non-negative, sane number, per-rank lists of the plan's pipeline degree; returns it."""
    if not isinstance(rec, dict) or rec.get("format") != MEASURED_FORMAT:
        raise RecordError(f"{src}: not a ds_autoplan record (format {MEASURED_FORMAT!r} expected)")
    plan = rec.get("plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("pp"), int) or plan["pp"] < 1:
        raise RecordError(f"{src}: plan: missing or malformed")
    P = plan["pp"]
    if pp is not None and P != pp:
        raise RecordError(f"{src}: the record has {P} pipeline ranks, its plan.json {pp}")
    it = rec.get("iteration_time_s") or {}
    if not isinstance(it, dict):
        raise RecordError(f"{src}: iteration_time_s must be an object")
    if _num(it.get("measured"), f"{src}: iteration_time_s.measured") <= 0:
        raise RecordError(f"{src}: iteration_time_s.measured must be positive")
    if "tail_after_last_action" in it:
        _num(it["tail_after_last_action"], f"{src}: iteration_time_s.tail_after_last_action")
    steps = rec.get("steps")
    if not isinstance(steps, int) or steps < 1:
        raise RecordError(f"{src}: steps must be a positive whole number, got {steps!r}")
    comps = rec.get("components")
    if not isinstance(comps, dict):
        raise RecordError(f"{src}: components: missing")
    for name in NAMES:
        c = comps.get(name)
        if not isinstance(c, dict):
            raise RecordError(f"{src}: components.{name}: missing")
        for side in ("measured",) + (("count",) if "count" in c else ()):
            v = c.get(side)
            if not isinstance(v, list) or len(v) != P:
                raise RecordError(f"{src}: components.{name}.{side} must list {P} pipeline ranks")
            for i, x in enumerate(v):
                _num(x, f"{src}: components.{name}.{side}[{i}]")
    mem = rec.get("peak_memory_gb") or {}
    for side in ("measured",):
        v = mem.get(side)
        if not isinstance(v, list) or len(v) != P:
            raise RecordError(f"{src}: peak_memory_gb.{side} must list {P} pipeline ranks")
        for i, x in enumerate(v):
            _num(x, f"{src}: peak_memory_gb.{side}[{i}]")
    return rec


def _compute_points(recs: list, ovh_old_s: float):
    """(modelled seconds without the fixed cost, actions, measured seconds) per (run, rank,
    compute component) with actions."""
    X, N, Y = [], [], []
    for r in recs:
        for name in COMPUTE:
            c = r["components"][name]
            cnt = c.get("count") or [0] * len(c["measured"])
            for p, (pred, meas, n) in enumerate(zip(c["predicted"], c["measured"], cnt)):
                if n > 0 and pred > 0:
                    X.append(max(0.0, pred - n * ovh_old_s))
                    N.append(n)
                    Y.append(meas)
    return np.array(X), np.array(N, dtype=float), np.array(Y)


def fit_compute(recs: list, ovh_old_s: float) -> tuple[float | None, float | None, float]:
    """(a, c, spread): measured = a * modelled + actions * c (c in seconds; None where the
    points do not separate it) and the points' largest relative residual."""
    X, N, Y = _compute_points(recs, ovh_old_s)
    if len(X) == 0 or not X.any():
        return None, None, 0.0
    A = np.stack([X, N], axis=1)
    # the fixed cost separates from the rate only across micro-batch sizes: within one, a
    # kind's actions all do the same work, and F against B (2:1 in the model) would fit the
    # engine's different fixed costs of the two kinds as compute
    sep = len({r["plan"].get("micro_batch_size") for r in recs}) > 1
    if sep:
        (a, c), *_ = np.linalg.lstsq(A, Y, rcond=None)
        if c < 0 or a <= 0:
            sep = False
    if not sep:
        a, c = float(Y.sum() / X.sum()), None
    pred = a * X + (c or 0.0) * N
    spread = float(np.max(np.abs(pred / np.maximum(Y, 1e-12) - 1.0)))
    return float(a), (float(c) if c is not None else None), spread


def with_compute(cl: ClusterSpec, a: float) -> tuple[ClusterSpec, list]:
    """The cluster with its compute ``a`` times slower (a > 1) or faster; the moves."""
    if cl.gpu:
        new = cl.compute_scale / a
        return replace(cl, compute_scale=new), [("compute_scale", cl.compute_scale, new)]
    eff = cl.compute_efficiency / a
    if eff <= 1.0:
        return replace(cl, compute_efficiency=eff), [("compute_efficiency", cl.compute_efficiency, eff)]
    # faster than the stated peak: the peak moves, the efficiency is 1
    peak = cl.peak_tflops * eff
    return replace(cl, compute_efficiency=1.0, peak_tflops=peak), \
        [("compute_efficiency", cl.compute_efficiency, 1.0), ("peak_tflops", cl.peak_tflops, peak)]


def with_links(cl: ClusterSpec, k: float) -> ClusterSpec:
    """Every link ``k`` times slower: latency x k, bandwidth / k."""
    ch = {f: getattr(cl, f) / k for f in LINK_FIELDS if getattr(cl, f)}
    ch.update({f: getattr(cl, f) * k for f in LATENCY_FIELDS})
    return replace(cl, **ch)


def with_link_figures(cl: ClusterSpec, latency_s: float, GBps: float | None) -> ClusterSpec:
    """The cluster with the probed pipeline link: ``latency_s`` and ``GBps`` (None: bandwidth
    unchanged) for the links a pipeline send uses (cost/collectives.py Network.p2p): inside a
    node, or across nodes (and ``p2p_GBps``) on a cluster of several nodes."""
    ch = {"intra_latency_us": latency_s * 1e6}
    if GBps:
        ch["intra_node_GBps"] = GBps
    if cl.num_nodes > 1 or cl.p2p_GBps:
        ch["inter_latency_us"] = latency_s * 1e6
        if GBps and cl.p2p_GBps:
            ch["p2p_GBps"] = GBps
    return replace(cl, **ch)


def fit(recs: list, cluster: ClusterSpec, predict) -> Fit:
    """Fit ``cluster`` to the checked records ``recs`` (module docstring).  ``predict(cluster,
    i) -> (iteration seconds, [peak GB per pipeline rank], components)`` re-costs the plan of
    record ``i`` (components: plan.json's ``predicted["components"]``)."""
    out = Fit(cluster)
    cl = cluster
    # 1. compute and the per-action fixed cost
    a, c, spread = fit_compute(recs, cl.action_overhead_us * 1e-6)
    if a is None:
        out.unchanged.append(("compute", "no compute action was measured"))
    else:
        cl, moves = with_compute(cl, a)
        out.moved += [(f, b, v, f"compute actions measured {a:.3g}x the modelled time") for f, b, v in moves]
        if c is not None:
            out.moved.append(("action_overhead_us", cluster.action_overhead_us, c * 1e6,
                              "fixed cost per action, fitted beside the compute rate"))
            cl = replace(cl, action_overhead_us=c * 1e6)
        else:
            out.unchanged.append(("action_overhead_us", "runs of one micro-batch size do not separate "
                                  "it from the compute rate (calibrate from runs of two sizes)"))
    measured = np.array([r["iteration_time_s"]["measured"] for r in recs])
    # the tail the cost model adds to the makespan: from the last action on any rank to the
    # iteration's end (older records: the slowest rank's own tail)
    meas_tail = np.array([r["iteration_time_s"].get("tail_after_last_action",
                                                    max(r["components"]["step_tail"]["measured"]))
                          for r in recs])

    def error(c_):
        return np.array([predict(c_, i)[0] for i in range(len(recs))]) / measured - 1.0

    # 2. links: from the records' probes of the pipeline links where they have them, else
    # (or where no pipeline crosses a link) one factor that fits the iteration times
    base_step = cl.step_overhead_ms
    probes = [(l_["bytes"], l_["one_way_s"], l_["latency_s"]) for r in recs for l_ in r.get("links") or []
              if l_.get("bytes") and l_.get("one_way_s")]
    def exercised(c_) -> bool:          # whether any run's time moves with the links
        return bool(np.any(np.abs(error(with_links(c_, 1e2)) - error(with_links(c_, 1e-2))) > 0.01))

    if probes:
        lat = float(np.median([p[2] for p in probes]))
        per_byte = float(np.median([max(p[1] - p[2], 0.0) / p[0] for p in probes]))
        cl2 = with_link_figures(cl, lat, 1.0 / per_byte / 1e9 if per_byte > 0 else None)
        out.moved += [(f, getattr(cl, f), getattr(cl2, f), f"the pipeline links probed: {lat * 1e6:.0f} us "
                       f"latency, {probes[0][1] * 1e6:.0f} us for {int(probes[0][0])} bytes")
                      for f in LINK_FIELDS + LATENCY_FIELDS if getattr(cl, f) != getattr(cl2, f)]
        cl = cl2
    elif exercised(cl):
        k = _bisect(lambda x: float(np.median(error(with_links(cl, x)))), 1e-3, 1e3)
        cl2 = with_links(cl, k)
        out.moved += [(f, getattr(cl, f), getattr(cl2, f), f"the runs' iteration times: links "
                       f"{k:.3g}x {'slower' if k > 1 else 'faster'}")
                      for f in LINK_FIELDS + LATENCY_FIELDS if getattr(cl, f) and getattr(cl, f) != getattr(cl2, f)]
        cl = cl2
    else:
        out.unchanged += [(f, "no run exercised a link (one stage, one replica)")
                          for f in LINK_FIELDS + LATENCY_FIELDS if getattr(cl, f)]
    # 3. what the iteration times keep beyond compute and links: the per-iteration overhead
    left_ms = float(np.median(-error(cl) * measured)) * 1e3
    cl = replace(cl, step_overhead_ms=max(0.0, cl.step_overhead_ms + left_ms))
    if cl.step_overhead_ms != base_step:
        out.moved.append(("step_overhead_ms", base_step, cl.step_overhead_ms,
                          "the measured iteration time left after compute and links (step tail: "
                          f"{1e3 * float(np.median(meas_tail)):.3g} ms measured)"))
    # 4. memory
    diffs = []
    for i, r in enumerate(recs):
        if r["peak_memory_gb"].get("activations_tracked") is False:
            continue             # model states only (DeepSpeed's plain engine on a CPU rank)
        _, peaks, _ = predict(cl, i)
        diffs += [m - p for m, p in zip(r["peak_memory_gb"]["measured"], peaks) if m > 0]
    if diffs:
        mo = cl.memory_overhead_gb + float(statistics.median(diffs))
        out.moved.append(("memory_overhead_gb", cl.memory_overhead_gb, mo,
                          "the measured peaks over the modelled ones (median)"))
        cl = replace(cl, memory_overhead_gb=mo)
    else:
        out.unchanged.append(("memory_overhead_gb", "no run measured its peak with the activations "
                                                    "(a plain engine's record on CPU holds the model "
                                                    "states only)"))
    out.residuals = [float(x) for x in error(cl)]
    # components whose ratio differs among the runs beyond the compute fit's own spread
    if len(recs) > 1:
        for name in NAMES:
            ratios = []
            for r in recs:
                c_ = r["components"][name]
                p_, m_ = sum(c_["predicted"]), sum(c_["measured"])
                if p_ > 0 and m_ > 0:
                    ratios.append(m_ / p_)
            if len(ratios) > 1 and max(ratios) / min(ratios) - 1 > 2 * max(spread, 0.05):
                out.disagree.append((name, ratios))
    out.cluster = replace(cl, calibration_error=round(max(abs(x) for x in out.residuals), 6),
                          calibration_runs=len(recs))
    return out


def _bisect(f, lo: float, hi: float, it: int = 40) -> float:
    """x in [lo, hi] (geometric) where the increasing f crosses 0 (an end where it does not)."""
    flo, fhi = f(lo), f(hi)
    if flo >= 0:
        return lo
    if fhi <= 0:
        return hi
    for _ in range(it):
        mid = math.sqrt(lo * hi)
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.0005:
            break
    return math.sqrt(lo * hi)
