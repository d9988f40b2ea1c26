"""Backward postprocess: ``dq = dq_accum * softmax_scale`` in the input dtype.

The main backward kernel accumulates ``dS @ K`` (without the softmax scale) into the float32
workspace ``dq_accum``, in the fragment order of its dQ MMA (Note [dQ accumulator layout] in
fa4/bwd/workspace.py; ``mma.sync`` for the sm80 family, wgmma for sm90). This kernel runs one CTA
per (m_block, head, batch) with the same number of threads and the same tiled MMA (only its
layouts: it issues no MMA), so each thread reads back exactly the accumulator fragment that the
main kernel's thread of that index added (``vec`` floats per load, whole cache lines per warp), scales it,
rounds it once, puts it through shared memory at its (row, column), and writes dq with 128-bit
stores. Rows at or past the sequence's length are not written. With ``counted`` the main kernel
did not need a zeroed ``dq_accum`` (its first contributor of each slot stores the tile: Note [First
store] in fa4/bwd/sm90.py) and the slot counters say which tiles it wrote: a tile whose counter is 0
had no contributor (no key is visible to its rows) and is written as zeros, its accumulator not
read. Layouts (varlen: ``b = 1``, ``s = total_q``, with ``cu_seqlens_q``):

    dq_accum  see fa4/bwd/workspace.py    float32
    counters  (b, h, m_blocks)            int32, with ``counted`` (b: the sequences when varlen)
    dq        (b, s, h, d)                fp16/bf16, last dim contiguous, written
"""

# No ``from __future__ import annotations``: see Note [no ``from __future__ import annotations``] in
# fa4/fwd/sm80.py (``cute.struct`` reads its field annotations as objects).

from dataclasses import dataclass
from typing import ClassVar, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.bwd.preprocess import _DTYPES
from fa4.bwd.workspace import DqFragment, dq_accum_view, dq_tiled_mma, red_vec, thread_fragment
from fa4.config import KernelConfig
from fa4.cute_utils import (
    acc_to_smem,
    rows_per_pass_16B,
    smem_layout_atom_sm80,
    smem_to_gmem_pred,
    tiled_copy_rows_16B,
    transposed,
)
from fa4.seqlen import SeqlenInfo, grid_extent


@dataclass(frozen=True)
class BwdPostprocessConfig(KernelConfig):
    """Compile key of :class:`BwdPostprocess`. ``head_dim``: the padded head dim of ``dq_accum``
    (a multiple of 32); the real one comes from ``dq`` at run time. ``tile_m`` and the dQ MMA
    (``mma``, ``num_threads``, ``atom_m``, ``atom_n``: a :class:`fa4.bwd.workspace.DqFragment`)
    are the main kernel's: they define the dq_accum tiles and their fragment order. ``ws_tile_m``
    (0: ``tile_m``): the rows of the workspace's tiles, where the main kernel's dQ tiles are a part
    of them (the sm90 two-CTA backward adds half tiles: Note [Two-CTA dQ] in fa4/bwd/sm90.py); it
    places a varlen sequence's first tile. ``counted``: the slot counters tell which tiles hold
    data (module docstring). ``pdl`` (after an sm90 main kernel with ``pdl``): launched as a
    programmatic dependent of whatever kernel precedes it (the main kernel, or torch's sums and copies
    of a split GQA group), and waits for that kernel before reading anything (Note [Programmatic
    dependent launch] in fa4/bwd/sm90.py)."""

    head_dim: int = 128
    tile_m: int = 64
    ws_tile_m: int = 0
    num_threads: int = 256
    atom_m: int = 2
    atom_n: int = 1
    mma: str = "sm80"
    swap: bool = False
    varlen: bool = False
    counted: bool = False
    pdl: bool = False

    @property
    def fragment(self) -> DqFragment:
        return DqFragment(self.mma, self.num_threads, self.atom_m, self.atom_n, self.swap)

    KERNEL: ClassVar[str] = "fa4.bwd.postprocess:BwdPostprocess"


class BwdPostprocess:
    def __init__(self, cfg: BwdPostprocessConfig):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.tile_m = cfg.tile_m
        self.head_dim = cfg.head_dim
        self.num_threads = cfg.num_threads
        self.vec = red_vec(cfg.arch)

    @staticmethod
    def can_implement(cfg: BwdPostprocessConfig) -> None:
        cfg.check_target(_DTYPES, head_dim_multiple=32)
        if cfg.mma == "sm90":
            if cfg.arch != "sm_90a":
                raise ValueError(f"BwdPostprocessConfig: the wgmma fragment order needs sm_90a, got {cfg.arch!r}")
            wgs = cfg.num_threads // 128
            if cfg.num_threads % 128 or cfg.atom_m * cfg.atom_n != wgs:
                raise ValueError(f"BwdPostprocessConfig: {cfg.num_threads} threads are not atom_m x atom_n = "
                                 f"{cfg.atom_m} x {cfg.atom_n} warpgroups")
            mm, nn = cfg.fragment.mma_shape(cfg.tile_m, cfg.head_dim)
            if mm % (64 * cfg.atom_m) or nn % (8 * cfg.atom_n):
                raise ValueError(f"BwdPostprocessConfig: a {cfg.tile_m}x{cfg.head_dim} dQ tile does not tile into "
                                 f"{cfg.atom_m}x{cfg.atom_n} warpgroups of 64-row wgmma atoms")
            return
        if cfg.mma != "sm80":
            raise ValueError(f"BwdPostprocessConfig.mma must be 'sm80' or 'sm90', got {cfg.mma!r}")
        warps = cfg.num_threads // 32
        if cfg.num_threads not in (128, 256) or cfg.atom_m <= 0 or warps % cfg.atom_m:
            raise ValueError(
                f"BwdPostprocessConfig: num_threads must be 128 or 256 and atom_m divide its warps, "
                f"got {cfg.num_threads}/{cfg.atom_m}"
            )
        if cfg.tile_m % (16 * cfg.atom_m) or cfg.head_dim % (16 * (warps // cfg.atom_m)):
            raise ValueError(
                f"BwdPostprocessConfig: a {cfg.tile_m}x{cfg.head_dim} dQ tile does not tile into "
                f"{cfg.atom_m}x{warps // cfg.atom_m} warps of 16x16 MMA steps"
            )

    @staticmethod
    def fake_args(cfg: BwdPostprocessConfig) -> tuple:
        b, s, h = (cute.sym_int() for _ in range(3))
        d = cute.sym_int(divisibility=8)
        dq_accum = cute.runtime.make_fake_compact_tensor(
            Float32, (b, h, cute.sym_int(), cfg.head_dim), stride_order=(3, 2, 1, 0), assumed_align=16
        )
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
        dq = cute.runtime.make_fake_tensor(_DTYPES[cfg.dtype], (b, s, h, d), strides, assumed_align=16)
        cu_seqlens_q = (
            cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4) if cfg.varlen else None
        )
        counters = (cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(), h, cute.sym_int()),
                                                          stride_order=(2, 1, 0), assumed_align=4)
                    if cfg.counted else None)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return (dq_accum, dq, cu_seqlens_q, counters, Float32(1.0), Int32(1), stream)

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # fa4/bwd/workspace.py
        mdQ: cute.Tensor,  # (b, s, h, d)
        mCuSeqlensQ: Optional[cute.Tensor],  # (b + 1,) int32
        mCounters: Optional[cute.Tensor],  # (b, h, m_blocks) int32 (``counted``)
        softmax_scale: Float32,
        max_seqlen_q: Int32,  # longest sequence (varlen grid); ignored for fixed length
        stream,
    ):
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError("dq must have the configured dtype")
        atom = smem_layout_atom_sm80(self.dtype, self.head_dim)
        frag = self.cfg.fragment
        if const_expr(frag.mma == "sm90" and (frag.swap or (self.head_dim // frag.atom_n) % atom.outer.shape[1])):
            # A warpgroup's columns do not cover whole swizzle rows (head dim 96 / 160 / 192 / 224
            # over two warpgroups): rows padded by 16 bytes instead, conflict free for the
            # accumulator's 4-byte stores (row stride 4 banks mod 32). Also for the swapped order
            # (dQ^T), whose element stores go through a transposed view, which a swizzle cannot give.
            sdQ_layout = cute.make_layout((self.tile_m, self.head_dim), stride=(self.head_dim + 8, 1))
            atom = atom.outer.shape[1]
        else:
            sdQ_layout = cute.tile_to_shape(atom, (self.tile_m, self.head_dim), (0, 1))
        copy_out = tiled_copy_rows_16B(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128), self.num_threads, atom
        )
        # A tile_m that copy_out's rows per pass do not divide (80) needs its passes limited to the tile.
        self.ragged = self.tile_m % rows_per_pass_16B(self.dtype, self.num_threads, atom) != 0
        tiled_mma = dq_tiled_mma(self.cfg.fragment, self.dtype, self.tile_m, self.head_dim)
        num_batch, seqlen = grid_extent(mdQ, mCuSeqlensQ, max_seqlen_q)

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)], 1024]

        grid = (cute.ceil_div(seqlen, self.tile_m), mdQ.shape[2], num_batch)
        self.kernel(
            mdQaccum, mdQ, mCuSeqlensQ, mCounters, softmax_scale, sdQ_layout, copy_out, tiled_mma, SharedStorage
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
                 use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCounters: Optional[cute.Tensor],
        softmax_scale: Float32,
        sdQ_layout,  # cute.ComposedLayout (swizzled) or cute.Layout (padded rows)
        copy_out: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # the main kernel's dq_accum (and counters) complete
        seq = SeqlenInfo.create(batch, mdQ.shape[1], 0, mCuSeqlensQ=mCuSeqlensQ)
        rows_left = seq.seqlen_q - m_block * self.tile_m
        if rows_left > 0:
            tile = (self.tile_m, self.head_dim)
            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            sdQ = storage.sdQ.get_tensor(sdQ_layout)
            frag = self.cfg.fragment
            acc = cute.make_rmem_tensor(
                tiled_mma.get_slice(tidx).partition_shape_C(frag.mma_shape(self.tile_m, self.head_dim)), Float32)
            ws_tile = self.cfg.ws_tile_m or self.tile_m
            gAcc = cute.local_tile(dq_accum_view(mdQaccum, seq, batch, head, ws_tile), tile, (m_block, 0))
            gFrag = thread_fragment(gAcc, self.cfg.fragment, cute.size(acc), self.vec, tidx)
            acc_v = cute.make_tensor(acc.iterator, cute.make_layout(gFrag.shape))
            written = True
            if const_expr(self.cfg.counted):
                written = mCounters[batch, head, m_block] > 0
            if written:
                for v in cutlass.range_constexpr(cute.size(gFrag, mode=[1])):
                    acc_v[None, v].store(gFrag[None, v].load())
                acc.store(acc.load() * softmax_scale)
            else:  # no contributor: dq = 0 (the tile was never written)
                acc.fill(0.0)
            if const_expr(frag.swap):  # dQ^T: a register pair is two rows of sdQ
                acc_to_smem(acc, tiled_mma, transposed(sdQ), tidx, pairs=False)
            else:
                acc_to_smem(acc, tiled_mma, sdQ, tidx)
            cute.arch.barrier()
            gdQ = cute.local_tile(seq.q_view(mdQ, batch, head), tile, (m_block, 0))
            smem_to_gmem_pred(copy_out, sdQ, gdQ, rows_left, mdQ.shape[3], tidx, ragged=self.ragged)


_configs: dict = {}


def config_for(bwd_cfg) -> BwdPostprocessConfig:
    """The postprocess that reads back the dq_accum of the main kernel config ``bwd_cfg`` (its
    tile_m and dQ fragment order, ``bwd_cfg.dq_fragment``, define the tiles: Note [dQ accumulator
    layout]). Cached: it is on every backward call's host path."""
    cfg = _configs.get(bwd_cfg)
    if cfg is None:
        frag = bwd_cfg.dq_fragment
        cfg = _configs[bwd_cfg] = BwdPostprocessConfig(
            arch=bwd_cfg.arch, dtype=bwd_cfg.dtype, head_dim=bwd_cfg.head_dim, tile_m=bwd_cfg.dq_rows,
            # (Only a varlen sequence's first tile depends on it.)
            ws_tile_m=bwd_cfg.tile_m if bwd_cfg.dq_rows != bwd_cfg.tile_m and bwd_cfg.varlen_q else 0,
            num_threads=frag.num_threads, atom_m=frag.atom_m, atom_n=frag.atom_n, mma=frag.mma, swap=frag.swap,
            varlen=bwd_cfg.varlen_q, counted=bool(getattr(bwd_cfg, "dq_first_store", False)),
            pdl=bool(getattr(bwd_cfg, "pdl", False) and getattr(bwd_cfg, "pdl_post", True)))
    return cfg


def run_postprocess(
    cfg: BwdPostprocessConfig,
    dq_accum,
    dq,
    softmax_scale: float,
    *,
    cu_seqlens_q=None,
    max_seqlen_q: Optional[int] = None,
    counters=None,
) -> None:
    """Launch the postprocess ``cfg`` (:func:`config_for` the main kernel that filled ``dq_accum``)
    on torch tensors (layouts in the module docstring; ``counters``: the main kernel's slot counters,
    exactly when ``cfg.counted``)."""
    from fa4.jit import get_kernel

    if (cu_seqlens_q is not None) != cfg.varlen:
        raise ValueError("cu_seqlens_q must be given exactly when the postprocess config is varlen")
    if (counters is not None) != cfg.counted:
        raise ValueError("counters must be given exactly when the postprocess config is counted")
    if cfg.varlen and max_seqlen_q is None:
        raise ValueError("max_seqlen_q is required with cu_seqlens_q")
    seqlen = max_seqlen_q if cfg.varlen else dq.shape[1]
    if seqlen == 0 or dq.numel() == 0:
        return
    get_kernel(cfg)(dq_accum, dq, cu_seqlens_q, counters, float(softmax_scale), seqlen)


def variants(arch: str) -> list[BwdPostprocessConfig]:
    """A covering set: every padded head dim in the sm80 order (256 threads, the dQ warp layouts
    of the sm80 tuning table), both dtypes, varlen; on sm_90a also the wgmma orders of the sm90
    backward (64-row tiles with the warpgroups along the head dim, 128-row tiles with them along
    the rows). :func:`fa4.arch.all_variants` adds the postprocess of every main-kernel variant."""
    out = []
    for i, hd in enumerate(range(32, 257, 32)):
        atom_m = 4 if hd <= 96 or hd % 64 else 2  # 8 warps: 2 x 4 tiles hd only in multiples of 64
        out.append(BwdPostprocessConfig(arch=arch, dtype=("bf16", "fp16")[i % 2], head_dim=hd,
                                        tile_m=128 if hd <= 64 else 64, atom_m=atom_m, varlen=i % 3 == 0))
    if arch == "sm_90a":
        for hd, tile_m, am, an, varlen in ((128, 64, 1, 2, False), (64, 128, 2, 1, True), (256, 64, 1, 2, True),
                                           (96, 64, 1, 2, False)):
            out.append(BwdPostprocessConfig(arch=arch, dtype="bf16", head_dim=hd, tile_m=tile_m, num_threads=256,
                                            atom_m=am, atom_n=an, mma="sm90", varlen=varlen))
        out.append(BwdPostprocessConfig(arch=arch, dtype="fp16", head_dim=128, tile_m=80, num_threads=256, atom_m=2,
                                        atom_n=1, mma="sm90", swap=True, varlen=True))
        # Half tiles of the two-CTA backward (32 rows swapped at d128) in 64-row workspace tiles.
        out.append(BwdPostprocessConfig(arch=arch, dtype="bf16", head_dim=128, tile_m=32, ws_tile_m=64, num_threads=256,
                                        atom_m=2, atom_n=1, mma="sm90", swap=True, varlen=True))
        # After a main kernel that stores each slot's first tile (Note [First store] in fa4/bwd/sm90.py).
        out.append(BwdPostprocessConfig(arch=arch, dtype="bf16", head_dim=128, tile_m=64, num_threads=256,
                                        atom_m=1, atom_n=2, mma="sm90", varlen=True, counted=True))
    return out
