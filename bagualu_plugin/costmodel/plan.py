"""`Plan`: a mitigation strategy per operator (paper §V-A), the value the planner produces, the
cost model prices and the runtime installs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from .graph import OpId
from .mitigation import STRATEGIES

# How many plans a per-plan cache keeps (the most recent): a run meets few plans again and again,
# and over a long one with spikes ever new combinations of escalated layers, used once or twice.
PLANS_CACHED = 256


class Plan(Mapping[OpId, str]):
    """{OpId: "keep" | "recompute" | "offload" | "fp8"}; ops not named are kept. Keys may be
    written as "layer.op" strings ("3.expert_fc1")."""

    def __init__(self, strategies: Mapping[OpId | str, str] | None = None):
        self._map: dict[OpId, str] = {}
        self._key: tuple[tuple[OpId, str], ...] | None = None
        self._blocks: dict[int, tuple[tuple[str, str], ...]] | None = None
        self._hash: int | None = None
        self._named: tuple[tuple[str, str], ...] | None = None
        for key, strategy in (strategies or {}).items():
            op = key if isinstance(key, OpId) else OpId.parse(key)
            if strategy not in STRATEGIES:
                raise ValueError(f"plan: op {op} has strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
            self._map[op] = strategy

    @classmethod
    def uniform(cls, ops: Iterable[OpId], strategy: str) -> Plan:
        return cls(dict.fromkeys(ops, strategy))

    def __getitem__(self, op: OpId) -> str:
        return self._map[op]

    def __iter__(self) -> Iterator[OpId]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    @property
    def key(self) -> tuple[tuple[OpId, str], ...]:
        """The plan as a hashable value, sorted once: what caches of plans key on (a plan never
        changes once made)."""
        if self._key is None:
            self._key = tuple(sorted(self._map.items()))
        return self._key

    def __hash__(self) -> int:  # a plan never changes once made, so it may key a cache
        if self._hash is None:
            self._hash = hash(self.key)
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return self.key == other.key if isinstance(other, Plan) else Mapping.__eq__(self, other)

    def block(self, layer: int) -> tuple[tuple[str, str], ...]:
        """(op name, strategy) of `layer`'s ops the plan names, sorted: what one block's costs
        depend on, grouped once."""
        if self._blocks is None:
            grouped: dict[int, list[tuple[str, str]]] = {}
            for op, strategy in self.key:
                grouped.setdefault(op.layer, []).append((op.name, strategy))
            self._blocks = {i: tuple(entries) for i, entries in grouped.items()}
        return self._blocks.get(layer, ())

    def named(self) -> dict[str, str]:
        """{"layer.op": strategy}, sorted: the plan as telemetry writes it (a new dict each time)."""
        if self._named is None:
            self._named = tuple((str(op), s) for op, s in self.key)
        return dict(self._named)

    def strategy(self, op: OpId) -> str:
        return self._map.get(op, "keep")

    def __repr__(self) -> str:
        return f"Plan({{{', '.join(f'{op}: {s!r}' for op, s in sorted(self._map.items()))}}})"
