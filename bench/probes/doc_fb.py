"""Document mask (8 docs) fwd+bwd at B=4 H=16 S=4096 D=64 bf16: flexcore with the new paths on and
off, alternating rounds, and torch's compiled flex_attention, median ms per round."""
import torch, triton
from flexcore import flex_attention, create_block_mask
import flexcore.kernels.forward as F
from torch.nn.attention.flex_attention import flex_attention as tflex, create_block_mask as tcbm

B, H, S, D = 4, 16, 4096, 64
doc = torch.arange(S, device="cuda") // (S // 8)
def document(b, h, q, kv): return doc[q] == doc[kv]
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn_like(q)
bm = create_block_mask(document, None, None, S, S, device="cuda")
tbm = tcbm(document, None, None, S, S, device="cuda")
cf = torch.compile(tflex)
def step(fn, mask):
    def run():
        out = fn(q, k, v, block_mask=mask)
        out.backward(g)
    return run
def fwd(fn, mask):
    return lambda: fn(q, k, v, block_mask=mask)
for r in range(4):
    row = []
    for tag, flags in (("new", (True, True)), ("old", (False, False))):
        F.DENSE, F.FULL_RUNS = flags
        row.append(f"{tag} fb {triton.testing.do_bench(step(flex_attention, bm), warmup=25, rep=200, return_mode='median'):.3f}"
                   f" f {triton.testing.do_bench(fwd(flex_attention, bm), warmup=25, rep=100, return_mode='median'):.3f}")
    row.append(f"torch fb {triton.testing.do_bench(step(cf, tbm), warmup=25, rep=200, return_mode='median'):.3f}"
               f" f {triton.testing.do_bench(fwd(cf, tbm), warmup=25, rep=100, return_mode='median'):.3f}")
    print(" | ".join(row), flush=True)
