/* td_args: the command line of a program, parsed option by option. One parser for tandem's
 * tools, examples and benchmarks, and for a trainer of one's own.
 *
 * GNU long options: `--name VALUE` or `--name=VALUE`, '-' and '_' alike inside a name
 * (torchrun's --nproc_per_node), `-h` or `--help` for the usage, `--` ending the options. The
 * program offers each option it knows to the current argument with what the option takes (an
 * integer in a range, a number, one of some words, ...); a value that is not that is an error
 * naming the option, the value and what it wanted (`--steps 10x: expected an integer >= 1`),
 * and an argument no option took is an unknown option. The parse stops at the first error.
 * The library neither prints nor exits: td_args_finish prints what the parse came to and
 * returns the status the program exits with.
 *
 *   td_args a;
 *   td_args_init(&a, "gpt", argc, argv);
 *   while (td_args_next(&a)) {
 *       td_args_long(&a, "--steps", 1, LONG_MAX, &steps);
 *       td_args_real(&a, "--lr", 0, INFINITY, &lr);
 *       td_args_flag(&a, "--amp", &amp);
 *   }
 *   int rc = td_args_finish(&a, usage_text);   // -1: go on; else exit(rc)
 *   if (rc >= 0) exit(rc);
 */
#ifndef TANDEM_ARGS_H
#define TANDEM_ARGS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A parse in progress; the caller owns it (on the stack), td_args_init fills it. The fields
 * are read-only for the program: `index` is where the parse stands in argv. */
typedef struct {
    int argc;
    char **argv;
    const char *program; /* names the program in messages */
    int index;           /* argv[index] is the current argument */
    int option;          /* argv[option] is the option whose value is being read */
    int taken;           /* an option took the current argument */
    int positional_only; /* past "--": every argument is a positional one */
    int help;            /* -h or --help was given */
    int failed;          /* the parse stopped on an error, said in `message` */
    int show_usage;      /* the error is an unknown option: the usage follows it */
    char message[512];
} td_args;

/* Starts the parse of argv[1..argc) for `program` (as messages name it). */
void td_args_init(td_args *args, const char *program, int argc, char **argv);

/* Moves to the next argument: 1 while there is one to offer to the options; 0 at the end, on
 * --help, or on an error (also when no option took the previous argument). */
int td_args_next(td_args *args);

/* 1 when the current argument is option `name` ("--steps"), which then takes it (with no
 * value): for options whose value the program reads itself (td_args_value). */
int td_args_is(td_args *args, const char *name);

/* The value of the option td_args_is just took (after '=' or the next argument); NULL, with
 * the error recorded, when there is none. */
const char *td_args_value(td_args *args);

/* --name: sets *out to 1. 1 when the argument was this option (so for each call below). */
int td_args_flag(td_args *args, const char *name, int *out);

/* --name with no value: sets *out to `value` (--no-prefix sets a switch to 0). */
int td_args_set(td_args *args, const char *name, int *out, int value);

/* --name TEXT: *out points into argv. */
int td_args_string(td_args *args, const char *name, const char **out);

/* --name N: a decimal integer in [min, max]. */
int td_args_int(td_args *args, const char *name, int min, int max, int *out);

/* --name N: a decimal integer in [min, max], long. */
int td_args_long(td_args *args, const char *name, long min, long max, long *out);

/* --name N: an unsigned 64-bit decimal integer (a seed). */
int td_args_u64(td_args *args, const char *name, uint64_t *out);

/* --name X: a number in [min, max) (max INFINITY: any finite number >= min). */
int td_args_real(td_args *args, const char *name, double min, double max, double *out);

/* --name X: a number above 0 and below max (INFINITY: any finite one). */
int td_args_positive(td_args *args, const char *name, double max, double *out);

/* --name WORD: one of `choices`, words separated by '|' ("naive|gpipe|1f1b"); *out is its
 * index among them. */
int td_args_choice(td_args *args, const char *name, const char *choices, int *out);

/* --name 1,2,4: comma-separated integers, each in [min, max], at most cap of them; *n is their
 * count, out[0..n) the values in the order given. */
int td_args_int_list(td_args *args, const char *name, int min, int max, int *out, int cap, int *n);

/* A positional argument (not an option, or anything after "--"): *out points into argv. */
int td_args_positional(td_args *args, const char **out);

/* Records an error of the current option's value, "NAME VALUE: expected TAKES", for values the
 * program checks itself (after td_args_is and td_args_value). Returns 1, as the option was
 * taken. */
int td_args_bad_value(td_args *args, const char *value, const char *takes);

/* Records an error in the program's own words (options that do not go together, say); the
 * parse stops there. printf-style. */
void td_args_error(td_args *args, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Ends the parse: -1 when the program goes on; otherwise the status it exits with, after
 * printing: 0 after `usage` on stdout for --help, 2 after the error on stderr ("PROGRAM:
 * message", then `usage` for an unknown option, or where to find it). */
int td_args_finish(td_args *args, const char *usage);

#ifdef __cplusplus
}
#endif
#endif
