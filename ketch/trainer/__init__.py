"""The training loops: `PPOTrainer` (RL), `SFTTrainer`, `RMTrainer`, the `TrainingLoop` they share, and the
built-in warm-up, checkpoints, export and validation around them."""
