"""Plan → megatron-core parallel setup and TransformerConfig overrides (docs/runtimes.md §4.1, §4.3).

* ``initialize_model_parallel`` gets the plan's tp / pp sizes; its virtual size is the number
  of stages per rank (2 for V-shapes, ``v`` for interleaved, none for 1F1B-family).
* The layer layout goes into ``pipeline_model_parallel_layout``.  For sequential and
  interleaved placements Megatron's own list-of-lists layout is used (its order vpp0pp0,
  vpp0pp1, ... *is* stage order).  A V placement (stage i and 2d-1-i on rank i) is not
  expressible that way (Megatron requires the loss in its last vpp/pp slot and computes layer
  offsets in interleaved order), so :class:`StageLayerLayout` -- a subclass of Megatron's
  ``PipelineParallelLayerLayout``, which ``TransformerConfig`` accepts as is -- keeps the
  (pp rank, vp stage) → stage map and computes layer counts and offsets in stage order.
* Recompute: a plan's ``recompute_per_stage`` is R actions in the schedule, inserted by the
  pass both runtimes share (``schedule.passes.plan_schedule``: R re-runs the first
  round(fraction · layers) layers of the stage, Merak's stage-aware recomputation), so the
  simulator's memory model is what runs.  Megatron's own full-layer recompute
  (``recompute_granularity='full'``) is therefore off in every chunk's config
  (:meth:`MegatronSetup.chunk_config`): nothing is recomputed twice.  Selective recompute
  (``plan.selective_recompute``: the attention core of every layer, Korthikanti et al. 2022
  §5) has no R: it stays Megatron's ``recompute_granularity='selective'``.
* Expert parallelism: the plan's ``ep`` / ``etp`` go to ``initialize_model_parallel``
  (``expert_model_parallel_size``, ``expert_tensor_parallel_size``) and to every chunk's
  config; Megatron regroups each stage's tp·cp·dp ranks as etp·ep·expert-dp, so the MoE
  layers' all-to-all runs among ranks that execute the same action list.  Context
  parallelism (``cp`` > 1) needs Transformer Engine's attention on a CUDA GPU:
  :func:`initialize` refuses it elsewhere with one line (docs/megatron.md).
"""
from __future__ import annotations

import copy
import dataclasses
import math

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from ...emit.megatron import layout_string
from ...emit.megatron import megatron_args as emit_megatron_args
from ...schedule import Schedule, ScheduleError
from ...schedule.passes import plan_schedule, recompute_layers
from ..common import check_world
from ..watchdog import process_group_timeout, startup_watchdog


def stage_layer_lists(layers_per_stage) -> list[list[str]]:
    """Megatron layout entries per stage (LayerType names): the embedding on stage 0, one
    'decoder' per transformer layer, the loss on the last stage."""
    S = len(layers_per_stage)
    return [(["embedding"] if s == 0 else []) + ["decoder"] * int(n) + (["loss"] if s == S - 1 else [])
            for s, n in enumerate(layers_per_stage)]


class StageLayerLayout(PipelineParallelLayerLayout):
    """``PipelineParallelLayerLayout`` for any placement (stage → pp rank), chunks of a rank in
    stage order; layer offsets are counted in stage (= layer) order."""

    def __init__(self, stage_lists, placement):
        placement = list(placement)
        d = max(placement) + 1
        per_rank = [[s for s, r in enumerate(placement) if r == rank] for rank in range(d)]
        v = len(per_rank[0])
        if any(len(x) != v for x in per_rank):
            raise ScheduleError("every pipeline rank must hold the same number of stages")
        self.stage_of = {(r, c): per_rank[r][c] for r in range(d) for c in range(v)}
        vpp_major = [stage_lists[self.stage_of[(r, c)]] for c in range(v) for r in range(d)]
        super().__init__(vpp_major, d)
        self.input_data = [list(x) for x in stage_lists]
        # stage (layer) order, so validate_layer_layout sees E first and L last
        self.flatten_layout = [LayerType[t] if isinstance(t, str) else t
                               for st in stage_lists for t in st]
        self._stage_lists = [self.layout[r][c] for (r, c) in sorted(self.stage_of, key=self.stage_of.get)]

    def get_layer_offset(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None):
        from megatron.core import parallel_state
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        stage = self.stage_of[(pp_rank, vp_stage or 0)]
        return sum(st.count(layer_type) for st in self._stage_lists[:stage])


@dataclasses.dataclass
class MegatronSetup:
    """What :func:`initialize` decided for this process."""

    schedule: Schedule
    pp_rank: int
    config_overrides: dict          # for every chunk's TransformerConfig
    stages: list                    # stage id of each local model chunk (chunk order)
    recompute_num_layers: list      # per stage: the layers an R of the schedule re-runs
    layout: object                  # what config_overrides['pipeline_model_parallel_layout'] holds
    selective_recompute: bool = False

    @property
    def num_chunks(self) -> int:
        return len(self.stages)

    def pre_process(self, chunk: int = 0) -> bool:
        """GPTModel(pre_process=...) for local chunk ``chunk`` (holds the embedding)."""
        return self.stages[chunk] == 0

    def post_process(self, chunk: int = 0) -> bool:
        """GPTModel(post_process=...) for local chunk ``chunk`` (holds output layer + loss)."""
        return self.stages[chunk] == self.schedule.num_stages - 1

    def vp_stage(self, chunk: int = 0):
        return chunk if self.num_chunks > 1 else None

    def chunk_overrides(self, chunk: int = 0) -> dict:
        """``config_overrides`` plus the recompute settings of local chunk ``chunk``: no
        Megatron full-layer recompute (the schedule's R actions recompute, see the module
        doc); selective recompute stays Megatron's own, it has no R."""
        rec = dict(recompute_granularity="selective" if self.selective_recompute else None,
                   recompute_method=None, recompute_num_layers=None)
        return {**self.config_overrides, **rec}

    def chunk_config(self, config, chunk: int = 0):
        """A copy of ``config`` with this chunk's recompute settings (:meth:`chunk_overrides`)."""
        cfg = copy.copy(config)
        for k, v in self.chunk_overrides(chunk).items():
            if k.startswith("recompute"):
                setattr(cfg, k, v)
        return cfg


def context_parallel_problem(cp: int) -> str | None:
    """Why Megatron context parallelism of degree ``cp`` cannot run in this process (None:
    it can): it needs Transformer Engine's attention, which needs a CUDA GPU."""
    if cp <= 1:
        return None
    import importlib.util

    import torch
    if not torch.cuda.is_available():
        return (f"context parallelism (cp={cp}) needs Transformer Engine's attention on a CUDA "
                f"GPU and this machine has none; run it where GPUs are (docs/megatron.md, "
                f"'Expert, context and Ulysses parallelism')")
    if importlib.util.find_spec("transformer_engine") is None:
        return (f"context parallelism (cp={cp}) needs Transformer Engine (pip install "
                f"transformer_engine[pytorch]); see docs/megatron.md")
    return None


def layout_for(schedule: Schedule, layers_per_stage):
    if schedule.round_robin:
        return layout_string(layers_per_stage)   # Megatron's own layout; stage order == vpp-major
    return StageLayerLayout(stage_layer_lists(layers_per_stage), schedule.placement)


def plan_overrides(plan, schedule: Schedule | None = None) -> tuple[dict, list, object]:
    """TransformerConfig overrides, the layers an R re-runs per stage and the layout of
    ``plan`` run with ``schedule`` (default the plan's; both with the plan's R actions)."""
    sched = plan_schedule(plan, schedule)
    S, d = sched.num_stages, sched.num_ranks
    lps = list(plan.layers_per_stage)
    if len(lps) != S:
        raise ScheduleError(f"plan.layers_per_stage has {len(lps)} entries but schedule "
                            f"{plan.schedule!r} has {S} stages")
    if len(plan.recompute_per_stage) not in (0, S):
        raise ScheduleError(f"plan.recompute_per_stage has {len(plan.recompute_per_stage)} "
                            f"entries, expected {S}")
    layout = layout_for(sched, lps)
    vpp = sched.chunks_per_rank if S > d else None
    over = dict(num_layers=sum(lps), tensor_model_parallel_size=plan.tp,
                expert_model_parallel_size=plan.ep, expert_tensor_parallel_size=plan.etp,
                context_parallel_size=plan.cp,
                sequence_parallel=bool(plan.sequence_parallel and plan.tp > 1),   # needs tp > 1
                pipeline_model_parallel_size=d, virtual_pipeline_model_parallel_size=vpp,
                pipeline_model_parallel_layout=layout,
                microbatch_group_size_per_vp_stage=sched.meta.get(
                    "microbatch_group_size_per_vp_stage", d) if vpp else None)
    if vpp is None:
        over.pop("microbatch_group_size_per_vp_stage")
    return over, recompute_layers(sched, lps), layout


def start_line(plan, sched: Schedule) -> str:
    """What the Megatron runtime prints once at start (rank 0): the plan, its schedule, the
    stage -> pp rank placement and the layers of each pp rank's model chunks."""
    opts = "".join(f" {k}={v}" for k, v in sorted(plan.schedule_options.items()))
    chunks = [[int(plan.layers_per_stage[s]) for s in sched.stages_of(r)] for r in range(sched.num_ranks)]
    return (f"ds_autoplan: plan {plan.model or '(unnamed)'} tp={plan.tp} pp={plan.pp} dp={plan.dp} "
            f"micro-batch {plan.micro_batch_size} x {plan.num_microbatches}; schedule "
            f"{plan.schedule}{opts} ({sched.num_stages} stages); placement {sched.placement_kind} "
            f"stage->pp rank {list(sched.placement)}; layers per chunk (per pp rank) {chunks}")


def announce(plan, sched: Schedule) -> None:
    """Print :func:`start_line` on global rank 0 (every rank when no process group exists)."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(start_line(plan, sched), flush=True)


def initialize(plan, schedule: Schedule | None = None, **model_parallel_kwargs) -> MegatronSetup:
    """``parallel_state.initialize_model_parallel`` with the plan's sizes (torch.distributed
    must be initialised; world = tp·cp·pp·dp, ep·etp dividing tp·cp·dp), and the
    TransformerConfig overrides for this rank.  ``cp`` > 1 is refused without CUDA and
    Transformer Engine (:func:`context_parallel_problem`).

    Build each local chunk ``c`` as ``GPTModel(config=setup.chunk_config(cfg, c),
    pre_process=setup.pre_process(c), post_process=setup.post_process(c),
    vp_stage=setup.vp_stage(c), ...)`` where ``cfg = TransformerConfig(**base,
    **setup.config_overrides)``.
    """
    from megatron.core import parallel_state

    import torch.distributed as dist

    sched = plan_schedule(plan, schedule)
    over, rec_layers, layout = plan_overrides(plan, sched)
    problem = context_parallel_problem(plan.cp)
    if problem:
        raise ScheduleError(problem)
    check_world(plan, dist.get_world_size(), sched.num_ranks, "Megatron runtime")
    # the model-parallel groups get the timeout of every group ds_autoplan creates
    pg = process_group_timeout((plan.predicted or {}).get("iteration_time_s"))
    model_parallel_kwargs.setdefault("distributed_timeout_minutes",
                                     max(1, math.ceil(pg.total_seconds() / 60)))
    if not sched.round_robin:
        # the embedding (first stage) and the output layer (last stage) live where the
        # placement puts them (a V: both on pp rank 0), not on Megatron's first and last rank
        ends = sorted({sched.placement[0], sched.placement[-1]})
        model_parallel_kwargs.setdefault("get_embedding_ranks",
                                         lambda pp_ranks, *a: [pp_ranks[r] for r in ends])
    with startup_watchdog("Megatron model-parallel initialisation"):
        parallel_state.initialize_model_parallel(**{
            "tensor_model_parallel_size": plan.tp, "pipeline_model_parallel_size": sched.num_ranks,
            "virtual_pipeline_model_parallel_size": over["virtual_pipeline_model_parallel_size"],
            "context_parallel_size": plan.cp, "expert_model_parallel_size": plan.ep,
            "expert_tensor_parallel_size": plan.etp, **model_parallel_kwargs})
    announce(plan, sched)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return MegatronSetup(sched, rank, over, sched.stages_of(rank), rec_layers, layout,
                         bool(plan.selective_recompute))


def megatron_args(plan) -> list[str]:
    """Megatron-LM command-line flags for ``plan`` (what ``pretrain_gpt.py`` accepts), as an
    argv list; the planner's emitter (ds_autoplan.emit.megatron) is the one source.  A V
    placement cannot be written as flags (see docs/megatron.md): only its sizes are emitted
    and the patched script applies the rest from the plan."""
    return [tok for flag in emit_megatron_args(plan) for tok in flag.split(" ", 1)]

