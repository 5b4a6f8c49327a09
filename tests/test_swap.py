"""DawnPiper's swap at run time (docs/dawnpiper.md §7.5, seed 002 §C.2): the tensors a
per-tensor policy (memopt.tensor_mem_opt on a real profile) chooses really leave the device,
gradients stay bit-identical, and the per-tensor recompute choice is what the runtimes'
``recompute_per_stage`` executes.  Also run as a worker: ``python tests/test_swap.py --worker
POLICY_JSON`` (one DeepSpeed rank, spawned by :func:`test_deepspeed_stage_swaps`)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from ds_autoplan.models.tiny_gpt import GPTConfig, TinyGPT, example_batch, gpt_loss
from ds_autoplan.search.memopt import KEEP, _TensorStage, tensor_mem_opt
from ds_autoplan.runtime.memtrack import MemTracker, hold
from ds_autoplan.runtime.swap import SwapPolicy, Swapper

CFG = dict(vocab_size=64, hidden=32, num_layers=4, num_heads=2, seq_len=16)
MBS, STAGE = 2, (0, 4)            # stage = embedding + 3 blocks of [embed, 4 blocks, head]


def model():
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(**CFG))


@pytest.fixture(scope="module")
def prof():
    from ds_autoplan.profile import profile_model
    p = profile_model(model(), batch_size=MBS, repeats=1, warmup=0, device="cpu")
    for u in p.units:      # fixed times: the choices below must not depend on timing noise
        u.fwd_s, u.bwd_s = 1e-3, 2e-3
    return p


def run_stage(m, seeds, swapper=None, tracker=None):
    """Forward ``seeds`` micro-batches through the stage's layers (all in flight, as on a
    1F1B stage with that many copies), then their backwards; -> (device-resident saved bytes
    after the forwards, host bytes then, parameter gradients)."""
    layers = m.layers()[STAGE[0]:STAGE[1]]
    outs = []
    for s in seeds:
        x = example_batch(m.cfg, MBS, s)[0]
        with swapper.forward() if swapper else tracker.track():
            for layer in layers:
                x = layer(x)
        outs.append(x)
    dev = tracker.current
    host = swapper.host_tracker.current if swapper else 0
    for y in outs:
        y.square().mean().backward()
    return dev, host, [p.grad.clone() for p in m.parameters() if p.grad is not None]


def test_swapper_offloads_the_policy_bytes_and_gradients_are_bit_identical(prof):
    st = _TensorStage(prof, *STAGE, 2, 1e12, 4.0)
    # the profile's per-tensor records are what a forward of these layers saves (§2.3)
    ref = model()
    tr0 = MemTracker(exclude=list(ref.parameters()))
    dev0, _, g0 = run_stage(ref, [1, 2], tracker=tr0)
    assert dev0 == 2 * st.resident([KEEP] * len(st.tb))
    base = tensor_mem_opt(prof, *STAGE, float("inf"), 2).base_peak_bytes
    pol = tensor_mem_opt(prof, *STAGE, 0.8 * base, 2, swap_GBps=1000.0)   # fast link: swaps hide
    assert pol.feasible and pol.swap_bytes > 0 and not pol.recompute
    m = model()
    tr = MemTracker(exclude=list(m.parameters()))
    sw = Swapper(SwapPolicy.from_stage_policy(pol), m, tracker=tr)
    dev, host, g = run_stage(m, [1, 2], swapper=sw, tracker=tr)
    assert dev0 - dev == 2 * pol.swap_bytes          # per in-flight micro-batch
    assert host == sw.host_tracker.peak == 2 * pol.swap_bytes
    assert sw.swapped_bytes == pol.swap_bytes        # the last forward's offload
    assert sw.host_tracker.current == 0 and tr.current == 0   # all released by the backward
    assert len(g) == len(g0) and all(torch.equal(a, b) for a, b in zip(g, g0))


def test_swap_policy_names_and_json():
    pol = SwapPolicy.from_dict({"blocks.1": [0, 3], "embed": None})
    assert pol.select("blocks.1", 3, 10) and not pol.select("blocks.1", 1, 10)
    assert pol.select("embed", 7, 10) and not pol.select("head", 0, 10)
    assert not SwapPolicy(pol.units, min_bytes=11).select("embed", 0, 10)
    lay = pol.to_layers(["embed", "blocks.0", "blocks.1", "head"])
    assert lay.units == {"2": {0, 3}, "0": None}
    with pytest.raises(ValueError):
        pol.to_layers(["embed"])
    with pytest.raises(ValueError):
        Swapper(pol, model().blocks)      # names no module of the one given


def test_per_tensor_recompute_is_what_recompute_per_stage_runs(prof):
    # The runtimes recompute the first round(fraction * layers) layers of a stage (DeepSpeed
    # adapter: module.recompute_layers; Megatron: recompute_method="block"); with prefix_only
    # the per-tensor policy recomputes exactly such a prefix, and the engine's way of running
    # it keeps exactly the bytes the policy's memory model says (§3.3 A_x).
    n = STAGE[1] - STAGE[0]
    base = tensor_mem_opt(prof, *STAGE, float("inf"), 3).base_peak_bytes
    seen = set()
    for frac in (0.9, 0.8, 0.7):
        pol = tensor_mem_opt(prof, *STAGE, frac * base, 3, swap_GBps=None, prefix_only=True)
        kp = len(pol.recompute)
        assert pol.feasible and pol.recompute == pol.units[:kp]
        assert round(pol.recompute_fraction * n) == kp
        st = _TensorStage(prof, *STAGE, 3, 0.0, 4.0, prefix=True)
        plan = [pol.tensor_choice[k] for k in st.names]
        assert plan == st.prefix_plan([KEEP] * len(plan), kp - 1)   # whole units, no swap
        m = model()
        tr = MemTracker(exclude=list(m.parameters()))
        layers = m.layers()[STAGE[0]:STAGE[1]]
        x = example_batch(m.cfg, MBS, 1)[0]
        ckpt = hold(tr, x)                          # as AutoplanEngine._exec_forward_pass
        with torch.no_grad():
            for layer in layers[:kp]:
                x = layer(x)
        x = x.detach().requires_grad_(x.is_floating_point())
        with tr.track():
            for layer in layers[kp:]:
                x = layer(x)
        assert tr.current == st.resident(plan), (kp, plan)
        del ckpt, x
        seen.add(kp)
    assert len(seen) == 3 and min(seen) > 0     # the caps exercise different prefixes


# ---- DeepSpeed: a stage's forward under a Swapper (AutoplanEngine.set_swap_policy) ---------

def worker(path):
    from ds_autoplan.runtime.deepspeed import api
    spec = json.load(open(path))
    n, steps = spec["n"], 2
    batches = [[example_batch(GPTConfig(**CFG), MBS, 100 * s + i) for i in range(n)]
               for s in range(steps)]
    plan = {"pp": 2, "dp": 1, "micro_batch_size": MBS, "num_microbatches": n,
            "global_batch_size": MBS * n, "precision": "fp32", "schedule": "1f1b",
            "layers_per_stage": [2, 2], "recompute_per_stage": [0.0, 0.0]}
    cfg = {"steps_per_print": 10 ** 9, "gradient_clipping": 0.0}
    out = {}
    for on in (False, True):
        swap = {"swap": spec["swap"], "unit_names": spec["units"]}   # as partition_report writes
        engine, *_ = api.initialize(model().layers(), plan, loss_fn=gpt_loss, config=cfg,
                                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                    track_memory=True, swap=swap if on else None)
        losses, peak = [], 0
        for s in range(steps):
            losses.append(float(engine.train_batch(iter(batches[s]))))
            peak = max(peak, engine.memtracker.peak)
        sw = engine.ap_swap.get(engine.stage_id)
        out[on] = {"losses": losses, "peak": peak,
                   "host_peak": sw.host_tracker.peak if sw else 0,
                   "params": [p.detach().clone() for p in engine.module.parameters()]}
    same = all(torch.equal(a, b) for a, b in zip(out[False]["params"], out[True]["params"]))
    for d in out.values():
        del d["params"]
    print("AUTOPLAN_RESULT " + json.dumps({"rank": engine.stage_id, "same_params": same,
                                           "off": out[False], "on": out[True]}), flush=True)
    # Tear the gloo group down before interpreter exit: left to the exit, its threads can be
    # destroyed while joinable ("terminate called without an active exception", SIGABRT).
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def test_deepspeed_stage_swaps(prof, tmp_path):
    pytest.importorskip("deepspeed")
    from ds_autoplan.search.memopt import inflight_copies, stage_memory_options
    from ds_autoplan.runtime.launch import spawn
    from ds_autoplan.schedule import build
    n = 4
    copies = inflight_copies(build("1f1b", d=2, n=n))          # [2, 1]
    bounds = [(0, 3), (3, 6)]                                   # plan layers_per_stage [2, 2]
    base = tensor_mem_opt(prof, *bounds[0], float("inf"), copies[0]).base_peak_bytes
    pols = [tensor_mem_opt(prof, *bounds[0], 0.85 * base, copies[0], swap_GBps=1000.0),
            tensor_mem_opt(prof, *bounds[1], float("inf"), copies[1], stage=1)]
    opts = stage_memory_options(pols)
    assert opts["swap_bytes_per_stage"][0] > 0 and opts["swap"][1] == {}
    path = tmp_path / "swap.json"
    path.write_text(json.dumps({"n": n, "swap": opts["swap"],
                                "units": [u.name for u in prof.units]}))
    res = {}
    for rc, out in spawn([__file__, "--worker", str(path)], 2, timeout=300):
        assert rc == 0, out
        for line in out.splitlines():
            if line.startswith("AUTOPLAN_RESULT "):
                d = json.loads(line.split(" ", 1)[1])
                res[d["rank"]] = d
    assert sorted(res) == [0, 1]
    for r, d in res.items():
        assert d["same_params"] and d["on"]["losses"] == d["off"]["losses"], d
        drop = copies[r] * opts["swap_bytes_per_stage"][r]      # per in-flight micro-batch
        assert d["off"]["peak"] - d["on"]["peak"] == drop, (r, d)
        assert d["on"]["host_peak"] == drop, (r, d)
    assert res[0]["on"]["peak"] < res[0]["off"]["peak"]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2])
