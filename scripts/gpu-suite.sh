#!/usr/bin/env bash
# The GPU suite, in one command on a CUDA machine: install, run the `cuda` tests, run the
# benchmarks, print a short table last. Results go to $OUT (the device tool's folder) or results/.
#
# The GPU image has torch, Triton, pytest, hypothesis, rich, scikit-build-core and pybind11 but no
# network and no hatchling, so quant-core is built in place without build isolation and the three
# pure-Python packages are put on PYTHONPATH rather than installed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name())'
python3 -m pip install -q --no-build-isolation --no-deps ./packages/quant-core 2>&1 | tail -3
export PYTHONPATH="$PWD/packages/quant-tensors/src:$PWD/packages/quant-fsdp/src:$PWD/packages/quant-optim/src${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import quant_core; print("quant_core", quant_core.__version__, "backends", quant_core.available_backends())'

set +e
python3 -m pytest -m cuda -q -p no:cacheprovider --junitxml="$out/cuda-tests.xml" 2>&1 | tee "$out/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}
python3 -m quant_fsdp.cli bench --device cuda --out "$out" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
python3 -m quant_optim.bench --device cuda --out "$out" 2>&1 | tee "$out/bench_optim.log"
bench_rc=$(( bench_rc | PIPESTATUS[0] ))
set -e

echo
echo "== gpu-suite summary"
tail -n 1 "$out/cuda-tests.log"
python3 - "$out/bench.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print(f"torch {report['torch']}, {report['date']}, {report['size']}x{report['size']} bf16")
for device in report["devices"]:
    for r in device["results"]:
        print(f"{device['device'][:24]:24} {r['case'][:38]:38} {r['backend']:9} {r['median_ms']:9.3f} ms {r['gb_per_s']:8.1f} GB/s {r['speedup_vs_reference']:6.2f}x ref")
PY
grep -A12 "^FusedAdam vs torch AdamW" "$out/bench_optim.log" | grep -v "^wrote" || true
exit $(( tests_rc == 5 ? bench_rc : tests_rc | bench_rc ))
