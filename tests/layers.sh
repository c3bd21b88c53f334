#!/bin/sh
# The library's arrows point one way: each folder of src/ may include only the headers of the
# layers below it (its own included), public (tandem/X.h) or internal (X/...). The engine goes
# core -> device -> tensor -> ops -> graph -> nn (comm, optim and checkpoint may use devices; the
# rendezvous store stands on core alone, and comm uses it);
# the graph's passes walk op tables and never name an op (only src/graph/build.c, the public op
# builders, does, and autocast.c the casts it inserts). Prints one line per violation and a
# closing "P passed, F failed" line like the test programs. Collective ops (all-gather,
# SyncBatchNorm) are graph ops that call comm/ (ARCHITECTURE.md), so ops and graph may use
# process groups, through the public tandem/comm.h only, never comm's internals. oneDNN stays
# inside the CPU backend's files (src/ops/cpu/). Programs (tools, examples, benchmarks) use the public headers
# only.
cd "$(dirname "$0")/.."
# Which layer a public header belongs to.
layer_of_public() {
    case "$1" in
    core | param | trace | args) echo core ;;
    device) echo device ;;
    tensor) echo tensor ;;
    ops) echo ops ;;
    graph) echo graph ;;
    nn) echo nn ;;
    comm | recorder) echo comm ;;
    store) echo store ;;
    doctor) echo doctor ;;
    spawn | launch) echo launch ;;
    data) echo data ;;
    optim) echo optim ;;
    checkpoint) echo checkpoint ;;
    ddp | dp | amp | mesh | pipeline | zero) echo parallel ;;
    *) echo "?$1" ;;
    esac
}
# The layers a folder may use (itself included).
allowed() {
    case "$1" in
    core) echo "core" ;;
    device) echo "core device" ;;
    tensor) echo "core device tensor" ;;
    ops) echo "core device tensor ops comm" ;;
    graph) echo "core device tensor ops graph comm" ;;
    nn) echo "core device tensor ops graph nn" ;;
    store) echo "core store" ;;
    comm) echo "core device store comm" ;;
    optim | checkpoint) echo "core device $1" ;;
    launch) echo "core $1" ;;
    doctor) echo "core device comm checkpoint doctor" ;;
    data) echo "core device data" ;;
    parallel) echo "core device tensor ops graph nn comm optim checkpoint parallel" ;;
    *) echo "" ;;
    esac
}
bad=0
for f in $(find src -name '*.[ch]' | sort); do
    folder=$(echo "$f" | cut -d/ -f2)
    ok=" $(allowed "$folder") "
    for inc in $(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f"); do
        case "$inc" in
        tandem/*) l=$(layer_of_public "$(basename "$inc" .h)") ;;
        */*) l=${inc%%/*} ;;
        *) continue ;; # a header beside the file
        esac
        case "$folder:$inc" in
        ops:comm/* | graph:comm/*)
            echo "layers: $f includes \"$inc\": the engine uses process groups through tandem/comm.h only"
            bad=$((bad + 1))
            continue
            ;;
        esac
        case "$ok" in
        *" $l "*) ;;
        *)
            echo "layers: $f includes \"$inc\" ($l), above or beside $folder"
            bad=$((bad + 1))
            ;;
        esac
    done
done
for f in src/graph/*.c; do
    [ "$f" = src/graph/build.c ] && continue
    # Mixed precision inserts casts (autocast.c), and only casts.
    cast=
    [ "$f" = src/graph/autocast.c ] && cast='\|td__op_cast\b'
    if grep -n 'td__op_[a-z]' "$f" | grep -v "td__op_ctx\\|td__op_attr\\|td__op_alloc$cast" >/dev/null; then
        echo "layers: $f names a particular op (only build.c may, and autocast.c its casts):"
        grep -n 'td__op_[a-z]' "$f" | grep -v "td__op_ctx\\|td__op_attr\\|td__op_alloc$cast" | sed 's/^/    /'
        bad=$((bad + 1))
    fi
done
# oneDNN is the CPU backend's business (src/ops/cpu/): the tensor, the op contract, the ops'
# definitions, the other backends and everything above the ops name no oneDNN header or type.
for f in $(find src -name '*.[ch]' | sort); do
    case "$f" in
    src/ops/cpu/*) continue ;;
    esac
    if grep -n '<dnnl\|dnnl_\|ops/cpu/onednn.h' "$f" >/dev/null; then
        echo "layers: $f names oneDNN (only the CPU backend's files, src/ops/cpu/, may):"
        grep -n '<dnnl\|dnnl_\|ops/cpu/onednn.h' "$f" | sed 's/^/    /'
        bad=$((bad + 1))
    fi
done
# Whether a process lives is asked in one place (src/core/proc.c: td__proc_state, td__pid_dead);
# strategies pass on what their process group reports instead of probing peers themselves.
for f in $(find src -name '*.[ch]' | sort); do
    [ "$f" = src/core/proc.c ] && continue
    probes=$(grep -nE 'kill\([^;]*, *0\)|/proc/%d/stat' "$f" | grep -vE '^[0-9]+: *(\*|/\*|//)')
    if [ -n "$probes" ]; then
        echo "layers: $f probes a process itself (src/core/proc.c does):"
        echo "$probes" | sed 's/^/    /'
        bad=$((bad + 1))
    fi
done
# DDP's front reaches a reducer through its table only (src/parallel/reducer.h): a reducer's file
# exports its table and nothing else, so no branch of the front can call one reducer's code.
for f in $(grep -l '^const td__ddp_reducer ' src/parallel/*.c); do
    if grep -nE '^[a-z_][a-z_0-9 *]*[ *][a-z_][a-z_0-9]* *(\(|\[|=|;)' "$f" |
        grep -v ':static \|:typedef \|:const td__ddp_reducer ' >/dev/null; then
        echo "layers: $f, a reducer, exports more than its table:"
        grep -nE '^[a-z_][a-z_0-9 *]*[ *][a-z_][a-z_0-9]* *(\(|\[|=|;)' "$f" |
            grep -v ':static \|:typedef \|:const td__ddp_reducer ' | sed 's/^/    /'
        bad=$((bad + 1))
    fi
done
# Device types are the device layer's table (src/device/library.c, docs/devices.md): the layers
# above name only the CPU and ask a device for its tables, so another type (HIP, Metal) slots in
# beside CUDA without touching them. Only the device layer and CUDA's graph backend name CUDA.
typed=$(grep -rn 'TD_DEVICE_CUDA' src | grep -v '^src/device/\|^src/ops/cuda/')
if [ -n "$typed" ]; then
    echo "layers: TD_DEVICE_CUDA outside src/device and src/ops/cuda (ask the device's tables):"
    echo "$typed" | sed 's/^/    /'
    bad=$((bad + 1))
fi
# Programs (tools/, examples/, bench/) use the library as a user would: its public headers
# (tandem/X.h) and headers beside them, never src/'s internals, nor a td__ name declared by hand.
for f in $(find tools examples bench -name '*.[ch]' | sort); do
    for inc in $(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f"); do
        case "$inc" in
        tandem/*) continue ;;
        */*) ;;
        *) [ -f "$(dirname "$f")/$inc" ] && continue ;;
        esac
        echo "layers: $f includes \"$inc\": programs use the public headers (include/tandem) only"
        bad=$((bad + 1))
    done
    if grep -n 'td__[a-z]' "$f" >/dev/null; then
        echo "layers: $f names the library's internals (td__), which programs may not:"
        grep -n 'td__[a-z]' "$f" | sed 's/^/    /'
        bad=$((bad + 1))
    fi
done
if [ "$bad" -eq 0 ]; then echo "1 passed, 0 failed"; else echo "0 passed, 1 failed"; fi
[ "$bad" -eq 0 ]
