"""Launches a test module starts at set-up and runs in the background, a few ranks at a time.

Most of a multi-rank launch's time on 2 cores is single-process work: the launcher's interpreter
start-ups, rank 0's planning, the exits.  Two launches side by side overlap that with the
other's ranks.  A module's fixture adds its launches in the order its tests read them,
:meth:`Launches.start` runs the ones the session's selected tests name in their ``launches``
marks (``@pytest.mark.launches("name", ...)``, see :func:`wanted`), and each test waits for
its own with :meth:`Launches.result`."""
from __future__ import annotations

import concurrent.futures
import threading


class Launches:
    """Callables (launches) run in background threads in the order added, each as soon as what
    it comes ``after`` has finished, with at most ``ranks`` ranks running at once (first ready,
    first served: a launch that needs more ranks than are free holds back the ones behind it).
    ``result(name)`` waits for one (its exception re-raised)."""

    def __init__(self, ranks: int):
        self.free, self.closed, self.jobs, self.line, self.futures = ranks, False, {}, [], {}
        self.cv = threading.Condition()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)

    def add(self, name, ranks: int, fn, after=()) -> None:
        self.jobs[name] = ranks, fn, list(after)

    def start(self, names) -> None:
        """Run the launches ``names`` and what they come after; the others never run."""
        want = set(names)
        for name in reversed(list(self.jobs)):           # what a wanted launch comes after
            if name in want:
                want.update(self.jobs[name][2])
        for name in [n for n in self.jobs if n in want]:
            ranks, fn, after = self.jobs[name]
            ticket = {"ready": not after}
            self.line.append(ticket)
            self.futures[name] = self.pool.submit(self._run, ticket, ranks, fn, after)

    def _run(self, ticket, ranks, fn, after):
        concurrent.futures.wait([self.futures[d] for d in after])
        with self.cv:
            ticket["ready"] = True
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.closed or (
                next(t for t in self.line if t["ready"]) is ticket and self.free >= ranks))
            if self.closed:
                raise RuntimeError("the module ended before this launch started")
            self.line.remove(ticket)
            self.free -= ranks
        try:
            return fn()
        finally:
            with self.cv:
                self.free += ranks
                self.cv.notify_all()

    def result(self, name):
        return self.futures[name].result()

    def close(self) -> None:
        """Start nothing more; wait for the launches that run."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.pool.shutdown(wait=True)


def wanted(request) -> set:
    """The launch names in the ``launches`` marks of the session's selected tests of the
    requesting fixture's module."""
    return {name for item in request.session.items if item.module is request.module
            for mark in item.iter_markers("launches") for name in mark.args}
