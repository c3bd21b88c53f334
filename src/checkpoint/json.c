/* The strict JSON parser behind safetensors headers: recursive descent over a byte range,
 * producing a tree, with every error reported as "byte N: what was expected".
 *
 * It does not keep number text or key order beyond what the tree holds, and it does not
 * write JSON (the checkpoint writer emits its fixed shape directly). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/json_impl.h"
#include "core/core_impl.h"

#define MAX_DEPTH 64

typedef struct {
    const char *s;
    size_t len, pos;
    char *err;
    size_t err_len;
    int failed;
} parser;

static void fail(parser *p, const char *fmt, ...) {
    if (p->failed) return;
    p->failed = 1;
    int k = snprintf(p->err, p->err_len, "byte %zu: ", p->pos);
    if (k < 0 || (size_t)k >= p->err_len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->err + k, p->err_len - (size_t)k, fmt, ap);
    va_end(ap);
}

/* Byte c is not what JSON allows where it stands: "<what> 'c'", the byte escaped, as it may be
 * any byte. */
static void fail_byte(parser *p, const char *what, char c) {
    char shown[8];
    td__json_escape(shown, sizeof shown, &c, 1);
    fail(p, "%s '%s'", what, shown);
}

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static void free_node(td__json *v) {
    if (!v) return;
    free(v->string);
    for (size_t i = 0; i < v->n; i++) {
        free_node(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    memset(v, 0, sizeof *v);
}

void td__json_free(td__json *v) {
    if (!v) return;
    free_node(v);
    free(v);
}

static int hex4(parser *p, unsigned *out) {
    if (p->len - p->pos < 4) {
        fail(p, "truncated \\u escape");
        return 0;
    }
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p->s[p->pos + i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else {
            fail(p, "bad hex digit in \\u escape");
            return 0;
        }
    }
    p->pos += 4;
    *out = v;
    return 1;
}

static size_t put_utf8(char *o, unsigned cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Parses a string starting at the opening quote; the decoded form is never longer. */
static char *parse_string(parser *p, size_t *out_len) {
    p->pos++; /* opening quote */
    size_t start = p->pos, end = start;
    while (end < p->len && p->s[end] != '"') end += p->s[end] == '\\' ? 2 : 1;
    if (end >= p->len) {
        fail(p, "unterminated string");
        return NULL;
    }
    char *o = malloc(end - start + 1);
    if (!o) {
        fail(p, "out of memory");
        return NULL;
    }
    size_t k = 0;
    while (p->pos < end) {
        unsigned char c = (unsigned char)p->s[p->pos];
        if (c < 0x20) {
            fail(p, "control character 0x%02x inside a string", c);
            goto bad;
        }
        if (c != '\\') {
            o[k++] = (char)c;
            p->pos++;
            continue;
        }
        p->pos++;
        char e = p->s[p->pos++];
        switch (e) {
        case '"':
            o[k++] = '"';
            break;
        case '\\':
            o[k++] = '\\';
            break;
        case '/':
            o[k++] = '/';
            break;
        case 'b':
            o[k++] = '\b';
            break;
        case 'f':
            o[k++] = '\f';
            break;
        case 'n':
            o[k++] = '\n';
            break;
        case 'r':
            o[k++] = '\r';
            break;
        case 't':
            o[k++] = '\t';
            break;
        case 'u': {
            unsigned cp;
            if (!hex4(p, &cp)) goto bad;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (p->pos + 2 > end || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u') {
                    fail(p, "high surrogate without a low surrogate");
                    goto bad;
                }
                p->pos += 2;
                if (!hex4(p, &lo)) goto bad;
                if (lo < 0xDC00 || lo > 0xDFFF) {
                    fail(p, "bad low surrogate");
                    goto bad;
                }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                fail(p, "lone low surrogate");
                goto bad;
            }
            k += put_utf8(o + k, cp);
            break;
        }
        default:
            p->pos--;
            fail_byte(p, "bad escape: a backslash before", e);
            goto bad;
        }
    }
    p->pos = end + 1;
    o[k] = '\0';
    *out_len = k;
    return o;
bad:
    free(o);
    return NULL;
}

static int parse_number(parser *p, td__json *v) {
    size_t start = p->pos;
    int digits_only = 1;
    if (p->pos < p->len && p->s[p->pos] == '-') {
        digits_only = 0;
        p->pos++;
    }
    if (p->pos >= p->len || p->s[p->pos] < '0' || p->s[p->pos] > '9') {
        fail(p, "expected a digit");
        return 0;
    }
    if (p->s[p->pos] == '0')
        p->pos++;
    else
        while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
    if (p->pos < p->len && p->s[p->pos] == '.') {
        digits_only = 0;
        p->pos++;
        size_t d = p->pos;
        while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
        if (p->pos == d) {
            fail(p, "expected a digit after '.'");
            return 0;
        }
    }
    if (p->pos < p->len && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
        digits_only = 0;
        p->pos++;
        if (p->pos < p->len && (p->s[p->pos] == '+' || p->s[p->pos] == '-')) p->pos++;
        size_t d = p->pos;
        while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
        if (p->pos == d) {
            fail(p, "expected a digit in the exponent");
            return 0;
        }
    }
    char buf[64];
    size_t n = p->pos - start;
    v->kind = TD__JSON_NUMBER;
    if (n < sizeof buf) {
        memcpy(buf, p->s + start, n);
        buf[n] = '\0';
        v->number = strtod(buf, NULL);
    } else {
        v->number = 1e308; /* absurdly long numbers are never valid offsets or dims */
    }
    if (digits_only) {
        uint64_t u = 0;
        int ok = 1;
        for (size_t i = start; i < p->pos; i++) {
            unsigned d = (unsigned)(p->s[i] - '0');
            if (u > (UINT64_MAX - d) / 10) {
                ok = 0;
                break;
            }
            u = u * 10 + d;
        }
        v->is_uint = ok;
        v->uint = ok ? u : 0;
    }
    return 1;
}

static int parse_value(parser *p, td__json *v, int depth);

static int grow(parser *p, td__json *v, size_t *cap, int with_keys) {
    if (v->n < *cap) return 1;
    size_t nc = *cap ? *cap * 2 : 4;
    td__json *items = realloc(v->items, nc * sizeof *items);
    if (!items) {
        fail(p, "out of memory");
        return 0;
    }
    v->items = items;
    if (with_keys) {
        char **keys = realloc(v->keys, nc * sizeof *keys);
        if (!keys) {
            fail(p, "out of memory");
            return 0;
        }
        v->keys = keys;
    }
    *cap = nc;
    return 1;
}

static int parse_container(parser *p, td__json *v, int depth, int object) {
    char close = object ? '}' : ']';
    v->kind = object ? TD__JSON_OBJECT : TD__JSON_ARRAY;
    size_t cap = 0;
    p->pos++;
    skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == close) {
        p->pos++;
        return 1;
    }
    for (;;) {
        if (!grow(p, v, &cap, object)) return 0;
        td__json *item = &v->items[v->n];
        memset(item, 0, sizeof *item);
        if (object) {
            skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != '"') {
                fail(p, "expected a string key");
                return 0;
            }
            size_t klen;
            char *key = parse_string(p, &klen);
            if (!key) return 0;
            for (size_t i = 0; i < v->n; i++)
                if (strcmp(v->keys[i], key) == 0) {
                    char shown[128];
                    td__json_escape(shown, sizeof shown, key, klen);
                    fail(p, "duplicate key \"%s\"", shown);
                    free(key);
                    return 0;
                }
            v->keys[v->n] = key;
            skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':') {
                v->n++; /* so the key is freed */
                fail(p, "expected ':'");
                return 0;
            }
            p->pos++;
        }
        v->n++;
        if (!parse_value(p, item, depth + 1)) return 0;
        skip_ws(p);
        if (p->pos < p->len && p->s[p->pos] == ',') {
            p->pos++;
            continue;
        }
        if (p->pos < p->len && p->s[p->pos] == close) {
            p->pos++;
            return 1;
        }
        fail(p, "expected ',' or '%c'", close);
        return 0;
    }
}

static int literal(parser *p, const char *word) {
    size_t n = strlen(word);
    if (p->len - p->pos >= n && memcmp(p->s + p->pos, word, n) == 0) {
        p->pos += n;
        return 1;
    }
    fail_byte(p, "unexpected character", p->s[p->pos]);
    return 0;
}

static int parse_value(parser *p, td__json *v, int depth) {
    if (depth > MAX_DEPTH) {
        fail(p, "nesting deeper than %d", MAX_DEPTH);
        return 0;
    }
    skip_ws(p);
    if (p->pos >= p->len) {
        fail(p, "unexpected end of input");
        return 0;
    }
    char c = p->s[p->pos];
    switch (c) {
    case '{':
        return parse_container(p, v, depth, 1);
    case '[':
        return parse_container(p, v, depth, 0);
    case '"':
        v->kind = TD__JSON_STRING;
        v->string = parse_string(p, &v->string_len);
        return v->string != NULL;
    case 't':
        v->kind = TD__JSON_BOOL;
        v->boolean = 1;
        return literal(p, "true");
    case 'f':
        v->kind = TD__JSON_BOOL;
        return literal(p, "false");
    case 'n':
        v->kind = TD__JSON_NULL;
        return literal(p, "null");
    default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number(p, v);
        fail_byte(p, "unexpected character", c);
        return 0;
    }
}

td__json *td__json_parse(const char *text, size_t len, char *err, size_t err_len) {
    parser p = {text, len, 0, err, err_len, 0};
    if (err_len) err[0] = '\0';
    td__json *v = calloc(1, sizeof *v);
    if (!v) {
        fail(&p, "out of memory");
        return NULL;
    }
    if (!parse_value(&p, v, 0)) {
        td__json_free(v);
        return NULL;
    }
    skip_ws(&p);
    if (p.pos != len) {
        fail(&p, "trailing characters after the JSON value");
        td__json_free(v);
        return NULL;
    }
    return v;
}

const td__json *td__json_get(const td__json *o, const char *key) {
    if (!o || o->kind != TD__JSON_OBJECT) return NULL;
    for (size_t i = 0; i < o->n; i++)
        if (strcmp(o->keys[i], key) == 0) return &o->items[i];
    return NULL;
}
