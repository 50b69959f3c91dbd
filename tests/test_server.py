"""The OpenAI-compatible HTTP server (python/dflash2_rt/server.py), live on 127.0.0.1, talked
to with the official `openai` client (and httpx for raw requests).

Every server test runs against two engines: "fake" (tests/fake_engine.py, pure Python, always
available) and "real" (dflash2_rt.Engine over the bundled default pair; skipped, with the
reason, until this build's Engine has the request API submit / poll / cancel / metrics).
"""
from __future__ import annotations

import json
import os
import re
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("jinja2")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import serve_support as sup  # noqa: E402  (tests/ is on sys.path)

server = sup.load_server()

MODEL = "dflash2-test"
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "# Return the sum of a list\n",
    "for i in range(10):",
    "    raise ValueError(",
    "with open(path) as f:\n",
    "def __repr__(self):\n        return",
]


class Live:
    """An engine served on a free port of 127.0.0.1."""

    def __init__(self, kind: str, engine, app_kw: dict | None = None):
        self.kind = kind
        self.engine = engine
        self.bg = server.BackgroundServer(server.create_app(engine, model_name=MODEL, **(app_kw or {})))
        self.url = self.bg.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = httpx.get(self.url + "/health", timeout=10)
        assert r.status_code == 200, r.text

    def post(self, path: str, body, **kw):
        kw.setdefault("timeout", 60)
        if isinstance(body, (bytes, str)):
            return httpx.post(self.url + path, content=body, headers={"content-type": "application/json"}, **kw)
        return httpx.post(self.url + path, json=body, **kw)

    def metrics_text(self) -> str:
        r = httpx.get(self.url + "/metrics", timeout=10)
        assert r.status_code == 200
        return r.text

    def metric(self, name: str) -> float:
        return parse_prometheus(self.metrics_text())[name]

    def close(self):
        self.bg.stop()
        self.engine.close()


def _engine(kind: str, target=None):
    try:
        return sup.make_engine(kind, target=target, max_batch_size=8, speculation="adaptive")
    except LookupError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=["fake", "real"])
def live(request):
    srv = Live(request.param, _engine(request.param))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def chat_live(live, tmp_path_factory):
    """The same kind of engine over a copy of the bundled target that has a chat template."""
    target = sup.make_chat_target(str(tmp_path_factory.mktemp("chat_target") / "target"))
    srv = Live(live.kind, _engine(live.kind, target=target))
    yield srv
    srv.close()


def parse_prometheus(text: str) -> dict:
    """{name or name{labels}: value} of a Prometheus text exposition; every sample line must
    parse, every sample must have a TYPE line."""
    out, typed = {}, set()
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            assert typ in ("gauge", "counter", "histogram", "summary", "untyped"), line
            typed.add(name)
            continue
        if line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{", 1)[0]
        assert name in typed, f"sample without a TYPE line: {line}"
        out[key] = float(value)
    return out


def complete(live: Live, prompt, max_tokens=24, **kw):
    extra = kw.pop("extra_body", {})
    return live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          temperature=kw.pop("temperature", 0), extra_body=extra, **kw)


def wait_until(pred, timeout: float, interval: float = 0.02):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(interval)
    return None


# ------------------------------------------------------------------------------ basics


def test_health_and_models(live):
    r = httpx.get(live.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = live.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert live.client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(live.url + "/v1/models/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_completion_text_prompt(live):
    r = complete(live, PROMPTS[0], max_tokens=24, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert isinstance(r.created, int)
    (c,) = r.choices
    assert c.index == 0 and c.logprobs is None and c.finish_reason == "length"
    ids = c.model_extra["token_ids"]
    assert len(ids) == 24
    assert c.text == live.engine.decode(ids)
    prompt_ids = live.engine.encode(PROMPTS[0])
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == len(prompt_ids) + 24
    ext = r.model_extra["dflash2"]
    assert ext["generated_tokens"] == 24 and ext["acceptance_length"] >= 1


def test_usage_reports_cached_prompt_tokens(live):
    """The real engine's prefix cache: the same long prompt again takes its full blocks, and
    the usage says so as OpenAI does (prompt_tokens_details.cached_tokens); the text is the same."""
    if live.kind != "real":
        pytest.skip("the fake engine has no prefix cache")
    prompt = "".join(PROMPTS) * 3
    first = complete(live, prompt, max_tokens=8)
    again = complete(live, prompt, max_tokens=8)
    n = len(live.engine.encode(prompt))
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens == first.usage.prompt_tokens == n
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (n - 1) // 16 * 16 > 0, (n, cached)


def test_completion_token_id_prompt_equals_text_prompt(live):
    by_text = complete(live, PROMPTS[1], max_tokens=16)
    by_ids = complete(live, live.engine.encode(PROMPTS[1]), max_tokens=16)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens
    # a batch of one prompt is one prompt
    one = complete(live, [PROMPTS[1]], max_tokens=16)
    assert one.choices[0].text == by_text.choices[0].text
    one = complete(live, [live.engine.encode(PROMPTS[1])], max_tokens=16)
    assert one.choices[0].text == by_text.choices[0].text


def test_engine_greedy_matches_direct(live):
    """The server's tokens are the engine's own greedy tokens for the prompt."""
    r = complete(live, PROMPTS[2], max_tokens=20, extra_body={"return_token_ids": True})
    direct = live.engine.generate([live.engine.encode(PROMPTS[2])], max_new_tokens=20, temperature=0.0)[0]
    assert r.choices[0].model_extra["token_ids"] == list(direct.token_ids)


def test_streaming_equals_non_streaming(live):
    for prompt, n in ((PROMPTS[3], 40), (PROMPTS[4], 7)):
        full = complete(live, prompt, max_tokens=n)
        stream = complete(live, prompt, max_tokens=n, stream=True, stream_options={"include_usage": True})
        texts, reasons, usage = [], [], None
        for ch in stream:
            assert ch.object == "text_completion" and ch.model == MODEL
            if ch.choices:
                texts.append(ch.choices[0].text)
                reasons.append(ch.choices[0].finish_reason)
            if ch.usage is not None:
                usage = ch.usage
        assert "".join(texts) == full.choices[0].text
        assert reasons[-1] == full.choices[0].finish_reason and all(r is None for r in reasons[:-1])
        assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
        assert usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_raw_sse_format(live):
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 12, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)
    assert chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == live.engine.decode(
        [t for t in ids if t not in (live.engine.config.get("eos_token_id"),)])
    counts = [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]
    assert counts == sorted(counts)  # continuous usage: cumulative


# ------------------------------------------------------------------------------ stop


def test_stop_strings(live):
    full = complete(live, PROMPTS[6], max_tokens=48, extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 12, full
    stop = full[len(full) // 3:len(full) // 3 + 4]
    expect = full[:full.index(stop)]
    before = live.metric("dflash2_stop_string_matches_total")
    r = complete(live, PROMPTS[6], max_tokens=48, stop=["\x00never", stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    stream = complete(live, PROMPTS[6], max_tokens=48, stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream if c.choices]
    assert "".join(t for t, _ in chunks) == expect and chunks[-1][1] == "stop"
    assert live.metric("dflash2_stop_string_matches_total") == before + 2
    r = complete(live, PROMPTS[6], max_tokens=48, stop=stop, extra_body={"ignore_eos": True,
                                                                        "include_stop_str_in_output": True})
    assert r.choices[0].text == expect + stop and r.choices[0].finish_reason == "stop"
    # a stop string that never occurs changes nothing
    r = complete(live, PROMPTS[6], max_tokens=48, stop="\x00\x01", extra_body={"ignore_eos": True})
    assert r.choices[0].text == full and r.choices[0].finish_reason == "length"


def test_stop_token_ids(live):
    r = complete(live, PROMPTS[7], max_tokens=24, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    t = ids[5]
    k = ids.index(t)
    r2 = complete(live, PROMPTS[7], max_tokens=24,
                  extra_body={"stop_token_ids": [t], "ignore_eos": True, "return_token_ids": True})
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].model_extra["token_ids"] == ids[:k + 1]
    assert r2.choices[0].text == live.engine.decode(ids[:k])  # the stop token is not in the text
    assert r2.usage.completion_tokens == k + 1


# ------------------------------------------------------------------------------ chat


def test_chat_without_template_is_400(live):
    r = live.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and "chat template" in err["message"]
    with pytest.raises(openai.BadRequestError, match="chat template"):
        live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_chat_with_template(chat_live):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A function to add."}]
    r = chat_live.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (c,) = r.choices
    assert c.message.role == "assistant" and c.finish_reason == "length"
    # the prompt is the template's rendering, tokenized
    rendered = sup.render_chat(msgs)
    ref = complete(chat_live, rendered, max_tokens=20, extra_body={"ignore_eos": True})
    assert c.message.content == ref.choices[0].text
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    # streaming: role first, then content deltas, then finish_reason
    stream = chat_live.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # content as a list of text parts
    parts = [{"role": "system",
              "content": [{"type": "text", "text": "You write "}, {"type": "text", "text": "Python."}]},
             msgs[1]]
    r2 = chat_live.client.chat.completions.create(model=MODEL, messages=parts, max_tokens=20, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert r2.choices[0].message.content == c.message.content
    # no max_tokens: up to the rest of the context; a stop string ends it early
    text = c.message.content
    assert len(text) >= 6, text
    stop = text[len(text) // 3:len(text) // 3 + 3]
    r3 = chat_live.client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, stop=[stop],
                                                  extra_body={"ignore_eos": True})
    assert r3.choices[0].finish_reason == "stop"
    assert r3.choices[0].message.content == text[:text.index(stop)]


def test_chat_template_override(live):
    """create_app(chat_template=...) over a target without one; a template's
    raise_exception is a 400."""
    if live.kind != "fake":
        pytest.skip("one engine per kind is enough: the fake shares it safely")
    tpl = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('role bad is not allowed') }}"
           "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    srv = server.BackgroundServer(server.create_app(live.engine, model_name=MODEL, chat_template=tpl))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                      temperature=0)
        ref = c.completions.create(model=MODEL, prompt="[user] hi\n[assistant]", max_tokens=8, temperature=0)
        assert r.choices[0].message.content == ref.choices[0].text
        resp = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": [{"role": "bad", "content": "x"}]})
        assert resp.status_code == 400 and "role bad is not allowed" in resp.json()["error"]["message"]
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ metrics


def test_metrics_prometheus(live):
    complete(live, PROMPTS[0], max_tokens=8)
    m = parse_prometheus(live.metrics_text())
    for name in ("dflash2_queue_length", "dflash2_running_requests", "dflash2_tokens_per_second",
                 "dflash2_acceptance_length", "dflash2_step_time_seconds", "dflash2_requests_total",
                 "dflash2_requests_finished_total", "dflash2_generated_tokens_total",
                 "dflash2_server_active_requests", "dflash2_client_disconnects_total",
                 "dflash2_prompt_tokens_total", "dflash2_completion_tokens_total"):
        assert name in m, name
    assert m["dflash2_requests_total"] >= 1 and m["dflash2_generated_tokens_total"] >= 8
    assert m["dflash2_queue_length"] >= 0 and m["dflash2_running_requests"] >= 0
    assert m['dflash2_http_requests_total{endpoint="/v1/completions",code="200"}'] >= 1


# ------------------------------------------------------------------------------ bad requests


LONG = "long"  # placeholder: a prompt of max_seq_len token ids

BAD = [
    # (endpoint, body or raw text, param)
    ("c", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("c", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("c", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("c", {"prompt": "x", "max_tokens": 10 ** 9}, "max_tokens"),
    ("c", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("c", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("c", {"prompt": "x", "top_p": 0}, "top_p"),
    ("c", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("c", {"prompt": "x", "top_k": -2}, "top_k"),
    ("c", {"prompt": "x", "seed": -1}, "seed"),
    ("c", {"prompt": "x", "n": 0}, "n"),
    ("c", {"prompt": "x", "n": 65}, "n"),
    ("c", {"prompt": ["x"] * 33, "n": 2}, "n"),
    ("c", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("c", {"prompt": "x", "n": 2, "best_of": 3, "stream": True}, "best_of"),
    ("c", {"prompt": "x", "best_of": 2, "temperature": 0}, "best_of"),
    ("c", {"prompt": "x", "logit_bias": {" 7": 1}}, "logit_bias"),
    ("c", {"prompt": "x", "logit_bias": {"7": 10 ** 400}}, "logit_bias"),
    ("c", {"prompt": "x", "temperature": 10 ** 400}, "temperature"),
    ("c", {"prompt": "x", "repetition_penalty": 0.001}, "repetition_penalty"),
    ("c", {"prompt": ["x", "y", "z"], "best_of": 22}, "best_of"),
    ("c", {"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
    ("c", {"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("c", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("c", {"prompt": "x", "frequency_penalty": "high"}, "frequency_penalty"),
    ("c", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("c", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("c", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("c", {"prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
    ("c", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("c", {"prompt": "x", "logit_bias": {"10000000": 1}}, "logit_bias"),
    ("c", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -3}, "presence_penalty"),
    ("c", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("c", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("c", {"prompt": "x", "echo": "yes"}, "echo"),
    ("c", {"prompt": "x", "stop": 5}, "stop"),
    ("c", {"prompt": "x", "stop": [""]}, "stop"),
    ("c", {"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ("c", {"prompt": "x", "stop_token_ids": [10 ** 7]}, "stop_token_ids"),
    ("c", {"prompt": "x", "stream": "yes"}, "stream"),
    ("c", {"max_tokens": 4}, "prompt"),
    ("c", {"prompt": ""}, "prompt"),
    ("c", {"prompt": []}, "prompt"),
    ("c", {"prompt": 123}, "prompt"),
    ("c", {"prompt": ["a", ""]}, "prompt"),
    ("c", {"prompt": ["a", [1, "b"]]}, "prompt"),
    ("c", {"prompt": [1, "b"]}, "prompt"),
    ("c", {"prompt": [1, 10 ** 7]}, "prompt"),
    ("c", {"prompt": LONG}, "prompt"),
    ("c", {"prompt": "x", "model": 7}, "model"),
    ("c", "{not json", None),
    ("c", "[1, 2]", None),
    ("m", {"messages": "hi"}, "messages"),
    ("m", {}, "messages"),
    ("m", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("m", {"messages": [{"content": "hi"}]}, "messages"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, "logprobs"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": 5}, "chat_template_kwargs"),
    ("m", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "response_format": "json"}, "response_format"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     "response_format"),
    ("m", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"},
           "guided_regex": "a+"}, "guided_regex"),
    ("c", {"prompt": "x", "structured_outputs": "json"}, "structured_outputs"),
    ("c", {"prompt": "x", "guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_bad_request_is_400_naming_the_field(live, chat_live, endpoint, body, param):
    srv = live if endpoint == "c" else chat_live
    path = "/v1/completions" if endpoint == "c" else "/v1/chat/completions"
    if isinstance(body, dict) and body.get("prompt") == LONG:
        body = dict(body, prompt=[5] * live.engine.max_seq_len)
    for stream in (False, True):
        if isinstance(body, dict):
            b = dict(body, stream=body.get("stream", stream))
            b.setdefault("model", MODEL)
        else:
            b = body
        r = srv.post(path, b)
        assert r.status_code == 400, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        assert err["param"] == param
        if param is not None:
            assert param in err["message"], err["message"]
        if not isinstance(body, dict):
            break


def test_unknown_model_is_404(live):
    r = live.post("/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        live.client.completions.create(model="gpt-4", prompt="x")
    # no model field: the served one
    r = live.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_unknown_path_and_method(live):
    r = httpx.get(live.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(live.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_engine_errors(live):
    """An engine InvalidArgumentError is a 400 naming the field; any other engine error a
    500 with its message (non-streaming), or an error event in the stream."""
    if live.kind != "fake":
        pytest.skip("needs the fake engine's fault injection")
    eng = live.engine
    orig = eng.submit

    def submit(prompt, **kw):
        raise sup.load_fake().InvalidArgumentError("submit: prompt has 9999 tokens; max_seq_len is 4096")

    eng.submit = submit
    try:
        r = live.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    finally:
        eng.submit = orig
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"

    eng.fail_next("kaboom in the engine")
    r = live.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert r.status_code == 500 and "kaboom in the engine" in r.json()["error"]["message"]

    eng.fail_next("kaboom again")
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "x", "stream": True}) as r:
        raw = r.read().decode()
    assert "kaboom again" in raw and raw.endswith("data: [DONE]\n\n")
    assert httpx.get(live.url + "/health").status_code == 200


# ------------------------------------------------------------------------------ cancellation


def _long_request(live):
    n_prompt = len(live.engine.encode(PROMPTS[0]))
    return {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": live.engine.max_seq_len - n_prompt - 1,
            "temperature": 0, "ignore_eos": True}


def _idle(live) -> bool:
    m = live.engine.metrics()
    return m["running"] == 0 and m["queue_length"] == 0


def test_streaming_disconnect_cancels(live):
    assert wait_until(lambda: _idle(live), 10) is not None
    before = live.metric("dflash2_client_disconnects_total")
    gen_before = live.engine.metrics()["generated_tokens_total"]
    n_sub = len(getattr(live.engine, "submitted", []))
    body = dict(_long_request(live), stream=True)
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
    # the response (and its connection) is closed here: the engine request must end soon
    assert wait_until(lambda: live.metric("dflash2_client_disconnects_total") == before + 1, 3) is not None
    assert wait_until(lambda: _idle(live), 3) is not None, live.engine.metrics()
    # ended well before its max_tokens
    assert live.engine.metrics()["generated_tokens_total"] - gen_before < body["max_tokens"] // 2
    if live.kind == "fake":
        assert live.engine.finish_reasons.get(live.engine.submitted[n_sub]) == "cancelled"
    assert live.metric("dflash2_server_active_requests") == 0


def test_non_streaming_disconnect_cancels(live):
    assert wait_until(lambda: _idle(live), 10) is not None
    before = live.metric("dflash2_client_disconnects_total")
    gen_before = live.engine.metrics()["generated_tokens_total"]
    n_sub = len(getattr(live.engine, "submitted", []))
    body = _long_request(live)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        live.post("/v1/completions", body, timeout=httpx.Timeout(10, read=0.5))
    assert wait_until(lambda: live.metric("dflash2_client_disconnects_total") == before + 1, 3) is not None
    assert wait_until(lambda: _idle(live), 3) is not None, live.engine.metrics()
    assert live.engine.metrics()["generated_tokens_total"] - gen_before < body["max_tokens"] // 2
    if live.kind == "fake":
        assert live.engine.finish_reasons.get(live.engine.submitted[n_sub]) == "cancelled"
    assert live.metric("dflash2_server_active_requests") == 0


# ------------------------------------------------------------------------------ concurrency


def test_concurrent_clients_get_single_request_output(live):
    lengths = [8, 40, 17, 64, 3, 29, 50, 11]
    ref = [complete(live, p, max_tokens=n).choices[0].text for p, n in zip(PROMPTS, lengths)]
    out: list = [None] * 8
    errors: list = []
    barrier = threading.Barrier(8)

    def client(i):
        try:
            c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
            barrier.wait()
            if i % 2:
                stream = c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0,
                                              stream=True)
                out[i] = "".join(ch.choices[0].text for ch in stream if ch.choices)
            else:
                out[i] = c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=lengths[i],
                                              temperature=0).choices[0].text
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert out == ref
    assert wait_until(lambda: _idle(live), 5) is not None


# ------------------------------------------------------------------------------ text pieces (no server)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(os.path.join(sup.BUNDLED, "target", "tokenizer.json"))


def test_detokenizer_byte_level_bpe(tokenizer):
    import random

    text = "def f(x):\n    return 'é 日本語 🙂' + x  # naïve\n"
    ids = tokenizer.encode(text).ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # multi-byte characters span tokens
    rng = random.Random(0)
    for trial in range(20):
        seq = ids if trial == 0 else [rng.randrange(2, tokenizer.get_vocab_size()) for _ in range(60)]
        d = server.Detokenizer(tokenizer.decode)
        pieces, i = [], 0
        while i < len(seq):
            k = rng.randint(1, 4)
            piece = d.add(seq[i:i + k])
            assert not piece.endswith("\ufffd") or trial > 0
            pieces.append(piece)
            i += k
        pieces.append(d.flush())
        assert "".join(pieces) == tokenizer.decode(seq)
        if trial == 0:
            assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)


def test_stop_strings_hold_back():
    s = server.StopStrings(["STOP", "xyz"])
    assert s.feed("abc S") == ("abc ", False)      # "S" may start "STOP"
    assert s.feed("TO") == ("", False)
    assert s.feed("P and more") == ("", True)
    s = server.StopStrings(["ab"])
    assert s.feed("xa") == ("x", False)
    assert s.finish("c") == ("ac", False)
    s = server.StopStrings(["aab"])
    out1 = s.feed("aa")
    out2 = s.feed("aab")
    assert out1 == ("", False) and out2 == ("aa", True)
    assert server.StopStrings([]).feed("anything") == ("anything", False)
    s = server.StopStrings(["STOP"])  # min_tokens: early text is not matched, its end still held
    assert s.feed("a STOP b S", match=False) == ("a STOP b ", False)
    assert s.feed("TOP c") == ("", True)
    s = server.StopStrings(["STOP", "ST"], include=True)  # the stop string kept; the first listed at a tie
    assert s.feed("abc S") == ("abc ", False)
    assert s.feed("TOP and more") == ("abc STOP"[4:], True)
    assert server.StopStrings(["b", "ab"], include=True).feed("xaby") == ("xab", True)  # the earliest


# ------------------------------------------------------------------------------ CLI


def _cli():
    try:
        from dflash2_rt import cli
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"dflash2_rt.cli needs the native core: {type(e).__name__}: {e}")
    return cli


def test_cli_serve_arguments():
    cli = _cli()
    args = cli.build_parser().parse_args(["serve"])
    assert (args.target, args.draft, args.method, args.host, args.port) == (None, None, None, "127.0.0.1", 8000)
    assert (args.max_batch_size, args.max_seq_len, args.speculation) == (8, None, "adaptive")
    args = cli.build_parser().parse_args(["serve", "--port", "9001", "--speculation", "fixed", "--max-batch-size", "4",
                                          "--max-seq-len", "512", "--host", "0.0.0.0"])
    assert (args.port, args.speculation, args.max_batch_size, args.max_seq_len, args.host) == (
        9001, "fixed", 4, 512, "0.0.0.0")
    assert args.prefill_tokens_per_step is None and args.prefix_caching is True
    assert cli.build_parser().parse_args(["serve", "--no-prefix-caching"]).prefix_caching is False
    args = cli.build_parser().parse_args(["serve", "--prefill-tokens-per-step", "64", "--kv-cache-dtype", "fp8"])
    assert (args.prefill_tokens_per_step, args.kv_cache_dtype) == (64, "fp8")


def test_cli_serve_without_fastapi(monkeypatch, capsys):
    cli = _cli()
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)  # import uvicorn -> ImportError
    assert cli.main(["serve"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'dflash2_rt[serve]'" in err and "Traceback" not in err


# ------------------------------------------------------------------------------ choices, logprobs, echo


def _lp_close(a, b, tol=1e-4):
    return all(abs(x - y) <= tol for x, y in zip(a, b)) and len(a) == len(b)


def test_n_choices_and_several_prompts(live):
    """n > 1 and a list of prompts: choice k = prompt k // n, sample k % n, each its own engine
    request; seeded choices draw from distinct streams (and repeat); usage counts each prompt
    once and every choice's tokens."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3,
            "ignore_eos": True}
    r1, r2 = live.post("/v1/completions", body).json(), live.post("/v1/completions", body).json()
    assert [c["index"] for c in r1["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in r1["choices"]]
    assert texts == [c["text"] for c in r2["choices"]]  # seeded: reproducible
    assert len(set(texts)) > 1  # distinct streams
    n_prompt = r1["usage"]["prompt_tokens"]
    one = live.post("/v1/completions", dict(body, n=1)).json()
    assert n_prompt == one["usage"]["prompt_tokens"] and r1["usage"]["completion_tokens"] == 36
    assert one["choices"][0]["text"] == texts[0]  # choice 0 is the single request's
    greedy = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    both = live.post("/v1/completions", dict(greedy, prompt=PROMPTS[1:3], n=2)).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    for k, c in enumerate(both["choices"]):
        alone = live.post("/v1/completions", dict(greedy, prompt=PROMPTS[1 + k // 2])).json()
        assert c["text"] == alone["choices"][0]["text"]
    assert both["usage"]["completion_tokens"] == 32
    # the openai client reads them
    r = live.client.completions.create(model=MODEL, prompt=[PROMPTS[3], PROMPTS[4]], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]


def test_completion_logprobs(live):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "logprobs": 3,
            "ignore_eos": True, "return_token_ids": True}
    r = live.post("/v1/completions", body).json()
    (c,) = r["choices"]
    lp = c["logprobs"]
    ids = c["token_ids"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) == 16
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert v <= 0 and 3 <= len(top) <= 4 and top[tok] == v
        assert max(top.values()) == v  # greedy: the most likely token
    if live.kind == "real":  # the engine's own numbers
        want = live.engine.generate([PROMPTS[0]], max_new_tokens=16, stop_token_ids=[], logprobs=3)[0]
        assert want.token_ids == ids and _lp_close([x.logprob for x in want.logprobs], lp["token_logprobs"])
    r = live.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=0)
    assert len(r.choices[0].logprobs.token_logprobs) == 4 and len(r.choices[0].logprobs.top_logprobs[0]) == 1


def test_chat_logprobs(chat_live):
    r = chat_live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                                 extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and bytes(e.bytes).decode("utf-8", "replace") is not None
        assert e.top_logprobs[0].logprob == e.logprob and e.top_logprobs[0].token == e.token
    r = chat_live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, temperature=0, logprobs=False)
    assert r.choices[0].logprobs is None


def test_streamed_choices_carry_their_logprobs(live, chat_live):
    """A stream of n choices: every chunk names its choice; each choice's text, token ids and
    logprobs put together equal the non-streamed response's."""
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 14, "temperature": 0, "n": 2, "logprobs": 2,
            "ignore_eos": True, "return_token_ids": True}
    whole = live.post("/v1/completions", body).json()
    with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                      json=dict(body, stream=True, stream_options={"include_usage": True})) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    got = {0: {"text": "", "ids": [], "tokens": [], "lps": []}, 1: {"text": "", "ids": [], "tokens": [], "lps": []}}
    finals = 0
    for ev in events[:-1]:
        (c,) = ev["choices"]
        g = got[c["index"]]
        g["text"] += c["text"]
        g["ids"] += c.get("token_ids") or []
        if c["logprobs"]:
            g["tokens"] += c["logprobs"]["tokens"]
            g["lps"] += c["logprobs"]["token_logprobs"]
        finals += c["finish_reason"] is not None
    assert finals == 2 and events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    for k in (0, 1):
        w = whole["choices"][k]
        assert got[k]["text"] == w["text"] and got[k]["ids"] == w["token_ids"]
        assert got[k]["tokens"] == w["logprobs"]["tokens"] and got[k]["lps"] == w["logprobs"]["token_logprobs"]
    # chat: the delta's logprobs.content
    with httpx.stream("POST", chat_live.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                            "temperature": 0, "logprobs": True, "stream": True, "ignore_eos": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    content = [e for ev in events for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert len(content) == 5 and all(e["top_logprobs"] == [] for e in content)


def test_echo_and_prompt_logprobs(live):
    """echo puts the prompt before the text; with logprobs the prompt's tokens are scored too
    (the first one has none), and max_tokens 0 scores a prompt without generating."""
    ids = [5, 17, 33, 101, 7, 64]
    r = live.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
                                      "echo": True, "ignore_eos": True}).json()
    plain = live.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
                                          "ignore_eos": True}).json()
    assert r["choices"][0]["text"] == PROMPTS[1] + plain["choices"][0]["text"]
    score = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    r = live.post("/v1/completions", score).json()
    lp = r["choices"][0]["logprobs"]
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 6
    assert r["choices"][0]["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == 6
    eng = live.engine
    lg = np.asarray(eng.logits(ids), np.float64)[:-1]
    ref = lg - (lg.max(1, keepdims=True) + np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1, keepdims=True)))
    assert _lp_close(lp["token_logprobs"][1:], [ref[j - 1, ids[j]] for j in range(1, 6)])
    for j in range(1, 6):
        assert len(lp["top_logprobs"][j]) in (2, 3)
        assert abs(max(lp["top_logprobs"][j].values()) - ref[j - 1].max()) < 1e-4
    # streamed: the prompt's chunk first
    with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                      json=dict(score, max_tokens=3, stream=True, ignore_eos=True)) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) == 6
    total = sum(len(ev["choices"][0]["logprobs"]["tokens"]) for ev in events if ev["choices"][0]["logprobs"])
    assert total == 9


def test_api_key_guards_v1_only():
    eng = _engine("fake")
    bg = server.BackgroundServer(server.create_app(eng, model_name=MODEL, api_key="s3cret"))
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        r = httpx.post(bg.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(bg.url + "/v1/completions", json=body, timeout=30, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        assert httpx.get(bg.url + "/v1/models", timeout=30).status_code == 401
        ok = openai.OpenAI(base_url=bg.url + "/v1", api_key="s3cret", max_retries=0, timeout=30)
        assert len(ok.completions.create(model=MODEL, prompt="x", max_tokens=2).choices) == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=bg.url + "/v1", api_key="x", max_retries=0).models.list()
        assert httpx.get(bg.url + "/health", timeout=30).status_code == 200
        assert httpx.get(bg.url + "/metrics", timeout=30).status_code == 200
    finally:
        bg.stop()
        eng.close()
    with pytest.raises(ValueError):
        server.create_app(eng, api_key="")


def test_tokenize_and_detokenize(live, chat_live):
    r = live.post("/tokenize", {"prompt": PROMPTS[0]}).json()
    ids = live.engine.encode(PROMPTS[0])
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == live.engine.max_seq_len
    assert live.post("/detokenize", {"tokens": ids}).json()["prompt"] == live.engine.decode(ids)
    assert live.post("/tokenize", {"prompt": 5}).status_code == 400
    assert live.post("/detokenize", {"tokens": [10 ** 8]}).json()["error"]["param"] == "tokens"
    msgs = [{"role": "user", "content": "hi"}]
    r = chat_live.post("/tokenize", {"messages": msgs}).json()
    done = chat_live.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    assert r["count"] == done.usage.prompt_tokens


def test_a_failed_choice_ends_its_siblings(live):
    if live.kind != "fake":
        pytest.skip("needs the fake engine's fault injection")
    eng = live.engine
    before = len(eng.cancelled)
    eng.fail_next("kaboom in choice 0")
    t0 = time.monotonic()
    r = live.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 3, "max_tokens": 4000,
                                      "ignore_eos": True, "temperature": 0})
    assert r.status_code == 500 and "kaboom in choice 0" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 3.0  # not after the other choices' 4000 tokens
    assert wait_until(lambda: len(eng.cancelled) >= before + 2, 5) is not None  # choices 1 and 2


def test_penalties_and_logit_bias(live):
    """presence / frequency / repetition penalties, logit_bias and min_tokens reach the engine
    (the real engine: the tokens are the engine's own for those arguments; logit_bias +100
    forces a token), in streams too; defaults send nothing."""
    eng = live.engine
    body = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2, "logit_bias": {"7": 2.5},
            "return_token_ids": True, "ignore_eos": True}
    r = complete(live, PROMPTS[2], max_tokens=16, extra_body=body)
    ids = r.choices[0].model_extra["token_ids"]
    if live.kind == "fake":
        assert eng.last_adjust == {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2,
                                   "logit_bias": {7: 2.5}}
        complete(live, PROMPTS[2], max_tokens=4)
        assert eng.last_adjust == {}
        return
    direct = eng.generate([eng.encode(PROMPTS[2])], max_new_tokens=16, stop_token_ids=[], presence_penalty=0.5,
                          frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={7: 2.5})[0]
    assert ids == list(direct.token_ids)
    plain = complete(live, PROMPTS[2], max_tokens=16, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert plain.choices[0].model_extra["token_ids"] != ids
    stream = complete(live, PROMPTS[2], max_tokens=16, stream=True, extra_body=body)
    got = [t for c in stream if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert got == ids
    forced = complete(live, PROMPTS[3], max_tokens=6, extra_body={"logit_bias": {"42": 100}, "return_token_ids": True,
                                                                    "ignore_eos": True})
    assert forced.choices[0].model_extra["token_ids"] == [42] * 6
    # min_tokens holds back a stop token id (and stop strings) until that many tokens
    t = ids[1]
    early = complete(live, PROMPTS[2], max_tokens=16, extra_body=dict(body, stop_token_ids=[t]))
    assert early.choices[0].model_extra["token_ids"] == ids[:2]
    late = complete(live, PROMPTS[2], max_tokens=16, extra_body=dict(body, stop_token_ids=[t], min_tokens=8))
    late_ids = late.choices[0].model_extra["token_ids"]
    assert len(late_ids) >= 8 and t not in late_ids[:8]
    text = eng.decode(ids[1:2])
    if text.strip():  # a stop string in the second token's text: matched only after min_tokens
        r1 = complete(live, PROMPTS[2], max_tokens=16, stop=[text], extra_body=body)
        assert r1.choices[0].finish_reason == "stop" and len(r1.choices[0].text) <= len(eng.decode(ids[:1]))
        r2 = complete(live, PROMPTS[2], max_tokens=16, stop=[text], extra_body=dict(body, min_tokens=8))
        assert len(r2.choices[0].model_extra["token_ids"]) >= 8
        assert r2.choices[0].text.startswith(eng.decode(ids[:6]))  # no stop string before token 8
        assert len(r2.choices[0].text) > len(r1.choices[0].text)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def test_structured_output(live, chat_live):
    """response_format (json_object, json_schema), structured_outputs and guided_* reach the
    engine as one spec (the fake engine records it); on the real engine the text follows it
    (chat and completions, streamed == not), and a spec the engine rejects is a 400."""
    ways = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
             {"json": SCHEMA}),
            ({"response_format": {"type": "json_object"}}, {"json_object": True}),
            ({"structured_outputs": {"regex": "[a-z]{3}", "choice": None}}, {"regex": "[a-z]{3}"}),
            ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
            ({"guided_json": SCHEMA}, {"json": SCHEMA}),
            ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
            ({"guided_grammar": 'start: "a" | "b"'}, {"grammar": 'start: "a" | "b"'})]
    eng = live.engine
    if live.kind == "fake":
        for extra, spec in ways:
            complete(live, PROMPTS[1], max_tokens=4, extra_body=extra)
            assert eng.last_adjust == {"structured_outputs": spec}, extra
        complete(live, PROMPTS[1], max_tokens=4, extra_body={"response_format": {"type": "text"}})
        assert eng.last_adjust == {}
        return
    pytest.importorskip("llguidance")
    compact = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    r = complete(live, PROMPTS[1], max_tokens=60, extra_body=compact)
    v = json.loads(r.choices[0].text)
    assert set(v) == {"n", "ok"} and isinstance(v["n"], int) and isinstance(v["ok"], bool)
    assert r.choices[0].finish_reason == "stop"
    s = complete(live, PROMPTS[1], max_tokens=60, stream=True, extra_body=compact)
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text
    r = complete(live, PROMPTS[2], max_tokens=10, extra_body={"guided_choice": ["alpha", "beta (2)"]})
    assert r.choices[0].text in ("alpha", "beta (2)") and r.choices[0].finish_reason == "stop"
    r = complete(live, PROMPTS[0], max_tokens=12, n=2, temperature=1.0, seed=4,
                 extra_body={"guided_regex": "[0-9]{2}-[a-z]{2}"})
    assert all(re.fullmatch("[0-9]{2}-[a-z]{2}", c.text) for c in r.choices)
    c = chat_live.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    text = c.choices[0].message.content
    if c.choices[0].finish_reason == "length":  # (any whitespace: the pair may spend the budget on it)
        assert text.lstrip().startswith("{")
    else:
        assert json.loads(text).keys() == {"n", "ok"}
    for bad in ({"guided_regex": "(unclosed"}, {"structured_outputs": {"jsonn": {}}},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}):
        resp = live.post("/v1/completions", dict(model=MODEL, prompt="x", max_tokens=4, **bad))
        assert resp.status_code == 400, (bad, resp.text)
        err = resp.json()["error"]
        assert err["param"] == next(iter(bad)) and err["param"] in err["message"], err


def test_best_of_returns_the_most_likely_choices(live):
    """best_of > n: best_of samples per prompt, the n with the highest mean log-probability
    per token returned (renumbered), usage counting every sample's tokens; the same seeded
    samples requested as n = best_of with logprobs show which were the best."""
    body = {"temperature": 1.0, "seed": 11, "ignore_eos": True, "return_token_ids": True}
    r = complete(live, [PROMPTS[1], PROMPTS[2]], max_tokens=12, n=2, best_of=5, extra_body=body)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.logprobs is None for c in r.choices)  # not asked for
    every = complete(live, [PROMPTS[1], PROMPTS[2]], max_tokens=12, n=5, logprobs=0, extra_body=body)
    assert r.usage.completion_tokens == every.usage.completion_tokens  # all ten samples counted
    for g in range(2):
        group = every.choices[5 * g:5 * g + 5]
        mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in group]
        order = sorted(range(5), key=lambda i: (-mean[i], i))[:2]
        got = [c.model_extra["token_ids"] for c in r.choices[2 * g:2 * g + 2]]
        assert got == [group[i].model_extra["token_ids"] for i in order]
    # best_of == n (or 1, OpenAI's default) changes nothing
    one = complete(live, PROMPTS[1], max_tokens=6, n=2, best_of=2, extra_body=body)
    assert len(one.choices) == 2
    assert len(complete(live, PROMPTS[1], max_tokens=6, n=3, best_of=1, extra_body=body).choices) == 3



def test_skip_special_tokens(live):
    """skip_special_tokens (default true): a special token's text (the bundled tokenizer's
    <|mask|>, id 1, forced by logit_bias) is left out of the text, or kept with false."""
    if live.kind == "fake":
        pytest.skip("the fake engine's tokenizer has no special tokens")
    body = {"logit_bias": {"1": 100}, "ignore_eos": True, "return_token_ids": True}
    r = complete(live, PROMPTS[0], max_tokens=3, extra_body=body)
    assert r.choices[0].model_extra["token_ids"] == [1, 1, 1] and r.choices[0].text == ""
    r = complete(live, PROMPTS[0], max_tokens=3, extra_body=dict(body, skip_special_tokens=False))
    assert r.choices[0].text == "<|mask|>" * 3
    chunks = complete(live, PROMPTS[0], max_tokens=3, stream=True, extra_body=dict(body, skip_special_tokens=False))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "<|mask|>" * 3
