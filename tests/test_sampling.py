"""The sampling and acceptance ops (dflash2_rt.ops.sample / accept) against exact
distributions computed here by sorting (the reference the sorting-free op must equal):

* the support of a row's distribution is exactly the top-k / top-p set of the definition
  (ties at the cut go to the lower id), and its frequencies match the exact probabilities
  (TV distance within a bound that tightens with the number of draws);
* draws are a pure function of (key, counter): same state, same token;
* acceptance is lossless: drafting d ~ q and committing accept's output token gives
  exactly p (one-hot and K-wide q), and greedy acceptance is the longest argmax prefix.
"""
from __future__ import annotations

import numpy as np
import pytest

import dflash2_rt
from dflash2_rt import ops


def exact_probs(logits, temperature, top_k, top_p):
    """The definition, with a stable sort: scale, keep the top_k largest (ties to the lower
    id), then the smallest prefix by probability whose mass reaches top_p (ties to the
    lower id), renormalise."""
    x = np.asarray(logits, np.float64) / temperature
    V = x.shape[0]
    order = sorted(range(V), key=lambda i: (-float(logits[i]), i))  # descending, ties lower id first
    keep = order[:top_k] if 0 < top_k < V else order
    w = np.exp(x[keep] - x.max())
    w = w / w.sum()
    if top_p < 1.0:
        cum, n = 0.0, 0
        for n, v in enumerate(w, 1):
            cum += v
            if cum >= top_p:
                break
        keep, w = keep[:n], w[:n] / w[:n].sum()
    p = np.zeros(V)
    p[keep] = w
    return p


def tv_bound(p, n):
    """A generous high-probability bound on the TV distance of an n-sample empirical
    distribution from p (5 standard deviations of the sum of |errors|)."""
    sd = np.sqrt(p * (1 - p) / n)
    return 0.5 * (np.sqrt(2 / np.pi) * sd.sum() + 5 * np.sqrt((sd ** 2).sum())) + 1e-12


def rng_rows(key, n, start=0, stride=1):
    return np.stack([np.full(n, key, np.int64), start + stride * np.arange(n, dtype=np.int64)], 1)


def params(n, temperature, top_p, top_k):
    return (np.full(n, temperature, np.float32), np.full(n, top_p, np.float32), np.full(n, top_k, np.int32))


def sample_many(row, n, temperature, top_p, top_k, key=7):
    logits = np.repeat(np.asarray(row, np.float32)[None], n, 0)
    t, p, k = params(n, temperature, top_p, top_k)
    return np.asarray(ops.sample(logits, t, p, k, rng_rows(key, n)).numpy())


ROWS = {
    "random": np.random.default_rng(1).normal(0, 2, 40).astype(np.float32),
    # ties everywhere: 4 values, 10 copies each, interleaved
    "ties": np.array([3.0, 1.0, 2.0, 0.5] * 10, np.float32),
    "peaked": np.concatenate([[8.0, 7.5], np.random.default_rng(2).normal(0, 1, 30)]).astype(np.float32),
    "negative": -np.abs(np.random.default_rng(3).normal(5, 3, 33)).astype(np.float32),
}
SETTINGS = [(1.0, 1.0, 0), (0.7, 1.0, 5), (1.0, 0.9, 0), (1.3, 0.5, 0), (0.8, 0.85, 6), (1.0, 0.3, 12),
            (2.0, 1.0, 1), (1.0, 1e-6, 0), (1.0, 0.999, 3)]


@pytest.mark.parametrize("name", sorted(ROWS))
@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_sample_matches_the_exact_distribution(name, temperature, top_p, top_k):
    row = ROWS[name]
    p = exact_probs(row, temperature, top_k, top_p)
    n = 20000
    got = sample_many(row, n, temperature, top_p, top_k)
    support = set(np.flatnonzero(p))
    assert set(got.tolist()) <= support, f"drew outside the kept set: {sorted(set(got.tolist()) - support)}"
    # every token of the kept set with a fair share of the mass appears
    assert {i for i in support if p[i] > 20 / n} <= set(got.tolist())
    emp = np.bincount(got, minlength=row.shape[0]) / n
    tv = 0.5 * np.abs(emp - p).sum()
    assert tv <= tv_bound(p, n), f"TV {tv:.4f} > {tv_bound(p, n):.4f}"


def test_top_k_cuts_ties_at_the_lower_id():
    row = np.array([1.0, 5.0, 3.0, 5.0, 3.0, 3.0, 0.0], np.float32)
    got = set(sample_many(row, 4000, 1.0, 1.0, 3).tolist())
    assert got == {1, 3, 2}  # both 5s and the first 3
    got = set(sample_many(row, 4000, 1.0, 1.0, 4).tolist())
    assert got == {1, 3, 2, 4}


def test_top_p_cuts_ties_at_the_lower_id():
    # four equal tokens with 0.234 of the mass each: top_p 0.4 keeps the 2 lowest ids, 0.5 the 3 lowest
    row = np.array([0.0, 2.0, 2.0, 0.0, 2.0, 2.0], np.float32)
    for top_p, want in ((0.4, {1, 2}), (0.5, {1, 2, 4})):
        assert set(np.flatnonzero(exact_probs(row, 1.0, 0, top_p))) == want
        assert set(sample_many(row, 4000, 1.0, top_p, 0).tolist()) == want


def test_greedy_is_argmax_and_draws_are_a_function_of_the_state():
    rows = np.random.default_rng(5).normal(size=(6, 300)).astype(np.float32)
    rows[2, 7] = rows[2, 9] = rows[2].max() + 1  # a tie: the lower id
    t, p, k = params(6, 0.0, 1.0, 0)
    g = np.asarray(ops.sample(rows, t, p, k, rng_rows(1, 6)).numpy())
    assert g.tolist() == [int(np.argmax(r)) for r in rows] and g[2] == 7
    t, p, k = params(6, 1.0, 0.9, 50)
    a = np.asarray(ops.sample(rows, t, p, k, rng_rows(3, 6, 100)).numpy())
    b = np.asarray(ops.sample(rows, t, p, k, rng_rows(3, 6, 100)).numpy())
    c = np.asarray(ops.sample(rows, t, p, k, rng_rows(4, 6, 100)).numpy())
    assert (a == b).all() and not (a == c).all()


def test_sample_argument_errors():
    x = np.zeros((2, 5), np.float32)
    t, p, k = params(2, 1.0, 1.0, 0)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="sample: .*top_p"):
        ops.sample(x, t, np.array([1.0, 1.5], np.float32), k, rng_rows(1, 2))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="sample: .*temperature"):
        ops.sample(x, np.array([1.0, np.nan], np.float32), p, k, rng_rows(1, 2))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="sample: .*rng"):
        ops.sample(x, t, p, k, np.zeros((2, 3), np.int64))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="sample: .*top_k"):
        ops.sample(x, t, p, np.array([0, -1], np.int32), rng_rows(1, 2))


# ----------------------------------------------------------------------------- accept


def test_greedy_acceptance_is_the_longest_argmax_prefix():
    V, K = 20, 4
    rng = np.random.default_rng(0)
    S = 5
    logits = rng.normal(size=(S * (K + 1), V)).astype(np.float32)
    am = logits.argmax(1).reshape(S, K + 1)
    draft = am[:, :K].copy()
    draft[1, 2] = (draft[1, 2] + 1) % V   # rejected at 2
    draft[2, 0] = (draft[2, 0] + 1) % V   # rejected at 0
    lens = np.array([K, K, K, 2, 0], np.int32)
    t, p, k = params(S, 0.0, 1.0, 0)
    acc, bon = ops.accept(logits, np.arange(S, dtype=np.int32) * (K + 1), draft.astype(np.int32),
                          np.arange(S, dtype=np.int32), lens, temperature=t, top_p=p, top_k=k, rng=rng_rows(1, S))
    acc, bon = np.asarray(acc.numpy()), np.asarray(bon.numpy())
    assert acc.tolist() == [4, 2, 0, 2, 0]
    assert bon.tolist() == [am[0, 4], am[1, 2], am[2, 0], am[3, 2], am[4, 0]]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("setting", [(1.0, 1.0, 0), (0.8, 0.85, 6)])
def test_rejection_sampling_keeps_the_target_distribution(wide, setting):
    """Draft d ~ q (one-hot on a fixed token, or a K-wide proposal over candidates), then the
    first committed token (d if accepted, else the bonus) must be distributed as p."""
    temperature, top_p, top_k = setting
    V, C, n = 24, 6, 30000
    g = np.random.default_rng(11)
    row = g.normal(0, 1.5, V).astype(np.float32)
    p = exact_probs(row, temperature, top_k, top_p)
    logits = np.repeat(row[None], 2 * n, 0)  # rows [2s, 2s+1]: the anchor's row, then the bonus row
    if wide:
        cands = g.choice(V, C, replace=False).astype(np.int32)
        qv = g.dirichlet(np.ones(C)).astype(np.float32)
        pick = g.choice(C, n, p=qv / qv.sum())
        draft = cands[pick][:, None]
        cand = np.repeat(cands[None, None], n, 0)
        q = np.repeat(qv[None, None], n, 0)
    else:
        draft = np.full((n, 1), int(np.argsort(-p)[1]), np.int32)  # a likely but not the likeliest token
        cand = q = None
    t, pp, k = params(n, temperature, top_p, top_k)
    acc, bon = ops.accept(logits, np.arange(n, dtype=np.int32) * 2, draft.astype(np.int32),
                          np.arange(n, dtype=np.int32), np.ones(n, np.int32), cand=cand, q=q,
                          temperature=t, top_p=pp, top_k=k, rng=rng_rows(99, n, 0, 2))
    acc, bon = np.asarray(acc.numpy()), np.asarray(bon.numpy())
    first = np.where(acc == 1, draft[:, 0], bon)
    emp = np.bincount(first, minlength=V) / n
    tv = 0.5 * np.abs(emp - p).sum()
    assert tv <= tv_bound(p, n), f"TV {tv:.4f} > {tv_bound(p, n):.4f}"
    assert 0.02 < acc.mean() < 0.98  # both branches exercised
    # the accepted rate is sum_d min(p, q) (the classic result)
    qfull = np.zeros(V)
    if wide:
        qfull[cands] = qv / qv.sum()
    else:
        qfull[draft[0, 0]] = 1.0
    want = np.minimum(p, qfull).sum()
    assert abs(acc.mean() - want) < 5 * np.sqrt(want * (1 - want) / n) + 1e-3


def test_accept_argument_errors():
    logits = np.zeros((4, 5), np.float32)
    t, p, k = params(2, 1.0, 1.0, 0)
    args = dict(temperature=t, top_p=p, top_k=k, rng=rng_rows(1, 2))
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="accept: .*logits rows"):
        ops.accept(logits, np.array([0, 3], np.int32), np.zeros((2, 2), np.int32), np.array([0, 1], np.int32),
                   np.array([1, 1], np.int32), **args)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="accept: .*draft_len"):
        ops.accept(logits, np.array([0, 2], np.int32), np.zeros((2, 2), np.int32), np.array([0, 1], np.int32),
                   np.array([3, 1], np.int32), **args)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="accept: .*drafted token 9"):
        ops.accept(logits, np.array([0, 2], np.int32), np.full((2, 2), 9, np.int32), np.array([0, 1], np.int32),
                   np.array([1, 1], np.int32), **args)


# ---------------------------------------------------------------------------- the CUDA backend
# sample / accept on the GPU (cpp/src/backend/cuda/sampling.cu) make the CPU's decisions
# with the same Philox draws: the tokens equal the CPU's row for row (their sums differ only
# in order, ~1e-16 relative, which moves a draw only if it lands that close to a bucket
# edge), and the statistical tests hold on the GPU by themselves.
def _cuda():
    from conftest import cuda_or_skip
    cuda_or_skip()


def _dev(a):
    return dflash2_rt.from_dlpack(np.ascontiguousarray(a)).to("cuda")


def _host(t):
    return np.asarray(t.to("cpu").numpy())


@pytest.mark.parametrize("name", sorted(ROWS))
def test_cuda_sample_equals_cpu(name):
    _cuda()
    n = 1000
    for (temperature, top_p, top_k) in SETTINGS + [(0.0, 1.0, 0)]:
        logits = np.repeat(ROWS[name][None], n, 0)
        t, p, k = params(n, temperature, top_p, top_k)
        r = rng_rows(5, n)
        want = np.asarray(ops.sample(logits, t, p, k, r).numpy())
        got = _host(ops.sample(_dev(logits), _dev(t), _dev(p), _dev(k), _dev(r)))
        assert np.array_equal(got, want), f"{name} {temperature, top_p, top_k}: {(got != want).sum()} of {n} differ"


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.8, 0.85, 6), (1.0, 0.3, 12)])
def test_cuda_sample_matches_the_exact_distribution(temperature, top_p, top_k):
    _cuda()
    n = 20000
    row = ROWS["random"]
    logits = np.repeat(row[None], n, 0)
    t, p, k = params(n, temperature, top_p, top_k)
    got = _host(ops.sample(_dev(logits), _dev(t), _dev(p), _dev(k), _dev(rng_rows(17, n))))
    exact = exact_probs(row, temperature, top_k, top_p)
    emp = np.bincount(got, minlength=len(row)) / n
    assert 0.5 * np.abs(emp - exact).sum() <= tv_bound(exact, n)


def _drafts(g, logits, S, K, C, wide):
    """Random drafts for S blocks of K + 1 logits rows (every third block the rows' argmax:
    fully accepted when greedy), draft lengths, and with `wide` a K-wide q over C candidates
    holding the drafted token."""
    V = logits.shape[1]
    draft = g.integers(0, V, (S, K)).astype(np.int32)
    am = logits.argmax(1).reshape(S, K + 1)
    draft[::3] = am[::3, :K]
    lens = g.integers(0, K + 1, S).astype(np.int32)
    cand = q = None
    if wide:
        cand = np.stack([[g.choice(V, C, replace=False) for _ in range(K)] for _ in range(S)]).astype(np.int32)
        cand[:, :, 0] = draft
        q = g.dirichlet(np.ones(C), (S, K)).astype(np.float32)
    return draft, lens, cand, q


def _accept_equal_cpu(what, logits, row0, draft, drow, lens, cand, q, t, p, k, r):
    """accept on the GPU gives the CPU op's accepted counts and bonus tokens."""
    a0, b0 = ops.accept(logits, row0, draft, drow, lens, cand=cand, q=q, temperature=t, top_p=p, top_k=k, rng=r)
    a1, b1 = ops.accept(_dev(logits), _dev(row0), _dev(draft), _dev(drow), _dev(lens),
                        cand=None if cand is None else _dev(cand), q=None if q is None else _dev(q),
                        temperature=_dev(t), top_p=_dev(p), top_k=_dev(k), rng=_dev(r))
    assert np.array_equal(_host(a1), np.asarray(a0.numpy())), what
    assert np.array_equal(_host(b1), np.asarray(b0.numpy())), what


@pytest.mark.parametrize("wide", [False, True])
def test_cuda_accept_equals_cpu(wide):
    _cuda()
    g = np.random.default_rng(21)
    S, K, V, C = 64, 4, 50, 8
    logits = g.normal(0, 1.5, (S * (K + 1), V)).astype(np.float32)
    draft, lens, cand, q = _drafts(g, logits, S, K, C, wide)
    row0 = np.arange(S, dtype=np.int32) * (K + 1)
    drow = np.arange(S, dtype=np.int32)
    for setting in [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.8, 0.9, 10)]:
        t, p, k = params(S, *setting)
        _accept_equal_cpu(setting, logits, row0, draft, drow, lens, cand, q, t, p, k, rng_rows(33, S, 0, K + 1))


def test_cuda_rejection_sampling_keeps_the_target_distribution():
    _cuda()
    temperature, top_p, top_k = 0.8, 0.85, 6
    V, C, n = 24, 6, 30000
    g = np.random.default_rng(12)
    row = g.normal(0, 1.5, V).astype(np.float32)
    p = exact_probs(row, temperature, top_k, top_p)
    logits = np.repeat(row[None], 2 * n, 0)
    cands = g.choice(V, C, replace=False).astype(np.int32)
    qv = g.dirichlet(np.ones(C)).astype(np.float32)
    draft = cands[g.choice(C, n, p=qv / qv.sum())][:, None].astype(np.int32)
    cand, q = np.repeat(cands[None, None], n, 0), np.repeat(qv[None, None], n, 0)
    t, pp, k = params(n, temperature, top_p, top_k)
    acc, bon = ops.accept(_dev(logits), _dev(np.arange(n, dtype=np.int32) * 2), _dev(draft),
                          _dev(np.arange(n, dtype=np.int32)), _dev(np.ones(n, np.int32)), cand=_dev(cand), q=_dev(q),
                          temperature=_dev(t), top_p=_dev(pp), top_k=_dev(k), rng=_dev(rng_rows(98, n, 0, 2)))
    acc, bon = _host(acc), _host(bon)
    first = np.where(acc == 1, draft[:, 0], bon)
    emp = np.bincount(first, minlength=V) / n
    assert 0.5 * np.abs(emp - p).sum() <= tv_bound(p, n)
    assert 0.02 < acc.mean() < 0.98


# Rows longer than one chunk of 4096 ids are split over several blocks per row on the GPU
# (sampling.cu "wide rows": one launch per step, each chunk's partial combined in chunk
# order by the row's last block). Rows of 9000 ids (3 chunks) with ties that cross the
# chunks (top-k / top-p cuts inside a tie group, the n-th tie in a later chunk), -inf, and
# every setting mixed in one batch: the CPU's tokens, row for row.
def _wide_rows():
    g = np.random.default_rng(41)
    V = 9000
    tail = g.normal(0, 2, V)
    tail[g.choice(V, 300, replace=False)] = -np.inf
    return {
        "random": g.normal(0, 2, V).astype(np.float32),
        "ties": np.tile(np.array([3.0, 1.0, 2.0, 0.5], np.float32), V // 4),
        "peaked": np.concatenate([[8.0, 7.5], g.normal(0, 1, V - 2)]).astype(np.float32),
        "neg-inf": tail.astype(np.float32),
        "late-max": np.concatenate([g.normal(0, 1, V - 5), [9.0, 2.0, 9.0, 1.0, 0.0]]).astype(np.float32),
    }


WIDE_SETTINGS = [(0.0, 1.0, 0), (1.0, 1.0, 0), (1.0, 0.95, 0), (0.8, 0.85, 50), (1.0, 0.3, 12), (2.0, 1.0, 1),
                 (1.0, 1e-6, 0), (0.7, 1.0, 5000), (1.0, 0.6, 0), (1.3, 0.5, 3000), (1.0, 0.999, 2251)]


def _wide_batch(reps, key):
    rows = _wide_rows()
    combos = [(name, s) for name in sorted(rows) for s in WIDE_SETTINGS]
    combos = combos * reps
    logits = np.stack([rows[name] for name, _ in combos])
    t = np.array([s[0] for _, s in combos], np.float32)
    p = np.array([s[1] for _, s in combos], np.float32)
    k = np.array([s[2] for _, s in combos], np.int32)
    return combos, logits, t, p, k, rng_rows(key, len(combos), 5, 7)


def test_cuda_sample_wide_rows_equal_cpu():
    _cuda()
    combos, logits, t, p, k, r = _wide_batch(2, 61)
    want = np.asarray(ops.sample(logits, t, p, k, r).numpy())
    assert ops.wide_rows()
    for wide in (True, False):  # the split rows, then one block per row (the baseline form)
        ops.set_wide_rows(wide)
        try:
            got = _host(ops.sample(_dev(logits), _dev(t), _dev(p), _dev(k), _dev(r)))
        finally:
            ops.set_wide_rows(True)
        bad = [combos[i] for i in np.nonzero(got != want)[0]]
        assert not bad, f"wide={wide}: {len(bad)} of {len(combos)} rows differ: {bad[:5]}"
    # a lone row (one task: the chunks are the only parallelism) and greedy rows
    for i in [0, 3, 17, 30]:
        one = _host(ops.sample(_dev(logits[i:i + 1]), _dev(t[i:i + 1]), _dev(p[i:i + 1]), _dev(k[i:i + 1]),
                               _dev(r[i:i + 1])))
        assert one[0] == want[i], combos[i]


@pytest.mark.parametrize("wide", [False, True])
def test_cuda_accept_wide_rows_equal_cpu(wide):
    _cuda()
    g = np.random.default_rng(23)
    rows = _wide_rows()
    names = sorted(rows)
    S, K, C = 12, 3, 8
    V = len(rows[names[0]])
    logits = np.stack([rows[names[(i * 7) % len(names)]] for i in range(S * (K + 1))])
    logits = logits + g.normal(0, 0.3, logits.shape).astype(np.float32) * (g.random((S * (K + 1), 1)) < 0.5)
    logits = logits.astype(np.float32)
    draft, lens, cand, q = _drafts(g, logits, S, K, C, wide)
    row0 = np.arange(S, dtype=np.int32) * (K + 1)
    drow = np.arange(S, dtype=np.int32)[::-1].copy()
    settings = [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.8, 0.9, 10), (1.0, 0.6, 0), (0.7, 1.0, 5000)]
    t = np.array([settings[s % len(settings)][0] for s in range(S)], np.float32)
    p = np.array([settings[s % len(settings)][1] for s in range(S)], np.float32)
    k = np.array([settings[s % len(settings)][2] for s in range(S)], np.int32)
    for key in (33, 34):
        _accept_equal_cpu(key, logits, row0, draft, drow, lens, cand, q, t, p, k, rng_rows(key, S, 0, K + 1))
