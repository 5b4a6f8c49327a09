"""Real sequence-length distribution for variable-length training data.

The shipped file ``ds_autoplan/data/text_lengths.tsv`` holds token counts of real text
that is available offline on any Debian/Ubuntu machine with CPython 3.11, arranged as
instruction-style (prompt, response) pairs from three "tasks":

* ``deb``   -- Debian package descriptions in ``/var/lib/dpkg/status``: prompt = package
  name + synopsis line, response = the extended description.
* ``topic`` -- Python's own documentation topics (``pydoc_data.topics``, the text of
  ``help('if')`` etc.): prompt = topic name, response = topic text.
* ``doc``   -- docstrings of public functions/classes in a fixed list of standard-library
  modules: prompt = qualified name + signature, response = docstring.

Tokeniser: a simple BPE stand-in, ``re.findall(r"\\w{1,6}|[^\\w\\s]")`` (words are cut into
pieces of at most 6 characters, every punctuation character is one token), which gives
about 1.2 tokens per English word like a GPT-2 BPE does.

Regenerate with ``python -m ds_autoplan.dynamic.lengths [--out PATH]``; the header of the
file records the interpreter version and the counts per source.  ``load_lengths`` reads it
and ``LengthSampler`` draws global batches from it (decoder-only: prompt+response, clipped
to ``max_len``; encoder-decoder: the pair).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import warnings
from dataclasses import dataclass

import numpy as np

DATA_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "text_lengths.tsv")
DPKG_STATUS = "/var/lib/dpkg/status"
DOC_MODULES = ("builtins", "os", "os.path", "sys", "re", "json", "collections", "itertools",
               "functools", "string", "textwrap", "pathlib", "argparse", "logging", "subprocess",
               "threading", "shutil", "tempfile", "datetime", "math", "statistics", "random",
               "heapq", "bisect", "csv", "io", "struct", "socket", "typing", "dataclasses",
               "enum", "contextlib", "inspect", "unittest", "email", "http.client", "urllib.parse",
               "xml.etree.ElementTree", "sqlite3", "zipfile", "tarfile", "gzip", "hashlib",
               "base64", "pickle", "copy", "pprint", "operator", "decimal", "fractions")
_TOKEN = re.compile(r"\w{1,6}|[^\w\s]")


def count_tokens(text: str) -> int:
    """Token count under the simple tokeniser described in the module docstring."""
    return len(_TOKEN.findall(text))


def _debian(path: str = DPKG_STATUS) -> list[tuple[int, int]]:
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return out
    for para in text.split("\n\n"):
        name = re.search(r"^Package: (.*)$", para, re.M)
        desc = re.search(r"^Description: (.*)\n((?: .*\n?)*)", para, re.M)
        if not (name and desc):
            continue
        body = "\n".join(ln[1:] for ln in desc.group(2).splitlines() if ln.strip() != ".")
        out.append((count_tokens(name.group(1) + " " + desc.group(1)), count_tokens(body)))
    return out


def _topics() -> list[tuple[int, int]]:
    from pydoc_data.topics import topics
    return [(count_tokens(k), count_tokens(v)) for k, v in sorted(topics.items())]


def _docstrings() -> list[tuple[int, int]]:
    out, seen = [], set()
    for modname in DOC_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:  # pragma: no cover - minimal interpreters
            continue
        for name in sorted(dir(mod)):
            if name.startswith("_"):
                continue
            with warnings.catch_warnings():  # deprecated aliases (typing.io) warn on access
                warnings.simplefilter("ignore")
                obj = getattr(mod, name, None)
                doc = inspect.getdoc(obj) if callable(obj) else None
            if not doc or id(obj) in seen:
                continue
            seen.add(id(obj))
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "()"
            out.append((count_tokens(f"{modname}.{name}{sig}"), count_tokens(doc)))
    return out


def generate(out_path: str = DATA_FILE) -> dict:
    """Measure the three sources and write the TSV; return counts per source."""
    rows = [("deb", p, r) for p, r in _debian()]
    rows += [("topic", p, r) for p, r in _topics()]
    rows += [("doc", p, r) for p, r in _docstrings()]
    rows = [x for x in rows if x[2] > 0]
    counts = {s: sum(1 for x in rows if x[0] == s) for s in ("deb", "topic", "doc")}
    from ..outputs import text, write_file
    lines = ["# token lengths of real offline text; regenerate: python -m ds_autoplan.dynamic.lengths",
             f"# python {sys.version.split()[0]}; tokeniser \\w{{1,6}}|[^\\w\\s]; sources "
             + ", ".join(f"{k}={v}" for k, v in counts.items()),
             "source\tprompt\tresponse", *(f"{s}\t{p}\t{r}" for s, p, r in rows)]
    write_file(out_path, text("\n".join(lines) + "\n"), what="--out")
    return counts


@dataclass(frozen=True)
class LengthTable:
    source: np.ndarray    # str per sample
    prompt: np.ndarray    # int
    response: np.ndarray  # int

    def __len__(self) -> int:
        return len(self.prompt)


def load_lengths(path: str = DATA_FILE) -> LengthTable:
    src, p, r = [], [], []
    with open(path) as fh:
        for ln in fh:
            if ln.startswith("#") or ln.startswith("source"):
                continue
            a, b, c = ln.split()
            src.append(a), p.append(int(b)), r.append(int(c))
    return LengthTable(np.array(src), np.array(p, dtype=np.int64), np.array(r, dtype=np.int64))


class LengthSampler:
    """Draws sequence lengths from the measured table (with replacement).

    ``kind='decoder'``: one length per sample, prompt + response (+1 separator), clipped to
    ``max_len``.  ``kind='encdec'``: an ``[N, 2]`` array (encoder = prompt, decoder =
    response), each clipped to ``max_len``.
    """

    def __init__(self, kind: str = "decoder", max_len: int = 4096, seed: int = 0,
                 path: str = DATA_FILE):
        if kind not in ("decoder", "encdec"):
            raise ValueError("kind must be 'decoder' or 'encdec'")
        self.kind, self.max_len = kind, int(max_len)
        self.table = load_lengths(path)
        self.rng = np.random.default_rng(seed)

    def __call__(self, n: int) -> np.ndarray:
        idx = self.rng.integers(0, len(self.table), size=n)
        p, r = self.table.prompt[idx], self.table.response[idx]
        if self.kind == "decoder":
            return np.minimum(p + r + 1, self.max_len)
        return np.stack([np.minimum(p, self.max_len), np.minimum(r, self.max_len)], axis=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DATA_FILE)
    args = ap.parse_args(argv)
    counts = generate(args.out)
    tab = load_lengths(args.out)
    tot = tab.prompt + tab.response
    print(f"wrote {args.out}: {counts}; total length percentiles 10/50/90/99/max = "
          f"{np.percentile(tot, [10, 50, 90, 99]).astype(int).tolist()} {int(tot.max())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
