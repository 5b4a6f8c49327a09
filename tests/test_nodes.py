"""Planning the machine you are on (issue 27): GPU kinds from the names and memory devices
report, ``nvidia-smi`` output, the nodes of a launch (DeepSpeed's resource parsing, every
rank's facts), ``--cluster auto``, and a plan launched across two nodes on one machine.

The recorded ``nvidia-smi`` output: tests/harness/recorded_smi.py.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time

import pytest
from harness.recorded_smi import RECORDED, TOPO_H200, TOPO_PCIE, UNKNOWN

from ds_autoplan.spec import ClusterSpec, SpecError, load_cluster
from ds_autoplan.spec.devices import (Device, check_homogeneous, gpu_cluster, kind_of, parse_smi,
                                      parse_topo, same_devices)

@pytest.mark.parametrize("line,kind,mem", RECORDED, ids=[r[1] + "-" + r[0].split(",")[0][-12:] for r in RECORDED])
def test_recorded_devices_map_to_their_kind_and_memory(line, kind, mem):
    (dev,) = parse_smi(line)
    assert dev.memory_gib == pytest.approx(mem, abs=0.01)
    assert kind_of(dev.name, dev.memory_gib) == kind


@pytest.mark.parametrize("line", UNKNOWN)
def test_unknown_devices_have_no_kind(line):
    (dev,) = parse_smi(line)
    assert kind_of(dev.name, dev.memory_gib) is None


def test_every_kind_in_gpus_yaml_has_a_recorded_name():
    from ds_autoplan.cost.compute import gpu_kinds
    from ds_autoplan.spec.cluster import gpu_table
    gpu_kinds()                      # every kind still builds its compute model
    recorded = {k for _, k, _ in RECORDED}
    for key, row in gpu_table().items():
        assert row.get("smi") and row.get("memory_gib") and row.get("form") in ("sxm", "pcie"), key
        assert key in recorded, key


@pytest.mark.parametrize("text,n", [
    ("name, memory.total [MiB]\nNVIDIA H100 80GB HBM3, 81559 MiB\nNVIDIA H100 80GB HBM3, 81559 MiB\n", 2),
    ("index, name, memory.total [MiB]\n0, NVIDIA H200, 143771 MiB\n1, NVIDIA H200, 143771 MiB\n", 2),
    ("index, name, memory.total [MiB], driver_version, power.limit [W], pstate\n"
     "0, NVIDIA H200, 143771 MiB, 570.211.01, 700.00 W, P0\n", 1),
    ("NVIDIA A10G, 23028 MiB\nNVIDIA A10G, 23028 MiB\nNVIDIA A10G, 23028 MiB\nNVIDIA A10G, 23028 MiB\n", 4),
    ("0, NVIDIA A10G, 23028 MiB, 22515 MiB\n", 1),                        # noheader, index first
    ("name, memory.total [MiB]\nNVIDIA A10G, 23028\n", 1),                   # nounits
    ("NVIDIA A10G, 23028\n", 1),                                             # noheader,nounits
])
def test_smi_formats(text, n):
    devs = parse_smi(text)
    assert len(devs) == n and all(not d.mig for d in devs)
    assert kind_of(devs[0].name, devs[0].memory_gib) is not None


def test_mig_devices_are_refused_by_name():
    on = parse_smi("index, name, memory.total [MiB], mig.mode.current\n"
                   "0, NVIDIA A100-SXM4-40GB, 40960 MiB, Enabled\n1, NVIDIA A100-SXM4-40GB, 40960 MiB, Enabled\n")
    slice_ = parse_smi("NVIDIA A100-SXM4-40GB MIG 3g.20gb, 19968 MiB\n")
    for devs in (on, slice_):
        assert devs[0].mig
        with pytest.raises(SpecError, match="MIG") as e:
            same_devices(devs, "smi.csv")
        assert "NVIDIA A100-SXM4-40GB" in str(e.value)


def test_mixed_and_unreadable_smi_output_is_refused():
    with pytest.raises(SpecError, match=r"GPU 1 is NVIDIA RTX A6000"):
        same_devices(parse_smi("NVIDIA A100-SXM4-80GB, 81920 MiB\nNVIDIA RTX A6000, 49140 MiB\n"), "x")
    for bad in ("", "NVIDIA A100-SXM4-80GB\n", "NVIDIA A100-SXM4-80GB, [N/A]\n", "NVIDIA A100, 80 TB\n"):
        with pytest.raises(SpecError):
            parse_smi(bad, "smi.csv")


def test_topo_matrices():
    t = parse_topo(TOPO_H200)
    assert t.gpus == 8 and t.nvlink and t.links[0][1] == "NV18"
    t = parse_topo(TOPO_PCIE)
    assert t.gpus == 4 and not t.nvlink and t.links[0][2] == "SYS"
    with pytest.raises(SpecError, match="GPU0"):
        parse_topo("name, memory.total\n")


def test_from_smi_cluster_yaml_plans(tmp_path, capsys):
    """``cluster --from-smi --topo --nodes`` writes a YAML that ``plan --cluster`` reads; NVLink
    nodes get the kind's NVLink figure, a PCIe host its PCIe figure."""
    from ds_autoplan.cli import main
    (tmp_path / "smi.csv").write_text("name, memory.total [MiB]\n" + "NVIDIA H200, 143771 MiB\n" * 8)
    (tmp_path / "topo.txt").write_text(TOPO_H200)
    out = tmp_path / "c.yaml"
    assert main(["cluster", "--from-smi", str(tmp_path / "smi.csv"), "--topo", str(tmp_path / "topo.txt"),
                 "--nodes", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "datasheet" in printed and "measured" in printed and "inter-node bandwidth not measured" in printed
    c = load_cluster(str(out))
    assert (c.num_nodes, c.gpus_per_node, c.gpu, c.intra_node_GBps) == (4, 8, "h200-141gb", 360)
    assert c.memory_gb == pytest.approx(140.4, abs=0.01)
    assert main(["plan", "--model", "llama2-7b", "--cluster", str(out), "--global-batch", "128", "--json",
                 "--no-wide", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pp"] >= 1
    (tmp_path / "pcie.csv").write_text("NVIDIA L40S, 46068 MiB\n" * 4)
    (tmp_path / "pcie.txt").write_text(TOPO_PCIE)
    assert main(["cluster", "--from-smi", str(tmp_path / "pcie.csv"), "--topo", str(tmp_path / "pcie.txt"),
                 "--out", str(out)]) == 0
    assert load_cluster(str(out)).intra_node_GBps == 25


@pytest.mark.parametrize("text,err", [
    ("NVIDIA RTX A6000, 49140 MiB\n", "unknown GPU NVIDIA RTX A6000"),
    ("NVIDIA A100-SXM4-40GB MIG 3g.20gb, 19968 MiB\n", "MIG device"),
])
def test_from_smi_refuses_unknown_and_mig_devices(tmp_path, capsys, text, err):
    from ds_autoplan.cli import main
    (tmp_path / "smi.csv").write_text(text)
    assert main(["cluster", "--from-smi", str(tmp_path / "smi.csv")]) == 2
    msg = capsys.readouterr().err.strip()
    assert err in msg and len(msg.splitlines()) == 1


def test_unknown_device_is_measured_and_said_so():
    dev = Device("NVIDIA RTX A6000", 48.0)
    fields, figures, notes = gpu_cluster(dev, 1, 4, measured={"peak_tflops": 120.0, "intra_node_GBps": 20.0})
    c = ClusterSpec.from_dict(fields)
    assert c.gpu is None and c.peak_tflops == 120.0 and c.compute_efficiency == 1.0
    assert any("measured by a short matmul" in n for n in notes)
    with pytest.raises(SpecError, match="nothing measured"):
        gpu_cluster(dev, 1, 4)


# -- the nodes of a launch -------------------------------------------------------------------------
def _facts(per_node, device="NVIDIA H100 80GB HBM3", mem=79.65):
    out, rank = [], 0
    for node, (n, dev) in enumerate(per_node):
        for _ in range(n):
            out.append({"rank": rank, "node": node, "host": f"h{node}", "device": dev or device,
                        "memory_gib": mem, "host_memory_gb": 2000.0, "cpu_cores": 96})
            rank += 1
    return out


def test_mixed_nodes_are_refused_naming_the_odd_node():
    assert len(check_homogeneous(_facts([(8, None)] * 3))) == 3
    with pytest.raises(SpecError, match=r"node 1 \(h1, ranks 8-11\): 4 x"):
        check_homogeneous(_facts([(8, None), (4, None), (8, None)]))
    with pytest.raises(SpecError, match=r"node 2 \(h2, ranks 16-23\): 8 x NVIDIA A100-SXM4-80GB"):
        check_homogeneous(_facts([(8, None), (8, None), (8, "NVIDIA A100-SXM4-80GB")]))


def test_gpu_ranks_plan_on_their_kind():
    """What ``--cluster auto`` makes of GPU ranks' facts at ``deepspeed.initialize`` (it refused
    on GPUs before: "give the cluster to plan for"): their kind's figures, the launch's nodes."""
    from ds_autoplan.profile.detect import cluster_from_facts
    from ds_autoplan.search import plan_model
    fields, _, notes = cluster_from_facts(_facts([(8, None), (8, None)]))
    c = ClusterSpec.from_dict(fields)
    assert (c.num_nodes, c.gpus_per_node, c.gpu, c.intra_node_GBps) == (2, 8, "h100-sxm-80gb", 360)
    assert (c.host_memory_gb, c.cpu_cores) == (2000.0, 96)
    assert any("inter-node bandwidth not measured" in n for n in notes)
    assert plan_model("llama2-7b", c, 64).world == 16


def test_hostfile_nodes_and_slots(tmp_path):
    """Nodes and slots from DeepSpeed's own resource parsing (hostfile, --include/--exclude,
    --num_nodes/--num_gpus); nodes of different slots refused naming the odd one."""
    from deepspeed.launcher import runner

    from ds_autoplan.cli import UserError
    from ds_autoplan.cli.launch_cmd import launch_resources
    hosts = tmp_path / "hostfile"
    hosts.write_text("worker-0 slots=8\nworker-1 slots=8\nworker-2 slots=4\n")

    def resources(*argv):
        return launch_resources(runner.parse_args(["--hostfile", str(hosts), *argv, "train.py"]))
    r = resources("--exclude", "worker-2")
    assert {h: len(s) for h, s in r.items()} == {"worker-0": 8, "worker-1": 8}
    assert {h: len(s) for h, s in resources("--num_nodes", "2", "--num_gpus", "4").items()} == \
        {"worker-0": 4, "worker-1": 4}
    assert {h: len(s) for h, s in resources("--include", "worker-1:0,1@worker-2:0,1").items()} == \
        {"worker-1": 2, "worker-2": 2}
    with pytest.raises(UserError, match="node worker-2 has 4 slots, the other nodes 8"):
        resources()


def test_auto_uses_slurm_allocation(monkeypatch):
    from ds_autoplan.cli.cluster_cmd import layout
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "4")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    assert layout() == (4, 8)
    assert layout(nodes=2, world=8) == (2, 8)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    assert layout(world=16) == (4, 4)


def test_node_layout_conflicts():
    from ds_autoplan.plan import Plan
    two = Plan(pp=2, dp=2, micro_batch_size=1, num_microbatches=4, layers_per_stage=[2, 2],
               recompute_per_stage=[0.0, 0.0], world_size=4, gpus_per_node=2)
    assert two.layout_conflict(2, 2) is None and two.layout_conflict(1, 4) is None
    assert "data-parallel group of 2 ranks spans 2 nodes" in two.layout_conflict(4, 1)
    one = Plan(**{**two.to_dict(), "gpus_per_node": 4})
    assert "pipeline sends cross nodes" in one.layout_conflict(2, 2)
    assert Plan(**{**two.to_dict(), "gpus_per_node": 0}).layout_conflict(4, 1) is None   # older plan file


def test_cpu_auto_plans_as_cpu_n_where_the_figures_agree():
    """The measured CPU cluster with cpu-2's figures is cpu-2: the same plan."""
    from ds_autoplan.profile.detect import cpu_cluster
    from ds_autoplan.search import plan_model
    ref = load_cluster("cpu-2")
    fields, _, _ = cpu_cluster(1, 2, {"host_memory_gb": ref.memory_gb * 2, "cpu_cores": ref.cpu_cores},
                               {"peak_tflops": ref.flops / 1e12, "intra_node_GBps": ref.intra_node_GBps,
                                "intra_latency_us": ref.intra_latency_us, "inter_latency_us": ref.inter_latency_us,
                                "host_link_GBps": ref.host_link_GBps,
                                "cpu_adam_rate_per_core": ref.cpu_adam_rate_per_core})
    auto = ClusterSpec.from_dict({**fields, "host_memory_gb": ref.host_memory_gb})
    a, b = (plan_model("gpt-tiny", c, 8).to_dict() for c in (auto, ref))
    for k in ("iteration_time_s", "peak_memory_gb_per_stage"):      # (MFU: over another peak)
        assert a["predicted"][k] == b["predicted"][k]
    for d in (a, b):
        del d["cluster"], d["predicted"]
    assert a == b


# -- two nodes on one machine ----------------------------------------------------------------------
HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULES = ("1f1b", "v-half")


def _node_launchers(job: str, port: int, log_dir) -> list:
    """Two DeepSpeed node launchers, as DeepSpeed's multi-node runner starts them on each
    host (``deepspeed.launcher.launch --node_rank N --world_info ...``), of 2 CPU ranks each."""
    from harness import ENV
    info = base64.urlsafe_b64encode(json.dumps({"node0": [0, 1], "node1": [0, 1]}).encode()).decode()
    env = dict(os.environ, **ENV, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = []
    for node in range(2):
        log = open(os.path.join(log_dir, f"node{node}.log"), "w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "deepspeed.launcher.launch", f"--node_rank={node}", f"--world_info={info}",
             "--master_addr=127.0.0.1", f"--master_port={port}", "--no_local_rank", "--module",
             "harness.forked", job], env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """One world of 2 nodes x 2 CPU ranks formed by two DeepSpeed node launchers: the hook plans
    the script's layers for it (``--cluster auto``) with 1F1B and with V-Half (forked cases,
    harness.forked), and a plan made for one node of 4 is run there; then one single-node launch
    of 4 ranks trains each two-node plan.  Rows per (run, schedule)."""
    from harness import ENV
    from harness import forked

    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime import launch
    tmp = tmp_path_factory.mktemp("nodes")
    one_node = Plan(pp=2, dp=2, micro_batch_size=1, num_microbatches=4, global_batch_size=8, precision="fp32",
                    layers_per_stage=[2, 2], recompute_per_stage=[0.0, 0.0], world_size=4, gpus_per_node=4,
                    cluster="1 node x 4")
    one_node.save(tmp / "one-node.json")
    cases = [{"name": s, "fn": "harness.ds_nodes:train",
              "options": {"pp": 2, "schedules": [s], "out": str(tmp / s), "global_batch": 8}} for s in SCHEDULES]
    cases.append({"name": "one-node-plan", "fn": "harness.ds_nodes:train",
                  "options": {"plan": str(tmp / "one-node.json"), "out": str(tmp / "refused")}})
    cases.append({"name": "cluster", "fn": "harness.ds_nodes:cluster_cmd", "out": str(tmp / "cluster.yaml")})
    job = str(tmp / "job.json")
    with open(job, "w") as f:
        json.dump({"warm": forked.DEEPSPEED, "forked": cases, "then": str(tmp / "then.json")}, f)
    launch.prebuild_ops({**os.environ, **ENV})
    procs = _node_launchers(job, launch.free_port(), tmp)
    deadline = time.time() + 600
    while not all(os.path.exists(f"{job}.done{r}") for r in range(4)) and time.time() < deadline \
            and all(p.poll() is None for p, _ in procs):
        time.sleep(0.2)
    (tmp / "then.json").write_text("[]")
    for p, log in procs:
        try:
            p.wait(timeout=max(10, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
    logs = [(p.returncode, (tmp / f"node{i}.log").read_text()) for i, (p, _) in enumerate(procs)]
    assert all(rc == 0 for rc, _ in logs), "\n".join(out for _, out in logs)
    rows = forked.rows(logs)
    refs = [{"fn": "harness.ds_nodes:train", "schedule": s,
             "options": {"plan": str(tmp / s / "plan.json"), "out": str(tmp / f"ref-{s}")}}
            for s in SCHEDULES if (tmp / s / "plan.json").exists()]
    one = launch.launch(4, refs, timeout=600, env=ENV) if refs else [[]] * 4
    return tmp, rows, [[{**r, "schedule": c["schedule"]} for r, c in zip(rank_rows, refs)] for rank_rows in one]


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_node_plan_trains_and_equals_the_single_node_run(two_nodes, schedule):
    from ds_autoplan.plan import Plan
    tmp, rows, single = two_nodes
    plan = Plan.load(tmp / schedule / "plan.json")
    assert (plan.world_size, plan.gpus_per_node, plan.pp, plan.dp) == (4, 2, 2, 2), plan
    assert plan.cluster == "cpu-auto-2x2" and plan.schedule == schedule
    two = [r for r in rows if r.get("forked") == schedule and "losses" in r]
    assert sorted(r["rank"] for r in two) == [0, 1, 2, 3], rows
    one = [r for rank_rows in single for r in rank_rows if r["schedule"] == schedule]
    assert sorted(r["rank"] for r in one) == [0, 1, 2, 3]
    ours = next(r["losses"] for r in two if r["rank"] == 0)
    ref = next(r["losses"] for r in one if r["rank"] == 0)
    assert len(ours) == 3 and ours[-1] < ours[0]
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= 1e-6, (ours, ref)


@pytest.mark.multiproc
def test_plan_for_one_node_refused_on_two(two_nodes):
    _, rows, _ = two_nodes
    ends = [r for r in rows if r.get("forked") == "one-node-plan" and "exit" in r]
    assert ends and all(r["exit"] != 0 for r in ends), ends
    out = open(ends[0]["out"]).read()
    assert "does not fit this launch of 2 nodes x 2 ranks" in out and "plan it for this launch" in out, out


@pytest.mark.multiproc
def test_cluster_command_under_a_two_node_launch(two_nodes):
    """``ds-autoplan cluster`` run by every rank of the 2-node launch: the nodes and ranks per
    node are the launch's, the links inside a node and between them measured."""
    import yaml
    tmp, rows, _ = two_nodes
    assert sorted(r["rank"] for r in rows if r.get("forked") == "cluster" and r.get("rc") == 0) == [0, 1, 2, 3], rows
    doc = yaml.safe_load((tmp / "cluster.yaml").read_text())
    c = load_cluster(str(tmp / "cluster.yaml"))
    assert (c.num_nodes, c.gpus_per_node, c.name) == (2, 2, "cpu-auto-2x2")
    figures = doc["detected"]["figures"]
    for k in ("intra_node_GBps", "nic_GBps", "inter_node_GBps", "peak_tflops"):
        assert figures[k]["measured"] > 0, figures
    assert c.nic_GBps == figures["nic_GBps"]["measured"] and c.inter_node_GBps == 2 * c.nic_GBps


def test_planning_at_initialize_leaves_the_scripts_random_generators_alone(tmp_path, monkeypatch):
    """Rank 0 plans inside ``deepspeed.initialize`` (layers profiled, dropout included; a CPU
    device measured): the script's torch generator continues as if it had not planned, so its
    dropout draws are DeepSpeed's own engine's (seen as losses off DeepSpeed's from step 0
    when a partition put a dropout layer on rank 0)."""
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    from ds_autoplan.clients import deepspeed_hook
    from ds_autoplan.models.tiny_gpt import gpt_loss, gpt_tiny
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)     # one rank, as a launcher sets it
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    init_distributed()            # DeepSpeed's comm on this process group
    try:
        model = gpt_tiny(vocab_size=32, hidden=16, num_layers=2, num_heads=2, seq_len=8, seed=0)
        module = PipelineModule(layers=[*model.layers()[:-1], torch.nn.Dropout(0.5), model.layers()[-1]],
                                loss_fn=gpt_loss, num_stages=1)
        data = [(torch.randint(0, 32, (8,)), torch.randint(0, 32, (8,))) for _ in range(4)]
        deepspeed_hook.install({"out": str(tmp_path / "out")})
        before = torch.get_rng_state()
        plan = deepspeed_hook._shared_plan(module, {"train_batch_size": 4}, data, None)
        assert plan.world_size == 1 and plan.cluster == "cpu-auto-1x1"
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        dist.destroy_process_group()
