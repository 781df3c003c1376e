#!/usr/bin/env bash
# The GPU suite, in one command on a CUDA machine: install, run the `cuda` tests, run the
# benchmarks, print a short table last. Results go to $OUT (the device tool's folder) or results/.
# GPU_SUITE_STEPS picks steps (comma-separated, default all but nccl and multi): tests (the `cuda` tests of
# GPU_SUITE_TESTS, default every package), bench (kernels), linear
# (host time per Linear fwd+bwd, benchmarks/linear_host.py), e2e (benchmarks/e2e.py, ~8 min on an
# H100; E2E_ARGS adds options, e.g. "--runs bf16,fp8"), optim (FusedAdam, benchmarks/optim.py), and on
# every GPU of the host: nccl (the NCCL tests and collective bandwidth) and leak (memory after each
# of 300 steps on 2 GPUs, every recipe and weight mode, eager and compiled), side by side (~7 min
# for both on 2 H200s), then multi (benchmarks/multi_gpu.py with MULTI_GPU_ARGS, e.g.
# "--runs bf16:compiled,fp8:qw:compiled --repeats 3"; ~35 s per run on the 2.2B model), and titan
# (benchmarks/torchtitan_trainer.py: inside torchtitan 0.2.2's own Trainer on one GPU, bf16 and
# torchtitan's float8 vs ours, each run a torchrun process, ending by its --deadline-s (450 s);
# TITAN_ARGS adds options, e.g. "--runs bf16,fp8:qw-bf16 --repeats 3"; not in the default steps), and
# rsfidelity (benchmarks/reduce_scatter_fidelity.py: the FP8 gradient reduce-scatter against bf16's
# over 8 simulated ranks, 1000 steps per run; RS_FIDELITY_ARGS adds options, e.g. "--runs
# fp8:hp:compiled --reductions bf16", then "... --reductions fp8 --include FILE"; not in the defaults).
# `--multi` is GPU_SUITE_STEPS=nccl,leak,multi.
#
# The GPU image has torch, Triton, pytest, hypothesis, rich, scikit-build-core and pybind11 but no
# network and no hatchling, so quant-core is built in place without build isolation (for the bench
# step, which times its C++ kernels; GPU_SUITE_CPP=1 for any other step) and the three pure-Python
# packages and the lab (lab/: the demo and the test worlds) are put on PYTHONPATH rather than
# installed. torchao (for the e2e and host-time comparisons) and torchtitan 0.2.2 with its
# dependencies (the titan step) come as wheels in the git-ignored .whl/ folder, which
# scripts/gpu-wheels.sh fills.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [[ "${1:-}" == "--multi" ]]; then GPU_SUITE_STEPS=nccl,leak,multi; fi
steps=",${GPU_SUITE_STEPS:-tests,bench,linear,e2e,optim},"
# NVLink multicast stays off: on shared hosts a program using it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
want() { [[ "$steps" == *",$1,"* ]]; }

python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name())'
if want bench || [[ "${GPU_SUITE_CPP:-0}" == 1 ]]; then
  # The kernel benchmark times the C++ kernels too (a build of a few minutes).
  python3 -m pip install -q --no-build-isolation --no-deps ./packages/quant-core 2>&1 | tail -3
else
  # Every other step runs the Triton and reference kernels only: quant-core from its sources,
  # without the C++ extension (`quant_core.available_backends()` then leaves out cpp).
  export PYTHONPATH="$PWD/packages/quant-core/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/packages/quant-tensors/src:$PWD/packages/quant-fsdp/src:$PWD/packages/quant-optim/src:$PWD/lab/src${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import quant_core; print("quant_core", quant_core.__version__, "backends", quant_core.available_backends())'
if (want tests || want e2e || want linear || want multi || want titan || want rsfidelity) && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -3
  export PYTHONPATH="$PYTHONPATH:/tmp/site"  # after ours, still before site-packages: only what the image lacks
fi

set +e
tests_rc=5  # pytest's "no tests collected" when the step is skipped
bench_rc=0
if want tests; then
  # The tests compare with CPU references on large inputs: spread them over processes with one
  # torch thread each (one process with 16 threads took > 10 min).
  parallel=()
  if python3 -c 'import xdist' 2> /dev/null; then parallel=(-n "${GPU_SUITE_WORKERS:-8}"); fi
  # A test that hangs (e.g. a collective that never completes) fails after this many seconds.
  if python3 -c 'import pytest_timeout' 2> /dev/null; then parallel+=(--timeout "${GPU_SUITE_TEST_TIMEOUT:-300}"); fi
  # shellcheck disable=SC2086  # GPU_SUITE_TESTS is a list of paths
  OMP_NUM_THREADS=1 python3 -m pytest -m cuda -rfE -v --durations=25 -p no:cacheprovider -p no:benchmark \
    "${parallel[@]}" --junitxml="$out/cuda-tests.xml" ${GPU_SUITE_TESTS:-} 2>&1 | tee "$out/cuda-tests.log"
  tests_rc=${PIPESTATUS[0]}
fi
if want bench; then
  python3 benchmarks/kernel_speed.py --device cuda --out "$out" 2>&1 | tee "$out/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi
if want linear; then
  python3 benchmarks/linear_host.py --device cuda --out "$out" 2>&1 | tee "$out/linear.log"
  bench_rc=$(( bench_rc | PIPESTATUS[0] ))
fi
if want e2e; then
  # shellcheck disable=SC2086  # E2E_ARGS is a list of options
  python3 benchmarks/e2e.py --device cuda --out "$out" ${E2E_ARGS:-} 2>&1 | tee "$out/e2e.log"
  bench_rc=$(( bench_rc | PIPESTATUS[0] ))
fi
nccl_tests=(tests-integration/test_fsdp2_cuda.py tests-integration/test_nccl_training.py tests-integration/test_long_run.py)
nccl_timeout=() leak_timeout=()
if python3 -c 'import pytest_timeout' 2> /dev/null; then
  # The 2000-step long run takes ~3 min of the nccl step; a compiled leak case several.
  nccl_timeout=(--timeout "${GPU_SUITE_TEST_TIMEOUT:-600}") leak_timeout=(--timeout 600)
fi
# The 2-GPU tests run side by side: the nccl step's tests one after another in one pytest, each
# leak case in a pytest of its own (each holds well under 1 GiB of either GPU, and a compiled case
# spends most of its minutes compiling on the CPU), so both steps take about as long as the longest.
jobs_rc=() job_pids=()
if want nccl; then
  OMP_NUM_THREADS=1 python3 -m pytest -m cuda -rfE -v -s -p no:cacheprovider -p no:benchmark "${nccl_timeout[@]}" \
    -k "not stays_flat" "${nccl_tests[@]}" > "$out/multi-tests.log" 2>&1 &
  job_pids+=($!)
fi
if want leak; then
  mapfile -t leak_ids < <(python3 -m pytest --collect-only -q -p no:cacheprovider -k "stays_flat" "${nccl_tests[@]}" | grep "::")
  for id in "${leak_ids[@]}"; do
    case_name="${id##*[}"
    OMP_NUM_THREADS=1 python3 -m pytest -rfE -v -s -p no:cacheprovider -p no:benchmark "${leak_timeout[@]}" \
      "$id" > "$out/leak-${case_name%]}.log" 2>&1 &
    job_pids+=($!)
  done
fi
for pid in "${job_pids[@]}"; do
  wait "$pid"
  jobs_rc+=($?)
done
for rc in "${jobs_rc[@]}"; do tests_rc=$(( tests_rc == 5 ? rc : tests_rc | rc )); done
if want nccl; then
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  torchrun --standalone --nproc-per-node="$gpus" benchmarks/collective_bandwidth.py 2>&1 | tee "$out/bandwidth.log"
fi
if want multi; then
  # shellcheck disable=SC2086  # MULTI_GPU_ARGS is a list of options
  python3 benchmarks/multi_gpu.py --drive --model llama-2b --out "$out/multi_gpu" ${MULTI_GPU_ARGS:-} 2>&1 | tee "$out/multi_gpu.log"
  bench_rc=$(( bench_rc | PIPESTATUS[0] ))
fi
if want titan; then
  # shellcheck disable=SC2086  # TITAN_ARGS is a list of options
  python3 benchmarks/torchtitan_trainer.py --out "$out/torchtitan" ${TITAN_ARGS:-} 2>&1 | tee "$out/titan.log"
  bench_rc=$(( bench_rc | PIPESTATUS[0] ))
fi
if want rsfidelity; then
  # shellcheck disable=SC2086  # RS_FIDELITY_ARGS is a list of options
  python3 benchmarks/reduce_scatter_fidelity.py --device cuda --out "$out/rs_fidelity" ${RS_FIDELITY_ARGS:-} 2>&1 | tee "$out/rs_fidelity.log"
  bench_rc=$(( bench_rc | PIPESTATUS[0] ))
fi
if want optim; then
  python3 benchmarks/optim.py --device cuda --out "$out" 2>&1 | tee "$out/bench_optim.log"
  bench_rc=$(( bench_rc | PIPESTATUS[0] ))
fi
set -e

echo
echo "== gpu-suite summary (steps: ${steps:1:-1})"
if want tests; then tail -n 1 "$out/cuda-tests.log"; fi
if want bench && [[ -f "$out/bench.json" ]]; then
python3 - "$out/bench.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print(f"torch {report['torch']}, {report['date']}, {report['size']}x{report['size']} bf16")
for device in report["devices"]:
    for r in device["results"]:
        print(f"{device['device'][:24]:24} {r['case'][:38]:38} {r['backend']:9} {r['median_ms']:9.3f} ms {r['gb_per_s']:8.1f} GB/s {r['speedup_vs_reference']:6.2f}x ref")
PY
fi
if want linear; then grep -A40 "Host time per Linear" "$out/linear.log" || true; fi
if want e2e && [[ -f "$out/e2e.md" ]]; then cat "$out/e2e.md"; fi
if want nccl; then tail -n 1 "$out/multi-tests.log"; grep '"collective"' "$out/bandwidth.log" || true; fi
if want leak; then grep -hE "spread|passed|failed" "$out"/leak-*.log || true; fi
if want multi; then grep "^|" "$out/multi_gpu/multi_gpu.md" || true; fi
if want titan; then sed -n "/^torchtitan 0.2 Trainer, one GPU/,\$p" "$out/titan.log" || true; fi
if want rsfidelity && [[ -f "$out/rs_fidelity/reduce_scatter_fidelity.md" ]]; then grep "^|" "$out/rs_fidelity/reduce_scatter_fidelity.md"; fi
if want optim; then sed -n "/^FusedAdam vs torch AdamW/,/^wrote /{/^wrote /!p}" "$out/bench_optim.log" || true; fi
exit $(( tests_rc == 5 ? bench_rc : tests_rc | bench_rc ))
