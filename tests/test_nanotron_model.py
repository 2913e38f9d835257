"""`PipelineModel` runs an HF MoE model of every supported family as nanotron `PipelineBlock`s:
on one pipeline rank its loss and gradients equal the HF model's own forward bit for bit (the
embedding, each stage's layers with the decoder's positions, RoPE tables and causal or
sliding-window masks, the final norm, LM head and loss), under sdpa and eager attention, both in
one launch (`helpers.run_jobs`)."""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("nanotron")

from helpers import run_jobs  # noqa: E402

from bagualu_plugin.adapters import tiny_model  # noqa: E402
from bagualu_plugin.families import FAMILIES  # noqa: E402

ATTENTION = ["sdpa", "eager"]


def _against_hf(rank: int, size: int, attention: str) -> dict:
    from bagualu_plugin.integrations.nanotron.compat import import_pipeline

    import_pipeline()
    from nanotron.parallel.pipeline_parallel.p2p import P2P

    from bagualu_plugin.integrations.nanotron.model import PipelineModel

    out = {}
    for family in sorted(FAMILIES):
        # mixtral and qwen3_moe with a window shorter than the sequence: their sliding-window mask matters
        window = {"sliding_window": 8} if family in ("mixtral", "qwen3_moe") else {}
        kernel = "eager" if family == "gpt_oss" else attention  # transformers runs gpt-oss (sinks) eagerly only
        model = tiny_model(family, num_hidden_layers=4, attn_implementation=kernel, **window)
        model.set_experts_implementation("bagualu")
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
        theirs = model(input_ids=ids, labels=ids).loss
        theirs.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        ours = PipelineModel(model, P2P(dist.group.WORLD, torch.device("cpu")))(input_ids=ids, labels=ids)["loss"]
        ours.backward()
        same = all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if p.grad is not None)
        out[family] = (torch.equal(ours, theirs), same, len(grads))
    return out


@pytest.fixture(scope="module")
def one_rank() -> dict[str, list]:
    """Both attention kernels' runs in one launch of one rank (one torch thread, as on a busy CPU)."""
    return run_jobs(1, {attention: (_against_hf, attention) for attention in ATTENTION}, timeout_s=120, threads=1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("attention", ATTENTION)
def test_one_stage_is_the_hf_forward_bitwise(one_rank, attention):
    for family, (loss, grads, count) in one_rank[attention][0].items():
        assert loss and grads and count > 0, family


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_each_stage_loads_only_its_weights(tmp_path, tied):
    """`load_pretrained(keep=stage_state(pp, rank))`: a stage's layers (and the embedding on the
    first, the norm and LM head on the last) equal `from_pretrained`'s, the rest stays on the meta
    device unread; with tied embeddings the last stage's LM head is read from the embedding's key."""
    from transformers import AutoModelForCausalLM

    from bagualu_plugin.adapters import save_tiny
    from bagualu_plugin.integrations.nanotron.model import stage_state
    from bagualu_plugin.parallel import load_pretrained

    path = save_tiny("qwen3_moe", tmp_path / "ckpt", num_hidden_layers=4, tie_word_embeddings=tied)
    whole = dict(AutoModelForCausalLM.from_pretrained(path, local_files_only=True).named_parameters())
    for rank, layers in ((0, {0, 1}), (1, {2, 3})):
        model = load_pretrained(path, keep=stage_state(2, rank))
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        for name, param in model.named_parameters():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            embed = name.startswith("model.embed_tokens") and (rank == 0 or tied)
            head = name.startswith(("model.norm", "lm_head")) and rank == 1
            held = layer in layers if layer is not None else embed or head
            assert param.is_meta != held, name
            if held:
                assert torch.equal(param, whole[name]), name
        assert not model.model.rotary_emb.inv_freq.is_meta
