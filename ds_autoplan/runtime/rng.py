"""Random-number state of one forward, replayed by its recomputation (action R).

A forward with dropout draws random numbers; its recomputation must draw the same ones or
the gradient is wrong, and must leave the generators as it found them so that the forwards
that follow draw what they would without recomputation (torch.utils.checkpoint's
``preserve_rng_state``, Megatron's ``CheckpointFunction``).  The state is the CPU generator,
the current CUDA device's generator (when CUDA is in use) and Megatron-core's CUDA RNG
tracker (model-parallel / expert-parallel streams), when the process uses it.

A checkpoint saves each rank's state (:meth:`RngState.state_dict`, see
:func:`ds_autoplan.runtime.checkpoint.save_rank_state`) so that a resumed run draws what the
uninterrupted one would have.
"""
from __future__ import annotations

import contextlib
import sys

import torch


def _tracker():
    """Megatron-core's CUDA RNG tracker, where this process imported its module: only then
    can anything have put a state in it.  Importing megatron-core just to read an empty
    tracker would cost every DeepSpeed rank seconds at its first checkpoint or recompute."""
    mrandom = sys.modules.get("megatron.core.tensor_parallel.random")
    if mrandom is None:     # megatron-core is optional for the DeepSpeed runtime
        return None
    t = mrandom.get_cuda_rng_tracker()
    return t if hasattr(t, "get_states") and hasattr(t, "set_states") else None


class RngState:
    """The generators' state now; :meth:`replay` runs a block from it and then puts back
    whatever state the generators had when the block began."""

    __slots__ = ("cpu", "cuda", "tracker")

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and \
            torch.cuda.is_initialized() else None
        t = _tracker()
        self.tracker = {k: v.clone() for k, v in t.get_states().items()} if t is not None else None

    def state_dict(self) -> dict:
        """The three states as plain tensors (what a checkpoint stores)."""
        return {"cpu": self.cpu, "cuda": self.cuda, "tracker": self.tracker}

    @classmethod
    def from_state_dict(cls, sd: dict) -> "RngState":
        """The state :meth:`state_dict` returned; :meth:`restore` puts it in place (a CUDA
        state saved where CUDA was in use is ignored on a machine without CUDA)."""
        st = cls.__new__(cls)
        st.cpu = sd["cpu"]
        st.cuda = sd["cuda"] if torch.cuda.is_available() else None
        st.tracker = sd["tracker"]
        return st

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        t = _tracker() if self.tracker is not None else None
        if t is not None:
            t.set_states({k: v.clone() for k, v in self.tracker.items()})

    @contextlib.contextmanager
    def replay(self):
        now = RngState()
        self.restore()
        try:
            yield
        finally:
            now.restore()
