"""JIT compilation and the two-level kernel cache (process memory, then disk).

A kernel is named by its config (a frozen :class:`fa4.config.KernelConfig` subclass): the config's
``KERNEL`` attribute says which class to build ("fa4.fwd.sm80:FlashFwdSm80"), its fields are
everything the generated code depends on, and its ``arch`` is the code-generation target.

Kernel classes follow one protocol:

* ``Kernel(cfg)`` builds the host object (a ``@cute.jit`` ``__call__``);
* ``Kernel.fake_args(cfg)`` returns the arguments to compile with: fake tensors with symbolic
  sizes (:func:`cute.runtime.make_fake_tensor`), scalars, and a fake TVM-FFI environment stream,
  so compiling needs no GPU and the compiled function takes torch tensors directly.

Compiled kernels are exported as object files (``export_to_c``) into
``$FA4_CACHE_DIR/<fa4 version>-dsl<DSL version>/``, each named by its config's key and the hash of
the sources its kernel depends on (Note [Kernel source keys]), and loaded with
``cute.runtime.load_module`` by later processes. Writes are atomic (temp file + rename); a
per-entry file lock makes concurrent processes compile one key once while the others wait and load
it. ``FA4_DISABLE_DISK_CACHE=1`` keeps everything in memory. An object built on a CPU-only machine
for arch X is used by a GPU machine of arch X (the DSL's CUDA 12 and CUDA 13 flavors of one version
produce interchangeable objects; the key holds the DSL version).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import json
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from fa4 import __version__
from fa4.config import KernelConfig

EXPORT_SYMBOL = "fa4_kernel"

_lock = threading.RLock()
_memory: dict[KernelConfig, Callable] = {}  # keyed by the frozen config itself: no string per call
_modules: list[Any] = []  # keep loaded modules alive


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    last: dict[str, Any] = field(default_factory=dict)


_stats = CacheStats()


# --------------------------------------------------------------------------------------------
# Cache location and identity
# --------------------------------------------------------------------------------------------


def disk_cache_enabled() -> bool:
    return os.environ.get("FA4_DISABLE_DISK_CACHE", "0") not in ("1", "true", "yes")


def dsl_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:  # pragma: no cover - metadata missing in odd installs
        import cutlass

        return getattr(cutlass, "__version__", "unknown")


# Note [Kernel source keys]
#     A kernel's disk entry is named by its config's key and the hash of the sources that can change
#     its code: every fa4 source but the other kernel families' modules (and a few host-only tools),
#     plus the family modules its own kernel module imports (following imports out of family modules
#     only). Editing one family's kernel (fa4/bwd/sm90.py, say) recompiles that family's kernels and
#     no other: an edit-run loop on the backward does not recompile the forward. Editing any shared
#     module (softmax, mask, seqlen, cute_utils, config, ...) recompiles every kernel. The rule is
#     static (imports read with ``ast``); tests/test_cache.py checks on the CPU that every fa4 file
#     whose code runs while a kernel of each family compiles is in that kernel's key. Each entry's
#     record holds its sources hash, so ``python -m fa4 cache --prune`` can drop the entries that
#     edits have made unreachable (:func:`stale_entries`).
FAMILY_MODULES = frozenset({
    "fa4.fwd.sm80", "fa4.fwd.sm90", "fa4.bwd.sm80", "fa4.bwd.sm90", "fa4.bwd.dq_sm90", "fa4.bwd.preprocess",
    "fa4.bwd.postprocess", "fa4.combine_kernel", "fa4.block_table_kernel", "fa4._device_tests",
})
# Never run while a kernel is traced: not in any key (editing the bench recompiles nothing).
HOST_ONLY_MODULES = frozenset({"fa4.bench", "fa4.__main__", "fa4.testing", "fa4.sass"})

_PKG_ROOT = Path(__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(_PKG_ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)
def _sources() -> dict[str, tuple[Path, str]]:
    """fa4 module name -> (file, sha256 of its bytes), read once per process."""
    return {_module_name(p): (p, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(_PKG_ROOT.rglob("*.py"))}


@functools.lru_cache(maxsize=None)
def _fa4_imports(path: Path) -> frozenset:
    """The fa4 modules a file imports anywhere (module level or inside functions)."""
    import ast

    mods = _sources()
    out = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fa4":
            subs = [f"{node.module}.{a.name}" for a in node.names]
            out.update(x for x in subs if x in mods)
            if any(x not in mods for x in subs) and node.module in mods:
                out.add(node.module)  # names defined in the module itself
    return frozenset(out)


def _module_file(module: str) -> Optional[Path]:
    import importlib.util

    spec = importlib.util.find_spec(module)
    return Path(spec.origin) if spec is not None and spec.origin else None


@functools.lru_cache(maxsize=None)
def kernel_sources(kernel_module: str) -> tuple[str, ...]:
    """The fa4 modules in the key of the kernels of ``kernel_module`` (Note [Kernel source keys])."""
    mods = _sources()
    reached, todo = set(), [kernel_module]
    while todo:
        m = todo.pop()
        if m in reached:
            continue
        reached.add(m)
        if m == kernel_module or m in FAMILY_MODULES:
            path = mods[m][0] if m in mods else _module_file(m)
            todo.extend(_fa4_imports(path) if path else ())
    shared = {m for m in mods if m not in FAMILY_MODULES and m not in HOST_ONLY_MODULES}
    return tuple(sorted(shared | {m for m in reached if m in mods}))


@functools.lru_cache(maxsize=None)
def kernel_source_hash(kernel_module: str) -> str:
    """Hash of :func:`kernel_sources` (and of the kernel module's own file when it lies outside fa4)."""
    mods = _sources()
    h = hashlib.sha256()
    for m in kernel_sources(kernel_module):
        h.update(f"{m}:{mods[m][1]};".encode())
    if kernel_module not in mods:
        path = _module_file(kernel_module)
        h.update(path.read_bytes() if path else kernel_module.encode())
    return h.hexdigest()[:16]


def stale_entries(directory: Optional[Path] = None) -> list[Path]:
    """Disk entries (``.o`` with its ``.json``) that no current source can ask for: their kernel's
    sources changed since they were built (Note [Kernel source keys]), or their record is missing or
    unreadable. ``directory`` defaults to :func:`cache_dir`."""
    d = directory or cache_dir()
    out = []
    for obj in sorted(d.glob("*.o")) if d.exists() else []:
        try:
            info = json.loads(obj.with_suffix(".json").read_text())
            module = info["kernel"].partition(":")[0]
            if info.get("sources") == kernel_source_hash(module):
                continue
        except (OSError, ValueError, KeyError, ImportError, AttributeError):
            pass
        out.append(obj)
    return out


def cache_root() -> Path:
    base = os.environ.get("FA4_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fa4"
    )
    return Path(base)


def cache_dir() -> Path:
    return cache_root() / f"{__version__}-dsl{dsl_version()}"


def entry_name(cfg: KernelConfig) -> str:
    """The disk entry of ``cfg``: its key and its kernel's sources (Note [Kernel source keys])."""
    module = type(cfg).KERNEL.partition(":")[0]
    return hashlib.sha256(f"{cfg.key()}|{kernel_source_hash(module)}".encode()).hexdigest()[:32]


# --------------------------------------------------------------------------------------------
# Compile, export, load
# --------------------------------------------------------------------------------------------


def kernel_class(cfg: KernelConfig):
    mod_name, _, cls_name = type(cfg).KERNEL.partition(":")
    return getattr(importlib.import_module(mod_name), cls_name)


@contextlib.contextmanager
def _target_arch(arch: str):
    """Make the DSL build ops for ``arch`` (it checks some ops against its notion of the arch)."""
    from cutlass.base_dsl.dsl import BaseDSL

    envar = BaseDSL._get_dsl().envar
    old = envar.arch
    envar.arch = arch
    try:
        yield
    finally:
        envar.arch = old


# Note [Compiler switches]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# The DSL lowers a kernel in one MLIR pass, ``cute-to-nvvm``, whose sub-passes a caller may switch
# off by raw pass options (the DSL's ``ExtraCompilerOpts``, what ``CUTE_DSL_COMPILER_OPT`` feeds).
# Its strength reduction costs 4-6% of the native compile time (MLIR, LLVM, ptxas; summed over each
# arch's variants, each compiled both ways in one process; end to end, with tracing and export,
# less). Switched off, the instruction listings, encodings and scheduling control bits included,
# are identical on every variant of every family and arch (``fa4.arch.all_variants`` of sm_80,
# sm_90a, sm_100a; tools/compiler_switch_check.py) but 13 of the sm90 backward main kernel's 81 and
# one of the dQ pass's 15, which no GPU has timed (RESULTS v0.54). So the config classes whose
# variants all matched compile with it off (:func:`pass_switches`; those two opt out by
# ``PASS_SWITCHES_OK = False``), on the archs checked: issue 7's compile bar is a few percent over on
# some head dims. tests/test_compile.py checks that the switch reaches the pipeline exactly there
# and a few variants' listings both ways. A user's own ``CUTE_DSL_COMPILER_OPT`` still applies.
PASS_SWITCHES = "use-strength-reduction-pass=false"
PASS_SWITCHES_ARCHS = ("sm_80", "sm_90a", "sm_100a")  # where the listings were compared


def pass_switches(cfg: KernelConfig) -> str:
    """The raw ``cute-to-nvvm`` options ``cfg`` compiles with (Note [Compiler switches])."""
    if cfg.arch in PASS_SWITCHES_ARCHS and type(cfg).PASS_SWITCHES_OK:
        return PASS_SWITCHES
    return ""


def compile_options(cfg: KernelConfig) -> tuple:
    """The DSL compile options of ``cfg``'s kernel: its arch, the TVM-FFI calling convention, and
    :func:`pass_switches`."""
    from cutlass.base_dsl import compiler

    opts = (compiler.GPUArch(cfg.arch), compiler.EnableTVMFFI(True))
    switches = pass_switches(cfg)
    return opts + ((compiler.ExtraCompilerOpts(switches),) if switches else ())


def compile_uncached(cfg: KernelConfig, engine: bool = True):
    """Compile ``cfg`` now (no cache lookup); returns the TVM-FFI callable. ``engine=False``: for
    export only (Note [Export without an engine]); the result is not callable."""
    import cutlass.cute as cute

    cls = kernel_class(cfg)
    if hasattr(cls, "can_implement"):
        cls.can_implement(cfg)
    obj = cls(cfg)
    args = cls.fake_args(cfg)
    with _lock, _target_arch(cfg.arch):
        return cute.compile[compile_options(cfg)](obj, *args, no_jit_engine=not engine)


# Note [Export without an engine]
# ``cute.compile`` builds a host execution engine for the compiled module (MCJIT) whenever the
# current arch can run it, and the TVM-FFI wrapper then emits the host object once more and links it
# again (JITLink). A kernel bound for the disk cache is exported to an object file anyway, and the
# process loads that file as every later process does (``cute.runtime.load_module``, JITLink): so
# the disk path compiles with ``no_jit_engine`` and loads its own export, 0.1-0.25 s less per
# variant on the 2-core CPU (RESULTS v0.29). The exported bytes are the same either way.


_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE = 0x2F, 0x11


def _nv_info_attrs(data: bytes, off: int, size: int) -> list[tuple[int, bytes]]:
    """(attribute, value) entries of a ``.nv.info`` section: 4-byte headers (format, attribute, and
    for sized values a 16-bit length), every entry 4-byte aligned."""
    out, p, end = [], off, off + size
    while p + 4 <= end:
        fmt, attr = data[p], data[p + 1]
        if fmt == 4:  # EIFMT_SVAL: u16 size, then the value
            n = struct.unpack_from("<H", data, p + 2)[0]
            out.append((attr, data[p + 4 : p + 4 + n]))
            p += 4 + n
        else:  # no value / byte / half: fits in the header word
            out.append((attr, data[p + 2 : p + 4]))
            p += 4
    return out


def cubin_info(obj_path: os.PathLike) -> list[dict[str, Any]]:
    """Per CUDA ELF (cubin) inside an object: SM version, registers and stack frame bytes.

    SM version from ``e_flags`` (bits 0-7 for ELF ABI version 7: sm_80/sm_90a; bits 8-15 for ABI
    version 8: sm_100a). Registers (EIATTR_REGCOUNT) and frame size (EIATTR_FRAME_SIZE; > 0 means
    local memory, usually spills) from the ``.nv.info`` section, as (symbol, value) pairs; the
    maximum over the kernels of the cubin is reported.
    """
    data = Path(obj_path).read_bytes()
    out: list[dict[str, Any]] = []
    i = data.find(b"\x7fELF", 1)
    while i != -1:
        try:
            if data[i + 4] == 2 and struct.unpack_from("<H", data, i + 18)[0] == 190:  # 64-bit, EM_CUDA
                e_flags = struct.unpack_from("<I", data, i + 48)[0]
                sm = (e_flags >> 8) & 0xFF if data[i + 8] >= 8 else e_flags & 0xFF
                shoff = struct.unpack_from("<Q", data, i + 40)[0]
                shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, i + 58)
                sh = [struct.unpack_from("<IIQQQQIIQQ", data, i + shoff + k * shentsize) for k in range(shnum)]
                strtab = i + sh[shstrndx][4]
                regs, frame = 0, 0
                for s in sh:
                    name = data[strtab + s[0] : data.index(b"\0", strtab + s[0])]
                    if name == b".nv.info":
                        for attr, val in _nv_info_attrs(data, i + s[4], s[5]):
                            if attr == _EIATTR_REGCOUNT and len(val) == 8:
                                regs = max(regs, struct.unpack_from("<I", val, 4)[0])
                            elif attr == _EIATTR_FRAME_SIZE and len(val) == 8:
                                frame = max(frame, struct.unpack_from("<I", val, 4)[0])
                out.append({"sm": sm, "registers": regs, "frame_bytes": frame})
        except (struct.error, ValueError, IndexError):
            pass
        i = data.find(b"\x7fELF", i + 1)
    return out


def _atomic_write_json(path: Path, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _load(path: Path) -> Callable:
    import cutlass.cute as cute

    t0 = time.perf_counter()
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    fn = getattr(module, EXPORT_SYMBOL)
    _modules.append(module)
    dt = time.perf_counter() - t0
    _stats.load_seconds += dt
    _stats.last = {"event": "disk_hit", "seconds": dt, "path": str(path)}
    return fn


def _compile_to_disk(cfg: KernelConfig, path: Path) -> None:
    """Compile ``cfg`` without a host engine and export it to ``path`` (Note [Export without an
    engine]); its metadata beside it. ``compile_seconds``: compile and export. The temporary file
    is made before compiling, so an unwritable directory costs no compile; OSErrors of the file
    system propagate as :class:`_CacheWriteError`, the compiler's own errors as they are."""
    t0 = time.perf_counter()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".o")
        os.close(fd)
    except OSError as e:
        raise _CacheWriteError(e) from e
    try:
        fn = compile_uncached(cfg, engine=False)
        t_export = time.perf_counter()
        try:
            fn.export_to_c(tmp, function_name=EXPORT_SYMBOL)
            os.replace(tmp, path)
        except OSError as e:
            raise _CacheWriteError(e) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    t1 = time.perf_counter()
    dt = t1 - t0
    _stats.compiles += 1
    _stats.compile_seconds += dt
    _stats.last = {"event": "compile", "seconds": dt, "export_seconds": t1 - t_export, "path": str(path)}
    info = {"key": cfg.key(), "config": cfg.describe(), "kernel": type(cfg).KERNEL, "compile_seconds": dt,
            "sources": kernel_source_hash(type(cfg).KERNEL.partition(":")[0]),
            "cubins": cubin_info(path), "created": time.time(), "fa4": __version__, "dsl": dsl_version()}
    try:
        _atomic_write_json(path.with_suffix(".json"), info)
    except OSError as e:  # the entry itself is in place and usable
        raise _CacheWriteError(e, entry_written=True) from e


class _CacheWriteError(Exception):
    """A file-system error of the disk cache's write path (Note [Unusable cache directory])."""

    def __init__(self, err: OSError, entry_written: bool = False):
        super().__init__(f"{type(err).__name__}: {err}")
        self.entry_written = entry_written


def get_kernel(cfg: KernelConfig) -> Callable:
    """The compiled kernel for ``cfg``: from memory, else disk, else compiled (and stored)."""
    fn = _memory.get(cfg)
    if fn is not None:
        _stats.memory_hits += 1
        return fn
    with _lock:
        fn = _memory.get(cfg)
        if fn is not None:
            _stats.memory_hits += 1
            return fn
        fn = _get_from_disk(cfg) if disk_cache_enabled() and cfg.disk_cacheable else None
        if fn is None:
            t0 = time.perf_counter()
            fn = compile_uncached(cfg)
            dt = time.perf_counter() - t0
            _stats.compiles += 1
            _stats.compile_seconds += dt
            _stats.last = {"event": "compile", "seconds": dt, "path": None}
        _memory[cfg] = fn
        return fn


# Note [Unusable cache directory]
# A cache directory that cannot be created or written (a read-only home on a cluster, a full disk,
# a path that is a file) must not stop attention from running. The first file-system error of the
# write path (making the directory, the lock file, the temporary object, the export, the rename, the
# record) turns writing off for the process, with one warning naming the directory and
# FA4_CACHE_DIR; entries already there (a read-only cache filled by `python -m fa4 compile`) are
# still loaded, and missing kernels are compiled in memory (as with FA4_DISABLE_DISK_CACHE=1). The
# compiler's own errors, and a corrupt entry's, are not file-system errors of the cache: they raise
# or rebuild as before. A failure after a compile (the export or rename on a full disk) compiles
# once more in memory; a failure writing the record keeps the entry, which loads.
_disk_unusable: Optional[str] = None


def _disk_cache_failed(err) -> None:
    global _disk_unusable
    import warnings

    _disk_unusable = str(err)
    warnings.warn(f"fa4: the kernel disk cache at {cache_dir()} cannot be written ({_disk_unusable}); existing "
                  "entries are still loaded, new kernels compile in memory for this process (set FA4_CACHE_DIR "
                  "to a writable directory to keep them across processes)", RuntimeWarning, stacklevel=4)


def _load_entry(path: Path) -> Optional[Callable]:
    """The entry at ``path`` if it exists and loads (a corrupt one is left for the rebuild)."""
    if not path.exists():
        return None
    try:
        fn = _load(path)
    except Exception:  # a corrupt entry (or one removed meanwhile): rebuilt under the lock
        return None
    _stats.disk_hits += 1
    return fn


def _get_from_disk(cfg: KernelConfig) -> Optional[Callable]:
    """The kernel from the disk cache, compiled into it if missing; None when it is missing and the
    cache cannot be written (Note [Unusable cache directory]): the caller compiles in memory."""
    d = cache_dir()
    path = d / f"{entry_name(cfg)}.o"
    fn = _load_entry(path)
    if fn is not None or _disk_unusable:
        return fn
    try:
        d.mkdir(parents=True, exist_ok=True)
        lockf = open(d / f"{entry_name(cfg)}.lock", "a+")
    except OSError as e:
        _disk_cache_failed(e)
        return None
    with lockf:
        fcntl.flock(lockf.fileno(), fcntl.LOCK_EX)
        try:
            fn = _load_entry(path)  # another process may have built it meanwhile
            if fn is not None:
                return fn
            try:
                path.unlink(missing_ok=True)  # corrupt: rebuild
            except OSError as e:
                _disk_cache_failed(e)
                return None
            try:
                _compile_to_disk(cfg, path)
            except _CacheWriteError as e:
                _disk_cache_failed(e)
                if not e.entry_written:
                    return None
            last = _stats.last
            try:
                fn = _load(path)
            except Exception:  # removed meanwhile (a `cache --clear`): compile in memory
                return None
            _stats.last = {**last, "load_seconds": _stats.last["seconds"]}
            return fn
        finally:
            fcntl.flock(lockf.fileno(), fcntl.LOCK_UN)


def precompile(cfg: KernelConfig) -> dict[str, Any]:
    """Compile ``cfg`` into the disk cache if absent (no loading, so it works for any arch on
    any machine). Returns a row for the CLI table."""
    if not cfg.disk_cacheable:
        raise ValueError(f"{type(cfg).__name__} with user functions (score_mod / mask_mod) is not disk-cached "
                         f"(Note [User functions in the compile key] in fa4/mods.py)")
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{entry_name(cfg)}.o"
    row = {"kernel": type(cfg).__name__, "arch": cfg.arch, "key": cfg.key(), "path": str(path)}
    with open(d / f"{entry_name(cfg)}.lock", "a+") as lockf:
        fcntl.flock(lockf.fileno(), fcntl.LOCK_EX)
        try:
            if path.exists() and path.with_suffix(".json").exists():
                row["cached"] = True
            else:
                try:
                    _compile_to_disk(cfg, path)
                except _CacheWriteError as e:
                    raise OSError(f"fa4: cannot write the kernel cache at {d}: {e}") from e
                row["cached"] = False
        finally:
            fcntl.flock(lockf.fileno(), fcntl.LOCK_UN)
    meta = json.loads(path.with_suffix(".json").read_text())
    row["compile_seconds"] = meta["compile_seconds"]
    row["registers"] = max((c["registers"] for c in meta["cubins"]), default=None)
    row["frame_bytes"] = max((c["frame_bytes"] for c in meta["cubins"]), default=None)
    row["sm"] = sorted({c["sm"] for c in meta["cubins"]})
    return row


def cache_info() -> dict[str, Any]:
    """Counters of this process's kernel cache, and where the disk cache lives."""
    return {
        "memory_hits": _stats.memory_hits,
        "disk_hits": _stats.disk_hits,
        "misses": _stats.compiles,
        "compile_seconds": round(_stats.compile_seconds, 4),
        "load_seconds": round(_stats.load_seconds, 4),
        "in_memory": len(_memory),
        "disk_cache": disk_cache_enabled(),
        "cache_dir": str(cache_dir()),
        **({"disk_cache_error": _disk_unusable} if _disk_unusable else {}),
        "last": dict(_stats.last),
    }


def clear_memory_cache() -> None:
    """Forget in-process kernels (tests use it to force a disk load)."""
    with _lock:
        _memory.clear()
