"""`ds-autoplan checkpoint info DIR`: which plan (schedule, partition, pp, dp, ZeRO) and which
runtime wrote a ds_autoplan checkpoint, at which step (ds_autoplan.runtime.checkpoint)."""
from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect a ds_autoplan checkpoint")
    csub = p.add_subparsers(dest="action", required=True)
    info = csub.add_parser("info", help="the plan and step a checkpoint was saved under")
    info.add_argument("dir", help="checkpoint folder (holds autoplan_checkpoint.json)")
    info.add_argument("--json", action="store_true", help="print the metadata as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..runtime.checkpoint import describe, read_meta
    print(json.dumps(read_meta(args.dir), indent=1) if args.json else describe(args.dir))
    return 0
