"""``flash_attn_with_kvcache``: FlashAttention-2/3's decode entry point, on fa4's kernels.

One call appends this step's keys and values to a KV cache (in place), applies rotary embeddings to
them and to the queries, and attends over each sequence's cache (Note [KV cache calls]).

Note [KV cache calls]
    flash_attn (2.x, and FlashAttention-3's ``flash_attn_interface``) fuse the append and the rotary
    embedding into the attention kernel. fa4 composes them from what it has:

    1. rotary (``rotary_cos`` / ``rotary_sin``, ``(seqlen_ro, rotary_dim / 2)``): float32 math on the
       first ``rotary_dim`` channels, rounded to the input dtype. The new key ``i`` of sequence ``b``
       sits at position ``cache_seqlens[b] + i``; the queries at the same positions when the call
       is causal or local, else all at ``cache_seqlens[b]`` (flash_attn's convention; as there, a
       window side at least the cache's length counts as unbounded in that test).
       ``rotary_interleaved``: pairs ``(0, 1), (2, 3), ...`` (GPT-J); else ``(i, i + rotary_dim / 2)``
       (GPT-NeoX).
    2. append: ``k`` / ``v`` written into ``k_cache`` / ``v_cache`` at those positions (row
       ``cache_batch_idx[b]``, or the pages ``block_table[b]`` names), one ``index_put_`` each.
    3. attention: :func:`fa4.flash_attn_varlen_func` with batched (or paged) K/V and
       ``seqused_k = cache_seqlens + seqlen_new``: the decode path (one CTA per tile, split-KV, pack
       GQA). Causal and local masks are bottom-right aligned to each sequence's ``seqused_k``. With
       ``cache_batch_idx`` and no ``block_table``, the cache is read as pages of one sequence each
       (``page_table = cache_batch_idx[:, None]``): on Hopper no cache row is copied when the
       cache's length is a multiple of 8; otherwise, and on the sm80 family, the paged path
       gathers the rows it reads (:func:`fa4.ops.forward`, a one-time warning).

    Every argument, the attention call's included (``validate.check_varlen`` and the flags), is
    checked before step 2 writes the caches: a call that raises leaves them as they were.

    The pieces run as separate launches (2 for the append, about 10 small ones for the rotary): more
    host time per step than flash_attn's single kernel, none of it reading device memory on the host.
    No host step reads ``cache_seqlens``, so positions past the cache (or past ``rotary_cos``) are
    not checked here, as in flash_attn: they fail in the device's indexing. Like flash_attn's, the
    call takes no gradients (inference).
"""

from __future__ import annotations

from typing import Optional

import torch

from fa4 import interface, validate
from fa4.config import is_int

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_new(name: str, t: torch.Tensor, cache: torch.Tensor, batch: int, seqlen_new: Optional[int]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dim() != 4 or t.shape[0] != batch or t.shape[2:] != cache.shape[2:] or (
            seqlen_new is not None and t.shape[1] != seqlen_new):
        want = f"({batch}, {seqlen_new if seqlen_new is not None else 'seqlen_new'}, {cache.shape[2]}, {cache.shape[3]})"
        raise ValueError(f"{name} must have shape (batch, seqlen_new, heads_k, head_dim) = {want} to match q and the "
                         f"cache, got {tuple(t.shape)}")
    if t.dtype != cache.dtype:
        raise TypeError(f"{name} must have the cache's dtype {cache.dtype}, got {t.dtype}")
    if t.device != cache.device:
        raise ValueError(f"{name} must be on the cache's device {cache.device}, got {t.device}")


def _check_index(name: str, t, batch: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of shape ({batch},), got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES or t.shape != (batch,):
        raise ValueError(f"{name} must be an int32 (or int64) tensor of shape ({batch},), got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, interleaved: bool):
    """``x (b, s, h, d)`` with its first ``2 * cos.shape[1]`` channels rotated by the angles of
    positions ``pos (b, s)`` (Note [KV cache calls]): each pair times ``cos + i sin`` (gathered for
    those positions only) in float32 complex arithmetic (``x1 cos - x2 sin``, ``x2 cos + x1 sin``),
    rounded to ``x``'s dtype. No state is kept between calls (safe under torch.compile, CUDA graph
    capture and inference mode)."""
    half = cos.shape[1]
    ang = torch.complex(cos[pos].float(), sin[pos].float()).unsqueeze(2)  # (b, s, 1, half)
    xr = x[..., :2 * half].float().contiguous()  # (view_as_complex needs a unit last stride)
    if interleaved:  # pairs (2i, 2i + 1)
        rot = torch.view_as_real(torch.view_as_complex(xr.unflatten(-1, (half, 2))) * ang).flatten(-2)
    else:  # pairs (i, i + half)
        rot = torch.view_as_real(torch.complex(xr[..., :half], xr[..., half:]) * ang).transpose(-1, -2).flatten(-2)
    rot = rot.to(x.dtype)
    return rot if 2 * half == x.shape[-1] else torch.cat((rot, x[..., 2 * half:]), dim=-1)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    page_table: Optional[torch.Tensor] = None,
    pack_gqa: Optional[bool] = None,
    qv: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    attention_chunk: int = 0,
    scheduler_metadata=None,
    sm_margin: int = 0,
    learnable_sink: Optional[torch.Tensor] = None,
    kernel_options=None,
):
    """Attention of ``q`` over a KV cache, after appending ``k`` / ``v`` to it (flash_attn's
    ``flash_attn_with_kvcache``: the same arguments, in the same order; Note [KV cache calls]).

    ``q``: ``(batch, seqlen_q, heads, head_dim)``. ``k_cache`` / ``v_cache``: ``(batch_cache,
    seqlen_cache, heads_k, head_dim[_v])`` (``batch_cache >= batch``), or pages ``(num_pages,
    page_size, heads_k, head_dim[_v])`` with ``block_table`` (int32 ``(batch, max_pages)``;
    FlashAttention-3's name ``page_table`` is accepted too). ``k`` / ``v``: ``(batch, seqlen_new,
    heads_k, head_dim[_v])``, written into the caches in place at positions ``cache_seqlens[b] ...``.
    ``cache_seqlens``: an int or int32 ``(batch,)``, the tokens already in each sequence's cache
    (required with ``k``; without it the whole cache is read). ``cache_batch_idx``: the cache row
    of each sequence (not with ``block_table``). ``rotary_cos`` / ``rotary_sin``: ``(seqlen_ro,
    rotary_dim / 2)``, applied to ``q`` and ``k`` (only with ``k``). ``window_size``: ``-1`` or
    None is unbounded. ``num_splits``: 0 chooses. ``learnable_sink`` (keyword): flash_attn.cute's
    attention sinks, a ``(heads,)`` logit per q head (gpt-oss's decode).

    Returns ``out`` ``(batch, seqlen_q, heads, head_dim_v)``, or ``(out, softmax_lse)`` with
    ``softmax_lse`` float32 ``(batch, heads, seqlen_q)`` when ``return_softmax_lse``. No gradients.
    Every argument is checked before the cache is written. ``cache_leftpad``, ``alibi_slopes`` and
    FlashAttention-3's ``qv``, ``cu_seqlens_q``, ``cu_seqlens_k_new``, ``max_seqlen_q``,
    ``rotary_seqlens``, ``q/k/v_descale``, ``attention_chunk`` and ``scheduler_metadata`` raise
    ``NotImplementedError`` (keyword-only here: FlashAttention-3's positional order differs from
    flash_attn 2's, which this follows); ``sm_margin`` is a hint fa4 ignores (a one-time warning).
    """
    causal, rotary_interleaved, return_softmax_lse, pack_gqa = validate.plain_bools(
        causal, rotary_interleaved, return_softmax_lse, pack_gqa)
    for name, value in (("cache_leftpad", cache_leftpad), ("alibi_slopes", alibi_slopes), ("qv", qv),
                        ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_new", cu_seqlens_k_new),
                        ("max_seqlen_q", max_seqlen_q), ("rotary_seqlens", rotary_seqlens),
                        ("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale),
                        ("scheduler_metadata", scheduler_metadata)):
        if value is not None:
            raise NotImplementedError(f"flash_attn_with_kvcache: {name} is not supported by fa4")
    if attention_chunk:
        raise NotImplementedError("flash_attn_with_kvcache: attention_chunk is not supported by fa4 (pass 0)")
    if sm_margin:
        interface._ignored_hint("sm_margin", sm_margin)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    if block_table is not None and page_table is not None:
        raise ValueError("pass block_table or page_table (its FlashAttention-3 name), not both")
    pages = block_table if block_table is not None else page_table
    paged = pages is not None  # (the user's pages; cache_batch_idx's one-page table comes later)
    batch, seqlen_q = q.shape[0], q.shape[1]
    if (k is None) != (v is None):
        raise ValueError("pass k and v together (the new keys and values to append), or neither")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("pass rotary_cos and rotary_sin together, or neither")
    if rotary_cos is not None and k is None:
        raise ValueError("rotary_cos / rotary_sin need k and v: the rotary embedding applies to the appended keys "
                         "and the queries")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {rotary_interleaved!r}")
    if not isinstance(return_softmax_lse, bool):
        raise TypeError(f"return_softmax_lse must be a bool, got {return_softmax_lse!r}")
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with a paged cache (block_table): the table names each "
                             "sequence's pages")
        if not isinstance(pages, torch.Tensor) or pages.dim() != 2 or pages.shape[0] != batch:
            raise ValueError(f"block_table must be an int32 tensor of shape (batch={batch}, max_pages), got "
                             f"{tuple(pages.shape) if isinstance(pages, torch.Tensor) else type(pages).__name__}")
    elif cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, fewer than q's batch {batch} (pass "
                         f"cache_batch_idx to choose the rows)")
    if k is not None:
        _check_new("k", k, k_cache, batch, None)
        _check_new("v", v, v_cache, batch, k.shape[1])
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required with k / v: it says where each sequence's new tokens go")
    device = q.device
    if cache_seqlens is not None:
        if is_int(cache_seqlens):
            if int(cache_seqlens) < 0:
                raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
            cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=device)
        else:
            _check_index("cache_seqlens", cache_seqlens, batch, device)
    if cache_batch_idx is not None:
        _check_index("cache_batch_idx", cache_batch_idx, batch, device)
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor (seqlen_ro, rotary_dim / 2), got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            if t.device != device:
                raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}, got "
                             f"{tuple(rotary_sin.shape)}")
        if not 0 < 2 * rotary_cos.shape[1] <= min(q.shape[3], k.shape[3]):
            raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {2 * rotary_cos.shape[1]}) must be in "
                             f"(0, head_dim = {q.shape[3]}]")
    # The attention's K/V and lengths (Note [KV cache calls]), known before anything is written.
    k_att, v_att = k_cache, v_cache
    if pages is None:
        if cache_batch_idx is not None:  # one page per sequence: no cache row is copied
            pages = cache_batch_idx.to(torch.int32)[:, None]
        elif k_cache.shape[0] > batch:
            k_att, v_att = k_cache[:batch], v_cache[:batch]
    elif pages.dtype not in _INDEX_DTYPES:
        raise ValueError(f"block_table must be an int32 tensor, got {pages.dtype}")
    page_table_att = None if pages is None else pages.to(torch.int32)
    seqused_k = cache_seqlens
    if cache_seqlens is not None and (k is not None or cache_seqlens.dtype != torch.int32):
        seqused_k = (cache_seqlens + (k.shape[1] if k is not None else 0)).to(torch.int32)
    capacity = k_cache.shape[1] * (pages.shape[1] if paged else 1)
    if rotary_cos is not None and rotary_cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos / rotary_sin have {rotary_cos.shape[0]} positions, fewer than the cache's "
                         f"{capacity} (seqlen_ro >= the cache's length, as flash_attn requires)")
    # Every check of the attention call, before the append mutates the caches.
    validate.check_varlen(q, k_att, v_att, None, None, None, None, seqused_k, softmax_scale, causal, window_size,
                          softcap, page_table=page_table_att)
    if learnable_sink is not None:
        validate.check_sink(learnable_sink, q.shape[2], device)
    validate.check_num_splits(num_splits)
    if pack_gqa is not None:
        validate.as_bool("pack_gqa", pack_gqa)
    interface._check_flags(kernel_options, False, return_softmax_lse)
    # flash_attn's local test (for the queries' rotary positions): a window side at least the
    # cache's length is unbounded.
    local = any(w is not None and w < capacity for w in validate._check_window(window_size))  # None: unbounded

    with torch.no_grad():
        if k is not None:
            pos_k = cache_seqlens[:, None] + torch.arange(k.shape[1], device=device)  # (b, seqlen_new), int64
            if rotary_cos is not None:
                if causal or local:
                    pos_q = cache_seqlens[:, None] + torch.arange(seqlen_q, device=device)
                else:  # every query at cache_seqlens (flash_attn's convention)
                    pos_q = cache_seqlens.long()[:, None].expand(batch, seqlen_q)
                q = _rotary(q, rotary_cos, rotary_sin, pos_q, rotary_interleaved)
                k = _rotary(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved)
            if paged:
                page_size = k_cache.shape[1]
                where = (pages.gather(1, pos_k // page_size), pos_k % page_size)
            else:
                rows = cache_batch_idx if cache_batch_idx is not None else torch.arange(batch, device=device)
                where = (rows[:, None].expand_as(pos_k), pos_k)
            k_cache.index_put_(where, k)
            v_cache.index_put_(where, v)
        out, lse = interface.flash_attn_varlen_func(
            q, k_att, v_att, seqused_k=seqused_k, page_table=page_table_att, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, learnable_sink=learnable_sink, softcap=softcap,
            num_splits=num_splits, pack_gqa=pack_gqa, return_lse=return_softmax_lse, kernel_options=kernel_options)
    return (out, lse) if return_softmax_lse else out
