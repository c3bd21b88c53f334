/* The two views SimCLR compares, made on the CPU as a batch is assembled. The encoder pools
 * globally, so shifts and flips alone change little of what it sees: the views also differ in
 * scale (the crop is resized), contrast and brightness, and an erased patch, as SimCLR's crop
 * and colour distortion make its views differ. The random stream of a view starts at a counter
 * derived from (epoch, index, view), so it does not depend on which rank builds it or when. */
#include <math.h>

#include "contrastive.h"

#define PAD 4              /* the crop may reach 4 pixels past each edge (black there) */
#define MIN_AREA 0.35f     /* the crop covers 35% to 100% of the padded image's area ... */
#define MAX_ASPECT 1.3333f /* ... with an aspect ratio between 3/4 and 4/3 */
#define CONTRAST 0.4f      /* pixel values scaled by 1 +- 0.4 ... */
#define BRIGHTNESS 0.3f    /* ... and shifted by +- 0.3 (on the 0..1 scale) */
#define ERASE_P 0.5f       /* half the views lose a black rectangle ... */
#define ERASE_MAX 0.2f     /* ... of up to a fifth of the image */
#define NOISE_STD 0.1f     /* Gaussian noise, in the dataset's normalised units */
#define VIEW_DRAWS 4096    /* 32-bit draws a view may use: the stride between views' streams */
#define NOISE_FROM 64      /* the noise's draws start here, after the geometry's */

static float uniform(td_rng *rng, float lo, float hi) {
    return lo + (hi - lo) * td_rng_uniform(rng);
}

/* n normal values from the Philox blocks of stream `seed` from draw `offset` on: each block's
 * four words give two (Box-Muller's cosine and sine), a quarter of td_rng_normal's blocks. */
static void normals(float *out, int n, uint64_t seed, uint64_t offset) {
    for (int i = 0; i < n; i += 2) {
        uint32_t w[4];
        td_philox4x32(seed, offset / 4 + (uint64_t)(i / 2), w);
        float u1 = ((float)(w[0] >> 8) + 1.0f) * (1.0f / 16777217.0f); /* (0, 1] */
        float u2 = (float)(w[1] >> 8) * (1.0f / 16777216.0f);
        float r = sqrtf(-2.0f * logf(u1)), a = 6.28318530717958647692f * u2;
        out[i] = r * cosf(a);
        if (i + 1 < n) out[i + 1] = r * sinf(a);
    }
}

/* The image at (y, x) of the padded plane, bilinear, black outside the image. */
static float sample(const float *image, float y, float x, float black) {
    int y0 = (int)floorf(y), x0 = (int)floorf(x);
    float fy = y - (float)y0, fx = x - (float)x0, v = 0;
    for (int dy = 0; dy < 2; dy++)
        for (int dx = 0; dx < 2; dx++) {
            int yy = y0 + dy, xx = x0 + dx;
            float p = yy >= 0 && yy < IMAGE_SIDE && xx >= 0 && xx < IMAGE_SIDE
                          ? image[yy * IMAGE_SIDE + xx]
                          : black;
            v += p * (dy ? fy : 1 - fy) * (dx ? fx : 1 - fx);
        }
    return v;
}

void augment_view(float *out, const float *image, uint64_t seed, uint64_t epoch, uint64_t index,
                  int view) {
    /* Datasets of up to 2^20 images: no two (epoch, index, view) share a stream. */
    uint64_t stream = ((epoch << 20) + index) * 2 + (uint64_t)view;
    td_rng rng = {.seed = seed, .offset = stream * VIEW_DRAWS};
    /* Padding is black: a zero pixel after the dataset's normalisation. */
    const float mean = TD_FASHION_MNIST_MEAN, std = TD_FASHION_MNIST_STD, black = -mean / std;
    const float side = IMAGE_SIDE + 2 * PAD;
    float area = uniform(&rng, MIN_AREA, 1) * side * side;
    float aspect = expf(uniform(&rng, -logf(MAX_ASPECT), logf(MAX_ASPECT)));
    float h = fminf(sqrtf(area / aspect), side), w = fminf(sqrtf(area * aspect), side);
    float top = uniform(&rng, 0, side - h) - PAD, left = uniform(&rng, 0, side - w) - PAD;
    int flip = td_rng_below(&rng, 2) == 1;
    float contrast = uniform(&rng, 1 - CONTRAST, 1 + CONTRAST);
    float brightness = uniform(&rng, -BRIGHTNESS, BRIGHTNESS);
    int erase = td_rng_uniform(&rng) < ERASE_P;
    float ea = uniform(&rng, 0.02f, ERASE_MAX) * IMAGE_PIXELS, ear = uniform(&rng, 0.5f, 2);
    int eh = (int)fminf(sqrtf(ea / ear), IMAGE_SIDE), ew = (int)fminf(sqrtf(ea * ear), IMAGE_SIDE);
    int et = (int)td_rng_below(&rng, (uint32_t)(IMAGE_SIDE - eh + 1));
    int el = (int)td_rng_below(&rng, (uint32_t)(IMAGE_SIDE - ew + 1));
    float noise[IMAGE_PIXELS];
    normals(noise, IMAGE_PIXELS, seed, stream * VIEW_DRAWS + NOISE_FROM);
    for (int i = 0; i < IMAGE_SIDE; i++)
        for (int j = 0; j < IMAGE_SIDE; j++) {
            int jj = flip ? IMAGE_SIDE - 1 - j : j;
            float y = top + ((float)i + 0.5f) * h / IMAGE_SIDE - 0.5f;
            float x = left + ((float)jj + 0.5f) * w / IMAGE_SIDE - 0.5f;
            float raw = sample(image, y, x, black) * std + mean; /* back to 0..1 */
            raw = fminf(fmaxf(raw * contrast + brightness, 0), 1);
            if (erase && i >= et && i < et + eh && j >= el && j < el + ew) raw = 0;
            out[i * IMAGE_SIDE + j] = (raw - mean) / std + NOISE_STD * noise[i * IMAGE_SIDE + j];
        }
}
