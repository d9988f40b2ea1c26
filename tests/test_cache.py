"""The JIT cache: memory and disk levels, a second process loads instead of compiling, atomic
writes, and one compile for a key that several processes want at once. CPU only: kernels compile
with fake tensors, and loading an exported object needs no GPU."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fa4 import jit
from kernels_for_tests import ScaleAddConfig

HERE = os.path.dirname(__file__)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FA4_DISABLE_DISK_CACHE", raising=False)
    jit.clear_memory_cache()
    yield tmp_path
    jit.clear_memory_cache()


def _run_child(code: str, cache: str, extra_env=None) -> dict:
    env = dict(os.environ, FA4_CACHE_DIR=cache, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra_env or {})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


CHILD = """
import json, time
from fa4 import jit
from kernels_for_tests import ScaleAddConfig
t = time.perf_counter()
fn = jit.get_kernel(ScaleAddConfig(arch="sm_90a", dtype="fp32", bias={bias}))
info = jit.cache_info(); info["get_seconds"] = time.perf_counter() - t
print(json.dumps(info))
"""


def test_memory_then_disk_then_second_process(cache_dir):
    cfg = ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=2.0)
    before = jit.cache_info()
    fn = jit.get_kernel(cfg)
    assert jit.cache_info()["misses"] == before["misses"] + 1
    assert jit.get_kernel(cfg) is fn
    assert jit.cache_info()["memory_hits"] == before["memory_hits"] + 1
    files = sorted(p.name for p in (cache_dir).rglob("*") if p.is_file())
    assert any(f.endswith(".o") for f in files) and any(f.endswith(".json") for f in files)
    assert not any(f.startswith(".tmp-") for f in files), files  # temp files renamed into place
    child = _run_child(CHILD.format(bias=2.0), str(cache_dir))
    assert child["misses"] == 0 and child["disk_hits"] == 1, child
    assert child["get_seconds"] < 5.0


def test_configs_with_different_fields_are_different_entries(cache_dir):
    a = ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=1.0)
    b = ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=5.0)
    c = ScaleAddConfig(arch="sm_80", dtype="fp32", bias=1.0)
    assert len({jit.entry_name(x) for x in (a, b, c)}) == 3
    assert "bias=5.0" in b.key() and "arch='sm_80'" in c.key()


def test_cache_dir_is_versioned(cache_dir):
    d = jit.cache_dir()
    assert d.parent == cache_dir
    assert d.name.startswith(jit.__version__) and jit.dsl_version() in d.name


def _fwd_bwd_configs():
    from fa4.bwd import sm90 as bwd90
    from fa4.config import AttnProblem
    from fa4.fwd import sm90 as fwd90

    p = AttnProblem("bf16", 2, 1024, 1024, 8, 8, 128, 128, 128**-0.5, causal=True)
    return fwd90.make_config(p, None, "sm_90a", True), bwd90.make_config(p, None, "sm_90a", False)


def test_an_edit_to_one_family_recompiles_only_its_kernels(monkeypatch):
    """Note [Kernel source keys]: a changed backward kernel module renames the backward's entries and
    not the forward's; a changed shared module renames both; the bench renames none."""
    fwd, bwd = _fwd_bwd_configs()
    before = jit.entry_name(fwd), jit.entry_name(bwd)
    real = jit._sources()

    def edited(module):
        changed = {m: (path, digest + ("x" if m == module else "")) for m, (path, digest) in real.items()}
        for f in (jit.kernel_sources, jit.kernel_source_hash):
            f.cache_clear()
        monkeypatch.setattr(jit, "_sources", lambda: changed)
        return jit.entry_name(fwd), jit.entry_name(bwd)

    try:
        after = edited("fa4.bwd.sm90")
        assert after[0] == before[0] and after[1] != before[1]
        after = edited("fa4.fwd.sm90")
        assert after[0] != before[0] and after[1] == before[1]
        after = edited("fa4.softmax")
        assert after[0] != before[0] and after[1] != before[1]
        assert edited("fa4.bench") == before
    finally:
        monkeypatch.undo()
        for f in (jit.kernel_sources, jit.kernel_source_hash):
            f.cache_clear()
    assert (jit.entry_name(fwd), jit.entry_name(bwd)) == before


def test_kernel_keys_hold_every_source_that_runs_while_compiling():
    """Note [Kernel source keys]: the fa4 files whose code runs while one kernel of each family
    compiles (traced with sys.setprofile) are all in that kernel's key, so no edit that changes a
    kernel's code can leave its old entry in use."""
    from fa4 import arch

    root = os.path.dirname(jit.__file__)
    by_kernel = {}
    for cfg in arch.all_variants("sm_90a"):
        by_kernel.setdefault(type(cfg).KERNEL, cfg)
    assert len(by_kernel) >= 8, sorted(by_kernel)
    for kernel, cfg in sorted(by_kernel.items()):
        ran = set()

        def profile(frame, event, arg):
            f = frame.f_code.co_filename
            if event == "call" and f.startswith(root):
                ran.add(jit._module_name(jit.Path(f).resolve()))

        sys.setprofile(profile)
        try:
            jit.compile_uncached(cfg)
        finally:
            sys.setprofile(None)
        module = kernel.partition(":")[0]
        missing = ran - set(jit.kernel_sources(module))
        assert not missing, f"{kernel}: {sorted(missing)} run while it compiles but are not in its key"
        assert module in ran or kernel.startswith("fa4.combine:")


def test_corrupt_entry_is_rebuilt(cache_dir):
    cfg = ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=3.0)
    jit.get_kernel(cfg)
    path = jit.cache_dir() / f"{jit.entry_name(cfg)}.o"
    path.write_bytes(b"not an object file")
    jit.clear_memory_cache()
    n = jit.cache_info()["misses"]
    jit.get_kernel(cfg)
    assert jit.cache_info()["misses"] == n + 1
    assert path.read_bytes()[:4] == b"\x7fELF"


def test_disable_disk_cache(cache_dir, monkeypatch):
    monkeypatch.setenv("FA4_DISABLE_DISK_CACHE", "1")
    jit.get_kernel(ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=4.0))
    assert not any(p.suffix == ".o" for p in cache_dir.rglob("*"))


def test_unusable_cache_directory_falls_back_to_memory(tmp_path, monkeypatch):
    """Note [Unusable cache directory]: a cache path that cannot be created (here, below a file) warns
    once, names the directory, and the kernels compile in memory; cache_info() says so."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("FA4_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.delenv("FA4_DISABLE_DISK_CACHE", raising=False)
    monkeypatch.setattr(jit, "_disk_unusable", None)
    jit.clear_memory_cache()
    try:
        with pytest.warns(RuntimeWarning, match="cannot be written.*FA4_CACHE_DIR"):
            assert callable(jit.get_kernel(ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=8.0)))
        assert "disk_cache_error" in jit.cache_info()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            jit.get_kernel(ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=9.0))
    finally:
        jit.clear_memory_cache()


def test_unwritable_cache_still_loads_its_entries(cache_dir, monkeypatch):
    """A write failure turns off writing only: entries already on disk (a read-only cache filled by
    ``python -m fa4 compile``) still load, missing kernels compile in memory and are not written."""
    monkeypatch.setattr(jit, "_disk_unusable", None)
    a, b, c = (ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=x) for x in (10.0, 11.0, 12.0))
    jit.get_kernel(a)
    jit.clear_memory_cache()
    (jit.cache_dir() / f"{jit.entry_name(b)}.lock").mkdir()  # b's lock cannot be opened
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        jit.get_kernel(b)
    assert not (jit.cache_dir() / f"{jit.entry_name(b)}.o").exists()
    hits, misses = jit.cache_info()["disk_hits"], jit.cache_info()["misses"]
    jit.get_kernel(a)
    assert jit.cache_info()["disk_hits"] == hits + 1 and jit.cache_info()["misses"] == misses
    jit.get_kernel(c)
    assert jit.cache_info()["misses"] == misses + 1
    assert not (jit.cache_dir() / f"{jit.entry_name(c)}.o").exists()


def test_a_failed_export_compiles_in_memory(cache_dir, monkeypatch):
    """A file-system error after the compile (the rename, as on a full disk) falls back to an
    in-memory compile; no partial entry is left behind."""
    monkeypatch.setattr(jit, "_disk_unusable", None)
    cfg = ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=13.0)

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(jit.os, "replace", full)
    with pytest.warns(RuntimeWarning, match="No space left"):
        assert callable(jit.get_kernel(cfg))
    assert not any(p.suffix == ".o" for p in jit.cache_dir().iterdir())


def test_concurrent_processes_compile_once(cache_dir):
    """Four processes ask for one key at the same moment: exactly one compiles, three load."""
    code = CHILD.format(bias=7.0)
    env = dict(os.environ, FA4_CACHE_DIR=str(cache_dir), PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    infos = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        infos.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(i["misses"] for i in infos) == 1, infos
    assert sum(i["disk_hits"] for i in infos) == 3, infos


def test_precompile_reports_registers_and_arch(cache_dir):
    for arch, sm in (("sm_80", 80), ("sm_90a", 90), ("sm_100a", 100)):
        row = jit.precompile(ScaleAddConfig(arch=arch, dtype="fp32", bias=1.5))
        assert row["sm"] == [sm], row  # the cubin inside the object is for the arch asked for
        assert row["registers"] and row["registers"] > 0
        assert row["cached"] is False
        assert jit.precompile(ScaleAddConfig(arch=arch, dtype="fp32", bias=1.5))["cached"] is True


def test_cubin_info_reads_nothing_from_garbage(tmp_path):
    p = tmp_path / "x.o"
    p.write_bytes(b"\x7fELF" + b"\0" * 10 + b"\x7fELF" + b"\x02" * 100)
    assert jit.cubin_info(p) == []


def test_prune_removes_entries_whose_sources_changed(cache_dir, capsys):
    """``python -m fa4 cache --prune``: an entry whose recorded sources hash is not its kernel's
    current one (an edit since it was built), or whose record is unreadable, goes; a current one stays."""
    from fa4.__main__ import main

    keep = ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=11.0)
    old = ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=12.0)
    broken = ScaleAddConfig(arch="sm_90a", dtype="fp32", bias=13.0)
    for cfg in (keep, old, broken):
        jit.get_kernel(cfg)
    d = jit.cache_dir()
    path = {c: d / f"{jit.entry_name(c)}.o" for c in (keep, old, broken)}
    info = json.loads(path[old].with_suffix(".json").read_text())
    assert info["sources"] == jit.kernel_source_hash("kernels_for_tests")
    info["sources"] = "0" * 16  # as if built before an edit of its sources
    path[old].with_suffix(".json").write_text(json.dumps(info))
    path[broken].with_suffix(".json").write_text("{not json")
    assert jit.stale_entries() == sorted([path[old], path[broken]])
    assert main(["cache"]) == 0 and all(p.exists() for p in path.values())  # reports, removes nothing
    assert main(["cache", "--prune"]) == 0
    assert "pruned 2 entries" in capsys.readouterr().out
    assert path[keep].exists() and not path[old].exists() and not path[broken].exists()
    assert not path[old].with_suffix(".json").exists() and jit.stale_entries() == []
