/* Names of code addresses for the stacks in a flight recorder's dump: the function and the
 * offset into it. The dynamic loader names only what an object exports (dladdr); the functions
 * an executable keeps to itself (static ones, all of a program not linked with -rdynamic) are
 * found in the file's own symbol table (.symtab), read once per file and per dump. A stripped
 * file gives its offset only ("train(+0x7cf2)", which addr2line -f -e train 0x7cf2 names). */
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core_impl.h"

#define FILES_MAX 16

typedef struct {
    uintptr_t start, size; /* in the running process */
    const char *name;      /* in `strings` */
} func;

typedef struct {
    char *path;
    func *funcs; /* (n) sorted by start */
    size_t n;
    char *strings;
} symfile;

struct td__symbols {
    symfile files[FILES_MAX];
    int n;
};

td__symbols *td__symbols_open(void) { return calloc(1, sizeof(td__symbols)); }

void td__symbols_close(td__symbols *s) {
    for (int i = 0; s && i < s->n; i++) {
        free(s->files[i].path);
        free(s->files[i].funcs);
        free(s->files[i].strings);
    }
    free(s);
}

static int by_start(const void *a, const void *b) {
    const func *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

/* The functions of the ELF file at `path`, loaded at `base`, from its .symtab. */
static void load(symfile *f, const char *path, uintptr_t base) {
    f->path = strdup(path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0 || (size_t)sb.st_size < sizeof(Elf64_Ehdr)) {
        if (fd >= 0) close(fd);
        return;
    }
    size_t size = (size_t)sb.st_size;
    unsigned char *m = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return;
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)m;
    int ok = memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 && eh->e_ident[EI_CLASS] == ELFCLASS64 &&
             eh->e_shoff && eh->e_shentsize == sizeof(Elf64_Shdr) &&
             eh->e_shoff + (size_t)eh->e_shnum * sizeof(Elf64_Shdr) <= size;
    const Elf64_Shdr *sh = ok ? (const Elf64_Shdr *)(m + eh->e_shoff) : NULL;
    /* Executables are linked at their addresses; shared objects and PIEs at base. */
    uintptr_t at = eh->e_type == ET_DYN ? base : 0;
    for (int i = 0; ok && i < eh->e_shnum; i++) {
        if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_link >= eh->e_shnum) continue;
        const Elf64_Shdr *str = &sh[sh[i].sh_link];
        if (sh[i].sh_offset + sh[i].sh_size > size || str->sh_offset + str->sh_size > size) break;
        size_t count = sh[i].sh_size / sizeof(Elf64_Sym);
        const Elf64_Sym *sym = (const Elf64_Sym *)(m + sh[i].sh_offset);
        f->strings = malloc(str->sh_size + 1);
        f->funcs = malloc((count + 1) * sizeof *f->funcs);
        if (!f->strings || !f->funcs) break;
        memcpy(f->strings, m + str->sh_offset, str->sh_size);
        f->strings[str->sh_size] = 0;
        for (size_t k = 0; k < count; k++)
            if (ELF64_ST_TYPE(sym[k].st_info) == STT_FUNC && sym[k].st_size &&
                sym[k].st_name < str->sh_size)
                f->funcs[f->n++] = (func){at + sym[k].st_value, sym[k].st_size,
                                          f->strings + sym[k].st_name};
        qsort(f->funcs, f->n, sizeof *f->funcs, by_start);
        break;
    }
    munmap(m, size);
}

void td__symbolize(td__symbols *s, const void *addr, char *out, size_t cap) {
    Dl_info info;
    uintptr_t a = (uintptr_t)addr;
    if (!dladdr(addr, &info) || !info.dli_fname) {
        snprintf(out, cap, "%p", addr);
        return;
    }
    const char *file = strrchr(info.dli_fname, '/');
    file = file ? file + 1 : info.dli_fname;
    if (info.dli_sname && info.dli_saddr) {
        snprintf(out, cap, "%s+0x%lx (%s)", info.dli_sname,
                 (unsigned long)(a - (uintptr_t)info.dli_saddr), file);
        return;
    }
    symfile *f = NULL;
    for (int i = 0; s && i < s->n && !f; i++)
        if (s->files[i].path && strcmp(s->files[i].path, info.dli_fname) == 0) f = &s->files[i];
    if (!f && s && s->n < FILES_MAX) {
        f = &s->files[s->n++];
        load(f, info.dli_fname, (uintptr_t)info.dli_fbase);
    }
    size_t lo = 0, hi = f ? f->n : 0; /* the last function starting at or before a */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (f->funcs[mid].start <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    const func *fn = lo ? &f->funcs[lo - 1] : NULL;
    if (fn && a < fn->start + fn->size)
        snprintf(out, cap, "%s+0x%lx (%s)", fn->name, (unsigned long)(a - fn->start), file);
    else
        snprintf(out, cap, "%s(+0x%lx)", file, (unsigned long)(a - (uintptr_t)info.dli_fbase));
}
