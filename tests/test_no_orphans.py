"""A rank killed with SIGKILL leaves no process of its own behind (issue 27): the
``multiprocessing`` children a rank started (here a spawn ``Manager``, as Megatron's
dist_checkpointing starts one) end with it, whichever launcher started the rank.

Found after a fresh-clone run of the suite: the spawn Manager of a rank SIGKILLed by
test_checkpoint_faults' Megatron kill case, alive 25 minutes later (parent gone, 270 MB).
Every process of a launch here carries a marker in its environment, so what is left is found
by the marker (:func:`harness.leftovers`), whatever it was re-parented to.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid

import pytest
from harness import ENV, leftovers

# a rank that starts a spawn Manager (a server process waiting on a futex, as Megatron's), says
# its pid, then is SIGKILLed; with "--ok" it ends normally instead (the Manager left running)
RANK = """
import multiprocessing, os, signal, sys
if __name__ == "__main__" and (os.environ.get("RANK", "0") == "1" or "--ok" in sys.argv):
    m = multiprocessing.get_context("spawn").Manager()
    print("MANAGER", m._process.pid, flush=True)
    if "--ok" not in sys.argv:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)
"""


def _marked() -> dict:
    return {"DS_AUTOPLAN_TEST_MARK": uuid.uuid4().hex}


def _gone(mark: str) -> list:
    return leftovers(mark, wait=10.0)


@pytest.mark.parametrize("how", ["killed", "ended"])
def test_spawn_sweeps_what_a_rank_left(tmp_path, how):
    """runtime.launch.spawn (tests, benchmarks, the profiler): each rank leads a process group,
    swept when the rank has ended."""
    from ds_autoplan.runtime.launch import spawn
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = _marked()
    outs = spawn([str(script)] + (["--ok"] if how == "ended" else []), 2, timeout=60, grace=30,
                 env=env, prebuild=False)
    assert any("MANAGER" in out for _, out in outs), outs
    if how == "killed":
        assert outs[1][0] == -9, outs
    assert _gone(env["DS_AUTOPLAN_TEST_MARK"]) == []


def test_rank_of_deepspeed_autoplan_killed_leaves_nothing(tmp_path):
    """A rank of ``deepspeed --autoplan`` / ``ds-autoplan launch`` (ds_autoplan's bootstrap),
    started as DeepSpeed's per-node launcher starts it (in the launcher's process group), is
    SIGKILLed: its Manager ends with it."""
    script = tmp_path / "train.py"
    script.write_text(RANK)
    blob = base64.urlsafe_b64encode(json.dumps({"out": str(tmp_path / "o")}).encode()).decode()
    env = dict(os.environ, **ENV, **_marked(), RANK="1", DS_ACCELERATOR="cpu")
    r = subprocess.run([sys.executable, "-m", "ds_autoplan.clients.bootstrap", f"--ds-autoplan={blob}",
                        str(script)], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == -9 and "MANAGER" in r.stdout, r.stdout + r.stderr
    assert _gone(env["DS_AUTOPLAN_TEST_MARK"]) == []


def test_ranks_die_with_their_launcher(tmp_path):
    """What left two ranks of tests/test_swap.py training 44 minutes with no parent: the test
    session that ran ``spawn`` was killed (a timeout's signal runs no ``finally``).  A killed
    launcher takes its ranks, and what they started, with it."""
    import signal
    import time
    script = tmp_path / "rank.py"
    script.write_text("import multiprocessing, os, time\n"
                      "if __name__ == '__main__':\n"
                      "    m = multiprocessing.get_context('spawn').Manager()\n"
                      f"    open(os.path.join({str(tmp_path)!r}, 'up' + os.environ['RANK']), 'w').close()\n"
                      "    time.sleep(300)\n")
    env = dict(os.environ, **ENV, **_marked())
    launcher = subprocess.Popen([sys.executable, "-c", "from ds_autoplan.runtime.launch import spawn; "
                                 f"spawn([{str(script)!r}], 2, timeout=600, prebuild=False)"],
                                env=env, stdin=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not all((tmp_path / f"up{r}").exists() for r in range(2)) and time.time() < deadline:
        time.sleep(0.1)
    assert all((tmp_path / f"up{r}").exists() for r in range(2)), "the ranks did not start"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert _gone(env["DS_AUTOPLAN_TEST_MARK"]) == []
