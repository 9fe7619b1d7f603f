"""TRL's own colocated weight sync vs mxrefit's, in TRL's real GRPOTrainer (issue 24).

Per GRPO step: the weight-sync time (the generation backend's ``sync_weights``, which TRL calls
once per optimizer step, wrapped with a timer that synchronizes the device before and after) and
the whole step's time (a TrainerCallback, on_step_begin .. on_step_end); medians after warm-up.
Also TRL's ``sampling/sampling_logp_difference/max`` per step (does vLLM track the trainer's
weights), mxrefit's refit reports (versions, bytes), the versions, and a device-to-device copy
bandwidth measured in the same process for reference.

Model: a random-weight Qwen3 dense built from a config (hidden 2048, 28 layers, intermediate 6144,
16 / 8 heads, head_dim 128, vocabulary 32000: about 1.7 B parameters) with a word-level tokenizer
made with ``tokenizers``; ``--tiny``: the CPU test's size. Every (mode, format) runs in its own
subprocess (GPU memory freed between), in order; a failure (TRL's own sync fails on vLLM's CPU
build) is recorded under its mode and the next one still runs.

    python scripts/gpu_trl.py --mode both --fmt bf16,mxfp8 --json /tmp/trl.json
    python scripts/gpu_trl.py --device cpu --tiny --mode both --steps 3 --json /tmp/trl_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD, EOS = "<pad>", "<eos>"
PROMPT_LEN = 8
LOGP_KEY = "sampling/sampling_logp_difference/max"


def model_shape(tiny: bool) -> dict:
    if tiny:
        return dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16)


def build_policy(path: str, tiny: bool, device: str, seed: int = 0) -> None:
    """A random-weight Qwen3 (BF16 checkpoint) and its word-level tokenizer at ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    shape = model_shape(tiny)
    vocab_n = shape["vocab_size"]
    vocab = {f"t{i}": i for i in range(vocab_n - 2)} | {PAD: vocab_n - 2, EOS: vocab_n - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")
    cfg = Qwen3Config(
        **shape,
        num_key_value_heads=2 if tiny else 8,
        head_dim=32 if tiny else 128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=vocab_n - 1,
        pad_token_id=vocab_n - 2,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model


def copy_bandwidth(device: str) -> dict:
    """Median over 10 copies of one tensor (4 GiB on CUDA, 256 MiB on CPU); GB/s counts read + write."""
    import torch

    n = (4 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(11):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[1:])
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": n, "median_s": med, "gbps_read_plus_write": 2 * n / med / 1e9}


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def versions(device: str) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for mod in ("vllm", "trl", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as err:  # noqa: BLE001 - recorded, not fatal
            out[mod] = f"unavailable: {err}"
    out["device"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return out


def run_one(args: argparse.Namespace, mode: str, fmt: str) -> None:
    """One (mode, format) in this process; the record is rewritten to ``args.out`` as it grows."""
    rec: dict = {"mode": mode, "fmt": fmt, "stage": "setup", "steps": [], "syncs": []}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1, default=str)

    try:
        import torch

        rec["versions"] = versions(args.device)
        rec["copy_bandwidth"] = copy_bandwidth(args.device)
        save()
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        rec["stage"] = "model"
        workdir = args.workdir
        policy_path = os.path.join(workdir, "policy-tiny" if args.tiny else "policy")
        if not os.path.exists(os.path.join(policy_path, "config.json")):
            t0 = time.perf_counter()
            build_policy(policy_path, args.tiny, args.device)
            rec["build_s"] = time.perf_counter() - t0
        model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).to(args.device)  # FP32 master
        rec["params"] = sum(p.numel() for p in model.parameters())
        tokenizer = AutoTokenizer.from_pretrained(policy_path)
        vocab_n = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        n_prompts = args.steps * args.batch // args.group + 8
        words = torch.randint(0, vocab_n - 2, (n_prompts, PROMPT_LEN), generator=g).tolist()
        dataset = Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in p) for p in words]})

        def reward(completion_ids: list[list[int]], **_) -> list[float]:
            return [sum(t % 16 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

        cpu = args.device == "cpu"
        config = GRPOConfig(
            output_dir=os.path.join(workdir, f"out-{mode}-{fmt}"),
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.05 if cpu else args.gpu_mem,
            vllm_max_model_length=64 if cpu else 512,
            per_device_train_batch_size=args.batch,
            num_generations=args.group,
            max_completion_length=8 if cpu else args.new_tokens,
            max_steps=args.steps,
            learning_rate=1e-5,
            beta=0.0,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=cpu,
            bf16=not cpu,
            gradient_checkpointing=False,
            seed=0,
            data_seed=0,
            shuffle_dataset=False,
            disable_tqdm=True,
            generation_kwargs={"ignore_eos": True},
        )
        eager = cpu or args.eager  # vLLM's CPU build would compile its graphs (tens of seconds)
        rec["enforce_eager"] = eager
        if mode == "trl":
            if eager:  # TRL passes no LLM arguments through: add enforce_eager to the LLM it builds
                import trl.generation.vllm_generation as vg

                base_llm = vg.LLM
                vg.LLM = lambda *a, **kw: base_llm(*a, **{**kw, "enforce_eager": True})
            trainer_cls, extra = GRPOTrainer, {}
        else:
            from mxrefit.integrations.trl import MxrefitGRPOTrainer

            trainer_cls = MxrefitGRPOTrainer
            extra = {"refit_format": fmt, "llm_kwargs": {"enforce_eager": True} if eager else {}}

        step_t: dict[int, float] = {}
        device = args.device

        class Timer(TrainerCallback):
            def on_step_begin(self, _args, state, control, **kw):
                sync(device)
                step_t[state.global_step + 1] = time.perf_counter()

            def on_step_end(self, _args, state, control, **kw):
                sync(device)
                rec["steps"].append({"step": state.global_step, "step_s": time.perf_counter() - step_t[state.global_step]})
                save()

        rec["stage"] = "engine"
        save()
        t0 = time.perf_counter()
        trainer = trainer_cls(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Timer()],
            **extra,
        )
        rec["engine_start_s"] = time.perf_counter() - t0
        gen = trainer.vllm_generation
        inner = gen.sync_weights

        def timed_sync() -> None:
            sync(device)
            t0 = time.perf_counter()
            try:
                inner()
            except Exception as err:
                rec["syncs"].append({"step": trainer.state.global_step, "error": f"{type(err).__name__}: {err}"})
                raise
            sync(device)
            rec["syncs"].append({"step": trainer.state.global_step, "sync_s": time.perf_counter() - t0})

        gen.sync_weights = timed_sync
        rec["stage"] = "train"
        save()
        t0 = time.perf_counter()
        trainer.train()
        rec["train_s"] = time.perf_counter() - t0
        logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
        for s in rec["steps"]:
            h = logs.get(s["step"], {})
            s[LOGP_KEY] = h.get(LOGP_KEY)
            for k in ("mxrefit/version", "mxrefit/bytes", "mxrefit/refit_ms", "reward"):
                if k in h:
                    s[k] = h[k]
        rec["refits"] = [
            {"version": r.version, "bytes": r.bytes, "transport": r.transport, "total_s": r.total_s}
            for r in getattr(trainer, "refit_reports", [])
        ]
        rec["stage"] = "done"
        if hasattr(gen, "close"):
            gen.close()
    except BaseException as err:  # noqa: BLE001 - recorded for the parent, which reports it
        rec["error"] = f"{type(err).__name__}: {err}"
        rec["error_type"] = type(err).__name__
        rec["traceback"] = traceback.format_exc()[-6000:]
        print(rec["traceback"], file=sys.stderr, flush=True)
    save()


def summarize(rec: dict, warmup: int) -> dict:
    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    syncs = [s["sync_s"] for s in rec.get("syncs", []) if "sync_s" in s]
    steps = [s["step_s"] for s in rec.get("steps", [])]
    logp = [s.get(LOGP_KEY) for s in rec.get("steps", []) if s.get(LOGP_KEY) is not None]
    refits = rec.get("refits") or []
    return {
        "steps_done": len(steps),
        "sync_median_s": med(syncs[warmup:] or syncs),
        "step_median_s": med(steps[warmup:] or steps),
        "sync_s_all": syncs,
        "step_s_all": steps,
        "logp_diff_max_per_step": logp,
        "refit_versions": [r["version"] for r in refits],
        "refit_bytes": refits[-1]["bytes"] if refits else None,
    }


def line(rec: dict, s: dict) -> str:
    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1e3:.1f}ms"

    bw = rec.get("copy_bandwidth", {}).get("gbps_read_plus_write")
    text = (
        f"trl_bench: mode={rec['mode']} fmt={rec['fmt']} device={rec.get('versions', {}).get('device')} "
        f"params={rec.get('params')} steps={s['steps_done']} sync_median={ms(s['sync_median_s'])} "
        f"step_median={ms(s['step_median_s'])} logp_diff_max={[round(x, 4) for x in s['logp_diff_max_per_step']]} "
        f"refit_versions={s['refit_versions']} refit_bytes={s['refit_bytes']} "
        f"copy_bw={'n/a' if bw is None else f'{bw:.0f}GB/s'}"
    )
    if rec.get("error"):
        text += f" ERROR(stage={rec.get('stage')}): {rec['error'][:300]}"
    return text


def run_child(args: argparse.Namespace, mode: str, fmt: str, eager: bool, workdir: str) -> dict:
    out = os.path.join(workdir, f"{mode}-{fmt}{'-eager' if eager else ''}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--fmt", fmt, "--out", out, "--workdir", workdir]
    cmd += ["--device", args.device, "--steps", str(args.steps), "--batch", str(args.batch), "--group", str(args.group)]
    cmd += ["--new-tokens", str(args.new_tokens), "--gpu-mem", str(args.gpu_mem)]
    cmd += ["--tiny"] * args.tiny + ["--eager"] * eager
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH", "")] if p)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(args.mode_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    try:
        with open(out) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        rec = {"mode": mode, "fmt": fmt, "stage": "start"}
    rec["returncode"] = rc
    rec["wall_s"] = time.perf_counter() - t0
    if rc == "timeout" and not rec.get("error"):
        rec["error"] = f"timeout after {args.mode_timeout} s in stage {rec.get('stage')}"
    elif rc != 0 and not rec.get("error"):
        rec["error"] = f"exit code {rc} in stage {rec.get('stage')}"
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("trl", "mxrefit", "both"), default="both")
    p.add_argument("--fmt", default="bf16", help="bf16, mxfp8 or a comma-separated list")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--group", type=int, default=8, help="num_generations")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--gpu-mem", type=float, default=0.3, help="vllm_gpu_memory_utilization")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the CPU test's model size")
    p.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    p.add_argument("--mode-timeout", type=float, default=240.0, help="seconds per (mode, format) subprocess")
    p.add_argument("--json")
    p.add_argument("--workdir")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        run_one(args, args.child, args.fmt)
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpu-trl-")
    modes = ("trl", "mxrefit") if args.mode == "both" else (args.mode,)
    result: dict = {"config": vars(args), "runs": []}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)

    for fmt in args.fmt.split(","):
        for mode in modes:
            if mode == "trl" and fmt == "mxfp8":
                rec = {"mode": mode, "fmt": fmt, "skipped": "TRL's own sync loads unquantized weights (its baseline is bf16)"}
                result["runs"].append(rec)
                print(f"trl_bench: mode=trl fmt=mxfp8 skipped: {rec['skipped']}", flush=True)
                continue
            rec = run_child(args, mode, fmt, args.eager, workdir)
            if (
                rec.get("error")
                and not args.eager
                and args.device == "cuda"
                and rec.get("stage") == "engine"
                and rec.get("error_type") != "TrlIntegrationError"
            ):
                print(f"trl_bench: mode={mode} fmt={fmt} failed at engine start with CUDA graphs, retrying eager", flush=True)
                rec = {"first_try": rec, **run_child(args, mode, fmt, True, workdir)}
            rec["summary"] = summarize(rec, args.warmup)
            result["runs"].append(rec)
            save()
            print(line(rec, rec["summary"]), flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
