"""Log-probs and entropy of given tokens through the output projection, without keeping any logits.

`token_log_probs` computes, chunk by chunk of tokens, the logits `states @ weight.T` (in the weights' dtype),
their log-sum-exp, the label's log-prob and the entropy, and keeps only those `[tokens]` figures. The
backward pass recomputes each chunk's logits and turns them straight into the logits' gradient, so neither
the float32 logits nor the softmax are ever stored and each chunk's vocabulary axis is read a few times in
all. A chunk holds at most a fixed number of logits (`logit_chunk`), so the pass's peak memory does not grow
with tokens x vocabulary: only the `[tokens]` and `[tokens, hidden]` tensors grow with the tokens. On CUDA the
elementwise and reduction work over the vocabulary is compiled into fused kernels (one kernel per formula
instead of a pass per operator over `[chunk, vocab]` float32 tensors); elsewhere the same formulas run eagerly,
in place where they can, so that a chunk holds two float32 `[chunk, vocab]` tensors at a time.

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
"""The most tokens per chunk."""
LOGIT_ELEMENTS = {"cuda": 2**26, "cpu": 2**20}
"""Logits per chunk (tokens x vocabulary), by device type (others: the CPU's). On GPUs 2^26: 256 MiB per float32
`[chunk, vocab]` tensor, 441 tokens of a 152k vocabulary (Qwen2.5), 2,048 of a 32k one. The projection's matmul then
reads the weight once per 441 tokens: 441 multiply-adds per weight read, above the ~200 at which an H200's bf16
matmul stops waiting for memory, and the chunk's logits cost 0.3 GiB instead of the 2.3 GiB of 4,096 tokens
(each float32 tensor of the backward pass as much again). On the CPU, where matmuls are efficient from a few dozen
rows, 2^20: 4 MiB per tensor, which stays in the caches and is not a fresh mapping of memory at each allocation."""
MIN_LOGIT_CHUNK = 16
"""The fewest tokens per chunk, for vocabularies so large that the element budget would leave fewer."""


def logit_chunk(vocab: int, device_type: str, elements: int | None = None) -> int:
    """Tokens per chunk for a vocabulary of `vocab` on a device of `device_type`: as many as fit in `elements`
    logits (None: the device's `LOGIT_ELEMENTS`), between `MIN_LOGIT_CHUNK` and `LOGIT_CHUNK`."""
    elements = elements or LOGIT_ELEMENTS.get(device_type, LOGIT_ELEMENTS["cpu"])
    return min(LOGIT_CHUNK, max(MIN_LOGIT_CHUNK, elements // vocab))


def _statistics(
    states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    scale: float,
    softcap: float | None,
    inv_temperature: float,
    calc_entropy: bool,
):
    """Hidden `states` `[n, hidden]` -> log-prob of `labels`, log-sum-exp and entropy (empty without `calc_entropy`)
    of the model's logits (`LogitTransform` `scale` and `softcap`) divided by the temperature, each `[n]` in float32
    (or the weights' dtype, if wider)."""
    z, _ = _scaled_logits(states, weight, bias, scale, softcap, inv_temperature)
    peak = z.amax(-1, keepdim=True)
    shifted = (z - peak).exp_()
    total = shifted.sum(-1)
    lse = total.log() + peak.squeeze(-1)
    log_prob = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not calc_entropy:
        return log_prob, lse, lse.new_zeros(0)
    entropy = lse - shifted.mul_(z).sum(-1) / total
    return log_prob, lse, entropy


def _logit_grad(
    states,
    weight,
    bias,
    labels,
    lse,
    entropy,
    grad_log_prob,
    grad_entropy,
    scale: float,
    softcap: float | None,
    inv_temperature: float,
):
    """The gradient `[n, vocab]` (in the weights' dtype) of `sum(grad_log_prob * lp + grad_entropy * H)` with
    respect to the projections `states @ weight.T + bias`; `grad_entropy` None when the entropy is not
    differentiated. `-p * (g_lp + g_H * (log p + H))`, then `g_lp` added at each label."""
    z, slope = _scaled_logits(states, weight, bias, scale, softcap, inv_temperature)
    log_p = z.sub_(lse.unsqueeze(-1))
    p = log_p.exp()
    if grad_entropy is None:
        grad = p.mul_(-grad_log_prob.unsqueeze(-1))
    else:
        weighted = log_p.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
        grad = weighted.add_(grad_log_prob.unsqueeze(-1)).mul_(p).neg_()
    grad = grad.scatter_add_(-1, labels.unsqueeze(-1), grad_log_prob.unsqueeze(-1).to(grad.dtype))
    return grad.mul_(slope * inv_temperature).to(weight.dtype)


def _scaled_logits(
    states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    inv_temperature: float,
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """The model's logits divided by the temperature, `[n, vocab]` in float32 (or wider), from the projections
    `states @ weight.T + bias`, and their derivative with respect to the projections before the temperature (a
    tensor with a soft cap, else the scale). One float32 tensor: the projections' own where they are float32."""
    wide = _wide(nn.functional.linear(states, weight, bias))
    if softcap is None:
        return wide.mul_(scale * inv_temperature), scale
    capped = wide.mul_(scale / softcap).tanh_()
    slope = (1 - capped.square()) * scale
    return capped.mul_(softcap * inv_temperature), slope


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
            statistics(states[part], weight, bias, labels[part], *ctx_transform, inv, calc_entropy)
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
            g_ent = None if grad_entropy is None else grad_entropy[part]
            args = (labels[part], lse[part], entropy[part], grad_log_prob[part], g_ent, *ctx.transform, ctx.inv)
            grad = logit_grad(states[part], weight, bias, *args)
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
    chunk: int | None = None,
    transform: LogitTransform = PLAIN_LOGITS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `labels` `[tokens]` under `softmax(logits / temperature)` from hidden `states` `[tokens, hidden]`
    and the output projection `weight` `[vocab, hidden]`, the logits being `states @ weight.T + bias` under the
    model's `transform` (scale, soft cap); and the entropy `[tokens]` when `calc_entropy` (else None). Both float32
    (float64 for float64 inputs) and differentiable. `chunk` tokens at a time (None: `logit_chunk`'s)."""
    if states.shape[0] == 0:  # still part of the graph, so that a backward pass through it runs
        empty = states.sum(-1).float()
        return empty, (empty if calc_entropy else None)
    chunk = chunk or logit_chunk(weight.shape[0], states.device.type)
    log_prob, entropy = _TokenLogProbs.apply(states, labels, weight, bias, transform, temperature, calc_entropy, chunk)
    return log_prob, entropy if calc_entropy else None
