"""Schedule intermediate representation.

A schedule is one ordered list of :class:`Action` per rank plus a placement that maps
every pipeline *stage* (a contiguous slice of layers; called a model chunk when a rank
holds several) to the rank that owns it.  Builders only produce lists; runtimes only
execute them (docs/schedules.md §0).

Dependencies, for any placement (docs/schedules.md §0):
  F(s,mb) after F(s-1,mb); B(s,mb) after B(s+1,mb) (or after F(S-1,mb) for the last stage,
  which computes the loss); W(s,mb) after B(s,mb); BW behaves like B and has no W;
  R(s,mb) (recompute-forward) after F(s,mb) and before B/BW(s,mb).

Communication actions carry the stage of the compute action they belong to on their own
rank: SEND_F(s) follows F(s) and feeds stage s+1; RECV_F(s) precedes F(s) and brings the
output of stage s-1; SEND_B(s) follows B/BW(s) and feeds stage s-1; RECV_B(s) precedes
B/BW(s) and brings the input-gradient of stage s+1.  ``peer`` is the other rank.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Iterable, Sequence


class ScheduleError(ValueError):
    """A schedule (or a builder's arguments) is malformed; the message says why."""


class Kind(str, enum.Enum):
    """The action vocabulary (docs/schedules.md §0): compute F, B, W, BW, R and the communication
    SEND_F, RECV_F, SEND_B, RECV_B that lowering adds."""
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    R = "R"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_comm(self) -> bool:
        """True for SEND_*/RECV_* (added by lowering; no compute)."""
        return self in COMM_KINDS

    @property
    def is_compute(self) -> bool:
        """True for F, B, W, BW and R."""
        return not self.is_comm

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.value


COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
BACKWARD_KINDS = frozenset({Kind.B, Kind.BW})


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work on one rank: ``kind`` of micro-batch ``mb`` on stage ``stage``."""

    rank: int
    kind: Kind
    stage: int
    mb: int
    peer: int | None = None  # the other rank, for SEND_*/RECV_* only

    def __post_init__(self):
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))

    @property
    def key(self) -> tuple[Kind, int, int]:
        """``(kind, stage, mb)``: the action without its rank and peer."""
        return (self.kind, self.stage, self.mb)

    def short(self) -> str:
        """Text form ``F3.0`` (``SEND_F3.0@1`` with a peer), the inverse of :meth:`parse`."""
        s = f"{self.kind.value}{self.stage}.{self.mb}"
        return s if self.peer is None else f"{s}@{self.peer}"

    @classmethod
    def parse(cls, text: str, rank: int) -> "Action":
        """Inverse of :meth:`short`: ``F3.0``, ``SEND_F3.0@1``."""
        t = text.strip()
        peer = None
        if "@" in t:
            t, p = t.split("@", 1)
            peer = int(p)
        kind_txt = t.rstrip("0123456789.")
        rest = t[len(kind_txt):]
        try:
            kind = Kind(kind_txt)
            stage_txt, mb_txt = rest.split(".")
            return cls(rank, kind, int(stage_txt), int(mb_txt), peer)
        except (ValueError, KeyError) as e:
            raise ScheduleError(f"rank {rank}: cannot parse action {text!r} "
                                f"(expected e.g. F3.0, BW1.2, SEND_F0.1@1)") from e


# ----------------------------------------------------------------------------- placement
def sequential_placement(d: int) -> tuple[int, ...]:
    """Stage s on rank s (GPipe, 1F1B, ZB-H1)."""
    return tuple(range(d))


def interleaved_placement(d: int, v: int) -> tuple[int, ...]:
    """v chunks per rank, stage s on rank s mod d (Megatron's interleaved 1F1B)."""
    return tuple(s % d for s in range(v * d))


def v_placement(d: int) -> tuple[int, ...]:
    """2d stages; stage i and stage 2d-1-i on rank i (docs/schedules.md §2.1)."""
    return tuple(list(range(d)) + list(range(d - 1, -1, -1)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus the stage→rank placement."""

    name: str
    num_microbatches: int
    placement: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    meta: dict = field(default_factory=dict, compare=False)

    # -- shape -----------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        """Pipeline ranks (one action list each)."""
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        """Pipeline stages (entries of the placement)."""
        return len(self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in layer order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def chunk_of(self, stage: int) -> int:
        """Index of ``stage`` among its rank's stages (0 = first in layer order)."""
        return self.stages_of(self.placement[stage]).index(stage)

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks (stages) each rank holds: S / d (every placement here is uniform)."""
        return self.num_stages // self.num_ranks

    @property
    def round_robin(self) -> bool:
        """Stage s on rank s mod d (sequential, or Megatron's interleaved order): the order
        Megatron's own pipeline layout expresses.  False for a V (the return leg runs from the
        last rank back to rank 0, so the first and the last stage share rank 0)."""
        d = self.num_ranks
        return all(r == s % d for s, r in enumerate(self.placement))

    @property
    def placement_kind(self) -> str:
        """``sequential``, ``interleaved``, ``v`` or ``custom``: a label for reports; code asks
        :attr:`chunks_per_rank` and the placement itself."""
        d, S = self.num_ranks, self.num_stages
        if self.placement == sequential_placement(d):
            return "sequential"
        if S % d == 0 and self.placement == interleaved_placement(d, S // d):
            return "interleaved"
        if S == 2 * d and self.placement == v_placement(d):
            return "v"
        return "custom"

    def actions(self) -> Iterable[Action]:
        """Every action of every rank, rank by rank in list order."""
        for lst in self.ranks:
            yield from lst

    def has_comm(self) -> bool:
        """True when the lists are lowered (contain SEND/RECV)."""
        return any(a.kind.is_comm for a in self.actions())

    def compute_only(self) -> "Schedule":
        """The same schedule with communication actions dropped."""
        return self.replace_lists([[a for a in lst if a.kind.is_compute] for lst in self.ranks])

    def replace_lists(self, lists: Sequence[Sequence[Action]], **meta) -> "Schedule":
        """The same schedule (name, micro-batches, placement) with other per-rank lists and
        ``meta`` updated by ``meta``."""
        return Schedule(self.name, self.num_microbatches, self.placement,
                        tuple(tuple(x) for x in lists), {**self.meta, **meta})

    # -- construction helper -----------------------------------------------------------
    @classmethod
    def from_keys(cls, name: str, n: int, placement: Sequence[int],
                  per_rank: Sequence[Sequence[tuple]], **meta) -> "Schedule":
        """Build from per-rank lists of ``(kind, stage, mb)`` tuples."""
        lists = []
        for r, keys in enumerate(per_rank):
            lists.append(tuple(Action(r, k, s, m) for (k, s, m) in keys))   # Action converts k
        return cls(name, n, tuple(placement), tuple(lists), dict(meta))

    # -- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON form (``format: ds_autoplan.schedule/1``; actions in their short text form)."""
        return {
            "format": "ds_autoplan.schedule/1",
            "name": self.name,
            "num_microbatches": self.num_microbatches,
            "placement": list(self.placement),
            "ranks": [[a.short() for a in lst] for lst in self.ranks],
            "meta": self.meta,
        }

    def to_json(self, **kw) -> str:
        """``to_dict`` as a JSON string (keywords go to :func:`json.dumps`)."""
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, obj: dict) -> "Schedule":
        """Inverse of :meth:`to_dict`; a malformed object raises :class:`ScheduleError`."""
        try:
            ranks = obj["ranks"]
            sched = cls(str(obj.get("name", "custom")), int(obj["num_microbatches"]),
                        tuple(int(x) for x in obj["placement"]),
                        tuple(tuple(Action.parse(t, r) for t in lst) for r, lst in enumerate(ranks)),
                        dict(obj.get("meta", {})))
        except (KeyError, TypeError) as e:
            raise ScheduleError(f"malformed schedule object: missing or bad field {e}") from e
        return sched

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """Inverse of :meth:`to_json`."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScheduleError(f"schedule file is not valid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ScheduleError("schedule JSON must be an object")
        return cls.from_dict(obj)

    def to_text(self) -> str:
        """Compact, editable text form: a header line, then ``rankR: A A A ...`` per rank."""
        head = (f"# ds_autoplan schedule name={self.name} microbatches={self.num_microbatches} "
                f"placement={','.join(map(str, self.placement))}")
        body = [f"rank{r}: " + " ".join(a.short() for a in lst) for r, lst in enumerate(self.ranks)]
        return "\n".join([head, *body]) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Parse the text form (a ``# ds_autoplan schedule`` header with micro-batches and
        placement, then one line of short actions per rank) that :meth:`save` writes."""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if not lines or not lines[0].startswith("# ds_autoplan schedule"):
            raise ScheduleError("text schedule must start with '# ds_autoplan schedule ...'")
        fields = dict(tok.split("=", 1) for tok in lines[0].split()[3:] if "=" in tok)
        try:
            n = int(fields["microbatches"])
            placement = tuple(int(x) for x in fields["placement"].split(","))
        except (KeyError, ValueError) as e:
            raise ScheduleError(f"bad schedule header {lines[0]!r}: {e}") from e
        ranks = []
        for ln in lines[1:]:
            if ln.startswith("#"):
                continue
            label, _, rest = ln.partition(":")
            if not label.startswith("rank"):
                raise ScheduleError(f"expected 'rankN: ...', got {ln[:40]!r}")
            r = int(label[4:])
            if r != len(ranks):
                raise ScheduleError(f"ranks must be listed in order; got rank{r} at position {len(ranks)}")
            ranks.append(tuple(Action.parse(t, r) for t in rest.split()))
        return cls(fields.get("name", "custom"), n, placement, tuple(ranks), {})

    def to_csv(self) -> str:
        """One row per action: rank,index,kind,stage,mb,peer."""
        rows = ["rank,index,kind,stage,mb,peer"]
        for r, lst in enumerate(self.ranks):
            for i, a in enumerate(lst):
                rows.append(f"{r},{i},{a.kind.value},{a.stage},{a.mb},{'' if a.peer is None else a.peer}")
        return "\n".join(rows) + "\n"

    @classmethod
    def load(cls, path: str) -> "Schedule":
        """Read a schedule file: JSON when it starts with ``{``, else the text form."""
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError:
            raise ScheduleError(f"{path} is not a schedule file (not UTF-8 text: JSON or the "
                                f"text form)") from None
        return cls.from_json(text) if text.lstrip().startswith("{") else cls.from_text(text)

    def save(self, path: str) -> None:
        """Write the schedule to ``path``: JSON for a ``.json`` name, else the text form
        (:meth:`from_text`)."""
        with open(path, "w") as fh:
            fh.write(self.to_json(indent=1) if path.endswith(".json") else self.to_text())


# ----------------------------------------------------------------------------- dependencies
class DependencyIndex:
    """Resolves the compute predecessors of every action of a schedule."""

    def __init__(self, sched: Schedule):
        self.S = sched.num_stages
        self.bwd: dict[tuple[int, int], Kind] = {}
        self.rec: set[tuple[int, int]] = set()
        for a in sched.actions():
            if a.kind in BACKWARD_KINDS:
                self.bwd[(a.stage, a.mb)] = a.kind
            elif a.kind == Kind.R:
                self.rec.add((a.stage, a.mb))

    def backward_kind(self, stage: int, mb: int) -> Kind:
        """The backward kind (B or BW) the schedule uses for (``stage``, ``mb``)."""
        return self.bwd.get((stage, mb), Kind.BW)

    def preds(self, a: Action) -> list[tuple[Kind, int, int]]:
        """The ``(kind, stage, mb)`` actions ``a`` must wait for (docs/schedules.md §0)."""
        k, s, m = a.kind, a.stage, a.mb
        if k == Kind.F:
            return [(Kind.F, s - 1, m)] if s > 0 else []
        if k == Kind.R:
            return [(Kind.F, s, m)]
        if k in BACKWARD_KINDS:
            p = [(Kind.F, s, m)]
            if s + 1 < self.S:
                p.append((self.backward_kind(s + 1, m), s + 1, m))
            if (s, m) in self.rec:
                p.append((Kind.R, s, m))
            return p
        if k == Kind.W:
            return [(Kind.B, s, m)]
        # communication: a SEND follows its local compute action
        if k == Kind.SEND_F:
            return [(Kind.F, s, m)]
        if k == Kind.SEND_B:
            return [(self.backward_kind(s, m), s, m)]
        return []  # RECV_*: matched to the peer's SEND by the simulator


def cross_stage_pred(a: Action, dep: DependencyIndex) -> tuple[Kind, int, int] | None:
    """The predecessor of a compute action that lives on another stage, if any."""
    if a.kind == Kind.F and a.stage > 0:
        return (Kind.F, a.stage - 1, a.mb)
    if a.kind in BACKWARD_KINDS and a.stage + 1 < dep.S:
        return (dep.backward_kind(a.stage + 1, a.mb), a.stage + 1, a.mb)
    return None


# ----------------------------------------------------------------------------- validation
def validate(sched: Schedule) -> None:
    """Raise :class:`ScheduleError` unless the schedule is complete and locally ordered.

    Checks (docs/schedules.md §3.3, checks 1, 6 and the same-rank half of 2): every micro-batch
    gets exactly one F and either one BW or one B and one W on every stage, on the owning
    rank; at most one R, after F and before the backward; no duplicates; on each rank the
    order respects the dependencies between its own actions; SEND/RECV pairs match per
    ordered rank pair.  Cross-rank ordering (deadlock) is the simulator's job.
    """
    d, S, n = sched.num_ranks, sched.num_stages, sched.num_microbatches
    if d < 1 or n < 1:
        raise ScheduleError("a schedule needs at least one rank and one micro-batch")
    forwards = sum(1 for a in sched.actions() if a.kind == Kind.F)
    if forwards < n * S:       # before anything is sized by n (costs, loops over micro-batches)
        raise ScheduleError(f"schedule declares {n} micro-batches on {S} stages but lists "
                            f"{forwards} forward actions (one F per stage and micro-batch)")
    for s, r in enumerate(sched.placement):
        if not 0 <= r < d:
            raise ScheduleError(f"stage {s} placed on rank {r}, but there are {d} ranks")
    seen: dict[tuple, Action] = {}
    for r, lst in enumerate(sched.ranks):
        for a in lst:
            if a.rank != r:
                raise ScheduleError(f"{a.short()} listed on rank {r} but says rank {a.rank}")
            if not (0 <= a.stage < S and 0 <= a.mb < n):
                raise ScheduleError(f"rank {r}: {a.short()} out of range (stages {S}, micro-batches {n})")
            if a.kind.is_compute and sched.placement[a.stage] != r:
                raise ScheduleError(f"rank {r}: {a.short()} but stage {a.stage} is placed on rank "
                                    f"{sched.placement[a.stage]}")
            if a.key in seen:
                raise ScheduleError(f"rank {r}: duplicate action {a.short()}")
            seen[a.key] = a
    for s in range(S):
        for m in range(n):
            has = {k for k in (Kind.F, Kind.B, Kind.W, Kind.BW) if (k, s, m) in seen}
            if Kind.F not in has:
                raise ScheduleError(f"missing F for stage {s}, micro-batch {m}")
            if Kind.BW in has and (Kind.B in has or Kind.W in has):
                raise ScheduleError(f"stage {s}, micro-batch {m} has BW and a split B/W")
            if Kind.BW not in has and has != {Kind.F, Kind.B, Kind.W}:
                miss = sorted(k.value for k in {Kind.B, Kind.W} - has)
                raise ScheduleError(f"stage {s}, micro-batch {m}: missing {'/'.join(miss)} "
                                    f"(need BW, or B and W)")
    dep = DependencyIndex(sched)
    for r, lst in enumerate(sched.ranks):
        pos = {a.key: i for i, a in enumerate(lst)}
        for i, a in enumerate(lst):
            for p in dep.preds(a):
                if p in pos and pos[p] > i:
                    raise ScheduleError(f"rank {r}: {a.short()} at position {i} comes before "
                                        f"its dependency {p[0].value}{p[1]}.{p[2]} (position {pos[p]})")
                if p not in seen and a.kind.is_compute:
                    raise ScheduleError(f"rank {r}: {a.short()} depends on missing "
                                        f"{p[0].value}{p[1]}.{p[2]}")
    if sched.has_comm():
        _validate_comm(sched, seen)


def comm_peer(kind: Kind, stage: int, placement: Sequence[int]) -> int | None:
    """Rank on the other end of a communication action, or None if the edge is local."""
    S = len(placement)
    other = {Kind.SEND_F: stage + 1, Kind.RECV_F: stage - 1,
             Kind.SEND_B: stage - 1, Kind.RECV_B: stage + 1}[kind]
    if not 0 <= other < S:
        return None
    peer = placement[other]
    return None if peer == placement[stage] else peer


MATCHING = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}


def matching_recv_key(a: Action) -> tuple[Kind, int, int]:
    """Key of the RECV that pairs with SEND ``a``."""
    return (Kind.RECV_F, a.stage + 1, a.mb) if a.kind == Kind.SEND_F else (Kind.RECV_B, a.stage - 1, a.mb)


def _validate_comm(sched: Schedule, seen: dict) -> None:
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for a in sched.actions():
        if not a.kind.is_comm:
            continue
        if sched.placement[a.stage] != a.rank:
            raise ScheduleError(f"rank {a.rank}: {a.short()} but stage {a.stage} lives on rank "
                                f"{sched.placement[a.stage]}")
        peer = comm_peer(a.kind, a.stage, sched.placement)
        if peer is None or a.peer != peer:
            raise ScheduleError(f"rank {a.rank}: {a.short()} has no remote peer "
                                f"(expected peer {peer})")
        if a.kind in MATCHING:
            sends.setdefault((a.rank, a.peer), []).append(matching_recv_key(a))
        else:
            recvs.setdefault((a.peer, a.rank), []).append(a.key)
    for pair in set(sends) | set(recvs):
        if sends.get(pair, []) != recvs.get(pair, []):
            raise ScheduleError(f"sends from rank {pair[0]} to rank {pair[1]} do not match the "
                                f"receives posted there (check 6 of docs/schedules.md §3.3)")
