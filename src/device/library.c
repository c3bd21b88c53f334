/* The device types beside the CPU and the libraries that implement them, loaded the first time a
 * device of the type is asked for; each remembers why its devices cannot be used when the
 * library, the driver or a device is missing. A type is one row of `types`: how devices are
 * spelt, the library, the variable that overrides where it is found, and the entry of each of
 * its tables (device_api.h). A HIP or Metal device would be a row here and a library exporting
 * the same three tables; the layers above ask for tables by device (td__device_library) and
 * never name a type. A library is searched, in order: the path in its variable; beside the code
 * of this library (libtandem.so's folder, or for a program linked statically the program's
 * folder and its ../lib); then the dynamic linker's own path by name. Nothing is loaded on
 * machines where no one asks for a device. */
#include <dlfcn.h>
#include <libgen.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "device/device_api.h"
#include "device/device_impl.h"

typedef struct {
    td_device_type type;
    const char *name;    /* devices are `name` and `name:N` */
    const char *library; /* searched as the header says */
    const char *env;     /* a path to the library, overriding the search */
    const char *visible; /* the variable that says which devices a process sees */
    const char *entry[TD__DEVICE_TABLES];
} device_type;

static const device_type types[] = {
    {TD_DEVICE_CUDA,
     "cuda",
     "libtandem_cuda.so",
     "TANDEM_CUDA_LIB",
     "CUDA_VISIBLE_DEVICES",
     {"td_cuda_entry", "td_cuda_backend_entry", "td_cuda_comm_entry"}},
};
#define NTYPES (sizeof types / sizeof *types)

/* What is known of a type once its library was looked for. */
typedef struct {
    int loaded, counted;
    const td__device_runtime *runtime;
    void *handle; /* the dlopen handle behind runtime */
    int count;    /* devices that can be used */
    char why[1024];
} loaded_type;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static loaded_type loaded[NTYPES];

static const td__device_host host = {.abi = TD__DEVICE_ABI,
                                     .fail = td__fail,
                                     .alloc = td_device_alloc,
                                     .free = td_device_free,
                                     .stream = td__device_stream};

static int index_of(td_device_type type) {
    for (size_t i = 0; i < NTYPES; i++)
        if (types[i].type == type) return (int)i;
    return -1;
}

int td__device_type_parse(const char *name, td_device_type *out) {
    for (size_t i = 0; i < NTYPES; i++)
        if (strcmp(types[i].name, name) == 0) {
            *out = types[i].type;
            return 1;
        }
    return 0;
}

const char *td__device_type_name(td_device_type type) {
    int i = index_of(type);
    return i < 0 ? NULL : types[i].name;
}

const char *td__device_type_visible(td_device_type type) {
    int i = index_of(type);
    return i < 0 ? "" : types[i].visible;
}

/* Tries one path: 1 when it loaded (the runtime set, or why says what was wrong with it). */
static int try_open(const device_type *t, loaded_type *l, const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        size_t used = strlen(l->why);
        snprintf(l->why + used, sizeof l->why - used, "%s%s", used ? "; " : "", dlerror());
        return 0;
    }
    td__device_runtime_entry entry =
        (td__device_runtime_entry)(uintptr_t)dlsym(h, t->entry[TD__DEVICE_RUNTIME]);
    const td__device_runtime *r = entry ? entry(&host) : NULL;
    if (!r || r->abi != TD__DEVICE_ABI) {
        snprintf(l->why, sizeof l->why,
                 "%s is not a tandem %s library of this version (ABI %d, want %d)", path, t->name,
                 r ? r->abi : -1, TD__DEVICE_ABI);
        dlclose(h);
        return 1;
    }
    l->why[0] = 0;
    l->runtime = r;
    l->handle = h;
    return 1;
}

static void load(const device_type *t, loaded_type *l) {
    const char *env = getenv(t->env);
    if (env && *env) {
        if (!try_open(t, l, env)) {
            char tried[sizeof l->why];
            snprintf(tried, sizeof tried, "%s", l->why);
            snprintf(l->why, sizeof l->why, "%s=%s cannot be loaded: %.700s", t->env, env, tried);
        }
        return;
    }
    Dl_info info;
    if (dladdr((void *)(uintptr_t)load, &info) && info.dli_fname) {
        char self[4096], path[4200];
        snprintf(self, sizeof self, "%s", info.dli_fname);
        char *dir = dirname(self);
        snprintf(path, sizeof path, "%s/%s", dir, t->library);
        if (try_open(t, l, path)) return;
        snprintf(path, sizeof path, "%s/../lib/%s", dir, t->library);
        if (try_open(t, l, path)) return;
    }
    if (try_open(t, l, t->library)) return;
    char tried[sizeof l->why];
    snprintf(tried, sizeof tried, "%s", l->why);
    snprintf(l->why, sizeof l->why, "%s not found (tandem built without it, or set %s): %.700s",
             t->library, t->env, tried);
}

/* Type i's library looked for and its devices counted, once; the counts do not change within a
 * process. */
static loaded_type *known(int i) {
    loaded_type *l = &loaded[i];
    pthread_mutex_lock(&lock);
    if (!l->loaded) {
        load(&types[i], l);
        l->loaded = 1;
    }
    if (!l->counted) {
        l->counted = 1;
        if (l->runtime &&
            (l->runtime->device_count(&l->count, l->why, sizeof l->why) != TD_OK || l->count <= 0))
            l->count = 0;
    }
    pthread_mutex_unlock(&lock);
    return l;
}

const td__device_runtime *td__device_runtime_of(td_device_type type) {
    int i = index_of(type);
    return i < 0 ? NULL : known(i)->runtime;
}

int td__device_count(td_device_type type) {
    int i = index_of(type);
    return i < 0 ? 0 : known(i)->count;
}

const char *td__device_unavailable(td_device_type type) {
    int i = index_of(type);
    if (i < 0) return "tandem knows no such device type";
    loaded_type *l = known(i);
    return l->count > 0 ? NULL : l->why;
}

td_status td__device_library(td_device d, td__device_table which, const char *what,
                             const void **out) {
    *out = NULL;
    int i = index_of(d.type);
    if (i < 0)
        return td__fail(TD_EINVAL, "%s: device type %d is neither the CPU nor one tandem knows",
                        what, (int)d.type);
    char name[32];
    td_device_format(d, name, sizeof name);
    loaded_type *l = known(i);
    if (l->count == 0)
        return td__fail(TD_EUNSUPPORTED, "%s: %s: no GPU can be used here: %s", what, name, l->why);
    if (d.index < 0 || d.index >= l->count)
        return td__fail(TD_EINVAL, "%s: %s does not exist (%d %s device%s visible)", what, name,
                        l->count, types[i].name, l->count == 1 ? " is" : "s are");
    if (which == TD__DEVICE_RUNTIME) {
        *out = l->runtime;
        return TD_OK;
    }
    const void *(*entry)(void) =
        (const void *(*)(void))(uintptr_t)dlsym(l->handle, types[i].entry[which]);
    *out = entry ? entry() : NULL;
    if (!*out)
        return td__fail(TD_EUNSUPPORTED, "%s: %s: the %s library has no %s", what, name,
                        types[i].name, types[i].entry[which]);
    return TD_OK;
}

td_status td_cuda_device_count(int *out) {
    if (!out) return td__fail(TD_EINVAL, "td_cuda_device_count: out is NULL");
    *out = td__device_count(TD_DEVICE_CUDA);
    return TD_OK;
}

const char *td_cuda_unavailable(void) { return td__device_unavailable(TD_DEVICE_CUDA); }
