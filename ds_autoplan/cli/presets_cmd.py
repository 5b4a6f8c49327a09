"""`ds-autoplan presets`: the built-in models and clusters that --model and --cluster take by
name, and the Hugging Face config.json files shipped with ds_autoplan."""
from __future__ import annotations

import json
import os
import shutil
import textwrap


def add_parser(sub) -> None:
    from . import doc_description
    p = sub.add_parser("presets", help="list the built-in models and clusters (--model, --cluster)",
                       description=doc_description(__doc__))
    p.add_argument("--json", action="store_true",
                   help="print {\"models\": {name: description}, \"clusters\": ..., \"hf\": ...}")
    p.set_defaults(func=run)


def _shown(path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def listing() -> dict[str, dict[str, str]]:
    """{"models", "clusters", "hf"}: name (HF: the config.json's path) -> one line saying what
    it is (the sizes from the preset itself, then its comment)."""
    from ..spec.presets import CONFIG_DIRS, preset_description, preset_files, read_mapping
    out: dict[str, dict[str, str]] = {"models": {}, "clusters": {}, "hf": {}}
    for name, path in preset_files("models").items():
        d = read_mapping(path)
        sizes = f"{d.get('arch', 'gpt')}, {d.get('num_layers')} layers, hidden {d.get('hidden')}"
        out["models"][name] = "; ".join(x for x in (sizes, preset_description(path)) if x)
    for name, path in preset_files("clusters").items():
        d = read_mapping(path)
        n = "N" if name.endswith("-N") else d.get("gpus_per_node")
        sizes = (f"{d.get('num_nodes', 1)} x {n} {d.get('gpu') or 'devices'}, "
                 f"{d.get('memory_gb')} GB each")
        out["clusters"][name] = "; ".join(x for x in (sizes, preset_description(path)) if x)
    seen = set()
    for root in CONFIG_DIRS:
        for path in sorted((root / "hf").glob("*/config.json")):
            if path.parent.name not in seen:
                seen.add(path.parent.name)
                out["hf"][_shown(str(path))] = str(json.loads(path.read_text()).get("model_type", ""))
    return out


def run(args) -> int:
    lists = listing()
    if args.json:
        print(json.dumps(lists, indent=2))
        return 0
    for title, key in (("models (--model NAME)", "models"), ("clusters (--cluster NAME)", "clusters"),
                       ("Hugging Face configs shipped (--model PATH)", "hf")):
        print(f"{title}:")
        width = max(map(len, lists[key]), default=0) + 4
        cols = max(60, min(shutil.get_terminal_size().columns, 120))
        for name, what in lists[key].items():
            print(textwrap.fill(what, cols, initial_indent=f"  {name:<{width - 2}}",
                                subsequent_indent=" " * width, break_on_hyphens=False))
    print("--model also takes a model YAML or any Hugging Face config.json; --cluster a cluster "
          "YAML (docs: README.md)")
    return 0
