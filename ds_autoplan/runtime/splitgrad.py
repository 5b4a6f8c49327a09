"""Deferred weight gradients: the B/W split of zero-bubble schedules (docs/schedules.md §6.3).

``install(modules)`` routes every ``nn.Linear`` through :class:`_SplitLinear`.  Its backward
always returns the input gradient; the weight/bias gradient GEMMs run either at once (fused
backward, identical to ``F.linear``) or, while a :class:`WeightGradStore` is ``deferring``,
are stashed as ``(input, grad_output)`` and run later by ``store.run_all()`` (the W pass),
accumulating into ``param.grad`` exactly as autograd's AccumulateGrad would.  Other
parameters (norms, embeddings) are small and get their gradients inside B [code: only linear
layers defer in the ZB reference].  With a :class:`~.memtrack.MemTracker` the stash is
counted as held activation memory until W has run.
"""
from __future__ import annotations

import contextlib
from types import MethodType

import torch
import torch.nn.functional as F

from .memtrack import hold

# Process-wide, not thread-local: on GPUs autograd runs backward on a device thread while
# the calling thread waits, so the store set around ``backward()`` must be visible there.
_ACTIVE: list = [None]


def _active() -> "WeightGradStore | None":
    return _ACTIVE[0]


def _weight_grads(x, go, has_bias):
    go2 = go.reshape(-1, go.shape[-1])
    gw = go2.t().matmul(x.reshape(-1, x.shape[-1]))
    gb = go2.sum(0) if has_bias else None
    return gw, gb


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.save_for_backward(x, weight)
        ctx.module = module
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, go):
        x, weight = ctx.saved_tensors
        gx = go.matmul(weight) if ctx.needs_input_grad[0] else None
        if defer(_linear_wgrad, x, go, module=ctx.module):
            return gx, None, None, None
        gw, gb = _weight_grads(x, go, ctx.has_bias)
        return gx, (gw if ctx.needs_input_grad[1] else None), (gb if ctx.needs_input_grad[2] else None), None


def _linear_wgrad(x, go, module):
    gw, gb = _weight_grads(x, go, module.bias is not None)
    return [(module.weight, gw), (module.bias, gb)]


def defer(fn, *tensors, **kwargs) -> bool:
    """Inside a backward: if a :class:`WeightGradStore` is deferring, stash the weight-gradient
    work ``fn(*tensors, **kwargs) -> [(param, grad), ...]`` for its W pass and return True;
    otherwise return False (compute it now).  Custom layers use this to join the B/W split;
    ``tensors`` are counted as held activations until W."""
    store = _active()
    if store is None:
        return False
    store._items.append((fn, [hold(store._tracker, t) for t in tensors], kwargs))
    return True


def _split_forward(self, x):
    return _SplitLinear.apply(x, self.weight, self.bias, self)


def install(modules) -> callable:
    """Route the ``nn.Linear`` layers inside ``modules`` through the split backward.

    Returns a function that undoes it.  Idempotent."""
    if isinstance(modules, torch.nn.Module):
        modules = [modules]
    done = []
    for root in modules:
        for m in root.modules():
            if isinstance(m, torch.nn.Linear) and "forward" not in m.__dict__:
                m.forward = MethodType(_split_forward, m)
                done.append(m)

    def undo():
        for m in done:
            m.__dict__.pop("forward", None)
    return undo


class WeightGradStore:
    """The W work of one (stage, micro-batch): filled during B, drained by W."""

    def __init__(self):
        self._items: list = []
        self._tracker = None

    def __len__(self) -> int:
        return len(self._items)

    @contextlib.contextmanager
    def deferring(self, tracker=None):
        """Inside: backward passes through split layers stash their weight-gradient work here."""
        prev = _active()
        self._tracker = tracker
        _ACTIVE[0] = self
        try:
            yield self
        finally:
            _ACTIVE[0] = prev

    def run_all(self) -> None:
        """The W pass: compute every stashed weight gradient, then free the stash.

        Gradients reach ``param.grad`` through autograd's AccumulateGrad (``backward`` on the
        leaf parameters), so gradient hooks of DeepSpeed (ZeRO, bf16 accumulation) fire as
        for a fused backward."""
        items, self._items = self._items, []
        params, grads = [], []
        with torch.no_grad():
            while items:
                fn, refs, kwargs = items.pop()
                for p, g in fn(*[r.tensor for r in refs], **kwargs):
                    if g is not None and p is not None and p.requires_grad:
                        params.append(p)
                        grads.append(g.to(p.dtype))
                del refs
        if params:
            torch.autograd.backward(params, grads)
