"""Timelines as Chrome / Perfetto traces (the Trace Event Format's JSON object form).

One timeline is a list of action records ``{"rank", "kind", "stage", "mb", "start", "end"}``
in seconds: what :meth:`SimResult.timeline` predicts and what the runtimes measure with
``DS_AUTOPLAN_TRACE=dir`` (:mod:`ds_autoplan.runtime.common.trace`).  Each record becomes a
complete event (``"ph": "X"``, microseconds) on the track of its rank, so a predicted and a
measured trace open side by side in https://ui.perfetto.dev or ``chrome://tracing``.

Tracks: one process per trace (``pid``, named by ``label``), one thread per pipeline rank
(``tid`` = rank, named ``rank r``).  :func:`check_trace` is the format check the tests use.
"""
from __future__ import annotations

from typing import Iterable, Mapping

#: colour names of the legacy trace viewer's palette, per action kind (Perfetto ignores them)
_COLOURS = {"F": "thread_state_running", "B": "thread_state_iowait", "W": "thread_state_runnable",
            "BW": "thread_state_iowait", "R": "thread_state_unknown"}


def trace_events(groups: Iterable[tuple[str, Iterable[Mapping]]], *, scale: float = 1e6) -> dict:
    """The trace object of ``groups``: ``(label, records)`` pairs, one process (track group)
    each, e.g. ``[("predicted", sim.timeline())]`` or one per compared schedule.  ``scale``
    turns record times into microseconds (default: records in seconds)."""
    events, meta = [], []
    for pid, (label, records) in enumerate(groups):
        ranks = set()
        for r in records:
            rank = int(r["rank"])
            ranks.add(rank)
            kind = str(r["kind"])
            start, end = float(r["start"]), float(r["end"])
            ev = {"name": f"{kind}{r['stage']}.{r['mb']}", "cat": kind, "ph": "X", "pid": pid,
                  "tid": rank, "ts": start * scale, "dur": max(0.0, end - start) * scale,
                  "args": {"stage": int(r["stage"]), "mb": int(r["mb"]),
                           **({"step": int(r["step"])} if "step" in r else {})}}
            if kind in _COLOURS:
                ev["cname"] = _COLOURS[kind]
            events.append(ev)
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"name": label}})
        for k in sorted(ranks):
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": k,
                         "args": {"name": f"rank {k}"}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": k,
                         "args": {"sort_index": k}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


_REQUIRED = {"X": ("name", "ph", "ts", "dur", "pid", "tid"), "M": ("name", "ph", "pid", "args")}


def check_trace(obj) -> dict[int, int]:
    """Check ``obj`` against the Trace Event Format (JSON object form: ``traceEvents`` list;
    complete events with name/ph/ts/dur/pid/tid, ts and dur non-negative numbers; metadata
    events with their args) and the ds_autoplan layout (every event's track named by a
    ``thread_name`` event, events of one track not overlapping).  Returns the number of
    events per track ``(pid, tid)``; raises ``ValueError`` naming the first problem."""
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        raise ValueError("a trace is an object with a 'traceEvents' list")
    named, per_track = set(), {}
    spans: dict[tuple, list] = {}
    for i, ev in enumerate(obj["traceEvents"]):
        ph = ev.get("ph") if isinstance(ev, dict) else None
        if ph not in _REQUIRED:
            raise ValueError(f"event {i}: unsupported phase {ph!r}")
        missing = [k for k in _REQUIRED[ph] if k not in ev]
        if missing:
            raise ValueError(f"event {i}: missing {', '.join(missing)}")
        if ph == "M":
            if ev["name"] == "thread_name":
                named.add((ev["pid"], ev["tid"]))
            continue
        if not all(isinstance(ev[k], (int, float)) and ev[k] >= 0 for k in ("ts", "dur")):
            raise ValueError(f"event {i}: ts and dur must be non-negative numbers")
        spans.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for track, sp in spans.items():
        if track not in named:
            raise ValueError(f"track pid={track[0]} tid={track[1]} has no thread_name")
        sp.sort()
        for (a0, a1), (b0, _) in zip(sp, sp[1:]):
            if b0 < a1 - 1e-6 * max(1.0, a1):
                raise ValueError(f"track pid={track[0]} tid={track[1]}: events overlap at ts={b0}")
        per_track[track] = len(sp)
    return per_track
