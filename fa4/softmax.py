"""The shared softmax engine (device): online softmax, exp2 emulation, conditional rescale, softcap.

Scores live in the log2 domain: ``x = s * scale_log2`` with ``scale_log2 = softmax_scale * log2(e)``;
with softcap the raw ``qk`` first becomes ``t = tanh(qk * softmax_scale / softcap)`` and
``scale_log2 = softcap * log2(e)`` (:func:`score_scales`), so one code path serves both.

Online softmax (:class:`OnlineSoftmax`, one object per thread, rows = the thread's accumulator rows)
    per K block: ``m_blk`` = row max of the block (thread-local, then over the quad); decide whether
    to rescale; ``P = exp2(x - m * scale_log2)`` in place; ``l += rowsum(P)`` (thread-local partial
    sums, reduced over the quad only in :meth:`OnlineSoftmax.finalize`).

Note [Conditional rescale]
    With ``rescale_threshold = tau > 0`` a warp rescales O and l only when some row it holds grows
    its max by more than ``tau`` (log2 units): ``vote.any`` over the warp; the row maxes and l are
    updated branch-free (scale 1 for a row that keeps its max) and only the multiplication of O
    sits behind the warp-uniform branch. If it rescales, every row of the warp takes its new max
    (rows that grew by less, too); otherwise every row keeps its stale max, so ``P <= 2**tau``
    (256 for tau = 8: fine for fp32 l and bf16/fp16 P). ``tau = 0`` is the classic rule: every row rescales whenever its max grows.
    Normalization and LSE use the max the row actually used, so they are exact either way:
    ``out = O / l``, ``lse = (m * scale_log2 + log2(l)) * ln(2)``. A row with no visible key keeps
    ``m = -inf``, ``l = 0``: it gets ``out = 0`` and ``lse = -inf`` (exponentials use a "safe" max
    of 0 for such rows, so no ``-inf - -inf`` NaN appears).

Note [Normalizing by the rounded P]
    ``O += P V`` multiplies P rounded to 16 bits; ``l`` summed from the fp32 P then differs from
    the weights actually applied by the rounding of every P. With ``round_p`` ``l`` is the sum
    of the rounded P, so ``out = sum(p^ v) / sum(p^)`` is an exact convex combination of the rounded
    weights, and the rounding of a dominant weight cancels to first order between numerator and
    denominator. This matters with a rescale threshold: a row that keeps a stale max has its largest
    P in (1, 2**tau] instead of exactly 1 (exact in bf16), so without it the dominant weight carries
    a rounding error the classic rule does not have.

Note [Attention sinks in the softmax]
    A learnable sink is one more logit per q head, ``sink``, with a zero value vector: the row's
    normalizer becomes ``l' = l * 2**(m - m') + 2**(sink * log2(e) - m')`` with ``m`` the row's
    scaled max over its keys and ``m' = max(m, sink * log2(e))``, the output ``O * 2**(m - m') /
    l'`` and the LSE ``(m' + log2(l')) * ln(2)``, all in float32 before the one rounding of the
    output (:meth:`OnlineSoftmax.finalize`). A row that saw no key gets ``out = 0`` and ``lse =
    sink``; with a ``-inf`` sink too, ``lse = -inf``. The backward needs nothing new: with the LSE
    including the sink, ``P = exp(s - lse)`` and ``D = rowsum(dO * O)`` are the sink-inclusive ones,
    and ``dsink = sum over rows of p_sink * (dlse - D)`` with ``p_sink = exp(sink - lse)``.

Note [exp2 emulation]
    ``2**x = 2**n * 2**f`` with ``n = floor(x)``, ``f = x - n`` in [0, 1). ``floor`` comes from one
    round-toward-minus-infinity add of ``1.5 * 2**23`` (the integer lands in the low mantissa bits);
    ``2**f`` is a degree-3 polynomial evaluated with 3 FMAs; ``2**n`` is added into the exponent
    field as an integer add of ``n << 23``. ``x`` is clamped to ``>= -127``: with ``c0 = 1`` exactly,
    ``x <= -127`` (and -inf) gives the bit pattern 0, i.e. exactly 0, and the add never wraps.
    Coefficients: minimax for the relative error of ``p(f) / 2**f`` on [0, 1] with ``c0`` pinned to 1,
    solved as a linear program on 4001 points (scipy ``linprog``), rounded to fp32; max relative error
    8.57e-5 (fp32 Horner, 2e6 samples) on normal results (``x >= -126``). Results below 2**-126 are
    not faithful (the implicit bit is lost) but are < 2**-126 in absolute value (MUFU ``ex2.ftz``
    flushes them to 0).
    Unlike MUFU ``ex2`` (which gives NaN, +inf, +inf), a NaN input gives 0 (``fmax`` returns the
    non-NaN operand), +inf gives NaN, and ``x >= 128`` a wrong finite value: the kernels only feed it
    ``s * scale - bias`` with the bias at least the row's max (or +inf for a row with no key), so
    ``x <= 0`` up to rounding, except where the scores themselves are NaN.
    A compile-time fraction ``exp2_emu_frac`` of the exponentials uses the polynomial (FMA pipe),
    the rest MUFU ``ex2.approx``: :func:`emulated_elements` picks, per row of a thread's fragment,
    exactly ``floor(frac * n + 0.5)`` of the ``n`` elements, spread evenly (Bresenham), the same
    columns for every row.
"""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.cute_utils import (
    add_round_down,
    convert_f32_to_half,
    round_to_half_,
    fadd_reduce,
    fmax_reduce,
    make_acc_mn_view,
    quad_allreduce_max,
    quad_allreduce_sum,
)

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# p(f) ~= 2**f on [0, 1): c0 + c1 f + c2 f^2 + c3 f^3 (fp32 values; see Note [exp2 emulation]).
EXP2_POLY = (1.0, 0.6951166391372681, 0.22764497995376587, 0.07706724107265472)
EXP2_POLY_MAX_REL_ERR = 8.57e-5
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23


# --------------------------------------------------------------------------------------------
# exp2
# --------------------------------------------------------------------------------------------


def emulated_elements(n: int, frac: float) -> tuple[bool, ...]:
    """Which of a row's ``n`` per-thread elements use the polynomial exp2: exactly
    ``floor(frac * n + 0.5)`` of them, evenly spread (element ``i`` is emulated iff
    ``floor((i + 1) k / n) > floor(i k / n)``). Pure Python, compile-time."""
    k = min(max(int(math.floor(frac * n + 0.5)), 0), n)
    return tuple((i + 1) * k // n > i * k // n for i in range(n))


def exp2_emulated(x: Float32) -> Float32:
    """``2**x`` on the FMA/ALU pipes (no MUFU). Exact 0 for ``x <= -127``; assumes ``x < 128``."""
    xc = cute.arch.fmax(x, -127.0)
    r = add_round_down(xc, _ROUND_MAGIC)  # bits hold 0x4B400000 + floor(xc)
    f = xc - (r - _ROUND_MAGIC)  # in [0, 1), exact
    c0, c1, c2, c3 = EXP2_POLY
    p = cute.math.fma(cute.math.fma(cute.math.fma(Float32(c3), f, Float32(c2)), f, Float32(c1)), f, Float32(c0))
    # (bits(r) << 23) == floor(xc) << 23 modulo 2**32: the magic's own bits shift out.
    return (p.bitcast(Int32) + (r.bitcast(Int32) << 23)).bitcast(Float32)


def exp2_mufu(x: Float32) -> Float32:
    """``2**x`` by MUFU ``ex2.approx``."""
    return cute.math.exp2(x, fastmath=True)


def exp2_select(x: Float32, emulate: bool) -> Float32:
    return exp2_emulated(x) if emulate else exp2_mufu(x)


def exp2_rows(
    acc_mn: cute.Tensor,
    row_bias: cute.Tensor,
    scale_log2: Float32,
    exp2_emu_frac: float,
    bias_per_col: bool = False,
) -> None:
    """In place on a ``(rows, cols)`` view: ``acc[r, c] = 2**(acc[r, c] * scale_log2 - bias)`` with
    ``bias = row_bias[r]`` (or ``row_bias[c]`` when ``bias_per_col``, e.g. a transposed S^T tile in
    the backward, where the bias is ``lse * log2(e)``). The emulated columns follow
    :func:`emulated_elements` on the view's column count."""
    ncol = cute.size(acc_mn.shape[1])
    emu = emulated_elements(ncol, exp2_emu_frac)
    if not any(emu) and not bias_per_col:
        # All MUFU: one vector op per row (same instructions, far less to trace).
        for r in range(cute.size(acc_mn.shape[0])):
            x = acc_mn[r, None].load() * scale_log2 - row_bias[r]
            acc_mn[r, None].store(cute.math.exp2(x, fastmath=True))
        return
    for r in range(cute.size(acc_mn.shape[0])):
        for c in range(ncol):
            b = row_bias[c] if bias_per_col else row_bias[r]
            acc_mn[r, c] = exp2_select(cute.math.fma(acc_mn[r, c], scale_log2, -b), emu[c])


# --------------------------------------------------------------------------------------------
# Softcap
# --------------------------------------------------------------------------------------------


def score_scales(softmax_scale: Float32, softcap: Optional[Float32], has_softcap: bool, has_score_mod: bool = False):
    """``(prescale, scale_log2)``: scores are ``tanh(qk * prescale)`` then ``* scale_log2`` with
    softcap, or ``qk * scale_log2`` without (``prescale`` None). With a user ``score_mod``
    (:mod:`fa4.mods`) the score is ``score_mod(qk * prescale)`` (``prescale = softmax_scale``, as
    flash_attn.cute passes it) then ``* log2(e)``."""
    if has_score_mod:
        return softmax_scale, Float32(LOG2_E)
    if has_softcap:
        return softmax_scale / softcap, softcap * LOG2_E
    return None, softmax_scale * LOG2_E


def apply_softcap(acc_S: cute.Tensor, prescale: Float32) -> None:
    """In place: ``acc = tanh(acc * prescale)`` (MUFU ``tanh.approx``). The log2-domain score is
    then ``acc * scale_log2`` with ``scale_log2 = softcap * log2(e)``."""
    for i in range(cute.size(acc_S)):
        acc_S[i] = cute.math.tanh(acc_S[i] * prescale, approx=True)


def softcap_grad(dS: cute.Tensor, tanh_S: cute.Tensor) -> None:
    """Backward through the softcap, in place: ``dS *= 1 - t**2`` where ``t`` is the tanh value
    kept from :func:`apply_softcap`. With ``s = softcap * tanh(qk * scale / softcap)``,
    ``ds/dqk = scale * (1 - t**2)``; the ``scale`` factor is applied where the backward applies
    ``softmax_scale`` without softcap (when writing dQ / dK)."""
    for i in range(cute.size(dS)):
        t = tanh_S[i]
        dS[i] = dS[i] * (1.0 - t * t)


# --------------------------------------------------------------------------------------------
# Online softmax
# --------------------------------------------------------------------------------------------


def rescale_rows(acc_mn: cute.Tensor, row_scale: cute.Tensor) -> None:
    """``acc[r, :] *= row_scale[r]`` on a ``(rows, cols)`` view."""
    for r in range(cute.size(acc_mn.shape[0])):
        acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])


class OnlineSoftmax:
    """Running max ``m`` and sum ``l`` for the ``num_rows`` accumulator rows of this thread.

    ``scale_log2``: runtime; ``exp2_emu_frac``, ``rescale_threshold``: compile-time.
    State lives in register tensors (``row_max`` holds raw scores, not scaled).
    """

    def __init__(self, scale_log2: Float32, num_rows: int, exp2_emu_frac: float = 0.0,
                 rescale_threshold: float = 0.0, round_p=None):
        self.scale_log2 = scale_log2
        # The 16-bit type P is rounded to before l sums it (Note [Normalizing by the rounded P]);
        # None: l sums the fp32 P.
        self.round_p = round_p
        self.num_rows = num_rows
        self.exp2_emu_frac = float(exp2_emu_frac)
        self.rescale_threshold = float(rescale_threshold)
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    # Carried through dynamic control flow (a persistent kernel's tile loop) as its three runtime
    # values; the compile-time knobs are copied.
    _DYNAMIC = ("scale_log2", "row_max", "row_sum")

    def __extract_mlir_values__(self):
        return [v for name in self._DYNAMIC for v in cutlass.extract_mlir_values(getattr(self, name))]

    def __new_from_mlir_values__(self, values):
        new = object.__new__(OnlineSoftmax)
        new.__dict__.update(self.__dict__)
        for name in self._DYNAMIC:
            n = len(cutlass.extract_mlir_values(getattr(self, name)))
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name), values[:n]))
            values = values[n:]
        return new

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def online_softmax(self, acc_S: cute.Tensor, acc_O: cute.Tensor,
                       is_first: cutlass.Constexpr[bool] = False) -> None:
        """One K block: ``acc_S`` (scores of the block, fp32 accumulator, masked entries -inf)
        becomes P in place; ``acc_O`` rows and ``l`` are rescaled when the max moves (see
        Note [Conditional rescale]); ``l`` gains the block's (thread-partial) row sums."""
        row_scale, do_rescale = self.update(acc_S, is_first=is_first)
        if const_expr(not is_first):
            self.rescale_O(acc_O, row_scale, do_rescale)

    @cute.jit
    def update(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool] = False):
        """The softmax of one K block without touching O: ``acc_S`` becomes P in place, the row
        maxes and ``l`` are updated, and ``(row_scale, do_rescale)`` is returned for
        :meth:`rescale_O`, which the caller applies to O when O is free (a kernel whose previous
        ``P @ V`` is still in flight rescales after it completes). ``do_rescale`` is warp-uniform
        (always true without a rescale threshold); ``row_scale`` is 1 for rows that keep their max.
        With ``is_first`` there is nothing to rescale (the scales are not meaningful).
        With ``round_p``, P is rounded to 16 bits in place before ``l`` sums it (Note [Normalizing by
        the rounded P]); the caller then converts P with :meth:`convert_P`."""
        acc_S_mn = make_acc_mn_view(acc_S)
        blk_max = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            blk_max[r] = quad_allreduce_max(fmax_reduce(acc_S_mn[r, None]))
        scale = cute.make_rmem_tensor(self.num_rows, Float32)
        take_new = cutlass.Boolean(True)
        if const_expr(is_first):
            for r in cutlass.range_constexpr(self.num_rows):
                self.row_max[r] = blk_max[r]
                scale[r] = 1.0
        else:
            conditional = self.rescale_threshold > 0.0
            if const_expr(conditional):
                need = cutlass.Boolean(False)
                for r in cutlass.range_constexpr(self.num_rows):
                    need = need | ((blk_max[r] - self.row_max[r]) * self.scale_log2 > self.rescale_threshold)
                take_new = cute.arch.vote_any_sync(need)
            # Row scales (1 for rows that keep their max), computed branch-free; only the
            # multiplication of O is skipped when the whole warp keeps its maxes.
            for r in cutlass.range_constexpr(self.num_rows):
                old = self.row_max[r]
                new = cute.arch.fmax(old, blk_max[r])
                if const_expr(conditional):
                    new = new if take_new else old
                new_safe = 0.0 if new == -Float32.inf else new
                scale[r] = cute.math.exp2((old - new_safe) * self.scale_log2, fastmath=True)
                self.row_max[r] = new
                self.row_sum[r] = self.row_sum[r] * scale[r]
        # P = 2**(s * scale_log2 - m * scale_log2), with m = 0 for rows that have seen nothing.
        bias = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            m = self.row_max[r]
            bias[r] = (0.0 if m == -Float32.inf else m) * self.scale_log2
        exp2_rows(acc_S_mn, bias, self.scale_log2, self.exp2_emu_frac)
        if const_expr(self.round_p is not None):
            round_to_half_(acc_S, self.round_p)  # P as P @ V will see it (the later conversion is exact)
        for r in cutlass.range_constexpr(self.num_rows):
            self.row_sum[r] = fadd_reduce(acc_S_mn[r, None], init=self.row_sum[r])
        return scale, take_new

    @cute.jit
    def convert_P(self, acc_S: cute.Tensor, rP: cute.Tensor) -> None:
        """P (fp32, after :meth:`update`) rounded into the 16-bit ``rP`` (same layout) for ``P @ V``.
        A kernel whose previous ``P @ V`` still reads ``rP`` calls this once that MMA completed."""
        convert_f32_to_half(acc_S, rP)

    @cute.jit
    def rescale_O(self, acc_O: cute.Tensor, row_scale: cute.Tensor, do_rescale) -> None:
        """``acc_O[r, :] *= row_scale[r]`` (skipped when the warp-uniform ``do_rescale`` is false)."""
        acc_O_mn = make_acc_mn_view(acc_O)
        if const_expr(self.rescale_threshold > 0.0):
            if do_rescale:
                rescale_rows(acc_O_mn, row_scale)
        else:
            rescale_rows(acc_O_mn, row_scale)

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, sink_log2: Optional[cute.Tensor] = None) -> cute.Tensor:
        """Normalize ``acc_O`` by ``l`` (0 for rows with ``l = 0``) and return the per-row natural
        LSE (-inf for rows with ``l = 0``), a register tensor of ``num_rows``.

        ``sink_log2`` (Note [Attention sinks in the softmax]): per row, the sink logit times
        ``log2(e)``; the row's softmax then has one more term with a zero value vector."""
        acc_O_mn = make_acc_mn_view(acc_O)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row_sum = quad_allreduce_sum(self.row_sum[r])
            if const_expr(sink_log2 is None):
                empty = row_sum == 0.0
                inv = 0.0 if empty else cute.arch.rcp_approx(row_sum)
                lse[r] = (
                    -Float32.inf
                    if empty
                    else (self.row_max[r] * self.scale_log2 + cute.math.log2(row_sum, fastmath=True)) * LN_2
                )
            else:
                m = -Float32.inf if self.row_max[r] == -Float32.inf else self.row_max[r] * self.scale_log2
                m_all = cute.arch.fmax(m, sink_log2[r])
                m_safe = 0.0 if m_all == -Float32.inf else m_all
                keys = cute.math.exp2(m - m_safe, fastmath=True)  # 0 for a row that saw no key
                total = row_sum * keys + cute.math.exp2(sink_log2[r] - m_safe, fastmath=True)
                empty = total == 0.0
                inv = 0.0 if empty else keys * cute.arch.rcp_approx(total)
                lse[r] = -Float32.inf if empty else (m_safe + cute.math.log2(total, fastmath=True)) * LN_2
            acc_O_mn[r, None].store(acc_O_mn[r, None].load() * inv)
        return lse
