"""Measure a traced chain on the actual device: per unit parameters, forward/backward time,
activation bytes kept for backward, boundary bytes (docs/dawnpiper.md §2.3).

Times (after warm-up, median of ``repeats``): by default inside whole-model steps, from module
and tensor hooks (:func:`time_in_chain`; ``perf_counter``, with a CUDA synchronise per event on
a GPU); or each unit alone in a loop (:func:`time_units`; CUDA events on a GPU).
Saved activations: ``torch.autograd.graph.saved_tensors_hooks`` during one forward of the whole
chain; tensors are deduplicated by storage and parameters are excluded, so the sum over a
stage's units (minus what neighbours share, ``act_shared_prev_bytes``) is what a pipeline stage
keeps per micro-batch.  On CUDA the peak allocated bytes of each unit's forward and backward
are also recorded.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch
from torch import nn

from .trace import Chain


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


def _skey(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr())


def _sbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class SavedTracker:
    """Collects the storages autograd saves for backward, tagged with the current owner
    (unit index, or micro-batch in a runtime); parameters excluded, dedup by storage."""

    def __init__(self, exclude: nn.Module | None = None):
        self.exclude = {_skey(p) for p in exclude.parameters()} if exclude is not None else set()
        self.owner = None
        self.saved: dict = {}          # owner -> {storage key: bytes}
        self.first: dict = {}          # storage key -> [first owner, index there, shape, dtype]
        self._count: dict = {}         # owner -> new storages packed so far

    def _pack(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            k = _skey(t)
            if k not in self.exclude and k[1] != 0:
                self.saved.setdefault(self.owner, {})[k] = _sbytes(t)
                if k not in self.first:   # per-tensor record, in packing order (§2.3)
                    i = self._count[self.owner] = self._count.get(self.owner, -1) + 1
                    self.first[k] = [self.owner, i, list(t.shape), str(t.dtype)]
        return t

    @contextmanager
    def track(self, owner=None):
        prev, self.owner = self.owner, owner
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            try:
                yield self
            finally:
                self.owner = prev

    def bytes(self, owner) -> int:
        return sum(self.saved.get(owner, {}).values())


class Timer:
    """Wall time of a callable on the device (CUDA events when on a GPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            torch.cuda.synchronize()
            return out, a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def _prep_inputs(args, grad: bool):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.detach().clone()
            if grad and a.is_floating_point():
                a.requires_grad_(True)
        out.append(a)
    return out


def capture_unit_inputs(chain: Chain, inputs: tuple) -> list[tuple]:
    """One no-grad run of the chain recording each unit's positional inputs."""
    got: list = [None] * len(chain.names)
    hooks = [u.register_forward_pre_hook(lambda m, a, i=i: got.__setitem__(i, a))
             for i, u in enumerate(chain.units)]
    try:
        with torch.no_grad():
            chain.split(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return got


def measure_saved(chain: Chain, inputs: tuple, loss_fn=None,
                  tensors: list | None = None) -> tuple[list[dict], dict | None]:
    """Saved-for-backward storages per unit on one grad-enabled forward of the whole chain.
    With ``tensors`` (a list) one record per saved storage is appended to it (DawnPiper's
    per-node saved-tensor lists, docs/dawnpiper.md §2.3): ``unit`` (first unit saving
    it; the loss counts as the last unit), ``index`` (its order among that unit's new saved
    storages: how a runtime recognises it), ``bytes``, ``shape``, ``dtype``, ``users`` (units
    saving it), ``producer`` (unit that computed it: a unit whose output it is, else the first
    saver; -1 for the chain's inputs) and per unit the float ``inputs`` it reads as
    ``[producer, bytes, tensor id or -1]`` (what a recomputation needs)."""
    tr = SavedTracker(chain.split)
    hooks = []
    for i, u in enumerate(chain.units):
        hooks.append(u.register_forward_pre_hook(lambda m, a, i=i: setattr(tr, "owner", i)))
        hooks.append(u.register_forward_hook(lambda m, a, o: setattr(tr, "owner", None)))
    in_keys: list[set] = [set() for _ in chain.names]
    in_rows: list[list] = [[] for _ in chain.names]
    out_of: dict = {}                  # storage key -> unit whose output it is (first)

    keep: list = []                    # hold every tensor seen: no storage address reuse

    def _pre(i, a):
        keep.extend(_tensors(a))
        in_keys[i].update(_skey(t) for t in _tensors(a))
        in_rows[i] += [(_skey(t), _sbytes(t)) for t in _tensors(a) if t.is_floating_point()]

    hooks += [u.register_forward_pre_hook(lambda m, a, i=i: _pre(i, a))
              for i, u in enumerate(chain.units)]
    def _post(i, o):                   # returns None: the output is left as it is
        for t in _tensors(o):
            keep.append(t)
            out_of.setdefault(_skey(t), i)

    hooks += [u.register_forward_hook(lambda m, a, o, i=i: _post(i, o))
              for i, u in enumerate(chain.units)]
    try:
        with tr.track(None):
            out = chain.split(*_prep_inputs(inputs, False))
            if loss_fn is not None:
                tr.owner = "loss"
                loss_fn(out)
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for i in range(len(chain.names)):
        mine = tr.saved.get(i, {})
        prev = tr.saved.get(i - 1, {})
        rows.append({"act_bytes": sum(mine.values()),
                     "act_shared_prev_bytes": sum(b for k, b in mine.items() if k in prev),
                     "act_input_bytes": sum(b for k, b in mine.items() if k in in_keys[i])})
    if tensors is not None:
        K = len(chain.names)
        ids = {}
        for k, (owner, idx, shape, dtype) in tr.first.items():
            if owner is None:
                continue
            unit = K - 1 if owner == "loss" else owner
            users = sorted({K - 1 if o == "loss" else o for o, d in tr.saved.items()
                            if o is not None and k in d})
            ids[k] = len(tensors)
            tensors.append({"unit": unit, "owner": "loss" if owner == "loss" else unit,
                            "index": idx, "bytes": tr.saved[owner][k], "shape": shape,
                            "dtype": dtype, "users": users,
                            "producer": out_of[k] if k in out_of
                            else (-1 if k in in_keys[unit] else unit)})
        rows_in = [[[out_of.get(k, -1), b, ids.get(k, -1)] for k, b in dict(r).items()]
                   for r in in_rows]
        for r, ins in zip(rows, rows_in):
            r["inputs"] = ins
    loss = None
    if loss_fn is not None:
        mine, last = tr.saved.get("loss", {}), tr.saved.get(len(chain.names) - 1, {})
        loss = {"act_bytes": sum(mine.values()),
                "act_shared_prev_bytes": sum(b for k, b in mine.items() if k in last)}
    return rows, loss


def _time_once(fn, args, timer: Timer, params: list[torch.Tensor]) -> tuple:
    """One forward (grad enabled) + backward of ``fn(*args)``: (fwd s, bwd s, CUDA peaks)."""
    cuda = timer.cuda
    a = _prep_inputs(args, True)
    peak_f = peak_b = 0
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    out, tf = timer(lambda: fn(*a))
    if cuda:
        peak_f = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        base_b = torch.cuda.memory_allocated()
    outs = [o for o in _tensors(out) if o.requires_grad]
    grads = [torch.ones_like(o) for o in outs]
    _, tb = timer(lambda: torch.autograd.backward(outs, grads) if outs else None)
    if cuda:
        peak_b = torch.cuda.max_memory_allocated() - base_b
    for p in params:
        p.grad = None
    return tf, tb, peak_f, peak_b


def time_units(fns: list, args: list, device: torch.device, repeats: int, warmup: int,
               params: list[list[torch.Tensor]]) -> list[dict]:
    """Median forward/backward time of each ``fns[i](*args[i])``.  Repeats go round-robin
    over the units, so a burst of load on a shared machine hits one repeat of several units
    rather than every repeat of one unit; the median then drops it."""
    timer = Timer(device)
    rec = [([], [], 0, 0) for _ in fns]
    for r in range(warmup + repeats):
        for i, fn in enumerate(fns):
            tf, tb, pf, pb = _time_once(fn, args[i], timer, params[i])
            fw, bw, mf, mb = rec[i]
            if r >= warmup:
                fw.append(tf)
                bw.append(tb)
            rec[i] = (fw, bw, max(mf, pf), max(mb, pb))
    out = []
    for fw, bw, mf, mb in rec:
        d = {"fwd_s": statistics.median(fw), "bwd_s": statistics.median(bw)}
        if timer.cuda:
            d.update(peak_fwd_bytes=int(mf), peak_bwd_bytes=int(mb))
        out.append(d)
    return out


def time_in_chain(chain: Chain, inputs: tuple, device: torch.device, repeats: int,
                  warmup: int, loss_fn=None, inflight: int = 1) -> list[dict]:
    """Per-unit times inside whole-model iterations (DawnPiper's timing hooks at the start and
    end of every node's forward and backward, docs/dawnpiper.md §2.3): forward from the
    unit's pre/post hooks; backward of unit i from the arrival of the gradient of its input
    (tensor hooks) to that of unit i+1's input.  Units then see the caches and allocator
    state of a real step rather than a tight loop over one unit.  ``inflight`` iterations are
    kept stashed (forward of k, then backward of k - inflight + 1, as a pipeline stage in
    steady state); gradients accumulate over the iterations, as over micro-batches."""
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    now = lambda: (sync(), time.perf_counter())[1]   # noqa: E731
    K = len(chain.names)
    cur: dict = {}

    def grad_hook(st, slot):
        def h(g):
            t = now()
            st["in"][slot] = t if st["in"][slot] is None else min(st["in"][slot], t)
        return h

    def pre(i):
        def h(m, args):
            st = cur["st"]
            for t in _tensors(args):
                if t.requires_grad:
                    t.register_hook(grad_hook(st, i))
            st["pre"][i] = now()
        return h

    def post(i):
        def h(m, a, o):
            cur["st"]["post"][i] = now()
        return h

    hooks = []
    for i, u in enumerate(chain.units):
        hooks.append(u.register_forward_pre_hook(pre(i)))
        hooks.append(u.register_forward_hook(post(i)))
    params = list(chain.split.parameters())
    rec = [([], []) for _ in range(K + 1)]          # + the loss

    def backward(st):
        tb = now()
        if loss_fn is not None:
            st["y"].backward()
        else:
            torch.autograd.backward(st["outs"], [torch.ones_like(o) for o in st["outs"]])
        t_end = now()
        if st["r"] < warmup:
            return
        t_in = st["in"]
        ends = [t_in[i] if t_in[i] is not None else t_end for i in range(K)]
        ends[0] = t_end                                # first unit: until backward returns
        starts = [ends[i + 1] if i + 1 < K else (t_in[K] or tb) for i in range(K)]
        for i in range(K):
            rec[i][0].append(st["post"][i] - st["pre"][i])
            rec[i][1].append(max(0.0, ends[i] - starts[i]))
        rec[K][0].append(st["loss_s"])
        rec[K][1].append(max(0.0, (t_in[K] or tb) - tb))

    total, queue = warmup + repeats, []
    try:
        for r in range(total + inflight - 1):
            if r < total:
                st = cur["st"] = {"pre": [0.0] * K, "post": [0.0] * K, "in": [None] * (K + 1),
                                  "r": r}
                out = chain.split(*inputs)
                t0 = now()
                st["y"] = loss_fn(out) if loss_fn is not None else out
                st["loss_s"] = now() - t0
                st["outs"] = [o for o in _tensors(out) if o.requires_grad]
                for o in st["outs"]:
                    o.register_hook(grad_hook(st, K))      # gradient of the model output
                queue.append(st)
            if len(queue) >= max(1, inflight) or r >= total:
                backward(queue.pop(0))
    finally:
        for h in hooks:
            h.remove()
        for p in params:
            p.grad = None
    return [{"fwd_s": statistics.median(f), "bwd_s": statistics.median(b)} for f, b in rec]


def measure_chain(chain: Chain, inputs: tuple, device: torch.device, *, repeats: int = 5,
                  warmup: int = 2, loss_fn=None, timing: str = "chain",
                  inflight: int = 1, tensors: list | None = None
                  ) -> tuple[list[dict], dict | None]:
    """Everything per unit (and for the loss, when given) on ``device``; per saved tensor
    records are appended to ``tensors`` when given (:func:`measure_saved`)."""
    unit_inputs = capture_unit_inputs(chain, inputs)
    saved, loss_saved = measure_saved(chain, inputs, loss_fn, tensors)
    rows, fns, args, params = [], list(chain.units), list(unit_inputs), []
    for i, (name, unit) in enumerate(zip(chain.names, chain.units)):
        ps = list(unit.parameters())
        params.append(ps)
        with torch.no_grad():
            outs = _tensors(unit(*unit_inputs[i]))
        rows.append({"name": name, "kind": chain.kinds[i], "modules": chain.modules[i],
                     "params": int(sum(p.numel() for p in ps)),
                     "param_bytes": int(sum(p.numel() * p.element_size() for p in ps)),
                     "out_bytes": int(sum(t.numel() * t.element_size() for t in outs)),
                     "out_shapes": [list(t.shape) for t in outs],
                     "in_bytes": int(sum(t.numel() * t.element_size() for t in
                                         _tensors(unit_inputs[i]) if t.is_floating_point())),
                     **saved[i]})
    if loss_fn is not None:
        with torch.no_grad():
            logits = chain.split(*inputs)
        fns.append(loss_fn)
        args.append((logits,))
        params.append([])
    if timing == "chain":
        times = time_in_chain(chain, inputs, device, repeats, warmup, loss_fn, inflight)
        if device.type == "cuda":   # peak bytes still come from the isolated runs
            iso = time_units(fns, args, device, 1, 0, params)
            for t, i in zip(times, iso):
                t.update({k: v for k, v in i.items() if k.startswith("peak")})
    else:
        times = time_units(fns, args, device, repeats, warmup, params)
    for row, t in zip(rows, times):
        row.update(t)
    loss = {**loss_saved, **times[-1]} if loss_fn is not None else None
    return rows, loss
