"""runtime.common.posting_order: the order a gloo runtime posts a lowered list in (sends
first in each group of transfers, receives one or two compute actions early) keeps every
rank's compute order and each (peer, direction)'s message order, leaves a RECV_B after the
F it serves, and still finishes in the simulator's non-blocking model; the runtimes' tests
(test_runtime_deepspeed, test_runtime_megatron, ...) run it against unpipelined losses."""
from __future__ import annotations

import pytest

from ds_autoplan.runtime.common import deadlock_free, posting_order
from ds_autoplan.schedule import Kind, build, lower, names

SENDS = (Kind.SEND_F, Kind.SEND_B)


def _cases():
    out = []
    for nm in names():
        for d, n in ((2, 4), (4, 8), (4, 12)):
            try:
                out.append((nm, d, n, lower(build(nm, d, n))))
            except Exception:       # a builder that needs other shapes or options
                continue
    return out


CASES = _cases()


def test_every_builder_is_covered():
    assert {c[0] for c in CASES} >= {"1f1b", "gpipe", "interleaved", "zb-h1", "v-zb", "v-half",
                                     "v-min"}


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("nm,d,n,low", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
def test_order_keeps_what_the_peers_rely_on(nm, d, n, low, early):
    lists = []
    for acts in low.ranks:
        got = posting_order(acts, early=early)
        assert sorted(map(repr, got)) == sorted(map(repr, acts))
        assert [a for a in got if a.kind.is_compute] == [a for a in acts if a.kind.is_compute]
        for pick in (lambda a: a.kind in SENDS, lambda a: a.kind.is_comm and a.kind not in SENDS):
            for peer in {a.peer for a in acts if a.kind.is_comm}:
                sel = [a for a in acts if pick(a) and a.peer == peer]
                assert [a for a in got if pick(a) and a.peer == peer] == sel
        pos = {(a.kind, a.stage, a.mb): i for i, a in enumerate(got)}
        for i, a in enumerate(got):
            if a.kind == Kind.RECV_B and (Kind.F, a.stage, a.mb) in pos:
                assert pos[(Kind.F, a.stage, a.mb)] < i, a
            if a.kind == Kind.SEND_F:      # a send still follows the action it sends from
                assert pos[(Kind.F, a.stage, a.mb)] < i
        # sends before receives in every group between two compute actions
        group = []
        for a in got + [None]:
            if a is not None and a.kind.is_comm:
                group.append(a.kind in SENDS)
                continue
            assert group == sorted(group, reverse=True)
            group = []
        lists.append(got)
    deadlock_free(low.replace_lists(lists, lowered=True), "posting_order")


def test_early_receives_move_up_one_or_two_compute_actions():
    acts = lower(build("1f1b", 4, 8)).ranks[3]
    got = posting_order(acts, early=True)

    def computes_before(lst, a):
        i = lst.index(a)
        return sum(x.kind.is_compute for x in lst[:i])
    ups = [computes_before(acts, a) - computes_before(got, a) for a in acts if a.kind == Kind.RECV_F]
    assert set(ups) <= {0, 1, 2} and max(ups) == 2
    # the last stage of 1F1B: each receive goes out with the send of the previous backward
    i = got.index(next(a for a in got if a.kind == Kind.RECV_F and a.mb == 3))
    assert (got[i - 1].kind, got[i - 1].mb) == (Kind.SEND_B, 1)
