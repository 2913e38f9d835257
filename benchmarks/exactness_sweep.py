"""Randomised sweep of what users' trainers do, against the plugin's promise: every case trains
with its peak at or under the capacity and no out-of-memory error, or is refused before training
with the bytes; and every micro-batch keeps what its kind's cost model predicts for its plan
(`Event.misses` empty; `runtime.calibration` reports any other difference) and none moves
activations to host memory to stay under the capacity (`Event.spilled_bytes` 0: the last resort of
a plan made for less than its forward keeps, which an exact plan never needs).

A case draws a family, a trainer (TRL's SFTTrainer, HF's Trainer with its language-modelling
collator, or a plain loop with `bgl.apply`), PEFT LoRA or not, the per-device batch, the longest
text (texts of uneven length: padded batches and unpadded ones), gradient accumulation, the
strategies, a capacity between the floor (full recompute) and the unplanned micro-batch, and the
precision (`PRECISIONS`): FP32 throughout; a BF16 checkpoint under autocast to BF16; or standard
mixed precision, FP32 weights under autocast to BF16 (SFTTrainer at its defaults, HF's Trainer with
`bf16=True`, the loop's `torch.autocast`) or to FP16 (the loop's: accelerate runs no FP16 autocast
on a CPU). SFTTrainer's cases may pack the texts (`packing=True`: padding-free rows, the varlen
arguments through the layers).
Tiny random-init checkpoints, saved and loaded offline, on the CPU; the capacity is simulated.

    python benchmarks/exactness_sweep.py --cases 500 --seed 7    # a table of outcomes; exit 1 on a failure

tests/test_exactness_sweep.py runs 50 cases of a fixed seed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import io
import logging
import os
import random
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

FAMILIES = ("deepseek_v3", "glm4_moe", "gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe")
LORA = {"deepseek_v3": ["q_b_proj", "kv_b_proj"]}  # others: q_proj, v_proj
# precision: (the weights' dtype, the autocast's dtype or None)
PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, torch.bfloat16), "mixed-bf16": (torch.float32, torch.bfloat16),
              "mixed-fp16": (torch.float32, torch.float16)}
STRATEGIES = (["recompute"], ["recompute", "offload"], ["recompute", "offload", "fp8"], ["offload"], ["offload", "fp8"])
WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens across ranks".split()


@dataclass(frozen=True)
class Case:
    family: str
    trainer: str  # sft, hf, loop
    lora: bool
    batch: int
    length: int  # the longest text, in tokens (SFT's max_length; truncation elsewhere)
    accumulation: int
    strategies: tuple[str, ...]
    share: float  # capacity: floor + share * (unplanned - floor), of the model as loaded (before LoRA)
    seed: int
    precision: str = "fp32"  # a key of PRECISIONS
    packing: bool = False  # SFTTrainer only: TRL's padding-free packing of the texts into rows
    fraction: float | None = None  # capacity: this fraction of the unplanned micro-batch of the model that trains instead


@dataclass
class Outcome:
    case: Case
    result: str  # fits, refused, out_of_memory, spilled, misses, error
    detail: str = ""
    micro_batches: int = 0
    mitigated: int = 0  # micro-batches whose plan mitigated something
    peak: int = 0
    capacity: int = 0
    digest: str = ""  # the trained weights' bytes (sha256), to compare runs bitwise


def draw(seed: int, count: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        case = Case(
            rng.choice(FAMILIES), rng.choice(("sft", "hf", "loop")), rng.random() < 0.3, rng.randint(1, 4), rng.randint(8, 40),
            rng.randint(1, 3), tuple(rng.choice(STRATEGIES)), round(rng.uniform(0.15, 1.0), 3), rng.randrange(2**16),
            rng.choice(tuple(PRECISIONS)),
        )
        if case.precision == "mixed-fp16":
            case = replace(case, trainer="loop")
        cases.append(replace(case, packing=case.trainer == "sft" and rng.random() < 0.4))
    return cases


def _texts(rng: random.Random, count: int = 24) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60))) for _ in range(count)]


def run(case: Case, root: Path, plugin: bool = True) -> Outcome:
    """Train one case for two optimizer steps; its outcome (`plugin=False`: the same training
    without the plugin, for its digest)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    import bagualu_plugin as bgl
    from bagualu_plugin.adapters.costs import model_cost
    from bagualu_plugin.adapters.tiny import save_tiny, tiny_tokenizer
    from bagualu_plugin.costmodel import ForwardKind
    from bagualu_plugin.integrations.transformers import BagualuCallback
    from bagualu_plugin.runtime import SimulatedOutOfMemoryError

    checkpoint = root / case.family
    if not checkpoint.exists():
        save_tiny(case.family, checkpoint, num_hidden_layers=3)
    torch.manual_seed(case.seed)
    rng = random.Random(case.seed)
    weights, autocast = PRECISIONS[case.precision]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True, dtype=weights)
    peft = None
    if case.lora:
        from peft import LoraConfig, get_peft_model

        peft = LoraConfig(r=4, lora_alpha=8, target_modules=LORA.get(case.family, ["q_proj", "v_proj"]))
    # `fraction` is of the model that trains, LoRA included; `share` of the model as loaded
    priced = model if peft is None or case.fraction is None else get_peft_model(copy.deepcopy(model), peft)
    cm = model_cost(priced, kind=ForwardKind(autocast={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(autocast)))
    tokens = case.batch * case.length
    unplanned = cm.activation_bytes(tokens, seq_len=case.length)
    floor = cm.activation_bytes(tokens, seq_len=case.length, plan=cm.full_recompute())
    capacity = int(case.fraction * unplanned if case.fraction is not None else floor + case.share * (unplanned - floor))
    partial = {"hardware": {"capacity_bytes": capacity}, "budget": {"non_activation_bytes": 0},
               "strategies": {"allowed": list(case.strategies)}}
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    dataset = Dataset.from_dict({"text": _texts(rng)})
    prov = None
    try:
        if case.trainer == "loop":
            if peft is not None:
                model = get_peft_model(model, peft)
            if plugin:
                prov = bgl.apply(model, {**partial, "pipeline": {"micro_batches": case.accumulation}})
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            texts = iter(_texts(rng, 2 * case.accumulation * case.batch))
            for _ in range(2):
                for _ in range(case.accumulation):
                    batch = tokenizer([next(texts) for _ in range(case.batch)], truncation=True, max_length=case.length,
                                      padding=True, return_tensors="pt")
                    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
                    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                        loss = model(**batch, labels=labels).loss
                    (loss / case.accumulation).backward()
                optimizer.step()
                optimizer.zero_grad()
        else:
            callback = BagualuCallback(partial)
            callbacks = [callback] if plugin else []
            common = dict(output_dir=str(root / "out"), per_device_train_batch_size=case.batch,
                          gradient_accumulation_steps=case.accumulation, max_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                          save_strategy="no", use_cpu=True, seed=case.seed, gradient_checkpointing=False, disable_tqdm=True)
            if not (case.trainer == "sft" and case.precision == "mixed-bf16"):  # there SFTConfig's default, bf16=True
                common["bf16"] = autocast is not None
            if case.trainer == "sft":
                from trl import SFTConfig, SFTTrainer

                config = SFTConfig(max_length=case.length, packing=case.packing, **common)
                trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=peft,
                                     callbacks=callbacks)
            else:
                if peft is not None:
                    model = get_peft_model(model, peft)
                tokenized = dataset.map(lambda row: tokenizer(row["text"], truncation=True, max_length=case.length),
                                        remove_columns=["text"])
                trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=tokenized, processing_class=tokenizer,
                                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), callbacks=callbacks)
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.train()
            prov = callback.provisioner if plugin else None
            model = trainer.model
    except SimulatedOutOfMemoryError as error:
        return Outcome(case, "out_of_memory", str(error)[:300], capacity=capacity)
    except ValueError as error:
        if "cannot hold" in str(error) or "cannot fit" in str(error):
            return Outcome(case, "refused", str(error)[:300], capacity=capacity)
        return Outcome(case, "error", f"ValueError: {str(error)[:300]}", capacity=capacity)
    finally:
        if prov is not None and case.trainer == "loop":
            prov.remove()
    digest = _digest(model)
    if prov is None:
        return Outcome(case, "fits", capacity=capacity, digest=digest)
    events = list(prov.events)
    missed = [(e.micro_batch, [asdict(m) for m in e.misses]) for e in events if e.misses]
    outcome = Outcome(case, "fits", micro_batches=len(events), mitigated=sum(bool(e.plan) for e in events),
                      peak=prov.peak_device_bytes, capacity=capacity, digest=digest)
    if prov.peak_device_bytes > capacity:
        outcome.result, outcome.detail = "out_of_memory", f"peak {prov.peak_device_bytes} over {capacity}"
    elif any(e.spilled_bytes for e in events):
        outcome.result, outcome.detail = "spilled", str([(e.micro_batch, e.spilled_bytes) for e in events if e.spilled_bytes][:4])
    elif missed:
        outcome.result, outcome.detail = "misses", str(missed[:2])[:300]
    return outcome


def _digest(model: torch.nn.Module) -> str:
    """sha256 of the trainable weights' bytes, in order."""
    digest = hashlib.sha256()
    for p in model.parameters():
        if p.requires_grad:
            digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def sweep(cases: list[Case], root: Path, plugin: bool = True) -> list[Outcome]:
    logging.disable(logging.WARNING)
    outcomes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in cases:
            try:
                outcomes.append(run(case, root, plugin))
            except Exception as error:  # noqa: BLE001 - a case's crash is its outcome
                outcomes.append(Outcome(case, "error", f"{type(error).__name__}: {str(error)[:300]}"))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from tqdm import tqdm

    cases = draw(args.seed, args.cases)
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = [sweep([case], Path(tmp))[0] for case in tqdm(cases, desc="cases", disable=False)]
    from bagualu_plugin.report import table

    counts = Counter(o.result for o in outcomes)
    print(table(["result", "cases"], [[r, counts[r]] for r in ("fits", "refused", "out_of_memory", "spilled", "misses", "error")]))
    by = Counter((o.case.family, o.case.trainer, o.result) for o in outcomes)
    print(table(["family", "trainer", "result", "cases"], [[*k, v] for k, v in sorted(by.items())]))
    bad = [o for o in outcomes if o.result not in ("fits", "refused")]
    for o in bad:
        print(f"{o.result}: {o.case} {o.detail}", file=sys.stderr)
    print(f"seed {args.seed}: {len(outcomes)} cases, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
