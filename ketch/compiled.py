"""torch.compile whose compiled code outlives the process.

`SavedCompile(fn, name)` is called as `torch.compile(fn, fullgraph=True)` would be. Each compiled form of `fn`
(torch's aot_compile: the traced graph, its guards and inductor's code) is saved in the ketch cache directory;
a later process loads the saved forms (`load`: where the model is set up, or at the first call) and runs the
first whose guards accept the call, so dynamo neither traces nor looks up its caches again (which was most of
the first step of a run whose compiler caches were warm). A call that no form accepts compiles and saves a new
form; as with torch.compile's automatic dynamic shapes, a new form makes dynamic the tensor sizes that differ
from the last form's, unless `dynamic=False`. The first process of each machine (`LOCAL_RANK` 0) saves what
it compiles; the others load its forms in later runs. A saved form whose traced sources have changed is
deleted; one that another torch or another GPU saved is not used. Where torch cannot compile or save `fn`
this way, it falls back to `torch.compile(fn, fullgraph=True)`. `saved_compile` gives the process one
`SavedCompile` per function and name, which every engine of the same blocks shares.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import logging
import os
import pickle
import time
import uuid
import warnings
from functools import cache
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from ketch.cache import cache_dir, use_compile_cache

logger = logging.getLogger("ketch.compiled")

_EAGER = False


@contextlib.contextmanager
def eager():
    """Run every `SavedCompile` (and torch.compile) eagerly inside the block."""
    global _EAGER
    previous, _EAGER = _EAGER, True
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        _EAGER = previous


class SavedCompile:
    """`fn` compiled with dynamo's aot_compile, one form per family of calls, saved under `name`."""

    def __init__(self, fn, name: str, dynamic: bool | None = None, backend="inductor"):
        self.fn, self.name, self.dynamic, self.backend = fn, name, dynamic, backend
        self.forms: list[_Form] | None = None
        self.fallback = None
        if isinstance(backend, str):
            use_compile_cache()
            _import_compiler()
        else:  # a backend object: plain torch.compile, not saved
            self.fallback = self._torch_compile()
        self.directory = cache_dir() / "compiled" / torch.__version__ / str(backend) / name
        """Where the forms are saved: by torch version, backend and `name`."""

    def __call__(self, *args, **kwargs):
        if _EAGER:
            return self.fn(*args, **kwargs)
        if self.fallback is not None:
            return self.fallback(*args, **kwargs)
        for form in self.load():
            if form.compiled.guard_check(*args, **kwargs):
                return form.compiled.fn(*args, **kwargs)  # `fn`: the form without a second guard check
        form = self._compile(args, kwargs)
        if form is None:
            return self.fallback(*args, **kwargs)
        self.forms.append(form)
        return form.compiled.fn(*args, **kwargs)

    def _compile(self, args, kwargs) -> _Form | None:
        sizes = [tuple(t.shape) for t in _tensors(args, kwargs)]
        dynamic = {} if self.dynamic is False or not self.forms else _changed(self.forms[-1], sizes)
        marked = _mark_dynamic(args, kwargs, dynamic)
        grad = "on" if torch.is_grad_enabled() else "off"
        logger.info("%s: compiling a form for sizes %s, grad %s%s", self.name, sizes, grad, _describe(dynamic))
        start = time.perf_counter()
        try:
            torch._dynamo.config.enable_aot_compile = True
            options = {"guard_filter_fn": _saved_guards}
            with warnings.catch_warnings():  # saving the guards reads `.grad` of FSDP's unsharded parameters
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
                compiled = self._torch_compile(options).aot_compile((args, kwargs))
            data = type(compiled).serialize(compiled).serialized_data
        except Exception as error:  # torch's failures here are many; torch.compile itself is always a way out
            logger.warning("%s: torch.compile without saving (%s: %s)", self.name, type(error).__name__, error)
            self.fallback = self._torch_compile()
            return None
        finally:
            _unmark_dynamic(marked)
        form = _Form(compiled, sizes, dynamic)
        logger.info("%s: compiled in %.1f s, %s", self.name, time.perf_counter() - start, self._save(form, data))
        return form

    def _save(self, form: _Form, data: bytes) -> str:
        """Write `form` (serialized as `data`) where this process is the machine's first (`LOCAL_RANK` 0: one copy
        per machine, not one per process); returns what happened, for the log."""
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return "not saved (LOCAL_RANK 0 saves)"
        try:
            _write(self.directory, form, data)
        except OSError as error:
            logger.warning("%s: not saved to %s (%s)", self.name, self.directory, error)
            return "not saved"
        return "saved"

    def load(self) -> list[_Form]:
        """The saved forms, loaded on the first call (or earlier, where the caller sets things up: a form's
        guards may name classes that exist only then, as FSDP's class of a sharded module)."""
        if self.forms is None:
            start = time.perf_counter()
            self.forms = [] if self.fallback is not None else _load_forms(self.directory, self.fn.__globals__)
            if self.forms:
                logger.info("%s: loaded %d forms in %.2f s", self.name, len(self.forms), time.perf_counter() - start)
        return self.forms

    def __getstate__(self):
        """Only what defines the function: a module whose `forward` is this object is pickled with the guards of
        its compiled forms, which must not hold the forms themselves."""
        return {"fn": self.fn, "name": self.name, "dynamic": self.dynamic, "backend": self.backend}

    def __setstate__(self, state):
        self.__init__(**state)

    def _torch_compile(self, options: dict | None = None):
        return torch.compile(self.fn, fullgraph=True, dynamic=self.dynamic, backend=self.backend, options=options)


def saved_compile(fn, name: str, dynamic: bool | None = None, backend="inductor") -> SavedCompile:
    """The process's one `SavedCompile` of `fn` under `name` (per cache directory): engines of the same blocks
    (actor, reference, critic) share its forms instead of each compiling, saving and loading them."""
    return _shared(fn, name, dynamic, backend, cache_dir())


def saved_forms(root: Path) -> dict[str, tuple[int, int]]:
    """The forms saved under the cache directory `root`, by the torch version that saved them: (count, bytes)."""
    usage = {}
    for version in sorted(p for p in (root / "compiled").glob("*") if p.is_dir()):
        files = list(version.rglob("*.form"))
        if files:
            usage[version.name] = (len(files), sum(f.stat().st_size for f in files))
    return usage


@cache
def _shared(fn, name: str, dynamic: bool | None, backend, directory: Path) -> SavedCompile:
    return SavedCompile(fn, name, dynamic, backend)


class _Form:
    """One compiled form: the loaded function, the tensor sizes it was compiled for and its dynamic dims
    (tensor index -> dims)."""

    def __init__(self, compiled, sizes: list[tuple[int, ...]], dynamic: dict[int, list[int]]):
        self.compiled, self.sizes, self.dynamic = compiled, sizes, dynamic


@cache
def _import_compiler() -> None:
    """Import the parts of torch's compiler that loading a form runs (AOTAutograd, inductor's code cache and
    Triton runtime: seconds in a fresh process) when a compiled function is set up, not inside its first call."""
    import torch._functorch.aot_autograd
    import torch._inductor.async_compile
    import torch._inductor.compile_fx  # noqa: F401


def _saved_guards(entries) -> list[bool]:
    """Which guards a saved form keeps: torch's own rule (none on globals, none of a kind that cannot be saved),
    and no type guard on an FSDP-wrapped module, whose class FSDP makes anew in each process (it would load as
    the module's own class and never match again; the parameters' guards and the form's name still tell
    modules apart)."""
    from torch._dynamo.guards import CheckFunctionManager
    from torch.distributed.fsdp import FSDPModule

    unsaved = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [
        not (
            e.is_global or e.guard_type in unsaved or (e.guard_type == "TYPE_MATCH" and isinstance(e.value, FSDPModule))
        )
        for e in entries
    ]


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


def _changed(last: _Form, sizes: list[tuple[int, ...]]) -> dict[int, list[int]]:
    """The last form's dynamic dims plus the dims whose size differs from its example's."""
    dynamic = {i: list(dims) for i, dims in last.dynamic.items()}
    for i, (old, new) in enumerate(zip(last.sizes, sizes, strict=False)):
        if len(old) == len(new):
            changed = {d for d, (a, b) in enumerate(zip(old, new, strict=True)) if a != b}
            dims = sorted(set(dynamic.get(i, [])) | changed)
            if dims:
                dynamic[i] = dims
    return dynamic


def _mark_dynamic(args, kwargs, dynamic: dict[int, list[int]]) -> list[torch.Tensor]:
    """Mark the dims dynamic where dynamo may (not a size of 0 or 1); returns the marked tensors."""
    marked = []
    for i, t in enumerate(_tensors(args, kwargs)):
        if i in dynamic:
            torch._dynamo.maybe_mark_dynamic(t, dynamic[i])
            marked.append(t)
    return marked


def _unmark_dynamic(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if hasattr(t, "_dynamo_weak_dynamic_indices"):
            del t._dynamo_weak_dynamic_indices


def _describe(dynamic: dict[int, list[int]]) -> str:
    return f" (dynamic sizes: {dynamic})" if dynamic else ""


def _write(directory: Path, form: _Form, data: bytes) -> None:
    """Write the form atomically, under a name of its own (ranks and runs compile side by side)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{uuid.uuid4().hex}.form"
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(pickle.dumps({"sizes": form.sizes, "dynamic": form.dynamic, "compiled": data}))
    os.replace(temporary, path)


def _load_forms(directory: Path, f_globals: dict) -> list[_Form]:
    """The saved forms that this process can use, oldest first (`f_globals`: the function's module globals);
    those whose traced sources changed are deleted."""
    if not directory.is_dir():
        return []
    forms = []
    for path in sorted(directory.glob("*.form"), key=_age):
        try:
            saved = pickle.loads(path.read_bytes())
            with _no_compile_workers():
                compiled = torch.compiler.load_compiled_function(io.BytesIO(saved["compiled"]), f_globals=f_globals)
        except Exception as error:  # another GPU's, or unreadable: what it served is compiled again
            logger.info("%s: not using %s (%s: %s)", directory.name, path.name, type(error).__name__, error)
            continue
        if not _sources_unchanged(compiled):
            logger.info("%s: deleting %s, whose traced sources changed", directory.name, path.name)
            path.unlink(missing_ok=True)
            continue
        forms.append(_Form(compiled, saved["sizes"], saved["dynamic"]))
    return forms


def _no_compile_workers():
    """Inductor's settings while a form loads: one compile thread. Loading a form's Triton kernels otherwise
    starts inductor's pool of compile workers (a process per core, each importing torch) that a loaded form
    never uses; on one H200 machine they slowed the run's first steps by about a tenth and the whole process
    by 5 to 8 s."""
    return torch._inductor.config.patch(compile_threads=1)


def _age(path: Path) -> float:
    """When the form was written (one that another process deleted meanwhile sorts last and then fails to load)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")


def _sources_unchanged(compiled) -> bool:
    """Whether every source that dynamo traced into the form still reads the same."""
    for source in compiled.source_info().inlined_sources:
        lines = inspect.getsourcelines(importlib.import_module(source.module))[0]
        text = "".join(lines[source.firstlineno - 1 : source.lastlineno - 1])
        if hashlib.sha256(text.encode()).hexdigest() != source.checksum:
            return False
    return True
