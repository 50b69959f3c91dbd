"""Engine options as a careless user sets them: thread counts (bounded, per engine, never
process-wide), non-finite weights (a typed error naming the step, not silent garbage),
max_seq_len from the model's limit, and the method inferred from the drafter.

Runs on copies of the bundled default pair (weights symlinked or rewritten, configs edited).
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import dflash2_rt
from dflash2_rt.checkpoint import save_safetensors
from dflash2_rt.engine import DEFAULT_PAIR_DIR

TARGET = os.path.join(DEFAULT_PAIR_DIR, "target")
DRAFT = os.path.join(DEFAULT_PAIR_DIR, "draft")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(TARGET, "config.json")),
                                reason="the bundled default pair is not present")
PROMPT = [15, 687, 9, 280, 13, 292]


def _copy(src, dst, link_weights=True):
    os.makedirs(dst)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if name.endswith(".safetensors") and link_weights:
            os.symlink(s, d)
        else:
            shutil.copy(s, d)
    return str(dst)


def _edit(path, **kv):
    p = os.path.join(path, "config.json")
    with open(p, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(kv)
    with open(p, "w", encoding="utf-8") as f:
        json.dump(cfg, f)


# ----------------------------------------------------------------------------- threads


@pytest.mark.parametrize("n", [10 ** 6, 10 ** 12, -1])
def test_absurd_num_threads_is_an_error_and_harms_no_other_engine(n):
    healthy = dflash2_rt.Engine(method="ar", max_seq_len=128)
    want = healthy.generate([PROMPT], max_new_tokens=8)[0].token_ids
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="num_threads"):
        dflash2_rt.Engine(method="ar", max_seq_len=128, num_threads=n)
    assert healthy.generate([PROMPT], max_new_tokens=8)[0].token_ids == want


def test_num_threads_is_per_engine():
    before = dflash2_rt.build_info()["num_threads"]
    one = dflash2_rt.Engine(method="ar", max_seq_len=128, num_threads=1)
    other = dflash2_rt.Engine(method="ar", max_seq_len=128)
    assert one._e.num_threads == 1 and other._e.num_threads == 0
    a = one.generate([PROMPT], max_new_tokens=8)[0].token_ids
    # the process-wide / calling thread's setting is untouched by the engine's own
    assert dflash2_rt.build_info()["num_threads"] == before
    b = other.generate([PROMPT], max_new_tokens=8)[0].token_ids
    assert a == b  # the thread count never changes the numbers
    assert dflash2_rt.build_info()["num_threads"] == before


# ----------------------------------------------------------------------------- non-finite weights


def _poisoned_target(tmp_path, name, value, rows=None):
    """A copy of the bundled target with `value` written into tensor `name` (rows: which
    rows; None = all)."""
    import safetensors.numpy as stn
    import torch
    from safetensors.torch import load_file, save_file

    dst = _copy(TARGET, tmp_path / "poisoned", link_weights=False)
    f = os.path.join(dst, "model.safetensors")
    t = load_file(f)
    w = t[name].float()
    if rows is None:
        w[...] = value
    else:
        w[rows] = value
    t[name] = w.to(t[name].dtype)
    save_file(t, f, metadata={"format": "pt"})
    del stn, torch
    return dst


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("method", ["ar", "dflash2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_weights_raise_a_typed_error(tmp_path, value, method, temperature):
    pytest.importorskip("safetensors.torch")
    tgt = _poisoned_target(tmp_path, "model.norm.weight", value, rows=slice(0, 3))
    eng = dflash2_rt.Engine(target=tgt, draft=DRAFT if method != "ar" else None, method=method, max_seq_len=128)
    with pytest.raises(dflash2_rt.NumericalError, match=r"prompt 0: non-finite logits .* the prefill"):
        eng.generate([PROMPT], max_new_tokens=8, temperature=temperature, seed=0)
    assert isinstance(dflash2_rt.NumericalError("x"), ArithmeticError)


def test_non_finite_logits_in_a_decode_step_name_the_step_and_request(tmp_path):
    """An embedding row only one request's generated token reaches: the prefill is finite,
    the decode step that feeds the poisoned token raises naming its step and request."""
    pytest.importorskip("safetensors.torch")
    ar = dflash2_rt.Engine(method="ar", max_seq_len=128)
    other = [7, 8, 11, 12]
    toks = ar.generate([PROMPT], max_new_tokens=12)[0].token_ids
    # poison the embedding row of a generated token no prompt holds: the step that feeds it breaks
    bad = next(t for t in toks[1:] if t not in PROMPT and t not in other and t != toks[0])
    tgt = _poisoned_target(tmp_path, "model.embed_tokens.weight", float("nan"), rows=bad)
    eng = dflash2_rt.Engine(target=tgt, method="ar", max_seq_len=128)
    with pytest.raises(dflash2_rt.NumericalError, match=r"prompt 1: non-finite logits .* decode step \d+ \(request \d+, logits row \d+\)"):
        eng.generate([other, PROMPT], max_new_tokens=12, stop_token_ids=[])


# ----------------------------------------------------------------------------- max_seq_len, method


def test_max_seq_len_defaults_to_the_models_limit(tmp_path):
    small = _copy(TARGET, tmp_path / "small")
    _edit(small, max_position_embeddings=512)
    eng = dflash2_rt.Engine(target=small)
    assert eng.max_seq_len == 512
    assert eng.generate([PROMPT], max_new_tokens=4)[0].token_ids
    assert dflash2_rt.Engine(target=TARGET).max_seq_len == min(4096, json.load(
        open(os.path.join(TARGET, "config.json")))["max_position_embeddings"])
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="max_position_embeddings"):
        dflash2_rt.Engine(target=small, max_seq_len=1024)


def test_method_is_inferred_from_the_drafter(tmp_path):
    eng = dflash2_rt.Engine(target=TARGET, draft=DRAFT)
    assert eng.method == "dflash2"
    v1 = _copy(DRAFT, tmp_path / "v1")
    _edit(v1, architectures=["DFlashDraftModel"])
    assert dflash2_rt.Engine(target=TARGET, draft=v1).method == "dflash"
    assert dflash2_rt.Engine(target=TARGET).method == "ar"
    odd = _copy(DRAFT, tmp_path / "odd")
    _edit(odd, architectures=["LlamaForCausalLM"])
    with pytest.raises(dflash2_rt.ConfigError, match="architectures"):
        dflash2_rt.Engine(target=TARGET, draft=odd)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="method 'mtp' takes no drafter"):
        dflash2_rt.Engine(target=TARGET, draft=DRAFT, method="mtp")
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="takes no drafter"):
        dflash2_rt.Engine(target=TARGET, draft=DRAFT, method="ar")
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="unknown method"):
        dflash2_rt.Engine(target=TARGET, method="eagle")
    # the inferred engine is the explicit one
    a = eng.generate([PROMPT], max_new_tokens=12)[0].token_ids
    b = dflash2_rt.Engine(target=TARGET, draft=DRAFT, method="dflash2").generate([PROMPT], max_new_tokens=12)[0].token_ids
    assert a == b
    assert np.array_equal(a, dflash2_rt.Engine(method="ar").generate([PROMPT], max_new_tokens=12)[0].token_ids)


@pytest.mark.parametrize("method", ["ar", "mtp", "dflash", "dflash2"])
def test_tiny_max_step_tokens_chunks_everything_and_changes_nothing(method):
    """max_step_tokens smaller than a verify block and than the batch: the prefill, the
    verify pass, the drafter's context appends and the MTP chain all run in chunks; the
    tokens must be those of an unchunked engine (greedy and seeded sampling)."""
    prompts = [PROMPT, PROMPT[:3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [44, 45]]
    kw = dict(method=method, max_batch_size=4, max_seq_len=256)
    small = dflash2_rt.Engine(max_step_tokens=3, **kw)
    big = dflash2_rt.Engine(**kw)
    for sampling in (dict(), dict(temperature=1.0, top_p=0.9, seed=3)):
        a = [r.token_ids for r in small.generate(prompts, max_new_tokens=20, stop_token_ids=[], **sampling)]
        b = [r.token_ids for r in big.generate(prompts, max_new_tokens=20, stop_token_ids=[], **sampling)]
        assert a == b


def test_gpu_only_options_on_the_cpu():
    """cuda_graphs and prefill_gemm are accepted on the CPU and report what is in effect:
    no graphs, exact prefill (auto); a wrong type or value is a clear error."""
    eng = dflash2_rt.Engine(TARGET, DRAFT, max_batch_size=1, max_seq_len=64)
    assert eng.cuda_graphs is False and eng.prefill_gemm == "exact"
    m = eng.metrics()
    for k in ("cuda_graphs_captured", "cuda_graphs_replayed", "cuda_graphs_eager", "cuda_graphs_failed"):
        assert m[k] == 0, k
    assert m["cuda_graphs_last_failure"] == ""
    eng.close()
    eng = dflash2_rt.Engine(TARGET, DRAFT, max_batch_size=1, max_seq_len=64, cuda_graphs=False, prefill_gemm="bf16")
    assert eng.cuda_graphs is False and eng.prefill_gemm == "bf16"
    (r,) = eng.generate([PROMPT], max_new_tokens=4)
    assert len(r.token_ids) == 4
    eng.close()
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="cuda_graphs"):
        dflash2_rt.Engine(TARGET, DRAFT, cuda_graphs="yes")
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="prefill_gemm"):
        dflash2_rt.Engine(TARGET, DRAFT, prefill_gemm="BF16")


def test_steps_run_as_one_unit_where_they_can():
    """A decode step's draft (the DFlash block, or the MTP chain position by position),
    verify pass and acceptance are queued and run together (one CUDA graph on a GPU; in order
    here): every dflash2 / mtp / ar step of a small batch is one unit, a step whose verify pass
    might need several chunks runs piece by piece, and the tokens are the same either way
    (greedy and seeded sampling). The DFlash drafter appends the verified rows to its context
    inside the step (all of them; acceptance then sets the context's length)."""
    prompts = [PROMPT, [3, 14, 15, 92, 65]]
    for method in ("dflash2", "ar", "mtp"):
        for temperature in (0.0, 0.8):
            out, units = [], []
            for step_tokens in (256, 8):  # 8 < 2 sequences x a verify block
                eng = dflash2_rt.Engine(TARGET, DRAFT if method == "dflash2" else None, method=method,
                                        max_batch_size=2, max_seq_len=96, max_step_tokens=step_tokens)
                res = eng.generate(prompts, max_new_tokens=12, temperature=temperature, seed=5)
                out.append([r.token_ids for r in res])
                m = eng.metrics()
                units.append((m["steps_as_one_unit"], max(r.stats["verify_steps"] for r in res)))
                # the drafter's state update (the DFlash context append, the MTP layer over the
                # committed rows) ran inside every such step; ar has none
                assert m["drafter_appends_in_step"] == (m["steps_as_one_unit"] if method != "ar" else 0), m
                eng.close()
            assert out[0] == out[1], (method, temperature)
            (one, steps), (small, steps_small) = units
            assert steps >= 1, units
            assert one >= steps, (method, temperature, units)  # every step of the batch
            if method != "ar":  # steps with both sequences (2 x 8 tokens) are not queued (one alone fits)
                assert small < one, units
            else:  # ar: 2 x 1 token <= 8, every step still fits
                assert small >= steps_small, units


def test_steps_padded_to_batch_buckets():
    """pad_to_buckets pads a step run as one unit to the next batch-size bucket (3 sequences
    run as 4, ...) with padding sequences whose output is dropped: the tokens equal the
    unpadded engine's (greedy and seeded sampling, fixed and adaptive speculation, dflash2 /
    ar), padding is counted, and the padding stream's pages are not the requests' pages. MTP
    steps, whose chain writes each slot's MTP cache, are not padded."""
    prompts = [PROMPT, [3, 14, 15, 92, 65], [2, 7, 1, 8, 2, 8, 1, 8], [5, 5, 5]]
    cases = [("dflash2", 0.0, "fixed"), ("dflash2", 0.8, "fixed"), ("dflash2", 0.0, "adaptive"), ("ar", 0.7, "fixed"),
             ("mtp", 0.0, "fixed")]
    for method, temperature, spec in cases:
        out, pads, pages = [], [], []
        for pad in (False, True):
            eng = dflash2_rt.Engine(TARGET, DRAFT if method == "dflash2" else None, method=method, max_batch_size=5,
                                    max_seq_len=96, speculation=spec, pad_to_buckets=pad)
            assert eng.pad_to_buckets is pad
            # 3 sequences run as 4; then 4 (a bucket), shrinking as they end at different steps
            res = eng.generate(prompts[:3], max_new_tokens=20, temperature=temperature, seed=11, stop_token_ids=[])
            res += eng.generate(prompts, max_new_tokens=7, temperature=temperature, seed=12, stop_token_ids=[])
            out.append([r.token_ids for r in res])
            m = eng.metrics()
            pads.append(m["padding_rows"])
            pages.append((m["cache_pages_used"], m["cache_pages_total"]))
            eng.close()
        assert out[0] == out[1], (method, temperature, spec)
        assert pads[0] == 0, pads
        assert (pads[1] > 0) == (method != "mtp"), (method, pads)
        assert pages[0] == pages[1] and pages[0][0] == 0, pages
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="pad_to_buckets"):
        dflash2_rt.Engine(TARGET, DRAFT, pad_to_buckets="yes")
    eng = dflash2_rt.Engine(TARGET, DRAFT, max_batch_size=1, max_seq_len=64)
    assert eng.pad_to_buckets is False  # auto: on with CUDA graphs only
    eng.close()


def test_capture_at_load_leaves_no_trace():
    """capture_at_load runs a few decode steps of dummy requests at every batch-size bucket while
    loading (greedy and sampled; on a GPU they capture the step graphs): it leaves the requests'
    state as a fresh engine's -- no pages used, no request counted, the same tokens (greedy and
    seeded sampling) -- and only the step counters remember it. Off by default on the CPU."""
    prompts = [PROMPT, [3, 14, 15, 92, 65], [2, 7, 1, 8]]
    assert dflash2_rt.Engine(TARGET, DRAFT, max_batch_size=1, max_seq_len=64).capture_at_load is False
    for method in ("dflash2", "mtp", "ar"):
        out = []
        for capture in (True, False):
            eng = dflash2_rt.Engine(TARGET, DRAFT if method == "dflash2" else None, method=method, max_batch_size=3,
                                    max_seq_len=96, pad_to_buckets=True, capture_at_load=capture)
            assert eng.capture_at_load is capture
            m = eng.metrics()
            assert m["requests_total"] == 0 and m["running"] == 0 and m["cache_pages_used"] == 0, m
            assert (m["steps_as_one_unit"] > 0) == capture, (method, m)
            got = []
            for kw in (dict(), dict(temperature=0.9, seed=4)):
                got.append([r.token_ids for r in eng.generate(prompts, max_new_tokens=10, stop_token_ids=[], **kw)])
            out.append(got)
            eng.close()
        assert out[0] == out[1], method
    # adaptive speculation: every shorter draft length is warmed up too (more steps at load),
    # and the engine still generates as a fresh one
    loaded = {}
    for spec in ("fixed", "adaptive"):
        eng = dflash2_rt.Engine(TARGET, DRAFT, max_batch_size=3, max_seq_len=96, pad_to_buckets=True,
                                capture_at_load=True, speculation=spec)
        loaded[spec] = eng.metrics()["steps_as_one_unit"]
        assert eng.metrics()["cache_pages_used"] == 0
        got = [r.token_ids for r in eng.generate(prompts, max_new_tokens=10, stop_token_ids=[])]
        assert got == out[1][0], spec  # out: the last method's (ar) greedy tokens; lossless
        eng.close()
    assert loaded["adaptive"] > loaded["fixed"] > 0, loaded
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="capture_at_load"):
        dflash2_rt.Engine(TARGET, DRAFT, capture_at_load=1)
