#!/bin/sh
# The README's main job: installs what is missing, builds, and trains PyTorch's MNIST example Net on
# Fashion-MNIST with two data-parallel ranks on this host. Extra arguments go to the
# example (e.g. --model cnn --epochs 3).
set -e
cd "$(dirname "$0")/.."
sh scripts/deps.sh
make -j"$(nproc)"
exec build/bin/tandemrun --nproc-per-node 2 build/examples/mnist --model net --epochs 2 "$@"
