import tempfile, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from vllm import LLM, SamplingParams
from mxrefit import Sender
from mxrefit.integrations.vllm.client import refit_while

if __name__ == "__main__":  # vLLM starts its engine in a new process
    torch.manual_seed(0)
    policy = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=32)).bfloat16()
    path = tempfile.mkdtemp(); policy.save_pretrained(path)        # the engine starts from the step-0 policy
    llm = LLM(model=path, skip_tokenizer_init=True, gpu_memory_utilization=0.05, max_model_len=64, enforce_eager=True,
              worker_extension_cls="mxrefit.integrations.vllm.worker.RefitWorkerExtension")
    info = llm.collective_rpc("mxrefit_init")[0]                     # once: engine tables + control socket
    sender = Sender(info["address"], bytes.fromhex(info["token"]))   # CPU: shared memory; GPU: device="cuda", CUDA IPC
    greedy = lambda: llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=6),
                                  use_tqdm=False)[0].outputs[0].token_ids
    print("before:", greedy())
    for step in range(3):
        with torch.no_grad():                                        # stand-in for an optimizer step
            for p in policy.parameters(): p.add_(0.05 * torch.randn_like(p))
        r = refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, dict(policy.named_parameters()))
        llm.reset_prefix_cache()                                     # cached KV came from the old weights
        print(f"refit {r.version}: {r.bytes / 1e6:.2f} MB in {r.total_s * 1e3:.1f} ms ({r.transport}) ->", greedy())
    llm.collective_rpc("mxrefit_close")                              # close the worker's refit socket
