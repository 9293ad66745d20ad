"""The OpenAI Files and Batch APIs on the balancer (``/v1/files``, ``/v1/batches``; docs/api.md), for clients that
submit thousands of requests as a file: ``client.files.create(purpose="batch")``, ``client.batches.create(...)``,
``client.batches.retrieve(id)``, ``client.files.content(output_file_id)``.

Files and batches live under ``--files-dir`` (each file's bytes and a JSON record; each batch a JSON record), so a
restarted balancer still lists them and resumes the batches that were running: lines already answered are not sent
again (common/batchfile.py). A batch's lines go through the balancer's own queue, like any request, at most
``--batch-concurrency`` at once per batch; a line the balancer cannot admit for the moment (429 queue full, 503 no
healthy worker) waits and is tried again rather than failing. Answers go to the batch's output file (2xx) or error
file (everything else, and lines that could not be sent), one result line per request line, in the order answers
come. ``completion_window`` is accepted ("24h") and not enforced: a batch runs until its lines are done or it is
cancelled."""
from __future__ import annotations

import asyncio
import collections
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
from aiohttp import BodyPartReader, web

from common.batchfile import BATCH_URLS, is_final, parse_line, result_key, result_line
from common.http import MAX_BODY_BYTES, body_read, json_response
from common.openai_http import ENDPOINTS, parse
from common.protocol import APIError, error_body, loads

log = logging.getLogger("dllm.balancer.batches")

RUNNING = ("validating", "in_progress", "finalizing", "cancelling")
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")


def public(b: dict) -> dict:
    """A batch record as the API shows it (without the fields kept for resuming it)."""
    return {k: v for k, v in b.items() if not k.startswith("_")}


def _now() -> int:
    return int(time.time())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_durably(tmp: Path, path: Path) -> None:
    """``tmp`` (written, not yet synced) becomes ``path``: its bytes reach the disk before the rename, and the
    rename before this returns (without it a power loss could leave an empty record, and its batch skipped)."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write(path: Path, raw: bytes, durable: bool) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(raw)
    if durable:
        _replace_durably(tmp, path)
    else:
        os.replace(tmp, path)


def _sync(path: Path) -> None:
    """``path``'s bytes to the disk (opened again: the writer's descriptor may be closed meanwhile)."""
    if path.exists():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


class Records:
    """The JSON records (a file's, a batch's) and the other small writes of --files-dir, done in order on one
    thread of their own: a record is written whole and synced to disk with its folder (``durable``), which took
    2-12 ms a write on the event loop (35-57 ms stalls with 16 batches ending together: a review). A record is read
    back as last written (or removed: gone), before that is done."""

    _GONE = b""                      # (in _latest: a removal queued)

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="records")
        self._latest: dict[Path, bytes] = {}

    def write(self, path: Path, data: dict, durable: bool = True) -> asyncio.Future:
        raw = self._latest[path] = orjson.dumps(data)

        def written(_):
            if self._latest.get(path) is raw:
                del self._latest[path]
        fut = asyncio.get_running_loop().run_in_executor(self._pool, _write, path, raw, durable)
        fut.add_done_callback(written)
        return asyncio.shield(fut)

    def run(self, fn, *args) -> asyncio.Future:
        """``fn(*args)`` on the records' thread, after the writes before it. Once queued it is done, whatever
        becomes of the one awaiting it (a client that left cancelled its handler, and with it a write still queued:
        a review's cancel was answered, never written, and the batch ended "completed")."""
        return asyncio.shield(asyncio.get_running_loop().run_in_executor(self._pool, fn, *args))

    def remove(self, *paths: Path) -> asyncio.Future:
        """Remove files, in order with the writes (a record's pending write would bring it back); read as gone
        from now on."""
        gone = self._GONE
        for p in paths:
            self._latest[p] = gone

        def removed(_):
            for p in paths:
                if self._latest.get(p) is gone:
                    del self._latest[p]
        fut = asyncio.get_running_loop().run_in_executor(self._pool, lambda: [p.unlink(missing_ok=True)
                                                                              for p in paths])
        fut.add_done_callback(removed)
        return asyncio.shield(fut)

    def read(self, path: Path) -> dict | None:
        """The record as last written; None if it is gone (deleted, or its removal queued)."""
        raw = self._latest.get(path)
        if raw is self._GONE:
            return None
        if raw is None:
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                return None
        return orjson.loads(raw)

    def close(self) -> None:
        self._pool.shutdown(wait=True)



def _model_and_usage(path: Path) -> tuple[str | None, dict | None]:
    """A finished batch's ``model`` (its answers') and ``usage`` (theirs summed, in the Responses API's names, as
    OpenAI's batch object gives it), from its output file."""
    model, totals, seen = None, {"input_tokens": 0, "output_tokens": 0, "cached_tokens": 0}, False
    if not path.exists():
        return model, None
    with open(path, "rb") as f:           # a line at a time: an output of hundreds of MiB is never held whole
        for raw in f:
            try:
                body = orjson.loads(raw)["response"]["body"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
            if not isinstance(body, dict):
                continue
            model = model or body.get("model")
            u = body.get("usage")
            if isinstance(u, dict):
                seen = True
                totals["input_tokens"] += u.get("input_tokens", u.get("prompt_tokens")) or 0
                totals["output_tokens"] += u.get("output_tokens", u.get("completion_tokens")) or 0
                details = u.get("input_tokens_details") or u.get("prompt_tokens_details") or {}
                totals["cached_tokens"] += details.get("cached_tokens") or 0
    if not seen:
        return model, None
    return model, {"input_tokens": totals["input_tokens"], "output_tokens": totals["output_tokens"],
                   "total_tokens": totals["input_tokens"] + totals["output_tokens"],
                   "input_tokens_details": {"cached_tokens": totals["cached_tokens"]},
                   "output_tokens_details": {"reasoning_tokens": 0}}


def _load_all(folder: Path, pattern: str) -> list[dict]:
    """The JSON records in ``folder`` named like ``pattern``; one being written or removed meanwhile is skipped."""
    out = []
    for f in folder.glob(pattern):
        try:
            out.append(orjson.loads(f.read_bytes()))
        except (OSError, orjson.JSONDecodeError):
            continue
    return out

class _Lines:
    """A batch's input lines, parsed as its lanes take them, a chunk at a time on a thread (at most CHUNK_LINES lines
    or CHUNK_BYTES bytes, and at least one line): a batch holds a chunk and its lines in flight, not its whole input
    (every line parsed at once took about 6x the file: a review's 100 MiB file held 600 MB a batch). Lines already
    answered (``done``: their keys) are skipped; a custom_id used before is refused as the whole file was."""

    CHUNK_LINES = 256
    CHUNK_BYTES = 8 << 20

    def __init__(self, path: Path, endpoint: str, done: set):
        self.path, self.endpoint, self.done = path, endpoint, done
        self.seen: set[str] = set()
        self.number, self.ready, self.eof = 0, collections.deque(), False
        self.lock = asyncio.Lock()
        self.file = None

    def __enter__(self) -> "_Lines":
        self.file = open(self.path, "rb")
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def _chunk(self) -> tuple[list, bool]:
        out, size = [], 0
        while len(out) < self.CHUNK_LINES and size < self.CHUNK_BYTES:
            raw = self.file.readline()
            if not raw:
                return out, True
            self.number += 1
            size += len(raw)
            if not raw.strip():
                continue
            line = parse_line(self.number, raw, self.seen)
            if line.error is None and line.url != self.endpoint:   # every line of this batch names its endpoint
                line.kind, line.error = None, {"code": "invalid_url", "message": f"line {line.number}: url "
                                               f"{line.url!r} is not the batch's endpoint {self.endpoint!r}"}
            if line.key not in self.done:
                out.append(line)
        return out, False

    async def next(self):
        """The next line to send (in the file's order), or None once every line is taken."""
        async with self.lock:
            while not self.ready and not self.eof:
                chunk, self.eof = await asyncio.to_thread(self._chunk)
                self.ready.extend(chunk)
            return self.ready.popleft() if self.ready else None


class FolderInUse(RuntimeError):
    """Another balancer holds this files folder (BatchJobs.start)."""


class BatchJobs:
    def __init__(self, state, root: Path, max_file_bytes: int, concurrency: int, max_running: int = 16,
                 min_free_bytes: int = 1 << 30):
        self.state, self.root = state, root
        self.max_file_bytes, self.concurrency = max_file_bytes, concurrency
        # --max-running-batches: batches past it wait "validating", in the order they were created; a running batch
        # holds its files open and a chunk of its parsed lines (up to _Lines.CHUNK_BYTES of input)
        self.running = asyncio.Semaphore(max_running)
        self.min_free_bytes = min_free_bytes         # --min-free-disk-bytes: uploads and new batches leave it free
        # a running batch's request counts, kept here as it progresses (its record is written at each change of
        # status, durably, not after every answer): shown over the record's
        self.counts: dict[str, dict] = {}
        self.records = Records()
        self._started: set[str] = set()         # batches past their wait for a running place (_run_lines)
        self._ending: set[str] = set()          # batches whose run is writing their end
        self._full: set[str] = set()            # running batches stopped by a full disk
        # --batch-concurrency: lines in the queue at once over every running batch, taken in turn (FIFO): a client
        # starting many batches gets no more of the queue than one batch (a review filled the 4,096-request queue
        # with 70 batches of 64 lanes each, and every interactive request got 429)
        self.slots = asyncio.Semaphore(concurrency)
        self.files_dir, self.batches_dir = root / "files", root / "batches"
        self.tasks: dict[str, asyncio.Task] = {}
        self._cancel: set[str] = set()          # batches being cancelled (read per line: kept in memory)
        # what a listing sorts by, kept in memory (read from the records once, at the start): a listing read and
        # parsed every record on the event loop, seconds for 20,000 files with every client stopped (a review)
        self._files: dict[str, tuple[int, str]] = {}       # file id -> (created_at, purpose)
        self._batches: dict[str, int] = {}                 # batch id -> created_at
        self._gone: dict[str, int] = {}                    # deleted file id -> created_at: a page `after` it
        self._lock = None                                  # the folder's lock file, held while this runs

    # ------------------------------------------------------------ storage
    def start(self) -> None:
        """Create the directories, lock them for this process (raises FolderInUse if another balancer holds them);
        resume the batches a previous balancer left running."""
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        # One balancer process a folder: a second one (another port, or the same port before it found the port
        # taken) resumed the running batches too, rewriting their result files under the first one's open handles
        # (a review: 13 of 60 answers left on disk). A POSIX lock: it goes with the process however it ends, and
        # apps in one process (tests) do not exclude each other.
        self._lock = open(self.root / ".lock", "a+")
        try:
            fcntl.lockf(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            holder = self._lock.read().strip()
            self._lock.close()
            raise FolderInUse(f"--files-dir {self.root} is in use by another balancer ({holder or 'pid unknown'}); "
                              "give this one a folder of its own") from None
        self._lock.truncate(0)
        self._lock.write(f"pid {os.getpid()}")
        self._lock.flush()
        for rec in _load_all(self.files_dir, "file-*.json"):
            self._files[rec["id"]] = (rec["created_at"], rec["purpose"])
        stored = _load_all(self.batches_dir, "batch_*.json")
        for b in sorted(stored, key=lambda b: (b["created_at"], b.get("_seq", 0), b["id"])):    # in the order they came
            self._batches[b["id"]] = b["created_at"]
            if b.get("status") == "cancelling":
                self._cancel.add(b["id"])
            if b.get("status") in RUNNING:
                log.info("resuming batch %s (%s)", b["id"], b["status"])
                self.tasks[b["id"]] = asyncio.create_task(self._run(b["id"]), name=f"batch {b['id']}")

    async def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await asyncio.to_thread(self.records.close)      # (the writes queued: done)
        if self._lock is not None:
            self._lock.close()                           # (the lock goes with it)
            self._lock = None

    def _file(self, fid: str) -> dict:
        path = self.files_dir / f"{fid}.json"
        rec = self.records.read(path) if FILE_ID.fullmatch(fid) else None
        if rec is None:
            raise APIError(404, f"No such File object: {fid}", param="file_id", code="file_not_found")
        return rec

    def _data(self, fid: str) -> Path:
        return self.files_dir / f"{fid}.data"

    def _batch(self, bid: str) -> dict:
        path = self.batches_dir / f"{bid}.json"
        rec = self.records.read(path) if BATCH_ID.fullmatch(bid) else None
        if rec is None:
            raise APIError(404, f"No such Batch object: {bid}", param="batch_id", code="batch_not_found")
        return rec

    def _save_batch(self, b: dict) -> asyncio.Future:
        """Its record, written in order (queued now; awaited for its end)."""
        return self.records.write(self.batches_dir / f"{b['id']}.json", self._shown(b))

    def _counts_path(self, bid: str) -> Path:
        return self.batches_dir / f"{bid}.counts"

    def _shown(self, b: dict) -> dict:
        """``b`` with its request counts as they stand: a running batch's from memory (``counts``); one left
        running by an earlier balancer (waiting for its turn to resume) from its last progress note."""
        live = self.counts.get(b["id"])
        if live is None and b.get("status") in RUNNING:
            try:
                live = self.records.read(self._counts_path(b["id"]))    # (a note whose removal is queued: gone)
            except (OSError, orjson.JSONDecodeError):
                live = None
        if isinstance(live, dict):
            b["request_counts"].update(live)
        return b

    def _note_counts(self, bid: str, counts: dict) -> None:
        """A running batch's counts noted beside its record (not synced; read only if the record still says it
        runs), so a balancer that crashed shows them while the batch waits to resume."""
        fut = self.records.write(self._counts_path(bid), counts, durable=False)
        fut.add_done_callback(lambda f: f.exception() and log.warning("batch %s: counts not noted: %s", bid,
                                                                      f.exception()))

    def _room(self) -> int:
        """Bytes that may still be written under --files-dir leaving --min-free-disk-bytes free (507 if none)."""
        room = shutil.disk_usage(self.files_dir).free - self.min_free_bytes
        if room <= 0:
            raise self._no_room(room + self.min_free_bytes)
        return room

    def _no_room(self, free: int) -> APIError:
        return APIError(507, f"no room under --files-dir: its disk has {max(0, free) / 2**20:,.0f} MiB free and "
                             f"--min-free-disk-bytes keeps {self.min_free_bytes / 2**20:,.0f} MiB of it free",
                        type="server_error", code="insufficient_storage",
                        headers={"x-should-retry": "false"})   # (the openai client retries a 5xx: an upload twice)

    async def _new_file(self, fid: str, filename: str, purpose: str, size: int) -> dict:
        rec = {"id": fid, "object": "file", "bytes": size, "created_at": _now(), "filename": filename,
               "purpose": purpose, "status": "processed", "status_details": None}
        await self.records.write(self.files_dir / f"{fid}.json", rec)
        self._files[fid] = (rec["created_at"], purpose)
        return rec

    async def _page(self, folder: Path, keys: dict, after: str | None, desc: bool, limit: int,
                    gone: dict | None = None) -> tuple[list[dict], bool]:
        """One page of a listing: the records of ``keys`` (id -> created_at) sorted by (created_at, id), those
        after the id ``after`` (by its place in that order, so one deleted meanwhile still marks it: ``gone``),
        read from disk on a thread, at most ``limit``; and whether more follow."""
        order = sorted(((c, i) for i, c in keys.items()), reverse=desc)
        if after:
            c = keys.get(after, (gone or {}).get(after))
            if c is None:
                order = []                 # an id this server never listed
            else:
                mark = (c, after)
                order = [k for k in order if (k < mark if desc else k > mark)]
        page = order[:limit]

        def read() -> list[dict]:
            out = []
            for _, i in page:
                try:
                    rec = self.records.read(folder / f"{i}.json")
                except (OSError, orjson.JSONDecodeError):      # removed meanwhile
                    continue
                if rec is not None:
                    out.append(rec)
            return out
        return await asyncio.to_thread(read), len(order) > limit

    # ------------------------------------------------------------ /v1/files
    async def upload(self, request: web.Request) -> web.Response:
        if not (request.content_type or "").startswith("multipart/"):
            raise APIError(400, "upload a file as multipart/form-data with the fields purpose and file", param="file")
        purpose, fid, filename, size = None, "file-" + secrets.token_hex(12), None, 0
        data = self._data(fid)
        try:
            reader = await request.multipart()
            while (part := await body_read(request, reader.next())) is not None:
                if not isinstance(part, BodyPartReader):
                    raise APIError(400, "a nested multipart part is not a form field", param="file")
                if part.name == "purpose":
                    purpose = (await body_read(request, part.text())).strip()
                elif part.name == "file":
                    if filename is not None:
                        raise APIError(400, "one file part per upload", param="file")
                    filename = part.filename or "upload.jsonl"
                    filename.encode("utf-8")      # (a name that is not UTF-8: UnicodeEncodeError, a 400 below)
                    with open(data, "wb") as f:
                        while chunk := await body_read(request, part.read_chunk(1 << 20)):
                            size += len(chunk)
                            if size > self.max_file_bytes:
                                raise APIError(413, f"the file is larger than --max-file-bytes "
                                                    f"({self.max_file_bytes} bytes)", param="file")
                            # the disk as it is now, each chunk (uploads at once, running batches: a review's
                            # four uploads, each checked once at its start, went 3.4 MB past the floor)
                            if self._room() <= len(chunk):
                                raise self._no_room(self._room() + self.min_free_bytes)
                            f.write(chunk)
                    await self.records.run(_sync, data)          # its bytes on disk before its record
            if purpose != "batch":
                raise APIError(400, f"purpose must be 'batch' (the only files this server takes), got {purpose!r}",
                               param="purpose")
            if filename is None:
                raise APIError(400, "no file part in the upload", param="file")
            return json_response(await self._new_file(fid, filename, purpose, size))
        except (ValueError, LookupError) as e:   # not multipart/form-data after all, a field or name not UTF-8, an
            data.unlink(missing_ok=True)         # unknown charset
            raise APIError(400, f"the upload is not a valid multipart/form-data body: {e}", param="file") from None
        except BaseException:
            data.unlink(missing_ok=True)
            raise

    async def list_files(self, request: web.Request) -> web.Response:
        """As OpenAI's: ``purpose``, ``order`` (desc: newest first, or asc), ``limit`` (1-10,000, 10,000) and
        ``after`` (the id the page starts after); ``first_id``, ``last_id`` and ``has_more`` for the next page."""
        q = request.query
        purpose, order = q.get("purpose"), q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        try:
            limit = int(q.get("limit", 10000))
        except ValueError:
            raise APIError(400, "limit must be an integer", param="limit")
        if not 1 <= limit <= 10000:
            raise APIError(400, f"limit must be between 1 and 10000, got {limit}", param="limit")
        keys = {i: c for i, (c, p) in self._files.items() if purpose is None or p == purpose}
        page, more = await self._page(self.files_dir, keys, q.get("after"), order == "desc", limit, self._gone)
        return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": more})

    async def get_file(self, request: web.Request) -> web.Response:
        return json_response(self._file(request.match_info["file_id"]))

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        fid = request.match_info["file_id"]
        self._file(fid)
        path = self._data(fid)
        if "Range" in request.headers:         # a range it cannot serve: 416 in the OpenAI shape (aiohttp's is empty)
            size = path.stat().st_size if path.exists() else 0
            try:
                rng = request.http_range
                start = None if rng.start is None else max(0, rng.start + size) if rng.start < 0 else rng.start
            except ValueError:
                start = size
            if start is not None and start >= size:
                raise APIError(416, f"the Range {request.headers['Range']!r} is not within this file's {size} bytes",
                               type="invalid_request_error", param="Range", code="range_not_satisfiable",
                               headers={"Content-Range": f"bytes */{size}"})
        return web.FileResponse(path, headers={"Content-Type": "application/jsonl"})

    async def delete_file(self, request: web.Request) -> web.Response:
        fid = request.match_info["file_id"]
        rec = self._file(fid)
        # a running batch reads its input again when it resumes: its stored status says so, whether or not its task
        # runs now (a drain stops the tasks and leaves the batches running: a review deleted an input then)
        for bid in self.tasks:
            try:
                b = self._batch(bid)
            except APIError:
                continue
            if b.get("input_file_id") == fid and b["status"] in RUNNING:
                raise APIError(409, f"file {fid} is the input of batch {bid}, which is {b['status']}: cancel "
                                    f"the batch or let it end first", param="file_id", code="file_in_use",
                               type="invalid_request_error")
        self._files.pop(fid, None)
        await self.records.remove(self.files_dir / f"{fid}.json", self._data(fid))
        self._gone[fid] = rec["created_at"]
        return json_response({"id": fid, "object": "file", "deleted": True})

    # ------------------------------------------------------------ /v1/batches
    async def create(self, request: web.Request) -> web.Response:
        from common.http import read_body
        body = loads(await read_body(request))
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        fid, endpoint = body.get("input_file_id"), body.get("endpoint")
        if not isinstance(fid, str):
            raise APIError(400, "input_file_id must be a file id", param="input_file_id")
        if not isinstance(endpoint, str) or endpoint not in BATCH_URLS:
            raise APIError(400, f"endpoint must be one of {sorted(BATCH_URLS)}, got {endpoint!r}", param="endpoint")
        window = body.get("completion_window", "24h")
        if window != "24h":
            raise APIError(400, "completion_window must be '24h'", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise APIError(400, "metadata: at most 16 string keys (64 chars) and values (512 chars)",
                           param="metadata")
        f = self._file(fid)
        if f["purpose"] != "batch":
            raise APIError(400, f"file {fid} has purpose {f['purpose']!r}, not 'batch'", param="input_file_id")
        self._room()                      # (its answers need room: see _run_lines for a disk that fills meanwhile)
        now = _now()
        b = {"id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": endpoint, "errors": None,
             "input_file_id": fid, "completion_window": window, "status": "validating", "output_file_id": None,
             "error_file_id": None, "created_at": now, "in_progress_at": None, "expires_at": now + 86400,
             "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
             "cancelling_at": None, "cancelled_at": None,
             "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "model": None,
             "usage": None, "_seq": time.time_ns()}            # (its place among batches made in one second)
        saved = self._save_batch(b)
        # known before the write's end: a delete of its input meanwhile is refused (a review's succeeded, and the
        # batch failed); a client that leaves meanwhile leaves a batch listed and running, not only on disk
        self._batches[b["id"]] = now
        self.tasks[b["id"]] = asyncio.create_task(self._run(b["id"]), name=f"batch {b['id']}")
        await saved
        return json_response(public(b))

    async def get_batch(self, request: web.Request) -> web.Response:
        return json_response(public(self._shown(self._batch(request.match_info["batch_id"]))))

    async def list_batches(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", 20))
        except ValueError:
            raise APIError(400, "limit must be an integer", param="limit")
        if not 1 <= limit <= 100:         # (OpenAI's range; as /v1/files refuses its own)
            raise APIError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
        page, more = await self._page(self.batches_dir, self._batches, request.query.get("after"), True, limit)
        page = [public(self._shown(b)) for b in page]
        return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": more})

    async def cancel(self, request: web.Request) -> web.Response:
        b = self._shown(self._batch(request.match_info["batch_id"]))
        # (not once finalizing: its answers are all in, and the run's last write, which follows, would overwrite a
        # "cancelling" it never saw: a review's cancel was told "cancelling" and the batch then said "completed")
        bid = b["id"]
        if bid in self._ending:
            return json_response(public(b))        # its run is writing its end (failed, completed): as it is
        task = self.tasks.get(bid)
        idle = task is None or task.done() or bid not in self._started     # (decided before any await)
        if b["status"] in ("validating", "in_progress"):
            b["status"], b["cancelling_at"] = "cancelling", _now()
            self._cancel.add(bid)
            if not idle:
                await self._save_batch(b)          # its lanes stop; the run ends it "cancelled"
        if b["status"] == "cancelling" and idle:
            # nothing runs it now (a drain stopped it; it waits for a running place): cancelled now, with the
            # answers it has (they were orphaned; it stayed "cancelling" until a place came: reviews)
            if task is not None and not task.done():
                task.cancel()
            b["status"], b["cancelled_at"] = "cancelled", _now()
            await self._attach_results(b)
            await self._save_batch(b)
            self._note_gone(bid)
        return json_response(public(b))

    # ------------------------------------------------------------ running a batch
    async def _run(self, bid: str) -> None:
        try:
            async with self.running:          # (--max-running-batches: it waits, as it is, meanwhile)
                if self.state.draining or self._batch(bid)["status"] not in RUNNING:
                    return                    # resumed by the next balancer on this folder; (ended: cancelled)
                self._started.add(bid)
                await self._run_lines(bid)
        except asyncio.CancelledError:
            raise
        except Exception as e:           # a bug, or the disk: the batch must not stay "in_progress" for ever
            log.exception("batch %s failed", bid)
            full = isinstance(e, OSError) and e.errno == errno.ENOSPC
            await self._fail(bid, "insufficient_storage" if full else "server_error", f"{type(e).__name__}: {e}")
        finally:
            self._started.discard(bid)
            self._ending.discard(bid)

    async def _fail(self, bid: str, code: str, message: str) -> None:
        """The batch ends "failed" with ``errors`` saying why; what it answered stays in its files."""
        self._ending.add(bid)
        try:
            b = self._shown(self._batch(bid))
            b["status"], b["failed_at"] = "failed", _now()
            b["errors"] = {"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                       "line": None}]}
            await self._attach_results(b)
            await self._save_batch(b)
        except OSError:               # (the disk is full after all: its record stays as it was, resumed later)
            log.exception("batch %s: its failure could not be recorded", bid)
        finally:
            self.counts.pop(bid, None)
        self._note_gone(bid)

    def _note_gone(self, bid: str) -> None:
        """An ended batch's progress note goes (after its record: the same thread, in order; read as gone at
        once: a cancel right after a drain read the older note, a fresh clone's CI run found)."""
        self.records.remove(self._counts_path(bid))

    async def _attach_results(self, b: dict) -> None:
        """A batch ending early (failed, or cancelled while nothing runs it): its output and error files so far
        become files of its own (``output_file_id``, ``error_file_id``); an empty one is removed."""
        for key, kind in (("_output_file_id", "output"), ("_error_file_id", "error")):
            fid = b.get(key)
            path = self._data(fid) if fid else None
            if path is not None and path.exists() and path.stat().st_size:
                await self.records.run(_sync, path)
                await self._new_file(fid, f"{b['id']}_{kind}.jsonl", "batch_output", path.stat().st_size)
                b[key[1:]] = fid
            elif path is not None:
                path.unlink(missing_ok=True)

    def _read_lines(self, input_path: Path, out_path: Path, err_path: Path) -> tuple[int, set, dict]:
        """(On a thread: a file of hundreds of MiB takes seconds.) The batch's line count, the keys of the lines
        already answered finally by an earlier run (resuming: what is final stays in the result files, the rest is
        sent again) and the counts of those answers. The lines themselves are parsed as they are sent
        (:class:`_Lines`)."""
        done, counts = set(), {}
        for path, name in ((out_path, "completed"), (err_path, "failed")):
            kept = 0
            if path.exists():
                tmp = path.with_name(path.name + ".tmp")        # (a crash here keeps the old file whole)
                with open(path, "rb") as old, open(tmp, "wb") as new:      # a line at a time, never the whole file
                    for raw in old:
                        try:
                            obj = orjson.loads(raw)
                        except orjson.JSONDecodeError:
                            continue                            # (a line cut short by a crash: sent again)
                        if isinstance(obj, dict) and is_final(obj) and result_key(obj) is not None:
                            done.add(result_key(obj))
                            new.write(raw.rstrip(b"\n") + b"\n")
                            kept += 1
                _replace_durably(tmp, path)
            counts[name] = kept
        with open(input_path, "rb") as f:
            total = sum(1 for raw in f if raw.strip())
        return total, done, counts

    async def _run_lines(self, bid: str) -> None:
        b = self._batch(bid)
        # the result files' ids are kept for a restart; the API shows them once the batch has ended (as OpenAI's)
        out_id = b.get("_output_file_id") or b["output_file_id"] or "file-" + secrets.token_hex(12)
        err_id = b.get("_error_file_id") or b["error_file_id"] or "file-" + secrets.token_hex(12)
        out_path, err_path = self._data(out_id), self._data(err_id)
        total, done, counts = await asyncio.to_thread(self._read_lines, self._data(b["input_file_id"]), out_path,
                                                      err_path)
        b = self._batch(bid)
        b.update(status="in_progress" if b["status"] != "cancelling" else "cancelling",
                 in_progress_at=b["in_progress_at"] or _now(), _output_file_id=out_id, _error_file_id=err_id)
        b["request_counts"]["total"] = total
        self.counts[bid] = counts
        await self._save_batch(b)
        noted = [time.monotonic()]
        with open(out_path, "ab") as out, open(err_path, "ab") as err, \
                _Lines(self._data(b["input_file_id"]), b["endpoint"], done) as todo:
            def record(data: bytes, ok: bool) -> None:
                fh = out if ok else err
                fh.write(data)
                fh.flush()                    # (to the kernel; on disk at the batch's end, or by a later resume)
                counts["completed" if ok else "failed"] += 1
                if time.monotonic() - noted[0] > 0.5:
                    noted[0] = time.monotonic()
                    self._note_counts(bid, counts)
                # a disk that fills as it runs: it stops while --min-free-disk-bytes is left for its records (a
                # review's batches filled a small disk: their last records failed, they stayed in_progress)
                if shutil.disk_usage(self.files_dir).free < self.min_free_bytes:
                    self._full.add(bid)

            async def lane() -> None:         # --batch-concurrency of these take the lines in order
                while (line := await todo.next()) is not None:
                    if line.error is not None:
                        record(result_line(line.custom_id, error=line.error), False)
                        continue
                    if self._stopping(bid):
                        return
                    try:
                        async with self.slots:        # (its turn may come after a cancel or a drain)
                            if self._stopping(bid):
                                return
                            status, data = await self._answer(line, lambda: self._cancelling(bid))
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:    # (a bug) this line's error, not the batch's end
                        log.exception("batch %s line %d failed", bid, line.number)
                        status, data = 500, error_body(f"internal error: {type(e).__name__}: {e}", "server_error")
                    if status is None:        # stopping or cancelled: the line is left (for a restart)
                        return
                    record(result_line(line.custom_id, status, data), 200 <= status < 300)
            await asyncio.gather(*(lane() for _ in range(self.concurrency)))
        if not self.state.draining or self._cancelling(bid):
            self._ending.add(bid)         # (a cancel from now on is answered as the batch is: it ends as it is)
        await asyncio.gather(self.records.run(_sync, out_path), self.records.run(_sync, err_path))
        if bid in self._full and not self._cancelling(bid) and counts["completed"] + counts["failed"] < total:
            self._full.discard(bid)
            free = shutil.disk_usage(self.files_dir).free
            await self._fail(bid, "insufficient_storage", f"the disk of --files-dir filled up ({free / 2**20:,.0f} "
                             f"MiB free, --min-free-disk-bytes {self.min_free_bytes / 2**20:,.0f} MiB): stopped "
                             f"after {counts['completed'] + counts['failed']} answers, kept in its files")
            return
        self._full.discard(bid)
        if self.state.draining and not self._cancelling(bid):
            await self._save_batch(self._batch(bid))  # still in_progress: a balancer on the same --files-dir resumes it
            self.counts.pop(bid, None)
            self._note_gone(bid)          # (its record holds the counts now: an older note would show fewer)
            log.info("batch %s left in progress at shutdown: %s", bid, counts)
            return
        b = self._shown(self._batch(bid))
        if b["status"] == "cancelling":
            b["status"], b["cancelled_at"] = "cancelled", _now()
        else:
            b["status"], b["finalizing_at"] = "finalizing", _now()
            await self._save_batch(b)
            b["status"], b["completed_at"] = "completed", _now()
        for fid, path in ((out_id, out_path), (err_id, err_path)):     # as OpenAI's: no file where none is due
            if path.stat().st_size:
                await self._new_file(fid, f"{bid}_{'output' if fid == out_id else 'error'}.jsonl", "batch_output",
                                     path.stat().st_size)
            else:
                path.unlink(missing_ok=True)
        b["output_file_id"] = out_id if out_path.exists() else None
        b["error_file_id"] = err_id if err_path.exists() else None
        b["model"], b["usage"] = await asyncio.to_thread(_model_and_usage, out_path)
        await self._save_batch(b)
        self.counts.pop(bid, None)
        self._note_gone(bid)
        log.info("batch %s %s: %s", bid, b["status"], b["request_counts"])

    def _cancelling(self, bid: str) -> bool:
        return bid in self._cancel

    def _stopping(self, bid: str) -> bool:
        return bid in self._cancel or bid in self._full or self.state.draining

    async def _answer(self, line, cancelled) -> tuple[int | None, object]:
        """One line through the balancer's queue, as its door would take it: (status, body); a line the balancer
        cannot admit now (queue full, no healthy worker) waits and tries again; (None, None) when the balancer is
        shutting down or the batch is ``cancelled()`` meanwhile (the line is not answered)."""
        t0 = time.monotonic()
        body = orjson.dumps(line.body)
        try:
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            req = await parse(line.kind, body)       # (a line's body may be as large as a request's)
        except APIError as e:
            self.state.observe(ENDPOINTS[line.kind], e.status, time.monotonic() - t0)
            return e.status, e.body()
        state, delay = self.state, 0.1
        while True:
            try:
                p = state.admit(line.kind, body, False, time.monotonic(), version=req.model_version)
                break
            except APIError as e:
                if state.draining or cancelled():
                    return None, None
                if e.status not in (429, 503):
                    state.observe(ENDPOINTS[line.kind], e.status, time.monotonic() - t0)
                    return e.status, e.body()
                await asyncio.sleep(delay)
                delay = min(state.cfg.batch_retry_max, delay * 2)
        result = None
        try:
            async for _, event, status, data, end in p:
                if event in ("response", "error"):
                    result = (status, data)
                if end:
                    break
        finally:
            state.release(p)
        if result is None:
            result = (502, {"error": {"message": "no answer", "type": "server_error", "param": None, "code": None}})
        if not (result[0] == 499 or (state.draining and result[0] == 503) or cancelled()):
            state.observe(ENDPOINTS[line.kind], result[0], time.monotonic() - t0)   # (as the door counts a request)
        return result


def add_routes(app: web.Application, jobs: BatchJobs) -> None:
    app.router.add_post("/v1/files", jobs.upload)
    app.router.add_get("/v1/files", jobs.list_files)
    app.router.add_get("/v1/files/{file_id}", jobs.get_file)
    app.router.add_get("/v1/files/{file_id}/content", jobs.file_content)
    app.router.add_delete("/v1/files/{file_id}", jobs.delete_file)
    app.router.add_post("/v1/batches", jobs.create)
    app.router.add_get("/v1/batches", jobs.list_batches)
    app.router.add_get("/v1/batches/{batch_id}", jobs.get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", jobs.cancel)
