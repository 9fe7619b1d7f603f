"""Per-bucket host work of ``Sender.refit`` on CPU (trainer process only), for whichever mxrefit
tree is first on PYTHONPATH: calls of ``.item()``, ``.tolist()``, ``fill_``, allocations and
encoder launches per refit and per bucket, and the non-finite cell's pointer alignment, over
the bench's own ``run_mode`` on the tiny MoE (1 MiB buckets). It compares trees on the host
side only: on CPU the grouped Triton kernels do not run (docs/benchmarks.md, "A/B of 2026-12-06").

    PYTHONPATH=$PWD .venv/bin/python scripts/cpu_pack_audit.py prequant          # this tree
    PYTHONPATH=$PWD/.old .venv/bin/python scripts/cpu_pack_audit.py prequant     # .old = git archive 5afcbb7 mxrefit
"""

import collections
import inspect
import sys

import torch

import mxrefit
from mxrefit.bench import run as br
from mxrefit.plan.build import SourceSpec
from mxrefit.plan.shapes import hf_tensor_specs
from mxrefit.source import sender as S

C = collections.Counter()
ACTIVE = [False]


def wrap(owner, name, key):
    orig = getattr(owner, name)

    def w(*a, **k):
        if ACTIVE[0]:
            C[key] += 1
        return orig(*a, **k)

    setattr(owner, name, w)


wrap(torch.Tensor, "item", "Tensor.item")
wrap(torch.Tensor, "fill_", "Tensor.fill_")
wrap(torch.Tensor, "tolist", "Tensor.tolist")
wrap(torch.Tensor, "cpu", "Tensor.cpu")
wrap(torch, "_foreach_copy_", "_foreach_copy_")
wrap(torch, "full", "torch.full")
wrap(torch, "empty", "torch.empty")
wrap(torch, "tensor", "torch.tensor")
if hasattr(S, "_BucketFlags"):
    wrap(S._BucketFlags, "__init__", "_BucketFlags.__init__")
    wrap(S._BucketFlags, "mark", "_BucketFlags.mark")
    wrap(S._BucketFlags, "cell", "_BucketFlags.cell")

orig_build = S.Sender._build_encoders


def build(self, plan, path):
    orig_build(self, plan, path)
    C["plan.buckets"] = len(plan.buckets)
    wrapped = []
    for encs in self._bucket_encoders:
        row = []
        for idx, enc in encs:

            def e(srcs, bad, _enc=enc):
                if ACTIVE[0]:
                    C["encoder calls"] += 1
                    C[f"bad ptr % 16 = {bad.data_ptr() % 16}"] += 1
                return _enc(srcs, bad)

            row.append((idx, e))
        wrapped.append(row)
    self._bucket_encoders = wrapped


S.Sender._build_encoders = build
orig_refit = S.Sender.refit


def refit(self, *a, **k):
    ACTIVE[0] = True
    try:
        return orig_refit(self, *a, **k)
    finally:
        ACTIVE[0] = False
        C["refits"] += 1


S.Sender.refit = refit

if __name__ == "__main__":
    mode = sys.argv[1]
    post = sys.argv[2] if len(sys.argv) > 2 else "trtllm"
    dev = torch.device("cpu")
    shape = br.resolve_shape("tiny-qwen3-moe")
    specs = [SourceSpec(n, tuple(s), dt) for n, s, dt in hf_tensor_specs(shape, experts="per_expert")]
    weights = br.make_weights(specs, dev)
    kw = dict(steps=2, warmup=1, bucket_bytes=1 << 20, timeout_s=120.0, experts="per_expert", post=post, fmt="mxfp8")
    res = br.run_mode(mode, shape, dev, weights, **kw)
    n = C["refits"]
    print(
        mxrefit.__file__,
        mode,
        post,
        "refits",
        n,
        "buckets/plan",
        C["plan.buckets"],
        "sender defaults:",
        {
            k: v.default
            for k, v in inspect.signature(S.Sender.__init__).parameters.items()
            if k in ("one_behind", "slots", "bucket_bytes")
        },
    )
    for k, v in sorted(C.items()):
        if k not in ("refits", "plan.buckets"):
            print(f"  {k}: {v} total, {v / n:.2f} per refit, {v / n / C['plan.buckets']:.3f} per bucket")
    st = res["steps"][-1]
    print("  last step pack_s", round(st["pack_s"] * 1e3, 2), "ms; check", res.get("check", {}).get("mismatched"))
