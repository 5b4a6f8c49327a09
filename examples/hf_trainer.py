"""A Hugging Face ``Trainer`` + DeepSpeed script, unchanged under ``deepspeed --autoplan``
(docs/huggingface.md): a tiny Llama from a config (random weights, nothing downloaded) on random
tokens.  Flags are ``TrainingArguments``' own (``HfArgumentParser``), plus ``--lora_r``.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/hf_trainer.py
    DS_ACCELERATOR=cpu deepspeed --autoplan --num_gpus 2 examples/hf_trainer.py   # planned
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/hf_trainer.py \\
        $(cat ds_autoplan_out/training_args.flags) --deepspeed ds_autoplan_out/ds_config.autoplan.json

Rank 0 prints ``LOSS step value`` for every optimizer step.
"""
import os
import sys
from dataclasses import dataclass

from transformers import HfArgumentParser, Trainer, TrainingArguments

from ds_autoplan.runtime.ending import finish, one_line_errors
from ds_autoplan.models.tiny_hf import tiny_llama, token_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = ["--output_dir", os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf_trainer_out"),
            "--max_steps", "3", "--logging_steps", "1", "--learning_rate", "1e-3",
            "--lr_scheduler_type", "constant", "--per_device_train_batch_size", "1",
            "--gradient_accumulation_steps", "4", "--report_to", "none", "--save_strategy", "no",
            "--seed", "0", "--deepspeed", os.path.join(HERE, "ds_config_hf.json")]


@dataclass
class Extra:
    lora_r: int = 0          # > 0: LoRA adapters (peft) on q_proj and v_proj, the rest frozen


def main():
    args, extra = HfArgumentParser((TrainingArguments, Extra)).parse_args_into_dataclasses(
        DEFAULTS + sys.argv[1:])
    model = tiny_llama(lora_r=extra.lora_r)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.train()
    if trainer.is_world_process_zero():
        for h in trainer.state.log_history:
            if "loss" in h:
                print(f"LOSS {h['step']} {h['loss']!r}", flush=True)
    finish()        # every rank done: the group torn down, the rank ended (ds_autoplan/runtime/ending.py)


if __name__ == "__main__":
    with one_line_errors("hf_trainer.py"):    # a bad DS_AUTOPLAN_* value: one line, exit 2
        main()
