"""Fault injection for every command that writes files (docs/reliability.md "Output
files" and "patch deepspeed"): the user's files next to the outputs stay untouched, targets of
the wrong kind (FIFO, device node, socket, file, dangling symlink, a parent that is a file) are
refused before anything is written, symlinks are written through, a SIGKILL during a write
leaves whole files and nothing the next run does not clean, stale files are only ever the
last run's own, concurrent writers leave one consistent set, modes follow the umask, a
read-only file system is one error line; the DeepSpeed launcher patch survives interrupted
writes and detects a reinstall (on a copy of runner.py, never the installed one)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ds_autoplan import outputs
from ds_autoplan.cli import main
from ds_autoplan.outputs import LAUNCH_LOCK, MANIFEST

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--model", "gpt-tiny", "--cluster", "cpu-2", "--global-batch", "8", "--quiet"]


def _user_files(d: Path) -> dict:
    """The user's own project: a script, a config and a data folder."""
    (d / "data").mkdir(parents=True, exist_ok=True)
    files = {"train.py": "print('mine')\n", "ds_config.json": '{"train_batch_size": 3}\n',
             "data/x.txt": "precious\n", "notes.md": "# mine\n"}
    for k, v in files.items():
        (d / k).write_text(v)
    return files


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in d.rglob("*")}


def _stamp(p: Path) -> dict:
    """The manifest's record of a file ds-autoplan wrote."""
    return {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "inode": p.stat().st_ino}


def _temps(d: Path) -> list:
    return [p.name for p in d.rglob("*") if outputs.TMP_TAG in p.name]


def _fifo(d: Path) -> Path:
    p = d / "fifo"
    os.mkfifo(p)
    return p


def _device(d: Path) -> Path:
    p = d / "null"
    if os.geteuid() != 0:
        pytest.skip("device nodes need root (os.mknod); not running as root")
    try:
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError as e:
        pytest.skip(f"os.mknod refused here: {e}")
    return p


def _socket(d: Path) -> Path:
    p = d / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()
    return p


def _regular(d: Path) -> Path:
    p = d / "file.txt"
    p.write_text("mine\n")
    return p


def _dangling(d: Path) -> Path:
    p = d / "dangling"
    p.symlink_to(d / "nowhere")
    return p


def _parent_is_file(d: Path) -> Path:
    return _regular(d) / "out"


WRONG_FOLDER = {"fifo": _fifo, "device": _device, "socket": _socket, "file": _regular,
                "dangling": _dangling, "parent-file": _parent_is_file}
def _folder(d: Path) -> Path:
    p = d / "a-folder"
    p.mkdir()
    return p


WRONG_FILE = {"fifo": _fifo, "device": _device, "socket": _socket, "folder": _folder,
              "dangling": _dangling, "parent-file": _parent_is_file}


def _refused(args, kind, capsys, command):
    """Run the command (a FIFO target in its own process under a timeout: it must not hang;
    the rest in this one) and check it is refused with one error line."""
    if kind == "fifo":
        r = subprocess.run([sys.executable, "-m", "ds_autoplan", *args], capture_output=True,
                           text=True, timeout=120)
        rc, err = r.returncode, r.stderr
    else:
        rc, err = main(args), capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"ds-autoplan {command}: error:") and err.count("\n") == 1, err


# ----------------------------------------------------------------------------- plan --out
def test_plan_out_dot_keeps_the_users_files(tmp_path, capsys):
    """`--out .` in a project folder: the user's train.py, data/ and notes stay as they were;
    a user ds_config.json is a clash refused before anything is written."""
    proj = tmp_path / "proj"
    _user_files(proj)
    (proj / "ds_config.json").unlink()
    before = _snapshot(proj)
    assert main(PLAN + ["--out", str(proj)]) == 0
    after = _snapshot(proj)
    assert {k: v for k, v in after.items() if k in before} == before
    written = set(after) - set(before)
    assert written == {"plan.json", "ds_config.json", "megatron.json", "megatron_args.txt",
                       "report.md", "memory_per_stage.png", MANIFEST}
    manifest = json.loads((proj / MANIFEST).read_text())["files"]
    assert set(manifest) == written - {MANIFEST}
    for name, stamps in manifest.items():
        assert stamps == [_stamp(proj / name)]
    # again, with a different plan: our files replaced, the user's untouched
    assert main(PLAN[:-2] + ["16", "--quiet", "--out", str(proj)]) == 0
    assert json.loads((proj / "plan.json").read_text())["global_batch_size"] == 16
    assert {k: v for k, v in _snapshot(proj).items() if k in before} == before


def test_plan_out_refuses_a_users_config_and_an_edited_output(tmp_path, capsys):
    proj = tmp_path / "proj"
    _user_files(proj)
    before = _snapshot(proj)
    assert main(PLAN + ["--out", str(proj)]) == 2
    err = capsys.readouterr().err
    assert "ds_config.json was not written by ds-autoplan" in err and err.count("\n") == 1
    assert _snapshot(proj) == before                        # nothing written at all
    out = tmp_path / "out"
    assert main(PLAN + ["--out", str(out)]) == 0
    (out / "report.md").write_text("my notes on the plan\n")      # the user edits an output
    snap = _snapshot(out)
    assert main(PLAN + ["--out", str(out)]) == 2
    assert "report.md was changed since ds-autoplan wrote it" in capsys.readouterr().err
    assert _snapshot(out) == snap


@pytest.mark.parametrize("kind", sorted(WRONG_FOLDER))
def test_plan_out_of_the_wrong_kind_is_refused_before_writing(tmp_path, kind, capsys):
    target = WRONG_FOLDER[kind](tmp_path)
    before = _snapshot(tmp_path)
    _refused(PLAN + ["--out", str(target)], kind, capsys, "plan")
    assert _snapshot(tmp_path) == before
    st = os.lstat(target) if os.path.lexists(target) else None
    if kind in ("fifo", "device", "socket"):
        assert st is not None and not stat.S_ISDIR(st.st_mode)      # still what it was


def test_plan_out_empty_is_an_error(capsys):
    assert main(PLAN + ["--out", ""]) == 2
    assert "--out needs a path" in capsys.readouterr().err


def test_plan_out_through_a_symlink_to_a_folder(tmp_path):
    (tmp_path / "real").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    assert main(PLAN + ["--out", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(tmp_path / "real")
    assert (tmp_path / "real" / "plan.json").is_file()
    assert main(PLAN + ["--out", str(link)]) == 0                # and again
    assert link.is_symlink()


def test_plan_out_missing_parents_are_created_with_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        assert main(PLAN + ["--out", str(tmp_path / "a" / "b" / "out")]) == 0
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "out"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o750, p
    for p in (tmp_path / "a" / "b" / "out").iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o640, p


def test_stale_files_are_only_the_last_runs_own(tmp_path):
    """pp=2 writes gantt.png and memory.png, pp=1 does not: the next run removes them, but
    not a user file, nor a plot the user changed (then it is theirs)."""
    out = tmp_path / "out"
    assert main(PLAN + ["--pp", "2", "--out", str(out)]) == 0
    assert (out / "gantt.png").exists() and (out / "memory.png").exists()
    (out / "mine.txt").write_text("mine\n")
    with open(out / "memory.png", "ab") as fh:      # the user annotates one plot
        fh.write(b"x")
    assert main(PLAN + ["--pp", "1", "--out", str(out)]) == 0
    assert not (out / "gantt.png").exists()
    assert (out / "memory.png").exists() and (out / "mine.txt").read_text() == "mine\n"
    assert "memory.png" not in json.loads((out / MANIFEST).read_text())["files"]


@pytest.mark.parametrize("fmt", ["ds-autoplan-outputs/1", outputs.MANIFEST_FORMAT])
def test_a_crafted_or_copied_manifest_owns_nothing(tmp_path, capsys, fmt):
    """A manifest naming the user's files with their true sha256 (crafted, or copied beside
    them; the older name -> sha256 format and the current one, whose inodes cannot be the
    user's files'): ``plan --out`` neither replaces ``ds_config.json`` (a clash, one line) nor
    removes ``notes.md`` -- only the files ds-autoplan wrote there themselves count as its own
    (was: both gone).  A copied output folder's files are refused as copies, not overwritten."""
    proj = tmp_path / "proj"
    _user_files(proj)

    def entry(name):
        h = hashlib.sha256((proj / name).read_bytes()).hexdigest()
        return h if fmt.endswith("/1") else {"sha256": h, "inode": 1}
    (proj / MANIFEST).write_text(json.dumps({"format": fmt, "files": {
        n: [entry(n)] for n in ("notes.md", "ds_config.json")}}))
    before = _snapshot(proj)
    rc, err = main(PLAN + ["--out", str(proj)]), capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "ds_config.json " in err, err
    assert _snapshot(proj) == before
    (proj / "ds_config.json").unlink()
    del before["ds_config.json"], before[MANIFEST]
    assert main(PLAN + ["--out", str(proj)]) == 0
    assert {k: v for k, v in _snapshot(proj).items() if k in before} == before   # notes.md kept
    copy = tmp_path / "copy"
    shutil.copytree(proj, copy)
    rc, err = main(PLAN + ["--out", str(copy)]), capsys.readouterr().err
    assert rc == 2 and "plan.json is not the file ds-autoplan wrote there" in err, err


def test_a_readonly_file_system_is_one_line(tmp_path, monkeypatch, capsys):
    """Root ignores permission bits (CI runs as root) and a read-only bind mount needs
    privileges: EROFS is injected where the writer creates files and folders."""
    def erofs(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(outputs, "_new_temp", erofs)
    monkeypatch.setattr(outputs.os, "mkdir", erofs)
    for args in (PLAN + ["--out", str(tmp_path / "out")],
                 ["simulate", "--plot", str(tmp_path / "g.png")],
                 ["simulate", "--save", str(tmp_path / "s.json")]):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert "Read-only file system" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_a_readonly_folder_is_one_line(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(PLAN + ["--out", str(ro)]) == 2
        assert "Permission denied" in capsys.readouterr().err
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


KILLER = textwrap.dedent("""
    import os, sys, time
    from ds_autoplan import outputs
    from ds_autoplan.cli import main
    ready, at = sys.argv[1], int(sys.argv[2])
    seen = []
    def slow(path):                 # between a file's temporary copy and its os.replace
        seen.append(path)
        if len(seen) == at:
            open(ready, "w").close()
            time.sleep(60)
    outputs._before_replace = slow
    sys.exit(main(sys.argv[3:]))
""")


@pytest.mark.parametrize("at", [1, 4])
def test_sigkill_during_a_write_leaves_whole_files(tmp_path, at):
    out, ready = tmp_path / "out", tmp_path / "ready"
    _user_files(out)
    (out / "ds_config.json").unlink()
    user = _snapshot(out)
    assert main(PLAN + ["--out", str(out)]) == 0
    old = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != MANIFEST}
    proc = subprocess.Popen([sys.executable, "-c", KILLER, str(ready), str(at),
                             *PLAN[:-2], "16", "--quiet", "--out", str(out)])
    try:
        for _ in range(1200):
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), "the writer never reached os.replace"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # every output is whole: the old file or the new one
    assert _plan_batch(out / "plan.json") in (8, 16)
    for name in old:
        if name.endswith(".json"):
            json.loads((out / name).read_text())
    assert {k: v for k, v in _snapshot(out).items() if k in user} == user
    assert not [p for p in out.iterdir() if p.is_dir() and p.name != "data"]     # no stray folder
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds-autoplan")]
    # the next run owns the folder, cleans the killed writer's temporary files, succeeds
    assert main(PLAN[:-2] + ["32", "--quiet", "--out", str(out)]) == 0
    assert _temps(out) == []
    assert json.loads((out / "plan.json").read_text())["global_batch_size"] == 32
    assert {k: v for k, v in _snapshot(out).items() if k in user} == user


def _plan_batch(path: Path) -> int:
    from ds_autoplan.plan import Plan
    return Plan.load(path).global_batch_size


def test_concurrent_writers_leave_one_consistent_set(tmp_path):
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-m", "ds_autoplan", *PLAN[:-2], str(b), "--quiet",
                               "--out", str(out)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for b in (8, 16, 32)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    manifest = json.loads((out / MANIFEST).read_text())["files"]
    on_disk = {p.name for p in out.iterdir()} - {MANIFEST}
    assert set(manifest) == on_disk and _temps(out) == []
    for name, stamps in manifest.items():
        assert stamps == [_stamp(out / name)]
    batch = json.loads((out / "plan.json").read_text())["global_batch_size"]
    cfg = json.loads((out / "ds_config.json").read_text())
    assert cfg["train_batch_size"] == batch                       # files of one run


# ----------------------------------------------------------------------------- simulate
@pytest.mark.parametrize("kind", sorted(WRONG_FILE))
def test_simulate_plot_and_save_targets_of_the_wrong_kind(tmp_path, kind, capsys):
    _user_files(tmp_path)
    target = WRONG_FILE[kind](tmp_path)
    before = _snapshot(tmp_path)
    for opt in ("--plot", "--memory-plot", "--save"):
        _refused(["simulate", "-d", "2", "-n", "2", opt, str(target)], kind, capsys, "simulate")
        assert _snapshot(tmp_path) == before


def test_simulate_writes_only_the_files_it_is_given(tmp_path, capsys):
    _user_files(tmp_path)
    before = _snapshot(tmp_path)
    real = tmp_path / "plots"
    real.mkdir()
    (real / "g.png").write_bytes(b"old")
    link = tmp_path / "g.png"
    link.symlink_to(real / "g.png")                      # a symlink to a file: written through
    assert main(["simulate", "-d", "2", "-n", "2", "--plot", str(link)]) == 0
    assert link.is_symlink() and (real / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert {k: v for k, v in _snapshot(tmp_path).items() if k in before} == before
    assert sorted(p.name for p in real.iterdir()) == ["g.png"]
    assert main(["simulate", "--compare", "1f1b,gpipe", "-d", "2", "-n", "2",
                 "--plot", str(real / "c.svg")]) == 0            # documented: -SCHEDULE names
    assert sorted(p.name for p in real.iterdir()) == ["c-1f1b.svg", "c-gpipe.svg", "g.png"]


def test_simulate_files_are_written_together(tmp_path, monkeypatch, capsys):
    """``--save s.json --plot s.png``: the plot fails on a full disk (ENOSPC injected while it
    renders) -- neither file changes (was: s.json replaced, s.png not), one error line, no
    temporary file left."""
    from ds_autoplan.schedule import plots
    for name in ("s.json", "s.png"):
        (tmp_path / name).write_text("old\n")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(plots, "plot_gantt", full)
    rc = main(["simulate", "-d", "2", "-n", "2", "--save", str(tmp_path / "s.json"), "--plot",
               str(tmp_path / "s.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "No space left on device" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.png"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {"old\n"}


# ----------------------------------------------------------------------------- profile
@pytest.mark.parametrize("kind", sorted(WRONG_FILE))
def test_profile_out_of_the_wrong_kind_is_refused_before_measuring(tmp_path, kind, capsys):
    target = WRONG_FILE[kind](tmp_path)
    before = _snapshot(tmp_path)
    for opt in ("--out", "--policy-out", "--hardware"):
        _refused(["profile", "gpt-tiny", "--repeats", "1", "--warmup", "0", opt, str(target)]
                 + (["--out", str(tmp_path / "p.json")] if opt != "--out" else []), kind, capsys,
                 "profile")
        assert _snapshot(tmp_path) == before


def test_profile_hardware_never_replaces_an_existing_file(tmp_path, capsys):
    """``--hardware FILE`` names an output; an existing FILE may be the cluster file the user
    meant to read: refused in one line before measuring (was: overwritten), unless --force."""
    mine = tmp_path / "cluster.yaml"
    mine.write_text("name: mine\n")
    assert main(["profile", "--hardware", str(mine)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--hardware {mine} exists: refusing to replace it" in err, err
    assert "--force" in err and mine.read_text() == "name: mine\n"


def test_profile_writes_only_its_out(tmp_path, capsys, monkeypatch):
    _user_files(tmp_path)
    before = _snapshot(tmp_path)
    args = ["profile", "gpt-tiny-4", "--repeats", "1", "--warmup", "0", "--stages", "2",
            "--out", str(tmp_path / "p.json")]
    assert main(args) == 0
    assert set(_snapshot(tmp_path)) - set(before) == {"p.json"}      # no p.policy.json
    assert main(args + ["--policy-out", str(tmp_path / "pol.json")]) == 0
    assert set(_snapshot(tmp_path)) - set(before) == {"p.json", "pol.json"}
    assert json.loads((tmp_path / "pol.json").read_text())["units_per_stage"]
    capsys.readouterr()

    def erofs(*a, **k):                      # a read-only file system (see above)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(outputs, "_new_temp", erofs)
    snap = _snapshot(tmp_path)
    assert main(args + ["--policy-out", str(tmp_path / "pol.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-autoplan profile: error:") and "Read-only file system" in err
    assert err.count("\n") == 1 and _snapshot(tmp_path) == snap


# ----------------------------------------------------------------------------- launch --out
def _launch_args(tmp_path):
    """DeepSpeed's parsed launcher arguments, as far as ds-autoplan reads them (a local launch)."""
    from ds_autoplan.runtime.launch import free_port
    return SimpleNamespace(no_python=False, module=False, user_script=str(tmp_path / "train.py"),
                           user_args=[], hostfile=str(tmp_path / "no-hostfile"), include="", exclude="",
                           num_nodes=-1, num_gpus=2, master_port=free_port())


def test_launch_out_dot_never_writes_the_users_ds_config(tmp_path, monkeypatch):
    from ds_autoplan.cli.launch_cmd import MERGED_CONFIG, apply_autoplan
    user = _user_files(tmp_path)
    before = _snapshot(tmp_path)
    env = {}
    opts = apply_autoplan(_launch_args(tmp_path), {"localhost": [0, 1]}, env, model="gpt-tiny", cluster="cpu-2",
                          global_batch=8, out=str(tmp_path))
    assert opts["out"] == str(tmp_path) and env["DS_AUTOPLAN_PLAN"] == str(tmp_path / "plan.json")
    assert {k: v for k, v in _snapshot(tmp_path).items() if k in before} == before
    assert (tmp_path / "ds_config.json").read_text() == user["ds_config.json"]
    # and the launch's hold on the folder while it runs (outputs.hold_for_launch)
    assert set(_snapshot(tmp_path)) - set(before) == {"plan.json", MERGED_CONFIG, MANIFEST, LAUNCH_LOCK}


def test_launch_leaves_no_out_folder_when_planning_fails(tmp_path):
    from ds_autoplan.cli import UserError
    from ds_autoplan.cli.launch_cmd import apply_autoplan
    with pytest.raises(UserError):
        apply_autoplan(_launch_args(tmp_path), {"localhost": [0, 1]}, {}, model="no-such-model", cluster="cpu-2",
                       global_batch=8, out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "device", "file", "dangling", "empty"])
def test_launch_out_of_the_wrong_kind_is_refused(tmp_path, kind):
    from ds_autoplan.cli import UserError
    from ds_autoplan.cli.launch_cmd import apply_autoplan
    target = "" if kind == "empty" else str(WRONG_FOLDER[kind](tmp_path))
    before = _snapshot(tmp_path)
    with pytest.raises(UserError):
        apply_autoplan(_launch_args(tmp_path), {"localhost": [0, 1]}, {}, model="gpt-tiny", cluster="cpu-2",
                       global_batch=8, out=target)
    assert _snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- write_folder
def test_write_folder_partial_sets_keep_the_other_files(tmp_path):
    """`complete=False` (launch: the launcher writes plan + config, rank 0 the profile):
    nothing of the earlier writes is removed."""
    outputs.write_folder(tmp_path, {"a.json": outputs.text("1")}, complete=False)
    outputs.write_folder(tmp_path, {"b.json": outputs.text("2")}, complete=False)
    assert set(json.loads((tmp_path / MANIFEST).read_text())["files"]) == {"a.json", "b.json"}
    outputs.write_folder(tmp_path, {"b.json": outputs.text("3")}, complete=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "b.json"]


def test_only_a_killed_writers_temporary_files_are_removed(tmp_path):
    """A temporary file a live writer holds (flock) stays; one nobody holds (its writer was
    killed) goes; other hidden files stay."""
    live = outputs._new_temp(str(tmp_path), "plan.json")
    dead = tmp_path / f".plan.json.999999-0badc0de{outputs.TMP_TAG}.json"
    dead.write_text("{")
    (tmp_path / ".plan.json.mine").write_text("x")
    assert outputs.clean_temps(str(tmp_path)) == [dead.name]
    assert os.path.exists(live) and (tmp_path / ".plan.json.mine").exists()
    outputs._release(live, remove=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".plan.json.mine"]


def test_a_failing_writer_changes_nothing(tmp_path):
    outputs.write_folder(tmp_path, {"a.txt": outputs.text("old")})

    def boom(path):
        raise RuntimeError("renderer failed")
    with pytest.raises(RuntimeError):
        outputs.write_folder(tmp_path, {"a.txt": outputs.text("new"), "b.png": boom})
    assert (tmp_path / "a.txt").read_text() == "old" and _temps(tmp_path) == []
    with pytest.raises(RuntimeError):
        outputs.write_folder(tmp_path / "fresh", {"b.png": boom})
    assert not (tmp_path / "fresh").exists()


# ----------------------------------------------------------------------------- patch deepspeed
@pytest.fixture
def runner_copy(tmp_path, monkeypatch):
    """A copy of the installed runner.py; `ds-autoplan patch deepspeed` pointed at it."""
    from ds_autoplan.cli import patch_cmd
    pytest.importorskip("deepspeed")
    real, version = patch_cmd.runner_file()
    copy = tmp_path / "launcher" / "runner.py"
    copy.parent.mkdir()
    copy.write_text(patch_cmd.unpatched(Path(real).read_text()))
    copy.chmod(0o644)
    monkeypatch.setattr(patch_cmd, "runner_file", lambda: (str(copy), version))
    return copy


def test_patch_keeps_the_original_and_reverts_byte_for_byte(runner_copy, capsys):
    from ds_autoplan.cli import patch_cmd
    orig = runner_copy.read_bytes()
    assert main(["patch", "deepspeed"]) == 0
    assert patch_cmd.MARK in runner_copy.read_text()
    assert Path(patch_cmd.backup_file(str(runner_copy))).read_bytes() == orig
    assert stat.S_IMODE(runner_copy.stat().st_mode) == 0o644
    assert main(["patch", "deepspeed", "--check"]) == 0
    assert "--autoplan applied" in capsys.readouterr().out
    assert main(["patch", "deepspeed", "--revert"]) == 0
    assert runner_copy.read_bytes() == orig
    assert sorted(p.name for p in runner_copy.parent.iterdir()) == ["runner.py"]


def test_patch_interrupted_by_a_full_disk_leaves_the_launcher_whole(runner_copy, monkeypatch,
                                                                    capsys):
    """ENOSPC in the middle of writing the patched launcher: runner.py is the old one, no
    temporary file stays, and patching again works."""
    orig = runner_copy.read_bytes()
    real_fill = outputs.text

    def full_disk(content):
        def fill(path):
            with open(path, "w") as fh:
                fh.write(content[: len(content) // 2])
            if "ds_autoplan" in content:              # the patched text, not the backup
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fill(content)(path)
        return fill
    monkeypatch.setattr(outputs, "text", full_disk)
    assert main(["patch", "deepspeed"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert runner_copy.read_bytes() == orig and _temps(runner_copy.parent) == []
    compile(runner_copy.read_text(), "runner.py", "exec")
    monkeypatch.setattr(outputs, "text", real_fill)
    assert main(["patch", "deepspeed"]) == 0
    assert main(["patch", "deepspeed", "--revert"]) == 0 and runner_copy.read_bytes() == orig


def test_revert_restores_a_launcher_damaged_by_an_interrupted_write(runner_copy, capsys):
    """An older in-place write left runner.py empty: --revert restores the kept original."""
    from ds_autoplan.cli import patch_cmd
    orig = runner_copy.read_bytes()
    assert main(["patch", "deepspeed"]) == 0
    runner_copy.write_text("")                                   # what an in-place write left
    assert main(["patch", "deepspeed", "--check"]) == 0
    assert "damaged" in capsys.readouterr().out
    assert main(["patch", "deepspeed"]) == 2                    # patching it is refused
    assert "--revert" in capsys.readouterr().err
    assert main(["patch", "deepspeed", "--revert"]) == 0
    assert "restored from the backup" in capsys.readouterr().out
    assert runner_copy.read_bytes() == orig
    assert not os.path.exists(patch_cmd.backup_file(str(runner_copy)))


def test_a_reinstalled_deepspeed_is_detected(runner_copy, capsys):
    orig = runner_copy.read_bytes()
    assert main(["patch", "deepspeed"]) == 0
    runner_copy.write_bytes(orig)                 # pip reinstall: a fresh runner.py, backup left
    capsys.readouterr()
    assert main(["patch", "deepspeed", "--check"]) == 0
    out = capsys.readouterr().out
    assert "--autoplan lost" in out and "run `ds-autoplan patch deepspeed` again" in out
    assert main(["patch", "deepspeed"]) == 0 and "patched" in capsys.readouterr().out
    assert main(["patch", "deepspeed", "--revert"]) == 0 and runner_copy.read_bytes() == orig


@pytest.mark.parametrize("kind", ["fifo", "file", "dangling"])
def test_deepspeed_autoplan_bad_out_is_one_line(tmp_path, kind, capsys):
    """What the patched launcher calls (`deepspeed --autoplan` with DS_AUTOPLAN_OUT): a bad
    target is one `ds-autoplan: error:` line and exit 2, before anything is written (an empty
    DS_AUTOPLAN_OUT counts as unset, as every DS_AUTOPLAN_* variable: ds_autoplan.env)."""
    from ds_autoplan.cli import launch_cmd, patch_cmd
    assert "launch_cmd import autoplan_in_runner" in "".join(
        line for _, lines, _ in patch_cmd._EDITS for line in lines)
    target = str(WRONG_FOLDER[kind](tmp_path))
    before = _snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        launch_cmd.autoplan_in_runner(_launch_args(tmp_path), 2, {"DS_AUTOPLAN_OUT": target})
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("ds-autoplan: error:") and err.count("\n") == 1
    assert _snapshot(tmp_path) == before
