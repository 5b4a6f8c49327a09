"""Emitters: a Plan as DeepSpeed and Megatron-core/Megatron-LM configuration."""
