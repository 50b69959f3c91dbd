"""atheris (libFuzzer) harness for the native safetensors header validator and JSON parser.

    python tests/fuzz/fuzz_safetensors.py [libFuzzer flags] [CORPUS_DIR]
    e.g. python tests/fuzz/fuzz_safetensors.py -max_total_time=25 /tmp/st_corpus

The only exception the native code may raise is DFlash2Error; anything else (or a crash)
is a finding. When an input is accepted, the result is checked against Python: the
header must also be valid JSON for Python's json module, agree on every entry, and
describe non-overlapping tensors inside the data region; an accepted JSON text must
decode to the same value with json.loads.

The first byte of an input selects the mode:
  0: the bytes are a whole safetensors image;
  1: the bytes are a header (2 bytes of data-region size, then the header JSON): the
     harness adds a correct length prefix, so mutations reach the per-tensor checks;
  2: the bytes are a JSON text for the JSON parser.
The seed corpus (valid images and JSON texts) and a dictionary of JSON / safetensors
tokens are written by the harness itself into CORPUS_DIR (a new temporary directory if
none is given).

The C++ code is not built with coverage instrumentation, so libFuzzer's feedback comes
from this file: each distinct native error class is a separate branch below, which makes
inputs that reach a new validation error "interesting" to the fuzzer.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import tempfile

import atheris

import dflash2_rt
from dflash2_rt import DFlash2Error, _core

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "U8": 1, "I32": 4, "I64": 8}
MAX_DATA = 4096  # data region size in mode 1


# ---------------------------------------------------------------------------- seeds


def _image(header: dict | str, data_size: int) -> bytes:
    h = header if isinstance(header, str) else json.dumps(header)
    hb = h.encode()
    return struct.pack("<Q", len(hb)) + hb + bytes(data_size)


def _layout(entries: list[tuple[str, str, list[int]]], metadata: dict | None = None) -> tuple[dict, int]:
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    off = 0
    for name, dt, shape in entries:
        n = SIZES[dt] * math.prod(shape)
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    return header, off


def seed_inputs() -> list[bytes]:
    headers = [
        _layout([("model.embed_tokens.weight", "BF16", [8, 4]), ("model.norm.weight", "F32", [4])], {"format": "pt"}),
        _layout([(f"t{dt}", dt, [3, 2]) for dt in SIZES]),
        _layout([("scalar", "F32", []), ("empty", "U8", [0, 7]), ("v", "I64", [2])]),
        _layout([("model.layers.0.mlp.experts.0.down_proj.weight", "F8_E4M3", [4, 16]),
                 ("model.layers.0.mlp.experts.0.down_proj.weight_scale", "F8_E4M3", [4, 1]),
                 ("model.layers.0.mlp.experts.0.down_proj.weight_scale_2", "F32", [])]),
        _layout([("caf\u00e9\U0001F600", "U8", [1])], {"k": "v\n\u00e9"}),
        ({}, 0),
    ]
    out = []
    for header, size in headers:
        img = _image(header, size)
        out.append(b"\x00" + img)
        padded = json.dumps(header) + " " * 5
        out.append(b"\x00" + _image(padded, size))
        out.append(b"\x01" + struct.pack("<H", size) + json.dumps(header, indent=1).encode())
    jsons = [
        '{"a": [1, -2, 3.5e-3, true, false, null], "b": {"c": "d\\n\\u00e9\\ud83d\\ude00"}}',
        "[]", "{}", "0", "-0.0", "9223372036854775807", "-9223372036854775808", "18446744073709551616",
        '"\\u0000 \\" \\\\ \\/ \\b \\f \\n \\r \\t"', "[[[[[[[[[[1]]]]]]]]]]", "1e308", "2.5E-308",
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}, "metadata": {"total_size": 12}}),
    ]
    out += [b"\x02" + j.encode() for j in jsons]
    return out


DICTIONARY = [
    '"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"weight_map"', *(f'"{d}"' for d in SIZES),
    '"F64"', '"BOOL"', "[", "]", "{", "}", ":", ",", '""', "true", "false", "null", "-", "0", "1e", "E+", ".5",
    "\\u", "\\ud83d", "\\ude00", "\\\\", "\\n", "9223372036854775807", "9223372036854775808", "-1",
    "18446744073709551615", "4294967296", "\xc3\xa9", "\xf0\x9f\x98\x80", "\xed\xa0\x80", "\xc0\x80",
]


def write_corpus_and_dict(corpus_dir: str) -> str:
    os.makedirs(corpus_dir, exist_ok=True)
    for i, s in enumerate(seed_inputs()):
        with open(os.path.join(corpus_dir, f"seed_{i:03d}"), "wb") as f:
            f.write(s)
    dict_path = os.path.join(corpus_dir + ".dict")
    with open(dict_path, "w", encoding="utf-8") as f:
        for tok in DICTIONARY:
            esc = "".join(c if (c.isascii() and c.isprintable() and c not in '"\\') else
                          "".join(f"\\x{b:02x}" for b in c.encode("utf-8")) for c in tok)
            f.write(f'"{esc}"\n')
    return dict_path


# ---------------------------------------------------------------------------- checks


def classify(msg: str) -> int:
    """One branch per native error class (coverage feedback for the fuzzer)."""
    if "too short" in msg:
        return 1
    if "header length" in msg:
        return 2
    if "byte order mark" in msg:
        return 3
    if "nesting deeper" in msg:
        return 4
    if "duplicate object key" in msg:
        return 5
    if "surrogate" in msg:
        return 6
    if "invalid UTF-8" in msg or "truncated UTF-8" in msg:
        return 7
    if "control character" in msg:
        return 8
    if "escape" in msg:
        return 9
    if "leading zeros" in msg:
        return 10
    if "out of range" in msg:
        return 11
    if "exponent" in msg or "decimal point" in msg or "digit in a number" in msg:
        return 12
    if "trailing comma" in msg:
        return 13
    if "after the JSON value" in msg:
        return 14
    if "unterminated" in msg:
        return 15
    if "literal" in msg:
        return 16
    if "malformed JSON" in msg:
        return 17
    if "must be a JSON object" in msg:
        return 18
    if "__metadata__" in msg:
        return 19
    if "expected an object" in msg:
        return 20
    if "missing field" in msg:
        return 21
    if "field 'dtype'" in msg:
        return 22
    if "unsupported dtype" in msg:
        return 23
    if "negative dimension" in msg:
        return 24
    if "field 'shape'" in msg:
        return 25
    if "fit in 64 bits" in msg or "too large" in msg:
        return 26
    if "data_offsets" in msg and "begin > end" in msg:
        return 27
    if "beyond the data region" in msg:
        return 28
    if "field 'data_offsets'" in msg:
        return 29
    if "byte size does not match" in msg:
        return 30
    if "overlap" in msg:
        return 31
    return 0


def check_image(img: bytes) -> None:
    try:
        out = _core.parse_safetensors_bytes(img, "fuzz.safetensors")
    except DFlash2Error as e:
        assert "fuzz.safetensors" in str(e), str(e)
        classify(str(e))
        return
    # Accepted: cross-check with Python's own reading of the header.
    (n,) = struct.unpack("<Q", img[:8])
    data_size = len(img) - 8 - n
    assert data_size >= 0
    header = json.loads(img[8:8 + n].decode("utf-8"))
    assert isinstance(header, dict)
    meta = header.pop("__metadata__", {})
    assert isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    assert list(out) == sorted(header), (list(out), sorted(header))
    ranges = []
    for name, info in out.items():
        h = header[name]
        assert info["dtype"] == h["dtype"] and info["dtype"] in SIZES
        assert info["shape"] == h["shape"] and all(isinstance(d, int) and d >= 0 for d in info["shape"])
        b, e = h["data_offsets"]
        assert 0 <= b <= e <= data_size
        assert e - b == SIZES[info["dtype"]] * math.prod(info["shape"])
        if e > b:
            ranges.append((b, e))
    ranges.sort()
    for (b0, e0), (b1, e1) in zip(ranges, ranges[1:]):
        assert e0 <= b1, (b0, e0, b1, e1)


def same_json(ours, ref) -> bool:
    if isinstance(ref, bool) or ref is None:
        return ours is ref
    if isinstance(ref, int):
        if isinstance(ours, bool):
            return False
        if isinstance(ours, int):
            return ours == ref
        return isinstance(ours, float) and ours == float(ref) and not (-(2**63) <= ref < 2**63)
    if isinstance(ref, float):
        return isinstance(ours, float) and (ours == ref or (math.isnan(ours) and math.isnan(ref)))
    if isinstance(ref, str):
        return ours == ref
    if isinstance(ref, list):
        return isinstance(ours, list) and len(ours) == len(ref) and all(same_json(a, b) for a, b in zip(ours, ref))
    if isinstance(ref, dict):
        return (isinstance(ours, dict) and list(ours) == list(ref)
                and all(same_json(ours[k], ref[k]) for k in ref))
    return False


def check_json(text: bytes) -> None:
    try:
        ours = _core._parse_json(text)
    except DFlash2Error as e:
        assert "malformed JSON at byte" in str(e), str(e)
        classify(str(e))
        return
    ref = json.loads(text.decode("utf-8"))
    assert same_json(ours, ref), (text[:200], ours, ref)


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % 3, data[1:]
    if mode == 0:
        check_image(body)
    elif mode == 1:
        if len(body) < 2:
            return
        (size,) = struct.unpack("<H", body[:2])
        header = body[2:]
        check_image(struct.pack("<Q", len(header)) + header + bytes(min(size, MAX_DATA)))
    else:
        check_json(body)


for _f in (classify, check_image, same_json, check_json, TestOneInput):
    globals()[_f.__name__] = atheris.instrument_func(_f)


def main(argv: list[str]) -> None:
    flags = [a for a in argv[1:] if a.startswith("-")]
    dirs = [a for a in argv[1:] if not a.startswith("-")]
    corpus = dirs[0] if dirs else tempfile.mkdtemp(prefix="dflash2_fuzz_st_")
    dict_path = write_corpus_and_dict(corpus)
    if not any(f.startswith("-dict=") for f in flags):
        flags.append(f"-dict={dict_path}")
    if not any(f.startswith("-max_len=") for f in flags):
        flags.append("-max_len=8192")
    print(f"fuzz_safetensors: corpus {corpus}, dflash2_rt {dflash2_rt.__version__}", file=sys.stderr, flush=True)
    atheris.Setup([argv[0], *flags, corpus, *dirs[1:]], TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
