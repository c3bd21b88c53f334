/* DistributedSampler: which dataset indices each rank visits in an epoch, with the rules of
 * torch.utils.data.DistributedSampler (seed + epoch permutation, pad by repeating from the
 * start or truncate, rank r takes indices[r::world]), or sharded by global batch (each batch
 * of B consecutive permuted samples cut into per-rank slices as even as possible).
 *
 * The permutation comes from td_rng (Fisher-Yates), so it cannot equal torch's; every rank
 * computes the same one without communicating. */
#include <stdlib.h>

#include "tandem/data.h"

#include "core/core_impl.h"

struct td_sampler {
    td_sampler_params p;
    size_t n;           /* dataset size */
    size_t num_samples; /* per rank */
    size_t total_size;  /* rank-strided: num_samples * world_size */
    size_t batches;     /* sharded: global batches per epoch */
    size_t *perm;       /* (n) scratch for the permutation */
    size_t *indices;    /* (num_samples) this rank's share */
    uint64_t epoch;
};

td_sampler_params td_sampler_default_params(void) {
    td_sampler_params p = {
        .rank = 0, .world_size = 1, .shuffle = 1, .seed = 0, .drop_last = 0, .global_batch = 0};
    return p;
}

void td_split_even(size_t total, int world, int rank, size_t *offset, size_t *count) {
    size_t w = (size_t)world, r = (size_t)rank, base = total / w, extra = total % w;
    *count = base + (r < extra);
    *offset = r * base + (r < extra ? r : extra);
}

td_status td_sampler_create(td_sampler **out, size_t n, const td_sampler_params *params) {
    if (!out || !params)
        return td__fail(TD_EINVAL, "td_sampler_create: out and params must not be NULL");
    *out = NULL;
    if (params->world_size < 1)
        return td__fail(TD_EINVAL, "td_sampler_create: world_size %d, expected >= 1",
                        params->world_size);
    if (params->rank < 0 || params->rank >= params->world_size)
        return td__fail(TD_EINVAL, "td_sampler_create: rank %d, expected 0..%d", params->rank,
                        params->world_size - 1);
    if (n == 0) return td__fail(TD_EINVAL, "td_sampler_create: the dataset is empty");
    if (n > UINT32_MAX)
        return td__fail(TD_EINVAL, "td_sampler_create: %zu samples, at most 2^32-1 supported", n);
    size_t world = (size_t)params->world_size, B = params->global_batch;
    /* An epoch of nothing would let a training loop run zero steps without a word. */
    if (params->drop_last && B && n < B)
        return td__fail(TD_EINVAL,
                        "td_sampler_create: %zu samples make no global batch of %zu and "
                        "drop_last drops the short one: an epoch would have no batch",
                        n, B);
    if (params->drop_last && !B && n < world)
        return td__fail(TD_EINVAL,
                        "td_sampler_create: %zu samples for %zu ranks and drop_last drops the "
                        "uneven tail: every rank would get none",
                        n, world);
    td_sampler *s = calloc(1, sizeof *s);
    if (!s) return td__fail(TD_ENOMEM, "td_sampler_create: out of memory");
    s->p = *params;
    s->n = n;
    if (B) {
        s->batches = params->drop_last ? n / B : (n + B - 1) / B;
        size_t full = params->drop_last || n % B == 0 ? s->batches : s->batches - 1, off, cnt;
        td_split_even(B, params->world_size, params->rank, &off, &cnt);
        s->num_samples = full * cnt;
        if (full < s->batches) {
            td_split_even(n % B, params->world_size, params->rank, &off, &cnt);
            s->num_samples += cnt;
        }
    } else if (params->drop_last && n % world != 0) {
        /* torch: ceil((N - world) / world) when dropping an uneven tail, else ceil(N / world). */
        s->num_samples = n < world ? 0 : (n - world + world - 1) / world;
    } else {
        s->num_samples = (n + world - 1) / world;
    }
    s->total_size = s->num_samples * world;
    s->perm = malloc(n * sizeof *s->perm);
    s->indices = malloc((s->num_samples ? s->num_samples : 1) * sizeof *s->indices);
    if (!s->perm || !s->indices) {
        td_sampler_destroy(s);
        return td__fail(TD_ENOMEM, "td_sampler_create: cannot allocate %zu indices", n);
    }
    td_sampler_set_epoch(s, 0);
    *out = s;
    return TD_OK;
}

void td_sampler_destroy(td_sampler *s) {
    if (!s) return;
    free(s->perm);
    free(s->indices);
    free(s);
}

void td_sampler_set_epoch(td_sampler *s, uint64_t epoch) {
    if (!s) return;
    s->epoch = epoch;
    size_t n = s->n;
    for (size_t i = 0; i < n; i++) s->perm[i] = i;
    if (s->p.shuffle) {
        td_rng rng;
        td_rng_init(&rng, s->p.seed + epoch);
        for (size_t i = n - 1; i > 0; i--) {
            size_t j = td_rng_below(&rng, (uint32_t)(i + 1));
            size_t t = s->perm[i];
            s->perm[i] = s->perm[j];
            s->perm[j] = t;
        }
    }
    if (s->p.global_batch) {
        size_t at = 0, first, count;
        for (size_t k = 0; k < s->batches; k++) {
            size_t base = k * s->p.global_batch,
                   len = n - base < s->p.global_batch ? n - base : s->p.global_batch;
            td_split_even(len, s->p.world_size, s->p.rank, &first, &count);
            for (size_t i = 0; i < count; i++) s->indices[at++] = s->perm[base + first + i];
        }
        return;
    }
    /* Position k of the padded list is perm[k mod n]: torch repeats the list from its start
     * (as often as needed) up to total_size, or truncates to it. */
    size_t world = (size_t)s->p.world_size, rank = (size_t)s->p.rank;
    for (size_t i = 0; i < s->num_samples; i++) s->indices[i] = s->perm[(rank + i * world) % n];
}

size_t td_sampler_size(const td_sampler *s) { return s ? s->num_samples : 0; }
const size_t *td_sampler_indices(const td_sampler *s) { return s ? s->indices : NULL; }
size_t td_sampler_batches(const td_sampler *s) { return s ? s->batches : 0; }

void td_sampler_batch(const td_sampler *s, size_t k, size_t *first, size_t *count) {
    *first = *count = 0;
    if (!s || !s->p.global_batch || k >= s->batches) return;
    size_t B = s->p.global_batch, off, cnt;
    td_split_even(B, s->p.world_size, s->p.rank, &off, &cnt);
    *first = k * cnt;
    *count = cnt;
    if (k + 1 == s->batches && s->n % B && !s->p.drop_last)
        td_split_even(s->n % B, s->p.world_size, s->p.rank, &off, count);
}
