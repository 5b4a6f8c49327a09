"""Output files: a command owns only what it writes (docs/reliability.md "Output
files").

Every output file is written to a temporary file in its own folder (``.NAME.PID-XXXX.
ds-autoplan-tmp.EXT``: hidden, named after the file and the writing process), flushed and moved
into place with ``os.replace``; a reader sees the old file or the new one, never a part.  A
target of the wrong kind (a folder where a file is asked, a device node, FIFO or socket, a
dangling symlink, a parent that is a file) is refused before anything is written; a symlink
is written through (the link stays a link); a missing parent folder is created.  Modes follow
the umask.

An output *folder* (``plan --out``, ``launch --out``) keeps a manifest of what ds-autoplan
wrote there (``.ds-autoplan-manifest.json``: name -> sha256 and inode number).  A file in the
folder is only replaced when the manifest says ds-autoplan wrote it -- the same file (inode:
a copy, or a manifest copied or crafted beside the user's files, does not match) -- and it is
unchanged since (sha256); anything else there (the user's ``train.py``, ``data/``, a
hand-edited ``ds_config.json``) is never touched, and a name clash with it is refused before
anything is written.  A run that writes the whole
set (``complete=True``) removes the files of the last run it no longer produces (a plot) and
nothing else.  Writers of one folder take turns (``flock`` on the folder); temporary files of
a killed writer (no longer holding the ``flock`` a writer keeps on its temporary file) are
removed by the next run.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
from typing import Callable

from .errors import UserError

MANIFEST = ".ds-autoplan-manifest.json"
MANIFEST_FORMAT = "ds-autoplan-outputs/2"
TMP_TAG = ".ds-autoplan-tmp"
_TMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-[0-9a-f]+" + re.escape(TMP_TAG) + r"(\.[^.]*)?$")

Fill = Callable[[str], object]   # writes one file at the path it is given


class OutputError(UserError):
    """An output target that cannot or must not be written (one line)."""


def text(content: str) -> Fill:
    """A fill that writes ``content`` (UTF-8)."""
    def fill(path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(content)
    return fill


def json_text(obj, indent: int = 2) -> Fill:
    return text(json.dumps(obj, indent=indent) + "\n")


# hook for the fault-injection tests: called between writing a temporary file and moving it
# into place (tests slow it down to SIGKILL a writer in that window)
_before_replace: Callable[[str], None] | None = None


def _os_error(what: str, path: str, e: OSError) -> OutputError:
    return OutputError(f"cannot write {what} {path}: {e.strerror or e}")


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, for a message ("a FIFO", ...)."""
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device node"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def _check_name(path, what: str) -> str:
    if path is None or not str(path).strip():
        raise OutputError(f"{what} needs a path (got an empty one)")
    return os.path.abspath(os.fspath(path))


def _parent(path: str, what: str, create: bool = True) -> str:
    """The existing (or created) folder holding ``path``."""
    parent = os.path.dirname(path)
    probe = parent
    while not os.path.lexists(probe):               # the nearest existing ancestor
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OutputError(f"cannot write {what} {path}: {probe} is not a folder")
    if not os.path.isdir(parent) and create:
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise _os_error(what, path, e) from None
    return parent


def _follow(path, what: str) -> tuple[str, int | None]:
    """(the checked absolute path, symlinks followed; its mode, None when it does not exist)."""
    path = _check_name(path, what)
    if os.path.islink(path):
        real = os.path.realpath(path)
        if not os.path.exists(real):
            raise OutputError(f"{what} {path} is a dangling symlink (to {os.readlink(path)})")
        path = real
    return path, (os.stat(path).st_mode if os.path.exists(path) else None)


def resolve_file(path, what: str = "output", create_parent: bool = True) -> str:
    """The real path an output file is written to, after refusing a target of the wrong
    kind; creates missing parent folders (``create_parent``).  A symlink is followed (written
    through)."""
    path, mode = _follow(path, what)
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputError(f"{what} {path} is {file_kind(mode)}; give a file path")
    _parent(path, what, create_parent)
    return path


def resolve_folder(path, what: str = "--out", create: bool = True) -> tuple[str, bool]:
    """(the real folder, whether it was created now) after refusing a target that is not a
    folder; a symlink to a folder is followed."""
    path, mode = _follow(path, what)
    if mode is not None:
        if not stat.S_ISDIR(mode):
            raise OutputError(f"{what} {path} is {'a file' if stat.S_ISREG(mode) else file_kind(mode)}; "
                              "give a folder")
        return path, False
    _parent(path, what)
    if not create:
        return path, False
    try:
        os.mkdir(path)
    except FileExistsError:                          # made by a concurrent writer
        return resolve_folder(path, what, create)
    except OSError as e:
        raise _os_error(what, path, e) from None
    return path, True


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(folder: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_held: dict[str, int] = {}    # temporary path -> its open, flock-ed descriptor (while written)


def _unheld(path: str) -> int | None:
    """An exclusive lock on ``path`` when no live writer holds it (its writer was killed),
    else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def clean_temps(folder: str, names=None) -> list[str]:
    """Remove the temporary files that no live ds-autoplan writer holds in ``folder`` (a
    killed writer's; only those for ``names`` when given); returns what was removed."""
    gone = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return gone
    for entry in entries:
        m = _TMP_RE.match(entry)
        p = os.path.join(folder, entry)
        if not m or (names is not None and m["name"] not in names) or not os.path.isfile(p) \
                or os.path.islink(p):
            continue
        fd = _unheld(p)
        if fd is None:
            continue
        try:
            os.unlink(p)
            gone.append(entry)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return gone


def _new_temp(folder: str, name: str) -> str:
    """A fresh temporary file for ``name`` in ``folder``, created with the umask's mode and
    locked (``flock``) until it is moved into place or removed: the lock tells the next run
    whether its writer is still alive."""
    ext = os.path.splitext(name)[1]
    tmp = os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_TAG}{ext}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held[tmp] = fd
    return tmp


def _release(tmp: str, remove: bool = False) -> None:
    if remove:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fd = _held.pop(tmp, None)
    if fd is not None:
        os.close(fd)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _render(folder: str, name: str, fill: Fill) -> str:
    """``fill`` into a temporary file beside ``name``; returns the temporary path."""
    tmp = _new_temp(folder, name)
    try:
        fill(tmp)
        _fsync(tmp)
    except BaseException:
        _release(tmp, remove=True)
        raise
    return tmp


def _replace(tmp: str, path: str) -> None:
    if _before_replace is not None:
        _before_replace(path)
    os.replace(tmp, path)
    _release(tmp)


def write_file(path, fill: Fill, what: str = "output") -> str:
    """Write one output file atomically (see the module doc); returns the path written."""
    return write_files({path: (fill, what)})[0]


def write_files(files: dict) -> list[str]:
    """Write several output files (path -> ``(fill, what)``) as one: every file is rendered to
    its temporary file first, and only when all are complete are they moved into place, so a
    failure (a full disk, a failing plot) leaves every target as it was.  Returns the paths
    written."""
    staged: list[tuple[str, str]] = []
    try:
        for path, (fill, what) in files.items():
            real = resolve_file(path, what)
            folder, name = os.path.split(real)
            clean_temps(folder, {name})
            try:
                staged.append((_render(folder, name, fill), real))
            except OSError as e:
                raise _os_error(what, os.fspath(path), e) from None
        for (tmp, real), (path, (_, what)) in zip(staged, files.items()):
            try:
                _replace(tmp, real)
            except OSError as e:
                raise _os_error(what, os.fspath(path), e) from None
            _fsync_dir(os.path.dirname(real))
    finally:
        for tmp, _ in staged:
            if tmp in _held:                         # not moved into place
                _release(tmp, remove=True)
    return [real for _, real in staged]


# ----------------------------------------------------------------------------- folders
Stamp = tuple[str, int]      # (sha256, inode number) of a file ds-autoplan wrote


def _stamp(path: str) -> Stamp:
    return sha256(path), os.lstat(path).st_ino


def read_manifest(folder: str) -> dict[str, list[Stamp]]:
    """name -> the stamps of what ds-autoplan wrote in ``folder`` ({} if none, unreadable or
    of an older format: then nothing there counts as ds-autoplan's)."""
    p = os.path.join(folder, MANIFEST)
    if os.path.islink(p) or not os.path.isfile(p):
        return {}
    try:
        with open(p, encoding="utf-8") as fh:
            d = json.load(fh)
        files = d["files"] if d.get("format") == MANIFEST_FORMAT else {}
        return {str(k): [(str(e["sha256"]), int(e["inode"])) for e in v]
                for k, v in files.items() if os.sep not in str(k) and str(k) not in (".", "..")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write_manifest(folder: str, files: dict[str, list[Stamp]]) -> None:
    blob = {"format": MANIFEST_FORMAT,
            "note": "files ds-autoplan wrote in this folder (name -> sha256, inode); the next "
                    "run replaces or removes only these files themselves, and only while unchanged",
            "files": {k: [{"sha256": h, "inode": i} for h, i in v] for k, v in sorted(files.items())}}
    tmp = _render(folder, MANIFEST, json_text(blob, indent=1))
    os.replace(tmp, os.path.join(folder, MANIFEST))
    _release(tmp)


LAUNCH_LOCK = ".ds-autoplan-launch.lock"
_HELD: dict = {}                # folder -> fd of its launch lock, held by this process


def hold_for_launch(path, what: str = "--out") -> tuple[str, bool]:
    """Take the output folder ``path`` for one launch: an exclusive lock on its
    :data:`LAUNCH_LOCK` file, held while this process lives (or until :func:`release_launch`),
    so a second launch into the same folder is refused by name before it plans or writes
    anything (two launches in one working directory once replaced each other's plan.json).
    The lock file holds the holder's pid.  Returns (the real folder, whether it was created
    now)."""
    folder, created = resolve_folder(path, what)
    if folder in _HELD:
        return folder, created
    lock = os.path.join(folder, LAUNCH_LOCK)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        raise _os_error(what, lock, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise OutputError(f"{what} {folder}: another launch (pid {holder}) is using this folder; "
                          "wait for it to end or pass another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[folder] = fd
    return folder, created


def release_launch(folder: str, remove: bool = False, created: bool = False) -> None:
    """Give the launch lock of ``folder`` back; ``remove``: also delete the lock file, and the
    folder where the launch ``created`` it and nothing else is in it (a launch refused before
    it wrote anything; a folder the user made stays)."""
    fd = _HELD.pop(folder, None)
    if fd is None:
        return
    if remove:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, LAUNCH_LOCK))
    if remove and created:
        with contextlib.suppress(OSError):
            os.rmdir(folder)                     # only when empty
    os.close(fd)


@contextlib.contextmanager
def _locked(folder: str):
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                                 # releases the lock


def _not_ours(path: str, stamps: list[Stamp]) -> str | None:
    """Why the regular file ``path`` is not one ds-autoplan wrote there and left unchanged
    (one of ``stamps``); None when it is."""
    ino = os.lstat(path).st_ino
    if all(i != ino for _, i in stamps):
        return "is not the file ds-autoplan wrote there (a copy, or replaced since)"
    if (sha256(path), ino) not in stamps:
        return "was changed since ds-autoplan wrote it"
    return None


def _conflicts(folder: str, names, owned: dict[str, list[Stamp]]) -> list[str]:
    out = []
    for name in names:
        p = os.path.join(folder, name)
        if not os.path.lexists(p):
            continue
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            out.append(f"{name} is a symlink")
        elif not stat.S_ISREG(st.st_mode):
            out.append(f"{name} is {file_kind(st.st_mode)}")
        elif name not in owned:
            out.append(f"{name} was not written by ds-autoplan")
        elif (why := _not_ours(p, owned[name])) is not None:
            out.append(f"{name} {why}")
    return out


def check_folder(path, names, what: str = "--out") -> None:
    """Refuse now (before any work) what :func:`write_folder` would refuse: a target that is
    not a folder, or a name in it that is not ds-autoplan's unchanged file."""
    folder, _ = resolve_folder(path, what, create=False)
    if os.path.isdir(folder):
        bad = _conflicts(folder, names, read_manifest(folder))
        if bad:
            raise OutputError(_clash(what, folder, bad))


def _clash(what: str, folder: str, bad: list[str]) -> str:
    return (f"{what} {folder}: {'; '.join(bad)}; refusing to replace it (move it away or "
            "choose another folder)")


def write_folder(path, files: dict[str, Fill], complete: bool = True,
                 what: str = "--out") -> list[str]:
    """Write ``files`` (name -> fill) into the folder ``path`` (see the module doc); with
    ``complete`` the set is the whole output of the command and the last run's files it no
    longer produces are removed (while unchanged).  Returns the names written."""
    for name in files:
        if not name or os.sep in name or name.startswith(".") or name == MANIFEST:
            raise ValueError(f"not an output file name: {name!r}")
    folder, created = resolve_folder(path, what)
    temps: dict[str, str] = {}
    done = False
    try:
        with _locked(folder):
            old = read_manifest(folder)
            clean_temps(folder, set(files) | set(old) | {MANIFEST})
            bad = _conflicts(folder, files, old)
            if bad:
                raise OutputError(_clash(what, folder, bad))
            for name, fill in files.items():
                temps[name] = _render(folder, name, fill)
            new = {name: _stamp(tmp) for name, tmp in temps.items()}    # os.replace keeps the inode
            # while files move into place, both versions count as ours (a kill in between
            # leaves a folder the next run still owns)
            _write_manifest(folder, {**old, **{n: old.get(n, []) + [st] for n, st in new.items()}})
            for name in files:
                _replace(temps.pop(name), os.path.join(folder, name))
            final = {n: [st] for n, st in new.items()}
            for name, stamps in old.items():        # the last run's files not written now
                if name in final:
                    continue
                p = os.path.join(folder, name)
                if not complete:
                    if os.path.lexists(p):
                        final[name] = stamps         # still ours while unchanged
                elif os.path.isfile(p) and not os.path.islink(p) and _not_ours(p, stamps) is None:
                    os.unlink(p)                     # ours, unchanged, no longer produced
            _write_manifest(folder, final)
            _fsync_dir(folder)
            done = True
    except OSError as e:
        raise _os_error(what, folder, e) from None
    finally:
        for tmp in temps.values():
            _release(tmp, remove=True)
        if created and not done:                     # no empty folder left behind
            with contextlib.suppress(OSError):
                os.rmdir(folder)
    return list(files)


__all__ = ["MANIFEST", "OutputError", "check_folder", "clean_temps", "file_kind", "json_text",
           "read_manifest", "resolve_file", "resolve_folder", "sha256", "text", "write_file",
           "write_files", "write_folder"]
