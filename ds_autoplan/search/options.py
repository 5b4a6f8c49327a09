"""What a search is asked: one :class:`SearchOptions` object, built once by its caller (the
``plan`` and ``cost`` commands, ``ds-autoplan launch``, the DeepSpeed hook) and read by the
space (:mod:`.space`), the evaluation (:mod:`.evaluate`) and the search (:mod:`.planner`).

A new option is a field here (with its default, which must keep the plans of callers that do
not set it unchanged) and its use where the space, the evaluation or the search reads it;
``search(..., name=value)`` and ``Planner(..., name=value)`` take it by keyword with no other
change.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..cost.model import MOE_IMBALANCE

SP_MODES = ("auto", "on", "off")


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """The options of one search (keywords only).

    Problem: ``precision``; ``budget_gb`` (per-device cap; default the device memory less the
    preset's reserve) and ``headroom_gb`` (kept free below it; cost/memory.py usable_budget);
    ``runtime``: whose memory accounting plans must fit ('any', 'megatron', 'deepspeed');
    ``execution``: the engine's execution model (cost/engines.py; None: the runtime's);
    ``moe_imbalance``: the busiest expert rank's tokens over the mean.

    Space: ``pp``/``tp`` one degree each (None: every degree); ``max_tp``; ``sequence_parallel``
    'auto' (on whenever tp > 1), 'on' (tp > 1 only) or 'off'; ``fix``: the user's configuration
    as restrictions (:func:`ds_autoplan.search.fix.parse_fix`); ``allow_zero``: ZeRO stages;
    ``schedules``: builder names (None: those the registry marks as searched by default);
    ``partitioner``: bmw, even, dawnpiper or merak; ``units``: memory units of the stage DP.

    Output: ``wide`` the wide Galvatron-BMW mode, ``baselines`` the baselines, ``keep_sim`` the
    winner's simulation for the plots, ``progress`` a progress bar.

    Input checks: ``world_size`` (the cluster must have that many devices), ``profile`` (a
    model profile or a YAML of measured cluster overrides).

    Training: ``trainable`` (frozen parameters, LoRA)."""
    precision: str = "bf16"
    budget_gb: float | None = None
    headroom_gb: float | None = None
    runtime: str = "any"
    execution: Any = None
    moe_imbalance: float = MOE_IMBALANCE
    pp: int | None = None
    tp: int | None = None
    max_tp: int | None = None
    sequence_parallel: str = "auto"
    fix: dict | str | None = None
    allow_zero: tuple = (0, 1, 2, 3)
    schedules: tuple | list | None = None
    partitioner: str = "bmw"
    units: int = 512
    wide: bool = True
    baselines: bool = True
    keep_sim: bool = True
    progress: bool = False
    world_size: int | None = None
    profile: str | None = None
    # which parameters train (spec/trainable.py: a fraction, 'lora:r=..,targets=..' or a
    # Trainable; None: all): frozen ones cost parameter bytes only
    trainable: Any = None
    # the offloads weighed where the cluster has host figures (None: search/space.OFFLOAD_SPACE)
    offloads: tuple | None = None

    @classmethod
    def of(cls, options: "SearchOptions | None" = None, **changes) -> "SearchOptions":
        """``options`` (default: all defaults) with ``changes`` (keywords as the fields; an
        unknown one is a TypeError naming it)."""
        known = {f.name for f in fields(cls)}
        bad = sorted(set(changes) - known)
        if bad:
            raise TypeError(f"unknown search option(s) {', '.join(bad)}; the options are "
                            f"{', '.join(sorted(known))}")
        return replace(options, **changes) if options is not None else cls(**changes)
