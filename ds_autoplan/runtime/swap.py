"""Swap chosen saved-for-backward tensors to host memory during a stage's forward and bring
them back when the backward reads them (DawnPiper's swap, seed 002 §C.2;
docs/dawnpiper.md §7.5).

torch >= 2 needs no storage patch: ``torch.autograd.graph.saved_tensors_hooks`` packs a saved
tensor into a host copy (pinned, copied on a side stream on CUDA) and unpacks it on demand.
Which tensors go is a :class:`SwapPolicy`: by module ("unit") membership, by the order of a
storage among the new saved storages of that unit (the ``index`` recorded by the profiler,
``ds_autoplan.profile.measure.measure_saved``) and by a size threshold.  A storage is copied
once however many saved views share it, and restored with its views' offsets and strides, so
gradients are bit-identical to a run without swapping.

Bytes are counted with :class:`~ds_autoplan.runtime.memtrack.MemTracker` semantics (dedup by
storage, parameters excluded): saved tensors that stay go to ``tracker`` (device-resident),
offloaded storages to ``host_tracker``; on a CPU-only machine "host" is the same memory, and
these two counters are what shows the effect.

    sw = Swapper(SwapPolicy.from_stage_policy(stage_policy), model, tracker=tracker)
    with sw.forward():            # one micro-batch's forward
        loss = model(x).sum()
    loss.backward()               # swapped tensors come back here

In the DeepSpeed runtime ``AutoplanEngine.set_swap_policy(stage_memory_options(...)["swap"])``
(unit names mapped to layer indices with :meth:`SwapPolicy.to_layers`) runs each local stage's
forward under a Swapper.  [decision] The swap-in is issued when the backward first reads the
storage (on demand), not one action ahead as the cost model assumes (§7.4); on CUDA the
swap-out runs on a side stream.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .memtrack import MemTracker


@dataclass
class SwapPolicy:
    """``units``: unit (module) name -> indices of its saved storages to offload, or None for
    all of them; ``min_bytes``: only storages at least this large (θ, docs/dawnpiper.md
    §7.3)."""
    units: dict = field(default_factory=dict)
    min_bytes: int = 0

    def select(self, owner, index: int, nbytes: int) -> bool:
        if owner not in self.units or nbytes < self.min_bytes:
            return False
        want = self.units[owner]
        return want is None or index in want

    @classmethod
    def from_dict(cls, units: dict, min_bytes: int = 0) -> "SwapPolicy":
        """From one stage's entry of ``stage_memory_options(...)["swap"]`` (JSON: lists)."""
        return cls({u: None if ix is None else set(ix) for u, ix in units.items()}, min_bytes)

    @classmethod
    def from_stage_policy(cls, policy, min_bytes: int = 0) -> "SwapPolicy":
        """From a :class:`ds_autoplan.search.memopt.StagePolicy` (its ``swap_units``: the
        per-tensor choice when it has one, else whole units chosen ``swap``)."""
        return cls.from_dict(policy.swap_units, min_bytes)

    @classmethod
    def every_layer(cls, module: nn.Module) -> "SwapPolicy":
        """Every saved tensor of every layer of a pipeline module (its children named
        ``str(i)``, DeepSpeed's ``PipelineModule``): a plan's activation offload
        (``Offload.activations``, docs/offload.md §2)."""
        return cls({n: None for n, _ in module.named_children() if n.isdigit()})

    def to_layers(self, layer_names: list[str]) -> "SwapPolicy":
        """The same policy over a pipeline module, whose layer ``i`` is the module ``str(i)``
        (DeepSpeed's ``PipelineModule``): a unit named ``layer_names[i]`` (a block-granularity
        profile of a model whose layer list is its units) or inside it (``name.sub``) is
        renamed ``i`` (``i.sub``)."""
        def rename(u):
            for i, n in enumerate(layer_names):
                if u == n or u.startswith(n + "."):
                    return str(i) + u[len(n):]
            raise ValueError(f"swap policy unit {u!r} is not in layers {layer_names}")
        return SwapPolicy({rename(u): ix for u, ix in self.units.items()}, self.min_bytes)


class _Host:
    """One offloaded storage: its host copy (and, on CUDA, the copy's event / the device copy
    brought back, shared by every saved view of the storage)."""

    __slots__ = ("host", "device", "event", "ref", "back")

    def __init__(self, t: torch.Tensor, host_tracker: MemTracker | None, stream):
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        self.device, self.event, self.back = t.device, None, None
        if t.device.type == "cuda":
            self.host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(src, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            src.record_stream(stream)     # the device storage may be reused after the copy
        else:
            self.host = src.clone()       # a separate host buffer (same memory on CPU)
        self.ref = host_tracker.hold(self.host) if host_tracker is not None else None

    def fetch(self) -> torch.Tensor:
        if self.back is None:
            if self.event is not None:
                torch.cuda.current_stream(self.device).wait_event(self.event)
                self.back = self.host.to(self.device, non_blocking=True)
            else:
                self.back = self.host
        return self.back


class Swapper:
    """Offloads the saved tensors a :class:`SwapPolicy` selects.  ``modules``: the stage's
    module (its named submodules are the units) or a dict unit name -> module; the current
    unit is set by forward hooks on them, as the profiler does.  Within one :meth:`forward`
    every packed storage is remembered (and kept alive, so its address is not reused and a
    storage is recognised however many views are saved); the device copies of offloaded
    storages are released when that forward ends, which is what matters for the micro-batches
    a pipeline stage keeps in flight."""

    def __init__(self, policy: SwapPolicy, modules, *, tracker: MemTracker | None = None,
                 host_tracker: MemTracker | None = None):
        mods = dict(modules.named_modules() if isinstance(modules, nn.Module) else modules)
        missing = sorted(set(policy.units) - set(mods))
        if missing:
            raise ValueError(f"swap policy names units that are not modules here: {missing}")
        self.policy, self.mods = policy, {n: mods[n] for n in policy.units}
        self.tracker = tracker
        self.host_tracker = host_tracker if host_tracker is not None else MemTracker()
        self._owners = [modules] if isinstance(modules, nn.Module) else list(mods.values())
        self._params: set = set()
        self._stream = None
        self.owner, self._count, self._seen = None, {}, {}
        self.swapped_bytes = 0        # offloaded by the last forward (unique storages)

    # -- which tensor is this ------------------------------------------------------------------
    def _classify(self, t: torch.Tensor):
        """(decision, cached _Host or None) for a new pack, mirroring the profiler's indexing:
        a storage's index counts new storages first packed under the current unit."""
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device.type)
        ent = self._seen.get(key)
        if ent is not None:            # the same storage (kept alive by _seen) seen before
            return ent[0], ent[2], key
        i = self._count[self.owner] = self._count.get(self.owner, -1) + 1
        return self.policy.select(self.owner, i, st.nbytes()), None, key

    # -- autograd hooks --------------------------------------------------------------------------
    def _pack(self, t):
        # parameters stay, and views of them (a linear's transposed weight; ZeRO-3's gathered
        # parameters have storages of their own, not seen when the forward starts)
        if not isinstance(t, torch.Tensor) or t.is_meta or isinstance(t, nn.Parameter) \
                or isinstance(t._base, nn.Parameter) \
                or t.layout != torch.strided or t.untyped_storage().nbytes() == 0 \
                or t.untyped_storage().data_ptr() in self._params:
            return ("k", t if self.tracker is None else self.tracker.hold(t))
        swap, host, key = self._classify(t)
        if not swap:
            self._seen.setdefault(key, [False, t, None])
            return ("k", t if self.tracker is None else self.tracker.hold(t))
        if host is None:
            if t.device.type == "cuda" and self._stream is None:
                self._stream = torch.cuda.Stream(t.device)
            host = _Host(t, self.host_tracker, self._stream)
            self.swapped_bytes += host.host.numel()
            self._seen[key] = [True, t, host]
        return ("s", host, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    @staticmethod
    def _unpack(p):
        if p[0] == "k":
            return p[1] if isinstance(p[1], torch.Tensor) else p[1].tensor
        _, host, dtype, off, size, stride = p
        data = host.fetch()
        return torch.empty(0, dtype=dtype, device=data.device).set_(
            data.untyped_storage(), off, size, stride)

    # -- one micro-batch's forward ----------------------------------------------------------
    @contextlib.contextmanager
    def forward(self):
        """Offload during one forward (indices restart per forward, as in the profile)."""
        self._count, self._seen, self.swapped_bytes = {}, {}, 0
        # parameters as they are now (an engine may have flattened them since __init__)
        self._params = {p.untyped_storage().data_ptr() for m in self._owners
                        for p in m.parameters()}
        hooks = []
        for name, m in self.mods.items():
            hooks.append(m.register_forward_pre_hook(
                lambda mod, a, name=name: setattr(self, "owner", name)))
            hooks.append(m.register_forward_hook(
                lambda mod, a, o: setattr(self, "owner", None)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for h in hooks:
                h.remove()
            self.owner, self._seen = None, {}
