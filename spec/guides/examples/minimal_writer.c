/*
 * minimal_writer: a lean image writer in C, in one sequential pass (spec/format.md v1.0).
 *
 *     minimal_writer MEMORY.raw OUT.lean|- [FIRST+COUNT ...]
 *
 * Writes guest memory MEMORY.raw (a whole number of 4096-byte pages) as one region named
 * "ram" at guest-physical address 0: all-zero pages become ZERO, the pages of each
 * FIRST+COUNT range FREE (e.g. pages the guest's balloon holds), every other page STORED in
 * zstd frames. Never seeks in its output, so OUT may be a pipe (-: stdout); a file OUT
 * appears only when complete. spec/guides/writing-a-writer.md walks through it.
 *
 *     cc -O2 -o minimal_writer minimal_writer.c -lzstd -lxxhash
 *     (Debian: apt-get install gcc libzstd-dev libxxhash-dev)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#include <zstd.h>

enum { PAGE_SIZE = 4096, FRAME_PAGES = 512 };          /* 2 MiB of pages per frame (<= 16 MiB) */
enum { HEADER_LENGTH = 104, FOOTER_LENGTH = 48 };
enum { REGION_ID = 0, HAS_GPA = 1, ZSTD_LEVEL = 3 };
enum { MAX_EXTENTS = 65536, MAX_DIGEST_PAGES = 65536 }; /* per PAGE_MAP / DIGESTS record (spec 9.2) */
enum { STORED = 1, ZERO = 2, FREE = 3 };                /* page classes (spec 6.1) */
enum { REGION = 0x1, PAGE_FRAME = 0x10, PAGE_MAP = 0x20, DIGESTS = 0x21, INDEX = 0xFF };
#define NO_KEY 0xFFFFFFFFu

/* ---- little-endian fields, errors ---------------------------------------------------- */
static void put_u16(uint8_t *p, uint16_t v) { for (int i = 0; i < 2; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void put_u32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void put_u64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static size_t align8(size_t n) { return (n + 7) & ~(size_t)7; }

static const char *temp_path;                           /* removed when we fail */

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("minimal_writer: error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    if (temp_path)
        remove(temp_path);
    exit(1);
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size);
    if (!p)
        die("out of memory");
    return p;
}

/* A digest is the xxh3-128 in canonical (big-endian) form (spec: Notation). */
static void digest_of(const void *data, size_t len, uint8_t out[16])
{
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits(data, len));
    memcpy(out, canonical.digest, 16);
}

/* ---- the output: every byte hashed for the footer's image_digest, every record indexed -- */
struct index_entry { uint64_t offset, first, count; uint32_t type, key; };

struct output {
    FILE *file;
    uint64_t offset;                /* bytes written so far */
    XXH3_state_t *image_hash;       /* xxh3-128 of everything before the footer (spec 8.3) */
    struct index_entry *index;
    size_t num_index, cap_index;
};

static void emit(struct output *o, const void *data, size_t len)
{
    if (fwrite(data, 1, len, o->file) != len)
        die("write failed: %s", strerror(errno));
    XXH3_128bits_update(o->image_hash, data, len);
    o->offset += len;
}

/* One record (spec 4.1): 16-byte head, body, zero padding to 8, xxh3-64 of all that.
 * key, first and count are what the INDEX lists for it (spec 8.1). */
static void write_record(struct output *o, uint32_t type, const uint8_t *body, size_t body_len,
                         uint32_t key, uint64_t first, uint64_t count)
{
    size_t covered = 16 + align8(body_len);
    uint8_t *record = xcalloc(covered + 8, 1);          /* calloc: flags and padding are zero */
    put_u32(record, type);
    put_u64(record + 8, body_len);
    memcpy(record + 16, body, body_len);
    put_u64(record + covered, XXH3_64bits(record, covered));
    if (type != INDEX) {                                /* the INDEX lists every record but itself */
        if (o->num_index == o->cap_index) {
            o->cap_index = o->cap_index ? 2 * o->cap_index : 64;
            o->index = realloc(o->index, o->cap_index * sizeof *o->index);
            if (!o->index)
                die("out of memory");
        }
        o->index[o->num_index++] = (struct index_entry){o->offset, first, count, type, key};
    }
    emit(o, record, covered + 8);
    free(record);
}

/* ---- header, region ------------------------------------------------------------------- */
static void write_header(struct output *o)
{
    uint8_t h[HEADER_LENGTH] = {0};                     /* no parent, no features: zeros */
    memcpy(h, "\x89LEANIMG", 8);
    put_u16(h + 8, 1);                                  /* major_version */
    put_u16(h + 10, 0);                                 /* minor_version */
    put_u32(h + 12, HEADER_LENGTH);
    FILE *random = fopen("/dev/urandom", "rb");         /* image_uuid: a random (v4) UUID */
    if (!random || fread(h + 40, 1, 16, random) != 16)
        die("cannot read /dev/urandom for the image UUID");
    fclose(random);
    h[40 + 6] = (h[40 + 6] & 0x0F) | 0x40;
    h[40 + 8] = (h[40 + 8] & 0x3F) | 0x80;
    put_u32(h + 88, PAGE_SIZE);
    put_u64(h + 96, XXH3_64bits(h, HEADER_LENGTH));     /* computed with the checksum field zero */
    emit(o, h, HEADER_LENGTH);
}

static void write_region(struct output *o, const char *name, uint64_t size_bytes)
{
    size_t name_len = strlen(name);
    uint8_t body[32 + 255] = {0};
    put_u32(body, REGION_ID);
    put_u32(body + 4, HAS_GPA);
    put_u64(body + 8, 0);                               /* guest_phys_base */
    put_u64(body + 16, size_bytes);
    put_u32(body + 24, (uint32_t)name_len);
    memcpy(body + 32, name, name_len);
    write_record(o, REGION, body, 32 + name_len, REGION_ID, 0, size_bytes / PAGE_SIZE);
}

/* ---- stored pages: a frame of up to FRAME_PAGES pages, one zstd frame each (spec 6.3) ---- */
struct frame {
    uint8_t *pages;
    uint32_t fill;
    uint64_t first_ordinal;
    ZSTD_CCtx *zstd;
};

static void flush_frame(struct output *o, struct frame *f)
{
    if (!f->fill)
        return;
    size_t raw_len = (size_t)f->fill * PAGE_SIZE;
    size_t bound = ZSTD_compressBound(raw_len);
    uint8_t *body = xcalloc(16 + bound, 1);
    /* Frame_Content_Size must be declared (LI-FRM-003): ZSTD_compress2 writes it when on */
    size_t n = ZSTD_compress2(f->zstd, body + 16, bound, f->pages, raw_len);
    if (ZSTD_isError(n))
        die("zstd: %s", ZSTD_getErrorName(n));
    put_u64(body, f->first_ordinal);
    put_u32(body + 8, f->fill);
    write_record(o, PAGE_FRAME, body, 16 + n, NO_KEY, f->first_ordinal, f->fill);
    free(body);
    f->first_ordinal += f->fill;
    f->fill = 0;
}

/* ---- the maps written at the end: PAGE_MAP extents, DIGESTS (spec 6.2, 6.5) ------------ */
struct page_info { uint8_t page_class; uint64_t slot; uint8_t digest[16]; };  /* ~25 bytes a page */

static void write_page_map(struct output *o, const struct page_info *pages, uint64_t num_pages)
{
    uint8_t *body = xcalloc(8 + 24 * (size_t)MAX_EXTENTS, 1);
    uint64_t page = 0;
    while (page < num_pages) {                          /* one record per MAX_EXTENTS extents */
        uint32_t extents = 0;
        uint64_t record_first = page;
        while (page < num_pages && extents < MAX_EXTENTS) {
            /* an extent: a run of one class whose slots (for STORED) count up by one */
            uint64_t start = page;
            uint8_t cls = pages[page].page_class;
            while (++page < num_pages && pages[page].page_class == cls
                   && (cls != STORED || pages[page].slot == pages[page - 1].slot + 1)
                   && page - start < UINT32_MAX)
                ;
            uint8_t *e = body + 8 + 24 * (size_t)extents++;
            memset(e, 0, 24);
            put_u64(e, start);
            put_u32(e + 8, (uint32_t)(page - start));
            put_u16(e + 12, cls);
            put_u64(e + 16, cls == STORED ? pages[start].slot : 0);   /* 0 for ZERO, FREE (LI-MAP-003) */
        }
        put_u32(body, REGION_ID);
        put_u32(body + 4, extents);
        write_record(o, PAGE_MAP, body, 8 + 24 * (size_t)extents, REGION_ID, record_first, page - record_first);
    }
    free(body);
}

static void write_digests(struct output *o, const struct page_info *pages, uint64_t num_pages)
{
    uint8_t *body = xcalloc(24 + 16 * (size_t)MAX_DIGEST_PAGES, 1);
    for (uint64_t first = 0; first < num_pages; first += MAX_DIGEST_PAGES) {
        uint64_t count = num_pages - first < MAX_DIGEST_PAGES ? num_pages - first : MAX_DIGEST_PAGES;
        uint32_t n = 0;                                 /* only STORED pages bear digests here */
        for (uint64_t p = first; p < first + count; p++)
            if (pages[p].page_class == STORED)
                memcpy(body + 24 + 16 * (size_t)n++, pages[p].digest, 16);
        put_u32(body, REGION_ID);
        put_u32(body + 4, n);                           /* num_digests (LI-DIG-003) */
        put_u64(body + 8, first);
        put_u64(body + 16, count);
        write_record(o, DIGESTS, body, 24 + 16 * (size_t)n, REGION_ID, first, count);
    }
    free(body);
}

/* ---- INDEX and footer (spec 8.1, 8.2) ----------------------------------------------------- */
static void write_index_and_footer(struct output *o)
{
    uint64_t index_offset = o->offset;
    uint8_t *body = xcalloc(8 + 32 * o->num_index, 1);
    put_u32(body, (uint32_t)o->num_index);
    for (size_t i = 0; i < o->num_index; i++) {
        uint8_t *e = body + 8 + 32 * i;
        put_u64(e, o->index[i].offset);
        put_u32(e + 8, o->index[i].type);
        put_u32(e + 12, o->index[i].key);
        put_u64(e + 16, o->index[i].first);
        put_u64(e + 24, o->index[i].count);
    }
    write_record(o, INDEX, body, 8 + 32 * o->num_index, 0, 0, 0);
    free(body);

    uint8_t footer[FOOTER_LENGTH] = {0};
    memcpy(footer, "\x89LEANEND", 8);
    put_u64(footer + 8, index_offset);
    put_u64(footer + 16, o->offset + FOOTER_LENGTH);    /* file_length */
    XXH128_canonical_t digest;                          /* image_digest: every byte before the footer */
    XXH128_canonicalFromHash(&digest, XXH3_128bits_digest(o->image_hash));
    memcpy(footer + 24, digest.digest, 16);
    put_u64(footer + 40, XXH3_64bits(footer, 40));
    if (fwrite(footer, 1, FOOTER_LENGTH, o->file) != FOOTER_LENGTH)
        die("write failed: %s", strerror(errno));
}

/* ---- main: one pass over the memory, then the maps, the index and the footer ------------- */
static int is_free(uint64_t page, char **ranges, int num_ranges)
{
    for (int i = 0; i < num_ranges; i++) {
        char *plus;
        uint64_t first = strtoull(ranges[i], &plus, 10), count = strtoull(plus + 1, NULL, 10);
        if (page >= first && page - first < count)
            return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: minimal_writer MEMORY.raw OUT.lean|- [FIRST+COUNT ...]\n");
        return 2;
    }
    for (int i = 3; i < argc; i++)
        if (!strchr(argv[i], '+'))
            die("free range %s: expected FIRST+COUNT", argv[i]);
    FILE *memory = fopen(argv[1], "rb");
    if (!memory || fseek(memory, 0, SEEK_END) != 0)
        die("cannot open %s: %s", argv[1], strerror(errno));
    long size = ftell(memory);
    rewind(memory);
    if (size <= 0 || size % PAGE_SIZE)
        die("%s: %ld bytes is not a non-zero multiple of %d", argv[1], size, PAGE_SIZE);
    uint64_t num_pages = (uint64_t)size / PAGE_SIZE;

    char temp[4096] = "";
    struct output o = {.image_hash = XXH3_createState()};
    if (strcmp(argv[2], "-") == 0) {
        o.file = stdout;
    } else {
        snprintf(temp, sizeof temp, "%s.partial", argv[2]);
        temp_path = temp;
        o.file = fopen(temp, "wb");
    }
    if (!o.file || !o.image_hash)
        die("cannot write %s: %s", argv[2], strerror(errno));
    XXH3_128bits_reset(o.image_hash);

    struct frame f = {.pages = xcalloc(FRAME_PAGES, PAGE_SIZE), .zstd = ZSTD_createCCtx()};
    ZSTD_CCtx_setParameter(f.zstd, ZSTD_c_compressionLevel, ZSTD_LEVEL);
    ZSTD_CCtx_setParameter(f.zstd, ZSTD_c_contentSizeFlag, 1);
    struct page_info *pages = xcalloc(num_pages, sizeof *pages);
    static const uint8_t zero_page[PAGE_SIZE];
    uint64_t next_ordinal = 0;

    write_header(&o);
    write_region(&o, "ram", num_pages * PAGE_SIZE);
    for (uint64_t p = 0; p < num_pages; p++) {
        uint8_t *page = f.pages + (size_t)f.fill * PAGE_SIZE;   /* read straight into the frame */
        if (fread(page, 1, PAGE_SIZE, memory) != PAGE_SIZE)
            die("%s: short read at page %llu", argv[1], (unsigned long long)p);
        if (is_free(p, argv + 3, argc - 3)) {
            pages[p].page_class = FREE;
        } else if (memcmp(page, zero_page, PAGE_SIZE) == 0) {
            pages[p].page_class = ZERO;                 /* its digest is implied: nothing kept */
        } else {
            pages[p].page_class = STORED;
            pages[p].slot = next_ordinal++;             /* ordinals in page order: one extent per run */
            digest_of(page, PAGE_SIZE, pages[p].digest);
            if (++f.fill == FRAME_PAGES)
                flush_frame(&o, &f);
        }
    }
    flush_frame(&o, &f);
    write_page_map(&o, pages, num_pages);
    write_digests(&o, pages, num_pages);
    write_index_and_footer(&o);

    if (fflush(o.file) != 0 || (o.file != stdout && fclose(o.file) != 0))
        die("write failed: %s", strerror(errno));
    if (temp_path && rename(temp, argv[2]) != 0)
        die("cannot rename %s to %s: %s", temp, argv[2], strerror(errno));
    fclose(memory);
    return 0;
}
