"""The one tiny megatron-core GPT of ds_autoplan (tests, benchmarks, the profiler's
``megatron-gpt-tiny``): Megatron's local layer spec, CPU-friendly config, fixed seeds.

``gpt(config, ...)`` builds one pipeline chunk (``pre_process`` / ``post_process`` /
``vp_stage`` as Megatron's ``GPTModel``); with ``split=True`` the linear layers defer their
weight gradients to W actions (:func:`ds_autoplan.runtime.megatron.split_backward_spec`).
A config with ``num_moe_experts`` (:func:`moe_config`) gets Megatron's MoE layer in every
layer: top-k router, alltoall token dispatcher, per-expert MLPs (``SequentialMLP``: grouped
GEMM needs Transformer Engine / CUDA); its expert linear layers are split like the others.
"""
from __future__ import annotations

VOCAB, HIDDEN, HEADS, SEQ, MBS = 32, 16, 2, 8, 2


def base_config(**over):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=2 * HIDDEN,
              use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
              pipeline_dtype=torch.float32, params_dtype=torch.float32,
              deallocate_pipeline_outputs=True, bias_activation_fusion=False,
              bias_dropout_fusion=False, masked_softmax_fusion=False,
              gradient_accumulation_fusion=False, persist_layer_norm=False)
    kw.update(over)
    return TransformerConfig(**kw)


class SPTorchNorm:
    """torch ``LayerNorm`` for sequence parallelism on CPU: Megatron's local ``WrappedTorchNorm``
    refuses SP and its ``FusedLayerNorm`` needs apex.  A norm is per token, so SP only needs
    what ``FusedLayerNorm`` does: mark the parameters ``sequence_parallel`` (their gradients
    are summed over the tp group, as ``finalize_model_grads`` does)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_):
        import torch
        norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


EXPERTS, TOPK = 4, 2


def moe_config(num_experts: int = EXPERTS, topk: int = TOPK, aux_loss: float = 0.0) -> dict:
    """TransformerConfig keywords of the tiny MoE model: ``num_experts`` experts of FFN size
    2·hidden, top-``topk`` routing, Megatron's alltoall dispatcher (over the plan's ``ep``
    ranks: ``expert_model_parallel_size`` comes with ``setup.config_overrides``), dropless
    (no capacity factor) and no auxiliary load-balancing loss, so every token's output depends
    on its own routing only and a pipelined/expert-parallel run equals one process;
    ``aux_loss`` > 0 adds Megatron's load-balancing loss (``aux_loss``: statistics of each
    micro-batch, the same micro-batches in both runs).  No linear
    biases (as Mixtral/Qwen-MoE): megatron-core 0.16.1's expert MLP adds its fc2 bias in place
    on the tp-reduce output, which autograd refuses for Megatron's local linear layers."""
    return dict(add_bias_linear=False, num_moe_experts=num_experts, moe_router_topk=topk, moe_ffn_hidden_size=2 * HIDDEN,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                moe_router_load_balancing_type="aux_loss" if aux_loss else "none",
                moe_aux_loss_coeff=aux_loss)


def layer_spec(split: bool = True, sp: bool = False, num_experts: int | None = None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ..runtime.megatron.splitgrad import split_backward_spec
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    if sp:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SPTorchNorm
    return split_backward_spec(spec) if split else spec


def gpt(config, pre_process=True, post_process=True, vp_stage=None, split=True, seed=1234,
        max_seq=SEQ, pg_collection=None):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    from ..runtime.megatron.shim import cpu_shim
    torch.manual_seed(seed)
    spec = layer_spec(split, config.sequence_parallel, config.num_moe_experts)
    if config.sequence_parallel:     # the block's final norm, too
        spec = TransformerBlockSubmodules([spec] * get_num_layers_to_build(config, vp_stage),
                                          layer_norm=SPTorchNorm)
    with cpu_shim():    # the MoE dispatcher asks for a CUDA stream at construction
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                        max_sequence_length=max_seq, pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=False,
                        vp_stage=vp_stage, pg_collection=pg_collection)


def build_reference(num_layers: int, split=True, max_seq=SEQ, tp=1, sp=False):
    """The whole model on this pipeline rank (pp=1 config), deterministic weights; with
    ``tp`` > 1 it is tensor-parallel on this rank's tp group (sharded like the chunks)."""
    cfg = dict(tensor_model_parallel_size=tp, sequence_parallel=sp) if tp > 1 else {}
    return gpt(base_config(num_layers=num_layers, **cfg), split=split, max_seq=max_seq)


def build_chunks(setup, split=True, max_seq=SEQ, **cfg_over):
    """This rank's model chunks per :func:`ds_autoplan.runtime.megatron.initialize`'s setup."""
    base = base_config(**{**setup.config_overrides, **cfg_over})
    return [gpt(setup.chunk_config(base, c), setup.pre_process(c), setup.post_process(c),
                setup.vp_stage(c), split=split, max_seq=max_seq) for c in range(setup.num_chunks)]


def global_name(name: str, offset: int) -> str:
    """A chunk's parameter name in the whole model (its layers start at ``offset``)."""
    if name.startswith("decoder.layers."):
        rest = name[len("decoder.layers."):]
        i, tail = rest.split(".", 1)
        return f"decoder.layers.{int(i) + offset}.{tail}"
    return name


def stage_offset(layers_per_stage, stage) -> int:
    return sum(layers_per_stage[:stage])


def copy_weights(ref, chunks, setup, layers_per_stage):
    """Copy the whole model's weights into this rank's chunks."""
    import torch
    rp = dict(ref.named_parameters())
    with torch.no_grad():
        for c, m in enumerate(chunks):
            off = stage_offset(layers_per_stage, setup.stages[c])
            for n, p in m.named_parameters():
                p.copy_(rp[global_name(n, off)])


def data_iter(seed=7):
    """Endless random (tokens, next tokens) micro-batches of shape [MBS, SEQ]."""
    import torch
    g = torch.Generator().manual_seed(seed)
    while True:
        tok = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        yield tok, torch.roll(tok, -1, 1)


def _loss_func(out):
    loss = out.float().mean()
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_it, model):
    """Megatron's ``forward_step_func`` for :func:`gpt` on :func:`data_iter`."""
    import torch
    tok, lab = next(data_it) if data_it is not None else (None, None)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    # explicit causal mask: Megatron's default one is built on device "cuda"
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return model(tok, pos, mask, labels=lab), _loss_func
