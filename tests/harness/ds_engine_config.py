"""Worker (every rank): ``ds_autoplan.initialize`` a tiny GPT from ``PLAN.json`` and report the
DeepSpeed config the engine runs (``engine._config._param_dict``, what DeepSpeed parsed)."""
import sys

import torch

from ds_autoplan.models.tiny_gpt import GPTConfig, TinyGPT, gpt_loss
from ds_autoplan.plan import Plan
from ds_autoplan.runtime.deepspeed import initialize
from ds_autoplan.runtime.deepspeed.dist import init_distributed
from ds_autoplan.runtime.launch import report_runs


def main(path: str) -> None:
    init_distributed()
    plan = Plan.load(path)
    torch.manual_seed(0)
    layers = TinyGPT(GPTConfig(vocab_size=32, hidden=16, num_layers=sum(plan.layers_per_stage) - 2,
                               num_heads=2, seq_len=8)).layers()
    engine, *_ = initialize(layers, plan, loss_fn=gpt_loss,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    report_runs([lambda: {"rank": torch.distributed.get_rank(),
                          "config": engine._config._param_dict,
                          "ds_interval": engine._config.pipeline["activation_checkpoint_interval"],
                          "recomputed_layers": dict(engine.module.recompute_layers)}])


if __name__ == "__main__":
    main(sys.argv[1])
