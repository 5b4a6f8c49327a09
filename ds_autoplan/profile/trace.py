"""torch.fx tracing with leaf "proxy" modules and the ordered chain of partition units.

Merak (docs/merak.md §2, §4; seed 001 §4): modules that must not be split are leaves of
the tracer, so each is one ``call_module`` node; the traced DAG is then cut into an ordered chain
of subgraphs at points where few tensors cross (``common`` nodes such as a mask used by every
layer are forwarded and do not count).  Granularity ``"block"`` (default) merges the pieces
between blocks so the chain is ``[pre, block_0 .. block_{L-1}, post]`` (a layer list);
``"node"`` keeps every cut (DawnPiper's fine-grained graph, docs/dawnpiper.md §2).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from ..errors import UserError

_BLOCK_NAME = re.compile(r"(Block|Layer|DecoderLayer|EncoderLayer)$")


class TraceFailure(UserError):
    """torch.fx could not trace a module; ``module``/``cls`` name it."""

    def __init__(self, msg: str, module: str = "", cls: str = ""):
        super().__init__(msg)
        self.module, self.cls = module, cls


def _is_builtin(m: nn.Module) -> bool:
    return type(m).__module__.startswith("torch.nn")


def auto_leaf_classes(model: nn.Module) -> set[type]:
    """Transformer blocks: non-torch classes repeated (>= 2 with parameters) inside a
    ModuleList/Sequential, or named ``*Block``/``*Layer`` and holding parameters."""
    found: set[type] = set()
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            counts: dict[type, int] = {}
            for c in m.children():
                if not _is_builtin(c) and any(True for _ in c.parameters()):
                    counts[type(c)] = counts.get(type(c), 0) + 1
            found |= {t for t, k in counts.items() if k >= 2}
    for m in model.modules():   # named like a block, holding parameters, not around a block
        if m is not model and not _is_builtin(m) and _BLOCK_NAME.search(type(m).__name__) \
                and any(True for _ in m.parameters()) \
                and not any(isinstance(a, tuple(found)) for a in m.modules() if a is not m):
            found.add(type(m))
    return found


def resolve_leaf_names(model: nn.Module, names) -> set[type]:
    """Class names (``--leaf Attention``) -> classes found in ``model``."""
    by_name: dict[str, type] = {}
    for m in model.modules():
        by_name.setdefault(type(m).__name__, type(m))
        by_name.setdefault(f"{type(m).__module__}.{type(m).__qualname__}", type(m))
    out, missing = set(), []
    for n in names or ():
        (out.add(by_name[n]) if n in by_name else missing.append(n))
    if missing:
        known = sorted({type(m).__name__ for m in model.modules()})
        raise UserError(f"--leaf: no module of class {', '.join(missing)} in the model; "
                        f"classes present: {', '.join(known)}")
    return out


class LeafTracer(fx.Tracer):
    """fx tracer whose leaves are the torch.nn built-ins plus ``leaf_types``; it remembers
    which module was being traced when an error occurred."""

    def __init__(self, leaf_types=(), autowrap_functions=()):
        super().__init__()
        # functions recorded as one call (e.g. Megatron's make_viewless_tensor, whose
        # ``out.data = inp.data`` fx cannot see)
        self._autowrap_function_ids.update(id(f) for f in autowrap_functions)
        self.leaf_types = tuple(leaf_types)
        self.stack: list[tuple[str, str]] = []
        self.failed_at: tuple[str, str] | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.stack.append((self.path_of_module(m), type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_at is None:
                self.failed_at = self.stack[-1]
            raise
        finally:
            self.stack.pop()


def trace(model: nn.Module, leaf_types=(), tracer_cls: type | None = None,
          concrete_args: dict | None = None, autowrap_functions=()) -> fx.GraphModule:
    """Symbolically trace ``model``; on failure raise :class:`TraceFailure` naming the module.
    ``concrete_args``: forward arguments fixed during tracing (e.g. optional ones = None)."""
    leaf_types = tuple(leaf_types)
    cls = LeafTracer
    if tracer_cls is not None:   # e.g. transformers' HFTracer: subclass it with our leaves
        cls = type("Leaf" + tracer_cls.__name__, (LeafTracer, tracer_cls), {})
    tracer = cls(leaf_types, tuple(autowrap_functions))
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError, ... from user code
        where, cls = tracer.failed_at or ("", type(model).__name__)
        if where:
            hint = (f"mark it a leaf so it is profiled as one node: --leaf {cls} "
                    f"(or leaf_classes=['{cls}'])")
            raise TraceFailure(f"torch.fx cannot trace module '{where}' (class {cls}): "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                               + hint, where, cls) from None
        first = str(e).splitlines()[0] if str(e) else ""
        raise TraceFailure(f"torch.fx cannot trace the forward of {cls} itself: "
                           f"{type(e).__name__}: {first}; mark its data-dependent sub-modules "
                           "as leaves (--leaf ClassName) or pass a traceable factory",
                           "", cls) from None
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


@dataclass
class Chain:
    """An ordered chain of units over a traced graph."""
    gm: fx.GraphModule
    split: fx.GraphModule            # top module calling submod_0 .. submod_{k-1} in order
    names: list[str]                 # one per unit
    kinds: list[str]                 # "pre" | "block" | "post" | "node"
    modules: list[list[str]]         # call_module targets per unit

    @property
    def units(self) -> list[fx.GraphModule]:
        return [getattr(self.split, f"submod_{i}") for i in range(len(self.names))]


def _unit_name(targets: list[str], fallback: str) -> str:
    if not targets:
        return fallback
    parts = [t.split(".") for t in targets]
    common = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        common.append(xs[0])
    if common:
        return ".".join(common)
    tops = list(dict.fromkeys(p[0] for p in parts))
    return "+".join(tops[:3]) + ("+..." if len(tops) > 3 else "")


def _float_tensor(n: fx.Node) -> bool:
    tm = n.meta.get("tensor_meta")
    return hasattr(tm, "dtype") and tm.dtype.is_floating_point   # one TensorMetadata, no tuple


def build_chain(gm: fx.GraphModule, example_inputs: tuple, leaf_types=(),
                granularity: str = "block", max_cross: int = 1, num_blocks: int = 0,
                anchor_types=None) -> Chain:
    """Cut the traced graph into an ordered chain (Merak §4.2: common nodes exempt).  A cut is
    valid where at most ``max_cross`` non-common values are live, all floating-point tensors
    (shapes from fx ShapeProp on ``example_inputs``).  ``anchor_types`` (default: the leaf
    types): the block classes a ``block``-granularity unit is built around; other leaves
    (Merak-style GEMM proxies) are merged into them."""
    if granularity not in ("block", "node"):
        raise UserError("granularity must be 'block' or 'node'")
    from torch.fx.passes.shape_prop import ShapeProp

    class _Prop(ShapeProp):   # also remember which values are None (free to pass along)
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["is_none"] = out is None
            return out
    with torch.no_grad():
        _Prop(gm).propagate(*example_inputs)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    pos = {n: i for i, n in enumerate(nodes)}
    N = len(nodes)
    anchors = tuple(leaf_types if anchor_types is None else anchor_types)
    mods = dict(gm.named_modules())
    is_anchor = [n.op == "call_module" and isinstance(mods.get(n.target), anchors)
                 for n in nodes] if anchors else [False] * N
    L = max(3, sum(is_anchor), num_blocks)
    # common nodes: graph inputs, constants, and values read by >= L later tensor ops, one per
    # layer (Merak §4.2, with ">=" as decided there); shape queries do not count as reads
    common = {n for n in nodes if n.op in ("placeholder", "get_attr")
              or sum("tensor_meta" in u.meta for u in n.users) >= L}
    last_use = {n: max((pos.get(u, N) for u in n.users), default=pos[n]) for n in nodes}
    # cut after index i is valid if <= max_cross non-common values are live across it
    cuts, live = [], set()
    for i, n in enumerate(nodes):
        if n not in common and not n.meta.get("is_none"):
            live.add(n)
        live = {x for x in live if last_use[x] > i}
        if i < N - 1 and len(live) <= max_cross and all(map(_float_tensor, live)) \
                and nodes[i + 1].op != "placeholder":
            cuts.append(i)
    segs, start = [], 0
    for c in cuts + [N - 1]:
        if c >= start:
            segs.append(list(range(start, c + 1)))
            start = c + 1
    seg_anchor = [any(is_anchor[i] for i in s) for s in segs]
    if granularity == "block" and any(seg_anchor):
        groups, cur, kinds = [], [], []
        first = seg_anchor.index(True)
        last = len(segs) - 1 - seg_anchor[::-1].index(True)
        if first > 0:
            groups.append(sum(segs[:first], []))
            kinds.append("pre")
        for j in range(first, last + 1):
            cur += segs[j]
            if seg_anchor[j]:
                groups.append(cur)
                kinds.append("block")
                cur = []
        if last < len(segs) - 1:
            groups.append(sum(segs[last + 1:], []))
            kinds.append("post")
    else:
        groups, kinds = segs, ["node"] * len(segs)
    # placeholders-only groups (inputs) are folded into the next group
    merged, mkinds = [], []
    for g, k in zip(groups, kinds):
        if merged and all(nodes[i].op in ("placeholder", "get_attr") for i in merged[-1]):
            merged[-1] = merged[-1] + g
            mkinds[-1] = k
        else:
            merged.append(g)
            mkinds.append(k)
    unit_of = {}
    for u, g in enumerate(merged):
        for i in g:
            unit_of[nodes[i].name] = u
    split = split_module(gm, gm, lambda n: unit_of[n.name], keep_original_order=True)
    targets = [[nodes[i].target for i in g if nodes[i].op == "call_module"] for g in merged]
    names = [_unit_name(t, f"{mkinds[u]}_{u}") for u, t in enumerate(targets)]
    dup = {nm for nm in names if names.count(nm) > 1}
    for u, nm in enumerate(names):   # e.g. a block cut in two: "blocks.0:ln1", "blocks.0:ln2"
        if nm in dup and targets[u] and targets[u][0] != nm:
            names[u] = f"{nm}:{targets[u][0][len(nm) + 1:]}"
    return Chain(gm, split, names, mkinds, targets)
