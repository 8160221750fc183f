/* leanimg._native: the loops of a restore that numpy and the xxhash module can only do with
 * the GIL held for most of their time, or in many passes, done in C with the GIL released:
 *  - digest_rows: the page digests of spec §6.5 (xxh3-128 of each page, canonical byte order)
 *    of many pages in one call; the xxhash module takes one call per page under the GIL;
 *  - index_list_heads / index_list_words: the plain INDEX_LIST entries of a decompressed
 *    DELTA_FRAME (spec §7.3) parsed in one pass; numpy needs a dozen passes and gathers;
 *  - copy_rows: pages copied from a decompressed frame into a chain's range buffer, one
 *    copy each (numpy's fancy assignment gathers into a temporary first);
 *  - read_delta_frames: a batch of DELTA_FRAME records (one per link of a deep chain) read,
 *    tested and decompressed in one call, so a read-ahead worker does not take the GIL
 *    from the caller record after record;
 *  - page_map_extents, extents_hold: tables_batch's page-map rules of many links' extents
 *    in one pass each (the rules of each extent alone; those across a link's extents);
 *  - own_extents: the links' own (non-PARENT) extents laid end to end, field by field, for
 *    the fold (numpy concatenates each field of every link and filters them);
 *  - fold_own_pages: chain.resolve's fold of a chain's own pages (the nearest link holding
 *    each page's base and digest, the deltas above the base, by page, deepest link first) in
 *    one pass over the extents; numpy expands them page by page and sorts the deltas;
 *  - fold_words: a batch of DELTA_FRAMEs' words folded into the nearest link's value of each
 *    word, by page and word (a radix sort by page; numpy sorts every word and gathers);
 *  - span_checksums: the checksums of a batch of links' headers, footers and records, one call;
 *  - qemu_run_length: how far a run of QEMU RAM entries at consecutive offsets goes, in one
 *    pass (convert: a real save's runs are short, and numpy pays a dozen calls per run);
 *  - scan_files: the *.lean files beside an image opened, handed to the kernel's read-ahead
 *    and their headers read, on a thread of their own, while the chain's walk checks the
 *    links found so far (in Python, each file costs the walk's thread four system calls).
 * Optional: leanimg works the same without it (setup.py builds it where gcc, Python's headers,
 * xxhash.h and libzstd are found; format.py, delta.py, tables_batch.py and chain/ fall back
 * to the xxhash and zstandard modules and numpy, and tests/test_native.py and
 * tests/test_chain_fold.py check both give the same). xxhash.h is Debian's libxxhash-dev,
 * used header-only; libzstd is libzstd-dev. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>
#include <zstd.h>

/* PyBuffer_Release of each view given, up to the NULL that ends the list (what a function
 * that took buffers does at ``done:``). */
static void release_views(Py_buffer *view, ...)
{
    va_list more;
    va_start(more, view);
    for (; view != NULL; view = va_arg(more, Py_buffer *))
        PyBuffer_Release(view);
    va_end(more);
}

/* digest_rows(data, page_size, rows, out): for each int64 k of ``rows``, the digest of page
 * k of ``data`` (pages of page_size bytes laid end to end) into 16 bytes of ``out``, in order.
 * ValueError (nothing written) when a row is outside data or out is too small. */
static PyObject *digest_rows(PyObject *self, PyObject *args)
{
    Py_buffer data, rows, out;
    Py_ssize_t page_size;
    if (!PyArg_ParseTuple(args, "y*ny*w*", &data, &page_size, &rows, &out))
        return NULL;
    PyObject *result = NULL;
    const int64_t *row = rows.buf;
    Py_ssize_t n = rows.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t pages = page_size > 0 ? data.len / page_size : 0;
    int bad = page_size <= 0 || rows.len % (Py_ssize_t)sizeof(int64_t) || out.len < n * 16;
    for (Py_ssize_t i = 0; !bad && i < n; i++)
        bad = row[i] < 0 || row[i] >= pages;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "digest_rows: a row outside the pages, or out too small");
        goto done;
    }
    const unsigned char *base = data.buf;
    XXH128_canonical_t *digest = out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        XXH128_canonicalFromHash(&digest[i], XXH3_128bits(base + row[i] * page_size, (size_t)page_size));
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release_views(&data, &rows, &out, NULL);
    return result;
}

/* Little-endian loads: the format is little-endian whatever the host. */
static inline uint64_t load_le16(const unsigned char *p) { return (uint64_t)p[0] | (uint64_t)p[1] << 8; }

static inline uint64_t load_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--)
        v = v << 8 | p[k];
    return v;
}

#define ENTRY_HEAD 4            /* encoding u1, reserved u1, num_words u2 (spec §7.2) */
#define INDEX_LIST 1
#define WORD_SIZE 8

/* The entries [offsets[e], offsets[e+1]) of ``content``, checked to lie inside it. */
static int entries_inside(const Py_buffer *content, const Py_buffer *offsets, Py_ssize_t *n)
{
    const int64_t *off = offsets->buf;
    *n = offsets->len / (Py_ssize_t)sizeof(int64_t) - 1;
    if (offsets->len % (Py_ssize_t)sizeof(int64_t) || *n < 0)
        return 0;
    for (Py_ssize_t e = 0; e < *n; e++)
        if (off[e] < 0 || off[e + 1] < off[e] || off[e + 1] > content->len)
            return 0;
    return 1;
}

/* index_list_heads(content, offsets, page_size, simple, word_start, num_words) -> words:
 * per entry of a decompressed DELTA_FRAME, whether its head and length are those of a plain
 * INDEX_LIST entry (spec §7.3: encoding 1, reserved 0, 0 < num_words, length 4 + 10 x
 * num_words, shorter than a page), where its words start among the plain entries' words laid
 * end to end, and its num_words (0 for an entry shorter than its head); the words in all. */
static PyObject *index_list_heads(PyObject *self, PyObject *args)
{
    Py_buffer content, offsets, simple, word_start, num_words;
    Py_ssize_t page_size, n;
    if (!PyArg_ParseTuple(args, "y*y*nw*w*w*", &content, &offsets, &page_size, &simple, &word_start, &num_words))
        return NULL;
    PyObject *result = NULL;
    if (!entries_inside(&content, &offsets, &n) || simple.len < n || word_start.len < n * 8 || num_words.len < n * 8) {
        PyErr_SetString(PyExc_ValueError, "index_list_heads: entries outside the content, or outputs too small");
        goto done;
    }
    const unsigned char *c = content.buf;
    const int64_t *off = offsets.buf;
    unsigned char *plain = simple.buf;
    int64_t *start_of = word_start.buf, *words_of = num_words.buf, total = 0;
    for (Py_ssize_t e = 0; e < n; e++) {
        int64_t at = off[e], length = off[e + 1] - off[e];
        int64_t words = length >= ENTRY_HEAD ? (int64_t)load_le16(c + at + 2) : 0;
        plain[e] = length >= ENTRY_HEAD && c[at] == INDEX_LIST && c[at + 1] == 0 && words > 0 &&
                   length == ENTRY_HEAD + 10 * words && length < page_size;
        start_of[e] = total;
        words_of[e] = words;
        total += plain[e] ? words : 0;
    }
    result = PyLong_FromLongLong(total);
done:
    release_views(&content, &offsets, &simple, &word_start, &num_words, NULL);
    return result;
}

/* index_list_words(content, offsets, page_size, simple, word_start, positions, values): the
 * words of the entries index_list_heads found plain, at their word_start in ``positions``
 * (int64) and ``values`` (uint64); an entry with a word position past the page, or not above
 * the one before it, is no longer plain (its words stay written). The GIL is released. */
static PyObject *index_list_words(PyObject *self, PyObject *args)
{
    Py_buffer content, offsets, simple, word_start, positions, values;
    Py_ssize_t page_size, n;
    if (!PyArg_ParseTuple(args, "y*y*nw*y*w*w*", &content, &offsets, &page_size, &simple, &word_start,
                          &positions, &values))
        return NULL;
    PyObject *result = NULL;
    const int64_t *off = offsets.buf, *start_of = word_start.buf;
    Py_ssize_t capacity = positions.len / 8 < values.len / 8 ? positions.len / 8 : values.len / 8;
    int inside = entries_inside(&content, &offsets, &n) && simple.len >= n && word_start.len >= n * 8;
    unsigned char *plain = simple.buf;
    for (Py_ssize_t e = 0; inside && e < n; e++)
        inside = !plain[e] || (start_of[e] >= 0 && start_of[e] + (off[e + 1] - off[e] - ENTRY_HEAD) / 10 <= capacity);
    if (!inside) {
        PyErr_SetString(PyExc_ValueError, "index_list_words: entries outside the content, or outputs too small");
        goto done;
    }
    const unsigned char *c = content.buf;
    int64_t *position = positions.buf, words_per_page = page_size / WORD_SIZE;
    uint64_t *value = values.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t e = 0; e < n; e++) {
        if (!plain[e])
            continue;
        int64_t words = (off[e + 1] - off[e] - ENTRY_HEAD) / 10, first = start_of[e];
        const unsigned char *at = c + off[e] + ENTRY_HEAD, *val = at + 2 * words;
        int ok = 1;
        for (int64_t j = 0; j < words; j++) {
            int64_t word = (int64_t)load_le16(at + 2 * j);
            ok &= word < words_per_page && (j == 0 || word > position[first + j - 1]);
            position[first + j] = word;
            value[first + j] = load_le64(val + 8 * j);
        }
        plain[e] = ok;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release_views(&content, &offsets, &simple, &word_start, &positions, &values, NULL);
    return result;
}


#define RECORD_HEAD 16          /* record_type u4, flags u4, body_length u8 (spec §5.2) */
#define RECORD_TRAILER 8        /* record_checksum u8: xxh3-64 of the record before it */
#define DELTA_FRAME_TYPE 0x11
#define DELTA_HEAD 16           /* first_delta u8, num_deltas u4, reserved u4 (spec §7.1) */
#define FRAME_PAGES_MAX_BYTES ((int64_t)16 << 20)

static inline uint64_t load_le32(const unsigned char *p)
{
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24;
}

static int all_zero(const unsigned char *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

/* The DELTA_FRAME record ``r`` (``length`` bytes, up to the next record) tested as
 * chain.deltas._quick_delta_frame tests it, its INDEX entry listing ``first`` and ``num``: framing,
 * checksum, flags and padding, body length, reserved field, entry offsets, size, one whole
 * zstd frame declaring that size. Its decompressed size (>0), with where its zstd frame lies;
 * -1 when any test fails (the checked path then reads it and raises its finding). */
static int64_t delta_record_holds(const unsigned char *r, int64_t length, int64_t first, int64_t num,
                                  int64_t *frame_at, int64_t *frame_length)
{
    if (length < RECORD_HEAD + DELTA_HEAD + 4 + RECORD_TRAILER || load_le32(r) != DELTA_FRAME_TYPE || load_le32(r + 4))
        return -1;
    uint64_t body = load_le64(r + 8);
    if (body > (uint64_t)(length - RECORD_HEAD - RECORD_TRAILER) ||
        RECORD_HEAD + ((body + 7) & ~(uint64_t)7) + RECORD_TRAILER != (uint64_t)length)
        return -1;
    int64_t n = (int64_t)load_le32(r + 24), body_end = RECORD_HEAD + (int64_t)body;
    if ((int64_t)load_le64(r + 16) != first || n != num || n < 1 || load_le32(r + 28))
        return -1;
    int64_t table_end = RECORD_HEAD + DELTA_HEAD + 4 * (n + 1);
    int64_t start = RECORD_HEAD + ((DELTA_HEAD + 4 * (n + 1) + 7) & ~(int64_t)7);
    if (start > body_end || !all_zero(r + body_end, length - RECORD_TRAILER - body_end) ||
        !all_zero(r + table_end, start - table_end) ||
        XXH3_64bits(r, (size_t)(length - RECORD_TRAILER)) != load_le64(r + length - RECORD_TRAILER))
        return -1;
    const unsigned char *table = r + RECORD_HEAD + DELTA_HEAD;
    if (load_le32(table))
        return -1;
    for (int64_t i = 1; i <= n; i++)
        if (load_le32(table + 4 * i) < load_le32(table + 4 * (i - 1)))
            return -1;
    int64_t size = (int64_t)load_le32(table + 4 * n);
    size_t src_length = (size_t)(body_end - start);
    const unsigned char *src = r + start;
    if (size < 1 || size > FRAME_PAGES_MAX_BYTES || src_length < 4 || load_le32(src) != ZSTD_MAGICNUMBER ||
        ZSTD_getFrameContentSize(src, src_length) != (unsigned long long)size ||
        ZSTD_findFrameCompressedSize(src, src_length) != src_length)
        return -1;
    *frame_at = start;
    *frame_length = (int64_t)src_length;
    return size;
}

/* Every byte of [offset, offset + length) of fd into out; 0 when the file is shorter or unreadable. */
static int read_fully(int fd, unsigned char *out, int64_t length, int64_t offset)
{
    while (length > 0) {
        ssize_t got = pread(fd, out, (size_t)length, (off_t)offset);
        if (got <= 0)
            return 0;
        out += got;
        length -= got;
        offset += got;
    }
    return 1;
}

struct batch {
    Py_ssize_t n;
    const int32_t *fd;
    const int64_t *offset, *length, *first, *num;
    unsigned char *raw;
    int64_t *size, *frame_at, *frame_length;
};

/* Each record read and tested; 0 when one cannot be (or its content would pass ``most``). */
static int batch_read(struct batch *b, int64_t most)
{
    int64_t at = 0, total = 0;
    for (Py_ssize_t k = 0; k < b->n; k++) {
        if (!read_fully(b->fd[k], b->raw + at, b->length[k], b->offset[k]))
            return 0;
        b->size[k] = delta_record_holds(b->raw + at, b->length[k], b->first[k], b->num[k], &b->frame_at[k],
                                        &b->frame_length[k]);
        if (b->size[k] < 0 || (total += b->size[k]) > most)
            return 0;
        b->frame_at[k] += at;
        at += b->length[k];
    }
    return 1;
}

/* Each record's frame decompressed into content (laid end to end) and its entry offsets, made
 * offsets into content, into offsets (sum of num, plus the end); 0 when a frame fails. */
static int batch_decompress(struct batch *b, unsigned char *content, int64_t *offsets)
{
    ZSTD_DCtx *dctx = ZSTD_createDCtx();
    int ok = dctx != NULL;
    int64_t at = 0, entry = 0, record = 0;
    for (Py_ssize_t k = 0; ok && k < b->n; k++) {
        size_t got = ZSTD_decompressDCtx(dctx, content + at, (size_t)b->size[k], b->raw + b->frame_at[k],
                                         (size_t)b->frame_length[k]);
        ok = !ZSTD_isError(got) && got == (size_t)b->size[k];
        const unsigned char *table = b->raw + record + RECORD_HEAD + DELTA_HEAD;
        for (int64_t i = 0; ok && i < b->num[k]; i++)
            offsets[entry++] = at + (int64_t)load_le32(table + 4 * i);
        at += b->size[k];
        record += b->length[k];
    }
    offsets[entry] = at;
    ZSTD_freeDCtx(dctx);
    return ok;
}

/* read_delta_frames(fds, offsets, lengths, firsts, nums, most) -> (content, entry offsets) or
 * None: DELTA_FRAME records (record k: ``lengths[k]`` bytes at ``offsets[k]`` of ``fds[k]``
 * (i4), up to the next record; its INDEX entry lists firsts[k] and nums[k], i8) read, tested as
 * chain.deltas._quick_delta_frame tests one, and decompressed, all with the GIL released: their
 * contents laid end to end (bytes, at most ``most`` of them) and their entries' offsets into
 * it (i8 bytes: sum(nums) + 1). None when any record fails a test, or is not read whole: the
 * caller then reads them one by one on the checked path. */
static PyObject *read_delta_frames(PyObject *self, PyObject *args)
{
    Py_buffer in[5];
    long long most;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*L", &in[0], &in[1], &in[2], &in[3], &in[4], &most))
        return NULL;
    PyObject *result = NULL, *content = NULL, *offsets = NULL;
    struct batch b = {in[0].len / 4, in[0].buf, in[1].buf, in[2].buf, in[3].buf, in[4].buf, NULL, NULL, NULL, NULL};
    int64_t raw_total = 0, entries = 0, content_total = 0;
    int bad = in[0].len % 4 || b.n < 1;
    for (int i = 1; i < 5; i++)
        bad |= in[i].len != b.n * 8;
    for (Py_ssize_t k = 0; !bad && k < b.n; k++) {
        bad = b.length[k] < 0 || b.offset[k] < 0 || b.num[k] < 0 || b.num[k] > UINT32_MAX;
        raw_total += b.length[k];
        entries += b.num[k];
        bad |= raw_total > PY_SSIZE_T_MAX / 2;
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "read_delta_frames: arrays of unequal lengths, or a bad length or count");
        goto done;
    }
    b.raw = malloc(raw_total > 0 ? (size_t)raw_total : 1);
    int64_t *scratch = malloc((size_t)b.n * 3 * sizeof(int64_t));
    b.size = scratch;
    if (!b.raw || !scratch) {
        free(b.raw);
        free(scratch);
        PyErr_NoMemory();
        goto done;
    }
    b.frame_at = scratch + b.n;
    b.frame_length = scratch + 2 * b.n;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = batch_read(&b, most);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t k = 0; ok && k < b.n; k++)
        content_total += b.size[k];
    if (ok) {
        content = PyBytes_FromStringAndSize(NULL, content_total);
        offsets = PyBytes_FromStringAndSize(NULL, (entries + 1) * 8);
        if (content && offsets) {
            unsigned char *c = (unsigned char *)PyBytes_AS_STRING(content);
            int64_t *o = (int64_t *)PyBytes_AS_STRING(offsets);
            Py_BEGIN_ALLOW_THREADS
            ok = batch_decompress(&b, c, o);
            Py_END_ALLOW_THREADS
            result = ok ? PyTuple_Pack(2, content, offsets) : Py_NewRef(Py_None);
        }
    } else {
        result = Py_NewRef(Py_None);
    }
    free(b.raw);
    free(scratch);
    Py_XDECREF(content);
    Py_XDECREF(offsets);
done:
    for (int i = 0; i < 5; i++)
        PyBuffer_Release(&in[i]);
    return result;
}

/* copy_rows(src, src_rows, dst, dst_rows, row_size): row src_rows[k] of ``src`` (rows of
 * row_size bytes laid end to end) to row dst_rows[k] of ``dst``, for each k (int64 rows), the
 * GIL released: one copy per row, where numpy's dst[rows] = src[rows] gathers into a
 * temporary and copies again. ValueError (nothing written) when a row is outside its buffer. */
static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    Py_buffer src, src_rows, dst, dst_rows;
    Py_ssize_t row_size;
    if (!PyArg_ParseTuple(args, "y*y*w*y*n", &src, &src_rows, &dst, &dst_rows, &row_size))
        return NULL;
    PyObject *result = NULL;
    const int64_t *from = src_rows.buf, *to = dst_rows.buf;
    Py_ssize_t n = src_rows.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t src_count = row_size > 0 ? src.len / row_size : 0, dst_count = row_size > 0 ? dst.len / row_size : 0;
    int bad = row_size <= 0 || src_rows.len % (Py_ssize_t)sizeof(int64_t) || dst_rows.len != src_rows.len;
    for (Py_ssize_t k = 0; !bad && k < n; k++)
        bad = from[k] < 0 || from[k] >= src_count || to[k] < 0 || to[k] >= dst_count;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: a row outside its buffer, or rows of unequal lengths");
        goto done;
    }
    const unsigned char *in = src.buf;
    unsigned char *out = dst.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++)
        memcpy(out + to[k] * row_size, in + from[k] * row_size, (size_t)row_size);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release_views(&src, &src_rows, &dst, &dst_rows, NULL);
    return result;
}

/* One extent of a PAGE_MAP (spec §6.2), as laid out in the file. */
struct extent {
    uint64_t first_page;
    uint32_t num_pages;
    uint16_t page_class, reserved;
    uint64_t first_slot;
};

/* Whether ``extents`` holds whole EXTENT records and ``lengths`` (i8, one per link) are
 * counts of them that add up to all: the page maps of many links laid end to end. */
static int lengths_add_up(const Py_buffer *extents, const Py_buffer *lengths)
{
    const int64_t *length = lengths->buf;
    Py_ssize_t m = extents->len / (Py_ssize_t)sizeof(struct extent), total = 0;
    if (extents->len % (Py_ssize_t)sizeof(struct extent) || lengths->len % 8)
        return 0;
    for (Py_ssize_t k = 0; k < lengths->len / 8; k++) {
        if (length[k] < 0 || length[k] > m - total)
            return 0;
        total += length[k];
    }
    return total == m;
}

/* page_map_extents(extents, lengths, is_page_class, has_slot, ok, pages, firsts): the page
 * maps of many links laid end to end (``lengths[k]`` EXTENT records of link k, i8), each
 * extent's own rules (spec §6.2: reserved zero, a page class, at least one page, first_slot
 * zero for a class without slots; is_page_class and has_slot: u1 tables of 65536) tested per
 * link into ok (u1 per link), with its pages in all (u8, wrapping) and its first extent's
 * first_page (u8; 0 without extents). ValueError (nothing written) when the lengths do not
 * add up to the extents or a table or an output is too small. */
static PyObject *page_map_extents(PyObject *self, PyObject *args)
{
    Py_buffer extents, lengths, is_page_class, has_slot, ok, pages, firsts;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*w*w*", &extents, &lengths, &is_page_class, &has_slot, &ok, &pages, &firsts))
        return NULL;
    PyObject *result = NULL;
    const struct extent *e = extents.buf;
    const int64_t *length = lengths.buf;
    const unsigned char *is_class = is_page_class.buf, *slotted = has_slot.buf;
    Py_ssize_t links = lengths.len / 8;
    if (!lengths_add_up(&extents, &lengths) || is_page_class.len < 65536 || has_slot.len < 65536 ||
        ok.len < links || pages.len < links * 8 || firsts.len < links * 8) {
        PyErr_SetString(PyExc_ValueError, "page_map_extents: lengths that do not add up to the extents, or a table "
                                          "or an output too small");
        goto done;
    }
    unsigned char *good = ok.buf;
    uint64_t *sum = pages.buf, *first = firsts.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < links; e += length[k], k++) {
        int holds = 1;
        uint64_t in_all = 0;
        for (int64_t i = 0; i < length[k]; i++) {
            uint16_t c = e[i].page_class;
            holds &= !e[i].reserved && is_class[c] && e[i].num_pages && (slotted[c] || !e[i].first_slot);
            in_all += e[i].num_pages;
        }
        good[k] = holds;
        sum[k] = in_all;
        first[k] = length[k] ? e[0].first_page : 0;
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release_views(&extents, &lengths, &is_page_class, &has_slot, &ok, &pages, &firsts, NULL);
    return result;
}

/* extents_hold(extents, lengths, pages, available, own, has_own_digest, has_digest, slot_classes,
 *              ok, present, bearing, rank0)
 * The page maps of many links laid end to end (``extents``: EXTENT records, ``lengths[k]``
 * of link k): per link whether its extents cover pages 0.. pages[k] contiguously
 * (LI-MAP-001) and, for each class c of ``slot_classes`` (i8), the slots its pages use
 * follow each other from 0 in extent order and number available[k, c] (LI-MAP-004, i8
 * per link and slot class); into ok (u1 per link). present (u8 per link): bit c for each
 * class c < 64 of its extents (a class past 63 fails the link). bearing (u1 per extent):
 * whether its pages bear a stored digest (has_own_digest[class] for a link that ``own``s
 * (u1 per link), else has_digest[class], tables of 65536 u1); rank0 (i8 per extent): the
 * digests before it in its link. Sums wrap as uint64, as numpy's int64 sums do. ValueError (nothing written) when
 * the lengths do not add up to the extents or a table or an output is too small. */
static PyObject *extents_hold(PyObject *self, PyObject *args)
{
    Py_buffer in[8], out[4];
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*w*w*w*w*", &in[0], &in[1], &in[2], &in[3], &in[4], &in[5],
                          &in[6], &in[7], &out[0], &out[1], &out[2], &out[3]))
        return NULL;
    PyObject *result = NULL;
    const struct extent *extent = in[0].buf;
    const int64_t *length = in[1].buf, *pages = in[2].buf, *available = in[3].buf, *slot_class = in[7].buf;
    const unsigned char *own = in[4].buf, *has_own_digest = in[5].buf, *has_digest = in[6].buf;
    unsigned char *ok = out[0].buf, *bearing = out[2].buf;
    uint64_t *present = out[1].buf;
    int64_t *rank0 = out[3].buf;
    Py_ssize_t m = in[0].len / (Py_ssize_t)sizeof(struct extent), links = in[1].len / 8, classes = in[7].len / 8;
    int bad = !lengths_add_up(&in[0], &in[1]) || in[2].len < links * 8 ||
              in[3].len < links * classes * 8 || in[4].len < links || in[5].len < 65536 || in[6].len < 65536 ||
              out[0].len < links || out[1].len < links * 8 || out[2].len < m || out[3].len < m * 8;
    int slot_index[64];                 /* class -> its place in slot_classes, or -1 */
    for (int c = 0; c < 64; c++)
        slot_index[c] = -1;
    bad |= classes > 64;
    for (Py_ssize_t c = 0; !bad && c < classes; c++) {
        bad = slot_class[c] < 0 || slot_class[c] >= 64;
        if (!bad)
            slot_index[slot_class[c]] = (int)c;
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "extents_hold: lengths that do not add up to the extents, or a table "
                                          "or an output too small");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const struct extent *e = extent;
    for (Py_ssize_t k = 0; k < links; e += length[k], k++) {
        uint64_t end = 0, digests = 0, used[64] = {0}, mask = 0;
        int good = length[k] > 0;
        const unsigned char *bears = own[k] ? has_own_digest : has_digest;
        for (int64_t i = 0; i < length[k]; i++) {
            uint16_t c = e[i].page_class;
            good &= e[i].first_page == end;
            end = e[i].first_page + e[i].num_pages;
            if (c >= 64)
                good = 0;                       /* no such class: the page-map pass refuses it */
            else {
                mask |= (uint64_t)1 << c;
                if (slot_index[c] >= 0) {
                    good &= e[i].first_slot == used[slot_index[c]];
                    used[slot_index[c]] += e[i].num_pages;
                }
            }
            bearing[e - extent + i] = bears[c];
            rank0[e - extent + i] = (int64_t)digests;
            digests += bears[c] ? e[i].num_pages : 0;
        }
        good &= end == (uint64_t)pages[k];
        for (Py_ssize_t c = 0; c < classes; c++)
            good &= used[c] == (uint64_t)available[k * classes + c];
        ok[k] = good;
        present[k] = mask;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (int k = 0; k < 8; k++)
        PyBuffer_Release(&in[k]);
    for (int k = 0; k < 4; k++)
        PyBuffer_Release(&out[k]);
    return result;
}

/* own_extents(extents, bearing, rank0, depths, limit, parent_class, start, count, cls, slot,
 *             bearing_out, rank0_out, depth_out) -> m
 * chain.resolution._own_extents in one pass: the extents of a region in each link (``extents[k]``: EXTENT
 * records, with ``bearing[k]`` (u1) and ``rank0[k]`` (i8) per extent; link depths[k], i4),
 * nearest link first, those of a class other than parent_class starting below ``limit``
 * laid end to end field by field into the outputs (i8 first page, i8 pages (cut at limit),
 * u1 class, i8 first slot, u1 bearing, i8 rank, i4 link); their number is returned.
 * ValueError (nothing written past the check) when the sequences differ in length, an item's
 * sizes do not match its extents', or an output is too small. */
static PyObject *own_extents(PyObject *self, PyObject *args)
{
    PyObject *lists[3], *fast[3] = {NULL, NULL, NULL};
    Py_buffer depths, out[7];
    long long limit;
    int parent_class;
    if (!PyArg_ParseTuple(args, "OOOy*Liw*w*w*w*w*w*w*", &lists[0], &lists[1], &lists[2], &depths, &limit,
                          &parent_class, &out[0], &out[1], &out[2], &out[3], &out[4], &out[5], &out[6]))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t links = depths.len / 4, m = 0, views_held = 0;
    Py_buffer *views = NULL;
    for (int i = 0; i < 3; i++)
        if (!(fast[i] = PySequence_Fast(lists[i], "own_extents: a sequence")))
            goto done;
    int bad = depths.len % 4 || limit < 0 || PySequence_Fast_GET_SIZE(fast[0]) != links ||
              PySequence_Fast_GET_SIZE(fast[1]) != links || PySequence_Fast_GET_SIZE(fast[2]) != links;
    if (!bad && !(views = PyMem_Calloc((size_t)(3 * links + 1), sizeof(Py_buffer)))) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t k = 0; !bad && k < links; k++) {
        for (int i = 0; i < 3; i++) {
            if (PyObject_GetBuffer(PySequence_Fast_ITEMS(fast[i])[k], &views[3 * k + i], PyBUF_C_CONTIGUOUS) < 0)
                goto done;
            views_held++;
        }
        Py_ssize_t n = views[3 * k].len / (Py_ssize_t)sizeof(struct extent);
        bad = views[3 * k].len % (Py_ssize_t)sizeof(struct extent) || views[3 * k + 1].len != n ||
              views[3 * k + 2].len != n * 8;
        total += n;
    }
    bad |= out[0].len < total * 8 || out[1].len < total * 8 || out[2].len < total || out[3].len < total * 8 ||
           out[4].len < total || out[5].len < total * 8 || out[6].len < total * 4;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "own_extents: sequences of unequal lengths, an item's sizes not its "
                                          "extents', or an output too small");
        goto done;
    }
    int64_t *start = out[0].buf, *count = out[1].buf, *slot = out[3].buf, *rank = out[5].buf;
    unsigned char *cls = out[2].buf, *bears = out[4].buf;
    int32_t *link = out[6].buf;
    const int32_t *depth = depths.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < links; k++) {
        const struct extent *e = views[3 * k].buf;
        const unsigned char *bearing = views[3 * k + 1].buf;
        const int64_t *rank0 = views[3 * k + 2].buf;
        Py_ssize_t n = views[3 * k].len / (Py_ssize_t)sizeof(struct extent);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (e[i].page_class == parent_class || e[i].first_page >= (uint64_t)limit)
                continue;
            uint64_t room = (uint64_t)limit - e[i].first_page;
            start[m] = (int64_t)e[i].first_page;
            count[m] = (int64_t)(e[i].num_pages < room ? e[i].num_pages : room);
            cls[m] = (unsigned char)e[i].page_class;
            slot[m] = (int64_t)e[i].first_slot;
            bears[m] = bearing[i];
            rank[m] = rank0[i];
            link[m] = depth[k];
            m++;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(m);
done:
    for (Py_ssize_t v = 0; v < views_held; v++)
        PyBuffer_Release(&views[v]);
    PyMem_Free(views);
    for (int i = 0; i < 3; i++)
        Py_XDECREF(fast[i]);
    PyBuffer_Release(&depths);
    for (int i = 0; i < 7; i++)
        PyBuffer_Release(&out[i]);
    return result;
}

/* fold_own_pages(starts, counts, classes, slots, bearing, rank0, depths, inherits, concrete,
 *                delta_class, base_link, base_class, base_slot, digest_link, digest_class, digest_rank,
 *                delta_pages, delta_links, delta_slots) -> deltas
 * The own (non-PARENT) extents of a chain's links, laid end to end nearest link first (per
 * extent: first page, pages, class (u1), first slot, whether its pages bear a stored digest (u1),
 * the rank of its first digest, its link (i4)), folded into the per-page arrays chain.resolution._Fold
 * holds, each page taking the nearest link offering it: base_* from links whose class is
 * ``concrete`` (u1 per class), digest_* (rank -1 where not bearing) from links that
 * ``inherits`` (u1 per link) -- a page's link is replaced only by a nearer one (i4 arrays,
 * CHAIN_DEPTH_MAX where none). The pages of class ``delta_class`` above their final base go
 * to delta_* (i8, i4, i8), by page, the deepest link first; their number is returned.
 * ValueError (nothing written) when an extent lies outside the pages or a class or link
 * outside its table, or an output is too small (delta_* need room for every DELTA page).
 * The GIL is released. */
static PyObject *fold_own_pages(PyObject *self, PyObject *args)
{
    Py_buffer in[9], out[9];
    int delta_class;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*y*iw*w*w*w*w*w*w*w*w*", &in[0], &in[1], &in[2], &in[3], &in[4],
                          &in[5], &in[6], &in[7], &in[8], &delta_class, &out[0], &out[1], &out[2], &out[3],
                          &out[4], &out[5], &out[6], &out[7], &out[8]))
        return NULL;
    PyObject *result = NULL;
    const int64_t *start = in[0].buf, *count = in[1].buf, *slot = in[3].buf, *rank0 = in[5].buf;
    const unsigned char *cls = in[2].buf, *bearing = in[4].buf, *inherits = in[7].buf, *concrete = in[8].buf;
    const int32_t *depth = in[6].buf;
    int32_t *base_link = out[0].buf, *digest_link = out[3].buf, *delta_link = out[7].buf;
    unsigned char *base_class = out[1].buf, *digest_class = out[4].buf;
    int64_t *base_slot = out[2].buf, *digest_rank = out[5].buf, *delta_page = out[6].buf, *delta_slot = out[8].buf;
    Py_ssize_t m = in[0].len / 8, n = out[0].len / 4, links = in[7].len, room = out[6].len / 8, deltas = 0;
    int bad = in[1].len < m * 8 || in[2].len < m || in[3].len < m * 8 || in[4].len < m || in[5].len < m * 8 ||
              in[6].len < m * 4 || delta_class < 0 || in[8].len <= delta_class || out[1].len < n ||
              out[2].len < n * 8 || out[3].len < n * 4 || out[4].len < n || out[5].len < n * 8 ||
              out[7].len < room * 4 || out[8].len < room * 8;
    for (Py_ssize_t e = 0; !bad && e < m; e++) {
        bad = start[e] < 0 || count[e] < 0 || start[e] > n - count[e] || cls[e] >= in[8].len ||
              depth[e] < 0 || depth[e] >= links;
        deltas += cls[e] == delta_class ? count[e] : 0;
    }
    int64_t *first_of = NULL;
    if (!bad && deltas > room)
        bad = 1;
    if (!bad && deltas && !(first_of = calloc((size_t)n + 1, sizeof(int64_t)))) {
        PyErr_NoMemory();
        goto done;
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "fold_own_pages: an extent outside the pages, a class or link outside "
                                          "its table, or an output too small");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t e = 0; e < m; e++) {
        int32_t d = depth[e];
        unsigned char c = cls[e];
        for (int64_t k = 0, p = start[e]; k < count[e]; k++, p++) {
            if (concrete[c] && d < base_link[p]) {
                base_link[p] = d;
                base_class[p] = c;
                base_slot[p] = slot[e] + k;
            }
            if (inherits[d] && d < digest_link[p]) {
                digest_link[p] = d;
                digest_class[p] = c;
                digest_rank[p] = bearing[e] ? rank0[e] + k : -1;
            }
        }
    }
    /* the DELTA pages above their page's final base: counted by page, then placed by page from
     * the deepest extent back (extents come nearest link first), so each page's deepest link
     * comes first; two more passes over the extents, no copy of the pages */
    if (deltas) {
        for (Py_ssize_t e = 0; e < m; e++)
            if (cls[e] == delta_class)
                for (int64_t p = start[e]; p < start[e] + count[e]; p++)
                    first_of[p + 1] += depth[e] < base_link[p];
        for (Py_ssize_t p = 0; p < n; p++)
            first_of[p + 1] += first_of[p];
        deltas = first_of[n];
        for (Py_ssize_t e = m - 1; e >= 0; e--)
            if (cls[e] == delta_class)
                for (int64_t k = count[e] - 1, p = start[e] + k; k >= 0; k--, p--)
                    if (depth[e] < base_link[p]) {
                        int64_t at = first_of[p]++;
                        delta_page[at] = p;
                        delta_link[at] = depth[e];
                        delta_slot[at] = slot[e] + k;
                    }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(deltas);
done:
    free(first_of);
    for (int k = 0; k < 9; k++) {
        PyBuffer_Release(&in[k]);
        PyBuffer_Release(&out[k]);
    }
    return result;
}

/* One kept word of a page while fold_words dedupes it: its index in the page, its value. */
struct word {
    int64_t at;
    uint64_t value;
};

static int word_before(const void *a, const void *b)
{
    int64_t x = ((const struct word *)a)->at, y = ((const struct word *)b)->at;
    return (x > y) - (x < y);
}

/* Sort n words by index (a page's few: insertion sort; many: qsort). */
static void sort_words(struct word *w, Py_ssize_t n)
{
    if (n > 32) {
        qsort(w, (size_t)n, sizeof(struct word), word_before);
        return;
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        struct word x = w[i];
        Py_ssize_t j = i;
        for (; j > 0 && w[j - 1].at > x.at; j--)
            w[j] = w[j - 1];
        w[j] = x;
    }
}

/* Stable LSD radix sort of ``n`` item ids ``ids`` by ``key[id]`` (0 <= key < limit), a byte a
 * pass (a batch's few thousand entries: 256 counts a pass cost less than 65536); ``tmp`` as
 * long as ids. The result is in ids. */
static void radix_by_key(int64_t *ids, int64_t *tmp, Py_ssize_t n, const int64_t *key, int64_t limit)
{
    int64_t counts[256 + 1];
    for (int shift = 0; shift < 64 && (limit - 1) >> shift; shift += 8) {
        memset(counts, 0, sizeof counts);
        for (Py_ssize_t i = 0; i < n; i++)
            counts[((key[ids[i]] >> shift) & 0xFF) + 1]++;
        for (int d = 0; d < 256; d++)
            counts[d + 1] += counts[d];
        for (Py_ssize_t i = 0; i < n; i++)
            tmp[counts[(key[ids[i]] >> shift) & 0xFF]++] = ids[i];
        memcpy(ids, tmp, (size_t)n * sizeof(int64_t));
    }
}

/* fold_words(simple, word_start, positions, values, entries, pages, words_per_page, page_limit,
 *            plain, flat, flat_values) -> count, or -1
 * chain.deltas._fold_delta_batch's fold, in one pass without the GIL. Entries (simple u1, word_start
 * i8: where each entry's words start in positions i8 / values u8, laid end to end) as
 * parse_index_lists gives them; rows (entries i8: each row's entry, pages i8: its page). Per
 * row, plain[row] = simple[entry]; a plain row's entry applies to its page (of two rows of one
 * entry, the later). Every word of an applying entry is page * words_per_page + its index;
 * of a word several entries set, the first entry's value is kept (entries come nearest link
 * first); the words go to flat / flat_values ascending, their number returned. -1 (the caller
 * folds with numpy) when an input is not as described: an entry or page out of range, word
 * starts not ascending, a word index outside its page. The GIL is released. */
static PyObject *fold_words(PyObject *self, PyObject *args)
{
    Py_buffer simple_b, start_b, pos_b, val_b, entries_b, pages_b, plain_b, flat_b, fval_b;
    int64_t wpp, page_limit;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*LLw*w*w*", &simple_b, &start_b, &pos_b, &val_b, &entries_b, &pages_b,
                          &wpp, &page_limit, &plain_b, &flat_b, &fval_b))
        return NULL;
    PyObject *result = NULL;
    const unsigned char *simple = simple_b.buf;
    const int64_t *word_start = start_b.buf, *positions = pos_b.buf, *entries = entries_b.buf, *pages = pages_b.buf;
    const uint64_t *values = val_b.buf;
    unsigned char *plain = plain_b.buf;
    int64_t *flat = flat_b.buf;
    uint64_t *flat_values = fval_b.buf;
    Py_ssize_t E = simple_b.len, W = pos_b.len / 8, R = entries_b.len / 8;
    int64_t count = -1;
    int bad = pos_b.len % 8 || entries_b.len % 8 || E >= (Py_ssize_t)UINT32_MAX ||   /* stamps: u4 a page */
              start_b.len != E * 8 || val_b.len != W * 8 || pages_b.len != R * 8 || plain_b.len != R ||
              flat_b.len < W * 8 || fval_b.len < W * 8 || wpp <= 0 || page_limit < 0 || page_limit > (1LL << 48) ||
              (page_limit > 0 && wpp > INT64_MAX / page_limit);
    int64_t *page_of = NULL, *ids = NULL, *tmp = NULL;
    uint32_t *seen = NULL;
    struct word *kept = NULL;
    if (!bad) {
        page_of = malloc(((size_t)E + 1) * sizeof(int64_t));
        ids = malloc(((size_t)E + 1) * sizeof(int64_t));
        tmp = malloc(((size_t)E + 1) * sizeof(int64_t));
        seen = calloc((size_t)wpp, sizeof(uint32_t));
        kept = malloc(((size_t)W + 1) * sizeof(struct word));
        if (!page_of || !ids || !tmp || !seen || !kept) {
            PyErr_NoMemory();
            goto done;
        }
    }
    if (bad)
        goto answer;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t e = 0; e < E; e++) {
        page_of[e] = -1;
        if (word_start[e] < (e ? word_start[e - 1] : 0) || word_start[e] > W)
            bad = 1;
    }
    for (Py_ssize_t r = 0; !bad && r < R; r++) {
        int64_t e = entries[r];
        bad = e < 0 || e >= E;
        if (!bad) {
            plain[r] = simple[e] != 0;
            if (plain[r]) {
                bad = pages[r] < 0 || pages[r] >= page_limit;
                page_of[e] = pages[r];
            }
        }
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t e = 0; !bad && e < E; e++)
        if (page_of[e] >= 0)
            ids[n++] = e;
    if (!bad)
        radix_by_key(ids, tmp, n, page_of, page_limit);
    int64_t out = 0;
    uint32_t stamp = 0;
    for (Py_ssize_t i = 0; !bad && i < n;) {
        int64_t page = page_of[ids[i]];
        Py_ssize_t many = 0;
        stamp++;
        for (; i < n && page_of[ids[i]] == page; i++) {
            int64_t e = ids[i], end = e + 1 < E ? word_start[e + 1] : W;
            for (int64_t w = word_start[e]; w < end; w++) {
                int64_t at = positions[w];
                if (at < 0 || at >= wpp) {
                    bad = 1;
                    break;
                }
                if (seen[at] != stamp) {
                    seen[at] = stamp;
                    kept[many].at = at;
                    kept[many++].value = values[w];
                }
            }
        }
        sort_words(kept, many);
        for (Py_ssize_t k = 0; k < many; k++) {
            flat[out] = page * wpp + kept[k].at;
            flat_values[out++] = kept[k].value;
        }
    }
    count = bad ? -1 : out;
    Py_END_ALLOW_THREADS
answer:
    result = PyLong_FromLongLong(count);
done:
    free(page_of);
    free(ids);
    free(tmp);
    free(seen);
    free(kept);
    release_views(&simple_b, &start_b, &pos_b, &val_b, &entries_b, &pages_b, &plain_b, &flat_b, &fval_b, NULL);
    return result;
}

/* span_checksums(buffers, offsets, lengths, out): out[k] (u8) = xxh3-64 (spec §3.6's checksum)
 * of bytes [offsets[k], offsets[k] + lengths[k]) of buffers[k] (a list of bytes-like objects;
 * offsets and lengths i8): the header, footer and record checksums of a batch of links in one
 * call, where Python takes a slice, a memoryview and a call per link. ValueError (nothing
 * written) when a span is outside its buffer or the lengths do not match. */
static PyObject *span_checksums(PyObject *self, PyObject *args)
{
    PyObject *buffers;
    Py_buffer offsets_b, lengths_b, out_b;
    if (!PyArg_ParseTuple(args, "O!y*y*w*", &PyList_Type, &buffers, &offsets_b, &lengths_b, &out_b))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = PyList_GET_SIZE(buffers);
    const int64_t *offsets = offsets_b.buf, *lengths = lengths_b.buf;
    uint64_t *out = out_b.buf;
    if (offsets_b.len != n * (Py_ssize_t)sizeof(int64_t) || lengths_b.len != offsets_b.len ||
        out_b.len != offsets_b.len) {
        PyErr_SetString(PyExc_ValueError, "span_checksums: offsets, lengths and out must have one i8 per buffer");
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PyList_GET_ITEM(buffers, k), &view, PyBUF_SIMPLE) < 0)
            goto done;
        int inside = offsets[k] >= 0 && lengths[k] >= 0 && offsets[k] <= view.len && lengths[k] <= view.len - offsets[k];
        if (inside)
            out[k] = XXH3_64bits((const unsigned char *)view.buf + offsets[k], (size_t)lengths[k]);
        PyBuffer_Release(&view);
        if (!inside) {
            PyErr_Format(PyExc_ValueError, "span_checksums: span %zd is outside its buffer", k);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    release_views(&offsets_b, &lengths_b, &out_b, NULL);
    return result;
}

/* scan_files(names, starts, small, budget, keep_most, group, fds, sizes, got, heads, progress):
 * the files ``names`` names (NUL-terminated, laid end to end, name k from starts[k], i8, n + 1
 * of them) read in order, ``group`` files at a time, the GIL released throughout. Each file of
 * a group is opened, and one of 1 .. small - 1 bytes that ``budget`` (bytes, spent in order)
 * still allows is handed whole to the kernel's read-ahead (WILLNEED), its size in sizes[k]
 * (else 0): a group's reads are queued together. Then, file by file, its first bytes are read
 * into row k of ``heads`` (rows of len(heads) / n bytes; got[k] how many, -1 when unreadable);
 * a file with a size is kept open, fds[k] (i4), while fewer than keep_most are, else closed
 * (-1; -2: it cannot be opened). progress[0] (i8) counts the files done, each one's outputs
 * written before it is counted: another thread reads them as they come. ValueError (nothing
 * done) when the buffers do not match. */
static PyObject *scan_files(PyObject *self, PyObject *args)
{
    Py_buffer names, starts_b, fds_b, sizes_b, got_b, heads_b, progress_b;
    long long small, budget, keep_most;
    Py_ssize_t group;
    if (!PyArg_ParseTuple(args, "y*y*LLLnw*w*w*w*w*", &names, &starts_b, &small, &budget, &keep_most, &group,
                          &fds_b, &sizes_b, &got_b, &heads_b, &progress_b))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = fds_b.len / (Py_ssize_t)sizeof(int32_t);
    const char *name = names.buf;
    const int64_t *starts = starts_b.buf;
    int bad = n < 1 || group < 1 || fds_b.len % (Py_ssize_t)sizeof(int32_t) ||
              starts_b.len != (n + 1) * (Py_ssize_t)sizeof(int64_t) || sizes_b.len != n * (Py_ssize_t)sizeof(int64_t) ||
              got_b.len != sizes_b.len || heads_b.len % n || progress_b.len < (Py_ssize_t)sizeof(int64_t) ||
              starts[0] != 0 || starts[n] != names.len;
    for (Py_ssize_t k = 0; !bad && k < n; k++)
        bad = starts[k + 1] <= starts[k] || starts[k + 1] > names.len || name[starts[k + 1] - 1] != 0;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "scan_files: buffers of unmatched lengths, or names not NUL-terminated");
        goto done;
    }
    int32_t *fds = fds_b.buf;
    int64_t *sizes = sizes_b.buf, *got = got_b.buf, *progress = progress_b.buf, kept = 0;
    size_t row = (size_t)(heads_b.len / n);
    unsigned char *heads = heads_b.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t lo = 0; lo < n; lo += group) {
        Py_ssize_t hi = lo + group < n ? lo + group : n;
        for (Py_ssize_t k = lo; k < hi; k++) {          /* the group opened, its small files asked for */
            int fd = open(name + starts[k], O_RDONLY | O_CLOEXEC);
            struct stat st;
            int64_t size = fd >= 0 && fstat(fd, &st) == 0 ? (int64_t)st.st_size : -1;
            fds[k] = fd >= 0 ? fd : -2;
            sizes[k] = 0;
            if (size > 0 && size < small && size <= budget) {
                budget -= size;
#ifdef POSIX_FADV_WILLNEED
                posix_fadvise(fd, 0, (off_t)size, POSIX_FADV_WILLNEED);     /* advice: its failure changes nothing */
#endif
                sizes[k] = size;
            }
        }
        for (Py_ssize_t k = lo; k < hi; k++) {          /* then read, file by file */
            int fd = fds[k];
            got[k] = -1;
            if (fd >= 0) {
                ssize_t r;
                do
                    r = pread(fd, heads + (size_t)k * row, row, 0);
                while (r < 0 && errno == EINTR);
                got[k] = r;
                if (r >= 0 && sizes[k] && kept < keep_most)
                    kept++;
                else {
                    close(fd);
                    fds[k] = -1;
                    sizes[k] = r >= 0 ? sizes[k] : 0;
                }
            }
            __atomic_store_n(progress, (int64_t)(k + 1), __ATOMIC_RELEASE);
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release_views(&names, &starts_b, &fds_b, &sizes_b, &got_b, &heads_b, &progress_b, NULL);
    return result;
}

/* qemu_run_length(buf, pos, first, flags, stride, limit, page_size): how many of the ``limit``
 * QEMU RAM entries at ``pos`` of ``buf``, ``stride`` bytes apart, continue a run: big-endian
 * headers first | flags, first + page_size | flags, ... (and a zero fill byte after each
 * header when stride is 9: a ZERO entry). converters/qemu.py's _run_length in one pass; numpy
 * pays a dozen calls per run, and runs of a real save are short. ValueError when the entries
 * run past the buffer. */
static PyObject *qemu_run_length(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t pos, stride, limit, page_size;
    unsigned long long first, flags;
    if (!PyArg_ParseTuple(args, "y*nKKnnn", &buf, &pos, &first, &flags, &stride, &limit, &page_size))
        return NULL;
    if (pos < 0 || stride < 9 || limit < 0 || page_size <= 0 || limit > (buf.len - pos) / stride) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "qemu_run_length: entries outside the buffer");
        return NULL;
    }
    const unsigned char *at = (const unsigned char *)buf.buf + pos;
    uint64_t expected = first | flags;
    Py_ssize_t n = 0;
    for (; n < limit; n++, at += stride, expected += (uint64_t)page_size) {
        uint64_t header;
        memcpy(&header, at, 8);
        if (__builtin_bswap64(header) != expected || (stride == 9 && at[8] != 0))
            break;
    }
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"digest_rows", digest_rows, METH_VARARGS,
     "digest_rows(data, page_size, rows, out): xxh3-128 of pages ``rows`` of ``data`` into ``out``."},
    {"index_list_heads", index_list_heads, METH_VARARGS,
     "index_list_heads(content, offsets, page_size, simple, word_start, num_words) -> words"},
    {"index_list_words", index_list_words, METH_VARARGS,
     "index_list_words(content, offsets, page_size, simple, word_start, positions, values)"},
    {"copy_rows", copy_rows, METH_VARARGS, "copy_rows(src, src_rows, dst, dst_rows, row_size)"},
    {"read_delta_frames", read_delta_frames, METH_VARARGS,
     "read_delta_frames(fds, offsets, lengths, firsts, nums, most) -> (content, entry offsets) or None"},
    {"page_map_extents", page_map_extents, METH_VARARGS,
     "page_map_extents(extents, lengths, is_page_class, has_slot, ok, pages, firsts)"},
    {"extents_hold", extents_hold, METH_VARARGS,
     "extents_hold(extents, lengths, pages, available, own, has_own_digest, has_digest, slot_classes, ok, present, "
     "bearing, rank0)"},
    {"own_extents", own_extents, METH_VARARGS,
     "own_extents(extents, bearing, rank0, depths, limit, parent_class, start, count, cls, slot, bearing_out, "
     "rank0_out, depth_out) -> m"},
    {"fold_own_pages", fold_own_pages, METH_VARARGS,
     "fold_own_pages(starts, counts, classes, slots, bearing, rank0, depths, inherits, concrete, delta_class, "
     "base_link, base_class, base_slot, digest_link, digest_class, digest_rank, delta_pages, delta_links, "
     "delta_slots) -> deltas"},
    {"fold_words", fold_words, METH_VARARGS,
     "fold_words(simple, word_start, positions, values, entries, pages, words_per_page, page_limit, plain, flat, "
     "flat_values) -> count or -1"},
    {"span_checksums", span_checksums, METH_VARARGS, "span_checksums(buffers, offsets, lengths, out)"},
    {"qemu_run_length", qemu_run_length, METH_VARARGS,
     "qemu_run_length(buf, pos, first, flags, stride, limit, page_size) -> count"},
    {"scan_files", scan_files, METH_VARARGS,
     "scan_files(names, starts, small, budget, keep_most, group, fds, sizes, got, heads, progress)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
