"""The cost model's components: the one table that says, for each part of an iteration the
cost model predicts, which actions of a run measure it and which cluster figure a
calibration fits to it (docs/calibration.md).

A plan's ``predicted["components"]`` holds, per component, the predicted seconds per
iteration of every pipeline rank; a run's ``measured.json`` (runtime/common/record.py)
holds the same keys measured, and ``ds-autoplan calibrate`` (cost/calibrate.py) fits the
cluster from the pairs.  A new component is added here, with the action kinds that measure
it: the runtimes record every action kind alike and need no change.

* ``forward``, ``input_grad``, ``weight_grad``, ``recompute``: the compute of the rank's
  F, B (or fused BW), W and R actions, each including the cluster's fixed cost per action
  (``action_overhead_us``); measured as the actions' own time (waits for a peer excluded).
* ``transfers``: posting the pipeline sends and receives (SEND/RECV actions) and completing
  the sends at the step's end: the runtime's own time for the transfers.
* ``idle``: the rest of the busiest rank's iteration while this rank waits: the pipeline
  bubble and the transfers' latency (the link figures).  Predicted by the schedule
  simulator, measured as the step's time not spent in any action or the step's tail.
* ``step_tail``: after the rank's last action: the data-parallel gradient reduction, the
  parameter gathers and the optimizer step (with offloading its copies), and the cluster's
  fixed per-iteration cost (``step_overhead_ms``).
"""
from __future__ import annotations

from typing import NamedTuple

MEASURED_FORMAT = "ds_autoplan.measured/1"     # a run's record (runtime/common/record.py)


class Component(NamedTuple):
    name: str
    kinds: tuple            # action kinds (schedule.Kind values) whose own time measures it
    what: str               # one line for the calibrate table
    figure: str             # the cluster figure(s) a calibration fits to it


COMPONENTS = (
    Component("forward", ("F",), "forward compute", "compute"),
    Component("input_grad", ("B", "BW"), "input-gradient (fused: whole backward) compute", "compute"),
    Component("weight_grad", ("W",), "deferred weight-gradient compute", "compute"),
    Component("recompute", ("R",), "activation recomputation", "compute"),
    Component("transfers", ("SEND_F", "RECV_F", "SEND_B", "RECV_B"), "posting pipeline transfers",
              "action_overhead_us"),
    Component("idle", (), "pipeline bubble and transfer waits", "links"),
    Component("step_tail", (), "gradient reduction, optimizer step, gathers", "step_overhead_ms"),
)
NAMES = tuple(c.name for c in COMPONENTS)
COMPUTE = ("forward", "input_grad", "weight_grad", "recompute")
KIND_OF = {k: c.name for c in COMPONENTS for k in c.kinds}       # action kind -> component


def component_of(kind) -> str | None:
    """The component an action kind's own time is measured into (None: no component)."""
    return KIND_OF.get(getattr(kind, "value", kind))


def pipeline_components(placement, m: int, f, b, w, r, split: bool, tail, makespan: float,
                        action_overhead_s: float) -> dict:
    """Predicted seconds per iteration of every component on each of the ``P`` pipeline
    ranks, from the per-stage seconds of one micro-batch the simulator was given (``f`` F,
    ``b`` the backward without W where ``split``, ``w`` W, ``r`` the recompute inside the
    backward), the per-rank ``tail`` and the simulated ``makespan``; ``actions``: the compute
    actions per rank and iteration (what the fixed per-action cost multiplies)."""
    P = max(placement) + 1
    out = {k: [0.0] * P for k in NAMES}
    out["actions"] = [0] * P
    for s, rank in enumerate(placement):
        out["forward"][rank] += m * float(f[s])
        out["recompute"][rank] += m * float(r[s])
        out["input_grad"][rank] += m * (float(b[s]) - float(r[s]))
        out["actions"][rank] += m * (2 + (1 if r[s] else 0))
        if split:
            out["weight_grad"][rank] += m * (float(w[s]) + action_overhead_s)
            out["actions"][rank] += m
    for rank in range(P):
        busy = sum(out[k][rank] for k in COMPUTE)
        out["step_tail"][rank] = float(tail[rank])
        out["idle"][rank] = max(0.0, makespan - busy)
    return {k: [round(x, 9) if isinstance(x, float) else x for x in v] for k, v in out.items()}
