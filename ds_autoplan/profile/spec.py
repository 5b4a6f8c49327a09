"""Profile -> the planner's ModelSpec (ds_autoplan.spec.model).

The ModelSpec speaks per-sample FLOPs and 2-byte activation bytes; the cost model turns FLOPs
into time with the cluster's achieved FLOP/s and takes backward = 2 x forward.  A measured unit
is therefore written as ``flops = (fwd_s + bwd_s) / 3 / batch * flops_ref`` (so F + 2F is the
measured forward + backward when the cluster spec's FLOP/s is ``flops_ref``, the matmul rate
measured with the profile; ``ds-autoplan profile --hardware`` writes such a cluster spec), and
bytes are rescaled from the profile's dtype to 2-byte activations.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

from .profile import Profile, Unit


def _tp_fraction(cfg: dict, seq: int) -> float:
    """Share of a block's activation split by tensor parallelism (Megatron accounting of the
    analytic ModelSpec for the same shape); 0 when the shape is unknown."""
    h, nh = cfg.get("hidden"), cfg.get("num_heads", cfg.get("heads"))
    if not (h and nh and seq):
        return 0.0
    from ..spec.model import build_model
    m = build_model({"arch": "gpt", "num_layers": 1, "hidden": h, "heads": nh, "seq_len": seq,
                     "vocab": cfg.get("vocab_size", cfg.get("vocab", 2)), "dropout": False,
                     "ffn": cfg.get("mlp_ratio", 4) * h})
    blk = m.layers[0]
    return blk.act_tp / (blk.act_rep + blk.act_tp)


def to_model_spec(profile: Profile, flops_ref: float | None = None, average_blocks: bool = True):
    """The planner's ModelSpec for the profiled model: ``block`` (or ``node``) units become
    ``layers``; ``pre`` units merge into ``pre``, ``post`` units and the loss into ``post``.
    ``flops_ref``: the FLOP/s the planner will divide by; pass the cluster's
    (``ClusterSpec.flops``) and the cost model reproduces the measured times exactly; default:
    the matmul rate measured with the profile.
    ``average_blocks``: blocks of identical structure share the median time, so the planner
    sees one layer type instead of measurement noise."""
    from ..spec.model import LayerSpec, ModelSpec
    p = profile
    ref = float(flops_ref or p.flops_ref or 1e12)
    scale = {"float32": 2.0, "float64": 4.0}.get(p.dtype, 1.0)   # to 2-byte activations
    b = max(1, p.batch_size)
    cfg = p.model_info.get("config", {}) or {}
    frac = _tp_fraction(cfg, p.seq_len)

    def layer(units: list[Unit], kind: str, name: str, with_loss=False,
              first_in_stage=False) -> LayerSpec:
        f = sum(u.fwd_s + u.bwd_s for u in units)
        act = sum(u.act_bytes for u in units) - sum(u.act_shared_prev_bytes
                                                   for u in units[0 if not first_in_stage else 1:])
        if with_loss and p.loss:
            f += p.loss["fwd_s"] + p.loss["bwd_s"]
            act += p.loss.get("act_bytes", 0) - p.loss.get("act_shared_prev_bytes", 0)
        act = max(0.0, act) / scale / b
        tp = frac if kind == "block" else 0.0
        return LayerSpec(name, kind, float(sum(u.params for u in units)), f / 3 / b * ref,
                         act * (1 - tp), act * tp,
                         (units[0].in_bytes / scale / b) if units else 0.0,
                         2 if kind == "block" else (1 if units else 0), kind == "block")

    pre_u = [u for u in p.units if u.kind == "pre"]
    post_u = [u for u in p.units if u.kind == "post"]
    mid = [u for u in p.units if u.kind not in ("pre", "post")]
    layers = [layer([u], "block", u.name) for u in mid]
    if average_blocks:
        groups: dict = {}
        for i, (u, l) in enumerate(zip(mid, layers)):
            groups.setdefault((u.params, u.act_bytes, u.act_shared_prev_bytes, u.in_bytes,
                               u.out_bytes), []).append(i)
        for idx in groups.values():
            med = statistics.median(layers[i].flops for i in idx)
            proto = replace(layers[idx[0]], name="block", flops=med)
            for i in idx:
                layers[i] = proto
    pre = layer(pre_u, "pre", "+".join(u.name for u in pre_u) or "none", first_in_stage=True)
    post = layer(post_u, "post", "+".join(u.name for u in post_u) or "loss", with_loss=True)
    last = p.units[-1].out_shapes[0] if p.units and p.units[-1].out_shapes else []
    hidden = int(cfg.get("hidden")
                 or (mid[0].out_shapes[0][-1] if mid and mid[0].out_shapes else 0))
    return ModelSpec(name=p.model, arch=str(cfg.get("arch", "gpt")), seq_len=int(p.seq_len),
                     hidden=hidden, heads=int(cfg.get("num_heads", cfg.get("heads", 1)) or 1),
                     num_layers=len(layers),
                     vocab=int(cfg.get("vocab_size") or (last[-1] if last else 0)),
                     layers=tuple(layers), pre=pre, post=post,
                     config={"name": p.model, "tie_embeddings": False,   # params as measured
                             "profile": {"model_fingerprint": p.model_fingerprint,
                                         "device": p.device, "flops_ref": ref,
                                         "batch_size": p.batch_size,
                                         "granularity": p.granularity}})
