/* What the data readers share: opening a data set's file. Not installed. */
#ifndef TANDEM_DATA_IMPL_H
#define TANDEM_DATA_IMPL_H

#include <stdio.h>

#include "tandem/core.h"

/* Opens `path` for reading, only when it is a regular file: a directory, a FIFO (which blocks
 * until a writer comes), a device (/dev/zero never ends) or a socket is refused, naming what it
 * is. *size is the file's size. A file that cannot be opened is TD_EIO naming the path and the
 * system's reason, followed by `hint` (may be ""). */
td_status td__data_open(const char *path, const char *hint, FILE **out, size_t *size);

#endif
