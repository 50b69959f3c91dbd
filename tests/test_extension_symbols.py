"""What the extension module exports: nothing of the static archives linked into it.

On the lent H200 machines the compiler links libstdc++ statically; exported, its facet ids
are STB_GNU_UNIQUE symbols that the dynamic linker binds process-wide, so with torch, numpy
or tokenizers in the same process two libstdc++ copies shared ids that index different
facet tables and the module crashed at import (std::basic_ostream::_M_insert<long> in
build_info(), 2026-12-04). CMakeLists.txt links _core with -Wl,--exclude-libs,ALL; these
tests read the module's dynamic symbol table (a small ELF reader, no binutils needed) and
fail if that ever stops holding, with any toolchain.
"""
import struct
import sys

import pytest

import dflash2_rt

SHT_DYNSYM = 11
STB_GNU_UNIQUE = 10


def dynamic_symbols(path):
    """[(name, binding, defined)] of an ELF64 little-endian file's .dynsym."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        pytest.skip(f"{path} is not a 64-bit little-endian ELF file")
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(e_shnum):
        (_name, sh_type, _flags, _addr, sh_offset, sh_size, sh_link, _info, _align,
         sh_entsize) = struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize)
        sections.append((sh_type, sh_offset, sh_size, sh_link, sh_entsize))
    out = []
    for sh_type, off, size, link, entsize in sections:
        if sh_type != SHT_DYNSYM:
            continue
        str_off = sections[link][1]
        for k in range(size // entsize):
            st_name, st_info, _other, st_shndx, _value, _size = struct.unpack_from("<IBBHQQ", data, off + k * entsize)
            end = data.index(b"\0", str_off + st_name)
            out.append((data[str_off + st_name:end].decode("ascii", "replace"), st_info >> 4, st_shndx != 0))
    return out


@pytest.fixture(scope="module")
def symbols():
    if not sys.platform.startswith("linux"):
        pytest.skip("the symbol-export rule is about ELF shared objects (Linux)")
    return dynamic_symbols(dflash2_rt._core.__file__)


def test_module_init_is_exported(symbols):
    assert ("PyInit__core", 1, True) in symbols  # STB_GLOBAL, defined


def test_no_gnu_unique_symbols_are_exported(symbols):
    unique = [name for name, bind, defined in symbols if defined and bind == STB_GNU_UNIQUE]
    assert not unique, f"{len(unique)} STB_GNU_UNIQUE symbols exported, e.g. {unique[:5]}"


def test_the_core_library_stays_inside(symbols):
    # libdflash2.a's own functions (namespace dflash2) are hidden by --exclude-libs
    ours = [name for name, _bind, defined in symbols if defined and name.startswith("_ZN7dflash2")]
    assert not ours, f"{len(ours)} symbols of libdflash2.a exported, e.g. {ours[:5]}"
