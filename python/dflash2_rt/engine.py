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

from . import _core
from ._core import GenerationResult, UnsupportedError  # noqa: F401


class Engine:
    def __init__(self, target=None, draft=None, method: str = "ar", device: str = "cpu", *,
                 max_batch_size: int = 8, max_seq_len: int = 4096, max_step_tokens: int = 256,
                 kv_block_size: int = 16, num_threads: Optional[int] = None, mtp_draft_tokens: int = 7):
        if target is None:
            raise UnsupportedError(
                "Engine() without a target needs the bundled default model pair, which is not built yet; "
                "pass target=PATH to a glm_moe_dsa checkpoint directory")
        self._e = _core.Engine(os.fspath(target), None if draft is None else os.fspath(draft), method, device,
                               max_batch_size, max_seq_len, max_step_tokens, kv_block_size, num_threads or 0,
                               mtp_draft_tokens)
        self.method = method
        self.device = device
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

    def logits(self, token_ids: Iterable[int]) -> np.ndarray:
        """float32 [n, vocab]: the logits at every position of `token_ids` (real prefill path)."""
        return self._e.logits(list(token_ids))

    def generate(self, prompts: Seq[Seq[int]], max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                 stop_token_ids: Optional[Iterable[int]] = None) -> list:
        """Generates for a batch of prompts (lists of token ids), decoded together. Each
        result has .token_ids (generated only, ending with the stop token if one was hit),
        .finish_reason ('stop' | 'length') and .stats. stop_token_ids=None uses the
        config's eos_token_id; [] disables stopping."""
        if isinstance(prompts, (str, bytes)):
            raise _core.InvalidArgumentError("generate: 'prompts' must be a list of prompts (each a list of token ids)")
        return self._e.generate([list(p) for p in prompts], max_new_tokens, temperature, top_p, top_k, seed,
                                None if stop_token_ids is None else list(stop_token_ids))

    @property
    def block_size(self) -> int:
        """Tokens verified per step: 1 for ar, the drafter's block size (8), or mtp_draft_tokens + 1."""
        return self._e.block_size

    def propose(self, token_ids: Iterable[int]):
        """One greedy draft block after a prefill of `token_ids`: .anchor (the target's greedy
        next token), .tokens (the drafted block_size - 1 tokens) and .candidates (the
        selector's top-k ids per drafted position; empty for DFlash 1 and MTP)."""
        return self._e.propose(list(token_ids))

    def stream(self, prompt: Seq[int], max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: Optional[int] = None,
               stop_token_ids: Optional[Iterable[int]] = None) -> Iterator[int]:
        """Yields the generated token ids of one prompt as they are committed (several per
        verify step with speculative methods). Errors are raised in the caller's thread."""
        q: queue.Queue = queue.Queue()
        done = object()
        box = {}

        def run():
            try:
                box["result"] = self._e.generate([list(prompt)], max_new_tokens, temperature, top_p, top_k, seed,
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
