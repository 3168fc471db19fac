"""torch.compile's caches go under the ketch cache directory, unless the user named another directory."""

from __future__ import annotations

from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from ketch.cache import use_compile_cache


def test_compile_cache_replaces_torchs_default_but_keeps_a_directory_the_user_set(monkeypatch, tmp_path):
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path / "ketch"))
    # torch writes its default into the variable on first use (importing transformers' models does)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert use_compile_cache() == str(tmp_path / "ketch" / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert use_compile_cache() == str(tmp_path / "ketch" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == str(tmp_path / "mine")
