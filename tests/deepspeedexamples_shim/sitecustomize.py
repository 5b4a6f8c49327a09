"""Test-side CPU shim for DeepSpeedExamples' pipeline_parallelism/train.py, on the PYTHONPATH of
its ranks (never an edit of the client): ``torch.cuda.set_device`` is a no-op on CPU ranks;
a rank ends as soon as the script has run to its end (ds_autoplan.runtime.ending.finish);
rank 0 prints every ``train_batch`` loss (``SHIM_LOSS``; DeepSpeed's pipeline engine and
ds_autoplan's plain one), and DeepSpeed's own plain engine every rank's micro-step loss
(``SHIM_MICRO_LOSS rank loss``); with ``SHIM_PARTS`` (layer
boundaries, e.g. "0,10,22") DeepSpeed's own PipelineModule of that many stages uses that partition, so a
reference run can cut the layers where a plan did.  Each line is one write: the launcher runs
its ranks unbuffered (``python -u``), where ``print`` writes the text and its newline apart
and another rank's line could land between them."""
import os
import sys

try:          # tests/ranksite's sitecustomize, which this one shadows: py-cpuinfo asked once
    import cached_cpuinfo  # noqa: F401
except ImportError:
    pass

import torch

torch.cuda.set_device = lambda *a, **k: None


def _line(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _logged(cls):
    train_batch = cls.train_batch

    def logged(self, *a, **k):
        loss = train_batch(self, *a, **k)
        if torch.distributed.get_rank() == 0:
            _line(f"SHIM_LOSS {float(loss):.10e}")
        return loss
    cls.train_batch = logged


def _patch_deepspeed():
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import PipelineModule
    _logged(PipelineEngine)
    try:          # ds_autoplan's plain engine (plans without a pipeline), when it is importable
        from ds_autoplan.runtime.deepspeed.plain import DataParallelEngine
    except ImportError:
        pass
    else:
        _logged(DataParallelEngine)
    # the script's non-pipelined path (-p 0) in DeepSpeed's own engine: every micro-step's loss
    from deepspeed.runtime.engine import DeepSpeedEngine
    backward = DeepSpeedEngine.backward

    def logged_backward(self, loss, *a, **k):
        if type(self) is DeepSpeedEngine:
            _line(f"SHIM_MICRO_LOSS {torch.distributed.get_rank()} {float(loss.detach()):.10e}")
        return backward(self, loss, *a, **k)
    DeepSpeedEngine.backward = logged_backward
    parts = os.environ.get("SHIM_PARTS")
    if parts:
        partition = PipelineModule._partition_layers

        def fixed(self, method="uniform"):
            if type(self) is not PipelineModule or len(parts.split(",")) != self.num_stages + 1:
                return partition(self, method)
            self.parts = [int(x) for x in parts.split(",")]
            self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])
        PipelineModule._partition_layers = fixed


def _exit_after_script():
    """``runpy.run_path`` (how the bootstrap runs the script) ends the rank when the script
    returns (ds_autoplan.runtime.ending.finish); one that raises goes on as before (a
    refusal's message and exit status 2)."""
    import runpy
    run_path = runpy.run_path

    def run(*a, **k):
        result = run_path(*a, **k)
        from ds_autoplan.runtime.ending import finish
        finish(0)           # every rank done: a barrier, the group torn down, no interpreter teardown
        return result
    runpy.run_path = run


if "RANK" in os.environ:          # the ranks, not the launcher
    _patch_deepspeed()
    if "SHIM_RUNS" not in os.environ:          # shim_runs.py runs the script several times
        _exit_after_script()
