"""Repetition control (presence / frequency / repetition penalties, logit_bias, min_tokens):
generated tokens against a reference built from the teacher-forced target (Engine.logits over
prompt + output, the penalties applied in numpy in the op's float32 order), for every method,
so speculative decoding keeps the penalized distribution: a verify row counts the drafts
before it as generated. Requests with and without penalties share steps; log-probabilities
are of the adjusted logits; tensor parallelism; argument errors. The sampled distribution
under penalties is checked in test_speculative.py (test_sampling_with_penalties_*)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import dflash2_rt
from dflash2_rt.engine import DEFAULT_PAIR_DIR

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_PAIR_DIR, "target", "config.json")),
                                reason="the bundled default pair is not present")

P1 = [(j * 37) % 3000 + 2 for j in range(21)]
P2 = [(j * 53 + 11) % 3000 + 2 for j in range(9)]
F32_MAX = np.finfo(np.float32).max


def adjust(lg, prompt, toks, pres=0.0, freq=0.0, rep=1.0, bias=None, min_tokens=0, stops=()):
    """The adjusted logits F32 [V] of the row after prompt + toks (toks: generated so far)."""
    f32 = np.float32
    x = np.array(lg, np.float32, copy=True)
    if bias:
        b = np.zeros_like(x)
        for t, v in bias.items():
            b[t] = f32(v)
        x = (x + b).astype(np.float32)
    cnt = np.bincount(np.asarray(toks, np.int64), minlength=len(x)) if toks else np.zeros(len(x), np.int64)
    seen = cnt > 0
    m = seen.copy()
    m[list(prompt)] = True
    if rep != 1:
        x[m] = np.where(x[m] > 0, x[m] / f32(rep), x[m] * f32(rep)).astype(np.float32)
    x[seen] = (x[seen] - (f32(freq) * cnt[seen].astype(np.float32)).astype(np.float32)).astype(np.float32)
    x[seen] = (x[seen] - f32(pres)).astype(np.float32)
    if len(toks) < min_tokens:
        x[list(stops)] = -F32_MAX
    return x


def ref_greedy(eng, prompt, n, stops=(), **kw):
    """Greedy tokens under the penalties from the teacher-forced target (stopping at a stop token)."""
    toks: list = []
    while len(toks) < n:
        x = adjust(eng.logits(list(prompt) + toks)[-1], prompt, toks, stops=stops, **kw)
        toks.append(int(np.argmax(x)))
        if toks[-1] in stops:
            break
    return toks


def api(kw):
    """ref_greedy's keyword names -> the engine's."""
    names = dict(pres="presence_penalty", freq="frequency_penalty", rep="repetition_penalty", bias="logit_bias",
                 min_tokens="min_tokens")
    return {names[k]: v for k, v in kw.items()}


def wait(eng, rid):
    while True:
        u = eng.poll(rid)
        if u.finished:
            return u.result


SETTINGS = [dict(rep=1.3), dict(pres=0.8, freq=0.5), dict(bias={5: 3.0, 17: -2.0, 1000: 1.5}, freq=0.3),
            dict(rep=0.7, pres=-0.5, freq=1.2, bias={42: 4.0})]


@pytest.fixture(scope="module", params=["ar", "dflash2", "mtp", "dflash"])
def engine(request):
    eng = dflash2_rt.Engine(method=request.param, max_batch_size=3, max_seq_len=256)
    yield eng
    eng.close()


def test_greedy_penalties_equal_the_reference(engine):
    plain = engine.generate([P1, P2], max_new_tokens=30, stop_token_ids=[])
    for kw in SETTINGS:
        got = engine.generate([P1, P2], max_new_tokens=30, stop_token_ids=[], **api(kw))
        for p, g, w in zip([P1, P2], got, plain):
            assert g.token_ids == ref_greedy(engine, p, 30, **kw), kw
            assert g.token_ids != w.token_ids  # the penalty changed something
        if engine.method != "ar" and "rep" in kw and kw["rep"] > 1:
            assert max(g.stats["acceptance_length"] for g in got) > 1.3  # drafts were accepted


def test_penalized_and_plain_requests_share_steps(engine):
    """A penalized request beside plain ones (each its own table row; the plain ones untouched),
    a slot used by a penalized request then by another (its counts start again)."""
    plain = engine.generate([P1, P2], max_new_tokens=24, stop_token_ids=[])
    kw = dict(pres=1.0, freq=0.4, rep=1.2)
    for _ in range(2):
        rids = [engine.submit(P2, max_new_tokens=24, stop_token_ids=[], **api(kw)),
                engine.submit(P1, max_new_tokens=24, stop_token_ids=[]),
                engine.submit(P1, max_new_tokens=24, stop_token_ids=[], **api(dict(freq=0.9)))]
        res = [wait(engine, r) for r in rids]
        assert res[0].token_ids == ref_greedy(engine, P2, 24, **kw)
        assert res[1].token_ids == plain[0].token_ids
        assert res[2].token_ids == ref_greedy(engine, P1, 24, freq=0.9)


def test_min_tokens_holds_the_stop_tokens_back(engine):
    plain = engine.generate([P1], max_new_tokens=30, stop_token_ids=[])[0].token_ids
    stops = [plain[2], plain[5]]  # the plain output would stop at its third token
    early = engine.generate([P1], max_new_tokens=30, stop_token_ids=stops)[0]
    assert early.token_ids == plain[:3] and early.finish_reason == "stop"
    for m in (4, 12, 30):
        got = engine.generate([P1], max_new_tokens=30, stop_token_ids=stops, min_tokens=m)[0]
        want = ref_greedy(engine, P1, 30, stops=stops, min_tokens=m)
        assert got.token_ids == want
        assert len(got.token_ids) >= m and not set(got.token_ids[:m]) & set(stops)
    # with penalties too, and with the config's eos (no stop_token_ids)
    got = engine.generate([P1], max_new_tokens=20, stop_token_ids=stops, min_tokens=8, frequency_penalty=0.5)[0]
    assert got.token_ids == ref_greedy(engine, P1, 20, stops=stops, min_tokens=8, freq=0.5)
    assert len(engine.generate([P1], max_new_tokens=5, min_tokens=5)[0].token_ids) == 5


def test_logit_bias_forces_and_bans(engine):
    forced = engine.generate([P1], max_new_tokens=12, stop_token_ids=[], logit_bias={77: 100.0})[0]
    assert forced.token_ids == [77] * 12
    if engine.method in ("dflash2", "dflash"):  # the drafter drafts under the bias too: whole blocks accepted
        assert forced.stats["acceptance_length"] > 6, forced.stats
    first = engine.generate([P1], max_new_tokens=1, stop_token_ids=[])[0].token_ids[0]
    banned = engine.generate([P1], max_new_tokens=12, stop_token_ids=[], logit_bias={first: -100.0})[0]
    assert first not in banned.token_ids
    assert banned.token_ids == ref_greedy(engine, P1, 12, bias={first: -100.0})


def test_logprobs_are_of_the_adjusted_logits():
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=2, max_seq_len=256)
    try:
        kw = dict(rep=1.4, freq=0.6, bias={9: 2.0}, min_tokens=6)
        stops = [3]
        r = eng.generate([P1], max_new_tokens=16, stop_token_ids=stops, logprobs=3, **api(kw))[0]
        assert r.token_ids == ref_greedy(eng, P1, 16, stops=stops, **kw)
        for j, (t, lp) in enumerate(zip(r.token_ids, r.logprobs)):
            x = adjust(eng.logits(P1 + r.token_ids[:j])[-1], P1, r.token_ids[:j], stops=stops, **kw).astype(np.float64)
            m = x.max()
            ref = x - (m + np.log(np.exp(x - m).sum()))
            assert abs(lp.logprob - ref[t]) < 1e-4
            assert list(lp.top_ids) == list(np.argsort(-ref, kind="stable")[:3])
            if j < 6:
                assert lp.logprob > -1e30  # finite: a masked stop token is -FLT_MAX, not -inf
    finally:
        eng.close()


def test_penalties_under_tensor_parallelism():
    one = dflash2_rt.Engine(method="dflash2", max_batch_size=2, max_seq_len=256)
    two = dflash2_rt.Engine(method="dflash2", max_batch_size=2, max_seq_len=256, tensor_parallel=2)
    try:
        kw = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={11: 2.5})
        a = one.generate([P1, P2], max_new_tokens=24, stop_token_ids=[], **kw)
        b = two.generate([P1, P2], max_new_tokens=24, stop_token_ids=[], **kw)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        assert a[0].token_ids == ref_greedy(one, P1, 24, pres=0.5, freq=0.5, rep=1.2, bias={11: 2.5})
    finally:
        one.close()
        two.close()


def test_sampled_penalized_requests_are_reproducible():
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=2, max_seq_len=256)
    try:
        kw = dict(temperature=1.0, top_p=0.95, seed=7, stop_token_ids=[], repetition_penalty=1.3,
                  presence_penalty=0.3)
        a = eng.generate([P1, P2], max_new_tokens=24, **kw)
        b = eng.generate([P1, P2], max_new_tokens=24, **kw)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        c = eng.generate([P1, P2], max_new_tokens=24, **{**kw, "repetition_penalty": 1.0})
        assert [r.token_ids for r in a] != [r.token_ids for r in c]
    finally:
        eng.close()


@pytest.mark.parametrize("kw, match", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=0.001), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(min_tokens=17), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(logit_bias={10 ** 6: 1.0}), "logit_bias"),
    (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logit_bias=[(3, 1.0)]), "logit_bias"),
    (dict(logit_bias={"3": 1.0}), "logit_bias"),
])
def test_argument_errors(kw, match):
    eng = dflash2_rt.Engine(method="ar", max_batch_size=1, max_seq_len=64)
    try:
        for call in (lambda: eng.generate([P2], max_new_tokens=16, **kw),
                     lambda: eng.submit(P2, max_new_tokens=16, **kw),
                     lambda: next(eng.stream(P2, max_new_tokens=16, **kw))):
            with pytest.raises(dflash2_rt.InvalidArgumentError, match=match):
                call()
        with pytest.raises(TypeError, match="bad_penalty"):
            eng.generate([P2], bad_penalty=1.0)
        assert eng.generate([P2], max_new_tokens=4)[0].token_ids  # still serves
    finally:
        eng.close()
