"""Inference: the continuous-batching engine (`engine.LLMEngine`), its OpenAI-compatible server
(`server`), per-request sampling, and the one-request reference loop (`simple.generate_tokens`)."""
