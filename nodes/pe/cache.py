"""The result cache: enhanced prompts in memory and in an SQLite file, keyed by the backend's identity, the prompt, the
image size, the sampling parameters and the seed. Bounded; a corrupt file is set aside and rebuilt, a busy one (locked
by another process) is passed over for the moment; never a crash.

The file is private to its user (the folder 0700, the file and SQLite's journals 0600, also made so when they exist
with wider modes): it holds the user's prompts and texts an API key paid for."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from .protocol import Completion, EnhancerError, PromptEnhancer, PromptSpec, SamplingParams

_SCHEMA = "CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, text TEXT NOT NULL, truncated INTEGER NOT NULL, "
_SCHEMA += "used REAL NOT NULL)"
CACHE_MODES = ("use", "refresh", "off")
_BUSY_TIMEOUT_S = 5.0  # how long a statement waits for another process's lock on the file
# SQLite's result codes (extended ones start with these) for a sound file that cannot be used at the moment.
_PASSING_ERRORS = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_READONLY", "SQLITE_FULL", "SQLITE_IOERR", "SQLITE_CANTOPEN")


def cache_key(identity: str, spec: PromptSpec, params: SamplingParams) -> str:
    """Everything the text depends on, hashed."""
    fields = [identity, spec.prompt, spec.width, spec.height, params.temperature, params.top_p,
              params.max_new_tokens, params.seed]
    return hashlib.sha256(json.dumps(fields, ensure_ascii=False).encode()).hexdigest()


class ResultCache:
    """An LRU in memory in front of an SQLite file (``path`` None: memory only). Thread-safe. ``former``: where an
    earlier version kept the file; it is moved to ``path`` when ``path`` does not exist yet."""

    def __init__(self, path: Path | None, max_entries: int = 20_000, memory_entries: int = 512,
                 former: Path | None = None):
        self.path, self.max_entries, self.memory_entries = path, max_entries, memory_entries
        self.former = former
        self._memory: OrderedDict[str, Completion] = OrderedDict()
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._warned_busy = False

    def get(self, key: str) -> Completion | None:
        with self._lock:
            if key in self._memory:
                self._memory.move_to_end(key)
                return self._memory[key]
            row = self._query("SELECT text, truncated FROM results WHERE key = ?", (key,))
            if row is None:
                return None
            self._query("UPDATE results SET used = ? WHERE key = ?", (time.time(), key))
            completion = Completion(row[0], bool(row[1]))
            self._remember(key, completion)
            return completion

    def put(self, key: str, completion: Completion) -> None:
        with self._lock:
            self._remember(key, completion)
            self._query("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?)",
                        (key, completion.text, int(completion.truncated), time.time()))
            count = self._query("SELECT COUNT(*) FROM results")
            if count is not None and count[0] > self.max_entries:
                self._query("DELETE FROM results WHERE key IN (SELECT key FROM results ORDER BY used LIMIT ?)",
                            (count[0] - self.max_entries,))

    def _remember(self, key: str, completion: Completion) -> None:
        self._memory[key] = completion
        self._memory.move_to_end(key)
        while len(self._memory) > self.memory_entries:
            self._memory.popitem(last=False)

    def _query(self, sql: str, args: tuple = ()) -> tuple | None:
        """Run one statement on the file; a corrupt file is set aside and rebuilt, an unusable one is skipped."""
        for attempt in range(2):
            try:
                db = self._connect()
                if db is None:
                    return None
                with db:
                    return db.execute(sql, args).fetchone()
            except sqlite3.DatabaseError as error:
                if (getattr(error, "sqlite_errorname", None) or "").startswith(_PASSING_ERRORS):
                    # Locked by another ComfyUI sharing the user directory, read-only, disk full: the file and its
                    # results are sound, only this statement cannot use it now (memory keeps the result).
                    self._skip(error)
                    return None
                self._set_aside(error, final=attempt == 1)  # not a database, malformed, another table layout
        return None

    def _connect(self) -> sqlite3.Connection | None:
        if self._db is None and self.path is not None:
            try:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                if self.former is not None and self.former.is_file() and not self.path.exists():
                    self.former.replace(self.path)  # its texts stay cached; the old place may be served (/userdata)
                _make_private(self.path)
            except OSError as error:
                logging.warning("ERNIE-Image PE cache: cannot use %s (%s); caching in memory only", self.path, error)
                self.path = None
                return None
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=_BUSY_TIMEOUT_S)
            self._db.execute(_SCHEMA)
        return self._db

    def _skip(self, error: sqlite3.DatabaseError) -> None:
        if not self._warned_busy:
            self._warned_busy = True
            logging.warning("ERNIE-Image PE cache: %s is in use or not writable (%s); results it cannot take stay in "
                            "memory (said once)", self.path, error)

    def _set_aside(self, error: Exception, final: bool) -> None:
        """Move the bad file out of the way (kept for inspection) so that the next use starts a new one."""
        if self._db is not None:
            self._db.close()
            self._db = None
        if final:
            logging.warning("ERNIE-Image PE cache: %s still fails (%s); caching in memory only", self.path, error)
            self.path = None
            return
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        logging.warning("ERNIE-Image PE cache: %s is unreadable (%s); moved to %s, starting a new one", self.path,
                        error, aside.name)
        try:
            self.path.replace(aside)
        except OSError:
            pass  # the retry fails the same way and falls back to memory


def _make_private(path: Path) -> None:
    """``path``'s folder and the file (created if missing) and its SQLite journals readable by their owner only: no
    bits for the group and others, the owner's own kept (a file the user made read-only stays read-only)."""
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))  # created private, not at the umask's mode
    for target in (path.parent, path, *(path.with_name(path.name + end) for end in ("-journal", "-wal", "-shm"))):
        if target.exists():
            mode = target.stat().st_mode & 0o777
            if mode & 0o077:
                os.chmod(target, mode & 0o700)


def enhance_cached(
    enhancer: PromptEnhancer, specs: Sequence[PromptSpec], params: SamplingParams, cache: ResultCache,
    mode: str = "use",
) -> list[Completion]:
    """Enhance ``specs`` in order, each distinct prompt once. ``mode`` (``CACHE_MODES``): ``use`` asks the backend
    only for prompts not cached and stores what it gets; ``refresh`` asks for all and replaces what was stored;
    ``off`` asks for all and neither reads nor stores (nor asks the backend for its identity)."""
    if mode not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}, got {mode!r}")
    identity = enhancer.identity if mode != "off" else ""
    keys = [cache_key(identity, spec, params) for spec in specs]
    found = {key: cache.get(key) if mode == "use" else None for key in dict.fromkeys(keys)}
    missing = [key for key, completion in found.items() if completion is None]
    spec_of = dict(zip(keys, specs, strict=True))

    def keep(index: int, completion: Completion) -> None:
        # Each text is stored as it comes: a prompt of the batch that fails then loses none of the others.
        key = missing[index]
        if not completion.text:
            raise EnhancerError(f"the prompt enhancer returned no text for {spec_of[key].prompt[:60]!r}")
        if mode != "off":
            cache.put(key, completion)

    fresh = enhancer.enhance([spec_of[key] for key in missing], params, keep) if missing else []
    found.update(zip(missing, fresh, strict=True))
    for completion in found.values():  # a cut text from the cache is as cut as a fresh one
        if completion.truncated:
            logging.warning("ERNIE-Image PE: the enhanced prompt was cut at max_new_tokens=%d; raise it for the "
                            "full text", params.max_new_tokens)
    return [found[key] for key in keys]
