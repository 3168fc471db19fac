"""Forward wrappers that turn a HF model into what RL needs: per-token log-probs/entropy, values, or one
score per sequence (reward models).

Each wrapper is the root module that FSDP shards, so that the whole computation, including the output
projection, happens inside one root forward (where FSDP has the parameters gathered). Positions are
aligned so that output `[:, t]` scores response token t from the hidden state just before it.

With `packed`, the backbone runs padding-free on the real tokens only (`ketch.engine.packing`); outputs are
the same, zeros at padding. Given `host_attention_mask`, the attention mask on the host, the heads find the
real tokens from it: on the GPU, finding them would wait for all work queued before. With a `sequence_parallel`
group (set by the engine), the policy and value heads run packed on this rank's share of the tokens
(`ketch.engine.sequence_parallel`).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from ketch.architecture import decoder, is_vision_model, logit_transform, router, router_outputs, unrecorded_router
from ketch.determinism import disable_dropout, keep_in_eval
from ketch.engine.fused_log_probs import token_log_probs
from ketch.engine.load_balancing import load_balancing_loss
from ketch.engine.packing import Packing, backbone_hidden, packs, to_device, use_packed_attention
from ketch.engine.sequence_parallel import sharded_states
from ketch.engine.vision_forward import vision_hidden
from ketch.models.batch_invariant import label_log_probs, make_batch_invariant
from ketch.models.router_replay import ExpertRouting, differing, unrecorded_last

logger = logging.getLogger("ketch.engine")
_SAID: set[str] = set()
"""The mixtures of experts whose unrecorded router logits have been logged in this process."""


class _Deterministic(nn.Module):
    """A head whose model computes in training mode what it computes in eval mode (`disable_dropout`): the modules in
    `eval_only` stay in eval mode whatever `train()` is called with."""

    eval_only: list[nn.Module]

    def train(self, mode: bool = True) -> _Deterministic:
        super().train(mode)
        keep_in_eval(self.eval_only)
        return self


class PolicyModel(_Deterministic):
    """A causal LM that returns log-probs (and entropy) of given response tokens. With `route_experts`, a mixture of
    experts keeps each token's experts, and routes by given ones where asked (`ketch.models.router_replay`). With
    `batch_invariant`, the model computes batch-invariantly and the log-probs come from its output projection's
    logits, one log-softmax per token, as the rollout computes them (`rollout.exact_log_probs`)."""

    def __init__(self, lm: nn.Module, packed: bool = False, route_experts: bool = False, batch_invariant: bool = False):
        super().__init__()
        self.eval_only = disable_dropout(lm)
        self.lm, self.packed, self.sequence_parallel = lm, packs(lm, packed), None
        self.batch_invariant = batch_invariant
        if batch_invariant:
            make_batch_invariant(lm)
        self.transform, self.router_logits = logit_transform(lm.config), []
        routers = router_outputs(lm)
        self.router = router(lm.config) if routers else None
        if (problem := unrecorded_router(lm)) and problem not in _SAID:
            _SAID.add(problem)
            logger.warning("%s: it trains without the router's auxiliary loss", problem)
        for module, index in routers:  # hooks, traced into compiled blocks (transformers' own capture is not)
            module.register_forward_hook(partial(_record, self.router_logits, index))
        self.routing = ExpertRouting(lm).attach() if route_experts else None
        if self.packed:  # a vision-language model's language model only: its vision encoder is no causal LM
            use_packed_attention(decoder(lm) if is_vision_model(lm.config) else lm)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_len: int,
        temperature: float = 1.0,
        calc_entropy: bool = False,
        host_attention_mask: torch.Tensor | None = None,
        given_experts: torch.Tensor | None = None,
        replay: bool = False,
        return_experts: bool = False,
        image_inputs: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Inputs `[batch, seq]` (prompt then response); returns `log_prob` (and `entropy`) `[batch, response_len]`
        in float32, for logits divided by `temperature` as in sampling; 0 at response padding (attention_mask 0),
        where the output projection is not computed. A mixture of experts also returns, where gradients are taken,
        its router's load-balancing loss over the real tokens, `router_aux_loss` (a float32 scalar).

        With `route_experts`: `given_experts` `[batch, seq, moe_layers, top_k]` are routed to with `replay`, and
        `router_mismatch` `[batch, response_len]` is 1.0 where the token before a response token (whose hidden state
        scores it) chose other experts in some layer than given; `return_experts` returns the forward's own choice
        as `routed_experts` `[batch, seq, moe_layers, top_k]` (zeros at padding).

        A vision-language model runs whole (vision encoder and language model; `ketch.engine.vision_forward`) with
        `image_inputs` (the batch's images, `ketch.models.vision.image_model_inputs`; None or empty: none) and, for
        the Qwen families, the multimodal rotary positions `position_ids` `[batch, 3, seq]` the rollout carried
        (`[batch, seq]`: the model computes them from the tokens and the attention mask, as its `generate` does)."""
        host = attention_mask if host_attention_mask is None else host_attention_mask
        self.router_logits.clear()
        tokens = self._route(given_experts if replay else None, host, input_ids.device)
        backbone = decoder(self.lm)
        if self.sequence_parallel is not None:
            args = (input_ids, position_ids, host, response_len, self.sequence_parallel)
            states, labels, place = sharded_states(backbone, *args)
        else:
            if is_vision_model(self.lm.config):
                images = image_inputs or {}
                hidden = vision_hidden(self.lm, input_ids, attention_mask, position_ids, images, self.packed, host)
            else:
                hidden = backbone_hidden(backbone, input_ids, attention_mask, position_ids, self.packed, host)
            valid = tuple(to_device(i, input_ids.device) for i in host[:, -response_len:].nonzero(as_tuple=True))
            states = hidden[:, -response_len - 1 : -1][valid]
            labels = input_ids[:, -response_len:][valid]
            place = partial(_place, valid, (input_ids.shape[0], response_len))
        head = self.lm.get_output_embeddings()
        if self.batch_invariant:
            log_prob, entropy = label_log_probs(head(states), labels, temperature, calc_entropy)
        else:
            log_prob, entropy = token_log_probs(
                states, labels, head.weight, head.bias, temperature, calc_entropy, transform=self.transform
            )
        out = {"log_prob": place(log_prob)}
        if calc_entropy:
            out["entropy"] = place(entropy)
        if self.router is not None and torch.is_grad_enabled():
            out["router_aux_loss"] = self._router_aux_loss(host, input_ids.device)
        self.router_logits.clear()
        if tokens is not None:
            out |= self._routing_outputs(tokens, given_experts, host, response_len, return_experts)
        return out

    def _route(self, given: torch.Tensor | None, host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """With `route_experts`: route the next forward by `given` `[batch, seq, moe_layers, top_k]` (None: by its
        own choice; each row's last real token always by its own); returns where the forward's tokens sit in
        `[batch * seq]` (`[tokens]`)."""
        if self.routing is None:
            return None
        tokens = Packing.from_mask(host, device).index if self.packed else torch.arange(host.numel(), device=device)
        if given is not None:
            given = given.flatten(0, 1)[tokens].to(torch.int16)  # -1: the token routes by its own choice
            given[unrecorded_last(host).flatten().to(device)[tokens]] = -1
        self.routing.replay(given)
        return tokens

    def _routing_outputs(self, tokens, given, host, response_len: int, return_experts: bool) -> dict:
        """`router_mismatch` and `routed_experts` (see `forward`) from the choices of the forward just run, whose
        tokens sit at `tokens` `[tokens]` of `[batch * seq]`."""
        chosen = self.routing.chosen()
        own = chosen.new_zeros(host.numel(), *chosen.shape[1:]).index_copy(0, tokens, chosen)
        own = own.view(*host.shape, *chosen.shape[1:])
        out = {"routed_experts": own} if return_experts else {}
        if given is not None:
            mask = to_device(host[:, -response_len:], own.device)
            out["router_mismatch"] = differing(own, given)[:, -response_len - 1 : -1].float() * mask
        return out

    def _router_aux_loss(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The router's load-balancing loss over the real tokens of the forward just run."""
        logits = tuple(self.router_logits)
        if not self.packed:  # padded: the logits of every position, padding included
            index = Packing.from_mask(host, device).index
            logits = tuple(layer[index] for layer in logits)
        return load_balancing_loss(logits, self.router.top_k)


def _place(valid: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int], values: torch.Tensor) -> torch.Tensor:
    """Per-token `values` put at the `valid` positions of `shape` `[batch, response_len]` zeros: a fresh tensor, not a
    view, so that FSDP's backward hook on a root output is not bypassed."""
    return torch.zeros(shape, dtype=torch.float32, device=values.device).index_put(valid, values)


def _record(records: list[torch.Tensor], index: int, _module, _inputs, output) -> None:
    """A forward hook: append a router's logits `[tokens, experts]` (its output, or item `index` of it) to
    `records`."""
    records.append(output[index] if isinstance(output, tuple) else output)


class ValueModel(_Deterministic):
    """A backbone with a scalar head (`*ForTokenClassification`, one label; a vision-language model's
    `ketch.models.vision_critic.VisionTokenClassifier`) that returns per-token values."""

    def __init__(self, critic: nn.Module, packed: bool = False):
        super().__init__()
        self.eval_only = disable_dropout(critic)
        self.critic, self.packed, self.sequence_parallel = critic, packs(critic, packed), None
        # the head stays reachable only through `critic`: a second reference would duplicate its state-dict keys
        self.head_name = next(
            (n for n in ("score", "classifier") if isinstance(getattr(critic, n, None), nn.Linear)), None
        )
        if self.head_name is None:
            raise TypeError(f"{type(critic).__name__} has no linear `score` or `classifier` head to read values from")
        if self.packed:  # a vision-language model's language model only, as the policy's
            use_packed_attention(decoder(critic) if is_vision_model(critic.config) else critic)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_len: int,
        host_attention_mask: torch.Tensor | None = None,
        image_inputs: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Inputs `[batch, seq]`; returns `values` `[batch, response_len]` in float32. A vision-language model's
        backbone reads the images and positions as `PolicyModel`'s does (`image_inputs`; `position_ids` `[batch, 3,
        seq]` where the rollout carried them)."""
        dropout, head = getattr(self.critic, "dropout", nn.Identity()), getattr(self.critic, self.head_name)
        host = attention_mask if host_attention_mask is None else host_attention_mask
        if self.sequence_parallel is not None:  # zeros where the token before is padding (the critic masks them)
            args = (input_ids, position_ids, host, response_len, self.sequence_parallel)
            states, _, place = sharded_states(self.critic.base_model, *args, real_only=False)
            return {"values": place(head(dropout(states))[..., 0])}
        if is_vision_model(self.critic.config):
            args = (input_ids, attention_mask, position_ids, image_inputs or {}, self.packed, host)
            hidden = vision_hidden(self.critic, *args)
        else:
            hidden = backbone_hidden(self.critic.base_model, input_ids, attention_mask, position_ids, self.packed, host)
        values = head(dropout(hidden[:, -response_len - 1 : -1]))[..., 0]
        return {"values": values.float().clone()}


class ScoreModel(_Deterministic):
    """A backbone with a scalar head (`*ForSequenceClassification`, one label, head named `score`) that returns
    one score per sequence, read from the hidden state of its last token with attention_mask 1. The
    position comes from the mask, not from the model's pad-token rule, so it is right for left-padded
    prompts, right-padded responses and any pad id."""

    def __init__(self, reward_model: nn.Module, packed: bool = False):
        super().__init__()
        if not isinstance(getattr(reward_model, "score", None), nn.Linear):
            raise TypeError(
                f"{type(reward_model).__name__} has no linear `score` head; a reward model must be a "
                "*ForSequenceClassification model of a decoder architecture (Llama, Qwen2, Mistral, GPT-2, ...)"
            )
        self.eval_only = disable_dropout(reward_model)
        self.reward_model, self.packed = reward_model, packs(reward_model, packed)
        if self.packed:
            use_packed_attention(reward_model)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_len: int,
        host_attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Inputs `[batch, seq]`; returns `scores` `[batch]` in float32 (`response_len`, given by the engine to
        every head, is not needed)."""
        hidden = backbone_hidden(
            self.reward_model.base_model, input_ids, attention_mask, position_ids, self.packed, host_attention_mask
        )
        positions = torch.arange(1, attention_mask.shape[-1] + 1, device=attention_mask.device)
        last = ((attention_mask != 0) * positions).amax(dim=-1).clamp(min=1) - 1
        states = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return {"scores": self.reward_model.score(states).squeeze(-1).float().clone()}
