"""The measured timeline of a rank, for ``DS_AUTOPLAN_TRACE=dir``: every compute action's
wall-clock start and end in the first ``DS_AUTOPLAN_TRACE_STEPS`` steps (default 20), written
as ``dir/trace-rank{r}.json`` whenever a step ends and at exit, in the format of
:mod:`ds_autoplan.schedule.trace` (the one ``ds-autoplan simulate --trace`` writes), so
predicted and measured timelines open side by side in Perfetto.

Both adapters time their actions through :class:`~ds_autoplan.runtime.common.memory.ActionMemory`,
which records here when tracing is on; times are seconds since the rank's first action.
"""
from __future__ import annotations

import atexit
import os
import time

from ...outputs import json_text, resolve_folder, write_file
from ...schedule.trace import trace_events
from .collectives import rank

ENV = "DS_AUTOPLAN_TRACE"
STEPS_ENV = "DS_AUTOPLAN_TRACE_STEPS"


class Timeline:
    """Action records of this process (one pipeline rank) in its first ``max_steps`` steps."""

    def __init__(self, folder: str, max_steps: int = 20):
        self.folder = folder
        self.max_steps = max_steps
        self.records: list[dict] = []
        self.t0: float | None = None
        self.rank: int | None = None
        self.step = 0
        self.written = 0               # records in the file already
        self.named = folder            # the DS_AUTOPLAN_TRACE value it was made for

    def record(self, kind, stage: int, mb: int, start: float, end: float) -> None:
        """One compute action's start and end (``clock()`` values) in the current step."""
        if self.step >= self.max_steps:
            return
        if self.t0 is None:
            self.t0, self.rank = start, rank()
        self.records.append({"rank": self.rank, "kind": getattr(kind, "value", kind),
                             "stage": stage, "mb": mb, "start": start - self.t0,
                             "end": end - self.t0, "step": self.step})

    def next_step(self) -> None:
        """An adapter starts another step (steps are numbered from 0 by their first action)."""
        if self.records and self.records[-1]["step"] == self.step:
            self.step += 1
            self.write()

    def path(self) -> str:
        """The file this rank's timeline goes to: ``<folder>/trace-rank<r>.json``."""
        return os.path.join(self.folder, f"trace-rank{self.rank if self.rank is not None else 0}.json")

    def write(self) -> str | None:
        """(Re)write the file if records came since the last write."""
        if len(self.records) == self.written:
            return None
        self.written = len(self.records)
        groups = [(f"measured rank {self.rank}", self.records)]
        return write_file(self.path(), json_text(trace_events(groups), indent=None),
                          what=ENV)


_TIMELINE: Timeline | None = None


def from_env() -> Timeline | None:
    """This process's :class:`Timeline` when ``DS_AUTOPLAN_TRACE`` names a folder (made if
    missing; a path that is not a folder is refused), else None."""
    global _TIMELINE
    from ...env import env_int, env_str
    folder = env_str(ENV)
    if not folder:
        return None
    if _TIMELINE is None or _TIMELINE.named != folder:
        real = resolve_folder(folder, ENV)[0]       # a path that is not a folder: one line
        _TIMELINE = Timeline(real, max_steps=env_int(STEPS_ENV, 20, minimum=0))
        _TIMELINE.named = folder
        atexit.register(flush)
    return _TIMELINE


def flush() -> None:
    """Write this process's timeline now (at exit; ``runtime.launch`` calls it before its
    ``os._exit``, which skips atexit)."""
    if _TIMELINE is not None:
        _TIMELINE.write()


clock = time.perf_counter
