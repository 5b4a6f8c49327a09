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


def launch_cluster(cluster=None):
    """Collective: the cluster a plan made in this launch is for.  ``cluster`` None or
    ``"auto"``: detected from the ranks' facts (a known GPU kind: its datasheet figures; CPU
    ranks and unknown devices: measured here, links among the ranks included), as a
    ClusterSpec; otherwise returned as given, after the launch's nodes were checked."""
    nodes = launch_nodes()
    if cluster not in (None, "auto"):
        return cluster
    from ..spec import ClusterSpec, SpecError
    try:
        fields, _, notes, _ = detect(launch_facts(), nodes)
        spec = ClusterSpec.from_dict(fields, "--cluster auto")
    except SpecError as e:
        raise UserError(f"--cluster auto: {e}") from None
    import torch.distributed as dist
    if dist.get_rank() == 0:
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

    from ..profile.detect import (host_link, kind_of, launch_layout, local_device, measure_device,
                                  measure_links, with_matmul)
    from .common.collectives import broadcast_text
    f = facts[0]
    known = bool(f.get("device")) and kind_of(f["device"], float(f["memory_gib"])) is not None
    measured: dict = {}
    if measure_all or not known:
        dev = local_device(launch_layout())
        mine = {}
        if dist.get_rank() == 0:
            m = measure_device(dev, quick)
            mine = {"host_link_GBps": host_link(dev, quick),
                    ("matmul_tflops" if known else "peak_tflops"): m["peak_tflops"]}
            if dev.type == "cuda":
                mine["hbm_GBps"] = m["hbm_GBps"]
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
