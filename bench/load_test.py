"""A bounded load test of the HTTP server (dflash2-rt serve): many concurrent OpenAI-style
clients on localhost with mixed prompt and output lengths, a quarter of them disconnecting
early; checks correctness under load and reports latency and throughput.

    python bench/load_test.py --fake                 # against the pure-Python fake engine
    python bench/load_test.py                        # the real Engine over the bundled pair
    python bench/load_test.py --url http://127.0.0.1:8000   # a running server

Steps: (1) start the server in this process (or use --url); (2) build a pool of --distinct
requests (text prompts cut from the Python standard library's sources, tokenized with the
bundled tokenizer: mixed prompt lengths and max_tokens; greedy; ignore_eos so outputs have
the asked length, unless --respect-eos) and compute each one's single-request output, one at
a time; (3) --clients concurrent clients each send --requests-per-client requests drawn from
the pool: a quarter streaming and disconnecting after a few chunks, half streaming to the
end, a quarter non-streaming; (4) check that every completed response equals its
single-request output token for token (and text), that every disconnected client's tokens are
a prefix of it, that no request failed, and that afterwards the engine is idle (0 running,
0 queued; any "...pages_used" metric 0) and the server healthy; (5) print throughput
(tokens/s), time to first token, inter-token latency (a chunk of k tokens after a gap g
counts k tokens of g/k: speculative decoding commits several tokens a step), time per output
token and end-to-end latency, p50 / p99; write JSON to --out (default
bench/results/load_test.json). Exit code 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import httpx  # noqa: E402

import serve_support as sup  # noqa: E402


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(xs, scale=1.0):
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": sum(xs) / len(xs) * scale, "p50": percentile(xs, 50) * scale,
            "p90": percentile(xs, 90) * scale, "p99": percentile(xs, 99) * scale, "max": max(xs) * scale}


def corpus_ids(tokenizer, n_files: int = 40, seed: int = 0) -> list:
    """Token ids of some of the standard library's Python sources (the bundled pair was trained
    on them), or of this repository's Python files when the stdlib sources are absent."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if len(files) < 5:
        files = sorted(glob.glob(os.path.join(ROOT, "python", "dflash2_rt", "**", "*.py"), recursive=True))
    random.Random(seed).shuffle(files)
    ids = []
    for f in files[:n_files]:
        try:
            with open(f, encoding="utf-8", errors="replace") as fh:
                ids.extend(tokenizer.encode(fh.read()).ids)
        except OSError:
            continue
    return ids


def make_pool(args, tokenizer, max_seq_len: int) -> list:
    rng = random.Random(args.seed)
    ids = corpus_ids(tokenizer, seed=args.seed)
    prompt_lens = [8, 16, 32, 64, 128, 256, 512]
    out_lens = [4, 8, 16, 32, 64, 128, 256]
    pool = []
    for i in range(args.distinct):
        lp = rng.choice(prompt_lens)
        lo = rng.choice(out_lens)
        lp = min(lp, max_seq_len // 2)
        lo = max(1, min(lo, max_seq_len - 2 * lp - 8))  # room for the re-tokenized text prompt
        s = rng.randrange(0, max(1, len(ids) - lp))
        text = tokenizer.decode(ids[s:s + lp]) or "def f():"
        pool.append({"i": i, "prompt": text, "max_tokens": lo})
    return pool


class Client:
    def __init__(self, url: str, model: str, ignore_eos: bool):
        self.url = url
        self.model = model
        self.ignore_eos = ignore_eos

    def body(self, spec: dict, stream: bool) -> dict:
        b = {"model": self.model, "prompt": spec["prompt"], "max_tokens": spec["max_tokens"], "temperature": 0,
             "return_token_ids": True, "stream": stream}
        if self.ignore_eos:
            b["ignore_eos"] = True
        return b

    async def full(self, http: httpx.AsyncClient, spec: dict) -> dict:
        t0 = time.perf_counter()
        r = await http.post(self.url + "/v1/completions", json=self.body(spec, False))
        t1 = time.perf_counter()
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
        c = r.json()["choices"][0]
        return {"ids": c["token_ids"], "text": c["text"], "finish_reason": c["finish_reason"], "e2e": t1 - t0}

    async def stream(self, http: httpx.AsyncClient, spec: dict, stop_after: int = 0) -> dict:
        """stop_after > 0: close the response after that many chunks with tokens."""
        t0 = time.perf_counter()
        ids, text, times, counts, reason = [], [], [], [], None
        async with http.stream("POST", self.url + "/v1/completions", json=self.body(spec, True)) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    return {"error": obj["error"].get("message")}
                if not obj["choices"]:
                    continue
                ch = obj["choices"][0]
                new = ch.get("token_ids") or []
                text.append(ch.get("text") or "")
                if ch.get("finish_reason"):
                    reason = ch["finish_reason"]
                if new:
                    ids.extend(new)
                    times.append(time.perf_counter())
                    counts.append(len(new))
                    if stop_after and len(times) >= stop_after:
                        break  # leaving the block closes the connection: the server must cancel
        t1 = time.perf_counter()
        res = {"ids": ids, "text": "".join(text), "finish_reason": reason, "e2e": t1 - t0, "disconnected": bool(
            stop_after) and not done}
        if times:
            res["ttft"] = times[0] - t0
            res["itl"] = [g / k for prev, t, k in zip(times, times[1:], counts[1:]) for g in [t - prev]
                          for _ in range(k)]
            if len(ids) > counts[0]:
                res["tpot"] = (times[-1] - times[0]) / (len(ids) - counts[0])
        return res


async def engine_metrics(url: str, http: httpx.AsyncClient, engine=None) -> dict:
    if engine is not None:
        return dict(await asyncio.to_thread(engine.metrics))
    r = await http.get(url + "/metrics")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return {"queue_length": out.get("dflash2_queue_length"), "running": out.get("dflash2_running_requests"),
            "generated_tokens_total": out.get("dflash2_generated_tokens_total"), "prometheus": out}


async def server_gauge(url: str, http: httpx.AsyncClient, name: str) -> float:
    r = await http.get(url + "/metrics")
    for line in r.text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


async def run_load(args, url: str, model: str, engine, tokenizer, max_seq_len: int) -> dict:
    cl = Client(url, model, not args.respect_eos)
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        pool = make_pool(args, tokenizer, max_seq_len)
        # (2) single-request outputs, one at a time
        t0 = time.perf_counter()
        ref = {}
        for spec in pool:
            r = await cl.full(http, spec)
            if "error" in r:
                raise SystemExit(f"reference request {spec['i']} failed: {r['error']}")
            ref[spec["i"]] = r
        ref_s = time.perf_counter() - t0
        print(f"references: {len(pool)} requests one at a time in {ref_s:.1f} s", file=sys.stderr, flush=True)

        # (3) the load
        rng = random.Random(args.seed + 1)
        plan = []
        for c in range(args.clients):
            reqs = []
            for j in range(args.requests_per_client):
                spec = rng.choice(pool)
                u = rng.random()
                if u < args.disconnect_fraction:
                    mode = "disconnect"
                elif u < args.disconnect_fraction + (1 - args.disconnect_fraction) * 2 / 3:
                    mode = "stream"
                else:
                    mode = "full"
                reqs.append((spec, mode, rng.randint(1, 4)))
            plan.append(reqs)
        m0 = await engine_metrics(url, http, engine)
        disc0 = await server_gauge(url, http, "dflash2_client_disconnects_total")
        results = []
        start = asyncio.Event()

        async def client(c):
            await start.wait()
            for spec, mode, k in plan[c]:
                try:
                    if mode == "full":
                        r = await cl.full(http, spec)
                    else:
                        r = await cl.stream(http, spec, stop_after=k if mode == "disconnect" else 0)
                except Exception as e:  # noqa: BLE001 - counted as a failure
                    r = {"error": f"{type(e).__name__}: {e}"}
                r.update(client=c, spec=spec["i"], mode=mode)
                results.append(r)

        tasks = [asyncio.create_task(client(c)) for c in range(args.clients)]
        t_load = time.perf_counter()
        start.set()
        await asyncio.wait_for(asyncio.gather(*tasks), args.timeout)
        wall = time.perf_counter() - t_load

        # (4) checks
        errors = [r for r in results if "error" in r]
        mismatches, prefix_bad = [], []
        for r in results:
            if "error" in r:
                continue
            want = ref[r["spec"]]
            if r["mode"] == "disconnect" and r.get("disconnected"):
                if r["ids"] != want["ids"][:len(r["ids"])]:
                    prefix_bad.append(r)
            elif r["ids"] != want["ids"] or r["text"] != want["text"]:
                mismatches.append(r)
        t_idle = time.perf_counter()
        idle, m1 = False, {}
        while time.perf_counter() - t_idle < args.idle_timeout:
            m1 = await engine_metrics(url, http, engine)
            active = await server_gauge(url, http, "dflash2_server_active_requests")
            if m1.get("running") == 0 and m1.get("queue_length") == 0 and active == 0:
                idle = True
                break
            await asyncio.sleep(0.05)
        pages_busy = {k: v for k, v in m1.items() if isinstance(v, (int, float)) and "page" in k
                      and any(w in k for w in ("used", "in_use", "allocated", "busy")) and v != 0}
        disc1 = await server_gauge(url, http, "dflash2_client_disconnects_total")
        healthy = (await http.get(url + "/health")).status_code == 200

    done = [r for r in results if "error" not in r]
    n_disc = sum(1 for r in done if r.get("disconnected"))
    # disconnected streams that had all their tokens already (the server may have finished them first)
    n_disc_full = sum(1 for r in done if r.get("disconnected") and len(r["ids"]) == len(ref[r["spec"]]["ids"]))
    tokens = sum(len(r["ids"]) for r in done)
    completed_tokens = sum(len(r["ids"]) for r in done if not r.get("disconnected"))
    gen0, gen1 = m0.get("generated_tokens_total"), m1.get("generated_tokens_total")
    summary = {
        "config": {k: v for k, v in vars(args).items()},
        "model": model,
        "requests": len(results),
        "completed": len(done) - n_disc,
        "disconnected": n_disc,
        "disconnected_with_all_tokens": n_disc_full,
        "disconnects_seen_by_server": None if disc1 != disc1 else disc1 - disc0,
        "engine_cancelled": len(engine.cancelled) if hasattr(engine, "cancelled") else None,  # the fake's record
        "errors": [r["error"] for r in errors][:10],
        "n_errors": len(errors),
        "mismatches": [{"client": r["client"], "spec": r["spec"], "mode": r["mode"]} for r in mismatches][:10],
        "n_mismatches": len(mismatches),
        "n_bad_prefixes": len(prefix_bad),
        "reference_s": ref_s,
        "wall_s": wall,
        "received_tokens": tokens,
        "completed_tokens": completed_tokens,
        "throughput_tokens_per_s": tokens / wall if wall > 0 else None,
        "engine_generated_tokens": (gen1 - gen0) if gen0 is not None and gen1 is not None else None,
        "engine_tokens_per_s": ((gen1 - gen0) / wall) if gen0 is not None and gen1 is not None and wall > 0 else None,
        "requests_per_s": len(done) / wall if wall > 0 else None,
        "ttft_ms": dist([r["ttft"] for r in done if "ttft" in r], 1e3),
        "itl_ms": dist([x for r in done for x in r.get("itl", [])], 1e3),
        "tpot_ms": dist([r["tpot"] for r in done if "tpot" in r], 1e3),
        "e2e_s": dist([r["e2e"] for r in done if not r.get("disconnected")]),
        "idle_after": idle,
        "final_engine_metrics": {k: v for k, v in m1.items() if k != "prometheus"},
        "busy_pages": pages_busy,
        "healthy_after": healthy,
    }
    summary["ok"] = (not errors and not mismatches and not prefix_bad and idle and healthy and not pages_busy)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake", action="store_true", help="serve the pure-Python fake engine (tests/fake_engine.py)")
    ap.add_argument("--url", default=None, help="test a running server instead of starting one")
    ap.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--method", default=None)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill-tokens-per-step", type=int, default=None,
                    help="the engine's prefill_tokens_per_step (default: max_step_tokens; 0 = every prompt whole)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--distinct", type=int, default=32, help="distinct requests in the pool (references)")
    ap.add_argument("--disconnect-fraction", type=float, default=0.25)
    ap.add_argument("--respect-eos", action="store_true", help="stop at eos (default: ignore_eos, fixed lengths)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fake-step-time", type=float, default=0.003, help="the fake engine's step time (s)")
    ap.add_argument("--timeout", type=float, default=900, help="limit for the load phase (s)")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--idle-timeout", type=float, default=10, help="wait for 0 running / 0 queued after the load")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "load_test.json"))
    args = ap.parse_args(argv)

    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(sup.BUNDLED, "target", "tokenizer.json"))
    engine = bg = None
    if args.url:
        url = args.url.rstrip("/")
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        model = args.model or models[0]["id"]
        max_seq_len = int(models[0].get("max_model_len") or 4096)
    else:
        server = sup.load_server()
        kw = dict(max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, speculation=args.speculation)
        if args.fake:
            kw["step_time"] = args.fake_step_time
        else:
            kw["prefill_tokens_per_step"] = args.prefill_tokens_per_step
            for k in ("draft", "method"):
                if getattr(args, k) is not None:
                    kw[k] = getattr(args, k)
            if args.threads is not None:
                kw["num_threads"] = args.threads
        try:
            engine = sup.make_engine("fake" if args.fake else "real", target=args.target, **kw)
        except LookupError as e:
            print(f"error: {e} (use --fake, or --url for a running server)", file=sys.stderr)
            return 2
        model = args.model or "load-test"
        bg = sup.load_server().BackgroundServer(server.create_app(engine, model_name=model))
        url = bg.url
        max_seq_len = engine.max_seq_len
    print(f"load test: {args.clients} clients x {args.requests_per_client} requests against {url} "
          f"({'fake engine' if args.fake else 'in-process engine' if engine else 'external server'})",
          file=sys.stderr, flush=True)
    try:
        summary = asyncio.run(run_load(args, url, model, engine, tokenizer, max_seq_len))
    finally:
        if bg is not None:
            bg.stop()
        if engine is not None:
            engine.close()
    summary["engine"] = "fake" if args.fake else ("url" if args.url else "real")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)

    def ms(d):
        return f"p50 {d['p50']:.1f} ms, p99 {d['p99']:.1f} ms" if d.get("n") else "-"

    print(f"requests: {summary['requests']} ({summary['completed']} completed, {summary['disconnected']} "
          f"disconnected early, {summary['n_errors']} errors) in {summary['wall_s']:.2f} s")
    print(f"correctness: {summary['n_mismatches']} completed responses differ from the single-request output, "
          f"{summary['n_bad_prefixes']} disconnected streams are not a prefix of it")
    print(f"throughput: {summary['throughput_tokens_per_s']:.0f} tokens/s received"
          + (f", {summary['engine_tokens_per_s']:.0f} tokens/s generated by the engine"
             if summary["engine_tokens_per_s"] is not None else "")
          + f", {summary['requests_per_s']:.1f} requests/s")
    print(f"time to first token: {ms(summary['ttft_ms'])}")
    print(f"inter-token latency: {ms(summary['itl_ms'])}")
    print(f"time per output token: {ms(summary['tpot_ms'])}")
    e2e = summary["e2e_s"]
    if e2e.get("n"):
        print(f"end-to-end latency: p50 {e2e['p50']:.2f} s, p99 {e2e['p99']:.2f} s")
    fm = summary["final_engine_metrics"]
    print(f"after: running {fm.get('running')}, queued {fm.get('queue_length')}, idle {summary['idle_after']}, "
          f"busy pages {summary['busy_pages'] or 'none'}, healthy {summary['healthy_after']}, "
          f"disconnects seen by the server {summary['disconnects_seen_by_server']} (of {summary['disconnected']}, "
          f"{summary['disconnected_with_all_tokens']} of which had all their tokens)")
    print(f"{'OK' if summary['ok'] else 'FAILED'}; wrote {os.path.relpath(args.out)}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
