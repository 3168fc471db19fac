"""Statistics over the valid entries of a tensor: mean, variance and whitening under a 0/1 mask.

Masked-out entries never enter a result, even when they hold NaN or inf (padding may hold anything).
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` is nonzero, over all entries (dim=None) or along `dim`.

    `x` and `mask` share a shape such as `[batch, response_len]`. Where there is no valid entry the mean is 0.
    """
    valid = mask.bool()
    total = torch.where(valid, x, 0).sum() if dim is None else torch.where(valid, x, 0).sum(dim)
    count = valid.sum() if dim is None else valid.sum(dim)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries of `x` (a scalar); unbiased divides by n − 1.

    With one valid entry (or none) the variance is 0, not NaN.
    """
    valid = mask.bool()
    centered = torch.where(valid, x - masked_mean(x, valid), 0)
    count = valid.sum()
    return centered.square().sum() / ((count - 1) if unbiased else count).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`x` scaled to unit (unbiased) variance over its valid entries, and to mean 0 when `shift_mean`.

    Without `shift_mean` the original mean is kept: (x − mean)/std + mean. Masked entries are 0 in the result.
    A single valid entry becomes 0 (its deviation from the mean), never NaN.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0)
