"""The backward preprocess kernel against torch, through its launcher ``run_preprocess``.

Workspaces are views of NaN-filled buffers one guard region longer than needed: the test checks
every element the kernel must write (whole tiles of the main kernel's tile_m rows, for several
tile_m: the rows' values, the padding rows' +inf / 0 and dq_accum's zeros; Note [Padded row tiles]
in fa4/bwd/workspace.py) and that the guard is untouched. Inputs cover odd lengths
(1, 113, 1000), head dims that are not multiples of 32 (column predicates), rows with lse = -inf,
varlen with uneven lengths, with and without dLSE, and the semaphore zeroing.
"""

import math

import pytest
import torch

from fa4.bwd import preprocess
from fa4.bwd.workspace import dq_accum_shape, head_dim_padded, rows_shape

pytestmark = pytest.mark.gpu

GUARD = 1000


def _guarded(shape, dtype, fill):
    n = math.prod(shape)
    buf = torch.full((n + GUARD,), fill, dtype=dtype, device="cuda")
    return buf, buf[:n].view(shape)


def _check_guard(buf, fill):
    tail = buf[-GUARD:]
    assert (tail.isnan() if math.isnan(fill) else tail == fill).all(), "the kernel wrote past its workspace"


def _reference(out, dout, lse, dlse):
    """(dpsum, lse_log2) in (b, h, s) from (b, s, h, d) out/dout and (b, h, s) lse/dlse."""
    d = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    if dlse is not None:
        d = d - dlse
    lse_log2 = torch.where(lse == -math.inf, math.inf, lse * math.log2(math.e))
    return d, lse_log2


def _tile_rows(cu_seqlens_q, s, tile_m):
    """(rows of the sequences' rows, padding rows) of one head of the workspaces, the rows in
    (sequence, row) order (Note [Padded row tiles]): whole tiles of tile_m rows from each
    sequence's padded offset."""
    if cu_seqlens_q is None:
        return torch.arange(s), torch.arange(s, -(-s // tile_m) * tile_m)
    cu = cu_seqlens_q.tolist()
    rows, pad = [], []
    for b in range(len(cu) - 1):
        base, n = (cu[b] // tile_m + b) * tile_m, cu[b + 1] - cu[b]
        rows += range(base, base + n)
        pad += range(base + n, base + -(-n // tile_m) * tile_m)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(pad, dtype=torch.long)


def _run_and_check(out, dout, lse, dlse, cu_seqlens_q=None, max_seqlen_q=None, sem_shape=None, dq_tile_m=64):
    b, s, h, d = out.shape
    dpad = head_dim_padded(d)
    nan = float("nan")
    nseq = b if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
    varlen = cu_seqlens_q is not None
    buf_d, dpsum = _guarded(rows_shape(nseq, h, s, dq_tile_m, varlen), torch.float32, nan)
    buf_l, lse_log2 = _guarded(rows_shape(nseq, h, s, dq_tile_m, varlen), torch.float32, nan)
    acc_shape = dq_accum_shape(nseq, h, s, dpad, dq_tile_m, varlen)
    buf_a, dq_accum = _guarded(acc_shape, torch.float32, nan)
    sem = None
    if sem_shape is not None:
        buf_s, sem = _guarded(sem_shape, torch.int32, -7)
    preprocess.run_preprocess(
        out,
        dout,
        lse,
        lse_log2,
        dpsum,
        dq_accum,
        dlse=dlse,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        semaphore=sem,
        dq_tile_m=dq_tile_m,
    )
    torch.cuda.synchronize()
    ref_d, ref_l = _reference(out, dout, lse, dlse)
    # fp32 sums of d products in another order: a few ulps of the magnitude of the terms.
    tol = 1e-5 * (dout.float().abs() * out.float().abs()).sum(-1).transpose(1, 2).max().item() + 1e-6
    rows, pad = (t.to(out.device) for t in _tile_rows(cu_seqlens_q, s, dq_tile_m))
    got_d, got_l = dpsum[:, :, rows], lse_log2[:, :, rows]
    assert not got_d.isnan().any(), "dpsum has unwritten rows"
    torch.testing.assert_close(got_d, ref_d, atol=tol, rtol=1e-5)
    assert not got_l.isnan().any(), "lse_log2 has unwritten rows"
    assert torch.equal(got_l == math.inf, lse == -math.inf)
    torch.testing.assert_close(got_l, ref_l, atol=0, rtol=2e-7)
    assert torch.equal(dpsum[:, :, pad], torch.zeros_like(dpsum[:, :, pad])), "padding rows: dpsum != 0"
    assert (lse_log2[:, :, pad] == math.inf).all(), "padding rows: lse_log2 != +inf"
    tiles = dq_accum[:, :, torch.cat([rows, pad])]
    assert torch.equal(tiles, torch.zeros_like(tiles)), "dq_accum tiles not zeroed (NaN-filled before)"
    for buf in (buf_d, buf_l, buf_a):
        _check_guard(buf, nan)
    if sem is not None:
        assert torch.equal(sem, torch.zeros_like(sem))
        _check_guard(buf_s, -7)


def _inputs(b, s, h, d, dtype, seed, dlse: bool, neg_inf_rows: bool = True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.randn(b, s, h, d, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    lse = torch.randn(b, h, s, device="cuda", generator=g) * 5
    if neg_inf_rows and s > 1:
        lse[:, :, ::7] = -math.inf  # rows with no allowed key
    dl = torch.randn(b, h, s, device="cuda", generator=g) if dlse else None
    return out, dout, lse, dl


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64, 72, 128, 136, 192, 256])
@pytest.mark.parametrize("s", [1, 113, 1000])
@pytest.mark.parametrize("dlse", [False, True])
def test_preprocess_dense(dtype, d, s, dlse):
    out, dout, lse, dl = _inputs(2, s, 3, d, dtype, seed=s * 1000 + d, dlse=dlse)
    _run_and_check(out, dout, lse, dl, dq_tile_m=(32, 64, 128, 80)[d % 4])


@pytest.mark.parametrize("s", [1, 250, 256, 1000])
def test_preprocess_tiles_that_straddle_blocks(s):
    """80-row main-kernel tiles (the swapped dQ wgmma): the last tile may end past the rows of the
    preprocess's 128-row blocks (s = 250: tiles to 320); its padding and dq_accum are still written."""
    out, dout, lse, dl = _inputs(2, s, 3, 128, torch.bfloat16, seed=s, dlse=True)
    _run_and_check(out, dout, lse, dl, dq_tile_m=80)


def test_preprocess_strided_inputs_and_expanded_dlse():
    """out/dout with a non-compact head stride; dlse an expanded (stride-0) autograd-style view."""
    b, s, h, d = 2, 113, 4, 128
    big = torch.randn(b, s, h, 2 * d, device="cuda").to(torch.bfloat16)
    out, dout = big[..., :d], big[..., d:]
    lse = torch.randn(b, h, s, device="cuda")
    dl = torch.ones(1, 1, 1, device="cuda").expand(b, h, s)
    _run_and_check(out, dout, lse, dl)


@pytest.mark.parametrize("dlse", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_preprocess_varlen(dlse, d):
    lengths = [1, 1000, 113, 7, 257]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    total, h = sum(lengths), 3
    out, dout, lse, dl = _inputs(1, total, h, d, torch.bfloat16, seed=d, dlse=dlse)
    _run_and_check(
        out,
        dout,
        lse,
        dl,
        cu_seqlens_q=cu,
        max_seqlen_q=max(lengths),
        sem_shape=(len(lengths), h, -(-max(lengths) // 64)),
        dq_tile_m={96: 128, 128: 80}.get(d, 64),
    )


def test_preprocess_semaphores_larger_than_grid():
    """More semaphores than preprocess threads (a small problem with a tiny main-kernel tile_m)."""
    out, dout, lse, _ = _inputs(1, 1, 1, 64, torch.bfloat16, seed=3, dlse=False)
    _run_and_check(out, dout, lse, None, sem_shape=(3, 5, 1000))
