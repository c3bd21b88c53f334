/* Where a process learns its place in the job: td_comm_params defaults and their resolution
 * from the environment, in torchrun's words (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
 * NODE_RANK, MASTER_ADDR, MASTER_PORT), tandem's (TANDEM_TOKEN, TANDEM_TIMEOUT,
 * TANDEM_HIERARCHICAL, TANDEM_STORE_HOSTED), Open MPI's (OMPI_COMM_WORLD_*) and Slurm's
 * (SLURM_*). It does not start or contact anything. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_impl.h"
#include "core/core_impl.h"

td_comm_params td_comm_default_params(void) {
    td_comm_params p = {.backend = TD_BACKEND_AUTO,
                        .rank = -1,
                        .world_size = -1,
                        .local_rank = -1,
                        .local_world_size = -1,
                        .node_rank = -1,
                        .hierarchical = -1,
                        .store_hosted = -1};
    return p;
}

/* The first of `names` that is set; *which gets its name. */
static const char *env_first(const char *const *names, const char **which) {
    for (; *names; names++) {
        const char *v = getenv(*names);
        if (v && *v) {
            *which = *names;
            return v;
        }
    }
    return NULL;
}

/* Reads an integer from the first set variable; *found = 0 when none is set. */
static td_status env_int(const char *const *names, long lo, long hi, int *out, int *found) {
    const char *which = NULL, *v = env_first(names, &which);
    *found = v != NULL;
    if (!v) return TD_OK;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    /* Slurm writes SLURM_NTASKS_PER_NODE as "4(x2)"; the count comes first. */
    if (errno || end == v || (*end && *end != '(') || x < lo || x > hi)
        return td__fail(TD_EINVAL, "%s='%s' is not an integer in [%ld, %ld]", which, v, lo, hi);
    *out = (int)x;
    return TD_OK;
}

static const char *const rank_vars[] = {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMIX_RANK",
                                        NULL};
static const char *const size_vars[] = {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", NULL};
static const char *const local_rank_vars[] = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                              "SLURM_LOCALID", NULL};
static const char *const local_size_vars[] = {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                              "SLURM_NTASKS_PER_NODE", NULL};
static const char *const port_vars[] = {"MASTER_PORT", NULL};
static const char *const node_vars[] = {"NODE_RANK", "GROUP_RANK", NULL};
static const char *const hier_vars[] = {"TANDEM_HIERARCHICAL", NULL};
static const char *const hosted_vars[] = {"TANDEM_STORE_HOSTED", NULL};

td_status td__comm_resolve_params(const td_comm_params *in, td_comm_params *out) {
    *out = *in;
    int found;
    td_status s;
    if (out->rank < 0) {
        if ((s = env_int(rank_vars, 0, 1 << 24, &out->rank, &found))) return s;
        if (!found)
            return td__fail(
                TD_EINVAL,
                "RANK is not set (nor OMPI_COMM_WORLD_RANK, SLURM_PROCID, PMIX_RANK): launch "
                "with tandemrun/mpirun/srun or set td_comm_params.rank");
    }
    if (out->world_size < 0) {
        if ((s = env_int(size_vars, 1, 1 << 24, &out->world_size, &found))) return s;
        if (!found)
            return td__fail(
                TD_EINVAL,
                "WORLD_SIZE is not set (nor OMPI_COMM_WORLD_SIZE, SLURM_NTASKS): launch with "
                "tandemrun/mpirun/srun or set td_comm_params.world_size");
    }
    if (out->world_size < 1 || out->rank >= out->world_size)
        return td__fail(TD_EINVAL, "rank %d is not below world_size %d", out->rank,
                        out->world_size);
    if (out->local_rank < 0) {
        if ((s = env_int(local_rank_vars, 0, 1 << 24, &out->local_rank, &found))) return s;
        if (!found) out->local_rank = out->rank; /* one host */
    }
    if (out->local_world_size < 0) {
        if ((s = env_int(local_size_vars, 1, 1 << 24, &out->local_world_size, &found))) return s;
        if (!found) out->local_world_size = out->world_size;
    }
    if (!out->master_addr) {
        const char *v = getenv("MASTER_ADDR");
        out->master_addr = v && *v ? v : "127.0.0.1";
    }
    if (out->master_port == 0) {
        if ((s = env_int(port_vars, 1, 65535, &out->master_port, &found))) return s;
        if (!found) out->master_port = 29500;
    }
    if (out->master_port < 1 || out->master_port > 65535)
        return td__fail(TD_EINVAL, "master_port %d is not a TCP port", out->master_port);
    if (!out->token) {
        const char *v = getenv("TANDEM_TOKEN");
        out->token = v ? v : "";
    }
    if (out->timeout_s == 0) {
        const char *v = getenv("TANDEM_TIMEOUT");
        out->timeout_s = 300;
        if (v && *v) {
            char *end;
            double t = strtod(v, &end);
            if (end == v || *end || !(t > 0))
                return td__fail(TD_EINVAL,
                                "TANDEM_TIMEOUT='%s' is not a positive number of seconds", v);
            out->timeout_s = t;
        }
    }
    if (!(out->timeout_s > 0))
        return td__fail(TD_EINVAL, "timeout_s %g must be positive", out->timeout_s);
    if (out->node_rank < 0) {
        if ((s = env_int(node_vars, 0, 1 << 24, &out->node_rank, &found))) return s;
        if (!found) out->node_rank = -1; /* the ucx backend then tells hosts apart by name */
    }
    if (out->hierarchical < 0) {
        if ((s = env_int(hier_vars, 0, 1, &out->hierarchical, &found))) return s;
        if (!found) out->hierarchical = 1;
    }
    if (out->store_hosted < 0) {
        if ((s = env_int(hosted_vars, 0, 1, &out->store_hosted, &found))) return s;
        if (!found) out->store_hosted = 0;
    }
    if (out->backend == TD_BACKEND_AUTO) {
        int mpi_launcher = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK");
#ifdef TD_HAVE_MPI
        if (mpi_launcher) out->backend = TD_BACKEND_MPI;
#else
        (void)mpi_launcher;
#endif
        if (out->backend == TD_BACKEND_AUTO)
            out->backend = out->local_world_size < out->world_size ? TD_BACKEND_UCX : TD_BACKEND_SHM;
    }
    if (out->backend != TD_BACKEND_SHM && out->backend != TD_BACKEND_MPI &&
        out->backend != TD_BACKEND_UCX)
        return td__fail(TD_EINVAL, "unknown backend %d", (int)out->backend);
    return TD_OK;
}
