"""`ds-autoplan checkpoint info DIR`: which plan (schedule, partition, pp, dp, ZeRO) and which
runtime wrote a ds_autoplan checkpoint, at which step (ds_autoplan.runtime.checkpoint)."""
from __future__ import annotations

import json

from . import doc_description


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect a ds_autoplan checkpoint",
                       description=doc_description(__doc__))
    csub = p.add_subparsers(dest="action", required=True)
    info = csub.add_parser("info", help="the plan and step a checkpoint was saved under; verifies "
                                        "its files against its manifest (size, sha256)")
    info.add_argument("dir", help="checkpoint folder (holds autoplan_checkpoint.json)")
    info.add_argument("--json", action="store_true", help="print the metadata as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..runtime.checkpoint import check_files, describe, read_meta
    if args.json:
        meta = read_meta(args.dir)
        check_files(args.dir)
        print(json.dumps(meta, indent=1))
    else:
        print(describe(args.dir))
    return 0
