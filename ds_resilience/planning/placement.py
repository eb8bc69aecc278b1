"""Where the in-memory checkpoint replicas live: Gemini's group and mixed placement (layer L1).

Every machine keeps ``replicas`` (m) copies of its checkpoint in CPU memory, its own included,
spread over N machines. Following Gemini (Wang et al., SOSP'23), as digested in
``shared/research/checkpoint.md`` §1.1:

* **Group placement** (m divides N): the machines are split into N/m groups of m consecutive
  machines; every machine stores the checkpoint of every member of its group (its own included).
  Gemini's theorem: this maximizes the probability of recovering from CPU memory.
* **Mixed placement** (m does not divide N): the first floor(N/m) - 1 groups have m machines each,
  with group placement inside; the last group has m + N mod m machines, too many for every member
  to hold everyone, so inside it the checkpoints are placed as a **ring**: the machine at position
  j of the group is held by positions j, j+1, ..., j+m-1 (mod the group size), i.e. it sends its
  checkpoint to its m-1 successors. (§1.1 "Mixed strategy" / "Ring"; the digest's probe
  reproduces Gemini's stated gap (2m-3)/C(N,m) to the optimum exactly with this reading: N=5,
  m=2 gives 0.600 against an optimum of 0.700 at two failures.) When floor(N/m) = 1 the ring
  group is all N machines.

The recovery probability is exact: holder sets never cross group boundaries, so the number of
survivable failure sets of size k is the coefficient of x^k in the product over groups of each
group's "survivable subsets" polynomial, with closed forms for full groups (every subset but the
whole group) and ring groups (cyclic 0/1 strings without m consecutive failed machines). Pure
Python; never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from math import comb
from typing import Iterable, Mapping, Sequence

from ..errors import ConfigError, PlanningError

__all__ = [
    "Placement",
    "place",
    "recovery_probability",
    "recovery_probabilities",
    "survivable_failure_sets",
    "brute_force_probability",
    "corollary_lower_bound",
    "lost_checkpoints",
    "retrieval_plan",
    "placement_from_holders",
]

# A group whose holder sets are neither "full" nor "ring" (only possible for a hand-built
# Placement) is counted by enumerating its subsets; above this size that is refused.
_MAX_ENUMERATED_GROUP = 20


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Which machines hold each machine's in-memory checkpoint.

    Attributes:
        machines: N, the number of machines (ranked 0..N-1).
        replicas: m, the copies of each checkpoint, the owner's own copy included.
        groups: disjoint tuples of machine ids covering 0..N-1; no checkpoint leaves its group.
        holders: ``holders[i]`` is the sorted tuple of the m machines storing machine i's
            checkpoint; it always contains i itself.

    Invariants are checked on construction; build one with :func:`place`.
    """

    machines: int
    replicas: int
    groups: tuple[tuple[int, ...], ...]
    holders: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        _check_counts(self.machines, self.replicas)
        n = self.machines
        seen: dict[int, int] = {}
        for gi, group in enumerate(self.groups):
            if not group:
                raise PlanningError(f"placement group {gi} is empty")
            for x in group:
                if not 0 <= x < n:
                    raise PlanningError(f"placement group {gi} names machine {x}, allowed 0..{n - 1}")
                if x in seen:
                    raise PlanningError(f"machine {x} is in placement groups {seen[x]} and {gi}")
                seen[x] = gi
        missing = sorted(set(range(n)) - set(seen))
        if missing:
            raise PlanningError(f"machines {missing} are in no placement group")
        if len(self.holders) != n:
            raise PlanningError(f"holders has {len(self.holders)} entries, expected one per machine ({n})")
        for i, hs in enumerate(self.holders):
            if tuple(sorted(set(hs))) != tuple(hs):
                raise PlanningError(f"holders of machine {i} must be sorted and distinct, got {list(hs)}")
            if len(hs) != self.replicas:
                raise PlanningError(
                    f"machine {i} has {len(hs)} holders {list(hs)}, expected replicas={self.replicas}"
                )
            if i not in hs:
                raise PlanningError(f"machine {i} does not hold its own checkpoint (holders {list(hs)})")
            outside = [h for h in hs if seen.get(h) != seen[i]]
            if outside:
                raise PlanningError(
                    f"holders {outside} of machine {i} are outside its placement group {list(self.groups[seen[i]])}"
                )

    @property
    def kind(self) -> str:
        """``"group"`` when every group stores all its members' checkpoints, else ``"mixed"``."""
        if all(self.holders[i] == tuple(sorted(g)) for g in self.groups for i in g):
            return "group"
        return "mixed"

    def group_of(self, machine: int) -> tuple[int, ...]:
        """The placement group containing ``machine``."""
        _check_machine(self.machines, machine)
        return next(g for g in self.groups if machine in g)

    def stored_on(self, machine: int) -> tuple[int, ...]:
        """The machines whose checkpoints ``machine`` keeps in memory (its own included), sorted."""
        _check_machine(self.machines, machine)
        return tuple(i for i, hs in enumerate(self.holders) if machine in hs)

    def to_dict(self) -> dict:
        """A JSON-ready view: machines, replicas, kind, groups and holders as lists."""
        return {
            "machines": self.machines,
            "replicas": self.replicas,
            "kind": self.kind,
            "groups": [list(g) for g in self.groups],
            "holders": [list(h) for h in self.holders],
        }


def _check_counts(machines: object, replicas: object) -> None:
    if isinstance(machines, bool) or not isinstance(machines, int) or machines < 1:
        raise ConfigError("machines", f"must be an integer >= 1, got {machines!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= machines:
        raise ConfigError(
            "replicas",
            f"must be an integer in [1, {machines}] (1 to the machine count, own copy included), got {replicas!r}",
        )


def _check_machine(machines: int, machine: object) -> None:
    if isinstance(machine, bool) or not isinstance(machine, int) or not 0 <= machine < machines:
        raise PlanningError(f"machine {machine!r} out of range; allowed 0..{machines - 1}")


def _check_failures(placement: Placement, failures: object) -> int:
    n = placement.machines
    if isinstance(failures, bool) or not isinstance(failures, int) or not 0 <= failures <= n:
        raise PlanningError(f"failures must be an integer in [0, {n}] (0 to the machine count), got {failures!r}")
    return failures


def place(machines: int, replicas: int) -> Placement:
    """Gemini's placement of ``replicas`` copies of each checkpoint over ``machines`` machines.

    Group placement when ``replicas`` divides ``machines``, else mixed placement (groups of m and a
    last group of m + N mod m machines with ring placement inside); see the module docstring.

    Raises:
        ConfigError: ``machines < 1`` or ``replicas`` outside [1, machines].
    """
    _check_counts(machines, replicas)
    n, m = machines, replicas
    count = n // m  # >= 1 because m <= n
    starts = [g * m for g in range(count)]
    groups = [tuple(range(s, s + m)) for s in starts[:-1]]
    groups.append(tuple(range(starts[-1], n)))  # m + N mod m machines
    holders: list[tuple[int, ...]] = [()] * n
    for group in groups:
        size = len(group)
        for j, machine in enumerate(group):
            if size == m:  # group placement: everyone in the group holds everyone
                holders[machine] = group
            else:  # ring: held by itself and its m-1 successors in the group
                holders[machine] = tuple(sorted(group[(j + d) % size] for d in range(m)))
    return Placement(machines=n, replicas=m, groups=tuple(groups), holders=tuple(holders))


# --- exact counting -------------------------------------------------------------------------------


def _bounded_compositions(total: int, parts: int, cap: int) -> int:
    """Number of (g_1..g_parts) with 0 <= g <= cap and sum ``total`` (inclusion-exclusion)."""
    if parts == 0:
        return 1 if total == 0 else 0
    step = cap + 1
    return sum(
        (-1) ** i * comb(parts, i) * comb(total - i * step + parts - 1, parts - 1)
        for i in range(min(parts, total // step) + 1)
    )


def _ring_counts(size: int, window: int) -> list[int]:
    """counts[j]: j-subsets of a cycle of ``size`` with no ``window`` cyclically consecutive members.

    With z = size - j >= 1 survivors, the failed machines fall into the z cyclic gaps between
    survivors, each gap < window. A (subset, marked survivor) pair is a (start position,
    composition of j into z bounded gaps) pair, so the count is size * compositions / z.
    """
    counts = []
    for j in range(size + 1):
        z = size - j
        if z == 0:
            counts.append(0)
            continue
        pairs = size * _bounded_compositions(j, z, window - 1)
        counts.append(pairs // z)
    return counts


def _enumerated_counts(group: Sequence[int], holders: Sequence[Sequence[int]]) -> list[int]:
    if len(group) > _MAX_ENUMERATED_GROUP:
        raise PlanningError(
            f"cannot count failure sets of a {len(group)}-machine group whose holders are neither "
            f"group nor ring placement (at most {_MAX_ENUMERATED_GROUP} machines are enumerated)"
        )
    counts = [0] * (len(group) + 1)
    for j in range(len(group) + 1):
        for failed in combinations(group, j):
            dead = set(failed)
            if all(not dead.issuperset(holders[i]) for i in failed):
                counts[j] += 1
    return counts


def _group_counts(placement: Placement, group: tuple[int, ...]) -> list[int]:
    size, m = len(group), placement.replicas
    ordered = tuple(sorted(group))
    if all(placement.holders[i] == ordered for i in group):  # full group: lost only if all fail
        return [comb(size, j) for j in range(size)] + [0]
    if all(
        placement.holders[x] == tuple(sorted(group[(j + d) % size] for d in range(m))) for j, x in enumerate(group)
    ):
        return _ring_counts(size, m)
    return _enumerated_counts(group, placement.holders)


def survivable_failure_sets(placement: Placement) -> tuple[int, ...]:
    """``result[k]``: how many k-machine failure sets leave every checkpoint on an alive holder.

    Exact integers for k = 0..N; the product over groups of each group's counting polynomial.
    """
    total = [1]
    for group in placement.groups:
        counts = _group_counts(placement, group)
        product = [0] * (len(total) + len(counts) - 1)
        for a, ca in enumerate(total):
            if ca:
                for b, cb in enumerate(counts):
                    product[a + b] += ca * cb
        total = product
    return tuple(total)


def recovery_probabilities(placement: Placement, max_failures: int) -> tuple[float, ...]:
    """:func:`recovery_probability` for every failure count 0..``max_failures``."""
    k_max = _check_failures(placement, max_failures)
    counts = survivable_failure_sets(placement)
    n = placement.machines
    return tuple(counts[k] / comb(n, k) for k in range(k_max + 1))


def recovery_probability(placement: Placement, failures: int) -> float:
    """Probability that every checkpoint survives ``failures`` machines failing uniformly at random.

    "Survives" means at least one of its holders is alive; computed exactly (combinatorially).

    Raises:
        PlanningError: ``failures`` outside [0, machines].
    """
    return recovery_probabilities(placement, failures)[failures]


def brute_force_probability(placement: Placement, failures: int) -> float:
    """The same probability by enumerating every failure set (exponential; for tests)."""
    k = _check_failures(placement, failures)
    n = placement.machines
    ok = 0
    for failed in combinations(range(n), k):
        dead = set(failed)
        if all(any(h not in dead for h in hs) for hs in placement.holders):
            ok += 1
    return ok / comb(n, k)


def corollary_lower_bound(machines: int, replicas: int, failures: int) -> float:
    """Gemini's corollary for group placement: 1 if k < m, else max(0, 1 - N·C(N-m, k-m)/(m·C(N, k))).

    A lower bound on :func:`recovery_probability` of group placement (digest §1.1 "Corollary").
    """
    _check_counts(machines, replicas)
    n, m, k = machines, replicas, failures
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
        raise PlanningError(f"failures must be an integer in [0, {n}] (0 to the machine count), got {k!r}")
    if k < m:
        return 1.0
    return max(0.0, 1.0 - n * comb(n - m, k - m) / (m * comb(n, k)))


# --- recovery -------------------------------------------------------------------------------------


def _failed_set(placement: Placement, failed: Iterable[int]) -> frozenset[int]:
    dead = frozenset(failed)
    for x in dead:
        _check_machine(placement.machines, x)
    return dead


def lost_checkpoints(placement: Placement, failed: Iterable[int]) -> tuple[int, ...]:
    """The machines whose checkpoint has no alive holder when ``failed`` machines are down."""
    dead = _failed_set(placement, failed)
    return tuple(i for i in sorted(dead) if dead.issuperset(placement.holders[i]))


def retrieval_plan(placement: Placement, failed: Iterable[int]) -> dict[int, int]:
    """For each failed machine, the alive holder to fetch its checkpoint from.

    The lowest-numbered alive holder is chosen (digest §5.4 "Recover"). Alive machines restore from
    their own memory and are not in the plan.

    Raises:
        PlanningError: a failed id is out of range, or some checkpoints lost every holder (the
            message names them; recover those from the persistent tier).
    """
    dead = _failed_set(placement, failed)
    lost = lost_checkpoints(placement, dead)
    if lost:
        detail = "; ".join(f"machine {i} (holders {list(placement.holders[i])})" for i in lost)
        raise PlanningError(
            f"checkpoints of machines {list(lost)} are lost from memory: every holder failed "
            f"(failed {sorted(dead)}): {detail}; recover them from the persistent tier"
        )
    return {i: next(h for h in placement.holders[i] if h not in dead) for i in sorted(dead)}


def placement_from_holders(machines: int, replicas: int, holders: Mapping[int, Iterable[int]]) -> Placement:
    """Build a :class:`Placement` from an arbitrary holder map (groups = connected components).

    For experiments with placements other than Gemini's (e.g. the exhaustive optimum search).
    """
    _check_counts(machines, replicas)
    parent = list(range(machines))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    hs = []
    for i in range(machines):
        if i not in holders:
            raise PlanningError(f"no holders given for machine {i}")
        row = tuple(sorted(set(holders[i])))
        for h in row:
            _check_machine(machines, h)
            parent[find(h)] = find(i)
        hs.append(row)
    comps: dict[int, list[int]] = {}
    for i in range(machines):
        comps.setdefault(find(i), []).append(i)
    groups = tuple(sorted(tuple(c) for c in comps.values()))
    return Placement(machines=machines, replicas=replicas, groups=groups, holders=tuple(hs))

