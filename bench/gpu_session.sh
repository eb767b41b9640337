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
# whole job stays under DEADLINE seconds (default 420): logs in $OUT/logs.tar.gz. Steps whose binaries are missing say so.
# bench/pack_gpu_bundle.sh makes all of it one file, .gpu/bundle.tar.gz
# (carry [".gpu"]); this script unpacks it first.
set -u
out=${OUT:-${1:-gpu-out}}
mkdir -p "$out"
# The device tool returns at most 8 files from $OUT: every step's log goes to
# $logs and is packed into $out/logs.tar.gz after each step (so a job cut
# off at its limit still returns what ran); session.log is the summary.
logs=/tmp/gpu-logs
mkdir -p "$logs"
# The whole job's budget in seconds (DEADLINE): a step gets at most what is
# left of it, and steps are ordered by what the GPU issues need most.
deadline=$((SECONDS + ${DEADLINE:-420}))
bundle=$(ls .gpu/bundle.tar.xz .gpu/bundle.tar.gz 2>/dev/null | head -1)
if [ -n "$bundle" ]; then
  mkdir -p /tmp/gpu-bundle && tar -C /tmp/gpu-bundle -xf "$bundle"
  cd_bundle=/tmp/gpu-bundle
  BUILD_CUDA=${BUILD_CUDA:-$cd_bundle/build-cuda}
  BUILD_HOST=${BUILD_HOST:-$cd_bundle/build-host}
  [ -d $cd_bundle/.mpi ] && ln -sfn $cd_bundle/.mpi .mpi
fi
cuda=${BUILD_CUDA:-build-cuda}
host=${BUILD_HOST:-build-host}
log() { printf '[gpu_session] %s\n' "$*" | tee -a "$out/session.log"; }
pack() { tar -C "$logs" -czf "$out/logs.tar.gz" . 2>/dev/null; }
# STEPS="name ...": only those steps (a rerun of what failed); DTYPES: the
# value types of the bf16/fp32 benchmarks (default bf16,fp32).
dtypes=${DTYPES:-bf16,fp32}
step() {  # step <name> <timeout s> <command...>: output to $logs/<name>.log
  local name=$1 limit=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 15 ]; then
    log "$name: skipped (the job's deadline is near)"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  log "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)"
  pack
  return $rc
}

# The CUDA libraries from PyTorch's wheels (cuDNN 9, NVRTC, the runtime), then
# the toolkit's.
site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
for d in "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib; do
  [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
[ -d /usr/local/cuda/lib64 ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
[ -d "$host/lib" ] && LD_LIBRARY_PATH="$host/lib:${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
{ nvidia-smi; lscpu | grep -E 'Model name|^CPU\(s\)'; python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())'; } \
  >"$logs/machine.log" 2>&1
head -20 "$logs/machine.log" | grep -E 'H100|H200|Driver|torch|Model name' | tee -a "$out/session.log"
# Which code the bundle's binaries are (pack_gpu_bundle.sh), next to the
# working tree's commit (the scripts that run them).
if [ -n "${cd_bundle:-}" ] && [ -f "$cd_bundle/BUILT_FROM" ]; then
  sed 's/^/[bundle] /' "$cd_bundle/BUILT_FROM" | tee -a "$out/session.log"
fi
log "working tree: $(git rev-parse HEAD 2>/dev/null || echo 'no git')"
log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ldd "$cuda/tests/blockattn_test_cuda" 2>&1 | grep -E 'cudnn|nvrtc|cudart|not found' | tee -a "$out/session.log"

# 0. PyTorch's SDPA, the reference every speed row below reads (torch.txt).
step torch_sdpa 120 python3 bench/torch_sdpa.py --device cuda --heads 16 --dims 128 \
  --lengths 4096,8192,16384 --dtypes "$dtypes" --out "$logs/torch.txt"

# 1. The tensor-core forward (kernel/cuda/flash_forward.hpp), backward
#     (cuda/flash_backward.hpp) and fp32 forward (cuda/flash_forward_f32.hpp): their
#     checks, then their speed next to PyTorch's (the same torch.txt; "bwd"
#     rows for the backward, then the fp32 table). First: the backward and
#     the fp32 forward have never run on a GPU, the cuDNN path has.
if [ -x "$cuda/tests/blockattn_flash_check" ]; then
  # (Most of its time is the fp64 references on the host: 192 forward cases of
  # three variants, 40 backward, 64 fp32; an estimate of ~45 s, hence 120.)
  step flash_check 120 "$cuda/tests/blockattn_flash_check"
  grep -sE 'FAIL|passed|failed' "$logs/flash_check.log" | head -20 | tee -a "$out/session.log"
  step flash_bench 60 "$cuda/tests/blockattn_flash_check" --bench --torch "$logs/torch.txt"
  cat 2>/dev/null "$logs/flash_bench.log" >>"$out/session.log"
fi
# 2. Correctness on the GPU, cuDNN on: every single-device test case (the
#    16-bit ones against the fused bound where cuDNN ran, bitwise otherwise).
if [ -x "$cuda/tests/blockattn_test_cuda" ]; then
  step test_cuda 150 "$cuda/tests/blockattn_test_cuda" -d
  grep -sE 'test cases|assertions|Status|ERROR|FAILED' "$logs/test_cuda.log" | head -30 | tee -a "$out/session.log"
  # The library's 16-bit cases again on the tensor-core forward's wide
  # variant (BLOCKATTN_FLASH_VARIANT, kernel/cuda/flash_path.hpp).
  step test_cuda_wide 60 env BLOCKATTN_FLASH_VARIANT=wide "$cuda/tests/blockattn_test_cuda" \
    -tc='16-bit*,bf16*'
  grep -sE 'test cases|assertions|Status' "$logs/test_cuda_wide.log" | tee -a "$out/session.log"
else
  log "no $cuda/tests/blockattn_test_cuda: skipped"
fi

# 2b. Speed: PyTorch's SDPA (above) and ours in the same job (bf16 fused, then our kernels).
if [ -x "$cuda/bench/blockattn_bench_gpu" ]; then
  step bench_gpu 120 "$cuda/bench/blockattn_bench_gpu" --dtypes "$dtypes" --torch "$logs/torch.txt"
  [ -f "$logs/bench_gpu.log" ] && cat "$logs/bench_gpu.log" >>"$out/session.log"
  # The cost of the check of V for inf / NaN that masked cuDNN calls make.
  step bench_gpu_noguard 60 "$cuda/bench/blockattn_bench_gpu" --dtypes bf16 --guard 0 \
    --torch "$logs/torch.txt"
  grep -s causal "$logs/bench_gpu_noguard.log" >>"$out/session.log"
else
  log "no $cuda/bench/blockattn_bench_gpu: skipped"
fi

# 2c. fp32 on tensor cores through the library (ForwardOptions::fp32_tensor_cores,
#     cuda/flash_forward_f32.hpp; its check of q, k, v for inf / NaN included), next
#     to PyTorch's fp32 (flash_check above checked the kernel against fp64).
if [ -x "$cuda/bench/blockattn_bench_gpu" ]; then
  for m in tf32x3 tf32; do
    step "bench_gpu_fp32_$m" 60 "$cuda/bench/blockattn_bench_gpu" --dtypes fp32 --fp32-tc $m \
      --backward 0 --torch "$logs/torch.txt"
    grep -s '^fwd' "$logs/bench_gpu_fp32_$m.log" | sed "s/^/$m /" >>"$out/session.log"
  done
fi

# 3. Ranks sharing the GPU (the distributed suite, a ring's steps), and the
#    planner at P = 4, 8 on the CPUs.
if [ -d .mpi ]; then
  export OPAL_PREFIX=$PWD/.mpi/usr PATH=$PWD/.mpi/usr/bin:$PATH
  export LD_LIBRARY_PATH=$PWD/.mpi/usr/lib/x86_64-linux-gnu:$PWD/.mpi/usr/lib/x86_64-linux-gnu/openmpi/lib:$LD_LIBRARY_PATH
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader
  export PMIX_INSTALL_PREFIX=$PWD/.mpi/usr/lib/x86_64-linux-gnu/pmix2 PMIX_MCA_pcompress_base_silence_warning=1
  if [ -x "$cuda/bench/blockattn_bench_steps" ]; then
    step steps_np2 60 mpiexec -n 2 --oversubscribe --bind-to none "$cuda/bench/blockattn_bench_steps" \
      --n 16384 --heads 16 --dim 128 --reps 5 --dtype bf16
    cat 2>/dev/null "$logs/steps_np2.log" >>"$out/session.log"
    # The ring's backward: its own pairs on cuDNN per band piece.
    step steps_backward_np2 60 mpiexec -n 2 --oversubscribe --bind-to none \
      "$cuda/bench/blockattn_bench_steps" --n 16384 --heads 16 --dim 128 --reps 3 --dtype bf16 \
      --pass backward
    cat 2>/dev/null "$logs/steps_backward_np2.log" >>"$out/session.log"
    # The Q ring's backward: travelled queries on cuDNN through a proxy O.
    step steps_burst_backward_np2 60 mpiexec -n 2 --oversubscribe --bind-to none \
      "$cuda/bench/blockattn_bench_steps" --n 16384 --heads 16 --dim 128 --reps 3 --dtype bf16 \
      --pass backward --schedule burst
    cat 2>/dev/null "$logs/steps_burst_backward_np2.log" >>"$out/session.log"
  fi
  # NcclCommunicator (never run on a GPU before): one rank per GPU.
  if [ -x "$cuda/tests/blockattn_test_nccl" ]; then
    step nccl_np1 60 mpiexec -n 1 --bind-to none "$cuda/tests/blockattn_test_nccl"
    grep -sE 'test cases|Status|ERROR|FAILED' "$logs/nccl_np1.log" | head -10 | tee -a "$out/session.log"
  fi
  if [ -x "$cuda/tests/blockattn_test_fused_distributed_cuda" ]; then
    for np in 1 2 3 4; do
      step "fused_distributed_np$np" 60 mpiexec -n $np --oversubscribe --bind-to none \
        "$cuda/tests/blockattn_test_fused_distributed_cuda"
      grep -sE 'test cases|Status|ERROR|FAILED' "$logs/fused_distributed_np$np.log" | head -10 | tee -a "$out/session.log"
    done
  fi
  if [ -x "$cuda/tests/blockattn_test_distributed_cuda" ]; then
    for np in 2 4; do
      step "distributed_cuda_np$np" 90 mpiexec -n $np --oversubscribe --bind-to none \
        "$cuda/tests/blockattn_test_distributed_cuda"
      grep -sE 'test cases|Status|ERROR|FAILED' "$logs/distributed_cuda_np$np.log" | head -10 | tee -a "$out/session.log"
    done
  fi
  if [ -x "$host/bench/blockattn_bench_plan" ]; then
    for np in 4 8; do
      step "bench_plan_np$np" 60 env OMP_NUM_THREADS=$((16 / np)) OMP_PROC_BIND=false \
        mpiexec -n $np --oversubscribe --bind-to none "$host/bench/blockattn_bench_plan"
      tail -15 2>/dev/null "$logs/bench_plan_np$np.log" >>"$out/session.log"
      # Four heads (the query tiles spread over more teams than threads).
      step "bench_plan_np${np}_h4" 60 env OMP_NUM_THREADS=$((16 / np)) OMP_PROC_BIND=false \
        mpiexec -n $np --oversubscribe --bind-to none "$host/bench/blockattn_bench_plan" --heads 4
      # The backward's model (a training step's other half; the Q ring joins).
      step "bench_plan_np${np}_bwd" 60 env OMP_NUM_THREADS=$((16 / np)) OMP_PROC_BIND=false \
        mpiexec -n $np --oversubscribe --bind-to none "$host/bench/blockattn_bench_plan" \
        --pass backward --n-local 2048 --reps 3
      tail -12 2>/dev/null "$logs/bench_plan_np${np}_bwd.log" >>"$out/session.log"
    done
  fi
else
  log "no .mpi (Open MPI unpacked with dpkg -x): the multi-rank steps skipped"
fi

# 4. compute-sanitizer on the tensor-core kernel's checks (small problems).
if [ -x "$cuda/tests/blockattn_flash_check" ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    step "flash_$tool" 90 compute-sanitizer --tool $tool --error-exitcode 9 \
      "$cuda/tests/blockattn_flash_check" --variant "${FLASH_SANITIZE_VARIANT:-wide}"
    grep -sE 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$logs/flash_$tool.log" | tee -a "$out/session.log"
  done
fi
# 4b. compute-sanitizer memcheck on the score-policy cases (their LSE).
if [ -x "$cuda/tests/blockattn_test_cuda" ] && command -v compute-sanitizer >/dev/null; then
  step score_memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$cuda/tests/blockattn_test_cuda" -tc='score policies and sinks match*'
  grep -sE 'ERROR SUMMARY|test cases' "$logs/score_memcheck.log" | tee -a "$out/session.log"
fi
# 4c. Nsight Compute on one launch of the tensor-core forward (N = 4096, full):
#     speed of light, occupancy, the pipes (where the runtime lets ncu read
#     the counters; --clock-control none leaves the clocks alone).
if [ -x "$cuda/tests/blockattn_flash_check" ] && command -v ncu >/dev/null; then
  for v in ${NCU_VARIANTS:-regs wide}; do
    step "ncu_$v" 60 ncu --clock-control none --kernel-name regex:forward_kernel --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section WarpStateStats \
      "$cuda/tests/blockattn_flash_check" --bench --reps 1 --variant "$v"
  done
fi
# 4d. The same on one launch of each tensor-core backward kernel (dK/dV, dQ),
#     and of the fp32 forward.
if [ -x "$cuda/tests/blockattn_flash_check" ] && command -v ncu >/dev/null; then
  step ncu_backward 60 ncu --clock-control none --kernel-name regex:'dkdv_kernel|dq_kernel' \
    --launch-count 2 --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis \
    --section WarpStateStats "$cuda/tests/blockattn_flash_check" --bench --reps 1 --variant wide
  # ... and of the fp32 forward (tf32x3, N = 4096, full).
  step ncu_fp32 60 ncu --clock-control none --kernel-name regex:forward_f32_kernel \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis \
    --section WarpStateStats "$cuda/tests/blockattn_flash_check" --bench --reps 1 --variant wide
fi
# 5. Our kernels alone at one length (the fused path's gain), score policies
#    and sinks, decode, the distributed decode step on the CPUs.
if [ -x "$cuda/bench/blockattn_bench_gpu" ]; then
  step bench_gpu_portable 60 "$cuda/bench/blockattn_bench_gpu" --dtypes bf16 --lengths 4096 \
    --portable 1 --torch "$logs/torch.txt"
  cat 2>/dev/null "$logs/bench_gpu_portable.log" >>"$out/session.log"
fi
if [ -x "$cuda/bench/blockattn_bench_score" ]; then
  step bench_score 60 "$cuda/bench/blockattn_bench_score" --n 4096 --heads 16 --reps 3
fi
if [ -x "$cuda/bench/blockattn_bench_decode" ]; then
  step bench_decode 60 "$cuda/bench/blockattn_bench_decode" --reps 5
  step prefill_cuda 60 "$cuda/bench/blockattn_bench_decode" --prefill --reps 3
  # 8-bit and paged caches on the GPU's split-KV kernel (never timed there).
  step decode_quant_cuda 60 "$cuda/bench/blockattn_bench_decode" --quant --reps 3
  step decode_paged_cuda 60 "$cuda/bench/blockattn_bench_decode" --paged --reps 3
fi
# Chunked prefill on 16 CPU cores: where the forward's kernels overtake the
# decode kernel with many threads (ServeOptions::prefill_forward_rows).
if [ -x "$host/bench/blockattn_bench_decode" ]; then
  step prefill_host 90 env OMP_NUM_THREADS=16 OMP_PROC_BIND=spread \
    "$host/bench/blockattn_bench_decode" --prefill --reps 3
  grep -sE '^(type|fp32|bf16) ' "$logs/prefill_host.log" >>"$out/session.log"
fi
if [ -d .mpi ]; then
  for np in 1 3; do
    [ -x "$cuda/tests/blockattn_test_distributed_cuda" ] &&
      step "distributed_cuda_np$np" 90 mpiexec -n $np --oversubscribe --bind-to none \
        "$cuda/tests/blockattn_test_distributed_cuda"
  done
  for np in 1 2; do
    [ -x "$cuda/tests/blockattn_test_random_cuda" ] &&
      step "random_cuda_np$np" 90 mpiexec -n $np --oversubscribe --bind-to none \
        "$cuda/tests/blockattn_test_random_cuda"
  done
  grep -shE 'test cases|Status' "$logs"/distributed_cuda_np[13].log "$logs"/random_cuda_np*.log 2>/dev/null | tee -a "$out/session.log"
fi
if [ -d .mpi ] && [ -x "$host/bench/blockattn_bench_serve" ]; then
  for np in 1 2 4 8; do
    step "bench_serve_np$np" 60 env OMP_NUM_THREADS=$((16 / np)) OMP_PROC_BIND=false \
      mpiexec -n $np --oversubscribe --bind-to none "$host/bench/blockattn_bench_serve" --reps 3
  done
fi
pack
log "done"
