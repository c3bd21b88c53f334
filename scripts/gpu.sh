#!/bin/sh
# The one command that verifies tandem on a GPU machine: sets up what the machine lacks,
# builds with CUDA (warnings kept as warnings), runs every test that has GPU cases (the test
# programs whose cases skip with "no CUDA device" elsewhere) side by side, then the GPU
# benchmarks beside their peers, then a short run of each example on the GPU, and prints a
# report. It keeps to one 10-minute call on a 16-core GPU machine: every phase's time limit is
# cut to what is left of TD_GPU_SECONDS (540 by default), so a hang or a slow phase costs the
# report nothing but its own lines. TD_GPU_BENCH passes train_gpu its options ("--models
# mlp"), TD_GPU_BENCH=none skips the benchmarks; TD_GPU_SANITIZE=1 runs test_cuda_graph under
# compute-sanitizer (slow: for chasing a bad address).
#
#   sh scripts/gpu.sh --fetch   here, with apt: downloads the Debian packages the build needs
#                               into .gpu-debs/ (ignored by git), to carry to a machine that
#                               has no package manager or network
#   sh scripts/gpu.sh           there: unpacks them into a scratch folder when oneDNN, make or
#                               the data sets are not installed, builds, tests, reports
#
# cuDNN and NCCL come from the CUDA toolkit's folders, or else from PyTorch's pip wheels (found
# under site-packages/nvidia/ by their file names). Where $OUT names a folder, the build log,
# every test's log and every benchmark's and example's output are left there as
# gpu-logs.tar.gz.
set -e
cd "$(dirname "$0")/.."
debs=${TD_GPU_DEBS:-.gpu-debs}
if [ "${1:-}" = --fetch ]; then
    mkdir -p "$debs"
    cd "$debs"
    # oneDNN's library needs the OpenCL loader (ocl-icd-libopencl1) to link and load.
    apt-get download libdnnl2 libdnnl-dev ocl-icd-libopencl1 zlib1g zlib1g-dev \
        dataset-fashion-mnist r-cran-janeaustenr make
    ls -l
    exit 0
fi
# The driver first, in one line: without one, or with one older than CUDA 13's runtime needs
# (580.65), every GPU test would only skip.
need=580.65
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
if [ -z "$driver" ]; then
    echo "gpu.sh: no NVIDIA driver or GPU here (nvidia-smi answers none): nothing to check" >&2
    exit 1
fi
if [ "$(printf '%s\n%s\n' "$need" "$driver" | sort -V | head -n 1)" != "$need" ]; then
    echo "gpu.sh: NVIDIA driver $driver is older than $need, which CUDA 13's runtime needs" >&2
    exit 1
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
fashion=/usr/share/datasets/fashion-mnist
austen=/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb
if [ ! -e /usr/include/dnnl.h ] || ! command -v make >/dev/null 2>&1 || [ ! -d "$fashion" ] ||
    [ ! -e "$austen" ]; then
    if ! ls "$debs"/*.deb >/dev/null 2>&1; then
        echo "gpu.sh: oneDNN, make or the data sets are not installed here and $debs/ holds no" \
            ".deb files: run 'sh scripts/gpu.sh --fetch' on a machine with apt and bring" \
            "$debs/ along" >&2
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
    [ ! -d "$fashion" ] && [ -d "$root$fashion" ] && export TD_FASHION_MNIST_DIR="$root$fashion"
    [ -e "$austen" ] || austen="$root$austen"
fi
command -v nvcc >/dev/null 2>&1 || [ ! -x /usr/local/cuda/bin/nvcc ] ||
    export PATH="$PATH:/usr/local/cuda/bin"
# cuDNN, NCCL and cuBLAS of PyTorch's wheels, wherever their layout puts them.
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
if [ -n "$site" ] && [ -d "$site/nvidia" ]; then
    for f in libcudnn.so.9 libnccl.so.2 libcublasLt.so.13; do
        d=$(find "$site/nvidia" -name "$f" 2>/dev/null | head -n 1)
        [ -n "$d" ] || continue
        # -lcublasLt wants the unversioned name, which the wheel lacks: a link, found after
        # the toolkit's own folder
        if [ "$f" = libcublasLt.so.13 ]; then
            mkdir -p "$root/link"
            ln -sf "$d" "$root/link/libcublasLt.so"
            export LIBRARY_PATH="${LIBRARY_PATH:+$LIBRARY_PATH:}$root/link"
        fi
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
# Warnings stay warnings: this machine's compilers may be newer than the ones the code was
# written against (CI builds with -Werror).
if ! timeout "$(left 300)" make -j"$(nproc)" WERROR= all tests > "$logs/build.log" 2>&1; then
    grep -E 'error|cannot find|No such file|undefined reference' "$logs/build.log" | head -n 30
    tail -n 20 "$logs/build.log"
    echo "gpu.sh: the build failed" >&2
    exit 1
fi
echo "built in $(($(date +%s) - t0)) s, $(grep -c 'warning:' "$logs/build.log") warnings"
[ -e build/lib/libtandem_cuda.so ] || { echo "gpu.sh: libtandem_cuda.so was not built" >&2; exit 1; }

echo "== GPU tests (side by side)"
status=0
t0=$(date +%s)
tests=$(grep -l 'no CUDA device' tests/test_*.c | sed 's|tests/||; s|\.c$||')
limit=$(left 240)
for t in $tests; do
    if [ "$t" = test_cuda_graph ] && [ "${TD_GPU_SANITIZE:-0}" = 1 ]; then
        OMP_NUM_THREADS=1 timeout -k 5 "$limit" compute-sanitizer --print-limit 20 \
            "build/tests/$t" > "$logs/$t.log" 2>&1 &
    else
        OMP_NUM_THREADS=1 timeout -k 5 "$limit" "build/tests/$t" > "$logs/$t.log" 2>&1 &
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

# A program under a time limit (what is left of the budget when less), its output kept in the
# logs: name, lines of it to show, seconds at most, command...
run() {
    name=$1 lines=$2 most=$3
    shift 3
    if OMP_NUM_THREADS=1 timeout -k 5 "$(left "$most")" "$@" > "$logs/$name.log" 2>&1; then
        tail -n "$lines" "$logs/$name.log"
    else
        tail -n "$lines" "$logs/$name.log"
        echo "gpu.sh: $name failed or ran out of time" >&2
        status=1
    fi
}

# The benchmarks first (the issue's numbers), the training benchmark's models narrowed to the ones
# its targets name: PyTorch's MNIST example Net, the MLP and the CNN (3x PyTorch eager) and
# ResNet-50 with AMP (1x), beside the matmul ceiling.
bench=${TD_GPU_BENCH:---models net,mlp,cnn,resnet50 --precisions f32,bf16 --iters 10 --windows 3}
if [ "$bench" != none ]; then
    echo "== GPU training benchmark: build/bench/train_gpu $bench"
    # shellcheck disable=SC2086 # the options are words
    run train_gpu 40 200 build/bench/train_gpu $bench
    echo "== all-reduce on device memory: build/bench/allreduce_gpu"
    run allreduce_gpu 40 60 build/bench/allreduce_gpu --iters 10
    echo "== DDP on one GPU, two ranks sharing it: build/bench/train --device cuda:0"
    run train_cuda 20 90 build/bench/train --device cuda:0 --models mlp,cnn --worlds 1,2 \
        --amp O0,O2 --iters 10 --windows 3
    echo "== DataParallel vs DDP vs DDP + AMP on one GPU: build/bench/dp_vs_ddp --device cuda:0"
    run dp_vs_ddp 30 60 build/bench/dp_vs_ddp --device cuda:0 --model cnn --iters 60 --amp O2
fi

# The examples on the GPU, a short run each: the CNN on Fashion-MNIST, the GPT on Jane Austen,
# SimCLR on Fashion-MNIST.
echo "== examples on cuda"
run mnist 3 60 build/examples/mnist --model cnn --device cuda --max-steps 200
run gpt 12 60 build/examples/gpt --device cuda --data "$austen" --steps 300 --eval-every 100 \
    --sample 200
run contrastive 3 60 build/examples/contrastive --device cuda --epochs 1 --max-steps 100 \
    --probe-train 5000 --probe-test 1000 --probe-epochs 2
echo "== gpu.sh took $(($(date +%s) - start)) s, status $status"
exit "$status"
