"""Automatic prefix caching (Engine(prefix_caching=True), the default): the full KV-cache
blocks of prompts that ran stay cached, and a prompt that starts with the same tokens takes
them instead of running them again. Every output must equal the engine's without the cache
(greedy and seeded sampled, every method, concurrent requests, under eviction)."""
from __future__ import annotations

import os
import threading

import pytest

import dflash2_rt
from dflash2_rt.engine import DEFAULT_PAIR_DIR

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_PAIR_DIR, "target", "config.json")),
                                reason="the bundled default pair is not present")
BS = 16  # kv_block_size

SYSTEM = [(j * 41) % 3000 + 2 for j in range(75)]


def with_tail(k):
    return SYSTEM + [(7 + 3 * k + j) % 3000 + 2 for j in range(1 + k % 5)]


@pytest.mark.parametrize("method", ["ar", "dflash2", "mtp", "dflash"])
def test_shared_prefix_is_taken_and_outputs_do_not_change(method):
    kw = dict(method=method, max_batch_size=2, max_seq_len=256)
    ref = dflash2_rt.Engine(**kw, prefix_caching=False)
    eng = dflash2_rt.Engine(**kw)
    try:
        assert eng.prefix_caching and not ref.prefix_caching
        for sampled in (False, True):
            samp = dict(temperature=1.0, top_p=0.9, seed=5) if sampled else {}
            for k in range(4):
                p = with_tail(k)
                want = ref.generate([p], max_new_tokens=24, stop_token_ids=[], **samp)[0]
                got = eng.generate([p], max_new_tokens=24, stop_token_ids=[], **samp)[0]
                assert got.token_ids == want.token_ids, (method, sampled, k)
                assert want.stats["cached_tokens"] == 0
                # 75 shared tokens: 4 full blocks whose next token is known (the 5th block ends past them)
                assert got.stats["cached_tokens"] == (0 if (k == 0 and not sampled) else 4 * BS), got.stats
                if method != "ar":
                    assert got.stats["acceptance_length"] == want.stats["acceptance_length"]
        m = eng.metrics()
        assert m["prefix_cache_hit_tokens"] == 7 * 4 * BS and m["prefix_cache_pages"] >= 4
        assert m["cache_pages_used"] == 0 and ref.metrics()["prefix_cache_pages"] == 0
    finally:
        eng.close()
        ref.close()


def test_the_same_prompt_again_runs_only_its_last_block():
    """A prompt that ran takes its full blocks whose next token it knows, and always runs at
    least its last token (its logits start the generation)."""
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=1, max_seq_len=256)
    try:
        for n in (15, 16, 17, 32, 33, 48):
            p = [(j * 29 + n) % 3000 + 2 for j in range(n)]
            first = eng.generate([p], max_new_tokens=8, stop_token_ids=[])[0]
            again = eng.generate([p], max_new_tokens=8, stop_token_ids=[])[0]
            assert again.token_ids == first.token_ids
            assert first.stats["cached_tokens"] == 0
            assert again.stats["cached_tokens"] == (n - 1) // BS * BS, (n, again.stats)
    finally:
        eng.close()


@pytest.mark.parametrize("method", ["ar", "dflash2", "mtp"])
def test_only_blocks_every_cache_holds_are_kept(method):
    """A request that ends at its first token never drafts, so the drafter's rows of its prompt
    wait uncommitted (DFlash: not in the context cache yet; MTP: not run yet): its blocks are
    not kept (ar keeps them: the target's rows are all there). A later request with that prefix
    then drafts from the context it would have built itself."""
    kw = dict(method=method, max_batch_size=1, max_seq_len=256)
    ref = dflash2_rt.Engine(**kw, prefix_caching=False)
    eng = dflash2_rt.Engine(**kw)
    short = SYSTEM[:38]  # fewer rows than a drafter keeps waiting (64): none appended at the prefill
    try:
        one = eng.generate([short + [3]], max_new_tokens=1, stop_token_ids=[])[0]
        assert len(one.token_ids) == 1
        got = eng.generate([short + [4, 5]], max_new_tokens=24, stop_token_ids=[])[0]
        want = ref.generate([short + [4, 5]], max_new_tokens=24, stop_token_ids=[])[0]
        assert got.token_ids == want.token_ids
        assert got.stats["cached_tokens"] == (2 * BS if method == "ar" else 0)
        assert got.stats["acceptance_length"] == want.stats["acceptance_length"]
        again = eng.generate([short + [6]], max_new_tokens=24, stop_token_ids=[])[0]
        assert again.stats["cached_tokens"] == 2 * BS  # the request above drafted: its blocks are kept
    finally:
        eng.close()
        ref.close()


@pytest.mark.parametrize("method", ["ar", "dflash2"])
def test_a_running_requests_prompt_is_shared(method):
    """A prompt's pages are kept when its prefill ends (those every cache holds; the rest, if
    the drafter's last rows still wait, when the request ends): a request arriving while the
    first one still decodes takes them, and the first one's pages count as in use."""
    kw = dict(method=method, max_batch_size=2, max_seq_len=512)
    ref = dflash2_rt.Engine(**kw, prefix_caching=False)
    eng = dflash2_rt.Engine(**kw)
    long_sys = [(j * 43) % 3000 + 2 for j in range(200)]
    try:
        want_a = ref.generate([long_sys + [5]], max_new_tokens=150, stop_token_ids=[])[0].token_ids
        want_b = ref.generate([long_sys + [6, 7]], max_new_tokens=20, stop_token_ids=[])[0].token_ids
        a = eng.submit(long_sys + [5], max_new_tokens=150, stop_token_ids=[])
        got = []
        while len(got) < 3:  # decoding (the metrics are a snapshot after each step)
            got += eng.poll(a, timeout=30).new_token_ids
        assert eng.metrics()["cache_pages_used"] > 0
        b = eng.generate([long_sys + [6, 7]], max_new_tokens=20, stop_token_ids=[])[0]
        assert b.token_ids == want_b
        # every full page of the shared 200 tokens (a prompt chunk of more than 64 rows goes to
        # the drafter's context at once: its rows are all there when the prefill ends)
        assert b.stats["cached_tokens"] == 192, b.stats
        while True:
            up = eng.poll(a, timeout=30)
            got += up.new_token_ids
            if up.finished:
                break
        assert got == want_a
        m = eng.metrics()
        assert m["running"] == 0 and m["cache_pages_used"] == 0, m
    finally:
        eng.close()
        ref.close()


def test_concurrent_requests_with_a_shared_prefix():
    prompts = [with_tail(k) for k in range(10)]
    ref = dflash2_rt.Engine(method="dflash2", max_batch_size=4, max_seq_len=256, prefix_caching=False)
    want = [ref.generate([p], max_new_tokens=20, stop_token_ids=[])[0].token_ids for p in prompts]
    ref.close()
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=4, max_seq_len=256, speculation="adaptive")
    got, errors = {}, []

    def worker(ids):
        try:
            for i in ids:
                got[i] = eng.generate([prompts[i]], max_new_tokens=20, stop_token_ids=[])[0].token_ids
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(list(range(t, 10, 4)),)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert [got[i] for i in range(10)] == want
        m = eng.metrics()
        assert m["prefix_cache_hit_tokens"] > 0 and m["running"] == 0 and m["cache_pages_used"] == 0, m
    finally:
        eng.close()


def test_eviction_when_the_cache_is_full():
    """Two slots of 128 tokens: the cache holds 16 blocks (+ padding); 14 distinct 100-token
    prompts keep 6 blocks each, so older entries are evicted (least recently used first); a
    prompt whose prefix was evicted runs it again; every output equals the cache-less engine's."""
    kw = dict(method="mtp", max_batch_size=2, max_seq_len=128)
    ref = dflash2_rt.Engine(**kw, prefix_caching=False)
    eng = dflash2_rt.Engine(**kw)
    try:
        ps = [[(j * 13 + k * 101) % 3000 + 2 for j in range(100)] for k in range(14)]
        for p in ps + ps[:3] + [ps[-1]]:
            got = eng.generate([p], max_new_tokens=10, stop_token_ids=[])[0]
            assert got.token_ids == ref.generate([p], max_new_tokens=10, stop_token_ids=[])[0].token_ids
        m = eng.metrics()
        assert m["prefix_cache_evictions"] > 0 and m["cache_pages_used"] == 0, m
        last = eng.generate([ps[-1]], max_new_tokens=10, stop_token_ids=[])[0]
        assert last.stats["cached_tokens"] == 96  # the most recent prompt is still cached
        # a batch that needs every block: the cache gives them all back
        big = [[(j * 7 + k) % 3000 + 2 for j in range(110)] for k in range(2)]
        res = eng.generate(big, max_new_tokens=16, stop_token_ids=[])
        assert [r.token_ids for r in res] == [r.token_ids for r in ref.generate(big, max_new_tokens=16,
                                                                                  stop_token_ids=[])]
    finally:
        eng.close()
        ref.close()


def test_prefix_cache_with_interleaved_prefill_and_tensor_parallelism():
    kw = dict(method="dflash2", max_batch_size=2, max_seq_len=512, max_step_tokens=32, tensor_parallel=2)
    ref = dflash2_rt.Engine(**kw, prefix_caching=False)
    eng = dflash2_rt.Engine(**kw, prefill_tokens_per_step=16)
    try:
        long_p = [(j * 37) % 3000 + 2 for j in range(150)]
        want_long = ref.generate([long_p + [9]], max_new_tokens=12, stop_token_ids=[])[0].token_ids
        want_first = ref.generate([[5, 6, 7]], max_new_tokens=200, stop_token_ids=[])[0].token_ids
        eng.generate([long_p + [4]], max_new_tokens=4, stop_token_ids=[])  # caches 9 blocks
        first = eng.submit([5, 6, 7], max_new_tokens=200, stop_token_ids=[])
        got = eng.poll(first, timeout=30).new_token_ids
        rid = eng.submit(long_p + [9], max_new_tokens=12, stop_token_ids=[])
        res = {}
        while len(res) < 2:
            for r in (first, rid):
                if r not in res:
                    up = eng.poll(r, timeout=0.05)
                    if r == first:
                        got += up.new_token_ids
                    if up.finished:
                        res[r] = up.result
        assert res[rid].token_ids == want_long and got == want_first
        st = res[rid].stats
        assert st["cached_tokens"] == 144 and st["prefill_rounds"] == 1, st  # 7 tokens left to run
    finally:
        eng.close()
        ref.close()


def test_prefix_caching_argument_is_checked():
    for bad in ("yes", 1, None):
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="prefix_caching"):
            dflash2_rt.Engine(method="ar", prefix_caching=bad)


def test_step_level_api_evicts_cached_pages_it_needs():
    """Cached pages count as free for the step-level API too: logits() over a long sequence
    with the cache full of kept prompts evicts what it needs (no OutOfMemoryError), equal to
    the engine's without the cache."""
    import numpy as np
    eng = dflash2_rt.Engine(method="ar", max_batch_size=1, max_seq_len=128)
    ref = dflash2_rt.Engine(method="ar", max_batch_size=1, max_seq_len=128, prefix_caching=False)
    try:
        for k in range(6):
            eng.generate([[(j * 13 + k * 101) % 3000 + 2 for j in range(100)]], max_new_tokens=4, stop_token_ids=[])
        m = eng.metrics()
        assert m["prefix_cache_pages"] >= m["cache_pages_total"] - 2 and m["cache_pages_used"] == 0, m
        ids = [(j * 7) % 3000 + 2 for j in range(120)]
        assert np.array_equal(eng.logits(ids), ref.logits(ids))
        again = eng.generate([ids], max_new_tokens=4, stop_token_ids=[])[0]
        assert again.token_ids == ref.generate([ids], max_new_tokens=4, stop_token_ids=[])[0].token_ids
        assert eng.metrics()["prefix_cache_evictions"] > 0
    finally:
        eng.close()
        ref.close()


@pytest.mark.parametrize("method", ["ar", "dflash2", "mtp", "dflash"])
def test_a_conversation_takes_its_previous_turns_output(method):
    """With every numerics exact (the CPU's default) a request that ends keeps its prompt and
    output as one prefix: the next turn (the previous prompt + output + a new message) takes
    the output's blocks too, and every output equals the cache-less engine's (greedy and
    seeded sampled)."""
    kw = dict(method=method, max_batch_size=2, max_seq_len=256)
    ref = dflash2_rt.Engine(**kw, prefix_caching=False)
    eng = dflash2_rt.Engine(**kw)
    try:
        assert eng.prefix_cache_generated and not ref.prefix_cache_generated
        for samp in ({}, dict(temperature=1.0, top_p=0.9, seed=11)):
            convo = list(SYSTEM[:23])
            for turn in range(3):
                want = ref.generate([convo], max_new_tokens=37, stop_token_ids=[], **samp)[0]
                got = eng.generate([convo], max_new_tokens=37, stop_token_ids=[], **samp)[0]
                assert got.token_ids == want.token_ids, (method, samp, turn)
                if method != "ar":
                    assert got.stats["acceptance_length"] == want.stats["acceptance_length"]
                if turn > 0:  # more than the previous prompt's blocks: the output's too
                    assert got.stats["cached_tokens"] > (len(convo) - 37 - 4) // BS * BS, (turn, got.stats)
                convo = convo + list(got.token_ids) + [(turn * 13 + j) % 3000 + 2 for j in range(4)]
        assert eng.metrics()["cache_pages_used"] == 0
    finally:
        eng.close()
        ref.close()


def test_generated_blocks_are_kept_only_where_decode_rows_are_prompt_rows():
    """Under prefill_gemm="bf16" a prompt's rows are not the decode steps' (tensor-core vs
    exact numerics): the output's blocks are not kept, so a next turn takes only prompt blocks
    (and its output stays the cache-less engine's)."""
    kw = dict(method="dflash2", max_batch_size=1, max_seq_len=256, prefill_gemm="bf16")
    eng = dflash2_rt.Engine(**kw)
    ref = dflash2_rt.Engine(**kw, prefix_caching=False)
    try:
        assert not eng.prefix_cache_generated
        first = eng.generate([SYSTEM[:40]], max_new_tokens=40, stop_token_ids=[])[0]
        nxt = SYSTEM[:40] + list(first.token_ids) + [5, 6]
        got = eng.generate([nxt], max_new_tokens=8, stop_token_ids=[])[0]
        assert got.stats["cached_tokens"] == 32  # the first prompt's two full blocks only
        assert got.token_ids == ref.generate([nxt], max_new_tokens=8, stop_token_ids=[])[0].token_ids
    finally:
        eng.close()
        ref.close()


@pytest.mark.parametrize("method", ["ar", "dflash2", "mtp"])
def test_prompts_admitted_together_share_one_prefill(method):
    """Requests with one prompt arriving together (n choices, a batch sharing a system
    prompt): the first runs it, the others are admitted after its prefill and take its blocks
    (every block for ar; a drafter still holding its last rows back keeps those for later)."""
    kw = dict(method=method, max_batch_size=4, max_seq_len=256)
    ref = dflash2_rt.Engine(**kw, prefix_caching=False)
    eng = dflash2_rt.Engine(**kw)
    try:
        p = [(j * 43 + 7) % 3000 + 2 for j in range(150)]
        others = [p[:100] + [5 + k] * 3 for k in range(2)]  # sharing 6 blocks with p
        want = ref.generate([p] * 3 + others, max_new_tokens=12, stop_token_ids=[])
        got = eng.generate([p] * 3 + others, max_new_tokens=12, stop_token_ids=[])
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        cached = [g.stats["cached_tokens"] for g in got]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
        if method == "ar":
            assert cached == [0, 144, 144, 96, 96], cached
        assert eng.metrics()["cache_pages_used"] == 0
    finally:
        eng.close()
        ref.close()


def test_a_prompt_prefilled_over_several_rounds_is_not_waited_for():
    """The wait is one round at most: while requests decode and prefill_tokens_per_step cuts a
    long prompt into rounds, a request with the same prompt is admitted beside it (and runs
    its own), instead of holding the queue back for all of that prompt's rounds."""
    eng = dflash2_rt.Engine(method="ar", max_batch_size=3, max_seq_len=256, prefill_tokens_per_step=32)
    ref = dflash2_rt.Engine(method="ar", max_batch_size=3, max_seq_len=256, prefix_caching=False)
    try:
        p = [(j * 43 + 7) % 3000 + 2 for j in range(150)]
        first = eng.submit(SYSTEM[:20], max_new_tokens=200, stop_token_ids=[])
        while not eng.poll(first, timeout=5).new_token_ids:  # decoding
            pass
        a = eng.submit(p, max_new_tokens=4, stop_token_ids=[])
        b = eng.submit(p, max_new_tokens=4, stop_token_ids=[])
        res = {}
        for rid in (a, b):
            while True:
                u = eng.poll(rid, timeout=30)
                if u.finished:
                    res[rid] = u.result
                    break
        want = ref.generate([p], max_new_tokens=4, stop_token_ids=[])[0].token_ids
        assert res[a].token_ids == want and res[b].token_ids == want
        assert res[a].stats["prefill_rounds"] > 1 and res[b].stats["cached_tokens"] == 0, res[b].stats
        eng.cancel(first)
    finally:
        eng.close()
        ref.close()
