#!/bin/sh
# The CUDA compiler's resource report as a gate: reads, for each object of libtandem_cuda.so,
# ptxas's report (OBJ with .ptxas for .o, written by the build's nvcc -Xptxas -v) and the PTX the
# object carries (uncompressed), and fails, naming the kernel, on
#   - a register spill (any bytes of spill stores or loads, kernel or device function);
#   - static shared memory over 48 KiB (what a block may have without opting in);
#   - a kernel without launch bounds, or bounds other than TD__THREADS (device/cuda/kernel.cuh):
#     td__launch launches every kernel with TD__THREADS threads, so a kernel bounded lower would
#     be launched past its bounds, and one unbounded may be compiled for more registers than a
#     block of that size can have;
#   - registers x threads past a multiprocessor's 65536.
# Prints one markdown table row per kernel (file, kernel, registers, static shared memory, stack
# frame); with --docs FILE, also puts the table into FILE between the markers
# "<!-- cuda-resources -->" and "<!-- /cuda-resources -->" (docs/gpu.md's).
# A build folder instead of objects stands for the objects of every src/*/cuda/*.cu in it.
#   sh scripts/cuda_resources.sh build
#   sh scripts/cuda_resources.sh --docs docs/gpu.md build
set -e
docs=
if [ "$1" = --docs ]; then
    docs=$2
    shift 2
fi
cd "$(dirname "$0")/.." 2>/dev/null || true
if [ $# -eq 1 ] && [ -d "$1" ]; then
    build=$1
    set --
    for cu in src/*/cuda/*.cu; do set -- "$@" "$build/obj/${cu%.cu}.o"; done
fi
threads=$(sed -n 's/^#define TD__THREADS \([0-9][0-9]*\).*/\1/p' src/device/cuda/kernel.cuh)
table=$(mktemp)
bad=$(mktemp)
trap 'rm -f "$table" "$bad"' EXIT
for obj in "$@"; do
    report=${obj%.o}.ptxas
    if [ ! -f "$report" ]; then
        echo "cuda_resources: $report is missing (objects are built with nvcc -Xptxas -v)" >>"$bad"
        continue
    fi
    src=$(echo "$obj" | sed 's|^.*/obj/||; s|\.o$|.cu|')
    # Launch bounds from the PTX: ".entry NAME(" ... ".maxntid X, Y, Z".
    strings "$obj" | awk '
        /\.entry [A-Za-z0-9_$]+\(/ { match($0, /\.entry [A-Za-z0-9_$]+/); name = substr($0, RSTART + 7, RLENGTH - 7); bounds[name] = 0 }
        /^\.maxntid / { gsub(/[^0-9,]/, ""); split($0, d, ","); bounds[name] = d[1] * d[2] * d[3] }
        END { for (n in bounds) print "bounds", n, bounds[n] }' >"$table.bounds"
    awk -v src="$src" -v threads="$threads" -v bounds="$table.bounds" '
        BEGIN { while ((getline line < bounds) > 0) { split(line, f, " "); maxntid[f[2]] = f[3]; seen[f[2]] = 1 } }
        /Compiling entry function/ { match($0, /\x27[^\x27]+\x27/); entry = substr($0, RSTART + 1, RLENGTH - 2) }
        /Function properties for/ { fn = $NF }
        /bytes stack frame/ {
            stack[fn] = $1
            if ($5 + 0 > 0 || $9 + 0 > 0) printf "%s: %s spills registers (%s bytes stored, %s loaded)\n", src, fn, $5, $9 > "/dev/stderr"
            if ($5 + 0 > 0 || $9 + 0 > 0) failed = 1
        }
        /Used [0-9]+ registers/ && entry != "" {
            match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15) + 0
            smem = 0
            if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH - 11) + 0
            if (smem > 49152) { printf "%s: %s has %d bytes of static shared memory (at most 49152)\n", src, entry, smem > "/dev/stderr"; failed = 1 }
            if (!(entry in seen)) { printf "%s: %s: no PTX in the object to read its launch bounds from (build with --no-compress)\n", src, entry > "/dev/stderr"; failed = 1 }
            else if (maxntid[entry] == 0) { printf "%s: %s has no launch bounds (__launch_bounds__(TD__THREADS))\n", src, entry > "/dev/stderr"; failed = 1 }
            else if (maxntid[entry] != threads) { printf "%s: %s is bounded to %d threads, but every launch has TD__THREADS = %d\n", src, entry, maxntid[entry], threads > "/dev/stderr"; failed = 1 }
            if (regs * threads > 65536) { printf "%s: %s uses %d registers a thread, more than a block of %d may have\n", src, entry, regs, threads > "/dev/stderr"; failed = 1 }
            print src "\t" entry "\t" regs "\t" smem "\t" stack[entry] + 0
            entry = ""
        }
        END { exit failed }' "$report" >>"$table" 2>>"$bad" || true
    rm -f "$table.bounds"
done
if [ -s "$bad" ]; then
    cat "$bad" >&2
    echo "cuda_resources: the kernels above break the GPU build's resource rules" >&2
    exit 1
fi
rows=$(sort "$table" | while IFS="$(printf '\t')" read -r src entry regs smem stack; do
    name=$(echo "$entry" | c++filt | sed 's/(.*//; s/^void //')
    printf '| `%s` | `%s` | %s | %s | %s |\n' "$src" "$name" "$regs" "$smem" "$stack"
done)
text=$(printf '| file | kernel | registers | static shared bytes | stack bytes |\n|---|---|---|---|---|\n%s\n' "$rows")
echo "$text"
if [ -n "$docs" ]; then
    awk -v text="$text" '
        /<!-- cuda-resources -->/ { print; print text; skip = 1; next }
        /<!-- \/cuda-resources -->/ { skip = 0 }
        !skip { print }' "$docs" >"$docs.tmp" && mv "$docs.tmp" "$docs"
fi
