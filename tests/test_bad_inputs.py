"""Bad inputs: each is refused with one ``ds-autoplan ...: error:`` line
and a non-zero exit, never a traceback, a silently ignored value or an unbounded search."""
from __future__ import annotations

import re

import pytest

from ds_autoplan.cli import main
from ds_autoplan.env import EnvError, env_float, env_int, env_list


def _one_line_error(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"ds-autoplan {argv[0]}: error: ")
    for n in needles:
        assert n in err, err
    return err


# -- environment variables -------------------------------------------------------------------
@pytest.mark.parametrize("value,needle", [("abc", "not a whole number"), ("0", "at least 1"),
                                          ("2.5", "not a whole number")])
def test_env_int_names_the_variable(monkeypatch, value, needle):
    monkeypatch.setenv("DS_AUTOPLAN_PP", value)
    with pytest.raises(EnvError, match=f"DS_AUTOPLAN_PP={value!r}.*{needle}"):
        env_int("DS_AUTOPLAN_PP")


def test_env_helpers_defaults_and_values(monkeypatch):
    monkeypatch.delenv("DS_AUTOPLAN_X", raising=False)
    assert env_int("DS_AUTOPLAN_X", 7) == 7
    monkeypatch.setenv("DS_AUTOPLAN_X", " ")
    assert env_float("DS_AUTOPLAN_X", 1.5) == 1.5      # empty = unset
    monkeypatch.setenv("DS_AUTOPLAN_X", "a, b,,c")
    assert env_list("DS_AUTOPLAN_X") == ["a", "b", "c"]
    for bad in ("nan", "inf", "-1"):
        monkeypatch.setenv("DS_AUTOPLAN_X", bad)
        with pytest.raises(EnvError, match="DS_AUTOPLAN_X"):
            env_float("DS_AUTOPLAN_X")


@pytest.mark.parametrize("var,value,needle", [
    ("DS_AUTOPLAN_CHECKPOINT_DELAY", "abc", "is not a finite number"),
    ("DS_AUTOPLAN_CHECKPOINT_DELAY", "-1", "must be a finite number of at least 0"),
    ("DS_AUTOPLAN_CHECKPOINT_FAULT", "file:x@y", "is not POINT[:N][@RANK]"),
    ("DS_AUTOPLAN_CHECKPOINT_FAULT", "nope", "POINT one of staged, file"),
])
def test_checkpoint_fault_variables_are_read_through_env(monkeypatch, tmp_path, var, value, needle):
    """A checkpoint save with a malformed fault-injection variable: one EnvError line naming it
    (was: ``ValueError`` from ``float()`` / ``int()`` deep in the save)."""
    from ds_autoplan.runtime import checkpoint_files as cf
    monkeypatch.setenv(var, value)
    with pytest.raises(EnvError, match=re.escape(f"{var}={value!r}") + ".*" + re.escape(needle)):
        cf.save_atomically(tmp_path / "t", lambda d: None)
    assert not (tmp_path / "t").exists()


def test_an_unreadable_plan_named_by_the_environment_is_one_line(monkeypatch, tmp_path):
    """``DS_AUTOPLAN_PLAN`` naming a missing or binary file (``ds_autoplan.initialize`` without
    a plan): one PlanError naming the file and the variable (was: ``FileNotFoundError``)."""
    pytest.importorskip("deepspeed")
    from ds_autoplan.errors import PlanError
    from ds_autoplan.runtime.deepspeed.api import as_plan
    binary = tmp_path / "plan.json"
    binary.write_bytes(bytes(range(256)))
    for path, why in (("/nonexistent/plan.json", "No such file or directory"),
                      (str(binary), "not a text file")):
        monkeypatch.setenv("DS_AUTOPLAN_PLAN", path)
        with pytest.raises(PlanError, match=re.escape(f"cannot read the plan {path}: {why} "
                                                      "(named by DS_AUTOPLAN_PLAN)")):
            as_plan(None)


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text("raise SystemExit('the script must not run')\n")
    return p


@pytest.mark.parametrize("var,value,needle", [
    ("DS_AUTOPLAN_PP", "abc", "DS_AUTOPLAN_PP='abc' is not a whole number"),
    ("DS_AUTOPLAN_GLOBAL_BATCH", "abc", "DS_AUTOPLAN_GLOBAL_BATCH='abc' is not a whole number"),
    ("DS_AUTOPLAN_SCHEDULES", "nope", "unknown schedule(s) 'nope'; choose from gpipe, 1f1b"),
    ("DS_AUTOPLAN_CHECKPOINT_DELAY", "abc", "DS_AUTOPLAN_CHECKPOINT_DELAY='abc' is not a finite number"),
    ("DS_AUTOPLAN_CHECKPOINT_FAULT", "file:x@y", "DS_AUTOPLAN_CHECKPOINT_FAULT='file:x@y' is not "
                                                 "POINT[:N][@RANK]"),
])
def test_launch_refuses_a_bad_environment_variable(monkeypatch, capsys, tmp_path, script, var,
                                                   value, needle):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv(var, value)
    monkeypatch.setenv("DS_AUTOPLAN_OUT", str(tmp_path / "out"))
    _one_line_error(capsys, ["launch", "--num_gpus", "2", str(script)], needle)


def test_launch_refuses_an_unknown_schedule_option(monkeypatch, capsys, tmp_path, script):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_AUTOPLAN_OUT", str(tmp_path / "out"))
    _one_line_error(capsys, ["launch", "--schedules", "1f1b,nope", "--num_gpus", "2", str(script)],
                    "--schedules: unknown schedule(s) 'nope'")


@pytest.mark.parametrize("args,needle", [
    (["--global-batch", "0"], "--global-batch must be at least 1, got 0"),     # was dropped
    (["--pp", "-1"], "--pp must be at least 1, got -1"),                       # was ignored
    (["--num_gpus", "0"], "--num_gpus 0: give at least 1"),                    # ran 1 rank
    (["--num_nodes", "0"], "--num_nodes 0: give at least 1"),
])
def test_launch_refuses_counts_below_one(monkeypatch, capsys, tmp_path, script, args, needle):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_AUTOPLAN_OUT", str(tmp_path / "out"))
    _one_line_error(capsys, ["launch", *args, str(script)], needle)
    assert not (tmp_path / "out").exists()


def test_launch_on_a_port_in_use_says_to_pass_master_port(monkeypatch, capsys, tmp_path, script):
    """Another launch holds the master port (a listening socket here): refused before any rank
    starts (was: torch's ``DistNetworkError EADDRINUSE`` traceback on rank 0)."""
    pytest.importorskip("deepspeed")
    import socket
    monkeypatch.setenv("DS_AUTOPLAN_OUT", str(tmp_path / "out"))
    with socket.socket() as other:
        other.bind(("", 0))
        other.listen()
        port = other.getsockname()[1]
        _one_line_error(capsys, ["launch", "--num_gpus", "2", "--master_port", str(port), str(script)],
                        f"port {port} (--master_port) is in use", "pass --master_port")


def test_the_planner_refuses_unknown_schedules_it_is_given():
    """Any caller of the search (the DeepSpeed hook's planning at deepspeed.initialize too):
    an unknown name is an error, not silently dropped from the candidates."""
    from ds_autoplan.schedule import ScheduleError
    from ds_autoplan.search.planner import Planner
    from ds_autoplan.spec.cluster import load_cluster
    from ds_autoplan.spec.model import load_model
    with pytest.raises(ScheduleError, match="unknown schedule.*'nope'.*choose from"):
        Planner(load_model("gpt-tiny"), load_cluster("cpu-2"), 8, schedules=["1f1b", "nope"])


# -- planner inputs ------------------------------------------------------------------------------
PLAN = ["plan", "--model", "gpt-tiny", "--cluster", "cpu-2", "--global-batch", "8"]


@pytest.mark.parametrize("flag", ["--memory-budget-gb", "--headroom-gb"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_memory_budget_must_be_a_finite_positive_number(capsys, flag, value):
    _one_line_error(capsys, PLAN + [flag, value], flag.strip("-").split("-")[0])


def _hf(tmp_path, **fields):
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "configs" / "hf" / "Meta-Llama-3-8B" / "config.json"
    p = tmp_path / "hf" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps({**json.loads(root.read_text()), **fields}))
    return str(p)


SPEC_FILES = {   # name -> (plan arguments, needle); was a traceback or silently accepted
    "binary-model": (lambda t: ["--model", _binary(t, "m.yaml"), "--cluster", "cpu-2"],
                     "not a text file (not UTF-8)"),                       # UnicodeDecodeError
    "binary-cluster": (lambda t: ["--model", "gpt-tiny", "--cluster", _binary(t, "c.json")],
                       "not a text file (not UTF-8)"),
    "nan-memory": (lambda t: ["--model", "gpt-tiny", "--cluster", _text(
        t, "c.yaml", "name: c\ngpus_per_node: 2\nmemory_gb: .nan\npeak_tflops: 1\n"
                     "intra_node_GBps: 10\ninter_node_GBps: 10\n")],
        "field 'memory_gb' must be a finite positive number, got nan"),   # NaN -> int
    "nan-reserve": (lambda t: ["--model", "gpt-tiny", "--cluster", _text(
        t, "c.yaml", "name: c\ngpus_per_node: 2\nmemory_gb: 8\nreserve_gb: .nan\npeak_tflops: 1\n"
                     "intra_node_GBps: 10\ninter_node_GBps: 10\n")],
        "reserve_gb nan: every figure must be a finite number"),
    "huge-budget": (lambda t: ["--model", "gpt-tiny", "--cluster", "cpu-2", "--memory-budget-gb",
                               "1e308"], "memory budget 1e+308 GB is too large"),
    "hf-heads-string": (lambda t: ["--model", _hf(t, num_attention_heads="32"), "--cluster",
                                   "8xa100-80gb"],
                        "field 'num_attention_heads' must be a number, got the string '32'"),
    "hf-nan-eps": (lambda t: ["--model", _hf(t, rms_norm_eps=float("nan")), "--cluster", "8xa100-80gb"],
                   "field 'norm_eps' must be a finite positive number, got nan"),
}


def _binary(tmp_path, name):
    p = tmp_path / name
    p.write_bytes(bytes(range(256)) * 4)
    return str(p)


def _text(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("case", sorted(SPEC_FILES))
def test_malformed_model_and_cluster_inputs_are_one_line(capsys, tmp_path, case):
    args, needle = SPEC_FILES[case]
    _one_line_error(capsys, ["plan", *args(tmp_path), "--global-batch", "8", "--out",
                             str(tmp_path / "out")], needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config,needle", [("tp=2,tp=1", "--config: tp is given twice"),  # last won
                                           ("mbs=1,micro_batch_size=2", "mbs is given twice"),
                                           ("", "--config: names nothing")])      # was: no restriction
def test_cost_config_given_twice_or_empty(capsys, config, needle):
    _one_line_error(capsys, ["cost", *PLAN[1:], "--config", config], needle)


def test_cost_of_a_configuration_that_cannot_run_exits_non_zero(capsys):
    """The report (the planner's choice beside it) is kept; one error line, exit 2 (was 0)."""
    rc = main(["cost", *PLAN[1:], "--config", "pp=4"])
    cap = capsys.readouterr()
    assert rc == 2 and "your configuration : cannot run" in cap.out and "planner's choice" in cap.out
    assert cap.err.count("\n") == 1 and cap.err.startswith(
        "ds-autoplan cost: error: your configuration cannot run: pp=4 must divide the 2 devices"), cap.err


def test_absurd_num_layers_refused_before_any_allocation(capsys, tmp_path):
    from ds_autoplan.spec.model import MAX_LAYERS
    y = tmp_path / "deep.yaml"
    y.write_text("name: deep\narch: gpt\nnum_layers: 1000000000\nhidden: 64\nheads: 4\n"
                 "vocab: 512\nseq_len: 64\n")
    _one_line_error(capsys, ["plan", "--model", str(y), "--cluster", "cpu-2", "--global-batch", "8"],
                    "num_layers 1000000000", str(MAX_LAYERS))


def test_a_model_far_beyond_the_budget_is_refused_without_the_quadratic_split(monkeypatch):
    """4000 layers of hidden 500000: the 'cannot fit' floor comes from the model states alone
    (no stage holds less than their mean), without the memory-balanced split whose tables are
    (layers x layers) per configuration (was: about a minute before the refusal); a model near
    the budget still gets the exact split's figure."""
    from ds_autoplan.search import partition
    from ds_autoplan.search.planner import Planner
    from ds_autoplan.spec.cluster import load_cluster
    from ds_autoplan.spec.model import load_model
    big = load_model({"name": "big", "arch": "gpt", "num_layers": 4000, "hidden": 500000,
                      "heads": 1000, "vocab": 50000, "seq_len": 2048})
    split = partition.stage_matrices
    calls = []
    monkeypatch.setattr(partition, "stage_matrices", lambda *a: calls.append(1) or split(*a))
    pl = Planner(big, load_cluster("8xa100-80gb"), 8)
    assert pl.min_memory() > 10 * pl.E and calls == []
    tiny = Planner(load_model("gpt-tiny"), load_cluster("cpu-2"), 8)
    assert 0 < tiny.min_memory() < tiny.E and calls


def test_micro_batch_enumeration_is_bounded_by_memory_not_by_the_batch(monkeypatch):
    """The search's work does not grow with the global batch: micro-batch sizes are enumerated
    only up to what a device could hold (Planner.micro_batch_bound, independent of the batch),
    and every divisor enumeration of the batch is capped there."""
    from ds_autoplan.search import planner as planner_mod
    from ds_autoplan.search.space import divisors
    from ds_autoplan.spec.cluster import load_cluster
    from ds_autoplan.spec.model import load_model
    model, cluster = load_model("gpt3-13b"), load_cluster("2x8xa100-ib200")
    calls = []

    def counted(n, upto=None):
        calls.append((n, upto))
        return divisors(n, upto)
    monkeypatch.setattr(planner_mod, "divisors", counted)
    bounds = set()
    for B in (2 ** 40, 2 ** 50, 99999999999):
        pl = planner_mod.Planner(model, cluster, B)
        bounds.add(pl.max_mbs)
        sizes = {c.micro_batch for c in pl.combos()}       # micro-batch per device
        assert sizes and max(sizes) <= pl.max_mbs
        pl.search_wide(max_pairs=1)
    assert len(bounds) == 1 and bounds.pop() < 10 ** 5
    big = [(n, u) for n, u in calls if n >= 10 ** 9]
    assert big and all(u is not None and u < 10 ** 6 for n, u in big), big


def test_huge_global_batch_plans(capsys):
    """``--global-batch 99999999999`` (was: still searching after 2 minutes) gives a plan."""
    from ds_autoplan.search import search
    res = search("gpt3-13b", "2x8xa100-ib200", 99999999999, wide=False, baselines=False,
                 keep_sim=False)
    p = res.plan
    assert p.micro_batch_size * p.num_microbatches * p.dp == 99999999999


@pytest.mark.parametrize("model,cluster,tp", [("gpt3-1.3b", "8xa100-80gb", 2),
                                              ("gpt3-1.3b", "8xa100-80gb", 4),
                                              ("llama2-7b", "8xh100-80gb", 2)])
def test_plan_fix_tp_plans(capsys, tmp_path, model, cluster, tp):
    """``--fix tp=N`` leaves pipeline depths where no layout of the per-layer search fits (fewer
    than N devices per stage): an empty strategy list is costed as empty tables, not a
    ``ValueError`` in the re-layout table (was: a traceback from ``cost/model.py``)."""
    import json
    out = tmp_path / "out"
    rc = main(["plan", "--model", model, "--cluster", cluster, "--global-batch", "64",
               "--fix", f"tp={tp}", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((out / "plan.json").read_text())["tp"] == tp


def test_divisors_match_the_definition():
    from ds_autoplan.search.space import divisors
    for n in list(range(1, 400)) + [2 ** 20, 3 ** 9 * 7, 99991]:
        full = [k for k in range(1, n + 1) if n % k == 0]
        assert divisors(n) == full
        for u in (1, 2, 7, 64, n):
            assert divisors(n, u) == [k for k in full if k <= u]


@pytest.mark.parametrize("args,needle", [
    (["gpt-tiny", "--threads", "-1"], "--threads must be >= 1"),     # was torch's RuntimeError
    (["module:../../x"], "expected module:package.module.factory"),  # was TypeError (relative import)
])
def test_profile_refuses_bad_options(capsys, tmp_path, args, needle):
    _one_line_error(capsys, ["profile", *args, "--out", str(tmp_path / "p.json")], needle)
    assert not (tmp_path / "p.json").exists()


# -- schedule files ------------------------------------------------------------------------------
def test_simulate_a_binary_file(capsys, tmp_path):
    f = tmp_path / "sched.json"
    f.write_bytes(bytes(range(256)) * 8)
    _one_line_error(capsys, ["simulate", "--file", str(f)], "not a schedule file")


def test_simulate_a_file_declaring_absurd_microbatches(capsys, tmp_path):
    f = tmp_path / "sched.txt"
    f.write_text("# ds_autoplan schedule name=x microbatches=99999999999 placement=0,1\n"
                 "rank0: F0.0 BW0.0\nrank1: F1.0 BW1.0\n")
    _one_line_error(capsys, ["simulate", "--file", str(f)], "99999999999 micro-batches",
                    "2 forward actions")


def test_simulate_absurd_microbatches_option(capsys):
    _one_line_error(capsys, ["simulate", "-n", "99999999999"], "n=99999999999")


# -- runtime refusals (DeepSpeed runtime, 2 ranks) -----------------------------------------------
REFUSALS = [
    # a tp=2, world-4 plan on 2 ranks (it trained, without TP)
    ({"plan": {"tp": 2}}, "ScheduleError: ds_autoplan.initialize: the plan needs tp*cp*pp*dp = "
                          "2*1*2*1 = 4 processes, the world has 2"),
    # tp=2 with the world it needs: DeepSpeed's pipeline grid has no TP axis (TP ranks -> DP)
    ({"plan": {"tp": 2, "pp": 1, "layers_per_stage": [4], "recompute_per_stage": [0.0]}},
     "the plan has tp=2 but the DeepSpeed pipeline's tensor-parallel (model) axis is 1"),
    # data-parallel mismatch: a dp=2 plan on one replica
    ({"plan": {"dp": 2, "global_batch_size": 16}}, "tp*cp*pp*dp = 1*1*2*2 = 4 processes"),
    # DeepSpeed's batch assertion, explained
    ({"config": {"train_batch_size": 999}}, "DeepSpeed's batch check failed"),
    # an empty stage (the optimizer would get an empty parameter list on rank 0): the plan
    # itself refuses it, saying why
    ({"plan": {"layers_per_stage": [0, 4]}}, "PlanError: plan: stage 0 of the 2 stages of '1f1b' "
                                             "on pp=2 has no layers"),
]


def test_deepspeed_runtime_refuses_on_every_rank_before_training():
    """Each case: every rank refuses in one line, before any collective (no rank hangs); the
    last case (the plain plan) runs, so the refusals are the inputs' doing."""
    pytest.importorskip("deepspeed")
    from ds_autoplan.runtime.launch import launch
    from harness import ENV
    cases = [dict(c, fn="harness.hang_cases:refusal_case") for c, _ in REFUSALS] + \
        [{"fn": "harness.hang_cases:refusal_case"}]
    per_rank = launch(2, cases, timeout=240, env=ENV)
    for rows in per_rank:
        assert len(rows) == len(cases)
        for row, (_, want) in zip(rows, REFUSALS):
            assert row["error"] is not None and want in row["error"], (want, row)
            assert "\n" not in row["error"]
        assert rows[-1]["error"] is None


# -- loose ends of issue 40: each failed before its fix ---------------------------------------
def test_launch_checks_the_plan_it_is_given_before_anything_starts(monkeypatch, capsys, tmp_path, script):
    """``DS_AUTOPLAN_PLAN`` naming a missing plan, or a plan for another world size: refused in
    one line before DeepSpeed's launcher starts a rank (it used to start them, and each rank
    found the plan unreadable)."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_AUTOPLAN_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("DS_AUTOPLAN_PLAN", "/nonexistent/plan.json")
    _one_line_error(capsys, ["launch", "--num_gpus", "1", str(script)],
                    "cannot read the plan /nonexistent/plan.json", "(named by DS_AUTOPLAN_PLAN)")
    from ds_autoplan.search import SearchOptions, plan_model
    two = tmp_path / "two.json"
    plan_model("gpt-tiny", "cpu-2", 8, options=SearchOptions(pp=2)).save(two)
    monkeypatch.setenv("DS_AUTOPLAN_PLAN", str(two))
    _one_line_error(capsys, ["launch", "--num_gpus", "1", str(script)],
                    f"the plan {two} (DS_AUTOPLAN_PLAN) uses 2 ranks", "the launch has 1")
    assert not (tmp_path / "out").exists()


def test_the_plan_line_names_the_detected_cluster(capsys, tmp_path):
    """The launcher's plan line names the cluster it planned on, not the ClusterSpec's repr
    of 20 fields (the detected cluster is a ClusterSpec, as this one)."""
    from ds_autoplan.cli.launch_cmd import _plan_model_now
    from ds_autoplan.spec.cluster import load_cluster
    _plan_model_now("gpt-tiny", load_cluster("cpu-2"), 8, 2, None, {"localhost": [0, 1]}, str(tmp_path / "o"))
    out = capsys.readouterr().out
    assert "ds-autoplan: gpt-tiny on cpu-2 (2 ranks): pp=2" in out and "ClusterSpec" not in out, out


def test_a_second_launch_into_a_running_launchs_folder_is_refused(tmp_path):
    """Two launches in one working directory: while the first holds its output folder (here a
    process of its own, as a launcher is), the second is refused by name before it plans or
    writes anything; once the first has ended, the folder is free."""
    import subprocess
    import sys

    from ds_autoplan.cli import UserError
    from ds_autoplan.cli.launch_cmd import apply_autoplan
    from types import SimpleNamespace
    out = tmp_path / "ds_autoplan_out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from ds_autoplan.outputs import "
                               f"hold_for_launch; hold_for_launch({str(out)!r}); print('held', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = SimpleNamespace(no_python=False, module=False, user_script=str(tmp_path / "train.py"), user_args=[])
        with pytest.raises(UserError, match=re.escape(f"--out {out}: another launch (pid {holder.pid}) is "
                                                      "using this folder")):
            apply_autoplan(args, {"localhost": [0, 1]}, {}, model="gpt-tiny", cluster="cpu-2", global_batch=8,
                           out=str(out))
        assert sorted(p.name for p in out.iterdir()) == [".ds-autoplan-launch.lock"]
    finally:
        holder.communicate("")
    opts = apply_autoplan(args, {"localhost": [0, 1]}, {}, model="gpt-tiny", cluster="cpu-2", global_batch=8,
                          out=str(out))
    assert (out / "plan.json").exists() and opts["out"] == str(out)


def test_a_bad_variable_under_plain_deepspeed_is_one_line(tmp_path):
    """``DS_AUTOPLAN_CHECKPOINT_DELAY=abc`` under a plain run of the example (no --autoplan):
    the rank prints the one line and exits 2, as the CLI does (was: an EnvError traceback)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ds_autoplan.runtime.launch import free_port
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               DS_AUTOPLAN_CHECKPOINT_DELAY="abc")
    r = subprocess.run([sys.executable, str(root / "examples" / "train_deepspeed.py"), "--steps", "1",
                        "--save", str(tmp_path / "ckpt")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("train_deepspeed.py: error: ")]
    assert len(lines) == 1 and "DS_AUTOPLAN_CHECKPOINT_DELAY='abc'" in lines[0], r.stderr


def test_a_profile_of_other_layers_is_refused(tmp_path):
    """``--profile`` naming a profile of other layers (or no profile at all): one line naming
    both layer lists' starts (it would plan another model's times)."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from ds_autoplan.clients.deepspeed_hook import _given_profile
    from ds_autoplan.clients.module_plan import AutoplanRefused
    given = Path(__file__).with_name("data") / "alexnet_pipeline_profile.json"
    model = SimpleNamespace(_layer_specs=[torch.nn.Linear(2, 2), torch.nn.ReLU()])
    with pytest.raises(AutoplanRefused, match=re.escape(f"--profile {given} profiles 22 layers (0:Conv2d, "
                                                        "1:ReLU, 2:MaxPool2d, ...), the script's "
                                                        "PipelineModule has 2 (0:Linear, 1:ReLU, ...)")):
        _given_profile(str(given), model, {"via": "launch"})
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    with pytest.raises(AutoplanRefused, match=re.escape(f"DS_AUTOPLAN_PROFILE={bad}: not a ds_autoplan profile")):
        _given_profile(str(bad), model, {})


def test_a_refused_launch_leaves_the_users_empty_out_folder(tmp_path, capsys):
    """A launch refused after it took its --out folder (the plan cannot be made) removes its
    lock, and the folder only where it made it: an empty folder the user made stays."""
    import os
    from pathlib import Path
    script = str(Path(__file__).resolve().parents[1] / "examples" / "train_deepspeed.py")
    for out, made in ((tmp_path / "mine", True), (tmp_path / "new", False)):
        if made:
            out.mkdir()
        rc = main(["launch", "--model", "gpt-tiny", "--cluster", "no-such-cluster", "--out", str(out),
                   "--num_gpus", "2", script])
        err = capsys.readouterr().err
        assert rc == 2 and "no-such-cluster" in err, err
        assert out.exists() is made and (not made or os.listdir(out) == []), out
