"""Start-up watchdog: a rank stuck at start-up says where it waits and exits
non-zero; a live extension build is never interrupted.  Every lock lives in a TEMPORARY
TORCH_EXTENSIONS_DIR (the real ~/.cache/torch_extensions is never touched)."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from ds_autoplan.runtime import watchdog

# seconds: a rank meets the lock well under a second into the watched start-up (measured: it
# waits at the lock 0.3 s in, on 2 cores at load 10), so 3 s is far above that
TIMEOUT = 3


def _stale_lock(tmp_path):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    return lock


def _python(code, tmp_path, timeout=60):
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    return subprocess.run([sys.executable, str(script)], env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_stale_lock_run_exits_within_the_watchdog_time_naming_the_lock(tmp_path):
    pytest.importorskip("deepspeed")
    from ds_autoplan.runtime.launch import spawn
    lock = _stale_lock(tmp_path)
    # DS_AUTOPLAN_SHM=1: the ranks JIT-load DeepSpeed's shm comm op and meet the stale lock
    # (prebuild=False: the launcher must not meet it first)
    env = dict(DS_AUTOPLAN_SHM="1", TORCH_EXTENSIONS_DIR=str(tmp_path),
               DS_AUTOPLAN_INIT_TIMEOUT=str(TIMEOUT))
    start = "from ds_autoplan.runtime.deepspeed.dist import init_distributed; init_distributed()"
    outs = spawn(["-c", start], 2, timeout=150, env=env, prebuild=False)
    for rc, out in outs:
        assert rc == watchdog.EXIT_CODE, out
        assert f"rm {lock}" in out, out
        waited = float(re.search(r"after (\d+) s", out).group(1))
        assert TIMEOUT <= waited <= TIMEOUT + 2, out
        assert "baton.wait()" in out          # where it waits: torch's lock loop
    assert lock.exists()                      # the watchdog reports, it does not delete


def test_no_lock_reports_where_the_main_thread_waits(tmp_path):
    r = _python("""
        import time
        from ds_autoplan.runtime.watchdog import startup_watchdog
        with startup_watchdog("a test start-up", timeout=1):
            time.sleep(30)
        """, tmp_path)
    assert r.returncode == watchdog.EXIT_CODE, r.stderr
    assert "has not finished a test start-up" in r.stderr
    assert "No extension build lock found" in r.stderr
    assert "time.sleep(30)" in r.stderr


def test_a_live_build_is_waited_for_not_killed(tmp_path):
    lock = _stale_lock(tmp_path)
    # a process working inside the op's build folder = a build in progress (ninja, compiler)
    builder = subprocess.Popen(["sleep", "60"], cwd=lock.parent)
    try:
        assert builder.pid in watchdog.build_in_progress(str(tmp_path))
        r = _python("""
            import time
            from ds_autoplan.runtime.watchdog import startup_watchdog
            with startup_watchdog("a test start-up", timeout=0.5):
                time.sleep(1.7)       # the watchdog looks three times
            print("finished")
            """, tmp_path)
    finally:
        builder.kill()
        builder.wait()
    assert r.returncode == 0, r.stderr
    assert "finished" in r.stdout
    assert "not interrupting it" in r.stderr
    assert watchdog.build_in_progress(str(tmp_path)) == []


def test_timeout_setting(monkeypatch):
    monkeypatch.setenv(watchdog.ENV, "2.5")
    assert watchdog.init_timeout() == 2.5
    monkeypatch.delenv(watchdog.ENV)
    assert watchdog.init_timeout() == watchdog.DEFAULT_TIMEOUT
    monkeypatch.setenv(watchdog.ENV, "soon")
    with pytest.raises(ValueError, match=watchdog.ENV):
        watchdog.init_timeout()
