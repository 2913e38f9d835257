"""`Plan`: a mitigation strategy per operator (paper §V-A), the value the planner produces, the
cost model prices and the runtime installs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from .graph import OpId
from .mitigation import STRATEGIES

Block = tuple[tuple[str, str], ...]  # one layer's (op name, strategy), sorted by name


class Plan(Mapping[OpId, str]):
    """{OpId: "keep" | "recompute" | "offload" | "fp8"}; ops not named are kept. Keys may be
    written as "layer.op" strings ("3.expert_fc1")."""

    def __init__(self, strategies: Mapping[OpId | str, str] | None = None):
        self._map: dict[OpId, str] | None = {}
        self._key: tuple[tuple[int, Block], ...] | None = None
        self._blocks: dict[int, Block] | None = None
        self._hash: int | None = None
        self._named: tuple[tuple[str, str], ...] | None = None
        self._stores: bool | None = None
        for key, strategy in (strategies or {}).items():
            op = key if isinstance(key, OpId) else OpId.parse(key)
            if strategy not in STRATEGIES:
                raise ValueError(f"plan: op {op} has strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
            self._map[op] = strategy

    @classmethod
    def uniform(cls, ops: Iterable[OpId], strategy: str) -> Plan:
        return cls(dict.fromkeys(ops, strategy))

    def _mapping(self) -> dict[OpId, str]:
        if self._map is None:  # made from blocks (`with_block`): the flat map only when asked for
            self._map = {OpId(layer, name): s for layer, block in self._blocks.items() for name, s in block}
        return self._map

    def __getitem__(self, op: OpId) -> str:
        return self._mapping()[op]

    def __iter__(self) -> Iterator[OpId]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())

    def with_block(self, layer: int, strategies: Mapping[str, str]) -> Plan:
        """This plan with `layer`'s ops in `strategies` ({op name: strategy}) set so: a gate's
        escalation. It is made from this plan's blocks, replacing one, so making it costs the
        number of layers, not of ops, and no cache of whole plans is needed to make it cheap (the
        escalated layers' combinations keep coming new over a long run)."""
        bad = {s for s in strategies.values() if s not in STRATEGIES}
        if bad:
            raise ValueError(f"plan: strategies {sorted(bad)} at layer {layer}; expected one of {', '.join(STRATEGIES)}")
        blocks = self.blocks()
        block = tuple(sorted({**dict(blocks.get(layer, ())), **strategies}.items()))
        return Plan.of_blocks({**blocks, layer: block} if layer in blocks else dict(sorted({**blocks, layer: block}.items())))

    @classmethod
    def of_blocks(cls, blocks: dict[int, Block]) -> Plan:
        """The plan whose `blocks()` these are (sorted by layer, each block sorted, strategies
        valid: a planner's own), made without going through every op."""
        plan = cls()
        plan._map, plan._blocks = None, blocks
        return plan

    def blocks(self) -> dict[int, Block]:
        """{layer: its ops' (op name, strategy), sorted}, sorted by layer: what one block's costs
        and regions depend on, grouped once (a plan never changes once made)."""
        if self._blocks is None:
            grouped: dict[int, list[tuple[str, str]]] = {}
            for op, strategy in self._map.items():
                grouped.setdefault(op.layer, []).append((op.name, strategy))
            self._blocks = {layer: tuple(sorted(grouped[layer])) for layer in sorted(grouped)}
        return self._blocks

    def block(self, layer: int) -> Block:
        """`layer`'s (op name, strategy), sorted; () where the plan names none of its ops."""
        return self.blocks().get(layer, ())

    @property
    def key(self) -> tuple[tuple[int, Block], ...]:
        """The plan as a hashable value, its blocks in order: what caches of plans key on."""
        if self._key is None:
            self._key = tuple(self.blocks().items())
        return self._key

    def __hash__(self) -> int:  # a plan never changes once made, so it may key a cache
        if self._hash is None:
            self._hash = hash(self.key)
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return self.key == other.key if isinstance(other, Plan) else Mapping.__eq__(self, other)

    def named(self) -> dict[str, str]:
        """{"layer.op": strategy}, sorted: the plan as telemetry writes it (a new dict each time)."""
        if self._named is None:
            self._named = tuple((f"{layer}.{name}", s) for layer, block in self.key for name, s in block)
        return dict(self._named)

    @property
    def stores(self) -> bool:
        """Whether an op is offloaded or kept in FP8: a plan that only keeps and recomputes needs
        its saves counted, not stored in another form."""
        if self._stores is None:
            self._stores = any(s in ("offload", "fp8") for block in self.blocks().values() for _, s in block)
        return self._stores

    def strategy(self, op: OpId) -> str:
        return self._mapping().get(op, "keep")

    def __repr__(self) -> str:
        return f"Plan({{{', '.join(f'{op}: {s!r}' for op, s in sorted(self._mapping().items()))}}})"
