"""Profile a (tiny) HF MoE model, pick per-operator mitigations with the cost model, check them.

A user's first session with the plugin: list the operators, measure what each keeps for backward,
ask the cost model what each strategy would save and cost, install the chosen plan with
`bgl.apply_plan`, and see the Ledger agree with the prediction. Runs offline on CPU in seconds:

    python examples/profile_and_mitigate.py [--family qwen3_moe]
"""

from __future__ import annotations

import argparse

import torch

import bagualu_plugin as bgl
from bagualu_plugin.adapters import FAMILIES, tiny_model
from bagualu_plugin.costmodel import Forward
from bagualu_plugin.report import table
from bagualu_plugin.units import fmt_bytes, fmt_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    args = p.parse_args()

    model = tiny_model(args.family)
    batch, seq_len = 4, 64
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    tokens = batch * seq_len

    cm = bgl.profile(model, [64, 128, 256])
    print(f"{args.family}: {len(bgl.list_ops(model))} operators; at {batch}x{seq_len} tokens it keeps "
          f"{fmt_bytes(cm.activation_bytes(tokens, seq_len=seq_len))} for backward\n")

    # What each strategy would do for the MoE layer's operators, as the planner sees it.
    layer = cm.moe_layers[0]
    rows = []
    for cost in cm.op_costs(Forward(tokens, seq_len)):
        if cost.op.layer != layer:
            continue
        cells = [str(cost.op), fmt_bytes(cost.saved_bytes)]
        for strategy in ("recompute", "offload", "fp8"):
            ops = cm.recompute_unit(cost.op) if strategy == "recompute" else cost.op
            if not ops:
                cells.append("n/a")
                continue
            m = cm.mitigation_cost(ops, strategy, Forward(tokens, seq_len))
            cells.append(f"{fmt_bytes(m.bytes_saved)} / {fmt_seconds(m.forward_s + m.backward_s)}")
        rows.append(cells)
    print(table(["op", "keeps", "recompute", "offload", "fp8"], rows), "\n")

    # Recompute the experts' activation and keep their up-projection output in FP8.
    plan = bgl.Plan({bgl.OpId(layer, "expert_act"): "recompute", bgl.OpId(layer, "expert_fc1"): "fp8"})
    conflicts = bgl.find_conflicts(plan, model)
    predicted = cm.activation_bytes(tokens, seq_len=seq_len, plan=plan)
    with bgl.apply_plan(model, plan) as ledger:
        loss = model(input_ids=ids, labels=ids).loss
        measured = ledger.live_device_bytes
    loss.backward()
    print(f"plan {plan}: conflicts {[str(c) for c in conflicts] or 'none'}")
    print(f"predicted {fmt_bytes(predicted)}, measured by the Ledger {fmt_bytes(measured)}")


if __name__ == "__main__":
    main()
