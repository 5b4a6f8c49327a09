"""Finding and reading YAML presets (configs/models, configs/clusters) and user files."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from ..env import env_str
from . import SpecError

CONFIG_DIRS = [Path(__file__).resolve().parents[2] / "configs",
               Path(__file__).resolve().parents[1] / "data" / "configs"]


def _dirs(kind: str) -> list[Path]:
    extra = env_str("DS_AUTOPLAN_CONFIGS")
    roots = ([Path(extra)] if extra else []) + CONFIG_DIRS
    return [r / kind for r in roots if (r / kind).is_dir()]


# a preset file whose name ends in -N stands for a family of presets: ``cpu-N.yaml`` answers
# ``cpu-1``, ``cpu-2``, ``cpu-16``, ... with ``name`` and ``gpus_per_node`` set from the name
_FAMILY = re.compile(r"(.+)-([0-9]+)")


def preset_names(kind: str) -> list[str]:
    """Names of the built-in presets of ``kind`` ('models' or 'clusters'); a family of presets
    is listed by its file's name (``cpu-N``)."""
    return sorted({p.stem for d in _dirs(kind) for p in d.glob("*.yaml")})


def preset_files(kind: str) -> dict[str, Path]:
    """Preset name -> its file (the first of the preset folders that has it)."""
    out: dict[str, Path] = {}
    for d in _dirs(kind):
        for p in sorted(d.glob("*.yaml")):
            out.setdefault(p.stem, p)
    return dict(sorted(out.items()))


# a full stop before a capital, not after "al" (et al.) or an initial
_SENTENCE_END = re.compile(r"(?<!\bal)(?<!\b[A-Z])\.\s+(?=[A-Z])")


def preset_description(path: Path) -> str:
    """What a preset is: the first sentence of its leading comment."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return _SENTENCE_END.split(" ".join(lines), maxsplit=1)[0].rstrip(".")


def read_mapping(path: str | Path) -> dict:
    """A YAML or JSON file as a dict; malformed files raise SpecError."""
    import yaml
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"cannot read {p}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{p}: not a text file (not UTF-8): expected YAML or JSON") from None
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
    if key.endswith("-n") and any((d / f"{key[:-1]}N.yaml").exists() for d in _dirs(kind)):
        raise SpecError(f"{name_or_path}: N is the number of devices, e.g. {key[:-1]}2")
    fam = _FAMILY.fullmatch(key)
    for d in _dirs(kind) if fam and int(fam[2]) > 0 else []:
        p = d / f"{fam[1]}-N.yaml"
        if p.exists():
            return {**read_mapping(p), "name": key, "gpus_per_node": int(fam[2])}, str(p)
    raise SpecError(f"unknown {kind[:-1]} preset {name_or_path!r}; choose from "
                    f"{', '.join(preset_names(kind))} or give a file path")


def field_name(d: dict, key: str) -> str:
    """The user's name for field ``key`` of a spec mapping: a Hugging Face config.json's own
    key (``vocab`` is its ``vocab_size``; spec/hf.py records them as ``source_keys``)."""
    keys = d.get("source_keys")
    return keys.get(key, key) if isinstance(keys, dict) else key


def need(d: dict, key: str, typ, src: str, default=None):
    """A typed field of a spec mapping with one clear message when it is wrong."""
    name = field_name(d, key)
    if key not in d or d[key] is None:
        if default is not None:
            return default
        raise SpecError(f"{src}: missing required field {name!r}")
    v = d[key]
    if typ in (int, float) and isinstance(v, str):      # "32": a quoted number is a typo
        raise SpecError(f"{src}: field {name!r} must be a number, got the string {v!r}")
    if typ is int and (isinstance(v, bool) or (isinstance(v, float) and not v.is_integer())):
        raise SpecError(f"{src}: field {name!r} must be an integer, got {v!r}")
    try:
        v = typ(v)
    except (TypeError, ValueError):
        raise SpecError(f"{src}: field {name!r} must be {typ.__name__}, got {d[key]!r}") from None
    if typ in (int, float) and not (v > 0 and math.isfinite(v)):
        raise SpecError(f"{src}: field {name!r} must be a finite positive number, got {d[key]!r}")
    return v
