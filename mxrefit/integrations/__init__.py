"""Other projects' engines and trainers: vLLM (``integrations.vllm``, one module a job) and TRL
(``integrations.trl``). Each imports its project only where used; none registers anything on import."""
