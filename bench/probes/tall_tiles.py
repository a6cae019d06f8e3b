"""Dense path with query tiles taller than a mask block (BLOCK_M=256 over 128-token blocks):
forward TFLOP/s (4*B*H*S*S*D) per tile configuration, bf16 H=16, anchors shapes, and the max
difference to the table path (dense_probe.sweep). Usage: PYTHONPATH=. python3 bench/probes/tall_tiles.py [mods...]

Entry 28 ran it with a host change that was not kept: `_launcher` accepted dense candidates whose
BLOCK_M is a multiple of the mask block, and EVEN_Q was taken against the largest candidate.
Without it the 256-row candidates are filtered out, and the probe prints "not run" for them."""
import sys

from bench.probes.dense_probe import sweep

CANDS = {128: [(128, 64, 4, 2), (256, 64, 8, 2), (256, 64, 8, 3), (256, 128, 8, 2), (128, 128, 8, 2)],
         64: [(128, 128, 4, 3), (256, 64, 8, 2), (256, 64, 8, 3), (256, 128, 8, 2), (256, 128, 8, 3)]}
sweep(CANDS, sys.argv[1:] or ["noop", "alibi"], dims=(64, 128))
