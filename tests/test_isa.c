/* The library's own vector paths (core/cpu.c): chosen at run time from what the CPU has,
 * capped by TANDEM_MAX_CPU_ISA, and the same bits at every level (the collectives' reductions
 * for every dtype and op, the bf16/f16 conversions; a NaN's payload aside, where two meet; a
 * linear layer's gradients summed over deterministic mode's shards); and the
 * shared library carries instructions beyond plain x86-64 only in the functions compiled for them,
 * so that it loads and runs on any x86-64 CPU. Each level runs in a fresh process of this program,
 * since the level is decided once per process. */
#include <stdint.h>
#include <sys/wait.h>

#include "comm/comm_impl.h"
#include "core/core_impl.h"
#include "ops/cpu/linear_shards.h"
#include "test.h"

#define N_ELEMS (16 * 37 + 11) /* whole 16-element blocks and a tail */
#define MAX_SRC 5

static const char *const level_names[] = {"sse2", "avx2", "avx512"};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t next_u64(void) {
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}

/* Floats that exercise every rounding rule: ordinary values of both signs, values halfway
 * between two bf16 or f16 neighbours, subnormals, infinities, quiet and signalling NaNs. */
static float some_float(size_t i) {
    static const uint32_t special[] = {0x7fc00000u, 0x7fa00001u, 0xffc12345u, 0x7f800000u,
                                       0xff800000u, 0x00000001u, 0x80400000u, 0x3f808000u,
                                       0x3f818000u, 0x477ff000u, 0x38800000u, 0x33800000u};
    uint64_t r = next_u64();
    if (i % 29 == 7) return td__bits_f32(special[r % (sizeof special / sizeof *special)]);
    return (float)((double)(int64_t)(r >> 11) / (double)(1ull << 50)) * ((r & 3) ? 1.0f : 300.0f);
}

/* One source of n elements of dtype; the half-width ones also hold their own NaNs (signalling
 * ones too), infinities and subnormals. */
static void fill(void *p, td_dtype dt, size_t n) {
    static const uint16_t f16_special[] = {0x7d00, 0xfc01, 0x7e00, 0x0001, 0x83ff, 0x7c00, 0xfbff};
    static const uint16_t bf16_special[] = {0x7f81, 0xff81, 0x7fc0, 0x0001, 0x807f, 0x7f80, 0xff7f};
    for (size_t i = 0; i < n; i++) {
        if ((dt == TD_F16 || dt == TD_BF16) && i % 31 == 5) {
            const uint16_t *sp = dt == TD_F16 ? f16_special : bf16_special;
            ((uint16_t *)p)[i] = sp[next_u64() % 7];
            continue;
        }
        switch (dt) {
        case TD_F32:
            ((float *)p)[i] = some_float(i);
            break;
        case TD_F64:
            ((double *)p)[i] = (double)some_float(i) * (1.0 + 1e-9 * (double)i);
            break;
        case TD_BF16:
            ((uint16_t *)p)[i] = td_f32_to_bf16(some_float(i));
            break;
        case TD_F16:
            ((uint16_t *)p)[i] = td_f32_to_f16(some_float(i) * 1e-2f);
            break;
        case TD_I32:
            ((int32_t *)p)[i] = (int32_t)next_u64();
            break;
        case TD_I64:
            ((int64_t *)p)[i] = (int64_t)next_u64();
            break;
        default:
            ((uint8_t *)p)[i] = (uint8_t)next_u64();
            break;
        }
    }
}

static void print_digest(FILE *out, const char *what, const void *p, size_t bytes) {
    uint8_t d[32];
    td_sha256(p, bytes, d);
    fprintf(out, "%s ", what);
    for (int i = 0; i < 32; i++) fprintf(out, "%02x", d[i]);
    fputc('\n', out);
}

/* Every NaN of a float result as one quiet NaN. Where two NaNs meet in a sum or product, which
 * one's payload the result carries is the compiler's choice of operand order (x86's addps and
 * vaddps keep different operands' payloads): the one difference the levels are allowed. */
static void same_nans(void *p, td_dtype dt, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (dt == TD_F32 && isnan(((float *)p)[i])) ((float *)p)[i] = NAN;
        if (dt == TD_F64 && isnan(((double *)p)[i])) ((double *)p)[i] = NAN;
        if ((dt == TD_BF16 || dt == TD_F16) && isnan(td__load(p, dt, i))) td__store(p, dt, i, NAN);
    }
}

/* The child: the level it runs at, then one line per reduction and conversion with the digest
 * of its result. The inputs are the same in every child (a fixed seed). */
static int compute(const char *path) {
    FILE *out = fopen(path, "w");
    if (!out) return 2;
    fprintf(out, "isa %s\n", level_names[td__cpu_isa()]);
    static const char *const op_names[] = {"sum", "prod", "min", "max", "avg"};
    static unsigned char src[MAX_SRC][N_ELEMS * 8], dst[N_ELEMS * 8];
    for (int dt = 0; dt < TD_DTYPE_COUNT; dt++)
        for (int op = 0; op < TD_OP_COUNT; op++)
            for (int nsrc = 1; nsrc <= MAX_SRC; nsrc++) {
                const void *srcs[MAX_SRC];
                for (int j = 0; j < nsrc; j++) {
                    fill(src[j], (td_dtype)dt, N_ELEMS);
                    srcs[j] = src[j];
                }
                td__reduce(dst, srcs, nsrc, N_ELEMS, (td_dtype)dt, (td_reduce_op)op, nsrc);
                same_nans(dst, (td_dtype)dt, N_ELEMS);
                char what[64];
                snprintf(what, sizeof what, "reduce %s %s x%d", td_dtype_name((td_dtype)dt),
                         op_names[op], nsrc);
                print_digest(out, what, dst, N_ELEMS * td_dtype_size((td_dtype)dt));
            }
    static const td_dtype halves[] = {TD_BF16, TD_F16};
    for (int h = 0; h < 2; h++) {
        fill(src[0], TD_F32, N_ELEMS);
        td__convert(dst, halves[h], src[0], TD_F32, N_ELEMS);
        char what[64];
        snprintf(what, sizeof what, "convert f32 to %s", td_dtype_name(halves[h]));
        print_digest(out, what, dst, N_ELEMS * 2);
        fill(src[1], halves[h], N_ELEMS);
        td__convert(dst, TD_F32, src[1], halves[h], N_ELEMS);
        snprintf(what, sizeof what, "convert %s to f32", td_dtype_name(halves[h]));
        print_digest(out, what, dst, N_ELEMS * 4);
    }
    /* A linear layer's weight and bias gradients over 3 shards of 5 samples, 150 inputs (two
     * column blocks and a part) and 11 outputs (two tiles of rows and a part). */
    enum { SHARDS = 3, SN = 5, SIN = 150, SOUT = 11 };
    size_t each = td__linear_shard_floats(SN, SIN, SOUT);
    static float x[SN * SIN], dy[SN * SOUT], dw[SOUT * SIN], db[SOUT];
    float *packed = aligned_alloc(64, SHARDS * each * sizeof(float));
    const float *shard[SHARDS];
    for (int sh = 0; sh < SHARDS && packed; sh++) {
        fill(x, TD_F32, SN * SIN);
        fill(dy, TD_F32, SN * SOUT);
        td__linear_shard_pack(packed + sh * each, x, dy, SN, SIN, SOUT);
        shard[sh] = packed + sh * each;
    }
    if (!packed || td__linear_shard_grads(dw, db, shard, SHARDS, SN, SIN, SOUT, 0.125f, 0.125f) != 0)
        return 2;
    same_nans(dw, TD_F32, SIN * SOUT);
    same_nans(db, TD_F32, SOUT);
    print_digest(out, "sharded linear weight gradient", dw, SIN * SOUT * sizeof(float));
    print_digest(out, "sharded linear bias gradient", db, SOUT * sizeof(float));
    free(packed);
    return fclose(out) == 0 ? 0 : 2;
}

/* Runs this program's compute mode with TANDEM_MAX_CPU_ISA = cap (NULL: unset) and reads its
 * lines into out (cap_out bytes); returns 0 when it ran. */
static int run_child(const char *cap, char *out, size_t cap_out) {
    char path[] = "/tmp/td_test_isa_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return -1;
    close(fd);
    pid_t pid = fork();
    if (pid == 0) {
        if (cap)
            setenv("TANDEM_MAX_CPU_ISA", cap, 1);
        else
            unsetenv("TANDEM_MAX_CPU_ISA");
        execl("/proc/self/exe", "test_isa", "--compute", path, (char *)NULL);
        _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(out, 1, cap_out - 1, f) : 0;
    if (f) fclose(f);
    out[n] = '\0';
    unlink(path);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 && n > 0 ? 0 : -1;
}

/* What this CPU offers, read from the kernel's /proc/cpuinfo flags (cpu.c asks the CPU itself):
 * AVX2 with FMA and F16C, and AVX-512 F, BW, VL and DQ beyond that. */
static int cpu_level(void) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[8192];
    int level = TD__ISA_SSE2;
    while (f && fgets(line, sizeof line, f)) {
        if (strncmp(line, "flags", 5) != 0) continue;
        static const char *const avx2[] = {" avx2", " fma", " f16c"};
        static const char *const avx512[] = {" avx512f", " avx512bw", " avx512vl", " avx512dq"};
        int has2 = 1, has512 = 1;
        line[strcspn(line, "\n")] = ' ';
        for (int i = 0; i < 3; i++) {
            char word[32];
            snprintf(word, sizeof word, "%s ", avx2[i]);
            has2 &= strstr(line, word) != NULL;
        }
        for (int i = 0; i < 4; i++) {
            char word[32];
            snprintf(word, sizeof word, "%s ", avx512[i]);
            has512 &= strstr(line, word) != NULL;
        }
        level = has2 && has512 ? TD__ISA_AVX512 : has2 ? TD__ISA_AVX2 : TD__ISA_SSE2;
        break;
    }
    if (f) fclose(f);
    return level;
}

#define OUT_BYTES (1 << 16)

/* Every level the cap can ask for runs at min(cap, CPU) and computes the same bits. */
static void levels_same_bits(void) {
    static char base[OUT_BYTES], got[OUT_BYTES];
    static const char *const caps[] = {"sse2", "avx2", "AVX512", NULL};
    int have = cpu_level();
    CHECK(run_child("sse2", base, sizeof base) == 0);
    for (int c = 0; c < 4; c++) {
        if (run_child(caps[c], got, sizeof got) != 0) {
            TEST_FAIL_AT("TANDEM_MAX_CPU_ISA=%s: the child failed", caps[c] ? caps[c] : "(unset)");
            continue;
        }
        int want = c < 3 && c < have ? c : have;
        char line[32];
        snprintf(line, sizeof line, "isa %s\n", level_names[want]);
        if (strncmp(got, line, strlen(line)) != 0)
            TEST_FAIL_AT("TANDEM_MAX_CPU_ISA=%s on a CPU with %s: ran at '%.*s', expected %s",
                         caps[c] ? caps[c] : "(unset)", level_names[have], (int)strcspn(got, "\n"),
                         got, level_names[want]);
        /* Past the first line every level must print the same digests. */
        const char *a = strchr(base, '\n'), *b = strchr(got, '\n');
        if (!a || !b) continue;
        while (*a && *a == *b) a++, b++;
        if (*a || *b) {
            const char *start = b;
            while (start > got && start[-1] != '\n') start--;
            TEST_FAIL_AT("TANDEM_MAX_CPU_ISA=%s: '%.*s' differs from sse2's",
                         caps[c] ? caps[c] : "(unset)", (int)strcspn(start, "\n"), start);
        }
    }
    if (!test_case_failed)
        printf("    this CPU: %s; sse2, avx2 and %s give the same bits\n", level_names[have],
               level_names[have]);
    if (have < TD__ISA_AVX512)
        printf("    (the avx512 paths were not run: this CPU has no AVX-512)\n");
}

/* A cap the library does not know turns the vector paths off rather than on. */
static void unknown_cap_is_sse2(void) {
    static char got[OUT_BYTES];
    CHECK(run_child("avx1024", got, sizeof got) == 0);
    CHECK(strncmp(got, "isa sse2\n", 9) == 0);
}

/* Whether an objdump line's instruction needs more than x86-64's baseline: a VEX or EVEX
 * encoded one (its mnemonic starts with v) or one on ymm, zmm or mask registers. */
static int beyond_baseline(const char *line) {
    const char *tab = strchr(line, '\t'); /* "  addr:\tinstruction" */
    if (!tab) return 0;
    const char *ins = tab + 1;
    if (ins[0] == 'v' && strncmp(ins, "verr", 4) != 0 && strncmp(ins, "verw", 4) != 0) return 1;
    return strstr(ins, "%ymm") || strstr(ins, "%zmm") || strstr(ins, "%k");
}

/* A function compiled for a richer set says so by its name: *_avx2, *_avx512 (GCC's clones
 * keep the name before a dot: f_avx512.part.0, f_avx512.cold). */
static int named_for_isa(const char *fn) {
    char name[256];
    snprintf(name, sizeof name, "%s", fn);
    char *dot = strchr(name, '.');
    if (dot) *dot = '\0';
    size_t n = strlen(name);
    return (n > 5 && strcmp(name + n - 5, "_avx2") == 0) ||
           (n > 7 && strcmp(name + n - 7, "_avx512") == 0);
}

/* The default build's shared library runs on any x86-64: objdump finds AVX, AVX2 or AVX-512
 * instructions only inside the functions compiled for them, which run only after cpu.c chose
 * them. */
static void library_runs_on_any_x86_64(void) {
#if defined(__AVX__)
    SKIP("built with NATIVE=1 (-march=native): the library is this CPU's alone");
    return;
#else
    char lib[4096];
    ssize_t len = readlink("/proc/self/exe", lib, sizeof lib - 64);
    if (len <= 0) {
        TEST_FAIL_AT("cannot read /proc/self/exe");
        return;
    }
    lib[len] = '\0';
    for (int up = 0; up < 2; up++) *strrchr(lib, '/') = '\0';
    strcat(lib, "/lib/libtandem.so");
    if (system("command -v objdump > /dev/null 2>&1") != 0) {
        SKIP("no objdump (Debian's binutils) to read %s with", lib);
        return;
    }
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "objdump -d --no-show-raw-insn '%s'", lib);
    FILE *p = popen(cmd, "r");
    CHECK(p != NULL);
    if (!p) return;
    char line[1024], fn[256] = "", last_counted[256] = "";
    int functions = 0, vector_functions = 0, bad = 0;
    while (fgets(line, sizeof line, p)) {
        char name[256];
        if (sscanf(line, "%*x <%255[^>]>:", name) == 1) {
            snprintf(fn, sizeof fn, "%s", name);
            functions++;
            continue;
        }
        if (!beyond_baseline(line)) continue;
        if (named_for_isa(fn)) {
            if (strcmp(last_counted, fn) != 0) vector_functions++;
            snprintf(last_counted, sizeof last_counted, "%s", fn);
            continue;
        }
        if (bad < 10) TEST_FAIL_AT("%s: %s outside a function compiled for it", fn, line);
        bad++;
    }
    CHECK_EQ(pclose(p), 0);
    CHECK(functions > 1000);
    CHECK(vector_functions > 0);
    printf("    %d functions, %d of them for AVX2 or AVX-512, %d instructions beyond x86-64 "
           "elsewhere\n",
           functions, vector_functions, bad);
#endif
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--compute") == 0) return compute(argv[2]);
    RUN(levels_same_bits);
    RUN(unknown_cap_is_sse2);
    RUN(library_runs_on_any_x86_64);
    TEST_END();
}
