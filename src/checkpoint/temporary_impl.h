/* The temporary file a checkpoint save writes before renaming it over the destination, and
 * the removal of the ones that killed saves left behind. Not installed. */
#ifndef TANDEM_CHECKPOINT_TEMPORARY_IMPL_H
#define TANDEM_CHECKPOINT_TEMPORARY_IMPL_H

/* Creates "<path>.tmp.XXXXXX" (mkstemp's six characters) in path's directory, after removing
 * the temporaries of path whose writers have died. The descriptor holds an exclusive flock
 * that marks the save as alive, so the caller closes it only after the rename or the unlink.
 * Returns the descriptor and the malloc'd name in *name, or -1 with errno set. */
int td__checkpoint_temporary(const char *path, char **name);

#endif
