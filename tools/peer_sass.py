"""SASS of flash-attn-4's Hopper forward, compiled on this machine (no GPU) with fake tensors, and an
opcode census of the K-block loop of it and of fa4's (RESULTS v0.8: where the two mainloops differ).

    python tools/peer_sass.py [--hd 64|128] [--peer-src DIR] [--out DIR]

flash-attn-4 and quack come from the wheels that ``../shared/device/pack.sh --with-peer`` leaves in
``.device/`` (unpacked into ``--out``), or from ``--peer-src`` (a directory holding ``flash_attn/``
and ``quack/``). Their package ``__init__`` files are skipped (quack's imports triton). Config: bf16,
d128 (``--hd 64``: d64), non-causal, tile 128 x 128 (d64: 192 x 128, three consumer warpgroups), two
stages, P V from registers, intra-warpgroup overlap (the peer's own choices) against fa4's default
config of that head dim. This runs flash-attn-4's code only to
read its compiled output; nothing of it is part of fa4.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import types
import zipfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTR = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*);")


def _peer_src(out: str, given: str | None) -> str:
    if given:
        return given
    src = os.path.join(out, "site")
    if not os.path.isdir(os.path.join(src, "flash_attn")):
        for wheel in glob.glob(os.path.join(ROOT, ".device", "*.whl")):
            zipfile.ZipFile(wheel).extractall(src)
    return src


def compile_peer(src: str, obj: str, d: int = 128) -> None:
    sys.path[:0] = [src]
    for name in ("quack", "flash_attn", "flash_attn.cute"):  # bare packages: skip their __init__
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(src, *name.split("."))]
        sys.modules[name] = mod
    import quack.dsl  # noqa: F401  (the tensor-indexing patch quack's __init__ would install)
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.utils import AuxData

    dt = cutlass.BFloat16
    tile_m = 192 if d <= 64 else 128

    def strides():
        return tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)

    b, s_q, s_k, h, h_k = (cute.sym_int() for _ in range(5))
    q = cute.runtime.make_fake_tensor(dt, (b, s_q, h, d), strides(), assumed_align=16)
    k = cute.runtime.make_fake_tensor(dt, (b, s_k, h_k, d), strides(), assumed_align=16)
    v = cute.runtime.make_fake_tensor(dt, (b, s_k, h_k, d), strides(), assumed_align=16)
    o = cute.runtime.make_fake_tensor(dt, (b, s_q, h, d), strides(), assumed_align=16)
    lse = cute.runtime.make_fake_tensor(Float32, (b, h, s_q), (cute.sym_int64(), cute.sym_int64(), 1),
                                        assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = FlashAttentionForwardSm90(
        dt, d, d, 1, is_causal=False, is_local=False, pack_gqa=False, tile_m=tile_m, tile_n=128, num_stages=2,
        num_threads=128 * (tile_m // 64 + 1), Q_in_regs=False, intra_wg_overlap=True, mma_pv_is_rs=True, mask_mod=None,
        score_mod=None, has_aux_tensors=False, q_subtile_factor=None, paged_kv_non_tma=False)
    args = [kernel, q, k, v, o, lse, Float32(0.088)] + [None] * 9 + [AuxData(None, None), None, None, stream]
    cute.compile(*args, options="--enable-tvm-ffi").export_to_c(obj, function_name="k")


def k_loop(sass: str) -> list[tuple[str, str]]:
    """(opcode, operands) of the K-block loop: the innermost loop holding both the Q K^T and the
    P V wgmma groups (two committed groups, a ``.tnspB`` HGMMA, a wait leaving one group in
    flight), from its label to its back-branch."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", l))}
    best = None
    for i, l in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = lines[labels[m.group(1)]:i + 1]
            two_groups = sum("HGMMA" in x and "gsb0" in x for x in body) >= 2
            if two_groups and any("tnspB" in x for x in body) and any("DEPBAR.LE gsb0, 0x1" in x for x in body):
                if best is None or len(body) < len(best):
                    best = body
    return [(m.group(2), m.group(3)) for x in best or [] if (m := INSTR.match(x))]


def census(loop) -> dict:
    """Opcode counts per stretch: to the last Q K^T HGMMA, the last P V HGMMA, the wait for Q K^T
    (``DEPBAR.LE gsb0, 0x1``), the wait for P V (``0x0``), and the back-branch."""
    def key(op):
        return "MUFU.EX2" if op.startswith("MUFU.EX2") else op.split(".")[0] if not op.startswith("WARPGROUP") \
            else ".".join(op.split(".")[:2])
    ends = [i for i, (op, a) in enumerate(loop) if op.startswith("HGMMA") and "gsb0" in a][:2]
    d1 = next(i for i, (op, a) in enumerate(loop) if op == "WARPGROUP.DEPBAR.LE" and "0x1" in a)
    d0 = next(i for i, (op, a) in enumerate(loop) if op == "WARPGROUP.DEPBAR.LE" and "0x0" in a and i > d1)
    bounds = [0, ends[0] + 1, ends[1] + 1, d1 + 1, d0 + 1, len(loop)]
    return {name: collections.Counter(key(op) for op, _ in loop[bounds[j]:bounds[j + 1]])
            for j, name in enumerate(("->QK", "->PV", "->wait1", "->wait0", "->branch"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-src")
    ap.add_argument("--out", default="/tmp/peer_sass")
    ap.add_argument("--hd", type=int, default=128, choices=(64, 128))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, ROOT)
    from fa4 import sass as fa4_sass

    d = args.hd
    peer_obj = os.path.join(args.out, f"peer_d{d}.o")
    compile_peer(_peer_src(args.out, args.peer_src), peer_obj, d)
    texts = {"flash-attn-4": fa4_sass.disassemble_object(peer_obj)}
    ours = os.path.join(args.out, f"fa4_d{d}.sass")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sass.py"), "fwd90", "--hd", str(d), "--out", ours],
                   check=True, capture_output=True)
    texts["fa4"] = open(ours).read()
    open(os.path.join(args.out, f"peer_d{d}.sass"), "w").write(texts["flash-attn-4"])
    for name, text in texts.items():
        segs = census(k_loop(text))
        total = sum(segs.values(), collections.Counter())
        print(f"== {name}: {sum(total.values())} instructions in the K-block loop")
        print(f"{'op':<20} {'total':>5} " + " ".join(f"{s:>9}" for s in segs))
        for op, n in total.most_common():
            print(f"{op:<20} {n:>5} " + " ".join(f"{c[op]:>9}" for c in segs.values()))


if __name__ == "__main__":
    main()
