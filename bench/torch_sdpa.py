#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch's scaled_dot_product_attention on the shapes of bench_forward.cpp (CPU)
or bench_gpu.cpp (--device cuda).

The CPU peer of the forward/backward benchmark: run by bench/run_forward.sh
right before our binary, with the same thread count, and its rates printed
next to ours in the same run. Writes one line per case to --out:

    <fwd|bwd> <N> <D> <full|causal> <dtype> <GFLOP/s>

with the FLOP conventions of bench_forward.cpp: 4*D per allowed query-key pair
forward, 2.5x that backward, times H. B = 1, H = --heads (default 1); the
tensors are (B, H, N, D) over memory laid out as --layout says: bnhd (the
default: [B][N][H][D], a projection's output viewed per head, as our bench
lays out its Views) or bhnd ([B][H][N][D], contiguous). bench/run_forward.sh
gives both programs the same layout. PyTorch picks its backend itself (on CPU: its flash-attention
kernel for these shapes; in bf16 on AMX CPUs, blocks packed for oneDNN's AMX
brgemm). Never a
build or test dependency: bench/run_forward.sh skips it when torch does not import.

With --device cuda (the GPU peer of bench_gpu.cpp, whose Views are bnhd): the
same tensors on the GPU, each of the flash, cuDNN and memory-efficient
backends that runs the case is timed (CUDA events, best of --reps) and the
fastest is written with its name as a seventh column, in TFLOP/s:

    <fwd|bwd> <N> <D> <full|causal> <dtype> <TFLOP/s> <backend>
"""
import argparse
import sys
import time


def fastest(timed, min_time):
    """The fastest of repetitions of timed() (which returns its own seconds),
    after one warm-up call, until they add up to min_time and at least 2: the
    rule bench_forward.cpp applies to ours (Google Benchmark's iterations up to
    its 0.3 s minimum, and a second call where one takes longer). Earlier the
    forward stopped at 50 repetitions and the backward took the best of 3 (2
    at N >= 16384): fewer samples than ours at N <= 2048."""
    timed()  # warm-up
    best, total, reps = float("inf"), 0.0, 0
    while total < min_time or reps < 2:
        dt = timed()
        best, total, reps = min(best, dt), total + dt, reps + 1
    return best


def best_time(fn, min_time):
    """fastest() of fn() timed whole."""
    def timed():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return fastest(timed, min_time)


def cases(a, device, heads):
    """Every (dtype, D, N, mask) case of the run, with its random q, k, v, dO
    (uniform in [-1, 1], seed 1 per case), shape (1, heads, N, D) over memory
    laid out as a.layout says (bnhd: a transposed view of (1, N, heads, D))."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for name in a.dtypes.split(","):
        for d in map(int, a.dims.split(",")):
            for n in map(int, a.lengths.split(",")):
                for causal in (False, True):
                    g = torch.Generator(device=device).manual_seed(1)
                    if a.layout == "bhnd":
                        tensors = tuple(torch.rand(1, heads, n, d, generator=g, device=device)
                                        .mul_(2).sub_(1).to(dtypes[name]) for _ in range(4))
                    else:
                        tensors = tuple(torch.rand(1, n, heads, d, generator=g, device=device)
                                        .mul_(2).sub_(1).to(dtypes[name]).transpose(1, 2)
                                        for _ in range(4))
                    pairs = n * (n + 1) / 2 if causal else float(n) * n
                    yield name, d, n, causal, "causal" if causal else "full", pairs, tensors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="fp32")
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layout", default="bnhd", choices=["bnhd", "bhnd"])
    a = ap.parse_args()
    if a.device == "cuda":
        return cuda_main(a)

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, memory {a.layout}", file=sys.stderr)
    with open(a.out, "w") as out:
        for name, d, n, causal, mask, pairs, (q, k, v, do) in cases(a, "cpu", a.heads):
            with torch.no_grad():
                t = best_time(lambda: F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal), a.min_time)
            out.write(f"fwd {n} {d} {mask} {name} {4 * d * pairs * a.heads / t * 1e-9:.3f}\n")
            if a.no_backward:
                continue
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

            def bwd():
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                t0 = time.perf_counter()
                o.backward(do)
                return time.perf_counter() - t0

            t = fastest(bwd, a.min_time)
            out.write(f"bwd {n} {d} {mask} {name} "
                      f"{2.5 * 4 * d * pairs * a.heads / t * 1e-9:.3f}\n")
            out.flush()


def cuda_main(a):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    print(f"PyTorch {torch.__version__}, {torch.cuda.get_device_name()}", file=sys.stderr)

    def cuda_time(fn, reps):
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            best = min(best, s.elapsed_time(e) * 1e-3)
        return best

    with open(a.out, "w") as out:
        for name, d, n, causal, mask, pairs, (q, k, v, do) in cases(a, "cuda", a.heads):
            flops = 4 * d * pairs * a.heads
            best = {"fwd": (0.0, "-"), "bwd": (0.0, "-")}
            for bname, be in backends.items():
                try:
                    with sdpa_kernel([be]):
                        with torch.no_grad():
                            t = cuda_time(lambda: F.scaled_dot_product_attention(
                                q, k, v, is_causal=causal), a.reps)
                        if flops / t > best["fwd"][0]:
                            best["fwd"] = (flops / t, bname)
                        if a.no_backward:
                            continue
                        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                        t = cuda_time(lambda: torch.autograd.grad(
                            o, (qg, kg, vg), do, retain_graph=True), a.reps)
                        if 2.5 * flops / t > best["bwd"][0]:
                            best["bwd"] = (2.5 * flops / t, bname)
                except RuntimeError as err:  # backend does not support the case
                    print(f"{bname} {name} N={n} {mask}: {str(err)[:80]}",
                          file=sys.stderr)
            for op in ("fwd", "bwd"):
                if best[op][0] > 0:
                    out.write(f"{op} {n} {d} {mask} {name} "
                              f"{best[op][0] * 1e-12:.3f} {best[op][1]}\n")
            out.flush()


if __name__ == "__main__":
    main()
