"""Execute a lowered schedule for real on CPU: one thread per pipeline rank, compute
replaced by a sleep of its cost-model time (``sleep``: ``time.sleep``, or the benchmarks'
calibrated ``ds_autoplan.models.sleep.sleep``), transfers through per-rank-pair FIFO queues.

This is a multi-rank execution of the per-rank action and send/recv lists (threads in one
process, not processes): a SEND enqueues (non-blocking, like ``isend``), a RECV blocks until
the message arrives and checks that it is the one the plan expected, so a wrong
communication order shows up as a mismatch or a timeout, never as a silent hang.
"""
from __future__ import annotations

import queue
import threading
import time

from ..schedule import Costs, Kind, Schedule, ScheduleError


def run_threads(low: Schedule, costs: Costs, ms_per_unit: float = 1.0, *,
                timeout: float = 60.0, sleep=time.sleep) -> dict:
    """Run ``low`` (a lowered schedule) with one thread per rank; a compute action sleeps
    ``duration · ms_per_unit`` milliseconds with ``sleep``.  Returns wall seconds and per-rank busy seconds;
    raises ScheduleError on a message-order mismatch or a receive timeout."""
    if not low.has_comm() and low.num_ranks > 1 and any(
            low.placement[s] != low.placement[s + 1] for s in range(low.num_stages - 1)):
        raise ScheduleError("run_threads needs a lowered schedule (ds_autoplan.schedule.lower)")
    d = low.num_ranks
    chans = {(a, b): queue.Queue() for a in range(d) for b in range(d) if a != b}
    busy = [0.0] * d
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(r: int):
        try:
            for a in low.ranks[r]:
                if stop.is_set():
                    return
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    key = (Kind.RECV_F, a.stage + 1, a.mb) if a.kind == Kind.SEND_F else \
                        (Kind.RECV_B, a.stage - 1, a.mb)
                    chans[(r, a.peer)].put(key)
                elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                    try:
                        got = chans[(a.peer, r)].get(timeout=timeout)
                    except queue.Empty:
                        raise ScheduleError(f"rank {r}: {a.short()} timed out") from None
                    if got != a.key:
                        raise ScheduleError(f"rank {r}: expected {a.short()}, got "
                                            f"{got[0].value}{got[1]}.{got[2]} (order mismatch)")
                else:
                    dur = float(costs.duration(a.kind, a.stage, a.mb)) * ms_per_unit / 1e3
                    t = time.perf_counter()
                    sleep(dur)
                    busy[r] += time.perf_counter() - t
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(d)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    deadline = t0 + timeout
    while not errors and time.perf_counter() < deadline:  # return at the first error
        alive = [th for th in threads if th.is_alive()]
        if not alive:
            break
        alive[0].join(0.01)
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0] if isinstance(errors[0], ScheduleError) else ScheduleError(str(errors[0]))
    if any(th.is_alive() for th in threads):
        stop.set()
        raise ScheduleError("run_threads: a rank did not finish (deadlock?)")
    return {"wall_s": wall, "busy_s": busy}
