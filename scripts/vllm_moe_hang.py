#!/usr/bin/env python3
"""Why does a Qwen3-MoE ModelOpt MXFP8 checkpoint hang vLLM 0.26 on Hopper? (issue 22)

Writes the checkpoint that hung (8 experts, hidden 512, moe_intermediate 256, written by
``save_mxfp8_checkpoint``) and starts vLLM on it in several variants at once, each in its own
process tree with a deadline. Every Python process of a variant has faulthandler armed by
``scripts/vllm_hooks/sitecustomize.py``; at the deadline this script sends SIGUSR1 to the
whole tree (each process writes all its threads' stacks), waits, then kills it. One log
holds, per variant: the outcome, the last lines of vLLM's output (the MoE backend it chose)
and every stack dump.

    python3 scripts/vllm_moe_hang.py --timeout 120 --log $OUT/moe_hang.log --json $OUT/moe_hang.json \
        --variants auto,auto-eager,triton

Variants: a base, then flags joined by "-". Bases: ``auto`` (vLLM's choice: Marlin on Hopper),
``triton`` (``moe_backend="triton"``: vLLM's MXFP8 emulation, dequantized per forward), ``marlin``,
``humming``, ``bf16`` (the same model in BF16). Flags: ``eager`` (``enforce_eager``), ``profile``
(the hung start's settings: ``gpu_memory_utilization=0.3``, ``max_model_len=512``, vLLM profiles
memory; otherwise a fixed ``kv_cache_memory_bytes`` skips the profiling), ``tokens``
(``max_num_batched_tokens=$HANG_BATCHED_TOKENS``, default 512). A variant may end in ``:inproc``
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core and worker in the script's own process).
With ``MXREFIT_FAULTHANDLER_S`` set every process also dumps its stacks periodically.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOKS = os.path.join(ROOT, "scripts", "vllm_hooks")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                parts = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(parts[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def child(args) -> int:
    """One variant: start vLLM, generate, report."""
    t0 = time.time()
    variant = args.variant.split(":")[0]
    base, *flags = variant.split("-")
    from vllm import LLM, SamplingParams

    kw = dict(
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=1 << 30,
        attention_config={"backend": "FLASH_ATTN"},
    )
    if "profile" in flags:  # the settings of the start that hung (shared/vllm-h200 vsmoke.py): vLLM profiles memory
        kw.update(gpu_memory_utilization=0.3, max_model_len=512)
        del kw["kv_cache_memory_bytes"]
    if "eager" in flags:
        kw["enforce_eager"] = True
    else:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    if "tokens" in flags:  # a smaller token budget: the warm-up / profile forward runs this many tokens
        kw["max_num_batched_tokens"] = int(os.environ.get("HANG_BATCHED_TOKENS", "512"))
    if base in ("triton", "marlin", "humming"):
        kw["moe_backend"] = base
    if "scale" in flags:  # room for the longest prompt timed below
        kw["max_model_len"] = 1024
    llm = LLM(model=args.ckpt, **kw)
    up = time.time() - t0
    if "scale" in flags:  # prefill time against prompt length: how the MoE forward scales with tokens
        budget = kw.get("max_num_batched_tokens", 2048)
        sp1 = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for n in (16, 64, 256, 512, 1000):
            if n > budget or n >= kw["max_model_len"]:
                continue
            times = []
            for rep in range(3):
                prompt = [(7 * i + rep) % 1000 + 3 for i in range(n)]
                t1 = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], sp1, use_tqdm=False)
                times.append(time.perf_counter() - t1)
            print(
                f"VARIANT-SCALE {args.variant} prompt {n} tokens: prefill {min(times) * 1e3:.1f} ms "
                f"(first {times[0] * 1e3:.1f} ms)",
                flush=True,
            )
    out = llm.generate(
        [{"prompt_token_ids": [1, 5, 9, 42, 7]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False
    )
    print(f"VARIANT-OK {args.variant} up {up:.1f}s tokens {list(out[0].outputs[0].token_ids)}", flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", nargs="?", default="diagnose", choices=("diagnose", "child"))
    p.add_argument("--variants", default="auto,auto-eager,triton")
    p.add_argument("--variant")
    p.add_argument("--ckpt")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--work", default="/tmp/mxrefit_moe_hang")
    p.add_argument("--log", default="moe_hang.log")
    p.add_argument("--json")
    args = p.parse_args()
    if args.cmd == "child":
        return child(args)

    from vllm_oracle import make_policy, save_checkpoint

    os.makedirs(args.work, exist_ok=True)
    ckpts = {}
    for fmt in ("mxfp8", "bf16"):
        path = os.path.join(args.work, f"moe_{fmt}")
        if not os.path.exists(os.path.join(path, "config.json")):
            save_checkpoint(make_policy("moe", 0), path, fmt)
        ckpts[fmt] = path
    runs = {}
    for variant in args.variants.split(","):
        vdir = os.path.join(args.work, variant.replace(":", "_"))
        os.makedirs(vdir, exist_ok=True)
        for old in glob.glob(os.path.join(vdir, "fh_*.txt")):
            os.remove(old)
        env = dict(
            os.environ,
            MXREFIT_FAULTHANDLER=vdir,
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join([HOOKS, ROOT, os.environ.get("PYTHONPATH", "")]),
        )
        if variant.endswith(":inproc"):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        ckpt = ckpts["bf16" if variant.startswith("bf16") else "mxfp8"]
        logf = open(os.path.join(vdir, "out.txt"), "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "child", "--variant", variant, "--ckpt", ckpt],
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        runs[variant] = (proc, vdir, logf, time.time())
    results = {}
    deadline = time.time() + args.timeout
    while runs:
        for variant, (proc, vdir, logf, t0) in list(runs.items()):
            rc = proc.poll()
            if rc is None and time.time() < deadline:
                continue
            if rc is None:  # hung: stacks of the whole tree, then kill it
                tree = descendants(proc.pid)
                for pid in tree:
                    try:
                        os.kill(pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                time.sleep(3)
                for pid in reversed(tree):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait()
                outcome = f"HUNG (killed after {args.timeout:.0f} s; stacks of {len(tree)} processes)"
            else:
                outcome = "OK" if rc == 0 else f"FAILED (exit {rc})"
            logf.close()
            results[variant] = {"outcome": outcome, "seconds": round(time.time() - t0, 1), "dir": vdir}
            del runs[variant]
        time.sleep(0.5)
    with open(args.log, "w") as log:
        for variant, r in results.items():
            log.write(f"\n######## {variant}: {r['outcome']} in {r['seconds']} s\n")
            with open(os.path.join(r["dir"], "out.txt"), errors="replace") as f:
                lines = f.readlines()
            keep = [
                ln
                for ln in lines
                if any(
                    k in ln
                    for k in (
                        "MoE",
                        "moe",
                        "Marlin",
                        "marlin",
                        "backend",
                        "Error",
                        "error",
                        "VARIANT-",
                        "Traceback",
                        "kernel",
                        "took",
                    )
                )
            ]
            log.write("".join(keep[-60:]))
            log.write("---- last 40 lines ----\n" + "".join(lines[-40:]))
            for fh in sorted(glob.glob(os.path.join(r["dir"], "fh_*.txt"))):
                with open(fh, errors="replace") as f:
                    text = f.read()
                if "most recent call first" in text:
                    log.write(f"---- {os.path.basename(fh)} ----\n{text}")
            r["tail"] = "".join(lines[-8:])
            r["variant_lines"] = [
                ln.strip() for ln in lines if "VARIANT-" in ln or "warmup run took" in ln or "init engine" in ln
            ]
    for variant, r in results.items():
        print(f"moe_hang: {variant}: {r['outcome']} in {r['seconds']} s")
        for ln in r.get("variant_lines", []):
            print(f"moe_hang:   {ln[-160:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
