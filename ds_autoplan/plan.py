"""The Plan: what the planner decided, in a form the runtimes execute unchanged.

Contract (what both runtimes read): ``pp, tp, dp, zero_stage, micro_batch_size, num_microbatches,
global_batch_size, precision, schedule, schedule_options, layers_per_stage,
recompute_per_stage`` and :meth:`Plan.build_schedule`.  The degrees are those of one
:class:`~ds_autoplan.spec.parallel.Parallel` (:attr:`Plan.parallel`; a plan is built from one
with :meth:`Plan.parallel_fields`), kept flat in ``plan.json``; ``ep``, ``etp`` and ``cp``
are absent from older plan files and default to no expert / context parallelism.  Extra fields carry the model /
cluster identity, the per-layer-group strategies of the wide Galvatron mode and the
predicted cost, so ``plan.json`` alone reproduces the report.

A plan validates itself on construction (and so when read from JSON): sizes, batch triple,
precision, per-stage lists against the schedule's stage count (the builder registry's
description); a violation is a :class:`~ds_autoplan.errors.PlanError` naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import PlanError
from .spec import SpecError
from .spec.parallel import Offload, Parallel

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class Plan:
    pp: int = 1
    tp: int = 1
    dp: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    num_microbatches: int = 1
    global_batch_size: int = 0           # 0: micro_batch_size * num_microbatches * dp
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
    sequence_parallel: bool = False      # Megatron SP (tp > 1 only); absent in old plan files
    selective_recompute: bool = False    # attention core recomputed on every layer (Megatron only)
    partitioner: str = "bmw"
    ep: int = 1                          # expert parallelism (absent in old plan files)
    etp: int = 0                         # expert tensor parallelism; 0: Megatron's default (= tp)
    cp: int = 1                          # context parallelism
    cp_comm: str = "p2p"                 # p2p: Megatron ring attention; a2a: Ulysses all-to-all
    offload: str = "none"                # spec.parallel.Offload's text form (absent in old plan files)
    # per-layer strategies of the wide (Galvatron) search: list of dicts
    # {"tp": int, "dp": int, "sdp": bool, "ckpt": bool} (one per model layer)
    layer_strategies: list = field(default_factory=list)
    predicted: dict = field(default_factory=dict)   # iteration_time_s, tokens/s, memory ...
    notes: list = field(default_factory=list)

    def __post_init__(self):
        if self.etp == 0:
            self.etp = self.tp
        if self.global_batch_size == 0:
            self.global_batch_size = self.micro_batch_size * self.num_microbatches * self.dp
        self.validate()

    def validate(self) -> "Plan":
        """Raise :class:`PlanError` on the first field no runtime can execute."""
        for k in ("pp", "tp", "dp", "ep", "etp", "cp", "micro_batch_size", "num_microbatches",
                  "global_batch_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"plan: {k} must be a positive integer, got {v!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"plan: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.precision not in PRECISIONS:
            raise PlanError(f"plan: precision must be one of {', '.join(PRECISIONS)}, "
                            f"got {self.precision!r}")
        if self.global_batch_size != self.micro_batch_size * self.num_microbatches * self.dp:
            raise PlanError(f"plan: global_batch_size {self.global_batch_size} != micro_batch_size "
                            f"{self.micro_batch_size} x num_microbatches {self.num_microbatches} "
                            f"x dp {self.dp}")
        if not isinstance(self.schedule, str) or not self.schedule:
            raise PlanError(f"plan: schedule must be a builder name, got {self.schedule!r}")
        if not isinstance(self.schedule_options, dict):
            raise PlanError(f"plan: schedule_options must be a mapping, got {self.schedule_options!r}")
        self._validate_stages()
        try:
            self.parallel
        except SpecError as e:
            raise PlanError(f"plan: {e}") from None
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
    def parallel(self) -> Parallel:
        """The plan's degrees and batch split (chunks: schedule stages per pipeline rank)."""
        return Parallel(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep, etp=self.etp, cp=self.cp,
                        cp_comm=self.cp_comm, zero=self.zero_stage, sp=bool(self.sequence_parallel),
                        offload=Offload.parse(self.offload),
                        chunks=max(1, len(self.layers_per_stage) // self.pp),
                        micro_batch=self.micro_batch_size, num_microbatches=self.num_microbatches)

    @staticmethod
    def parallel_fields(par: Parallel) -> dict[str, Any]:
        """The Plan fields of ``par`` (``Plan(**Plan.parallel_fields(par), ...)``); chunks are
        the schedule's (``layers_per_stage`` and ``schedule_options``)."""
        return {"pp": par.pp, "tp": par.tp, "dp": par.dp, "ep": par.ep, "etp": par.etp,
                "cp": par.cp, "cp_comm": par.cp_comm, "zero_stage": par.zero, "sequence_parallel": par.sp,
                "offload": par.offload.text(),
                "micro_batch_size": par.micro_batch, "num_microbatches": par.num_microbatches}

    def build_schedule(self):
        """The pipeline schedule this plan runs (lazy import: planning needs no torch).
        Plans with pp = 1 have no pipeline schedule (builders need d >= 2: ScheduleError)."""
        from .schedule import build
        return build(self.schedule, self.pp, self.num_microbatches, **self.schedule_options)

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}   # newer plan files may carry more keys
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
        with open(path) as f:
            return cls.from_json(f.read())
