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

#include "tandem/args.h"
#include "tandem/checkpoint.h"

static const char usage[] =
    "usage: tandem-consolidate CHECKPOINT OUT [--model-only] [--drop PREFIX]...\n"
    "  writes CHECKPOINT (sharded or not) as one safetensors file OUT\n"
    "  --model-only   leave out optim.* and amp.* (a model's state_dict)\n"
    "  --drop PREFIX  leave out tensors whose names begin with PREFIX\n";

int main(int argc, char **argv) {
    const char *in = NULL, *out = NULL, **drop = calloc((size_t)argc + 2, sizeof *drop);
    size_t n_drop = 0;
    if (!drop) return 1;
    int model_only = 0;
    td_args a;
    td_args_init(&a, "tandem-consolidate", argc, argv);
    while (td_args_next(&a)) {
        td_args_flag(&a, "--model-only", &model_only);
        if (td_args_string(&a, "--drop", &drop[n_drop])) n_drop += !a.failed;
        if (!in) td_args_positional(&a, &in);
        if (!out) td_args_positional(&a, &out);
    }
    if (!a.failed && !a.help && (!in || !out))
        td_args_error(&a, "give the checkpoint to read and the file to write");
    int rc = td_args_finish(&a, usage);
    if (rc >= 0) {
        free(drop);
        return rc;
    }
    if (model_only) {
        drop[n_drop++] = "optim.";
        drop[n_drop++] = "amp.";
    }
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
