"""FP8 weight scales on a real model: how far the next-token distributions move when the decoder blocks' projections
are rounded to float8 e4m3 with one scale per output channel (what `rollout.quantization=fp8` decodes with), per
128 x 128 block, or per group of 128 or 64 inputs of a channel (issue 53: "say which, measured"), and per channel
with the projections' inputs rounded per token too (what `torch._scaled_mm` multiplies).

    PYTHONPATH=. python3 benchmarks/fp8_scales.py --model DIR [--out FILE]

`--model` is a Hugging Face directory (e.g. SmolLM2-135M-Instruct from `ketch convert-gguf`). In float32 on the CPU,
teacher-forced over 8 prompts of `lora_learning.py`'s sums task with an answer: for each scheme, the mean KL
divergence of the rounded model's next-token distribution from the model's (nats a token) and the share of tokens
whose most likely next token stays the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.rollout.fp8 import PROJECTIONS, dequantize, quantize_blocks, quantize_per_channel

SUMS = [(3, 17), (12, 9), (20, 20), (7, 14), (1, 19), (15, 6), (11, 11), (2, 8)]


def grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    """`weight` `[out, in]` rounded to e4m3 with one scale per `group` inputs of each output channel (per channel
    where `in` is not a multiple of `group`), back in float32."""
    groups = weight if weight.shape[1] % group else weight.reshape(-1, group)  # a group is a row to the quantizer
    return dequantize(quantize_per_channel(groups)).view_as(weight)


SCHEMES = {
    "per_channel": lambda w: dequantize(quantize_per_channel(w)),
    "block_128x128": lambda w: dequantize(quantize_blocks(w)),
    "group_1x128": lambda w: grouped(w, 128),
    "group_1x64": lambda w: grouped(w, 64),
}
ACTIVATIONS = "per_channel_activations_per_token"
"""One more scheme: the per-channel weights with each projection's input rows rounded per token too, what
`torch._scaled_mm` multiplies (`fp8.fp8_linear` past `fp8.WEIGHT_ONLY_ROWS` rows)."""


def round_inputs(module: torch.nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: the projection's input `[..., in]` rounded to e4m3 per token, back in float32."""
    rows = args[0].reshape(-1, args[0].shape[-1])
    return (dequantize(quantize_per_channel(rows)).view_as(args[0]),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}], tokenize=False,
                                      add_generation_prompt=True) + f"{a} + {b} = {a + b}"
        for a, b in SUMS
    ]  # fmt: skip
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    projections = {n: p for n, p in model.named_parameters() if n.rsplit(".", 2)[-2] in PROJECTIONS and p.dim() == 2}
    kept = {name: weight.detach().clone() for name, weight in projections.items()}
    with torch.no_grad():
        reference = model(**batch).logits.log_softmax(-1)
        result = {"model": args.model, "tokens": int(real.sum()), "projections": len(projections), "schemes": {}}

        def measure(scheme: str) -> None:
            log_probs = model(**batch).logits.log_softmax(-1)
            kl = (reference.exp() * (reference - log_probs)).sum(-1)[real].mean().item()
            same = (reference.argmax(-1) == log_probs.argmax(-1))[real].float().mean().item()
            result["schemes"][scheme] = {"kl_nats_per_token": round(kl, 4), "same_top_token": round(same, 4)}
            print(scheme, result["schemes"][scheme], flush=True)

        for scheme, rounded in SCHEMES.items():
            for name, weight in projections.items():
                weight.copy_(rounded(kept[name]))
            measure(scheme)
        for name, weight in projections.items():
            weight.copy_(SCHEMES["per_channel"](kept[name]))
        modules = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]
        hooks = [module.register_forward_pre_hook(round_inputs) for module in modules]
        measure(ACTIVATIONS)
        for hook in hooks:
            hook.remove()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
