#!/usr/bin/env bash
# Host-time and end-to-end A/B of source trees in one call on the GPU machine, alternating trees
# round by round (the VM's host speed drifts by tens of percent between calls, less within one).
#
#   bash benchmarks/ab_trees.sh prepare REV [REV ...]   # here: `git archive` each REV's sources into .ab/REV
#   ROUNDS=3 E2E_ROUNDS=2 bash benchmarks/ab_trees.sh run REV ... new   # there (device tool, carry [".ab", ".whl"])
#
# "new" is the working tree. Each round runs benchmarks/host_per_linear.py (LAYERS) under every tree,
# then each e2e round `benchmarks/e2e.py --runs $E2E_RUNS` (the working tree's benchmark) under
# every tree's packages. quant-core's
# compiled extension is built once from the working tree; an older tree's quant_core Python files
# are laid over a copy of it (valid while csrc/ is unchanged between the trees). The lab (the e2e
# benchmark's task) is the working tree's for every tree. Results: $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
action=${1:?prepare or run}
shift
if [[ "$action" == prepare ]]; then
  for rev in "$@"; do
    rm -rf ".ab/$rev" && mkdir -p ".ab/$rev"
    git archive "$rev" packages/quant-core/src packages/quant-tensors/src packages/quant-fsdp/src \
      packages/quant-optim/src | tar -x -C ".ab/$rev"
  done
  exit 0
fi
out="${OUT:-results}"
mkdir -p "$out"
python3 -m pip install -q --no-build-isolation --no-deps ./packages/quant-core > /dev/null 2>&1
site=$(python3 -c 'import os, quant_core; print(os.path.dirname(os.path.dirname(quant_core.__file__)))')
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ab-peers .whl/*.whl > /dev/null 2>&1
fi
path_of() {  # PYTHONPATH of tree $1
  local src="$PWD/packages" core="$site"
  if [[ "$1" != new ]]; then
    src="$PWD/.ab/$1/packages" core="/tmp/ab-core-$1"
    if [[ ! -d "$core" ]]; then
      mkdir -p "$core" && cp -r "$site/quant_core" "$core/" && cp "$src"/quant-core/src/quant_core/*.py "$core/quant_core/"
    fi
  fi
  echo "$core:$src/quant-tensors/src:$src/quant-fsdp/src:$src/quant-optim/src:$PWD/lab/src:/tmp/ab-peers"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  for tree in "$@"; do
    # shellcheck disable=SC2086  # LAYERS is a list
    echo "$tree $(PYTHONPATH=$(path_of "$tree") python3 benchmarks/host_per_linear.py ${LAYERS:-} 2> /dev/null)" | tee -a "$out/host_per_linear.txt"
  done
done
for round in $(seq 1 "${E2E_ROUNDS:-0}"); do
  for tree in "$@"; do
    PYTHONPATH=$(path_of "$tree") python3 benchmarks/e2e.py --device cuda --out "$out/e2e-$tree-$round" \
      --runs "${E2E_RUNS:-bf16:eager,fp8:hp:eager,mxfp8:hp:eager}" > "$out/e2e-$tree-$round.log" 2>&1 || true
    echo "== e2e round $round, tree $tree"
    grep "^| " "$out/e2e-$tree-$round/e2e.md" | tail -n +3 || tail -3 "$out/e2e-$tree-$round.log"
  done
done
