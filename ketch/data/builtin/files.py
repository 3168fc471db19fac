"""`resolve_data_files`: the `builtin:` entries of `data.train_files` / `data.val_files` as cached Parquet paths."""

from __future__ import annotations

from ketch.config.schema import BUILTIN_PREFERENCE_TASK, BUILTIN_TASK
from ketch.data.builtin.arithmetic import SPLITS, ArithmeticTask, builtin_task_files
from ketch.data.builtin.calculator import BUILTIN_CALCULATOR_TASK, builtin_calculator_files
from ketch.data.builtin.calculator import SPLITS as CALCULATOR_SPLITS
from ketch.data.builtin.dots import BUILTIN_DOTS_TASK, builtin_dots_files
from ketch.data.builtin.dots import SPLITS as DOTS_SPLITS
from ketch.data.builtin.preference import PREFERENCE_SPLITS, PreferenceTask, builtin_preference_files

BUILTIN_SPLITS = {
    BUILTIN_TASK: SPLITS,
    BUILTIN_PREFERENCE_TASK: PREFERENCE_SPLITS,
    BUILTIN_CALCULATOR_TASK: CALCULATOR_SPLITS,
    BUILTIN_DOTS_TASK: DOTS_SPLITS,
}
"""The built-in data sets and their splits."""


def resolve_data_files(files: list[str], task: ArithmeticTask | None = None) -> list[str]:
    """`files` with `builtin:arithmetic/{train,val}`, `builtin:arithmetic-preference/{sft,train,val}`,
    `builtin:calculator/{train,mixed,val}` and `builtin:dots/{train,val}` replaced by cached Parquet paths (generated
    on first use).

    Other entries pass through unchanged. `task` gives the generator settings (default: `ArithmeticTask()`).
    """
    resolved = []
    for entry in files:
        if not entry.startswith("builtin:"):
            resolved.append(entry)
            continue
        name, _, split = entry.rpartition("/")
        if split not in BUILTIN_SPLITS.get(name, ()):
            choices = ", ".join(f"{n}/{s}" for n, names in BUILTIN_SPLITS.items() for s in names)
            raise ValueError(f"unknown built-in data set {entry!r} in the data files; the built-in ones are: {choices}")
        if name == BUILTIN_CALCULATOR_TASK:
            resolved.append(str(builtin_calculator_files()[split]))
        elif name == BUILTIN_DOTS_TASK:
            resolved.append(str(builtin_dots_files()[split]))
        elif name == BUILTIN_TASK:
            resolved.append(str(builtin_task_files(task or ArithmeticTask())[split]))
        else:
            resolved.append(str(builtin_preference_files(PreferenceTask(task or ArithmeticTask()))[split]))
    return resolved
