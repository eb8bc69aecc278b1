"""One closing line for several JUnit XML reports: ``total: N passed, N failed, N skipped``."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(paths: list[str]) -> int:
    tests = failed = skipped = 0
    for path in paths:
        for suite in ET.parse(path).iter("testsuite"):
            tests += int(suite.get("tests", 0))
            failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
    print(f"total: {tests - failed - skipped} passed, {failed} failed, {skipped} skipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
