"""Qwen3.5 executor: model, tokenizer, backends, runtime, server."""
