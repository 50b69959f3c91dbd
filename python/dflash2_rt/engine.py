"""The generation engine (Python face of dflash2::Engine).

    eng = dflash2_rt.Engine(target="path/to/glm_moe_dsa_checkpoint", method="ar")
    eng.logits([1, 2, 3])                       # float32 [3, vocab], teacher-forced prefill
    eng.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)   # a batch, decoded in lockstep

Methods: "ar" (plain autoregressive decoding), "mtp" (the target's MTP layer chained to
draft `mtp_draft_tokens` tokens), "dflash" (a DFlash 1 drafter: argmax per position) and
"dflash2" (a DFlash 2 drafter: dynamic convs + candidate selector). All share one verifier
and are lossless: greedy output equals "ar" token for token, and sampling keeps the
target's distribution (rejection sampling with the drafter's proposal).
"""
from __future__ import annotations

import json
import os
import queue
import threading
from typing import Iterable, Iterator, Optional, Sequence as Seq

import numpy as np

from dataclasses import dataclass, field

from . import _core
from ._core import UnsupportedError  # noqa: F401


@dataclass
class GenerationResult:
    """One request's output: the generated token ids (ending with the stop token if one
    was hit), why it ended ("stop" | "length"), the decoded text when the target has a
    tokenizer.json, and stats (acceptance_length, verify_steps, accepted_per_position,
    draft_s / verify_s / host_s, prefill_s, decode_s, tokens_per_second, ...)."""
    token_ids: list
    finish_reason: str
    stats: dict = field(default_factory=dict)
    text: Optional[str] = None


def _load_tokenizer(target):
    path = os.path.join(os.fspath(target), "tokenizer.json") if os.path.isdir(os.fspath(target)) else None
    if not path or not os.path.exists(path):
        return None
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedError(f"{path} exists but the 'tokenizers' package is not installed: pip install tokenizers") from e
    return tokenizers.Tokenizer.from_file(path)


DEFAULT_PAIR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "default")


def default_pair() -> tuple:
    """(target dir, draft dir) of the bundled default model pair (a small glm_moe_dsa target
    with an MTP layer and its DFlash 2 drafter, trained on the Python standard library by
    ``python -m dflash2_rt.train.make_default_pair``)."""
    t, d = os.path.join(DEFAULT_PAIR_DIR, "target"), os.path.join(DEFAULT_PAIR_DIR, "draft")
    if not os.path.exists(os.path.join(t, "config.json")):
        raise UnsupportedError(f"the bundled default model pair is missing ({t}); reinstall dflash2_rt "
                               "or pass target=PATH to a glm_moe_dsa checkpoint directory")
    return t, d


class Engine:
    def __init__(self, target=None, draft=None, method: Optional[str] = None, device: str = "cpu", *,
                 max_batch_size: int = 8, max_seq_len: int = 4096, max_step_tokens: int = 256,
                 kv_block_size: int = 16, num_threads: Optional[int] = None, mtp_draft_tokens: int = 7):
        if target is None:  # the bundled default pair (python/dflash2_rt/models/default)
            target, bundled_draft = default_pair()
            method = method or "dflash2"
            if draft is None and method in ("dflash", "dflash2"):
                draft = bundled_draft
        method = method or "ar"
        self._e = _core.Engine(os.fspath(target), None if draft is None else os.fspath(draft), method, device,
                               max_batch_size, max_seq_len, max_step_tokens, kv_block_size, num_threads or 0,
                               mtp_draft_tokens)
        self.method = method
        self.device = device
        self.target = os.fspath(target)
        self.tokenizer = _load_tokenizer(target)
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size

    @property
    def config(self) -> dict:
        """The target's config.json as loaded."""
        return json.loads(self._e.config_json)

    @property
    def vocab_size(self) -> int:
        return self._e.vocab_size

    @property
    def has_mtp(self) -> bool:
        return self._e.has_mtp

    def logits(self, token_ids) -> np.ndarray:
        """float32 [n, vocab]: the logits at every position of `token_ids` (real prefill path)."""
        return self._e.logits(self._ids(token_ids))

    def encode(self, text: str) -> list:
        if self.tokenizer is None:
            raise _core.InvalidArgumentError(
                f"a text prompt needs a tokenizer, but {self.target} has no tokenizer.json; pass token ids")
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: Iterable[int]) -> str:
        if self.tokenizer is None:
            raise _core.InvalidArgumentError(f"{self.target} has no tokenizer.json to decode with")
        return self.tokenizer.decode(list(token_ids))

    def _ids(self, prompt) -> list:
        return self.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                 stop_token_ids: Optional[Iterable[int]] = None) -> list:
        """Generates for a batch of prompts (each a list of token ids, or a string when the
        target has a tokenizer.json), decoded together in lockstep; returns one
        GenerationResult per prompt. stop_token_ids=None uses the config's eos_token_id;
        [] disables stopping. seed makes sampling reproducible (request i draws from a
        stream derived from (seed, i))."""
        if isinstance(prompts, (str, bytes)):
            raise _core.InvalidArgumentError("generate: 'prompts' must be a list of prompts (token-id lists or strings)")
        ids = [self._ids(p) for p in prompts]
        raw = self._e.generate(ids, max_new_tokens, temperature, top_p, top_k, seed,
                               None if stop_token_ids is None else list(stop_token_ids))
        out = []
        for r in raw:
            text = self.tokenizer.decode(list(r.token_ids)) if self.tokenizer is not None else None
            out.append(GenerationResult(list(r.token_ids), r.finish_reason, dict(r.stats), text))
        return out

    @property
    def block_size(self) -> int:
        """Tokens verified per step: 1 for ar, the drafter's block size (8), or mtp_draft_tokens + 1."""
        return self._e.block_size

    def propose(self, token_ids):
        """One greedy draft block after a prefill of `token_ids`: .anchor (the target's greedy
        next token), .tokens (the drafted block_size - 1 tokens) and .candidates (the
        selector's top-k ids per drafted position; empty for DFlash 1 and MTP)."""
        return self._e.propose(self._ids(token_ids))

    def stream(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: Optional[int] = None,
               stop_token_ids: Optional[Iterable[int]] = None) -> Iterator[int]:
        """Yields the generated token ids of one prompt as they are committed (several per
        verify step with speculative methods). Errors are raised in the caller's thread."""
        ids = self._ids(prompt)
        q: queue.Queue = queue.Queue()
        done = object()
        box = {}

        def run():
            try:
                box["result"] = self._e.generate([ids], max_new_tokens, temperature, top_p, top_k, seed,
                                                 None if stop_token_ids is None else list(stop_token_ids),
                                                 lambda i, toks: q.put(list(toks)))
            except BaseException as e:  # noqa: BLE001 - re-raised below in the consumer
                box["error"] = e
            finally:
                q.put(done)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        while True:
            item = q.get()
            if item is done:
                break
            yield from item
        th.join()
        if "error" in box:
            raise box["error"]

    def new_sequence(self):
        """A sequence with its own KV caches, for step-level use: .extend(tokens, hidden_layers)
        -> (logits, {layer: hidden}), .rollback(length), .mtp_extend(next_tokens, hidden_main)."""
        return self._e.new_sequence()
