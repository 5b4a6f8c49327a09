"""Built-in models for profiling and examples, and ``module:path.to.factory`` resolution.

``resolve_model(name)`` returns a :class:`ds_autoplan.profile.ModelEntry` for
:func:`ds_autoplan.profile.profile_model`: the module, a function making example inputs for a
batch size, an optional loss (for profiling the last stage's loss) and the tracer class to use
(Hugging Face models need ``transformers.utils.fx.HFTracer``).
"""
from __future__ import annotations

import importlib
from typing import Callable

from torch import nn

from ..profile.profile import ModelEntry
from .tiny_gpt import GPTConfig, TinyGPT, example_batch, gpt_loss, gpt_tiny

__all__ = ["GPTConfig", "ModelEntry", "TinyGPT", "BUILTIN", "example_batch", "gpt_loss",
           "gpt_tiny", "resolve_model"]


def _tiny(name: str, **kw) -> ModelEntry:
    m = gpt_tiny(**kw)
    cfg = m.cfg
    return ModelEntry(name, m, lambda b: m.example_inputs(b),
                      lambda out, b: gpt_loss(out, example_batch(cfg, b)[1]),
                      None, cfg.to_dict(), cfg.seq_len)


def _hf(name: str, family: str) -> ModelEntry:
    try:
        import torch
        import transformers
        from transformers.utils.fx import HFTracer
    except ImportError as e:
        from ..errors import UserError
        raise UserError(f"model {name!r} needs the 'transformers' package ({e}); "
                        "install it or use gpt-tiny / module:path.to.factory") from None
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512,
                                      n_positions=64)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                       num_key_value_heads=4, intermediate_size=172,
                                       vocab_size=512, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg)
    seq = 64

    def inputs(b: int):
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, 512, (b, seq), generator=g),)
    return ModelEntry(name, model, inputs, None, HFTracer, cfg.to_dict(), seq)


def _megatron(name: str) -> ModelEntry:
    """megatron-core GPTModel (2 layers, hidden 16) on this process: a 1-rank gloo group and
    model-parallel state are created if absent.  Traced with Merak-style proxies: transformer
    layers and the tensor-parallel GEMM/embedding modules are leaves; optional forward
    arguments are fixed to None; ``make_viewless_tensor`` is recorded as one call."""
    import os

    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding)
    from megatron.core.utils import make_viewless_tensor

    from ..runtime.megatron.shim import cpu_shim
    from . import megatron_gpt as T
    if not torch.distributed.is_initialized():
        from ..runtime.launch import free_port
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model = T.gpt(T.base_config(num_layers=2), split=False)
    opt = ("attention_mask", "decoder_input", "labels", "inference_context", "packed_seq_params",
           "extra_block_kwargs", "runtime_gather_output", "inference_params", "loss_mask",
           "padding_mask")

    def inputs(b: int):
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, T.VOCAB, (b, T.SEQ), generator=g),
                torch.arange(T.SEQ).expand(b, -1).contiguous(), None)
    return ModelEntry(name, model, inputs, None, None,
                      {"hidden": T.HIDDEN, "num_heads": T.HEADS, "vocab_size": T.VOCAB}, T.SEQ,
                      (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding),
                      {k: None for k in opt}, (make_viewless_tensor,),
                      lambda: cpu_shim(remap_cuda_factories=True))


BUILTIN: dict[str, Callable[[], ModelEntry]] = {
    "gpt-tiny": lambda: _tiny("gpt-tiny"),
    "gpt-tiny-4": lambda: _tiny("gpt-tiny-4", num_layers=4),
    "hf-gpt2-tiny": lambda: _hf("hf-gpt2-tiny", "gpt2"),
    "hf-llama-tiny": lambda: _hf("hf-llama-tiny", "llama"),
    "megatron-gpt-tiny": lambda: _megatron("megatron-gpt-tiny"),
}


def resolve_model(name: str) -> ModelEntry:
    """``gpt-tiny`` (and the other BUILTIN names) or ``module:pkg.mod.factory``.  A factory
    returns an ``nn.Module`` with ``example_inputs(batch_size)``, or ``(module, make_inputs)``."""
    from ..errors import UserError
    if name in BUILTIN:
        return BUILTIN[name]()
    if not name.startswith("module:"):
        raise UserError(f"unknown model {name!r}; built-in: {', '.join(BUILTIN)}, "
                        "or module:path.to.factory")
    path = name[len("module:"):]
    mod_name, _, attr = path.replace(":", ".").rpartition(".")
    if not all(part.isidentifier() for part in [*mod_name.split("."), attr]):
        raise UserError(f"model {name!r}: expected module:package.module.factory (Python names; "
                        "an importable module, not a file path)")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"cannot import model factory {path!r}: {e}") from None
    made = factory()
    model, make_inputs = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, nn.Module):
        raise UserError(f"factory {path!r} returned {type(model).__name__}, not an nn.Module")
    if make_inputs is None:
        if not hasattr(model, "example_inputs"):
            raise UserError(f"model from {path!r} has no example_inputs(batch_size); return "
                            "(module, make_inputs) from the factory instead")
        make_inputs = model.example_inputs
    return ModelEntry(name, model, lambda b: tuple(make_inputs(b)))
