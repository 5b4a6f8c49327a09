"""Hugging Face config.json files of public models (values copied from their hub configs, no
weights): parameter counts within 0.5% of the published counts, tied embeddings, biases, RoPE,
norm epsilon and Mixtral's experts read and carried into Megatron-LM's flags, a training
sequence length by default, unsupported MoE families refused."""
import json
import subprocess
import sys

import pytest

from ds_autoplan.emit.megatron import megatron_args
from ds_autoplan.plan import Plan
from ds_autoplan.spec import SpecError
from ds_autoplan.spec.model import load_model

# name: (config.json, published parameter count: the model cards / safetensors totals)
HF = {
 "Llama-2-7B": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
   "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "vocab_size": 32000}, 6_738_415_616),
 "Mistral-7B": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
   "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000}, 7_241_732_096),
 "Qwen2-7B": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
   "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
   "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False, "vocab_size": 152064}, 7_615_616_512),
 "gpt2-xl": ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 1600, "n_head": 25, "n_layer": 48,
   "n_ctx": 1024, "n_positions": 1024, "layer_norm_epsilon": 1e-05, "vocab_size": 50257}, 1_557_611_200),
 "Llama-3.2-1B": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
   "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
   "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
   "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "tie_word_embeddings": True, "vocab_size": 128256}, 1_235_814_400),
 "Llama-3-70B": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
   "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "max_position_embeddings": 8192,
   "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256}, 70_553_706_496),
 "Mixtral-8x7B": ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
   "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
   "tie_word_embeddings": False, "vocab_size": 32000}, 46_702_792_704),
}


def _write(tmp_path, name, cfg):
    p = tmp_path / name / "config.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cfg))
    return str(p)


@pytest.mark.parametrize("name", list(HF))
def test_parameter_count_matches_published(tmp_path, name):
    cfg, published = HF[name]
    m = load_model(_write(tmp_path, name, cfg))
    assert abs(m.total_params / published - 1) < 0.005, (m.total_params, published)


def _flags(name, tmp_path, **plan):
    m = load_model(_write(tmp_path, name, HF[name][0]))
    return " ".join(megatron_args(Plan(**{"precision": "bf16", **plan}), m)) + " ", m


def test_megatron_flags_carry_the_architecture(tmp_path):
    qwen, m = _flags("Qwen2-7B", tmp_path)
    assert "--disable-bias-linear --add-qkv-bias " in qwen and "--rotary-base 1000000 " in qwen
    assert "--norm-epsilon 1e-06 " in qwen and "--untie-embeddings-and-output-weights " in qwen
    assert "--seq-length 4096 " in qwen and m.config["max_positions"] == 131072
    gpt2, m = _flags("gpt2-xl", tmp_path)
    assert "--untie" not in gpt2 and "--disable-bias-linear" not in gpt2 and "rope" not in gpt2
    assert "--seq-length 1024 " in gpt2 and "--norm-epsilon 1e-05 " in gpt2
    small, _ = _flags("Llama-3.2-1B", tmp_path)
    assert "--untie" not in small and "--add-qkv-bias" not in small
    assert "--rotary-base 500000 --use-rope-scaling --rope-scaling-factor 32.0 " in small
    llama, _ = _flags("Llama-2-7B", tmp_path)
    assert "--untie-embeddings-and-output-weights --disable-bias-linear --rotary-base 10000 " in llama


def test_mixtral_is_planned_with_its_experts(tmp_path):
    mix = load_model(_write(tmp_path, "Mixtral-8x7B", HF["Mixtral-8x7B"][0]))
    dense = load_model(dict(HF["Mixtral-8x7B"][0], num_local_experts=1))
    blk, dblk = mix.layers[0], dense.layers[0]
    mlp = 3 * 4096 * 14336
    assert blk.params - dblk.params == pytest.approx(7 * mlp + 8 * 4096)      # all 8 experts
    # compute: two experts per token (+ the router), not eight
    assert blk.flops - dblk.flops == pytest.approx(2 * 4096 * (mlp + 8 * 4096))
    flags, _ = _flags("Mixtral-8x7B", tmp_path)
    assert "--num-experts 8 --moe-router-topk 2 " in flags


def test_moe_outside_the_moe_families_is_refused(tmp_path):
    """A dense family's config with experts is not planned dense (tests/test_hf_families.py
    covers the MoE families themselves)."""
    cfg = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100, "num_experts": 8}
    with pytest.raises(SpecError, match="mixture-of-experts.*not a supported MoE family"):
        load_model(_write(tmp_path, "moe", cfg))


def test_plan_prints_the_sequence_length(tmp_path):
    path = _write(tmp_path, "Qwen2-7B", HF["Qwen2-7B"][0])
    run = lambda *a: subprocess.run([sys.executable, "-m", "ds_autoplan", "plan", "--model", path,  # noqa: E731
                                     "--cluster", "2x8xa100-ib200", "--global-batch", "256",
                                     "--no-wide", "--quiet", *a], capture_output=True, text=True)
    r = run()
    assert r.returncode == 0, r.stderr
    assert "sequence length 4096 (default: the model's context 131072 capped at 4096; --seq to change)" in r.stdout
    r = run("--seq", "2048")
    assert r.returncode == 0 and "sequence length 2048 (--seq)" in r.stdout
