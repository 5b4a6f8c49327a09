"""Run Megatron-LM's own argument parser and validator (megatron/training/arguments.py of a
COPY of the client in ../shared/clients) on flag lists read as JSON from stdin; print one
JSON line per list with the sizes Megatron derived, or its error.

    WORLD_SIZE=24 python megatron_argcheck.py CLIENT_COPY < lists.json

With ARGCHECK_CONFIG=1 it also builds megatron-core's TransformerConfig (MLATransformerConfig
for --multi-latent-attention) from the arguments, as pretrain_gpt.py does, so the config
class's own checks run.

Test-side shims only (the client is not modified): megatron/training/__init__ imports the
training loop, so the package is entered without it; the device architecture query and
CUDA_DEVICE_MAX_CONNECTIONS are what a CPU test machine lacks."""
import json
import os
import sys
import types

client = sys.argv[1]
sys.path.insert(0, client)
os.environ.setdefault("RANK", "0")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
import megatron  # noqa: E402,F401

pkg = types.ModuleType("megatron.training")
pkg.__path__ = [os.path.join(client, "megatron", "training")]
sys.modules["megatron.training"] = pkg
from megatron.training import global_vars  # noqa: E402

for k in dir(global_vars):
    if k.startswith("get_"):
        setattr(pkg, k, getattr(global_vars, k))
from megatron.training import arguments  # noqa: E402

arguments.get_device_arch_version = lambda: 9          # no device to query on CPU
# what the model flags set, as Megatron parsed them (JSON-safe values)
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "ffn_hidden_size", "swiglu", "qk_layernorm", "window_size", "window_attn_skip_freq",
              "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
              "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq",
              "moe_router_enable_expert_bias", "moe_router_pre_softmax", "moe_router_score_function",
              "multi_latent_attention", "q_lora_rank",
              "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
              "rotary_scaling_factor", "mscale", "mscale_all_dim", "rotary_percent")
for flags in json.load(sys.stdin):
    sys.argv = ["pretrain_gpt.py"] + flags
    try:
        a = arguments.validate_args(arguments.parse_args())
        out = {"ok": True, "dp": a.data_parallel_size, "tp": a.tensor_model_parallel_size,
               "pp": a.pipeline_model_parallel_size, "mbs": a.micro_batch_size,
               "gbs": a.global_batch_size, "vpp": a.virtual_pipeline_model_parallel_size,
               "cp": a.context_parallel_size, "cp_comm": a.cp_comm_type,
               "ep": a.expert_model_parallel_size, "etp": a.expert_tensor_parallel_size,
               "experts": a.num_experts, "dispatcher": a.moe_token_dispatcher_type,
               "model": {k: getattr(a, k, None) for k in MODEL_KEYS}}
        if os.environ.get("ARGCHECK_CONFIG"):   # megatron-core's own checks of the model config
            cfg = arguments.core_transformer_config_from_args(a)
            out["config"] = type(cfg).__name__
            out["gated_linear_unit"] = cfg.gated_linear_unit
            out["activation"] = getattr(cfg.activation_func, "__name__", str(cfg.activation_func))
    except (AssertionError, SystemExit, ValueError) as e:
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print("ARGCHECK " + json.dumps(out), flush=True)
