"""Small device helpers shared by every kernel family.

* Reductions across the threads that share a row of an MMA accumulator (``quad_allreduce_*``:
  the 4 lanes of a quad on sm80 ``mma.sync``), across a warp (``warp_allreduce``), and inside one
  thread's registers (``fmax_reduce`` / ``fadd_reduce``, written as balanced trees for ILP).
* Fragment views of ``mma.sync`` m16n8k16 tensors: ``make_acc_mn_view`` turns an accumulator
  ``((2, 2), MMA_M, MMA_N)`` into a ``(rows, cols)`` view; ``make_acc_as_A`` reinterprets a
  (converted) accumulator of S as the A operand of the next ``P @ V`` MMA.
* Conversions: ``convert_f32_to_half`` packs pairs of fp32 with ``cvt.rn.{bf16x2,f16x2}.f32``.
* Predicates for copies: ``predicate_cols`` (head-dim bound, one flag per 16-byte column chunk).
* Bit helpers used by the exp2 emulation: ``add_round_down``.

Note [MMA accumulator layout]
    sm80 m16n8k16: thread ``lane`` of a warp owns, in every 16x8 C tile, rows ``lane // 4`` and
    ``lane // 4 + 8`` and columns ``2 * (lane % 4) + {0, 1}``. The CuTe fragment is
    ``((2, 2), MMA_M, MMA_N)``: mode ``(0, 0)`` walks the 2 columns, ``(0, 1)`` the 2 rows (+8),
    then the tiles.
    sm90 wgmma m64nNk16: warp ``w`` of the warpgroup owns rows ``16 w + lane // 4 (+8)``, and the
    thread holds columns ``8 j + 2 * (lane % 4) + {0, 1}`` for ``j < N / 8``: the fragment is
    ``((2, 2, N / 8), MMA_M, MMA_N)``, the same pattern with the 8-column groups as a third
    sub-mode. In both, the 4 lanes of a quad hold one row together: row reductions are a
    thread-local reduction followed by two butterfly shuffles (``quad_allreduce_*``).
"""

from __future__ import annotations

import copy
import operator
from typing import Callable, Type

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr
import cutlass._mlir.dialects.cute as _cute_ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# --------------------------------------------------------------------------------------------
# Reductions
# --------------------------------------------------------------------------------------------


def warp_allreduce(val, op: Callable, width: int = 32):
    """All-reduce ``val`` over groups of ``width`` consecutive lanes (butterfly shuffles)."""
    offset = width // 2
    while offset > 0:
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=offset))
        offset //= 2
    return val


def quad_allreduce_max(val: Float32) -> Float32:
    """Max over the 4 lanes of a quad (the lanes sharing an accumulator row)."""
    val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=2))
    return cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=1))


def quad_allreduce_sum(val: Float32) -> Float32:
    """Sum over the 4 lanes of a quad."""
    val = val + cute.arch.shuffle_sync_bfly(val, offset=2)
    return val + cute.arch.shuffle_sync_bfly(val, offset=1)


def _tree_reduce(t: cute.Tensor, op: Callable, lanes: int):
    # Plain Python (traced inline): ``lanes`` independent chains, then a balanced tree.
    n = cute.size(t)
    acc = [t[i] for i in range(min(lanes, n))]
    for i in range(lanes, n):
        acc[i % lanes] = op(acc[i % lanes], t[i])
    while len(acc) > 1:
        acc = [op(acc[2 * j], acc[2 * j + 1]) if 2 * j + 1 < len(acc) else acc[2 * j]
               for j in range((len(acc) + 1) // 2)]
    return acc[0]


def fmax_reduce(t: cute.Tensor, init: Float32 | None = None) -> Float32:
    """Max of the elements of the register tensor ``t`` (4 independent chains, then a tree)."""
    res = _tree_reduce(t, cute.arch.fmax, 4)
    if init is not None:
        res = cute.arch.fmax(res, init)
    return res


def fadd_reduce(t: cute.Tensor, init: Float32 | None = None) -> Float32:
    """Sum of the elements of the register tensor ``t`` (4 independent chains, then a tree)."""
    res = _tree_reduce(t, operator.add, 4)
    if init is not None:
        res = res + init
    return res


# --------------------------------------------------------------------------------------------
# Fragment views
# --------------------------------------------------------------------------------------------


def _acc_mn_layout(layout: cute.Layout, transpose: bool = False) -> cute.Layout:
    # sm80:  ((2 cols, 2 rows), MMA_M, MMA_N)        -> ((2 rows, MMA_M), (2 cols, MMA_N))
    # sm90:  ((2 cols, 2 rows, V), MMA_M, MMA_N)     -> ((2 rows, MMA_M), (2 cols, V, MMA_N))
    # (V: the 8-column groups of one wgmma atom; see Note [MMA accumulator layout]).
    lc = cute.make_layout(layout.shape)
    s0, d0 = lc.shape[0], lc.stride[0]
    rows = ((s0[1], lc.shape[1]), (d0[1], lc.stride[1]))
    if cute.rank(s0) == 3:
        cols = ((s0[0], s0[2], lc.shape[2]), (d0[0], d0[2], lc.stride[2]))
    else:
        cols = ((s0[0], lc.shape[2]), (d0[0], lc.stride[2]))
    first, second = (cols, rows) if transpose else (rows, cols)
    mn = cute.make_layout((first[0], second[0]), stride=(first[1], second[1]))
    return cute.composition(layout, mn)


def make_acc_mn_view(acc: cute.Tensor, transpose: bool = False) -> cute.Tensor:
    """``(rows, cols)`` view of an sm80 ``mma.sync`` or sm90 ``wgmma`` accumulator (or of its
    ``partition_C`` of an identity tensor). ``transpose=True`` gives ``(cols, rows)``, for kernels
    that compute S^T. Row ``r`` of the view is this thread's ``r``-th row; its columns are
    contiguous pairs, in increasing column order."""
    return cute.make_tensor(acc.iterator, _acc_mn_layout(acc.layout, transpose))


def _leaves(shape, stride):
    """``(extent, stride)`` of each leaf of a (nested) layout mode, in colexicographic order."""
    if isinstance(shape, tuple):
        for s, d in zip(shape, stride):
            yield from _leaves(s, d)
    else:
        yield shape, stride


def _add_offset(out: list, shape, stride, i) -> None:
    """Add to ``out`` the coordinate offset of index ``i`` (an int: colexicographic over the mode;
    or a tuple shaped like the mode) of one layout mode whose strides are basis elements or 0."""
    if isinstance(i, tuple):
        for s, d, j in zip(shape, stride, i):
            _add_offset(out, s, d, j)
        return
    for extent, d in _leaves(shape, stride):
        if isinstance(d, cute.ScaledBasis):
            out[d.mode[0]] += d.value * (i % extent)
        i //= extent


def static_coords(t: cute.Tensor) -> Callable:
    """``coord(index)`` for the coordinate tensor ``t``: the coordinate that element ``index`` (a
    flat int, or one index per top-level mode, each an int or a coordinate of that mode) holds, as
    ``t[index]`` gives it, but computed in Python when ``t``'s origin and layout are static (thread 0's
    partition of an identity tensor), so a lookup costs no IR; otherwise ``t[index]``.
    Note [Static coordinates]."""
    origin = t.iterator
    static = isinstance(origin, tuple) and all(type(x) is int for x in origin)
    if static:
        layout = t.layout
        shape, stride = layout.shape, layout.stride
        if not isinstance(shape, tuple):  # a rank-1 layout
            shape, stride = (shape,), (stride,)
        for extent, d in _leaves(shape, stride):
            basis = isinstance(d, cute.ScaledBasis) and len(d.mode) == 1 and type(d.value) is int
            static = static and type(extent) is int and (basis or (type(d) is int and d == 0))
    if not static:
        return lambda index: t[index]

    def coord(index):
        # A flat (colexicographic) int over the whole tensor, or one index per mode; else the lookup.
        if not (isinstance(index, int) or (isinstance(index, tuple) and len(index) == len(shape))):
            return t[index]
        out = list(origin)
        _add_offset(out, shape, stride, index)
        return tuple(out)
    return coord


# Note [Static coordinates]
# Indexing a coordinate tensor (``t0ScS[r, c]``) traces a chain of CuTe ops (make_coord, slice,
# get_iter, deref, get_leaves; ~12 a lookup) that canonicalization folds into the constant the
# lookup returned anyway. The masks looked up thread 0's coordinates once per accumulator element:
# 1,536 of the ~9,300 ops a d128 causal sm90 forward traced (v0.33). ``static_coords`` evaluates
# the same layout in Python instead; its results equal the lookups' (tests/test_static_coords.py,
# every element of the sm80 and sm90 accumulators, straight and transposed). Likewise
# ``_gemm_op`` drops ``cute.gemm``'s rank checks (12 traced shape queries a call). With both, the
# SASS of every sm_90a and sm_80 variant stayed the same (v0.33, hashed before and after).
# A flat index (an int) is evaluated in Python too (v0.37): the user functions' positions read
# thread 0's coordinates element by element (Note [Score positions] in fa4/mods_kernel.py).
#
# Dead ops are not SASS-neutral in general: one gemm call over the whole k mode (instead of one a
# k slice) and a zero fragment shared by the sm80 loads' row fills both changed some variants'
# SASS, so neither is used without a GPU to time them.


def make_acc_as_A(acc: cute.Tensor) -> cute.Tensor:
    """Reinterpret an accumulator fragment (already converted to 16-bit) as the A-operand fragment
    of the next MMA, to feed P to ``P @ V`` from registers.

    sm80 ``((2, 2), MMA_M, MMA_N)`` -> ``((2, 2, 2), MMA_M, MMA_N / 2)``: two adjacent 8-column
    accumulator tiles form one 16-deep k slice of m16n8k16.
    sm90 ``((2, 2, V), MMA_M, 1)`` -> ``((2, 2, 2), MMA_M, V / 2)``: the 8-column groups ``2k`` and
    ``2k + 1`` of a wgmma accumulator are the k slice ``k`` of a register-A wgmma (k16)."""
    if cute.rank(acc.layout.shape[0]) == 3:
        s0, d0 = acc.layout.shape[0], acc.layout.stride[0]
        assert cute.size(acc.layout.shape[2]) == 1 and s0[2] % 2 == 0
        layout = cute.make_layout(
            ((s0[0], s0[1], 2), acc.layout.shape[1], s0[2] // 2),
            stride=((d0[0], d0[1], d0[2]), acc.layout.stride[1], 2 * d0[2]),
        )
        return cute.make_tensor(acc.iterator, layout)
    div = cute.logical_divide(acc.layout, (None, None, 2))
    layout = cute.make_layout(
        ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
        stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
    )
    return cute.make_tensor(acc.iterator, layout)


# --------------------------------------------------------------------------------------------
# Conversions
# --------------------------------------------------------------------------------------------


@dsl_user_op
def cvt_f32x2_to_half2(a: Float32, b: Float32, dtype: Type[cutlass.Numeric], *, loc=None, ip=None) -> Int32:
    """Two fp32 -> one packed bf16x2/f16x2 register (``a`` in the low half), round to nearest."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{kind}.f32 $0, $2, $1;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert_f32_to_half(src: cute.Tensor, dst: cute.Tensor) -> None:
    """``dst[i] = dtype(src[i])`` for a register fragment, two elements per instruction.
    ``dst`` is bf16/fp16 with the same (even) size as the fp32 ``src``."""
    dst_i32 = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst_i32)):
        dst_i32[i] = cvt_f32x2_to_half2(src[2 * i], src[2 * i + 1], dst.element_type)


@cute.jit
def round_to_half_(t: cute.Tensor, dtype: Type[cutlass.Numeric]) -> None:
    """In place: ``t[i] = float32(dtype(t[i]))`` (round to nearest) for an fp32 register fragment.
    bf16: one ``cvt.rn.bf16x2.f32`` per pair, unpacked by a shift and a mask (bf16 is the high half
    of an fp32)."""
    if const_expr(dtype is cutlass.BFloat16):
        for i in cutlass.range_constexpr(cute.size(t) // 2):
            packed = cvt_f32x2_to_half2(t[2 * i], t[2 * i + 1], dtype)
            t[2 * i] = (packed << 16).bitcast(Float32)
            t[2 * i + 1] = (packed & Int32(-65536)).bitcast(Float32)
    else:
        t.store(t.load().to(dtype).to(Float32))


# --------------------------------------------------------------------------------------------
# Predicates
# --------------------------------------------------------------------------------------------


@cute.jit
def predicate_cols(tAcA: cute.Tensor, limit: Int32, col_mode: cutlass.Constexpr[int] = 1) -> cute.Tensor:
    """Column (head-dim) predicates for a thread's copy partition ``(CPY_ATOM, CPY_ROWS, CPY_COLS)``
    of an identity tensor: flag ``[v, 0, k]`` says whether that 16-byte chunk's column is
    ``< limit``. The rows mode has stride 0 (rows are bounded separately with an ``if``)."""
    tApA = cute.make_rmem_tensor(
        cute.make_layout(
            (cute.size(tAcA, mode=[0, 1]), cute.size(tAcA, mode=[1]), cute.size(tAcA, mode=[2])),
            stride=(cute.size(tAcA, mode=[2]), 0, 1),
        ),
        Boolean,
    )
    for v in cutlass.range_constexpr(tApA.shape[0]):
        for k in cutlass.range_constexpr(tApA.shape[2]):
            tApA[v, 0, k] = cute.elem_less(tAcA[(0, v), 0, k][col_mode], limit)
    return tApA


# --------------------------------------------------------------------------------------------
# Bits and rounding
# --------------------------------------------------------------------------------------------


@dsl_user_op
def add_round_down(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """``a + b`` rounded toward -inf (``add.rm.f32``): with ``b = 1.5 * 2**23`` the low bits of the
    result hold ``floor(a)`` (FMA pipe, unlike ``cvt.rmi``)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            "add.rm.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


# --------------------------------------------------------------------------------------------
# sm80 shared memory and MMA helpers
# --------------------------------------------------------------------------------------------


def smem_layout_atom_sm80(dtype: Type[cutlass.Numeric], k_dim: int) -> cute.ComposedLayout:
    """Swizzled (8, 64) or (8, 32) atom for a 16-bit tile of row width ``k_dim`` (a multiple of 32):
    rows of 128 (64) bytes, 16-byte chunks XOR-ed with the row index, so ``cp.async`` 16-byte
    stores and ``ldmatrix`` reads of 8 rows hit 8 distinct bank groups."""
    assert dtype.width == 16 and k_dim % 32 == 0
    atom_k = 64 if k_dim % 64 == 0 else 32
    bits = 3 if atom_k == 64 else 2
    return cute.make_composed_layout(
        cute.make_swizzle(bits, 3, 3), 0, cute.make_layout((8, atom_k), stride=(atom_k, 1))
    )


def tiled_mma_sm80(dtype: Type[cutlass.Numeric], num_threads: int, warps_m: int) -> cute.TiledMma:
    """An m16n8k16 (bf16/fp16 in, fp32 accumulate) tiled MMA over ``num_threads // 32`` warps,
    ``warps_m`` of them along M and the rest along N, each warp one 16x16 step per atom."""
    warps = num_threads // 32
    return cute.make_tiled_mma(
        cute.nvgpu.warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)),
        (warps_m, warps // warps_m, 1),
        permutation_mnk=(warps_m * 16, (warps // warps_m) * 16, 16),
    )


def tiled_copy_rows_16B(copy_atom: cute.CopyAtom, num_threads: int, atom) -> cute.TiledCopy:
    """A tiled copy of 16-bit tiles laid out with the swizzle ``atom`` (:func:`smem_layout_atom_sm80`):
    16 bytes per lane (``copy_atom`` must move 128 bits), the lanes of a thread row along one swizzle
    row (64 or 32 elements), so gmem accesses are whole 128 / 64-byte runs and smem ones conflict free.
    ``atom`` may also be the row width in elements (64 or 32) of an unswizzled tile."""
    elems = 128 // copy_atom.value_type.width
    rows = rows_per_pass_16B(copy_atom.value_type, num_threads, atom)
    thr_layout = cute.make_ordered_layout((rows, num_threads // rows), order=(1, 0))
    return cute.make_tiled_copy_tv(copy_atom, thr_layout, cute.make_layout((1, elems)))


def rows_per_pass_16B(dtype: Type[cutlass.Numeric], num_threads: int, atom) -> int:
    """Rows one pass of :func:`tiled_copy_rows_16B` covers: its threads over the lanes of a row."""
    return num_threads // ((atom if isinstance(atom, int) else atom.outer.shape[1]) * dtype.width // 128)


def stmatrix_atom(dtype: Type[cutlass.Numeric]) -> cute.CopyAtom:
    """Register -> smem copy of 16-bit accumulator fragments (sm90): ``stmatrix`` of four 8x8
    matrices, one 16-byte row address per lane where 32-bit stores need one per element pair
    (fewer address registers, which LLVM hoists out of a persistent kernel's tile loop: Note
    [O staged by stmatrix] in fa4/fwd/sm90.py). The sm90 backward's P / dS / dK / dV and dQ, and
    the forward's O with ``stmatrix_o``."""
    return cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)


@cute.jit
def acc_to_smem(acc: cute.Tensor, tiled_mma: cute.TiledMma, sT: cute.Tensor, tidx: Int32,
                pairs: cutlass.Constexpr[bool] = True) -> None:
    """Round an fp32 MMA accumulator to ``sT``'s dtype and store it to ``sT`` (pairs of columns per
    store; one element per store without ``pairs``, for a transposed ``sT`` view). The caller puts a
    barrier before the tile is read back."""
    bits = (2 if const_expr(pairs) else 1) * sT.element_type.width
    r2s = cute.make_tiled_copy_C(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sT.element_type, num_bits_per_copy=bits), tiled_mma,
    ).get_slice(tidx)
    rT = cute.make_rmem_tensor(acc.shape, sT.element_type)
    rT.store(acc.load().to(sT.element_type))
    cute.copy(r2s, r2s.retile(rT), r2s.partition_D(sT))


@cute.jit
def smem_to_gmem_pred(copy: cute.TiledCopy, sT: cute.Tensor, gT: cute.Tensor, rows: Int32, cols: Int32, tidx: Int32,
                      ragged: cutlass.Constexpr[bool] = False):
    """Copy a ``(tile_rows, tile_cols)`` smem tile to gmem with ``copy`` (16-byte chunks); only rows
    ``< rows`` and column chunks ``< cols`` are written. ``ragged``: the copy's rows per pass do not
    divide ``tile_rows`` (80-row tiles), so the last pass reaches past the tile: its smem reads and
    its gmem writes are limited to the tile too (unlimited, the reads left the tile, which
    compute-sanitizer caught, and the writes put rows never loaded over the next tile's first rows,
    which a review caught: RESULTS v0.7)."""
    thr = copy.get_slice(tidx)
    tile_rows = cute.size(sT, mode=[0])
    tcT = thr.partition_S(cute.make_identity_tensor((tile_rows, cute.size(sT, mode=[1]))))
    tsT = thr.partition_S(sT)
    tgT = thr.partition_D(gT)
    rT = cute.make_rmem_tensor_like(tgT)
    if const_expr(ragged):
        rows = cutlass.min(rows, tile_rows)
        for m in cutlass.range_constexpr(cute.size(tgT, mode=[1])):
            if tcT[0, m, 0][0] < rows:
                cute.autovec_copy(tsT[None, m, None], rT[None, m, None])
    else:
        cute.autovec_copy(tsT, rT)
    for m in cutlass.range_constexpr(cute.size(tgT, mode=[1])):
        if tcT[0, m, 0][0] < rows:
            for k in cutlass.range_constexpr(cute.size(tgT, mode=[2])):
                if tcT[0, m, k][1] < cols:
                    cute.copy(copy, rT[None, m, k], tgT[None, m, k])


def gemm_sm80(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsA: cute.Tensor,
    tCsB: cute.Tensor,
    smem_thr_copy_A,
    smem_thr_copy_B,
    A_in_regs: bool = False,
    B_in_regs: bool = False,
) -> None:
    """``acc += A @ B^T`` over the k mode: ``ldmatrix`` of k-slice ``k + 1`` is issued before the
    MMAs of slice ``k``. Operands already in registers (``*_in_regs``) are not reloaded."""
    tCrA_v = smem_thr_copy_A.retile(tCrA)
    tCrB_v = smem_thr_copy_B.retile(tCrB)
    num_k = cute.size(tCsA.shape[2]) if not A_in_regs else cute.size(tCrA.shape[2])
    if not A_in_regs:
        cute.copy(smem_thr_copy_A, tCsA[None, None, 0], tCrA_v[None, None, 0])
    if not B_in_regs:
        cute.copy(smem_thr_copy_B, tCsB[None, None, 0], tCrB_v[None, None, 0])
    for k in range(num_k):
        if k + 1 < num_k:
            if not A_in_regs:
                cute.copy(smem_thr_copy_A, tCsA[None, None, k + 1], tCrA_v[None, None, k + 1])
            if not B_in_regs:
                cute.copy(smem_thr_copy_B, tCsB[None, None, k + 1], tCrB_v[None, None, k + 1])
        _gemm_op(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k])


def gemm_sm80_rs(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsB: cute.Tensor,
    smem_thr_copy_B,
) -> None:
    """``acc += A @ B^T`` with A in registers (e.g. P from :func:`make_acc_as_A`), B from smem."""
    tCrB_v = smem_thr_copy_B.retile(tCrB)
    num_k = cute.size(tCrA.shape[2])
    cute.copy(smem_thr_copy_B, tCsB[None, None, 0], tCrB_v[None, None, 0])
    for k in range(num_k):
        if k + 1 < num_k:
            cute.copy(smem_thr_copy_B, tCsB[None, None, k + 1], tCrB_v[None, None, k + 1])
        _gemm_op(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k])


# --------------------------------------------------------------------------------------------
# sm90 (wgmma) helpers
# --------------------------------------------------------------------------------------------


def gemm_sm90(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
              zero_init: bool = False) -> None:
    """Issue ``acc (+)= A @ B^T`` as one wgmma group over the k mode and commit it (asynchronous:
    the caller waits with ``warpgroup.wait_group``). ``tCrA``: smem descriptors or registers
    ``(MMA, MMA_M, MMA_K)``; ``tCrB``: smem descriptors ``(MMA, MMA_N, MMA_K)``. ``zero_init``
    (compile-time): the first k slice overwrites ``acc``."""
    warpgroup = cute.nvgpu.warpgroup
    # ``set`` rebinds the MMA's IR value: on a copy, so the caller's object (also used for
    # partitioning after this, possibly outside the branch issuing the GEMM) is untouched.
    tiled_mma = copy.copy(tiled_mma)
    tiled_mma._trait = copy.copy(tiled_mma._trait)
    warpgroup.fence()
    for k in range(cute.size(tCrA.shape[2])):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, not (zero_init and k == 0))
        _gemm_op(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k])
    warpgroup.commit_group()


@dsl_user_op
def _gemm_op(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, *, loc=None,
             ip=None) -> None:
    """``cute.gemm(tiled_mma, acc, a, b, acc)`` without its Python-side rank checks, whose shape
    queries trace 12 ops a call that canonicalization removes (Note [Static coordinates]): the same
    gemm op. The callers' operands are rank-2 slices of ``tiled_mma``'s partitions, which those
    checks accept."""
    _cute_ir.gemm(tiled_mma._unpack(loc=loc, ip=ip), acc.value, [a.value], [b.value], acc.value, loc=loc, ip=ip)


def transposed(sT: cute.Tensor) -> cute.Tensor:
    """The same smem as ``sT`` with its first two modes swapped (a row-major tile seen as the
    MN-major operand of the transposed product: V in ``P V``, Q / dO / K / dS in the backward)."""
    return cute.make_tensor(sT.iterator, cute.select(sT.layout, mode=[1, 0, 2] if cute.rank(sT) == 3 else [1, 0]))


def smem_layout_sm90(dtype: Type[cutlass.Numeric], rows: int, cols: int, stages: int | None = None,
                     atom_cols: int | None = None, order: tuple | None = None):
    """Row-major (``cols`` contiguous) swizzled smem layout of a ``(rows, cols[, stages])`` 16-bit
    tile for TMA and wgmma: the widest swizzle (128 / 64 / 32 bytes) whose atom divides ``cols``
    (or ``atom_cols``: when a transposed view of the tile is an MN-major wgmma operand split into
    parts of ``atom_cols`` columns, every part must hold whole swizzle atoms). ``order``: of the
    modes when tiling the atoms (default rows, then columns, then stages)."""
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.utils import LayoutEnum

    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols), dtype)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, order or ((0, 1) if stages is None else (0, 1, 2)))


@cute.jit
def zero_rows_from(sT: cute.Tensor, row_start: Int32, tidx: Int32, num_threads: cutlass.Constexpr[int]) -> None:
    """Zero rows ``>= row_start`` of a 16-bit ``(rows, cols)`` smem tile (any swizzle: 16-byte chunks
    stay contiguous), one 16-byte chunk per store, by ``num_threads`` threads (``tidx`` in
    ``[0, num_threads)``). For tiles that TMA filled with rows past a sequence's used length (a KV
    cache slot may hold NaN, and ``0 * NaN`` poisons a product even where the scores are masked).
    The caller fences (``fence_proxy async.shared``) and synchronizes before wgmma reads the tile."""
    rows, cols = cute.size(sT, mode=[0]), cute.size(sT, mode=[1])
    per_row = cols // 8
    zero = cute.make_rmem_tensor(cute.make_layout((1, 8)), sT.element_type)
    zero.fill(0.0)
    first = cutlass.max(row_start, 0) * per_row
    for j in cutlass.range(first + tidx, rows * per_row, num_threads, unroll=1):
        r = j // per_row
        chunk = cute.local_tile(sT, (1, 8), (r, j - r * per_row))
        cute.autovec_copy(zero, chunk)


@cute.jit
def store_rows_16B(sT: cute.Tensor, gT: cute.Tensor, rows_left: Int32, cols: Int32, tidx: Int32,
                   num_threads: cutlass.Constexpr[int]) -> None:
    """A 16-bit ``(rows, tile_cols)`` smem tile -> gmem with 16-byte stores by ``num_threads``
    threads: rows ``< rows_left`` and 16-byte column chunks ``< cols`` only (varlen: the rows past a
    sequence belong to the next one; padded head dims are not stored). The caller synchronizes
    the writers of ``sT`` before."""
    tile_cols = cute.size(sT, mode=[1])
    per_row = 8 if (tile_cols // 8) % 8 == 0 else 4
    copy = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sT.element_type, num_bits_per_copy=128),
        cute.make_ordered_layout((num_threads // per_row, per_row), order=(1, 0)),
        cute.make_layout((1, 8)))
    thr = copy.get_slice(tidx)
    tTcT = thr.partition_S(cute.make_identity_tensor((cute.size(sT, mode=[0]), tile_cols)))
    tTsT = thr.partition_S(sT)
    tTrT = cute.make_fragment_like(tTsT, sT.element_type)
    cute.autovec_copy(tTsT, tTrT)
    tTgT = thr.partition_D(gT)
    tTpT = predicate_cols(tTcT, cols)
    for m in cutlass.range_constexpr(cute.size(tTrT.shape[1])):
        if tTcT[0, m, 0][0] < rows_left:
            cute.copy(copy, tTrT[None, m, None], tTgT[None, m, None], pred=tTpT[None, m, None])


# --------------------------------------------------------------------------------------------
# sm90 bulk copies smem -> gmem (no tensor map): one thread issues them
# --------------------------------------------------------------------------------------------


def _bulk_to_global(instr: str, dst_gmem: cute.Pointer, src_smem: cute.Pointer, num_bytes: int, loc, ip) -> None:
    llvm.inline_asm(
        None,
        [dst_gmem.toint(loc=loc, ip=ip).ir_value(), Int32(src_smem.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        f"{instr} [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_reduce_add_f32(dst_gmem: cute.Pointer, src_smem: cute.Pointer, num_bytes: int, *, loc=None,
                        ip=None) -> None:
    """``cp.reduce.async.bulk .add.f32`` of ``num_bytes`` (a multiple of 16, 16-byte aligned) from
    shared memory into global memory, in the issuing thread's bulk async-group (commit it with
    ``cute.arch.cp_async_bulk_commit_group``, wait with ``cp_async_bulk_wait_group``)."""
    _bulk_to_global("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", dst_gmem, src_smem, num_bytes,
                    loc, ip)


@dsl_user_op
def bulk_store(dst_gmem: cute.Pointer, src_smem: cute.Pointer, num_bytes: int, *, loc=None, ip=None) -> None:
    """``cp.async.bulk`` of ``num_bytes`` (a multiple of 16, 16-byte aligned) from shared memory to
    global memory, a plain store; bulk async-group as :func:`bulk_reduce_add_f32`."""
    _bulk_to_global("cp.async.bulk.global.shared::cta.bulk_group", dst_gmem, src_smem, num_bytes, loc, ip)


@dsl_user_op
def bulk_copy_to_peer(dst_smem: cute.Pointer, src_smem: cute.Pointer, mbar: cute.Pointer, peer, num_bytes: int, *,
                      loc=None, ip=None) -> None:
    """``cp.async.bulk.shared::cluster.shared::cta`` of ``num_bytes`` (a multiple of 16, 16-byte
    aligned) from this CTA's ``src_smem`` into CTA ``peer`` of the cluster, at the address that
    ``dst_smem`` has in this CTA; completes (``complete_tx``) on the peer's mbarrier at the address
    ``mbar`` has here. The peer expects the bytes (``arrive_and_expect_tx``) and waits on it."""
    llvm.inline_asm(
        None,
        [Int32(dst_smem.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
         Int32(src_smem.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
         Int32(mbar.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
         Int32(peer).ir_value(loc=loc, ip=ip), Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 d, m;\nmapa.shared::cluster.u32 d, $0, $3;\nmapa.shared::cluster.u32 m, $2, $3;\n"
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [d], [$1], $4, [m];\n}",
        "r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
