#!/bin/sh
# The README's test command: installs what is missing, builds, and runs the suite twice
# (optimised, then under AddressSanitizer + UndefinedBehaviorSanitizer).
set -e
cd "$(dirname "$0")/.."
sh scripts/deps.sh
make -j"$(nproc)" test
