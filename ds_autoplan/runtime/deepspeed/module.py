"""A :class:`PipelineModule` whose layers are cut into the plan's stages and placed on ranks
by the schedule's placement (docs/runtimes.md §1.1, §1.5).

Generalises DeepSpeed 0.19.8's ``DualPipeVModule`` (which builds stages ``r`` and
``2P-1-r`` on rank ``r`` and swaps them with ``activate_phase``) to any placement:
sequential (1F1B), interleaved (``s mod d``), V, or custom.  Each local stage is a *chunk*;
:meth:`activated` exposes one chunk (or a sub-range of its layers, for stage-aware
recomputation) through the parent's ``forward``.
"""
from __future__ import annotations

import contextlib
from itertools import accumulate

import torch
from deepspeed.runtime.pipe.module import PipelineModule

from ...schedule.passes import recompute_counts, recompute_layers, with_recompute


class PartitionError(ValueError):
    """The plan's partition does not fit the model's layer list."""


def _joins_ends(counts, num_layers: int) -> bool:
    """Plan counts of transformer layers only, on ``[embedding, blocks..., head]``."""
    return sum(counts) == num_layers - 2


def parts_from(layers_per_stage, num_layers: int) -> list[int]:
    """Layer counts per stage -> boundaries ``[0, c0, c0+c1, ..., num_layers]``.

    Plans count transformer layers only; when the counts sum to ``num_layers - 2`` the layer
    list is taken to be ``[embedding, blocks..., head]`` and the embedding joins the first
    stage, the head the last."""
    counts = [int(c) for c in layers_per_stage]
    if any(c < 0 for c in counts):
        raise PartitionError(f"negative layer count in layers_per_stage {counts}")
    if _joins_ends(counts, num_layers):
        counts[0] += 1
        counts[-1] += 1
    parts = [0, *accumulate(counts)]
    if parts[-1] != num_layers:
        raise PartitionError(f"layers_per_stage {counts} sums to {parts[-1]}, but the model has "
                             f"{num_layers} layers")
    return parts


_NULL = contextlib.nullcontext()


class AutoplanPipelineModule(PipelineModule):
    """``PipelineModule`` with an explicit stage partition and stage→rank placement.

    ``placement[s]`` is the pipeline rank of stage ``s`` (``len(placement)`` = number of stages
    S); ``layers_per_stage`` (S counts) fixes the partition, otherwise ``partition_method``
    splits the layers into S parts as DeepSpeed does.  ``recompute_per_stage[s]`` is the
    fraction of stage ``s``'s layers whose activations are recomputed (Merak's 1-α_i, seed 001
    §5.2; the *first* layers of the stage, docs/merak.md §6.3 [decision]): when the
    schedule has no R actions, the R pass (``schedule.passes.add_recompute``) adds them once
    the partition is known.  ``recompute_layers[s]`` (local stages) is then the number of
    module layers R re-runs: the schedule's count of plan layers, plus the embedding on
    stage 0 when it joins the first stage (:func:`parts_from`).
    """

    def __init__(self, layers, placement, layers_per_stage=None, recompute_per_stage=None,
                 schedule=None, track_memory=False, **kwargs):
        placement = tuple(int(r) for r in placement)
        d = max(placement) + 1
        if sorted(set(placement)) != list(range(d)):
            raise PartitionError(f"placement {placement} leaves a rank without a stage")
        S = len(placement)
        rec = [0.0] * S if recompute_per_stage is None else [float(x) for x in recompute_per_stage]
        if len(rec) != S or not all(0.0 <= x <= 1.0 for x in rec):
            raise PartitionError(f"recompute_per_stage needs {S} fractions in [0, 1], got {rec}")
        for k, v in (("_ap_placement", placement), ("_ap_lps", layers_per_stage),
                     ("_ap_recompute", rec), ("autoplan_schedule", schedule),
                     ("track_memory", bool(track_memory))):
            object.__setattr__(self, k, v)
        if kwargs.get("topology") is None:
            kwargs["num_stages"] = d
        super().__init__(layers, **kwargs)

    # -- partition / build ---------------------------------------------------------------
    def _partition_layers(self, method="uniform"):
        S = len(self._ap_placement)
        if self.num_stages != max(self._ap_placement) + 1:
            raise PartitionError(f"placement is for {max(self._ap_placement) + 1} pipeline ranks, "
                                 f"topology has {self.num_stages}")
        self.num_stages = S            # stage_owner() and checkpoint paths walk the S parts
        if self._ap_lps is not None:
            if len(self._ap_lps) != S:
                raise PartitionError(f"layers_per_stage has {len(self._ap_lps)} entries, the "
                                     f"schedule has {S} stages")
            self.parts = parts_from(self._ap_lps, len(self._layer_specs))
            self._set_bounds(self.parts[0], self.parts[1])
        else:
            saved, self.stage_id = self.stage_id, 0
            super()._partition_layers(method)
            self.stage_id = saved
        self._check_no_empty_rank()
        rank = self.stage_id
        self.local_stages = [s for s, r in enumerate(self._ap_placement) if r == rank]
        self.chunk_bounds = [(self.parts[s], self.parts[s + 1]) for s in self.local_stages]
        self._set_recompute()
        self._set_bounds(*self.chunk_bounds[0])

    def _check_no_empty_rank(self):
        """Every pipeline rank must hold a trainable parameter, or its optimizer gets an empty
        parameter list (torch's ValueError deep in deepspeed.initialize, on that rank only,
        while the others wait).  Decided from the whole partition, so every rank refuses the
        same plan; layers given as specs (built later) are taken to have parameters."""
        def trainable(i):
            spec = self._layer_specs[i]
            if not isinstance(spec, torch.nn.Module):
                return True
            return any(p.requires_grad for p in spec.parameters())
        counts = [b - a for a, b in zip(self.parts, self.parts[1:])]
        for r in sorted(set(self._ap_placement)):
            stages = [s for s, q in enumerate(self._ap_placement) if q == r]
            if not any(trainable(i) for s in stages for i in range(self.parts[s], self.parts[s + 1])):
                raise PartitionError(
                    f"pipeline rank {r} would hold stage(s) {stages} with no trainable parameter "
                    f"(module layers per stage {counts}): its optimizer would get an empty "
                    f"parameter list; give every rank a layer with parameters")

    def _set_recompute(self):
        S, n = len(self._ap_placement), len(self._layer_specs)
        self._joined = self._ap_lps is not None and _joins_ends(self._ap_lps, n)
        self.plan_layer_counts = list(self._ap_lps) if self._joined else \
            [self.parts[s + 1] - self.parts[s] for s in range(S)]
        if self.autoplan_schedule is not None:
            object.__setattr__(self, "autoplan_schedule", self.with_recompute(self.autoplan_schedule))
            self.recompute_layers = self.recompute_plan(self.autoplan_schedule)
        else:
            ks = recompute_counts(self._ap_recompute, self.plan_layer_counts)
            self.recompute_layers = self._module_units(ks)

    def _module_units(self, ks) -> dict:
        return {s: ks[s] + (1 if self._joined and s == 0 and ks[s] else 0) for s in self.local_stages}

    def recompute_plan(self, sched) -> dict:
        """Local stage -> number of module layers an R of ``sched`` re-runs (0: none)."""
        return self._module_units(recompute_layers(sched, self.plan_layer_counts))

    def with_recompute(self, sched):
        """``sched`` with this module's recompute fractions applied by the R pass when it has
        no R actions of its own (``schedule.passes.with_recompute``, this partition's counts)."""
        return with_recompute(sched, self._ap_recompute, self.plan_layer_counts)

    def stage_owner(self, layer_idx):
        """The pipeline rank that owns ``layer_idx``."""
        return self._ap_placement[super().stage_owner(layer_idx)]

    def _build(self):
        self.__dict__.pop("_ap_active", None)
        self.chunk_funcs = []
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
            self.forward_funcs = []
        self._activate(0, 0, None)

    def _activate(self, chunk, lo, hi):
        key = (chunk, lo, hi, self.activation_checkpoint_interval)
        state = self.__dict__         # plain attributes: skip nn.Module.__setattr__ (per action)
        if state.get("_ap_active") == key and "forward_funcs" in state:
            return
        state["_ap_active"] = key
        funcs = self.chunk_funcs[chunk]
        hi = len(funcs) if hi is None else hi
        state["forward_funcs"] = funcs[lo:hi]
        start = self.chunk_bounds[chunk][0]
        state["_local_start"], state["_local_stop"] = start + lo, start + hi
        if self.activation_checkpoint_interval > 0:
            k = self.activation_checkpoint_interval
            self.is_checkpointable_results = [self._is_checkpointable(self.forward_funcs[i:i + k])
                                              for i in range(0, len(self.forward_funcs), k)]
            self.is_checkpointable_results_interval = k

    def activated(self, stage: int, lo: int = 0, hi: int | None = None):
        """Context exposing layers ``[lo, hi)`` of local ``stage`` through ``forward``: no
        context at all when that is what ``forward`` exposes outside one (one stage, whole)."""
        chunk = self.local_stages.index(stage)
        if chunk == 0 and lo == 0 and hi is None and \
                self.__dict__.get("_ap_active") == (0, 0, None, self.activation_checkpoint_interval):
            return _NULL
        return self._activated(chunk, lo, hi)

    @contextlib.contextmanager
    def _activated(self, chunk: int, lo: int, hi: int | None):
        self._activate(chunk, lo, hi)
        try:
            yield self
        finally:
            self._activate(0, 0, None)

    def _precompute_checkpointable_values(self):
        self._activate(0, 0, None)

    def set_checkpoint_interval(self, interval):
        self.activation_checkpoint_interval = interval
        self._activate(0, 0, None)

    def local_layers(self):
        """``(global layer index, layer)`` for every layer this rank holds, in layer order."""
        return sorted((lo + i, f) for (lo, _), fs in zip(self.chunk_bounds, self.chunk_funcs)
                      for i, f in enumerate(fs))

    def _each_chunk(self, fn, *args, **kwargs):
        for c in range(len(self.chunk_funcs)):
            self._activate(c, 0, None)
            fn(*args, **kwargs)
        self._activate(0, 0, None)

    def save_state_dict(self, *args, **kwargs):
        self._each_chunk(super().save_state_dict, *args, **kwargs)

    def load_state_dir(self, *args, **kwargs):
        self._each_chunk(super().load_state_dir, *args, **kwargs)
