"""Speculative decoding in the runtime (``dflash2_rt.Engine`` with method "dflash2",
"dflash", "mtp") against the independent reference (tests/dflash_ref.py) and against plain
autoregressive decoding ("ar") of the same engine.

* ``propose`` equals the reference (anchor, drafted tokens, candidates) for DFlash 2 and
  DFlash 1 drafters: causal / non-causal, sliding window smaller than the prompt, BF16,
  odd shapes. Comparisons are tie-aware: where the engine differs from the reference, the
  engine's choice must score within a tolerance of the reference's best.
* greedy is lossless: every method equals "ar" token for token, at every batch size
  1..max_batch_size with prompts of different lengths in one batch, in long generations
  with low acceptance (random drafters) and with high acceptance (the self-drafting pair
  of tests/dflash_fixtures.py, whose accepted count per verify step is known exactly).
* sampling is lossless: the distribution of the first three generated tokens matches the
  exact target distribution (computed by teacher forcing) on a 16-token vocabulary, with a
  TV bound that tightens with the number of samples.
* stats, stop tokens, streaming, configuration errors and argument errors.

The whole module skips while the engine raises NotImplementedError for method="dflash2".
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.glm_moe_dsa", reason="needs transformers>=5 with GlmMoeDsa")
pytest.importorskip("safetensors")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash2_rt  # noqa: E402
import dflash_fixtures as F  # noqa: E402
import dflash_ref as R  # noqa: E402

try:
    import glm_fixtures as G  # noqa: E402  (another engineer's tiny targets, with an MTP layer)
except ImportError:  # pragma: no cover
    G = None

torch.set_num_threads(1)

MAXB = 4
MAXLEN = 256
NO_STOP: list = []


def _engine(target, draft=None, method="ar", **kw):
    return dflash2_rt.Engine(target=os.fspath(target), draft=None if draft is None else os.fspath(draft),
                             method=method, device="cpu", max_batch_size=MAXB, max_seq_len=MAXLEN, **kw)


def _greedy_equal_in_batches(eng, want, stride, what):
    """eng's greedy continuations of GREEDY_PROMPTS at batch sizes 1 and 3 (prompts grouped in
    a `stride`-dependent order) equal want[i] token for token."""
    n = len(GREEDY_PROMPTS)
    for bs in (1, 3):
        order = [(i * stride + bs) % n for i in range(n)]
        for j in range(0, n, bs):
            idx = order[j:j + bs]
            res = eng.generate([GREEDY_PROMPTS[i] for i in idx], max_new_tokens=GREEDY_NEW, stop_token_ids=NO_STOP)
            for i, r in zip(idx, res):
                assert list(r.token_ids) == want[i], f"{what}, batch size {bs}, prompt {i}"


def _prompt(seed: int, n: int, vocab: int = 256) -> list:
    return [int(x) for x in np.random.default_rng(500 + seed).integers(0, vocab - 1, n)]


# Random drafters: name -> (make function, kwargs). Seeds differ so that each is its own drafter.
DRAFTERS = {
    "d2": ("v2", dict(seed=1)),
    "d2_causal": ("v2", dict(seed=2, is_causal=True)),
    "d2_sw": ("v2", dict(seed=3, sliding_window=12)),
    "d2_sw_causal": ("v2", dict(seed=4, sliding_window=12, is_causal=True)),
    "d2_no_causal_key": ("v2", dict(seed=5, is_causal=None)),   # key absent -> non-causal
    "d2_bf16": ("v2", dict(seed=6, dtype="bf16")),
    "d2_shapes": ("v2", dict(seed=7, num_layers=3, block_size=6, heads=8, kv_heads=2, head_dim=8,
                             conv_group_size=8, selector_rank=16, selector_top_k=8, intermediate=96)),
    "d1": ("v1", dict(seed=1)),
    "d1_causal": ("v1", dict(seed=2, is_causal=True)),
    "d1_sw": ("v1", dict(seed=3, sliding_window=12)),
}


class World:
    """The tiny target (with an MTP layer when tests/glm_fixtures.py is there), drafters and
    references, built on first use."""

    def __init__(self, root):
        self.root = root
        if G is not None:
            self.target = G.build_model(root / "target", "tiny")
        else:
            self.target = F.make_tiny_target(root / "target", num_hidden_layers=4)
        self.cfg = F.read_target_config(self.target)
        self.V = self.cfg["vocab_size"]
        self._drafts, self._refs, self._tref = {}, {}, None

    def draft(self, key):
        if key not in self._drafts:
            kind, kw = DRAFTERS[key]
            make = F.make_dflash2_drafter if kind == "v2" else F.make_dflash1_drafter
            self._drafts[key] = make(self.target, self.root / key, **kw)
        return self._drafts[key]

    @property
    def tref(self):
        if self._tref is None:
            self._tref = R.TargetRef(self.target)
        return self._tref

    def ref(self, key, use_selector=True):
        k = (key, use_selector)
        if k not in self._refs:
            self._refs[k] = R.DraftRef(self.draft(key), self.tref, use_selector=use_selector)
        return self._refs[k]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("spec"))
    try:
        _engine(w.target, w.draft("d2"), "dflash2")
    except NotImplementedError as e:
        pytest.skip(f"speculative decoding is not implemented yet (Engine(method='dflash2') raised: {e})")
    return w


@pytest.fixture(scope="module")
def ar_engine(world):
    return _engine(world.target)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, world):
    return F.make_self_drafting_pair(tmp_path_factory.mktemp("pair"))


def _has_mtp(world) -> bool:
    return bool(_engine(world.target).has_mtp)


# ---------------------------------------------------------------------------- propose vs reference


def check_proposal(ref: R.Proposal, got, dref: R.DraftRef, rel_tol: float = 1e-4) -> bool:
    """Asserts that the engine's proposal is the reference's up to near-ties; returns True
    if it is exactly the reference's."""
    c = dref.cfg
    scale = max(1.0, float(ref.logits.abs().max()), float(ref.anchor_logits.abs().max()))
    tol = rel_tol * scale
    al = ref.anchor_logits.double()
    assert 0 <= got.anchor < al.shape[0]
    if got.anchor != ref.anchor:
        assert float(al[got.anchor]) >= float(al.max()) - tol, (got.anchor, ref.anchor)
        return False  # a tie decided the anchor: a different block, nothing more to compare
    toks = [int(t) for t in got.tokens]
    assert len(toks) == c.block_size - 1, f"{len(toks)} drafted tokens, expected block_size - 1 = {c.block_size - 1}"
    exact = toks == ref.tokens
    if dref.use_selector:
        cands = [[int(x) for x in row] for row in got.candidates]
        assert len(cands) == c.block_size - 1
        A = dref.w["candidate_selector.predecessor_codebook"]
        Bc = dref.w["candidate_selector.successor_codebook"]
        pred = ref.anchor
        for t in range(c.block_size - 1):
            row = ref.logits[t]
            assert len(cands[t]) == c.selector_top_k and len(set(cands[t])) == c.selector_top_k
            vals = row[torch.tensor(cands[t])]
            # the engine's candidates are a top-k in descending order, up to ties
            assert torch.allclose(vals, ref.unary[t], rtol=0, atol=tol), (t, cands[t], ref.candidates[t])
            assert toks[t] in cands[t], f"position {t + 1}: drafted token {toks[t]} is not a candidate"
            s = R.selector_scores(vals, torch.tensor(cands[t]), ref.g[t], A, Bc, pred)
            b = cands[t].index(toks[t])
            assert float(s[b]) >= float(s.max()) - tol, (t, toks, ref.tokens)
            pred = toks[t]
        exact = exact and cands == ref.candidates
    else:
        for t in range(c.block_size - 1):
            assert float(ref.logits[t][toks[t]]) >= float(ref.logits[t].max()) - tol, (t, toks, ref.tokens)
    return exact


PROPOSE_KEYS = ["d2", "d2_causal", "d2_sw", "d2_sw_causal", "d2_no_causal_key", "d2_bf16", "d2_shapes",
                "d1", "d1_causal", "d1_sw"]


@pytest.mark.parametrize("key", PROPOSE_KEYS)
def test_propose_matches_reference(world, key):
    kind = DRAFTERS[key][0]
    eng = _engine(world.target, world.draft(key), "dflash2" if kind == "v2" else "dflash")
    dref = world.ref(key)
    exact = 0
    prompts = [_prompt(1, 5), _prompt(2, 17), _prompt(3, 30)]   # window 12 < 17, 30
    for ids in prompts:
        got = eng.propose(ids)
        exact += check_proposal(dref.propose(ids), got, dref)
        if kind == "v1":
            assert len(got.candidates) == 0 or all(len(c) > 0 for c in got.candidates)
    assert exact >= 2, f"only {exact} of {len(prompts)} proposals equal the reference exactly"


def test_dflash2_checkpoint_as_dflash_drafts_argmax_with_convs(world):
    """method 'dflash' on a DFlash 2 checkpoint (the README's ablation): convs on, selector off."""
    eng = _engine(world.target, world.draft("d2"), "dflash")
    dref = world.ref("d2", use_selector=False)
    exact = 0
    for ids in (_prompt(4, 9), _prompt(5, 21)):
        exact += check_proposal(dref.propose(ids), eng.propose(ids), dref)
    assert exact >= 1


def test_dflash2_never_runs_as_dflash1(world, tmp_path):
    """The conv + selector path is used: a DFlash 2 drafter proposes differently from the
    same weights loaded as DFlash 1, unless its convs are identity and its successor
    codebook is zero (then it must draft exactly like DFlash 1)."""
    d2 = world.draft("d2")
    d1 = F.dflash1_from_dflash2(d2, tmp_path / "d2_as_v1")
    e2, e1 = _engine(world.target, d2, "dflash2"), _engine(world.target, d1, "dflash")
    prompts = [_prompt(s, n) for s, n in ((10, 6), (11, 14), (12, 23), (13, 3))]
    differs = 0
    for ids in prompts:
        p2, p1 = e2.propose(ids), e1.propose(ids)
        assert p2.anchor == p1.anchor
        assert len(p2.candidates) == 7 and all(len(c) == 16 for c in p2.candidates)
        differs += list(p2.tokens) != list(p1.tokens)
    assert differs >= 2, "a DFlash 2 drafter drafts like its DFlash 1 weights: convs/selector not applied"
    ident = F.make_dflash2_drafter(world.target, tmp_path / "ident", seed=1, identity_convs=True,
                                   zero_successor=True)
    ident1 = F.dflash1_from_dflash2(ident, tmp_path / "ident_v1")
    ei, ei1 = _engine(world.target, ident, "dflash2"), _engine(world.target, ident1, "dflash")
    for ids in prompts:
        pi, pi1 = ei.propose(ids), ei1.propose(ids)
        assert list(pi.tokens) == list(pi1.tokens)
        assert [c[0] for c in pi.candidates] == list(pi.tokens)


def test_dflash2_refuses_dflash1_checkpoint(world):
    with pytest.raises(dflash2_rt.ConfigError):
        _engine(world.target, world.draft("d1"), "dflash2")


# ---------------------------------------------------------------------------- greedy is lossless

GREEDY_PROMPTS = [_prompt(20 + i, n) for i, n in enumerate([3, 8, 17, 30, 5, 12, 25, 1])]
GREEDY_NEW = 24


@pytest.fixture(scope="module")
def ar_greedy(world, ar_engine):
    out = []
    for i in range(0, len(GREEDY_PROMPTS), MAXB):
        out += [list(r.token_ids) for r in ar_engine.generate(GREEDY_PROMPTS[i:i + MAXB], max_new_tokens=GREEDY_NEW,
                                                              stop_token_ids=NO_STOP)]
    return out


def _spec_engine(world, key):
    if key == "mtp":
        if not _has_mtp(world):
            pytest.skip("the target has no MTP layer (tests/glm_fixtures.py not available)")
        return _engine(world.target, None, "mtp")
    kind = DRAFTERS[key][0]
    return _engine(world.target, world.draft(key), "dflash2" if kind == "v2" else "dflash")


@pytest.mark.parametrize("key", ["d2", "d2_sw_causal", "d2_shapes", "d1", "mtp"])
def test_greedy_equals_ar_every_batch_size(world, ar_greedy, key):
    eng = _spec_engine(world, key)
    n = len(GREEDY_PROMPTS)
    for bs in range(1, MAXB + 1):
        order = [(i * 3 + bs) % n for i in range(n)]        # mixes prompt lengths inside a batch
        for j in range(0, n, bs):
            idx = order[j:j + bs]
            res = eng.generate([GREEDY_PROMPTS[i] for i in idx], max_new_tokens=GREEDY_NEW, stop_token_ids=NO_STOP)
            assert len(res) == len(idx)
            for i, r in zip(idx, res):
                assert list(r.token_ids) == ar_greedy[i], f"{key}, batch size {bs}, prompt {i}"
                assert r.finish_reason == "length"


def test_bf16_prefill_is_lossless(world, ar_greedy):
    """prefill_gemm="bf16": prompt tokens' projections on the tensor cores' BF16 numerics
    (CUTLASS on a GPU; here the CPU's emulation of it). Generated tokens decode exact, so
    speculative == AR holds in that mode at every batch size; and the output stays close
    to exact prefill's (only near-ties may flip)."""
    assert _engine(world.target).prefill_gemm == "exact"  # "auto" on the CPU
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="prefill_gemm"):
        _engine(world.target, prefill_gemm="fp4")
    with pytest.raises(dflash2_rt.ConfigError, match="FP8 block-128 checkpoint"):
        _engine(world.target, prefill_gemm="fp8")
    assert _engine(world.target).experts_prefill_gemm == "exact"
    ar = _engine(world.target, prefill_gemm="bf16")
    assert ar.prefill_gemm == "bf16" and ar.experts_prefill_gemm == "bf16"
    n = len(GREEDY_PROMPTS)
    want = _speculative_equals_ar(world, ar, 3, "bf16 prefill", prefill_gemm="bf16")
    same_first = sum(w[0] == e[0] for w, e in zip(want, ar_greedy))
    assert same_first >= (3 * n) // 4, f"bf16 prefill changed the first token of {n - same_first} of {n} prompts"


def _speculative_equals_ar(world, ar, stride, what, **kw):
    """AR engine `ar`'s greedy continuations of GREEDY_PROMPTS (returned), and dflash2 (and MTP
    where the target has it) engines with options kw equal to them token for token at batch
    sizes 1 and 3 (_greedy_equal_in_batches with `stride`)."""
    n = len(GREEDY_PROMPTS)
    want = []
    for i in range(0, n, MAXB):
        want += [list(r.token_ids) for r in ar.generate(GREEDY_PROMPTS[i:i + MAXB], max_new_tokens=GREEDY_NEW,
                                                        stop_token_ids=NO_STOP)]
    for key in ["d2"] + (["mtp"] if _has_mtp(world) else []):
        eng = (_engine(world.target, None, "mtp", **kw) if key == "mtp"
               else _engine(world.target, world.draft(key), "dflash2", **kw))
        _greedy_equal_in_batches(eng, want, stride, f"{key}, {what}")
    return want


def _quantized_prefill_is_lossless(world, path, mode, other, experts, option="prefill_gemm"):
    """Engines on `path` with option=mode (prefill_gemm or decode_gemm): speculative (dflash2,
    and MTP when the target has it) == AR token for token at batch sizes 1 and 3, and the
    greedy outputs differ from option=other's for some prompt (the mode's numerics really
    apply); the routed experts take `experts` numerics."""
    ar = _engine(path, **{option: mode})
    assert getattr(ar, option) == mode
    got_experts = getattr(ar, "experts_" + option)
    assert got_experts == experts, (mode, got_experts)
    n = len(GREEDY_PROMPTS)

    def greedy(e):
        out = []
        for i in range(0, n, MAXB):
            out += [list(r.token_ids) for r in e.generate(GREEDY_PROMPTS[i:i + MAXB], max_new_tokens=GREEDY_NEW,
                                                          stop_token_ids=NO_STOP)]
        return out

    want = greedy(ar)
    base = greedy(_engine(path, **{option: other}))
    assert any(w != b for w, b in zip(want, base)), f"{option}={mode} changed no continuation: is it quantizing?"
    keys = ["d2"] + (["mtp"] if _has_mtp(world) else [])
    for key in keys:
        eng = (_engine(path, None, "mtp", **{option: mode}) if key == "mtp"
               else _engine(path, world.draft(key), "dflash2", **{option: mode}))
        _greedy_equal_in_batches(eng, want, 5, f"{key}, {option}={mode}")


def test_decode_gemm_is_lossless(world, tmp_path):
    """decode_gemm: the generated tokens' projections and routed experts (decode and verify
    chunks) on the tensor cores' numerics ("bf16"; "fp8" = W8A8 on an FP8 block-128 copy;
    here the CPU's emulations). Each row's result does not depend on the batch around it, so
    AR decode and the verify blocks compute every token alike and speculative (dflash2, MTP)
    == AR token for token at batch sizes 1 and 3; the modes really change the output; the
    default and "auto" on the CPU are "exact"; logits() stays exact whatever the mode."""
    from dflash2_rt.tools.quantize import quantize_checkpoint
    assert _engine(world.target).decode_gemm == "exact"
    assert _engine(world.target, decode_gemm="auto").decode_gemm == "exact"  # the CPU
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="decode_gemm"):
        _engine(world.target, decode_gemm="fp16")
    with pytest.raises(dflash2_rt.ConfigError, match="decode_gemm='fp8'"):
        _engine(world.target, decode_gemm="fp8")
    _quantized_prefill_is_lossless(world, world.target, "bf16", "exact", "bf16", option="decode_gemm")
    ids = GREEDY_PROMPTS[3]
    assert np.array_equal(_engine(world.target, decode_gemm="bf16").logits(ids), _engine(world.target).logits(ids))
    fp8 = str(tmp_path / "fp8")
    quantize_checkpoint(os.fspath(world.target), fp8, "fp8", "all")
    _quantized_prefill_is_lossless(world, fp8, "fp8", "exact", "fp8", option="decode_gemm")


def test_kv_cache_bf16_is_lossless(world):
    """kv_cache_dtype="bf16": the target's MLA latent and indexer keys (and the MTP layer's)
    stored as BF16. Every method reads the same cache, so speculative (dflash2, MTP) == AR
    token for token at batch sizes 1 and 3 under it; the cache really is BF16 (the logits
    move, most positions by about the latent's rounding) and takes half the bytes
    (metrics()["kv_cache_bytes"]); bad values are refused."""
    assert _engine(world.target).kv_cache_dtype == "f32"
    for bad in ("fp16", "BF16", None):
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="kv_cache_dtype"):
            _engine(world.target, kv_cache_dtype=bad)
    ar = _engine(world.target, kv_cache_dtype="bf16")
    assert ar.kv_cache_dtype == "bf16"
    f32_bytes = _engine(world.target).metrics()["kv_cache_bytes"]
    assert f32_bytes > 0 and ar.metrics()["kv_cache_bytes"] * 2 == f32_bytes
    ids = GREEDY_PROMPTS[3]
    lg16, lg32 = ar.logits(ids), _engine(world.target).logits(ids)
    assert not np.array_equal(lg16, lg32), "kv_cache_dtype='bf16' changed no logit: is the cache BF16?"
    # most positions move by BF16's rounding of the latent (NMSE ~4e-6 here); a position whose
    # indexer selection flips on the rounded index keys attends to other keys and moves more
    rows = ((lg16 - lg32) ** 2).sum(1) / (lg32 ** 2).sum(1)
    assert np.median(rows) <= 1e-4, rows
    _speculative_equals_ar(world, ar, 5, "kv_cache_dtype=bf16", kv_cache_dtype="bf16")


def test_kv_cache_fp8_is_lossless(world, tmp_path):
    """kv_cache_dtype="fp8" (cpp/src/ops/kv_fp8.h): the latent's kv_lora values and the index
    keys as E4M3 codes with a power-of-two scale per group, the latent's rope in BF16. Every
    method reads the same cache, so speculative (dflash2, MTP) == AR token for token at batch
    sizes 1 and 3; the cache takes the bytes its layout says (metrics()["kv_cache_bytes"]), the
    logits move by about E4M3's rounding of the latent (more than BF16's), and a model whose
    kv_lora_rank cannot be grouped is refused before anything is allocated."""
    cfg = json.load(open(os.path.join(world.target, "config.json")))
    kvl, rope, dI = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["index_head_dim"]
    fp8 = _engine(world.target, kv_cache_dtype="fp8")
    assert fp8.kv_cache_dtype == "fp8"
    b32 = _engine(world.target).metrics()["kv_cache_bytes"]
    b16 = _engine(world.target, kv_cache_dtype="bf16").metrics()["kv_cache_bytes"]
    b8 = fp8.metrics()["kv_cache_bytes"]
    # rows of kvl + rope (latent) and dI (keys) values: F32 4 bytes each; FP8 the codes, the
    # group scales padded to 16 bytes, the rope in BF16, padded to 16 bytes
    g = lambda d: d + -(-4 * (d // min(d, 128)) // 16) * 16  # noqa: E731
    lat8, key8 = -(-(g(kvl) + 2 * rope) // 16) * 16, g(dI)
    # b = rows * (n_lat * lat_w + n_key * key_w): solve n_lat, n_key from F32 and FP8, both integers
    rows_lat_f32, key_f32 = 4 * (kvl + rope), 4 * dI
    found = [(a, k) for a in range(1, 64) for k in range(0, 64)
             if b32 * (a * lat8 + k * key8) == b8 * (a * rows_lat_f32 + k * key_f32)]
    assert found, f"{b8} bytes is not an FP8 layout of the F32 cache's {b32}"
    assert b16 * 2 == b32 and 0 < b8 < b16
    ids = GREEDY_PROMPTS[3]
    lg8, lg16, lg32 = fp8.logits(ids), _engine(world.target, kv_cache_dtype="bf16").logits(ids), \
        _engine(world.target).logits(ids)
    n8 = ((lg8 - lg32) ** 2).sum(1) / (lg32 ** 2).sum(1)
    n16 = ((lg16 - lg32) ** 2).sum(1) / (lg32 ** 2).sum(1)
    assert np.median(n8) > np.median(n16), "kv_cache_dtype='fp8' moved the logits less than bf16: is it FP8?"
    # (this random-weight fixture amplifies E4M3's ~2^-5 relative rounding to a median NMSE
    # of ~0.02; the bundled trained pair's logits move by ~1e-6)
    assert np.median(n8) <= 0.1, n8
    _speculative_equals_ar(world, fp8, 7, "kv_cache_dtype=fp8", kv_cache_dtype="fp8")
    import glm_fixtures as gf
    odd = gf.build_model(os.fspath(tmp_path / "lora24"), "tiny", config=dict(kv_lora_rank=24))
    assert _engine(odd).kv_cache_dtype == "f32"  # the model loads
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="kv_lora_rank 24"):
        _engine(odd, kv_cache_dtype="fp8")


def test_fp8_prefill_is_lossless(world, tmp_path):
    """prefill_gemm="fp8" on an FP8 block-128 checkpoint: the prompt tokens' FP8 projections
    and routed experts run W8A8 (activations quantized per 128 inputs: CUTLASS on sm_90a,
    here the CPU's emulation), the others bf16. Generated tokens decode exact, so
    speculative == AR holds at every batch size; and the prompt states really differ from
    exact prefill's."""
    from dflash2_rt.tools.quantize import quantize_checkpoint
    fp8 = str(tmp_path / "fp8")
    quantize_checkpoint(os.fspath(world.target), fp8, "fp8", "all")
    assert _engine(fp8).prefill_gemm == "exact"  # "auto" on the CPU
    _quantized_prefill_is_lossless(world, fp8, "fp8", "exact", "fp8")


def test_nvfp4_prefill_is_lossless(world, tmp_path):
    """prefill_gemm="nvfp4" on a checkpoint whose MLPs are NVFP4 (with an input_scale): the
    prompt tokens' NVFP4 projections run W4A4 (CUTLASS on sm_100a; here the CPU's
    emulation), the others bf16; speculative == AR at every batch size."""
    from dflash2_rt.tools.quantize import quantize_checkpoint
    fp4 = str(tmp_path / "nvfp4")
    quantize_checkpoint(os.fspath(world.target), fp4, "nvfp4", "mlp")
    with pytest.raises(dflash2_rt.ConfigError, match="NVFP4 with an input_scale"):
        _engine(world.target, prefill_gemm="nvfp4")
    _quantized_prefill_is_lossless(world, fp4, "nvfp4", "bf16", "nvfp4")


def test_draft_gemm_is_lossless(world, ar_greedy, tmp_path):
    """draft_gemm: the DFlash drafter's projections and its LM head over the block on the
    tensor cores' numerics ("bf16"; "fp8" = W8A8 for a drafter stored in FP8 block-128; here
    the CPU's emulations). Drafts only steer acceptance, so speculative == AR token for token
    in every mode; "auto" is "exact" on the CPU; a mode the drafter's weights cannot take, or
    one given to an engine without a DFlash drafter, is a clear error; W8A8 really changes
    some drafts."""
    from dflash2_rt.tools.quantize import quantize_checkpoint
    d2 = world.draft("d2")
    fp8 = tmp_path / "d2_fp8"
    quantize_checkpoint(os.fspath(d2), os.fspath(fp8), "fp8")
    assert _engine(world.target, d2, "dflash2").draft_gemm == "exact"  # "auto" on the CPU
    assert _engine(world.target).draft_gemm == "exact"
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="draft_gemm"):
        _engine(world.target, d2, "dflash2", draft_gemm="BF16")
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="DFlash drafters"):
        _engine(world.target, None, "ar", draft_gemm="bf16")
    with pytest.raises(dflash2_rt.ConfigError, match="FP8 block-128"):
        _engine(world.target, d2, "dflash2", draft_gemm="fp8")
    with pytest.raises(dflash2_rt.ConfigError, match="NVFP4"):
        _engine(world.target, d2, "dflash2", draft_gemm="nvfp4")
    cases = [(d2, "dflash2", "bf16"), (world.draft("d1"), "dflash", "bf16"), (fp8, "dflash2", "fp8")]
    exact_bytes = _engine(world.target, d2, "dflash2").metrics()["draft_cache_bytes"]
    assert exact_bytes > 0 and _engine(world.target).metrics()["draft_cache_bytes"] == 0
    for draft, method, mode in cases:
        eng = _engine(world.target, draft, method, draft_gemm=mode)
        assert eng.draft_gemm == mode
        if draft == d2:  # the tensor-core modes keep the draft cache in BF16: half the bytes
            assert eng.metrics()["draft_cache_bytes"] * 2 == exact_bytes
        _greedy_equal_in_batches(eng, ar_greedy, 7, f"{method}, draft_gemm={mode}")
    # BF16 numerics and the BF16 draft cache round, but read right they keep most drafts
    ex, b16 = _engine(world.target, d2, "dflash2"), _engine(world.target, d2, "dflash2", draft_gemm="bf16")
    same = sum(list(ex.propose(p).tokens) == list(b16.propose(p).tokens) for p in GREEDY_PROMPTS)
    assert same >= len(GREEDY_PROMPTS) - 2, f"draft_gemm='bf16' changed {len(GREEDY_PROMPTS) - same} drafts"
    exact, w8a8 = _engine(world.target, fp8, "dflash2"), _engine(world.target, fp8, "dflash2", draft_gemm="fp8")
    assert exact.draft_gemm == "exact"
    assert any(list(exact.propose(p).tokens) != list(w8a8.propose(p).tokens) for p in GREEDY_PROMPTS), \
        "draft_gemm='fp8' changed no draft: is it quantizing?"


def test_nvfp4_experts_prefill_is_lossless(world, tmp_path):
    """A checkpoint whose routed experts are NVFP4 (only those, as GLM-5.3-NVFP4): with
    prefill_gemm="bf16" the prompt tokens' experts run moe_experts' BF16 numerics (W4A16: the
    grouped mainloop-dequantizing GEMM on a GPU), with "nvfp4" its W4A4 numerics (the grouped
    block-scaled GEMM on Blackwell), here the CPU's emulations; speculative == AR at every
    batch size in both, and each changes continuations (against exact, against bf16)."""
    from dflash2_rt.tools.quantize import quantize_checkpoint
    fp4 = str(tmp_path / "nvfp4e")
    quantize_checkpoint(os.fspath(world.target), fp4, "nvfp4", "experts")
    _quantized_prefill_is_lossless(world, fp4, "bf16", "exact", "bf16")
    _quantized_prefill_is_lossless(world, fp4, "nvfp4", "bf16", "nvfp4")


@pytest.mark.parametrize("key", ["d2", "d2_sw", "d1_causal", "mtp"])
def test_long_generation_low_acceptance_equals_ar(world, ar_engine, key):
    """Random drafters accept little: many rejections, rollbacks and context appends."""
    eng = _spec_engine(world, key)
    prompts = [_prompt(40, 9), _prompt(41, 23)]
    new = 150
    want = [list(r.token_ids) for r in ar_engine.generate(prompts, max_new_tokens=new, stop_token_ids=NO_STOP)]
    got = eng.generate(prompts, max_new_tokens=new, stop_token_ids=NO_STOP)
    for w, r in zip(want, got):
        assert list(r.token_ids) == w
        assert 1.0 <= r.stats["acceptance_length"] <= eng.block_size


def test_reference_decode_loop_agrees(world):
    """The reference's own greedy speculative loop (HF target, no caches) commits the same
    accepted counts as the engine for a random drafter, as long as no near-tie intervenes."""
    dref = world.ref("d2")
    prompt = _prompt(60, 11)
    toks, accepted = dref.speculative_greedy(prompt, 12)
    r = _engine(world.target, world.draft("d2"), "dflash2").generate([prompt], max_new_tokens=12,
                                                                      stop_token_ids=NO_STOP)[0]
    assert list(r.token_ids) == toks
    assert r.stats["verify_steps"] == len(accepted)


# ---------------------------------------------------------------------------- high acceptance (the pair)

PAIR_PROMPTS = [[3, 77, 12, 40], [9, 100], [127], [5] * 20 + [60]]


def _per_position(accepted, B):
    steps = len(accepted)
    return [sum(a > j for a in accepted) / steps for j in range(B - 1)]


def _check_pair_result(r, exp, B):
    assert list(r.token_ids) == exp["tokens"]
    st = r.stats
    assert st["verify_steps"] == exp["steps"]
    steps = exp["steps"]
    # the last step may be counted before or after truncation to max_new_tokens
    assert abs(st["acceptance_length"] - exp["tau"]) <= (B - 1) / steps + 1e-9, (st, exp)
    app = st["accepted_per_position"]
    assert len(app) == B - 1
    for got, want in zip(app, _per_position(exp["accepted"], B)):
        assert abs(got - want) <= 1.0 / steps + 1e-9, (app, exp["accepted"])


@pytest.mark.parametrize("variant", ["default", "causal", "window8", "no_breaks", "two_layers"])
def test_self_drafting_pair_high_acceptance(pair, tmp_path, variant):
    p = {
        "default": lambda: pair,
        "causal": lambda: pair.with_drafter(tmp_path / "d", is_causal=True),
        "window8": lambda: pair.with_drafter(tmp_path / "d", sliding_window=8),
        "no_breaks": lambda: pair.with_drafter(tmp_path / "d", break_tokens=()),
        "two_layers": lambda: pair.with_drafter(tmp_path / "d", num_draft_layers=2, is_causal=None),
    }[variant]()
    eng = _engine(p.target_dir, p.draft_dir, "dflash2")
    new = 41
    res = eng.generate(PAIR_PROMPTS, max_new_tokens=new, stop_token_ids=NO_STOP)
    for prompt, r in zip(PAIR_PROMPTS, res):
        exp = p.expected_greedy(prompt, new)
        _check_pair_result(r, exp, p.block_size)
        if variant == "no_breaks":
            assert r.stats["acceptance_length"] == p.block_size
        else:
            assert r.stats["acceptance_length"] >= 3.0
    # propose: anchor + 1, anchor + 2, ... up to the first break, candidates a-6 .. a+9
    prop = eng.propose([11, 22, 33])
    a = prop.anchor
    assert a == 34
    k = p.accepted_from(a)
    assert list(prop.tokens)[: k + 1] == p.draft_from(a)[: k + 1]
    assert sorted((c - a) % p.period for c in prop.candidates[0]) == list(range(10)) + list(range(122, 128))
    # the same engine again: no state carried between calls
    again = eng.generate(PAIR_PROMPTS[:2], max_new_tokens=new, stop_token_ids=NO_STOP)
    for r0, r1 in zip(res, again):
        assert list(r0.token_ids) == list(r1.token_ids)
        assert r0.stats["verify_steps"] == r1.stats["verify_steps"]


def test_self_drafting_pair_equals_ar_and_batch_sizes(pair):
    ar = _engine(pair.target_dir)
    eng = _engine(pair.target_dir, pair.draft_dir, "dflash2")
    prompts = [[int(x)] * (1 + i % 5) + [int(x)] for i, x in enumerate(np.random.default_rng(9).integers(0, 128, 6))]
    want = [pair.expected_greedy(pr, 57)["tokens"] for pr in prompts]
    for bs in (1, 3, 4):
        for j in range(0, len(prompts), bs):
            got = eng.generate(prompts[j:j + bs], max_new_tokens=57, stop_token_ids=NO_STOP)
            assert [list(r.token_ids) for r in got] == want[j:j + bs]
    got = ar.generate(prompts[:4], max_new_tokens=57, stop_token_ids=NO_STOP)
    assert [list(r.token_ids) for r in got] == want[:4]


# ---------------------------------------------------------------------------- stop tokens, streaming


def test_stop_tokens_truncate_inside_a_block(pair):
    eng = _engine(pair.target_dir, pair.draft_dir, "dflash2")
    prompts = [[1, 40], [7, 7, 10], [60], [2, 49]]
    stops = [50, 15]
    res = eng.generate(prompts, max_new_tokens=30, stop_token_ids=stops)
    for pr, r in zip(prompts, res):
        full = pair.expected_greedy(pr, 30)["tokens"]
        cut = next((i for i, t in enumerate(full) if t in stops), None)
        if cut is None:
            assert list(r.token_ids) == full and r.finish_reason == "length"
        else:
            assert list(r.token_ids) == full[: cut + 1] and r.finish_reason == "stop"
    assert list(res[3].token_ids) == [50]                  # the prefill's token is already a stop
    assert list(res[0].token_ids) == list(range(41, 51))   # 10 tokens: cut in the middle of a block


def test_stop_tokens_random_drafter(world, ar_engine):
    eng = _engine(world.target, world.draft("d2"), "dflash2")
    prompt = _prompt(70, 13)
    full = list(ar_engine.generate([prompt], max_new_tokens=30, stop_token_ids=NO_STOP)[0].token_ids)
    stop = full[6]
    cut = full.index(stop)
    r = eng.generate([prompt, _prompt(71, 4)], max_new_tokens=30, stop_token_ids=[stop])
    assert list(r[0].token_ids) == full[: cut + 1] and r[0].finish_reason == "stop"
    other = list(ar_engine.generate([_prompt(71, 4)], max_new_tokens=30, stop_token_ids=[stop])[0].token_ids)
    assert list(r[1].token_ids) == other


def test_stream_yields_the_generated_tokens(world, pair):
    eng = _engine(pair.target_dir, pair.draft_dir, "dflash2")
    pr = [3, 77, 12, 40]
    assert list(eng.stream(pr, max_new_tokens=25, stop_token_ids=NO_STOP)) == pair.expected_greedy(pr, 25)["tokens"]
    assert list(eng.stream(pr, max_new_tokens=25, stop_token_ids=[50])) == list(range(41, 51))
    e2 = _engine(world.target, world.draft("d2"), "dflash2")
    p = _prompt(80, 7)
    want = list(e2.generate([p], max_new_tokens=20, stop_token_ids=NO_STOP)[0].token_ids)
    assert list(e2.stream(p, max_new_tokens=20, stop_token_ids=NO_STOP)) == want


# ---------------------------------------------------------------------------- stats


def test_stats_sanity(world, pair):
    eng = _engine(world.target, world.draft("d2"), "dflash2")
    res = eng.generate(GREEDY_PROMPTS[:4], max_new_tokens=20, stop_token_ids=NO_STOP)
    B = eng.block_size
    assert B == 8
    for r in res:
        st = r.stats
        for key in ("acceptance_length", "verify_steps", "accepted_per_position", "draft_s", "verify_s", "host_s",
                    "tokens_per_second"):
            assert key in st, f"stats lack '{key}'"
        assert 1.0 <= st["acceptance_length"] <= B
        assert 1 <= st["verify_steps"] <= 20
        app = st["accepted_per_position"]
        assert len(app) == B - 1 and all(0.0 <= a <= 1.0 for a in app)
        assert all(app[j] >= app[j + 1] for j in range(B - 2)), app   # a prefix rule: non-increasing
        # tau = 1 + mean accepted = 1 + sum of per-position rates (up to the truncated last step)
        assert abs(st["acceptance_length"] - 1 - sum(app)) <= (B - 1) / st["verify_steps"] + 1e-9
        for key in ("draft_s", "verify_s", "accept_s", "host_s", "prefill_wait_s"):
            assert st[key] >= 0.0
        assert st["accept_s"] > 0.0  # every verify step accepts
        # the split adds up to the decode time (host_s is the rest, never negative)
        parts = st["draft_s"] + st["verify_s"] + st["accept_s"] + st["prefill_wait_s"] + st["host_s"]
        assert parts == pytest.approx(st["decode_s"], rel=1e-9, abs=1e-12) or st["host_s"] == 0.0
        assert st["tokens_per_second"] > 0
    pe = _engine(pair.target_dir, pair.draft_dir, "dflash2")
    r = pe.generate([[3, 77, 12, 40]], max_new_tokens=64, stop_token_ids=NO_STOP)[0]
    assert r.stats["acceptance_length"] > 3.5
    assert r.stats["accepted_per_position"][0] > 0.6


# ---------------------------------------------------------------------------- sampling is lossless

V_SMALL = 16
SAMPLE_PROMPT = [3, 9, 4, 12, 7]
SAMPLE_T = 0.7      # not 1: a verifier that forgets the temperature on p (or on q) is caught


class Small:
    """A 16-token target with a sharpened lm_head (so that sampled sequences concentrate on
    few outcomes) and drafters with top-4 candidates (q is zero outside them)."""

    def __init__(self, root):
        if G is not None:
            self.target = G.build_model(root / "t16", "tiny", config={"vocab_size": V_SMALL})
        else:
            self.target = F.make_tiny_target(root / "t16", vocab_size=V_SMALL, num_hidden_layers=4)
        _scale_tensor(self.target, "lm_head.weight", 5.0)
        self.d2 = F.make_dflash2_drafter(self.target, root / "d2", seed=11, selector_top_k=4, selector_rank=8)
        self.ar = _engine(self.target)
        self.exact = _exact_triples(self.ar, SAMPLE_PROMPT, SAMPLE_T)
        # DFlash 1 drafts one-hot; a random one is almost never accepted, so this one always
        # drafts the target's most likely second token
        self.d1_token = int(np.argmax(self.exact.sum((0, 2))))
        self.d1 = F.make_constant_dflash1_drafter(self.target, root / "d1", self.d1_token, seed=12)


def _scale_tensor(ckpt_dir, name, factor):
    from safetensors.torch import load_file, save_file

    d = os.fspath(ckpt_dir)
    for f in sorted(os.listdir(d)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(d, f)
        t = load_file(path)
        if name in t:
            t[name] = (t[name].float() * factor).to(t[name].dtype)
            save_file(t, path, metadata={"format": "pt"})
            return
    raise KeyError(name)


def _softmax(x, T):
    z = np.asarray(x, np.float64) / T
    z = np.exp(z - z.max())
    return z / z.sum()


def _exact_triples(ar, prompt, T):
    """p(t1, t2, t3 | prompt) at temperature T by teacher forcing, [V, V, V]."""
    V = V_SMALL
    p1 = _softmax(ar.logits(prompt)[-1], T)
    out = np.zeros((V, V, V))
    for a in range(V):
        p2 = _softmax(ar.logits(prompt + [a])[-1], T)
        for b in range(V):
            if p1[a] * p2[b] < 1e-7:
                continue
            p3 = _softmax(ar.logits(prompt + [a, b])[-1], T)
            out[a, b] = p1[a] * p2[b] * p3
    return out / out.sum()


@pytest.fixture(scope="module")
def small(world, tmp_path_factory):
    s = Small(tmp_path_factory.mktemp("small"))
    assert R.DraftRef(s.d1, R.TargetRef(s.target)).propose(SAMPLE_PROMPT).tokens == [s.d1_token] * 7
    # the teacher-forced engine logits used for the exact distribution agree with transformers
    tr = R.TargetRef(s.target)
    ids = SAMPLE_PROMPT + [2, 5]
    lg, _ = tr.run(ids)
    np.testing.assert_allclose(s.ar.logits(ids), lg.numpy(), rtol=0, atol=1e-4 * float(lg.abs().max()) + 1e-5)
    return s


def _sample(eng, n, seed0, **kw):
    """n sampled continuations of SAMPLE_PROMPT (3 tokens each), 4 per generate call."""
    kw.setdefault("temperature", SAMPLE_T)
    out, acc = [], []
    i = 0
    while len(out) < n:
        res = eng.generate([SAMPLE_PROMPT] * MAXB, max_new_tokens=3, seed=seed0 + i, stop_token_ids=NO_STOP, **kw)
        for r in res:
            assert len(r.token_ids) == 3
            out.append(list(r.token_ids))
            app = r.stats.get("accepted_per_position") or [0.0]
            acc.append(app[0] if r.stats.get("verify_steps") else 0.0)
        i += 1
    return np.array(out[:n]), float(np.mean(acc))


def _tv_bound(p, n, c=2.0):
    """c x the expected TV distance between p and an n-sample empirical distribution (the
    observed ratio for a correct sampler is about 1; seeds are fixed)."""
    p = p.ravel()
    return c * 0.5 * float(np.sum(np.sqrt(2 * p * (1 - p) / (math.pi * n))))


def _marginals(samples_or_p, V=V_SMALL):
    if samples_or_p.ndim == 2:                      # samples [n, 3]
        p = np.zeros((V, V, V))
        np.add.at(p, (samples_or_p[:, 0], samples_or_p[:, 1], samples_or_p[:, 2]), 1.0)
        p /= len(samples_or_p)
    else:
        p = samples_or_p
    return {"t1,t2": p.sum(2), "t2,t3": p.sum(0), "t1,t3": p.sum(1)}


@pytest.mark.parametrize("method", ["ar", "dflash2", "dflash", "mtp", "dflash2_bf16_draft"])
def test_sampling_matches_target_distribution(small, method):
    if method == "ar":
        eng = small.ar
    elif method == "mtp":
        if not small.ar.has_mtp:
            pytest.skip("the small target has no MTP layer (tests/glm_fixtures.py not available)")
        try:  # fewer chained MTP drafts: the same verifier, a third of the drafting time
            eng = _engine(small.target, None, "mtp", mtp_draft_tokens=3)
        except TypeError:
            eng = _engine(small.target, None, "mtp")
    elif method == "dflash2_bf16_draft":  # the drafter on the tensor cores' numerics (draft_gemm)
        eng = _engine(small.target, small.d2, "dflash2", draft_gemm="bf16")
    else:
        eng = _engine(small.target, small.d2 if method == "dflash2" else small.d1, method)
    check_sampling_distribution(small, eng, method)


def check_sampling_distribution(small, eng, method):
    """4000 sampled 3-token continuations of SAMPLE_PROMPT from `eng` against the exact
    distribution (pairwise marginals within the TV bound at 1000 and 4000 samples), and
    enough first drafts accepted to exercise acceptance (test_cuda_engine runs it on a GPU)."""
    samples, acc0 = _sample(eng, 4000, seed0=1000)
    exact = _marginals(small.exact)
    for n in (1000, 4000):                       # the bound tightens with the sample size
        emp = _marginals(samples[:n])
        for name in exact:
            tv = 0.5 * float(np.abs(emp[name] - exact[name]).sum())
            bound = _tv_bound(exact[name], n)
            print(f"{method}: TV({name}) = {tv:.4f}, bound {bound:.4f}, {n} samples")
            assert tv <= bound, f"{method}: TV({name}) = {tv:.4f} > {bound:.4f} with {n} samples"
    print(f"{method}: first draft accepted in {acc0:.3f} of the verify steps")
    if method != "ar":
        assert acc0 > 0.01, \
            f"{method}: almost no draft accepted ({acc0:.3f}): the test would not exercise acceptance"


def test_sampling_with_top_k_top_p_matches_ar(small):
    """Temperature, top-k and top-p apply to p exactly as in plain sampling (two-sample test)."""
    kw = dict(temperature=0.8, top_k=6, top_p=0.85)
    n = 3000
    a, _ = _sample(small.ar, n, seed0=5000, **kw)
    b, acc0 = _sample(_engine(small.target, small.d2, "dflash2"), n, seed0=9000, **kw)
    ma, mb = _marginals(a), _marginals(b)
    for name in ma:
        pooled = 0.5 * (ma[name] + mb[name])
        tv = 0.5 * float(np.abs(ma[name] - mb[name]).sum())
        bound = 2 * _tv_bound(pooled, n)
        print(f"TV({name}) dflash2 vs ar = {tv:.4f}, bound {bound:.4f}")
        assert tv <= bound, f"TV({name}) dflash2 vs ar = {tv:.4f} > {bound:.4f}"
    assert acc0 > 0.02


PEN = dict(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.8, logit_bias={2: 1.5, 11: -1.0})


def _penalized(lg, prompt, toks):
    """The logits after PEN (float64 is enough here: the test compares distributions)."""
    x = np.asarray(lg, np.float64) + np.array([PEN["logit_bias"].get(v, 0.0) for v in range(len(lg))])
    cnt = np.bincount(np.asarray(toks, np.int64), minlength=len(x)) if toks else np.zeros(len(x), np.int64)
    seen = np.zeros(len(x), bool)
    seen[list(prompt)] = True
    seen |= cnt > 0
    r = PEN["repetition_penalty"]
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - PEN["frequency_penalty"] * cnt - PEN["presence_penalty"] * (cnt > 0)


def _exact_penalized_triples(ar, prompt, T):
    V = V_SMALL
    p1 = _softmax(_penalized(ar.logits(prompt)[-1], prompt, []), T)
    out = np.zeros((V, V, V))
    for a in range(V):
        p2 = _softmax(_penalized(ar.logits(prompt + [a])[-1], prompt, [a]), T)
        for b in range(V):
            if p1[a] * p2[b] < 1e-7:
                continue
            p3 = _softmax(_penalized(ar.logits(prompt + [a, b])[-1], prompt, [a, b]), T)
            out[a, b] = p1[a] * p2[b] * p3
    return out / out.sum()


@pytest.mark.parametrize("method", ["ar", "dflash2", "mtp"])
def test_sampling_with_penalties_matches_target_distribution(small, method):
    """Presence / frequency / repetition penalties and a logit bias: the sampled 3-token
    continuations follow the exact penalized distribution (teacher forcing), speculative
    methods included (the second and third verify rows count the drafts before them)."""
    eng = _sampling_engine(small, method)
    exact = _marginals(_exact_penalized_triples(small.ar, SAMPLE_PROMPT, SAMPLE_T))
    samples, acc0 = _sample(eng, 3000, seed0=20000, **PEN)
    _assert_adjusted_distribution(small, method, "penalized", samples, exact, acc0)


def _sampling_engine(small, method):
    """ar / mtp (3 chained drafts) / dflash2 on the small target."""
    if method == "ar":
        return small.ar
    if method == "mtp":
        if not small.ar.has_mtp:
            pytest.skip("the small target has no MTP layer (tests/glm_fixtures.py not available)")
        return _engine(small.target, None, "mtp", mtp_draft_tokens=3)
    return _engine(small.target, small.d2, method)


def _assert_adjusted_distribution(small, method, what, samples, exact, acc0):
    """samples [n, 3] follow `exact` (pairwise marginals within the TV bound), which differs
    from the plain distribution (the adjustment matters), with drafts accepted."""
    plain = _marginals(small.exact)
    assert 0.5 * float(np.abs(plain["t1,t2"] - exact["t1,t2"]).sum()) > 0.1
    for name in exact:
        emp = _marginals(samples)[name]
        tv = 0.5 * float(np.abs(emp - exact[name]).sum())
        bound = _tv_bound(exact[name], len(samples))
        print(f"{method} {what}: TV({name}) = {tv:.4f}, bound {bound:.4f}")
        assert tv <= bound, f"{method} {what}: TV({name}) = {tv:.4f} > {bound:.4f}"
    if method != "ar":
        assert acc0 > 0.01


class RuleConstraint:
    """A token constraint (the engine's TokenConstraint protocol) whose allowed set depends on
    the last token: after token a, the tokens (5 a + k) % V for k < 6 are banned (before any
    token, a = 1). The rule is the reference's too."""

    def __init__(self, V, start=1):
        self.V, self.last, self.calls = V, start, 0

    @staticmethod
    def banned(a, V):
        return {(5 * a + k) % V for k in range(6)}

    def _row(self, a, out):
        bits = np.ones(out.shape[0] * 32, bool)
        bits[self.V:] = False
        bits[list(self.banned(a, self.V))] = False
        out[:] = np.packbits(bits, bitorder="little").view(np.int32)

    def masks(self, drafts, out):
        self.calls += 1
        a = self.last
        self._row(a, out[0])
        for j, d in enumerate(drafts):
            if d in self.banned(a, self.V):  # rejected there: the rows after it are not read
                return j + 1
            a = d
            self._row(a, out[j + 1])
        return len(drafts) + 1

    def commit(self, tokens):
        for t in tokens:
            assert t not in self.banned(self.last, self.V), "a banned token was committed"
            self.last = t

    def done(self):
        return False


def _exact_constrained_triples(ar, prompt, T):
    V = V_SMALL

    def p(ctx, a):
        x = np.asarray(ar.logits(ctx)[-1], np.float64).copy()
        x[list(RuleConstraint.banned(a, V))] = -np.inf
        return _softmax(x, T)

    p1 = p(prompt, 1)
    out = np.zeros((V, V, V))
    for a in range(V):
        if p1[a] < 1e-9:
            continue
        p2 = p(prompt + [a], a)
        for b in range(V):
            if p1[a] * p2[b] < 1e-7:
                continue
            out[a, b] = p1[a] * p2[b] * p(prompt + [a, b], b)
    return out / out.sum()


@pytest.mark.parametrize("method", ["ar", "dflash2", "mtp"])
def test_sampling_with_constraint_matches_target_distribution(small, method):
    """Structured output's token masks under sampling: 3000 sampled 3-token continuations,
    each with a constraint banning 6 tokens that depend on the last one, follow the exact
    masked distribution (teacher forcing): a draft the mask bans is rejected with certainty and
    the residual keeps the masked target's distribution. (A verifier that masked only each
    step's first row stays within these TV bounds at this pair's acceptance rates; it commits
    banned tokens, which the constraint's commit() catches.)"""
    eng = _sampling_engine(small, method)
    exact = _marginals(_exact_constrained_triples(small.ar, SAMPLE_PROMPT, SAMPLE_T))
    out, acc, i = [], [], 0
    while len(out) < 3000:
        rids = [eng.submit(SAMPLE_PROMPT, max_new_tokens=3, temperature=SAMPLE_T, seed=30000 + i, _stream_index=j,
                           stop_token_ids=NO_STOP, constraint=RuleConstraint(V_SMALL)) for j in range(MAXB)]
        for rid in rids:
            while True:
                u = eng.poll(rid)
                if u.finished:
                    break
            r = u.result
            assert len(r.token_ids) == 3
            out.append(list(r.token_ids))
            app = r.stats.get("accepted_per_position") or [0.0]
            acc.append(app[0] if r.stats.get("verify_steps") else 0.0)
        i += 1
    _assert_adjusted_distribution(small, method, "constrained", np.array(out), exact, float(np.mean(acc)))


# ---------------------------------------------------------------------------- bad configurations


def _fake_target(tmp_path, world, **changes):
    """A directory with only the target's config.json, edited (the fixtures read nothing else)."""
    d = tmp_path / ("fake_" + "_".join(changes))
    d.mkdir()
    cfg = dict(world.cfg["raw"])
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_config_error_hidden_size_mismatch(world, tmp_path):
    d = F.make_dflash2_drafter(_fake_target(tmp_path, world, hidden_size=32), tmp_path / "d")
    with pytest.raises(dflash2_rt.ConfigError, match=r"(?i)hidden"):
        _engine(world.target, d, "dflash2")


def test_config_error_vocab_mismatch(world, tmp_path):
    d = F.make_dflash2_drafter(_fake_target(tmp_path, world, vocab_size=300), tmp_path / "d", mask_token_id=100)
    with pytest.raises(dflash2_rt.ConfigError, match=r"(?i)vocab"):
        _engine(world.target, d, "dflash2")


def test_config_error_mask_token_out_of_vocab(world, tmp_path):
    d = shutil.copytree(world.draft("d2"), tmp_path / "d")
    F.rewrite_config(d, dflash_config={"mask_token_id": world.V})
    with pytest.raises(dflash2_rt.ConfigError, match=r"(?i)mask"):
        _engine(world.target, d, "dflash2")
    d1 = shutil.copytree(world.draft("d1"), tmp_path / "d1")
    F.rewrite_config(d1, dflash_config={"mask_token_id": world.V + 5})
    with pytest.raises(dflash2_rt.ConfigError, match=r"(?i)mask"):
        _engine(world.target, d1, "dflash")


def test_config_error_target_layer_ids_out_of_range(world, tmp_path):
    T = world.cfg["num_hidden_layers"]
    d = shutil.copytree(world.draft("d2"), tmp_path / "d")
    F.rewrite_config(d, dflash_config={"target_layer_ids": [0, T]})
    with pytest.raises(dflash2_rt.ConfigError, match=r"(?i)target_layer_ids|layer"):
        _engine(world.target, d, "dflash2")
    F.rewrite_config(d, dflash_config={"target_layer_ids": [-1, 1]})
    with pytest.raises(dflash2_rt.ConfigError, match=r"(?i)target_layer_ids|layer"):
        _engine(world.target, d, "dflash2")


def test_dflash2_checkpoint_without_selector_or_convs_fails(world, tmp_path):
    """A DFlash2DraftModel missing its selector or conv tensors is an error, never a
    silent DFlash 1."""
    from safetensors.torch import load_file, save_file

    for drop in ("candidate_selector.", "_conv."):
        d = shutil.copytree(world.draft("d2"), tmp_path / drop.strip("._"))
        path = os.path.join(d, "model.safetensors")
        t = {k: v for k, v in load_file(path).items() if drop not in k and not k.startswith(drop)}
        save_file(t, path, metadata={"format": "pt"})
        with pytest.raises(dflash2_rt.DFlash2Error):
            _engine(world.target, d, "dflash2")


def test_config_error_conv_group_size(world, tmp_path):
    d = shutil.copytree(world.draft("d2"), tmp_path / "d")
    F.rewrite_config(d, dflash_config={"conv_group_size": 24})    # does not divide 64
    with pytest.raises(dflash2_rt.DFlash2Error):
        _engine(world.target, d, "dflash2")


# ---------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("kw", [dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(temperature=-0.5),
                                dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.1)])
def test_invalid_sampling_arguments(world, kw):
    eng = _engine(world.target, world.draft("d2"), "dflash2")
    args = dict(max_new_tokens=4, stop_token_ids=NO_STOP)
    args.update(kw)
    with pytest.raises(dflash2_rt.InvalidArgumentError):
        eng.generate([_prompt(90, 5)], **args)
    with pytest.raises(dflash2_rt.InvalidArgumentError):
        list(eng.stream(_prompt(90, 5), **args))


def test_invalid_prompts(world):
    eng = _engine(world.target, world.draft("d2"), "dflash2")
    with pytest.raises(dflash2_rt.InvalidArgumentError):
        eng.generate([[]], max_new_tokens=4)
    with pytest.raises(dflash2_rt.InvalidArgumentError):
        eng.generate([_prompt(91, 3), []], max_new_tokens=4)
    with pytest.raises(dflash2_rt.InvalidArgumentError):
        eng.generate([[1, world.V]], max_new_tokens=4)
    with pytest.raises(dflash2_rt.InvalidArgumentError):
        list(eng.stream([], max_new_tokens=4))
    with pytest.raises(dflash2_rt.InvalidArgumentError):
        eng.propose([])
