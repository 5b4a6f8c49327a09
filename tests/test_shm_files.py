"""DeepSpeed's CPU allreduce op leaves one /dev/shm file per rank and launch (RAM until the
machine restarts): ds_autoplan removes those no live process maps, and a rank its own at exit.
The end-to-end check (a launch leaves none) is in test_clients_deepspeed.py."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys

from ds_autoplan.runtime.deepspeed import shm


def _make(folder, name, size=4096):
    p = os.path.join(folder, name)
    with open(p, "wb") as fh:
        fh.write(b"\0" * size)
    return p


def test_sweep_removes_only_unmapped_files_of_this_user(tmp_path):
    uid = os.getuid()
    left = _make(tmp_path, f"{shm.PREFIX}_{uid}_127.0.0.1_29500_0")
    live = _make(tmp_path, f"{shm.PREFIX}_{uid}_127.0.0.1_29500_1")
    other = _make(tmp_path, f"{shm.PREFIX}_{uid + 1}_127.0.0.1_29500_0")
    unrelated = _make(tmp_path, "torch_shm_something")
    with open(live, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as m:   # a live rank maps its file
        gone = shm.sweep(str(tmp_path))
        assert m[0] == 0
    assert gone == [os.path.basename(left)]
    assert not os.path.exists(left)
    assert all(os.path.exists(p) for p in (live, other, unrelated))


def test_a_launch_sweeps_only_its_own_files(tmp_path):
    """A launch that ends removes its own ranks' files, not those of a launch on another port
    whose ranks are starting (a file exists unmapped until its rank has written and mapped it)."""
    uid = os.getuid()
    mine = _make(tmp_path, f"{shm.PREFIX}_{uid}_127.0.0.1_29500_1")
    starting = _make(tmp_path, f"{shm.PREFIX}_{uid}_127.0.0.1_29501_0")
    assert shm.leftovers(str(tmp_path), port=29500) == [os.path.basename(mine)]
    assert shm.sweep(str(tmp_path), port=29500) == [os.path.basename(mine)]
    assert not os.path.exists(mine) and os.path.exists(starting)


def test_a_rank_removes_its_own_file_at_exit(tmp_path, monkeypatch):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", RANK="3")
    name = shm.own_name(env)
    assert name == f"{shm.PREFIX}_{os.getuid()}_127.0.0.1_29999_3"
    path = _make(tmp_path, name)
    code = ("import sys; from ds_autoplan.runtime.deepspeed import shm; "
            f"shm.SHM_DIR = {str(tmp_path)!r}; shm.unlink_at_exit(); "
            f"assert shm.own_name() == {name!r}")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(path)
    assert shm.own_name({}) is None
