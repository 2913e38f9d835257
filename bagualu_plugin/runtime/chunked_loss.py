"""The LM head and HF's causal-LM cross-entropy fused and chunked over tokens, so that the full
(tokens x vocabulary) logits never exist at once (as Liger-Kernel's fused linear cross-entropy).

Semantics are transformers' `ForCausalLMLoss`: labels shifted by one and padded with
`ignore_index` (or `shift_labels` as given), logits upcast to FP32, the mean over tokens that are
not ignored, or the sum over `num_items_in_batch` when given. Forward keeps the hidden states,
the targets, one FP32 log-sum-exp per token and the divisor; backward recomputes each chunk's
logits from them.

Not bitwise equal to HF's loss: the log-sum-exp and the picked logit are reduced per token rather
than through a log-softmax, and the weight gradient is summed over chunks in FP32. Tolerance
(tests/test_head.py), relative: loss 1e-6; gradients 1e-6 in FP32 and 2^-8 in BF16 (one
rounding; measured 2.1e-7 and 6.0e-5), 2^-7 through a whole BF16 model's backward (measured
2.8e-3). benchmarks/chunked_loss.py measures a 32k and a 64k vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss = sum over kept tokens of (lse(h W^T + b) - (h W^T + b)[target]) / divisor."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk: int, ignore_index: int):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        picked = torch.empty_like(lse)
        kept = targets != ignore_index
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = nn.functional.linear(hidden[rows], weight, bias).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            picked[rows] = logits.gather(1, torch.where(kept[rows], targets[rows], 0).unsqueeze(1)).squeeze(1)
        loss = torch.where(kept, lse - picked, 0.0).sum() / divisor
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        ctx.save_for_backward(hidden, weight, bias, targets, lse, divisor)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, targets, lse, divisor = ctx.saved_tensors
        scale = (grad_loss / divisor).float()
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], ctx.chunk):  # in place: one FP32 chunk of logits at a time
            rows = slice(start, start + ctx.chunk)
            h, t = hidden[rows], targets[rows]
            kept = t != ctx.ignore_index
            grad = nn.functional.linear(h, weight, bias).float()
            grad.sub_(lse[rows].unsqueeze(1)).exp_()  # softmax
            grad.scatter_add_(1, torch.where(kept, t, 0).unsqueeze(1), torch.full_like(grad[:, :1], -1.0))
            grad.mul_(torch.where(kept, scale, 0.0).unsqueeze(1))
            rounded = grad.to(hidden.dtype)  # as HF casts the logits' gradient back to the model dtype
            if grad_hidden is not None:
                grad_hidden[rows] = rounded @ weight
            if grad_weight is not None or grad_bias is not None:
                grad.copy_(rounded)
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, h.float())
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor,
    chunk: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_kwargs,
) -> torch.Tensor:
    """`ForCausalLMLoss(lm_head(hidden), labels, ...)` in chunks of `chunk` tokens (other keyword
    arguments are ignored, as HF's loss ignores them)."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum().float()
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    flat = hidden.reshape(-1, hidden.shape[-1])
    return ChunkedLinearCrossEntropy.apply(flat, lm_head.weight, lm_head.bias, targets, divisor, chunk, ignore_index)
