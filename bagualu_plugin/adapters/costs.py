"""The analytic cost model of a supported HF model, and the §V-A conflicts of a plan on it: the
model's config, dtype, attention kernel and PEFT LoRA adapters read off the model (its graphs
name the same tensors the model saves; benchmarks/costmodel_accuracy.py checks it)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..costmodel import CostModel, ForwardKind, ModelDims, Parallel
from ..costmodel.conflicts import Conflict, conflicts
from ..costmodel.dims import LoraDims, lora_shapes
from ..costmodel.plan import Plan
from ..hardware import HardwareSpec
from .adapter import Adapter

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def model_dims(model: nn.Module) -> ModelDims:
    """The dimensions of a supported HF model as the analytic cost model needs them (a recipe's
    `model:` section): its config, in the dtype and attention kernel it runs, with the PEFT LoRA
    adapters injected into it (`get_peft_model`, `inject_adapter_in_model`) as `lora`, and whether
    `F.linear` is DeepSpeed ZeRO-3's now (`zero3_linear`: its linears run through it), and the
    routers' weights' dtype where it is not the family's (`router_dtype`). The
    dimensions of the checkpoint, not of the machine: `device` is left to `model_cost`."""
    adapter = Adapter(model)
    weight = adapter.weight
    dims = ModelDims.from_hf_config(adapter.config, dtype=DTYPES[weight.dtype], attention=_attention_kernel(adapter, weight))
    lora = _lora(adapter, dims)
    zero3 = getattr(torch.nn.functional.linear, "__module__", None) == "deepspeed.runtime.zero.linear"
    router = next(layer.router for layer in adapter.layers if layer.moe)
    stored = DTYPES[getattr(router, "get_base_layer", lambda: router)().weight.dtype]
    family = "fp32" if dims.traits.router_fp32 else dims.dtype
    router_dtype = None if stored == family else stored
    if lora is None and not zero3 and router_dtype is None:
        return dims
    return ModelDims.model_validate({**dict(dims), "lora": lora, "zero3_linear": zero3, "router_dtype": router_dtype})


def model_cost(model: nn.Module, hardware: HardwareSpec | str = "cpu", kind: ForwardKind = ForwardKind()) -> CostModel:
    """The analytic cost model of a supported HF model (`model_dims`) on `hardware` (a preset
    name or a spec, e.g. a recipe's `hardware`), on this rank of its expert-parallel group
    (`bgl.expert_parallel`) if it has one, of the forwards of `kind` (`costmodel.ForwardKind`):
    attention given a padding or packing mask, which SDPA keeps; TRL's fused head; a loss that
    divides by a token count tensor (the Trainer's `num_items_in_batch`); the routers'
    load-balancing loss (`ModelDims.router_aux_loss`); autocast to "bf16" or "fp16"
    (`ModelDims.autocast`); no loss computed (no labels: the caller's loss runs on the logits)."""
    adapter = Adapter(model)
    group = adapter.expert_group
    parallel = Parallel(ep=group.size, ep_rank=group.rank, all_to_all=True) if group else Parallel()
    dims = model_dims(model)
    if adapter.weight.device.type == "cpu":  # else CUDA's (the meta device's too)
        dims = dims.model_copy(update={"device": "cpu"})
    if kind.masked and dims.attention == "sdpa":
        dims = dims.model_copy(update={"attention": "sdpa_masked"})
    if kind.fused_head or not kind.loss:
        dims = dims.model_copy(update={"lm_head": "trl_fused" if kind.fused_head else "hf_logits"})
    dims = ModelDims.model_validate(
        {**dict(dims), "loss_divisor_bytes": kind.loss_divisor_bytes, "router_aux_loss": kind.router_aux_loss, "autocast": kind.autocast}
    )
    return CostModel.from_config(dims, hardware, parallel)


def _lora(adapter: Adapter, dims: ModelDims) -> LoraDims | None:
    """The LoRA adapters PEFT put in the decoder layers (its `lora.Linear`s and, for the fused
    expert weights, `ParamWrapper`s), read off the layers; None without any. What `LoraDims`
    cannot describe, and so the cost model would predict wrongly, is an error naming it."""
    if not any(map(_is_lora, adapter.model.modules())):
        return None
    where = {}  # LoRA layer -> (decoder layer, target: its name there)
    for layer in adapter.layers:
        for name, module in layer.module.named_modules():
            if _is_lora(module):  # nested ParamWrappers hold the experts as base_layer.base_layer...
                target = name.replace(".base_layer", "")
                where[module] = (layer.index, f"{target}.{module.parameter_name}" if hasattr(module, "parameter_name") else target)
    outside = [name for name, module in adapter.model.named_modules() if _is_lora(module) and module not in where]
    if outside:
        raise ValueError(f"LoRA adapters outside the decoder layers ({', '.join(outside)}) are not modelled; leave them out")
    ranks, dropouts, dtypes, targets, params = {}, set(), set(), {}, set()
    for module, (index, target) in where.items():
        names = [a for a in module.active_adapters if a in module.lora_A]
        unsupported = module.merged or module.disable_adapters or len(names) != 1
        if not unsupported:
            (name,) = names
            unsupported = module.use_dora[name] or module.lora_bias[name] or name in module.lora_variant
        if unsupported:
            raise ValueError(
                f"layer {index} {target}: the cost model describes one active, unmerged plain LoRA adapter per layer "
                f"(no DoRA, LoRA bias or other variant); it has {names or 'none active'}"
            )
        ranks.setdefault(target, set()).add(module.r[name])
        dropouts.add(getattr(module.lora_dropout[name], "p", 0.0))
        dtypes.add(DTYPES[module.lora_A[name].weight.dtype])
        targets.setdefault(index, set()).add(target)
        params |= {id(p) for p in (*module.lora_A[name].parameters(), *module.lora_B[name].parameters())}
    uneven_ranks = sorted(t for t, found in ranks.items() if len(found) > 1)
    extra = [name for name, p in adapter.model.named_parameters() if p.requires_grad and id(p) not in params]
    frozen = [name for name, p in adapter.model.named_parameters() if id(p) in params and not p.requires_grad]
    union = set().union(*targets.values())
    known = set(lora_shapes(dims))  # (unknown targets are the validator's to name)
    expected = {layer.index: union & set(lora_shapes(dims, moe=layer.moe)) for layer in adapter.layers}  # those it has
    uneven = [i for i, found in targets.items() if found & known != expected[i]]
    problems = [
        (uneven_ranks, f"lora.ranks: {uneven_ranks} have different ranks in different layers; the cost model takes one each"),
        (len(dropouts) > 1, f"lora.dropout: the adapters have dropouts {sorted(dropouts)}; the cost model takes one"),
        (len(dtypes) > 1, f"lora.dtype: the adapters' weights are {sorted(dtypes)}; the cost model takes one"),
        (uneven, f"lora.targets: layers {uneven} adapt only some of {sorted(union)}; the cost model takes one set for all"),
        (extra, f"parameters outside the adapters train ({', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''}), "
                "which LoRA's cost model keeps frozen: freeze them (modules_to_save is not modelled)"),
        (frozen, f"adapter parameters are frozen ({', '.join(frozen[:4])}): the cost model trains every adapter"),
    ]
    bad = [message for found, message in problems if found]
    if bad:
        raise ValueError("; ".join(bad))
    rank_of = {t: found.pop() for t, found in ranks.items()}
    rank = max(rank_of.values(), key=list(rank_of.values()).count)  # the most common; the others as exceptions
    return LoraDims(
        rank=rank,
        ranks={t: r for t, r in sorted(rank_of.items()) if r != rank},
        dropout=dropouts.pop(),
        targets=sorted(union),
        layers=None if all(i in targets for i, found in expected.items() if found) else sorted(targets),
        dtype=dtypes.pop(),
    )


def _is_lora(module: nn.Module) -> bool:
    """A PEFT LoRA layer (duck-typed: PEFT is optional)."""
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def _attention_kernel(adapter: Adapter, weight: torch.Tensor) -> str:
    """The attention the model really runs, as the cost model names it. On CUDA, torch dispatches
    FP32 SDPA with grouped-query attention (transformers passes `enable_gqa`) to its math kernel,
    not a fused one (flash and cuDNN take half precision only): it keeps the (L x L) probabilities,
    a scaled q and the repeated k and v, the bytes eager attention keeps (seen on an H200 with
    torch 2.11; benchmarks/gpu_check.py checks it)."""
    config, kind = adapter.config, adapter.config._attn_implementation
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kind == "sdpa" and weight.is_cuda and weight.dtype == torch.float32 and kv_heads != heads:
        return "eager"
    return kind


def find_conflicts(plan: Mapping, model: nn.Module | CostModel) -> list[Conflict]:
    """`bgl.find_conflicts`: the §V-A conflicts of `plan` on a supported HF model (its analytic
    cost model names the same tensors the model saves) or on a cost model."""
    return conflicts(plan if isinstance(plan, Plan) else Plan(plan), model if isinstance(model, CostModel) else model_cost(model))
