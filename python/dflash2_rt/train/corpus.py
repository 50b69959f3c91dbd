"""Step 1: the corpus (this interpreter's Python standard library sources) and the tokenizer.

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except ``site-packages`` and the
test suites (``test/``, ``tests/``, ``idle_test/``), sorted by relative path. The held-out
evaluation set is every file whose index in that order is ``== 7 (mod 20)``. The tokenizer is a
byte-level BPE (HF ``tokenizers``) with vocab 4096 trained on the training files, plus two
special tokens: ``<|endoftext|>`` (EOS, appended after every file) and ``<|mask|>`` (the
DFlash drafter's mask token).
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig

import numpy as np

VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
MASK = "<|mask|>"
HOLDOUT_MOD, HOLDOUT_REM = 20, 7
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> list:
    """Relative paths of the corpus files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in filenames:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def split() -> tuple:
    """(train files, held-out files), relative paths."""
    files = stdlib_files()
    train = [f for i, f in enumerate(files) if i % HOLDOUT_MOD != HOLDOUT_REM]
    held = [f for i, f in enumerate(files) if i % HOLDOUT_MOD == HOLDOUT_REM]
    return train, held


def read(rel: str) -> str:
    with open(os.path.join(sysconfig.get_paths()["stdlib"], rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def train_tokenizer(files: list):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS, MASK], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read(f) for f in files), trainer=trainer, length=len(files))
    return tok


def encode_files(tok, files: list) -> np.ndarray:
    """All files concatenated, each followed by EOS, as uint16 token ids."""
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch([read(f) for f in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def run(work: str, out: str) -> dict:
    os.makedirs(work, exist_ok=True)
    tdir = os.path.join(out, "target")
    os.makedirs(tdir, exist_ok=True)
    train, held = split()
    tok = train_tokenizer(train)
    tok.save(os.path.join(tdir, "tokenizer.json"))
    tok.save(os.path.join(work, "tokenizer.json"))
    tr = encode_files(tok, train)
    ev = encode_files(tok, held)
    np.save(os.path.join(work, "train_ids.npy"), tr)
    np.save(os.path.join(work, "eval_ids.npy"), ev)
    info = {"train_files": len(train), "heldout_files": held, "train_tokens": int(tr.size),
            "eval_tokens": int(ev.size), "vocab_size": tok.get_vocab_size(),
            "eos_token_id": tok.token_to_id(EOS), "mask_token_id": tok.token_to_id(MASK)}
    with open(os.path.join(work, "corpus.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/dflash2_default_work")
    ap.add_argument("--out", default="python/dflash2_rt/models/default")
    a = ap.parse_args(argv)
    info = run(a.work, a.out)
    print({k: v for k, v in info.items() if k != "heldout_files"}, "heldout:", len(info["heldout_files"]))


if __name__ == "__main__":
    main()
