"""The pure layers must load without torch or deepspeed (ARCHITECTURE.md, L0-L2)."""

import subprocess
import sys

import pytest

PURE = [
    "ds_resilience",
    "ds_resilience.ir",
    "ds_resilience.planning",
    "ds_resilience.sim",
    "ds_resilience.topology",
    "ds_resilience.config",
    "ds_resilience.costs",
    "ds_resilience.errors",
    "ds_resilience.cli",
]
HEAVY = ["torch", "deepspeed", "megatron", "triton", "matplotlib"]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_heavy_package(module):
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        f"bad = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"


def test_plan_command_does_not_import_torch():
    code = (
        "import sys, io, contextlib\n"
        "from ds_resilience.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['plan', '--dp', '2', '--pp', '3', '--microbatches', '4', '--json'])\n"
        "print('torch' in sys.modules, 'deepspeed' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
