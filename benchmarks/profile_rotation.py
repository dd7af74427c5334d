"""One launch each of the per-(sequence, head) quantization, unrotated and rotated (dense, kron,
gluon), for Nsight Compute: where the rotated cast's time goes.

    ncu --kernel-name regex:_cast_kernel --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section InstructionStats --section MemoryWorkloadAnalysis \\
        python benchmarks/profile_rotation.py [--tokens 8192 --heads 128 --rotations plain,dense,kron,gluon]

The first round warms the compiles (skipped by --launch-skip N, N the number of rotations),
the second is profiled: each of `--rotations` in order ("plain" unrotated; "gluon" the Gluon
cast, `gluon_rotate`), one sequence of `--tokens` rows (bf16 q, k, v, normal) at `--heads`
heads, B1-S8192-H128 by default. Both passes launch each time (`--kernel-name` picks).
"""

from __future__ import annotations

import argparse

import torch

from mla_plugins.core.kernels import triton_heads as th

ROTATIONS = {"plain": (False, None), "dense": (True, "dense"), "kron": (True, "kron"),
             "gluon": (True, "gluon")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--rotations", default=",".join(ROTATIONS))
    args = parser.parse_args()
    chosen = args.rotations.split(",")
    unknown = [r for r in chosen if r not in ROTATIONS]
    if unknown:
        parser.error(f"--rotations: found {unknown}, expected some of {list(ROTATIONS)}")
    heads, n = args.heads, args.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n, heads, 192, device="cuda", generator=gen).bfloat16()
    k = torch.randn(n, heads, 192, device="cuda", generator=gen).bfloat16()
    v = torch.randn(n, heads, 128, device="cuda", generator=gen).bfloat16()
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = th.head_splits(n, 1, heads, sms)
    for _ in range(2):
        for name in chosen:
            rotate, rotation = ROTATIONS[name]
            th.quantize_heads(q, k, v, cu, cu, 1, n, n, splits, torch.float8_e4m3fn, rotate=rotate,
                              rotation=rotation, sms=sms)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
