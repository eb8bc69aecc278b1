"""A restarted worker's default process group meets under its attempt's prefix of the agent's store.

A restart of every worker from the snapshots keeps the agent's store (same address and port: the
other nodes' followers, and a head, stay connected; ``store_keys.attempt_prefix``). The workers
launched by the agent rendezvous through that store (``TORCHELASTIC_USE_AGENT_STORE=True``), and
torch's ``env://`` rendezvous connects to it with no per-attempt prefix (torchelastic hosts a new
store per attempt), so the restart's default group would read the keys the first attempt's left
there. Before the user's script runs, :func:`scope_rendezvous` makes that rendezvous hand out the
store under the attempt's prefix, whoever calls ``init_process_group`` (``deepspeed.init_distributed``,
``ds_resilience.init_distributed``, or the script itself). The first attempt (``DSR_RESTART`` unset
or 0) and workers not launched by the agent are left alone.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

__all__ = ["restart_of", "scope_rendezvous"]


def restart_of(env: Mapping[str, str]) -> int:
    """The attempt a worker belongs to (``DSR_RESTART``; 0 when unset or not launched by the agent)."""
    if env.get("DSR_AGENT") != "1":
        return 0
    raw = env.get("DSR_RESTART") or "0"
    return int(raw) if raw.isdigit() else 0


def scope_rendezvous(env: Mapping[str, str] | None = None) -> bool:
    """Under attempt ``n >= 1`` of the agent's store, make torch's rendezvous return the store
    under ``store_keys.attempt_prefix(n)``; returns whether it did (idempotent)."""
    env = os.environ if env is None else env
    attempt = restart_of(env)
    if attempt == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    import torch.distributed as dist
    import torch.distributed.rendezvous  # noqa: F401 - the module, not the function of that name
    import sys

    from ..store_keys import attempt_prefix

    module = sys.modules["torch.distributed.rendezvous"]
    create = module._create_c10d_store
    if getattr(create, "_dsr_attempt", None) is not None:
        return True
    prefix = attempt_prefix(attempt)

    def scoped(*args: Any, **kwargs: Any) -> dist.Store:
        return dist.PrefixStore(prefix, create(*args, **kwargs))

    scoped._dsr_attempt = attempt  # type: ignore[attr-defined]
    module._create_c10d_store = scoped
    return True
