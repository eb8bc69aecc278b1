"""csrc/ compiles without a GPU: nvcc -c of the kernel, g++ -c of the torch binding, and a link check.

Each test skips, saying why, when its compiler or headers are missing. Nothing built here runs: a
CPU machine can only prove that the code compiles for real targets with warnings as errors, that
the dense path really uses 16-byte vector accesses (read off the PTX), and that the binding and the
kernel agree on their entry points (C++ linkage: the mangled names carry the parameter types).
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL = os.path.join(REPO, "csrc", "copy_kernel.cu")
BINDINGS = os.path.join(REPO, "csrc", "bindings.cpp")
BUILD_EXT = os.path.join(REPO, "csrc", "build_ext.py")
ARCHS = ("80", "90")
ENTRY_POINTS = ("dsr_copy::launch_copy_contiguous", "dsr_copy::launch_copy_strided")


def _nvcc() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA_HOME, CUDA_PATH or PATH)")


def _cuda_root() -> str | None:
    """The toolkit root nvcc itself uses (``TOP`` in its dry run; nvcc may be a wrapper script)."""
    if NVCC is None:
        return None
    try:
        proc = subprocess.run([NVCC, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^#\$ TOP=(.+)$", proc.stdout + proc.stderr, re.M)
    root = os.path.realpath(match.group(1).strip()) if match else os.path.dirname(os.path.dirname(os.path.realpath(NVCC)))
    return root if os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")) else None


def _cuda_include() -> str | None:
    root = _cuda_root()
    return os.path.join(root, "include") if root else None


def _run(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stderr ---\n{proc.stderr[-6000:]}"
    return proc


def _symbols(path: str, *flags: str) -> str:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not found")
    return _run([nm, "-C", *flags, path]).stdout


@pytest.fixture(scope="module")
def kernel_object(tmp_path_factory):
    """csrc/copy_kernel.cu -> an object with SASS for sm_80 and sm_90 (C++20, as torch builds it)."""
    if NVCC is None:
        pytest.skip("nvcc not found (CUDA_HOME, CUDA_PATH or PATH)")
    out = tmp_path_factory.mktemp("csrc") / "copy_kernel.o"
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    _run([NVCC, "-c", KERNEL, "-o", str(out), "-std=c++20", "-O3", *gencode,
          "-Xcompiler", "-Wall,-Wextra,-fPIC", "-Werror", "all-warnings"])
    return str(out)


@needs_nvcc
def test_kernel_compiles_for_sm80_and_sm90(kernel_object):
    assert os.path.getsize(kernel_object) > 0
    defined = _symbols(kernel_object, "--defined-only")
    for name in ENTRY_POINTS:
        assert name in defined, f"{name} not defined in the kernel object"


@needs_nvcc
def test_kernel_compiles_standalone_as_cxx17(tmp_path):
    """No torch, no C++20 needed: the kernel file builds on its own (the pure-CUDA entry points)."""
    _run([NVCC, "-c", KERNEL, "-o", str(tmp_path / "k17.o"), "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings"])


@needs_nvcc
def test_dense_path_uses_16_byte_vector_accesses(tmp_path):
    ptx_path = tmp_path / "copy_kernel.ptx"
    _run([NVCC, "-ptx", KERNEL, "-o", str(ptx_path), "-std=c++20", "-O3", "-arch=sm_90"])
    ptx = ptx_path.read_text()
    entries = re.findall(r"\.visible \.entry (\S+)\(", ptx)
    assert len(entries) == 12, entries  # dense {uint4, u32} + strided {u8, u16, u32, u64}, x {checksum, not}
    assert re.search(r"ld\.global\.nc\.v4\.[ub]32", ptx), "no 16-byte non-coherent vector loads"
    assert re.search(r"st\.global\.v4\.[ub]32", ptx), "no 16-byte vector stores"
    assert "atom.global.add.u32" in ptx or "red.global.add.u32" in ptx, "checksum publish must be an atomic add"


def _torch_include_flags() -> list[str]:
    try:
        from torch.utils.cpp_extension import include_paths
    except ImportError:
        pytest.skip("torch is not importable: no extension headers")
    paths = include_paths()
    torch_include = paths[0]
    if not os.path.isfile(os.path.join(torch_include, "c10", "cuda", "CUDAStream.h")):
        pytest.skip("this torch ships no c10/cuda headers")
    flags = [f for p in paths for f in ("-isystem", p)]
    flags += ["-isystem", sysconfig.get_paths()["include"]]
    if not os.path.isfile(os.path.join(torch_include, "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        # CPU wheels lack this generated header; it only defines C10_CUDA_BUILD_SHARED_LIBS (Windows).
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return flags


@pytest.fixture(scope="module")
def bindings_object(tmp_path_factory):
    """csrc/bindings.cpp -> an object, against torch's extension headers and CUDA's (about 20 s)."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cuda_include = _cuda_include()
    if cuda_include is None:
        pytest.skip("CUDA headers not found in nvcc's toolkit root")
    import torch

    out = tmp_path_factory.mktemp("csrc") / "bindings.o"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    _run([cxx, "-c", BINDINGS, "-o", str(out), "-std=c++20", "-O0", "-fPIC", "-Wall", "-Wextra", "-Werror",
          *_torch_include_flags(), "-isystem", cuda_include,
          "-DTORCH_EXTENSION_NAME=_copy_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"])
    return str(out)


@needs_nvcc
def test_bindings_compile_against_torch_headers(bindings_object):
    defined = _symbols(bindings_object, "--defined-only")
    assert "PyInit__copy_cuda" in defined


@needs_nvcc
def test_binding_and_kernel_resolve_each_other(bindings_object, kernel_object, tmp_path):
    """Every dsr_copy symbol the binding needs is defined by the kernel, with the same signature,
    and the two link into one shared object exporting the module's init function."""
    needed = {line.split(" U ", 1)[1].strip() for line in _symbols(bindings_object, "-u").splitlines() if "dsr_copy::" in line}
    assert needed == {
        "dsr_copy::launch_copy_contiguous(void const*, void*, long, unsigned int*, int, CUstream_st*)",
        "dsr_copy::launch_copy_strided(void const*, void*, long, int, int, long const*, long const*, unsigned int*, int, CUstream_st*)",
    }
    defined = _symbols(kernel_object, "--defined-only")
    for symbol in needed:
        assert symbol in defined, f"the binding needs {symbol}, the kernel does not define it"
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    lib = os.path.join(_cuda_root() or "", "lib64")
    shared = tmp_path / "_copy_cuda.so"
    _run([cxx, "-shared", bindings_object, kernel_object, "-o", str(shared), f"-L{lib}", "-lcudart"])
    dynamic = _symbols(str(shared), "-D")
    assert re.search(r" T PyInit__copy_cuda$", dynamic, re.M)
    assert not re.search(r" U dsr_copy::", dynamic)


# ---------------------------------------------------------------------------------- build_ext.py
def _build_ext(monkeypatch, value: str | None) -> dict:
    if value is None:
        monkeypatch.delenv("DSR_BUILD_CUDA", raising=False)
    else:
        monkeypatch.setenv("DSR_BUILD_CUDA", value)
    return runpy.run_path(BUILD_EXT)  # exactly how setup.py loads it: a fresh namespace each time


def test_build_ext_skips_cleanly_without_cuda_torch(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    ns = _build_ext(monkeypatch, None)
    if torch.version.cuda and NVCC is not None:  # pragma: no cover - a CUDA build machine
        exts = ns["cuda_extensions"]()
        assert [e.name for e in exts] == ["ds_resilience.kernels._copy_cuda"]
        assert sorted(exts[0].sources) == ["csrc/bindings.cpp", "csrc/copy_kernel.cu"]
        assert "build_ext" in ns["cmdclass"]()
        return
    assert ns["cuda_extensions"]() == []
    assert ns["cmdclass"]() == {}
    assert "skipping the CUDA copy kernel" in capsys.readouterr().out


def test_build_ext_honours_dsr_build_cuda(monkeypatch):
    ns = _build_ext(monkeypatch, "0")
    assert ns["skip_reason"]() == "DSR_BUILD_CUDA=0"
    assert ns["cuda_extensions"]() == [] and ns["cmdclass"]() == {}
    torch = pytest.importorskip("torch")
    if not torch.version.cuda:
        ns = _build_ext(monkeypatch, "1")
        with pytest.raises(RuntimeError, match="not a CUDA build"):
            ns["cuda_extensions"]()


def test_build_ext_sources_exist():
    ns = runpy.run_path(BUILD_EXT)
    for source in ns["SOURCES"]:
        assert os.path.isfile(os.path.join(REPO, source)), source
    assert ns["EXTENSION_NAME"] == "ds_resilience.kernels._copy_cuda"
    assert sys.modules.get("build_ext") is None  # run_path leaves no stray top-level module
