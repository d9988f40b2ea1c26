"""Ampere-family attention backward (``mma.sync`` m16n8k16, ``cp.async``, ``ldmatrix``) and its launcher.

FlashAttention-2's algorithm. One CTA per (n_block, kv head, batch) keeps the dK and dV tiles of
its ``tile_n`` keys in registers and walks every (q head of its group, m_block) that sees those
keys, so dK/dV are summed over the GQA group inside the CTA (no atomics, deterministic). Per step:

    S  = Q K^T                          (Q, dO: cp.async, double-buffered; K, V: loaded once)
    P  = exp2(S * scale_log2 - lse_log2)   (masks; softcap: S <- tanh(S * scale / cap) first)
    dP = dO V^T
    dS = P * (dP - D)                    (softcap: * (1 - tanh^2))
    dV += P^T dO,  dK += dS^T Q          (P, dS staged in smem for the transposed operands)
    dQ_accum[m_block] += dS K            (float32 red.add, or in a fixed order: deterministic)

then dK *= softmax_scale and dK/dV go out through smem with 128-bit stores. The preprocess
(:mod:`fa4.bwd.preprocess`) makes ``D = rowsum(dO * O) - dLSE`` and ``lse_log2`` and zeroes the
workspaces; the postprocess (:mod:`fa4.bwd.postprocess`) scales ``dq_accum`` into dq.

Note [Out-of-bounds tiles]
    Q/dO rows past ``seqlen_q`` and K/V rows past ``seqlen_k`` are never read: their smem rows are
    zero-filled, as are head-dim columns past ``d`` (the kernel is compiled for ``d`` rounded up
    to 32). An out-of-range row gets ``lse_log2 = +inf`` and ``D = 0``, so its P and dS are exactly
    0; out-of-range keys are masked to -inf. Nothing out of bounds is stored; dq_accum rows are
    predicated too. Hence no NaN can leak from padding, whatever the memory beyond holds.

Launch order and the deterministic mode: Note [Launch order] and Note [Deterministic dQ] in
fa4/bwd/common.py (the driver shared by every family). How this kernel waits for and publishes its
dQ slot: Note [Split-phase dQ] below.

Note [Split-phase dQ]
    Per step (Note [Split-phase] in fa4/sched/semaphore.py). Right after the barrier at the top of
    step ``t`` (every thread's dQ adds of step ``t - 1`` are issued), thread 0 reads this step's
    counter (relaxed), fences once -- the release of step ``t - 1``'s adds and the acquire of the
    value just read --, bumps step ``t - 1``'s counter, and records in shared memory whether the
    value already equals its rank. The barrier after the P/dS stores makes the flag and the
    acquire cover the CTA: in the usual case the step adds its dQ tile with no further wait and no
    extra barrier, like the non-deterministic kernel. Otherwise (a predecessor less than a step
    ahead) thread 0 spins with ``ld.acquire`` just before the dQ MMA (where the dQ accumulator is
    not yet live, so the spin costs no registers) and a barrier releases the CTA. The last step's
    counter is bumped after the loop. Only warp 0 waits for the fence's round trip, while the
    other warps start the step's MMAs; the fence precedes the step's cp.async so it waits for
    nothing else.

    Publishing every 2 or 4 steps behind one fence (an acquiring peek each step instead) was
    measured in v0.2 (docs/RESULTS.md): 0-5% slower at hdim 64/128, up to 22% at 256, so the
    fence is not what the deterministic mode pays for.
"""

# No ``from __future__ import annotations``: see Note [no ``from __future__ import annotations``] in
# fa4/fwd/sm80.py (``cute.struct`` reads its field annotations as objects).

from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from fa4.bwd import common
from fa4.bwd.preprocess import _DTYPES
from fa4.bwd.workspace import (
    DqFragment,
    dq_accum_view,
    dq_tiled_mma,
    head_dim_padded,
    red_add_fragment,
    red_vec,
    rows_view,
    thread_fragment,
)
from fa4.config import ARCHS, AttnKernelConfig, AttnProblem, KernelOptions
from fa4.cute_utils import (
    acc_to_smem,
    gemm_sm80,
    make_acc_mn_view,
    smem_layout_atom_sm80,
    smem_to_gmem_pred,
    tiled_copy_rows_16B,
    tiled_mma_sm80,
)
from fa4.mask import AttentionMask
from fa4.mods import check_config, launch_aux, lookup
from fa4.mods_kernel import BlockSkip, UserMods, check_block_skip, fake_aux
from fa4.sched import semaphore
from fa4.sched.tile import section_tile
from fa4.seqlen import SeqlenInfo, grid_extent
from fa4.softmax import apply_softcap, exp2_rows, score_scales, softcap_grad
from fa4.validate import kernel_ready

# Dynamic shared memory per CTA (bytes) by code-generation target.
SMEM_CAPACITY = {"sm_80": 166912, "sm_90a": 232448, "sm_100a": 232448}


@dataclass(frozen=True)
class BwdSm80Config(AttnKernelConfig):
    """Compile key of :class:`FlashBwdSm80`.

    ``head_dim``: the head dim rounded up to 32 (:func:`fa4.bwd.workspace.head_dim_padded`), the
    real one is a runtime size. ``tile_m`` x ``tile_n``: the Q rows per step x the K rows per CTA.
    ``num_stages``: smem buffers of Q/LSE and dO/D (2 = the next step's loads overlap this one).
    ``atom_m_sdp`` (warps along tile_m for S and dP), ``atom_n_dkv`` (warps along tile_n for dK,
    dV), ``atom_m_dq`` (warps along tile_m for dQ): the warp layouts of the three MMA shapes, the
    other direction taking the remaining warps. ``kv_split`` (a power of two dividing the GQA group):
    the q heads of a kv head over that many CTAs per K block, float32 partial dK / dV (Note [Split
    GQA group] in fa4/bwd/sm90.py; the driver allocates and sums the partials). ``block_skip`` (not
    deterministic): ``(aux slot, block_q, block_k)`` of a block-sparse call's block table, ``()``
    without one: each CTA narrows its m_blocks to those its K block is visible to, as the sm90
    backward's (Note [Block skip in the backward] in fa4/bwd/sm90.py).
    """

    head_dim: int = 128
    tile_m: int = 64
    tile_n: int = 128
    num_threads: int = 256
    num_stages: int = 2
    atom_m_sdp: int = 2
    atom_n_dkv: int = 4
    atom_m_dq: int = 2
    deterministic: bool = False
    kv_split: int = 1
    block_skip: tuple = ()

    KERNEL: ClassVar[str] = "fa4.bwd.sm80:FlashBwdSm80"

    # Shared with the sm90 config, for the family-independent driver: one CTA per K block, dQ
    # tiles of tile_m rows, the deterministic order of Note [Deterministic dQ] only.
    cluster_n: ClassVar[int] = 1
    det_rotate: ClassVar[bool] = False

    @property
    def dq_rows(self) -> int:
        return self.tile_m

    @property
    def num_warps(self) -> int:
        return self.num_threads // 32

    @property
    def dq_fragment(self) -> DqFragment:
        """The order of this kernel's dQ tiles in dq_accum (Note [dQ accumulator layout])."""
        return DqFragment("sm80", self.num_threads, self.atom_m_dq)

    def smem_bytes(self) -> int:
        """Shared memory the kernel allocates (alignment padding included)."""

        def r1k(n: int) -> int:
            return (n + 1023) // 1024 * 1024

        q = r1k(self.tile_m * self.head_dim * self.num_stages * 2)
        kv = r1k(self.tile_n * self.head_dim * 2)
        pds = r1k(self.tile_m * self.tile_n * 2)
        rows = (self.tile_m * self.num_stages * 4 + 15) // 16 * 16
        ready = 16 if self.deterministic else 0
        return 2 * q + 2 * kv + 2 * pds + 2 * rows + ready


def mma_shape_error(cfg: BwdSm80Config) -> Optional[str]:
    """Why the tiles and warp layouts do not fit the m16n8k16 MMAs (None when they do)."""
    w = cfg.num_warps
    # (name, warps along the first dim, first extent, second extent, reduction extent)
    shapes = (
        ("S/dP", cfg.atom_m_sdp, cfg.tile_m, cfg.tile_n, cfg.head_dim),
        ("dK/dV", cfg.atom_n_dkv, cfg.tile_n, cfg.head_dim, cfg.tile_m),
        ("dQ", cfg.atom_m_dq, cfg.tile_m, cfg.head_dim, cfg.tile_n),
    )
    for name, a, first, second, red in shapes:
        if a <= 0 or w % a:
            return f"{name}: {a} warps along dim 0 do not divide {w} warps"
        if first % (16 * a) or second % (16 * (w // a)) or red % 16:
            return (
                f"{name}: a {first}x{second} tile (reduction {red}) does not tile into {a}x{w // a} warps "
                f"of 16x16 (x16) MMA steps"
            )
    return None


class FlashBwdSm80:
    """The backward kernel; see the module docstring.

    Shared memory: sQ (tile_m, d, stages), sdO (tile_m, d, stages), sK, sV (tile_n, d),
    sP, sdS (tile_m, tile_n), sLSE, sD (tile_m, stages) float32. All 16-bit tiles use
    128-byte (or 64-byte) swizzled rows so ldmatrix and the 16-byte cp.async are conflict free.
    One cp.async group per step: {Q, LSE, dO, D} of the next step (K and V join the first one).
    """

    def __init__(self, cfg: BwdSm80Config):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.tile_m, self.tile_n, self.head_dim = cfg.tile_m, cfg.tile_n, cfg.head_dim
        self.num_threads = cfg.num_threads
        self.num_stages = cfg.num_stages
        # User functions (fa4/mods.py), None when absent.
        self.score_mod, self.mask_mod = lookup(cfg.score_mod), lookup(cfg.mask_mod)
        self.score_mod_bwd = lookup(cfg.score_mod_bwd)
        self.user_mods = self.score_mod is not None or self.mask_mod is not None

    # ----------------------------------------------------------------------------------------
    # Protocol
    # ----------------------------------------------------------------------------------------

    @staticmethod
    def can_implement(cfg: BwdSm80Config) -> None:
        cfg.check_target(_DTYPES, head_dim_multiple=32)
        check_config(cfg, "BwdSm80Config", backward=True)
        # (the ordered dQ counts on every K block of a slot's mask range)
        check_block_skip(cfg, "BwdSm80Config", deterministic=cfg.deterministic)
        if cfg.num_threads not in (128, 256):
            raise ValueError(f"BwdSm80Config.num_threads must be 128 or 256, got {cfg.num_threads}")
        if cfg.tile_m not in (32, 64, 128) or cfg.tile_n not in (32, 64, 128):
            raise ValueError(f"BwdSm80Config.tile_m/tile_n must be 32, 64 or 128, got {cfg.tile_m}/{cfg.tile_n}")
        if cfg.tile_m > cfg.num_threads:
            raise ValueError("BwdSm80Config.tile_m must be <= num_threads (one thread per LSE row)")
        if cfg.num_stages not in (1, 2):
            raise ValueError(f"BwdSm80Config.num_stages must be 1 or 2, got {cfg.num_stages}")
        if cfg.causal and cfg.local:
            raise ValueError("BwdSm80Config: causal and local are exclusive (local with window_right=0 is causal)")
        if cfg.kv_split < 1 or cfg.kv_split & (cfg.kv_split - 1):
            raise ValueError(f"BwdSm80Config.kv_split (Note [Split GQA group]) must be a power of two, got {cfg.kv_split}")
        err = mma_shape_error(cfg)
        if err:
            raise ValueError(f"BwdSm80Config: {err}")
        if cfg.smem_bytes() > SMEM_CAPACITY[cfg.arch]:
            raise ValueError(
                f"BwdSm80Config: {cfg.smem_bytes()} bytes of shared memory exceed "
                f"{cfg.arch}'s {SMEM_CAPACITY[cfg.arch]}"
            )

    @staticmethod
    def fake_args(cfg: BwdSm80Config) -> tuple:
        args = common.fake_args(cfg)
        return args[:-1] + (fake_aux(cfg.aux),) + args[-1:]  # the aux tensors before the stream

    # ----------------------------------------------------------------------------------------
    # Host side: layouts, copies, MMAs, launch
    # ----------------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_k, d)
        mV: cute.Tensor,  # (b, s_k, h_k, d)
        mdO: cute.Tensor,  # (b, s_q, h, d)
        mLSElog2: cute.Tensor,  # (b, h, s_q) float32
        mDpsum: cute.Tensor,  # (b, h, s_q) float32
        mdQaccum: cute.Tensor,  # (b, h, s_q, head_dim_padded) float32
        mdK: cute.Tensor,  # (b, s_k, h_k, d)
        mdV: cute.Tensor,  # (b, s_k, h_k, d)
        mCuSeqlensQ: Optional[cute.Tensor],  # (b + 1,) int32
        mCuSeqlensK: Optional[cute.Tensor],  # (b + 1,) int32
        mSeqUsedK: Optional[cute.Tensor],  # (b,) int32
        mSemaphore: Optional[cute.Tensor],  # (b, h, ceil(max_seqlen_q / tile_m)) int32
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        max_seqlen_k: Int32,  # longest key sequence (varlen grid); ignored for fixed length
        section_pairs: Int32,  # launch order: (batch, kv head) pairs per section (Note [Launch order], common.py)
        mAux: Optional[tuple],  # the user functions' aux tensors (cfg.aux; fa4/mods.py)
        stream,
    ):
        common.check_main_kernel_types(self.cfg, self.dtype, mQ, mK, mV, mdO, mdK, mdV)
        d, hd = self.head_dim, self.head_dim
        atom = smem_layout_atom_sm80(self.dtype, d)
        sQ_layout = cute.tile_to_shape(atom, (self.tile_m, hd, self.num_stages), (0, 1, 2))
        sK_layout = cute.tile_to_shape(atom, (self.tile_n, hd), (0, 1))
        sPdS_layout = cute.tile_to_shape(smem_layout_atom_sm80(self.dtype, self.tile_n), (self.tile_m, self.tile_n), (0, 1))
        sRow_layout = cute.make_layout((self.tile_m, self.num_stages))
        deterministic = self.cfg.deterministic

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 16]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 16]
            if const_expr(deterministic):
                # Note [Split-phase dQ]: "this step's dQ slot is ready", set by thread 0.
                sReady: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]

        # gmem <-> smem copies of 16-bit tiles: 16 bytes per lane, lanes along a swizzle row.
        copy_g2s = tiled_copy_rows_16B(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype, num_bits_per_copy=128
            ),
            self.num_threads,
            atom,
        )
        copy_s2g = tiled_copy_rows_16B(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128), self.num_threads, atom
        )
        # One 4-byte cp.async per row statistic (LSE, D), by threads 0 .. tile_m - 1.
        copy_row = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32),
            cute.make_layout(self.tile_m),
            cute.make_layout(1),
        )
        mma_sdp = tiled_mma_sm80(self.dtype, self.num_threads, self.cfg.atom_m_sdp)
        mma_dkv = tiled_mma_sm80(self.dtype, self.num_threads, self.cfg.atom_n_dkv)
        mma_dq = dq_tiled_mma(self.cfg.dq_fragment, self.dtype, self.tile_m, self.head_dim)  # dq_accum's order

        num_batch, seqlen_k = grid_extent(mK, mCuSeqlensK, max_seqlen_k)
        num_x = cute.ceil_div(seqlen_k, self.tile_n)
        # 1-D, in sections of `section` (batch, kv head) pairs: Note [Launch order] in fa4/bwd/common.py
        # (with kv_split, of the partials' virtual kv heads: Note [Split GQA group]).
        section = cutlass.max(cutlass.min(section_pairs, mdK.shape[2] * num_batch), 1)
        grid = (num_x * mdK.shape[2] * num_batch, 1, 1)
        prescale, scale_log2 = score_scales(softmax_scale, softcap, self.cfg.has_softcap, self.score_mod is not None)
        if const_expr(not self.cfg.has_softcap and self.score_mod is None):
            prescale = Float32(1.0)
        self.kernel(
            mQ,
            mK,
            mV,
            mdO,
            mLSElog2,
            mDpsum,
            mdQaccum,
            mdK,
            mdV,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedK,
            mSemaphore,
            mAux,
            softmax_scale,
            prescale,
            scale_log2,
            window_left,
            window_right,
            num_x,
            num_batch,
            section,
            sQ_layout,
            sK_layout,
            sPdS_layout,
            sRow_layout,
            copy_g2s,
            copy_s2g,
            copy_row,
            mma_sdp,
            mma_dkv,
            mma_dq,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    # ----------------------------------------------------------------------------------------
    # Device side
    # ----------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mDpsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mSemaphore: Optional[cute.Tensor],
        mAux: Optional[tuple],
        softmax_scale: Float32,
        prescale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        num_x: Int32,
        num_batch: Int32,
        section: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        sRow_layout: cute.Layout,
        copy_g2s: cute.TiledCopy,
        copy_s2g: cute.TiledCopy,
        copy_row: cute.TiledCopy,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        # Sections of `section` (batch, kv head) pairs, one after the other; inside one, x slowest,
        # pairs fastest (kv heads fastest). Note [Launch order] in fa4/bwd/common.py.
        x_block, head_kv, batch = section_tile(cute.arch.block_idx()[0], num_x, mdK.shape[2], num_batch, section, False)
        seq = SeqlenInfo.create(batch, mQ.shape[1], mK.shape[1], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        # Keys this sequence owns (dK/dV rows to write) vs keys it uses (seqused_k <= that).
        seqlen_k_rows = seq.seqlen_k
        if const_expr(self.cfg.has_seqused_k):
            if const_expr(self.cfg.varlen_k):
                seqlen_k_rows = mCuSeqlensK[batch + 1] - seq.offset_k
            else:
                seqlen_k_rows = mK.shape[1]
        num_n_used = cute.ceil_div(seq.seqlen_k, self.tile_n)
        n_block = x_block
        if n_block * self.tile_n < seqlen_k_rows:
            mask = AttentionMask(
                self.tile_m,
                self.tile_n,
                self.cfg.causal,
                self.cfg.local,
                seq.seqlen_q,
                seq.seqlen_k,
                window_left,
                window_right,
            )
            m_min, m_max = mask.m_block_range(n_block)
            if const_expr(self.cfg.block_skip):  # (every thread of the CTA: whole warps)
                slot, bq, bk = self.cfg.block_skip
                g = mQ.shape[2] // mdK.shape[2]
                skip = BlockSkip(mAux[slot], bq, bk, self.tile_m, self.tile_n, batch, head_kv * g, Int32(0))
                m_min, m_max = skip.narrow_rows(n_block, m_min, m_max, head_kv * g, g)
            num_m = cutlass.max(m_max - m_min, 0)
            if n_block >= num_n_used:
                num_m = Int32(0)  # keys past seqused_k: dK = dV = 0
            group = mQ.shape[2] // mdK.shape[2]
            num_steps = num_m * group

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sdO = storage.sdO.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sK_layout)
            sV = storage.sV.get_tensor(sK_layout)
            sP = storage.sP.get_tensor(sPdS_layout)
            sdS = storage.sdS.get_tensor(sPdS_layout)
            sLSE = storage.sLSE.get_tensor(sRow_layout)
            sD = storage.sD.get_tensor(sRow_layout)
            sReady = None
            if const_expr(self.cfg.deterministic):
                sReady = storage.sReady.get_tensor(cute.make_layout(4))

            acc_dK = cute.make_rmem_tensor(
                mma_dkv.get_slice(tidx).partition_shape_C((self.tile_n, self.head_dim)), Float32
            )
            acc_dV = cute.make_rmem_tensor(
                mma_dkv.get_slice(tidx).partition_shape_C((self.tile_n, self.head_dim)), Float32
            )
            acc_dK.fill(0.0)
            acc_dV.fill(0.0)

            if num_steps > 0:
                head_k = head_kv // self.cfg.kv_split  # (Note [Split GQA group]: a virtual kv head)
                gK = cute.local_tile(seq.k_view(mK, batch, head_k), (self.tile_n, self.head_dim), (n_block, 0))
                gV = cute.local_tile(seq.k_view(mV, batch, head_k), (self.tile_n, self.head_dim), (n_block, 0))
                rows_k = seq.seqlen_k - n_block * self.tile_n
                d = mQ.shape[3]
                self.load_tile(copy_g2s, gK, sK, rows_k, d, tidx)
                self.load_tile(copy_g2s, gV, sV, rows_k, d, tidx)
                self.mainloop(
                    mQ,
                    mdO,
                    mLSElog2,
                    mDpsum,
                    mdQaccum,
                    mSemaphore,
                    seq,
                    mask,
                    batch,
                    head_kv,
                    n_block,
                    m_min,
                    num_m,
                    group,
                    num_steps,
                    prescale,
                    scale_log2,
                    sQ,
                    sdO,
                    sK,
                    sV,
                    sP,
                    sdS,
                    sLSE,
                    sD,
                    sReady,
                    acc_dK,
                    acc_dV,
                    copy_g2s,
                    copy_row,
                    mma_sdp,
                    mma_dkv,
                    mma_dq,
                    tidx,
                    mAux,
                )
            # No cp.async may still target sK/sV, and every warp is done reading them.
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            self.epilogue(
                acc_dK,
                acc_dV,
                mdK,
                mdV,
                sK,
                sV,
                seq,
                batch,
                head_kv,
                n_block,
                seqlen_k_rows - n_block * self.tile_n,
                softmax_scale,
                copy_s2g,
                mma_dkv,
                tidx,
            )

    @cute.jit
    def load_tile(self, copy: cute.TiledCopy, gT: cute.Tensor, sT: cute.Tensor, rows: Int32, d: Int32, tidx: Int32):
        """cp.async a (tile, head_dim) tile into smem; rows >= ``rows`` and columns >= ``d`` are
        zero-filled instead (Note [Out-of-bounds tiles])."""
        thr = copy.get_slice(tidx)
        tTgT = thr.partition_S(gT)
        tTsT = thr.partition_D(sT)
        tTcT = thr.partition_S(cute.make_identity_tensor((cute.size(sT, mode=[0]), self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(tTsT, mode=[1])):
            row_ok = tTcT[0, m, 0][0] < rows
            for k in cutlass.range_constexpr(cute.size(tTsT, mode=[2])):
                if row_ok and tTcT[0, m, k][1] < d:
                    cute.copy(copy, tTgT[None, m, k], tTsT[None, m, k])
                else:
                    tTsT[None, m, k].fill(0.0)

    @cute.jit
    def load_rows(
        self, copy_row: cute.TiledCopy, gR: cute.Tensor, sR: cute.Tensor, rows: Int32, fill: Float32, tidx: Int32
    ):
        """cp.async tile_m float32 row statistics; rows >= ``rows`` get ``fill``."""
        if tidx < self.tile_m:
            thr = copy_row.get_slice(tidx)
            tRgR = thr.partition_S(gR)
            tRsR = thr.partition_D(sR)
            if tidx < rows:
                cute.copy(copy_row, tRgR, tRsR)
            else:
                tRsR.fill(fill)

    @cute.jit
    def mainloop(
        self,
        mQ: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mDpsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSemaphore: Optional[cute.Tensor],
        seq: SeqlenInfo,
        mask: AttentionMask,
        batch: Int32,
        head_kv: Int32,
        n_block: Int32,
        m_min: Int32,
        num_m: Int32,
        group: Int32,
        num_steps: Int32,
        prescale: Float32,
        scale_log2: Float32,
        sQ: cute.Tensor,
        sdO: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sP: cute.Tensor,
        sdS: cute.Tensor,
        sLSE: cute.Tensor,
        sD: cute.Tensor,
        sReady: Optional[cute.Tensor],
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        copy_g2s: cute.TiledCopy,
        copy_row: cute.TiledCopy,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        tidx: Int32,
        mAux=None,
    ):
        """Steps t = 0 .. num_steps - 1 over the (q head, m_block) slots of :meth:`step_slot`;
        ``mAux``: the user functions' aux tensors (fa4/mods.py)."""
        hd = self.head_dim
        d = mQ.shape[3]
        # Transposed smem views for the MMAs whose reduction runs over the strided dim.
        sQt = cute.composition(
            sQ, cute.make_layout((hd, self.tile_m, self.num_stages), stride=(self.tile_m, 1, self.tile_m * hd))
        )
        sdOt = cute.composition(
            sdO, cute.make_layout((hd, self.tile_m, self.num_stages), stride=(self.tile_m, 1, self.tile_m * hd))
        )
        sKt = cute.composition(sK, cute.make_layout((hd, self.tile_n), stride=(self.tile_n, 1)))
        sPt = cute.composition(sP, cute.make_layout((self.tile_n, self.tile_m), stride=(self.tile_m, 1)))
        sdSt = cute.composition(sdS, cute.make_layout((self.tile_n, self.tile_m), stride=(self.tile_m, 1)))

        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        # Register fragments of the MMA operands.
        tSrQ = thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ[None, None, 0]))
        tSrK = thr_sdp.make_fragment_B(thr_sdp.partition_B(sK))
        tdPrdO = thr_sdp.make_fragment_A(thr_sdp.partition_A(sdO[None, None, 0]))
        tdPrV = thr_sdp.make_fragment_B(thr_sdp.partition_B(sV))
        tdVrPt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sPt))
        tdVrdOt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sdOt[None, None, 0]))
        tdKrdSt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sdSt))
        tdKrQt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sQt[None, None, 0]))
        tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tdQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(sKt))
        # ldmatrix copies (.trans for the transposed views) and their smem partitions.
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        cp_A_sdp = cute.make_tiled_copy_A(ldsm, mma_sdp).get_slice(tidx)
        cp_B_sdp = cute.make_tiled_copy_B(ldsm, mma_sdp).get_slice(tidx)
        cp_A_dkv = cute.make_tiled_copy_A(ldsm_t, mma_dkv).get_slice(tidx)
        cp_B_dkv = cute.make_tiled_copy_B(ldsm_t, mma_dkv).get_slice(tidx)
        cp_A_dq = cute.make_tiled_copy_A(ldsm, mma_dq).get_slice(tidx)
        cp_B_dq = cute.make_tiled_copy_B(ldsm_t, mma_dq).get_slice(tidx)
        tSsQ = cp_A_sdp.partition_S(sQ)
        tSsK = cp_B_sdp.partition_S(sK)
        tdPsdO = cp_A_sdp.partition_S(sdO)
        tdPsV = cp_B_sdp.partition_S(sV)
        tdVsPt = cp_A_dkv.partition_S(sPt)
        tdVsdOt = cp_B_dkv.partition_S(sdOt)
        tdKsdSt = cp_A_dkv.partition_S(sdSt)
        tdKsQt = cp_B_dkv.partition_S(sQt)
        tdQsdS = cp_A_dq.partition_S(sdS)
        tdQsKt = cp_B_dq.partition_S(sKt)
        # Register -> smem copies of P and dS (pairs of 16-bit values).
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width),
            mma_sdp,
        ).get_slice(tidx)
        tPsP = r2s.partition_D(sP)
        tdSsdS = r2s.partition_D(sdS)
        # This thread's accumulator rows in the S tile (for LSE / D).
        tScS_mn = make_acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        num_rows = cute.size(tScS_mn, mode=[0])

        acc_shape_S = thr_sdp.partition_shape_C((self.tile_m, self.tile_n))
        acc_shape_dQ = thr_dq.partition_shape_C((self.tile_m, hd))
        # m_blocks that need the causal/local mask, and whether keys pass seqlen_k (last block).
        seqlen_k_partial = (n_block + 1) * self.tile_n > seq.seqlen_k
        m_no_mask = mask.m_block_max_no_window_mask(n_block)

        # The loads of one step (Q, dO, LSE, D of its slot) into an smem stage: (t, stage) -> None.
        load_step = partial(
            self.load_step, mQ, mdO, mLSElog2, mDpsum, seq, batch, head_kv, group, m_min, num_m,
            sQ, sdO, sLSE, sD, copy_g2s, copy_row, d, tidx,
        )
        load_step(Int32(0), Int32(0))
        cute.arch.cp_async_commit_group()

        for t in cutlass.range(num_steps, unroll=1):
            head, m_block = self.step_slot(t, head_kv, group, m_min, num_m)
            stage = t % self.num_stages if const_expr(self.num_stages == 2) else 0
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if const_expr(self.cfg.deterministic):
                # Every thread's dQ adds of step t - 1 are issued (barrier above): publish them, and
                # peek at this step's slot (Note [Split-phase dQ]). Before this step's cp.async,
                # so that the fence waits for nothing but the adds and the peek.
                if tidx == 0:
                    self.det_step_begin(
                        mSemaphore, mask, batch, head, m_block, head_kv, group, m_min, num_m, n_block, t, sReady
                    )
            if const_expr(self.num_stages == 2):
                if t + 1 < num_steps:
                    load_step(t + 1, 1 - stage)
                cute.arch.cp_async_commit_group()

            # S = Q K^T, then P in place.
            acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
            acc_S.fill(0.0)
            gemm_sm80(mma_sdp, acc_S, tSrQ, tSrK, tSsQ[None, None, None, stage], tSsK, cp_A_sdp, cp_B_sdp)
            tanh_S = None
            if const_expr(self.cfg.has_softcap):
                apply_softcap(acc_S, prescale)
                tanh_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                tanh_S.store(acc_S.load())
            umod, raw_S = None, None
            if const_expr(self.user_mods):  # every step, before the mask (fa4/mods.py)
                umod = UserMods(self.score_mod, self.mask_mod, self.tile_m, self.tile_n, 1, batch, head, seq, mAux,
                                score_mod_bwd=self.score_mod_bwd, backward=True)
                if const_expr(self.score_mod is not None):  # Q K^T as the score_mod read it, for its derivative
                    raw_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                    raw_S.store(acc_S.load())
                umod.apply(acc_S, thr_sdp, m_block, n_block, prescale)
            need_mask = seqlen_k_partial
            if const_expr(self.cfg.local):
                need_mask = Boolean(True)
            elif const_expr(self.cfg.causal):
                need_mask = need_mask or m_block < m_no_mask
            if need_mask:
                mask.apply(acc_S, thr_sdp, m_block, n_block, mask_seqlen=True, mask_window=True)
            acc_S_mn = make_acc_mn_view(acc_S)
            lse = cute.make_rmem_tensor(num_rows, Float32)
            for r in cutlass.range_constexpr(num_rows):
                lse[r] = sLSE[tScS_mn[r, 0][0], stage]
            exp2_rows(acc_S_mn, lse, scale_log2, 0.0)

            # dP = dO V^T, then dS = P (dP - D) in place.
            acc_dP = cute.make_rmem_tensor(acc_shape_S, Float32)
            acc_dP.fill(0.0)
            gemm_sm80(mma_sdp, acc_dP, tdPrdO, tdPrV, tdPsdO[None, None, None, stage], tdPsV, cp_A_sdp, cp_B_sdp)
            acc_dP_mn = make_acc_mn_view(acc_dP)
            for r in cutlass.range_constexpr(num_rows):
                dpsum = sD[tScS_mn[r, 0][0], stage]
                for c in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[1])):
                    acc_dP_mn[r, c] = acc_S_mn[r, c] * (acc_dP_mn[r, c] - dpsum)
            if const_expr(self.cfg.has_softcap):
                softcap_grad(acc_dP, tanh_S)
            if const_expr(self.score_mod is not None):  # through the score_mod: its derivative
                umod.apply_bwd(acc_dP, raw_S, thr_sdp, m_block, n_block, prescale)

            # P and dS to smem (16-bit) for the transposed operands.
            rP = cute.make_rmem_tensor(acc_shape_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            cute.copy(r2s, r2s.retile(rP), tPsP)
            rdS = cute.make_rmem_tensor(acc_shape_S, self.dtype)
            rdS.store(acc_dP.load().to(self.dtype))
            cute.copy(r2s, r2s.retile(rdS), tdSsdS)
            cute.arch.barrier()

            # dV += P^T dO, dK += dS^T Q.
            gemm_sm80(mma_dkv, acc_dV, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt[None, None, None, stage], cp_A_dkv, cp_B_dkv)
            gemm_sm80(mma_dkv, acc_dK, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt[None, None, None, stage], cp_A_dkv, cp_B_dkv)
            if const_expr(self.num_stages == 1):
                # Q and dO of this step are consumed: fetch the next step's while dQ runs.
                cute.arch.barrier()
                if t + 1 < num_steps:
                    load_step(t + 1, Int32(0))
                cute.arch.cp_async_commit_group()

            if const_expr(self.cfg.deterministic):
                # Slow path: the peek at the top of the step saw an earlier count (CTA-uniform).
                # Before the dQ MMA, where its accumulator does not hold registers yet.
                if sReady[0] == 0:
                    if tidx == 0:
                        n_min, _ = mask.n_block_range(m_block)
                        semaphore.spin(self.sem_ptr(mSemaphore, batch, head, m_block), n_block - n_min)
                    cute.arch.barrier()
            # dQ_accum += dS K.
            acc_dQ = cute.make_rmem_tensor(acc_shape_dQ, Float32)
            acc_dQ.fill(0.0)
            gemm_sm80(mma_dq, acc_dQ, tdQrdS, tdQrKt, tdQsdS, tdQsKt, cp_A_dq, cp_B_dq)
            self.store_dq(acc_dQ, mdQaccum, seq, batch, head, m_block, tidx)

        if const_expr(self.cfg.deterministic):
            # Publish the last step's adds (every thread's are issued after the barrier).
            cute.arch.barrier()
            if tidx == 0:
                last_head, last_m = self.step_slot(num_steps - 1, head_kv, group, m_min, num_m)
                semaphore.publish(self.sem_ptr(mSemaphore, batch, last_head, last_m), True)

    @cute.jit
    def load_step(
        self,
        mQ: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,
        mDpsum: cute.Tensor,
        seq: SeqlenInfo,
        batch: Int32,
        head_kv: Int32,
        group: Int32,
        m_min: Int32,
        num_m: Int32,
        sQ: cute.Tensor,
        sdO: cute.Tensor,
        sLSE: cute.Tensor,
        sD: cute.Tensor,
        copy_g2s: cute.TiledCopy,
        copy_row: cute.TiledCopy,
        d: Int32,
        tidx: Int32,
        t: Int32,
        stage: Int32,
    ):
        """Issue the loads of step ``t`` (Q, dO, lse_log2, D of one (q head, m_block)) into ``stage``."""
        head, m_block = self.step_slot(t, head_kv, group, m_min, num_m)
        rows = seq.seqlen_q - m_block * self.tile_m
        tile = (self.tile_m, self.head_dim)
        gQ = cute.local_tile(seq.q_view(mQ, batch, head), tile, (m_block, 0))
        gdO = cute.local_tile(seq.q_view(mdO, batch, head), tile, (m_block, 0))
        self.load_tile(copy_g2s, gQ, sQ[None, None, stage], rows, d, tidx)
        self.load_tile(copy_g2s, gdO, sdO[None, None, stage], rows, d, tidx)
        gLSE = cute.local_tile(rows_view(mLSElog2, seq, batch, head, self.tile_m), (self.tile_m,), (m_block,))
        gD = cute.local_tile(rows_view(mDpsum, seq, batch, head, self.tile_m), (self.tile_m,), (m_block,))
        self.load_rows(copy_row, gLSE, sLSE[None, stage], rows, Float32.inf, tidx)
        self.load_rows(copy_row, gD, sD[None, stage], rows, Float32(0.0), tidx)

    def step_slot(self, t: Int32, head_kv: Int32, group: Int32, m_min: Int32, num_m: Int32):
        """(q head, m_block) of step ``t``: :func:`fa4.bwd.common.step_slot`."""
        return common.step_slot(t, head_kv, group, m_min, num_m, self.cfg.deterministic)

    def sem_ptr(self, mSemaphore: cute.Tensor, batch: Int32, head: Int32, m_block: Int32):
        """The counter of the dQ slot (batch, q head, m_block) (plain arithmetic, traced inline)."""
        return mSemaphore.iterator + cute.crd2idx((batch, head, m_block), mSemaphore.layout)

    @cute.jit
    def det_step_begin(
        self,
        mSemaphore: cute.Tensor,
        mask: AttentionMask,
        batch: Int32,
        head: Int32,
        m_block: Int32,
        head_kv: Int32,
        group: Int32,
        m_min: Int32,
        num_m: Int32,
        n_block: Int32,
        t: Int32,
        sReady: cute.Tensor,
    ):
        """Thread 0, top of step ``t`` (after the CTA barrier): peek at this step's counter (relaxed),
        fence once -- the release of step ``t - 1``'s adds and the acquire of the peeked value --,
        add 1 to step ``t - 1``'s counter (``t > 0``), and record in ``sReady[0]`` whether the peek
        already saw this CTA's rank (Note [Split-phase dQ], Note [Split-phase] in
        fa4/sched/semaphore.py). ``(head, m_block)`` is step ``t``'s slot."""
        seen = semaphore.peek(self.sem_ptr(mSemaphore, batch, head, m_block))
        prev_head, prev_m = self.step_slot(cutlass.max(t - 1, 0), head_kv, group, m_min, num_m)
        semaphore.publish(self.sem_ptr(mSemaphore, batch, prev_head, prev_m), t > 0)
        n_min, _ = mask.n_block_range(m_block)
        sReady[0] = Int32(seen == n_block - n_min)

    @cute.jit
    def store_dq(
        self,
        acc_dQ: cute.Tensor,
        mdQaccum: cute.Tensor,
        seq: SeqlenInfo,
        batch: Int32,
        head: Int32,
        m_block: Int32,
        tidx: Int32,
    ):
        """Add this K block's dQ tile into its dq_accum tile, in fragment order (Note [dQ
        accumulator layout] in fa4/bwd/workspace.py: full cache lines, no row predicate). In
        deterministic mode the caller has waited for the K blocks ranked before it."""
        tile = (self.tile_m, self.head_dim)
        gdQ = cute.local_tile(dq_accum_view(mdQaccum, seq, batch, head, self.tile_m), tile, (m_block, 0))
        vec = red_vec(self.cfg.arch)
        red_add_fragment(acc_dQ, thread_fragment(gdQ, self.cfg.dq_fragment, cute.size(acc_dQ), vec, tidx), vec)

    @cute.jit
    def epilogue(
        self,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        seq: SeqlenInfo,
        batch: Int32,
        head_kv: Int32,
        n_block: Int32,
        rows: Int32,
        softmax_scale: Float32,
        copy_s2g: cute.TiledCopy,
        mma_dkv: cute.TiledMma,
        tidx: Int32,
    ):
        """dK *= softmax_scale; dK, dV -> dtype -> smem (over sK, sV) -> gmem, 128-bit, predicated
        (with ``kv_split``: float32 partials from registers, :func:`fa4.bwd.common.store_dkv_partial`)."""
        acc_dK.store(acc_dK.load() * softmax_scale)
        if const_expr(self.cfg.kv_split > 1):
            for acc, mT in ((acc_dK, mdK), (acc_dV, mdV)):
                common.store_dkv_partial(acc, mma_dkv.get_slice(tidx), mT, seq, batch, head_kv, n_block, rows,
                                         self.tile_n, self.head_dim)
            return
        acc_to_smem(acc_dK, mma_dkv, sK, tidx)
        acc_to_smem(acc_dV, mma_dkv, sV, tidx)
        cute.arch.barrier()
        tile = (self.tile_n, self.head_dim)
        for mT, sT in ((mdK, sK), (mdV, sV)):
            gT = cute.local_tile(seq.k_view(mT, batch, head_kv), tile, (n_block, 0))
            smem_to_gmem_pred(copy_s2g, sT, gT, rows, mdK.shape[3], tidx)


FlashBwdSm80.kernel.set_name_prefix("fa4_bwd_sm80", remove_cutlass_symbol=True)


# --------------------------------------------------------------------------------------------
# Tuning table and launcher (host)
# --------------------------------------------------------------------------------------------

# Padded head dim -> (tile_m, tile_n, num_threads, atom_m_sdp, atom_n_dkv, atom_m_dq): FlashAttention-2's
# sm80 backward choices (A100, 8 warps), adjusted so every warp layout divides the padded head dim.
# Measured on an H200 (docs/RESULTS.md, v0.1 sweeps): d128 64x128 atoms 2/4/2 300 TFLOP/s (s8192)
# vs 2/4/4 290, 4/2/2 282, 2/2/2 297, 128x128 269, 64x64/4 warps 252; d64 128x128 best; d256 64x64
# atoms 4/2/2 213 vs 4/4/4 200 and 2/2/2 213. v0.2 (dq_accum in fragment order), d256: 2/2/2 265
# (non-causal) / 263 (causal) vs 4/2/2 254 / 255, 4/4/4 234 / 243, one stage 244 / 249, so 256 uses
# 2/2/2; d192 (h8 s8192): 4/2/2 243.7 / 243.9 vs 2/2/2 241.4 / 242.8, so 160-224 keep 4/2/2.
TUNING = {
    32: (128, 128, 256, 2, 4, 4),
    64: (128, 128, 256, 2, 4, 4),
    96: (64, 128, 256, 2, 4, 4),
    128: (64, 128, 256, 2, 4, 2),
    160: (64, 64, 256, 4, 2, 2),
    192: (64, 64, 256, 4, 2, 2),
    224: (64, 64, 256, 4, 2, 2),
    256: (64, 64, 256, 2, 2, 2),
}


def _pick_atoms(
    tile_m: int, tile_n: int, head_dim: int, num_threads: int, preferred: tuple[int, int, int]
) -> Optional[tuple[int, int, int]]:
    """Warp layouts for (S/dP, dK/dV, dQ) that tile the given shapes: the preferred ones when they
    fit, else the first fitting choice (fewest warps along dim 0 first)."""
    warps = num_threads // 32
    options = [a for a in (1, 2, 4, 8) if warps % a == 0]
    picked = []
    for pref, dim0, dim1, red in (
        (preferred[0], tile_m, tile_n, head_dim),
        (preferred[1], tile_n, head_dim, tile_m),
        (preferred[2], tile_m, head_dim, tile_n),
    ):
        fits = [a for a in options if dim0 % (16 * a) == 0 and dim1 % (16 * (warps // a)) == 0 and red % 16 == 0]
        if not fits:
            return None
        picked.append(pref if pref in fits else fits[0])
    return tuple(picked)


def make_config(
    problem: AttnProblem, options: Optional[KernelOptions], arch: str, deterministic: bool = False
) -> BwdSm80Config:
    """The kernel config for ``problem`` on ``arch`` (a code-generation target, e.g. "sm_90a").

    Tiles come from :data:`TUNING` for the padded head dim; ``options.bwd_tile_m``,
    ``bwd_tile_n`` and ``bwd_num_threads`` override them (ValueError naming the option when the
    kernel cannot run them). Two smem stages when they fit the arch's shared memory, else one.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS} (a code-generation target), got {arch!r}")
    if problem.head_dim != problem.head_dim_v:
        raise NotImplementedError(
            f"the sm80 backward needs head_dim_v == head_dim, got {problem.head_dim_v} != {problem.head_dim}"
        )
    hd = head_dim_padded(problem.head_dim)
    tile_m, tile_n, threads, *atoms = TUNING[hd]
    opts = options or KernelOptions()
    for name, value, allowed in (
        ("bwd_tile_m", opts.bwd_tile_m, (32, 64, 128)),
        ("bwd_tile_n", opts.bwd_tile_n, (32, 64, 128)),
        ("bwd_num_threads", opts.bwd_num_threads, (128, 256)),
    ):
        if value is not None and value not in allowed:
            raise ValueError(f"KernelOptions.{name}={value} is not supported by the sm80 backward (allowed: {allowed})")
    if opts.bwd_two_cta:
        raise ValueError("KernelOptions.bwd_two_cta=True: the sm80 backward has no two-CTA path (clusters and "
                         "distributed shared memory are sm90's); use the sm90 family or leave it None")
    if opts.bwd_dq_pass:
        raise ValueError("KernelOptions.bwd_dq_pass=True: the sm80 backward has no dQ pass (a WGMMA kernel of the "
                         "sm90 family); use the sm90 family or leave it None")
    if opts.bwd_exp2_emu_frac:
        raise ValueError(f"KernelOptions.bwd_exp2_emu_frac={opts.bwd_exp2_emu_frac}: the sm80 backward computes every "
                         "exponential with MUFU ex2; use the sm90 family or leave it None (or 0)")
    if problem.score_mod and opts.bwd_tile_m is None:
        # The kept Q K^T of a score_mod (fa4/mods.py) spills with 128 rows (d64 with the tanh
        # score_mod of the tests: 25 spill stores; 64 rows: none).
        tile_m = min(tile_m, 64)
    tile_m = opts.bwd_tile_m or tile_m
    tile_n = opts.bwd_tile_n or tile_n
    threads = opts.bwd_num_threads or threads
    if tile_m > threads:
        raise ValueError(
            f"KernelOptions.bwd_tile_m={tile_m} must be <= bwd_num_threads ({threads}) in the sm80 backward"
        )
    picked = _pick_atoms(tile_m, tile_n, hd, threads, tuple(atoms))
    if picked is None:
        raise ValueError(
            f"KernelOptions.bwd_tile_m/bwd_tile_n/bwd_num_threads = {tile_m}/{tile_n}/{threads}: "
            f"no warp layout of the sm80 backward tiles them for head_dim {problem.head_dim}"
        )
    cfg = BwdSm80Config(
        arch=arch,
        dtype=problem.dtype,
        head_dim=hd,
        tile_m=tile_m,
        tile_n=tile_n,
        num_threads=threads,
        num_stages=2,
        atom_m_sdp=picked[0],
        atom_n_dkv=picked[1],
        atom_m_dq=picked[2],
        deterministic=bool(deterministic),
        block_skip=BlockSkip.table_fits(problem.block_table, tile_m, tile_n) if not deterministic else (),
        kv_split=common.choose_kv_split(
            opts, problem,
            (lambda: common.kv_split_for(problem, tile_m, tile_n, common.arch.num_sms())) if KV_SPLIT else None,
            deterministic=bool(deterministic)),
        score_mod_bwd=problem.score_mod_bwd,
        **BwdSm80Config.problem_flags(problem),
    )
    if cfg.smem_bytes() > SMEM_CAPACITY[arch]:
        cfg = replace(cfg, num_stages=1)
    if cfg.smem_bytes() > SMEM_CAPACITY[arch]:
        raise ValueError(
            f"KernelOptions.bwd_tile_m/bwd_tile_n = {tile_m}/{tile_n}: the sm80 backward needs "
            f"{cfg.smem_bytes()} bytes of shared memory for head_dim {problem.head_dim}, "
            f"more than {arch}'s {SMEM_CAPACITY[arch]}"
        )
    if cfg.score_mod or cfg.mask_mod:  # (before anything runs: the interface asks at forward time)
        FlashBwdSm80.can_implement(cfg)
    return cfg


KV_SPLIT = True
"""Whether the sm80 backward takes :func:`fa4.bwd.common.kv_split_for`'s split of the GQA group
(Note [Split GQA group] in fa4/bwd/sm90.py). Sweep v60 (docs/RESULTS.md v0.27, H200, two rounds,
TFLOP/s): MQA d128 s8k causal split 1 / 4 / 8: 160.0 / 306.6 / 317.4 and 159.8 / 309.7 / 317.1; d64
(g32) 150.2 / 287.2 / 291.0 and 150.9 / 283.9 / 291.2; without a mask split 1 / 2: 325.6 / 319.3 and
324.8 / 319.3 (the rule keeps 1 there). Measured on the H200 only (this family also serves sm8x GPUs
and sm100's fallback, unmeasured there). ``KernelOptions(bwd_kv_split=N)`` fixes a split instead
(with determinism too, since v0.28)."""


LAUNCH_ORDER = common.LaunchOrder(causal=16, det_no_mask=32, det_causal=64)
"""Pairs per launch section (Note [Launch order] in fa4/bwd/common.py), measured on the H200 (v0.2
in docs/RESULTS.md): with a causal mask, 16 pairs beat one section of all pairs by 0-3% and
sections of one pair by 1-7%; deterministic, 32 (no mask) beat one section of all pairs by up to 7%
at seqlen 1024 and sections of 2 by 1-13%, and 64 (causal) beat 16 by 0-5% and 4 by 1-13%."""


def run_backward(cfg: BwdSm80Config, problem: AttnProblem, dout, q, k, v, out, lse, dlse, cu_seqlens_q,
                 cu_seqlens_k, seqused_k, dq, dk, dv, aux=None) -> None:
    """dq, dk, dv in place: :func:`fa4.bwd.common.run_backward` with this family's launch order."""
    common.run_backward(cfg, problem, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                        dq, dk, dv, order=LAUNCH_ORDER, extra=(launch_aux(aux) if cfg.aux else None,))


def deterministic_schedule(*args, **kwargs):
    """:func:`fa4.bwd.common.deterministic_schedule` with this family's launch order."""
    return common.deterministic_schedule(*args, order=LAUNCH_ORDER, **kwargs)


_problem = common.representative_problem


def variants(arch: str) -> list[BwdSm80Config]:
    """A covering set of make_config's outputs: every padded head dim (32 .. 256), both dtypes, and
    each of causal / local / softcap / varlen / seqused_k / deterministic / one smem stage at
    least once."""
    cases = [
        (_problem(32), False),
        (_problem(64, "fp16", causal=True), False),
        (_problem(96, local=True), False),
        (_problem(128), False),
        (_problem(128, "fp16", causal=True), True),
        (_problem(160, softcap=30.0), False),
        (_problem(192, "fp16", causal=True, varlen=True), False),
        (_problem(224, local=True, varlen=True, seqused_k=True), False),
        (_problem(256, causal=True), False),
        (_problem(128, softcap=30.0, varlen=True, seqused_k=True), True),
    ]
    # (kv_split pinned, not from kv_split_for: the compiled set must not depend on the SM count.)
    out = [replace(make_config(p, None, arch, det), kv_split=1) for p, det in cases]
    if all(c.num_stages == 2 for c in out):
        out.append(replace(out[3], num_stages=1))
    # The split GQA group (KV_SPLIT; Note [Split GQA group] in fa4/bwd/sm90.py).
    out.append(replace(make_config(_problem(128, causal=True), None, arch), kv_split=4))
    out.append(replace(make_config(_problem(64, varlen=True, seqused_k=True), None, arch, True), kv_split=2))
    return out
