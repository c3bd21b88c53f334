/* What the diagnosis (diagnose.c, straggler.c, doctor_trace.c) reads: every rank's dump
 * (src/comm/dump.c writes them) and what a launcher knew of the ranks' processes, loaded by
 * dumps.c. Not installed. Ranks are world ranks throughout. */
#ifndef TANDEM_DOCTOR_IMPL_H
#define TANDEM_DOCTOR_IMPL_H

#include <stdint.h>

#include "tandem/doctor.h"

/* One call of a group's ring, as a dump has it. */
typedef struct {
    uint64_t seq;
    char kind[16]; /* "allreduce", "send", "split", ... */
    int coll;      /* a collective, which every member makes with the same seq */
    int p2p;       /* a send or a receive */
    char desc[256];
    char tag[48];
    char dtype[8];
    uint64_t count;
    int op, peer, p2p_tag; /* peer: a p2p's world rank, a rooted collective's root */
    char state[12];        /* "queued", "running", "done", "failed" */
    char status[48];       /* what a failed call returned */
    int64_t step;
    int waiting_for; /* the world rank its wait was on, or -1 */
    double wait_s;   /* how long it waited past the spin (0: it did not) */
    double ended_s_ago;
} dr_call;

/* One group as one rank saw it. */
typedef struct {
    char key[24];
    char label[128]; /* "world", "group {1,2,3}" */
    int *members;    /* (size) world ranks */
    int size, rank;
    char backend[16];
    char failed[512];
    dr_call *calls; /* (ncalls), oldest first */
    int ncalls;
} dr_group;

typedef struct {
    int have_dump;
    int rank, world_size, pid;
    uint64_t time_ns; /* the dump's td_time_ns (CLOCK_MONOTONIC of its host) */
    char host[64], why[64], failure[1024];
    int64_t step;
    double step_for_s;
    int micro_batch;
    char op[48], phase[16];
    double op_for_s;
    int creating; /* in td_comm_create */
    double creating_for_s;
    dr_group *groups;
    int ngroups;
    char main_stack[4][160]; /* the main thread's innermost frames outside the C library */
    /* What the launcher said (launcher.json). */
    int have_proc;
    td_doctor_proc proc;
} dr_rank;

typedef struct {
    dr_rank *ranks; /* (n) indexed by world rank */
    int n;
    int hosts; /* distinct hosts among the dumps */
} dr_job;

/* Reads DIR/rank*.json and DIR/launcher.json; TD_EIO when the directory cannot be read,
 * TD_EFORMAT naming a dump that is not one (ranks without a dump stay have_dump = 0). */
td_status td__doctor_load(const char *dir, dr_job *job);
void td__doctor_free(dr_job *job);

/* The group of rank r whose key and members equal g's, or NULL. */
const dr_group *td__doctor_group_of(const dr_job *job, int r, const dr_group *g);

/* The straggler report of a job no rank of which is stuck (straggler.c): appends its lines to
 * out (first line the finding); 0 when it found no rank slower than the others. */
int td__doctor_straggler(const dr_job *job, char *out, size_t cap);

#endif
