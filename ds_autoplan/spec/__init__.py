"""Model and cluster specifications (presets in configs/, user YAML, Hugging Face config.json)."""
from __future__ import annotations


class SpecError(ValueError):
    """Bad model/cluster/training input: printed as one clear line by the CLI."""


from .cluster import ClusterSpec, load_cluster  # noqa: E402
from .model import LayerSpec, ModelSpec, load_model  # noqa: E402
from .presets import preset_names  # noqa: E402

__all__ = ["ClusterSpec", "LayerSpec", "ModelSpec", "SpecError", "load_cluster", "load_model",
           "preset_names"]
