"""What the tests share: tiny models, engine and trainer processes, hostile peers, fault
injection, vLLM fakes and models, and the checks that compare an engine with the trainer."""
