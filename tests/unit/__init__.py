"""Fast tests: one process, no vLLM (kernels under the Triton interpreter run in a child only for its environment)."""
