/*
 * leanimg-guest-free: tells `leanimg checkpoint --live --guest-free SOCKET` which of the
 * guest's pages are free (spec/hints.md §3.1, the guest free-list protocol).
 *
 * Build it for the guest (static, no libraries):   gcc -static -O2 -o leanimg-guest-free leanimg-guest-free.c
 * Run it in the guest as root:                     leanimg-guest-free            (serve the port)
 *                                                  leanimg-guest-free --once     (print one answer)
 *
 * Where the pages come from: /proc/kpageflags, one u64 of flags per page frame. Linux sets
 * KPF_BUDDY (bit 10) on every page of a free buddy block (the block's first page, and since
 * 4.x each later page too: stable_page_flags() asks is_free_buddy_page() for pages with a zero
 * reference count). Pages on per-CPU free lists carry no flag and are not reported: missing
 * free pages costs size, never a wrong page. Each page is judged at the moment its flags are
 * read, after the host's request: that is what the stream-offset rule needs.
 *
 * The port: a virtio-serial port named org.leanimg.free.0 (QEMU: -device virtio-serial-pci
 * -chardev socket,id=lf,path=SOCKET,server=on,wait=off -device virtserialport,chardev=lf,
 * name=org.leanimg.free.0; the guest needs virtio_console). It is found by name in
 * /sys/class/virtio-ports, as udev would, so no udev is needed.
 *
 * Protocol, one line per request, ASCII:
 *   host:  "free NONCE\n"                      NONCE: 1-32 of [0-9a-f]
 *   guest: "begin NONCE PAGE_SIZE\n"
 *          "%016llx %016llx\n" per range      first page frame number, number of pages;
 *                                             ascending, disjoint, at most MAX_RANGES
 *          "end NONCE RANGES PAGES MICROSECONDS\n"
 *   or     "error NONCE MESSAGE\n"            (e.g. page poisoning on: free pages hold a
 *                                             pattern the kernel checks when it hands them out)
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PORT_NAME "org.leanimg.free.0"
#define KPF_BUDDY 10
#define MAX_RANGES (1u << 20)
#define CHUNK 65536                     /* page frames read per read() */
#define RANGE_LINE 34                   /* "%016llx %016llx\n" */

struct answer {
    char *text;
    size_t length, capacity;
    uint64_t ranges, pages;
};

static void append(struct answer *a, const char *data, size_t n)
{
    if (a->length + n > a->capacity) {
        size_t capacity = a->capacity ? a->capacity * 2 : 1 << 16;
        while (capacity < a->length + n)
            capacity *= 2;
        char *grown = realloc(a->text, capacity);
        if (!grown) {
            fprintf(stderr, "leanimg-guest-free: out of memory\n");
            exit(1);
        }
        a->text = grown;
        a->capacity = capacity;
    }
    memcpy(a->text + a->length, data, n);
    a->length += n;
}

static void add_range(struct answer *a, uint64_t first, uint64_t count)
{
    char line[RANGE_LINE + 1];
    if (a->ranges >= MAX_RANGES)        /* more ranges than the host takes: report fewer pages */
        return;
    snprintf(line, sizeof line, "%016llx %016llx\n", (unsigned long long)first, (unsigned long long)count);
    append(a, line, RANGE_LINE);
    a->ranges++;
    a->pages += count;
}

/* The kernel checks the poison pattern of a free page when it hands it out again. */
static const char *unsafe_kernel(void)
{
    char cmdline[4096] = "";
    int fd = open("/proc/cmdline", O_RDONLY);
    if (fd >= 0) {
        ssize_t n = read(fd, cmdline, sizeof cmdline - 1);
        cmdline[n > 0 ? n : 0] = 0;
        close(fd);
    }
    for (char *word = strtok(cmdline, " \n"); word; word = strtok(NULL, " \n"))
        if (!strcmp(word, "page_poison=1") || !strcmp(word, "page_poison=on") || !strcmp(word, "page_poison=y"))
            return "page poisoning is on (page_poison=): free pages hold a pattern the kernel checks";
    return NULL;
}

/* The free page frames, as ranges appended to a; NULL or why not. */
static const char *free_ranges(struct answer *a)
{
    static uint64_t flags[CHUNK];
    uint64_t pfn = 0, run_start = 0;
    int in_run = 0;
    int fd = open("/proc/kpageflags", O_RDONLY);
    if (fd < 0)
        return "cannot open /proc/kpageflags (needs root and CONFIG_PROC_PAGE_MONITOR)";
    for (;;) {
        ssize_t n = read(fd, flags, sizeof flags);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            close(fd);
            return "cannot read /proc/kpageflags";
        }
        if (n == 0)
            break;
        for (size_t i = 0; i < (size_t)n / 8; i++, pfn++) {
            int is_free = (flags[i] >> KPF_BUDDY) & 1;
            if (is_free && !in_run)
                run_start = pfn;
            else if (!is_free && in_run)
                add_range(a, run_start, pfn - run_start);
            in_run = is_free;
        }
    }
    if (in_run)
        add_range(a, run_start, pfn - run_start);
    close(fd);
    return NULL;
}

static uint64_t now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

/* The whole answer to request NONCE. */
static void answer(struct answer *a, const char *nonce)
{
    char line[256];
    uint64_t t0 = now_us();
    const char *why = unsafe_kernel();
    a->length = a->ranges = a->pages = 0;
    snprintf(line, sizeof line, "begin %s %ld\n", nonce, sysconf(_SC_PAGESIZE));
    append(a, line, strlen(line));
    if (!why)
        why = free_ranges(a);
    if (why) {
        a->length = 0;
        snprintf(line, sizeof line, "error %s %s\n", nonce, why);
    } else {
        snprintf(line, sizeof line, "end %s %llu %llu %llu\n", nonce, (unsigned long long)a->ranges,
                 (unsigned long long)a->pages, (unsigned long long)(now_us() - t0));
    }
    append(a, line, strlen(line));
}

static int write_all(int fd, const char *data, size_t n)
{
    while (n) {
        ssize_t w = write(fd, data, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        data += w;
        n -= (size_t)w;
    }
    return 0;
}

/* /dev/vportNpM of the port named PORT_NAME, found in sysfs. */
static int find_port(char *path, size_t size)
{
    DIR *dir = opendir("/sys/class/virtio-ports");
    struct dirent *entry;
    int found = 0;
    if (!dir)
        return 0;
    while (!found && (entry = readdir(dir))) {
        char name_file[512], name[128] = "";
        if (entry->d_name[0] == '.')
            continue;
        snprintf(name_file, sizeof name_file, "/sys/class/virtio-ports/%s/name", entry->d_name);
        int fd = open(name_file, O_RDONLY);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, name, sizeof name - 1);
        close(fd);
        name[n > 0 ? n : 0] = 0;
        name[strcspn(name, "\n")] = 0;
        if (!strcmp(name, PORT_NAME)) {
            snprintf(path, size, "/dev/%s", entry->d_name);
            found = 1;
        }
    }
    closedir(dir);
    return found;
}

static int valid_nonce(const char *nonce)
{
    size_t n = strlen(nonce);
    return n >= 1 && n <= 32 && strspn(nonce, "0123456789abcdef") == n;
}

static void serve_line(int port, struct answer *a, char *line)
{
    char reply[128];
    if (!strncmp(line, "free ", 5) && valid_nonce(line + 5)) {
        answer(a, line + 5);
        write_all(port, a->text, a->length);
        return;
    }
    snprintf(reply, sizeof reply, "error - unknown request\n");
    write_all(port, reply, strlen(reply));
}

static int serve(void)
{
    char path[300], line[128];
    size_t used = 0;
    struct answer a = {0};
    if (!find_port(path, sizeof path)) {
        fprintf(stderr, "leanimg-guest-free: no virtio port named %s (virtio_console loaded?)\n", PORT_NAME);
        return 1;
    }
    int port;
    /* one opener at a time: a helper that was just stopped may hold the port a moment longer */
    for (int tries = 0; (port = open(path, O_RDWR)) < 0 && errno == EBUSY && tries < 100; tries++)
        usleep(100000);
    if (port < 0) {
        fprintf(stderr, "leanimg-guest-free: cannot open %s: %s\n", path, strerror(errno));
        return 1;
    }
    for (;;) {
        char c;
        ssize_t n = read(port, &c, 1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {                   /* the host end is not connected: wait for it */
            used = 0;
            usleep(100000);
            continue;
        }
        if (c != '\n') {
            if (used < sizeof line - 1)
                line[used++] = c;
            continue;
        }
        line[used] = 0;
        used = 0;
        serve_line(port, &a, line);
    }
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--once")) {
        struct answer a = {0};
        answer(&a, "0");
        if (write_all(1, a.text, a.length))
            return 1;
        return !strncmp(a.text, "error", 5);
    }
    if (argc != 1) {
        fprintf(stderr, "usage: leanimg-guest-free [--once]\n");
        return 2;
    }
    return serve();
}
