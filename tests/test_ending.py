"""How a rank ends (ds_autoplan/runtime/ending.py): after its script, with a gloo group a library
still holds, ``finish`` runs the atexit handlers, flushes and leaves without the interpreter's
finalization (where a gloo worker thread taking the GIL aborts the process: "terminate called
without an active exception"); the exit status is the one given."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import atexit, datetime, os, sys, threading, time
    import torch, torch.distributed as dist
    from ds_autoplan.runtime.ending import finish

    class Marker:
        def __del__(self):
            os.write(1, b"FINALIZED\\n")
    MARK = Marker()                     # collected only by the interpreter's finalization
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    HELD = dist.new_group([0])          # as DeepSpeed's groups: referenced after the script
    dist.all_reduce(torch.ones(4), group=HELD)
    atexit.register(lambda: print("ATEXIT", "group" if dist.is_initialized() else "torn-down"))
    print("BUFFERED")                   # block-buffered on a pipe: only a flush writes it
    if sys.argv[2] == "thread":
        threading.Thread(target=time.sleep, args=(0.5,)).start()
    finish(3)
    print("NOT REACHED")
""")


def _run(tmp_path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "end.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "store"), mode], env=env,
                          capture_output=True, text=True, timeout=120)


def test_finish_leaves_without_finalizing_after_the_atexit_handlers(tmp_path):
    r = _run(tmp_path, "plain")
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.split() == ["BUFFERED", "ATEXIT", "torn-down"], r.stdout + r.stderr


def test_finish_with_a_thread_still_running_exits_as_python_would(tmp_path):
    """A non-daemon thread: ``finish`` cannot leave at once; Python's own exit waits for it."""
    r = _run(tmp_path, "thread")
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.split() == ["BUFFERED", "ATEXIT", "torn-down", "FINALIZED"], r.stdout + r.stderr

