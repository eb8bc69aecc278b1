"""py-cpuinfo asked once per process (runtime/cpu_probe.py): DeepSpeed's op builder calls
``cpuinfo.get_cpu_info`` twice per CPU op load, a subprocess each."""

from __future__ import annotations

import pytest

cpuinfo = pytest.importorskip("cpuinfo")

from ds_resilience.runtime.cpu_probe import memoize_cpu_info  # noqa: E402


def test_the_first_answer_is_kept_and_each_caller_gets_its_own_copy(monkeypatch):
    calls = []

    def ask():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2"]}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", ask)
    assert memoize_cpu_info() and not calls  # lazy without warm
    first = cpuinfo.get_cpu_info()
    first["flags"].append("mutated by a caller")
    first["arch"] = "changed"
    second = cpuinfo.get_cpu_info()
    from cpuinfo import get_cpu_info  # as DeepSpeed's builder imports it, at each call

    assert get_cpu_info()["arch"] == second["arch"] == "X86_64" and len(calls) == 1
    assert second["flags"] == ["avx2"]
    memoize_cpu_info(warm=True)  # idempotent: not wrapped twice, nothing asked again
    assert len(calls) == 1 and cpuinfo.get_cpu_info()["arch"] == "X86_64"


def test_warm_asks_at_once(monkeypatch):
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"arch": "ARM_8"})
    memoize_cpu_info(warm=True)
    assert len(calls) == 1
    assert cpuinfo.get_cpu_info() == {"arch": "ARM_8"} and len(calls) == 1
