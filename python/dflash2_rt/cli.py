"""The ``dflash2-rt`` command line (also ``python -m dflash2_rt``).

Each subcommand is one entry of ``_COMMANDS``: a name, a help line, a function that adds
its arguments to its sub-parser and a function that runs it and returns the exit code.
Errors of the runtime (DFlash2Error) are printed as one ``error: ...`` line with exit code
1, never as a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, NamedTuple, Optional, Sequence

from . import DFlash2Error, build_info, cuda_available
from .checkpoint import DTYPE_SIZES, inspect_checkpoint


class _Command(NamedTuple):
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _human(n: float, units: Sequence[str], base: float) -> str:
    for unit in units[:-1]:
        if abs(n) < base:
            return f"{n:.1f} {unit}" if unit != units[0] else f"{int(n)} {unit}".rstrip()
        n /= base
    return f"{n:.1f} {units[-1]}"


def human_bytes(n: int) -> str:
    return _human(n, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"], 1024.0)


def human_count(n: int) -> str:
    return _human(n, ["", "K", "M", "B", "T"], 1000.0)


def printable(s: str) -> str:
    """`s` safe to print on a terminal: backslashes, control characters (ESC, newlines, ...)
    and other non-printable characters (format characters such as U+202E, unassigned code
    points, lone surrogates) escaped as \\, \\n, \\x1b, \\u202e; printable text unchanged."""
    out = []
    for ch in s:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        elif ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        else:
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return "".join(out)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---------------------------------------------------------------------------- inspect


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a .safetensors file or a checkpoint directory")
    p.add_argument("--summary", action="store_true", help="print the totals only, not the per-tensor table")
    p.add_argument("--json", action="store_true", help="print {name: {dtype, shape, file}} and totals as JSON")


def _run_inspect(args: argparse.Namespace) -> int:
    tensors = inspect_checkpoint(args.path)
    params = 0
    total_bytes = 0
    per_dtype: dict[str, int] = {}
    files = set()
    for info in tensors.values():
        n = _numel(info["shape"])
        b = n * DTYPE_SIZES[info["dtype"]]
        params += n
        total_bytes += b
        per_dtype[info["dtype"]] = per_dtype.get(info["dtype"], 0) + b
        files.add(info["file"])
    if args.json:
        out = {"tensors": tensors,
               "totals": {"tensors": len(tensors), "parameters": params, "bytes": total_bytes,
                          "bytes_per_dtype": dict(sorted(per_dtype.items())), "files": sorted(files)}}
        print(json.dumps(out, indent=1))
        return 0
    if not args.summary and tensors:
        rows = [("name", "dtype", "shape", "file")]
        for name, info in tensors.items():
            shape = "[" + ", ".join(str(d) for d in info["shape"]) + "]"
            rows.append((printable(name), printable(info["dtype"]), shape, printable(info["file"])))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
        print()
    print(f"tensors:    {len(tensors)}")
    print(f"files:      {len(files)}")
    print(f"parameters: {params:,} ({human_count(params)})")
    print(f"bytes:      {total_bytes:,} ({human_bytes(total_bytes)})")
    for dt in sorted(per_dtype):
        print(f"  {printable(dt) + ':':<9} {per_dtype[dt]:,} ({human_bytes(per_dtype[dt])})")
    return 0


# ---------------------------------------------------------------------------- info


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print build_info() as JSON")


def _run_info(args: argparse.Namespace) -> int:
    info = build_info()
    ok, why = cuda_available(with_reason=True)
    info["cuda_available"] = ok
    if not ok:
        info["cuda_unavailable_reason"] = why
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        if isinstance(v, (list, tuple)):
            v = ", ".join(str(x) for x in v) if v else "-"
        elif v == "":
            v = "-"
        print(f"{k + ':':<{width + 1}} {v}")
    return 0


# ---------------------------------------------------------------------------- generate
def _add_gemm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-gemm", choices=("auto", "exact", "bf16", "fp8", "nvfp4"), default="auto",
                   help="prompt tokens' GEMM numerics: bf16 = tensor cores (CPU: emulated), fp8 = W8A8 for an "
                        "FP8 block-128 checkpoint, nvfp4 = W4A4 for an NVFP4 one, exact = fp32 activations; "
                        "auto = fp8 / nvfp4 / bf16 on a supported GPU, else exact")
    p.add_argument("--draft-gemm", choices=("auto", "exact", "bf16", "fp8", "nvfp4"), default="auto",
                   help="the DFlash drafter's GEMM numerics, as --prefill-gemm for the drafter's weights (lossless "
                        "whichever: drafts only steer acceptance); auto = the tensor cores on a supported GPU")
    p.add_argument("--decode-gemm", choices=("auto", "exact", "bf16", "fp8", "nvfp4"), default="exact",
                   help="generated tokens' GEMM numerics (decode and verify chunks), as --prefill-gemm; exact (the "
                        "default) = fp32 as on the CPU; any mode keeps speculative == AR")
    p.add_argument("--kv-cache-dtype", choices=("f32", "bf16", "fp8"), default="f32",
                   help="the target's MLA latent and indexer-key caches: f32 (default), bf16 (half the memory) or "
                        "fp8 (E4M3 with power-of-two scales per 128 values, the latent's rope in BF16: 0.57x BF16's "
                        "bytes for GLM-5.3); speculative == AR in every form")


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="target checkpoint directory (glm_moe_dsa; default: the bundled default pair)")
    p.add_argument("--draft", default=None, help="drafter checkpoint directory (methods dflash2 / dflash)")
    p.add_argument("--method", default=None, choices=["ar", "mtp", "dflash", "dflash2"],
                   help="decoding method (default: from the drafter's architecture with --draft, dflash2 on the "
                        "bundled pair, else ar)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs tokenizer.json in the target directory)")
    g.add_argument("--prompt-ids", help="prompt token ids, comma- or space-separated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed, an integer in [0, 2**63)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="prompt + generated tokens (default: min(4096, the model's max_position_embeddings))")
    p.add_argument("--device", default="cpu",
                   help="where the target runs: cpu, cuda or cuda:N (CUDA: see the README; never run on a GPU yet)")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="ranks the target is split across (on the CPU: threads of this process)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tensor-parallel > 1: whole routed experts per rank instead of a slice of each")
    _add_gemm_args(p)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="CUDA: run every forward chunk eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each token's log-probability under the target and the N most likely tokens' (0..20): "
                        "a table after the text, or 'logprobs' in --json")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X (in [-2, 2]) from the logit of every token generated so far")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X (in [-2, 2]) per occurrence from the logit of every token generated so far")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                   help="divide (multiply when negative) the logits of the prompt's and the output's tokens by X "
                        "(> 0; 1 = off)")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no stop token before N generated tokens")
    so = p.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="SCHEMA",
                    help="structured output: JSON following this JSON schema (JSON text, or a file holding it)")
    so.add_argument("--json-object", action="store_true", help="structured output: any JSON object")
    so.add_argument("--regex", metavar="RE", help="structured output: text matching this regular expression")
    so.add_argument("--choice", nargs="+", metavar="TEXT", help="structured output: exactly one of these texts")
    so.add_argument("--grammar", metavar="LARK",
                    help="structured output: text of this Lark grammar (the grammar, or a file holding it)")
    p.add_argument("--no-json-whitespace", action="store_true",
                   help="with --json-schema / --json-object: no whitespace between JSON tokens")


def _text_or_file(v: str) -> str:
    """v, or the contents of the file v names."""
    if os.path.isfile(v):
        with open(v, encoding="utf-8") as f:
            return f.read()
    return v


def _structured_spec(args: argparse.Namespace):
    """The structured-output spec of generate's --json-schema / --json-object / --regex /
    --choice / --grammar (None: none)."""
    spec = None
    if args.json_schema is not None:
        spec = {"json": _text_or_file(args.json_schema)}
    elif args.json_object:
        spec = {"json_object": True}
    elif args.regex is not None:
        spec = {"regex": args.regex}
    elif args.choice:
        spec = {"choice": args.choice}
    elif args.grammar is not None:
        spec = {"grammar": _text_or_file(args.grammar)}
    if spec is not None and args.no_json_whitespace:
        spec["disable_any_whitespace"] = True
    return spec


def _run_generate(args: argparse.Namespace) -> int:
    import time

    from .engine import Engine

    if args.seed is not None and not 0 <= args.seed < 2 ** 63:
        print(f"error: --seed must be an integer in [0, 2**63), found {args.seed}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"loading {args.target or 'the bundled default pair'}" + (f" + {args.draft}" if args.draft else "") +
          (f" (method {args.method})" if args.method else "") + " ...", file=sys.stderr, flush=True)
    eng = Engine(target=args.target, draft=args.draft, method=args.method, device=args.device,
                 max_seq_len=args.max_seq_len, max_batch_size=1, num_threads=args.threads,
                 tensor_parallel=args.tensor_parallel, expert_parallel=args.expert_parallel,
              prefill_gemm=args.prefill_gemm, draft_gemm=args.draft_gemm, decode_gemm=args.decode_gemm, cuda_graphs=args.cuda_graphs,
              kv_cache_dtype=args.kv_cache_dtype)
    method = eng.method
    print(f"loaded in {time.perf_counter() - t0:.2f} s (method {method})", file=sys.stderr, flush=True)
    if args.prompt is not None:
        prompt = args.prompt
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            print(f"error: --prompt-ids must be integers, found {args.prompt_ids!r}", file=sys.stderr)
            return 2
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
              top_k=args.top_k, seed=args.seed, logprobs=args.logprobs)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if getattr(args, name) != (1.0 if name == "repetition_penalty" else 0):
            kw[name] = getattr(args, name)
    spec = _structured_spec(args)
    if spec is not None:
        kw["structured_outputs"] = spec
    if args.stream and not args.json:
        # One generation: the tokens are printed as they come and the stats are this run's.
        box: dict = {}
        for tok in eng.stream(prompt, on_result=lambda res: box.setdefault("result", res), **kw):
            piece = eng.decode([tok]) if eng.tokenizer is not None else f"{tok} "
            print(piece, end="", flush=True)
        print()
        r = box["result"]
    else:
        r = eng.generate([prompt], **kw)[0]
    st = r.stats
    if args.json:
        out = {"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason, "stats": st}
        if r.logprobs is not None:
            out["logprobs"] = [{"token_id": t, "logprob": lp.logprob,
                                "top": [[i, v] for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                               for t, lp in zip(r.token_ids, r.logprobs)]
        print(json.dumps(out, indent=1))
        return 0
    if not args.stream:
        print(r.text if r.text is not None else " ".join(str(t) for t in r.token_ids))
    if r.logprobs is not None:
        def show(t):
            return repr(eng.decode([t])) if eng.tokenizer is not None else str(t)
        for t, lp in zip(r.token_ids, r.logprobs):
            top = "  ".join(f"{show(i)} {v:.3f}" for i, v in zip(lp.top_ids, lp.top_logprobs))
            print(f"{show(t):>16} {lp.logprob:9.4f}" + (f"   | {top}" if top else ""))
    print(f"[{method}] {st['generated_tokens']} tokens, {st['tokens_per_second']:.1f} tok/s, "
          f"acceptance length {st['acceptance_length']:.2f} over {st['verify_steps']} verify steps, "
          f"finish: {r.finish_reason}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- serve


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="target checkpoint directory (glm_moe_dsa; default: the bundled default pair)")
    p.add_argument("--draft", default=None, help="drafter checkpoint directory (methods dflash2 / dflash)")
    p.add_argument("--method", default=None, choices=["ar", "mtp", "dflash", "dflash2"],
                   help="decoding method (default: from the drafter's architecture with --draft, dflash2 on the "
                        "bundled pair, else ar)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together (default: 8)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="prompt + generated tokens per request (default: min(4096, the model's "
                        "max_position_embeddings))")
    p.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"],
                   help="speculation length policy (default: adaptive)")
    p.add_argument("--device", default="cpu",
                   help="where the target runs: cpu, cuda or cuda:N (CUDA: see the README; never run on a GPU yet)")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="ranks the target is split across (on the CPU: threads of this process)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tensor-parallel > 1: whole routed experts per rank instead of a slice of each")
    _add_gemm_args(p)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="CUDA: run every forward chunk eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--pad-to-buckets", choices=("auto", "on", "off"), default="auto",
                   help="pad decode steps run as one CUDA graph to batch-size buckets (1, 2, 4, 8, 16, 32, ...) "
                        "so each bucket has one graph; auto = on with CUDA graphs")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not keep prompts' KV-cache blocks for later prompts with the same prefix")
    p.add_argument("--prefill-tokens-per-step", type=int, default=None,
                   help="while requests decode, at most this many prompt tokens of new requests run between two "
                        "decode steps (default: one chunk, max_step_tokens; 0 = every new prompt whole first)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--model-name", default=None,
                   help="the model name clients must send (default: the target directory's name; 'default' for "
                        "the bundled pair)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file for /v1/chat/completions (default: the checkpoint's, from "
                        "tokenizer_config.json or chat_template.jinja)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--api-key", default=os.environ.get("DFLASH2_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DFLASH2_API_KEY; unset: open)")


def _run_serve(args: argparse.Namespace) -> int:
    import time

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"error: dflash2-rt serve needs fastapi and uvicorn ({e.name or e} is missing): "
              "pip install 'dflash2_rt[serve]'", file=sys.stderr)
        return 1
    if not 0 <= args.port <= 65535:
        print(f"error: --port must be in [0, 65535], found {args.port}", file=sys.stderr)
        return 2
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        print(f"error: --chat-template: no such file: {args.chat_template}", file=sys.stderr)
        return 2
    from .engine import Engine
    from .server import run

    if not hasattr(Engine, "submit"):
        print("error: this build's Engine has no request API (submit / poll / cancel): rebuild dflash2_rt",
              file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    print(f"loading {args.target or 'the bundled default pair'}" + (f" + {args.draft}" if args.draft else "") +
          (f" (method {args.method})" if args.method else "") + " ...", file=sys.stderr, flush=True)
    kw = dict(max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, speculation=args.speculation,
              tensor_parallel=args.tensor_parallel, expert_parallel=args.expert_parallel,
              prefill_gemm=args.prefill_gemm, draft_gemm=args.draft_gemm, decode_gemm=args.decode_gemm, cuda_graphs=args.cuda_graphs,
              kv_cache_dtype=args.kv_cache_dtype, prefill_tokens_per_step=args.prefill_tokens_per_step,
              prefix_caching=args.prefix_caching,
              pad_to_buckets={"auto": None, "on": True, "off": False}[args.pad_to_buckets])
    if args.threads is not None:
        kw["num_threads"] = args.threads
    eng = Engine(target=args.target, draft=args.draft, method=args.method, device=args.device, **kw)
    try:
        print(f"loaded in {time.perf_counter() - t0:.2f} s (method {eng.method}, max_batch_size "
              f"{eng.max_batch_size}, max_seq_len {eng.max_seq_len}); serving on http://{args.host}:{args.port}/v1",
              file=sys.stderr, flush=True)
        run(eng, host=args.host, port=args.port, model_name=args.model_name, chat_template=args.chat_template,
            log_level=args.log_level, api_key=args.api_key or None)
    finally:
        eng.close()
    return 0


_COMMANDS = [
    _Command("generate", "generate from a prompt with ar / mtp / dflash / dflash2 decoding; prints text and stats",
             _generate_args, _run_generate),
    _Command("serve", "serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics)",
             _serve_args, _run_serve),
    _Command("inspect", "validate a checkpoint and list its tensors (name, dtype, shape, file) with totals",
             _inspect_args, _run_inspect),
    _Command("info", "print what this build contains (backends, CUDA archs, NCCL, CUTLASS, BLAS, threads)",
             _info_args, _run_info),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash2-rt", description="dflash2_rt: GLM-5.3 + DFlash 2 inference runtime")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for cmd in _COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except DFlash2Error as e:
        msg = " ".join(str(e).split("\n"))
        print(f"error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the running request was cancelled by the engine
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `dflash2-rt inspect ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the flush at exit does not fail again
        return 0
