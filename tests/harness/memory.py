"""Per-layer activation bytes, measured with the runtime's tracker and B/W split (the
memory side of the simulator's predictions in the runtime tests)."""
from __future__ import annotations

import torch

from ds_autoplan.runtime import splitgrad
from ds_autoplan.runtime.memtrack import MemTracker


def profile_layers(layers, sample, loss_fn=None, labels=None, split: bool = True):
    """Per-layer activation bytes of one micro-batch: list of (mem_f, mem_b, mem_w).

    Runs the layers in sequence on ``sample`` with a tracker: ``mem_f`` is what stays saved
    after the layer's forward (the loss, if given, is charged to the last layer), ``mem_b`` the
    change after its input-gradient backward (with :mod:`splitgrad` deferral when ``split``),
    ``mem_w`` the change after its weight-gradient pass; they sum to zero.
    """
    params = [p for m in layers for p in m.parameters()]
    tr = MemTracker(exclude=params)
    undo = splitgrad.install(layers) if split else None
    out = []
    x = sample
    try:
        for i, layer in enumerate(layers):
            last = loss_fn is not None and i == len(layers) - 1
            inp = x.detach().requires_grad_(x.is_floating_point())
            before = tr.current
            with tr.track():
                y = layer(inp)
                root = loss_fn(y, labels) if last else y
            f = tr.current - before
            x = y.detach()
            store = splitgrad.WeightGradStore()
            with store.deferring(tracker=tr):
                root.backward(None if last else torch.ones_like(root))
            del y, root
            b = tr.current - before - f
            store.run_all()
            out.append((f, b, tr.current - before - f - b))
            for p in params:
                p.grad = None
    finally:
        if undo is not None:
            undo()
    return out
