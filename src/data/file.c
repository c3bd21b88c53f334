/* Opening a data set's file: a regular file only, so that a reader never blocks on a FIFO nor
 * reads a device that never ends, and the caller knows the size before it allocates. */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core_impl.h"
#include "data_impl.h"

static const char *file_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}

td_status td__data_open(const char *path, const char *hint, FILE **out, size_t *size) {
    *out = NULL;
    *size = 0;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return td__fail(TD_EIO, "%s: cannot open it: %s%s", path, strerror(errno), hint);
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return td__fail(TD_EIO, "%s: cannot stat it: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return td__fail(TD_EINVAL, "%s is %s, not a regular file: a data set is read from a file",
                        path, file_kind(st.st_mode));
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) (void)fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        int e = errno;
        close(fd);
        return td__fail(TD_EIO, "%s: cannot open it: %s", path, strerror(e));
    }
    *out = f;
    *size = (size_t)st.st_size;
    return TD_OK;
}
