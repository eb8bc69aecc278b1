"""Who owns a job's snapshots in host memory, and the reclaiming of a dead agent's.

The agent owns ``<host_dir>/<job id>`` (``launch.snapshot_root``): its workers write their
snapshots there, it outlives their crashes, and the agent removes it when it exits. An agent that
is itself SIGKILLed (or whose machine's init reaps it) cannot: the tmpfs would keep the files until
a reboot. So each agent records itself in ``<root>/agent.json`` (pid and process start time, which
a reused pid does not repeat), and an agent that starts removes every job directory under its
``host_dir`` whose recorded agent is gone: the next agent on the machine reclaims the memory. A
*named* job's directory (``--job_id``, or the scheduler's: the job can be started again) is what
its next run resumes from, so the next agent of that job keeps it (its workers restore those
snapshots: nothing committed is lost) and removes it when it exits; an agent of another job leaves
it alone until it is :data:`NAMED_TTL_S` old (never for ever).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from ..logs import get_logger

__all__ = ["OWNER_FILE", "claim", "disown", "owner_alive", "reclaim_orphans"]

log = get_logger(__name__)

OWNER_FILE = "agent.json"

NAMED_TTL_S = 24 * 3600.0
"""How long a dead agent's directory of a named job waits for that job's next run before an agent
of another job reclaims it."""


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


def claim(root: str | os.PathLike[str], job_id: str, *, named: bool = False) -> None:
    """Record this process as the owner of the job directory ``root`` (created if missing);
    ``named``: the job can be started again under its id (its snapshots wait for that run)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    owner = {"pid": os.getpid(), "start": _start_time(os.getpid()), "job_id": job_id, "host": socket.gethostname(),
             "named": named}
    tmp = root / f"{OWNER_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(owner))
    os.replace(tmp, root / OWNER_FILE)


def owner_alive(root: str | os.PathLike[str]) -> bool | None:
    """Whether the agent recorded in ``root`` still runs (``None``: no record, or one of another
    host's, not ours to judge)."""
    try:
        owner = json.loads((Path(root) / OWNER_FILE).read_text())
        pid, start = int(owner["pid"]), owner.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if owner.get("host") not in (None, socket.gethostname()):
        return None
    now = _start_time(pid)
    return now is not None and (start is None or now == start)


def disown(root: str | os.PathLike[str]) -> None:
    """Drop the record: what ``root`` holds is kept on purpose (``keep_snapshots``), for good."""
    try:
        os.unlink(Path(root) / OWNER_FILE)
    except OSError:
        pass


def reclaim_orphans(host_dir: str | os.PathLike[str], *, keep: Path | None = None) -> list[Path]:
    """Remove the job directories under ``host_dir`` whose recorded agent is gone; returns them.
    ``keep``: the directory of the starting agent's own job, when the job is named: its workers
    resume from what a dead agent of the same job left there (the new agent claims it)."""
    removed = []
    try:
        entries = sorted(Path(host_dir).iterdir())
    except OSError:
        return removed
    for root in entries:
        if keep is not None and root.resolve() == Path(keep).resolve():
            continue
        if root.is_dir() and owner_alive(root) is False and not _awaits_its_job(root):
            size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
            shutil.rmtree(root, ignore_errors=True)
            log.warning("removed %s: %.1f MB of snapshots left in host memory by an agent that is gone", root,
                        size / 2**20)
            removed.append(root)
    return removed


def _awaits_its_job(root: Path) -> bool:
    """Whether ``root`` is a named job's, recorded less than :data:`NAMED_TTL_S` ago: its next run
    resumes from it."""
    record = root / OWNER_FILE
    try:
        named = bool(json.loads(record.read_text()).get("named"))
        age = time.time() - record.stat().st_mtime
    except (OSError, ValueError, AttributeError):
        return False
    return named and age < NAMED_TTL_S
