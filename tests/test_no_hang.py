"""No silent hang: both runtimes refuse an action list the simulator proves
deadlocking (it used to hang), and a rank that stops in the middle of a step (SIGSTOP) makes
every other rank exit within the step watchdog, naming the action and the peer it waits for.
Every multi-rank run is bounded by the launcher's kill timeout: a hang fails the test."""
from __future__ import annotations

import contextlib
import json
import os
import re

import pytest

from ds_autoplan.runtime import watchdog
from ds_autoplan.runtime.common import accept, waits_for
from ds_autoplan.schedule import DeadlockError, build, simulate, Costs

from harness import ENV
from harness.hang_cases import deadlock_schedule

# seconds: a step of these tiny models takes about 0.1 s, even with the machine loaded 6x over
# (measured: 0.08-0.18 s per step on 2 cores at load 12); 4 s is far above that
STEP_TIMEOUT = 4


def _run(tmp_path, world, case, env=None, timeout=150, grace=5):
    from ds_autoplan.runtime.launch import spawn
    path = tmp_path / "cases.json"
    path.write_text(json.dumps([case]))
    return spawn(["-m", "ds_autoplan.runtime.launch", str(path)], world, timeout=timeout,
                 grace=grace, env={**ENV, **(env or {})})


# -- deadlocking lists ---------------------------------------------------------------------------
def test_the_list_deadlocks_in_the_simulator():
    s = deadlock_schedule()
    with pytest.raises(DeadlockError, match="wait cycle: rank 0 -> rank 1 -> rank 0"):
        simulate(s, Costs.uniform(s))


def test_the_contract_refuses_it_with_the_simulators_message():
    with pytest.raises(DeadlockError, match=r"X: refused, this action list would hang: deadlock "
                                            r"in schedule 'deadlock': rank 0 at BW0\.0, rank 1 "
                                            r"at F1\.1; wait cycle"):
        accept(deadlock_schedule(), num_ranks=2, who="X")
    good = build("1f1b", 2, 4)
    lowered = accept(good, num_ranks=2)
    assert accept(lowered, num_ranks=2) is lowered       # a lowered list that finishes passes


@pytest.mark.parametrize("runtime", ["ds", "mg"])
def test_a_runtime_refuses_a_deadlocking_list_on_every_rank(tmp_path, runtime):
    if runtime == "mg":
        pytest.importorskip("megatron.core")
    outs = _run(tmp_path, 2, {"fn": f"harness.hang_cases:{runtime}_case",
                              "sched": deadlock_schedule().to_dict()}, timeout=150)
    for rank, (rc, out) in enumerate(outs):
        assert rc not in (0, -9), (rank, out)         # failed by itself, not killed
        assert "DeadlockError" in out and "this action list would hang" in out, out
        assert "wait cycle: rank 0 -> rank 1 -> rank 0" in out, out


# -- step watchdog -------------------------------------------------------------------------------
def test_waits_for_names_the_producing_rank():
    s = accept(build("1f1b", 2, 2), num_ranks=2)
    got = {a.short(): waits_for(a, s.placement) for lst in s.ranks for a in lst}
    assert got["F1.0"] == 0 and got["BW0.0"] == 1 and got["RECV_F1.0@0"] == 0
    assert got["F0.0"] is None and got["BW1.0"] is None      # first stage input, loss stage


def test_step_timeout_default_and_setting(monkeypatch):
    monkeypatch.delenv(watchdog.STEP_ENV, raising=False)
    assert watchdog.step_timeout(None) == watchdog.STEP_FLOOR
    assert watchdog.step_timeout(1.0) == watchdog.STEP_FLOOR           # floor of minutes
    assert watchdog.step_timeout(100.0) == 100.0 * watchdog.STEP_FACTOR
    monkeypatch.setenv(watchdog.STEP_ENV, "7")
    assert watchdog.step_timeout(100.0) == 7.0
    assert watchdog.process_group_timeout().total_seconds() > max(7.0, watchdog.init_timeout())
    monkeypatch.setenv(watchdog.STEP_ENV, "soon")
    with pytest.raises(ValueError, match=watchdog.STEP_ENV):
        watchdog.step_timeout()


def _start_stalled(folder, world, case):
    """Start ``world`` ranks of ``case`` (logs in ``folder``) without waiting for them."""
    import subprocess
    import sys

    from ds_autoplan.runtime.launch import _rank_env, free_port
    folder.mkdir()
    path = folder / "cases.json"
    path.write_text(json.dumps([case]))
    env, port, procs = {**ENV, watchdog.STEP_ENV: str(STEP_TIMEOUT)}, free_port(), []
    for r in range(world):
        log = open(folder / f"rank{r}.log", "w+")
        procs.append((subprocess.Popen([sys.executable, "-m", "ds_autoplan.runtime.launch",
                                        str(path)], env=_rank_env(r, world, port, env),
                                       stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def _finish_stalled(procs, stopped, deadline):
    """Once every rank but ``stopped`` has exited (or at the ``deadline``) kill what is left --
    this test's own processes, whatever else runs on the machine -- and return
    ``[(returncode, output)]``."""
    import time
    while time.time() < deadline and any(p.poll() is None for r, (p, _) in enumerate(procs)
                                         if r != stopped):
        time.sleep(0.2)
    out = []
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        rc = p.wait()
        log.seek(0)
        out.append((rc, log.read()))
        log.close()
    return out


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    """Both runtimes' stalled runs, started together so that their watchdog waits overlap:
    DeepSpeed on 3 pipeline ranks and Megatron on 2, rank 1 stopping in its second step.
    ``{runtime: [(returncode, output)] per rank}`` (no "mg" without megatron-core)."""
    import importlib.util
    import time
    cases = {"ds": (3, {"fn": "harness.hang_cases:ds_case", "stall_rank": 1})}
    if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.core"):
        cases["mg"] = (2, {"fn": "harness.hang_cases:mg_case", "stall_rank": 1})
    tmp = tmp_path_factory.mktemp("stalled")
    started = {k: _start_stalled(tmp / k, world, case) for k, (world, case) in cases.items()}
    deadline = time.time() + 200
    return {k: _finish_stalled(procs, 1, deadline) for k, procs in started.items()}


def _check_stalled(outs, stopped: int):
    """Every rank but the stopped one exited by its watchdog naming the stopped rank."""
    assert outs[stopped][0] == -9, outs[stopped][1]    # stopped: killed by the test
    assert "stopping (SIGSTOP)" in outs[stopped][1]
    for rank, (rc, out) in enumerate(outs):
        if rank == stopped:
            continue
        assert rc == watchdog.EXIT_CODE, (rank, rc, out)
        m = re.search(r"step (\d+) has not finished after (\d+) s \(limit (\d+) s, set by "
                      r"DS_AUTOPLAN_STEP_TIMEOUT\): stuck at (\S+), waiting for pipeline rank "
                      rf"{stopped} \(global rank {stopped}\)", out)
        assert m, (rank, out)
        assert m.group(1) == "2" and int(m.group(3)) == STEP_TIMEOUT
        assert STEP_TIMEOUT <= int(m.group(2)) <= STEP_TIMEOUT + 5


def test_deepspeed_stalled_rank_stops_the_others_within_the_watchdog(stalled):
    """3 pipeline ranks, the middle one stops: both neighbours name it."""
    _check_stalled(stalled["ds"], 1)


def test_megatron_stalled_rank_stops_the_others_within_the_watchdog(stalled):
    pytest.importorskip("megatron.core")
    _check_stalled(stalled["mg"], 1)


def test_a_left_op_build_lock_is_named_not_waited_on_silently(tmp_path, monkeypatch, capsys):
    """torch waits for ever on a JIT build's ``lock``; a killed build leaves it.  While an op
    build waits on one, ds-autoplan names the file and what to do (and says nothing without)."""
    import time
    from torch.utils.cpp_extension import _get_build_directory
    from ds_autoplan.runtime.launch import lock_watch
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with lock_watch("fused_adam", after=0.01) as lock:      # no lock: nothing said
        time.sleep(0.2)
    assert capsys.readouterr().err == ""
    assert lock == os.path.join(_get_build_directory("fused_adam", verbose=False), "lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    open(lock, "w").close()
    err = ""
    with lock_watch("fused_adam", after=0.01):
        for _ in range(200):                                # the watcher thread's line
            time.sleep(0.05)
            err += capsys.readouterr().err
            if err:
                break
    assert lock in err and "remove that file" in err, err


# -- Ctrl-C of a launch ---------------------------------------------------------------------------
SLEEPER = """import os, sys, time
with open(os.path.join(sys.argv[-1], "rank%s.pid" % os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""
# DeepSpeed's runner, patched for --autoplan, run from a copy (site-packages is not edited)
RUN_COPY = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location("
            "'deepspeed.launcher.runner', sys.argv.pop(1)); m = importlib.util.module_from_spec(spec); "
            "sys.modules[spec.name] = m; spec.loader.exec_module(m); m.main()")


@pytest.mark.multiproc
def test_ctrl_c_of_a_launch_stops_every_rank(tmp_path):
    """SIGINT to ``ds-autoplan launch`` and to ``deepspeed --autoplan`` (two 2-rank launches of
    a script that sleeps, side by side): each launcher stops its ranks and DeepSpeed's
    per-node launcher, says so in one line and exits 130, no traceback (was: exit 130 with a
    ``KeyboardInterrupt`` traceback, the per-node launcher reparented and both ranks still
    running)."""
    pytest.importorskip("deepspeed")
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    from ds_autoplan.cli import patch_cmd
    from ds_autoplan.runtime.launch import free_port
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    runner = tmp_path / "runner.py"
    runner.write_text(patch_cmd.patched(patch_cmd.unpatched(Path(patch_cmd.runner_file()[0]).read_text())))
    launches = {"ds-autoplan launch": [sys.executable, "-m", "ds_autoplan", "launch"],
                "ds-autoplan": [sys.executable, "-c", RUN_COPY, str(runner), "--autoplan"]}
    env = {**os.environ, **ENV, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    runs = {}
    for i, (prog, cmd) in enumerate(launches.items()):
        d = tmp_path / f"launch{i}"
        d.mkdir()
        runs[prog] = (d, subprocess.Popen(
            cmd + ["--num_gpus", "2", "--master_port", str(free_port()), str(script), str(d)],
            cwd=d, env={**env, "DS_AUTOPLAN_OUT": str(d / "out")}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,      # SIGINT handled as in a terminal's job
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)))
    trees: dict = {}
    try:
        deadline = time.time() + 240
        while not all(len(list(d.glob("rank*.pid"))) == 2 for d, _ in runs.values()):
            assert time.time() < deadline and all(p.poll() is None for _, p in runs.values()), \
                {prog: (p.poll(), p.poll() is not None and p.stdout.read())
                 for prog, (_, p) in runs.items()}
            time.sleep(0.2)
        trees = {prog: psutil.Process(p.pid).children(recursive=True) for prog, (_, p) in runs.items()}
        for _, p in runs.values():
            p.send_signal(signal.SIGINT)
        for prog, (d, p) in runs.items():
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 130, (prog, out)
            assert "Traceback" not in out and "KeyboardInterrupt" not in out, (prog, out)
            assert out.strip().splitlines()[-1].startswith(f"{prog}: interrupted (SIGINT): stopped "
                                                           "the launch"), (prog, out)
            ranks = {int(f.read_text()) for f in d.glob("rank*.pid")}
            assert ranks <= {q.pid for q in trees[prog]}           # the launch's own processes
            left = [q for q in trees[prog] if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]
            assert left == [], (prog, left)
    finally:                 # nothing of the test's left running, whatever failed
        for q in [q for tree in trees.values() for q in tree]:
            with contextlib.suppress(psutil.Error):
                q.kill()
        for _, p in runs.values():
            p.kill()
            p.wait()
