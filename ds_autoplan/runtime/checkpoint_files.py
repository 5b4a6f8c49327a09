"""The files of a checkpoint: read without running code, written crash-safe, verified by a
manifest.  Both runtimes' checkpoints go through here.

Reading.  Every file is read with ``torch.load(weights_only=True)`` (:func:`safe_load`):
tensors, numbers, strings, ``None`` and containers of them; a file that needs any other object
is refused with one line naming it, before the object is built.  Megatron-core's
``dist_checkpointing`` reads through :func:`no_code_on_load`: torch's DCP metadata file
(``.metadata``, a plain pickle that torch reads with ``pickle.load``) through an unpickler that
allows only DCP's own metadata classes, and every ``torch.load`` it makes (``common.pt``, the
non-tensor items of the ``.distcp`` files, which DCP reads with ``weights_only=False``) with
``weights_only=True``.

Writing.  :func:`save_atomically` (every rank) writes a checkpoint folder into a staging folder
beside it (``.<name>.autoplan-staging-XXXXXXXX`` in the same parent), then -- when every rank
wrote its files -- rank 0 hashes and fsyncs them (shared by all ranks), writes
``manifest.json`` (each file's size and sha256), fsyncs the folder and renames it into place:
an existing folder of the same name (a re-saved tag) is swapped with it atomically
(``renameat2(RENAME_EXCHANGE)``; on a file system without it: two renames, and a kill between
them leaves ``.<name>.autoplan-old`` which loading and the next save use) and removed only
afterwards.  :func:`write_latest` replaces DeepSpeed's ``latest`` file atomically (temporary
file, fsync, ``os.replace``).  A rank killed at any moment therefore leaves the previous
checkpoint complete and ``latest`` naming a complete tag; the staging folder it leaves is
removed by the next save (of any tag) into that parent (rank 0 holds an ``flock`` on its staging folder
while it saves, so a concurrent writer's folder is never taken for a stale one).

Verifying.  :func:`verify` checks a folder against its manifest: a missing, truncated,
changed or unlisted file is named.  Loading verifies first (every rank checks the sizes, each
rank hashes its share of the files) and all ranks agree on the first problem, so every rank
stops with the same one line instead of one rank failing inside a collective.

Fault injection (tests): ``DS_AUTOPLAN_CHECKPOINT_FAULT=POINT[:N][@RANK]`` SIGKILLs rank RANK
(default 0) the N-th time (default 1) it reaches POINT of a save (:data:`FAULT_POINTS`);
``DS_AUTOPLAN_CHECKPOINT_DELAY=SECONDS`` sleeps at every point (a window for outside kills).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import io
import json
import os
import pickle
import secrets
import shutil
import signal
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import outputs
from ..env import EnvError, env_float, env_str
from ..errors import UserError
from .common.collectives import broadcast_text, gather_text
from .common.collectives import rank as _rank, world as _world

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
STAGING = ".autoplan-staging-"
OLD = ".autoplan-old"
FAULT_POINTS = ("staged", "file", "written", "manifest", "between-renames", "installed",
                "latest-tmp")


class CheckpointError(UserError):
    """A checkpoint folder or file that is missing, damaged, unsafe, from another framework
    or another model."""


# -- agreement between ranks ------------------------------------------------------------------

def first_error(exc: BaseException | str | None) -> tuple[int, str] | None:
    """Collective: ``(rank, message)`` of the lowest rank that reports a problem (an exception
    or a message), None when no rank does."""
    own = "" if exc is None else (exc if isinstance(exc, str) else _one_line(exc))
    return next(((r, msg) for r, msg in enumerate(gather_text(own)) if msg), None)


def agree(exc: BaseException | None, what: str) -> None:
    """Collective: raise on every rank when any rank failed (this rank's own exception as it
    is; on the others a :class:`CheckpointError` naming the failed rank and its problem)."""
    problem = first_error(exc)
    if problem is None:
        return
    if exc is not None:
        raise exc
    raise CheckpointError(f"{what} on rank {problem[0]}: {problem[1]}")


def _one_line(exc: BaseException) -> str:
    """The first sentence of the exception's message."""
    text = str(exc).strip().splitlines()
    return text[0].split(". ")[0] if text else type(exc).__name__


# -- fault injection --------------------------------------------------------------------------

_reached: dict[str, int] = {}
FAULT_ENV, DELAY_ENV = "DS_AUTOPLAN_CHECKPOINT_FAULT", "DS_AUTOPLAN_CHECKPOINT_DELAY"


def fault_settings(env=None) -> tuple[float | None, tuple[str, int, int] | None]:
    """``DS_AUTOPLAN_CHECKPOINT_DELAY`` (seconds, None when unset) and ``(point, n, rank)`` of
    ``DS_AUTOPLAN_CHECKPOINT_FAULT=POINT[:N][@RANK]`` (None when unset); a malformed value
    raises :class:`~ds_autoplan.env.EnvError` naming it."""
    delay, spec = env_float(DELAY_ENV, env=env), env_str(FAULT_ENV, env=env)
    if spec is None:
        return delay, None
    where, at, rank = spec.partition("@")
    name, colon, nth = where.partition(":")
    if name not in FAULT_POINTS or (colon and not nth.isdigit()) or (at and not rank.isdigit()) \
            or nth.isdigit() and int(nth) < 1:
        raise EnvError(f"{FAULT_ENV}={spec!r} is not POINT[:N][@RANK] (N >= 1, RANK >= 0) with "
                       f"POINT one of {', '.join(FAULT_POINTS)}")
    return delay, (name, int(nth or 1), int(rank or 0))


def fault_point(point: str) -> None:
    """Where a save may be interrupted (see the module's docstring)."""
    delay, spec = fault_settings()
    if delay:
        time.sleep(delay)
    if spec is None or spec[0] != point or _rank() != spec[2]:
        return
    _reached[point] = _reached.get(point, 0) + 1
    if _reached[point] == spec[1]:
        os.kill(os.getpid(), signal.SIGKILL)


# -- reading ----------------------------------------------------------------------------------

def open_regular(path):
    """``open(path, "rb")`` of a regular file: a FIFO (whose open would wait for a writer for
    ever), device node or socket raises :class:`CheckpointError` before it is opened (and the
    opened file is checked again); a missing file raises ``FileNotFoundError``."""
    path = os.fspath(path)
    mode = os.stat(path).st_mode
    fd = -1
    if stat.S_ISREG(mode):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)     # replaced by a FIFO since: no wait
        mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        if fd >= 0:
            os.close(fd)
        raise CheckpointError(f"{path}: {outputs.file_kind(mode)}, not a checkpoint file: refusing "
                              "to read it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_latest(ckpt_dir) -> str | None:
    """The tag DeepSpeed's ``ckpt_dir/latest`` names (None without that file): a plain folder
    name, never a path (``latest`` comes with the checkpoint: it must not lead elsewhere)."""
    latest = os.path.join(os.fspath(ckpt_dir), "latest")
    try:
        with open_regular(latest) as fh:
            raw = fh.read(4096)
    except FileNotFoundError:
        return None
    try:
        tag = raw.decode().strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{latest}: not a tag name (not text)") from None
    if not tag or os.sep in tag or tag in (".", "..") or "\0" in tag:
        raise CheckpointError(f"{latest} names {tag[:200]!r}, which is not a tag (a folder name in "
                              f"{ckpt_dir})")
    return tag


def _refusal(path, exc: BaseException) -> str:
    """torch's weights-only message, reduced to the object it refused."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    why = next((ln for ln in lines if "Unsupported" in ln or "WeightsUnpickler error" in ln),
               lines[0] if lines else type(exc).__name__)
    why = why.replace("WeightsUnpickler error: ", "").split(" was not an allowed global")[0]
    return (f"{path}: refused: it holds an object other than tensors, numbers, strings and "
            f"containers, and loading it could run code ({why})")


def safe_load(path, map_location="cpu"):
    """``torch.load(path, weights_only=True)``; a missing, truncated or damaged file and one
    that needs any other object raise :class:`CheckpointError` naming ``path``."""
    path = os.fspath(path)
    try:
        with open_regular(path) as fh:
            return torch.load(fh, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            raise CheckpointError(_refusal(path, e)) from None
        raise CheckpointError(f"{path}: damaged ({_one_line(e)})") from None
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"{path}: truncated or damaged, cannot be read ({_one_line(e)})") \
            from None


def loadable_without_code(obj, what: str) -> None:
    """Refuse (before writing) what :func:`safe_load` could not read back: ``what`` names it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(_refusal(what, e).replace(": refused: it holds", " holds", 1)
                              .replace("loading it could", "loading it would")
                              + "; keep only such values in it") from None


# torch.distributed.checkpoint's metadata file: the classes its pickle may name (torch 2.13)
_DCP = "torch.distributed.checkpoint."
_METADATA_CLASSES = {
    *((_DCP + "metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *((_DCP + "planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    (_DCP + "filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "PurePosixPath"))}


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds DCP's metadata dataclasses, torch dtypes and nothing
    else (torch's weights-only unpickler does not read the protocol-4 pickle DCP writes)."""

    def find_class(self, module, name):
        if (module, name) in _METADATA_CLASSES or \
                (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")


class _NoCodeLoad:
    """What :func:`no_code_on_load` puts in place of ``torch.load`` and DCP's ``pickle``."""

    def __init__(self, torch_load):
        self.torch_load, self.refused = torch_load, []

    def load_torch(self, f, *args, weights_only=None, **kw):
        try:
            return self.torch_load(f, *args, weights_only=True, **kw)
        except pickle.UnpicklingError as e:
            self.refused.append(_refusal(getattr(f, "name", None) or
                                         (f if isinstance(f, (str, os.PathLike)) else
                                          "a non-tensor item of a .distcp file"), e))
            raise

    def load_pickle(self, f, *args, **kw):
        try:
            return _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            self.refused.append(f"{getattr(f, 'name', 'DCP metadata')}: refused: it names an "
                                f"object outside torch.distributed.checkpoint's metadata "
                                f"({_one_line(e)}), and loading it could run code")
            raise


def check_dcp_metadata(folder) -> None:
    """Read torch DCP's metadata file(s) of ``folder`` (``.metadata``, ``__<rank>.metadata``)
    with the restricted unpickler: a refused one raises :class:`CheckpointError` naming it
    before ``dist_checkpointing`` (whose reader would log a traceback) is called."""
    for entry in sorted(os.listdir(folder)):
        if entry == ".metadata" or (entry.startswith("__") and entry.endswith(".metadata")):
            path = os.path.join(folder, entry)
            try:
                with open(path, "rb") as f:
                    _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"{path}: refused: it names an object outside "
                                      f"torch.distributed.checkpoint's metadata ({_one_line(e)}), "
                                      "and loading it could run code") from None
            except (EOFError, ValueError, AttributeError, TypeError, IndexError) as e:
                raise CheckpointError(f"{path}: truncated or damaged ({_one_line(e)})") from None


class _PickleModule:
    """``pickle`` with ``load`` replaced (DCP's filesystem module reads metadata through it)."""

    def __init__(self, load):
        self.load = load

    def __getattr__(self, name):
        return getattr(pickle, name)


@contextlib.contextmanager
def no_code_on_load(what):
    """While Megatron-core's ``dist_checkpointing`` loads ``what`` (a folder): no unpickling
    that can run code (see the module's docstring).  Any failure inside becomes one
    :class:`CheckpointError` naming the refused file, or the folder."""
    from torch.distributed.checkpoint import filesystem
    guard = _NoCodeLoad(torch.load)
    saved_pickle = filesystem.pickle
    torch.load, filesystem.pickle = guard.load_torch, _PickleModule(guard.load_pickle)
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:          # DCP's CheckpointException is a BaseException
        if guard.refused:
            raise CheckpointError(guard.refused[0]) from None
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{what}: Megatron-core's dist_checkpointing could not load it "
                              f"({_one_line(e)})") from None
    finally:
        torch.load, filesystem.pickle = guard.torch_load, saved_pickle


# -- manifest ---------------------------------------------------------------------------------

def _files(folder) -> list[str]:
    """Every file under ``folder`` but the manifest, relative, sorted; a symlink to a folder
    counts as a file (it is not walked: a checkpoint holds none, so it is never listed)."""
    out = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for n in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            rel = os.path.relpath(os.path.join(root, n), folder)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _digest(path, sync: bool = False) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open_regular(path) as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _digests(folder, rels: list[str], sync: bool = False) -> dict:
    """``{rel: (size, sha256)}`` of files of ``folder``, hashed on a few threads (hashlib
    releases the GIL while it hashes)."""
    workers = max(1, min(8, os.cpu_count() or 1, len(rels)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(rels, pool.map(lambda rel: _digest(os.path.join(folder, rel), sync), rels)))


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(folder, final=None) -> None:
    """Collective: fsync and hash the folder's files (rank r takes every world-th), then rank
    0 writes ``manifest.json`` and fsyncs the folder.  A rank that fails (no space for the
    manifest, an I/O error) fails it on every rank, naming ``final`` (default ``folder``)."""
    files, exc = _files(folder), None
    try:
        mine = _digests(folder, files[_rank()::_world()], sync=True)
    except OSError as e:
        mine, exc = {}, _write_error(final or folder, e)
    rows = [json.loads(t) for t in gather_text(json.dumps(mine))]
    agree(exc, f"saving {final or folder} failed")
    if _rank() == 0:
        entries = {rel: {"size": s, "sha256": h} for part in rows for rel, (s, h) in part.items()}
        try:
            with open(os.path.join(folder, MANIFEST), "w") as f:
                json.dump({"format": MANIFEST_FORMAT, "files": dict(sorted(entries.items()))}, f,
                          indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(folder)
        except OSError as e:
            exc = _write_error(final or folder, e)
    agree(exc, f"saving {final or folder} failed")


def read_manifest(folder) -> dict:
    """``{relative path: {"size", "sha256"}}`` of ``folder``'s manifest."""
    path = os.path.join(os.fspath(folder), MANIFEST)
    try:
        with open_regular(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {MANIFEST}: its save did not complete (or a "
                              f"ds_autoplan without manifests wrote it)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({_one_line(e)})") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()):
        raise CheckpointError(f"{path}: not a ds_autoplan manifest (no \"files\" with a size and "
                              "sha256 per file)")
    if data.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path}: manifest format {data.get('format')!r}, this version "
                              f"reads format {MANIFEST_FORMAT}")
    outside = next((rel for rel in files if not _inside(folder, rel)), None)
    if outside is not None:
        raise CheckpointError(f"{path}: lists {outside[:200]!r}, which is not a file inside "
                              f"{folder}: refusing to read it")
    return files


def _inside(folder, rel: str) -> bool:
    """``rel`` names a path inside ``folder``, also once symlinks are followed: a relative,
    normalised name (no ``..``) whose real path lies under the folder's."""
    if not rel or "\0" in rel or os.path.isabs(rel) or os.path.normpath(rel) != rel \
            or rel.split(os.sep)[0] == "..":
        return False
    real = os.path.realpath(folder)
    return os.path.realpath(os.path.join(folder, rel)).startswith(real.rstrip(os.sep) + os.sep)


def verify(folder, part: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with ``folder`` against its manifest, one line per file: missing,
    truncated (or grown), not listed, checksum mismatch.  Sizes are checked for every file,
    checksums for the files ``part`` = (i, n) selects (every n-th from the i-th)."""
    folder = os.fspath(folder)
    files = read_manifest(folder)
    problems = []
    for rel in sorted(set(_files(folder)) - set(files)):
        problems.append(f"{os.path.join(folder, rel)}: not listed in {MANIFEST}")
    names = sorted(files)
    whole = []
    for rel in names:
        path, want = os.path.join(folder, rel), files[rel]
        try:
            st = os.stat(path)
        except FileNotFoundError:
            problems.append(f"{path}: missing (listed in {MANIFEST})")
            continue
        if not stat.S_ISREG(st.st_mode):        # never opened: a FIFO's open would wait for ever
            problems.append(f"{path}: {outputs.file_kind(st.st_mode)}, not a checkpoint file")
            continue
        size = st.st_size
        if size != want["size"]:
            what = "truncated" if size < want["size"] else "larger than saved"
            problems.append(f"{path}: {what}: {size} bytes, {want['size']} when saved")
        else:
            whole.append(rel)
    mine = set(names[part[0]::part[1]])
    for rel, (_, digest) in _digests(folder, [r for r in whole if r in mine]).items():
        if digest != files[rel]["sha256"]:
            problems.append(f"{os.path.join(folder, rel)}: checksum mismatch: its content "
                            "changed after the save")
    return problems


def verify_before_load(folder) -> None:
    """Collective: every rank checks every size and its share of the checksums; all ranks
    raise the same one line when anything is wrong."""
    try:
        problems = verify(folder, (_rank(), _world()))
    except CheckpointError as e:
        problems = [str(e)]
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    bad = first_error("; ".join(problems[:3]) + more if problems else None)
    if bad is not None:
        raise CheckpointError(f"checkpoint {folder} is damaged: {bad[1]}")


# -- writing ----------------------------------------------------------------------------------

def _exchange(a, b) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or file system has no such call."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _aside(final) -> str:
    parent, name = os.path.split(final)
    return os.path.join(parent, f".{name}{OLD}")


def _install(staging, final) -> None:
    """Move the sealed ``staging`` folder to ``final``; an existing ``final`` stays complete
    until the new one is in place, then is removed."""
    try:
        os.rename(staging, final)
        return
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
            raise
    if exchange(staging, final):            # staging now holds the previous copy
        shutil.rmtree(staging, ignore_errors=True)
        return
    old = _aside(final)                     # no atomic swap here: two renames
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
    fault_point("between-renames")
    os.rename(staging, final)
    shutil.rmtree(old, ignore_errors=True)


exchange = _exchange      # tests replace it to take the two-rename path


def resolve(final) -> str:
    """``final``, or the previous copy a save moved aside and was killed before replacing
    (the two-rename path of :func:`_install`) when ``final`` is missing."""
    final = os.fspath(final)
    old = _aside(os.path.abspath(final))
    if not os.path.exists(final) and os.path.isfile(os.path.join(old, MANIFEST)):
        return old
    return final


def _lock(path) -> tuple[int | None, bool]:
    """``(fd, locked)``: an exclusive ``flock`` on ``path`` taken; ``(None, False)`` when
    another process holds it (or ``path`` is gone); ``(fd, False)`` where the file system has
    no ``flock`` (then nothing is ever taken for a killed writer's)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None, False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd, True
    except BlockingIOError:
        os.close(fd)
        return None, False
    except OSError:
        return fd, False


def _remove_stale(parent) -> None:
    """Rank 0, before a save into ``parent``: remove the staging folders no live save holds
    (a killed save's, of any tag) and put back a copy a killed two-rename swap left aside
    (dropping it where the tag is in place).  Only these hidden names of ours are touched."""
    for entry in os.listdir(parent):
        if entry.startswith(".") and entry.endswith(OLD) and len(entry) > len(OLD) + 1:
            old, final = os.path.join(parent, entry), os.path.join(parent, entry[1:-len(OLD)])
            if not os.path.isdir(old) or os.path.islink(old):
                continue
            if os.path.exists(final) or not os.path.isfile(os.path.join(old, MANIFEST)):
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(old, final)
    _remove_unheld(parent, lambda e: e.startswith(".") and STAGING in e, os.path.isdir, shutil.rmtree)


def _remove_unheld(parent, ours, kind, remove) -> None:
    """Remove the entries of ``parent`` whose name ``ours(name)`` accepts, of ``kind``
    (``os.path.isdir`` / ``isfile``; never a symlink), whose ``flock`` no live writer holds:
    a killed writer's."""
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        if ours(entry) and kind(path) and not os.path.islink(path):
            fd, locked = _lock(path)
            if fd is None:
                continue
            try:
                if locked:
                    remove(path)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)


def _stage(final) -> tuple[str, int]:
    """Rank 0: a new staging folder beside ``final`` (mode from the umask), locked."""
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    if os.path.lexists(final) and not os.path.isdir(final):
        raise CheckpointError(f"{final} exists and is not a folder: refusing to replace it "
                              "with a checkpoint")
    _remove_stale(parent)
    while True:
        staging = os.path.join(parent, f".{name}{STAGING}{secrets.token_hex(4)}")
        try:
            os.mkdir(staging)
        except FileExistsError:
            continue
        fd, _ = _lock(staging)
        if fd is not None and os.path.isdir(staging):
            return staging, fd
        if fd is not None:          # a cleaner removed it before the lock: another name
            os.close(fd)


def _write_error(final, e: BaseException) -> BaseException:
    """A failed write of a save as one line: the system's reason (a read-only file system, no
    permission, no space), torch's zip writer's failure (how a full disk shows through
    ``torch.save``) with the space left; other exceptions as they are."""
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        return CheckpointError(f"cannot save {final}: {e.strerror or _one_line(e)}{where}")
    if isinstance(e, RuntimeError) and ("inline_container" in str(e) or "PytorchStreamWriter" in str(e)):
        try:
            free = f"{shutil.disk_usage(os.path.dirname(final)).free / 2 ** 20:.0f} MiB free there"
        except OSError:
            free = "free space unknown"
        return CheckpointError(f"cannot save {final}: torch could not write a file of it (a full "
                               f"disk? {free}): {_one_line(e)}")
    return e


def save_atomically(final, write) -> None:
    """Collective: ``write(folder)`` on every rank into one staging folder, then (when every
    rank succeeded) seal it with a manifest and move it to ``final`` (see the module's
    docstring).  A failure on any rank raises on every rank and leaves ``final`` as it was."""
    final = os.path.abspath(os.fspath(final))
    staging, fd, exc = "", None, None
    if _rank() == 0:
        try:
            staging, fd = _stage(final)
        except Exception as e:              # noqa: BLE001 -- every rank must hear of it
            exc = _write_error(final, e)
    try:
        agree(exc, f"cannot save {final}")
        staging = broadcast_text(staging)
        fault_point("staged")
        try:
            write(staging)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:          # noqa: BLE001 -- DCP's CheckpointException too
            exc = _write_error(final, e)
        agree(exc, f"saving {final} failed")
        fault_point("written")
        _seal(staging, final)
        fault_point("manifest")
        if _rank() == 0:
            try:
                _install(staging, final)
                _fsync_dir(os.path.dirname(final))
            except OSError as e:
                exc = CheckpointError(f"cannot move the saved checkpoint to {final}: {e}")
        agree(exc, f"saving {final} failed")
        fault_point("installed")
    finally:
        if _rank() == 0 and fd is not None:
            if os.path.isdir(staging):      # a failed save's (a successful one was moved)
                shutil.rmtree(staging, ignore_errors=True)
            os.close(fd)


def write_file(path, data: bytes | str) -> None:
    """Replace ``path`` atomically with ``data`` (:func:`ds_autoplan.outputs.write_file`: a
    locked temporary file beside it, fsync, ``os.replace``, fsync of the folder), the fault
    point ``latest-tmp`` between the written temporary file and the replace."""
    raw = data.encode() if isinstance(data, str) else data

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        fault_point("latest-tmp")

    outputs.write_file(path, fill, what="checkpoint file")


def write_latest(save_dir, tag: str) -> None:
    """DeepSpeed's ``save_dir/latest`` naming ``tag``, replaced atomically (rank 0)."""
    write_file(os.path.join(os.fspath(save_dir), "latest"), str(tag))


def torch_save(obj, path) -> None:
    """``torch.save`` of one checkpoint file (a fault point follows)."""
    torch.save(obj, path)
    fault_point("file")


class SafeFiles:
    """The checkpoint engine handed to DeepSpeed's ``PipelineModule.save_state_dict`` /
    ``load_state_dir``: writes through the engine's own (DeepSpeed's ``TorchCheckpointEngine``
    unless configured otherwise), reads with :func:`safe_load` -- files read beforehand
    (``preloaded``, path -> object) are handed over without reading them again."""

    def __init__(self, inner, preloaded: dict | None = None):
        self.inner, self.preloaded = inner, dict(preloaded or {})

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save(self, state_dict, path):
        self.inner.save(state_dict, path)
        fault_point("file")

    def load(self, path, map_location=None):
        if path in self.preloaded:
            return self.preloaded.pop(path)
        return safe_load(path, map_location="cpu" if map_location is None else map_location)


__all__ = ["CheckpointError", "FAULT_POINTS", "MANIFEST", "SafeFiles", "agree", "check_dcp_metadata",
           "fault_point", "fault_settings", "first_error", "loadable_without_code", "no_code_on_load",
           "open_regular", "read_latest", "read_manifest", "resolve", "safe_load", "save_atomically",
           "torch_save", "verify", "verify_before_load", "write_file", "write_latest"]
