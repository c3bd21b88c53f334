#!/bin/sh
# Runs every test program in BUILD/tests, each under a time limit, and adds up their
# closing "P passed, F failed[, S skipped]" lines. A program that crashes, hangs or exits non-zero
# without reporting a failure counts as one failed case. Ends with the suite's total.
build=${1:-build}
limit=${TD_TEST_TIMEOUT:-600}
passed=0
failed=0
skipped=0
logdir="$build/test-logs"
mkdir -p "$logdir"
export PATH="$PWD/$build/bin:$PATH"
export OMP_NUM_THREADS=1
for t in "$build"/tests/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    start=$(date +%s)
    timeout -k 10 "$limit" "$t" > "$logdir/$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$logdir/$name.log" | tail -n 1)
    p=0; f=0; s=0
    if [ -n "$line" ]; then
        p=$(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')
        f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
        case "$line" in *skipped*) s=$(echo "$line" | sed -E 's/.* ([0-9]+) skipped.*/\1/') ;; esac
    fi
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    passed=$((passed + p))
    failed=$((failed + f))
    skipped=$((skipped + s))
    if [ "$f" -eq 0 ] && [ "$s" -gt 0 ]; then
        printf '%-28s %4d passed  %3ds  (%d skipped: %s)\n' "$name" "$p" "$secs" "$s" \
            "$(grep -m1 '^skipped: ' "$logdir/$name.log" | sed 's/^skipped: //')"
    elif [ "$f" -eq 0 ]; then
        printf '%-28s %4d passed  %3ds\n' "$name" "$p" "$secs"
    else
        printf '%-28s %4d passed, %d FAILED (exit %d)  %3ds\n' "$name" "$p" "$f" "$rc" "$secs"
        grep -v '^ok  ' "$logdir/$name.log" | tail -n 40 | sed 's/^/    /'
    fi
done
# A check script of tests/ ends with its own "P passed, F failed" line too; each counts as one.
check_script() {
    name=$1
    shift
    if sh "$@" > "$logdir/$name.log" 2>&1; then
        passed=$((passed + 1))
        printf '%-28s %4d passed\n' "$name" 1
    else
        failed=$((failed + 1))
        printf '%-28s %4d passed, 1 FAILED\n' "$name" 0
        sed 's/^/    /' "$logdir/$name.log" | tail -n 40
    fi
}
check_script layers tests/layers.sh            # the library's layers include one way only
check_script exports tests/exports.sh "$build" # the shared library exports the public API alone
# Every ```c block of the README, and every whole program (a block with main) in docs/, must
# compile and link against the library, so the docs cannot drift from the headers.
libs=$(sed -n 's/^Libs.private: //p' "$build/tandem.pc")
for md in README.md docs/*.md; do
    awk -v dir="$logdir" -v name="$(basename "$md" .md)" \
        '/^```c$/ {n++; f=sprintf("%s/snippet_%s_%d.c", dir, name, n); on=1; next}
        /^```/ {on=0} on {print > f}' "$md"
done
for snippet in "$logdir"/snippet_*.c; do
    [ -f "$snippet" ] || continue
    case $snippet in */snippet_README_*) ;; *) grep -q '^int main' "$snippet" || continue ;; esac
    if ${CC:-cc} -std=c11 -Wall -Wextra -Werror -Iinclude ${TD_LDFLAGS:-} "$snippet" -o "${snippet%.c}" \
        "$build/lib/libtandem.a" $libs > "${snippet%.c}.log" 2>&1; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        echo "doc snippet $(basename "$snippet") does not compile:"
        sed 's/^/    /' "${snippet%.c}.log" | head -n 20
    fi
done
# The installed library serves an outside program through pkg-config, as the README says: linked
# against the shared library and against the archive, each program runs as built (no
# LD_LIBRARY_PATH, no ldconfig) and needs libtandem.so at run time or not. pkg-config --static
# only adds Libs.private; -ltandem would still pick the shared library installed beside the
# archive (and the second build would repeat the first), so that build names the archive.
prefix=$(mktemp -d)
ok=0
if [ -f "$logdir/snippet_README_1.c" ] &&
    make -s BUILD="$build" PREFIX="$prefix" install > "$logdir/install.log" 2>&1; then
    ok=1
    for mode in shared static; do
        if [ "$mode" = shared ]; then
            flags=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs tandem)
        else
            flags=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --static --cflags --libs \
                tandem | sed 's/-ltandem\( \|$\)/-l:libtandem.a\1/')
        fi
        if ! { ${CC:-cc} -std=c11 ${TD_LDFLAGS:-} "$logdir/snippet_README_1.c" -o "$logdir/installed" \
            $flags && env -u LD_LIBRARY_PATH "$logdir/installed"; } >> "$logdir/install.log" 2>&1; then
            echo "$mode: the program does not build or run as built" >> "$logdir/install.log"
            ok=0
        fi
        needs=$(readelf -d "$logdir/installed" 2>/dev/null | grep -c 'NEEDED.*libtandem\.so')
        want=1
        [ "$mode" = static ] && want=0
        if [ "$needs" -ne "$want" ]; then
            echo "$mode: libtandem.so is needed $needs time(s), expected $want" >> "$logdir/install.log"
            ok=0
        fi
    done
fi
if [ "$ok" -eq 1 ]; then
    passed=$((passed + 1))
else
    failed=$((failed + 1))
    echo "make install + pkg-config + the README's first snippet failed:"
    tail -n 20 "$logdir/install.log" | sed 's/^/    /'
fi
rm -rf "$prefix" "$logdir/installed"
rm -f "$logdir"/snippet_*
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
