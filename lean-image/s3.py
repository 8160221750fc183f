"""Images in S3-compatible object storage: ``s3://BUCKET/KEY`` names an object that is read by
ranged GETs and written by a multipart upload.

Reads go through obstore (object_store's Rust client: it starts in ~10 ms, where boto3 takes
~220 ms, which a lazy restore's time-to-running pays), writes and the upload housekeeping
through boto3 (multipart uploads it aborts and lists); spec/guides/architecture.md says why.
Endpoint, region, credentials and retries come from the standard AWS configuration
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_REGION``, profiles, ``AWS_MAX_ATTEMPTS``),
so one command works against AWS S3, Ceph RGW, SeaweedFS, Garage or any other S3-compatible
store. Nothing here knows pages: an object is a file the reader reads with ``pread``, an
upload a file the writer writes to.
"""

from __future__ import annotations

import atexit
import io
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from .errors import LeanImageError

if TYPE_CHECKING:  # concurrent.futures (and logging with it) imported by the first object read
    from concurrent.futures import Future, ThreadPoolExecutor

    from obstore.store import ClientConfig, RetryConfig, S3Credential

SCHEME = "s3://"
BLOCK = 1 << 20  # the unit of reads and of the cache
GET_BLOCKS_MOST = 8  # blocks one GET asks for at most (nearby blocks coalesced)
AHEAD_BLOCKS = 32  # blocks read ahead of a reader that goes forward
CACHE_BLOCKS = 96  # blocks kept (LRU): memory is bounded whatever the object's size
FETCH_THREADS = 8
PART_SIZE = 8 << 20  # multipart upload parts (S3: at least 5 MiB but the last)
PARTS_IN_FLIGHT = 4
LIST_PAGE = 1000


class StoreError(LeanImageError):
    """The object store refused or failed a request, or an object changed while it was read."""


def is_s3(name) -> bool:
    return isinstance(name, str) and name.startswith(SCHEME)


def split(name: str) -> tuple[str, str]:
    """(bucket, key) of ``s3://BUCKET/KEY``."""
    bucket, _, key = name[len(SCHEME) :].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise StoreError(f"expected s3://BUCKET/KEY, got {name!r}", path=name)
    return bucket, key


def join(bucket: str, key: str) -> str:
    return f"{SCHEME}{bucket}/{key}"


# -- the client ------------------------------------------------------------------
_lock = threading.Lock()
_client = None
_stores: dict = {}
_pool: ThreadPoolExecutor | None = None


def client():
    """The process's boto3 client (thread-safe) for uploads and the checks before a write,
    made on first use: importing boto3 and building it costs ~220 ms, which no read pays."""
    global _client
    with _lock:
        if _client is None:
            import boto3
            from botocore.config import Config

            config = Config(
                retries={"mode": os.environ.get("AWS_RETRY_MODE", "standard"), "max_attempts": _attempts()},
                max_pool_connections=2 * FETCH_THREADS,
                connect_timeout=10,
                read_timeout=60,
            )
            _client = boto3.session.Session().client("s3", config=config)
        return _client


def _attempts() -> int:
    return int(os.environ.get("AWS_MAX_ATTEMPTS", "5"))


def reader(bucket: str):
    """The obstore S3Store that reads ``bucket`` (one per bucket and configuration, thread-safe).
    Credentials from the environment; without AWS_ACCESS_KEY_ID, from boto3's chain (profiles,
    SSO, roles)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    key = (
        bucket,
        endpoint,
        os.environ.get("AWS_ACCESS_KEY_ID"),
        os.environ.get("AWS_SECRET_ACCESS_KEY"),
        os.environ.get("AWS_PROFILE"),
        os.environ.get("AWS_MAX_ATTEMPTS"),
    )
    with _lock:
        if key not in _stores:
            from datetime import timedelta
            from obstore.store import S3Store

            options: ClientConfig = {
                "connect_timeout": "10s",
                "timeout": "60s",
                "allow_http": endpoint.startswith("http://"),
            }
            retry: RetryConfig = {"max_retries": max(_attempts() - 1, 0), "retry_timeout": timedelta(seconds=60)}
            if os.environ.get("AWS_ACCESS_KEY_ID"):
                _stores[key] = S3Store(bucket, client_options=options, retry_config=retry)
            else:
                _stores[key] = S3Store(
                    bucket, client_options=options, retry_config=retry, credential_provider=_ProfileCredentials()
                )
        return _stores[key]


class _ProfileCredentials:
    """Credentials for obstore from boto3's own chain (profiles, SSO, instance roles): only
    when the environment has none, so the common case never imports boto3."""

    def __init__(self):
        import boto3

        session = boto3.session.Session()
        self.credentials = session.get_credentials()
        if self.credentials is None:
            raise StoreError(
                "no credentials for the store (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
            )
        self.config = {"region": session.region_name} if session.region_name else {}

    def __call__(self) -> S3Credential:
        from datetime import datetime, timedelta, timezone

        frozen = self.credentials.get_frozen_credentials()
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(timezone.utc) + timedelta(minutes=5),
        }


def read_failure(exc: Exception, name: str, doing: str) -> StoreError:
    """A clear StoreError for what obstore raised while ``doing`` something to ``name``."""
    from obstore import exceptions as oe

    message = str(exc).split("\n", 1)[0]
    if isinstance(exc, StoreError):
        exc.path = exc.path or name
        exc.args = (str(exc),)
        return exc
    if isinstance(exc, FileNotFoundError):
        return StoreError(f"{doing}: no such object (or its bucket does not exist)", path=name)
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
        return StoreError(
            f"{doing}: the store refused the credentials; check AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY or the profile",
            path=name,
        )
    if "error sending request" in message or "connect" in message.lower():
        return StoreError(f"{doing}: cannot reach the store ({message})", path=name)
    return StoreError(f"{doing}: {message}", path=name)


def _read_errors():
    from obstore.exceptions import BaseError

    return (StoreError, BaseError, OSError, ValueError, RuntimeError)


def pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="leanimg-s3")
        return _pool


def failure(exc: Exception, name: str, doing: str) -> StoreError:
    """A clear StoreError for what boto3 raised while ``doing`` something to ``name``."""
    from botocore import exceptions as bce

    if isinstance(exc, bce.ClientError):
        error = exc.response.get("Error", {})
        code, status = str(error.get("Code", "")), exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            bucket = name[len(SCHEME) :].partition("/")[0] if is_s3(name) else name
            return StoreError(f"{doing}: bucket {bucket!r} does not exist", path=name)
        if code in ("NoSuchKey", "404", "NotFound"):
            return StoreError(f"{doing}: no such object (or its bucket does not exist)", path=name)
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden"):
            return StoreError(
                f"{doing}: the store refused the credentials ({code}); check AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY or the profile",
                path=name,
            )
        return StoreError(
            f"{doing}: the store answered {status} {code}: {error.get('Message', '')}".rstrip(": "), path=name
        )
    if isinstance(exc, bce.NoCredentialsError):
        return StoreError(
            f"{doing}: no credentials for the store (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)",
            path=name,
        )
    if isinstance(exc, (bce.EndpointConnectionError, bce.ConnectionClosedError, bce.ConnectTimeoutError)):
        return StoreError(f"{doing}: cannot reach the store ({exc})", path=name)
    if isinstance(exc, bce.BotoCoreError):
        return StoreError(f"{doing}: {exc}", path=name)
    return StoreError(f"{doing}: {type(exc).__name__}: {exc}", path=name)


def _boto_errors():
    from botocore import exceptions as bce
    from urllib3 import exceptions as u3

    return (bce.BotoCoreError, bce.ClientError, u3.HTTPError, OSError)


# -- what was fetched ----------------------------------------------------------------
class Fetched:
    """Bytes and requests one object cost, for `inspect` and `validate` to report."""

    def __init__(self, name: str, size: int):
        self.name, self.size, self.bytes, self.requests = name, size, 0, 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        """One GET of ``nbytes`` (from the fetch threads: counted under a lock)."""
        with self._lock:
            self.bytes += nbytes
            self.requests += 1

    def as_dict(self) -> dict:
        return {
            "location": self.name,
            "object_bytes": self.size,
            "fetched_bytes": self.bytes,
            "requests": self.requests,
        }


FETCHED: dict[str, Fetched] = {}


def fetched_total() -> tuple[int, int] | None:
    """(bytes, GETs) fetched so far from every object this process read (None: it read none)."""
    if not FETCHED:
        return None
    return sum(f.bytes for f in FETCHED.values()), sum(f.requests for f in FETCHED.values())


def take_fetched() -> list[dict]:
    """What every object opened since the last call cost (Fetched.as_dict), and start again."""
    found = [f.as_dict() for f in FETCHED.values()]
    FETCHED.clear()
    return found


def fetched_lines(fetched: list[dict]) -> list[str]:
    return [
        f"  fetched {f['fetched_bytes'] / 2**20:.2f} MiB of {f['object_bytes'] / 2**20:.2f} MiB in "
        f"{f['requests']} ranged GETs: {f['location']}"
        for f in fetched
    ]


# -- reading -------------------------------------------------------------------------
class _Blocks:
    """The blocks read of every object open in this process, by (bucket, key, ETag, block):
    the last CACHE_BLOCKS kept (LRU), those asked for but not yet arrived as futures. Shared,
    so a command that opens an image twice (validate: its records, then its pages) or a
    parent twice fetches a block once while it is kept."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a GET that ended already runs its callback at once
        self.held: OrderedDict[tuple, bytes] = OrderedDict()
        self.pending: dict[tuple, Future] = {}


_BLOCKS = _Blocks()


class S3Object(io.RawIOBase):
    """An object read like a file: ``pread`` and sequential reads. Reads are BLOCK-aligned
    ranged GETs, nearby missing blocks coalesced into one request, many requests at once,
    the blocks ahead of a reader going forward asked for before it gets there, the last
    CACHE_BLOCKS kept (_Blocks). The object is pinned by the ETag it had when opened: a GET
    of an object replaced since fails (If-Match), so bytes of two versions are never mixed."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.bucket, self.key = split(name)
        try:
            import obstore

            head = obstore.head(reader(self.bucket), self.key)
        except _read_errors() as exc:
            raise read_failure(exc, name, "cannot open") from None
        self.size, self.etag = int(head["size"]), head.get("e_tag")
        if not self.etag:
            raise StoreError(
                "cannot open: the store gave no ETag, so the object cannot be pinned against "
                "replacement while it is read",
                path=name,
            )
        self.fetched = FETCHED.setdefault(name, Fetched(name, self.size))
        self.fetched.size = self.size
        self._pos = 0
        self._id = (self.bucket, self.key, self.etag)
        self._next_block = -1  # the block after the last read: reading on from there reads ahead
        self._window = 0  # blocks read ahead: grows while the reader goes on

    # file protocol
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.name} is an object, not a file")

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        data = self.pread(len(buffer), self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def pread(self, length: int, offset: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer at the object's end), as os.pread."""
        end = min(offset + length, self.size)
        if length <= 0 or offset >= end:
            return b""
        first, last = offset // BLOCK, (end - 1) // BLOCK
        with _BLOCKS.lock:
            self._ask(first, last + 1)
            if first <= self._next_block <= last + 1:
                # a window that doubles while the reader goes on (a few tables read one after
                # another fetch little ahead), its end moving in whole GETs
                self._window = min(max(2 * self._window, GET_BLOCKS_MOST), AHEAD_BLOCKS)
                ahead = (last + 1 + self._window) // GET_BLOCKS_MOST * GET_BLOCKS_MOST
                self._ask(last + 1, min(ahead, self._blocks_in_object()))
            else:
                self._window = 0
            self._next_block = last + 1
        lo = offset - first * BLOCK
        if first == last:
            return self._block(first)[lo : lo + end - offset]
        data = b"".join([self._block(b) for b in range(first, last + 1)])
        return data[lo : lo + end - offset]

    def _blocks_in_object(self) -> int:
        return -(-self.size // BLOCK)

    def _ask(self, lo: int, hi: int) -> None:
        """GETs for the blocks of [lo, hi) neither held nor asked for; called under the lock."""

        def missing(k):
            return (*self._id, k) not in _BLOCKS.held and (*self._id, k) not in _BLOCKS.pending

        b = lo
        while b < hi:
            if not missing(b):
                b += 1
                continue
            run_end = b
            while run_end < hi and run_end - b < GET_BLOCKS_MOST and missing(run_end):
                run_end += 1
            future = pool().submit(self._get, b, run_end)
            for k in range(b, run_end):
                key = (*self._id, k)
                _BLOCKS.pending[key] = future
            future.add_done_callback(self._arrived)
            b = run_end

    def _arrived(self, future: Future) -> None:
        """A GET's blocks moved to the held ones (LRU, CACHE_BLOCKS at most) as it ends, read
        or not: blocks read ahead and never used cannot pile up. A failed GET's are
        forgotten, so a later read asks again."""
        failed = future.cancelled() or future.exception() is not None
        with _BLOCKS.lock:
            for key in [key for key, f in _BLOCKS.pending.items() if f is future]:
                del _BLOCKS.pending[key]
                if not failed:
                    lo, data = future.result()
                    k = key[-1] - lo
                    _BLOCKS.held[key] = data[k * BLOCK : (k + 1) * BLOCK]
            while len(_BLOCKS.held) > CACHE_BLOCKS:
                _BLOCKS.held.popitem(last=False)

    def _block(self, b: int) -> bytes:
        key = (*self._id, b)
        with _BLOCKS.lock:
            if key not in _BLOCKS.held and key not in _BLOCKS.pending:
                self._ask(b, b + 1)  # evicted since asked for (or never asked): ask again
            if key in _BLOCKS.held:
                _BLOCKS.held.move_to_end(key)
                return _BLOCKS.held[key]
            future = _BLOCKS.pending.get(key)
        if future is None:  # its GET failed at once: here, to raise its error
            return self._get(b, b + 1)[1]
        lo, data = future.result()
        return data[(b - lo) * BLOCK : (b - lo + 1) * BLOCK]

    def _get(self, lo: int, hi: int) -> tuple[int, bytes]:
        cache = disk_cache()
        kept = cache and cache.get_run(self._id, lo, hi)
        if kept:
            return lo, kept
        lo, data = self._fetch(lo, hi)
        if cache:
            cache.put_run(self._id, lo, data)
        return lo, data

    def _fetch(self, lo: int, hi: int) -> tuple[int, bytes]:
        import obstore
        from obstore.exceptions import PreconditionError

        start, end = lo * BLOCK, min(hi * BLOCK, self.size)
        doing = f"reading bytes {start}-{end - 1}"
        try:
            data = bytes(
                obstore.get(
                    reader(self.bucket), self.key, options={"range": (start, end), "if_match": self.etag}
                ).bytes()
            )
        except PreconditionError:
            raise StoreError(
                f"{doing}: the object was replaced since it was opened (its ETag was "
                f"{self.etag}); refused rather than mixing two versions",
                path=self.name,
            ) from None
        except _read_errors() as exc:
            if isinstance(exc, FileNotFoundError):
                raise StoreError(f"{doing}: the object was deleted since it was opened", path=self.name) from None
            raise read_failure(exc, self.name, doing) from None
        self.fetched.add(len(data))
        if len(data) != end - start:
            raise StoreError(
                f"{doing}: got {len(data)} bytes, expected {end - start} (object changed?)", path=self.name
            )
        return lo, data


class DiskCache:
    """A read-through cache of blocks on local disk (LEANIMG_S3_CACHE=DIR, at most
    LEANIMG_S3_CACHE_MB, default 4096): a host that restores or serves the same images again
    (a fleet's golden image) fetches their blocks once. A block is kept by object, ETag and
    number (a replaced object is another ETag: never served from the old one's blocks), written
    whole by rename, with its xxh3-64 checked when read (a damaged file is dropped and fetched
    again). The least recently used files go when the limit is passed."""

    def __init__(self, directory: str, limit: int):
        self.directory, self.limit = directory, limit
        self.used: int | None = None
        self.lock = threading.Lock()

    def _path(self, object_id: tuple, block: int) -> str:
        import hashlib

        name = hashlib.sha256("\0".join(object_id).encode()).hexdigest()[:32]
        return os.path.join(self.directory, name, str(block))

    def get_run(self, object_id: tuple, lo: int, hi: int) -> bytes | None:
        """Blocks [lo, hi) joined, if every one is here and intact."""
        import xxhash

        parts = []
        for block in range(lo, hi):
            try:
                with open(self._path(object_id, block), "rb") as f:
                    raw = f.read()
            except OSError:
                return None
            if len(raw) < 8 or xxhash.xxh3_64_digest(raw[8:]) != raw[:8]:
                self._drop(self._path(object_id, block))
                return None
            parts.append(raw[8:])
        for block in range(lo, hi):  # recently used: kept longest
            try:
                os.utime(self._path(object_id, block))
            except OSError:
                pass
        return b"".join(parts)

    def put_run(self, object_id: tuple, lo: int, data: bytes) -> None:
        import xxhash

        added = 0
        for k in range(-(-len(data) // BLOCK)):
            block = data[k * BLOCK : (k + 1) * BLOCK]
            path = self._path(object_id, lo + k)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                temp = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
                with open(temp, "wb") as f:
                    f.write(xxhash.xxh3_64_digest(block) + block)
                os.replace(temp, path)
                added += len(block) + 8
            except OSError:
                return  # a full or read-only cache costs fetches, never a failure
        with self.lock:
            if self.used is None:
                self.used = sum(size for _, size, _ in self._files())
            else:
                self.used += added
            if self.used > self.limit:
                self._trim()

    def _files(self) -> list[tuple[float, int, str]]:
        found = []
        for root, _, names in os.walk(self.directory):
            for name in names:
                try:
                    st = os.stat(os.path.join(root, name))
                except OSError:
                    continue
                found.append((st.st_mtime, st.st_size, os.path.join(root, name)))
        return found

    def _trim(self) -> None:
        files = sorted(self._files())
        self.used = sum(size for _, size, _ in files)
        for _, size, path in files:
            if self.used <= self.limit * 0.9:
                break
            self._drop(path)
            self.used -= size

    @staticmethod
    def _drop(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass


_disk_cache: list = []


def disk_cache() -> DiskCache | None:
    """The read-through cache LEANIMG_S3_CACHE names (None: no cache)."""
    with _lock:
        if not _disk_cache:
            directory = os.environ.get("LEANIMG_S3_CACHE")
            limit = int(os.environ.get("LEANIMG_S3_CACHE_MB", "4096")) << 20
            _disk_cache.append(DiskCache(directory, limit) if directory else None)
        return _disk_cache[0]


def exists(name: str) -> bool:
    bucket, key = split(name)
    try:
        client().head_object(Bucket=bucket, Key=key)
        return True
    except _boto_errors() as exc:
        error = failure(exc, name, "cannot look at the output")
        if "no such object" in error.message:
            return False
        raise error from None


def check_bucket(name: str) -> None:
    """Refuse to write ``name`` into a bucket that does not exist (some stores, SeaweedFS
    among them, would create it on the first write)."""
    from botocore.exceptions import ClientError

    bucket = split(name)[0]
    try:
        client().head_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
            raise StoreError(f"cannot write: bucket {bucket!r} does not exist", path=name) from None
        raise failure(exc, name, "cannot write") from None
    except _boto_errors() as exc:
        raise failure(exc, name, "cannot write") from None


def read_heads(names: list[str], length: int) -> list[bytes | None]:
    """The first ``length`` bytes of each object (None: unreadable), asked for all at once."""
    import obstore

    def head(name):
        try:
            bucket, key = split(name)
            return bytes(obstore.get(reader(bucket), key, options={"range": (0, length)}).bytes())
        except (StoreError, *_read_errors()):
            return None

    return list(pool().map(head, names))


def list_beside(name: str, suffix: str, most: int) -> list[str]:
    """The objects beside ``name`` (same prefix up to its last '/') whose keys end in
    ``suffix``, sorted, at most ``most``."""
    import obstore

    bucket, key = split(name)
    prefix = key[: key.rfind("/") + 1]
    found: list[str] = []
    listed = 0
    try:  # listed LIST_PAGE keys at a time, ``most`` at most (deeper keys counted too)
        for page in obstore.list(reader(bucket), prefix=prefix.rstrip("/") or None, chunk_size=LIST_PAGE):
            keys = [item["path"] for item in page]
            listed += len(keys)
            found.extend(k for k in keys if k.endswith(suffix) and "/" not in k[len(prefix) :])
            if listed >= most:
                break
    except _read_errors() as exc:
        raise read_failure(exc, join(bucket, prefix or "/"), "cannot list the images beside it") from None
    return [join(bucket, k) for k in sorted(found)[:most]]


# -- writing ---------------------------------------------------------------------------
_UPLOADS: set["S3Upload"] = set()


class S3Upload(io.RawIOBase):
    """A new object written like a file, as a multipart upload: PART_SIZE parts sent on the
    fetch threads, PARTS_IN_FLIGHT at most (memory bounded whatever the object's size). The
    object appears under its key only at ``commit``; ``discard`` (or the process ending
    without a commit) aborts the upload, so no part of it stays in the store."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.bucket, self.key = split(name)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self.written = 0
        _UPLOADS.add(self)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.name} is an object, not a file")

    def write(self, data) -> int:
        self._buffer += data
        self.written += len(data)
        while len(self._buffer) >= PART_SIZE:
            self._send(bytes(self._buffer[:PART_SIZE]))
            del self._buffer[:PART_SIZE]
        return len(data)

    def _send(self, data: bytes) -> None:
        if self._upload_id is None:
            try:
                self._upload_id = client().create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
            except _boto_errors() as exc:
                raise failure(exc, self.name, "cannot start the upload") from None
        number = len(self._parts) + 1
        self._parts.append(pool().submit(self._upload_part, number, data))
        in_flight = [part for part in self._parts if not part.done()]
        if len(in_flight) > PARTS_IN_FLIGHT:
            in_flight[0].result()

    def _upload_part(self, number: int, data: bytes) -> dict:
        try:
            response = client().upload_part(
                Bucket=self.bucket, Key=self.key, UploadId=self._upload_id, PartNumber=number, Body=data
            )
        except _boto_errors() as exc:
            raise failure(exc, self.name, f"cannot upload part {number}") from None
        return {"PartNumber": number, "ETag": response["ETag"]}

    def commit(self) -> None:
        """Make the object visible under its key, complete."""
        try:
            if self._upload_id is None:
                client().put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self._buffer))
            else:
                if self._buffer:
                    self._send(bytes(self._buffer))
                parts = [part.result() for part in self._parts]
                client().complete_multipart_upload(
                    Bucket=self.bucket, Key=self.key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
                )
        except _boto_errors() as exc:
            self.discard()
            raise failure(exc, self.name, "cannot complete the upload") from None
        except BaseException:
            self.discard()
            raise
        self._buffer = bytearray()
        _UPLOADS.discard(self)
        super().close()

    def discard(self) -> None:
        """Abort the upload: nothing of it is left in the store."""
        _UPLOADS.discard(self)
        for part in self._parts:
            part.cancel()
        self._buffer = bytearray()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            for part in self._parts:
                try:
                    part.exception()
                except BaseException:
                    pass
            try:
                client().abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=upload_id)
            except _boto_errors():
                pass  # `leanimg uploads --abort` finds it
        super().close()


@atexit.register
def _abort_leftover_uploads() -> None:
    for upload in list(_UPLOADS):
        upload.discard()


def incomplete_uploads(prefix_name: str) -> list[dict]:
    """The multipart uploads under ``s3://BUCKET[/PREFIX]`` never completed nor aborted
    (a writer killed with SIGKILL leaves one): key, upload id, when it began."""
    bucket, _, prefix = prefix_name[len(SCHEME) :].partition("/")
    found: list[dict] = []
    try:
        for page in client().get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
            found.extend(
                {
                    "location": join(bucket, u["Key"]),
                    "upload_id": u["UploadId"],
                    "initiated": u["Initiated"].isoformat(),
                }
                for u in page.get("Uploads", ())
            )
    except _boto_errors() as exc:
        raise failure(exc, prefix_name, "cannot list the uploads") from None
    return found


def abort_upload(location: str, upload_id: str) -> None:
    bucket, key = split(location)
    try:
        client().abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    except _boto_errors() as exc:
        raise failure(exc, location, "cannot abort the upload") from None
