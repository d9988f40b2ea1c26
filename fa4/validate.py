"""Input validation: every bad argument is rejected here, before any kernel launch.

Each failure is a ``TypeError`` (wrong kind of thing: dtype, Python type) or ``ValueError`` (wrong
value: shape, device, layout, range) whose message names the argument and says what was expected.
Arguments no kernel supports yet raise ``NotImplementedError`` naming the argument.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from fa4.config import AttnProblem
from fa4.config import is_int as _is_int
from fa4.config import is_real as _is_real

def is_fake(t: torch.Tensor) -> bool:
    """FakeTensors (torch.compile tracing) have no storage to check."""
    return type(t) is not torch.Tensor and t.__class__.__name__ == "FakeTensor"


_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256  # what the kernels are built and tested for
HEAD_DIM_MULTIPLE = 8  # 16 bytes of fp16/bf16: the vector width of every load


def _check_tensor(name: str, t, rank: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be torch.float16 or torch.bfloat16, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {what}, got shape {tuple(t.shape)}")


def _check_layout(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {t.stride()}")
    for dim, s in enumerate(t.stride()[:-1]):
        if s % HEAD_DIM_MULTIPLE and t.shape[dim] > 1:
            raise ValueError(
                f"{name} stride {s} of dimension {dim} must be a multiple of {HEAD_DIM_MULTIPLE} elements "
                f"(16 bytes), got strides {t.stride()}"
            )
    if not torch.compiler.is_compiling():  # (traced graphs: fa4::fwd copies a misaligned tensor)
        check_aligned(name, t)


def _fits_in_place(t: torch.Tensor) -> bool:
    """The kernels read ``t`` as it is: unit last stride, every other stride a multiple of 8
    elements (size-1 dims included) and a 16-byte aligned base. A plain loop: this runs on the
    per-call path."""
    stride = t.stride()
    if stride[-1] != 1 or t.data_ptr() & 15:
        return False
    for s in stride[:-1]:
        if s & 7:
            return False
    return True


def layout_misfit(t) -> Optional[str]:
    """Why the kernels cannot read tensor ``t`` in place (its last stride is not 1, another stride
    is not a multiple of 8 elements, or its base is not 16-byte aligned), or None where they can
    (and for anything that is not a tensor: the checks name that). The pointer is not read on fake
    tensors (tracing): a traced graph's op copies a misaligned tensor (``ops.fwd_op``)."""
    if t.__class__ is torch.Tensor and not torch.compiler.is_compiling() and t.dim() and _fits_in_place(t):
        return None  # the common case, in ~1 us
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    stride, shape = t.stride(), t.shape
    if stride[-1] != 1 and shape[-1] > 1:
        return f"its last stride is {stride[-1]}, not 1"
    for dim in range(t.dim() - 1):
        if stride[dim] % HEAD_DIM_MULTIPLE and shape[dim] > 1:
            return f"its stride {stride[dim]} of dimension {dim} is not a multiple of {HEAD_DIM_MULTIPLE} elements"
    if torch.compiler.is_compiling():  # (the op copies a misaligned tensor: fa4::fwd)
        return None
    if t.device.type != "meta" and not is_fake(t) and t.data_ptr() % 16:
        return f"its data pointer {t.data_ptr():#x} is not 16-byte aligned"
    return None


def kernel_ready(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` as the compiled kernels take it: unit last stride, every other stride a multiple of 8
    elements (the compiled code checks all of them, size-1 dims included) and a 16-byte aligned
    base. Size-1 dims with odd strides get a zero-copy view with stride 0 there (their stride is
    never used); anything else that does not fit (an expanded or transposed autograd gradient, a
    misaligned base) is copied into a fresh compact tensor."""
    if t is None:
        return None
    if _fits_in_place(t):
        return t
    stride = t.stride()
    if stride[-1] == 1 and not t.data_ptr() & 15:
        shape = t.shape
        if all(s % 8 == 0 or n == 1 for n, s in zip(shape[:-1], stride[:-1])):
            return t.as_strided(shape, tuple(0 if n == 1 else s for n, s in zip(shape, stride)))
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def check_aligned(name: str, t: torch.Tensor) -> None:
    if t.device.type != "meta" and not is_fake(t) and t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned, its data pointer is {t.data_ptr():#x}")


def _check_same(name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the same dtype as q ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the same device as q ({ref.device}), got {t.device}")


def _check_window(window_size) -> tuple[Optional[int], Optional[int]]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of int or None, got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if w is None:
            out.append(None)
            continue
        if not _is_int(w):
            raise TypeError(f"window_size {side} must be an int or None, got {w!r}")
        w = int(w)
        if w == -1:  # FlashAttention-2's spelling of "unbounded"
            out.append(None)
        elif w < 0:
            raise ValueError(f"window_size {side} must be >= 0 (or None / -1 for unbounded), got {w}")
        else:
            out.append(w)
    return out[0], out[1]


def check_int32_vector(name: str, t, device: torch.device, ref: str = "q", what: str = "") -> int:
    """A contiguous 1-D int32 tensor on ``device`` (``ref`` names the tensor that set it; ``what``
    describes the expected shape in the messages); returns its length."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-dimensional{what}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as {ref} ({device}), got {t.device}")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    return t.numel()


def _check_cu_seqlens(name: str, t, batch: Optional[int], device: torch.device) -> int:
    check_int32_vector(name, t, device)
    expected = None if batch is None else batch + 1
    if t.numel() < 1 or (expected is not None and t.numel() != expected):  # [0]: no sequences, as flash_attn.cute
        want = "batch + 1 (>= 1)" if expected is None else f"batch + 1 = {expected}"
        raise ValueError(f"{name} must have length {want}, got {t.numel()}")
    return t.numel() - 1


def _check_max_seqlen(name: str, v) -> int:
    if not _is_int(v):
        raise TypeError(f"{name} must be an int (the longest sequence of the batch), got {v!r}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return int(v)


def _max_seqlen(name: str, v, bound: int) -> int:
    """The longest sequence of a varlen batch as the kernels use it (to size grids): an int as
    given; ``None`` or a 0-dim tensor on the GPU: ``bound``, the packed token count, an upper
    bound read from the shapes without a device sync (flash_attn.cute makes both optional, and
    Hugging Face-style callers pass 0-dim tensors); a 0-dim CPU integer tensor: its value. A value
    above ``bound`` is ``bound`` (no sequence is longer than the packed tokens)."""
    if v is None:
        return bound
    if isinstance(v, torch.Tensor):
        if v.dim() != 0 or v.dtype.is_floating_point or v.dtype == torch.bool or v.is_complex():
            raise TypeError(f"{name} must be an int or a 0-dim integer tensor, got a {v.dtype} tensor of shape "
                            f"{tuple(v.shape)}")
        if v.device.type != "cpu":
            return bound
        v = int(v)
    return min(_check_max_seqlen(name, v), bound)


# The kernels take softmax_scale and softcap as float32: normal float32 values only.
FLOAT32_NORMAL = (1.1754943508222875e-38, 3.4028234663852886e+38)


def _as_float(v) -> float:
    """``float(v)`` of an int / float (numpy scalars included); inf where it is too large for a float."""
    try:
        return float(v)
    except OverflowError:
        return math.inf


def _check_scalars(softmax_scale, softcap, head_dim: int) -> tuple[float, float]:
    lo, hi = FLOAT32_NORMAL
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif not _is_real(softmax_scale):
        raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    elif not (math.isfinite(_as_float(softmax_scale)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    elif not lo <= float(softmax_scale) <= hi:
        raise ValueError(f"softmax_scale must be a normal float32 value (in [{lo:.4g}, {hi:.4g}]), got {softmax_scale}")
    if softcap is None:
        softcap = 0.0
    if not _is_real(softcap):
        raise TypeError(f"softcap must be a float, got {softcap!r}")
    if not (math.isfinite(_as_float(softcap)) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    if softcap and not lo <= float(softcap) <= hi:
        raise ValueError(f"softcap must be 0 or a normal float32 value (in [{lo:.4g}, {hi:.4g}]), got {softcap}")
    return float(softmax_scale), float(softcap)


def _masking(causal, window, seqlen_q: int, seqlen_k: int) -> tuple[bool, bool, int, int]:
    """(causal, local, window_left, window_right) as the kernels take them (see DESIGN.md)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    left, right = window
    if causal:
        right = 0
    unbounded = max(seqlen_q, seqlen_k, 1)
    if left is not None and left >= unbounded:
        left = None
    if right is not None and right >= unbounded:
        right = None
    if left is None and right == 0:  # a causal mask, however it was spelled
        return True, False, unbounded, 0
    if left is None and right is None:
        return False, False, unbounded, unbounded
    return False, True, unbounded if left is None else left, unbounded if right is None else right


_any_device = False


@contextlib.contextmanager
def allow_any_device():
    """Validate shapes and dtypes of CPU / meta tensors too (for :func:`fa4.explain`)."""
    global _any_device
    old, _any_device = _any_device, True
    try:
        yield
    finally:
        _any_device = old


def _check_qkv(q, k, v, rank: int, what: str, kv_rank: Optional[int] = None, kv_what: Optional[str] = None) -> None:
    _check_tensor("q", q, rank, what)
    _check_tensor("k", k, kv_rank or rank, kv_what or what)
    _check_tensor("v", v, kv_rank or rank, kv_what or what)
    _check_same("k", k, q)
    _check_same("v", v, q)
    if q.device.type != "cuda" and not _any_device:
        raise ValueError(f"q, k, v must be CUDA tensors, got device {q.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)}")
    d, dv = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k head_dim ({k.shape[-1]}) must equal q head_dim ({d})")
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM) or d % HEAD_DIM_MULTIPLE:
        raise ValueError(
            f"head_dim must be a multiple of {HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {d}")
    if not (MIN_HEAD_DIM <= dv <= MAX_HEAD_DIM) or dv % HEAD_DIM_MULTIPLE:
        raise ValueError(f"v's head dim (head_dim_v) must be a multiple of {HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, "
                         f"{MAX_HEAD_DIM}], got {dv}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk:
        raise ValueError(f"the number of heads of q ({hq}) must be divisible by that of k and v ({hk})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, t)


# flash_attn.cute's ``qv`` is the fourth parameter of both calls: an argument meant for a later one
# (FlashAttention-2's dropout_p / softmax_scale, or cu_seqlens_q) given by position lands there.
_QV_HINT = ("qv is flash_attn.cute's fourth parameter (after q, k, v): pass the later arguments by keyword "
            "(softmax_scale=..., causal=..., cu_seqlens_q=..., ...)")


def reject_unsupported(**kwargs) -> None:
    """Arguments of flash-attn-4's API that no fa4 kernel implements yet raise, never pass silently."""
    for name, value in kwargs.items():
        if name == "qv" and value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"qv must be a torch.Tensor or None, got {value!r}: {_QV_HINT}")
        if name == "qv" and isinstance(value, torch.Tensor) and value.dtype == torch.int32:
            raise NotImplementedError(f"fa4 does not support the argument 'qv' yet, and this int32 tensor looks like "
                                      f"cu_seqlens given by position: {_QV_HINT}")
        if value is not None and value is not False:
            raise NotImplementedError(f"fa4 does not support the argument {name!r} yet (got {value!r})")


# Note [validation cache]
# Everything check_dense verifies is a function of the tensors' shapes, strides, dtypes and devices
# and of the scalar arguments (with their types: causal=1 must still fail), except the data
# pointers' alignment. So a call whose key matches an earlier valid call reuses its AttnProblem
# and re-checks only the pointers: a few microseconds instead of ~20 on the per-call host path.
_dense_cache: dict = {}
_CACHE_LIMIT = 4096


def _dense_key(q, k, v, softmax_scale, causal, window_size, softcap):
    try:
        wl, wr = window_size
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device, softmax_scale.__class__, softmax_scale,
               causal.__class__, causal, window_size.__class__, wl.__class__, wl, wr.__class__, wr,
               softcap.__class__, softcap, _any_device)
        hash(key)
        return key
    except (AttributeError, TypeError, ValueError):  # not tensors, odd scalars: the full checks say what is wrong
        return None


def check_dense(q, k, v, softmax_scale, causal, window_size, softcap) -> AttnProblem:
    """Validate a ``flash_attn_func`` call and describe it as an :class:`AttnProblem`
    (cached by everything but the data pointers: Note [validation cache])."""
    if torch.compiler.is_compiling():
        return _check_dense(q, k, v, softmax_scale, causal, window_size, softcap)
    key = _dense_key(q, k, v, softmax_scale, causal, window_size, softcap)
    problem = _dense_cache.get(key) if key is not None else None
    if problem is not None:
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            for name, t in (("q", q), ("k", k), ("v", v)):
                check_aligned(name, t)
        return problem
    problem = _check_dense(q, k, v, softmax_scale, causal, window_size, softcap)
    if key is not None and len(_dense_cache) < _CACHE_LIMIT:
        _dense_cache[key] = problem
    return problem


def _check_dense(q, k, v, softmax_scale, causal, window_size, softcap) -> AttnProblem:
    _check_qkv(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    b, sq, hq, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"k and v batch ({k.shape[0]}) must equal q batch ({b})")
    sk, hk = k.shape[1], k.shape[2]
    scale, softcap = _check_scalars(softmax_scale, softcap, d)
    causal_, local, wl, wr = _masking(causal, _check_window(window_size), sq, sk)
    return AttnProblem(_DTYPES[q.dtype], b, sq, sk, hq, hk, d, v.shape[-1], scale, causal_, local, wl, wr, softcap,
                       total_q=b * sq, total_k=b * sk)


def _check_lengths(name: str, t, batch: int, device) -> None:
    """``seqused_q`` / ``seqused_k``: int32 (batch,) on q's device."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {getattr(t, 'dtype', type(t))}")
    if t.shape != (batch,) or t.device != device:
        raise ValueError(f"{name} must have shape (batch,) = ({batch},) on {device}, got {tuple(t.shape)} on "
                         f"{t.device}")
    if t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def _check_page_table(page_table, batch: int, device) -> int:
    """(batch, max_pages) int32 with a unit last stride; returns max_pages. Page indices are not read
    (that would sync the device): an index outside the cache reads zeros (TMA bounds), never memory
    outside it."""
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32:
        raise TypeError(f"page_table must be an int32 torch.Tensor, got {getattr(page_table, 'dtype', type(page_table))}")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must have shape (batch, max_pages) with batch = {batch}, got "
                         f"{tuple(page_table.shape)}")
    if page_table.device != device:
        raise ValueError(f"page_table must be on the same device as q ({device}), got {page_table.device}")
    if page_table.shape[1] == 0:
        raise ValueError("page_table must have at least one page per sequence (max_pages >= 1)")
    if page_table.stride(1) != 1 and page_table.shape[1] > 1:
        raise ValueError(f"page_table must be contiguous in its last dimension, got strides {page_table.stride()}")
    return page_table.shape[1]


def _meta(t):
    """What validation reads of an optional tensor argument (its data are never read)."""
    if t is None:
        return None
    return t.__class__, t.shape, t.stride(), t.dtype, t.device


def _max_key(v):
    if isinstance(v, torch.Tensor):  # a CPU scalar's value is read (cheap); a GPU one is not
        return _meta(v), (v.item() if v.device.type == "cpu" and v.dim() == 0 and not v.dtype.is_floating_point
                          else None)
    return v.__class__, v


def _varlen_key(args):
    (q, k, v, cu_q, cu_k, max_q, max_k, used_k, scale, causal, window, softcap, used_q, table) = args
    try:
        wl, wr = window
        key = (_meta(q), _meta(k), _meta(v), _meta(cu_q), _meta(cu_k), _max_key(max_q), _max_key(max_k),
               _meta(used_k), _meta(used_q), _meta(table), scale.__class__, scale, causal.__class__, causal,
               window.__class__, wl.__class__, wl, wr.__class__, wr, softcap.__class__, softcap, _any_device)
        hash(key)
        return key
    except (AttributeError, TypeError, ValueError, RuntimeError):  # the full checks say what is wrong
        return None


_varlen_cache: dict = {}


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                 softmax_scale, causal, window_size, softcap, seqused_q=None, page_table=None) -> AttnProblem:
    """:func:`_check_varlen`, cached like :func:`check_dense` by everything it reads but the data
    pointers (Note [validation cache]): a decode loop pays ~3 us instead of ~20 per call."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
            window_size, softcap, seqused_q, page_table)
    if torch.compiler.is_compiling():
        return _check_varlen(*args)
    key = _varlen_key(args)
    problem = _varlen_cache.get(key) if key is not None else None
    if problem is not None:
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            for name, t in (("q", q), ("k", k), ("v", v)):
                check_aligned(name, t)
        return problem
    problem = _check_varlen(*args)
    if key is not None and len(_varlen_cache) < _CACHE_LIMIT:
        _varlen_cache[key] = problem
    return problem


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                  softmax_scale, causal, window_size, softcap, seqused_q=None, page_table=None) -> AttnProblem:
    """Validate a ``flash_attn_varlen_func`` call. Each side is packed or batched on its own:

    * q: packed ``(total_q, heads, head_dim)`` with ``cu_seqlens_q``, else batched ``(batch,
      seqlen_q, heads, head_dim)``;
    * k, v: packed ``(total_k, heads_k, head_dim)`` with ``cu_seqlens_k``; paged ``(num_pages,
      page_size, heads_k, head_dim)`` with ``page_table (batch, max_pages)``; else batched ``(batch,
      seqlen_k, heads_k, head_dim)``.

    ``seqused_q`` / ``seqused_k`` (int32, (batch,)) cap each sequence's queries / keys."""
    varlen_q, varlen_k, paged = cu_seqlens_q is not None, cu_seqlens_k is not None, page_table is not None
    if varlen_k and paged:
        raise ValueError("cu_seqlens_k and page_table are exclusive: with a page table, seqused_k gives the keys "
                         "of each sequence")
    q_what = "(total_q, heads, head_dim) with cu_seqlens_q" if varlen_q else "(batch, seqlen_q, heads, head_dim)"
    kv_what = ("(total_k, heads_k, head_dim) with cu_seqlens_k" if varlen_k else
               "(num_pages, page_size, heads_k, head_dim) with page_table" if paged else
               "(batch, seqlen_k, heads_k, head_dim) without cu_seqlens_k")
    _check_qkv(q, k, v, 3 if varlen_q else 4, q_what, 3 if varlen_k else 4, kv_what)
    if varlen_q:
        batch = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q.device)
    else:
        batch = q.shape[0]
    if varlen_k:
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch, q.device)
    elif not paged and k.shape[0] != batch:
        raise ValueError(f"k and v batch ({k.shape[0]}) must equal the batch of q ({batch})")
    page_size = 0
    if paged:
        max_pages = _check_page_table(page_table, batch, q.device)
        page_size = k.shape[1]
        if page_size == 0:
            raise ValueError("k and v (the paged cache) must have page_size >= 1")
        if k.shape[0] == 0:
            raise ValueError("k and v (the paged cache) must have num_pages >= 1, got shape "
                             f"{tuple(k.shape)}")
    sq = _max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0]) if varlen_q else q.shape[1]
    if varlen_k:
        sk = _max_seqlen("max_seqlen_k", max_seqlen_k, k.shape[0])
    else:  # batched or paged: the shapes give the lengths (a max_seqlen_k is checked, not used)
        sk = max_pages * page_size if paged else k.shape[1]
        _max_seqlen("max_seqlen_k", max_seqlen_k, sk)
    if not varlen_q:
        _max_seqlen("max_seqlen_q", max_seqlen_q, sq)
    if seqused_k is not None:
        _check_lengths("seqused_k", seqused_k, batch, q.device)
    if seqused_q is not None:
        _check_lengths("seqused_q", seqused_q, batch, q.device)
    hq, d = q.shape[-2], q.shape[-1]
    hk = k.shape[-2]
    scale, softcap = _check_scalars(softmax_scale, softcap, d)
    causal_, local, wl, wr = _masking(causal, _check_window(window_size), sq, sk)
    total_q = q.shape[0] if varlen_q else batch * q.shape[1]
    total_k = k.shape[0] if varlen_k else (k.shape[0] * k.shape[1])
    return AttnProblem(_DTYPES[q.dtype], batch, sq, sk, hq, hk, d, v.shape[-1], scale, causal_, local, wl, wr, softcap,
                       varlen_q=varlen_q, varlen_k=varlen_k, has_seqused_k=seqused_k is not None,
                       total_q=total_q, total_k=total_k, has_seqused_q=seqused_q is not None, page_size=page_size)


def check_sink(sink, heads: int, device) -> None:
    """``learnable_sink``: a (heads,) float tensor (one logit per q head) on q's device."""
    if not isinstance(sink, torch.Tensor) or sink.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"learnable_sink must be a float32/bf16/fp16 torch.Tensor of shape (heads,), got "
                        f"{getattr(sink, 'dtype', type(sink))}")
    if sink.shape != (heads,):
        raise ValueError(f"learnable_sink must have shape (heads,) = ({heads},), got {tuple(sink.shape)}")
    if sink.device != device and not _any_device:
        raise ValueError(f"learnable_sink must be on the same device as q ({device}), got {sink.device}")


def check_num_splits(num_splits) -> int:
    """``num_splits`` as :class:`fa4.config.AttnProblem` holds it: None or <= 0 -> 0 (fa4 chooses)."""
    if num_splits is None:
        return 0
    if not _is_int(num_splits):
        raise TypeError(f"num_splits must be an int or None (<= 0 or None: chosen by fa4), got {num_splits!r}")
    return max(int(num_splits), 0)


def check_options(options) -> None:
    from fa4.config import KernelOptions

    if options is not None and not isinstance(options, KernelOptions):
        raise TypeError(f"kernel_options must be a fa4.KernelOptions or None, got {type(options).__name__}")


def as_bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return v


def _is_numpy_bool(v) -> bool:
    t = type(v)
    return t.__module__ == "numpy" and t.__name__ in ("bool_", "bool")


def plain_bools(*values) -> tuple:
    """``values`` with numpy bools made Python bools, the rest unchanged (their checks come later).

    Flags are compile keys and custom-op arguments, which take Python bools only; a flag read from a
    numpy array (``np.bool_``) is the same choice, so the entry points convert it rather than refuse
    it. Ints and tensors still get the flag's ``TypeError``."""
    return tuple(bool(v) if _is_numpy_bool(v) else v for v in values)
