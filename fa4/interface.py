"""The public API: the same calls and argument names as flash-attn-4's ``flash_attn.cute``.

Arguments of that API that fa4 cannot honour yet raise ``NotImplementedError`` naming the argument;
pure performance hints (``num_splits``, ``pack_gqa``, ``min_seqlen_k``) that fa4 does not use give a
one-time warning, never a silent change of results.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fa4 import arch as _arch
from fa4 import ops, validate
from fa4.config import AttnProblem, KernelOptions

_hint_warned: set = set()


def _ignored_hint(name: str, value) -> None:
    if name not in _hint_warned:
        _hint_warned.add(name)
        warnings.warn(f"fa4: {name}={value!r} is a performance hint fa4 does not use; it is ignored "
                      f"(results are unaffected)", stacklevel=3)


_DEFAULT_OPTIONS = KernelOptions()


def _run(problem: AttnProblem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options: Optional[KernelOptions],
         deterministic: bool, return_lse: bool):
    options = options if options is not None else _DEFAULT_OPTIONS
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    need_lse = return_lse or grad
    if torch.compiler.is_compiling():
        out, lse = ops.fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, problem.seqlen_q, problem.seqlen_k,
                              problem.softmax_scale, problem.causal, problem.local, problem.window_left,
                              problem.window_right, problem.softcap, need_lse, deterministic, options.to_str())
        return out, (lse if return_lse else None)
    if grad:
        return ops.FlashAttnFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, problem, options,
                                           deterministic, return_lse, need_lse)
    return ops.forward(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options, need_lse)


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
    num_splits: int = 1,
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
    *,
    kernel_options: Optional[KernelOptions] = None,
):
    """Attention over (batch, seqlen, heads, head_dim) tensors.

    Returns ``(out, lse)``: ``out`` like q; ``lse`` float32 (batch, heads, seqlen_q), the natural-log
    sum of exponentials of each row's scaled scores, when ``return_lse`` (it then takes gradients),
    else None. ``window_size=(left, right)`` limits keys to ``[i + sk - sq - left, i + sk - sq + right]``
    (None = unbounded); ``causal`` sets right = 0 (bottom-right aligned when sq != sk). ``softcap > 0``
    caps scores as ``softcap * tanh(s / softcap)``. ``deterministic`` makes the backward bit-exact
    across runs. ``kernel_options`` (fa4 only): tile sizes, stages, exp2 emulation, rescale threshold,
    forced kernel family.
    """
    if (qv is not None or gather_kv_indices is not None or learnable_sink is not None or score_mod is not None
            or score_mod_bwd is not None or mask_mod is not None or aux_tensors is not None or aux_scalars is not None
            or block_sparse_tensors is not None or block_sparse_tensors_bwd is not None):
        validate.reject_unsupported(qv=qv, gather_kv_indices=gather_kv_indices, learnable_sink=learnable_sink,
                                    score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod,
                                    aux_tensors=aux_tensors, aux_scalars=aux_scalars,
                                    block_sparse_tensors=block_sparse_tensors,
                                    block_sparse_tensors_bwd=block_sparse_tensors_bwd)
    if num_splits != 1:
        _ignored_hint("num_splits", num_splits)
    if pack_gqa is not None:
        _ignored_hint("pack_gqa", pack_gqa)
    _check_flags(kernel_options, deterministic, return_lse)
    problem = validate.check_dense(q, k, v, softmax_scale, causal, window_size, softcap)
    return _run(problem, q, k, v, None, None, None, kernel_options, deterministic, return_lse)


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
    num_splits: int = 1,
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
    *,
    kernel_options: Optional[KernelOptions] = None,
):
    """Attention over packed variable-length sequences.

    q (total_q, heads, head_dim), k/v (total_k, heads_k, head_dim); sequence b is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]`` (int32, length batch + 1); ``max_seqlen_q/k`` are the longest
    lengths (optional: ``None`` or a 0-dim GPU tensor uses the packed token count as an upper bound,
    without a device sync; a 0-dim CPU tensor is read); ``seqused_k`` (int32, (batch,)) optionally
    uses only the first keys of each sequence.
    Returns ``(out, lse)`` with out (total_q, heads, head_dim) and lse float32 (heads, total_q) or None.
    """
    validate.reject_unsupported(qv=qv, seqused_q=seqused_q, gather_kv_indices=gather_kv_indices,
                                page_table=page_table, learnable_sink=learnable_sink, score_mod=score_mod,
                                score_mod_bwd=score_mod_bwd, mask_mod=mask_mod,
                                block_sparse_tensors=block_sparse_tensors, aux_tensors=aux_tensors,
                                aux_scalars=aux_scalars, scheduler_metadata=scheduler_metadata,
                                seqlen_k_per_split=seqlen_k_per_split,
                                disable_scheduler_metadata=disable_scheduler_metadata)
    if num_splits != 1:
        _ignored_hint("num_splits", num_splits)
    if pack_gqa is not None:
        _ignored_hint("pack_gqa", pack_gqa)
    if min_seqlen_k is not None:
        _ignored_hint("min_seqlen_k", min_seqlen_k)
    _check_flags(kernel_options, deterministic, return_lse)
    problem = validate.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                    softmax_scale, causal, window_size, softcap)
    return _run(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, kernel_options, deterministic, return_lse)


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
            if "error" in info:
                lines.append(f"  error: {info['error']}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _cache_state(cfg) -> str:
    from fa4 import jit

    if cfg in jit._memory:
        return "compiled in this process"
    if jit.disk_cache_enabled() and (jit.cache_dir() / f"{jit.entry_name(cfg)}.o").exists():
        return f"on disk ({jit.cache_dir()})"
    return "not compiled yet (compiles on first call)"


def explain(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            seqused_k=None, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
            deterministic=False, return_lse=False, kernel_options: Optional[KernelOptions] = None,
            capability: Optional[tuple] = None) -> Explanation:
    """Which kernels, arch and options a call with these arguments would use, and why.

    Launches nothing. ``capability`` (e.g. ``(9, 0)``) explains for another GPU, or on a machine
    without one (then q/k/v may be CPU or meta tensors of the right shapes and dtypes).
    """
    options = kernel_options if kernel_options is not None else KernelOptions()
    validate.check_options(kernel_options)
    if capability is None:
        capability = _arch.device_capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    varlen = cu_seqlens_q is not None
    with validate.allow_any_device():
        if varlen:
            problem = validate.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            seqused_k, softmax_scale, causal, window_size, softcap)
        else:
            problem = validate.check_dense(q, k, v, softmax_scale, causal, window_size, softcap)
    ex = Explanation(problem, tuple(capability))
    need_bwd = q.requires_grad or k.requires_grad or v.requires_grad
    for direction in ("fwd", "bwd"):
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
                cfg = mod.make_config(problem, options, d.target, return_lse or need_bwd)
            else:
                cfg = mod.make_config(problem, options, d.target, deterministic)
            info["config"] = cfg.describe()
            info["cache"] = _cache_state(cfg)
        except (ImportError, AttributeError) as e:  # kernel module not importable here
            info["error"] = f"cannot build the config: {e}"
        ex.directions[direction] = info
        if d.fallback:
            ex.notes.append(f"{direction}: {d.reason}; running family {d.family}")
    if not need_bwd:
        ex.notes.append("no input requires grad: only the forward runs (bwd shown for reference)")
    return ex
