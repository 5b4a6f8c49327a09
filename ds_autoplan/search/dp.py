"""Galvatron's per-stage dynamic programme (docs/planner.md §3) and the pipeline cost
of a full plan (Eq. 9), vectorised with numpy and memoised on stage prefixes."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..cost.model import CostModel, LayerTables
from ..spec.cluster import GB

INF = float("inf")


@dataclass
class StagePlan:
    """One stage's DP answer: a strategy index per unit and its Eq. 2 peak bytes."""
    strategies: list      # strategy index per unit of the stage
    E_all: float          # Eq. 2 peak bytes


class Context:
    """Everything fixed for one (pp, m, B_m, strategy set): tables, discretised weights,
    DP prefix cache.  ``seq`` is the unit sequence pre, blocks..., post (type ids)."""

    def __init__(self, cm: CostModel, strategies: list, pp: int, m: int, B_m: int, budget: float,
                 units: int = 512, paper_mode: bool = False):
        self.cm, self.pp, self.m, self.B_m, self.E = cm, pp, m, B_m, float(budget)
        self.tab: LayerTables = cm.tables(strategies, B_m)
        self.S = len(strategies)
        self.strategies = strategies
        self.g = max(2.0 ** 20, self.E / units)          # memory unit (§6 #4)
        self.units = int(self.E // self.g)
        # what a stage's Eq. 2 peak may reach: the budget less the cluster's calibrated device
        # memory above the model (spec/cluster.py), which every reported peak includes
        self.fit = self.E - cm.cluster.memory_overhead_gb * GB
        self.paper_mode = paper_mode
        t = self.tab
        bad = ~t.allowed
        # DP objective per layer: c + (m-1) c_ns (§3.1, §6 #25); R counted m times
        self.cost = np.where(bad, INF, t.c + (m - 1) * t.c_ns)
        self.Rm = m * t.R
        self.seq = np.concatenate([[0], cm.block_types, [1]])
        self._types = tuple(int(x) for x in self.seq)
        self._w: dict[int, np.ndarray] = {}
        self._r_zero = ~np.any(self.Rm != 0, axis=(1, 2))
        self._shifts: dict = {}
        self._prefix: dict = {}
        self._solved: dict = {}
        self._stage_memo: dict = {}
        self._ck_memo: dict = {}
        self._arrays: dict = {}
        self._staged: dict = {}
        self._figs_memo: dict = {}      # pipeline.stage_figures: per (plans, stage bounds)
        # per (objective, plan): the split matrices' terms per stage shape (partition.py),
        # shared with the contexts of these tables over other stage counts
        self.split_terms: dict = {}

    def staged(self, S: int) -> "Context":
        """The context of the same strategies, micro-batches and budget split into ``S``
        pipeline stages (a schedule's stage count), memoised, so its stage figures and split
        matrices serve every costing of that schedule."""
        if S not in self._staged:
            sub = self._staged[S] = Context(self.cm, self.strategies, S, self.m, self.B_m, self.E, self.units)
            sub.split_terms = self.split_terms
        return self._staged[S]

    @cached_property
    def _classes(self):
        """Strategies sharing a layout (TP, data degree, level order) re-lay out to each
        other for free and alike to the rest (§2.5), so the DP's min over s' runs per class:
        (class of each strategy, the members of each class as the rows of a [class, member]
        index array padded with S (an INF row) where the classes differ in size, R between
        classes), or None where R is not per layout (a plain S x S min)."""
        keys = [(s.tp, s.dp, s.tp_outer) for s in self.strategies]
        uniq = list(dict.fromkeys(keys))
        cls = np.array([uniq.index(k) for k in keys])
        members = [np.flatnonzero(cls == c) for c in range(len(uniq))]
        rep = np.array([m[0] for m in members])
        Rc = self.Rm[:, rep][:, :, rep]
        if not np.array_equal(Rc[:, cls][:, :, cls], self.Rm):
            return None
        rows = np.full((len(members), max(len(m) for m in members)), self.S)
        for c, m in enumerate(members):
            rows[c, :len(m)] = m
        return cls, rows, Rc

    def _columns(self, t: int) -> np.ndarray:
        """Row of :meth:`_relayout_min`'s matrices that serves each strategy, for type t."""
        if self._r_zero[t]:
            return np.zeros(self.S, dtype=np.int64)
        return np.arange(self.S) if self._classes is None else self._classes[0]

    def _relayout_min(self, Dp: np.ndarray, t: int):
        """M[k, e] = min_s' D[s', e] + m R(s', s) and its first argmin s', for the strategies
        s of row k = ``_columns(t)[s]``: one row when R(t) is zero, one per layout class
        when R is per class (the first class that attains it, then its first member that
        attains the class's min), else one per strategy."""
        if self._r_zero[t]:
            M, arg = _min_first(Dp, 0)
            return M[None], arg[None]
        if self._classes is None:
            return _min_first(Dp[:, None, :] + self.Rm[t][:, :, None], 0)
        _, rows, Rc = self._classes
        if rows.shape[0] * rows.shape[1] > self.S:          # padded: index S is a row of INF
            Dp = np.concatenate([Dp, np.full((1, Dp.shape[1]), INF)])
        Dc, k = _min_first(Dp[rows], 1)                                     # [class, member, e]
        M, arg = _min_first(Dc[:, None, :] + Rc[t][:, :, None], 0)         # [source class, class, e]
        best = rows[np.arange(len(rows))[:, None], k]                       # [class, e]
        return M, best[arg, np.arange(Dp.shape[1])]

    def w(self, K: int) -> np.ndarray:
        """Discretised forward-memory weight per (type, strategy): K*O_f1 + O_ms (Eq. 3),
        rounded to the nearest unit; the exact Eq. 2 check follows on the plan."""
        if K not in self._w:
            t = self.tab
            raw = np.rint((K * t.f1 + t.ms) / self.g)
            raw[~t.allowed] = self.units + 1
            self._w[K] = np.minimum(raw, self.units + 1).astype(np.int64)
        return self._w[K]

    def _shift(self, K: int, t: int) -> np.ndarray:
        """Flat index, per (s, e), of entry (row of s, e - w(t, s)) in the column-padded
        :meth:`_relayout_min` matrix; the padding column (INF) where e - w(t, s) < 0."""
        key = (K, t)
        if key not in self._shifts:
            E1 = self.units + 1
            idx = np.arange(E1)[None, :] - self.w(K)[t][:, None]
            self._shifts[key] = np.where(idx >= 0, idx, E1) + self._columns(t)[:, None] * (E1 + 1)
        return self._shifts[key]

    # -- §3.3 recurrence over a stage's unit types, cached by prefix --------------------
    def _table(self, rle: tuple, K: int):
        """D[s, e] (least cost ending in strategy s within e memory units) and back-pointers
        for a unit sequence given run-length encoded, ((type, count), ...): identical layers
        share prefixes, so uniform models hit the cache almost always."""
        key = (K, rle)
        hit = self._prefix.get(key)
        if hit is not None:
            return hit
        E1 = self.units + 1
        t, c = rle[-1]
        if len(rle) == 1 and c == 1:
            e = np.arange(E1)[None, :]
            D = np.where(e >= self.w(K)[t][:, None], self.cost[t][:, None], INF)
            res = (D, ())
        else:
            prev = rle[:-1] + (((t, c - 1),) if c > 1 else ())
            Dp, args = self._table(prev, K)
            Mk, arg = self._relayout_min(Dp, t)          # M[s, e] = Mk[row of s, e]
            M = np.empty((Mk.shape[0], E1 + 1))
            M[:, :E1] = Mk
            M[:, E1] = INF
            D = M.ravel().take(self._shift(K, t))
            D += self.cost[t][:, None]
            res = (D, args + ((arg.astype(np.int16), self._columns(t)),))
        if self.pp > 1:     # one stage: one unit sequence, no prefix is met again (each D: S x E1)
            self._prefix[key] = res
        return res

    def _backtrack(self, types: tuple, K: int, args, e: int, s: int) -> list:
        w = self.w(K)
        plan = [s]
        for j in range(len(types) - 1, 0, -1):
            e -= int(w[types[j], s])
            arg, rows = args[j - 1]
            s = int(arg[rows[s], e])
            plan.append(s)
        return plan[::-1]

    def e_all(self, types, plan, K: int) -> float:
        """Stage peak, Eq. 2 generalised with K in-flight micro-batches (§2.2)."""
        t = self.tab
        f1 = t.f1[list(types), plan]
        ob = t.ob[list(types), plan]
        ms = t.ms[list(types), plan]
        return float((K - 1) * f1.sum() + np.max(np.cumsum(f1) + ob) + ms.sum())

    def solve(self, types: tuple, K: int) -> StagePlan | None:
        """Fastest per-layer strategies of one stage under the budget (Algorithm 3 with
        the full-window scan, §3.4)."""
        key = (K, types)
        if key in self._solved:
            return self._solved[key]
        if self._two_level or self.S == 1:
            out = self._solve_ckpt_count(types, K) if self.S == 2 else self._solve_single(types, K)
            self._solved[key] = out
            return out
        D, args = self._table(tuple((k, len(list(g))) for k, g in itertools.groupby(types)), K)
        t = self.tab
        b_up = float(np.max(np.where(t.allowed[list(types)], t.ob[list(types)], 0.0)))
        lo = max(0, self.units - math.ceil(b_up / self.g) - 1)
        out = None
        # the whole window (E - b_up, E], then geometric steps below it: with rounded
        # weights a plan's true E_f can exceed e*g slightly, so validity is re-checked
        es = list(range(self.units, lo - 1, -1))
        step = 2
        while es[-1] - step >= 0:
            es.append(es[-1] - step)
            step *= 2
        for e in es:
            s = int(np.argmin(D[:, e]))
            if not np.isfinite(D[s, e]):
                break
            plan = self._backtrack(types, K, args, e, s)
            ea = self.e_all(types, plan, K)
            if ea <= self.fit:
                out = StagePlan(plan, ea)
                break
            if self.paper_mode:
                break
        self._solved[key] = out
        return out

    @cached_property
    def _two_level(self) -> bool:
        """An executable strategy set: one layout without and with CKPT (no re-layout)."""
        st = self.strategies
        return len(st) == 2 and not st[0].ckpt and st[1] == st[0]._replace(ckpt=True) and self._r_zero.all()

    def _solve_single(self, types: tuple, K: int) -> StagePlan | None:
        """The DP's answer for one strategy in closed form: its only plan, where the rounded
        weights fit the memory units (the table is finite at e = units) and the exact Eq. 2
        peak the budget (a smaller e gives the same plan and peak)."""
        ty = list(types)
        if int(self.w(K)[ty, 0].sum()) > self.units or not np.isfinite(self.cost[ty, 0]).all():
            return None
        plan = [0] * len(ty)
        ea = self.e_all(types, plan, K)
        return StagePlan(plan, ea) if ea <= self.fit else None

    def _solve_ckpt_count(self, types: tuple, K: int) -> StagePlan | None:
        """The DP's answer for the two-level set in closed form: the first k checkpointable
        units recomputed (Megatron's 'block' order keeps the running peak lowest), all k at
        once with exact Eq. 2 peaks; the cheapest k that fits."""
        sel, f1, run, ms, cost = self._ckpt_terms(types)
        peak = (K - 1) * f1 + run + ms
        total = np.where(peak <= self.fit, cost, INF)
        i = int(np.argmin(total))
        if not np.isfinite(total[i]):
            return None
        return StagePlan([int(x) for x in sel[i]], float(peak[i]))

    def _ckpt_terms(self, types: tuple) -> tuple:
        """Per count k of recomputed units (rows): which units, and the Eq. 2 terms that do
        not depend on the in-flight micro-batches K (f1 sum, running peak, model states) and
        the cost, memoised per unit types (stages of a split that hold the same units differ
        in K alone)."""
        if types not in self._ck_memo:
            t = self.tab
            ty = np.asarray(types)
            ck = t.allowed[ty, 1]
            rank = np.cumsum(ck) - 1                               # order among checkpointable units
            k = np.arange(int(ck.sum()) + 1)[:, None]
            sel = ck[None, :] & (rank[None, :] < k)                # [k, unit]: recomputed
            pick = lambda a: np.where(sel, a[ty, 1][None, :], a[ty, 0][None, :])   # noqa: E731
            f1, ob, ms, cost = pick(t.f1), pick(t.ob), pick(t.ms), pick(self.cost)
            self._ck_memo[types] = (sel, f1.sum(1), (np.cumsum(f1, 1) + ob).max(1), ms.sum(1), cost.sum(1))
        return self._ck_memo[types]

    # -- whole pipeline ----------------------------------------------------------------
    def stage_types(self, parts: tuple) -> list[tuple]:
        """Unit-type tuples of each stage for block counts ``parts`` (pre on the first stage,
        post on the last)."""
        out, a = [], 1
        for i, n in enumerate(parts):
            lo = 0 if i == 0 else a
            hi = a + n + (1 if i == len(parts) - 1 else 0)
            out.append(self._types[lo:hi])
            a += n
        return out

    def K(self, i: int) -> int:
        """In-flight micro-batches of stage ``i`` under 1F1B: ``min(pp - i, m)``."""
        return min(self.pp - i, self.m)            # 1F1B in-flight micro-batches (§6 #2)

    def search(self, parts: tuple):
        """Galvatron_Search: per-stage DP for a fixed partition; returns (T_iter, plan)."""
        plan = []
        for i, types in enumerate(self.stage_types(parts)):
            sp = self.solve(types, self.K(i))
            if sp is None:
                return INF, None
            plan += sp.strategies
        return self.pipeline_time(parts, plan), plan

    def layer_arrays(self, plan: list):
        """Per-unit arrays (seq order) of the given full-model plan, memoised (read only: the
        splits, stage costs and figures of one plan share them)."""
        key = tuple(plan)
        if key not in self._arrays:
            self._arrays[key] = self._layer_arrays(plan)
        return self._arrays[key]

    def _layer_arrays(self, plan: list):
        t, seq = self.tab, self.seq
        p = np.asarray(plan)
        R = np.zeros(len(seq))
        R[1:] = t.R[seq[1:], p[:-1], p[1:]]
        return dict(c=t.c[seq, p] + R, cns=t.c_ns[seq, p] + R, f1=t.f1[seq, p], ob=t.ob[seq, p],
                    ms=t.ms[seq, p], p2p=t.p2p[seq, p], fwd=t.fwd[seq, p], bwd_ns=t.bwd_ns[seq, p],
                    wgrad=t.wgrad[seq, p], sync=(t.bwd - t.bwd_ns)[seq, p], kept=t.kept[seq, p], R=R)

    def bounds(self, parts: tuple) -> list[tuple[int, int]]:
        """[lo, hi) unit ranges of the stages."""
        out, a = [], 1
        for i, n in enumerate(parts):
            lo = 0 if i == 0 else a
            hi = a + n + (1 if i == len(parts) - 1 else 0)
            out.append((lo, hi))
            a += n
        return out

    def stage_costs(self, parts: tuple, plan: list):
        """(C, C_ns, E_all) per stage (§2.6; P2P on non-final stages, §6 #16), memoised (BMW
        and its adjustment re-cost the same split and plan)."""
        key = (tuple(parts), tuple(plan))
        if key not in self._stage_memo:
            self._stage_memo[key] = self._stage_costs(parts, plan)
        return self._stage_memo[key]

    def _stage_costs(self, parts: tuple, plan: list):
        A = self.layer_arrays(plan)
        C, Cns, Mem = [], [], []
        cl = self.cm.cluster
        # the calibrated fixed costs (spec/cluster.py): an F and a B per stage and micro-batch,
        # device memory above the model (the iteration's own: once, in pipeline_time)
        act, mem = 2 * cl.action_overhead_us * 1e-6, cl.memory_overhead_gb * GB
        for i, (lo, hi) in enumerate(self.bounds(parts)):
            p2p = 2 * A["p2p"][hi - 1] if i < len(parts) - 1 else 0.0
            C.append(A["c"][lo:hi].sum() + p2p + act)
            Cns.append(A["cns"][lo:hi].sum() + p2p + act)
            f1, ob = A["f1"][lo:hi], A["ob"][lo:hi]
            out = A["kept"][hi - 1] if i < len(parts) - 1 else 0.0     # the stage output kept
            Mem.append((self.K(i) - 1) * f1.sum() + np.max(np.cumsum(f1) + ob) + A["ms"][lo:hi].sum()
                       + self.K(i) * out + mem)
        return np.array(C), np.array(Cns), np.array(Mem)

    def pipeline_time(self, parts: tuple, plan: list) -> float:
        """Eq. 9: T = (m-1) max_i C_ns(M_i) + sum_i C(M_i), plus the calibrated per-iteration
        overhead once (spec/cluster.py)."""
        C, Cns, _ = self.stage_costs(parts, plan)
        return float((self.m - 1) * Cns.max() + C.sum()) + self.cm.cluster.step_overhead_ms * 1e-3


def _min_first(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """``x.min(axis)`` and the first index along ``axis`` that attains it: numpy's argmin
    (for arrays without NaN) without its slow scan along a leading axis."""
    m = x.min(axis=axis)
    return m, (x == np.expand_dims(m, axis)).argmax(axis=axis)
