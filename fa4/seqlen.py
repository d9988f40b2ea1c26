"""Per-batch sequence offsets and lengths (device), and the per-(batch, head) global views.

Tensor conventions (DESIGN.md): Q/O ``(b, s_q, h, d)``, K/V ``(b, s_k, h_k, d)``, LSE ``(b, h, s_q)``.
Varlen tensors arrive as ``(1, total, h, d)`` / LSE ``(1, h, total_q)`` with ``cu_seqlens`` giving each
sequence's first row; ``seqused_k`` (optional) caps the keys a sequence uses.

:class:`SeqlenInfo` reads ``cu_seqlens`` / ``seqused_k`` once per CTA; its ``*_view`` methods return
the ``(seqlen, d)`` (or ``(seqlen,)``) tensor of one (batch, head): the row offset of a varlen
sequence is applied with ``cute.domain_offset``, so with 64-bit strides in the kernel's argument
layouts (every fa4 launcher declares them so) all batch / sequence offsets are 64-bit. Rows past
``seqlen_q`` / ``seqlen_k`` belong to other sequences (or are out of the tensor): callers predicate
them with the lengths held here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class SeqlenInfo:
    """Offsets and lengths of one batch entry (built on the device at the start of a tile).

    ``offset_q`` / ``offset_k``: first row of the sequence in the ``(1, total, ...)`` varlen view
    (0 when not varlen); ``seqlen_q`` / ``seqlen_k``: its lengths (``seqlen_k`` = ``seqused_k[b]``
    when given). ``varlen_q`` / ``varlen_k`` are compile-time.
    """

    offset_q: Int32
    offset_k: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    varlen_q: cutlass.Constexpr[bool] = False
    varlen_k: cutlass.Constexpr[bool] = False

    @staticmethod
    def create(
        batch: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,
        mSeqUsedQ: Optional[cute.Tensor] = None,
    ) -> "SeqlenInfo":
        """``seqlen_*_static``: the sequence mode of Q / K (used when not varlen; for paged K/V the
        page table's capacity); ``mSeqUsedQ`` / ``mSeqUsedK`` cap the lengths (values past the
        length are clamped to it)."""
        if const_expr(mCuSeqlensQ is not None):
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        else:
            offset_q = Int32(0)
            seqlen_q = Int32(seqlen_q_static)
        if const_expr(mCuSeqlensK is not None):
            offset_k = mCuSeqlensK[batch]
            seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        else:
            offset_k = Int32(0)
            seqlen_k = Int32(seqlen_k_static)
        # A used length past the sequence (or the batched / paged capacity) is clamped to it: the
        # rows past it belong to another sequence or lie outside the tensor.
        if const_expr(mSeqUsedK is not None):
            seqlen_k = cutlass.min(mSeqUsedK[batch], seqlen_k)
        if const_expr(mSeqUsedQ is not None):
            seqlen_q = cutlass.min(mSeqUsedQ[batch], seqlen_q)
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k, mCuSeqlensQ is not None, mCuSeqlensK is not None)

    # ----------------------------------------------------------------------------------------
    # Views. ``mT`` is in the kernel-boundary layout (b, s, h, d); the result is (s, d) of one
    # (batch, head), starting at this sequence's first row.
    # ----------------------------------------------------------------------------------------

    def q_view(self, mQ: cute.Tensor, batch: Int32, head: Int32) -> cute.Tensor:
        """(seqlen_q, d) view of Q (or O, or dO) for (batch, head)."""
        return _seq_view(mQ, batch, head, self.offset_q, self.varlen_q)

    def k_view(self, mK: cute.Tensor, batch: Int32, head_kv: Int32) -> cute.Tensor:
        """(seqlen_k, d) view of K (or V, dK, dV) for (batch, kv head)."""
        return _seq_view(mK, batch, head_kv, self.offset_k, self.varlen_k)

    # Views of tensors in the TMA order ``(s, d, h, b)`` (:func:`to_sdhb`): TMA coordinate tensors
    # of the sm90 kernels, whose tiles must lead with the (rows, head dim) modes.

    def q_view_sd(self, mT: cute.Tensor, batch: Int32, head: Int32) -> cute.Tensor:
        """(seqlen_q, d) view of an ``(s, d, h, b)`` Q/O tensor for (batch, head)."""
        return _seq_view_sd(mT, batch, head, self.offset_q, self.varlen_q)

    def k_view_sd(self, mT: cute.Tensor, batch: Int32, head_kv: Int32) -> cute.Tensor:
        """(seqlen_k, d) view of an ``(s, d, h_k, b)`` K/V tensor for (batch, kv head)."""
        return _seq_view_sd(mT, batch, head_kv, self.offset_k, self.varlen_k)

    def lse_view(self, mLSE: cute.Tensor, batch: Int32, head: Int32) -> cute.Tensor:
        """(seqlen_q,) view of a ``(b, h, s_q)`` / varlen ``(1, h, total_q)`` row statistic (LSE)."""
        if const_expr(not self.varlen_q):
            return mLSE[batch, head, None]
        return cute.domain_offset((self.offset_q,), mLSE[0, head, None])


def grid_extent(mT: cute.Tensor, mCuSeqlens: Optional[cute.Tensor], max_seqlen: Int32):
    """(sequences, longest sequence) to size a grid over ``mT`` ``(b, s, ...)``: ``(b, s)``, or with
    ``mCuSeqlens`` (varlen, ``mT`` packed as ``(1, total, ...)``) its ``len - 1`` and ``max_seqlen``.
    Host side of a jit function (traced inline)."""
    if const_expr(mCuSeqlens is not None):
        return mCuSeqlens.shape[0] - 1, max_seqlen
    return mT.shape[0], mT.shape[1]


def to_sdhb(mT: cute.Tensor) -> cute.Tensor:
    """The kernel-boundary ``(b, s, h, d)`` tensor as ``(s, d, h, b)`` (same memory): the order
    TMA atoms tile in (rows and head dim first)."""
    return cute.make_tensor(mT.iterator, cute.select(mT.layout, mode=[1, 3, 2, 0]))


def _seq_view_sd(mT: cute.Tensor, batch: Int32, head: Int32, offset: Int32, varlen: bool) -> cute.Tensor:
    if const_expr(not varlen):
        return mT[None, None, head, batch]
    return cute.domain_offset((offset, 0), mT[None, None, head, 0])


def _seq_view(mT: cute.Tensor, batch: Int32, head: Int32, offset: Int32, varlen: bool) -> cute.Tensor:
    if const_expr(not varlen):
        return mT[batch, None, head, None]
    return cute.domain_offset((offset, 0), mT[0, None, head, None])
