"""The Plan: what the planner decided, in a form the runtimes execute unchanged.

Contract (COMMON brief): ``pp, tp, dp, zero_stage, micro_batch_size, num_microbatches,
global_batch_size, precision, schedule, schedule_options, layers_per_stage,
recompute_per_stage`` and :meth:`Plan.build_schedule`.  Extra fields carry the model /
cluster identity, the per-layer-group strategies of the wide Galvatron mode and the
predicted cost, so ``plan.json`` alone reproduces the report.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Plan:
    pp: int = 1
    tp: int = 1
    dp: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    num_microbatches: int = 1
    global_batch_size: int = 1
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
    # per-layer strategies of the wide (Galvatron) search: list of dicts
    # {"tp": int, "dp": int, "sdp": bool, "ckpt": bool} (one per model layer)
    layer_strategies: list = field(default_factory=list)
    predicted: dict = field(default_factory=dict)   # iteration_time_s, tokens/s, memory ...
    notes: list = field(default_factory=list)

    # ---- derived ----
    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

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
        p = cls(**d)
        p.layers_per_stage = [int(x) for x in p.layers_per_stage]
        p.recompute_per_stage = [float(x) for x in p.recompute_per_stage]
        return p

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        with open(path) as f:
            return cls.from_json(f.read())
