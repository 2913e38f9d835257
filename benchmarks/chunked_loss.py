"""Peak memory of the LM head + loss, HF's way against the chunked linear cross-entropy
(`MitigationOptions.loss_chunk_tokens`, `runtime.chunked_loss`), on a head with a realistic
vocabulary: forward and backward of T tokens through a (V x H) projection.

HF's loss makes the (T x V) logits, their FP32 upcast (BF16), log-softmax and its gradient; the
chunked loss never holds more than one chunk's logits. Each variant runs in a fresh process, so
one's allocations cannot hide in the other's peak: on CUDA the peak is
`torch.cuda.max_memory_allocated`, on CPU the growth of the process's peak resident set
(`ru_maxrss`) over forward and backward. The loss and gradient differences are relative (the
gradients' L2 error over the hidden states and the weight).

    python benchmarks/chunked_loss.py   (about 30 s on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from bagualu_plugin.report import table
from bagualu_plugin.runtime.chunked_loss import chunked_causal_lm_loss

CASES = [  # (dtype, tokens, hidden, vocabulary)
    ("float32", 4096, 256, 32768),
    ("bfloat16", 2048, 256, 65536),
]
CHUNK = 1024
MiB = 2**20


def _peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child(dtype: str, tokens: int, hidden_size: int, vocab: int, chunked: bool, out: Path) -> None:
    """One variant: forward + backward once, the peak's growth, the loss and gradients saved."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(hidden_size, vocab, bias=False).to(getattr(torch, dtype))
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=g) * hidden_size**-0.5)
    head = head.to(device)
    hidden = torch.randn(1, tokens, hidden_size, generator=g).to(device, head.weight.dtype).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    head.weight.grad = torch.zeros_like(head.weight)  # gradients exist before the measured pass
    hidden.grad = torch.zeros_like(hidden)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before, start = _peak_bytes(device), time.perf_counter()
    if chunked:
        loss = chunked_causal_lm_loss(hidden, head, labels, CHUNK)
    else:
        loss = ForCausalLMLoss(head(hidden), labels, vocab)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grown = _peak_bytes(device) - (0 if device == "cuda" else before)
    if device == "cuda":
        grown -= sum(t.numel() * t.element_size() for t in (head.weight, head.weight.grad, hidden, hidden.grad, labels))
    torch.save({"loss": loss.detach().cpu(), "grads": [hidden.grad.cpu(), head.weight.grad.cpu()], "peak": grown, "s": seconds}, out)


def _variant(case: tuple, chunked: bool, folder: Path) -> dict:
    out = folder / f"{case[0]}-{chunked}.pt"
    command = [sys.executable, __file__, "--child", *map(str, case), str(int(chunked)), str(out)]
    subprocess.run(command, check=True)
    return torch.load(out)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            dtype, tokens, hidden_size, vocab = case
            plain, chunked = (_variant(case, c, Path(tmp)) for c in (False, True))
            logits = tokens * vocab * torch.finfo(getattr(torch, dtype)).bits // 8
            grads = sum(((c - p).float().norm() ** 2).item() for c, p in zip(chunked["grads"], plain["grads"]))
            grads = (grads / sum((p.float().norm() ** 2).item() for p in plain["grads"])) ** 0.5
            drop = plain["peak"] - chunked["peak"]
            rows.append([
                dtype, tokens, hidden_size, vocab, f"{logits / MiB:.0f} MiB", f"{plain['peak'] / MiB:.0f} MiB",
                f"{chunked['peak'] / MiB:.0f} MiB", f"{drop / MiB:.0f} MiB ({drop / logits:.1f}x logits)",
                f"{_relative(chunked['loss'], plain['loss']):.1e}", f"{grads:.1e}", f"{plain['s']:.1f} / {chunked['s']:.1f}",
            ])
    device = "cuda" if torch.cuda.is_available() else "cpu (ru_maxrss growth)"
    headers = [
        "dtype", "tokens", "hidden", "vocab", "logits", "peak HF loss", f"peak chunked ({CHUNK})", "drop",
        "loss diff", "grad diff", "seconds HF / chunked",
    ]
    print(f"LM head + loss, forward and backward, peak memory on {device}")
    print(table(headers, rows))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=6, metavar=("DTYPE", "TOKENS", "HIDDEN", "VOCAB", "CHUNKED", "OUT"))
    args = parser.parse_args()
    if args.child:
        dtype, tokens, hidden_size, vocab, chunked, out = args.child
        child(dtype, int(tokens), int(hidden_size), int(vocab), chunked == "1", Path(out))
        sys.exit(0)
    sys.exit(main())
