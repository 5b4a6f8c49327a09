"""Swap in the Megatron runtime: a stage's MLP saved tensors offloaded to host
during its forwards give bit-identical gradients and fewer device-resident saved bytes
(2 CPU ranks, gloo, 1F1B)."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")

UNIT = "decoder.layers.0.mlp"


def swap_case(case) -> dict:
    from megatron.core import parallel_state as ps

    from ds_autoplan.runtime.megatron import get_forward_backward_func, initialize
    from ds_autoplan.runtime.megatron.swap import swap_forward_step
    from ds_autoplan.models.megatron_gpt import MBS, SEQ, build_chunks, data_iter, forward_step
    from harness.megatron_cases import _plan
    from ds_autoplan.runtime.memtrack import MemTracker
    out = {}
    for on in (False, True):
        ps.destroy_model_parallel()
        plan = _plan(case)
        setup = initialize(plan)
        chunks = build_chunks(setup)
        tracker = MemTracker(exclude=[p for m in chunks for p in m.parameters()])
        step = swap_forward_step(forward_step, chunks,
                                 [{UNIT: None} if on and setup.pp_rank == 0 else {}], tracker=tracker)
        fb = get_forward_backward_func(plan, tracker=tracker)
        losses = fb(forward_step_func=step, data_iterator=data_iter(0), model=chunks,
                    num_microbatches=plan.num_microbatches, seq_length=SEQ, micro_batch_size=MBS)
        sw = step.swappers.get(0)
        out[on] = {"peak": fb.peak_bytes, "losses": [float(x["loss"]) for x in losses],
                   "host": sw.host_tracker.peak if sw else 0,
                   "grads": [p.grad.clone() for m in chunks for p in m.parameters()]}
    same = all(torch.equal(a, b) for a, b in zip(out[False]["grads"], out[True]["grads"]))
    return {"rank": setup.pp_rank, "same_grads": same, "losses": [out[0]["losses"], out[1]["losses"]],
            "peak": [out[0]["peak"], out[1]["peak"]], "host": out[True]["host"]}


@pytest.mark.timeout(150)
def test_megatron_stage_swaps_mlp_tensors():
    from harness.megatron_cases import launch
    case = dict(fn=f"{__file__}:swap_case", pp=2, n=4, schedule="1f1b", layers=[2, 2])
    rows = sorted((o[0] for o in launch(2, [case], timeout=120)), key=lambda r: r["rank"])
    r0, r1 = rows
    for r in rows:
        assert r["same_grads"], r
        assert r["losses"][0] == r["losses"][1]
    # 1F1B: rank 0 holds 2 micro-batches' activations at its peak; both MLP copies go to host
    assert r0["host"] > 0 and r0["peak"][0] - r0["peak"][1] == r0["host"], r0
    assert r1["host"] == 0 and r1["peak"][1] == r1["peak"][0], r1
