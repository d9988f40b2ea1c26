"""Note [Compiler switches]: compile every kernel variant of an arch with ``jit.PASS_SWITCHES`` and
without, and compare the two (CPU only, no GPU):

    python tools/compiler_switch_check.py --arch sm_90a [--part 0/2] [--out FILE.json]

Each variant (``fa4.arch.all_variants``) is compiled twice in this process, the switch forced on
(whatever its class's ``PASS_SWITCHES_OK`` and the arch), then off. The two SASS listings are compared with each
instruction's encoding (``nvdisasm -hex``: opcode, operands and the scheduling control bits),
addresses stripped. Prints, per config class, how many variants are identical and the native
compile seconds (MLIR, LLVM, ptxas) summed each way; ``--out`` keeps the per-variant record.
``--part i/n`` takes every n-th variant from the i-th, to split the list over processes.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--part", default="0/1")
    ap.add_argument("--out")
    ap.add_argument("--resume", action="store_true", help="keep --out's records and compile only the rest")
    args = ap.parse_args()
    os.environ["CUTE_DSL_ARCH"] = args.arch
    os.environ["FA4_CACHE_DIR"] = tempfile.mkdtemp(prefix="fa4-switch-check-")

    from cutlass.base_dsl import compiler

    from fa4 import arch, jit, sass

    native = {}
    real = compiler.Compiler.compile

    def timed(self, module, pipeline, *a, **k):
        t0 = time.perf_counter()
        try:
            return real(self, module, pipeline, *a, **k)
        finally:
            native["seconds"] = time.perf_counter() - t0
            native["switched"] = jit.PASS_SWITCHES in pipeline if jit.PASS_SWITCHES else False

    compiler.Compiler.compile = timed
    switches = jit.PASS_SWITCHES
    i, n = (int(x) for x in args.part.split("/"))
    record = {}
    if args.resume and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            record = json.load(f)
    for cfg in arch.all_variants(args.arch)[i::n]:
        if cfg.key() in record:
            continue
        row = {}
        for mode in ("on", "off"):
            jit.PASS_SWITCHES = switches if mode == "on" else ""
            jit.pass_switches = lambda _cfg: jit.PASS_SWITCHES  # every class and arch (the rule's own checks aside)
            text = sass.without_addresses(sass.disassemble(cfg, encodings=True))
            assert native["switched"] == (mode == "on"), (mode, cfg.key())
            row[mode] = (hashlib.sha256(text.encode()).hexdigest(), native["seconds"])
        record[cfg.key()] = {"class": type(cfg).__name__, "same": row["on"][0] == row["off"][0],
                             "seconds_on": row["on"][1], "seconds_off": row["off"][1]}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f)
    by = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
    for r in record.values():
        b = by[r["class"]]
        b[0] += 1
        b[1] += r["same"]
        b[2] += r["seconds_off"]  # pass running (no switch)
        b[3] += r["seconds_on"]  # pass switched off
    print(f"{args.arch} part {args.part}: class | variants | identical | native s with the pass -> switched off")
    for name, (count, same, s_pass, s_switched) in sorted(by.items()):
        print(f"{name} | {count} | {same} | {s_pass:.1f} -> {s_switched:.1f}")


if __name__ == "__main__":
    main()
