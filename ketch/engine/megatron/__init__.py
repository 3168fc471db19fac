"""The Megatron-Core training engine (`strategy=megatron`): tensor and pipeline parallelism on GPUs.

`weights.py` maps HF Llama/Qwen2 weights to Megatron's sharded layout and back (no megatron import);
`model.py` builds the GPTModel chunks; `engine.py` is the engine behind the FSDP2 engine's interface.
"""
