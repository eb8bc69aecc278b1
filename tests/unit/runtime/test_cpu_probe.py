"""py-cpuinfo asked once per machine (runtime/cpu_probe.py): DeepSpeed's op builder calls
``cpuinfo.get_cpu_info`` twice per CPU op load, a subprocess each."""

from __future__ import annotations

import json

import pytest

cpuinfo = pytest.importorskip("cpuinfo")

from ds_resilience.runtime import cpu_probe  # noqa: E402
from ds_resilience.runtime.cpu_probe import memoize_cpu_info  # noqa: E402


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Each test its own cache directory (never the machine's: a made-up answer there would give
    DeepSpeed's next build made-up flags)."""
    monkeypatch.setenv(cpu_probe.CACHE_VAR, str(tmp_path / "cache"))
    return tmp_path / "cache"


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


def test_warm_asks_at_once_and_the_next_process_reads_the_answer_from_disk(monkeypatch, cache_dir):
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"arch": "ARM_8", "flags": []})
    memoize_cpu_info(warm=True)
    assert len(calls) == 1
    assert cpuinfo.get_cpu_info() == {"arch": "ARM_8", "flags": []} and len(calls) == 1
    files = list(cache_dir.glob("cpuinfo-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["arch"] == "ARM_8"
    # another process on the machine: a fresh memo reads the file and asks nothing
    fresh = cpu_probe._memo(lambda: pytest.fail("asked again"), files[0])
    assert fresh()["arch"] == "ARM_8"
    files[0].write_text("{not json")  # a torn or foreign file: asked again, and rewritten
    again = []
    assert cpu_probe._memo(lambda: again.append(1) or {"arch": "X86_64"}, files[0])()["arch"] == "X86_64"
    assert again and json.loads(files[0].read_text())["arch"] == "X86_64"


def test_an_empty_cache_setting_keeps_no_file(monkeypatch, cache_dir):
    monkeypatch.setenv(cpu_probe.CACHE_VAR, "")
    assert cpu_probe._cache_file("9.0.0") is None
    monkeypatch.setenv(cpu_probe.CACHE_VAR, str(cache_dir))
    first, other = cpu_probe._cache_file("9.0.0"), cpu_probe._cache_file("9.0.1")
    assert first.parent == cache_dir and first != other  # py-cpuinfo's version is part of the key
