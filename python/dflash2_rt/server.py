"""An OpenAI-compatible HTTP server over a ``dflash2_rt.Engine`` (FastAPI + uvicorn).

    from dflash2_rt import Engine
    from dflash2_rt.server import create_app, run
    eng = Engine(max_batch_size=8, speculation="adaptive")
    run(eng, host="127.0.0.1", port=8000)          # or: dflash2-rt serve --port 8000

Endpoints
    POST /v1/completions        prompt (a string, a list of token ids, or a list of several of
                                those: one set of choices per prompt), max_tokens (default 16),
                                temperature (default 1), top_p, seed, stop (strings, matched on the
                                text: the output is cut before the match, finish_reason "stop"), n
                                (choices per prompt; choice k = prompt k // n, sample k % n, each an
                                engine request; seeded choices draw from distinct streams),
                                best_of (>= n: best_of samples per prompt, the n with the highest
                                mean log-probability per token returned; not streamed; usage
                                counts every sample),
                                logprobs (0..20: every generated token's log-probability under the
                                target and the top ones', OpenAI's tokens / token_logprobs /
                                top_logprobs / text_offset), echo (the prompt before the text; with
                                logprobs its tokens scored too, the first as null; max_tokens 0
                                with echo scores a prompt without generating), stream (SSE
                                "data: {...}" chunks, then "data: [DONE]"),
                                stream_options.include_usage, presence_penalty /
                                frequency_penalty / logit_bias (repetition control, applied to the
                                target's logits: speculative decoding stays lossless); suffix
                                unsupported (400)
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template
                                (tokenizer_config.json "chat_template" or chat_template.jinja in
                                the target directory, or create_app(chat_template=...)); without
                                one: 400 naming the missing template. max_tokens /
                                max_completion_tokens default to the rest of the context; n;
                                logprobs (true) with top_logprobs (0..20): logprobs.content; text
                                content parts only; no tools. response_format json_object /
                                json_schema: structured output (below)
    POST /tokenize              {"prompt": text[, "add_special_tokens"]} or {"messages": [...]}
                                (rendered with the chat template) -> {"tokens", "count",
                                "max_model_len"}; POST /detokenize {"tokens": [...]} -> {"prompt"}
                                (vLLM's endpoints)
    GET  /v1/models, /v1/models/{id}
    GET  /health                200 {"status": "ok"} while the engine answers metrics(), else 503
    GET  /metrics               Prometheus text exposition: dflash2_queue_length,
                                dflash2_running_requests, dflash2_tokens_per_second,
                                dflash2_acceptance_length, dflash2_step_time_seconds,
                                dflash2_requests_total, dflash2_requests_finished_total,
                                dflash2_generated_tokens_total (from Engine.metrics(); its other
                                numeric keys as dflash2_engine_<key>), and the server's
                                dflash2_http_requests_total{endpoint,code},
                                dflash2_server_active_requests, dflash2_client_disconnects_total,
                                dflash2_stop_string_matches_total, dflash2_prompt_tokens_total,
                                dflash2_completion_tokens_total

Extensions (request fields): top_k (0 or -1: off), structured output on both endpoints (the grammar engine llguidance: pip install llguidance):
response_format {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}
(OpenAI's), structured_outputs {"json" | "regex" | "choice" | "grammar" (Lark) | "json_object",
"disable_any_whitespace"} and guided_json / guided_regex / guided_choice / guided_grammar (vLLM's),
one of them per request; speculative decoding stays lossless under it. include_stop_str_in_output (a matched stop
string stays at the end of the text: vLLM's), skip_special_tokens (default true; false: special
tokens' text stays in the output text: vLLM's), repetition_penalty ([0.01, 100], 1 = off: vLLM's),
min_tokens (no stop token or stop string before that many tokens: vLLM's), stop_token_ids (in addition to the
checkpoint's eos ids), ignore_eos (do not stop at eos), return_token_ids (the choice gets
"token_ids": all generated ids; in a stream, each chunk's new ids),
stream_options.continuous_usage_stats (every chunk carries the cumulative usage; with
include_usage), chat_template_kwargs (extra template variables). Responses carry a "dflash2"
object with the request's engine stats (acceptance_length, verify_steps, prefill_s, decode_s,
tokens_per_second, ...): at the top level, and in a stream's last chunk. Stop tokens (eos,
stop_token_ids) are counted in usage and listed in token_ids but not part of the text.
Context: a prompt of max_seq_len tokens or more, or an explicit max_tokens that does not fit
after the prompt, is a 400 (as OpenAI answers), never cut silently.

API key: ``create_app(api_key=...)`` / ``dflash2-rt serve --api-key KEY`` (or the
DFLASH2_API_KEY environment variable): every /v1/* request needs "Authorization: Bearer KEY",
else 401 ``invalid_api_key`` (what the openai client sends with ``api_key=KEY``).

Model names: ``model`` may be omitted; when given it must be the served name
(``create_app(model_name=...)``, by default the target directory's name, "default" for the
bundled pair), else 404 ``model_not_found`` as OpenAI answers.

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: client mistakes
(malformed JSON, missing or invalid fields, unsupported options such as tools or suffix, a
prompt too long for max_seq_len, an engine InvalidArgumentError) are 400 naming the
field in ``param`` and in the message; other engine errors are 500 with their message.

Each choice is one engine request, submitted and polled by a thread of its own (so no
engine call ever runs on the event loop); the thread detokenizes incrementally (correct for
byte-level BPE: partial UTF-8 characters are held back), applies stop strings on the text
(holding back a possible stop-string prefix; on a match it cancels the engine request) and
hands text deltas to the event loop. A client that disconnects -- streaming or not -- gets
its engine request cancelled within one poll interval plus one engine step.

This module imports nothing from the dflash2_rt package at import time (the engine is passed
in), so it can be used and tested with a stand-in engine without the native core.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import numbers
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, Optional

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("dflash2_rt.server")

_POLL_S = 0.1             # poll timeout of the request threads: how often they look at a cancel flag
_CANCEL_DRAIN_S = 30.0    # after a cancel, how long a request thread waits for the engine to end it
_I64_MAX = 2 ** 63 - 1
_MAX_N = 64               # choices per request (n x prompts)
_MAX_LOGPROBS = 20        # top log-probabilities per token (the engine's bound)


# ----------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, type_: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: Optional[str], message: str) -> ApiError:
    return ApiError(400, message, param)


def _is_invalid_argument(e: BaseException) -> bool:
    """dflash2_rt.InvalidArgumentError (or a stand-in engine's error of that name)."""
    return any(c.__name__ == "InvalidArgumentError" for c in type(e).__mro__)


# engine argument names -> API field names, for the `param` of a 400 from the engine
_ENGINE_PARAMS = [("max_new_tokens", "max_tokens"), ("stop_token_ids", "stop_token_ids"), ("top_p", "top_p"),
                  ("top_k", "top_k"), ("temperature", "temperature"), ("seed", "seed"), ("logprobs", "logprobs"),
                  ("prompt", "prompt"), ("structured_outputs", "response_format")]


def _engine_error(e: BaseException) -> ApiError:
    msg = " ".join(str(e).split()) or type(e).__name__
    if _is_invalid_argument(e):
        param = next((api for name, api in _ENGINE_PARAMS if name in msg), None)
        return ApiError(400, msg, param)
    if any(c.__name__ == "UnsupportedError" for c in type(e).__mro__):  # e.g. structured output without llguidance
        return ApiError(400, msg, None)
    return ApiError(500, f"{type(e).__name__}: {msg}", None, "server_error")


# ----------------------------------------------------------------------------- validation


def _short(v: Any) -> str:
    r = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__
    return r if len(r) <= 60 else r[:57] + "..."


def _int(body: dict, name: str, default, lo: Optional[int] = None, hi: Optional[int] = None, what: str = ""):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"'{name}' must be an integer{what}, found {_short(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(name, f"'{name}' must be an integer{what}, found {v}")
    return v


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    try:  # (an integer too large for a float overflows: a 400 like any other bad number)
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v))
    except OverflowError:
        ok = False
    if not ok:
        raise _bad(name, f"'{name}' must be a finite number, found {_short(v)}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a boolean, found {_short(v)}")
    return v


def _unsupported(body: dict, name: str, ok: Callable[[Any], bool], message: str) -> None:
    v = body.get(name)
    if v is not None and not ok(v):
        raise _bad(name, message)


class _Params:
    """A request's generation arguments, checked."""

    __slots__ = ("max_tokens", "max_tokens_given", "max_tokens_param", "temperature", "top_p", "top_k", "seed",
                 "stop", "stop_token_ids", "ignore_eos", "stream", "include_usage", "continuous_usage",
                 "return_token_ids", "n", "best_of", "logprobs", "echo", "adjust", "include_stop",
                 "skip_special", "structured_param")


def _parse_adjust(body: dict, vocab_size: Optional[int]) -> dict:
    """Repetition control: OpenAI's presence_penalty / frequency_penalty ([-2, 2]) and
    logit_bias ({"token id": bias in [-100, 100]}), vLLM's repetition_penalty ([0.01, 100], 1 = off)
    and min_tokens; the engine keyword arguments that differ from the defaults."""
    out: dict = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name, 0.0)
        if not -2 <= v <= 2:
            raise _bad(name, f"'{name}' must be in [-2, 2], found {v:g}")
        if v:
            out[name] = v
    rp = _number(body, "repetition_penalty", 1.0)
    if not 0.01 <= rp <= 100:
        raise _bad("repetition_penalty", f"'repetition_penalty' must be in [0.01, 100] (1 = off), found {rp:g}")
    if rp != 1:
        out["repetition_penalty"] = rp
    mt = _int(body, "min_tokens", 0, 0, None, " >= 0")
    if mt:
        out["min_tokens"] = mt
    lb = body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise _bad("logit_bias", f"'logit_bias' must be an object mapping token ids to biases, found {_short(lb)}")
        bias = {}
        for k, v in lb.items():
            if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12):
                raise _bad("logit_bias", f"'logit_bias' key {_short(k)} is not a token id")
            t = int(k)
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise _bad("logit_bias", f"'logit_bias': token {t} is outside the vocabulary [0, {vocab_size})")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise _bad("logit_bias", f"'logit_bias' of token {t} must be a number in [-100, 100], found {_short(v)}")
            bias[t] = float(v)
        if bias:
            out["logit_bias"] = bias
    return out


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def _parse_structured(body: dict) -> Optional[tuple]:
    """Structured output: OpenAI's response_format (json_object, json_schema), vLLM's
    structured_outputs ({json | regex | choice | grammar | json_object, disable_any_whitespace})
    and its older guided_json / guided_regex / guided_choice / guided_grammar; at most one of
    them. (the field, the spec for the engine: dflash2_rt.structured; the engine checks its
    contents) or None."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise _bad("response_format", "'response_format' must be an object with a 'type'")
        t = rf["type"]
        if t == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js or not isinstance(js["schema"], (dict, bool)):
                raise _bad("response_format", "'response_format' of type json_schema needs 'json_schema': "
                                              "{\"name\": ..., \"schema\": {...}}")
            found.append(("response_format", {"json": js["schema"]}))
        elif t != "text":
            raise _bad("response_format", f"'response_format' type must be text, json_object or json_schema, "
                                          f"found {_short(t)}")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", f"'structured_outputs' must be an object, found {_short(so)}")
        found.append(("structured_outputs", {k: v for k, v in so.items() if v is not None}))
    for name, key in _GUIDED:
        if body.get(name) is not None:
            found.append((name, {key: body[name]}))
    if len(found) > 1:
        raise _bad(found[1][0], f"only one of {', '.join(n for n, _ in found)} may be given")
    return found[0] if found else None


def _parse_common(body: dict, *, chat: bool, vocab_size: Optional[int]) -> _Params:
    p = _Params()
    p.n = _int(body, "n", 1, 1, _MAX_N, f" in [1, {_MAX_N}]")
    p.best_of = _int(body, "best_of", p.n, 1, _MAX_N, f" in [1, {_MAX_N}]")
    if p.best_of < p.n:
        if body.get("best_of") == 1:  # OpenAI's default value: the same as n
            p.best_of = p.n
        else:
            raise _bad("best_of", f"'best_of' ({p.best_of}) must be >= 'n' ({p.n})")
    p.adjust = _parse_adjust(body, vocab_size)
    so = _parse_structured(body)
    p.structured_param = so[0] if so else None
    if so is not None:
        p.adjust["structured_outputs"] = so[1]
    p.echo = False
    if chat:
        want = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, 0, _MAX_LOGPROBS, f" in [0, {_MAX_LOGPROBS}]")
        if top is not None and not want:
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        p.logprobs = (top or 0) if want else None
        _unsupported(body, "echo", lambda v: v is False, "'echo' is not supported in chat completions")
        _unsupported(body, "tools", lambda v: v == [], "'tools' (function calling) is not supported")
        _unsupported(body, "tool_choice", lambda v: v == "none", "'tool_choice' is not supported")
    else:
        p.logprobs = _int(body, "logprobs", None, 0, _MAX_LOGPROBS, f" in [0, {_MAX_LOGPROBS}]")
        p.echo = _bool(body, "echo", False)
        _unsupported(body, "suffix", lambda v: v == "", "'suffix' is not supported")

    name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    v = body.get(name)
    if p.echo and isinstance(v, int) and not isinstance(v, bool) and v == 0:  # scoring a prompt, nothing generated
        p.max_tokens = 0
    else:
        p.max_tokens = _int(body, name, None, 1, None, " >= 1" + (" (or 0 with 'echo')" if not chat else ""))
    p.max_tokens_param = name
    p.max_tokens_given = p.max_tokens is not None
    if p.max_tokens_given and p.adjust.get("min_tokens", 0) > max(p.max_tokens, 1):
        raise _bad("min_tokens", f"'min_tokens' ({p.adjust['min_tokens']}) must not exceed '{name}' ({p.max_tokens})")
    if not p.max_tokens_given and not chat:
        p.max_tokens = 16  # OpenAI's default for completions
    p.temperature = _number(body, "temperature", 1.0)  # OpenAI's default: sampling
    if p.temperature < 0:
        raise _bad("temperature", f"'temperature' must be >= 0, found {p.temperature:g}")
    p.top_p = _number(body, "top_p", 1.0)
    if not 0 < p.top_p <= 1:
        raise _bad("top_p", f"'top_p' must be in (0, 1], found {p.top_p:g}")
    p.top_k = _int(body, "top_k", 0, -1, None, " >= -1 (0 or -1: no top-k)")
    if p.top_k < 0:
        p.top_k = 0
    p.seed = _int(body, "seed", None, 0, _I64_MAX, " in [0, 2**63)")

    stop = body.get("stop")
    if stop is None:
        p.stop = []
    elif isinstance(stop, str):
        p.stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        p.stop = list(stop)
    else:
        raise _bad("stop", f"'stop' must be a string or a list of strings, found {_short(stop)}")
    if any(s == "" for s in p.stop):
        raise _bad("stop", "'stop' strings must not be empty")

    sti = body.get("stop_token_ids")
    if sti is None:
        p.stop_token_ids = []
    elif isinstance(sti, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in sti):
        for t in sti:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise _bad("stop_token_ids", f"'stop_token_ids': {t} is outside the vocabulary [0, {vocab_size})")
        p.stop_token_ids = list(sti)
    else:
        raise _bad("stop_token_ids", f"'stop_token_ids' must be a list of token ids, found {_short(sti)}")

    p.ignore_eos = _bool(body, "ignore_eos", False)
    p.include_stop = _bool(body, "include_stop_str_in_output", False)
    p.skip_special = _bool(body, "skip_special_tokens", True)
    p.stream = _bool(body, "stream", False)
    if p.stream and p.best_of > p.n:
        raise _bad("best_of", "'best_of' > 'n' cannot be streamed (the best choices are known at the end)")
    if p.best_of > p.n and p.temperature == 0:
        raise _bad("best_of", "'best_of' > 'n' needs sampling (temperature > 0): greedy samples are all alike")
    p.return_token_ids = _bool(body, "return_token_ids", False)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise _bad("stream_options", f"'stream_options' must be an object, found {_short(so)}")
    so = so or {}
    for key in ("include_usage", "continuous_usage_stats"):
        if so.get(key) is not None and not isinstance(so[key], bool):
            raise _bad("stream_options", f"'stream_options.{key}' must be a boolean, found {_short(so[key])}")
    p.include_usage = bool(so.get("include_usage"))
    p.continuous_usage = p.include_usage and bool(so.get("continuous_usage_stats"))
    return p


# ----------------------------------------------------------------------------- text


class Detokenizer:
    """Incremental text of a growing list of token ids.

    ``add(ids)`` returns the new text that is stable: the decode of a window of recent ids
    (the ids since the previous emission plus those of the emission before, as context) minus
    the decode of its context part -- held back while it ends with U+FFFD, i.e. while the last
    bytes may be an incomplete UTF-8 character of a byte-level BPE. ``flush()`` returns the
    rest at the end, from one decode of all ids, so that the concatenated pieces equal
    ``decode(all ids)``."""

    def __init__(self, decode: Callable[[list], str]):
        self._decode = decode
        self.ids: list = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, ids) -> str:
        if not ids:
            return ""
        self.ids.extend(ids)
        context = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return ""
        if not window.startswith(context):  # a tokenizer whose decode is not local: decode everything
            full = self._decode(self.ids)
            if full.endswith("\ufffd") or not full.startswith(self.text):
                return ""
            delta = full[len(self.text):]
        else:
            delta = window[len(context):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        full = self._decode(self.ids)
        if full.startswith(self.text):
            delta = full[len(self.text):]
        else:
            context = self._decode(self.ids[self._prefix:self._read])
            window = self._decode(self.ids[self._prefix:])
            delta = window[len(context):] if window.startswith(context) else ""
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


class StopStrings:
    """Stop sequences on streamed text: ``feed(delta)`` -> (text safe to release, matched).
    Text that could be the start of a stop string is held back until it is known not to be;
    on a match the text before the stop string (with include: and the stop string) is released
    and the rest dropped. Of several matches the earliest wins (at one position: the first
    listed)."""

    def __init__(self, stops: list, include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self.buf = ""

    def feed(self, delta: str, match: bool = True) -> tuple:
        """match=False (the text of tokens before min_tokens): nothing matches, but the end
        that could start a stop string is still held back (a stop string may end in a later
        token's text)."""
        if not self.stops:
            return delta, False
        buf = self.buf + delta
        cut, hit = -1, ""
        for s in self.stops if match else ():
            i = buf.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut, hit = i, s
        if cut >= 0:
            self.buf = ""
            return buf[:cut + (len(hit) if self.include else 0)], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.buf = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def finish(self, delta: str, match: bool = True) -> tuple:
        out, hit = self.feed(delta, match)
        if not hit:
            out, self.buf = out + self.buf, ""
        return out, hit


# ----------------------------------------------------------------------------- one request


class _Job:
    """One engine request, driven by a thread of its own: submit, then poll with a short
    timeout (looking at the cancel flag between polls), detokenize, apply stop strings, and
    post events to the event loop's queue:
    ("started", rid) | ("error", exc) first, then ("delta", text, new_ids, n_generated, new_logprobs)*,
    then ("done", text, finish_reason, result, n_generated) or ("error", exc)."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, prompt_ids: list, sampling: dict,
                 stop_strings: list, hidden_ids: set, decode: Optional[Callable[[list], str]], on_stop_string=None,
                 include_stop: bool = False):
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._prompt = prompt_ids
        self._sampling = sampling
        self._stops = stop_strings
        self._hidden = hidden_ids
        self._decode = decode
        self._on_stop_string = on_stop_string
        self._include_stop = include_stop  # vLLM's include_stop_str_in_output
        self._min_tokens = int(sampling.get("min_tokens", 0))
        self._cancel = threading.Event()
        self._abandoned = False
        self.finished = False
        self.rid: Optional[int] = None
        self._thread = threading.Thread(target=self._run, name="dflash2-request", daemon=True)

    def start(self) -> "_Job":
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Ends the engine request (the thread calls engine.cancel at its next poll) and stops
        posting events: nobody reads them any more."""
        self._abandoned = True
        self._cancel.set()

    def _post(self, ev: tuple) -> None:
        if self._abandoned:
            return
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the event loop is closed (server shut down): end the request
            self._abandoned = True
            self._cancel.set()

    def _run(self) -> None:
        eng = self.engine
        try:
            rid = eng.submit(self._prompt, **self._sampling)
        except BaseException as e:  # noqa: BLE001 - handed to the event loop
            self.finished = True
            self._post(("error", e))
            return
        self.rid = rid
        self._post(("started", rid))
        detok = Detokenizer(self._decode) if self._decode is not None else None
        stops = StopStrings(self._stops, self._include_stop)
        stopped = False      # a stop string matched: later tokens are dropped
        cancel_at = None     # monotonic time engine.cancel was called
        n = 0
        while True:
            if self._cancel.is_set() and cancel_at is None:
                cancel_at = time.monotonic()
                try:
                    eng.cancel(rid)
                except Exception:  # noqa: BLE001 - the poll below reports the state
                    log.debug("cancel(%s) failed", rid, exc_info=True)
            try:
                upd = eng.poll(rid, timeout=_POLL_S)
            except BaseException as e:  # noqa: BLE001
                self.finished = True
                self._post(("error", e))
                return
            new = list(upd.new_token_ids)
            if new:
                # vLLM's min_tokens: a stop string must end in the text of token min_tokens or
                # later; the tokens before it go through without matching (their text's end
                # still held back: a stop string may start there)
                early = max(0, min(len(new), self._min_tokens - 1 - n))
                n += len(new)
                if not stopped and not self._abandoned:
                    text, hit = "", False
                    for part, match in ((new[:early], False), (new[early:], True)):
                        if not part:
                            continue
                        piece = ""
                        if detok is not None:
                            try:
                                piece = detok.add([t for t in part if t not in self._hidden])
                            except Exception as e:  # noqa: BLE001 - a decode failure ends the request
                                self._cancel.set()
                                self.finished = True
                                self._post(("error", e))
                                self._drain(rid)
                                return
                        piece, hit = stops.feed(piece, match)
                        text += piece
                    if hit:
                        stopped = True
                        self._cancel.set()
                        if self._on_stop_string is not None:
                            self._on_stop_string()
                    self._post(("delta", text, new, n, list(getattr(upd, "new_logprobs", None) or [])))
            if upd.finished:
                result = upd.result
                text = ""
                if not stopped and not self._abandoned:
                    tail = detok.flush() if detok is not None else ""
                    text, hit = stops.finish(tail, n >= self._min_tokens)
                    stopped = stopped or hit
                reason = "stop" if stopped else getattr(result, "finish_reason", "stop")
                self.finished = True
                self._post(("done", text, reason, result, n))
                return
            if cancel_at is not None and time.monotonic() - cancel_at > _CANCEL_DRAIN_S:
                log.warning("request %s: still not ended %.0f s after cancel; giving up on it", rid, _CANCEL_DRAIN_S)
                self.finished = True
                self._post(("error", RuntimeError(f"request {rid} did not end after cancel")))
                return

    def _drain(self, rid) -> None:
        try:
            self.engine.cancel(rid)
            t0 = time.monotonic()
            while time.monotonic() - t0 < _CANCEL_DRAIN_S:
                if self.engine.poll(rid, timeout=_POLL_S).finished:
                    return
        except Exception:  # noqa: BLE001
            pass

    async def events(self):
        """The events in order, the deltas already queued merged into one (one chunk, one write
        for a reader that fell behind); a checkpoint before each, so that a writer never
        monopolizes the loop (nor misses the client's disconnect) while events are queued."""
        pending = None
        while True:
            await asyncio.sleep(0)
            ev = pending if pending is not None else await self.queue.get()
            pending = None
            if ev[0] == "delta":
                while not self.queue.empty():
                    nxt = self.queue.get_nowait()
                    if nxt[0] != "delta":
                        pending = nxt
                        break
                    ev = ("delta", ev[1] + nxt[1], ev[2] + nxt[2], nxt[3], ev[4] + nxt[4])
            yield ev
            if ev[0] in ("done", "error"):
                return


# ----------------------------------------------------------------------------- chat template


def _load_chat_template(target: Optional[str], override: Optional[str]) -> tuple:
    """(template source or None, special tokens dict, where it came from)."""
    special: dict = {}
    cfg_path = os.path.join(target, "tokenizer_config.json") if target else None
    cfg: dict = {}
    if cfg_path and os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            log.warning("cannot read %s: %s", cfg_path, e)
            cfg = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            special[k] = v
    if override is not None:
        if os.path.isfile(override):
            with open(override, encoding="utf-8") as f:
                return f.read(), special, override
        return override, special, "chat_template argument"
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tpl, str) and tpl:
        return tpl, special, cfg_path
    jinja_path = os.path.join(target, "chat_template.jinja") if target else None
    if jinja_path and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), special, jinja_path
    return None, special, None


def _compile_template(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(source)


def _chat_messages(body: dict) -> list:
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("messages", "'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "'messages' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad("messages", f"'{where}' must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _bad("messages", f"'{where}.role' must be a non-empty string")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad("messages", f"'{where}.content[{j}]': only text parts "
                                           "({\"type\": \"text\", \"text\": ...}) are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise _bad("messages", f"'{where}.content' must be a string or a list of text parts")
        mm = dict(m)
        mm["content"] = content if content is not None else ""
        out.append(mm)
    return out


# ----------------------------------------------------------------------------- responses


class _EventStream(StreamingResponse):
    """Server-sent events that always watch for the client's disconnect (whatever ASGI spec
    version the server announces), then close the body generator and call ``on_close`` --
    which cancels the engine request unless it ended -- however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close: Callable[[], None], **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone
                        pass
                    tg.cancel_scope.cancel()

                async def listen() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            break
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(listen)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()
            finally:
                self._on_close()


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _jsonable(v):
    """stats as JSON: numpy scalars to Python numbers, non-finite floats to None."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        f = float(v)
        return f if math.isfinite(f) else None
    if hasattr(v, "tolist"):  # a numpy array
        return _jsonable(v.tolist())
    return str(v)


def _prom_value(v) -> str:
    f = float(v)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f.is_integer() and abs(f) < 2 ** 53:
        return str(int(f))
    return repr(f)


# engine metric -> (exposed name, type, help)
_ENGINE_METRICS = [
    ("queue_length", "dflash2_queue_length", "gauge", "Requests waiting for a batch slot."),
    ("running", "dflash2_running_requests", "gauge", "Requests in the running batch."),
    ("tokens_per_second", "dflash2_tokens_per_second", "gauge", "Generated tokens per second (recent)."),
    ("acceptance_length", "dflash2_acceptance_length", "gauge",
     "Mean committed tokens per request per verify step (recent)."),
    ("step_time_s", "dflash2_step_time_seconds", "gauge", "Mean engine step time in seconds (recent)."),
    ("requests_total", "dflash2_requests_total", "counter", "Requests submitted to the engine."),
    ("requests_finished", "dflash2_requests_finished_total", "counter", "Requests the engine finished."),
    ("generated_tokens_total", "dflash2_generated_tokens_total", "counter", "Tokens generated by the engine."),
]


def _metric_name(key: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
    return "dflash2_engine_" + out.strip("_")


class _Counters:
    """The server's own counters (the event loop's thread only, no lock needed, except for
    the stop-string counter incremented from request threads: guarded)."""

    def __init__(self):
        self.http: dict = {}           # (endpoint, status) -> count
        self.disconnects = 0           # requests cancelled because their client went away
        self.active = 0                # generation requests in flight
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._lock = threading.Lock()
        self.stop_strings = 0          # requests ended by a stop string

    def stop_string(self) -> None:
        with self._lock:
            self.stop_strings += 1


# ----------------------------------------------------------------------------- the app


def default_model_name(engine) -> str:
    """The target directory's name ('default' for the bundled pair, whose target is
    models/default/target)."""
    target = getattr(engine, "target", None)
    if not target:
        return "dflash2"
    path = os.path.normpath(os.fspath(target))
    name = os.path.basename(path)
    if name == "target":
        name = os.path.basename(os.path.dirname(path)) or name
    return name or "dflash2"


class _Choice:
    """One choice of a request: its prompt, its engine request (none for echo with max_tokens
    0) and what came back."""

    def __init__(self, index: int, ids: list, text: Optional[str], max_tokens: int):
        self.index = index
        self.ids = ids
        self.text = text          # the prompt's text (echo)
        self.max_tokens = max_tokens
        self.job: Optional[_Job] = None
        self.rid = None
        self.prompt_lps: Optional[list] = None  # echo with logprobs: the prompt tokens'
        self.texts: list = []
        self.ids_out: list = []
        self.lps: list = []
        self.done: Optional[tuple] = None
        self.error: Optional[BaseException] = None


class _Logprob:
    """A prompt token's log-probabilities (the engine's TokenLogprobs shape)."""

    __slots__ = ("logprob", "top_ids", "top_logprobs")

    def __init__(self, logprob: float, top_ids: list, top_logprobs: list):
        self.logprob = logprob
        self.top_ids = top_ids
        self.top_logprobs = top_logprobs


class _Service:
    def __init__(self, engine, model_name: str, chat_template: Optional[str]):
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())
        self.counters = _Counters()
        self._tok_text: dict = {}  # token id -> its text (log-probabilities)
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.max_seq_len = getattr(engine, "max_seq_len", None)
        try:
            self.vocab_size = int(engine.vocab_size)
        except Exception:  # noqa: BLE001
            self.vocab_size = None
        cfg = {}
        try:
            cfg = dict(engine.config or {})
        except Exception:  # noqa: BLE001
            pass
        self.eos_ids = set(self._ids(cfg.get("eos_token_id")))
        target = getattr(engine, "target", None)
        gen_cfg = os.path.join(target, "generation_config.json") if target else None
        if gen_cfg and os.path.isfile(gen_cfg):
            try:
                with open(gen_cfg, encoding="utf-8") as f:
                    self.eos_ids |= set(self._ids(json.load(f).get("eos_token_id")))
            except (OSError, ValueError):
                pass
        self.template_source, self.special_tokens, self.template_origin = _load_chat_template(
            os.fspath(target) if target else None, chat_template)
        self.template = None
        self.template_error = None
        if self.template_source is not None:
            try:
                self.template = _compile_template(self.template_source)
            except Exception as e:  # noqa: BLE001 - reported on each chat request
                self.template_error = f"the chat template ({self.template_origin}) does not compile: {e}"
                log.warning(self.template_error)

    @staticmethod
    def _ids(v) -> list:
        if v is None:
            return []
        if isinstance(v, int) and not isinstance(v, bool):
            return [v]
        if isinstance(v, list):
            return [t for t in v if isinstance(t, int) and not isinstance(t, bool)]
        return []

    # ------------------------------------------------------------------ helpers

    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is None:
            return
        if not isinstance(m, str):
            raise _bad("model", f"'model' must be a string, found {_short(m)}")
        if m != self.model_name:
            raise ApiError(404, f"The model '{m}' does not exist; this server serves '{self.model_name}'",
                           "model", "invalid_request_error", "model_not_found")

    def encode(self, text: str, special: bool = True) -> list:
        if self.tokenizer is None:
            raise _bad("prompt", "this model has no tokenizer (no tokenizer.json in its target directory): "
                                 "send the prompt as a list of token ids")
        if not special:
            try:
                return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
            except TypeError:
                pass
        if hasattr(self.engine, "encode"):
            return list(self.engine.encode(text))
        return list(self.tokenizer.encode(text).ids)

    def decoder(self, skip_special: bool = True) -> Optional[Callable[[list], str]]:
        """Token ids -> text (None without a tokenizer); skip_special=False keeps the special
        tokens' text (vLLM's skip_special_tokens: false)."""
        if self.tokenizer is None:
            return None
        if not skip_special:
            return lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return self.engine.decode if hasattr(self.engine, "decode") else (lambda ids: self.tokenizer.decode(ids))

    def token_ids(self, v, param: str = "prompt") -> list:
        ids = list(v)
        for j, t in enumerate(ids):
            if self.vocab_size is not None and not 0 <= t < self.vocab_size:
                raise _bad(param, f"'{param}': token {j} = {t} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    async def completion_prompts(self, body: dict) -> list:
        """[(token ids, the prompt's text or None)] of 'prompt': a string, a list of token ids,
        or a list of several of those (a batch: one choice set per prompt)."""
        prompt = body.get("prompt")
        if prompt is None:
            raise _bad("prompt", "'prompt' is required")
        if isinstance(prompt, list) and prompt and all(isinstance(t, (str, list)) for t in prompt):
            if len(prompt) > _MAX_N:
                raise _bad("prompt", f"'prompt' holds {len(prompt)} prompts; at most {_MAX_N} per request")
            return [await self._one_prompt(q, f"prompt[{i}]") for i, q in enumerate(prompt)]
        return [await self._one_prompt(prompt, "prompt")]

    async def _one_prompt(self, prompt, where: str) -> tuple:
        if isinstance(prompt, str):
            if prompt == "":
                raise _bad("prompt", f"'{where}' must not be empty")
            return await anyio.to_thread.run_sync(self.encode, prompt), prompt
        if isinstance(prompt, list):
            if not prompt:
                raise _bad("prompt", f"'{where}' must not be empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return self.token_ids(prompt), None
        raise _bad("prompt", f"'{where}' must be a string or a list of token ids")

    def render_chat(self, messages: list, body: dict) -> list:
        if self.template_error is not None:
            raise ApiError(500, self.template_error)
        if self.template is None:
            target = getattr(self.engine, "target", "?")
            raise _bad("messages", f"model '{self.model_name}' has no chat template (no 'chat_template' in "
                                   f"tokenizer_config.json and no chat_template.jinja in {target}); "
                                   "use /v1/completions, or serve with --chat-template")
        import jinja2

        kwargs = dict(self.special_tokens)
        extra = body.get("chat_template_kwargs")
        if extra is not None:
            if not isinstance(extra, dict):
                raise _bad("chat_template_kwargs", "'chat_template_kwargs' must be an object")
            kwargs.update({k: v for k, v in extra.items() if k not in ("messages", "add_generation_prompt")})
        try:
            text = self.template.render(messages=messages, add_generation_prompt=True, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise _bad("messages", f"the chat template rejected the messages: {e}") from None
        if not text:
            raise _bad("messages", "the chat template rendered an empty prompt")
        return self.encode(text, special=False)

    def check_structured(self, p: _Params) -> None:
        """The request's structured-output spec compiled now (the engine keeps it for the
        submits), so that a bad one is a 400 naming the field that carried it."""
        spec = p.adjust.get("structured_outputs")
        grammar = getattr(self.engine, "_grammar", None)
        if spec is None or grammar is None:
            return
        try:
            grammar(spec, p.structured_param)
        except Exception as e:  # noqa: BLE001 - InvalidArgumentError / UnsupportedError: the client's
            if not any(c.__name__ in ("InvalidArgumentError", "UnsupportedError") for c in type(e).__mro__):
                raise
            raise _bad(p.structured_param, " ".join(str(e).split())) from None

    def fit(self, ids: list, p: _Params, prompt_param: str) -> int:
        """max_tokens of a prompt against the context: 400 when the prompt or prompt +
        max_tokens do not fit in max_seq_len; a missing max_tokens (chat) takes the rest of
        the context."""
        L = self.max_seq_len
        if L is None:
            return 16 if p.max_tokens is None else p.max_tokens
        if len(ids) >= L:
            raise _bad(prompt_param, f"the prompt has {len(ids)} tokens; this model's max_seq_len is {L} "
                                     "(the prompt plus at least one generated token must fit)")
        room = L - len(ids)
        if p.max_tokens is None:
            return room
        if p.max_tokens > room:
            if p.max_tokens_given:
                raise _bad(p.max_tokens_param, f"'{p.max_tokens_param}' = {p.max_tokens} plus the prompt's "
                                               f"{len(ids)} tokens exceeds this model's max_seq_len of {L}")
            return room  # the completions default (16) near the end of the context
        return p.max_tokens

    def sampling(self, p: _Params, max_tokens: int) -> dict:
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= self.eos_ids
        out = dict(max_new_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                   seed=p.seed, stop_token_ids=sorted(stop_ids))
        if p.logprobs is not None:
            out["logprobs"] = p.logprobs
        out.update(p.adjust)
        if "min_tokens" in out:  # a context-filling default max_tokens may be smaller
            out["min_tokens"] = min(out["min_tokens"], max_tokens)
        return out

    # ------------------------------------------------------------------ log-probabilities

    def tok_str(self, t: int) -> str:
        """A token's text for log-probabilities (its own decode; 'token_id:N' without a tokenizer)."""
        s = self._tok_text.get(t)
        if s is None:
            dec = self.decoder()
            try:
                s = dec([t]) if dec is not None else f"token_id:{t}"
            except Exception:  # noqa: BLE001 - a token that does not decode alone
                s = f"token_id:{t}"
            if len(self._tok_text) < 1 << 18:
                self._tok_text[t] = s
        return s

    def completion_logprobs(self, toks: list, lps: list, offset: int) -> dict:
        """OpenAI's completions logprobs object of tokens (lps[j] None: a prompt's first token)."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in zip(toks, lps):
            s = self.tok_str(t)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(float(lp.logprob))
            top = {}
            for i, v in zip(lp.top_ids, lp.top_logprobs):
                top.setdefault(self.tok_str(i), float(v))
            top.setdefault(s, float(lp.logprob))
            out["top_logprobs"].append(top)
        return out

    def chat_logprobs(self, toks: list, lps: list) -> dict:
        """OpenAI's chat logprobs object ({"content": [...]}) of tokens."""
        def entry(t, v):
            s = self.tok_str(t)
            return {"token": s, "logprob": float(v), "bytes": list(s.encode("utf-8"))}
        content = []
        for t, lp in zip(toks, lps):
            e = entry(t, lp.logprob)
            e["top_logprobs"] = [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]
            content.append(e)
        return {"content": content}

    def prompt_logprobs(self, ids: list, top: int) -> list:
        """[None, TokenLogprobs...]: each prompt token's log-probability after the tokens before
        it (Engine.prompt_logprobs; an engine without it: from Engine.logits), for echo with
        logprobs."""
        import numpy as np

        out: list = [None]
        if len(ids) < 2:
            return out
        if hasattr(self.engine, "prompt_logprobs"):
            return out + list(self.engine.prompt_logprobs(ids, top))
        lg = np.asarray(self.engine.logits(ids), np.float64)[:-1]
        m = lg.max(axis=1, keepdims=True)
        lsm = lg - (m + np.log(np.exp(lg - m).sum(axis=1, keepdims=True)))
        for j in range(1, len(ids)):
            row = lsm[j - 1]
            best = []
            if top > 0:
                part = np.argpartition(-row, top - 1)[:top] if top < row.shape[0] else np.arange(row.shape[0])
                best = sorted((int(i) for i in part), key=lambda i: (-row[i], i))[:top]
            out.append(_Logprob(float(row[ids[j]]), best, [float(row[i]) for i in best]))
        return out

    # ------------------------------------------------------------------ generation

    async def generate(self, request: Request, prompts: list, p: _Params, chat: bool) -> Response:
        """prompts: [(ids, prompt text or None, max_tokens)]; choice k = prompt k // n, sample
        k % n, each an engine request of its own (max_tokens 0 with echo: none)."""
        loop = asyncio.get_running_loop()
        choices = []
        for i, (ids, text, mt) in enumerate(prompts):
            for j in range(p.best_of):  # best_of > n: the best n of them are returned (_collect)
                choices.append(_Choice(len(choices), ids, text, mt))
        if p.echo:
            for c in choices:
                if c.text is None:
                    dec = self.decoder(p.skip_special)
                    c.text = await anyio.to_thread.run_sync(dec, list(c.ids)) if dec is not None else ""
                if p.logprobs is not None:
                    if not hasattr(self.engine, "logits") and not hasattr(self.engine, "prompt_logprobs"):
                        raise _bad("echo", "this engine cannot score prompts ('echo' with 'logprobs')")
                    same = next((d for d in choices[:c.index] if d.ids is c.ids and d.prompt_lps is not None), None)
                    if same is not None:
                        c.prompt_lps = same.prompt_lps
                    else:
                        if self.max_seq_len is not None and len(c.ids) > self.max_seq_len:
                            raise _bad("prompt", f"the prompt has {len(c.ids)} tokens; this model's max_seq_len "
                                                 f"is {self.max_seq_len}")
                        try:
                            c.prompt_lps = await anyio.to_thread.run_sync(self.prompt_logprobs, list(c.ids),
                                                                          p.logprobs)
                        except Exception as e:  # noqa: BLE001 - a bad prompt is a 400, the rest a 500
                            raise _engine_error(e) from None
        several = len(choices) > 1
        for c in choices:
            if c.max_tokens == 0:
                continue
            sampling = self.sampling(p, c.max_tokens)
            if p.best_of > p.n and "logprobs" not in sampling:
                sampling["logprobs"] = 0  # what the choices are ranked by
            if several and p.seed is not None:
                sampling["_stream_index"] = c.index  # seeded choices draw from distinct streams
            c.job = _Job(self.engine, loop, c.ids, sampling, p.stop, set(sampling["stop_token_ids"]),
                         self.decoder(p.skip_special), self.counters.stop_string, p.include_stop)
        jobs = [c.job for c in choices if c.job is not None]
        for job in jobs:
            job.start()
        self.counters.active += 1
        handed_over = False
        try:
            for c in choices:
                if c.job is None:
                    continue
                first = await c.job.queue.get()
                if first[0] == "error":
                    raise _engine_error(first[1])
                c.rid = first[1]
            req_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            if p.stream:
                state = {"done": False, "closed": False}

                def on_close() -> None:  # the event loop's thread; once
                    if state["closed"]:
                        return
                    state["closed"] = True
                    self.counters.active -= 1
                    if not state["done"]:
                        for job in jobs:
                            job.cancel()
                        self.counters.disconnects += 1
                        log.info("request %s: stream closed before its end (client disconnected); cancelled", req_id)

                resp = _EventStream(self._stream(choices, p, chat, req_id, state), on_close,
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                handed_over = True
                return resp
            return await self._collect(request, choices, p, chat, req_id)
        finally:
            if not handed_over:
                for job in jobs:
                    job.cancel()  # a no-op for a finished request
                self.counters.active -= 1

    async def _collect(self, request: Request, choices: list, p: _Params, chat: bool, req_id: str) -> Response:
        live = [c for c in choices if c.job is not None]

        async def consume(c, scope) -> None:
            async for ev in c.job.events():
                if ev[0] == "delta":
                    c.texts.append(ev[1])
                    c.ids_out.extend(ev[2])
                    c.lps.extend(ev[4])
                elif ev[0] == "done":
                    c.texts.append(ev[1])
                    c.done = ev
                else:  # one choice failed: the request fails, the other choices end now
                    c.error = ev[1]
                    for d in live:
                        d.job.cancel()
                    scope.cancel()
                    return

        disconnected = False
        if live:
            async with anyio.create_task_group() as tg:
                async def main() -> None:
                    async with anyio.create_task_group() as inner:
                        for c in live:
                            inner.start_soon(consume, c, inner.cancel_scope)
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    nonlocal disconnected
                    while True:
                        message = await request.receive()
                        if message["type"] == "http.disconnect":
                            disconnected = True
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(main)
                tg.start_soon(watch)
        if disconnected and not any(c.error is not None for c in live) and any(c.done is None for c in live):
            for c in live:
                c.job.cancel()
            self.counters.disconnects += 1
            log.info("request %s: client disconnected; cancelled", req_id)
            return Response(status_code=499)  # nobody reads it
        for c in live:
            if c.error is not None:
                raise _engine_error(c.error)
        out = []
        shown = self._best(choices, p)
        for c in shown:
            reason = c.done[2] if c.done is not None else "length"
            text = (c.text if p.echo else "") + "".join(c.texts)
            choice: dict = {"index": c.index, "finish_reason": reason, "logprobs": self._choice_logprobs(c, p, chat)}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if p.return_token_ids:
                result = c.done[3] if c.done is not None else None
                choice["token_ids"] = list(getattr(result, "token_ids", None) or c.ids_out)
            if len(shown) > 1 and c.done is not None:
                choice["dflash2"] = self._extension(c.done[3], c.rid)
            out.append(choice)
        first = next((c for c in shown if c.done is not None), None)
        obj = {"id": req_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
               "model": self.model_name, "choices": out, "usage": self._usage(choices),
               "dflash2": self._extension(first.done[3], first.rid) if first is not None else {}}
        if chat:
            obj["system_fingerprint"] = None
        return JSONResponse(obj)

    @staticmethod
    def _best(choices: list, p: _Params) -> list:
        """The choices to return: all of them, or with best_of > n the n of each prompt's best_of
        with the highest mean log-probability per generated token (OpenAI's "best"; ties to the
        earlier), renumbered in that order."""
        if p.best_of <= p.n:
            return choices

        def score(c) -> float:  # over the tokens the choice's text came from (not past a stop string)
            lps = c.lps[:len(c.ids_out)]
            return sum(float(x.logprob) for x in lps) / len(lps) if lps else 0.0

        shown = []
        for g in range(0, len(choices), p.best_of):
            group = choices[g:g + p.best_of]
            shown += sorted(group, key=lambda c: (-score(c), c.index))[:p.n]
        for i, c in enumerate(shown):
            c.index = i
        return shown

    def _choice_logprobs(self, c, p: _Params, chat: bool):
        """A whole choice's logprobs object (None unless asked for): the tokens the choice's
        text came from (as a stream hands them out: up to the piece where a stop string
        matched), after the prompt's with echo."""
        if p.logprobs is None:
            return None
        n = min(len(c.ids_out), len(c.lps))
        toks, lps = c.ids_out[:n], c.lps[:n]
        if chat:
            return self.chat_logprobs(toks, lps)
        if p.echo:
            pl = self.completion_logprobs(c.ids, c.prompt_lps or [None] * len(c.ids), 0)
            gl = self.completion_logprobs(toks, lps, len(c.text or ""))
            return {k: pl[k] + gl[k] for k in pl}
        return self.completion_logprobs(toks, lps, 0)

    def _usage(self, choices: list, partial: Optional[dict] = None) -> dict:
        """Usage of a request: each prompt counted once, every choice's generated tokens (partial:
        {choice index: tokens so far} for a stream's running usage)."""
        prompt, completion, cached, seen = 0, 0, None, set()
        for c in choices:
            first = id(c.ids) not in seen  # the first choice of its prompt
            seen.add(id(c.ids))
            prompt += len(c.ids) if first else 0
            if partial is not None:
                completion += partial.get(c.index, 0)
                continue
            result = c.done[3] if c.done is not None else None
            toks = getattr(result, "token_ids", None)
            completion += len(toks) if toks is not None else (c.done[4] if c.done is not None else 0)
            got = (getattr(result, "stats", None) or {}).get("cached_tokens")
            if got is not None and first:
                cached = (cached or 0) + int(got)
        if partial is None:
            self.counters.prompt_tokens += prompt
            self.counters.completion_tokens += completion
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if cached is not None:  # the prompt tokens taken from the engine's prefix cache (OpenAI's field)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    @staticmethod
    def _extension(result, rid) -> dict:
        stats = getattr(result, "stats", None) or {}
        out = {"request_id": rid, "engine_finish_reason": getattr(result, "finish_reason", None)}
        out.update(_jsonable(dict(stats)))
        return out

    async def _stream(self, choices: list, p: _Params, chat: bool, req_id: str, state: dict):
        created = int(time.time())
        obj_type = "chat.completion.chunk" if chat else "text_completion"
        counts: dict = {}    # choice index -> tokens generated so far
        offsets: dict = {}   # choice index -> text offset of its next token (completions logprobs)

        def chunk(c, text: Optional[str], reason: Optional[str], new_ids: Optional[list], lps: Optional[list],
                  role: bool = False, lp_obj=None) -> dict:
            logprobs = lp_obj
            if logprobs is None and p.logprobs is not None and lps:
                n = min(len(new_ids or []), len(lps))
                if chat:
                    logprobs = self.chat_logprobs(new_ids[:n], lps[:n])
                else:
                    logprobs = self.completion_logprobs(new_ids[:n], lps[:n], offsets.get(c.index, 0))
                    if n:
                        offsets[c.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if chat:
                delta: dict = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": c.index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
            if p.return_token_ids and new_ids is not None:
                choice["token_ids"] = new_ids
            obj = {"id": req_id, "object": obj_type, "created": created, "model": self.model_name, "choices": [choice]}
            if chat:
                obj["system_fingerprint"] = None
            if p.include_usage:
                obj["usage"] = self._usage(choices, counts) if p.continuous_usage else None
            return obj

        merged: asyncio.Queue = asyncio.Queue()

        async def pump(c) -> None:
            async for ev in c.job.events():
                await merged.put((c, ev))

        tasks = [asyncio.ensure_future(pump(c)) for c in choices if c.job is not None]
        try:
            for c in choices:
                if chat:
                    yield _sse(chunk(c, "", None, None, None, role=True))
                elif p.echo:
                    lp_obj = None
                    if p.logprobs is not None:
                        lp_obj = self.completion_logprobs(c.ids, c.prompt_lps or [None] * len(c.ids), 0)
                    offsets[c.index] = len(c.text or "")
                    yield _sse(chunk(c, c.text, "length" if c.job is None else None, None, None, lp_obj=lp_obj))
            left = len(tasks)
            finals = []
            while left:
                c, ev = await merged.get()
                if ev[0] == "delta":
                    _, text, new_ids, n, lps = ev
                    counts[c.index] = n
                    if text or p.return_token_ids or p.continuous_usage or (p.logprobs is not None and new_ids):
                        yield _sse(chunk(c, text, None, new_ids, lps))
                elif ev[0] == "done":
                    _, text, reason, result, n = ev
                    left -= 1
                    c.done = ev
                    toks = getattr(result, "token_ids", None)
                    counts[c.index] = len(toks) if toks is not None else n
                    final = chunk(c, text if (text or not chat) else None, reason,
                                  [] if p.return_token_ids else None, None)
                    final["dflash2"] = self._extension(result, c.rid)
                    finals.append(final)
                    yield _sse(final)
                else:
                    state["done"] = True
                    for d in choices:
                        if d.job is not None:
                            d.job.cancel()
                    err = _engine_error(ev[1])
                    if err.status >= 500:
                        log.error("request %s failed: %s", c.rid, err.message)
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"
                    return
            state["done"] = True
            usage = self._usage(choices)
            if p.include_usage:
                yield _sse({"id": req_id, "object": obj_type, "created": created, "model": self.model_name,
                            "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ metrics

    def prometheus(self, m: dict) -> str:
        lines = []
        seen = set()
        for key, name, typ, help_ in _ENGINE_METRICS:
            if key in m and isinstance(m[key], (int, float)) and not isinstance(m[key], bool):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {typ}", f"{name} {_prom_value(m[key])}"]
                seen.add(key)
        for key, v in sorted(m.items()):
            if key in seen or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            name = _metric_name(str(key))
            lines += [f"# HELP {name} Engine metric '{key}'.", f"# TYPE {name} gauge", f"{name} {_prom_value(v)}"]
        c = self.counters
        lines += ["# HELP dflash2_http_requests_total HTTP requests answered, by endpoint and status code.",
                  "# TYPE dflash2_http_requests_total counter"]
        for (ep, code), v in sorted(c.http.items()):
            lines.append(f'dflash2_http_requests_total{{endpoint="{ep}",code="{code}"}} {v}')
        for name, typ, help_, v in [
            ("dflash2_server_active_requests", "gauge", "Generation requests in flight in the HTTP server.", c.active),
            ("dflash2_client_disconnects_total", "counter",
             "Requests cancelled because their client disconnected.", c.disconnects),
            ("dflash2_stop_string_matches_total", "counter", "Requests ended by a stop string.", c.stop_strings),
            ("dflash2_prompt_tokens_total", "counter", "Prompt tokens of the answered requests.", c.prompt_tokens),
            ("dflash2_completion_tokens_total", "counter", "Completion tokens of the answered requests.",
             c.completion_tokens),
        ]:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {typ}", f"{name} {_prom_value(v)}"]
        return "\n".join(lines) + "\n"


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        raise _bad(None, "the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _bad(None, f"the request body must be a JSON object, found {type(body).__name__}")
    return body


class _ApiKey:
    """Pure ASGI middleware (receive / send pass through untouched, so streams and disconnect
    detection work as without it): an HTTP request to /v1/* (relative to the app's root_path)
    without "Authorization: Bearer <key>" gets a 401 in OpenAI's error shape."""

    def __init__(self, app, key: str, counters):
        import hmac

        self.app = app
        self._want = ("Bearer " + key).encode()
        self._eq = hmac.compare_digest
        self._counters = counters

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http":
            path = scope.get("path", "")
            root = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):]
            if path.startswith("/v1/"):
                got = b""
                for k, v in scope.get("headers", []):
                    if k.lower() == b"authorization":
                        got = v
                        break
                if not self._eq(got, self._want):
                    e = ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", None,
                                 "invalid_request_error", "invalid_api_key")
                    key = ("/v1 (unauthorized)", 401)
                    self._counters.http[key] = self._counters.http.get(key, 0) + 1
                    await JSONResponse(e.body(), status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def create_app(engine, model_name: Optional[str] = None, *, chat_template: Optional[str] = None,
               api_key: Optional[str] = None) -> FastAPI:
    """The FastAPI app serving `engine` (which the app does not own: close it after the
    server stops). model_name: the served name (default: default_model_name(engine)).
    chat_template: a Jinja chat template (its source, or a path to a file) overriding the
    checkpoint's. api_key: every /v1/* request must carry "Authorization: Bearer <api_key>"
    (else 401; /health, /metrics, /tokenize and /detokenize stay open, as vLLM's). The
    service state lives in app.state.dflash2."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("create_app: api_key must be a non-empty string or None")
    svc = _Service(engine, model_name or default_model_name(engine), chat_template)
    app = FastAPI(title="dflash2_rt", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dflash2 = svc

    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key, counters=svc.counters)

    def count(endpoint: str, status: int) -> None:
        key = (endpoint, status)
        svc.counters.http[key] = svc.counters.http.get(key, 0) + 1

    async def handle(endpoint: str, fn, request: Request) -> Response:
        try:
            resp = await fn(request)
        except ClientDisconnect:  # gone while its body was being read: nothing was submitted
            count(endpoint, 499)
            return Response(status_code=499)
        except ApiError as e:
            if e.status >= 500:
                log.error("%s: %s", endpoint, e.message)
            count(endpoint, e.status)
            return JSONResponse(e.body(), status_code=e.status)
        except Exception as e:  # noqa: BLE001 - a bug or an engine failure: 500 with the message
            log.exception("%s failed", endpoint)
            err = ApiError(500, f"{type(e).__name__}: {e}")
            count(endpoint, 500)
            return JSONResponse(err.body(), status_code=500)
        count(endpoint, resp.status_code)
        return resp

    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        svc.check_model(body)
        p = _parse_common(body, chat=False, vocab_size=svc.vocab_size)
        await anyio.to_thread.run_sync(svc.check_structured, p)
        prompts = await svc.completion_prompts(body)
        if len(prompts) * p.best_of > _MAX_N:
            what = "n" if p.best_of == p.n else "best_of"
            raise _bad(what, f"{len(prompts)} prompts x {what} = {p.best_of} choices exceed {_MAX_N} per request")
        prompts = [(ids, text, p.max_tokens if p.max_tokens == 0 else svc.fit(ids, p, "prompt"))
                   for ids, text in prompts]
        return await svc.generate(request, prompts, p, chat=False)

    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        svc.check_model(body)
        messages = _chat_messages(body)
        p = _parse_common(body, chat=True, vocab_size=svc.vocab_size)
        await anyio.to_thread.run_sync(svc.check_structured, p)
        ids = await anyio.to_thread.run_sync(svc.render_chat, messages, body)
        return await svc.generate(request, [(ids, None, svc.fit(ids, p, "messages"))], p, chat=True)

    async def tokenize(request: Request) -> Response:
        body = await _json_body(request)
        svc.check_model(body)
        if body.get("messages") is not None:
            ids = await anyio.to_thread.run_sync(svc.render_chat, _chat_messages(body), body)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise _bad("prompt", f"'prompt' must be a string (or send 'messages'), found {_short(prompt)}")
            special = _bool(body, "add_special_tokens", True)
            ids = await anyio.to_thread.run_sync(svc.encode, prompt, special) if prompt else []
        return JSONResponse({"tokens": list(ids), "count": len(ids), "max_model_len": svc.max_seq_len})

    async def detokenize(request: Request) -> Response:
        body = await _json_body(request)
        svc.check_model(body)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise _bad("tokens", f"'tokens' must be a list of token ids, found {_short(toks)}")
        ids = svc.token_ids(toks, "tokens")
        dec = svc.decoder()
        if dec is None:
            raise _bad("tokens", "this model has no tokenizer (no tokenizer.json in its target directory)")
        return JSONResponse({"prompt": await anyio.to_thread.run_sync(dec, ids)})

    @app.post("/tokenize")
    async def _tokenize(request: Request):
        return await handle("/tokenize", tokenize, request)

    @app.post("/detokenize")
    async def _detokenize(request: Request):
        return await handle("/detokenize", detokenize, request)

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await handle("/v1/completions", completions, request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await handle("/v1/chat/completions", chat_completions, request)

    def model_card() -> dict:
        return {"id": svc.model_name, "object": "model", "created": svc.created, "owned_by": "dflash2_rt",
                "max_model_len": svc.max_seq_len, "method": getattr(engine, "method", None)}

    @app.get("/v1/models")
    async def _models():
        count("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def _model(model_id: str):
        if model_id != svc.model_name:
            count("/v1/models", 404)
            e = ApiError(404, f"The model '{model_id}' does not exist; this server serves '{svc.model_name}'",
                         "model", "invalid_request_error", "model_not_found")
            return JSONResponse(e.body(), status_code=404)
        count("/v1/models", 200)
        return JSONResponse(model_card())

    @app.get("/health")
    async def _health():
        try:
            await anyio.to_thread.run_sync(engine.metrics)
        except Exception as e:  # noqa: BLE001 - closed or broken engine
            count("/health", 503)
            return JSONResponse({"status": "error", "message": f"{type(e).__name__}: {e}"}, status_code=503)
        count("/health", 200)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def _metrics():
        try:
            m = await anyio.to_thread.run_sync(engine.metrics)
        except Exception as e:  # noqa: BLE001
            count("/metrics", 503)
            return PlainTextResponse(f"# engine unavailable: {type(e).__name__}: {e}\n", status_code=503)
        count("/metrics", 200)
        return PlainTextResponse(svc.prometheus(dict(m)), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        e = ApiError(exc.status_code, str(exc.detail), None,
                     "invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(e.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        loc = errs[0].get("loc", ()) if errs else ()
        param = ".".join(str(x) for x in loc if x != "body") or None
        e = _bad(param, "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()))}: {er.get('msg')}" for er in errs))
        return JSONResponse(e.body(), status_code=400)

    return app


# ----------------------------------------------------------------------------- running


def run(engine, host: str = "127.0.0.1", port: int = 8000, *, model_name: Optional[str] = None,
        chat_template: Optional[str] = None, log_level: str = "info", api_key: Optional[str] = None) -> None:
    """Serves `engine` until interrupted (Ctrl-C / SIGTERM). The engine is not closed."""
    import uvicorn

    app = create_app(engine, model_name, chat_template=chat_template, api_key=api_key)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class BackgroundServer:
    """A uvicorn server on a thread of this process (tests, benchmarks):

        with BackgroundServer(create_app(engine)) as srv:
            httpx.get(srv.url + "/health")

    port=0 picks a free port (the socket is bound here, so there is no race)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 startup_timeout: float = 30.0):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host = host
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="dflash2-server", daemon=True)
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread ended during startup")
            if time.monotonic() - t0 > startup_timeout:
                self.stop()
                raise RuntimeError(f"the server did not start within {startup_timeout} s")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
