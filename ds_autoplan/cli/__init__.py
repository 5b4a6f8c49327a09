"""`ds-autoplan` command line.  Each sub-command lives in its own module of this package
with ``add_parser(subparsers)`` and ``run(args) -> int``; errors that are the user's
(bad input) are raised as :class:`UserError` and printed as one line, exit code 2."""
from __future__ import annotations

import argparse
import sys

from ..errors import UserError  # noqa: F401  (re-exported: ds_autoplan.cli.UserError)



def _user_errors() -> tuple[type, ...]:
    from ..schedule.ir import ScheduleError
    from ..spec import SpecError
    return (UserError, ScheduleError, SpecError)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-autoplan", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    from . import (checkpoint_cmd, cost_cmd, launch_cmd, patch_cmd, plan_cmd, profile_cmd,
                   simulate_cmd)
    for cmd in (simulate_cmd, plan_cmd, cost_cmd, profile_cmd, launch_cmd, patch_cmd, checkpoint_cmd):
        cmd.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except _user_errors() as e:
        print(f"ds-autoplan {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:       # a missing input, a read-only file system, no permission...
        print(f"ds-autoplan {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
