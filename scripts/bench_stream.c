/* The load generators of bench_stream.py, in C: the same two modes, the same
 * stdin/stdout protocol, a fraction of the CPU per chunk.
 *
 *     cc -O2 -o bench_stream scripts/bench_stream.c
 *     ./bench_stream upstream          # prints its port
 *     ./bench_stream clients PORT N    # driven over stdin/stdout
 *
 * bench_stream.py's docstring is the specification; this file follows it
 * line by line, so that bench.py, bench_workers.py and bench_churn.py can
 * start either one (bench_stream.py compiles this file on demand). Why C:
 * the generators share the machine's two cores with the proxy, and the
 * Python loops cost about a third of what the proxy does per chunk, which
 * caps what a two-worker proxy can show.
 *
 * upstream: answers like llama-server. "GET /health" gets 200 {"status":"ok"}
 * and "GET /v1/models" (or /models) a one-model list, each with a
 * Content-Length, and the connection waits for its next request; a POST to
 * a path ending in "/completions" (or to "/completion") gets an endless SSE
 * stream (the head and one event at once, then one event every 100 ms) from
 * one timer that walks a wheel of 100 one-millisecond slots; any other
 * request gets llama-server's 404 (a short JSON body, "Connection: close")
 * at once, and the connection is closed. A body with "max_tokens":K gets K
 * events, then the chunked body's end, and the connection waits for its
 * next request. Every event is stamped "t=NANOSECONDS;" with CLOCK_MONOTONIC
 * just before it is written.
 *
 * clients: opens N streams in batches of 100, prints "open M" (how many
 * delivered an event), on "go" starts counting, on "stop" prints
 * "chunks p50 p99 max cpu elapsed broken" (delays in ms, CPU and elapsed
 * time in seconds) and exits.
 *
 * Linux only: epoll, timerfd. Level-triggered, one read or one write per
 * event; every epoll_wait wakeup handles all the sockets it returned.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define PERIOD_NS 100000000LL /* a token every 100 ms per stream */
#define SLOTS 100
#define SLOT_NS (PERIOD_NS / SLOTS)
#define MAX_EVENTS 1024      /* sockets handled per epoll_wait */
#define READ_SIZE 65536      /* one recv, as the Python loops */
#define REQUEST_LIMIT 65536  /* a request head and body larger than this is dropped */
#define TAIL 40              /* bytes kept between reads: a split stamp is whole next time */
#define BATCH 100            /* streams connected before waiting for their first events */
#define CONNECT_TIMEOUT_MS 10000
#define NAP_NS 1000000LL     /* the clients wake at most once a millisecond */

static const char EVENT_HEAD[] =
    "data: {\"object\":\"chat.completion.chunk\","
    "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t=";
static const char EVENT_TAIL[] = ";\"}}]}\n\n";
static const char STREAM_HEAD[] =
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n";
static const char MODELS[] =
    "{\"object\":\"list\",\"data\":[{\"id\":\"bench\",\"object\":\"model\",\"owned_by\":\"bench\"}]}";
static const char HEALTH[] = "{\"status\":\"ok\"}";
static const char NOT_FOUND[] =
    "{\"error\":{\"message\":\"File Not Found\",\"type\":\"not_found_error\",\"code\":404}}";
static const char REQUEST_BODY[] =
    "{\"model\":\"bench\",\"messages\":[{\"role\":\"user\",\"content\":\"Count.\"}],\"stream\":true}";
static const char BODY_END[] = "0\r\n\r\n";

static void die(const char *what) {
    perror(what);
    exit(1);
}

static int64_t monotonic_ns(void) {
    struct timespec now;
    if (clock_gettime(CLOCK_MONOTONIC, &now) != 0) die("clock_gettime");
    return (int64_t)now.tv_sec * 1000000000LL + now.tv_nsec;
}

static int set_nodelay(int fd) {
    int one = 1;
    return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* The first occurrence of needle in haystack[0:length], or NULL. */
static const char *find(const char *haystack, size_t length, const char *needle) {
    return memmem(haystack, length, needle, strlen(needle));
}

/* -- the upstream ---------------------------------------------------------------------- */

enum kind { LISTENER, TIMER, STREAM };

/* One accepted connection. While it waits for a request it has no slot
 * (slot < 0) and gathers the request in `request`; while it streams it is
 * on its slot's list and whatever it sends is ignored, as in bench_stream.py. */
struct conn {
    enum kind kind;
    int fd;
    int slot;            /* its wheel slot while streaming, else -1 */
    long left;           /* events still to send on a finite stream; -1: endless */
    struct conn *prev, *next; /* the slot's list */
    char *request;       /* the request so far (NULL while streaming) */
    size_t used, size;
};

struct upstream {
    int epoll, listener, timer;
    struct conn listener_conn, timer_conn;
    struct conn *wheel[SLOTS];
    unsigned long opened;
};

static void wheel_add(struct upstream *u, struct conn *c, int slot) {
    c->slot = slot;
    c->prev = NULL;
    c->next = u->wheel[slot];
    if (c->next) c->next->prev = c;
    u->wheel[slot] = c;
}

static void wheel_remove(struct upstream *u, struct conn *c) {
    if (c->slot < 0) return;
    if (c->prev) c->prev->next = c->next;
    else u->wheel[c->slot] = c->next;
    if (c->next) c->next->prev = c->prev;
    c->prev = c->next = NULL;
    c->slot = -1;
}

static void conn_close(struct upstream *u, struct conn *c) {
    wheel_remove(u, c);
    if (close(c->fd) != 0) perror("close"); /* close() also leaves the epoll set */
    free(c->request);
    free(c);
}

/* Ready to read a request: an empty buffer. 0 on success. */
static int await_request(struct conn *c) {
    c->size = 1024;
    c->used = 0;
    c->request = malloc(c->size);
    return c->request ? 0 : -1;
}

/* One chunk of the chunked body, an SSE event stamped now, written at out;
 * its length. out has room for EVENT_ROOM bytes. Formatted by hand: it is
 * most of the user-space work per event, and snprintf took a third of it. */
#define EVENT_ROOM 256
static size_t event(char *out) {
    char digits[24];
    size_t n_digits = 0;
    uint64_t stamp = (uint64_t)monotonic_ns();
    do { /* at least one digit, backwards */
        digits[n_digits++] = (char)('0' + stamp % 10);
        stamp /= 10;
    } while (stamp && n_digits < sizeof digits);
    size_t data_length = sizeof EVENT_HEAD - 1 + n_digits + sizeof EVENT_TAIL - 1;
    static const char hex[] = "0123456789abcdef";
    size_t at = 0;
    for (int shift = 8; shift >= 0; shift -= 4) /* the chunk size, under 4096 */
        if (data_length >> shift || shift == 0) out[at++] = hex[(data_length >> shift) & 0xf];
    out[at++] = '\r';
    out[at++] = '\n';
    memcpy(out + at, EVENT_HEAD, sizeof EVENT_HEAD - 1);
    at += sizeof EVENT_HEAD - 1;
    while (n_digits) out[at++] = digits[--n_digits];
    memcpy(out + at, EVENT_TAIL, sizeof EVENT_TAIL - 1);
    at += sizeof EVENT_TAIL - 1;
    out[at++] = '\r';
    out[at++] = '\n';
    return at;
}

/* Write all of data in one send, or end the stream: a full socket buffer
 * means the reader stopped reading, and a partial write would break the
 * chunked framing. 0 if the connection is still open. */
static int send_or_close(struct upstream *u, struct conn *c, const char *data, size_t length) {
    ssize_t sent = send(c->fd, data, length, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent == (ssize_t)length) return 0;
    conn_close(u, c);
    return -1;
}

/* The stream's next event; after a finite stream's last, the body's end. */
static void tick(struct upstream *u, struct conn *c, int with_head) {
    char out[sizeof STREAM_HEAD + EVENT_ROOM + sizeof BODY_END];
    size_t length = 0;
    if (with_head) {
        memcpy(out, STREAM_HEAD, sizeof STREAM_HEAD - 1);
        length = sizeof STREAM_HEAD - 1;
    }
    length += event(out + length);
    if (c->left < 0) {
        send_or_close(u, c, out, length);
    } else if (c->left > 1) {
        c->left -= 1;
        send_or_close(u, c, out, length);
    } else { /* the last event and the end; then wait for the next request */
        wheel_remove(u, c);
        c->left = -1;
        memcpy(out + length, BODY_END, sizeof BODY_END - 1);
        length += sizeof BODY_END - 1;
        if (await_request(c) != 0) {
            conn_close(u, c);
            return;
        }
        send_or_close(u, c, out, length);
    }
}

/* The value of a head's Content-Length (at a line's start, any case), or -1. */
static long content_length(const char *head, size_t length) {
    static const char name[] = "content-length:";
    size_t n = sizeof name - 1;
    for (size_t at = 0; at + n <= length; at++) {
        if ((at == 0 || head[at - 1] == '\n') && strncasecmp(head + at, name, n) == 0) {
            size_t i = at + n;
            while (i < length && (head[i] == ' ' || head[i] == '\t')) i++;
            if (i >= length || head[i] < '0' || head[i] > '9') continue;
            long value = 0;
            while (i < length && head[i] >= '0' && head[i] <= '9' && value < 1000000000L)
                value = value * 10 + (head[i++] - '0');
            return value;
        }
    }
    return -1;
}

/* "max_tokens":K in the body (spaces allowed after the colon): K, or -1. */
static long max_tokens(const char *body, size_t length) {
    static const char key[] = "\"max_tokens\":";
    const char *end = body + length;
    const char *at = body;
    while ((at = find(at, (size_t)(end - at), key)) != NULL) {
        const char *p = at + sizeof key - 1;
        while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')) p++;
        if (p < end && *p >= '0' && *p <= '9') {
            long value = 0;
            while (p < end && *p >= '0' && *p <= '9' && value < 1000000000L)
                value = value * 10 + (*p++ - '0');
            return value;
        }
        at += 1;
    }
    return -1;
}

enum route { ROUTE_STREAM, ROUTE_HEALTH, ROUTE_MODELS, ROUTE_MISSING };

/* Whether s[0:n] is word. */
static int is(const char *s, size_t n, const char *word) {
    return n == strlen(word) && memcmp(s, word, n) == 0;
}

/* What the upstream does with a request, by its head's method and path: as
 * bench_stream.py's route(). */
static enum route route_of(const char *head, size_t length) {
    const char *end = head + length;
    const char *space = memchr(head, ' ', length);
    if (!space) return ROUTE_MISSING;
    size_t method = (size_t)(space - head);
    const char *path = space + 1;
    const char *at = path;
    while (at < end && *at != ' ' && *at != '?' && *at != '\r') at++;
    size_t n = (size_t)(at - path);
    static const char suffix[] = "/completions";
    size_t s = sizeof suffix - 1;
    if (is(head, method, "GET") && is(path, n, "/health")) return ROUTE_HEALTH;
    if (is(head, method, "GET") && (is(path, n, "/v1/models") || is(path, n, "/models")))
        return ROUTE_MODELS;
    if (is(head, method, "POST")
        && ((n >= s && memcmp(path + n - s, suffix, s) == 0) || is(path, n, "/completion")))
        return ROUTE_STREAM;
    return ROUTE_MISSING;
}

/* A short JSON answer with a Content-Length, as llama-server writes one; 0 if
 * the connection is still open. */
static int json_answer(struct upstream *u, struct conn *c, const char *status, const char *body,
                       int close) {
    char answer[512];
    int n = snprintf(answer, sizeof answer,
                     "HTTP/1.1 %s\r\nContent-Type: application/json; charset=utf-8\r\n"
                     "%sContent-Length: %zu\r\n\r\n%s",
                     status, close ? "Connection: close\r\n" : "", strlen(body), body);
    if (n < 0 || (size_t)n >= sizeof answer) {
        conn_close(u, c);
        return -1;
    }
    return send_or_close(u, c, answer, (size_t)n);
}

/* A request is whole: answer it (the health, the models list, a 404, or a stream). */
static void request(struct upstream *u, struct conn *c, size_t head_length) {
    const char *body = c->request + head_length + 4;
    size_t body_length = c->used - head_length - 4;
    enum route route = route_of(c->request, head_length);
    long tokens = route == ROUTE_STREAM ? max_tokens(body, body_length) : -1;
    free(c->request); /* anything after the request is not read, as in bench_stream.py */
    c->request = NULL;
    c->used = c->size = 0;
    if (route == ROUTE_MISSING) {
        if (json_answer(u, c, "404 Not Found", NOT_FOUND, 1) == 0) conn_close(u, c);
        return;
    }
    if (route != ROUTE_STREAM) { /* the connection waits for its next request */
        if (await_request(c) != 0) {
            conn_close(u, c);
            return;
        }
        json_answer(u, c, "200 OK", route == ROUTE_HEALTH ? HEALTH : MODELS, 0);
        return;
    }
    wheel_add(u, c, (int)(u->opened % SLOTS));
    u->opened += 1;
    c->left = tokens;
    tick(u, c, 1);
}

static void readable(struct upstream *u, struct conn *c) {
    char scratch[4096];
    char *into = scratch;
    size_t room = sizeof scratch;
    if (c->request) {
        if (c->size - c->used < 4096 && c->size < REQUEST_LIMIT) {
            size_t size = c->size * 2;
            char *grown = realloc(c->request, size);
            if (!grown) {
                conn_close(u, c);
                return;
            }
            c->request = grown;
            c->size = size;
        }
        into = c->request + c->used;
        room = c->size - c->used;
        if (room == 0) { /* over REQUEST_LIMIT: not a request of ours */
            conn_close(u, c);
            return;
        }
    }
    ssize_t n = recv(c->fd, into, room, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) {
        conn_close(u, c);
        return;
    }
    if (!c->request) return; /* streaming: what the reader sends is ignored */
    c->used += (size_t)n;
    const char *sep = find(c->request, c->used, "\r\n\r\n");
    if (!sep) return;
    size_t head_length = (size_t)(sep - c->request);
    long length = content_length(c->request, head_length);
    if (length >= 0 && c->used - head_length - 4 < (size_t)length) return;
    request(u, c, head_length);
}

static void accept_all(struct upstream *u) {
    for (;;) {
        int fd = accept4(u->listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR
                || errno == ECONNABORTED)
                return;
            die("accept4"); /* e.g. EMFILE: as bench_stream.py, which raises */
        }
        struct conn *c = calloc(1, sizeof *c);
        if (!c || set_nodelay(fd) != 0 || await_request(c) != 0) {
            if (c) free(c->request);
            free(c);
            close(fd);
            continue;
        }
        c->kind = STREAM;
        c->fd = fd;
        c->slot = -1;
        c->left = -1;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(u->epoll, EPOLL_CTL_ADD, fd, &ev) != 0) {
            perror("epoll_ctl");
            conn_close(u, c);
        }
    }
}

/* Serve one slot: the next event of every stream on it. */
static void serve_slot(struct upstream *u, int slot) {
    struct conn *c = u->wheel[slot];
    while (c) {
        struct conn *next = c->next; /* tick may take c off the list, or free it */
        tick(u, c, 0);
        c = next;
    }
}

_Noreturn static void run_upstream(void) {
    struct upstream u;
    memset(&u, 0, sizeof u);
    u.listener = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (u.listener < 0) die("socket");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(u.listener, (struct sockaddr *)&addr, sizeof addr) != 0) die("bind");
    if (listen(u.listener, 4096) != 0) die("listen");
    socklen_t len = sizeof addr;
    if (getsockname(u.listener, (struct sockaddr *)&addr, &len) != 0) die("getsockname");

    u.epoll = epoll_create1(EPOLL_CLOEXEC);
    if (u.epoll < 0) die("epoll_create1");
    /* One periodic timer, a tick per slot; its count of expirations is not
     * used: the clock says which slots are due, and a late loop catches up. */
    u.timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (u.timer < 0) die("timerfd_create");
    int64_t tick_at = monotonic_ns() + SLOT_NS;
    struct itimerspec spec = {
        .it_interval = {.tv_sec = 0, .tv_nsec = SLOT_NS},
        .it_value = {.tv_sec = tick_at / 1000000000LL, .tv_nsec = tick_at % 1000000000LL},
    };
    if (timerfd_settime(u.timer, TFD_TIMER_ABSTIME, &spec, NULL) != 0) die("timerfd_settime");
    u.listener_conn.kind = LISTENER;
    u.timer_conn.kind = TIMER;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &u.listener_conn};
    if (epoll_ctl(u.epoll, EPOLL_CTL_ADD, u.listener, &ev) != 0) die("epoll_ctl");
    ev.data.ptr = &u.timer_conn;
    if (epoll_ctl(u.epoll, EPOLL_CTL_ADD, u.timer, &ev) != 0) die("epoll_ctl");

    printf("%d\n", ntohs(addr.sin_port));
    if (fflush(stdout) != 0) die("stdout");

    static struct epoll_event events[MAX_EVENTS];
    unsigned long tick = 0;
    for (;;) { /* until the bench terminates the process */
        int n = epoll_wait(u.epoll, events, MAX_EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            struct conn *c = events[i].data.ptr;
            if (c->kind == LISTENER) {
                accept_all(&u);
            } else if (c->kind == TIMER) {
                uint64_t expirations;
                if (read(u.timer, &expirations, sizeof expirations) < 0 && errno != EAGAIN)
                    die("read timerfd");
            } else {
                readable(&u, c);
            }
        }
        int64_t now = monotonic_ns();
        while (tick_at <= now) { /* when late, catch up: every slot is served */
            serve_slot(&u, (int)(tick % SLOTS));
            tick += 1;
            tick_at += SLOT_NS;
        }
    }
}

/* -- the clients ----------------------------------------------------------------------- */

/* One stream: its socket and the bytes after its last whole stamp. */
struct stream {
    int fd;             /* -1 once closed */
    int open;           /* has received its first event */
    unsigned char tail_length;
    char tail[TAIL];
};

struct clients {
    int epoll;
    int port;
    struct stream *streams;
    int count;         /* streams connected so far */
    int open;          /* of them, how many have delivered an event */
    long broken;
    int counting;
    int64_t *delays;
    size_t delays_used, delays_size;
    char line[256];    /* stdin, up to its next newline */
    size_t line_used;
    int stdin_eof;
    int64_t woke;        /* CLOCK_MONOTONIC at the last epoll_wait's return */
    int64_t real_offset; /* CLOCK_REALTIME - CLOCK_MONOTONIC, then */
};

#define STDIN_TAG 1 /* epoll data of stdin; a stream carries its index + 2 */

static void record(struct clients *cl, int64_t delay) {
    if (cl->delays_used == cl->delays_size) {
        size_t size = cl->delays_size ? cl->delays_size * 2 : 65536;
        int64_t *grown = realloc(cl->delays, size * sizeof *grown);
        if (!grown) die("realloc");
        cl->delays = grown;
        cl->delays_size = size;
    }
    cl->delays[cl->delays_used++] = delay;
}

/* Every whole "t=DIGITS;" in data[0:length], timed against received; the
 * offset just past the last one, or 0 if there was none. It looks for '='
 * (memchr is the fast search; our events have no other '=') and then for
 * the 't' before it. */
static size_t stamps(struct clients *cl, const char *data, size_t length, int64_t received) {
    size_t end = 0;
    const char *p = data + 1, *stop = data + length; /* p: just past a candidate 't' */
    while (p < stop && (p = memchr(p, '=', (size_t)(stop - p))) != NULL) {
        const char *q = p + 1;
        if (p[-1] != 't') {
            p = q;
            continue;
        }
        uint64_t stamp = 0; /* unsigned: a runaway number wraps, it does not overflow */
        while (q < stop && *q >= '0' && *q <= '9') stamp = stamp * 10 + (uint64_t)(*q++ - '0');
        if (q > p + 1 && q < stop && *q == ';') {
            if (cl->counting) record(cl, received - (int64_t)stamp);
            end = (size_t)(q + 1 - data);
        }
        p = q;
    }
    return end;
}

/* When the kernel took in the last segment a recvmsg read (SO_TIMESTAMPNS,
 * in CLOCK_REALTIME), on the monotonic clock; the clock now if there is no
 * such stamp. That is when a client reading at once would have read it. */
static int64_t arrival(const struct clients *cl, struct msghdr *message) {
    for (struct cmsghdr *c = CMSG_FIRSTHDR(message); c; c = CMSG_NXTHDR(message, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
            struct timespec at;
            memcpy(&at, CMSG_DATA(c), sizeof at);
            int64_t real = (int64_t)at.tv_sec * 1000000000LL + at.tv_nsec;
            if (real > 0) return real - cl->real_offset;
        }
    }
    return monotonic_ns();
}

static void stream_close(struct clients *cl, struct stream *s) {
    if (close(s->fd) != 0) perror("close");
    s->fd = -1;
    if (s->open) cl->open -= 1;
    s->open = 0;
}

/* What one readable stream has sent. */
static void stream_read(struct clients *cl, struct stream *s) {
    static char buffer[TAIL + READ_SIZE];
    memcpy(buffer, s->tail, s->tail_length);
    struct iovec into = {.iov_base = buffer + s->tail_length, .iov_len = READ_SIZE};
    union { /* aligned for the control message */
        char bytes[CMSG_SPACE(sizeof(struct timespec))];
        struct cmsghdr header;
    } control;
    struct msghdr message = {.msg_iov = &into, .msg_iovlen = 1};
    message.msg_control = control.bytes;
    message.msg_controllen = sizeof control.bytes;
    ssize_t n = recvmsg(s->fd, &message, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    int64_t received = arrival(cl, &message); /* before parsing: only transit counts */
    if (n <= 0) {
        cl->broken += 1;
        stream_close(cl, s);
        return;
    }
    size_t length = s->tail_length + (size_t)n;
    size_t end = stamps(cl, buffer, length, received);
    if (end && !s->open) {
        s->open = 1;
        cl->open += 1;
    }
    /* A stamp split between two reads is matched once whole. */
    size_t keep_from = length > TAIL && length - TAIL > end ? length - TAIL : end;
    s->tail_length = (unsigned char)(length - keep_from);
    memcpy(s->tail, buffer + keep_from, s->tail_length);
}

/* Read what has arrived within timeout_ms; 1 if stdin has something.
 *
 * After each wakeup the clients nap out the rest of NAP_NS: woken for every
 * chunk (a proxy writes them one by one) they spent half their CPU, and the
 * proxy a few microseconds a chunk, on the sleeps and wake-ups alone. The nap
 * does not add to the delays: those are timed from the kernel's arrival
 * time (see arrival()). */
static int poll_streams(struct clients *cl, int timeout_ms) {
    static struct epoll_event events[MAX_EVENTS];
    int n = epoll_wait(cl->epoll, events, MAX_EVENTS, timeout_ms);
    if (n < 0) {
        if (errno == EINTR) return 0;
        die("epoll_wait");
    }
    cl->woke = monotonic_ns();
    /* CLOCK_REALTIME (the kernel's receive stamps) minus CLOCK_MONOTONIC
     * (the events' stamps), read anew each wakeup: NTP may slew the first. */
    struct timespec real;
    if (clock_gettime(CLOCK_REALTIME, &real) != 0) die("clock_gettime");
    cl->real_offset = (int64_t)real.tv_sec * 1000000000LL + real.tv_nsec - cl->woke;
    int command = 0;
    for (int i = 0; i < n; i++) {
        if (events[i].data.u64 == STDIN_TAG) {
            command = 1;
            continue;
        }
        struct stream *s = &cl->streams[events[i].data.u64 - 2];
        if (s->fd >= 0) stream_read(cl, s);
    }
    int64_t left = cl->woke + NAP_NS - monotonic_ns();
    if (!command && left > 0) {
        struct timespec nap = {.tv_sec = 0, .tv_nsec = (long)left};
        if (nanosleep(&nap, NULL) != 0 && errno != EINTR) die("nanosleep");
    }
    return command;
}

/* A connected, non-blocking socket to 127.0.0.1:port within the timeout, or exit. */
static int connect_one(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) die("socket");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        if (errno != EINPROGRESS) die("connect");
        struct pollfd waiting = {.fd = fd, .events = POLLOUT};
        int ready = poll(&waiting, 1, CONNECT_TIMEOUT_MS);
        if (ready < 0) die("poll");
        if (ready == 0) {
            fprintf(stderr, "connect: timed out\n");
            exit(1);
        }
        int error = 0;
        socklen_t len = sizeof error;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0) die("getsockopt");
        if (error) {
            errno = error;
            die("connect");
        }
    }
    if (set_nodelay(fd) != 0) die("setsockopt");
    int one = 1; /* the kernel's receive time of each read; see arrival() */
    if (setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one) != 0) die("setsockopt");
    return fd;
}

static void connect_streams(struct clients *cl, int how_many) {
    char request[512];
    int length = snprintf(request, sizeof request,
                          "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                          "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                          sizeof REQUEST_BODY - 1, REQUEST_BODY);
    for (int i = 0; i < how_many; i++) {
        struct stream *s = &cl->streams[cl->count];
        s->fd = connect_one(cl->port);
        if (send(s->fd, request, (size_t)length, MSG_NOSIGNAL) != length) die("send");
        struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)cl->count + 2};
        if (epoll_ctl(cl->epoll, EPOLL_CTL_ADD, s->fd, &ev) != 0) die("epoll_ctl");
        cl->count += 1;
    }
}

/* Open `total` streams in batches of 100; how many delivered an event. */
static int open_streams(struct clients *cl, int total, double limit_s) {
    int64_t deadline = monotonic_ns() + (int64_t)(limit_s * 1e9);
    for (int start = 0; start < total; start += BATCH) {
        int batch = total - start < BATCH ? total - start : BATCH;
        connect_streams(cl, batch);
        while (cl->open < start + batch) {
            if (monotonic_ns() > deadline) return cl->open;
            poll_streams(cl, 50);
        }
    }
    return cl->open;
}

/* A line from stdin already buffered, without its newline: 1, or 0. */
static int take_line(struct clients *cl, char *out, size_t size) {
    char *newline = memchr(cl->line, '\n', cl->line_used);
    if (!newline && !cl->stdin_eof && cl->line_used < sizeof cl->line) return 0;
    size_t length = newline ? (size_t)(newline - cl->line) : cl->line_used;
    size_t copy = length < size - 1 ? length : size - 1;
    memcpy(out, cl->line, copy);
    out[copy] = '\0';
    size_t consumed = newline ? length + 1 : length;
    memmove(cl->line, cl->line + consumed, cl->line_used - consumed);
    cl->line_used -= consumed;
    while (copy > 0 && (out[copy - 1] == '\r' || out[copy - 1] == ' ')) out[--copy] = '\0';
    return 1;
}

/* Relay-read every stream until a line comes on stdin; the line ("" at EOF). */
static void run_until_line(struct clients *cl, char *out, size_t size) {
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = STDIN_TAG};
    if (epoll_ctl(cl->epoll, EPOLL_CTL_ADD, STDIN_FILENO, &ev) != 0) die("epoll_ctl stdin");
    while (!take_line(cl, out, size)) {
        if (!poll_streams(cl, 1000)) continue;
        ssize_t n = read(STDIN_FILENO, cl->line + cl->line_used, sizeof cl->line - cl->line_used);
        if (n < 0 && errno != EAGAIN && errno != EINTR) die("read stdin");
        if (n == 0) cl->stdin_eof = 1;
        if (n > 0) cl->line_used += (size_t)n;
    }
    if (epoll_ctl(cl->epoll, EPOLL_CTL_DEL, STDIN_FILENO, NULL) != 0) die("epoll_ctl stdin");
}

static double cpu_now(void) {
    struct rusage usage;
    if (getrusage(RUSAGE_SELF, &usage) != 0) die("getrusage");
    return (double)usage.ru_utime.tv_sec + usage.ru_utime.tv_usec / 1e6
           + (double)usage.ru_stime.tv_sec + usage.ru_stime.tv_usec / 1e6;
}

static int compare(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The q-quantile of the sorted delays, in ms, as bench_stream.py takes it. */
static double quantile_ms(const struct clients *cl, double q) {
    if (!cl->delays_used) return -1.0;
    size_t index = (size_t)(q * (double)cl->delays_used);
    if (index > cl->delays_used - 1) index = cl->delays_used - 1;
    return (double)cl->delays[index] / 1e6;
}

static int run_clients(int port, int total) {
    struct clients cl;
    memset(&cl, 0, sizeof cl);
    cl.port = port;
    cl.streams = calloc((size_t)total + 1, sizeof *cl.streams);
    if (!cl.streams) die("calloc");
    cl.epoll = epoll_create1(EPOLL_CLOEXEC);
    if (cl.epoll < 0) die("epoll_create1");
    int opened = open_streams(&cl, total, 30.0 + total / 50.0);
    printf("open %d\n", opened);
    if (fflush(stdout) != 0) die("stdout");
    char line[64];
    run_until_line(&cl, line, sizeof line);
    if (strcmp(line, "go") == 0) {
        cl.counting = 1;
        cl.broken = 0;
        double cpu = cpu_now();
        int64_t began = monotonic_ns();
        run_until_line(&cl, line, sizeof line); /* "stop" */
        double elapsed = (double)(monotonic_ns() - began) / 1e9;
        cpu = cpu_now() - cpu;
        qsort(cl.delays, cl.delays_used, sizeof *cl.delays, compare);
        printf("%zu %.6f %.6f %.6f %.6f %.6f %ld\n", cl.delays_used, quantile_ms(&cl, 0.5),
               quantile_ms(&cl, 0.99), quantile_ms(&cl, 1.0), cpu, elapsed, cl.broken);
        if (fflush(stdout) != 0) die("stdout");
    }
    for (int i = 0; i < cl.count; i++)
        if (cl.streams[i].fd >= 0) stream_close(&cl, &cl.streams[i]);
    close(cl.epoll);
    free(cl.streams);
    free(cl.delays);
    return 0;
}

static int usage(void) {
    fprintf(stderr, "usage: bench_stream upstream | bench_stream clients PORT N\n");
    return 2;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN); /* a closed reader is a failed send, not a signal */
    if (argc == 2 && strcmp(argv[1], "upstream") == 0) run_upstream();
    if (argc == 4 && strcmp(argv[1], "clients") == 0) {
        char *end;
        long port = strtol(argv[2], &end, 10);
        if (*end || port <= 0 || port > 65535) return usage();
        long total = strtol(argv[3], &end, 10);
        if (*end || total < 0 || total > 1000000) return usage();
        return run_clients((int)port, (int)total);
    }
    return usage();
}
