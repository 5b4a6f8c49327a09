"""One parallel configuration: every degree a plan sets, in one place (docs/architecture.md).

:class:`Parallel` is what the cost model's closed form (cost/iteration.py), the search's
space and candidates (search/space.py, search/evaluate.py), the Plan (plan.py) and the
emitters read their degrees from.  A new degree is a field here, its validation here (and
its JSON form in :meth:`Parallel.as_dict` if it is not a plain value), and its use where it
costs, is searched, emitted or run (docs/architecture.md "How to add a parallel degree"):
plan.json and the summaries carry it with no edit.

Names follow Megatron-core's parallel_state (0.16.1): ``tp`` tensor, ``pp`` pipeline,
``dp`` data, ``cp`` context, ``ep`` expert, ``etp`` expert tensor parallelism.  The ranks of
one pipeline stage are tp * cp * dp (Megatron's order tp-cp-ep-dp-pp); the expert layers
regroup the same ranks as etp * ep * expert-dp, so expert_dp = tp * cp * dp / (etp * ep).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from . import SpecError

ZERO_STAGES = (0, 1, 2, 3)
# context parallelism's communication: "p2p" Megatron's ring attention (KV blocks passed
# around the ring, Liu et al. 2023 / Megatron-core's --cp-comm-type p2p); "a2a"
# DeepSpeed-Ulysses (all-to-all from sequence to head sharding, Jacobs et al. 2023 §3;
# Megatron-core's --cp-comm-type a2a)
CP_COMM = ("p2p", "a2a")
OFFLOAD_DEVICES = ("cpu", "nvme")


@dataclass(frozen=True)
class Offload:
    """What a configuration keeps off the device (docs/offload.md §2).

    ``optimizer``: the fraction of the rank's optimizer states (fp32 master, Adam moments, fp32
    gradients) held -- and stepped -- by the host: 0 none, 1 all (ZeRO-Offload, Ren et al.
    2021), in between DeepSpeed's ``offload_optimizer.ratio`` (ZeRO-Offload++ Twin-Flow, ZeRO-3
    only) or Megatron-core's ``optimizer_offload_fraction``; ``params``: ZeRO-3's parameter
    partitions on the host (ZeRO-Infinity ``offload_param``, Rajbhandari et al. 2021 §5);
    ``device``: 'cpu' (host DRAM) or 'nvme' (ZeRO-Infinity's NVMe, through host buffers), where
    the states go; ``activations``: the activations kept for the backward live in host memory
    (always DRAM): a recomputed layer's input (DeepSpeed's ``activation_checkpointing.
    cpu_checkpointing``), a kept layer's saved tensors (the runtime's swap policy,
    runtime/swap.py; docs/offload.md §2).

    Text form (``--fix offload=...``, ``plan.json``): ``none``, ``opt``, ``opt:0.5``,
    ``opt+param``, ``param``, with an optional ``nvme:`` prefix (``nvme:opt+param``), and ``act``
    alone or last (``act``, ``opt+act``)."""
    optimizer: float = 0.0
    params: bool = False
    device: str = "cpu"
    activations: bool = False

    def __post_init__(self):
        f = self.optimizer
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise SpecError(f"offloaded optimizer fraction must lie in [0, 1], got {f!r}")
        object.__setattr__(self, "optimizer", float(f))
        if self.device not in OFFLOAD_DEVICES:
            raise SpecError(f"offload device must be one of {', '.join(OFFLOAD_DEVICES)}, got {self.device!r}")
        if self.device == "nvme" and not self.states:
            raise SpecError("offload to nvme names no model states to offload (opt and/or param; "
                            "activations go to host memory)")

    @property
    def any(self) -> bool:
        """Something is offloaded."""
        return self.states or self.activations

    @property
    def states(self) -> bool:
        """Model states (optimizer, parameters) are offloaded: what needs ZeRO."""
        return self.optimizer > 0 or self.params

    def text(self) -> str:
        """The text form (:meth:`parse` reads it back)."""
        if not self.any:
            return "none"
        parts = ([("opt" if self.optimizer == 1 else f"opt:{self.optimizer:g}")] if self.optimizer else []) + \
            (["param"] if self.params else []) + (["act"] if self.activations else [])
        return ("nvme:" if self.device == "nvme" else "") + "+".join(parts)

    def label(self) -> str:
        """Words for a plan line: what is offloaded where."""
        if not self.any:
            return "no offload"
        what = [f"{'' if self.optimizer == 1 else f'{self.optimizer:.0%} of '}optimizer states"] if self.optimizer else []
        what += ["parameters"] if self.params else []
        out = [" + ".join(what) + (" on NVMe" if self.device == "nvme" else " on the host")] if what else []
        return " + ".join(out + (["activations on the host"] if self.activations else []))

    @classmethod
    def parse(cls, text: "str | Offload | None") -> "Offload":
        """:meth:`text`'s form back into an Offload (also 'false'/'0' for none)."""
        if isinstance(text, Offload):
            return text
        t = str(text or "none").strip().lower()
        if t in ("none", "no", "false", "0", "off", ""):
            return cls()
        device = "cpu"
        if ":" in t and t.split(":", 1)[0] in OFFLOAD_DEVICES:
            device, t = t.split(":", 1)
        opt, params, act = 0.0, False, False
        for item in t.split("+"):
            k, _, v = item.strip().partition(":")
            if k in ("opt", "optimizer"):
                try:
                    opt = float(v) if v else 1.0
                except ValueError:
                    raise SpecError(f"offload: optimizer fraction must be a number, got {v!r}") from None
            elif k in ("param", "params", "parameters") and not v:
                params = True
            elif k in ("act", "activations") and not v:
                act = True
            else:
                raise SpecError(f"offload: unknown part {item!r}; write none, opt, opt:FRACTION, "
                                f"opt+param or param, optionally after nvme:, and/or act")
        return cls(opt, params, device, act)


NO_OFFLOAD = Offload()


class ParallelError(SpecError):
    """A configuration :class:`Parallel` refuses: ``field`` names the degree (None: a relation
    of several), ``problem`` the rest of the message (callers with other names for the
    fields, such as plan.json's, say it in theirs)."""
    def __init__(self, field: str | None, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field} {problem}" if field else problem)


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """The degrees and the batch split of one uniform configuration (keywords only).

    ``zero``: ZeRO stage over the data-parallel group (Megatron's distributed optimizer: 1);
    ``sp``: Megatron sequence parallelism (tp > 1 only); ``chunks``: model chunks (virtual
    stages) per pipeline rank; ``micro_batch``: samples per data-parallel rank per
    micro-batch; ``num_microbatches``: micro-batches per iteration (gradient accumulation);
    ``etp``: None means Megatron's default, the dense tensor-parallel degree; ``cp_comm``:
    how context parallelism exchanges (:data:`CP_COMM`); ``offload``: what the device does not
    hold (:class:`Offload`; with ZeRO 1-3, parameters with ZeRO-3 only)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    cp_comm: str = "p2p"
    zero: int = 0
    sp: bool = False
    chunks: int = 1
    micro_batch: int = 1
    num_microbatches: int = 1
    offload: Offload = NO_OFFLOAD

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for k in ("tp", "pp", "dp", "ep", "etp", "cp", "chunks", "micro_batch", "num_microbatches"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParallelError(k, f"must be a positive integer, got {v!r}")
        if self.cp_comm not in CP_COMM:
            raise ParallelError("cp_comm", f"must be one of {', '.join(CP_COMM)}, got {self.cp_comm!r}")
        if self.zero not in ZERO_STAGES:
            raise ParallelError("zero", f"must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.offload, Offload):
            object.__setattr__(self, "offload", Offload.parse(self.offload))
        if self.offload.states and self.zero < 1:
            raise SpecError("offloading model states needs ZeRO (stage 1-3): the engines offload the "
                            "partitioned optimizer (DeepSpeed's ZeRO optimizers, Megatron's distributed "
                            "optimizer)")
        if self.offload.params and self.zero != 3:
            raise SpecError("parameter offload needs ZeRO-3 (DeepSpeed's offload_param)")
        if (self.tp * self.cp * self.dp) % (self.ep * self.etp):
            raise ParallelError(None, f"ep x etp = {self.ep} x {self.etp} must divide the tp x cp "
                                f"x dp = {self.tp * self.cp * self.dp} ranks of a pipeline stage")

    # ---- derived ----
    @property
    def world_size(self) -> int:
        """Devices: tp * cp * dp per stage, times pp stages."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def stage_ranks(self) -> int:
        """Devices of one pipeline stage (tp * cp * dp)."""
        return self.tp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel degree: the stage's ranks regrouped as etp * ep * expert_dp
        (megatron-core parallel_state's expert groups)."""
        return self.stage_ranks // (self.ep * self.etp)

    @property
    def batch_per_microbatch(self) -> int:
        """Samples of one micro-batch over the whole data-parallel group."""
        return self.micro_batch * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.num_microbatches * self.dp

    @property
    def sequence_parallel(self) -> bool:
        """Megatron SP as it runs: only with tensor parallelism."""
        return self.sp and self.tp > 1

    def with_(self, **changes) -> "Parallel":
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        """Every field; the offload in its text form (JSON-able)."""
        return {f.name: (getattr(self, f.name).text() if f.name == "offload" else getattr(self, f.name))
                for f in fields(self)}
