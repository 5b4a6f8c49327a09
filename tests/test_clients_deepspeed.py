"""`deepspeed --autoplan` / `ds-autoplan launch` on DeepSpeedExamples' unchanged
pipeline_parallelism/train.py (AlexNet as a PipelineModule; copied from ../shared/clients to a
temporary folder), 2 CPU ranks.  Test-side only: tests/deepspeedexamples_shim (torchvision
stand-in with random CIFAR-like tensors, ``torch.cuda.set_device`` neutralised, loss lines).

The plan is for AlexNet's 22 layers (profiled in the ranks); the script's ds_config.json keeps
its optimizer and logging, only parallel/batch/schedule keys change (reported); 1F1B losses
equal DeepSpeed's own engine (TrainSchedule) run with the same config and partition; V-ZB
trains; a script that passes a plain module (its -p 0 path) is planned for DeepSpeed's own
engine and trains as by hand with the config it wrote.

The module's launches start at set-up and run in the background, two 2-rank launches at a time
(a 4-rank one alone; tests/harness/background.py), with DeepSpeed's launcher patched for the
whole module; each test reads its launch's outcome."""
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from ds_autoplan.cli import patch_cmd  # noqa: E402
from harness import CLIENTS_SKIP, TESTS, clients_dir  # noqa: E402
from harness.background import Launches, wanted  # noqa: E402
from ds_autoplan.runtime.launch import free_port  # noqa: E402
from ds_autoplan.runtime.deepspeed.shm import leftovers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLIENT = (clients_dir() or ROOT.parent / "shared" / "clients") / "deepspeedexamples-pipeline_parallelism" \
    / "training" / "pipeline_parallelism"
SHIM = Path(__file__).with_name("deepspeedexamples_shim")
BIN = Path(sys.executable).parent
# the script's AlexNet layers as a launch of it measured them on a CPU rank (AMD EPYC, 1 thread,
# torch 2.13.0, micro-batch 8): the unrestricted launches plan from these figures
PROFILE = Path(__file__).with_name("data") / "alexnet_pipeline_profile.json"
ARGS = ["--deepspeed_config=ds_config.json", "-p", "2", "--steps=2", "--backend", "gloo"]   # the README's
ALEXNET = ["Conv2d", "ReLU", "MaxPool2d", "Conv2d", "ReLU", "MaxPool2d", "Conv2d", "ReLU", "Conv2d",
           "ReLU", "Conv2d", "ReLU", "MaxPool2d", "AdaptiveAvgPool2d", "<lambda>", "Dropout", "Linear",
           "ReLU", "Dropout", "Linear", "ReLU", "Linear"]

# a test waits for its launch behind the ones started before it (fixture launches): beyond the
# 300 s per test of pyproject.toml on a loaded machine; each launch has its own timeout
pytestmark = [pytest.mark.skipif(not CLIENT.is_dir(), reason=f"{CLIENTS_SKIP} ({CLIENT} not found)"),
              pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # the script's "Adam" loads DeepSpeed's JIT-built fused_adam op: built once per session,
    # before any test's clock (conftest.py)
    d = tmp_path_factory.mktemp("pipeline_parallelism")
    for f in CLIENT.iterdir():
        shutil.copy(f, d / f.name)
        os.chmod(d / f.name, 0o644)
    return d


def _env(**kw):
    path = os.pathsep.join([str(SHIM), str(ROOT), TESTS, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=path, **kw)


def _run(cmd, cwd, env, timeout=600):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    return r.returncode, out, [float(ln.split()[1]) for ln in out.splitlines() if ln.startswith("SHIM_LOSS ")]


def _readme_commands() -> dict:
    """The README's "Train with DeepSpeed" lines that train the example: {launcher: (env, argv)},
    with a free --master_port added."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Train with DeepSpeed\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        toks = shlex.split(line) if line.startswith("    ") else []
        if "train.py" not in toks:
            continue
        env = dict(t.split("=", 1) for t in toks if re.match(r"^[A-Z_]+=", t))
        argv = [t for t in toks if not re.match(r"^[A-Z_]+=", t)]
        at = argv.index("--num_gpus") + 2
        argv[at:at] = ["--master_port", str(free_port())]
        key = argv[0]
        argv[:1] = [str(BIN / "deepspeed")] if key == "deepspeed" else [sys.executable, "-m", "ds_autoplan"]
        out[key] = (env, argv)
    assert set(out) == {"deepspeed", "ds-autoplan"}, section
    return out


def _readme_run(launcher: str, client: Path):
    env, argv = _readme_commands()[launcher]          # its port chosen now
    return _run(argv, client, _env(**env))


@pytest.fixture(scope="module")
def patched_runner():
    """``deepspeed --autoplan`` for the module's launches: DeepSpeed's launcher patched before
    the first, then restored byte for byte (asserted) after the last."""
    path = Path(patch_cmd.runner_file()[0])
    before = path.read_bytes()
    try:
        if patch_cmd.MARK not in before.decode():
            path.write_text(patch_cmd.patched(before.decode()))
        yield
    finally:
        path.write_bytes(before)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(before).digest()


def _own_leftovers(port: int, before: set) -> set:
    """The /dev/shm files of the launch on ``port`` that no live process maps (not in
    ``before``); DeepSpeed's CPU allreduce op names each file by the launch's master port."""
    return {n for n in set(leftovers()) - before if n.split("_")[-2] == str(port)}


@pytest.fixture(scope="module")
def launches(client, patched_runner, tmp_path_factory, request):
    """The module's launches that its selected tests read (their ``launches`` marks), started
    here (harness.background, 4 ranks at a time: two 2-rank launches side by side, a 4-rank one
    alone; in the order the tests read them, the one 2-rank launch without a partner the
    lightest, a refusal).

    ``"1f1b"``: the README's ``deepspeed --autoplan`` line; ``"v-zb"``: its ``ds-autoplan
    launch`` line; ``(form, world)``: the unrestricted runs (:func:`_unrestricted`: rc,
    output, losses, the /dev/shm files the launch left); ``"references"``: DeepSpeed's own
    engines on the unchanged script, one run after the other in the ranks of one 2-rank
    ``deepspeed`` launch (deepspeedexamples_shim/shim_runs.py): the pipeline engine with one
    stage (-p 1) under the unrestricted 2-rank plan's merged config at ZeRO-1, then with two
    (TrainSchedule) under the 1F1B plan's merged config and cut (``train_batch`` losses),
    ``{"zero2": (rc, out, per-step losses), "1f1b": (...)}``; the
    refusal of a pipeline without example input; ``"plain-module"`` and ``"plain-module-by-hand"``:
    the -p 0 path planned, then by hand with the config it wrote."""
    nodata = tmp_path_factory.mktemp("nodata")
    (nodata / "train_nodata.py").write_text(NO_DATA_SCRIPT)
    jobs = Launches(ranks=4)
    jobs.add("1f1b", 2, lambda: _readme_run("deepspeed", client))
    jobs.add(("deepspeed", 2), 2, lambda: _unrestricted("deepspeed", 2, client))
    jobs.add("references", 2, lambda: _references(client, jobs.result("1f1b"), jobs.result(("deepspeed", 2))),
             after=["1f1b", ("deepspeed", 2)])
    jobs.add("v-zb", 2, lambda: _readme_run("ds-autoplan", client))
    jobs.add(("launch", 2), 2, lambda: _unrestricted("launch", 2, client))
    # -p 0: the script's non-pipelined path (deepspeed.initialize(model=AlexNet(...))), planned,
    # then by hand in DeepSpeed's own launcher with the config the planned run wrote
    jobs.add("plain-module", 2, lambda: _run(_launcher("--out", "out-base", args=[
        "--deepspeed_config=ds_config.json", "-p", "0", "--steps=2", "--backend", "gloo"]), client, _env(),
        timeout=300))
    jobs.add("plain-module-by-hand", 2, lambda: _run(
        [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
         "--deepspeed_config=out-base/ds_config.autoplan.json", "-p", "0", "--steps=2", "--backend", "gloo"],
        client, _env(), timeout=300), after=["plain-module"])
    jobs.add("no-example-input", 2, lambda: _run(
        [sys.executable, "-m", "ds_autoplan", "launch", "--num_gpus", "2", "--master_port", str(free_port()),
         "train_nodata.py"], nodata, _env(), timeout=300))
    jobs.add(("launch", 4), 4, lambda: _unrestricted("launch", 4, client))
    jobs.add(("deepspeed", 4), 4, lambda: _unrestricted("deepspeed", 4, client))
    jobs.start(wanted(request))
    try:
        yield jobs
    finally:
        jobs.close()


@pytest.mark.launches("1f1b")
def test_plan_is_for_the_scripts_alexnet_and_keeps_its_config(client, launches):
    rc, out, losses = launches.result("1f1b")
    assert rc == 0, out
    assert len(losses) == 2, out
    plan = json.loads((client / "ds_autoplan_out" / "plan.json").read_text())
    assert plan["model"] == "train.py:PipelineModule" and plan["pp"] == 2 and plan["schedule"] == "1f1b"
    assert sum(plan["layers_per_stage"]) == 22
    # no cluster named: the launch's, detected (--cluster auto): one node of 2 CPU ranks, measured
    assert (plan["cluster"], plan["gpus_per_node"]) == ("cpu-auto-1x2", 2), plan
    assert "ds-autoplan: cluster auto: CPU: each of the 2 ranks of a node is a device" in out
    assert plan["notes"][-1] == "profiled layers: " + ", ".join(f"{i}:{n}" for i, n in enumerate(ALEXNET))
    prof = json.loads((client / "ds_autoplan_out" / "profile.json").read_text())
    assert [u["params"] for u in prof["units"] if u["params"]] == [
        23296, 307392, 663936, 884992, 590080, 37752832, 16781312, 40970]       # AlexNet(num_classes=10)
    user = json.loads((CLIENT / "ds_config.json").read_text())
    cfg = json.loads((client / "ds_autoplan_out" / "ds_config.autoplan.json").read_text())
    for k in ("optimizer", "steps_per_print", "wall_clock_breakdown"):
        assert cfg[k] == user[k], k
    assert "gradient_clipping" not in cfg and "bf16" not in cfg and "fp16" not in cfg
    assert cfg["train_batch_size"] == 32 == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    assert "ds-autoplan: ds_config train_batch_size: 256 -> 32" in out
    mbs = cfg["train_micro_batch_size_per_gpu"]
    assert mbs == 8 or f"ds-autoplan: ds_config train_micro_batch_size_per_gpu: 8 -> {mbs}" in out


@pytest.mark.launches("1f1b", "references")
def test_1f1b_losses_equal_deepspeeds_own_engine(client, launches):
    """DeepSpeed's PipelineEngine (TrainSchedule) on the unchanged script, with the merged
    config and the plan's cut (same dropout draws per rank): the same losses."""
    rc, out, ours = launches.result("1f1b")
    assert rc == 0, out
    plan = json.loads((client / "ds_autoplan_out" / "plan.json").read_text())
    rc, out, ref = launches.result("references")["1f1b"]
    assert rc == 0, out
    assert len(ref) == len(ours) == 2
    err = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
    print(json.dumps({"test": "alexnet_1f1b_vs_deepspeed", "ours": ours, "deepspeed": ref, "rel_err": err,
                      "layers_per_stage": plan["layers_per_stage"]}))
    assert err <= 1e-6, (ours, ref)


@pytest.mark.launches("v-zb")
def test_v_zb_trains_through_ds_autoplan_launch(client, launches):
    rc, out, losses = launches.result("v-zb")
    assert rc == 0, out
    plan = json.loads((client / "out-vzb" / "plan.json").read_text())
    assert plan["schedule"] == "v-zb" and len(plan["layers_per_stage"]) == 4
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


# -- no restriction: the planner chooses, whatever engine runs it -------------------------------
def _unrestricted(form: str, world: int, client: Path):
    """The README's example without --pp / --schedules (DS_AUTOPLAN_PP, _SCHEDULES): ``form``
    'deepspeed' (``deepspeed --autoplan``, options from the environment) or 'launch'
    (``ds-autoplan launch``, flags); global batch 32 keeps the CPU run short.  The cluster is
    the ``cpu-<world>`` preset, whose figures do not move with the machine's load (a measured
    one does: the planner's free choice, which the test checks, would too).  Plan and config
    under ``out-{form}-{world}``; (rc, output, losses, the /dev/shm files the launch left).
    The layers' times are :data:`PROFILE`'s (``--profile`` / ``DS_AUTOPLAN_PROFILE``), not
    measured again: a profile taken on two loaded cores once moved the choice to pp=2 (0.409 s
    against pp=1's 0.423 s), where a quiet one has pp=1 1.5x faster."""
    port, out = free_port(), f"out-{form}-{world}"
    before = set(leftovers())
    if form == "deepspeed":
        argv = [str(BIN / "deepspeed"), "--autoplan", "--num_gpus", str(world), "--master_port", str(port),
                "train.py", *ARGS]
        res = _run(argv, client, _env(DS_AUTOPLAN_GLOBAL_BATCH="32", DS_AUTOPLAN_OUT=out,
                                      DS_AUTOPLAN_CLUSTER=f"cpu-{world}", DS_AUTOPLAN_PROFILE=str(PROFILE)))
    else:
        argv = [sys.executable, "-m", "ds_autoplan", "launch", "--global-batch", "32", "--out", out,
                "--cluster", f"cpu-{world}", "--profile", str(PROFILE), "--num_gpus", str(world),
                "--master_port", str(port), "train.py", *ARGS]
        res = _run(argv, client, _env())
    return (*res, _own_leftovers(port, before))


def _references(client: Path, pipe_run, zero2_run) -> dict:
    """See :func:`launches` ("references")."""
    assert pipe_run[0] == 0, pipe_run[1]
    assert zero2_run[0] == 0, zero2_run[1]
    plan = json.loads((client / "ds_autoplan_out" / "plan.json").read_text())
    cuts = [0, plan["layers_per_stage"][0], 22]
    # the unrestricted plan's merged config at ZeRO-1: DeepSpeed's PipelineEngine asserts ZeRO < 2
    zero1 = json.loads((client / "out-deepspeed-2" / "ds_config.autoplan.json").read_text())
    assert zero1["zero_optimization"]["stage"] >= 2, zero1
    zero1["zero_optimization"]["stage"] = 1
    (client / "ds_config.zero1.json").write_text(json.dumps(zero1))
    pipe = client / "ds_autoplan_out" / "ds_config.autoplan.json"
    runs = [["--deepspeed_config=ds_config.zero1.json", "-p", "1", "--steps=2", "--backend", "gloo"],
            [f"--deepspeed_config={pipe}", *ARGS[1:]]]
    rc, out, losses = _run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                            str(SHIM / "shim_runs.py")], client,
                           _env(SHIM_PARTS=",".join(map(str, cuts)), SHIM_RUNS=json.dumps(runs)))
    return {"zero2": (rc, out, losses[:2]), "1f1b": (rc, out, losses[2:])}


@pytest.mark.parametrize("form,world", [
    pytest.param("deepspeed", 2, marks=pytest.mark.launches(("deepspeed", 2), "references")),
    pytest.param("launch", 4, marks=pytest.mark.launches(("launch", 4))),
    pytest.param("launch", 2, marks=pytest.mark.launches(("launch", 2))),
    pytest.param("deepspeed", 4, marks=pytest.mark.launches(("deepspeed", 4)))])
def test_unrestricted_plan_trains_the_unchanged_script(client, launches, form, world):
    """Without restrictions the planner picks ZeRO-2 without a pipeline on these CPU ranks (cpu-N's
    figures: the AlexNet fits every rank; no pipeline bubble); the script's pipeline layers train in
    DeepSpeed's plain engine through its ``train_batch`` calls, on the batches DeepSpeed's
    pipeline engine feeds (not shuffled), with the losses of DeepSpeed's own launch of the
    script with one stage under the merged config at ZeRO-1, the highest stage its pipeline
    engine takes (1e-6)."""
    out_dir = f"out-{form}-{world}"
    rc, out, ours, left = launches.result((form, world))
    assert rc == 0, out
    assert "Traceback" not in out, out
    # DeepSpeed's CPU allreduce op never unlinks its /dev/shm files (69 MB of RAM per rank and
    # launch); the ranks remove their own at exit
    assert not left, sorted(left)
    assert len(ours) == 2 and all(math.isfinite(x) for x in ours), out
    plan = json.loads((client / out_dir / "plan.json").read_text())
    assert (plan["pp"], plan["dp"], plan["world_size"]) == (1, world, world), plan
    assert plan["cluster"] == f"cpu-{world}", plan
    assert plan["zero_stage"] >= 2, plan
    assert "in DeepSpeed's engine (no pipeline)" in out
    assert f"ds-autoplan: profile: the script's 22 layers as {PROFILE} measured them" in out, out
    hint = "--pp 2" if form == "launch" else "DS_AUTOPLAN_PP=2"
    assert f"the script asked for 2 pipeline stages; the plan uses pp=1 (restrict it with {hint})" in out
    if (form, world) != ("deepspeed", 2):
        return
    rc, ref_out, ref = launches.result("references")["zero2"]
    assert rc == 0, ref_out
    err = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
    print(json.dumps({"test": "alexnet_zero2_vs_deepspeed", "ours": ours, "deepspeed": ref, "rel_err": err}))
    assert len(ref) == 2 and err <= 1e-6, (ours, ref)


def _launcher(*extra, args=ARGS):
    return [sys.executable, "-m", "ds_autoplan", "launch", *extra, "--num_gpus", "2",
            "--master_port", str(free_port()), "train.py", *args]


def _micro_losses(out: str) -> dict:
    per_rank: dict = {}
    for ln in out.splitlines():
        if ln.startswith("SHIM_MICRO_LOSS "):
            _, r, v = ln.split()
            per_rank.setdefault(int(r), []).append(v)
    return per_rank


@pytest.mark.launches("plain-module", "plain-module-by-hand")
def test_a_plain_module_script_trains_planned_as_by_hand(client, launches):
    """The script's non-pipelined path (a plain AlexNet module) is planned for DeepSpeed's own
    engine (ZeRO stage, micro-batch, accumulation), its config's optimizer kept, and trains with
    the losses of the same script run by hand with the config the planned run wrote."""
    rc, out, _ = launches.result("plain-module")
    assert rc == 0 and "Traceback" not in out, out
    assert re.search(r"ds-autoplan: AlexNet on cpu-auto-1x2: dp=2 ZeRO-\d micro-batch \d+ x \d+ accumulation "
                     r"steps, activation checkpointing off, in DeepSpeed's engine", out), out
    cfg = json.loads((client / "out-base" / "ds_config.autoplan.json").read_text())
    user = json.loads((client / "ds_config.json").read_text())
    assert cfg["optimizer"] == user["optimizer"] and cfg["train_batch_size"] == user["train_batch_size"]
    if cfg["train_micro_batch_size_per_gpu"] != user["train_micro_batch_size_per_gpu"]:
        assert (f"ds-autoplan: ds_config train_micro_batch_size_per_gpu: {user['train_micro_batch_size_per_gpu']}"
                f" -> {cfg['train_micro_batch_size_per_gpu']}") in out
    rc, ref, _ = launches.result("plain-module-by-hand")
    assert rc == 0, ref
    ours, theirs = _micro_losses(out), _micro_losses(ref)
    assert sorted(ours) == [0, 1] and ours == theirs, (ours, theirs)


# -- without ranks ------------------------------------------------------------------------------
def test_user_config_sets_only_the_plans_keys_and_reports_replacements():
    from ds_autoplan.emit.deepspeed import user_config, validate
    from ds_autoplan.plan import Plan
    plan = Plan(pp=2, dp=1, micro_batch_size=1, num_microbatches=32, global_batch_size=32,
                precision="bf16", schedule="1f1b", layers_per_stage=[10, 12], recompute_per_stage=[0, 0])
    user = {"train_batch_size": 256, "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 10,
            "zero_optimization": {"stage": 2, "overlap_comm": True}}
    cfg, changes = user_config(plan, user)
    assert cfg["optimizer"] == user["optimizer"] and cfg["steps_per_print"] == 10
    assert cfg["zero_optimization"] == {"stage": 0, "overlap_comm": True}
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (32, 1, 32)
    assert changes == ["train_batch_size: 256 -> 32", "train_micro_batch_size_per_gpu: 8 -> 1",
                       "zero_optimization.stage: 2 -> 0",
                       "precision: the plan was costed for bf16; the config trains in fp32 (kept)"]
    assert user["zero_optimization"]["stage"] == 2          # the user's dict is not modified
    validate(cfg, plan)                                     # DeepSpeed's own config class accepts it


def test_launch_runs_the_script_through_the_bootstrap(tmp_path):
    import base64
    from deepspeed.launcher import runner

    from ds_autoplan.cli.launch_cmd import BOOTSTRAP, apply_autoplan
    from ds_autoplan.clients.bootstrap import split_argv
    a = runner.parse_args(["--num_gpus", "2", "train.py", "--steps", "3"])
    opts = apply_autoplan(a, {"localhost": [0, 1]}, {"DS_AUTOPLAN_OUT": str(tmp_path / "o")}, pp=2)
    assert (a.user_script, a.module) == (BOOTSTRAP, True) and a.user_args[1:] == ["train.py", "--steps", "3"]
    assert "plan" not in opts and opts["pp"] == 2 and opts["out"] == str(tmp_path / "o")
    got, inserted, argv = split_argv(["--local_rank=1", *a.user_args])
    assert got == opts == json.loads(base64.urlsafe_b64decode(a.user_args[0].split("=", 1)[1]))
    assert argv == ["train.py", "--local_rank=1", "--steps", "3"]


def test_refusals_name_the_plan_and_the_restriction_in_the_users_form():
    from ds_autoplan.clients.deepspeed_hook import AutoplanRefused, _check_executable, option
    from ds_autoplan.plan import Plan
    assert option({"via": "launch"}, "pp", 2) == "--pp 2"
    assert option({}, "pp", 2) == "DS_AUTOPLAN_PP=2"
    assert option({"via": "env"}, "schedules", ["1f1b", "v-zb"]) == "DS_AUTOPLAN_SCHEDULES=1f1b,v-zb"
    plan = Plan(pp=2, dp=2, zero_stage=2, micro_batch_size=1, num_microbatches=8, precision="fp32",
                layers_per_stage=[10, 12], recompute_per_stage=[0, 0])
    for via, hint in (("launch", "--pp 1"), ("env", "DS_AUTOPLAN_PP=1")):
        with pytest.raises(AutoplanRefused) as e:
            _check_executable(plan, {"via": via})
        assert str(e.value) == (
            "the plan (pp=2 dp=2 ZeRO-2 schedule=1f1b micro-batch 1 x 8, layers per stage [10, 12]) "
            f"uses ZeRO-2 with a pipeline, which DeepSpeed's pipeline engine cannot run; plan it "
            f"without a pipeline ({hint})")
    _check_executable(Plan(pp=1, dp=4, zero_stage=3, precision="fp32", layers_per_stage=[22]), {})


NO_DATA_SCRIPT = """
import deepspeed, torch
from deepspeed.pipe import PipelineModule
deepspeed.init_distributed(dist_backend="gloo")
net = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)], num_stages=2,
                     loss_fn=torch.nn.CrossEntropyLoss())
deepspeed.initialize(model=net, config={"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})
"""


@pytest.mark.launches("no-example-input")
def test_a_pipeline_without_example_input_is_refused(launches):
    rc, out, _ = launches.result("no-example-input")
    assert rc != 0
    assert "ds-autoplan: error: cannot profile the script's 3 layers: deepspeed.initialize got no " \
           "training_data" in out
    assert "Traceback" not in out
