"""Profile a pipeline's own layer list (a ``PipelineModule``'s layers: modules, ``LayerSpec`` or
plain functions) with one unit per layer, so the planner's partition is over exactly the
layers the script built (DawnPiper's measured per-node costs, docs/dawnpiper.md §2.3, at
the granularity DeepSpeed partitions).  Profiling leaves the training untouched: the random
number streams are forked and module buffers (e.g. BatchNorm statistics) restored."""
from __future__ import annotations

import contextlib
import datetime

import torch
from torch import nn

from .measure import measure_chain
from .profile import Profile, Unit, device_info, model_fingerprint
from .trace import Chain


class _Fn(nn.Module):
    """A plain function layer (``lambda x: torch.flatten(x, 1)``) as a module."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class LayerChain(nn.Module):
    """The layers run in order, each on its predecessor's output as one argument (DeepSpeed's
    ``PipelineModule.forward``); ``submod_i`` is layer i (what :class:`trace.Chain` expects)."""

    def __init__(self, layers):
        super().__init__()
        self.n = len(layers)
        for i, layer in enumerate(layers):
            self.add_module(f"submod_{i}", layer if isinstance(layer, nn.Module) else _Fn(layer))

    def forward(self, x):
        for i in range(self.n):
            x = getattr(self, f"submod_{i}")(x)
        return x


def built(layer):
    """A module or function for each entry of a PipelineModule's layer list (LayerSpec built)."""
    from deepspeed.runtime.pipe.module import LayerSpec
    return layer.build() if isinstance(layer, LayerSpec) else layer


def layer_name(layer) -> str:
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", "fn")


def _to(x, device):
    if torch.is_tensor(x):
        return x.to(device)
    return type(x)(_to(t, device) for t in x) if isinstance(x, (tuple, list)) else x


@contextlib.contextmanager
def untouched(module: nn.Module):
    """Random state forked, buffers restored, gradients left as they were."""
    bufs = {k: b.detach().clone() for k, b in module.named_buffers()}
    grads = {p: p.grad for p in module.parameters()}
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        try:
            yield module
        finally:
            with torch.no_grad():
                for k, b in module.named_buffers():
                    b.copy_(bufs[k])
            for p, g in grads.items():
                p.grad = g


def profile_layer_list(layers, inputs, labels=None, loss_fn=None, *, name: str = "layers",
                       device=None, repeats: int = 2, warmup: int = 1) -> Profile:
    """Measured costs of each entry of ``layers`` on one micro-batch's ``inputs`` (what the first
    layer receives; ``loss_fn(out, labels)`` profiled with the last layer).  Every unit is a ``node``: the planner may cut
    between any two layers, as DeepSpeed's ``PipelineModule`` partition does."""
    from .hardware import matmul_flops
    chain_mod = LayerChain([built(x) for x in layers])
    device = torch.device(device or next((p.device for p in chain_mod.parameters()), "cpu"))
    names = [f"{i}:{layer_name(x)}" for i, x in enumerate(layers)]
    chain = Chain(None, chain_mod, names, ["node"] * len(names), [[n] for n in names])
    inputs = _to(inputs, device)
    lf = None
    if loss_fn is not None:
        labels = _to(labels, device)
        lf = lambda out: loss_fn(out, labels)  # noqa: E731
    with untouched(chain_mod):
        rows, loss = measure_chain(chain, (inputs,), device, repeats=repeats, warmup=warmup, loss_fn=lf)
        flops_ref = matmul_flops(512, device, repeats=3)
    first = inputs if torch.is_tensor(inputs) else inputs[0]
    batch = int(first.shape[0]) if first.dim() else 1
    dtype = next((str(p.dtype).replace("torch.", "") for p in chain_mod.parameters()), "float32")
    return Profile(name, model_fingerprint(chain_mod, [], "layer"), device_info(device), batch,
                   [Unit(**r) for r in rows], "layer", [], 1, dtype, loss, repeats,
                   {"class": "PipelineModule", "layers": names,
                    "params": int(sum(p.numel() for p in chain_mod.parameters())), "config": {}},
                   flops_ref,
                   datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
