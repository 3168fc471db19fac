"""Launches a decode step of `rollout.exact_log_probs` costs a decoder layer, counted on the CPU: with the CPU's torch
ops, and with the GPU's Triton kernels (run by Triton's interpreter). On a GPU the static decoder replays a step from a
CUDA graph, so its time is about one launch's latency per kernel: this counts them.

    PYTHONPATH=. python3 benchmarks/exact_launches.py [--out FILE]

Every aten op that computes (views and metadata excepted) counts as one launch, and so does each call of a Triton
kernel. A tiny Qwen2 with the Qwen2.5 layout (biased q/k/v, 14 query heads over 2 key heads) decodes 16 rows after
prompts of 40 tokens; the third decode step is counted with 2 and with 4 layers, so that the difference halved is a
layer's launches and the rest the step's own (embedding, final norm, lm head, sampling, bookkeeping).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels then run on the CPU

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.data import build_char_tokenizer
from ketch.models.batch_invariant import make_batch_invariant
from ketch.models.tiny import build_tiny_model
from ketch.rollout.exact_decoding import ExactDecoder
from ketch.rollout.sampling import Sampling

FREE = {"view", "_unsafe_view", "transpose", "t", "expand", "slice", "select", "unsqueeze", "squeeze", "permute",
        "as_strided", "detach", "alias", "split", "split_with_sizes", "unbind", "chunk", "narrow", "lift_fresh",
        "_reshape_alias", "reshape", "view_as", "empty", "new_empty", "empty_like", "empty_strided", "unflatten",
        "flatten", "contiguous", "item", "_local_scalar_dense", "sym_size", "is_same_size"}  # fmt: skip
"""aten ops that launch nothing (views, allocation, shape queries)."""


class Launches(TorchDispatchMode):
    """Counts the aten ops that compute, by name, and the Triton kernels' launches (by the kernel's name), not the
    ops the interpreter runs inside a launch."""

    def __init__(self):
        super().__init__()
        self.ops, self.inside = Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name not in FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def count_launches(self) -> None:
        """Count each Triton launch as one (the interpreter's `run`), the ops it runs as none."""
        run = InterpretedFunction.run

        def counted(function, *args, **kwargs):
            self.ops[function.__name__] += 1
            self.inside = True
            try:
                return run(function, *args, **kwargs)
            finally:
                self.inside = False

        InterpretedFunction.run = counted
        self.restore = lambda: setattr(InterpretedFunction, "run", run)


def step_launches(layers: int, kernels: bool) -> Counter:
    """The third decode step's launches by name (aten ops, and kernel launches with `kernels`), `layers` layers."""
    os.environ["TRITON_INTERPRET"] = "1" if kernels else "0"
    model = build_tiny_model(build_char_tokenizer(), hidden_size=112, intermediate_size=128, num_layers=layers,
                             num_heads=14, num_kv_heads=2, max_positions=512).eval()  # fmt: skip
    decoder = ExactDecoder(make_batch_invariant(copy.deepcopy(model)), compile_step=False)
    counted, iterate = {"steps": 0}, ExactDecoder._iterate

    def third(self, *args):
        counted["steps"] += 1
        if counted["steps"] != 3:
            return iterate(self, *args)
        mode = Launches()
        mode.count_launches()
        try:
            with mode:
                iterate(self, *args)
        finally:
            mode.restore()
        counted["ops"] = mode.ops

    ExactDecoder._iterate = third
    try:
        ids = torch.randint(4, 40, (16, 40), generator=torch.Generator().manual_seed(0))
        decoder.generate(ids, torch.ones_like(ids), 5, Sampling(True, 0.9), None, pad_token_id=0)
    finally:
        ExactDecoder._iterate = iterate
    return counted["ops"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the counts as JSON here")
    args = parser.parse_args()
    result = {}
    for path, kernels in (("torch ops (CPU)", False), ("Triton kernels (GPU)", True)):
        two, four = (step_launches(n, kernels) for n in (2, 4))
        layer = {name: count // 2 for name, count in (four - two).items()}
        result[path] = {"per_layer": sum(layer.values()), "per_step": sum(two.values()) - 2 * sum(layer.values()),
                        "a_layer_by_op": layer}  # fmt: skip
        print(path, json.dumps(result[path]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
