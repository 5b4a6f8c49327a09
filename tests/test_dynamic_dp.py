"""DynaPipe micro-batch construction: the DP against brute force, the baselines,
the cost model and the shipped length distribution."""
import json

import numpy as np
import pytest

from ds_autoplan.dynamic.cost import CostModel, pad_len
from ds_autoplan.dynamic.lengths import LengthSampler, generate, load_lengths
from ds_autoplan.dynamic.microbatch import (dynapipe_split, fixed_split, packing_split,
                                            sample_order, split, token_split)

WORKED = [1000, 950, 620, 600, 580, 300, 280, 260, 250, 120, 110, 100, 64, 60, 40, 32]
# docs/schedules.md §5.4: t(M) = 1 + |M|·(0.002·L + 4e-6·L²), L = roundup8(max)
WORKED_COST = CostModel(overhead=1.0, lin=0.002, quad=4e-6, bw_ratio=0.0)


def brute_force(lengths, cost, c, mem_cap=None, count=None):
    """Best objective over all 2^(N-1) contiguous splits of the DP's sample order (slice
    times computed directly from the cost model, memoised per slice)."""
    a = np.asarray(lengths)
    srt = a[sample_order(a)]
    N = len(srt)
    memo = {}

    def t(i, j):  # None when the slice breaks the memory cap
        if (i, j) not in memo:
            L = cost.padded(srt[i:j].max(axis=0))
            bad = mem_cap is not None and cost.memory(j - i, L) > mem_cap
            memo[(i, j)] = None if bad else float(cost.time(j - i, L))
        return memo[(i, j)]

    best = (np.inf, None)
    for mask in range(1 << (N - 1)):
        cuts = [0] + [i + 1 for i in range(N - 1) if mask >> i & 1] + [N]
        if count is not None and len(cuts) - 1 != count:
            continue
        ts = [t(i, j) for i, j in zip(cuts, cuts[1:])]
        if None in ts:
            continue
        obj = (c - 1) * max(ts) + sum(ts)
        if obj < best[0] - 1e-12:
            best = (obj, [j - i for i, j in zip(cuts, cuts[1:])])
    return best


@pytest.mark.parametrize("c,sizes,objective", [(1, [2, 3, 4, 7], 30.4104),
                                               (4, [1, 1, 1, 2, 4, 7], 52.6086),
                                               (8, [1, 1, 1, 2, 4, 7], 80.6086)])
def test_worked_example(c, sizes, objective):
    plan = dynapipe_split(WORKED, WORKED_COST, c)
    assert plan.sizes == sizes
    assert plan.objective == pytest.approx(objective, abs=5e-5)
    if c > 1:
        assert plan.t_max == pytest.approx(7.0, abs=1e-3)
    bf = brute_force(WORKED, WORKED_COST, c)
    assert bf[1] == sizes and bf[0] == pytest.approx(plan.objective, rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_random_small_cases_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    N = int(rng.integers(2, 10))
    encdec = seed % 3 == 2
    cost = CostModel(overhead=float(rng.uniform(0, 2)), lin=float(rng.uniform(1e-4, 5e-3)),
                     quad=float(rng.uniform(0, 1e-5)), bw_ratio=float(rng.uniform(0, 2)),
                     mem_lin=1.0, mem_quad=float(rng.uniform(0, 1e-2)), encdec=encdec)
    lengths = rng.integers(1, 1500, size=(N, 2) if encdec else N)
    c = int(rng.integers(1, 9))
    mem_cap = None
    if seed % 2:  # a cap that forbids the largest slices but not single samples
        single = max(float(cost.memory(1, cost.padded(x))) for x in lengths)
        mem_cap = single * float(rng.uniform(1.0, 4.0))
    plan = dynapipe_split(lengths, cost, c, mem_cap=mem_cap)
    bf_obj, _ = brute_force(lengths, cost, c, mem_cap)
    assert plan.objective == pytest.approx(bf_obj, rel=1e-9)
    assert sorted(i for mb in plan.microbatches for i in mb.samples) == list(range(N))
    if mem_cap is not None:
        assert all(cost.memory(m.mbs, m.seqlen) <= mem_cap for m in plan.microbatches)
    # fixed number of micro-batches (for runtimes with a fixed accumulation count)
    n = int(rng.integers(1, N + 1))
    bf_n, sizes_n = brute_force(lengths, cost, c, mem_cap, count=n)
    if np.isfinite(bf_n):
        fixed = dynapipe_split(lengths, cost, c, mem_cap=mem_cap, num_microbatches=n)
        assert len(fixed) == n and fixed.objective == pytest.approx(bf_n, rel=1e-9)
    else:
        with pytest.raises(ValueError, match="fits the memory cap"):
            dynapipe_split(lengths, cost, c, mem_cap=mem_cap, num_microbatches=n)


def test_worked_example_with_a_fixed_micro_batch_count():
    for n in (1, 4, 6, 16):
        plan = dynapipe_split(WORKED, WORKED_COST, 4, num_microbatches=n)
        assert len(plan) == n
        assert plan.objective == pytest.approx(brute_force(WORKED, WORKED_COST, 4, count=n)[0])
    with pytest.raises(ValueError, match="num_microbatches"):
        dynapipe_split(WORKED, WORKED_COST, 4, num_microbatches=17)


def test_memory_cap_too_small_is_a_clear_error():
    cost = WORKED_COST.with_(mem_lin=1.0)
    with pytest.raises(ValueError, match="exceeds the memory cap"):
        dynapipe_split(WORKED, cost, 4, mem_cap=500.0)


def test_thinning_and_candidate_cap_stay_near_optimal():
    a = LengthSampler(max_len=2048, seed=3)(96)
    cost = CostModel.gpt(stages=4)
    exact = dynapipe_split(a, cost, 4)
    thin = dynapipe_split(a, cost, 4, tmax_step=5.0, max_candidates=16)
    assert exact.objective <= thin.objective <= 1.05 * exact.objective


def test_baselines_cover_every_sample_once_and_respect_their_rules():
    a = LengthSampler(max_len=1024, seed=5)(70)
    cost = CostModel.gpt(stages=4)
    for plan in (fixed_split(a, cost, 4, 4), token_split(a, cost, 4, 4096),
                 packing_split(a, cost, 4, 1024, rows_per_mb=2), split("dynapipe", a, cost, 4)):
        got = sorted(i for mb in plan.microbatches for i in mb.samples)
        assert got == list(range(len(a))), plan.method
        assert 0 < plan.padding_efficiency <= 1.0
        assert plan.real_tokens == int(a.sum())
    tok = token_split(a, cost, 4, 4096)
    assert all(m.mbs * m.seqlen <= 4096 or m.mbs == 1 for m in tok.microbatches)
    pk = packing_split(a, cost, 4, 1024, rows_per_mb=2)
    assert all(sum(a[list(r)]) <= 1024 for m in pk.microbatches for r in m.rows)
    assert all(m.shape == (len(m.rows), 1024) for m in pk.microbatches)
    fx = fixed_split(a, cost, 4, 4)
    assert fx.shapes[0] == (4, int(pad_len(a[:4].max())))
    with pytest.raises(ValueError, match="unknown micro-batching method"):
        split("nope", a, cost, 4)


def test_dp_beats_baselines_on_its_objective():
    a = LengthSampler(max_len=4096, seed=7)(128)
    cost = CostModel.gpt(stages=4)
    dp = dynapipe_split(a, cost, 4)
    for other in [fixed_split(a, cost, 4, m) for m in (1, 2, 4, 8)] + \
            [token_split(a, cost, 4, t) for t in (2048, 4096, 8192, 16384)] + \
            [packing_split(a, cost, 4, 4096)]:
        assert dp.objective <= other.objective + 1e-9, other.method


def test_cost_model_attention_is_quadratic_and_encdec_uses_both_lengths():
    g = CostModel.gpt(hidden=1024, heads=16, layers=8, stages=2)
    assert g.layers == 4
    t1, t2 = g.fwd(1, 2048), g.fwd(1, 4096)
    lin_only = g.with_(quad=0.0)
    assert t2 - g.layers * g.overhead > 2.0 * (t1 - g.layers * g.overhead)  # super-linear
    assert lin_only.fwd(1, 4096) < t2
    assert g.time(2, 512) == pytest.approx(3.0 * g.fwd(2, 512))
    assert g.memory(2, 1024) == pytest.approx(2 * g.memory(1, 1024))
    flash = CostModel.gpt(hidden=1024, attention="flash")
    assert flash.quad < g.quad
    t5 = g.with_(encdec=True)
    assert t5.fwd(4, (512, 64)) > t5.fwd(4, (256, 64))
    assert t5.fwd(4, (64, 512)) > t5.fwd(4, (64, 256))
    assert int(t5.tokens(4, (512, 64))) == 4 * 576


def test_length_data_is_real_and_varied(tmp_path):
    tab = load_lengths()
    assert set(tab.source) == {"deb", "topic", "doc"} and len(tab) > 1000
    tot = tab.prompt + tab.response
    assert np.percentile(tot, 99) / np.percentile(tot, 10) > 30  # ~100x spread
    counts = generate(str(tmp_path / "x.tsv"))  # the regeneration script runs offline
    assert counts["topic"] > 50 and counts["doc"] > 100
    s = LengthSampler(max_len=512, seed=0)
    x = s(1000)
    assert x.max() <= 512 and x.min() >= 1
    y = LengthSampler(kind="encdec", max_len=512, seed=0)(10)
    assert y.shape == (10, 2)
    json.dumps(x.tolist())


@pytest.mark.parametrize("encdec", [False, True])
@pytest.mark.parametrize("cap", [None, 2e9, 4e8])
def test_slice_table_is_every_slice_costed_directly(encdec, cap):
    # the vectorised table against t(M) and mem(M) of each slice, one at a time
    from ds_autoplan.dynamic.microbatch import slice_table
    cost = CostModel.gpt(2048, 16, 24, 4, encdec=encdec)
    a = LengthSampler("encdec" if encdec else "decoder", 4096, 3)(40)
    a = a[sample_order(a)]
    T = slice_table(a, cost, cap)
    for i in range(len(a)):
        stop = False
        for k in range(len(a) + 1):
            if k <= i:
                assert T[i, k] == np.inf
                continue
            L = cost.padded(a[i:k].max(axis=0))
            stop = stop or (cap is not None and cost.memory(k - i, L) > cap)
            assert T[i, k] == (np.inf if stop else pytest.approx(float(cost.time(k - i, L)), rel=1e-12))
