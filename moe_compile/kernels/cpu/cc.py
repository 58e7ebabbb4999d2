"""Builds the package's C kernels (``skinny.c``, ``rows.c``, ``experts.c``, ...) and its one C++ torch
kernel (``decode_op.cpp``) on first use.

A kernel is compiled with the system C compiler into a cache directory (``$MOE_COMPILE_CACHE`` or
``~/.cache/moe_compile``), under a name hashed from its sources (``<stem>.c``, its ``<stem>_*.c`` parts,
the folder's headers) and flags, and loaded with ctypes.
Never at import: the caller builds when the kernel is first needed.  Linked with ``-fopenmp``, a
kernel shares the OpenMP runtime torch has already loaded (same soname, libgomp.so.1), so its
parallel loops run on torch's own intra-op threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import warnings
from importlib import resources
from pathlib import Path

import torch

FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-fopenmp")


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_COMPILE_CACHE") or Path.home() / ".cache" / "moe_compile")


def lacks_avx2() -> str | None:
    """Why this CPU cannot run the kernels (they are written for AVX2 + FMA), or None."""
    cap = torch.backends.cpu.get_cpu_capability()
    return None if cap in ("AVX2", "AVX512") else f"CPU capability {cap}, the kernel needs AVX2"


def _build(stem: str, source: bytes, headers: dict[str, bytes] | None = None, *, suffix: str = ".c",
           compiler: str | None = None, flags: tuple = FLAGS, link: tuple = ()) -> Path:
    """Compile ``stem`` + ``suffix`` (with ``headers``, name -> text of the files it includes: headers
    and parts, beside it) into the cache unless it is there.  Written to a temporary name then
    renamed, so concurrent processes never load half a file."""
    headers = headers or {}
    text = source + b"".join(name.encode() + body for name, body in sorted(headers.items()))
    tag = hashlib.sha256(text + " ".join(flags + link).encode()).hexdigest()[:16]
    lib = cache_dir() / f"{stem}_{tag}.so"
    if lib.exists():
        return lib
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / f"{stem}{suffix}", Path(tmp) / f"{stem}.so"
        src.write_bytes(source)
        for name, body in headers.items():
            (Path(tmp) / name).write_bytes(body)
        done = subprocess.run([compiler, *flags, str(src), "-o", str(out), *link], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:500]}")
        os.replace(out, lib)
    _prune(stem, keep=lib)
    return lib


def _torch_flags() -> tuple[tuple, tuple]:
    """Compile and link flags of a C++ file against this torch's headers and libraries (what
    ``torch.utils.cpp_extension`` would pass, without importing it); the torch version is in the
    flags, so each version gets its own build."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ("-O2", "-std=c++20", "-fPIC", "-shared", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-DMOE_COMPILE_TORCH={torch.__version__}", f"-I{root / 'include'}",
             f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}")
    link = (f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}")
    return flags, link


def build_torch_library(stem: str) -> Path:
    """``moe_compile/kernels/cpu/<stem>.cpp`` compiled against torch (C++ compiler: ``$CXX``, c++ or
    g++); the caller loads it with ``torch.ops.load_library``.  Raises RuntimeError when it cannot
    be built."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++/g++) on PATH")
    flags, link = _torch_flags()
    source = resources.files(__package__).joinpath(f"{stem}.cpp").read_bytes()
    return _build(stem, source, suffix=".cpp", compiler=compiler, flags=flags, link=link)


STALE_AFTER_S = 7 * 24 * 3600


def _prune(stem: str, keep: Path) -> None:
    """Delete ``stem``'s builds of other sources (older package versions) not touched for a week:
    every change of a C file leaves a new build in the cache.  A process that loaded one keeps its
    mapping; younger ones stay for versions still in use."""
    now = time.time()
    for old in keep.parent.glob(f"{stem}_*.so"):
        try:
            if old != keep and now - old.stat().st_mtime > STALE_AFTER_S:
                old.unlink()
        except OSError:
            pass  # another process pruned it first


def _beside(stem: str, name: str) -> bool:
    """Whether file ``name`` of the folder goes beside ``<stem>.c`` in its build: every header, and
    the stem's parts ``<stem>_*.c``.  A large kernel (qdecode.c, qgemm.c) is split into parts that
    its ``<stem>.c`` #includes, one translation unit rather than objects linked together: its
    helpers stay static and inline across the parts as they did in one file (and GCC's FMA
    contraction with them), so the split changes no instruction.  The parts are only ever compiled
    through their stem (no kernel's stem is another's plus ``_...``: ``ep_copy.c`` has no ``ep.c``)."""
    return name.endswith(".h") or (name.startswith(f"{stem}_") and name.endswith(".c"))


def load(stem: str) -> ctypes.CDLL:
    """The compiled ``moe_compile/kernels/cpu/<stem>.c``; raises OSError / RuntimeError when it cannot
    be built or loaded (the caller keeps the reason and falls back to torch ops).  Its parts and the
    headers are in the build's hash with it, so an edit of any of them rebuilds."""
    files = resources.files(__package__)
    beside = {f.name: f.read_bytes() for f in files.iterdir() if _beside(stem, f.name)}
    return ctypes.CDLL(str(_build(stem, files.joinpath(f"{stem}.c").read_bytes(), beside)))


class Kernel:
    """One C file of the package, built and loaded on its first use: ``lib()`` is the library, or
    None with ``error()`` saying why (turned off by ``env``=0, no AVX2, no compiler, build failed).

    ``signatures``: function name -> ctypes argument types (returns void) or (argument types,
    return type); ``fallback``: what the caller does without it, for the one warning a failed
    build gives."""

    def __init__(self, stem: str, env: str, signatures: dict, fallback: str):
        self.stem, self.env, self.signatures, self.fallback = stem, env, signatures, fallback
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None

    def lib(self) -> ctypes.CDLL | None:
        if self._lib is not None or self._error is not None:
            return self._lib
        if os.environ.get(self.env, "1") == "0":
            self._error = f"turned off by {self.env}=0"
        elif (lacking := lacks_avx2()) is not None:
            self._error = lacking
        else:
            try:
                lib = load(self.stem)
                for name, signature in self.signatures.items():
                    argtypes, restype = signature if isinstance(signature, tuple) else (signature, None)
                    getattr(lib, name).argtypes = argtypes
                    getattr(lib, name).restype = restype
                self._lib = lib
            except (OSError, RuntimeError) as err:
                self._error = str(err)
                warnings.warn(f"moe_compile: {self.stem}.c unavailable, {self.fallback} ({err})", stacklevel=3)
        return self._lib

    def error(self) -> str | None:
        self.lib()
        return self._error


def install_once(state: dict, install, stem: str, without: str) -> bool:
    """Run ``install()`` (build, load and arm ``<stem>.cpp``: whether it serves calls) once per
    process, into ``state``: "installed" True/False, or "error" why not.  A build or load failure
    warns once, saying what runs ``without`` it."""
    if not state:
        try:
            state["installed"] = install()
        except (OSError, RuntimeError) as err:
            state["error"] = str(err)
            warnings.warn(f"moe_compile: {stem}.cpp unavailable, {without} ({err})", RuntimeWarning, stacklevel=4)
    return bool(state.get("installed"))
