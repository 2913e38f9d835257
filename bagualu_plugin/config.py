"""The recipe: one YAML file that says which model runs on which hardware, how it is parallelised,
and what the adaptive activation-memory system may do about it.

Loading is strict (unknown keys, "8" for an int and duplicate YAML keys are errors) because a
silently ignored typo in a memory budget shows up hours later as an out-of-memory crash. Every
error names the file and the dotted field path, one line per problem.
"""

from __future__ import annotations

import os
import re
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .costmodel.dims import ModelDims, Parallel
from .hardware import HardwareSpec, preset
from .units import Bytes, fmt_bytes
from .validation import FIELD_PROBLEMS, reject

_Index = Annotated[int, Field(ge=0)]
TELEMETRY_FILE = "bagualu-telemetry.jsonl"  # a run's events, in its output directory (`Telemetry.file`)

# Pydantic names the member of a union that failed, as in budget.min_budget.literal['auto'] or
# spikes.layers.list[constrained-int].2; these tags are not fields the user wrote.
_UNION_TAG = re.compile(r"[a-z-]+\[.*\]|int|float|str|bool|none")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def check_pipeline(pp: int) -> None:
    """§V-B needs four distinct micro-batches at a steady point F_x B_y: x - y > 2. Arithmetic on
    pp alone, so it lives with the recipe, below everything that checks it (`pipeline.dual_batch`
    here, nanotron's `bagualu.dual_batch`)."""
    if pp <= 2:
        raise ValueError(
            f"dual-batch execution needs a pipeline of more than 2 stages (x - y > 2 at a steady scheduling point "
            f"F_x B_y, so that F, B, O and R belong to four micro-batches), got pp={pp}"
        )


class Pipeline(_Section):
    """This device's pipeline stage. The budget of each micro-batch depends on the 1F1B phase
    (§V-A): stage `rank` of `pp` runs pp - rank - 1 warmup forwards before its first backward.
    With vp > 1 (Megatron-LM's interleaved 1F1B, §VI-A) the rank holds vp model chunks and each
    forward runs one chunk of a micro-batch (`costmodel.pipeline.interleaved_one_f_one_b`); `Stage`
    budgets whole-rank micro-batches and refuses it. Table II's VP is layers per virtual stage,
    i.e. model.num_layers / (pp * vp) here."""

    pp: int = Field(default=1, ge=1)
    rank: int = Field(default=0, ge=0)
    micro_batches: int = Field(ge=1, description="micro-batches per iteration")
    schedule: Literal["1f1b"] = "1f1b"
    vp: int = Field(
        default=1,
        ge=1,
        description="model chunks (virtual stages) per rank, Megatron's virtual_pipeline_model_parallel_size; 1: plain 1F1B",
    )
    dual_batch: bool = Field(
        default=False,
        description="fused dual-batch execution in the steady phase (§V-B): each forward runs interleaved with the "
        "backward after it and the next micro-batch's recovery; needs pp > 2",
    )
    overlap_all_to_all: bool | None = Field(
        default=None,
        description="at a fused point, each all-to-all of the forward is waited on only after the backward or recovery "
        "piece the schedule put beside it has run (null, the default: on with dual_batch); false: at once. Needs dual_batch",
    )

    @model_validator(mode="after")
    def _rank_in_pipeline(self) -> Pipeline:
        problems = []
        if self.rank >= self.pp:
            problems.append(("rank", f"rank ({self.rank}) must be < pp ({self.pp})"))
        if self.vp > 1 and self.pp < 2:
            problems.append(("vp", f"vp ({self.vp}) interleaves model chunks over pipeline ranks: it needs pp >= 2, got {self.pp}"))
        elif self.vp > 1 and self.micro_batches % self.pp:
            msg = f"with vp ({self.vp}) > 1, micro_batches ({self.micro_batches}) must be a multiple of pp ({self.pp})"
            problems.append(("vp", f"{msg}: the interleaved schedule runs them in groups of pp"))
        if self.overlap_all_to_all is not None and not self.dual_batch:
            problems.append(("overlap_all_to_all", "applies to the fused points of dual_batch, which is off: set dual_batch: true"))
        if self.dual_batch:
            try:
                check_pipeline(self.pp)
            except ValueError as error:
                problems.append(("dual_batch", str(error)))
        reject(problems)
        return self


class Batch(_Section):
    """One micro-batch: `tokens` = seq_len * micro_batch_size is the T of the cost model (§IV)."""

    seq_len: int = Field(gt=0)
    micro_batch_size: int = Field(default=1, gt=0)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch_size


def _not_keep(name: object) -> object:
    if name == "keep":
        raise ValueError("'keep' is always allowed implicitly; list only recompute, offload or fp8")
    return name


_Mitigation = Annotated[Literal["recompute", "offload", "fp8"], BeforeValidator(_not_keep)]


class FP8Options(_Section):
    """Saved activations stored as FP8 with one scale per block: per-tensor scales gave ~5e-2
    gradient error in our measurements (docs/architecture.md)."""

    block_size: int = Field(default=128, ge=16)
    format: Literal["e4m3"] = "e4m3"

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, block_size: int) -> int:
        if block_size & (block_size - 1):
            raise ValueError(f"block_size ({block_size}) must be a power of two")
        return block_size


class OffloadOptions(_Section):
    """Tensors below `min_bytes` are never offloaded: a copy's fixed launch cost outweighs them."""

    min_bytes: Bytes = 2**20


class Strategies(_Section):
    """The per-operator mitigations the planner may choose from (§V-A, Algorithm 2)."""

    allowed: list[_Mitigation] = Field(default_factory=lambda: ["recompute", "offload", "fp8"])
    fp8: FP8Options = FP8Options()
    offload: OffloadOptions = OffloadOptions()
    loss_chunk_tokens: int | None = Field(
        default=None, gt=0, description="LM head + loss in chunks of this many tokens (no full logits); None: HF's loss"
    )

    @field_validator("allowed")
    @classmethod
    def _unique(cls, allowed: list[str]) -> list[str]:
        reject([(str(i), f"{a!r} is listed twice") for i, a in enumerate(allowed) if a in allowed[:i]])
        return allowed


class Budget(_Section):
    """Inputs of the pipeline-aware budget (§V-A, Algorithm 1): capacity M_max comes from the
    hardware, M_used starts at the non-activation bytes, and every micro-batch not yet launched is
    guaranteed at least M0 (`min_budget`, the activation memory under full recompute at the top of
    the normal routing band, `spikes.normal_max_imbalance`, which plans are made for)."""

    reserve_bytes: Bytes = Field(default=0, description="never given to activations (allocator, buffers)")
    min_budget: Literal["auto"] | Bytes = Field(default="auto", description="M0; auto: from the cost model")
    non_activation_bytes: Literal["auto"] | Bytes = Field(
        default="auto", description="weights, grads, optimizer state; auto: from the sizes below"
    )
    weight_bytes_per_param: float = Field(default=2.0, gt=0)
    grad_bytes_per_param: float = Field(default=4.0, ge=0)
    optimizer_bytes_per_param: float = Field(default=12.0, ge=0)
    shard_optimizer: bool = Field(default=True, description="optimizer state divided over dp ranks")
    shard_gradients: bool = Field(default=False, description="gradients divided over dp ranks too (ZeRO-2)")
    fsdp: bool = Field(
        default=False,
        description="full shard (FSDP2, ZeRO-3): weights, gradients and optimizer state divided over dp ranks, "
        "plus two decoder layers' weights gathered whole (one running, one prefetched)",
    )
    offload_optimizer: bool = Field(
        default=False, description="optimizer state and its gradients in host memory (ZeRO-Offload, FSDP2's CPU offload)"
    )
    offload_params: bool = Field(default=False, description="with fsdp: the weight shards in host memory too")
    engine_buffer_bytes: Bytes = Field(
        default=0,
        description="a sharding engine's own device buffers beside the shards (DeepSpeed ZeRO's gradient reduce buckets), "
        "added to the non-activation bytes",
    )


class Telemetry(_Section):
    """Where the per-micro-batch telemetry events go (`bagualu report` draws them). On by default:
    a run's picture should not need a switch turned on before it."""

    enabled: bool = Field(default=True, description="write the events; false: none")
    path: str | None = Field(
        default=None, description="JSON-lines file; None: bagualu-telemetry.jsonl in the run's output directory (the working directory)"
    )

    def file(self, rank: int = 0, world: int = 1) -> Path | None:
        """This rank's events file: the path, with `.rank<rank>` before its suffix where more than
        one process writes (each its own file, none clobbering another's lines)."""
        if not self.enabled:
            return None
        path = Path(self.path or TELEMETRY_FILE)
        return path.with_name(f"{path.stem}.rank{rank}{path.suffix}") if world > 1 else path


class Spikes(_Section):
    """Synthetic routing skew for simulation and demos. Imbalance is the busiest expert-parallel
    rank's routed (token, expert) pairs over the mean. §II-B measured 97.1% of iterations below
    1.2x and 2.9% spiking up to 2.6x; those are the defaults."""

    enabled: bool = False
    seed: int = Field(default=0, ge=0)
    normal_max_imbalance: float = Field(default=1.2, ge=1)
    spike_probability: float = Field(default=0.029, ge=0, le=1)
    spike_max_imbalance: float = Field(default=2.6, ge=1)
    layers: Literal["all"] | list[_Index] = Field(default="all", description="the MoE layers that may spike")
    micro_batches: list[_Index] | None = Field(default=None, description="None: any micro-batch")
    restart_iterations: float = Field(
        default=16, ge=0, description="an OOM's cost to a static baseline: a cold restart, in its mean iterations"
    )

    @model_validator(mode="after")
    def _spike_above_normal(self) -> Spikes:
        if self.spike_max_imbalance < self.normal_max_imbalance:
            msg = f"spike_max_imbalance ({self.spike_max_imbalance}) must be >= normal_max_imbalance"
            reject([("spike_max_imbalance", f"{msg} ({self.normal_max_imbalance})")])
        return self


class Recipe(_Section):
    """A validated recipe; build it with `load_recipe` or `Recipe.from_dict`."""

    hardware: HardwareSpec
    model: ModelDims
    parallel: Parallel = Parallel()
    pipeline: Pipeline
    batch: Batch
    strategies: Strategies = Strategies()
    budget: Budget = Budget()
    telemetry: Telemetry = Telemetry()
    spikes: Spikes = Spikes()

    @field_validator("hardware", mode="before")
    @classmethod
    def _resolve_preset(cls, value: Any) -> Any:
        """`h100`, or `{preset: h100, capacity_bytes: 40GiB}`: a preset with some fields replaced."""
        if isinstance(value, str):
            return preset(value)
        if isinstance(value, dict) and "preset" in value:
            overrides = dict(value)
            base = preset(str(overrides.pop("preset")))  # str(): a non-string gets the unknown-preset error
            return {**base.model_dump(), **overrides}
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        m, par, pipe, spikes = self.model, self.parallel, self.pipeline, self.spikes
        cap, group = self.hardware.capacity_bytes, par.dp * par.tp
        problems = []
        if self.budget.fsdp and par.ep != 1:
            problems.append(("budget.fsdp", f"FSDP shards the experts itself: parallel.ep must be 1, got {par.ep}"))
        if self.budget.offload_params and not self.budget.fsdp:
            problems.append(("budget.offload_params", "weight shards in host memory need budget.fsdp (full shard)"))
        if m.num_experts % par.ep:
            problems.append(("parallel.ep", f"ep ({par.ep}) must divide model.num_experts ({m.num_experts})"))
        if group % par.ep:
            msg = f"ep ({par.ep}) must divide dp*tp ({group}): the expert-parallel group lives inside dp x tp"
            problems.append(("parallel.ep", msg))
        if m.num_attention_heads % par.tp:
            msg = f"tp ({par.tp}) must divide model.num_attention_heads ({m.num_attention_heads})"
            problems.append(("parallel.tp", msg))
        if m.num_layers % pipe.pp:
            msg = f"pp ({pipe.pp}) must divide model.num_layers ({m.num_layers}): stages have equal layers"
            problems.append(("pipeline.pp", msg))
        elif m.num_layers % (pipe.pp * pipe.vp):
            msg = f"pp*vp ({pipe.pp * pipe.vp}) must divide model.num_layers ({m.num_layers}): virtual stages have equal layers"
            problems.append(("pipeline.vp", msg))
        for name in ("reserve_bytes", "min_budget", "non_activation_bytes"):
            value = getattr(self.budget, name)
            if value != "auto" and value >= cap:
                msg = f"{name} ({fmt_bytes(value)}) must be < hardware.capacity_bytes ({fmt_bytes(cap)})"
                problems.append((f"budget.{name}", msg))
        if spikes.layers != "all":
            moe = m.moe_layers
            problems += [
                (f"spikes.layers.{i}", f"layer {layer} is not an MoE layer (MoE layers: {moe[0]}..{moe[-1]})")
                for i, layer in enumerate(spikes.layers)
                if layer not in moe
            ]
        n = pipe.micro_batches
        problems += [
            (f"spikes.micro_batches.{i}", f"micro-batch {mb} must be < pipeline.micro_batches ({n})")
            for i, mb in enumerate(spikes.micro_batches or [])
            if mb >= n
        ]
        reject(problems)
        return self

    @property
    def gpus(self) -> int:
        return self.parallel.dp * self.parallel.tp * self.pipeline.pp

    def with_output_dir(self, directory: str | os.PathLike[str]) -> Recipe:
        """This recipe with its telemetry in the run's output `directory`, unless it names a file."""
        if self.telemetry.path is not None:
            return self
        telemetry = self.telemetry.model_copy(update={"path": str(Path(directory) / TELEMETRY_FILE)})
        return self.model_copy(update={"telemetry": telemetry})

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> Recipe:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise RecipeError(source, _problems(exc)) from None


class RecipeError(ValueError):
    """Everything wrong with one recipe, one line per problem: `recipe <source>: <path>: <message>`."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        super().__init__(source, problems)
        self.source, self.problems = source, problems

    def __str__(self) -> str:
        return "\n".join(f"recipe {self.source}: " + (f"{p}: {m}" if p else m) for p, m in self.problems)


def _keys_at(path: list[str]) -> list[str]:
    """The field names of the section at `path`, for an unknown key's message."""
    section: type[BaseModel] = Recipe
    for name in path:
        annotation = section.model_fields[name].annotation
        candidates = (annotation, *get_args(annotation))  # MLADims | None: look inside the union
        section = next(t for t in candidates if isinstance(t, type) and issubclass(t, BaseModel))
    return list(section.model_fields)


def _is_union_tag(part: str | int) -> bool:
    return isinstance(part, str) and _UNION_TAG.fullmatch(part) is not None


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    errors = exc.errors(include_url=False)
    # A union member that failed inside the value (spikes.layers.2) matched the input's shape: it
    # is the member the user meant, so the other members' "should be 'all'" is noise.
    matched = {err["loc"][:i] for err in errors for i, p in enumerate(err["loc"][:-1]) if _is_union_tag(p)}
    problems = []
    for err in errors:
        if err["loc"] and _is_union_tag(err["loc"][-1]) and err["loc"][:-1] in matched:
            continue
        loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
        if err["type"] == FIELD_PROBLEMS:
            problems += [(".".join([*loc, path]), msg) for path, msg in err["ctx"]["problems"]]
            continue
        if err["type"] == "value_error":
            msg = str(err["ctx"]["error"])
        elif err["type"] == "extra_forbidden":
            msg = f"unknown key; expected one of: {', '.join(_keys_at(loc[:-1]))}"
        elif err["type"] == "missing":
            msg = "required, but missing"
        else:
            msg = f"{err['msg']}, got {err['input']!r}"
        problems.append((".".join(loc), msg))
    return problems


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load semantics, except that a key given twice is an error: PyYAML would silently
    keep the last one."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_unique(node, [], set())
        return super().construct_document(node)

    def _check_unique(self, node: yaml.Node, path: list[str], seen: set[int]) -> None:
        if id(node) in seen:  # an alias: checked where its anchor was defined
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_unique(item, [*path, str(i)], seen)
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[str, int] = {}
            for key, value in node.value:
                name, line = str(key.value), key.start_mark.line + 1
                if name in first_line:
                    msg = f"duplicate key at line {line} (first at line {first_line[name]})"
                    raise RecipeError(self.name, [(".".join([*path, name]), msg)])
                first_line[name] = line
                self._check_unique(value, [*path, name], seen)


def builtin_recipes() -> dict[str, Path]:
    """Recipes shipped in the package: family recipes and the paper's cluster presets (Table II)."""
    root = Path(str(files("bagualu_plugin") / "recipes" / "bagualu"))
    return {p.stem: p for p in [*sorted(root.glob("*.yaml")), *sorted(root.glob("cluster/*.yaml"))]}


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate a recipe file, or a built-in recipe by name (`glm-423b-a30b`)."""
    source, data = read_recipe(path)
    return Recipe.from_dict(data, source)


def read_recipe(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """The sections of a recipe file (or of a built-in recipe by name) as written, not yet
    validated, with the file's name for errors: what `load_recipe` validates as a whole and
    `derive_recipe` as a partial recipe."""
    builtin = builtin_recipes()
    file = Path(path)
    if not file.is_file() and str(path) in builtin:
        file = builtin[str(path)]
    source = str(file)
    try:
        with file.open("rb") as stream:
            loader = _UniqueKeyLoader(stream)
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
    except OSError as exc:
        msg = f"cannot read it ({exc.strerror}); built-in recipes: {', '.join(builtin)}"
        raise RecipeError(source, [("", msg)]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        msg = f"invalid YAML: {where}{getattr(exc, 'problem', None) or exc}"
        raise RecipeError(source, [("", msg)]) from None
    expected = "a mapping of sections (model, hardware, ...)"
    if data is None:
        raise RecipeError(source, [("", f"the file is empty; expected {expected}")])
    if not isinstance(data, dict):
        raise RecipeError(source, [("", f"the top level must be {expected}, got a {type(data).__name__}")])
    return source, data
