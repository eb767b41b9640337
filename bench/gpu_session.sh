#!/usr/bin/env bash
# The prepared GPU job (one `run` on the lent GPU machine; see docs/gpu.md):
# every check and benchmark the GPU issues ask for, logs under $OUT.
#
#   bash bench/gpu_session.sh            ($OUT set by the device tool, or OUT=dir)
#
# Expects, carried from the CPU machine (built there with nvcc 13, sm_90):
#   build-cuda/   a CUDA build (BLOCKATTN_ENABLE_CUDNN=ON, -DBLOCKATTN_BUILD_BENCH=ON):
#                 tests/blockattn_test_cuda, bench/blockattn_bench_gpu and, when
#                 MPI is carried, tests/blockattn_test_distributed_cuda
#   .mpi/         optional: Debian's Open MPI unpacked with dpkg -x (OPAL_PREFIX)
#   build-host/   optional: a host (OpenMP) build with bench/blockattn_bench_plan
# and PyTorch on the GPU machine (its wheels bring libcudnn, libnvrtc, libcudart).
# Each step has its own timeout so that one hang leaves the others' logs; the
# whole job stays under 8 minutes. Steps whose binaries are missing say so.
# bench/pack_gpu_bundle.sh makes all of it one file, .gpu/bundle.tar.gz
# (carry [".gpu"]); this script unpacks it first.
set -u
out=${OUT:-${1:-gpu-out}}
mkdir -p "$out"
if [ -f .gpu/bundle.tar.gz ]; then
  mkdir -p /tmp/gpu-bundle && tar -C /tmp/gpu-bundle -xzf .gpu/bundle.tar.gz
  cd_bundle=/tmp/gpu-bundle
  BUILD_CUDA=${BUILD_CUDA:-$cd_bundle/build-cuda}
  BUILD_HOST=${BUILD_HOST:-$cd_bundle/build-host}
  [ -d $cd_bundle/.mpi ] && ln -sfn $cd_bundle/.mpi .mpi
fi
cuda=${BUILD_CUDA:-build-cuda}
host=${BUILD_HOST:-build-host}
log() { printf '[gpu_session] %s\n' "$*" | tee -a "$out/session.log"; }
step() {  # step <name> <timeout s> <command...>: output to $out/<name>.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  log "$name: exit $rc after $((SECONDS - t0)) s"
  return $rc
}

# The CUDA libraries from PyTorch's wheels (cuDNN 9, NVRTC, the runtime).
site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
for d in "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib; do
  [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
{ nvidia-smi; lscpu | grep -E 'Model name|^CPU\(s\)'; python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())'; } \
  >"$out/machine.log" 2>&1
log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ldd "$cuda/tests/blockattn_test_cuda" 2>&1 | grep -E 'cudnn|nvrtc|cudart|not found' | tee -a "$out/session.log"

# 1. Correctness on the GPU, cuDNN on: every single-device test case (the
#    16-bit ones against the fused bound where cuDNN ran, bitwise otherwise).
if [ -x "$cuda/tests/blockattn_test_cuda" ]; then
  step test_cuda 150 "$cuda/tests/blockattn_test_cuda" -s -d
  grep -E 'test cases|assertions|Status' "$out/test_cuda.log" | tee -a "$out/session.log"
else
  log "no $cuda/tests/blockattn_test_cuda: skipped"
fi

# 2. Speed: PyTorch's SDPA and ours in the same job (bf16 fused, then our kernels).
if [ -x "$cuda/bench/blockattn_bench_gpu" ]; then
  step torch_sdpa 120 python3 bench/torch_sdpa.py --device cuda --heads 16 --dims 128 \
    --lengths 4096,8192,16384 --dtypes fp32,bf16 --out "$out/torch.txt"
  step bench_gpu 120 "$cuda/bench/blockattn_bench_gpu" --dtypes bf16,fp32 --torch "$out/torch.txt"
  step bench_gpu_portable 60 "$cuda/bench/blockattn_bench_gpu" --dtypes bf16 --lengths 4096 \
    --portable 1 --torch "$out/torch.txt"
  cat "$out/bench_gpu.log" "$out/bench_gpu_portable.log" >>"$out/session.log"
else
  log "no $cuda/bench/blockattn_bench_gpu: skipped"
fi

# Score policies and sinks on the GPU: their cost next to no policy (portable kernel).
if [ -x "$cuda/bench/blockattn_bench_score" ]; then
  step bench_score 60 "$cuda/bench/blockattn_bench_score" --n 4096 --heads 16 --reps 3
else
  log "no $cuda/bench/blockattn_bench_score: skipped"
fi

# Decode on the GPU: split-KV against a plain read of the same bytes (HBM).
if [ -x "$cuda/bench/blockattn_bench_decode" ]; then
  step bench_decode 60 "$cuda/bench/blockattn_bench_decode" --reps 5
else
  log "no $cuda/bench/blockattn_bench_decode: skipped"
fi

# 3. Ranks sharing the GPU (the distributed suite), and the planner at P = 4, 8 on the CPUs.
if [ -d .mpi ]; then
  export OPAL_PREFIX=$PWD/.mpi/usr PATH=$PWD/.mpi/usr/bin:$PATH
  export LD_LIBRARY_PATH=$PWD/.mpi/usr/lib/x86_64-linux-gnu:$PWD/.mpi/usr/lib/x86_64-linux-gnu/openmpi/lib:$LD_LIBRARY_PATH
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_btl_vader_single_copy_mechanism=none
  if [ -x "$cuda/tests/blockattn_test_distributed_cuda" ]; then
    for np in 2 4; do
      step "distributed_cuda_np$np" 90 mpiexec -n $np --oversubscribe \
        "$cuda/tests/blockattn_test_distributed_cuda"
    done
  fi
  if [ -x "$host/bench/blockattn_bench_plan" ]; then
    for np in 4 8; do
      step "bench_plan_np$np" 60 env OMP_NUM_THREADS=$((16 / np)) OMP_PROC_BIND=false \
        mpiexec -n $np --oversubscribe "$host/bench/blockattn_bench_plan"
    done
  fi
  # The distributed decode step on the CPUs at P = 1, 2, 4, 8 (tree, ring, planner).
  if [ -x "$host/bench/blockattn_bench_serve" ]; then
    for np in 1 2 4 8; do
      step "bench_serve_np$np" 60 env OMP_NUM_THREADS=$((16 / np)) OMP_PROC_BIND=false \
        mpiexec -n $np --oversubscribe --bind-to none "$host/bench/blockattn_bench_serve" --reps 3
    done
  fi
else
  log "no .mpi (Open MPI unpacked with dpkg -x): the multi-rank steps skipped"
fi
log "done"
