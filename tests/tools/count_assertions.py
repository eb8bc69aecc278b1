"""Count the assertions of the test suite, so a reorganisation can show it dropped none.

    python tests/tools/count_assertions.py [TESTS_DIR]      # total, then per test function

An assertion is an ``assert`` statement, a ``pytest.raises``/``pytest.warns`` block or call, or a
``torch.testing.assert_close``/``np.testing.assert_*`` call, anywhere under the tests directory
(test modules, helper programs and the harness alike: a test merged into a shared scenario keeps
its assertions wherever they end up). Pure standard library.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

_CALLS = {"raises", "warns", "assert_close", "assert_allclose", "assert_array_equal", "assert_equal"}


def count(tree: ast.AST) -> int:
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            n += 1
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in _CALLS:
                n += 1
    return n


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    total, tests = 0, 0
    rows = []
    for path in sorted(root.rglob("*.py")):
        if "tools" in path.relative_to(root).parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        n = count(tree)
        t = sum(1 for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name.startswith("test_"))
        total, tests = total + n, tests + t
        rows.append((str(path.relative_to(root)), n, t))
    for name, n, t in rows:
        print(f"{n:6d} assertions {t:4d} test functions  {name}")
    print(f"{total:6d} assertions {tests:4d} test functions  in {len(rows)} files under {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
