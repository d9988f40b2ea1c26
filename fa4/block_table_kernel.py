"""Device code of the block table builder (:mod:`fa4.block_sparse` holds the config and the host side).

Imported lazily (through ``fa4.block_sparse.BlockTableBuilder``): it imports the CuTe DSL, ``import
fa4`` must not.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int8, Int32, const_expr

from fa4.block_sparse import BlockTableConfig, check_table_config


class BlockTableBuilder:
    """SIMT kernel: a block-sparse call's lists -> its int8 block table (Note [Block sparsity as a
    block table] in fa4/block_sparse.py), in one launch.

    One CTA per table row ``(batch, head, q block)`` (a flat grid of ``B * H * Mb``), ``num_threads`` threads
    striding over the row. Three phases, a CTA barrier between each: the row's ``Nb`` entries set to
    0 (hidden); each of the first ``mask_block_cnt`` entries of ``mask_block_idx`` inside ``[0, Nb)``
    set to 1; then the same for the full lists with 2, so a block in both lists ends whole, as the
    torch scatters that this replaces left it. No shared memory, no other synchronization: two
    threads of one phase that meet at a block write the same value.
    """

    def __init__(self, cfg: BlockTableConfig):
        self.cfg = cfg
        self.num_threads = cfg.num_threads

    @staticmethod
    def can_implement(cfg: BlockTableConfig) -> None:
        check_table_config(cfg)

    @staticmethod
    def fake_args(cfg: BlockTableConfig) -> tuple:
        b, h, mb, nb = (cute.sym_int() for _ in range(4))

        def lists(entries):
            """A (count, index) pair: any strides (broadcast batch / heads have stride 0)."""
            cnt = cute.runtime.make_fake_tensor(Int32, (b, h, mb), tuple(cute.sym_int64() for _ in range(3)),
                                                assumed_align=4)
            idx = cute.runtime.make_fake_tensor(Int32, (b, h, mb, entries), tuple(cute.sym_int64() for _ in range(4)),
                                                assumed_align=4)
            return cnt, idx

        mask_cnt, mask_idx = lists(cute.sym_int())
        full_cnt, full_idx = lists(cute.sym_int()) if cfg.has_full else (None, None)
        table = cute.runtime.make_fake_compact_tensor(Int8, (b, h, mb, nb), stride_order=(3, 2, 1, 0), assumed_align=1)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return (mask_cnt, mask_idx, full_cnt, full_idx, table, stream)

    @cute.jit
    def __call__(
        self,
        mMaskCnt: cute.Tensor,  # (B, H, Mb) int32
        mMaskIdx: cute.Tensor,  # (B, H, Mb, N) int32
        mFullCnt: Optional[cute.Tensor],  # (B, H, Mb) int32 (cfg.has_full)
        mFullIdx: Optional[cute.Tensor],  # (B, H, Mb, N') int32 (cfg.has_full)
        mTable: cute.Tensor,  # (B, H, Mb, Nb) int8, written whole
        stream,
    ):
        rows = mTable.shape[0] * mTable.shape[1] * mTable.shape[2]  # one CTA a row, on grid x (no 65535 cap)
        self.kernel(mMaskCnt, mMaskIdx, mFullCnt, mFullIdx, mTable).launch(
            grid=(rows, 1, 1), block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mMaskCnt: cute.Tensor, mMaskIdx: cute.Tensor, mFullCnt: Optional[cute.Tensor],
               mFullIdx: Optional[cute.Tensor], mTable: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        mb, heads = mTable.shape[2], mTable.shape[1]
        m = bid % mb
        h = (bid // mb) % heads
        b = bid // (mb * heads)
        row = mTable[b, h, m, None]
        nb = mTable.shape[3]
        for j in cutlass.range(tidx, nb, self.num_threads):
            row[j] = Int8(0)
        cute.arch.barrier()
        self.mark(mMaskCnt, mMaskIdx, row, b, h, m, nb, tidx, Int8(1))
        if const_expr(mFullCnt is not None):
            cute.arch.barrier()
            self.mark(mFullCnt, mFullIdx, row, b, h, m, nb, tidx, Int8(2))

    @cute.jit
    def mark(self, mCnt: cute.Tensor, mIdx: cute.Tensor, row: cute.Tensor, b: Int32, h: Int32, m: Int32, nb,
             tidx: Int32, value: Int8):
        """``row[n] = value`` for the first ``cnt`` indices ``n`` of the list that lie in ``[0, Nb)``."""
        count = cutlass.min(mCnt[b, h, m], mIdx.shape[3])
        for j in cutlass.range(tidx, count, self.num_threads):
            n = mIdx[b, h, m, j]
            if n >= 0 and n < nb:
                row[n] = value
