"""A pure-Python stand-in for ``dflash2_rt.Engine``'s request API (submit / poll / cancel /
metrics), for developing and testing the HTTP server without the native core.

Same interface as the real engine: ``FakeEngine(target=None, draft=None, method=None, *,
max_batch_size=8, max_seq_len=None, speculation="adaptive")``, ``tokenizer`` (the bundled
target's tokenizer.json), ``encode`` / ``decode``, ``vocab_size``, ``method``,
``max_seq_len``, ``max_batch_size``, ``target``, ``config``; ``submit`` -> request id,
``poll(id, timeout)`` -> update (.new_token_ids, .finished, .result), ``cancel(id)``,
``stream``, ``generate``, ``metrics()``, ``close()`` and a context manager.

A worker thread runs "steps" of ``step_time`` seconds over at most ``max_batch_size``
running requests (the rest wait in a FIFO queue). Each step commits 1..4 tokens per
request (a deterministic "acceptance length"). The token at position i of a request is a
hash of (prompt, i) -- plus the seed when sampling -- so greedy output depends only on the
prompt, whatever runs concurrently, like the real engine's. Tokens are drawn from the whole
vocabulary, byte-level pieces included, so decoded text has partial UTF-8 characters that
a streaming detokenizer must handle. The fake never produces the eos / mask tokens (0, 1)
by itself, so requests end by ``max_new_tokens`` unless ``stop_token_ids`` (or the
``eos_every`` knob) says otherwise.

Test hooks: ``finish_reasons`` (request id -> finish reason, for every finished request),
``cancelled`` (ids cancelled while they were queued or running), ``submitted`` (ids in
order), ``fail_next(message)`` (the next submitted request fails in the worker: its poll
raises RuntimeError(message)).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
BUNDLED_TARGET = os.path.join(_ROOT, "python", "dflash2_rt", "models", "default", "target")


def _error_type():
    """dflash2_rt.InvalidArgumentError when the package (with its native core) imports, else a
    local ValueError subclass of the same name: the server maps either to 400."""
    try:
        from dflash2_rt import InvalidArgumentError  # type: ignore

        return InvalidArgumentError
    except Exception:  # noqa: BLE001 - no native core in this checkout
        class InvalidArgumentError(ValueError):
            pass

        return InvalidArgumentError


InvalidArgumentError = _error_type()


@dataclass
class GenerationResult:
    token_ids: list
    finish_reason: str
    stats: dict = field(default_factory=dict)
    text: Optional[str] = None
    logprobs: Optional[list] = None


@dataclass
class Update:
    new_token_ids: list
    finished: bool
    result: Optional[GenerationResult] = None
    new_logprobs: Optional[list] = None


@dataclass
class TokenLogprobs:
    logprob: float
    top_ids: list
    top_logprobs: list


class _Request:
    __slots__ = ("rid", "prompt", "max_new", "temperature", "seed", "stop", "tokens", "pending", "finished",
                 "result", "error", "cancel", "t_submit", "t_start", "steps", "delivered", "fail", "logprobs",
                 "lps", "pending_lps", "stream_index")

    def __init__(self, rid, prompt, max_new, temperature, seed, stop, fail, logprobs=None, stream_index=0):
        self.logprobs = logprobs
        self.lps: list = []
        self.pending_lps: list = []
        self.stream_index = stream_index
        self.rid = rid
        self.prompt = prompt
        self.max_new = max_new
        self.temperature = temperature
        self.seed = seed
        self.stop = stop
        self.tokens: list = []
        self.pending: list = []
        self.finished = False
        self.result = None
        self.error: Optional[BaseException] = None
        self.cancel = False
        self.t_submit = time.perf_counter()
        self.t_start = None
        self.steps = 0
        self.delivered = False
        self.fail = fail


def _h(*parts) -> int:
    d = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(d, "little")


class FakeEngine:
    """See the module docstring."""

    def __init__(self, target=None, draft=None, method: Optional[str] = None, device: str = "cpu", *,
                 max_batch_size: int = 8, max_seq_len: Optional[int] = None, speculation: str = "adaptive",
                 step_time: float = 0.003, eos_every: int = 0, **_ignored):
        if speculation not in ("fixed", "adaptive"):
            raise InvalidArgumentError(f"Engine: speculation must be 'fixed' or 'adaptive', found {speculation!r}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise InvalidArgumentError(f"Engine: max_batch_size must be a positive integer, found {max_batch_size!r}")
        self.target = os.fspath(target) if target is not None else BUNDLED_TARGET
        with open(os.path.join(self.target, "config.json")) as f:
            self._config = json.load(f)
        self.method = method or ("dflash2" if target is None else "ar")
        self.speculation = speculation
        self.max_batch_size = max_batch_size
        mpe = int(self._config.get("max_position_embeddings", 4096))
        self.max_seq_len = int(max_seq_len) if max_seq_len else min(4096, mpe)
        self.tokenizer = None
        tok_path = os.path.join(self.target, "tokenizer.json")
        if os.path.exists(tok_path):
            import tokenizers

            self.tokenizer = tokenizers.Tokenizer.from_file(tok_path)
        self.step_time = step_time
        self.eos_every = eos_every  # > 0: a greedy request emits eos where hash % eos_every == 0
        eos = self._config.get("eos_token_id")
        self._eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # worker wake-up and poll wake-up
        self._requests: dict = {}
        self._waiting: collections.deque = collections.deque()
        self._running: list = []
        self._next_id = 1
        self._closed = False
        self._fail_next: Optional[str] = None
        # counters and recent windows for metrics()
        self._requests_total = 0
        self._requests_finished = 0
        self._generated_total = 0
        self._recent_steps: collections.deque = collections.deque(maxlen=64)  # (t_end, dt, tokens, n_req)
        # test hooks
        self.finish_reasons: dict = {}
        self.cancelled: list = []
        self.submitted: list = []
        self._worker = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ properties

    @property
    def config(self) -> dict:
        return dict(self._config)

    @property
    def vocab_size(self) -> int:
        return int(self._config["vocab_size"])

    def encode(self, text: str) -> list:
        if self.tokenizer is None:
            raise InvalidArgumentError(f"a text prompt needs a tokenizer, but {self.target} has no tokenizer.json")
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: Iterable[int]) -> str:
        if self.tokenizer is None:
            raise InvalidArgumentError(f"{self.target} has no tokenizer.json to decode with")
        return self.tokenizer.decode(list(token_ids))

    # ------------------------------------------------------------------ requests

    def _check_open(self):
        if self._closed:
            raise RuntimeError("Engine: closed")

    def fail_next(self, message: str) -> None:
        """The next submitted request fails in the worker with RuntimeError(message)."""
        with self._lock:
            self._fail_next = message

    def submit(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: Optional[int] = None, stop_token_ids: Optional[Iterable[int]] = None,
               _stream_index: int = 0, logprobs: Optional[int] = None, **adjust) -> int:
        self._check_open()
        for k in adjust:
            if k not in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                         "structured_outputs"):
                raise TypeError(f"submit() got an unexpected keyword argument '{k}'")
        self.last_adjust = dict(adjust)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 20):
            raise InvalidArgumentError(f"submit: logprobs must be None or an integer in [0, 20], found {logprobs!r}")
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            try:
                ids = list(prompt)
            except TypeError:
                raise InvalidArgumentError(f"submit: prompt must be a list of token ids or a str, "
                                           f"found {type(prompt).__name__}") from None
            for j, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise InvalidArgumentError(f"submit: prompt token {j} must be an integer token id, found {t!r}")
                if not 0 <= t < self.vocab_size:
                    raise InvalidArgumentError(
                        f"submit: prompt token {j} = {t} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise InvalidArgumentError("submit: prompt is empty")
        if len(ids) >= self.max_seq_len:
            raise InvalidArgumentError(f"submit: prompt has {len(ids)} tokens; max_seq_len is {self.max_seq_len} "
                                       "(the prompt plus at least one generated token must fit)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidArgumentError(f"submit: max_new_tokens must be a positive integer, found {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise InvalidArgumentError(f"submit: temperature must be a number >= 0, found {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise InvalidArgumentError(f"submit: top_p must be in (0, 1], found {top_p!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InvalidArgumentError(f"submit: top_k must be an integer >= 0, found {top_k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
            raise InvalidArgumentError(f"submit: seed must be None or an integer in [0, 2**63), found {seed!r}")
        if stop_token_ids is None:
            stop = set(self._eos)
        else:
            stop = set()
            for j, t in enumerate(stop_token_ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise InvalidArgumentError(f"submit: stop_token_ids: token {j} must be a token id in "
                                               f"[0, {self.vocab_size}), found {t!r}")
                stop.add(t)
        max_new = min(max_new_tokens, self.max_seq_len - len(ids))
        with self._cv:
            self._check_open()
            rid = self._next_id
            self._next_id += 1
            fail, self._fail_next = self._fail_next, None
            if seed is None and temperature > 0:
                seed = _h("seed", rid, time.time_ns())
            r = _Request(rid, tuple(ids), max_new, float(temperature), seed, stop, fail, logprobs, _stream_index)
            self._requests[rid] = r
            self._waiting.append(r)
            self._requests_total += 1
            self.submitted.append(rid)
            self._cv.notify_all()
        return rid

    def _get(self, rid) -> _Request:
        r = self._requests.get(rid)
        if r is None:
            raise InvalidArgumentError(f"unknown request id {rid!r}")
        return r

    def poll(self, request_id: int, timeout: Optional[float] = None) -> Update:
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        with self._cv:
            r = self._get(request_id)
            while not r.pending and not r.finished:
                if self._closed:
                    raise RuntimeError("Engine: closed")
                if deadline is None:
                    self._cv.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
            new, r.pending = r.pending, []
            lps, r.pending_lps = (r.pending_lps or None), []
            if r.finished:
                r.delivered = True
                self._requests.pop(request_id, None)
                if r.error is not None:
                    raise r.error
                return Update(new, True, r.result, lps)
            return Update(new, False, None, lps)

    def cancel(self, request_id: int) -> None:
        with self._cv:
            r = self._requests.get(request_id)
            if r is None or r.finished or r.cancel:
                return
            r.cancel = True
            self.cancelled.append(request_id)
            if r in self._waiting:  # never started: ends now
                self._waiting.remove(r)
                self._finish(r, "cancelled")
            self._cv.notify_all()

    # ------------------------------------------------------------------ worker

    def _token(self, r: _Request, pos: int) -> int:
        key = ("tok", r.prompt, pos) if r.temperature == 0 else ("tok", r.prompt, pos, r.seed, r.temperature,
                                                                 r.stream_index)
        h = _h(*key)
        if self.eos_every and self._eos and h % self.eos_every == 0:
            return self._eos[0]
        return 2 + h % (self.vocab_size - 2)

    def _logprob(self, r: _Request, t: int, pos: int) -> TokenLogprobs:
        """Made-up log-probabilities, deterministic: the token's, and r.logprobs distinct ids
        with decreasing values (the token first when greedy)."""
        own = -(_h("lp", r.prompt, pos, t) % 4000) / 1000.0
        ids, vals = [], []
        if r.temperature == 0 and r.logprobs:
            ids, vals = [t], [own]
        j = 0
        while len(ids) < r.logprobs:
            i = 2 + _h("top", r.prompt, pos, j) % (self.vocab_size - 2)
            j += 1
            if i not in ids:
                ids.append(i)
                vals.append((vals[-1] if vals else own + 0.5) - 0.25)
        return TokenLogprobs(own, ids, vals)

    def logits(self, token_ids) -> "object":
        """float32 [n, vocab]: made-up logits, row j a function of token_ids[:j + 1]."""
        import numpy as np

        ids = list(token_ids)
        out = np.empty((len(ids), self.vocab_size), np.float32)
        for j in range(len(ids)):
            out[j] = np.random.default_rng(_h("logits", tuple(ids[:j + 1]))).standard_normal(self.vocab_size)
        return out

    def _finish(self, r: _Request, reason: str) -> None:  # under the lock
        now = time.perf_counter()
        t0 = r.t_start if r.t_start is not None else now
        decode_s = max(now - t0, 1e-9)
        n = len(r.tokens)
        text = self.tokenizer.decode(list(r.tokens)) if self.tokenizer is not None else None
        stats = {"prompt_tokens": len(r.prompt), "generated_tokens": n,
                 "acceptance_length": (n / r.steps) if r.steps else 0.0, "verify_steps": r.steps,
                 "prefill_s": 0.0, "decode_s": decode_s, "queue_s": t0 - r.t_submit,
                 "tokens_per_second": n / decode_s}
        r.result = GenerationResult(list(r.tokens), reason, stats, text,
                                    list(r.lps) if r.logprobs is not None else None)
        r.finished = True
        self._requests_finished += 1
        self.finish_reasons[r.rid] = reason
        if r in self._running:
            self._running.remove(r)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not self._running:
                    self._cv.wait()
                if self._closed:
                    return
                while self._waiting and len(self._running) < self.max_batch_size:
                    r = self._waiting.popleft()
                    r.t_start = time.perf_counter()
                    self._running.append(r)
                batch = list(self._running)
            t0 = time.perf_counter()
            time.sleep(self.step_time)
            produced = 0
            with self._cv:
                for r in batch:
                    if r.finished:
                        continue
                    if r.cancel:
                        self._finish(r, "cancelled")
                        continue
                    if r.fail is not None:
                        r.error = RuntimeError(r.fail)
                        self._finish(r, "error")
                        continue
                    k = 1 + _h("accept", r.prompt, len(r.tokens)) % 4
                    r.steps += 1
                    reason = None
                    for _ in range(k):
                        t = self._token(r, len(r.tokens))
                        r.tokens.append(t)
                        r.pending.append(t)
                        if r.logprobs is not None:
                            lp = self._logprob(r, t, len(r.tokens) - 1)
                            r.lps.append(lp)
                            r.pending_lps.append(lp)
                        produced += 1
                        if t in r.stop:
                            reason = "stop"
                            break
                        if len(r.tokens) >= r.max_new:
                            reason = "length"
                            break
                    if reason is not None:
                        self._finish(r, reason)
                self._generated_total += produced
                dt = time.perf_counter() - t0
                self._recent_steps.append((time.perf_counter(), dt, produced, len(batch)))
                self._cv.notify_all()

    # ------------------------------------------------------------------ convenience API

    def stream(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: Optional[int] = None, stop_token_ids=None, on_result=None) -> Iterator[int]:
        rid = self.submit(prompt, max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids)

        def gen():
            done = False
            try:
                while True:
                    u = self.poll(rid)
                    yield from u.new_token_ids
                    if u.finished:
                        done = True
                        if on_result is not None:
                            on_result(u.result)
                        return
            finally:
                if not done:
                    self.cancel(rid)

        return gen()

    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: Optional[int] = None, stop_token_ids=None) -> list:
        ids = [self.submit(p, max_new_tokens, temperature, top_p, top_k, None if seed is None else seed + i,
                           stop_token_ids) for i, p in enumerate(prompts)]
        out = []
        for rid in ids:
            while True:
                u = self.poll(rid)
                if u.finished:
                    out.append(u.result)
                    break
        return out

    def metrics(self) -> dict:
        self._check_open()
        with self._lock:
            now = time.perf_counter()
            recent = [s for s in self._recent_steps if now - s[0] < 2.0]
            toks = sum(s[2] for s in recent)
            span = (now - recent[0][0] + recent[0][1]) if recent else 0.0
            reqsteps = sum(s[3] for s in recent)
            return {
                "queue_length": len(self._waiting),
                "running": len(self._running),
                "requests_total": self._requests_total,
                "requests_finished": self._requests_finished,
                "generated_tokens_total": self._generated_total,
                "tokens_per_second": toks / span if span > 0 else 0.0,
                "acceptance_length": toks / reqsteps if reqsteps else 0.0,
                "step_time_s": (sum(s[1] for s in recent) / len(recent)) if recent else 0.0,
                "max_batch_size": self.max_batch_size,
            }

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for r in list(self._waiting) + list(self._running):
                if not r.finished:
                    self._finish(r, "cancelled")
            self._waiting.clear()
            self._cv.notify_all()
        self._worker.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
