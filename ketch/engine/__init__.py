"""The training engine: the FSDP2 and Megatron engines, the model heads they train, packing, log-probs, the
optimizer, LoRA, checkpoints and the HF export."""
