"""The devices of a machine as the planner needs them (docs/planner.md §0, §1.4): a GPU's kind
matched from the name and memory it reports (``data/gpus.yaml``: ``smi``, ``memory_gib``),
``nvidia-smi`` output read (``--query-gpu=name,memory.total --format=csv`` and ``topo -m``),
the facts every rank of a launch reports grouped into nodes, and the ClusterSpec fields of a
node layout with the datasheet figures of its kind.

torch-free: what is measured on a machine (matmul rate, bandwidths) is measured by
:mod:`ds_autoplan.profile.detect` and handed in here as figures.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from . import SpecError
from .cluster import gpu_table

GiB = 1024 ** 3
MEMORY_TOLERANCE = 0.1      # a device within 10% of a kind's memory is that kind's size
INTER_NODE_GBPS = 25.0      # [decision] per node when nothing measured it: one 200 Gb/s HDR
                            # InfiniBand link, as the 2x8xa100-ib200 preset
_PREFIX = re.compile(r"^(NVIDIA|Tesla)\s+", re.I)
_MIG = re.compile(r"\bMIG\b")
_LINK_CODES = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")
# the ClusterSpec fields a datasheet or a measurement gives, shown side by side
FIGURES = ("peak_tflops", "intra_node_GBps", "intra_latency_us", "inter_node_GBps",
           "inter_latency_us", "nic_GBps", "host_link_GBps", "cpu_adam_rate_per_core")


@dataclass(frozen=True)
class Device:
    """One device as a tool reports it: its name and total memory (GiB)."""
    name: str
    memory_gib: float
    mig: bool = False

    def __str__(self) -> str:
        return f"{self.name} ({self.memory_gib:.1f} GiB)"


def short_name(name: str) -> str:
    """The device name without a leading "NVIDIA " / "Tesla " and surrounding blanks."""
    return _PREFIX.sub("", name.strip())


def kind_of(name: str, memory_gib: float) -> str | None:
    """The ``gpus.yaml`` kind of a device reporting ``name`` and ``memory_gib`` GiB, or None:
    a kind whose ``smi`` pattern matches the name, the nearest of its memory sizes within 10%
    (a name shared by two kinds, e.g. A100-SXM4 40/80 GB in older drivers, goes to the nearer)."""
    short, best = short_name(name), None
    for key, row in gpu_table().items():
        if not any(re.fullmatch(p, short, re.I) for p in row.get("smi") or ()):
            continue
        off = min(abs(memory_gib - m) / m for m in row["memory_gib"])
        if off <= MEMORY_TOLERANCE and (best is None or off < best[0]):
            best = (off, key)
    return best[1] if best else None


# -- nvidia-smi output ---------------------------------------------------------------------------
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(MiB|GiB)?\s*$", re.I)


def _memory_gib(text: str, unit: str | None, where: str) -> float:
    m = _MEMORY.match(text)
    if not m:
        raise SpecError(f"{where}: memory.total {text.strip()!r} is not a size in MiB or GiB")
    v, u = float(m.group(1)), (m.group(2) or unit or "MiB").lower()
    return v / 1024 if u == "mib" else v


def parse_smi(text: str, src: str = "nvidia-smi output") -> list[Device]:
    """The devices of ``nvidia-smi --query-gpu=name,memory.total --format=csv`` output (with or
    without the header, ``noheader``/``nounits``, an ``index`` column first or any further
    columns such as ``mig.mode.current``); a MIG device (``MIG`` in its name, MIG mode
    enabled) is kept with ``mig=True`` for the caller to refuse."""
    rows = [ln for ln in text.splitlines() if ln.strip()]
    if not rows:
        raise SpecError(f"{src}: no devices (expected `nvidia-smi --query-gpu=name,memory.total "
                        "--format=csv` output)")
    cols, unit = None, None
    head = [c.strip().lower() for c in rows[0].split(",")]
    if any(c.startswith("name") for c in head) and any(c.startswith("memory.total") for c in head):
        rows = rows[1:]
        mem_col = next(c for c in head if c.startswith("memory.total"))
        unit = "GiB" if "[gib]" in mem_col else "MiB"
        cols = {"name": next(i for i, c in enumerate(head) if c.startswith("name")),
                "memory": head.index(mem_col),
                "mig": next((i for i, c in enumerate(head) if c.startswith("mig.mode.current")), None)}
    devices = []
    for n, line in enumerate(rows, 1):
        f = [x.strip() for x in line.split(",")]
        where = f"{src}, device line {n} ({line.strip()!r})"
        if cols is None:          # no header: [index,] name, memory.total[, ...]
            lead = 1 if len(f) >= 3 and f[0].isdigit() else 0
            if len(f) < lead + 2:
                raise SpecError(f"{where}: expected 'name, memory.total' (nvidia-smi "
                                "--query-gpu=name,memory.total --format=csv)")
            name, mem, mig = f[lead], f[lead + 1], None
        else:
            if len(f) <= max(cols["name"], cols["memory"]):
                raise SpecError(f"{where}: fewer fields than the header names")
            name, mem = f[cols["name"]], f[cols["memory"]]
            mig = f[cols["mig"]] if cols["mig"] is not None and cols["mig"] < len(f) else None
        devices.append(Device(name, _memory_gib(mem, unit, where),
                              mig=bool(_MIG.search(name)) or (mig or "").lower() == "enabled"))
    return devices


@dataclass(frozen=True)
class Topology:
    """``nvidia-smi topo -m``: how each pair of a node's GPUs is connected."""
    gpus: int
    links: tuple        # links[i][j]: "X", "NV<n>", "PIX", "PXB", "PHB", "NODE", "SYS"

    @property
    def nvlink(self) -> bool:
        """Every pair of GPUs joined by NVLink (NVSwitch boards show NV<n> everywhere; a bridge
        joins pairs only)."""
        return self.gpus > 1 and all(self.links[i][j].startswith("NV")
                                     for i in range(self.gpus) for j in range(self.gpus) if i != j)

    def describe(self) -> str:
        codes = sorted({self.links[i][j] for i in range(self.gpus) for j in range(self.gpus) if i != j})
        return f"{self.gpus} GPUs, links {'/'.join(codes) or '-'}" + \
            (" (NVLink between every pair)" if self.nvlink else "")


def parse_topo(text: str, src: str = "nvidia-smi topo -m output") -> Topology:
    """The GPU-to-GPU matrix of ``nvidia-smi topo -m`` (NIC rows and columns, CPU/NUMA affinity
    and the legend are ignored)."""
    lines = text.splitlines()
    head = next((i for i, ln in enumerate(lines)       # "GPU0 GPU1 ..." (the GPU0 row: "GPU0 X ...")
                 if ln.split()[:1] == ["GPU0"] and ln.split()[1:2] != ["X"]), None)
    if head is None:
        raise SpecError(f"{src}: no GPU0 header line (expected `nvidia-smi topo -m` output)")
    names = lines[head].split()
    n = 0
    while n < len(names) and names[n] == f"GPU{n}":
        n += 1
    links = []
    for i in range(n):
        row = next((ln.split() for ln in lines[head + 1:] if ln.split()[:1] == [f"GPU{i}"]), None)
        if row is None or len(row) < n + 1 or not all(_LINK_CODES.match(c) for c in row[1:n + 1]):
            raise SpecError(f"{src}: no complete row for GPU{i} ({n} GPU columns in the header)")
        links.append(tuple(row[1:n + 1]))
    return Topology(n, tuple(links))


# -- from devices to a cluster ---------------------------------------------------------------------
def same_devices(devices: list[Device], where: str) -> Device:
    """The one device model of ``devices``; MIG slices and a mix of models are refused."""
    if not devices:
        raise SpecError(f"{where}: no GPU")
    for i, d in enumerate(devices):
        if d.mig:
            raise SpecError(f"{where}: GPU {i} ({d.name}) is a MIG device (MIG mode enabled or a "
                            "MIG slice): a slice has a fraction of the GPU's SMs, memory and "
                            "bandwidth, which no kind in ds_autoplan/data/gpus.yaml describes; "
                            "disable MIG or write the cluster YAML by hand (docs/cluster.md)")
    first = devices[0]
    for i, d in enumerate(devices):
        if short_name(d.name) != short_name(first.name) or abs(d.memory_gib - first.memory_gib) > 0.5:
            raise SpecError(f"{where}: GPU {i} is {d}, GPU 0 {first}: ds_autoplan plans nodes of "
                            "identical devices; plan the GPUs of one model (CUDA_VISIBLE_DEVICES)")
    return first


def unknown_gpu(device: Device, where: str) -> SpecError:
    known = ", ".join(sorted(gpu_table()))
    return SpecError(f"{where}: unknown GPU {device} (ds_autoplan/data/gpus.yaml knows {known}); "
                     "run `ds-autoplan cluster` on a machine with it (an unknown device is "
                     "measured there) or write the cluster YAML by hand")


def gpu_cluster(device: Device, num_nodes: int, gpus_per_node: int, *, kind: str | None = None,
                link: str | None = None, measured: dict | None = None, host: dict | None = None,
                inter_node_GBps: float | None = None, nic_GBps: float | None = None,
                name: str | None = None) -> tuple[dict, dict, list[str]]:
    """ClusterSpec fields for ``num_nodes`` nodes of ``gpus_per_node`` x ``device``, the
    figures behind them (``{field: {"datasheet": x, "measured": y}}``) and notes.

    ``kind``: the device's ``gpus.yaml`` kind (None: an unknown device, which needs the
    ``measured`` ``peak_tflops``); ``link``: "nvlink" or "pcie" between the node's GPUs
    (default: the kind's form); ``measured``: figures measured on the machine, which replace
    the datasheet's (``peak_tflops`` achieved, ``intra_node_GBps``, ``intra_latency_us``,
    ``inter_node_GBps``, ``inter_latency_us``, ``nic_GBps``, ``hbm_GBps``, ``host_link_GBps``,
    ``cpu_adam_rate_per_core``); ``host``: one node's ``host_memory_gb`` and ``cpu_cores``
    (:func:`host_fields`)."""
    measured = {k: v for k, v in (measured or {}).items() if v is not None}
    notes: list[str] = []
    row = gpu_table()[kind] if kind else {}
    if not kind and "peak_tflops" not in measured:
        raise SpecError(f"unknown GPU {device}: no datasheet figures and nothing measured")
    link = link or ("nvlink" if row.get("form") == "sxm" else "pcie")
    if link == "nvlink" and "nvlink_busbw_GBps" not in row:
        link = "pcie"
    sheet = {"peak_tflops": row.get("peak_tflops"), "hbm_GBps": row.get("hbm_GBps"),
             "intra_node_GBps": row.get(f"{link}_busbw_GBps"), "host_link_GBps": row.get("host_link_GBps"),
             "inter_node_GBps": inter_node_GBps, "nic_GBps": nic_GBps}
    figures = {k: {"datasheet": sheet.get(k), "measured": measured.get(k)}
               for k in (*FIGURES, "hbm_GBps")
               if sheet.get(k) is not None or measured.get(k) is not None}

    def pick(key, default=None):
        return measured.get(key, sheet.get(key) if sheet.get(key) is not None else default)

    mem = device.memory_gib
    intra = pick("intra_node_GBps") if gpus_per_node > 1 or "intra_node_GBps" in measured else \
        sheet.get("intra_node_GBps") or row.get("pcie_busbw_GBps") or 25.0
    inter = pick("inter_node_GBps")
    if inter is None:
        inter = INTER_NODE_GBPS
        if num_nodes > 1:
            notes.append(f"inter-node bandwidth not measured: {inter:g} GB/s per node assumed (one "
                         "200 Gb/s link); measure it by running `ds-autoplan cluster` under a "
                         "launcher on every node, or pass --inter-node-GBps")
    fields = {"name": name or f"{num_nodes}x{gpus_per_node}x{kind or short_name(device.name)}",
              "num_nodes": num_nodes, "gpus_per_node": gpus_per_node,
              "memory_gb": round(mem, 2),
              # [decision] CUDA context and allocator slack: 5% of the memory, as the presets' 4 of 80
              "reserve_gb": round(max(0.5, 0.05 * mem), 2),
              "intra_node_GBps": round(float(intra), 3), "inter_node_GBps": round(float(inter), 3),
              "intra_latency_us": round(float(pick("intra_latency_us", 10.0)), 2),
              "inter_latency_us": round(float(pick("inter_latency_us", 20.0)), 2),
              "overlap_slowdown": 1.3}
    if kind and "peak_tflops" not in measured:
        # the kind's shape-aware model costs the known layers; profiled models use peak x 0.5
        fields.update(peak_tflops=float(row["peak_tflops"]), compute_efficiency=0.5, gpu=kind)
    else:
        # a measured matmul rate is achieved FLOP/s: efficiency 1, no shape model of a kind
        fields.update(peak_tflops=round(float(measured["peak_tflops"]), 4), compute_efficiency=1.0)
        if not kind:
            notes.append(f"{device.name}: not in ds_autoplan/data/gpus.yaml; its figures were "
                         "measured by a short matmul and memory-bandwidth benchmark on this "
                         "machine (no shape-aware compute model)")
    if pick("nic_GBps") is not None:
        fields["nic_GBps"] = round(float(pick("nic_GBps")), 3)
    fields.update(host_fields(host, pick("host_link_GBps"), measured.get("cpu_adam_rate_per_core"), notes))
    if kind and kind.startswith("v100"):
        notes.append("V100 has no bf16: plan it with --precision fp16")
    return fields, figures, notes


def host_fields(host: dict | None, link_GBps: float | None, adam_rate: float | None,
                notes: list[str]) -> dict:
    """The host fields of a node (spec/cluster.py: memory, cores, the CPU optimizer's rate per
    core, the host link of one device) that are known; a note names what offloading lacks."""
    out = {k: v for k, v in (("host_memory_gb", (host or {}).get("host_memory_gb")),
                             ("cpu_cores", (host or {}).get("cpu_cores")),
                             ("cpu_adam_rate_per_core", adam_rate),
                             ("host_link_GBps", link_GBps)) if v is not None}
    lack = [k for k in ("host_memory_gb", "cpu_cores", "cpu_adam_rate_per_core", "host_link_GBps")
            if k not in out]
    if lack:
        notes.append(f"host figures not known ({', '.join(lack)}): plans do not offload; "
                     "`ds-autoplan cluster` on the machine measures them")
    return out


# -- the facts every rank reports ----------------------------------------------------------------
def nodes_of(facts: list[dict]) -> list[list[dict]]:
    """The ranks' facts grouped by node (``node``: the launcher's node rank), in node order."""
    by: dict = {}
    for f in facts:
        by.setdefault(f["node"], []).append(f)
    return [by[k] for k in sorted(by)]


def _node_text(node: list[dict]) -> str:
    f, ranks = node[0], sorted(x["rank"] for x in node)
    span = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 \
        else ",".join(map(str, ranks))
    what = f"{f['device']} ({f['memory_gib']:.1f} GiB)" if f.get("device") else "CPU ranks"
    return (f"node {f['node']} ({f.get('host', '?')}, rank{'s' if len(ranks) > 1 else ''} {span}): "
            f"{len(node)} x {what}")


def check_homogeneous(facts: list[dict]) -> list[list[dict]]:
    """The nodes of a launch, refused (naming the odd node) unless every node runs as many ranks
    on the same device model and memory."""
    nodes = nodes_of(facts)

    def devices(node) -> set:
        return {(x.get("device"), round(float(x.get("memory_gib") or 0), 1)) for x in node}
    for node in nodes:
        if len(devices(node)) > 1:
            raise SpecError(f"{_node_text(node)} mixes devices {sorted(devices(node), key=str)}: "
                            "ds_autoplan plans nodes of identical devices")
    keys = [(len(n), devices(n).pop()) for n in nodes]
    common = max(set(keys), key=keys.count)
    if len(set(keys)) > 1:
        odd = next(n for n, k in zip(nodes, keys) if k != common)
        normal = next(n for n, k in zip(nodes, keys) if k == common)
        raise SpecError(f"{_node_text(odd)}, unlike {_node_text(normal)}: ds_autoplan plans "
                        "identical nodes (as many ranks on the same device); launch the odd node "
                        "out (--exclude) or give every node the same slots")
    return nodes
