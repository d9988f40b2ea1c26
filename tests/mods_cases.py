"""User score / mask functions for the tests, each with its torch twin (fa4.testing.attention_ref's
``score_fn`` / ``mask_fn``), written as a flash_attn.cute user would write them.

A twin gets broadcastable int64 index tensors ``b (B,1,1,1)``, ``h (1,H,1,1)``, ``q (1,1,Sq,1)``,
``kv (1,1,1,Sk)`` of one sequence, so ``q.shape[2]`` / ``kv.shape[3]`` are its lengths.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


def identity():
    import cutlass.cute as cute

    @cute.jit
    def identity(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return scores

    return identity, lambda s, b, h, q, kv: s


def alibi(slope: float):
    """A per-head linear bias on the distance to the bottom-right diagonal (uses seqlen_info)."""
    import cutlass.cute as cute

    @cute.jit
    def alibi(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        dist = q_idx + (seqlen_info.seqlen_k - seqlen_info.seqlen_q) - kv_idx
        return scores - (h + 1).to(cute.Float32) * slope * dist.to(cute.Float32)

    def twin(s, b, h, q, kv):
        dist = q + (kv.shape[3] - q.shape[2]) - kv
        return s - (h + 1).float() * slope * dist.float()

    return alibi, twin


def tanh_cap(cap: float):
    """The softcap as a score_mod (flash_attn.cute builds its softcap this way)."""
    import cutlass.cute as cute

    @cute.jit
    def tanh_cap(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return cute.math.tanh(scores * (1.0 / cap), fastmath=True) * cap

    return tanh_cap, lambda s, b, h, q, kv: cap * torch.tanh(s / cap)


def batch_bias(step: float):
    """A bias per sequence (varlen: the batch index is the sequence's)."""
    import cutlass.cute as cute

    @cute.jit
    def batch_bias(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return scores + b.to(cute.Float32) * step

    return batch_bias, lambda s, b, h, q, kv: s + b.float() * step


def causal_mask():
    """Bottom-right causal, as a mask_mod reading the sequence's lengths."""
    import cutlass.cute as cute

    @cute.jit
    def causal_mask(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return kv_idx <= q_idx + (seqlen_info.seqlen_k - seqlen_info.seqlen_q)

    return causal_mask, lambda b, h, q, kv: kv <= q + (kv.shape[3] - q.shape[2])


def doc_mask(doc: int):
    """Documents of ``doc`` positions (query and key positions in the same document)."""
    import cutlass.cute as cute

    @cute.jit
    def doc_mask(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return (q_idx // doc) == (kv_idx // doc)

    return doc_mask, lambda b, h, q, kv: (q // doc) == (kv // doc)


def causal_doc(doc: int):
    """Bottom-right causal within documents of ``doc`` positions: the mask a causal call with a
    document mask_mod states (causal=True itself does not combine with a mask_mod)."""
    import cutlass.cute as cute

    @cute.jit
    def causal_doc(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        qk = q_idx + (seqlen_info.seqlen_k - seqlen_info.seqlen_q)
        return (kv_idx <= qk) & ((qk // doc) == (kv_idx // doc))

    def twin(b, h, q, kv):
        qk = q + (kv.shape[3] - q.shape[2])
        return (kv <= qk) & ((qk // doc) == (kv // doc))

    return causal_doc, twin


def head_parity():
    """Head h sees the keys of h's parity: a head-dependent mask (pack GQA's head index)."""
    import cutlass.cute as cute

    @cute.jit
    def head_parity(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return ((h + kv_idx) % 2) == 0

    return head_parity, lambda b, h, q, kv: ((h + kv) % 2) == 0


def every_seventh_row_blind():
    """Rows with ``q_idx % 7 == 0`` see no key at all (their out is 0, their lse -inf)."""
    import cutlass.cute as cute

    @cute.jit
    def blind(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return (q_idx % 7) != 0

    return blind, lambda b, h, q, kv: ((q % 7) != 0) & (kv >= 0)


def derivative(name: str):
    """The ``score_mod_bwd`` of SCORE_MODS[name] (flash_attn.cute's convention: the gradient with
    respect to the score_mod's input, given the one with respect to its output)."""
    import cutlass.cute as cute

    if name == "tanh_cap":
        cap = 20.0

        @cute.jit
        def tanh_cap_bwd(grad, scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            t = cute.math.tanh(scores * (1.0 / cap), fastmath=True)
            return grad * (1.0 - t * t)
        return tanh_cap_bwd

    @cute.jit
    def shift_bwd(grad, scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):  # a score plus a constant
        return grad
    return shift_bwd


SCORE_MODS = {"identity": identity, "alibi": lambda: alibi(0.05), "tanh_cap": lambda: tanh_cap(20.0),
              "batch_bias": lambda: batch_bias(0.5)}
MASK_MODS = {"causal_mask": causal_mask, "doc64": lambda: doc_mask(64), "doc100": lambda: doc_mask(100),
             "causal_doc100": lambda: causal_doc(100),
             "head_parity": head_parity, "blind7": every_seventh_row_blind}


# With aux tensors (the call passes ``aux_tensors=[table]``; the factories return the table too).


def doc_ids(batch: int, seqlen: int, device, seed: int = 0):
    """A mask from per-position document ids, an int32 ``(batch, seqlen)`` aux tensor (ids rise
    along the positions, documents of random lengths)."""
    import cutlass.cute as cute

    gen = torch.Generator().manual_seed(seed)
    ids = torch.cumsum((torch.rand(batch, seqlen, generator=gen) < 0.01).int(), dim=1).int().to(device)

    @cute.jit
    def same_doc(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        d = aux_tensors[0]
        return d[b[0], q_idx[0]] == d[b[0], kv_idx[0]]

    def twin(b, h, q, kv):
        bb = b.view(-1, 1)
        dq = ids.long()[bb, q.view(1, -1)]  # (B, Sq)
        dk = ids.long()[bb, kv.view(1, -1)]  # (B, Sk)
        return dq[:, None, :, None] == dk[:, None, None, :]

    return same_doc, twin, ids


def rel_bias_table(heads: int, max_len: int, device, seed: int = 0):
    """A learned relative-position bias per head, a float32 ``(heads, 2 * max_len - 1)`` aux tensor
    indexed by ``q_idx - kv_idx + max_len - 1``."""
    import cutlass.cute as cute

    gen = torch.Generator().manual_seed(seed)
    table = (torch.randn(heads, 2 * max_len - 1, generator=gen) * 0.5).to(device)

    @cute.jit
    def rel_bias(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        t = aux_tensors[0]
        return scores + t[h[0], q_idx[0] - kv_idx[0] + (max_len - 1)]

    def twin(s, b, h, q, kv):
        return s + table[h, q - kv + (max_len - 1)]

    return rel_bias, twin, table


# With aux scalars (the call passes ``aux_scalars=SCALARS``: runtime values, not compile-time ones).


def scalar_alibi_band():
    """ALiBi whose slope is a float aux scalar, a band of ``aux_scalars[1]`` keys below the bottom-right
    diagonal (an int aux scalar, and every key above it hidden) and the derivative of the score_mod,
    which also takes the scalars. Returns ``(score_mod, score_mod_bwd, mask_mod, score twin factory,
    mask twin factory)``; a twin factory takes the scalars' values."""
    import cutlass.cute as cute

    @cute.jit
    def slope_bias(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
        dist = q_idx + (seqlen_info.seqlen_k - seqlen_info.seqlen_q) - kv_idx
        return scores - dist.to(cute.Float32) * aux_scalars[0]

    @cute.jit
    def slope_bias_bwd(grad, scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
        return grad

    @cute.jit
    def band(b, h, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
        dist = q_idx[0] + (seqlen_info.seqlen_k - seqlen_info.seqlen_q) - kv_idx[0]
        return (dist >= 0) & (dist < aux_scalars[1])

    def score_twin(slope, width):
        def twin(s, b, h, q, kv):
            return s - (q + (kv.shape[3] - q.shape[2]) - kv).float() * slope
        return twin

    def mask_twin(slope, width):
        def twin(b, h, q, kv):
            dist = q + (kv.shape[3] - q.shape[2]) - kv
            return (dist >= 0) & (dist < width)
        return twin

    return slope_bias, slope_bias_bwd, band, score_twin, mask_twin


def doc_ids_window(batch: int, seqlen: int, device, seed: int = 0):
    """Document ids (an aux tensor, :func:`doc_ids`) and a window of ``aux_scalars[0]`` keys on
    either side of the query: a mask reading a tensor and a scalar. Returns ``(mask_mod, twin
    factory, ids)``."""
    import cutlass.cute as cute

    same_doc, doc_twin, ids = doc_ids(batch, seqlen, device, seed)

    @cute.jit
    def doc_window(b, h, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
        d = aux_tensors[0]
        near = (q_idx[0] - kv_idx[0] < aux_scalars[0]) & (kv_idx[0] - q_idx[0] < aux_scalars[0])
        return near & (d[b[0], q_idx[0]] == d[b[0], kv_idx[0]])

    def twin_of(width):
        def twin(b, h, q, kv):
            return doc_twin(b, h, q, kv) & ((q - kv).abs() < width)
        return twin

    return doc_window, twin_of, ids


# Block sparsity (flash_attn.cute's block_sparse_tensors; fa4/block_sparse.py).


class BlockSparseTensorsTorch(NamedTuple):
    """The fields of flash_attn.cute's BlockSparseTensorsTorch, as a caller builds them."""

    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: Optional[torch.Tensor] = None
    full_block_idx: Optional[torch.Tensor] = None
    cu_total_m_blocks: Optional[torch.Tensor] = None
    cu_block_idx_offsets: Optional[torch.Tensor] = None
    block_size: Optional[tuple] = None
    dq_write_order: Optional[torch.Tensor] = None
    dq_write_order_full: Optional[torch.Tensor] = None
    spt: Optional[bool] = None


def random_block_sparse(batch: int, heads: int, seqlen_q: int, seqlen_k: int, block: tuple, device, seed: int = 0,
                        full: bool = True, heads_broadcast: bool = False, empty_row: bool = False):
    """Random block lists (each row: a random count of mask blocks, then of full blocks, disjoint),
    and the state table they mean, int ``(B, H, Mb, Nb)``: 0 hidden, 1 mask_mod, 2 whole.
    ``empty_row``: q block 0 of batch 0 attends to nothing. Returns ``(bst, state)``."""
    import math

    gen = torch.Generator().manual_seed(seed)
    mb, nb = math.ceil(seqlen_q / block[0]), math.ceil(seqlen_k / block[1])
    h = 1 if heads_broadcast else heads
    state = torch.zeros(batch, h, mb, nb, dtype=torch.int32)
    mask_cnt = torch.zeros(batch, h, mb, dtype=torch.int32)
    full_cnt = torch.zeros(batch, h, mb, dtype=torch.int32)
    mask_idx = torch.full((batch, h, mb, nb), -1, dtype=torch.int32)  # (entries past the count: junk)
    full_idx = torch.full((batch, h, mb, nb), nb + 5, dtype=torch.int32)
    for b in range(batch):
        for hh in range(h):
            for m in range(mb):
                perm = torch.randperm(nb, generator=gen)
                n_mask = int(torch.randint(0, nb + 1, (1,), generator=gen))
                n_full = int(torch.randint(0, nb - n_mask + 1, (1,), generator=gen)) if full else 0
                if empty_row and b == 0 and m == 0:
                    n_mask = n_full = 0
                mask_cnt[b, hh, m], full_cnt[b, hh, m] = n_mask, n_full
                mask_idx[b, hh, m, :n_mask] = perm[:n_mask].int()
                full_idx[b, hh, m, :n_full] = perm[n_mask:n_mask + n_full].int()
                state[b, hh, m, perm[:n_mask]] = 1
                state[b, hh, m, perm[n_mask:n_mask + n_full]] = 2
    to = dict(device=device)
    bst = BlockSparseTensorsTorch(mask_cnt.to(**to), mask_idx.to(**to), full_cnt.to(**to) if full else None,
                                  full_idx.to(**to) if full else None, block_size=tuple(block))
    return bst, state.expand(batch, heads, mb, nb)


def lists_from_state(state: torch.Tensor, block: tuple, device) -> "BlockSparseTensorsTorch":
    """flash_attn.cute's lists of a state table, int ``(B, H, Mb, Nb)`` (0 hidden, 1 mask_mod, 2
    whole): per row the mask blocks, then the full ones, in block order."""
    b, h, mb, nb = state.shape
    cnt = {v: torch.zeros(b, h, mb, dtype=torch.int32) for v in (1, 2)}
    idx = {v: torch.full((b, h, mb, nb), -1, dtype=torch.int32) for v in (1, 2)}
    for key in ((i, j, m) for i in range(b) for j in range(h) for m in range(mb)):
        for v in (1, 2):
            cols = (state[key] == v).nonzero().flatten().int()
            cnt[v][key] = len(cols)
            idx[v][key][:len(cols)] = cols
    to = dict(device=device)
    return BlockSparseTensorsTorch(cnt[1].to(**to), idx[1].to(**to), cnt[2].to(**to), idx[2].to(**to),
                                   block_size=tuple(block))


def document_block_sparse(batch: int, heads: int, seqlen_q: int, seqlen_k: int, block: tuple, device,
                          seed: int = 0, docs: int = 4):
    """Block lists of a document mask in sparse blocks: each (batch, head) cuts the sequences into
    ``docs`` documents at random points (heads differ, so a GQA group's union is wider than each
    head's), a q block sees the K blocks of its documents (whole inside one, through the mask_mod
    on a boundary); the last two K blocks are seen by no query of any head (their dK = dV = 0) and
    q block 0 of batch 0 sees nothing (its dQ = 0). Returns ``(bst, state)`` as
    :func:`random_block_sparse`."""
    import math

    gen = torch.Generator().manual_seed(seed)
    mb, nb = math.ceil(seqlen_q / block[0]), math.ceil(seqlen_k / block[1])
    state = torch.zeros(batch, heads, mb, nb, dtype=torch.int32)
    for b in range(batch):
        for hh in range(heads):
            cuts = torch.sort(torch.rand(docs - 1, generator=gen)).values
            doc = lambda pos: torch.bucketize(pos, cuts)  # noqa: E731
            q0 = doc(torch.arange(mb) * block[0] / seqlen_q)
            q1 = doc(torch.clamp((torch.arange(mb) + 1) * block[0] - 1, max=seqlen_q - 1) / seqlen_q)
            k0 = doc(torch.arange(nb) * block[1] / seqlen_k)
            k1 = doc(torch.clamp((torch.arange(nb) + 1) * block[1] - 1, max=seqlen_k - 1) / seqlen_k)
            meet = (q0[:, None] <= k1[None, :]) & (k0[None, :] <= q1[:, None])
            whole = (q0 == q1)[:, None] & (k0 == k1)[None, :] & (q0[:, None] == k0[None, :])
            state[b, hh] = torch.where(whole, 2, torch.where(meet, 1, 0))
    if nb > 3:
        state[..., nb - 2:] = 0
    state[0, :, 0] = 0
    return lists_from_state(state, block, device), state


def block_sparse_twin(state: torch.Tensor, block: tuple, inner=None):
    """The torch twin of a block-sparse call's mask: the state table, and inside the blocks marked 1
    the twin ``inner`` of the user's mask_mod (None: none)."""
    def twin(b, h, q, kv):
        st = state.to(q.device)[b, h, q // block[0], kv // block[1]]
        keep_inner = inner(b, h, q, kv) if inner is not None else torch.ones_like(st, dtype=torch.bool)
        return (st == 2) | ((st == 1) & keep_inner)
    return twin
