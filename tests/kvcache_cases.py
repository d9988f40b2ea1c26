"""Shared pieces of the flash_attn_with_kvcache tests (CPU and GPU): random caches in the three
layouts, and an independent reference built from the logical sequences (Note [KV cache calls])."""

from __future__ import annotations

import math

import torch

from fa4.testing import attention_ref


def rotary_tables(seqlen_ro: int, rotary_dim: int, device, dtype=torch.float32):
    """cos / sin ``(seqlen_ro, rotary_dim / 2)`` of the usual inverse-frequency angles."""
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(device=device, dtype=dtype), ang.sin().to(device=device, dtype=dtype)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, interleaved: bool):
    """Rotary embedding as complex multiplication, in float64 (independent of fa4.kvcache._rotary)."""
    half = cos.shape[1]
    xd = x.double()
    if interleaved:
        pairs = xd[..., :2 * half].reshape(*x.shape[:-1], half, 2)
    else:
        pairs = torch.stack((xd[..., :half], xd[..., half:2 * half]), dim=-1)
    z = torch.view_as_complex(pairs.contiguous())
    ang = torch.complex(cos.double()[pos], sin.double()[pos]).unsqueeze(2)  # (b, s, 1, half)
    r = torch.view_as_real(z * ang)
    rot = r.flatten(-2) if interleaved else torch.cat((r[..., 0], r[..., 1]), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def make_case(layout: str, *, batch=3, seqlen_q=1, seqlen_new=1, heads=4, heads_k=2, d=64, dv=None,
              cache_len=96, page_size=16, dtype=torch.bfloat16, device="cpu", seed=0):
    """``(q, k_cache, v_cache, k, v, cache_seqlens, extra, logical)``: ``layout`` 'batched' (a cache
    with two spare rows), 'batch_idx' (rows chosen by ``cache_batch_idx``) or 'paged' (shuffled pages
    through ``block_table``); ``logical(b)`` returns sequence b's cache (``(cache_len, heads_k, d)``
    keys and values) as it is before the call."""
    gen = torch.Generator().manual_seed(seed)
    dv = dv or d

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q = rnd(batch, seqlen_q, heads, d)
    k, v = rnd(batch, seqlen_new, heads_k, d), rnd(batch, seqlen_new, heads_k, dv)
    lens = torch.randint(0, cache_len - seqlen_new + 1, (batch,), generator=gen)
    lens[0] = cache_len - seqlen_new  # one sequence filled to the end
    cache_seqlens = lens.to(torch.int32).to(device)
    extra = {}
    if layout == "batched":
        k_cache, v_cache = rnd(batch + 2, cache_len, heads_k, d), rnd(batch + 2, cache_len, heads_k, dv)

        def logical(b):
            return k_cache[b].clone(), v_cache[b].clone()
    elif layout == "batch_idx":
        rows = torch.randperm(batch + 2, generator=gen)[:batch]
        k_cache, v_cache = rnd(batch + 2, cache_len, heads_k, d), rnd(batch + 2, cache_len, heads_k, dv)
        extra["cache_batch_idx"] = rows.to(torch.int32).to(device)

        def logical(b):
            return k_cache[rows[b]].clone(), v_cache[rows[b]].clone()
    else:
        per_seq = math.ceil(cache_len / page_size)
        num_pages = batch * per_seq + 3
        perm = torch.randperm(num_pages, generator=gen)[:batch * per_seq].reshape(batch, per_seq)
        k_cache, v_cache = rnd(num_pages, page_size, heads_k, d), rnd(num_pages, page_size, heads_k, dv)
        extra["block_table"] = perm.to(torch.int32).to(device)

        def logical(b):
            return (k_cache[perm[b]].reshape(-1, heads_k, d)[:cache_len].clone(),
                    v_cache[perm[b]].reshape(-1, heads_k, dv)[:cache_len].clone())
    before = [logical(b) for b in range(batch)]
    return q, k_cache, v_cache, k, v, cache_seqlens, extra, (lambda b: before[b])


def reference(q, k, v, cache_seqlens, logical, *, rotary=None, interleaved=True, causal=False,
              window_size=(None, None), softcap=0.0, upcast=True, rotate=rotary_ref, capacity=None):
    """Per sequence: the old cache's first ``cache_seqlens[b]`` tokens, then the (rotated) new ones;
    the (rotated) queries attend over them. Returns (out, lse, new_keys) with new_keys the rotated
    ``k`` the cache should now hold. ``rotate``: the rotation (the GPU tests pass fa4's own, so that
    their comparison is of the attention alone; the CPU tests check it)."""
    batch, seqlen_q = q.shape[:2]
    lens = cache_seqlens.long().cpu()
    if rotary is not None:
        cos, sin = rotary
        steps = torch.arange(k.shape[1])
        # flash_attn: a window side of at least the cache's length (``capacity``) is unbounded.
        local = any(w is not None and 0 <= w < (capacity or 2 ** 31) for w in window_size)
        pos_k = (lens[:, None] + steps).to(q.device)
        pos_q = (lens[:, None] + (torch.arange(seqlen_q) if causal or local else torch.zeros(seqlen_q,
                                                                                           dtype=torch.long)))
        q = rotate(q, cos, sin, pos_q.to(q.device), interleaved)
        k = rotate(k, cos, sin, pos_k, interleaved)
    outs, lses = [], []
    win = tuple(None if (w is None or w < 0) else w for w in window_size)
    for b in range(batch):
        kc, vc = logical(b)
        n = int(lens[b])
        keys = torch.cat((kc[:n], k[b]), 0)[None]
        vals = torch.cat((vc[:n], v[b]), 0)[None]
        o, l = attention_ref(q[b:b + 1], keys, vals, causal=causal, window_size=win, softcap=softcap, upcast=upcast)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses), k
