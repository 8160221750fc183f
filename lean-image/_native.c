/* leanimg._native: the two loops of a restore that numpy and the xxhash module can only do
 * with the GIL held for most of their time, done in C with the GIL released:
 *  - digest_rows: the page digests of spec §6.5 (xxh3-128 of each page, canonical byte order)
 *    of many pages in one call; the xxhash module takes one call per page under the GIL;
 *  - index_list_heads / index_list_words: the plain INDEX_LIST entries of a decompressed
 *    DELTA_FRAME (spec §7.3) parsed in one pass; numpy needs a dozen passes and gathers.
 * Optional: leanimg works the same without it (setup.py builds it where gcc, Python's headers
 * and xxhash.h are found; format.py and delta.py fall back to the xxhash module and numpy,
 * and tests/test_native.py checks both give the same). xxhash.h is Debian's libxxhash-dev,
 * used header-only. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

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
    PyBuffer_Release(&data);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
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
    PyBuffer_Release(&content);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&simple);
    PyBuffer_Release(&word_start);
    PyBuffer_Release(&num_words);
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
    PyBuffer_Release(&content);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&simple);
    PyBuffer_Release(&word_start);
    PyBuffer_Release(&positions);
    PyBuffer_Release(&values);
    return result;
}

static PyMethodDef methods[] = {
    {"digest_rows", digest_rows, METH_VARARGS,
     "digest_rows(data, page_size, rows, out): xxh3-128 of pages ``rows`` of ``data`` into ``out``."},
    {"index_list_heads", index_list_heads, METH_VARARGS,
     "index_list_heads(content, offsets, page_size, simple, word_start, num_words) -> words"},
    {"index_list_words", index_list_words, METH_VARARGS,
     "index_list_words(content, offsets, page_size, simple, word_start, positions, values)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
