"""DeepSpeed adapter: run any ds_autoplan schedule in ``PipelineEngine``.

``initialize`` is the entry point; ``AutoplanEngine`` / ``AutoplanPipelineModule`` are the
engine and module it installs.  Imports are lazy so that importing the package needs no
DeepSpeed."""

__all__ = ["initialize", "build_module", "AutoplanEngine", "AutoplanPipelineModule",
           "load_checkpoint", "save_checkpoint"]


def __getattr__(name):
    if name in ("initialize", "build_module", "as_plan", "config_from_plan"):
        from . import api
        return getattr(api, name)
    if name in ("AutoplanEngine", "PipelineRankError"):
        from . import engine
        return getattr(engine, name)
    if name in ("save_checkpoint", "load_checkpoint"):
        from . import checkpoint
        return getattr(checkpoint, name)
    if name == "AutoplanPipelineModule":
        from .module import AutoplanPipelineModule
        return AutoplanPipelineModule
    raise AttributeError(name)
