/*
 * CONNECT (protocol.py, "port"): a TCP connection to a port of the guest itself, for the
 * server's port proxy (server/ports.py). Only 127.0.0.1 is ever dialled: the request names a
 * port, never an address, so no request can make the agent reach past the guest (its egress
 * rules are the NIC's, unchanged). mux.c relays the bytes both ways (DATA and ACK, within
 * protocol.WINDOW); this file holds what can be checked alone: the request's header and the
 * dial with its deadline.
 */
#ifndef CLEANROOM_PORT_H
#define CLEANROOM_PORT_H

#include "json.h"

enum {
    PORT_CONNECT_MS = 5000, /* a dial that takes longer is FAILED {code: "timeout"} */
    PORT_MAX_OPEN = 64,     /* connections at once; one more is FAILED {code: "busy"} */
};

/* The header's "port": an integer 1..65535 into *port (0), else -1. */
int port_of(jspan header, int *port);

/* A connected, close-on-exec TCP socket to 127.0.0.1:port (>= 0), or -1 with errno
 * (ECONNREFUSED: nothing listens there; ETIMEDOUT: no answer within timeout_ms). */
int port_dial(int port, int timeout_ms);

/* FAILED's code for a dial's errno: "refused", "timeout" or "os_error". */
const char *port_error_code(int err);

#endif
