/* Finds and loads libtandem_cuda.so the first time a GPU is asked for, and remembers why GPUs
 * cannot be used when it, the driver or a device is missing. Searched, in order: the path in
 * TANDEM_CUDA_LIB; beside the code of this library (libtandem.so's folder, or for a program
 * linked statically the program's folder and its ../lib); then the dynamic linker's own path
 * by name. Nothing is loaded on machines where no one asks for a GPU. */
#include <dlfcn.h>
#include <libgen.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_impl.h"
#include "device/cuda_api.h"
#include "device/device_impl.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;
static const td__cuda_api *api;
static void *library; /* the dlopen handle behind api */
static char why[1024];

static const td__cuda_host host = {.abi = TD__CUDA_ABI,
                                   .fail = td__fail,
                                   .alloc = td_device_alloc,
                                   .free = td_device_free,
                                   .stream = td__device_stream};

/* Tries one path: 1 when it loaded (api set or why says what was wrong with it). */
static int try_open(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        size_t used = strlen(why);
        snprintf(why + used, sizeof why - used, "%s%s", used ? "; " : "", dlerror());
        return 0;
    }
    td__cuda_entry_fn entry = (td__cuda_entry_fn)(uintptr_t)dlsym(h, TD__CUDA_ENTRY);
    const td__cuda_api *a = entry ? entry(&host) : NULL;
    if (!a || a->abi != TD__CUDA_ABI) {
        snprintf(why, sizeof why,
                 "%s is not a tandem CUDA library of this version (ABI %d, want %d)", path,
                 a ? a->abi : -1, TD__CUDA_ABI);
        dlclose(h);
        return 1;
    }
    why[0] = 0;
    api = a;
    library = h;
    return 1;
}

static void load(void) {
    const char *env = getenv("TANDEM_CUDA_LIB");
    if (env && *env) {
        if (!try_open(env)) {
            char tried[sizeof why];
            snprintf(tried, sizeof tried, "%s", why);
            snprintf(why, sizeof why, "TANDEM_CUDA_LIB=%s cannot be loaded: %.700s", env, tried);
        }
        return;
    }
    Dl_info info;
    if (dladdr((void *)(uintptr_t)load, &info) && info.dli_fname) {
        char self[4096], path[4200];
        snprintf(self, sizeof self, "%s", info.dli_fname);
        char *dir = dirname(self);
        snprintf(path, sizeof path, "%s/libtandem_cuda.so", dir);
        if (try_open(path)) return;
        snprintf(path, sizeof path, "%s/../lib/libtandem_cuda.so", dir);
        if (try_open(path)) return;
    }
    if (try_open("libtandem_cuda.so")) return;
    char tried[sizeof why];
    snprintf(tried, sizeof tried, "%s", why);
    snprintf(
        why, sizeof why,
        "libtandem_cuda.so not found (tandem built without CUDA, or set TANDEM_CUDA_LIB): %.700s",
        tried);
}

const td__cuda_api *td__cuda(void) {
    pthread_once(&once, load);
    return api;
}

const void *td__device_library_table(const char *entry) {
    if (!td__cuda()) return NULL;
    const void *(*fn)(void) = (const void *(*)(void))(uintptr_t)dlsym(library, entry);
    return fn ? fn() : NULL;
}

/* The device count is asked once: the driver's answer does not change within a process. */
static pthread_once_t counted = PTHREAD_ONCE_INIT;
static int ngpus;

static void count(void) {
    const td__cuda_api *a = td__cuda();
    if (!a) return;
    if (a->device_count(&ngpus, why, sizeof why) != TD_OK || ngpus == 0) ngpus = 0;
}

const char *td__cuda_unavailable(void) {
    pthread_once(&counted, count);
    return ngpus > 0 ? NULL : why;
}

td_status td_cuda_device_count(int *out) {
    if (!out) return td__fail(TD_EINVAL, "td_cuda_device_count: out is NULL");
    pthread_once(&counted, count);
    *out = ngpus;
    return TD_OK;
}

const char *td_cuda_unavailable(void) { return td__cuda_unavailable(); }
