"""The launch contract between the agent (``ds-resilience run``) and its workers: one typed value.

The agent starts every worker with the environment the ``deepspeed`` launcher would give it
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) plus the ``DSR_*`` variables below.
They are written in one place (:meth:`LaunchEnv.to_environ`, the agent) and read in one place
(:func:`launch_env`, once, at ``ds_resilience.initialize`` / ``init_distributed``); every other
module receives the parsed :class:`LaunchEnv` as an argument.

==============================  ==========================================================
``DSR_AGENT=1``                 launched by the agent (without it there is no live recovery)
``DSR_AGENT_PID``               the agent's pid: a worker whose parent is gone exits
``DSR_INCARNATION``             0 at launch, +1 per relaunch of this rank
``DSR_REJOIN=1``                relaunched after a failure: join at an iteration boundary
``DSR_RESTART``                 the number of restarts from the in-memory snapshots so far
``DSR_JOB_ID``                  names the job's host-memory snapshot directory
``DSR_HEARTBEAT_INTERVAL_S``    the agent's heartbeat interval (overrides the config's)
``DSR_HEARTBEAT_TIMEOUT_S``     the silence after which the agent declares a hang
``DSR_FAULTS``                  faults to inject, a JSON list (tests and demos; replaces the config's)
==============================  ==========================================================

Pure Python, no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .config import FaultInjection
from .epochs import MembershipError
from .errors import ConfigError

__all__ = [
    "CONTRACT_KEYS", "DEFAULT_HOST_DIR", "FAULTS_VAR", "LaunchEnv", "LaunchError", "launch_env", "faults_from_env", "job_checkpoint_dir",
    "snapshot_root",
]

DEFAULT_HOST_DIR = "/dev/shm/ds_resilience"
FAULTS_VAR = "DSR_FAULTS"

CONTRACT_KEYS = frozenset({
    "DSR_AGENT", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DSR_INCARNATION", "DSR_REJOIN", "DSR_RESTART",
    "DSR_RESUME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DSR_AGENT_PID", "DSR_JOB_ID", "DSR_HEARTBEAT_INTERVAL_S",
    "DSR_HEARTBEAT_TIMEOUT_S", FAULTS_VAR, "GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE",
})
"""Every variable of the launch contract (:meth:`LaunchEnv.to_environ` and the agent's additions):
all that a launch request from another node may set for a worker (``supervisor/nodes.py``)."""


class LaunchError(MembershipError):
    """``DSR_AGENT=1`` but the agent's environment is incomplete or malformed."""


def snapshot_root(host_dir: str | os.PathLike[str] | None, job_id: str) -> Path:
    """Where a job's in-memory snapshots live (one sub-directory per machine).

    ``host_dir`` is ``resilience.checkpoint.host_dir`` (``None``: :data:`DEFAULT_HOST_DIR`, tmpfs).
    The agent creates and removes it; workers write it; it outlives their crashes.
    """
    return Path(host_dir or DEFAULT_HOST_DIR) / job_id


def job_checkpoint_dir(persistent_dir: str | os.PathLike[str] | None, job_id: str | None) -> str:
    """Where a job's stops (an interrupt, beyond tolerance) write its checkpoints, in the front
    end's layout with ``latest``: ``<resilience.checkpoint.persistent_dir or ./checkpoints>/<job_id>``
    (without a job id, the base itself). A job started again under the same job id resumes from it."""
    base = os.fspath(persistent_dir) if persistent_dir else os.path.join(os.getcwd(), "checkpoints")
    return os.path.join(base, job_id) if job_id else base


def faults_from_env(env: Mapping[str, str] | None = None) -> tuple[FaultInjection, ...] | None:
    """The faults listed in ``DSR_FAULTS`` (``None`` when unset or empty).

    Raises:
        ConfigError: the variable is not a JSON list of valid fault objects (path ``DSR_FAULTS[i]``).
    """
    env = os.environ if env is None else env
    text = env.get(FAULTS_VAR)
    if text is None or not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(FAULTS_VAR, f"not valid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise ConfigError(FAULTS_VAR, f"expected a JSON list of fault objects, got {type(data).__name__}")
    faults = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise ConfigError(f"{FAULTS_VAR}[{i}]", f"expected an object, got {entry!r}")
        faults.append(FaultInjection.from_dict(entry, f"{FAULTS_VAR}[{i}]"))
    return tuple(faults)


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """What the agent tells one worker (see the module docstring for the variables).

    Attributes:
        host, port: the agent's store (``MASTER_ADDR``/``MASTER_PORT``).
        rank, world_size: the global rank and the number of ranks.
        incarnation: 0 at launch, +1 per relaunch of this rank.
        rejoin: relaunched after a failure; it joins the survivors at an iteration boundary.
        heartbeat_interval_s: the agent's heartbeat interval; workers beat at this rate.
        agent_pid: the agent's pid (``None`` if it did not say).
        local_rank, local_world_size: position on the node (``None`` if not given).
        restart: how many times the agent restarted every worker from the snapshots so far.
        job_id: names the job's host-memory directory and its stop checkpoints (``None``: the
            engine makes one up).
        resume: the job id was named (``--job_id``, or the scheduler's job id): a fresh start
            resumes from the newest checkpoint its stops left (:func:`job_checkpoint_dir`).
        heartbeat_timeout_s: the silence after which the agent declares a worker hung.
        faults: faults to inject (``DSR_FAULTS``), replacing the config's; ``None`` if unset.
    """

    host: str
    port: int
    rank: int
    world_size: int
    incarnation: int = 0
    rejoin: bool = False
    heartbeat_interval_s: float | None = None
    agent_pid: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    restart: int = 0
    job_id: str | None = None
    heartbeat_timeout_s: float | None = None
    faults: tuple[FaultInjection, ...] | None = None
    resume: bool = False

    @property
    def first_attempt(self) -> bool:
        """The first incarnation of the first attempt: the only one in which faults fire."""
        return self.incarnation == 0 and self.restart == 0

    def to_environ(self) -> dict[str, str]:
        """The variables the agent exports for this worker (:func:`launch_env` reads them back)."""
        env = {
            "DSR_AGENT": "1",
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            "DSR_INCARNATION": str(self.incarnation),
            "DSR_REJOIN": "1" if self.rejoin else "0",
            "DSR_RESTART": str(self.restart),
            "DSR_RESUME": "1" if self.resume else "0",
        }
        optional = {
            "LOCAL_RANK": self.local_rank,
            "LOCAL_WORLD_SIZE": self.local_world_size,
            "DSR_AGENT_PID": self.agent_pid,
            "DSR_JOB_ID": self.job_id,
            "DSR_HEARTBEAT_INTERVAL_S": self.heartbeat_interval_s,
            "DSR_HEARTBEAT_TIMEOUT_S": self.heartbeat_timeout_s,
        }
        env.update({k: str(v) for k, v in optional.items() if v is not None})
        if self.faults is not None:
            env[FAULTS_VAR] = json.dumps([f.to_dict() for f in self.faults])
        return env


def _opt(env: Mapping[str, str], key: str, kind):
    raw = env.get(key)
    return kind(raw) if raw not in (None, "") else None


def launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The agent's settings when launched by it (``DSR_AGENT=1``), else ``None``.

    Raises:
        LaunchError: ``DSR_AGENT=1`` but a variable is missing or malformed.
        ConfigError: ``DSR_FAULTS`` is malformed.
    """
    env = os.environ if env is None else env
    if env.get("DSR_AGENT") != "1":
        return None
    try:
        return LaunchEnv(
            host=env["MASTER_ADDR"],
            port=int(env["MASTER_PORT"]),
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            incarnation=int(env.get("DSR_INCARNATION") or 0),
            rejoin=env.get("DSR_REJOIN") == "1",
            heartbeat_interval_s=_opt(env, "DSR_HEARTBEAT_INTERVAL_S", float),
            agent_pid=_opt(env, "DSR_AGENT_PID", int),
            local_rank=_opt(env, "LOCAL_RANK", int),
            local_world_size=_opt(env, "LOCAL_WORLD_SIZE", int),
            restart=int(env.get("DSR_RESTART") or 0),
            job_id=env.get("DSR_JOB_ID") or None,
            resume=env.get("DSR_RESUME") == "1",
            heartbeat_timeout_s=_opt(env, "DSR_HEARTBEAT_TIMEOUT_S", float),
            faults=faults_from_env(env),
        )
    except (KeyError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise LaunchError(f"DSR_AGENT=1 but the agent's environment is incomplete: {exc!r}") from exc
