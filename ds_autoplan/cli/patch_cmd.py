"""`ds-autoplan patch deepspeed [--revert|--check|--diff]`: add ``--autoplan`` to the installed
DeepSpeed launcher (``deepspeed/launcher/runner.py``), or take it out again.

The edit is the one in ``patches/deepspeed-autoplan.patch``: one launcher option and, once the
launch's resources are known, a call to :func:`ds_autoplan.cli.launch_cmd.apply_autoplan`
(every rank runs the script through ds_autoplan's bootstrap, which plans the model the script
builds and merges the plan into the script's DeepSpeed config).  Every
inserted line ends with a marker, so applying is idempotent and ``--revert`` restores the
original file byte for byte.  Only DeepSpeed versions whose launcher was checked are patched.

``ds-autoplan launch`` does the same with no edit of site-packages (it calls DeepSpeed's own
``runner.main``) and is the route to prefer; DeepSpeed's launcher has no plugin hook, so
``deepspeed --autoplan`` needs this edit.  The edit is crash-safe: the original is kept beside
it (``runner.py.ds-autoplan-orig``) and each file is replaced atomically (temporary file, fsync,
``os.replace``), so an interrupted write leaves the old launcher whole, and ``--revert``
restores the backup if runner.py was damaged anyway.  A reinstall of DeepSpeed leaves the
backup but not the edit: ``--check`` reports the patch as lost and says to patch again
(DeepSpeed's own parser rejects ``--autoplan`` before any code of ours runs).
"""
from __future__ import annotations

import difflib
import os

from . import UserError, doc_description

MARK = "  # ds_autoplan"
SUPPORTED = ("0.19.8",)

# (anchor line, lines to insert, before/after the anchor)
_EDITS = [
    ('    parser.add_argument("user_script", type=str, help="User script to launch, followed by any required "\n',
     ['    parser.add_argument("--autoplan", action="store_true",',
      '                        help="ds_autoplan: plan the model the script builds for this launch\'s world "',
      '                        "size and merge the plan into the script\'s DeepSpeed config")'],
     "before"),
    ("    active_resources = apply_num_nodes_and_gpus(active_resources, args.num_nodes, args.num_gpus)\n",
     ["    if args.autoplan:",
      "        from ds_autoplan.cli.launch_cmd import autoplan_in_runner",
      "        autoplan_in_runner(args, sum(len(slots) for slots in active_resources.values()), env)"],
     "after"),
]


def patched(text: str) -> str:
    """``runner.py`` text with the ``--autoplan`` edit (raises UserError if an anchor moved)."""
    for anchor, lines, where in _EDITS:
        if text.count(anchor) != 1:
            raise UserError("the installed deepspeed launcher does not look like the one this patch "
                            f"was written for (anchor not found: {anchor.strip()[:60]!r})")
        block = "".join(ln + MARK + "\n" for ln in lines)
        text = text.replace(anchor, block + anchor if where == "before" else anchor + block)
    return text


def unpatched(text: str) -> str:
    return "".join(ln for ln in text.splitlines(keepends=True) if not ln.rstrip("\n").endswith(MARK))


def runner_file() -> tuple[str, str]:
    """Path of the installed ``deepspeed/launcher/runner.py`` and DeepSpeed's version, found
    without importing DeepSpeed (its import prints accelerator warnings)."""
    import importlib.metadata
    import importlib.util
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("deepspeed is not installed in this environment")
    path = os.path.join(list(spec.submodule_search_locations)[0], "launcher", "runner.py")
    if not os.path.exists(path):
        raise UserError(f"deepspeed launcher not found at {path}")
    return path, importlib.metadata.version("deepspeed")


def diff(text: str) -> str:
    new = patched(text)
    return "".join(difflib.unified_diff(text.splitlines(keepends=True), new.splitlines(keepends=True),
                                        "a/deepspeed/launcher/runner.py", "b/deepspeed/launcher/runner.py"))


BACKUP_SUFFIX = ".ds-autoplan-orig"


def backup_file(path: str) -> str:
    """The original ``runner.py`` kept beside it while patched (not in DeepSpeed's install
    record, so a reinstall leaves it: its presence with an unpatched runner.py means the patch
    was lost)."""
    return path + BACKUP_SUFFIX


def _atomic_write(path: str, data: str) -> None:
    """``data`` into ``path`` via a temporary file in the same folder, fsync, ``os.replace``
    (an interrupted write leaves the old file whole); keeps ``path``'s mode."""
    from ..outputs import text, write_file
    mode = os.stat(path).st_mode & 0o7777 if os.path.exists(path) else None
    write_file(path, text(data), what="the deepspeed launcher")
    if mode is not None:
        os.chmod(path, mode)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


def _plausible(text: str | None) -> bool:
    """A whole launcher: it compiles and both anchors of the edit are there."""
    if not text:
        return False
    try:
        compile(text, "runner.py", "exec")
    except (SyntaxError, ValueError):
        return False
    return all(unpatched(text).count(anchor) == 1 for anchor, _, _ in _EDITS)


def state(path: str) -> str:
    """``applied``, ``not applied``, ``lost`` (a backup of an earlier patch but an unpatched
    launcher: DeepSpeed was reinstalled) or ``damaged`` (runner.py is not a whole launcher)."""
    text, has_backup = _read(path), os.path.exists(backup_file(path))
    if text is not None and MARK in text and _plausible(text):
        return "applied"
    if not _plausible(text):
        return "damaged"
    return "lost" if has_backup else "not applied"


LOST_HINT = ("the --autoplan patch was lost (DeepSpeed reinstalled or upgraded?); run "
             "`ds-autoplan patch deepspeed` again, or use `ds-autoplan launch`, which needs no patch")


def apply(path: str, version: str) -> str:
    """Patch ``path`` (kept as the backup first); returns the message."""
    st = state(path)
    if st == "applied":
        return f"{path}: already patched"
    if st == "damaged":
        raise UserError(f"{path} is not a whole deepspeed launcher (an interrupted write?); "
                        "run `ds-autoplan patch deepspeed --revert` to restore the backup, or "
                        "reinstall deepspeed")
    if version not in SUPPORTED:
        raise UserError(f"deepspeed {version} is not supported by this patch (checked: "
                        f"{', '.join(SUPPORTED)}); use `ds-autoplan launch` instead")
    text = _read(path)
    new = patched(text)
    compile(new, path, "exec")
    if not os.access(path, os.W_OK) or not os.access(os.path.dirname(path), os.W_OK):
        raise UserError(f"cannot write {path}; run with permission to edit the DeepSpeed install, "
                        "or use `ds-autoplan launch`, which needs no patch")
    _atomic_write(backup_file(path), text)        # the original first, then the edit
    try:
        _atomic_write(path, new)
    except BaseException:
        os.unlink(backup_file(path))              # runner.py is still the original
        raise
    return f"{path}: patched: deepspeed --autoplan is available"


def revert(path: str) -> str:
    """Undo the patch (or an interrupted write of it); returns the message."""
    st, backup = state(path), backup_file(path)
    original = _read(backup) if os.path.exists(backup) else None
    if st == "applied":
        new = unpatched(_read(path))
        _atomic_write(path, new)
    elif st == "damaged":
        if not _plausible(original):
            raise UserError(f"{path} is not a whole deepspeed launcher and no backup is kept "
                            f"({backup}); reinstall deepspeed")
        _atomic_write(path, original)
    elif st == "not applied":
        return f"{path}: not patched; nothing to do"
    if os.path.exists(backup):
        os.unlink(backup)
    if st == "lost":
        return f"{path}: not patched (DeepSpeed was reinstalled since the patch); removed the old backup"
    return f"{path}: {'restored from the backup' if st == 'damaged' else 'reverted'}"


def add_parser(subparsers):
    p = subparsers.add_parser("patch", help="add/remove `deepspeed --autoplan` in the installed launcher",
                              description=doc_description(__doc__))
    p.add_argument("target", choices=["deepspeed"], help="the launcher to patch (DeepSpeed's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--revert", action="store_true", help="restore the original launcher")
    g.add_argument("--check", action="store_true", help="only report whether the patch is applied")
    g.add_argument("--diff", action="store_true", help="print the patch as a unified diff")
    p.set_defaults(func=run)


def run(args) -> int:
    path, version = runner_file()
    if args.check:
        st = state(path)
        print(f"{path}: --autoplan {st} (deepspeed {version})"
              + (f"; {LOST_HINT}" if st == "lost" else "")
              + ("; run `ds-autoplan patch deepspeed --revert`" if st == "damaged" else ""))
        return 0
    if args.diff:
        text = _read(path)
        if not _plausible(text):
            raise UserError(f"{path} is not a whole deepspeed launcher; run --revert first")
        print(diff(unpatched(text)), end="")
        return 0
    print(revert(path) if args.revert else apply(path, version))
    return 0
