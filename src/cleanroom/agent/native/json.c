/* JSON reader and writer: see json.h. */
#include "json.h"

#include <stdlib.h>
#include <string.h>

static void skip_ws(const char *s, size_t n, size_t *i) {
    while (*i < n && (s[*i] == ' ' || s[*i] == '\t' || s[*i] == '\n' || s[*i] == '\r'))
        (*i)++;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static int hex4(const char *s, size_t n, size_t i, unsigned *out) {
    unsigned v = 0;
    if (i + 4 > n)
        return -1;
    for (size_t k = 0; k < 4; k++) {
        int h = hexval(s[i + k]);
        if (h < 0)
            return -1;
        v = v * 16 + (unsigned)h;
    }
    *out = v;
    return 0;
}

/* the length of the UTF-8 sequence at s (1..4), or 0 if invalid */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        min = 0x10000;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    unsigned v = c & (0x7F >> len);
    for (size_t k = 1; k < len; k++) {
        if ((s[k] & 0xC0) != 0x80)
            return 0;
        v = (v << 6) | (s[k] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    return len;
}

int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        size_t len = utf8_seq(s + i, n - i);
        if (!len)
            return 0;
        i += len;
    }
    return 1;
}

static int skip_string(const char *s, size_t n, size_t *i) {
    (*i)++; /* the opening quote */
    while (*i < n) {
        unsigned char c = (unsigned char)s[*i];
        if (c == '"') {
            (*i)++;
            return 0;
        }
        if (c < 0x20)
            return -1;
        if (c == '\\') {
            if (*i + 1 >= n)
                return -1;
            char e = s[*i + 1];
            if (e == 'u') {
                unsigned v;
                if (hex4(s, n, *i + 2, &v))
                    return -1;
                *i += 6;
            } else if (strchr("\"\\/bfnrt", e) && e) {
                *i += 2;
            } else {
                return -1;
            }
            continue;
        }
        size_t len = utf8_seq((const unsigned char *)s + *i, n - *i);
        if (!len)
            return -1;
        *i += len;
    }
    return -1;
}

static int skip_number(const char *s, size_t n, size_t *i) {
    size_t k = *i;
    if (k < n && s[k] == '-')
        k++;
    if (k >= n)
        return -1;
    if (s[k] == '0') {
        k++;
    } else if (s[k] >= '1' && s[k] <= '9') {
        while (k < n && s[k] >= '0' && s[k] <= '9')
            k++;
    } else {
        return -1;
    }
    if (k < n && s[k] == '.') {
        k++;
        if (k >= n || s[k] < '0' || s[k] > '9')
            return -1;
        while (k < n && s[k] >= '0' && s[k] <= '9')
            k++;
    }
    if (k < n && (s[k] == 'e' || s[k] == 'E')) {
        k++;
        if (k < n && (s[k] == '+' || s[k] == '-'))
            k++;
        if (k >= n || s[k] < '0' || s[k] > '9')
            return -1;
        while (k < n && s[k] >= '0' && s[k] <= '9')
            k++;
    }
    *i = k;
    return 0;
}

static int skip_literal(const char *s, size_t n, size_t *i, const char *word) {
    size_t len = strlen(word);
    if (*i + len > n || memcmp(s + *i, word, len) != 0)
        return -1;
    *i += len;
    return 0;
}

static int skip_value(const char *s, size_t n, size_t *i, int depth) {
    skip_ws(s, n, i);
    if (*i >= n)
        return -1;
    char c = s[*i];
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        if (depth >= JSON_MAX_DEPTH)
            return -1;
        (*i)++;
        skip_ws(s, n, i);
        if (*i < n && s[*i] == close) {
            (*i)++;
            return 0;
        }
        for (;;) {
            if (c == '{') {
                skip_ws(s, n, i);
                if (*i >= n || s[*i] != '"' || skip_string(s, n, i))
                    return -1;
                skip_ws(s, n, i);
                if (*i >= n || s[*i] != ':')
                    return -1;
                (*i)++;
            }
            if (skip_value(s, n, i, depth + 1))
                return -1;
            skip_ws(s, n, i);
            if (*i >= n)
                return -1;
            if (s[*i] == ',') {
                (*i)++;
                continue;
            }
            if (s[*i] == close) {
                (*i)++;
                return 0;
            }
            return -1;
        }
    }
    if (c == '"')
        return skip_string(s, n, i);
    if (c == 't')
        return skip_literal(s, n, i, "true");
    if (c == 'f')
        return skip_literal(s, n, i, "false");
    if (c == 'n')
        return skip_literal(s, n, i, "null");
    return skip_number(s, n, i);
}

int json_check(const char *s, size_t n) {
    size_t i = 0;
    if (skip_value(s, n, &i, 0))
        return -1;
    skip_ws(s, n, &i);
    return i == n ? 0 : -1;
}

int json_check_object(const char *s, size_t n) {
    size_t i = 0;
    skip_ws(s, n, &i);
    if (i >= n || s[i] != '{')
        return -1;
    return json_check(s, n);
}

/* in a validated document, skip one value without checks beyond what is needed */
static void next_value(jspan c, size_t *i, jspan *out) {
    skip_ws(c.p, c.n, i);
    size_t start = *i;
    skip_value(c.p, c.n, i, 0);
    out->p = c.p + start;
    out->n = *i - start;
}

int json_next(jspan c, size_t *pos, jspan *key, jspan *value) {
    if (c.n < 2 || (c.p[0] != '{' && c.p[0] != '['))
        return 0;
    size_t i = *pos ? *pos : 1;
    skip_ws(c.p, c.n, &i);
    if (i >= c.n || c.p[i] == '}' || c.p[i] == ']')
        return 0;
    if (c.p[i] == ',') {
        i++;
        skip_ws(c.p, c.n, &i);
    }
    if (c.p[0] == '{') {
        jspan k;
        next_value(c, &i, &k);
        if (key)
            *key = k;
        skip_ws(c.p, c.n, &i);
        i++; /* ':' */
    }
    next_value(c, &i, value);
    *pos = i;
    return 1;
}

int json_is(jspan v, char first) {
    if (!v.n)
        return 0;
    if (first == '-')
        return v.p[0] == '-' || (v.p[0] >= '0' && v.p[0] <= '9');
    return v.p[0] == first;
}

int json_string(jspan v, char *buf, size_t cap, size_t *len) {
    if (!json_is(v, '"') || v.n < 2 || cap == 0)
        return -1;
    size_t o = 0;
    for (size_t i = 1; i + 1 < v.n;) {
        unsigned char ch = (unsigned char)v.p[i];
        char tmp[4];
        size_t tn = 1;
        if (ch != '\\') {
            tmp[0] = (char)ch;
            i++;
        } else {
            char e = v.p[i + 1];
            i += 2;
            if (e == 'u') {
                unsigned cp;
                if (hex4(v.p, v.n, i, &cp))
                    return -1;
                i += 4;
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    unsigned lo;
                    if (i + 6 <= v.n && v.p[i] == '\\' && v.p[i + 1] == 'u' &&
                        !hex4(v.p, v.n, i + 2, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                        i += 6;
                    } else {
                        return -1; /* a lone surrogate: not encodable as UTF-8 */
                    }
                } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                    return -1;
                }
                if (cp == 0)
                    return -1;
                if (cp < 0x80) {
                    tmp[0] = (char)cp;
                } else if (cp < 0x800) {
                    tmp[0] = (char)(0xC0 | (cp >> 6));
                    tmp[1] = (char)(0x80 | (cp & 0x3F));
                    tn = 2;
                } else if (cp < 0x10000) {
                    tmp[0] = (char)(0xE0 | (cp >> 12));
                    tmp[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
                    tmp[2] = (char)(0x80 | (cp & 0x3F));
                    tn = 3;
                } else {
                    tmp[0] = (char)(0xF0 | (cp >> 18));
                    tmp[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
                    tmp[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
                    tmp[3] = (char)(0x80 | (cp & 0x3F));
                    tn = 4;
                }
            } else {
                const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
                const char *at = strchr(from, e);
                if (!at || !e)
                    return -1;
                tmp[0] = to[at - from];
            }
        }
        if (o + tn >= cap)
            return -1;
        memcpy(buf + o, tmp, tn);
        o += tn;
    }
    buf[o] = 0;
    if (len)
        *len = o;
    return 0;
}

char *json_strdup(jspan v) {
    if (!json_is(v, '"'))
        return NULL;
    size_t cap = v.n; /* decoding never grows a string */
    char *buf = malloc(cap);
    if (buf && json_string(v, buf, cap, NULL)) {
        free(buf);
        return NULL;
    }
    return buf;
}

int json_int(jspan v, int64_t *out) {
    if (!json_is(v, '-'))
        return -1;
    size_t i = 0;
    int neg = v.p[0] == '-';
    if (neg)
        i++;
    uint64_t acc = 0;
    if (i >= v.n)
        return -1;
    for (; i < v.n; i++) {
        if (v.p[i] < '0' || v.p[i] > '9')
            return -1; /* a fraction or exponent: not an integer literal */
        unsigned d = (unsigned)(v.p[i] - '0');
        if (acc > (UINT64_C(9223372036854775807) - d) / 10)
            return -1;
        acc = acc * 10 + d;
    }
    *out = neg ? -(int64_t)acc : (int64_t)acc;
    return 0;
}

int json_number(jspan v, double *out) {
    char tmp[64];
    if (!json_is(v, '-') || v.n >= sizeof tmp)
        return -1;
    memcpy(tmp, v.p, v.n);
    tmp[v.n] = 0;
    char *end;
    *out = strtod(tmp, &end);
    return *end ? -1 : 0;
}

int json_true(jspan v) { return v.n == 4 && memcmp(v.p, "true", 4) == 0; }

int json_get(jspan obj, const char *key, jspan *out) {
    if (!json_is(obj, '{'))
        return -1;
    size_t pos = 0, klen = strlen(key);
    jspan k, v;
    char name[256];
    while (json_next(obj, &pos, &k, &v)) {
        size_t n;
        if (k.n < sizeof name && !json_string(k, name, sizeof name, &n) && n == klen &&
            memcmp(name, key, klen) == 0) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* -- writing ------------------------------------------------------------------------------- */

void jb_raw(jbuf *b, const char *s, size_t n) {
    if (b->failed)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->failed = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void jb_lit(jbuf *b, const char *s) { jb_raw(b, s, strlen(s)); }

static const char hex[] = "0123456789abcdef";

/* the inside of a JSON string: quotes, backslashes and control characters escaped */
static void jb_escaped(jbuf *b, const char *s, size_t n) {
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        jb_raw(b, s + run, i - run);
        run = i + 1;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            jb_raw(b, e, 2);
        } else {
            char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            jb_raw(b, e, 6);
        }
    }
    jb_raw(b, s + run, n - run);
}

void jb_str(jbuf *b, const char *s, size_t n) {
    jb_raw(b, "\"", 1);
    jb_escaped(b, s, n);
    jb_raw(b, "\"", 1);
}

void jb_name(jbuf *b, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    jb_raw(b, "\"", 1);
    for (size_t i = 0; i < n;) {
        size_t j = i, len;
        while (j < n && (len = utf8_seq(u + j, n - j)))
            j += len;
        jb_escaped(b, s + i, j - i);
        if (j < n) { /* an undecodable byte, as os.fsdecode's surrogateescape gives it */
            char e[6] = {'\\', 'u', 'd', 'c', hex[u[j] >> 4], hex[u[j] & 15]};
            jb_raw(b, e, 6);
            j++;
        }
        i = j;
    }
    jb_raw(b, "\"", 1);
}

void jb_int(jbuf *b, int64_t v) {
    char buf[24];
    int i = sizeof buf;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        buf[--i] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        buf[--i] = '-';
    jb_raw(b, buf + i, sizeof buf - (size_t)i);
}

void jb_fixed(jbuf *b, uint64_t micros) {
    char frac[8];
    jb_int(b, (int64_t)(micros / 1000000));
    uint64_t f = micros % 1000000;
    frac[0] = '.';
    for (int k = 6; k >= 1; k--) {
        frac[k] = (char)('0' + f % 10);
        f /= 10;
    }
    jb_raw(b, frac, 7);
}

void jb_key(jbuf *b, const char *key) {
    if (b->n && b->p[b->n - 1] != '{')
        jb_raw(b, ",", 1);
    jb_str(b, key, strlen(key));
    jb_raw(b, ":", 1);
}

void jb_free(jbuf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
    b->failed = 0;
}
