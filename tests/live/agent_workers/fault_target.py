"""Walks steps 0..4 through every fault point, printing each before calling the injector.

Usage: ``python fault_target.py RANK``; faults come from ``DSR_FAULTS``. Prints ``survived`` at the
end. No torch: the injector is pure Python.
"""

from __future__ import annotations

import os
import sys

from ds_resilience.vocab import ITERATION_POINTS
from ds_resilience.runtime.faults import FaultInjector


def main() -> int:
    injector = FaultInjector((), int(sys.argv[1]), env=os.environ)
    for step in range(5):
        for point in ITERATION_POINTS:
            print(f"{step} {point}", flush=True)
            injector.maybe_fire(point, step)
    print("survived", [f"{f.step} {f.point}" for f in injector.fired], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
