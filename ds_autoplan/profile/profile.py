"""The profile file: what was measured, for which model, on which device.

``profile_model`` traces (trace.py), cuts the chain and measures it (measure.py); a
:class:`Profile` round-trips through JSON and carries two fingerprints, so a profile of another
model or taken on another device is refused with the reason (``check``/``load_profile``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import UserError

FORMAT = "ds_autoplan.profile/1"


class ProfileMismatch(UserError, ValueError):
    """The profile belongs to another model or device, or is not a profile at all."""


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device | str = "cpu") -> dict:
    """What makes measured times comparable: device kind and name, threads, torch version."""
    device = torch.device(device)
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        return {"type": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}",
                "memory_bytes": int(p.total_memory), "torch": torch.__version__}
    return {"type": device.type, "name": _cpu_name(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def model_fingerprint(model: nn.Module, leaf_classes, granularity: str) -> str:
    """Structure of the model: class, parameter names/shapes/dtypes, leaves, granularity."""
    return _digest({"class": f"{type(model).__module__}.{type(model).__qualname__}",
                    "params": [(n, list(p.shape), str(p.dtype))
                               for n, p in model.named_parameters()],
                    "leaves": sorted(leaf_classes), "granularity": granularity})


@dataclass
class Unit:
    """One partition unit (a layer of the chain), for one micro-batch."""
    name: str
    kind: str
    params: int
    param_bytes: int
    fwd_s: float
    bwd_s: float
    act_bytes: int                 # saved for backward (dedup by storage, params excluded)
    out_bytes: int                 # boundary bytes if a cut falls after this unit
    in_bytes: int = 0
    act_shared_prev_bytes: int = 0  # of act_bytes, also saved by the previous unit
    act_input_bytes: int = 0        # of act_bytes, storages that are this unit's inputs
    modules: list = field(default_factory=list)
    out_shapes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)   # [producer unit, bytes, saved tensor id]
    peak_fwd_bytes: int | None = None   # CUDA only
    peak_bwd_bytes: int | None = None


@dataclass
class Profile:
    model: str
    model_fingerprint: str
    device: dict
    batch_size: int
    units: list[Unit]
    granularity: str = "block"
    leaf_classes: list = field(default_factory=list)
    seq_len: int = 0
    dtype: str = "float32"
    loss: dict | None = None          # {"fwd_s", "bwd_s", "act_bytes", ...} of the loss
    repeats: int = 0
    model_info: dict = field(default_factory=dict)
    flops_ref: float = 0.0            # matmul FLOP/s measured on the device with the profile
    created: str = ""
    format: str = FORMAT
    tensors: list = field(default_factory=list)   # per saved tensor (measure.measure_saved)

    # ---- derived ----
    @property
    def device_fingerprint(self) -> str:
        return _digest({k: v for k, v in self.device.items() if k != "memory_bytes"})

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def total_params(self) -> int:
        return sum(u.params for u in self.units)

    def stage_act_bytes(self, lo: int, hi: int, with_loss: bool | None = None) -> int:
        """Saved bytes per micro-batch of units [lo, hi) run as one stage (neighbours inside
        the stage share storages: counted once); the loss joins the last stage."""
        b = sum(u.act_bytes for u in self.units[lo:hi])
        b -= sum(u.act_shared_prev_bytes for u in self.units[lo + 1:hi])
        if (with_loss if with_loss is not None else hi == len(self.units)) and self.loss:
            b += self.loss.get("act_bytes", 0) - self.loss.get("act_shared_prev_bytes", 0)
        return int(b)

    def stage_times(self, lo: int, hi: int, with_loss: bool | None = None) -> tuple[float, float]:
        f = sum(u.fwd_s for u in self.units[lo:hi])
        b = sum(u.bwd_s for u in self.units[lo:hi])
        if (with_loss if with_loss is not None else hi == len(self.units)) and self.loss:
            f, b = f + self.loss["fwd_s"], b + self.loss["bwd_s"]
        return f, b

    # ---- checks ----
    def mismatch(self, model_name: str | None = None, model: nn.Module | None = None,
                 device: torch.device | str | dict | None = None) -> str | None:
        """Why this profile does not fit (None if it does)."""
        if model_name is not None and model_name != self.model:
            return f"profile is of model {self.model!r}, not {model_name!r}"
        if model is not None:
            fp = model_fingerprint(model, self.leaf_classes, self.granularity)
            if fp != self.model_fingerprint:
                return (f"profile of {self.model!r} was taken on a model with another structure "
                        f"(fingerprint {self.model_fingerprint} != {fp})")
        if device is not None:
            want = device if isinstance(device, dict) else device_info(device)
            for k in ("type", "name", "threads", "capability"):
                if k in want and k in self.device and want[k] != self.device[k]:
                    return (f"profile was measured on another device: {k} "
                            f"{self.device[k]!r} != {want[k]!r} here")
        return None

    def check(self, **kw) -> "Profile":
        why = self.mismatch(**kw)
        if why:
            raise ProfileMismatch(why)
        return self

    # ---- serialisation ----
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["device_fingerprint"] = self.device_fingerprint
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            fmt = d.get("format") if isinstance(d, dict) else None
            raise ProfileMismatch(f"not a ds_autoplan profile (format {fmt!r}, "
                                  f"expected {FORMAT!r})")
        d = dict(d)
        stored_dev = d.pop("device_fingerprint", None)
        names = {f.name for f in dataclasses.fields(cls)}
        unames = {f.name for f in dataclasses.fields(Unit)}
        try:
            units = [Unit(**{k: v for k, v in u.items() if k in unames}) for u in d["units"]]
            p = cls(**{**{k: v for k, v in d.items() if k in names}, "units": units})
        except (KeyError, TypeError) as e:
            raise ProfileMismatch(f"malformed profile: {e}") from None
        if stored_dev is not None and stored_dev != p.device_fingerprint:
            raise ProfileMismatch("profile's device fingerprint does not match its device record "
                                  "(edited by hand?)")
        return p

    def save(self, path: str) -> None:
        """Write the profile atomically (ds_autoplan.outputs.write_file)."""
        from ..outputs import json_text, write_file
        write_file(path, json_text(self.to_dict(), indent=1), what="profile")

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ProfileMismatch(f"{path}: not JSON ({e})") from None
        return cls.from_dict(d)


def is_profile(path: str) -> bool:
    """True if ``path`` is a profile written by :func:`profile_model` (and not, e.g., a cluster
    YAML of measured overrides)."""
    try:
        with open(path) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_profile(path: str, model_name: str | None = None, *, model: nn.Module | None = None,
                 device=None) -> Profile:
    """Load a profile; refuse it with the reason (:class:`ProfileMismatch`, a ``UserError``
    and ``ValueError``) if it is of another model (name or structure) or device."""
    if not os.path.exists(path):
        raise UserError(f"profile {path!r} does not exist (make one: ds-autoplan profile MODEL "
                        f"--out {path})")
    try:
        return Profile.load(path).check(model_name=model_name, model=model, device=device)
    except ProfileMismatch as e:
        raise ProfileMismatch(f"{path}: {e}") from None


@dataclass
class ModelEntry:
    """A model to profile with what profiling it needs (``ds_autoplan.models.resolve_model``
    makes them from names)."""
    name: str
    model: nn.Module
    make_inputs: Callable[[int], tuple]          # batch size -> positional inputs
    loss: Callable[[Any, int], Any] | None = None  # (output, batch size) -> scalar loss
    tracer_cls: type | None = None
    config: dict = field(default_factory=dict)
    seq_len: int = 0
    leaves: tuple = ()                   # extra leaf (proxy) classes for the tracer
    concrete_args: dict | None = None    # forward arguments fixed while tracing
    autowrap: tuple = ()                 # functions recorded as one call by the tracer
    context: Callable | None = None      # context manager to profile under



def profile_model(model: nn.Module | ModelEntry, make_inputs=None, *, batch_size: int = 1,
                  name: str | None = None, leaf_classes=(), auto_leaves: bool = True,
                  granularity: str = "block", max_cross: int = 1, loss=None,
                  device: torch.device | str | None = None, repeats: int = 5, warmup: int = 2,
                  tracer_cls: type | None = None, out: str | None = None,
                  reuse: bool = True, timing: str = "chain", inflight: int = 1,
                  concrete_args: dict | None = None, autowrap_functions=()) -> Profile:
    """Trace and measure ``model`` (an ``nn.Module``, or a :class:`ModelEntry`, e.g.
    ``ds_autoplan.models.resolve_model("gpt-tiny")``).  ``make_inputs(batch_size)`` gives the example
    inputs; ``loss(output, batch_size)`` (optional) is profiled as part of the last unit.
    ``leaf_classes``: class names or classes kept whole (plus auto-detected transformer blocks
    when ``auto_leaves``).  With ``out`` an existing matching profile is reused, a mismatching
    one is refused.  ``timing``: ``"chain"`` times units inside whole-model iterations
    (default; ``inflight`` iterations stashed, as on a pipeline stage), ``"isolated"`` runs
    each unit alone in a loop.  ``concrete_args`` and
    ``autowrap_functions`` go to the tracer (:func:`trace.trace`)."""
    from .trace import auto_leaf_classes, build_chain, resolve_leaf_names, trace
    from .measure import measure_chain
    config, seq, ctx = {}, 0, None
    if isinstance(model, str):
        raise UserError(f"profile_model takes a module or a ModelEntry; for the name {model!r} "
                        "use ds_autoplan.models.resolve_model")
    if isinstance(model, ModelEntry):
        entry = model
        name = name or entry.name
        model, make_inputs = entry.model, entry.make_inputs
        loss = loss if loss is not None else entry.loss
        tracer_cls = tracer_cls or entry.tracer_cls
        config, seq = entry.config, entry.seq_len
        leaf_classes = list(leaf_classes) + list(entry.leaves)
        concrete_args = concrete_args if concrete_args is not None else entry.concrete_args
        autowrap_functions = tuple(autowrap_functions) + tuple(entry.autowrap)
        ctx = entry.context
    if make_inputs is None:
        if not hasattr(model, "example_inputs"):
            raise UserError("give make_inputs(batch_size) or a model with example_inputs()")
        make_inputs = model.example_inputs
    name = name or type(model).__name__
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    leaves = {c for c in leaf_classes if isinstance(c, type)}
    leaves |= resolve_leaf_names(model, [c for c in leaf_classes if isinstance(c, str)])
    blocks = auto_leaf_classes(model)
    anchors = (blocks if blocks and auto_leaves else set(leaves)) if granularity == "block" \
        else set(leaves)
    if auto_leaves and granularity == "block":
        leaves |= blocks
    leaf_names = sorted(c.__name__ for c in leaves)
    fp = model_fingerprint(model, leaf_names, granularity)
    dev = device_info(device)
    if out and reuse and os.path.exists(out):
        try:
            old = Profile.load(out)
        except ProfileMismatch as e:
            raise ProfileMismatch(f"{out} exists: {e}; remove it, use another --out or "
                                  "--force") from None
        why = old.mismatch(model_name=name, model=model, device=dev)
        if why is None and old.batch_size != batch_size:
            why = f"profile is for micro-batch size {old.batch_size}, not {batch_size}"
        if why:
            raise ProfileMismatch(f"{out} exists and does not fit: {why}; remove it, use "
                                  "another --out or --force")
        return old
    if timing not in ("chain", "isolated"):
        raise UserError("timing must be 'chain' or 'isolated'")
    model = model.to(device)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x
                   for x in make_inputs(batch_size))
    loss_fn = (lambda o: loss(o, batch_size)) if loss is not None else None
    with ctx() if ctx is not None else contextlib.nullcontext():
        gm = trace(model, leaves, tracer_cls, concrete_args, autowrap_functions)
        nblocks = sum(isinstance(m, tuple(blocks)) for m in model.modules()) if blocks else 0
        chain = build_chain(gm, inputs, leaves, granularity, max_cross, num_blocks=nblocks,
                            anchor_types=anchors)
        tensors: list = []
        rows, loss_row = measure_chain(chain, inputs, device, repeats=repeats, warmup=warmup,
                                       tensors=tensors,
                                       loss_fn=loss_fn, timing=timing, inflight=inflight)
    if seq == 0:
        seq = next((int(x.shape[1]) for x in inputs
                    if isinstance(x, torch.Tensor) and x.dim() > 1), 0)
    dtype = next((str(p.dtype).replace("torch.", "") for p in model.parameters()), "float32")
    from .hardware import matmul_flops
    prof = Profile(name, fp, dev, batch_size, [Unit(**r) for r in rows], granularity, leaf_names,
                   seq, dtype, loss_row, repeats,
                   {"class": f"{type(model).__module__}.{type(model).__qualname__}",
                    "params": int(sum(p.numel() for p in model.parameters())), "config": config},
                   matmul_flops(512, device, repeats=max(3, repeats)),
                   datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   tensors=tensors)
    if out:
        prof.save(out)
    return prof
