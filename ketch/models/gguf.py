"""GGUF files as plain Hugging Face model directories.

transformers (with the `gguf` package) reads a GGUF file's tokenizer, config and weights, dequantizing them on
load, but refuses to save such a model. `convert_gguf` rebuilds it as a normal model and writes a directory that
transformers, vLLM and ketch load like any other: safetensors, the tokenizer with its chat template, and a
`generation_config.json` whose EOS ids are the file's end-of-text and end-of-turn tokens (the tokenizer that
transformers builds from a GGUF file may name another EOS). `cached_gguf_model` converts once per file.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ketch.cache import cache_dir
from ketch.models.pretrained import ModelLoadError, quiet_transformers
from ketch.models.special_tokens import ensure_eos_token, ensure_pad_token

logger = logging.getLogger("ketch.models")

_MAGIC = b"GGUF"
_END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
"""GGUF metadata naming the tokens that end a response: end of text, end of turn, end of a tool call."""

_FORMAT_VERSION = 1
"""Bump when converted directories change for the same file, to convert again."""


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a `.gguf` file (by its name: the contents are checked on conversion)."""
    return str(path).lower().endswith(".gguf")


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the model in `gguf_file` to `out_dir` as a Hugging Face directory with weights in `dtype`.

    Raises ModelLoadError naming the file when it is missing, not GGUF, or not loadable by transformers."""
    gguf_file, out = Path(gguf_file).expanduser().resolve(), Path(out_dir)
    end_ids, pad_id = _read_special_ids(gguf_file)
    quiet_transformers()
    kwargs = {"gguf_file": gguf_file.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kwargs)
    except (ImportError, OSError, ValueError, KeyError, RuntimeError) as err:
        raise ModelLoadError(
            f"cannot convert {gguf_file}: {err}; ketch converts GGUF files through transformers, which needs the "
            "'gguf' and 'accelerate' packages (pip install 'ketch[gguf]') and supports llama, mistral, qwen2, "
            "gemma and a few more architectures"
        ) from err
    model = _plain_copy(loaded, dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    generation = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=end_ids or [tokenizer.eos_token_id], pad_token_id=pad_id
    )
    generation.save_pretrained(out)
    ensure_eos_token(tokenizer, str(out))
    ensure_pad_token(tokenizer, str(out))
    tokenizer.save_pretrained(out)
    return out


def cached_gguf_model(gguf_file: str | Path) -> Path:
    """The converted directory of `gguf_file` under the user cache (converted on first use, keyed by the file's
    name, size and first megabyte, so that a changed file converts again)."""
    path = Path(gguf_file).expanduser().resolve()
    _read_special_ids(path)  # a missing or foreign file fails here, before anything is written
    with path.open("rb") as f:
        head = f.read(1 << 20)
    key = hashlib.sha256(head + f"{path.stat().st_size}:{_FORMAT_VERSION}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to a Hugging Face directory (once; cached in %s)", path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        convert_gguf(path, Path(tmp) / "model")
        if not (target / "config.json").is_file():
            shutil.rmtree(target, ignore_errors=True)
            (Path(tmp) / "model").rename(target)
    return target


def _read_special_ids(path: Path) -> tuple[list[int], int | None]:
    """(ids that end a response, pad id) from the GGUF metadata of `path`."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist; pass the path of a .gguf model file")
    with path.open("rb") as f:
        if f.read(4) != _MAGIC:
            raise ModelLoadError(
                f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf model file, or a Hugging "
                "Face model directory as model.path"
            )
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ModelLoadError(f"reading {path} needs the 'gguf' package: pip install 'ketch[gguf]'") from err
    fields = GGUFReader(path).fields

    def value(key: str) -> int | None:
        return int(fields[key].contents()) if key in fields else None

    ends = [value(key) for key in _END_KEYS]
    return list(dict.fromkeys(i for i in ends if i is not None)), value("tokenizer.ggml.padding_token_id")


def _plain_copy(loaded: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`loaded` (a model transformers marks as GGUF-quantized) as a model of the same class with no quantization
    config, so that `save_pretrained` writes it."""
    config = loaded.config
    del config.quantization_config
    config.name_or_path = ""
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    return model.to(dtype)
