/* tandem under a real Slurm: a cluster of one node, its own munged, slurmctld and slurmd
 * (Debian's slurmctld, slurmd, slurm-client and munge) on ports and in a directory of its own,
 * started here and stopped here. The batch script of docs/launching.md, as it stands there, and
 * srun --mpi=pmix each train examples/mnist with DDP on 2 ranks for four steps, and the
 * parameters are the bits tandemrun --nproc-per-node 2 gives. Skips, saying why, where Slurm is
 * not installed or the test is not root. */
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>

#include "tandem/launch.h"

#include "test.h"
#include "test_program.h" /* run, output, printed_sha256 */

#define STEPS_ARGS "--max-steps 4 --no-eval"

static char build[PATH_MAX], dir[256], conf[300];
static char mnist_digest[65]; /* tandemrun's, the yardstick */

typedef struct {
    const char *name;
    pid_t pid;
} daemon_proc;

static daemon_proc munged = {"munged", 0}, slurmctld = {"slurmctld", 0}, slurmd = {"slurmd", 0};
static int cluster_state; /* 0 not tried, 1 up, -1 skipped (cluster_why says why), -2 failed */
static char cluster_why[512];

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_ms(int ms) {
    nanosleep(&(struct timespec){ms / 1000, (ms % 1000) * 1000000L}, NULL);
}

/* Starts argv as a child that dies with this process (so a killed test leaves no daemon), its
 * output appended to DIR/<name>.out. */
static void daemon_start(daemon_proc *d, char *const argv[]) {
    char log[400];
    snprintf(log, sizeof log, "%s/%s.out", dir, d->name);
    pid_t parent = getpid();
    d->pid = fork();
    if (d->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) dup2(fd, 1), dup2(fd, 2);
        execvp(argv[0], argv);
        _exit(127);
    }
}

/* Whether d is still running (reaps it when it is not). */
static int daemon_alive(daemon_proc *d) {
    if (d->pid <= 0) return 0;
    if (waitpid(d->pid, NULL, WNOHANG) == 0) return 1;
    d->pid = 0;
    return 0;
}

/* SIGTERM, then SIGKILL after 10 s; 0 when it had to be killed. */
static int daemon_stop(daemon_proc *d) {
    if (d->pid <= 0) return 1;
    kill(d->pid, SIGTERM);
    for (double t0 = seconds(); seconds() - t0 < 10;) {
        if (!daemon_alive(d)) return 1;
        sleep_ms(50);
    }
    kill(d->pid, SIGKILL);
    waitpid(d->pid, NULL, 0);
    d->pid = 0;
    return 0;
}

/* The last lines of a daemon's output, for a message. */
static const char *daemon_tail(const daemon_proc *d) {
    static char tail[600];
    char path[400];
    snprintf(path, sizeof path, "%s/%s.out", dir, d->name);
    FILE *f = fopen(path, "r");
    tail[0] = 0;
    if (!f) return tail;
    fseek(f, 0, SEEK_END);
    long end = ftell(f), from = end > (long)sizeof tail - 1 ? end - (long)sizeof tail + 1 : 0;
    fseek(f, from, SEEK_SET);
    size_t n = fread(tail, 1, sizeof tail - 1, f);
    tail[n] = 0;
    fclose(f);
    return tail;
}

/* The cluster's configuration: this host's name for the controller (slurmctld checks it is
 * its own), the node as localhost, both on 127.0.0.1, no cgroups, no accounting. */
static void write_conf(int ctld_port, int slurmd_port) {
    char host[256] = "localhost", text[4096];
    gethostname(host, sizeof host - 1);
    host[strcspn(host, ".")] = 0;
    snprintf(text, sizeof text,
             "ClusterName=tandemtest\n"
             "SlurmctldHost=%s(127.0.0.1)\n"
             "SlurmUser=root\nSlurmdUser=root\n"
             "SlurmctldPort=%d\nSlurmdPort=%d\n"
             "AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket=%s/munge.socket\n"
             "StateSaveLocation=%s/state\nSlurmdSpoolDir=%s/spool\n"
             "SlurmctldPidFile=%s/slurmctld.pid\nSlurmdPidFile=%s/slurmd.pid\n"
             "ProctrackType=proctrack/pgid\nTaskPlugin=task/none\nMpiDefault=none\n"
             "ReturnToService=2\nSchedulerType=sched/builtin\n"
             "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
             "SlurmdParameters=config_overrides\n"
             "JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n"
             "JobAcctGatherType=jobacct_gather/none\n"
             "NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 RealMemory=1000 State=UNKNOWN\n"
             "PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP "
             "OverSubscribe=YES\n",
             host, ctld_port, slurmd_port, dir, dir, dir, dir, dir);
    test_write_file(conf, text, strlen(text));
}

/* Waits up to `secs` for the node to be idle in sinfo; 0 when it is. */
static int wait_node_idle(double secs) {
    for (double t0 = seconds(); seconds() - t0 < secs;) {
        if (!daemon_alive(&slurmctld) || !daemon_alive(&slurmd)) return -1;
        if (run("sinfo -h -o %%t") == 0 && strncmp(output, "idle", 4) == 0) return 0;
        sleep_ms(200);
    }
    return -1;
}

static int cluster_try(void) {
    int ctld_port = 0, slurmd_port = 0;
    if (td_free_port(&ctld_port) || td_free_port(&slurmd_port) || ctld_port == slurmd_port)
        return -1;
    write_conf(ctld_port, slurmd_port);
    run_quiet("{ rm -rf %s/state %s/spool && mkdir -p %s/state %s/spool; }", dir, dir, dir, dir);
    daemon_start(&slurmctld, (char *const[]){"slurmctld", "-D", "-f", conf, NULL});
    daemon_start(&slurmd, (char *const[]){"slurmd", "-D", "-f", conf, "-N", "localhost", NULL});
    if (wait_node_idle(60) == 0) return 0;
    daemon_stop(&slurmd);
    daemon_stop(&slurmctld);
    return -1;
}

/* Brings the cluster up once: the munge key and daemon, then the controller and the node (on
 * new ports when a port was taken between choosing it and binding it). */
static int cluster_up(void) {
    if (cluster_state) return cluster_state;
    cluster_state = -1;
    if (geteuid() != 0) {
        snprintf(cluster_why, sizeof cluster_why,
                 "slurmd starts a job's tasks as its user and needs root; this test runs as uid %d",
                 (int)geteuid());
        return cluster_state;
    }
    if (run_quiet("{ command -v slurmctld && command -v slurmd && command -v munged && command -v "
                  "mungekey && command -v sbatch && command -v srun && command -v sinfo; }") != 0) {
        snprintf(cluster_why, sizeof cluster_why,
                 "Slurm is not installed (sh scripts/deps.sh slurm: slurmctld slurmd "
                 "slurm-client munge)");
        return cluster_state;
    }
    cluster_state = -2;
    char key[300];
    snprintf(key, sizeof key, "%s/munge.key", dir);
    if (run("mungekey -c -k %s", key) != 0) {
        TEST_FAIL_AT("mungekey: %s", output);
        return cluster_state;
    }
    char sock[300], pid[300], log[300], seed[300];
    snprintf(sock, sizeof sock, "--socket=%s/munge.socket", dir);
    snprintf(pid, sizeof pid, "--pid-file=%s/munged.pid", dir);
    snprintf(log, sizeof log, "--log-file=%s/munged.log", dir);
    snprintf(seed, sizeof seed, "--seed-file=%s/munged.seed", dir);
    char keyarg[320];
    snprintf(keyarg, sizeof keyarg, "--key-file=%s", key);
    daemon_start(&munged,
                 (char *const[]){"munged", "-F", "-f", sock, keyarg, pid, log, seed, NULL});
    int ready = 0;
    for (double t0 = seconds(); !ready && seconds() - t0 < 20 && daemon_alive(&munged);) {
        ready = run_quiet("{ munge -S %s/munge.socket -n | unmunge -S %s/munge.socket; }", dir,
                          dir) == 0;
        if (!ready) sleep_ms(100);
    }
    if (!ready) {
        TEST_FAIL_AT("munged did not start:\n%s", daemon_tail(&munged));
        return cluster_state;
    }
    for (int attempt = 0; attempt < 3; attempt++)
        if (cluster_try() == 0) return cluster_state = 1;
    TEST_FAIL_AT("the Slurm cluster did not start:\nslurmctld: %s\nslurmd: %s",
                 daemon_tail(&slurmctld), daemon_tail(&slurmd));
    return cluster_state;
}

/* The cluster, or a skip or failure saying why not; 1 when the case can go on. */
static int need_cluster(void) {
    int s = cluster_up();
    if (s == -1) SKIP("%s", cluster_why);
    if (s == -2 && !test_case_failed) TEST_FAIL_AT("the Slurm cluster failed to start earlier");
    return s == 1;
}

/* tandemrun's digest for the runs below to match, made once. */
static int yardstick(void) {
    if (mnist_digest[0]) return 1;
    if (run("timeout 300 %s/bin/tandemrun --nproc-per-node 2 %s/examples/mnist " STEPS_ARGS, build,
            build) != 0) {
        TEST_FAIL_AT("tandemrun --nproc-per-node 2 examples/mnist failed");
        return 0;
    }
    printed_sha256(mnist_digest);
    if (!mnist_digest[0]) TEST_FAIL_AT("examples/mnist printed no params_sha256:\n%s", output);
    return mnist_digest[0] != 0;
}

/* The sbatch script of docs/launching.md (the ```sh block that starts #!/bin/sh and holds
 * #SBATCH lines), written to path. */
static int docs_script(const char *path) {
    size_t len = 0;
    char *doc = (char *)test_read_file(test_source_path("docs/launching.md"), &len);
    if (!doc) return -1;
    const char *start = strstr(doc, "```sh\n#!/bin/sh\n");
    while (start) {
        const char *body = start + 6, *end = strstr(body, "\n```");
        if (!end) break;
        if (memmem(body, (size_t)(end - body), "#SBATCH", 7)) {
            FILE *f = fopen(path, "w");
            int ok = f && fwrite(body, 1, (size_t)(end - body) + 1, f) == (size_t)(end - body) + 1;
            if (f) ok &= fclose(f) == 0;
            free(doc);
            return ok ? 0 : -1;
        }
        start = strstr(end, "```sh\n#!/bin/sh\n");
    }
    free(doc);
    return -1;
}

/* docs/launching.md's batch script, submitted with sbatch --wait, trains as tandemrun does. */
static void sbatch_script_trains_as_tandemrun(void) {
    if (!need_cluster() || !yardstick()) return;
    char script[300], out[300];
    snprintf(script, sizeof script, "%s/train.sbatch", dir);
    snprintf(out, sizeof out, "%s/job.out", dir);
    if (docs_script(script) != 0) {
        TEST_FAIL_AT("docs/launching.md has no ```sh block with an #SBATCH script");
        return;
    }
    int port = 0;
    CHECK_OK(td_free_port(&port));
    double t0 = seconds();
    int rc = run("MASTER_PORT=%d timeout 300 sbatch --wait --quiet --output=%s %s "
                 "%s/examples/mnist " STEPS_ARGS,
                 port, out, script, build);
    size_t len = 0;
    char *job = (char *)test_read_file(out, &len);
    snprintf(output, sizeof output, "%s", job ? job : "");
    free(job);
    if (rc != 0) {
        TEST_FAIL_AT("sbatch --wait exited %d; the job's output:\n%s", rc, output);
        return;
    }
    char got[65];
    printed_sha256(got);
    printf("    sbatch (%.1f s): params_sha256 %.16s..., tandemrun %.16s...\n", seconds() - t0, got,
           mnist_digest);
    CHECK(strstr(output, "2 rank(s)") != NULL);
    if (strcmp(got, mnist_digest) != 0)
        TEST_FAIL_AT("the job's parameters %s differ from tandemrun's %s:\n%s", got, mnist_digest,
                     output);
}

/* srun --mpi=pmix: Open MPI starts from Slurm's PMIx, the mpi backend carries the collectives,
 * and the parameters are tandemrun's (a sum of two is the same bits in any order). */
static void srun_pmix_trains_as_tandemrun(void) {
#ifndef TD_HAVE_MPI
    SKIP("built without MPI (make MPICC=): no mpi backend for srun --mpi=pmix");
    return;
#else
    if (!need_cluster() || !yardstick()) return;
    double t0 = seconds();
    /* Open MPI frees little at exit, so the sanitizers' leak reports would name MPI, not us. */
    if (run("ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0\" timeout 300 "
            "srun --mpi=pmix -n 2 --kill-on-bad-exit=1 --time=5 %s/examples/mnist " STEPS_ARGS,
            build) != 0) {
        TEST_FAIL_AT("srun --mpi=pmix -n 2 examples/mnist failed");
        return;
    }
    char got[65];
    printed_sha256(got);
    printf("    srun --mpi=pmix (%.1f s): params_sha256 %.16s...\n", seconds() - t0, got);
    if (strcmp(got, mnist_digest) != 0)
        TEST_FAIL_AT("srun's parameters %s differ from tandemrun's %s:\n%s", got, mnist_digest,
                     output);
#endif
}

/* Every job is over, and the daemons stop leaving no job step behind (slurmstepd removes its
 * socket, localhost_<job>.<step>, from the spool directory as it exits). */
static void cluster_stops_cleanly(void) {
    if (!need_cluster()) return;
    if (run("scancel --quiet --user=root") != 0) TEST_FAIL_AT("scancel failed: %s", output);
    int idle = 0;
    for (double t0 = seconds(); !idle && seconds() - t0 < 30;) {
        idle = run("squeue -h") == 0 && output[0] == 0;
        if (!idle) sleep_ms(200);
    }
    CHECK(idle);
    CHECK(daemon_stop(&slurmd));
    CHECK(daemon_stop(&slurmctld));
    CHECK(daemon_stop(&munged));
    int steps = 1;
    for (double t0 = seconds(); steps && seconds() - t0 < 15;) {
        steps = run_quiet("{ ls %s/spool | grep -q '^localhost_[0-9]'; }", dir) == 0;
        if (steps) sleep_ms(200);
    }
    if (steps) TEST_FAIL_AT("job steps are still running: %s/spool holds their sockets", dir);
    cluster_state = -2;
}

int main(int argc, char **argv) {
    (void)argc;
    char self[PATH_MAX];
    if (!realpath(argv[0], self)) return 1;
    snprintf(build, sizeof build, "%s", dirname(dirname(self))); /* BUILD/tests/x -> BUILD */
    test_temp_dir(dir, sizeof dir, "slurm");
    snprintf(conf, sizeof conf, "%s/slurm.conf", dir);
    /* Every Slurm command, and the jobs through them, use this cluster. */
    setenv("SLURM_CONF", conf, 1);
    char path[8192];
    snprintf(path, sizeof path, "%s:/usr/sbin:/sbin", getenv("PATH") ? getenv("PATH") : "/usr/bin");
    setenv("PATH", path, 1);
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1); /* containers lack CMA */
    setenv("OMPI_MCA_btl", "self,vader", 1);                       /* one host */
    RUN(sbatch_script_trains_as_tandemrun);
    RUN(srun_pmix_trains_as_tandemrun);
    RUN(cluster_stops_cleanly);
    /* What a failed case left: stopped here too. */
    daemon_stop(&slurmd);
    daemon_stop(&slurmctld);
    daemon_stop(&munged);
    test_remove_dir(dir);
    TEST_END();
}
