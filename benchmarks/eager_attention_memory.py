"""Peak GPU memory of one training forward and backward pass on transformers' eager attention against SDPA, beside
`ketch doctor`'s estimate of the scores eager attention keeps (`ketch.config.memory.eager_score_bytes`).

A Gemma 2 shape (attention logits soft-capped; hidden 1024, 8 layers, 8 heads of 128, a 1,024-token vocabulary,
random bf16 weights) and the same shape without the cap, one padded sequence of each `--length` tokens, with and
without recomputation (transformers' non-reentrant checkpointing): each run's peak allocated above the weights,
eager's peak minus SDPA's, and the estimate, printed and written to `--out`.

    PYTHONPATH=. python3 benchmarks/eager_attention_memory.py --length 2048 4096 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from ketch.config import load_config
from ketch.config.memory import eager_score_bytes

GIB = 2**30


def shape(softcap: float | None) -> Gemma2Config:
    """The measured Gemma 2 shape, with the attention soft cap `softcap` (None: without one)."""
    return Gemma2Config(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, vocab_size=1024, attn_logit_softcapping=softcap,
        final_logit_softcapping=None, sliding_window=1 << 20,
    )  # fmt: skip


def peak_bytes(config: Gemma2Config, attention: str, length: int, recompute: bool) -> int:
    """Peak CUDA memory allocated above the model's weights over one forward and backward pass of one sequence
    of `length` tokens (its first 16 padding) under `attention`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.bfloat16).cuda()
    model.train()
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    input_ids = torch.randint(0, config.vocab_size, (1, length), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, :16] = 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model(input_ids=input_ids, attention_mask=attention_mask).logits.float().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model
    torch.cuda.empty_cache()
    return peak


def estimate(config: Gemma2Config, length: int, recompute: bool) -> int:
    """`ketch doctor`'s eager scores for one micro-batch of one sequence of `length` tokens."""
    ketch_config = load_config(
        overrides=[
            "trainer.device=cuda",
            "data.max_prompt_length=16",
            f"data.max_response_length={length - 16}",
            "actor.use_dynamic_bsz=true",
            f"actor.ppo_max_token_len_per_device={length}",
            f"model.gradient_checkpointing={str(recompute).lower()}",
        ]
    )
    return eager_score_bytes(ketch_config, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for softcap, length, recompute in [(c, n, r) for c in (50.0, None) for n in args.length for r in (False, True)]:
        config = shape(softcap)
        eager, sdpa = (peak_bytes(config, a, length, recompute) for a in ("eager", "sdpa"))
        row = {"softcap": softcap, "length": length, "recompute": recompute, "eager_peak": eager, "sdpa_peak": sdpa}
        row |= {"eager_minus_sdpa": eager - sdpa, "estimate": estimate(config, length, recompute)}
        rows.append(row)
        print(
            f"softcap {softcap} length {length} recompute {recompute}: eager {eager / GIB:.2f} GiB, sdpa "
            f"{sdpa / GIB:.2f} GiB, difference {(eager - sdpa) / GIB:.2f} GiB, estimate {row['estimate'] / GIB:.2f} GiB"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
