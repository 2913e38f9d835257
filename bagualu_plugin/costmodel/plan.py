"""`Plan`: a mitigation strategy per operator (paper §V-A), the value the planner produces, the
cost model prices and the runtime installs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from .graph import OpId
from .mitigation import STRATEGIES


class Plan(Mapping[OpId, str]):
    """{OpId: "keep" | "recompute" | "offload" | "fp8"}; ops not named are kept. Keys may be
    written as "layer.op" strings ("3.expert_fc1")."""

    def __init__(self, strategies: Mapping[OpId | str, str] | None = None):
        self._map: dict[OpId, str] = {}
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

    def strategy(self, op: OpId) -> str:
        return self._map.get(op, "keep")

    def __repr__(self) -> str:
        return f"Plan({{{', '.join(f'{op}: {s!r}' for op, s in sorted(self._map.items()))}}})"
