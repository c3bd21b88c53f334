/* A small strict JSON parser for safetensors headers (RFC 8259: no comments, no trailing
 * commas, no NaN, valid escapes, nesting depth at most 64). Not installed.
 *
 * It builds a tree of malloc'd nodes; it is meant for headers of a few MB, not big documents. */
#ifndef TANDEM_CHECKPOINT_JSON_IMPL_H
#define TANDEM_CHECKPOINT_JSON_IMPL_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    TD__JSON_NULL,
    TD__JSON_BOOL,
    TD__JSON_NUMBER,
    TD__JSON_STRING,
    TD__JSON_ARRAY,
    TD__JSON_OBJECT,
} td__json_kind;

typedef struct td__json td__json;
struct td__json {
    td__json_kind kind;
    int boolean;
    double number;
    int is_uint; /* a number written as digits only that fits in uint64 */
    uint64_t uint;
    char *string; /* NUL-terminated UTF-8 (may contain \0 written as \u0000) */
    size_t string_len;
    size_t n;        /* items of an array or object */
    td__json *items; /* (n) */
    char **keys;     /* (n) object keys, NUL-terminated */
};

/* Parses text[0..len); on failure returns NULL and writes a message with the byte offset to
 * err. The whole input must be one value with only whitespace around it. */
td__json *td__json_parse(const char *text, size_t len, char *err, size_t err_len);

/* Frees a tree from td__json_parse; NULL-safe. */
void td__json_free(td__json *value);

/* The member of an object named key, or NULL. */
const td__json *td__json_get(const td__json *object, const char *key);

#endif
