"""flash_attn.cute's ``block_sparse_tensors``, as a block table read by a mask function.

A block-sparse call names, for each ``(batch, head, q block)``, the K blocks it attends to, in two
lists (flash_attn.cute's ``BlockSparseTensorsTorch`` fields):

* ``mask_block_cnt`` ``(B, H, Mb)`` / ``mask_block_idx`` ``(B, H, Mb, N)``: blocks whose scores go
  through the ``mask_mod`` (without one: taken whole);
* ``full_block_cnt`` / ``full_block_idx`` (optional, the same shapes): blocks taken whole, without
  the ``mask_mod``;
* every other block is hidden.

The first ``cnt`` entries of each index row count; B and H may be 1 (broadcast). ``block_size`` is
``(q block, kv block)`` in tokens, so ``Mb = ceil(seqlen_q / q block)`` and every index is below
``ceil(seqlen_k / kv block)``; fa4 defaults it to ``(128, 128)`` where the shapes fit that
(flash_attn.cute's default is its own kernel's tile, which fa4's kernels do not share).

Note [Block sparsity as a block table]
    The call's lists become one int8 table ``(B, H, Mb, Nb)``
    (0 hidden, 1 through the mask_mod, 2 whole), built on the device (one launch, Note [One launch
    for the table]; no host sync; an index outside ``[0, Nb)`` or past its row's count is
    dropped), and passed as one more aux
    tensor. The mask function of the call (:func:`table_mask`) reads the table at ``(b, h, q_idx //
    q block, kv_idx // kv block)`` and calls the user's ``mask_mod`` only on the blocks marked 1
    (its result is discarded on the others). The results are those of a kernel that skips the
    hidden blocks, in the forward and the backward of both families (the mask function is an
    ordinary ``mask_mod``: Note [User functions in the compile key]). The sm90 forward also skips
    the hidden blocks (``AttnProblem.block_table`` names the table; ``FwdSm90Config.block_skip``,
    :class:`fa4.mods_kernel.BlockSkip`): its producer and consumers narrow each tile's K range to
    its visible blocks and step over the hidden ones, where a kernel block touches at most 16
    table entries and the tile's rows are one q head (no pack GQA). The sm90 backward narrows each
    K block's Q blocks to the visible range (``BwdSm90Config.block_skip``, Note [Block skip in the
    backward] in fa4/bwd/sm90.py; a deterministic run through its dQ pass), and so does the sm80
    backward when not deterministic. The sm80 forward (its narrowing spills: ``fwd.sm80.BLOCK_SKIP``)
    and the deterministic sm80 backward compute every block, at dense speed, with a one-time warning
    per direction. The backward reads the forward's table, so ``block_sparse_tensors_bwd`` (the same
    pattern indexed by K block) is checked for its shapes and not read. Eager calls only: under ``torch.compile`` the call raises
    NotImplementedError (dynamo cannot trace the making of the mask function, nor guard on one made
    outside the graph); there, build the table with :func:`table` and read it in your own mask_mod.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Callable, ClassVar, Optional

from fa4.config import ARCHS, KernelConfig

DEFAULT_BLOCK = (128, 128)
# CUDA lists become the table in one launch of fa4.block_table_kernel (False: the torch scatters of
# _table_torch, about 20 launches; CPU tensors always take those). Note [One launch for the table].
TABLE_KERNEL = True
# Fields of flash_attn.cute's BlockSparseTensorsTorch fa4 does not take yet (varlen block sparsity,
# its backward's write orders and options): NotImplementedError when set.
UNSUPPORTED_FIELDS = ("cu_total_m_blocks", "cu_block_idx_offsets", "dq_write_order", "dq_write_order_full", "spt")
_warned: list = []


def _field(bst, name: str):
    return getattr(bst, name, None)


def _check_pair(bst, what: str, cnt_name: str, idx_name: str, lead: tuple, rows: int, device,
                required: bool) -> bool:
    """Check one (count, index) pair of ``bst``; whether it is present."""
    import torch

    cnt, idx = _field(bst, cnt_name), _field(bst, idx_name)
    if cnt is None and idx is None and not required:
        return False
    for name, t, ndim in ((cnt_name, cnt, 3), (idx_name, idx, 4)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}.{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{what}.{name} must be int32, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{what}.{name} must have {ndim} dimensions (batch, heads, {'q blocks' if ndim == 3 else 'q blocks, entries'}), got shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{what}.{name} is on {t.device}; expected q's device {device}")
        for axis, (got, want) in enumerate(zip(t.shape[:2], lead)):
            if got not in (1, want):
                raise ValueError(f"{what}.{name} has {got} {('batches', 'heads')[axis]}; expected {want} or 1 "
                                 f"(shape {tuple(t.shape)})")
        if t.shape[2] != rows:
            raise ValueError(f"{what}.{name} has {t.shape[2]} rows of blocks; expected {rows} "
                             f"(ceil of the sequence length over the block size)")
    if idx.shape[3] == 0:
        raise ValueError(f"{what}.{idx_name} has no entries per row")
    return True


def block_size(bst, seqlen_q: int, seqlen_k: int, head_dim: int = 128) -> tuple[int, int]:
    """``bst.block_size`` as a pair of positive ints, or :data:`DEFAULT_BLOCK` where it is None, the
    head dim is 128 and the counts' shape fits it. (flash_attn.cute reads a None as its own
    kernel's tile, 128 x 128 on Hopper at head dim 128 only; elsewhere the lists' meaning depends on
    its tile table, so fa4 asks for the size.)"""
    size = _field(bst, "block_size")
    if size is None:
        import torch

        cnt = _field(bst, "mask_block_cnt")
        if not isinstance(cnt, torch.Tensor):
            raise TypeError(f"block_sparse_tensors.mask_block_cnt must be a torch.Tensor, got {type(cnt).__name__}")
        rows = cnt.shape[-1]
        if head_dim != 128 or rows != math.ceil(seqlen_q / DEFAULT_BLOCK[0]):
            raise ValueError(f"block_sparse_tensors.block_size is None: fa4 takes it as {DEFAULT_BLOCK} only at head "
                             f"dim 128 with ceil(seqlen_q / 128) q blocks (head dim {head_dim}, {rows} q blocks); "
                             f"pass block_size=(q block, kv block) in tokens")
        return DEFAULT_BLOCK
    if (not isinstance(size, (tuple, list)) or len(size) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in size)):
        raise ValueError(f"block_sparse_tensors.block_size must be a pair of positive ints, got {size!r}")
    return int(size[0]), int(size[1])


def check(bst, bst_bwd, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device,
          head_dim: int = 128) -> tuple[int, int]:
    """Validate a call's block-sparse tensors (before any launch); returns the block size."""
    if bst is None:
        if bst_bwd is not None:
            raise ValueError("block_sparse_tensors_bwd without block_sparse_tensors: the forward's pattern is "
                             "the one fa4 reads (Note [Block sparsity as a block table] in fa4/block_sparse.py)")
        return (0, 0)
    for what, value in (("block_sparse_tensors", bst), ("block_sparse_tensors_bwd", bst_bwd)):
        if value is None:
            continue
        if not hasattr(value, "mask_block_cnt"):
            raise TypeError(f"{what} must be a BlockSparseTensorsTorch-like named tuple (mask_block_cnt, "
                            f"mask_block_idx, full_block_cnt, full_block_idx, ..., block_size), got "
                            f"{type(value).__name__}")
        for name in UNSUPPORTED_FIELDS:
            if _field(value, name) is not None and _field(value, name) is not False:  # (spt=False: the default)
                raise NotImplementedError(f"fa4 does not support {what}.{name} yet (varlen block sparsity and "
                                          f"flash_attn.cute's backward write orders)")
    bq, bk = block_size(bst, seqlen_q, seqlen_k, head_dim)
    mb, nb = math.ceil(seqlen_q / bq), math.ceil(seqlen_k / bk)
    lead = (batch, heads)
    _check_pair(bst, "block_sparse_tensors", "mask_block_cnt", "mask_block_idx", lead, mb, device, True)
    _check_pair(bst, "block_sparse_tensors", "full_block_cnt", "full_block_idx", lead, mb, device, False)
    if bst_bwd is not None:  # indexed by K block (rows: the K blocks; entries: q blocks)
        if tuple(block_size(bst_bwd, seqlen_q, seqlen_k, head_dim) if _field(bst_bwd, "block_size") is not None
                 else (bq, bk)) != (bq, bk):
            raise ValueError("block_sparse_tensors_bwd.block_size differs from block_sparse_tensors.block_size")
        _check_pair(bst_bwd, "block_sparse_tensors_bwd", "mask_block_cnt", "mask_block_idx", lead, nb, device, True)
        _check_pair(bst_bwd, "block_sparse_tensors_bwd", "full_block_cnt", "full_block_idx", lead, nb, device,
                    False)
    return bq, bk


def warn_dense(direction: str, kernel: str) -> None:
    """One warning per direction that a block-sparse call computes every block there (the same results
    through the table's mask function, at dense speed): the sm80 family, and the sm90 kernels where
    they cannot skip (pack GQA, sparse blocks much smaller than the tile, a deterministic backward
    told not to take its dQ pass)."""
    if direction not in _warned:
        _warned.append(direction)
        warnings.warn(f"fa4: block_sparse_tensors in the {direction} ({kernel}): every block is computed, the "
                      f"block table acting as a mask (the same results, at dense speed); the sm90 kernels skip "
                      f"hidden blocks where they can (Note [Block sparsity as a block table] in "
                      f"fa4/block_sparse.py)",
                      stacklevel=4)


@dataclasses.dataclass(frozen=True)
class BlockTableConfig(KernelConfig):
    """Compile key of :class:`fa4.block_table_kernel.BlockTableBuilder`. ``dtype``: the lists'
    ("int32"); ``has_full``: the call has full lists; ``num_threads``: threads per CTA (one CTA per
    table row)."""

    has_full: bool = False
    num_threads: int = 128

    KERNEL: ClassVar[str] = "fa4.block_sparse:BlockTableBuilder"


def check_table_config(cfg: BlockTableConfig) -> None:
    cfg.check_target(("int32",))
    if cfg.num_threads % 32 or not 32 <= cfg.num_threads <= 1024:
        raise ValueError(f"BlockTableConfig.num_threads must be a multiple of 32 in [32, 1024], got {cfg.num_threads}")


def variants(arch: str) -> list[BlockTableConfig]:
    """Both kernels (with and without full lists); SIMT code, so every arch."""
    if arch not in ARCHS:
        return []
    return [BlockTableConfig(arch=arch, dtype="int32", has_full=f) for f in (False, True)]


def __getattr__(name: str):
    if name == "BlockTableBuilder":  # BlockTableConfig.KERNEL: the DSL is imported on first use only
        from fa4.block_table_kernel import BlockTableBuilder

        return BlockTableBuilder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Note [One launch for the table]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every block-sparse call turns its lists into the table anew (the lists may have changed in
# place, and a CUDA graph replays the conversion with the call). Built by torch ops, that is about
# 20 small launches. On the H100 host the bench read 0.64-0.97 ms for fa4 (v0.35) on a case that
# flash-attn-4 runs in 0.46 ms, a spread that suggested a host-bound call. Measured (RESULTS v0.36,
# tools/host_vs_gpu.py, H100): it is not; the eager call and its CUDA-graph replay take the same
# time (torch build 0.631 / 0.614 ms). The 20 launches cost GPU time, though: with the one launch
# below 0.562 / 0.573 ms. fa4.block_table_kernel builds the table in one launch: a CTA per
# table row zeroes it, then marks the mask lists' blocks 1 and the full lists' 2 (a barrier between,
# so a block in both ends whole, as the scatters left it). tests/test_block_sparse_gpu.py compares
# it with the torch build (:func:`_table_torch`), which CPU tensors and ``TABLE_KERNEL = False`` take.


def table(bst, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block: tuple[int, int]):
    """The call's block table, int8 ``(batch, heads, Mb, Nb)`` (broadcast batch / heads have stride 0):
    0 hidden, 1 through the mask_mod, 2 whole (Note [Block sparsity as a block table]). Device ops
    only, no host sync: one kernel for int32 CUDA lists outside a torch.compile trace (Note [One
    launch for the table]), else torch ops (which dynamo traces, and which take any integer lists)."""
    import torch

    lists = [t for t in (_field(bst, n) for n in ("mask_block_cnt", "mask_block_idx", "full_block_cnt",
                                                    "full_block_idx")) if t is not None]
    if (TABLE_KERNEL and bst.mask_block_cnt.is_cuda and all(t.dtype == torch.int32 for t in lists)
            and not torch.compiler.is_compiling()):
        return _table_kernel(bst, batch, heads, seqlen_k, block)
    return _table_torch(bst, batch, heads, seqlen_q, seqlen_k, block)


def _table_kernel(bst, batch: int, heads: int, seqlen_k: int, block: tuple[int, int]):
    import torch

    from fa4 import arch as _arch
    from fa4.jit import get_kernel

    nb = math.ceil(seqlen_k / block[1])
    b0, h0, mb = _lead(bst, 0), _lead(bst, 1), bst.mask_block_cnt.shape[2]
    dev = bst.mask_block_cnt.device
    out = torch.empty(b0, h0, mb, nb, dtype=torch.int8, device=dev)
    if out.numel() == 0:  # (no rows: no launch; a grid may not be empty)
        return out.expand(batch, heads, mb, nb)
    lists = []
    for cnt_name, idx_name in (("mask_block_cnt", "mask_block_idx"), ("full_block_cnt", "full_block_idx")):
        c, i = _field(bst, cnt_name), _field(bst, idx_name)
        lists += [c.expand(b0, h0, mb), i.expand(b0, h0, mb, i.shape[3])] if c is not None else [None, None]
    cfg = BlockTableConfig(arch=_arch.target_arch(_arch.capability_of(dev)), dtype="int32",
                           has_full=lists[2] is not None)
    with _arch.device_guard(dev):  # Note [Device guard] in fa4/arch.py
        get_kernel(cfg)(*lists, out)
    return out.expand(batch, heads, mb, nb)


def _table_torch(bst, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block: tuple[int, int]):
    """:func:`table` by torch ops (any device)."""
    import torch

    nb = math.ceil(seqlen_k / block[1])
    b0, h0, mb = _lead(bst, 0), _lead(bst, 1), bst.mask_block_cnt.shape[2]
    out = torch.zeros(b0, h0, mb, nb + 1, dtype=torch.int8, device=bst.mask_block_cnt.device)  # column nb: dropped
    for cnt_name, idx_name, mark in (("mask_block_cnt", "mask_block_idx", 1), ("full_block_cnt", "full_block_idx", 2)):
        c, i = _field(bst, cnt_name), _field(bst, idx_name)
        if c is None:
            continue
        c, i = c.expand(b0, h0, mb), i.expand(b0, h0, mb, i.shape[3])
        pos = torch.arange(i.shape[3], device=i.device, dtype=torch.int32)
        keep = (pos < c[..., None]) & (i >= 0) & (i < nb)
        cols = torch.where(keep, i, torch.full_like(i, nb)).long()
        out.scatter_(3, cols, torch.full(cols.shape, mark, dtype=torch.int8, device=cols.device))
    return out[..., :nb].expand(batch, heads, mb, nb)


def _lead(bst, axis: int) -> int:
    """The largest extent of dimension ``axis`` over the present fields (batch / heads broadcast)."""
    sizes = [t.shape[axis] for t in (_field(bst, n) for n in ("mask_block_cnt", "mask_block_idx", "full_block_cnt",
                                                                "full_block_idx")) if t is not None]
    return max(sizes)


@functools.lru_cache(maxsize=256)
def table_mask(user_mask: Optional[Callable], block_q: int, block_k: int, slot: int, scalars: bool) -> Callable:
    """The mask function of a block-sparse call: ``aux_tensors[slot]`` is the block table; the user's
    ``mask_mod`` (None: none) decides inside the blocks marked 1; ``scalars``: the call has
    ``aux_scalars`` (the function takes them, and passes them on). One function object per
    arguments (cached: the same kernel key without rehashing a new closure's captures)."""
    import cutlass
    import cutlass.cute as cute

    def state_of(b, h, q_idx, kv_idx, aux_tensors):
        return aux_tensors[slot][b[0], h[0], q_idx[0] // block_q, kv_idx[0] // block_k]

    def own(aux_tensors):
        """The user's aux tensors (the table is appended after them), None without any, as
        flash_attn.cute passes a mask_mod's."""
        return aux_tensors[:slot] if slot else None

    def decide(state, inner):
        if cutlass.const_expr(inner is None):
            return state != cutlass.Int8(0)
        if cutlass.const_expr(isinstance(inner, cute.TensorSSA)):
            inner = inner[0]
        return (state == cutlass.Int8(2)) | ((state == cutlass.Int8(1)) & inner)

    def marked(fn):
        fn._fa4_inner = user_mask  # the kernels that skip blocks call it alone on blocks marked 1 (BlockSkip)
        return fn

    if scalars:
        @marked
        @cute.jit
        def block_table_mask_s(b, h, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
            inner = None
            if cutlass.const_expr(user_mask is not None):
                inner = user_mask(b, h, q_idx, kv_idx, seqlen_info, own(aux_tensors), aux_scalars)
            return decide(state_of(b, h, q_idx, kv_idx, aux_tensors), inner)
        return block_table_mask_s

    @marked
    @cute.jit
    def block_table_mask(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        inner = None
        if cutlass.const_expr(user_mask is not None):
            inner = user_mask(b, h, q_idx, kv_idx, seqlen_info, own(aux_tensors))
        return decide(state_of(b, h, q_idx, kv_idx, aux_tensors), inner)
    return block_table_mask


def explain_note() -> str:
    return ("block_sparse_tensors: a block table read by the mask function (the same results); the sm90 forward "
            "skips the hidden blocks (not with pack GQA), the sm90 backward narrows each K block's Q blocks to the "
            "visible range (a deterministic run through its dQ pass), the sm80 backward too when not "
            "deterministic; the sm80 forward computes every block "
            "(fa4/block_sparse.py)")
