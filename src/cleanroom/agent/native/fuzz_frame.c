/*
 * libFuzzer target: the native agent's frame reader and JSON walker over arbitrary bytes
 * (what a host, or anything that reaches the port, could send). Every frame read is walked
 * as the agent would: its keys, strings and numbers decoded. The same bytes as a guest file
 * name must encode to one valid JSON string (jb_name). A frame with an id is classified as
 * mux.c's reading thread does, and a request's "user" looked up in /etc/passwd, /etc/group.
 * A CONNECT's port is read as port.c reads it: whatever it takes is 1..65535.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastseed.h"
#include "frame.h"
#include "mux.h"
#include "port.h"

struct mem {
    const uint8_t *p;
    size_t n;
};

static ssize_t mem_read(void *ctx, void *buf, size_t n) {
    struct mem *m = ctx;
    if (n > m->n)
        n = m->n;
    if (n > 7) /* short reads, as a port gives them */
        n = n / 2 + 1;
    memcpy(buf, m->p, n);
    m->p += n;
    m->n -= n;
    return (ssize_t)n;
}

static void walk(jspan v, int depth) {
    char buf[512];
    int64_t i;
    double d;
    (void)json_string(v, buf, sizeof buf, NULL);
    free(json_strdup(v));
    (void)json_int(v, &i);
    (void)json_number(v, &d);
    if (depth > 8)
        return;
    size_t pos = 0;
    jspan key, value;
    while (json_next(v, &pos, &key, &value)) {
        walk(value, depth + 1);
        if (json_is(v, '{'))
            walk(key, depth + 1);
    }
}

/* The agent writes any guest file name with jb_name: whatever the bytes, the result must be
 * one JSON string the host can parse (a bad name is refused there, by name). */
static void name_is_json(const uint8_t *data, size_t size) {
    jbuf b = {0};
    jb_name(&b, (const char *)data, size);
    if (!b.failed && (json_check(b.p, b.n) || !json_is((jspan){b.p, b.n}, '"')))
        abort();
    jb_free(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static struct reader r;
    name_is_json(data, size < 4096 ? size : 4096);
    struct fastseed_header seed; /* a clone's RESEED header, on its own path */
    if (fastseed_parse(data, size, &seed) &&
        (!seed.has_id || json_check_object((const char *)data, size)))
        abort(); /* what it takes must be a JSON object the general reader takes too */
    struct mem m = {data, size};
    memset(&r, 0, sizeof r);
    r.read = mem_read;
    r.ctx = &m;
    for (int n = 0; n < 8; n++) {
        struct frame f;
        const char *why;
        if (frame_read(&r, &f, &why) != FRAME_OK)
            break;
        jspan h = frame_header(&f);
        walk(h, 0);
        jspan v;
        (void)json_get(h, "argv", &v);
        (void)json_get(h, "path", &v);
        int64_t id;
        jspan idv;
        int what = mux_classify(&f, &id, &idv);
        if (what != MUX_NOT && json_check(idv.p, idv.n))
            abort(); /* the id it echoes in a FAILED must be one JSON value */
        int port = 0;
        if (!port_of(h, &port) && (port < 1 || port > 65535))
            abort(); /* a CONNECT may only ever dial a port of the guest's own loopback */
        char *user = json_get(h, "user", &v) ? NULL : json_strdup(v);
        if (user) {
            unsigned uid, gid, groups[8];
            char home[64], name[64];
            size_t ngroups;
            (void)mux_lookup_user(user, &uid, &gid, home, sizeof home, name, sizeof name, groups,
                                  &ngroups, 8);
            free(user);
        }
        frame_free(&f);
    }
    return 0;
}
