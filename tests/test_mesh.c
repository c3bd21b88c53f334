/* The device mesh: at 8 ranks as (pp 2, dp 2, tp 2) every dimension's group holds the ranks
 * equal in the other coordinates, in order along it (each checked by an all-gather of world
 * ranks over the group); -1 takes what the world leaves; the default layout reads TANDEM_TP and
 * TANDEM_PP; a rank that describes another mesh, sizes that do not make the world and a bad
 * environment value fail on every rank, naming them. Ranks are forked (td_spawn), over shm. */
#include <stdlib.h>
#include <string.h>

#include "tandem/mesh.h"

#include "test.h"
#include "test_comm_util.h"

/* Every group of the mesh holds the ranks the rank formula says, in order. */
static void check_groups(td_mesh *m, int world_rank) {
    td_mesh_params p = td_mesh_get_params(m);
    int coords[TD_MESH_MAX_DIMS];
    for (int d = 0; d < p.ndims; d++) coords[d] = td_mesh_coord(m, p.names[d]);
    CHECK_EQ(td_mesh_rank_at(m, coords), world_rank);
    for (int d = 0; d < p.ndims; d++) {
        td_comm *g = td_mesh_group(m, p.names[d]);
        CHECK(g != NULL);
        if (!g) continue;
        CHECK_EQ(td_comm_size(g), p.sizes[d]);
        CHECK_EQ(td_comm_rank(g), coords[d]);
        int32_t mine = world_rank, all[16];
        CHECK_EQ(td_comm_allgather(g, &mine, all, 1, TD_I32), TD_OK);
        for (int i = 0; i < p.sizes[d]; i++) {
            int c[TD_MESH_MAX_DIMS];
            memcpy(c, coords, sizeof c);
            c[d] = i;
            if (all[i] != td_mesh_rank_at(m, c))
                TEST_FAIL_AT("rank %d: group '%s' member %d is rank %d, expected %d", world_rank,
                             p.names[d], i, all[i], td_mesh_rank_at(m, c));
        }
    }
}

static void groups_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c;
    CHECK_EQ(test_comm_create(&c, rank, size, port, 20), TD_OK);
    td_mesh_params p = {.ndims = 3, .names = {"pp", "dp", "tp"}, .sizes = {2, -1, 2}};
    td_mesh *m;
    CHECK_EQ(td_mesh_create(&m, c, &p), TD_OK);
    CHECK_EQ(td_mesh_size(m, "dp"), 2);
    CHECK_EQ(td_mesh_size(m, "ep"), 1); /* a name the mesh lacks: one */
    CHECK(td_mesh_group(m, "ep") == NULL);
    CHECK_EQ(td_mesh_coord(m, "tp"), rank % 2);
    CHECK_EQ(td_mesh_coord(m, "pp"), rank / 4);
    check_groups(m, rank);
    char s[64];
    CHECK(!strcmp(td_mesh_format(m, s, sizeof s), "pp 2 x dp 2 x tp 2"));
    td_mesh_destroy(m);
    /* the order the user gives decides who is a neighbour */
    td_mesh_params q = {.ndims = 2, .names = {"tp", "dp"}, .sizes = {4, 2}};
    CHECK_EQ(td_mesh_create(&m, c, &q), TD_OK);
    CHECK_EQ(td_mesh_coord(m, "dp"), rank % 2);
    check_groups(m, rank);
    td_mesh_destroy(m);
    td_comm_destroy(c);
}

static void groups_at_eight_ranks(void) {
    CHECK_EQ(test_run_ranks(8, groups_rank, NULL, 60, 0), 0);
}

static void env_rank(int rank, int size, int port, void *arg) {
    (void)arg;
    td_comm *c;
    CHECK_EQ(test_comm_create(&c, rank, size, port, 20), TD_OK);
    setenv("TANDEM_TP", "2", 1);
    unsetenv("TANDEM_PP");
    td_mesh *m;
    CHECK_EQ(td_mesh_create(&m, c, NULL), TD_OK);
    char s[64];
    CHECK(!strcmp(td_mesh_format(m, s, sizeof s), "pp 1 x dp 2 x tp 2"));
    CHECK_EQ(td_mesh_coord(m, "tp"), rank % 2);
    check_groups(m, rank);
    td_mesh_destroy(m);
    /* sizes that do not make the world, on every rank */
    setenv("TANDEM_TP", "3", 1);
    CHECK_EQ(td_mesh_create(&m, c, NULL), TD_EINVAL);
    CHECK(strstr(td_last_error(), "does not divide the group's 4") != NULL);
    setenv("TANDEM_TP", "two", 1);
    CHECK_EQ(td_mesh_create(&m, c, NULL), TD_EINVAL);
    CHECK(strstr(td_last_error(), "TANDEM_TP") != NULL);
    /* one rank describes another mesh: every rank is told which */
    setenv("TANDEM_TP", rank == 3 ? "4" : "2", 1);
    CHECK_EQ(td_mesh_create(&m, c, NULL), TD_EINVAL);
    if (rank == 0) printf("    %s\n", td_last_error());
    CHECK(strstr(td_last_error(), "rank 3 has pp 1 x dp -1 x tp 4") != NULL);
    td_mesh_params bad = {.ndims = 2, .names = {"dp", "tp"}, .sizes = {3, 2}};
    CHECK_EQ(td_mesh_create(&m, c, &bad), TD_EINVAL);
    CHECK(strstr(td_last_error(), "dp 3 x tp 2 is 6 ranks, but the group has 4") != NULL);
    bad = (td_mesh_params){.ndims = 2, .names = {"tp", "tp"}, .sizes = {2, 2}};
    CHECK_EQ(td_mesh_create(&m, c, &bad), TD_EINVAL);
    CHECK(strstr(td_last_error(), "two dimensions are called 'tp'") != NULL);
    td_comm_destroy(c);
}

static void environment_and_errors(void) { CHECK_EQ(test_run_ranks(4, env_rank, NULL, 60, 0), 0); }

int main(void) {
    RUN(groups_at_eight_ranks);
    RUN(environment_and_errors);
    TEST_END();
}
