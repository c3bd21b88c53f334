/* ZeRO's layout: which parameters form a unit, the flat buffers of each unit (one per dtype,
 * members back to back at 64-byte offsets, padded to a multiple of the world size), where each
 * flat lies in the group's regions, and the parts of parameters in this rank's chunks, which the
 * optimizer steps. It allocates no parameter or gradient memory and communicates nothing; the
 * same parameters and unit names give the same layout on every rank. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "parallel/zero_impl.h"

#define ZERO_ALIGN_BYTES 64

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Whether parameter `name` is called `unit` or lies under it ("<unit>."). */
static int under(const char *name, const char *unit) {
    size_t len = strlen(unit);
    return !strncmp(name, unit, len) && (name[len] == '\0' || name[len] == '.');
}

/* The length of the part of `name` before the first '.'. */
static size_t top_len(const char *name) {
    const char *dot = strchr(name, '.');
    return dot ? (size_t)(dot - name) : strlen(name);
}

/* starts[i] = 1 where a unit begins. */
static td_status unit_starts(const td_param *params, size_t n, const char *const *units,
                             size_t n_units, int rank, unsigned char *starts) {
    if (n) starts[0] = 1;
    if (!units) {
        for (size_t i = 1; i < n; i++) {
            size_t a = top_len(params[i - 1].name), b = top_len(params[i].name);
            starts[i] = a != b || strncmp(params[i - 1].name, params[i].name, a) != 0;
        }
        return TD_OK;
    }
    for (size_t k = 0; k < n_units; k++) {
        if (!units[k] || !units[k][0])
            return td__fail(TD_EINVAL, "zero rank %d: unit name %zu is empty", rank, k);
        size_t i = 0;
        while (i < n && !under(params[i].name, units[k])) i++;
        if (i == n)
            return td__fail(TD_ENOTFOUND,
                            "zero rank %d: unit '%s' begins at no parameter (none is called '%s' "
                            "or '%s.*'); the first parameter is '%s'",
                            rank, units[k], units[k], units[k], n ? params[0].name : "(none)");
        starts[i] = 1;
    }
    return TD_OK;
}

/* Appends unit u's flats: one per dtype, in the order the dtypes first appear. */
static td_status plan_flats(td__zero_layout *lay, const td_param *params, size_t u) {
    td__zero_unit *un = &lay->units[u];
    un->first_flat = lay->n_flats;
    size_t end = un->first_param + un->n_params;
    for (size_t i = un->first_param; i < end; i++) {
        int seen = 0;
        for (size_t j = un->first_param; j < i && !seen; j++)
            seen = params[j].dtype == params[i].dtype;
        if (seen) continue;
        td__zero_flat *f = &lay->flats[lay->n_flats++];
        f->dtype = params[i].dtype;
        f->unit = u;
        size_t es = td_dtype_size(f->dtype), align = ZERO_ALIGN_BYTES / es;
        for (size_t j = i; j < end; j++) f->n_members += params[j].dtype == f->dtype;
        f->members = malloc(f->n_members * sizeof *f->members);
        f->offset = malloc(f->n_members * sizeof *f->offset);
        if (!f->members || !f->offset)
            return td__fail(TD_ENOMEM, "zero rank %d: out of memory", lay->rank);
        size_t m = 0;
        for (size_t j = i; j < end; j++) {
            if (params[j].dtype != f->dtype) continue;
            f->count = round_up(f->count, align);
            f->members[m] = j;
            f->offset[m] = f->count;
            lay->flat_of[j] = lay->n_flats - 1;
            lay->member_of[j] = m++;
            f->count += params[j].count;
        }
        f->chunk = round_up((f->count + (size_t)lay->world - 1) / (size_t)lay->world, align);
        if (f->chunk == 0) f->chunk = align;
        f->at = lay->region_bytes;
        f->span = td__zero_pages(f->chunk * (size_t)lay->world * es);
        lay->region_bytes += f->span;
        un->n_flats++;
    }
    return TD_OK;
}

/* The parts of each flat's members inside this rank's chunk. */
static td_status plan_views(td__zero_layout *lay, const td_param *params) {
    size_t cap = 0;
    for (size_t f = 0; f < lay->n_flats; f++) cap += lay->flats[f].n_members;
    lay->views = calloc(cap ? cap : 1, sizeof *lay->views);
    if (!lay->views) return td__fail(TD_ENOMEM, "zero rank %d: out of memory", lay->rank);
    for (size_t f = 0; f < lay->n_flats; f++) {
        const td__zero_flat *fl = &lay->flats[f];
        size_t lo = (size_t)lay->rank * fl->chunk, hi = lo + fl->chunk;
        for (size_t m = 0; m < fl->n_members; m++) {
            size_t p = fl->members[m], a = fl->offset[m], b = a + params[p].count;
            size_t from = a > lo ? a : lo, to = b < hi ? b : hi;
            if (from >= to) continue;
            lay->views[lay->n_views++] = (td__zero_view){.param = p,
                                                         .param_offset = from - a,
                                                         .count = to - from,
                                                         .flat = f,
                                                         .flat_offset = from};
        }
    }
    return TD_OK;
}

td_status td__zero_plan(td__zero_layout *lay, const td_param *params, size_t n,
                        const char *const *units, size_t n_units, int rank, int world) {
    memset(lay, 0, sizeof *lay);
    lay->rank = rank;
    lay->world = world;
    for (size_t i = 0; i < n; i++)
        if (!params[i].name || !td__is_float(params[i].dtype))
            return td__fail(TD_EINVAL,
                            "zero rank %d: parameter %zu has no name or is not f32, "
                            "bf16 or f16",
                            rank, i);
    size_t m = n ? n : 1;
    unsigned char *starts = calloc(m, 1);
    lay->unit_of = calloc(m, sizeof *lay->unit_of);
    lay->flat_of = calloc(m, sizeof *lay->flat_of);
    lay->member_of = calloc(m, sizeof *lay->member_of);
    lay->units = calloc(m, sizeof *lay->units);
    lay->flats = calloc(m, sizeof *lay->flats); /* at most one flat per parameter */
    td_status s =
        starts && lay->unit_of && lay->flat_of && lay->member_of && lay->units && lay->flats
            ? TD_OK
            : td__fail(TD_ENOMEM, "zero rank %d: out of memory", rank);
    if (s == TD_OK) s = unit_starts(params, n, units, n_units, rank, starts);
    for (size_t i = 0; s == TD_OK && i < n; i++) {
        if (starts[i]) lay->units[lay->n_units++].first_param = i;
        lay->units[lay->n_units - 1].n_params++;
        lay->unit_of[i] = lay->n_units - 1;
    }
    for (size_t u = 0; s == TD_OK && u < lay->n_units; u++) s = plan_flats(lay, params, u);
    if (s == TD_OK) s = plan_views(lay, params);
    free(starts);
    return s;
}

void td__zero_layout_free(td__zero_layout *lay) {
    for (size_t f = 0; lay->flats && f < lay->n_flats; f++) {
        free(lay->flats[f].members);
        free(lay->flats[f].offset);
    }
    free(lay->flats);
    free(lay->units);
    free(lay->unit_of);
    free(lay->flat_of);
    free(lay->member_of);
    free(lay->views);
    memset(lay, 0, sizeof *lay);
}
