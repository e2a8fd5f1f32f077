/*
 * cleanroom-agent (native): PID 1 of every cleanroom VM, the one guest agent. It needs
 * nothing from the image: static, no Python, no shell.
 *
 * It finds the control port (the virtio-serial port named "ctl" in /sys/class/virtio-ports, or
 * the unix socket in CLEANROOM_AGENT_SOCKET), says HELLO and serves the host's frames as the
 * framed protocol (agent/protocol.py) says: PING, SHUTDOWN, SNAPSHOT_PREPARE, RESEED on the
 * reading thread; RUN (command entrypoints), one at a time, on a request thread started before
 * HELLO (so a snapshot template holds it); the numbered requests (EXEC, UPLOAD, DOWNLOAD, FS,
 * CONNECT, ...) several at once in mux.c (the first protocol's unnumbered EXEC, PUT and GET
 * are retired); HEARTBEAT every
 * second while a request runs. A closed channel powers the VM off, except after
 * SNAPSHOT_PREPARE: then it waits for the next host (a clone's), whose RESEED mixes host
 * entropy into the kernel's pool (credited), forces a CRNG reseed, sets the clock and gets a
 * new HELLO. /proc/sys/kernel/random/boot_id is never read (each clone makes its own).
 *
 * As PID 1 it forks: the parent reaps orphans and powers off when the agent child ends.
 * The host distrusts every byte of this program's output (agent/wire.py, session.py).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bulk.h"
#include "fastseed.h"
#include "frame.h"
#include "json.h"
#include "mux.h"
#include "net.h"
#include "proc.h"
#include "gym.h"
#include "warm.h"

#define AGENT_VERSION "0.7.1"
#define PORT_NAME "ctl"
#define BASE_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

enum {
    MAX_NAME = 1024,     /* protocol.MAX_NAME: bytes of an artifact name */
    MAX_NAME_PARTS = 32, /* protocol.MAX_NAME_PARTS */
    MAX_SECRETS = 256,
    MAX_ENTROPY = 1024, /* of a RESEED's body kept for function episodes' seeds */
    THREAD_STACK = 256 * 1024, /* the request thread's deepest user: 32 nested artifact folders */
    MALLOC_KEEP = 4 * 1024 * 1024, /* past a frame (MAX_BODY): below this, malloc keeps the heap */
};
static const double WARM_UP_S = 5.0; /* the worker's answer to a WARM_UP (warm.c: warm_up) */

static int port = -1;
static struct reader rd;
static pthread_mutex_t send_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t state = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER; /* a request is pending, or busy set */
static pthread_cond_t idle = PTHREAD_COND_INITIALIZER;
static int busy, has_pending, snapshotted;
static int muxed; /* multiplexed requests running (mux.c) */
static int subreaper; /* outside a VM: orphans are this process's to reap */
static int sandbox_pid1; /* started as PID 1 (a VM's, or a gVisor sandbox's) */
static struct frame pending;
static int pool = -1; /* /dev/urandom for writing, opened at SNAPSHOT_PREPARE */
static char root[4096]; /* the guest root: $CLEANROOM_GUEST_ROOT/run/cleanroom */
static char agent_dir[4096]; /* the folder of this binary (worker.py, ../entry.json) */
static unsigned char entropy[MAX_ENTROPY]; /* the host's last RESEED bytes */
static size_t nentropy;

static void log_msg(const char *what, const char *detail) {
    char line[1024];
    int n = snprintf(line, sizeof line, "cleanroom-agent: %s%s%s\n", what, detail ? ": " : "",
                     detail ? detail : "");
    if (n > 0) {
        ssize_t ignored = write(2, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
        (void)ignored;
    }
}

static ssize_t fd_read(void *ctx, void *buf, size_t n) { return read(*(int *)ctx, buf, n); }

/* one encoded frame, whole, to the port (frames of two threads never interleave) */
static void send_raw(const void *data, size_t total) {
    const unsigned char *p = data;
    pthread_mutex_lock(&send_lock);
    for (size_t off = 0; off < total;) {
        ssize_t w = write(port, p + off, total - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break; /* the host is gone: reading the port will say so */
        off += (size_t)w;
    }
    pthread_mutex_unlock(&send_lock);
}

/* A multiplexed EXEC's EXIT, held by its thread until the DONE that follows it, so both go
 * to the port in one write (each write is a trip through the virtio queue); any other frame
 * of that thread sends it first, so the order stays. */
static __thread unsigned char *held;
static __thread size_t held_n;

static void send_held(unsigned char *data, size_t total) {
    if (!held) {
        send_raw(data, total);
        return;
    }
    unsigned char *both = data ? realloc(held, held_n + total) : held;
    if (both && data) {
        memcpy(both + held_n, data, total);
        send_raw(both, held_n + total);
    } else {
        send_raw(held, held_n); /* out of memory: one after the other */
        if (data)
            send_raw(data, total);
    }
    free(both ? both : held);
    held = NULL;
}

/* one frame; a multiplexed request's thread (mux.c) has its id put first in the header */
static void send_frame(int kind, const char *header, const void *body, size_t blen) {
    size_t total;
    jbuf tagged = {0};
    int64_t id = mux_current_id();
    if (id >= 0) {
        jb_lit(&tagged, "{\"id\":");
        jb_int(&tagged, id);
        if (header && strlen(header) > 2) {
            jb_lit(&tagged, ",");
            jb_lit(&tagged, header + 1); /* the rest of "{...}" */
        } else {
            jb_lit(&tagged, "}");
        }
        if (tagged.failed) {
            jb_free(&tagged);
            send_held(NULL, 0);
            return;
        }
        header = tagged.p;
    }
    unsigned char *data =
        frame_encode(kind, header, header ? strlen(header) : 0, body, blen, &total);
    jb_free(&tagged);
    if (!data) {
        send_held(NULL, 0);
        return;
    }
    if (kind == K_EXIT && id >= 0 && !held) {
        held = data; /* its DONE comes next */
        held_n = total;
        return;
    }
    send_held(data, total);
    free(data);
}

static void send_error(const char *message) {
    jbuf h = {0};
    jb_lit(&h, "{\"message\":");
    jb_str(&h, message, strlen(message));
    jb_lit(&h, "}");
    send_frame(K_ERROR, h.failed ? NULL : h.p, NULL, 0);
    jb_free(&h);
}

static void send_errno(const char *what, const char *path, int err) {
    char msg[8192];
    snprintf(msg, sizeof msg, "%s: [Errno %d] %s: '%s'", what, err, strerror(err), path);
    send_error(msg);
}

static uint64_t micros(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* HELLO: who this agent is, plus `extra` (",key:value..." of a clone's reseed facts); only
 * encoded, not sent, when `send` is 0 (the rehearsal before a snapshot) */
/* HELLO's fields but boot_time_s and a clone's facts: "{..." without the closing brace */
static void hello_fields(jbuf *h) {
    struct utsname u;
    uname(&u);
    jb_lit(h, "{\"agent_version\":\"" AGENT_VERSION "\",\"protocol\":1,\"agent\":\"native\"");
    jb_key(h, "kernel");
    jb_str(h, u.release, strlen(u.release));
    jb_key(h, "pid");
    jb_int(h, getpid());
    /* of protocol.FEATURES what mux.c serves, and gym where gym.c can run a gym process */
    jb_lit(h, ",\"features\":[\"mux\",\"stdin\",\"spawn\",\"pty\",\"user\",\"stream\",\"tar\",\"fs\","
              "\"port\"");
    if (bulk_size() > 0)
        jb_lit(h, ",\"bulk\"");
    jb_lit(h, gym_available() ? ",\"gym\"]" : "]");
    warm_hello(h);
    net_hello(h);
}

static void hello(const char *extra, int send) {
    jbuf h = {0};
    hello_fields(&h);
    jb_key(&h, "boot_time_s");
    jb_fixed(&h, micros(CLOCK_BOOTTIME) / 10000 * 10000);
    if (extra)
        jb_lit(&h, extra);
    jb_lit(&h, "}");
    if (send)
        send_frame(K_HELLO, h.failed ? NULL : h.p, NULL, 0);
    jb_free(&h);
}

/* -- files -------------------------------------------------------------------------------- */

static void prepare_guest_root(void) {
    char path[4200];
    snprintf(path, sizeof path, "%s/out/", root);
    make_parents(path);
    snprintf(path, sizeof path, "%s/secrets", root);
    mkdir(path, 0700);
}

/* A file as chunks: FILE {name, offset, eof, kind}, or for kind "result" RESULT {present,
 * offset, eof}; at most `limit` bytes (0: no limit). 0, or -1 with errno if it cannot be read. */
static int send_fd(int fd, const char *name, const char *kind, size_t limit) {
    static unsigned char buf[CHUNK];
    size_t offset = 0;
    int result = strcmp(kind, "result") == 0;
    for (;;) {
        size_t want = CHUNK;
        if (limit && limit - offset < want)
            want = limit - offset;
        size_t got = 0;
        while (got < want) {
            ssize_t k = read(fd, buf + got, want - got);
            if (k < 0 && errno == EINTR)
                continue;
            if (k < 0)
                return -1;
            if (k == 0)
                break;
            got += (size_t)k;
        }
        int eof = got < CHUNK || (limit && offset + got == limit);
        jbuf h = {0};
        if (result) {
            jb_lit(&h, "{\"present\":true");
        } else {
            jb_lit(&h, "{\"name\":");
            jb_name(&h, name, strlen(name));
        }
        jb_key(&h, "offset");
        jb_int(&h, (int64_t)offset);
        jb_lit(&h, eof ? ",\"eof\":true" : ",\"eof\":false");
        if (!result) {
            jb_key(&h, "kind");
            jb_str(&h, kind, strlen(kind));
        }
        jb_lit(&h, "}");
        send_frame(result ? K_RESULT : K_FILE, h.failed ? NULL : h.p, buf, got);
        jb_free(&h);
        offset += got;
        if (eof)
            return 0;
    }
}

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every regular file under the folder `dirfd` (never through a symlink), files before
 * folders, each sorted by name, as FILE frames of kind "artifact" named by relative path. */
static void send_artifacts(int folder, const char *prefix, int depth) {
    DIR *dir = fdopendir(folder);
    if (!dir) {
        close(folder);
        return;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 32;
            char **more = realloc(names, cap * sizeof *names);
            if (!more)
                break;
            names = more;
        }
        if (!(names[n] = strdup(e->d_name)))
            break;
        n++;
    }
    if (n)
        qsort(names, n, sizeof *names, cmp_names);
    for (int pass = 0; pass < 2; pass++) { /* files, then folders */
        for (size_t i = 0; i < n; i++) {
            struct stat st;
            char *rel = NULL; /* any name: the host judges it (and refuses a bad one by name) */
            if (fstatat(dirfd(dir), names[i], &st, AT_SYMLINK_NOFOLLOW) ||
                asprintf(&rel, "%s%s%s", prefix, *prefix ? "/" : "", names[i]) < 0)
                continue;
            if (pass == 0 && S_ISREG(st.st_mode)) {
                int fd = openat(dirfd(dir), names[i], O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
                struct stat fst;
                if (fd >= 0 && !fstat(fd, &fst) && S_ISREG(fst.st_mode))
                    send_fd(fd, rel, "artifact", 0);
                if (fd >= 0)
                    close(fd);
            } else if (pass == 1 && S_ISDIR(st.st_mode) && depth + 1 < MAX_NAME_PARTS) {
                int sub = openat(dirfd(dir), names[i],
                                 O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                if (sub >= 0)
                    send_artifacts(sub, rel, depth + 1);
            }
            free(rel);
        }
    }
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    closedir(dir);
}

/* -- requests ----------------------------------------------------------------------------- */

/* the base environment, then the object `extra` (string values), over it; -1 if malformed */
static int env_of(struct env *e, jspan extra) {
    if (env_set(e, "PATH", BASE_PATH) || env_set(e, "HOME", "/root") ||
        env_set(e, "LANG", "C.UTF-8") || net_env(e))
        return -1;
    if (!json_is(extra, '{'))
        return json_is(extra, 'n') || extra.n == 0 ? 0 : -1;
    size_t pos = 0;
    jspan k, v;
    while (json_next(extra, &pos, &k, &v)) {
        char *key = json_strdup(k), *value = json_strdup(v);
        int bad = !key || !value || !*key || strchr(key, '=') || env_set(e, key, value);
        free(key);
        free(value);
        if (bad)
            return -1;
    }
    return 0;
}

static jspan field(const struct frame *f, const char *key) {
    jspan v = {"", 0};
    json_get(frame_header(f), key, &v);
    return v;
}

/* A request's environment: the base one, its "env" over it, then `extra_env` (NULL: none)
 * over both; -1 if "env" is malformed */
static int request_env(const struct frame *f, const struct env *extra_env, struct env *env) {
    int ok = env_of(env, field(f, "env")) == 0;
    for (size_t i = 0; ok && extra_env && i < extra_env->n; i++) {
        char *eq = strchr(extra_env->items[i], '=');
        *eq = 0;
        ok = env_set(env, extra_env->items[i], eq + 1) == 0;
        *eq = '=';
    }
    return ok ? 0 : -1;
}

static void exec_request(const struct frame *f, jspan argv_span, const struct env *extra_env,
                         struct timed_file *timed, size_t ntimed) {
    char **argv = argv_of(argv_span);
    struct env env = {0};
    char *cwd = NULL;
    jspan cwd_span = field(f, "cwd");
    if (json_is(cwd_span, '"'))
        cwd = json_strdup(cwd_span);
    int ok = argv && request_env(f, extra_env, &env) == 0;
    if (!ok || (json_is(cwd_span, '"') && !cwd))
        send_error("ValueError: argv must be a list of strings, env an object of strings");
    else
        run_process(send_frame, argv, env.items, cwd && *cwd ? cwd : "/",
                    timeout_of(field(f, "timeout_s")), timed, ntimed);
    free(cwd);
    free_argv(argv);
    env_free(&env);
}

/* A function entrypoint: relayed to the warm Python worker (warm.c), which sends EXIT */
static void function_request(const struct frame *f, const struct env *extra_env,
                             struct timed_file *timed, size_t ntimed) {
    struct env env = {0}, base = {0};
    jspan none = {"", 0};
    if (request_env(f, extra_env, &env) || env_of(&base, none))
        send_error("ValueError: env must be an object of strings");
    else
        warm_run(send_frame, field(f, "function"), root, field(f, "cwd"), env.items, base.items,
                 entropy, nentropy, timeout_of(field(f, "timeout_s")), timed, ntimed);
    env_free(&env);
    env_free(&base);
}

static int write_file(const char *path, const char *data, size_t n, mode_t mode) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0)
        return -1;
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, data + done, n - done);
        if (w <= 0)
            break;
        done += (size_t)w;
    }
    close(fd);
    return done == n ? 0 : -1;
}

static int safe_secret_name(const char *name) {
    return *name && !strchr(name, '/') && strcmp(name, ".") && strcmp(name, "..");
}

/* RUN: manifest in, entrypoint run (secrets as files meanwhile), artifacts and result out */
static void run_request(const struct frame *f) {
    char path[4300];
    jspan function = field(f, "function");
    if (function.n && !json_is(function, '{') && !json_is(function, 'n')) {
        send_error("ValueError: RUN's function must be an object (the warm worker's config)");
        return;
    }
    prepare_guest_root();
    jspan manifest = field(f, "manifest");
    snprintf(path, sizeof path, "%s/manifest.json", root);
    if (write_file(path, manifest.n ? manifest.p : "null", manifest.n ? manifest.n : 4, 0644)) {
        send_errno("OSError", path, errno);
        return;
    }
    struct timed_file secrets[MAX_SECRETS];
    size_t nsecrets = 0;
    jspan files = field(f, "secret_files"), lifetimes = field(f, "secret_lifetimes");
    size_t pos = 0;
    jspan k, v;
    int bad = 0;
    while (!bad && json_is(files, '{') && json_next(files, &pos, &k, &v)) {
        char *name = json_strdup(k), *value = json_strdup(v);
        bad = !name || !value || !safe_secret_name(name) || nsecrets == MAX_SECRETS;
        if (!bad) {
            snprintf(path, sizeof path, "%s/secrets/%s", root, name);
            bad = write_file(path, value, strlen(value), 0600) != 0;
        }
        if (!bad) {
            jspan life;
            double seconds;
            secrets[nsecrets].path = strdup(path);
            secrets[nsecrets].at = -1;
            if (!json_get(lifetimes, name, &life) && !json_number(life, &seconds) && seconds > 0)
                secrets[nsecrets].at = monotonic_s() + seconds;
            bad = !secrets[nsecrets].path;
            nsecrets += !bad;
        }
        free(name);
        free(value);
    }
    if (bad) {
        send_error("ValueError: secret_files must map plain names to strings");
    } else {
        struct env extra = {0};
        if (env_set(&extra, "CLEANROOM_DIR", root)) {
            send_error("MemoryError");
        } else {
            /* the request's env goes over CLEANROOM_DIR: exec_request reads "env" itself, so
             * CLEANROOM_DIR is set first only when the header does not name it */
            jspan env = field(f, "env");
            jspan named;
            if (json_is(env, '{') && !json_get(env, "CLEANROOM_DIR", &named))
                env_free(&extra);
            if (json_is(function, '{'))
                function_request(f, extra.n ? &extra : NULL, secrets, nsecrets);
            else
                exec_request(f, field(f, "entrypoint"), extra.n ? &extra : NULL, secrets,
                             nsecrets);
        }
        env_free(&extra);
    }
    for (size_t i = 0; i < nsecrets; i++) { /* a secret lives no longer than the entrypoint */
        unlink(secrets[i].path);
        free(secrets[i].path);
    }
    if (bad)
        return;
    snprintf(path, sizeof path, "%s/out", root);
    int out = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (out >= 0)
        send_artifacts(out, "", 0);
    snprintf(path, sizeof path, "%s/result.json", root);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && !fstat(fd, &st) && S_ISREG(st.st_mode))
        send_fd(fd, "result.json", "result", RESULT_MAX_BYTES + 1);
    else
        send_frame(K_RESULT, "{\"present\":false}", NULL, 0);
    if (fd >= 0)
        close(fd);
    send_frame(K_DONE, NULL, NULL, 0);
}

static void handle(const struct frame *f) {
    switch (f->kind) {
    case K_RUN:
        run_request(f);
        break;
    default: {
        char msg[64];
        snprintf(msg, sizeof msg, "unexpected frame %d", f->kind);
        send_error(msg);
    }
    }
}

/* Outside a VM (a subreaper): the orphans a request left behind, each by its pid, never a
 * process of a running multiplexed request (its thread waits for that one itself). */
static void reap_orphans(void) {
    while (subreaper) {
        siginfo_t si;
        memset(&si, 0, sizeof si);
        if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) || si.si_pid <= 0)
            return;
        pthread_mutex_lock(&state);
        int others = muxed;
        pthread_mutex_unlock(&state);
        if (others || mux_owns(si.si_pid))
            return;
        waitpid(si.si_pid, NULL, WNOHANG);
    }
}

/* mux.c's requests count as work: the heartbeat runs, a snapshot waits for them; the last
 * one to end reaps what they left behind */
static void mux_activity(int delta) {
    pthread_mutex_lock(&state);
    muxed += delta;
    int none = muxed == 0;
    pthread_cond_broadcast(muxed ? &wake : &idle);
    pthread_mutex_unlock(&state);
    if (none && delta < 0)
        reap_orphans();
}

static void *request_thread(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&state);
        while (!has_pending)
            pthread_cond_wait(&wake, &state);
        struct frame f = pending;
        has_pending = 0;
        pthread_mutex_unlock(&state);
        handle(&f);
        frame_free(&f);
        reap_orphans();
        pthread_mutex_lock(&state);
        busy = 0;
        pthread_cond_broadcast(&idle);
        pthread_mutex_unlock(&state);
    }
    return NULL;
}

/* While a request runs, tell the host every second that the agent is alive; idle, it waits
 * without a timer (a restored clone must not spend its first moments waking this thread). */
static void *heartbeat_thread(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&state);
        while (!busy && !muxed)
            pthread_cond_wait(&wake, &state);
        pthread_mutex_unlock(&state);
        struct timespec second = {1, 0};
        while (nanosleep(&second, &second) && errno == EINTR)
            ;
        pthread_mutex_lock(&state);
        int still = busy || muxed;
        pthread_mutex_unlock(&state);
        if (still) {
            jbuf h = {0};
            jb_lit(&h, "{\"t\":");
            jb_fixed(&h, micros(CLOCK_MONOTONIC));
            jb_lit(&h, "}");
            send_frame(K_HEARTBEAT, h.failed ? NULL : h.p, NULL, 0);
            jb_free(&h);
        }
    }
    return NULL;
}

/* Let a request that sent its last frame finish (the host may already be ahead). */
static int wait_idle(void) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 2;
    pthread_mutex_lock(&state);
    while ((busy || muxed) && pthread_cond_timedwait(&idle, &state, &until) == 0)
        ;
    int ok = !busy && !muxed;
    pthread_mutex_unlock(&state);
    return ok;
}

/* -- snapshots ---------------------------------------------------------------------------- */

/* A clone's RESEED: the host's entropy into the pool, credited (none in the `rehearsal` before
 * the snapshot, which only walks this path so a clone finds its pages and heap in place), a
 * forced CRNG reseed, the clock set; then HELLO with the facts. */
static void reseed(const struct frame *f, int rehearsal) {
    uint64_t started = micros(CLOCK_MONOTONIC);
    jbuf facts = {0};
    jb_lit(&facts, ",\"start\":\"snapshot\",\"reseeder\":\"native\",\"clone_id\":");
    jspan id = field(f, "clone_id");
    if (id.n)
        jb_raw(&facts, id.p, id.n); /* a value of a validated header: valid JSON */
    else
        jb_lit(&facts, "null");
    struct rand_pool_info *info = malloc(sizeof *info + f->blen);
    int ok = info != NULL;
    if (ok) {
        info->entropy_count = rehearsal ? 0 : (int)(8 * f->blen);
        info->buf_size = (int)f->blen;
        memcpy(info->buf, f->body, f->blen);
        ok = write(pool, f->body, f->blen) == (ssize_t)f->blen && !ioctl(pool, RNDADDENTROPY, info) &&
             !ioctl(pool, RNDRESEEDCRNG);
    }
    int err = errno;
    free(info);
    jb_lit(&facts, ok ? ",\"reseeded\":true" : ",\"reseeded\":false");
    if (!ok) {
        jb_key(&facts, "reseed_error");
        const char *why = strerror(err);
        jb_str(&facts, why, strlen(why));
    }
    int64_t when;
    if (rehearsal) {
        /* the clock is left alone */
    } else if (!json_int(field(f, "time_ns"), &when)) {
        struct timespec ts = {(time_t)(when / 1000000000), (long)(when % 1000000000)};
        if (when >= 0 && clock_settime(CLOCK_REALTIME, &ts)) {
            const char *why = strerror(errno);
            jb_key(&facts, "clock_error");
            jb_str(&facts, why, strlen(why));
        }
    }
    jb_key(&facts, "reseed_ms");
    jb_fixed(&facts, (micros(CLOCK_MONOTONIC) - started) * 1000); /* in ms */
    if (!rehearsal) {
        snapshotted = 0; /* a clone now: its host closing the channel ends it */
        nentropy = f->blen < MAX_ENTROPY ? f->blen : MAX_ENTROPY;
        memcpy(entropy, f->body, nentropy); /* function episodes seed their random from it */
    }
    hello(facts.failed ? NULL : facts.p, !rehearsal);
    jb_free(&facts);
}

static void discard(int kind, const char *header, const void *body, size_t blen) {
    (void)kind, (void)header, (void)body, (void)blen;
}

/* Before a snapshot: one EXEC of `true`, its frames dropped, so the pages a clone's first EXEC
 * reads (the program, the loader, libc) are in the template's page cache, not on its disk. */
/* Before a snapshot: RESEED -> HELLO walked once (nothing credited, the clock left alone,
 * nothing sent), so a clone's RESEED finds its code, heap and page tables in place. */
static void rehearse_reseed(void) {
    static const char header[] = "{\"clone_id\":\"env-0000000000000000\",\"time_ns\":0}";
    struct frame f = {0};
    f.kind = K_RESEED;
    f.header = strdup(header);
    f.hlen = sizeof header - 1;
    f.body = calloc(1, 64);
    f.blen = 64;
    if (f.header && f.body)
        reseed(&f, 1);
    frame_free(&f);
}

static void rehearse_exec(void) {
    char *argv[] = {"true", NULL};
    struct env env = {0};
    jspan none = {"", 0};
    if (env_of(&env, none) == 0)
        run_process(discard, argv, env.items, "/", 30, NULL, 0);
    env_free(&env);
}

/* -- serving ------------------------------------------------------------------------------ */

static int open_port(void) {
    const char *sock = getenv("CLEANROOM_AGENT_SOCKET");
    if (sock && *sock) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un addr = {.sun_family = AF_UNIX};
        if (fd < 0 || strlen(sock) >= sizeof addr.sun_path)
            return -1;
        memcpy(addr.sun_path, sock, strlen(sock) + 1);
        return connect(fd, (struct sockaddr *)&addr, sizeof addr) ? -1 : fd;
    }
    for (int tries = 0; tries < 6000; tries++) { /* 30 s */
        DIR *dir = opendir("/sys/class/virtio-ports");
        struct dirent *e;
        while (dir && (e = readdir(dir))) {
            char path[512], name[64];
            if (e->d_name[0] == '.')
                continue;
            snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            ssize_t n = fd >= 0 ? read(fd, name, sizeof name - 1) : -1;
            if (fd >= 0)
                close(fd);
            if (n <= 0)
                continue;
            name[n] = 0;
            name[strcspn(name, "\n")] = 0;
            if (strcmp(name, PORT_NAME))
                continue;
            snprintf(path, sizeof path, "/dev/%s", e->d_name);
            fd = open(path, O_RDWR | O_CLOEXEC);
            if (fd >= 0) {
                closedir(dir);
                return fd;
            }
        }
        if (dir)
            closedir(dir);
        usleep(5000);
    }
    return -1;
}

/* A GYM_* request, answered by the gym process; making or closing an env may take seconds
 * (a module imported, an env constructed): the heartbeat runs meanwhile. */
static void gym_relay(const struct frame *f) {
    int slow = f->kind == K_GYM_MAKE || f->kind == K_GYM_CLOSE;
    if (slow)
        mux_activity(1);
    gym_handle(send_frame, f);
    if (slow)
        mux_activity(-1);
}

static void serve(void) {
    struct env base = {0};
    jspan none = {"", 0};
    if (env_of(&base, none) == 0) { /* a function baseline: its worker is ready before HELLO */
        warm_boot(agent_dir, base.items);
        gym_boot(agent_dir, base.items); /* a baseline with gym.json: its gym process too */
    }
    env_free(&base);
    struct mux_host lent = {send_frame, env_of, mux_activity};
    mux_init(&lent);
    port = open_port();
    if (port < 0) {
        log_msg("control port did not appear", NULL);
        return;
    }
    rd.read = fd_read;
    rd.ctx = &port;
    pthread_t t;
    pthread_attr_t small; /* mlockall at a snapshot locks every stack: keep them small */
    pthread_attr_init(&small);
    pthread_attr_setstacksize(&small, THREAD_STACK);
    pthread_create(&t, &small, request_thread, NULL);
    pthread_create(&t, &small, heartbeat_thread, NULL);
    pthread_attr_destroy(&small);
    hello(NULL, 1);
    for (;;) {
        struct frame f;
        const char *why;
        if (snapshotted && pool >= 0) { /* a clone's first frame: its RESEED, on its own path */
            int fast = fastseed_try(&rd, pool, send_raw, entropy, MAX_ENTROPY, &nentropy);
            if (fast == FAST_DONE) {
                snapshotted = 0; /* a clone now: its host closing the channel ends it */
                continue;
            }
            if (fast == FAST_EOF) {
                rd.start = rd.end = 0; /* the port reads EOF until its host connects */
                usleep(2000);
                continue;
            }
        }
        int st = frame_read(&rd, &f, &why);
        if (st == FRAME_EOF || st == FRAME_CLOSED) {
            if (!snapshotted)
                return;
            rd.start = rd.end = 0; /* a clone: the port reads EOF until its host connects */
            usleep(2000);
            continue;
        }
        if (st != FRAME_OK) {
            log_msg("bad frame from the host", st == FRAME_BAD ? why : "out of memory");
            return;
        }
        if (f.kind == K_PING) {
            jspan t_ = field(&f, "t");
            jbuf h = {0};
            jb_lit(&h, "{\"t\":");
            jb_raw(&h, t_.n ? t_.p : "null", t_.n ? t_.n : 4);
            jb_lit(&h, "}");
            send_frame(K_PONG, h.failed ? NULL : h.p, NULL, 0);
            jb_free(&h);
        } else if (f.kind == K_SHUTDOWN) {
            frame_free(&f);
            return;
        } else if (f.kind == K_SNAPSHOT_PREPARE && wait_idle()) {
            if (pool < 0)
                pool = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
            rehearse_exec();
            rehearse_reseed();
            jbuf fields = {0}; /* a clone's HELLO but its facts, for its RESEED's own path */
            hello_fields(&fields);
            if (fields.failed || fastseed_prepare(fields.p, fields.n))
                log_msg("RESEED takes the general path", "its HELLO prefix did not fit");
            jb_free(&fields);
            mlockall(MCL_CURRENT); /* a clone reads none of these pages from disk */
            snapshotted = 1;
            send_frame(K_OK, "{\"prepared\":true,\"reseeder\":\"native\"}", NULL, 0);
        } else if (f.kind == K_RESEED && pool >= 0 && wait_idle()) {
            reseed(&f, 0);
        } else if (f.kind == K_WARM_UP && wait_idle()) {
            uint64_t started = micros(CLOCK_MONOTONIC);
            int warmed = warm_up(WARM_UP_S);
            jbuf h = {0};
            jb_lit(&h, warmed > 0 ? "{\"warmed\":true" : "{\"warmed\":false");
            jb_key(&h, "warm_up_ms");
            jb_fixed(&h, (micros(CLOCK_MONOTONIC) - started) * 1000);
            jb_lit(&h, "}");
            send_frame(K_OK, h.failed ? NULL : h.p, NULL, 0);
            jb_free(&h);
        } else if (gym_request(f.kind) && json_get(frame_header(&f), "id", &(jspan){0}) != 0) {
            gym_relay(&f); /* inline, a step hands off to no thread */
        } else if (mux_route(&f)) {
            continue; /* routed: mux.c freed it or keeps it */
        } else if (!wait_idle()) {
            send_error("busy: one request at a time");
        } else {
            pthread_mutex_lock(&state);
            pending = f;
            has_pending = 1;
            busy = 1;
            pthread_cond_broadcast(&wake);
            pthread_mutex_unlock(&state);
            continue; /* the request thread frees it */
        }
        frame_free(&f);
    }
}

static void power_off(void) {
    if (!getenv("CLEANROOM_AGENT_SOCKET")) {
        int fd = open("/proc/sysrq-trigger", O_WRONLY);
        if (fd >= 0) {
            ssize_t ignored = write(fd, "o", 1);
            (void)ignored;
            close(fd);
        }
        sleep(5);
    }
    _exit(0);
}

int main(void) {
    /* a transfer's chunks (256 KiB frames) from the heap, reused, not each a fresh mmap: under
     * TCG every first touch of a page is a fault the guest pays for again and again. At most
     * two arenas, so what the heaps keep stays bounded (2 x 2 x MALLOC_KEEP) */
    mallopt(M_MMAP_THRESHOLD, MALLOC_KEEP);
    mallopt(M_TRIM_THRESHOLD, 2 * MALLOC_KEEP);
    mallopt(M_ARENA_MAX, 2);
    const char *relocated = getenv("CLEANROOM_GUEST_ROOT");
    snprintf(root, sizeof root, "%s/run/cleanroom", relocated ? relocated : "");
    ssize_t n = readlink("/proc/self/exe", agent_dir, sizeof agent_dir - 1);
    agent_dir[n > 0 ? n : 0] = 0;
    char *slash = strrchr(agent_dir, '/');
    if (slash)
        *slash = 0; /* its folder */
    signal(SIGPIPE, SIG_IGN);
    /* a terminal's signals are its process's (a PTY's ^C, its hangup): never the agent's */
    int tty_signals[] = {SIGHUP, SIGINT, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU};
    for (size_t i = 0; i < sizeof tty_signals / sizeof *tty_signals; i++)
        signal(tty_signals[i], SIG_IGN);
    if (getpid() != 1) {
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
        subreaper = 1;
        prepare_guest_root();
        serve();
        return 0;
    }
    sandbox_pid1 = 1;
    if (!getenv("PATH"))
        setenv("PATH", BASE_PATH, 1);
    prepare_guest_root();
    net_setup(); /* a NIC only if the episode has an egress allowlist */
    if (!getenv("CLEANROOM_AGENT_SOCKET"))
        bulk_open(); /* a VM's bulk disk, if it has one (gVisor: none) */
    pid_t child = fork();
    if (child == 0) {
        serve();
        _exit(0);
    }
    for (;;) { /* PID 1: reap every orphan; when the agent ends, the VM ends */
        pid_t pid = wait(NULL);
        if (pid < 0 && errno == EINTR)
            continue;
        if (pid < 0 || pid == child)
            break;
    }
    power_off();
}
