"""Exactness of per-operator mitigation on real (tiny) HF MoE models (paper §IV-B, §V-A).

For every family and dtype, each op is offloaded, quantised (FP8 e4m3, blockwise scales of 128)
and recomputed on its own (attention's ops, Qwen2-MoE's shared expert and the LM head's loss
through their spans), each recompute unit (the LM head with the loss among them) is recomputed,
then every op at once, against the unmitigated run of the same micro-batch (2 x 48 tokens).
Offload and recompute must give bitwise-equal loss and gradients; FP8 and int8 storage change
only what backward reads, so the loss stays bitwise and the gradient error (relative L2 norm over
all parameters) is reported. Everything recomputed keeps the reported share of everything kept.
The chunked loss (`loss_chunk_tokens=40`) runs kept and everything recomputed; its largest
relative loss and gradient differences to HF's loss are reported. The saved bytes the Ledger
counts are compared with the analytic cost model's prediction for every plan.

    python benchmarks/mitigation_exactness.py   (about 30 s on 2 cores)
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

import bagualu_plugin as bgl
from bagualu_plugin.adapters import FAMILIES, Adapter, tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.adapters.units import block_spans, block_units
from bagualu_plugin.costmodel import OpId
from bagualu_plugin.costmodel.mitigation import MitigationOptions
from bagualu_plugin.report import table
from bagualu_plugin.runtime.plan_runtime import apply_plan

IDS = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
LABELS = IDS.clone()  # their own storage, as data collators make them
CHUNKED = MitigationOptions(loss_chunk_tokens=40)


def run(model, plan, options=MitigationOptions()):
    model.zero_grad(set_to_none=True)
    with apply_plan(model, plan, options=options) as ledger:
        loss = model(input_ids=IDS, labels=LABELS).loss
        saved = ledger.live_device_bytes
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], saved


def relative_error(grads, reference) -> float:
    num = sum(((g - r).float().norm() ** 2).item() for g, r in zip(grads, reference))
    return (num / sum((r.float().norm() ** 2).item() for r in reference)) ** 0.5


def row(family: str, dtype: torch.dtype) -> list:
    model = tiny_model(family, dtype=dtype)
    cm = model_cost(model)
    loss0, grads0, keep = run(model, {})
    adapter = Adapter(model)
    blocks = [-1, *(layer.index for layer in adapter.layers), adapter.head_index]
    units = [tuple(OpId(b, n) for n in u) for b in blocks for u in block_units(adapter, b)]
    units += [(OpId(b, n),) for b in blocks for span in block_spans(adapter, b) for n in span]
    units = list(dict.fromkeys(units))
    ops = bgl.list_ops(model)
    plans = [{op: s} for op in ops for s in ("offload", "fp8")] + [dict.fromkeys(u, "recompute") for u in units]
    plans += [dict.fromkeys(ops, "offload"), dict.fromkeys(ops, "fp8"), cm.full_recompute()]
    exact, worst_fp8, predicted, everything = True, 0.0, 0, 0
    for plan in plans:
        loss, grads, saved = run(model, plan)
        predicted += saved == cm.activation_bytes(96, seq_len=48, plan=plan)
        everything = saved if plan == cm.full_recompute() else everything
        quantised = "fp8" in plan.values()
        if quantised and len(plan) == 1:
            worst_fp8 = max(worst_fp8, relative_error(grads, grads0))
        elif not quantised:
            exact &= torch.equal(loss, loss0) and all(torch.equal(g, r) for g, r in zip(grads, grads0))
    _, grads_fp8, _ = run(model, dict.fromkeys(ops, "fp8"))
    _, grads_int8, _ = run(model, dict.fromkeys(ops, "fp8"), MitigationOptions(quant_format="int8"))
    loss_diff = grad_diff = 0.0
    for plan in ({}, cm.full_recompute()):
        loss, grads, saved = run(model, plan, CHUNKED)
        predicted += saved == cm.activation_bytes(96, seq_len=48, plan=plan, options=CHUNKED)
        loss_diff = max(loss_diff, ((loss - loss0).abs() / loss0).item())
        grad_diff = max(grad_diff, relative_error(grads, grads0))
    return [
        family,
        str(dtype).removeprefix("torch."),
        len(plans) + 2,
        "bitwise" if exact else "DIFFERS",
        f"{everything / keep:.1%}",
        f"{worst_fp8:.2%}",
        f"{relative_error(grads_fp8, grads0):.2%}",
        f"{relative_error(grads_int8, grads0):.2%}",
        f"{loss_diff:.1e} / {grad_diff:.1e}",
        f"{predicted}/{len(plans) + 2}",
    ]


def main() -> int:
    combos = [(f, d) for f in FAMILIES for d in (torch.float32, torch.bfloat16)]
    rows = [row(f, d) for f, d in tqdm(combos, desc="families x dtypes")]
    headers = [
        "family", "dtype", "plans", "offload+recompute", "recompute all / keep", "fp8 one op (worst)", "fp8 all ops",
        "int8 all ops", "chunked loss: loss / grads", "bytes == model",
    ]
    print(table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
