/* Base layer: status strings, last-error messages, dtype conversions, arena, RNG. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

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

int main(void) {
    RUN(status_strings_are_distinct);
    RUN(last_error_keeps_the_message);
    RUN(bf16_and_f16_round_trip);
    RUN(bulk_conversions_match_the_scalar_rules);
    RUN(arena_aligns_reuses_and_tracks_peak);
    RUN(philox_matches_the_published_vectors);
    RUN(rng_is_reproducible_and_uniform);
    TEST_END();
}
