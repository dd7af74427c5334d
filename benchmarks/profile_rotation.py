"""One launch each of the per-(sequence, head) quantization, unrotated and rotated (dense, kron,
gluon), for Nsight Compute: where the rotated cast's time goes.

    ncu --kernel-name regex:_cast_kernel --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section InstructionStats --section MemoryWorkloadAnalysis \\
        python benchmarks/profile_rotation.py

The first round warms the compiles (skipped by --launch-skip 4), the second is profiled:
unrotated, dense, kron, gluon (the Gluon cast, `gluon_rotate`), B1-S8192-H128 (bf16 q, k, v).
"""

from __future__ import annotations

import torch

from mla_plugins.core.kernels import triton_heads as th


def main() -> None:
    heads, n = 128, 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n, heads, 192, device="cuda", generator=gen).bfloat16()
    k = torch.randn(n, heads, 192, device="cuda", generator=gen).bfloat16()
    v = torch.randn(n, heads, 128, device="cuda", generator=gen).bfloat16()
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    splits = th.head_splits(n, 1, heads, torch.cuda.get_device_properties(0).multi_processor_count)
    for _ in range(2):
        for rotate, rotation in ((False, None), (True, "dense"), (True, "kron"),
                                 (True, "gluon")):
            th.quantize_heads(q, k, v, cu, cu, 1, n, n, splits, torch.float8_e4m3fn, rotate=rotate,
                              rotation=rotation)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
