"""ds_resilience.logs: the lines workers printed, now through logging, byte for byte; log_dist; progress bars."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

from ds_resilience import logs


@pytest.fixture
def fresh(monkeypatch):
    """A handler made anew (the environment read again) and loggers detached from it afterwards."""
    monkeypatch.setattr(logs, "_handler", None)
    taken: list[logging.Logger] = []

    def take(name: str) -> logging.Logger:
        logger = logs.get_logger(name)
        taken.append(logger)
        return logger

    yield take
    for logger in taken:
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def test_default_format_is_the_printed_line_on_stderr(fresh, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    log = fresh("ds_resilience.test_logs.a")
    log.info("injecting sigkill at step 3 mid_backward on rank 2")
    log.warning("rank 2 recovery plan {\"a\": \"100%\"}")
    log.info("ds_resilience: PP=2 x DP=2", extra=logs.BARE)
    log.info("rank 1: the monitors stop", extra=logs.STDOUT)
    out, err = capsys.readouterr()
    assert err == ("[ds_resilience] injecting sigkill at step 3 mid_backward on rank 2\n"
                   "[ds_resilience] rank 2 recovery plan {\"a\": \"100%\"}\n"
                   "ds_resilience: PP=2 x DP=2\n")
    assert out == "[ds_resilience] rank 1: the monitors stop\n"


def test_each_record_is_flushed(fresh, monkeypatch):
    class Stream(io.StringIO):
        flushed = 0

        def flush(self):
            Stream.flushed += 1

    stream = Stream()
    monkeypatch.setattr(sys, "stderr", stream)
    log = fresh("ds_resilience.test_logs.flush")
    log.info("one")
    log.info("two")
    assert stream.getvalue() == "[ds_resilience] one\n[ds_resilience] two\n" and Stream.flushed == 2


def test_format_and_level_from_the_environment(fresh, capsys, monkeypatch):
    monkeypatch.setenv("DSR_LOG_FORMAT", "rank %(rank)s %(levelname)s %(name)s: %(message)s")
    monkeypatch.setenv("DSR_LOG_LEVEL", "warning")
    monkeypatch.setenv("RANK", "3")
    log = fresh("ds_resilience.test_logs.env")
    log.info("dropped")
    log.warning("kept")
    assert capsys.readouterr().err == "rank 3 WARNING ds_resilience.test_logs.env: kept\n"


def test_names_go_under_the_package_and_do_not_propagate(fresh):
    log = fresh("elsewhere")
    assert log.name == "ds_resilience.elsewhere" and not log.propagate
    with pytest.raises(ValueError):
        logs.get_logger("ds_resilience")


def test_plain_loggers_keep_the_standard_behaviour(fresh, capsys):
    fresh("ds_resilience.test_logs.b")
    logging.getLogger("ds_resilience.test_logs.plain").info("not shown")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("rank, ranks, shown", [
    ("0", (0,), True), ("1", (0,), False), ("1", None, True), ("1", [-1], True), ("2", [1, 2], True),
    (None, (0,), True),  # outside a distributed run every process logs
])
def test_log_dist(fresh, capsys, monkeypatch, rank, ranks, shown):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.setitem(sys.modules, "torch.distributed", None)
    else:
        monkeypatch.setenv("RANK", rank)
    log = fresh("ds_resilience.test_logs.dist")
    logs.log_dist("hello", ranks=ranks, logger=log)
    assert capsys.readouterr().err == ("[ds_resilience] hello\n" if shown else "")


def test_progress_only_on_rank_zero_and_a_terminal(monkeypatch):
    monkeypatch.delenv("DSR_PROGRESS", raising=False)
    monkeypatch.setenv("RANK", "0")
    assert not logs.progress_enabled()  # pytest's captured stderr is no terminal
    assert isinstance(logs.progress_bar(10, "x"), logs._NoBar)
    monkeypatch.setenv("DSR_PROGRESS", "1")
    assert logs.progress_enabled() and not logs.progress_enabled(False)
    monkeypatch.setenv("RANK", "1")
    assert not logs.progress_enabled()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("DSR_PROGRESS", "0")
    assert not logs.progress_enabled(True)


def test_forced_bar_ends_its_line(monkeypatch, capsys):
    monkeypatch.setenv("DSR_PROGRESS", "1")
    monkeypatch.setenv("RANK", "0")
    with logs.progress_bar(4, "planning", delay_s=0) as bar:
        for _ in range(4):
            bar.update()
    err = capsys.readouterr().err
    assert "planning" in err and err.endswith("\n")


def test_layer_zero_imports_neither_torch_nor_tqdm():
    code = "import sys, ds_resilience.logs; print(sorted(m for m in ('torch', 'tqdm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
