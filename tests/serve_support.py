"""Support code shared by tests/test_server.py and bench/load_test.py: import the server
module and the engines (the fake always, the real one when this build has its request API)
without needing the native core, and make a target directory with a chat template."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SERVER_PY = os.path.join(ROOT, "python", "dflash2_rt", "server.py")
BUNDLED = os.path.join(ROOT, "python", "dflash2_rt", "models", "default")

if HERE not in sys.path:
    sys.path.insert(0, HERE)

# A small chat template: "<|role|>\ncontent\n" per message, then "<|assistant|>\n".
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def render_chat(messages: list) -> str:
    """CHAT_TEMPLATE rendered by hand, to check the server's rendering."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def load_server():
    """dflash2_rt.server: from the package when it imports (an installed or built
    dflash2_rt), else straight from python/dflash2_rt/server.py (no native core needed)."""
    try:
        return importlib.import_module("dflash2_rt.server")
    except ImportError:
        pass
    name = "dflash2_rt_server"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SERVER_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_fake():
    import fake_engine

    return fake_engine


def real_engine_class():
    """(dflash2_rt.Engine, None) when the native core imports and its Engine has the request
    API (submit / poll / cancel / metrics), else (None, why)."""
    try:
        import dflash2_rt
    except Exception as e:  # noqa: BLE001 - ImportError, or an OSError from a broken build
        return None, f"dflash2_rt (native core) is not importable here: {type(e).__name__}: {e}"
    engine = getattr(dflash2_rt, "Engine", None)
    if engine is None:
        return None, "this dflash2_rt has no Engine"
    missing = [a for a in ("submit", "poll", "cancel", "metrics") if not hasattr(engine, a)]
    if missing:
        return None, f"this build's dflash2_rt.Engine has no {'/'.join(missing)} yet (request scheduler not merged)"
    return engine, None


def make_engine(kind: str, target=None, **kw):
    """A 'fake' or 'real' engine over the bundled pair (or `target` with the bundled drafter);
    raises LookupError(why) when the real one is unavailable."""
    if kind == "fake":
        return load_fake().FakeEngine(target=target, **kw)
    cls, why = real_engine_class()
    if cls is None:
        raise LookupError(why)
    if target is not None:
        kw.setdefault("draft", os.path.join(BUNDLED, "draft"))
        kw.setdefault("method", "dflash2")
    return cls(target=target, **kw)


def make_chat_target(dst: str, template: str = CHAT_TEMPLATE) -> str:
    """A copy of the bundled target directory (weights symlinked) with a tokenizer_config.json
    holding `template`; returns its path."""
    src = os.path.join(BUNDLED, "target")
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.lexists(d):
            continue
        if name.endswith(".safetensors"):
            os.symlink(s, d)
        else:
            shutil.copy(s, d)
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "eos_token": "<|endoftext|>", "bos_token": None}, f)
    return dst
