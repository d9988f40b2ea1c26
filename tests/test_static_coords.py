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
    # An index that is not one int per mode (a flat index here) is the lookup itself.
    assert tuple(coord(7)) == tuple(view[7])
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
