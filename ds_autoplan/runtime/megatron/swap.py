"""DawnPiper's swap in our Megatron forward_backward_func (seed 002 §C.2;
docs/dawnpiper.md §7.5): a stage's chosen saved-for-backward tensors go to host memory
during its forward and come back when its backward reads them.

The executor stays as it is: the forward step function is wrapped, so whichever model chunk
(stage) Megatron's ``forward_step`` hands it runs under that chunk's
:class:`~ds_autoplan.runtime.swap.Swapper`::

    fb = ds_autoplan.runtime.megatron.get_forward_backward_func(plan, tracker=tracker)
    step = swap_forward_step(forward_step, chunks, [{"decoder.layers.0.mlp": None}, {}],
                             tracker=tracker)
    fb(forward_step_func=step, model=chunks, ...)

``policies``: one per local chunk, a :class:`SwapPolicy` or its JSON form (module name inside
the chunk -> indices of its new saved storages, or None for all), e.g. one stage's entry of
``ds_autoplan.search.memopt.stage_memory_options(...)["swap"]`` for a profile of that chunk.
Evaluation (no autograd) runs without swapping.  With ``tracker`` (the runner's
``MemTracker``) the bytes that stay on the device are counted as the runner counts them.
"""
from __future__ import annotations

import contextlib

import torch

from ..swap import SwapPolicy, Swapper


def swap_forward_step(forward_step_func, chunks, policies, *, tracker=None):
    """``forward_step_func`` whose model forward runs under the chunk's Swapper; the
    Swappers are on the returned function's ``swappers`` (chunk index -> Swapper)."""
    chunks = chunks if isinstance(chunks, (list, tuple)) else [chunks]
    if len(policies) != len(chunks):
        raise ValueError(f"{len(policies)} swap policies for {len(chunks)} model chunks")
    swappers = {c: Swapper(p if isinstance(p, SwapPolicy) else SwapPolicy.from_dict(p), m,
                           tracker=tracker)
                for c, (m, p) in enumerate(zip(chunks, policies)) if p}
    index = {id(m): c for c, m in enumerate(chunks)}

    def step(data_iterator, model, *args, **kwargs):
        sw = swappers.get(index.get(id(model)))
        ctx = sw.forward() if sw is not None and torch.is_grad_enabled() else contextlib.nullcontext()
        with ctx:
            return forward_step_func(data_iterator, model, *args, **kwargs)
    step.swappers = swappers
    return step
