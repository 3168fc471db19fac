"""The `hf` rollout backend: `model.generate` (or the static decoder) on a copy of the policy in this process,
whole or, with `rollout.tensor_parallel_size` > 1, this rank's tensor-parallel shard of it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn
from transformers import GenerationConfig, StoppingCriteriaList

from ketch.architecture import decoder_blocks, is_vision_model, static_decoding_problem
from ketch.config.schema import KetchConfig
from ketch.models import load_causal_lm, stop_token_ids
from ketch.models.batch_invariant import label_log_probs, make_batch_invariant
from ketch.models.mrope import continued_positions, has_mrope, rope_positions
from ketch.models.router_replay import ExpertRouting
from ketch.models.vision import image_model_inputs, placeholder_token_ids
from ketch.protocol import DataProto
from ketch.rollout.base import Rollout, call_limits, call_sampling, register_rollout, rollout_output
from ketch.rollout.exact_decoding import ExactDecoder
from ketch.rollout.fp8 import FP8Projections
from ketch.rollout.group_stop import GroupStop, GroupStopCriteria
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder
from ketch.rollout.tensor_parallel import TensorParallel, same_random_numbers

logger = logging.getLogger("ketch.rollout")


@register_rollout("hf")
class HFRollout(Rollout):
    """Generates with transformers' `generate`; returns the sampled tokens' log-probs too."""

    def __init__(
        self, config: KetchConfig, model_path: str, tokenizer, dtype: torch.dtype, device: torch.device, seed: int
    ):
        m = config.model
        model = load_causal_lm(model_path, dtype, m.attn_implementation, m.trust_remote_code, m.override_config)
        if config.rollout.exact_log_probs:  # the ops of the actor's training forward (`ketch.engine.heads`)
            make_batch_invariant(model)
        size = config.rollout.tensor_parallel_size
        self.tp = TensorParallel(size) if size > 1 else None
        self.model = self.tp.shard_model(model, device) if self.tp else model.to(device).eval()
        if config.rollout.free_memory_while_training:
            _own_weight_memory(self.model)
        self.config = config.rollout
        self.max_response_length = config.data.max_response_length
        self.tokenizer, self.pad_token_id = tokenizer, tokenizer.pad_token_id
        self.stop_token_ids = stop_token_ids(tokenizer, model_path, config.rollout.stop_token_ids)
        self.never_sampled = placeholder_token_ids(self.model.config)
        decoding = config.rollout.hf_decoding
        static = decoding == "static" or (decoding == "auto" and device.type == "cuda")
        if static and (problem := static_decoding_problem(self.model)):
            if config.rollout.kv_cache_dtype == "fp8":
                raise ValueError(
                    f"rollout.kv_cache_dtype=fp8 is the static decoder's cache, and {type(self.model).__name__} "
                    f"decodes with generate ({problem}): set rollout.kv_cache_dtype=auto"
                )
            logger.info("%s decodes with generate, not the static decoder: %s", type(self.model).__name__, problem)
            static = False
        compiled = device.type == "cuda"
        longest = config.data.max_prompt_length
        settings = {"longest_prompt": longest, "never_sampled": self.never_sampled}
        settings["kv_dtype"] = torch.float8_e4m3fn if config.rollout.kv_cache_dtype == "fp8" else None
        decoder = ExactDecoder if config.rollout.exact_log_probs else StaticDecoder  # the training forward's ops
        self.decoder = decoder(self.model, compiled, **settings) if static else None
        fp8 = config.rollout.quantization == "fp8"
        self.fp8 = FP8Projections(decoder_blocks(self.model)) if fp8 else None
        self.routing = ExpertRouting(self.model).attach() if config.actor.router_replay != "off" else None
        if self.decoder is not None:
            self.decoder.routing = self.routing
        self.dropped: list[tuple[torch.UntypedStorage, int]] = []
        self.shared: set[str] = set()
        """The weights read in place from the trainer's tensors (`share_weights`)."""

    @torch.no_grad()
    def generate(self, prompts: DataProto) -> DataProto:
        """See `Rollout.generate`; with `actor.router_replay`, also `routed_experts` `[batch, prompt_len +
        response_len, moe_layers, top_k]`: the experts of every token fed to the model (`ketch.models.router_replay`;
        zeros at padding and at each response's last token). A Qwen vision-language model's `position_ids` are its
        multimodal rotary positions `[batch, 3, prompt_len + response_len]` (`ketch.models.mrope`), computed once
        here for the decoding and every training forward after it."""
        prompts = self._with_rope_positions(prompts)
        *decoded, rows = self._decode_together(prompts, self._decode)
        if rows is not None:
            decoded = [values[rows] for values in decoded]
        stops = None if self.config.ignore_eos else self.stop_token_ids
        prompts = prompts.to(decoded[0].device)
        responses, log_probs, cut_at = decoded[:3]
        out = rollout_output(prompts, responses, log_probs, stops, self.pad_token_id, cut_at)
        if (positions := _rope_positions(prompts)) is not None:
            out.batch["position_ids"] = continued_positions(positions, out.batch["attention_mask"])
        if self.routing is not None:
            out.batch["routed_experts"] = decoded[3]
        return out

    def _with_rope_positions(self, prompts: DataProto) -> DataProto:
        """`prompts` with a Qwen vision-language model's multimodal rotary positions as `position_ids` `[batch, 3,
        prompt_len]`, from its rows' images (`multi_modal_inputs`); other models' prompts as they are."""
        if not is_vision_model(self.model.config) or not has_mrope(self.model.model):
            return prompts
        b = prompts.batch
        rows = prompts.non_tensor_batch.get("multi_modal_inputs")
        positions = rope_positions(self.model.model, b["input_ids"], b["attention_mask"], rows)
        return DataProto(dict(b) | {"position_ids": positions}, prompts.non_tensor_batch, prompts.meta_info)

    @torch.no_grad()
    def warm_up(self, prompts: DataProto) -> None:
        """With a compiled static decoder: two tokens for `prompts`, which load (or compile) the decode step of
        their shape and capture it, as the first `generate` of that shape would."""
        if self.decoder is not None and (self.decoder.compiled or self.decoder.capture):
            self._decode_together(prompts, partial(self._decode, stop_after=2))

    def _decode_together(self, prompts: DataProto, decode) -> tuple:
        """`decode(prompts)` on this rank's device, then the rows of this rank (None: all). With tensor parallelism,
        the group decodes the prompts of all its ranks together (the same random numbers on each), and the rows of
        this rank's own are returned too."""
        device = next(self.model.parameters()).device
        if self.tp is None:
            return *decode(prompts.to(device)), None
        together, rows, seed = self.tp.group_prompts(prompts, self.pad_token_id)
        with same_random_numbers(seed, device):
            return *decode(together.to(device)), rows

    def _decode(self, prompts: DataProto, stop_after: int | None = None) -> tuple[torch.Tensor, ...]:
        """`responses` and their log-probs `[batch, max_response_length]`, each row's tokens where a group stop cut
        it (`cut_at` `[batch]`, `max_response_length` where none did; `StaticDecoder.generate`), and with `routing`,
        the experts `[batch, prompt_len + max_response_length, moe_layers, top_k]`, decoded in sub-batches of
        `rows_per_batch` rows; `stop_after`: see `StaticDecoder`."""
        rows = rows_per_batch(
            self.config.max_num_batched_tokens, prompts.batch["input_ids"].shape[-1], self.max_response_length
        )
        if rows is None or rows >= len(prompts):
            return self._decode_batch(prompts, stop_after)
        parts = [self._decode_batch(part, stop_after) for part in prompts.split(rows)]
        return tuple(torch.cat(outputs) for outputs in zip(*parts, strict=True))

    def _decode_batch(self, prompts: DataProto, stop_after: int | None) -> tuple[torch.Tensor, ...]:
        do_sample, temperature = call_sampling(prompts, self.config)
        limits = call_limits(prompts, self.max_response_length)
        if self.decoder is None:
            return self._decode_generate(prompts, do_sample, temperature, *limits)
        return self._decode_static(prompts, do_sample, temperature, min(stop_after or limits[0], limits[0]))

    def _decode_generate(self, prompts: DataProto, do_sample: bool, temperature: float, max_new: int, stop: list[str]):
        prompt_ids, forwards = prompts.batch["input_ids"], []
        images = prompts.non_tensor_batch.get("multi_modal_inputs", ())
        group_stop = GroupStop.of(prompts)
        criteria = None
        if group_stop is not None and not self.config.ignore_eos:
            group_stop = group_stop.to(prompt_ids.device)
            criteria = GroupStopCriteria(
                group_stop, prompt_ids.shape[-1], self.stop_token_ids, self.max_response_length
            )
        hook = None
        if self.routing is not None:
            hook = self.model.register_forward_hook(lambda *_: forwards.append(self.routing.chosen()))
        try:
            out = self.model.generate(
                input_ids=prompt_ids,
                attention_mask=prompts.batch["attention_mask"],
                generation_config=self._generation_config(do_sample, temperature, max_new, stop),
                tokenizer=self.tokenizer if stop else None,
                stopping_criteria=StoppingCriteriaList([criteria] if criteria else []),
                **image_model_inputs(self.model.config, prompt_ids, images),
            )
        finally:
            if hook is not None:
                hook.remove()
        responses = self._pad(out.sequences[:, prompt_ids.shape[-1] :])
        cut_at = criteria.cut_at if criteria else torch.full((len(responses),), self.max_response_length)
        decoded = responses, self._log_probs(out.logits, responses, temperature), cut_at.to(responses.device)
        return decoded if self.routing is None else (*decoded, self._generated_experts(forwards, prompt_ids.shape))

    def _generated_experts(self, forwards: list, shape: torch.Size) -> torch.Tensor:
        """The experts of `generate`'s forwards (`forwards`: each one's choices, taken by the hook that appended
        to it): the prompt's `[batch, prompt_len]` first, then one token a step, as `[batch, prompt_len +
        max_response_length, moe_layers, top_k]`."""
        experts = torch.cat([step.view(shape[0], -1, *step.shape[1:]) for step in forwards], dim=1)
        missing = shape[1] + self.max_response_length - experts.shape[1]
        return nn.functional.pad(experts, (0, 0, 0, 0, 0, missing))

    def _decode_static(self, prompts: DataProto, do_sample: bool, temperature: float, stop_after: int):
        """Decodes `stop_after` tokens (a call's `max_new_tokens`) or to a stop token, in the shape of
        `data.max_response_length` tokens (one length keeps the compiled shapes few), past a call's stop strings
        (the caller cuts there)."""
        r = self.config
        sampling = Sampling(do_sample, temperature, r.top_p, r.top_k)
        stops = None if r.ignore_eos else self.stop_token_ids
        b = prompts.batch
        args = (self.max_response_length, sampling, stops, self.pad_token_id, stop_after)
        images = prompts.non_tensor_batch.get("multi_modal_inputs")
        positions = _rope_positions(prompts)
        more = {"images": images, "positions": positions, "group_stop": GroupStop.of(prompts)}
        decoded = (*self.decoder.generate(b["input_ids"], b["attention_mask"], *args, **more), self.decoder.cut_at)
        return decoded if self.routing is None else (*decoded, self.decoder.routed_experts)

    def _generation_config(
        self, do_sample: bool, temperature: float, max_new: int, stop: list[str]
    ) -> GenerationConfig:
        sampling = {"temperature": temperature, "top_p": self.config.top_p, "top_k": self.config.top_k}
        return GenerationConfig(
            max_new_tokens=max_new,
            stop_strings=stop or None,
            do_sample=do_sample,
            **(sampling if do_sample else {}),
            eos_token_id=[] if self.config.ignore_eos else self.stop_token_ids,  # None: the model's own EOS
            pad_token_id=self.pad_token_id,
            suppress_tokens=self.never_sampled or None,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
        )

    def _pad(self, tokens: torch.Tensor) -> torch.Tensor:
        missing = self.max_response_length - tokens.shape[-1]
        return nn.functional.pad(tokens, (0, missing), value=self.pad_token_id) if missing else tokens

    def _log_probs(self, logits: tuple[torch.Tensor, ...], responses: torch.Tensor, temperature: float) -> torch.Tensor:
        """Log-probs `[batch, response_len]` of the sampled tokens under the raw logits / temperature."""
        stacked = torch.stack(logits, dim=1)
        log_probs, _ = label_log_probs(stacked, responses[:, : stacked.shape[1]], temperature)
        return self._pad_float(log_probs)

    def _pad_float(self, values: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(values, (0, self.max_response_length - values.shape[-1]))

    def weight_norm(self, name: str) -> float:
        return self.model.get_parameter(name).float().norm().item()

    @property
    def dropped_weights(self) -> bool:
        return bool(self.dropped)

    def sleep(self) -> None:
        """With `rollout.free_memory_while_training`: free the weights' memory (each storage resized to nothing,
        so the parameters, their fused views and tied names keep their objects) and the KV caches."""
        if not self.config.free_memory_while_training or self.dropped:
            return
        params = self.model.named_parameters()
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for n, p in params if n not in self.shared}
        self.dropped = [(storage, storage.nbytes()) for storage in storages.values()]
        for storage, _ in self.dropped:
            storage.resize_(0)
        if self.decoder is not None:
            self.decoder.release()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each full tensor (or, with tensor parallelism, this rank's shard of it) into the model; weights
        that `sleep` dropped get their memory back first (every one of them is then overwritten). With
        `rollout.quantization=fp8` the projections' FP8 copies are then made again from them."""
        for storage, size in self.dropped:
            storage.resize_(size)
        self.dropped = []
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            if name in self.shared:
                continue
            if name not in params:
                raise KeyError(f"hf rollout: the policy sent weight {name!r}, which the rollout model does not have")
            params[name].copy_(self.tp.shard(name, tensor) if self.tp else tensor)
        if self.fp8 is not None:
            self.fp8.refresh()

    @torch.no_grad()
    def share_weights(self, named_tensors: dict[str, torch.Tensor]) -> set[str]:
        """See `Rollout.share_weights`: a parameter named there reads the given tensor, and its own memory is freed,
        where the two match in shape, dtype and device and the parameter holds its memory alone (not a view of
        the static decoder's fused projections, which it computes with). Not with tensor parallelism (the rollout
        holds shards). Tied names follow their parameter."""
        if self.tp is not None:
            return set()
        for name, param in self.model.named_parameters(remove_duplicate=False):
            tensor = named_tensors.get(name)
            if tensor is None or not _same_kind(tensor, param):
                continue
            if param.data_ptr() != tensor.data_ptr() and _holds_its_memory_alone(param):
                param.data = tensor
            if param.data_ptr() == tensor.data_ptr():
                self.shared.add(name)
        if self.shared:
            size = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if n in self.shared)
            logger.info("hf rollout: %d weights (%.2f GiB) read in place", len(self.shared), size / 2**30)
        return self.shared


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)


def _holds_its_memory_alone(param: torch.Tensor) -> bool:
    return param.untyped_storage().nbytes() == param.numel() * param.element_size()


def rows_per_batch(max_num_batched_tokens: int | None, prompt_length: int, max_response_length: int) -> int | None:
    """Rows the hf rollout decodes together: as many whose prompt and longest response fit in
    `rollout.max_num_batched_tokens` tokens of KV cache (at least one); None (all of them) without it."""
    if max_num_batched_tokens is None:
        return None
    return max(1, max_num_batched_tokens // (prompt_length + max_response_length))


def _own_weight_memory(model: nn.Module) -> None:
    """Give weights that sit in memory the model does not own (a memory-mapped checkpoint file on the CPU) a copy
    of their own, which `HFRollout.sleep` can free and `update_weights` allocate again."""
    for param in model.parameters():
        if not param.untyped_storage().resizable():
            param.data = param.data.clone()


def _rope_positions(prompts: DataProto) -> torch.Tensor | None:
    """The prompts' multimodal rotary positions `[batch, 3, prompt_len]`, or None where they have none (text
    models' `position_ids` are `[batch, prompt_len]`, and a caller may give none)."""
    positions = prompts.batch.get("position_ids")
    return positions if positions is not None and positions.dim() == 3 else None
