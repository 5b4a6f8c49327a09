"""An Accelerate + DeepSpeed training loop, unchanged under ``deepspeed --autoplan``
(docs/huggingface.md): a tiny Llama from a config (random weights, nothing downloaded) on random
tokens, the DeepSpeed plugin reading ``--deepspeed`` (default ``ds_config_accelerate.json`` beside this
file), the loader batching ``--batch_size`` examples.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/hf_accelerate.py
    DS_ACCELERATOR=cpu deepspeed --autoplan --num_gpus 2 examples/hf_accelerate.py   # planned

Rank 0 prints ``LOSS step value`` (the mean loss of each optimizer step's micro-batches).
"""
import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from torch.utils.data import DataLoader

from ds_autoplan.runtime.ending import finish, one_line_errors
from ds_autoplan.models.tiny_hf import tiny_llama, token_dataset

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed", default=os.path.join(HERE, "ds_config_accelerate.json"))
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lora_r", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1)       # DeepSpeed's launcher passes it
    args = p.parse_args()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=args.deepspeed,
                                                       gradient_accumulation_steps=args.gradient_accumulation_steps))
    model = tiny_llama(lora_r=args.lora_r)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    loader = DataLoader(token_dataset(), batch_size=args.batch_size, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    model.train()
    step, losses = 0, []
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        if acc.sync_gradients:
            step += 1
            if acc.is_main_process:
                print(f"LOSS {step} {sum(losses) / len(losses)!r}", flush=True)
            losses = []
            if step == args.steps:
                break
    # Every rank past its last collective before the group goes (end_training destroys it), and
    # the rank ended without the interpreter's finalization: gloo's worker threads release a
    # collective's tensors after the caller's wait returns, and one still doing so as the
    # interpreter finalizes aborts the process ("terminate called without an active exception",
    # seen on rank 1 of this script, which exits while rank 0 prints; ds_autoplan/runtime/ending.py)
    acc.wait_for_everyone()
    acc.end_training()
    finish()


if __name__ == "__main__":
    with one_line_errors("hf_accelerate.py"):    # a bad DS_AUTOPLAN_* value: one line, exit 2
        main()
