"""Comparisons shared by the tests that check one engine against another (TP=N vs TP=1,
CUDA vs CPU): logits within a relative bound, and greedy tokens equal unless the
reference's top-2 margin where they part is within that bound (a genuine near-tie)."""
import numpy as np


def close(got, ref, what, rel):
    """max |got - ref| <= rel * max |ref|, and got finite."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{what}: NaN/Inf in the logits"
    err, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    print(f"{what}: max|d| = {err:.2e}, rel {err / scale:.1e}")
    assert err <= rel * scale, f"{what}: max|d| = {err:.3e} > {rel} * {scale:.3e}"


def same_tokens(ref_engine, prompt, got, want, what, rel):
    """got == want, or they part at a token where ref_engine's top-2 margin is within 4 rel
    of the logit scale."""
    if list(got) == list(want):
        return
    j = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    logits = np.asarray(ref_engine.logits(list(prompt) + list(want[:j])))[-1]
    top2 = np.sort(logits)[-2:]
    margin, scale = float(top2[1] - top2[0]), float(np.abs(logits).max())
    assert margin <= 4 * rel * scale, (f"{what}: token {j} differs ({got[j]} vs {want[j]}) with a reference margin "
                                       f"{margin:.2e} > {4 * rel} * {scale:.2e}\n got  {list(got)}\n want {list(want)}")
