"""`ds-autoplan patch deepspeed [--revert|--check|--diff]`: add ``--autoplan`` to the installed
DeepSpeed launcher (``deepspeed/launcher/runner.py``), or take it out again.

The edit is the one in ``patches/deepspeed-autoplan.patch``: one launcher option and, once the
launch's resources are known, a call to :func:`ds_autoplan.cli.launch_cmd.apply_autoplan`
(every rank runs the script through ds_autoplan's bootstrap, which plans the model the script
builds and merges the plan into the script's DeepSpeed config).  Every
inserted line ends with a marker, so applying is idempotent and ``--revert`` restores the
original file byte for byte.  Only DeepSpeed versions whose launcher was checked are patched.
"""
from __future__ import annotations

import difflib
import os

from . import UserError

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
      "        from ds_autoplan.cli.launch_cmd import apply_autoplan",
      "        apply_autoplan(args, sum(len(slots) for slots in active_resources.values()), env)"],
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


def add_parser(subparsers):
    p = subparsers.add_parser("patch", help="add/remove `deepspeed --autoplan` in the installed launcher",
                              description=__doc__.splitlines()[0])
    p.add_argument("target", choices=["deepspeed"])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--revert", action="store_true", help="restore the original launcher")
    g.add_argument("--check", action="store_true", help="only report whether the patch is applied")
    g.add_argument("--diff", action="store_true", help="print the patch as a unified diff")
    p.set_defaults(func=run)


def run(args) -> int:
    path, version = runner_file()
    with open(path) as fh:
        text = fh.read()
    applied = MARK in text
    if args.check:
        print(f"{path}: --autoplan {'applied' if applied else 'not applied'} (deepspeed {version})")
        return 0
    if args.diff:
        print(diff(unpatched(text)), end="")
        return 0
    if args.revert:
        if not applied:
            print(f"{path}: not patched; nothing to do")
            return 0
        new = unpatched(text)
    else:
        if version not in SUPPORTED:
            raise UserError(f"deepspeed {version} is not supported by this patch (checked: "
                            f"{', '.join(SUPPORTED)}); use `ds-autoplan launch` instead")
        if applied:
            print(f"{path}: already patched")
            return 0
        new = patched(text)
        compile(new, path, "exec")
    if not os.access(path, os.W_OK):
        raise UserError(f"cannot write {path}; run with permission to edit the DeepSpeed install")
    with open(path, "w") as fh:
        fh.write(new)
    print(f"{path}: {'reverted' if args.revert else 'patched: deepspeed --autoplan is available'}")
    return 0
