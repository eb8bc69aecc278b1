"""Which checkpoint tags of a save directory are complete, what is wrong with the others, and which
tag a load should read.

A tag written by :class:`~ds_resilience.checkpoint.persistent.AsyncCheckpointWriter` is complete
when every expected rank's marker ``<save_dir>/<tag>/.complete-rank<R>`` exists and every file a
marker lists is there with the size (and, when asked, the CRC-32) the marker recorded. Markers of
older versions record no sizes: their files are only required to exist.

:func:`resolve_load_tag` picks the tag a load reads. The tag ``latest`` names, when it is
incomplete (a crash truncated a file, a marker is missing), gives way to the newest complete tag,
with a warning naming what was wrong; nothing is deleted. A tag without any marker was not written
by our engine (vanilla DeepSpeed's ``save_checkpoint``, a stop's export): it is loaded as it is,
unless an unfinished save left its traces there (``.saving-rank<R>``, ``<name>.tmp-<pid>``).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any

from ..errors import ResilienceError
from ..logs import get_logger

__all__ = ["CheckpointIncomplete", "MARKER_PREFIX", "SAVING_PREFIX", "complete_tags", "crc32_of", "latest_complete_tag",
           "read_markers", "resolve_load_tag", "tag_problems"]

log = get_logger(__name__)

MARKER_PREFIX = ".complete-rank"
SAVING_PREFIX = ".saving-rank"  # written before a tag's data, removed once its marker is there
_CHUNK = 8 << 20


class CheckpointIncomplete(ResilienceError):
    """No complete checkpoint to load: the message names what is wrong with each tag found."""


def read_markers(tag_dir: str) -> dict[int, dict]:
    """The completion markers of ``tag_dir`` by rank (unreadable or half-written ones left out)."""
    out: dict[int, dict] = {}
    try:
        names = os.listdir(tag_dir)
    except OSError:
        return out
    for name in names:
        if name.startswith(MARKER_PREFIX) and ".tmp" not in name:
            try:
                rank = int(name[len(MARKER_PREFIX):])
                with open(os.path.join(tag_dir, name)) as fd:
                    marker = json.load(fd)
            except (ValueError, OSError):
                continue
            if isinstance(marker, dict):
                out[rank] = marker
    return out


def crc32_of(path: str) -> int:
    """The CRC-32 (``zlib.crc32``) of a file's bytes."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _expected(markers: dict[int, dict], world_size: int) -> set[int]:
    named = {int(r) for m in markers.values() for r in (m.get("expected") or ())}
    return named or set(range(world_size))


def tag_problems(save_dir: str, tag: str, world_size: int, *, checksums: bool = False) -> list[str]:
    """What keeps ``<save_dir>/<tag>`` from being complete (an empty list: it is complete).

    Checks every expected rank's marker and, for each file a marker records, its presence, size
    and (with ``checksums``) CRC-32."""
    tag_dir = os.path.join(save_dir, tag)
    if not os.path.isdir(tag_dir):
        return [f"directory {tag_dir} does not exist"]
    markers = read_markers(tag_dir)
    if not markers:
        torn = _leftovers(tag_dir)
        return [f"no completion marker ({MARKER_PREFIX}<rank>) in {tag_dir}: its save never finished"
                + (f" (left: {', '.join(torn)})" if torn else "")]
    problems = [f"rank {r}'s marker {MARKER_PREFIX}{r} is missing"
                for r in sorted(_expected(markers, world_size)) if r not in markers]
    for rank in sorted(markers):
        marker = markers[rank]
        checks: dict[str, Any] = marker.get("checks") or {}
        for name in marker.get("files") or ():
            path = os.path.join(tag_dir, name)
            try:
                size = os.stat(path).st_size
            except OSError:
                problems.append(f"{name} (rank {rank}) is missing")
                continue
            check = checks.get(name)
            if not isinstance(check, dict):
                continue  # a marker of an older version: no size recorded
            if size != check.get("size"):
                problems.append(f"{name} (rank {rank}) has {size} bytes, its marker recorded {check.get('size')} "
                                f"(truncated or torn)")
            elif checksums and "crc32" in check and crc32_of(path) != check["crc32"]:
                problems.append(f"{name} (rank {rank}) fails its checksum (CRC-32 recorded in the marker)")
    return problems


def _leftovers(tag_dir: str) -> list[str]:
    """What an unfinished save leaves: ``.saving-rank<R>`` and temporary files of interrupted
    atomic writes (``<name>.tmp-<pid>``, ``<name>.tmp<pid>``)."""
    try:
        return sorted(n for n in os.listdir(tag_dir) if n.startswith(SAVING_PREFIX) or re.search(r"\.tmp-?\d+$", n))
    except OSError:
        return []


def _step_of(tag: str) -> int:
    m = re.fullmatch(r"global_step(\d+)", tag)
    return int(m.group(1)) if m else -1


def _marked_tags(save_dir: str) -> list[tuple[int, int, str, dict[int, dict]]]:
    """(created_ns, step, tag, markers) of every tag with a marker, oldest first."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    found = []
    for tag in names:
        tag_dir = os.path.join(save_dir, tag)
        if os.path.isdir(tag_dir) and (markers := read_markers(tag_dir)):
            created = max(int(m.get("created_ns", 0)) for m in markers.values())
            found.append((created, _step_of(tag), tag, markers))
    found.sort(key=lambda t: t[:3])
    return found


def complete_tags(save_dir: str, world_size: int, *, checksums: bool = False) -> list[str]:
    """Tags of ``save_dir`` that are complete (see :func:`tag_problems`), oldest first (ordered by
    the time their save began). The expected ranks are those the markers name (the survivors that
    saved the tag); markers that name none expect every rank ``0..world_size-1``."""
    return [tag for *_, tag, _ in _marked_tags(save_dir)
            if not tag_problems(save_dir, tag, world_size, checksums=checksums)]


def latest_complete_tag(save_dir: str, world_size: int, *, checksums: bool = False) -> str | None:
    """The newest complete tag, or None."""
    tags = complete_tags(save_dir, world_size, checksums=checksums)
    return tags[-1] if tags else None


def resolve_load_tag(load_dir: str, tag: Any, world_size: int, *, checksums: bool = True) -> Any:
    """The tag a load of ``load_dir`` should read.

    ``tag=None`` means the one ``<load_dir>/latest`` names: when that tag has markers but is
    incomplete, the newest complete tag is returned instead, with a warning naming what was wrong.
    An explicit ``tag`` that is incomplete raises (the caller asked for that one). A tag without
    markers (DeepSpeed's own files, a stop's export), or no ``latest`` file at all, is returned
    unchanged for DeepSpeed to load as it always did.

    Raises:
        CheckpointIncomplete: the tag is incomplete and no complete tag exists (or the incomplete
            tag was asked for by name); the message names each problem and the tags that exist.
    """
    named = tag is not None
    if not named:
        try:
            with open(os.path.join(load_dir, "latest")) as fd:
                tag = fd.read().strip()
        except OSError:
            return None
    tag = str(tag)
    tag_dir = os.path.join(load_dir, tag)
    if not read_markers(tag_dir) and (os.path.isdir(tag_dir) and not _leftovers(tag_dir)
                                      or not _marked_tags(load_dir)):
        return tag  # no marker at all: DeepSpeed's own files or an export, loaded (or reported missing) as before
    problems = tag_problems(load_dir, tag, world_size, checksums=checksums)
    if not problems:
        return tag
    where = f"checkpoint tag {tag!r} in {load_dir}" if named else f"checkpoint tag {tag!r} named by {load_dir}/latest"
    what = "; ".join(problems)
    candidates = [t for *_, t, _ in _marked_tags(load_dir) if t != tag]
    if not named:
        for other in reversed(candidates):
            if not tag_problems(load_dir, other, world_size, checksums=checksums):
                log.warning("%s is incomplete: %s. Loading the newest complete checkpoint %r instead "
                            "(nothing was deleted)", where, what, other)
                return other
    others = {t: tag_problems(load_dir, t, world_size, checksums=checksums) for t in candidates}
    complete = [t for t, p in others.items() if not p]
    if named:
        raise CheckpointIncomplete(f"{where} is incomplete: {what}. Complete tags there: {complete or 'none'} "
                                   f"(pass one of them, or tag=None for the newest complete one)")
    listing = "; ".join(f"{t!r}: {', '.join(p)}" for t, p in others.items()) or "no other tag"
    raise CheckpointIncomplete(f"{where} is incomplete: {what}; and no complete checkpoint exists in {load_dir} "
                               f"to fall back to ({listing})")
