"""Time and measure the lm-head pass (output projection, log-probs, entropy; forward and backward) on one GPU:
ketch's chunked log-probs (`ketch.engine.fused_log_probs`) at several logit budgets per chunk, beside Liger-Kernel's
fused linear cross-entropy (`pip install liger-kernel`), whose per-token loss is minus the log-prob (it has no entropy).

Random bf16 hidden states and output projection of a Qwen2.5 shape, `--tokens` response tokens, random labels and
random gradients of the log-probs (and of the entropy) from the loss above. For each implementation: the median
time of a forward and backward pass over `--repeats` passes after one warm-up, the peak GPU memory the pass added
to its inputs, and the largest difference of its log-probs and its gradient of the hidden states from ketch's at
the default budget.

    PYTHONPATH=. python3 benchmarks/lm_head.py --shape 1.5b --tokens 8192 32768 --out results/lm_head.json
    PYTHONPATH=. python3 benchmarks/lm_head.py --elements 16777216 67108864 268435456   # other budgets per chunk
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.engine import fused_log_probs as log_probs

SHAPES = {"0.5b": (896, 151936), "1.5b": (1536, 151936), "7b": (3584, 152064)}
"""Hidden size and vocabulary of Qwen2.5's shapes."""


def inputs(tokens: int, hidden: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device).manual_seed(0)
    return {
        "states": (torch.randn(tokens, hidden, generator=g, device=device) * 0.5).bfloat16().requires_grad_(),
        "weight": (torch.randn(vocab, hidden, generator=g, device=device) * 0.02).bfloat16().requires_grad_(),
        "labels": torch.randint(0, vocab, (tokens,), generator=g, device=device),
        "grad_log_prob": torch.randn(tokens, generator=g, device=device) / tokens,
        "grad_entropy": torch.randn(tokens, generator=g, device=device) / tokens,
    }


def ketch_pass(x: dict, calc_entropy: bool, elements: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and the hidden states' gradient through `token_log_probs`, `elements` logits per chunk."""
    chunk = None if elements is None else log_probs.logit_chunk(x["weight"].shape[0], "cuda", elements)
    x["states"].grad = x["weight"].grad = None
    log_prob, entropy = log_probs.token_log_probs(
        x["states"], x["labels"], x["weight"], None, 1.0, calc_entropy, chunk=chunk
    )
    objective = (log_prob * x["grad_log_prob"]).sum()
    if calc_entropy:
        objective = objective + (entropy * x["grad_entropy"]).sum()
    objective.backward()
    return log_prob.detach(), x["states"].grad


def liger_pass(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (minus the per-token loss) and the hidden states' gradient through Liger's fused linear
    cross-entropy with `reduction="none"`."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    x["states"].grad = x["weight"].grad = None
    out = liger_fused_linear_cross_entropy(x["states"], x["weight"], x["labels"], reduction="none")
    loss = getattr(out, "loss", out[0] if isinstance(out, tuple) else out)
    (-(loss.float() * x["grad_log_prob"]).sum()).backward()
    return -loss.detach().float(), x["states"].grad


def measure(run, repeats: int) -> dict:
    """Median seconds of `run()` after a warm-up, and the most memory it allocated beyond what was allocated
    before it."""
    reference = run()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base
    return {"seconds": statistics.median(seconds), "peak_gib": peak / 2**30, "outputs": reference}


def compare(name: str, result: dict, baseline: tuple[torch.Tensor, torch.Tensor]) -> dict:
    log_prob, grad = result.pop("outputs")
    result["max_log_prob_diff"] = (log_prob - baseline[0]).abs().max().item()
    result["max_grad_states_diff"] = (grad.float() - baseline[1].float()).abs().max().item()
    print(name, json.dumps(result), flush=True)
    return result


def run(args) -> list[dict]:
    hidden, vocab = SHAPES[args.shape]
    rows = []
    for tokens in args.tokens:
        rows += rows_for(inputs(tokens, hidden, vocab, torch.device("cuda")), args)
        torch.cuda.empty_cache()
    return rows


def rows_for(x: dict, args) -> list[dict]:
    """Every implementation on the inputs `x`, compared with ketch at its default budget."""
    tokens, vocab = x["states"].shape[0], x["weight"].shape[0]
    common = {"tokens": tokens, "float32_logits_gib": tokens * vocab * 4 / 2**30}
    rows = []
    for calc_entropy in (False, True):
        baseline = None
        for elements in [None, *args.elements]:
            chunk = log_probs.logit_chunk(vocab, "cuda", elements)
            result = measure(partial(ketch_pass, x, calc_entropy, elements), args.repeats)
            baseline = baseline or result["outputs"]
            row = {"impl": "ketch", "entropy": calc_entropy, "chunk": chunk, **common}
            rows.append(row | compare(f"ketch {row}", result, baseline))
        if not calc_entropy and not args.no_liger:
            row = {"impl": "liger", "entropy": False, **common}
            rows.append(row | compare(f"liger {row}", measure(partial(liger_pass, x), args.repeats), baseline))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--elements", type=int, nargs="*", default=[2**24, 2**28], help="other logit budgets per chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-liger", action="store_true", help="leave Liger-Kernel out")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "rows": run(args)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
