/* Multiplexed requests: see mux.h. */
#define _GNU_SOURCE
#include "mux.h"
#include "bulk.h"
#include "port.h"
#include "pty.h"
#include "tar.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
    MAX_REQUESTS = 128,        /* at once; one more is FAILED {code: "busy"} */
    WINDOW = 16 * 256 * 1024,  /* protocol.WINDOW (16 CHUNKs) */
    MAX_QUEUED = 2 * WINDOW,   /* input a request holds; a host past its window loses the rest */
    MAX_GROUPS = 64,           /* supplementary groups of a user */
    STACK = 256 * 1024,        /* a request thread's stack (relay_step keeps 64 KiB on it) */
};

struct chunk {
    struct chunk *next;
    size_t n;
    unsigned char *data; /* the frame's body, taken over: input is never copied here */
};

/* a chunk and its data (NULL: nothing); never a bare free(c), which would leak the body */
static void chunk_free(struct chunk *c) {
    if (!c)
        return;
    free(c->data);
    free(c);
}

struct request {
    int used, kind, pid, killed, eof;
    int64_t id, acked;
    struct chunk *head, *tail;
    size_t queued;
    struct frame f;
    pthread_t writer;
    int has_writer, has_tty, tty; /* tty: a PTY's master (RESIZE sets its window) */
};

static struct mux_host host;
static struct request table[MAX_REQUESTS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int ports_open; /* CONNECT requests running (port.h: PORT_MAX_OPEN) */
static __thread int64_t current = -1;

void mux_init(const struct mux_host *h) { host = *h; }

int64_t mux_current_id(void) { return current; }

int mux_owns(int pid) {
    int owned = 0;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < MAX_REQUESTS && !owned; i++)
        owned = table[i].used && table[i].pid == pid;
    pthread_mutex_unlock(&lock);
    return owned;
}

static jspan field(const struct frame *f, const char *key) {
    jspan v = {"", 0};
    json_get(frame_header(f), key, &v);
    return v;
}

/* FAILED {code, message} of the calling thread's request (the sender adds its id) */
/* FAILED {id?, code, message}: ``id`` (a value of a validated header: valid JSON) only where
 * the sender does not add it (a refusal on the reading thread) */
static void send_failed(const jspan *id, const char *code, const char *message) {
    jbuf h = {0};
    jb_lit(&h, "{");
    if (id) {
        jb_key(&h, "id");
        jb_raw(&h, id->p, id->n);
    }
    jb_key(&h, "code");
    jb_str(&h, code, strlen(code));
    jb_key(&h, "message");
    jb_str(&h, message, strlen(message));
    jb_lit(&h, "}");
    host.send(K_FAILED, h.failed ? NULL : h.p, NULL, 0);
    jb_free(&h);
}

static void failed(const char *code, const char *message) { send_failed(NULL, code, message); }

/* FAILED's code for an errno (transfers.FAILURES on the host) */
static const char *errno_code(int err) {
    return err == ENOENT || err == ENOTDIR ? "not_found"
           : err == EACCES                 ? "permission"
           : err == EISDIR                 ? "is_a_directory"
                                           : "os_error";
}

/* FAILED for an errno, with errno_code's codes */
static void failed_errno(const char *what, const char *path, int err) {
    const char *code = errno_code(err);
    char msg[4400];
    snprintf(msg, sizeof msg, "%s: [Errno %d] %s: '%.4096s'", what, err, strerror(err), path);
    failed(code, msg);
}

static void send_size(int kind, int64_t size, const char *extra) {
    jbuf h = {0};
    jb_lit(&h, "{\"size\":");
    jb_int(&h, size);
    if (extra)
        jb_lit(&h, extra);
    jb_lit(&h, "}");
    host.send(kind, h.failed ? NULL : h.p, NULL, 0);
    jb_free(&h);
}

/* -- input of a running request (from the reading thread) ----------------------------------- */

static struct request *find(int64_t id) {
    for (size_t i = 0; i < MAX_REQUESTS; i++)
        if (table[i].used && table[i].id == id)
            return &table[i];
    return NULL;
}

static void deliver(struct request *r, struct frame *f) {
    int64_t size;
    if (f->kind == K_KILL) {
        r->killed = 1;
        if (r->pid > 0)
            kill(-r->pid, SIGKILL);
    } else if (f->kind == K_ACK) {
        if (!json_int(field(f, "size"), &size) && size > r->acked)
            r->acked = size;
    } else if (f->kind == K_STDIN || f->kind == K_DATA) {
        if (f->blen && r->queued + f->blen <= MAX_QUEUED) {
            struct chunk *c = malloc(sizeof *c);
            if (c) {
                c->next = NULL;
                c->n = f->blen;
                c->data = f->body;
                f->body = NULL; /* the chunk owns it now (frame_free leaves it) */
                *(r->tail ? &r->tail->next : &r->head) = c;
                r->tail = c;
                r->queued += f->blen;
            }
        }
        if (json_true(field(f, "eof")))
            r->eof = 1;
    } else if (f->kind == K_RESIZE && r->has_tty) {
        int64_t rows, cols;
        if (!json_int(field(f, "rows"), &rows) && !json_int(field(f, "cols"), &cols) &&
            rows > 0 && rows < 65536 && cols > 0 && cols < 65536) {
            struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
            ioctl(r->tty, TIOCSWINSZ, &ws);
        }
    }
    pthread_cond_broadcast(&changed);
}

/* The next chunk of input (the caller frees it); NULL at its end or once killed / done. */
static struct chunk *next_input(struct request *r) {
    pthread_mutex_lock(&lock);
    while (!r->head && !r->eof && !r->killed)
        pthread_cond_wait(&changed, &lock);
    struct chunk *c = r->killed ? NULL : r->head;
    if (c) {
        r->head = c->next;
        if (!r->head)
            r->tail = NULL;
        r->queued -= c->n;
    }
    pthread_mutex_unlock(&lock);
    return c;
}

/* Wait until `size` more bytes fit the receiver's window; 0 if killed meanwhile. */
static int wait_window(struct request *r, int64_t sent, size_t size) {
    pthread_mutex_lock(&lock);
    while (!r->killed && sent - r->acked + (int64_t)size > WINDOW && sent != r->acked)
        pthread_cond_wait(&changed, &lock);
    int ok = !r->killed;
    pthread_mutex_unlock(&lock);
    return ok;
}

static void set_killed(struct request *r) {
    pthread_mutex_lock(&lock);
    r->killed = 1;
    r->pid = 0;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
}

/* -- users --------------------------------------------------------------------------------- */

/* the next line of `f` split at ':' into at most `max` fields; -1 at the end of the file
 * (a line too long for `line` is skipped whole) */
static int next_record(FILE *f, char *line, size_t cap, char **fields, int max) {
    for (;;) {
        if (!fgets(line, (int)cap, f))
            return -1;
        size_t n = strlen(line);
        if (n && line[n - 1] != '\n' && !feof(f)) {
            int ch;
            while ((ch = fgetc(f)) != EOF && ch != '\n')
                ;
            continue;
        }
        line[strcspn(line, "\n")] = 0;
        int k = 0;
        for (char *p = line; k < max; k++) {
            fields[k] = p;
            char *colon = strchr(p, ':');
            if (!colon) {
                k++;
                break;
            }
            *colon = 0;
            p = colon + 1;
        }
        return k;
    }
}

static int parse_id(const char *s, unsigned *out) {
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (!*s || *end || errno || v > 0xfffffffeUL || *s == '-' || *s == '+' || *s == ' ')
        return -1;
    *out = (unsigned)v;
    return 0;
}

int mux_lookup_user(const char *name, unsigned *uid, unsigned *gid, char *home, size_t home_cap,
                    char *user, size_t user_cap, unsigned *groups, size_t *ngroups,
                    size_t max_groups) {
    unsigned wanted;
    int by_uid = *name && strspn(name, "0123456789") == strlen(name) && !parse_id(name, &wanted);
    if (!*name)
        return -1;
    char line[4096], *fl[7];
    FILE *f = fopen("/etc/passwd", "re");
    int found = 0, n;
    while (f && !found && (n = next_record(f, line, sizeof line, fl, 7)) >= 0) {
        unsigned u, g;
        if (n < 6 || parse_id(fl[2], &u) || parse_id(fl[3], &g))
            continue;
        if (by_uid ? u != wanted : strcmp(fl[0], name) != 0)
            continue;
        if (strlen(fl[5]) >= home_cap || strlen(fl[0]) >= user_cap)
            continue;
        *uid = u;
        *gid = g;
        strcpy(home, fl[5]);
        strcpy(user, fl[0]);
        found = 1;
    }
    if (f)
        fclose(f);
    if (!found && (by_uid ? wanted == 0 : strcmp(name, "root") == 0) && home_cap > 5 &&
        user_cap > 4) { /* root needs no /etc/passwd (a FROM scratch or distroless image) */
        *uid = *gid = 0;
        strcpy(home, "/root");
        strcpy(user, "root");
        found = 1;
    }
    if (!found || !max_groups)
        return -1;
    *ngroups = 0;
    groups[(*ngroups)++] = *gid; /* os.getgrouplist: the primary group, then the others */
    f = fopen("/etc/group", "re");
    while (f && (n = next_record(f, line, sizeof line, fl, 4)) >= 0) {
        unsigned g;
        if (n < 4 || parse_id(fl[2], &g) || g == *gid || *ngroups == max_groups)
            continue;
        for (char *m = strtok(fl[3], ","); m; m = strtok(NULL, ",")) {
            if (!strcmp(m, user)) {
                groups[(*ngroups)++] = g;
                break;
            }
        }
    }
    if (f)
        fclose(f);
    return 0;
}

/* -- EXEC ---------------------------------------------------------------------------------- */

struct feed {
    struct request *r;
    int fd, terminal;
};

/* `n` bytes into the pipe or terminal; -1 once the request ended or the process closed its
 * stdin (the rest of the chunk is dropped) */
static int feed_bytes(struct feed *fe, const char *p, size_t n) {
    size_t off = 0;
    while (off < n) {
        ssize_t w = write(fe->fd, p + off, n - off);
        if (w > 0) {
            off += (size_t)w;
        } else if (w < 0 && errno == EAGAIN) {
            struct pollfd pf = {fe->fd, POLLOUT, 0};
            poll(&pf, 1, 100);
            pthread_mutex_lock(&lock);
            int stop = fe->r->killed;
            pthread_mutex_unlock(&lock);
            if (stop)
                return -1;
        } else if (!(w < 0 && errno == EINTR)) {
            return -1;
        }
    }
    return 0;
}

/* stdin: the request's input into the pipe (non-blocking: it stops once the request ends),
 * ACK {size} after each chunk; on a terminal that signals nobody its ^C is SIGINT (pty.h) */
static void *feed_stdin(void *arg) {
    struct feed *fe = arg;
    current = fe->r->id;
    int64_t written = 0;
    struct chunk *c;
    while ((c = next_input(fe->r))) {
        int intr = fe->terminal ? pty_unattached_intr(fe->fd) : -1;
        const char *p = (const char *)c->data, *end = p + c->n;
        while (p < end) {
            const char *hit = intr < 0 ? NULL : memchr(p, intr, (size_t)(end - p));
            if (feed_bytes(fe, p, (size_t)((hit ? hit : end) - p)) || !hit)
                break;
            pthread_mutex_lock(&lock);
            int pgid = fe->r->pid;
            pthread_mutex_unlock(&lock);
            if (pgid > 0)
                kill(-pgid, SIGINT);
            p = hit + 1;
        }
        written += (int64_t)c->n;
        chunk_free(c);
        send_size(K_ACK, written, NULL);
    }
    pthread_mutex_lock(&lock);
    int ended = fe->r->eof && !fe->r->killed;
    pthread_mutex_unlock(&lock);
    if (fe->terminal && ended) {
        ssize_t ignored = write(fe->fd, "\x04", 1); /* end of input on a terminal: ^D */
        (void)ignored;
    }
    close(fe->fd);
    free(fe);
    return NULL;
}

static void on_started(void *ctx, int pid) {
    struct request *r = ctx;
    pthread_mutex_lock(&lock);
    r->pid = pid > 0 ? pid : 0;
    if (r->killed && pid > 0)
        kill(-pid, SIGKILL);
    pthread_mutex_unlock(&lock);
    jbuf h = {0};
    jb_lit(&h, "{\"pid\":");
    if (pid > 0)
        jb_int(&h, pid);
    else
        jb_lit(&h, "null");
    jb_lit(&h, "}");
    host.send(K_STARTED, h.failed ? NULL : h.p, NULL, 0);
    jb_free(&h);
}

/* A PTY of the size [rows, cols] for the request: its master kept, its terminal end in opts
 * (stdin, stdout and stderr of the process); -1 with errno if there is none. */
static int open_pty(struct request *r, jspan size, struct proc_opts *opts) {
    struct winsize ws = {.ws_row = 24, .ws_col = 80};
    size_t pos = 0;
    jspan v;
    int64_t n[2];
    for (int i = 0; i < 2 && json_is(size, '[') && json_next(size, &pos, NULL, &v); i++)
        if (!json_int(v, &n[i]) && n[i] > 0 && n[i] < 65536)
            *(i ? &ws.ws_col : &ws.ws_row) = (unsigned short)n[i];
    char name[128];
    int master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0)
        return -1;
    int slave = -1;
    if (grantpt(master) || unlockpt(master) || ptsname_r(master, name, sizeof name) ||
        (slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
        int err = errno;
        close(master);
        errno = err;
        return -1;
    }
    ioctl(master, TIOCSWINSZ, &ws);
    fcntl(master, F_SETFL, O_NONBLOCK);
    pthread_mutex_lock(&lock);
    r->tty = master;
    r->has_tty = 1;
    pthread_mutex_unlock(&lock);
    opts->tty_fd = slave;
    opts->tty_master = master;
    return 0;
}

static void exec_request(struct request *r) {
    const struct frame *f = &r->f;
    jspan pty = field(f, "pty"), user = field(f, "user"), env_span = field(f, "env");
    struct proc_opts opts = {.stdin_fd = -1, .started = on_started, .ctx = r};
    if (pty.n && !json_is(pty, 'n') && open_pty(r, pty, &opts)) {
        failed_errno("OSError", "/dev/ptmx", errno);
        return;
    }
    unsigned groups[MAX_GROUPS];
    char home[4096] = "", name[256] = "";
    if (user.n && !json_is(user, 'n')) {
        char *wanted = json_strdup(user);
        int unknown = !wanted || mux_lookup_user(wanted, &opts.uid, &opts.gid, home, sizeof home,
                                                 name, sizeof name, groups, &opts.ngroups,
                                                 MAX_GROUPS);
        if (unknown) {
            jbuf msg = {0};
            jb_lit(&msg, "no user ");
            jb_raw(&msg, user.p, user.n < 200 ? user.n : 200);
            jb_lit(&msg, " in this guest");
            failed("unknown_user", msg.failed ? "no such user in this guest" : msg.p);
            jb_free(&msg);
            free(wanted);
            return;
        }
        free(wanted);
        opts.has_ids = 1;
        opts.groups = groups;
    }
    char **argv = argv_of(field(f, "argv"));
    struct env env = {0};
    jspan cwd_span = field(f, "cwd"), named;
    char *cwd = json_is(cwd_span, '"') ? json_strdup(cwd_span) : NULL;
    int ok = argv && host.env_of(&env, env_span) == 0 && (cwd || !json_is(cwd_span, '"'));
    const char *keys[] = {"HOME", "USER", "LOGNAME"}, *values[] = {home, name, name};
    for (int i = 0; ok && opts.has_ids && i < 3; i++)
        if (!json_is(env_span, '{') || json_get(env_span, keys[i], &named))
            ok = env_set(&env, keys[i], values[i]) == 0;
    struct stat st;
    const char *dir = cwd && *cwd                                           ? cwd
                      : opts.has_ids && !stat(home, &st) && S_ISDIR(st.st_mode) ? home
                                                                            : "/";
    int in[2] = {-1, -1};
    if (ok && r->has_tty) {
        in[1] = fcntl(r->tty, F_DUPFD_CLOEXEC, 0);
    } else if (ok && json_true(field(f, "stdin")) && pipe2(in, O_CLOEXEC) == 0) {
        fcntl(in[1], F_SETFL, O_NONBLOCK);
    }
    if (in[1] >= 0) {
        struct feed *fe = malloc(sizeof *fe);
        pthread_attr_t small;
        pthread_attr_init(&small);
        pthread_attr_setstacksize(&small, 64 * 1024);
        if (fe) {
            fe->r = r;
            fe->fd = in[1];
            fe->terminal = r->has_tty;
        }
        if (fe && pthread_create(&r->writer, &small, feed_stdin, fe) == 0) {
            r->has_writer = 1;
            opts.stdin_fd = in[0];
        } else {
            free(fe);
            if (in[0] >= 0)
                close(in[0]);
            close(in[1]);
        }
        pthread_attr_destroy(&small);
    }
    if (!ok && opts.tty_fd > 0)
        close(opts.tty_fd);
    if (!ok)
        failed("error", "ValueError: argv must be a list of strings, env an object of strings");
    else
        run_process_with(host.send, argv, env.items, dir, timeout_of(field(f, "timeout_s")), NULL,
                         0, &opts);
    set_killed(r); /* the process ended: its stdin writer stops */
    if (r->has_writer)
        pthread_join(r->writer, NULL); /* its last ACK before DONE */
    if (r->has_tty) {
        pthread_mutex_lock(&lock);
        r->has_tty = 0;
        pthread_mutex_unlock(&lock);
        close(r->tty);
    }
    if (ok)
        host.send(K_DONE, NULL, NULL, 0);
    free(cwd);
    free_argv(argv);
    env_free(&env);
}

/* -- tar (tar.c): the request's DATA as its input, DATA within the window as its output -- */

struct tar_in {
    struct request *r;
    struct chunk *c;
    size_t off;
    int64_t size; /* consumed and ACKed */
};

static size_t tar_read(void *ctx, unsigned char *buf, size_t cap) {
    struct tar_in *in = ctx;
    if (!in->c || in->off == in->c->n) {
        chunk_free(in->c);
        in->off = 0;
        if (!(in->c = next_input(in->r)))
            return 0;
        in->size += (int64_t)in->c->n;
        send_size(K_ACK, in->size, NULL);
    }
    size_t n = in->c->n - in->off < cap ? in->c->n - in->off : cap;
    memcpy(buf, in->c->data + in->off, n);
    in->off += n;
    return n;
}

struct tar_out {
    struct request *r;
    int64_t sent;
};

static int tar_write(void *ctx, const unsigned char *p, size_t n) {
    struct tar_out *out = ctx;
    if (!wait_window(out->r, out->sent, n))
        return 0;
    jbuf h = {0};
    jb_lit(&h, "{\"offset\":");
    jb_int(&h, out->sent);
    jb_lit(&h, ",\"eof\":false}");
    host.send(K_DATA, h.failed ? NULL : h.p, p, n);
    jb_free(&h);
    out->sent += (int64_t)n;
    return 1;
}

static void tar_failed(const struct tar_error *e) {
    if (e->code == TAR_OS && e->err)
        failed_errno("OSError", e->message, e->err);
    else
        failed(tar_code(e->code), e->message);
}

/* UPLOAD with "tar": unpacked into the folder `path`; DONE {size} of all the input */
static void upload_tar(struct request *r, const char *path) {
    struct tar_in in = {.r = r};
    struct tar_io io = {.ctx = &in, .read = tar_read};
    struct tar_error e;
    if (!path || !*path)
        failed("error", "ValueError: UPLOAD needs a path");
    else if (tar_extract(&io, path, &e))
        tar_failed(&e);
    else
        send_size(K_DONE, in.size, NULL);
    chunk_free(in.c);
}

/* DOWNLOAD with "tar": the folder `path` packed; DONE {size} (stopped: the host left) */
static void download_tar(struct request *r, const char *path) {
    struct tar_out out = {.r = r};
    struct tar_io io = {.ctx = &out, .write = tar_write};
    struct tar_error e;
    int rc = path ? tar_pack(&io, path, &e) : TAR_BAD;
    if (!path)
        failed("error", "ValueError: DOWNLOAD needs a path");
    else if (rc == TAR_STOPPED)
        send_size(K_DONE, out.sent, ",\"stopped\":true");
    else if (rc)
        tar_failed(&e);
    else
        send_size(K_DONE, out.sent, NULL);
}

/* -- UPLOAD / DOWNLOAD (and BULK_PUT / BULK_GET below) ------------------------------------ */

/* the request's integer "mode" (0644 if absent), 0 to 07777, into *mode (0), or -1 */
static int mode_field(const struct frame *f, int64_t *mode) {
    jspan m = field(f, "mode");
    *mode = 0644;
    return (m.n && json_int(m, mode)) || *mode < 0 || *mode > 07777 ? -1 : 0;
}

/* `path` opened for writing (created with `mode`, its folders made first; `flags`: O_TRUNC or
 * 0), or -1 with errno */
static int open_for_writing(const char *path, int64_t mode, int flags) {
    return make_parents(path) ? -1
                              : open(path, O_WRONLY | O_CREAT | O_CLOEXEC | flags, (mode_t)mode);
}

/* `path` opened for reading, a file and no folder; else FAILED is sent and -1 returned */
static int open_for_reading(const char *path) {
    struct stat st;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0 && !fstat(fd, &st) && !S_ISDIR(st.st_mode))
        return fd;
    failed_errno(fd < 0 ? "FileNotFoundError" : "IsADirectoryError", path,
                 fd < 0 ? errno : EISDIR);
    if (fd >= 0)
        close(fd);
    return -1;
}

static void upload(struct request *r) {
    const struct frame *f = &r->f;
    char *path = json_strdup(field(f, "path"));
    int64_t mode;
    if (json_true(field(f, "tar"))) {
        upload_tar(r, path);
    } else if (!path || !*path || mode_field(f, &mode)) {
        failed("error", "ValueError: UPLOAD needs a path and an integer mode");
    } else {
        int fd = open_for_writing(path, mode, O_TRUNC);
        if (fd < 0) {
            failed_errno("OSError", path, errno);
            free(path);
            return;
        }
        int64_t size = 0;
        struct chunk *c;
        int err = 0;
        while (!err && (c = next_input(r))) {
            for (size_t off = 0; off < c->n && !err;) {
                ssize_t w = write(fd, c->data + off, c->n - off);
                if (w > 0)
                    off += (size_t)w;
                else if (!(w < 0 && errno == EINTR))
                    err = w < 0 ? errno : EIO;
            }
            size += (int64_t)c->n;
            chunk_free(c);
            if (!err)
                send_size(K_ACK, size, NULL);
        }
        close(fd);
        pthread_mutex_lock(&lock);
        int stopped = r->killed;
        pthread_mutex_unlock(&lock);
        if (err)
            failed_errno("OSError", path, err);
        else
            send_size(K_DONE, size, stopped ? ",\"stopped\":true" : ",\"stopped\":false");
    }
    free(path);
}

static void download(struct request *r) {
    const struct frame *f = &r->f;
    char *path = json_strdup(field(f, "path"));
    if (json_true(field(f, "tar"))) {
        download_tar(r, path);
        free(path);
        return;
    }
    int fd = -1;
    unsigned char *buf = malloc(CHUNK);
    if (!path || !buf) {
        failed("error", path ? "MemoryError" : "ValueError: DOWNLOAD needs a path");
    } else if ((fd = open_for_reading(path)) >= 0) {
        int64_t sent = 0;
        for (;;) {
            ssize_t got = read(fd, buf, CHUNK);
            if (got < 0 && errno == EINTR)
                continue;
            if (got < 0) {
                failed_errno("OSError", path, errno);
                break;
            }
            if (got == 0) {
                send_size(K_DONE, sent, NULL);
                break;
            }
            if (!wait_window(r, sent, (size_t)got)) {
                send_size(K_DONE, sent, ",\"stopped\":true");
                break;
            }
            jbuf h = {0};
            jb_lit(&h, "{\"offset\":");
            jb_int(&h, sent);
            jb_lit(&h, ",\"eof\":false}");
            host.send(K_DATA, h.failed ? NULL : h.p, buf, (size_t)got);
            jb_free(&h);
            sent += got;
        }
    }
    if (fd >= 0)
        close(fd);
    free(buf);
    free(path);
}

/* -- BULK_PUT / BULK_GET (bulk.h) ----------------------------------------------------------- */

/* an integer field >= 0 into *out (0), or -1 */
static int count_field(const struct frame *f, const char *key, int64_t *out) {
    jspan v = field(f, key);
    return v.n && !json_int(v, out) && *out >= 0 ? 0 : -1;
}

/* BULK_PUT {path, mode, offset, size}: the disk's first `size` bytes written at `offset` of
 * `path` (offset 0: created or truncated first); DONE {size: offset + size} */
static void bulk_put(struct request *r) {
    const struct frame *f = &r->f;
    char *path = json_strdup(field(f, "path"));
    int64_t mode, offset, size;
    if (!path || !*path || mode_field(f, &mode) || count_field(f, "offset", &offset) ||
        count_field(f, "size", &size)) {
        failed("error", "ValueError: BULK_PUT needs a path, a mode, an offset and a size");
        free(path);
        return;
    }
    int fd = open_for_writing(path, mode, offset == 0 ? O_TRUNC : 0);
    int err = fd < 0 ? errno : bulk_to_file(fd, offset, size);
    if (fd >= 0)
        close(fd);
    if (err == EINVAL)
        failed("error", "ValueError: BULK_PUT's size is past the bulk disk");
    else if (err)
        failed_errno("OSError", path, err);
    else
        send_size(K_DONE, offset + size, NULL);
    free(path);
}

/* BULK_GET {path, offset, max}: up to `max` bytes of `path` from `offset` at the disk's start;
 * DONE {size, eof} (eof: the file ended within them) */
static void bulk_get(struct request *r) {
    const struct frame *f = &r->f;
    char *path = json_strdup(field(f, "path"));
    int64_t offset, max, got = 0;
    if (!path || count_field(f, "offset", &offset) || count_field(f, "max", &max)) {
        failed("error", "ValueError: BULK_GET needs a path, an offset and a max");
        free(path);
        return;
    }
    int fd = open_for_reading(path);
    if (fd >= 0) {
        int err = bulk_from_file(fd, offset, max, &got);
        if (err == EINVAL)
            failed("error", "ValueError: BULK_GET's max is past the bulk disk");
        else if (err)
            failed_errno("OSError", path, err);
        else
            send_size(K_DONE, got, got < max ? ",\"eof\":true" : ",\"eof\":false");
        close(fd);
    }
    free(path);
}

/* -- FS {op, path, dest, depth}: stat / list / mkdir / rename / remove --------------------- */
/* Answered by DONE {size, truncated} whose body is the entries, each eight NUL-ended fields:
 * path, type (f d l p s c b ?), size, mode (octal), uid, gid, mtime (s.ns), link target;
 * stat: the path itself (never followed); list: what is under it, `depth` levels (1..64),
 * links to folders not entered; at most FS_BODY bytes (then truncated: true). */

enum { FS_BODY = 1024 * 1024 - 64 * 1024, FS_DEPTH = 64 };

struct fsbuf {
    char *p;
    size_t n, cap;
    int full;
};

static void fs_put(struct fsbuf *b, const char *s, size_t n) {
    if (b->full)
        return;
    if (b->n + n + 1 > FS_BODY) {
        b->full = 1;
        return;
    }
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 64 * 1024;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->full = 1;
            return;
        }
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n++] = 0;
}

static char fs_type(mode_t m) {
    return S_ISREG(m) ? 'f' : S_ISDIR(m) ? 'd' : S_ISLNK(m) ? 'l' : S_ISFIFO(m) ? 'p'
         : S_ISSOCK(m) ? 's' : S_ISCHR(m) ? 'c' : S_ISBLK(m) ? 'b' : '?';
}

/* one entry: `path` as `st` says (`dirfd`/`name`: where to read a link's target) */
static void fs_entry(struct fsbuf *b, const char *path, const struct stat *st, int dirfd,
                     const char *name) {
    char num[64], target[4096];
    size_t start = b->n;
    fs_put(b, path, strlen(path));
    num[0] = fs_type(st->st_mode), num[1] = 0;
    fs_put(b, num, 1);
    fs_put(b, num, (size_t)snprintf(num, sizeof num, "%lld", (long long)st->st_size));
    fs_put(b, num, (size_t)snprintf(num, sizeof num, "%o", (unsigned)(st->st_mode & 07777)));
    fs_put(b, num, (size_t)snprintf(num, sizeof num, "%u", (unsigned)st->st_uid));
    fs_put(b, num, (size_t)snprintf(num, sizeof num, "%u", (unsigned)st->st_gid));
    fs_put(b, num, (size_t)snprintf(num, sizeof num, "%lld.%09ld", (long long)st->st_mtim.tv_sec,
                                    st->st_mtim.tv_nsec));
    ssize_t t = S_ISLNK(st->st_mode) ? readlinkat(dirfd, name, target, sizeof target - 1) : -1;
    fs_put(b, target, t > 0 ? (size_t)t : 0);
    if (b->full)
        b->n = start; /* no half entry */
}

/* the entries under the open folder `fd` (named `path`), `depth` levels; closes `fd` */
static void fs_walk(struct fsbuf *b, int fd, const char *path, int depth) {
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return;
    }
    struct dirent *e;
    while (!b->full && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char child[4096];
        int n = snprintf(child, sizeof child, "%s%s%s", path,
                         path[strlen(path) - 1] == '/' ? "" : "/", e->d_name);
        struct stat st;
        if (n < 0 || (size_t)n >= sizeof child || fstatat(dirfd(d), e->d_name, &st,
                                                          AT_SYMLINK_NOFOLLOW))
            continue;
        fs_entry(b, child, &st, dirfd(d), e->d_name);
        if (depth > 1 && S_ISDIR(st.st_mode)) {
            int sub = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub >= 0)
                fs_walk(b, sub, child, depth - 1);
        }
    }
    closedir(d);
}

static int fs_unlink(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)ftw;
    return (flag == FTW_DP ? rmdir(path) : unlink(path)) ? errno : 0;
}

static void fs_request(struct request *r) {
    const struct frame *f = &r->f;
    char *op = json_strdup(field(f, "op")), *path = json_strdup(field(f, "path"));
    char *dest = json_strdup(field(f, "dest"));
    int64_t depth = 1;
    jspan dv = field(f, "depth");
    struct fsbuf b = {0};
    struct stat st;
    int err = 0;
    if (!op || !path || path[0] != '/' || (dv.n && (json_int(dv, &depth) || depth < 1))) {
        failed("error", "ValueError: FS needs an op and an absolute path (depth >= 1)");
        goto out;
    }
    if (depth > FS_DEPTH)
        depth = FS_DEPTH;
    if (!strcmp(op, "stat") || !strcmp(op, "list")) {
        if (lstat(path, &st)) {
            err = errno;
        } else if (!strcmp(op, "stat")) {
            fs_entry(&b, path, &st, AT_FDCWD, path);
        } else {
            int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (fd < 0)
                err = errno;
            else
                fs_walk(&b, fd, path, (int)depth);
        }
    } else if (!strcmp(op, "mkdir")) {
        err = make_parents(path) || mkdir(path, 0755) ? errno : 0;
    } else if (!strcmp(op, "rename")) {
        if (!dest || dest[0] != '/') {
            failed("error", "ValueError: FS rename needs an absolute dest");
            goto out;
        }
        err = make_parents(dest) || rename(path, dest) ? errno : 0;
    } else if (!strcmp(op, "remove")) {
        err = lstat(path, &st) ? errno
              : S_ISDIR(st.st_mode) ? nftw(path, fs_unlink, 16, FTW_DEPTH | FTW_PHYS)
                                    : (unlink(path) ? errno : 0);
        if (err < 0)
            err = errno ? errno : EIO;
    } else {
        failed("unsupported", "ValueError: FS op is none of stat, list, mkdir, rename, remove");
        goto out;
    }
    if (err) {
        failed_errno("OSError", path, err);
    } else {
        jbuf h = {0};
        jb_lit(&h, "{\"size\":");
        jb_int(&h, (int64_t)b.n);
        jb_lit(&h, b.full ? ",\"truncated\":true}" : ",\"truncated\":false}");
        host.send(K_DONE, h.failed ? NULL : h.p, (unsigned char *)b.p, b.n);
        jb_free(&h);
    }
out:
    free(b.p);
    free(op);
    free(path);
    free(dest);
}

/* -- CONNECT {port} (port.h): a guest TCP port relayed both ways -------------------------- */
/* STARTED {port} once connected (else FAILED {code: refused, timeout, busy, os_error}); then
 * the host's DATA into the socket (ACK {size} after each chunk; its eof shuts the socket's
 * sending half) while what the socket gives goes out as DATA within the host's window; DONE
 * {size, received, stopped} once the guest's end closed (or KILL: stopped). */

struct port_out {
    struct request *r;
    int fd;
    int64_t written; /* bytes of the host's DATA taken (ACKed) */
};

/* `n` bytes into the socket; -1 once it failed (its peer went) or the request ended */
static int port_send(struct port_out *o, const unsigned char *p, size_t n) {
    size_t off = 0;
    while (off < n) {
        ssize_t w = send(o->fd, p + off, n - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            off += (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pf = {o->fd, POLLOUT, 0};
            poll(&pf, 1, 100);
            pthread_mutex_lock(&lock);
            int stop = o->r->killed;
            pthread_mutex_unlock(&lock);
            if (stop)
                return -1;
        } else if (!(w < 0 && errno == EINTR)) {
            return -1;
        }
    }
    return 0;
}

/* the host's side: its chunks into the socket (a socket that failed: taken and dropped, so
 * the host's window never stalls) until its eof, then the sending half shut */
static void *port_feed(void *arg) {
    struct port_out *o = arg;
    current = o->r->id;
    int broken = 0;
    struct chunk *c;
    while ((c = next_input(o->r))) {
        if (!broken && port_send(o, c->data, c->n))
            broken = 1;
        o->written += (int64_t)c->n;
        chunk_free(c);
        send_size(K_ACK, o->written, NULL);
    }
    pthread_mutex_lock(&lock);
    int ended = o->r->eof && !o->r->killed;
    pthread_mutex_unlock(&lock);
    if (ended && !broken)
        shutdown(o->fd, SHUT_WR);
    return NULL;
}

/* the guest's side: what the socket gives as DATA until it ends or the host stops it */
static int64_t port_relay(struct request *r, int fd, unsigned char *buf, int *stopped) {
    int64_t sent = 0;
    for (;;) {
        pthread_mutex_lock(&lock);
        int killed = r->killed;
        pthread_mutex_unlock(&lock);
        if (killed) {
            *stopped = 1;
            return sent;
        }
        struct pollfd pf = {fd, POLLIN, 0};
        int ready = poll(&pf, 1, 200);
        if (ready < 0 && errno != EINTR)
            return sent;
        if (ready <= 0)
            continue;
        ssize_t got = recv(fd, buf, CHUNK, 0);
        if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (got <= 0) /* its end closed (or reset) */
            return sent;
        if (!wait_window(r, sent, (size_t)got)) {
            *stopped = 1;
            return sent;
        }
        jbuf h = {0};
        jb_lit(&h, "{\"offset\":");
        jb_int(&h, sent);
        jb_lit(&h, ",\"eof\":false}");
        host.send(K_DATA, h.failed ? NULL : h.p, buf, (size_t)got);
        jb_free(&h);
        sent += got;
    }
}

static void port_request(struct request *r) {
    int port, fd = -1;
    if (port_of(frame_header(&r->f), &port)) {
        failed("error", "ValueError: CONNECT needs a port, an integer 1..65535");
        return;
    }
    pthread_mutex_lock(&lock);
    int busy = ports_open >= PORT_MAX_OPEN;
    ports_open += !busy;
    pthread_mutex_unlock(&lock);
    char msg[200];
    unsigned char *buf = busy ? NULL : malloc(CHUNK);
    if (busy || !buf) {
        snprintf(msg, sizeof msg, "%s (%d connections at most)",
                 busy ? "too many port connections at once" : "MemoryError", PORT_MAX_OPEN);
        failed("busy", msg);
    } else if ((fd = port_dial(port, PORT_CONNECT_MS)) < 0) {
        int err = errno;
        snprintf(msg, sizeof msg, "connect to 127.0.0.1:%d: [Errno %d] %s", port, err,
                 strerror(err));
        failed(port_error_code(err), msg);
    } else {
        jbuf h = {0};
        jb_lit(&h, "{\"port\":");
        jb_int(&h, port);
        jb_lit(&h, "}");
        host.send(K_STARTED, h.failed ? NULL : h.p, NULL, 0);
        jb_free(&h);
        struct port_out out = {.r = r, .fd = fd};
        pthread_attr_t small;
        pthread_attr_init(&small);
        pthread_attr_setstacksize(&small, 64 * 1024);
        int has_writer = pthread_create(&r->writer, &small, port_feed, &out) == 0;
        pthread_attr_destroy(&small);
        int stopped = 0;
        int64_t sent = has_writer ? port_relay(r, fd, buf, &stopped) : 0;
        set_killed(r); /* the writer stops */
        if (has_writer)
            pthread_join(r->writer, NULL); /* its last ACK before DONE */
        close(fd);
        jbuf d = {0};
        jb_lit(&d, "{\"size\":");
        jb_int(&d, sent);
        jb_lit(&d, ",\"received\":");
        jb_int(&d, out.written);
        jb_lit(&d, stopped || !has_writer ? ",\"stopped\":true}" : ",\"stopped\":false}");
        host.send(K_DONE, d.failed ? NULL : d.p, NULL, 0);
        jb_free(&d);
    }
    free(buf);
    if (!busy) {
        pthread_mutex_lock(&lock);
        ports_open--;
        pthread_mutex_unlock(&lock);
    }
}

/* -- routing ------------------------------------------------------------------------------- */

static void *serve(void *arg) {
    struct request *r = arg;
    current = r->id;
    if (r->kind == K_EXEC)
        exec_request(r);
    else if (r->kind == K_UPLOAD)
        upload(r);
    else if (r->kind == K_BULK_PUT)
        bulk_put(r);
    else if (r->kind == K_BULK_GET)
        bulk_get(r);
    else if (r->kind == K_FS)
        fs_request(r);
    else if (r->kind == K_CONNECT)
        port_request(r);
    else
        download(r);
    pthread_mutex_lock(&lock);
    for (struct chunk *c = r->head, *next; c; c = next) {
        next = c->next;
        chunk_free(c);
    }
    frame_free(&r->f);
    memset(r, 0, sizeof *r);
    pthread_mutex_unlock(&lock);
    host.activity(-1);
    return NULL;
}

/* FAILED for a request that never ran here (from the reading thread: the id is echoed) */
static void refuse(jspan id, const char *code, const char *message) {
    send_failed(&id, code, message);
}

int mux_classify(const struct frame *f, int64_t *id, jspan *idv) {
    if (json_get(frame_header(f), "id", idv))
        return MUX_NOT;
    int is_int = !json_int(*idv, id);
    if (f->kind == K_STDIN || f->kind == K_KILL || f->kind == K_RESIZE || f->kind == K_DATA ||
        f->kind == K_ACK)
        return is_int ? MUX_INPUT : MUX_LATE;
    if (is_int && (f->kind == K_EXEC || f->kind == K_UPLOAD || f->kind == K_DOWNLOAD ||
                   f->kind == K_FS || f->kind == K_CONNECT))
        return MUX_NEW;
    if (is_int && (f->kind == K_BULK_PUT || f->kind == K_BULK_GET) && bulk_size() > 0)
        return MUX_NEW; /* without a bulk disk: refused, FAILED {code: "unsupported"} */
    return MUX_REFUSE;
}

int mux_route(struct frame *f) {
    jspan idv;
    int64_t id = -1;
    int what = mux_classify(f, &id, &idv);
    if (what == MUX_NOT)
        return 0;
    if (what == MUX_INPUT || what == MUX_LATE) {
        pthread_mutex_lock(&lock);
        struct request *r = what == MUX_INPUT ? find(id) : NULL;
        if (r) /* else it just ended: its late input has nowhere to go */
            deliver(r, f);
        pthread_mutex_unlock(&lock);
        frame_free(f);
        return 1;
    }
    pthread_mutex_lock(&lock);
    int fresh = what == MUX_NEW && !find(id);
    struct request *r = NULL;
    for (size_t i = 0; fresh && i < MAX_REQUESTS && !r; i++)
        r = table[i].used ? NULL : &table[i];
    if (r) {
        memset(r, 0, sizeof *r);
        r->used = 1;
        r->id = id;
        r->kind = f->kind;
        r->f = *f; /* the thread frees it */
    }
    pthread_mutex_unlock(&lock);
    if (!r) {
        char msg[96];
        if (fresh)
            snprintf(msg, sizeof msg, "too many requests at once (%d)", MAX_REQUESTS);
        else
            snprintf(msg, sizeof msg, "no request of kind %d with this id here", f->kind);
        refuse(idv, fresh ? "busy" : "unsupported", msg);
        frame_free(f);
        return 1;
    }
    host.activity(+1);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, STACK);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, serve, r)) {
        pthread_mutex_lock(&lock);
        memset(r, 0, sizeof *r);
        pthread_mutex_unlock(&lock);
        refuse(idv, "busy", "no thread for the request");
        frame_free(f);
        host.activity(-1);
    }
    pthread_attr_destroy(&attr);
    return 1;
}
