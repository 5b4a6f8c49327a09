"""Offloading (issue 26): the host side of the cluster, the Offload spec, the engines' memory and
time with offload, the search dimension and the emitted configs (docs/offload.md)."""
import pytest

from ds_autoplan.spec import SpecError
from ds_autoplan.spec.cluster import load_cluster
from ds_autoplan.spec.parallel import NO_OFFLOAD, Offload, Parallel


def test_host_fields_load_check_and_share_links():
    c = load_cluster("8xa100-80gb")
    assert c.offload_missing() == [] and c.offload_missing(nvme=True) == []
    assert (c.host_memory_gb, c.cpu_cores, c.host_link_shared_by) == (2048, 128, 2)
    # two GPUs behind one PCIe switch uplink: each gets half while both copy
    assert c.host_link_each_GBps() == pytest.approx(c.host_link_GBps / 2)
    assert c.host_link_each_GBps(active=1) == pytest.approx(c.host_link_GBps)
    bare = load_cluster("64xa100-40gb")          # no host figures: cannot offload, and says what lacks
    assert bare.offload_missing() == ["host_memory_gb", "cpu_cores", "cpu_adam_rate_per_core", "host_link_GBps"]
    d = {**c.__dict__, "cpu_cores": 0}
    with pytest.raises(SpecError, match="cpu_cores must be a positive integer"):
        load_cluster(d)
    with pytest.raises(SpecError, match="host_link_GBps must be a number"):
        load_cluster({**c.__dict__, "host_link_GBps": "fast"})


@pytest.mark.parametrize("text", ["none", "opt", "opt:0.5", "opt+param", "param", "nvme:opt", "nvme:opt+param",
                                  "act", "opt+act", "nvme:opt+param+act"])
def test_offload_text_round_trips(text):
    o = Offload.parse(text)
    assert o.text() == text and Offload.parse(o.text()) == o


def test_offload_refusals():
    for bad, msg in (("opt:1.5", r"\[0, 1\]"), ("gpu:opt", "unknown part"), ("nvme:none", "unknown part"),
                     ("opt:x", "must be a number"), ("nvme:act", "no model states"), ("act:1", "unknown part")):
        with pytest.raises(SpecError, match=msg):
            Offload.parse(bad)
    with pytest.raises(SpecError, match="needs ZeRO"):
        Parallel(zero=0, offload="opt")
    with pytest.raises(SpecError, match="needs ZeRO-3"):
        Parallel(zero=2, offload="opt+param")
    assert Parallel(zero=3, offload="opt:0.25").offload == Offload(0.25)
    assert Parallel().offload is NO_OFFLOAD and Parallel(zero=1, offload="opt").as_dict()["offload"] == "opt"
    act = Parallel(zero=0, offload="act").offload         # activations need no ZeRO
    assert act.any and not act.states and act.label() == "activations on the host"


# ---- memory and time per engine (cost/offload.py) ----
from ds_autoplan.cost import offload as ofl                      # noqa: E402
from ds_autoplan.cost.iteration import Config, config_cost       # noqa: E402
from ds_autoplan.cost.model import CostModel, Strategy           # noqa: E402
from ds_autoplan.spec.cluster import GB                          # noqa: E402
from ds_autoplan.spec.model import load_model                    # noqa: E402


def test_engine_bytes_per_parameter():
    """Device and host bytes as DeepSpeed 0.19.8 and Megatron-core 0.16.1 hold them (bf16, d = 4)."""
    d, full = 4, Offload(1.0)
    z1 = ofl.terms("deepspeed", "bf16", 1, d, full)
    assert z1.device == (2.0, 2.0, 0.0) and z1.host == pytest.approx(20 / d) and z1.cpu == 1 / d
    z2 = ofl.terms("deepspeed", "bf16", 2, d, full)
    assert z2.device == (2.0, 0.0, 0.0) and z2.accum == pytest.approx(4 / d)
    half = ofl.terms("deepspeed", "bf16", 3, d, Offload(0.5))          # Twin-Flow ratio 0.5
    assert half.device == (2 / d, 0.0, 8 / d) and half.host == pytest.approx(8 / d) and half.concurrent
    inf = ofl.terms("deepspeed", "bf16", 3, d, Offload(1.0, True))     # ZeRO-Infinity on the host
    assert inf.device == (0.0, 0.0, 0.0) and inf.fetch == 2 / d and inf.h2d == 0.0
    assert inf.host == pytest.approx(16 / d) and inf.accum == pytest.approx(4 / d)
    mg = ofl.terms("megatron", "bf16", 1, d, Offload(0.25))            # HybridDeviceOptimizer
    assert mg.device == (2.0, 4.0, 0.75 * 12 / d) and mg.host == pytest.approx(4 / d) and mg.torch_cpu
    for eng, z, off, word in (("deepspeed", 2, Offload(0.5), "ZeRO-3's"), ("megatron", 3, full, "ZeRO-1"),
                              ("megatron", 1, Offload(1.0, device="nvme"), "no NVMe")):
        with pytest.raises(SpecError, match=word):
            ofl.terms(eng, "bf16", z, d, off)


def test_config_cost_offload_fits_on_device_and_host_and_refuses_by_name():
    m, c = load_model("llama2-7b"), load_cluster("1xa100-80gb")
    cm = CostModel(m, c, "bf16", "deepspeed", execution="deepspeed")
    cfg = dict(micro_batch=1, num_microbatches=8, recompute="full")
    none = config_cost(cm, Config(zero=1, **cfg))
    opt = config_cost(cm, Config(zero=1, offload="opt", **cfg))
    assert not none.fits and opt.fits and opt.peak[0] < none.peak[0] - 70 * GB
    # the host holds 16 + 2 cb bytes per parameter (fp32 master, gradient, moments, 16-bit copies)
    assert opt.host == pytest.approx(20 * m.total_params, rel=0.02)
    assert opt.time > none.time and opt.tail > none.tail            # host step and copies
    small = CostModel(m, load_cluster({**c.__dict__, "host_memory_gb": 64}), "bf16", "deepspeed",
                      execution="deepspeed")
    assert not config_cost(small, Config(zero=1, offload="opt", **cfg)).fits      # host budget
    with pytest.raises(SpecError, match="ratio, NVMe and parameter offload are ZeRO-3's"):
        config_cost(cm, Config(zero=2, offload="opt:0.5", **cfg))
    bare = CostModel(m, load_cluster("64xa100-40gb"), "bf16", "deepspeed")
    with pytest.raises(SpecError, match="no host figures.*profile --hardware"):
        config_cost(bare, Config(zero=3, dp=64, offload="opt", micro_batch=1, num_microbatches=1))


def test_partial_offload_sits_between_none_and_full():
    """ZeRO-3 with Twin-Flow's ratio: device bytes fall and host step time rises with the ratio."""
    m, c = load_model("llama2-13b"), load_cluster("8xa100-80gb")
    cm = CostModel(m, c, "bf16", "deepspeed", execution="deepspeed")
    runs = [config_cost(cm, Config(zero=3, dp=8, offload=o, micro_batch=1, num_microbatches=4))
            for o in ("none", "opt:0.25", "opt:0.5", "opt")]
    peaks, tails = [r.peak[0] for r in runs], [r.tail for r in runs]
    assert peaks == sorted(peaks, reverse=True) and tails == sorted(tails)


# ---- the search dimension, the plan and the emitted configs ----
from ds_autoplan.cli import main                                   # noqa: E402
from ds_autoplan.emit.deepspeed import ds_config, user_config, validate   # noqa: E402
from ds_autoplan.emit.megatron import NotExpressible, megatron_args       # noqa: E402
from ds_autoplan.plan import Plan                                  # noqa: E402
from ds_autoplan.search.planner import search                      # noqa: E402


@pytest.mark.parametrize("model,cluster,batch", [("llama2-70b", "8xa100-80gb", 64),
                                                 ("llama2-7b", "1xa100-80gb", 32),
                                                 ("llama2-13b", "1xa100-40gb", 32)])
def test_plan_fits_device_and_host_beyond_gpu_memory(model, cluster, batch, tmp_path, capsys):
    """Issue 26's cases: each only fits by offloading; the plan prints both peaks and its
    ds_config.json passes DeepSpeed's validation."""
    assert main(["plan", "--model", model, "--cluster", cluster, "--global-batch", str(batch),
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(tmp_path / "plan.json")
    pr, off = plan.predicted, plan.predicted["offload"]
    assert plan.parallel.offload.any and off["what"] == plan.offload
    assert max(pr["peak_memory_gb_per_stage"]) <= pr["memory_budget_gb"]
    assert 0 < off["host_memory_gb_per_node"] <= off["host_budget_gb_per_node"] and off["step_s"] > 0
    assert f"peak memory {max(pr['peak_memory_gb_per_stage']):.2f} GB" in out
    assert f"host memory {off['host_memory_gb_per_node']:.1f} GB" in out
    cfg = ds_config(plan)
    validate(cfg, plan)
    zo = cfg["zero_optimization"]
    assert zo["offload_optimizer"]["device"] == "cpu" and zo["stage"] == plan.zero_stage >= 1
    assert "ZeRO-3 + full offload" in (tmp_path / "report.md").read_text()


def test_partial_offload_beats_none_and_full_and_the_search_finds_it():
    """LLaMA-2 7B, global batch 16, on one device of 120 GB with a DGX A100 host: without offload
    every state fits only with half the layers recomputed at micro-batch 1; a quarter of the
    optimizer kept on the device (ZeRO-3, Twin-Flow ratio 0.75) buys micro-batch 4 without
    recomputation, its device share stepped beside the host's; the whole optimizer on the host
    (ZeRO-2 / ZeRO-3 ZeRO-Offload) buys the same and pays the host step for all of it."""
    cl = {**load_cluster("1xa100-80gb").__dict__, "memory_gb": 120}
    kw = dict(wide=False, baselines=False, runtime="deepspeed", execution="deepspeed")
    t = {o: search("llama2-7b", cl, 16, fix=f"offload={o}", **kw).plan for o in ("none", "opt:0.75", "opt")}
    time = {o: p.predicted["iteration_time_s"] for o, p in t.items()}
    assert time["opt:0.75"] < min(time["none"], time["opt"]), time
    assert sum(t["none"].recompute_per_stage) > 0 and sum(t["opt:0.75"].recompute_per_stage) == 0
    free = search("llama2-7b", cl, 16, **kw).plan
    assert free.offload == "opt:0.75" and free.zero_stage == 3
    assert free.predicted["iteration_time_s"] == pytest.approx(time["opt:0.75"])
    cfg = ds_config(free)
    validate(cfg, free)
    zo = cfg["zero_optimization"]
    assert zo["offload_optimizer"]["ratio"] == 0.75 and zo["sub_group_size"] * 20 >= 6.7e9 * 0.99


def test_fits_without_offload_offloads_nothing_and_bare_clusters_say_why(capsys):
    p = search("gpt3-1.3b", "8xa100-80gb", 512, wide=False).plan
    assert p.offload == "none" and p.predicted["offload"]["why"] == "fits and runs fastest without"
    assert "offload_optimizer" not in ds_config(p)["zero_optimization"]
    with pytest.raises(SpecError, match="no host figures.*missing host_memory_gb"):
        search("gpt3-1.3b", "64xa100-40gb", 512, wide=False, fix="offload=opt,zero=1")
    # a user's offload the plan does not make is removed from the merged config, by name
    cfg, changes = user_config(p, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert "offload_optimizer" not in cfg["zero_optimization"] and any("removed" in c for c in changes)


def test_activation_offload_is_costed_searched_and_emitted():
    """Activations on the host (DeepSpeed's cpu_checkpointing, the runtime's swap): the device
    drops what the blocks keep, the host holds it, the link time is paid; the search takes it
    where the link outruns recomputation (LLaMA-2 7B at 32k tokens with a 450 GB/s host link,
    GH200's NVLink-C2C) and recomputes instead over a DGX A100's PCIe (25 GB/s per GPU);
    ds_config's cpu_checkpointing passes DeepSpeed's parser; Megatron and pipelines refuse it."""
    m, c = load_model("llama2-7b"), load_cluster("1xa100-80gb")
    cm = CostModel(m, c, "bf16", "deepspeed", execution="deepspeed")
    cfg = dict(zero=2, micro_batch=1, num_microbatches=8, recompute="none")
    opt, act = (config_cost(cm, Config(offload=o, **cfg)) for o in ("opt", "opt+act"))
    tab = cm.tables([Strategy(1, 1, 2, offload=Offload.parse("opt"))], 1)
    kept = m.num_layers * sum(tab.f1[i, 0] for i, u in enumerate(cm.units) if u.kind == "block")   # 1 unit
    assert act.host - opt.host == pytest.approx(kept) and kept > 10 * GB
    assert opt.peak[0] - act.peak[0] > 0.9 * kept and act.time > opt.time
    kw = dict(wide=False, baselines=False, runtime="deepspeed", execution="deepspeed")
    fast = {**c.__dict__, "host_link_GBps": 450.0}
    p = search("llama2-7b", fast, 8, 32768, **kw).plan
    assert p.parallel.offload.activations and sum(p.recompute_per_stage) == 0
    assert p.predicted.iteration_time_s < search("llama2-7b", fast, 8, 32768, fix="offload=opt", **kw
                                                 ).plan.predicted.iteration_time_s
    pcie = search("llama2-7b", c, 8, 32768, **kw).plan
    assert not pcie.parallel.offload.activations and sum(pcie.recompute_per_stage) > 0
    ds = ds_config(p)
    assert validate(ds, p).activation_checkpointing_config.cpu_checkpointing is True
    assert "cpu_checkpointing" not in user_config(pcie, {})[0].get("activation_checkpointing", {})
    assert user_config(p, {})[0]["activation_checkpointing"]["cpu_checkpointing"] is True
    with pytest.raises(NotExpressible, match="activation offloading"):
        megatron_args(p)
    assert "without a pipeline" in ofl.check("deepspeed", 1, Offload.parse("act"), pp=2)
    with pytest.raises(SpecError, match="without a pipeline"):
        search("llama2-7b", load_cluster("8xa100-80gb"), 64, fix="offload=act,pp=2", **kw)


def test_megatron_offload_flags_and_refusal(tmp_path):
    """Megatron-LM's flags for the HybridDeviceOptimizer, accepted by Megatron-LM's own parser
    and argument checks (it asks for the precision-aware and the distributed optimizer beside
    them); a ZeRO-3 offload is DeepSpeed's only."""
    import os

    from harness.megatron_args import CLIENT, argcheck
    p = search("llama2-70b", "8xa100-80gb", 64, wide=False, runtime="megatron").plan
    assert p.zero_stage == 1 and p.parallel.offload.optimizer > 0
    a = megatron_args(p)
    assert "--optimizer-cpu-offload" in a and "--use-precision-aware-optimizer" in a
    assert f"--optimizer-offload-fraction {p.parallel.offload.optimizer:g}" in a
    if os.path.isdir(CLIENT):
        m = load_model("llama2-70b")
        flags = " ".join(a).split() + ["--mock-data", "--tokenizer-type", "NullTokenizer",
                                       "--vocab-size", str(m.vocab)]
        out = argcheck(tmp_path, [flags], 8)
        assert out[0]["ok"] and out[0]["dp"] == p.dp, out
    z3 = Plan(zero_stage=3, dp=8, offload="opt:0.5", global_batch_size=8)
    with pytest.raises(NotExpressible, match="Megatron offloads its distributed optimizer"):
        megatron_args(z3)


def test_cost_config_takes_offload(capsys):
    assert main(["cost", "--model", "llama2-7b", "--cluster", "1xa100-80gb", "--global-batch", "32",
                 "--config", "zero=2,offload=opt,recompute=full", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["yours"]["offload"] == "opt" and out["yours"]["zero_stage"] == 2
    assert out["yours"]["host_memory_gb_per_node"] > 100


# ---- the runtime: offload plans train in DeepSpeed (2 CPU ranks, one launch) ----
def test_offload_plans_train_like_deepspeeds_engine_and_resume_across_offload():
    """ZeRO-2 with the optimizer on the host, ZeRO-3 with half of it (Twin-Flow) and with the
    parameters too (ZeRO-Infinity) in DeepSpeed's plain engine, ZeRO-1 + offload in the pipeline
    engine (2 stages), activations on the host in either engine (a third of the layers recomputed): the losses of DeepSpeed's own engine under the same merged config, exactly;
    a ZeRO-1 pipeline checkpoint (ds_autoplan's) and a ZeRO-2 one (DeepSpeed's plain engine, its
    own) saved without offload resume with it and back, on the uninterrupted run's losses."""
    import os

    from ds_autoplan.runtime.launch import results
    worker = os.path.join(os.path.dirname(__file__), "ds_offload_worker.py")
    # the plain engine's cases before the first 2-stage pipeline: its grid stays DeepSpeed's
    # mpu (deepspeed.utils.groups), which a plain DeepSpeedEngine built later would read
    cases = ["zero2-opt", "zero3-ratio", "zero3-infinity", "zero2-opt-act", "zero1-act",
             "resume-zero2-off-on", "resume-zero2-on-off", "pipe-zero1-opt", "resume-off-on", "resume-on-off"]
    rows = results([worker, *cases], 2, timeout=400)
    assert sorted((r["case"], r["rank"]) for r in rows) == sorted((c, k) for c in cases for k in (0, 1))
    for r in rows:
        assert r["loss_err"] <= 1e-6, r
        if "zero" in r and r["case"] != "zero1-act":     # what DeepSpeed's engine was configured with
            assert r["optimizer"] == "DeepSpeedCPUAdam" and r["zero"][1] == "cpu", r
    got = {r["case"]: r for r in rows}
    assert got["zero3-ratio"]["zero"][2] == 0.5 and got["zero3-infinity"]["zero"][3] == "cpu"
    assert got["pipe-zero1-opt"]["engine"] == "AutoplanEngine"
    assert got["zero2-opt"]["engine"] == got["resume-zero2-on-off"]["engine"] == "DataParallelEngine"
    # activations on the host: the kept layers' saved tensors went there, in both engines
    assert got["zero2-opt-act"]["engine"] == "DataParallelEngine" and got["zero1-act"]["engine"] == "AutoplanEngine"
    assert all(got[k]["swapped_bytes"] > 0 for k in ("zero2-opt-act", "zero1-act"))
    assert got["zero2-opt"]["swapped_bytes"] == 0 and got["zero1-act"]["zero"][1] is None


def test_launch_takes_an_offload_restriction_and_refuses_a_bad_one(capsys, monkeypatch):
    import os
    worker = os.path.join(os.path.dirname(__file__), "ds_offload_worker.py")
    assert main(["launch", "--offload", "opt:2", "--num_gpus", "1", worker]) == 2
    assert "--offload: offloaded optimizer fraction must lie in [0, 1]" in capsys.readouterr().err
    monkeypatch.setenv("DS_AUTOPLAN_OFFLOAD", "gpu")
    assert main(["launch", "--num_gpus", "1", worker]) == 2
    assert "DS_AUTOPLAN_OFFLOAD: offload: unknown part 'gpu'" in capsys.readouterr().err
    # a model description planned before launch with the restriction (what --model does)
    from ds_autoplan.search import plan_model
    p = plan_model("gpt-tiny", "cpu-2", 8, fix={"offload": "opt"})
    assert p.offload == "opt" and p.zero_stage >= 1


def test_nvme_offload_needs_the_nodes_nvme_to_hold_the_states():
    """ZeRO-Infinity on NVMe: LLaMA 3 405B on one DGX A100 fits only with the states on NVMe
    (30 TB); the same node with a 1 TB drive cannot hold them and the search says it cannot fit."""
    p = search("llama3-405b", "8xa100-80gb", 8, wide=False, baselines=False).plan
    assert p.parallel.offload.device == "nvme" and p.zero_stage == 3
    small = {**load_cluster("8xa100-80gb").__dict__, "nvme_gb": 1000}
    with pytest.raises(SpecError, match="cannot fit"):
        search("llama3-405b", small, 8, wide=False, baselines=False)
    cm = CostModel(load_model("llama3-405b"), load_cluster(small), "bf16", "deepspeed", execution="deepspeed")
    assert not config_cost(cm, Config(zero=3, dp=8, offload="nvme:opt+param", micro_batch=1,
                                      num_microbatches=1, recompute="full")).fits


def test_launch_trains_an_offloaded_plan_of_an_unchanged_script(tmp_path):
    """``ds-autoplan launch --offload ...`` (2 gloo ranks) on an unchanged DeepSpeed pipeline
    script (ds_offload_worker.py --script): the plan offloads the optimizer (and the activations),
    DeepSpeed's engine runs with offload_optimizer on the host and cpu_checkpointing, and the
    activation offload leaves the losses of the same plan without it unchanged, exactly.  The
    optimizer-offload plan (ZeRO-2, no pipeline: DeepSpeed's plain engine) has the losses of
    DeepSpeed's own launch of the script under the merged config at ZeRO-1 (its pipeline
    engine asserts ZeRO < 2): the same batches in the same order, the same offloaded Adam."""
    import json
    import os
    import re
    import subprocess
    import sys

    from ds_autoplan.runtime.launch import free_port
    worker = os.path.join(os.path.dirname(__file__), "ds_offload_worker.py")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    runs = {}
    for off in ("opt", "opt+act"):
        out = subprocess.run([sys.executable, "-m", "ds_autoplan", "launch", "--offload", off, "--cluster", "cpu-2",
                              "--global-batch", "8", "--out", str(tmp_path / off), "--num_gpus", "2",
                              "--master_port", str(free_port()), worker, "--script"],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text
        assert Plan.load(tmp_path / off / "plan.json").offload == off
        ran = re.search(r"OFFLOAD_RAN (\d) (\S+) (\S+)", text).groups()
        assert ran[1] == "cpu" and ran[2] == str(off.endswith("act")), ran
        runs[off] = [float(x) for x in re.findall(r"OFFLOAD_LOSS \d+ (\S+)", text)]
    assert len(runs["opt"]) == 3 and runs["opt+act"] == runs["opt"], runs
    cfg = json.loads((tmp_path / "opt" / "ds_config.autoplan.json").read_text())
    assert cfg["zero_optimization"]["stage"] == 2, cfg
    cfg["zero_optimization"]["stage"] = 1
    (tmp_path / "zero1.json").write_text(json.dumps(cfg))
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
                          "--master_port", str(free_port()), worker, "--script", "--config", "zero1.json"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert re.search(r"OFFLOAD_RAN (\d) (\S+)", text).groups() == ("1", "cpu"), text
    ref = [float(x) for x in re.findall(r"OFFLOAD_LOSS \d+ (\S+)", text)]
    assert len(ref) == 3 and max(abs(a - b) / abs(b) for a, b in zip(runs["opt"], ref)) <= 1e-6, (runs, ref)


def test_the_example_trains_an_offloaded_plan_made_before_launch(tmp_path):
    """docs/offload.md's user path with the example script: ``ds-autoplan launch --model gpt-tiny
    --offload opt`` plans ZeRO-2 + optimizer offload without a pipeline (DeepSpeed's plain engine)
    and examples/train_deepspeed.py trains it on 2 gloo ranks, reading ``engine.grid`` as it does
    under a pipeline plan (the plain engine had none: AttributeError on every rank)."""
    import os
    import re
    import subprocess
    import sys

    from ds_autoplan.runtime.launch import free_port
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "ds_autoplan", "launch", "--model", "gpt-tiny",
                          "--cluster", "cpu-2", "--offload", "opt", "--out", str(tmp_path / "o"),
                          "--num_gpus", "2", "--master_port", str(free_port()),
                          os.path.join(root, "examples", "train_deepspeed.py"), "--steps", "3"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    plan = Plan.load(tmp_path / "o" / "plan.json")
    assert (plan.pp, plan.dp, plan.zero_stage, plan.offload) == (1, 2, 2, "opt"), plan.to_dict()
    losses = [float(x) for x in re.findall(r"step \d+ loss (\S+)", text)]
    assert len(losses) == 3 and losses[-1] < losses[0], text
