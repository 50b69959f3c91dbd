"""Runs the atheris harness tests/fuzz/fuzz_safetensors.py for ~25 s: the native
safetensors validator and JSON parser may only ever raise DFlash2Error, and what they
accept must agree with Python's json module (see the harness)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import dflash2_rt

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz", "fuzz_safetensors.py")


def _env() -> dict:
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(dflash2_rt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    return env


@pytest.mark.slow
def test_fuzz_safetensors_and_json(tmp_path):
    try:
        import atheris  # noqa: F401
    except ImportError as e:
        pytest.skip(f"atheris is not importable ({e}); install it with `pip install atheris` to run the fuzzer")
    corpus = tmp_path / "corpus"
    cmd = [sys.executable, HARNESS, "-max_total_time=25", "-rss_limit_mb=4096", "-print_final_stats=1", str(corpus)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env(), cwd=str(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"fuzzer failed (exit {r.returncode}):\n{out[-6000:]}"
    m = re.search(r"Done (\d+) runs", out) or re.search(r"stat::number_of_executed_units:\s*(\d+)", out)
    assert m, f"no run count in the fuzzer output:\n{out[-3000:]}"
    runs = int(m.group(1))
    print(f"fuzz_safetensors executed {runs} inputs")
    assert runs > 1000, f"only {runs} inputs executed:\n{out[-3000:]}"
