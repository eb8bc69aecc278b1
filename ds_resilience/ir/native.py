"""The planner's hot loops in C (``csrc/schedule_core.c``, loaded with ctypes).

Four loops over a schedule encoded as flat numpy arrays, each with the same double operations in
the same order as its Python reference, so the results are equal bit for bit
(``tests/unit/ir/test_native.py`` compares each with its reference):

* :func:`list_orders`: the list scheduler's event loop (:mod:`ds_resilience.planning.list_scheduler`);
* :func:`replay_times`: what :func:`~.timeline.iteration_time` reads from a replay (every iteration's
  end, the makespan, a deadlock), for buffered sends and the step modes whose OPT_STEP is a local
  step or a collective (``plain``, ``barrier``, ``wait``); the others replay in Python;
* :func:`check`: the validator's rules 1-5 and 7 (:mod:`.validate`) as a yes or no; on no the
  Python validator runs and names the fault, so the C check must never pass what Python rejects;
* :func:`peaks`: every worker's memory peaks (:func:`~.timeline.memory_peaks`,
  :func:`ds_resilience.planning.memory.worker_peaks`).

Each returns ``None`` (``check``: ``False``) where it does not apply, and its caller runs the Python
code. The library is compiled on first use with the system C compiler (``$CC``, else ``cc``) into
``$DSR_NATIVE_CACHE`` (default ``~/.cache/ds_resilience``), one file per source hash, and reused
after. No compiler, a failed build, no numpy, an installed copy without ``csrc/``, or
``DSR_NATIVE=0``: the Python code everywhere, with one log line saying why. The replay's other
uses (transfers, spans, NCCL's rules) stay in :mod:`.replay`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..costs import CostModel
from .action import ActionKind
from .schedule import Schedule

__all__ = ["NativeTimes", "available", "check", "kind_codes", "list_orders", "peaks", "remember", "replay_times",
           "why_unavailable"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "schedule_core.c"
_OP_COMPUTE, _OP_SEND, _OP_RECV, _OP_COLLECTIVE = range(4)
_NATIVE_MODES = frozenset({"plain", "barrier", "wait"})

_lock = threading.Lock()
_state: dict[str, object] = {}


@dataclass(frozen=True)
class NativeTimes:
    """What the planner reads from a replay."""

    iteration_ends: list[float]  # per iteration (schedule.iterations * repeat): its last OPT_STEP's end
    makespan: float
    blocked: dict[int, int]  # stuck worker -> action index (in the repeated list), as Replay.blocked


def _cache_dir() -> Path:
    return Path(os.environ.get("DSR_NATIVE_CACHE") or Path.home() / ".cache" / "ds_resilience")


def _build() -> ctypes.CDLL:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    target = _cache_dir() / f"schedule_core-{digest}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not compiler:
            raise OSError("no C compiler (set CC or install cc)")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # build aside, then one rename
            out = Path(tmp) / target.name
            done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(SOURCE)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    p = ctypes.c_void_p
    lib.dsr_replay.restype = ctypes.c_int
    lib.dsr_replay.argtypes = [ctypes.c_int, p, p, p, p, p, p, p, ctypes.c_int, ctypes.c_double, ctypes.c_int,
                               ctypes.c_int, p, p, p, p, p, p, ctypes.c_int, p]
    lib.dsr_check.restype = ctypes.c_int
    lib.dsr_check.argtypes = [ctypes.c_int] * 5 + [p] * 9
    lib.dsr_peaks.restype = None
    lib.dsr_peaks.argtypes = [ctypes.c_int, ctypes.c_int] + [p] * 8
    lib.dsr_list_schedule.restype = ctypes.c_int64
    lib.dsr_list_schedule.argtypes = [ctypes.c_int] * 4 + [p] * 17
    return lib


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            lib, why = None, None
            if os.environ.get("DSR_NATIVE", "1") == "0":
                why = "DSR_NATIVE=0"
            elif importlib.util.find_spec("numpy") is None:
                why = "numpy is not installed"
            elif not SOURCE.exists():
                why = f"{SOURCE} is not there (an installed copy without csrc/)"
            else:
                try:
                    lib = _build()
                except Exception as exc:  # noqa: BLE001 (no compiler, no home, a bad build: Python runs)
                    why = f"{type(exc).__name__}: {exc}"
            if why is not None:
                log.info("C schedule core off, the Python code runs instead: %s", why)
            _state["lib"], _state["why"] = lib, why
        return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the C core loads here (built on the first call)."""
    return _library() is not None


def why_unavailable() -> str | None:
    """Why the C core is off (``None`` when it is on)."""
    _library()
    return _state.get("why")  # type: ignore[return-value]


class _Structure:
    """One schedule's actions as flat arrays (what does not depend on the cost model), and its
    messages matched: the k-th receive of a key with the k-th send (a key has one sender and one
    receiver, so within a key this is program order)."""

    def __init__(self, schedule: Schedule, np, columns: tuple | None = None) -> None:  # noqa: ANN001 (numpy)
        """``columns``: the actions' (kind code, stage, microbatch, pipeline, peer) as int arrays in
        worker order, ``None`` read as 0, as whoever built ``schedule`` from them knows them
        (:func:`remember`); else read from the actions."""
        from operator import attrgetter

        n = len(schedule.workers)
        dp, pp = schedule.dp, schedule.pp
        self.n = n
        self.sizes = np.fromiter(map(len, schedule.workers), dtype=np.int64, count=n)
        total = self.total = int(self.sizes.sum())
        self.off = np.zeros(n + 1, dtype=np.int64)
        self.off[1:] = np.cumsum(self.sizes)
        rows = None if columns is not None else list(map(attrgetter("kind", "stage", "microbatch", "pipeline", "peer"),
                                                         (x for actions in schedule.workers for x in actions)))
        if columns is not None:
            kinds, stages, mbs, pipes, peers = columns
            self.kinds = np.ascontiguousarray(kinds, dtype=np.int32)
            self.stage = np.ascontiguousarray(stages, dtype=np.int32)
            self.mb, self.pipe, self.peer = (np.ascontiguousarray(c, dtype=np.int64) for c in (mbs, pipes, peers))
        elif rows:
            k_col, s_col, m_col, p_col, q_col = zip(*rows)
            self.kinds = np.fromiter(map(_INDEX.__getitem__, k_col), dtype=np.int32, count=total)
            self.stage = np.fromiter(s_col, dtype=np.int32, count=total)
            # None (a field the kind does not have) reads as 0; the C side never looks at it
            self.mb, self.pipe, self.peer = (np.nan_to_num(np.array(col, dtype=np.float64), nan=0.0).astype(np.int64)
                                             for col in (m_col, p_col, q_col))
        else:
            self.kinds = self.stage = np.zeros(0, dtype=np.int32)
            self.mb = self.pipe = self.peer = np.zeros(0, dtype=np.int64)
        kinds, stage = self.kinds, self.stage
        self.worker = np.repeat(np.arange(n, dtype=np.int64), self.sizes)
        self.sends = np.isin(kinds, _SEND_CODES)
        self.recvs = np.isin(kinds, _RECV_CODES)
        is_ckpt = np.isin(kinds, [_K[ActionKind.CKPT_SEND], _K[ActionKind.CKPT_RECV]])
        channel = np.where(np.isin(kinds, [_K[ActionKind.SEND_GRAD], _K[ActionKind.RECV_GRAD]]), 1, 0)
        channel = np.where(is_ckpt, 2, channel)
        sender_stage = np.where(kinds == _K[ActionKind.RECV_ACT], stage - 1,
                                np.where(kinds == _K[ActionKind.RECV_GRAD], stage + 1, stage)).astype(np.int64)
        sender_stage = np.where(is_ckpt, 0, sender_stage)
        pipe = np.where(is_ckpt, 0, self.pipe)
        src = np.where(self.sends, self.worker, self.peer)
        dst = np.where(self.sends, self.peer, self.worker)
        self.s_pos = np.flatnonzero(self.sends)
        self.r_pos = np.flatnonzero(self.recvs)
        span_mb = int(self.mb.max()) + 1 if total else 1
        span_pipe = int(self.pipe.max()) + 1 if total else 1
        small = (total == 0 or (self.mb.min() >= 0 and self.pipe.min() >= 0 and self.peer.min() >= 0
                                and int(self.peer.max()) < n and int(stage.min()) >= 0 and int(stage.max()) < pp))
        self.matched = False  # every key sent and received equally often (else the C replay is off)
        self.pair_order = False  # and each pair's receives in its send order
        self.link_id = np.zeros(len(self.s_pos), dtype=np.int64)
        self.n_links = 0
        if small and 3 * span_pipe * span_mb * (pp + 2) * n * n < 2 ** 62 and len(self.s_pos) == len(self.r_pos):
            key = ((((channel * span_pipe + pipe) * span_mb + self.mb) * (pp + 2) + sender_stage + 1) * n + src) * n + dst
            self.s_order = self.s_pos[np.argsort(key[self.s_pos], kind="stable")]
            self.r_order = self.r_pos[np.argsort(key[self.r_pos], kind="stable")]
            self.matched = bool(np.array_equal(key[self.s_order], key[self.r_order]))
            link = src * n + dst
            s_by_link = self.s_pos[np.argsort(link[self.s_pos], kind="stable")]
            r_by_link = self.r_pos[np.argsort(link[self.r_pos], kind="stable")]
            self.pair_order = self.matched and bool(np.array_equal(key[s_by_link], key[r_by_link]))
            links, inverse = np.unique(link[self.s_pos], return_inverse=True)
            self.link_id = inverse.reshape(-1).astype(np.int64)
            self.n_links = len(links)
        alive = [i for i in range(n) if i not in schedule.failed]
        self.members: list[list[int]] = [[i for i in alive if i // dp == s] for s in range(pp)]
        self.members.append(alive)  # the global barrier: group pp; tied group g: pp + 1 + g
        self.members.extend([i for i in alive if i // dp in group] for group in schedule.tied)


_last: tuple | None = None  # (schedule, its structure): a plan reads one schedule 3-4 times in a row


def _structure(schedule: Schedule, np) -> _Structure:  # noqa: ANN001
    global _last
    last = _last  # one read, one write: threads never see a schedule with another's structure
    if last is not None and last[0] is schedule:
        return last[1]
    structure = _Structure(schedule, np)
    _last = (schedule, structure)
    return structure


def remember(schedule: Schedule, kinds, stages, microbatches, pipelines, peers) -> None:  # noqa: ANN001
    """Hold ``schedule``'s arrays for the C loops that read it next (the replay, the check, the peaks),
    from the columns it was built from: per action in worker order, its kind's code
    (:func:`kind_codes`), stage, microbatch, pipeline and peer, ``None`` given as 0. The caller
    vouches that they are ``schedule``'s (``tests/unit/planning/test_lowering_arrays.py``)."""
    global _last
    import numpy as np

    _last = (schedule, _Structure(schedule, np, (kinds, stages, microbatches, pipelines, peers)))


def kind_codes() -> dict[ActionKind, int]:
    """Each action kind's code in the arrays the C loops read."""
    return dict(_K)


def replay_times(schedule: Schedule, cost: CostModel, *, repeat: int = 1, mode: str = "plain") -> NativeTimes | None:
    """Iteration ends, makespan and deadlock of ``schedule`` replayed ``repeat`` times (buffered
    sends, no checkpoint messages' sizes), or ``None`` where only the Python replay applies: the
    library is off, the step mode is a speculative one, or a message key is sent and received a
    different number of times (which the Python replay resolves across iterations)."""
    if mode not in _NATIVE_MODES:
        return None
    lib = _library()
    if lib is None:
        return None
    import numpy as np

    st = _structure(schedule, np)
    if not st.matched:
        return None
    enc = _program(schedule, st, cost, mode, np)
    if enc is None:
        return None
    codes, a, b, dur = enc
    n, sizes, off, total = st.n, st.sizes, st.off, st.total
    roff = off * repeat
    goff = np.zeros(len(st.members) + 1, dtype=np.int64)
    goff[1:] = np.cumsum([len(m) for m in st.members])
    gmem = np.array([x for m in st.members for x in m], dtype=np.int32)
    is_opt = (st.kinds == _K[ActionKind.OPT_STEP]).astype(np.uint8)
    out_len = max(1, total * repeat)
    ends = np.zeros(out_len)
    arrival = np.zeros(out_len)
    pcs = np.zeros(max(1, n), dtype=np.int64)
    n_iter = schedule.iterations * repeat
    iter_ends = np.zeros(max(1, n_iter))
    last_arrival = ctypes.c_double(0.0)

    def ptr(x: np.ndarray) -> int:
        return x.ctypes.data

    if lib.dsr_replay(n, ptr(off), ptr(roff), ptr(codes), ptr(a), ptr(b), ptr(dur), ptr(is_opt), repeat,
                      float(cost.p2p_latency), st.n_links, len(st.members), ptr(goff), ptr(gmem), ptr(ends),
                      ptr(arrival), ptr(pcs), ptr(iter_ends), n_iter, ctypes.addressof(last_arrival)) < 0:
        raise MemoryError("native replay: out of memory")
    size = sizes.tolist()
    blocked = {w: int(pcs[w]) for w in range(n) if pcs[w] < size[w] * repeat}
    # as Replay.makespan: the last slot of every list, and the last arrival
    last = max((float(ends[roff[w] + size[w] * repeat - 1]) for w in range(n) if size[w]), default=0.0)
    makespan = max(last, last_arrival.value)
    return NativeTimes(iteration_ends=iter_ends[:n_iter].tolist(), makespan=makespan, blocked=blocked)


def check(schedule: Schedule) -> bool:
    """Whether ``schedule`` keeps the validator's rules 1-5 and 7 (:mod:`.validate`); ``False``
    also when the C checks are off. Rule 6, no deadlock, is the replay's. ``True`` is final;
    on ``False`` the Python validator runs and names what is wrong."""
    lib = _library()
    if lib is None:
        return False
    import numpy as np

    st = _structure(schedule, np)
    if not st.pair_order:  # rule 4 (every send matched) and rule 7 (pair order)
        return False
    dp, pp, mbs = schedule.dp, schedule.pp, schedule.microbatches
    if len(schedule.tied) > 64:
        return False
    member = np.zeros(max(1, len(schedule.tied) * pp), dtype=np.uint8)
    for g, group in enumerate(schedule.tied):
        for s in group:
            if 0 <= s < pp:
                member[g * pp + s] = 1
    failed = np.zeros(max(1, st.n), dtype=np.uint8)
    failed[[i for i in schedule.failed if 0 <= i < st.n]] = 1
    forwards = np.zeros(max(1, dp * pp * mbs), dtype=np.int32)
    rc = lib.dsr_check(dp, pp, mbs, schedule.iterations, len(schedule.tied), member.ctypes.data, failed.ctypes.data,
                       st.off.ctypes.data, st.kinds.ctypes.data, st.stage.ctypes.data, st.mb.ctypes.data,
                       st.pipe.ctypes.data, st.peer.ctypes.data, forwards.ctypes.data)
    if rc < 0:
        raise MemoryError("native check: out of memory")
    return rc == 0


def peaks(schedule: Schedule, weights) -> tuple | None:  # noqa: ANN001
    """Per worker: the memory-weighted peak of its states under ``weights`` (per stage
    ``(activation, pending W)``, as :meth:`CostModel.memory_weights`), and the peaks of its held
    activations, pending W's and their sum; ``None`` when the C library is off."""
    lib = _library()
    if lib is None:
        return None
    import numpy as np

    st = _structure(schedule, np)
    n = st.n
    act_w = np.array([float(a) for a, _ in weights] or [0.0])
    w_w = np.array([float(w) for _, w in weights] or [0.0])
    top = np.zeros(max(1, n))
    acts, pend, state = (np.zeros(max(1, n), dtype=np.int32) for _ in range(3))
    lib.dsr_peaks(n, schedule.dp, st.off.ctypes.data, st.kinds.ctypes.data, act_w.ctypes.data, w_w.ctypes.data,
                  top.ctypes.data, acts.ctypes.data, pend.ctypes.data, state.ctypes.data)
    return (tuple(top[:n].tolist()), tuple(acts[:n].tolist()), tuple(pend[:n].tolist()), tuple(state[:n].tolist()))


_KINDS = tuple(ActionKind)
_INDEX = {k: i for i, k in enumerate(_KINDS)}
_K = {k: _INDEX[k] for k in ActionKind}
_SEND_CODES = [_K[ActionKind.SEND_ACT], _K[ActionKind.SEND_GRAD], _K[ActionKind.CKPT_SEND]]
_RECV_CODES = [_K[ActionKind.RECV_ACT], _K[ActionKind.RECV_GRAD], _K[ActionKind.CKPT_RECV]]


def _program(schedule: Schedule, st: _Structure, cost: CostModel, mode: str, np):  # noqa: ANN001
    """The C replay's op arrays for ``cost`` and the step ``mode`` (codes, a, b, durations), the
    same ops as :func:`~.replay._compile`; ``None`` where the C loop does not apply."""
    from .replay import _COLLECTIVE, _COMPUTE, _duration_table, _opt_op

    pp = schedule.pp
    kinds, stage, total = st.kinds, st.stage, st.total
    stages = cost.stages(pp)
    K = _K
    duration = _duration_table(cost, pp)
    per_kind = np.zeros((len(_KINDS), pp))
    for (kind, s), value in duration.items():
        per_kind[K[kind], s] = value
    dur = per_kind[kinds, stage] if total else np.zeros(0)
    codes = np.full(total, _OP_COMPUTE, dtype=np.int32)
    a = np.zeros(total, dtype=np.int32)
    b = np.zeros(total, dtype=np.int64)
    sends, recvs = st.sends, st.recvs
    # how long a send keeps its link busy: an activation is the sender's output, a gradient the
    # output of the stage below the sender; a checkpoint chunk has no size in a planner's replay
    act_busy = np.array([cost.transfer_time(c.activation_bytes) for c in stages] + [0.0])
    grad = kinds == K[ActionKind.SEND_GRAD]
    dur = np.where(sends, act_busy[np.where(grad, stage - 1, stage)], dur)
    dur = np.where(kinds == K[ActionKind.CKPT_SEND], cost.transfer_time(0.0), dur)
    codes[sends] = _OP_SEND
    codes[recvs] = _OP_RECV
    a[sends | recvs] = st.peer[sends | recvs]
    reduce = kinds == K[ActionKind.REDUCE_GRAD]
    codes[reduce] = _OP_COLLECTIVE
    a[reduce] = stage[reduce]
    tied = kinds == K[ActionKind.TIED_REDUCE]
    if tied.any():
        groups = st.mb[tied]
        if groups.min() < 0 or groups.max() >= len(schedule.tied):
            return None  # the Python replay names the bad group
        codes[tied] = _OP_COLLECTIVE
        a[tied] = pp + 1 + groups
        dur[tied] = np.array([cost.tied_reduce_time(g) for g in schedule.tied])[groups]
    # OPT_STEP per stage as the Python replay runs it in this mode: a local step, or a collective of
    # every survivor (the global barrier, group pp) with the step check's messages
    opt = kinds == K[ActionKind.OPT_STEP]
    opt_code, opt_dur = np.zeros(pp, dtype=np.int32), np.zeros(pp)
    for s in range(pp):
        op = _opt_op(schedule, cost, s, mode, duration[ActionKind.OPT_STEP, s])
        if op[0] == _COMPUTE:
            opt_code[s], opt_dur[s] = _OP_COMPUTE, op[1]
        elif op[0] == _COLLECTIVE:
            opt_code[s], opt_dur[s] = _OP_COLLECTIVE, op[2]
        else:
            return None  # a speculative step's publish-and-validate: the Python replay
    codes[opt] = opt_code[stage[opt]]
    a[opt] = np.where(opt_code[stage[opt]] == _OP_COLLECTIVE, pp, 0)
    dur[opt] = opt_dur[stage[opt]]
    b[st.r_order] = st.s_order - st.off[st.worker[st.s_order]]  # the matched send's index in its sender's list
    b[st.s_pos] = st.link_id
    return codes, a, b, np.ascontiguousarray(dur, dtype=np.float64)


_TASK_KINDS = (ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW)


def list_orders(*, dp: int, pp: int, microbatches: int, cost: CostModel, assignment, split_backward: bool,
                act_caps, w_caps, mem_caps, start_times, mem_weights, raw: bool = False) -> tuple | None:  # noqa: ANN001
    """The list scheduler's orders and makespan from the C loop (arguments as
    :func:`ds_resilience.planning.list_scheduler.list_schedule`, every one given), or ``None``
    where only the Python loop applies: the library is off, the placement is not a full one of
    same-stage workers, or the caps leave it stuck (the Python loop then says why).

    ``raw``: instead of the orders, the arrays ``(worker, kind, pipeline, microbatch, owner)``: every
    task in the order the loop emitted it, its kind an index in ``(F, B, W, BW)``, and the
    placement (``owner[(p * pp + s) * microbatches + m]``: the worker of that item)."""
    lib = _library()
    if lib is None:
        return None
    import numpy as np

    from .action import trusted_action

    n, keys = dp * pp, dp * pp * microbatches
    if len(assignment) != keys:
        return None
    owner = np.full(keys, -1, dtype=np.int32)
    for (p, s, m), w in assignment.items():
        if not (0 <= p < dp and 0 <= s < pp and 0 <= m < microbatches and 0 <= w < n and w // dp == s):
            return None
        owner[(p * pp + s) * microbatches + m] = w
    if (owner < 0).any():
        return None
    stages = cost.stages(pp)
    t_f, t_b, t_w, t_bw = (np.array([getattr(c, name) for c in stages], dtype=np.float64)
                           for name in ("t_f", "t_b", "t_w", "t_bw"))
    links = np.array([cost.p2p_latency + cost.transfer_time(c.activation_bytes) for c in stages], dtype=np.float64)
    act = np.array([int(x) for x in act_caps], dtype=np.int32)
    wc = np.array([-1 if x is None else int(x) for x in w_caps], dtype=np.int32)
    mem = np.array([np.inf if x is None else float(x) for x in (mem_caps if mem_caps is not None else [None] * n)])
    start = np.array([float(x) for x in (start_times if start_times is not None else [0.0] * n)])
    weights = mem_weights if mem_weights is not None else [(1.0, 1.0)] * n
    aw = np.array([float(a) for a, _ in weights])
    ww = np.array([float(b) for _, b in weights])
    total = keys * (3 if split_backward else 2)
    o_w, o_kind, o_p, o_m = (np.zeros(max(1, total), dtype=np.int32) for _ in range(4))
    makespan = ctypes.c_double(0.0)
    arrays = (owner, t_f, t_b, t_w, t_bw, links, act, wc, mem, start, aw, ww, o_w, o_kind, o_p, o_m)
    got = lib.dsr_list_schedule(dp, pp, microbatches, int(bool(split_backward)),
                                *(x.ctypes.data for x in arrays), ctypes.addressof(makespan))
    if got == -1:
        raise MemoryError("native list scheduler: out of memory")
    if got < 0:
        return None
    if raw:  # the tasks in the order the loop emitted them, each (worker, kind index in _TASK_KINDS, pipeline, mb)
        return (o_w[:got], o_kind[:got], o_p[:got], o_m[:got], owner), makespan.value
    orders: list[list] = [[] for _ in range(n)]
    kinds = _TASK_KINDS
    for w, k, p, m in zip(o_w[:got].tolist(), o_kind[:got].tolist(), o_p[:got].tolist(), o_m[:got].tolist()):
        orders[w].append(trusted_action(kinds[k], w // dp, m, p))
    return orders, makespan.value
