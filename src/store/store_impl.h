/* The rendezvous store's wire format, shared by the server (store_server.c) and the client
 * (store.c). All integers are little-endian. A request is a 16-byte header
 *     u8 op, u8 0, u8 0, u8 0, u32 key_len, u32 value_len, u32 arg
 * followed by key_len key bytes and value_len value bytes. Ops: 1 AUTH (value = token, at
 * most TD_STORE_MAX_TOKEN bytes; must be a connection's first request and the only one it
 * sends before the answer), 2 SET, 3 GET (arg = milliseconds to wait for the key), 4 ADD
 * (value = i64 delta), 5 WAIT (arg = milliseconds). A reply is an 8-byte header
 *     u8 status, u8 0, u8 0, u8 0, u32 value_len
 * and value_len bytes. Status
 *     0 ok (GET: the value, ADD: the new i64);
 *     1 the key did not appear in time;
 *     2 the store is full: sent unasked to a new connection, which the server then closes
 *       (value: u32 connections held, u32 the limit reached, u32 which limit: 1 the store's
 *       slots, 2 the host process's open-file limit);
 *     3 wrong token: the answer to AUTH, after which the server closes the connection.
 * A connection closed without any answer was dropped for a protocol error or a deadline, or
 * shed to make room (see store_server.c); it says nothing about the token. */
#ifndef TANDEM_STORE_IMPL_H
#define TANDEM_STORE_IMPL_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/store.h"

#define STORE_REQ_HDR 16
#define STORE_REP_HDR 8
#define STORE_FULL_LEN 12 /* value of a "full" reply */

enum { OP_AUTH = 1, OP_SET = 2, OP_GET = 3, OP_ADD = 4, OP_WAIT = 5 };
enum { ST_OK = 0, ST_MISSING = 1, ST_FULL = 2, ST_DENIED = 3 };
enum { FULL_SLOTS = 1, FULL_FILES = 2 };

static inline void put_u32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static inline uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void put_i64(unsigned char *p, int64_t v) {
    put_u32(p, (uint32_t)((uint64_t)v & 0xffffffffu));
    put_u32(p + 4, (uint32_t)((uint64_t)v >> 32));
}

static inline int64_t get_i64(const unsigned char *p) {
    return (int64_t)((uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32);
}

static inline struct sockaddr_in sockaddr_of(struct in_addr a, int port) {
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr = a;
    return sa;
}

typedef struct td__store_server td__store_server;

/* Resolves `host` to its IPv4 addresses: itself when numeric (*numeric set), else every
 * address the name resolves to, without repeats, at most `cap`. */
td_status td__store_resolve(const char *host, struct in_addr *out, size_t cap, size_t *n,
                            int *numeric);

/* Listens on every address of `host` on *port (0: a free one, written back) and serves the
 * store on a thread of its own; only clients presenting `token` are served. */
td_status td__store_server_start(td__store_server **out, const char *host, int *port,
                                 const char *token);

/* Stops the thread, closes every connection and frees the store's contents. */
void td__store_server_stop(td__store_server *s);

#endif
