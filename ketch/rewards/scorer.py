"""`RewardScorer`: decode a rollout batch, score each response, put the score on its last response token."""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from ketch.protocol import DataProto, object_array
from ketch.rewards.custom import load_reward_function
from ketch.rewards.registry import UnknownDataSourceError, scorer_for

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("ketch.rewards")

REQUIRED_COLUMNS = ("data_source", "ground_truth")
TOOL_COUNTS = ("tool_calls", "tool_errors")
"""A multi-turn trajectory's tool calls and failed calls, which scorers see in `extra_info` (with `messages`)."""


class RewardError(RuntimeError):
    """A scorer raised or returned a non-finite/invalid score for a sample (reward.on_error=raise)."""


class RewardScorer:
    """Token-level scores of a batch from `reward.function` (a `path.py:fn` spec) or the registered scorers.

    on_error="raise" stops at the first failing sample with a `RewardError`; "zero" scores it 0, logs each
    distinct error once on the `ketch.rewards` logger and counts it in `info["num_errors"]`. `scorer_kwargs`
    maps a data source to keyword arguments for the function that scores its samples (`reward.scorer_kwargs`).
    The trainers build it before any model loads, so that a broken function fails first, with `tokenizer=None`,
    and set `tokenizer` (which decodes the responses) once it has loaded.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        function: str | None = None,
        on_error: Literal["raise", "zero"] = "raise",
        scorer_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        if on_error not in ("raise", "zero"):
            raise ValueError(f"reward.on_error must be 'raise' or 'zero', got {on_error!r}")
        self.tokenizer = tokenizer
        self.function = function
        self.on_error = on_error
        self._user_fn = load_reward_function(function) if function else None
        self._logged: set[tuple[str, str]] = set()
        self.scorer_kwargs = scorer_kwargs or {}
        for source, kwargs in self.scorer_kwargs.items():
            _check_kwargs(self._user_fn or scorer_for(source), source, kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # A user function lives in a module other processes cannot import: they reload it from the spec.
        return self.__dict__ | {"_user_fn": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.function:
            self._user_fn = load_reward_function(self.function)

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, Any]]:
        """Score `data` (batch: responses, response_mask `[batch, response_len]`; non_tensor: data_source,
        ground_truth, optional extra_info). A multi-turn trajectory is scored whole: the text is every response
        token the attention mask covers (tool results too), and extra_info gains `messages` (the conversation),
        `env_reward` (the environment's reward, NaN if none) and `TOOL_COUNTS`.

        Returns `token_level_scores` `[batch, response_len]` float32, zero except the score at each row's last
        mask==1 position, and info: `scores` np.float64 `[batch]`, `response_texts` list[str], `extra` {field:
        np array `[batch]`} of the extra dict fields (NaN where missing), `num_errors` int.
        """
        responses, mask = _response_tensors(data)
        sources, truths, extra_infos = _columns(data)
        last = _last_valid_index(mask)
        scorers = self._resolve_scorers(sources)
        shown = _trajectory_mask(data, mask).bool().cpu()
        token_ids = [row[valid].tolist() for row, valid in zip(responses.cpu(), shown, strict=True)]
        texts = decode_rows(self.tokenizer, token_ids)
        scores = np.zeros(len(texts), dtype=np.float64)
        extras: list[dict[str, Any]] = [{} for _ in texts]
        num_errors = 0
        for i, (fn, name) in enumerate(scorers):
            try:
                kwargs = self.scorer_kwargs.get(sources[i], {})
                scores[i], extras[i] = _score_one(fn, sources[i], texts[i], truths[i], extra_infos[i], kwargs)
            except Exception as exc:
                self._fail(exc, i, name, _sample(data, i, texts[i]))
                num_errors += 1
        token_level_scores = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        token_level_scores[torch.arange(len(texts), device=responses.device), last] = torch.as_tensor(
            scores, dtype=torch.float32, device=responses.device
        )
        info = {"scores": scores, "response_texts": texts, "extra": _stack_extras(extras), "num_errors": num_errors}
        return token_level_scores, info

    def _resolve_scorers(self, sources: Sequence[str]) -> list[tuple[Callable, str]]:
        """(scorer, name) per sample; an unknown data source fails here, whatever on_error says."""
        if self._user_fn is not None:
            return [(self._user_fn, f"reward.function={self.function}")] * len(sources)
        resolved: list[tuple[Callable, str]] = []
        for i, source in enumerate(sources):
            try:
                fn = scorer_for(source)
            except UnknownDataSourceError as exc:
                raise UnknownDataSourceError(f"sample {i}: {exc}") from None
            resolved.append((fn, f"{fn.__module__}.{fn.__qualname__}"))
        return resolved

    def _fail(self, exc: Exception, index: int, name: str, sample: dict[str, Any]) -> None:
        """Raise a `RewardError` (on_error=raise) or log the error once per distinct message (on_error=zero).
        `sample` (from `_sample`) says where the sample comes from and what it holds."""
        where = f"reward scorer {name} failed on sample {index} (data_source={sample['data_source']!r})"
        message = f"{type(exc).__name__}: {exc}"
        if self.on_error == "raise":
            shown = "\n".join(f"  {k}: {v if k == 'data file' else _shorten(v)}" for k, v in sample.items())
            raise RewardError(
                f"{where}: {message}\nthe sample:\n{shown}\nthe scorer's traceback:\n{_scorer_traceback(exc)}"
                "Fix the scorer or the data, or set reward.on_error=zero to score such samples 0"
            ) from exc
        if (name, message) not in self._logged:
            self._logged.add((name, message))
            logger.warning(
                "%s: %s; scored 0 (reward.on_error=zero), identical errors are not logged again", where, message
            )


def _sample(data: DataProto, i: int, response: str) -> dict[str, Any]:
    """What a failing sample is: its data file and row (`source_row`, set by the datasets), data source, prompt,
    response and ground truth."""
    columns = data.non_tensor_batch
    sample = {"data file": columns["source_row"][i]} if "source_row" in columns else {}
    sample["data_source"] = str(columns["data_source"][i])
    if "raw_prompt" in columns:
        sample["prompt"] = columns["raw_prompt"][i]
    return sample | {"response": response, "ground truth": columns["ground_truth"][i]}


def _shorten(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 30]}... ({len(text)} characters)"


def _scorer_traceback(exc: Exception) -> str:
    """The traceback of `exc` from the scorer's own frames on (the frames of this module dropped)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _check_kwargs(fn: Callable, source: str, kwargs: Any) -> None:
    """Fail at the start, naming the key, when `fn` cannot take the keyword arguments given for `source`."""
    where = f"reward.scorer_kwargs[{source!r}]"
    if not isinstance(kwargs, dict):
        raise ValueError(f"{where} must be a mapping of keyword arguments, got {kwargs!r}")
    try:
        inspect.signature(fn).bind("data_source", "solution_str", "ground_truth", None, **kwargs)
    except TypeError as err:
        raise ValueError(
            f"{where}={kwargs!r} does not fit the scorer {fn.__module__}.{fn.__qualname__}{inspect.signature(fn)}: "
            f"{err}"
        ) from None


def _score_one(
    fn: Callable, source: str, text: str, truth: Any, extra_info: Any, kwargs: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    """Call `fn` (with `kwargs`) and split its result into a finite float score and the extra fields of a dict
    result."""
    result = fn(source, text, truth, extra_info, **kwargs)
    extra: dict[str, Any] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without a 'score' key (keys: {sorted(result)})")
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if not hasattr(result, "__float__"):
        raise TypeError(f"returned {result!r} ({type(result).__name__}); expected a float or a dict with 'score'")
    value = float(result)
    if not math.isfinite(value):
        raise ValueError(f"returned the non-finite score {value}")
    return value, extra


def _response_tensors(data: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """`responses` and `response_mask`, both `[batch, response_len]`."""
    missing = [k for k in ("responses", "response_mask") if k not in data.batch]
    if missing:
        raise ValueError(f"RewardScorer needs batch[{missing[0]!r}]; the batch has {sorted(data.batch)}")
    responses, mask = data.batch["responses"], data.batch["response_mask"]
    if responses.shape != mask.shape or responses.dim() != 2:
        raise ValueError(
            f"RewardScorer needs responses and response_mask of one shape [batch, response_len]; "
            f"got {tuple(responses.shape)} and {tuple(mask.shape)}"
        )
    return responses, mask


def _columns(data: DataProto) -> tuple[list[str], np.ndarray, np.ndarray]:
    """data_source (as str), ground_truth and extra_info (None where the column is absent) per sample."""
    columns = data.non_tensor_batch
    for key in REQUIRED_COLUMNS:
        if key not in columns:
            raise ValueError(
                f"RewardScorer needs the non-tensor column {key!r}; the data has {sorted(columns)}. "
                "Add it to the dataset (every row needs data_source and ground_truth)"
            )
    extra_info = columns.get("extra_info")
    if extra_info is None:
        extra_info = np.full(len(data), None, dtype=object)
    if "messages" in columns:
        keys = ("messages", "env_reward", *(k for k in TOOL_COUNTS if k in columns))
        trajectory = zip(extra_info, *(columns[k] for k in keys), strict=True)
        extra_info = object_array([{**(e or {}), **dict(zip(keys, values, strict=True))} for e, *values in trajectory])
    return [str(s) for s in columns["data_source"]], columns["ground_truth"], extra_info


def decode_rows(tokenizer: PreTrainedTokenizerBase, token_ids: list[list[int]]) -> list[str]:
    """`tokenizer.batch_decode(token_ids, skip_special_tokens=True)`. A fast tokenizer that neither overrides its
    decoding nor cleans up spaces (most) decodes the whole batch in one call of its Rust backend, in parallel."""
    from transformers import PreTrainedTokenizerFast

    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return tokenizer.backend_tokenizer.decode_batch(token_ids, skip_special_tokens=True)
    return tokenizer.batch_decode(token_ids, skip_special_tokens=True)


def _trajectory_mask(data: DataProto, response_mask: torch.Tensor) -> torch.Tensor:
    """The response tokens to decode `[batch, response_len]`: the response part of the attention mask when the
    batch has one (a multi-turn trajectory's tool results included), else `response_mask`."""
    attention_mask = data.batch.get("attention_mask")
    return response_mask if attention_mask is None else attention_mask[:, -response_mask.shape[1] :]


def _last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """`[batch]` index of the last position where mask == 1; every row must have one."""
    valid = mask.bool()
    empty = (~valid.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"RewardScorer: samples {empty} have no response token (response_mask is all 0)")
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (valid * positions).amax(dim=1) - 1


def _stack_extras(extras: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """{field: `[batch]` array}: float64 with NaN where missing when all values are numbers, else object."""
    names = list(dict.fromkeys(k for extra in extras for k in extra))
    stacked = {}
    for name in names:
        values = [extra.get(name, math.nan) for extra in extras]
        numeric = all(isinstance(v, numbers.Real) for v in values)
        stacked[name] = np.array(values, dtype=np.float64 if numeric else object)
    return stacked
