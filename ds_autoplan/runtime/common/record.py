"""A run's record of itself: ``measured.json`` beside its ``plan.json`` (docs/calibration.md).

Every runtime times its actions through :class:`~ds_autoplan.runtime.common.memory.ActionMemory`;
with a :class:`Recorder` attached, each action's own time (its waits for a peer excluded)
goes to the cost-model component of its kind (cost/components.py: one table, no runtime
names a component), the waits to ``idle``, and the rest of the step to ``step_tail``.
After ``DS_AUTOPLAN_MEASURE_STEPS`` steps (default 3; the first is warm-up and not counted;
0: no record) every rank contributes its sums to one ``all_gather`` of a float64 tensor
(nothing pickled) and rank 0 writes ``measured.json`` atomically into the run's output folder:
``DS_AUTOPLAN_OUT``, else the folder of ``DS_AUTOPLAN_PLAN``; a run with neither records
nothing.  Figures are seconds per iteration, averaged over the counted steps; a pipeline
rank's figure is the mean over its data-parallel replicas (the iteration time and memory:
the largest).
"""
from __future__ import annotations

import datetime
import hashlib
import os
import time

from ...cost.components import COMPONENTS, MEASURED_FORMAT, NAMES, component_of
from . import trace

STEPS_ENV = "DS_AUTOPLAN_MEASURE_STEPS"
OUT_ENV = "DS_AUTOPLAN_OUT"
PLAN_ENV = "DS_AUTOPLAN_PLAN"
FILE = "measured.json"
FORMAT = MEASURED_FORMAT
GB = 1024 ** 3
_C = len(NAMES)
MAX_STEPS = 64
# the gathered row of one rank: rank, pipeline rank, steps, step seconds, then per component
# seconds and action counts, then peak bytes, the model-state bytes inside them, whether
# activations were tracked; then per step (warm-up included) the wall-clock start of the
# step, end of its last action and of the step (time.time(): comparable across ranks and
# nodes); then the probed link
_ROW = 4 + 2 * _C + 3 + 3 * MAX_STEPS + 3
PROBES = 10          # round trips per size of the link probe
PROBE_BYTES = 1 << 20   # at least this large: a few KB of activation give a latency, not a bandwidth


def output_folder(env=None) -> str | None:
    """The folder a run's record goes to (module docstring), or None."""
    from ...env import env_str
    out = env_str(OUT_ENV, env=env)
    if out:
        return out
    plan = env_str(PLAN_ENV, env=env)
    return os.path.dirname(os.path.abspath(plan)) if plan else None


def plan_digest(path: str) -> str | None:
    """sha256 of a plan file's bytes (a record names the plan it measured), None if unreadable."""
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


class Recorder:
    """Per-process sums of one run's counted steps; :meth:`step_end` writes the record once
    the steps are in.  ``plan``: the :class:`~ds_autoplan.plan.Plan` that runs;
    ``pipeline_rank``: this process's; ``runtime``: the adapter's name for the record."""

    def __init__(self, folder: str, plan, pipeline_rank: int, runtime: str, steps: int = 3,
                 state_bytes=None, peers: tuple = (None, None), peak_complete: bool = True):
        self.folder, self.plan, self.pipe, self.runtime = folder, plan, pipeline_rank, runtime
        # whether the measured peak holds every model state and the activations (the record's
        # activations_tracked: calibrate fits memory only from such records)
        self.peak_complete = peak_complete
        self.on_record = None                   # called on every rank once the record is written
        self.on_step = None                     # called on every rank as a step begins
        self.steps = steps
        self.state_bytes = state_bytes          # callable -> model-state bytes of this rank
        self.own = [0.0] * _C
        self.count = [0] * _C
        self.step_s = 0.0
        self.step = -1                          # steps begun
        self._own_step, self._count_step = [0.0] * _C, [0] * _C     # actions before a step (eval_batch)
        self.t0 = None
        self.wait = 0.0                         # this step's waits so far
        self.done = False
        self.written: str | None = None
        self.peak = 0.0
        self._idle = NAMES.index("idle")
        self._tail = NAMES.index("step_tail")
        self._index = {k: NAMES.index(component_of(k)) for c in COMPONENTS for k in c.kinds}
        self._wall = time.time() - trace.clock()          # trace.clock() -> wall clock
        self.last = 0.0                                   # this step's last action's end (clock)
        self.begins: list = []
        self.lasts: list = []
        self.ends: list = []
        self.peers = peers          # global ranks of the previous and next pipeline rank
        self.boundary = 0           # bytes of the largest activation this rank sent
        self.link = (0.0, 0.0, 0.0)     # to the next pipeline rank: bytes, one-way s, latency s

    @property
    def counting(self) -> bool:
        """Whether the current step is one the record counts (not warm-up, not after)."""
        return not self.done and 1 <= self.step < self.steps

    def step_begin(self) -> None:
        if self.on_step is not None:
            self.on_step()
        self.step += 1
        self.wait = 0.0
        self._own_step = [0.0] * _C
        self._count_step = [0] * _C
        self.t0 = self.last = trace.clock()

    def action(self, kind, seconds: float, waited: float) -> None:
        """One action's wall ``seconds`` of which ``waited`` were waits for a peer."""
        i = self._index.get(getattr(kind, "value", kind))
        self.last = trace.clock()
        if i is not None:
            self._own_step[i] += seconds - waited
            self._count_step[i] += 1

    def waited(self, seconds: float) -> None:
        """A wait for a peer (a receive's data, a send's completion, a collective)."""
        self.wait += seconds

    def step_end(self, peak_bytes: float = 0.0) -> None:
        """The step ended: add it to the sums when counted; after the last counted step,
        gather and (rank 0) write the record.  Every rank calls it at the same step."""
        if self.t0 is None or self.done:
            return
        now = trace.clock()
        dt = now - self.t0
        self.begins.append(self.t0 + self._wall)
        self.lasts.append(self.last + self._wall)
        self.ends.append(now + self._wall)
        if self.counting:
            own = self._own_step
            own[self._idle] = self.wait
            own[self._tail] = max(0.0, dt - sum(own))
            self.own = [a + b for a, b in zip(self.own, own)]
            self.count = [a + b for a, b in zip(self.count, self._count_step)]
            self.step_s += dt
            self.peak = max(self.peak, float(peak_bytes))
        if self.step == self.steps - 1:
            self.done = True
            self._gather_and_write()
            if self.on_record is not None:      # launch --calibrate's decision (runtime/replan.py)
                self.on_record()

    # -- the record ------------------------------------------------------------------------
    def _row(self) -> list:
        import torch.distributed as dist
        n = max(1, self.steps - 1)
        states = float(self.state_bytes()) if self.state_bytes else 0.0
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        pad = [0.0] * (MAX_STEPS - len(self.ends))
        return [rank, self.pipe, n, self.step_s / n, *(x / n for x in self.own),
                *(c / n for c in self.count), self.peak + states, states, float(self.peak > 0 and self.peak_complete),
                *self.begins, *pad, *self.lasts, *pad, *self.ends, *pad, *self.link]

    def _probe(self) -> None:
        """The link to the next pipeline rank, measured once: one-way seconds of the largest
        activation sent (at least PROBE_BYTES) and of one byte (round trip / 2, median of PROBES), in two phases
        (even pipeline ranks with their next, then odd ones) so every pair meets."""
        import statistics

        import torch
        import torch.distributed as dist
        from .collectives import device
        prev, nxt = self.peers
        nbytes = max(int(self.boundary), PROBE_BYTES)
        dev = device()          # the process group's (NCCL takes no CPU tensor)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        for phase in (0, 1):
            for leader, peer in ((True, nxt), (False, prev)):
                if peer is None or (self.pipe - (0 if leader else 1)) % 2 != phase:
                    continue
                size = torch.zeros(1, dtype=torch.float64, device=dev)
                if leader:                       # agree on the size: the sender's
                    size[0] = nbytes
                    dist.send(size, peer)
                else:
                    dist.recv(size, peer)
                times = []
                for n in (max(1, int(size[0]) // 4), 1):
                    buf, one = torch.zeros(n, dtype=torch.float32, device=dev), []
                    for _ in range(PROBES + 1):
                        t0 = time.perf_counter()
                        if leader:
                            dist.send(buf, peer)
                            dist.recv(buf, peer)
                        else:
                            dist.recv(buf, peer)
                            dist.send(buf, peer)
                        sync()
                        one.append((time.perf_counter() - t0) / 2)
                    times.append(statistics.median(one[1:]))
                if leader:
                    self.link = (float(size[0]), times[0], times[1])

    def _gather_and_write(self) -> None:
        import torch
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and any(p is not None for p in self.peers):
            self._probe()
        from .collectives import device, world
        row = torch.tensor(self._row(), dtype=torch.float64, device=device() if world() > 1 else "cpu")
        if world() > 1:
            rows = [torch.zeros(_ROW, dtype=torch.float64, device=row.device) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, row)
            me = dist.get_rank()
        else:
            rows, me = [row], 0
        if me == 0:
            from ...errors import UserError
            try:
                self.written = write_record(self.folder, self.plan, [r.tolist() for r in rows], self.runtime)
            except UserError as e:          # the run goes on without its record
                print(f"ds-autoplan: warning: the run's record not written: {e}", flush=True)


def _per_pipeline_rank(rows: list, P: int, col: int, how=None) -> list:
    """Column ``col`` of the gathered rows, one value per pipeline rank (mean over its
    replicas, or ``how`` of them)."""
    out = []
    for p in range(P):
        vals = [r[col] for r in rows if int(r[1]) == p]
        out.append((how or (lambda v: sum(v) / len(v)))(vals) if vals else None)
    return out


def write_record(folder: str, plan, rows: list, runtime: str) -> str:
    """Write ``measured.json`` for the gathered ``rows`` (one per rank) into ``folder``
    (atomically; the folder's other files untouched); returns its path."""
    from ...outputs import json_text, write_folder
    P = plan.pp
    pred = plan.predicted.to_dict() if plan.predicted is not None else {}
    comps = pred.get("components") or {}
    steps = int(rows[0][2])
    # the iteration, as the cost model composes it (cost/components.py): from one step's end
    # (the last rank's) to the next, the warm-up step's end to the last counted one's over
    # the counted steps (what a run of many steps takes per step); its tail from the last
    # action on any rank to that end
    base = 4 + 2 * _C + 3
    lasts, ends = ([max(r[base + j * MAX_STEPS + k] for r in rows) for k in range(steps + 1)]
                   for j in (1, 2))
    period = (ends[-1] - ends[0]) / steps
    critical_tail = sum(ends[k] - lasts[k] for k in range(1, steps + 1)) / steps
    measured = {}
    for i, name in enumerate(NAMES):
        measured[name] = {"predicted": comps.get(name),
                          "measured": [round(x, 9) for x in _per_pipeline_rank(rows, P, 4 + i)],
                          "count": [round(x, 3) for x in _per_pipeline_rank(rows, P, 4 + _C + i)]}
    actions = [sum(r[4 + _C + i] for i, n in enumerate(NAMES) if n in ("forward", "input_grad",
                                                                      "weight_grad", "recompute"))
               for r in rows]
    act_rows = [[r[0], r[1], 0, 0, a] for r, a in zip(rows, actions)]
    record = {
        "format": FORMAT,
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "runtime": runtime,
        "plan": {"file": "plan.json", "sha256": plan_digest(os.path.join(folder, "plan.json")),
                 "model": plan.model, "cluster": plan.cluster, "pp": plan.pp, "dp": plan.dp,
                 "tp": plan.tp, "micro_batch_size": plan.micro_batch_size,
                 "num_microbatches": plan.num_microbatches, "schedule": plan.schedule_label,
                 "num_stages": plan.num_stages, "layers_per_stage": list(plan.layers_per_stage or [])},
        "steps": steps, "warmup_steps": 1, "world_size": len(rows),
        "iteration_time_s": {"predicted": pred.get("iteration_time_s"), "measured": round(period, 9),
                             "slowest_rank_step": round(max(r[3] for r in rows), 9),
                             "tail_after_last_action": round(critical_tail, 9)},
        "peak_memory_gb": {"predicted": pred.get("peak_memory_gb_per_stage"),
                           "measured": [round(x / GB, 6) for x in _per_pipeline_rank(rows, P, 4 + 2 * _C, max)],
                           "model_states_gb": [round(x / GB, 6) for x in
                                               _per_pipeline_rank(rows, P, 5 + 2 * _C, max)],
                           "activations_tracked": all(r[6 + 2 * _C] > 0 for r in rows)},
        "components": measured,
        "actions": {"predicted": comps.get("actions"),
                    "measured": _per_pipeline_rank(act_rows, P, 4)},
        "ranks": [{"rank": int(r[0]), "pipeline_rank": int(r[1]), "step_time_s": round(r[3], 9)}
                  for r in rows],
        # the link from each pipeline rank to the next, probed once after the counted steps
        "links": [{"from_pipeline_rank": p, "bytes": int(b), "one_way_s": round(t, 9),
                   "latency_s": round(lat, 9)}
                  for p, (b, t, lat) in enumerate(zip(*(_per_pipeline_rank(rows, P, _ROW - 3 + j)
                                                        for j in range(3))))
                  if b],
    }
    # among the folder's outputs (its manifest): the next run from this folder replaces it
    write_folder(folder, {FILE: json_text(record)}, complete=False, what="the run's output folder")
    return os.path.join(folder, FILE)


def from_env(plan, pipeline_rank: int, runtime: str, state_bytes=None,
             peers: tuple = (None, None), peak_complete: bool = True) -> Recorder | None:
    """This run's :class:`Recorder` when it has an output folder and records (module
    docstring), else None.  A bad ``DS_AUTOPLAN_MEASURE_STEPS`` is one line (EnvError)."""
    from ...env import EnvError, env_int
    steps = env_int(STEPS_ENV, 3, minimum=0)
    if steps > MAX_STEPS:
        raise EnvError(f"{STEPS_ENV}={steps}: at most {MAX_STEPS} steps are recorded")
    folder = output_folder()
    if not steps or folder is None or plan is None:
        return None
    if steps < 2:
        raise EnvError(f"{STEPS_ENV}={steps}: the first step is warm-up; give at least 2 (0: no record)")
    return Recorder(folder, plan, pipeline_rank, runtime, steps, state_bytes, peers, peak_complete)


def model_state_bytes(module, optimizer=None) -> float:
    """Bytes of this rank's parameters, their gradients and the optimizer's state tensors
    (walking wrapped optimizers' ``.optimizer``), each tensor once."""
    import torch
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if torch.is_tensor(t) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for p in module.parameters():
        add(p)
        add(p.grad)
        add(getattr(p, "main_grad", None))      # Megatron's DDP keeps gradients there
    opt, depth = optimizer, 0
    while opt is not None and depth < 4:
        for st in getattr(opt, "state", {}).values() if isinstance(getattr(opt, "state", None), dict) else ():
            for v in (st.values() if isinstance(st, dict) else ()):
                add(v)
        for name in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition", "fp32_groups_flat"):
            for t in getattr(opt, name, None) or ():
                add(t)
                add(getattr(t, "grad", None))
        opt, depth = getattr(opt, "optimizer", None), depth + 1
    return float(total)
