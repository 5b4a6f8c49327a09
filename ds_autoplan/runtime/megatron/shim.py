"""CPU shim for the few CUDA-only calls of megatron-core 0.16.1 (integration.md §4.4, §7.2).

On a CPU-only torch build these calls raise ``Torch not compiled with CUDA enabled``:

* ``P2PCommunicator._communicate`` allocates receive buffers on ``torch.cuda.current_device()``
  (and ``_communicate_shapes`` the shape tensors), then may call ``torch.cuda.synchronize()``;
* the three built-in schedule functions allocate their token counter with ``device="cuda"``.

:func:`cpu_shim` fixes exactly these, only while its ``with`` block runs, and restores the
originals afterwards (never editing site-packages):

* ``torch.cuda.current_device`` → returns ``torch.device("cpu")``;
* ``torch.cuda.synchronize`` → no-op;
* the tensor-parallel RNG tracker (``DotProductAttention`` forks it around attention dropout even
  with TP=1): ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` read and
  write the CPU generator, and a ``model-parallel-rng`` state is registered for the block if
  none exists (removed again on exit);
* with ``remap_cuda_factories=True`` (needed only to run Megatron's *own* schedule functions,
  e.g. as a reference in tests/benchmarks) a ``TorchFunctionMode`` rewrites a ``device="cuda…"``
  keyword of tensor factory calls to ``"cpu"``.  Our executor allocates on the model's device
  itself and does not need this mode.

When CUDA is available the shim does nothing.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange,
              torch.zeros_like, torch.ones_like, torch.empty_like}


class _CudaFactoriesToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if func in _FACTORIES and dev is not None and str(dev).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_shim(remap_cuda_factories: bool = False):
    """Make megatron-core's CUDA-only p2p/schedule calls run on CPU inside this block."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel import random as mrandom

    saved = (torch.cuda.current_device, torch.cuda.synchronize)
    saved_rng = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    tracker = mrandom.get_cuda_rng_tracker()
    name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME
    added = isinstance(getattr(tracker, "states_", None), dict) and name not in tracker.states_
    if added:
        tracker.states_[name] = torch.get_rng_state()
    try:
        if remap_cuda_factories:
            with _CudaFactoriesToCpu():
                yield
        else:
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved_rng
        if added:
            tracker.states_.pop(name, None)
