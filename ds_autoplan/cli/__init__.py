"""`ds-autoplan` command line.

Each sub-command lives in its own module of this package with ``add_parser(subparsers)`` and
``run(args) -> int``; errors that are the user's (bad input) are raised as :class:`UserError`
and printed as one line, exit code 2."""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import UserError  # noqa: F401  (re-exported: ds_autoplan.cli.UserError)



def _user_errors() -> tuple[type, ...]:
    from ..schedule.ir import ScheduleError
    from ..spec import SpecError
    return (UserError, ScheduleError, SpecError)


DESCRIPTION = ("Plan large-model training for DeepSpeed and Megatron-core: search the hybrid "
               "parallelism (data, ZeRO, tensor, pipeline, recompute), the micro-batch and the "
               "pipeline schedule for a model on a cluster, and write the configs your script needs.")


def _epilog() -> str:
    from ..spec import preset_names
    return (f"model presets: {', '.join(preset_names('models'))} (or a model YAML, or a Hugging "
            f"Face config.json); cluster presets: {', '.join(preset_names('clusters'))} (or a "
            "cluster YAML). `ds-autoplan presets` says what each is.\n\n"
            "start here: ds-autoplan plan --model gpt3-13b --cluster 2x8xa100-ib200 "
            "--global-batch 256 --out out/plan")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's paragraphs, wrapping each one."""
    def _fill_text(self, text, width, indent):
        import textwrap
        return "\n\n".join(textwrap.fill(par, width, initial_indent=indent, subsequent_indent=indent,
                                          break_on_hyphens=False) for par in text.split("\n\n"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-autoplan", description=DESCRIPTION, epilog=_epilog(),
                                formatter_class=_Help)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from . import (calibrate_cmd, checkpoint_cmd, cluster_cmd, cost_cmd, launch_cmd, patch_cmd,
                   plan_cmd, presets_cmd, profile_cmd, simulate_cmd)
    for cmd in (plan_cmd, cost_cmd, cluster_cmd, simulate_cmd, launch_cmd, calibrate_cmd, profile_cmd,
                presets_cmd, patch_cmd, checkpoint_cmd):
        cmd.add_parser(sub)
    return p


def doc_description(doc: str) -> str:
    """A command's description for its --help: the first paragraph of its module docstring,
    without the `ds-autoplan NAME ...`: head and reST markup."""
    first = " ".join(doc.split("\n\n")[0].split())
    if first.startswith("`ds-autoplan") and "`: " in first:
        first = first.split("`: ", 1)[1]
    first = first.replace("``", "")
    return first[:1].upper() + first[1:]


def _stdout_closed() -> int:
    """The reader of our output went away (``ds-autoplan plan --json | head -c 600``): a normal
    end, as for any Unix tool: no message, the exit status a shell reports for SIGPIPE, and no
    second error when Python flushes stdout at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()          # a closed pipe shows here, not in the interpreter's exit
        return rc
    except BrokenPipeError:
        return _stdout_closed()
    except _user_errors() as e:
        print(f"ds-autoplan {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:       # a missing input, a read-only file system, no permission...
        print(f"ds-autoplan {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
