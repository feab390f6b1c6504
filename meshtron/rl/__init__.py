"""Reinforcement learning: environments with verifiable rewards, grouped rollouts from an inference
backend (the in-process engine by default), the GRPO family of losses, packing, and the loop."""
