"""Test support for fa4's kernels: the reference, the pass rule, and input generators.

Everything here is plain PyTorch and runs on CPU tensors as well as CUDA ones.

* :func:`attention_ref` -- the attention reference with FlashAttention's semantics (causal
  bottom-right, sliding window, softcap, GQA/MQA, varlen with ``seqused_k``, fully masked rows).
  ``upcast=True`` gives the float32 reference; ``upcast=False`` gives what a naive PyTorch
  implementation computes in the input dtype (the "PyTorch low-precision" baseline of the pass rule).
* :func:`check_close` -- the pass rule: a kernel may be at most twice as far from the float32
  reference as the naive low-precision PyTorch result is, plus the output dtype's rounding noise.
* :func:`random_qkv`, :func:`random_varlen`, :func:`adversarial_scores_qk`, :func:`nan_like` --
  inputs and output fills that make kernel bugs visible.

Typical kernel test::

    q, k, v = random_qkv(2, 113, 203, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=0)
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    out_pt, lse_pt = attention_ref(q, k, v, causal=True, upcast=False)
    check_close("out", out, out_ref, out_pt)
    check_close("lse", lse, lse_ref, lse_pt)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

Window = tuple[Optional[int], Optional[int]]

PT_FACTOR = 2.0
"""How many times the naive low-precision PyTorch error a kernel may reach (FlashAttention's rule)."""

# Note [rounding noise]
# The pass rule's additive term, as (relative to max|ref|, absolute), per dtype of the tested tensor.
# * 16-bit outputs: one epsilon of the dtype at the reference's largest magnitude, i.e. 1-2 ulps of
#   the largest element. A correct kernel rounds P to the dtype before P@V and rounds O once more:
#   two half-ulp roundings. This term only matters when the naive PyTorch result happens to be exact
#   (a single allowed key, a tiny problem); it stays below any real bug. A reference that is all
#   zeros (every row masked) gives 0: the kernel must then write exact zeros.
# * float32 outputs (the LSE): the kernels compute it in float32 but through approximate exp2/log2
#   (MUFU ex2 ~2^-22 relative, a degree-3 polynomial exp2 emulation ~2^-13.5 relative) and in another
#   summation order. A relative error of the row sum is an absolute error of the log, so the noise
#   is 2^-12 absolute plus 8 float32 ulps of the magnitude (score rounding over the head dim).
_ROUNDING_NOISE: dict[torch.dtype, tuple[float, float]] = {
    torch.bfloat16: (2.0**-7, 0.0),
    torch.float16: (2.0**-10, 0.0),
    torch.float32: (2.0**-20, 2.0**-12),
    torch.float64: (2.0**-49, 0.0),
}


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def attention_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window_size: Window = (None, None),
    device: Optional[torch.device | str] = None,
) -> torch.Tensor:
    """Boolean ``(seqlen_q, seqlen_k)`` mask, True where query row i may attend key j.

    FlashAttention's convention: ``i + sk - sq - left <= j <= i + sk - sq + right`` with ``None``
    unbounded; ``causal`` sets ``right = 0`` (bottom-right aligned when ``sq != sk``).
    """
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = rows + seqlen_k - seqlen_q  # the key aligned with row i
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left is not None:
        allowed &= cols >= diag - left
    if right is not None:
        allowed &= cols <= diag + right
    return allowed


def _repeat_kv_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``(b, s, heads_k, d) -> (b, s, heads, d)``: q head h reads kv head ``h // (heads // heads_k)``."""
    heads_k = t.shape[2]
    if heads % heads_k != 0:
        raise ValueError(f"heads ({heads}) must be a multiple of heads_k ({heads_k})")
    return t.repeat_interleave(heads // heads_k, dim=2)


def _dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_size: Window,
    softcap: float,
    score_fn: Optional[Callable] = None,
    mask_fn: Optional[Callable] = None,
    batch_base: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q (b, sq, h, d)`` over ``k, v (b, sk, hk, d*)`` in the dtype of the inputs.

    Returns ``out (b, sq, h, dv)`` and ``lse`` float32 ``(b, h, sq)``. Rows with no allowed key
    give out 0 and lse -inf; they are routed around the softmax so their gradients are 0, not NaN.
    ``score_fn`` / ``mask_fn``: the torch twins of a ``score_mod`` / ``mask_mod`` (:func:`attention_ref`);
    ``batch_base``: the batch index of ``q``'s first entry.
    """
    heads, seqlen_q, seqlen_k = q.shape[2], q.shape[1], k.shape[1]
    heads_k = k.shape[2]
    # float32 GQA: each kv head's q heads as one group, so K and V are not copied per q head (a decode
    # test's float32 copy was 8 GiB, and 12 test workers ran an H100 out of memory, v0.43). The
    # input-dtype computation keeps the copies: its rounding is the tests' baseline.
    grouped = heads != heads_k and q.dtype == torch.float32 and heads % heads_k == 0
    if grouped:
        g = heads // heads_k
        scores = torch.einsum("bqhgd,bkhd->bhgqk", q.unflatten(2, (heads_k, g)), k).flatten(1, 2) * softmax_scale
    else:
        k = _repeat_kv_heads(k, heads)
        v = _repeat_kv_heads(v, heads)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    if score_fn is not None or mask_fn is not None:
        dev = q.device
        idx = (torch.arange(batch_base, batch_base + q.shape[0], device=dev).view(-1, 1, 1, 1),
               torch.arange(heads, device=dev).view(1, -1, 1, 1), torch.arange(seqlen_q, device=dev).view(1, 1, -1, 1),
               torch.arange(seqlen_k, device=dev).view(1, 1, 1, -1))
    if score_fn is not None:
        scores = score_fn(scores, *idx).to(scores.dtype)
    allowed = attention_mask(seqlen_q, seqlen_k, causal=causal, window_size=window_size, device=q.device)
    if mask_fn is not None:
        allowed = allowed & mask_fn(*idx)  # (b, h, sq, sk)
    row_live = allowed.any(dim=-1, keepdim=True)  # (sq, 1)
    # Masked keys get -inf; fully masked rows get all zeros instead (finite softmax, zero grads).
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~row_live, 0.0)
    lse = torch.logsumexp(scores.float(), dim=-1).masked_fill(~row_live.squeeze(-1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~row_live, 0.0)
    if grouped:
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs.unflatten(1, (heads_k, g)), v).flatten(2, 3)
    else:
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def _varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: Optional[torch.Tensor],
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``(total, h, d)`` attention, one sequence at a time (memory grows with the longest one).

    Sequence b uses queries ``cu_q[b]:cu_q[b+1]`` and keys ``cu_k[b]:cu_k[b] + used_k[b]`` where
    ``used_k`` is ``seqused_k`` if given, else the cu_seqlens length; window alignment uses these
    per-sequence lengths. Returns ``out (total_q, h, dv)`` and ``lse (h, total_q)``.
    """
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_q)} entries but cu_seqlens_k has {len(cu_k)}")
    if q.shape[0] != cu_q[-1]:
        raise ValueError(f"q has {q.shape[0]} rows but cu_seqlens_q ends at {cu_q[-1]}")
    used_k = seqused_k.tolist() if seqused_k is not None else [end - start for start, end in itertools.pairwise(cu_k)]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        k_start = cu_k[b]
        k_stop = k_start + used_k[b]
        if used_k[b] > cu_k[b + 1] - k_start:
            raise ValueError(f"seqused_k[{b}] = {used_k[b]} exceeds the sequence's {cu_k[b + 1] - k_start} keys")
        out, lse = _dense_attention(
            q[cu_q[b] : cu_q[b + 1]].unsqueeze(0),
            k[k_start:k_stop].unsqueeze(0),
            v[k_start:k_stop].unsqueeze(0),
            **kwargs,
            batch_base=b,
        )
        outs.append(out.squeeze(0))
        lses.append(lse.squeeze(0))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Window = (None, None),
    softcap: float = 0.0,
    upcast: bool = True,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    score_fn: Optional[Callable] = None,
    mask_fn: Optional[Callable] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention with FlashAttention's semantics; differentiable with torch autograd.

    Fixed length: ``q (b, sq, h, d)``, ``k (b, sk, hk, d)``, ``v (b, sk, hk, dv)`` ->
    ``out (b, sq, h, dv)``, ``lse (b, h, sq)``. Varlen (``cu_seqlens_q`` and ``cu_seqlens_k`` int
    ``(batch + 1,)``): packed ``q (total_q, h, d)``, ``k, v (total_k, hk, d*)`` -> ``out (total_q, h,
    dv)``, ``lse (h, total_q)``; ``seqused_k (batch,)`` limits the keys each sequence uses.

    Scores are ``q.k * softmax_scale`` (default ``d ** -0.5``), then ``softcap * tanh(s / softcap)``
    when ``softcap > 0``, then ``score_fn(scores, b, h, q_idx, kv_idx)`` (a ``score_mod``'s torch twin:
    indices as broadcastable int64 tensors ``(B,1,1,1)``, ``(1,H,1,1)``, ``(1,1,Sq,1)``, ``(1,1,1,Sk)``;
    varlen: positions in the sequence, ``b`` its index); ``mask_fn(b, h, q_idx, kv_idx)`` -> bool hides
    keys where False, on top of the window. ``upcast=True``: inputs are upcast and everything, including ``out``, is
    float32. ``upcast=False``: the naive PyTorch computation in the input dtype (scores, softmax and
    P@V in that dtype; only the LSE reduction runs in float32 over the low-precision scores), and
    ``out`` has the input dtype. ``lse`` is always float32, natural log; a row with no allowed key
    has ``out = 0`` and ``lse = -inf``, and contributes no NaN to gradients.
    """
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if seqused_k is not None and cu_seqlens_k is None:
        raise ValueError("seqused_k needs cu_seqlens_q / cu_seqlens_k")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    kwargs = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size, "softcap": softcap,
              "score_fn": score_fn, "mask_fn": mask_fn}
    if cu_seqlens_q is None:
        return _dense_attention(q, k, v, **kwargs)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, **kwargs)


# --------------------------------------------------------------------------------------------
# Pass rule
# --------------------------------------------------------------------------------------------


class CloseReport(NamedTuple):
    """What :func:`check_close` measured (over positions where the reference is finite)."""

    err: float
    err_pt: float
    atol: float
    bound: float


def rounding_noise(dtype: torch.dtype, magnitude: float) -> float:
    """The additive term of the pass rule for a tensor of ``dtype`` whose reference peaks at ``magnitude``.

    See Note [rounding noise]; unknown dtypes use their machine epsilon relative to the magnitude.
    """
    rel, absolute = _ROUNDING_NOISE.get(dtype, (torch.finfo(dtype).eps, 0.0))
    return rel * magnitude + absolute


def _fmt_index(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Flat index -> coordinates (row-major)."""
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return tuple(reversed(coords))


def grad_noise_floor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                     softmax_scale: Optional[float] = None) -> dict[str, float]:
    """Absolute rounding floors for ``dq`` / ``dk`` / ``dv`` where the exact gradient cancels to 0.

    Note [gradient cancellation floor]
    ``dS = P * (dP - D)`` with ``dP_ij = dO_i . V_j`` and ``D_i = dO_i . O_i``: when a row sees one
    key (or all its probability sits on one), ``dP - D`` is exactly 0 in real arithmetic, and the
    reference (float32 and low-precision alike) returns exact zeros, so the pass rule's bound is 0.
    A kernel forms ``dP`` (an MMA over the head dim) and ``D`` (a row sum) in float32 in different
    orders, so it lands a few float32 roundings of ``|dP| ~ sqrt(d) * rms(dO) * rms(V)`` away from
    0. ``dq = scale * dS K`` and ``dk = scale * dS^T Q`` carry that times ``|K|`` / ``|Q|`` (and for
    ``dk``, summed over up to ``seqlen_q`` rows, ``sqrt(seqlen_q)``). ``dv = P^T dO`` does not cancel.
    The floor is 16 float32 epsilons of that size: far below any indexing or masking bug, which
    shows at the scale of the gradients themselves (1e-2 and up).
    """
    d = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    rms = lambda t: float(t.detach().float().pow(2).mean().sqrt())  # noqa: E731
    dp = math.sqrt(d) * rms(dout) * rms(v)
    eps = 16 * 2.0**-23
    seqlen_q = q.shape[-3]
    return {
        "dq": eps * dp * scale * float(k.detach().abs().max()),
        "dk": eps * dp * scale * float(q.detach().abs().max()) * math.sqrt(seqlen_q),
        "dv": 0.0,
    }


def check_close(
    name: str,
    out: torch.Tensor,
    out_ref: torch.Tensor,
    out_pt: torch.Tensor,
    *,
    extra_atol: Optional[float] = None,
) -> CloseReport:
    """Assert that ``out`` is as close to the float32 reference as the rule allows.

    Passes when ``max|out - out_ref| <= 2 * max|out_pt - out_ref| + rounding_noise(out.dtype,
    max|out_ref|) + extra_atol``, where ``out_pt`` is the naive low-precision PyTorch result
    (:func:`attention_ref` with ``upcast=False``, or its gradients). Positions where the reference
    is not finite (the -inf LSE of fully masked rows) must hold exactly the same value and are left
    out of the maxima. Any NaN in ``out`` fails, whatever the tolerance.

    Raises AssertionError naming the tensor, its error, the low-precision error, the bound, and the
    location and values of the first NaN or else of the worst element. Returns the measured
    :class:`CloseReport` (``err`` leaves NaN out: any NaN raises).
    """
    if out.shape != out_ref.shape or out_pt.shape != out_ref.shape:
        raise AssertionError(
            f"{name}: shape mismatch: out {tuple(out.shape)}, ref {tuple(out_ref.shape)}, pt {tuple(out_pt.shape)}"
        )
    o, r, p = (t.detach().to(torch.float64) for t in (out, out_ref, out_pt))
    if torch.isnan(r).any() or torch.isnan(p).any():
        raise AssertionError(f"{name}: the reference (float32 or low-precision) contains NaN")
    finite = torch.isfinite(r)
    if (torch.isfinite(p) != finite).any() or (p[~finite] != r[~finite]).any():
        raise AssertionError(f"{name}: the low-precision reference's infinities differ from the reference's")
    nan = torch.isnan(o)
    special_diff = torch.where(o == r, 0.0, math.inf)  # infinities must match exactly
    diff = torch.where(finite, (o - r).abs(), special_diff).masked_fill(nan, 0.0)
    err_pt = float((p - r).abs()[finite].max()) if finite.any() else 0.0
    magnitude = float(r.abs()[finite].max()) if finite.any() else 0.0
    atol = rounding_noise(out.dtype, magnitude) + (extra_atol or 0.0)
    bound = PT_FACTOR * err_pt + atol
    err = float(diff.max()) if diff.numel() else 0.0
    nan_count = int(nan.sum())
    if nan_count or err > bound:
        worst = int(nan.flatten().nonzero()[0]) if nan_count else int(diff.argmax())
        where = _fmt_index(worst, diff.shape)
        what = f"{nan_count} NaN(s) in out, first at {where}" if nan_count else f"worst at {where}"
        raise AssertionError(
            f"{name}: max|out - ref| = {err:.4g} (NaN excluded), bound {bound:.4g} = {PT_FACTOR:g} * max|pt - ref| "
            f"({err_pt:.4g}) + atol ({atol:.4g}); {what}: out={o.flatten()[worst].item():.6g}, "
            f"ref={r.flatten()[worst].item():.6g}, pt={p.flatten()[worst].item():.6g}"
            + ("" if nan_count else "; no NaN")
        )
    return CloseReport(err=err, err_pt=err_pt, atol=atol, bound=bound)


# --------------------------------------------------------------------------------------------
# Inputs and output fills
# --------------------------------------------------------------------------------------------


def _generator(device: torch.device | str, seed: Optional[int]) -> Optional[torch.Generator]:
    """A seeded generator on ``device``, or None (global RNG) when no seed is given."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _randn_nonzero(shape: Sequence[int], dtype: torch.dtype, device, gen, requires_grad: bool) -> torch.Tensor:
    """Standard normal values in ``dtype`` with exact zeros (which hide missing loads) replaced by 1."""
    t = torch.randn(*shape, device=device, generator=gen).to(dtype)
    t = torch.where(t == 0, torch.ones((), dtype=dtype, device=device), t)
    return t.requires_grad_(requires_grad)


def random_qkv(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    heads: int,
    heads_k: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device | str,
    requires_grad: bool = False,
    seed: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard normal ``q (batch, seqlen_q, heads, d)``, ``k, v (batch, seqlen_k, heads_k, d)``, never 0."""
    gen = _generator(device, seed)
    q = _randn_nonzero((batch, seqlen_q, heads, d), dtype, device, gen, requires_grad)
    k = _randn_nonzero((batch, seqlen_k, heads_k, d), dtype, device, gen, requires_grad)
    v = _randn_nonzero((batch, seqlen_k, heads_k, d), dtype, device, gen, requires_grad)
    return q, k, v


@dataclass
class VarlenBatch:
    """Packed inputs for ``flash_attn_varlen_func`` and ``attention_ref``.

    ``q (total_q, heads, d)``, ``k, v (total_k, heads_k, d)``; ``cu_seqlens_q/k`` int32
    ``(batch + 1,)`` and ``seqused_k`` int32 ``(batch,)`` or None, all on the inputs' device;
    ``seqlens_q/k`` are the per-sequence lengths as Python lists.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seqlens_q: list[int]
    seqlens_k: list[int]
    seqused_k: Optional[torch.Tensor] = None


def _uneven_lengths(batch: int, max_len: int, short_first: bool, gen: torch.Generator) -> list[int]:
    """Random lengths in ``[1, max_len]`` with one sequence of length 1 and one of ``max_len``.

    ``short_first`` puts the length-1 sequence first and the longest last, else the other way
    round, so q and k lengths can be paired adversarially. A batch of one gets ``max_len``.
    """
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    if batch >= 2:
        short, long_ = (0, batch - 1) if short_first else (batch - 1, 0)
        lengths[short], lengths[long_] = 1, max_len
    else:
        lengths[0] = max_len
    return lengths


def _cu_seqlens(lengths: Sequence[int], device) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32 on ``device``."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def random_varlen(
    batch: int,
    max_seqlen: int,
    heads: int,
    heads_k: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    max_seqlen_k: Optional[int] = None,
    with_seqused_k: bool = False,
    requires_grad: bool = False,
    seed: Optional[int] = None,
) -> VarlenBatch:
    """Random packed sequences of uneven lengths, all >= 1.

    Query lengths lie in ``[1, max_seqlen]`` and key lengths in ``[1, max_seqlen_k]`` (default
    ``max_seqlen``); with ``batch >= 2`` the first sequence has 1 query and the most keys and the
    last one the most queries and 1 key (so causal masks leave rows fully masked). With
    ``with_seqused_k``, each sequence uses a random ``seqused_k[b]`` in ``[1, len_k[b]]`` keys.
    """
    max_seqlen_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    cpu_gen = torch.Generator().manual_seed(seed) if seed is not None else torch.default_generator
    seqlens_q = _uneven_lengths(batch, max_seqlen, short_first=True, gen=cpu_gen)
    seqlens_k = _uneven_lengths(batch, max_seqlen_k, short_first=False, gen=cpu_gen)
    used = None
    if with_seqused_k:
        used = [int(torch.randint(1, n + 1, (1,), generator=cpu_gen)) for n in seqlens_k]
    return varlen_batch(seqlens_q, seqlens_k, heads, heads_k, d, dtype, device, seqused_k=used,
                        requires_grad=requires_grad, seed=seed)


def varlen_batch(
    seqlens_q: Sequence[int],
    seqlens_k: Sequence[int],
    heads: int,
    heads_k: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    seqused_k: Optional[Sequence[int]] = None,
    requires_grad: bool = False,
    seed: Optional[int] = None,
) -> VarlenBatch:
    """Random packed sequences of the given lengths (and ``seqused_k``, if given)."""
    seqlens_q, seqlens_k = list(seqlens_q), list(seqlens_k)
    gen = _generator(device, seed)
    q = _randn_nonzero((sum(seqlens_q), heads, d), dtype, device, gen, requires_grad)
    k = _randn_nonzero((sum(seqlens_k), heads_k, d), dtype, device, gen, requires_grad)
    v = _randn_nonzero((sum(seqlens_k), heads_k, d), dtype, device, gen, requires_grad)
    return VarlenBatch(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=_cu_seqlens(seqlens_q, device),
        cu_seqlens_k=_cu_seqlens(seqlens_k, device),
        max_seqlen_q=max(seqlens_q),
        max_seqlen_k=max(seqlens_k),
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        seqused_k=None if seqused_k is None else torch.tensor(list(seqused_k), dtype=torch.int32, device=device),
    )


def adversarial_scores_qk(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    heads: int,
    heads_k: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    block_n: int = 128,
    step: float = 0.5,
    jump: float = 8.0,
    huge: float = 60.0,
    softmax_scale: Optional[float] = None,
    seed: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (batch, seqlen_q, heads, d)``, ``k (batch, seqlen_k, heads_k, d)`` that stress the online softmax.

    Made for the conditional-rescale tests (O and the row sum are rescaled only when a row max grows
    by more than a threshold). With ``s = q.k * softmax_scale`` and key block ``n = j // block_n``
    (blocks counted from key 0, no masking), query rows cycle through three kinds (``i % 3``):

    * 0, creeping: the row max grows by about ``step`` in every key block -- below a rescale
      threshold (FA4's 8 log2 units = 5.5 nats), so rescales are skipped and the stale max drifts;
    * 1, jumping: the row max grows by about ``jump`` in every key block -- above the threshold,
      so every block rescales, and the final scores are far above the first ones;
    * 2, one cliff: creeps like kind 0, then jumps by a further ``huge`` in the last key block, so
      everything accumulated before must be scaled by about ``exp(-huge)``.

    Construction: coordinate 0 carries the ramp (``k[j, 0] = n + 1``, exact in 16-bit types, and
    ``q[i, 0] = rate / softmax_scale``), coordinate 1 the cliff (``k[j, 1] = 1`` in the last block);
    the other coordinates are uniform noise small enough (at most ``step / 4`` in ``s``) that each
    block's max is strictly larger than the previous one's. Steps are in natural-log units of ``s``.
    Pair with ``v`` from :func:`random_qkv`. Needs ``d >= 2`` and ``seqlen_k >= 1``.
    """
    if d < 2 or seqlen_k < 1:
        raise ValueError("adversarial_scores_qk needs d >= 2 and seqlen_k >= 1")
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    gen = _generator(device, seed)
    # |noise score| <= (d - 2) * a * a * scale <= step / 4 for uniform noise in [-a, a].
    amp = math.sqrt(step / (4 * scale * max(d - 2, 1)))
    q = (torch.rand(batch, seqlen_q, heads, d, device=device, generator=gen) * 2 - 1) * amp
    k = (torch.rand(batch, seqlen_k, heads_k, d, device=device, generator=gen) * 2 - 1) * amp
    block = torch.arange(seqlen_k, device=device) // block_n
    k[..., 0] = (block + 1).float().view(1, -1, 1)
    k[..., 1] = (block == block[-1]).float().view(1, -1, 1)
    kind = torch.arange(seqlen_q, device=device) % 3
    rate = torch.tensor([step, jump, step], device=device)[kind]
    cliff = torch.where(kind == 2, huge, 0.0)
    q[..., 0] = (rate / scale).view(1, -1, 1)
    q[..., 1] = (cliff / scale).view(1, -1, 1)
    return q.to(dtype), k.to(dtype)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like ``t`` filled with NaN: preallocate outputs with it so unwritten elements fail."""
    return torch.full_like(t, float("nan"))
