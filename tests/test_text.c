/* Text corpora (src/data/text.c): an R lazy-load database written here the way R writes one
 * (zlib-compressed XDR character vectors) reads back as its lines; damaged or foreign files are
 * errors naming the file and offset; a missing file names the Debian package that ships the
 * novels; plain text reads as bytes; windows cut the text into inputs and next bytes. With
 * r-cran-janeaustenr installed, the six novels read in full. */
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "tandem/data.h"

#include "test.h"

/* Appends a big-endian u32. */
static size_t be(unsigned char *p, size_t at, uint32_t v) {
    p[at] = (unsigned char)(v >> 24), p[at + 1] = (unsigned char)(v >> 16);
    p[at + 2] = (unsigned char)(v >> 8), p[at + 3] = (unsigned char)v;
    return at + 4;
}

/* One rdb entry holding a character vector of `n` lines. */
static size_t rdb_entry(unsigned char *out, const char *const *lines, int n) {
    unsigned char obj[512];
    size_t at = 0;
    obj[at++] = 'X', obj[at++] = '\n';
    at = be(obj, at, 3), at = be(obj, at, 0x40202), at = be(obj, at, 0x30500);
    at = be(obj, at, 5);
    memcpy(obj + at, "UTF-8", 5), at += 5;
    at = be(obj, at, 16), at = be(obj, at, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        at = be(obj, at, 0x40009);
        if (!lines[i]) { /* NA */
            at = be(obj, at, 0xffffffffu);
            continue;
        }
        at = be(obj, at, (uint32_t)strlen(lines[i]));
        memcpy(obj + at, lines[i], strlen(lines[i])), at += strlen(lines[i]);
    }
    uLongf zlen = 1024;
    compress(out + 4, &zlen, obj, at);
    be(out, 0, (uint32_t)at);
    return 4 + zlen;
}

static void rdb_reads_its_character_vectors(void) {
    char dir[256], path[300];
    test_temp_dir(dir, sizeof dir, "text");
    snprintf(path, sizeof path, "%s/Rdata.rdb", dir);
    const char *a[] = {"EMMA", "", "Emma Woodhouse, handsome,"}, *b[] = {"PERSUASION", NULL, "x"};
    unsigned char file[4096];
    size_t n = rdb_entry(file, a, 3);
    n += rdb_entry(file + n, b, 3);
    test_write_file(path, file, n);
    td_corpus c;
    CHECK_OK(td_corpus_load(&c, path));
    const char *want = "EMMA\n\nEmma Woodhouse, handsome,\nPERSUASION\nx\n";
    CHECK_EQ(c.size, strlen(want));
    CHECK(c.bytes && memcmp(c.bytes, want, c.size) == 0);
    td_corpus_free(&c);
    /* cut off inside the second entry's stream */
    test_write_file(path, file, n - 3);
    CHECK_STATUS(td_corpus_load(&c, path), TD_EFORMAT);
    char offset[64];
    snprintf(offset, sizeof offset, "entry at offset %zu", rdb_entry(file, a, 3));
    CHECK(strstr(td_last_error(), offset) != NULL);
    test_write_file(path, "not an R database", 17);
    CHECK_STATUS(td_corpus_load(&c, path), TD_EFORMAT);
    CHECK(strstr(td_last_error(), "Rdata.rdb") != NULL);
    /* plain text is its bytes */
    snprintf(path, sizeof path, "%s/plain.txt", dir);
    test_write_file(path, "abcdefghij", 10);
    CHECK_OK(td_corpus_load(&c, path));
    CHECK_EQ(c.size, 10);
    /* windows: (10 - 1) / 4 = 2 of 4 inputs and their next bytes */
    CHECK_EQ(td_corpus_windows(c.size, 4), 2);
    float x[4];
    int64_t y[4];
    td_corpus_window(c.bytes, 1, 4, x, y);
    CHECK(x[0] == 'e' && x[3] == 'h' && y[0] == 'f' && y[3] == 'i');
    td_corpus_free(&c);
    snprintf(path, sizeof path, "%s/missing.rdb", dir);
    CHECK_STATUS(td_corpus_load(&c, path), TD_EIO);
    CHECK(strstr(td_last_error(), "r-cran-janeaustenr") != NULL);
    test_remove_dir(dir);
}

/* What is not a regular file is refused saying what it is, before anything is read: a FIFO
 * (whose open would wait for a writer forever), a directory, /dev/zero (which never ends); and
 * a text larger than the bound is refused saying the bound, before it is read. An alarm turns
 * a blocked open into a failure of the test rather than a hang of the suite. */
static void corpus_must_be_a_regular_file_within_the_bound(void) {
    char dir[256], path[300];
    test_temp_dir(dir, sizeof dir, "text");
    td_corpus c;
    alarm(60);
    snprintf(path, sizeof path, "%s/fifo", dir);
    CHECK(mkfifo(path, 0600) == 0);
    CHECK_STATUS(td_corpus_load(&c, path), TD_EINVAL);
    CHECK(strstr(td_last_error(), path) && strstr(td_last_error(), "is a FIFO"));
    CHECK_STATUS(td_corpus_load(&c, dir), TD_EINVAL);
    CHECK(strstr(td_last_error(), dir) && strstr(td_last_error(), "is a directory"));
    snprintf(path, sizeof path, "%s/big.txt", dir);
    FILE *f = fopen(path, "wb");
    CHECK(f && ftruncate(fileno(f), (off_t)TD_CORPUS_MAX_BYTES + 1) == 0); /* sparse */
    if (f) fclose(f);
    CHECK_STATUS(td_corpus_load(&c, path), TD_EINVAL);
    CHECK(strstr(td_last_error(), path) && strstr(td_last_error(), "1073741825 bytes") &&
          strstr(td_last_error(), "1 GiB"));
    printf("    %s\n", td_last_error());
    CHECK_STATUS(td_corpus_load(&c, "/dev/zero"), TD_EINVAL);
    CHECK(strstr(td_last_error(), "/dev/zero is a character device"));
    printf("    %s\n", td_last_error());
    alarm(0);
    test_remove_dir(dir);
}

static void jane_austen_reads_in_full(void) {
    if (access(td_corpus_default_path(), R_OK) != 0) {
        SKIP("%s is not installed (Debian's r-cran-janeaustenr)", td_corpus_default_path());
        return;
    }
    td_corpus c;
    CHECK_OK(td_corpus_load(&c, td_corpus_default_path()));
    CHECK(c.size > 4000000);
    CHECK(c.size >= 4 && memcmp(c.bytes, "EMMA", 4) == 0);
    const char *pride = "It is a truth universally acknowledged";
    int found = 0;
    for (size_t i = 0; i + strlen(pride) < c.size && !found; i++)
        found = memcmp(c.bytes + i, pride, strlen(pride)) == 0;
    CHECK(found);
    printf("    %zu bytes\n", c.size);
    td_corpus_free(&c);
}

int main(void) {
    RUN(rdb_reads_its_character_vectors);
    RUN(corpus_must_be_a_regular_file_within_the_bound);
    RUN(jane_austen_reads_in_full);
    TEST_END();
}
