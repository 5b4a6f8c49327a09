"""`ds-autoplan patch deepspeed` / `deepspeed --autoplan` / `ds-autoplan launch`, end to end on
2 CPU ranks; the patch is always reverted."""
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from ds_autoplan.cli import patch_cmd  # noqa: E402
from ds_autoplan.runtime.launch import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "ds_autoplan", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=env and env.get("PWD"))


def _runner():
    return Path(patch_cmd.runner_file()[0])


def test_patch_text_is_reversible_and_matches_shipped_patch():
    text = _runner().read_text()
    text = patch_cmd.unpatched(text)           # whatever the current state
    new = patch_cmd.patched(text)
    assert new != text and patch_cmd.MARK in new
    assert patch_cmd.unpatched(new) == text
    assert patch_cmd.diff(text) == (ROOT / "patches" / "deepspeed-autoplan.patch").read_text()
    r = _cli("patch", "deepspeed", "--diff")
    assert r.returncode == 0 and r.stdout == patch_cmd.diff(text)
    with pytest.raises(patch_cmd.UserError):
        patch_cmd.patched("def main():\n    pass\n")


def test_deepspeed_autoplan_end_to_end(tmp_path):
    path = _runner()
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    # a model description: planned before launch, DS_AUTOPLAN_PLAN read by the example
    env = dict(os.environ, DS_ACCELERATOR="cpu", PWD=str(tmp_path), OMP_NUM_THREADS="1",
               DS_AUTOPLAN_MODEL="gpt-tiny", DS_AUTOPLAN_CLUSTER="cpu-2")   # cpu-2: figures that do
    # not move with the machine's load, so the plan is the one-stage one the labels below name
    try:
        r = _cli("patch", "deepspeed", env=env)
        assert r.returncode == 0, r.stderr
        r = _cli("patch", "deepspeed", env=env)           # idempotent
        assert r.returncode == 0 and "already patched" in r.stdout
        run = subprocess.run([str(BIN / "deepspeed"), "--autoplan", "--num_gpus", "2",
                              "--master_port", str(free_port()),
                              str(ROOT / "examples" / "train_deepspeed.py"), "--steps", "2"],
                             capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out
        assert "step 1 loss" in out
        # the launcher and the ranks name the same schedule
        launcher = re.search(r"ds-autoplan: gpt-tiny on cpu-2 \(2 ranks\): .* schedule=(.+) -> ", out)
        ranks = re.search(r"plan: pp=1 dp=2 schedule=(.+) layers=", out)
        assert launcher and ranks and launcher[1] == ranks[1] == "none (no pipeline, pp=1)", out
        assert (tmp_path / "ds_autoplan_out" / "ds_config.autoplan.json").exists()
        assert (tmp_path / "ds_autoplan_out" / "plan.json").exists()
    finally:
        r = _cli("patch", "deepspeed", "--revert", env=env)
    assert r.returncode == 0, r.stderr
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_launch_bad_input_is_one_clear_error(tmp_path):
    r = _cli("launch", "--num_gpus", "2", str(tmp_path / "missing.py"))
    assert r.returncode == 2
    assert "training script not found" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("world,schedule,lps", [(4, "v-half", [1] * 8), (1, "v-half", [4])])
def test_example_trains_with_a_pipeline_schedule(world, schedule, lps):
    """V-Half on 4 ranks: the default layer count fills its 8 stages; on 1 rank no pipeline."""
    from ds_autoplan.runtime.launch import spawn
    outs = spawn([str(ROOT / "examples" / "train_deepspeed.py"), "--schedule", schedule,
                  "--steps", "3", "--recompute", "1"], world, timeout=240)
    assert all(rc == 0 for rc, _ in outs), outs[0][1]
    assert f"layers={sum(lps)} layers_per_stage={lps}" in outs[0][1], outs[0][1]
    losses = [float(ln.split()[-1]) for ln in outs[0][1].splitlines() if ln.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]


def _example(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("world", [1, 2, 4])
def test_example_default_layers_fill_every_stage_of_every_schedule(world):
    from argparse import Namespace

    from ds_autoplan.schedule import names
    ex = _example("train_deepspeed")
    for schedule in names():
        if schedule in ("adaptive", "dynapipe"):           # built per step / under a memory cap
            continue
        args = Namespace(schedule=schedule, microbatches=8, mbs=1, layers=None, seq=16, zero=0,
                         recompute=0.0)
        plan = ex.flag_plan(args, world)
        S = 1 if world == 1 else plan.build_schedule().num_stages
        assert len(plan.layers_per_stage) == S and min(plan.layers_per_stage) >= 1, (schedule, plan)
        assert plan.num_layers == sum(plan.layers_per_stage) >= 4


def test_a_plan_with_an_empty_stage_is_refused():
    from argparse import Namespace

    from ds_autoplan.errors import PlanError
    ex = _example("train_deepspeed")
    args = Namespace(schedule="v-half", microbatches=8, mbs=1, layers=4, seq=16, zero=0, recompute=0.0)
    with pytest.raises(PlanError) as e:
        ex.flag_plan(args, 4)
    assert str(e.value) == ("plan: stage 4 of the 8 stages of 'v-half' on pp=4 has no layers "
                            "(layers_per_stage [1, 1, 1, 1, 0, 0, 0, 0]): every stage needs at "
                            "least one; use 8 or more layers or a schedule with fewer stages")
