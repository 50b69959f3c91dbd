"""The bundled default model pair (python/dflash2_rt/models/default): it loads with no paths,
generates text, is lossless against ar for every speculative method (greedy, several
prompts), and reaches a measured acceptance-length floor on a fixed prompt set.

The floors are the values measured when the pair was made (see the comment at FLOORS)
minus a margin; the runtime's greedy path is deterministic, so a drop below them means the
drafter, the verifier or the target's features changed, not noise.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import dflash2_rt
from dflash2_rt.engine import DEFAULT_PAIR_DIR

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_PAIR_DIR, "target", "config.json")),
                                reason="the bundled default pair is not present")

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    \"\"\"Parse the command line and run.\"\"\"\n"
    "    if argv is None:\n        argv = sys.argv[1:]\n",
    "class Queue:\n    \"\"\"A simple FIFO queue.\"\"\"\n\n    def __init__(self, maxsize=0):\n"
    "        self.maxsize = maxsize\n        self.queue = []\n\n    def put(self, item):\n",
    "def _read_config(path):\n    result = {}\n    with open(path, encoding='utf-8') as f:\n"
    "        for line in f:\n            line = line.strip()\n            if not line or line.startswith('#'):\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.name)\n\n"
    "    def __eq__(self, other):\n        if not isinstance(other, self.__class__):\n",
]
NEW = 48
# measured greedy acceptance length over PROMPTS (48 new tokens each) when the pair was made:
# mtp 3.97, dflash 5.45, dflash2 5.31; floors with a margin of about 1 token per step
FLOORS = {"mtp": 3.0, "dflash": 4.2, "dflash2": 4.5}


@pytest.fixture(scope="module")
def ar_outputs():
    eng = dflash2_rt.Engine(method="ar")
    return eng.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])


def test_default_engine_is_dflash2_and_makes_text():
    eng = dflash2_rt.Engine()
    assert eng.method == "dflash2" and eng.block_size == 8 and eng.has_mtp
    assert eng.tokenizer is not None
    r = eng.generate([PROMPTS[0]], max_new_tokens=16)[0]
    assert 1 <= len(r.token_ids) <= 16 and isinstance(r.text, str)
    assert r.stats["acceptance_length"] >= 1.0


@pytest.mark.parametrize("method", ["mtp", "dflash", "dflash2"])
def test_lossless_and_acceptance_floor(method, ar_outputs):
    eng = dflash2_rt.Engine(method=method)
    out = eng.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    for a, b in zip(ar_outputs, out):
        assert a.token_ids == b.token_ids
    tau = float(np.mean([r.stats["acceptance_length"] for r in out]))
    assert tau >= FLOORS[method], f"{method}: acceptance length {tau:.2f} below the floor {FLOORS[method]}"


def test_sampling_runs():
    eng = dflash2_rt.Engine()
    r = eng.generate([PROMPTS[1]], max_new_tokens=24, temperature=1.0, top_p=0.95, seed=1, stop_token_ids=[])[0]
    assert len(r.token_ids) == 24
