"""B/W split for megatron-core's linear layers (schedules.md §6.3).

megatron-core 0.16.1 has no weight-gradient store (integration.md §5: ``delay_wgrad_compute``
exists only on the MoE/TE path).  The generic store lives in
:mod:`ds_autoplan.runtime.splitgrad` (``WeightGradStore``, ``defer``; it patches ``nn.Linear``);
Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` are not ``nn.Linear`` and route
their GEMM through ``_forward_impl`` (bias inside or outside the GEMM), so this module adds:

* :class:`SplitColumnParallelLinear` / :class:`SplitRowParallelLinear` -- the Megatron layers
  with ``_forward_impl`` replaced (TP=1, no sequence parallel) by a linear whose backward returns
  the input gradient at once and defers ``dW`` (and the bias gradient, if the bias goes through
  the GEMM) with the runtime's ``defer`` while a ``WeightGradStore`` is deferring; otherwise it
  returns them at once (fused BW).  The runtime store accumulates deferred gradients through
  autograd, so Megatron DDP's gradient hooks (``main_grad``) fire as in a fused backward;
* :func:`split_backward_spec` -- swaps those classes into a layer ``ModuleSpec`` (the public way
  to choose a layer's modules in megatron-core).

Other parameters (norms, embeddings) get their gradients inside B [code: only linear layers
defer in the zero-bubble reference].
"""
from __future__ import annotations

import copy

import torch

from ..runtime.splitgrad import defer

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def _wgrad(weight, bias):
    """The W work of one linear call: [(param, grad)] for the runtime store to accumulate."""
    def run(x, go):
        go2 = go.reshape(-1, go.shape[-1])
        out = [(weight, go2.t().matmul(x.reshape(-1, x.shape[-1])))]
        if bias is not None:
            out.append((bias, go2.sum(0)))
        return out
    return run


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        # the weight is kept on ctx, not saved: under saved-tensor hooks (memtrack) the unpacked
        # tensor is not the Parameter object, and dW must land on the Parameter
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias
        out = torch.matmul(x, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, go):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        gx = go.matmul(weight)
        run = _wgrad(weight, ctx.bias)
        if defer(run, x, go):          # B of a split schedule: dW waits for the W pass
            return gx, None, None
        with torch.no_grad():
            grads = dict(run(x, go))
        return gx, grads[weight], (grads[ctx.bias] if ctx.bias is not None else None)


class _SplitMixin:
    """``_forward_impl`` override shared by the two Megatron linear layers."""

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                      allreduce_dgrad=False, sequence_parallel=False, *args, **kwargs):
        tp = getattr(self, "tp_group", None)
        if (not weight.requires_grad or allreduce_dgrad or sequence_parallel
                or (tp is not None and tp.size() > 1)):
            # TP>1 / sequence parallel: keep Megatron's fused path (no split; documented gap)
            return super()._forward_impl(input, weight, bias, gradient_accumulation_fusion,
                                         allreduce_dgrad, sequence_parallel, *args, **kwargs)
        return _SplitLinearFn.apply(input, weight, bias)


class SplitColumnParallelLinear(_SplitMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose weight gradient can be deferred to a W pass."""


class SplitRowParallelLinear(_SplitMixin, RowParallelLinear):
    """``RowParallelLinear`` whose weight gradient can be deferred to a W pass."""


_SWAP = {ColumnParallelLinear: SplitColumnParallelLinear, RowParallelLinear: SplitRowParallelLinear}


def split_backward_spec(spec):
    """A deep copy of a layer ``ModuleSpec`` with Megatron's linear layers replaced by the
    split-aware ones (e.g. ``split_backward_spec(get_gpt_layer_local_spec())``)."""
    spec = copy.deepcopy(spec)

    def walk(obj, seen):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            items = list(obj.items())
        elif hasattr(obj, "__dict__"):
            items = list(vars(obj).items())
        else:
            return
        for k, v in items:
            if isinstance(v, type) and v in _SWAP:
                if isinstance(obj, dict):
                    obj[k] = _SWAP[v]
                else:
                    setattr(obj, k, _SWAP[v])
            elif not isinstance(v, (str, int, float, bool, type, tuple)) and v is not None:
                walk(v, seen)
    walk(spec, set())
    return spec
