"""The public API: the same calls and argument names as flash-attn-4's ``flash_attn.cute``.

``score_mod`` / ``score_mod_bwd`` / ``mask_mod`` (user CuTe DSL functions) are described in :mod:`fa4.mods`.
Arguments of that API that fa4 cannot honour yet raise ``NotImplementedError`` naming the argument;
pure performance hints that fa4 does not use (``min_seqlen_k``) give a one-time warning, never a
silent change of results.

``num_splits`` (split-KV): ``None`` (the default) or ``<= 0`` lets fa4 choose from the SM count, the
tiles and ``seqlen_k`` (a decode call with default arguments splits when its tiles alone would leave
SMs idle); ``1`` never splits; ``n > 1`` splits every tile's keys ``n`` ways (at most
:data:`fa4.fwd.common.MAX_SPLITS`). ``pack_gqa``: ``None`` packs the q heads of a kv head into one
tile where that needs fewer tiles (short ``seqlen_q`` with GQA); ``True`` / ``False`` force it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fa4 import arch as _arch
from fa4 import mods, ops, validate
from fa4.config import AttnProblem, KernelOptions

_hint_warned: set = set()


def _ignored_hint(name: str, value) -> None:
    if name not in _hint_warned:
        _hint_warned.add(name)
        warnings.warn(f"fa4: {name}={value!r} is a performance hint fa4 does not use; it is ignored "
                      f"(results are unaffected)", stacklevel=3)


_DEFAULT_OPTIONS = KernelOptions()


_hinted: dict = {}


def _with_hints(problem: AttnProblem, num_splits, pack_gqa) -> AttnProblem:
    """``problem`` with the forward hints (validated; the defaults keep the cached problem, and a
    hinted problem is memoized like the validated one)."""
    if num_splits is None and pack_gqa is None:
        return problem
    key, hinted = None, None
    if not torch.compiler.is_compiling():  # (dynamo does not trace the memo's dataclass values)
        key = (problem, num_splits.__class__, num_splits, pack_gqa.__class__, pack_gqa)
        try:
            hinted = _hinted.get(key)
        except TypeError:  # an unhashable argument: the checks below say what is wrong
            key = None
    if hinted is not None:
        return hinted
    splits = validate.check_num_splits(num_splits)
    if pack_gqa is not None and pack_gqa.__class__ is not bool:
        validate.as_bool("pack_gqa", pack_gqa)
    hinted = problem
    if splits != problem.num_splits or pack_gqa != problem.pack_gqa:
        hinted = dataclasses.replace(problem, num_splits=splits, pack_gqa=pack_gqa)
    if key is not None and len(_hinted) < 4096:
        _hinted[key] = hinted
    return hinted


def _with_block_sparsity(problem: AttnProblem, bst, bst_bwd, mask_mod, aux_tensors, aux_scalars, device,
                         score_mod=None):
    """The mask function and aux tensors of a block-sparse call, and its ``AttnProblem.block_table``:
    the block table appended to the aux tensors, read by :func:`fa4.block_sparse.table_mask` around
    the user's ``mask_mod`` (Note [Block sparsity as a block table] in fa4/block_sparse.py)."""
    from fa4 import block_sparse

    if torch.compiler.is_compiling():
        raise NotImplementedError("block_sparse_tensors under torch.compile: fa4 makes the call's mask function per "
                                  "call, which a traced graph cannot; call it eagerly, or build the block table "
                                  "with fa4.block_sparse.table and read it in your own mask_mod (Note [Block "
                                  "sparsity as a block table])")
    if mask_mod is not None and (problem.causal or problem.local):
        _refuse_mask_with_window()
    if mask_mod is not None:
        mods.require_callable(mask_mod, "mask_mod")
    # As without block sparsity: aux arguments need a user function to read them (the table's own
    # mask function is not one).
    mods.check_arguments(score_mod, mask_mod, aux_tensors, aux_scalars)
    if problem.seqlen_q == 0 or problem.seqlen_k == 0:  # no blocks: the dense call's empty result
        return mask_mod, aux_tensors, ()
    # The user's own aux arguments, checked as without block sparsity (before the table is built).
    mods.aux_signature(aux_tensors, device, aux_scalars)
    block = block_sparse.check(bst, bst_bwd, problem.batch, problem.heads, problem.seqlen_q, problem.seqlen_k, device,
                               problem.head_dim)
    table = block_sparse.table(bst, problem.batch, problem.heads, problem.seqlen_q, problem.seqlen_k, block)
    slot = len(aux_tensors or ())
    fn = block_sparse.table_mask(mask_mod, block[0], block[1], slot, aux_scalars is not None)
    return fn, list(aux_tensors or ()) + [table], (slot, block[0], block[1])


@functools.lru_cache(maxsize=1)
def _dynamo_guards_function_ids() -> bool:
    """Whether this torch's dynamo guards ``id(fn)`` of a function (torch 2.13 does; 2.11's ``id()`` of a
    function installs no guard: measured on the H200 host, v0.31)."""
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (2, 13)
    except (ValueError, IndexError):
        return True


def _unread_max_seqlen_k_valid(v) -> bool:
    """Whether ``max_seqlen_k`` of a call whose k is paged or batched (the value is checked, never
    read) passes the full way's check: None, an int >= 0 (numpy's too), a 0-dim integer tensor (a
    CPU one >= 0). Such a value is left out of the fast path's key (Note [Fast path])."""
    try:
        validate._max_seqlen("max_seqlen_k", v, 0)
    except (TypeError, ValueError):
        return False
    return True


def _flags_key(num_splits, pack_gqa, deterministic, return_lse, kernel_options) -> tuple:
    """The part of a fast-path key from a call's hints, flags and options, with the flags' classes
    (``return_lse=1`` is another signature, which the full way rejects; Note [Fast path])."""
    return (num_splits.__class__, num_splits, pack_gqa.__class__, pack_gqa, deterministic.__class__, deterministic,
            return_lse.__class__, return_lse, kernel_options)


def _fast_try(key: tuple, q, k, v, return_lse: bool, *tensors):
    """Note [Fast path]: ``(result, key)``. ``result`` is the call's ``(out, lse)`` where the
    signature's entry launched it (None otherwise); ``key`` is the key for the full way to record,
    None where the signature is decided, unhashable, or an input requires grad (grad mode or not:
    Note [lse with inputs that require grad])."""
    if q.requires_grad or k.requires_grad or v.requires_grad:  # (Note [lse with inputs that require grad])
        return None, None
    try:
        entry = ops.fast_entry(key)
    except TypeError:  # an unhashable argument: the full way says what is wrong with it
        return None, None
    if entry is None:
        return None, key
    call = entry[0]
    if (call is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
            and q.device.index == torch.cuda.current_device()):
        out, lse = call(q, k, v, *tensors)
        return (out, lse if return_lse else None), None
    return None, None


def _no_empty(aux_scalars):
    """An empty ``aux_scalars`` list or tuple is None (as flash_attn.cute takes it)."""
    return None if isinstance(aux_scalars, (list, tuple)) and not aux_scalars else aux_scalars


def _refuse_mask_with_window():
    raise ValueError("mask_mod with causal=True or a window_size: flash_attn.cute ignores causal and window_size "
                     "when a mask_mod is given; fa4 refuses the pair rather than differ from it silently. Put the "
                     "condition in the mask_mod (its seqlen_info has seqlen_q and seqlen_k; fa4/mods.py)")


def _with_mods(problem: AttnProblem, score_mod, mask_mod, aux_tensors, aux_scalars, device=None,
               score_mod_bwd=None, generated_mask: bool = False) -> AttnProblem:
    """``problem`` with the keys of the user's ``score_mod`` / ``mask_mod`` / ``score_mod_bwd`` and the
    signature of their ``aux_tensors`` (validated; :mod:`fa4.mods`). ``generated_mask``: the
    mask_mod is fa4's block-table mask (it combines with causal / window_size)."""
    if (score_mod is None and mask_mod is None and aux_tensors is None and aux_scalars is None
            and score_mod_bwd is None):
        return problem
    if mask_mod is not None and (problem.causal or problem.local) and not generated_mask:
        _refuse_mask_with_window()
    if torch.compiler.is_compiling():
        # Traced: the functions' keys are a constant of the graph, computed once per trace (Note
        # [User functions under torch.compile] in fa4/mods.py); the aux tensors' signature is read
        # from their (static) dtypes and ranks.
        if not _dynamo_guards_function_ids():
            raise NotImplementedError(
                f"score_mod / mask_mod under torch.compile need torch >= 2.13 (this is {torch.__version__}): older "
                f"dynamo guards a function by its code only, and every @cute.jit function shares the DSL's wrapper "
                f"code, so a compiled callable would keep running the first function it traced when given another "
                f"(another closure, another layer's function). Call fa4 outside the graph (a "
                f"torch.compiler.disable'd function) or upgrade torch (Note [User functions under torch.compile])")
        for fn in (score_mod, mask_mod, score_mod_bwd):
            if fn is not None:
                if inspect.ismethod(fn):
                    raise NotImplementedError("a bound method as score_mod / mask_mod under torch.compile: its "
                                              "instance cannot be a constant of the graph; pass a function or a "
                                              "closure (eager calls take bound methods)")
                id(fn)  # dynamo guards on the object's identity (its code is the DSL's shared jit wrapper)
        mods.check_arguments(score_mod, mask_mod, aux_tensors, aux_scalars)
        if aux_scalars is not None:
            raise NotImplementedError("aux_scalars under torch.compile: fa4's custom op has no slot for runtime "
                                      "scalars; capture the values in the function (compile-time constants) or "
                                      "pass them in a one-element aux tensor")
        aux = mods.aux_signature(aux_tensors, device) if aux_tensors is not None else ()
        if len(aux) > mods.MAX_AUX_COMPILED:
            raise NotImplementedError(f"fa4 passes at most {mods.MAX_AUX_COMPILED} aux_tensors through a "
                                      f"torch.compile graph (its custom op has that many slots); got {len(aux)}")
        sk, mk, bk = mods.split_keys(_constant_keys(score_mod, mask_mod, problem.softcap, bool(aux), score_mod_bwd))
    else:
        sk, mk, aux, bk = mods.check(score_mod, mask_mod, problem.softcap, aux_tensors, aux_scalars, device,
                                     score_mod_bwd)
    if aux_tensors is not None and torch.is_grad_enabled() and any(t.requires_grad for t in aux_tensors):
        _warn_aux_grad()
    return dataclasses.replace(problem, score_mod=sk, mask_mod=mk, aux=aux, score_mod_bwd=bk)


_aux_grad_warned: list = []


def _warn_aux_grad() -> bool:
    """The one-time warning that aux tensors get no gradient. Marked as a constant result (below), so
    under torch.compile dynamo runs it once at trace time instead of breaking the graph on
    ``warnings.warn``."""
    if not _aux_grad_warned:
        _aux_grad_warned.append(True)
        warnings.warn("fa4: an aux tensor requires grad, but aux_tensors get no gradient (as in flash_attn.cute); "
                      "its .grad stays None", stacklevel=5)
    return True


_warn_aux_grad._dynamo_marked_constant = True

def _constant_keys(*args) -> str:
    """The user functions' keys under torch.compile: dynamo calls this once per trace and bakes the
    string into the graph (the functions themselves cannot enter a custom op's schema)."""
    return mods.check_functions(*args)


# ``torch.compiler.assume_constant_result(_constant_keys)``, without importing torch._dynamo with
# fa4 (+1.5 s of import time): the mark it sets (tests/test_mods.py checks that it is that one).
_constant_keys._dynamo_marked_constant = True


def _run(problem: AttnProblem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options: Optional[KernelOptions],
         deterministic: bool, return_lse: bool, seqused_q=None, page_table=None, sink=None, aux=None):
    options = options if options is not None else _DEFAULT_OPTIONS
    grad_qkv = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    grad_sink = torch.is_grad_enabled() and sink is not None and sink.requires_grad
    grad = grad_qkv or grad_sink
    # Note [lse with inputs that require grad]
    want_lse = return_lse or _requires_grad(q, k, v, sink)  # (and a gradient needs such an input)
    forward_only = problem.has_seqused_q or problem.page_size
    # Note [Refusing in the backward]
    refusal = None
    if grad_qkv and forward_only:
        name = "seqused_q" if problem.has_seqused_q else "page_table"
        refusal = NotImplementedError(f"fa4's backward does not support {name} yet (forward only); call the "
                                      f"forward under torch.no_grad() or without inputs that require grad")
    elif grad_qkv and problem.score_mod and not problem.score_mod_bwd:
        refusal = ValueError("the backward through a score_mod needs its derivative, score_mod_bwd (flash_attn.cute's "
                             "convention; fa4/mods.py); or call the forward under torch.no_grad()")
    if refusal is not None and torch.compiler.is_compiling():
        raise refusal  # (the custom op's backward would run without the argument; Note [Refusing in the backward])
    if (grad_qkv and refusal is None and (problem.head_dim_v != problem.head_dim or options.sets_backward()
                      or problem.mask_mod or problem.score_mod) and not torch.compiler.is_compiling()):
        # Only the sm90 backward serves head_dim_v != head_dim, and a backward option (bwd_tile_m,
        # bwd_kv_split, ...) may not fit the problem: ask the backward's family now (its make_config
        # raises), not after the forward has run. (The plan is cached for the backward.)
        ops.check_backward(problem, q.device, options, deterministic)
    if torch.compiler.is_compiling():
        pack = -1 if problem.pack_gqa is None else int(problem.pack_gqa)
        keys = (f"{problem.score_mod}|{problem.mask_mod}|{problem.score_mod_bwd}"
                if problem.score_mod or problem.mask_mod else "")
        slots = list(aux or ()) + [None] * (mods.MAX_AUX_COMPILED - len(aux or ()))
        out, lse = ops.fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, problem.seqlen_q, problem.seqlen_k,
                              problem.softmax_scale, problem.causal, problem.local, problem.window_left,
                              problem.window_right, problem.softcap, want_lse, deterministic, options.to_str(),
                              problem.num_splits, pack, seqused_q, page_table, sink, keys, *slots)
        return out, (lse if want_lse else None)
    if refusal is not None:
        return _refused_in_backward(refusal, problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options,
                                    want_lse, seqused_q, page_table, sink, aux)
    if forward_only:
        if grad_sink:  # only the sink takes a gradient: the kernel without it, composed under autograd
            out, lse = ops.forward(dataclasses.replace(problem, has_sink=False), q, k, v, cu_seqlens_q, cu_seqlens_k,
                                   seqused_k, options, True, seqused_q=seqused_q, page_table=page_table, aux=aux)
            out, lse = ops.compose_sink(out, lse, sink, problem.varlen_q)
        else:
            out, lse = ops.forward(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options, want_lse,
                                   seqused_q=seqused_q, page_table=page_table, sink=sink, aux=aux)
        return out, (lse if want_lse else None)
    if grad:
        return ops.FlashAttnFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, problem, options,
                                           deterministic, want_lse, want_lse, sink, aux)
    out, lse = ops.forward(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options, want_lse, sink=sink,
                           aux=aux)
    return out, (lse if want_lse else None)


# Note [Refusing in the backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A call whose backward fa4 cannot compute (``seqused_q`` or ``page_table``, forward only; a
# score_mod without its ``score_mod_bwd``) runs its forward even when an input requires grad, as
# flash_attn.cute's does (an eval or decode loop left with grad on): the outputs hang on an autograd
# node whose backward raises the reason, so a gradient is never silently missing. A learnable sink's
# own gradient can still be taken alone (``torch.autograd.grad(loss, sink)``; its host composition
# sits on top). While dynamo traces the call, it raises instead (the custom op's backward would run
# without the argument): with fullgraph the trace fails on it; without, dynamo runs the frame
# eagerly, as above.


class _RefusedBackward(torch.autograd.Function):
    """Outputs computed by ``run()``, whose backward raises ``refusal`` (Note [Refusing in the backward])."""

    @staticmethod
    def forward(ctx, refusal, run, q, k, v):
        ctx.refusal = refusal
        out, lse = run()
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        r = ctx.refusal
        raise type(r)(*r.args)  # (a fresh one: a retained graph may run this again)


def _refused_in_backward(refusal, problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options, want_lse,
                         seqused_q, page_table, sink, aux):
    grad_sink = sink is not None and sink.requires_grad
    p = dataclasses.replace(problem, has_sink=False) if grad_sink else problem

    def run():
        return ops.forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options, True, seqused_q=seqused_q,
                           page_table=page_table, sink=None if grad_sink else sink, aux=aux)
    out, lse = _RefusedBackward.apply(refusal, run, q, k, v)
    if grad_sink:
        out, lse = ops.compose_sink(out, lse, sink, problem.varlen_q)
    return out, (lse if want_lse else None)


# Note [lse with inputs that require grad]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# flash_attn.cute returns the lse whenever an input requires grad (a training call computes it for
# the backward anyway), not only with ``return_lse=True``; code written against it (a ring or
# chunked attention merging partial results) reads it without asking. fa4 does the same, grad mode
# or not (so a call under ``torch.no_grad()`` on leaves that require grad computes it too), and its
# lse takes gradients as with ``return_lse=True`` (flash_attn.cute drops them when not asked).


def _requires_grad(q, k, v, sink) -> bool:
    return q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)


# Note [Small head dims]
# ~~~~~~~~~~~~~~~~~~~~~~
# flash_attn.cute takes head dims 8, 16 and 24 (small test models use them); fa4's kernels are
# built for 32-256. A call with a smaller q/k or v head dim (a multiple of 8) runs on copies padded
# with zeros to 32 (zero columns add nothing to Q K^T, and zero columns of V give output columns that
# are cut off), with the default softmax_scale of the real head dim, and returns the real columns
# (contiguous): the same results, through autograd and torch.compile alike, at the cost of the
# copies (a one-time warning; fa4.explain says so). Not for paged K/V, whose whole cache would be
# copied on every call: that raises, as before.


def _pads_head_dims(q, k, v, page_table=None) -> bool:
    """Whether the call runs padded (Note [Small head dims]); anything else goes to the checks."""
    if page_table is not None or not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (q, k, v)):
        return False
    if k.shape[:-1] != v.shape[:-1] or any(t.stride(-1) != 1 for t in (q, k, v)):
        return False  # (the checks name the user's own shapes)
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]

    def ok(x):
        return x % validate.HEAD_DIM_MULTIPLE == 0 and validate.HEAD_DIM_MULTIPLE <= x <= validate.MAX_HEAD_DIM
    return d == dk and ok(d) and ok(dv) and min(d, dv) < validate.MIN_HEAD_DIM


def _padded_call(q, k, v, softmax_scale, call):
    """``call(q, k, v, softmax_scale) -> (out, lse)`` on zero-padded copies, out cut back
    (Note [Small head dims])."""
    d, dv = q.shape[-1], v.shape[-1]
    _warn_padded()
    out, lse = call(*_pad_to_min(q, k, v), softmax_scale if softmax_scale is not None else d ** -0.5)
    return (out[..., :dv].contiguous() if dv < validate.MIN_HEAD_DIM else out), lse


def _warn_padded() -> bool:
    """The one-time warning of Note [Small head dims]; a constant result for dynamo (as
    :func:`_warn_aux_grad`), so a compiled call warns once at trace time without a graph break."""
    if "small_head_dim" not in _hint_warned:
        _hint_warned.add("small_head_dim")
        warnings.warn(f"fa4: head dims below {validate.MIN_HEAD_DIM} run on copies of q, k, v padded with zeros to "
                      f"{validate.MIN_HEAD_DIM} (the same results; Note [Small head dims] in fa4/interface.py)",
                      stacklevel=5)
    return True


_warn_padded._dynamo_marked_constant = True


def _pad_to_min(q, k, v):
    """q, k and v with their head dims zero-padded to at least ``MIN_HEAD_DIM``."""
    pad = torch.nn.functional.pad
    d, dv = q.shape[-1], v.shape[-1]
    to_qk, to_v = max(d, validate.MIN_HEAD_DIM), max(dv, validate.MIN_HEAD_DIM)
    q, k = (pad(t, (0, to_qk - d)) if to_qk > d else t for t in (q, k))
    return q, k, (pad(v, (0, to_v - dv)) if to_v > dv else v)


# Note [Copied layouts]
# ~~~~~~~~~~~~~~~~~~~~~~
# The kernels read q, k and v in place when the last stride is 1, every other stride a multiple of
# 8 elements (16 bytes) and the base 16-byte aligned. flash_attn.cute copies a tensor that is not
# (a transposed view, a slice at an odd offset) into a contiguous one, so a drop-in call must run
# too: fa4 makes the same copy (``clone``, so gradients flow back to the caller's tensor), warns
# once, and fa4.explain names the tensor and why. A call that copies never takes the fast path
# (its signature's entry would launch on the caller's layout). Not a paged K/V cache (``page_table``):
# its whole capacity would be copied on every decode step, so it raises, naming the layout, as Note
# [Small head dims] refuses to pad one; nor flash_attn_with_kvcache's caches, appended in place.


def _misfits(q, k, v, paged: bool = False) -> tuple:
    """``((name, why), ...)`` for those of q, k, v the kernels cannot read in place and the call
    copies (``paged``: q only; a paged cache raises in the checks)."""
    misfit = validate.layout_misfit
    wq, wk, wv = misfit(q), (None if paged else misfit(k)), (None if paged else misfit(v))
    if wq is None and wk is None and wv is None:  # (the per-call path: every full-way call pays this)
        return ()
    return tuple((name, why) for name, why in (("q", wq), ("k", wk), ("v", wv)) if why is not None)


def _copy_misfits(q, k, v, misfits, warn: bool = True):
    """q, k, v with the misfits of Note [Copied layouts] replaced by contiguous copies."""
    if warn:
        _warn_copied()
    names = {name for name, _ in misfits}
    return tuple(t.clone(memory_format=torch.contiguous_format) if name in names else t
                 for name, t in (("q", q), ("k", k), ("v", v)))


def _warn_copied() -> bool:
    """The one-time warning of Note [Copied layouts] (a dynamo constant, as :func:`_warn_padded`)."""
    if "copied_layout" not in _hint_warned:
        _hint_warned.add("copied_layout")
        warnings.warn("fa4: q, k or v is in a layout the kernels cannot read in place (last stride 1, the other "
                      "strides multiples of 8 elements, a 16-byte aligned base): such calls run on contiguous "
                      "copies, as flash_attn.cute's do (fa4.explain names the tensor; Note [Copied layouts] in "
                      "fa4/interface.py)", stacklevel=4)
    return True


_warn_copied._dynamo_marked_constant = True


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, packed_q: bool, return_lse: bool):
    """The host composition of attention sinks (:func:`fa4.ops.compose_sink`), kept for the tests
    and tools that compare it with the kernels' own sink (Note [Attention sinks in the softmax])."""
    out_all, lse_all = ops.compose_sink(out, lse, sink, packed_q)
    return out_all, (lse_all if return_lse else None)


def _check_flags(kernel_options, deterministic, return_lse) -> None:
    if kernel_options is not None and kernel_options.__class__ is not KernelOptions:
        validate.check_options(kernel_options)
    if deterministic.__class__ is not bool:
        validate.as_bool("deterministic", deterministic)
    if return_lse.__class__ is not bool:
        validate.as_bool("return_lse", return_lse)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: Optional[int] = None,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    block_sparse_tensors=None,
    block_sparse_tensors_bwd=None,
    return_lse: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: Optional[int] = None,
    *,
    kernel_options: Optional[KernelOptions] = None,
):
    """Attention over (batch, seqlen, heads, head_dim) tensors.

    Returns ``(out, lse)``: ``out`` contiguous, q's shape with v's head dim; ``lse`` float32 (batch,
    heads, seqlen_q), the natural-log sum of exponentials of each row's scaled scores, when
    ``return_lse`` or an input requires grad (as flash_attn.cute; it takes gradients; Note [lse with
    inputs that require grad]), else None. ``window_size=(left, right)`` limits keys to ``[i + sk -
    sq - left, i + sk - sq + right]`` (None = unbounded); ``causal`` sets right = 0 (bottom-right
    aligned when sq != sk). ``softcap > 0`` caps scores as ``softcap * tanh(s / softcap)``.
    ``deterministic`` makes the backward bit-exact across runs. Head dims 8-24 run padded to 32 (Note
    [Small head dims]). ``num_splits`` / ``pack_gqa``: split-KV and pack GQA (module docstring; results
    stay deterministic). ``kernel_options`` (fa4 only): tile sizes, stages, exp2 emulation, rescale
    threshold, forced kernel family. ``gather_bwd_recompute_p`` / ``gather_bwd_token_chunk`` belong to
    flash-attn-4's ``gather_kv_indices`` backward and, like it, raise ``NotImplementedError`` when set.
    ``score_mod`` / ``score_mod_bwd`` / ``mask_mod``: CuTe DSL functions with flash_attn.cute's
    signatures, traced into the kernels with the tensors of ``aux_tensors`` (:mod:`fa4.mods`).
    """
    if (causal.__class__ is not bool or deterministic.__class__ is not bool or return_lse.__class__ is not bool
            or (pack_gqa is not None and pack_gqa.__class__ is not bool)):
        causal, deterministic, return_lse, pack_gqa = validate.plain_bools(causal, deterministic, return_lse,
                                                                           pack_gqa)
    fast_key = None
    if (qv is None and gather_kv_indices is None and learnable_sink is None and score_mod is None
            and score_mod_bwd is None and mask_mod is None and aux_tensors is None and aux_scalars is None
            and block_sparse_tensors is None and block_sparse_tensors_bwd is None and gather_bwd_recompute_p is False
            and gather_bwd_token_chunk is None and not torch.compiler.is_compiling()):
        # Note [Fast path] in fa4/ops.py (the key is None for arguments that are not tensors)
        dense_key = validate._dense_key(q, k, v, softmax_scale, causal, window_size, softcap)
        if dense_key is not None:
            signature = ("fast", dense_key) + _flags_key(num_splits, pack_gqa, deterministic, return_lse,
                                                         kernel_options)
            done, fast_key = _fast_try(signature, q, k, v, return_lse)
            if done is not None:
                return done
    misfits = _misfits(q, k, v)
    if misfits:  # Note [Copied layouts]
        (q, k, v), fast_key = _copy_misfits(q, k, v, misfits), None
    if _pads_head_dims(q, k, v):  # (the copies made under no_grad do not require grad: ask for the lse)
        lse_too = return_lse is True or _requires_grad(q, k, v, learnable_sink)
        return _padded_call(q, k, v, softmax_scale, lambda q, k, v, scale: flash_attn_func(
            q, k, v, qv, gather_kv_indices, scale, causal, window_size, learnable_sink, softcap, num_splits, pack_gqa,
            deterministic, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars, block_sparse_tensors,
            block_sparse_tensors_bwd, lse_too or return_lse, gather_bwd_recompute_p, gather_bwd_token_chunk,
            kernel_options=kernel_options))
    if (qv is not None or gather_kv_indices is not None
            or gather_bwd_recompute_p is not False or gather_bwd_token_chunk is not None):
        validate.reject_unsupported(qv=qv, gather_kv_indices=gather_kv_indices,
                                    gather_bwd_recompute_p=gather_bwd_recompute_p,
                                    gather_bwd_token_chunk=gather_bwd_token_chunk)
    _check_flags(kernel_options, deterministic, return_lse)
    aux_scalars = _no_empty(aux_scalars)
    problem = _with_hints(validate.check_dense(q, k, v, softmax_scale, causal, window_size, softcap), num_splits,
                          pack_gqa)
    if fast_key is not None:
        ops.set_fast_entry(fast_key, problem, q, k, v, kernel_options if kernel_options is not None else
                           _DEFAULT_OPTIONS, return_lse)
    table = ()
    if block_sparse_tensors is not None or block_sparse_tensors_bwd is not None:
        mask_mod, aux_tensors, table = _with_block_sparsity(problem, block_sparse_tensors, block_sparse_tensors_bwd,
                                                            mask_mod, aux_tensors, aux_scalars, q.device, score_mod)
    problem = _with_mods(problem, score_mod, mask_mod, aux_tensors, aux_scalars, q.device, score_mod_bwd,
                         generated_mask=bool(table))
    if table:
        problem = dataclasses.replace(problem, block_table=table)
    aux = tuple(aux_tensors or ()) + tuple(aux_scalars or ()) if problem.aux else None
    if learnable_sink is not None:
        validate.check_sink(learnable_sink, problem.heads, q.device)
        return _run(dataclasses.replace(problem, has_sink=True), q, k, v, None, None, None, kernel_options,
                    deterministic, return_lse, sink=learnable_sink, aux=aux)
    return _run(problem, q, k, v, None, None, None, kernel_options, deterministic, return_lse, aux=aux)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    min_seqlen_k: Optional[int] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: Optional[int] = None,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_scalars=None,
    return_lse: bool = False,
    scheduler_metadata=None,
    seqlen_k_per_split: Optional[int] = None,
    disable_scheduler_metadata: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: Optional[int] = None,
    *,
    kernel_options: Optional[KernelOptions] = None,
):
    """Attention over variable-length sequences, each side packed, batched or (k/v) paged.

    q: packed ``(total_q, h, d)`` with ``cu_seqlens_q`` (int32, ``batch + 1``: sequence b is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``), or batched ``(batch, seqlen_q, h, d)`` without it. k, v:
    packed ``(total_k, h_k, d)`` with ``cu_seqlens_k``; paged ``(num_pages, page_size, h_k, d)``
    with ``page_table`` (int32, ``(batch, max_pages)``, forward only); or batched ``(batch,
    seqlen_k, h_k, d)``. ``max_seqlen_q/k``: the longest packed lengths (optional: ``None`` or a
    0-dim GPU tensor uses the packed token count as an upper bound, without a device sync; a 0-dim
    CPU tensor is read; ignored for batched / paged sides). ``seqused_q`` / ``seqused_k`` (int32,
    ``(batch,)``) use only the first queries / keys of each sequence (output rows past
    ``seqused_q`` are not written; ``seqused_q`` is forward only).
    Returns ``(out, lse)`` with out contiguous, q's shape with v's head dim, and lse float32 (h,
    total_q) (batched q: (batch, h, seqlen_q)) when ``return_lse`` or an input requires grad, else
    None (as :func:`flash_attn_func`).
    ``disable_scheduler_metadata`` is accepted (fa4 builds none); ``seqlen_k_per_split`` is a
    hint fa4 ignores (a one-time warning).
    """
    if disable_scheduler_metadata.__class__ is not bool:
        (disable_scheduler_metadata,) = validate.plain_bools(disable_scheduler_metadata)
    if (causal.__class__ is not bool or deterministic.__class__ is not bool or return_lse.__class__ is not bool
            or (pack_gqa is not None and pack_gqa.__class__ is not bool)):
        causal, deterministic, return_lse, pack_gqa = validate.plain_bools(causal, deterministic, return_lse,
                                                                           pack_gqa)
    fast_key = None
    if (qv is None and gather_kv_indices is None and learnable_sink is None and score_mod is None
            and score_mod_bwd is None and mask_mod is None and aux_tensors is None and aux_scalars is None
            and block_sparse_tensors is None and scheduler_metadata is None and seqlen_k_per_split is None
            and disable_scheduler_metadata is False and gather_bwd_recompute_p is False
            and gather_bwd_token_chunk is None and min_seqlen_k is None and not torch.compiler.is_compiling()):
        # Note [Fast path] in fa4/ops.py. A paged or batched k does not read max_seqlen_k (checked, not
        # used): a decode loop's growing value is left out of the key once it is a valid int.
        key_max_k = max_seqlen_k
        if cu_seqlens_k is None and _unread_max_seqlen_k_valid(max_seqlen_k):
            key_max_k = None
        varlen_key = validate._varlen_key((q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, key_max_k, seqused_k,
                                           softmax_scale, causal, window_size, softcap, seqused_q, page_table))
        if varlen_key is not None:
            # (a paged call's gather-or-load decision is read per call the full way: FA4_ARCH in its key)
            signature = ("fast", "varlen", varlen_key, os.environ.get("FA4_ARCH") if page_table is not None else None)
            signature += _flags_key(num_splits, pack_gqa, deterministic, return_lse, kernel_options)
            done, fast_key = _fast_try(signature, q, k, v, return_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                       seqused_q, page_table)
            if done is not None:
                return done
    misfits = _misfits(q, k, v, paged=page_table is not None)
    if misfits:  # Note [Copied layouts]
        (q, k, v), fast_key = _copy_misfits(q, k, v, misfits), None
    if _pads_head_dims(q, k, v, page_table):  # (as flash_attn_func's)
        lse_too = return_lse is True or _requires_grad(q, k, v, learnable_sink)
        return _padded_call(q, k, v, softmax_scale, lambda q, k, v, scale: flash_attn_varlen_func(
            q, k, v, qv=qv, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, min_seqlen_k=min_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
            gather_kv_indices=gather_kv_indices, page_table=page_table, softmax_scale=scale, causal=causal,
            window_size=window_size, learnable_sink=learnable_sink, softcap=softcap, num_splits=num_splits,
            pack_gqa=pack_gqa, deterministic=deterministic, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors, aux_tensors=aux_tensors,
            aux_scalars=aux_scalars, return_lse=lse_too or return_lse, scheduler_metadata=scheduler_metadata,
            seqlen_k_per_split=seqlen_k_per_split, disable_scheduler_metadata=disable_scheduler_metadata,
            gather_bwd_recompute_p=gather_bwd_recompute_p, gather_bwd_token_chunk=gather_bwd_token_chunk,
            kernel_options=kernel_options))
    validate.reject_unsupported(qv=qv, gather_kv_indices=gather_kv_indices,
                                block_sparse_tensors=block_sparse_tensors,
                                scheduler_metadata=None if disable_scheduler_metadata is True else scheduler_metadata,
                                gather_bwd_recompute_p=gather_bwd_recompute_p,
                                gather_bwd_token_chunk=gather_bwd_token_chunk)
    if min_seqlen_k is not None:
        _ignored_hint("min_seqlen_k", min_seqlen_k)
    # flash_attn.cute's split-KV scheduling knobs (its Hopper forward never splits): fa4 builds no
    # scheduler metadata, so disabling it is what it does already; the split length is a hint.
    if disable_scheduler_metadata.__class__ is not bool:
        validate.as_bool("disable_scheduler_metadata", disable_scheduler_metadata)
    if seqlen_k_per_split is not None:
        if not isinstance(seqlen_k_per_split, int) or isinstance(seqlen_k_per_split, bool):
            raise TypeError(f"seqlen_k_per_split must be an int or None, got {seqlen_k_per_split!r}")
        if seqlen_k_per_split < 1:
            raise ValueError(f"seqlen_k_per_split must be positive, got {seqlen_k_per_split}")
        _ignored_hint("seqlen_k_per_split", seqlen_k_per_split)
    _check_flags(kernel_options, deterministic, return_lse)
    aux_scalars = _no_empty(aux_scalars)
    problem = _with_hints(validate.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                seqused_k, softmax_scale, causal, window_size, softcap,
                                                seqused_q=seqused_q, page_table=page_table),
                          num_splits, pack_gqa)
    problem = _with_mods(problem, score_mod, mask_mod, aux_tensors, aux_scalars, q.device, score_mod_bwd)
    if fast_key is not None:
        ops.set_fast_entry(fast_key, problem, q, k, v, kernel_options if kernel_options is not None else
                           _DEFAULT_OPTIONS, return_lse, page_table)
    aux = tuple(aux_tensors or ()) + tuple(aux_scalars or ()) if problem.aux else None
    if learnable_sink is not None:
        validate.check_sink(learnable_sink, problem.heads, q.device)
        return _run(dataclasses.replace(problem, has_sink=True), q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                    kernel_options, deterministic, return_lse, seqused_q, page_table, sink=learnable_sink, aux=aux)
    return _run(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, kernel_options, deterministic, return_lse,
                seqused_q, page_table, aux=aux)


# --------------------------------------------------------------------------------------------
# explain()
# --------------------------------------------------------------------------------------------


@dataclass
class Explanation:
    """What a call would run: per direction, the family, target arch, reason, config and cache state."""

    problem: AttnProblem
    capability: tuple
    directions: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        p = self.problem
        lines = [
            f"fa4 {p.dtype} b={p.batch} sq={p.seqlen_q} sk={p.seqlen_k} h={p.heads} h_k={p.heads_k} d={p.head_dim}"
            f" causal={p.causal} local={p.local} softcap={p.softcap} varlen={p.is_varlen}",
            f"device compute capability {self.capability[0]}.{self.capability[1]}",
        ]
        for direction, info in self.directions.items():
            lines.append(f"[{direction}] family={info.get('family')} target={info.get('target')}: {info.get('reason')}")
            if "config" in info:
                lines.append(f"  config: {info['config']}")
                lines.append(f"  cache: {info['cache']}")
            if "splits" in info:
                lines.append(f"  split-KV: {info['splits']} splits per tile, merged by the combine kernel")
            if "error" in info:
                lines.append(f"  error: {info['error']}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _cache_state(cfg) -> str:
    from fa4 import jit

    if cfg in jit._memory:
        return "compiled in this process"
    if not cfg.disk_cacheable:
        return "not compiled yet (user functions: compiled on first call, process memory only)"
    if jit.disk_cache_enabled() and (jit.cache_dir() / f"{jit.entry_name(cfg)}.o").exists():
        return f"on disk ({jit.cache_dir()})"
    return "not compiled yet (compiles on first call)"


def explain(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            seqused_k=None, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
            num_splits=None, pack_gqa=None, seqused_q=None, page_table=None, deterministic=False,
            return_lse=False, kernel_options: Optional[KernelOptions] = None,
            capability: Optional[tuple] = None, score_mod=None, mask_mod=None,
            score_mod_bwd=None, block_sparse_tensors=None) -> Explanation:
    """Which kernels, arch and options a call with these arguments would use, and why.

    Launches nothing. ``capability`` (e.g. ``(9, 0)``) explains for another GPU, or on a machine
    without one (then q/k/v may be CPU or meta tensors of the right shapes and dtypes).
    """
    causal, pack_gqa, deterministic = validate.plain_bools(causal, pack_gqa, deterministic)
    options = kernel_options if kernel_options is not None else KernelOptions()
    validate.check_options(kernel_options)
    if capability is None:
        capability = _arch.capability_of(q.device)
    varlen = any(t is not None for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table))
    misfits = _misfits(q, k, v, paged=page_table is not None)
    if misfits:  # Note [Copied layouts]
        q, k, v = _copy_misfits(q, k, v, misfits, warn=False)
    padded = _pads_head_dims(q, k, v, page_table)
    if padded:  # Note [Small head dims]
        pad_note = (f"head dims {q.shape[-1]} / {v.shape[-1]}: the call runs on copies of q, k, v padded with zeros "
                    f"to {validate.MIN_HEAD_DIM} (the same results; Note [Small head dims])")
        softmax_scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        q, k, v = _pad_to_min(q, k, v)
    with validate.allow_any_device():
        if varlen:
            problem = validate.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            seqused_k, softmax_scale, causal, window_size, softcap,
                                            seqused_q=seqused_q, page_table=page_table)
        else:
            problem = validate.check_dense(q, k, v, softmax_scale, causal, window_size, softcap)
    problem = _with_hints(problem, num_splits, pack_gqa)
    problem = _with_mods(problem, score_mod, mask_mod, None, None, score_mod_bwd=score_mod_bwd)
    ex = Explanation(problem, tuple(capability))
    if problem.batch == 0 or problem.total_q == 0 or problem.seqlen_k == 0:
        ex.notes.append("no kernel runs: the call has no sequences, no queries or no keys (out is zeros, lse -inf), "
                        "the configs above are what a non-empty call of these sizes would take")
    for name, why in misfits:
        ex.notes.append(f"{name}: {why}, so the call runs on a contiguous copy of it, as flash_attn.cute's does "
                        f"(Note [Copied layouts])")
    if padded:
        ex.notes.append(pad_note)
    if block_sparse_tensors is not None:
        from fa4 import block_sparse

        ex.notes.append(block_sparse.explain_note())
    if problem.score_mod or problem.mask_mod:
        ex.notes.append("score_mod / mask_mod: traced into the kernels (every K block); each kernel is compiled "
                        "per function (keyed by its code and the values it reads) and kept in process memory only; "
                        "the backward takes mask_mod, and score_mod with its score_mod_bwd (fa4/mods.py)")
    for side, given, cu in (("q", max_seqlen_q, cu_seqlens_q), ("k", max_seqlen_k, cu_seqlens_k)):
        if cu is not None and cu.shape[0] > 2 and (given is None or (isinstance(given, torch.Tensor)
                                                                      and given.device.type != "cpu")):
            what = ("the sm90 forward then runs the compact varlen grid, its tile, packing and split count judged "
                    "on the average length, and the backward its launch sections" if side == "q" else
                    "the backward then judges its launch sections on the average length; the forward's split "
                    "count reads the bound")
            ex.notes.append(f"max_seqlen_{side} not given (or a GPU tensor): the packed token count stands in for "
                            f"the longest sequence, with no device sync; {what} (the notes below); pass it as an "
                            "int when known (docs/RESULTS.md v0.29, v0.38)")
    fwd_problem = problem
    if problem.page_size:  # the same choice as ops.forward: TMA pages (sm90) or a gather first
        try:
            fwd_family = _arch.resolve("fwd", tuple(capability), options, warn=False).family
        except (ValueError, NotImplementedError):
            fwd_family = None
        if not ops.paged_in_kernel(fwd_family, problem.page_size):
            why = ("the sm90 forward's TMA boxes need a page size that is a multiple of 8"
                   if fwd_family == "sm90" else f"the {fwd_family} forward has no paged loads")
            ex.notes.append(f"page_size={problem.page_size}: pages are gathered into a contiguous K/V before the "
                            f"kernel ({why})")
            fwd_problem = dataclasses.replace(problem, page_size=0)
    need_bwd = q.requires_grad or k.requires_grad or v.requires_grad
    for direction in ("fwd", "bwd"):
        if direction == "bwd" and problem.score_mod and not problem.score_mod_bwd:
            ex.directions[direction] = {"error": "the backward through a score_mod needs score_mod_bwd (without it "
                                                 "the forward runs and its backward raises ValueError; Note [Refusing "
                                                 "in the backward])"}
            continue
        try:
            d = _arch.resolve(direction, tuple(capability), options, warn=False)
        except (ValueError, NotImplementedError) as e:
            ex.directions[direction] = {"error": str(e)}
            continue
        info: dict[str, Any] = {"family": d.family, "target": d.target, "reason": d.reason}
        try:
            import importlib

            mod = importlib.import_module(d.module)
            if direction == "fwd":
                cfg = mod.make_config(fwd_problem, options, d.target, return_lse or need_bwd)
            else:
                cfg = mod.make_config(problem, options, d.target, deterministic)
            info["config"] = cfg.describe()
            info["cache"] = _cache_state(cfg)
            if hasattr(mod, "explain_notes"):  # what the family's choice for this problem costs or means
                ex.notes.extend(f"{direction}: {n}" for n in
                                mod.explain_notes(fwd_problem if direction == "fwd" else problem, options, cfg))
            if getattr(cfg, "split_kv", False):
                from fa4.fwd import common as fwd_common

                info["splits"] = fwd_common.compact_splits(cfg, fwd_problem)
        except (ImportError, AttributeError) as e:  # kernel module not importable here
            info["error"] = f"cannot build the config: {e}"
        ex.directions[direction] = info
        if d.fallback:
            ex.notes.append(f"{direction}: {d.reason}; running family {d.family}")
    if not need_bwd:
        ex.notes.append("no input requires grad: only the forward runs (bwd shown for reference)")
    return ex
