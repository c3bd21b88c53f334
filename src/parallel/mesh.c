/* The device mesh (tandem/mesh.h): named dimensions over one group, one sub-group per dimension
 * split once at creation (MPI_Cart_sub's groups, DeviceMesh's get_group). It checks that every
 * rank describes the same mesh before splitting, so a rank launched with other sizes is named
 * instead of hanging in a split the others never make. It moves no data. */
#include "tandem/mesh.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"

#define NAME_CAP 16

struct td_mesh {
    td_comm *comm; /* not owned */
    int ndims;
    char names[TD_MESH_MAX_DIMS][NAME_CAP];
    int sizes[TD_MESH_MAX_DIMS];
    int coords[TD_MESH_MAX_DIMS];
    td_comm *groups[TD_MESH_MAX_DIMS]; /* owned */
};

/* An environment variable's size: 1 when unset, 0 when not a whole number from 1. */
static int env_size(const char *name) {
    const char *v = getenv(name);
    if (!v || !*v) return 1;
    char *end;
    long n = strtol(v, &end, 10);
    return *end || n < 1 || n > 1 << 20 ? 0 : (int)n;
}

td_mesh_params td_mesh_default_params(void) {
    td_mesh_params p = {.ndims = 3, .names = {"pp", "dp", "tp"}};
    p.sizes[0] = env_size("TANDEM_PP");
    p.sizes[1] = -1;
    p.sizes[2] = env_size("TANDEM_TP");
    return p;
}

/* What every rank must say alike: the names and the sizes as given. */
typedef struct {
    int32_t ndims, sizes[TD_MESH_MAX_DIMS];
    char names[TD_MESH_MAX_DIMS][NAME_CAP];
} mesh_sig;

/* "pp 2 x dp -1 x tp 2" */
static void format_dims(const char (*names)[NAME_CAP], const int *sizes, int n, char *out,
                        size_t cap) {
    size_t at = 0;
    out[0] = 0;
    for (int i = 0; i < n && at < cap; i++)
        at += (size_t)snprintf(out + at, cap - at, "%s%s %d", i ? " x " : "", names[i], sizes[i]);
}

static void describe(const void *sig, const void *other, char *out, size_t cap, void *ctx) {
    (void)other, (void)ctx;
    const mesh_sig *s = sig;
    int sizes[TD_MESH_MAX_DIMS];
    for (int i = 0; i < s->ndims; i++) sizes[i] = s->sizes[i];
    format_dims(s->names, sizes, s->ndims, out, cap);
}

/* Checks p on this rank and resolves its -1 against the group's size into m. */
static td_status check(td_mesh *m, const td_mesh_params *p, int world) {
    if (p->ndims < 1 || p->ndims > TD_MESH_MAX_DIMS)
        return td__fail(TD_EINVAL, "mesh: %d dimensions (1 to %d)", p->ndims, TD_MESH_MAX_DIMS);
    m->ndims = p->ndims;
    int open = -1;
    long product = 1;
    for (int i = 0; i < p->ndims; i++) {
        const char *n = p->names[i];
        if (!n || !*n || strlen(n) >= NAME_CAP)
            return td__fail(TD_EINVAL, "mesh: dimension %d's name is %s (1 to %d characters)", i,
                            n ? (*n ? "too long" : "empty") : "NULL", NAME_CAP - 1);
        snprintf(m->names[i], NAME_CAP, "%s", n);
        for (int j = 0; j < i; j++)
            if (!strcmp(m->names[j], n))
                return td__fail(TD_EINVAL, "mesh: two dimensions are called '%s'", n);
        m->sizes[i] = p->sizes[i];
        if (p->sizes[i] == -1 && open < 0) {
            open = i;
            continue;
        }
        if (p->sizes[i] < 1) {
            const char *env = !strcmp(n, "tp")   ? " (TANDEM_TP, tandemrun --tp)"
                              : !strcmp(n, "pp") ? " (TANDEM_PP, tandemrun --pp)"
                                                 : "";
            return td__fail(TD_EINVAL,
                            "mesh: dimension '%s' has size %d%s; expected a whole number >= 1%s", n,
                            p->sizes[i], env, p->sizes[i] == -1 ? " (only one may be -1)" : "");
        }
        product *= p->sizes[i];
    }
    if (open >= 0) {
        if (product > world || world % product)
            return td__fail(TD_EINVAL,
                            "mesh: the other dimensions make %ld ranks, which does not divide the "
                            "group's %d into '%s'",
                            product, world, m->names[open]);
        m->sizes[open] = (int)(world / product);
        product = world;
    }
    if (product != world) {
        char dims[128];
        format_dims(m->names, m->sizes, m->ndims, dims, sizeof dims);
        return td__fail(TD_EINVAL, "mesh: %s is %ld ranks, but the group has %d", dims, product,
                        world);
    }
    return TD_OK;
}

td_status td_mesh_create(td_mesh **out, td_comm *comm, const td_mesh_params *p) {
    if (!out || !comm) return td__fail(TD_EINVAL, "td_mesh_create: out or comm is NULL");
    *out = NULL;
    td_mesh_params def = td_mesh_default_params();
    if (!p) p = &def;
    td_mesh *m = calloc(1, sizeof *m);
    if (!m) return td__fail(TD_ENOMEM, "mesh: out of memory");
    m->comm = comm;
    int world = td_comm_size(comm), rank = td_comm_rank(comm);
    mesh_sig sig;
    memset(&sig, 0, sizeof sig);
    td_status local = check(m, p, world);
    if (local == TD_OK) {
        sig.ndims = m->ndims;
        for (int i = 0; i < m->ndims; i++) {
            sig.sizes[i] = p->sizes[i];
            memcpy(sig.names[i], m->names[i], NAME_CAP);
        }
    }
    td_comm_agreement a = {.what = "mesh",
                           .local = local,
                           .sig = &sig,
                           .bytes = sizeof sig,
                           .mismatch = TD_EINVAL,
                           .describe = describe,
                           .hint = "; every rank must build the same mesh"};
    td_status s = td_comm_agree(comm, &a);
    for (int i = m->ndims - 1, r = rank; s == TD_OK && i >= 0; i--) {
        m->coords[i] = r % m->sizes[i];
        r /= m->sizes[i];
    }
    /* Dimension d's group: the ranks equal in every other coordinate. Its colour is the rank
     * with coordinate d set to 0 (unique per group), its key the coordinate along d. */
    for (int d = 0; s == TD_OK && d < m->ndims; d++) {
        int c[TD_MESH_MAX_DIMS];
        memcpy(c, m->coords, sizeof c);
        c[d] = 0;
        s = td_comm_split(comm, td_mesh_rank_at(m, c), m->coords[d], &m->groups[d]);
        /* Named by dimension and place among its kind, in messages and dumps: "tp1". */
        int at = 0;
        for (int e = 0; e < m->ndims; e++)
            if (e != d) at = at * m->sizes[e] + m->coords[e];
        char name[NAME_CAP + 12];
        snprintf(name, sizeof name, "%s%d", m->names[d], at);
        if (s == TD_OK) s = td_comm_set_name(m->groups[d], name);
    }
    if (s != TD_OK) {
        td_mesh_destroy(m);
        return s;
    }
    *out = m;
    return TD_OK;
}

void td_mesh_destroy(td_mesh *m) {
    if (!m) return;
    for (int d = 0; d < m->ndims; d++) td_comm_destroy(m->groups[d]);
    free(m);
}

static int dim_of(const td_mesh *m, const char *dim) {
    if (!m || !dim) return -1;
    for (int d = 0; d < m->ndims; d++)
        if (!strcmp(m->names[d], dim)) return d;
    return -1;
}

td_comm *td_mesh_group(const td_mesh *m, const char *dim) {
    int d = dim_of(m, dim);
    return d < 0 ? NULL : m->groups[d];
}

int td_mesh_size(const td_mesh *m, const char *dim) {
    int d = dim_of(m, dim);
    return d < 0 ? 1 : m->sizes[d];
}

int td_mesh_coord(const td_mesh *m, const char *dim) {
    int d = dim_of(m, dim);
    return d < 0 ? 0 : m->coords[d];
}

td_comm *td_mesh_comm(const td_mesh *m) { return m ? m->comm : NULL; }

int td_mesh_rank_at(const td_mesh *m, const int *coords) {
    if (!m || !coords) return -1;
    int r = 0;
    for (int d = 0; d < m->ndims; d++) {
        if (coords[d] < 0 || coords[d] >= m->sizes[d]) return -1;
        r = r * m->sizes[d] + coords[d];
    }
    return r;
}

td_mesh_params td_mesh_get_params(const td_mesh *m) {
    td_mesh_params p;
    memset(&p, 0, sizeof p);
    if (!m) return p;
    p.ndims = m->ndims;
    for (int d = 0; d < m->ndims; d++) {
        p.names[d] = m->names[d];
        p.sizes[d] = m->sizes[d];
    }
    return p;
}

const char *td_mesh_format(const td_mesh *m, char *out, size_t cap) {
    if (!out || !cap) return out;
    out[0] = 0;
    if (m) format_dims(m->names, m->sizes, m->ndims, out, cap);
    return out;
}
