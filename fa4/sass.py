"""SASS of a compiled kernel config, on any machine (no GPU): the cubins inside an exported object,
disassembled with nvdisasm (the ``nvidia-cuda-nvdisasm`` wheel), and an opcode census.

Used by ``tools/sass.py`` and by the compile tests that check a kernel really uses the instructions
its family is about (HGMMA and UTMALDG for sm90).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
from typing import Iterator, Optional


def cubins(data: bytes) -> Iterator[bytes]:
    """The CUDA ELF images (machine 190) embedded in an object file."""
    i = data.find(b"\x7fELF", 1)
    while i != -1:
        if data[i + 4] == 2 and struct.unpack_from("<H", data, i + 18)[0] == 190:
            phoff, shoff = struct.unpack_from("<QQ", data, i + 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, i + 54)
            yield data[i : i + max(shoff + shentsize * shnum, phoff + phentsize * phnum)]
        i = data.find(b"\x7fELF", i + 1)


def nvdisasm_path() -> Optional[str]:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for sub in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm"):
            if os.path.exists(os.path.join(root, sub)):
                return os.path.join(root, sub)
    return None


def disassemble_object(obj_path: str, encodings: bool = False) -> str:
    """The SASS of every cubin in ``obj_path``; ``encodings``: with each instruction's encoding
    (``nvdisasm -hex``: opcode, operands and the scheduling control bits)."""
    tool = nvdisasm_path()
    if tool is None:
        raise RuntimeError("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    data = open(obj_path, "rb").read()
    texts = []
    with tempfile.TemporaryDirectory() as d:
        for n, cubin in enumerate(cubins(data)):
            path = os.path.join(d, f"{n}.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            flags = ["-c", "-hex"] if encodings else ["-c"]
            texts.append(subprocess.run([tool, *flags, path], capture_output=True, text=True, check=True).stdout)
    return "\n".join(texts)


@contextlib.contextmanager
def exported(cfg) -> Iterator[str]:
    """Compile ``cfg`` (uncached) and export it: the object file's path, for the ``with`` block."""
    from fa4 import jit

    fn = jit.compile_uncached(cfg, engine=False)  # export only (Note [Export without an engine])
    with tempfile.TemporaryDirectory() as d:
        obj = os.path.join(d, "k.o")
        fn.export_to_c(obj, function_name=jit.EXPORT_SYMBOL)
        yield obj


def disassemble(cfg, encodings: bool = False) -> str:
    """Compile ``cfg`` (uncached) and return its SASS (``encodings``: :func:`disassemble_object`'s)."""
    with exported(cfg) as obj:
        return disassemble_object(obj, encodings)


def without_addresses(sass: str) -> str:
    """``sass`` without its instruction addresses (``/*04d0*/``), encodings kept (``/* 0x... */``)."""
    return re.sub(r"/\*[0-9a-f]{4,}\*/", "", sass)


def opcode_counts(sass: str) -> collections.Counter:
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def count(ops: collections.Counter, key: str) -> int:
    """Instructions whose opcode is ``key`` or ``key.<modifiers>``."""
    return sum(v for op, v in ops.items() if op == key or op.startswith(key + "."))


def loop_bodies(sass: str) -> list[list[str]]:
    """The instructions of every loop in ``sass``: from a label to a later branch back to it
    (inner loops and the loops around them alike), in address order."""
    instrs: list[str] = []
    labels: dict[str, int] = {}
    loops = []
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m:
            instrs.append(m.group(1))
            b = re.search(r"BRA.*`\((\.L_x_\d+)\)", m.group(1))
            if b and b.group(1) in labels:
                loops.append(instrs[labels[b.group(1)]:])
    return loops


def compile_report(cfg) -> dict:
    """Compile ``cfg`` (uncached), export it, and report what the compile tests check: the cubins'
    arch, registers and stack bytes, and the count of each opcode in the config's ``REQUIRED_SASS``.
    A plain function of a picklable config, so a process pool can run it (tests/test_compile.py
    compiles the covering set in parallel)."""
    from fa4 import jit

    with exported(cfg) as obj:
        report = {"cubins": jit.cubin_info(obj), "required": {}}
        required = getattr(type(cfg), "REQUIRED_SASS", ())
        if required:
            ops = opcode_counts(disassemble_object(obj))
            report["required"] = {op: count(ops, op) for op in required}
    return report
