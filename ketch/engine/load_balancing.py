"""The load-balancing loss of a mixture-of-experts router (Switch Transformer, Fedus et al. 2021, eq. 4; the
auxiliary loss of Mixtral, Qwen-MoE and OLMoE): the number of experts times the sum, over experts and over each
token's k choices, of the share of the choices that go to the expert times the mean routing probability it gets.
It is k when the choices and the probabilities spread evenly over the experts, and up to k times the number of
experts when every token picks the same ones."""

from __future__ import annotations

import torch


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """The loss over every layer's router logits `[tokens, experts]` taken together (as transformers' MoE models
    compute it), where each token picks its `top_k` most probable experts; a float32 scalar."""
    logits = torch.cat(router_logits).float()
    experts = logits.shape[-1]
    probs = logits.softmax(-1)
    chosen = probs.topk(top_k, dim=-1).indices
    choice_share = torch.nn.functional.one_hot(chosen, experts).float().mean(0)  # [top_k, experts]
    return (choice_share * probs.mean(0)).sum() * experts
