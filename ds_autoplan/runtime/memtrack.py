"""Saved-activation byte accounting for one rank.

Counts the bytes of tensors autograd saves for backward (``torch.autograd.graph.
saved_tensors_hooks``) plus tensors a runtime holds explicitly for a later pass (recompute
checkpoints, the deferred weight-gradient stash of :mod:`splitgrad`).  Tensors are
deduplicated by storage: a storage counts once, with its full size, while at least one
saved or held reference to it is alive.  Parameters (and views of them) are excluded, so the
number is the activation memory the schedule simulator models (docs/schedules.md §0 ``a_F``).
"""
from __future__ import annotations

import contextlib

import torch


class _Ref:
    """One saved/held reference to a storage; releasing it is tied to its lifetime."""

    __slots__ = ("tensor", "key", "tracker", "__weakref__")

    def __init__(self, tracker: "MemTracker", tensor: torch.Tensor, key):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        tr = self.tracker
        if tr is not None and self.key is not None:
            tr._release(self.key)


class MemTracker:
    """Current and peak bytes of saved/held activations on this process."""

    def __init__(self, exclude=()):
        self._refs: dict = {}      # storage key -> [count, nbytes]
        self.current = 0
        self.peak = 0
        self._excluded: set = set()
        self.exclude(exclude)

    # -- bookkeeping ------------------------------------------------------------------
    @staticmethod
    def _key(t: torch.Tensor):
        st = t.untyped_storage()
        return (st.data_ptr(), t.device.type), st.nbytes()

    def exclude(self, tensors) -> None:
        """Never count these tensors' storages (parameters, persistent buffers)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._excluded.add(self._key(t)[0])

    def _acquire(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or t.is_meta or isinstance(t, torch.nn.Parameter):
            return None
        key, nbytes = self._key(t)
        if key in self._excluded or nbytes == 0:
            return None
        ent = self._refs.get(key)
        if ent is None:
            self._refs[key] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            ent[0] += 1
        return key

    def _release(self, key) -> None:
        ent = self._refs.get(key)
        if ent is None:
            return
        ent[0] -= 1
        if ent[0] == 0:
            del self._refs[key]
            self.current -= ent[1]

    def hold(self, tensor: torch.Tensor) -> _Ref:
        """Count ``tensor`` while the returned handle is alive (handle.tensor gives it back)."""
        return _Ref(self, tensor, self._acquire(tensor))

    def reset_peak(self) -> None:
        self.peak = self.current

    # -- autograd hooks -----------------------------------------------------------------
    def _pack(self, t):
        return _Ref(self, t, self._acquire(t))

    @staticmethod
    def _unpack(ref):
        return ref.tensor

    @contextlib.contextmanager
    def track(self):
        """Count every tensor saved for backward inside this context."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def hold(tracker: MemTracker | None, tensor):
    """``tracker.hold(tensor)`` or the tensor wrapped in an uncounted handle."""
    if tracker is None:
        return _Ref(None, tensor, None)
    return tracker.hold(tensor)
