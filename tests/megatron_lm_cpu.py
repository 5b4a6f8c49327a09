"""Run Megatron-LM's ``pretrain_gpt.py`` on CPU ranks (gloo) -- a test-side shim, never a
change to the client files.

    torchrun --nproc_per_node 2 tests/megatron_lm_cpu.py COPY/pretrain_gpt.py <Megatron-LM flags>

Megatron-LM's loop assumes CUDA (../shared/clients/README.md).  Before the script runs, this
shim: lets ``initialize_megatron`` start without CUDA; stubs the CUDA-only calls the loop makes
(streams, ``Tensor.cuda``, memory statistics, CUDA RNG state) and rewrites ``device="cuda"``
tensor factories to the CPU (``ds_autoplan.runtime.megatron.cpu_shim``); skips
``_compile_dependencies`` (the wheel ships the dataset helpers; the fused CUDA kernels are off);
stands in for two GPU-only or missing imports (triton kernels, ``megatron.rl``) and gives
dist_checkpointing's writer a queue whose process does not import them again.

Test-only extras, switched by environment variables:

* ``MLM_CPU_INIT_BY_NAME=1``: after ``get_model`` every parameter is re-drawn from a generator
  seeded by its *global* name (layer index counted over the whole model), so runs with
  different placements (1F1B, interleaved, V) start from the same weights.
* ``MLM_CPU_SERIAL_P2P=1``: Megatron's own interleaved schedule sends one message at a time
  (see :func:`_serial_p2p`), the mode in which it is exact on gloo.
* ``MLM_CPU_REPORT=path``: each rank appends its model chunks' layers and pre/post_process.
* ``MLM_CPU_LOSSES=path``: the last rank appends each step's logged ``lm loss`` (full
  precision) to ``path`` as JSON lines.
* ``MLM_CPU_SLEEP=s``: every transformer layer also sleeps ``s`` seconds per sample of its
  micro-batch in its forward and twice that in its backward (calibrated-sleep layers: a step's
  time then shows the schedule, not two ranks contending for two cores).

When the script is done the rank ends at once (:func:`harness.forked.exit_now`), without the
interpreter's teardown of the modules megatron-core imports.

    torchrun --nproc_per_node 2 tests/megatron_lm_cpu.py --runs JOB.json

runs the script several times in one launch, each run in forked children of the ranks (their
imports paid once, see :func:`runs`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import runpy
import sys

import torch
from harness.forked import exit_now, fork_wait


class _Stream:
    """Stand-in for ``torch.cuda.Stream``: every operation runs in order on the CPU."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return None


def _stub_cuda() -> None:
    c = torch.cuda
    c.Stream = _Stream
    c.current_stream = lambda *a, **k: _Stream()
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.set_device = lambda *a, **k: None
    c.device_count = lambda: 1      # Megatron-LM sets up model parallelism only with devices
    c.empty_cache = lambda: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(c, name, lambda *a, **k: 0)
    c.reset_peak_memory_stats = lambda *a, **k: None
    c.get_rng_state = lambda *a, **k: torch.get_rng_state()
    c.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    c.manual_seed = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self


def _global_name(chunk, name: str) -> str:
    """``decoder.layers.<local i>.x`` -> ``decoder.layers.<global i>.x`` (Megatron's
    ``layer_number`` is global and 1-based); MoE: ``local_experts.<j>`` -> the global expert
    index (ep rank · local experts + j, as Megatron's ``local_expert_indices``)."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        layers = chunk
        for p in parts[:i + 1]:
            layers = getattr(layers, p)
        parts[i + 1] = str(layers[int(parts[i + 1])].layer_number - 1)
    if "local_experts" in parts:
        from megatron.core import parallel_state as ps
        i = parts.index("local_experts")
        experts = chunk.get_submodule(".".join(name.split(".")[:i + 1]))
        parts[i + 1] = str(ps.get_expert_model_parallel_rank() * len(experts) + int(parts[i + 1]))
    return ".".join(parts)


def _init_by_name(model) -> None:
    from megatron.core.utils import unwrap_model
    with torch.no_grad():
        for chunk in model:
            inner = unwrap_model(chunk)
            for name, p in inner.named_parameters():
                key = _global_name(inner, name)
                seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "little")
                g = torch.Generator().manual_seed(seed)
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.02)


def _stub_triton_kernels() -> None:
    """megatron-core's batch-invariant kernels import triton (GPU only); Megatron-LM imports
    ``enable_batch_invariant_mode`` from them and calls it only with --batch-invariant-mode."""
    import types
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    try:
        __import__(name)
    except ImportError:
        mod = types.ModuleType(name)

        def enable_batch_invariant_mode(*a, **k):
            raise RuntimeError("--batch-invariant-mode needs triton (GPU)")
        mod.enable_batch_invariant_mode = enable_batch_invariant_mode
        sys.modules[name] = mod


def _stub_rl_utils() -> None:
    """training.py imports ``megatron.rl.parallel_utils`` unguarded (used by RL runs only); the
    client folder does not hold ``megatron/rl``."""
    import types
    try:
        __import__("megatron.rl.parallel_utils")
    except ImportError:
        pkg, mod = types.ModuleType("megatron.rl"), types.ModuleType("megatron.rl.parallel_utils")
        pkg.__path__ = []

        def build_inference_pg_collection(*a, **k):
            raise RuntimeError("megatron.rl is not part of this Megatron-LM copy")
        mod.build_inference_pg_collection = build_inference_pg_collection
        sys.modules.update({"megatron.rl": pkg, "megatron.rl.parallel_utils": mod})


def _serial_p2p(model) -> None:
    """Megatron's interleaved schedule with one isend/irecv per message.  Megatron-LM forces
    ``overlap_p2p_comm`` (or else ``batch_p2p_comm``) for interleaving on 2 pp ranks; with gloo
    both post messages in both directions to the one peer at once and gloo pairs them in posting
    order, so activations reach the wrong micro-batch (measured: step-1 loss of micro-batch 3
    off by 0.02)."""
    from megatron.core.utils import get_model_config
    cfg = get_model_config(model[0])
    cfg.overlap_p2p_comm = cfg.batch_p2p_comm = False


def _r_actions(runner) -> list | None:
    """The R actions (stage, micro-batch) of this pp rank's list in ``runner``'s schedule."""
    if runner is None:
        return None
    from megatron.core import parallel_state as ps
    return [[a.stage, a.mb] for a in runner.schedule.ranks[ps.get_pipeline_model_parallel_rank()]
            if a.kind.value == "R"]


def _report(model, fb, path: str) -> None:
    """One JSON line per rank: its chunks' global layer numbers, pre/post_process and
    recomputation, its B/W-split linear layers, and the class of the forward_backward_func
    train() will use."""
    from megatron.core.utils import unwrap_model
    chunks = [unwrap_model(c) for c in model]
    from ds_autoplan.runtime.megatron import SplitColumnParallelLinear, SplitRowParallelLinear
    split = (SplitColumnParallelLinear, SplitRowParallelLinear)
    runner = getattr(fb, "fb", None)          # ds_autoplan's ScheduleRunner (patched script)
    rec = {"rank": torch.distributed.get_rank(), "forward_backward_func": type(fb).__name__,
           "split_linears": sum(isinstance(m, split) for c in chunks for m in c.modules()),
           "r_actions": _r_actions(runner),
           "chunks": [{"layers": [int(x.layer_number) for x in c.decoder.layers],
                       "pre_process": bool(c.pre_process), "post_process": bool(c.post_process),
                       "recompute": [c.config.recompute_granularity, c.config.recompute_num_layers]}
                      for c in chunks]}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _sleep_layers(model, per_sample: float) -> None:
    """``MLM_CPU_SLEEP`` (module docstring): hooks on every TransformerLayer."""
    import time

    from megatron.core.transformer.transformer_layer import TransformerLayer

    def backward_sleep(n):
        def hook(grad):
            time.sleep(2 * per_sample * n)
            return grad
        return hook

    def after_forward(module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        n = hidden.shape[1]                     # [sequence, batch, hidden]
        time.sleep(per_sample * n)
        if hidden.requires_grad:
            hidden.register_hook(backward_sleep(n))
    for chunk in model:
        for m in chunk.modules():
            if isinstance(m, TransformerLayer):
                m.register_forward_hook(after_forward)


def _fork_write_queue() -> None:
    """dist_checkpointing's writer gets its results queue from a ``spawn`` Manager, whose
    process re-runs the script's imports (``pretrain_gpt.py``: triton, missing here, which
    :func:`_stub_triton_kernels` stubs in this process only); here it comes from a ``fork``ed
    one."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    def queue():        # its server is shut down at exit (multiprocessing's finalizer, via atexit)
        if fa._results_queue is None:
            fa._results_queue = mp.get_context("fork").Manager().Queue()
        return fa._results_queue
    fa._get_write_results_queue = queue


def _install_hooks() -> None:
    _stub_triton_kernels()
    _stub_rl_utils()
    _fork_write_queue()
    import megatron.training.initialize as mi
    import megatron.training.training as mt

    mi._compile_dependencies = lambda: None     # dataset helpers (prebuilt) and CUDA kernels
    mi._warmup_jit_function = lambda: None      # warms fused bias-gelu/dropout up on "cuda"
    mt.initialize_megatron = functools.partial(mt.initialize_megatron, allow_no_cuda=True)
    get_model = mt.get_model

    def get_model_on_cpu(*a, **k):
        model = get_model(*a, **k)
        if os.environ.get("MLM_CPU_INIT_BY_NAME"):
            _init_by_name(model)
        if os.environ.get("MLM_CPU_SERIAL_P2P"):
            _serial_p2p(model)
        if os.environ.get("MLM_CPU_SLEEP"):
            _sleep_layers(model, float(os.environ["MLM_CPU_SLEEP"]))
        return model
    mt.get_model = get_model_on_cpu
    if os.environ.get("MLM_CPU_REPORT"):
        train = mt.train

        def train_reported(forward_step_func, model, *a, **k):   # the model as it trains
            _report(model, mt.get_forward_backward_func(), os.environ["MLM_CPU_REPORT"])
            return train(forward_step_func, model, *a, **k)
        mt.train = train_reported
    path = os.environ.get("MLM_CPU_LOSSES")
    if path:
        log = mt.training_log

        def training_log(loss_dict, *a, **k):
            if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
                with open(path, "a") as f:
                    f.write(json.dumps({k_: float(v) for k_, v in loss_dict.items()}) + "\n")
            return log(loss_dict, *a, **k)
        mt.training_log = training_log


def _exit_code(e: SystemExit) -> int:
    """The status Python would exit with for ``e`` (a non-int code is printed, status 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _run_script(script: str) -> int:
    """Run ``script`` as ``__main__`` with the hooks; its exit status (the process group is
    gone after it)."""
    from ds_autoplan.runtime.megatron import cpu_shim
    _install_hooks()
    code = 0
    try:
        with cpu_shim(remap_cuda_factories=True):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    from ds_autoplan.runtime.ending import tear_down
    tear_down(barrier=code == 0)    # trained: every rank past its last collective before the group goes
    return code


def _end(code: int) -> None:
    """End the rank once the script is done (trained, or refused with ``SystemExit``):
    :func:`harness.forked.exit_now`, else (a non-daemon thread still runs) a normal exit."""
    exit_now(code)
    sys.exit(code)


RUN_TIMEOUT = 300.0     # a forked run ends in seconds; past this it is killed


def _run_child(run: dict, rank: int, world: int) -> int:
    """One run of :func:`runs`, in a child of the rank: its own process group, then the script."""
    import datetime
    os.environ.update(run["env"])
    sys.argv = list(run["argv"])
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{run['store']}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120))
    code = _run_script(sys.argv[0])
    exit_now(code)
    return code


def runs(job: str) -> None:
    """``--runs JOB.json``: several runs of one script in this launch, each in a forked child
    of this rank after the imports (megatron-core and Megatron-LM's, seconds per rank) are paid
    once.  ``JOB``: a list of ``{"tag", "argv": [script, flags...], "env", "log", "store"}``
    (and ``"refusal": true`` for a run that is meant to end non-zero).
    A run's children (one per rank) form a process group of their own (the file store
    ``store``; Megatron-LM then skips its own ``init_process_group``), write their output to
    ``log`` and see ``env`` added; each rank prints ``MLM_CPU_RUN {"tag", "rank", "exit"}``
    after each run.  The rank exits non-zero if a run failed that is not a refusal: a launch
    with a refusal in it ends 0 when every run did what it should, so its launcher's summary
    ("local rank 0 exited with code 1") names a real failure, not the refusal's status."""
    with open(job) as f:
        todo = json.load(f)
    script = todo[0]["argv"][0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    _stub_cuda()
    _stub_triton_kernels()
    _stub_rl_utils()
    from ds_autoplan.runtime.megatron import cpu_shim
    with cpu_shim(remap_cuda_factories=True):
        runpy.run_path(script, run_name="megatron_lm_cpu_warm")     # its imports, not its main
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    failed = False
    for run in todo:
        code = fork_wait(lambda run=run: _run_child(run, rank, world), run["log"], RUN_TIMEOUT)
        failed |= code != 0 and not run.get("refusal")
        # one write of one line (print writes the text and the newline apart: ranks sharing the
        # launcher's pipe interleaved there, two results on one line)
        sys.stdout.write("MLM_CPU_RUN " + json.dumps({"tag": run["tag"], "rank": rank, "exit": code}) + "\n")
        sys.stdout.flush()
    _end(1 if failed else 0)


def main() -> None:
    if sys.argv[1] == "--runs":
        runs(sys.argv[2])
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    _stub_cuda()
    _end(_run_script(script))


if __name__ == "__main__":
    main()
