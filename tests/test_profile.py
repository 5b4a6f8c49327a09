"""Profiling: fx chain, measured bytes/params against independent counts, profile file,
refusals, planner ModelSpec, hardware benchmark, CLI."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ds_autoplan.cli import main
from ds_autoplan.errors import UserError
from ds_autoplan.models import TinyGPT, resolve_model
from ds_autoplan.profile import (Profile, ProfileMismatch, TraceFailure, auto_leaf_classes,
                                 build_chain, load_profile, profile_model, to_model_spec, trace)

B = 2  # micro-batch


@pytest.fixture(scope="module")
def prof():
    torch.set_num_threads(1)
    return profile_model(resolve_model("gpt-tiny-4"), batch_size=B, repeats=1, warmup=0)


def _chain(granularity, max_cross=1, leaves=True):
    e = resolve_model("gpt-tiny-4")
    lt = auto_leaf_classes(e.model) if leaves else set()
    x = e.make_inputs(B)
    return e, x, build_chain(trace(e.model, lt), x, lt, granularity, max_cross, num_blocks=4)


def test_block_chain_is_the_layer_list_and_reproduces_the_model():
    e, x, ch = _chain("block")
    assert ch.names == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert ch.kinds == ["pre", "block", "block", "block", "block", "post"]
    assert torch.equal(ch.split(*x), e.model(*x))


def test_fine_chain_cuts_blocks_into_attention_and_mlp():
    # Merak §4.5: one tensor crosses each cut; each block becomes attention + FFN subgraphs
    e, x, ch = _chain("node", leaves=False)
    assert ch.names[:3] == ["embed", "blocks.0:ln1", "blocks.0:ln2"] and len(ch.names) == 11
    assert torch.equal(ch.split(*x), e.model(*x))


def test_params_boundary_and_saved_bytes_match_independent_counts(prof):
    from ds_autoplan.runtime.memtrack import MemTracker
    e = resolve_model("gpt-tiny-4")
    cfg = e.model.cfg
    assert sum(u.params for u in prof.units) == sum(p.numel() for p in e.model.parameters())
    assert [u.out_bytes for u in prof.units[:-1]] == [B * cfg.seq_len * cfg.hidden * 4] * 5
    assert prof.units[-1].out_bytes == B * cfg.seq_len * cfg.vocab_size * 4
    # whole-model saved-for-backward bytes, counted by the runtime's tracker
    tr = MemTracker(exclude=list(e.model.parameters()))
    with tr.track():
        loss = e.loss(e.model(*e.make_inputs(B)), B)
        whole = tr.current
    del loss
    N = prof.num_units
    assert prof.stage_act_bytes(0, N) == whole
    for k in range(1, N):   # block boundaries: nothing is kept twice
        assert prof.stage_act_bytes(0, k) + prof.stage_act_bytes(k, N) == whole


def test_saved_bytes_scale_with_the_micro_batch(prof):
    p1 = profile_model(resolve_model("gpt-tiny-4"), batch_size=1, repeats=1, warmup=0)
    assert [2 * u.act_bytes for u in p1.units[1:-1]] == [u.act_bytes for u in prof.units[1:-1]]


def test_cut_inside_a_block_keeps_the_residual_on_both_sides():
    p = profile_model(resolve_model("gpt-tiny-4"), batch_size=B, repeats=1, warmup=0, granularity="node",
                      max_cross=2)
    N, total = p.num_units, p.stage_act_bytes(0, p.num_units)
    splits = [p.stage_act_bytes(0, k) + p.stage_act_bytes(k, N) - total for k in range(1, N)]
    assert min(splits) == 0 and max(splits) > 0
    assert all(s in (0, B * 64 * 64 * 4) for s in splits)   # one [B, T, H] residual, fp32


def test_profile_roundtrip_and_refusals(prof, tmp_path):
    path = str(tmp_path / "p.json")
    prof.save(path)
    from ds_autoplan.profile import is_profile
    assert is_profile(path) and not is_profile(str(tmp_path / "missing.json"))
    again = load_profile(path, "gpt-tiny-4", model=resolve_model("gpt-tiny-4").model, device="cpu")
    assert again.to_dict() == prof.to_dict()
    with pytest.raises(ProfileMismatch, match="not 'gpt2'"):
        load_profile(path, "gpt2")
    with pytest.raises(ProfileMismatch, match="another structure"):
        load_profile(path, model=TinyGPT(num_layers=3))
    with pytest.raises(ProfileMismatch, match="another device: name"):
        load_profile(path, device={**prof.device, "name": "NVIDIA H100"})
    with pytest.raises(ProfileMismatch, match="threads"):
        load_profile(path, device={**prof.device, "threads": 64})
    assert issubclass(ProfileMismatch, ValueError) and issubclass(ProfileMismatch, UserError)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"units": []}))
    with pytest.raises(ProfileMismatch, match="not a ds_autoplan profile"):
        load_profile(str(bad))
    d = prof.to_dict()
    d["device"]["name"] = "edited"
    bad.write_text(json.dumps(d))
    with pytest.raises(ProfileMismatch, match="fingerprint"):
        load_profile(str(bad))


class Gate(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else -self.lin(x)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.gate = Gate()
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.gate(self.inp(x)))

    def example_inputs(self, b):
        return (torch.randn(b, 8),)


def gated_factory():
    return Gated()


def test_untraceable_module_is_named_and_leaf_option_fixes_it():
    with pytest.raises(TraceFailure, match=r"module 'gate' \(class Gate\).*--leaf Gate") as ei:
        profile_model(Gated(), repeats=1, warmup=0)
    assert ei.value.module == "gate" and ei.value.cls == "Gate"
    p = profile_model(Gated(), leaf_classes=["Gate"], repeats=1, warmup=0, granularity="node")
    assert [u.name for u in p.units] == ["inp", "gate", "out"]
    with pytest.raises(UserError, match="no module of class Nope"):
        profile_model(Gated(), leaf_classes=["Nope"])


def test_model_spec_reproduces_measured_times_in_the_cost_model(prof):
    from ds_autoplan.cost.model import CostModel, Strategy
    from ds_autoplan.spec import load_cluster
    spec = to_model_spec(prof)
    assert spec.num_layers == 4 and spec.type_ids == [0, 0, 0, 0]
    assert spec.total_params == prof.total_params
    cluster = load_cluster({"name": "here", "num_nodes": 1, "gpus_per_node": 1, "memory_gb": 8,
                            "reserve_gb": 0, "peak_tflops": prof.flops_ref / 1e12,
                            "compute_efficiency": 1.0, "intra_node_GBps": 1, "inter_node_GBps": 1})
    t = CostModel(spec, cluster, "fp32").tables([Strategy(1, 1)], B)
    pre, post = prof.units[0], prof.units[-1]
    blocks = sorted(u.fwd_s + u.bwd_s for u in prof.units[1:-1])
    # unit order in the cost model: pre, post, blocks
    assert t.fwd[0, 0] + t.bwd[0, 0] == pytest.approx(pre.fwd_s + pre.bwd_s, rel=1e-9)
    assert t.fwd[1, 0] + t.bwd[1, 0] == pytest.approx(
        post.fwd_s + post.bwd_s + prof.loss["fwd_s"] + prof.loss["bwd_s"], rel=1e-9)
    assert t.fwd[2, 0] + t.bwd[2, 0] == pytest.approx((blocks[1] + blocks[2]) / 2, rel=1e-9)
    # fp32 activations: the cost model's stash equals the measured saved bytes
    assert t.f1[2, 0] == pytest.approx(prof.units[1].act_bytes, rel=1e-9)


def test_hardware_benchmark_gives_a_loadable_cluster_spec():
    from ds_autoplan.profile import hardware_cluster_spec
    from ds_autoplan.spec import load_cluster
    spec = hardware_cluster_spec(quick=True)          # 2 gloo processes
    m = spec["measured"]
    assert m["backend"] == "gloo" and m["world"] == 2
    for op in ("all_reduce", "all_gather", "p2p"):
        assert m[op]["GBps"] > 0 and len(m[op]["points"]) == 2
        assert all(t > 0 for _, t in m[op]["points"])
    cl = load_cluster(spec["cluster"])
    assert cl.gpus_per_node == 2 and cl.flops == pytest.approx(m["matmul_flops"])
    assert cl.p2p_GBps == pytest.approx(m["p2p"]["GBps"])
    # the host side (issue 26): DeepSpeedCPUAdam's rate per core, the copy rate, memory, cores
    assert m["cpu_adam"]["params_per_s"] > 0 and m["cpu_adam"]["threads"] == cl.cpu_cores
    assert cl.cpu_adam_rate_per_core == pytest.approx(m["cpu_adam"]["per_core"])
    assert cl.host_link_GBps > 0 and cl.host_memory_gb > 0 and cl.offload_missing() == []


def test_cli_profile_writes_reuses_and_refuses(tmp_path, capsys):
    out = str(tmp_path / "prof.json")
    args = ["profile", "gpt-tiny-4", "--out", out, "--repeats", "1", "--warmup", "0"]
    assert main(args) == 0
    assert Profile.load(out).model == "gpt-tiny-4"
    assert main(args) == 0 and "reused" in capsys.readouterr().out
    assert main(["profile", "gpt-tiny", "--out", out]) == 2
    assert "not 'gpt-tiny'" in capsys.readouterr().err
    assert main(["profile", "no-such-model", "--out", out]) == 2
    assert main(["profile", "module:test_profile.gated_factory", "--out",
                 str(tmp_path / "g.json")]) == 2
    err = capsys.readouterr().err
    assert "class Gate" in err and "--leaf Gate" in err and "Traceback" not in err
    assert main(["profile", "module:test_profile.gated_factory", "--leaf", "Gate", "--out",
                 str(tmp_path / "g.json"), "--repeats", "1", "--warmup", "0"]) == 0
    assert main(["profile", "hf-gpt2-tiny", "--out", str(tmp_path / "h.json")]) in (0, 2)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        import time
        time.sleep(0.02)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        import time
        time.sleep(0.04)
        return g * 2


class Slow(nn.Module):
    """20 ms forward, 40 ms backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return _Sleep.apply(self.lin(x))


class WithSlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.slow, self.b = nn.Linear(8, 8), Slow(), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.slow(self.a(x)))


@pytest.mark.parametrize("timing,inflight", [("chain", 1), ("chain", 3), ("isolated", 1)])
def test_time_is_attributed_to_the_unit_that_spends_it(timing, inflight):
    p = profile_model(WithSlow(), lambda b: (torch.randn(b, 8),), leaf_classes=["Slow"],
                      granularity="node", repeats=2, warmup=1, timing=timing, inflight=inflight)
    assert [u.name for u in p.units] == ["a", "slow", "b"]
    a, slow, b = p.units
    assert 0.02 <= slow.fwd_s < 0.2 and 0.04 <= slow.bwd_s < 0.4
    assert max(a.fwd_s, a.bwd_s, b.fwd_s, b.bwd_s) < 0.015


def test_megatron_core_gpt_model_traces_into_its_layers(tmp_path):
    # in a subprocess: the built-in creates a 1-rank process group and Megatron's parallel state
    import subprocess
    import sys
    out = tmp_path / "m.json"
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "ds_autoplan", "profile",
                        "megatron-gpt-tiny", "--out", str(out), "--repeats", "1", "--warmup", "0"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    p = Profile.load(str(out))
    assert [u.kind for u in p.units] == ["pre", "block", "block", "post"]
    assert [u.name for u in p.units][1:3] == ["decoder.layers.0", "decoder.layers.1"]
    assert p.total_params == p.model_info["params"]
    assert p.units[1].act_bytes == p.units[2].act_bytes > 0


def test_plan_uses_a_model_profile_and_refuses_another_models(tmp_path, capsys):
    import json
    out = str(tmp_path / "prof.json")
    assert main(["profile", "gpt-tiny-4", "--out", out, "--repeats", "1", "--warmup", "0"]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", "gpt-tiny-4", "--cluster", "cpu-2", "--global-batch", "8",
                 "--profile", out, "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert sum(summary["layers_per_stage"]) == 4          # the profiled model's 4 blocks
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "cpu-2", "--global-batch", "8",
                 "--profile", out, "--quiet"]) == 2
    assert "gpt-tiny" in capsys.readouterr().err
