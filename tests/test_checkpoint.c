/* safetensors checkpoints: round trips of every dtype, metadata, files written by Python,
 * strict rejection of damaged headers and data, checked integer metadata, paths that are not
 * files, atomic replacement on a failed save, and the removal of a killed save's temporary. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tandem/checkpoint.h"

#include "test.h"

static char dir[256];

static void path_in_dir(char *out, size_t len, const char *name) {
    snprintf(out, len, "%s/%s", dir, name);
}

/* A safetensors file from a header string and a data blob, header padded to 8 bytes. */
static void write_st(const char *path, const char *header, const void *data, size_t data_len) {
    size_t hl = strlen(header), padded = (hl + 7) / 8 * 8;
    unsigned char *buf = calloc(1, 8 + padded + data_len + 1);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, header, hl);
    memset(buf + 8 + hl, ' ', padded - hl);
    if (data_len) memcpy(buf + 8 + padded, data, data_len);
    test_write_file(path, buf, 8 + padded + data_len);
    free(buf);
}

static int count_files(void) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.') n++;
    if (d) closedir(d);
    return n;
}

static void round_trip_every_dtype_and_metadata(void) {
    float f32[6] = {1.5f, -2.25f, 3.0f, 0.0f, -0.0f, 1e-30f};
    double f64[4] = {3.141592653589793, -1e300, 0.5, 2.0};
    int64_t i64[1] = {-((int64_t)1 << 40)};
    int32_t i32[4] = {1, -2, 2147483647, -2147483647};
    uint16_t bf16[3] = {td_f32_to_bf16(1.0f), td_f32_to_bf16(-3.5f), td_f32_to_bf16(0.15625f)};
    uint16_t f16[3] = {td_f32_to_f16(1.0f), td_f32_to_f16(65504.0f), td_f32_to_f16(-0.5f)};
    uint8_t u8[5] = {0, 1, 127, 128, 255};
    float empty[1];
    td_param t[] = {
        {.name = "layer.weight",
         .data = f32,
         .count = 6,
         .dtype = TD_F32,
         .ndim = 2,
         .shape = {2, 3}},
        {.name = "f64", .data = f64, .count = 4, .dtype = TD_F64, .ndim = 1, .shape = {4}},
        {.name = "scalar", .data = i64, .count = 1, .dtype = TD_I64, .ndim = 0},
        {.name = "i32", .data = i32, .count = 4, .dtype = TD_I32, .ndim = 2, .shape = {2, 2}},
        {.name = "bf16", .data = bf16, .count = 3, .dtype = TD_BF16, .ndim = 1, .shape = {3}},
        {.name = "f16", .data = f16, .count = 3, .dtype = TD_F16, .ndim = 1, .shape = {3}},
        {.name = "u8 \"quoted\" \\ name",
         .data = u8,
         .count = 5,
         .dtype = TD_U8,
         .ndim = 3,
         .shape = {5, 1, 1}},
        {.name = "empty", .data = empty, .count = 0, .dtype = TD_F32, .ndim = 2, .shape = {0, 4}},
    };
    size_t n = sizeof t / sizeof *t;
    td_checkpoint_meta meta[] = {{"epoch", "3"},
                                 {"rng", "seed=42 offset=1000"},
                                 {"odd", "line\nbreak \"q\" \\ tab\t \xc3\xa9"}};
    char path[300];
    path_in_dir(path, sizeof path, "round.safetensors");
    CHECK_OK(td_checkpoint_save(path, t, n, meta, 3));

    /* The layout the spec fixes: u64 LE header size, '{', header padded to 8, data follows. */
    size_t len = 0;
    unsigned char *raw = test_read_file(path, &len);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | raw[i];
    size_t data_bytes = 24 + 32 + 8 + 16 + 6 + 6 + 5;
    CHECK_EQ(hl % 8, 0);
    CHECK_EQ(len, 8 + hl + data_bytes);
    CHECK_EQ(raw[8], '{');
    CHECK(memcmp(raw + 8 + hl, f32, 24) == 0); /* tensors stored in order, raw bytes */
    CHECK(memcmp(raw + len - 5, u8, 5) == 0);
    free(raw);

    td_checkpoint *c = NULL;
    CHECK_OK(td_checkpoint_open(&c, path));
    if (!c) return;
    CHECK_EQ(td_checkpoint_count(c), n);
    td_param info;
    CHECK_OK(td_checkpoint_tensor(c, 6, &info));
    CHECK(strcmp(info.name, t[6].name) == 0);
    CHECK_EQ(info.dtype, TD_U8);
    CHECK_EQ(info.ndim, 3);
    CHECK_EQ(info.shape[0], 5);
    CHECK_OK(td_checkpoint_tensor(c, 2, &info));
    CHECK_EQ(info.ndim, 0);
    CHECK_EQ(info.count, 1);
    CHECK(strcmp(td_checkpoint_get_meta(c, "epoch"), "3") == 0);
    CHECK(strcmp(td_checkpoint_get_meta(c, "rng"), "seed=42 offset=1000") == 0);
    CHECK(strcmp(td_checkpoint_get_meta(c, "odd"), meta[2].value) == 0);
    CHECK(td_checkpoint_get_meta(c, "missing") == NULL);

    float f32b[6];
    double f64b[4];
    int64_t i64b[1];
    int32_t i32b[4];
    uint16_t bf16b[3], f16b[3];
    uint8_t u8b[5];
    void *bufs[] = {f32b, f64b, i64b, i32b, bf16b, f16b, u8b, empty};
    td_param back[8];
    memcpy(back, t, sizeof back);
    for (size_t i = 0; i < n; i++) back[i].data = bufs[i];
    /* Reading a subset in another order works; the file's other tensors are ignored. */
    td_param rev[2] = {back[3], back[0]};
    CHECK_OK(td_checkpoint_read(c, rev, 2));
    CHECK(memcmp(i32b, i32, sizeof i32) == 0);
    CHECK_OK(td_checkpoint_read(c, back, n));
    for (size_t i = 0; i < n; i++)
        CHECK(memcmp(bufs[i], t[i].data, t[i].count * td_dtype_size(t[i].dtype)) == 0);
    td_checkpoint_close(c);
}

static void reads_files_written_by_other_writers(void) {
    /* As Python's safetensors lays a file out, keys in its own order and "format": "pt". */
    const char *h =
        "{\"__metadata__\":{\"format\":\"pt\"},\"b\":{\"dtype\":\"I64\",\"shape\":[1],"
        "\"data_offsets\":[8,16]},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    unsigned char data[16];
    float a[2] = {0.25f, -8.0f};
    int64_t b = 123456789012345LL;
    memcpy(data, a, 8);
    memcpy(data + 8, &b, 8);
    char path[300];
    path_in_dir(path, sizeof path, "other.safetensors");
    write_st(path, h, data, 16);
    float a2[2] = {0};
    int64_t b2 = 0;
    td_param t[2] = {
        {.name = "a", .data = a2, .count = 2, .dtype = TD_F32, .ndim = 1, .shape = {2}},
        {.name = "b", .data = &b2, .count = 1, .dtype = TD_I64, .ndim = 1, .shape = {1}}};
    CHECK_OK(td_checkpoint_load(path, t, 2));
    CHECK(a2[0] == 0.25f && a2[1] == -8.0f);
    CHECK_EQ(b2, b);
    /* The optimizer fixture was written by hand in Python from the spec. */
    td_checkpoint *c = NULL;
    const char *fixture = test_source_path("tests/fixtures/optim/optim_ref.safetensors");
    CHECK_OK(td_checkpoint_open(&c, fixture));
    if (c) {
        CHECK(td_checkpoint_get_meta(c, "generator") &&
              strcmp(td_checkpoint_get_meta(c, "generator"), "make_optim_ref.py") == 0);
        CHECK(td_checkpoint_count(c) > 50);
    }
    td_checkpoint_close(c);
}

/* Opening path must fail with `status` and a message that contains `what`. */
static void expect_open_error(const char *path, td_status status, const char *what) {
    td_checkpoint *c = NULL;
    td_status st = td_checkpoint_open(&c, path);
    CHECK(c == NULL);
    if (st != status || !strstr(td_last_error(), what) || !strstr(td_last_error(), path))
        TEST_FAIL_AT("open -> %s \"%s\", expected %s and \"%s\"", td_status_string(st),
                     td_last_error(), td_status_string(status), what);
    td_checkpoint_close(c);
}

static void damaged_headers_are_errors_naming_the_problem(void) {
    char path[300];
    path_in_dir(path, sizeof path, "bad.safetensors");
    unsigned char data[64] = {0};
    const struct {
        const char *header;
        size_t data_len;
        td_status status;
        const char *what;
    } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},}", 8, TD_EFORMAT,
         "not valid JSON: byte"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, TD_EFORMAT,
         "not valid JSON"},
        {"{\"a\":{\"dtype\":\"F32,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, TD_EFORMAT,
         "not valid JSON"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}} x", 8, TD_EFORMAT,
         "trailing"},
        {"[1]", 0, TD_EFORMAT, "start with '{'"},
        {"{\"a\":{\"dtype\":\"F8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2, TD_EDTYPE,
         "tensor a: dtype \"F8\""},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}", 20, TD_EFORMAT,
         "tensor w: shape needs 24 bytes of F32 but data_offsets span 20"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, TD_EFORMAT, "overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
         20, TD_EFORMAT, "belong to no tensor"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, TD_EFORMAT,
         "cover 8 data bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, TD_EFORMAT,
         "tensor a: data_offsets [0, 16] beyond"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 8, TD_EFORMAT,
         "end before"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, TD_EFORMAT,
         "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 8, TD_EFORMAT,
         "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, TD_EFORMAT,
         "data_offsets must be"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8, TD_EFORMAT,
         "unknown field \"x\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
         8, TD_EFORMAT, "duplicate key \"a\""},
        {"{\"__metadata__\":{\"epoch\":3}}", 0, TD_EFORMAT, "value of \"epoch\" is not a string"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,99999999999999999999]}}", 8,
         TD_EFORMAT, "data_offsets must be"},
        {"{\"a\":\"\\x\"}", 0, TD_EFORMAT, "bad escape"},
        {"{\"a\":\"tab\there\"}", 0, TD_EFORMAT, "control character"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_st(path, cases[i].header, data, cases[i].data_len);
        expect_open_error(path, cases[i].status, cases[i].what);
    }
    /* Nesting far deeper than any header needs is refused, not a stack overflow. */
    char deep[2100] = "{\"a\":";
    for (int i = 0; i < 1000; i++) strcat(deep, "[");
    for (int i = 0; i < 1000; i++) strcat(deep, "]");
    strcat(deep, "}");
    write_st(path, deep, data, 0);
    expect_open_error(path, TD_EFORMAT, "nesting deeper");
    /* Header length fields that do not fit the file. */
    unsigned char raw[32] = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    test_write_file(path, raw, 16);
    expect_open_error(path, TD_EFORMAT, "header length 200");
    test_write_file(path, raw, 5);
    expect_open_error(path, TD_EFORMAT, "too short");
    memset(raw, 0xff, 8);
    test_write_file(path, raw, 32);
    expect_open_error(path, TD_EFORMAT, "header length");
    path_in_dir(path, sizeof path, "missing.safetensors");
    expect_open_error(path, TD_ENOTFOUND, "cannot open");
}

/* The last error holds only printable ASCII and contains `escaped`: bytes from a damaged file
 * (terminal escapes, bytes that are not UTF-8) appear as JSON escapes, never as they are. */
static void expect_escaped(const char *escaped) {
    const char *e = td_last_error();
    for (const unsigned char *p = (const unsigned char *)e; *p; p++)
        if (*p < 0x20 || *p >= 0x7f) {
            TEST_FAIL_AT("byte 0x%02x copied into \"%s\"", *p, e);
            return;
        }
    if (!strstr(e, escaped)) TEST_FAIL_AT("\"%s\" lacks %s", e, escaped);
}

static void damaged_bytes_are_escaped_in_messages(void) {
    char path[300];
    path_in_dir(path, sizeof path, "raw.safetensors");
    unsigned char data[8] = {0};
    const struct {
        const char *header;
        const char *escaped;
    } cases[] = {
        /* a name decoded from \u001b: an ANSI colour sequence */
        {"{\"a\\u001b[31m\":{\"dtype\":\"F8\",\"shape\":[2],\"data_offsets\":[0,2]}}",
         "tensor a\\u001b[31m: dtype"},
        {"{\"a\":{\"dtype\":\"F\\u00078\",\"shape\":[2],\"data_offsets\":[0,2]}}",
         "dtype \"F\\u00078\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"\\r\":1}}",
         "unknown field \"\\u000d\""},
        {"{\"a\":\xff}", "unexpected character '\\u00ff'"},
        {"{\"a\":\"\\\xfe\"}", "'\\u00fe'"},
        {"{\"\\u0007\":1,\"\\u0007\":2}", "duplicate key \"\\u0007\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_st(path, cases[i].header, data, 8);
        td_checkpoint *c = NULL;
        CHECK(td_checkpoint_open(&c, path) != TD_OK);
        expect_escaped(cases[i].escaped);
    }
    /* A metadata value with a byte that is not UTF-8, as a damaged file has it. */
    write_st(path,
             "{\"__metadata__\":{\"epoch\":\"3\xff\"},"
             "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
             data, 8);
    td_checkpoint *c = NULL;
    CHECK_OK(td_checkpoint_open(&c, path));
    int64_t v;
    CHECK_STATUS(td_checkpoint_get_meta_i64(c, "epoch", 0, 10, &v), TD_EFORMAT);
    expect_escaped("\"3\\u00ff\", not a decimal integer");
    td_checkpoint_close(c);
    /* What a file cannot hold is refused when saving, not changed. */
    float w[2] = {1, 2};
    td_param t = {.name = "w\xff", .data = w, .count = 2, .dtype = TD_F32, .ndim = 1, .shape = {2}};
    CHECK_STATUS(td_checkpoint_save(path, &t, 1, NULL, 0), TD_EINVAL);
    expect_escaped("tensor name \"w\\u00ff\" is not UTF-8 text");
    t.name = "w";
    td_checkpoint_meta meta[1] = {{"epoch", "3\xfe"}};
    CHECK_STATUS(td_checkpoint_save(path, &t, 1, meta, 1), TD_EINVAL);
    expect_escaped("metadata entry 0 (\"epoch\") is not UTF-8 text");
}

static void every_truncation_and_byte_flip_fails_cleanly(void) {
    float w[6] = {1, 2, 3, 4, 5, 6};
    int64_t s[2] = {7, 8};
    td_param t[2] = {
        {.name = "w", .data = w, .count = 6, .dtype = TD_F32, .ndim = 2, .shape = {3, 2}},
        {.name = "s", .data = s, .count = 2, .dtype = TD_I64, .ndim = 1, .shape = {2}}};
    td_checkpoint_meta meta[1] = {{"step", "10"}};
    char good[300], bad[300];
    path_in_dir(good, sizeof good, "good.safetensors");
    path_in_dir(bad, sizeof bad, "cut.safetensors");
    CHECK_OK(td_checkpoint_save(good, t, 2, meta, 1));
    size_t len = 0;
    unsigned char *raw = test_read_file(good, &len);
    for (size_t cut = 0; cut < len; cut++) {
        test_write_file(bad, raw, cut);
        td_checkpoint *c = NULL;
        td_status st = td_checkpoint_open(&c, bad);
        if (st == TD_OK)
            TEST_FAIL_AT("a file cut to %zu of %zu bytes opened", cut, len);
        else
            CHECK(strstr(td_last_error(), bad) != NULL);
        td_checkpoint_close(c);
    }
    /* Flipped header bytes: the file either still parses to something consistent or is an
     * error; the sanitizers check that neither path touches memory it should not. */
    td_rng rng;
    td_rng_init(&rng, 5);
    int rejected = 0;
    for (int trial = 0; trial < 400; trial++) {
        size_t at = 8 + td_rng_below(&rng, (uint32_t)(len - 8 - 64));
        unsigned char old = raw[at];
        raw[at] = (unsigned char)td_rng_u32(&rng);
        test_write_file(bad, raw, len);
        raw[at] = old;
        td_checkpoint *c = NULL;
        if (td_checkpoint_open(&c, bad) != TD_OK) rejected++;
        td_checkpoint_close(c);
    }
    CHECK(rejected > 200);
    free(raw);
}

static void load_checks_names_dtypes_and_shapes(void) {
    float w[6] = {1, 2, 3, 4, 5, 6};
    td_param t[1] = {{.name = "conv.weight",
                      .data = w,
                      .count = 6,
                      .dtype = TD_F32,
                      .ndim = 2,
                      .shape = {2, 3}}};
    char path[300];
    path_in_dir(path, sizeof path, "shapes.safetensors");
    CHECK_OK(td_checkpoint_save(path, t, 1, NULL, 0));
    float into[6] = {9, 9, 9, 9, 9, 9};
    td_param want = {.name = "conv.weight",
                     .data = into,
                     .count = 6,
                     .dtype = TD_F32,
                     .ndim = 2,
                     .shape = {3, 2}};
    CHECK_STATUS(td_checkpoint_load(path, &want, 1), TD_ESHAPE);
    CHECK(strstr(td_last_error(), "conv.weight: expected shape (3, 2), file has (2, 3)") != NULL);
    want.shape[0] = 2;
    want.shape[1] = 3;
    want.dtype = TD_BF16;
    CHECK_STATUS(td_checkpoint_load(path, &want, 1), TD_EDTYPE);
    CHECK(strstr(td_last_error(), "conv.weight: expected dtype BF16, file has F32") != NULL);
    want.dtype = TD_F32;
    td_param two[2] = {want, want};
    two[1].name = "conv.bias";
    CHECK_STATUS(td_checkpoint_load(path, two, 2), TD_ENOTFOUND);
    CHECK(strstr(td_last_error(), "conv.bias is not in the file") != NULL);
    CHECK_EQ(into[0], 9); /* nothing is written until every tensor checks out */
    CHECK_OK(td_checkpoint_load(path, &want, 1));
    CHECK_EQ(into[5], 6);
}

static void failed_save_keeps_the_previous_checkpoint(void) {
    char path[300];
    path_in_dir(path, sizeof path, "atomic.safetensors");
    int before = count_files();
    float small[4] = {1, 2, 3, 4};
    td_param good = {
        .name = "w", .data = small, .count = 4, .dtype = TD_F32, .ndim = 1, .shape = {4}};
    td_checkpoint_meta meta[1] = {{"step", "1"}};
    CHECK_OK(td_checkpoint_save(path, &good, 1, meta, 1));
    CHECK_EQ(count_files(), before + 1);

    /* A write that fails half way: the file size limit stops it after 64 KiB of 4 MiB. */
    size_t big_n = 1 << 20;
    float *big = calloc(big_n, sizeof(float));
    td_param huge = {.name = "w",
                     .data = big,
                     .count = big_n,
                     .dtype = TD_F32,
                     .ndim = 1,
                     .shape = {(int64_t)big_n}};
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = 64 << 10;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    td_checkpoint_meta meta2[1] = {{"step", "2"}};
    td_status st = td_checkpoint_save(path, &huge, 1, meta2, 1);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    CHECK_EQ(st, TD_EIO);
    CHECK(strstr(td_last_error(), path) && strstr(td_last_error(), "unchanged"));
    free(big);

    /* Bad arguments fail before any file is made. */
    td_param dup[2] = {good, good};
    CHECK_STATUS(td_checkpoint_save(path, dup, 2, NULL, 0), TD_EINVAL);
    CHECK(strstr(td_last_error(), "w appears twice") != NULL);
    td_param wrong = good;
    wrong.count = 5;
    CHECK_STATUS(td_checkpoint_save(path, &wrong, 1, NULL, 0), TD_ESHAPE);
    char nodir[300];
    path_in_dir(nodir, sizeof nodir, "no/such/dir/x.safetensors");
    CHECK_STATUS(td_checkpoint_save(nodir, &good, 1, NULL, 0), TD_EIO);
    CHECK(strstr(td_last_error(), nodir) != NULL);

    CHECK_EQ(count_files(), before + 1); /* no temporary file left behind */
    float back[4] = {0};
    td_param r = good;
    r.data = back;
    td_checkpoint *c = NULL;
    CHECK_OK(td_checkpoint_open(&c, path));
    if (c) {
        CHECK(strcmp(td_checkpoint_get_meta(c, "step"), "1") == 0);
        CHECK_OK(td_checkpoint_read(c, &r, 1));
        CHECK(memcmp(back, small, sizeof small) == 0);
    }
    td_checkpoint_close(c);
    /* A successful save then replaces it. */
    small[0] = 42;
    CHECK_OK(td_checkpoint_save(path, &good, 1, meta2, 1));
    CHECK_OK(td_checkpoint_load(path, &r, 1));
    CHECK_EQ(back[0], 42);
    CHECK_EQ(count_files(), before + 1);
}

/* Saves a one-tensor checkpoint whose only metadata is {key: value} and opens it. */
static td_checkpoint *with_meta(const char *path, const char *key, const char *value) {
    float w[2] = {1, 2};
    td_param t = {.name = "w", .data = w, .count = 2, .dtype = TD_F32, .ndim = 1, .shape = {2}};
    td_checkpoint_meta meta[1] = {{key, value}};
    td_checkpoint *c = NULL;
    CHECK_OK(td_checkpoint_save(path, &t, 1, meta, 1));
    CHECK_OK(td_checkpoint_open(&c, path));
    return c;
}

/* The last error must name the file, the key, the value as written and the range. */
static void expect_meta_error(const char *path, const char *key, const char *value,
                              const char *range) {
    const char *e = td_last_error();
    char quoted_key[64], quoted_value[96];
    snprintf(quoted_key, sizeof quoted_key, "\"%s\"", key);
    snprintf(quoted_value, sizeof quoted_value, "\"%s\"", value);
    if (!strstr(e, path) || !strstr(e, quoted_key) || !strstr(e, quoted_value) || !strstr(e, range))
        TEST_FAIL_AT("\"%s\": \"%s\" does not name the file, key, value and %s", value, e, range);
}

static void integer_metadata_must_parse_fully_and_be_in_range(void) {
    char path[300];
    path_in_dir(path, sizeof path, "meta.safetensors");
    /* The cases (what atoi read as -3, 0, 12 and 0, and strtoull saturated), then
     * near misses: blanks, a '+', hex, an exponent, decimals, a bare sign, one past max. */
    const char *bad[] = {
        "-3",  "abc", "12abc", "",    "99999999999999999999999", //
        " 5",  "+5",  "5 ",    "0x5", "1e3",
        "1.0", "-",   "--1",   "11",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        td_checkpoint *c = with_meta(path, "epoch", bad[i]);
        if (!c) continue;
        int64_t v = 77;
        CHECK_STATUS(td_checkpoint_get_meta_i64(c, "epoch", 0, 10, &v), TD_EFORMAT);
        expect_meta_error(path, "epoch", bad[i], "[0, 10]");
        CHECK_EQ(v, 77); /* untouched on failure */
        uint64_t u = 77;
        CHECK_STATUS(td_checkpoint_get_meta_u64(c, "epoch", 0, 10, &u), TD_EFORMAT);
        expect_meta_error(path, "epoch", bad[i], "[0, 10]");
        CHECK_EQ(u, 77);
        td_checkpoint_close(c);
    }

    /* Valid values, the bounds inclusive. */
    td_checkpoint *c = with_meta(path, "epoch", "3");
    int64_t v = -1;
    uint64_t u = 0;
    if (c) {
        CHECK_OK(td_checkpoint_get_meta_i64(c, "epoch", 0, 10, &v));
        CHECK_EQ(v, 3);
        CHECK_OK(td_checkpoint_get_meta_i64(c, "epoch", 3, 3, &v));
        CHECK_OK(td_checkpoint_get_meta_u64(c, "epoch", 0, 3, &u));
        CHECK_EQ(u, 3);
        CHECK_STATUS(td_checkpoint_get_meta_i64(c, "epoch", 0, 2, &v), TD_EFORMAT);
        expect_meta_error(path, "epoch", "3", "[0, 2]");
        CHECK_STATUS(td_checkpoint_get_meta_u64(c, "epoch", 4, 9, &u), TD_EFORMAT);
        expect_meta_error(path, "epoch", "3", "[4, 9]");
        /* A missing key is not found, by name. */
        CHECK_STATUS(td_checkpoint_get_meta_i64(c, "step", 0, 10, &v), TD_ENOTFOUND);
        CHECK(strstr(td_last_error(), "\"step\"") && strstr(td_last_error(), path));
        CHECK_STATUS(td_checkpoint_get_meta_u64(c, "step", 0, 10, &u), TD_ENOTFOUND);
        CHECK_STATUS(td_checkpoint_get_meta_i64(c, "epoch", 5, 4, &v), TD_EINVAL);
        td_checkpoint_close(c);
    }
    /* The ends of both types; a sign is for signed values only. */
    c = with_meta(path, "offset", "-9223372036854775808");
    if (c) {
        CHECK_OK(td_checkpoint_get_meta_i64(c, "offset", INT64_MIN, INT64_MAX, &v));
        CHECK(v == INT64_MIN);
        CHECK_STATUS(td_checkpoint_get_meta_u64(c, "offset", 0, UINT64_MAX, &u), TD_EFORMAT);
        td_checkpoint_close(c);
    }
    c = with_meta(path, "offset", "9223372036854775808");
    if (c) {
        CHECK_STATUS(td_checkpoint_get_meta_i64(c, "offset", INT64_MIN, INT64_MAX, &v), TD_EFORMAT);
        CHECK_OK(td_checkpoint_get_meta_u64(c, "offset", 0, UINT64_MAX, &u));
        CHECK(u == (uint64_t)INT64_MAX + 1);
        td_checkpoint_close(c);
    }
    c = with_meta(path, "seed", "18446744073709551615");
    if (c) {
        CHECK_OK(td_checkpoint_get_meta_u64(c, "seed", 0, UINT64_MAX, &u));
        CHECK(u == UINT64_MAX);
        td_checkpoint_close(c);
    }
    c = with_meta(path, "seed", "18446744073709551616");
    if (c) {
        CHECK_STATUS(td_checkpoint_get_meta_u64(c, "seed", 0, UINT64_MAX, &u), TD_EFORMAT);
        expect_meta_error(path, "seed", "18446744073709551616", "[0, 18446744073709551615]");
        td_checkpoint_close(c);
    }
}

static void paths_that_are_not_files_say_what_they_are(void) {
    char sub[300], path[512];
    path_in_dir(sub, sizeof sub, "a_directory");
    CHECK(mkdir(sub, 0755) == 0);
    expect_open_error(sub, TD_EINVAL, "is a directory");
    float w[2] = {0};
    td_param t = {.name = "w", .data = w, .count = 2, .dtype = TD_F32, .ndim = 1, .shape = {2}};
    CHECK_STATUS(td_checkpoint_load(sub, &t, 1), TD_EINVAL);
    CHECK(strstr(td_last_error(), sub) && strstr(td_last_error(), "is a directory"));
    CHECK_STATUS(td_checkpoint_save(sub, &t, 1, NULL, 0), TD_EINVAL);
    CHECK(strstr(td_last_error(), sub) && strstr(td_last_error(), "is a directory"));

    /* Missing, below a file, unreadable: the path and the system's reason. */
    path_in_dir(path, sizeof path, "absent.safetensors");
    expect_open_error(path, TD_ENOTFOUND, "No such file or directory");
    char file[300];
    path_in_dir(file, sizeof file, "plain.safetensors");
    CHECK_OK(td_checkpoint_save(file, &t, 1, NULL, 0));
    snprintf(path, sizeof path, "%s/inner", file);
    expect_open_error(path, TD_ENOTFOUND, "Not a directory");
    if (geteuid() != 0) { /* root reads anything */
        CHECK(chmod(file, 0) == 0);
        expect_open_error(file, TD_EIO, "Permission denied");
        CHECK(chmod(file, 0644) == 0);
    }

    /* A FIFO is refused at once rather than waiting for a writer; tried in a child, which an
     * alarm ends if it hangs, so that a hang fails this case and not the whole program. */
    path_in_dir(path, sizeof path, "fifo.safetensors");
    CHECK(mkfifo(path, 0644) == 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(10);
        td_checkpoint *c = NULL;
        td_status st = td_checkpoint_open(&c, path);
        _exit(st == TD_EINVAL && strstr(td_last_error(), path) && strstr(td_last_error(), "a FIFO")
                  ? 0
                  : 1);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        TEST_FAIL_AT("opening a FIFO %s", WIFSIGNALED(status) ? "hung" : "gave the wrong error");
}

/* Names in folder d, sorted, as one string "a b c". */
static void list_dir(const char *d, char *out, size_t len) {
    struct dirent **names;
    int n = scandir(d, &names, NULL, alphasort);
    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (names[i]->d_name[0] != '.') {
            size_t k = strlen(out);
            snprintf(out + k, len - k, "%s%s", k ? " " : "", names[i]->d_name);
        }
        free(names[i]);
    }
    if (n >= 0) free(names);
}

static void a_killed_save_leaves_a_temporary_the_next_save_removes(void) {
    char sub[300], path[512], other[512], listing[2048];
    path_in_dir(sub, sizeof sub, "killed");
    CHECK(mkdir(sub, 0755) == 0);
    snprintf(path, sizeof path, "%s/ck.safetensors", sub);
    size_t big_n = 1 << 20;
    float *big = calloc(big_n, sizeof(float));
    td_param huge = {.name = "w",
                     .data = big,
                     .count = big_n,
                     .dtype = TD_F32,
                     .ndim = 1,
                     .shape = {(int64_t)big_n}};
    /* A real kill in the middle of the write: past the file size limit the kernel sends
     * SIGXFSZ, whose default action ends the process where it stands. */
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit lim = {64 << 10, 64 << 10}, no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        setrlimit(RLIMIT_FSIZE, &lim);
        signal(SIGXFSZ, SIG_DFL);
        td_checkpoint_save(path, &huge, 1, NULL, 0);
        _exit(0);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGXFSZ);
    list_dir(sub, listing, sizeof listing);
    /* Exactly one file, "ck.safetensors.tmp." and six characters, was left. */
    CHECK(strncmp(listing, "ck.safetensors.tmp.", 19) == 0 && strlen(listing) == 25);

    /* Neighbours that are not that checkpoint's temporaries, though some look alike. */
    const char *keep[] = {"ck.safetensors.tmp.Ab12Z9.bak", "ck.safetensors.tmp.Ab1-Z9",
                          "ck.safetensors.tmp.Ab12Z",      "other.safetensors.tmp.Ab12Z9",
                          "xck.safetensors.tmp.Ab12Z9",    "notes.txt"};
    for (size_t i = 0; i < sizeof keep / sizeof *keep; i++) {
        snprintf(other, sizeof other, "%s/%s", sub, keep[i]);
        test_write_file(other, "x", 1);
    }
    snprintf(other, sizeof other, "%s/ck.safetensors.tmp.Lnk123", sub);
    CHECK(symlink("notes.txt", other) == 0);
    snprintf(other, sizeof other, "%s/ck.safetensors.tmp.Dir123", sub);
    CHECK(mkdir(other, 0755) == 0);

    float w[2] = {5, 6}, back[2] = {0};
    td_param t = {.name = "w", .data = w, .count = 2, .dtype = TD_F32, .ndim = 1, .shape = {2}};
    CHECK_OK(td_checkpoint_save(path, &t, 1, NULL, 0));
    list_dir(sub, listing, sizeof listing);
    CHECK(strcmp(listing, "ck.safetensors ck.safetensors.tmp.Ab1-Z9 ck.safetensors.tmp.Ab12Z "
                          "ck.safetensors.tmp.Ab12Z9.bak ck.safetensors.tmp.Dir123 "
                          "ck.safetensors.tmp.Lnk123 notes.txt other.safetensors.tmp.Ab12Z9 "
                          "xck.safetensors.tmp.Ab12Z9") == 0);
    t.data = back;
    CHECK_OK(td_checkpoint_load(path, &t, 1));
    CHECK(back[0] == 5 && back[1] == 6);
    free(big);
}

static void a_temporary_still_being_written_is_kept(void) {
    char sub[300], path[512], tmp[600], listing[1024];
    path_in_dir(sub, sizeof sub, "live");
    CHECK(mkdir(sub, 0755) == 0);
    snprintf(path, sizeof path, "%s/ck.safetensors", sub);
    /* Another process's save in progress, as the library makes it: a locked temporary. */
    snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", path);
    int fd = mkstemp(tmp);
    CHECK(fd >= 0);
    CHECK(flock(fd, LOCK_EX) == 0);
    CHECK(write(fd, "partial", 7) == 7);
    float w[2] = {1, 2};
    td_param t = {.name = "w", .data = w, .count = 2, .dtype = TD_F32, .ndim = 1, .shape = {2}};
    CHECK_OK(td_checkpoint_save(path, &t, 1, NULL, 0));
    CHECK(access(tmp, F_OK) == 0);
    /* Once its writer is gone (here: the lock released), the next save removes it. */
    close(fd);
    CHECK_OK(td_checkpoint_save(path, &t, 1, NULL, 0));
    CHECK(access(tmp, F_OK) != 0 && errno == ENOENT);
    list_dir(sub, listing, sizeof listing);
    CHECK(strcmp(listing, "ck.safetensors") == 0);
}

int main(void) {
    test_temp_dir(dir, sizeof dir, "ckpt");
    RUN(round_trip_every_dtype_and_metadata);
    RUN(reads_files_written_by_other_writers);
    RUN(damaged_headers_are_errors_naming_the_problem);
    RUN(damaged_bytes_are_escaped_in_messages);
    RUN(every_truncation_and_byte_flip_fails_cleanly);
    RUN(load_checks_names_dtypes_and_shapes);
    RUN(failed_save_keeps_the_previous_checkpoint);
    RUN(integer_metadata_must_parse_fully_and_be_in_range);
    RUN(paths_that_are_not_files_say_what_they_are);
    RUN(a_killed_save_leaves_a_temporary_the_next_save_removes);
    RUN(a_temporary_still_being_written_is_kept);
    test_remove_dir(dir);
    TEST_END();
}
