"""Forward/backward drivers, the torch.library custom ops and autograd.

Two entry paths share the same drivers (:func:`forward`, :func:`backward`):

* eager calls go straight to the drivers through a small ``torch.autograd.Function``: a custom op
  costs tens of microseconds of dispatcher time per call, more than the whole kernel of a decode
  step;
* under ``torch.compile`` the calls are the custom ops ``fa4::fwd`` / ``fa4::bwd``, with fake
  (meta) implementations and registered autograd, so graphs trace with no graph break.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch

from fa4 import arch as _arch
from fa4 import block_sparse
from fa4 import validate
from fa4.config import AttnProblem, KernelOptions

_nan_fill = os.environ.get("FA4_DEBUG_NAN_FILL", "0") == "1"


def set_nan_fill(enabled: bool) -> None:
    """Allocate every output NaN-filled (tests: an element a kernel forgets to write then fails)."""
    global _nan_fill
    _nan_fill = bool(enabled)


def _empty(shape, dtype, device) -> torch.Tensor:
    if _nan_fill:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``t``'s shape, dtype and device (Note [Contiguous outputs]). Through
    ``empty_like``, not ``empty(shape, dtype=, device=)``: 2.3 against 4.9 us of host time per call
    on a 2-core CPU, on the latency rows' path (RESULTS v0.41)."""
    if _nan_fill:
        return torch.full_like(t, float("nan"), memory_format=torch.contiguous_format)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# Note [Contiguous outputs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# ``out`` and the gradients are contiguous whatever the inputs' strides, as flash_attn.cute
# allocates them (and as the custom ops' fake implementations say, which torch.compile's generated
# code checks against the real tensors' strides). ``empty_like`` kept a permuted q's strides (q of
# SDPA's (b, h, s, d) memory passed as a transposed view), so ``out.view(b, s, h * d)`` failed.


def _dispatch(direction: str, device: torch.device, options: KernelOptions) -> _arch.Dispatch:
    return _arch.resolve(direction, _arch.capability_of(device), options)


def _family_module(d: _arch.Dispatch):
    import importlib

    return importlib.import_module(d.module)


# (direction, problem, options, device, flag) -> (family module, config): the dispatch and tuning
# decisions of a call signature, made once (host overhead is part of the product). ``flag``: need_lse
# for the forward, deterministic for the backward. FA4_ARCH is read when a signature is first seen.
class _Plans(dict):
    """The plans; clearing them clears the fast path's entries too (Note [Fast path]): a test that
    changes a tuning constant and clears the plans sees the new choice on both paths."""

    def clear(self) -> None:
        super().clear()
        _fast.clear()


_plans: dict = _Plans()
_fast: dict = {}  # Note [Fast path]: ("fast", ...) keys -> (call, need_lse) or (None, None)
_FAST_LIMIT = 8192


def _plan(direction: str, problem: AttnProblem, options: KernelOptions, device: torch.device, flag: bool):
    key = (direction, problem, options, device, flag)
    plan = _plans.get(key)
    if plan is None:
        d = _dispatch(direction, device, options)
        mod = _family_module(d)
        cfg = mod.make_config(problem, options, d.target, flag)
        plan = _plans[key] = (mod, cfg)
    return plan


# Note [Fast path]
#     A forward call (flash_attn_func or flash_attn_varlen_func) without gradients, user functions,
#     sinks or other extras, whose signature (fa4.validate's validation key: shapes, strides, dtypes,
#     devices, scalars, the metadata of cu_seqlens / seqused / page table but not their values; the
#     hints, options and return_lse; a paged or batched k's max_seqlen_k, which nothing reads, left
#     out, so a decode loop's growing value keeps its entry) was seen before, skips the layers between
#     the API and the kernel: the
#     signature's launch (its family's ``prepare_launch``: the compiled kernel through the memory
#     cache, the same arguments ``run`` would pass) is kept in ``_fast`` (cleared with ``_plans``), and
#     a call checks only what can change with the same
#     signature: the pointers' 16-byte alignment, the current device, whether an input requires grad. A config with
#     per-call state (the dynamic scheduler's claims counter, split-KV's partials) calls its family's
#     ``run`` instead of a prepared launch. The first call of a signature, and the signatures the fast
#     path does not take (aux tensors, block sparsity, a sink; a copy or view kernel_ready would make;
#     an empty problem), go the full way; (None, None) marks a signature that never will.
#     Host time per call on a 2-core CPU (launches stubbed): dense b1 s128 / s_k 512 h16 d128, 22-30 us
#     the full way, 8-10 us the fast one; a paged decode step (b8, 32 / 8 heads, 16-row pages, one
#     split) 97-113 against 39-40 us (RESULTS v0.32). ``tools/host_cpu.py`` times the fast path this
#     way on any trees, interleaved (v0.41: 7.5-8.0 us, after an allocation had cost 3-4 us more).


def fast_entry(key) -> Optional[tuple]:
    """The ("fast", ...) entry of a signature: (``call(q, k, v) -> (out, lse)``, need_lse), (None,
    None) where the fast path does not take it, or None when not yet decided."""
    return _fast.get(key)


def set_fast_entry(key, problem: AttnProblem, q, k, v, options: KernelOptions, need_lse: bool,
                   page_table: Optional[torch.Tensor] = None) -> None:
    """Decide (once) whether the signature ``key`` takes the fast path (Note [Fast path]). Left
    undecided where the reason can change: fake tensors (tracing), a GPU other than the current one."""
    dev = q.device
    if validate.is_fake(q) or not (dev.type == "cuda" or validate._any_device) or (
            (dev.index if dev.index is not None else torch.cuda.current_device()) != torch.cuda.current_device()):
        return
    entry = (None, None)
    if (q.numel() and problem.batch and problem.seqlen_k and not problem.block_table and not problem.aux
            and not problem.has_sink
            and all(validate.kernel_ready(t) is t for t in (_as4d(q, problem.varlen_q), _as4d(k, problem.varlen_k),
                                                           _as4d(v, problem.varlen_k)))
            and k.shape[-3] > 0
            and (page_table is None or (page_table.stride(-1) == 1
                                        and paged_in_kernel(_dispatch("fwd", dev, options).family,
                                                            problem.page_size)))):
        entry = (_fast_call(problem, q, options, need_lse), need_lse)
    if len(_fast) >= _FAST_LIMIT:
        _fast.clear()
    _fast[key] = entry


def _fast_call(problem: AttnProblem, q, options: KernelOptions, need_lse: bool):
    """``call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, seqused_q, page_table) -> (out, lse)``
    of a signature on the fast path: :func:`_forward`'s steps without its checks (the outputs
    allocated the same way), then the family's prepared launch, or its ``run`` (varlen, paged and
    seqused calls, and configs with per-call state: the dynamic scheduler's claims counter,
    split-KV's partials and combine)."""
    mod, cfg = _plan("fwd", problem, options, q.device, need_lse)
    vq, vk = problem.varlen_q, problem.varlen_k
    dense = not (vq or vk or problem.page_size or problem.has_seqused_k or problem.has_seqused_q)
    prepare = getattr(mod, "prepare_launch", None)
    launch = prepare(cfg, problem, q.device) if prepare is not None and dense else None

    def call(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, seqused_q=None, page_table=None):
        if vq:
            q = q.unsqueeze(0)
        if vk:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        out, lse = _outputs(problem, q, need_lse)
        if launch is not None:
            launch(q, k, v, out, lse)
        else:
            mod.run(cfg, problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, seqused_q=seqused_q,
                    page_table=page_table)
        if vq:
            return out.squeeze(0), (lse.squeeze(0) if lse is not None else None)
        return out, lse
    return call


def _outputs(problem: AttnProblem, q: torch.Tensor, need_lse: bool):
    """The forward's ``(out, lse)`` for a 4-D ``q`` (varlen: (1, total, h, d)): ``out`` contiguous,
    q's shape with ``head_dim_v`` (Note [Contiguous outputs]), ``lse`` float32 (b, h, s_q) or None;
    NaN-filled in the tests' mode."""
    out = _empty_like(q) if problem.head_dim_v == problem.head_dim else _empty(
        q.shape[:-1] + (problem.head_dim_v,), q.dtype, q.device)
    lse = _empty((q.shape[0], q.shape[2], q.shape[1]), torch.float32, q.device) if need_lse else None
    return out, lse


def _as4d(t: Optional[torch.Tensor], varlen: bool) -> Optional[torch.Tensor]:
    return t.unsqueeze(0) if (varlen and t is not None) else t


def _as_user(t: Optional[torch.Tensor], varlen: bool) -> Optional[torch.Tensor]:
    return t.squeeze(0) if (varlen and t is not None) else t


def forward(problem: AttnProblem, q: torch.Tensor, *args, **kwargs):
    """:func:`_forward` with ``q``'s GPU current (Note [Device guard] in fa4/arch.py)."""
    with _arch.device_guard(q):
        return _forward(problem, q, *args, **kwargs)


def _forward(problem: AttnProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
             seqused_k: Optional[torch.Tensor], options: KernelOptions, need_lse: bool,
             seqused_q: Optional[torch.Tensor] = None, page_table: Optional[torch.Tensor] = None,
             sink: Optional[torch.Tensor] = None, aux: Optional[tuple] = None):
    """Run the forward on the tensors as the user passed them ((b, s, h, d), or (total, h, d) for
    a packed side, which the kernels see as (1, total, h, d); paged k/v (num_pages, page_size, h_k,
    d)). Returns (out, lse); lse is (b, h, s_q) (packed q: (h, total_q)) float32, or None when not
    needed. ``sink`` ((h,), with ``problem.has_sink``): learnable sink logits, applied in the
    kernel's softmax (Note [Attention sinks in the softmax] in fa4/softmax.py) or, with split-KV, by
    the combine; lse then includes the sink. ``aux``: the aux tensors of the user's score_mod /
    mask_mod (:mod:`fa4.mods`; sm90 family)."""
    varlen = problem.varlen_q
    if sink is not None:
        need_lse = True  # the host composition of a split run, and the gradient, read it
        sink = sink.float().contiguous()
    if page_table is not None and page_table.stride(-1) != 1:
        page_table = page_table.contiguous()  # (b, 1) tables may carry any stride
    if (page_table is not None and problem.batch
            and not paged_in_kernel(_dispatch("fwd", q.device, options).family, problem.page_size)):
        k, v, page_table = _gather_pages(problem, k, v, page_table)
        problem = dataclasses.replace(problem, page_size=0)
    q = _as4d(q, varlen)
    k, v = _as4d(k, problem.varlen_k), _as4d(v, problem.varlen_k)
    if 1 in q.shape:  # size-1 dims may carry any stride: see validate.kernel_ready
        q = validate.kernel_ready(q)
    if 1 in k.shape:
        k, v = validate.kernel_ready(k), validate.kernel_ready(v)
    out, lse = _outputs(problem, q, need_lse)
    if out.numel() == 0:
        pass
    elif problem.seqlen_k == 0 or k.shape[1] == 0 or problem.batch == 0:  # (no sequences: rows of none)
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
    else:
        mod, cfg = _plan("fwd", problem, options, q.device, need_lse)
        if problem.block_table and not getattr(cfg, "block_skip", ()):
            block_sparse.warn_dense("forward", type(cfg).__name__)
        mod.run(cfg, problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, seqused_q=seqused_q,
                page_table=page_table, sink=sink, **({"aux": aux} if aux else {}))
        return _as_user(out, varlen), _as_user(lse, varlen)
    # No kernel ran (no queries or no keys): with a sink, lse = sink and out = 0.
    out, lse = _as_user(out, varlen), _as_user(lse, varlen)
    return compose_sink(out, lse, sink, varlen) if sink is not None else (out, lse)


def compose_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, packed_q: bool):
    """Attention sinks applied to a finished ``out`` and ``lse`` over the keys alone (the host
    path: a call with no keys; the tests' reference): ``lse' = logaddexp(lse, sink)``, ``out' = out *
    exp(lse - lse')``; ``out`` is then rounded twice, the kernels' own sink once. A row that sees no
    key gets ``out' = 0``, ``lse' = sink``. Differentiable (autograd through the two steps)."""
    s = sink.float()
    s = s[:, None] if packed_q else s[None, :, None]  # lse: (h, total_q) or (b, h, s_q)
    lse_all = torch.logaddexp(lse, s)
    # A row with no key and a -inf sink: lse_all = -inf, and out stays 0 (not exp(-inf + inf) = NaN).
    scale = torch.where(lse_all == -torch.inf, torch.zeros_like(lse_all), torch.exp(lse - lse_all))
    scale = scale.transpose(0, 1) if packed_q else scale.transpose(1, 2)  # -> out's (.., s, h)
    return (out.float() * scale.unsqueeze(-1)).to(out.dtype), lse_all


def sink_grad(sink: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
              dlse: Optional[torch.Tensor], packed_q: bool) -> torch.Tensor:
    """``dsink`` of a forward whose ``lse`` includes the sink (Note [Attention sinks in the
    softmax]): ``sum over batch and rows of p_sink * (dlse - D)``, ``p_sink = exp(sink - lse)``,
    ``D = rowsum(dout * out)`` in float32."""
    d = (dout.float() * out.float()).sum(-1)  # (b, s, h) or (total, h)
    d = d.transpose(0, 1) if packed_q else d.transpose(1, 2)  # -> lse's layout
    s = sink.float()
    s = s[:, None] if packed_q else s[None, :, None]
    p = torch.where(lse == -torch.inf, torch.zeros_like(lse), torch.exp(s - lse))
    g = -d if dlse is None else dlse - d
    dims = (1,) if packed_q else (0, 2)
    return (p * g).sum(dims).to(sink.dtype)


_gather_warned = [False]


def paged_in_kernel(family: Optional[str], page_size: int) -> bool:
    """Whether forward family ``family`` loads pages of ``page_size`` rows itself (the sm90 family,
    page sizes of whole 8-row TMA boxes); otherwise :func:`forward` gathers them first and
    fa4.explain() says so."""
    from fa4.fwd import sm90

    return family == "sm90" and sm90.paged_supported(page_size)


def _gather_pages(problem: AttnProblem, k, v, page_table):
    """Page sizes the sm90 kernel cannot load by TMA (not a multiple of 8), or a family without
    paged loads (sm80): gather the pages of every sequence into a batched ``(b, max_pages *
    page_size, h_k, d)`` K/V first. This copies the page table's whole capacity (``b * max_pages``
    pages, whatever ``seqused_k`` is: reading the lengths would sync the device), so it can cost
    several times the kernel's own traffic; a one-time warning says so, fa4.explain() too. Indices
    outside the cache are clamped to a real page (the TMA path reads zeros there instead); their
    rows are past ``seqused_k`` unless the table is wrong."""
    import warnings

    if not _gather_warned[0]:
        _gather_warned[0] = True
        warnings.warn(f"fa4: page_size={problem.page_size} is not loaded by the kernel (the sm90 forward's TMA loads "
                      f"page sizes that are multiples of 8; the sm80 forward has no paged loads); the whole page "
                      f"table is gathered into a contiguous K/V first (an extra copy of its capacity per call)",
                      stacklevel=4)
    num_pages = k.shape[0]
    idx = page_table.long().clamp(0, num_pages - 1)
    b, max_pages = idx.shape
    kk = k[idx].reshape(b, max_pages * k.shape[1], *k.shape[2:])
    vv = v[idx].reshape(b, max_pages * v.shape[1], *v.shape[2:])
    return kk, vv, None


def check_backward(problem: AttnProblem, device: torch.device, options: KernelOptions, deterministic: bool) -> None:
    """Raise now what the backward of ``problem`` would raise (its family's make_config), e.g. the
    sm80 family's NotImplementedError for head_dim_v != head_dim."""
    with _arch.device_guard(device):  # make_config reads the device's SM count (Note [Device guard])
        _plan("bwd", problem, options, device, deterministic)


def backward(problem: AttnProblem, dout, q, *args, **kwargs):
    """:func:`_backward` with ``q``'s GPU current (Note [Device guard] in fa4/arch.py)."""
    with _arch.device_guard(q):
        return _backward(problem, dout, q, *args, **kwargs)


def _backward(problem: AttnProblem, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
              options: KernelOptions, deterministic: bool, aux: Optional[tuple] = None):
    """Gradients (dq, dk, dv) of the attention forward, tensors in the user's layout as in
    :func:`forward`. Layout fix-ups of the inputs (an expanded ``dout``...) are the launcher's."""
    vq, vk = problem.varlen_q, problem.varlen_k
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    if q.numel() == 0 or k.numel() == 0 or problem.batch == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return dq, dk, dv
    mod, cfg = _plan("bwd", problem, options, q.device, deterministic)
    if problem.block_table and not getattr(cfg, "block_skip", ()):
        block_sparse.warn_dense("backward", type(cfg).__name__)
    mod.run_backward(
        cfg, problem, _as4d(dout, vq), _as4d(q, vq), _as4d(k, vk), _as4d(v, vk), _as4d(out, vq), _as4d(lse, vq),
        _as4d(dlse, vq), cu_seqlens_q, cu_seqlens_k, seqused_k, _as4d(dq, vq), _as4d(dk, vk), _as4d(dv, vk),
        **({"aux": aux} if aux else {}))
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Eager autograd
# --------------------------------------------------------------------------------------------


class FlashAttnFunction(torch.autograd.Function):
    """Eager path: q/k/v as the user gave them (4D dense or 3D varlen)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, problem: AttnProblem,
                options: KernelOptions, deterministic: bool, return_lse: bool, need_lse: bool, sink=None, aux=None):
        out, lse = forward(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options, need_lse, sink=sink,
                           aux=aux)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sink)
        ctx.problem, ctx.options, ctx.deterministic, ctx.return_lse = problem, options, deterministic, return_lse
        ctx.aux = aux  # a mask_mod's aux tensors (no gradient)
        ctx.set_materialize_grads(False)
        return out, (lse if return_lse else None)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k, seqused_k, sink = ctx.saved_tensors
        p = ctx.problem
        if dout is None:
            dout = torch.zeros_like(out)
        # With a sink, lse includes it: the kernels' P and D are the sink-inclusive ones.
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):  # not when only the sink takes a gradient
            dq, dk, dv = backward(p, dout, q, k, v, out, lse, dlse, cu_q, cu_k, seqused_k, ctx.options,
                                  ctx.deterministic, aux=ctx.aux)
        dsink = None
        if sink is not None and ctx.needs_input_grad[11]:
            dsink = sink_grad(sink, out, dout, lse, dlse, p.varlen_q)
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsink, None


# --------------------------------------------------------------------------------------------
# Custom ops for torch.compile
# --------------------------------------------------------------------------------------------


def _problem_from_op_args(q, k, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                          local, window_left, window_right, softcap, num_splits: int = 0,
                          pack_gqa: int = -1, cu_seqlens_k=None, seqused_q=None, page_table=None,
                          v=None, keys: str = "", aux: tuple = ()) -> AttnProblem:
    """The AttnProblem of a custom-op call (the interface validated it before tracing). Each side
    is packed (its cu_seqlens given) or batched; ``page_table``: paged K/V; ``keys`` / ``aux``: the
    user functions' keys (``fa4.mods.split_keys``) and aux tensors."""
    varlen_q = cu_seqlens_q is not None
    varlen_k = cu_seqlens_k is not None
    if varlen_q:
        batch, (total_q, hq, d) = cu_seqlens_q.shape[0] - 1, q.shape
        sq = max_seqlen_q
    else:
        batch, sq, hq, d = q.shape
        total_q = batch * sq
    hk = k.shape[-2]
    page_size = 0
    if varlen_k:
        total_k, sk = k.shape[0], max_seqlen_k
    elif page_table is not None:
        page_size = k.shape[1]
        total_k, sk = k.shape[0] * page_size, page_table.shape[1] * page_size
    else:
        total_k, sk = k.shape[0] * k.shape[1], k.shape[1]
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    dv = d if v is None else v.shape[-1]
    return AttnProblem(dtype, batch, sq, sk, hq, hk, d, dv, softmax_scale, causal, local, window_left, window_right,
                       softcap, varlen_q=varlen_q, varlen_k=varlen_k, has_seqused_k=seqused_k is not None,
                       total_q=total_q, total_k=total_k, num_splits=num_splits,
                       pack_gqa=None if pack_gqa < 0 else bool(pack_gqa), has_seqused_q=seqused_q is not None,
                       page_size=page_size, **_user_fields(keys, aux))


def _user_fields(keys: str, aux: tuple) -> dict:
    """AttnProblem fields of the user functions a custom op carries (fa4/mods.py)."""
    if not keys:
        return {}
    from fa4 import mods

    sk, mk, bk = mods.split_keys(keys)
    return dict(score_mod=sk, mask_mod=mk, score_mod_bwd=bk, aux=mods.aux_signature(aux, None) if aux else ())


def _aux_of(*slots) -> tuple:
    """The aux tensors in a custom op's slots (the used slots come first)."""
    return tuple(t for t in slots if t is not None)


@torch.library.custom_op("fa4::fwd", mutates_args=(), device_types="cuda")
def fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
           cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
           max_seqlen_k: int, softmax_scale: float, causal: bool, local: bool, window_left: int, window_right: int,
           softcap: float, need_lse: bool, deterministic: bool, options: str, num_splits: int = 0,
           pack_gqa: int = -1, seqused_q: Optional[torch.Tensor] = None,
           page_table: Optional[torch.Tensor] = None,
           learnable_sink: Optional[torch.Tensor] = None, user_keys: str = "", aux0: Optional[torch.Tensor] = None,
           aux1: Optional[torch.Tensor] = None, aux2: Optional[torch.Tensor] = None,
           aux3: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom-op form of the forward; lse is an empty tensor when ``need_lse`` is False;
    ``pack_gqa`` -1 / 0 / 1 = None / False / True; ``learnable_sink`` as :func:`forward`'s sink;
    ``user_keys`` / ``aux0``-``aux3``: the user functions' keys and aux tensors (fa4/mods.py;
    ``mods.MAX_AUX_COMPILED`` slots)."""
    # A traced graph cannot see pointers: a misaligned q / k / v is copied here, as the eager call
    # copies it (Note [Copied layouts] in fa4/interface.py; the backward's launcher does the same).
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        q, k, v = validate.kernel_ready(q), validate.kernel_ready(k), validate.kernel_ready(v)
    aux = _aux_of(aux0, aux1, aux2, aux3)
    p = _problem_from_op_args(q, k, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              local, window_left, window_right, softcap, num_splits, pack_gqa, cu_seqlens_k,
                              seqused_q, page_table, v, user_keys, aux)
    if learnable_sink is not None:
        p = dataclasses.replace(p, has_sink=True)
    out, lse = forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, KernelOptions.from_str(options), need_lse,
                       seqused_q=seqused_q, page_table=page_table, sink=learnable_sink, aux=aux or None)
    if not need_lse:
        lse = None
    return out, (lse if lse is not None else q.new_empty((0,), dtype=torch.float32))


@fwd_op.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
              local, window_left, window_right, softcap, need_lse, deterministic, options, num_splits=0,
              pack_gqa=-1, seqused_q=None, page_table=None, learnable_sink=None, user_keys="", aux0=None, aux1=None,
              aux2=None, aux3=None):
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    if not need_lse:
        return out, q.new_empty((0,), dtype=torch.float32)
    if cu_seqlens_q is not None:
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("fa4::bwd", mutates_args=(), device_types="cuda")
def bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
           cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
           max_seqlen_k: int, softmax_scale: float, causal: bool, local: bool, window_left: int, window_right: int,
           softcap: float, deterministic: bool, options: str, user_keys: str = "",
           aux0: Optional[torch.Tensor] = None, aux1: Optional[torch.Tensor] = None,
           aux2: Optional[torch.Tensor] = None,
           aux3: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    aux = _aux_of(aux0, aux1, aux2, aux3)
    p = _problem_from_op_args(q, k, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              local, window_left, window_right, softcap, cu_seqlens_k=cu_seqlens_k, v=v,
                              keys=user_keys, aux=aux)
    return backward(p, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                    KernelOptions.from_str(options), deterministic, aux=aux or None)


@bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, local, window_left, window_right, softcap, deterministic, options, user_keys="",
              aux0=None, aux1=None, aux2=None, aux3=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, seqused_k, max_sq, max_sk, scale, causal, local, wl, wr, softcap, need_lse,
     deterministic, options, _num_splits, _pack_gqa, _seqused_q, _page_table, sink, user_keys, *aux) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seqused_k, sink, *aux)
    ctx.scalars = (max_sq, max_sk, scale, causal, local, wl, wr, softcap, deterministic, options, user_keys)
    ctx.return_lse = need_lse


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, seqused_k, sink, *aux = ctx.saved_tensors
    max_sq, max_sk, scale, causal, local, wl, wr, softcap, deterministic, options, user_keys = ctx.scalars
    dq = dk = dv = None
    if any(ctx.needs_input_grad[:3]):  # not when only the sink takes a gradient
        dq, dk, dv = bwd_op(dout, q, k, v, out, lse, dlse, cu_q, cu_k, seqused_k, max_sq, max_sk, scale, causal,
                            local, wl, wr, softcap, deterministic, options, user_keys, *aux)
    # With a sink the saved lse includes it (the op's forward always computes it then).
    dsink = None
    if sink is not None and ctx.needs_input_grad[21]:
        dsink = sink_grad(sink, out, dout, lse, dlse if ctx.return_lse else None, cu_q is not None)
    return (dq, dk, dv) + (None,) * 18 + (dsink,) + (None,) * 5  # (the user keys, the aux slots)


fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
