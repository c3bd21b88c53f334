/* Data: IDX reading (real Fashion-MNIST and damaged copies), DistributedSampler index lists
 * against PyTorch's rules, and the prefetching loader (coverage, ordering, resume, shutdown). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "tandem/data.h"

#include "test.h"

static char tmpdir[256];

static void write_gz(const char *path, const void *data, size_t len) {
    gzFile f = gzopen(path, "wb");
    CHECK(f != NULL);
    if (!f) return;
    CHECK_EQ(gzwrite(f, data, (unsigned)len), (long long)len);
    gzclose(f);
}

/* An IDX u8 header for the given dims. */
static size_t idx_header(unsigned char *h, int ndim, const uint32_t *dims, unsigned char type) {
    h[0] = 0;
    h[1] = 0;
    h[2] = type;
    h[3] = (unsigned char)ndim;
    for (int i = 0; i < ndim; i++) {
        h[4 + 4 * i] = (unsigned char)(dims[i] >> 24);
        h[5 + 4 * i] = (unsigned char)(dims[i] >> 16);
        h[6 + 4 * i] = (unsigned char)(dims[i] >> 8);
        h[7 + 4 * i] = (unsigned char)dims[i];
    }
    return 4 + 4 * (size_t)ndim;
}

static const char *fmnist_dir(void) {
    const char *d = getenv("TD_FASHION_MNIST_DIR");
    return d && *d ? d : "/usr/share/datasets/fashion-mnist";
}

static void fashion_mnist_train_and_test(void) {
    td_dataset *train = NULL, *test = NULL;
    CHECK_OK(td_dataset_load_fashion_mnist(&train, NULL, TD_SPLIT_TRAIN));
    CHECK_OK(td_dataset_load_fashion_mnist(&test, NULL, TD_SPLIT_TEST));
    if (!train || !test) goto done;
    CHECK_EQ(td_dataset_size(train), 60000);
    CHECK_EQ(td_dataset_size(test), 10000);
    CHECK_EQ(td_dataset_sample_numel(train), 784);
    int64_t shape[TD_MAX_DIMS];
    CHECK_EQ(td_dataset_sample_shape(train, shape), 3);
    CHECK(shape[0] == 1 && shape[1] == 28 && shape[2] == 28);
    const int64_t first_train[10] = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5};
    const int64_t first_test[10] = {9, 2, 1, 1, 6, 1, 4, 6, 5, 7};
    for (int i = 0; i < 10; i++) {
        CHECK_EQ(td_dataset_y(train)[i], first_train[i]);
        CHECK_EQ(td_dataset_y(test)[i], first_test[i]);
    }
    /* Both splits are balanced: 6000 / 1000 of each class. */
    size_t hist[10] = {0}, hist_test[10] = {0};
    for (size_t i = 0; i < 60000; i++) hist[td_dataset_y(train)[i]]++;
    for (size_t i = 0; i < 10000; i++) hist_test[td_dataset_y(test)[i]]++;
    for (int c = 0; c < 10; c++) {
        CHECK_EQ(hist[c], 6000);
        CHECK_EQ(hist_test[c], 1000);
    }
    /* Normalised pixels span exactly (0 - mean)/std .. (1 - mean)/std, and the training mean
     * and std come out near 0 and 1 since the constants are the dataset's own. */
    const float *x = td_dataset_x(train);
    double lo = 1e9, hi = -1e9, sum = 0, sum2 = 0;
    for (size_t i = 0; i < 60000 * 784; i++) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
        sum += x[i];
        sum2 += (double)x[i] * x[i];
    }
    double n = 60000.0 * 784, mean = sum / n, std = sqrt(sum2 / n - mean * mean);
    CHECK_NEAR(lo, (0.0 - 0.2860) / 0.3530, 1e-5);
    CHECK_NEAR(hi, (1.0 - 0.2860) / 0.3530, 1e-5);
    CHECK_NEAR(mean, 0.0, 2e-3);
    CHECK_NEAR(std, 1.0, 2e-3);
done:
    td_dataset_destroy(train);
    td_dataset_destroy(test);
}

static void fashion_mnist_dir_from_env_and_missing_dir(void) {
    td_dataset *d = NULL;
    CHECK_STATUS(td_dataset_load_fashion_mnist(&d, "/nonexistent-td-dir", TD_SPLIT_TEST), TD_EIO);
    CHECK(strstr(td_last_error(), "/nonexistent-td-dir/t10k-images-idx3-ubyte.gz") != NULL);
    CHECK(d == NULL);
    char *old = getenv("TD_FASHION_MNIST_DIR") ? strdup(getenv("TD_FASHION_MNIST_DIR")) : NULL;
    setenv("TD_FASHION_MNIST_DIR", "/nonexistent-td-env", 1);
    CHECK_STATUS(td_dataset_load_fashion_mnist(&d, NULL, TD_SPLIT_TEST), TD_EIO);
    CHECK(strstr(td_last_error(), "/nonexistent-td-env/") != NULL);
    if (old) {
        setenv("TD_FASHION_MNIST_DIR", old, 1);
        free(old);
    } else {
        unsetenv("TD_FASHION_MNIST_DIR");
    }
}

static void idx_reads_plain_files_and_converts_byte_order(void) {
    unsigned char buf[64];
    uint32_t dims[2] = {2, 3};
    size_t h = idx_header(buf, 2, dims, 0x0C); /* i32, big-endian */
    for (int i = 0; i < 6; i++) {
        uint32_t v = (uint32_t)(i * 1000 - 2500);
        buf[h + 4 * i] = (unsigned char)(v >> 24);
        buf[h + 4 * i + 1] = (unsigned char)(v >> 16);
        buf[h + 4 * i + 2] = (unsigned char)(v >> 8);
        buf[h + 4 * i + 3] = (unsigned char)v;
    }
    char path[300];
    snprintf(path, sizeof path, "%s/plain-i32.idx", tmpdir);
    test_write_file(path, buf, h + 24);
    td_idx idx;
    CHECK_OK(td_idx_read(path, &idx));
    CHECK_EQ(idx.dtype, TD_I32);
    CHECK_EQ(idx.ndim, 2);
    CHECK_EQ(idx.dims[0], 2);
    CHECK_EQ(idx.dims[1], 3);
    CHECK_EQ(idx.count, 6);
    for (int i = 0; i < 6 && idx.data; i++) CHECK_EQ(((int32_t *)idx.data)[i], i * 1000 - 2500);
    td_idx_free(&idx);
    CHECK(idx.data == NULL);
}

/* How often `needle` occurs in `text`. */
static int occurrences(const char *text, const char *needle) {
    int n = 0;
    for (const char *at = text; (at = strstr(at, needle)); at += strlen(needle)) n++;
    return n;
}

/* Each damaged file must give TD_EFORMAT, name the file once, and say what was wrong. */
static void expect_format_error(const char *path, const char *what) {
    td_idx idx;
    td_status st = td_idx_read(path, &idx);
    CHECK_EQ(st, TD_EFORMAT);
    CHECK(idx.data == NULL);
    if (occurrences(td_last_error(), path) != 1 || !strstr(td_last_error(), what))
        TEST_FAIL_AT("message \"%s\" should name %s once and say \"%s\"", td_last_error(), path,
                     what);
}

/* Writes len bytes of buf to <tmpdir>/name, gzip-compressed when gz, and expects the
 * format error `what` for it. */
static void expect_damaged(const char *name, int gz, const void *buf, size_t len,
                           const char *what) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    if (gz)
        write_gz(path, buf, len);
    else
        test_write_file(path, buf, len);
    expect_format_error(path, what);
}

static void idx_damaged_files_are_errors_naming_the_file(void) {
    unsigned char buf[4096];
    uint32_t dims[3] = {10, 28, 28};
    size_t h = idx_header(buf, 3, dims, 0x08);
    memset(buf + h, 7, sizeof buf - h);

    /* the header promises 7840 bytes */
    expect_damaged("short-images-idx3-ubyte.gz", 1, buf, h + 1234,
                   "expected 7840 bytes of data, file ends after 1234");
    expect_damaged("short-plain-idx3-ubyte", 0, buf, h + 100, "file ends after 100");

    uint32_t small[1] = {5};
    h = idx_header(buf, 1, small, 0x08);
    expect_damaged("extra-idx1-ubyte.gz", 1, buf, h + 9, "extra bytes");

    h = idx_header(buf, 1, small, 0x08);
    buf[0] = 0x1f;
    expect_damaged("magic.idx", 0, buf, h + 5, "magic");

    h = idx_header(buf, 1, small, 0x0B); /* i16: not accepted */
    expect_damaged("type.idx", 0, buf, h + 10, "type byte 0x0b");

    h = idx_header(buf, 1, small, 0x08);
    buf[3] = 0;
    expect_damaged("ndim.idx", 0, buf, h + 5, "ndim 0");

    expect_damaged("tiny.idx", 0, buf, 2, "4-byte IDX magic");

    h = idx_header(buf, 3, dims, 0x08);
    expect_damaged("dims.idx", 0, buf, 4 + 6, "dims"); /* ends inside the dims */

    /* Damaged copies of the real compressed file: cut short, and bytes flipped inside the
     * deflate stream (zlib then reports a data or CRC error, or the length comes out wrong). */
    char src[300];
    snprintf(src, sizeof src, "%s/t10k-labels-idx1-ubyte.gz", fmnist_dir());
    size_t len = 0;
    unsigned char *gz = test_read_file(src, &len);
    CHECK(gz != NULL && len > 1000);
    if (!gz) return;
    expect_damaged("t10k-labels-cut.gz", 0, gz, len / 2, "t10k-labels-cut.gz");
    for (size_t at = 100; at < len - 20; at += len / 7) {
        for (int k = 0; k < 16; k++) gz[at + k] ^= 0x5a;
        expect_damaged("t10k-labels-flip.gz", 0, gz, len, "t10k-labels-flip.gz");
        for (int k = 0; k < 16; k++) gz[at + k] ^= 0x5a;
    }
    free(gz);
}

/* The bytes of a gzip file, decompressed (malloc'd, the caller frees), or NULL. */
static unsigned char *gunzip_file(const char *path, size_t *len) {
    gzFile f = gzopen(path, "rb");
    *len = 0;
    if (!f) return NULL;
    size_t cap = 1 << 16;
    unsigned char *buf = malloc(cap);
    int got;
    while (buf && (got = gzread(f, buf + *len, (unsigned)(cap - *len))) > 0)
        if ((*len += (size_t)got) == cap) buf = realloc(buf, cap *= 2);
    gzclose(f);
    return buf;
}

/* len bytes gzip-compressed at deflate `level` (0: stored blocks, the bytes as they are),
 * malloc'd; *out_len is its size. */
static unsigned char *gzip_bytes(const void *data, size_t len, int level, size_t *out_len) {
    z_stream z;
    memset(&z, 0, sizeof z);
    *out_len = 0;
    if (deflateInit2(&z, level, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) return NULL;
    size_t cap = deflateBound(&z, (uLong)len);
    unsigned char *out = malloc(cap);
    z.next_in = (Bytef *)data;
    z.avail_in = (uInt)len;
    z.next_out = out;
    z.avail_out = (uInt)cap;
    CHECK_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
    *out_len = z.total_out;
    deflateEnd(&z);
    return out;
}

/* A gzip file cut by 1 to 9 bytes (inside its 8-byte trailer, CRC-32 and length, or at the end
 * of its last deflate block) holds all its data, so only the trailer can tell: every file of
 * the data set is refused at every such cut, naming it, and the loader names the file too. */
static void idx_gzip_cut_by_1_to_9_bytes_is_an_error(void) {
    static const char *const files[] = {"t10k-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                                        "train-labels-idx1-ubyte.gz",
                                        "train-images-idx3-ubyte.gz"};
    for (size_t f = 0; f < sizeof files / sizeof *files; f++) {
        char src[300], path[512];
        snprintf(src, sizeof src, "%s/%s", fmnist_dir(), files[f]);
        snprintf(path, sizeof path, "%s/%s", tmpdir, files[f]);
        size_t len = 0;
        unsigned char *gz = test_read_file(src, &len);
        CHECK(gz != NULL && len > 1000);
        if (!gz) continue;
        test_write_file(path, gz, len);
        free(gz);
        td_idx idx;
        CHECK_OK(td_idx_read(path, &idx)); /* whole, it reads */
        td_idx_free(&idx);
        for (size_t cut = 1; cut <= 9; cut++) {
            CHECK(truncate(path, (off_t)(len - cut)) == 0);
            expect_format_error(path, "unexpected end of file");
        }
    }
    /* The loader: the training split with its labels cut, the images whole. */
    char dir[300], path[400], src[300];
    snprintf(dir, sizeof dir, "%s/cut-set", tmpdir);
    CHECK(mkdir(dir, 0700) == 0);
    snprintf(src, sizeof src, "%s/train-images-idx3-ubyte.gz", fmnist_dir());
    snprintf(path, sizeof path, "%s/train-images-idx3-ubyte.gz", dir);
    CHECK(symlink(src, path) == 0);
    snprintf(src, sizeof src, "%s/train-labels-idx1-ubyte.gz", tmpdir); /* cut by 9 above */
    snprintf(path, sizeof path, "%s/train-labels-idx1-ubyte.gz", dir);
    CHECK(rename(src, path) == 0);
    td_dataset *d = NULL;
    CHECK_STATUS(td_dataset_load_fashion_mnist(&d, dir, TD_SPLIT_TRAIN), TD_EFORMAT);
    CHECK(d == NULL);
    if (!strstr(td_last_error(), path) || !strstr(td_last_error(), "trailer"))
        TEST_FAIL_AT("message \"%s\" should name %s and its trailer", td_last_error(), path);
}

/* Deflate level 0 stores the bytes as they are, so a flipped bit decodes without complaint and
 * only the trailer's CRC-32 can tell: with it the file is refused, and without it too. */
static void idx_stored_gzip_with_a_flipped_bit_is_an_error(void) {
    char src[300], path[512];
    snprintf(src, sizeof src, "%s/t10k-labels-idx1-ubyte.gz", fmnist_dir());
    size_t len = 0, zlen = 0;
    unsigned char *raw = gunzip_file(src, &len);
    CHECK_EQ(len, 8 + 10000);
    unsigned char *z = raw ? gzip_bytes(raw, len, 0, &zlen) : NULL;
    CHECK(z != NULL && zlen > len);
    if (!z) goto done;
    snprintf(path, sizeof path, "%s/stored-labels.gz", tmpdir); /* intact, it reads */
    test_write_file(path, z, zlen);
    td_idx idx;
    CHECK_OK(td_idx_read(path, &idx));
    CHECK(idx.count == 10000 && idx.data && !memcmp(idx.data, raw + 8, 10000));
    td_idx_free(&idx);
    z[zlen / 2] ^= 0x10; /* a label in the middle of the data */
    expect_damaged("stored-flip.gz", 0, z, zlen, "incorrect data check");
    expect_damaged("stored-flip-no-trailer.gz", 0, z, zlen - 8, "unexpected end of file");
done:
    free(raw);
    free(z);
}

/* Damage deep in a large file is reported after the data that decoded before it (not "after
 * 0": zlib inflates a large read into the caller's buffer and counts none of it on an error),
 * naming the file once. */
static void idx_damage_deep_in_a_file_says_how_far_it_read(void) {
    char src[300], path[512];
    snprintf(src, sizeof src, "%s/t10k-images-idx3-ubyte.gz", fmnist_dir());
    size_t len = 0;
    unsigned char *gz = test_read_file(src, &len);
    CHECK(gz != NULL && len > 1000000);
    if (!gz) return;
    memset(gz + len / 2, 0xff, 4096); /* halfway through the compressed stream */
    snprintf(path, sizeof path, "%s/t10k-images-deep.gz", tmpdir);
    test_write_file(path, gz, len);
    expect_format_error(path, "damaged gzip data after ");
    const char *after = strstr(td_last_error(), "after ");
    long good = after ? atol(after + 6) : -1;
    printf("    %s\n", td_last_error());
    CHECK(good >= 7840000 / 4 && good < 7840000);
    free(gz);
}

static void image_label_count_mismatch_is_an_error(void) {
    char dir[300], path[400];
    snprintf(dir, sizeof dir, "%s/mismatch", tmpdir);
    CHECK(mkdir(dir, 0700) == 0);
    unsigned char buf[8192];
    uint32_t idims[3] = {5, 28, 28}, ldims[1] = {4};
    size_t h = idx_header(buf, 3, idims, 0x08);
    memset(buf + h, 0, 5 * 784);
    snprintf(path, sizeof path, "%s/train-images-idx3-ubyte.gz", dir);
    write_gz(path, buf, h + 5 * 784);
    h = idx_header(buf, 1, ldims, 0x08);
    memset(buf + h, 1, 4);
    snprintf(path, sizeof path, "%s/train-labels-idx1-ubyte.gz", dir);
    write_gz(path, buf, h + 4);
    td_dataset *d = NULL;
    CHECK_STATUS(td_dataset_load_fashion_mnist(&d, dir, TD_SPLIT_TRAIN), TD_EFORMAT);
    CHECK(strstr(td_last_error(), "5 images") && strstr(td_last_error(), "4 labels"));
    CHECK(d == NULL);
    /* With matching counts the same tiny files load. */
    ldims[0] = 5;
    h = idx_header(buf, 1, ldims, 0x08);
    memset(buf + h, 3, 5);
    write_gz(path, buf, h + 5);
    CHECK_OK(td_dataset_load_fashion_mnist(&d, dir, TD_SPLIT_TRAIN));
    CHECK_EQ(td_dataset_size(d), 5);
    if (d) CHECK_EQ(td_dataset_y(d)[4], 3);
    td_dataset_destroy(d);
}

/* This rank's index list as a fresh sampler gives it. */
static void sampler_lists(size_t n, int world, int drop_last, int shuffle, uint64_t seed,
                          uint64_t epoch, size_t out[][64], size_t *per_rank) {
    for (int r = 0; r < world; r++) {
        td_sampler_params p = td_sampler_default_params();
        p.rank = r;
        p.world_size = world;
        p.drop_last = drop_last;
        p.shuffle = shuffle;
        p.seed = seed;
        td_sampler *s = NULL;
        CHECK_OK(td_sampler_create(&s, n, &p));
        if (!s) return;
        td_sampler_set_epoch(s, epoch);
        *per_rank = td_sampler_size(s);
        memcpy(out[r], td_sampler_indices(s), *per_rank * sizeof(size_t));
        td_sampler_destroy(s);
    }
}

static void sampler_pads_and_truncates_like_pytorch(void) {
    /* Lists printed by torch.utils.data.DistributedSampler(range(N), shuffle=False). */
    struct {
        size_t n;
        int world, drop_last;
        size_t per_rank;
        size_t want[4][4];
    } cases[] = {
        {10, 3, 0, 4, {{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 1}}},
        {10, 3, 1, 3, {{0, 3, 6}, {1, 4, 7}, {2, 5, 8}}},
        {2, 4, 0, 1, {{0}, {1}, {0}, {1}}},
        {1, 4, 0, 1, {{0}, {0}, {0}, {0}}},
        {5, 2, 0, 3, {{0, 2, 4}, {1, 3, 0}}},
        {7, 4, 1, 1, {{0}, {1}, {2}, {3}}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        size_t got[4][64], per_rank = 0;
        sampler_lists(cases[c].n, cases[c].world, cases[c].drop_last, 0, 0, 0, got, &per_rank);
        CHECK_EQ(per_rank, cases[c].per_rank);
        for (int r = 0; r < cases[c].world; r++)
            for (size_t i = 0; i < per_rank; i++) CHECK_EQ(got[r][i], cases[c].want[r][i]);
    }
    td_sampler *s = NULL;
    td_sampler_params p = td_sampler_default_params();
    p.rank = 3;
    p.world_size = 3;
    CHECK_STATUS(td_sampler_create(&s, 10, &p), TD_EINVAL);
    CHECK(strstr(td_last_error(), "rank 3") != NULL);
}

static void sampler_shuffled_shards_cover_every_sample(void) {
    for (int world = 2; world <= 4; world++) {
        for (size_t n = 12; n <= 13; n++) {
            for (int drop_last = 0; drop_last <= 1; drop_last++) {
                size_t got[4][64], per_rank = 0;
                sampler_lists(n, world, drop_last, 1, 1234, 3, got, &per_rank);
                int seen[64] = {0};
                for (int r = 0; r < world; r++)
                    for (size_t i = 0; i < per_rank; i++) {
                        CHECK(got[r][i] < n);
                        if (got[r][i] < n) seen[got[r][i]]++;
                    }
                size_t once = 0, twice = 0, more = 0;
                for (size_t i = 0; i < n; i++) {
                    if (seen[i] == 1)
                        once++;
                    else if (seen[i] == 2)
                        twice++;
                    else if (seen[i] > 2)
                        more++;
                }
                CHECK_EQ(more, 0);
                if (drop_last) {
                    CHECK_EQ(per_rank, n / world); /* each sample at most once, the tail dropped */
                    CHECK_EQ(twice, 0);
                    CHECK_EQ(once, per_rank * world);
                } else {
                    size_t pad = per_rank * world - n; /* every sample, plus pad repeated ones */
                    CHECK_EQ(once + twice, n);
                    CHECK_EQ(twice, pad);
                }
            }
        }
    }
}

static void sampler_epochs_and_seeds(void) {
    size_t a[4][64], b[4][64], c[4][64], d[4][64], per_rank = 0;
    sampler_lists(60, 1, 0, 1, 7, 0, a, &per_rank);
    sampler_lists(60, 1, 0, 1, 7, 0, b, &per_rank);
    sampler_lists(60, 1, 0, 1, 7, 1, c, &per_rank);
    sampler_lists(60, 1, 0, 1, 8, 0, d, &per_rank);
    CHECK(memcmp(a[0], b[0], 60 * sizeof(size_t)) == 0);
    CHECK(memcmp(a[0], c[0], 60 * sizeof(size_t)) != 0);
    CHECK(memcmp(a[0], d[0], 60 * sizeof(size_t)) != 0);
    size_t sorted = 1;
    for (int i = 0; i < 60; i++) sorted &= a[0][i] == (size_t)i;
    CHECK(!sorted);
}

/* N samples of shape (2, 3) whose floats encode their index, label = index. */
static td_dataset *counting_dataset(size_t n) {
    const int64_t shape[2] = {2, 3};
    td_dataset *d = NULL;
    CHECK_OK(td_dataset_create(&d, n, 2, shape));
    if (!d) return NULL;
    for (size_t i = 0; i < n; i++) {
        for (int k = 0; k < 6; k++) td_dataset_x(d)[i * 6 + k] = (float)(i * 6 + k);
        td_dataset_y(d)[i] = (int64_t)i;
    }
    return d;
}

/* Drains one epoch, checking each batch's x matches its y, and records the labels. */
static size_t drain_epoch(td_loader *l, int64_t *ys, size_t cap, size_t *nbatches,
                          size_t *last_size) {
    size_t total = 0;
    *nbatches = 0;
    td_batch b;
    for (;;) {
        CHECK_OK(td_loader_next(l, &b));
        if (b.size == 0) break;
        CHECK_EQ(b.index, *nbatches);
        for (size_t i = 0; i < b.size; i++) {
            for (int k = 0; k < 6; k++) CHECK_EQ(b.x[i * 6 + k], b.y[i] * 6 + k);
            if (total < cap) ys[total] = b.y[i];
            total++;
        }
        *last_size = b.size;
        (*nbatches)++;
    }
    return total;
}

static void loader_covers_every_sample_once_per_epoch(void) {
    td_dataset *d = counting_dataset(1000);
    td_loader_params p = td_loader_default_params();
    p.batch_size = 64;
    p.sampler.seed = 99;
    td_loader *l = NULL, *l2 = NULL;
    CHECK_OK(td_loader_create(&l, d, &p));
    CHECK_OK(td_loader_create(&l2, d, &p));
    if (!l || !l2) goto done;
    CHECK_EQ(td_loader_batches_per_epoch(l), 16);
    static int64_t e0[1000], e1[1000], again[1000];
    size_t nb = 0, last = 0;
    CHECK_EQ(drain_epoch(l, e0, 1000, &nb, &last), 1000);
    CHECK_EQ(nb, 16);
    CHECK_EQ(last, 1000 - 15 * 64);
    td_batch b;
    CHECK_OK(td_loader_next(l, &b)); /* stays at the end until the next epoch is set */
    CHECK_EQ(b.size, 0);
    int seen[1000] = {0};
    for (int i = 0; i < 1000; i++) seen[e0[i]]++;
    for (int i = 0; i < 1000; i++) CHECK_EQ(seen[i], 1);
    CHECK_OK(td_loader_set_epoch(l, 1));
    CHECK_EQ(drain_epoch(l, e1, 1000, &nb, &last), 1000);
    CHECK(memcmp(e0, e1, sizeof e0) != 0);
    CHECK_EQ(drain_epoch(l2, again, 1000, &nb, &last), 1000); /* same seed, same epoch 0 order */
    CHECK(memcmp(e0, again, sizeof e0) == 0);
done:
    td_loader_destroy(l);
    td_loader_destroy(l2);
    td_dataset_destroy(d);
}

/* Sharded global batches: batch k of 128 is the same samples at every world size, cut 43,
 * 43, 42 over three ranks, and a short last batch is kept or dropped. */
static void loader_shards_global_batches_unevenly(void) {
    size_t off, cnt;
    td_split_even(128, 3, 0, &off, &cnt);
    CHECK(off == 0 && cnt == 43);
    td_split_even(128, 3, 2, &off, &cnt);
    CHECK(off == 86 && cnt == 42);
    td_split_even(2, 3, 2, &off, &cnt);
    CHECK(off == 2 && cnt == 0);
    td_dataset *d = counting_dataset(1000);
    for (int drop = 0; drop < 2; drop++) {
        static int64_t whole[1000], parts[1000];
        size_t nb = 0, last = 0, got = 0;
        td_loader_params p = td_loader_default_params();
        p.sampler.seed = 5;
        p.sampler.global_batch = 128;
        p.sampler.drop_last = drop;
        td_loader *l = NULL;
        CHECK_OK(td_loader_create(&l, d, &p));
        if (!l) break;
        size_t total = drain_epoch(l, whole, 1000, &nb, &last);
        CHECK_EQ(total, drop ? 7 * 128 : 1000);
        CHECK_EQ(nb, drop ? 7 : 8);
        td_loader_destroy(l);
        /* Three ranks' slices of each batch, side by side, are the batch itself. */
        td_loader *r[3] = {NULL};
        for (int k = 0; k < 3; k++) {
            p.sampler.rank = k;
            p.sampler.world_size = 3;
            CHECK_OK(td_loader_create(&r[k], d, &p));
        }
        if (!r[0] || !r[1] || !r[2]) break;
        for (size_t b = 0; b < nb; b++)
            for (int k = 0; k < 3; k++) {
                td_batch x;
                CHECK_OK(td_loader_next(r[k], &x));
                size_t want_off, want;
                td_split_even(b + 1 < nb || drop ? 128 : 1000 - 7 * 128, 3, k, &want_off, &want);
                CHECK_EQ(x.size, want);
                for (size_t i = 0; i < x.size && got < 1000; i++) parts[got++] = x.y[i];
            }
        CHECK_EQ(got, total);
        CHECK(memcmp(whole, parts, total * sizeof *whole) == 0);
        for (int k = 0; k < 3; k++) td_loader_destroy(r[k]);
    }
    td_dataset_destroy(d);
}

static void loader_drop_last_and_ranks(void) {
    td_dataset *d = counting_dataset(1000);
    td_loader_params p = td_loader_default_params();
    p.batch_size = 64;
    p.drop_last = 1;
    td_loader *l = NULL;
    CHECK_OK(td_loader_create(&l, d, &p));
    static int64_t ys[1000];
    size_t nb = 0, last = 0;
    if (l) {
        CHECK_EQ(td_loader_batches_per_epoch(l), 15);
        CHECK_EQ(drain_epoch(l, ys, 1000, &nb, &last), 15 * 64);
        CHECK_EQ(last, 64);
    }
    td_loader_destroy(l);
    /* Three ranks, sampler truncation: 333 each, together every sample but one, once. */
    int seen[1000] = {0};
    for (int r = 0; r < 3; r++) {
        p = td_loader_default_params();
        p.batch_size = 50;
        p.sampler.rank = r;
        p.sampler.world_size = 3;
        p.sampler.drop_last = 1;
        p.sampler.seed = 5;
        CHECK_OK(td_loader_create(&l, d, &p));
        if (!l) continue;
        CHECK_EQ(td_loader_batches_per_epoch(l), 7);
        CHECK_OK(td_loader_set_epoch(l, 4));
        CHECK_EQ(drain_epoch(l, ys, 1000, &nb, &last), 333);
        CHECK_EQ(last, 33);
        for (int i = 0; i < 333; i++) seen[ys[i]]++;
        td_loader_destroy(l);
    }
    int once = 0;
    for (int i = 0; i < 1000; i++) {
        CHECK(seen[i] <= 1);
        once += seen[i];
    }
    CHECK_EQ(once, 999);
    td_dataset_destroy(d);
}

/* With drop_last, a dataset smaller than one batch gives an epoch of no batch, which would
 * train nothing without a word: the sampler and the loader refuse it, saying the sizes. */
static void drop_last_leaving_no_batch_is_refused(void) {
    td_dataset *d = counting_dataset(100);
    td_loader *l = NULL;
    td_loader_params p = td_loader_default_params();
    p.sampler.global_batch = 128;
    p.sampler.drop_last = 1;
    CHECK_STATUS(td_loader_create(&l, d, &p), TD_EINVAL);
    CHECK(l == NULL);
    CHECK(strstr(td_last_error(), "100 samples") && strstr(td_last_error(), "global batch of 128"));
    p.sampler.global_batch = 100; /* exactly one batch */
    CHECK_OK(td_loader_create(&l, d, &p));
    CHECK_EQ(td_loader_batches_per_epoch(l), 1);
    td_loader_destroy(l);
    l = NULL;
    p.sampler.global_batch = 128; /* the short batch kept */
    p.sampler.drop_last = 0;
    CHECK_OK(td_loader_create(&l, d, &p));
    CHECK_EQ(td_loader_batches_per_epoch(l), 1);
    td_loader_destroy(l);
    l = NULL;

    p = td_loader_default_params(); /* the loader's own batches */
    p.batch_size = 128;
    p.drop_last = 1;
    CHECK_STATUS(td_loader_create(&l, d, &p), TD_EINVAL);
    CHECK(strstr(td_last_error(), "100 samples") && strstr(td_last_error(), "batch of 128"));
    p.sampler.world_size = 2; /* 50 per rank */
    p.batch_size = 64;
    CHECK_STATUS(td_loader_create(&l, d, &p), TD_EINVAL);
    CHECK(strstr(td_last_error(), "50 samples") && strstr(td_last_error(), "batch of 64"));
    p.batch_size = 50;
    CHECK_OK(td_loader_create(&l, d, &p));
    td_loader_destroy(l);

    td_sampler *s = NULL; /* rank-strided: fewer samples than ranks */
    td_sampler_params sp = td_sampler_default_params();
    sp.world_size = 4;
    sp.drop_last = 1;
    CHECK_STATUS(td_sampler_create(&s, 3, &sp), TD_EINVAL);
    CHECK(strstr(td_last_error(), "3 samples") && strstr(td_last_error(), "4 ranks"));
    CHECK(s == NULL);
    td_dataset_destroy(d);
}

static void loader_seek_resumes_bit_for_bit(void) {
    td_dataset *d = counting_dataset(700);
    td_loader_params p = td_loader_default_params();
    p.batch_size = 32;
    p.sampler.seed = 11;
    td_loader *a = NULL, *b = NULL;
    CHECK_OK(td_loader_create(&a, d, &p));
    CHECK_OK(td_loader_create(&b, d, &p));
    if (!a || !b) goto done;
    CHECK_OK(td_loader_set_epoch(a, 2));
    static float want[22][32 * 6];
    static int64_t want_y[22][32];
    size_t sizes[22];
    td_batch bt;
    for (int i = 0; i < 22; i++) {
        CHECK_OK(td_loader_next(a, &bt));
        sizes[i] = bt.size;
        memcpy(want[i], bt.x, bt.size * 6 * sizeof(float));
        memcpy(want_y[i], bt.y, bt.size * sizeof(int64_t));
    }
    CHECK_OK(td_loader_next(b, &bt)); /* b is mid-epoch 0 when it seeks */
    CHECK_OK(td_loader_seek(b, 2, 9));
    for (int i = 9; i < 22; i++) {
        CHECK_OK(td_loader_next(b, &bt));
        CHECK_EQ(bt.epoch, 2);
        CHECK_EQ(bt.index, i);
        CHECK_EQ(bt.size, sizes[i]);
        CHECK(memcmp(bt.x, want[i], sizes[i] * 6 * sizeof(float)) == 0);
        CHECK(memcmp(bt.y, want_y[i], sizes[i] * sizeof(int64_t)) == 0);
    }
    CHECK_OK(td_loader_next(b, &bt));
    CHECK_EQ(bt.size, 0);
    CHECK_STATUS(td_loader_seek(b, 3, 23), TD_EINVAL);
    CHECK(strstr(td_last_error(), "batch 23") != NULL);
done:
    td_loader_destroy(a);
    td_loader_destroy(b);
    td_dataset_destroy(d);
}

static void loader_destroy_mid_epoch(void) {
    td_dataset *d = counting_dataset(5000);
    td_loader_params p = td_loader_default_params();
    p.batch_size = 16;
    for (int stop_after = 0; stop_after < 4; stop_after++) {
        td_loader *l = NULL;
        CHECK_OK(td_loader_create(&l, d, &p));
        td_batch b;
        for (int i = 0; i < stop_after && l; i++) CHECK_OK(td_loader_next(l, &b));
        if (stop_after == 3 && l) CHECK_OK(td_loader_seek(l, 1, 100));
        td_loader_destroy(l);
    }
    td_loader_params bad = p;
    bad.batch_size = 0;
    td_loader *l = NULL;
    CHECK_STATUS(td_loader_create(&l, d, &bad), TD_EINVAL);
    CHECK(l == NULL);
    td_dataset_destroy(d);
}

static void loader_over_fashion_mnist_two_ranks(void) {
    td_dataset *d = NULL;
    CHECK_OK(td_dataset_load_fashion_mnist(&d, NULL, TD_SPLIT_TRAIN));
    if (!d) return;
    size_t hist[10] = {0}, total = 0;
    for (int r = 0; r < 2; r++) {
        td_loader_params p = td_loader_default_params();
        p.batch_size = 256;
        p.sampler.rank = r;
        p.sampler.world_size = 2;
        p.sampler.seed = 3;
        td_loader *l = NULL;
        CHECK_OK(td_loader_create(&l, d, &p));
        if (!l) continue;
        CHECK_EQ(td_loader_batches_per_epoch(l), (30000 + 255) / 256);
        td_batch b;
        for (;;) {
            CHECK_OK(td_loader_next(l, &b));
            if (b.size == 0) break;
            for (size_t i = 0; i < b.size; i++) hist[b.y[i]]++;
            total += b.size;
            CHECK(b.x[0] >= -0.82f && b.x[b.size * 784 - 1] <= 2.03f);
        }
        td_loader_destroy(l);
    }
    CHECK_EQ(total, 60000);
    for (int c = 0; c < 10; c++) CHECK_EQ(hist[c], 6000);
    td_dataset_destroy(d);
}

int main(void) {
    test_temp_dir(tmpdir, sizeof tmpdir, "data");
    RUN(fashion_mnist_train_and_test);
    RUN(fashion_mnist_dir_from_env_and_missing_dir);
    RUN(idx_reads_plain_files_and_converts_byte_order);
    RUN(idx_damaged_files_are_errors_naming_the_file);
    RUN(idx_gzip_cut_by_1_to_9_bytes_is_an_error);
    RUN(idx_stored_gzip_with_a_flipped_bit_is_an_error);
    RUN(idx_damage_deep_in_a_file_says_how_far_it_read);
    RUN(image_label_count_mismatch_is_an_error);
    RUN(sampler_pads_and_truncates_like_pytorch);
    RUN(sampler_shuffled_shards_cover_every_sample);
    RUN(sampler_epochs_and_seeds);
    RUN(loader_covers_every_sample_once_per_epoch);
    RUN(loader_drop_last_and_ranks);
    RUN(loader_shards_global_batches_unevenly);
    RUN(drop_last_leaving_no_batch_is_refused);
    RUN(loader_seek_resumes_bit_for_bit);
    RUN(loader_destroy_mid_epoch);
    RUN(loader_over_fashion_mnist_two_ranks);
    test_remove_dir(tmpdir);
    TEST_END();
}
