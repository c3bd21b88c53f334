/* The docs against what they stand on: every table of measured numbers in README.md and docs/
 * that has its data kept in docs/data/ is what that data gives (scripts/doc_tables.py --check;
 * the tables were typed in once and drifted from the data drawn beside them), and every
 * mpirun command the docs give for this host's build runs as root, as the README's does (the
 * suite and CI run as root, and Open MPI refuses root without --allow-run-as-root). */
#include <dirent.h>

#include "test.h"
#include "test_program.h" /* run, output */

static void tables_are_what_the_kept_data_gives(void) {
    if (access("/usr/bin/python3", X_OK) != 0) {
        SKIP("no /usr/bin/python3 to run scripts/doc_tables.py");
        return;
    }
    int rc = run("/usr/bin/python3 %s --check", test_source_path("scripts/doc_tables.py"));
    printf("    %s", output);
    CHECK_EQ(rc, 0);
    CHECK(strstr(output, " 0 differ") != NULL);
}

/* One page's mpirun lines that start the build's programs on this host (no -H, no hostfile:
 * those are for a cluster's users) and lack --allow-run-as-root; returns how many. */
static int root_mpirun_lines(const char *page) {
    size_t len = 0;
    char *text = (char *)test_read_file(test_source_path(page), &len);
    CHECK(text != NULL);
    if (!text) return 0;
    int n = 0;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        if (strncmp(line, "mpirun ", 7) || !strstr(line, "build/")) continue;
        n++;
        if (strstr(line, " -H ") || strstr(line, "--hostfile")) continue;
        if (!strstr(line, "--allow-run-as-root"))
            TEST_FAIL_AT("%s: \"%s\" lacks --allow-run-as-root", page, line);
    }
    free(text);
    return n;
}

static void mpirun_commands_run_as_root(void) {
    int lines = root_mpirun_lines("README.md");
    DIR *d = opendir(test_source_path("docs"));
    CHECK(d != NULL);
    for (struct dirent *e; d && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n < 4 || strcmp(e->d_name + n - 3, ".md")) continue;
        char page[300];
        snprintf(page, sizeof page, "docs/%s", e->d_name);
        lines += root_mpirun_lines(page);
    }
    if (d) closedir(d);
    printf("    %d mpirun lines of the build's programs\n", lines);
    CHECK(lines >= 3);
}

int main(void) {
    RUN(tables_are_what_the_kept_data_gives);
    RUN(mpirun_commands_run_as_root);
    TEST_END();
}
