/*
 * Test-guest workload, linked statically and run from the busybox initramfs.
 *
 *   workload pagecache DIR      read every regular file under DIR (page cache)
 *   workload anon MIB           fill MIB MiB of anonymous memory with random data
 *   workload dirty DIR MIB      write MIB MiB of random data to DIR/dirty.bin, no sync
 *   workload idle               nothing
 *   workload beacon             nothing, and heartbeat every BEACON_MS (20) ms instead of HB_MS: how
 *                               soon a resumed guest runs again is seen to within 20 ms
 *   workload freed MIB          fill MIB MiB of anonymous memory with random data, then give
 *                               it back to the kernel (munmap): stale free pages
 *   workload fillall [MARGIN]   allocate all available memory but MARGIN MiB (default 24, from
 *                               MemAvailable), write a pattern to every page and check it
 *                               (prints WORKLOAD-ERROR on a mismatch), then free it
 *   workload words MIB [ROUNDS] [PAGES]
 *                               fill MIB MiB (page aligned) with random data, then each
 *                               round write 1..4 random 8-byte words in each of PAGES
 *                               (default 256) random pages spread over the whole buffer
 *   workload check MIB          fill MIB MiB with random data and remember its checksum;
 *                               before every heartbeat read the whole buffer again and
 *                               compare ("WORKLOAD-ERROR check ..." and exit on a mismatch),
 *                               so "HB check n" after a restore means every page read back
 *                               as it was written
 *   workload pages MIB [ROUNDS] [PERMILLE]
 *                               fill MIB MiB (page aligned) with random data, then each
 *                               round rewrite PERMILLE/1000 (default 50, i.e. 5%) of its
 *                               pages, picked at random, with fresh random data
 *   workload liar MIB [garbage | slow MS]
 *                               a guest free-list helper that lies (guest/leanimg-guest-free.c's
 *                               protocol on the port org.leanimg.free.0): every answer says all
 *                               of RAM is free; after each answer it rewrites every page of its
 *                               MIB MiB buffer, each page starting with LIAR_MARK and the
 *                               number of the answer (a u64 at byte 16): pages hinted FREE
 *                               and written after the hint (spec/hints.md LI-HNT-023);
 *                               with "garbage" its answers break the protocol (a bad range line);
 *                               with "slow MS" it prints "LIAR-HEARD <nonce>" when a request
 *                               arrives and writes its answer MS milliseconds of guest time later
 *
 * After the work it prints "WORKLOAD-DONE <mode> <checksum>" and then a heartbeat
 * "HB <mode> <n>" every HB_MS milliseconds forever, so a test can see that a guest
 * restored from a save keeps running.
 *
 * words and pages print "WORKLOAD-DONE" after the fill and then do one round of writes
 * before every heartbeat: "HB <mode> n" means rounds 0..n are in memory.  With ROUNDS > 0
 * (0 = forever) they stop writing after round ROUNDS-1 but keep their memory and keep
 * heartbeating, so a test can end a phase at a known point (the guest then has both
 * buffers; the heartbeat number says how many rounds happened).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define HB_MS 500
#define BEACON_MS 20
#define PAGE 4096

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;

static uint64_t next_random(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void fill_random(uint64_t *buf, size_t words)
{
    for (size_t i = 0; i < words; i++)
        buf[i] = next_random();
}

static uint64_t read_file(const char *path)
{
    static unsigned char buf[1 << 16];
    uint64_t sum = 0;
    ssize_t n;
    int fd = open(path, O_RDONLY);

    if (fd < 0)
        return 0;
    while ((n = read(fd, buf, sizeof buf)) > 0)
        for (ssize_t i = 0; i < n; i += 512)
            sum = sum * 31 + buf[i];
    close(fd);
    return sum;
}

static uint64_t read_tree(const char *dir)
{
    char path[4096];
    struct dirent *de;
    struct stat st;
    uint64_t sum = 0;
    DIR *d = opendir(dir);

    if (!d)
        return 0;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (lstat(path, &st) != 0)
            continue;
        if (S_ISDIR(st.st_mode))
            sum += read_tree(path);
        else if (S_ISREG(st.st_mode))
            sum += read_file(path);
    }
    closedir(d);
    return sum;
}

static uint64_t fill_anon(long mib)
{
    size_t bytes = (size_t)mib << 20;
    uint64_t *mem = malloc(bytes);

    if (!mem) {
        printf("WORKLOAD-ERROR malloc %ld MiB\n", mib);
        exit(1);
    }
    fill_random(mem, bytes / 8);
    return mem[bytes / 8 - 1];  /* the block stays allocated for the process lifetime */
}

static uint64_t fill_and_free(long mib)
{
    size_t bytes = (size_t)mib << 20;
    uint64_t *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint64_t last;

    if (mem == MAP_FAILED) {
        printf("WORKLOAD-ERROR mmap %ld MiB\n", mib);
        exit(1);
    }
    fill_random(mem, bytes / 8);
    last = mem[bytes / 8 - 1];
    munmap(mem, bytes);
    return last;
}

static long available_mib(void)
{
    char line[256];
    long kib = -1;
    FILE *f = fopen("/proc/meminfo", "r");

    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %ld kB", &kib) == 1)
            break;
    if (f)
        fclose(f);
    return kib / 1024;
}

/* Every page written with a value derived from its index, then read back. */
static uint64_t check_memory(long margin)
{
    long mib = available_mib() - margin;
    size_t bytes, words;
    uint64_t *mem;

    if (mib <= 0) {
        printf("WORKLOAD-ERROR fillall: %ld MiB available\n", mib + margin);
        exit(1);
    }
    bytes = (size_t)mib << 20;
    words = bytes / 8;
    mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        printf("WORKLOAD-ERROR mmap %ld MiB\n", mib);
        exit(1);
    }
    for (size_t i = 0; i < words; i++)
        mem[i] = i * 0x9e3779b97f4a7c15ULL + 1;
    for (size_t i = 0; i < words; i++)
        if (mem[i] != i * 0x9e3779b97f4a7c15ULL + 1) {
            printf("WORKLOAD-ERROR fillall: word %zu of %ld MiB reads %016llx\n", i, mib,
                   (unsigned long long)mem[i]);
            exit(1);
        }
    munmap(mem, bytes);
    return (uint64_t)mib;
}

static uint64_t write_dirty(const char *dir, long mib)
{
    static uint64_t buf[(1 << 20) / 8];
    char path[4096];
    int fd;

    snprintf(path, sizeof path, "%s/dirty.bin", dir);
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        printf("WORKLOAD-ERROR open %s\n", path);
        exit(1);
    }
    for (long i = 0; i < mib; i++) {
        fill_random(buf, sizeof buf / 8);
        if (write(fd, buf, sizeof buf) != (ssize_t)sizeof buf) {
            printf("WORKLOAD-ERROR write %s\n", path);
            exit(1);
        }
    }
    close(fd);
    return buf[0];
}

static void heartbeat(const char *mode, long ms)
{
    struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

    for (unsigned long n = 0;; n++) {
        printf("HB %s %lu\n", mode, n);
        fflush(stdout);
        nanosleep(&ts, NULL);
    }
}

static uint64_t *alloc_filled(long mib, size_t *pages)
{
    size_t bytes = (size_t)mib << 20;
    void *mem = NULL;

    if (mib <= 0 || posix_memalign(&mem, PAGE, bytes) != 0 || !mem) {
        printf("WORKLOAD-ERROR posix_memalign %ld MiB\n", mib);
        exit(1);
    }
    fill_random(mem, bytes / 8);
    *pages = bytes / PAGE;
    return mem;
}

/* A few changed words in many pages: what FITDOC's 8-byte deltas are for. */
static void words_round(uint64_t *mem, size_t pages, long touched)
{
    for (long i = 0; i < touched; i++) {
        uint64_t *page = mem + (next_random() % pages) * (PAGE / 8);
        int n = 1 + (int)(next_random() % 4);
        for (int w = 0; w < n; w++)
            page[next_random() % (PAGE / 8)] = next_random();
    }
}

/* Whole pages rewritten with fresh random data: no delta helps. */
static void pages_round(uint64_t *mem, size_t pages, long permille)
{
    size_t count = pages * (size_t)permille / 1000;

    for (size_t i = 0; i < count; i++)
        fill_random(mem + (next_random() % pages) * (PAGE / 8), PAGE / 8);
}

static uint64_t checksum(const uint64_t *mem, size_t words)
{
    uint64_t sum = 0;

    for (size_t i = 0; i < words; i++)
        sum = (sum ^ mem[i]) * 0x100000001b3ULL;
    return sum;
}

/* Reads back its whole buffer before every heartbeat: a lazily restored page that arrived
 * wrong (or as zeros) ends the heartbeat. */
static void check_loop(long mib)
{
    struct timespec ts = { HB_MS / 1000, (HB_MS % 1000) * 1000000L };
    size_t pages;
    uint64_t *mem = alloc_filled(mib, &pages);
    size_t words = pages * (PAGE / 8);
    uint64_t want = checksum(mem, words);

    printf("WORKLOAD-DONE check %016llx\n", (unsigned long long)want);
    for (unsigned long n = 0;; n++) {
        uint64_t got = checksum(mem, words);
        if (got != want) {
            printf("WORKLOAD-ERROR check round %lu: checksum %016llx, expected %016llx\n", n,
                   (unsigned long long)got, (unsigned long long)want);
            fflush(stdout);
            exit(1);
        }
        printf("HB check %lu\n", n);
        fflush(stdout);
        nanosleep(&ts, NULL);
    }
}

static void rounds(const char *mode, long mib, long limit, long amount)
{
    struct timespec ts = { HB_MS / 1000, (HB_MS % 1000) * 1000000L };
    size_t pages;
    uint64_t *mem = alloc_filled(mib, &pages);

    printf("WORKLOAD-DONE %s %016llx\n", mode, (unsigned long long)mem[pages * (PAGE / 8) - 1]);
    for (unsigned long n = 0;; n++) {
        if (limit <= 0 || n < (unsigned long)limit) {
            if (mode[0] == 'w')
                words_round(mem, pages, amount);
            else
                pages_round(mem, pages, amount);
        }
        printf("HB %s %lu\n", mode, n);
        fflush(stdout);
        nanosleep(&ts, NULL);
    }
}

#define LIAR_MARK "LEANIMG-AFTERHNT"   /* 16 bytes at the start of each page the liar writes */

static int open_free_port(void)
{
    DIR *d = opendir("/sys/class/virtio-ports");
    struct dirent *de;
    char path[512], name[128];
    int port = -1;

    while (d && port < 0 && (de = readdir(d)) != NULL) {
        snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", de->d_name);
        int fd = open(path, O_RDONLY);
        ssize_t n = fd >= 0 ? read(fd, name, sizeof name - 1) : -1;
        if (fd >= 0)
            close(fd);
        name[n > 0 ? n : 0] = 0;
        if (!strncmp(name, "org.leanimg.free.0\n", 19)) {
            snprintf(path, sizeof path, "/dev/%s", de->d_name);
            /* a helper killed a moment ago may hold the port still (one opener at a time) */
            for (int tries = 0; (port = open(path, O_RDWR)) < 0 && errno == EBUSY && tries < 100; tries++)
                usleep(100000);
        }
    }
    if (d)
        closedir(d);
    if (port < 0) {
        printf("WORKLOAD-ERROR liar: cannot open the port org.leanimg.free.0\n");
        exit(1);
    }
    return port;
}

static void liar(long mib, int garbage, long slow_ms)
{
    size_t pages;
    uint64_t *mem = alloc_filled(mib, &pages);
    int port = open_free_port();
    char line[128], reply[256];
    size_t used = 0;
    unsigned long lies = 0;
    long ram_pages = sysconf(_SC_PHYS_PAGES);

    printf("WORKLOAD-DONE liar %016llx\n", (unsigned long long)mem[0]);
    for (;;) {
        char c;
        ssize_t n = read(port, &c, 1);
        if (n <= 0) {
            if (n < 0 && errno == EINTR)
                continue;
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
        if (strncmp(line, "free ", 5))
            continue;
        if (slow_ms > 0) {
            printf("LIAR-HEARD %s\n", line + 5);
            fflush(stdout);
            struct timespec wait = {slow_ms / 1000, slow_ms % 1000 * 1000000L};
            nanosleep(&wait, NULL);
        }
        int len = garbage ? snprintf(reply, sizeof reply, "begin %s 4096\nnot a range\n", line + 5)
                          : snprintf(reply, sizeof reply, "begin %s 4096\n%016llx %016llx\nend %s 1 %ld 0\n",
                                     line + 5, 0ULL, (unsigned long long)ram_pages, line + 5, ram_pages);
        if (write(port, reply, (size_t)len) != len)
            continue;
        lies++;
        for (size_t p = 0; p < pages; p++) {
            uint64_t *page = mem + p * (PAGE / 8);
            fill_random(page, PAGE / 8);
            memcpy(page, LIAR_MARK, 16);
            page[2] = lies;                 /* which answer this rewrite followed */
        }
        printf("HB liar %lu\n", lies);
        fflush(stdout);
    }
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "idle";
    uint64_t sum = 0;

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!strcmp(mode, "pagecache") && argc > 2)
        sum = read_tree(argv[2]);
    else if (!strcmp(mode, "anon") && argc > 2)
        sum = fill_anon(atol(argv[2]));
    else if (!strcmp(mode, "freed") && argc > 2)
        sum = fill_and_free(atol(argv[2]));
    else if (!strcmp(mode, "fillall"))
        sum = check_memory(argc > 2 ? atol(argv[2]) : 24);
    else if (!strcmp(mode, "dirty") && argc > 3)
        sum = write_dirty(argv[2], atol(argv[3]));
    else if (!strcmp(mode, "check") && argc > 2) {
        rng_state ^= 0x27d4eb2f165667c5ULL;
        check_loop(atol(argv[2]));
    } else if ((!strcmp(mode, "words") || !strcmp(mode, "pages")) && argc > 2) {
        /* Seeded apart from anon/dirty so their random data never coincide. */
        rng_state ^= mode[0] == 'w' ? 0x5bd1e9955bd1e995ULL : 0xc2b2ae3d27d4eb4fULL;
        rounds(mode, atol(argv[2]), argc > 3 ? atol(argv[3]) : 0,
               argc > 4 ? atol(argv[4]) : (mode[0] == 'w' ? 256 : 50));
    } else if (!strcmp(mode, "liar") && argc > 2) {
        liar(atol(argv[2]), argc > 3 && !strcmp(argv[3], "garbage"),
             argc > 4 && !strcmp(argv[3], "slow") ? atol(argv[4]) : 0);
    } else if (strcmp(mode, "idle") && strcmp(mode, "beacon")) {
        printf("WORKLOAD-ERROR usage: workload pagecache DIR | anon MIB | dirty DIR MIB | "
               "words MIB [ROUNDS] [PAGES] | check MIB | pages MIB [ROUNDS] [PERMILLE] | freed MIB | "
               "fillall [MARGIN] | liar MIB [garbage | slow MS] | idle | beacon\n");
        return 2;
    }
    printf("WORKLOAD-DONE %s %016llx\n", mode, (unsigned long long)sum);
    heartbeat(mode, strcmp(mode, "beacon") ? HB_MS : BEACON_MS);
    return 0;
}
