"""Run any ds_autoplan schedule inside DeepSpeed's ``PipelineEngine`` (docs/runtimes.md §1.4,
option A; docs/schedules.md §6.1).

``train_batch`` / ``eval_batch`` run the rank's lowered action list (an
:class:`ActionSchedule`) through the adapter's dispatch table, action kind -> the engine
method that runs it (docs/schedules.md §6.1); the engine keeps per-(stage, micro-batch)
state (``runtime.common.Slots``) instead of DeepSpeed's "latest value" attributes, so F and
B of a micro-batch may be arbitrarily far apart and a rank may hold any number of stages.
Nothing here looks at a schedule's name.

After the list: the step's sends are completed, then DeepSpeed's own once-per-step work --
the tied-gradient reduction (only with tied modules), the data-parallel gradient reduction
(only with something to reduce: more than one data-parallel replica, ZeRO or MoE) and the
optimizer step -- and ``train_batch``'s loss aggregation: with one data-parallel replica
and no additional losses, the loss rank's broadcast of the step's loss is posted as soon as
its last forward of the loss stage has run and the other ranks' receive where they first
wait for a peer (or after their list), so no rank waits for it at the step's end.  Transfers are
``torch.distributed`` ``isend``/``irecv`` between global ranks: a SEND is issued and not
waited for, a RECV posts the receive and the consuming F/B waits for it, exactly the
semantics ``ds_autoplan.schedule.lower`` orders for.

F and B call the stage's layers and autograd directly where DeepSpeed's
``DeepSpeedEngine.forward`` / ``backward`` would do nothing else for the engine's
configuration (:func:`wrapper_work`, decided once when the engine is built); otherwise they go
through those wrappers as ``PipelineEngine`` does.
"""
from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch.nn.modules import module as _nn_module
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from ...env import env_float
from ...schedule import Kind, Schedule
from .. import splitgrad
from ..common import (Slots, StepState, accept, dispatch_table, posting_order, recomputed,
                     waits_for)
from ..common import record
from ..common.memory import ActionMemory
from ..common.trace import clock
from ..memtrack import MemTracker, hold
from ...plan import Plan
from ..rng import RngState
from ..watchdog import PG_MARGIN, StepWatchdog, step_timeout
from .checkpoint import engine_load, engine_save
from .module import AutoplanPipelineModule


class PipelineRankError(RuntimeError):
    """A peer rank failed or stopped answering; raised instead of hanging."""


# the adapter's dispatch table: action kind -> the AutoplanEngine method that runs it
HANDLERS = dispatch_table({
    Kind.F: "_run_forward", Kind.B: "_run_backward_input", Kind.BW: "_run_backward",
    Kind.W: "_run_weight", Kind.R: "_run_recompute", Kind.SEND_F: "_send_activation",
    Kind.RECV_F: "_recv_activation", Kind.SEND_B: "_send_grad", Kind.RECV_B: "_recv_grad"},
    "DeepSpeed adapter")


class ActionSchedule:
    """One rank's action list for one step (``train``: then the gradient reduction and the
    optimizer step), with the pipeline rank each action waits for (the step watchdog's)."""

    def __init__(self, actions, placement, train=True):
        self.actions, self.train = tuple(actions), train
        self.waits = tuple(waits_for(a, placement) for a in self.actions)


def wrapper_work(engine) -> list[str]:
    """What ``DeepSpeedEngine.forward`` / ``backward`` (DeepSpeed 0.19.8, runtime/engine.py)
    would do for ``engine`` besides calling its module and autograd; empty: nothing, and F/B
    call them directly (the values are the same, bit for bit: the loss is divided by the
    accumulation steps as ``backward`` does, and ``AutoplanEngine._backward_prologue_per_tensor``
    leaves output gradients as they are).  What the wrappers do, and when:

    - ``forward``: a ZeRO optimizer's ``clear_backward_seen_flag``; the autotuner's model-info
      profile (then exits); DeepCompile's compile passes and ZeRO-3 eager fallback; the
      ``torch_autocast`` context (and turning off an outer autocast: checked per call);
      output backward hooks whose first call runs ``_backward_prologue`` -- engine timers
      (``wall_clock_breakdown`` / flops profiler), ``memory_breakdown``'s print, DeepCompile's
      prologue, a ZeRO optimizer's ``backward_prologue`` / ``enter_backward`` / post-backward
      callback and accumulation boundary (ZeRO-1/2/3 and ``BF16_Optimizer``, which DeepSpeed
      uses for bf16 pipelines, are ZeRO optimizers).
    - ``backward``: an optimizer assertion; the running-backward count under a lock and the
      engine-backward graph tracker (read by the two prologues above); the unmanaged
      accumulation count; loss / accumulation steps; loss scaling by a ZeRO or fp16 optimizer
      or the autocast ``GradScaler``; compiled autograd (``compile()``); then
      ``_backward_epilogue``: timers, ``BF16_Optimizer.backward_epilogue``, the gradient
      all-reduce where ``enable_backward_allreduce`` (``PipelineEngine`` turns it off), a ZeRO
      optimizer's epilogue / ``exit_backward``, DeepCompile's epilogue, ``memory_breakdown``.

    The module's own forward hooks (DeepSpeed's ``_forward_prologue`` / ``_forward_epilogue``:
    forward timers, throughput timer, flops profiler, random-LTD) are :func:`hook_work`'s
    decision.  Micro-step counters and accumulation boundaries move in ``step()``, not here."""
    opt = engine.optimizer
    why = []
    if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, DeepSpeedOptimizer):
        why.append(f"optimizer {type(opt).__name__} (a DeepSpeed wrapper or none)")
    checks = {"ZeRO": engine.zero_optimization(), "fp16": engine.fp16_enabled(),
              "torch_autocast": engine.torch_autocast_enabled(),
              "DeepCompile": engine.is_deepcompile_enabled(),
              "compile()": engine.is_compiled or engine._is_compiled_autograd_enabled,
              "engine timers": bool(engine.engine_timers.backward_timers),
              "memory_breakdown": engine.memory_breakdown(),
              "autotuning profile": engine.autotuning_profile_model_info(),
              "unmanaged gradient accumulation": not engine.managed_gradient_accumulation(),
              "backward all-reduce": engine.enable_backward_allreduce,
              "ZenFlow": bool(engine.zenflow)}
    return why + [k for k, on in checks.items() if on]


def hook_work(engine) -> list[str]:
    """What DeepSpeed's forward hooks on the engine's module (``DeepSpeedEngine.
    _forward_prologue`` / ``_forward_epilogue``, DeepSpeed 0.19.8, registered at engine set-up)
    would do for ``engine`` besides starting the throughput timer (``tput_timer.start()``
    without a training data loader, which ``PipelineEngine._exec_forward_pass`` also does
    before every forward); empty: a direct F (``ap_direct``) starts that timer itself and calls
    the module's ``forward``, as long as those two hooks are the module's only ones (checked
    per call: a hook the user adds later takes ``nn.Module.__call__`` again).  The pieces:
    ``see_memory_usage`` (``memory_breakdown``), the flops profiler, random-LTD's sequence
    update, the forward timers (``wall_clock_breakdown``), ZeRO-3's parameter discovery,
    fp16 auto-cast of the inputs and the autotuner's profile."""
    checks = {"memory_breakdown": engine.memory_breakdown(),
              "flops profiler": engine.flops_profiler_enabled(),
              "random-LTD": engine.random_ltd_enabled(),
              "forward timers": bool(engine.engine_timers.forward_timers),
              "ZeRO-3": engine.zero_optimization_partition_weights(),
              "fp16 auto-cast": engine.fp16_auto_cast(),
              "autotuning profile": engine.autotuning_profile_model_info()}
    return [k for k, on in checks.items() if on]


def _as_list(x):
    return [x] if torch.is_tensor(x) else list(x)


def _detached_leaf(x):
    def one(t):
        return t.detach().requires_grad_(t.is_floating_point())
    return one(x) if torch.is_tensor(x) else tuple(one(t) for t in x)


def _cloned(x):
    """What a stage's layers see of a received or handed-over input: a clone, as DeepSpeed's
    ``_exec_forward_pass`` does, so a first layer that works in place (``nn.ReLU(inplace=True)``)
    never writes into the leaf whose gradient is sent back."""
    return x.clone() if torch.is_tensor(x) else tuple(t.clone() for t in x)


class AutoplanEngine(PipelineEngine):
    """``PipelineEngine`` that executes the action lists of a ds_autoplan schedule."""

    def __init__(self, *args, **kwargs):
        self._ap_ready = False
        super().__init__(*args, **kwargs)
        mod = self.module
        if not isinstance(mod, AutoplanPipelineModule):
            raise TypeError("AutoplanEngine needs an AutoplanPipelineModule (use ds_autoplan.initialize)")
        sched: Schedule = mod.autoplan_schedule
        if sched is None:
            raise ValueError("the AutoplanPipelineModule carries no schedule")
        self.S = sched.num_stages
        self._ap_globals = [self.grid.stage_to_global(r) for r in range(self.num_stages)]
        self._world = dist.group.WORLD      # p2p by global rank, without the per-call checks
        # gloo's posts never block: a run of transfers goes out sends first (posting_order)
        self._ap_grouped = dist.get_backend(self._world) == "gloo"
        self.placement = tuple(mod._ap_placement)
        self._loss_rank = self.placement[-1]
        self._ap_loss_src = self.grid.stage_to_global(self._loss_rank)
        self._loss_due = False           # the step's loss broadcast (its send or receive) is still to post
        self._split = False
        self._take_schedule(sched, self.micro_batches)
        self.memtracker = MemTracker(exclude=list(mod.parameters()) + list(mod.buffers())) \
            if mod.track_memory else None
        self.ap_mem_trace: list = []      # (action, bytes after it) of the last batch, if tracked
        planned = (self._config.pipeline or {}).get("autoplan") or {}
        # the run's record of itself (runtime/common/record.py): measured.json beside plan.json
        P = self.num_stages
        self.ap_recorder = record.from_env(
            Plan.from_dict(planned) if planned else None, self.stage_id, "deepspeed-pipeline",
            state_bytes=lambda: record.model_state_bytes(self.module, self.optimizer),
            peers=(self._ap_globals[self.stage_id - 1] if self.stage_id > 0 else None,
                   self._ap_globals[self.stage_id + 1] if self.stage_id + 1 < P else None))
        self.ap_memory = ActionMemory(self.memtracker, self.ap_recorder)   # (delta, rise), times
        predicted = planned.get("predicted") or {}
        # the step watchdog (runtime/watchdog.py) bounds a step and names what it waits for;
        # a p2p wait gives up (PipelineRankError) only after it, unless set shorter
        self.ap_watchdog = StepWatchdog(step_timeout(predicted.get("iteration_time_s")),
                                        "DeepSpeed pipeline", global_rank_of=self._peer)
        self._p2p_timeout = datetime.timedelta(seconds=env_float(
            "DS_AUTOPLAN_P2P_TIMEOUT", (self.ap_watchdog.timeout or 600.0) + PG_MARGIN))
        self._slots = Slots()        # (stage, micro-batch) -> runtime.common.Slot
        self._sends: list = []           # (work, what, peer) of the sends not known complete
        self._loss_bcast = None          # (work, losses, agg) of the step's loss broadcast
        self._meta_sent: set = set()
        self._recv_meta: dict = {}
        self._batches: dict = {}
        self._batch_used: dict = {}
        self._next_mb = 0
        # per-step state of dynamic micro-batching (dynamic.py): shape plan, loss factors
        self.ap_shape_plan = None        # (stage, mb) -> (is_tensor, [(dtype, shape)]) or None
        self.ap_loss_factors = None      # per micro-batch factor on the loss stage's loss
        self.ap_swap: dict = {}          # local stage -> runtime.swap.Swapper (set_swap_policy)
        self._step_state = None          # StepState of the next train_batch (set_step)
        self.ap_table = self._dispatch()        # kind -> callable(action), HANDLERS
        self._decide_calls()
        self._ap_ready = True
        if self.training_data and (self.is_first_stage() or self.is_last_stage()) \
                and getattr(self, "data_iterator", None) is None:
            # only where PipelineEngine.__init__ has not: a second loader would draw from the
            # global random stream again (DataLoader's base seed) and shift dropout masks
            self._build_data_iter(self.training_data)

    def set_step_schedule(self, sched: Schedule):
        """Run the next ``train_batch`` with ``sched`` (any micro-batch count; lowered or
        not), e.g. one DynaPipe iteration plan.  Sets ``gradient_accumulation_steps`` to its
        micro-batch count through DeepSpeed's ``set_train_batch_size``."""
        if sched.num_ranks != self.num_stages or tuple(sched.placement) != self.placement:
            raise ValueError(f"step schedule for {sched.num_ranks} ranks with placement "
                             f"{tuple(sched.placement)}; the engine has {self.num_stages} pipeline "
                             f"ranks with placement {self.placement}")
        n = sched.num_microbatches
        self._take_schedule(self.module.with_recompute(sched), n)
        if n != self.micro_batches:
            self.set_train_batch_size(self.train_micro_batch_size_per_gpu() * n * self.dp_world_size)
            self.micro_batches = n

    def set_step(self, state: StepState, shapes=None):
        """Per-step state for the next ``train_batch`` only (``runtime.common.StepState``, as
        the Megatron adapter's ``set_step``): its schedule (:meth:`set_step_schedule`), its
        micro-batch shapes -- ``shapes(stage, (mbs, length)) -> (is_tensor, [(dtype, shape)])``
        is the activation entering a stage, so receives need no handshake -- and its loss
        weights (on the loss rank micro-batch m's loss is multiplied by n·w_m)."""
        if state.schedule is not None:
            self.set_step_schedule(state.schedule)
        n = self.micro_batches
        state.check(n)
        if state.shapes is not None and shapes is None:
            raise ValueError("StepState.shapes needs shapes=: (stage, (mbs, length)) -> "
                             "(is_tensor, [(dtype, shape)])")
        self.ap_shape_plan = None if state.shapes is None else \
            (lambda stage, mb: shapes(stage, state.shapes[mb]))
        self.ap_loss_factors = None if state.loss_weights is None else \
            [state.loss_factor(m, n) for m in range(n)]
        self._step_state = state

    def _dispatch(self) -> dict:
        """The dispatch table: kind -> the engine's handler, taking the action; a compute
        handler's tracked-memory change and rise are recorded (common contract)."""
        return self.ap_memory.measured({k: getattr(self, m) for k, m in HANDLERS.items()})

    def _decide_calls(self):
        """F/B call the module and autograd directly when DeepSpeed's wrappers have nothing
        to do for this engine (``ap_wrapped``: what they would do, :func:`wrapper_work`)."""
        self.ap_wrapped = wrapper_work(self)
        self.ap_direct = not self.ap_wrapped
        # DeepSpeed's own forward hooks on the module, skipped by a direct F (hook_work)
        own = (getattr(self, "module_forward_pre_hook", None), getattr(self, "module_forward_post_hook", None))
        self._ap_hooks = None if not self.ap_direct or None in own or hook_work(self) \
            else (own[0].id, own[1].id)
        # BF16_Optimizer keeps fp32 gradients, moved after every backward piece (_lp_grads)
        self._ap_lp = self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update

    def compile(self, *args, **kwargs):
        """DeepSpeed's ``compile``; F/B go through its wrappers from then on."""
        out = super().compile(*args, **kwargs)
        self._decide_calls()
        return out

    def eval_batch(self, *args, **kwargs):
        with self.ap_watchdog.step():
            return super().eval_batch(*args, **kwargs)

    def train_batch(self, data_iter=None):
        rec = self.ap_recorder
        if rec is not None:
            rec.step_begin()
        try:
            with self.ap_watchdog.step():
                out = super().train_batch(data_iter)
            if rec is not None:
                rec.step_end(self.memtracker.peak if self.memtracker is not None else 0.0)
            return out
        finally:
            if self._step_state is not None:      # set_step's state lasts one step
                self._step_state = self.ap_shape_plan = self.ap_loss_factors = None

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's ``save_checkpoint`` (same signature, ``save_dir/<tag>`` and ``latest``),
        writing ds_autoplan's plan-independent checkpoint: it loads under any other plan of the
        same model (runtime/deepspeed/checkpoint.py, ``engine_save``).  Every rank calls it."""
        return engine_save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``; reads a
        checkpoint :meth:`save_checkpoint` wrote under any plan (``engine_load``)."""
        return engine_load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                           load_lr_scheduler_states, load_module_only, custom_load_fn)

    def _take_schedule(self, sched: Schedule, n: int):
        """Accept ``sched`` (common contract: validated, lowered) for the next steps."""
        self.ap_schedule = accept(sched, num_ranks=self.num_stages, num_microbatches=n,
                                  placement=self.placement, who="DeepSpeed adapter")
        self.ap_actions = self.ap_schedule.ranks[self.stage_id]
        self._ap_train = ActionSchedule(posting_order(self.ap_actions) if self._ap_grouped
                                        else self.ap_actions, self.placement)
        self._ap_early = None       # the list with early receives, once every shape is known
        self._ap_recv_stages = {a.stage for a in self.ap_actions if a.kind == Kind.RECV_F}
        self._recompute = self.module.recompute_plan(self.ap_schedule)
        self._recomputed = recomputed(self.ap_actions)
        if any(a.kind == Kind.W for a in self.ap_actions) and not self._split:
            splitgrad.install(self.module)
            self._split = True

    def set_swap_policy(self, policies):
        """Offload the saved tensors chosen per stage to host memory during its forwards
        (DawnPiper's swap, docs/dawnpiper.md §7.5): ``policies`` is stage -> (or a list
        per stage of) ``runtime.swap.SwapPolicy`` or its JSON form, e.g.
        ``stage_memory_options(...)["swap"]``; unit names are this module's layer names
        (``str(layer index)``, see ``SwapPolicy.to_layers``) -- or a whole
        ``ds-autoplan profile --stages`` report (``search.dawnpiper.partition_report``), whose unit
        names are mapped onto the layers."""
        from ..swap import SwapPolicy, Swapper
        if isinstance(policies, dict) and "unit_names" in policies:     # a profile report
            policies = [SwapPolicy.from_dict(u).to_layers(policies["unit_names"])
                        for u in policies["swap"]]
        items = policies.items() if isinstance(policies, dict) else enumerate(policies)
        self.ap_swap = {s: Swapper(p if isinstance(p, SwapPolicy) else SwapPolicy.from_dict(p),
                                   self.module, tracker=self.memtracker)
                        for s, p in items if s in self.module.local_stages and p}

    def reset_activation_shape(self):
        """Exchange tensor shapes again (call when activation shapes change between batches)."""
        super().reset_activation_shape()
        self._meta_sent.clear()
        self._recv_meta.clear()

    # -- where the loss lives --------------------------------------------------------------
    def is_last_stage(self):
        """True on the rank that holds the loss stage (the topological last during __init__)."""
        if not getattr(self, "_ap_ready", False):
            return super().is_last_stage()
        return self.stage_id == self._loss_rank

    def _loss_stage_global_rank(self):
        return self._ap_loss_src

    def _backward_prologue_per_tensor(self, grad):
        # the loss is divided by gradient_accumulation_steps in DeepSpeedEngine.backward;
        # gradients entering any other stage are already scaled
        return grad

    # -- schedules ----------------------------------------------------------------------------
    def _train_schedule(self):
        """The rank's list; over gloo, with early receives once no receive needs a shape
        handshake (the first step's is blocking: posted early it could wait for a peer that
        waits for this rank), see ``runtime.common.posting_order``."""
        if not self._ap_grouped or (self.ap_shape_plan is None
                                    and not self._ap_recv_stages <= self._recv_meta.keys()):
            return self._ap_train
        if self._ap_early is None:
            self._ap_early = ActionSchedule(posting_order(self.ap_actions, early=True),
                                            self.placement)
        return self._ap_early

    def _inference_schedule(self, micro_batches):
        # forward only, in (micro-batch, stage) order: a topological order every rank follows
        from ...schedule import Action
        acts = []
        for mb in range(micro_batches):
            for s in range(self.S):
                if self.placement[s] != self.stage_id:
                    continue
                if s > 0 and self.placement[s - 1] != self.stage_id:
                    acts.append(Action(self.stage_id, Kind.RECV_F, s, mb, self.placement[s - 1]))
                acts.append(Action(self.stage_id, Kind.F, s, mb))
                if s + 1 < self.S and self.placement[s + 1] != self.stage_id:
                    acts.append(Action(self.stage_id, Kind.SEND_F, s, mb, self.placement[s + 1]))
        return ActionSchedule(acts, self.placement, train=False)

    def _exec_schedule(self, pipe_schedule: ActionSchedule):
        self._slots.clear()
        self._batches.clear()
        self._batch_used = {}
        self._next_mb = 0
        self.ap_mem_trace = []
        self.ap_memory.new_step()
        self.fwd_outputs = []
        self._loss_bcast = None
        # the step's loss broadcast: the loss rank posts it after its last F of the loss
        # stage, the others their receive where they first wait for a peer (_take_recv);
        # whoever has not, after its list
        self._loss_due = pipe_schedule.train and self._loss_ahead()
        tr = self.memtracker
        if tr is not None:
            tr.reset_peak()
            with tr.track():
                self._run(pipe_schedule)
        else:
            self._run(pipe_schedule)
        if pipe_schedule.train:
            self._slots.check_done(f"DeepSpeed adapter, pipeline rank {self.stage_id}")
        self._slots.clear()

    def _run(self, sched: ActionSchedule):
        """Every action of the list, then the sends' completion and, training, the step."""
        table, doing = self.ap_table, self.ap_watchdog.doing
        for a, peer in zip(sched.actions, sched.waits):
            doing(a, peer)
            table[a.kind](a)
        if self._loss_due:
            self._post_loss()
        doing("completing the step's sends")
        self._exec_commit_p2p()
        if sched.train:
            doing("the gradient reduction and optimizer step (data-parallel collectives)")
            for name in self._step_work():
                getattr(self, name)()

    def _step_work(self) -> list[str]:
        """DeepSpeed's once-per-step instructions that have something to do: the tied-weight
        reduction with tied modules (or partitioned gradients), the data-parallel reduction
        unless one replica holds all gradients without ZeRO or MoE, the optimizer step."""
        work = []
        if self.module.get_tied_weights_and_groups() or self.zero_optimization_partition_gradients():
            work.append("_exec_reduce_tied_grads")
        if self.dp_world_size > 1 or self.zero_optimization_stage() > 0 or self.has_moe_layers:
            work.append("_exec_reduce_grads")
        return work + ["_exec_optimizer_step"]

    # -- the step's loss ---------------------------------------------------------------------
    def _loss_ahead(self) -> bool:
        """Whether the step's loss goes out by one broadcast posted ahead (every rank decides
        alike): a pipeline of one data-parallel replica without additional losses; otherwise
        DeepSpeed's own aggregation runs after the step."""
        return self.is_pipe_parallel and not self.is_data_parallel \
            and self.module.get_additional_losses() is None

    def _post_loss(self):
        """Post the step's loss broadcast over the pipeline group: on the loss rank, the
        values DeepSpeed's ``_aggregate_total_loss`` sends (the loss divided by the
        accumulation steps, twice: this replica's and the data-parallel mean); elsewhere the
        receive."""
        self._loss_due = False
        src = self._ap_loss_src
        if self.is_last_stage():
            loss = self._scale_loss_by_gas(self.total_loss)
            self.agg_additional_losses = None
            self.dp_group_loss = loss.clone().detach()
            agg = self.dp_group_loss.clone().detach()
            losses = torch.stack([self.dp_group_loss, agg]).float()
        else:
            agg, losses = None, torch.zeros(2, device=self.device)
        work = dist.broadcast(losses, src=src, group=self.grid.get_pipe_parallel_group(),
                              async_op=True)
        self._loss_bcast = (work, losses, agg)

    def _aggregate_total_loss(self):
        pending, self._loss_bcast = self._loss_bcast, None
        if pending is None:
            return super()._aggregate_total_loss()
        work, losses, agg = pending
        self.ap_watchdog.doing("the step's loss broadcast", self._loss_rank)
        self._wait(work, "the step's loss broadcast", self._loss_rank)
        if agg is None:
            self.dp_group_loss = losses[0].clone().detach()
            agg = losses[1].clone().detach()
        return agg

    def _trace(self, name, stage, mb):
        if self.memtracker is not None:
            self.ap_mem_trace.append((name, stage, mb, self.memtracker.current))

    # -- data ---------------------------------------------------------------------------------
    def _batch(self, mb):
        while mb not in self._batches:
            self._batches[self._next_mb] = self._next_batch()
            self._next_mb += 1
        return self._batches[mb]

    def _use_batch(self, mb, part):
        """Part 0 (inputs, stage 0) or 1 (labels, loss stage) of micro-batch ``mb``'s batch."""
        b = self._batch(mb)
        need = {0} if self.placement[0] == self.stage_id else set()
        if self.placement[-1] == self.stage_id:
            need.add(1)
        used = self._batch_used.setdefault(mb, set())
        used.add(part)
        if used >= need:
            self._batches.pop(mb, None)
        return b[part]

    def _load_inputs(self, mb):
        x = self._use_batch(mb, 0)
        reentrant = self._reentrant_activation_checkpointing()

        def one(t):
            t = t.clone().detach().to(self.device)
            if reentrant:
                t.requires_grad = t.is_floating_point()
            return t
        return one(x) if torch.is_tensor(x) else tuple(one(t) for t in x)

    def _load_labels(self, mb):
        y = self._use_batch(mb, 1)
        return y.to(self.device) if torch.is_tensor(y) else tuple(t.to(self.device).detach() for t in y)

    # -- p2p -------------------------------------------------------------------------------------
    def _peer(self, pipe_rank):
        """The global rank of pipeline rank ``pipe_rank`` (this rank's data-parallel column)."""
        return self._ap_globals[pipe_rank]

    def _isend(self, t, peer):
        """``dist.isend`` of ``t`` to pipeline rank ``peer`` (through the world group)."""
        return self._world.send([t], self._ap_globals[peer], 0)

    def _irecv(self, t, peer):
        """``dist.irecv`` into ``t`` from pipeline rank ``peer``."""
        return self._world.recv([t], self._ap_globals[peer], 0)

    def _wait(self, work, what, peer):
        t0 = clock() if self.ap_recorder is not None else None
        try:
            ok = work.wait(self._p2p_timeout)
        except Exception as e:  # gloo raises on closed connections and timeouts
            raise PipelineRankError(f"pipeline rank {self.stage_id} (global {self.global_rank}): "
                                    f"{what}: exchange with pipeline rank {peer} failed; that rank "
                                    f"has probably failed or stopped ({type(e).__name__}: {e})") from None
        if ok is False:
            raise PipelineRankError(f"pipeline rank {self.stage_id}: {what} with pipeline rank "
                                    f"{peer} timed out after {self._p2p_timeout}")
        if t0 is not None:
            self.ap_memory.waited(t0)

    def _send_meta(self, tensors, is_tensor, peer):
        meta = [int(is_tensor), len(tensors)]
        for t in tensors:
            meta += [self.DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        buf = torch.zeros(256, dtype=torch.long)
        buf[:len(meta)] = torch.tensor(meta, dtype=torch.long)
        self._sends.append((self._isend(buf, peer), "activation metadata", peer))

    def _recv_meta_blocking(self, peer):
        buf = torch.zeros(256, dtype=torch.long)
        self._wait(self._irecv(buf, peer), "activation metadata", peer)
        m = buf.tolist()
        is_tensor, n, i, specs = bool(m[0]), m[1], 2, []
        for _ in range(n):
            dt, nd = self.ID_TO_DTYPE[m[i]], m[i + 1]
            specs.append((dt, m[i + 2:i + 2 + nd]))
            i += 2 + nd
        return is_tensor, specs

    def _send_activation(self, a):
        mb, stage, peer = a.mb, a.stage, a.peer
        out = self._slots.at(stage, mb).out
        tensors = [t.detach() for t in _as_list(out)]
        if self.ap_shape_plan is not None:      # both ends know the shape: no handshake
            want = [tuple(sh) for _, sh in self.ap_shape_plan(stage + 1, mb)[1]]
            got = [tuple(t.shape) for t in tensors]
            if got != want:
                raise RuntimeError(f"stage {stage} micro-batch {mb}: activation shapes "
                                   f"{got} differ from the shape plan {want}")
        elif stage not in self._meta_sent:
            self._meta_sent.add(stage)
            self._send_meta(tensors, torch.is_tensor(out), peer)
        for t in tensors:
            self._sends.append((self._isend(t, peer), f"activation of stage {stage}", peer))
        self._prune_sends()
        rec = self.ap_recorder
        if rec is not None and rec.counting:
            rec.boundary = max(rec.boundary, sum(t.numel() * t.element_size() for t in tensors))

    def _recv_activation(self, a):
        mb, stage, peer = a.mb, a.stage, a.peer
        if self.ap_shape_plan is not None:
            is_tensor, specs = self.ap_shape_plan(stage, mb)
        else:
            if stage not in self._recv_meta:
                self._recv_meta[stage] = self._recv_meta_blocking(peer)
            is_tensor, specs = self._recv_meta[stage]
        bufs = [torch.empty(shape, dtype=dt, device=self.device) for dt, shape in specs]
        works = [self._irecv(b, peer) for b in bufs]
        self._slots.at(stage, mb).recv_f = (works, bufs, is_tensor, peer)

    def _send_grad(self, a):
        mb, stage, peer = a.mb, a.stage, a.peer
        slot = self._slots.at(stage, mb)
        grads = [t.grad for t in _as_list(slot.inp) if t.is_floating_point()]
        if any(g is None for g in grads):
            raise RuntimeError(f"stage {stage} micro-batch {mb}: no input gradient to send")
        for g in grads:
            self._sends.append((self._isend(g, peer), f"gradient of stage {stage}", peer))
        slot.inp = None
        self._prune_sends()

    def _recv_grad(self, a):
        mb, stage, peer = a.mb, a.stage, a.peer
        slot = self._slots.at(stage, mb)
        if slot.out is None:
            raise RuntimeError(f"RecvGrad for stage {stage} micro-batch {mb} before its forward")
        bufs = [torch.empty_like(t) for t in _as_list(slot.out) if t.is_floating_point()]
        slot.recv_b = ([self._irecv(b, peer) for b in bufs], bufs, None, peer)

    def _take_recv(self, slot, field, what):
        works, bufs, is_tensor, peer = getattr(slot, field)
        setattr(slot, field, None)
        if self._loss_due and works and self.stage_id != self._loss_rank \
                and not works[-1].is_completed():
            self._post_loss()       # the rank waits here anyway
        for w in works:
            self._wait(w, what, peer)
        return bufs, is_tensor

    def _prune_sends(self):
        self._sends[:] = [s for s in self._sends if not s[0].is_completed()]

    def _exec_commit_p2p(self):
        for work, what, peer in self._sends:
            self._wait(work, f"sending {what}", peer)
        self._sends.clear()

    # -- compute ---------------------------------------------------------------------------------
    def _stage_input(self, stage, mb, slot):
        if stage == 0:
            return self._load_inputs(mb)
        if self.placement[stage - 1] == self.stage_id:     # local hand-off (V turn-around, d=1)
            prev = self._slots.at(stage - 1, mb)
            x = _detached_leaf(prev.out)
            return x
        bufs, is_tensor = self._take_recv(slot, "recv_f", f"activation for stage {stage}")
        x = [b.requires_grad_(b.is_floating_point()) for b in bufs]
        return x[0] if is_tensor else tuple(x)

    def _run_forward(self, a):
        stage, mb = a.stage, a.mb
        slot = self._slots.at(stage, mb)
        slot.inp = self._stage_input(stage, mb, slot)
        x = _cloned(slot.inp)
        k = self._recompute[stage] if (stage, mb) in self._recomputed and torch.is_grad_enabled() else 0
        if k:
            # stage-aware recomputation: the first k layers keep only their input (checkpoint)
            slot.rng = RngState()      # R replays this forward's dropout
            slot.ckpt = [hold(self.memtracker, t) for t in _as_list(slot.inp)]
            with torch.no_grad(), self.module.activated(stage, 0, k):
                h = self.module(x)
            slot.h = x = _detached_leaf(h)
        sw = self.ap_swap.get(stage) if torch.is_grad_enabled() else None
        with self.module.activated(stage, k), \
                (sw.forward() if sw is not None else contextlib.nullcontext()):
            direct = self.ap_direct and not torch.is_autocast_enabled()
            out = self._call_module(x) if direct else DeepSpeedEngine.forward(self, x)
        slot.out = out
        if stage == self.S - 1:
            if self._compute_loss and self.module.loss_fn is not None:
                loss = self.module.loss_fn(out, self._load_labels(mb))
            else:
                loss = out
            if self.ap_loss_factors is not None and torch.is_grad_enabled():
                # DeepSpeed divides by gradient_accumulation_steps; the factor makes the step's
                # gradient the sample/token-weighted one (dynamic.py)
                loss = loss * self.ap_loss_factors[mb]
            state = self.__dict__   # plain attributes: no nn.Module.__setattr__ per micro-batch
            state["loss"] = slot.loss = loss
            if self.eval_return_logits:
                self.outputs = out
            det = loss.detach() if torch.is_tensor(loss) else [t.detach() for t in loss]
            self.fwd_outputs.append(det)
            if self.total_loss is None:
                state["total_loss"] = det.clone() if torch.is_tensor(det) else [t.clone() for t in det]
            elif torch.is_tensor(det):
                self.total_loss.add_(det)
            else:
                for t, d_ in zip(self.total_loss, det):
                    t += d_
            if self._loss_due and len(self.fwd_outputs) == self.micro_batches:
                self._post_loss()   # the step's loss is complete: no later action changes it
        if not torch.is_grad_enabled():
            slot.inp = None
        self._trace("F", stage, mb)

    def _call_module(self, x):
        """``self.module(x)``; where DeepSpeed's two forward hooks are its only hooks and do
        nothing but start the throughput timer (:func:`hook_work`), that and ``forward``."""
        mod, own = self.module, self._ap_hooks
        pre, post = mod._forward_pre_hooks, mod._forward_hooks
        if own is None or len(pre) != 1 or len(post) != 1 or own[0] not in pre or own[1] not in post \
                or mod._backward_hooks or mod._backward_pre_hooks or _nn_module._global_forward_pre_hooks \
                or _nn_module._global_forward_hooks or _nn_module._global_backward_hooks \
                or _nn_module._global_backward_pre_hooks or torch._C._get_tracing_state():
            return mod(x)
        if self.training_dataloader is None:
            self.tput_timer.start()
        return mod.forward(x)

    def _run_recompute(self, a):
        mb, stage = a.mb, a.stage
        slot = self._slots.at(stage, mb)
        if slot.h is None or slot.h2 is not None:
            raise RuntimeError(f"R for stage {stage} micro-batch {mb}: its F did not keep "
                               f"a recompute checkpoint, or it was recomputed already")
        k = self._recompute[stage]
        slot.ckpt = None        # the prefix's layers save their (cloned) input from here on
        rng, slot.rng = slot.rng, None
        with rng.replay(), torch.enable_grad(), self.module.activated(stage, 0, k):
            slot.h2 = self.module(_cloned(slot.inp))
        self._trace("R", stage, mb)

    def _output_grad(self, stage, mb, slot):
        if self.placement[stage + 1] == self.stage_id:      # local hand-off
            nxt = self._slots.at(stage + 1, mb)
            g = [t.grad for t in _as_list(nxt.inp) if t.is_floating_point()]
            nxt.inp = None
            return g
        bufs, _ = self._take_recv(slot, "recv_b", f"gradient for stage {stage}")
        return bufs

    def _backward(self, mb, stage, split):
        slot = self._slots.at(stage, mb)
        if slot.h is not None and slot.h2 is None:
            raise RuntimeError(f"backward of stage {stage} micro-batch {mb} before its R")
        store = splitgrad.WeightGradStore() if split else None
        grads = None if stage == self.S - 1 else self._output_grad(stage, mb, slot)
        ctx = (lambda: store.deferring(self.memtracker)) if split else _nullctx
        k = self._recompute[stage] if slot.h is not None else 0
        # the stage's layers stay active: DeepSpeed's checkpoint function re-runs
        # module.forward_funcs[start:end] during backward
        with ctx(), self.module.activated(stage, k):
            if stage < self.S - 1:
                self._outputs_backward(slot.out, grads)
            elif self.ap_direct:     # DeepSpeedEngine.backward's scaling, and nothing else
                torch.autograd.backward(slot.loss / self.gradient_accumulation_steps())
            else:
                DeepSpeedEngine.backward(self, slot.loss)
        if slot.h is not None:      # through the recomputed layers
            hs = [t for t in _as_list(slot.h) if t.is_floating_point()]
            h2 = [t for t in _as_list(slot.h2) if t.is_floating_point()]
            with ctx(), self.module.activated(stage, 0, k), self._lp_grads():
                torch.autograd.backward(h2, [t.grad for t in hs])
            slot.h = slot.h2 = None
        slot.out = slot.loss = None
        slot.store = store
        if stage == 0:
            slot.inp = None
        self._trace("B" if split else "BW", stage, mb)

    def _outputs_backward(self, out, grads):
        """Backward of a stage before the loss's, from its outputs' gradients (as
        ``PipelineEngine._exec_backward_pass``; directly where ``ap_direct``)."""
        outs = [t for t in _as_list(out) if t.is_floating_point()]
        if self.ap_direct:
            torch.autograd.backward(outs, grads)
            return
        state = self.__dict__    # a plain attribute: no nn.Module.__setattr__ here
        state["_running_engine_backward"] = True
        try:
            with self._lp_grads():
                torch.autograd.backward(outs, grads)
        finally:
            state["_running_engine_backward"] = False

    def _lp_grads(self):
        """BF16_Optimizer keeps fp32 gradients; move the low-precision ones after every
        backward piece that is not DeepSpeedEngine.backward (as PipelineEngine does)."""
        return self._bf16_grads() if self._ap_lp else _nullctx()

    @contextlib.contextmanager
    def _bf16_grads(self):
        self.optimizer.clear_lp_grads()
        yield
        self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _run_backward(self, a):
        self._backward(a.mb, a.stage, split=False)

    def _run_backward_input(self, a):
        self._backward(a.mb, a.stage, split=True)

    def _run_weight(self, a):
        mb, stage = a.mb, a.stage
        slot = self._slots.at(stage, mb)
        if slot.store is None:
            raise RuntimeError(f"W for stage {stage} micro-batch {mb} before its B")
        with self._lp_grads():
            slot.store.run_all()
        slot.store = None
        self._trace("W", stage, mb)


_nullctx = contextlib.nullcontext
