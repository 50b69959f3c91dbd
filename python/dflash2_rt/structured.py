"""Structured output: generation restricted to a JSON schema, a regular expression, a list of
choices or a Lark grammar, over llguidance (``pip install llguidance``; the grammar engine
vLLM, SGLang and llama.cpp use).

The engine asks a request's constraint for token masks and tells it what it commits (the C++
``TokenConstraint`` interface, see README "Structured output"): before the first token, and in
every decode step for the verify rows after each draft, so speculative decoding stays lossless
(a draft the grammar rejects has probability 0 under its row's mask and is rejected there).

    spec = {"json": {"type": "object", ...}}   # or {"regex": r"..."}, {"choice": ["yes", "no"]},
                                               # {"grammar": "<Lark>"}, {"json_object": True}
    eng.generate([prompt], structured_outputs=spec)

Any object with ``masks(drafts, out) -> int``, ``commit(tokens)`` and ``done() -> bool`` can be
passed as ``constraint=`` instead (one object per request: it holds the request's state).
"""
import json
from typing import Any, List, Optional

import numpy as np

from . import _core

KINDS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace",)  # JSON: no whitespace between tokens (vLLM's option; default: any)


def _llguidance():
    try:
        import llguidance
    except ImportError as e:
        raise _core.UnsupportedError("structured output needs the 'llguidance' package: pip install llguidance "
                                     "(or pip install 'dflash2_rt[structured]')") from e
    return llguidance


def _regex_literal(s: str) -> str:
    """s as a regular expression that matches exactly s (llguidance's regex syntax)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in s)


def compile_spec(spec: Any, where: str = "structured_outputs") -> str:
    """The llguidance grammar of a structured-output spec: a dict with exactly one of
    json (a JSON schema: dict or JSON text), regex (str), choice (non-empty list of str),
    grammar (Lark text) or json_object (True: any JSON object); and for JSON optionally
    disable_any_whitespace (True: no whitespace between JSON tokens). Bad specs raise
    InvalidArgumentError naming what is wrong; the grammar is checked when a constraint is
    made from it (Grammar)."""
    if not isinstance(spec, dict):
        raise _core.InvalidArgumentError(f"{where} must be a dict with one of {', '.join(KINDS)}, "
                                         f"found {type(spec).__name__}")
    given = [k for k, v in spec.items() if k in KINDS and v is not None and v is not False]
    unknown = [k for k in spec if k not in KINDS and k not in OPTIONS]
    if unknown:
        raise _core.InvalidArgumentError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} "
                                         f"(one of {', '.join(KINDS)}; options {', '.join(OPTIONS)})")
    compact = spec.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise _core.InvalidArgumentError(f"{where}: disable_any_whitespace must be a bool")
    json_opts = {"whitespace_flexible": False} if compact else None
    if len(given) != 1:
        raise _core.InvalidArgumentError(f"{where} must set exactly one of {', '.join(KINDS)}, found "
                                         f"{', '.join(given) if given else 'none'}")
    kind = given[0]
    v = spec[kind]
    llg = _llguidance()
    M = llg.LLMatcher
    if kind == "json_object":
        if v is not True:
            raise _core.InvalidArgumentError(f"{where}: json_object must be true")
        return M.grammar_from_json_schema({"type": "object"}, overrides=json_opts)
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise _core.InvalidArgumentError(f"{where}: json is not valid JSON text: {e}") from None
        if not isinstance(v, (dict, bool)):
            raise _core.InvalidArgumentError(f"{where}: json must be a JSON schema (an object), "
                                             f"found {type(v).__name__}")
        try:
            return M.grammar_from_json_schema(v, overrides=json_opts)
        except (ValueError, TypeError) as e:
            raise _core.InvalidArgumentError(f"{where}: json: {e}") from None
    if kind == "regex":
        if not isinstance(v, str):
            raise _core.InvalidArgumentError(f"{where}: regex must be a string, found {type(v).__name__}")
        return M.grammar_from_regex(v)
    if kind == "choice":
        if (not isinstance(v, (list, tuple)) or not v or not all(isinstance(c, str) and c for c in v)):
            raise _core.InvalidArgumentError(f"{where}: choice must be a non-empty list of non-empty strings")
        return M.grammar_from_regex("(" + "|".join(_regex_literal(c) for c in v) + ")")
    if not isinstance(v, str) or not v.strip():
        raise _core.InvalidArgumentError(f"{where}: grammar must be Lark grammar text")
    return M.grammar_from_lark(v)


class Grammar:
    """A compiled structured-output spec for one engine's tokenizer: checked once, then
    .constraint() makes one request's constraint (cheap)."""

    def __init__(self, tokenizer, grammar: str, where: str = "structured_outputs"):
        llg = _llguidance()
        err = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if err and not err.startswith("WARNING"):
            raise _core.InvalidArgumentError(f"{where}: {err}")
        self.tokenizer = tokenizer
        self.grammar = grammar

    def constraint(self) -> "GrammarConstraint":
        return GrammarConstraint(self.tokenizer, self.grammar)


class GrammarConstraint:
    """One request's constraint over an llguidance matcher (the engine's TokenConstraint)."""

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        self._m = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise _core.InvalidArgumentError(f"structured output: {self._m.get_error()}")
        self._words = (tokenizer.vocab_size + 31) // 32
        self._eos = set(int(e) for e in tokenizer.eos_tokens)

    def _check(self):
        if self._m.is_error():
            raise _core.InvalidArgumentError(f"structured output: {self._m.get_error()}")

    def masks(self, drafts: List[int], out) -> int:
        """Row 0: the tokens allowed next; row j: after drafts[:j] too, up to the first draft
        the grammar rejects (whose row is the last filled). The matcher is rolled back."""
        self._check()
        m, nbytes = self._m, self._words * 4
        if out.shape[1] < self._words:
            raise _core.InvalidArgumentError(f"structured output: the engine's mask rows have {out.shape[1]} words, "
                                             f"the tokenizer needs {self._words}")
        m.unsafe_compute_mask_ptr(out[0].ctypes.data, nbytes)
        ok = m.validate_tokens(list(drafts)) if drafts else 0
        filled = consumed = 0
        try:
            for j in range(ok):
                if m.is_stopped() or drafts[j] in self._eos:
                    # complete after drafts[:j] (row j allows only the end of sequence), or draft j
                    # ends it: the rows after allow only the end of sequence (never consumed)
                    self._eos_rows(out[j + 1:len(drafts) + 1])
                    return len(drafts) + 1
                if not m.consume_token(drafts[j]):
                    break
                consumed += 1
                m.unsafe_compute_mask_ptr(out[j + 1].ctypes.data, nbytes)
                filled = j + 1
        finally:
            if consumed:
                m.rollback(consumed)
            self._check()
        return filled + 1

    def _eos_rows(self, rows) -> None:
        rows[:] = 0
        u = rows.view(np.uint32)
        for e in self._eos:
            u[:, e >> 5] |= np.uint32(1 << (e & 31))

    def steer(self, cand, out) -> int:
        """Greedy drafts that follow the grammar: position by position the drafter's draft
        (out[j] on entry) where the grammar allows it after the drafts before it, else the best
        candidate it allows, else a token it forces; up to the first position with none of
        them, or the end of sequence. The matcher is rolled back."""
        self._check()
        m = self._m
        consumed = k = 0
        try:
            for j in range(len(cand)):
                if m.is_stopped():
                    break
                pick = None
                for c in [int(out[j])] + [int(c) for c in cand[j]]:
                    if m.validate_tokens([c]) == 1:
                        pick = c
                        break
                if pick is None:
                    ff = m.compute_ff_tokens()
                    if not ff:
                        break
                    pick = int(ff[0])
                out[j] = pick
                k = j + 1
                if pick in self._eos or not m.consume_token(pick):
                    break
                consumed += 1
        finally:
            if consumed:
                m.rollback(consumed)
            self._check()
        return k

    def commit(self, tokens: List[int]) -> None:
        if not self._m.consume_tokens(list(tokens)):
            raise _core.InvalidArgumentError(f"structured output: committed tokens {list(tokens)} are not allowed "
                                             f"by the grammar: {self._m.get_error()}")

    def done(self) -> bool:
        return self._m.is_stopped()


def tokenizer_for(tokenizer, vocab_size: int, eos_ids: Optional[List[int]]):
    """An llguidance tokenizer over a `tokenizers.Tokenizer` (the target's tokenizer.json) with
    the model's vocabulary size (its logits' width) and end-of-sequence ids."""
    llg = _llguidance()
    eos = [int(e) for e in (eos_ids or [])]
    try:
        return llg.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                               eos_token=None if not eos else eos[0] if len(eos) == 1 else eos)
    except Exception as e:  # noqa: BLE001 - llguidance raises plain exceptions for tokenizers it cannot read
        raise _core.UnsupportedError(f"structured output: llguidance cannot use this tokenizer: {e}") from None
