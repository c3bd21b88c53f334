/* Base layer: status strings, last-error messages, dtype conversions, arena, RNG. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/param.h"

#include "core/core_impl.h"
#include "test.h"

/* The bulk conversions (vector instructions where the CPU has them) give the scalar rules' bits
 * for every f16 and bf16 value, and for f32 values around every rounding boundary. */
static void bulk_conversions_match_the_scalar_rules(void) {
    enum { N = 1 << 16 };
    uint16_t *h = malloc(N * sizeof *h), *back = malloc(4 * N * sizeof *back);
    float *f = malloc(4 * N * sizeof *f);
    for (uint32_t i = 0; i < N; i++) h[i] = (uint16_t)i;
    td__convert(f, TD_F32, h, TD_F16, N);
    size_t wrong = 0;
    for (uint32_t i = 0; i < N; i++) {
        float want = td_f16_to_f32(h[i]); /* NaNs stay NaN (the hardware quiets signalling ones) */
        wrong += isnan(want) ? !isnan(f[i]) : memcmp(&f[i], &want, sizeof want) != 0;
    }
    CHECK_EQ(wrong, 0);
    wrong = 0;
    /* Each finite f16 value, the midpoints to its neighbour (ties), and just either side. */
    size_t m = 0;
    for (uint32_t i = 0; i < N; i++) {
        float a = td_f16_to_f32((uint16_t)i), b = td_f16_to_f32((uint16_t)(i + 1));
        if (!isfinite(a) || !isfinite(b) || (i & 0x7fff) == 0x7bff) continue;
        float mid = (a + b) / 2;
        f[m++] = a;
        f[m++] = mid;
        f[m++] = nextafterf(mid, a);
        f[m++] = nextafterf(mid, b);
    }
    f[m++] = 1e6f;
    f[m++] = -1e-9f;
    f[m++] = NAN;
    td__convert(back, TD_F16, f, TD_F32, m);
    for (size_t i = 0; i < m; i++) {
        uint16_t want = td_f32_to_f16(f[i]);
        if (back[i] != want && !(isnan(f[i]) && (back[i] & 0x7c00) == 0x7c00 && (back[i] & 0x3ff)))
            wrong++;
    }
    CHECK_EQ(wrong, 0);
    /* bf16 both ways: every bf16 value back and forth, and f32 values at and around every
     * bf16 rounding boundary (subnormals and NaNs included). */
    td__convert(f, TD_F32, h, TD_BF16, N);
    for (uint32_t i = 0; i < N; i++) {
        float want = td_bf16_to_f32(h[i]);
        wrong += memcmp(&f[i], &want, sizeof want) != 0;
    }
    m = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint32_t u = i << 16;
        float x, halfway, below, above;
        memcpy(&x, &u, 4);
        u |= 0x8000;
        memcpy(&halfway, &u, 4);
        u -= 1;
        memcpy(&below, &u, 4);
        u += 2;
        memcpy(&above, &u, 4);
        f[m++] = x;
        f[m++] = halfway;
        f[m++] = below;
        f[m++] = above;
    }
    td__convert(back, TD_BF16, f, TD_F32, m);
    for (size_t i = 0; i < m; i++) wrong += back[i] != td_f32_to_bf16(f[i]);
    CHECK_EQ(wrong, 0);
    free(h);
    free(back);
    free(f);
}

static void status_strings_are_distinct(void) {
    CHECK(strcmp(td_status_string(TD_OK), "success") == 0);
    CHECK(strcmp(td_status_string(TD_ETIMEOUT), "timed out") == 0);
    CHECK(strcmp(td_status_string((td_status)-999), "unknown status") == 0);
}

static void last_error_keeps_the_message(void) {
    CHECK_EQ(td__fail(TD_EFORMAT, "%s: truncated at byte %d", "x.gz", 42), TD_EFORMAT);
    CHECK(strcmp(td_last_error(), "x.gz: truncated at byte 42") == 0);
}

static void bf16_and_f16_round_trip(void) {
    float values[] = {0.0f, 1.0f, -2.5f, 3.140625f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f};
    for (size_t i = 0; i < sizeof values / sizeof *values; i++) {
        CHECK_NEAR(td_f16_to_f32(td_f32_to_f16(values[i])), values[i], 0.0);
    }
    CHECK_NEAR(td_bf16_to_f32(td_f32_to_bf16(1.0f + 1.0f / 512)), 1.0f, 0.0); /* ties to even */
    CHECK_NEAR(td_bf16_to_f32(td_f32_to_bf16(3.0f)), 3.0f, 0.0);
    CHECK_EQ(td_f32_to_f16(1e6f), 0x7c00); /* overflow is inf */
    CHECK(isnan(td_bf16_to_f32(td_f32_to_bf16(NAN))));
    CHECK_EQ(td_dtype_size(TD_BF16), 2);
    CHECK(strcmp(td_dtype_name(TD_I64), "i64") == 0);
}

static void arena_aligns_reuses_and_tracks_peak(void) {
    td_arena *arena = NULL;
    CHECK_OK(td_arena_create(&arena, 4096));
    char *a = td_arena_alloc(arena, 10);
    char *b = td_arena_alloc(arena, 100000); /* bigger than a block */
    CHECK(a && b && ((uintptr_t)a % 64) == 0 && ((uintptr_t)b % 64) == 0);
    memset(b, 1, 100000);
    size_t peak = td_arena_peak(arena);
    CHECK(peak >= 100010);
    td_arena_reset(arena);
    CHECK_EQ(td_arena_used(arena), 0);
    char *a2 = td_arena_alloc(arena, 10);
    CHECK(a2 == a); /* reset reuses the same memory in the same order */
    CHECK_EQ(td_arena_peak(arena), peak);
    td_arena_destroy(arena);
}

static void philox_matches_the_published_vectors(void) {
    /* Random123 known-answer tests for philox4x32-10. */
    uint32_t out[4];
    td_philox4x32(0, 0, out);
    CHECK_EQ(out[0], 0x6627e8d5u);
    CHECK_EQ(out[1], 0xe169c58du);
    CHECK_EQ(out[2], 0xbc57ac4cu);
    CHECK_EQ(out[3], 0x9b00dbd8u);
    /* All four counter words: the last two are the sub-stream. */
    td_philox4x32_stream(0xffffffffffffffffull, 0xffffffffffffffffull, 0xffffffffffffffffull, out);
    CHECK_EQ(out[0], 0x408f276du);
    CHECK_EQ(out[3], 0x6d5451fdu);
    td_philox4x32_stream(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull, out);
    CHECK_EQ(out[0], 0xd16cfe09u);
    CHECK_EQ(out[1], 0x94fdccebu);
    CHECK_EQ(out[2], 0x5001e420u);
    CHECK_EQ(out[3], 0x24126ea1u);
    uint32_t zero[4];
    td_philox4x32_stream(7, 0, 5, zero);
    td_philox4x32(7, 5, out);
    CHECK(memcmp(zero, out, sizeof out) == 0); /* stream 0 is td_rng's */
}

static void hex_of(const uint8_t d[32], char out[65]) {
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

/* FIPS 180-4's examples, a message fed in uneven pieces, and a parameter digest. */
static void sha256_matches_the_published_vectors(void) {
    uint8_t d[32];
    char hex[65];
    td_sha256("abc", 3, d);
    hex_of(d, hex);
    CHECK(!strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
    td_sha256("", 0, d);
    hex_of(d, hex);
    CHECK(!strcmp(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"; /* 56 bytes */
    td_sha256(two, strlen(two), d);
    hex_of(d, hex);
    CHECK(!strcmp(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
    /* A million 'a', in pieces of 1, 63, 64, 65 and 1000 bytes. */
    static char a[1000];
    memset(a, 'a', sizeof a);
    td_sha256_ctx ctx;
    td_sha256_init(&ctx);
    size_t pieces[] = {1, 63, 64, 65, 1000}, left = 1000000;
    for (size_t k = 0; left; k++) {
        size_t n = pieces[k % 5] < left ? pieces[k % 5] : left;
        td_sha256_update(&ctx, a, n);
        left -= n;
    }
    td_sha256_final(&ctx, d);
    hex_of(d, hex);
    CHECK(!strcmp(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"));
    /* The parameters' digest is the digest of their bytes, in order. */
    float w[2] = {1.0f, -2.0f}, b[1] = {0.5f};
    td_param ps[2] = {{.name = "w", .data = w, .count = 2, .dtype = TD_F32},
                      {.name = "b", .data = b, .count = 1, .dtype = TD_F32}};
    float all[3] = {1.0f, -2.0f, 0.5f};
    td_sha256(all, sizeof all, d);
    hex_of(d, hex);
    char digest[65];
    td_params_sha256(ps, 2, digest);
    CHECK(!strcmp(hex, digest));
    b[0] = 0.25f;
    td_params_sha256(ps, 2, digest);
    CHECK(strcmp(hex, digest) != 0);
}

static void rng_is_reproducible_and_uniform(void) {
    td_rng a, b;
    td_rng_init(&a, 42);
    td_rng_init(&b, 42);
    double sum = 0;
    for (int i = 0; i < 100000; i++) {
        float x = td_rng_uniform(&a);
        CHECK(x >= 0.0f && x < 1.0f);
        sum += x;
        if (x != td_rng_uniform(&b)) {
            CHECK(!"streams diverged");
            break;
        }
    }
    CHECK_NEAR(sum / 100000, 0.5, 0.01);
    td_rng c = a; /* copying the state continues the same stream */
    CHECK_EQ(td_rng_u32(&c), td_rng_u32(&a));
    int counts[7] = {0};
    for (int i = 0; i < 70000; i++) counts[td_rng_below(&a, 7)]++;
    for (int i = 0; i < 7; i++) CHECK_NEAR(counts[i], 10000, 500);
}

/* td__pairwise_sum adds L buffers in the aligned pairwise tree: node (l, i) = node (l-1, 2i) +
 * node (l-1, 2i+1), the earlier buffer on the left. */
static void pairwise_sum_is_the_aligned_tree(void) {
    enum { L = 8, N = 37 };
    float data[L][N], *x[L];
    td_rng g;
    td_rng_init(&g, 3);
    for (int l = 0; l < L; l++) {
        x[l] = data[l];
        for (int i = 0; i < N; i++) data[l][i] = td_rng_normal(&g) * ldexpf(1, (int)(i % 17) - 8);
    }
    float want[N];
    for (int i = 0; i < N; i++) {
        float d[L];
        for (int l = 0; l < L; l++) d[l] = data[l][i];
        want[i] = ((d[0] + d[1]) + (d[2] + d[3])) + ((d[4] + d[5]) + (d[6] + d[7]));
    }
    td__pairwise_sum(x, L, N);
    CHECK(memcmp(data[0], want, sizeof want) == 0);
}

/* Two accumulators added word by word, as td_comm's I64 SUM adds them across ranks. */
static void sumsq_add(td__sumsq *a, const td__sumsq *b) {
    for (int i = 0; i < TD__SUMSQ_WORDS; i++) a->d[i] += b->d[i];
    td__sumsq_normalize(a);
}

/* The exact sum of squares: the same bits for any split of the values (subnormals to 2^100
 * included), the exact value where a double sum loses it, and NaN and infinity kept. */
static void sum_of_squares_is_exact_and_split_free(void) {
    enum { N = 100000 };
    float *v = malloc(N * sizeof *v);
    td_rng g;
    td_rng_init(&g, 11);
    for (int i = 0; i < N; i++)
        v[i] = td_rng_normal(&g) * ldexpf(1, (int)(td_rng_u32(&g) % 240) - 140);
    v[5] = 1e-45f; /* the smallest subnormal */
    td__sumsq whole, part;
    td__sumsq_init(&whole);
    td__sumsq_add_f32(&whole, v, N);
    size_t cuts[] = {0, 1, 777, 65536, 70000, N};
    td__sumsq sum;
    td__sumsq_init(&sum);
    for (int k = 5; k > 0; k--) { /* the parts in reverse, as another rank order would */
        td__sumsq_init(&part);
        td__sumsq_add_f32(&part, v + cuts[k - 1], cuts[k] - cuts[k - 1]);
        sumsq_add(&sum, &part);
    }
    double a = td__sumsq_value(&whole), b = td__sumsq_value(&sum);
    CHECK(memcmp(&a, &b, sizeof a) == 0);
    long double ref = 0;
    for (int i = 0; i < N; i++) ref += (long double)v[i] * v[i];
    CHECK(fabsl((long double)a - ref) <= 1e-15L * ref);
    /* 2^54 + 4 ones: a double adding in turn keeps 2^54 */
    float big[5] = {ldexpf(1, 27), 1, 1, 1, 1};
    td__sumsq_init(&whole);
    td__sumsq_add_f32(&whole, big, 5);
    CHECK(td__sumsq_value(&whole) == ldexp(1, 54) + 4);
    double naive = 0;
    for (int i = 0; i < 5; i++) naive += (double)big[i] * big[i];
    CHECK(naive != ldexp(1, 54) + 4);
    big[2] = INFINITY;
    td__sumsq_init(&whole);
    td__sumsq_add_f32(&whole, big, 5);
    CHECK(isinf(td__sumsq_value(&whole)));
    big[3] = NAN;
    td__sumsq_add_f32(&whole, big, 5);
    CHECK(isnan(td__sumsq_value(&whole)));
    free(v);
}

int main(void) {
    RUN(status_strings_are_distinct);
    RUN(last_error_keeps_the_message);
    RUN(bf16_and_f16_round_trip);
    RUN(bulk_conversions_match_the_scalar_rules);
    RUN(arena_aligns_reuses_and_tracks_peak);
    RUN(philox_matches_the_published_vectors);
    RUN(rng_is_reproducible_and_uniform);
    RUN(sha256_matches_the_published_vectors);
    RUN(pairwise_sum_is_the_aligned_tree);
    RUN(sum_of_squares_is_exact_and_split_free);
    TEST_END();
}
