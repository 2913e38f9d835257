"""Expert parallelism's communication per MoE layer on gloo (CPU): dispatch and combine, forward
and backward, versus tokens per rank and EP size (`bagualu_plugin.parallel.expert`).

The script runs its ranks through `bagualu_plugin.parallel.launch.run_ranks` (one process each,
gloo, one process group per EP size) and calls the code path an expert-parallel layer runs, on
tensors, with no model: random top-k routing over E experts, then `ExpertGroup.route` (the
per-expert counts' all_to_all_single and the host sync), `_Dispatch.apply` (rows (T*k, H) float32
and their routing weights, uneven all_to_all_single), the received rows multiplied by their weights
(no expert compute: this measures communication), `_Combine.apply` (the reverse all-to-all,
un-permute, sum over top-k), then backward through both with a random output gradient. A barrier
precedes each timed region; each rank times its own regions, one warm-up pass, then the median of
--repeats. Dispatch issues its two exchanges (the rows, their routing weights) side by side, both
before it waits on either; the last table times the two alone, issued that way and one after the
other, to show what issuing them together hides.

A row's times are the slowest rank's (the layer waits for it; each column's own maximum, so the
phases need not add up to the total). "MB sent/rank" is what a rank sends to the other ranks
over the layer's four exchanges (dispatch rows + weights, combine rows, their gradients back;
its share to itself never leaves the process), the mean over ranks; GB/s is that over the
slowest rank's total. --skew s routes each pair to rank 0's experts with probability s and
otherwise to a uniformly random expert (sampled without replacement per token, so rank 0's share
is a little under s + (1 - s) / ep); its second table shows the hot rank 0 against the slowest
other rank.

The times are those of the real Functions, so they include their local copies (the gather into
expert order, the un-permute, the backward's scatter-add and gathers; the backward also holds the
weight multiply's), not only the all_to_all_single calls. All ranks share this machine's cores
(4 ranks on 2 cores oversubscribe them): each rank runs one torch thread (threads=1), and the
bandwidth is loopback TCP through gloo, not a network's.

    python benchmarks/expert_parallel.py [--ep 2 4] [--tokens 256 1024 4096] [--hidden 1024]
        [--top-k 2] [--experts 8] [--skew 0.5] [--repeats 5] [--json FILE]
    (about 60 s on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

from bagualu_plugin.parallel.launch import run_ranks
from bagualu_plugin.report import table

PHASES = ("route", "dispatch fwd", "combine fwd", "bwd")
PAIRED = ("one after another", "side by side")  # dispatch's rows and weights exchanges, as `_all_to_all` issues them
MB = 1e6


def _routing(tokens: int, num_experts: int, top_k: int, size: int, skew: float, g: torch.Generator):
    """(T, k) expert ids, distinct per token, and softmax weights; with skew, rank 0's experts hot."""
    local = num_experts // size
    p = torch.full((num_experts,), (1 - skew) / num_experts)
    p[:local] += skew / local
    index = torch.multinomial(p.expand(tokens, -1), top_k, replacement=False, generator=g)
    weights = torch.randn(tokens, top_k, generator=g).softmax(-1)
    return index, weights


def _measure(eg, tokens: int, hidden: int, top_k: int, skew: float, repeats: int, warmup: int, seed: int) -> dict:
    """One configuration on this rank: per-repeat times of each phase, and the splits."""
    from bagualu_plugin.parallel.expert import _all_to_all, _Combine, _Dispatch

    g = torch.Generator().manual_seed(seed)
    index, weights = _routing(tokens, eg.num_experts, top_k, eg.size, skew, g)
    states = torch.randn(tokens, hidden, generator=g)
    grad = torch.randn(tokens, hidden, generator=g)
    stand_in = types.SimpleNamespace()  # no gate attribute: route() fires no gate
    times = {phase: [] for phase in (*PHASES, "total", *PAIRED)}
    for step in range(warmup + repeats):
        x, w = states.clone().requires_grad_(), weights.clone().requires_grad_()
        spent = []
        dist.barrier(eg.group)
        start = time.perf_counter()
        route = eg.route(stand_in, index)
        spent.append(time.perf_counter() - start)
        dist.barrier(eg.group)
        start = time.perf_counter()
        rows, received_weights = _Dispatch.apply(x, w, index, route)
        spent.append(time.perf_counter() - start)
        out = rows * received_weights.unsqueeze(1)  # the experts' place, untimed
        dist.barrier(eg.group)
        start = time.perf_counter()
        y = _Combine.apply(out, index, route)
        spent.append(time.perf_counter() - start)
        dist.barrier(eg.group)
        start = time.perf_counter()
        torch.autograd.backward(y, grad)
        spent.append(time.perf_counter() - start)
        if x.grad is None or w.grad is None or not torch.isfinite(x.grad).all():
            raise RuntimeError("backward reached neither the rows nor the weights")
        # the dispatch's two exchanges alone, as its forward issues them (side by side) and one
        # after the other: what issuing them together hides of the smaller one
        exchanges = ((rows.detach(), route.sent, route.got), (received_weights.detach(), route.sent, route.got))
        for groups in ([exchanges[:1], exchanges[1:]], [exchanges]):  # PAIRED's order
            dist.barrier(eg.group)
            start = time.perf_counter()
            for batch in groups:
                _all_to_all(eg.group, *batch)
            spent.append(time.perf_counter() - start)
        if step >= warmup:
            for phase, s in zip((*PHASES, "total", *PAIRED), (*spent[:4], sum(spent[:4]), *spent[4:])):
                times[phase].append(s)
    rank = eg.rank
    off_sent, off_got = sum(route.sent) - route.sent[rank], sum(route.got) - route.got[rank]
    # dispatch: rows + weights out; combine: rows back; backward: the same in reverse
    sent_bytes = 4 * (off_sent * (hidden + 1) + off_got * hidden + off_sent * hidden + off_got * (hidden + 1))
    return {
        "rank": rank,
        "pairs_sent": route.sent,
        "pairs_received": route.got,
        "bytes_sent": sent_bytes,
        "dispatch_bytes_received": 4 * off_got * (hidden + 1),
        "seconds": {phase: statistics.median(v) for phase, v in times.items()},
    }


def _worker(rank: int, size: int, cases: list, args: dict) -> list[dict]:
    from bagualu_plugin.adapters.experts import local_expert_range
    from bagualu_plugin.parallel.expert import ExpertGroup

    eg = ExpertGroup(None, size, rank, args["experts"], local_expert_range(args["experts"], size, rank))
    results = []
    for i, (tokens, skew) in enumerate(cases):
        seed = 1000 * i + rank
        results.append(_measure(eg, tokens, args["hidden"], args["top_k"], skew, args["repeats"], args["warmup"], seed))
    return results


def _run(size: int, cases: list, args: dict, deadline: float) -> list[list[dict]]:
    """`size` ranks, one thread each; per case, each rank's result. The time left before `deadline`
    is the collectives' timeout (run_ranks allows 60 s more for spawning), so a hang fails."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"ep={size}: no time left before the deadline")
    per_rank = run_ranks(_worker, size, cases, args, timeout_s=left, threads=1)
    return [list(case) for case in zip(*per_rank)]


def _row(size: int, tokens: int, skew: float, ranks: list[dict], args: dict) -> dict:
    slowest = {phase: max(r["seconds"][phase] for r in ranks) for phase in (*PHASES, "total", *PAIRED)}
    pairs = tokens * size * args["top_k"]
    return {
        "ep": size,
        "tokens_per_rank": tokens,
        "hidden": args["hidden"],
        "top_k": args["top_k"],
        "experts": args["experts"],
        "skew": skew,
        "rank0_share": sum(ranks[0]["pairs_received"]) / pairs,
        "mb_sent_per_rank": statistics.mean(r["bytes_sent"] for r in ranks) / MB,
        "seconds": slowest,
        "gb_per_s": statistics.mean(r["bytes_sent"] for r in ranks) / slowest["total"] / 1e9,
        "ranks": ranks,
    }


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="EP sizes (one process group each)")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096], help="tokens per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--experts", type=int, default=8, help="E, over the whole group")
    p.add_argument("--skew", type=float, default=0.5, help="also a case with this fraction of pairs sent to rank 0 (0: none)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds for the whole run before it fails (+60 s to start ranks)")
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    for size in args.ep:
        if size < 2 or args.experts % size:
            raise SystemExit(f"--ep {size}: needs >= 2 ranks dividing --experts {args.experts}")
    if not 0 <= args.skew < 1:
        raise SystemExit("--skew must be in [0, 1)")
    settings = {"hidden": args.hidden, "top_k": args.top_k, "experts": args.experts, "repeats": args.repeats, "warmup": args.warmup}
    cases = [(t, s) for t in args.tokens for s in ([0.0, args.skew] if args.skew else [0.0])]
    deadline = time.monotonic() + args.deadline
    started = time.perf_counter()
    rows = []
    for size in args.ep:
        for (tokens, skew), ranks in zip(cases, _run(size, cases, settings, deadline)):
            rows.append(_row(size, tokens, skew, ranks, settings))
    elapsed = time.perf_counter() - started

    def routing(r: dict) -> str:
        return "uniform" if not r["skew"] else f"skew {r['skew']:g}"

    print(
        f"gloo on {os.cpu_count()} CPU cores, H={args.hidden} float32, top-{args.top_k} of E={args.experts}, "
        f"median of {args.repeats}, slowest rank, ms; {elapsed:.0f} s\n"
    )
    headers = [
        "ep", "tokens/rank", "routing", "rank 0 share", "MB sent/rank", "route", "dispatch fwd", "combine fwd",
        "dispatch+combine bwd", "total", "GB/s",
    ]
    print(table(headers, [
        [r["ep"], r["tokens_per_rank"], routing(r), f"{r['rank0_share']:.2f}", f"{r['mb_sent_per_rank']:.1f}",
         *(_ms(r["seconds"][phase]) for phase in (*PHASES, "total")), f"{r['gb_per_s']:.2f}"]
        for r in rows
    ]))
    skewed = [r for r in rows if r["skew"]]
    if skewed:
        print("\nskewed routing: hot rank 0 / slowest other rank, ms (MB received: dispatch rows + weights from other ranks)\n")
        hot = []
        for r in skewed:
            zero, others = r["ranks"][0], r["ranks"][1:]
            cells = [f"{zero['dispatch_bytes_received'] / MB:.1f} / {max(o['dispatch_bytes_received'] for o in others) / MB:.1f}"]
            for phase in ("dispatch fwd", "combine fwd", "bwd", "total"):
                cells.append(f"{_ms(zero['seconds'][phase])} / {_ms(max(o['seconds'][phase] for o in others))}")
            hot.append([r["ep"], r["tokens_per_rank"], routing(r), f"{r['rank0_share']:.2f}", *cells])
        print(table(["ep", "tokens/rank", "routing", "rank 0 share", "MB received", "dispatch fwd", "combine fwd",
                     "dispatch+combine bwd", "total"], hot))
    print("\ndispatch's rows and weights exchanges alone, slowest rank, ms\n")
    print(table(["ep", "tokens/rank", "routing", *PAIRED, "hidden"], [
        [r["ep"], r["tokens_per_rank"], routing(r), *(_ms(r["seconds"][p]) for p in PAIRED),
         f"{1 - r['seconds'][PAIRED[1]] / r['seconds'][PAIRED[0]]:.0%}"]
        for r in rows
    ]))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "seconds": elapsed, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
