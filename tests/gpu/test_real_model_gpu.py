"""SmolLM2-135M-Instruct (a Llama) on one GPU with the defaults: packed training forwards give the padded ones'
log-probs within bf16's error, and two GRPO steps run packed, with the static decoder."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ketch.config import load_config
from ketch.engine.heads import PolicyModel
from ketch.models import load_causal_lm
from ketch.trainer.ppo import PPOTrainer

CUDA = torch.device("cuda")


def test_smollm2_packs_and_trains_two_grpo_steps_with_the_defaults(smollm2_dir, tmp_path):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([40, 17, 25, 60])
    attention_mask = (torch.arange(64) >= 64 - lengths[:, None]).long()  # left-padded, the last 16 the response
    input_ids = torch.randint(100, 40000, attention_mask.shape, generator=g) * attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    mask = attention_mask[:, -16:].bool()
    out = {}
    for name, dtype, packed in (("float32", torch.float32, False), ("padded", torch.bfloat16, False),
                                ("packed", torch.bfloat16, True), ("packed_float32", torch.float32, True)):  # fmt: skip
        head = PolicyModel(load_causal_lm(str(smollm2_dir), dtype), packed).to(CUDA)
        assert head.packed == packed
        with torch.no_grad():
            log_prob = head(*(t.to(CUDA) for t in (input_ids, attention_mask, position_ids)), 16)["log_prob"]
        out[name] = log_prob[mask.to(CUDA)].float()
    errors = {name: (out[name] - out["float32"]).abs().mean().item() for name in ("padded", "packed", "packed_float32")}
    print("smollm2 mean abs log-prob error against float32 padded:", errors)
    assert errors["packed_float32"] < 1e-4
    assert errors["packed"] <= 1.5 * errors["padded"] and errors["packed"] < 0.2

    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b),
             "data_source": "qa"} for a, b in ((2, 3), (10, 7), (4, 4), (9, 1))]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "score.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(str(ground_truth) in solution_str)\n"
    )
    config = load_config(overrides=[
        f"model.path={smollm2_dir}", f"data.train_files=[{tmp_path / 'train.parquet'}]", "data.val_files=[]",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "data.max_prompt_length=64",
        "data.max_response_length=32", "rollout.n=4", "algorithm.adv_estimator=grpo",
        f"reward.function={tmp_path / 'score.py'}:score", "trainer.total_steps=2", "trainer.device=cuda",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={tmp_path / 'runs'}",
    ])  # fmt: skip
    trainer = PPOTrainer(config)
    trainer._open()
    steps = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    worker = trainer.actor_rollout.worker
    assert worker.actor.module.packed and worker.rollout.decoder is not None
    trainer.groups.shutdown()
    diffs = [m["training/rollout_probs_diff_max"] for m in steps]
    print("smollm2 GRPO steps: rollout_probs_diff_max", diffs, "pg_loss", [m["actor/pg_loss"] for m in steps])
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in steps) and max(diffs) < 0.1
