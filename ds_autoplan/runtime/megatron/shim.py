"""CPU shim for the few CUDA-only calls of megatron-core 0.16.1 (docs/runtimes.md §4.4, §7.2).

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
* MoE (the alltoall token dispatcher): ``torch.cuda.Stream`` / ``current_stream`` / ``stream``
  become one do-nothing host "stream" (its device-to-host copies are plain host tensors, its
  events are done), its split sizes, which it turns into host numpy arrays only when they are
  CUDA tensors (``maybe_move_tensor_to_cpu``), become numpy arrays on the host too
  (``all_to_all_single`` takes sizes, not tensors), and an ``expert-parallel-rng`` state is
  registered like the model-parallel one;
* with ``remap_cuda_factories=True`` (needed only to run Megatron's *own* schedule functions,
  e.g. as a reference in tests/benchmarks) a ``TorchFunctionMode`` rewrites a ``device="cuda…"``
  keyword of tensor factory calls to ``"cpu"``.  Our executor allocates on the model's device
  itself and does not need this mode.

When CUDA is available the shim does nothing.

:func:`moe_without_te` (not CUDA-specific, applied by :func:`cpu_shim` and the model builders):
without Transformer Engine, megatron-core 0.16.1's ``moe_utils`` never defines
``te_general_gemm`` (its TE import block is the only place that does) yet the router's
``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, so every MoE forward
raises ``NameError``; defining it as ``None`` selects the library's own torch fallback.
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


def moe_without_te() -> None:
    """Define ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` when
    Transformer Engine is absent (see the module doc); a no-op otherwise."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _HostStream:
    """The one "stream" of a CPU process: work is already in order, events are done."""

    def wait_stream(self, _other):
        pass

    def wait_event(self, _event):
        pass

    def record_event(self, _event=None):
        return self

    def synchronize(self):
        pass

    def query(self):
        return True


_HOST_STREAM = _HostStream()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for host tensors: numpy when asked, as on GPU."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


@contextlib.contextmanager
def cpu_shim(remap_cuda_factories: bool = False):
    """Make megatron-core's CUDA-only p2p/schedule calls run on CPU inside this block."""
    moe_without_te()
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import token_dispatcher

    saved_move = token_dispatcher.maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    saved = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream,
             torch.cuda.current_stream, torch.cuda.stream)
    saved_rng = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = lambda *a, **k: _HOST_STREAM
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    tracker = mrandom.get_cuda_rng_tracker()
    states = getattr(tracker, "states_", None)
    added = [n for n in (mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
                         mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME)
             if isinstance(states, dict) and n not in states]
    for name in added:
        states[name] = torch.get_rng_state()
    try:
        if remap_cuda_factories:
            with _CudaFactoriesToCpu():
                yield
        else:
            yield
    finally:
        (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream,
         torch.cuda.current_stream, torch.cuda.stream) = saved
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved_rng
        token_dispatcher.maybe_move_tensor_to_cpu = saved_move
        for name in added:
            states.pop(name, None)
