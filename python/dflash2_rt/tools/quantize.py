"""Quantizes a BF16/F16/F32 GLM-5.x (``glm_moe_dsa``) checkpoint to FP8 block-128 or NVFP4,
and turns a quantized checkpoint back into float weights. numpy only.

    python -m dflash2_rt.tools.quantize SRC_DIR DST_DIR --format fp8|nvfp4
        [--nvfp4-scope experts|mlp] [--shards N] [--input-amax A] [--force]

FP8 block-128 (zai-org/GLM-5.x-FP8 layout): every Linear weight [N, K] (attention and
indexer projections, dense MLPs, shared and routed experts, the MTP layer's ``eh_proj``)
becomes ``weight`` F8_E4M3 + ``weight_scale_inv`` F32 [ceil(N/128), ceil(K/128)] with
scale = amax(block) / 448 and W ~= fp8 * scale. Kept in their stored dtype: embeddings,
``lm_head`` / ``shared_head.head``, norms, the router (``mlp.gate.weight``,
``e_score_correction_bias``) and the indexer's ``weights_proj``. config.json gets
``quantization_config`` {quant_method fp8, weight_block_size [128, 128], modules_to_not_convert}.

NVFP4 (NVIDIA ModelOpt layout): routed experts only (``--nvfp4-scope experts``, as in
GLM-5.3-NVFP4) or every MLP (``mlp``: also shared experts and dense MLPs); the MTP layer
stays unquantized. Per weight: ``weight`` U8 [N, K/2] (low nibble = even k),
``weight_scale`` F8_E4M3 [N, K/16], ``weight_scale_2`` F32 scalar = amax / (6 * 448)
(gate_proj and up_proj of one MLP share it), ``input_scale`` F32 scalar. There is no
calibration: ``input_scale`` = ``--input-amax`` / (6 * 448) is a static guess (weight-only
W4A16 kernels ignore it). Writes ``hf_quant_config.json`` and copies config.json.

Other files of SRC_DIR (tokenizer, generation config, chat template) are copied. The
output mirrors the source's files (one output file per source file) unless ``--shards N``
asks for N shards; tensors are read through mmap and written one output file at a time,
so memory use is bounded by the largest output file.

Python API: :func:`quantize_checkpoint`, :func:`dequantize_checkpoint`, and the array
level :func:`quantize_fp8_block128` / :func:`quantize_nvfp4` with their inverses.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np

from ..checkpoint import INDEX_NAME, Checkpoint, save_safetensors

__all__ = [
    "FP8_MAX",
    "E2M1_VALUES",
    "fp8_e4m3_to_f32",
    "f32_to_fp8_e4m3",
    "quantize_fp8_block128",
    "dequantize_fp8_block128",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "fp8_modules",
    "nvfp4_modules",
    "quantize_checkpoint",
    "dequantize_checkpoint",
    "read_tensors",
    "main",
]

FP8_MAX = 448.0
NVFP4_GROUP = 16
FP8_BLOCK = 128
DEFAULT_INPUT_AMAX = 16.0
QUANT_CONFIG_NAME = "hf_quant_config.json"
_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")

PathLike = Union[str, os.PathLike]

# ---------------------------------------------------------------------------- fp8 e4m3 (fn)


def _fp8_table() -> np.ndarray:
    """float32 value of each of the 256 E4M3FN codes (bias 7, no infinities, 0x7F/0xFF NaN)."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    vals = sign * mag
    vals[(codes & 0x7F) == 0x7F] = np.nan
    return vals.astype(np.float32)


_FP8_VALUES = _fp8_table()
_FP8_POS = _FP8_VALUES[:0x7F].astype(np.float64)  # codes 0x00..0x7E: 0 .. 448, increasing


def fp8_e4m3_to_f32(u8: np.ndarray) -> np.ndarray:
    """E4M3FN bit patterns (uint8) -> float32 (exact)."""
    return _FP8_VALUES[np.asarray(u8, dtype=np.uint8)]


def f32_to_fp8_e4m3(x: np.ndarray) -> np.ndarray:
    """float -> E4M3FN bit patterns (uint8): round to nearest, ties to even, saturating at
    +-448 (no NaN for large finite inputs). NaN inputs become 0x7F."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), FP8_MAX)
    hi = np.searchsorted(_FP8_POS, a, side="left")  # first code whose value >= a
    hi = np.minimum(hi, len(_FP8_POS) - 1)
    lo = np.maximum(hi - 1, 0)
    dlo = a - _FP8_POS[lo]
    dhi = _FP8_POS[hi] - a
    take_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(take_hi, hi, lo).astype(np.uint8)
    code = np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), code).astype(np.uint8)


# ---------------------------------------------------------------------------- FP8 block-128


def quantize_fp8_block128(w: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """W [N, K] -> (fp8 codes uint8 [N, K], scale_inv float32 [ceil(N/b), ceil(K/b)]) with
    scale = amax(block) / 448 (1.0 for an all-zero block) and W ~= fp8 * scale."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_block128: expected a 2-D weight, found shape {list(w.shape)}")
    n, k = w.shape
    sn, sk = -(-n // block), -(-k // block)
    padded = np.zeros((sn * block, sk * block), np.float32)
    padded[:n, :k] = w
    blocks = padded.reshape(sn, block, sk, block)
    amax = np.abs(blocks).max(axis=(1, 3)).astype(np.float64)
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    expanded = np.repeat(np.repeat(scale.astype(np.float64), block, 0), block, 1)[:n, :k]
    q = f32_to_fp8_e4m3(w.astype(np.float64) / expanded)
    return q, scale


def dequantize_fp8_block128(q: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """(fp8 codes [N, K], scale_inv [ceil(N/b), ceil(K/b)]) -> float32 [N, K]."""
    q = np.asarray(q, dtype=np.uint8)
    n, k = q.shape
    s = np.asarray(scale_inv, dtype=np.float32)
    if s.shape != (-(-n // block), -(-k // block)):
        raise ValueError(f"dequantize_fp8_block128: scale_inv must be [{-(-n // block)}, {-(-k // block)}] "
                         f"for a [{n}, {k}] weight, found {list(s.shape)}")
    expanded = np.repeat(np.repeat(s, block, 0), block, 1)[:n, :k]
    return (fp8_e4m3_to_f32(q) * expanded).astype(np.float32)


# ---------------------------------------------------------------------------- NVFP4

# E2M1 code -> value (bit 3 = sign).
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
_E2M1_MID = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float64)


def _e2m1_encode(v: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code of each value (ties to the even code, saturating at +-6)."""
    a = np.abs(v)
    c = np.searchsorted(_E2M1_MID, a, side="left")  # number of midpoints strictly below a
    tie = (c < len(_E2M1_MID)) & (_E2M1_MID[np.minimum(c, len(_E2M1_MID) - 1)] == a) & (c % 2 == 1)
    c = (c + tie).astype(np.uint8)
    return np.where(np.signbit(v), c | 8, c).astype(np.uint8)


def nvfp4_global_scale(*weights: np.ndarray) -> np.float32:
    """weight_scale_2 shared by ``weights``: max amax / (6 * 448) (1.0 when all are zero)."""
    amax = max(float(np.abs(np.asarray(w, np.float32)).max()) if np.asarray(w).size else 0.0 for w in weights)
    return np.float32(amax / (6.0 * FP8_MAX)) if amax > 0 else np.float32(1.0)


def quantize_nvfp4(w: np.ndarray, global_scale: Optional[float] = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """W [N, K] (K % 16 == 0) -> (packed uint8 [N, K/2] with the even k in the low nibble,
    block scales as E4M3 codes uint8 [N, K/16], weight_scale_2 float32). W ~= e2m1 * fp8(scale) * g.
    ``global_scale`` defaults to amax(W) / (6 * 448); pass a shared one for gate/up pairs."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % NVFP4_GROUP:
        raise ValueError(f"quantize_nvfp4: expected a 2-D weight with K divisible by {NVFP4_GROUP}, "
                         f"found shape {list(w.shape)}")
    n, k = w.shape
    g = np.float32(nvfp4_global_scale(w) if global_scale is None else global_scale)
    if not (np.isfinite(g) and g > 0):
        raise ValueError(f"quantize_nvfp4: global scale must be positive and finite, found {g}")
    blocks = w.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP).astype(np.float64)
    bscale = np.abs(blocks).max(-1) / 6.0 / np.float64(g)
    scale_u8 = f32_to_fp8_e4m3(bscale)
    s = fp8_e4m3_to_f32(scale_u8).astype(np.float64) * np.float64(g)
    safe = np.where(s > 0, s, 1.0)
    vals = np.where(s[..., None] > 0, blocks / safe[..., None], 0.0)
    code = _e2m1_encode(vals).reshape(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale_u8, g


def dequantize_nvfp4(packed: np.ndarray, scale_u8: np.ndarray, global_scale: float) -> np.ndarray:
    """(packed uint8 [N, K/2], E4M3 scale codes [N, K/16], weight_scale_2) -> float32 [N, K]."""
    packed = np.asarray(packed, dtype=np.uint8)
    n, kh = packed.shape
    scale_u8 = np.asarray(scale_u8, dtype=np.uint8)
    if scale_u8.shape != (n, 2 * kh // NVFP4_GROUP):
        raise ValueError(f"dequantize_nvfp4: weight_scale must be [{n}, {2 * kh // NVFP4_GROUP}] for a packed "
                         f"[{n}, {kh}] weight, found {list(scale_u8.shape)}")
    codes = np.empty((n, 2 * kh), np.uint8)
    codes[:, 0::2] = packed & 15
    codes[:, 1::2] = packed >> 4
    s = np.repeat(fp8_e4m3_to_f32(scale_u8), NVFP4_GROUP, 1)
    return (E2M1_VALUES[codes] * s * np.float32(global_scale)).astype(np.float32)


# ---------------------------------------------------------------------------- reading


class _Source:
    """Zero-copy reads from a checkpoint validated by the native core (mmap per file)."""

    _STORAGE = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8, "U8": np.uint8,
                "I32": np.int32, "I64": np.int64}

    def __init__(self, path: PathLike):
        self.ck = Checkpoint.open(os.fspath(path))
        self.names = list(self.ck.names())
        self.infos = {n: self.ck.info(n) for n in self.names}
        self._maps: dict[str, np.memmap] = {}

    def _map(self, path: str) -> np.memmap:
        if path not in self._maps:
            with open(path, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + hlen)
        return self._maps[path]

    def dtype(self, name: str) -> str:
        return self.infos[name]["dtype"]

    def shape(self, name: str) -> tuple:
        return tuple(self.infos[name]["shape"])

    def raw(self, name: str) -> np.ndarray:
        """The stored bits (uint16 for BF16, uint8 for F8_E4M3), read-only."""
        info = self.infos[name]
        dt = info["dtype"]
        if dt not in self._STORAGE:
            raise ValueError(f"tensor '{name}': unsupported dtype {dt}")
        b, e = info["data_offsets"]
        return self._map(info["path"])[b:e].view(np.dtype(self._STORAGE[dt]).newbyteorder("<")).reshape(info["shape"])

    def f32(self, name: str) -> np.ndarray:
        raw = self.raw(name)
        dt = self.dtype(name)
        if dt == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if dt == "F8_E4M3":
            return fp8_e4m3_to_f32(raw)
        return raw.astype(np.float32)

    def stored(self, name: str):
        """A value save_safetensors writes back unchanged: array or (bits, dtype)."""
        dt = self.dtype(name)
        raw = np.array(self.raw(name))
        return (raw, dt) if dt in ("BF16", "F8_E4M3") else raw

    def files(self) -> list[str]:
        return list(self.ck.files())


def read_tensors(path: PathLike) -> dict:
    """Every tensor of a checkpoint as it is stored: numpy arrays, or (bits, 'BF16' / 'F8_E4M3')."""
    src = _Source(path)
    return {n: src.stored(n) for n in src.names}


# ---------------------------------------------------------------------------- selection

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
_SHARED_RE = re.compile(r"\.mlp\.shared_experts\.(gate|up|down)_proj$")
_DENSE_RE = re.compile(r"^model\.layers\.\d+\.mlp\.(gate|up|down)_proj$")
# Linear modules that stay in their stored dtype in FP8 checkpoints.
_FP8_KEEP = (re.compile(r"(^|\.)embed_tokens$"), re.compile(r"(^|\.)lm_head$"), re.compile(r"\.shared_head\.head$"),
             re.compile(r"\.mlp\.gate$"), re.compile(r"\.indexer\.weights_proj$"))


def _linear_modules(names: Iterable[str], shapes: Callable[[str], tuple]) -> list[str]:
    """Module prefixes of every 2-D ``<prefix>.weight`` (Linear and embedding weights)."""
    out = []
    for n in names:
        if n.endswith(".weight") and len(shapes(n)) == 2:
            out.append(n[: -len(".weight")])
    return sorted(out)


def fp8_modules(names: Iterable[str], shapes: Callable[[str], tuple]) -> tuple[list[str], list[str]]:
    """(modules to quantize, 2-D modules kept) for the FP8 block-128 format."""
    quant, keep = [], []
    for m in _linear_modules(names, shapes):
        (keep if any(p.search(m) for p in _FP8_KEEP) else quant).append(m)
    return quant, keep


def nvfp4_modules(names: Iterable[str], shapes: Callable[[str], tuple], scope: str,
                  num_hidden_layers: Optional[int]) -> tuple[list[str], list[str]]:
    """(modules to quantize, 2-D modules kept) for NVFP4 with scope 'experts' or 'mlp'.
    Layers at index >= num_hidden_layers (the MTP layer) stay unquantized."""
    if scope not in ("experts", "mlp"):
        raise ValueError(f"nvfp4 scope must be 'experts' or 'mlp', found '{scope}'")
    quant, keep = [], []
    for m in _linear_modules(names, shapes):
        lm = _LAYER_RE.match(m + ".")
        mtp = lm is not None and num_hidden_layers is not None and int(lm.group(1)) >= num_hidden_layers
        hit = bool(_EXPERT_RE.search(m))
        if scope == "mlp":
            hit = hit or bool(_SHARED_RE.search(m)) or bool(_DENSE_RE.match(m))
        (quant if hit and not mtp else keep).append(m)
    return quant, keep


def _gate_up_partner(module: str) -> Optional[str]:
    if module.endswith(".gate_proj"):
        return module[: -len("gate_proj")] + "up_proj"
    if module.endswith(".up_proj"):
        return module[: -len("up_proj")] + "gate_proj"
    return None


# ---------------------------------------------------------------------------- writing plan


def _group_names(names: list[str], sizes: dict, shards: int) -> list[list[str]]:
    """Splits name-ordered tensors into ``shards`` contiguous, non-empty groups of balanced size."""
    names = sorted(names)
    shards = max(1, min(shards, len(names)))
    total = max(sum(sizes[n] for n in names), 1)
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc, g = 0, 0
    for i, n in enumerate(names):
        want = min(int((acc + sizes[n] / 2) * shards // total), shards - 1)
        g = min(max(want, g), g + 1) if i else 0      # monotone, never skipping a group
        g = max(g, shards - (len(names) - i))          # enough names left for the later groups
        groups[g].append(n)
        acc += sizes[n]
    return groups


def _out_size(fmt: str, shape: tuple, stored_bytes: int) -> int:
    n, k = shape
    if fmt == "fp8":
        return n * k + 4 * (-(-n // FP8_BLOCK)) * (-(-k // FP8_BLOCK))
    if fmt == "nvfp4":
        return n * k // 2 + n * k // NVFP4_GROUP + 8
    return stored_bytes


def _shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _prepare_dst(dst: str, force: bool) -> None:
    if os.path.isdir(dst) and os.listdir(dst):
        if not force:
            raise FileExistsError(f"destination '{dst}' exists and is not empty (use --force / force=True)")
        for f in os.listdir(dst):
            if f.endswith(".safetensors") or f in (INDEX_NAME, QUANT_CONFIG_NAME):
                os.remove(os.path.join(dst, f))
    os.makedirs(dst, exist_ok=True)


def quantize_checkpoint(src: PathLike, dst: PathLike, fmt: str = "fp8", scope: str = "experts",
                        shards: Optional[int] = None, input_amax: float = DEFAULT_INPUT_AMAX,
                        force: bool = False, log: Optional[Callable[[str], None]] = None) -> dict:
    """Quantizes the checkpoint directory ``src`` into ``dst`` (see the module docstring).
    ``fmt``: 'fp8' or 'nvfp4'; ``scope`` (nvfp4): 'experts' or 'mlp'; ``shards``: number of
    output files (default: one per source file). Returns a summary dict
    {format, quantized: [module], kept: [module], files: [name]}."""
    src, dst = os.fspath(src), os.fspath(dst)
    fmt = fmt.lower()
    if fmt not in ("fp8", "nvfp4"):
        raise ValueError(f"unsupported format '{fmt}' (supported: fp8, nvfp4)")
    if not (input_amax > 0 and np.isfinite(input_amax)):
        raise ValueError(f"input_amax must be positive and finite, found {input_amax}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("source and destination must differ")
    if not os.path.isdir(src):
        raise FileNotFoundError(f"source checkpoint directory '{src}' does not exist")
    cfg_path = os.path.join(src, "config.json")
    config = {}
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    if config.get("quantization_config") or os.path.exists(os.path.join(src, QUANT_CONFIG_NAME)):
        raise ValueError(f"'{src}' is already quantized (quantization_config / {QUANT_CONFIG_NAME} present)")

    source = _Source(src)
    for n in source.names:
        if source.dtype(n) in ("F8_E4M3", "U8"):
            raise ValueError(f"'{src}' is already quantized: tensor '{n}' is {source.dtype(n)}")
        if n.rsplit(".", 1)[-1] in _SCALE_SUFFIXES:
            raise ValueError(f"'{src}' looks quantized: it has a scale tensor '{n}'")

    if fmt == "fp8":
        quant, keep = fp8_modules(source.names, source.shape)
    else:
        quant, keep = nvfp4_modules(source.names, source.shape, scope, config.get("num_hidden_layers"))
        for m in quant:
            k = source.shape(m + ".weight")[1]
            if k % NVFP4_GROUP:
                raise ValueError(f"'{m}.weight' has {k} input features, not divisible by {NVFP4_GROUP} (NVFP4)")
    quant_set = set(quant)

    # output size of each source tensor (its scales travel with it)
    sizes = {}
    for n in source.names:
        stored = int(source.infos[n]["nbytes"])
        m = n[: -len(".weight")] if n.endswith(".weight") else None
        sizes[n] = _out_size(fmt, source.shape(n), stored) if m in quant_set else stored

    if shards is None:
        by_file: dict[str, list[str]] = {}
        for n in source.names:
            by_file.setdefault(source.infos[n]["path"], []).append(n)
        groups = [sorted(by_file[p]) for p in sorted(by_file)]
    else:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, found {shards}")
        groups = _group_names(source.names, sizes, shards)
    file_names = _shard_file_names(len(groups))

    _prepare_dst(dst, force)
    g_cache: dict[str, np.float32] = {}

    def global_scale(module: str) -> np.float32:
        if module in g_cache:
            return g_cache[module]
        partner = _gate_up_partner(module)
        ws = [source.f32(module + ".weight")]
        if partner is not None and partner in quant_set:
            ws.append(source.f32(partner + ".weight"))
        g = nvfp4_global_scale(*ws)
        g_cache[module] = g
        if partner is not None and partner in quant_set:
            g_cache[partner] = g
        return g

    in_scale = np.array(np.float32(input_amax / (6.0 * FP8_MAX)))
    weight_map = {}
    total = 0
    for fname, group in zip(file_names, groups):
        out: dict = {}
        for n in group:
            m = n[: -len(".weight")] if n.endswith(".weight") else None
            if m in quant_set:
                w = source.f32(n)
                if fmt == "fp8":
                    q, s = quantize_fp8_block128(w)
                    out[m + ".weight"] = (q, "F8_E4M3")
                    out[m + ".weight_scale_inv"] = s
                else:
                    p, s, g = quantize_nvfp4(w, global_scale(m))
                    out[m + ".weight"] = p
                    out[m + ".weight_scale"] = (s, "F8_E4M3")
                    out[m + ".weight_scale_2"] = np.array(np.float32(g))
                    out[m + ".input_scale"] = in_scale.copy()
            else:
                out[n] = source.stored(n)
        save_safetensors(os.path.join(dst, fname), out, metadata={"format": "pt"})
        for name, v in out.items():
            arr = v[0] if isinstance(v, tuple) else v
            total += int(np.asarray(arr).nbytes)
            weight_map[name] = fname
        if log:
            log(f"wrote {fname}: {len(out)} tensors")
    if len(file_names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(dst, INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")

    # metadata files
    for f in sorted(os.listdir(src)):
        p = os.path.join(src, f)
        if not os.path.isfile(p) or f.endswith(".safetensors") or f in (INDEX_NAME, "config.json"):
            continue
        shutil.copyfile(p, os.path.join(dst, f))
    new_cfg = dict(config)
    if fmt == "fp8":
        new_cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": keep,
        }
    if config or fmt == "fp8":
        with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
            json.dump(new_cfg, f, indent=2)
            f.write("\n")
    if fmt == "nvfp4":
        hq = {
            "producer": {"name": "modelopt", "version": "dflash2_rt.tools.quantize"},
            "quantization": {"quant_algo": "NVFP4", "group_size": NVFP4_GROUP, "kv_cache_quant_algo": None,
                             "exclude_modules": keep},
        }
        with open(os.path.join(dst, QUANT_CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(hq, f, indent=2)
            f.write("\n")
    return {"format": fmt if fmt == "fp8" else f"nvfp4-{scope}", "quantized": quant, "kept": keep,
            "files": file_names}


# ---------------------------------------------------------------------------- dequantizing


def dequantize_checkpoint(path: PathLike) -> dict:
    """Every tensor of a (quantized or not) checkpoint as float32 numpy arrays under the
    original names: FP8 block-128 and NVFP4 weights are dequantized into ``<prefix>.weight``
    and their scale tensors dropped; BF16/F16/F32 tensors are widened."""
    src = _Source(path)
    names = set(src.names)
    out: dict = {}
    consumed = set()
    for n in src.names:
        if not n.endswith(".weight"):
            continue
        prefix = n[: -len(".weight")]
        dt = src.dtype(n)
        if dt == "F8_E4M3":
            sn = prefix + ".weight_scale_inv"
            if sn not in names:
                raise ValueError(f"'{n}' is F8_E4M3 but '{sn}' is missing")
            out[n] = dequantize_fp8_block128(src.raw(n), src.f32(sn))
            consumed.update({n, sn})
        elif dt == "U8":
            sn, gn = prefix + ".weight_scale", prefix + ".weight_scale_2"
            missing = [x for x in (sn, gn) if x not in names]
            if missing:
                raise ValueError(f"'{n}' is U8 (NVFP4) but {missing} missing")
            g = float(src.f32(gn).reshape(-1)[0])
            out[n] = dequantize_nvfp4(src.raw(n), src.raw(sn), g)
            consumed.update({n, sn, gn, prefix + ".input_scale"} & names)
    for n in src.names:
        if n not in consumed:
            out[n] = np.array(src.f32(n), dtype=np.float32)
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash2_rt.tools.quantize",
                                 description="Quantize a glm_moe_dsa checkpoint to FP8 block-128 or NVFP4 (ModelOpt layout).")
    ap.add_argument("src", help="source checkpoint directory (BF16/F16/F32)")
    ap.add_argument("dst", help="destination directory")
    ap.add_argument("--format", required=True, choices=["fp8", "nvfp4"])
    ap.add_argument("--nvfp4-scope", default="experts", choices=["experts", "mlp"],
                    help="nvfp4: routed experts only (default) or every MLP (+ shared experts, dense MLPs)")
    ap.add_argument("--shards", type=int, default=None, help="number of output files (default: as the source)")
    ap.add_argument("--input-amax", type=float, default=DEFAULT_INPUT_AMAX,
                    help=f"nvfp4: assumed activation amax for input_scale (default {DEFAULT_INPUT_AMAX})")
    ap.add_argument("--force", action="store_true", help="write into a non-empty destination")
    args = ap.parse_args(argv)
    try:
        summary = quantize_checkpoint(args.src, args.dst, args.format, args.nvfp4_scope, args.shards,
                                      args.input_amax, args.force, log=print)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{summary['format']}: quantized {len(summary['quantized'])} weights, kept {len(summary['kept'])} "
          f"2-D weights unquantized, {len(summary['files'])} file(s) in {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
