"""Log-probabilities of generated tokens (generate / submit / stream with logprobs=n): every
token's log-probability under the target -- the log-softmax of the target's logits at its
position, before temperature / top-p / top-k -- and the n most likely tokens'. Checked against
the teacher-forced logits of the same tokens (Engine.logits over prompt + output), for every
method (a speculative step's verify rows are the target's rows), greedy and sampled, batched,
under tensor parallelism, streamed through poll, and with stop tokens inside a verify block."""
from __future__ import annotations

import os

import numpy as np
import pytest

import dflash2_rt
from dflash2_rt.engine import DEFAULT_PAIR_DIR

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_PAIR_DIR, "target", "config.json")),
                                reason="the bundled default pair is not present")
TOL = 1e-4  # the teacher-forced logits run as a prompt; a step's as decode / verify rows

P1 = [(j * 37) % 3000 + 2 for j in range(21)]
P2 = [(j * 53 + 11) % 3000 + 2 for j in range(9)]


def ref_logprobs(eng, prompt, toks):
    """float64 [len(toks), V]: log-softmax of the target's logits before each token."""
    lg = eng.logits(list(prompt) + list(toks[:-1])).astype(np.float64)[len(prompt) - 1:]
    m = lg.max(1, keepdims=True)
    return lg - (m + np.log(np.exp(lg - m).sum(1, keepdims=True)))


def check(res, ref, n, greedy):
    assert res.logprobs is not None and len(res.logprobs) == len(res.token_ids)
    for j, (t, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        assert abs(lp.logprob - ref[j, t]) < TOL, (j, t, lp.logprob, ref[j, t])
        assert len(lp.top_ids) == n and len(lp.top_logprobs) == n
        if n:
            np.testing.assert_allclose(lp.top_logprobs, np.sort(ref[j])[::-1][:n], atol=TOL)
            np.testing.assert_allclose(lp.top_logprobs, ref[j, list(lp.top_ids)], atol=TOL)
            assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            assert len(set(lp.top_ids)) == n
            if greedy:  # the greedy token is the most likely one
                assert lp.top_ids[0] == t and lp.top_logprobs[0] == lp.logprob


@pytest.mark.parametrize("method", ["ar", "dflash2", "mtp", "dflash"])
def test_logprobs_equal_the_teacher_forced_target(method):
    eng = dflash2_rt.Engine(method=method, max_batch_size=2, max_seq_len=256)
    try:
        for samp in ({}, dict(temperature=1.0, top_p=0.9, seed=3)):
            plain = eng.generate([P1, P2], max_new_tokens=40, stop_token_ids=[], **samp)
            for n in (0, 5):
                got = eng.generate([P1, P2], max_new_tokens=40, stop_token_ids=[], logprobs=n, **samp)
                for p, g, w in zip([P1, P2], got, plain):
                    assert g.token_ids == w.token_ids  # asking for log-probabilities changes nothing
                    assert w.logprobs is None
                    check(g, ref_logprobs(eng, p, g.token_ids), n, greedy=not samp)
                    if method != "ar" and not samp:
                        assert g.stats["acceptance_length"] > 1.5  # several tokens per verify step
    finally:
        eng.close()


def test_mixed_requests_stream_their_logprobs_through_poll():
    """Requests with and without log-probabilities (and different n) share steps; the new
    tokens' log-probabilities come with each poll, and together they are the result's."""
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=4, max_seq_len=256)
    try:
        asks = [None, 2, 0, 7]
        rids = [eng.submit(P1 if i % 2 else P2, max_new_tokens=30 + 3 * i, stop_token_ids=[], logprobs=n)
                for i, n in enumerate(asks)]
        for i, (rid, n) in enumerate(zip(rids, asks)):
            toks, lps = [], []
            while True:
                u = eng.poll(rid)
                toks += u.new_token_ids
                if n is None:
                    assert u.new_logprobs is None
                elif u.new_token_ids:
                    assert len(u.new_logprobs) == len(u.new_token_ids)
                    lps += u.new_logprobs
                if u.finished:
                    res = u.result
                    break
            assert toks == res.token_ids and len(toks) == 30 + 3 * i
            if n is None:
                assert res.logprobs is None
                continue
            assert [x.logprob for x in lps] == [x.logprob for x in res.logprobs]
            assert [x.top_ids for x in lps] == [x.top_ids for x in res.logprobs]
            check(res, ref_logprobs(eng, P1 if i % 2 else P2, toks), n, greedy=True)
        # stream(): the result handed to on_result carries them too
        seen = []
        toks = list(eng.stream(P1, max_new_tokens=12, stop_token_ids=[], logprobs=1, on_result=seen.append))
        assert seen[0].token_ids == toks and len(seen[0].logprobs) == 12
    finally:
        eng.close()


def test_a_stop_token_inside_a_verify_block_ends_the_logprobs_too():
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=1, max_seq_len=256)
    try:
        full = eng.generate([P1], max_new_tokens=40, stop_token_ids=[], logprobs=3)[0]
        stop = full.token_ids[13]
        cut = eng.generate([P1], max_new_tokens=40, stop_token_ids=[stop], logprobs=3)[0]
        k = full.token_ids.index(stop)
        assert cut.token_ids == full.token_ids[:k + 1] and cut.finish_reason == "stop"
        assert [x.logprob for x in cut.logprobs] == [x.logprob for x in full.logprobs[:k + 1]]
        short = eng.generate([P1], max_new_tokens=5, stop_token_ids=[], logprobs=3)[0]
        assert len(short.logprobs) == 5 and short.finish_reason == "length"
    finally:
        eng.close()


def test_logprobs_under_tensor_parallelism():
    """Greedy steps under tensor parallelism gather each rank's (max, id) pairs instead of the
    logits; a step with a request that asks for log-probabilities gathers the logits."""
    ref = dflash2_rt.Engine(method="dflash2", max_batch_size=2, max_seq_len=256)
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=2, max_seq_len=256, tensor_parallel=2)
    try:
        for samp in ({}, dict(temperature=1.0, seed=9)):
            want = ref.generate([P1, P2], max_new_tokens=32, stop_token_ids=[], logprobs=4, **samp)
            g0 = eng.metrics()["argmax_gather_steps"]
            got = eng.generate([P1, P2], max_new_tokens=32, stop_token_ids=[], logprobs=4, **samp)
            assert eng.metrics()["argmax_gather_steps"] == g0
            for p, g, w in zip([P1, P2], got, want):
                assert g.token_ids == w.token_ids
                check(g, ref_logprobs(ref, p, g.token_ids), 4, greedy=not samp)
        g0 = eng.metrics()["argmax_gather_steps"]
        eng.generate([P1], max_new_tokens=16, stop_token_ids=[])
        assert eng.metrics()["argmax_gather_steps"] > g0  # (the path above was really avoided)
    finally:
        eng.close()
        ref.close()


def test_logprobs_arguments_are_checked():
    eng = dflash2_rt.Engine(method="ar", max_batch_size=1, max_seq_len=64)
    try:
        for bad in (21, -1, True, "2", 1.5):
            with pytest.raises(dflash2_rt.InvalidArgumentError, match="logprobs"):
                eng.generate([P2], max_new_tokens=2, logprobs=bad)
            with pytest.raises(dflash2_rt.InvalidArgumentError, match="logprobs"):
                eng.submit(P2, max_new_tokens=2, logprobs=bad)
        assert len(eng.generate([P2], max_new_tokens=2, stop_token_ids=[], logprobs=20)[0].logprobs[1].top_ids) == 20
    finally:
        eng.close()


@pytest.mark.parametrize("method", ["ar", "dflash2"])
def test_prompt_logprobs_score_a_prompt(method):
    """Engine.prompt_logprobs: token j + 1's log-probability after tokens [0, j] and the top
    ones', computed where the logits are; over several chunks; equal to the teacher-forced
    logits' and, for a generated continuation, bit for bit to what generate(logprobs=n) gave
    (exact numerics: a decode row is the prefill row)."""
    eng = dflash2_rt.Engine(method=method, max_batch_size=1, max_seq_len=512, max_step_tokens=64)
    try:
        long = [(j * 29 + 5) % 3000 + 2 for j in range(150)]  # three chunks
        pl = eng.prompt_logprobs(long, top=4)
        assert len(pl) == 149
        ref = ref_logprobs(eng, long[:1], long[1:])
        for j, x in enumerate(pl):
            assert abs(x.logprob - ref[j, long[j + 1]]) < TOL
            np.testing.assert_allclose(x.top_logprobs, np.sort(ref[j])[::-1][:4], atol=TOL)
        out = eng.generate([P1], max_new_tokens=24, stop_token_ids=[], logprobs=2)[0]
        again = eng.prompt_logprobs(P1 + out.token_ids, top=2)[len(P1) - 1:]
        assert [x.logprob for x in again] == [x.logprob for x in out.logprobs]
        assert [x.top_ids for x in again] == [x.top_ids for x in out.logprobs]
        for bad, kw in (([5], {}), (P1, dict(top=21)), (P1, dict(top=-1)), ([5, 10 ** 8], {})):
            with pytest.raises(dflash2_rt.InvalidArgumentError):
                eng.prompt_logprobs(bad, **kw)
    finally:
        eng.close()
