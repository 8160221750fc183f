/*
 * Test-guest workload, linked statically and run from the busybox initramfs.
 *
 *   workload pagecache DIR      read every regular file under DIR (page cache)
 *   workload anon MIB           fill MIB MiB of anonymous memory with random data
 *   workload dirty DIR MIB      write MIB MiB of random data to DIR/dirty.bin, no sync
 *   workload idle               nothing
 *
 * After the work it prints "WORKLOAD-DONE <mode> <checksum>" and then a heartbeat
 * "HB <mode> <n>" every HB_MS milliseconds forever, so a test can see that a guest
 * restored from a save keeps running.
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define HB_MS 500

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

static void heartbeat(const char *mode)
{
    struct timespec ts = { HB_MS / 1000, (HB_MS % 1000) * 1000000L };

    for (unsigned long n = 0;; n++) {
        printf("HB %s %lu\n", mode, n);
        fflush(stdout);
        nanosleep(&ts, NULL);
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
    else if (!strcmp(mode, "dirty") && argc > 3)
        sum = write_dirty(argv[2], atol(argv[3]));
    else if (strcmp(mode, "idle")) {
        printf("WORKLOAD-ERROR usage: workload pagecache DIR | anon MIB | dirty DIR MIB | idle\n");
        return 2;
    }
    printf("WORKLOAD-DONE %s %016llx\n", mode, (unsigned long long)sum);
    heartbeat(mode);
    return 0;
}
