"""ModelSpec: a linear sequence of layers with per-sample parameter, FLOP and activation
figures (docs/planner.md §2.1 analytic fallback, Korthikanti et al. activation
accounting, generalised to GQA, any head size, gated MLPs, mixtures of experts, multi-latent
and sliding-window attention, flash attention and cross-attention: spec/blocks.py).

All per-sample byte counts assume 2-byte activations (bf16/fp16); the cost model scales
them for fp32.  ``pre`` (embedding) is attached to the first pipeline stage and ``post``
(final norm, head and loss) to the last one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from . import SpecError
from .blocks import ACTIVATIONS, BlockShape
from .hf import from_hf_config
from .presets import field_name, need, resolve, read_mapping

ARCHS = ("gpt", "llama", "bert", "t5", "vit")


@dataclass(frozen=True)
class LayerSpec:
    name: str                 # layer type ("block", "dec_block", "embedding", "head", ...)
    kind: str                 # "pre" | "block" | "post"
    params: float             # parameter count W_l
    flops: float              # forward FLOPs per sample
    act_rep: float            # activation bytes per sample not split by TP
    act_tp: float             # activation bytes per sample split by TP (a_l(t) = rep + tp/t)
    boundary: float           # bytes per sample of the layer's input (what CKPT keeps), x_{l-1}
    tp_allreduces: int = 2    # forward all-reduces under Megatron TP (n_ar, §2.4)
    checkpointable: bool = True
    shape: BlockShape | None = None   # a transformer block's sizes (None: embedding, head, profiled)

    @property
    def active_params(self) -> float:
        """Parameters one token goes through (MoE: the routed experts it is not sent to left out)."""
        return float(self.shape.active_params()) if self.shape is not None else self.params

    @property
    def expert_params(self) -> float:
        """Routed-expert parameters (part of ``params``): what expert parallelism splits."""
        return float(self.shape.expert_params()) if self.shape is not None else 0.0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    seq_len: int
    hidden: int
    heads: int
    num_layers: int           # transformer blocks (encoder + decoder for T5)
    vocab: int
    layers: tuple             # LayerSpec per block, in order
    pre: LayerSpec
    post: LayerSpec
    config: dict = field(default_factory=dict)   # the source mapping (for emitters)

    @property
    def label(self) -> str:
        """The model as messages name it: a preset by its name, a model from the user's file
        by its name and the file (``'Llama-2-7b' (ckpt/config.json)``)."""
        src = self.config.get("source")
        return f"{self.name!r} ({src})" if src else self.name

    @property
    def type_ids(self) -> list[int]:
        """Index of each block's distinct LayerSpec (identical layers share costs)."""
        uniq: dict = {}
        return [uniq.setdefault(l, len(uniq)) for l in self.layers]

    def _tied(self) -> float:
        return self.vocab * self.hidden if self.arch != "vit" and tied_embeddings(self.config) else 0

    @property
    def total_params(self) -> float:
        """Distinct parameters: a tied output layer shares the input embedding's matrix (the
        per-stage memory still counts it on the last stage, where pipelining keeps a copy)."""
        return sum(l.params for l in self.layers) + self.pre.params + self.post.params - self._tied()

    @property
    def active_params(self) -> float:
        """Parameters each token goes through (embeddings and head included, counted like
        :attr:`total_params`); equal to it for a dense model."""
        return sum(l.active_params for l in self.layers) + self.pre.params + self.post.params - self._tied()

    @property
    def flops_per_sample(self) -> float:
        return sum(l.flops for l in self.layers) + self.pre.flops + self.post.flops

    def with_seq(self, seq: int) -> "ModelSpec":
        if seq == self.seq_len:
            return self
        if "num_layers" not in self.config:
            raise SpecError(f"{self.name}: the sequence length of a profiled model is fixed by "
                            f"its profile ({self.seq_len}); profile again for {seq}")
        cfg = {k: v for k, v in self.config.items() if k != "seq_note"}
        return build_model({**cfg, "seq_len": int(seq)}, self.name)


def _layer(name: str, b: BlockShape) -> LayerSpec:
    rep, tp = b.activation_bytes()
    return LayerSpec(name, "block", float(b.params()), float(b.flops()), rep, tp, b.boundary(),
                     3 if b.cross_s else 2, True, b)


FIELDS = {"name", "arch", "num_layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len",
          "dec_layers", "dec_seq_len", "image_size", "patch_size", "num_classes",
          "flash_attention", "dropout", "description",
          # attention and MLP variants (spec/blocks.py)
          "head_dim", "activation", "qk_norm", "sandwich_norms", "sliding_window", "global_every",
          "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
          "num_experts", "moe_topk", "moe_ffn", "moe_shared_ffn", "moe_shared_gate",
          "moe_router_bias", "moe_pattern", "moe_expert_bias", "attn_out_bias", "attn_sinks",
          # the router's arithmetic (no cost; carried to the Megatron flags)
          "moe_score", "moe_groups", "moe_group_topk", "moe_scale", "moe_pre_softmax",
          # read from Hugging Face configs; carried to the Megatron flags (emit/megatron.py)
          "tie_embeddings", "linear_bias", "qkv_bias", "rope_base", "rope_scaling_factor",
          "rope_scaling_type", "rope_scaling", "rotary_percent", "norm_eps", "max_positions",
          "seq_note", "family",
          # the user's file and its names for our fields (messages name them; spec/hf.py)
          "source", "source_keys"}


# numbers no cost reads, carried to the emitted Megatron flags: checked like the rest
CARRIED_NUMBERS = ("norm_eps", "rope_base", "rope_scaling_factor", "rotary_percent")


def tied_embeddings(d: dict) -> bool:
    """Input embedding shared with the output layer: the mapping's ``tie_embeddings``, else
    Megatron's default for the arch (tied, except LLaMA-style models)."""
    return bool(d.get("tie_embeddings", str(d.get("arch", "gpt")).lower() != "llama"))


# the deepest published transformer has 1000 layers (DeepNet, Wang et al. 2022, §5); a spec
# beyond this is a typo, refused before the search builds per-layer tables for it
MAX_LAYERS = 4096


def _depth(n: int, key: str, src: str) -> int:
    if n > MAX_LAYERS:
        raise SpecError(f"{src}: {key} {n} is more than {MAX_LAYERS} layers; no transformer is "
                        f"that deep (a typo?)")
    return n


def _count(d: dict, key: str, src: str) -> int:
    """An optional non-negative integer field (absent, None or 0: off)."""
    v = d.get(key)
    if v is None or v is False:
        return 0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v != int(v) or v < 0:
        raise SpecError(f"{src}: field {key!r} must be a non-negative integer, got {v!r}")
    return int(v)


def _moe_pattern(d: dict, L: int, src: str) -> list[int]:
    """1 for each mixture-of-experts layer (default: all of them)."""
    pat = d.get("moe_pattern")
    if pat is None:
        return [1] * L
    if not isinstance(pat, (list, tuple)) or len(pat) != L or any(x not in (0, 1) for x in pat):
        raise SpecError(f"{src}: moe_pattern must list 0 (dense) or 1 (experts) for each of the {L} layers")
    return [int(x) for x in pat]


def _mla(d: dict, src: str) -> tuple:
    """(q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) or ()."""
    kvl = _count(d, "kv_lora_rank", src)
    if not kvl:
        return ()
    dims = tuple(_count(d, k, src) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if not all(dims):
        raise SpecError(f"{src}: multi-latent attention (kv_lora_rank) needs qk_nope_head_dim, "
                        "qk_rope_head_dim and v_head_dim")
    return (_count(d, "q_lora_rank", src), kvl, *dims)


def _shapes(d: dict, arch: str, s: int, src: str) -> list[BlockShape]:
    """One BlockShape per transformer block (encoder blocks for T5)."""
    L = _depth(need(d, "num_layers", int, src), field_name(d, "num_layers"), src)
    h = need(d, "hidden", int, src)
    heads = need(d, "heads", int, src)
    kv = need(d, "kv_heads", int, src, heads)
    n = {k: field_name(d, k) for k in ("hidden", "heads", "kv_heads")}
    if heads % kv:
        raise SpecError(f"{src}: {n['kv_heads']} {kv} does not divide {n['heads']} {heads} "
                        "(grouped-query attention shares each K/V head among a whole number of "
                        "query heads)")
    hd = _count(d, "head_dim", src)
    if not hd:
        if h % heads:
            raise SpecError(f"{src}: {n['hidden']} {h} is not divisible by {n['heads']} {heads} "
                            "(set head_dim)")
        hd = h // heads
    act = str(d.get("activation", "swiglu" if arch == "llama" else "gelu")).lower()
    if act not in ACTIVATIONS:
        raise SpecError(f"{src}: unknown activation {act!r}; choose from {', '.join(ACTIVATIONS)}")
    f = need(d, "ffn", int, src, 4 * h)
    E = need(d, "num_experts", int, src, 1)
    k = need(d, "moe_topk", int, src, 2 if E > 1 else 1)
    if E > 1 and not 1 <= k <= E:
        raise SpecError(f"{src}: moe_topk {k} must be between 1 and num_experts {E}")
    mla = _mla(d, src)
    window, every = _count(d, "sliding_window", src), _count(d, "global_every", src)
    base = BlockShape(s=s, h=h, heads=heads, kv=heads if mla else kv, hd=hd, ffn=f, act=act, mla=mla,
                      qk_norm=bool(d.get("qk_norm")), norms=4 if d.get("sandwich_norms") else 2,
                      layernorm=arch != "llama", linear_bias=bool(d.get("linear_bias", False)),
                      qkv_bias=bool(d.get("qkv_bias", False)), o_bias=bool(d.get("attn_out_bias")),
                      sinks=bool(d.get("attn_sinks")),
                      flash=bool(d.get("flash_attention", arch in ("gpt", "llama"))),
                      dropout=bool(d.get("dropout", arch != "llama")))
    moe = BlockShape(**{**base.__dict__, "ffn": 0, "experts": E, "topk": k,
                        "expert_ffn": need(d, "moe_ffn", int, src, f),
                        "shared_ffn": _count(d, "moe_shared_ffn", src),
                        "shared_gate": bool(d.get("moe_shared_gate")),
                        "router_bias": bool(d.get("moe_router_bias")),
                        "expert_bias": bool(d.get("moe_expert_bias"))}) if E > 1 else base
    pattern = _moe_pattern(d, L, src) if E > 1 else [0] * L
    out = []
    for i in range(L):
        b = moe if pattern[i] else base
        if window and not (every and (i + 1) % every == 0):     # a local (sliding-window) layer
            b = BlockShape(**{**b.__dict__, "window": window})
        out.append(b)
    return out


def build_model(d: dict, src: str = "model") -> ModelSpec:
    unknown = set(d) - FIELDS
    if unknown:
        raise SpecError(f"{src}: unknown model field(s) {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(sorted(FIELDS))}")
    arch = str(d.get("arch", "gpt")).lower()
    if arch not in ARCHS:
        raise SpecError(f"{src}: unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    for k in CARRIED_NUMBERS:
        if d.get(k) is not None:
            need(d, k, float, src)
    h = need(d, "hidden", int, src)
    if arch == "vit":
        img, p = need(d, "image_size", int, src, 224), need(d, "patch_size", int, src, 16)
        s = (img // p) ** 2 + 1
        vocab = need(d, "num_classes", int, src, 1000)
    else:
        s = need(d, "seq_len", int, src)
        vocab = need(d, "vocab", int, src)
    shapes = _shapes(d, arch, s, src)
    cache: dict = {}
    layers = [cache.setdefault(b, _layer("block", b)) for b in shapes]
    if arch == "t5":
        Ld = _depth(need(d, "dec_layers", int, src, len(layers)), "dec_layers", src)
        sd = need(d, "dec_seq_len", int, src, s)
        base = shapes[0]
        dec = _layer("dec_block", BlockShape(**{**base.__dict__, "s": sd, "cross_s": s, "window": 0}))
        layers = [_layer("enc_block", b) for b in shapes] + [dec] * Ld
    out_s = s if arch != "t5" else need(d, "dec_seq_len", int, src, s)
    norm = h * (2 if arch != "llama" else 1)          # final LayerNorm (weight, bias) or RMSNorm
    if arch == "vit":
        pre = LayerSpec("patch_embed", "pre", 3 * p * p * h + (s + 1) * h, 2 * s * 3 * p * p * h,
                        2 * s * h, 0.0, 2 * 3 * img * img, 0, False)
        post = LayerSpec("cls_head", "post", h * vocab + 2 * h, 2 * h * vocab, 2 * s * h,
                         6 * vocab, 2 * s * h, 0, False)
    else:
        pos = need(d, "max_positions", int, src, s) * h if arch in ("gpt", "bert") else 0
        # stash: the int64 token ids and the embedding dropout's 1-byte mask (Megatron-LM's
        # theoretical_memory_usage.py: 8 s b + s b h); its output is the first block's input,
        # counted there
        drop = bool(d.get("dropout", arch != "llama"))
        pre = LayerSpec("embedding", "pre", vocab * h + pos, 2 * s * h, 8 * s + (s * h if drop else 0),
                        0.0, 4 * s, 1, False)
        extra = h * h if arch == "bert" else 0
        post = LayerSpec("head", "post", vocab * h + extra + norm, 2 * out_s * h * vocab + 2 * out_s * extra,
                         2 * out_s * h, 6 * out_s * vocab, 2 * out_s * h, 1, False)
    name = str(d.get("name", Path(src).stem))
    return ModelSpec(name=name, arch=arch, seq_len=s, hidden=h, heads=shapes[0].heads,
                     num_layers=len(layers), vocab=vocab, layers=tuple(layers), pre=pre, post=post,
                     config={**d, "arch": arch, "name": name})


def load_model(model: "str | ModelSpec | dict", seq: int | None = None) -> ModelSpec:
    """A preset name, a YAML path, a Hugging Face config.json path, a dict or a ModelSpec."""
    if isinstance(model, ModelSpec):
        m = model
    else:
        if isinstance(model, dict):
            d, src = model, str(model.get("name", "model"))
        else:
            d, src = resolve(str(model), "models")
        if "model_type" in d or "architectures" in d:
            d = from_hf_config(d, src)
        if src == str(model):              # the user's file, not a preset
            d = {**d, "source": src}
        m = build_model(d, src)
    if seq is not None:
        if int(seq) <= 0:
            raise SpecError(f"sequence length must be positive, got {seq}")
        if m.arch == "vit":
            raise SpecError("--seq does not apply to ViT models (set image_size/patch_size)")
        m = m.with_seq(int(seq))
    return m


__all__ = ["LayerSpec", "ModelSpec", "build_model", "from_hf_config", "load_model", "read_mapping"]
