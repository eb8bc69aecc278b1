"""A stand-in training worker for tests/live/test_agent.py: the agent protocol, no DeepSpeed.

It connects to the agent's store, registers (pipeline, stage), heartbeats, watches epochs, waits
until every first-incarnation worker is up, then runs ``--steps`` "iterations" of ``--step_s``
seconds, calling the fault injector at each point (faults come from ``DSR_FAULTS``). Every event
goes as one JSON line to ``$DSR_TEST_OUT/rank{r}.{incarnation}.jsonl``.

A relaunched worker marks itself admitted (``membership.mark_admitted``) when it sees its own
re-join epoch, as the engine does once a donor's state arrived. On a stop epoch it writes ``saved.{r}`` into ``$DSR_TEST_OUT`` (a stand-in checkpoint) and exits 0.
With ``--until_epoch K`` it keeps stepping past ``--steps`` until it has seen epoch K.
``DSR_TEST_IGNORE_INTERRUPT=1`` makes it go on through an interrupt epoch (a worker that does not stop);
``DSR_TEST_DIE_EARLY=r`` makes rank r exit with code 5 before registering;
``DSR_TEST_DIE_IF_REJOIN=1`` makes every relaunched worker exit with code 5 at once;
``DSR_TEST_START_DELAY_IF_REJOIN=S`` makes it sleep S seconds before it starts (a slow start-up);
``DSR_TEST_REGRID_AT_STEP=N`` makes rank 0 announce at step N that the survivors re-form the grid
(what ``integrations/ds_regrid.py`` does);
``DSR_TEST_JOINER_WAITS=1`` makes a relaunched worker register through a real ``Coordinator`` and
wait, as a re-joining engine does, for peers that never come (these stand-in survivors do not
admit anyone): it logs ``training_over`` and exits 0 when the coordinator gives up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

if os.environ.get("DSR_TEST_DIE_IF_REJOIN") == "1" and os.environ.get("DSR_REJOIN") == "1":
    sys.exit(5)
if os.environ.get("DSR_REJOIN") == "1":
    time.sleep(float(os.environ.get("DSR_TEST_START_DELAY_IF_REJOIN", "0")))

from ds_resilience.vocab import ITERATION_POINTS
from ds_resilience.runtime import membership as mb
from ds_resilience.runtime.faults import FaultInjector


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step_s", type=float, default=0.05)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--until_epoch", type=int, default=0)
    parser.add_argument("--local_rank", type=int, required=True)
    args = parser.parse_args()

    settings = mb.agent_env()
    assert settings is not None, "launch me through the agent"
    rank, world = settings.rank, settings.world_size
    assert rank == args.local_rank
    out_dir = os.environ["DSR_TEST_OUT"]
    out = open(os.path.join(out_dir, f"rank{rank}.{settings.incarnation}.jsonl"), "a", buffering=1)

    def emit(ev: str, **fields: object) -> None:
        out.write(json.dumps({"ev": ev, "t": time.time(), **fields}) + "\n")
        out.flush()
        os.fsync(out.fileno())

    emit("start", pid=os.getpid(), incarnation=settings.incarnation, rejoin=settings.rejoin,
         env={k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "OMP_NUM_THREADS",
                                             "TORCHELASTIC_USE_AGENT_STORE", "DSR_REJOIN")})
    if os.environ.get("DSR_TEST_DIE_EARLY") == str(rank):
        emit("die_early")
        return 5

    if os.environ.get("DSR_TEST_JOINER_WAITS") == "1" and settings.rejoin:
        return _wait_as_a_joiner(settings, world // args.stages, emit)
    store = mb.agent_store_from_env(30.0)
    dp = world // args.stages
    mb.register_worker(store, mb.WorkerInfo(rank=rank, pipeline=rank % dp, stage=rank // dp, pid=os.getpid(),
                                            incarnation=settings.incarnation))
    heartbeat = mb.Heartbeat(store, rank, settings.heartbeat_interval_s or 0.5, agent_pid=settings.agent_pid)
    heartbeat.start()

    stop = threading.Event()
    seen: list[int] = []

    def on_epoch(record: mb.EpochRecord) -> None:
        seen.append(record.epoch)
        emit("epoch", record=json.loads(record.to_json()))
        if settings.rejoin and rank in record.joining:  # its own re-join epoch: "admitted" at once
            mb.mark_admitted(store, rank, settings.incarnation)
        if record.stop and not (record.kind == "interrupt" and os.environ.get("DSR_TEST_IGNORE_INTERRUPT") == "1"):
            stop.set()

    watcher = mb.EpochWatcher(store, on_epoch, after=0)
    watcher.start()
    mb.set_status(store, rank, "running")
    if settings.incarnation == 0:  # start together, so fault steps are comparable across ranks
        store.add("test/ready", 1)
        deadline = time.monotonic() + 60
        while int(store.add("test/ready", 0)) < world and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.01)

    injector = FaultInjector((), rank, launch=settings, on_fire=lambda f: emit("fault", kind=f.kind, step=f.step, point=f.point))
    step = 0
    deadline = time.monotonic() + 60
    regrid_at = int(os.environ.get("DSR_TEST_REGRID_AT_STEP", "-1"))
    while step < args.steps or (args.until_epoch and not any(e >= args.until_epoch for e in seen)
                                and time.monotonic() < deadline):
        if step == regrid_at and rank == 0 and settings.incarnation == 0:
            store.set(mb.REGRIDDED_KEY, f"step {step}: the survivors re-form the grid")
            emit("regrid", step=step)
        for point in ITERATION_POINTS:
            injector.maybe_fire(point, step)
            time.sleep(args.step_s / len(ITERATION_POINTS))
            if stop.is_set():
                open(os.path.join(out_dir, f"saved.{rank}"), "w").close()
                mb.set_status(store, rank, "saved")
                emit("saved", step=step)
                return 0
        step += 1
    mb.set_status(store, rank, "done")
    emit("done", steps=step, seen=seen)
    watcher.stop()
    heartbeat.stop()
    return 0


def _wait_as_a_joiner(settings, dp: int, emit) -> int:
    from ds_resilience.runtime.coordinator import Coordinator, TrainingOver

    rank = settings.rank
    coordinator = Coordinator(launch=settings, info={"pipeline": rank % dp, "stage": rank // dp},
                              heartbeat_interval_s=0.1, store_timeout_s=30.0, on_epoch=lambda record: None)
    emit("joining", joining=coordinator.joining)
    try:
        coordinator.wait_key("test/never-posted")  # the arrival of a survivor that finished instead
    except TrainingOver as over:
        emit("training_over", why=str(over))
        coordinator.close()
        return 0
    return 7


if __name__ == "__main__":
    sys.exit(main())
