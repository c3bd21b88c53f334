#!/bin/sh
# The one command that verifies tandem on a GPU machine: sets up what the machine lacks,
# builds with CUDA, runs every test that has GPU cases (the test programs whose cases skip
# with "no CUDA device" elsewhere) side by side, a short run of each example on the GPU, then
# the GPU benchmarks beside their peers, and prints a report. It keeps to one 10-minute call
# on a 16-core GPU machine: every phase's time limit is cut to what is left of
# TD_GPU_SECONDS (540 by default), so a hang or a slow phase costs the report nothing but its
# own lines. TD_GPU_BENCH passes train_gpu its options ("--models mlp"), TD_GPU_BENCH=none
# skips the benchmarks; TD_GPU_SANITIZE=1 runs test_cuda_graph under compute-sanitizer
# (slow: for chasing a bad address).
#
#   sh scripts/gpu.sh --fetch   here, with apt: downloads the Debian packages the build needs
#                               into .gpu-debs/ (ignored by git), to carry to a machine that
#                               has no package manager or network
#   sh scripts/gpu.sh           there: unpacks them into a scratch folder when oneDNN (or make)
#                               is not installed, builds, tests, reports
#
# cuDNN and NCCL come from the CUDA toolkit's folders, or else from PyTorch's pip wheels (found
# under site-packages/nvidia/ by their file names). Where $OUT names a folder, the build log
# and every test's log are left there as gpu-logs.tar.gz.
set -e
cd "$(dirname "$0")/.."
debs=${TD_GPU_DEBS:-.gpu-debs}
if [ "${1:-}" = --fetch ]; then
    mkdir -p "$debs"
    cd "$debs"
    apt-get download libdnnl2 libdnnl-dev zlib1g zlib1g-dev dataset-fashion-mnist \
        r-cran-janeaustenr make
    ls -l
    exit 0
fi
start=$(date +%s)
budget=${TD_GPU_SECONDS:-540}
# Seconds a phase may take: its own limit, or what is left of the budget when that is less.
left() {
    l=$((budget - ($(date +%s) - start)))
    [ "$l" -lt "$1" ] && echo $((l > 5 ? l : 5)) || echo "$1"
}
logs=/tmp/tandem-gpu-logs
rm -rf "$logs"
mkdir -p "$logs"
keep_logs() {
    [ -n "${OUT:-}" ] && [ -d "$OUT" ] && tar -czf "$OUT/gpu-logs.tar.gz" -C /tmp tandem-gpu-logs
    return 0
}
trap keep_logs EXIT

root=/tmp/tandem-gpu-root
unpack() { # one .deb into $root, with dpkg where there is one, else ar and tar
    if command -v dpkg >/dev/null 2>&1; then
        dpkg -x "$1" "$root"
    else
        member=$(ar t "$1" | grep '^data\.tar')
        case $member in
        *.xz) ar p "$1" "$member" | tar -xJ -C "$root" ;;
        *.zst) ar p "$1" "$member" | zstd -dc | tar -x -C "$root" ;;
        *) ar p "$1" "$member" | tar -xz -C "$root" ;;
        esac
    fi
}
if [ ! -e /usr/include/dnnl.h ] || ! command -v make >/dev/null 2>&1; then
    if ! ls "$debs"/*.deb >/dev/null 2>&1; then
        echo "gpu.sh: oneDNN or make is not installed here and $debs/ holds no .deb files:" \
            "run 'sh scripts/gpu.sh --fetch' on a machine with apt and bring $debs/ along" >&2
        exit 1
    fi
    mkdir -p "$root"
    for f in "$debs"/*.deb; do unpack "$f"; done
    # Links to absolute paths (libz.so -> /lib/...) must point into the scratch folder.
    find "$root" -type l | while read -r l; do
        case "$(readlink "$l")" in /*) ln -sf "$root$(readlink "$l")" "$l" ;; esac
    done
    export PATH="$PATH:$root/usr/bin"
    export CPATH="$root/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    [ -d "$root/usr/share/datasets/fashion-mnist" ] &&
        export TD_FASHION_MNIST_DIR="$root/usr/share/datasets/fashion-mnist"
fi
command -v nvcc >/dev/null 2>&1 || [ ! -x /usr/local/cuda/bin/nvcc ] ||
    export PATH="$PATH:/usr/local/cuda/bin"
# cuDNN, NCCL and cuBLAS of PyTorch's wheels, wherever their layout puts them.
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
if [ -n "$site" ] && [ -d "$site/nvidia" ]; then
    for f in libcudnn.so.9 libnccl.so.2 libcublasLt.so.13; do
        d=$(find "$site/nvidia" -name "$f" 2>/dev/null | head -n 1)
        [ -n "$d" ] || continue
        d=$(dirname "$d")
        export LIBRARY_PATH="$d${LIBRARY_PATH:+:$LIBRARY_PATH}"
        export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
    for f in cudnn.h nccl.h; do
        d=$(find "$site/nvidia" -name "$f" 2>/dev/null | head -n 1)
        [ -n "$d" ] || continue
        d=$(dirname "$d")
        export CPATH="$d${CPATH:+:$CPATH}"
    done
fi

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nvcc --version | tail -n 1
echo "$(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
python3 -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null || true

echo "== build"
t0=$(date +%s)
if ! timeout "$(left 300)" make -j"$(nproc)" all tests > "$logs/build.log" 2>&1; then
    grep -E 'error|cannot find|No such file' "$logs/build.log" | head -n 30
    tail -n 20 "$logs/build.log"
    echo "gpu.sh: the build failed" >&2
    exit 1
fi
echo "built in $(($(date +%s) - t0)) s"
[ -e build/lib/libtandem_cuda.so ] || { echo "gpu.sh: libtandem_cuda.so was not built" >&2; exit 1; }

echo "== GPU tests (side by side)"
status=0
t0=$(date +%s)
tests=$(grep -l 'no CUDA device' tests/test_*.c | sed 's|tests/||; s|\.c$||')
limit=$(left 240)
for t in $tests; do
    if [ "$t" = test_cuda_graph ] && [ "${TD_GPU_SANITIZE:-0}" = 1 ]; then
        OMP_NUM_THREADS=1 timeout "$limit" compute-sanitizer --print-limit 20 "build/tests/$t" \
            > "$logs/$t.log" 2>&1 &
    else
        OMP_NUM_THREADS=1 timeout "$limit" "build/tests/$t" > "$logs/$t.log" 2>&1 &
    fi
done
wait || true
for t in $tests; do
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$logs/$t.log" | tail -n 1)
    echo "$t: ${line:-no closing line (crashed or timed out)}"
    grep -v -E '^(ok  |[0-9]+ passed)' "$logs/$t.log" | head -n 60 | sed 's/^/    /'
    case $line in
    *" 0 failed"*) ;;
    *) status=1 ;;
    esac
    if grep -q '^skip ' "$logs/$t.log"; then
        echo "gpu.sh: $t skipped GPU cases on a GPU machine" >&2
        status=1
    fi
done
echo "tests took $(($(date +%s) - t0)) s"
[ "$status" -eq 0 ] && echo "== all GPU tests passed" || echo "== GPU tests FAILED"

# The examples on the GPU, a short run each: the CNN on Fashion-MNIST, the GPT on Jane Austen,
# SimCLR on Fashion-MNIST.
echo "== examples on cuda"
austen=/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb
[ -e "$austen" ] || austen="$root$austen"
example() { # name, lines of its output to show, command...
    name=$1 lines=$2
    shift 2
    if OMP_NUM_THREADS=1 timeout "$(left 90)" "$@" > "$logs/$name.log" 2>&1; then
        tail -n "$lines" "$logs/$name.log"
    else
        tail -n 20 "$logs/$name.log"
        echo "gpu.sh: $name on cuda failed" >&2
        status=1
    fi
}
example mnist 3 build/examples/mnist --model cnn --device cuda --max-steps 200
example gpt 12 build/examples/gpt --device cuda --data "$austen" --steps 300 --eval-every 100 \
    --sample 200
example contrastive 3 build/examples/contrastive --device cuda --epochs 1 --max-steps 100 \
    --probe-train 5000 --probe-test 1000 --probe-epochs 2

bench=${TD_GPU_BENCH:---iters 10 --windows 3}
if [ "$bench" != none ]; then
    echo "== all-reduce on device memory: build/bench/allreduce_gpu"
    timeout "$(left 90)" build/bench/allreduce_gpu --iters 10 ||
        { echo "gpu.sh: allreduce_gpu failed" >&2; status=1; }
    echo "== DDP on one GPU, two ranks sharing it: build/bench/train --device cuda:0"
    timeout "$(left 120)" build/bench/train --device cuda:0 --models mlp,cnn --worlds 1,2 \
        --amp O0,O2 --iters 10 --windows 3 ||
        { echo "gpu.sh: bench/train on cuda:0 failed" >&2; status=1; }
    echo "== DataParallel vs DDP vs DDP + AMP on one GPU: build/bench/dp_vs_ddp --device cuda:0"
    timeout "$(left 90)" build/bench/dp_vs_ddp --device cuda:0 --model cnn --iters 60 --amp O2 ||
        { echo "gpu.sh: dp_vs_ddp on cuda:0 failed" >&2; status=1; }
    echo "== GPU training benchmark: build/bench/train_gpu $bench"
    # shellcheck disable=SC2086 # the options are words
    timeout "$(left 420)" build/bench/train_gpu $bench ||
        { echo "gpu.sh: train_gpu failed or ran out of time" >&2; status=1; }
fi
echo "== gpu.sh took $(($(date +%s) - start)) s, status $status"
exit "$status"
