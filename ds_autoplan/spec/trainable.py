"""Which parameters train: all, a fraction, or LoRA adapters on named linears (the rest frozen).

A frozen parameter keeps its 16-bit (fp32: 32-bit) copy only: no gradient, no fp32 master, no
optimizer state; its layer's backward computes the input gradient only, and the data-parallel
gradient reduction and the optimizer step see the trainable parameters alone (cost/model.py).

LoRA (Hu et al. 2021 §4.1; peft's ``LoraConfig``): each targeted linear ``W0`` of ``in -> out``
gets ``A`` (``r x in``) and ``B`` (``out x r``), trained, beside the frozen ``W0``; embeddings,
norms and the head stay frozen.  peft's ``lora.Linear`` holds ``lora_A`` = Linear(in, r) and
``lora_B`` = Linear(r, out), both without bias: ``r (in + out)`` parameters per target.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import SpecError

# Hugging Face module names of a decoder block's linears -> (in, out) from its BlockShape
# (LlamaAttention / LlamaMLP and the families spec/hf.py reads as arch "llama")
_LINEARS = {
    "q_proj": lambda b: (b.h, b.heads * b.hd),
    "k_proj": lambda b: (b.h, b.kv * b.hd),
    "v_proj": lambda b: (b.h, b.kv * b.hd),
    "o_proj": lambda b: (b.heads * b.hd, b.h),
    "gate_proj": lambda b: (b.h, b.ffn),
    "up_proj": lambda b: (b.h, b.ffn),
    "down_proj": lambda b: (b.ffn, b.h),
}
LORA_TARGETS = tuple(_LINEARS)


@dataclass(frozen=True)
class Trainable:
    """``fraction``: share of the model's own parameters trained (1.0: full fine-tune), the
    same in every layer; ``lora_r`` > 0: LoRA adapters of rank r on ``lora_targets`` of every
    block, everything else frozen."""
    fraction: float = 1.0
    lora_r: int = 0
    lora_targets: tuple = ()

    @property
    def full(self) -> bool:
        return self.lora_r == 0 and self.fraction >= 1.0

    def split(self, unit) -> tuple[float, float]:
        """(parameters, of which trainable) of one unit (spec.model.LayerSpec): its own
        parameters plus the adapters LoRA adds to it."""
        if not self.lora_r:
            return unit.params, unit.params * self.fraction
        if unit.kind != "block":
            return unit.params, 0.0
        b = unit.shape
        if b is None:
            raise SpecError("LoRA needs the blocks' shapes (a preset, YAML or Hugging Face config); "
                            "a profiled model takes --trainable FRACTION")
        if b.mla or b.experts or b.cross_s:
            raise SpecError(f"LoRA on {', '.join(self.lora_targets)}: only dense decoder blocks with "
                            "standard attention (llama-like) are counted; use --trainable FRACTION")
        adapters = float(sum(self.lora_r * sum(_LINEARS[t](b)) for t in self.lora_targets))
        return unit.params + adapters, adapters

    def counts(self, model) -> tuple[float, float]:
        """(parameters, trainable parameters) of the model (adapters included)."""
        units = [model.pre, *model.layers, model.post]
        total, train = (sum(x) for x in zip(*(self.split(u) for u in units)))
        tied = model.total_params - sum(u.params for u in units)     # a tied head counted once
        return total + tied, train + (tied * self.fraction if not self.lora_r else 0.0)

    def label(self) -> str:
        if self.lora_r:
            return f"lora:r={self.lora_r},targets={','.join(self.lora_targets)}"
        return "full" if self.full else f"{self.fraction:g}"


FULL = Trainable()


def parse_trainable(text: "str | float | Trainable | None") -> Trainable:
    """``--trainable``: a fraction in (0, 1], ``full``, or ``lora:r=16,targets=q_proj,v_proj``."""
    if text is None:
        return FULL
    if isinstance(text, Trainable):
        return text
    s = str(text).strip()
    if s.lower() == "full":
        return FULL
    if s.lower().startswith("lora:"):
        return _parse_lora(s[5:])
    try:
        f = float(s)
    except ValueError:
        raise SpecError(f"--trainable: expected a fraction in (0, 1], 'full' or "
                        f"'lora:r=R,targets=NAME,...', got {s!r}") from None
    if not 0.0 < f <= 1.0:
        raise SpecError(f"--trainable: the trained fraction must be in (0, 1], got {s}")
    return Trainable(fraction=f)


def _parse_lora(s: str) -> Trainable:
    r, targets, key = None, [], None
    for tok in (t.strip() for t in s.split(",")):
        if "=" in tok:
            key, tok = (x.strip() for x in tok.split("=", 1))
            if key not in ("r", "targets"):
                raise SpecError(f"--trainable lora: unknown key {key!r} (r, targets)")
        if key == "r":
            try:
                r = int(tok)
            except ValueError:
                raise SpecError(f"--trainable lora: r must be a positive integer, got {tok!r}") from None
        elif key == "targets" and tok:
            if tok not in _LINEARS:
                raise SpecError(f"--trainable lora: unknown target {tok!r}; choose from "
                                f"{', '.join(LORA_TARGETS)}")
            targets.append(tok)
        elif key is None:
            raise SpecError(f"--trainable lora: expected r=R,targets=NAME,..., got {s!r}")
    if not r or r < 1 or not targets:
        raise SpecError(f"--trainable lora: give r (>= 1) and targets, e.g. "
                        f"lora:r=16,targets=q_proj,v_proj; got {s!r}")
    return Trainable(lora_r=r, lora_targets=tuple(dict.fromkeys(targets)))
