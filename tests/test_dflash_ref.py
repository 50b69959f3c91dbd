"""Tests of the DFlash reference (tests/dflash_ref.py) and fixtures (tests/dflash_fixtures.py)
on their own: no runtime needed. The runtime is compared against them in test_speculative.py."""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
try:
    from transformers import GlmMoeDsaConfig  # noqa: F401
except ImportError:  # pragma: no cover
    pytest.skip("transformers has no GlmMoeDsa (needs >= 5)", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_fixtures as F  # noqa: E402
import dflash_ref as R  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = F.make_tiny_target(tmp_path_factory.mktemp("dfref") / "target", seed=3)
    return R.TargetRef(d)


PROMPTS = [[5, 17, 200, 3, 99], [int(x) for x in np.random.default_rng(1).integers(0, 255, 19)]]


# ---------------------------------------------------------------------------- dispatch-level equivalences


def test_identity_convs_and_zero_successor_draft_like_dflash1(target, tmp_path):
    d2 = F.make_dflash2_drafter(target.dir, tmp_path / "d2", seed=5, identity_convs=True, zero_successor=True)
    d1 = F.dflash1_from_dflash2(d2, tmp_path / "d1")
    r2, r1 = R.DraftRef(d2, target), R.DraftRef(d1, target)
    assert r2.cfg.v2 and not r1.cfg.v2
    for ids in PROMPTS:
        p2, p1 = r2.propose(ids), r1.propose(ids)
        assert p2.anchor == p1.anchor
        torch.testing.assert_close(p2.logits, p1.logits, rtol=0, atol=1e-12)
        assert p2.tokens == p1.tokens
        assert [c[0] for c in p2.candidates] == p2.tokens  # walk = argmax with a zero successor codebook


def test_random_dflash2_uses_convs_and_selector(target, tmp_path):
    """Non-identity convs change the logits; a non-zero selector changes the path."""
    d2 = F.make_dflash2_drafter(target.dir, tmp_path / "d2", seed=5)
    d1 = F.dflash1_from_dflash2(d2, tmp_path / "d1")
    r2, r1 = R.DraftRef(d2, target), R.DraftRef(d1, target)
    walk_differs = False
    for ids in PROMPTS:
        p2, p1 = r2.propose(ids), r1.propose(ids)
        assert float((p2.logits - p1.logits).abs().max()) > 0.05
        walk_differs |= p2.tokens != p2.logits.argmax(-1).tolist()
        # candidates are the top-k of the logits, in descending order
        for t in range(len(p2.tokens)):
            vals = p2.logits[t][torch.tensor(p2.candidates[t])]
            assert torch.all(vals[:-1] >= vals[1:])
            assert float(vals[-1]) >= float(torch.topk(p2.logits[t], 17).values[-1])
    assert walk_differs, "the selector never changed the greedy path: codebooks too weak to test anything"


# ---------------------------------------------------------------------------- pieces


def test_conv_edge_rule_and_formula():
    g = torch.Generator().manual_seed(0)
    B, H, gs = 5, 8, 4
    x = torch.randn(B, H, generator=g, dtype=torch.float64)
    # a pure one-step shift: position 0 reads zero, position t reads x[t - 1]
    shift = torch.stack([torch.zeros(H), torch.ones(H)]).double()
    out = R.conv2(x, shift, torch.zeros(B, 2, H // gs, dtype=torch.float64), gs)
    assert torch.all(out[0] == 0)
    torch.testing.assert_close(out[1:], x[:-1], rtol=0, atol=0)
    # the general formula, element by element
    base = torch.randn(2, H, generator=g, dtype=torch.float64)
    dyn = torch.randn(B, 2, H // gs, generator=g, dtype=torch.float64)
    out = R.conv2(x, base, dyn, gs)
    for t in range(B):
        for c in range(H):
            want = (base[0, c] + dyn[t, 0, c // gs]) * x[t, c]
            if t > 0:
                want += (base[1, c] + dyn[t, 1, c // gs]) * x[t - 1, c]
            assert abs(float(out[t, c] - want)) < 1e-12
    # no state: position 0 ignores anything "before" the block, position t only x[t], x[t-1]
    x2 = x.clone()
    x2[3] += 1.0
    d = (R.conv2(x2, base, dyn, gs) - out).abs().sum(-1)
    assert d[3] > 0 and d[4] > 0 and float(d[:3].sum()) == 0.0


def test_conv_prepare_projection_layout():
    """kernel_projection rows are [2 sides][2 taps][groups]; side 0 feeds prepare, side 1 finish."""
    B, H, gs = 3, 8, 4
    G = H // gs
    y = torch.zeros(B, H, dtype=torch.float64)
    y[:, 0] = 1.0                        # projection output = its column 0
    proj = torch.zeros(4 * G, H, dtype=torch.float64)
    proj[:, 0] = torch.arange(4 * G, dtype=torch.float64)  # row r -> value r
    base = torch.zeros(2, 2, H, dtype=torch.float64)
    out, dyn1 = R.conv_prepare(y, proj, base, gs)
    for side in range(2):
        for tap in range(2):
            for grp in range(G):
                r = (side * 2 + tap) * G + grp
                if side == 1:
                    assert float(dyn1[0, tap, grp]) == r
    # side 0, tap 0, group 0 multiplies channel 0 of the same token: coefficient row 0 = 0,
    # tap 1 of group 0 (row 2) reads the previous token's channel 0 (=1): out[1, 0] = 0*1 + 2*1
    assert float(out[0, 0]) == 0.0 and float(out[1, 0]) == 2.0
    z = torch.ones(B, H, dtype=torch.float64)
    fin = R.conv_finish(z, dyn1, base, gs)
    # channel 4 is group 1: side 1 tap 0 row (1*2+0)*2+1 = 5, tap 1 row 7 -> 5 + 7 at t >= 1
    assert float(fin[0, 4]) == 5.0 and float(fin[2, 4]) == 12.0


def test_attention_mask_rules():
    m = R.attention_mask(n_ctx=6, start=6, B=3, causal=False, window=None)
    assert m.all()
    m = R.attention_mask(n_ctx=6, start=6, B=3, causal=True, window=None)
    assert m[:, :6].all() and m[0, 6:].tolist() == [True, False, False] and m[2, 6:].all()
    # window 4: query at 6 sees 3..; at 8 sees 5..; block keys are all inside (non-causal)
    m = R.attention_mask(n_ctx=6, start=6, B=3, causal=False, window=4)
    assert m[0].tolist() == [False] * 3 + [True] * 6
    assert m[2].tolist() == [False] * 5 + [True] * 4
    assert R.causal_for_layer({"is_causal": True}, 0) is True
    assert R.causal_for_layer({"is_causal": True, "dflash_config": {"causal": False}}, 0) is False
    assert R.causal_for_layer({}, 0) is False


def test_rope_is_neox_half_split():
    D = 8
    x = torch.zeros(1, 1, D, dtype=torch.float64)
    x[0, 0, 0] = 1.0                     # pair (0, 4) rotates at frequency 1 (theta^0)
    y = R.rope_neox(x, torch.tensor([1]), 10000.0)
    assert abs(float(y[0, 0, 0]) - math.cos(1.0)) < 1e-12 and abs(float(y[0, 0, 4]) - math.sin(1.0)) < 1e-12
    assert float(y[0, 0, 1].abs()) == 0.0
    z = R.rope_interleaved(x, torch.tensor([1]), 10000.0)
    assert abs(float(z[0, 0, 1]) - math.sin(1.0)) < 1e-12 and float(z[0, 0, 4]) == 0.0


def test_selector_walk_hand_made():
    V, rank = 6, 2
    A = torch.zeros(V, rank, dtype=torch.float64)
    Bc = torch.zeros(V, rank, dtype=torch.float64)
    A[0] = torch.tensor([1.0, 0.0])
    A[1] = torch.tensor([0.0, 1.0])
    Bc[1] = torch.tensor([1.0, 0.0])
    Bc[4] = torch.tensor([0.2, 0.0])
    Bc[2] = torch.tensor([0.0, 0.1])
    Bc[3] = torch.tensor([0.0, 1.0])
    U = torch.tensor([[2.0, 1.5, 1.0], [1.0, 0.9, 0.0]], dtype=torch.float64)
    cand = torch.tensor([[3, 1, 4], [5, 2, 3]])
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    # t=1, pred 0: bonus (A[0]*g1).B[c] = [0, 1, 0.2] -> scores [2, 2.5, 1.2] -> token 1
    # t=2, pred 1: bonus (A[1]*g2).B[c] = [0, 0.2, 2] -> scores [1, 1.1, 2] -> token 3
    toks, idx, scores = R.selector_walk(U, cand, g, A, Bc, anchor=0)
    assert toks == [1, 3] and idx == [1, 2]
    torch.testing.assert_close(scores, torch.tensor([[2.0, 2.5, 1.2], [1.0, 1.1, 2.0]], dtype=torch.float64))
    # another anchor (A = 0): the walk is the argmax of the logits
    toks, _, _ = R.selector_walk(U, cand, g, A, Bc, anchor=5)
    assert toks == [3, 5]
    # the sampled walk's proposal: softmax(score / T) for a fixed predecessor; one-hot at T = 0
    q = R.selector_q(U[0], cand[0], g[0], A, Bc, pred=0, temperature=0.5)
    torch.testing.assert_close(q, torch.softmax(torch.tensor([2.0, 2.5, 1.2], dtype=torch.float64) / 0.5, -1))
    assert R.selector_q(U[0], cand[0], g[0], A, Bc, pred=0, temperature=0.0).tolist() == [0.0, 1.0, 0.0]


def test_taps_are_decoder_layer_outputs(target):
    """hidden_states[id + 1] is the output of decoder layer id (not its input)."""
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, layer in enumerate(target.model.model.layers)]
    try:
        _, hs = target.run(PROMPTS[0])
    finally:
        for h in hooks:
            h.remove()
    for i in range(target.num_layers - 1):
        torch.testing.assert_close(hs[i + 1], outs[i][0], rtol=0, atol=0)
    feats = target.taps(hs, [0, 1])
    assert feats.shape == (len(PROMPTS[0]), 2 * target.hidden_size)
    with pytest.raises(ValueError):
        target.taps(hs, [target.num_layers])
    with pytest.raises(ValueError):
        target.taps(hs, [target.num_layers - 1])


def test_config_defaults():
    assert R.spec_default_target_layer_ids(78, 6) == [1, 16, 31, 45, 60, 75]
    assert R.spec_default_target_layer_ids(78, 1) == [39]
    assert F.spec_default_target_layer_ids(78, 6) == R.spec_default_target_layer_ids(78, 6)
    cfg = R.parse_draft_config({"architectures": ["DFlash2DraftModel"], "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
                                "dflash_config": {"block_size": 8, "mask_token_id": 255}}, num_target_layers=10)
    assert cfg.head_dim == 128 and cfg.rope_theta == 10000.0 and cfg.selector_rank == 256
    assert cfg.selector_top_k == 16 and cfg.conv_group_size == 16 and cfg.target_layer_ids == [1, 7]
    assert cfg.causal is False and cfg.v2
    cfg = R.parse_draft_config({"architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 256, "block_size": 16,
                                "mask_token_id": 3, "rope_parameters": {"rope_theta": 5.0}}, num_target_layers=10)
    assert not cfg.v2 and cfg.block_size == 16 and cfg.mask_token_id == 3 and cfg.target_layer_ids == [5]
    assert cfg.rope_theta == 5.0


def test_fixture_config_format(target, tmp_path):
    import json

    d = F.make_dflash2_drafter(target.dir, tmp_path / "d", sliding_window=12, is_causal=True, dtype="bf16")
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 12
    assert cfg["use_sliding_window"] is True and cfg["is_causal"] is True and cfg["num_target_layers"] == 3
    assert cfg["dflash_config"] == {"block_size": 8, "mask_token_id": 255, "target_layer_ids": [0, 1],
                                    "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32,
                                    "selector_top_k": 16}
    from safetensors import safe_open

    with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
        assert st.get_tensor("fc.weight").dtype == torch.bfloat16
        assert tuple(st.get_tensor("layers.1.mlp_conv.kernel_projection.weight").shape) == (16, 64)
        assert tuple(st.get_tensor("layers.0.attention_conv.base_kernel").shape) == (2, 2, 64)
        assert tuple(st.get_tensor("candidate_selector.successor_codebook").shape) == (256, 32)
    assert len(names) == 3 + 2 * 15 + 3
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)
    d1 = F.make_dflash1_drafter(target.dir, tmp_path / "d1")
    cfg1 = json.load(open(os.path.join(d1, "config.json")))
    assert cfg1["architectures"] == ["DFlashDraftModel"] and cfg1["block_size"] == 8
    assert "conv_kernel_size" not in cfg1["dflash_config"]


# ---------------------------------------------------------------------------- lossless acceptance


def _markov_setup(V=5, k=3, rank=2, seed=0):
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.full(V, 0.7), size=V)            # target: p(next | prev)
    # a drafter independent of the context, with a selector: its own (wrong) preferences
    logits = torch.from_numpy(rng.normal(size=(2, V)) * 1.5)
    U, cand = zip(*[R.topk_desc(row, k) for row in logits])
    U, cand = torch.stack(U), torch.stack(cand)
    g = torch.from_numpy(rng.normal(size=(2, rank)))
    A = torch.from_numpy(rng.normal(size=(V, rank)))
    Bc = torch.from_numpy(rng.normal(size=(V, rank)))
    return P, (U, cand, g, A, Bc)


def _spec_sample_pairs(P, draft, n, seed, rule, temperature=1.0, one_hot=False):
    """n samples of the first two tokens after anchor 0, generated block by block (B = 3)."""
    U, cand, g, A, Bc = draft
    V, steps = P.shape[0], U.shape[0]
    # q depends only on (position, predecessor): tabulate it once
    qtab = np.array([[R.selector_q(U[t], cand[t], g[t], A, Bc, pred, temperature).numpy() for pred in range(V)]
                     for t in range(steps)])
    greedy = {a: R.selector_walk(U, cand, g, A, Bc, a)[0] for a in range(V)}
    cand_np = cand.numpy()
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(n):
        out, anchor = [], 0
        while len(out) < 2:
            if one_hot:
                toks, q = greedy[anchor], None
            else:
                toks, q, pred = [], [], anchor
                for t in range(steps):
                    row = qtab[t, pred]
                    pred = int(cand_np[t, rng.choice(len(row), p=row)])
                    toks.append(pred)
                    q.append(row)
            p_rows = np.stack([P[anchor]] + [P[t] for t in toks])
            a, bonus = rule(p_rows, toks, q, cand_np, rng)
            out += toks[:a] + [bonus]
            anchor = out[-1]
        counts[out[0], out[1]] += 1
    return counts / n


def test_selector_walk_sample_matches_q():
    P, (U, cand, g, A, Bc) = _markov_setup()
    rng = np.random.default_rng(0)
    toks, q = R.selector_walk_sample(U, cand, g, A, Bc, 0, 0.7, rng)
    torch.testing.assert_close(torch.from_numpy(q[0]), R.selector_q(U[0], cand[0], g[0], A, Bc, 0, 0.7))
    torch.testing.assert_close(torch.from_numpy(q[1]), R.selector_q(U[1], cand[1], g[1], A, Bc, toks[0], 0.7))
    assert toks[0] in cand[0].tolist() and toks[1] in cand[1].tolist()


def _wrong_rule(p_rows, draft_tokens, q_rows, cand_rows, rng):
    """The classic bug: accept iff u < p(d), ignoring q(d)."""
    for i, d in enumerate(draft_tokens):
        p = p_rows[i]
        if rng.random() < p[d]:
            continue
        qv = np.zeros_like(p)
        if q_rows is not None:
            np.add.at(qv, cand_rows[i], q_rows[i])
        r = np.maximum(p - qv, 0)
        r = r / r.sum() if r.sum() > 0 else p
        return i, int(rng.choice(len(r), p=r))
    return len(draft_tokens), int(rng.choice(p_rows.shape[1], p=p_rows[-1]))


def _tv_bound(p, n, c=3.0):
    """c x the expected TV distance of an n-sample empirical distribution from p."""
    return c * 0.5 * float(np.sum(np.sqrt(2 * p * (1 - p) / (math.pi * n)))) + 1e-12


def test_rejection_sampling_reproduces_target_distribution():
    P, draft = _markov_setup()
    exact = P[0][:, None] * P                              # p(t1, t2 | anchor 0)
    for n, seed in ((800, 1), (6400, 2)):
        emp = _spec_sample_pairs(P, draft, n, seed, R.accept_block)
        tv = 0.5 * np.abs(emp - exact).sum()
        assert tv < _tv_bound(exact, n), (n, tv, _tv_bound(exact, n))
    # a one-hot (greedy-walk) proposal with a sampled target is lossless too
    emp = _spec_sample_pairs(P, draft, 3000, 3, R.accept_block, one_hot=True)
    assert 0.5 * np.abs(emp - exact).sum() < _tv_bound(exact, 3000)
    # ... and the wrong rule is caught at the larger sample size
    emp = _spec_sample_pairs(P, draft, 6400, 2, _wrong_rule)
    tv = 0.5 * np.abs(emp - exact).sum()
    assert tv > 2 * _tv_bound(exact, 6400), tv


# ---------------------------------------------------------------------------- the self-drafting pair


def test_self_drafting_pair_reference(tmp_path):
    pair = F.make_self_drafting_pair(tmp_path / "pair")
    assert abs(pair.steady_tau() - F.PAIR_DEFAULT_TAU) < 0.01
    tg = R.TargetRef(pair.target_dir)
    dr = R.DraftRef(pair.draft_dir, tg)
    for last in (0, 13, 56, 99, 127):
        p = dr.propose([7, 100, 31, last])
        assert p.anchor == pair.next_token(last)
        a = pair.accepted_from(p.anchor)
        assert p.tokens[: a + 1] == pair.draft_from(p.anchor)[: a + 1]
        window = sorted((c - p.anchor) % pair.period for c in p.candidates[0])
        assert window == list(range(0, 10)) + list(range(122, 128))       # a - 6 .. a + 9
    # the reference decode loop commits exactly the predicted accepted counts
    prompt = [3, 77, 12, 40]
    toks, accepted = dr.speculative_greedy(prompt, 30)
    exp = pair.expected_greedy(prompt, 30)
    assert toks == exp["tokens"] and accepted == exp["accepted"]
    assert pair.expected_greedy(prompt, 64)["tau"] > 3.5
    full = pair.with_drafter(tmp_path / "full", break_tokens=())
    assert full.expected_greedy(prompt, 33)["accepted"] == [7, 7, 7, 7]
