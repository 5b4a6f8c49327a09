"""The nodes of a running launch, for the runtimes and the client hooks: every rank's facts
(node, device, host; :func:`ds_autoplan.profile.detect.rank_facts`) gathered once per process
group, nodes that differ refused naming the odd one, ``--cluster auto`` detected from them, and
a plan whose node layout the launch contradicts refused in one line (``Plan.layout_conflict``).
"""
from __future__ import annotations

import json

from ..errors import UserError

_FACTS: dict = {}


def launch_facts() -> list[dict]:
    """Collective (every rank calls it, in an initialised default group): every rank's facts,
    in rank order; gathered once per process group."""
    import torch.distributed as dist

    from ..profile.detect import launch_layout, rank_facts
    from .common.collectives import gather_text
    key = (id(dist.group.WORLD), dist.get_world_size(), dist.get_rank())
    if key not in _FACTS:
        layout = {**launch_layout(), "rank": dist.get_rank(), "world": dist.get_world_size()}
        _FACTS.clear()
        _FACTS[key] = [json.loads(t) for t in gather_text(json.dumps(rank_facts(layout)))]
    return _FACTS[key]


def launch_nodes() -> list[list[dict]]:
    """Collective: the launch's ranks by node; nodes that differ are refused naming the odd one."""
    from ..spec import SpecError
    from ..spec.devices import check_homogeneous
    try:
        return check_homogeneous(launch_facts())
    except SpecError as e:
        raise UserError(str(e)) from None


def launch_cluster(cluster=None, folder: str | None = None, remeasure: bool = False):
    """Collective: the cluster a plan made in this launch is for.  ``cluster`` None or
    ``"auto"``: detected from the ranks' facts (a known GPU kind: its datasheet figures; CPU
    ranks and unknown devices: measured here, links among the ranks included), as a
    ClusterSpec, its figures kept in the run's output ``folder`` and reused by the next launch
    from it on the same machine unless ``remeasure`` (profile/persisted.py: rank 0 reads the
    file, every rank gets its answer); otherwise returned as given, after the launch's nodes
    were checked."""
    nodes = launch_nodes()
    if cluster not in (None, "auto"):
        return cluster
    import torch.distributed as dist

    from ..profile import persisted
    from ..spec import ClusterSpec, SpecError
    from .common.collectives import broadcast_text
    facts = launch_facts()
    mach = persisted.machine(facts)
    kept = None
    if dist.get_rank() == 0 and not persisted.remeasure(remeasure):
        kept = persisted.load(folder, mach)
    kept = json.loads(broadcast_text(json.dumps(kept)))
    try:
        if kept is not None:
            fields, notes = persisted.reused(kept, folder)
        else:
            fields, _, notes, _ = detect(facts, nodes)
        spec = ClusterSpec.from_dict(fields, "--cluster auto")
    except SpecError as e:
        raise UserError(f"--cluster auto: {e}") from None
    if dist.get_rank() == 0:
        if kept is None:
            persisted.keep(folder, fields, mach, notes)
        for note in notes:
            print(f"ds-autoplan: cluster auto: {note}", flush=True)
    return spec


def detect(facts: list[dict], nodes: list[list[dict]], quick: bool = True, measure_all: bool = False,
           name: str | None = None):
    """Collective, in an initialised process group (every rank of a launch calls it, with the
    ranks' ``facts`` and their ``nodes``): measures what no datasheet gives (a CPU or unknown
    device: rank 0's device; the links among the ranks), or everything with ``measure_all``.
    The same ``(fields, figures, notes, facts)`` on every rank."""
    import torch.distributed as dist

    from ..profile.detect import device_measured, kind_of, launch_layout, local_device, measure_links, with_matmul
    from .common.collectives import broadcast_text
    f = facts[0]
    known = bool(f.get("device")) and kind_of(f["device"], float(f["memory_gib"])) is not None
    measured: dict = {}
    if measure_all or not known:
        dev = local_device(launch_layout())
        mine = device_measured(dev, quick, known) if dist.get_rank() == 0 else {}
        measured.update(json.loads(broadcast_text(json.dumps(mine))))
        measured.update(measure_links(nodes, dev, quick))
    return (*with_matmul(facts, measured, name), facts)


def check_plan(plan, where: str = "this launch") -> None:
    """Collective: refuse, in one line, a plan whose node layout ``where`` contradicts (a group
    the plan kept inside a node spans nodes here); re-planning for the launch is the fix."""
    nodes = launch_nodes()
    conflict = plan.layout_conflict(len(nodes), len(nodes[0]))
    if conflict:
        raise UserError(f"the plan ({plan.cluster}, pp={plan.pp} tp={plan.tp} dp={plan.dp}) does not "
                        f"fit {where} of {len(nodes)} node{'s' if len(nodes) > 1 else ''} x "
                        f"{len(nodes[0])} ranks: {conflict}; plan it for this launch (--cluster auto)")
