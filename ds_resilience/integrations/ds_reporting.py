"""What a DeepSpeed training loop sees printed and monitored, from the survivors.

As vanilla ``PipelineEngine.train_batch`` does: every ``steps_per_print`` steps one line with the
loss, the iteration time and samples/s (and, with ``wall_clock_breakdown``, where the time went),
and DeepSpeed's configured monitor gets ``Train/Samples/train_loss``; ds_resilience adds the
resilience events (recovery and lookup time, failed workers, re-routed micro-batches). Rank 0
reports; once it has died, the first survivor does, appending to the same csv_monitor files.
"""

from __future__ import annotations

import csv
from pathlib import Path

from ..logs import STDOUT, get_logger

__all__ = ["is_reporter", "plan_line", "report", "write_csv_events", "write_monitor"]

log = get_logger(__name__)


def write_monitor(engine, events: list[tuple[str, float, int]]) -> None:
    """DeepSpeed's monitor writes on global rank 0 only; once rank 0 is gone the reporting
    survivor appends to the same CSV files itself (DeepSpeed's csv_monitor format). Other
    monitor backends stop with rank 0 (a warning says so, once)."""
    if engine.rank == 0:
        engine.monitor.write_events(events)
        return
    cfg = engine._config.monitor_config
    if cfg.csv_monitor.enabled and cfg.csv_monitor.output_path is not None:
        write_csv_events(Path(cfg.csv_monitor.output_path) / cfg.csv_monitor.job_name, events)
    if not engine._monitor_warned and (cfg.tensorboard.enabled or cfg.wandb.enabled or cfg.comet.enabled):
        engine._monitor_warned = True
        log.warning("rank %s: rank 0 failed; the tensorboard/wandb/comet monitors lived there and stop "
                    "(csv_monitor continues from this rank)", engine.rank, extra=STDOUT)


def plan_line(figures: dict, cost_name: str, failed: str) -> str:
    """One line on the plan a recovery adopted: the failed workers (actual labels: a table's stored
    figures carry canonical ones), the variant and its predicted iteration time (in the cost model's
    unit), and with ``variant: auto`` what the others predicted."""
    line = (f"plan for failed {failed}: variant {figures.get('variant')}, predicted iteration "
            f"{figures.get('iteration_time', float('nan')):.4g} ({cost_name} costs; fault-free 1F1B "
            f"{figures.get('fault_free_iteration_time', float('nan')):.4g})")
    if figures.get("fused_stages"):  # the split variant runs these stages' backward fused (planning/stage_mix.py)
        line += f", fused backward on stage(s) {', '.join(map(str, figures['fused_stages']))}"
    choice = figures.get("variant_choice")
    if choice:
        line += "; chosen among " + ", ".join(
            f"{v} {t:.4g}" if isinstance(t, (int, float)) else f"{v} ({t})" for v, t in choice.items())
    return line


def is_reporter(engine) -> bool:
    """The rank that prints and writes the monitor: rank 0, or the first survivor once it died."""
    return engine.rank == min(engine.topology.rank(w) for w in engine.current.alive_workers())


def report(engine, elapsed: float) -> None:
    """``steps_per_print`` logging, ``wall_clock_breakdown`` timings and the monitor, as vanilla
    writes them, plus the resilience events of the recoveries since the last report."""
    engine._since_print += elapsed
    every = engine.steps_per_print()
    due = every is not None and engine.global_steps % every == 0
    reporter = is_reporter(engine)
    if due and reporter:
        iter_time = engine._since_print / every
        extra = ""
        if engine.validator is not None:
            v = engine.validator
            extra = f" rollbacks/100 steps: {v.rollbacks_per_100():0.1f} waits/100 steps: {v.waits_per_100():0.1f}"
        print(f"steps: {engine.global_steps} loss: {float(engine.agg_train_loss):0.4f} iter time (s): {iter_time:0.3f} "
              f"samples/sec: {engine.train_batch_size() / iter_time:0.3f}{extra}", flush=True)
        if engine.wall_clock_breakdown():
            parts = " | ".join(f"{kind}: {1e3 * sum(v):.2f}" for kind, v in sorted(engine.executor.stats.durations.items()))
            print(f"rank={engine.rank} time (ms) | {parts}", flush=True)
    if due:
        engine._since_print = 0.0
    if reporter and engine._config.monitor_config.enabled:
        events = [("Train/Samples/train_loss", float(engine.agg_train_loss), engine.global_samples)]
        for rec in engine.recovery_log[engine._reported_recoveries:]:
            events += [(f"Resilience/{key}", float(rec[key]), engine.global_samples)
                       for key in ("recovery_s", "lookup_s", "apply_s") if rec.get(key) is not None]
            events.append(("Resilience/failed_workers", float(len(rec.get("failed", ()))), engine.global_samples))
        if engine.validator is not None:
            events.append(("Resilience/rollbacks_per_100", engine.validator.rollbacks_per_100(), engine.global_samples))
            events.append(("Resilience/waits_per_100", engine.validator.waits_per_100(), engine.global_samples))
        if engine.recovery_log[engine._reported_recoveries:] or engine.current.failed:
            events.append(("Resilience/rerouted_microbatches", float(engine.executor.stats.rerouted), engine.global_samples))
        # a straggler's speed when it is found slow, 1.0 when it recovered (runtime/stragglers.py)
        events += [(f"Resilience/rank{d.rank}_speed", d.speed if d.slow else 1.0, engine.global_samples)
                   for d in _stragglers(engine)[engine._reported_stragglers:]]
        write_monitor(engine, events)
    engine._reported_recoveries = len(engine.recovery_log)
    engine._reported_stragglers = len(_stragglers(engine))


def _stragglers(engine) -> list:
    watch = engine.live.stragglers
    return watch.decisions if watch is not None else []


def write_csv_events(log_dir: Path, events: list[tuple[str, float, int]]) -> None:
    """Append ``(name, value, step)`` events as DeepSpeed's csv_monitor does: one file per event
    name (``Train/Samples/train_loss`` -> ``Train_Samples_train_loss.csv``), header ``step,<last part>``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for name, value, step in events:
        path = log_dir / (name.replace("/", "_").replace(" ", "_") + ".csv")
        new = not path.exists()
        with open(path, "a+", newline="") as fh:
            writer = csv.writer(fh)
            if new:
                writer.writerow(["step", name.split("/")[-1]])
            writer.writerow([step, value])
