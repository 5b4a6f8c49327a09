"""The execution state of one step, per (stage, micro-batch), the same in both adapters.

An action leaves in its :class:`Slot` what a later action of the same stage and micro-batch
(or of the neighbouring stage on the same rank) takes; :class:`Slots` holds one step's slots
and, at the step's end, says what no action took (an action list that misses a B, W or a
receive's consumer).  Each adapter fills the fields its framework needs; a field is None when
nothing is held.
"""
from __future__ import annotations

from ...schedule import ScheduleError


class Slot:
    """What one (stage, micro-batch) holds between its actions."""

    __slots__ = ("inp",       # the stage input (a leaf: its .grad is the gradient sent back)
                 "out",       # the stage output, until its backward (and its SEND_F)
                 "loss",      # the loss (loss stage), until its backward
                 "recv_f",    # a posted receive of the input activation (RECV_F -> F)
                 "recv_b",    # a posted receive of the output gradient (RECV_B -> B/BW)
                 "handed_f",  # the activation handed over by the previous stage on this rank
                 "handed_b",  # the output gradient handed over by the next stage on this rank
                 "in_grad",   # the input gradient, until SEND_B sends it
                 "store",     # the deferred weight-gradient work (B -> W)
                 "rng",       # the random state of a recomputed F (F -> R)
                 "ckpt",      # the recompute checkpoint: the held input (F -> R)
                 "h",         # the leaf after the recomputed prefix (F -> B)
                 "h2")        # the recomputed prefix's output (R -> B)

    def __init__(self):
        for k in Slot.__slots__:
            setattr(self, k, None)

    def held(self) -> list[str]:
        """The fields that hold something."""
        return [k for k in Slot.__slots__ if getattr(self, k) is not None]


class Slots(dict):
    """(stage, micro-batch) -> :class:`Slot` of one step."""

    def at(self, stage: int, mb: int) -> Slot:
        """The slot of (``stage``, ``mb``), made on first use."""
        slot = self.get((stage, mb))
        if slot is None:
            slot = self[(stage, mb)] = Slot()
        return slot

    def check_done(self, who: str) -> None:
        """Raise :class:`ScheduleError` if a slot still holds something at the step's end."""
        left = {k: held for k, sl in sorted(self.items()) if (held := sl.held())}
        if left:
            first = "; ".join(f"stage {s} micro-batch {m}: {', '.join(h)}"
                              for (s, m), h in list(left.items())[:4])
            raise ScheduleError(f"{who}: the step ended with state no action took ({len(left)} "
                                f"(stage, micro-batch) pairs; {first}): missing B/W actions?")
