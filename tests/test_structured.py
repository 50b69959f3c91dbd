"""Structured output (token constraints): generated tokens against a reference built from the
teacher-forced target (Engine.logits over prompt + output, the constraint's mask applied in
numpy, then argmax), for every method, so speculative decoding stays lossless under masks: a
verify row is masked for the state after the drafts before it, a banned draft is rejected.
Then the llguidance specs (JSON schema, regex, choice, Lark grammar, json_object) on the
bundled pair, constrained and plain requests sharing steps, with penalties and logprobs,
tensor parallelism, a constraint that fails, and argument errors. The sampled distribution
under masks is checked in test_speculative.py (test_sampling_with_constraint_*)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import dflash2_rt
from dflash2_rt.engine import DEFAULT_PAIR_DIR

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_PAIR_DIR, "target", "config.json")),
                                reason="the bundled default pair is not present")

P1 = [(j * 37) % 3000 + 2 for j in range(21)]
P2 = [(j * 53 + 11) % 3000 + 2 for j in range(9)]
F32_MAX = np.finfo(np.float32).max


class Banned:
    """A token constraint (the TokenConstraint protocol) banning, after token a, the tokens
    {(a * mult + k) % V : k < n} and the fixed set `extra` (before any token a = 1). Checks
    that what is committed was allowed, and that masks() leaves its state alone."""

    def __init__(self, V, mult=7, n=1500, extra=(), stop_after=None, steering=False):
        self.V, self.mult, self.n, self.extra = V, mult, n, set(extra)
        self.last, self.count, self.stop_after = 1, 0, stop_after
        self.mask_calls = self.steer_calls = 0
        self.steering = steering

    def banned(self, a):
        return {(a * self.mult + k) % self.V for k in range(self.n)} | self.extra

    def allowed_bits(self, a, words):
        bits = np.ones(words * 32, bool)
        bits[self.V:] = False
        bits[list(self.banned(a))] = False
        return bits

    def masks(self, drafts, out):
        self.mask_calls += 1
        a = self.last
        out[0] = np.packbits(self.allowed_bits(a, out.shape[1]), bitorder="little").view(np.int32)
        for j, d in enumerate(drafts):
            if d in self.banned(a):
                return j + 1
            a = d
            out[j + 1] = np.packbits(self.allowed_bits(a, out.shape[1]), bitorder="little").view(np.int32)
        return len(drafts) + 1

    def steer(self, cand, out):
        """Greedy drafts: per position the drafter's draft if allowed after the ones before, else
        the first allowed candidate."""
        if not self.steering:
            return -1
        self.steer_calls += 1
        a = self.last
        for j, row in enumerate(cand):  # the drafter's draft where allowed, else the first allowed candidate
            ok = [int(c) for c in [out[j]] + list(row) if int(c) not in self.banned(a)]
            if not ok:
                return j
            out[j] = a = ok[0]
        return len(cand)

    def commit(self, tokens):
        for t in tokens:
            assert t not in self.banned(self.last), f"token {t} was banned after {self.last}"
            self.last = t
            self.count += 1

    def done(self):
        return self.stop_after is not None and self.count >= self.stop_after


def ref_greedy(eng, prompt, n, c: Banned, stop_after=None):
    """Greedy tokens from the teacher-forced target with c's masks (a fresh rule state)."""
    toks: list = []
    a = 1
    while len(toks) < n and (stop_after is None or len(toks) < stop_after):
        x = np.array(eng.logits(list(prompt) + toks)[-1], np.float32)
        x[list(c.banned(a))] = -F32_MAX
        toks.append(int(np.argmax(x)))
        a = toks[-1]
    return toks


def wait(eng, rid):
    while True:
        u = eng.poll(rid)
        if u.finished:
            return u.result


@pytest.fixture(scope="module", params=["ar", "dflash2", "mtp", "dflash"])
def engine(request):
    eng = dflash2_rt.Engine(method=request.param, max_batch_size=3, max_seq_len=256)
    yield eng
    eng.close()


def test_greedy_masks_equal_the_reference(engine):
    """Masks banning a third of the vocabulary after each token (the plain output's next tokens
    among them) and a mild one (a few tokens): tokens equal the masked teacher-forced argmax,
    the output differs from the plain one, and with the mild mask drafts are still accepted."""
    V = engine.vocab_size
    plain = engine.generate([P1], max_new_tokens=30, stop_token_ids=[])[0].token_ids
    acc = {}
    for kw in (dict(n=V // 3), dict(n=0, extra=plain[3:6]), dict(n=V // 3, steering=True),
               dict(n=V // 2, mult=3), dict(n=V // 2, mult=3, steering=True)):
        c = Banned(V, **kw)
        got = engine.generate([P1], max_new_tokens=30, stop_token_ids=[], constraint=c)[0]
        assert got.token_ids == ref_greedy(engine, P1, 30, Banned(V, **kw))
        assert got.token_ids != plain
        assert c.count == len(got.token_ids) and c.mask_calls > 0
        if engine.method != "ar" and kw.get("n") == 0:
            assert got.stats["acceptance_length"] > 1.3  # drafts were accepted
        if engine.method == "dflash2":  # (the only drafter with candidates to steer)
            assert (c.steer_calls > 0) == kw.get("steering", False)
        acc[repr(kw)] = got.stats["acceptance_length"]
    if engine.method == "dflash2":  # drafts the mask allows are accepted at least as often
        a1, s1 = acc[repr(dict(n=V // 3))], acc[repr(dict(n=V // 3, steering=True))]
        a2, s2 = acc[repr(dict(n=V // 2, mult=3))], acc[repr(dict(n=V // 2, mult=3, steering=True))]
        assert s1 >= a1 and s2 >= a2 and s1 + s2 > a1 + a2, acc


def test_constrained_and_plain_requests_share_steps(engine):
    V = engine.vocab_size
    plain = engine.generate([P1, P2], max_new_tokens=24, stop_token_ids=[])
    for _ in range(2):
        c0, c2 = Banned(V, n=V // 4, steering=True), Banned(V, mult=11, n=V // 2)
        rids = [engine.submit(P2, max_new_tokens=24, stop_token_ids=[], constraint=c0),
                engine.submit(P1, max_new_tokens=24, stop_token_ids=[]),
                engine.submit(P1, max_new_tokens=24, stop_token_ids=[], constraint=c2)]
        res = [wait(engine, r) for r in rids]
        assert res[0].token_ids == ref_greedy(engine, P2, 24, Banned(V, n=V // 4))
        assert res[1].token_ids == plain[0].token_ids
        assert res[2].token_ids == ref_greedy(engine, P1, 24, Banned(V, mult=11, n=V // 2))


def test_done_ends_the_request(engine):
    V = engine.vocab_size
    r = engine.generate([P1], max_new_tokens=30, stop_token_ids=[], constraint=Banned(V, n=V // 3, stop_after=7))[0]
    assert r.finish_reason == "stop" and len(r.token_ids) == 7
    assert r.token_ids == ref_greedy(engine, P1, 30, Banned(V, n=V // 3), stop_after=7)
    r = engine.generate([P1], max_new_tokens=1, stop_token_ids=[], constraint=Banned(V, stop_after=1))[0]
    assert r.finish_reason == "stop" and len(r.token_ids) == 1


def test_masks_with_penalties_and_logprobs(engine):
    """Masks after the penalties, log-probabilities of the adjusted (masked) logits: a banned
    token's top list never holds a banned token while allowed ones remain."""
    V = engine.vocab_size
    c = Banned(V, n=V // 3)
    r = engine.generate([P1], max_new_tokens=12, stop_token_ids=[], constraint=c, repetition_penalty=1.3,
                        logprobs=5)[0]
    a = 1
    toks: list = []
    for t, lp in zip(r.token_ids, r.logprobs):
        ban = c.banned(a)
        assert t not in ban and not set(lp.top_ids) & ban
        assert np.isfinite(lp.logprob) and lp.logprob <= 0
        a = t
        toks.append(t)
    assert len(toks) == 12


class Raising(Banned):
    def __init__(self, V, when="masks", after=2):
        super().__init__(V, n=0)
        self.when, self.after = when, after

    def masks(self, drafts, out):
        if self.when == "masks" and self.mask_calls >= self.after:
            raise RuntimeError("grammar exploded")
        if self.when == "count":
            self.mask_calls += 1
            return len(drafts) + 2
        n = super().masks(drafts, out)
        if self.when == "empty" and self.mask_calls > self.after:
            out[:n] = 0
        if self.when == "stops":  # only the stop tokens 3 and 4
            out[:n] = 0
            out[:n, 0] = 0b11000
        return n

    def commit(self, tokens):
        if self.when == "commit" and self.count >= self.after:
            raise KeyError("bad commit")
        super().commit(tokens)


@pytest.mark.parametrize("when", ["masks", "commit", "count", "empty", "stops"])
def test_a_failing_constraint_fails_its_request_only(engine, when):
    """A constraint that raises, fills too many rows, allows no token, or allows only stop
    tokens while min_tokens holds them back: its request fails saying so, the others go on."""
    V = engine.vocab_size
    plain = engine.generate([P1], max_new_tokens=16, stop_token_ids=[])[0].token_ids
    kw = dict(stop_token_ids=[3, 4], min_tokens=5) if when == "stops" else dict(stop_token_ids=[])
    bad = engine.submit(P2, max_new_tokens=16, constraint=Raising(V, when), **kw)
    ok = engine.submit(P1, max_new_tokens=16, stop_token_ids=[])
    with pytest.raises(dflash2_rt.InvalidArgumentError,
                       match="grammar exploded|bad commit|filled|allows no token|allows only stop tokens"):
        wait(engine, bad)
    assert wait(engine, ok).token_ids == plain
    assert engine.generate([P1], max_new_tokens=16, stop_token_ids=[])[0].token_ids == plain


DEADLOCK_SCRIPT = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
import dflash2_rt
from test_structured import Banned, P1, wait
eng = dflash2_rt.Engine(method="dflash2", max_batch_size=3, max_seq_len=256)
stop = threading.Event()
def busy():
    while not stop.is_set():
        eng.metrics()
        seq = eng.new_sequence()
        seq.extend([5, 6, 7])
        seq.rollback(1)
        del seq
ts = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
for t in ts:
    t.start()
V = eng.vocab_size
for i in range(6):
    rids = [eng.submit(P1, max_new_tokens=12, stop_token_ids=[], constraint=Banned(V, n=V // 3)) for _ in range(3)]
    for r in rids:
        wait(eng, r)
stop.set()
for t in ts:
    t.join()
eng.close()
print("ok")
"""


def test_python_constraints_beside_other_python_threads():
    """The scheduler thread takes the GIL for a Python constraint while it holds the model lock:
    threads calling metrics(), the step-level Sequence API and dropping constraints meanwhile
    must not deadlock (each binding that takes an engine lock releases the GIL first). In a
    subprocess, so that a deadlock fails the test instead of hanging it."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run([sys.executable, "-c", DEADLOCK_SCRIPT, here], capture_output=True, text=True,
                           timeout=240, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: Python constraints beside threads calling the engine")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_structured_output_without_llguidance_says_so(monkeypatch):
    """Without the llguidance package a spec is an UnsupportedError naming it (the server: a
    400); constraint= objects need nothing."""
    from dflash2_rt import structured

    def missing():
        raise dflash2_rt.UnsupportedError("structured output needs the 'llguidance' package: pip install llguidance")

    monkeypatch.setattr(structured, "_llguidance", missing)
    eng = dflash2_rt.Engine(method="ar", max_batch_size=1, max_seq_len=128)
    try:
        with pytest.raises(dflash2_rt.UnsupportedError, match="pip install llguidance"):
            eng.generate(["x"], max_new_tokens=4, structured_outputs={"regex": "[a-z]+"})
        r = eng.generate([P1], max_new_tokens=4, stop_token_ids=[], constraint=Banned(eng.vocab_size))[0]
        assert len(r.token_ids) == 4
    finally:
        eng.close()


def test_constraint_argument_errors():
    eng = dflash2_rt.Engine(method="ar", max_batch_size=2, max_seq_len=128)
    try:
        V = eng.vocab_size
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="masks"):
            eng.submit(P1, constraint=object())
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="one request's state"):
            eng.generate([P1, P2], constraint=Banned(V))
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="not both"):
            eng.generate([P1], constraint=Banned(V), structured_outputs={"regex": "a"})
        with pytest.raises(TypeError, match="unexpected keyword"):
            eng.generate([P1], structured_output={"regex": "a"})
    finally:
        eng.close()


# ---------------------------------------------------------------- llguidance specs on the pair

def need_llguidance():
    pytest.importorskip("llguidance", reason="structured output's specs need llguidance (pip install llguidance)")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
SPECS = [("json", {"json": SCHEMA, "disable_any_whitespace": True}),
         ("json_object", {"json_object": True, "disable_any_whitespace": True}),
         ("regex", {"regex": r"[0-9]{3}-[a-z]{2,5}"}), ("choice", {"choice": ["yes", "no", "not sure (x+y)?"]}),
         ("grammar", {"grammar": 'start: "x = " sum\nsum: NUM | NUM "+" NUM | NUM "+" NUM "+" NUM\nNUM: /[1-9][0-9]?/'})]


def valid(kind, text):
    if kind == "json":
        v = json.loads(text)
        return set(v) <= {"name", "age", "tags"} and {"name", "age"} <= set(v) and isinstance(v["age"], int)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text) is not None
    if kind == "choice":
        return text in ("yes", "no", "not sure (x+y)?")
    return re.fullmatch(r"x = [1-9][0-9]?(\+[1-9][0-9]?){0,2}", text) is not None


@pytest.fixture(scope="module")
def pair():
    need_llguidance()
    engs = {m: dflash2_rt.Engine(method=m, max_batch_size=4, max_seq_len=512) for m in ("ar", "dflash2")}
    yield engs
    for e in engs.values():
        e.close()


@pytest.mark.parametrize("kind,spec", SPECS, ids=[k for k, _ in SPECS])
def test_specs_give_valid_output_and_dflash2_equals_ar(pair, kind, spec):
    prompts = ["def read_config(path):", "import os\n"]
    for temp in (0.0, 0.8):
        outs = {}
        for m, eng in pair.items():
            res = eng.generate(prompts, max_new_tokens=120, temperature=temp, seed=3, structured_outputs=spec)
            for r in res:
                if kind == "json_object" and r.finish_reason == "length":  # the pair writes code into a string
                    assert r.text.startswith('{"'), (kind, m, r.text)
                    continue
                assert r.finish_reason == "stop", (kind, m, r.text)
                assert valid(kind, r.text), (kind, m, r.text)
            outs[m] = [r.token_ids for r in res]
        if temp == 0.0:
            assert outs["dflash2"] == outs["ar"]


def test_structured_and_plain_requests_share_steps(pair):
    eng = pair["dflash2"]
    plain = eng.generate(["def f(x):"], max_new_tokens=40, stop_token_ids=[])[0].token_ids
    solo = {k: eng.generate(["def f(x):"], max_new_tokens=120, structured_outputs=s)[0].token_ids for k, s in SPECS[:3]}
    rids = [eng.submit("def f(x):", max_new_tokens=120, structured_outputs=s) for _, s in SPECS[:3]]
    rid_plain = eng.submit("def f(x):", max_new_tokens=40, stop_token_ids=[])
    for (k, _), rid in zip(SPECS[:3], rids):
        assert wait(eng, rid).token_ids == solo[k]
    assert wait(eng, rid_plain).token_ids == plain


def test_grammar_constraint_masks_leave_its_state(pair):
    """GrammarConstraint.masks over drafts that complete the grammar and go on with the end of
    sequence and more: rows up to the completion follow the grammar, the rows after it allow
    only the end of sequence, the state is rolled back (the same tokens commit after), a
    rejected draft ends the rows, and done() follows the commits."""
    eng = pair["ar"]
    g = eng._grammar({"choice": ["no", "yes"]}, "test")
    eos = eng.config["eos_token_id"]
    eos = eos if isinstance(eos, int) else eos[0]
    no = eng.encode("no")
    W = (eng.vocab_size + 31) // 32

    def allowed(row):
        return set(np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:eng.vocab_size])[0].tolist())

    c = g.constraint()
    drafts = no + [eos, 5, 6]
    out = np.zeros((len(drafts) + 1, W), np.int32)
    assert c.masks(drafts, out) == len(drafts) + 1
    assert no[0] in allowed(out[0])
    for j in range(len(no), len(drafts) + 1):
        assert allowed(out[j]) == {eos}, j
    bad = np.zeros((3, W), np.int32)
    assert c.masks([no[0], 7], bad) == 2 or len(no) == 1  # the draft after "n..." is rejected at row 1
    c.commit(no)
    assert c.done()
    c2 = g.constraint()
    out2 = np.zeros((2, W), np.int32)
    assert c2.masks([eos], out2) == 1  # the end of sequence before anything: rejected at row 0
    assert eos not in allowed(out2[0])


def test_stream_with_structured_output(pair):
    eng = pair["dflash2"]
    toks = list(eng.stream("x", max_new_tokens=60, structured_outputs=SPECS[0][1]))
    assert valid("json", eng.decode(toks))


def test_structured_output_under_tensor_parallelism():
    need_llguidance()
    spec = SPECS[0][1]
    e1 = dflash2_rt.Engine(max_batch_size=2, max_seq_len=256)
    e2 = dflash2_rt.Engine(max_batch_size=2, max_seq_len=256, tensor_parallel=2)
    try:
        for temp in (0.0, 0.9):
            a = e1.generate(["def g():"], max_new_tokens=80, temperature=temp, seed=5, structured_outputs=spec)[0]
            b = e2.generate(["def g():"], max_new_tokens=80, temperature=temp, seed=5, structured_outputs=spec)[0]
            assert a.token_ids == b.token_ids and valid("json", a.text)
    finally:
        e1.close()
        e2.close()


@pytest.mark.parametrize("spec,match", [
    ("not a dict", "must be a dict"),
    ({}, "exactly one"),
    ({"json": SCHEMA, "regex": "a"}, "exactly one"),
    ({"jsn": SCHEMA}, "unknown field"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "JSON schema"),
    ({"json": {"type": "no-such-type"}}, "."),
    ({"regex": "(unclosed"}, "."),
    ({"regex": 5}, "must be a string"),
    ({"choice": []}, "non-empty"),
    ({"choice": ["a", 3]}, "non-empty"),
    ({"grammar": "start: undefined_rule"}, "."),
    ({"json_object": "yes"}, "must be true"),
    ({"json_object": True, "disable_any_whitespace": 1}, "must be a bool"),
])
def test_bad_specs_are_errors(pair, spec, match):
    with pytest.raises(dflash2_rt.InvalidArgumentError, match=match):
        pair["ar"].generate(["x"], max_new_tokens=4, structured_outputs=spec)
