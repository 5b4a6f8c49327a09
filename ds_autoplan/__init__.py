"""ds_autoplan: plans and schedules large-model training for DeepSpeed and Megatron-core."""
__version__ = "0.1.0"
