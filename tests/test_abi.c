/* The options structs as a program built against an older header meets them (core.h: how the
 * options structs keep the ABI): every td_*_params keeps the size it has in libtandem.so.0 and
 * ends in its reserved bytes, which td_*_default_params() leaves zero; an options struct added to
 * the headers without reserved room, or a field added without taking its bytes from reserved,
 * fails here with what to do. */
#include <dirent.h>
#include <stddef.h>

#include "tandem/tandem.h"

#include "test.h"

/* Each options struct, its size in libtandem.so.0, and its defaults. */
#define OPTIONS_STRUCTS(X)                                         \
    X(td_amp_params, 76, td_graph_default_params().amp)            \
    X(td_adamw_params, 104, td_adamw_default_params())             \
    X(td_batch_norm_params, 72, td_batch_norm_default_params())    \
    X(td_comm_params, 136, td_comm_default_params())               \
    X(td_conv2d_params, 88, td_conv2d_default_params())            \
    X(td_ddp_params, 128, td_ddp_default_params())                 \
    X(td_dp_params, 608, td_dp_default_params())                   \
    X(td_gpt_params, 96, td_gpt_default_params())                  \
    X(td_grad_scaler_params, 112, td_grad_scaler_default_params()) \
    X(td_graph_params, 240, td_graph_default_params())             \
    X(td_job_params, 80, td_job_default_params())                  \
    X(td_loader_params, 192, td_loader_default_params())           \
    X(td_mesh_params, 120, td_mesh_default_params())               \
    X(td_lr_schedule_params, 128, td_lr_schedule_default_params()) \
    X(td_pipeline_params, 496, td_pipeline_default_params())       \
    X(td_pool2d_params, 88, td_pool2d_default_params())            \
    X(td_resnet_params, 136, td_resnet_default_params())           \
    X(td_sampler_params, 104, td_sampler_default_params())         \
    X(td_sgd_params, 104, td_sgd_default_params())                 \
    X(td_spawn_params, 120, td_spawn_default_params())             \
    X(td_store_params, 96, td_store_default_params())              \
    X(td_zero_params, 224, td_zero_default_params())

static int all_zero(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static void options_keep_their_size(void) {
#define CHECK_OPTIONS(type, abi_size, defaults)                                                   \
    do {                                                                                          \
        if (sizeof(type) != (abi_size))                                                           \
            TEST_FAIL_AT(#type " is %zu bytes, but %d in libtandem.so.0: a new option takes its " \
                               "bytes from reserved[] (core.h)",                                  \
                         sizeof(type), (abi_size));                                               \
        if (offsetof(type, reserved) + sizeof(((type *)0)->reserved) != sizeof(type))             \
            TEST_FAIL_AT(#type ": reserved[] is not its last member");                            \
        type d_ = defaults;                                                                       \
        if (!all_zero(d_.reserved, sizeof d_.reserved))                                           \
            TEST_FAIL_AT(#defaults " leaves reserved[] non-zero");                                \
    } while (0);
    OPTIONS_STRUCTS(CHECK_OPTIONS)
#undef CHECK_OPTIONS
}

/* Every options struct the public headers define is one of the above: a new one gets reserved
 * room and a row here. */
static void every_options_struct_is_kept(void) {
    static const char *const known[] = {
#define NAME(type, abi_size, defaults) #type,
        OPTIONS_STRUCTS(NAME)
#undef NAME
    };
    size_t n_known = sizeof known / sizeof *known;
    int *seen = calloc(n_known, sizeof *seen);
    const char *dir = test_source_path("include/tandem");
    char dirname[4096];
    snprintf(dirname, sizeof dirname, "%s", dir);
    DIR *d = opendir(dirname);
    CHECK(d != NULL);
    if (!d) {
        free(seen);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 3 || strcmp(e->d_name + len - 2, ".h") != 0) continue;
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", dirname, e->d_name);
        FILE *f = fopen(path, "r");
        CHECK(f != NULL);
        if (!f) continue;
        char line[1024], name[128];
        while (fgets(line, sizeof line, f)) {
            const char *close = strstr(line, "} td_");
            if (!close || sscanf(close, "} %127[a-z0-9_];", name) != 1) continue;
            size_t nl = strlen(name);
            if (strncmp(name, "td_", 3) != 0 || nl < 7 || strcmp(name + nl - 7, "_params") != 0)
                continue;
            size_t k = 0;
            while (k < n_known && strcmp(known[k], name) != 0) k++;
            if (k == n_known)
                TEST_FAIL_AT("%s (%s) is an options struct without a row in tests/test_abi.c: "
                             "end it in reserved[] as the others (core.h) and add its size here",
                             name, e->d_name);
            else
                seen[k] = 1;
        }
        fclose(f);
    }
    closedir(d);
    for (size_t k = 0; k < n_known; k++)
        if (!seen[k]) TEST_FAIL_AT("%s is no longer in include/tandem/: drop its row", known[k]);
    free(seen);
}

int main(void) {
    RUN(options_keep_their_size);
    RUN(every_options_struct_is_kept);
    TEST_END();
}
