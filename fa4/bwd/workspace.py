"""The backward's float32 workspaces and their layouts, shared by every kernel that touches them.

The preprocess writes the row statistics (``lse_log2``, ``dpsum``) and zeroes the dQ accumulator,
the main kernel of either family reads the statistics and adds every K block's ``dS @ K`` tile into
the accumulator, and the postprocess reads it back, scales it and writes dq. All of them locate a
tile through the functions here, so the layouts cannot drift apart.

Note [Padded row tiles]
    The workspaces are cut into *tiles* of ``tile_m`` rows, the main kernel's Q block. Tile ``m``
    of a sequence starts at row ``tile_base + m * tile_m`` of its (batch, head):

    * fixed length: ``tile_base = 0`` and each (batch, head) holds ``seqlen_q`` rounded up to
      ``tile_m`` rows;
    * varlen (``cu_seqlens_q``, ``b = 1``): sequence ``s`` starts at the *padded offset*
      ``(cu_seqlens_q[s] // tile_m + s) * tile_m``. It is a multiple of ``tile_m`` (so a row
      statistic tile is 16-byte aligned for a bulk copy), and consecutive sequences never overlap:
      the offsets of ``s`` and ``s + 1`` differ by ``(cu[s+1] // tile_m - cu[s] // tile_m + 1) *
      tile_m >= ceil(len_s / tile_m) * tile_m``. ``(total_q // tile_m + batch) * tile_m`` rows
      hold every sequence's tiles.

    Rows of a tile past ``seqlen_q`` are *padding*: the preprocess writes ``lse_log2 = +inf`` and
    ``dpsum = 0`` there, so a main kernel that reads whole tiles gets ``P = 0`` and ``dS = 0`` for
    them, and zeroes their dQ rows, which then only ever receive exact zeros; the postprocess never
    writes them to dq.

Note [dQ accumulator layout]
    ``dq_accum`` is float32 ``(b, h, rows, head_dim_padded)``, but inside a tile (``tile_m *
    head_dim_padded`` contiguous floats) the floats are in the *fragment order* of the main
    kernel's dQ MMA (:class:`DqFragment`), not row-major. The tile is split into ``chunks``
    contiguous parts of ``chunk_threads`` threads each (sm80: one chunk of every thread; sm90: one
    chunk per warpgroup, so that each warpgroup's part is one bulk reduce-add); register ``i`` of
    thread ``t``'s accumulator (``vec`` consecutive registers per group ``v = i // vec``) lives at
    tile offset ``(t // chunk_threads) * chunk + (v * chunk_threads + t % chunk_threads) * vec + i % vec``.

    Why: an MMA accumulator gives a lane two adjacent columns of one row, so in row-major order a
    warp-wide reduction touches 8 rows x 8 (or 16) bytes -- 8 cache lines, 8 L2 requests for 64
    floats. In fragment order the 32 lanes of one instruction cover ``32 * vec`` consecutive
    floats: a full 128-byte line with scalar ``red.add.f32`` (``vec = 1``, sm80), four full lines
    with ``red.add.v4.f32`` (``vec = 4``), a quarter of the requests per float and no row
    predicate; on sm90 a warpgroup's chunk goes out as one ``cp.reduce.async.bulk``. The
    postprocess, built with the same tiled MMA (:func:`dq_tiled_mma`), maps every element back to
    its (row, column).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.seqlen import SeqlenInfo


def red_vec(arch: str) -> int:
    """Floats per reduction instruction: ``red.global.add.v4.f32`` needs sm_90; sm_80 has scalar
    ``red.add.f32`` only."""
    return 1 if arch == "sm_80" else 4


def head_dim_padded(d: int) -> int:
    """The padded head dim of the backward kernels and of ``dq_accum``'s last dim: a multiple of 32."""
    return (d + 31) // 32 * 32


# --------------------------------------------------------------------------------------------
# Shapes (host)
# --------------------------------------------------------------------------------------------


def padded_rows(batch: int, seqlen_q: int, tile_m: int, varlen: bool) -> int:
    """Rows per (batch, head) of the workspaces (Note [Padded row tiles]); ``seqlen_q`` is the
    per-sequence length (fixed length) or ``total_q`` (varlen, ``batch`` sequences)."""
    if varlen:
        return (seqlen_q // tile_m + batch) * tile_m
    return -(-seqlen_q // tile_m) * tile_m


def rows_shape(batch: int, heads: int, seqlen_q: int, tile_m: int, varlen: bool) -> tuple[int, int, int]:
    """Shape of ``lse_log2`` / ``dpsum``: ``(b, h, rows)``, varlen ``(1, h, rows)``."""
    return (1 if varlen else batch, heads, padded_rows(batch, seqlen_q, tile_m, varlen))


def dq_accum_shape(
    batch: int, heads: int, seqlen_q: int, head_dim_padded: int, tile_m: int, varlen: bool
) -> tuple[int, int, int, int]:
    """Shape of ``dq_accum``: the row statistics' shape with the padded head dim last."""
    return rows_shape(batch, heads, seqlen_q, tile_m, varlen) + (head_dim_padded,)


def dq_accum_placeholder(shape: tuple[int, int, int, int], device):
    """A 16-row float32 stand-in for a ``dq_accum`` of ``shape`` that no kernel reads or writes (the
    dQ pass, Note [dQ pass] in fa4/bwd/dq_sm90.py): its batch, head and head-dim modes match the
    other workspaces' (the kernels' symbolic sizes are shared), 16 rows."""
    import torch

    return torch.empty(shape[:2] + (16,) + shape[3:], dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------
# Views (device; plain arithmetic, traced inline)
# --------------------------------------------------------------------------------------------


def tile_base(seq: SeqlenInfo, batch: Int32, tile_m: int):
    """First row of this sequence's tiles in its (batch, head) of a workspace."""
    if const_expr(not seq.varlen_q):
        return Int32(0)
    return (seq.offset_q // tile_m + batch) * tile_m


def dq_accum_view(mdQaccum: cute.Tensor, seq: SeqlenInfo, batch: Int32, head: Int32, tile_m: int) -> cute.Tensor:
    """``(rows, head_dim_padded)`` view of ``dq_accum`` for one (batch, head), from the sequence's
    first tile on."""
    if const_expr(not seq.varlen_q):
        return mdQaccum[batch, head, None, None]
    return cute.domain_offset((tile_base(seq, batch, tile_m), 0), mdQaccum[0, head, None, None])


def rows_view(mRows: cute.Tensor, seq: SeqlenInfo, batch: Int32, head: Int32, tile_m: int) -> cute.Tensor:
    """``(rows,)`` view of ``lse_log2`` / ``dpsum`` for one (batch, head), from the first tile on."""
    if const_expr(not seq.varlen_q):
        return mRows[batch, head, None]
    return cute.domain_offset((tile_base(seq, batch, tile_m),), mRows[0, head, None])


def rows_tma_order(mRows: cute.Tensor) -> cute.Tensor:
    """``lse_log2`` / ``dpsum`` ``(b, h, rows)`` as ``(rows, h, b)`` (same memory): the order a TMA
    atom tiles in (rows first; every stride a multiple of 16 bytes, the rows being whole tiles)."""
    return cute.make_tensor(mRows.iterator, cute.select(mRows.layout, mode=[2, 1, 0]))


def rows_view_tma(mRows_t: cute.Tensor, seq: SeqlenInfo, batch: Int32, head: Int32, tile_m: int) -> cute.Tensor:
    """:func:`rows_view` of a ``(rows, h, b)`` TMA coordinate tensor (:func:`rows_tma_order`)."""
    if const_expr(not seq.varlen_q):
        return mRows_t[None, head, batch]
    return cute.domain_offset((tile_base(seq, batch, tile_m),), mRows_t[None, head, 0])


# --------------------------------------------------------------------------------------------
# Fragment order of the dQ tiles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DqFragment:
    """The dQ MMA of a main kernel, which fixes the order of the floats in a dq_accum tile
    (Note [dQ accumulator layout]). ``mma``: "sm80" (``mma.sync`` over ``num_threads // 32`` warps,
    ``atom_m`` of them along the rows) or "sm90" (wgmma over ``num_threads // 128`` warpgroups,
    ``atom_m`` along the rows and ``atom_n`` along the head dim). ``swap`` (sm90): the MMA computes
    dQ^T = K^T dS^T, a ``(head_dim, tile_m)`` tile with ``atom_m`` warpgroups along the head dim, for
    tiles of rows that are not a multiple of 64 (wgmma's M) but are a valid N (80)."""

    mma: str
    num_threads: int
    atom_m: int
    atom_n: int = 1
    swap: bool = False

    @property
    def chunk_threads(self) -> int:
        return 128 if self.mma == "sm90" else self.num_threads

    def mma_shape(self, tile_m: int, head_dim: int) -> tuple[int, int]:
        """The (M, N) of the dQ MMA's tile: ``(tile_m, head_dim)``, swapped ``(head_dim, tile_m)``."""
        return (head_dim, tile_m) if self.swap else (tile_m, head_dim)



def dq_tiled_mma(frag: DqFragment, dtype, tile_m: int, head_dim: int) -> cute.TiledMma:
    """The tiled MMA of ``frag`` for a ``(tile_m, head_dim)`` dQ tile (inside a jit function).
    sm90: A (dS, ``tile_m`` contiguous) and B (K^T, ``head_dim`` contiguous) both MN-major; swapped,
    A is K^T and B is dS, still both MN-major, over the ``(head_dim, tile_m)`` tile."""
    from fa4.cute_utils import tiled_mma_sm80

    if frag.mma == "sm80":
        return tiled_mma_sm80(dtype, frag.num_threads, frag.atom_m)
    import cutlass.utils.hopper_helpers as sm90_utils

    MN = cute.nvgpu.OperandMajorMode.MN
    mm, nn = frag.mma_shape(tile_m, head_dim)
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, MN, MN, Float32, (frag.atom_m, frag.atom_n, 1), (64, nn // frag.atom_n))


def thread_fragment(tile: cute.Tensor, frag: DqFragment, frag_size: int, vec: int, tidx: Int32) -> cute.Tensor:
    """Thread ``tidx``'s ``(vec, frag_size // vec)`` part of one tile (``tile``: the ``(tile_m,
    head_dim)`` gmem tile, compact): element ``(j, v)`` is the thread's register ``v * vec + j``."""
    ct = frag.chunk_threads
    chunk = frag_size * ct
    base = tile.iterator + (tidx // ct) * chunk + (tidx % ct) * vec
    return cute.make_tensor(base, cute.make_layout((vec, frag_size // vec), stride=(1, vec * ct)))


@cute.jit
def red_add_fragment(acc: cute.Tensor, gFrag: cute.Tensor, vec: cutlass.Constexpr[int]):
    """``gFrag += acc`` with ``red.add`` (relaxed, gpu scope), ``vec`` floats per instruction.
    ``acc`` is a compact register tensor, ``gFrag`` from :func:`thread_fragment`."""
    acc_v = cute.make_tensor(acc.iterator, cute.make_layout(gFrag.shape))
    for v in cutlass.range_constexpr(cute.size(gFrag, mode=[1])):
        ptr = gFrag[None, v].iterator
        if const_expr(vec == 1):
            cute.arch.red(ptr, acc_v[0, v], op="add", dtype=Float32, sem="relaxed", scope="gpu")
        else:
            cute.arch.red(ptr, acc_v[None, v].load(), op="add", dtype=Float32, sem="relaxed", scope="gpu")
