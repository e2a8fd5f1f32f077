/*
 * The egress NIC, as agent/guestnet.py sets it up: a VM gets a NIC only when its episode has
 * an egress allowlist (QEMU user-mode networking, restrict=on: the only ways out are forwards
 * to the host's egress proxy). The layout is fixed: eth0 GUEST_ADDR/24, a default route via
 * GATEWAY, lo up, /etc/resolv.conf naming DNS_ADDR over TCP; every process the agent starts
 * gets the proxy variables. Without a NIC only lo is brought up (the guest's own 127.0.0.1,
 * for its servers and CONNECT: port.h); outside a VM nothing happens.
 */
#ifndef CLEANROOM_NET_H
#define CLEANROOM_NET_H

#include "json.h"
#include "proc.h"

/* At boot (PID 1, before the agent forks): configure eth0 if there is one. */
void net_setup(void);

/* ,"network":{"address","env"} or {"error"} for HELLO (nothing without a NIC). */
void net_hello(jbuf *h);

/* The proxy variables into `e` (nothing without a configured NIC); -1 when out of memory. */
int net_env(struct env *e);

#endif
