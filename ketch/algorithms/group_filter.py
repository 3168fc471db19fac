"""DAPO's dynamic sampling filter (Yu et al. 2025, https://arxiv.org/abs/2503.14476, section 3.2).

A group (the samples of one prompt) whose samples all score the same gets group-relative advantages of zero:
it adds nothing to the gradient but still dilutes the batch. DAPO drops such groups and samples more prompts
until the batch is full of informative ones. A group of one sample is all-equal by definition, so it is
dropped too (verl keeps it; here no kept group can have all-zero group advantages).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def informative_groups(group_ids: Sequence[Hashable] | np.ndarray, values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Bool mask `[batch]`: True for the samples whose group (same `group_ids` entry) has at least two different
    `values` (`[batch]`, e.g. each sample's summed score). A NaN value raises ValueError naming the sample."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) != len(group_ids):
        raise ValueError(f"informative_groups: {len(group_ids)} group ids but {len(values)} values")
    missing = np.flatnonzero(np.isnan(values))
    if len(missing):
        raise ValueError(
            f"informative_groups: the filter metric is NaN (missing) for samples {missing[:8].tolist()}; every "
            "sample needs a value (does the reward function return this field for every sample?)"
        )
    _, group = np.unique(np.asarray(group_ids, dtype=object).astype(str), return_inverse=True)
    low = np.full(group.max() + 1 if len(group) else 0, np.inf)
    high = np.full_like(low, -np.inf)
    np.minimum.at(low, group, values)
    np.maximum.at(high, group, values)
    return (high > low)[group]
