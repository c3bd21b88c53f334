#!/bin/sh
# The docs' figures from fresh benchmark runs, in one command (make plots): installs what the
# benchmarks and the figures need, builds, runs every benchmark with --json into docs/data/
# (about 40 minutes on two cores; bench/multihost only as root) and draws docs/img/*.png from it.
#   sh scripts/plots.sh                    all of them
#   sh scripts/plots.sh train,pipeline     these benchmarks again, every figure redrawn
set -e
cd "$(dirname "$0")/.."
sh scripts/deps.sh bench torch plots
make -j"$(nproc)"
if [ -n "${1:-}" ]; then
    exec /usr/bin/python3 scripts/plots.py --run --only "$1"
fi
exec /usr/bin/python3 scripts/plots.py --run
