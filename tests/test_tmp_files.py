"""What the suite's processes leave in the temporary folder (issue 33): a Manager server that a
rank's fast exit terminated left its pymp-* folder and listener socket; one whose forked case
was killed ran on, orphaned, with its socket; torchrun writes torchelastic_* logs there.  The
ranks now shut such servers down, forked cases take their process group with them, and the
session's TMPDIR is a folder of its own, removed at the end (tests/conftest.py)."""
import os
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANAGER = "import multiprocessing as mp; q = mp.get_context('spawn').Manager().Queue(); q.put(1)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:         # a zombie is gone but for its parent's wait
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _python(code: str, tmp) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join((ROOT, os.path.join(ROOT, "tests")))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_session_has_a_temporary_folder_of_its_own():
    tmp = os.environ["TMPDIR"]
    assert os.path.basename(tmp).startswith("ds-autoplan-tests-") and tempfile.gettempdir() == tmp
    assert os.path.isdir(tmp)


def test_a_rank_exit_shuts_its_manager_down(tmp_path):
    """launch._exit (a rank's end without the interpreter's teardown) ends a Manager as atexit
    would: its server exits by itself and removes its pymp-* folder."""
    p = _python(f"""
        {MANAGER}
        print(mp.active_children()[0].pid, flush=True)
        from ds_autoplan.runtime import launch
        launch._exit(0)""", tmp_path)
    assert p.returncode == 0, p.stderr
    server = int(p.stdout)
    deadline = time.time() + 10
    while _alive(server) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(server) and os.listdir(tmp_path) == []


def test_a_killed_forked_case_takes_its_processes_along(tmp_path):
    """A forked case SIGKILLed mid-save (the checkpoint fault cases) leaves its Manager server
    behind; fork_wait kills the child's process group once it has ended."""
    p = _python(f"""
        import os, signal
        from harness.forked import fork_wait
        def child():
            {MANAGER}
            with open({str(tmp_path / "server")!r}, "w") as f:
                f.write(str(mp.active_children()[0].pid))
            os.kill(os.getpid(), signal.SIGKILL)
        print(fork_wait(child, {str(tmp_path / "out")!r}, 60))""", tmp_path)
    assert p.returncode == 0 and p.stdout.split() == ["-9"], p.stdout + p.stderr
    server = int((tmp_path / "server").read_text())
    time.sleep(0.2)
    assert not _alive(server)
