/* In-memory datasets of fixed-size float samples with int64 labels, and the Fashion-MNIST
 * loader that builds one from the four IDX files.
 *
 * It does not stream from disk or transform samples; a dataset is immutable once filled,
 * which is what lets the loader's prefetch thread read it without locks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/data.h"

#include "core/core_impl.h"

struct td_dataset {
    size_t n;
    int ndim;
    int64_t shape[TD_MAX_DIMS];
    size_t numel; /* floats per sample */
    float *x;     /* (n, shape...) */
    int64_t *y;   /* (n) */
};

td_status td_dataset_create(td_dataset **out, size_t n, int sample_ndim,
                            const int64_t *sample_shape) {
    if (!out) return td__fail(TD_EINVAL, "td_dataset_create: out must not be NULL");
    *out = NULL;
    if (sample_ndim < 0 || sample_ndim > TD_MAX_DIMS - 1)
        return td__fail(TD_EINVAL, "td_dataset_create: sample_ndim %d, expected 0..%d", sample_ndim,
                        TD_MAX_DIMS - 1);
    if (sample_ndim > 0 && !sample_shape)
        return td__fail(TD_EINVAL, "td_dataset_create: sample_shape is NULL for %d dims",
                        sample_ndim);
    size_t numel = 1;
    for (int i = 0; i < sample_ndim; i++) {
        if (sample_shape[i] <= 0)
            return td__fail(TD_EINVAL, "td_dataset_create: sample_shape[%d] = %lld, expected > 0",
                            i, (long long)sample_shape[i]);
        numel *= (size_t)sample_shape[i];
    }
    if (n > 0 && numel > SIZE_MAX / sizeof(float) / n)
        return td__fail(TD_EINVAL, "td_dataset_create: %zu samples of %zu floats overflow", n,
                        numel);
    td_dataset *d = calloc(1, sizeof *d);
    if (!d) return td__fail(TD_ENOMEM, "td_dataset_create: out of memory");
    d->n = n;
    d->ndim = sample_ndim;
    for (int i = 0; i < sample_ndim; i++) d->shape[i] = sample_shape[i];
    d->numel = numel;
    d->x = calloc(n * numel > 0 ? n * numel : 1, sizeof(float));
    d->y = calloc(n ? n : 1, sizeof(int64_t));
    if (!d->x || !d->y) {
        td_dataset_destroy(d);
        return td__fail(TD_ENOMEM, "td_dataset_create: cannot allocate %zu samples of %zu floats",
                        n, numel);
    }
    *out = d;
    return TD_OK;
}

void td_dataset_destroy(td_dataset *d) {
    if (!d) return;
    free(d->x);
    free(d->y);
    free(d);
}

size_t td_dataset_size(const td_dataset *d) { return d ? d->n : 0; }
size_t td_dataset_sample_numel(const td_dataset *d) { return d ? d->numel : 0; }
float *td_dataset_x(td_dataset *d) { return d ? d->x : NULL; }
int64_t *td_dataset_y(td_dataset *d) { return d ? d->y : NULL; }

int td_dataset_sample_shape(const td_dataset *d, int64_t shape[TD_MAX_DIMS]) {
    if (!d) return 0;
    for (int i = 0; i < d->ndim; i++) shape[i] = d->shape[i];
    return d->ndim;
}

static char *join_path(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

td_status td_dataset_load_fashion_mnist(td_dataset **out, const char *dir, td_split split) {
    if (!out) return td__fail(TD_EINVAL, "td_dataset_load_fashion_mnist: out must not be NULL");
    *out = NULL;
    if (split != TD_SPLIT_TRAIN && split != TD_SPLIT_TEST)
        return td__fail(TD_EINVAL,
                        "td_dataset_load_fashion_mnist: split %d is neither train nor test",
                        (int)split);
    if (!dir) dir = getenv("TD_FASHION_MNIST_DIR");
    if (!dir || !*dir) dir = "/usr/share/datasets/fashion-mnist";
    const char *prefix = split == TD_SPLIT_TRAIN ? "train" : "t10k";
    char name[64];
    td_idx images = {0}, labels = {0};
    td_dataset *d = NULL;
    td_status st;
    snprintf(name, sizeof name, "%s-images-idx3-ubyte.gz", prefix);
    char *ipath = join_path(dir, name);
    snprintf(name, sizeof name, "%s-labels-idx1-ubyte.gz", prefix);
    char *lpath = join_path(dir, name);
    if (!ipath || !lpath) {
        st = td__fail(TD_ENOMEM, "td_dataset_load_fashion_mnist: out of memory");
        goto done;
    }
    if ((st = td_idx_read(ipath, &images)) != TD_OK) goto done;
    if ((st = td_idx_read(lpath, &labels)) != TD_OK) goto done;
    if (images.dtype != TD_U8 || images.ndim != 3 || images.dims[1] != 28 || images.dims[2] != 28) {
        st = td__fail(
            TD_EFORMAT,
            "%s: expected u8 images of shape (N, 28, 28), got %s with %d dims (%lld, %lld, ...)",
            ipath, td_dtype_name(images.dtype), images.ndim, (long long)images.dims[0],
            (long long)(images.ndim > 1 ? images.dims[1] : 0));
        goto done;
    }
    if (labels.dtype != TD_U8 || labels.ndim != 1) {
        st = td__fail(TD_EFORMAT, "%s: expected u8 labels of shape (N), got %s with %d dims", lpath,
                      td_dtype_name(labels.dtype), labels.ndim);
        goto done;
    }
    if (labels.dims[0] != images.dims[0]) {
        st = td__fail(TD_EFORMAT, "%s has %lld images but %s has %lld labels", ipath,
                      (long long)images.dims[0], lpath, (long long)labels.dims[0]);
        goto done;
    }
    const int64_t shape[3] = {1, 28, 28};
    size_t n = (size_t)images.dims[0];
    if ((st = td_dataset_create(&d, n, 3, shape)) != TD_OK) goto done;
    const uint8_t *px = images.data, *lb = labels.data;
    /* Divisions, not reciprocal multiplies, so values equal torchvision's ToTensor + Normalize. */
    for (size_t i = 0; i < n * 784; i++)
        d->x[i] = ((float)px[i] / 255.0f - TD_FASHION_MNIST_MEAN) / TD_FASHION_MNIST_STD;
    for (size_t i = 0; i < n; i++) {
        if (lb[i] > 9) {
            st = td__fail(TD_EFORMAT, "%s: label %zu is %u, expected 0..9", lpath, i, lb[i]);
            goto done;
        }
        d->y[i] = lb[i];
    }
    *out = d;
    d = NULL;
done:
    td_dataset_destroy(d);
    td_idx_free(&images);
    td_idx_free(&labels);
    free(ipath);
    free(lpath);
    return st;
}
