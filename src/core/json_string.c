/* The body of a JSON string, escaped: for the files tandem writes as JSON (traces, safetensors
 * headers) and for error messages that quote bytes read from a file, which may hold anything;
 * and whether bytes are UTF-8 text, which a JSON file must hold. It does not add the quotes
 * around the body and does not parse JSON (src/checkpoint/json.c). */
#include <stdio.h>

#include "core/core_impl.h"

/* The length of the well-formed UTF-8 sequence at p[0 .. n), or 0 when there is none there. */
static size_t utf8_sequence(const unsigned char *p, size_t n) {
    unsigned lo = 0x80, hi = 0xBF;
    size_t len;
    if (p[0] >= 0xC2 && p[0] <= 0xDF)
        len = 2;
    else if (p[0] >= 0xE0 && p[0] <= 0xEF)
        len = 3, lo = p[0] == 0xE0 ? 0xA0 : lo, hi = p[0] == 0xED ? 0x9F : hi;
    else if (p[0] >= 0xF0 && p[0] <= 0xF4)
        len = 4, lo = p[0] == 0xF0 ? 0x90 : lo, hi = p[0] == 0xF4 ? 0x8F : hi;
    else
        return 0;
    if (n < len || p[1] < lo || p[1] > hi) return 0;
    for (size_t k = 2; k < len; k++)
        if ((p[k] & 0xC0) != 0x80) return 0;
    return len;
}

int td__utf8_valid(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0, len; i < n; i += len)
        if (!(len = p[i] < 0x80 ? 1 : utf8_sequence(p + i, n - i))) return 0;
    return 1;
}

size_t td__json_escape(char *out, size_t cap, const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t need = 0, at = 0;
    int full = 0; /* a unit did not fit: nothing after it is written either */
    for (size_t i = 0; i < n;) {
        char unit[8];
        size_t len = utf8_sequence(p + i, n - i), take = len ? len : 1;
        if (len > 1) {
            for (size_t k = 0; k < len; k++) unit[k] = (char)p[i + k];
        } else if (p[i] == '"' || p[i] == '\\') {
            unit[0] = '\\', unit[1] = (char)p[i], len = 2;
        } else if (p[i] < 0x20 || p[i] >= 0x7F) {
            /* control characters, and bytes that are not UTF-8: their value, visibly */
            snprintf(unit, sizeof unit, "\\u%04x", p[i]);
            len = 6;
        } else {
            unit[0] = (char)p[i], len = 1;
        }
        if (!full && at + len < cap) {
            for (size_t k = 0; k < len; k++) out[at++] = unit[k];
        } else {
            full = 1;
        }
        need += len;
        i += take;
    }
    if (cap) out[at] = '\0';
    return need;
}
