"""Sampling the next token on the device, for the static decoder (`static_decoding.py`): from logits `[batch,
vocab]`, with temperature and top-k/top-p filters, returning the token and its log-prob under the temperature-scaled
distribution (what the training engine computes)."""

from __future__ import annotations

import logging
from functools import cache

import torch

from ketch.compiled import SavedCompile

logger = logging.getLogger("ketch.rollout")


class Sampling:
    """Picks the next token from logits `[batch, vocab]` (read as float32) and returns its log-prob under the
    temperature-scaled distribution (what the training engine computes), before top-k/top-p filtering.

    Sampling takes the argmax of the filtered logits plus Gumbel noise (the Gumbel-max trick: the same
    distribution as a draw from their softmax); on CUDA it is compiled into a few fused kernels over the
    vocabulary, where softmax, `multinomial` and `log_softmax` took a pass (or several) each. Without a filter,
    the static decoder's draws on CUDA go to a Triton kernel instead (`sample_kernel.py`: two passes, one random
    number per row)."""

    def __init__(self, do_sample: bool, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0):
        self.do_sample, self.temperature, self.top_p, self.top_k = do_sample, temperature, top_p, top_k

    def key(self) -> tuple:
        """What the sampling function is specialized on (a CUDA graph of it holds these)."""
        return self.do_sample, self.temperature, self.top_p, self.top_k

    def sample(self, logits: torch.Tensor, seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(token, log_prob)`, each `[batch]`, from `logits` `[batch, vocab]` in any float dtype. Given a `seed`
        `[1]` (int64, on the logits' device), CUDA logits without a top-k/top-p filter go to the Triton kernel
        (`sample_kernel.py`), whose noise is keyed on it: the caller changes it between draws."""
        if seed is not None and logits.is_cuda and self.top_k == 0 and self.top_p >= 1.0:
            from ketch.rollout.sample_kernel import fits, sample

            if fits(logits):
                return sample(logits, self.temperature if self.do_sample else 1.0, self.do_sample, seed)
        return compiled_sampler(logits.device.type)(logits, self.do_sample, self.temperature, self.top_k, self.top_p)


def _sample(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float):
    logits = logits.float()  # compiled, the cast fuses into the sampling kernels: no float32 copy of the logits
    if do_sample:
        scaled = logits / temperature
        gumbel = -(-torch.rand_like(scaled).log()).log()
        token = (_filter(scaled, top_k, top_p) + gumbel).argmax(-1)
    else:
        scaled, token = logits, logits.argmax(-1)
    return token, scaled.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)


def _filter(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top-k and the top-p nucleus set to -inf."""
    if top_k > 0:
        kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs > top_p  # the nucleus keeps the token that crosses top_p
        scaled = scaled.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return scaled


@cache
def compiled_sampler(device_type: str):
    """The sampling function for `device_type`: on CUDA compiled (and saved, `SavedCompile`) once per process."""
    if device_type != "cuda":
        return _sample
    sample = SavedCompile(_sample, "sample", dynamic=False)
    logger.info("compiling the sampling function on first use, or loading it (cache %s)", sample.directory)
    return sample
