"""`ketch doctor`: the checks a run needs before it spends GPU hours, printed as one table.

`checks.py` holds the environment rows (Python, torch and the GPUs, Ray, vLLM, `/dev/shm`, disk, the cache, the
trackers), the table and the command; `config_checks.py` the rows of a config (the model loads, the data files,
the batch sizes, the model's code paths, memory, parallelism, the first step's rollout-vs-training check).
"""

from ketch.doctor.checks import Check, doctor, format_table, run_checks

__all__ = ["Check", "doctor", "format_table", "run_checks"]
