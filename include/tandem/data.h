/* Training data: IDX files (MNIST / Fashion-MNIST, gzip or plain), in-memory datasets of
 * fixed-size samples, a DistributedSampler with PyTorch's semantics, and a batch loader
 * with a prefetch thread.
 *
 * Everything here lives in host memory; there are no transforms or augmentation, and a
 * dataset must fit in RAM. */
#ifndef TANDEM_DATA_H
#define TANDEM_DATA_H

#include <stdint.h>

#include "tandem/core.h"
#include "tandem/device.h"
#include "tandem/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- IDX files ---------------------------------------------------------------------- */

/* The contents of one IDX file, converted to host byte order. Owned by the caller: free
 * it with td_idx_free. */
typedef struct {
    td_dtype dtype; /* TD_U8, TD_I32, TD_F32 or TD_F64 */
    int ndim;       /* 1..TD_MAX_DIMS */
    int64_t dims[TD_MAX_DIMS];
    size_t count; /* product of dims */
    void *data;   /* (dims...) elements of dtype */
} td_idx;

/* Reads a gzip-compressed or uncompressed IDX file, checking magic, dtype, dims, the data
 * length and, for gzip, the whole trailer (zlib checks its CRC-32 and length): a bad file, one
 * cut anywhere included, is TD_EFORMAT with a message naming it. */
td_status td_idx_read(const char *path, td_idx *out);

/* Frees what td_idx_read allocated and zeroes the struct; NULL-safe. */
void td_idx_free(td_idx *idx);

/* ---- Datasets ----------------------------------------------------------------------- */

/* N samples, each a float tensor of a fixed sample_shape plus an int64 label. */
typedef struct td_dataset td_dataset;

/* Creates a dataset of n zeroed samples of the given shape; fill it via td_dataset_x/_y. */
td_status td_dataset_create(td_dataset **out, size_t n, int sample_ndim,
                            const int64_t *sample_shape);

/* Which half of a dataset with a train/test split to load. */
typedef enum { TD_SPLIT_TRAIN = 0, TD_SPLIT_TEST = 1 } td_split;

/* Fashion-MNIST mean and standard deviation of the training pixels scaled to [0, 1]. */
#define TD_FASHION_MNIST_MEAN 0.2860f
#define TD_FASHION_MNIST_STD 0.3530f

/* Loads Fashion-MNIST (or MNIST files with the same names) as images (N, 1, 28, 28)
 * normalised by (x / 255 - mean) / std and labels (N). dir NULL means $TD_FASHION_MNIST_DIR,
 * else /usr/share/datasets/fashion-mnist. */
td_status td_dataset_load_fashion_mnist(td_dataset **out, const char *dir, td_split split);

/* Frees the dataset; NULL-safe. */
void td_dataset_destroy(td_dataset *dataset);

/* Number of samples N. */
size_t td_dataset_size(const td_dataset *dataset);

/* Floats per sample (product of the sample shape). */
size_t td_dataset_sample_numel(const td_dataset *dataset);

/* Copies the sample shape into shape[] and returns its number of dims. */
int td_dataset_sample_shape(const td_dataset *dataset, int64_t shape[TD_MAX_DIMS]);

/* The samples, (N, sample_shape...), owned by the dataset. */
float *td_dataset_x(td_dataset *dataset);

/* The labels, (N), owned by the dataset. */
int64_t *td_dataset_y(td_dataset *dataset);

/* ---- Text ------------------------------------------------------------------------- */

/* A text as bytes: byte-level tokens, vocabulary 256. Owned by the caller: free with
 * td_corpus_free. */
typedef struct {
    uint8_t *bytes; /* (size) */
    size_t size;
} td_corpus;

/* Where Debian's r-cran-janeaustenr keeps Jane Austen's six novels (an R lazy-load database). */
const char *td_corpus_default_path(void);

/* The most bytes a text may have (1 GiB): every rank reads the whole text into its own memory
 * before training, so a host of 8 ranks holds it 8 times; a larger corpus wants a tokenized,
 * memory-mapped file, which td_corpus is not. */
#define TD_CORPUS_MAX_BYTES ((size_t)1 << 30)

/* Reads a text: a path ending in ".rdb" is an R lazy-load database whose character vectors are
 * joined line by line (the janeaustenr package's novels, read without R); anything else is
 * taken as plain bytes. A missing file is TD_EIO naming the package that ships the novels; a
 * directory, FIFO or device is TD_EINVAL saying what it is, and a text over
 * TD_CORPUS_MAX_BYTES (the file, or the novels it unpacks to) is TD_EINVAL saying the bound. */
td_status td_corpus_load(td_corpus *out, const char *path);

/* Frees the bytes and zeroes the struct; NULL-safe. */
void td_corpus_free(td_corpus *corpus);

/* Non-overlapping windows of T + 1 bytes that `size` bytes hold: window k is bytes
 * [k T, k T + T + 1), the T inputs and the T next bytes they predict. A sampler over
 * td_corpus_windows(size, T) indices gives a language model's batches. */
size_t td_corpus_windows(size_t size, int64_t T);

/* Window k of `text`: x[t] = text[k T + t] (as f32 token ids) and y[t] = text[k T + t + 1]
 * (either may be NULL). */
void td_corpus_window(const uint8_t *text, size_t k, int64_t T, float *x, int64_t *y);

/* ---- DistributedSampler ------------------------------------------------------------- */

/* Options of a sampler; fill with td_sampler_default_params. Two ways to share an epoch:
 * global_batch 0 is torch's DistributedSampler (rank r takes every world_size-th index of the
 * permutation, padded or truncated to an equal share); global_batch B > 0 shards each global
 * batch instead: batch k is the permutation's samples [kB, kB + B), cut into one contiguous
 * slice per rank as even as possible (td_split_even: 128 over 3 ranks is 43, 43, 42), so the
 * order depends on the seed, the epoch and B only, and any world size sees the same batches. */
typedef struct {
    int rank;            /* 0..world_size-1 */
    int world_size;      /* number of replicas, >= 1 */
    int shuffle;         /* permute with seed + epoch */
    uint64_t seed;       /* the same on every rank */
    int drop_last;       /* 0: pad (rank-strided) or keep a short last batch (sharded);
                            1: truncate to floor(N / world) * world, or drop the short batch */
    size_t global_batch; /* 0: rank-strided; B: sharded global batches of B samples */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_sampler_params;

/* rank 0 of 1, shuffle on, seed 0, drop_last off, rank-strided. */
td_sampler_params td_sampler_default_params(void);

/* Splits range(N) among ranks as torch.utils.data.DistributedSampler does, or by global batch. */
typedef struct td_sampler td_sampler;

/* Rank `rank`'s part of `total` items split among `world` ranks as evenly as it goes: the first
 * total % world ranks get one more; *offset is where its part starts. */
void td_split_even(size_t total, int world, int rank, size_t *offset, size_t *count);

/* Creates a sampler over n samples, set to epoch 0. TD_EINVAL when drop_last would leave an
 * epoch with no batch (fewer samples than one global batch, or than ranks). */
td_status td_sampler_create(td_sampler **out, size_t n, const td_sampler_params *params);

/* Frees the sampler; NULL-safe. */
void td_sampler_destroy(td_sampler *sampler);

/* Recomputes this rank's indices for `epoch` (the permutation uses seed + epoch). */
void td_sampler_set_epoch(td_sampler *sampler, uint64_t epoch);

/* Indices this rank gets per epoch (the same on every rank). */
size_t td_sampler_size(const td_sampler *sampler);

/* This rank's indices for the current epoch, (td_sampler_size), owned by the sampler. */
const size_t *td_sampler_indices(const td_sampler *sampler);

/* Sharded samplers (global_batch > 0): global batches per epoch, and where batch k's slice for
 * this rank lies in td_sampler_indices (count may be 0 for a short last batch). */
size_t td_sampler_batches(const td_sampler *sampler);
void td_sampler_batch(const td_sampler *sampler, size_t k, size_t *first, size_t *count);

/* ---- Batch loader ------------------------------------------------------------------- */

/* Options of a loader; fill with td_loader_default_params. */
typedef struct {
    size_t batch_size;         /* samples per batch, >= 1; with a sharding sampler
                                  (sampler.global_batch > 0) each batch is this rank's slice of
                                  a global batch instead, and this field is ignored */
    int drop_last;             /* drop the final partial batch instead of yielding it short
                                  (sharded: the sampler's drop_last decides) */
    td_sampler_params sampler; /* which indices this rank gets, in which order */
    td_device device;          /* where batches are handed out (PyTorch's pin_memory plus
                                  non_blocking copies): on a GPU the prefetch thread fills
                                  page-locked host memory and uploads the batch on the GPU's
                                  copy stream while the caller trains on the one before; the
                                  batch's memory is then on the GPU, and work queued on its
                                  compute stream after td_loader_next sees it. The CPU by
                                  default */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_loader_params;

/* batch_size 64, no dropping, the sampler's defaults (rank 0 of 1, shuffled, seed 0), on the
 * CPU. */
td_loader_params td_loader_default_params(void);

/* One batch; its memory belongs to the loader and is valid until the next td_loader_next,
 * td_loader_set_epoch, td_loader_seek or td_loader_destroy. */
typedef struct {
    float *x;     /* (size, sample_shape...) */
    int64_t *y;   /* (size) */
    size_t size;  /* samples in this batch; 0 marks the end of the epoch */
    size_t index; /* batch number within the epoch */
    uint64_t epoch;
    td_device device; /* where x and y are (the loader's device) */
} td_batch;

/* Yields per-rank batches of a dataset, filling the next batch on a prefetch thread
 * while the caller trains on the current one. */
typedef struct td_loader td_loader;

/* Creates a loader positioned at batch 0 of epoch 0. The dataset must outlive it. TD_EINVAL
 * when drop_last would leave an epoch with no batch (the sampler's rules, or fewer samples on
 * this rank than batch_size). */
td_status td_loader_create(td_loader **out, const td_dataset *dataset,
                           const td_loader_params *params);

/* Stops the prefetch thread (also mid-epoch) and frees everything; NULL-safe. */
void td_loader_destroy(td_loader *loader);

/* Starts `epoch` from its first batch. */
td_status td_loader_set_epoch(td_loader *loader, uint64_t epoch);

/* Positions the loader at batch `batch` of `epoch`, so a resumed run sees exactly the
 * batches an uninterrupted one would have. */
td_status td_loader_seek(td_loader *loader, uint64_t epoch, size_t batch);

/* Batches per epoch on this rank (the same on every rank). */
size_t td_loader_batches_per_epoch(const td_loader *loader);

/* The next batch of the current epoch; at the end of the epoch it returns TD_OK with
 * batch->size == 0 until td_loader_set_epoch or td_loader_seek. */
td_status td_loader_next(td_loader *loader, td_batch *batch);

#ifdef __cplusplus
}
#endif
#endif
