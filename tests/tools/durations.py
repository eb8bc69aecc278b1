"""The suite's time from a JUnit XML report (``pytest --junitxml=FILE``), as Markdown tables.

    python tests/tools/durations.py FILE [FILE ...] [--top 40]   # e.g. .test-reports/*.xml
    python tests/tools/durations.py .test-reports/*.xml --write tests/durations.json

Prints the slowest tests (setup, call and teardown together: a module fixture's run is charged to
the first test that uses it) and the time per file and per tier. ``--write`` also keeps the time
per file (of files over a second) as JSON: ``conftest.py`` hands files to the pytest-xdist workers
longest first from it. Pure standard library.
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", nargs="+")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--write", metavar="JSON", help="also write {file: seconds} for files over a second")
    args = p.parse_args(argv)
    tests, files, tiers = [], collections.Counter(), collections.Counter()
    cases = [case for path in args.junit for case in ET.parse(path).iter("testcase")]
    for case in cases:
        path = case.get("classname", "").replace(".", "/") + ".py"  # relative to tests/
        seconds = float(case.get("time", 0))
        tests.append((seconds, f"{path}::{case.get('name')}"))
        files[path] += seconds
        first = path.split("/")[0]
        tiers[first if first in ("dist", "live") else "unit"] += seconds
    total = sum(files.values())
    print(f"| tier | seconds | share |\n|---|---:|---:|")
    for tier in ("unit", "dist", "live"):
        print(f"| {tier} | {tiers[tier]:.0f} | {tiers[tier] / total:.0%} |")
    print(f"| all ({len(tests)} tests) | {total:.0f} | |\n")
    print(f"| the {args.top} slowest tests | seconds |\n|---|---:|")
    for seconds, name in sorted(tests, reverse=True)[: args.top]:
        print(f"| `{name}` | {seconds:.1f} |")
    print("\n| file | seconds |\n|---|---:|")
    for path, seconds in files.most_common():
        if seconds >= 0.5:
            print(f"| `{path}` | {seconds:.1f} |")
    print(f"| {sum(1 for s in files.values() if s < 0.5)} files under 0.5 s each | "
          f"{sum(s for s in files.values() if s < 0.5):.1f} |")
    if args.write:
        slow = {path: round(seconds, 1) for path, seconds in files.most_common() if seconds >= 1.0}
        with open(args.write, "w") as f:
            json.dump(slow, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
