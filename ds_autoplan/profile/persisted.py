"""The detected cluster, kept: ``--cluster auto`` writes the figures it measured to
``cluster.detected.yaml`` in the run's output folder and the next launch from that folder
reuses them, measuring again only when the machine differs (its hosts, devices, node count,
ranks per node, cores or memory) or when asked (``--remeasure`` / ``DS_AUTOPLAN_REMEASURE=1``).
The same job on the same machine then gets the same plan: a micro-benchmark's noise (a CPU
rank's latency measured at 1644.6 us, then at 310.0 us a minute later) no longer moves it.

The file is a cluster file (``--cluster cluster.detected.yaml`` loads it) with two more keys:
``machine`` (what the figures were measured on) and ``notes`` (what detection said)."""
from __future__ import annotations

import datetime
import os

FILE = "cluster.detected.yaml"
REMEASURE_ENV = "DS_AUTOPLAN_REMEASURE"


def machine(facts: list[dict]) -> dict:
    """What the figures depend on, from the ranks' facts (profile/detect.rank_facts)."""
    nodes = sorted({int(f["node"]) for f in facts})
    first = {n: next(f for f in facts if int(f["node"]) == n) for n in nodes}
    return {"nodes": len(nodes), "ranks_per_node": len(facts) // max(1, len(nodes)),
            "hosts": [first[n]["host"] for n in nodes],
            "devices": sorted({f"{f.get('device') or 'cpu'}:{f.get('memory_gib')}" for f in facts}),
            "cpu_cores": facts[0].get("cpu_cores"), "host_memory_gb": facts[0].get("host_memory_gb")}


def remeasure(asked: bool = False) -> bool:
    """Whether to measure again although a kept file matches."""
    from ..env import env_int
    return asked or bool(env_int(REMEASURE_ENV, 0, minimum=0))


def load(folder: str | None, mach: dict) -> tuple[dict, list] | None:
    """The kept ``(cluster fields, notes)`` for ``mach`` in ``folder``, or None (no file, another
    machine, a file that is not one of ours, or one whose figures make no cluster: measured
    again)."""
    if not folder:
        return None
    import yaml
    path = os.path.join(folder, FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            d = yaml.safe_load(fh.read(1 << 20))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(d, dict) or d.get("machine") != mach or not isinstance(d.get("cluster"), dict):
        return None
    from ..spec import ClusterSpec, SpecError
    try:                        # figures a cluster cannot hold (an older or edited file): measured again
        ClusterSpec.from_dict(d["cluster"], path)
    except (SpecError, ValueError, TypeError):
        return None
    notes = d.get("notes") if isinstance(d.get("notes"), list) else []
    return d["cluster"], [str(n) for n in notes]


def reused(kept: tuple, folder: str) -> tuple[dict, list]:
    """``(fields, notes)`` of a kept file (:func:`load`), the notes saying where they came from."""
    fields, notes = kept
    return fields, [*notes, (f"the figures measured before on this machine, from "
                             f"{os.path.join(folder, FILE)} (--remeasure, or {REMEASURE_ENV}=1, "
                             "measures again)")]


def keep(folder: str | None, fields: dict, mach: dict, notes: list) -> None:
    """Keep the measured ``fields`` for ``mach`` in ``folder`` (atomically, among the folder's
    outputs; no folder: nothing kept); a failure is a warning on stderr, not a stop."""
    if not folder:
        return
    import sys

    import yaml

    from ..errors import UserError
    from ..outputs import text, write_folder
    body = {"cluster": fields, "machine": mach, "notes": list(notes),
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    header = ("# figures ds-autoplan measured on this machine (--cluster auto); reused by launches "
              "from this folder\n# on the same machine (--remeasure measures again)\n")
    try:
        write_folder(folder, {FILE: text(header + yaml.safe_dump(body, sort_keys=False))}, complete=False)
    except UserError as e:
        print(f"ds-autoplan: warning: {e}; the figures measured now are not kept", file=sys.stderr, flush=True)
