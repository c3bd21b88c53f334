/* Temporaries of checkpoint saves: "<path>.tmp.XXXXXX" beside the destination, locked while
 * written, and removed by a later save of the same path once their writer is gone (a save
 * killed mid-write leaves one, and nothing else would ever remove it).
 *
 * It touches only names of that one template, and of those only regular files (no links)
 * whose writer's lock is free; it does not write the file or rename it (the caller does). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/temporary_impl.h"
#include "core/core_impl.h"

/* The six characters mkstemp puts in place of XXXXXX. */
static int is_mkstemp_char(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
}

/* Removes what earlier saves of this path left when they were killed mid-write: files in the
 * same directory named by the same template (tmpl is "<path>.tmp.XXXXXX") with mkstemp's six
 * characters in place of the X's. Other checkpoints' temporaries share only a suffix and are
 * left alone.
 *
 * Two processes may save the same path at once. Each save holds an exclusive flock on its
 * temporary from creation until after the rename, and the kernel drops the locks of a process
 * that dies; so a temporary whose lock this can take belongs to no running save, and one whose
 * lock is held is skipped. A saver that finds its fresh temporary unlinked before it could
 * lock it makes another (create_temporary). Hence a concurrent save's temporary is never
 * removed, and path always holds one complete file, from whichever rename came last. Where
 * flock is not supported nothing can be proven dead and nothing is removed.
 *
 * Failures here never fail the save: a directory that cannot be listed makes mkstemp fail with
 * its own message, and a temporary that cannot be removed is only disk space. */
static void remove_stale_temporaries(const char *tmpl) {
    const char *slash = strrchr(tmpl, '/');
    const char *name = slash ? slash + 1 : tmpl;
    size_t name_len = strlen(name), prefix_len = name_len - 6; /* ends in "XXXXXX" */
    char *dir = NULL;
    if (!slash)
        dir = strdup(".");
    else if (slash == tmpl)
        dir = strdup("/");
    else
        dir = strndup(tmpl, (size_t)(slash - tmpl));
    if (!dir) return;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
    if (!d) {
        if (dfd >= 0) close(dfd);
        free(dir);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        const char *en = e->d_name;
        if (strlen(en) != name_len || memcmp(en, name, prefix_len) != 0) continue;
        int ours = 1;
        for (size_t i = prefix_len; i < name_len; i++) ours &= is_mkstemp_char(en[i]);
        if (!ours) continue;
        /* O_NOFOLLOW: a link is never ours; O_NONBLOCK: a FIFO must not block the open;
         * O_RDWR: flock over NFS is a write lock, which needs a writable descriptor. */
        int fd = openat(dirfd(d), en, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) continue;
        struct stat held, named;
        /* The name must still be the file that is locked: another cleaner may have removed
         * it between our readdir and our lock. */
        if (flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &held) == 0 && S_ISREG(held.st_mode) &&
            fstatat(dirfd(d), en, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
            held.st_dev == named.st_dev && held.st_ino == named.st_ino &&
            unlinkat(dirfd(d), en, 0) == 0)
            td__log(TD_LOG_INFO, "%s/%s: removed the temporary file of a save that did not finish",
                    dir, en);
        close(fd); /* drops the lock */
    }
    closedir(d);
    free(dir);
}

/* Creates and locks the temporary for a save (tmpl is "<path>.tmp.XXXXXX", overwritten with
 * the name made); returns its descriptor or -1 with errno set. */
static int create_temporary(char *tmpl) {
    size_t len = strlen(tmpl);
    for (int attempt = 0; attempt < 100; attempt++) {
        memcpy(tmpl + len - 6, "XXXXXX", 6);
        /* O_CLOEXEC: a child the program forks meanwhile must not inherit the lock, or a
         * killed save's temporary would look alive for as long as that child runs. */
        int fd = mkostemp(tmpl, O_CLOEXEC);
        if (fd < 0) return -1;
        /* Blocks only while a concurrent cleaner examines this file, which takes no longer than
         * an unlink; such a cleaner may have removed the name before we held the lock, and then
         * the file has no link left and we make another. A failure other than EINTR means no
         * flock on this filesystem, where no cleaner can lock (and so remove) it either. */
        while (flock(fd, LOCK_EX) != 0 && errno == EINTR) continue;
        struct stat sb;
        if (fstat(fd, &sb) != 0 || sb.st_nlink > 0) return fd;
        close(fd);
    }
    errno = EEXIST;
    return -1;
}

int td__checkpoint_temporary(const char *path, char **name) {
    size_t len = strlen(path) + sizeof ".tmp.XXXXXX";
    char *tmpl = malloc(len);
    if (!tmpl) {
        errno = ENOMEM;
        return -1;
    }
    snprintf(tmpl, len, "%s.tmp.XXXXXX", path);
    remove_stale_temporaries(tmpl);
    int fd = create_temporary(tmpl);
    if (fd < 0) {
        int saved = errno;
        free(tmpl);
        errno = saved;
        return -1;
    }
    *name = tmpl;
    return fd;
}
