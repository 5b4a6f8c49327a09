"""Plan -> what a Hugging Face ``Trainer`` takes: ``TrainingArguments`` values and a
``ds_config.json`` for ``TrainingArguments(deepspeed=...)`` (docs/huggingface.md).

The config leaves to the Trainer what it fills from its arguments (``auto``: batch size,
accumulation, clipping, precision; the optimizer and scheduler it builds itself) and sets what
the plan decides and the arguments cannot say: the ZeRO stage, its offloading and DeepSpeed's
AutoTP degree (``tensor_parallel.autotp_size``; the Trainer shards the model with
``deepspeed.tp_model_init`` and counts its data-parallel world as world / autotp_size).  A plan
with a pipeline, context or expert parallelism, or Megatron's sequence parallelism has no
Trainer form (the Trainer runs DeepSpeed's engine without them)."""
from __future__ import annotations

from ..plan import Plan


class NotATrainerPlan(ValueError):
    """The plan uses what a Trainer cannot run (a pipeline, context or expert parallelism,
    sequence parallelism)."""


def _check(plan: Plan) -> None:
    from ..search.engine_space import engine_runs
    if not engine_runs(plan):
        raise NotATrainerPlan(f"the plan uses pp={plan.pp} tp={plan.tp} cp={plan.cp} ep={plan.ep}"
                              f"{' with sequence parallelism' if plan.parallel.sequence_parallel else ''}; "
                              "a Trainer runs DeepSpeed's engine with data parallelism, ZeRO and "
                              "AutoTP only (plan with --emit hf, which searches that space)")


def training_args(plan: Plan) -> dict:
    """The ``TrainingArguments`` values the plan decides."""
    _check(plan)
    return {"per_device_train_batch_size": plan.micro_batch_size,
            "gradient_accumulation_steps": plan.num_microbatches,
            "gradient_checkpointing": any(x > 0 for x in plan.recompute_per_stage),
            "bf16": plan.precision == "bf16", "fp16": plan.precision == "fp16"}


def hf_ds_config(plan: Plan) -> dict:
    """A ``ds_config.json`` for ``TrainingArguments(deepspeed=...)`` running the plan."""
    _check(plan)
    from .deepspeed import offload_section
    zero = {"stage": plan.zero_stage}
    if plan.zero_stage >= 1:
        zero.update({"overlap_comm": True, "contiguous_gradients": True})
    if plan.parallel.offload.any:
        zero.update(offload_section(plan))
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "zero_optimization": zero, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    if plan.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    return cfg


def args_line(plan: Plan, config_path: str = "ds_config.json") -> str:
    """The matching command-line flags of a script parsing ``TrainingArguments``
    (``HfArgumentParser``)."""
    v = training_args(plan)
    flags = [f"--per_device_train_batch_size {v['per_device_train_batch_size']}",
             f"--gradient_accumulation_steps {v['gradient_accumulation_steps']}"]
    flags += [f"--{k}" for k in ("gradient_checkpointing", "bf16", "fp16") if v[k]]
    return " ".join(flags + [f"--deepspeed {config_path}"])
