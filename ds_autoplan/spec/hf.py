"""Hugging Face config.json (no weights) -> our model fields (spec/model.py FIELDS).

Decoder families are read by name; a family not listed here is refused by name, never
planned as something else.  A published config.json omits values equal to its transformers
config class's defaults (Gemma-3's nested ``text_config`` lists only a few keys), so each
family carries the defaults of the keys we read, from transformers'
``models/<family>/configuration_<family>.py``.
"""
from __future__ import annotations

from pathlib import Path

from . import SpecError

DEFAULT_TRAIN_SEQ = 4096   # tokens; LLaMA-2's pretraining length (Touvron et al. 2023 §2.2)

# decoder families read as arch "llama" (pre-norm, RoPE, gated MLP): defaults of the keys we
# read that their config classes set (tie_word_embeddings: PretrainedConfig's True unless set)
_GEMMA = {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}
_DECODERS = {
    "llama": {"tie_word_embeddings": False}, "mistral": {"tie_word_embeddings": False},
    "mixtral": {"tie_word_embeddings": False}, "qwen2": {"tie_word_embeddings": False},
    "qwen2_moe": {"tie_word_embeddings": False, "decoder_sparse_step": 1},
    "qwen3": {"tie_word_embeddings": False, "head_dim": 128},
    "qwen3_moe": {"tie_word_embeddings": False, "head_dim": 128, "decoder_sparse_step": 1},
    "gemma": _GEMMA,
    "gemma2": {**_GEMMA, "sliding_window": 4096},
    # Gemma3TextConfig (transformers 4.50): the 4B/12B checkpoints' text_config omits these
    "gemma3_text": {**_GEMMA, "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "sliding_window": 4096, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
                    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "phi3": {"tie_word_embeddings": False},
    "deepseek_v2": {"tie_word_embeddings": False, "first_k_dense_replace": 0, "moe_layer_freq": 1},
    "deepseek_v3": {"tie_word_embeddings": False, "first_k_dense_replace": 0, "moe_layer_freq": 1},
    "gpt_oss": {"tie_word_embeddings": False, "attention_bias": True, "head_dim": 64},
}
_OTHER = {**{m: "gpt" for m in ("gpt2", "gpt_neox", "gptj", "opt", "gpt_neo", "bloom", "falcon")},
          **{m: "bert" for m in ("bert", "roberta", "deberta", "electra")},
          **{m: "t5" for m in ("t5", "mt5", "bart")}, **{m: "vit" for m in ("vit", "deit", "beit")}}
_UNTIED_OTHER = {"gpt_neox", "gptj"}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_QK_NORM = {"qwen3", "qwen3_moe", "gemma3_text"}
_SANDWICH = {"gemma2", "gemma3_text"}


def _family(d: dict, src: str) -> tuple[str, dict]:
    """(model_type, the config with its family's defaults filled in)."""
    mt = str(d.get("model_type", "")).lower()
    if mt == "gemma3":                   # Gemma3ForConditionalGeneration: the text model plans
        if not isinstance(d.get("text_config"), dict):
            raise SpecError(f"{src}: gemma3 config without a text_config mapping")
        d = {**d["text_config"], "model_type": "gemma3_text"}
        mt = "gemma3_text"
    if mt in _DECODERS:
        return mt, {**_DECODERS[mt], **{k: v for k, v in d.items() if v is not None}}
    if mt in _OTHER:
        return mt, d
    known = sorted(set(_DECODERS) | set(_OTHER) | {"gemma3"})
    raise SpecError(f"{src}: unsupported Hugging Face model_type {mt!r}; supported: {', '.join(known)}")


def _activation(d: dict, mt: str, src: str) -> str:
    act = str(d.get("hidden_activation") or d.get("hidden_act") or "silu").lower()
    if mt == "gemma":                    # Gemma's modeling code runs GeLU-tanh whatever hidden_act says
        act = "gelu_pytorch_tanh"
    if mt == "gpt_oss":                  # GptOssExperts: (up + 1) * gate * sigmoid(1.702 gate), clamped
        return "quick_geglu"
    if act in ("silu", "swish"):
        return "swiglu"
    if act.startswith("gelu"):
        return "geglu"
    raise SpecError(f"{src}: {mt} with hidden activation {act!r} is not supported (silu or gelu gates)")


def _moe(d: dict, mt: str, L: int, src: str) -> dict:
    """Experts, top-k, expert and shared widths and which layers have experts (each family's
    own rule from its modeling code)."""
    n = next((int(d[k]) for k in _MOE_KEYS if isinstance(d.get(k), int) and d[k] > 1), 0)
    if not n:
        return {}
    k = int(d.get("num_experts_per_tok") or 2)
    if mt == "mixtral":
        return {"num_experts": n, "moe_topk": k}
    if mt == "gpt_oss":                  # GptOssMLP: router and experts with biases
        return {"num_experts": n, "moe_topk": k, "moe_router_bias": True, "moe_expert_bias": True}
    if mt in ("qwen2_moe", "qwen3_moe"):
        # Qwen2MoeDecoderLayer: experts where layer not in mlp_only_layers and (i+1) % step == 0
        step, only = int(d.get("decoder_sparse_step") or 1), set(d.get("mlp_only_layers") or [])
        pattern = [int(i not in only and (i + 1) % step == 0) for i in range(L)]
        shared = int(d.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0
        out = {"moe_ffn": d.get("moe_intermediate_size"), "moe_shared_ffn": shared or None,
               "moe_shared_gate": bool(shared)}
        # Qwen2MoeSparseMoeBlock: softmax over all experts, top-k, renormalised only with
        # norm_topk_prob (its config default False)
    elif mt in ("deepseek_v2", "deepseek_v3"):
        # DeepseekV2DecoderLayer: experts where i >= first_k_dense_replace and i % moe_layer_freq == 0
        first, freq = int(d.get("first_k_dense_replace") or 0), int(d.get("moe_layer_freq") or 1)
        pattern = [int(i >= first and i % freq == 0) for i in range(L)]
        fe = d.get("moe_intermediate_size")
        out = {"moe_ffn": fe, "moe_shared_ffn": int(d.get("n_shared_experts") or 0) * int(fe or 0) or None,
               "moe_router_bias": d.get("topk_method") == "noaux_tc",   # V3's e_score_correction_bias
               "moe_score": d.get("scoring_func"), "moe_scale": d.get("routed_scaling_factor")}
        if d.get("topk_method") in ("group_limited_greedy", "noaux_tc") and (d.get("n_group") or 1) > 1:
            out.update(moe_groups=d.get("n_group"), moe_group_topk=d.get("topk_group"))
    else:
        raise SpecError(f"{src}: {mt} is a mixture-of-experts model ({n} experts) but not a supported "
                        "MoE family (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3, gpt_oss)")
    # a softmax router that keeps the top-k probabilities of the softmax over all experts
    # (not renormalised) is Megatron's --moe-router-pre-softmax; Mixtral's (softmax of the
    # top-k logits, the same as renormalising) is Megatron's default
    if str(d.get("scoring_func") or "softmax") == "softmax" and not d.get("norm_topk_prob"):
        out["moe_pre_softmax"] = True
    out.update(num_experts=n, moe_topk=k)
    if not all(pattern):
        out["moe_pattern"] = pattern
    return out


def _window(d: dict, mt: str, L: int, src: str) -> dict:
    """Sliding-window attention: all layers (Mistral, Phi-3) or local layers with a global one
    every ``global_every`` (Gemma-2: odd layers global; Gemma-3: every 6th)."""
    if mt in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if d.get("use_sliding_window"):
            raise SpecError(f"{src}: {mt} with use_sliding_window (windows above max_window_layers) "
                            "is not supported")
        return {}
    w = d.get("sliding_window")
    if not w or mt in ("llama", "deepseek_v2", "deepseek_v3", "gemma"):
        return {}
    every = {"gemma2": 2, "gemma3_text": int(d.get("sliding_window_pattern") or 6), "gpt_oss": 2}.get(mt, 0)
    types = d.get("layer_types")
    if isinstance(types, list) and len(types) == L:
        glob = [i for i, t in enumerate(types) if t == "full_attention"]
        every = glob[0] + 1 if glob else 0
        if [i for i in range(L) if every and (i + 1) % every == 0] != glob:
            raise SpecError(f"{src}: layer_types is not a periodic local/global pattern")
    return {"sliding_window": w, "global_every": every or None}


def _rope(d: dict, mt: str, src: str) -> dict:
    rs = d.get("rope_scaling")
    if not isinstance(rs, dict) or not rs:
        return {}
    kind = str(rs.get("rope_type", rs.get("type", "default"))).lower()
    if kind == "default":
        return {}
    factor = rs.get("factor")
    if kind in ("llama3", "linear", "yarn", "dynamic") and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
        raise SpecError(f"{src}: rope_scaling of type {kind} needs a positive 'factor', got {factor!r}")
    clean = {k: v for k, v in rs.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    return {"rope_scaling_type": kind, "rope_scaling": clean,
            "rope_scaling_factor": factor if kind == "llama3" else None}


def _seq(d: dict, g) -> tuple[int, int, str]:
    """(training sequence length, context length, note): the model's context (the pre-scaling
    one under RoPE scaling) capped at :data:`DEFAULT_TRAIN_SEQ`."""
    rs = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else {}
    ctx = int(g("max_position_embeddings", "n_positions", "n_ctx", default=512))
    train = int(rs.get("original_max_position_embeddings") or ctx)
    seq = min(train, DEFAULT_TRAIN_SEQ)
    return seq, ctx, (f"sequence length {seq} (default: the model's context {train} capped at "
                      f"{DEFAULT_TRAIN_SEQ}; --seq to change)")


def _decoder(d: dict, mt: str, g, src: str) -> dict:
    """The fields of a LLaMA-style decoder family."""
    L = g("num_hidden_layers")
    if isinstance(L, float) and L.is_integer():
        L = int(L)
    if not isinstance(L, int) or isinstance(L, bool):   # build_model refuses it in one line
        return {"num_layers": L}
    # attention_bias: Q, K, V and output projections (LlamaAttention and its kin); Qwen2's
    # Q, K, V always, its output never
    qkv = mt in ("qwen2", "qwen2_moe") or bool(d.get("attention_bias"))
    o_bias = bool(d.get("attention_bias")) and mt not in ("qwen2", "qwen2_moe") and not d.get("mlp_bias")
    dense_ffn = g("intermediate_size")
    moe = _moe(d, mt, L, src)
    if mt in ("mixtral", "gpt_oss"):
        moe["moe_ffn"] = dense_ffn
    out = {"num_layers": L, "kv_heads": g("num_key_value_heads"), "ffn": dense_ffn,
           "head_dim": g("head_dim"), "activation": _activation(d, mt, src),
           "qk_norm": mt in _QK_NORM or None, "sandwich_norms": mt in _SANDWICH or None,
           "linear_bias": bool(d.get("attention_bias") and d.get("mlp_bias")), "qkv_bias": qkv,
           "attn_out_bias": o_bias or None, "attn_sinks": mt == "gpt_oss" or None,
           "rope_base": g("rope_theta", "rotary_emb_base"),
           "rotary_percent": d.get("partial_rotary_factor"),
           **moe, **_window(d, mt, L, src), **_rope(d, mt, src)}
    if mt.startswith("deepseek"):
        out.update({k: d.get(k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                          "qk_rope_head_dim", "v_head_dim")})
        out["head_dim"] = None
    return out


# our size fields -> the config.json keys that give them, in the order they are looked for
_SIZE_KEYS = {"num_layers": ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers"),
              "hidden": ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"),
              "heads": ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads"),
              "kv_heads": ("num_key_value_heads",),
              "ffn": ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim"),
              "vocab": ("vocab_size",)}


def model_name(d: dict, src: str, model_type: str) -> str:
    """What a config.json's model is called: the Hub name it was saved from
    (``_name_or_path``: ``meta-llama/Llama-2-7b-hf`` gives ``Llama-2-7b-hf``), else its folder
    (configs/hf/Qwen3-8B/config.json: ``Qwen3-8B``), else its model_type."""
    hub = str(d.get("_name_or_path") or "").rstrip("/")
    if hub:
        return hub.rsplit("/", 1)[-1]
    return Path(src).resolve().parent.name or model_type


def from_hf_config(d: dict, src: str) -> dict:
    """Map a Hugging Face config.json (no weights) to our preset fields: sizes, head size,
    gates, tied embeddings, biases, norms, RoPE base and scaling, sliding windows, experts,
    multi-latent attention, norm epsilon, and a training sequence length (:func:`_seq`;
    ``--seq`` overrides it)."""
    mt, d = _family(d, src)
    g = lambda *ks, default=None: next((d[k] for k in ks if d.get(k) is not None), default)  # noqa: E731
    arch = "llama" if mt in _DECODERS else _OTHER[mt]
    seq, ctx, note = _seq(d, g)
    sizes = {f: g(*keys) for f, keys in _SIZE_KEYS.items()}
    # refusals name the keys of the user's file: the one read, else the first one looked for
    keys = {f: next((k for k in ks if d.get(k) is not None), ks[0]) for f, ks in _SIZE_KEYS.items()}
    out = {"name": model_name(d, src, mt), "arch": arch, "family": mt, **sizes,
           "seq_len": seq, "max_positions": ctx, "seq_note": note, "source_keys": keys,
           "tie_embeddings": bool(d.get("tie_word_embeddings", mt not in _UNTIED_OTHER)),
           "norm_eps": g("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "layernorm_epsilon")}
    if arch == "llama":
        out.update(_decoder(d, mt, g, src))
    else:
        if any(isinstance(d.get(k), int) and d[k] > 1 for k in _MOE_KEYS):
            raise SpecError(f"{src}: {mt} is a mixture-of-experts model but not a supported MoE family "
                            "(mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3)")
        out.update({"dec_layers": g("num_decoder_layers", "decoder_layers"),
                    "image_size": g("image_size"), "patch_size": g("patch_size"),
                    "num_classes": len(d["id2label"]) if isinstance(d.get("id2label"), dict) else None,
                    "linear_bias": bool(d.get("bias", True)), "qkv_bias": False})
    if arch == "vit":
        for k in ("seq_len", "max_positions", "seq_note"):
            out.pop(k)
    return {k: v for k, v in out.items() if v is not None}
