"""Calibrated sleep: the one stand-in for compute in every benchmark.

On a shared CPU machine a benchmark of *schedules* must not measure CPU contention, so each
layer's forward, input-gradient (B) and weight-gradient (W) pass sleeps a set time instead
of computing.  ``time.sleep`` overshoots by a roughly constant amount per call, which would
penalise schedules with more, shorter actions, and grows with the machine's load;
:func:`sleep` subtracts the overshoot, measured at start (:func:`oversleep`) and then tracked
sleep by sleep.

:class:`SleepLayer` is ``y = p * x`` with a one-element weight ``p``; its backward joins the
B/W split of zero-bubble schedules through ``runtime.splitgrad.defer``.  What it keeps for
backward sets the benchmark's activation-memory model:

* ``inner`` extra copies of the input stand for the layer's internal activations;
* ``w_keeps='all'``: B keeps everything until W (the zero-bubble paper's a_B = 0);
  ``w_keeps='grad'``: B frees the internals, W keeps the input and the output gradient
  (per layer (a_F, a_B, a_W) = (1 + inner, 1 - inner, -2) in units of one input).

``split='graph'`` is the same layer for a runtime that splits the backward at the autograd
graph instead (``torch.distributed.pipelining``'s ``stage_backward_input`` / ``_weight``):
the input path and the weight path are separate autograd nodes, B sleeps on the first, W on
the second, and everything is kept until W (``w_keeps='all'``'s bytes).

B is the input gradient: a layer whose input needs none (the first layer of the first stage)
skips it, as autograd skips an operation's input gradient -- in both splits, so that every
runtime runs the same model (torch.distributed.pipelining's first stage never asks for it).

Times are seconds, or a callable ``shape -> seconds`` (a cost model of the input's shape).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Union

import torch

Seconds = Union[float, Callable[[tuple], float]]
_OVER: list = [None]      # this process's measured overshoot of time.sleep
_SCALE: list = [1.0]      # every sleep is scaled by this (see scaled)


def oversleep(samples: int = 15, dt: float = 0.002) -> float:
    """Median overshoot of ``time.sleep(dt)`` here, in seconds (measured, then cached)."""
    over = []
    for _ in range(samples):
        t0 = time.perf_counter()
        time.sleep(dt)
        over.append(time.perf_counter() - t0 - dt)
    _OVER[0] = max(0.0, statistics.median(over))
    return _OVER[0]


def sleep(seconds: float) -> None:
    """Sleep ``seconds`` of wall time, net of the overshoot (no spinning: a spin would take a
    core from the other ranks).  The overshoot estimate follows the load: each sleep moves
    it a fifth of the way towards the overshoot just observed."""
    seconds *= _SCALE[0]
    if seconds <= 0:
        return
    over = _OVER[0] if _OVER[0] is not None else oversleep()
    if seconds <= over:
        return
    t0 = time.perf_counter()
    time.sleep(seconds - over)
    _OVER[0] = min(max(0.0, over + 0.2 * (time.perf_counter() - t0 - seconds)), seconds / 2)


@contextlib.contextmanager
def scaled(factor: float):
    """Inside, every sleep lasts ``factor`` times as long; ``scaled(0)`` turns the sleep
    layers into a null model, so a step measures only the runtime's own time."""
    prev, _SCALE[0] = _SCALE[0], float(factor)
    try:
        yield
    finally:
        _SCALE[0] = prev


def _weight_pass(*held, layer):
    """The deferred W: sleep, then the weight gradient (B's sum when W keeps everything,
    else from the held input and output gradient)."""
    sleep(layer.seconds(layer.tw, held[0].shape))
    s = held[-1] if layer.w_keeps == "all" else (held[1] * held[0]).sum().reshape(1)
    g = _state_grad(layer)
    return [(layer.p, s)] + ([(layer.q, g)] if g is not None else [])


def _state_grad(layer):
    """The gradient of the layer's parameter-count stand-in ``q`` (zeros): once per step (when
    it has none), so its optimizer states exist and no backward adds to it."""
    q = layer.q
    return torch.zeros_like(q) if q is not None and q.grad is None else None


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, q, layer):
        sleep(layer.seconds(layer.tf, x.shape))
        saved = (x, x.repeat(1, 1, layer.inner)) if layer.inner else (x,)
        ctx.save_for_backward(*saved)
        ctx.p, ctx.layer = p, layer
        return x * p

    @staticmethod
    def backward(ctx, go):
        from ..runtime.splitgrad import defer
        x, *inner = ctx.saved_tensors
        layer = ctx.layer
        gx = None
        if ctx.needs_input_grad[0]:        # B: the input gradient, only where it is wanted
            sleep(layer.seconds(layer.tb, x.shape))
            gx = go * ctx.p
        s = (go * x).sum().reshape(1)
        held = (x, *inner, s) if layer.w_keeps == "all" else (x, go)
        if defer(_weight_pass, *held, layer=layer):
            return gx, None, None, None
        sleep(layer.seconds(layer.tw, x.shape))
        return gx, s, _state_grad(layer), None


class _InputPath(torch.autograd.Function):
    """``split='graph'``: F sleeps on the way in, B on the way back (input gradients)."""

    @staticmethod
    def forward(ctx, x, layer):
        sleep(layer.seconds(layer.tf, x.shape))
        ctx.layer, ctx.shape = layer, x.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        sleep(ctx.layer.seconds(ctx.layer.tb, ctx.shape))
        return g, None


class _WeightPath(torch.autograd.Function):
    """``split='graph'``: W sleeps on the weight's path and keeps the internals until then."""

    @staticmethod
    def forward(ctx, p, internals, layer, shape):
        ctx.save_for_backward(internals)
        ctx.layer, ctx.shape = layer, shape
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        sleep(ctx.layer.seconds(ctx.layer.tw, ctx.shape))
        return g, None, None, None


class SleepLayer(torch.nn.Module):
    """``y = p * x``; F, B and W sleep ``tf``, ``tb``, ``tw`` (seconds or ``shape -> s``)."""

    def __init__(self, tf: Seconds, tb: Seconds, tw: Seconds = 0.0, *, inner: int = 0,
                 w_keeps: str = "all", split: str = "defer", params: int = 0):
        super().__init__()
        if w_keeps not in ("all", "grad"):
            raise ValueError("w_keeps must be 'all' or 'grad'")
        if split not in ("defer", "graph") or (split == "graph" and w_keeps != "all"):
            raise ValueError("split must be 'defer' or 'graph' (which keeps everything until W)")
        self.p = torch.nn.Parameter(torch.ones(1))
        # ``params``: a weight of that many elements that holds the layer's parameter bytes
        # (its gradient and optimizer states too) and takes no compute: the gradient is zeros,
        # given once per step (_state_grad); split='defer' only
        self.q = torch.nn.Parameter(torch.zeros(int(params))) if params else None
        if params and split != "defer":
            raise ValueError("params needs split='defer'")
        self.tf, self.tb, self.tw, self.inner, self.w_keeps = tf, tb, tw, int(inner), w_keeps
        self.split = split

    @staticmethod
    def seconds(t: Seconds, shape) -> float:
        return float(t(tuple(shape))) if callable(t) else float(t)

    def forward(self, x):
        if self.split == "defer":
            return _SleepFn.apply(x, self.p, self.q, self)
        internals = x.detach().repeat(1, 1, self.inner) if self.inner else x.new_empty(0)
        return _InputPath.apply(x, self) * _WeightPath.apply(self.p, internals, self, x.shape)


def cost_model_layers(model: str, cluster, mbs: int, slower: float = 1.0) -> list:
    """A model's layers (embedding, blocks, head) as sleep layers that take ``slower`` times
    the cost model's F, B and W on ``cluster`` at micro-batch ``mbs``, hold the layer's
    parameters (as one weight: its gradient and optimizer states follow) and keep for backward
    the activation bytes the cost model gives it (copies of the input): a machine of the
    cluster's compute, whatever the cores running it (bench/calibration.py, tests/test_replan.py)."""
    from ..cost.model import CostModel, Strategy
    from ..spec.model import load_model
    spec = load_model(model)
    cm = CostModel(spec, cluster, precision="fp32")
    t = cm.tables([Strategy(1, 1)], mbs)
    x_bytes = mbs * spec.seq_len * spec.hidden * 4

    def layer(u):
        f, b, w = (float(x[u, 0]) * slower for x in (t.fwd, t.bwd_ns - t.wgrad, t.wgrad))
        return SleepLayer(f, b, w, inner=max(0, round(float(t.f1[u, 0]) / x_bytes) - 1),
                          params=int(cm.unit_params[u][0]))
    return [layer(0), *(layer(int(k)) for k in cm.block_types), layer(1)]
