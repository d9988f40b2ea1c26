"""Every kernel variant fa4 has compiles, with fake tensors and no GPU, for every arch it claims.

The variants are each kernel module's covering set (`variants(arch)`: every head-dim bucket, every
flag value at least once; `fa4.arch.KERNEL_MODULES` lists the modules). Each compiled kernel is
exported to an object file, and the cubin inside must be for the arch asked for, within the
register file, without large spills. sm_100a objects are checked the same way; no Blackwell GPU
ran them.

The compiles of the selected cases run in a pool of processes, one per core (each compile is
single-threaded; CI's wall time is mostly these compiles), in the order the tests run; each test
waits for its own case. ``FA4_COMPILE_TEST_JOBS`` sets the pool size (1: compile in the test).
"""

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from fa4 import arch, sass
from fa4.config import ARCHS

CASES = [(a, cfg) for a in ARCHS for cfg in arch.all_variants(a)]


def _id(case):
    a, cfg = case
    d = cfg.describe()
    flags = "-".join(k for k, v in d.items() if v is True)
    return f"{a}-{type(cfg).__name__}-d{d.get('head_dim', '')}-{d.get('dtype')}{('-' + flags) if flags else ''}"


def test_every_arch_has_variants():
    for a in ARCHS:
        kinds = {type(c).__name__ for c in arch.all_variants(a)}
        assert {"FwdSm80Config", "BwdSm80Config", "BwdPreprocessConfig", "BwdPostprocessConfig"} <= kinds, (a, kinds)
    assert {"FwdSm90Config", "BwdSm90Config"} <= {type(c).__name__ for c in arch.all_variants("sm_90a")}


def test_sm90_sass_check_has_a_disassembler():
    """The HGMMA / UTMALDG check of the sm90 variants needs nvdisasm (a test dependency): fail, do
    not skip, when it is missing, so the check cannot silently pass."""
    assert sass.nvdisasm_path() is not None


@pytest.fixture(scope="module")
def compiled(request):
    """``cfg -> future of sass.compile_report(cfg)`` for the cases this session selected."""
    cfgs = []
    for item in request.session.items:
        if getattr(item, "originalname", None) == "test_variant_compiles_for_its_arch":
            cfg = item.callspec.params["case"][1]
            if cfg not in cfgs:
                cfgs.append(cfg)
    jobs = int(os.environ.get("FA4_COMPILE_TEST_JOBS", "0")) or (os.cpu_count() or 1)
    if jobs <= 1 or len(cfgs) <= 1:
        yield None
        return
    # spawn, not fork: the pytest process holds torch's threads
    ex = ProcessPoolExecutor(max_workers=min(jobs, len(cfgs)), mp_context=multiprocessing.get_context("spawn"))
    try:
        yield {cfg: ex.submit(sass.compile_report, cfg) for cfg in cfgs}
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_variant_compiles_for_its_arch(case, compiled):
    a, cfg = case
    report = compiled[cfg].result() if compiled is not None else sass.compile_report(cfg)
    cubins = report["cubins"]
    assert cubins, "no cubin in the exported object"
    want = int(a[3:].rstrip("a"))
    assert {c["sm"] for c in cubins} == {want}, cubins
    for c in cubins:
        assert 0 < c["registers"] <= 255, c
        assert c["frame_bytes"] <= 1024, f"{c['frame_bytes']} bytes of stack (spills): {cfg.key()}"
        if type(cfg).__name__ == "BwdSm80Config":
            # A few spilled words at most (the one-stage hdim-128 variant spills 16 bytes on sm_90a).
            assert c["frame_bytes"] <= 64, c
    required = getattr(type(cfg), "REQUIRED_SASS", ())
    # A family defined by its instructions (sm90: wgmma and TMA) must really use them.
    assert set(report["required"]) == set(required), report["required"]
    for op in required:
        assert report["required"][op] > 0, f"no {op} in the SASS of {cfg.key()}"


@pytest.fixture(scope="module")
def one_step_sass():
    """SASS of the d128 causal one_step_loop compile variant and of the same config with separate
    loops, compiled once for the tests below: ``{"one": text, "sep": text}``."""
    one = next(c for c in arch.all_variants("sm_90a")
               if type(c).__name__ == "FwdSm90Config" and c.one_step_loop and c.causal and c.head_dim == 128)
    return {"one": sass.disassemble(one), "sep": sass.disassemble(dataclasses.replace(one, one_step_loop=False))}


@pytest.mark.slow
def test_one_step_window_branch_stays_uniform(one_step_sass):
    """Note [A uniform window branch]: with one step body, the sm90 forward's window mask sits under
    a runtime branch that ptxas must see as warp-uniform; else it wraps it in convergence barriers
    (d128 causal: 18 BSSY against 2) and slows every free block. The one-body kernel may hold no
    more BSSY than the same kernel with separate loops."""
    bssy = {k: sum(1 for line in text.splitlines() if "BSSY" in line) for k, text in one_step_sass.items()}
    assert bssy["one"] <= bssy["sep"], bssy


def _step_loops(text: str):
    """Each K-block loop of the SASS ``text`` (one step: at most 16 wgmmas, with exponentials) and
    the index of its wait for the previous P V (``wait_group(0)``), in address order."""
    for body in sass.loop_bodies(text):
        wgmmas = sum(1 for x in body if x.startswith("HGMMA"))
        wait = next((i for i, x in enumerate(body) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in x), None)
        if 0 < wgmmas <= 16 and wait is not None and any("MUFU.EX2" in x for x in body):
            yield body, wait


def _max_before_pv_wait(text: str) -> list[int]:
    """For each K-block loop of the SASS ``text``: the row-max instructions (FMNMX) ahead of its
    wait for the previous P V."""
    return [sum(1 for x in body[:wait] if x.startswith("FMNMX")) for body, wait in _step_loops(text)]


@pytest.mark.slow
def test_one_step_row_max_overlaps_pv(one_step_sass):
    """Note [K's release after the mask]: in the one-body loop the row max runs while the previous
    block's P V is in flight, as in the separate loops (released before the mask, K's arrive held
    the wait for P V at the top of the row max: 1 FMNMX ahead of it, against 68)."""
    counts = {k: _max_before_pv_wait(text) for k, text in one_step_sass.items()}
    assert counts["one"] and counts["sep"], counts
    assert min(counts["one"]) >= 16 and min(counts["sep"]) >= 16, counts


@pytest.mark.slow
def test_o_staged_by_stmatrix():
    """Note [O staged by stmatrix]: with ``stmatrix_o`` the d64 causal forward stages O by four
    ``stmatrix`` a thread (no 32-bit stores of O: one STS remains, not O's), and every K-block loop,
    the masked one included, holds the row max ahead of its wait for the previous P V. With 32-bit
    stores the masked loop waited at the top of its row max (0 FMNMX ahead; 68 with stmatrix, on
    both DSL flavors)."""
    from fa4.config import AttnProblem
    from fa4.fwd import sm90

    p = AttnProblem("bf16", 2, 8192, 8192, 32, 32, 64, 64, 0.125, causal=True)
    cfg = dataclasses.replace(sm90.make_config(p, None, "sm_90a", True), stmatrix_o=True)
    text = sass.disassemble(cfg)
    ops = sass.opcode_counts(text)
    assert sass.count(ops, "STSM") == 4 and sass.count(ops, "STS") <= 1, ops
    counts = _max_before_pv_wait(text)
    assert len(counts) >= 2 and min(counts) >= 16, counts


@pytest.mark.slow
def test_packed_rows_go_by_tma():
    """Note [Packed rows by TMA]: the sm90 forward's packed GQA rows (4 q heads per kv head in 128
    rows) are loaded by a 5-D TMA box (d, heads, positions, kv head, batch) and, without varlen Q,
    stored by one; with ``pack_tma`` off neither box exists (the consumers copy rows)."""
    packed = next(c for c in arch.all_variants("sm_90a")
                  if type(c).__name__ == "FwdSm90Config" and c.qhead_per_kvhead == 4 and c.tile_m == 128
                  and c.varlen_q and c.pack_tma)
    dense = dataclasses.replace(packed, varlen_q=False, varlen_k=False)

    def boxes(cfg):
        text = sass.disassemble(cfg)
        return (sum(1 for line in text.splitlines() if "UTMALDG.5D" in line),
                sum(1 for line in text.splitlines() if "UTMASTG.5D" in line))

    loads, stores = boxes(packed)
    assert loads > 0 and stores == 0
    assert all(n > 0 for n in boxes(dense))
    assert boxes(dataclasses.replace(dense, pack_tma=False)) == (0, 0)


@pytest.mark.slow
def test_edges_first_one_masked_copy_for_local():
    """Note [Edges first] in fa4/mask.py: a local tile's right- and left-edge blocks are walked one
    after the other, so with ``fold_first`` the d128 local kernel holds one masked step, as the
    causal one does (the same wgmmas: first Q K^T, one masked and one free step, the last P V),
    where the separate loops hold two more, and no more waits or convergence barriers."""
    fold = next(c for c in arch.all_variants("sm_90a")
                if type(c).__name__ == "FwdSm90Config" and c.fold_first and c.causal and c.head_dim == 128)
    # (one store of the tile, as the d128 local default: the causal tile's warpgroup stores, v0.56,
    # are not the local tile's)
    fold = dataclasses.replace(fold, wg_store_o=False)
    local = dataclasses.replace(fold, causal=False, local=True)

    def census(cfg):
        lines = sass.disassemble(cfg).splitlines()
        return {op: sum(1 for x in lines if op in x) for op in ("HGMMA", "MUFU", "WARPGROUP.DEPBAR", "BSSY")}

    got, sep, causal = census(local), census(dataclasses.replace(local, fold_first=False)), census(fold)
    assert got["HGMMA"] == causal["HGMMA"] < sep["HGMMA"], (got, causal, sep)
    assert got["MUFU"] < sep["MUFU"], (got, sep)
    assert got["WARPGROUP.DEPBAR"] <= sep["WARPGROUP.DEPBAR"] and got["BSSY"] <= sep["BSSY"], (got, sep)


@pytest.mark.slow
def test_fold_first_keeps_wgmmas_async():
    """Note [The first block in the masked loop]: the d128 causal kernel with the first block folded
    into the masked loop holds one copy of the softmax fewer (146 MUFU against 210) and keeps its
    wgmmas asynchronous: ptxas serializes every wgmma of a kernel (a wait after each) when a path
    may redefine an accumulator while a wgmma is pending, which a wait for the previous P V under a
    runtime branch did, and a first Q K^T pending at the loop's head. The folded kernel may hold no
    more waits or convergence barriers than the separate first block's."""
    fold = next(c for c in arch.all_variants("sm_90a")
                if type(c).__name__ == "FwdSm90Config" and c.fold_first and c.causal and c.head_dim == 128)

    def census(cfg):
        lines = sass.disassemble(cfg).splitlines()
        return {op: sum(1 for x in lines if op in x) for op in ("MUFU", "WARPGROUP.DEPBAR", "BSSY")}

    got, sep = census(fold), census(dataclasses.replace(fold, fold_first=False))
    assert got["MUFU"] < sep["MUFU"], (got, sep)
    assert got["WARPGROUP.DEPBAR"] <= sep["WARPGROUP.DEPBAR"] and got["BSSY"] <= sep["BSSY"], (got, sep)


@pytest.mark.slow
def test_overlap_tiles_keeps_wgmmas_async():
    """Note [Tiles overlapped]: the d128 multicast config with overlapped tiles issues the next tile's
    first Q K^T behind the last P V (a second copy of its HGMMAs) and keeps its wgmmas asynchronous:
    at most two more waits than the same kernel without it (issued under a runtime branch, ptxas had
    serialized them all: 40 waits against 4)."""
    ov = next(c for c in arch.all_variants("sm_90a")
              if type(c).__name__ == "FwdSm90Config" and c.overlap_tiles and c.head_dim == 128 and not c.causal)

    def census(cfg):
        lines = sass.disassemble(cfg).splitlines()
        return {op: sum(1 for x in lines if op in x) for op in ("HGMMA", "WARPGROUP.DEPBAR")}

    got, sep = census(ov), census(dataclasses.replace(ov, overlap_tiles=False))
    assert got["HGMMA"] > sep["HGMMA"], (got, sep)
    assert got["WARPGROUP.DEPBAR"] <= sep["WARPGROUP.DEPBAR"] + 2, (got, sep)


@pytest.mark.slow
def test_kv_mcast_loads_by_multicast():
    """Note [K/V multicast]: with ``kv_mcast`` every K / V load of the sm90 forward is a multicast TMA
    (each CTA issues its half of a block to both CTAs of the cluster); Q stays a plain TMA load, and
    the same config without it has no multicast load."""
    mc = next(c for c in arch.all_variants("sm_90a")
              if type(c).__name__ == "FwdSm90Config" and c.kv_mcast and c.head_dim == 128)
    loads = [x for x in sass.disassemble(mc).splitlines() if "UTMALDG" in x]
    mcast = [x for x in loads if "MULTICAST" in x]
    assert mcast and len(loads) - len(mcast) >= 1, loads
    plain = sass.disassemble(dataclasses.replace(mc, kv_mcast=False))
    assert "UTMALDG" in plain and "MULTICAST" not in plain


def test_pair_claims_store_to_the_peer():
    """Note [Pair claims]: with ``kv_mcast`` on the dynamic (causal) grid, CTA 0's producer claims each
    pair once (one global atomic) and stores it into CTA 1's shared memory by ``st.async`` (``STAS``);
    its K / V loads are multicast. The same config without multicast claims per CTA, with no ``STAS``."""
    mc = next(c for c in arch.all_variants("sm_90a")
              if type(c).__name__ == "FwdSm90Config" and c.kv_mcast and c.dynamic_sched and c.causal)
    text = sass.disassemble(mc)
    ops = sass.opcode_counts(text)
    assert ops["STAS"] == 1 and ops["ATOMG.E.ADD.STRONG.GPU"] == 1, ops
    assert any("UTMALDG" in x and "MULTICAST" in x for x in text.splitlines())
    plain = sass.opcode_counts(sass.disassemble(dataclasses.replace(mc, kv_mcast=False)))
    assert plain["STAS"] == 0 and plain["ATOMG.E.ADD.STRONG.GPU"] == 1, plain


@pytest.mark.slow
def test_compiler_switches_reach_the_pipeline_and_keep_the_sass(monkeypatch):
    """Note [Compiler switches]: fa4 compiles its kernels with the DSL's strength-reduction sub-pass
    off, but for the sm90 backward's main kernel (``PASS_SWITCHES_OK = False``); the switch reaches
    the ``cute-to-nvvm`` pipeline exactly there, and a few switched kernels (the d128 causal and d256
    forwards, the sm80 forward on sm_90a and on sm_80) compile to the same instructions both ways,
    encodings and control bits included (``nvdisasm -hex``), but for addresses."""
    from cutlass.base_dsl import compiler

    from fa4 import jit
    from fa4.bwd import sm90 as bwd90
    from fa4.config import AttnProblem
    from fa4.fwd import sm80 as fwd80
    from fa4.fwd import sm90 as fwd90

    pipelines = []
    real = compiler.Compiler.compile

    def spy(self, module, pipeline, *a, **k):
        pipelines.append(pipeline)
        return real(self, module, pipeline, *a, **k)

    def problem(d, causal):
        return AttnProblem("bf16", 2, 4096, 4096, 16, 16, d, d, d ** -0.5, causal=causal)

    def listing(cfg):
        """The SASS with encodings, and how many of the compile's pipelines carry the switch."""
        pipelines.clear()
        text = sass.without_addresses(sass.disassemble(cfg, encodings=True))
        assert pipelines and "/* 0x" in text
        return text, sum("use-strength-reduction-pass=false" in p for p in pipelines), len(pipelines)

    monkeypatch.setattr(compiler.Compiler, "compile", spy)
    bwd = bwd90.make_config(problem(128, True), None, "sm_90a", False)
    assert jit.pass_switches(bwd) == "" and listing(bwd)[1] == 0
    switched = [fwd90.make_config(problem(128, True), None, "sm_90a", True, num_sms=132),
                fwd90.make_config(problem(256, False), None, "sm_90a", True, num_sms=132),
                fwd80.make_config(problem(128, True), None, "sm_90a", True),
                fwd80.make_config(problem(128, False), None, "sm_80", True)]
    for cfg in switched:
        assert jit.pass_switches(cfg) == jit.PASS_SWITCHES != ""
        with_switches, on, total = listing(cfg)
        assert on == total
        with monkeypatch.context() as m:
            m.setattr(jit, "PASS_SWITCHES", "")
            without, off, _ = listing(cfg)
        assert off == 0
        assert with_switches == without, cfg.key()


@pytest.mark.slow
def test_bwd_pdl_instructions():
    """Note [Programmatic dependent launch] in fa4/bwd/sm90.py: with ``pdl`` every sm90 backward main
    kernel variant lets its dependent launch once (``griddepcontrol.launch_dependents``, SASS
    ``PREEXIT``) and waits for the preprocess in each role that runs (``griddepcontrol.wait``,
    ``ACQBULK``: the loads and the consumers, and the dQ writer or sequencing warp where there is one);
    its postprocess waits once; the preprocess lets the main kernel launch. With ``pdl_post`` off the
    main kernel lets nothing launch and its postprocess is a plain launch. Without ``pdl`` none of
    them holds either instruction."""
    from fa4.bwd import postprocess, preprocess

    mains = [c for c in arch.all_variants("sm_90a") if type(c).__name__ == "BwdSm90Config" and c.pdl]
    assert len(mains) >= 6 and any(not c.pdl_post for c in mains)
    pre = next(c for c in preprocess.variants("sm_90a") if c.pdl)

    def count(cfg):
        ops = sass.opcode_counts(sass.disassemble(cfg))
        return sass.count(ops, "PREEXIT"), sass.count(ops, "ACQBULK")

    for main in mains:
        warp1 = not main.dq_pass and (not main.dq_direct or main.deterministic)  # a writer / sequencing warp
        assert count(main) == (int(main.pdl_post), 2 + warp1), main.key()
        assert count(dataclasses.replace(main, pdl=False, pdl_post=True)) == (0, 0), main.key()
        if not main.dq_pass:
            post = postprocess.config_for(main)
            assert post.pdl == main.pdl_post
            if post.pdl:
                assert count(post) == (0, 1) and count(dataclasses.replace(post, pdl=False)) == (0, 0)
    assert count(pre) == (1, 0) and count(dataclasses.replace(pre, pdl=False)) == (0, 0)


def test_split_kv_pdl_instructions():
    """Note [Combine launched early] in fa4/combine.py: a split-KV sm90 forward variant with ``pdl``
    lets the combine launch once (``PREEXIT``) and waits for nothing (``ACQBULK``: none); the combine
    with ``pdl`` waits once and lets nothing launch. Without ``pdl`` neither kernel holds either."""
    from fa4 import combine

    fwds = [c for c in arch.all_variants("sm_90a") if type(c).__name__ == "FwdSm90Config" and c.pdl]
    combines = [c for c in combine.variants("sm_90a") if c.pdl]
    assert len(fwds) >= 2 and len(combines) >= 2
    assert not [c for c in combine.variants("sm_80") if c.pdl]

    def count(cfg):
        ops = sass.opcode_counts(sass.disassemble(cfg))
        return sass.count(ops, "PREEXIT"), sass.count(ops, "ACQBULK")

    for cfg in fwds:
        assert cfg.split_kv, cfg.key()
        assert count(cfg) == (1, 0), cfg.key()
        assert count(dataclasses.replace(cfg, pdl=False)) == (0, 0), cfg.key()
    for cfg in combines:
        assert count(cfg) == (0, 1), cfg.key()
        assert count(dataclasses.replace(cfg, pdl=False)) == (0, 0), cfg.key()
