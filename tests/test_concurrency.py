"""One engine, many callers (continuous batching on the engine's scheduler thread):

* N threads with mixed batch shapes get exactly the greedy output each gets alone;
  seeded sampled requests give the same tokens whatever runs beside them;
* an abandoned or closed stream cancels its request within a step and frees its pages;
  Ctrl-C (KeyboardInterrupt) during generate cancels; the interpreter exits cleanly with
  requests in flight (exit code 0, no abort), also `dflash2-rt generate --stream` on SIGINT;
* close() / with-blocks; requests beyond max_batch_size wait for a slot;
* submit / poll / cancel and metrics.
Runs on the bundled default pair.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import dflash2_rt
from dflash2_rt.engine import DEFAULT_PAIR_DIR

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_PAIR_DIR, "target", "config.json")),
                                reason="the bundled default pair is not present")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts(n, seed=0):
    return [[(seed * 131 + i * 31 + j * 17) % 4000 + 2 for j in range(5 + (i * 7) % 29)] for i in range(n)]


def child_env():
    env = dict(os.environ)
    if env.get("DFLASH2_RT_CORE_DIR"):
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def wait_until(pred, timeout=20.0):
    t = time.time()
    while time.time() - t < timeout:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.mark.parametrize("method,speculation", [("ar", "fixed"), ("dflash2", "fixed"), ("dflash2", "adaptive"),
                                                ("mtp", "adaptive")])
def test_threads_with_mixed_batches_get_their_alone_outputs(method, speculation):
    ps = prompts(12)
    alone_eng = dflash2_rt.Engine(method=method, max_batch_size=4, max_seq_len=256)
    alone = {i: alone_eng.generate([p], max_new_tokens=20, stop_token_ids=[])[0].token_ids for i, p in enumerate(ps)}
    alone_eng.close()
    eng = dflash2_rt.Engine(method=method, max_batch_size=4, max_seq_len=256, speculation=speculation)
    got, errors = {}, []
    shapes = [[0], [1, 2], [3, 4, 5], [6], [7, 8], [9], [10, 11], [2, 7, 11, 0]]  # 8 threads, batches of 1..4

    def worker(idx):
        try:
            res = eng.generate([ps[i] for i in idx], max_new_tokens=20, stop_token_ids=[])
            for i, r in zip(idx, res):
                got.setdefault(i, []).append(r.token_ids)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in shapes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for i, outs in got.items():
        for o in outs:
            assert o == alone[i], f"prompt {i}: {o} != alone {alone[i]}"
    m = eng.metrics()
    assert m["running"] == 0 and m["queue_length"] == 0 and m["requests_finished"] == m["requests_total"] == 16
    eng.close()


@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
def test_seeded_sampling_does_not_depend_on_the_neighbours(speculation):
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=6, max_seq_len=256, speculation=speculation)
    p = prompts(1, seed=5)[0]
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=77, stop_token_ids=[])
    alone = eng.generate([p], **kw)[0].token_ids
    noise = [eng.submit(q, max_new_tokens=40, temperature=0.8, stop_token_ids=[]) for q in prompts(4, seed=9)]
    greedy = [eng.submit(q, max_new_tokens=30, stop_token_ids=[]) for q in prompts(1, seed=3)]
    crowded = eng.generate([p], **kw)[0].token_ids
    assert crowded == alone
    for rid in noise + greedy:
        while not eng.poll(rid, timeout=30).finished:
            pass
    eng.close()


def test_submit_poll_cancel_and_metrics():
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=2, max_seq_len=256)
    ps = prompts(5)
    want = [eng.generate([p], max_new_tokens=16, stop_token_ids=[])[0].token_ids for p in ps]
    rids = [eng.submit(p, max_new_tokens=16, stop_token_ids=[]) for p in ps]  # 5 requests, 2 slots: some wait
    seen_queue = eng.metrics()["queue_length"]
    out = {r: [] for r in rids}
    results = {}
    for r in rids:
        while True:
            u = eng.poll(r, timeout=30)
            out[r] += u.new_token_ids
            if u.finished:
                results[r] = u.result
                break
    assert seen_queue >= 1
    assert [out[r] for r in rids] == want == [results[r].token_ids for r in rids]
    assert all(results[r].finish_reason == "length" for r in rids)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="unknown request id"):
        eng.poll(rids[0], timeout=0)  # the final update was returned: forgotten
    # cancel a running request: it ends within a step, its pages come back
    rid = eng.submit(ps[0], max_new_tokens=200, stop_token_ids=[])
    assert eng.poll(rid, timeout=30).new_token_ids
    eng.cancel(rid)
    assert wait_until(lambda: eng.metrics()["running"] == 0)
    m = eng.metrics()
    assert m["requests_cancelled"] == 1 and m["queue_length"] == 0
    eng.cancel(rid)  # ended: a no-op
    eng.cancel(10 ** 9)  # unknown: a no-op
    assert eng.generate([ps[1]], max_new_tokens=16, stop_token_ids=[])[0].token_ids == want[1]
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="submit: .*token"):
        eng.submit([10 ** 9], max_new_tokens=4)
    eng.close()


def test_abandoned_streams_cancel_and_free_their_pages():
    eng = dflash2_rt.Engine(method="dflash2", max_batch_size=4, max_seq_len=512)
    ps = prompts(6)
    want = eng.generate([ps[5]], max_new_tokens=24, stop_token_ids=[])[0].token_ids
    streams = [eng.stream(p, max_new_tokens=400, stop_token_ids=[]) for p in ps[:4]]
    for s in streams:
        for i, _ in enumerate(s):  # a few tokens, then abandon
            if i == 3:
                break
    for s in streams:
        s.close()
    del streams
    assert wait_until(lambda: eng.metrics()["running"] == 0), eng.metrics()
    assert eng.metrics()["requests_cancelled"] == 4
    # the engine is healthy and correct afterwards
    assert eng.generate([ps[5]], max_new_tokens=24, stop_token_ids=[])[0].token_ids == want
    eng.close()


def test_keyboard_interrupt_during_generate_cancels():
    eng = dflash2_rt.Engine(method="ar", max_batch_size=2, max_seq_len=1024)
    main = threading.get_ident()
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        eng.generate(prompts(2), max_new_tokens=1000, stop_token_ids=[])
    assert time.time() - t0 < 10, "generate did not stop promptly on Ctrl-C"
    assert wait_until(lambda: eng.metrics()["running"] == 0)
    assert eng.metrics()["requests_cancelled"] == 2
    eng.close()


def test_close_and_with_block():
    with dflash2_rt.Engine(method="ar", max_batch_size=2, max_seq_len=256) as eng:
        rid = eng.submit(prompts(1)[0], max_new_tokens=500, stop_token_ids=[])
        assert eng.poll(rid, timeout=30).new_token_ids
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="closed"):
        eng.submit([1, 2, 3], max_new_tokens=4)
    eng.close()  # idempotent
    # the step-level API still works on a closed engine
    assert eng.logits([5, 6, 7]).shape[0] == 3


SCRIPT_EXIT = r"""
import sys, threading, dflash2_rt
eng = dflash2_rt.Engine(method="dflash2", max_batch_size=4, max_seq_len=1024)
s = eng.stream([5, 6, 7, 8], max_new_tokens=900, stop_token_ids=[])
next(s)
rids = [eng.submit([9, 10, 11 + i], max_new_tokens=900, stop_token_ids=[]) for i in range(3)]
def consume():
    for _ in eng.stream([3, 4, 5], max_new_tokens=900, stop_token_ids=[]):
        pass
threading.Thread(target=consume, daemon=True).start()
print("in flight", flush=True)
sys.exit(0)
"""


def test_interpreter_exits_cleanly_with_requests_in_flight():
    # Several exits, two at a time: a daemon thread taking the GIL back while the interpreter
    # finalizes used to abort the process ("terminate called without an active exception",
    # a few percent of exits on a loaded machine: bindings.h ReleaseGil)
    for _ in range(4):
        ps = [subprocess.Popen([sys.executable, "-c", SCRIPT_EXIT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=child_env()) for _ in range(2)]
        for p in ps:
            out, err = p.communicate(timeout=120)
            assert "in flight" in out, err[-2000:]
            assert p.returncode == 0, (p.returncode, err[-2000:])
            assert "terminate called" not in err and "Abort" not in err


def test_ctrl_c_on_cli_stream_exits_cleanly():
    p = subprocess.Popen([sys.executable, "-m", "dflash2_rt", "generate", "--prompt-ids", "5,6,7",
                          "--max-new-tokens", "4000", "--max-seq-len", "4096", "--stream"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        assert p.stdout.read(8)  # streaming has started
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode in (130, 1), (p.returncode, err[-2000:])
    assert p.returncode != -signal.SIGABRT and "terminate called" not in err and "Traceback" not in err
    assert "interrupted" in err


def test_prefill_wait_is_its_own_share_of_decode_time():
    """A request decoding while another one's prompt runs (the scheduler prefills new prompts
    between steps) has that wait in stats["prefill_wait_s"], not in host_s; the newcomer,
    alone after its prefill, waited for none; each split adds up to decode_s."""
    eng = dflash2_rt.Engine(method="ar", max_batch_size=2, max_seq_len=512)
    try:
        first = eng.submit(prompts(1, seed=21)[0], max_new_tokens=120, stop_token_ids=[])
        got = []
        while len(got) < 3:  # decoding
            up = eng.poll(first, timeout=20.0)
            assert not up.finished
            got += up.new_token_ids
        second = eng.submit([int(t) % 200 + 2 for t in range(300)], max_new_tokens=2, stop_token_ids=[])
        results = {}
        for rid in (first, second):
            while True:
                up = eng.poll(rid, timeout=60.0)
                if up.finished:
                    results[rid] = up.result.stats
                    break
        a, b = results[first], results[second]
        assert a["prefill_wait_s"] > 0.0, a
        assert b["prefill_wait_s"] == 0.0, b
        for st in (a, b):
            parts = st["draft_s"] + st["verify_s"] + st["accept_s"] + st["prefill_wait_s"] + st["host_s"]
            assert abs(parts - st["decode_s"]) <= 1e-9 * max(1.0, st["decode_s"]), st
    finally:
        eng.close()



def _run_all(eng, rids, seen=None):
    """Polls the requests to their ends; checks that the streamed tokens (after `seen`, what
    was polled before) make up each result."""
    out = {r: list((seen or {}).get(r, [])) for r in rids}
    res = {}
    while len(res) < len(rids):
        for r in rids:
            if r in res:
                continue
            up = eng.poll(r, timeout=0.05)
            out[r] += up.new_token_ids
            if up.finished:
                res[r] = up.result
    for r in rids:
        assert out[r] == res[r].token_ids
    return res


@pytest.mark.parametrize("method", ["ar", "dflash2", "mtp"])
@pytest.mark.parametrize("budget", [None, 0, 20])
def test_long_prompt_prefills_between_decode_steps(method, budget):
    """While a request decodes, a newcomer's long prompt runs prefill_tokens_per_step tokens
    per scheduler round (None: max_step_tokens), a decode step of the running request between
    rounds, so it takes ceil(len / budget) rounds (0: one round, the whole prompt); a prompt
    arriving behind it waits its turn (first come first served) and may share a round. Every
    output equals its single-request output: greedy, and a seeded sampled request."""
    step_tokens = 32
    long_prompt = [(i * 37) % 3000 + 2 for i in range(203)]
    short = prompts(1, seed=4)[0]
    sampled = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=11, stop_token_ids=[])
    kw = dict(method=method, max_batch_size=3, max_seq_len=768, max_step_tokens=step_tokens)
    alone_eng = dflash2_rt.Engine(**kw, prefill_tokens_per_step=0)
    first_p = prompts(1, seed=8)[0]
    want_first = alone_eng.generate([first_p], max_new_tokens=400, stop_token_ids=[])[0].token_ids
    want_long = alone_eng.generate([long_prompt], max_new_tokens=12, stop_token_ids=[])[0].token_ids
    want_short = alone_eng.generate([short], **sampled)[0].token_ids
    alone_eng.close()
    eng = dflash2_rt.Engine(**kw, prefill_tokens_per_step=budget)
    try:
        per_round = step_tokens if budget is None else budget
        assert eng.prefill_tokens_per_step == per_round
        first = eng.submit(first_p, max_new_tokens=400, stop_token_ids=[])
        got = []
        while len(got) < 2:  # decoding
            up = eng.poll(first, timeout=20.0)
            got += up.new_token_ids
        rid_long = eng.submit(long_prompt, max_new_tokens=12, stop_token_ids=[])
        rid_short = eng.submit(short, **sampled)
        res = _run_all(eng, [rid_long, rid_short])
        assert res[rid_long].token_ids == want_long
        assert res[rid_short].token_ids == want_short
        st = res[rid_long].stats
        # `first` needs >= 400 / 8 steps: it decodes through every round of the long prompt
        assert st["prefill_rounds"] == (1 if per_round == 0 else -(-len(long_prompt) // per_round)), st
        assert res[rid_short].stats["prefill_rounds"] >= 1
        if per_round:
            assert st["prefill_s"] > 0.0
        rest = _run_all(eng, [first], {first: got})[first]
        assert rest.token_ids == want_first
        assert rest.stats["prefill_rounds"] == 1  # nothing decoded when it arrived: whole
        m = eng.metrics()
        assert m["running"] == 0 and m["prefilling"] == 0 and m["cache_pages_used"] == 0, m
    finally:
        eng.close()


def test_cancel_while_a_prompt_is_partly_prefilled():
    """A request cancelled between the rounds of its prompt ends "cancelled" and gives back
    its slot and pages; the request decoding beside it is unchanged, and the engine serves on."""
    kw = dict(method="dflash2", max_batch_size=2, max_seq_len=1024, max_step_tokens=16)
    eng = dflash2_rt.Engine(**kw, prefill_tokens_per_step=4)
    try:
        first_p = prompts(1, seed=2)[0]
        want = eng.generate([first_p], max_new_tokens=300, stop_token_ids=[])[0].token_ids
        first = eng.submit(first_p, max_new_tokens=300, stop_token_ids=[])
        got = eng.poll(first, timeout=20.0).new_token_ids
        long_rid = eng.submit([(i * 13) % 3000 + 2 for i in range(700)], max_new_tokens=4, stop_token_ids=[])
        assert wait_until(lambda: eng.metrics()["prefilling"] == 1), eng.metrics()
        eng.cancel(long_rid)
        assert wait_until(lambda: eng.metrics()["running"] <= 1)
        res = _run_all(eng, [first], {first: got})[first]
        assert res.token_ids == want
        up = eng.poll(long_rid, timeout=5.0)
        assert up.finished and up.result.finish_reason == "cancelled"
        m = eng.metrics()
        assert m["running"] == 0 and m["prefilling"] == 0 and m["cache_pages_used"] == 0, m
        assert m["requests_cancelled"] == 1
        assert eng.generate([first_p], max_new_tokens=300, stop_token_ids=[])[0].token_ids == want
    finally:
        eng.close()


def test_prefill_tokens_per_step_is_checked():
    for bad in (-1, -5, 1.5, "8", True):
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="prefill_tokens_per_step"):
            dflash2_rt.Engine(method="ar", prefill_tokens_per_step=bad)


@pytest.mark.parametrize("clients", ["threads", "loop"])
def test_bench_concurrency_drivers_run_every_request(clients):
    """bench/bench_concurrency.py's two client drivers (a thread per client; one thread keeping
    the level's requests in flight) run every request to its length and report the split."""
    import json
    import tempfile
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import bench_concurrency as bc
    eng = dflash2_rt.Engine(method="ar", max_batch_size=3, max_seq_len=256)
    try:
        tok, dt, split = bc.run_level(eng, 3, 2, 5, 7, eng.vocab_size, clients)
    finally:
        eng.close()
    assert tok == 3 * 2 * 5 and dt > 0
    # decode_s = draft + verify + accept + prefill_wait + host (host: the remainder, >= 0 on the CPU)
    assert split["decode_s"] > 0
    assert sum(split[k] for k in bc.SPLIT_KEYS if k != "decode_s") == pytest.approx(split["decode_s"], rel=1e-6)
    with tempfile.TemporaryDirectory() as out:
        bc.main(["--levels", "2", "--requests", "1", "--new", "3", "--repeat", "1", "--modes", "ar",
                 "--clients", clients, "--out", out])
        with open(os.path.join(out, "concurrency.json"), encoding="utf-8") as f:
            rep = json.load(f)
    assert rep["complete"] and rep["clients"] == clients
    assert rep["models"]["pair"][0]["ar"]["tokens"] == 2 * 3


def test_op_profile_script_times_the_decode_steps():
    """bench/op_profile.py: per-op times of an engine's decode steps (ops.set_op_timing), the
    timed total within the wall time, the op timing left as it was."""
    import json
    import tempfile
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import op_profile
    from dflash2_rt import ops
    was = ops.op_timing()
    with tempfile.TemporaryDirectory() as out:
        rep = op_profile.main(["--batch", "1", "2", "--new", "5", "--methods", "ar", "dflash2", "--out", out])
        with open(os.path.join(out, "op_profile.json"), encoding="utf-8") as f:
            assert json.load(f) == json.loads(json.dumps(rep))
    assert ops.op_timing() == was
    assert [(r["method"], r["batch"]) for r in rep["runs"]] == [("ar", 1), ("ar", 2), ("dflash2", 1), ("dflash2", 2)]
    for r in rep["runs"]:
        assert r["steps"] >= 1 and 0 < r["timed_ms_per_step"] <= r["wall_ms_per_step"] * 1.05
        names = {o["op"] for o in r["ops"]}
        assert {"linear", "moe_experts", "mla_attention"} <= names
        assert ("selector_walk" in names) == (r["method"] == "dflash2")
        assert abs(sum(o["share"] for o in r["ops"]) - 1.0) < 1e-9
