"""Megatron-LM's ``pretrain_gpt.py`` running a ds_autoplan plan.

``patches/megatron-lm-pretrain_gpt.patch`` makes the script call :func:`install_from_env`
before ``pretrain()`` when ``$DS_AUTOPLAN_PLAN`` names a ``plan.json``.  It hooks Megatron-LM at
four points, all reached through Megatron's own code path (``pretrain`` -> ``validate_args`` ->
``get_model(model_provider)`` -> ``train_step``):

* ``validate_args``: after Megatron-LM's own checks, the arguments are compared with the plan
  (sizes, micro-batches, layer split, virtual stages) and what cannot run is refused at start-up
  with one message on every rank (before any process group exists, so nothing can hang);
* ``get_forward_backward_func``: returns the plan's schedule (:func:`install`); the loss dicts
  are handed to the last pipeline rank, where ``train_step`` averages and logs them (a V plan
  computes the loss on pp rank 0);
* V placements (stage ``i`` and ``2P-1-i`` on pp rank ``i``): ``args.pipeline_model_parallel_layout``
  becomes a :class:`StageLayerLayout` (layer counts and offsets in stage order), ``get_model``
  gives ``model_provider`` the plan's ``pre_process``/``post_process`` per chunk, and
  ``parallel_state.is_pipeline_first/last_stage(ignore_virtual=False, vp_stage=c)`` answer for
  the chunk's stage (``pretrain_gpt.get_batch`` and the data loaders ask them);
* recomputation: the plan's ``recompute_per_stage`` runs as the schedule's R actions (the
  pass both runtimes share, ``schedule.passes.plan_schedule``), so after ``get_model`` every
  chunk's config has Megatron's full-layer recompute (``--recompute-granularity full``, which
  the emitted flags carry for Megatron's own schedules) turned off -- nothing is recomputed
  twice; selective recompute (``--recompute-granularity selective``) has no R and stays
  Megatron's own; ``--recompute-*`` flags other than the plan's are refused;
* schedules with W actions: ``gpt_builders``' local layer spec gets split-aware linear layers;
* MoE: the expert and context parallel sizes are checked against the plan; a plan with
  context parallelism (cp > 1) is refused at start-up where it cannot run (no CUDA GPU or no
  Transformer Engine: Megatron's CP attention is TE's); megatron-core's MoE router is made
  to run without Transformer Engine (:func:`~ds_autoplan.runtime.megatron.shim.moe_without_te`).
"""
from __future__ import annotations

import functools
import json
import os
import sys

import torch

from ..errors import UserError
from ..runtime.common.collectives import broadcast_text
from ..schedule import Kind, Schedule
from ..schedule.passes import plan_schedule

ENV = "DS_AUTOPLAN_PLAN"


class MegatronLMPlanError(UserError):
    """The Megatron-LM arguments and the plan cannot run together."""


def install_from_env() -> None:
    """What the patched ``pretrain_gpt.py`` calls: install the plan named by ``$DS_AUTOPLAN_PLAN``."""
    from ..env import env_str
    from ..plan import Plan
    path = env_str(ENV)
    if path is None:
        return      # no plan named: the script runs as Megatron-LM would
    try:
        plan = Plan.load(path)
    except (OSError, ValueError, KeyError) as e:
        _refuse(f"cannot read the plan {path} (${ENV}): {e}")
    from ..runtime import replan
    state = replan.from_env()           # ds-autoplan launch --calibrate N (runtime/replan.py)
    install_megatron_lm(plan, measured=state is not None)
    if state is not None:
        _hook_replan(state)


def _hook_replan(path: str) -> None:
    """``launch --calibrate N`` (runtime/replan.py) in Megatron-LM's loop: a start after a
    switch loads the switch's checkpoint (ds_autoplan's plan-independent one) when Megatron-LM
    has built the model and optimizer, and goes on from its step (the data loaders skip the
    samples of the steps done, as on Megatron's own resume); after the record, rank 0 decides,
    and on a switch every rank saves the checkpoint as the next step begins (after the
    optimizer step of the last) and ends the script, the process group torn down."""
    import megatron.training.training as mt
    from megatron.training import get_args

    from ..runtime import replan
    from ..runtime.megatron.checkpoint import load_checkpoint, save_checkpoint
    held, deciding = {}, replan.read_state(path)["phase"] != "done"
    setup = mt.setup_model_and_optimizer

    def setup_resumed(*a, **k):
        model, optimizer, scheduler = setup(*a, **k)
        held.update(model=model, optimizer=optimizer, scheduler=scheduler)
        r = replan.read_state(path).get("resume")
        if r:
            meta = load_checkpoint(model, optimizer, os.path.join(r["dir"], r["tag"]), scheduler=scheduler)
            args = get_args()
            args.iteration, args.consumed_train_samples = int(meta["step"]), 0   # Megatron counts them again
        return model, optimizer, scheduler
    mt.setup_model_and_optimizer = setup_resumed

    def save(step):
        def write(folder, tag):
            from ..plan import Plan
            save_checkpoint(held["model"], held["optimizer"], os.path.join(folder, tag),
                            plan=Plan.load(os.environ[ENV]), step=step, scheduler=held["scheduler"],
                            client_state={"replan": tag})
        return write

    def at_record(rec):
        step = get_args().curr_iteration + 1       # this step's optimizer step is still to come
        d = replan.decided(path, step)
        if d["switch"]:
            def at_next_step():
                rec.on_step = None
                if replan.saved(path, d["tag"], save(step)):
                    replan.restart(path, d["tag"])
            rec.on_step = at_next_step
    if deciding:
        _watch_records.append(at_record)

    train = mt.train

    def train_until_restart(*a, **k):
        try:
            return train(*a, **k)
        except replan.Restart:
            from ..runtime.ending import finish
            finish(0)                   # the group torn down, the rank ended (runtime/ending.py)
    mt.train = train_until_restart


_watch_records: list = []       # _hook_replan's: called with the run's Recorder once it exists


def install_megatron_lm(plan, measured: bool = False) -> Schedule | None:
    """Hook Megatron-LM's training loop (see the module docstring); returns the schedule
    (None for a plan without pipeline parallelism, which needs no hook, unless ``measured``:
    ``launch --calibrate`` times its steps in our function, pp=1 too)."""
    from ..runtime.megatron.setup import context_parallel_problem
    problem = context_parallel_problem(plan.cp)
    if problem:
        _refuse(problem)

    import megatron.training.initialize as mi
    import megatron.training.training as mt

    from ..runtime.megatron import install
    from ..runtime.megatron.shim import moe_without_te

    moe_without_te()
    if plan.pp < 2 and not measured:
        return None     # no pipeline: Megatron's own no-pipelining function (and flags) run it
    sched = plan_schedule(plan)
    validate = mi.validate_args

    def validate_args(args, defaults={}):   # noqa: B006 -- Megatron-LM's own signature
        out = validate(args, defaults)
        problems = check_args(args, plan, sched) + _layout_problems(plan)
        if problems:
            _refuse(f"the Megatron-LM arguments do not fit the plan {os.environ.get(ENV, '')}: "
                    + "; ".join(problems))
        if not sched.round_robin:
            args.pipeline_model_parallel_layout = _v_layout(plan, sched)
        return out
    mi.validate_args = validate_args
    install(plan, schedule=sched,
            wrap=lambda fb: _LossesToLastRank(fb, sched.placement[sched.num_stages - 1]))
    if not sched.round_robin:
        _placement_predicates(sched)
    _hook_get_model(mt, plan, sched)
    if any(a.kind == Kind.W for r in sched.ranks for a in r):
        _split_local_spec()
    return sched


def _layout_problems(plan) -> list[str]:
    """The launch's nodes (torchrun's ``LOCAL_WORLD_SIZE`` ranks per node, ``GROUP_RANK``)
    against the node layout the plan was costed on (``Plan.layout_conflict``)."""
    from ..profile.detect import launch_layout
    lay = launch_layout()
    if lay["world"] % lay["local_size"]:
        return []
    nodes = lay["world"] // lay["local_size"]
    conflict = plan.layout_conflict(nodes, lay["local_size"])
    return [f"the launch's {nodes} node{'s' if nodes > 1 else ''} x {lay['local_size']} ranks: "
            f"{conflict}; plan it for this launch (ds-autoplan plan --cluster auto --nodes {nodes})"] \
        if conflict else []


def _split_local_spec() -> None:
    """A schedule with W actions (ZB-H1, V-ZB, ...) gets a real B/W split with
    ``--transformer-impl local``: the local layer spec ``gpt_builders`` asks for (and, for MoE
    models, its local decoder block spec, experts included) gets split-aware linear layers
    (:func:`split_backward_spec`).  Transformer-Engine specs are left
    as they are (B then does the whole backward and W has nothing to do: exact, no overlap)."""
    from ..runtime.megatron import split_backward_spec
    builders = sys.modules.get("gpt_builders")
    local = getattr(builders, "get_gpt_layer_local_spec", None)
    if local is None:
        return
    builders.get_gpt_layer_local_spec = lambda *a, **k: split_backward_spec(local(*a, **k))
    block = getattr(builders, "get_gpt_decoder_block_spec", None)   # MoE models (--num-experts)
    if block is not None:
        def split_block(config, use_transformer_engine, *a, **k):
            spec = block(config, use_transformer_engine, *a, **k)
            return spec if use_transformer_engine else split_backward_spec(spec)
        builders.get_gpt_decoder_block_spec = split_block


def check_args(args, plan, sched: Schedule) -> list[str]:
    """Every way Megatron-LM's (validated) ``args`` disagree with ``plan``, as messages."""
    d, S = sched.num_ranks, sched.num_stages
    v = sched.chunks_per_rank
    got = {"--pipeline-model-parallel-size": (args.pipeline_model_parallel_size, d),
           "--tensor-model-parallel-size": (args.tensor_model_parallel_size, plan.tp),
           "--expert-model-parallel-size": (getattr(args, "expert_model_parallel_size", 1), plan.ep),
           "--expert-tensor-parallel-size": (getattr(args, "expert_tensor_parallel_size", None)
                                             or args.tensor_model_parallel_size, plan.etp),
           "--context-parallel-size": (getattr(args, "context_parallel_size", 1), plan.cp),
           "--micro-batch-size": (args.micro_batch_size, plan.micro_batch_size),
           "--num-layers": (args.num_layers, sum(plan.layers_per_stage)),
           "virtual stages per pipeline rank": (args.virtual_pipeline_model_parallel_size or 1, v)}
    out = [f"{k} is {a}, the plan has {b}" for k, (a, b) in got.items() if a != b]
    n = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if n != plan.num_microbatches:
        out.append(f"--global-batch-size {args.global_batch_size} gives {n} micro-batches per "
                   f"step (micro-batch {args.micro_batch_size}, data-parallel "
                   f"{args.data_parallel_size}), the plan's schedule is for {plan.num_microbatches}")
    if args.rampup_batch_size:
        out.append("--rampup-batch-size changes the micro-batch count; a plan's schedule has a fixed one")
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        out.append("--overlap-moe-expert-parallel-comm runs Megatron's combined 1F1B, not the plan's schedule")
    out += _recompute_problems(args, plan)
    if not sched.round_robin:
        out += _v_problems(args)
    elif not out:
        counts = _megatron_counts(args, S)
        if counts is not None and counts != list(plan.layers_per_stage):
            out.append(f"Megatron builds {counts} layers per stage, the plan has "
                       f"{list(plan.layers_per_stage)} (pass the plan's --pipeline-model-parallel-layout)")
    return out


def _recompute_problems(args, plan) -> list[str]:
    """The --recompute-* flags must be the plan's (``ds-autoplan plan --emit megatron-args``):
    under the patch the plan's R actions do the full recompute whatever the flags say, and
    selective recompute is fixed when the layers are built, so flags that say otherwise would
    run something other than what was planned and costed."""
    from ..emit.megatron import megatron_config
    keys = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    want = megatron_config(plan)
    got, exp = [getattr(args, k, None) for k in keys], [want[k] for k in keys]
    if got == exp:
        return []
    flag = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in zip(keys, exp) if v is not None)
    return [f"recompute flags {dict(zip(keys, got))} differ from the plan's "
            f"({flag or 'no recompute flags'}; per stage "
            f"{want['autoplan']['recompute_layers_per_stage']} layers run as R actions)"]


def _v_problems(args) -> list[str]:
    out = []
    if not args.untie_embeddings_and_output_weights:
        out.append("a V-shape plan keeps the embedding (first stage) and the output layer (last "
                   "stage) in two model chunks of pp rank 0, which Megatron cannot tie: add "
                   "--untie-embeddings-and-output-weights")
    if args.pipeline_model_parallel_layout is not None:
        out.append("a V-shape plan takes its layout from the plan: drop --pipeline-model-parallel-layout")
    if args.tensor_model_parallel_size > 1:
        out.append("a V-shape plan with tensor parallelism is not supported in pretrain_gpt.py "
                   "(get_batch_on_this_tp_rank gives pp rank 0's other tensor-parallel ranks only "
                   "the first stage's inputs, not the last stage's labels)")
    if args.use_legacy_models:
        out.append("a V-shape plan needs megatron-core models (drop --use-legacy-models)")
    if args.mtp_num_layers:
        out.append("a V-shape plan cannot place multi-token prediction layers (--mtp-num-layers)")
    return out


def _megatron_counts(args, num_stages: int) -> list[int] | None:
    """Decoder layers per stage (vpp-major order) that Megatron-LM will build, or None when
    the arguments use a split this check does not model (first/last-stage counts)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    if args.pipeline_model_parallel_layout is not None:
        stages = PipelineParallelLayerLayout.parse_str_to_list(args.pipeline_model_parallel_layout)
        return [st.count(LayerType.decoder) for st in stages]
    if args.decoder_first_pipeline_num_layers or args.decoder_last_pipeline_num_layers:
        return None
    return [args.num_layers // num_stages] * num_stages


def _v_layout(plan, sched: Schedule):
    from ..runtime.megatron.setup import StageLayerLayout, stage_layer_lists
    return StageLayerLayout(stage_layer_lists(plan.layers_per_stage), sched.placement)


class _LossesToLastRank:
    """The forward_backward_func, with the loss dicts sent from the pp rank that computes the
    loss to the last pp rank (where Megatron-LM's ``train_step`` reads them)."""

    def __init__(self, fb, loss_rank: int):
        self.fb, self.loss_rank = fb, loss_rank
        self.__signature__ = getattr(fb, "__signature__", None)

    def __call__(self, **kwargs):
        from megatron.core import parallel_state
        losses = self.fb(**kwargs)
        rec = getattr(self.fb, "recorder", None)
        while rec is not None and _watch_records:       # the record's steps are still to come
            rec.on_record = functools.partial(_watch_records.pop(), rec)
        group = parallel_state.get_pipeline_model_parallel_group()
        last = group.size() - 1
        if self.loss_rank == last:
            return losses
        me = group.rank()
        # JSON (dtype, shape, values: exact for every float and int dtype), not a pickle
        mine = json.dumps([{k: [str(v.dtype).removeprefix("torch."), list(v.shape),
                                v.detach().reshape(-1).tolist()] for k, v in x.items()}
                           for x in losses]) if me == self.loss_rank else ""
        rows = json.loads(broadcast_text(mine, src=self.loss_rank, group=group))
        if me != last:
            return losses
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        return [{k: torch.tensor(vals, dtype=getattr(torch, dt), device=dev).reshape(shape)
                 for k, (dt, shape, vals) in x.items()} for x in rows]


def _stage(sched: Schedule, vp_stage) -> int:
    """The plan's stage held by this pp rank's model chunk ``vp_stage``."""
    from megatron.core import parallel_state as ps
    return sched.stages_of(ps.get_pipeline_model_parallel_rank())[vp_stage or 0]


def _placement_predicates(sched: Schedule) -> None:
    """``is_pipeline_first/last_stage(ignore_virtual=False, vp_stage=c)`` answer for the stage
    of chunk ``c`` in the plan's placement (V: chunk 1 of pp rank 0 is the last stage)."""
    from megatron.core import parallel_state as ps
    last_stage = sched.num_stages - 1
    first, last = ps.is_pipeline_first_stage, ps.is_pipeline_last_stage

    def is_first(ignore_virtual=True, vp_stage=None):
        return first(ignore_virtual, vp_stage) if ignore_virtual or vp_stage is None \
            else _stage(sched, vp_stage) == 0

    def is_last(ignore_virtual=True, vp_stage=None):
        return last(ignore_virtual, vp_stage) if ignore_virtual or vp_stage is None \
            else _stage(sched, vp_stage) == last_stage
    ps.is_pipeline_first_stage, ps.is_pipeline_last_stage = is_first, is_last


def _hook_get_model(mt, plan, sched: Schedule) -> None:
    """Megatron-LM's ``get_model`` with chunk ``c`` of pp rank ``r`` built as the plan's stage
    ``sched.stages_of(r)[c]``: for a V placement ``model_provider`` gets that stage's
    ``pre_process``/``post_process``; then every chunk's full-layer recompute is turned off
    (:func:`_full_recompute_off`) and rank 0 logs the plan, schedule, placement and layers per
    chunk that run (``runtime.megatron.setup.start_line``)."""
    from ..runtime.megatron.setup import announce
    v, last_stage = not sched.round_robin, sched.num_stages - 1
    get_model = mt.get_model

    def get_model_planned(model_provider_func, *args, **kwargs):
        def provider(pre_process=True, post_process=True, vp_stage=None, **kw):
            if v:
                s = _stage(sched, vp_stage)
                pre_process, post_process = s == 0, s == last_stage
            return model_provider_func(pre_process=pre_process, post_process=post_process,
                                       vp_stage=vp_stage, **kw)
        model = get_model(provider, *args, **kwargs)
        _full_recompute_off(model)
        announce(plan, sched)
        return model
    mt.get_model = get_model_planned


def _full_recompute_off(model) -> None:
    """The plan's schedule recomputes with R actions: Megatron's full-layer recompute
    (``--recompute-granularity full``, read by its TransformerBlock at forward time) would
    recompute the same layers a second time, so it is switched off in every chunk's config.
    Selective recompute is set up when the layers are built and has no R: it stays."""
    from megatron.core.utils import unwrap_model
    for chunk in model:
        cfg = unwrap_model(chunk).config
        if cfg.recompute_granularity == "full":
            cfg.recompute_granularity = cfg.recompute_method = cfg.recompute_num_layers = None


def _refuse(msg: str):
    """One line on stderr and exit status 2, before any collective call.  Every rank fails the
    same check and prints the same line (a launcher may stop the other ranks as soon as one
    exits, so no single rank can be relied on to print it)."""
    print(f"ds_autoplan: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)
