"""User score and mask functions (``score_mod`` / ``score_mod_bwd`` / ``mask_mod``, flash_attn.cute's API).

A ``score_mod`` rewrites each score, a ``mask_mod`` hides keys; both are CuTe DSL functions the
kernels trace into their K-block step (the forward and backward of both families), with
flash_attn.cute's calling conventions, so a function written for flash_attn.cute runs unchanged:

* ``score_mod(scores, batch_idx, head_idx, q_idx=, kv_idx=, seqlen_info=, aux_tensors=)`` ->
  scores. ``scores`` is a float32 ``TensorSSA`` of ``vec_size`` scores, already multiplied by
  ``softmax_scale``; the index arguments are int32 ``TensorSSA`` of the same size, element ``j``
  holding score ``j``'s indices. ``vec_size`` is the function's ``__vec_size__`` (1 or 2), else 2
  (1 with aux tensors). Its values must be finite or -inf (+inf or NaN in a row is not guarded). A
  function must be element-wise: in the forward a vector is adjacent keys
  of one query, in the backward adjacent queries of one key (flash_attn.cute's backward groups
  them so too), so reading ``q_idx[0]`` for the whole vector is wrong in the backward.
* ``score_mod_bwd(grad, scores, batch_idx, head_idx, q_idx=, kv_idx=, seqlen_info=, aux_tensors=)``
  -> the gradient with respect to ``scores`` (the score_mod's input, times ``softmax_scale``) given
  ``grad``, the one with respect to its output: the backward through a score_mod (sm90) needs it,
  as flash_attn.cute's does. Its own ``__vec_size__``, else the score_mod's. Where ``grad`` is 0
  (a masked score) the result is taken as 0.
* ``mask_mod(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors)`` -> a Boolean (or a
  one-element Boolean ``TensorSSA``): False hides key ``kv_idx`` from query ``q_idx``, in every K
  block, forward and (sm90) backward. flash_attn.cute ignores ``causal`` / ``window_size`` when a
  mask_mod is given; fa4 raises a ValueError for the pair instead (the mask_mod states the whole
  mask). A ``score_mod`` combines with them.

``q_idx`` / ``kv_idx`` are positions in the sequence (varlen: in sequence ``batch_idx``),
``head_idx`` the q head (pack GQA included), ``seqlen_info`` has ``offset_q``, ``offset_k``,
``seqlen_q`` and ``seqlen_k`` (:class:`fa4.seqlen.SeqlenInfo`). ``aux_tensors``: the call's
``aux_tensors`` as a tuple of global-memory ``cute.Tensor`` (any strides; dtypes
:data:`AUX_DTYPES`), or ``()`` for a score_mod and None for a mask_mod without them. With aux
tensors the indices a function sees are clamped into the sequence (``q_idx < seqlen_q``,
``kv_idx < seqlen_k``): the tile's rows and keys past the sequence are computed and then dropped
or masked, and a table indexed by them must not be read out of bounds (flash_attn.cute wraps
them instead; inside the sequence both are the same). ``aux_scalars``: a tuple of Python ints
(int32) and floats (float32), runtime arguments of the kernel (their types are in the compile key,
their values are not: another value reuses the kernel, where a value a function closes over is a
compile-time constant of its own kernel). Given them, the functions receive them as flash_attn.cute
passes them: ``aux_scalars=`` (score_mod, score_mod_bwd) or a seventh argument (mask_mod), each a
DSL ``Int32`` / ``Float32``. Eager calls only: a torch.compile graph's custom op has no slot for
them (NotImplementedError there).

Note [User functions in the compile key]
    A config names its functions by key (``AttnKernelConfig.score_mod`` / ``mask_mod``), and the
    kernel looks the function up here when it is traced. The key is a hash of what the function
    computes, taken at every call: its code (field by field, with its file and lines, nested
    functions included), the values it closes over, its defaults, the globals its code names, a
    bound method's instance attributes, and ``__vec_size__``, where each value is plain (numbers,
    strings, tuples / lists / dicts of them, modules, classes, other functions by their own hash).
    The code is the function's as fa4 first saw it (the DSL rewrites ``__code__`` in place on its
    first trace). So a function redefined with the same code and values (a closure made per call, a script run
    again) reuses its kernel, and an edit, another captured or global value or another instance
    compiles a new one. A function that reads any other value (a tensor, a NumPy scalar, an
    object) is keyed by its identity instead (a bound method: its instance's and function's), with
    a one-time warning: one kernel per function object, held alive here, and a change of that
    value is not seen. Kernels with user functions stay in process memory; the disk cache does
    not take them (an identity means nothing in another process, and a hash cannot see everything
    a function reads, e.g. the contents of a module it calls into).

Note [User functions under torch.compile]
    A traced call cannot hash at every call: dynamo computes the keys once per trace (the key
    function is marked as ``torch.compiler.assume_constant_result`` would mark it) and guards the
    graph on each function object's identity (``id(fn)`` in the traced code; its code object alone
    is the DSL's ``jit_wrapper``, the same for every ``@cute.jit`` function). So another function
    object retraces, but the same object reading a changed global, captured value or attribute
    keeps its graph and kernel, and a closure made per call retraces at every call. Bound methods
    are refused there (their instance cannot be a constant of the graph). Torch before 2.13 is
    refused too: its dynamo installs no guard for ``id()`` of a function and guards a function
    argument by its ``__code__`` only, which every ``@cute.jit`` function shares, so a compiled
    callable given another function kept running the first one's kernel (seen on the H200 host's
    torch 2.11, v0.31).

This module (host only: ``import fa4`` does not load the DSL) validates and names the functions
(:func:`key_of`, :func:`lookup`, :func:`check`); :class:`fa4.mods_kernel.UserMods` applies them to an
accumulator tile in the kernel.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
import warnings
import weakref
from typing import Any, Callable, Optional

# key -> function (Note [User functions in the compile key]): the first function of each key, which
# its kernels trace.
_REGISTRY: dict[str, Callable] = {}
_opaque_warned: list = []
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class _Opaque(Exception):
    """A value a function captures that cannot be hashed by content."""


def _plain(value: Any, depth: int = 0) -> str:
    if depth > 8:
        raise _Opaque()
    if isinstance(value, _PLAIN):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, frozenset) else value
        return f"{type(value).__name__}(" + ",".join(_plain(v, depth + 1) for v in items) + ")"
    if isinstance(value, dict):
        return "dict(" + ",".join(f"{_plain(k, depth + 1)}={_plain(v, depth + 1)}" for k, v in value.items()) + ")"
    if isinstance(value, types.ModuleType):
        return f"module:{value.__name__}"
    if isinstance(value, type):
        return f"type:{value.__module__}.{value.__qualname__}"
    if callable(value) and hasattr(inspect.unwrap(value), "__code__"):
        return "fn:" + _fingerprint(value, depth + 1)
    raise _Opaque()


def _hash_code(h, code: types.CodeType) -> None:
    """What ``code`` computes, field by field (``marshal.dumps`` would hash reference counts too)."""
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_filename,
                   code.co_firstlineno, code.co_argcount, code.co_kwonlyargcount, code.co_flags)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions and comprehensions
            _hash_code(h, const)
        else:
            h.update(repr(const).encode())


def _fingerprint(fn: Callable, depth: int = 0) -> str:
    """A content hash of ``fn`` (Note [User functions in the compile key]); raises _Opaque where a
    value it reads cannot be hashed by content."""
    h = hashlib.sha256()
    if inspect.ismethod(fn):  # a bound method: its function and its instance's attributes
        try:
            state = vars(fn.__self__)
        except TypeError:
            raise _Opaque() from None
        h.update(_plain(state, depth).encode())
        h.update(_fingerprint(fn.__func__, depth + 1).encode())
        h.update(repr(getattr(fn, "__vec_size__", None)).encode())
        return h.hexdigest()[:24]
    f = inspect.unwrap(fn)
    code = _code_of(f)
    if code is None:
        raise _Opaque()
    h.update(f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', '')}".encode())
    _hash_code(h, code)
    for cell in f.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned after the function was made)
            h.update(b"<empty>")
            continue
        h.update(_plain(value, depth).encode())
    h.update(_plain(f.__defaults__, depth).encode())
    h.update(_plain(f.__kwdefaults__, depth).encode())
    g = getattr(f, "__globals__", {})
    builtins = g.get("__builtins__")
    for name in _global_names(code):
        if name in g:
            h.update(f"{name}={_plain(g[name], depth)}".encode())  # _Opaque: keyed by identity
        elif not (builtins is not None and (name in builtins if isinstance(builtins, dict)
                                             else hasattr(builtins, name))):
            h.update(f"{name}=<unbound>".encode())  # (an attribute name, or a global not yet defined)
    h.update(repr(getattr(fn, "__vec_size__", None)).encode())
    return h.hexdigest()[:24]


# The code object of each function as fa4 first saw it: the DSL rewrites a function's ``__code__``
# in place when it first traces it (its AST preprocessor adds lines and names), which would change
# the function's key after its first compile and so compile it again at the next call (v0.31).
_first_code: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _code_of(f) -> Optional[types.CodeType]:
    """``f.__code__`` as first seen (:data:`_first_code`), None if it has none."""
    try:
        code = _first_code.get(f)
    except TypeError:  # not weak-referenceable
        return getattr(f, "__code__", None)
    if code is None:
        code = getattr(f, "__code__", None)
        if code is not None:
            _first_code[f] = code
    return code


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions and comprehensions
            names.extend(_global_names(const))
    return names


def require_callable(fn, what: str) -> None:
    """TypeError naming ``what`` unless ``fn`` is callable."""
    if not callable(fn):
        raise TypeError(f"{what} must be a callable (a CuTe DSL function), got {type(fn).__name__}")


def key_of(fn: Callable, what: str) -> str:
    """The compile key of user function ``fn`` (``what``: its argument's name), registered for
    :func:`lookup`; computed on every (eager) call, so a value the function reads that changed
    since (a global, a captured cell, its ``__vec_size__``) gives a new key (traced calls: Note
    [User functions under torch.compile]). TypeError if it is not
    callable."""
    require_callable(fn, what)
    name = getattr(inspect.unwrap(fn), "__name__", type(fn).__name__)
    try:
        key = f"{what}:{name}:{_fingerprint(fn)}"
    except _Opaque:
        # Identity: of a bound method's instance and function (a bound method is a new object at
        # each attribute access), else of the function; the registry keeps them alive.
        ident = f"{id(fn.__self__):x}-{id(fn.__func__):x}" if inspect.ismethod(fn) else f"{id(fn):x}"
        key = f"{what}:{name}:id{ident}"
        if key not in _REGISTRY and not _opaque_warned:
            _opaque_warned.append(key)
            warnings.warn(f"fa4: {what} {name!r} reads a value that is not a number, string, tuple, module or "
                          f"function (a tensor, a NumPy scalar, an object): its kernel is keyed by the function "
                          f"object, so a {what} made anew for each call compiles anew for each call, and a change "
                          f"of that value is not seen; read plain values, or pass tensors as aux_tensors (Note "
                          f"[User functions in the compile key] in fa4/mods.py)", stacklevel=4)
    if key not in _REGISTRY:
        _count_variant(what, fn, name)
    _REGISTRY.setdefault(key, fn)
    return key


# Keys made per (argument, function's qualified name): a value captured anew at each call (a slope,
# a length) compiles a kernel per value; past MANY_VARIANTS a one-time warning says so.
MANY_VARIANTS = 8
_variants: dict = {}
_many_warned: set = set()


def _count_variant(what: str, fn: Callable, name: str) -> None:
    qual = (what, getattr(inspect.unwrap(fn), "__qualname__", name))
    n = _variants[qual] = _variants.get(qual, 0) + 1
    if n >= MANY_VARIANTS and qual not in _many_warned:
        _many_warned.add(qual)
        warnings.warn(f"fa4: {what} {name!r} has compiled {n} kernels, one per distinct value it captures or reads "
                      f"(Note [User functions in the compile key]); a value that changes from call to call is "
                      f"better passed as an aux_tensors entry and read in the function", stacklevel=4)


def lookup(key: str) -> Optional[Callable]:
    """The function of ``key`` ('' -> None)."""
    if not key:
        return None
    fn = _REGISTRY.get(key)
    if fn is None:
        raise KeyError(f"fa4: no user function is registered under {key!r} (configs with score_mod / mask_mod "
                       f"compile in the process that made them)")
    return fn


def check_config(cfg, name: str, backward: bool) -> None:
    """The user-function checks of every kernel's ``can_implement`` (``cfg``: an
    ``AttnKernelConfig``; ``name`` its class name): the keys are registered, a score_mod comes
    without softcap and, in a backward, with its derivative."""
    if cfg.score_mod and cfg.has_softcap:
        raise ValueError(f"{name}.score_mod and has_softcap cannot be used together: apply the softcap inside "
                         f"score_mod")
    if backward and cfg.score_mod and not cfg.score_mod_bwd:
        raise ValueError(f"{name}.score_mod needs score_mod_bwd (the backward through a score_mod)")
    for key in (cfg.score_mod, cfg.mask_mod, cfg.score_mod_bwd):
        lookup(key)  # registered (KeyError otherwise)


def vec_size(score_mod: Callable, has_aux: bool = False) -> int:
    """Scores per ``score_mod`` call: its ``__vec_size__`` (1 or 2), else 2, or 1 with aux tensors
    (flash_attn.cute's defaults on Hopper)."""
    v = getattr(score_mod, "__vec_size__", 1 if has_aux else 2)
    if v not in (1, 2):
        raise ValueError(f"score_mod.__vec_size__ must be 1 or 2 (a thread holds pairs of adjacent scores), got {v!r}")
    return int(v)


# dtypes an aux tensor may have (torch name -> the kernel's): read by the user's functions.
AUX_DTYPES = ("float32", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
MAX_AUX_RANK = 4
MAX_AUX_COMPILED = 4  # aux tensors a torch.compile graph's custom op carries (fa4/ops.py)


@functools.lru_cache(maxsize=1)
def _dtype_names() -> dict:
    import torch

    return {getattr(torch, n): n for n in AUX_DTYPES}


def has_aux_tensors(aux: tuple) -> bool:
    """Whether an aux signature (:func:`aux_signature`) has tensors (rank > 0), not only scalars."""
    return any(ndim > 0 for _, ndim in aux)


INT32_RANGE = (-(2 ** 31), 2 ** 31 - 1)


def scalar_signature(aux_scalars) -> tuple:
    """The signature entries of ``aux_scalars`` (a list or tuple of ints and floats):
    ``(("int32", 0) | ("float32", 0), ...)``; their values stay runtime arguments."""
    if not isinstance(aux_scalars, (list, tuple)) or not aux_scalars:
        raise TypeError(f"aux_scalars must be a non-empty list or tuple of ints and floats, got "
                        f"{type(aux_scalars).__name__}")
    sig = []
    for i, x in enumerate(aux_scalars):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(f"aux_scalars[{i}] must be a Python int or float (passed as int32 / float32), got "
                            f"{type(x).__name__}")
        if isinstance(x, int) and not INT32_RANGE[0] <= x <= INT32_RANGE[1]:
            raise ValueError(f"aux_scalars[{i}] = {x} does not fit in int32")
        sig.append(("int32" if isinstance(x, int) else "float32", 0))
    return tuple(sig)


# Note [Aux tensors' unit stride]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The kernels compile an aux tensor with its last dimension's stride a constant 1 (and the others
# runtime values): a user function's index on the last dimension then becomes an address without a
# multiply. In the sm90 forward's d128 step under the document mask, 892 -> 828 SASS instructions
# (IMAD 139 -> 77: one 64-bit multiply per key column). A tensor whose last stride is not 1 (a
# transposed or strided view, an expand on the last dim) is copied contiguous at the launch
# (:func:`launch_aux`); its values are the same, and the copy is the caller's cost for that layout.


def launch_aux(aux):
    """The launch's aux arguments (tensors, then scalars) with every tensor's last stride 1 (Note
    [Aux tensors' unit stride]); None stays None."""
    if aux is None:
        return None
    import torch

    out = []
    for t in aux:
        if isinstance(t, torch.Tensor) and t.stride(-1) != 1:
            t = t.as_strided(t.shape, t.stride()[:-1] + (1,)) if t.size(-1) == 1 else t.contiguous()
        out.append(t)
    return tuple(out)


def aux_signature(aux_tensors, device, aux_scalars=None) -> tuple:
    """The compile-relevant facts of ``aux_tensors`` (a list or tuple of tensors on ``device``),
    then of ``aux_scalars`` (:func:`scalar_signature`): ``((dtype, ndim), ...)``, ndim 0 for a
    scalar. Shapes, strides and the scalars' values stay runtime values."""
    import torch

    scalars = scalar_signature(aux_scalars) if aux_scalars is not None else ()
    if aux_tensors is None:
        return scalars
    if not isinstance(aux_tensors, (list, tuple)) or not aux_tensors:
        raise TypeError(f"aux_tensors must be a non-empty list or tuple of tensors, got {type(aux_tensors).__name__}")
    sig = []
    for i, t in enumerate(aux_tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"aux_tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        name = _dtype_names().get(t.dtype)
        if name is None:
            raise TypeError(f"aux_tensors[{i}] has dtype {t.dtype}; expected one of {AUX_DTYPES}")
        if not 1 <= t.dim() <= MAX_AUX_RANK:
            raise ValueError(f"aux_tensors[{i}] must have 1 to {MAX_AUX_RANK} dimensions, got {t.dim()}")
        if device is not None and t.device != device:
            raise ValueError(f"aux_tensors[{i}] is on {t.device}; expected q's device {device}")
        if t.numel() == 0:
            raise ValueError(f"aux_tensors[{i}] is empty")
        sig.append((name, t.dim()))
    return tuple(sig) + scalars


def check_functions(score_mod, mask_mod, softcap: float, has_aux: bool, score_mod_bwd=None) -> str:
    """Validate the user functions of a call (not their tensors); returns their keys as one string,
    ``"score_mod key|mask_mod key|score_mod_bwd key"`` ('' where absent): the form the custom ops
    of ``torch.compile`` graphs carry (:func:`split_keys`). Plain Python on the functions alone,
    so a ``torch.compile`` trace takes its result as a constant (fa4/interface.py)."""
    if score_mod is not None and softcap:
        raise ValueError("softcap and score_mod cannot be used together: apply the softcap inside score_mod")
    sk = key_of(score_mod, "score_mod") if score_mod is not None else ""
    if score_mod is not None:
        vec_size(score_mod, has_aux)
    mk = key_of(mask_mod, "mask_mod") if mask_mod is not None else ""
    if score_mod_bwd is not None and score_mod is None:
        raise ValueError("score_mod_bwd is the derivative of a score_mod; no score_mod was given")
    bk = key_of(score_mod_bwd, "score_mod_bwd") if score_mod_bwd is not None else ""
    if score_mod_bwd is not None and hasattr(score_mod_bwd, "__vec_size__"):
        vec_size(score_mod_bwd, has_aux)
    return f"{sk}|{mk}|{bk}"


def split_keys(keys: str) -> tuple[str, str, str]:
    """``(score_mod, mask_mod, score_mod_bwd)`` keys of :func:`check_functions`' string ('' -> all '')."""
    if not keys:
        return "", "", ""
    sk, mk, bk = keys.split("|")
    return sk, mk, bk


def check(score_mod, mask_mod, softcap: float, aux_tensors, aux_scalars, device=None,
          score_mod_bwd=None) -> tuple[str, str, tuple, str]:
    """Validate the user functions of a call; returns the keys of ``score_mod`` and ``mask_mod`` ('' where
    absent), the aux tensors' signature (:func:`aux_signature`; ``()`` without them) and the key of
    ``score_mod_bwd``."""
    check_arguments(score_mod, mask_mod, aux_tensors, aux_scalars)
    aux = aux_signature(aux_tensors, device, aux_scalars)
    sk, mk, bk = split_keys(check_functions(score_mod, mask_mod, softcap, has_aux_tensors(aux), score_mod_bwd))
    return sk, mk, aux, bk


def check_arguments(score_mod, mask_mod, aux_tensors, aux_scalars) -> None:
    """The checks on which arguments come together."""
    for name, value in (("aux_tensors", aux_tensors), ("aux_scalars", aux_scalars)):
        if value is not None and score_mod is None and mask_mod is None:
            raise ValueError(f"{name} are read by score_mod / mask_mod only; neither was given")
