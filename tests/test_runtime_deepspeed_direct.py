"""F and B of ds_autoplan's DeepSpeed engine call the stage's module and autograd directly
exactly where DeepSpeed's ``forward`` / ``backward`` wrappers would do nothing else
(``runtime.deepspeed.engine.wrapper_work``), and that gives bitwise the wrapped path's losses
and gradients (2 gloo ranks)."""
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("deepspeed")

from ds_autoplan.runtime.launch import results  # noqa: E402

N = 4     # micro-batches per step in ds_direct_worker.py

WORKER = str(Path(__file__).with_name("ds_direct_worker.py"))


def test_direct_exactly_where_the_wrappers_have_nothing_to_do():
    rows = results([WORKER, "decide"], 2, timeout=300)
    got = {(d["config"], d["rank"]): (d["direct"], d["wrapped"]) for d in rows}
    assert len(got) == 2 * 6, got
    for (config, _), (direct, wrapped) in got.items():
        assert direct == (config == "fp32"), (config, wrapped)
        assert direct == (not wrapped)
    want = {"fp32-zero1": "ZeRO", "bf16": "BF16_Optimizer", "torch_autocast": "torch_autocast",
            "wall_clock_breakdown": "engine timers", "memory_breakdown": "memory_breakdown"}
    for config, why in want.items():
        assert any(why in w for w in got[(config, 0)][1]), (config, got[(config, 0)])
    # DeepSpeed's forward hooks are skipped only where they would do nothing but start the
    # throughput timer (hook_work), which F then starts itself; a user's hook brings them back
    rows = {(d["config"], d["rank"]): d for d in rows}
    for (config, rank), d in rows.items():
        assert d["bare"] == (config == "fp32"), d
    assert "forward timers" in rows[("wall_clock_breakdown", 0)]["hooks"]
    assert "memory_breakdown" in rows[("memory_breakdown", 0)]["hooks"]
    for rank in (0, 1):
        d = rows[("fp32", rank)]
        assert d["timer"] == [True, True], d    # (PipelineEngine never stops it: no step())
        assert d["user_hook_calls"] == 2 * N, d  # every F of both steps on this rank


def _engine(optimizer, **on):
    """An engine as ``wrapper_work`` reads it, with the given switches on."""
    flags = {k: False for k in ("zero_optimization", "fp16_enabled", "torch_autocast_enabled",
                                "is_deepcompile_enabled", "memory_breakdown",
                                "autotuning_profile_model_info")}
    flags.update(on)
    e = SimpleNamespace(optimizer=optimizer, is_compiled=False, _is_compiled_autograd_enabled=False,
                        engine_timers=SimpleNamespace(backward_timers=[]), zenflow=False,
                        enable_backward_allreduce=False,
                        managed_gradient_accumulation=lambda: True)
    for k, v in flags.items():
        setattr(e, k, lambda v=v: v)
    return e


def test_configs_the_cpu_cannot_build_stay_wrapped():
    """fp16 (FP16_Optimizer: loss scaling) cannot be built on the CPU accelerator, nor ZeRO-2
    in a PipelineEngine: their optimizers are DeepSpeed wrappers, and their switches count."""
    import torch
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from ds_autoplan.runtime.deepspeed.engine import wrapper_work
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert wrapper_work(_engine(sgd)) == []
    assert wrapper_work(_engine(object.__new__(FP16_Optimizer), fp16_enabled=True)) == \
        ["optimizer FP16_Optimizer (a DeepSpeed wrapper or none)", "fp16"]
    assert wrapper_work(_engine(object.__new__(DeepSpeedZeroOptimizer), zero_optimization=True)) == \
        ["optimizer DeepSpeedZeroOptimizer (a DeepSpeed wrapper or none)", "ZeRO"]
    assert wrapper_work(_engine(sgd, is_deepcompile_enabled=True)) == ["DeepCompile"]
    assert wrapper_work(_engine(None)) == ["optimizer NoneType (a DeepSpeed wrapper or none)"]


def test_direct_calls_give_the_wrapped_losses_and_gradients_bitwise():
    names = ("1f1b", "v-zb", "zb-h1", "interleaved")
    rows = results([WORKER, "compare", *names], 2, timeout=300)
    assert {(d["schedule"], d["recompute"], d["rank"]) for d in rows} == \
        {(n, r, k) for n in names for r in (0.0, 0.5) for k in (0, 1)}
    for d in rows:
        assert d["direct"] and d["grads"] > 0, d
        assert d["identical"], d
