#!/bin/sh
# Makes sure the Debian packages tandem needs are installed: installs the missing ones when
# run as root, otherwise prints the exact command to run and fails.
#   sh scripts/deps.sh          build, test and train
#   sh scripts/deps.sh bench    also PyTorch and OpenBLAS, the benchmarks' peer
#   sh scripts/deps.sh torch    also PyTorch's C++ headers and pybind11: make then builds the
#                               torch.distributed backend (bindings/torch) and make check runs
#                               its tests (make check-torch alone)
#   sh scripts/deps.sh plots    also matplotlib, for scripts/plots.py
#   sh scripts/deps.sh torch2   also a current PyTorch 2.x from PyPI (with its CUDA libraries,
#                               about 5 GB) in the virtual environment .venv/torch2: the second
#                               PyTorch column of bench/train and bench/gpt; Debian's PyTorch
#                               stays the one the tests and the torch binding use
#   sh scripts/deps.sh slurm    also Slurm's daemons and commands and munge: make check then runs
#                               tests/test_slurm.c on a cluster of one node it starts itself
# (several at once: sh scripts/deps.sh torch plots). UCX carries the bytes between hosts under
# tandemrun --nnodes; iproute2 and iptables build the emulated hosts the multi-host tests run
# on (scripts/hosts.sh). r-cran-janeaustenr ships Jane Austen's six novels, the English text
# examples/gpt trains on (docs/gpt.md).
set -e
pkgs="gcc make libc6-dev pkg-config libdnnl-dev zlib1g-dev dataset-fashion-mnist libopenmpi-dev openmpi-bin"
pkgs="$pkgs libucx-dev iproute2 iptables r-cran-janeaustenr"
for extra in "$@"; do
    case $extra in
    bench) pkgs="$pkgs python3-torch libopenblas0-pthread" ;;
    torch) pkgs="$pkgs g++ python3-torch libtorch-dev pybind11-dev" ;;
    plots) pkgs="$pkgs python3-matplotlib" ;;
    torch2) pkgs="$pkgs python3-venv" torch2=1 ;;
    slurm) pkgs="$pkgs slurmctld slurmd slurm-client munge" ;;
    *)
        echo "scripts/deps.sh: unknown set '$extra' (bench, torch, plots, torch2 or slurm)" >&2
        exit 2
        ;;
    esac
done
missing=""
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "tandem needs these Debian packages:$missing" >&2
        echo "install them with: sudo apt-get update && sudo apt-get install -y$missing" >&2
        exit 1
    fi
    echo "installing:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends $missing
fi
if [ -n "${torch2:-}" ]; then
    venv="$(dirname "$0")/../.venv/torch2"
    if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
        echo "installing PyTorch 2.x from PyPI into .venv/torch2"
        /usr/bin/python3 -m venv "$venv"
        "$venv/bin/pip" install -q torch
    fi
fi
