"""The target on one GPU: ``Engine(device="cuda")`` against the same engine on the CPU.

On CUDA the weights, KV caches and chunk workspace live in device memory and every op of
the target's forward runs as a CUDA kernel (cpp/src/backend/cuda); the chunk's plan is
copied up, sampling and acceptance run on the device, and (without tensor parallelism) so
does the DFlash drafter. So the CPU engine is the oracle: logits
agree to fp32 summation-order differences (bounded here by REL of the logit scale), and
greedy tokens are equal except where the CPU's top-2 margin is within that bound.

Without a GPU (or in a build without the CUDA backend) the GPU cases skip with the reason
and one case checks that asking for CUDA is a clear UnsupportedError.
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
from conftest import cuda_or_skip  # noqa: E402
from dflash2_rt.tools.quantize import quantize_checkpoint  # noqa: E402

REL = 1e-4  # |logits(cuda) - logits(cpu)| <= REL * max|logits|
NO_STOP = []
# exact prompt numerics on both devices (the GPU's default is the tensor cores' BF16, which
# test_bf16_prefill_on_cuda checks against the CPU's emulation of it)
KW = dict(max_batch_size=4, max_seq_len=256, prefill_gemm="exact")
# the bf16 comparison's token check: the reference margins come from exact logits
# (Engine.logits), which differ from bf16 prefill's by BF16 rounding, not fp32 order
REL_BF16 = 5e-3
# the same for fp8 prefill (W8A8): exact logits differ from it by the activations' E4M3
# rounding (~3% per element before the sums average it out)
REL_FP8 = 3e-2


def close(got, ref, what, rel=REL):
    compare.close(got, ref, what, rel)


def same_tokens(ref_engine, prompt, got, want, what, rel=REL):
    compare.same_tokens(ref_engine, prompt, got, want, what, rel)


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    ok, why = dflash2_rt.cuda_available(with_reason=True)
    if ok:
        pytest.skip("a GPU is usable here: the GPU cases below run instead")
    path = gf.build_model(str(tmp_path / "tiny"), "tiny")
    with pytest.raises(dflash2_rt.UnsupportedError, match="cuda"):
        dflash2_rt.Engine(target=path, method="ar", device="cuda", **KW)
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="unknown device"):
        dflash2_rt.Engine(target=path, method="ar", device="gpu0", **KW)


class Zoo:
    def __init__(self, root):
        self.root, self.paths, self.engines = root, {}, {}

    def path(self, name, variant=None, quant=None, **opts):
        key = (name, quant)
        if key not in self.paths:
            p = gf.build_model(os.path.join(self.root, name), variant or name, **opts)
            if quant:
                q = os.path.join(self.root, f"{name}-{quant[0]}-{quant[1]}")
                quantize_checkpoint(p, q, quant[0], quant[1])
                p = q
            self.paths[key] = p
        return self.paths[key]

    def engine(self, name, device, method="ar", quant=None, **kw):
        key = (name, device, method, quant, tuple(sorted(kw.items())))
        if key not in self.engines:
            args = dict(KW, **kw)
            self.engines[key] = dflash2_rt.Engine(target=self.path(name, quant=quant), method=method, device=device,
                                                  **args)
        return self.engines[key]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    cuda_or_skip()
    return Zoo(str(tmp_path_factory.mktemp("cuda")))


@pytest.mark.parametrize("variant", ["tiny", "bf16", "ngroup", "indexshare_list"])
def test_logits_equal_cpu(zoo, variant):
    cpu, gpu = zoo.engine(variant, "cpu"), zoo.engine(variant, "cuda")
    for n in (1, 9, 40):  # below and above index_topk = 8: dense, then sparse attention
        ids = gf.prompt(800 + n, n)
        close(gpu.logits(ids), cpu.logits(ids), f"{variant} n={n}")


@pytest.mark.parametrize("quant", [("fp8", "all"), ("nvfp4", "experts"), ("nvfp4", "mlp")],
                         ids=["fp8", "nvfp4-experts", "nvfp4-mlp"])
def test_quantized_logits_equal_cpu(zoo, quant):
    if quant[0] == "fp8":
        name = "fp8wide"
        zoo.path(name, "tiny", quant=quant, mtp=False,
                 config=dict(num_attention_heads=32, num_key_value_heads=32, intermediate_size=256,
                             moe_intermediate_size=256))
    else:
        name = "tiny"
    cpu, gpu = zoo.engine(name, "cpu", quant=quant), zoo.engine(name, "cuda", quant=quant)
    ids = gf.prompt(810, 20)
    close(gpu.logits(ids), cpu.logits(ids), f"{quant}")


def test_greedy_and_batch_equal_cpu(zoo):
    cpu, gpu = zoo.engine("tiny", "cpu"), zoo.engine("tiny", "cuda")
    prompts = [gf.prompt(820 + i, n) for i, n in enumerate((3, 11, 6, 20))]
    want = cpu.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    got = gpu.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(cpu, prompts[i], g.token_ids, w.token_ids, f"cuda prompt {i}")


def test_mtp_on_cuda_equals_ar(zoo):
    """MTP drafting through the target's MTP layer on the GPU: lossless, so it equals AR."""
    cpu = zoo.engine("tiny", "cpu")
    gpu = zoo.engine("tiny", "cuda", method="mtp")
    for i, plen in enumerate((3, 12, 25)):
        p = gf.prompt(830 + i, plen)
        (want,) = cpu.generate([p], max_new_tokens=16, stop_token_ids=NO_STOP)
        (got,) = gpu.generate([p], max_new_tokens=16, stop_token_ids=NO_STOP)
        same_tokens(cpu, p, got.token_ids, want.token_ids, f"mtp cuda prompt {i}")
        assert got.stats["verify_steps"] >= 1


def kept_set_near_tie(logits, temperature, top_k=0, top_p=1.0, rel=1e-4):
    """Whether the kept set of these logits is ill-posed at fp32 rounding: at the top-k or the
    top-p cut, the last token in and the first token out have masses within `rel` of each
    other, or (top-p) the kept mass is within `rel` of top_p either side of the last one. The
    CPU's and the GPU's logits differ in the last bits, so such a step may keep different
    sets, and then sample other tokens."""
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max())
    s = np.sort(p)[::-1]
    near = []
    if 0 < top_k < len(s):
        near.append((s[top_k - 1] - s[top_k]) / s[top_k - 1])
        s = s[:top_k]
    if top_p < 1.0:
        s = s / s.sum()
        c = np.cumsum(s)
        n = min(int(np.searchsorted(c, top_p)), len(s) - 1)  # the last kept token's rank
        near.append(abs(c[n] - top_p) / top_p)
        if n > 0:
            near.append(abs(c[n - 1] - top_p) / top_p)
        if n + 1 < len(s):
            near.append((s[n] - s[n + 1]) / s[n])
    return bool(near) and min(near) < rel


def kept_ids(logits, temperature, top_k=0, top_p=1.0):
    """The ids the sampler keeps for these logits (top-k, then the smallest set of the largest
    whose mass reaches top_p), ascending: the order its draw walks."""
    x = np.asarray(logits, np.float64) / temperature
    w = np.exp(x - x.max())
    order = np.argsort(-x, kind="stable")
    if 0 < top_k < len(x):
        order = order[:top_k]
    if top_p < 1.0:
        c = np.cumsum(w[order])
        order = order[:int(np.searchsorted(c, np.float64(np.float32(top_p)) * c[-1])) + 1]
    return np.sort(order)


def test_seeded_sampling_equal_cpu(zoo):
    """Seeded sampling on the GPU draws the CPU's tokens: the same random stream per request
    and the same top-k / top-p / temperature rules over logits equal to fp32 rounding. Those
    last bits can still part a request where a step is ill-posed: its kept set
    (kept_set_near_tie), or its draw landing on the edge between two neighbouring kept ids (the
    fixture's near-uniform rows put ~230 ids within 1e-2 of each other). So where a request's
    tokens part, the step must be one of those (the CPU's own logits there: a near tie, or the
    two picks neighbours among the kept ids), and at least two of the three requests of each
    setting must agree throughout; a wrong stream, temperature or kept set fails both."""
    cpu, gpu = zoo.engine("tiny", "cpu"), zoo.engine("tiny", "cuda")
    prompts = [gf.prompt(840 + i, 5 + i) for i in range(3)]
    for seed, samp in ((7, dict(temperature=1.0, top_p=0.95)), (8, dict(temperature=0.7, top_k=20)),
                       (9, dict(temperature=0.8, top_p=0.5))):
        kw = dict(max_new_tokens=16, stop_token_ids=NO_STOP, **samp)
        a = [list(r.token_ids) for r in cpu.generate(prompts, seed=seed, **kw)]
        b = [list(r.token_ids) for r in gpu.generate(prompts, seed=seed, **kw)]
        parted = 0
        for p, x, y in zip(prompts, a, b):
            if x == y:
                continue
            parted += 1
            j = next(t for t in range(len(x)) if x[t] != y[t])
            logits = cpu.logits(p + x[:j])[-1]
            ids = list(kept_ids(logits, **samp))
            neighbours = x[j] in ids and y[j] in ids and abs(ids.index(x[j]) - ids.index(y[j])) == 1
            assert kept_set_near_tie(logits, **samp) or neighbours, \
                f"seed {seed} {samp}: CPU {x} != GPU {y} from token {j}, at a well-posed step"
        assert parted <= 1, (seed, samp, a, b)


def test_dflash2_pair_on_cuda(tmp_path):
    """DFlash 2 with the target and the drafter on the GPU: the hand-built pair's exact
    output and accepted counts with the drafter's exact GEMMs; with draft_gemm="auto" (the
    tensor cores once they pass the load-time check) the same output (drafts only steer
    acceptance)."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    prompts = [[int(x)] * 3 for x in (5, 40, 77)]
    for mode in ("exact", "auto"):
        eng = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", device="cuda",
                                draft_gemm=mode, **KW)
        print(f"draft_gemm={mode}: {eng.draft_gemm}")
        got = eng.generate(prompts, max_new_tokens=41, stop_token_ids=NO_STOP)
        for pr, r in zip(prompts, got):
            exp = pair.expected_greedy(pr, 41)
            assert list(r.token_ids) == exp["tokens"], mode
            if mode == "exact":
                assert r.stats["verify_steps"] == exp["steps"]


def test_wide_vocab_sampling_on_cuda(tmp_path):
    """A vocabulary longer than 4096 ids: sample and accept take their split-row kernels
    (cuda/sampling.cu, "wide rows": one block per 4096-id chunk, several launches per step)
    inside the captured step. The self-drafting pair with 8192 ids, sampled at t1.0 p0.95 with
    dflash2 and ar, graphs on: the CPU engine's tokens, with the one-block kernels
    (ops.set_wide_rows(False)) too; greedy dflash2 is still the pair's exact output."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path, vocab_size=8192)
    prompts = [[int(x)] * 3 for x in (5, 40, 77)]
    samp = dict(max_new_tokens=16, stop_token_ids=NO_STOP, temperature=1.0, top_p=0.95, seed=5)
    for method in ("dflash2", "ar"):
        draft = pair.draft_dir if method == "dflash2" else None
        cpu = dflash2_rt.Engine(target=pair.target_dir, draft=draft, method=method, device="cpu", **KW)
        want = [list(r.token_ids) for r in cpu.generate(prompts, **samp)]
        for wide in (True, False):
            dflash2_rt.ops.set_wide_rows(wide)
            try:
                gpu = dflash2_rt.Engine(target=pair.target_dir, draft=draft, method=method, device="cuda", **KW)
                got = [list(r.token_ids) for r in gpu.generate(prompts, **samp)]
                if method == "dflash2" and wide:
                    greedy = gpu.generate(prompts[:1], max_new_tokens=17, stop_token_ids=NO_STOP)[0]
                    assert list(greedy.token_ids) == pair.expected_greedy(prompts[0], 17)["tokens"]
                m = gpu.metrics()
                assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]
                assert m["cuda_graphs_replayed"] >= 1, m
            finally:
                dflash2_rt.ops.set_wide_rows(True)
            assert got == want, f"{method}, wide={wide}: GPU {got} != CPU {want}"


def bf16_copy(src, dst):
    """dst: the checkpoint directory src with every floating-point tensor cast to BF16."""
    import shutil

    from safetensors.torch import load_file, save_file
    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name.endswith(".safetensors"):
            ts = load_file(path)
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ts.items()},
                      os.path.join(dst, name), metadata={"format": "pt"})
        elif os.path.isfile(path):
            shutil.copy(path, dst)
    return dst


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_exact_tc_on_cuda(tmp_path, fmt):
    """ops.set_exact_tc(True) before the engines load: linear's and the routed experts' exact
    numerics on the tensor cores for BF16 / FP8 / NVFP4 weights (x as three BF16 planes). On a
    BF16 copy and an FP8 block-128 copy of the self-drafting pair's target: the prompt's
    logits agree with the CPU's and differ in some bits from the SIMT kernels' (the path is
    taken); AR on the GPU gives the CPU's greedy tokens (where the margins allow); DFlash 2 on
    the GPU -- target rows verified 8 at a time, decoded one per sequence in AR -- gives AR's
    tokens exactly, in fewer steps; the step graphs capture the kernels."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path / "pair")
    target = bf16_copy(pair.target_dir, str(tmp_path / "target-bf16"))
    if fmt == "fp8":
        quantize_checkpoint(target, str(tmp_path / "target-fp8"), "fp8", "all")
        target = str(tmp_path / "target-fp8")
    prompts = [[5, 5, 5], [40, 40, 40, 7], [9, 80, 3]]
    ids = [3, 50, 51, 52, 9, 9, 100]
    kw = dict(KW, max_batch_size=3)
    was = dflash2_rt.ops.exact_tc()
    try:
        dflash2_rt.ops.set_exact_tc(True)
        cpu = dflash2_rt.Engine(target=target, method="ar", device="cpu", **kw)
        ar = dflash2_rt.Engine(target=target, method="ar", device="cuda", **kw)
        d2 = dflash2_rt.Engine(target=target, draft=pair.draft_dir, method="dflash2", device="cuda", **kw)
        tc_logits = np.asarray(ar.logits(ids))
        close(tc_logits, cpu.logits(ids), "exact_tc logits")
        want = cpu.generate(prompts, max_new_tokens=24, stop_token_ids=NO_STOP)
        got = ar.generate(prompts, max_new_tokens=24, stop_token_ids=NO_STOP)
        spec = d2.generate(prompts, max_new_tokens=24, stop_token_ids=NO_STOP)
        for i, (g, w, sp) in enumerate(zip(got, want, spec)):
            same_tokens(cpu, prompts[i], g.token_ids, w.token_ids, f"exact_tc ar prompt {i}")
            assert list(sp.token_ids) == list(g.token_ids), f"dflash2 != ar under exact_tc, prompt {i}"
            assert sp.stats["verify_steps"] < 24, sp.stats
        for e in (ar, d2):
            m = e.metrics()
            assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]
            assert m["cuda_graphs_replayed"] >= 1, m
        dflash2_rt.ops.set_exact_tc(False)
        simt = dflash2_rt.Engine(target=target, method="ar", device="cuda", **kw)
        simt_logits = np.asarray(simt.logits(ids))
        close(simt_logits, tc_logits, "exact_tc vs SIMT logits")
        assert not np.array_equal(simt_logits.view(np.uint32), tc_logits.view(np.uint32)), \
            "the exact form on the tensor cores was not taken"
    finally:
        dflash2_rt.ops.set_exact_tc(was)


def test_bad_devices(zoo):
    path = zoo.path("tiny")
    with pytest.raises(dflash2_rt.InvalidArgumentError, match="visible"):
        dflash2_rt.Engine(target=path, method="ar", device="cuda:64", **KW)
    with pytest.raises(dflash2_rt.OutOfMemoryError, match="free"):
        # a KV pool far beyond any GPU's memory (1120 GiB; 4096 sequences were only 4.4 GiB):
        # refused before anything is allocated
        dflash2_rt.Engine(target=path, method="ar", device="cuda", max_batch_size=1 << 20, max_seq_len=1024,
                          max_step_tokens=64)


# ---------------------------------------------------------------------------- GLM-5.3's dimensions
REAL = gf.REAL_DIMS


def test_real_dimension_slice(zoo):
    """Two layers (dense + MoE) with GLM-5.3's attention dimensions (64 heads, q_lora 2048,
    kv_lora 512, rope 64, nope 192, v 256, indexer 32 x 128, index_topk 2048) over a context
    longer than index_topk, so the sparse path selects 2048 of 2100 keys."""
    path = zoo.path("real", "tiny", mtp=False, config=REAL)
    kw = dict(max_batch_size=1, max_seq_len=2200, max_step_tokens=256, prefill_gemm="exact")
    cpu = dflash2_rt.Engine(target=path, method="ar", device="cpu", **kw)
    gpu = dflash2_rt.Engine(target=path, method="ar", device="cuda", **kw)
    ids = gf.prompt(850, 2100, vocab=REAL["vocab_size"])
    ref, got = np.asarray(cpu.logits(ids)), np.asarray(gpu.logits(ids))
    close(got[-64:], ref[-64:], "real dims, last 64 positions")
    (want,) = cpu.generate([ids[:2060]], max_new_tokens=6, stop_token_ids=NO_STOP)
    (g,) = gpu.generate([ids[:2060]], max_new_tokens=6, stop_token_ids=NO_STOP)
    same_tokens(cpu, ids[:2060], g.token_ids, want.token_ids, "real dims greedy")
    # the prompt on the tensor cores (CUTLASS, K = 1024 / 2048, N up to 16384) against the
    # CPU's emulation of the same numerics
    kw["prefill_gemm"] = "bf16"
    cpu16 = dflash2_rt.Engine(target=path, method="ar", device="cpu", **kw)
    gpu16 = dflash2_rt.Engine(target=path, method="ar", device="cuda", **kw)
    (want,) = cpu16.generate([ids[:2060]], max_new_tokens=6, stop_token_ids=NO_STOP)
    (g,) = gpu16.generate([ids[:2060]], max_new_tokens=6, stop_token_ids=NO_STOP)
    same_tokens(cpu, ids[:2060], g.token_ids, want.token_ids, "real dims greedy, bf16 prefill", rel=REL_BF16)


def test_real_head_dims_small_topk(zoo):
    """GLM-5.3's attention dimensions as test_real_dimension_slice (64 heads, q_lora 2048,
    kv_lora 512, rope 64, nope 192, v 256, indexer 32 x 128) with index_topk 16 over a
    context of 48, so the sparse path (top-16 of up to 48 keys, the indexer's radix select)
    runs at a size the CPU emulation of the CUDA backend gets through (minutes; eager, no
    graphs): logits of the last positions vs the CPU, greedy tokens for a batch of 2, MTP ==
    AR on the GPU."""
    cfg = dict(REAL, index_topk=16)
    path = zoo.path("real16", "tiny", mtp=True, config=cfg)
    kw = dict(max_batch_size=2, max_seq_len=64, max_step_tokens=64, prefill_gemm="exact")
    cpu = dflash2_rt.Engine(target=path, method="ar", device="cpu", **kw)
    gpu = dflash2_rt.Engine(target=path, method="ar", device="cuda", cuda_graphs=False, **kw)
    ids = gf.prompt(851, 48, vocab=REAL["vocab_size"])
    ref, got = np.asarray(cpu.logits(ids)), np.asarray(gpu.logits(ids))
    close(got[-16:], ref[-16:], "real head dims, top-16, last 16 positions")
    prompts = [ids[:40], ids[:25]]
    want = cpu.generate(prompts, max_new_tokens=4, stop_token_ids=NO_STOP)
    g = gpu.generate(prompts, max_new_tokens=4, stop_token_ids=NO_STOP)
    for i in range(2):
        same_tokens(cpu, prompts[i], g[i].token_ids, want[i].token_ids, f"real head dims greedy, prompt {i}")
    mtp = dflash2_rt.Engine(target=path, method="mtp", device="cuda", cuda_graphs=False, **kw)
    spec = mtp.generate(prompts, max_new_tokens=4, stop_token_ids=NO_STOP)
    assert [list(r.token_ids) for r in spec] == [list(r.token_ids) for r in g], "mtp != ar on the GPU"


def test_cuda_graphs_equal_eager(tmp_path):
    """The target's decode / verify chunks replayed from CUDA graphs -- the whole step (draft
    or MTP chain, verify, acceptance) as one graph -- give exactly what the same kernels
    give eagerly (cuda_graphs=False): ar, mtp, dflash2 and dflash, batch sizes 1..4, greedy and seeded
    sampling; graphs were captured and replayed, none failed. With graphs the steps are padded
    to batch-size buckets (3 sequences run as 4), eagerly not: the tokens are the same."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    tiny = gf.build_model(str(tmp_path / "tiny"), "tiny")
    prompts = [[5, 5, 5], [40, 40, 40, 7], [9, 80, 3], [12]]
    emulated = dflash2_rt.build_info()["cuda_emulated"]
    cases = [(tiny, None, "ar"), (tiny, None, "mtp"), (pair.target_dir, pair.draft_dir, "dflash2"),
             (pair.target_dir, pair.draft_dir, "dflash")]
    # in the CPU emulation of the CUDA backend (minutes per engine): DFlash 1 is left to
    # test_dflash_paths_on_cuda (its steps are dflash2's without the conv and selector), and
    # generations are shorter
    new = 12 if emulated else 20
    for target, draft, method in cases[:3] if emulated else cases:
        engines = [dflash2_rt.Engine(target=target, draft=draft, method=method, device="cuda", cuda_graphs=g, **KW)
                   for g in (True, False)]
        assert engines[0].cuda_graphs and not engines[1].cuda_graphs
        assert engines[0].pad_to_buckets and not engines[1].pad_to_buckets
        # in the CPU emulation of the CUDA backend (minutes per engine): batch sizes 1 and 3
        # (3 runs padded to the bucket of 4)
        for bs in (1, 3) if emulated else (1, 2, 3, 4):
            for kw in (dict(), dict(temperature=1.0, top_p=0.9, seed=11)):
                a, b = [[list(r.token_ids) for r in e.generate(prompts[:bs], max_new_tokens=new, stop_token_ids=NO_STOP,
                                                               **kw)] for e in engines]
                assert a == b, f"{method}, batch {bs}, {kw}: graphs {a} != eager {b}"
        m = engines[0].metrics()
        assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]
        assert m["cuda_graphs_captured"] >= 1 and m["cuda_graphs_replayed"] >= 1, m
        assert engines[1].metrics()["cuda_graphs_replayed"] == 0
        # the steps ran as one graph each (the whole step, the MTP chain included)
        assert m["steps_as_one_unit"] >= 1, (method, m)
        assert engines[1].metrics()["steps_as_one_unit"] == 0
        assert (m["padding_rows"] > 0) == (method != "mtp"), (method, m)
        assert engines[1].metrics()["padding_rows"] == 0


def test_op_timing_on_cuda(tmp_path):
    """ops.set_op_timing on a CUDA engine: eager steps (cuda_graphs=False) time every op of every
    step (events around each op); with CUDA graphs the replayed steps dispatch nothing and the
    ops captured into them are not timed (only the eager prompt chunk and the first steps of a
    shape are); the tokens are the same either way."""
    cuda_or_skip()
    from dflash2_rt import ops
    tiny = gf.build_model(str(tmp_path / "tiny"), "tiny")
    engines = [dflash2_rt.Engine(target=tiny, method="ar", device="cuda", cuda_graphs=g, capture_at_load=False, **KW)
               for g in (True, False)]
    prompt = [[5, 40, 7, 9]]
    for e in engines:  # warm-up: the graphs of this shape are captured
        e.generate(prompt, max_new_tokens=6, stop_token_ids=NO_STOP)
    was = ops.op_timing()
    calls, toks = [], []
    try:
        for e in engines:
            ops.op_times(reset=True)
            ops.set_op_timing(True)
            toks.append([list(r.token_ids) for r in e.generate(prompt, max_new_tokens=12, stop_token_ids=NO_STOP)])
            ops.set_op_timing(False)
            rows = {r["op"]: r for r in ops.op_times(reset=True)}
            assert all(r["device"] == "cuda" and r["seconds"] >= 0 for r in rows.values())
            calls.append(rows.get("mla_attention", {}).get("calls", 0))
    finally:
        ops.set_op_timing(was)
        ops.op_times(reset=True)
    assert toks[0] == toks[1]
    graphs, eager = calls
    # eager: every layer's attention at every one of the 12 forwards (prompt + 11 steps)
    assert eager >= 12 * 2, calls
    # graphs: the prompt chunk's (eager) and nothing of the replayed steps
    assert 0 < graphs <= eager // 6, calls
    assert engines[0].metrics()["cuda_graphs_replayed"] >= 8


def test_pdl_graphs(tmp_path):
    """ops.set_pdl(True): the graphs captured afterwards chain their kernels with programmatic
    dependent launch (every captured kernel -> kernel edge into one of the backend's kernels,
    which all begin by waiting for the kernel before them: the emulator fails any that does
    not), and give the same tokens as with it off (ar, dflash2; greedy and seeded sampling;
    a batch of 3 padded to 4). With it off no edge is programmatic."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    tiny = gf.build_model(str(tmp_path / "tiny"), "tiny")
    prompts = [[5, 5, 5], [40, 40, 40, 7], [9, 80, 3]]
    was = dflash2_rt.ops.pdl()
    try:
        for target, draft, method in ((tiny, None, "ar"), (pair.target_dir, pair.draft_dir, "dflash2")):
            runs = {}
            for on in (True, False):
                dflash2_rt.ops.set_pdl(on)
                e = dflash2_rt.Engine(target=target, draft=draft, method=method, device="cuda", **KW)
                runs[on] = ([[list(r.token_ids) for r in e.generate(prompts[:bs], max_new_tokens=12,
                                                                     stop_token_ids=NO_STOP, **kw)]
                             for bs in (1, 3) for kw in (dict(), dict(temperature=1.0, top_p=0.9, seed=5))],
                            e.metrics())
            (a, m_on), (b, m_off) = runs[True], runs[False]
            assert a == b, f"{method}: PDL {a} != without {b}"
            assert m_on["cuda_graphs_failed"] == 0, m_on["cuda_graphs_last_failure"]
            assert m_on["cuda_graphs_replayed"] >= 1 and m_on["cuda_graphs_pdl_edges"] > 0, m_on
            assert m_off["cuda_graphs_pdl_edges"] == 0, m_off
    finally:
        dflash2_rt.ops.set_pdl(was)


def test_bf16_prefill_on_cuda(zoo):
    """prefill_gemm="bf16" on the GPU (the default there when the kernel is built): the
    default resolves to it, greedy tokens equal the CPU's emulation of the same numerics,
    and MTP speculation on the GPU equals AR on the GPU exactly (lossless in this mode)."""
    if not dflash2_rt.ops.linear_bf16_available("cuda:0"):
        pytest.skip("this build has no CUTLASS tensor-core GEMM for this GPU's architecture")
    path = zoo.path("tiny")
    assert dflash2_rt.Engine(target=path, method="ar", device="cuda", max_batch_size=1,
                             max_seq_len=64).prefill_gemm == "bf16"
    cpu = zoo.engine("tiny", "cpu", prefill_gemm="bf16")
    gpu = zoo.engine("tiny", "cuda", prefill_gemm="bf16")
    mtp = zoo.engine("tiny", "cuda", method="mtp", prefill_gemm="bf16")
    assert gpu.experts_prefill_gemm == cpu.experts_prefill_gemm == "bf16"  # the grouped BF16 experts
    prompts = [gf.prompt(880 + i, n) for i, n in enumerate((3, 11, 40, 130))]
    want = cpu.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    got = gpu.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(cpu, prompts[i], g.token_ids, w.token_ids, f"bf16 prefill prompt {i}", rel=REL_BF16)
    spec = mtp.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    for i, (s, g) in enumerate(zip(spec, got)):
        assert list(s.token_ids) == list(g.token_ids), f"mtp != ar on the GPU with bf16 prefill, prompt {i}"


@pytest.mark.parametrize("model", ["tiny", "lora128"])
def test_kv_cache_bf16_on_cuda(zoo, model):
    """kv_cache_dtype="bf16" on the GPU: the latent and index-key caches in BF16 (the SIMT
    MLA and indexer kernels widen them as they stage the keys; with kv_lora 128 MLA runs on
    the tensor cores, ops.mla_tc()): logits equal the CPU engine's under the same option
    (dense and sparse attention), greedy tokens equal the CPU's where the margin exceeds the
    tolerance, MTP speculation == AR on the GPU exactly (decode and verify rows alike), and
    the step graphs capture those kernels (none failed)."""
    _kv_cache_on_cuda(zoo, model, "bf16")


@pytest.mark.parametrize("model", ["tiny", "lora128"])
def test_kv_cache_fp8_on_cuda(zoo, model):
    """kv_cache_dtype="fp8" on the GPU (cpp/src/ops/kv_fp8.h rows: E4M3 codes with power-of-two
    group scales, the latent's rope in BF16; written by the warp kernel of cache_write_many,
    dequantized exactly as the SIMT or tensor-core kernels stage them): the same checks as
    test_kv_cache_bf16_on_cuda against the CPU engine under "fp8", and the load-time check of the
    tensor-core attention over FP8 rows passed."""
    _kv_cache_on_cuda(zoo, model, "fp8")


def _kv_cache_on_cuda(zoo, model, dtype):
    lengths, new = (3, 11, 40), 12
    if model == "lora128":  # two head tiles of 16, the second mostly padding; fewer steps (emulated MMAs are slow)
        zoo.path(model, "tiny", config=dict(kv_lora_rank=128, qk_rope_head_dim=32, index_head_dim=32,
                                            num_attention_heads=18, num_key_value_heads=18, num_hidden_layers=2))
        lengths, new = (11, 40), 8
    cpu = zoo.engine(model, "cpu", kv_cache_dtype=dtype)
    gpu = zoo.engine(model, "cuda", kv_cache_dtype=dtype)
    mtp = zoo.engine(model, "cuda", method="mtp", kv_cache_dtype=dtype)
    assert gpu.kv_cache_dtype == mtp.kv_cache_dtype == dtype
    # the load-time check of the tensor-core attention passed (a failure turns a switch off)
    assert dflash2_rt.ops.mla_tc() and dflash2_rt.ops.indexer_tc()
    for n in (1, 9, 40):  # below and above index_topk = 8: dense, then sparse attention
        ids = gf.prompt(860 + n, n)
        close(gpu.logits(ids), cpu.logits(ids), f"{dtype} cache n={n}", rel=REL_BF16)
    prompts = [gf.prompt(865 + i, n) for i, n in enumerate(lengths)]
    want = cpu.generate(prompts, max_new_tokens=new, stop_token_ids=NO_STOP)
    got = gpu.generate(prompts, max_new_tokens=new, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(cpu, prompts[i], g.token_ids, w.token_ids, f"{dtype} cache prompt {i}", rel=REL_BF16)
    spec = mtp.generate(prompts, max_new_tokens=new, stop_token_ids=NO_STOP)
    for i, (s_, g) in enumerate(zip(spec, got)):
        assert list(s_.token_ids) == list(g.token_ids), f"mtp != ar on the GPU with a {dtype} cache, prompt {i}"
    for e in (gpu, mtp):
        m = e.metrics()
        assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]


def _greedy_equals_cpu(cpu, gpu, seed, lengths, new):
    """Greedy tokens of the GPU engine after a load-time check's fallback equal the CPU engine's
    (the same numerics) where the reference margin exceeds the BF16 tolerance."""
    prompts = [gf.prompt(seed + i, n) for i, n in enumerate(lengths)]
    want = cpu.generate(prompts, max_new_tokens=new, stop_token_ids=NO_STOP)
    got = gpu.generate(prompts, max_new_tokens=new, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(cpu, prompts[i], g.token_ids, w.token_ids, f"prompt {i} after the fallback", rel=REL_BF16)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("kernel", ["indexer_tc_kernel", "mla_tc_kernel"])
def test_attention_tc_fault_falls_back_to_simt(zoo, monkeypatch, capfd, kernel, kv):
    """A BF16 (or FP8: kv_cache_dtype="fp8", the check runs over FP8 rows) cache's tensor-core
    attention failing the load-time check (the CPU emulator's EMU_MMA_FAULT=<kernel>: that
    kernel's mma.sync sums off by one) is turned off in the process with the reason on stderr
    (the other kernel's check passes and it stays on); an F32-cache engine runs no such check;
    greedy tokens after the fallback equal the CPU's over the same cache where the margin
    exceeds the tolerance."""
    cuda_or_skip()
    if not dflash2_rt.build_info()["cuda_emulated"]:
        pytest.skip("the failure injection is the CPU emulator's (EMU_MMA_FAULT)")
    ops = dflash2_rt.ops
    mine, other = ("indexer_tc", "mla_tc") if kernel.startswith("indexer") else ("mla_tc", "indexer_tc")
    message = {"indexer_tc": "the indexer's scores on the tensor cores (indexer_tc) failed their load-time check",
               "mla_tc": "sparse MLA on the tensor cores (mla_tc) failed its load-time check"}[mine]
    was = (ops.mla_tc(), ops.indexer_tc())
    try:
        ops.set_mla_tc(True)
        ops.set_indexer_tc(True)
        monkeypatch.setenv("EMU_MMA_FAULT", kernel)
        capfd.readouterr()
        kw = dict(KW, target=zoo.path("tiny"), method="ar", device="cuda")
        dflash2_rt.Engine(kv_cache_dtype="f32", **kw).close()
        assert "load-time check" not in capfd.readouterr().err and ops.mla_tc() and ops.indexer_tc()
        gpu = dflash2_rt.Engine(kv_cache_dtype=kv, **kw)
        err = capfd.readouterr().err
        assert message in err and "the SIMT kernel runs instead" in err, err
        assert f"over {'an FP8' if kv == 'fp8' else 'a BF16'} cache" in err, err
        assert not getattr(ops, mine)() and getattr(ops, other)()
        monkeypatch.delenv("EMU_MMA_FAULT")
        _greedy_equals_cpu(zoo.engine("tiny", "cpu", kv_cache_dtype=kv), gpu, 880, (5, 40), 6)
    finally:
        ops.set_mla_tc(was[0])
        ops.set_indexer_tc(was[1])


def test_decode_gemm_on_cuda(zoo):
    """decode_gemm="auto" on the GPU: the generated tokens' projections and experts on the
    tensor cores (as prefill_gemm's "auto": "bf16" on this BF16 fixture), greedy tokens equal
    the CPU's emulation of the same numerics where the margin exceeds the rounding, MTP
    speculation == AR on the GPU exactly, and the step graphs capture those kernels (none
    failed)."""
    if not dflash2_rt.ops.linear_bf16_available("cuda:0"):
        pytest.skip("this build has no CUTLASS tensor-core GEMM for this GPU's architecture")
    cpu = zoo.engine("tiny", "cpu", decode_gemm="bf16")
    gpu = zoo.engine("tiny", "cuda", decode_gemm="auto")
    mtp = zoo.engine("tiny", "cuda", method="mtp", decode_gemm="auto")
    assert gpu.decode_gemm == "bf16" and gpu.experts_decode_gemm == cpu.experts_decode_gemm == "bf16"
    prompts = [gf.prompt(870 + i, n) for i, n in enumerate((3, 11, 40, 130))]
    want = cpu.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    got = gpu.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(cpu, prompts[i], g.token_ids, w.token_ids, f"bf16 decode prompt {i}", rel=REL_BF16)
    spec = mtp.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    for i, (s_, g) in enumerate(zip(spec, got)):
        assert list(s_.token_ids) == list(g.token_ids), f"mtp != ar on the GPU with bf16 decode, prompt {i}"
    for e in (gpu, mtp):
        m = e.metrics()
        assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]


def test_decode_gemm_expert_parallel_on_gpus(zoo):
    """decode_gemm="bf16" over 2 GPUs with whole experts per rank (expert_parallel): each
    rank's decode chunks run its own experts (ids offset by the rank's first expert) on the
    skinny grouped GEMM, and the greedy tokens equal the CPU's emulation of the same numerics
    at TP 1 (where the margin exceeds the rounding). Needs 2 GPUs (the CPU emulator of the CUDA
    backend runs it over EMU_DEVICES emulated GPUs)."""
    if not dflash2_rt.ops.linear_bf16_available("cuda:0"):
        pytest.skip("this build has no CUTLASS tensor-core GEMM for this GPU's architecture")
    gpu = _tp_engine_or_skip(zoo, 2, expert_parallel=True, decode_gemm="bf16")
    cpu = zoo.engine("tiny", "cpu", decode_gemm="bf16")
    assert gpu.experts_decode_gemm == cpu.experts_decode_gemm == "bf16"
    prompts = [gf.prompt(890 + i, n) for i, n in enumerate((5, 23))]
    want = cpu.generate(prompts, max_new_tokens=10, stop_token_ids=NO_STOP)
    got = gpu.generate(prompts, max_new_tokens=10, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(cpu, prompts[i], g.token_ids, w.token_ids, f"bf16 decode, expert parallel, prompt {i}",
                    rel=REL_BF16)
    m = gpu.metrics()
    assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]


def _quantized_prefill_on_cuda(zoo, quant, mode, seed, experts):
    """prefill_gemm=mode on zoo's tiny target quantized as `quant`: "auto" resolves to it,
    greedy tokens equal the CPU's emulation of the same numerics (where the logit margin
    exceeds the tensor cores' rounding), and MTP on the GPU equals AR on the GPU exactly."""
    path = zoo.path("tiny", quant=quant)
    assert dflash2_rt.Engine(target=path, method="ar", device="cuda", max_batch_size=1,
                             max_seq_len=64).prefill_gemm == mode
    cpu = zoo.engine("tiny", "cpu", quant=quant, prefill_gemm=mode)
    gpu = zoo.engine("tiny", "cuda", quant=quant, prefill_gemm=mode)
    mtp = zoo.engine("tiny", "cuda", method="mtp", quant=quant, prefill_gemm=mode)
    # the routed experts' numerics: as expected, and the CPU (the oracle) chooses alike
    assert gpu.experts_prefill_gemm == cpu.experts_prefill_gemm == experts, (gpu.experts_prefill_gemm, experts)
    prompts = [gf.prompt(seed + i, n) for i, n in enumerate((3, 11, 40, 130))]
    want = cpu.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    got = gpu.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(cpu, prompts[i], g.token_ids, w.token_ids, f"{mode} prefill prompt {i}", rel=REL_FP8)
    spec = mtp.generate(prompts, max_new_tokens=12, stop_token_ids=NO_STOP)
    for i, (s, g) in enumerate(zip(spec, got)):
        assert list(s.token_ids) == list(g.token_ids), f"mtp != ar on the GPU with {mode} prefill, prompt {i}"


def test_fp8_prefill_on_cuda(zoo):
    """prefill_gemm="fp8" on an FP8 block-128 checkpoint (sm_90a: the W8A8 CUTLASS kernel
    and the grouped expert GEMM)."""
    if not dflash2_rt.ops.linear_fp8_available("cuda:0"):
        pytest.skip("this build has no FP8 block-128 CUTLASS GEMM for this GPU's architecture (sm_90a only)")
    _quantized_prefill_on_cuda(zoo, ("fp8", "all"), "fp8", 890, "fp8")


def test_nvfp4_prefill_on_cuda(zoo):
    """prefill_gemm="nvfp4" on a checkpoint with NVFP4 MLPs (sm_100a / sm_103a: the W4A4
    CUTLASS kernel)."""
    if not dflash2_rt.ops.linear_nvfp4_available("cuda:0"):
        pytest.skip("this build has no NVFP4 W4A4 CUTLASS GEMM for this GPU's architecture (sm_100a / sm_103a only)")
    _quantized_prefill_on_cuda(zoo, ("nvfp4", "mlp"), "nvfp4", 895, "nvfp4")


def test_nvfp4_experts_prefill_on_cuda(zoo):
    """A checkpoint whose NVFP4 weights are the routed experts only (as GLM-5.3-NVFP4): "auto"
    takes "nvfp4" where the W4A4 kernels exist (sm_100a / sm_103a: the experts on the grouped
    block-scaled GEMM) and "bf16" elsewhere (Hopper: the experts on the grouped
    mainloop-dequantizing GEMM, W4A16); either against the CPU's emulation, and MTP == AR on
    the GPU."""
    if not dflash2_rt.ops.linear_bf16_available("cuda:0"):
        pytest.skip("this build has no CUTLASS tensor-core GEMM for this GPU's architecture")
    mode = "nvfp4" if dflash2_rt.ops.linear_nvfp4_available("cuda:0") else "bf16"
    _quantized_prefill_on_cuda(zoo, ("nvfp4", "experts"), mode, 897, mode)


def _collectives_of(engines, prompts, n):
    """The collectives each engine issues generating the same prompts greedily (n tokens),
    and its steps run as one unit (the key "units"): give one request -- how requests join
    a batch depends on timing, and so do the counts."""
    counts = []
    for e in engines:
        before, u0 = e.tp_collectives(), e.metrics()["steps_as_one_unit"]
        e.generate(prompts, max_new_tokens=n, stop_token_ids=NO_STOP)
        counts.append({k: v - before[k] for k, v in e.tp_collectives().items()})
        counts[-1]["units"] = e.metrics()["steps_as_one_unit"] - u0
    return counts


def _same_collectives(graphs, eager, per_unit):
    """A graphs engine's collectives (replays counted as issued) against an eager engine's on
    the same request: the same all-reduces and all-gathers (the split drafter's among them);
    its steps run as one unit broadcast at least `per_unit` times each (rank 0's drafts, where
    the eager engine copies them peer to peer, and the context features of the append inside
    the step; both engines also broadcast the features of their appends outside steps)."""
    assert graphs["units"] > 0 and eager["units"] == 0, (graphs, eager)
    assert graphs["broadcast_calls"] >= per_unit * graphs["units"], (graphs, eager)
    if per_unit == 0:
        assert graphs["broadcast_calls"] == eager["broadcast_calls"] == 0, (graphs, eager)
    drop = ("units", "broadcast_calls", "broadcast_bytes", "broadcast_peer_calls")
    g = {k: v for k, v in graphs.items() if k not in drop}
    assert g == {k: v for k, v in eager.items() if k not in drop}, (graphs, eager)


def _tp_engine_or_skip(zoo, tp, **kw):
    try:
        return zoo.engine("tiny", "cuda", tensor_parallel=tp, **kw)
    except dflash2_rt.InvalidArgumentError as e:
        assert "visible" in str(e)
        pytest.skip(f"needs {tp} GPUs: {e}")


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_on_gpus(zoo, tp):
    """TP=2 / 4 over NCCL (one rank per GPU, one host thread per rank) against the CPU
    engine: logits and greedy tokens. Needs tp GPUs: the project's lent machine has one, so
    on hardware this has never run; the CPU emulator of the CUDA backend runs it over
    EMU_DEVICES emulated GPUs and its in-process NCCL (cpp/emu/nccl_emu.cpp)."""
    gpu = _tp_engine_or_skip(zoo, tp)
    cpu = zoo.engine("tiny", "cpu")
    for n in (1, 9, 40):
        ids = gf.prompt(860 + n, n)
        close(gpu.logits(ids), cpu.logits(ids), f"TP={tp} on GPUs n={n}")
    prompts = [gf.prompt(870, 7), gf.prompt(871, 12)]
    want = cpu.generate(prompts, max_new_tokens=10, stop_token_ids=NO_STOP)
    got = gpu.generate(prompts, max_new_tokens=10, stop_token_ids=NO_STOP)
    for i, (g, w) in enumerate(zip(got, want)):
        same_tokens(cpu, prompts[i], g.token_ids, w.token_ids, f"TP={tp} on GPUs greedy, prompt {i}")
    # every rank's decode chunks ran as CUDA graphs (NCCL collectives inside, one decision for
    # all ranks per chunk), none failed
    m = gpu.metrics()
    assert gpu.cuda_graphs and m["cuda_graphs_replayed"] > 0 and m["cuda_graphs_failed"] == 0, m
    assert m["argmax_gather_steps"] > 0, m  # greedy: (max, id) pairs gathered on the GPUs, not logits
    # the collectives a replayed graph ran are counted as if issued: the same totals as eagerly
    # (one request: how requests join a batch depends on timing, and so do the call counts);
    # every decode step is one unit of every rank (ar: nothing to broadcast)
    eager = _tp_engine_or_skip(zoo, tp, cuda_graphs=False)
    counts = _collectives_of((gpu, eager), prompts[1:], 10)
    _same_collectives(*counts, per_unit=0)
    assert counts[0]["all_reduce_calls"] > 0, counts
    # the tiny model's collectives are all small: every one took the kernels over peer memory
    # (graphs and eagerly), whose rank-order sums are the CPU communicator's
    for c in counts:
        for kind in ("all_reduce", "all_gather", "broadcast"):
            assert c[f"{kind}_peer_calls"] == c[f"{kind}_calls"], counts


@pytest.mark.parametrize("form", ["nccl", "two_shot"])
def test_one_shot_all_reduce_forms_same_tokens(zoo, monkeypatch, form):
    """DFLASH2_P2P_ALLREDUCE_MAX_KB=0 keeps every all-reduce on NCCL, and
    DFLASH2_P2P_ONE_SHOT_MAX_KB=0 sends every one to the two-shot form over peer memory: the
    same greedy tokens as with the one-shot kernel (all sum in rank order in the emulator; on
    GPUs NCCL's order differs, so there only where the top-2 margin allows), and the calls
    counted as taken over peer memory or not."""
    on = _tp_engine_or_skip(zoo, 2)
    monkeypatch.setenv("DFLASH2_P2P_ALLREDUCE_MAX_KB" if form == "nccl" else "DFLASH2_P2P_ONE_SHOT_MAX_KB", "0")
    off = dflash2_rt.Engine(target=zoo.path("tiny"), device="cuda", tensor_parallel=2, **KW)
    prompts = [gf.prompt(872, 9)]
    c0 = off.tp_collectives()
    want = on.generate(prompts, max_new_tokens=8, stop_token_ids=NO_STOP)
    got = off.generate(prompts, max_new_tokens=8, stop_token_ids=NO_STOP)
    c1 = off.tp_collectives()
    same_tokens(on, prompts[0], got[0].token_ids, want[0].token_ids, f"all-reduces: {form}")
    calls, peer = (c1[k] - c0[k] for k in ("all_reduce_calls", "all_reduce_peer_calls"))
    assert calls > 0 and peer == (0 if form == "nccl" else calls), (form, c0, c1)
    gathers, peer_gathers = (c1[k] - c0[k] for k in ("all_gather_calls", "all_gather_peer_calls"))
    assert gathers > 0 and peer_gathers == (0 if form == "nccl" else gathers), (form, c0, c1)
    off.close()


def test_speculative_tensor_parallel_on_gpus(zoo, tmp_path):
    """Speculation over a target sharded across 2 GPUs: greedy MTP equals AR on the same
    GPUs token for token; seeded MTP sampling equals the CPU's seeded MTP (the uniforms
    come from (seed, request, position) only; the logits differ by rounding, which moves a
    draw only if a uniform lands within ~1e-7 of a bucket edge); the DFlash 2 pair gives its
    exact expected output and accepted counts. The MTP chain runs on rank 0's GPU (rank 1
    copies its drafts and hidden states peer to peer); the DFlash drafter is split across both
    GPUs (each rank its heads and MLP slice, reading its shard of the target's embedding, its
    LM head on its vocabulary shard, each rank's top k gathered and merged on rank 0, the
    selector on rank 0)."""
    ar = _tp_engine_or_skip(zoo, 2)
    mtp = zoo.engine("tiny", "cuda", method="mtp", tensor_parallel=2)
    assert mtp.draft_device == "cuda:0" and ar.draft_device is None
    prompts = [gf.prompt(880 + i, n) for i, n in enumerate((3, 11, 6))]
    kw = dict(max_new_tokens=14, stop_token_ids=NO_STOP)
    a = [list(r.token_ids) for r in ar.generate(prompts, **kw)]
    b = [list(r.token_ids) for r in mtp.generate(prompts, **kw)]
    assert a == b, "greedy mtp != ar at TP=2 on GPUs"
    sk = dict(kw, temperature=1.0, top_p=0.95, seed=5)
    a = [list(r.token_ids) for r in zoo.engine("tiny", "cpu", method="mtp").generate(prompts, **sk)]
    b = [list(r.token_ids) for r in mtp.generate(prompts, **sk)]
    assert a == b, "seeded mtp sampling at TP=2 on GPUs != the CPU's"
    m = mtp.metrics()  # the MTP layer's chunks and the verify chunks as graphs on both ranks
    assert m["cuda_graphs_replayed"] > 0 and m["cuda_graphs_failed"] == 0, m
    pair = F.make_self_drafting_pair(tmp_path)
    eng = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", device="cuda",
                            tensor_parallel=2, draft_gemm="exact", **KW)
    assert eng.draft_device == "cuda:0" and eng.draft_ranks == 2 and mtp.draft_ranks == 1
    prompts = [[int(x)] * 3 for x in (5, 40)]
    for pr, r in zip(prompts, eng.generate(prompts, max_new_tokens=25, stop_token_ids=NO_STOP)):
        exp = pair.expected_greedy(pr, 25)
        assert list(r.token_ids) == exp["tokens"]
        assert r.stats["verify_steps"] == exp["steps"]
    # every decode step one graph per rank: the draft forward, its head on the shards, the
    # verify chunk, acceptance (captured at load for the batch-size buckets, padded to them)
    m = eng.metrics()
    assert m["cuda_graphs_replayed"] > 0 and m["cuda_graphs_failed"] == 0, m
    assert m["draft_head_gathers"] > 0 and m["steps_as_one_unit"] > 0 and eng.capture_at_load, m
    # the replayed graphs' collectives (the head's all-gather among them) are counted as if
    # issued: the same totals as an eager engine's on the same request, plus the step's two
    # broadcasts (the head's input rows, the drafts)
    eager = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", device="cuda",
                              tensor_parallel=2, draft_gemm="exact", cuda_graphs=False, **KW)
    counts = _collectives_of((eng, eager), prompts[1:], 25)
    _same_collectives(*counts, per_unit=2)
    assert counts[0]["all_gather_calls"] > 0, counts
    # propose() reads the drafts back from rank 0's GPU: the CPU engine's proposal
    cpu = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", **KW)
    c0 = eng.tp_collectives()
    want, got = cpu.propose(prompts[0]), eng.propose(prompts[0])
    c1 = eng.tp_collectives()
    assert list(got.tokens) == list(want.tokens)
    assert np.array_equal(np.asarray(got.candidates), np.asarray(want.candidates))
    # the prompt's last row of logits, then the draft head's shards' top k (never its logits)
    k, V = np.asarray(got.candidates).shape[1], 256
    assert c1["all_gather_bytes"] - c0["all_gather_bytes"] == V * 4 + 2 * len(got.tokens) * 2 * k * 4, (c0, c1)


def test_failed_captures_fall_back_to_eager(tmp_path, monkeypatch):
    """A CUDA graph capture that fails falls back to eager runs with the reason recorded,
    never to wrong output: with every instantiation failing (the CPU emulator's
    EMU_FAIL_GRAPHS=1), the DFlash 2 pair gives its exact output and accepted counts at TP 1
    (the recorded step, ForwardGraphs) and at TP 2 (GroupGraphs: each rank's whole step, one
    decision for both ranks), and at TP 2 the collectives are counted as an eager engine's
    plus the recorded steps' broadcasts (what a failed capture issued is taken back, not
    counted twice)."""
    cuda_or_skip()
    if not dflash2_rt.build_info()["cuda_emulated"]:
        pytest.skip("the failure injection is the CPU emulator's (EMU_FAIL_GRAPHS)")
    pair = F.make_self_drafting_pair(tmp_path)
    monkeypatch.setenv("EMU_FAIL_GRAPHS", "1")
    prompts = [[int(x)] * 3 for x in (5, 40)]
    for tp in (1, 2):
        kw = dict(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", device="cuda", tensor_parallel=tp,
                  draft_gemm="exact", **KW)
        try:
            eng = dflash2_rt.Engine(**kw)
        except dflash2_rt.InvalidArgumentError as e:
            assert "visible" in str(e)
            pytest.skip(f"needs {tp} GPUs: {e}")
        for pr, r in zip(prompts, eng.generate(prompts, max_new_tokens=25, stop_token_ids=NO_STOP)):
            exp = pair.expected_greedy(pr, 25)
            assert list(r.token_ids) == exp["tokens"], tp
            assert r.stats["verify_steps"] == exp["steps"], tp
        m = eng.metrics()
        assert m["cuda_graphs_failed"] > 0 and m["cuda_graphs_replayed"] == 0, (tp, m)
        assert "cudaGraphInstantiate" in m["cuda_graphs_last_failure"], m["cuda_graphs_last_failure"]
        if tp == 2:
            eager = dflash2_rt.Engine(cuda_graphs=False, **kw)
            counts = _collectives_of((eng, eager), prompts[1:], 25)
            _same_collectives(*counts, per_unit=2)


def test_dq_wgmma_fault_falls_back_to_mma_sync(zoo, monkeypatch, capfd):
    """The mainloop-dequantizing GEMM's wgmma form (Hopper; the emulator's default sm_90)
    failing the load-time check (the CPU emulator's EMU_WGMMA_FAULT=1: every wgmma's sums
    off by one) is turned off in the process with the reason on stderr; its mma.sync form
    passes the check, so prefill_gemm="auto" still resolves to "bf16" (the routed experts
    too), and greedy tokens equal the CPU's emulation of those numerics."""
    cuda_or_skip()
    if not dflash2_rt.build_info()["cuda_emulated"]:
        pytest.skip("the failure injection is the CPU emulator's (EMU_WGMMA_FAULT)")
    if not dflash2_rt.ops.linear_bf16_available("cuda:0"):
        pytest.skip("this build has no tensor-core GEMM for this GPU's architecture")
    was = dflash2_rt.ops.dq_wgmma()
    try:
        dflash2_rt.ops.set_dq_wgmma(True)
        monkeypatch.setenv("EMU_WGMMA_FAULT", "1")
        capfd.readouterr()
        gpu = dflash2_rt.Engine(target=zoo.path("tiny"), method="ar", device="cuda", max_batch_size=2,
                                max_seq_len=128)
        err = capfd.readouterr().err
        assert "(wgmma form) failed its load-time check" in err and "its mma.sync form runs instead" in err, err
        assert not dflash2_rt.ops.dq_wgmma()
        assert gpu.prefill_gemm == "bf16" and gpu.experts_prefill_gemm == "bf16"
        _greedy_equals_cpu(zoo.engine("tiny", "cpu", prefill_gemm="bf16"), gpu, 900, (5, 70), 8)
    finally:
        dflash2_rt.ops.set_dq_wgmma(was)


def test_dflash_paths_on_cuda(tmp_path):
    """The device drafter beyond greedy dflash2: dflash (argmax, no candidates) lossless,
    propose() equal to the CPU's, a prompt longer than max_step_tokens (several context
    appends in a row), and sampled dflash2 in a mixed greedy / sampled batch (acceptance
    reading the selector's candidates and proposal on the device): valid, and the greedy
    request still equal to AR."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    kw = dict(KW, max_step_tokens=32)
    ar = dflash2_rt.Engine(target=pair.target_dir, method="ar", device="cpu", **kw)
    cpu = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", device="cpu", **kw)
    gpu = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", device="cuda",
                            draft_gemm="exact", **kw)  # propose() equal to the CPU's
    g1 = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash", device="cuda", **kw)
    long_prompt = [int(x) % 100 + 2 for x in range(70)]  # > max_step_tokens = 32
    prompts = [[5, 5, 5], [40, 40, 40], long_prompt]
    want = ar.generate(prompts, max_new_tokens=24, stop_token_ids=NO_STOP)
    for eng, name in ((g1, "dflash"), (gpu, "dflash2")):
        got = eng.generate(prompts, max_new_tokens=24, stop_token_ids=NO_STOP)
        for i, (g, w) in enumerate(zip(got, want)):
            same_tokens(ar, prompts[i], g.token_ids, w.token_ids, f"{name} cuda prompt {i}")
    pc, pg = cpu.propose([5, 40, 77]), gpu.propose([5, 40, 77])
    assert pg.anchor == pc.anchor and list(pg.tokens) == list(pc.tokens)
    ids = [gpu.submit(prompts[0], max_new_tokens=24, stop_token_ids=NO_STOP),
           gpu.submit(prompts[1], max_new_tokens=24, temperature=1.0, top_p=0.95, seed=3, stop_token_ids=NO_STOP)]
    res = []
    for rid in ids:
        toks = []
        while True:
            u = gpu.poll(rid, timeout=60)
            toks += list(u.new_token_ids)
            if u.finished:
                break
        res.append(toks)
    same_tokens(ar, prompts[0], res[0], want[0].token_ids, "greedy beside a sampled request")
    V = gpu.vocab_size
    assert len(res[1]) == 24 and all(0 <= t < V for t in res[1])


@pytest.fixture(scope="module")
def small_sampling(tmp_path_factory):
    """test_speculative's 16-token target and drafters, with the exact distribution of its
    sampled continuations (computed on the CPU)."""
    cuda_or_skip()
    import test_speculative as TS

    return TS, TS.Small(tmp_path_factory.mktemp("small_cuda"))


@pytest.mark.parametrize("method", ["ar", "dflash2", "mtp"])  # (dflash's one-hot proposal: mtp's path)
def test_sampling_matches_target_distribution_on_cuda(small_sampling, method):
    """The statistical losslessness test on the GPU: sampled continuations of every method,
    with the step captured as one graph and padded to buckets (the defaults there), follow
    the target's exact distribution (pairwise marginals within the TV bound)."""
    TS, small = small_sampling
    draft = {"dflash2": small.d2, "dflash": small.d1}.get(method)
    kw = dict(mtp_draft_tokens=3) if method == "mtp" else {}
    if method == "mtp" and not small.ar.has_mtp:
        pytest.skip("the small target has no MTP layer")
    eng = dflash2_rt.Engine(target=str(small.target), draft=None if draft is None else str(draft), method=method,
                            device="cuda", max_batch_size=TS.MAXB, max_seq_len=TS.MAXLEN, **kw)
    assert eng.cuda_graphs and eng.pad_to_buckets
    TS.check_sampling_distribution(small, eng, method)
    assert eng.metrics()["cuda_graphs_failed"] == 0, eng.metrics()["cuda_graphs_last_failure"]


def test_stop_tokens_and_page_boundaries_on_cuda(tmp_path):
    """On the GPU, with the step as one graph and 4-token KV pages (every verify block of 8
    crosses a page, so each rollback lands inside or at the edge of one): stop tokens cut
    inside a block exactly where plain greedy decoding would stop, and the rest of the batch
    (3 sequences padded to 4) goes on equal to greedy, for dflash2 and dflash."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    prompts = [[1, 40], [7, 7, 10], [60], [2, 49]]
    stops = [50, 15]
    for method in ("dflash2", "dflash"):
        eng = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method=method, device="cuda",
                                max_batch_size=4, max_seq_len=128, kv_block_size=4)
        for batch in (prompts, prompts[:3]):
            res = eng.generate(batch, max_new_tokens=30, stop_token_ids=stops)
            for pr, r in zip(batch, res):
                full = pair.expected_greedy(pr, 30)["tokens"]
                cut = next((i for i, t in enumerate(full) if t in stops), None)
                want = full if cut is None else full[: cut + 1]
                assert list(r.token_ids) == want, (method, pr, list(r.token_ids), want)
                assert r.finish_reason == ("length" if cut is None else "stop")
            assert list(res[0].token_ids) == list(range(41, 51))  # cut in the middle of a block
        m = eng.metrics()
        assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]
        assert m["steps_as_one_unit"] >= 1 and m["padding_rows"] >= 1, m
        assert m["cache_pages_used"] == 0, m


def test_interleaved_prefill_on_cuda(tmp_path):
    """On the GPU, a prompt that arrives while another request decodes runs 8 tokens per
    scheduler round (prefill_tokens_per_step=8) between that request's captured steps: both
    outputs equal plain greedy decoding, the prompt took ceil(60 / 8) rounds, and every page
    comes back."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    eng = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", device="cuda",
                            max_batch_size=2, max_seq_len=128, max_step_tokens=16, prefill_tokens_per_step=8)
    try:
        first_p, long_p = [1, 40], [(i * 7) % 120 for i in range(59)] + [3]
        first = eng.submit(first_p, max_new_tokens=100, stop_token_ids=NO_STOP)
        got = eng.poll(first, timeout=600).new_token_ids
        rid = eng.submit(long_p, max_new_tokens=20, stop_token_ids=NO_STOP)
        res = {}
        while len(res) < 2:
            for r in (first, rid):
                if r not in res:
                    up = eng.poll(r, timeout=1.0)
                    if up.finished:
                        res[r] = up.result
        assert list(res[first].token_ids) == pair.expected_greedy(first_p, 100)["tokens"]
        assert list(res[rid].token_ids) == pair.expected_greedy(long_p, 20)["tokens"]
        assert got and res[rid].stats["prefill_rounds"] == 8, res[rid].stats
        m = eng.metrics()
        assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]
        assert m["steps_as_one_unit"] >= 1 and m["cache_pages_used"] == 0 and m["prefilling"] == 0, m
    finally:
        eng.close()


def test_conversation_prefix_on_cuda(tmp_path):
    """On the GPU with every numerics exact (prefill_gemm / draft_gemm "exact"; the defaults
    put prompts on the tensor cores, and then only prompt blocks are kept): a conversation's
    next turn takes its previous output's blocks from the target's and the drafter's caches,
    and its tokens stay plain greedy decoding's."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    eng = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", device="cuda",
                            max_batch_size=1, max_seq_len=64, kv_block_size=4, prefill_gemm="exact",
                            draft_gemm="exact")
    try:
        assert eng.prefix_cache_generated
        convo = [(i * 7) % 120 for i in range(9)]
        for turn in range(3):
            r = eng.generate([convo], max_new_tokens=10, stop_token_ids=NO_STOP)[0]
            assert list(r.token_ids) == pair.expected_greedy(convo, 10)["tokens"], turn
            if turn:
                assert r.stats["cached_tokens"] > (len(convo) - 14) // 4 * 4, (turn, r.stats)
            convo = convo + list(r.token_ids) + [3 + turn, 5]
        m = eng.metrics()
        assert m["cache_pages_used"] == 0 and m["cuda_graphs_failed"] == 0, m
    finally:
        eng.close()


def test_logprobs_on_cuda(tmp_path):
    """Log-probabilities on the GPU (steps as graphs; the first token's from a prefill chunk,
    the rest from verify rows after acceptance, ops.token_logprobs and ops.topk there) equal
    the CPU engine's, greedy and seeded sampled, at tensor_parallel 1 and 2 (where the greedy
    steps of such requests gather the logits instead of (max, id) pairs); so does scoring a
    prompt (Engine.prompt_logprobs)."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    prompts = [[(i * 7) % 120 for i in range(13)], [(i * 5 + 3) % 120 for i in range(6)]]
    kw = dict(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", max_batch_size=2, max_seq_len=64)
    cpu = dflash2_rt.Engine(**kw)
    try:
        for tp in (1, 2):
            eng = dflash2_rt.Engine(**kw, device="cuda", tensor_parallel=tp)
            try:
                g0 = eng.metrics()["argmax_gather_steps"]
                for samp in ({}, dict(temperature=1.0, seed=4)):
                    want = cpu.generate(prompts, max_new_tokens=20, stop_token_ids=NO_STOP, logprobs=3, **samp)
                    got = eng.generate(prompts, max_new_tokens=20, stop_token_ids=NO_STOP, logprobs=3, **samp)
                    for g, w in zip(got, want):
                        assert g.token_ids == w.token_ids, (tp, samp)
                        assert len(g.logprobs) == 20
                        np.testing.assert_allclose([x.logprob for x in g.logprobs], [x.logprob for x in w.logprobs],
                                                   atol=1e-4)
                        for x, y in zip(g.logprobs, w.logprobs):
                            assert list(x.top_ids) == list(y.top_ids)
                            np.testing.assert_allclose(x.top_logprobs, y.top_logprobs, atol=1e-4)
                # scoring a prompt: token_logprobs and topk over the device's logits
                for x, y in zip(eng.prompt_logprobs(prompts[0] + prompts[1], top=2),
                                cpu.prompt_logprobs(prompts[0] + prompts[1], top=2)):
                    assert abs(x.logprob - y.logprob) < 1e-4 and list(x.top_ids) == list(y.top_ids)
                m = eng.metrics()
                assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]
                if tp == 2:  # the logits were gathered (one GPU reads them from the projection's buffer)
                    assert m["argmax_gather_steps"] == g0, m
            finally:
                eng.close()
    finally:
        cpu.close()


def test_penalties_on_cuda(tmp_path):
    """Repetition control on the GPU (ops.apply_penalties inside the recorded step, before
    acceptance; ops.count_tokens after it): penalized, biased and min_tokens requests beside a
    plain one give the CPU engine's tokens, greedy and seeded sampled, at tensor_parallel 1 and
    2, and the steps stay graphs."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    prompts = [[(i * 7) % 120 for i in range(13)], [(i * 5 + 3) % 120 for i in range(6)]]
    kw = dict(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", max_batch_size=3, max_seq_len=64)
    pen = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={5: 2.0, 9: -3.0})
    cpu = dflash2_rt.Engine(**kw)
    try:
        stop = cpu.generate(prompts[:1], max_new_tokens=20, stop_token_ids=NO_STOP)[0].token_ids[1]
        for tp in (1, 2):
            eng = dflash2_rt.Engine(**kw, device="cuda", tensor_parallel=tp)
            try:
                for samp in ({}, dict(temperature=1.0, seed=4)):
                    reqs = [(prompts[0], dict(pen, stop_token_ids=NO_STOP)), (prompts[1], dict(stop_token_ids=NO_STOP)),
                            (prompts[0], dict(stop_token_ids=[stop], min_tokens=9, frequency_penalty=1.0))]
                    for e, out in ((cpu, want := []), (eng, got := [])):
                        rids = [e.submit(p, max_new_tokens=20, **k, **samp) for p, k in reqs]
                        for r in rids:
                            while not (u := e.poll(r)).finished:
                                pass
                            out.append(u.result.token_ids)
                    assert got == want, (tp, samp)
                    assert len(got[2]) >= 9 and stop not in got[2][:9]
                forced = eng.generate(prompts[:1], max_new_tokens=16, stop_token_ids=NO_STOP, logit_bias={7: 100.0})[0]
                assert forced.token_ids == [7] * 16
                if tp == 1:  # the drafter on the device drafts under the bias: whole blocks accepted
                    assert forced.stats["acceptance_length"] > 6, forced.stats
                m = eng.metrics()
                assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]
                assert m["cuda_graphs_replayed"] > 0, m
            finally:
                eng.close()
    finally:
        cpu.close()


def test_structured_output_on_cuda(tmp_path):
    """Token constraints on the GPU (ops.mask_logits over the verify rows, the step eager
    because the masks need the drafts on the host; greedy drafts steered by the constraint,
    the device's draft rows rewritten): constrained requests beside a plain one
    give the CPU engine's tokens, greedy and seeded sampled, at tensor_parallel 1 and 2, and
    plain steps afterwards are graphs again."""
    cuda_or_skip()
    from test_structured import Banned  # bans a third of the vocabulary after each token; steers greedy drafts

    pair = F.make_self_drafting_pair(tmp_path)
    prompts = [[(i * 7) % 120 for i in range(13)], [(i * 5 + 3) % 120 for i in range(6)]]
    kw = dict(target=pair.target_dir, draft=pair.draft_dir, method="dflash2", max_batch_size=3, max_seq_len=64)
    cpu = dflash2_rt.Engine(**kw)
    made = []

    def ban(V):
        made.append(Banned(V, n=V // 3, steering=True))
        return made[-1]

    try:
        V = cpu.vocab_size
        for tp in (1, 2):
            eng = dflash2_rt.Engine(**kw, device="cuda", tensor_parallel=tp)
            try:
                for samp in ({}, dict(temperature=1.0, seed=4)):
                    for e, out in ((cpu, want := []), (eng, got := [])):
                        rids = [e.submit(prompts[0], max_new_tokens=20, stop_token_ids=NO_STOP, constraint=ban(V),
                                         **samp),
                                e.submit(prompts[1], max_new_tokens=20, stop_token_ids=NO_STOP, **samp),
                                e.submit(prompts[1], max_new_tokens=20, stop_token_ids=NO_STOP, constraint=ban(V),
                                         repetition_penalty=1.2, **samp)]
                        for r in rids:
                            while not (u := e.poll(r)).finished:
                                pass
                            out.append(u.result.token_ids)
                    assert got == want, (tp, samp)
                    assert got[0] != pair.expected_greedy(prompts[0], 20)["tokens"] or samp
                assert sum(c.steer_calls for c in made) > 0  # the greedy requests' drafts were steered
                before = eng.metrics()["cuda_graphs_replayed"]
                r = eng.generate(prompts[:1], max_new_tokens=16, stop_token_ids=NO_STOP)[0]
                assert list(r.token_ids) == pair.expected_greedy(prompts[0], 16)["tokens"]
                m = eng.metrics()
                assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]
                assert m["cuda_graphs_replayed"] > before, m
            finally:
                eng.close()
    finally:
        cpu.close()


def test_prefix_cache_on_cuda(tmp_path):
    """On the GPU (steps as graphs, 4-token pages): prompts sharing a 30-token prefix take its
    cached blocks from the target's and the drafter's caches (7 pages), and every output
    equals plain greedy decoding for dflash2 and mtp-less ar; a full cache evicts."""
    cuda_or_skip()
    pair = F.make_self_drafting_pair(tmp_path)
    prefix = [(i * 7) % 120 for i in range(30)]
    for method in ("dflash2", "ar"):
        eng = dflash2_rt.Engine(target=pair.target_dir, draft=pair.draft_dir if method == "dflash2" else None,
                                method=method, device="cuda", max_batch_size=2, max_seq_len=64, kv_block_size=4)
        try:
            for k in range(4):
                p = prefix + [3 + k, 10 + k]
                r = eng.generate([p], max_new_tokens=20, stop_token_ids=NO_STOP)[0]
                assert list(r.token_ids) == pair.expected_greedy(p, 20)["tokens"], (method, k)
                assert r.stats["cached_tokens"] == (0 if k == 0 else 28), (method, k, r.stats)
            for k in range(12):  # distinct prompts: 2 slots of 64 tokens cannot keep them all
                p = [(i * 5 + 11 * k) % 120 for i in range(40)]
                r = eng.generate([p], max_new_tokens=8, stop_token_ids=NO_STOP)[0]
                assert list(r.token_ids) == pair.expected_greedy(p, 8)["tokens"], (method, k)
            m = eng.metrics()
            assert m["prefix_cache_evictions"] > 0 and m["cache_pages_used"] == 0, m
            assert m["cuda_graphs_failed"] == 0, m["cuda_graphs_last_failure"]
        finally:
            eng.close()
