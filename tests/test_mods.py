"""score_mod / mask_mod on the CPU: keys, validation, refusals, and that the sm90 forward traces the
functions into its kernel (SASS). The results are checked on the GPU (tests/test_mods_gpu.py)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import fa4
from fa4 import mods
from fa4.config import AttnProblem


def _make_bias(slope):
    import cutlass.cute as cute

    @cute.jit
    def bias(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return scores + (kv_idx - q_idx).to(cute.Float32) * slope

    return bias


def _make_doc_mask(doc):
    import cutlass.cute as cute

    @cute.jit
    def doc_mask(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return (q_idx // doc) == (kv_idx // doc)

    return doc_mask


def test_key_follows_code_and_captured_values():
    """Note [User functions in the compile key]: a closure remade with the same values has the same
    key (one kernel), another captured value or another function another key."""
    a, b, c = _make_bias(0.5), _make_bias(0.5), _make_bias(0.25)
    assert a is not b
    assert mods.key_of(a, "score_mod") == mods.key_of(b, "score_mod")
    assert mods.key_of(a, "score_mod") != mods.key_of(c, "score_mod")
    assert mods.key_of(_make_doc_mask(64), "mask_mod") != mods.key_of(_make_doc_mask(100), "mask_mod")
    k = mods.key_of(c, "score_mod")
    assert mods.key_of(mods.lookup(k), "score_mod") == k  # the kernel traces a function of the same key
    assert mods.key_of(a, "score_mod") != mods.key_of(a, "mask_mod")


def test_key_of_an_opaque_capture_is_the_function():
    """A function capturing an object (here a tensor) is keyed by identity: two such closures never
    share a kernel, and the same one keeps its key."""
    def make(t):
        def f(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            return scores + float(t.sum())
        return f

    t = torch.zeros(2)
    f, g = make(t), make(t)
    mods._opaque_warned.clear()
    with pytest.warns(UserWarning, match="compiles anew for each call"):
        kf = mods.key_of(f, "score_mod")
    assert kf != mods.key_of(g, "score_mod")
    assert mods.key_of(f, "score_mod") == mods.key_of(f, "score_mod")
    assert mods.lookup(mods.key_of(f, "score_mod")) is f


def test_many_captured_values_warn():
    """A closure remade with a new captured value at every call compiles a kernel per value: past
    MANY_VARIANTS keys of one function a warning points to aux_tensors."""
    mods._variants.clear()
    mods._many_warned.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(mods.MANY_VARIANTS - 1):
            mods.key_of(_make_bias(3.0 + i / 1000), "score_mod")  # (values no other test uses)
        assert not [w for w in seen if "kernels" in str(w.message)]
        mods.key_of(_make_bias(4.5), "score_mod")
    assert [w for w in seen if "better passed as an aux_tensors" in str(w.message)]


def test_key_sees_vec_size_and_plain_globals():
    f = _make_bias(1.0)
    k1 = mods.key_of(f, "score_mod")
    g = _make_bias(1.0)
    g.__vec_size__ = 1
    assert mods.key_of(g, "score_mod") != k1
    assert mods.vec_size(g) == 1 and mods.vec_size(f) == 2


class _Scaled:
    def __init__(self, x):
        self.x = x

    def score_mod(self, scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return scores * self.x


_GLOBAL_SLOPE = 0.5


def _uses_global(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
    return scores * _GLOBAL_SLOPE


def test_key_sees_bound_instances_and_globals():
    """A bound method is keyed with its instance's attributes (two instances of other values do not
    share a kernel; the same values do, though each access makes a new method object); a global the
    code reads is part of the key, read at every call."""
    global _GLOBAL_SLOPE
    assert mods.key_of(_Scaled(0.5).score_mod, "score_mod") != mods.key_of(_Scaled(0.25).score_mod, "score_mod")
    a = _Scaled(0.5)
    assert mods.key_of(a.score_mod, "score_mod") == mods.key_of(a.score_mod, "score_mod")
    k1 = mods.key_of(_uses_global, "score_mod")
    _GLOBAL_SLOPE = 0.25
    try:
        assert mods.key_of(_uses_global, "score_mod") != k1
    finally:
        _GLOBAL_SLOPE = 0.5
    assert mods.key_of(_uses_global, "score_mod") == k1


def test_check_and_lookup_refusals():
    f = _make_bias(1.0)
    with pytest.raises(TypeError, match="score_mod must be a callable"):
        mods.check(3, None, 0.0, None, None)
    with pytest.raises(TypeError, match="mask_mod must be a callable"):
        mods.check(None, "x", 0.0, None, None)
    with pytest.raises(ValueError, match="softcap and score_mod"):
        mods.check(f, None, 30.0, None, None)
    with pytest.raises(ValueError, match="aux_scalars are read by score_mod / mask_mod only"):
        mods.check(None, None, 0.0, None, [1.0])
    g = _make_bias(2.0)
    g.__vec_size__ = 4
    with pytest.raises(ValueError, match="__vec_size__"):
        mods.check(g, None, 0.0, None, None)
    with pytest.raises(KeyError, match="no user function"):
        mods.lookup("score_mod:nothing:0")
    assert mods.lookup("") is None
    assert mods.check(None, None, 30.0, None, None) == ("", "", (), "")


def test_api_refusals_before_launch():
    """Through the public API (CPU tensors, the device check lifted: every check below runs before
    any device work)."""
    from fa4 import validate

    with validate.allow_any_device():
        _api_refusals()


def _api_refusals():
    q = torch.empty(2, 10, 4, 64, dtype=torch.bfloat16)
    f = _make_bias(1.0)
    with pytest.raises(ValueError, match="softcap and score_mod"):
        fa4.flash_attn_func(q, q, q, softcap=10.0, score_mod=f)
    with pytest.raises(TypeError, match=r"aux_scalars\[0\] must be a Python int or float"):
        fa4.flash_attn_func(q, q, q, score_mod=f, aux_scalars=[q])
    with pytest.raises(ValueError, match="aux_scalars are read by score_mod / mask_mod only"):
        fa4.flash_attn_func(q, q, q, aux_scalars=[1.0])
    with pytest.raises(TypeError, match="aux_tensors"):
        fa4.flash_attn_func(q, q, q, score_mod=f, aux_tensors=q)
    with pytest.raises(ValueError, match="no score_mod was given"):
        fa4.flash_attn_func(q, q, q, score_mod_bwd=f)
    with pytest.raises(TypeError, match="mask_mod must be a callable"):
        fa4.flash_attn_func(q, q, q, mask_mod=1)
    with pytest.raises(ValueError, match="ignores causal and window_size"):
        fa4.flash_attn_func(q, q, q, causal=True, mask_mod=_make_doc_mask(64))
    with pytest.raises(ValueError, match="ignores causal and window_size"):
        fa4.flash_attn_func(q, q, q, window_size=(8, 0), mask_mod=_make_doc_mask(64))
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="score_mod must be a callable"):
        fa4.flash_attn_varlen_func(q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu, score_mod="bias")


class _Captured(Exception):
    pass


def _capture_graphs(fn, *calls) -> list:
    """Trace ``fn`` with torch.compile(fullgraph=True) once per argument tuple in ``calls`` (CPU
    tensors, the device check lifted), returning the FX graphs traced, without running them
    (fa4's ops have CUDA kernels only)."""
    from fa4 import validate

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def stop(*a):
            raise _Captured()
        return stop

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for args in calls:
        with validate.allow_any_device(), pytest.raises(_Captured):
            compiled(*args)
    return graphs


def _capture_graph(fn, *args):
    (gm,) = _capture_graphs(fn, args)
    return gm


def test_torch_compile_carries_the_functions():
    """torch.compile(fullgraph=True) traces a call with a score_mod, a mask_mod with an aux tensor
    and a score_mod_bwd without a graph break: the fa4::fwd op carries the functions' keys (a
    constant of the graph, computed once at trace time) and the aux tensor in its first slot."""
    from mods_cases import doc_ids

    f = _make_bias(0.5)
    fn, _, ids = doc_ids(2, 64, "cpu")

    def call(q, k, v, ids):
        return fa4.flash_attn_func(q, k, v, score_mod=f, score_mod_bwd=f, mask_mod=fn, aux_tensors=[ids])[0]

    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    gm = _capture_graph(call, q, q, q, ids)
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and "fa4" in str(n.target)]
    assert len(ops) == 1, gm.graph
    args = ops[0].args
    keys = next(a for a in args if isinstance(a, str) and a.count("|") == 2)
    sk, mk, bk = mods.split_keys(keys)
    assert sk == mods.key_of(f, "score_mod") and mk == mods.key_of(fn, "mask_mod")
    assert bk == mods.key_of(f, "score_mod_bwd")
    assert "ids" in str(args[-4]) and tuple(args[-3:]) == (None, None, None)


def test_torch_compile_retraces_for_another_function():
    """One compiled callable called with two closures of other values (the same DSL wrapper code):
    two graphs, each with its own key (Note [User functions under torch.compile])."""
    def call(q, fn):
        return fa4.flash_attn_func(q, q, q, score_mod=fn)[0]

    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    fns = [_make_bias(0.5), _make_bias(0.25)]
    graphs = _capture_graphs(call, *[(q, fn) for fn in fns])
    assert len(graphs) == 2
    keys = [next(a for n in gm.graph.nodes if n.op == "call_function" and "fa4" in str(n.target)
                 for a in n.args if isinstance(a, str) and a.count("|") == 2) for gm in graphs]
    assert [mods.split_keys(k)[0] for k in keys] == [mods.key_of(f, "score_mod") for f in fns]


def test_torch_compile_refuses_bound_methods():
    from fa4 import validate

    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    m = _Scaled(0.5)

    def call(q):
        return fa4.flash_attn_func(q, q, q, score_mod=m.score_mod)[0]

    torch._dynamo.reset()
    with validate.allow_any_device(), pytest.raises(Exception, match="bound method"):
        torch.compile(call, fullgraph=True, backend="eager")(q)


def test_torch_compile_backward_graph_carries_the_functions():
    """AOTAutograd's backward graph of a compiled call calls fa4::bwd with the user keys and the aux
    table (captured on CPU tensors; nothing runs)."""
    from mods_cases import doc_ids
    from torch._dynamo.backends.common import aot_autograd

    from fa4 import validate

    graphs = {}

    def compiler(name):
        def comp(gm, example_inputs):
            graphs[name] = gm
            if name == "bw":
                def stop(*a):
                    raise _Captured()
                return stop
            out = next(n for n in gm.graph.nodes if n.op == "output")
            places = [n for n in gm.graph.nodes if n.op == "placeholder"]

            def run(*a):  # the forward's outputs, as zeros of their traced shapes
                return [a[places.index(o)] if o.op == "placeholder"
                        else torch.zeros(o.meta["val"].shape, dtype=o.meta["val"].dtype) for o in out.args[0]]
            return run
        return comp

    f = _make_bias(0.5)
    fn, _, ids = doc_ids(2, 64, "cpu")

    def call(q, k, v, ids):
        return fa4.flash_attn_func(q, k, v, score_mod=f, score_mod_bwd=f, mask_mod=fn, aux_tensors=[ids])[0]

    q, k, v = (torch.randn(2, 64, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
    with validate.allow_any_device(), pytest.raises(_Captured):
        torch.compile(call, fullgraph=True, backend=backend)(q, k, v, ids).float().sum().backward()
    (bwd,) = [n for n in graphs["bw"].graph.nodes if n.op == "call_function" and "fa4.bwd" in str(n.target)]
    at = next(i for i, a in enumerate(bwd.args) if isinstance(a, str) and a.count("|") == 2)
    assert mods.split_keys(bwd.args[at]) == (mods.key_of(f, "score_mod"), mods.key_of(fn, "mask_mod"),
                                             mods.key_of(f, "score_mod_bwd"))
    slots = list(bwd.args[at + 1:])  # (trailing None slots may be left out of the node)
    assert isinstance(slots[0], torch.fx.Node) and all(a is None for a in slots[1:])


def test_constant_keys_carry_dynamos_mark():
    """fa4 marks its key function as torch.compiler.assume_constant_result would, without importing
    torch._dynamo at import time: the mark must be the one that function sets."""
    from fa4 import interface

    def probe():
        return ""
    torch.compiler.assume_constant_result(probe)
    marks = {k for k in vars(probe)}
    assert marks and all(getattr(interface._constant_keys, k, None) == vars(probe)[k] for k in marks)


def test_torch_compile_refuses_too_many_aux_tensors():
    from fa4 import validate

    fn, _, ids = __import__("mods_cases").doc_ids(2, 64, "cpu")
    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)

    def call(q):
        return fa4.flash_attn_func(q, q, q, mask_mod=fn, aux_tensors=[ids] * (mods.MAX_AUX_COMPILED + 1))[0]

    torch._dynamo.reset()
    with validate.allow_any_device(), pytest.raises(Exception, match="at most 4 aux_tensors"):
        torch.compile(call, fullgraph=True, backend="eager")(q)


def test_aux_tensor_requiring_grad_warns():
    """aux_tensors get no gradient (as in flash_attn.cute): one warning, not silence (seen before any
    launch: the device check is lifted and the call fails later on the CPU)."""
    from fa4 import interface, validate

    interface._aux_grad_warned.clear()
    table = torch.zeros(8, 8, requires_grad=True)
    q = torch.empty(2, 8, 4, 64, dtype=torch.bfloat16)
    with validate.allow_any_device(), pytest.warns(UserWarning, match="aux_tensors get no gradient"):
        with pytest.raises(Exception):  # noqa: B017 - past the checks, nothing runs on a CPU
            fa4.flash_attn_func(q, q, q, mask_mod=_make_doc_mask(64), aux_tensors=[table])


def test_aux_tensor_requiring_grad_warns_under_torch_compile():
    """The same warning from a fullgraph trace (dynamo runs it once at trace time; ``warnings.warn``
    itself would break the graph)."""
    from mods_cases import doc_ids

    from fa4 import interface

    interface._aux_grad_warned.clear()
    fn, _, ids = doc_ids(2, 64, "cpu")
    table = ids.float().requires_grad_()

    def call(q, table):
        return fa4.flash_attn_func(q, q, q, mask_mod=fn, aux_tensors=[table])[0]

    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="aux_tensors get no gradient"):
        _capture_graph(call, q, table)


def test_backward_traces_the_derivative():
    """The score_mod_bwd is compiled into the backward where dS is formed: the same config with a
    tanh derivative has MUFU.TANH in its SASS, with the identity derivative none (ALiBi score_mod)."""
    from mods_cases import SCORE_MODS, derivative

    from fa4 import sass
    from fa4.bwd import sm90 as bwd90

    sk = mods.key_of(SCORE_MODS["alibi"]()[0], "score_mod")
    counts = []
    for name in ("alibi", "tanh_cap"):
        bk = mods.key_of(derivative(name), "score_mod_bwd")
        p = AttnProblem("bf16", 2, 1000, 1000, 8, 2, 128, 128, 128 ** -0.5, score_mod=sk, score_mod_bwd=bk)
        counts.append(sass.count(sass.opcode_counts(sass.disassemble(bwd90.make_config(p, None, "sm_90a", False))),
                                 "MUFU.TANH"))
    assert counts[0] == 0 and counts[1] > 0


def test_configs_with_functions_stay_in_memory():
    from fa4 import jit
    from fa4.fwd import sm90

    sk = mods.key_of(_make_bias(0.5), "score_mod")
    p = AttnProblem("bf16", 2, 512, 512, 4, 4, 64, 64, 0.125, score_mod=sk)
    cfg = sm90.make_config(p, None, "sm_90a", True)
    assert cfg.score_mod == sk and not cfg.disk_cacheable
    plain = sm90.make_config(dataclasses.replace(p, score_mod=""), None, "sm_90a", True)
    assert plain.disk_cacheable and dataclasses.replace(cfg, score_mod="") == plain
    with pytest.raises(ValueError, match="not disk-cached"):
        jit.precompile(cfg)


@pytest.mark.parametrize("det", [False, True])
def test_sm80_backward_traces_the_functions(det):
    """The sm80 family's backward with a score_mod + its derivative and an aux-table mask_mod:
    compiled for sm_80 (deterministic too), more instructions than without them; a score_mod
    without its derivative is refused."""
    from mods_cases import SCORE_MODS, derivative, doc_ids

    from fa4 import sass
    from fa4.bwd import sm80 as bwd80

    sk = mods.key_of(SCORE_MODS["tanh_cap"]()[0], "score_mod")
    bk = mods.key_of(derivative("tanh_cap"), "score_mod_bwd")
    fn, _, ids = doc_ids(2, 1000, "cpu")
    mk, aux = mods.key_of(fn, "mask_mod"), mods.aux_signature([ids], None)
    p = AttnProblem("bf16", 2, 1000, 1000, 8, 2, 128, 128, 128 ** -0.5, score_mod=sk, mask_mod=mk, aux=aux,
                    score_mod_bwd=bk)
    with pytest.raises(ValueError, match="score_mod needs score_mod_bwd"):
        bwd80.make_config(dataclasses.replace(p, score_mod_bwd=""), None, "sm_80", det)
    cfg = bwd80.make_config(p, None, "sm_80", det)
    assert (cfg.score_mod, cfg.mask_mod, cfg.score_mod_bwd, cfg.aux) == (sk, mk, bk, aux)
    ops = sass.opcode_counts(sass.disassemble(cfg))
    assert sass.count(ops, "MUFU.TANH")  # the score_mod and its derivative
    plain = sass.opcode_counts(sass.disassemble(dataclasses.replace(cfg, score_mod="", mask_mod="", aux=(),
                                                                    score_mod_bwd="")))
    assert sum(ops.values()) > sum(plain.values())


@pytest.mark.parametrize("case", ["plain", "packed_split_aux"])
def test_sm80_forward_traces_the_functions(case):
    """The sm80 family's forward (Ampere, and what runs on a GPU without a family of its own) with a
    score_mod and a mask_mod: compiled for sm_80, more instructions than without them; packed GQA
    with split-KV and an aux table."""
    from mods_cases import SCORE_MODS, doc_ids

    from fa4 import sass
    from fa4.fwd import sm80

    sk = mods.key_of(SCORE_MODS["alibi"]()[0], "score_mod")
    if case == "plain":
        mk, aux = mods.key_of(_make_doc_mask(64), "mask_mod"), ()
        p = AttnProblem("bf16", 2, 1000, 1000, 4, 2, 128, 128, 128 ** -0.5, score_mod=sk, mask_mod=mk)
    else:
        fn, _, ids = doc_ids(4, 3000, "cpu")
        mk, aux = mods.key_of(fn, "mask_mod"), mods.aux_signature([ids], None)
        p = AttnProblem("bf16", 4, 4, 3000, 16, 2, 128, 128, 128 ** -0.5, score_mod=sk, mask_mod=mk, aux=aux)
    cfg = sm80.make_config(p, None, "sm_80", True)
    if case != "plain":
        assert cfg.qhead_per_kvhead > 1 and cfg.split_kv and cfg.aux == aux
    ops = sass.opcode_counts(sass.disassemble(cfg))
    plain = sass.opcode_counts(sass.disassemble(dataclasses.replace(cfg, score_mod="", mask_mod="", aux=())))
    assert sum(ops.values()) > sum(plain.values())


def test_sm90_backward_takes_the_functions():
    """The sm90 backward (main kernel and dQ pass) carries the mask_mod, the score_mod with its
    score_mod_bwd and the aux signature into its configs; a score_mod without score_mod_bwd it
    refuses."""
    from fa4.bwd import dq_sm90
    from fa4.bwd import sm90 as bwd90

    mk = mods.key_of(_make_doc_mask(64), "mask_mod")
    p = AttnProblem("bf16", 2, 512, 512, 4, 4, 256, 256, 0.0625, mask_mod=mk, aux=(("int32", 2),))
    cfg = bwd90.make_config(p, None, "sm_90a", False)
    assert cfg.mask_mod == mk and cfg.aux == (("int32", 2),) and not cfg.disk_cacheable and cfg.dq_pass
    dcfg = dq_sm90.config_for(cfg)
    assert dcfg.mask_mod == mk and dcfg.aux == cfg.aux
    f = _make_bias(0.5)
    sk, bk = mods.key_of(f, "score_mod"), mods.key_of(f, "score_mod_bwd")
    with pytest.raises(ValueError, match="score_mod needs score_mod_bwd"):
        bwd90.make_config(dataclasses.replace(p, score_mod=sk, mask_mod=""), None, "sm_90a", False)
    cfg = bwd90.make_config(dataclasses.replace(p, score_mod=sk, score_mod_bwd=bk), None, "sm_90a", False)
    assert (cfg.score_mod, cfg.score_mod_bwd) == (sk, bk)
    assert dq_sm90.config_for(cfg).score_mod_bwd == bk
    # The forward configs do not take the derivative (one forward kernel whatever it is).
    from fa4.fwd import sm90

    assert sm90.make_config(dataclasses.replace(p, score_mod=sk, score_mod_bwd=bk), None, "sm_90a",
                            True).score_mod_bwd == ""


BWD_VARIANTS = [(128, {}, None, False), (64, {}, None, True), (128, {}, "2cta", False), (256, {}, None, False)]


@pytest.mark.parametrize("d,name,causal", [(128, "tanh_cap", True), (256, "alibi", False)])
def test_sm90_backward_traces_score_mod(d, name, causal):
    """The backward through a score_mod and its score_mod_bwd compiles (d128 causal in the main
    kernel, d256 with a mask_mod too, through the dQ pass), HGMMA in each kernel's SASS, more
    instructions than without them."""
    from mods_cases import MASK_MODS, SCORE_MODS, derivative

    from fa4 import sass
    from fa4.bwd import dq_sm90
    from fa4.bwd import sm90 as bwd90

    sk = mods.key_of(SCORE_MODS[name]()[0], "score_mod")
    bk = mods.key_of(derivative(name), "score_mod_bwd")
    mk = mods.key_of(MASK_MODS["doc64"]()[0], "mask_mod") if d == 256 else ""
    p = AttnProblem("bf16", 2, 1000, 1000, 8, 2, d, d, d ** -0.5, causal=causal, score_mod=sk, mask_mod=mk,
                    score_mod_bwd=bk)
    cfg = bwd90.make_config(p, None, "sm_90a", False)
    assert cfg.dq_pass == (d == 256)
    for c in [cfg] + ([dq_sm90.config_for(cfg)] if cfg.dq_pass else []):
        ops = sass.opcode_counts(sass.disassemble(c))
        assert sass.count(ops, "HGMMA")
        plain = sass.opcode_counts(sass.disassemble(dataclasses.replace(c, score_mod="", mask_mod="",
                                                                        score_mod_bwd="")))
        assert sum(ops.values()) > sum(plain.values())


@pytest.mark.parametrize("d,kw,opt,det", BWD_VARIANTS, ids=["d128-aux", "d64-det", "d128-2cta", "d256-dqpass"])
def test_sm90_backward_traces_mask_mod(d, kw, opt, det):
    """The sm90 backward with a mask_mod compiles (1-CTA, deterministic, 2-CTA, and from d256 the
    dQ pass, an aux doc-id table in one), HGMMA in its SASS, more instructions than without it."""
    from mods_cases import doc_ids

    from fa4 import sass
    from fa4.bwd import dq_sm90
    from fa4.bwd import sm90 as bwd90
    from fa4.config import KernelOptions

    if d == 128 and opt is None:
        fn, _, ids = doc_ids(2, 1000, "cpu")
        mk, aux = mods.key_of(fn, "mask_mod"), mods.aux_signature([ids], None)
    else:
        mk, aux = mods.key_of(_make_doc_mask(64), "mask_mod"), ()
    p = AttnProblem("bf16", 2, 1000, 1000, 8, 2, d, d, d ** -0.5, mask_mod=mk, aux=aux, **kw)
    cfg = bwd90.make_config(p, KernelOptions(bwd_two_cta=True) if opt == "2cta" else None, "sm_90a", det)
    assert cfg.two_cta == (opt == "2cta") and cfg.deterministic == det
    kernels = [cfg] + ([dq_sm90.config_for(cfg)] if cfg.dq_pass else [])
    assert cfg.dq_pass == (d == 256)
    for c in kernels:
        ops = sass.opcode_counts(sass.disassemble(c))
        assert sass.count(ops, "HGMMA")
        plain = sass.opcode_counts(sass.disassemble(dataclasses.replace(c, mask_mod="", aux=())))
        assert sum(ops.values()) > sum(plain.values())


def test_explain_names_the_functions():
    q = torch.empty(2, 300, 4, 64, dtype=torch.bfloat16)
    ex = fa4.explain(q, q, q, capability=(9, 0), score_mod=_make_bias(0.5), mask_mod=_make_doc_mask(64))
    text = str(ex)
    assert "score_mod / mask_mod" in text
    assert ex.directions["fwd"]["config"]["score_mod"].startswith("score_mod:bias:")
    assert ex.directions["fwd"]["config"]["mask_mod"].startswith("mask_mod:doc_mask:")
    assert "process memory only" in ex.directions["fwd"]["cache"]
    assert "needs score_mod_bwd" in ex.directions["bwd"]["error"]
    ex = fa4.explain(q, q, q, capability=(9, 0), score_mod=_make_bias(0.5), score_mod_bwd=_make_bias(0.5))
    assert ex.directions["bwd"]["config"]["score_mod_bwd"].startswith("score_mod_bwd:bias:")


@pytest.mark.parametrize("kind", ["score", "mask", "both_causal_packed_split"])
def test_sm90_traces_the_functions(kind):
    """The functions are compiled into the sm90 forward: HGMMA and UTMALDG as every variant, and the
    kernel differs from the same config without them (more instructions: the indices, the bias /
    the mask). Pack GQA with split-KV covers the packed head index."""
    from fa4 import sass
    from fa4.fwd import sm90

    sk = mods.key_of(_make_bias(0.03125), "score_mod") if kind != "mask" else ""
    mk = mods.key_of(_make_doc_mask(64), "mask_mod") if kind != "score" else ""
    if kind == "both_causal_packed_split":
        p = AttnProblem("bf16", 8, 1, 8192, 8, 2, 128, 128, 128 ** -0.5, causal=True, score_mod=sk, mask_mod=mk)
    else:
        p = AttnProblem("bf16", 2, 1024, 1024, 4, 4, 64, 64, 0.125, score_mod=sk, mask_mod=mk)
    cfg = sm90.make_config(p, None, "sm_90a", True)
    if kind == "both_causal_packed_split":
        assert cfg.qhead_per_kvhead == 4 and cfg.split_kv
    ops = sass.opcode_counts(sass.disassemble(cfg))
    assert sass.count(ops, "HGMMA") and sass.count(ops, "UTMALDG")
    plain = sass.opcode_counts(sass.disassemble(dataclasses.replace(cfg, score_mod="", mask_mod="")))
    assert sum(ops.values()) > sum(plain.values())


PAIRS = [("identity", "causal_mask", {}), ("alibi", "doc64", dict(varlen_q=True, varlen_k=True)),
         ("tanh_cap", None, dict(local=True, window_left=100, window_right=0)), ("alibi", None, dict(causal=True)),
         ("batch_bias", "head_parity", dict(pack=True)), (None, "blind7", {}), ("tanh_cap", "causal_doc100", {}),
         (None, "doc100", {})]


@pytest.mark.parametrize("score,mask,kw", PAIRS, ids=[f"{s}-{m}" for s, m, _ in PAIRS])
def test_gpu_test_functions_compile(score, mask, kw):
    """Every function of tests/mods_cases.py traces and compiles into the sm90 forward (the GPU
    tests' functions; a typo in one costs no device time)."""
    from mods_cases import MASK_MODS, SCORE_MODS

    from fa4 import jit
    from fa4.fwd import sm90

    sk = mods.key_of(SCORE_MODS[score]()[0], "score_mod") if score else ""
    mk = mods.key_of(MASK_MODS[mask]()[0], "mask_mod") if mask else ""
    kw = dict(kw)
    if kw.pop("pack", False):
        p = AttnProblem("bf16", 4, 4, 3000, 16, 2, 128, 128, 128 ** -0.5, score_mod=sk, mask_mod=mk)
    else:
        p = AttnProblem("bf16", 2, 1000, 1000, 4, 2, 64, 64, 0.125, score_mod=sk, mask_mod=mk,
                        total_q=1500 if kw.get("varlen_q") else 0, total_k=1500 if kw.get("varlen_k") else 0, **kw)
    cfg = sm90.make_config(p, None, "sm_90a", True)
    jit.compile_uncached(cfg, engine=False)


@pytest.mark.parametrize("which", ["doc_ids", "rel_bias"])
def test_aux_functions_compile(which):
    """The aux-tensor functions of tests/mods_cases.py trace and compile with their tables as
    kernel arguments (a 2-D int32 and a 2-D float32 tensor), varlen and packed GQA."""
    from mods_cases import doc_ids, rel_bias_table

    from fa4 import jit
    from fa4.fwd import sm90

    if which == "doc_ids":
        fn, _, t = doc_ids(2, 1000, "cpu")
        p = AttnProblem("bf16", 2, 1000, 1000, 4, 2, 64, 64, 0.125, varlen_q=True, varlen_k=True, total_q=1500,
                        total_k=1500, mask_mod=mods.key_of(fn, "mask_mod"), aux=mods.aux_signature([t], None))
    else:
        fn, _, t = rel_bias_table(16, 3000, "cpu")
        p = AttnProblem("bf16", 4, 4, 3000, 16, 2, 128, 128, 128 ** -0.5, score_mod=mods.key_of(fn, "score_mod"),
                        aux=mods.aux_signature([t], None))
    cfg = sm90.make_config(p, None, "sm_90a", True)
    assert cfg.aux == ((("int32" if which == "doc_ids" else "float32"), 2),) and not cfg.disk_cacheable
    jit.compile_uncached(cfg, engine=False)


def test_launch_aux_gives_unit_last_strides():
    """Note [Aux tensors' unit stride]: the kernels compile an aux tensor's last stride as the constant
    1; a launch passes unit-stride tensors as they are, copies others (same values), takes a size-1
    last dim at stride 1 without a copy, and passes scalars and None through."""
    from fa4.mods_kernel import fake_aux

    assert mods.launch_aux(None) is None
    base = torch.arange(24, dtype=torch.int32).view(4, 6)
    strided, transposed, column = base[:, ::2], base.t(), base[:, :1].t().contiguous().t()
    assert column.stride(-1) != 1 and column.size(-1) == 1
    out = mods.launch_aux((base, strided, transposed, column, 3, 0.5))
    assert out[0] is base and out[4:] == (3, 0.5)
    for got, want in zip(out[1:4], (strided, transposed, column)):
        assert got.stride(-1) == 1 and torch.equal(got, want)
    assert out[3].data_ptr() == column.data_ptr()  # a view, not a copy
    fakes = fake_aux((("int32", 2), ("float32", 1), ("int32", 0)))
    assert fakes[0].stride[-1] == 1 and fakes[1].stride[-1] == 1


def test_aux_tensor_checks():
    f = _make_doc_mask(64)
    with pytest.raises(TypeError, match="non-empty list or tuple"):
        mods.check(None, f, 0.0, torch.zeros(3), None)
    with pytest.raises(TypeError, match=r"aux_tensors\[1\] must be a torch.Tensor"):
        mods.check(None, f, 0.0, [torch.zeros(3), 3], None)
    with pytest.raises(TypeError, match="dtype torch.complex64"):
        mods.check(None, f, 0.0, [torch.zeros(3, dtype=torch.complex64)], None)
    with pytest.raises(ValueError, match="1 to 4 dimensions"):
        mods.check(None, f, 0.0, [torch.zeros(())], None)
    with pytest.raises(ValueError, match="expected q's device"):
        mods.check(None, f, 0.0, [torch.zeros(3)], None, torch.device("meta"))
    with pytest.raises(ValueError, match="neither was given"):
        mods.check(None, None, 0.0, [torch.zeros(3)], None)
    assert mods.check(None, f, 0.0, [torch.zeros(3, 4, dtype=torch.int32)], None)[2] == (("int32", 2),)


def test_aux_scalar_checks():
    """aux_scalars: ints (int32) and floats (float32); their types are the signature, their values
    are not (another value, the same kernel)."""
    f = _make_doc_mask(64)
    assert mods.check(None, f, 0.0, None, (0.5, 7))[2] == (("float32", 0), ("int32", 0))
    assert mods.check(None, f, 0.0, None, [2.0, -3])[2] == mods.check(None, f, 0.0, None, (0.5, 7))[2]
    assert mods.check(None, f, 0.0, None, (1, 2.0))[2] == (("int32", 0), ("float32", 0))
    ids = torch.zeros(3, 4, dtype=torch.int32)
    assert mods.check(None, f, 0.0, [ids], (3,))[2] == (("int32", 2), ("int32", 0))  # tensors, then scalars
    assert not mods.has_aux_tensors(mods.check(None, f, 0.0, None, (3,))[2])
    for bad, err, match in (((True,), TypeError, "must be a Python int or float"),
                            ((torch.tensor(1.0),), TypeError, "got Tensor"),
                            ((2 ** 31,), ValueError, "does not fit in int32"),
                            ((), TypeError, "non-empty list or tuple"),
                            (1.0, TypeError, "non-empty list or tuple")):
        with pytest.raises(err, match=match):
            mods.check(None, f, 0.0, None, bad)


def test_torch_compile_refuses_aux_scalars():
    from fa4 import validate

    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    f = _make_bias(0.5)

    def call(q):
        return fa4.flash_attn_func(q, q, q, score_mod=f, aux_scalars=(1.0,))[0]

    torch._dynamo.reset()
    with validate.allow_any_device(), pytest.raises(Exception, match="aux_scalars under torch.compile"):
        torch.compile(call, fullgraph=True, backend="eager")(q)


@pytest.mark.parametrize("kind", ["fwd90", "fwd80", "bwd90", "bwd90_d256", "bwd80", "doc_window"])
def test_aux_scalar_functions_compile(kind):
    """Functions reading aux_scalars (tests/mods_cases.py) trace and compile with the scalars as
    runtime kernel arguments, with and without aux tensors, in every family and direction."""
    from mods_cases import doc_ids_window, scalar_alibi_band

    from fa4 import jit
    from fa4.bwd import sm80 as bwd80
    from fa4.bwd import sm90 as bwd90
    from fa4.fwd import sm80, sm90

    d = 256 if kind == "bwd90_d256" else 128
    if kind == "doc_window":
        fn, _, ids = doc_ids_window(2, 1000, "cpu")
        p = AttnProblem("bf16", 2, 1000, 1000, 8, 2, d, d, d ** -0.5, mask_mod=mods.key_of(fn, "mask_mod"),
                        aux=mods.aux_signature([ids], None, (64,)))
        cfgs = [sm90.make_config(p, None, "sm_90a", True), bwd90.make_config(p, None, "sm_90a", False)]
    else:
        sm, sb, mm, _, _ = scalar_alibi_band()
        p = AttnProblem("bf16", 2, 1000, 1000, 8, 2, d, d, d ** -0.5, score_mod=mods.key_of(sm, "score_mod"),
                        mask_mod=mods.key_of(mm, "mask_mod"), score_mod_bwd=mods.key_of(sb, "score_mod_bwd"),
                        aux=mods.aux_signature(None, None, (0.1, 300)))
        mod = {"fwd90": sm90, "fwd80": sm80, "bwd90": bwd90, "bwd90_d256": bwd90, "bwd80": bwd80}[kind]
        cfgs = [mod.make_config(p, None, "sm_80" if kind.endswith("80") else "sm_90a", kind.startswith("fwd"))]
    for cfg in cfgs:
        assert cfg.aux == p.aux and not cfg.disk_cacheable
        jit.compile_uncached(cfg, engine=False)


@pytest.mark.parametrize("name", ["mods-alibi-d128", "mods-docmask-d128", "mods-relbias-d128-causal"])
def test_offgrid_functions_compile(name):
    """The bench's user-function cases (fa4/offgrid.py USER_FUNCS) validate and compile."""
    from fa4 import jit, offgrid
    from fa4.fwd import sm90

    case, make = offgrid.USER_FUNCS[name]
    q = torch.empty(2, 256, 4, 128, dtype=torch.bfloat16)
    kw = make(q)
    sk, mk, aux, bk = mods.check(kw.get("score_mod"), kw.get("mask_mod"), 0.0, kw.get("aux_tensors"), None,
                                 score_mod_bwd=kw.get("score_mod_bwd"))
    p = AttnProblem("bf16", 2, 256, 256, 4, 4, 128, 128, 128 ** -0.5, causal=case[5], score_mod=sk, mask_mod=mk,
                    aux=aux, score_mod_bwd=bk)
    jit.compile_uncached(sm90.make_config(p, None, "sm_90a", True), engine=False)
    if bk or mk:  # the bench times the backward of these too
        from fa4.bwd import sm90 as bwd90

        jit.compile_uncached(bwd90.make_config(p, None, "sm_90a", False), engine=False)


@pytest.mark.parametrize("case", ["paged", "sink", "one_step_loop"])
def test_functions_compile_on_other_paths(case):
    """The sm90 forward with user functions on the paths the GPU tests take through the same step:
    a paged cache, a learnable sink, and one_step_loop (causal, one step body)."""
    from mods_cases import MASK_MODS, SCORE_MODS

    from fa4 import jit
    from fa4.fwd import sm90

    sk = mods.key_of(SCORE_MODS["alibi"]()[0], "score_mod")
    mk = mods.key_of(MASK_MODS["head_parity"]()[0], "mask_mod") if case != "one_step_loop" else ""
    kw = dict(paged=dict(page_size=16, has_seqused_k=True, varlen_k=False), sink=dict(has_sink=True),
              one_step_loop=dict(causal=True))[case]
    p = AttnProblem("bf16", 3, 5 if case == "paged" else 1000, 900 if case == "paged" else 1000, 16, 2, 128, 128,
                    128 ** -0.5, score_mod=sk, mask_mod=mk, **kw)
    cfg = sm90.make_config(p, None, "sm_90a", True)
    if case == "one_step_loop":
        cfg = dataclasses.replace(cfg, one_step_loop=True)
    assert (cfg.page_rows > 0) == (case == "paged") and cfg.has_sink == (case == "sink")
    jit.compile_uncached(cfg, engine=False)


def test_key_is_stable_across_the_first_trace():
    """The DSL rewrites a function's ``__code__`` when it first traces it; the key is of the code as
    first seen, so the next call finds the kernel the first compiled (v0.31: it compiled again)."""
    from mods_cases import SCORE_MODS

    from fa4 import jit
    from fa4.fwd import sm90

    fn = SCORE_MODS["alibi"]()[0]
    before = mods.key_of(fn, "score_mod")
    p = AttnProblem("bf16", 2, 256, 256, 4, 4, 64, 64, 0.125, score_mod=before)
    jit.compile_uncached(sm90.make_config(p, None, "sm_90a", True), engine=False)
    assert mods.key_of(fn, "score_mod") == before
    assert mods.key_of(SCORE_MODS["alibi"]()[0], "score_mod") == before  # a new closure of the same values


def test_torch_compile_refuses_functions_before_torch_2_13(monkeypatch):
    """Torch before 2.13 guards a function argument by its code only (the DSL's shared wrapper), so a
    compiled callable would keep its first function: fa4 refuses the trace there."""
    from fa4 import interface, validate

    monkeypatch.setattr(interface, "_dynamo_guards_function_ids", lambda: False)
    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    f = _make_bias(0.5)

    def call(q):
        return fa4.flash_attn_func(q, q, q, score_mod=f)[0]

    torch._dynamo.reset()
    with validate.allow_any_device(), pytest.raises(Exception, match="need torch >= 2.13"):
        torch.compile(call, fullgraph=True, backend="eager")(q)


@pytest.mark.slow
def test_document_mask_columns_share_one_address():
    """Note [Score positions]: a mask_mod that reads a table at each key (the off-grid document
    mask, sm90 forward d128) loads its 32 key columns per step from one 64-bit address plus
    immediate offsets, not one address computation per column (v0.36: 34 address registers for
    34 loads, the step 892 SASS instructions; with the positions, 642)."""
    import re

    from fa4 import offgrid, sass
    from fa4.config import AttnProblem
    from fa4.fwd import sm90

    case, make = offgrid.USER_FUNCS["mods-docmask-d128"]
    kw = make(torch.empty(2, 256, 4, 128, dtype=torch.bfloat16))
    sk, mk, aux, bk = mods.check(kw.get("score_mod"), kw.get("mask_mod"), 0.0, kw.get("aux_tensors"), None)
    p = AttnProblem("bf16", 2, 8192, 8192, 16, 16, 128, 128, 128 ** -0.5, score_mod=sk, mask_mod=mk, aux=aux,
                    score_mod_bwd=bk)
    text = sass.disassemble(sm90.make_config(p, None, "sm_90a", True))
    steps = [b for b in sass.loop_bodies(text)
             if sum(x.startswith("HGMMA") for x in b) == 16 and sum("LDG" in x for x in b) >= 32]
    assert steps, "no K-block step with the mask's loads"
    for body in steps:
        addresses = {m.group(1) for x in body for m in [re.search(r"LDG\S* \S+ desc\[\w+\]\[(R\d+)\.64", x)] if m}
        assert len(addresses) <= 4, sorted(addresses)
