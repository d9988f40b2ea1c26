"""The split-KV combine kernel against a float64 torch reference (needs a GPU: ``pytest -m gpu``).

Inputs: random float32 partials with about a third of the (split, row) slots empty (``lse = -inf``
and NaN in ``O``: an empty split must contribute nothing, never NaN), a few rows with every split
empty (``out = 0``, ``lse = -inf``). Outputs are NaN-filled before the launch (tests/conftest.py
sets ``fa4.ops.set_nan_fill``; user-passed outputs are filled here), so a row the kernel should
write and does not fails, and a row it must not write (past ``seqused``, outside every sequence)
is checked to still hold its sentinel. Grid: dense and packed, 1 to 200 splits, head dims 8 to 256
(the three lane mappings: 8, 16 and 32 lanes per row, and columns predicated off), the three
output dtypes, the warps-per-row sharing forced to 1, 2 and 4, and bit-exact repeatability.
Tolerances: out within one unit of the output dtype (fp32: 1e-5 relative), lse 1e-5 absolute.
"""

import itertools
import math

import pytest
import torch

import fa4
from fa4 import combine

pytestmark = pytest.mark.gpu

DEV = "cuda"
F32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
SPLITS = [1, 2, 7, 64, 200]
HEAD_DIMS = [64, 72, 128, 256]
DTYPES = [BF16, FP16, F32]


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def make_partials(splits, rows_shape, d, seed=0, empty_frac=0.35, all_empty_every=7):
    """``(out_partial, lse_partial)``: float32 ``(splits, *rows_shape, d)`` / ``(splits, *rows_shape)``.
    Empty slots have ``lse = -inf`` and NaN in ``O``; every ``all_empty_every``-th row has no
    non-empty split at all."""
    g = _gen(seed)
    op = torch.randn((splits, *rows_shape, d), generator=g, device=DEV)
    lse = torch.randn((splits, *rows_shape), generator=g, device=DEV) * 4 + 3
    empty = torch.rand(lse.shape, generator=g, device=DEV) < empty_frac
    if all_empty_every:
        flat = empty.view(splits, -1)
        flat[:, ::all_empty_every] = True
    lse[empty] = -math.inf
    op[empty] = math.nan
    return op, lse


def reference(op, lse):
    """float64 ``(out, lse)``: ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse) O_s``;
    an empty split contributes nothing, a row without any split gets ``out = 0``, ``lse = -inf``."""
    lse64 = lse.double()
    m = lse64.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse64 - m)
    total = w.sum(0)
    ref_lse = m + torch.log(total)
    o = torch.where((w > 0)[..., None], op.double(), torch.zeros((), dtype=torch.float64, device=op.device))
    ref_out = (w[..., None] * o).sum(0) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return ref_out, ref_lse


def check(out, lse, op, lp, rows=None):
    """``out`` / ``lse`` against the reference on the selected rows (a boolean mask over the row
    dims, or all)."""
    ref_out, ref_lse = reference(op, lp)
    if rows is not None:
        out, ref_out = out[rows], ref_out[rows]
        lse = lse[rows] if lse is not None else None
        ref_lse = ref_lse[rows]
    assert not out.isnan().any(), "NaN in out: a row not written, or an empty split's NaN propagated"
    if out.dtype == F32:
        # atol: MUFU ex2's ~2^-22 relative error of each weight, times |O| (a few units)
        torch.testing.assert_close(out, ref_out.float(), rtol=1e-5, atol=5e-6)
    else:  # one unit in the last place of the output dtype (the rounding of a correct fp32 result)
        ulp = 2.0**-7 if out.dtype == BF16 else 2.0**-10
        torch.testing.assert_close(out.float(), ref_out.to(out.dtype).float(), rtol=ulp, atol=1e-5)
    if lse is not None:
        assert not lse.isnan().any(), "NaN in lse"
        torch.testing.assert_close(lse, ref_lse.float(), rtol=0, atol=1e-5)


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)


# --------------------------------------------------------------------------------------------
# Accuracy grids
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("splits", SPLITS)
def test_dense(splits, d, dtype):
    op, lp = make_partials(splits, (3, 5, 6), d, seed=splits * 1000 + d)
    out, lse = fa4.flash_attn_combine(op, lp, out_dtype=dtype)
    assert out.shape == (3, 5, 6, d) and out.dtype == dtype
    assert lse.shape == (3, 5, 6) and lse.stride() == (30, 1, 5)
    check(out, lse, op, lp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 72, 256])
@pytest.mark.parametrize("splits", [1, 7, 200])
def test_varlen(splits, d, dtype):
    """Packed partials with uneven sequences (one empty); the 3 tokens after cu_seqlens[-1] belong
    to no sequence and are not written."""
    cu = _cu([3, 0, 7, 1, 4])
    total = int(cu[-1]) + 3
    op, lp = make_partials(splits, (total, 4), d, seed=splits + d)
    out, lse = fa4.flash_attn_combine(op, lp, out_dtype=dtype, cu_seqlens=cu)
    assert out.shape == (total, 4, d) and lse.shape == (total, 4) and lse.stride() == (1, total)
    n = int(cu[-1])
    check(out[:n], lse[:n], op[:, :n], lp[:, :n])
    assert out[n:].isnan().all() and lse[n:].isnan().all(), "wrote tokens outside every sequence"


@pytest.mark.parametrize("splits", [1, 64])
def test_packed_without_cu_seqlens(splits):
    op, lp = make_partials(splits, (13, 3), 128, seed=5)
    out, lse = fa4.flash_attn_combine(op, lp, out_dtype=BF16)
    check(out, lse, op, lp)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("d", [8, 32, 40, 136, 248])
def test_other_head_dims(d, dtype):
    """8 lanes per row (d <= 32), 16 lanes (d <= 64), two vectors per lane (d > 128), with the
    columns past the real head dim predicated off."""
    op, lp = make_partials(7, (2, 9, 5), d, seed=d)
    out, lse = fa4.flash_attn_combine(op, lp, out_dtype=dtype)
    check(out, lse, op, lp)


@pytest.mark.parametrize("wpr", [1, 2, 4])
@pytest.mark.parametrize("d,splits,rows", [(128, 64, (2, 3, 7)), (64, 64, (1, 5, 3)), (256, 7, (1, 3, 5)),
                                           (32, 200, (2, 1, 9))])
def test_warps_per_row(wpr, d, splits, rows):
    """Every sharing of the splits among the warps of a row group (more warps than steps of splits
    included: a warp with no split adds zeros); rows that do not fill the last CTA."""
    op, lp = make_partials(splits, rows, d, seed=wpr + splits)
    out = torch.full((*rows, d), math.nan, device=DEV)
    lse = torch.full(rows, math.nan, device=DEV)
    combine.combine_into(op, lp, out, lse, wpr=wpr)
    check(out, lse, op, lp)


# --------------------------------------------------------------------------------------------
# Empty splits and rows
# --------------------------------------------------------------------------------------------


def test_single_live_split_is_exact():
    """All splits but one are empty (NaN in their O): out is that split's O and lse its lse, bit
    for bit (weight exp2(0) = 1, sum 1, log 1 = 0)."""
    splits, rows, d = 9, (2, 4, 3), 128
    op, lp = make_partials(splits, rows, d, seed=3, empty_frac=0.0, all_empty_every=0)
    live = torch.randint(0, splits, rows, generator=_gen(4), device=DEV)
    dead = torch.arange(splits, device=DEV).view(-1, 1, 1, 1) != live
    lp[dead] = -math.inf
    op[dead] = math.nan
    out, lse = fa4.flash_attn_combine(op, lp)
    idx = live[None, ..., None].expand(1, *rows, d)
    assert torch.equal(out, op.gather(0, idx)[0])
    assert torch.equal(lse, lp.gather(0, live[None])[0])


@pytest.mark.parametrize("splits", [1, 5, 256])
def test_all_splits_empty(splits):
    op = torch.full((splits, 2, 3, 4, 64), math.nan, device=DEV)
    lp = torch.full((splits, 2, 3, 4), -math.inf, device=DEV)
    out, lse = fa4.flash_attn_combine(op, lp, out_dtype=BF16)
    assert torch.equal(out, torch.zeros_like(out))
    assert (lse == -math.inf).all()


def test_one_split_is_a_copy():
    op, lp = make_partials(1, (2, 3, 4), 64, seed=1, all_empty_every=0)
    live = lp != -math.inf
    out, lse = fa4.flash_attn_combine(op, lp)
    assert torch.equal(out[live[0]], op[0][live[0]]) and torch.equal(lse[live[0]], lp[0][live[0]])
    assert (out[~live[0]] == 0).all() and (lse[~live[0]] == -math.inf).all()


# --------------------------------------------------------------------------------------------
# seqused, outputs, layouts
# --------------------------------------------------------------------------------------------

SENTINEL = 96.0  # exact in every output dtype, far from any weighted mean of the partials


def test_seqused_dense():
    b, s, h, d = 3, 6, 4, 72
    op, lp = make_partials(7, (b, s, h), d, seed=11)
    seqused = torch.tensor([2, 0, 6], dtype=torch.int32, device=DEV)
    out = torch.full((b, s, h, d), SENTINEL, dtype=BF16, device=DEV)
    res, lse = fa4.flash_attn_combine(op, lp, out=out, seqused=seqused)
    assert res is out
    written = torch.arange(s, device=DEV)[None, :] < seqused[:, None].long()  # (b, s)
    check(out, lse, op, lp, rows=written)
    assert (out[~written] == SENTINEL).all(), "a row past seqused was written"
    assert lse[~written].isnan().all(), "an lse row past seqused was written"
    # the internal launcher, with a sentinel lse of any strides
    out2 = torch.full((b, s, h, d), SENTINEL, dtype=F32, device=DEV)
    lse2 = torch.full((b, h, s), SENTINEL, device=DEV).transpose(1, 2)
    combine.combine_into(op, lp, out2, lse2, seqused=seqused)
    check(out2, lse2, op, lp, rows=written)
    assert (out2[~written] == SENTINEL).all() and (lse2[~written] == SENTINEL).all()


def test_seqused_varlen():
    lengths = [3, 0, 7, 5]
    cu = _cu(lengths)
    seqused = torch.tensor([2, 0, 7, 1], dtype=torch.int32, device=DEV)
    total, h, d = int(cu[-1]), 3, 128
    op, lp = make_partials(64, (total, h), d, seed=12)
    out = torch.full((total, h, d), SENTINEL, dtype=FP16, device=DEV)
    lse = torch.full((h, total), SENTINEL, device=DEV).t()
    combine.combine_into(op, lp, out, lse, cu_seqlens=cu, seqused=seqused)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(DEV)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(DEV)
    written = pos < seqused.long()[seq]
    check(out, lse, op, lp, rows=written)
    assert (out[~written] == SENTINEL).all() and (lse[~written] == SENTINEL).all()
    res, lse3 = fa4.flash_attn_combine(op, lp, out=out.clone(), cu_seqlens=cu, seqused=seqused)
    check(res, lse3, op, lp, rows=written)


def test_return_lse_false():
    op, lp = make_partials(7, (2, 3, 4), 128, seed=2)
    out, lse = fa4.flash_attn_combine(op, lp, out_dtype=BF16, return_lse=False)
    assert lse is None
    check(out, None, op, lp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_user_out_strided(dtype):
    """A user ``out`` that is a view of a wider buffer: the columns past the head dim stay untouched."""
    b, s, h, d = 2, 3, 5, 128
    op, lp = make_partials(7, (b, s, h), d, seed=6)
    buf = torch.full((b, s, h, d + 8), SENTINEL, dtype=dtype, device=DEV)
    buf[..., :d] = math.nan
    out, lse = fa4.flash_attn_combine(op, lp, out=buf[..., :d])
    assert out.data_ptr() == buf.data_ptr() and out.dtype == dtype
    check(out, lse, op, lp)
    assert (buf[..., d:] == SENTINEL).all(), "wrote past the head dim"


def test_strided_partials():
    """out_partial a view of a wider buffer (head dim 72 of 80 columns); lse_partial a transposed
    view of (splits, b, h, s) memory (the forward's layout) and one with odd strides."""
    splits, b, s, h, d = 7, 2, 5, 3, 72
    op_full, lp = make_partials(splits, (b, s, h), 80, seed=8)
    op = op_full[..., :d]
    ref = fa4.flash_attn_combine(op.contiguous(), lp.contiguous())
    lp_t = lp.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
    assert lp_t.stride() == (b * h * s, h * s, 1, s)
    out, lse = fa4.flash_attn_combine(op, lp_t)
    check(out, lse, op, lp)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    lp_odd = torch.full((splits, b, s, h, 3), math.nan, device=DEV)[..., 1]
    lp_odd.copy_(lp)
    out, lse = fa4.flash_attn_combine(op, lp_odd)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


def test_varlen_lse_partial_transposed():
    cu = _cu([4, 2, 6])
    total, h, d = int(cu[-1]), 4, 64
    op, lp = make_partials(5, (total, h), d, seed=9)
    lp_t = lp.permute(0, 2, 1).contiguous().permute(0, 2, 1)  # (splits, h, total) memory
    out, lse = fa4.flash_attn_combine(op, lp_t, cu_seqlens=cu)
    check(out, lse, op, lp)


# --------------------------------------------------------------------------------------------
# Determinism, speed
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wpr", [None, 4])
def test_bit_exact_repeats(wpr):
    op, lp = make_partials(200, (4, 3, 8), 128, seed=10)
    results = []
    for _ in range(5):
        out = torch.full((4, 3, 8, 128), math.nan, dtype=F32, device=DEV)
        lse = torch.full((4, 8, 3), math.nan, device=DEV).transpose(1, 2)
        combine.combine_into(op, lp, out, lse, wpr=wpr)
        results.append((out, lse))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    check(*results[0], op, lp)


def test_decode_step_time():
    """A decode step's combine (batch 8, 32 heads, d 128, 16 splits: 2 MiB of partials) through the
    internal launcher: a few microseconds of GPU time (loose bound: catches a pathology only)."""
    op, lp = make_partials(16, (8, 1, 32), 128, seed=13, empty_frac=0.0, all_empty_every=0)
    out = torch.empty((8, 1, 32, 128), dtype=BF16, device=DEV)
    lse = torch.empty((8, 32, 1), device=DEV).transpose(1, 2)
    for _ in range(10):
        combine.combine_into(op, lp, out, lse)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 200
    start.record()
    for _ in range(n):
        combine.combine_into(op, lp, out, lse)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1000 / n
    print(f"combine decode step (8x32 rows, d128, 16 splits): {us:.1f} us per call (host + GPU)")
    assert us < 200
    check(out, lse, op, lp)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_16_bit_partials(dtype):
    """bf16 / fp16 partials are widened to float32 (exactly): the same bits as the widened call, the
    output in the partials' dtype by default."""
    op, lp = make_partials(5, (2, 33, 4), 128, seed=12)
    op = torch.nan_to_num(op).to(dtype)  # (16-bit partials of real calls hold no NaN)
    out, lse = fa4.flash_attn_combine(op, lp)
    ref, ref_lse = fa4.flash_attn_combine(op.float(), lp, out_dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, ref) and torch.equal(lse, ref_lse)
