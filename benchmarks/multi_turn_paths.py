"""Where the GPU's code paths part from the CPU's on the tool example (issue 36), in one device command.

    PYTHONPATH=. python3 benchmarks/multi_turn_paths.py --out $OUT/multi_turn_paths.json [--model DIR] [--device cuda]
        [overrides of the three gpu builds ...]

(On a CPU, `--device cpu model.dtype=bfloat16 model.use_remove_padding=true rollout.hf_decoding=static` runs the
GPU's paths where the CPU has them.)

On the tool example's first warm-up model (`builtin:tiny-calculator-calls`, which calls the tool greedily; built
into the cache first where missing, or `--model`) and the example's settings (examples/tool_calculator.yaml), the
actor and its hf rollout are built four times:

  gpu         the device's defaults (on CUDA: bfloat16, packed forwards, compiled blocks, the compiled static decoder)
  gpu_padded  as gpu, with padded training forwards (model.use_remove_padding=false)
  gpu_eager   as gpu, without compiled training blocks (model.use_torch_compile=false)
  reference   float32, padded forwards, transformers' `generate`, nothing compiled: the CPU's paths

and each check prints what tells them apart:

  varlen   (CUDA) the packed attention's flash path (bfloat16) against float64 causal attention per sequence, at
           the model's head shape and the example's lengths: the largest output error and the relative error of
           each gradient (dq, dk, dv)
  greedy   the model's validation by gpu's rollout and by reference's (128 problems): accuracy, tool-call rate,
           and how many trajectories are identical
  sampled  one training batch (16 prompts x 8 samples at temperature 0.7) from gpu's rollout: distinct trajectories
           and groups whose rewards differ (GRPO learns only from those); then each engine's log-probs of the sampled
           tokens against the rollout's, per kind of turn (`tool_turns`: calls the tool answered, `answer_turns`:
           each trajectory's last): max and mean |p_engine - p_rollout| and the share of tokens whose ratio leaves
           the PPO clip range [0.8, 1.2]
  update   the gradient of one GRPO update on that batch in each gpu engine as the example computes it (pi_old from
           gpu's rollout, the KL loss) against the exact one (reference's with pi_old from its own forward): cosine
           and norm ratio. (The ratio to the rollout's pi_old carries their mismatch, and PPO's clip zeroes tokens
           where it is large: a float32 engine against a bfloat16 rollout kept 0.24 of the direction on this CPU.)
  sft      the loss and gradient of one warm-up SFT step (32 demonstrations) in each engine, the gradient as its
           cosine with reference's
  weights  the actor's MLP weights scaled by 1.1 and handed to gpu's rollout (in place, as after an update): gpu's
           sampled trajectories scored by its own training forward, before and after; a rollout that kept the old
           weights (a CUDA graph or compiled form holding them) gives a large max |dp| after
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.algorithms import turn_masks
from ketch.config import derive_batch_plan, load_config
from ketch.config.schema import BUILTIN_CALLER_MODEL
from ketch.controller import LocalWorkerGroup
from ketch.data import RLHFDataset, SFTDataset, resolve_data_files
from ketch.engine.packing import VARLEN_PARAMETERS, packed_attention
from ketch.models import load_tokenizer
from ketch.protocol import DataProto
from ketch.rewards import RewardScorer
from ketch.rollout.multi_turn import tool_schemas, turn_stop_strings
from ketch.trainer import builtin
from ketch.trainer.validation import generate_and_score, generation_inputs
from ketch.workers import ActorRolloutRefWorker

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "tool_calculator.yaml"
PATHS = {
    "gpu": (),
    "gpu_padded": ("model.use_remove_padding=false",),
    "gpu_eager": ("model.use_torch_compile=false",),
    "reference": (
        "model.dtype=float32",
        "model.use_remove_padding=false",
        "model.use_torch_compile=false",
        "rollout.hf_decoding=generate",
    ),
}
CLIP = 0.2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the model (default: builtin:tiny-calculator-calls, built where missing)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="config overrides of gpu, gpu_padded and gpu_eager")
    args = parser.parse_args()
    runs = tempfile.mkdtemp(prefix="ketch-paths-")
    base = [f"trainer.device={args.device}", f"trainer.default_local_dir={runs}", "trainer.logger=[jsonl]"]
    calls = load_config(str(CONFIG), overrides=[*base, f"model.path={BUILTIN_CALLER_MODEL}"])
    model = args.model or builtin.resolve_model_path(calls)
    # lr 1e-12: the updates below record gradients and leave the weights as they are
    common = [*base, f"model.path={model}", "actor.optim.lr=1e-12", "trainer.seed=0"]
    configs = {
        name: load_config(str(CONFIG), overrides=[*common, *(() if name == "reference" else args.overrides), *paths])
        for name, paths in PATHS.items()
    }
    result = {"model": model, "device": args.device, "torch": torch.__version__, "varlen": sorted(VARLEN_PARAMETERS)}
    if args.device == "cuda":
        result["gpu_name"] = torch.cuda.get_device_name()
        result["varlen_check"] = show("varlen", varlen_check())
    groups = {name: build_group(config) for name, config in configs.items()}
    tokenizer = load_tokenizer(model, False, model)
    reward = RewardScorer(tokenizer)
    result["greedy"] = show("greedy", greedy_check(groups, configs, reward))
    batch = sampled_batch(groups["gpu"], configs["gpu"], reward)
    result["sampled"] = show("sampled", sampled_check(groups, batch))
    result["update"] = show("update", update_check(groups, batch))
    result["sft"] = show("sft", sft_check(groups, configs["reference"], tokenizer))
    result["weights"] = show("weights", weights_check(groups["gpu"], configs["gpu"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def show(name: str, values: dict) -> dict:
    print(f"== {name}: {json.dumps(values, indent=1)}", flush=True)
    return values


def build_group(config) -> LocalWorkerGroup:
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, config.model.path, derive_batch_plan(config), 10)
    group.init_model()
    return group


def varlen_check() -> dict:
    """The packed attention (bfloat16, `varlen_attn` where this torch has it) against float64 causal attention of
    each sequence, 4 query heads on 2 key/value heads of 32 (the built-in model), 64 sequences of 1 to 200 tokens."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1, 200, *torch.randint(20, 161, (62,), generator=torch.Generator().manual_seed(0)).tolist()]
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = (
        torch.randn(1, h, sum(lengths), 32, device="cuda", generator=g).bfloat16().requires_grad_() for h in (4, 2, 2)
    )
    out, _ = packed_attention(None, q, k, v, None, cu_seq_lens_q=offsets, max_length_q=max(lengths))
    grad_out = torch.randn(out.shape, device="cuda", generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * grad_out).sum(), (q, k, v))
    pieces = []
    for start, end in itertools.pairwise(offsets.tolist()):
        qs, ks, vs = (t[0, :, start:end].double() for t in (q, k, v))
        ks, vs = (t.repeat_interleave(2, dim=0) for t in (ks, vs))
        pieces.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    exact = torch.cat(pieces)[None]
    exact_grads = torch.autograd.grad((exact * grad_out).sum(), (q, k, v))
    errors = {"output_max_abs": (out.double() - exact).abs().max().item()}
    for name, got, want in zip("qkv", grads, exact_grads, strict=True):
        errors[f"d{name}_relative"] = ((got.double() - want.double()).norm() / want.double().norm()).item()
    return {name: round(value, 5) for name, value in errors.items()}


def greedy_check(groups: dict, configs: dict, reward: RewardScorer) -> dict:
    """Validation of the model by gpu's rollout and by reference's, and how many trajectories agree."""
    out, texts = {}, {}
    for name in ("gpu", "reference"):
        c = configs[name]
        val = RLHFDataset(resolve_data_files(c.data.val_files), reward.tokenizer, c.data)
        metrics = generate_and_score(groups[name], val, reward, c.rollout.val, None)
        texts[name] = [row["response"] for row in metrics.samples]
        keys = ("val/ketch/calculator/acc", "val/multi_turn/tool_call_rate", "val/multi_turn/tool_error_rate")
        out[name] = {key.rsplit("/", 1)[-1]: round(metrics[key], 4) for key in keys if key in metrics}
    out["identical_trajectories"] = sum(a == b for a, b in zip(texts["gpu"], texts["reference"], strict=True))
    out["trajectories"] = len(texts["gpu"])
    return out


def sampled_batch(group: LocalWorkerGroup, config, reward: RewardScorer) -> DataProto:
    """The example's first training batch, sampled by `group`'s rollout and scored: the rollout's fields,
    `scores` `[batch]` and `advantages` (GRPO's: each sample's score normalized within its prompt's group)."""
    dataset = RLHFDataset(resolve_data_files(config.data.train_files), reward.tokenizer, config.data)
    rows = config.data.train_batch_size
    data = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(rows)]))
    data = data.repeat(config.rollout.n, interleave=True)
    torch.manual_seed(0)
    data = data.union(group.generate_sequences(generation_inputs(data)))
    _, info = reward(data)
    scores = torch.tensor(info["scores"], dtype=torch.float32)
    grouped = scores.view(rows, config.rollout.n)
    normalized = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)
    data.batch["scores"] = scores
    data.batch["advantages"] = normalized.view(-1, 1) * data.batch["response_mask"]
    return data


def sampled_check(groups: dict, data: DataProto) -> dict:
    """Diversity of the sampled batch, and each engine's log-probs against the rollout's per kind of turn."""
    b, n = data.batch, 8
    real = b["attention_mask"][:, -b["responses"].shape[1] :].bool()
    responses = [tuple(row[mask].tolist()) for row, mask in zip(b["responses"], real, strict=True)]
    out = {
        "mean_score": round(b["scores"].mean().item(), 4),
        "distinct_trajectories_per_group": sum(len(set(responses[i : i + n])) for i in range(0, len(responses), n))
        / (len(responses) // n),
        "groups_with_reward_spread": int((b["scores"].view(-1, n).std(-1) > 0).sum()),
        "groups": len(responses) // n,
    }
    turns = turn_masks(b["response_mask"], real)
    rollout = b["rollout_log_probs"]
    for name, group in groups.items():
        log_prob = group.compute_log_prob(data).batch["old_log_prob"]
        out[name] = {}
        for kind, mask in turns.items():
            if mask.any():
                diff = (log_prob.exp() - rollout.exp()).abs()[mask]
                ratio = (log_prob - rollout)[mask].exp()
                clipped = ((ratio - 1).abs() > CLIP).float().mean().item()
                out[name][kind] = {
                    "tokens": int(mask.sum()),
                    "max_dp": round(diff.max().item(), 5),
                    "mean_dp": round(diff.mean().item(), 6),
                    "outside_clip": round(clipped, 5),
                }
    return out


def gradients(group: LocalWorkerGroup, call) -> dict[str, torch.Tensor]:
    """The actor's gradients (float32, on the CPU) at the next optimizer step, which `call()` makes."""
    grads, engine = {}, group.worker.actor
    hook = engine.optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.full_tensor().float().cpu() for n, p in engine.module.named_parameters()})
    )
    call()
    hook.remove()
    return grads


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x, y = (torch.cat([g[name].flatten() for name in sorted(a)]) for g in (a, b))
    return round(torch.nn.functional.cosine_similarity(x, y, dim=0).item(), 5)


def update_check(groups: dict, data: DataProto) -> dict:
    """Each gpu engine's GRPO gradient as the example computes it (pi_old from gpu's rollout, the KL loss) against
    the exact one (reference's, pi_old from its own forward: ratio 1): cosine and norm ratio."""
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages")
    update = DataProto.from_dict({k: data.batch[k] for k in keys})
    grads = {}
    for name, group in groups.items():  # each engine's own reference model gives the KL loss's log-probs
        own = group.compute_log_prob(update).batch["old_log_prob"]
        old = own if name == "reference" else data.batch["rollout_log_probs"]
        batch = update.union(DataProto.from_dict({"old_log_prob": old})).union(group.compute_ref_log_prob(update))
        grads[name] = gradients(group, lambda g=group, d=batch: g.update_actor(d))
    exact = grads.pop("reference")
    norm = torch.cat([g.flatten() for g in exact.values()]).norm()
    return {
        name: {
            "cosine": cosine(grad, exact),
            "norm_ratio": round((torch.cat([g.flatten() for g in grad.values()]).norm() / norm).item(), 4),
        }
        for name, grad in grads.items()
    }


def sft_check(groups: dict, config, tokenizer) -> dict:
    """Loss and gradient cosine (with reference's) of one SFT step on 32 of the first warm-up's demonstrations."""
    c = load_config(overrides=[*builtin.CALLER_WARMUP_OVERRIDES, f"model.path={config.model.path}"])
    stop, tools = turn_stop_strings(c, tokenizer), tool_schemas(c)
    dataset = SFTDataset(resolve_data_files(c.data.train_files), tokenizer, c.data, turn_stop=stop, tools=tools)
    data = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(32)]))
    losses, grads = {}, {}
    for name, group in groups.items():
        grads[name] = gradients(group, lambda g=group, n=name: losses.update({n: g.sft_step(data)}))
    out = {name: {"loss": round(losses[name].meta_info["metrics"]["sft/loss"], 5)} for name in groups}
    for name in groups:
        out[name]["cosine"] = cosine(grads[name], grads["reference"])
    return out


def weights_check(group: LocalWorkerGroup, config) -> dict:
    """After the actor's MLP weights change and reach the rollout in place, gpu's sampled trajectories scored by its
    own training forward, before and after (a rollout decoding with the old weights differs after)."""
    tokenizer = group.worker.tokenizer
    dataset = RLHFDataset(resolve_data_files(config.data.val_files), tokenizer, config.data)
    prompts = generation_inputs(DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(32)])))

    def mismatch() -> float:
        data = group.generate_sequences(prompts)
        log_prob = group.compute_log_prob(data).batch["old_log_prob"]
        mask = data.batch["response_mask"].bool()
        return round((log_prob.exp() - data.batch["rollout_log_probs"].exp()).abs()[mask].max().item(), 5)

    before = mismatch()
    module = group.worker.actor.module
    for unit in module.modules():  # sharded, as after a backward pass, where the optimizer changes the weights
        if isinstance(unit, FSDPModule):
            unit.reshard()
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ".mlp." in name:
                param.mul_(1.1)
    group.sync_rollout()
    return {"max_dp_before": before, "max_dp_after": mismatch()}


if __name__ == "__main__":
    main()
