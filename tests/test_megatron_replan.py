"""``ds-autoplan launch --calibrate N ... -- torchrun ... pretrain_gpt.py`` (issue 39): Megatron-LM's
real ``pretrain_gpt.py`` (../shared/clients, with the shipped patch) measures its first plan,
the launcher re-plans on the calibrated cluster, switches through ds_autoplan's
plan-independent Megatron checkpoint (saved and loaded by the patch's hook), measures again and
keeps the faster.  2 CPU gloo ranks under the test shim (tests/megatron_lm_cpu.py), whose
``MLM_CPU_SLEEP`` makes every layer a calibrated sleep of gpt-tiny's compute on the ``TRUTH``
cluster of tests/test_replan.py: the plans' measured times show their schedules, not two ranks
contending for two cores (pp=2 ZB-H1 measured ~0.8 s/it, dp=2 ~0.62 s/it)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from test_megatron_lm_client import CPU_FLAGS, ROOT, SHIM, client  # noqa: F401 -- the fixture
from test_replan import SLOW_SLEEP, TRUTH, _cluster, _record

# gpt-tiny (the preset) as Megatron-LM flags, without the ones a plan decides: the launcher adds those
MODEL = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 64 "
         "--max-position-embeddings 64 --global-batch-size 8 --mock-data --tokenizer-type NullTokenizer "
         "--vocab-size 512 --lr 1e-3 --min-lr 1e-3 --lr-decay-style constant")
# seconds per sample of one layer's forward: gpt-tiny's ~7.3 MFLOP at TRUTH's 0.00125 TFLOPS
SLEEP = "0.0058"
SCHEDULES = "1f1b,interleaved,zb-h1"     # V plans would need --untie-embeddings-and-output-weights


def _env(tmp_path, tag: str, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
               MLM_CPU_INIT_BY_NAME="1", MLM_CPU_SLEEP=SLEEP, OMP_NUM_THREADS="1",
               MLM_CPU_LOSSES=str(tmp_path / f"{tag}.losses"))
    for k in ("DS_AUTOPLAN_MEASURE_STEPS", "DS_AUTOPLAN_PLAN", "DS_AUTOPLAN_OUT", "DS_AUTOPLAN_REPLAN"):
        env.pop(k, None)
    return {**env, **extra}


def _torchrun(steps: int, launcher=("torchrun",)) -> list[str]:
    return [*launcher, "--standalone", "--nproc_per_node", "2", str(SHIM), "pretrain_gpt.py",
            *shlex.split(MODEL), "--train-iters", str(steps), *shlex.split(CPU_FLAGS)]


def _launch(client, tmp_path, tag: str, cluster: str, steps: int = 10, launcher=("torchrun",), check=True):
    r = subprocess.run([sys.executable, "-m", "ds_autoplan", "launch", "--calibrate", "3", "--model", "gpt-tiny",
                        "--cluster", cluster, "--schedules", SCHEDULES, "--out", str(tmp_path / tag), "--",
                        *_torchrun(steps, launcher)],
                       cwd=client, env=_env(tmp_path, tag), capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr                   # every rank's output, in full
    if check:
        assert r.returncode == 0 and "Traceback" not in out, out
    return r.returncode, out


def _losses(tmp_path, tag: str) -> list:
    path = tmp_path / f"{tag}.losses"
    return [json.loads(x)["lm loss"] for x in path.read_text().splitlines()] if path.exists() else []


def _iterations(out: str) -> list[int]:
    """The iterations Megatron-LM logged (each once: no step trained twice or skipped)."""
    return [int(i) for i in re.findall(r"\] iteration +(\d+)/", out)]


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
def test_wrong_links_switch_megatron_to_the_measured_faster_plan_with_the_losses_of_a_resumed_run(
        client, tmp_path):
    """Links 20x too slow in the cluster file: the first plan is pp=2; the record calibrates
    them, the re-plan (dp=2) is switched to at step 3 through the checkpoint, measures faster
    and is kept.  Every iteration is trained once, and the losses after the switch equal those
    of the new plan resumed by hand from the same checkpoint (the same plan: bitwise)."""
    _, out = _launch(client, tmp_path, "run", _cluster(tmp_path, SLOW_SLEEP))
    assert "; switching at step 3" in out and "keeping it" in out, out
    assert "restarting the ranks under the switched plan" in out, out
    (entry,) = _record(tmp_path / "run")["replans"]
    assert entry["from"].startswith("pp=2 ") and entry["to"].startswith("pp=1 tp=1 dp=2 "), entry
    assert entry["measured_after_s"] < entry["measured_before_s"] and entry["kept"] is True, entry
    assert entry["ended_on"] == entry["to"], entry
    assert _iterations(out) == list(range(1, 11)), out
    losses = _losses(tmp_path, "run")
    assert len(losses) == 10, out
    # the resumed run: the switched plan from the switch's checkpoint, started by hand
    from ds_autoplan.cli.launch_command import planned_command
    run, ref = tmp_path / "run", tmp_path / "ref"
    ref.mkdir()
    (ref / "replan.json").write_text(json.dumps({"format": 1, "phase": "done", "resume": {
        "dir": str(run / "replan_checkpoint"), "tag": "step3-to-replan"}}))
    cmd = _torchrun(10)
    cmd = planned_command(cmd, cmd[cmd.index(str(SHIM)) + 1:], str(run / "plan.json"))
    r = subprocess.run(cmd, cwd=client, capture_output=True, text=True, timeout=600,
                       env=_env(tmp_path, "ref", DS_AUTOPLAN_PLAN=str(run / "plan.json"), DS_AUTOPLAN_OUT=str(ref),
                                DS_AUTOPLAN_REPLAN=str(ref / "replan.json")))
    ref_out = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in ref_out, ref_out
    assert _iterations(ref_out) == list(range(4, 11)), ref_out
    assert _losses(tmp_path, "ref") == losses[3:]


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_true_figures_keep_the_megatron_plan(client, tmp_path):
    """From the true figures the first plan (dp=2, Megatron-LM's pp=1 timed in our function) is
    kept: no restart, the record's one decision keeps it (``python -m torch.distributed.run``)."""
    _, out = _launch(client, tmp_path, "run", _cluster(tmp_path, TRUTH), steps=5,
                     launcher=(sys.executable, "-m", "torch.distributed.run"))
    assert "keeping the plan: the re-plan" in out and "restarting the ranks" not in out, out
    (entry,) = _record(tmp_path / "run")["replans"]
    assert entry["kept"] is True and entry["from"] == entry["to"] == entry["ended_on"], entry
    assert entry["from"].startswith("pp=1 tp=1 dp=2 "), entry
    assert _iterations(out) == list(range(1, 6)) and len(_losses(tmp_path, "run")) == 5, out


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_a_megatron_switch_whose_checkpoint_cannot_be_written_keeps_the_running_plan(client, tmp_path):
    """The switch's checkpoint folder cannot be made (a file is in its place): every rank keeps
    the running plan, Megatron-LM trains to its end and the record says why it did not switch."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "replan_checkpoint").write_text("in the way\n")
    _, out = _launch(client, tmp_path, "run", _cluster(tmp_path, SLOW_SLEEP), steps=5)
    assert "; switching at step 3" in out, out
    assert "ds-autoplan: keeping the plan: the switch's checkpoint cannot be written (" in out, out
    assert "restarting the ranks" not in out, out
    (entry,) = _record(tmp_path / "run")["replans"]
    assert entry["kept"] is False and entry["not_switched"] and entry["ended_on"] == entry["from"], entry
    assert _iterations(out) == list(range(1, 6)), out


# -- the command form's refusals, in-process: one line, nothing written ----------------------------
@pytest.mark.parametrize("argv,needle", [
    (["--calibrate", "3", "--", "python", "pretrain_gpt.py"],
     "the command after -- is 'python': give torchrun (or python -m torch.distributed.run)"),
    (["--calibrate", "3", "--", "torchrun", "--nnodes", "2", "--nproc_per_node", "2", "pretrain_gpt.py"],
     "--nnodes 2: one torchrun command starts one node"),
    (["--calibrate", "3", "--", "torchrun", "--nproc_per_node", "gpu", "pretrain_gpt.py"],
     "--nproc_per_node gpu: give the number of ranks"),
    (["--calibrate", "0", "--", "torchrun", "--nproc_per_node", "2", "pretrain_gpt.py"], "--calibrate 0: at least 2"),
    (["--global-batch", "16", "--", "torchrun", "--nproc_per_node", "2", "pretrain_gpt.py", "--global-batch-size", "8"],
     "--global-batch 16 and the script's --global-batch-size 8 differ"),
    (["--schedules", "v-half", "--", "torchrun", "--nproc_per_node", "2", "pretrain_gpt.py"],
     "only with --untie-embeddings-and-output-weights"),
    (["--num_gpus", "2", "--", "torchrun", "--nproc_per_node", "2", "pretrain_gpt.py"],
     "before --, only ds-autoplan's options (the launcher's go after it): --num_gpus 2"),
    (["--", ], "give the command after --")])
def test_a_bad_command_launch_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch, argv, needle):
    from ds_autoplan.cli import main
    monkeypatch.chdir(tmp_path)
    rc = main(["launch", "--model", "gpt-tiny", "--cluster", "cpu-2", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "ds_autoplan_out").exists()


def test_a_command_launch_needs_the_model(tmp_path, capsys, monkeypatch):
    from ds_autoplan.cli import main
    monkeypatch.chdir(tmp_path)
    rc = main(["launch", "--", "torchrun", "--nproc_per_node", "2", "pretrain_gpt.py"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "-- COMMAND runs the plan made before launch: give --model" in err, err


def test_the_plans_flags_replace_the_commands():
    """A plan's parallel flags replace those of the command line (values included, ``=`` forms
    too); every other flag stays in its place."""
    from ds_autoplan.emit.megatron import with_plan_flags
    from ds_autoplan.search import SearchOptions, plan_model
    plan = plan_model("gpt-tiny", "cpu-2", 8, options=SearchOptions(pp=2, schedules=["1f1b"], precision="fp32"))
    got = with_plan_flags(["pretrain_gpt.py", "--micro-batch-size", "8", "--lr", "1e-3", "--sequence-parallel",
                           "--recompute-granularity=full", "--pipeline-model-parallel-layout", "Et|tL",
                           "--train-iters", "3"], plan)
    n = len(["pretrain_gpt.py", "--lr", "1e-3", "--train-iters", "3"])
    assert got[:n] == ["pretrain_gpt.py", "--lr", "1e-3", "--train-iters", "3"], got
    ours = got[n:]
    assert ours[:4] == ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"], ours
    assert ours[ours.index("--micro-batch-size") + 1] == str(plan.micro_batch_size), ours
    assert "--sequence-parallel" not in ours and "--recompute-granularity" not in ours, ours


def test_a_command_launch_writes_into_ds_autoplan_out(tmp_path, monkeypatch):
    """Without --out, the command form plans into DS_AUTOPLAN_OUT (checked as every
    DS_AUTOPLAN_* value is) and names it to the ranks; no ds_autoplan_out/ appears."""
    from ds_autoplan.cli import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_AUTOPLAN_OUT", str(tmp_path / "envout"))
    (tmp_path / "rank.py").write_text(
        "import os, pathlib\n"
        "pathlib.Path(os.environ['DS_AUTOPLAN_OUT'], 'seen' + os.environ['RANK']).write_text(os.environ['DS_AUTOPLAN_PLAN'])\n")
    rc = main(["launch", "--model", "gpt-tiny", "--cluster", "cpu-2", "--", sys.executable, "-m",
               "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "rank.py", "--global-batch-size", "8"])
    assert rc == 0
    out = tmp_path / "envout"
    assert (out / "plan.json").is_file() and not (tmp_path / "ds_autoplan_out").exists()
    assert [(out / f"seen{r}").read_text() for r in (0, 1)] == [str(out / "plan.json")] * 2
