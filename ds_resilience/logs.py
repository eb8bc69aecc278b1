"""Logging for ds_resilience: named loggers, one rank-aware handler per process, ``log_dist``, progress bars.

Modules take a logger with ``log = get_logger(__name__)`` and log with it. The first call installs
one handler for the process; every logger from :func:`get_logger` writes through it:

* the format is ``[ds_resilience] <message>`` (exactly what the workers printed before, so logs
  and tests read the same lines); ``DSR_LOG_FORMAT`` replaces it with any ``logging`` format, which
  may also name ``%(rank)s``: the launch environment's ``RANK``, or ``-`` outside a launch;
* records go to ``sys.stderr`` as it is when they are written (pytest's capture, a redirected
  stream), or to ``sys.stdout`` with ``extra=STDOUT``; ``extra=BARE`` leaves out the prefix;
* every record is flushed at once: a worker can be SIGKILLed the next instant;
* the level is ``DSR_LOG_LEVEL`` (a name or a number), INFO by default;
* these loggers do not propagate to the root logger (as DeepSpeed's own logger): an application
  that configures the root logger gets no second copy. Configure ``ds_resilience.*`` loggers
  directly to route them elsewhere.

The handler sits on each logger :func:`get_logger` returns, not on the ``ds_resilience`` parent:
loggers taken with plain ``logging.getLogger`` keep the standard library's behaviour (warnings on
stderr through ``logging.lastResort``, info dropped).

:func:`log_dist` logs on chosen ranks only, in DeepSpeed's ``deepspeed.utils.logging.log_dist``
convention (``ranks=None`` or ``[-1]``: every rank). :func:`progress_bar` draws a tqdm bar on
rank 0 when stderr is a terminal (or ``DSR_PROGRESS=1``), and is a no-op otherwise.

Layer 0: the standard library only (tqdm and torch are looked up lazily).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable

__all__ = ["BARE", "PREFIX", "STDOUT", "current_rank", "get_logger", "log_dist", "progress_bar", "progress_enabled"]

ROOT = "ds_resilience"
PREFIX = "[ds_resilience] "
STDOUT = {"dsr_stream": "stdout"}
"""``extra=STDOUT``: this record goes to stdout (where the line was printed to stdout before)."""
BARE = {"dsr_bare": True}
"""``extra=BARE``: this record has no ``[ds_resilience]`` prefix (under the default format)."""

_handler: logging.Handler | None = None


def current_rank() -> int | None:
    """This process's global rank: the launch environment's ``RANK``, else torch.distributed's if it is
    already imported and initialized, else ``None`` (not a distributed run)."""
    env = os.environ.get("RANK", "").strip()
    if env.lstrip("-").isdigit():
        return int(env)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class _Formatter(logging.Formatter):
    """``[ds_resilience] <message>``, or ``DSR_LOG_FORMAT``; ``extra=BARE`` drops the default prefix."""

    def __init__(self, fmt: str | None) -> None:
        super().__init__(fmt or PREFIX + "%(message)s")
        self._bare = None if fmt else logging.Formatter("%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if self._bare is not None and getattr(record, "dsr_bare", False):
            return self._bare.format(record)
        return super().format(record)


class _RankHandler(logging.Handler):
    """Writes each record to the current ``sys.stderr`` (or ``sys.stdout``) and flushes it."""

    terminator = "\n"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            rank = current_rank()
            record.rank = "-" if rank is None else rank
            text = self.format(record)
            stream = sys.stdout if getattr(record, "dsr_stream", None) == "stdout" else sys.stderr
            if stream is None:  # no console (pythonw, a closed stream): nothing to write to
                return
            bars = sys.modules.get("tqdm")
            if bars is not None and getattr(bars.tqdm, "_instances", None):
                with bars.tqdm.external_write_mode(file=stream):  # a bar is drawn: clear it, write, redraw
                    stream.write(text + self.terminator)
                    stream.flush()
                return
            stream.write(text + self.terminator)
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def _level() -> int:
    text = os.environ.get("DSR_LOG_LEVEL", "").strip()
    if not text:
        return logging.INFO
    if text.isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    return level if isinstance(level, int) else logging.INFO


def _install() -> logging.Handler:
    """The process's one handler, made on first use (a forked worker inherits it: it reads the
    streams and ``RANK`` at each record, so the parent's do not stick)."""
    global _handler
    if _handler is None:
        handler = _RankHandler()
        handler.setFormatter(_Formatter(os.environ.get("DSR_LOG_FORMAT") or None))
        _handler = handler
    return _handler


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` (a module's ``__name__``; names outside the package go under
    ``ds_resilience.``), writing through the process's rank-aware handler."""
    if name == ROOT:
        raise ValueError("take a named logger under ds_resilience (get_logger(__name__)), not the package's own")
    if not name.startswith(ROOT + "."):
        name = f"{ROOT}.{name}"
    logger = logging.getLogger(name)
    handler = _install()
    if handler not in logger.handlers:
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(_level())
    return logger


def log_dist(message: str, ranks: Iterable[int] | None = (0,), level: int = logging.INFO, *,
             logger: logging.Logger | None = None, **kwargs: Any) -> None:
    """Log ``message`` on the given ranks only (DeepSpeed's ``log_dist``): ``ranks=None`` or a first
    rank of ``-1`` logs on every rank; a process outside a distributed run always logs. ``logger``
    defaults to ``ds_resilience.dist``; ``kwargs`` (``extra=...``) go to :meth:`logging.Logger.log`."""
    chosen = None if ranks is None else list(ranks)
    rank = current_rank()
    if chosen is not None and (not chosen or chosen[0] != -1) and rank is not None and rank not in chosen:
        return
    (logger or get_logger(ROOT + ".dist")).log(level, message, **kwargs)


def progress_enabled(requested: bool | None = None) -> bool:
    """Whether to draw a progress bar here: never off rank 0 or with ``requested`` False or
    ``DSR_PROGRESS=0``; with ``DSR_PROGRESS=1`` always; else only when stderr is a terminal."""
    rank = current_rank()
    if requested is False or (rank is not None and rank != 0):
        return False
    env = os.environ.get("DSR_PROGRESS", "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    stream = sys.stderr
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):
        return False


class _NoBar:
    """What :func:`progress_bar` returns when no bar is drawn: the calls a caller makes, doing nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(total: int | None, desc: str, *, enabled: bool | None = None, unit: str = "it",
                 delay_s: float = 1.0):
    """A tqdm bar on stderr (use as a context manager: ``update``, ``set_postfix_str``), or a no-op
    one where :func:`progress_enabled` says no or tqdm is missing. On a terminal the bar appears
    only once the work has taken ``delay_s`` and is erased when it ends, so short work and the log
    lines after it stay as they were."""
    if not progress_enabled(enabled):
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, delay=delay_s, leave=not tty,
                dynamic_ncols=True, mininterval=0.5 if tty else 10.0)
