"""The float32 dQ accumulator of the backward: its layout, shared by the kernels that touch it.

The preprocess zeroes it, the main kernel adds every K block's ``dS @ K`` tile into it with
reduction instructions, and the postprocess reads it back, scales it and writes dq.

Note [dQ accumulator layout]
    ``dq_accum`` is a float32 ``(b, h, rows, head_dim_padded)`` tensor, but its rows are not
    query rows. It is cut into *tiles* of ``tile_m`` rows -- one per m_block of the main kernel,
    ``tile_m * head_dim_padded`` contiguous floats -- and inside a tile the floats are in
    *fragment order*: register ``i`` of the main kernel's thread ``t``'s dQ accumulator (``vec``
    consecutive registers per group ``v = i // vec``) lives at tile offset
    ``(v * num_threads + t) * vec + i % vec``.

    Why: the MMA accumulator gives a lane two adjacent columns of one row, so in row-major order a
    warp-wide reduction touches 8 rows x 8 (or 16) bytes -- 8 cache lines, 8 L2 requests for 64
    floats. In fragment order the 32 lanes of one instruction cover ``32 * vec`` consecutive floats:
    a full 128-byte line with scalar ``red.add.f32`` (``vec = 1``, sm80), four full lines with
    ``red.add.v4.f32`` (``vec = 4``, sm90+), a quarter of the requests per float and no row
    predicate. The postprocess, built with the same tiled MMA (:func:`fa4.cute_utils.tiled_mma_sm80`), maps every element
    back to its (row, column).

    Tile bases. Fixed length: tile ``m`` of (batch, head) is rows ``[m * tile_m, (m + 1) *
    tile_m)`` of ``dq_accum[batch, head]``, ``rows = seqlen_q`` rounded up to ``tile_m``. Varlen:
    sequence ``b`` starts at row ``cu_seqlens_q[b] + b * tile_m`` of ``dq_accum[0, head]`` and
    ``rows = total_q + batch * tile_m``, so that the rounded-up tiles of consecutive sequences
    never overlap. Rows of a tile past ``seqlen_q`` are zeroed by the preprocess and only ever
    receive exact zeros (their ``P`` and ``dS`` are 0: Note [Out-of-bounds tiles] in
    fa4/bwd/sm80.py); the postprocess does not write them to dq.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.seqlen import SeqlenInfo


def red_vec(arch: str) -> int:
    """Floats per reduction instruction: ``red.global.add.v4.f32`` needs sm_90; sm_80 has scalar
    ``red.add.f32`` only."""
    return 1 if arch == "sm_80" else 4


def dq_accum_shape(
    batch: int, heads: int, seqlen_q: int, head_dim_padded: int, tile_m: int, varlen: bool
) -> tuple[int, int, int, int]:
    """Host: the shape to allocate. ``seqlen_q`` is the per-sequence length (fixed length) or
    ``total_q`` (varlen, ``batch`` sequences)."""
    if varlen:
        return (1, heads, seqlen_q + batch * tile_m, head_dim_padded)
    return (batch, heads, -(-seqlen_q // tile_m) * tile_m, head_dim_padded)


def dq_accum_view(mdQaccum: cute.Tensor, seq: SeqlenInfo, batch: Int32, head: Int32, tile_m: int) -> cute.Tensor:
    """``(rows, head_dim_padded)`` view of ``dq_accum`` for one (batch, head), starting at the row
    base of its first tile (Note [dQ accumulator layout])."""
    if const_expr(not seq.varlen_q):
        return mdQaccum[batch, head, None, None]
    return cute.domain_offset((seq.offset_q + batch * tile_m, 0), mdQaccum[0, head, None, None])


def thread_fragment(tile: cute.Tensor, num_threads: int, frag_size: int, vec: int, tidx: Int32) -> cute.Tensor:
    """Thread ``tidx``'s ``(vec, frag_size // vec)`` part of one tile (``tile``: the ``(tile_m,
    head_dim)`` gmem tile, compact): element ``(j, v)`` is the thread's register ``v * vec + j``."""
    base = tile.iterator + tidx * vec
    return cute.make_tensor(base, cute.make_layout((vec, frag_size // vec), stride=(1, vec * num_threads)))


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
