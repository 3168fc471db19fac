"""Routing replay for mixtures of experts: record which experts each token was routed to, and route a forward by
given experts instead of its own choice.

Each MoE layer's choice is the `torch.topk` of `top_k` over a `[tokens, experts]` tensor that its router (or, where
the router module only computes the logits, its MoE block) computes: `ExpertRouting` runs those modules under a
`TorchFunctionMode` that sees that call, so it holds for any family whose router transformers records
(`architecture.router_outputs`), however the family scores its experts (softmax, sigmoid with a bias and groups).
Recorded, the call's indices are kept. Replayed, the call returns the given indices with the scores at them: the
family then weights and renormalises them as it always does, so the gate values are the router's own
probabilities of the replayed experts and the router's weights get their gradients through them.

The choices travel as `routed_experts` `[batch, seq, moe_layers, top_k]` in a small integer type
(`compact_dtype`), aligned with `input_ids`. A rollout never feeds a row's last token to the model, so it records
no experts there: replayed, that token routes by its own choice (`unrecorded_last`; given as -1); its experts
decide no log-prob (nothing attends to it), only its share of the load-balancing loss.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ketch.architecture import router, router_outputs, unrecorded_router

_TOPK = (torch.topk, torch.Tensor.topk)


def compact_dtype(experts: int) -> torch.dtype:
    """The smallest integer type that holds the indices of `experts` experts: uint8 up to 256, else int16."""
    return torch.uint8 if experts <= 256 else torch.int16


class _Choice(TorchFunctionMode):
    """Within one MoE layer's forward: sees its `topk` of `top_k` over `[tokens, experts]` scores, keeps the indices
    `[tokens, top_k]` in `chosen` and, with `given` `[tokens, top_k]`, returns those (and the scores at them); a
    token whose given experts are -1 keeps its own."""

    def __init__(self, experts: int, top_k: int, given: torch.Tensor | None):
        super().__init__()
        self.experts, self.top_k, self.given, self.chosen = experts, top_k, given, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _TOPK or not self._picks(*args, **kwargs):
            return out
        self.chosen = out.indices
        if self.given is None:
            return out
        scores = args[0]
        if self.given.shape != out.indices.shape:
            raise ValueError(f"routing replay: experts {tuple(self.given.shape)} given for {tuple(scores.shape)}")
        index = self.given.to(scores.device, torch.long)
        index = torch.where(index < 0, out.indices, index)
        return torch.return_types.topk((scores.gather(-1, index), index))

    def _picks(self, scores: torch.Tensor, k: int, dim: int = -1, *_, **__) -> bool:
        """Whether this `topk(scores, k, dim)` picks each token's experts."""
        return scores.dim() == 2 and scores.shape[-1] == self.experts and k == self.top_k and dim in (-1, 1)


class ExpertRouting:
    """The MoE layers of a HF causal LM (`architecture.router_outputs`), each wrapped while `attach`ed (or inside
    `with`): every forward leaves each layer's choice in `chosen()`, and a forward after `replay(given)` routes by
    `given`. `experts` and `top_k` are the model's; `layers` its MoE layers."""

    def __init__(self, model: nn.Module):
        config = router(model.config)
        found = list(dict.fromkeys(module for module, _ in router_outputs(model)))
        if problem := unrecorded_router(model):
            raise ValueError(f"routing replay: {problem}: upgrade transformers, or set actor.router_replay=off")
        if config is None or not found:
            raise ValueError(f"routing replay: {type(model).__name__} is not a mixture of experts")
        self.top_k, self.experts = config.top_k, found[0].weight.shape[0]
        parents = {module: parent for parent in model.modules() for module in parent.children()}
        self.modules = [m if self._chooses(m) else parents[m] for m in found]
        self.layers = len(self.modules)
        self.given: torch.Tensor | None = None
        self._chosen: list[torch.Tensor | None] = [None] * self.layers
        self._forwards: list[tuple[nn.Module, object]] = []

    def _chooses(self, module: nn.Module) -> bool:
        """Whether `module` (a router) picks the experts itself, rather than only computing their logits: seen on
        one token of zeros."""
        weight = module.weight
        mode = _Choice(self.experts, self.top_k, None)
        with torch.no_grad(), mode:
            type(module).forward(module, torch.zeros(1, weight.shape[-1], dtype=weight.dtype, device=weight.device))
        return mode.chosen is not None

    def attach(self) -> ExpertRouting:
        """Wrap each MoE layer's forward (once)."""
        if not self._forwards:
            for layer, module in enumerate(self.modules):
                self._forwards.append((module, module.__dict__.get("forward")))
                module.forward = partial(self._forward, layer, module.forward)
        return self

    def detach(self) -> None:
        """Give each MoE layer its forward back."""
        for module, forward in self._forwards:
            del module.forward
            if forward is not None:
                module.forward = forward
        self._forwards = []

    def __enter__(self) -> ExpertRouting:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _forward(self, layer: int, forward, *args, **kwargs):
        given = None if self.given is None else self.given[:, layer]
        mode = _Choice(self.experts, self.top_k, given)
        with mode:
            out = forward(*args, **kwargs)
        if mode.chosen is None:
            raise RuntimeError(f"routing replay: MoE layer {layer} ({type(self.modules[layer]).__name__}) chose none")
        self._chosen[layer] = mode.chosen
        return out

    def replay(self, given: torch.Tensor | None) -> None:
        """Route the next forwards by `given` `[tokens, layers, top_k]` (in the order the layers see the tokens),
        or by their own choice (None). It holds until the next call, so that a block recomputed in the backward
        pass (gradient checkpointing) routes as its forward did."""
        self.given = given

    def chosen(self) -> torch.Tensor:
        """The experts of the last forward: its own choice, not the replayed one, `[tokens, layers, top_k]` in
        `compact_dtype`."""
        return torch.stack(self._chosen, dim=1).to(compact_dtype(self.experts))


def unrecorded_last(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last real token, which a rollout does not feed to the model (it records no experts there):
    bool `[batch, seq]`."""
    mask = attention_mask.bool()
    last = mask.shape[-1] - 1 - mask.flip(-1).int().argmax(-1)
    marked = torch.zeros_like(mask)
    marked[torch.arange(len(last), device=mask.device), last] = True
    return marked


def differing(own: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """Where a token's experts, as a set, differ in some layer: `own` and `given` `[..., layers, top_k]` -> bool
    `[...]`."""
    own, given = (t.long().sort(-1).values for t in (own, given))
    return (own != given).flatten(-2).any(-1)
