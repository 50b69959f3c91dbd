"""The GLM-5.x target model (``dflash2_rt.Engine``, method "ar", CPU) against the
transformers oracle (``GlmMoeDsaForCausalLM`` in fp32, eager attention) on tiny random
checkpoints built by tests/glm_fixtures.py, and the MTP layer against tests/mtp_ref.py.

Logits are compared with max|d| <= 1e-4 * max|ref| + 1e-5 (the observed error is printed:
``pytest -rP tests/test_target.py``). Cache behaviour (decode == verify, rollback) is
compared bitwise.
"""
import json
import os
import re
import shutil
import tempfile

import numpy as np
import pytest

pytest.importorskip("transformers.models.glm_moe_dsa", reason="needs transformers>=5 with GlmMoeDsa")
pytest.importorskip("safetensors")
import torch  # noqa: E402

import dflash2_rt  # noqa: E402


def _engine_built() -> bool:
    try:
        dflash2_rt.Engine(target=os.path.join(tempfile.gettempdir(), "dflash2-no-such-checkpoint"), method="ar",
                          device="cpu")
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001  (a missing checkpoint: the engine exists)
        return True
    return True


if not _engine_built():
    pytest.skip("target model not built yet", allow_module_level=True)

import glm_fixtures as gf  # noqa: E402
from mtp_ref import MtpReference  # noqa: E402
from dflash2_rt.tools.quantize import dequantize_checkpoint, quantize_checkpoint  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
MAX_SEQ = 256
TOPK = gf.TINY_CONFIG["index_topk"]  # 8
VOCAB = gf.TINY_CONFIG["vocab_size"]


def assert_close(got, ref, what):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{what}: NaN/Inf"
    err = float(np.abs(got.astype(np.float64) - ref).max())
    scale = float(np.abs(ref).max())
    print(f"{what}: max|d| = {err:.3e}  max|ref| = {scale:.3e}  rel = {err / max(scale, 1e-30):.2e}")
    assert err <= RTOL * scale + ATOL, f"{what}: max|d| = {err:.3e} > {RTOL} * {scale:.3e} + {ATOL}"


class Zoo:
    """Checkpoints, engines and HF oracles, built once per module on first use."""

    def __init__(self, root):
        self.root = root
        self.paths, self.engines, self.hfs = {}, {}, {}

    def path(self, name, variant=None, **opts):
        if name not in self.paths:
            self.paths[name] = gf.build_model(os.path.join(self.root, name), variant or name, **opts)
        return self.paths[name]

    def engine(self, name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in self.engines:
            self.engines[key] = dflash2_rt.Engine(target=self.path(name), method="ar", device="cpu", max_batch_size=4,
                                                  max_seq_len=MAX_SEQ, **kw)
        return self.engines[key]

    def hf(self, name):
        if name not in self.hfs:
            self.hfs[name] = gf.load_hf(self.path(name))
        return self.hfs[name]


@pytest.fixture(scope="module", autouse=True)
def _torch_one_thread():
    """The HF oracle on tiny models is fastest single-threaded (and leaves the cores to the engine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(str(tmp_path_factory.mktemp("glm")))


def release(*seqs):
    """Frees sequences (seq.release() is tested on its own in test_sequence_release)."""
    for s in seqs:
        if hasattr(s, "release"):
            s.release()


def gen1(eng, p, n, **kw):
    kw.setdefault("stop_token_ids", [])
    (r,) = eng.generate([p], max_new_tokens=n, **kw)
    return r


# ---------------------------------------------------------------------------- logits


def test_config(zoo):
    cfg = zoo.engine("tiny").config
    assert cfg["model_type"] == "glm_moe_dsa"
    assert cfg["vocab_size"] == VOCAB and cfg["num_hidden_layers"] == 4


@pytest.mark.parametrize("variant", list(gf.VARIANTS))
def test_logits_match_transformers(zoo, variant):
    """Teacher-forced logits, prompts shorter than, at and longer than index_topk."""
    eng, hf = zoo.engine(variant), zoo.hf(variant)
    for n in (1, TOPK - 1, TOPK + 1, 40):
        ids = gf.prompt(n, n)
        assert_close(eng.logits(ids), gf.hf_logits(hf, ids), f"{variant} n={n}")


def test_fixtures_exercise_what_they_claim(zoo):
    """Guards on the fixtures themselves (HF only), so the logits tests above test what
    they claim: with index_topk = 8 the sparse selection changes the logits of a 40-token
    prompt a lot; the IndexShare and n_group variants (same weights as "tiny") change them
    too."""
    ids = gf.prompt(40, 40)
    ref = gf.hf_logits(zoo.hf("tiny"), ids)
    scale = np.abs(ref).max()
    dense = gf.load_hf(zoo.path("tiny"))
    for layer in dense.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = 10 ** 6
    assert np.abs(gf.hf_logits(dense, ids) - ref).max() > 0.1 * scale
    for variant in ("indexshare_list", "indexshare_pattern", "ngroup"):
        assert np.abs(gf.hf_logits(zoo.hf(variant), ids) - ref).max() > 0.05 * scale, variant


def test_hidden_states(zoo):
    """seq.extend(..., hidden_layers) returns the residual stream after each requested
    decoder layer: HF output_hidden_states[id + 1] for id < L-1. For the last layer
    transformers returns the state *after* model.norm in hidden_states[L]; the runtime
    returns the decoder layer's output (before model.norm), compared with a hook here."""
    eng, hf = zoo.engine("tiny"), zoo.hf("tiny")
    L = hf.config.num_hidden_layers
    ids = gf.prompt(20, 20)
    hs = gf.hf_hidden_states(hf, ids)
    captured = {}
    h = hf.model.layers[L - 1].register_forward_hook(lambda m, a, o: captured.__setitem__("last", o[0]))
    try:
        gf.hf_logits(hf, ids)
    finally:
        h.remove()
    seq = eng.new_sequence()
    try:
        logits, hidden = seq.extend(ids, hidden_layers=tuple(range(L)))
        assert sorted(hidden) == list(range(L))
        for i in range(L - 1):
            assert_close(hidden[i], hs[i + 1], f"hidden after layer {i}")
        assert_close(hidden[L - 1], captured["last"][0].numpy(), f"hidden after layer {L - 1} (pre-norm)")
        assert_close(logits, gf.hf_logits(hf, ids), "extend logits")
        assert seq.length == len(ids)
        _, none = seq.extend(gf.prompt(21, 3))
        assert none == {}
    finally:
        release(seq)


# ---------------------------------------------------------------------------- generation


@pytest.mark.parametrize("variant", ["tiny", "indexshare_freq"])
def test_greedy_matches_transformers_generate(zoo, variant):
    eng, hf = zoo.engine(variant), zoo.hf(variant)
    n_new = 12
    for i, plen in enumerate((3, 10, 25)):
        p = gf.prompt(50 + i, plen)
        ref, margins = gf.hf_greedy(hf, p, n_new)
        r = gen1(eng, p, n_new, temperature=0.0)
        if r.token_ids != ref:
            j = next(k for k, (a, b) in enumerate(zip(r.token_ids, ref)) if a != b)
            pytest.fail(f"{variant} prompt {i}: token {j} differs ({r.token_ids[j]} vs HF {ref[j]}); HF top1-top2 "
                        f"margin there = {margins[j]:.2e}\nours {r.token_ids}\nHF   {ref}")
        assert r.finish_reason == "length"
        assert isinstance(r.stats, dict)


def test_batch_equals_each_prompt_alone(zoo):
    eng = zoo.engine("tiny")
    prompts = [gf.prompt(60 + i, n) for i, n in enumerate((3, 11, 6, 20))]
    alone = [gen1(eng, p, 10) for p in prompts]
    batch = eng.generate(prompts, max_new_tokens=10, stop_token_ids=[])
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    # ragged finishing: a stop token that ends some sequences early
    stop = [alone[0].token_ids[3]]
    alone_s = [gen1(eng, p, 10, stop_token_ids=stop) for p in prompts]
    batch_s = eng.generate(prompts, max_new_tokens=10, stop_token_ids=stop)
    assert [(r.token_ids, r.finish_reason) for r in batch_s] == [(r.token_ids, r.finish_reason) for r in alone_s]
    assert batch_s[0].finish_reason == "stop"


def test_stop_tokens_and_finish_reason(zoo, tmp_path):
    eng = zoo.engine("tiny")
    p = gf.prompt(70, 7)
    full = gen1(eng, p, 10)
    assert len(full.token_ids) == 10 and full.finish_reason == "length"
    s = full.token_ids[4]
    cut = full.token_ids.index(s) + 1
    r = gen1(eng, p, 10, stop_token_ids=[s, VOCAB - 1])
    assert r.token_ids == full.token_ids[:cut] and r.finish_reason == "stop"
    # stop_token_ids=None: the config's eos_token_id (same weights, eos set to that token)
    path = gf.build_model(tmp_path / "eos", "tiny", config={"eos_token_id": [s, VOCAB - 1]})
    eng2 = dflash2_rt.Engine(target=path, method="ar", device="cpu", max_batch_size=4, max_seq_len=MAX_SEQ)
    (r2,) = eng2.generate([p], max_new_tokens=10)
    assert r2.token_ids == full.token_ids[:cut] and r2.finish_reason == "stop"
    (r3,) = eng2.generate([p], max_new_tokens=10, stop_token_ids=[])
    assert r3.token_ids == full.token_ids


def test_sampling_limits_and_seed(zoo):
    eng = zoo.engine("tiny")
    p = gf.prompt(80, 9)
    greedy = gen1(eng, p, 8).token_ids
    assert gen1(eng, p, 8, temperature=0.8, top_k=1, seed=3).token_ids == greedy
    assert gen1(eng, p, 8, temperature=0.8, top_p=1e-6, seed=3).token_ids == greedy
    a = gen1(eng, p, 8, temperature=1.0, seed=11).token_ids
    assert gen1(eng, p, 8, temperature=1.0, seed=11).token_ids == a
    assert all(0 <= t < VOCAB for t in a)


# ---------------------------------------------------------------------------- cache


@pytest.mark.parametrize("variant", ["tiny", "indexshare_freq", "bf16"])
def test_decode_equals_verify_bitwise(zoo, variant):
    """B tokens one at a time give bitwise the logits of the same B tokens in one call
    (crossing index_topk, so the sparse selection is active in both)."""
    eng = zoo.engine(variant)
    p, d = gf.prompt(90, 5), gf.prompt(91, 7)
    s1, s2 = eng.new_sequence(), eng.new_sequence()
    try:
        s1.extend(p)
        s2.extend(p)
        one = np.concatenate([s1.extend([t])[0] for t in d])
        many, _ = s2.extend(d)
        assert np.array_equal(one, many), f"max|d| = {np.abs(one - many).max():.3e}"
        assert s1.length == s2.length == len(p) + len(d)
        assert_close(many, gf.hf_logits(zoo.hf(variant), p + d)[len(p):], f"{variant} verify vs HF")
    finally:
        release(s1, s2)


def test_rollback_equals_straight_decoding_bitwise(zoo):
    eng, hf = zoo.engine("tiny"), zoo.hf("tiny")
    p, d, e = gf.prompt(100, 6), gf.prompt(101, 6), gf.prompt(102, 5)
    k = 2
    a, b = eng.new_sequence(), eng.new_sequence()
    try:
        a.extend(p)
        a.extend(d)  # B = 6 draft tokens, positions 6..11 (past index_topk)
        a.rollback(len(p) + k)
        assert a.length == len(p) + k
        la, _ = a.extend(e)
        la2, _ = a.extend([7])
        b.extend(p)
        b.extend(d[:k])
        lb, _ = b.extend(e)
        lb2, _ = b.extend([7])
        assert np.array_equal(la, lb), f"after rollback: max|d| = {np.abs(la - lb).max():.3e}"
        assert np.array_equal(la2, lb2)
        ref = gf.hf_logits(hf, p + d[:k] + e + [7])
        assert_close(np.concatenate([la, la2]), ref[len(p) + k:], "after rollback vs HF")
        # rolling back into the prompt and extending again
        a.rollback(3)
        assert a.length == 3
        lc, _ = a.extend(p[3:] + d[:k])
        assert_close(lc, ref[3:len(p) + k], "rollback into the prompt vs HF")
    finally:
        release(a, b)


def test_sequence_release(zoo):
    """seq.release() frees a sequence's caches: creating and releasing many more sequences
    than max_batch_size, each with a long prompt, keeps working."""
    eng = zoo.engine("tiny")
    p = gf.prompt(105, 200)
    first = None
    for _ in range(12):
        seq = eng.new_sequence()
        logits, _ = seq.extend(p)
        if first is None:
            first = logits[-1].copy()
        assert np.array_equal(logits[-1], first)
        seq.release()


# ---------------------------------------------------------------------------- MTP


def _check_mtp(eng, ref, hf, ids, what):
    """MTP logits for (h_main at t, token t+1), fed in chunks of 12, 1 and the rest."""
    h_main = gf.hf_final_hidden(hf, ids)
    nxt = ids[1:] + [int(gf.hf_logits(hf, ids)[-1].argmax())]
    seq = eng.new_sequence()
    try:
        seq.extend(ids)
        for a, b in ((0, 12), (12, 13), (13, len(ids))):
            got = seq.mtp_extend(nxt[a:b], h_main[a:b])
            assert_close(got, ref.step(nxt[a:b], h_main[a:b]), f"{what} rows {a}:{b}")
    finally:
        release(seq)


def test_mtp_matches_reference(zoo):
    eng = zoo.engine("tiny")
    assert eng.has_mtp
    _check_mtp(eng, MtpReference(zoo.path("tiny")), zoo.hf("tiny"), gf.prompt(110, 20), "mtp")


def test_mtp_uses_its_own_embedding_and_head_when_stored(zoo):
    path = zoo.path("tiny_mtp_head", "tiny", mtp_own_head=True)
    eng = dflash2_rt.Engine(target=path, method="ar", device="cpu", max_batch_size=4, max_seq_len=MAX_SEQ)
    _check_mtp(eng, MtpReference(path), zoo.hf("tiny"), gf.prompt(111, 16), "mtp own head")


# ---------------------------------------------------------------------------- quantized


@pytest.mark.parametrize("fmt,scope", [("fp8", None), ("nvfp4", "experts"), ("nvfp4", "mlp")])
def test_quantized_matches_transformers_on_dequantized_weights(zoo, tmp_path, fmt, scope):
    dst = str(tmp_path / f"{fmt}-{scope}")
    quantize_checkpoint(zoo.path("tiny"), dst, fmt, scope or "experts")
    deq = dequantize_checkpoint(dst)
    hf = gf.hf_from_tensors(dst, deq)
    eng = dflash2_rt.Engine(target=dst, method="ar", device="cpu", max_batch_size=4, max_seq_len=MAX_SEQ)
    for n in (TOPK - 1, 30):
        ids = gf.prompt(120 + n, n)
        assert_close(eng.logits(ids), gf.hf_logits(hf, ids), f"{fmt}/{scope} n={n}")
    p = gf.prompt(130, 6)
    ref, _ = gf.hf_greedy(hf, p, 6)
    assert gen1(eng, p, 6).token_ids == ref
    _check_mtp(eng, MtpReference(dst, tensors=deq), hf, gf.prompt(131, 14), f"{fmt}/{scope} mtp")


# ---------------------------------------------------------------------------- errors


def _rewrite(path, drop=(), replace=None):
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    for n in drop:
        del t[n]
    t.update(replace or {})
    save_file(t, f, metadata={"format": "pt"})


def _edit_config(path, fn):
    cp = os.path.join(path, "config.json")
    with open(cp) as f:
        d = json.load(f)
    fn(d)
    with open(cp, "w") as f:
        json.dump(d, f)


def _copy(zoo, tmp_path, name):
    dst = str(tmp_path / name)
    shutil.copytree(zoo.path("tiny"), dst)
    return dst


def _engine(path):
    return dflash2_rt.Engine(target=path, method="ar", device="cpu", max_batch_size=4, max_seq_len=MAX_SEQ)


def test_missing_tensor_is_a_checkpoint_error(zoo, tmp_path):
    path = _copy(zoo, tmp_path, "missing")
    _rewrite(path, drop=["model.layers.2.self_attn.kv_b_proj.weight", "model.norm.weight"])
    with pytest.raises(dflash2_rt.CheckpointError) as ei:
        _engine(path)
    msg = str(ei.value)
    assert "model.layers.2.self_attn.kv_b_proj.weight" in msg and "model.norm.weight" in msg, msg


def test_wrong_shape_is_a_checkpoint_error(zoo, tmp_path):
    path = _copy(zoo, tmp_path, "shape")
    _rewrite(path, replace={"model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 60)})
    with pytest.raises(dflash2_rt.CheckpointError) as ei:
        _engine(path)
    msg = str(ei.value)
    assert "model.layers.1.self_attn.o_proj" in msg and re.search(r"64, ?64", msg) and re.search(r"64, ?60", msg), msg


@pytest.mark.parametrize("edit,pattern", [
    (lambda d: d.update(model_type="llama"), "model_type"),
    (lambda d: d.update(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 256}), "rope_type"),
    (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
], ids=["model_type", "rope_type", "hidden_act"])
def test_unsupported_config_is_a_config_error(zoo, tmp_path, edit, pattern):
    path = _copy(zoo, tmp_path, "cfg")
    _edit_config(path, edit)
    with pytest.raises(dflash2_rt.ConfigError, match=pattern):
        _engine(path)


def test_bad_arguments_are_invalid_argument_errors(zoo):
    eng = zoo.engine("tiny")
    E = dflash2_rt.InvalidArgumentError
    ok = [1, 2, 3]
    with pytest.raises(E, match="max_seq_len"):
        eng.generate([list(range(MAX_SEQ + 10))], max_new_tokens=1)
    with pytest.raises(E, match="vocab"):
        eng.generate([[1, VOCAB]], max_new_tokens=1)
    with pytest.raises(E, match="vocab"):
        eng.generate([[1, -1]], max_new_tokens=1)
    with pytest.raises(E, match="vocab"):
        eng.logits([VOCAB + 5])
    with pytest.raises(E, match="empty"):
        eng.generate([ok, []], max_new_tokens=1)
    with pytest.raises(E, match="max_new_tokens"):
        eng.generate([ok], max_new_tokens=0)
    with pytest.raises(E, match="max_new_tokens"):
        eng.generate([ok], max_new_tokens=-3)
    with pytest.raises(E, match="temperature"):
        eng.generate([ok], max_new_tokens=1, temperature=-0.5)
    with pytest.raises(E, match="top_p"):
        eng.generate([ok], max_new_tokens=1, top_p=0.0)
    with pytest.raises(E, match="top_p"):
        eng.generate([ok], max_new_tokens=1, top_p=1.5)
    # the engine is still usable afterwards
    assert len(gen1(eng, ok, 2).token_ids) == 2


# ---------------------------------------------------------------------------- cache pages and chunking


def test_sequences_ending_on_page_boundaries(zoo):
    """Pitfall (DSA indexer table off by one): lengths that end exactly on a KV page, then
    decoding across it, equal transformers."""
    eng, hf = zoo.engine("tiny", kv_block_size=4), zoo.hf("tiny")
    for n in (4, 8, 12):
        ids = gf.prompt(n + 3, n)
        seq = eng.new_sequence()
        lg, _ = seq.extend(ids[:n])
        rows = [lg] + [seq.extend([t])[0] for t in ids[n:]]
        release(seq)
        assert_close(np.concatenate(rows), gf.hf_logits(hf, ids), f"page boundary n={n}")


def test_chunked_prefill_equals_one_pass_bitwise(zoo):
    """Prefill longer than max_step_tokens is chunked; every row is computed alone, so the
    chunked logits equal the single-pass ones bit for bit."""
    ids = gf.prompt(41, 7)
    one = zoo.engine("tiny").logits(ids)
    chunked = zoo.engine("tiny", max_step_tokens=5).logits(ids)
    assert np.array_equal(one, chunked)


def test_other_threads_may_run_wider_than_the_loader(zoo):
    """Regression: an engine loaded while this thread's OpenMP width was 1 (e.g. after
    torch.set_num_threads(1)) must stay correct when a thread with the default width (the
    one behind Engine.stream) runs it: per-thread scratch is sized for every core."""
    before = dflash2_rt.build_info()["num_threads"]
    dflash2_rt._core.set_num_threads(1)
    try:
        eng = dflash2_rt.Engine(target=zoo.path("tiny"), max_seq_len=MAX_SEQ, max_batch_size=1)
        p = gf.prompt(30, 3)
        want = gen1(eng, p, 12).token_ids
        got = list(eng.stream(p, max_new_tokens=12, stop_token_ids=[]))
    finally:
        dflash2_rt._core.set_num_threads(before)
    assert got == list(want)
