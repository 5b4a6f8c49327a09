"""B/W split for megatron-core's linear layers (docs/schedules.md §6.3).

megatron-core 0.16.1 has no weight-gradient store (docs/runtimes.md §5: ``delay_wgrad_compute``
exists only on the MoE/TE path).  The generic store lives in
:mod:`ds_autoplan.runtime.splitgrad` (``WeightGradStore``, ``defer``; it patches ``nn.Linear``);
Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` are not ``nn.Linear`` and route
their GEMM through ``_forward_impl`` (bias inside or outside the GEMM), so this module adds:

* :class:`SplitColumnParallelLinear` / :class:`SplitRowParallelLinear` -- the Megatron layers
  with ``_forward_impl`` (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``)
  replaced by a linear whose backward returns the input gradient at once and defers ``dW``
  (and the bias gradient, if the bias goes through the GEMM) with the runtime's ``defer``
  while a ``WeightGradStore`` is deferring; otherwise it returns them at once (fused BW).
  Tensor parallelism keeps Megatron's communication: the row-parallel GEMM is local (its
  output reduction happens outside ``_forward_impl``); column-parallel without sequence
  parallelism all-reduces the input gradient over the layer's tp group in B; with sequence
  parallelism the input is all-gathered along dim 0 in forward and the input gradient of
  the gathered input is reduce-scattered in B.  The runtime store accumulates deferred
  gradients through autograd, so Megatron DDP's gradient hooks (``main_grad``) fire as in a
  fused backward (``gradient_accumulation_fusion`` is therefore not used on this path);
* :func:`split_backward_spec` -- swaps those classes into a layer ``ModuleSpec`` (the public way
  to choose a layer's modules in megatron-core).

Other parameters (norms, embeddings) get their gradients inside B [code: only linear layers
defer in the zero-bubble reference].
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..splitgrad import defer

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (_gather_along_first_dim,
                                                    _reduce_scatter_along_first_dim)


def _wgrad(weight, bias, sp_group):
    """The W work of one linear call: [(param, grad)] for the runtime store to accumulate.

    Sequence parallel: dW needs the gathered input.  Only the local input is kept and W
    re-gathers it, as Megatron's own backward does: one all-gather per linear in backward
    either way, and the store holds 1/tp of the gathered input from B until W (keeping the
    gathered input would hold tp times as much across the whole B→W lifetime).  The
    all-gather at W is matched on every tp rank: all tp ranks of a pipeline rank run the same
    action list (the executor takes it by pp rank) and drain a store in the same order."""
    def run(x, go):
        if sp_group is not None:
            x = _gather_along_first_dim(x, sp_group)
        go2 = go.reshape(-1, go.shape[-1])
        out = [(weight, go2.t().matmul(x.reshape(-1, x.shape[-1])))]
        if bias is not None:
            out.append((bias, go2.sum(0)))
        return out
    return run


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, allreduce_dgrad, tp_group):
        # the weight is kept on ctx, not saved: under saved-tensor hooks (memtrack) the unpacked
        # tensor is not the Parameter object, and dW must land on the Parameter.
        # tp_group is None unless a collective is needed (column-parallel, tp > 1).
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias
        ctx.allreduce_dgrad, ctx.group = allreduce_dgrad, tp_group
        ctx.sp_group = None if allreduce_dgrad else tp_group
        total = x if ctx.sp_group is None else _gather_along_first_dim(x, tp_group)
        out = torch.matmul(total, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, go):
        (x,) = ctx.saved_tensors
        gx = go.matmul(ctx.weight)
        # B: Megatron's dgrad collective (all-reduce, or reduce-scatter of the gathered
        # input's gradient with sequence parallel); the all-reduce overlaps a fused dW
        handle = dist.all_reduce(gx, group=ctx.group, async_op=True) if ctx.allreduce_dgrad else None
        if ctx.sp_group is not None:
            gx = _reduce_scatter_along_first_dim(gx, ctx.sp_group)
        run = _wgrad(ctx.weight, ctx.bias, ctx.sp_group)
        grads = {}
        if not defer(run, x, go):      # fused BW; in B of a split schedule dW waits for W
            with torch.no_grad():
                grads = dict(run(x, go))
        if handle is not None:
            handle.wait()
        return gx, grads.get(ctx.weight), grads.get(ctx.bias), None, None


class _SplitMixin:
    """``_forward_impl`` override shared by the two Megatron linear layers."""

    def _forward_impl(self, input, weight, *args, **kw):
        # megatron-core 0.16.1 calls it with keywords only (ColumnParallelLinear.forward,
        # RowParallelLinear.forward); anything else takes Megatron's path
        if args or not weight.requires_grad or kw.get("grad_output_buffer") is not None:
            # frozen weight / Megatron's own embedding-wgrad deferral
            return super()._forward_impl(input, weight, *args, **kw)
        ar, sp = bool(kw.get("allreduce_dgrad")), bool(kw.get("sequence_parallel"))
        assert not (ar and sp)          # as in Megatron's backward
        group = None
        if ar or sp:
            group = kw["tp_group"] if kw.get("tp_group") is not None else self.tp_group
        return _SplitLinearFn.apply(input, weight, kw.get("bias"), ar, group)


class SplitColumnParallelLinear(_SplitMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose weight gradient can be deferred to a W pass."""


class SplitRowParallelLinear(_SplitMixin, RowParallelLinear):
    """``RowParallelLinear`` whose weight gradient can be deferred to a W pass."""


_SWAP = {ColumnParallelLinear: SplitColumnParallelLinear, RowParallelLinear: SplitRowParallelLinear}


def split_backward_spec(spec):
    """A deep copy of a layer ``ModuleSpec`` (or a block spec with ``layer_specs``, e.g. the MoE
    one of ``get_gpt_decoder_block_spec``) with Megatron's linear layers replaced by the
    split-aware ones (e.g. ``split_backward_spec(get_gpt_layer_local_spec())``)."""
    spec = copy.deepcopy(spec)

    def walk(obj, seen):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (dict, list)):    # a block spec's layer_specs is a list
            items = list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj))
        elif hasattr(obj, "__dict__"):
            items = list(vars(obj).items())
        else:
            return
        for k, v in items:
            if isinstance(v, type) and v in _SWAP:
                if isinstance(obj, (dict, list)):
                    obj[k] = _SWAP[v]
                else:
                    setattr(obj, k, _SWAP[v])
            elif not isinstance(v, (str, int, float, bool, type, tuple)) and v is not None:
                walk(v, seen)
    walk(spec, set())
    return spec
