#!/bin/sh
# libtandem.so exports the public API and nothing else (src/libtandem.map): every dynamic
# symbol it defines is a td_ name (one underscore, never the library's internal td__ ones), and
# every td_ function the archive defines and the public headers declare is among them, so a
# program built against the installed shared library finds what the headers promise. Prints one
# line per violation and a closing "P passed, F failed" line like the test programs.
#   sh tests/exports.sh [BUILD]
cd "$(dirname "$0")/.."
build=${1:-build}
so="$build/lib/libtandem.so"
archive="$build/lib/libtandem.a"
bad=0
exported=$(mktemp)
trap 'rm -f "$exported"' EXIT
nm -D --defined-only "$so" | awk '{print $NF}' | sort -u > "$exported"
if [ ! -s "$exported" ]; then
    echo "exports: nm -D lists nothing defined in $so"
    bad=$((bad + 1))
fi
for name in $(grep -v '^td_[A-Za-z0-9]' "$exported"); do
    echo "exports: $so exports $name, which is not public (only td_ names are)"
    bad=$((bad + 1))
done
# The public functions: defined in the archive, declared in include/tandem/ (declaration lines,
# not comments: a name followed by its argument list).
for name in $(nm -g --defined-only "$archive" 2>/dev/null | awk '$2 ~ /^[TDRB]$/ {print $3}' |
    grep '^td_[A-Za-z0-9]' | sort -u); do
    grep -qx "$name" "$exported" || {
        echo "exports: $name is defined in the library but not exported by $so (src/libtandem.map)"
        bad=$((bad + 1))
    }
done
for name in $(grep -hv '^ *\(\*\|/\*\)' include/tandem/*.h | grep -o '\btd_[a-z0-9_]*(' | tr -d '(' |
    sort -u); do
    grep -qx "$name" "$exported" || {
        echo "exports: include/tandem/ declares $name(), which $so does not export"
        bad=$((bad + 1))
    }
done
if [ "$bad" -eq 0 ]; then
    echo "1 passed, 0 failed"
else
    echo "0 passed, 1 failed"
fi
[ "$bad" -eq 0 ]
