"""Tensor parallelism (``Engine(tensor_parallel=N)``) on the CPU: N rank models on N
threads of one process, joined by the in-process communicator (cpp/src/comm/cpu_comm.cpp).

A TP=N engine computes the same function as TP=1 with the sums split differently: each
rank holds 1/N of the attention heads, of the dense and shared MLP intermediate, of the
vocabulary (embedding and LM head) and 1/N of the routed experts (expert parallelism),
and the partial outputs are summed in rank order. So logits agree with TP=1 to a few ulps
of fp32 (bounded here by 1e-5 of the logit scale) and everything that follows from the
logits (greedy tokens, seeded samples, speculative acceptance) is the same unless a
near-tie sits exactly at that scale; where a token differs the test checks that the TP=1
top-2 margin there was below the bound, and fails otherwise.

Shard-shape errors: sizes that N does not divide and quantized slices that break a block
(FP8: 128, NVFP4: 16) are ConfigErrors that name the field; tensor_parallel outside [1, 64]
is an InvalidArgumentError.
"""
import os

import numpy as np
import pytest

pytest.importorskip("transformers.models.glm_moe_dsa", reason="needs transformers>=5 with GlmMoeDsa")
pytest.importorskip("safetensors")
import torch  # noqa: E402,F401

import compare  # noqa: E402
import dflash2_rt  # noqa: E402
import dflash_fixtures as F  # noqa: E402
import glm_fixtures as gf  # noqa: E402
from dflash2_rt.tools.quantize import quantize_checkpoint  # noqa: E402

REL = 1e-5  # |logits(TP=N) - logits(TP=1)| <= REL * max|logits| (observed: ~3e-7)
NO_STOP = []


class Zoo:
    def __init__(self, root):
        self.root, self.paths, self.engines = root, {}, {}

    def path(self, name, variant=None, **opts):
        if name not in self.paths:
            self.paths[name] = gf.build_model(os.path.join(self.root, name), variant or name, **opts)
        return self.paths[name]

    def engine(self, name, tp, method="ar", **kw):
        key = (name, tp, method, tuple(sorted(kw.items())))
        if key not in self.engines:
            self.engines[key] = dflash2_rt.Engine(target=self.path(name), method=method, device="cpu",
                                                  max_batch_size=4, max_seq_len=256, tensor_parallel=tp, **kw)
        return self.engines[key]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(str(tmp_path_factory.mktemp("tp")))


def close(got, ref, what, rel=REL):
    compare.close(got, ref, what, rel)


def same_tokens(ref_engine, prompt, got, want, what, rel=REL):
    compare.same_tokens(ref_engine, prompt, got, want, what, rel)


# ---------------------------------------------------------------------------- logits


@pytest.mark.parametrize("ep", [False, True], ids=["experts-split", "expert-parallel"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", ["tiny", "bf16", "ngroup", "indexshare_list"])
def test_logits_equal_tp1(zoo, variant, tp, ep):
    one, eng = zoo.engine(variant, 1), zoo.engine(variant, tp, expert_parallel=ep)
    assert eng.tensor_parallel == tp and one.tensor_parallel == 1 and eng.expert_parallel == ep
    for n in (1, 9, 40):  # below and above index_topk = 8: sparse attention on every rank
        ids = gf.prompt(200 + n, n)
        close(eng.logits(ids), one.logits(ids), f"{variant} TP={tp} ep={ep} n={n}")


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_kv_cache_dtype_at_tp(zoo, kv):
    """kv_cache_dtype="bf16" / "fp8" under tensor parallelism: every rank keeps its own copy of
    the latent and index-key caches in that form (BF16 rows, or FP8 rows: cpp/src/ops/kv_fp8.h),
    so TP=2 and TP=4 give TP=1's logits under the same cache type, and MTP at TP=2 equals
    TP=1's AR token for token where the margins allow. The tolerance is the cache's rounding: the
    ranks' all-reduced sums differ from TP=1's in the last bits, and a latent value that lands on
    the other side of a BF16 / E4M3 rounding point moves a logit by up to 2^-9 / 2^-4 of that
    value's share (a wrong row layout moves them by O(1))."""
    rel = {"bf16": 1e-3, "fp8": 1e-2}[kv]
    one = zoo.engine("tiny", 1, kv_cache_dtype=kv)
    for tp in (2, 4):
        eng = zoo.engine("tiny", tp, kv_cache_dtype=kv)
        assert eng.kv_cache_dtype == kv
        for n in (1, 40):
            ids = gf.prompt(220 + n, n)
            close(eng.logits(ids), one.logits(ids), f"kv {kv} TP={tp} n={n}", rel=rel)
    mtp = zoo.engine("tiny", 2, method="mtp", kv_cache_dtype=kv)
    p = gf.prompt(330, 12)
    (want,) = one.generate([p], max_new_tokens=16, stop_token_ids=NO_STOP)
    (got,) = mtp.generate([p], max_new_tokens=16, stop_token_ids=NO_STOP)
    same_tokens(one, p, got.token_ids, want.token_ids, f"mtp TP=2 kv {kv}", rel=rel)


def test_tp_engine_matches_transformers(zoo):
    """Not only equal to TP=1: equal to the oracle (so TP=1 and TP=N are not wrong together)."""
    hf = gf.load_hf(zoo.path("tiny"))
    ids = gf.prompt(7, 30)
    ref = gf.hf_logits(hf, ids)
    got = np.asarray(zoo.engine("tiny", 4).logits(ids), np.float64)
    err = float(np.abs(got - ref).max())
    assert err <= 1e-4 * float(np.abs(ref).max()) + 1e-5


@pytest.mark.parametrize("ep", [False, True], ids=["experts-split", "expert-parallel"])
def test_mtp_layer_sharded(zoo, ep):
    """The MTP layer is split like the others: MTP speculative greedy at TP=2 equals TP=1 AR."""
    one = zoo.engine("tiny", 1)
    eng = zoo.engine("tiny", 2, method="mtp", expert_parallel=ep)
    for i, plen in enumerate((3, 12, 25)):
        p = gf.prompt(300 + i, plen)
        (want,) = one.generate([p], max_new_tokens=16, stop_token_ids=NO_STOP)
        (got,) = eng.generate([p], max_new_tokens=16, stop_token_ids=NO_STOP)
        same_tokens(one, p, got.token_ids, want.token_ids, f"mtp TP=2 prompt {i}")
        assert got.stats["verify_steps"] >= 1


# ---------------------------------------------------------------------------- generation


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_and_batch_equal_tp1(zoo, tp):
    one, eng = zoo.engine("tiny", 1), zoo.engine("tiny", tp)
    prompts = [gf.prompt(400 + i, n) for i, n in enumerate((3, 11, 6, 20))]
    want = one.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    got = eng.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(one, prompts[i], g.token_ids, w.token_ids, f"TP={tp} prompt {i}")
        assert g.finish_reason == "length"
    assert eng.metrics()["argmax_gather_steps"] > 0  # greedy: argmax pairs gathered, not logits


def test_greedy_steps_gather_argmax_pairs_not_logits(zoo):
    """Tensor parallelism with every request greedy: a decode step's verify pass gathers each
    rank's (max, id) pair per row (N x R x 2 floats), not the logits (R x V); a step with a
    sampled request gathers the logits. The tokens are TP=1's either way (above), and the
    argmax over the shards' pairs is the argmax over the gathered logits exactly."""
    V = gf.TINY_CONFIG["vocab_size"]
    for tp in (2, 4):
        eng = zoo.engine("tiny", tp)
        p = gf.prompt(610, 5)
        c0, m0 = eng.tp_collectives(), eng.metrics()["argmax_gather_steps"]
        (r,) = eng.generate([p], max_new_tokens=9, stop_token_ids=NO_STOP)
        c1, m1 = eng.tp_collectives(), eng.metrics()["argmax_gather_steps"]
        assert len(r.token_ids) == 9 and m1 - m0 == 8  # the prompt's logits give token 1; 8 decode steps
        assert c1["all_gather_calls"] - c0["all_gather_calls"] == 1 + 8
        # the prompt chunk's one logits row (V floats), then 8 steps of tp pairs of one row
        assert c1["all_gather_bytes"] - c0["all_gather_bytes"] == V * 4 + 8 * tp * 2 * 4
        (s,) = eng.generate([p], max_new_tokens=9, temperature=1.0, seed=1, stop_token_ids=NO_STOP)
        c2, m2 = eng.tp_collectives(), eng.metrics()["argmax_gather_steps"]
        assert m2 == m1 and c2["all_gather_bytes"] - c1["all_gather_bytes"] == 9 * V * 4  # sampled: the logits


@pytest.mark.parametrize("option", ["prefill_gemm", "decode_gemm"])
def test_bf16_gemm_at_tp(zoo, option):
    """prefill_gemm / decode_gemm = "bf16" with tensor parallelism: every rank runs the
    chunks' projections on the BF16 numerics (the chunk's flags reach each rank), so TP=2 and
    4 give TP=1's bf16 tokens, not a mix of bf16 and exact shards."""
    prompts = [gf.prompt(420 + i, n) for i, n in enumerate((3, 11, 6, 20, 9, 15, 4, 25))]
    kw = dict(max_new_tokens=24, stop_token_ids=NO_STOP)
    one = zoo.engine("tiny", 1, **{option: "bf16"})
    want = [list(r.token_ids) for p in (prompts[:4], prompts[4:]) for r in one.generate(p, **kw)]
    exact = [list(r.token_ids) for p in (prompts[:4], prompts[4:]) for r in zoo.engine("tiny", 1).generate(p, **kw)]
    assert want != exact, f"{option}='bf16' changed no continuation: the test would not tell the numerics apart"
    for tp in (2, 4):
        eng = zoo.engine("tiny", tp, **{option: "bf16"})
        assert getattr(eng, option) == "bf16"
        got = [list(r.token_ids) for p in (prompts[:4], prompts[4:]) for r in eng.generate(p, **kw)]
        for i, (g, w) in enumerate(zip(got, want)):
            same_tokens(one, prompts[i], g, w, f"TP={tp} {option}=bf16, prompt {i}")


def test_seeded_sampling_equal_tp1(zoo):
    """Sampling draws its uniforms from (seed, request, position) only, so a seeded TP=2 run
    reproduces TP=1 exactly (its probabilities differ by ~1e-7, which moves a sample only if
    a uniform lands within that distance of a bucket edge)."""
    one, eng = zoo.engine("tiny", 1), zoo.engine("tiny", 2)
    prompts = [gf.prompt(500 + i, 5 + i) for i in range(3)]
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.95, stop_token_ids=NO_STOP)
    for seed in (1, 2):
        a = [r.token_ids for r in one.generate(prompts, seed=seed, **kw)]
        b = [r.token_ids for r in eng.generate(prompts, seed=seed, **kw)]
        assert a == b
    a = [r.token_ids for r in zoo.engine("tiny", 1, method="mtp").generate(prompts, seed=3, **kw)]
    b = [r.token_ids for r in zoo.engine("tiny", 2, method="mtp").generate(prompts, seed=3, **kw)]
    assert a == b


def test_submit_poll_and_stream_at_tp2(zoo):
    eng, one = zoo.engine("tiny", 2), zoo.engine("tiny", 1)
    p = gf.prompt(600, 7)
    (want,) = one.generate([p], max_new_tokens=10, stop_token_ids=NO_STOP)
    assert list(eng.stream(p, max_new_tokens=10, stop_token_ids=NO_STOP)) == list(want.token_ids)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return F.make_self_drafting_pair(tmp_path_factory.mktemp("pair"))


@pytest.mark.parametrize("tp", [2, 4])
def test_dflash2_pair_at_tp(pair, tp):
    """DFlash 2 over a sharded target (the drafter runs on rank 0 and reads the reduced
    target features): the hand-built pair's exact output and accepted counts; its greedy
    steps gather argmax pairs, not logits."""
    eng = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", device="cpu",
                            max_batch_size=4, max_seq_len=256, tensor_parallel=tp)
    prompts = [[int(x)] * 3 for x in (5, 40, 77)]
    got = eng.generate(prompts, max_new_tokens=41, stop_token_ids=NO_STOP)
    for pr, r in zip(prompts, got):
        exp = pair.expected_greedy(pr, 41)
        assert list(r.token_ids) == exp["tokens"]
        assert r.stats["verify_steps"] == exp["steps"]
    assert eng.metrics()["argmax_gather_steps"] > 0


@pytest.fixture(scope="module")
def drafters(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    d2 = F.make_dflash2_drafter(zoo.path("tiny"), str(root / "d2"))
    return {"dflash2": d2, "dflash": F.dflash1_from_dflash2(d2, str(root / "d1"))}


@pytest.mark.parametrize("tp", [2, 4])
def test_drafter_head_on_vocabulary_shards(zoo, drafters, tp):
    """Under tensor parallelism the DFlash drafter's LM head runs on the target's vocabulary
    shards (Target::vocab_head): each rank's top 16 of its shard (DFlash 1: its argmax pair),
    gathered and merged on rank 0, is the full head's top 16 (argmax) -- so propose() gives
    TP=1's anchor, drafts and candidates in their order, and a draft gathers N x 7 rows x 2k
    floats, never the block's logits. Seeded sampling through the selector equals TP=1's."""
    V = 256
    for method, k in (("dflash2", 16), ("dflash", 1)):
        kw = dict(target=zoo.path("tiny"), draft=drafters[method], method=method, device="cpu", max_batch_size=4,
                  max_seq_len=256)
        one, eng = dflash2_rt.Engine(**kw), dflash2_rt.Engine(tensor_parallel=tp, **kw)
        for n in (3, 9):
            ids = gf.prompt(910 + n, n)
            want = one.propose(ids)
            c0 = eng.tp_collectives()
            got = eng.propose(ids)
            c1 = eng.tp_collectives()
            assert got.anchor == want.anchor and list(got.tokens) == list(want.tokens), (method, tp, n)
            assert np.array_equal(np.asarray(got.candidates), np.asarray(want.candidates)), (method, tp, n)
            # the prompt's last row of logits (the anchor), then the draft's shards' pairs
            assert c1["all_gather_calls"] - c0["all_gather_calls"] == 2, (c0, c1)
            assert c1["all_gather_bytes"] - c0["all_gather_bytes"] == V * 4 + tp * 7 * 2 * k * 4, (c0, c1)
        assert eng.metrics()["draft_head_gathers"] == 2 and one.metrics()["draft_head_gathers"] == 0
        prompts = [gf.prompt(930 + i, 4 + 3 * i) for i in range(3)]
        sk = dict(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=4, stop_token_ids=NO_STOP)
        a = [list(r.token_ids) for r in one.generate(prompts, **sk)]
        b = [list(r.token_ids) for r in eng.generate(prompts, **sk)]
        assert a == b, (method, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_steps_run_as_one_unit(zoo, drafters, tp):
    """Under tensor parallelism a decode step runs as one unit of every rank (on GPUs: every
    rank's step one CUDA graph; here: every rank's part queued and run together on its
    thread), and the DFlash drafter is split across the ranks: every rank runs its share of
    the draft forward (its heads and MLP slice; 1 + 2 x layers all-reduces), its vocabulary
    shard of the LM head and its part of the verify chunk and of the context append; rank 0
    the selector, the check and acceptance. Nothing but collectives orders the ranks within
    the step, so rank 0's context features [rows, H] and drafts [max_batch_size + 1, 7] reach
    the others by two broadcasts per step (AR: none). Tokens equal TP 1's -- greedy, seeded
    sampling, padded to batch-size buckets or not -- and the context append ran inside every
    such step."""
    H, L = gf.TINY_CONFIG["hidden_size"], gf.TINY_CONFIG["num_hidden_layers"]
    Ld = 2  # the fixture drafters' layers
    prompts = [gf.prompt(950 + i, 3 + 4 * i) for i in range(3)]
    for method in ("dflash2", "ar"):
        kw = dict(target=zoo.path("tiny"), draft=drafters.get(method), method=method, device="cpu", max_batch_size=4,
                  max_seq_len=256)
        one = dflash2_rt.Engine(**kw)
        for pad in (False, True):
            eng = dflash2_rt.Engine(tensor_parallel=tp, pad_to_buckets=pad, **kw)
            assert eng.pad_to_buckets is pad and eng.draft_ranks == (tp if method == "dflash2" else 0)
            for sk in (dict(), dict(temperature=1.0, top_p=0.95, seed=8)):
                want = one.generate(prompts, max_new_tokens=15, stop_token_ids=NO_STOP, **sk)
                c0, m0 = eng.tp_collectives(), eng.metrics()
                got = eng.generate(prompts, max_new_tokens=15, stop_token_ids=NO_STOP, **sk)
                c1, m1 = eng.tp_collectives(), eng.metrics()
                for i, (g, w) in enumerate(zip(got, want)):
                    if sk:
                        assert list(g.token_ids) == list(w.token_ids), (method, tp, pad, i)
                    else:
                        same_tokens(one, prompts[i], g.token_ids, w.token_ids, f"{method} TP={tp} pad={pad} {i}")
                units = m1["steps_as_one_unit"] - m0["steps_as_one_unit"]
                # the three requests decode together: every step of the batch is one unit
                assert units >= max(r.stats["verify_steps"] for r in got) > 0, (method, tp, units)
                calls = c1["broadcast_calls"] - c0["broadcast_calls"]
                if method == "ar":
                    assert calls == 0, (c0, c1)
                    continue
                # per step the drafts' buffer and the in-step append's features; before the first
                # step the prompts' rows were appended eagerly (one broadcast per chunk)
                assert 0 <= calls - 2 * units <= len(prompts), (units, c0, c1)
                assert m1["drafter_appends_in_step"] - m0["drafter_appends_in_step"] == units
                drafts = units * (4 + 1) * 7 * 4
                feats = c1["broadcast_bytes"] - c0["broadcast_bytes"] - drafts
                assert feats > 0 and feats % (H * 4) == 0, (units, c0, c1)
                # every target forward 1 + 2 L all-reduces, every draft 1 + 2 Ld (split drafter)
                d = m1["draft_head_gathers"] - m0["draft_head_gathers"]
                fwd = c1["all_gather_calls"] - c0["all_gather_calls"] - d
                assert d >= units and c1["all_reduce_calls"] - c0["all_reduce_calls"] == fwd * (1 + 2 * L) + d * (1 + 2 * Ld)
                assert (m1["padding_rows"] > m0["padding_rows"]) == pad, (m0, m1)
            eng.close()
        one.close()


def test_drafter_split_or_whole(zoo, tmp_path):
    """The DFlash drafter is split across the ranks where its heads divide (each rank's query
    heads reading whole key / value heads: 6 heads over 2 key / value heads split 2 ways, one
    shared key / value head per rank) and stays whole on rank 0 where they do not (6 heads
    over 4 ranks); either way propose() gives TP 1's drafts and candidates and generation
    TP 1's tokens (greedy and seeded sampling)."""
    d = F.make_dflash2_drafter(zoo.path("tiny"), str(tmp_path / "d6"), heads=6, kv_heads=2)
    kw = dict(target=zoo.path("tiny"), draft=d, method="dflash2", device="cpu", max_batch_size=4, max_seq_len=256)
    one = dflash2_rt.Engine(**kw)
    prompts = [gf.prompt(970 + i, 4 + 5 * i) for i in range(2)]
    for tp, ranks in ((2, 2), (4, 1)):
        eng = dflash2_rt.Engine(tensor_parallel=tp, **kw)
        assert eng.draft_ranks == ranks, (tp, eng.draft_ranks)
        ids = gf.prompt(975, 7)
        want, got = one.propose(ids), eng.propose(ids)
        assert list(got.tokens) == list(want.tokens), tp
        assert np.array_equal(np.asarray(got.candidates), np.asarray(want.candidates)), tp
        for sk in (dict(), dict(temperature=1.0, top_p=0.95, seed=6)):
            a = one.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP, **sk)
            b = eng.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP, **sk)
            for i, (x, y) in enumerate(zip(b, a)):
                if sk:
                    assert list(x.token_ids) == list(y.token_ids), (tp, i)
                else:
                    same_tokens(one, prompts[i], x.token_ids, y.token_ids, f"heads 6 TP={tp} {i}")
        eng.close()
    one.close()


# ---------------------------------------------------------------------------- quantized



def test_nvfp4_experts(zoo, tmp_path):
    dst = str(tmp_path / "nvfp4")
    quantize_checkpoint(zoo.path("tiny"), dst, "nvfp4", "experts")
    kw = dict(method="ar", device="cpu", max_batch_size=2, max_seq_len=128)
    one = dflash2_rt.Engine(target=dst, tensor_parallel=1, **kw)
    ids = gf.prompt(700, 20)
    # split experts: moe_intermediate_size 32 / 2 = 16, one NVFP4 block per rank
    close(dflash2_rt.Engine(target=dst, tensor_parallel=2, **kw).logits(ids), one.logits(ids), "nvfp4 TP=2")
    for tp in (2, 4):  # whole experts per rank: no NVFP4 block is cut
        close(dflash2_rt.Engine(target=dst, tensor_parallel=tp, expert_parallel=True, **kw).logits(ids),
              one.logits(ids), f"nvfp4 TP={tp} expert-parallel")
    # 32 / 4 = 8 columns of down_proj per rank would cut a 16-wide block
    with pytest.raises(dflash2_rt.ConfigError, match="16"):
        dflash2_rt.Engine(target=dst, tensor_parallel=4, **kw)


def test_expert_parallel_ranks_agree_on_experts_numerics(zoo, tmp_path):
    """With expert parallelism each rank holds other experts, and the routed experts'
    numerics must be one for all ranks: when one expert of the last rank's share cannot run
    W4A4 (a subnormal input_scale), prefill_gemm / decode_gemm = "nvfp4" keep every rank's
    experts off W4A4 (BF16, as TP=1 does), not rank 0's choice on rank 0 and BF16 elsewhere."""
    import glob
    import json
    import re
    import struct
    dst = str(tmp_path / "nvfp4")
    quantize_checkpoint(zoo.path("tiny"), dst, "nvfp4", "experts")
    pat = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.input_scale$")
    hits = []  # (layer, expert, file, header size, header entry)
    for f in sorted(glob.glob(os.path.join(dst, "*.safetensors"))):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            hdr = json.loads(fh.read(n))
        hits += [(int(m.group(1)), int(m.group(2)), f, n, hdr[k]) for k in hdr for m in [pat.search(k)] if m]
    last_layer = max(h[0] for h in hits)
    layer, expert, f, n, info = max((h for h in hits if h[0] == last_layer), key=lambda h: h[1])
    assert info["dtype"] == "F32", info
    a, b = info["data_offsets"]
    with open(f, "r+b") as fh:  # the last expert of one layer: a subnormal input_scale, in place
        fh.seek(8 + n + a)
        fh.write(np.full((b - a) // 4, 1e-40, np.float32).tobytes())
    kw = dict(method="ar", device="cpu", max_batch_size=2, max_seq_len=128, prefill_gemm="nvfp4", decode_gemm="nvfp4")
    one = dflash2_rt.Engine(target=dst, tensor_parallel=1, **kw)
    assert one.experts_prefill_gemm == one.experts_decode_gemm == "bf16"
    ep = dflash2_rt.Engine(target=dst, tensor_parallel=2, expert_parallel=True, **kw)
    assert ep.experts_prefill_gemm == ep.experts_decode_gemm == "bf16", (ep.experts_prefill_gemm, layer, expert)
    prompts = [gf.prompt(710 + i, n) for i, n in enumerate((5, 17))]
    want = one.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    got = ep.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(one, prompts[i], g.token_ids, w.token_ids, f"EP=2 nvfp4 modes, prompt {i}")


def test_fp8_tp2_with_block_aligned_slices(tmp_path):
    """FP8 block-128: a slice must start on a 128 boundary. 32 heads x (16 + 8) q rows and
    256-wide MLPs split in two keep every block whole."""
    src = gf.build_model(str(tmp_path / "wide"), "tiny", mtp=False,
                         config=dict(num_attention_heads=32, num_key_value_heads=32, intermediate_size=256,
                                     moe_intermediate_size=256))
    dst = str(tmp_path / "fp8")
    quantize_checkpoint(src, dst, "fp8")
    kw = dict(method="ar", device="cpu", max_batch_size=2, max_seq_len=128)
    ids = gf.prompt(710, 15)
    close(dflash2_rt.Engine(target=dst, tensor_parallel=2, **kw).logits(ids),
          dflash2_rt.Engine(target=dst, tensor_parallel=1, **kw).logits(ids), "fp8 TP=2")


def test_quantized_slices_that_cut_blocks_are_config_errors(zoo, tmp_path):
    fp8 = str(tmp_path / "fp8")
    quantize_checkpoint(zoo.path("tiny"), fp8, "fp8")
    with pytest.raises(dflash2_rt.ConfigError, match="128"):  # 4 heads x 24 rows / 2 = 48 rows
        dflash2_rt.Engine(target=fp8, method="ar", device="cpu", tensor_parallel=2)
    mlp = str(tmp_path / "mlp")
    quantize_checkpoint(zoo.path("tiny"), mlp, "nvfp4", "mlp")
    with pytest.raises(dflash2_rt.ConfigError, match="16"):  # intermediate 96 / 4 = 24
        dflash2_rt.Engine(target=mlp, method="ar", device="cpu", tensor_parallel=4)


# ---------------------------------------------------------------------------- errors


def test_bad_tensor_parallel_sizes(zoo):
    with pytest.raises(dflash2_rt.ConfigError, match="num_attention_heads = 4"):
        dflash2_rt.Engine(target=zoo.path("tiny"), method="ar", device="cpu", tensor_parallel=3)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="expert_parallel"):
        dflash2_rt.Engine(target=zoo.path("tiny"), method="ar", device="cpu", tensor_parallel=2, expert_parallel=1)
    for bad in (0, -1, 65, 100):
        with pytest.raises(dflash2_rt.InvalidArgumentError, match="tensor_parallel"):
            dflash2_rt.Engine(target=zoo.path("tiny"), method="ar", device="cpu", tensor_parallel=bad)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="tensor_parallel"):
        dflash2_rt.Engine(target=zoo.path("tiny"), method="ar", device="cpu", tensor_parallel=2.0)
    # an engine that failed to build leaves a good one working
    assert zoo.engine("tiny", 2).logits([1, 2, 3]).shape == (3, gf.TINY_CONFIG["vocab_size"])


def test_collectives_per_forward(zoo):
    """The collectives the model issues, counted on rank 0: per forward of T tokens, one
    all-reduce of the embedding [T, H], two per decoder layer (after o_proj and after the
    MLP or MoE block, routed and shared experts summed together first) and one all-gather
    of the logits [R, V]. bench/tp_model.py scales the same formula to GLM-5.3."""
    eng = zoo.engine("tiny", 2)
    H, V, L = gf.TINY_CONFIG["hidden_size"], gf.TINY_CONFIG["vocab_size"], gf.TINY_CONFIG["num_hidden_layers"]
    before = eng.tp_collectives()
    T = 13
    eng.logits(gf.prompt(800, T))
    after = eng.tp_collectives()
    d = {k: after[k] - before[k] for k in after}
    assert d["all_reduce_calls"] == 1 + 2 * L
    assert d["all_reduce_bytes"] == (1 + 2 * L) * T * H * 4
    assert d["all_gather_calls"] == 1 and d["all_gather_bytes"] == T * V * 4
    assert zoo.engine("tiny", 1).tp_collectives() == dict.fromkeys(after, 0)
