"""ModelSpec: a linear sequence of layers with per-sample parameter, FLOP and activation
figures (planner-galvatron.md §2.1 analytic fallback, Korthikanti et al. activation
accounting, generalised to GQA, gated MLPs, flash attention and cross-attention).

All per-sample byte counts assume 2-byte activations (bf16/fp16); the cost model scales
them for fp32.  ``pre`` (embedding) is attached to the first pipeline stage and ``post``
(final norm, head and loss) to the last one.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from . import SpecError
from .presets import need, resolve, read_mapping

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
    def type_ids(self) -> list[int]:
        """Index of each block's distinct LayerSpec (identical layers share costs)."""
        uniq: dict = {}
        return [uniq.setdefault(l, len(uniq)) for l in self.layers]

    @property
    def total_params(self) -> float:
        """Distinct parameters: a tied output layer shares the input embedding's matrix (the
        per-stage memory still counts it on the last stage, where pipelining keeps a copy)."""
        tied = self.vocab * self.hidden if self.arch != "vit" and tied_embeddings(self.config) else 0
        return sum(l.params for l in self.layers) + self.pre.params + self.post.params - tied

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


def _block(name, s, h, heads, kv, f, gated, flash, dropout, cross_s=None, bias=0, experts=1,
           topk=1):
    """One transformer block.  ``bias``: bias parameters of its linear layers; ``experts`` > 1:
    a mixture-of-experts MLP (each expert a full MLP of width ``f``, a linear router, every
    token through ``topk`` experts; Mixtral, Jiang et al. 2024 §2), so parameters count all
    experts and compute/activations ``topk`` of them."""
    hkv = h * kv // heads
    attn_p = h * (h + 2 * hkv) + h * h
    mlp_p = (3 if gated else 2) * h * f
    router = h * experts if experts > 1 else 0
    params = attn_p + experts * mlp_p + router + 4 * h + bias
    flops = 2 * s * (attn_p + topk * mlp_p + router) + 4 * s * s * h
    rep = s * h * (10 if dropout else 8) + (4 * s * experts if experts > 1 else 0)
    tp = s * (2 * (h + 2 * hkv) + 2 * h + topk * (6 if gated else 4) * f) + (0 if flash else 5 * heads * s * s)
    if experts > 1:               # tokens permuted to their experts and back (2 bytes each way)
        tp += 4 * s * topk * h
    boundary = 2 * s * h
    n_ar = 2
    if cross_s is not None:          # decoder block: cross-attention over the encoder output
        params += 4 * h * h + 2 * h
        flops += 2 * s * 2 * h * h + 2 * cross_s * 2 * h * h + 4 * s * cross_s * h
        rep += 4 * s * h
        tp += 6 * s * h + 4 * cross_s * h + (0 if flash else 5 * heads * s * cross_s)
        boundary += 2 * cross_s * h  # encoder output travels with every decoder stage (§6 #20)
        n_ar = 3
    return LayerSpec(name, "block", float(params), float(flops), float(rep), float(tp),
                     float(boundary), n_ar, True)


def _bias_params(h, hkv, f, gated, linear_bias, qkv_bias) -> int:
    """Bias parameters of one block: all linear layers (GPT-2) or only Q, K, V (Qwen2)."""
    qkv = h + 2 * hkv
    if linear_bias:
        return qkv + h + ((2 if gated else 1) * f + h)
    return qkv if qkv_bias else 0


FIELDS = {"name", "arch", "num_layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len",
          "dec_layers", "dec_seq_len", "image_size", "patch_size", "num_classes",
          "flash_attention", "dropout", "description",
          # read from Hugging Face configs; carried to the Megatron flags (emit/megatron.py)
          "tie_embeddings", "linear_bias", "qkv_bias", "rope_base", "rope_scaling_factor",
          "norm_eps", "num_experts", "moe_topk", "max_positions", "seq_note"}


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


def build_model(d: dict, src: str = "model") -> ModelSpec:
    unknown = set(d) - FIELDS
    if unknown:
        raise SpecError(f"{src}: unknown model field(s) {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(sorted(FIELDS))}")
    arch = str(d.get("arch", "gpt")).lower()
    if arch not in ARCHS:
        raise SpecError(f"{src}: unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    L = need(d, "num_layers", int, src)
    h = need(d, "hidden", int, src)
    heads = need(d, "heads", int, src)
    if h % heads:
        raise SpecError(f"{src}: hidden {h} is not divisible by heads {heads}")
    kv = need(d, "kv_heads", int, src, heads)
    gated = arch == "llama"
    f = need(d, "ffn", int, src, 4 * h)
    flash = bool(d.get("flash_attention", arch in ("gpt", "llama")))
    dropout = bool(d.get("dropout", arch != "llama"))
    if arch == "vit":
        img, p = need(d, "image_size", int, src, 224), need(d, "patch_size", int, src, 16)
        s = (img // p) ** 2 + 1
        vocab = need(d, "num_classes", int, src, 1000)
    else:
        s = need(d, "seq_len", int, src)
        vocab = need(d, "vocab", int, src)
    E = need(d, "num_experts", int, src, 1)
    k = need(d, "moe_topk", int, src, 2 if E > 1 else 1)
    if E > 1 and not 1 <= k <= E:
        raise SpecError(f"{src}: moe_topk {k} must be between 1 and num_experts {E}")
    bias = _bias_params(h, h * kv // heads, f, gated, bool(d.get("linear_bias", False)),
                        bool(d.get("qkv_bias", False)))
    blk = _block("block", s, h, heads, kv, f, gated, flash, dropout, bias=bias, experts=E, topk=k)
    layers = [blk] * _depth(L, "num_layers", src)
    if arch == "t5":
        Ld = _depth(need(d, "dec_layers", int, src, L), "dec_layers", src)
        sd = need(d, "dec_seq_len", int, src, s)
        layers = [replace(blk, name="enc_block")] * L + \
                 [_block("dec_block", sd, h, heads, kv, f, gated, flash, dropout, cross_s=s)] * Ld
    out_s = layers[-1].boundary / (2 * h) if arch != "t5" else need(d, "dec_seq_len", int, src, s)
    if arch == "vit":
        pre = LayerSpec("patch_embed", "pre", 3 * p * p * h + (s + 1) * h, 2 * s * 3 * p * p * h,
                        2 * s * h, 0.0, 2 * 3 * img * img, 0, False)
        post = LayerSpec("cls_head", "post", h * vocab + 2 * h, 2 * h * vocab, 2 * s * h,
                         6 * vocab, 2 * s * h, 0, False)
    else:
        pos = need(d, "max_positions", int, src, s) * h if arch in ("gpt", "bert") else 0
        pre = LayerSpec("embedding", "pre", vocab * h + pos, 2 * s * h, 2 * s * h, 0.0,
                        4 * s, 1, False)
        extra = h * h if arch == "bert" else 0
        post = LayerSpec("head", "post", vocab * h + extra + 2 * h, 2 * out_s * h * vocab + 2 * out_s * extra,
                         2 * out_s * h, 6 * out_s * vocab, 2 * out_s * h, 1, False)
    name = str(d.get("name", Path(src).stem))
    return ModelSpec(name=name, arch=arch, seq_len=s, hidden=h, heads=heads, num_layers=len(layers),
                     vocab=vocab, layers=tuple(layers), pre=pre, post=post,
                     config={**d, "arch": arch, "name": name})


# Hugging Face families whose config class defaults to untied input/output embeddings
# (transformers' PretrainedConfig default is tied)
_UNTIED = {"gpt_neox", "gptj", "llama", "mistral", "qwen2", "mixtral"}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
DEFAULT_TRAIN_SEQ = 4096   # tokens; LLaMA-2's pretraining length (Touvron et al. 2023 §2.2)


def _hf_arch(mt: str, src: str) -> str:
    if mt in ("gpt2", "gpt_neox", "gptj", "opt", "gpt_neo", "bloom", "falcon"):
        return "gpt"
    if mt in ("llama", "mistral", "qwen2", "gemma", "mixtral"):
        return "llama"
    if mt in ("bert", "roberta", "deberta", "electra"):
        return "bert"
    if mt in ("t5", "mt5", "bart"):
        return "t5"
    if mt in ("vit", "deit", "beit"):
        return "vit"
    raise SpecError(f"{src}: unsupported Hugging Face model_type {mt!r}")


def _hf_moe(d: dict, mt: str, src: str) -> dict:
    """Mixtral's experts; any other mixture-of-experts config is refused, never planned dense."""
    n = next((int(d[k]) for k in _MOE_KEYS if isinstance(d.get(k), int) and d[k] > 1), 0)
    if not n:
        return {}
    if mt != "mixtral":
        raise SpecError(f"{src}: {mt} is a mixture-of-experts model ({n} experts); only Mixtral-style "
                        "MoE (num_local_experts, num_experts_per_tok) is supported")
    return {"num_experts": n, "moe_topk": int(d.get("num_experts_per_tok") or 2)}


def _hf_seq(d: dict, g) -> tuple[int, int, str]:
    """(training sequence length, context length, note): the model's context (the pre-scaling
    one under RoPE scaling) capped at :data:`DEFAULT_TRAIN_SEQ`."""
    rs = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else {}
    ctx = int(g("max_position_embeddings", "n_positions", "n_ctx", default=512))
    train = int(rs.get("original_max_position_embeddings") or ctx)
    seq = min(train, DEFAULT_TRAIN_SEQ)
    return seq, ctx, (f"sequence length {seq} (default: the model's context {train} capped at "
                      f"{DEFAULT_TRAIN_SEQ}; --seq to change)")


def from_hf_config(d: dict, src: str) -> dict:
    """Map a Hugging Face config.json (no weights) to our preset fields: sizes, tied
    embeddings, biases, RoPE base and scaling, norm epsilon, Mixtral's experts, and a
    training sequence length (:func:`_hf_seq`; ``--seq`` overrides it)."""
    mt = str(d.get("model_type", "")).lower()
    g = lambda *ks, default=None: next((d[k] for k in ks if d.get(k) is not None), default)  # noqa: E731
    arch = _hf_arch(mt, src)
    h = g("hidden_size", "n_embd", "d_model", "word_embed_proj_dim")
    seq, ctx, note = _hf_seq(d, g)
    if arch == "llama":
        lin = bool(d.get("attention_bias") and d.get("mlp_bias"))
        qkv = mt == "qwen2" or bool(d.get("attention_bias"))
    else:
        lin, qkv = bool(d.get("bias", True)), False
    rs = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else {}
    out = {"name": Path(src).parent.name or mt, "arch": arch,
           "num_layers": g("num_hidden_layers", "n_layer", "num_layers", "encoder_layers"),
           "hidden": h, "heads": g("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads"),
           "kv_heads": g("num_key_value_heads"),
           "ffn": g("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim"),
           "vocab": g("vocab_size"),
           "seq_len": seq, "max_positions": ctx, "seq_note": note,
           "dec_layers": g("num_decoder_layers", "decoder_layers"),
           "image_size": g("image_size"), "patch_size": g("patch_size"),
           "num_classes": len(d["id2label"]) if isinstance(d.get("id2label"), dict) else None,
           "tie_embeddings": bool(d.get("tie_word_embeddings", mt not in _UNTIED)),
           "linear_bias": lin, "qkv_bias": qkv,
           "rope_base": g("rope_theta", "rotary_emb_base") if arch == "llama" else None,
           "rope_scaling_factor": rs.get("factor") if rs.get("rope_type", rs.get("type")) == "llama3" else None,
           "norm_eps": g("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "layernorm_epsilon"),
           **_hf_moe(d, mt, src)}
    if arch == "vit":
        for k in ("seq_len", "max_positions", "seq_note"):
            out.pop(k)
    return {k: v for k, v in out.items() if v is not None}


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
        m = build_model(d, src)
    if seq is not None:
        if int(seq) <= 0:
            raise SpecError(f"sequence length must be positive, got {seq}")
        if m.arch == "vit":
            raise SpecError("--seq does not apply to ViT models (set image_size/patch_size)")
        m = m.with_seq(int(seq))
    return m


__all__ = ["LayerSpec", "ModelSpec", "build_model", "from_hf_config", "load_model", "read_mapping"]
