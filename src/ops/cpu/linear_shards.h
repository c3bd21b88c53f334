/* A linear layer's weight and bias gradients summed over the shards of a deterministic step
 * (linear_shards.c), for the CPU backend's linear kernels. Not installed. */
#ifndef TANDEM_LINEAR_SHARDS_H
#define TANDEM_LINEAR_SHARDS_H

#include <stddef.h>
#include <stdint.h>

/* Floats one shard of n samples takes in the packed layout below (a multiple of 16: shards packed
 * one after another in 64-byte aligned memory stay aligned). */
size_t td__linear_shard_floats(int64_t n, int64_t in, int64_t out);

/* Packs one shard's x (n, in) and dy (n, out), row-major, into `packed` (64-byte aligned,
 * td__linear_shard_floats of them): the layout td__linear_shard_grads reads. */
void td__linear_shard_pack(float *packed, const float *x, const float *dy, int64_t n, int64_t in,
                           int64_t out);

/* dw (out, in) and db (out; NULL: none) = the sum over `count` shards, in deterministic mode's
 * pairwise tree, of shard s's dy^T x and of its dy's rows, from packed[s]; each shard's sums run
 * over its n samples in order, one fused multiply-add (one addition for db) each; then times
 * by_w and by_b (one multiplication, none for 1). Returns 0, or -1 when out of memory. */
int td__linear_shard_grads(float *dw, float *db, const float *const *packed, size_t count,
                           int64_t n, int64_t in, int64_t out, float by_w, float by_b);

#endif
