"""`ketch doctor`: checks what a run needs before it spends GPU hours, and prints one table of the findings.

Environment rows (Python, torch and the GPUs, transformers, Ray, vLLM, `/dev/shm`, disk, write access, the
cache directory and the compiled code saved there, trackers) are judged for the given config; config rows check
that the model loads, the data files read with the columns the run uses, and the batch sizes divide. A row is
`ok`, `warn` (worth a look) or `FAIL` (the run cannot work; its `fix` says what to do); any FAIL makes the
command exit 1.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import platform
import shutil
import socket
import sys
import textwrap
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from ketch.cache import cache_root
from ketch.config import BatchError, ConfigError, KetchConfig, load_config
from ketch.tracking.backends import TRACKER_MODULES, install_hint
from ketch.trainer.preflight import (
    GIB,
    Check,
    attention_row,
    cache_row,
    existing_parent,
    output_dir_row,
    resume_row,
    run_dir_row,
    tools_row,
    vllm_row,
)

MIN_SHM_GIB_FOR_VLLM = 8
MIN_FREE_DISK_GIB = 10
MIB = 1024**2


def run_checks(config_path: str | None = None, overrides: list[str] | None = None) -> list[Check]:
    """Every row, in table order; the environment rows are judged for the defaults when the config is invalid."""
    try:
        config = load_config(config_path, overrides or [], typed=True)
        given = [config_path or "defaults", *(overrides or [])]
        config_row = Check("config", "ok", " ".join(given) + ": valid")
    except (ConfigError, BatchError) as err:
        config, config_row = None, Check("config", "FAIL", str(err), "correct the keys named in the detail")
    env = config or load_config()
    rows = [_python(), *_torch(env), _package("transformers"), *_ray(env), vllm_row(env), attention_row(env)]
    rows.append(_shm(env))
    out_dir = Path(env.trainer.default_local_dir) / env.trainer.experiment_name
    cache = _cache()
    rows += [_disk(out_dir), output_dir_row(out_dir), run_dir_row(out_dir), resume_row(env), cache, _trackers(env)]
    rows.append(config_row)
    if config is not None and cache.status == "FAIL":  # built-in models and data are made in the cache
        rows.append(Check("model, data", "warn", "not checked: the cache directory cannot be written", "fix it first"))
    elif config is not None:
        rows += _config_rows(config)
    return rows


# ----------------------------------------------------------------- environment
def _python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check(
        "python",
        "ok" if ok else "FAIL",
        f"{platform.python_version()} ({sys.executable})",
        "" if ok else "use Python 3.11 or newer",
    )


def _torch(config: KetchConfig) -> list[Check]:
    import torch

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    gpus = gpus if torch.cuda.is_available() else []
    listed = "; ".join(f"cuda:{i} {p.name} {p.total_memory / GIB:.0f} GiB" for i, p in enumerate(gpus))
    row = Check("GPUs", "ok", listed or "none visible: the workers run on the CPU")
    t = config.trainer
    if t.device == "cuda" and not gpus:
        fix = "install a CUDA build of torch on a machine with NVIDIA GPUs (pytorch.org), or set trainer.device=cpu"
        row = Check("GPUs", "FAIL", "trainer.device=cuda, but torch sees no GPU", fix)
    elif config.uses_gpu(bool(gpus)) and _gpus_per_node(config)[0] > len(gpus):
        needed, keys = _gpus_per_node(config)
        detail = f"{keys}: {needed} GPUs per node, but this node has {len(gpus)}: {listed}"
        row = Check("GPUs", "FAIL", detail, f"lower them to {len(gpus)} GPUs in all")
    return [Check("torch", "ok", f"{torch.__version__} ({build})"), row]


def _gpus_per_node(config: KetchConfig) -> tuple[int, str]:
    """GPUs one node needs: the workers', and a standalone rollout's; and the keys that say so."""
    t, r = config.trainer, config.rollout
    if r.placement != "standalone":
        return t.n_gpus_per_node, f"trainer.n_gpus_per_node={t.n_gpus_per_node}"
    keys = f"trainer.n_gpus_per_node={t.n_gpus_per_node} + rollout.n_workers_per_node={r.n_workers_per_node}"
    return t.n_gpus_per_node + r.n_workers_per_node, keys


def _declared(distribution: str) -> SpecifierSet | None:
    """The version range ketch's package metadata asks for `distribution` (None when ketch is not installed)."""
    try:
        requirements = [Requirement(r) for r in importlib.metadata.requires("ketch") or []]
    except importlib.metadata.PackageNotFoundError:
        return None
    name = canonicalize_name(distribution)
    return next((r.specifier for r in requirements if canonicalize_name(r.name) == name and not r.marker), None)


def _package(distribution: str) -> Check:
    """Installed, and within the range ketch declares."""
    spec = _declared(distribution)
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return Check(distribution, "FAIL", "not installed", f"pip install '{distribution}{spec or ''}'")
    if spec and not spec.contains(version, prereleases=True):
        return Check(distribution, "FAIL", f"{version}, outside {spec}", f"pip install '{distribution}{spec}'")
    return Check(distribution, "ok", version)


def _ray(config: KetchConfig) -> list[Check]:
    """Ray's version; with `trainer.ray_address`, a row for the cluster too."""
    row = _package("ray")
    if row.status != "ok":
        return [row]
    if config.trainer.ray_address is None:
        import torch

        local = "starts a local Ray instance" if config.uses_ray(torch.cuda.is_available()) else "runs locally"
        return [Check("ray", "ok", f"{row.detail} (this config {local})")]
    return [row, _ray_cluster(config.trainer.ray_address)]


def _ray_cluster(address: str) -> Check:
    """Connect to `trainer.ray_address` and list the live nodes with their CPUs and GPUs."""
    import ray

    fix = (
        "start the cluster (`ray start --head` on the head node), check the address with `ray status` there, "
        "and that this machine reaches its port"
    )
    unreachable = _unreachable(address)
    if unreachable:  # Ray itself retries an address that does not answer for minutes
        return Check("ray cluster", "FAIL", f"trainer.ray_address={address}: {unreachable}", fix)
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    except Exception as err:  # Ray raises ConnectionError, RuntimeError, ... depending on how it fails
        return Check("ray cluster", "FAIL", f"cannot connect to trainer.ray_address={address}: {err}", fix)
    finally:
        ray.shutdown()
    listed = "; ".join(
        f"{n['NodeManagerAddress']}: {n['Resources'].get('CPU', 0):g} CPU, {n['Resources'].get('GPU', 0):g} GPU"
        for n in nodes
    )
    return Check("ray cluster", "ok", f"{address}: {len(nodes)} node(s): {listed}")


def _unreachable(address: str, timeout: float = 5.0) -> str | None:
    """Why nothing answers at a `HOST:PORT` (or `ray://HOST:PORT`) address; None when something does, or for
    `auto`, which Ray resolves itself."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        return f"nothing answers at {host}:{port} ({err.strerror or err})"
    return None


def _shm(config: KetchConfig) -> Check:
    needed = config.rollout.name == "vllm"
    try:
        size = shutil.disk_usage("/dev/shm").total / GIB
    except OSError:
        if needed:
            return Check("/dev/shm", "warn", "absent; vLLM needs shared memory", "run on Linux with a /dev/shm mount")
        return Check("/dev/shm", "ok", "absent (needed only by vLLM)")
    if needed and size < MIN_SHM_GIB_FOR_VLLM:
        fix = "give the container more: docker run --shm-size=16g (Kubernetes: an emptyDir of medium Memory)"
        detail = f"{size:.1f} GiB; vLLM needs {MIN_SHM_GIB_FOR_VLLM} GiB or more for long sequences"
        return Check("/dev/shm", "warn", detail, fix)
    return Check("/dev/shm", "ok", f"{size:.1f} GiB")


def _disk(out_dir: Path) -> Check:
    where = existing_parent(out_dir)
    free = shutil.disk_usage(where).free / GIB
    detail = f"{free:.1f} GiB free at {where}"
    if free < MIN_FREE_DISK_GIB:
        fix = (
            "free space, or set trainer.default_local_dir on a larger disk: a checkpoint holds the weights and "
            "the optimizer state, about 12 bytes per parameter"
        )
        return Check("disk", "warn", f"{detail} (under {MIN_FREE_DISK_GIB} GiB)", fix)
    return Check("disk", "ok", detail)


def _cache() -> Check:
    """The cache directory can be written; the compiled code saved there for this torch (which later runs load
    instead of compiling) and for other torch versions (which no run of this torch loads: space to free)."""
    import torch

    from ketch.compiled import saved_forms

    row = cache_row()
    if row.status == "FAIL":
        return row
    root = cache_root()
    forms = saved_forms(root)
    count, size = forms.pop(torch.__version__, (0, 0))
    detail = f"{row.detail}; compiled code for torch {torch.__version__}: {count} forms, {size / MIB:.1f} MiB"
    if not forms:
        return Check("cache", "ok", detail)
    others = ", ".join(f"{version} ({n} forms, {b / MIB:.1f} MiB)" for version, (n, b) in forms.items())
    fix = "delete " + " and ".join(str(root / "compiled" / version) for version in forms) + " to free the space"
    return Check("cache", "warn", f"{detail}; saved by other torch versions, not loaded by this one: {others}", fix)


def _trackers(config: KetchConfig) -> Check:
    chosen = [k for k in config.trainer.logger if k in TRACKER_MODULES]
    missing = [k for k in chosen if importlib.util.find_spec(TRACKER_MODULES[k]) is None]
    if missing:
        detail = f"trainer.logger names {', '.join(missing)}, not installed"
        return Check("trackers", "FAIL", detail, "; ".join(install_hint(k) for k in missing))
    console = ["console"] if "console" in config.trainer.logger else []
    return Check("trackers", "ok", ", ".join([*console, "jsonl", *chosen]) + (" (installed)" if chosen else ""))


def _config_rows(config: KetchConfig) -> list[Check]:
    """The model, the data files, the batch sizes, the model's code paths, the parallelism and the GPU memory of
    `config` (`ketch/doctor/config_checks.py`)."""
    import torch

    from ketch.doctor.config_checks import (
        available_host_memory,
        batch_row,
        data_row,
        host_memory_row,
        memory_row,
        mismatch_row,
        model_row,
        parallel_row,
        partial_row,
        paths_row,
    )

    model, tokenizer, model_config, processor = model_row(config)
    train, train_set = data_row(config, "train_files", tokenizer, processor)
    val, _ = data_row(config, "val_files", tokenizer, processor)
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    optional = (
        tools_row(config),
        paths_row(config, model_config, gpu_bytes is not None),
        parallel_row(config, model_config),
        memory_row(config, model_config, gpu_bytes),
        host_memory_row(config, model_config, available_host_memory()),
    )
    rows = [model, train, val, batch_row(config, train_set), *(row for row in optional if row), partial_row(config)]
    if all(row.status != "FAIL" for row in rows):  # a forward of the model on the data: where both load
        rows.append(mismatch_row(config))
    return rows


# ----------------------------------------------------------------- output
def format_table(rows: list[Check], width: int = 120) -> str:
    """The rows as an aligned text table; long details and fixes wrap within their columns (the fix column takes
    at most 2/5 of the width, and only what its longest fix needs)."""
    name_w = max(len("check"), *(len(r.name) for r in rows))
    cells_w = max(50, width - name_w - 2 - 8 - 2)  # the detail and fix columns, without the gaps
    fix_w = min(max(len("fix"), *(len(r.fix) for r in rows)), cells_w * 2 // 5)
    detail_w = cells_w - fix_w
    lines = [f"{'check':<{name_w}}  status  {'detail':<{detail_w}}  fix", "-" * width]
    for r in rows:
        details, fixes = _wrap(r.detail, detail_w), _wrap(r.fix, fix_w)
        for i in range(max(len(details), len(fixes))):
            cells = (r.name if i == 0 else "", r.status if i == 0 else "", _at(details, i), _at(fixes, i))
            lines.append(f"{cells[0]:<{name_w}}  {cells[1]:<6}  {cells[2]:<{detail_w}}  {cells[3]}".rstrip())
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` characters, its own line breaks kept."""
    return [part for line in text.splitlines() for part in textwrap.wrap(line, width) or [""]] or [""]


def _at(items: list[str], i: int) -> str:
    return items[i] if i < len(items) else ""


def doctor(config_path: str | None, overrides: list[str]) -> int:
    """Print the table and a verdict; 1 when any row failed, else 0."""
    rows = run_checks(config_path, overrides)
    print(format_table(rows, max(100, shutil.get_terminal_size((120, 24)).columns)))
    failed = [r.name for r in rows if r.status == "FAIL"]
    warned = [r.name for r in rows if r.status == "warn"]
    if failed:
        print(f"\n{len(failed)} check(s) failed: {', '.join(failed)}; see the fix column")
        return 1
    print("\nready to run" + (f" (warnings: {', '.join(warned)})" if warned else ""))
    return 0
