"""SASS of a kernel config, compiled here on the CPU: registers, stack, and an opcode census.

    python tools/sass.py bwd --hd 256 [--arch sm_90a] [--set causal=True --set tile_n=128] [--out f.sass]

``bwd`` / ``fwd`` / ``post``: the sm80 backward (its make_config for a head dim), the forward, or the
backward's postprocess. ``--set`` overrides config fields (Python literals). Prints the opcode counts
that matter for these kernels (MMA, ldmatrix, shared/global/local memory, reductions, barriers) so
two versions can be compared without a GPU; ``--out`` keeps the full listing. Needs nvdisasm (the
``nvidia-cuda-nvdisasm`` wheel).
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile


def _cubins(data: bytes):
    i = data.find(b"\x7fELF", 1)
    while i != -1:
        if data[i + 4] == 2 and struct.unpack_from("<H", data, i + 18)[0] == 190:
            phoff, shoff = struct.unpack_from("<QQ", data, i + 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, i + 54)
            yield data[i : i + max(shoff + shentsize * shnum, phoff + phentsize * phnum)]
        i = data.find(b"\x7fELF", i + 1)


def _nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    import nvidia

    for root in nvidia.__path__:
        for sub in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm"):
            if os.path.exists(os.path.join(root, sub)):
                return os.path.join(root, sub)
    sys.exit("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("bwd", "fwd", "post"))
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="field=value")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", args.arch)

    from fa4 import jit
    from fa4.bwd import postprocess
    from fa4.bwd import sm80 as bwd
    from fa4.config import AttnProblem
    from fa4.fwd import sm80 as fwd

    p = AttnProblem("bf16", 2, 1024, 1024, 8, 8, args.hd, args.hd, args.hd**-0.5, causal=args.causal)
    if args.kind == "fwd":
        cfg = fwd.make_config(p, None, args.arch, True)
    else:
        cfg = bwd.make_config(p, None, args.arch, args.deterministic)
    cfg = dataclasses.replace(cfg, **{k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in args.set)})
    if args.kind == "post":
        cfg = postprocess.config_for(cfg)
    print(cfg.key())
    fn = jit.compile_uncached(cfg)
    with tempfile.TemporaryDirectory() as d:
        obj = os.path.join(d, "k.o")
        fn.export_to_c(obj, function_name="k")
        print(jit.cubin_info(obj))
        data = open(obj, "rb").read()
        texts = []
        for n, cubin in enumerate(_cubins(data)):
            path = os.path.join(d, f"{n}.cubin")
            open(path, "wb").write(cubin)
            texts.append(subprocess.run([_nvdisasm(), "-c", path], capture_output=True, text=True, check=True).stdout)
    sass = "\n".join(texts)
    if args.out:
        open(args.out, "w").write(sass)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1)] += 1
    keys = ("HMMA", "LDSM", "LDS", "STS", "LDG", "STG", "LDGSTS", "RED", "ATOM", "LDL", "STL", "BAR", "MUFU", "SHFL")
    summary = {k: sum(v for op, v in ops.items() if op == k or op.startswith(k + ".")) for k in keys}
    print("instructions:", sum(ops.values()), summary)


if __name__ == "__main__":
    main()
