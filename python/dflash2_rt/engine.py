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
import math
import numbers
import operator
import os
import queue
import stat
import threading
import weakref
import atexit
from typing import Callable, Iterable, Iterator, Optional, Sequence as Seq

import numpy as np

from dataclasses import dataclass, field

from . import _core
from ._core import UnsupportedError  # noqa: F401


@dataclass
class GenerationResult:
    """One request's output: the generated token ids (ending with the stop token if one
    was hit), why it ended ("stop" | "length"), the decoded text when the target has a
    tokenizer.json, and stats (acceptance_length, verify_steps, accepted_per_position,
    draft_s / verify_s / accept_s / prefill_wait_s / host_s, prefill_s, decode_s,
    tokens_per_second, prefill_rounds, ...; decode_s = draft_s + verify_s + accept_s +
    prefill_wait_s (waiting for other requests' prompts) + host_s; prefill_s runs from the
    prompt's first chunk to the first token, over prefill_rounds scheduler rounds: 1 when it
    ran whole, more when prefill_tokens_per_step interleaved it with other requests' steps)."""
    token_ids: list
    finish_reason: str
    stats: dict = field(default_factory=dict)
    text: Optional[str] = None
    # with logprobs=n: one TokenLogprobs per token of token_ids (.logprob: the token's
    # log-probability under the target, the log-softmax of its logits before temperature /
    # top-p / top-k; .top_ids / .top_logprobs: the n most likely tokens', best first)
    logprobs: Optional[list] = None


@dataclass
class RequestUpdate:
    """poll()'s answer: tokens committed since the last poll, whether the request ended, and
    its GenerationResult once it has."""
    new_token_ids: list
    finished: bool
    result: Optional[GenerationResult] = None
    new_logprobs: Optional[list] = None  # the new tokens' TokenLogprobs (a request with logprobs=n)


# Engines still open: closed at interpreter exit, so that no scheduler thread outlives it
# (a joinable thread at exit would abort the process).
_LIVE: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_all_engines():
    for e in list(_LIVE):
        try:
            e.close()
        except Exception:  # noqa: BLE001
            pass


def _load_tokenizer(target):
    """The target's tokenizer.json, or None when the target directory has none. A
    tokenizer.json that is not a readable regular file or does not parse raises
    CheckpointError naming it (a FIFO or a device is refused, never read)."""
    target = os.fspath(target)
    if not os.path.isdir(target):
        return None
    path = os.path.join(target, "tokenizer.json")
    if not os.path.lexists(path):
        return None
    try:
        st = os.stat(path)
    except OSError as e:  # a dangling symlink, a symlink loop, no permission on the directory
        raise _core.CheckpointError(f"cannot read tokenizer '{path}': {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise _core.CheckpointError(f"cannot read tokenizer '{path}': it is a directory, expected a tokenizer.json file")
    if not stat.S_ISREG(st.st_mode):
        raise _core.CheckpointError(f"cannot read tokenizer '{path}': not a regular file (a FIFO, socket or device), "
                                    "expected a tokenizer.json file")
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedError(f"{path} exists but the 'tokenizers' package is not installed: pip install tokenizers") from e
    try:
        with open(path, "rb"):  # a readable file: permission errors get their own message
            pass
    except OSError as e:
        raise _core.CheckpointError(f"cannot read tokenizer '{path}': {e.strerror or e}") from None
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the tokenizers package raises a plain Exception
        msg = " ".join(str(e).split())
        if len(msg) > 300:
            msg = msg[:297] + "..."
        raise _core.CheckpointError(f"cannot load tokenizer '{path}': {msg}") from None


_I64_MAX = 2 ** 63 - 1


def _short(v) -> str:
    """type and repr of a bad value for a message, shortened."""
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _is_int(v) -> bool:
    """An integer that is not a bool (Python int, numpy integer, or anything with
    __index__ except bool / numpy.bool_)."""
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, numbers.Integral):
        return True
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def _check_int(where: str, name: str, v, lo: int = -_I64_MAX - 1, hi: int = _I64_MAX) -> int:
    if not _is_int(v):
        raise _core.InvalidArgumentError(f"{where}: {name} must be an integer, found {_short(v)}")
    v = operator.index(v)
    if not lo <= v <= hi:
        raise _core.InvalidArgumentError(f"{where}: {name} = {v} is out of range [{lo}, {hi}]")
    return v


def _check_real(where: str, name: str, v) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise _core.InvalidArgumentError(f"{where}: {name} must be a number, found {_short(v)}")
    f = float(v)
    if not math.isfinite(f):
        raise _core.InvalidArgumentError(f"{where}: {name} must be finite, found {f}")
    return f


def _check_seed(where: str, seed) -> Optional[int]:
    if seed is None:
        return None
    if not _is_int(seed):
        raise _core.InvalidArgumentError(
            f"{where}: seed must be None or an integer in [0, 2**63), found {_short(seed)}")
    s = operator.index(seed)
    if not 0 <= s <= _I64_MAX:
        raise _core.InvalidArgumentError(f"{where}: seed must be None or an integer in [0, 2**63), found {s}")
    return s


def _token_list(where: str, ids, vocab_size: int, max_len: Optional[int] = None) -> list:
    """A list of Python ints in [0, vocab_size) from an iterable of integers (numpy arrays
    included); anything else is an InvalidArgumentError naming `where` and the position.
    With max_len, a list of max_len or more ids is refused first (as the engine does: the
    prompt plus at least one generated token must fit)."""
    if isinstance(ids, (str, bytes, bytearray, memoryview)):
        raise _core.InvalidArgumentError(
            f"{where}: expected a list of token ids, found {type(ids).__name__} (text prompts are str)")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise _core.InvalidArgumentError(
                f"{where}: expected a 1-D integer array of token ids, found a {ids.ndim}-D {ids.dtype} array")
        out = ids.tolist()
    else:
        try:
            it = iter(ids)
        except TypeError:
            raise _core.InvalidArgumentError(f"{where}: expected a list of token ids, found {_short(ids)}") from None
        out = []
        for j, v in enumerate(it):
            if not _is_int(v):
                raise _core.InvalidArgumentError(f"{where}: token {j} must be an integer token id, found {_short(v)}")
            out.append(operator.index(v))
    if max_len is not None and len(out) >= max_len:
        raise _core.InvalidArgumentError(
            f"{where} has {len(out)} tokens; max_seq_len is {max_len} (the prompt plus at least one generated "
            "token must fit)")
    for j, t in enumerate(out):
        if not 0 <= t < vocab_size:
            raise _core.InvalidArgumentError(f"{where}: token {j} = {t} is outside the vocabulary [0, {vocab_size})")
    return out


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
                 max_batch_size: int = 8, max_seq_len: Optional[int] = None, max_step_tokens: int = 256,
                 kv_block_size: int = 16, num_threads: Optional[int] = None, mtp_draft_tokens: int = 7,
                 speculation: str = "fixed", tensor_parallel: int = 1, expert_parallel: bool = False,
                 prefill_gemm: str = "auto", draft_gemm: str = "auto", decode_gemm: str = "exact",
                 cuda_graphs: bool = True, pad_to_buckets: Optional[bool] = None,
                 capture_at_load: Optional[bool] = None, kv_cache_dtype: str = "f32",
                 prefill_tokens_per_step: Optional[int] = None, prefix_caching: bool = True):
        """target: a glm_moe_dsa checkpoint directory (None: the bundled default pair).
        draft: a DFlash 2 / DFlash 1 drafter directory. method: "ar" | "mtp" | "dflash" |
        "dflash2"; None infers it: "ar" without a drafter, else from the drafter's
        architecture (DFlash2DraftModel -> "dflash2", DFlashDraftModel -> "dflash").
        device: "cpu", "cuda" or "cuda:N": where the target's weights, caches and forward run
        (CUDA: compiled, never run on a GPU yet; sampling, acceptance and the DFlash drafter
        run on the GPU too; see the README's "The CUDA backend").
        max_seq_len None: min(4096, the model's max_position_embeddings). num_threads: this
        engine's CPU threads (None/0: all cores); it never changes other engines'.
        speculation: "fixed" (every step drafts the full block) or "adaptive" (per step, the
        draft length that maximises the measured throughput of the running batch).
        tensor_parallel: ranks the target is split across (heads, MLP slices, experts and the
        vocabulary; on the CPU the ranks are threads of this process). expert_parallel: with
        tensor_parallel > 1, give each rank whole routed experts (E / N of them) instead of
        a 1/N slice of every expert (the default: balanced whatever the routing; see README).
        prefill_gemm: the numerics of the prompt tokens' projections: "exact" (fp32
        activations, as decoding), "bf16" (the tensor cores' BF16 operands: CUTLASS on the
        GPU, emulated on the CPU), "fp8" (FP8 block-128 checkpoints: W8A8 for their FP8
        weights, bf16 for the rest), "nvfp4" (NVFP4 checkpoints whose attention / dense /
        shared-expert projections are NVFP4 with an input_scale: W4A4 for those, bf16 for
        the rest), "auto" (on a GPU this build has the kernels for: "fp8" / "nvfp4" for
        such a checkpoint where the kernel exists (sm_90a / sm_100a), else "bf16", each after
        a load-time check; "exact" elsewhere). Generated tokens take decode_gemm (default exact); speculative == AR holds in
        every mode; the resolved mode is `engine.prefill_gemm`.
        draft_gemm: the same choice for the DFlash drafter's projections and its LM head over
        the block ("fp8" / "nvfp4" need a drafter with such weights); "auto" takes the tensor
        cores where the drafter runs on a GPU this build has the kernels for (each numerics
        after its load-time check), "exact" elsewhere. Drafts only steer acceptance, so every
        choice is lossless; the resolved mode is `engine.draft_gemm` ("exact" for ar / mtp).
        decode_gemm: the same choice for the generated tokens' projections and routed experts
        (decode and verify chunks): "exact" (the default: fp32, as on the CPU) or a
        tensor-core mode ("bf16", "fp8", "nvfp4", "auto" = the tensor cores on a GPU), which
        makes verify batches at high concurrency tensor-core bound instead of SIMT bound (under
        "bf16" on the skinny split-K kernel of generated tokens, ops.linear_bf16(decode=True),
        any weight format read in place). A row's result never depends on the batch around
        it, so speculative == AR holds in every mode; `engine.decode_gemm` / `engine.experts_decode_gemm` say what runs.
        logits() and Sequence always run exact.
        cuda_graphs: on CUDA, capture the target's decode / verify chunks as CUDA graphs and
        replay them, on every rank with tensor_parallel > 1 (False: every chunk eagerly, the
        same kernels); `engine.cuda_graphs` says whether it is in effect, metrics() counts
        them (under tensor parallelism once per chunk for all ranks).
                pad_to_buckets: pad a decode step that runs as one unit (one CUDA graph per rank) to the next
        batch-size bucket (1, 2, 4, 8, 16, 32, then multiples of 32, at most max_batch_size)
        with padding sequences whose output is dropped, so the step's graphs are one per
        bucket and draft length; None: on with CUDA graphs, off elsewhere (on the CPU it only
        costs). `engine.pad_to_buckets` is what is in effect; metrics()["padding_rows"]
        counts the padding sequences run.
        capture_at_load: while loading, run a few decode steps of dummy requests at every
        batch-size bucket (greedy and sampled) so the step graphs exist before the first
        request; None: on with CUDA graphs where whole steps are graphs (every method at
        tensor_parallel=1; ar, dflash, dflash2 under tensor parallelism). `engine.capture_at_load` is what is in effect.
        kv_cache_dtype: the element type of the target's MLA latent and indexer-key caches (and
        the MTP layer's): "f32" (the default) or "bf16" (half the cache memory and half the
        bytes the attention reads per key; values are rounded to nearest even as they are
        written and widened exactly as they are read). Every method reads the same cache, so
        speculative == AR holds; against an "f32" cache the logits move by the latent's BF16
        rounding. "fp8": the latent's kv_lora values and the index keys as E4M3 codes with a
        power-of-two scale per group of up to 128 values, the latent's rope in BF16 (GLM-5.3:
        656 + 144 bytes a token and layer against 1152 + 256 in BF16; kv_lora_rank and
        index_head_dim must be multiples of 16, at most 128 or multiples of 128). The stored
        values are exact in BF16, so the attention kernels read them as they read a BF16
        cache. `engine.kv_cache_dtype` says what is in effect.
        prefill_tokens_per_step: while requests are decoding, at most this many prompt tokens
        of newly arrived requests run between two decode steps (chunked prefill interleaved
        with decoding: a long prompt delays the running streams by one chunk per step instead
        of by its whole prefill; the prompt continues over the next steps). None: max_step_tokens
        (one chunk); 0: no limit (every admitted prompt whole before the next step). With no
        request decoding, prompts run whole. Outputs do not depend on it.
        prefix_caching: keep the full KV-cache blocks of prompts that ran (least recently used
        evicted when the cache needs room), so a prompt that starts with the same tokens (a
        shared system prompt, an earlier turn) takes them instead of running them again:
        result.stats["cached_tokens"], metrics()["prefix_cache_*"]. Outputs do not depend on it.

        All generation runs on the engine's own scheduler thread: generate / stream / submit
        from any number of threads join one running batch (continuous batching). Close the
        engine with close() or a `with` block (also done at interpreter exit)."""
        if target is None:  # the bundled default pair (python/dflash2_rt/models/default)
            target, bundled_draft = default_pair()
            method = method or "dflash2"
            if draft is None and method in ("dflash", "dflash2"):
                draft = bundled_draft
        if method is not None and not isinstance(method, str):
            raise _core.InvalidArgumentError(f"Engine: method must be a string, found {type(method).__name__}")
        for name, v in (("max_batch_size", max_batch_size), ("max_step_tokens", max_step_tokens),
                        ("kv_block_size", kv_block_size), ("mtp_draft_tokens", mtp_draft_tokens)):
            _check_int("Engine", name, v)
        if max_seq_len is not None:
            _check_int("Engine", "max_seq_len", max_seq_len)
        if prefill_tokens_per_step is not None:
            _check_int("Engine", "prefill_tokens_per_step", prefill_tokens_per_step, 0)
        if num_threads is not None:
            _check_int("Engine", "num_threads", num_threads, -2 ** 31, 2 ** 31 - 1)
        # The tokenizer first: a broken tokenizer.json fails before the weights are loaded.
        tokenizer = _load_tokenizer(target)
        _check_int("Engine", "tensor_parallel", tensor_parallel, 1, 64)
        if not isinstance(expert_parallel, (bool, np.bool_)):
            raise _core.InvalidArgumentError(f"Engine: expert_parallel must be True or False, found {expert_parallel!r}")
        if not isinstance(prefix_caching, (bool, np.bool_)):
            raise _core.InvalidArgumentError(f"Engine: prefix_caching must be True or False, found {prefix_caching!r}")
        if not isinstance(cuda_graphs, (bool, np.bool_)):
            raise _core.InvalidArgumentError(f"Engine: cuda_graphs must be True or False, found {cuda_graphs!r}")
        if pad_to_buckets is not None and not isinstance(pad_to_buckets, (bool, np.bool_)):
            raise _core.InvalidArgumentError(
                f"Engine: pad_to_buckets must be None, True or False, found {pad_to_buckets!r}")
        if capture_at_load is not None and not isinstance(capture_at_load, (bool, np.bool_)):
            raise _core.InvalidArgumentError(
                f"Engine: capture_at_load must be None, True or False, found {capture_at_load!r}")
        for name, v in (("prefill_gemm", prefill_gemm), ("decode_gemm", decode_gemm), ("draft_gemm", draft_gemm)):
            if v not in ("auto", "exact", "bf16", "fp8", "nvfp4"):
                raise _core.InvalidArgumentError(
                    f"Engine: {name} must be 'auto', 'exact', 'bf16', 'fp8' or 'nvfp4', found {v!r}")
        if kv_cache_dtype not in ("f32", "bf16", "fp8"):
            raise _core.InvalidArgumentError(
                f"Engine: kv_cache_dtype must be 'f32', 'bf16' or 'fp8', found {kv_cache_dtype!r}")
        if speculation not in ("fixed", "adaptive"):
            raise _core.InvalidArgumentError(f"Engine: speculation must be 'fixed' or 'adaptive', found {speculation!r}")
        self._e = _core.Engine(os.fspath(target), None if draft is None else os.fspath(draft), method or "", device,
                               max_batch_size, max_seq_len or 0, max_step_tokens, kv_block_size, num_threads or 0,
                               mtp_draft_tokens, speculation, tensor_parallel, bool(expert_parallel),
                               prefill_gemm, draft_gemm, decode_gemm, bool(cuda_graphs),
                               -1 if pad_to_buckets is None else int(bool(pad_to_buckets)),
                               -1 if capture_at_load is None else int(bool(capture_at_load)), kv_cache_dtype,
                               -1 if prefill_tokens_per_step is None else prefill_tokens_per_step,
                               bool(prefix_caching))
        _LIVE.add(self)
        self.speculation = speculation
        self._cancelled: set = set()
        self.method = self._e.method
        self.device = device
        self.target = os.fspath(target)
        self.tokenizer = tokenizer
        self.max_seq_len = self._e.max_seq_len
        self.prefill_tokens_per_step = self._e.prefill_tokens_per_step  # resolved: 0 = no limit
        self.prefix_caching = self._e.prefix_caching
        # whether generated tokens' blocks are kept too (every numerics exact: a conversation's
        # next turn takes its previous turns' output from the cache)
        self.prefix_cache_generated = self._e.prefix_cache_generated
        self.max_batch_size = max_batch_size
        self._llg_tokenizer = None  # structured output's tokenizer, made on first use
        self._grammars: dict = {}    # structured output's compiled specs (at most 64, oldest dropped)
        self._grammar_lock = threading.Lock()

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

    @property
    def tensor_parallel(self) -> int:
        """Ranks the target is split across (1: not split)."""
        return self._e.tensor_parallel

    @property
    def cuda_graphs(self) -> bool:
        """Whether the target's decode / verify chunks run as CUDA graphs (CUDA, one rank)."""
        return self._e.cuda_graphs

    @property
    def capture_at_load(self) -> bool:
        """Whether the decode step's graphs were captured while loading (see __init__)."""
        return self._e.capture_at_load

    @property
    def pad_to_buckets(self) -> bool:
        """Whether steps run as one unit are padded to batch-size buckets (see __init__)."""
        return self._e.pad_to_buckets

    @property
    def prefill_gemm(self) -> str:
        """The prompt tokens' GEMM numerics this engine resolved: "exact", "bf16", "fp8" or "nvfp4"."""
        return self._e.prefill_gemm

    @property
    def kv_cache_dtype(self) -> str:
        """The element type of the target's KV caches: "f32" or "bf16"."""
        return self._e.kv_cache_dtype

    @property
    def decode_gemm(self) -> str:
        """The generated tokens' GEMM numerics this engine resolved: "exact", "bf16", "fp8" or "nvfp4"."""
        return self._e.decode_gemm

    @property
    def experts_decode_gemm(self) -> str:
        """The numerics the routed experts of decode / verify chunks take under `decode_gemm`."""
        return self._e.experts_decode_gemm

    @property
    def draft_gemm(self) -> str:
        """The DFlash drafter's GEMM numerics this engine resolved: "exact", "bf16", "fp8" or
        "nvfp4" ("exact" for ar / mtp)."""
        return self._e.draft_gemm

    @property
    def draft_device(self):
        """Where the drafter runs: "cpu", or "cuda:N" (the target's GPU; rank 0's under
        tensor parallelism -- the whole drafter there, or rank 0's share when it is split,
        see draft_ranks); None for method "ar"."""
        return self._e.draft_device or None

    @property
    def draft_ranks(self) -> int:
        """The ranks the drafter runs on: tensor_parallel when the DFlash drafter is split
        across them (each rank its share of heads and MLP intermediate), else 1 (whole, on
        rank 0); 0 for method "ar"."""
        return self._e.draft_ranks

    @property
    def experts_prefill_gemm(self) -> str:
        """The numerics the routed experts of prompt chunks take under `prefill_gemm`: "exact",
        "bf16" (W4A16 for NVFP4 experts), "fp8" or "nvfp4" (see the README's "prefill_gemm")."""
        return self._e.experts_prefill_gemm

    @property
    def expert_parallel(self) -> bool:
        """Whether each rank holds whole routed experts (True) or a slice of every expert."""
        return self._e.expert_parallel

    def tp_collectives(self) -> dict:
        """Collectives rank 0 has issued since load (every rank issues the same):
        {all_reduce_calls, all_reduce_bytes, all_reduce_peer_calls, all_gather_calls,
        all_gather_bytes, all_gather_peer_calls, broadcast_calls, broadcast_bytes,
        broadcast_peer_calls}; zeros at tensor_parallel = 1.
        all_reduce_peer_calls, all_gather_peer_calls, broadcast_peer_calls: those (counted in
        the totals too) that took the kernels over peer memory instead of NCCL (GPUs only). Broadcasts: a decode
        step run as one unit sends rank 0's drafted ids (and the DFlash head's input rows) to
        the other ranks.
        bench/tp_model.py compares them with its per-step model."""
        return dict(self._e.tp_collectives())

    def logits(self, token_ids) -> np.ndarray:
        """float32 [n, vocab]: the logits at every position of `token_ids` (real prefill path)."""
        return self._e.logits(self._ids(token_ids, "logits: token_ids"))

    def prompt_logprobs(self, token_ids, top: int = 0) -> list:
        """Scores a prompt: one TokenLogprobs per token after the first (token j + 1's
        log-probability under the target after tokens [0, j], and the `top` (0..20) most likely
        tokens' there), teacher-forced through the prefill path with exact numerics. On a GPU
        only these numbers leave the device (not the logits, as logits() would)."""
        ids = self._ids(token_ids, "prompt_logprobs: token_ids")
        return list(self._e.prompt_logprobs(ids, _check_int("prompt_logprobs", "top", top, 0, 20)))

    def encode(self, text: str) -> list:
        if self.tokenizer is None:
            raise _core.InvalidArgumentError(
                f"a text prompt needs a tokenizer, but {self.target} has no tokenizer.json; pass token ids")
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: Iterable[int]) -> str:
        if self.tokenizer is None:
            raise _core.InvalidArgumentError(f"{self.target} has no tokenizer.json to decode with")
        return self.tokenizer.decode(list(token_ids))

    def _ids(self, prompt, where: str, max_len: Optional[int] = None) -> list:
        """A prompt (a string when the target has a tokenizer.json, or token ids) as a list of
        ints in [0, vocab_size); InvalidArgumentError otherwise."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        return _token_list(where, prompt, self.vocab_size, max_len)

    def _request(self, where: str, max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids,
                 logprobs=None, adjust: Optional[dict] = None) -> tuple:
        """The sampling arguments checked for type and range (the engine checks the rest):
        submit's positional arguments up to stop_token_ids, then logprobs, then the repetition
        controls (presence_penalty, frequency_penalty, repetition_penalty, min_tokens, logit_bias)."""
        stop = None
        if stop_token_ids is not None:
            stop = _token_list(f"{where}: stop_token_ids", stop_token_ids, self.vocab_size)
        lp = None if logprobs is None else _check_int(where, "logprobs", logprobs, 0, 20)
        kw = {}
        for name, v in (adjust or {}).items():
            if name == "structured_outputs":
                if v is not None:
                    kw[name] = self._grammar(v, f"{where}: structured_outputs")
                continue
            if name == "constraint":
                if v is not None:
                    missing = [m for m in ("masks", "commit", "done") if not callable(getattr(v, m, None))]
                    if missing:
                        raise _core.InvalidArgumentError(
                            f"{where}: constraint must have masks(), commit() and done() (a token constraint), "
                            f"found {type(v).__name__} without {', '.join(m + '()' for m in missing)}")
                    kw[name] = v
                continue
            if name == "min_tokens":
                kw[name] = _check_int(where, name, v, 0)
            elif name == "logit_bias":
                if v is None:
                    continue
                if not isinstance(v, dict):
                    raise _core.InvalidArgumentError(f"{where}: logit_bias must be a dict {{token id: bias}}, "
                                                     f"found {_short(v)}")
                bias = {}
                for t, b in v.items():
                    t = _check_int(where, "a logit_bias token id", t, 0, self.vocab_size - 1)
                    bias[t] = _check_real(where, f"logit_bias[{t}]", b)
                if bias:
                    kw[name] = bias
            else:
                kw[name] = _check_real(where, name, v)
        return (_check_int(where, "max_new_tokens", max_new_tokens), _check_real(where, "temperature", temperature),
                _check_real(where, "top_p", top_p), _check_int(where, "top_k", top_k), _check_seed(where, seed), stop,
                lp, kw)

    _ADJUST = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
               "structured_outputs", "constraint")

    def _grammar(self, spec, where: str):
        """A structured-output spec compiled for this engine's tokenizer (structured.Grammar)."""
        if self.tokenizer is None:
            raise _core.InvalidArgumentError(f"{where}: structured output needs the target's tokenizer.json "
                                             f"({self.target} has none); pass constraint= instead")
        from . import structured
        try:  # the last specs compiled (a server's n choices, a client repeating its schema)
            key = json.dumps(spec, sort_keys=True)
        except (TypeError, ValueError):
            key = None
        with self._grammar_lock:  # (the server submits from many threads)
            g = self._grammars.get(key) if key is not None else None
            if g is not None:
                return g
            grammar = structured.compile_spec(spec, where)
            if self._llg_tokenizer is None:
                eos = self.config.get("eos_token_id")
                eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
                self._llg_tokenizer = structured.tokenizer_for(self.tokenizer, self.vocab_size, eos)
            g = structured.Grammar(self._llg_tokenizer, grammar, where)
            if key is not None:
                if len(self._grammars) >= 64:
                    self._grammars.pop(next(iter(self._grammars)))
                self._grammars[key] = g
            return g

    def _adjust(self, where: str, kw: dict) -> dict:
        """The repetition-control and structured-output keyword arguments (anything else is a
        TypeError, as Python raises for an unknown keyword)."""
        for name in kw:
            if name not in self._ADJUST:
                raise TypeError(f"{where}() got an unexpected keyword argument '{name}'")
        if kw.get("structured_outputs") is not None and kw.get("constraint") is not None:
            raise _core.InvalidArgumentError(f"{where}: pass structured_outputs or constraint, not both")
        return kw

    def _submit(self, ids: list, req: tuple, stream_index: int) -> int:
        kw = req[7]
        if "structured_outputs" in kw:  # a constraint of its own per request (it holds the request's state)
            kw = dict(kw)
            kw["constraint"] = kw.pop("structured_outputs").constraint()
        return self._e.submit(ids, *req[:6], stream_index, req[6], **kw)

    def _result(self, r) -> GenerationResult:
        text = self.tokenizer.decode(list(r.token_ids)) if self.tokenizer is not None else None
        lps = list(r.logprobs) if len(r.logprobs) else None
        return GenerationResult(list(r.token_ids), r.finish_reason, dict(r.stats), text, lps)

    # ------------------------------------------------------------------ requests
    def submit(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: Optional[int] = None, stop_token_ids: Optional[Iterable[int]] = None,
               _stream_index: int = 0, logprobs: Optional[int] = None, **adjust) -> int:
        """Queues one request (checked now: a bad request raises here) and returns its id; it
        joins the running batch at the next step. Follow it with poll(id) / cancel(id).
        logprobs=n (0..20): every generated token comes with its log-probability and the n most
        likely tokens' (RequestUpdate.new_logprobs, GenerationResult.logprobs).
        Repetition control (keyword arguments, as OpenAI / vLLM): presence_penalty and
        frequency_penalty (in [-2, 2]), repetition_penalty (> 0, 1 = off), logit_bias ({token id:
        bias in [-100, 100]}), min_tokens (no stop token before that many tokens)."""
        ids = self._ids(prompt, "submit: prompt", self.max_seq_len)
        req = self._request("submit", max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, logprobs,
                            self._adjust("submit", adjust))
        return self._submit(ids, req, _stream_index)

    def poll(self, request_id: int, timeout: Optional[float] = None) -> "RequestUpdate":
        """What happened to a request since the last poll: .new_token_ids, .finished, .result
        (a GenerationResult once finished; after that the id is forgotten). Waits up to
        `timeout` seconds for news (None: until there is some; 0: not at all). A request that
        failed raises its error here."""
        rid = _check_int("poll", "request_id", request_id)
        t = -1.0 if timeout is None else max(0.0, _check_real("poll", "timeout", timeout))
        while True:  # wait in slices so that Ctrl-C (KeyboardInterrupt) is seen
            step = 0.1 if t < 0 else min(t, 0.1)
            try:
                ups = self._e.poll([rid], step, True)
            except _core.InvalidArgumentError:
                if rid in self._cancelled:  # cancelled and ended: the engine forgot it
                    self._cancelled.discard(rid)
                    return RequestUpdate([], True, GenerationResult([], "cancelled", {}, None))
                raise
            if ups:
                _, toks, finished, res, lps = ups[0]
                return RequestUpdate(list(toks), bool(finished), self._result(res) if finished else None,
                                     list(lps) if len(lps) else None)
            if t >= 0:
                t -= step
                if t <= 0:
                    return RequestUpdate([], False, None)

    def cancel(self, request_id: int) -> None:
        """Ends a request within one step (finish_reason "cancelled") and frees its cache pages;
        no poll is needed afterwards (a later poll reports it finished, "cancelled"). Unknown
        or finished ids are ignored."""
        rid = _check_int("cancel", "request_id", request_id)
        self._e.cancel(rid)
        self._cancelled.add(rid)
        if len(self._cancelled) > 4096:  # bounded: the oldest are forgotten
            self._cancelled.pop()

    def metrics(self) -> dict:
        """Engine-wide counters: queue_length, running, prefilling (running requests whose
        prompts are partly run, interleaved with decode steps), prefix_cache_pages /
        _query_tokens / _hit_tokens / _evictions (automatic prefix caching: blocks kept,
        prompt tokens admitted, of them taken from the cache, entries evicted),
        requests_total / _finished / _cancelled,
        generated_tokens_total, steps_total, cache_pages_used / _total (the target's KV-cache
        blocks), and recent tokens_per_second, acceptance_length (committed tokens per
        sequence per step), step_time_s, draft_len; cuda_graphs_captured / _replayed / _eager /
        _failed / _last_failure / _pdl_edges (programmatic kernel -> kernel edges in the graphs
        captured with ops.set_pdl(True)), steps_as_one_unit (decode steps run as one unit: one CUDA
        graph on a GPU), padding_rows (padding sequences run by pad_to_buckets) and
        drafter_appends_in_step (of those steps, the ones that appended the verified rows to
        the DFlash drafter's context inside the step), draft_cache_bytes (the DFlash
        drafter's context cache: F32, or BF16 under a tensor-core draft_gemm),
        argmax_gather_steps (decode steps under tensor parallelism whose requests were all
        greedy: the ranks gathered (max, id) pairs of their vocabulary shards instead of the
        logits), draft_head_gathers (DFlash drafts under tensor parallelism whose LM head ran
        on the target's vocabulary shards: each rank's top k gathered and merged on rank 0)."""
        return dict(self._e.metrics())

    def close(self) -> None:
        """Cancels every request and stops the scheduler thread (idempotent). Later requests
        raise; logits / new_sequence still work."""
        e = getattr(self, "_e", None)
        if e is not None:
            e.close()
        _LIVE.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _wait_all(self, rids: list, on_update) -> None:
        """Polls rids until all finished, calling on_update(index, new_tokens, result_or_None);
        on any exception (KeyboardInterrupt included) the unfinished ones are cancelled."""
        pending = dict(zip(rids, range(len(rids))))
        try:
            while pending:
                for rid, toks, finished, res in self._e.poll(list(pending), 0.1):
                    i = pending[rid]
                    if finished:
                        del pending[rid]
                    on_update(i, list(toks), res if finished else None)
        except BaseException:
            for rid in pending:
                self._e.cancel(rid)
            raise

    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                 stop_token_ids: Optional[Iterable[int]] = None, logprobs: Optional[int] = None,
                 **adjust) -> list:
        """Generates for a list of prompts (each a list of token ids, or a string when the
        target has a tokenizer.json); returns one GenerationResult per prompt. The prompts
        join the engine's running batch (with whatever else runs). stop_token_ids=None uses
        the config's eos_token_id; [] disables stopping. seed makes sampling reproducible
        (request i draws from a stream derived from (seed, i)). logprobs=n (0..20): each
        result's .logprobs holds every generated token's log-probability under the target and
        the n most likely tokens' (TokenLogprobs). presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias, min_tokens: repetition control (see submit). Ctrl-C
        cancels the requests."""
        if isinstance(prompts, (str, bytes, bytearray, memoryview)):
            raise _core.InvalidArgumentError("generate: 'prompts' must be a list of prompts (token-id lists or strings)")
        try:
            prompts = list(prompts)
        except TypeError:
            raise _core.InvalidArgumentError(
                f"generate: 'prompts' must be a list of prompts, found {type(prompts).__name__}") from None
        if not prompts:
            raise _core.InvalidArgumentError("generate: no prompts given")
        ids = [self._ids(p, f"generate: prompt {i}", self.max_seq_len) for i, p in enumerate(prompts)]
        req = self._request("generate", max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, logprobs,
                            self._adjust("generate", adjust))
        if "constraint" in req[7] and len(ids) > 1:
            raise _core.InvalidArgumentError(
                f"generate: a constraint object holds one request's state; with {len(ids)} prompts pass "
                "structured_outputs (a constraint is made per prompt) or submit() each prompt with its own")
        rids = []
        try:
            for i, p in enumerate(ids):
                try:
                    rids.append(self._submit(p, req, i))
                except _core.DFlash2Error as e:
                    raise type(e)(f"generate: prompt {i}: {e}") from None
        except BaseException:
            for r in rids:
                self._e.cancel(r)
            raise
        results = [None] * len(ids)

        def done(i, toks, res):
            if res is not None:
                results[i] = self._result(res)

        try:
            self._wait_all(rids, done)
        except _core.DFlash2Error as e:
            rid = getattr(e, "request_id", None)
            which = f"prompt {rids.index(rid)}: " if rid in rids else ""
            raise type(e)(f"generate: {which}{e}") from None
        return results

    @property
    def block_size(self) -> int:
        """Tokens verified per step: 1 for ar, the drafter's block size (8), or mtp_draft_tokens + 1."""
        return self._e.block_size

    def propose(self, token_ids):
        """One greedy draft block after a prefill of `token_ids`: .anchor (the target's greedy
        next token), .tokens (the drafted block_size - 1 tokens) and .candidates (the
        selector's top-k ids per drafted position; empty for DFlash 1 and MTP)."""
        return self._e.propose(self._ids(token_ids, "propose: token_ids"))

    def stream(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: Optional[int] = None, stop_token_ids: Optional[Iterable[int]] = None,
               on_result: Optional[Callable[[GenerationResult], None]] = None,
               logprobs: Optional[int] = None, **adjust) -> Iterator[int]:
        """Yields the generated token ids of one prompt as they are committed (several per
        verify step with speculative methods). The arguments are checked here, before the
        first token; errors of the generation are raised in the caller's thread.
        on_result, when given, is called once with the GenerationResult of this same
        generation (finish_reason, text, stats; with logprobs=n, .logprobs) after the last token
        has been yielded. presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
        min_tokens: repetition control (see submit)."""
        ids = self._ids(prompt, "stream: prompt", self.max_seq_len)
        req = self._request("stream", max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, logprobs,
                            self._adjust("stream", adjust))
        if on_result is not None and not callable(on_result):
            raise _core.InvalidArgumentError(f"stream: on_result must be callable, found {type(on_result).__name__}")
        return self._stream(ids, req, on_result)

    def _stream(self, ids: list, req: tuple, on_result) -> Iterator[int]:
        rid = self._submit(ids, req, 0)
        finished = False
        try:
            while not finished:
                for _, toks, fin, res in self._e.poll([rid], 0.1):
                    yield from toks
                    if fin:
                        finished = True
                        if on_result is not None:
                            on_result(self._result(res))
        finally:
            if not finished:  # closed early (break, GeneratorExit, an error): cancel it
                self._e.cancel(rid)

    def new_sequence(self):
        """A sequence with its own KV caches, for step-level use: .extend(tokens, hidden_layers)
        -> (logits, {layer: hidden}), .rollback(length), .mtp_extend(next_tokens, hidden_main)."""
        return self._e.new_sequence()
