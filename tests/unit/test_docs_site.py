"""The documentation site builds with ``mkdocs build --strict`` and its generated references exist.

Strict mode turns every warning into a failure, and ``mkdocs.yml`` makes broken links, missing
anchors, pages left out of the nav and nav entries that point nowhere warnings: so a page that
links to a moved section fails here. The configuration, command-line and layer references are
written into the build by ``docs/hooks/reference.py`` from the code (``ds_resilience/config.py``,
``ds_resilience.cli.subcommand_parsers()``, ``LAYERS`` in ``tests/unit/test_layering.py``); the
checks below read them back. mkdocs and mkdocstrings come with the package's ``test`` extra: a
missing one is a failure, not a skip.

The build runs the ``mkdocs`` console script beside this interpreter (a build tool, as the C
compiler some unit tests run), under a time limit, so a hook that hangs fails the test.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 180
README_MAX_LINES = 220


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _mkdocs_command() -> list[str]:
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python") if not _importable(m)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not importable: install the test extra (pip install -e '.[test]', which "
                    "brings mkdocs>=1.6 and mkdocstrings[python]>=0.26) to build the documentation site",
                    pytrace=False)
    script = Path(sys.executable).with_name("mkdocs")
    if not script.exists():
        found = shutil.which("mkdocs")
        if found is None:
            pytest.fail(f"mkdocs is importable but its console script is neither beside {sys.executable} nor "
                        "on PATH", pytrace=False)
        script = Path(found)
    return [str(script)]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module with ``--strict`` into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    command = _mkdocs_command() + ["build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                                   "--site-dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100")
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mkdocs build --strict took over {BUILD_TIMEOUT_S} s:\n{exc.stderr or ''}", pytrace=False)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed (exit {done.returncode}):\n{log[-6000:]}"
    print(f"mkdocs build --strict: {time.monotonic() - start:.1f} s")
    return out


def _page(site: Path, uri: str) -> str:
    path = site / uri / "index.html"
    assert path.exists(), f"{uri} was not built (pages: {sorted(p.parent.name for p in site.rglob('index.html'))})"
    return path.read_text(encoding="utf-8")


def test_site_builds_strict(site: Path) -> None:
    for uri in ("", "getting-started", "deepspeed", "megatron", "agent", "architecture", "planner",
                "checkpoints", "templates", "simulator", "troubleshooting", "status", "benchmarks"):
        _page(site, uri)


def test_configuration_reference_is_generated_from_config_py(site: Path) -> None:
    from dataclasses import fields

    from ds_resilience.config import CheckpointConfig, ResilienceConfig

    html = _page(site, "reference/config")
    for f in fields(ResilienceConfig):
        assert f"<code>{f.name}</code>" in html, f"resilience.{f.name} missing from the configuration reference"
    for f in fields(CheckpointConfig):
        assert f"<code>checkpoint.{f.name}</code>" in html, f"checkpoint.{f.name} missing"
    assert "max_restarts" in html and "&quot;cpsat&quot;" in html  # a known key, a known allowed value


def test_cli_reference_is_generated_from_the_parsers(site: Path) -> None:
    html = _page(site, "reference/cli")
    for command in ("plan", "plan-table", "simulate", "placement", "templates", "run", "profile", "demo"):
        assert f"ds-resilience {command}" in html, f"subcommand {command} missing from the CLI reference"
    for option in ("--microbatches", "--max-failures", "--rejoin_after", "--heartbeat_timeout", "--profile-steps",
                   "--kill-step", "--mtbf", "--replicas"):
        assert option in html, f"option {option} missing from the CLI reference"


def test_layer_reference_is_generated_from_the_layering_test(site: Path) -> None:
    spec = importlib.util.spec_from_file_location("_docs_test_layering", ROOT / "tests" / "unit" / "test_layering.py")
    layering = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layering)
    html = _page(site, "reference/layers")
    for module, layer in layering.LAYERS.items():
        assert f"<code>{module}</code>" in html, f"{module} (L{layer}) missing from the layer reference"
    assert f"L{max(layering.LAYERS.values())}" in html


def test_api_reference_documents_initialize(site: Path) -> None:
    html = _page(site, "reference/api")
    assert "initialize" in html and "deepspeed.initialize" in html


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail into a docs/ page")


def test_benchmark_pages_state_date_and_machine() -> None:
    pages = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
    assert len(pages) > 2 and not (ROOT / "BENCHMARKS.md").exists()
    for page in pages:
        if page.name == "index.md":
            continue
        text = page.read_text(encoding="utf-8")
        assert "**Measured:**" in text and "**Machine:**" in text, f"{page.name} lacks its date or machine"
