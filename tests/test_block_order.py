"""The edges-first order of a local tile's K blocks (Note [Edges first] in fa4/mask.py), as the sm90
forward's producer and consumers walk it: a permutation of the tile's blocks that starts with the
tile's first block and visits every block at either edge of the window before any free one."""

from __future__ import annotations

from hypothesis import given, strategies as st

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
