"""The run's record (runtime/common/record.py) for DeepSpeed's plain engine: a plan without a
pipeline, trained by the script's own loop (``engine(x)``, ``engine.backward(loss)``,
``engine.step()`` per micro-batch: a plain script, Hugging Face's Trainer, Accelerate) or by
:class:`~ds_autoplan.runtime.deepspeed.plain.DataParallelEngine`'s ``train_batch``.

The engine's own calls are its actions: ``forward`` is an F, ``backward`` a fused BW (its
gradient reduction inside, as DeepSpeed's ZeRO runs it), and ``step`` at the accumulation
boundary ends the iteration (the optimizer step, in ``step_tail``).  The peak is the model
states' bytes plus the largest saved activations of a forward
(:class:`~ds_autoplan.runtime.memtrack.MemTracker` over the forward, as the pipeline engine
tracks its actions).  One iteration is one
global batch: every micro-batch from the first forward after a boundary to the boundary's
``step``.  The engine is not subclassed: its three bound methods are wrapped on the instance,
so any engine ``deepspeed.initialize`` returned records alike.
"""
from __future__ import annotations

import contextlib

import torch

from ...schedule import Kind
from ..common import record
from ..common.memory import ActionMemory
from ..memtrack import MemTracker


def record_engine(engine, plan, runtime: str = "deepspeed-plain"):
    """Wrap ``engine``'s forward, backward and step so the run writes ``measured.json`` (when it
    records: :func:`record.from_env`); returns the recorder, or None."""
    rec = record.from_env(plan, 0, runtime,
                          state_bytes=lambda: record.model_state_bytes(engine.module, engine.optimizer))
    if rec is None:
        return None
    forward, backward, step = engine.forward, engine.backward, engine.step
    open_ = [False]                    # an iteration has begun and not reached its boundary
    tracker = MemTracker()             # the forward's saved activations (not ActionMemory's deltas)
    timing = ActionMemory(None, rec)   # each call's own time, as the adapters time their actions
    forwards = [0]                     # of this iteration: the micro-batch a call belongs to

    def timed(kind, fn):
        def run(*args, **kwargs):
            if kind is Kind.F and not torch.is_grad_enabled():
                return fn(*args, **kwargs)      # an evaluation's forward: no part of a training step
            if not open_[0]:
                rec.step_begin()
                timing.new_step()
                tracker.reset_peak()
                open_[0], forwards[0] = True, 0
            mb = forwards[0] if kind is Kind.F else forwards[0] - 1
            forwards[0] += kind is Kind.F
            track = tracker.track() if kind is Kind.F else contextlib.nullcontext()
            token = timing.begin()
            try:
                with track:
                    return fn(*args, **kwargs)
            finally:
                timing.end(token, kind, 0, mb)
        run.__wrapped__ = fn
        return run

    def step_then_record(*args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()     # step() moves it on
        out = step(*args, **kwargs)
        if boundary and open_[0]:
            open_[0] = False
            rec.step_end(tracker.peak)
        return out
    step_then_record.__wrapped__ = step
    engine.forward = timed(Kind.F, forward)
    engine.backward = timed(Kind.BW, backward)
    engine.step = step_then_record
    engine.ap_recorder = rec
    return rec
