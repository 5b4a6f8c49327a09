"""A tiny Hugging Face Llama (random weights, from a config: nothing downloaded) and a token
data set, for the Trainer / Accelerate examples and tests (docs/huggingface.md)."""
from __future__ import annotations

import torch

VOCAB, SEQ = 128, 16


def tiny_llama(layers: int = 2, seed: int = 0, lora_r: int = 0):
    """``LlamaForCausalLM`` with hidden 32, 4 heads (2 key/value groups), seeded; ``lora_r`` > 0:
    wrapped by peft with LoRA adapters of that rank on q_proj and v_proj."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64))
    if lora_r:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r,
                                                 target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return model


def token_dataset(n: int = 64, seq: int = SEQ, seed: int = 1) -> list[dict]:
    """``n`` causal-LM examples of ``seq`` random tokens (labels = inputs)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]
