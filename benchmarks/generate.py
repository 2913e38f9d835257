"""Generation with the plugin installed against the same model without it: after fine-tuning with
`bgl.apply`, outside a training micro-batch the model runs as its own (KV cache, transformers'
experts kernel choice), so greedy decoding gives the same tokens at the same speed. Both are
timed in one run, alternating, on a model fine-tuned for one planned micro-batch (recompute).

    python benchmarks/generate.py   (about 1 min on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import bagualu_plugin as bgl
from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.config import Recipe
from bagualu_plugin.costmodel import ModelDims
from bagualu_plugin.report import table

SEQ, MBS = 64, 2


def _recipe(model, capacity: float) -> Recipe:
    """A capacity of `capacity` x what one micro-batch keeps unmitigated: the plugin has to plan."""
    keep = model_cost(model).activation_bytes(MBS * SEQ, seq_len=SEQ)
    return Recipe.from_dict({
        "hardware": {"preset": "cpu", "capacity_bytes": int(capacity * keep)},
        "model": ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa").model_dump(exclude_defaults=True),
        "pipeline": {"pp": 1, "micro_batches": 1},
        "batch": {"seq_len": SEQ, "micro_batch_size": MBS},
        "budget": {"non_activation_bytes": 0},
        "strategies": {"allowed": ["recompute"]},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_hidden_layers=4, hidden_size=128, intermediate_size=256, moe_intermediate_size=64)
    prompt = torch.randint(0, model.config.vocab_size, (1, 16))

    def generate() -> tuple[torch.Tensor, float]:
        with torch.no_grad():
            start = time.perf_counter()
            out = model.eval().generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            seconds = time.perf_counter() - start
        model.train()
        return out, seconds

    ids = torch.randint(0, model.config.vocab_size, (MBS, SEQ))
    prov = bgl.apply(model, _recipe(model, capacity=0.6))
    with prov.micro_batch(ids):
        model(input_ids=ids, labels=ids).loss.backward()
    plan = prov.events[-1].plan
    times: dict[bool, list[float]] = {True: [], False: []}
    outputs = {}
    generate()  # warm-up
    for _ in range(args.repeats):
        for installed in (True, False):
            if not installed:
                prov.remove()
            outputs[installed], seconds = generate()
            times[installed].append(seconds)
            if not installed:
                prov = bgl.apply(model, _recipe(model, capacity=0.6))
    prov.remove()
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"greedy decoding of {args.new_tokens} tokens, median of {args.repeats}; the plan of the fine-tuning "
          f"micro-batch recomputes {sum(s == 'recompute' for s in plan.values())} ops")
    print(table(
        ["model", "tokens/s", "vs without", "same tokens"],
        [["plugin installed", f"{args.new_tokens / median[True]:,.0f}", f"{median[False] / median[True]:.2f}x",
          str(torch.equal(outputs[True], outputs[False]))],
         ["without the plugin", f"{args.new_tokens / median[False]:,.0f}", "1.00x", "-"]],
    ))


if __name__ == "__main__":
    main()
