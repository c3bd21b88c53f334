/* The rendezvous store: a small TCP key-value store (torch.distributed.TCPStore) that one
 * process of the job hosts (rank 0, on MASTER_ADDR:MASTER_PORT) and every rank connects to.
 * It carries bootstrap data (shared-memory names, later NCCL ids) and barrier-like
 * rendezvous. The host listens only on the address it is given. Every connection must first
 * present the job's token; strangers are dropped, and shed first when the store fills up.
 * It is not a database: values are small (<= 1 MiB) and live as long as the host process. */
#ifndef TANDEM_STORE_H
#define TANDEM_STORE_H

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The key under which the host keeps the address ("10.0.0.2:40112", a NUL-terminated string)
 * of the last connection it refused for presenting another token: a client waiting for a peer
 * can tell that the peer came with a different token instead of waiting out its timeout. */
#define TD_STORE_KEY_DENIED "tandem/store/denied"

/* A connection to the store (and, when hosting, the server thread). */
typedef struct td_store td_store;

/* Largest key and value the store accepts, in bytes. */
#define TD_STORE_MAX_KEY 512
#define TD_STORE_MAX_VALUE (1u << 20)
/* Longest token, in bytes: strangers must not make the host buffer more than this. */
#define TD_STORE_MAX_TOKEN 4096

/* How to reach (or host) the store. */
typedef struct {
    /* Address to connect to, and the only one listened on when hosting: a name means every
     * IPv4 address it resolves to here, 0.0.0.0 every interface. NULL: 127.0.0.1 */
    const char *host;
    int port;          /* when hosting, 0 picks a free port (see td_store_port) */
    int is_server;     /* non-zero: host the store in this process on a background thread */
    const char *token; /* the job's token every connection presents; NULL: empty token */
    double timeout_s;  /* bound on connecting and on every request; 0: 30 s */
    /* zeros: room for later options (core.h) */
    unsigned char reserved[64];
} td_store_params;

/* The defaults above: a client of 127.0.0.1:29500. */
td_store_params td_store_default_params(void);

/* Connects, hosting first when asked; until the timeout it retries while the host is not up
 * yet or closes the connection unanswered. TD_EAUTH when the host rejects the token,
 * TD_EBACKEND when it is full of other authenticated clients, TD_EIO when it cannot listen
 * on `host` (not an address of this machine, or the port is taken). */
td_status td_store_create(td_store **out, const td_store_params *params);

/* Closes the connection; a host also stops serving (other clients then see TD_EPEER). */
void td_store_destroy(td_store *store);

/* The port the store listens on (useful after hosting on port 0). */
int td_store_port(const td_store *store);

/* Sets the bound on every later request, in seconds (> 0). */
td_status td_store_set_timeout(td_store *store, double seconds);

/* Stores `len` bytes under `key`, replacing any previous value, and wakes its waiters. */
td_status td_store_set(td_store *store, const char *key, const void *value, size_t len);

/* Waits (up to the timeout) until `key` exists, then copies its value into `value`
 * (at most `cap` bytes; *len gets the full length). TD_ETIMEOUT names the key. */
td_status td_store_get(td_store *store, const char *key, void *value, size_t cap, size_t *len);

/* Waits until `key` exists, up to `timeout_s` seconds (<= 0: the store's timeout). */
td_status td_store_wait(td_store *store, const char *key, double timeout_s);

/* Atomically adds `delta` to the 64-bit counter `key` (created at 0) and returns the new
 * value in *result (may be NULL). */
td_status td_store_add(td_store *store, const char *key, int64_t delta, int64_t *result);

#ifdef __cplusplus
}
#endif
#endif
