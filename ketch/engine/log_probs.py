"""Log-probs and entropy of given tokens through the output projection, without keeping any logits.

`token_log_probs` computes, chunk by chunk of tokens, the logits `states @ weight.T` (in the weights' dtype),
their log-sum-exp, the label's log-prob and the entropy, and keeps only those `[tokens]` figures. The
backward pass recomputes each chunk's logits and turns them straight into the logits' gradient, so neither
the float32 logits nor the softmax are ever stored and each chunk's vocabulary axis is read a few times in
all. On CUDA the elementwise and reduction work over the vocabulary is compiled into fused kernels (one
kernel per formula instead of a pass per operator over `[chunk, vocab]` float32 tensors); elsewhere the same
formulas run eagerly.

Gradients, with `z = logits / temperature`, `p = softmax(z)`, `lp = z[label] - lse(z)` and
`H = lse(z) - sum(p * z)`:
`d lp / d z = onehot(label) - p` and `d H / d z = -p * (log p + H)`.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
from torch import nn

from ketch.architecture import PLAIN_LOGITS, LogitTransform
from ketch.compiled import SavedCompile

logger = logging.getLogger("ketch.engine")

LOGIT_CHUNK = 4096
"""Tokens per chunk: full `[tokens, vocab]` float32 logits never exist at once."""


def _statistics(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scale: float,
    softcap: float | None,
    inv_temperature: float,
    calc_entropy: bool,
):
    """Projections `logits` `[n, vocab]` -> log-prob of `labels`, log-sum-exp and entropy (empty without
    `calc_entropy`) of the model's logits (`LogitTransform` `scale` and `softcap`) divided by the temperature, each
    `[n]` in float32 (or the logits' dtype, if wider)."""
    z = _transformed(logits, scale, softcap)[0] * inv_temperature
    peak = z.amax(-1, keepdim=True)
    shifted = (z - peak).exp()
    total = shifted.sum(-1)
    lse = total.log() + peak.squeeze(-1)
    log_prob = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not calc_entropy:
        return log_prob, lse, lse.new_zeros(0)
    entropy = lse - (shifted * z).sum(-1) / total
    return log_prob, lse, entropy


def _logit_grad(
    logits,
    labels,
    lse,
    entropy,
    grad_log_prob,
    grad_entropy,
    scale: float,
    softcap: float | None,
    inv_temperature: float,
):
    """The gradient `[n, vocab]` (in the logits' dtype) of `sum(grad_log_prob * lp + grad_entropy * H)` with
    respect to the projections `logits`; `grad_entropy` None when the entropy is not differentiated."""
    transformed, slope = _transformed(logits, scale, softcap)
    z = transformed * inv_temperature
    log_p = z - lse.unsqueeze(-1)
    p = log_p.exp()
    onehot = torch.arange(z.shape[-1], device=z.device) == labels.unsqueeze(-1)
    grad = grad_log_prob.unsqueeze(-1) * (onehot.to(p.dtype) - p)
    if grad_entropy is not None:
        grad = grad - grad_entropy.unsqueeze(-1) * p * (log_p + entropy.unsqueeze(-1))
    return (grad * (slope * inv_temperature)).to(logits.dtype)


def _transformed(
    logits: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """The model's logits from the projections `logits` (widened to float32), and their derivative with respect to
    the projections (a tensor with a soft cap, else the scale)."""
    scaled = _wide(logits) * scale
    if softcap is None:
        return scaled, scale
    capped = (scaled / softcap).tanh()
    return capped * softcap, (1 - capped.square()) * scale


def _wide(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


@cache
def _kernels(device_type: str):
    """The two formulas, compiled into fused kernels on CUDA (shapes may vary: the last chunk is shorter)."""
    if device_type != "cuda":
        return _statistics, _logit_grad
    statistics, logit_grad = SavedCompile(_statistics, "token_statistics"), SavedCompile(_logit_grad, "logit_grad")
    where = statistics.directory.parent
    logger.info("compiling the fused log-prob/entropy kernels on first use, or loading them (cache %s)", where)
    return statistics, logit_grad


def load_kernels(device: torch.device) -> None:
    """Load the kernels' saved forms now (where an engine is set up) rather than inside the first update."""
    if device.type == "cuda":
        for kernel in _kernels("cuda"):
            kernel.load()


def _chunks(tokens: int, chunk: int) -> list[slice]:
    return [slice(i, i + chunk) for i in range(0, tokens, chunk)]


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, states, labels, weight, bias, transform, temperature, calc_entropy, chunk):
        statistics, _ = _kernels(states.device.type)
        inv = 1.0 / temperature
        ctx_transform = (transform.scale, transform.softcap)
        parts = [
            statistics(
                nn.functional.linear(states[part], weight, bias), labels[part], *ctx_transform, inv, calc_entropy
            )
            for part in _chunks(states.shape[0], chunk)
        ]
        log_prob, lse, entropy = (torch.cat(p) for p in zip(*parts, strict=True))
        ctx.save_for_backward(states, labels, weight, bias, lse, entropy)
        ctx.transform, ctx.inv, ctx.chunk = ctx_transform, inv, chunk
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        states, labels, weight, bias, lse, entropy = ctx.saved_tensors
        _, logit_grad = _kernels(states.device.type)
        if grad_log_prob is None:
            grad_log_prob = lse.new_zeros(lse.shape)
        if grad_entropy is not None and grad_entropy.numel() == 0:
            grad_entropy = None
        grad_states = torch.empty_like(states) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[2] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[3] else None
        for part in _chunks(states.shape[0], ctx.chunk):
            logits = nn.functional.linear(states[part], weight, bias)
            g_ent = None if grad_entropy is None else grad_entropy[part]
            grad = logit_grad(
                logits, labels[part], lse[part], entropy[part], grad_log_prob[part], g_ent, *ctx.transform, ctx.inv
            )
            if grad_states is not None:
                torch.mm(grad, weight, out=grad_states[part])
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, states[part])
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        return grad_states, None, grad_weight, grad_bias, None, None, None, None


def token_log_probs(
    states: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    calc_entropy: bool,
    chunk: int = LOGIT_CHUNK,
    transform: LogitTransform = PLAIN_LOGITS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `labels` `[tokens]` under `softmax(logits / temperature)` from hidden `states` `[tokens, hidden]`
    and the output projection `weight` `[vocab, hidden]`, the logits being `states @ weight.T + bias` under the
    model's `transform` (scale, soft cap); and the entropy `[tokens]` when `calc_entropy` (else None). Both float32
    (float64 for float64 inputs) and differentiable."""
    if states.shape[0] == 0:  # still part of the graph, so that a backward pass through it runs
        empty = states.sum(-1).float()
        return empty, (empty if calc_entropy else None)
    log_prob, entropy = _TokenLogProbs.apply(states, labels, weight, bias, transform, temperature, calc_entropy, chunk)
    return log_prob, entropy if calc_entropy else None
