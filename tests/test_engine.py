"""The FSDP2 training engine: global loss normalisation and log-probs that agree with the rollout."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from recorded_grads import record_grads
from torch.distributed.tensor import DTensor

from ketch.algorithms import policy_loss
from ketch.architecture import LogitTransform
from ketch.config.schema import OptimConfig
from ketch.engine.distributed import init_process_group
from ketch.engine.engine import TrainEngine, compile_blocks, transformer_blocks
from ketch.engine.fused_log_probs import logit_chunk, token_log_probs
from ketch.engine.heads import PolicyModel
from ketch.engine.micro import split_micro_batches
from ketch.models import load_causal_lm
from ketch.protocol import DataProto

CPU = torch.device("cpu")


def make_batch(vocab: int, rows: int = 8, prompt_len: int = 5, response_len: int = 6) -> DataProto:
    """Random sequences; response lengths 1..6 so that rows hold different numbers of valid tokens."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, vocab, (rows, prompt_len + response_len), generator=g)
    lengths = torch.tensor([1, 6, 3, 6, 2, 5, 4, 6])[:rows]
    response_mask = (torch.arange(response_len) < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, prompt_len, dtype=torch.long), response_mask], dim=1)
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, prompt_len:],
            "response_mask": response_mask,
            "old_log_prob": -torch.rand(rows, response_len, generator=g) * 3,
            "advantages": torch.randn(rows, response_len, generator=g),
        }
    )


def engine_for(model_dir) -> TrainEngine:
    init_process_group(CPU)
    lm = load_causal_lm(str(model_dir), torch.float32, "eager")
    return TrainEngine(PolicyModel(lm), CPU, OptimConfig(lr=0.0, grad_clip=0.0), total_steps=1)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradient_is_the_same_for_one_micro_batch_of_8_and_8_of_1(tiny_model_dir, mode):
    def loss_fn(out, micro, num_tokens, num_seqs):
        b = micro.batch
        loss, _ = policy_loss(
            b["old_log_prob"],
            out["log_prob"],
            b["advantages"],
            b["response_mask"],
            loss_agg_mode=mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        return loss, {}

    whole, split = engine_for(tiny_model_dir), engine_for(tiny_model_dir)
    g_whole, g_split = record_grads(whole), record_grads(split)
    data = make_batch(vocab=100)
    metrics_whole = whole.train_mini_batch(split_micro_batches(data, 8), loss_fn)
    metrics_split = split.train_mini_batch(split_micro_batches(data, 1), loss_fn)
    assert metrics_split["loss"] == pytest.approx(metrics_whole["loss"], abs=1e-6)
    assert all(p.grad is None for p in whole.module.parameters())  # freed after the step
    assert len(g_whole) == len(g_split) > 0
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], atol=1e-6, rtol=1e-5)


def test_a_recomputing_engine_frees_the_blocks_weights_after_the_forward_with_the_same_gradients(tiny_model_dir):
    """In a world of one process, the blocks keep their gathered weights from the forward to the backward pass;
    with gradient checkpointing they give them back after the forward and gather them again for the backward."""
    init_process_group(CPU)
    engines, blocks, gathered, recorded = {}, {}, {}, {}
    for recompute in (False, True):
        policy = PolicyModel(load_causal_lm(str(tiny_model_dir), torch.float32, "eager"))
        blocks[recompute] = transformer_blocks(policy)  # before sharding: FSDP renames their classes
        engine = TrainEngine(
            policy, CPU, OptimConfig(lr=0.0, grad_clip=0.0), total_steps=1, gradient_checkpointing=recompute
        )
        engines[recompute], recorded[recompute] = engine, record_grads(engine)

    def loss_fn(out, micro, num_tokens, num_seqs, recompute):
        params = [p for block in blocks[recompute] for p in block.parameters()]
        gathered[recompute] = [not isinstance(p, DTensor) for p in params]
        b = micro.batch
        return policy_loss(b["old_log_prob"], out["log_prob"], b["advantages"], b["response_mask"])[0], {}

    for recompute, engine in engines.items():
        engine.train_mini_batch(split_micro_batches(make_batch(vocab=100), 8), partial(loss_fn, recompute=recompute))
    assert len(gathered[False]) == len(gathered[True]) > 0
    assert all(gathered[False]) and not any(gathered[True])
    for name, grad in recorded[False].items():
        torch.testing.assert_close(recorded[True][name], grad, atol=1e-6, rtol=1e-5)


def test_activations_kept_in_host_memory_give_the_same_gradients_and_with_recomputation_only_the_checkpoints(
    tiny_model_dir,
):
    """`activation_offload` copies what the forward saves to host memory and back for the backward pass: the
    gradients do not change. With gradient checkpointing only the checkpoints move (each of the 2 blocks' input,
    8 rows x 11 tokens x 32 float32 numbers, and what the heads outside the blocks save), not every activation."""
    init_process_group(CPU)
    engines, recorded = {}, {}
    for recompute, offload in ((False, False), (False, True), (True, True)):
        policy = PolicyModel(load_causal_lm(str(tiny_model_dir), torch.float32, "eager"))
        engine = TrainEngine(
            policy,
            CPU,
            OptimConfig(lr=0.0, grad_clip=0.0),
            total_steps=1,
            gradient_checkpointing=recompute,
            activation_offload=offload,
        )
        engines[recompute, offload], recorded[recompute, offload] = engine, record_grads(engine)

    def loss_fn(out, micro, num_tokens, num_seqs):
        b = micro.batch
        return policy_loss(b["old_log_prob"], out["log_prob"], b["advantages"], b["response_mask"])[0], {}

    for engine in engines.values():
        engine.train_mini_batch(split_micro_batches(make_batch(vocab=100), 8), loss_fn)
    assert engines[False, False].host_activations is None
    everything, checkpoints = (engines[key].host_activations.moved_bytes for key in ((False, True), (True, True)))
    assert checkpoints >= 2 * 8 * 11 * 32 * 4
    assert checkpoints < everything / 4, (checkpoints, everything)
    for key in ((False, True), (True, True)):
        for name, grad in recorded[False, False].items():
            torch.testing.assert_close(recorded[key][name], grad, atol=1e-6, rtol=1e-5, msg=f"{key} {name}")


def test_token_budget_micro_batches_keep_order_and_respect_the_budget():
    data = make_batch(vocab=100)
    lengths = data.batch["attention_mask"].sum(-1).tolist()  # [6, 11, 8, 11, 7, 10, 9, 11]
    parts = split_micro_batches(data, None, max_tokens=20)
    assert [len(p) for p in parts] == [2, 2, 2, 2]  # 6+11, 8+11, 7+10, 9+11
    assert all(p.batch["attention_mask"].sum() <= 20 for p in parts)
    assert torch.equal(DataProto.concat(parts).batch["input_ids"], data.batch["input_ids"])
    assert lengths == [6, 11, 8, 11, 7, 10, 9, 11]


def test_a_sequence_longer_than_the_token_budget_gets_a_micro_batch_alone_and_its_neighbours_keep_theirs():
    lengths = [3, 4, 20, 2, 5, 1]
    mask = (torch.arange(24) < torch.tensor(lengths)[:, None]).long()
    data = DataProto.from_dict({"attention_mask": mask, "input_ids": torch.arange(6)[:, None].expand(6, 24)})
    parts = split_micro_batches(data, None, max_tokens=8)
    assert [p.batch["attention_mask"].sum(-1).tolist() for p in parts] == [[3, 4], [20], [2, 5, 1]]
    assert torch.equal(DataProto.concat(parts).batch["input_ids"], data.batch["input_ids"])


def test_token_log_probs_and_their_gradients_equal_the_full_softmax():
    """Chunks of 3 of 10 tokens (the last one shorter) against autograd through the full float64 softmax."""
    g = torch.Generator().manual_seed(1)
    states = torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(30, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 30, (10,), generator=g)
    grad_lp, grad_ent = torch.randn(2, 10, generator=g, dtype=torch.float64)

    log_prob, entropy = token_log_probs(states, labels, weight, bias, temperature=0.7, calc_entropy=True, chunk=3)
    got = torch.autograd.grad((log_prob * grad_lp + entropy * grad_ent).sum(), (states, weight, bias))

    logits = (states @ weight.T + bias) / 0.7
    expected_lp = logits.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    expected_ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    expected = torch.autograd.grad((expected_lp * grad_lp + expected_ent * grad_ent).sum(), (states, weight, bias))
    torch.testing.assert_close(log_prob.double(), expected_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy.double(), expected_ent, atol=1e-6, rtol=0)
    for name, a, b in zip(("states", "weight", "bias"), got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)


def test_token_log_probs_without_entropy_differentiate_the_log_probs_only():
    g = torch.Generator().manual_seed(2)
    states = torch.randn(5, 4, generator=g, requires_grad=True)
    weight = torch.randn(7, 4, generator=g)
    labels = torch.tensor([0, 6, 3, 3, 1])
    log_prob, entropy = token_log_probs(states, labels, weight, None, temperature=1.0, calc_entropy=False, chunk=2)
    assert entropy is None
    (grad,) = torch.autograd.grad(log_prob.sum(), states)
    # d/ds sum_i log softmax(s_i W^T)[y_i] = W[y_i] - sum_v p_iv W[v]
    p = (states @ weight.T).softmax(-1)
    torch.testing.assert_close(grad, weight[labels] - p @ weight, atol=1e-6, rtol=1e-5)
    empty, _ = token_log_probs(states[:0], labels[:0], weight, None, 1.0, calc_entropy=False)
    assert empty.shape == (0,) and empty.requires_grad  # a micro-batch without response tokens still backpropagates


def _full_softmax(states, labels, weight, bias, transform: LogitTransform, temperature: float):
    """Log-probs and entropy `[tokens]` through the whole `[tokens, vocab]` logits, differentiated by autograd."""
    logits = (states @ weight.T + bias) * transform.scale
    logits = transform.softcap * torch.tanh(logits / transform.softcap) / temperature
    log_softmax = logits.log_softmax(-1)
    return log_softmax.gather(-1, labels[:, None]).squeeze(-1), -(log_softmax.exp() * log_softmax).sum(-1)


@pytest.mark.parametrize("calc_entropy", [True, False])
def test_fused_log_probs_entropy_and_gradients_agree_with_the_full_logits_in_float32(calc_entropy):
    """float32, 37 tokens in chunks of 8 (the last shorter), a scale and a soft cap (Gemma's, Granite's), a bias and
    a temperature: the fused pass and autograd through the whole logits agree to 1e-5."""
    g = torch.Generator().manual_seed(3)
    states = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = (torch.randn(500, 16, generator=g) * 0.5).requires_grad_()
    bias = torch.randn(500, generator=g, requires_grad=True)
    labels = torch.randint(0, 500, (37,), generator=g)
    grad_lp, grad_ent = torch.randn(2, 37, generator=g)
    transform = LogitTransform(scale=0.8, softcap=30.0)

    log_prob, entropy = token_log_probs(states, labels, weight, bias, 0.7, calc_entropy, chunk=8, transform=transform)
    expected_lp, expected_ent = _full_softmax(states, labels, weight, bias, transform, 0.7)
    objective = (log_prob * grad_lp).sum() + ((entropy * grad_ent).sum() if calc_entropy else 0)
    expected_objective = (expected_lp * grad_lp).sum() + ((expected_ent * grad_ent).sum() if calc_entropy else 0)
    got = torch.autograd.grad(objective, (states, weight, bias))
    expected = torch.autograd.grad(expected_objective, (states, weight, bias))
    torch.testing.assert_close(log_prob, expected_lp, atol=1e-5, rtol=0)
    if calc_entropy:
        torch.testing.assert_close(entropy, expected_ent, atol=1e-5, rtol=0)
    for name, a, b in zip(("states", "weight", "bias"), got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_chunks_hold_a_bounded_number_of_logits_whatever_the_vocabulary():
    assert logit_chunk(151936, "cuda") == 441  # Qwen2.5: 2^26 logits per chunk
    assert logit_chunk(32000, "cuda") == 2097
    assert logit_chunk(1000, "cuda") == 4096  # at most LOGIT_CHUNK tokens
    assert logit_chunk(151936, "cpu") == 16  # at least MIN_LOGIT_CHUNK
    assert logit_chunk(16384, "cpu") == 64  # 2^20 logits per chunk


_PEAK = """
import torch
from ketch.engine.fused_log_probs import token_log_probs

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

vocab, hidden = 16384, 16
for tokens in (256, 4096, 8192):  # the first pass sets up what torch sets up once
    g = torch.Generator().manual_seed(0)
    states = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from the current one
    before = status("VmRSS:")
    log_prob, entropy = token_log_probs(states, labels, weight, None, 1.0, calc_entropy=True)
    (log_prob.sum() + entropy.sum()).backward()
    print(status("VmHWM:") - before)
"""


def test_the_lm_head_passs_peak_memory_grows_with_the_tokens_not_with_tokens_times_vocabulary():
    """The forward and backward pass of log-probs and entropy over 4,096 and 8,192 tokens of a 16k vocabulary (whose
    float32 logits take 256 and 512 MiB), measured as the growth of a fresh process's peak resident memory. Every
    allocation over 64 KiB is its own mapping (glibc's MALLOC_MMAP_THRESHOLD_), returned at once when freed, so the
    resident size follows what is allocated, whatever else runs on the machine."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _PEAK], env=env, cwd=root, capture_output=True, text=True, check=True)
    peak_4k, peak_8k = (int(line) for line in done.stdout.split()[1:])
    logits_4k = 4096 * 16384 * 4
    assert peak_8k < 2.2 * peak_4k, (peak_4k, peak_8k)
    assert peak_4k < logits_4k / 8 and peak_8k < 2 * logits_4k / 8, (peak_4k, peak_8k)


def test_load_kernels_loads_the_two_saved_kernels_on_cuda_only(monkeypatch):
    """On CUDA the two fused kernels are saved compiled functions, whose forms `TrainEngine` loads when it is
    set up (not in the first update); on the CPU they are plain functions and nothing loads."""
    import ketch.engine.fused_log_probs as log_probs

    class Kernel:
        loads = 0

        def load(self):
            self.loads += 1

    kernels = (Kernel(), Kernel())
    monkeypatch.setattr(log_probs, "_kernels", {"cuda": kernels}.__getitem__)
    log_probs.load_kernels(torch.device("cuda", 0))
    assert [k.loads for k in kernels] == [1, 1]
    log_probs.load_kernels(CPU)
    assert [k.loads for k in kernels] == [1, 1]


def test_a_compiling_engine_sends_every_sharded_block_through_one_saved_function(tiny_model_dir, tmp_path, monkeypatch):
    """`compile=True` compiles the blocks before sharding (FSDP gives the blocks a class of its own, and
    `transformer_blocks` finds them by their class's name) and loads the saved forms after it (their guards
    name FSDP's class); engines of the same blocks share the compiled function and its forms."""
    from ketch.compiled import SavedCompile
    from ketch.engine.engine import transformer_blocks

    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))
    init_process_group(CPU)
    blocks = []
    for optim in (OptimConfig(lr=0.0), None):  # an actor and its reference: one compiled function, shared
        policy = PolicyModel(load_causal_lm(str(tiny_model_dir), torch.float32))
        blocks += transformer_blocks(policy)
        TrainEngine(policy, CPU, optim, total_steps=1, compile=True)
    functions = {block.forward.func for block in blocks}
    assert len(blocks) == 4 and len(functions) == 1
    compiled = functions.pop()
    assert isinstance(compiled, SavedCompile) and compiled.forms == []  # loaded: nothing saved in this cache
    assert type(blocks[0]).__name__ == "FSDPQwen2DecoderLayer"


def test_compiled_blocks_give_the_eager_log_probs_entropy_and_gradients(tiny_model_dir, tmp_path, monkeypatch):
    """Each decoder block through torch.compile (dynamo and AOTAutograd, FSDP's hooks outside; `aot_eager` keeps
    the test fast on a CPU) against the eager model: same outputs and gradients, one graph for both blocks."""
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))  # no forms saved by other tests
    init_process_group(CPU)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engines = {}
    for compiled in (False, True):
        policy = PolicyModel(load_causal_lm(str(tiny_model_dir), torch.float32))
        if compiled:
            assert compile_blocks(policy, backend="aot_eager") is not None
        engines[compiled] = TrainEngine(policy, CPU, OptimConfig(lr=0.0, grad_clip=0.0), total_steps=1)
    data = make_batch(vocab=100)
    out = {c: e.infer(data, micro_batch_size=8, calc_entropy=True) for c, e in engines.items()}
    for key in ("log_prob", "entropy"):
        torch.testing.assert_close(out[True][key], out[False][key], atol=1e-6, rtol=0)

    def loss_fn(o, micro, num_tokens, num_seqs):
        b = micro.batch
        return policy_loss(b["old_log_prob"], o["log_prob"], b["advantages"], b["response_mask"])[0], {}

    g_compiled, g_eager = record_grads(engines[True]), record_grads(engines[False])
    metrics = {c: e.train_mini_batch(split_micro_batches(data, 8), loss_fn) for c, e in engines.items()}
    assert metrics[True]["grad_norm"] == pytest.approx(metrics[False]["grad_norm"], abs=1e-6)
    assert metrics[False]["grad_norm"] > 1e-3
    assert len(g_eager) == len(g_compiled) > 0
    for name in g_eager:
        torch.testing.assert_close(g_compiled[name], g_eager[name], atol=1e-6, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the blocks' forward: no grad, and grad
