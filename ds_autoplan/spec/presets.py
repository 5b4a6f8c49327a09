"""Finding and reading YAML presets (configs/models, configs/clusters) and user files."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..env import env_str
from . import SpecError

CONFIG_DIRS = [Path(__file__).resolve().parents[2] / "configs",
               Path(__file__).resolve().parents[1] / "data" / "configs"]


def _dirs(kind: str) -> list[Path]:
    extra = env_str("DS_AUTOPLAN_CONFIGS")
    roots = ([Path(extra)] if extra else []) + CONFIG_DIRS
    return [r / kind for r in roots if (r / kind).is_dir()]


def preset_names(kind: str) -> list[str]:
    """Names of the built-in presets of ``kind`` ('models' or 'clusters')."""
    return sorted({p.stem for d in _dirs(kind) for p in d.glob("*.yaml")})


def read_mapping(path: str | Path) -> dict:
    """A YAML or JSON file as a dict; malformed files raise SpecError."""
    import yaml
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"cannot read {p}: {e.strerror}") from None
    try:
        # libyaml's parser where PyYAML was built with it (same SafeConstructor, ~10x faster)
        data = json.loads(text) if p.suffix == ".json" else \
            yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecError(f"malformed {'JSON' if p.suffix == '.json' else 'YAML'} in {p}: {msg}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{p}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def resolve(name_or_path: str, kind: str) -> tuple[dict, str]:
    """(mapping, source) for a preset name or a file path."""
    if os.path.sep in name_or_path or name_or_path.endswith((".yaml", ".yml", ".json")):
        if not Path(name_or_path).exists():
            raise SpecError(f"{kind[:-1]} file not found: {name_or_path}")
        return read_mapping(name_or_path), name_or_path
    key = name_or_path.lower()
    for d in _dirs(kind):
        p = d / f"{key}.yaml"
        if p.exists():
            return read_mapping(p), str(p)
    raise SpecError(f"unknown {kind[:-1]} preset {name_or_path!r}; choose from "
                    f"{', '.join(preset_names(kind))} or give a file path")


def need(d: dict, key: str, typ, src: str, default=None):
    """A typed field of a spec mapping with one clear message when it is wrong."""
    if key not in d or d[key] is None:
        if default is not None:
            return default
        raise SpecError(f"{src}: missing required field {key!r}")
    v = d[key]
    if typ is int and (isinstance(v, bool) or (isinstance(v, float) and not v.is_integer())):
        raise SpecError(f"{src}: field {key!r} must be an integer, got {v!r}")
    try:
        v = typ(v)
    except (TypeError, ValueError):
        raise SpecError(f"{src}: field {key!r} must be {typ.__name__}, got {d[key]!r}") from None
    if typ in (int, float) and v <= 0:
        raise SpecError(f"{src}: field {key!r} must be positive, got {d[key]!r}")
    return v
