"""ds_autoplan: plans and schedules large-model training for DeepSpeed and Megatron-core.

Planning and simulation import neither torch nor DeepSpeed; ``initialize`` (DeepSpeed's
engine running any ds_autoplan schedule) loads them on first use.
"""
__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """``ds_autoplan.initialize(model_or_layers, plan=..., **deepspeed.initialize kwargs)``
    returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` as
    ``deepspeed.initialize`` does, with the plan's partition and schedule."""
    from .runtime.deepspeed.api import initialize as _initialize
    return _initialize(*args, **kwargs)
