/* tandem-consolidate: writes a checkpoint, sharded (td_zero_save's, any world size) or not, as
 * one safetensors file with whole tensors, which PyTorch's safetensors.torch.load_file reads and
 * td_checkpoint_load or td_zero_load resume from.
 *
 *   tandem-consolidate run.st model.safetensors --model-only
 *
 * --model-only leaves out the optimizer's state ("optim.*") and the loss scaler's ("amp.*"), so
 * that the file holds what a model's state_dict does; --drop PREFIX leaves out the tensors whose
 * names begin with PREFIX. The metadata (epoch, step, ...) is kept. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/checkpoint.h"

static void usage(void) {
    fprintf(stderr, "usage: tandem-consolidate CHECKPOINT OUT [--model-only] [--drop PREFIX]...\n"
                    "  writes CHECKPOINT (sharded or not) as one safetensors file OUT\n"
                    "  --model-only   leave out optim.* and amp.* (a model's state_dict)\n"
                    "  --drop PREFIX  leave out tensors whose names begin with PREFIX\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *in = NULL, *out = NULL, **drop = calloc((size_t)argc + 2, sizeof *drop);
    size_t n_drop = 0;
    if (!drop) return 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model-only")) {
            drop[n_drop++] = "optim.";
            drop[n_drop++] = "amp.";
        } else if (!strcmp(argv[i], "--drop") && i + 1 < argc) {
            drop[n_drop++] = argv[++i];
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help") ||
                   !strncmp(argv[i], "--", 2)) {
            usage();
        } else if (!in) {
            in = argv[i];
        } else if (!out) {
            out = argv[i];
        } else {
            usage();
        }
    }
    if (!in || !out) usage();
    td_checkpoint *ck;
    td_status s = td_checkpoint_open(&ck, in);
    int sharded = 0;
    if (s == TD_OK) {
        sharded = td_checkpoint_get_meta(ck, "tandem.parts") != NULL;
        td_checkpoint_close(ck);
    }
    if (s == TD_OK) s = td_checkpoint_consolidate(in, out, drop, n_drop);
    size_t n = 0, bytes = 0;
    if (s == TD_OK) s = td_checkpoint_open(&ck, out);
    if (s == TD_OK) {
        n = td_checkpoint_count(ck);
        for (size_t i = 0; i < n; i++) {
            td_param t;
            if (td_checkpoint_tensor(ck, i, &t) == TD_OK) bytes += t.count * td_dtype_size(t.dtype);
        }
        td_checkpoint_close(ck);
    }
    if (s != TD_OK) {
        fprintf(stderr, "tandem-consolidate: %s: %s\n", td_status_string(s), td_last_error());
        free(drop);
        return 1;
    }
    printf("%s: %zu tensors (%zu bytes) from %s\n", out, n, bytes,
           sharded ? "a sharded checkpoint" : "one file");
    free(drop);
    return 0;
}
