"""A megatron-core ``forward_backward_func`` that executes any ds_autoplan action list.

The returned function has exactly the keyword signature of megatron-core's schedule
functions (taken from the installed ``forward_backward_pipelining_without_interleaving`` with
``inspect.signature``) and runs this rank's list of the *lowered* schedule (docs/schedules.md §6.4):

* ``F``   -- Megatron's ``forward_step`` on the chunk holding that stage (``set_input_tensor``,
  the user's ``forward_step_func``, loss on the last stage);
* ``B``   -- Megatron's ``backward_step`` while a runtime ``WeightGradStore`` (one per stage and
  micro-batch) defers the weight GEMMs of split-aware layers; ``W`` runs that store (B/W split);
  ``BW``  -- plain ``backward_step``;
* ``R``   -- recomputation with the one meaning of ``schedule/passes.py``: the F of a (stage,
  micro-batch) that has an R action runs the chunk's embedding and first k transformer layers
  without autograd and keeps only their input, the rest from a leaf; R re-runs that prefix
  with autograd (replaying the forward's random state); B runs the rest, then the prefix;
* ``RECV_*`` post a receive (Megatron's ``P2PCommunicator``, non-blocking ops), the consuming
  compute action waits for it; ``SEND_*`` start a send, completed at the end.  This is the
  simulator's non-blocking model, so a list the simulator finishes cannot deadlock here.
  Hand-offs between two stages on one rank (the turn of a V) need no communication.

Like Megatron's schedules it runs inside ``config.no_sync_func`` and lets gradients sync only
during the last B, W or BW of each stage, then calls ``grad_sync_func`` and
``finalize_model_grads_func``.

Model chunks are the rank's stages in stage order (V: chunk 0 = stage r, chunk 1 = stage
2d-1-r).  The runtime never looks at the schedule's name.

Variable shapes (DynaPipe, seed 004; docs/schedules.md §5.6) -- three optional keywords beyond
Megatron's signature, for one call (one optimizer step):

* ``schedule=``: this step's schedule (e.g. ``IterationPlan.lowered``), replacing the one the
  runner holds; ``num_microbatches`` must equal its micro-batch count;
* ``microbatch_shapes=[(mbs, L), ...]``: micro-batch m's activations and gradients are
  ``get_tensor_shapes(seq_length=L, micro_batch_size=mbs)`` (``L = (L_enc, L_dec)`` passes
  ``decoder_seq_length``), so every receive is posted with the right buffer and no shape
  handshake is needed (Megatron's ``variable_seq_lengths`` one is blocking);
  ``seq_length`` / ``micro_batch_size`` are then unused;
* ``microbatch_weights=[w_0, ...]``: micro-batch m's loss is multiplied by ``n·w_m``,
  undoing Megatron's ``1/num_microbatches``, so the step loss is ``Σ w_m·loss_m`` (see
  :func:`ds_autoplan.runtime.megatron.dynamic.loss_weights`: w_m = share of the step's tokens).
"""
from __future__ import annotations

import contextlib
import copy
import inspect

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as _ms
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model, get_model_config, get_model_type

from ...schedule import Costs, Kind, Schedule, ScheduleError, lower
from ...schedule.passes import plan_schedule, stage_recompute
from ..common import (RULES, Slots, StepState, accept, dispatch_table, posting_order, recomputed,
                      waits_for)
from ..common import record
from ..common.memory import ActionMemory
from ..common.trace import clock
from ..memtrack import hold
from ..rng import RngState
from ..splitgrad import WeightGradStore
from ..watchdog import StepWatchdog, step_timeout
from .shim import cpu_shim

SIGNATURE = inspect.signature(_ms.forward_backward_pipelining_without_interleaving)


class _Feed:
    """Replays a chunk's data iterator by micro-batch: F and R of micro-batch m both get the
    m-th item (the base iterator is read in order, at most once per item)."""

    def __init__(self, it):
        self.it, self.items, self.mb = it, [], 0

    def at(self, mb: int):
        self.mb = mb
        return self

    def __iter__(self):
        return self

    def __next__(self):
        while len(self.items) <= self.mb:
            self.items.append(next(self.it))
        return self.items[self.mb]


def _default_pgs():
    pg = ProcessGroupCollection()
    pg.tp = parallel_state.get_tensor_model_parallel_group()
    pg.cp = parallel_state.get_context_parallel_group()
    pg.embd = parallel_state.get_embedding_group(check_initialized=False)
    pg.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pg.pp = parallel_state.get_pipeline_model_parallel_group()
    pg.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                      partial_data_parallel=False)
    return pg


class _P2P:
    """Non-blocking sends/receives to the neighbouring pp ranks with Megatron's communicator
    (its ``_communicate`` with ``batch_p2p_comm`` off returns the requests unwaited)."""

    def __init__(self, pp_group, config):
        cfg = copy.copy(config)
        cfg.batch_p2p_comm = False
        cfg.variable_seq_lengths = False
        cfg.use_ring_exchange_p2p = False
        self.comm = P2PCommunicator(pp_group=pp_group, config=cfg)
        self.rank, self.size = pp_group.rank(), pp_group.size()
        self.pending: list = []

    def _side(self, peer: int) -> str:
        """'next' or 'prev' for a neighbour (with 2 ranks both are the same rank: 'next' is
        used on both ends, so a message's send and receive use the same process group)."""
        if peer == (self.rank + 1) % self.size:
            return "next"
        if peer == (self.rank - 1) % self.size:
            return "prev"
        raise ScheduleError(f"pp rank {self.rank}: peer {peer} is not a neighbour; megatron-core "
                            f"p2p only talks to the previous/next pipeline rank")

    def recv(self, peer: int, shape):
        side = self._side(peer)
        prev_t, next_t, reqs = self.comm._communicate(
            tensor_send_next=None, tensor_send_prev=None, recv_prev=side == "prev",
            recv_next=side == "next", tensor_shape=shape, wait_on_reqs=False)
        return (prev_t if side == "prev" else next_t), list(reqs.values())

    def send(self, peer: int, tensor: torch.Tensor) -> None:
        side = self._side(peer)
        t = tensor.detach()
        _, _, reqs = self.comm._communicate(
            tensor_send_next=t if side == "next" else None,
            tensor_send_prev=t if side == "prev" else None,
            recv_prev=False, recv_next=False, tensor_shape=None, wait_on_reqs=False)
        self.pending.append((t, list(reqs.values())))

    def finish(self) -> None:
        for _, reqs in self.pending:
            for r in reqs:
                r.wait()
        self.pending.clear()


def _wait(entry):
    t, reqs = entry
    for r in reqs:
        r.wait()
    return t


class ScheduleRunner:
    """Holds a lowered schedule; ``__call__`` is the forward_backward_func.  With ``plan``,
    every schedule it runs (its own: ``schedule`` or the plan's, and each step's) gets the
    plan's recomputation as R actions (``schedule.passes.plan_schedule``), as in the
    DeepSpeed adapter."""

    EXTRA = ("schedule", "microbatch_shapes", "microbatch_weights")   # see module docstring

    def __init__(self, schedule: Schedule | None, costs: Costs | None = None, tracker=None,
                 plan=None):
        self.costs, self.plan = costs, plan
        if plan is not None:
            schedule = plan_schedule(plan, schedule)
        self.schedule = None if schedule is None else lower(schedule, costs)
        self.tracker = tracker          # optional runtime.memtrack.MemTracker
        self.memory = ActionMemory(tracker)   # bytes per compute action; DS_AUTOPLAN_TRACE times
        self.recorder = None            # the run's record (runtime/common/record.py), first step
        self._recording = plan is not None
        self.peak_bytes = 0             # peak tracked saved-activation bytes of the last call
        self._next: StepState | None = None
        self.__signature__ = SIGNATURE
        # every call is one step under the step watchdog (runtime/watchdog.py)
        predicted = (plan.predicted or {}).get("iteration_time_s") if plan is not None else None
        self.watchdog = StepWatchdog(step_timeout(predicted), "Megatron pipeline")

    @property
    def mem_deltas(self) -> dict:
        """(kind value, stage, mb) -> tracked bytes change of the last call."""
        return {(k.value, s, m): v[0] for (k, s, m), v in self.memory.by_action.items()}

    def with_plan(self, sched: Schedule) -> Schedule:
        """A step's schedule with the plan's R actions (unchanged without a plan)."""
        return sched if self.plan is None else plan_schedule(self.plan, sched)

    def set_step(self, state: StepState) -> None:
        """Per-step state for the next call only (the common contract, runtime.common)."""
        self._next = state

    def __call__(self, *args, **kwargs):
        if args:
            raise TypeError("forward_backward_func takes keyword arguments only")
        extra = {k: kwargs.pop(k) for k in self.EXTRA if k in kwargs}
        state, self._next = self._next or StepState(), None
        if extra:     # the keyword form of the same per-step state
            state = StepState(extra.get("schedule", state.schedule),
                              extra.get("microbatch_shapes", state.shapes),
                              extra.get("microbatch_weights", state.loss_weights))
        b = SIGNATURE.bind(**kwargs)
        b.apply_defaults()
        with cpu_shim(), self.watchdog.step():
            return _Step(self, state, b.arguments).run()


class _PrefixDone(Exception):
    """Raised by the hook after the recomputed prefix's last layer during R (stops the rest)."""

    def __init__(self, hidden):
        super().__init__("recompute prefix done")
        self.hidden = hidden


def _chunk_layers(chunk):
    """The transformer layers of a (wrapped) GPTModel chunk; [] for a chunk with no decoder
    (any other module runs too, it just has nothing an R could re-run)."""
    try:
        dec = get_attr_wrapped_model(chunk, "decoder", allow_none=True)
    except RuntimeError:        # no ``decoder`` attribute at any wrapping level
        return []
    return list(dec.layers) if dec is not None else []


@contextlib.contextmanager
def _prefix_hooks(chunk, k: int, after, grad: bool):
    """Run the chunk's embedding and first ``k`` transformer layers with autograd ``grad``;
    at the output of layer k-1, ``after(hidden)`` returns what the next layers get (with
    autograd on), or raises."""
    layers = _chunk_layers(chunk)
    last = len(layers) == k

    def pre(_m, _args):
        torch.set_grad_enabled(grad)

    def post(_m, _args, out):
        torch.set_grad_enabled(True)
        hidden, ctx = out
        h = after(hidden)
        return (h.clone() if last else h), ctx
    hs = [chunk.register_forward_pre_hook(pre), layers[k - 1].register_forward_hook(post)]
    try:
        yield
    finally:
        for h in hs:
            h.remove()


class _Step:
    """One call of the forward_backward_func: the state per (stage, micro-batch)
    (``runtime.common.Slots``) and one handler per action kind (the adapter's dispatch
    table)."""

    def __init__(self, runner: ScheduleRunner, state: StepState, args: dict):
        self.runner, self.a, self.state = runner, args, state
        sched = runner.schedule if state.schedule is None else runner.with_plan(state.schedule)
        if sched is None:
            raise ScheduleError("this forward_backward_func holds no schedule: pass schedule=")
        state.check(args["num_microbatches"])        # before any communication
        self.forward_only = args["forward_only"]
        self.model = args["model"] if isinstance(args["model"], list) else [args["model"]]
        self.config = get_model_config(self.model[0])
        self.pgs = args["pg_collection"] or _default_pgs()
        p2pc = args["p2p_communicator"]
        self.pp_group = p2pc.pp_group if p2pc is not None else self.pgs.pp
        self.rank = self.pp_group.rank()
        self.sched = accept(sched, num_ranks=self.pp_group.size(),
                            num_microbatches=args["num_microbatches"], costs=runner.costs,
                            who="Megatron adapter")
        self.n, self.S = self.sched.num_microbatches, self.sched.num_stages
        self.stages = self.sched.stages_of(self.rank)
        self.chunk = {s: i for i, s in enumerate(self.stages)}
        self._check_chunks()
        self.shapes = self._shapes(state.shapes)
        self.mine = self.sched.ranks[self.rank]
        if torch.distributed.get_backend(self.pp_group) == "gloo":
            # gloo's posts never block: sends first in each group, receives posted early
            # (shapes are known: no handshake), see runtime.common.posting_order
            self.mine = posting_order(self.mine, early=True)
        self.rec = recomputed(self.mine)
        self.rec_k = {s: stage_recompute(self.sched, s, len(_chunk_layers(self.model[c])))
                      for s, c in self.chunk.items()}
        self.p2p = _P2P(self.pp_group, self.config) if self.pp_group.size() > 1 else None
        ranks = torch.distributed.get_process_group_ranks(self.pp_group)
        runner.watchdog.global_rank_of = ranks.__getitem__
        self.table = dispatch_table({
            Kind.F: self.forward, Kind.R: self.recompute, Kind.B: self.backward,
            Kind.BW: self.backward, Kind.W: self.weight, Kind.RECV_F: self.recv_f,
            Kind.RECV_B: self.recv_b, Kind.SEND_F: self.send_f, Kind.SEND_B: self.send_b},
            "Megatron adapter")
        self.slots = Slots()
        self.losses: dict = {}          # micro-batch -> what the loss function reported
        self.total_tokens = torch.zeros([], dtype=torch.int)
        self.seen_first: set = set()

    # -- set-up --------------------------------------------------------------------------
    def _check_chunks(self):
        if len(self.model) != len(self.stages):
            raise ScheduleError(f"pp rank {self.rank} holds stages {self.stages} of the schedule "
                                f"but got {len(self.model)} model chunk(s)")
        it = self.a["data_iterator"]
        if not isinstance(it, list) and len(self.model) > 1 and it is not None:
            raise ScheduleError("several model chunks need a list of data iterators (one per chunk)")
        its = it if isinstance(it, list) else [it] * len(self.model)
        self.feeds = [None if x is None else _Feed(x) for x in its]
        if self.state.loss_weights is not None and self.config.calculate_per_token_loss:
            raise ScheduleError("microbatch_weights and config.calculate_per_token_loss both "
                                "rescale the loss; use one of them")

    def _tensor_shape(self, mbs, seq, dec):
        sh = _ms.get_tensor_shapes(seq_length=seq, micro_batch_size=mbs, decoder_seq_length=dec,
                                   config=self.config, tp_group=self.pgs.tp, cp_group=self.pgs.cp)
        fn = self.a["adjust_tensor_shapes_fn"]
        if fn is not None:
            sh, _ = fn(sh, sh)
        return sh[0]

    def _shapes(self, given):
        if given is None:
            a = self.a
            return [self._tensor_shape(a["micro_batch_size"], a["seq_length"],
                                       a["decoder_seq_length"])] * self.n
        return [self._tensor_shape(int(b), *((int(L), None) if not isinstance(L, (tuple, list))
                                             else (int(L[0]), int(L[1]))))
                for b, L in given]

    # -- the step ------------------------------------------------------------------------
    def _recorder(self):
        """The runner's record of the run, made at its first training step (the model and
        the pipeline rank are known then), or None."""
        r = self.runner
        if r._recording and r.recorder is None:
            r._recording = False
            model = self.model
            ranks = torch.distributed.get_process_group_ranks(self.pp_group)
            me = self.pp_group.rank()
            r.recorder = record.from_env(
                r.plan, self.rank, "megatron",
                state_bytes=lambda: sum(record.model_state_bytes(c) for c in model),
                peers=(ranks[me - 1] if me > 0 else None, ranks[me + 1] if me + 1 < len(ranks) else None),
                peak_complete=False)       # Megatron's optimizer (its states) is not ours to see
            r.memory.recorder = r.recorder
        return r.recorder

    def run(self):
        r, tracker = self.runner, self.runner.tracker
        rec = None if self.forward_only else self._recorder()
        if rec is not None:
            rec.step_begin()
        r.memory.new_step()
        base = tracker.current if tracker is not None else 0
        if tracker is not None:
            tracker.reset_peak()
        sync = _GradSync(_no_sync_func(self.config))
        final = self._final_backwards()
        doing, place = r.watchdog.doing, self.sched.placement
        table = r.memory.measured(self.table)       # compute actions' bytes (and times)
        for i, act in enumerate(self.mine):
            if self.forward_only and not RULES[act.kind].forward:
                continue
            if i in final:
                sync.enable()
            doing(act, waits_for(act, place))
            table[act.kind](act)
            if i in final:
                sync.disable()
        doing("completing the step's sends")
        if self.p2p is not None:
            t0 = clock()
            self.p2p.finish()
            r.memory.waited(t0)             # the record's idle time
        if tracker is not None:
            r.peak_bytes = tracker.peak - base
        self.slots.check_done(f"Megatron adapter, pp rank {self.rank}")
        sync.enable()
        if not self.forward_only:
            doing("the gradient synchronisation (data-parallel collectives)")
            self._finalize()
        if rec is not None:
            rec.step_end(r.peak_bytes if tracker is not None else 0.0)
        return [self.losses[m] for m in sorted(self.losses)]

    def _final_backwards(self) -> set:
        """Megatron's rule: gradients are reduced (DDP hooks fire) only in the last backward
        of each chunk; here the last B, W or BW of each stage runs with grad sync enabled."""
        if self.forward_only:
            return set()
        last = {}
        for i, a in enumerate(self.mine):
            if RULES[a.kind].grads:
                last[(a.kind, a.stage)] = i
        return set(last.values())

    def _finalize(self):
        cfg = self.config
        if cfg.grad_sync_func is not None:
            fns = cfg.grad_sync_func if isinstance(cfg.grad_sync_func, list) \
                else [cfg.grad_sync_func] * len(self.model)
            for f, mchunk in zip(fns, self.model):
                f(mchunk.parameters())
        if cfg.finalize_model_grads_func is not None:
            cfg.finalize_model_grads_func(
                self.model, self.total_tokens if cfg.calculate_per_token_loss else None,
                pg_collection=self.pgs, force_all_reduce=self.a["force_all_reduce"])

    # -- forward pieces ----------------------------------------------------------------------
    def _fwd(self, s, m, inp, with_grad=True, keep_loss=True):
        c = self.chunk[s]
        feed = self.feeds[c].at(m) if self.feeds[c] is not None else None
        first = c not in self.seen_first
        self.seen_first.add(c)
        store = []
        train = with_grad and not self.forward_only
        fsf = self.a["forward_step_func"]
        factor = self.state.loss_factor(m, self.n) if s == self.S - 1 else None
        if factor is not None:
            fsf = _weighted(fsf, factor)
        tracker = self.runner.tracker
        with (torch.enable_grad() if train else torch.no_grad()), \
                (tracker.track() if train and tracker is not None else contextlib.nullcontext()):
            out, ntok = _ms.forward_step(
                fsf, feed, self.model[c], self.n, inp, store, self.config,
                self.pgs.cp.size(), self.a["collect_non_loss_data"],
                is_first_microbatch=_ms.check_first_val_step(self.a["first_val_step"],
                                                             self.forward_only, first),
                current_microbatch=m, vp_stage=None, is_last_stage=(s == self.S - 1))
        if store and s == self.S - 1 and keep_loss:
            self.losses[m] = store[-1]
        return out, ntok

    def _incoming(self, slot, handed: str, recv: str):
        """What a slot gets from its neighbour stage: handed over on this rank, or received."""
        field = handed if getattr(slot, handed) is not None else recv
        x = getattr(slot, field)
        setattr(slot, field, None)
        return x if field == handed else self._received(x)

    def _received(self, entry):
        """A posted receive's tensor, waited for (the wait is the record's idle time)."""
        t0 = clock()
        x = _wait(entry)
        self.runner.memory.waited(t0)
        return x

    def forward(self, a):
        s, m = a.stage, a.mb
        slot = self.slots.at(s, m)
        slot.inp = inp = None if s == 0 else self._incoming(slot, "handed_f", "recv_f")
        if (s, m) in self.rec and not self.forward_only:
            out, ntok = self._forward_with_prefix(slot, s, m, inp)
        else:
            out, ntok = self._fwd(s, m, inp, with_grad=True)
        self.total_tokens += ntok.to(self.total_tokens.dtype).cpu() if torch.is_tensor(ntok) else ntok
        slot.out = out
        if s + 1 < self.S and self.sched.placement[s + 1] == self.rank:
            o = _first(out)
            self.slots.at(s + 1, m).handed_f = o.detach().requires_grad_(not self.forward_only)
            if not self.forward_only:
                _ms.deallocate_output_tensor(o, self.config.deallocate_pipeline_outputs)
        if self.forward_only:
            slot.inp = None
            if s + 1 >= self.S or self.sched.placement[s + 1] == self.rank:
                slot.out = None

    def _forward_with_prefix(self, slot, s, m, inp):
        """F of a recomputed (s, m): the prefix runs without autograd and keeps only its
        input (counted as held); the rest of the stage runs from a leaf ``h``."""
        slot.rng = RngState()          # R replays this forward's dropout
        slot.ckpt = hold(self.runner.tracker, inp) if inp is not None else None

        def leaf(hidden):
            slot.h = h = hidden.detach().requires_grad_(True)
            return h
        with _prefix_hooks(self.model[self.chunk[s]], self.rec_k[s], leaf, grad=False):
            return self._fwd(s, m, inp, with_grad=True)

    def recompute(self, a):
        s, m = a.stage, a.mb
        slot = self.slots.at(s, m)
        if slot.h is None or slot.h2 is not None:
            raise ScheduleError(f"R{s}.{m}: its F kept no recompute checkpoint, or it ran already")

        def stop(hidden):
            raise _PrefixDone(hidden)
        rng, slot.rng = slot.rng, None
        with rng.replay(), _prefix_hooks(self.model[self.chunk[s]], self.rec_k[s], stop, grad=True):
            try:
                self._fwd(s, m, slot.inp, with_grad=True, keep_loss=False)
            except _PrefixDone as done:
                slot.h2 = done.hidden
            else:
                raise ScheduleError(f"R{s}.{m}: the recomputed prefix did not run")
        slot.ckpt = None

    # -- backward pieces ---------------------------------------------------------------------
    def backward(self, a):
        s, m = a.stage, a.mb
        slot = self.slots.at(s, m)
        og = None if s == self.S - 1 else self._incoming(slot, "handed_b", "recv_b")
        inp, out = slot.inp, slot.out
        slot.inp = slot.out = None
        store = None
        if a.kind == Kind.B:
            store = slot.store = WeightGradStore()
        ctx = store.deferring(self.runner.tracker) if store is not None else contextlib.nullcontext()
        with ctx:
            gin = self._backward_through(slot, s, m, inp, out, og)
        del out
        if s > 0:
            if self.sched.placement[s - 1] == self.rank:
                self.slots.at(s - 1, m).handed_b = _first(gin)
            else:
                slot.in_grad = gin

    def _backward_through(self, slot, s, m, inp, out, og):
        mt, cfg = get_model_type(self.model[0]), self.config
        if slot.h is None:
            return _ms.backward_step(inp, out, og, mt, cfg)
        if slot.h2 is None:
            raise ScheduleError(f"backward of stage {s} micro-batch {m} before its R")
        h, h2 = slot.h, slot.h2
        slot.h = slot.h2 = None
        gh = _ms.backward_step(h, out, og, mt, cfg)        # the layers after the prefix
        if inp is not None:
            inp.retain_grad()
        torch.autograd.backward(h2, gh)                    # the recomputed prefix
        return inp.grad if inp is not None else None

    def weight(self, a):
        slot = self.slots.at(a.stage, a.mb)
        store, slot.store = slot.store, None
        store.run_all()

    # -- communication -------------------------------------------------------------------------
    def recv_f(self, a):
        self.slots.at(a.stage, a.mb).recv_f = self.p2p.recv(a.peer, self.shapes[a.mb])

    def recv_b(self, a):
        self.slots.at(a.stage, a.mb).recv_b = self.p2p.recv(a.peer, self.shapes[a.mb])

    def send_f(self, a):
        s, m = a.stage, a.mb
        slot = self.slots.at(s, m)
        o = _first(slot.out)
        if self.state.shapes is not None:
            _check_shape(o, self.shapes[m], "output", s, m)
        self.p2p.send(a.peer, o)
        rec = self.runner.recorder
        if rec is not None and rec.counting:        # the link probe's size (runtime/common/record.py)
            rec.boundary = max(rec.boundary, o.numel() * o.element_size())
        if self.forward_only:
            slot.out = None
        else:
            _ms.deallocate_output_tensor(o, self.config.deallocate_pipeline_outputs)

    def send_b(self, a):
        s, m = a.stage, a.mb
        slot = self.slots.at(s, m)
        g, slot.in_grad = _first(slot.in_grad), None
        if self.state.shapes is not None:
            _check_shape(g, self.shapes[m], "input gradient", s, m)
        self.p2p.send(a.peer, g)


def _first(x):
    return x[0] if isinstance(x, list) else x


def _no_sync_func(config):
    no_sync = config.no_sync_func
    if isinstance(no_sync, list):
        ns_list = no_sync
        return lambda: _stack(f() for f in ns_list)
    return no_sync or contextlib.nullcontext


def _check_shape(t, shape, what, s, m):
    if tuple(t.shape) != tuple(shape):
        raise ScheduleError(f"stage {s} micro-batch {m}: {what} has shape {tuple(t.shape)}, the "
                            f"shape plan says {tuple(shape)} (same padding in loader and plan?)")


def _weighted(forward_step_func, factor: float):
    """``forward_step_func`` whose loss function scales the loss (first output) by ``factor``;
    the reported values and a non-loss-data call are left as they are."""
    def step(data_iterator, model, *args):
        out, loss_func = forward_step_func(data_iterator, model, *args)

        def scaled(output_tensor, *a, **k):
            res = loss_func(output_tensor, *a, **k)
            if k.get("non_loss_data"):
                return res
            return (res[0] * factor, *res[1:])
        return out, scaled
    return step


class _GradSync:
    """Megatron's disable_grad_sync / enable_grad_sync around ``config.no_sync_func``."""

    def __init__(self, no_sync):
        self.no_sync, self.ctx = no_sync, None
        self.disable()

    def disable(self):
        if self.ctx is None:
            self.ctx = self.no_sync()
            self.ctx.__enter__()

    def enable(self):
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
            self.ctx = None


def _stack(ctxs):
    st = contextlib.ExitStack()
    for c in ctxs:
        st.enter_context(c)
    return st
