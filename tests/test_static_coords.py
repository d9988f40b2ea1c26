"""``cute_utils.static_coords`` (Note [Static coordinates]) gives, in Python, the coordinate that a
lookup of a coordinate tensor gives: for every element of thread 0's accumulator partition of the
sm80 and sm90 MMAs the masks use, straight and transposed. CPU only: the comparison runs while a
small host function is traced (``cute.compile``), with no GPU and no kernel.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import pytest
from cutlass import Float32, Int32

from fa4 import jit
from fa4.cute_utils import make_acc_mn_view, static_coords, tiled_mma_sm80


def _sm90_mma(tile_n):
    K = cute.nvgpu.OperandMajorMode.K
    return sm90_utils.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, K, K, Float32, (2, 1, 1),
                                             (64, tile_n))


def _check(tiled_mma, shape, transpose, seen):
    """Compare every element of thread 0's ``(rows, cols)`` view (and the flat fragment) against
    the lookup, and check that a runtime thread's partition falls back to the lookup."""
    cS = cute.make_identity_tensor(shape)
    flat = tiled_mma.get_slice(0).partition_C(cS)
    view = make_acc_mn_view(flat, transpose)
    coord = static_coords(view)
    rows, cols = cute.size(view.shape[0]), cute.size(view.shape[1])
    for r in range(rows):
        for c in range(cols):
            got, want = coord((r, c)), view[r, c]
            assert isinstance(got, tuple) and all(type(x) is int for x in got), got
            assert got == tuple(want), (shape, transpose, r, c, got, want)
    # A flat index: the same coordinate as the lookup, in Python ints (Note [Score positions]).
    assert coord(7) == tuple(view[7]) and all(type(x) is int for x in coord(7))
    flat_coord = static_coords(flat)
    for i in range(cute.size(flat)):
        idx = cute.idx2crd(i, flat.shape)
        assert flat_coord(idx) == tuple(flat[idx]), (shape, i)
    seen.append((shape, transpose, rows * cols))


@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_static_coords_match_lookups(family):
    seen = []

    @cute.jit
    def trace(tidx: Int32):
        if cutlass.const_expr(family == "sm90"):
            cases = [(_sm90_mma(n), (128, n)) for n in (64, 96, 128, 176, 192)]
        else:
            cases = [(tiled_mma_sm80(cutlass.BFloat16, 128, 4), (64, n)) for n in (64, 128)]
            cases += [(tiled_mma_sm80(cutlass.BFloat16, 256, 8), (128, 64))]
        for tiled_mma, shape in cases:
            _check(tiled_mma, shape, False, seen)
            _check(tiled_mma, shape, True, seen)
        # A runtime thread's partition has a runtime origin: the lookup itself, not Python ints.
        mine = make_acc_mn_view(cases[0][0].get_slice(tidx).partition_C(cute.make_identity_tensor(cases[0][1])))
        got = static_coords(mine)((0, 1))
        assert not all(type(x) is int for x in got)

    with jit._target_arch("sm_90a"):  # (the DSL checks wgmma against its notion of the arch)
        cute.compile(trace, Int32(0))
    assert len(seen) == (10 if family == "sm90" else 6)
    assert all(n >= 32 for _, _, n in seen)


def _check_affine(tiled_mma, shape, seen):
    """Every (thread, value) coordinate of ``tiled_mma``'s accumulator layout over a ``shape`` tile
    is the thread's first coordinate plus thread 0's for that value; thread 0's agree with its
    partition of the identity tensor."""
    tv = tiled_mma.tv_layout_C_tiled
    threads, values = cute.size(tv.shape[0]), cute.size(tv.shape[1])
    rows = shape[0]

    def at(t, v):
        idx = cute.crd2idx((t, v), tv)
        return idx % rows, idx // rows

    t0 = static_coords(tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(shape)))
    for v in range(values):
        assert at(0, v) == t0(v), (shape, v, at(0, v), t0(v))
    for t in range(threads):
        first = at(t, 0)
        for v in range(values):
            want = (first[0] + t0(v)[0], first[1] + t0(v)[1])
            assert at(t, v) == want, (shape, t, v, at(t, v), want)
    seen.append((shape, threads, values))


@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_thread_positions_are_first_plus_thread0(family):
    """Note [Score positions] (fa4/mods_kernel.py): every thread's accumulator coordinates are its
    first element's plus thread 0's (``UserMods`` computes a score's query and key that way). Read
    from the MMAs' thread-value layouts in Python, for every thread and value of the sm80 and sm90
    MMAs the user functions run on; thread 0's row of that layout is checked against its
    partition (the element order ``UserMods`` walks)."""
    seen = []

    @cute.jit
    def trace(tidx: Int32):
        if cutlass.const_expr(family == "sm90"):
            cases = [(_sm90_mma(n), (128, n)) for n in (64, 80, 128, 176)]
        else:
            cases = [(tiled_mma_sm80(cutlass.BFloat16, 128, 4), (64, 128)),
                     (tiled_mma_sm80(cutlass.BFloat16, 256, 8), (128, 64))]
        for tiled_mma, shape in cases:
            _check_affine(tiled_mma, shape, seen)

    with jit._target_arch("sm_90a"):
        cute.compile(trace, Int32(0))
    assert len(seen) == (4 if family == "sm90" else 2)
    # (an sm80 MMA tile holds 8 values a thread; a partition repeats it, the same offsets for every thread)
    assert all(t >= 128 and v >= (32 if family == "sm90" else 8) for _, t, v in seen), seen
