"""The supervisor: runs in the agent process on each node, never imported by worker code.

``ds-resilience run`` starts one agent per node. It hosts the store (node 0's), launches the
workers, watches them, publishes membership, and relaunches or stops them; none of this code is in
a worker's process. The workers' side of the protocol (heartbeats, epochs, recovery, a worker's
boot) is :mod:`ds_resilience.runtime`; the two meet only through the store's keys
(:mod:`ds_resilience.store_keys`, :mod:`ds_resilience.runtime.membership`) and the launch contract
(:mod:`ds_resilience.launch`).

Modules:

* :mod:`.agent` -- the :class:`~.agent.Agent`: launches and watches one node's workers, hosts the
  store, publishes membership epochs, relaunches or stops;
* :mod:`.events` -- what the agent saw and did (:class:`~.events.AgentEvent`) and the table it
  prints at exit;
* :mod:`.nodes` -- several nodes: the leader's view of another node's workers and the follower
  agent (:class:`~.nodes.NodeAgent`) that launches them;
* :mod:`.spawn` -- how a worker process is started (a fresh interpreter, or a fork of a fork server
  that preloaded modules once);
* :mod:`.spawn_server` -- imported first by that fork server: it dies with the agent;
* :mod:`.cli` -- ``ds-resilience run``'s argument parser and entry point (:func:`~.cli.main_run`).

A forked worker's own start (in the child, before the script runs) is worker code:
:mod:`ds_resilience.runtime.fork_boot`.
"""

__all__: list[str] = []
