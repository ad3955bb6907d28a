"""Throwaway: the previous kernels (commit 4164249) at 8K soft fwd+bwd, default and 64x64/4/3 tiles."""
import json, os, sys
import torch
from triton.testing import do_bench
from focus_pretrain.focus.soft_triton import soft_gated_attention
torch.manual_seed(0)
b, n, h, d, K = 1, 8192, 16, 128, 8
q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
probs = torch.randn(b, n, K, device="cuda").mul(2).softmax(-1).requires_grad_(True)
g = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
def step():
    out, _ = soft_gated_attention(q, k, v, probs, window=128, gate_lambda=10.0, scale=d**-0.5)
    out.backward(g)
def fwd():
    with torch.no_grad():
        soft_gated_attention(q, k, v, probs, window=128, gate_lambda=10.0, scale=d**-0.5)
res = {}
for name, blocks in (("old default tiles", ""), ("old 64x64 4 warps 3 stages", "fwd=64x64,kv=64x64,q=64x64,warps=4,stages=3")):
    os.environ["FOCUS_TRITON_BLOCKS"] = blocks
    res[name] = {"fwd_ms": do_bench(fwd, warmup=25, rep=100, return_mode="median"),
                 "fwd_bwd_ms": do_bench(step, warmup=25, rep=100, return_mode="median")}
    print(name, res[name], flush=True)
json.dump(res, open(os.path.join(os.environ["OUT"], "old_kernels.json"), "w"), indent=1)
