"""Compiled functions saved across processes (`ketch.compiled`), with the `aot_eager` backend (dynamo and
AOTAutograd without inductor's code generation: fast on a CPU, saved the same way)."""

from __future__ import annotations

import importlib
import linecache
import sys

import torch

from ketch.compiled import SavedCompile, eager

BACKEND = "aot_eager"


def mlp(x, w1, w2, scale: float):
    return torch.nn.functional.gelu(x @ w1).mul(scale) @ w2


def weights():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(16, 16, generator=g, requires_grad=True) for _ in range(2))


def run(fn, x, w1, w2):
    """The output and the weights' gradients."""
    out = fn(x, w1, w2, 2.0)
    g1, g2 = torch.autograd.grad(out.square().sum(), (w1, w2))
    return out, g1, g2


def saved_files(compiled: SavedCompile) -> int:
    return len(list(compiled.directory.glob("*.form")))


def test_a_later_process_loads_the_saved_form_and_traces_nothing(tmp_path, monkeypatch):
    """The first call compiles one form (forward and backward) and saves it; a fresh `SavedCompile` (as in a
    later process) loads it and runs it without dynamo tracing anything; both give eager's values."""
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))
    w1, w2 = weights()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    expected = run(mlp, x, w1, w2)
    first = SavedCompile(mlp, "mlp", backend=BACKEND)
    for got, want in zip(run(first, x, w1, w2), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert saved_files(first) == 1
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    later = SavedCompile(mlp, "mlp", backend=BACKEND)
    assert len(later.load()) == 1
    for got, want in zip(run(later, x, w1, w2), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    assert saved_files(later) == 1


def test_a_new_size_adds_one_form_in_which_that_size_is_dynamic(tmp_path, monkeypatch):
    """Rows 4, then 6 (a second form, dim 0 of the first tensor dynamic), then 9 (served by the second form);
    another float (2.0 -> 3.0, a constant in the graph) and no grad each need a form of their own."""
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))
    w1, w2 = weights()
    compiled = SavedCompile(mlp, "mlp", backend=BACKEND)
    for rows in (4, 6, 9):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(compiled(x, w1, w2, 2.0), mlp(x, w1, w2, 2.0), atol=1e-6, rtol=1e-6)
    assert [form.dynamic for form in compiled.forms] == [{}, {0: [0]}]
    assert [form.sizes[0] for form in compiled.forms] == [(4, 16), (6, 16)]
    torch.testing.assert_close(compiled(x, w1, w2, 3.0), mlp(x, w1, w2, 3.0), atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        assert not compiled(x, w1, w2, 2.0).requires_grad
    assert len(compiled.forms) == 4 and saved_files(compiled) == 4
    with eager():
        compiled(torch.randn(2, 8, 16)[0], w1, w2, 5.0)
    assert len(compiled.forms) == 4


def test_loading_forms_starts_no_compile_workers(tmp_path, monkeypatch):
    """Forms load with inductor's compile threads at 1 (its pool of compile workers is not started for kernels
    that are already compiled); the setting is restored after loading."""
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))
    w1, w2 = weights()
    SavedCompile(mlp, "mlp", backend=BACKEND)(torch.randn(4, 16), w1, w2, 2.0)
    threads = []
    load = torch.compiler.load_compiled_function

    def spy(*args, **kwargs):
        threads.append(torch._inductor.config.compile_threads)
        return load(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "load_compiled_function", spy)
    with torch._inductor.config.patch(compile_threads=8):
        assert len(SavedCompile(mlp, "mlp", backend=BACKEND).load()) == 1
        assert threads == [1]
        assert torch._inductor.config.compile_threads == 8


def test_only_the_first_process_of_a_machine_saves_its_forms(tmp_path, monkeypatch):
    """Ranks compile the same forms: with `LOCAL_RANK` 1 the form serves the process but is not written."""
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))
    w1, w2 = weights()
    x = torch.randn(4, 16)
    for local_rank, files in (("1", 0), ("0", 1)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        compiled = SavedCompile(mlp, "mlp", backend=BACKEND)
        torch.testing.assert_close(compiled(x, w1, w2, 2.0), mlp(x, w1, w2, 2.0), atol=1e-6, rtol=1e-6)
        assert len(compiled.forms) == 1 and saved_files(compiled) == files


def test_a_cache_that_cannot_be_written_costs_the_saving_only(tmp_path, monkeypatch, caplog):
    """Where the form cannot be written (here its directory would sit under a file), a warning says where, and
    the compiled form still serves this process."""
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))
    (tmp_path / "blocked").write_text("a file, not a directory")
    w1, w2 = weights()
    x = torch.randn(4, 16)
    compiled = SavedCompile(mlp, "mlp", backend=BACKEND)
    compiled.directory = tmp_path / "blocked" / "mlp"
    with caplog.at_level("WARNING", logger="ketch.compiled"):
        torch.testing.assert_close(compiled(x, w1, w2, 2.0), mlp(x, w1, w2, 2.0), atol=1e-6, rtol=1e-6)
    assert f"not saved to {tmp_path / 'blocked' / 'mlp'}" in caplog.text
    assert len(compiled.forms) == 1
    compiled(x, w1, w2, 2.0)
    assert len(compiled.forms) == 1


def test_a_form_whose_traced_source_changed_is_deleted_and_compiled_again(tmp_path, monkeypatch):
    """Editing the compiled function's module makes its saved form stale: not used, deleted, compiled anew."""
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path / "cache"))
    module = tmp_path / "ketch_test_edited.py"
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(factor: str):
        module.write_text(f"def scaled(x):\n    return x * {factor}\n")
        linecache.checkcache(str(module))
        sys.modules.pop("ketch_test_edited", None)
        importlib.invalidate_caches()
        return importlib.import_module("ketch_test_edited").scaled

    x = torch.arange(3.0)
    first = SavedCompile(load("2.0"), "scaled", backend=BACKEND)
    assert first(x).tolist() == [0.0, 2.0, 4.0] and saved_files(first) == 1
    later = SavedCompile(load("5.0"), "scaled", backend=BACKEND)
    assert later.load() == [] and saved_files(later) == 0
    assert later(x).tolist() == [0.0, 5.0, 10.0] and saved_files(later) == 1


def test_a_function_whose_guards_cannot_be_saved_falls_back_to_torch_compile(tmp_path, monkeypatch, caplog):
    """A closure over an object of a class defined in a function: torch cannot save a guard on that class, so a
    warning names the function and the calls run through torch.compile; nothing is written."""
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))

    class Scale:
        factor = 2.0

    scale = Scale()

    def scaled(x):
        return x * scale.factor

    compiled = SavedCompile(scaled, "scaled", backend=BACKEND)
    with caplog.at_level("WARNING", logger="ketch.compiled"):
        assert compiled(torch.arange(3.0)).tolist() == [0.0, 2.0, 4.0]
    assert "scaled: torch.compile without saving" in caplog.text and "local scope" in caplog.text
    assert compiled.fallback is not None and not compiled.directory.exists()
    assert compiled(torch.arange(2.0)).tolist() == [0.0, 2.0]
