#!/bin/sh
# The library's arrows point one way: each folder of src/ may include only the headers of the
# layers below it (its own included), public (tandem/X.h) or internal (X/...). The engine goes
# core -> tensor -> ops -> graph -> nn; the graph's passes walk op tables and never name an op
# (only src/graph/build.c, the public op builders, does). Prints one line per violation and a
# closing "P passed, F failed" line like the test programs.
cd "$(dirname "$0")/.."
# Which layer a public header belongs to.
layer_of_public() {
    case "$1" in
    core | param | trace) echo core ;;
    tensor) echo tensor ;;
    ops) echo ops ;;
    graph) echo graph ;;
    nn) echo nn ;;
    comm | store) echo comm ;;
    spawn) echo launch ;;
    data) echo data ;;
    optim) echo optim ;;
    checkpoint) echo checkpoint ;;
    ddp | dp | amp | pipeline) echo parallel ;;
    *) echo "?$1" ;;
    esac
}
# The layers a folder may use (itself included).
allowed() {
    case "$1" in
    core) echo "core" ;;
    tensor) echo "core tensor" ;;
    ops) echo "core tensor ops" ;;
    graph) echo "core tensor ops graph" ;;
    nn) echo "core tensor ops graph nn" ;;
    comm | launch | data | optim | checkpoint) echo "core $1" ;;
    parallel) echo "core tensor ops graph nn comm optim parallel" ;;
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
    if grep -n 'td__op_[a-z]' "$f" | grep -v 'td__op_ctx\|td__op_attr\|td__op_alloc' >/dev/null; then
        echo "layers: $f names a particular op (only build.c may):"
        grep -n 'td__op_[a-z]' "$f" | grep -v 'td__op_ctx\|td__op_attr\|td__op_alloc' | sed 's/^/    /'
        bad=$((bad + 1))
    fi
done
if [ "$bad" -eq 0 ]; then echo "1 passed, 0 failed"; else echo "0 passed, 1 failed"; fi
[ "$bad" -eq 0 ]
