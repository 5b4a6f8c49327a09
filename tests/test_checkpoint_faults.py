"""Fault injection for checkpoints (3 and 7): SIGKILL at every point of a
save (one process, and the DeepSpeed runtime on 2 ranks, and Megatron-core's), truncated,
deleted, changed and unlisted files, crafted pickles in every kind of checkpoint file, and
concurrent writers.  What must hold: the previous checkpoint stays loadable and ``latest``
names a complete tag; a damaged checkpoint is refused naming the file; no file runs code on
load (a crafted object's ``__reduce__`` would create a marker file)."""
from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import shutil
import signal
import time
import uuid

import pytest
import torch

from ds_autoplan.runtime import checkpoint_files as cf
from ds_autoplan.runtime.checkpoint_files import CheckpointError

HERE = pathlib.Path(__file__).resolve().parent


class Marker:
    """Unpickling it creates ``path``: the proof that a load ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _write(folder, content: str, n: int = 4):
    for i in range(n):
        torch.save({"w": torch.full((64,), float(i)), "tag": content}, os.path.join(folder, f"f{i}.pt"))
        cf.fault_point("file")


def _contents(folder) -> set:
    return {torch.load(os.path.join(folder, f), weights_only=True)["tag"]
            for f in os.listdir(folder) if f.endswith(".pt")}


def _in_child(fn) -> int:
    """Run ``fn`` in a forked child; its exit status (negative: killed by that signal)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _leftovers(parent) -> list:
    return [e for e in os.listdir(parent) if ".autoplan-" in e]


# -- one process: every kill point of a save -----------------------------------------------

SAVE_POINTS = ["staged", "file:2", "written", "manifest", "installed", "latest-tmp"]


@pytest.mark.parametrize("fault", SAVE_POINTS)
@pytest.mark.parametrize("same_tag", [True, False], ids=["resave-same-tag", "new-tag"])
def test_sigkill_at_every_point_of_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                         fault, same_tag):
    """Save tag t1 and ``latest``; a second save (the same tag again, or t2) is SIGKILLed at
    ``fault``: ``latest`` names a complete tag (t1's content, or the new one when the kill came
    after its rename) and the next save, of any tag, clears the staging folder the kill left."""
    def save(tag, content):
        cf.save_atomically(tmp_path / tag, lambda d: _write(d, content))
        cf.write_latest(tmp_path, tag)
    save("t1", "old")
    monkeypatch.setenv("DS_AUTOPLAN_CHECKPOINT_FAULT", fault)
    tag2 = "t1" if same_tag else "t2"
    assert _in_child(lambda: save(tag2, "new")) == -signal.SIGKILL
    latest = (tmp_path / "latest").read_text()
    assert latest == "t1" and cf.verify(tmp_path / "t1") == []
    renamed = fault in ("installed", "latest-tmp")        # killed after the new tag was in place
    assert _contents(tmp_path / "t1") == ({"new"} if same_tag and renamed else {"old"})
    if not same_tag:
        assert (tmp_path / "t2").exists() == renamed
        assert not renamed or (cf.verify(tmp_path / "t2") == [] and _contents(tmp_path / "t2") == {"new"})
    monkeypatch.delenv("DS_AUTOPLAN_CHECKPOINT_FAULT")
    save("t3", "third")         # another tag: the killed save's staging folder is removed too
    assert _contents(tmp_path / "t3") == {"third"} and _leftovers(tmp_path) == []
    save(tag2, "fourth")
    assert _contents(tmp_path / tag2) == {"fourth"} and _leftovers(tmp_path) == []


def test_a_kill_between_the_two_renames_of_the_fallback_swap_keeps_the_old_copy(tmp_path, monkeypatch):
    """Without an atomic exchange (file systems lacking RENAME_EXCHANGE) the old tag is moved
    aside first: killed then, loading finds the old copy (``resolve``), and the next save puts
    it back before replacing it."""
    monkeypatch.setattr(cf, "exchange", lambda a, b: False)
    final = tmp_path / "t1"
    cf.save_atomically(final, lambda d: _write(d, "old"))
    monkeypatch.setenv("DS_AUTOPLAN_CHECKPOINT_FAULT", "between-renames")
    assert _in_child(lambda: cf.save_atomically(final, lambda d: _write(d, "new"))) == -signal.SIGKILL
    assert not final.exists()
    found = cf.resolve(final)
    assert cf.verify(found) == [] and _contents(found) == {"old"}
    monkeypatch.delenv("DS_AUTOPLAN_CHECKPOINT_FAULT")
    cf.save_atomically(final, lambda d: _write(d, "new"))
    assert _contents(final) == {"new"} and _leftovers(tmp_path) == []


def test_sigkill_at_random_moments_of_slow_saves(tmp_path, monkeypatch):
    """An outside SIGKILL at random moments of a slowed save of the same tag: every time the
    tag verifies and holds one whole save's content."""
    import random
    rng = random.Random(7)
    final = tmp_path / "t"
    cf.save_atomically(final, lambda d: _write(d, "s0"))
    monkeypatch.setenv("DS_AUTOPLAN_CHECKPOINT_DELAY", "0.02")
    for i in range(1, 9):
        pid = os.fork()
        if pid == 0:
            cf.save_atomically(final, lambda d, i=i: _write(d, f"s{i}"))
            os._exit(0)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert cf.verify(cf.resolve(final)) == [], i
        assert len(_contents(cf.resolve(final))) == 1


def test_concurrent_writers_leave_one_complete_checkpoint(tmp_path, monkeypatch):
    """Two processes saving the same tag and ``latest`` at once (slowed to overlap): the tag
    verifies and holds one writer's whole content, no staging folder is left."""
    monkeypatch.setenv("DS_AUTOPLAN_CHECKPOINT_DELAY", "0.01")

    def writer(content):
        def run():
            for _ in range(3):
                cf.save_atomically(tmp_path / "t", lambda d: _write(d, content))
                cf.write_latest(tmp_path, "t")
        return run
    pids = []
    for c in ("a", "b"):
        pid = os.fork()
        if pid == 0:
            try:
                writer(c)()
                os._exit(0)
            except BaseException:
                os._exit(1)
        pids.append(pid)
    assert [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids] == [0, 0]
    assert cf.verify(tmp_path / "t") == [] and len(_contents(tmp_path / "t")) == 1
    assert (tmp_path / "latest").read_text() == "t" and _leftovers(tmp_path) == []


def test_a_failing_writer_leaves_the_existing_checkpoint_and_no_staging(tmp_path):
    cf.save_atomically(tmp_path / "t", lambda d: _write(d, "old"))

    def bad(d):
        _write(d, "new", n=2)
        raise OSError(28, "No space left on device")
    with pytest.raises(CheckpointError, match=f"cannot save {tmp_path / 't'}: No space left"):
        cf.save_atomically(tmp_path / "t", bad)
    assert _contents(tmp_path / "t") == {"old"} and _leftovers(tmp_path) == []


@pytest.mark.parametrize("fault", ["full-disk", "read-only", "no-space-for-the-manifest"])
def test_a_full_disk_or_a_read_only_file_system_is_one_line(tmp_path, monkeypatch, fault):
    """torch's zip writer on a full disk (``/dev/full``: its ``RuntimeError: [enforce fail at
    inline_container.cc]``), a read-only file system (EROFS injected: CI runs as root), no
    space left for the manifest: one :class:`CheckpointError` line naming the checkpoint (was:
    the raw error), the existing checkpoint kept, no staging folder left."""
    import errno
    cf.save_atomically(tmp_path / "t", lambda d: _write(d, "old"))
    write, want = (lambda d: _write(d, "new")), "No space left on device"
    if fault == "full-disk":
        write, want = (lambda d: torch.save({"w": torch.ones(10 ** 5)}, "/dev/full")), \
            "torch could not write a file of it (a full disk?"
    elif fault == "read-only":
        def mkdir(path, *a, **k):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        monkeypatch.setattr(cf.os, "mkdir", mkdir)
        want = "Read-only file system"
    else:
        real = json.dump

        def dump(obj, f, **kw):
            if isinstance(obj, dict) and obj.get("format") == cf.MANIFEST_FORMAT:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(obj, f, **kw)
        monkeypatch.setattr(cf.json, "dump", dump)
    with pytest.raises(CheckpointError) as e:
        cf.save_atomically(tmp_path / "t", write)
    msg = str(e.value)
    assert msg.startswith(f"cannot save {tmp_path / 't'}: ") and want in msg and "\n" not in msg, msg
    monkeypatch.undo()
    assert _contents(tmp_path / "t") == {"old"} and _leftovers(tmp_path) == []


def test_a_checkpoint_target_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "t").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not a folder"):
        cf.save_atomically(tmp_path / "t", lambda d: _write(d, "x"))
    assert (tmp_path / "t").read_text() == "mine"


def test_saved_folders_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        cf.save_atomically(tmp_path / "t", lambda d: _write(d, "x"))
        cf.write_latest(tmp_path, "t")
    finally:
        os.umask(old)
    assert (tmp_path / "t").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "latest").stat().st_mode & 0o777 == 0o644


# -- verification: each damaged file named ---------------------------------------------------

@pytest.fixture
def sealed(tmp_path):
    cf.save_atomically(tmp_path / "c", lambda d: _write(d, "x"))
    return tmp_path / "c"


def test_truncated_deleted_changed_and_unlisted_files_are_named(sealed):
    with open(sealed / "f0.pt", "r+b") as f:
        f.truncate(100)
    (sealed / "f1.pt").unlink()
    data = bytearray((sealed / "f2.pt").read_bytes())
    data[-30] ^= 0xFF
    (sealed / "f2.pt").write_bytes(bytes(data))
    (sealed / "layer_09-model_00-model_states.pt").write_bytes(b"planted")
    problems = cf.verify(sealed)
    assert any(p.startswith(f"{sealed / 'f0.pt'}: truncated: 100 bytes") for p in problems), problems
    assert f"{sealed / 'f1.pt'}: missing (listed in manifest.json)" in problems
    assert any(p.startswith(f"{sealed / 'f2.pt'}: checksum mismatch") for p in problems)
    assert f"{sealed / 'layer_09-model_00-model_states.pt'}: not listed in manifest.json" in problems
    assert len(problems) == 4


def test_a_truncated_file_read_directly_is_one_line_naming_it(sealed):
    with open(sealed / "f0.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError) as e:
        cf.safe_load(sealed / "f0.pt")
    assert str(e.value).startswith(f"{sealed / 'f0.pt'}: truncated or damaged") and "\n" not in str(e.value)


@pytest.mark.parametrize("content,why", [(b"{not json", "not valid JSON"), (b"[1, 2]", "not a ds_autoplan manifest"),
                                         (b"\xff\xfe", "not valid JSON")])
def test_a_malformed_manifest_is_one_line(sealed, content, why):
    (sealed / "manifest.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=why):
        cf.verify(sealed)


def test_a_missing_manifest_means_an_incomplete_save(sealed):
    (sealed / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json: its save did not complete"):
        cf.verify(sealed)


class _Hang(Exception):
    pass


@pytest.fixture
def no_hang(tmp_path):
    """Fail (instead of waiting for ever) when the test blocks for 20 s: every reader blocked
    in the ``open`` of a FIFO of ``tmp_path`` (in any thread) is released, and the test fails."""
    def alarm(*_):
        for p in tmp_path.rglob("*"):
            if p.is_fifo():
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        raise _Hang("blocked for 20 s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _list(folder, rel, data: bytes = b""):
    """Add ``rel`` to ``folder``'s manifest with the size and sha256 of ``data`` (as an attacker
    who rewrites the manifest would, matching the file it points to)."""
    import hashlib
    m = json.loads((folder / "manifest.json").read_text())
    m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("entry", ["ABS", "../../../../OUT", "/dev/null", "sub/../../OUT", "link",
                                   "linkdir/outside.txt", "a\x00b"])
def test_manifest_entries_outside_the_folder_are_refused(sealed, entry, no_hang):
    """Each name the manifest lists is a normalised relative path whose real path lies inside
    the checkpoint folder (symlinks followed): an absolute path, ``..``, a symlink out of the
    folder are refused naming the entry, before anything outside is read -- with the outside
    file's true size and sha256 (was: hashed, and the checkpoint accepted)."""
    outside = sealed.parent / "outside.txt"
    outside.write_bytes(b"not yours")
    (sealed / "link").symlink_to(outside)
    (sealed / "linkdir").symlink_to(sealed.parent)
    rel = entry.replace("ABS", str(outside)).replace("OUT", os.path.relpath(outside, "/"))
    _list(sealed, rel, b"" if rel == "/dev/null" else outside.read_bytes())
    with pytest.raises(CheckpointError, match="which is not a file inside") as e:
        cf.verify(sealed)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="is damaged: .*which is not a file inside"):
        cf.verify_before_load(sealed)


@pytest.mark.parametrize("what", ["fifo", "fifo-manifest"])
def test_a_fifo_in_a_checkpoint_is_refused_not_waited_on(sealed, what, no_hang):
    """A FIFO listed in the manifest (size 0) or a FIFO manifest: refused in one line without
    opening it (opening a FIFO waits for a writer for ever; was: a hang), by the verification
    and by a direct read."""
    if what == "fifo":
        fifo = sealed / "extra.pt"
        os.mkfifo(fifo)
        _list(sealed, "extra.pt")
        assert cf.verify(sealed) == [f"{fifo}: a FIFO, not a checkpoint file"]
    else:
        fifo = sealed / "manifest.json"
        fifo.unlink()
        os.mkfifo(fifo)
        with pytest.raises(CheckpointError, match="manifest.json: a FIFO, not a checkpoint file"):
            cf.verify(sealed)
    with pytest.raises(CheckpointError, match=f"{fifo}: a FIFO, not a checkpoint file"):
        cf.safe_load(fifo)


# -- no code on load ---------------------------------------------------------------------------

def test_a_crafted_pickle_is_refused_naming_the_file_and_runs_nothing(tmp_path):
    marker = tmp_path / "MARKER"
    torch.save({"state": {"x": Marker(marker)}}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"evil.pt: refused: .*could run code .*GLOBAL io.open"):
        cf.safe_load(tmp_path / "evil.pt")
    assert not marker.exists()


def test_client_state_that_could_not_load_safely_is_refused_at_save(tmp_path):
    with pytest.raises(CheckpointError, match="client_state holds an object other than tensors"):
        cf.loadable_without_code({"cb": Marker(tmp_path / "m")}, "client_state")
    cf.loadable_without_code({"epoch": 3, "t": torch.ones(2), "betas": (0.9, 0.99), "x": None},
                             "client_state")


def test_megatron_dist_checkpointing_reads_run_no_code(tmp_path):
    """Inside ``no_code_on_load``: DCP's ``.metadata`` (a plain pickle torch reads with
    ``pickle.load``), Megatron's ``common.pt`` and DCP's non-tensor items (``torch.load(...,
    weights_only=False)`` in torch's DefaultLoadPlanner) are refused with the file named."""
    from torch.distributed.checkpoint import FileSystemReader, filesystem
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    marker, torch_load = tmp_path / "MARKER", torch.load
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(Marker(marker), f, protocol=4)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused: .*builtins\.open|io\.open"):
        with cf.no_code_on_load(tmp_path):
            FileSystemReader(str(tmp_path)).read_metadata()
    torch.save({"x": Marker(marker)}, tmp_path / "common.pt")
    with pytest.raises(CheckpointError, match=r"common.pt: refused"):
        with cf.no_code_on_load(tmp_path):
            torch.load(str(tmp_path / "common.pt"), map_location="cpu")     # as Megatron does
    buf = io.BytesIO()
    torch.save(Marker(marker), buf)
    buf.seek(0)
    planner = DefaultLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}

    class Item:
        class dest_index:
            fqn = "x"
    with pytest.raises(CheckpointError, match="a non-tensor item of a .distcp file: refused"):
        with cf.no_code_on_load(tmp_path):
            planner.load_bytes(Item, buf)
    assert not marker.exists()
    assert torch.load is torch_load and filesystem.pickle is pickle      # put back


def test_real_dcp_metadata_passes_the_allow_list(tmp_path):
    """A DCP checkpoint torch writes (tensors and a non-tensor item) loads through the guard."""
    import torch.distributed.checkpoint as dcp
    sd = {"w": torch.arange(6.0).reshape(2, 3), "extra": {"lr": 0.1, "name": "adam"}}
    dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    out = {"w": torch.zeros(2, 3), "extra": {"lr": 0.0, "name": ""}}
    with cf.no_code_on_load(tmp_path / "d"):
        dcp.load(out, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and out["extra"] == sd["extra"]


# -- the CLI -----------------------------------------------------------------------------------

def _info(path, capsys):
    from ds_autoplan.cli import main
    rc = main(["checkpoint", "info", str(path)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _meta_checkpoint(tmp_path):
    from ds_autoplan.runtime.checkpoint import META

    def write(d):
        _write(d, "x")
        (pathlib.Path(d) / META).write_text(json.dumps({
            "format": 1, "framework": "deepspeed", "step": 1, "num_layers": 2, "world_size": 1,
            "counters": {}, "plan": {}, "optimizer": {"class": "Adam", "param_groups": []},
            "lr_scheduler": None}))
    cf.save_atomically(tmp_path / "c", write)
    return tmp_path / "c"


def test_checkpoint_info_verifies_the_files(tmp_path, capsys):
    ck = _meta_checkpoint(tmp_path)
    rc, out, _ = _info(ck, capsys)
    assert rc == 0 and "files: 5 verified against manifest.json" in out
    with open(ck / "f3.pt", "r+b") as f:
        f.truncate(10)
    rc, out, err = _info(ck, capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"{ck / 'f3.pt'}: truncated: 10 bytes" in err


@pytest.mark.parametrize("tag", ["/etc", "..", "../c", "."])
def test_checkpoint_info_never_follows_latest_out_of_the_folder(tmp_path, capsys, tag, no_hang):
    """``latest`` names a tag, a folder of the checkpoint folder: a path in it is refused (was:
    "its latest checkpoint is /etc"); a FIFO ``latest`` is not opened."""
    (tmp_path / "latest").write_text(tag)
    rc, out, err = _info(tmp_path, capsys)
    assert rc == 2 and err.count("\n") == 1 and "which is not a tag" in err, err
    (tmp_path / "latest").unlink()
    os.mkfifo(tmp_path / "latest")
    rc, out, err = _info(tmp_path, capsys)
    assert rc == 2 and "latest: a FIFO, not a checkpoint file" in err, err


@pytest.mark.parametrize("content", ["{\"format\": 1, ", "[]", "\x00\x01", "{\"format\": 1}",
                                     "{\"format\": 1, \"framework\": \"deepspeed\", \"step\": \"3\"}"])
def test_checkpoint_info_on_malformed_metadata_is_one_line(tmp_path, capsys, content):
    from ds_autoplan.runtime.checkpoint import META
    ck = _meta_checkpoint(tmp_path)
    (ck / META).write_text(content)
    rc, out, err = _info(ck, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and META in err, err
    assert "Traceback" not in err


# -- the DeepSpeed and Megatron-core runtimes on 2 ranks: one launch -------------------------

WORKER = str(HERE / "checkpoint_faults_deepspeed.py")
M_WORKER = str(HERE / "checkpoint_faults_megatron.py")
# (name, tag of the second save, fault): a kill of rank 1 while it writes its files, of rank 0
# after every rank wrote (before the manifest), after the manifest (before the rename), after
# the rename (before ``latest``), while ``latest`` is replaced
DS_KILLS = [("resave-rank1-writing", "t1", "file:2@1"), ("resave-before-manifest", "t1", "written@0"),
            ("resave-before-rename", "t1", "manifest@0"), ("newtag-before-latest", "t2", "installed@0"),
            ("newtag-writing-latest", "t2", "latest-tmp@0")]
# Megatron: a checkpoint re-saved in place, rank 1 killed after dist_checkpointing wrote its files
M_KILL = "megatron-resave"
M = "megatron:"        # the Megatron load cases' names in the shared launch


def _kills(root) -> tuple[list, list]:
    """The modules the ranks import once, and the kill cases, of the runtimes installed."""
    import importlib.util

    from harness import forked
    warm, kills = [], []
    if importlib.util.find_spec("deepspeed"):
        warm += forked.DEEPSPEED
        kills += [{"name": n, "fn": WORKER + ":save", "dir": str(root / "ds" / n), "tag2": t, "fault": f}
                  for n, t, f in DS_KILLS]
    if importlib.util.find_spec("megatron.core"):
        warm += forked.MEGATRON
        kills.append({"name": M_KILL, "fn": M_WORKER + ":killed_resave",
                      "dir": str(root / "megatron" / "ck"), "fault": "file@1"})
    return warm, kills


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """One 2-rank launch (tests/harness/forked.py) for both runtimes: every kill scenario runs
    in forked children of the ranks, in a process group of their own; then the launch's
    process group loads what each left, and crafted and damaged copies of it
    (:func:`_ds_loads`, :func:`_megatron_loads`).  The root folder and every result row."""
    from harness import forked
    root = tmp_path_factory.mktemp("faults")
    warm, kills = _kills(root)
    if not kills:
        pytest.skip("neither deepspeed nor megatron-core is installed")
    (root / "ds").mkdir()
    (root / "megatron").mkdir()
    names = {k["name"] for k in kills}

    def loads():         # every kill is over: the cases of the launch's process group
        return (_ds_loads(root / "ds") if DS_KILLS[0][0] in names else []) + \
            (_megatron_loads(root / "megatron") if M_KILL in names else [])
    mark = uuid.uuid4().hex            # in every process of the launch (test_no_orphans.py)
    (root / "mark").write_text(mark)
    outs = forked.run(root, kills, loads, warm, timeout=600, grace=5, env={"DS_AUTOPLAN_TEST_MARK": mark})
    assert all(rc == 0 for rc, _ in outs), outs[0][1] + outs[1][1]
    return root, forked.rows(outs)


def test_killed_ranks_leave_no_process_behind(faults):
    """Issue 27: after this launch, the spawn Manager of Megatron's dist_checkpointing in a rank
    SIGKILLed mid-save was alive 25 minutes later; every process the kills left ends with them."""
    from harness import leftovers
    root, _ = faults
    assert leftovers((root / "mark").read_text(), wait=10.0) == []


def _killed(rows, name) -> dict:
    """Kill case ``name``: one rank was SIGKILLed; rank 0's rows before it, by what they saved."""
    assert any(r["exit"] == -signal.SIGKILL for r in rows if r.get("forked") == name and "exit" in r), \
        [r for r in rows if r.get("forked") == name]
    return {r["saved"]: r for r in rows if r.get("forked") == name and r["rank"] == 0 and "saved" in r}


@pytest.fixture(scope="module")
def ds_kills(faults):
    """Each kill scenario's folder and the digests rank 0 printed before the kill."""
    root, rows = faults
    if not any(r.get("forked") == DS_KILLS[0][0] for r in rows):
        pytest.skip("deepspeed is not installed")
    out = {}
    for name, _, _ in DS_KILLS:
        out[name] = _killed(rows, name)
        assert "t1" in out[name], [r for r in rows if r.get("forked") == name]
    return root / "ds", out


def _refused_on_both_ranks(rows, name, marker) -> None:
    """Case ``name`` stopped both ranks with one line refusing a file; no code ran."""
    for r in range(2):
        err = rows[(name, r)].get("error", "")
        assert "refused" in err and "could run code" in err and "\n" not in err, rows[(name, r)]
    assert not marker.exists()


def _layer_file(folder, layer: int) -> str:
    """DeepSpeed's weights file of ``layer`` (``layer_XX-[model_YY-]model_states.pt``)."""
    (path,) = pathlib.Path(folder).glob(f"layer_{layer:02d}-*model_states.pt")
    return path.name


def _plant(src, dst, rel, obj):
    """Copy checkpoint ``src`` to ``dst`` with ``rel`` replaced by ``torch.save(obj)`` and the
    manifest re-sealed (as an attacker who rewrites it would)."""
    shutil.copytree(src, dst)
    torch.save(obj, dst / rel)
    (dst / "manifest.json").unlink()
    cf._seal(str(dst))


def _ds_loads(root) -> list:
    """The DeepSpeed load job: one engine loads every kill scenario's ``latest`` and every
    damaged or crafted copy of a good checkpoint."""
    good = root / "newtag-before-latest" / "t1"
    marker = root / "MARKER"
    cases = [{"name": n, "dir": str(root / n)} for n, _, _ in DS_KILLS]
    cases += [{"name": n + ":t2", "dir": str(root / n), "tag": "t2"} for n, t, _ in DS_KILLS if t == "t2"]
    bad = root / "bad"
    bad.mkdir()
    evil = {"x": Marker(marker)}
    for name, rel, obj in [("evil-rank-state", "autoplan_rank_00001.pt", evil),
                           ("evil-train-state", "autoplan_train_state.pt", evil),
                           ("evil-layer-state", "layer_02-autoplan_states.pt", evil),
                           ("evil-layer-weights", _layer_file(good, 1), evil)]:
        _plant(good, bad / name, rel, obj)
        cases.append({"name": name, "dir": str(bad / name)})
    for name, rel, how in [("truncated-weights", _layer_file(good, 3), "truncate"),
                           ("deleted-rank-state", "autoplan_rank_00001.pt", "delete"),
                           ("deleted-train-state", "autoplan_train_state.pt", "delete")]:
        shutil.copytree(good, bad / name)
        if how == "truncate":
            with open(bad / name / rel, "r+b") as f:
                f.truncate(200)
        else:
            (bad / name / rel).unlink()
        cases.append({"name": name, "dir": str(bad / name)})
    outside = root / "outside.pt"           # a file of the user's, beside the checkpoints
    shutil.copyfile(good / "autoplan_train_state.pt", outside)
    for name, how in UNSOUND:
        shutil.copytree(good, bad / name)
        if how == "outside":
            _list(bad / name, str(outside), outside.read_bytes())
        elif how == "fifo":
            os.mkfifo(bad / name / "extra.pt")
            _list(bad / name, "extra.pt")
        else:
            (bad / name / "manifest.json").unlink()
        cases.append({"name": name, "dir": str(bad / name)})
    return [{"fn": WORKER + ":load", "cases": cases}]


@pytest.fixture(scope="module")
def ds_loads(faults, ds_kills):
    """Every kill scenario's ``latest`` and every damaged or crafted copy of a good checkpoint,
    loaded by one engine on 2 ranks: the rows and the marker no load may create."""
    root, rows = faults
    return {(r["name"], r["rank"]): r for r in rows if "name" in r and not r["name"].startswith(M)}, \
        root / "ds" / "MARKER"


@pytest.mark.multiproc
@pytest.mark.timeout(900)      # the first test pays for its fixture's process groups
@pytest.mark.parametrize("name,tag2,fault", DS_KILLS, ids=[k[0] for k in DS_KILLS])
def test_deepspeed_rank_killed_during_save_leaves_latest_loadable(ds_kills, ds_loads, name, tag2, fault):
    """Rank 0 or 1 SIGKILLed inside ``engine.save_checkpoint``: ``latest`` names a complete
    tag, which loads on 2 ranks with the weights it was saved with."""
    root, digests = ds_kills
    rows, _ = ds_loads
    assert (root / name / "latest").read_text() == "t1"       # the kill came before latest moved
    assert cf.verify(root / name / "t1") == []
    for r in range(2):
        row, saved = rows[(name, r)], digests[name]["t1"] if r == 0 else None
        assert "error" not in row, row
        assert row["path"] == str(root / name / "t1") and row["step"] == 1
        assert row["client_state"] == {"epoch": 1}
        if saved is not None:                                  # rank 0's layers as saved
            assert row["digest"] == pytest.approx(saved["digest"], rel=1e-12)
    if tag2 == "t2":        # killed after its rename: the new tag is complete too
        assert cf.verify(root / name / "t2") == []
        assert rows[(name + ":t2", 0)]["step"] == 2


@pytest.mark.multiproc
@pytest.mark.timeout(900)      # the first test pays for its fixture's process groups
@pytest.mark.parametrize("name", ["evil-rank-state", "evil-train-state", "evil-layer-state",
                                  "evil-layer-weights"])
def test_deepspeed_crafted_pickle_in_any_checkpoint_file_is_refused(ds_loads, name):
    """A pickled object in a rank state, the train state, a layer's optimizer state or one of
    DeepSpeed's per-layer weight files (manifest re-sealed to match): both ranks stop with one
    line naming the file (also the rank that does not read it), the marker never appears."""
    rows, marker = ds_loads
    _refused_on_both_ranks(rows, name, marker)


@pytest.mark.multiproc
@pytest.mark.timeout(900)      # the first test pays for its fixture's process groups
@pytest.mark.parametrize("name,file", [("truncated-weights", "model_states.pt: truncated"),
                                       ("deleted-rank-state", "autoplan_rank_00001.pt: missing"),
                                       ("deleted-train-state", "autoplan_train_state.pt: missing")])
def test_deepspeed_damaged_checkpoint_is_refused_naming_the_file(ds_loads, name, file):
    rows, _ = ds_loads
    for r in range(2):
        err = rows[(name, r)].get("error", "")
        assert err.startswith("checkpoint ") and file in err, rows[(name, r)]


UNSOUND = [("manifest-lists-outside", "outside"), ("fifo-listed", "fifo"),
           ("missing-manifest", "missing")]


@pytest.mark.multiproc
@pytest.mark.timeout(900)      # the first test pays for its fixture's process groups
@pytest.mark.parametrize("name,want", [
    ("manifest-lists-outside", "outside.pt', which is not a file inside"),
    ("fifo-listed", "extra.pt: a FIFO, not a checkpoint file"),
    ("missing-manifest", "has no manifest.json: its save did not complete")])
def test_deepspeed_load_refuses_an_unsound_manifest_on_every_rank(ds_loads, name, want):
    """A manifest listing a file outside the checkpoint (its true size and sha256), a FIFO it
    lists, no manifest: ``engine.load_checkpoint`` on 2 ranks stops every rank with the same
    one line (was: the outside file accepted; the FIFO hung every rank)."""
    rows, _ = ds_loads
    errs = [rows[(name, r)].get("error", "") for r in range(2)]
    assert errs[0] == errs[1] and want in errs[0] and "\n" not in errs[0], errs


# -- the Megatron-core runtime on 2 ranks ------------------------------------------------------

def _megatron_loads(root) -> list:
    """The Megatron load cases (names prefixed by :data:`M`): the killed re-save's folder, and
    crafted and damaged copies of it."""
    ck = root / "ck"
    marker = root / "MARKER"
    bad = root / "bad"
    bad.mkdir()
    cases = [{"name": "killed", "dir": str(ck)}]
    for name, rel in [("evil-common", "common.pt"), ("evil-rank-state", "autoplan_rank_00001.pt"),
                      ("evil-train-state", "autoplan_train_state.pt")]:
        _plant(ck, bad / name, rel, {"x": Marker(marker)})
        cases.append({"name": name, "dir": str(bad / name)})
    shutil.copytree(ck, bad / "evil-metadata")           # DCP's metadata: a plain pickle
    with open(bad / "evil-metadata" / ".metadata", "wb") as f:
        pickle.dump(Marker(marker), f, protocol=4)
    (bad / "evil-metadata" / "manifest.json").unlink()
    cf._seal(str(bad / "evil-metadata"))
    cases.append({"name": "evil-metadata", "dir": str(bad / "evil-metadata")})
    shutil.copytree(ck, bad / "zarr-backend")             # a backend not read through the guard
    (bad / "zarr-backend" / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "zarr", "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}))
    (bad / "zarr-backend" / "manifest.json").unlink()
    cf._seal(str(bad / "zarr-backend"))
    cases.append({"name": "zarr-backend", "dir": str(bad / "zarr-backend")})
    shutil.copytree(ck, bad / "truncated")
    with open(bad / "truncated" / "__1_0.distcp", "r+b") as f:
        f.truncate(1000)
    cases.append({"name": "truncated", "dir": str(bad / "truncated")})
    return [dict(c, name=M + c["name"], fn=M_WORKER + ":load") for c in cases]


@pytest.fixture(scope="module")
def megatron_faults(faults):
    """A Megatron checkpoint re-saved in place and SIGKILLed on rank 1 after
    dist_checkpointing wrote its files; then one process group loads it and crafted and
    damaged copies of it."""
    root, rows = faults
    if not any(r.get("forked") == M_KILL for r in rows):      # (not imported here: seconds)
        pytest.skip("megatron-core is not installed")
    saved = _killed(rows, M_KILL)
    assert 1 in saved, [r for r in rows if r.get("forked") == M_KILL]
    loads = {(r["name"][len(M):], r["rank"]): r for r in rows if r.get("name", "").startswith(M)}
    return loads, saved[1], root / "megatron" / "MARKER", root / "megatron" / "ck"


@pytest.mark.multiproc
@pytest.mark.timeout(900)      # the first test pays for its fixture's process groups
def test_megatron_rank_killed_during_resave_leaves_the_previous_checkpoint(megatron_faults):
    rows, saved, _, ck = megatron_faults
    assert cf.verify(ck) == []
    for r in range(2):
        row = rows[("killed", r)]
        assert "error" not in row, row
        assert row["step"] == 1 and row["client_state"] == {"epoch": 1}
    assert rows[("killed", 0)]["digest"] == pytest.approx(saved["digest"], rel=1e-12)


@pytest.mark.multiproc
@pytest.mark.timeout(900)      # the first test pays for its fixture's process groups
@pytest.mark.parametrize("name", ["evil-metadata", "evil-common", "evil-rank-state", "evil-train-state"])
def test_megatron_crafted_pickle_in_any_checkpoint_file_is_refused(megatron_faults, name):
    """DCP's ``.metadata`` (torch reads it with ``pickle.load``), Megatron's ``common.pt``, a
    rank state, the train state: refused naming the file on both ranks, the marker never made."""
    rows, _, marker, _ = megatron_faults
    _refused_on_both_ranks(rows, name, marker)


@pytest.mark.multiproc
@pytest.mark.timeout(900)      # the first test pays for its fixture's process groups
def test_megatron_truncated_shard_is_refused_naming_it(megatron_faults):
    rows, _, _, _ = megatron_faults
    for r in range(2):
        assert "__1_0.distcp: truncated: 1000 bytes" in rows[("truncated", r)].get("error", ""), rows


@pytest.mark.multiproc
@pytest.mark.timeout(900)      # the first test pays for its fixture's process groups
def test_megatron_backend_other_than_torch_dist_is_refused(megatron_faults):
    """``metadata.json`` naming another dist_checkpointing backend (whose reader the guard does
    not cover) is refused before Megatron picks that reader."""
    rows, _, _, _ = megatron_faults
    for r in range(2):
        assert "metadata.json: backends ('zarr', 'torch')" in rows[("zarr-backend", r)].get("error", "")
