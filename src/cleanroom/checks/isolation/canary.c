/*
 * The isolation check's canaries for a guest without Python: canary.py, line for line, in C.
 *
 *   canary plant --token T [--prefix P]    plant every canary, report what was planted
 *   canary probe --token T [--prefix P]    report which canaries named T are visible
 *
 * Same names, same evidence, same one JSON object on stdout as canary.py (the host reads both
 * through agent/wire.py): planted / skipped / observed, or seen / observed. Static (built by
 * isolation/native_canary.py), so it runs in a busybox-only or distroless image. The login
 * shell row runs `sh -l -c env` when the image has a /bin/sh; without one nothing is seen.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

enum { LINGER_S = 900, BIG = 1 << 16, PATHLEN = 8192, NOTELEN = PATHLEN + 512 };

struct canary { const char *name, *path, *text; };

static const struct canary FILES[] = {
    {"file:/", "/%s", "%s"},
    {"file:/root", "/root/.%s", "%s"},
    {"file:/tmp", "/tmp/%s", "%s"},
    {"file:/var/tmp", "/var/tmp/%s", "%s"},
    {"cache:pip", "/root/.cache/pip/http/%s/wheel.bin", "%s"},
    {"cache:huggingface", "/root/.cache/huggingface/hub/models--cleanroom--%s/config.json", "%s"},
};
static const struct canary APPENDS[] = {
    {"etc:hosts", "/etc/hosts", "127.0.0.9 %s\n"},
    {"env:/etc/environment", "/etc/environment", "CLEANROOM_CANARY=%s\n"},
    {"env:/root/.profile", "/root/.profile", "export CLEANROOM_CANARY_PROFILE=%s\n"},
};
static const struct canary SYSCTLS[] = {
    {"sysctl:kernel.hostname", "/proc/sys/kernel/hostname", NULL},
    {"sysctl:vm.swappiness", "/proc/sys/vm/swappiness", NULL},
};
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))
static const char *LOGIN = "env:login-shell", *PROCESS = "process:background";

/* -- a JSON object written as it goes ---------------------------------------------------- */

static int first_key;

static void jstr(const char *s) {
    putchar('"');
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20 || c >= 0x7f)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static void jkey(const char *key) {
    printf(first_key ? "" : ", ");
    first_key = 0;
    jstr(key);
    printf(": ");
}

static void jopen(const char *key) {
    if (key)
        jkey(key);
    putchar('{');
    first_key = 1;
}

static void jclose(void) {
    putchar('}');
    first_key = 0;
}

static void jpair(const char *key, const char *value) {
    jkey(key);
    if (value)
        jstr(value);
    else
        printf("null");
}

/* -- files ------------------------------------------------------------------------------- */

static void makedirs(const char *path) {
    char buf[PATHLEN];
    snprintf(buf, sizeof buf, "%s", path);
    char *slash = strrchr(buf, '/');
    if (!slash || slash == buf)
        return;
    *slash = 0;
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(buf, 0755);
            *p = '/';
        }
    mkdir(buf, 0755);
}

/* 0, or errno (the file is written whole: the canary's text) */
static int write_file(const char *path, const char *text, int append) {
    makedirs(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC), 0644);
    if (fd < 0)
        return errno;
    size_t n = strlen(text);
    int err = write(fd, text, n) == (ssize_t)n ? 0 : (errno ? errno : EIO);
    close(fd);
    return err;
}

/* the file's text (at most BIG bytes, NUL-terminated, malloc'd), or NULL */
static char *read_file(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    char *buf = malloc(BIG + 1);
    size_t n = 0;
    ssize_t got;
    while (buf && n < BIG && (got = read(fd, buf + n, BIG - n)) > 0)
        n += (size_t)got;
    close(fd);
    if (buf)
        buf[n] = 0;
    return buf;
}

static char *strip(char *s) {
    if (!s)
        return NULL;
    while (*s == ' ' || *s == '\n' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\n' || s[n - 1] == '\t'))
        s[--n] = 0;
    return s;
}

/* -- processes --------------------------------------------------------------------------- */

/* pids (not this one) whose command line names the token, as "[1, 2]" into out; how many */
static int processes_with(const char *token, char *out, size_t size) {
    DIR *d = opendir("/proc");
    int found = 0;
    size_t used = snprintf(out, size, "[");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 0 || pid == getpid())
            continue;
        char path[64], cmd[4096];
        snprintf(path, sizeof path, "/proc/%ld/cmdline", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, cmd, sizeof cmd);
        close(fd);
        if (n > 0 && memmem(cmd, (size_t)n, token, strlen(token)) && used < size)
            used += snprintf(out + used, size - used, "%s%ld", found++ ? ", " : "", pid);
    }
    if (d)
        closedir(d);
    if (used < size)
        snprintf(out + used, size - used, "]");
    return found;
}

static int linger(const char *token, char *pids, size_t size) {
    pid_t child = fork();
    if (child == 0) {
        setsid();
        if (fork() != 0)
            _exit(0);
        int devnull = open("/dev/null", O_RDWR);
        for (int fd = 0; fd < 3; fd++)
            dup2(devnull, fd);
        sleep(LINGER_S); /* this process's command line still names the token */
        _exit(0);
    }
    if (child > 0)
        waitpid(child, NULL, 0);
    for (int i = 0; i < 200; i++) {
        if (processes_with(token, pids, size))
            return 1;
        usleep(10000);
    }
    return 0;
}

/* what a login shell's environment says (stdout of `sh -l -c env`), or "" */
static char *login_env(void) {
    static char buf[BIG + 1];
    const char *sh = access("/bin/sh", X_OK) == 0 ? "/bin/sh" : "/usr/bin/sh";
    int p[2];
    if (access(sh, X_OK) != 0 || pipe(p) != 0)
        return "";
    pid_t pid = fork();
    if (pid == 0) {
        char *argv[] = {"sh", "-l", "-c", "env", NULL};
        char *envp[] = {"HOME=/root", "PATH=/usr/bin:/bin:/usr/sbin:/sbin", NULL};
        dup2(p[1], 1);
        close(p[0]);
        execve(sh, argv, envp);
        _exit(127);
    }
    close(p[1]);
    size_t n = 0;
    time_t deadline = time(NULL) + 60;
    struct pollfd pfd = {p[0], POLLIN, 0};
    while (pid > 0 && n < BIG && time(NULL) < deadline && poll(&pfd, 1, 1000) >= 0) {
        if (!pfd.revents)
            continue;
        ssize_t got = read(p[0], buf + n, BIG - n);
        if (got <= 0)
            break;
        n += (size_t)got;
    }
    close(p[0]);
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    buf[n] = 0;
    return buf;
}

/* -- plant and probe --------------------------------------------------------------------- */

static void observe(const char *prefix, char values[][128]) {
    char path[PATHLEN];
    for (size_t i = 0; i < COUNT(SYSCTLS); i++) {
        snprintf(path, sizeof path, "%s%s", prefix, SYSCTLS[i].path);
        char *text = read_file(path), *value = strip(text);
        snprintf(values[i], 128, "%s", value ? value : "\x01");
        free(text);
    }
    unsigned char random[32] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    ssize_t got = fd >= 0 ? read(fd, random, sizeof random) : -1;
    if (fd >= 0)
        close(fd);
    values[2][0] = 0;
    for (size_t i = 0; got == (ssize_t)sizeof random && i < sizeof random; i++)
        sprintf(values[2] + 2 * i, "%02x", random[i]);
    char *boot = read_file("/proc/sys/kernel/random/boot_id"), *id = strip(boot);
    snprintf(values[3], 128, "%s", id && *id ? id : "\x01");
    free(boot);
}

static void print_observed(const char *prefix) {
    char values[4][128];
    observe(prefix, values);
    jopen("observed");
    for (size_t i = 0; i < COUNT(SYSCTLS); i++)
        jpair(SYSCTLS[i].name, values[i][0] == 1 ? NULL : values[i]);
    jpair("rng:urandom", values[2]);
    jpair("rng:boot_id", values[3][0] == 1 ? NULL : values[3]);
    jclose();
}

static void plant(const char *token, const char *prefix) {
    char path[PATHLEN], text[PATHLEN], note[NOTELEN], skipped[16][NOTELEN];
    const char *skipped_name[16];
    int nskipped = 0;
    jopen(NULL);
    jopen("planted");
#define ATTEMPT(name_, path_, text_, append_, note_)                                          \
    do {                                                                                       \
        int err = write_file(path_, text_, append_);                                           \
        if (err) {                                                                             \
            skipped_name[nskipped] = name_;                                                    \
            snprintf(skipped[nskipped++], NOTELEN, "OSError: [Errno %d] %s: '%s'", err,            \
                     strerror(err), path_);                                                    \
        } else {                                                                               \
            snprintf(note, sizeof note, "%s%s", path_, note_);                                 \
            jpair(name_, note);                                                                \
        }                                                                                      \
    } while (0)
    for (size_t i = 0; i < COUNT(FILES); i++) {
        snprintf(text, sizeof text, "%s", token);
        int n = snprintf(path, sizeof path, "%s", prefix);
        snprintf(path + n, sizeof path - n, FILES[i].path, token);
        ATTEMPT(FILES[i].name, path, text, 0, "");
    }
    for (size_t i = 0; i < COUNT(APPENDS); i++) {
        snprintf(path, sizeof path, "%s%s", prefix, APPENDS[i].path);
        snprintf(text, sizeof text, APPENDS[i].text, token);
        ATTEMPT(APPENDS[i].name, path, text, 1, "");
    }
    if (*prefix) {
        skipped_name[nskipped] = LOGIN;
        snprintf(skipped[nskipped++], NOTELEN, "no VM: a login shell would read the host's profile");
    } else {
        jpair(LOGIN, "via /etc/environment and /root/.profile");
    }
    for (size_t i = 0; i < COUNT(SYSCTLS); i++) {
        char *original = read_file(SYSCTLS[i].path), *value = strip(original);
        const char *set = i == 0 ? token : (value && !strcmp(value, "7") ? "13" : "7");
        char suffix[256];
        snprintf(suffix, sizeof suffix, " = %s%s", set, *prefix ? " (simulated: no VM)" : "");
        snprintf(path, sizeof path, "%s%s", prefix, SYSCTLS[i].path);
        snprintf(text, sizeof text, "%s\n", set);
        ATTEMPT(SYSCTLS[i].name, path, text, 0, suffix);
        free(original);
    }
    char pids[1024];
    fflush(stdout); /* the lingering child must not repeat what is buffered */
    if (linger(token, pids, sizeof pids)) {
        snprintf(note, sizeof note, "pids %s (setsid, double fork)", pids);
        jpair(PROCESS, note);
    } else {
        skipped_name[nskipped] = PROCESS;
        snprintf(skipped[nskipped++], NOTELEN, "the background process did not appear");
    }
    jclose();
    jopen("skipped");
    for (int i = 0; i < nskipped; i++)
        jpair(skipped_name[i], skipped[i]);
    jclose();
    print_observed(prefix);
    jclose();
}

static void probe(const char *token, const char *prefix) {
    char path[PATHLEN], note[NOTELEN], pids[1024];
    struct stat st;
    jopen(NULL);
    jopen("seen");
    for (size_t i = 0; i < COUNT(FILES); i++) {
        int n = snprintf(path, sizeof path, "%s", prefix);
        snprintf(path + n, sizeof path - n, FILES[i].path, token);
        char folder[PATHLEN];
        snprintf(folder, sizeof folder, "%s", path);
        char *slash = strrchr(folder, '/');
        if (slash)
            *slash = 0;
        int in_folder = strstr(folder, token) && stat(folder, &st) == 0 && S_ISDIR(st.st_mode);
        if (lstat(path, &st) == 0 || in_folder) {
            snprintf(note, sizeof note, "%s exists", path);
            jpair(FILES[i].name, note);
        }
    }
    for (size_t i = 0; i < COUNT(APPENDS); i++) {
        snprintf(path, sizeof path, "%s%s", prefix, APPENDS[i].path);
        char *text = read_file(path);
        if (text && strstr(text, token)) {
            snprintf(note, sizeof note, "%s names the token", path);
            jpair(APPENDS[i].name, note);
        }
        free(text);
    }
    const char *login = NULL;
    if (!*prefix && strstr(login_env(), token))
        login = "a login shell's environment names the token";
    for (char **e = environ; *e; e++) {
        const char *value = strchr(*e, '=');
        if (value && strstr(value + 1, token))
            login = "this process's environment names the token";
    }
    if (login)
        jpair(LOGIN, login);
    if (processes_with(token, pids, sizeof pids)) {
        snprintf(note, sizeof note, "pids %s name the token", pids);
        jpair(PROCESS, note);
    }
    char values[4][128];
    observe(prefix, values);
    for (size_t i = 0; i < COUNT(SYSCTLS); i++)
        if (values[i][0] != 1 && strstr(values[i], token)) {
            snprintf(note, sizeof note, "%s = %s", SYSCTLS[i].name, values[i]);
            jpair(SYSCTLS[i].name, note);
        }
    jclose();
    print_observed(prefix);
    jclose();
}

int main(int argc, char **argv) {
    if (argc < 4 || (strcmp(argv[1], "plant") && strcmp(argv[1], "probe")) ||
        strcmp(argv[2], "--token") || strlen(argv[3]) > 200) {
        fprintf(stderr, "usage: canary plant|probe --token T [--prefix P]\n");
        return 2;
    }
    const char *prefix = argc >= 6 && !strcmp(argv[4], "--prefix") ? argv[5] : "";
    if (strlen(prefix) > 4096) {
        fprintf(stderr, "canary: prefix too long\n");
        return 2;
    }
    if (!strcmp(argv[1], "plant"))
        plant(argv[3], prefix);
    else
        probe(argv[3], prefix);
    putchar('\n');
    return fflush(stdout) == 0 ? 0 : 1;
}
