"""The `vllm` rollout backend: vLLM's offline engine inside the actor's process (the hybrid engine).

The engine starts from the actor's model directory; after each actor update the new weights are streamed
into it in memory (one tensor at a time, gathered from the FSDP shards) and its prefix cache is reset. On
GPUs `sleep()` frees its KV cache and weights while the actor trains; the CPU build cannot, which is said
once. Internal vLLM APIs are used only through `ketch.rollout.vllm_adapter`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from ketch.config.schema import KetchConfig
from ketch.models import stop_token_ids
from ketch.protocol import DataProto
from ketch.rollout import vllm_adapter as adapter
from ketch.rollout.base import Rollout, call_limits, call_sampling, register_rollout, rollout_output
from ketch.rollout.group_stop import GroupStop

logger = logging.getLogger("ketch.rollout")

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@register_rollout("vllm")
class VLLMRollout(Rollout):
    def __init__(
        self, config: KetchConfig, model_path: str, tokenizer, dtype: torch.dtype, device: torch.device, seed: int
    ):
        adapter.check_version()
        r, d = config.rollout, config.data
        if r.tensor_parallel_size != 1:
            raise ValueError(
                f"rollout.tensor_parallel_size={r.tensor_parallel_size}: the in-memory weight hand-off needs the "
                "vLLM engine in the actor's process, which ketch supports for tensor_parallel_size=1 only"
            )
        self.config, self.max_response_length = r, d.max_response_length
        self.pad_token_id = tokenizer.pad_token_id
        self.stop_token_ids = stop_token_ids(tokenizer, model_path, r.stop_token_ids)
        self.sleeps = adapter.can_sleep(device)
        self.asleep = False
        settings = {
            "dtype": DTYPE_NAMES[dtype],
            "seed": seed,
            "max_model_len": r.max_model_len or d.max_prompt_length + d.max_response_length,
            "gpu_memory_utilization": r.gpu_memory_utilization,
            "max_num_seqs": r.max_num_seqs,
            "max_num_batched_tokens": r.max_num_batched_tokens,
            "enforce_eager": r.enforce_eager,
            "enable_prefix_caching": r.enable_prefix_caching,
            "trust_remote_code": config.model.trust_remote_code,
            "enable_sleep_mode": self.sleeps,
        } | ({"quantization": "fp8"} if r.quantization == "fp8" else {})
        settings |= {"kv_cache_dtype": "fp8"} if r.kv_cache_dtype == "fp8" else {}
        tokenizer_path = config.model.tokenizer_path or model_path
        self.engine = adapter.create_engine(model_path, tokenizer_path, settings)
        if not self.sleeps:
            logger.info("vLLM on %s cannot free its memory between generations; sleep/wake_up do nothing", device)

    @torch.no_grad()
    def generate(self, prompts: DataProto) -> DataProto:
        """See `Rollout.generate`; with a group stop (`ketch.rollout.group_stop`) the engine runs one step at a time
        and the requests still running are aborted once enough groups are finished."""
        do_sample, temperature = call_sampling(prompts, self.config)
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        requests = adapter.token_prompts([row[keep].tolist() for row, keep in zip(ids, mask, strict=True)])
        settings = self._sampling(do_sample, temperature, *call_limits(prompts, self.max_response_length))
        group_stop = GroupStop.of(prompts)
        if group_stop is None:
            outputs = self.engine.generate(requests, adapter.sampling_params(**settings), use_tqdm=False)
            samples, aborted = [out.outputs[0] for out in outputs], [False] * len(outputs)
        else:
            samples, aborted = adapter.generate_until(self.engine, requests, settings, _stop_rule(group_stop))
        tokens = [[] if s is None else s.token_ids for s in samples]
        responses = self._pad(tokens, self.pad_token_id, torch.long)
        log_probs = self._pad(
            [[lp[t].logprob for t, lp in zip(s.token_ids, s.logprobs, strict=True)] if s else [] for s in samples]
        )
        cut_at = torch.where(torch.tensor(aborted), torch.tensor([len(t) for t in tokens]), self.max_response_length)
        stops = None if self.config.ignore_eos else self.stop_token_ids
        return rollout_output(prompts, responses, log_probs, stops, self.pad_token_id, cut_at)

    def _sampling(self, do_sample: bool, temperature: float, max_new: int, stop: list[str]) -> dict:
        """vLLM's sampling settings; stop strings need its detokenizer (kept in the output, as sampled)."""
        r = self.config
        stop_settings = {"stop": stop, "include_stop_str_in_output": True} if stop else {}
        return dict(
            n=1,
            temperature=temperature if do_sample else 0.0,
            top_p=r.top_p if do_sample else 1.0,
            top_k=r.top_k if do_sample else 0,
            max_tokens=max_new,
            stop_token_ids=[] if r.ignore_eos else self.stop_token_ids,
            ignore_eos=r.ignore_eos,
            logprobs=0,
            detokenize=bool(stop),
            **stop_settings,
        )

    def _pad(self, rows: list, value: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Right-pad ragged rows to `[batch, max_response_length]`."""
        tensors = [torch.tensor(list(row), dtype=dtype) for row in rows]
        return torch.stack([nn.functional.pad(t, (0, self.max_response_length - len(t)), value=value) for t in tensors])

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's loaders may hold a tensor after drawing the next one, so each is cloned (see `Rollout`)."""
        self.wake_up()
        adapter.reload_weights(self.engine, ((name, tensor.clone()) for name, tensor in named_tensors))

    def weight_norm(self, name: str) -> float:
        return adapter.parameter_norm(self.engine, name)

    def sleep(self) -> None:
        if self.sleeps and not self.asleep:
            self.engine.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.engine.wake_up()
            self.asleep = False


def _stop_rule(group_stop: GroupStop):
    """`finished` (a bool per request) -> whether `group_stop` lets the call stop now."""
    return lambda finished: group_stop.reached(
        torch.tensor([i for i, done in enumerate(finished) if not done], dtype=torch.long)
    )
