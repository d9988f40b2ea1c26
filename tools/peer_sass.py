"""SASS of flash-attn-4's Hopper forward, compiled on this machine (no GPU) with fake tensors, and an
opcode census of the K-block loop of it and of fa4's (RESULTS v0.8: where the two mainloops differ).

    python tools/peer_sass.py [--hd 64|128] [--peer-src DIR] [--out DIR]
    python tools/peer_sass.py --bwd [--causal] [--hd 64|128] [--peer-src DIR] [--out DIR]

flash-attn-4 and quack come from the wheels that ``../shared/device/pack.sh --with-peer`` leaves in
``.device/`` (unpacked into ``--out``), or from ``--peer-src`` (a directory holding ``flash_attn/``
and ``quack/``). Their package ``__init__`` files are skipped (quack's imports triton). Config: bf16,
d128 (``--hd 64``: d64), non-causal, tile 128 x 128 (d64: 192 x 128, three consumer warpgroups), two
stages, P V from registers, intra-warpgroup overlap (the peer's own choices) against fa4's default
config of that head dim. ``--bwd``: the backward main kernels instead (the peer's
``FlashAttentionBackwardSm90`` with its own ``_tile_size_bwd_sm90`` tile, d128: 80 x 128 with the swapped
dQ wgmma, causal 64 x 128; fa4's ``bwd90`` default): the main loop over the Q blocks by opcode family, per
step and per 64 Q rows, the step's fast path (less the blocks a branch skips: fa4 masks only the steps
that need it, the peer every step), the one-warp loops (producer, dQ writer) and the kernels' totals.
This runs flash-attn-4's code only to read its compiled output; nothing of it is part of fa4.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
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


def _import_peer(src: str) -> None:
    if "flash_attn.cute" in sys.modules:
        return
    sys.path[:0] = [src]
    for name in ("quack", "flash_attn", "flash_attn.cute"):  # bare packages: skip their __init__
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(src, *name.split("."))]
        sys.modules[name] = mod
    import quack.dsl  # noqa: F401  (the tensor-indexing patch quack's __init__ would install)


def compile_peer(src: str, obj: str, d: int = 128) -> None:
    _import_peer(src)
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


def _peer_bwd_tile(src: str):
    """``_tile_size_bwd_sm90`` (and its ``BwdConfig``) lifted from the peer's interface.py, whose
    own imports (torch, einops) this machine need not have."""
    path = os.path.join(src, "flash_attn", "cute", "interface.py")
    tree = ast.parse(open(path).read())
    keep = [n for n in tree.body if getattr(n, "name", None) in ("BwdConfig", "_tile_size_bwd_sm90")]
    scope = {"dataclass": dataclasses.dataclass}
    exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), scope)
    return scope["_tile_size_bwd_sm90"]


def compile_peer_bwd(src: str, obj: str, d: int = 128, causal: bool = False):
    """The peer's sm90 backward main kernel (dK, dV, and dQ accumulated in fp32), with the tile
    ``_tile_size_bwd_sm90`` gives it (d128: 80 x 128 with the swapped dQ wgmma, causal 64 x 128) and
    the arguments its ``_flash_attn_bwd`` compiles it with (no varlen, window, determinism or GQA).
    Returns that ``BwdConfig``."""
    _import_peer(src)
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.utils import AuxData

    dt = cutlass.BFloat16
    c = _peer_bwd_tile(src)(d, d, causal, False)

    def strides(n):
        return tuple(cute.sym_int64(divisibility=8) for _ in range(n - 1)) + (1,)

    b, s_q, s_k, h, s_qr = (cute.sym_int() for _ in range(5))
    q, do = (cute.runtime.make_fake_tensor(dt, (b, s_q, h, d), strides(4), assumed_align=16) for _ in range(2))
    k, v, dk, dv = (cute.runtime.make_fake_tensor(dt, (b, s_k, h, d), strides(4), assumed_align=16) for _ in range(4))
    lse, dpsum = (cute.runtime.make_fake_tensor(Float32, (b, h, s_qr), strides(3), assumed_align=16) for _ in range(2))
    dq_accum = cute.runtime.make_fake_tensor(Float32, (b, h, cute.sym_int()), strides(3), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = FlashAttentionBackwardSm90(
        dt, d, d, 1, causal, is_local=False, deterministic=False, tile_m=c.m_block_size, tile_n=c.n_block_size,
        Q_stage=c.num_stages_Q, dO_stage=c.num_stages_dO, PdS_stage=c.num_stages_PdS, SdP_swapAB=c.SdP_swapAB,
        dKV_swapAB=c.dKV_swapAB, dQ_swapAB=c.dQ_swapAB, AtomLayoutMSdP=c.AtomLayoutMSdP,
        AtomLayoutNdKV=c.AtomLayoutNdKV, AtomLayoutMdQ=c.AtomLayoutMdQ, num_threads=(c.num_wg + 1) * 128,
        V_in_regs=False, score_mod=None, score_mod_bwd=None, mask_mod=None, has_aux_tensors=False,
        q_subtile_factor=2, dQ_single_wg=c.dQ_single_wg)
    args = [kernel, q, k, v, do, lse, dpsum, dq_accum, dk, dv, Float32(0.088)] + [None] * 9
    args += [AuxData(None, None), None, None, stream]
    cute.compile(*args, options="--enable-tvm-ffi").export_to_c(obj, function_name="k")
    return c


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


def loops(sass: str) -> list[list[str]]:
    """The lines of every loop, from its label to its back-branch."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", l))}
    return [lines[labels[m.group(1)]:i + 1] for i, l in enumerate(lines)
            if (m := re.search(r"BRA[^`]*`\((\.L_x_\d+)\)", l)) and labels.get(m.group(1), i) < i]


def m_loop(sass: str, raw: bool = False):
    """(opcode, operands) of the backward's main loop (over the Q blocks of a K/V tile): the
    smallest loop holding the most HGMMAs, from its label to its back-branch (``raw``: its lines).
    (The mbarrier waits' retry blocks sit after the kernel's exit and branch back into the loop:
    bigger "loops" with the same HGMMAs, which this skips.)"""
    body = max(loops(sass), key=lambda b: (sum("HGMMA" in x for x in b), -len(b)), default=[])
    return body if raw else [(m.group(2), m.group(3)) for x in body if (m := INSTR.match(x))]


def fast_path(body: list[str]) -> int:
    """Instructions of a loop's lines less those a forward branch to a label inside it can skip
    (a mask applied only on some steps, a wait's second try): a step's count when every such
    branch is taken."""
    where = {m.group(1): i for i, l in enumerate(body) if (m := re.match(r"\s*(\.L_x_\d+):", l))}
    skip = set()
    for i, l in enumerate(body):
        m = re.search(r"@!?U?P\w+\s+BRA[^`]*`\((\.L_x_\d+)\)", l)
        if m and where.get(m.group(1), -1) > i:
            skip.update(range(i + 1, where[m.group(1)]))
    return sum(1 for i, l in enumerate(body) if i not in skip and INSTR.match(l))


FAMILIES = (  # (name, opcode prefixes), first match wins; a prefix matches the opcode or its head before a dot
    ("HGMMA", ("HGMMA",)), ("WARPGROUP", ("WARPGROUP",)),
    ("FFMA", ("FFMA",)), ("FMUL", ("FMUL",)), ("FADD", ("FADD",)),
    ("FSEL/FMNMX/FSETP", ("FSEL", "FMNMX", "FSETP", "FSET")), ("MUFU", ("MUFU",)),
    ("F2FP/conv", ("F2FP", "F2F", "I2F", "F2I", "I2FP", "FRND")),
    ("LDS", ("LDS",)), ("STS", ("STS",)), ("LDSM", ("LDSM",)), ("STSM", ("STSM",)),
    ("REDG/RED/ATOM/UBLKRED", ("REDG", "RED", "ATOM", "ATOMG", "ATOMS", "UBLKRED")),
    ("TMA/bulk copy", ("UTMALDG", "UTMASTG", "UTMAPF", "UTMACCTL", "UTMACMDFLUSH", "UBLKCP", "UBLKPF")),
    ("LDG/STG", ("LDG", "STG")), ("SHFL", ("SHFL",)),
    ("BAR/SYNCS/fence", ("BAR", "SYNCS", "MEMBAR", "FENCE", "DEPBAR", "NANOSLEEP", "ACQBULK", "ELECT", "ERRBAR")),
    ("ISETP/PLOP3", ("ISETP", "PLOP3", "P2R", "R2P")),
    ("IMAD/IADD/LEA", ("IMAD", "IADD3", "VIADD", "IADD", "LEA", "IMNMX", "IABS", "VIMNMX")),
    ("LOP3/SHF/SEL", ("LOP3", "SHF", "SEL", "FLO", "POPC", "BREV", "BMSK")),
    ("MOV/PRMT/CS2R/S2R", ("MOV", "PRMT", "CS2R", "S2R")),
    ("uniform U*", ("U", "R2UR", "S2UR", "VOTEU")), ("BRA/BSSY/BSYNC", ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL")),
    ("NOP", ("NOP",)))


def family(op: str) -> str:
    head = op.split(".")[0]
    for name, prefixes in FAMILIES:
        if head in prefixes or (prefixes == ("U", "R2UR", "S2UR", "VOTEU") and (head[0] == "U" or head in prefixes)):
            return name
    return "others"


def bwd_main(args) -> None:
    """``--bwd``: the main loop of both backward kernels by opcode family, per loop iteration and per
    64 Q rows (the peer's non-causal d128 tile is 80 rows, fa4's 64), and the kernels' totals."""
    from fa4 import sass as fa4_sass

    d, tag = args.hd, f"bwd_d{args.hd}" + ("_causal" if args.causal else "")
    peer_obj = os.path.join(args.out, f"peer_{tag}.o")
    cfg = compile_peer_bwd(_peer_src(args.out, args.peer_src), peer_obj, d, args.causal)
    print(f"flash-attn-4: {cfg}")
    texts = {"flash-attn-4": fa4_sass.disassemble_object(peer_obj)}
    rows = {"flash-attn-4": cfg.m_block_size}
    ours = os.path.join(args.out, f"fa4_{tag}.sass")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "sass.py"), "bwd90", "--hd", str(d), "--out", ours]
    run = subprocess.run(cmd + ["--causal"] * args.causal, check=True, capture_output=True, text=True)
    print("fa4:", run.stdout.splitlines()[0])
    texts["fa4"] = open(ours).read()
    rows["fa4"] = int(re.search(r"\btile_m=(\d+)", run.stdout).group(1))
    open(os.path.join(args.out, f"peer_{tag}.sass"), "w").write(texts["flash-attn-4"])
    fams = {name: collections.Counter(family(op) for op, _ in m_loop(text)) for name, text in texts.items()}
    names = list(texts)
    print(f"\nmain loop by opcode family: per iteration ({' / '.join(f'{rows[n]} rows {n}' for n in names)}), "
          "then per 64 Q rows")
    print(f"{'family':<24}" + "".join(f"{n:>14}" for n in names) + "".join(f"{n + '/64r':>18}" for n in names)
          + f"{'fa4-peer/64r':>14}")
    order = [name for name, _ in FAMILIES] + ["others"]
    for fam in order + ["total"]:
        n = {k: (sum(c.values()) if fam == "total" else c[fam]) for k, c in fams.items()}
        if not any(n.values()):
            continue
        per = {k: n[k] * 64 / rows[k] for k in names}
        print(f"{fam:<24}" + "".join(f"{n[k]:>14}" for k in names) + "".join(f"{per[k]:>18.1f}" for k in names)
              + f"{per['fa4'] - per['flash-attn-4']:>+14.1f}")
    fast = {k: fast_path(m_loop(texts[k], raw=True)) for k in names}
    print(f"{'fast path':<24}" + "".join(f"{fast[k]:>14}" for k in names)
          + "".join(f"{fast[k] * 64 / rows[k]:>18.1f}" for k in names)
          + f"{(fast['fa4'] / rows['fa4'] - fast['flash-attn-4'] / rows['flash-attn-4']) * 64:>+14.1f}")
    print("(fast path: less the blocks a forward branch can skip, e.g. a mask applied on some steps only)")
    for name in names:
        other = collections.Counter(op for op, _ in m_loop(texts[name]) if family(op) == "others")
        if other:
            print(f"others in {name}: {dict(other.most_common())}")
    print("other loops (producer, dQ writer: one warp each), instructions: " + "; ".join(
        f"{n} " + ", ".join(str(sum(1 for x in b if INSTR.match(x))) for b in loops(texts[n])
                           if len(b) > 12 and not any("HGMMA" in x for x in b)) for n in names))
    print("\nkernel totals (static instructions): " + ", ".join(
        f"{n} {sum(fa4_sass.opcode_counts(texts[n]).values())}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-src")
    ap.add_argument("--out", default="/tmp/peer_sass")
    ap.add_argument("--hd", type=int, default=128, choices=(64, 128))
    ap.add_argument("--bwd", action="store_true", help="the backward main loops (by opcode family) instead")
    ap.add_argument("--causal", action="store_true", help="with --bwd: the causal kernels")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, ROOT)
    if args.bwd:
        return bwd_main(args)
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
