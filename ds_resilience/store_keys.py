"""Every key ds_resilience writes in a job's TCPStore, in one place (like the launch contract).

The agent hosts the store; workers and the agent talk through these keys only. All live under
``dsr/``. Pure Python: every layer may import it.

Membership (agent and workers, :mod:`ds_resilience.runtime.membership`):

``dsr/hb/{rank}``, ``dsr/hb/{rank}/stopped``
    a worker's heartbeat counter, and the mark it stopped on purpose.
``dsr/worker/{rank}``
    a worker's registration (:class:`~ds_resilience.epochs.WorkerInfo` as JSON).
``dsr/epoch/{g}``, ``dsr/epoch/latest``
    membership epochs; the record is written before the pointer.
``dsr/status/{rank}``, ``dsr/admitted/{rank}``
    a worker's status text; a relaunched worker's admission.
``dsr/regrid_failed``, ``dsr/regridded``, ``dsr/training_over``
    the job-wide marks of a failed re-grid, a re-grid under way, and the end of training.

Recovery (workers, :mod:`ds_resilience.runtime.recovery` and ``coordinator``):
``dsr/agree/{epoch}/{rank}`` (step counts), ``dsr/switch/{epoch}`` (a re-join is being applied),
``dsr/arrive/{epoch}/{rank}`` (arrival before the new groups), ``dsr/saved/{epoch}/...`` (the
saves beyond tolerance), ``dsr/tp_arrive/{epoch}/{rank}`` (a Megatron tensor-parallel rank ready to
build its replica's group of that epoch).

Plans (:mod:`ds_resilience.runtime.plan_agreement`): ``dsr/plans/{scope}/{build}/{record|table}``,
``dsr/plans/{scope}/latest``, ``dsr/plans/{scope}/building``.

Nodes (the leader's store, :mod:`ds_resilience.supervisor.nodes`): ``dsr/nodes/launches/{node}``,
``dsr/nodes/launch/{node}/{i}``, ``dsr/nodes/exit/{rank}/{incarnation}``,
``dsr/nodes/kill/{rank}/{incarnation}``, ``dsr/nodes/done``, ``dsr/nodes/job`` (what every node runs), ``dsr/nodes/alive/{node}`` (a follower
agent's beat), ``dsr/nodes/lost/{node}`` (the first launch request a replacement of that node takes).

Attempts (a restart of every worker from the snapshots keeps the store: same address and port, so
the other nodes' followers and a head stay connected): attempt ``n >= 1`` sees every key above but
the node keys through the prefix ``dsr/attempt/{n}`` (:func:`attempt_prefix`), workers and agents
alike (``membership.attempt_view``); torch's ``env://`` rendezvous of a restarted worker too
(``runtime/attempt_scope.py``). The node keys that outlive an attempt (the launch requests, the
beats, the losses, the job and its end) stay unprefixed; a process's exit and kill keys are its
attempt's.

Per session (a live stage's generation of groups): ``dsr/{session}/val/{iteration}/{stage}``
(gradient norms for validation), ``dsr/{session}/loss/{epoch}/{step}``,
``dsr/{session}/idle/{step}``, ``dsr/{session}/pace/{rank}`` (a worker's compute pace, overwritten
every iteration: runtime/stragglers.py), ``dsr/{name}/{ranks}`` (a group's own prefix), and the snapshot
interval ``dsr/snapshot-interval[/{name}]``.
"""

from __future__ import annotations

from typing import Iterable

ROOT = "dsr"

# --- membership ------------------------------------------------------------------------------------
LATEST_EPOCH = f"{ROOT}/epoch/latest"
REGRID_FAILED = f"{ROOT}/regrid_failed"
REGRIDDED = f"{ROOT}/regridded"
GROW_FIGURES = f"{ROOT}/grow_figures"  # the re-formed grid's lead: what growing back would save (integrations/ds_grow.py)
TRAINING_OVER = f"{ROOT}/training_over"
STOP_REQUEST = f"{ROOT}/stop_request"  # a worker received SIGTERM/SIGINT itself: the agent stops the job gracefully
SLOW_REQUEST_SEQ = f"{ROOT}/slow_request_seq"  # numbers the slow-worker requests (an add)
SLOW_REQUEST = f"{ROOT}/slow_request"  # the reporting rank's slow workers (epochs.SlowRequest): the agent publishes a slow epoch


def hb(rank: int) -> str:
    return f"{ROOT}/hb/{rank}"


def hb_stopped(rank: int) -> str:
    return f"{ROOT}/hb/{rank}/stopped"


def worker(rank: int) -> str:
    return f"{ROOT}/worker/{rank}"


def epoch(g: int) -> str:
    return f"{ROOT}/epoch/{g}"


def status(rank: int) -> str:
    return f"{ROOT}/status/{rank}"


def admitted(rank: int) -> str:
    return f"{ROOT}/admitted/{rank}"


def applied(rank: int) -> str:
    """The newest epoch ``rank`` finished applying (the agent publishes a grow only after every
    survivor finished its re-grid: supervisor/agent.py)."""
    return f"{ROOT}/applied/{rank}"


# --- recovery --------------------------------------------------------------------------------------
def agree(epoch_: int, rank: int) -> str:
    return f"{ROOT}/agree/{epoch_}/{rank}"


def switch(epoch_: int) -> str:
    return f"{ROOT}/switch/{epoch_}"


def arrive(epoch_: int, rank: int) -> str:
    return f"{ROOT}/arrive/{epoch_}/{rank}"


def tp_arrive(epoch_: int, rank: int) -> str:
    """A tensor-parallel rank is ready to build its replica's group of ``epoch_`` (megatron/tp_group.py)."""
    return f"{ROOT}/tp_arrive/{epoch_}/{rank}"


def saved(epoch_: int, rank: int) -> str:
    return f"{ROOT}/saved/{epoch_}/r{rank}"


def saved_manifest(epoch_: int) -> str:
    return f"{ROOT}/saved/{epoch_}/manifest"


# --- plans -----------------------------------------------------------------------------------------
PLANS = f"{ROOT}/plans"


def plans(scope: str, build: int, what: str) -> str:
    return f"{PLANS}/{scope}/{build}/{what}"


def plans_latest(scope: str) -> str:
    return f"{PLANS}/{scope}/latest"


def plans_building(scope: str) -> str:
    return f"{PLANS}/{scope}/building"


# --- nodes (the leader's store) --------------------------------------------------------------------
NODES = f"{ROOT}/nodes/"
NODES_DONE = NODES + "done"
NODES_JOB = NODES + "job"  # the leader's script, its arguments and workers per node (JSON)


def node_launches(node: int) -> str:
    return f"{NODES}launches/{node}"


def node_launch(node: int, i: int) -> str:
    return f"{NODES}launch/{node}/{i}"


def node_exit(rank: int, incarnation: int) -> str:
    return f"{NODES}exit/{rank}/{incarnation}"


def node_kill(rank: int, incarnation: int) -> str:
    return f"{NODES}kill/{rank}/{incarnation}"


def node_alive(node: int) -> str:
    return f"{NODES}alive/{node}"


def node_lost(node: int) -> str:
    return f"{NODES}lost/{node}"


# --- attempts -------------------------------------------------------------------------------------
def attempt_prefix(n: int) -> str:
    """The prefix of attempt ``n``'s keys (``n >= 1``: the restarts; attempt 0 has none)."""
    if n < 1:
        raise ValueError(f"attempt {n} has no prefix (the first attempt, 0, writes at the root)")
    return f"{ROOT}/attempt/{n}"


# --- per session and group -------------------------------------------------------------------------
def validation(session: str, iteration: int, stage: int) -> str:
    return f"{ROOT}/{session}/val/{iteration}/{stage}"


def loss(session: str, epoch_: int, step: int) -> str:
    return f"{ROOT}/{session}/loss/{epoch_}/{step}"


def idle(session: str, step: int) -> str:
    return f"{ROOT}/{session}/idle/{step}"


def pace(session: str, rank: int) -> str:
    return f"{ROOT}/{session}/pace/{rank}"


def group(name: str, ranks: Iterable[int]) -> str:
    return f"{ROOT}/{name}/{'-'.join(map(str, ranks))}"


def snapshot_interval(name: str | None = None) -> str:
    return f"{ROOT}/snapshot-interval" if name is None else f"{ROOT}/snapshot-interval/{name}"


def megatron_session(counter: int) -> str:
    return f"{ROOT}/megatron/session{counter}"


def megatron_save(counter: int) -> str:
    return f"{ROOT}/megatron/ckpt{counter}"
