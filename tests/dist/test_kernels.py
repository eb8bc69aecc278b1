"""Copy kernels (ds_resilience.kernels): the checksum definition, the Triton kernel under the CPU
interpreter, the torch fallback, the dispatcher, and (GPU marker) the CUDA and compiled Triton paths.

Triton's interpreter mode is fixed when triton is first imported (its standard library, ``tl.sum``
included, is decorated then), and other test modules may import triton (through deepspeed) long
before this one. So the Triton-backend tests run in a child pytest process of this same file, started
by :func:`test_triton_interpreter_child` with ``TRITON_INTERPRET=1`` set before anything imports
triton; in the parent they skip, and the variable never reaches other test modules. Everything else
(checksum, layout, torch path, dispatch without CUDA, compile checks) runs in the parent.

Bitwise equality is ``torch.equal`` on uint8 views; random data are random *bit patterns* (NaN
payloads, -0.0, subnormals included), so any value conversion would show.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from ds_resilience.kernels import copy as copy_mod
from ds_resilience.kernels import (
    CopyKernelError,
    backend_name,
    checksum_of_bytes,
    checksum_reference,
    combine,
    copy_chunk,
    copy_chunk_using,
)
from ds_resilience.kernels.checksum import MASK32, mulmod32, pack, unpack
from ds_resilience.kernels.copy import plan_layout

REQUIRED_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
EXTRA_DTYPES = [torch.uint8, torch.int8, torch.bool, torch.int16, torch.int32, torch.float64, torch.complex64, torch.complex128]
SIZES = [1, 7, 1023, 4099]


CHILD_FLAG = "_DSR_TRITON_INTERPRETER_CHILD"
IN_CHILD = os.environ.get(CHILD_FLAG) == "1"
interpreted = pytest.mark.skipif(not IN_CHILD, reason="runs in the TRITON_INTERPRET=1 child (test_triton_interpreter_child)")
parent_only = pytest.mark.skipif(IN_CHILD, reason="parent process only")
BACKENDS = ["triton", "torch"] if IN_CHILD else ["torch"]  # the parent's triton cases would only skip


@parent_only
def test_triton_interpreter_child():
    """Run this file again in a fresh process with TRITON_INTERPRET=1: every Triton-backend test."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("TRITON_", "DSR_"))}
    env.update({"TRITON_INTERPRET": "1", CHILD_FLAG: "1", "OMP_NUM_THREADS": "1"})
    ini = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pytest.ini")
    cmd = [sys.executable, "-m", "pytest", "-c", ini, os.path.abspath(__file__), "-q", "-p", "no:cacheprovider", "-rfE"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280)
    tail = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, f"the interpreter child failed:\n{tail}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 150, f"too few tests ran in the child:\n{tail}"


@pytest.fixture(scope="module", autouse=True)
def interpreter_mode():
    """In the child, check that triton really came up in interpreter mode (else every test is void)."""
    if IN_CHILD:
        triton = pytest.importorskip("triton")
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert type(triton.language.standard.sum).__name__ == "InterpretedFunction"
    yield


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv("DSR_COPY_BACKEND", raising=False)
    copy_mod._reset_backend_choice()
    yield
    copy_mod._reset_backend_choice()


@pytest.fixture
def triton_only(monkeypatch):
    """Fail the test if the Triton backend quietly hands a call to the torch path (child only)."""
    if not IN_CHILD:
        pytest.skip("runs in the TRITON_INTERPRET=1 child (test_triton_interpreter_child)")
    pytest.importorskip("triton")

    def refuse(*args, **kwargs):
        raise AssertionError("the triton backend fell back to the torch path")

    monkeypatch.setattr(copy_mod, "_torch_copy", refuse)


# ------------------------------------------------------------------------------------------- data
def random_bits(shape, dtype, seed=0, device="cpu"):
    """A tensor of ``dtype`` whose bytes are uniformly random (valid 0/1 for bool)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool().to(device)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The logical row-major bytes of ``t`` (a copy where ``t`` is not dense)."""
    dense = t.contiguous()
    return dense.as_strided((dense.numel(),), (1,)).view(torch.uint8)


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(byte_view(t).tolist())


def make_layout(kind: str, dtype, seed: int = 0) -> torch.Tensor:
    """A non-contiguous (or offset) view of a fresh random tensor."""
    if kind == "offset":  # storage offset 3: only element-aligned, so no widening
        return random_bits((1030,), dtype, seed)[3:1026]
    if kind == "step":
        return random_bits((3 * 341 + 2,), dtype, seed)[1::3]
    if kind == "transposed":
        return random_bits((33, 31), dtype, seed).t()
    if kind == "column_slice":  # non-contiguous slice of a matrix
        return random_bits((37, 19), dtype, seed)[:, 2:-3]
    if kind == "permuted_3d":
        return random_bits((5, 7, 9), dtype, seed).permute(2, 0, 1)
    if kind == "permuted_4d":  # 4 dims that do not collapse: the Triton kernel's maximum
        return random_bits((3, 4, 5, 6), dtype, seed).permute(3, 1, 0, 2)
    if kind == "expanded":  # stride 0
        return random_bits((13,), dtype, seed)[:, None].expand(13, 6)
    if kind == "sliced_5d":  # more dims than Triton takes: one contiguous copy first
        return random_bits((3, 4, 3, 4, 5), dtype, seed)[:, ::2, :, 1:, ::2].permute(4, 3, 2, 1, 0)
    raise ValueError(kind)


LAYOUTS = ["offset", "step", "transposed", "column_slice", "permuted_3d", "permuted_4d", "expanded", "sliced_5d"]


def check_copy(backend: str, src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
    """Copy with and without checksum through ``backend``; assert bitwise equality and the checksum."""
    if dst is None:
        dst = torch.empty(src.shape, dtype=src.dtype)
    expected = byte_view(src).clone()
    dst.view(-1).view(torch.uint8).fill_(0xA5)
    assert copy_chunk_using(backend, src, dst) is None
    assert torch.equal(dst.view(-1).view(torch.uint8), expected)
    dst.view(-1).view(torch.uint8).fill_(0x5A)
    value = copy_chunk_using(backend, src, dst, checksum=True)
    assert torch.equal(dst.view(-1).view(torch.uint8), expected)
    assert value == checksum_reference(src)
    assert 0 <= value < 2**64
    return dst


# --------------------------------------------------------------------------------------- checksum
def test_checksum_golden_values():
    """Pins the definition: little-endian words, zero-padded tail, weights i + 1, (S2 << 32) | S1."""
    assert checksum_of_bytes(b"") == 0
    assert checksum_of_bytes(b"\x01\x02\x03\x04\x05") == 0x0403020B_04030206
    assert checksum_of_bytes(b"\xff" * 8) == 0xFFFFFFFD_FFFFFFFE  # both sums wrap mod 2**32
    assert checksum_reference(torch.tensor([1.0])) == 0x3F800000_3F800000
    assert checksum_reference(torch.tensor([1], dtype=torch.int64)) == pack(1, 1)
    assert checksum_reference(torch.tensor([0, 1], dtype=torch.int64)) == pack(1, 3)  # word 2, weight 3


@pytest.mark.parametrize("nbytes", [0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 1023, 4099, 40_001])
def test_reference_equals_pure_python_definition(nbytes):
    data = random_bits((nbytes,), torch.uint8, seed=nbytes)
    assert checksum_reference(data) == checksum_of_bytes(raw_bytes(data))


@pytest.mark.parametrize("dtype", REQUIRED_DTYPES + EXTRA_DTYPES)
def test_reference_depends_on_bytes_not_dtype(dtype):
    t = random_bits((257, 3), dtype, seed=3)[:, 1]  # strided too: logical row-major bytes
    assert checksum_reference(t) == checksum_of_bytes(raw_bytes(t))


def test_reference_steps_and_wraparound(monkeypatch):
    """Words 0xFFFFFFFF make every partial sum wrap; small steps exercise the chunked reduction."""
    data = torch.full((4 * 5000 + 3,), 0xFF, dtype=torch.uint8)
    monkeypatch.setattr("ds_resilience.kernels.checksum._REFERENCE_WORDS_PER_STEP", 7)
    assert checksum_reference(data) == checksum_of_bytes(raw_bytes(data))


def test_reference_handles_misaligned_views():
    base = random_bits((64,), torch.float16, seed=5)
    view = base[1:40]  # data_ptr is 2 mod 4
    assert checksum_reference(view) == checksum_of_bytes(raw_bytes(view))


def test_mulmod32_is_exact_without_overflow():
    gen = torch.Generator().manual_seed(11)
    v = torch.randint(0, 2**32, (4096,), dtype=torch.int64, generator=gen)
    w = torch.randint(0, 2**62, (4096,), dtype=torch.int64, generator=gen)
    v[:4] = torch.tensor([MASK32, MASK32, 0, 1])
    w[:4] = torch.tensor([MASK32, 2**62 - 1, 5, 2**40 + 7])
    got = mulmod32(v, w).tolist()
    assert got == [(a * b) % 2**32 for a, b in zip(v.tolist(), w.tolist())]


def test_s2_catches_what_s1_misses():
    a = b"\x01\x00\x00\x00\x02\x00\x00\x00"
    b = b"\x02\x00\x00\x00\x01\x00\x00\x00"  # the same words, swapped
    assert unpack(checksum_of_bytes(a))[0] == unpack(checksum_of_bytes(b))[0]
    assert checksum_of_bytes(a) != checksum_of_bytes(b)
    flipped = bytearray(a)
    flipped[5] ^= 0x10  # any change confined to one word moves S1
    assert unpack(checksum_of_bytes(bytes(flipped)))[0] != unpack(checksum_of_bytes(a))[0]


@pytest.mark.parametrize("split", [0, 4, 8, 1020, 4096])
def test_combine_composes_parts(split):
    data = raw_bytes(random_bits((4099,), torch.uint8, seed=split))
    whole = checksum_of_bytes(data)
    assert combine(checksum_of_bytes(data[:split]), checksum_of_bytes(data[split:]), split) == whole


def test_combine_rejects_unaligned_first_part():
    with pytest.raises(ValueError, match="4-byte words"):
        combine(0, 0, 6)


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize(
    "shape, make, sizes, strides",
    [
        ((6, 4), lambda t: t, (24,), (1,)),
        ((6, 4), lambda t: t.t(), (4, 6), (1, 4)),
        ((6, 4), lambda t: t[:, 1:3], (6, 2), (4, 1)),
        ((6, 4), lambda t: t[::2], (3, 4), (8, 1)),
        ((6, 4), lambda t: t[:, :1], (6,), (4,)),  # size-1 dim dropped
        ((2, 3, 4), lambda t: t[:, :, None, :], (24,), (1,)),  # inserted unit dim merges away
        ((5,), lambda t: t[:, None].expand(5, 3), (5, 3), (1, 0)),
        ((5,), lambda t: t[2:3], (), ()),
    ],
)
def test_plan_layout_collapses_dims(shape, make, sizes, strides):
    src = make(torch.zeros(shape))
    layout = plan_layout(src)
    assert (layout.sizes, layout.strides) == (sizes, strides)
    assert layout.numel == src.numel() and layout.elem_size == 4


@pytest.mark.parametrize(
    "src, width",
    [
        (torch.zeros(8, dtype=torch.float16), 8),  # 16 bytes: widened to int64
        (torch.zeros(6, dtype=torch.float16), 4),  # 12 bytes
        (torch.zeros(7, dtype=torch.float16), 2),  # 14 bytes
        (torch.zeros(9, dtype=torch.float16)[1:], 2),  # 16 bytes at a 2-byte-aligned address
        (torch.zeros(7, dtype=torch.uint8), 1),
    ],
)
def test_dense_chunks_are_widened(src, width):
    views = copy_mod._kernel_views(src, torch.empty(src.numel() * src.element_size(), dtype=torch.uint8))
    assert views is not None and views[2].elem_size == width and views[2].contiguous


# ---------------------------------------------------------------------------- copies: triton + torch
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", REQUIRED_DTYPES, ids=str)
def test_contiguous_copy_is_bitwise_with_checksum(backend, dtype, size, request):
    if backend == "triton":
        request.getfixturevalue("triton_only")
    check_copy(backend, random_bits((size,), dtype, seed=size))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", REQUIRED_DTYPES, ids=str)
def test_offset_view_copy(backend, dtype, size, request):
    if backend == "triton":
        request.getfixturevalue("triton_only")
    base = random_bits((size + 5,), dtype, seed=size + 1)
    check_copy(backend, base[3 : 3 + size])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("dtype", REQUIRED_DTYPES, ids=str)
def test_strided_views_copy(backend, dtype, kind, request):
    if backend == "triton":
        request.getfixturevalue("triton_only")
    src = make_layout(kind, dtype, seed=len(kind))
    assert not src.is_contiguous() or src.storage_offset() > 0
    check_copy(backend, src)


@pytest.mark.parametrize("kind", ["contiguous", "column_slice", "step"])
@pytest.mark.parametrize("dtype", EXTRA_DTYPES, ids=str)
def test_other_dtypes_through_triton(dtype, kind, triton_only):
    src = random_bits((101,), dtype, seed=7) if kind == "contiguous" else make_layout(kind, dtype, seed=7)
    check_copy("triton", src)


@pytest.mark.parametrize("block, programs", [(16, 1), (16, 3), (64, 5), (1024, 64)])
@pytest.mark.parametrize("kind", ["dense", "strided"])
def test_triton_grid_stride_loop_and_partials(block, programs, kind, triton_only):
    """Few programs, each looping over many blocks, must still copy and sum every element once."""
    from ds_resilience.kernels import triton_copy

    src = random_bits((4099,), torch.float16, seed=9)[1:] if kind == "dense" else make_layout("permuted_4d", torch.float16)
    dst = torch.empty(src.numel(), dtype=src.dtype)
    s, d, layout = copy_mod._kernel_views(src, dst)
    value = triton_copy.triton_copy_planned(s, d, layout, checksum=True, block=block, max_programs=programs)
    assert torch.equal(byte_view(dst), byte_view(src))
    assert value == checksum_reference(src)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.int64], ids=str)
def test_triton_splits_huge_dense_chunks_into_launches(dtype, monkeypatch, triton_only):
    """Dense chunks above MAX_LAUNCH_ELEMENTS run as several launches whose checksums combine;
    strided ones of that size go to the torch path (shrunk limits stand in for 2**30 elements)."""
    from ds_resilience.kernels import triton_copy

    monkeypatch.setattr(triton_copy, "MAX_LAUNCH_ELEMENTS", 64)
    check_copy("triton", random_bits((1001,), dtype, seed=4))
    check_copy("triton", random_bits((1001,), dtype, seed=4)[3:])
    strided = make_layout("column_slice", dtype)
    calls = []
    monkeypatch.setattr(copy_mod, "_torch_copy", lambda *a: calls.append(1) or copy_mod._IMPLEMENTATIONS["torch"](*a))
    assert copy_chunk_using("triton", strided, torch.empty(strided.shape, dtype=dtype), checksum=True) == checksum_reference(strided)
    assert calls == [1]


def test_triton_property_random_views(triton_only):
    """Random shapes, permutations and stepped slices, all four required dtypes."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None)
    @hypothesis.given(
        shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
        dtype=st.sampled_from(REQUIRED_DTYPES),
        data=st.data(),
    )
    def run(shape, dtype, data):
        base = random_bits(tuple(shape), dtype, seed=len(shape))
        perm = data.draw(st.permutations(range(len(shape))))
        view = base.permute(*perm)
        index = []
        for size in view.shape:
            start = data.draw(st.integers(0, size - 1))
            step = data.draw(st.integers(1, 3))
            index.append(slice(start, None, step))
        src = view[tuple(index)]
        dst = torch.empty(src.numel() * src.element_size(), dtype=torch.uint8)
        value = copy_chunk_using("triton", src, dst, checksum=True)
        assert torch.equal(dst, byte_view(src))
        assert value == checksum_of_bytes(raw_bytes(src))

    run()


# ------------------------------------------------------------------------------------- dst forms
@pytest.mark.parametrize("backend", BACKENDS)
def test_raw_uint8_sub_buffer_destination(backend):
    """The staging use: chunks of a flat tensor into one uint8 sub-buffer; chunk checksums compose."""
    flat = random_bits((10_000,), torch.bfloat16, seed=12)
    staging = torch.zeros(64 + flat.numel() * 2, dtype=torch.uint8)
    whole, offset = 0, 0
    for start in range(0, flat.numel(), 2500):  # 5000-byte chunks (word-aligned)
        chunk = flat[start : start + 2500]
        dst = staging[64 + offset : 64 + offset + 5000]
        value = copy_chunk_using(backend, chunk, dst, checksum=True)
        whole = value if offset == 0 else combine(whole, value, offset)
        offset += 5000
    assert torch.equal(staging[64:], byte_view(flat))
    assert whole == checksum_reference(flat)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_dtype_destination_of_other_shape(backend):
    src = make_layout("transposed", torch.float32)
    dst = torch.empty(src.numel(), dtype=torch.float32)
    check_copy(backend, src, dst)
    assert torch.equal(byte_view(dst.view(src.shape)), byte_view(src))


@pytest.mark.parametrize("backend", BACKENDS)
def test_misaligned_raw_destination_still_exact(backend):
    """A uint8 dst at an odd address cannot take fp32 stores: the kernel path widens down or falls back."""
    for src in (make_layout("column_slice", torch.float32), random_bits((33,), torch.float32)):
        buf = torch.zeros(src.numel() * 4 + 1, dtype=torch.uint8)
        check_copy(backend, src, buf[1:])


@interpreted
def test_misaligned_strided_destination_uses_torch_path(monkeypatch):
    calls = []
    original = copy_mod._torch_copy
    monkeypatch.setattr(copy_mod, "_torch_copy", lambda *a: calls.append(1) or original(*a))
    src = make_layout("column_slice", torch.float32)
    buf = torch.zeros(src.numel() * 4 + 1, dtype=torch.uint8)
    assert copy_chunk_using("triton", src, buf[1:], checksum=True) == checksum_reference(src)
    assert calls == [1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_chunk(backend):
    src = torch.empty(0, 5, dtype=torch.float16)
    assert copy_chunk_using(backend, src, torch.empty(0, dtype=torch.uint8), checksum=True) == 0
    assert copy_chunk_using(backend, src, torch.empty(0, dtype=torch.uint8)) is None


def test_bad_destinations_raise():
    src = torch.zeros(10, dtype=torch.float32)
    with pytest.raises(CopyKernelError, match="40 bytes"):
        copy_chunk(src, torch.empty(39, dtype=torch.uint8))
    with pytest.raises(CopyKernelError, match="contiguous"):
        copy_chunk(src, torch.empty(10, 2)[:, 0])
    with pytest.raises(CopyKernelError, match="tensors"):
        copy_chunk(src, bytearray(40))
    with pytest.raises(CopyKernelError, match="unknown copy backend"):
        copy_chunk_using("cuda", src, torch.empty_like(src))


# ------------------------------------------------------------------------------------------ dispatch
def _choice_records(caplog):
    return [r for r in caplog.records if r.name == "ds_resilience.kernels" and "copy kernel: backend" in r.getMessage()]


def test_dispatch_chooses_triton_under_interpreter_and_logs_once(caplog, triton_only):
    caplog.set_level(logging.INFO, logger="ds_resilience.kernels")
    src = random_bits((100,), torch.float32)
    dst = torch.empty_like(src)
    assert copy_chunk(src, dst, checksum=True) == checksum_reference(src)
    copy_chunk(src, dst)
    assert backend_name() == "triton"
    records = _choice_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert "backend triton" in message and "csrc" in message  # the skipped backend and why
    if not torch.cuda.is_available():
        assert "no CUDA device" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only choice")
def test_dispatch_goes_to_torch_without_cuda_or_interpreter(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    caplog.set_level(logging.INFO, logger="ds_resilience.kernels")
    assert backend_name() == "torch"
    assert backend_name() == "torch"
    (record,) = _choice_records(caplog)
    assert "TRITON_INTERPRET is not set" in record.getMessage()
    src = make_layout("transposed", torch.bfloat16)
    dst = torch.empty(src.numel(), dtype=torch.bfloat16)
    assert copy_chunk(src, dst, checksum=True) == checksum_reference(src)
    assert torch.equal(byte_view(dst), byte_view(src))


def test_forced_backend(monkeypatch):
    monkeypatch.setenv("DSR_COPY_BACKEND", "torch")
    assert backend_name() == "torch"
    copy_mod._reset_backend_choice()
    monkeypatch.setenv("DSR_COPY_BACKEND", "bogus")
    with pytest.raises(CopyKernelError, match="allowed: csrc, triton, torch"):
        backend_name()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_forcing_an_unavailable_backend_raises(monkeypatch):
    monkeypatch.setenv("DSR_COPY_BACKEND", "csrc")
    with pytest.raises(CopyKernelError, match="no CUDA device"):
        backend_name()
    with pytest.raises(CopyKernelError, match="unavailable"):
        copy_chunk_using("csrc", torch.zeros(4), torch.zeros(4))


def test_available_backends_here():
    names = copy_mod.available_backends()
    assert names[-1] == "torch"
    if not torch.cuda.is_available():
        assert "csrc" not in names
        assert ("triton" in names) == (copy_mod._why_unavailable("triton") is None)


@parent_only
def test_importing_kernels_does_not_import_triton():
    code = "import sys, ds_resilience.kernels as k; print('triton' in sys.modules)"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"


@parent_only
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_benchmark_says_it_needs_cuda_and_exits_0():
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "copy_kernel.py")
    out = subprocess.run([sys.executable, script, "--quick"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "needs a CUDA device" in out.stdout and "Nothing was measured" in out.stdout


# ------------------------------------------------------------------ compiled Triton (no GPU needed)
# Runs in a fresh process: the compiler needs triton imported with TRITON_INTERPRET unset.
_AOT_SCRIPT = r"""
import json, re, sys, warnings
warnings.simplefilter("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds_resilience.kernels import triton_copy

fn = triton.jit(triton_copy._copy_kernel)
names = fn.arg_names
out = []
for elem, ptr in ((1, "*i8"), (2, "*i16"), (4, "*i32"), (8, "*i64")):
    for contig in (True, False):
        for checksum in (True, False):
            signature = {name: "i32" for name in names}
            signature.update(src_ptr=ptr, dst_ptr=ptr, part_ptr="*i64")
            consts = {"CONTIG": contig, "ELEM": elem, "CHECKSUM": checksum, "BLOCK": 4096}
            signature.update({name: "constexpr" for name in consts})
            constexprs = {(names.index(k),): v for k, v in consts.items()}
            # what a real launch specializes for 16-byte-aligned buffers and n % 16 == 0
            attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("src_ptr", "dst_ptr", "part_ptr", "n")}
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
            ptx = kernel.asm["ptx"]
            out.append({"elem": elem, "contig": contig, "checksum": checksum, "cubin": "cubin" in kernel.asm,
                        "accesses": sorted(set(re.findall(r"(?:ld|st)\.global[.a-z0-9]*", ptx)))})
print(json.dumps(out))
"""


@parent_only
def test_triton_kernel_compiles_for_sm90_with_16_byte_accesses():
    """The interpreter does not type-check like the compiler: compile all 16 variants for sm_90
    (ptxas ships with Triton; no device needed) and check the dense path's 16-byte vector accesses."""
    import json

    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=240)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "No such file" in proc.stderr:  # pragma: no cover
        pytest.skip("Triton's NVIDIA backend has no usable ptxas here")
    assert proc.returncode == 0, proc.stderr[-4000:]
    variants = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(variants) == 16 and all(v["cubin"] for v in variants)
    for v in variants:
        if v["contig"]:
            joined = " ".join(v["accesses"])
            assert re.search(r"ld\.global\.v(4\.b32|2\.b64)", joined), v
            assert re.search(r"st\.global\.v(4\.b32|2\.b64)", joined), v


# ------------------------------------------------------------------------------------------- GPU
def _gpu_cases():
    return [
        ("dense_fp32", lambda: random_bits((33_554_433,), torch.float32, device="cuda")),  # 128 MiB + 4 B
        ("dense_bf16_offset", lambda: random_bits((4099,), torch.bfloat16, device="cuda")[1:]),
        ("int64_odd", lambda: random_bits((1023,), torch.int64, device="cuda")),
        ("fp16_7", lambda: random_bits((7,), torch.float16, device="cuda")),
        ("transposed", lambda: random_bits((1025, 513), torch.float16, device="cuda").t()),
        ("permuted_4d", lambda: make_layout("permuted_4d", torch.bfloat16).cuda().permute(1, 0, 3, 2)),
        ("sliced_5d", lambda: make_layout("sliced_5d", torch.float32).cuda().permute(1, 0, 2, 3, 4)),
        ("expanded", lambda: make_layout("expanded", torch.int64).cuda()),
    ]


@pytest.mark.gpu
@parent_only
@pytest.mark.parametrize("dst_kind", ["pinned", "device"])
@pytest.mark.parametrize("backend", ["csrc", "triton"])
@pytest.mark.parametrize("case", [c[0] for c in _gpu_cases()])
def test_gpu_backends_bitwise_and_checksum(backend, dst_kind, case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = copy_mod._why_unavailable(backend)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    monkeypatch.setattr(copy_mod, "_torch_copy", lambda *a: (_ for _ in ()).throw(AssertionError("fell back to torch")))
    src = dict(_gpu_cases())[case]()
    nbytes = src.numel() * src.element_size()
    dst = torch.empty(nbytes + 16, dtype=torch.uint8, pin_memory=True) if dst_kind == "pinned" else torch.empty(nbytes + 16, dtype=torch.uint8, device="cuda")
    dst = dst[16:]
    expected = checksum_reference(src)
    assert copy_chunk_using(backend, src, dst) is None
    torch.cuda.synchronize()
    assert torch.equal(dst.cuda() if dst_kind == "pinned" else dst, byte_view(src))
    dst.fill_(0)
    assert copy_chunk_using(backend, src, dst, checksum=True) == expected
    assert torch.equal(dst.cuda() if dst_kind == "pinned" else dst, byte_view(src))


@pytest.mark.gpu
@parent_only
def test_gpu_dispatch_prefers_csrc_when_built(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    caplog.set_level(logging.INFO, logger="ds_resilience.kernels")
    expected = next(name for name in ("csrc", "triton", "torch") if copy_mod._why_unavailable(name) is None)
    assert backend_name() == expected
    assert len(_choice_records(caplog)) == 1


def test_host_checksum_equals_torch_path_across_blocks(monkeypatch):
    """The numpy CPU path and the torch path agree over several blocks, a tail and a misaligned view."""
    from ds_resilience.kernels import checksum as cs

    monkeypatch.setattr(cs, "_REFERENCE_WORDS_PER_STEP", 1000)  # many blocks on a small tensor
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (4 * 3500 + 3,), dtype=torch.uint8, generator=gen)
    for t in (data, data[1:], data[5:4001]):
        raw = t.clone()
        assert cs._checksum_host(raw) == cs._checksum_torch(raw) == checksum_of_bytes(raw.numpy().tobytes())
    full = torch.full((10_000,), 0xFFFFFFFF, dtype=torch.int64).to(torch.int32)  # all-ones words: wraps S1 and S2
    assert cs.checksum_reference(full) == cs._checksum_torch(full.view(torch.uint8)) == checksum_of_bytes(full.numpy().tobytes())


@pytest.mark.parametrize("kind", ["dense", "split", "strided"])
def test_deferred_checksum_equals_the_synchronous_one_through_triton(kind, monkeypatch, triton_only):
    """copy_chunk_deferred leaves the kernel's sums on the device (the staging path reads every
    chunk's after one wait per snapshot); read later they equal the synchronous checksum, also
    when a dense chunk runs as several launches."""
    from ds_resilience.kernels import triton_copy
    from ds_resilience.kernels.copy import copy_chunk_deferred

    monkeypatch.setenv("DSR_COPY_BACKEND", "triton")
    copy_mod._reset_backend_choice()
    if kind == "split":
        monkeypatch.setattr(triton_copy, "MAX_LAUNCH_ELEMENTS", 64)
    src = make_layout("permuted_4d", torch.float16) if kind == "strided" else random_bits((1001,), torch.int32, seed=3)[1:]
    dst = torch.empty(src.numel() * src.element_size(), dtype=torch.uint8)
    deferred = copy_chunk_deferred(src, dst)
    parts = deferred._parts
    assert parts and all(k == "partials" for k, _, _ in parts)
    assert len(parts) == (1 if kind != "split" else -(-src.numel() // 64))
    assert deferred.value() == checksum_reference(src)
    assert torch.equal(dst, byte_view(src))
    copy_mod._reset_backend_choice()


def test_deferred_checksum_on_the_torch_path_is_ready_at_once(monkeypatch):
    from ds_resilience.kernels.checksum import DeferredChecksum
    from ds_resilience.kernels.copy import copy_chunk_deferred

    monkeypatch.setenv("DSR_COPY_BACKEND", "torch")
    copy_mod._reset_backend_choice()
    src = random_bits((257,), torch.float32, seed=2)
    dst = torch.empty(src.numel() * 4, dtype=torch.uint8)
    d = copy_chunk_deferred(src, dst)
    assert isinstance(d, DeferredChecksum) and d._parts[0][0] == "int"
    assert d.value() == checksum_reference(src)
    assert copy_chunk_deferred(src[:0], dst[:0]).value() == 0
    copy_mod._reset_backend_choice()
