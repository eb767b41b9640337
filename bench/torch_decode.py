#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch's scaled_dot_product_attention on the decode shapes of
bench_decode.cpp (CPU): one query row per sequence against a cache of --keys
keys, the peer of our split-KV decode. Run by bench/run_serve.sh right before
our binary, with the same thread count; bench_decode --torch=FILE prints its
times next to ours. Writes one line per case to --out:

    <fp32|bf16> <heads|seq> <B> <keys> <H> <Hkv> <D> <ms>

q is (B, H, 1, D) over [B][1][H][D] memory (a projection's output, as our
bench lays it out); k and v are (B, Hkv, keys, D) over heads-major memory
([B][Hkv][keys][D], contiguous) or sequence-major memory ([B][keys][Hkv][D]
viewed transposed), the two caches of our bench. GQA through
enable_gqa=True (PyTorch >= 2.5). No mask: the one row sits at the last
position, where causal allows every key. Each time is the fastest call of as
many as fill 0.3 s (at least two) after one warm-up, the rule of
bench/torch_sdpa.py. Never a build or test dependency.
"""
import argparse
import time


def fastest(fn, min_time):
    fn()  # warm-up
    best, total, reps = float("inf"), 0.0, 0
    while total < min_time or reps < 2:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, total, reps = min(best, dt), total + dt, reps + 1
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=65536)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: keep)")
    p.add_argument("--min-time", type=float, default=0.3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch
    import torch.nn.functional as F

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    shapes = [(8, 8, 128), (32, 8, 128), (8, 1, 128), (16, 16, 64)]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    lines = []
    with torch.no_grad():
        for h, hkv, d in shapes:
            for layout in ("heads", "seq"):
                for name, dt in dtypes.items():
                    b, n = a.batch, a.keys
                    q = (torch.rand(b, 1, h, d) * 2 - 1).to(dt).transpose(1, 2)
                    if layout == "heads":
                        k = (torch.rand(b, hkv, n, d) * 2 - 1).to(dt)
                        v = (torch.rand(b, hkv, n, d) * 2 - 1).to(dt)
                    else:
                        k = (torch.rand(b, n, hkv, d) * 2 - 1).to(dt).transpose(1, 2)
                        v = (torch.rand(b, n, hkv, d) * 2 - 1).to(dt).transpose(1, 2)
                    gqa = h != hkv
                    t = fastest(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
                                a.min_time)
                    lines.append(f"{name} {layout} {b} {n} {h} {hkv} {d} {t * 1e3:.4f}")
                    del q, k, v
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
