"""Expert-parallel checkpoints (`bagualu_plugin.parallel.checkpoint`) over 2 real gloo processes on
CPU: each rank materialises only its experts, the sharded model computes the loss of the whole
model loaded by `from_pretrained`, and `save_expert_parallel` writes back the very checkpoint.

The tests share one launch of 2 processes (`helpers.run_jobs` over `parallel.launch.run_ranks`);
a worker checks every case of a test and returns its measurements, which the parent asserts.
The group's collectives time out after 60 s and the ranks must finish within 120 s per worker,
so a deadlock fails instead of hanging."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import run_jobs
from safetensors import safe_open

from bagualu_plugin.adapters import save_tiny, tiny_model
from bagualu_plugin.parallel import load_expert_parallel, save_expert_parallel

WORLD = 2
TIMEOUT_S = 60  # collectives; run_ranks gives the ranks this + 60 s to finish
LOSS_RTOL = 1e-5  # EP forward differs from one process in the last ulps (CPU matmul results depend on the row count)

# name -> (family, save_tiny overrides, save_pretrained max_shard_size or None)
CASES = {
    "qwen3_moe": ("qwen3_moe", {}, None),
    "deepseek_v3": ("deepseek_v3", {}, None),
    "gpt_oss": ("gpt_oss", {}, None),  # fused experts in the checkpoint, with expert biases
    "mixtral": ("mixtral", {}, None),  # checkpoint keys renamed (block_sparse_moe, w1/w2/w3)
    "glm4_moe": ("glm4_moe", {}, None),
    "qwen2_moe": ("qwen2_moe", {}, None),
    "qwen3_moe_sharded": ("qwen3_moe", {}, "20KB"),  # several files and model.safetensors.index.json
    "qwen3_moe_tied": ("qwen3_moe", {"tie_word_embeddings": True}, None),  # lm_head not in the checkpoint
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """The checkpoints of CASES and one of 7 experts, then both workers in one launch of WORLD
    processes, one thread each: the folder, and each worker's reports in rank order."""
    tmp = tmp_path_factory.mktemp("ep_checkpoint")
    for name, (family, overrides, max_shard_size) in CASES.items():
        model = tiny_model(family, seed=3, **overrides)
        model.save_pretrained(tmp / name, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    save_tiny("qwen3_moe", tmp / "seven", num_experts=7)
    # the round trip patches the rank's `safe_open` (to count what it reads): it runs last
    jobs = {"seven": (_bad_input_worker, tmp), "round trip": (_round_trip_worker, tmp, list(CASES))}
    return tmp, run_jobs(WORLD, jobs, timeout_s=TIMEOUT_S, threads=1)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


class _CountingOpen:
    """`safe_open` that counts the bytes of the tensors it hands out (`get_tensor`, `get_slice`)."""

    read = 0

    def __init__(self, file, framework):
        self._file = safe_open(file, framework=framework)

    def __enter__(self):
        self._file.__enter__()
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def keys(self):
        return self._file.keys()

    def get_tensor(self, key):
        return self._count(self._file.get_tensor(key))

    def get_slice(self, key):
        rows = self._file.get_slice(key)
        return type("Slice", (), {"get_shape": lambda _: rows.get_shape(), "__getitem__": lambda _, i: self._count(rows[i])})()

    @classmethod
    def _count(cls, tensor):
        cls.read += tensor.numel() * tensor.element_size()
        return tensor


def _round_trip_worker(rank: int, size: int, tmp_path: Path, names: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    from bagualu_plugin.parallel import checkpoint, expert_group
    from bagualu_plugin.parallel.checkpoint import expert_shards

    checkpoint.safe_open = _CountingOpen  # in this rank's process only
    report = {}
    for name in names:
        path = tmp_path / name
        _CountingOpen.read = 0
        model = load_expert_parallel(path)
        bytes_read = _CountingOpen.read
        full = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).train()
        full_params = dict(full.named_parameters())
        shards = expert_shards(model)
        local = {expert_group(m).local for m in model.modules() if expert_group(m) is not None}
        (experts,) = local
        expert_bytes = _bytes(p for n, p in model.named_parameters() if n in shards)
        full_expert_bytes = _bytes(full_params[n] for n in shards)
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        torch.manual_seed(1000 + rank)
        ids = torch.randint(0, full.config.vocab_size, (2, 24))
        loss, full_loss = (m(input_ids=ids, labels=ids).loss.item() for m in (model, full))
        out = tmp_path / f"{name}_saved"
        with mock.patch.object(model, "save_pretrained", wraps=model.save_pretrained) as write:
            save_expert_parallel(model, out)
        case = {
            "local": [experts.start, experts.stop],
            "training": model.training,
            "on_meta": [n for n, t in [*params.items(), *buffers.items()] if t.is_meta],
            "sharded": sorted(shards),
            "expert_bytes": expert_bytes,
            "full_expert_bytes": full_expert_bytes,
            "param_bytes": _bytes(params.values()),
            "full_param_bytes": _bytes(full_params.values()),
            "slices_differ": [n for n in shards if not torch.equal(params[n], full_params[n][experts.start : experts.stop])],
            "replicated_differ": [n for n, p in params.items() if n not in shards and not torch.equal(p, full_params[n])],
            "buffers_differ": [n for n, b in buffers.items() if not torch.equal(b, dict(full.named_buffers())[n])],
            "lm_head_tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "bytes_read": bytes_read,
            "checkpoint_bytes": _bytes(_checkpoint(path).values()),
            "loss": loss,
            "full_loss": full_loss,
            "writes": write.call_count,
        }
        if rank == 0:
            original, saved = _checkpoint(path), _checkpoint(out)
            reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).state_dict()
            case["saved_keys_differ"] = sorted(set(original) ^ set(saved))
            case["saved_differ"] = [k for k in original.keys() & saved.keys() if not torch.equal(original[k], saved[k])]
            case["reloaded_differ"] = [k for k, t in full.state_dict().items() if not torch.equal(t, reloaded[k])]
        report[name] = case
    return report


@pytest.mark.multiprocess
def test_load_and_save_round_trip(ranks):
    """Each rank holds half the experts and nothing else less; slices, loss, buffers and the saved
    checkpoint all match the whole model's."""
    tmp_path, reports = ranks[0], ranks[1]["round trip"]
    assert (tmp_path / "qwen3_moe_sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "qwen3_moe_sharded").glob("*.safetensors"))) > 1
    for rank, report in enumerate(reports):
        for name, case in report.items():
            where = f"{name}, rank {rank}"
            assert case["local"] == [4 * rank, 4 * rank + 4], where
            assert case["training"] and case["on_meta"] == [], where
            assert case["sharded"], where
            assert 2 * case["expert_bytes"] == case["full_expert_bytes"], where
            assert case["param_bytes"] == case["full_param_bytes"] - case["full_expert_bytes"] // 2, where
            assert case["bytes_read"] == case["checkpoint_bytes"] - case["full_expert_bytes"] // 2, where  # never the other experts
            assert case["slices_differ"] == [] and case["replicated_differ"] == [] and case["buffers_differ"] == [], where
            assert case["lm_head_tied"] == name.endswith("_tied"), where
            assert case["loss"] == pytest.approx(case["full_loss"], rel=LOSS_RTOL), where
            assert case["writes"] == (rank == 0), where  # only rank 0 writes
            if rank == 0:
                assert case["saved_keys_differ"] == [] and case["saved_differ"] == [] and case["reloaded_differ"] == [], where
    assert any("bias" in n for n in reports[0]["gpt_oss"]["sharded"])  # gpt-oss expert biases are sharded too


def _bad_input_worker(rank: int, size: int, tmp_path: Path) -> dict:
    try:
        load_expert_parallel(tmp_path / "seven")
        error = None
    except ValueError as caught:
        error = str(caught)
    return {"error": error}


@pytest.mark.multiprocess
def test_experts_not_divisible_by_group(ranks):
    for report in ranks[1]["seven"]:
        assert report["error"] is not None and "num_experts=7" in report["error"]


def test_path_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_expert_parallel(tmp_path)


def test_save_needs_an_expert_parallel_model(tmp_path):
    with pytest.raises(ValueError, match="expert_parallel"):
        save_expert_parallel(tiny_model("qwen3_moe"), tmp_path)
