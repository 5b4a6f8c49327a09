"""One process (a 1-rank gloo group): a peft LoRA tiny Llama trained one step in DeepSpeed's
engine for each precision given; prints, per precision, the optimizer-state and gradient bytes
the engine holds (measured tensor by tensor) and the cost model's prediction for the module
(tests/test_hf_clients.py).  ``python lora_bytes.py fp32 bf16``."""
import json
import os
import sys

import torch


def grad_bytes(engine) -> int:
    """Gradient bytes the module's parameters hold (after the backward, before the step)."""
    return sum(p.grad.numel() * p.grad.element_size() for p in engine.module.parameters()
               if p.grad is not None)


def state_bytes(engine) -> int:
    """Optimizer-state bytes after the step: per-element Adam moments and any fp32 master
    copies the engine's optimizer keeps (FP16_UnfusedOptimizer's fp32_groups for bf16)."""
    opt = engine.optimizer
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0)
    masters = getattr(opt, "fp32_groups", None) or []
    return state + sum(p.numel() * p.element_size() for g in masters for p in g)


def main(precisions):
    import deepspeed
    from ds_autoplan.clients.module_plan import model_spec, trainable_of
    from ds_autoplan.cost.model import CostModel, Strategy
    from ds_autoplan.models.tiny_hf import tiny_llama, token_dataset
    from ds_autoplan.spec import load_cluster
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29731"),
                      RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="gloo")
    batch = {k: torch.stack([x[k] for x in token_dataset(2)]) for k in ("input_ids", "labels")}
    for precision in precisions:
        model = tiny_llama(lora_r=8)
        cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
               "zero_optimization": {"stage": 0}}
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        engine.backward(engine(**batch).loss)
        grads = grad_bytes(engine)
        engine.step()
        state = state_bytes(engine)
        spec = model_spec(model, 16)
        tr = trainable_of(model, spec)
        cm = CostModel(spec, load_cluster("cpu-1"), precision, "deepspeed", trainable=tr)
        _, g, o = cm.model_state_bytes(Strategy(1, 1, zero=0))
        print("LORA_BYTES " + json.dumps({"precision": precision, "trainable": tr.label(),
                                          "measured": [state, grads], "predicted": [o, g]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
