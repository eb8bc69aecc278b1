"""supervisor/host_memory.py: an agent records itself in its job's host-memory directory, and the
next agent removes the directories whose recorded agent is gone (a SIGKILLed agent cannot clean up)."""

from __future__ import annotations

import json
import os
import socket

from ds_resilience.supervisor.host_memory import OWNER_FILE, claim, disown, owner_alive, reclaim_orphans


def _record(root, **fields):
    root.mkdir(parents=True, exist_ok=True)
    (root / "rank0").mkdir(exist_ok=True)
    (root / "rank0" / "snap.bin").write_bytes(b"x" * 4096)
    (root / OWNER_FILE).write_text(json.dumps(fields))


def _unused_pid() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def test_claimed_by_a_live_agent_is_kept_and_a_dead_agents_directory_is_removed(tmp_path):
    claim(tmp_path / "live-job", "live-job")
    assert owner_alive(tmp_path / "live-job") is True
    _record(tmp_path / "dead-job", pid=_unused_pid(), start=123, job_id="dead-job", host=socket.gethostname())
    # this process's pid with another start time: the pid was reused, its agent is gone
    _record(tmp_path / "reused-pid", pid=os.getpid(), start=1, job_id="reused-pid", host=socket.gethostname())
    _record(tmp_path / "other-host", pid=_unused_pid(), start=1, job_id="x", host="another-machine")
    (tmp_path / "no-record").mkdir()
    removed = reclaim_orphans(tmp_path)
    assert sorted(p.name for p in removed) == ["dead-job", "reused-pid"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live-job", "no-record", "other-host"]


def test_a_kept_directory_is_disowned_and_never_reclaimed(tmp_path):
    _record(tmp_path / "kept", pid=_unused_pid(), start=1, job_id="kept", host=socket.gethostname())
    disown(tmp_path / "kept")
    assert owner_alive(tmp_path / "kept") is None
    assert reclaim_orphans(tmp_path) == [] and (tmp_path / "kept" / "rank0" / "snap.bin").exists()


def test_a_missing_host_dir_is_nothing_to_reclaim(tmp_path):
    assert reclaim_orphans(tmp_path / "absent") == []


def test_the_starting_agent_of_a_named_job_keeps_its_own_jobs_directory(tmp_path):
    """A named job's earlier agent was SIGKILLed: the next agent of that job keeps the directory
    (its workers resume from the snapshots), while other dead agents' directories still go."""
    for name in ("my-job", "other-dead-job"):
        _record(tmp_path / name, pid=_unused_pid(), start=1, job_id=name, host=socket.gethostname())
    removed = reclaim_orphans(tmp_path, keep=tmp_path / "my-job")
    assert [p.name for p in removed] == ["other-dead-job"]
    assert (tmp_path / "my-job" / "rank0" / "snap.bin").exists()


def test_a_named_jobs_directory_waits_for_its_next_run_but_not_for_ever(tmp_path):
    """A named job can be started again and resume from what its dead agent left: an agent of
    another job leaves that directory alone until it is NAMED_TTL_S old; an unnamed one goes."""
    import time

    from ds_resilience.supervisor.host_memory import NAMED_TTL_S

    _record(tmp_path / "named", pid=_unused_pid(), start=1, job_id="named", host=socket.gethostname(), named=True)
    _record(tmp_path / "old-named", pid=_unused_pid(), start=1, job_id="old-named", host=socket.gethostname(),
            named=True)
    _record(tmp_path / "unnamed", pid=_unused_pid(), start=1, job_id="job-1-x", host=socket.gethostname(), named=False)
    past = time.time() - NAMED_TTL_S - 60
    os.utime(tmp_path / "old-named" / OWNER_FILE, (past, past))
    removed = reclaim_orphans(tmp_path)
    assert sorted(p.name for p in removed) == ["old-named", "unnamed"]
    assert (tmp_path / "named" / "rank0" / "snap.bin").exists()
