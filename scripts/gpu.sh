#!/bin/sh
# The one command that verifies tandem on a GPU machine: sets up what the machine lacks,
# builds with CUDA, runs every test that has GPU cases (the test programs whose cases skip
# with "no CUDA device" elsewhere), then the GPU benchmark beside PyTorch, and prints a
# report. It fits in one 10-minute call on a 16-core GPU machine; TD_GPU_BENCH="--models mlp"
# (the benchmark's options) narrows the benchmark, TD_GPU_BENCH=none skips it.
#
#   sh scripts/gpu.sh --fetch   here, with apt: downloads the Debian packages the build needs
#                               into .gpu-debs/ (ignored by git), to carry to a machine that
#                               has no package manager or network
#   sh scripts/gpu.sh           there: unpacks them (dpkg -x, into a scratch folder) when
#                               oneDNN is not installed, builds, tests, reports
#
# cuDNN and NCCL come from the CUDA toolkit's folders, or else from PyTorch's pip wheels
# (site-packages/nvidia/cudnn, nvidia/nccl).
set -e
cd "$(dirname "$0")/.."
debs=${TD_GPU_DEBS:-.gpu-debs}
if [ "${1:-}" = --fetch ]; then
    mkdir -p "$debs"
    cd "$debs"
    apt-get download libdnnl2 libdnnl-dev zlib1g zlib1g-dev dataset-fashion-mnist
    ls -l
    exit 0
fi
root=/tmp/tandem-gpu-root
if [ ! -e /usr/include/dnnl.h ]; then
    if ! ls "$debs"/*.deb >/dev/null 2>&1; then
        echo "gpu.sh: oneDNN is not installed here and $debs/ holds no .deb files:" \
            "run 'sh scripts/gpu.sh --fetch' on a machine with apt and bring $debs/ along" >&2
        exit 1
    fi
    mkdir -p "$root"
    for f in "$debs"/*.deb; do dpkg -x "$f" "$root"; done
    # Links to absolute paths (libz.so -> /lib/...) must point into the scratch folder.
    find "$root" -type l | while read -r l; do
        case "$(readlink "$l")" in /*) ln -sf "$root$(readlink "$l")" "$l" ;; esac
    done
    export CPATH="$root/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    [ -d "$root/usr/share/datasets/fashion-mnist" ] &&
        export TD_FASHION_MNIST_DIR="$root/usr/share/datasets/fashion-mnist"
fi
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
for lib in cudnn nccl cublas; do
    if [ -n "$site" ] && [ -d "$site/nvidia/$lib/lib" ]; then
        export CPATH="$site/nvidia/$lib/include${CPATH:+:$CPATH}"
        export LIBRARY_PATH="$site/nvidia/$lib/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
        export LD_LIBRARY_PATH="$site/nvidia/$lib/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
done

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nvcc --version | tail -n 1
echo "$(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
python3 -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null || true

echo "== build"
start=$(date +%s)
make -j"$(nproc)" all tests > /tmp/tandem-gpu-build.log 2>&1 || {
    tail -n 40 /tmp/tandem-gpu-build.log
    exit 1
}
echo "built in $(($(date +%s) - start)) s"
[ -e build/lib/libtandem_cuda.so ] || { echo "gpu.sh: libtandem_cuda.so was not built" >&2; exit 1; }

echo "== GPU tests"
status=0
for src in $(grep -l 'no CUDA device' tests/test_*.c); do
    t=build/tests/$(basename "$src" .c)
    OMP_NUM_THREADS=1 timeout 300 "$t" > "/tmp/$(basename "$t").log" 2>&1 || status=1
    grep -v '^ok  ' "/tmp/$(basename "$t").log" | sed "s|^|$(basename "$t"): |"
    if grep -q '^skip ' "/tmp/$(basename "$t").log"; then
        echo "gpu.sh: $(basename "$t") skipped GPU cases on a GPU machine" >&2
        status=1
    fi
done
[ "$status" -eq 0 ] && echo "== all GPU tests passed" || echo "== GPU tests FAILED"

bench=${TD_GPU_BENCH:---iters 10 --windows 3}
if [ "$bench" != none ]; then
    echo "== GPU benchmark: build/bench/train_gpu $bench"
    # shellcheck disable=SC2086 # the options are words
    timeout 420 build/bench/train_gpu $bench || { echo "gpu.sh: the benchmark failed" >&2; status=1; }
fi
exit "$status"
