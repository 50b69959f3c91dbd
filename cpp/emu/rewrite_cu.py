#!/usr/bin/env python3
"""Rewrites a CUDA source for the CPU emulation (cpp/emu/cuda_emu.h), keeping its line numbers.

    python rewrite_cu.py IN.cu OUT.cpp [--backend]

- `kernel<T...><<<grid, block[, smem[, stream]]>>>(args)` becomes
  `::emu::Launcher(grid, block[, smem[, stream]]).run(kernel<T...>, args)` (with --backend,
  the backend's files: `.backend()` too, so the emulator checks each kernel's pdl_enter).
- `extern __shared__ [__align__(n)] T name[];` becomes a pointer to the launch's dynamic
  shared memory.
A `#line` directive keeps compiler messages and __FILE__ pointing at the original file.
"""
import json
import re
import sys


def _kernel_start(src: str, end: int) -> int:
    """Start of the kernel expression that ends just before `end` (an identifier, maybe
    qualified, maybe with template arguments)."""
    i = end
    while i > 0 and src[i - 1].isspace():
        i -= 1
    if src[i - 1] == ">":  # template arguments: match <...> backwards
        depth = 0
        j = i - 1
        while j >= 0:
            c = src[j]
            if c == ">":
                depth += 1
            elif c == "<":
                depth -= 1
                if depth == 0:
                    break
            j -= 1
        i = j
    while i > 0 and (src[i - 1].isalnum() or src[i - 1] in "_:"):
        i -= 1
    return i


def _matching(src: str, open_idx: int, o: str, c: str) -> int:
    depth = 0
    for j in range(open_idx, len(src)):
        if src[j] == o:
            depth += 1
        elif src[j] == c:
            depth -= 1
            if depth == 0:
                return j
    raise SystemExit(f"rewrite_cu: unbalanced {o}{c} at offset {open_idx}")


def rewrite(src: str, backend: bool = False) -> str:
    out = []
    pos = 0
    while True:
        k = src.find("<<<", pos)
        if k < 0:
            out.append(src[pos:])
            break
        start = _kernel_start(src, k)
        kernel = src[start:k].strip()
        close = src.find(">>>", k)
        cfg = src[k + 3:close]
        p = close + 3
        while src[p].isspace():
            p += 1
        if src[p] != "(":
            raise SystemExit(f"rewrite_cu: a launch without arguments list near {kernel!r}")
        q = _matching(src, p, "(", ")")
        args = src[p + 1:q]
        old = src[start:q + 1]
        name = json.dumps(" ".join(kernel.split()))
        # the backend's kernels must begin with detail::pdl_enter() (pdl.cuh); the emulator checks it
        check = ".backend()" if backend else ""
        call = f"::emu::Launcher({cfg}).named({name}){check}.run({kernel}{', ' + args if args.strip() else ''})"
        call = call.replace("\n", " ") + "\n" * old.count("\n")
        out.append(src[pos:start])
        out.append(call)
        pos = q + 1
    text = "".join(out)
    text = re.sub(
        r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([A-Za-z_][\w:]*(?:\s+[A-Za-z_][\w:]*)*)\s+(\w+)\s*\[\s*\]\s*;",
        r"\1* \2 = reinterpret_cast<\1*>(::emu::g_dyn_smem);",
        text,
    )
    return text


def main() -> None:
    src_path, out_path = sys.argv[1], sys.argv[2]
    backend = "--backend" in sys.argv[3:]
    with open(src_path) as f:
        src = f.read()
    text = f'#line 1 "{src_path}"\n' + rewrite(src, backend)
    with open(out_path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
