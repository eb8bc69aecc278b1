"""The structure half of a flattened state: a tree with tensors replaced by references, as JSON.

A training state is a nest of ``dict`` / ``OrderedDict`` / ``list`` / ``tuple`` holding tensors and
plain values (parameters, an optimizer ``state_dict``, LR-scheduler state, counters, RNG states).
:func:`plan_layout` walks it once and gives every tensor a 64-byte-aligned byte range of one
payload; :class:`Layout` keeps the rest. :func:`unflatten` rebuilds the state from a layout and its
payload.

A layout crosses process boundaries (replication, restore, re-join) and lives next to its payload
in the snapshot store, always as JSON (:meth:`Layout.to_json` / :meth:`Layout.from_json`), never
pickled: reading one can only build the closed set of types below, so a malformed or malicious
layout is an error, not code that runs.

Encoding of values (JSON object = a tag with exactly one key)::

    None, true/false, integers, finite floats, strings     as themselves
    list                                                   [ ... ]
    tuple                                                  {"tuple": [ ... ]}
    named tuple                                            {"namedtuple": [name, [fields], [values]]}
    dict / OrderedDict (any encodable keys, order kept)   {"dict": [[k, v], ...]} / {"odict": [...]}
    tensor number i of the payload                         {"tensor": i}
    nan, inf, -inf                                         {"float": "nan" | "inf" | "-inf"}
    bytes                                                  {"bytes": "<base64>"}
    torch.dtype                                            {"dtype": "float32"}

In memory (:func:`plan_layout`, :func:`unflatten` in one process) a named tuple keeps its type; from
JSON it comes back as a named tuple of the same name and fields, made afresh (no class is looked up
by name, so no module is imported).
"""

from __future__ import annotations

import base64
import json
import math
from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..errors import ResilienceError

__all__ = ["ALIGN", "DTYPES", "Layout", "LayoutError", "TensorMeta", "plan_layout", "unflatten"]

ALIGN = 64
LAYOUT_FORMAT = 2
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
"""The tensor dtypes a layout may name (anything else is refused when a layout is read)."""


class LayoutError(ResilienceError):
    """A layout is malformed (wrong JSON shape, unknown tag or dtype, bad offsets) or a state holds
    a value no layout can carry; the message names the path inside the state."""


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in the payload: ``dtype`` is the torch name (``"float32"``)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _TensorRef:
    """Placeholder for tensor ``index`` inside :attr:`Layout.tree`."""

    index: int


@dataclass(frozen=True)
class Layout:
    """A state's structure with tensors replaced by references, every tensor's :class:`TensorMeta`,
    and the payload size in bytes."""

    tree: Any
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    format: int = LAYOUT_FORMAT

    def to_json(self) -> bytes:
        """The layout as UTF-8 JSON (what the store writes and the transport sends)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False).encode("utf-8")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "nbytes": self.nbytes,
            "tensors": [[m.dtype, list(m.shape), m.offset, m.nbytes] for m in self.tensors],
            "tree": _encode(self.tree, "state"),
        }

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview | str) -> "Layout":
        """Parse and check :meth:`to_json`'s output.

        Raises:
            LayoutError: not JSON, another format, a field of the wrong type, an unknown tag or
                dtype, tensors that overlap or leave the payload, a reference to no tensor.
        """
        try:
            raw = json.loads(bytes(data).decode("utf-8") if not isinstance(data, str) else data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise LayoutError(f"a layout must be JSON: {exc}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Any) -> "Layout":
        if not isinstance(raw, dict) or set(raw) != {"format", "nbytes", "tensors", "tree"}:
            keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
            raise LayoutError(f"a layout is an object with format, nbytes, tensors and tree; got {keys}")
        if raw["format"] != LAYOUT_FORMAT:
            raise LayoutError(f"layout format {raw['format']!r}; this version reads {LAYOUT_FORMAT}")
        nbytes = _nonneg(raw["nbytes"], "nbytes")
        if not isinstance(raw["tensors"], list):
            raise LayoutError("layout tensors must be a list")
        metas = []
        end = 0
        for i, entry in enumerate(raw["tensors"]):
            if not (isinstance(entry, list) and len(entry) == 4):
                raise LayoutError(f"layout tensors[{i}] must be [dtype, shape, offset, nbytes]")
            dtype, shape, offset, size = entry
            if dtype not in DTYPES:
                raise LayoutError(f"layout tensors[{i}]: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
            if not isinstance(shape, list) or len(shape) > 64:
                raise LayoutError(f"layout tensors[{i}]: shape must be a list of at most 64 sizes")
            dims = tuple(_nonneg(d, f"tensors[{i}].shape") for d in shape)
            offset, size = _nonneg(offset, f"tensors[{i}].offset"), _nonneg(size, f"tensors[{i}].nbytes")
            numel = math.prod(dims)
            if size != numel * _itemsize(dtype):
                raise LayoutError(f"layout tensors[{i}]: {size} bytes for {dtype} {list(dims)}")
            if offset < end or offset % ALIGN or offset + size > nbytes:
                raise LayoutError(f"layout tensors[{i}]: bytes [{offset}, {offset + size}) overlap or leave the "
                                  f"payload of {nbytes} bytes")
            end = offset + size
            metas.append(TensorMeta(dtype, dims, offset, size))
        tree = _decode(raw["tree"], len(metas), "tree", 0)
        return cls(tree=tree, tensors=tuple(metas), nbytes=nbytes)


_SIZES: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    if dtype not in _SIZES:
        _SIZES[dtype] = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return _SIZES[dtype]


def _nonneg(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LayoutError(f"layout {what} must be a non-negative integer, got {value!r}")
    return value


# --- values <-> JSON ------------------------------------------------------------------------------
def _encode(obj: Any, path: str) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        return {"float": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, _TensorRef):
        return {"tensor": obj.index}
    if isinstance(obj, list):
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        values = [_encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if hasattr(obj, "_fields"):
            return {"namedtuple": [type(obj).__name__, list(obj._fields), values]}
        return {"tuple": values}
    if isinstance(obj, dict):
        tag = "odict" if isinstance(obj, OrderedDict) else "dict"
        return {tag: [[_encode(k, f"{path}.<key>"), _encode(v, f"{path}[{k!r}]")] for k, v in obj.items()]}
    if isinstance(obj, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
        return _encode(obj.item(), path)  # a numpy scalar
    raise LayoutError(f"{path}: a snapshot cannot hold a {type(obj).__module__}.{type(obj).__qualname__} "
                      f"(allowed: tensors, None, bool, int, float, str, bytes, list, tuple, dict, torch.dtype)")


@lru_cache(maxsize=256)
def _namedtuple(name: str, fields: tuple[str, ...]) -> type:
    return namedtuple(name, fields)  # validates the names as identifiers


_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_MAX_DEPTH = 200


def _decode(obj: Any, tensors: int, path: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise LayoutError(f"layout {path}: nested deeper than {_MAX_DEPTH}")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_decode(v, tensors, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if not (isinstance(obj, dict) and len(obj) == 1):
        raise LayoutError(f"layout {path}: expected a value or a one-key tag object, got {str(obj)[:80]}")
    ((tag, value),) = obj.items()
    if tag == "tensor":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < tensors:
            raise LayoutError(f"layout {path}: tensor reference {value!r} outside 0..{tensors - 1}")
        return _TensorRef(value)
    if tag == "tuple" and isinstance(value, list):
        return tuple(_decode(v, tensors, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
    if tag in ("dict", "odict") and isinstance(value, list):
        items = []
        for i, pair in enumerate(value):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise LayoutError(f"layout {path}: dict entry {i} must be [key, value]")
            key = _decode(pair[0], tensors, f"{path}.<key>", depth + 1)
            try:
                hash(key)
            except TypeError:
                raise LayoutError(f"layout {path}: dict key {key!r} is not hashable") from None
            items.append((key, _decode(pair[1], tensors, f"{path}[{key!r}]", depth + 1)))
        return OrderedDict(items) if tag == "odict" else dict(items)
    if tag == "namedtuple" and isinstance(value, list) and len(value) == 3:
        name, names, values = value
        if not (isinstance(name, str) and isinstance(names, list) and all(isinstance(n, str) for n in names)
                and isinstance(values, list) and len(values) == len(names)):
            raise LayoutError(f"layout {path}: a named tuple is [name, [fields], [values]]")
        try:
            cls = _namedtuple(name, tuple(names))
        except ValueError as exc:
            raise LayoutError(f"layout {path}: bad named tuple: {exc}") from None
        return cls(*(_decode(v, tensors, f"{path}.{n}", depth + 1) for n, v in zip(names, values)))
    if tag == "float" and value in _FLOATS:
        return _FLOATS[value]
    if tag == "bytes" and isinstance(value, str):
        try:
            return base64.b64decode(value.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise LayoutError(f"layout {path}: bad base64") from None
    if tag == "dtype" and value in DTYPES:
        return getattr(torch, value)
    raise LayoutError(f"layout {path}: unknown tag {tag!r} (or a bad value for it)")


# --- flattening -----------------------------------------------------------------------------------
def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _walk(obj: Any, leaves: list[torch.Tensor], metas: list[TensorMeta], cursor: list[int], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        dtype = str(obj.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise LayoutError(f"{path}: tensors of dtype {dtype} cannot be snapshot")
        nbytes = obj.numel() * obj.element_size()
        metas.append(TensorMeta(dtype, tuple(obj.shape), cursor[0], nbytes))
        leaves.append(obj.detach())
        cursor[0] = _align(cursor[0] + nbytes)
        return _TensorRef(len(leaves) - 1)
    if isinstance(obj, dict):
        items = [(k, _walk(v, leaves, metas, cursor, f"{path}[{k!r}]")) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [_walk(v, leaves, metas, cursor, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_walk(v, leaves, metas, cursor, f"{path}[{i}]") for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    _encode(obj, path)  # refuse, here and now, a value no layout can carry
    return obj


def plan_layout(state: Any) -> tuple[Layout, list[torch.Tensor]]:
    """The layout of ``state`` and its tensors in payload order (nothing is copied).

    Raises:
        LayoutError: the state holds a value a layout cannot carry (the message names its path).
    """
    leaves: list[torch.Tensor] = []
    metas: list[TensorMeta] = []
    cursor = [0]
    tree = _walk(state, leaves, metas, cursor, "state")
    nbytes = metas[-1].offset + metas[-1].nbytes if metas else 0
    return Layout(tree=tree, tensors=tuple(metas), nbytes=nbytes), leaves


def _rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dict):
        items = [(k, _rebuild(v, tensors)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [_rebuild(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        items = [_rebuild(v, tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def unflatten(layout: Layout, payload: torch.Tensor | bytes | bytearray | memoryview) -> Any:
    """Rebuild the state from ``layout`` and its payload; tensors come back as fresh CPU tensors,
    bitwise equal to the ones flattened (the payload may be freed or unmapped afterwards)."""
    if not isinstance(payload, torch.Tensor):
        payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    raw_all = payload.reshape(-1).view(torch.uint8)
    if raw_all.numel() < layout.nbytes:
        raise ValueError(f"payload has {raw_all.numel()} bytes, the layout needs {layout.nbytes}")
    tensors: list[torch.Tensor] = []
    for meta in layout.tensors:
        dtype = getattr(torch, meta.dtype)
        raw = raw_all[meta.offset : meta.offset + meta.nbytes].clone()  # owned and aligned
        if meta.nbytes == 0:
            tensors.append(torch.empty(meta.shape, dtype=dtype))
        else:
            tensors.append(raw.view(dtype).reshape(meta.shape))
    return _rebuild(layout.tree, tensors)
