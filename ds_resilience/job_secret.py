"""The job's shared secret, and the signed messages the agents of several nodes exchange.

The leader's store has no authentication: anyone who reaches its port can write a key. A follower
launches what a launch request names, so an unsigned request would let anyone start a process as
the job's user (with ``LD_PRELOAD`` or ``PYTHONPATH`` of their choice). Every message between the
agents of a job (launch requests, kill orders, exit reports, the end of the job) is therefore
sealed with an HMAC-SHA256 of the job's secret over the key it is stored under and its value (a
value moved to another key does not verify), and an agent drops, and logs, whatever does not verify.

The secret reaches every agent out of band: the environment variable ``DSR_JOB_SECRET`` or a file
(``--secret_file``) that only its owner can read. Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Mapping

from .errors import ResilienceError

__all__ = ["SECRET_VAR", "BadSignature", "SecretError", "load_secret", "new_secret", "seal", "unseal"]

SECRET_VAR = "DSR_JOB_SECRET"
"""The environment variable that carries the job's secret (hex, at least 32 characters)."""

_MIN_CHARS = 32


class SecretError(ResilienceError):
    """The job's secret is missing, too short, or in a file others can read."""


class BadSignature(ResilienceError):
    """A message that does not carry the job's signature (forged, corrupted, or of another job)."""


def new_secret() -> str:
    """A fresh secret: 256 random bits, hex."""
    return secrets.token_hex(32)


def _checked(secret: str, where: str) -> str:
    secret = secret.strip()
    if len(secret) < _MIN_CHARS:
        raise SecretError(f"the job secret from {where} has {len(secret)} characters; at least {_MIN_CHARS} are "
                          f"needed (e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def load_secret(secret_file: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The job's secret from ``secret_file`` (readable by its owner only), else ``$DSR_JOB_SECRET``;
    ``None`` when neither is given.

    Raises:
        SecretError: the file is missing, readable by its group or others, or either secret is
            shorter than 32 characters.
    """
    env = os.environ if env is None else env
    if secret_file is not None:
        path = Path(secret_file)
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            raise SecretError(f"--secret_file {path}: {exc.strerror or exc}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"--secret_file {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
                              f"allowed: only its owner (chmod 600 {path})")
        return _checked(path.read_text(), f"--secret_file {path}")
    raw = env.get(SECRET_VAR)
    return _checked(raw, f"${SECRET_VAR}") if raw else None


def _mac(secret: str, key: str, value: str) -> str:
    return hmac.new(secret.encode(), key.encode() + b"\0" + value.encode(), hashlib.sha256).hexdigest()


def seal(secret: str, key: str, value: str) -> str:
    """``value`` signed for storage under ``key``."""
    return f"{_mac(secret, key, value)}:{value}"


def unseal(secret: str, key: str, raw: bytes | str) -> str:
    """The value stored under ``key`` if its signature is the job's.

    Raises:
        BadSignature: it carries none, or another.
    """
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    mac, sep, value = text.partition(":")
    if not sep or len(mac) != 64 or not hmac.compare_digest(mac, _mac(secret, key, value)):
        raise BadSignature(f"{key}: not signed with the job's secret")
    return value
