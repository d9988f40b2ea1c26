"""The edges-first order of a local tile's K blocks (Note [Edges first] in fa4/mask.py), as the sm90
forward's producer and consumers walk it: a permutation of the tile's blocks that starts with the
tile's first block and visits every block at either edge of the window before any free one."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

import fa4.mask as fa4_mask
from fa4.mask import edges_first_block

order_at = edges_first_block.__wrapped__  # (the plain Python body: its arithmetic on ints)


@st.composite
def bounds(draw):
    n_min = draw(st.integers(0, 20))
    n_max = draw(st.integers(n_min + 1, n_min + 40))
    n_a = draw(st.integers(n_min, n_max - 1))
    n_b = draw(st.integers(n_min, n_a))
    return n_min, n_max, n_a, n_b


@given(bounds())
def test_edges_first_order(b):
    n_min, n_max, n_a, n_b = b
    order = [order_at(i, n_max, n_min, n_a, n_b) for i in range(n_max - n_min)]
    assert sorted(order) == list(range(n_min, n_max))
    assert order[0] == n_max - 1
    edges = (n_max - n_a) + (n_b - n_min)
    assert set(order[:edges]) == set(range(n_a, n_max)) | set(range(n_min, n_b))
    assert order[edges:] == list(range(n_a - 1, n_b - 1, -1))  # the free blocks, descending
    assert order[:n_max - n_a] == list(range(n_max - 1, n_a - 1, -1))  # the right edge from the first block


class _Cutlass:
    """What ``walk_blocks`` takes from cutlass, on Python ints (its loops run in Python)."""
    range = staticmethod(lambda n, unroll=1: range(n))
    max = staticmethod(max)
    min = staticmethod(min)


class _Cute:
    ceil_div = staticmethod(lambda a, b: -(-a // b))

    class arch:
        make_warp_uniform = staticmethod(lambda x: x)


def _walk(mask, m, n_min, n_max, fold):
    """The consumers' visits of tile ``m``'s blocks: ``(n, masked)`` in order, the first block first
    (``walk_blocks`` with ``edges_first``, the first block folded in or run before it)."""
    seen = [] if fold else [(n_max - 1, True)]
    step = lambda n, c, mask_window, window_if: seen.append((n, mask_window))  # noqa: E731
    first = lambda n, c, is_first: seen.append((n, True))  # noqa: E731
    fa4_mask.walk_blocks.__wrapped__(mask, m, n_min, n_max, step, None, uniform_bounds=True,
                                     first_step=first if fold else None, edges_first=True)
    return seen


@given(st.integers(1, 900), st.integers(1, 900), st.integers(0, 700), st.integers(0, 700),
       st.sampled_from([(64, 128), (128, 128), (192, 128), (128, 80), (128, 112)]), st.integers(1, 4),
       st.integers(0, 3))
def test_walk_matches_the_producer_order(sq, sk, wl, wr, tiles, splits, split):
    """Both consumer forms of the edges-first walk (folded and separate) visit a local tile's blocks
    in the order the producer loads them (``[n_max - 1] + edges_first_block(i + 1)``, split-KV
    ranges too), each once, masking the same blocks as the descending walk."""
    tile_m, tile_n = tiles
    mask = fa4_mask.AttentionMask(tile_m, tile_n, False, True, sq, sk, wl, wr)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fa4_mask, "cutlass", _Cutlass)
        mp.setattr(fa4_mask, "cute", _Cute)
        mp.setattr(fa4_mask, "const_expr", lambda x: x)
        mp.setattr(fa4_mask, "window_bounds", fa4_mask.window_bounds.__wrapped__)
        mp.setattr(fa4_mask, "edges_first_block", order_at)
        for m in range(-(-sq // tile_m)):
            lo, hi = mask.n_block_range(m)
            per = -(-(hi - lo) // splits)
            n_min, n_max = lo + min(split, splits - 1) * per, min(lo + (min(split, splits - 1) + 1) * per, hi)
            if n_min >= n_max:
                continue
            n_a, n_b = fa4_mask.window_bounds(mask, m, n_min, n_max)
            producer = [n_max - 1] + [order_at(i + 1, n_max, n_min, n_a, n_b) for i in range(n_max - 1 - n_min)]
            descending = [(n_max - 1, True)]
            fa4_mask.walk_blocks.__wrapped__(mask, m, n_min, n_max,
                                             lambda n, c, mw, wi: descending.append((n, mw)), None)
            for fold in (False, True):
                seen = _walk(mask, m, n_min, n_max, fold)
                assert [n for n, _ in seen] == producer, (m, n_min, n_max, fold)
                assert dict(seen) == dict(descending), (m, fold)
            assert sorted(producer) == list(range(n_min, n_max))
