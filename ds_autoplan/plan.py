"""The Plan: what the planner decided, in a form the runtimes execute unchanged.

A plan holds one :class:`~ds_autoplan.spec.parallel.Parallel` (:attr:`Plan.parallel`: every
degree and the batch split), the schedule and its per-stage lists, the model / cluster
identity, the per-layer strategies of the wide Galvatron mode and a typed
:class:`Prediction` (:attr:`Plan.predicted`), so ``plan.json`` alone reproduces the report.

``plan.json`` is flat: the Parallel's fields are top-level keys under their own names, but for
the three older files spell differently (:data:`FILE_NAMES`: ``zero_stage``,
``sequence_parallel``, ``micro_batch_size``); ``chunks`` is not written (the schedule's
``layers_per_stage`` give it), ``global_batch_size`` is written for the reader, and a field is
written in its JSON form (:meth:`Parallel.as_dict`: the offload as its text).  A plan is
built from a Parallel (``Plan(parallel=par, ...)``) or, as it reads from ``plan.json``, from
those flat keys (``Plan(pp=2, micro_batch_size=4, ...)``), and reads them back as read-only
attributes valued as in the file (``plan.zero_stage`` is ``plan.parallel.zero``,
``plan.offload`` the offload's text), generated from the same table: a
field added to Parallel is in ``plan.json`` and on the plan with no change here.  Keys a newer
file has and this code does not know are ignored; keys an older file lacks take their
defaults (no expert / context parallelism, no prediction).

Contract (what both runtimes read): those degrees, ``global_batch_size, precision, schedule,
schedule_options, layers_per_stage, recompute_per_stage`` and :meth:`Plan.build_schedule`.

A plan validates itself on construction (and so when read from JSON): degrees (Parallel's own
checks, named as plan.json names them), batch triple, precision, per-stage lists against the
schedule's stage count (the builder registry's description); a violation is a
:class:`~ds_autoplan.errors.PlanError` naming the field.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import PlanError
from .spec import SpecError
from .spec.parallel import Parallel, ParallelError

PRECISIONS = ("fp32", "bf16", "fp16")
# plan.json's names for the Parallel fields it spells differently (the files of every version
# use them); every other field is written under its own name
FILE_NAMES = {"zero": "zero_stage", "sp": "sequence_parallel", "micro_batch": "micro_batch_size"}
# Parallel fields plan.json does not hold: the chunks per rank are the schedule's stages / pp
NOT_WRITTEN = ("chunks",)
# plan.json key -> Parallel field
PARALLEL_KEYS = {FILE_NAMES.get(f.name, f.name): f.name for f in dataclasses.fields(Parallel)
                 if f.name not in NOT_WRITTEN}


# the fields of a Prediction that record the search rather than predict the plan
SEARCH_TABLES = ("baselines", "wide", "schedules_tried", "search_phases_s", "components")


def _when_set():
    """A :class:`Prediction` field written to plan.json only when it has a value (older plans
    and plans without what it measures have no key for it)."""
    return field(default=None, metadata={"when_set": True})


@dataclass(frozen=True)
class Prediction(Mapping):
    """What the cost model predicts for a plan, and the record of the search that chose it
    (``plan.json``'s ``"predicted"`` object: the field names are its keys).

    Every field is None when a plan file does not have it (a hand-made plan has no prediction
    at all: :attr:`Plan.predicted` is None).  Fields made with :func:`_when_set` are left out of
    ``plan.json`` while None; a new measure (host memory when offloading) is such a field, so
    plans without it are written as before.  The object also reads as its ``plan.json`` object
    (``pred["mfu"]``, ``pred.get(...)``) for scripts written against that dict."""
    # -- the prediction
    iteration_time_s: float | None = None
    throughput_tokens_per_s: float | None = None
    samples_per_s: float | None = None
    mfu: float | None = None
    peak_memory_gb_per_stage: list | None = None     # per pipeline rank, GB (rounded to kB)
    memory_budget_gb: float | None = None            # usable device memory the plan fits
    memory_headroom_gb: float | None = None          # kept free below the budget
    memory_runtime: str | None = None                # whose accounting: any, megatron, deepspeed
    # what is offloaded, the busiest node's host GB and budget, the seconds it adds; or why none
    # (search/result.py offload_summary)
    offload: dict | None = _when_set()
    # trained parameters and the model states beside a full fine-tune's (Space.trainable_summary)
    trainable: dict | None = _when_set()
    execution: str | None = None                     # the engine's execution model (cost/engines.py)
    error_band: dict | None = None                   # the expected error (cost.engines.error_band)
    # -- the search that chose the plan (the report's tables)
    search_time_s: float | None = None
    baselines: dict | None = None                    # name -> Candidate.summary row (None: OOM)
    wide: dict | None = None                         # the wide Galvatron-BMW mode's entries
    candidates_evaluated: int | None = None
    ratio_vs_best_baseline: float | None = None
    wide_gain: float | None = _when_set()
    wide_gain_vs_1f1b: float | None = _when_set()
    schedules_tried: list | None = None              # per schedule: time, fits, split, memory
    search_phases_s: dict | None = _when_set()
    # per cost-model component (cost/components.py), seconds per iteration of each pipeline rank
    components: dict | None = _when_set()

    def to_dict(self) -> dict[str, Any]:
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None or not f.metadata.get("when_set")}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Prediction | None":
        """The prediction of a plan file's ``"predicted"`` object (None for an empty one)."""
        if not isinstance(d, Mapping):
            raise PlanError(f"plan: predicted must be a JSON object, got {d!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names}) if d else None

    def figures(self) -> dict[str, Any]:
        """The predicted figures, every field but the search's tables (baselines, wide-mode
        entries, schedules tried, phase timings): what a one-line summary of the plan reports."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in SEARCH_TABLES}

    # the plan.json object's view
    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


@dataclass(eq=True)
class _PlanFields:
    parallel: Parallel = field(default_factory=Parallel)
    precision: str = "bf16"
    schedule: str = "1f1b"
    schedule_options: dict = field(default_factory=dict)
    layers_per_stage: list = field(default_factory=lambda: [1])
    recompute_per_stage: list = field(default_factory=lambda: [0.0])
    # -- extra fields (not part of the minimal contract) --
    model: str = ""
    cluster: str = ""
    seq_len: int = 0
    num_layers: int = 0
    world_size: int = 1
    gpus_per_node: int = 0               # devices per node the plan was costed on (0: not recorded)
    selective_recompute: bool = False    # attention core recomputed on every layer (Megatron only)
    partitioner: str = "bmw"
    # per-unit strategy labels of the wide (Galvatron) search (embedding, blocks, head)
    layer_strategies: list = field(default_factory=list)
    predicted: Prediction | None = None
    notes: list = field(default_factory=list)


class Plan(_PlanFields):
    """See the module docstring.  ``Plan(parallel=par, ...)`` or ``Plan(pp=..., ...)`` with
    plan.json's flat degree keys (not both); ``global_batch_size`` is checked against the
    batch split (0: not given); ``predicted`` a :class:`Prediction` or its plan.json object."""

    def __init__(self, parallel: Parallel | None = None, *, global_batch_size: int = 0, **kw):
        flat = {PARALLEL_KEYS[k]: kw.pop(k) for k in list(kw) if k in PARALLEL_KEYS}
        if parallel is not None and flat:
            raise TypeError(f"Plan: give parallel= or the degrees {sorted(flat)}, not both")
        if flat.get("etp") == 0:            # older callers: 0 for Megatron's default (= tp)
            flat["etp"] = None
        if kw.get("predicted") is not None and not isinstance(kw["predicted"], Prediction):
            kw["predicted"] = Prediction.from_dict(kw["predicted"])
        try:
            par = Parallel(**flat) if parallel is None else parallel
        except ParallelError as e:
            raise PlanError(f"plan: {FILE_NAMES.get(e.field, e.field)} {e.problem}"
                            if e.field else f"plan: {e.problem}") from None
        except SpecError as e:
            raise PlanError(f"plan: {e}") from None
        super().__init__(parallel=par, **kw)
        gbs = global_batch_size or par.global_batch
        if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1:
            raise PlanError(f"plan: global_batch_size must be a positive integer, got {gbs!r}")
        if gbs != par.global_batch:
            raise PlanError(f"plan: global_batch_size {gbs} != micro_batch_size "
                            f"{par.micro_batch} x num_microbatches {par.num_microbatches} "
                            f"x dp {par.dp}")
        self.validate()
        # the chunks per rank are the schedule's: its stages over the pipeline ranks
        self.parallel = par.with_(chunks=max(1, len(self.layers_per_stage) // par.pp))

    def validate(self) -> "Plan":
        """Raise :class:`PlanError` on the first field no runtime can execute (the degrees
        were checked when the plan's Parallel was made)."""
        if self.precision not in PRECISIONS:
            raise PlanError(f"plan: precision must be one of {', '.join(PRECISIONS)}, "
                            f"got {self.precision!r}")
        if not isinstance(self.schedule, str) or not self.schedule:
            raise PlanError(f"plan: schedule must be a builder name, got {self.schedule!r}")
        if not isinstance(self.schedule_options, dict):
            raise PlanError(f"plan: schedule_options must be a mapping, got {self.schedule_options!r}")
        self._validate_stages()
        return self

    def _validate_stages(self) -> None:
        lps, rec = self.layers_per_stage, self.recompute_per_stage
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in lps):
            raise PlanError(f"plan: layers_per_stage must be non-negative integers, got {lps!r}")
        if any(not 0.0 <= float(x) <= 1.0 for x in rec):
            raise PlanError(f"plan: recompute_per_stage must be fractions in [0, 1], got {rec!r}")
        if len(lps) > 1 and rec and len(rec) != len(lps):
            raise PlanError(f"plan: recompute_per_stage has {len(rec)} entries, layers_per_stage "
                            f"{len(lps)}")
        S = self._registered_stages()
        if S is not None and len(lps) > 1 and len(lps) != S:
            raise PlanError(f"plan: layers_per_stage has {len(lps)} entries but schedule "
                            f"{self.schedule!r} on pp={self.pp} has {S} stages")
        if len(lps) > 1 and 0 in lps:
            # a stage without layers still takes its slots in the schedule (a rank that only
            # forwards what it receives): time the model was costed without, and memory idle
            raise PlanError(f"plan: stage {lps.index(0)} of the {len(lps)} stages of "
                            f"{self.schedule!r} on pp={self.pp} has no layers (layers_per_stage "
                            f"{lps}): every stage needs at least one; use {len(lps)} or more layers "
                            "or a schedule with fewer stages")

    def _registered_stages(self) -> int | None:
        """Stages of the plan's schedule from the builder registry (None: pp = 1 or a
        schedule not registered here, e.g. a hand-made one passed to a runtime)."""
        from .schedule.builders import REGISTRY
        info = REGISTRY.get(self.schedule)
        if info is None:
            return None
        unknown = set(self.schedule_options) - set(info.options)
        if unknown:
            raise PlanError(f"plan: schedule_options {sorted(unknown)} do not fit {self.schedule!r} "
                            f"(it takes {', '.join(info.options) or 'no options'})")
        if self.pp == 1:
            return None
        try:
            return info.num_stages(self.pp, **self.schedule_options)
        except (TypeError, ValueError) as e:
            raise PlanError(f"plan: schedule_options {self.schedule_options!r} do not fit "
                            f"{self.schedule!r}: {e}") from None

    # ---- derived ----
    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def world(self) -> int:
        return self.parallel.world_size

    @property
    def global_batch_size(self) -> int:
        """Samples per iteration: micro-batch x micro-batches x dp."""
        return self.parallel.global_batch

    @property
    def schedule_label(self) -> str:
        """The pipeline schedule as messages name it: none with one stage (pp = 1)."""
        return self.schedule if self.pp > 1 else "none (no pipeline, pp=1)"

    def label(self) -> str:
        """The plan in one line, as the launcher's and calibration's records name it: its
        degrees, ZeRO stage, batch split and schedule."""
        return (f"pp={self.pp} tp={self.tp} dp={self.dp} ZeRO-{self.zero_stage} micro-batch "
                f"{self.micro_batch_size} x {self.num_microbatches} schedule={self.schedule_label}")

    def stage_placement(self) -> tuple[int, ...]:
        """The pipeline rank of each stage: the schedule's placement (the builder registry's),
        stage s on rank s mod pp where the builder decides it itself."""
        from .schedule.builders import REGISTRY
        info = REGISTRY.get(self.schedule)
        place = info.stage_placement(self.pp, **self.schedule_options) if info and self.pp > 1 else None
        if place is None or len(place) != self.num_stages:
            place = tuple(s % self.pp for s in range(self.num_stages))
        return place

    def layout_conflict(self, num_nodes: int, gpus_per_node: int) -> str | None:
        """Why a launch of ``num_nodes`` x ``gpus_per_node`` ranks contradicts the node layout
        this plan was costed on (docs/planner.md §1.4: ranks node-major, TP innermost, a stage's
        tp x cp x dp ranks consecutive, stages outermost), or None: a group the plan kept inside
        fewer nodes (TP, a stage's data-parallel group, the pipeline's sends) spans more here.
        Plans without a recorded layout (older files) are not checked."""
        G0, world = self.gpus_per_node, num_nodes * gpus_per_node
        if not G0 or G0 == gpus_per_node or world != self.world:
            return None

        def nodes(size, G):       # the most nodes one aligned block of `size` ranks touches
            return max(len({(s + i) // G for i in range(size)}) for s in range(0, world, size))

        def crossings(G):         # stage boundaries between ranks of different nodes
            n = self.world // self.pp
            return sum((s * n) // G != (s * n - 1) // G for s in range(1, self.pp))
        stage = self.tp * self.cp * self.dp
        for what, size in (("tensor-parallel group", self.tp), ("stage's data-parallel group", stage)):
            if size > 1 and nodes(size, gpus_per_node) > nodes(size, G0):
                return (f"its {what} of {size} ranks spans {nodes(size, gpus_per_node)} nodes of "
                        f"{gpus_per_node} here, {nodes(size, G0)} in the plan ({G0} per node)")
        if self.pp > 1 and crossings(gpus_per_node) > crossings(G0):
            return (f"{crossings(gpus_per_node)} of its {self.pp - 1} pipeline sends cross nodes of "
                    f"{gpus_per_node} here, {crossings(G0)} in the plan ({G0} per node)")
        return None

    @staticmethod
    def parallel_fields(par: Parallel) -> dict[str, Any]:
        """``par`` as plan.json's flat keys (``Plan(**Plan.parallel_fields(par), ...)`` builds
        the plan of ``par``; chunks are the schedule's: ``layers_per_stage``)."""
        d = par.as_dict()
        return {k: d[f] for k, f in PARALLEL_KEYS.items()}

    def build_schedule(self):
        """The pipeline schedule this plan runs (lazy import: planning needs no torch).
        Plans with pp = 1 have no pipeline schedule (builders need d >= 2: ScheduleError)."""
        from .schedule import build
        return build(self.schedule, self.pp, self.num_microbatches, **self.schedule_options)

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        """plan.json's object: the degrees flat, then the other fields."""
        out = {**self.parallel_fields(self.parallel), "global_batch_size": self.global_batch_size}
        for f in dataclasses.fields(_PlanFields):
            if f.name != "parallel":
                out[f.name] = copy.deepcopy(getattr(self, f.name))
        out["predicted"] = self.predicted.to_dict() if self.predicted is not None else {}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        names = {f.name for f in dataclasses.fields(_PlanFields)} | PARALLEL_KEYS.keys() \
            | {"global_batch_size"}
        d = {k: v for k, v in d.items() if k in names - {"parallel"}}   # newer files: more keys
        for k, conv in (("layers_per_stage", int), ("recompute_per_stage", float)):
            if k in d:
                try:
                    d[k] = [conv(x) for x in d[k]]
                except (TypeError, ValueError):
                    raise PlanError(f"plan: {k} must be a list of numbers, got {d[k]!r}") from None
        return cls(**d)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise PlanError(f"plan: expected a JSON object, got {type(d).__name__}")
        return cls.from_dict(d)

    def save(self, path: str | os.PathLike) -> None:
        """Write plan.json atomically (ds_autoplan.outputs.write_file)."""
        from .outputs import text, write_file
        write_file(path, text(self.to_json() + "\n"), what="plan")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """A ``plan.json``; one that cannot be read raises :class:`PlanError` naming it."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"cannot read the plan {os.fspath(path)}: "
                            f"{getattr(e, 'strerror', None) or 'not a text file'}") from None
        return cls.from_json(text)


# plan.json's degree keys as read-only attributes of the plan, valued as plan.json has them
# (``plan.tp``, ``plan.zero_stage``, ``plan.offload`` the offload's text)
for _key, _name in PARALLEL_KEYS.items():
    setattr(Plan, _key, property(lambda self, _n=_name: self.parallel.as_dict()[_n],
                                 doc=f"``parallel.{_name}`` as plan.json's ``{_key}``"))
