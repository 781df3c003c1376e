#!/usr/bin/env bash
# Downloads into the git-ignored .whl/ folder the wheels the GPU runs need and the GPU image lacks
# (it has no network; scripts/gpu-suite.sh installs .whl/*.whl with --no-deps into /tmp/site):
# torchao (the e2e, linear and multi steps' peer), torchtitan 0.2.2 with the dependencies it imports
# (the `titan` step, benchmarks/torchtitan_trainer.py) and pytest-xdist (the `tests` step).
# The image has torch 2.11 (torchtitan 0.3 needs >= 2.12), Python 3.12, Triton, transformers,
# tokenizers, tensorboard, einops, pillow, fsspec, pyarrow, pandas, xxhash, huggingface-hub,
# pytest, rich and pybind11.
# The pins work together: torchtitan 0.2.2 imports and trains with them (checked on torch 2.13 CPU,
# the lists below and nothing else beyond the image's packages).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
download=(python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --dest .whl)
"${download[@]}" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  torchao==0.18.0 \
  torchtitan==0.2.2 torchdata==0.11.0 \
  datasets==4.1.1 dill==0.4.0 multiprocess==0.70.16 \
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
  pytest-xdist==3.8.0 execnet==2.1.2
# Pure-Python wheels of packages that also come compiled per interpreter; requests and its
# dependencies for datasets.
"${download[@]}" --platform any --implementation py tomli==2.5.0 charset-normalizer==3.4.4 \
  requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1
ls -1 .whl
