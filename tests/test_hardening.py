"""User-facing hardening: typed errors for bad arguments and bad files, no hangs, no
tracebacks from the CLI, one generation per ``generate --stream``, escaped names in
``inspect``.

Most tests run on copies of the bundled default pair (python/dflash2_rt/models/default):
the weights are symlinked, config.json / tokenizer.json are copied and edited, and the
engine loads in milliseconds.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import dflash2_rt
from dflash2_rt import _core, cli
from dflash2_rt import engine as engine_mod
from dflash2_rt.checkpoint import save_safetensors
from dflash2_rt.engine import DEFAULT_PAIR_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(DEFAULT_PAIR_DIR, "target")
DRAFT = os.path.join(DEFAULT_PAIR_DIR, "draft")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(TARGET, "config.json")),
                                reason="the bundled default pair is not present")

E = dflash2_rt.InvalidArgumentError


def _copy_ckpt(src, dst, *, tokenizer=True):
    """A copy of checkpoint dir `src` at `dst`: weights symlinked, small files copied."""
    os.makedirs(dst)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if name.endswith(".safetensors"):
            os.symlink(s, d)
        elif name != "tokenizer.json" or tokenizer:
            shutil.copy(s, d)
    return str(dst)


def _edit_config(path, **updates):
    """Sets top-level keys (a dict value for 'dflash_config' is merged into it)."""
    p = os.path.join(path, "config.json")
    with open(p, encoding="utf-8") as f:
        cfg = json.load(f)
    for k, v in updates.items():
        if k == "dflash_config" and isinstance(v, dict):
            cfg.setdefault("dflash_config", {}).update(v)
        else:
            cfg[k] = v
    with open(p, "w", encoding="utf-8") as f:
        json.dump(cfg, f)


def _within(seconds, fn):
    """Runs fn in a thread; returns its exception (or None); fails if it has not finished in
    `seconds` (a hang must not hang the test run)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"still running after {seconds} s (hangs?)"
    return box.get("error")


@pytest.fixture(scope="module")
def eng():
    return dflash2_rt.Engine(max_seq_len=256, max_batch_size=2)  # dflash2 on the bundled pair


@pytest.fixture()
def target_copy(tmp_path):
    return _copy_ckpt(TARGET, tmp_path / "target", tokenizer=False)


@pytest.fixture()
def draft_copy(tmp_path):
    return _copy_ckpt(DRAFT, tmp_path / "draft")


def _child_env():
    """The environment for a child Python: the same dflash2_rt as this process (a dev build
    through DFLASH2_RT_CORE_DIR needs python/ on the path; an installed one must not get it,
    or the source tree without _core would shadow the wheel)."""
    env = dict(os.environ)
    if env.get("DFLASH2_RT_CORE_DIR"):
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run_cli(*args, timeout=120):
    env = _child_env()
    return subprocess.run([sys.executable, "-m", "dflash2_rt", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


_RealEngine = _core.Engine


class _CountingEngine:
    """Wraps a _core.Engine and counts generations (generate() calls, or requests submitted)."""
    instances: list = []

    def __init__(self, *a):
        self._real = _RealEngine(*a)
        self.generate_calls = 0
        _CountingEngine.instances.append(self)

    def generate(self, *a, **k):
        self.generate_calls += 1
        return self._real.generate(*a, **k)

    def submit(self, *a, **k):
        self.generate_calls += 1
        return self._real.submit(*a, **k)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture()
def counting(monkeypatch):
    _CountingEngine.instances = []
    monkeypatch.setattr(engine_mod._core, "Engine", _CountingEngine)
    return _CountingEngine.instances


# ---------------------------------------------------------------------------- 1. one run for --stream


def test_stream_on_result_comes_from_the_same_generation(counting):
    eng = dflash2_rt.Engine(max_seq_len=256, max_batch_size=1)
    results = []
    # sampling without a seed: a second run would (almost surely) differ
    toks = list(eng.stream([5, 6, 7], max_new_tokens=24, temperature=1.0, stop_token_ids=[],
                           on_result=results.append))
    assert len(results) == 1 and counting[0].generate_calls == 1
    r = results[0]
    assert isinstance(r, engine_mod.GenerationResult)
    assert r.token_ids == toks and r.stats["generated_tokens"] == len(toks) == 24
    assert r.finish_reason == "length" and r.text == eng.decode(toks)
    # without on_result stream() yields the same kind of thing as before
    assert all(isinstance(t, int) for t in eng.stream([5, 6, 7], max_new_tokens=4))


def test_cli_generate_stream_runs_once(counting, capsys, target_copy, draft_copy):
    rc = cli.main(["generate", "--target", target_copy, "--draft", draft_copy, "--prompt-ids", "5,6,7",
                   "--max-new-tokens", "12", "--temperature", "1.0", "--stream"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert len(counting) == 1 and counting[0].generate_calls == 1
    printed = [int(t) for t in out.split()]
    m = re.search(r"\] (\d+) tokens", err)
    assert m and int(m.group(1)) == len(printed) >= 1, (out, err)


# ---------------------------------------------------------------------------- 2. untyped errors


BAD_IDS = [[2 ** 70], [-1], [1, 2 ** 31], [1, -2 ** 70], [1.5], ["a"], [None], [[1]]]
BAD_SEEDS = [2 ** 63, 2 ** 64, -1, -5, 1.5, 2.0, "1", True]


@pytest.mark.parametrize("ids", BAD_IDS, ids=repr)
@pytest.mark.parametrize("fn", ["generate", "stream", "logits", "propose"])
def test_bad_token_ids_are_invalid_argument(eng, fn, ids):
    with pytest.raises(E):
        if fn == "generate":
            eng.generate([ids], max_new_tokens=2)
        elif fn == "stream":
            list(eng.stream(ids, max_new_tokens=2))
        else:
            getattr(eng, fn)(ids)


def test_too_long_prompt_is_reported_before_its_ids(eng):
    with pytest.raises(E, match="max_seq_len"):
        eng.generate([[2 ** 70] * 300], max_new_tokens=2)
    with pytest.raises(E, match="max_seq_len"):
        eng.stream([1] * 256, max_new_tokens=2)


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_bad_seeds_are_invalid_argument(eng, seed):
    with pytest.raises(E, match="seed"):
        eng.generate([[1, 2]], max_new_tokens=2, seed=seed)
    with pytest.raises(E, match="seed"):
        eng.stream([1, 2], max_new_tokens=2, seed=seed)  # raised at the call, before the first token


def test_good_seeds_and_other_numeric_arguments(eng):
    for seed in (None, 0, 2 ** 63 - 1, np.uint64(7), np.int32(3)):
        eng.generate([[1, 2]], max_new_tokens=2, temperature=0.7, seed=seed)
    a = eng.generate([[1, 2]], max_new_tokens=6, temperature=0.9, seed=2 ** 63 - 1, stop_token_ids=[])
    b = eng.generate([[1, 2]], max_new_tokens=6, temperature=0.9, seed=2 ** 63 - 1, stop_token_ids=[])
    assert a[0].token_ids == b[0].token_ids
    for kw in (dict(max_new_tokens=2 ** 70), dict(max_new_tokens=1.5), dict(top_k=2 ** 64), dict(top_k="3"),
               dict(temperature=float("nan")), dict(temperature="hot"), dict(top_p=float("inf"))):
        args = dict(max_new_tokens=2)
        args.update(kw)
        with pytest.raises(E):
            eng.generate([[1, 2]], **args)
    with pytest.raises(E):
        dflash2_rt.Engine(max_seq_len=2 ** 70)


def test_cli_huge_seed_is_one_error_line():
    r = _run_cli("generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--seed", "99999999999999999999")
    assert r.returncode in (1, 2), r
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and len(lines) == 1 and lines[0].startswith("error:") and "seed" in lines[0], r.stderr
    r = _run_cli("generate", "--prompt-ids", "1," + str(2 ** 70), "--max-new-tokens", "2")
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and "vocabulary" in r.stderr


def test_bad_alloc_is_out_of_memory_error(tmp_path):
    """A std::bad_alloc of the native core is dflash2_rt.OutOfMemoryError (a MemoryError):
    a token list that cannot be copied into C++ under an address-space limit."""
    script = textwrap.dedent("""
        import resource, sys
        import dflash2_rt
        eng = dflash2_rt.Engine(max_seq_len=64, max_batch_size=1)
        ids = [1] * 20_000_000                      # 160 MB of list; the C++ copy needs 80 MB more
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), resource.RLIM_INFINITY))
        try:
            eng._e.logits(ids)                       # the raw binding: no Python-side copy first
        except dflash2_rt.OutOfMemoryError as e:
            assert isinstance(e, MemoryError) and isinstance(e, dflash2_rt.DFlash2Error), type(e).__mro__
            print("OOM-TYPED", e)
            sys.exit(0)
        except BaseException as e:
            print("OTHER", type(e).__mro__, e)
            sys.exit(3)
        print("NO-ERROR")
        sys.exit(4)
    """)
    env = _child_env()
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "OOM-TYPED" in r.stdout, (r.stdout, r.stderr[-2000:])


def test_tensor_shapes_whose_size_overflows_are_out_of_memory():
    """The byte size of Tensor.empty was computed with a wrapping product: [2**62] F32 gave a
    0-byte block behind a huge shape."""
    for shape in ([2 ** 62], [2 ** 40, 2 ** 40], [2 ** 31, 2 ** 31, 4]):
        with pytest.raises(dflash2_rt.OutOfMemoryError):
            dflash2_rt.Tensor.empty("f32", shape)
    assert dflash2_rt.Tensor.empty("f32", [3, 4]).nbytes == 48


# ---------------------------------------------------------------------------- 3. accepted silently before


def test_bytes_prompt_and_bool_ids_are_rejected(eng):
    with pytest.raises(E, match="bytes"):
        eng.generate([b"\x01\x02"], max_new_tokens=2)
    with pytest.raises(E, match="bytearray"):
        eng.generate([bytearray(b"\x01")], max_new_tokens=2)
    with pytest.raises(E, match="bool"):
        eng.generate([[True, False]], max_new_tokens=2)
    with pytest.raises(E, match="bool"):
        eng.logits([1, np.bool_(True)])
    with pytest.raises(E, match="bool"):
        eng.generate([np.array([1, 0], dtype=bool)], max_new_tokens=2)
    with pytest.raises(E):
        eng.generate([np.array([[1, 2]])], max_new_tokens=2)
    with pytest.raises(E):
        eng.generate([7], max_new_tokens=2)


def test_numpy_integer_ids_still_work(eng):
    want = eng.generate([[3, 4, 5]], max_new_tokens=4, stop_token_ids=[])[0].token_ids
    for p in (np.array([3, 4, 5], np.int32), np.array([3, 4, 5], np.uint16), [np.int64(3), np.int8(4), 5],
              (3, 4, 5), range(3, 6)):
        assert eng.generate([p], max_new_tokens=4, stop_token_ids=[])[0].token_ids == want
        assert list(eng.stream(p, max_new_tokens=4, stop_token_ids=np.array([], np.int64))) == want
    assert np.array_equal(eng.logits(np.array([3, 4, 5])), eng.logits([3, 4, 5]))


def test_stop_token_ids_outside_the_vocabulary(eng):
    V = eng.vocab_size
    for stop in ([V], [-1], [1, 2 ** 70], [True], 5, "ab"):
        with pytest.raises(E):
            eng.generate([[1, 2]], max_new_tokens=2, stop_token_ids=stop)
        with pytest.raises(E):
            eng.stream([1, 2], max_new_tokens=2, stop_token_ids=stop)
    eng.generate([[1, 2]], max_new_tokens=2, stop_token_ids=[0, V - 1])


@pytest.mark.parametrize("eos", ["x", [1, "x"], [1, 4096], -1, 4096, {"a": 1}, True, 1.5],
                         ids=["str", "list-with-str", "list-out-of-vocab", "negative", "vocab", "object", "bool",
                              "float"])
def test_bad_eos_token_id_is_a_config_error(target_copy, eos):
    _edit_config(target_copy, eos_token_id=eos)
    with pytest.raises(dflash2_rt.ConfigError, match=r"config\.json.*eos_token_id"):
        dflash2_rt.Engine(target=target_copy, method="ar")


def test_good_eos_token_ids(target_copy):
    for eos in (None, 3, [3, 4], [], 3.0):
        _edit_config(target_copy, eos_token_id=eos)
        dflash2_rt.Engine(target=target_copy, method="ar", max_seq_len=64)


# ---------------------------------------------------------------------------- 4. config bounds


TARGET_EDITS = [
    ("num_hidden_layers", 0), ("num_hidden_layers", -1), ("num_hidden_layers", 10 ** 6),
    ("num_hidden_layers", 10 ** 12), ("hidden_size", 0), ("hidden_size", 2 ** 40), ("vocab_size", 0),
    ("vocab_size", 2 ** 40), ("num_attention_heads", 0), ("num_attention_heads", 10 ** 9), ("q_lora_rank", -1),
    ("kv_lora_rank", 10 ** 9), ("qk_nope_head_dim", 0), ("qk_rope_head_dim", 10 ** 8), ("v_head_dim", -3),
    ("intermediate_size", 0), ("moe_intermediate_size", 10 ** 12), ("n_routed_experts", 10 ** 9),
    ("n_routed_experts", -1), ("n_shared_experts", -1), ("num_experts_per_tok", 10 ** 9), ("index_topk", 0),
    ("index_topk", -5), ("index_n_heads", 10 ** 9), ("index_head_dim", 10 ** 9), ("rms_norm_eps", -1),
    ("rms_norm_eps", 1e300), ("rope_theta", -1.0), ("max_position_embeddings", 0), ("n_group", 0),
    ("topk_group", -2), ("routed_scaling_factor", -1e308),
]


@pytest.mark.parametrize("field,value", TARGET_EDITS, ids=[f"{f}={v}" for f, v in TARGET_EDITS])
def test_absurd_target_config_is_a_config_error(target_copy, field, value):
    if field == "rope_theta":
        _edit_config(target_copy, rope_parameters={"rope_theta": value, "rope_type": "default"})
    else:
        _edit_config(target_copy, **{field: value})
    t0 = time.perf_counter()
    with pytest.raises(dflash2_rt.ConfigError) as ei:
        dflash2_rt.Engine(target=target_copy, method="ar", max_seq_len=64)
    assert time.perf_counter() - t0 < 5
    msg = str(ei.value)
    assert "config.json" in msg and f"'{field}'" in msg, msg


DRAFT_EDITS = [
    ("num_hidden_layers", 0), ("num_hidden_layers", -1), ("num_hidden_layers", 10 ** 9),
    ("intermediate_size", 0), ("intermediate_size", -4), ("hidden_size", -1), ("hidden_size", 0),
    ("num_attention_heads", 0), ("num_attention_heads", -4), ("num_key_value_heads", 0), ("head_dim", 0),
    ("head_dim", -2), ("head_dim", 10 ** 9), ("rms_norm_eps", -1), ("rms_norm_eps", 1e300), ("rope_theta", 0),
    ("vocab_size", -1), ("num_target_layers", 10 ** 9), ("sliding_window", -5), ("sliding_window", "x"),
    ("dflash_config.block_size", 65), ("dflash_config.block_size", 10 ** 9), ("dflash_config.block_size", 1),
    ("dflash_config.block_size", -8), ("dflash_config.selector_top_k", 0),
    ("dflash_config.selector_top_k", 10 ** 6), ("dflash_config.selector_rank", 0),
    ("dflash_config.selector_rank", -1), ("dflash_config.selector_rank", 10 ** 9),
    ("dflash_config.conv_group_size", 0), ("dflash_config.conv_group_size", -16),
    ("dflash_config.target_layer_ids", list(range(5000))),
]


@pytest.mark.parametrize("field,value", DRAFT_EDITS, ids=[f"{f}={str(v)[:12]}" for f, v in DRAFT_EDITS])
def test_absurd_draft_config_is_a_config_error(draft_copy, field, value):
    if field.startswith("dflash_config."):
        _edit_config(draft_copy, dflash_config={field.split(".", 1)[1]: value})
    else:
        _edit_config(draft_copy, **{field: value})
    t0 = time.perf_counter()
    with pytest.raises(dflash2_rt.ConfigError) as ei:
        dflash2_rt.Engine(target=TARGET, draft=draft_copy, method="dflash2", max_seq_len=64)
    assert time.perf_counter() - t0 < 5
    msg = str(ei.value)
    assert "config.json" in msg and field.split(".")[-1] in msg, msg


def test_huge_layer_counts_fail_without_allocating(tmp_path):
    """num_hidden_layers = 10**6 / 10**9 fail fast under a 1 GiB address-space limit."""
    t = _copy_ckpt(TARGET, tmp_path / "t", tokenizer=False)
    _edit_config(t, num_hidden_layers=10 ** 6)
    d = _copy_ckpt(DRAFT, tmp_path / "d")
    _edit_config(d, num_hidden_layers=10 ** 9, num_target_layers=10 ** 9)
    script = textwrap.dedent(f"""
        import resource, sys
        import dflash2_rt
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
        for kw in (dict(target={t!r}, method="ar"), dict(target={TARGET!r}, draft={d!r}, method="dflash2")):
            try:
                dflash2_rt.Engine(max_seq_len=64, max_batch_size=1, **kw)
            except dflash2_rt.ConfigError as e:
                assert "num_hidden_layers" in str(e), e
                continue
            sys.exit(3)
        print("OK")
    """)
    env = _child_env()
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert time.perf_counter() - t0 < 60


# ---------------------------------------------------------------------------- 5. config.json that is not a file


def _make_special(path, kind):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        os.symlink(os.path.basename(path), path)  # config.json -> config.json
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "dangling":
        os.symlink(path + ".nowhere", path)


SPECIAL = {"fifo": "FIFO", "loop": "symbolic links", "directory": "directory", "dev_zero": "character device",
           "dangling": "dangling"}


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_config_json_that_is_not_a_regular_file(target_copy, kind):
    cfg = os.path.join(target_copy, "config.json")
    os.remove(cfg)
    _make_special(cfg, kind)
    err = _within(20, lambda: dflash2_rt.Engine(target=target_copy, method="ar"))
    assert isinstance(err, (dflash2_rt.ConfigError, dflash2_rt.CheckpointError)), repr(err)
    msg = str(err)
    assert "config.json" in msg and SPECIAL[kind] in msg and "missing" not in msg, msg
    err = _within(20, lambda: dflash2_rt.load_config(target_copy))
    assert isinstance(err, dflash2_rt.ConfigError) and SPECIAL[kind] in str(err), repr(err)
    err = _within(20, lambda: dflash2_rt.inspect_checkpoint(target_copy))
    assert isinstance(err, (dflash2_rt.ConfigError, dflash2_rt.CheckpointError)) and SPECIAL[kind] in str(err)
    r = _run_cli("inspect", "--summary", target_copy, timeout=30)
    assert r.returncode == 1 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("layout", ["file", "in_dir", "index"])
def test_safetensors_fifo_does_not_hang(tmp_path, layout):
    d = tmp_path / "ck"
    d.mkdir()
    if layout == "index":
        save_safetensors(d / "a.safetensors", {"x": np.zeros(2, np.float32)})
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
        os.mkfifo(d / "b.safetensors")
        path = str(d)
    else:
        os.mkfifo(d / "model.safetensors")
        path = str(d / "model.safetensors") if layout == "file" else str(d)
    err = _within(20, lambda: dflash2_rt.inspect_checkpoint(path))
    assert isinstance(err, dflash2_rt.CheckpointError) and "FIFO" in str(err), repr(err)


def test_index_json_that_is_a_fifo(tmp_path):
    save_safetensors(tmp_path / "a.safetensors", {"x": np.zeros(2, np.float32)})
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    err = _within(20, lambda: dflash2_rt.inspect_checkpoint(tmp_path))
    assert isinstance(err, dflash2_rt.CheckpointError) and "FIFO" in str(err), repr(err)


# ---------------------------------------------------------------------------- 6. tokenizer.json


@pytest.mark.parametrize("kind", ["garbage", "empty", "wrong_json", "directory", "fifo", "loop"])
def test_broken_tokenizer_is_typed_and_comes_before_the_weights(tmp_path, counting, kind):
    t = _copy_ckpt(TARGET, tmp_path / "t", tokenizer=False)
    # the weights are broken too: loading them first would report them instead
    os.remove(os.path.join(t, "model.safetensors"))
    with open(os.path.join(t, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00")
    tok = os.path.join(t, "tokenizer.json")
    if kind == "garbage":
        with open(tok, "wb") as f:
            f.write(b"{not json\xff")
    elif kind == "empty":
        open(tok, "wb").close()
    elif kind == "wrong_json":
        with open(tok, "w") as f:
            json.dump({"model": 3}, f)
    elif kind == "directory":
        os.mkdir(tok)
    elif kind == "fifo":
        os.mkfifo(tok)
    elif kind == "loop":
        os.symlink("tokenizer.json", tok)
    err = _within(20, lambda: dflash2_rt.Engine(target=t, method="ar"))
    assert isinstance(err, (dflash2_rt.CheckpointError, dflash2_rt.ConfigError)), repr(err)
    assert tok in str(err), str(err)
    assert counting == [], "the C++ engine was built before the tokenizer was checked"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_tokenizer(tmp_path):
    t = _copy_ckpt(TARGET, tmp_path / "t")
    tok = os.path.join(t, "tokenizer.json")
    os.chmod(tok, 0)
    with pytest.raises(dflash2_rt.CheckpointError, match=re.escape(tok)):
        dflash2_rt.Engine(target=t, method="ar")


def test_good_tokenizer_still_loads(tmp_path):
    t = _copy_ckpt(TARGET, tmp_path / "t")
    eng = dflash2_rt.Engine(target=t, method="ar", max_seq_len=64)
    assert eng.tokenizer is not None and eng.decode(eng.encode("def f(x):")) == "def f(x):"


# ---------------------------------------------------------------------------- 7. inspect escapes names


EVIL = "evil\x1b[31mred\nnext\u202eline\\x"


def test_inspect_escapes_names(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    save_safetensors(d / "model.safetensors", {EVIL: np.zeros(3, np.float32), "plain.weight": np.ones(2, np.float32)})
    for args in (["inspect", str(d)], ["inspect", "--summary", str(d)], ["inspect", str(d / "model.safetensors")]):
        r = _run_cli(*args, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "\x1b" not in r.stdout and "\u202e" not in r.stdout, repr(r.stdout)
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", r.stdout), repr(r.stdout)
        if "--summary" not in args:
            assert "evil\\x1b[31mred\\nnext\\u202eline\\\\x" in r.stdout, r.stdout
            assert "plain.weight" in r.stdout
            # one line per tensor: the header, then the rows in name order
            lines = r.stdout.splitlines()
            assert lines[1].startswith("evil\\x1b") and lines[2].startswith("plain.weight"), lines
    r = _run_cli("inspect", "--json", str(d), timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert EVIL in out["tensors"] and out["totals"]["tensors"] == 2
    assert "\x1b" not in r.stdout


def test_printable():
    assert cli.printable("a.b_c-1 é 😀") == "a.b_c-1 é 😀"
    assert cli.printable("\x1b[0m\n\t\r\x00\x7f\u202e\\") == "\\x1b[0m\\n\\t\\r\\x00\\x7f\\u202e\\\\"


# ---------------------------------------------------------------------------- 8. README "Embedding in C++"


def test_readme_embed_commands_name_what_is_built():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("### Embedding in C++", 1)[1].split("\n## ", 1)[0]
    with open(os.path.join(REPO, "examples", "embed", "CMakeLists.txt"), encoding="utf-8") as f:
        targets = re.findall(r"add_executable\((\w+)", f.read())
    runs = re.findall(r"/tmp/embed/(\w+)", section)
    assert runs and all(r in targets for r in runs), (runs, targets)
    # every /tmp path the commands use is created by an earlier command of the section
    for p in set(re.findall(r"(/tmp/[\w.-]+)", section)):
        first = section.index(p)
        assert re.search(r"(-B|make_demo_checkpoint)\s+" + re.escape(p), section[:first + len(p)]), p


def test_cli_generate_penalties():
    base = ("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "12", "--json")
    plain = json.loads(_run_cli(*base).stdout)["token_ids"]
    r = _run_cli(*base, "--repetition-penalty", "1.5", "--frequency-penalty", "0.5", "--presence-penalty", "0.5",
                 "--min-tokens", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["token_ids"]
    import dflash2_rt
    eng = dflash2_rt.Engine(max_batch_size=1)
    try:
        want = eng.generate([[5, 6, 7]], max_new_tokens=12, repetition_penalty=1.5, frequency_penalty=0.5,
                            presence_penalty=0.5, min_tokens=3)[0].token_ids
    finally:
        eng.close()
    assert out == want and out != plain
    r = _run_cli(*base, "--presence-penalty", "3")
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr and "presence_penalty" in r.stderr, r.stderr


def test_cli_generate_structured_output(tmp_path):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
              "additionalProperties": False}
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    base = ("generate", "--prompt", "def f(x):", "--max-new-tokens", "40", "--json")
    for arg in (json.dumps(schema), str(f)):
        r = _run_cli(*base, "--json-schema", arg, "--no-json-whitespace")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == {"k"}, out["text"]
    r = _run_cli(*base, "--choice", "red", "green (light)")
    assert r.returncode == 0 and json.loads(r.stdout)["text"] in ("red", "green (light)"), r.stderr
    r = _run_cli(*base, "--regex", "[0-9]{4}")
    assert r.returncode == 0 and re.fullmatch("[0-9]{4}", json.loads(r.stdout)["text"]), r.stderr
    r = _run_cli(*base, "--regex", "(")
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr and "regex" in r.stderr, r.stderr
    r = _run_cli(*base, "--regex", "a", "--choice", "b")
    assert r.returncode == 2 and "not allowed with" in r.stderr, r.stderr


def test_cli_generate_logprobs():
    r = _run_cli("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--logprobs", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [x["token_id"] for x in out["logprobs"]] == out["token_ids"] and len(out["token_ids"]) == 4
    assert all(len(x["top"]) == 2 and x["top"][0] == [x["token_id"], x["logprob"]] for x in out["logprobs"])
    r = _run_cli("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--logprobs", "1")
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) == 4, r.stdout  # the text, then 3 rows
    r = _run_cli("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--logprobs", "21")
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr and "logprobs" in r.stderr, r.stderr
