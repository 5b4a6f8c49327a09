"""A megatron-core ``forward_backward_func`` that executes any ds_autoplan action list.

The returned function has exactly the keyword signature of megatron-core's schedule
functions (taken from the installed ``forward_backward_pipelining_without_interleaving`` with
``inspect.signature``) and runs this rank's list of the *lowered* schedule (schedules.md §6.4):

* ``F``   -- Megatron's ``forward_step`` on the chunk holding that stage (``set_input_tensor``,
  the user's ``forward_step_func``, loss on the last stage);
* ``B``   -- Megatron's ``backward_step`` while a runtime ``WeightGradStore`` (one per stage and
  micro-batch) defers the weight GEMMs of split-aware layers; ``W`` runs that store (B/W split);
  ``BW``  -- plain ``backward_step``;
* ``R``   -- stage-aware recomputation: the F of a (stage, micro-batch) that has an R action
  runs without autograd and keeps only its input; R re-runs it with autograd before B;
* ``RECV_*`` post a receive (Megatron's ``P2PCommunicator``, non-blocking ops), the consuming
  compute action waits for it; ``SEND_*`` start a send, completed at the end.  This is the
  simulator's non-blocking model, so a list the simulator finishes cannot deadlock here.
  Hand-offs between two stages on one rank (the turn of a V) need no communication.

Like Megatron's schedules it runs inside ``config.no_sync_func`` and lets gradients sync only
during the last B, W or BW of each stage, then calls ``grad_sync_func`` and
``finalize_model_grads_func``.

Model chunks are the rank's stages in stage order (V: chunk 0 = stage r, chunk 1 = stage
2d-1-r).  The runtime never looks at the schedule's name.

Variable shapes (DynaPipe, seed 004; schedules.md §5.6) -- three optional keywords beyond
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
import time

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as _ms
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config, get_model_type

from ...schedule import Costs, Kind, Schedule, ScheduleError, lower
from .shim import cpu_shim
from ..rng import RngState
from ..splitgrad import WeightGradStore

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
    """Holds a lowered schedule; ``__call__`` is the forward_backward_func."""

    EXTRA = ("schedule", "microbatch_shapes", "microbatch_weights")   # see module docstring

    def __init__(self, schedule: Schedule | None, costs: Costs | None = None, tracker=None):
        self.costs = costs
        self.schedule = None if schedule is None else lower(schedule, costs)
        self.tracker = tracker          # optional runtime.memtrack.MemTracker
        self.timeline: list = []        # (kind, stage, mb, t0, t1) of the last call, this rank
        self.record_timeline = False
        self.mem_deltas: dict = {}      # (kind, stage, mb) -> tracked bytes change (with tracker)
        self.peak_bytes = 0             # peak tracked saved-activation bytes of the last call
        self.__signature__ = SIGNATURE

    def __call__(self, *args, **kwargs):
        if args:
            raise TypeError("forward_backward_func takes keyword arguments only")
        extra = {k: kwargs.pop(k) for k in self.EXTRA if k in kwargs}
        b = SIGNATURE.bind(**kwargs)
        b.apply_defaults()
        with cpu_shim():
            return self._run(**b.arguments, **extra)

    # ------------------------------------------------------------------------------------
    def _run(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
             micro_batch_size, decoder_seq_length=None, forward_only=False,
             collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
             p2p_communicator=None, pg_collection=None, force_all_reduce=False,
             schedule=None, microbatch_shapes=None, microbatch_weights=None):
        sched = self.schedule if schedule is None else lower(schedule, self.costs)
        if sched is None:
            raise ScheduleError("this forward_backward_func holds no schedule: pass schedule=")
        for nm, xs in (("microbatch_shapes", microbatch_shapes),
                       ("microbatch_weights", microbatch_weights)):
            if xs is not None and len(xs) != num_microbatches:
                raise ScheduleError(f"{len(xs)} {nm} for num_microbatches={num_microbatches}")
        model = model if isinstance(model, list) else [model]
        if pg_collection is None:
            pg_collection = _default_pgs()
        pp_group = p2p_communicator.pp_group if p2p_communicator is not None else pg_collection.pp
        rank, d = pp_group.rank(), pp_group.size()
        if d != sched.num_ranks:
            raise ScheduleError(f"schedule is for {sched.num_ranks} pipeline ranks, pp group has {d}")
        if num_microbatches != sched.num_microbatches:
            raise ScheduleError(f"schedule is for {sched.num_microbatches} micro-batches, "
                                f"called with num_microbatches={num_microbatches}")
        stages = sched.stages_of(rank)
        if len(model) != len(stages):
            raise ScheduleError(f"pp rank {rank} holds stages {stages} of the schedule but got "
                                f"{len(model)} model chunk(s)")
        chunk = {s: i for i, s in enumerate(stages)}
        S = sched.num_stages
        its = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(model)
        if not isinstance(data_iterator, list) and len(model) > 1 and data_iterator is not None:
            raise ScheduleError("several model chunks need a list of data iterators (one per chunk)")
        feeds = [None if it is None else _Feed(it) for it in its]
        config = get_model_config(model[0])
        model_type = get_model_type(model[0])

        def tensor_shape(mbs, seq, dec):
            sh = _ms.get_tensor_shapes(seq_length=seq, micro_batch_size=mbs, decoder_seq_length=dec,
                                       config=config, tp_group=pg_collection.tp,
                                       cp_group=pg_collection.cp)
            if adjust_tensor_shapes_fn is not None:
                sh, _ = adjust_tensor_shapes_fn(sh, sh)
            return sh[0]
        if microbatch_shapes is None:
            shape = tensor_shape(micro_batch_size, seq_length, decoder_seq_length)
            shapes = [shape] * num_microbatches
        else:
            shapes = [tensor_shape(int(b), *((int(L), None) if not isinstance(L, (tuple, list))
                                             else (int(L[0]), int(L[1]))))
                      for b, L in microbatch_shapes]
        if microbatch_weights is not None and config.calculate_per_token_loss:
            raise ScheduleError("microbatch_weights and config.calculate_per_token_loss both "
                                "rescale the loss; use one of them")
        p2p = _P2P(pp_group, config) if d > 1 else None
        cp_size = pg_collection.cp.size()
        rec = {(a.stage, a.mb) for a in sched.ranks[rank] if a.kind == Kind.R}

        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            ns_list = no_sync
            no_sync = lambda: _stack(f() for f in ns_list)  # noqa: E731
        no_sync = no_sync or contextlib.nullcontext
        # Megatron's rule: gradients are reduced (DDP hooks fire) only in the last backward of
        # each chunk; here the last B, W or BW of each stage runs with grad sync enabled
        mine = sched.ranks[rank]
        final = {max(i for i, a in enumerate(mine) if a.kind == k and a.stage == s)
                 for s in stages for k in (Kind.B, Kind.W, Kind.BW)
                 if any(a.kind == k and a.stage == s for a in mine)}
        grad_sync = _GradSync(no_sync)

        recvd: dict = {}        # (kind, stage, mb) -> (tensor, reqs)
        inputs: dict = {}       # (stage, mb) -> input tensor (None on stage 0)
        outputs: dict = {}      # (stage, mb) -> output tensor (or [tensor])
        local_in: dict = {}     # (stage, mb) -> input handed over from the previous local stage
        local_grad: dict = {}   # (stage, mb) -> output grad handed over from the next local stage
        in_grads: dict = {}     # (stage, mb) -> input grad to send
        stores: dict = {}
        rngs: dict = {}         # (stage, mb) -> RngState of a forward that R re-runs
        losses: dict = {}
        total_tokens = torch.zeros([], dtype=torch.int)
        tracker = self.tracker
        track = tracker.track if tracker is not None else contextlib.nullcontext
        self.timeline, self.mem_deltas = [], {}
        if tracker is not None:
            tracker.reset_peak()
            base = tracker.current
        seen_first = set()

        def fwd(s, m, with_grad=True, store_into=None):
            c = chunk[s]
            inp = inputs[(s, m)]
            feed = feeds[c].at(m) if feeds[c] is not None else None
            first = c not in seen_first
            seen_first.add(c)
            store = [] if store_into is None else store_into
            grad_ctx = torch.enable_grad() if with_grad and not forward_only else torch.no_grad()
            fsf = forward_step_func if microbatch_weights is None or s != S - 1 else \
                _weighted(forward_step_func, num_microbatches * float(microbatch_weights[m]))
            with grad_ctx, (track() if with_grad and not forward_only else contextlib.nullcontext()):
                out, ntok = _ms.forward_step(
                    fsf, feed, model[c], num_microbatches, inp, store, config,
                    cp_size, collect_non_loss_data,
                    is_first_microbatch=_ms.check_first_val_step(first_val_step, forward_only, first),
                    current_microbatch=m, vp_stage=None, is_last_stage=(s == S - 1))
            if store and s == S - 1 and store_into is None:
                losses[m] = store[-1]
            return out, ntok

        def output_tensor(s, m):
            o = outputs[(s, m)]
            return o[0] if isinstance(o, list) else o

        for i, a in enumerate(mine):
            k, s, m = a.kind, a.stage, a.mb
            if forward_only and k not in (Kind.F, Kind.SEND_F, Kind.RECV_F):
                continue
            sync = i in final and not forward_only
            if sync:
                grad_sync.enable()
            t0 = time.perf_counter() if self.record_timeline else 0.0
            m0 = tracker.current if tracker is not None else 0
            if k == Kind.RECV_F or k == Kind.RECV_B:
                recvd[(k, s, m)] = p2p.recv(a.peer, shapes[m])
            elif k == Kind.SEND_F:
                if microbatch_shapes is not None:
                    _check_shape(output_tensor(s, m), shapes[m], "output", s, m)
                p2p.send(a.peer, output_tensor(s, m))
                if forward_only:
                    outputs.pop((s, m))
                elif (s, m) not in rec:
                    _ms.deallocate_output_tensor(output_tensor(s, m), config.deallocate_pipeline_outputs)
            elif k == Kind.SEND_B:
                g = in_grads.pop((s, m))
                g = g[0] if isinstance(g, list) else g
                if microbatch_shapes is not None:
                    _check_shape(g, shapes[m], "input gradient", s, m)
                p2p.send(a.peer, g)
            elif k == Kind.F:
                if s == 0:
                    inp = None
                elif (s, m) in local_in:
                    inp = local_in.pop((s, m))
                else:
                    inp = _wait(recvd.pop((Kind.RECV_F, s, m)))
                inputs[(s, m)] = inp
                if (s, m) in rec and not forward_only:   # R replays this forward's dropout
                    rngs[(s, m)] = RngState()
                out, ntok = fwd(s, m, with_grad=(s, m) not in rec)
                total_tokens += ntok.to(total_tokens.dtype).cpu() if torch.is_tensor(ntok) else ntok
                outputs[(s, m)] = out
                if s + 1 < S and sched.placement[s + 1] == rank:
                    o = out[0] if isinstance(out, list) else out
                    local_in[(s + 1, m)] = o.detach().requires_grad_(not forward_only)
                    if not forward_only and (s, m) not in rec:
                        _ms.deallocate_output_tensor(o, config.deallocate_pipeline_outputs)
                if forward_only:
                    inputs.pop((s, m))
                    if s + 1 >= S or sched.placement[s + 1] == rank:
                        outputs.pop((s, m))
            elif k == Kind.R:
                with rngs.pop((s, m)).replay():
                    out, _ = fwd(s, m, with_grad=True, store_into=[])
                outputs[(s, m)] = out
                if s + 1 < S:  # only its grad_fn is needed from here on (as after a send)
                    _ms.deallocate_output_tensor(output_tensor(s, m), config.deallocate_pipeline_outputs)
            elif k in (Kind.B, Kind.BW):
                if s == S - 1:
                    og = None
                elif (s, m) in local_grad:
                    og = local_grad.pop((s, m))
                else:
                    og = _wait(recvd.pop((Kind.RECV_B, s, m)))
                inp, out = inputs.pop((s, m)), outputs.pop((s, m))
                if k == Kind.B:
                    store = stores[(s, m)] = WeightGradStore()
                    with store.deferring(tracker):
                        gin = _ms.backward_step(inp, out, og, model_type, config)
                else:
                    gin = _ms.backward_step(inp, out, og, model_type, config)
                del out
                if s > 0:
                    if sched.placement[s - 1] == rank:
                        local_grad[(s - 1, m)] = gin[0] if isinstance(gin, list) else gin
                    else:
                        in_grads[(s, m)] = gin
                del inp, gin
            elif k == Kind.W:
                stores.pop((s, m)).run_all()
            if self.record_timeline and k.is_compute:
                self.timeline.append((k.value, s, m, t0, time.perf_counter()))
            if tracker is not None and k.is_compute:
                self.mem_deltas[(k.value, s, m)] = tracker.current - m0
            if sync:
                grad_sync.disable()

        if p2p is not None:
            p2p.finish()
        if tracker is not None:
            self.peak_bytes = tracker.peak - base
        if recvd or stores or (not forward_only and (inputs or outputs)):
            raise ScheduleError(f"pp rank {rank}: schedule left work undone "
                                f"({len(recvd)} receives, {len(stores)} W, {len(outputs)} outputs)")
        grad_sync.enable()
        if not forward_only:
            if config.grad_sync_func is not None:
                fns = config.grad_sync_func if isinstance(config.grad_sync_func, list) \
                    else [config.grad_sync_func] * len(model)
                for f, mchunk in zip(fns, model):
                    f(mchunk.parameters())
            if config.finalize_model_grads_func is not None:
                config.finalize_model_grads_func(
                    model, total_tokens if config.calculate_per_token_loss else None,
                    pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        return [losses[m] for m in sorted(losses)]


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
