"""nanotron's `ParallelContext` over gloo processes on CPU (`integrations.nanotron.context`): the
one patch (`set_device` without CUDA) is all it takes, and the groups follow nanotron's layout,
world = ep x pp x dp x tp. Run against nanotron main as well with its sources first on the path
(`PYTHONPATH=<nanotron>/src pytest tests/test_nanotron_context.py tests/test_nanotron_engine.py`):
main's engine, P2P, blocks and context import without its config (which needs flash_attn); main's
context cannot lay out expert parallelism, which `EXPERT_PARALLEL` says and this test expects.
The layouts that lay out share one launch of 4 ranks (`helpers.run_jobs`)."""

import os

import numpy as np
import pytest
import torch.distributed as dist

pytest.importorskip("nanotron")

from helpers import run_jobs  # noqa: E402

from bagualu_plugin.parallel.launch import RankError, run_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test runs gloo ranks (`run_ranks`)


def _groups(rank: int, size: int, pp: int, dp: int, ep: int) -> dict:
    from bagualu_plugin.integrations.nanotron.context import expert_group, parallel_context, rank_matrix

    os.environ.update(WORLD_SIZE=str(size), RANK=str(rank), LOCAL_RANK=str(rank))  # as torchrun sets them
    pc = parallel_context(1, pp, dp, ep)
    return {
        "matrix": rank_matrix(pc).tolist(),
        "pp": dist.get_process_group_ranks(pc.pp_pg),
        "dp": dist.get_process_group_ranks(pc.dp_pg),
        "ep": dist.get_process_group_ranks(expert_group(pc)),
    }


LAYOUTS = {"pp2-dp2": (2, 2, 1), "pp2-ep2": (2, 1, 2)}  # (pp, dp, ep), 4 ranks each


def _lays_out(ep: int) -> bool:
    from bagualu_plugin.integrations.nanotron.context import EXPERT_PARALLEL

    return ep == 1 or EXPERT_PARALLEL  # nanotron main asserts tp x cp x dp x pp = world


@pytest.fixture(scope="module")
def layouts() -> dict[str, list]:
    """The groups of every layout that this nanotron lays out, in one launch of 4 ranks."""
    return run_jobs(4, {name: (_groups, *layout) for name, layout in LAYOUTS.items() if _lays_out(layout[2])}, timeout_s=60)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_groups_follow_nanotron_s_layout(layout, request):
    pp, dp, ep = LAYOUTS[layout]
    if not _lays_out(ep):
        with pytest.raises(RankError, match=r"TP\*CP\*DP\*PP"):
            run_ranks(_groups, pp * dp * ep, pp, dp, ep, timeout_s=60)
        return
    results = request.getfixturevalue("layouts")[layout]
    ranks = np.arange(pp * dp * ep).reshape(ep, pp, dp, 1)
    for rank, got in enumerate(results):
        e, p, d, _ = (int(i[0]) for i in np.nonzero(ranks == rank))
        assert got["matrix"] == ranks.tolist()
        assert got["pp"] == ranks[e, :, d, 0].tolist()
        assert got["dp"] == ranks[e, p, :, 0].tolist()
        assert got["ep"] == ranks[:, p, d, 0].tolist()
