"""The remote PE backend: any OpenAI-compatible server (vLLM, SGLang, ``transformers serve``) via
``<base_url>/chat/completions``.

Connection errors, timeouts, 408, 429 (Retry-After honoured) and 5xx are retried with exponential backoff and
jitter; other 4xx fail at once; redirects are not followed. Each request is bounded (``bounded_http``): one deadline
of ``timeout_s`` for the whole answer, a size cap, Cancel within a fraction of a second. The API key obeys
``key_policy`` and is read from the environment at each request, never stored. Error texts quote no answer beyond
the server's own JSON error message, capped, and only from a server named in the environment
(``key_policy.trusted_server``): of any other host's answers, this machine's included, only the status is told. No
ComfyUI.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import random
import re
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from ... import bounded_json
from ...bounded_json import NestedTooDeeply
from ..protocol import Completion, EnhancerError, GenerationStopped, PromptSpec, ResultCallback, SamplingParams
from ..runtime import Runtime
from .bounded_http import Answer, HttpFailure, exchange
from .key_policy import bound_key, check_key_name, credential_id, trusted_server
from .url import parse_api_root

_CONNECT_TIMEOUT_S = 10.0  # or timeout_s when shorter: a server that is up accepts at once; timeout_s is for answers
_BACKOFF_BASE_S = 0.5
_BACKOFF_CAP_S = 30.0
_RETRY_AFTER_CAP_S = 120.0
_MESSAGE_CHARS = 200  # the most of a server's own error message an error text quotes
_UNQUOTED = ("its answer is not shown: only a server named in the environment, by its address in an "
             "ERNIE_PE_API_KEY_<NAME>_URL variable, is quoted")
_NOW_S = 120.0  # a listing's `created` this close to now is the time of the listing (vLLM, SGLang), not a revision


def _retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _retry_after(answer: Answer) -> float | None:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date), capped."""
    value = answer.headers.get("Retry-After")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), _RETRY_AFTER_CAP_S)


def server_message(body: bytes) -> str | None:
    """The server's own error message from a JSON error answer (OpenAI's ``{"error": {"message"}}``, vLLM's
    ``{"message"}``, FastAPI's ``{"detail"}``), on one line and capped; None for anything else, which is never quoted
    (a ``base_url`` aimed at another service must not read that service's pages back into ComfyUI)."""
    try:
        data = bounded_json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    nested = error.get("message") if isinstance(error, dict) else error
    for message in (nested, data.get("detail"), data.get("message")):
        if isinstance(message, str) and message.strip():
            message = re.sub(r"\s+", " ", message).strip()
            return message if len(message) <= _MESSAGE_CHARS else message[:_MESSAGE_CHARS - 1] + "…"
    return None


def _where(location: str, url: str) -> str:
    """A redirect's target, as scheme, host and port only."""
    try:
        parts = urlsplit(urljoin(url, location))
        return f"{parts.scheme}://{(parts.hostname or '')[:100]}" + (f":{parts.port}" if parts.port else "")
    except ValueError:
        return "an unreadable address"


@dataclass(frozen=True)
class ServedModel:
    """The model a server says it serves: its id and, where the server tells, what identifies its checkpoint."""

    id: str
    revision: str = ""


def served_model(entry: dict) -> ServedModel:
    """A ``/models`` entry as a ``ServedModel``: ``root`` and ``parent`` (vLLM, SGLang: the checkpoint's path or hub
    id), ``created`` unless it is just the time of the listing."""
    fields = {key: entry[key] for key in ("root", "parent") if entry.get(key) is not None}
    created = entry.get("created")
    if isinstance(created, int | float) and abs(created - time.time()) > _NOW_S:
        fields["created"] = created
    return ServedModel(str(entry["id"]), json.dumps(fields, sort_keys=True) if fields else "")


class RemotePromptEnhancer:
    """A PE served over HTTP. ``model`` empty: the first model the server lists at ``<base_url>/models``.

    Everything a workflow gives is checked when the handle is made, before any request: ``base_url`` (``url``) and
    ``api_key_env`` (``key_policy``)."""

    def __init__(
        self,
        base_url: str,
        model: str = "",
        api_key_env: str = "",
        timeout_s: float = 120.0,
        max_retries: int = 3,
        max_concurrency: int = 4,
        runtime: Runtime | None = None,
    ):
        self.root = parse_api_root(base_url)
        self.api_key_env = check_key_name(api_key_env)
        bound_key(self.api_key_env, self.root)  # a key that may not go to base_url is refused now, not sent later
        self.model = model.strip()
        self.timeout_s, self.max_retries, self.max_concurrency = timeout_s, max_retries, max_concurrency
        self.runtime = runtime or Runtime()
        self._served: ServedModel | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemotePromptEnhancer({self.root}, model={self.model or '<first listed>'})"

    @property
    def identity(self) -> str:
        """What produces the text: the API root, the model the server reports and, where it tells, its checkpoint;
        and with a key, whose key (``credential_id``), so that a run without it cannot read what a keyed run paid for.
        Asked again at each read: a server can swap its checkpoint between two runs."""
        with self._lock:
            self._served = self._ask_served_model()
            credential = credential_id(self.api_key_env)
            return (f"remote:{self.root}|{self._served.id}|{self._served.revision}"
                    + (f"|key:{credential}" if credential else ""))  # without a key: the identity of before

    def resolved_model(self) -> str:
        """The model to ask for: the given one, or the first listed by the server (asked once)."""
        if self.model:
            return self.model
        with self._lock:
            if self._served is None:
                self._served = self._ask_served_model()
            return self._served.id

    def _ask_served_model(self) -> ServedModel:
        url = self.root.url("models")
        with self._host_stop():
            answer = self._request("GET", "models", threading.Event(), tolerate=(404, 405) if self.model else ())
        if answer is None:  # a server without a model listing: the given name is all there is to know
            return ServedModel(self.model)
        try:
            entries = [entry for entry in self._decode(answer, url)["data"] if isinstance(entry["id"], str)]
        except (KeyError, TypeError) as error:
            raise EnhancerError(f"malformed answer from {url}: expected data[].id ({error!r} missing)") from error
        if not entries and not self.model:
            raise EnhancerError(f"{url} lists no models: give the model name in 'model'")
        chosen = [entry for entry in entries if entry["id"] == self.model] if self.model else entries[:1]
        return served_model(chosen[0]) if chosen else ServedModel(self.model)

    def enhance(
        self, specs: Sequence[PromptSpec], params: SamplingParams, on_result: ResultCallback | None = None
    ) -> list[Completion]:
        """One request per prompt, at most ``max_concurrency`` at a time, answers in order; ``on_result`` gets each
        text as its answer arrives."""
        model = self.resolved_model()
        # This call's stop: set by the first of its requests to see a stop request, so that none starts after it
        # (ComfyUI's flag is cleared once its interrupt is raised, and the other workers would not see it any more).
        stop = threading.Event()

        def one(index: int) -> Completion:
            completion = self._chat(specs[index], params, model, stop)
            if on_result is not None:
                on_result(index, completion)
            return completion

        with self._host_stop():
            if len(specs) <= 1:
                return [one(index) for index in range(len(specs))]
            pool = ThreadPoolExecutor(min(len(specs), self.max_concurrency), thread_name_prefix="ernie-pe")
            futures = [pool.submit(one, index) for index in range(len(specs))]
            wait(futures, return_when=FIRST_EXCEPTION)
            # The prompts not sent yet are dropped. After a stop, the answers in flight end within the watchdog's
            # poll and are not waited for; after a failure they are, so that their texts reach on_result (the
            # cache) before the error is raised and a rerun pays only for what failed.
            pool.shutdown(wait=not stop.is_set(), cancel_futures=True)
            if stop.is_set():
                raise GenerationStopped("the requests were interrupted")
            for future in futures:
                if not future.cancelled() and future.exception() is not None:
                    raise future.exception()
            return [future.result() for future in futures]

    @contextlib.contextmanager
    def _host_stop(self) -> Iterator[None]:
        """A stop seen by a request (in any worker) becomes the host's interrupt, raised once, in the calling thread."""
        try:
            yield
        except GenerationStopped:
            self.runtime.on_stopped()
            raise

    def _chat(self, spec: PromptSpec, params: SamplingParams, model: str, stop: threading.Event) -> Completion:
        url = self.root.url("chat/completions")
        body = {
            "model": model,
            "messages": spec.messages(),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
            "seed": params.seed,
            "stream": False,
        }
        data = self._decode(self._request("POST", "chat/completions", stop, body), url)
        try:
            choice = data["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError) as error:
            raise EnhancerError(f"malformed answer from {url}: no choices[0].message.content") from error
        if not isinstance(content, str) or not content.strip():
            reason = f" (finish_reason={str(choice.get('finish_reason'))[:40]!r})" if self._trusted() else ""
            raise EnhancerError(
                f"{url} returned an empty enhanced prompt{reason}; check that the server runs the ERNIE-Image prompt "
                "enhancer"
            )
        return Completion(content.strip(), truncated=choice.get("finish_reason") == "length")

    def _headers(self, payload: dict | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "comfyui-ernie-image"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        key = bound_key(self.api_key_env, self.root)  # read now, checked again: the environment may have changed
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _request(self, method: str, endpoint: str, stop: threading.Event, payload: dict | None = None,
                 tolerate: tuple[int, ...] = ()) -> Answer | None:
        """One call with retries; returns the successful answer (None for a status in ``tolerate``). Sets ``stop``
        when the host asks to stop."""
        url = self.root.url(endpoint)
        body = None if payload is None else json.dumps(payload, ensure_ascii=False).encode()
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            if stop.is_set() or self.runtime.should_stop():
                stop.set()
                raise GenerationStopped("the request was interrupted")
            pause = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)
            try:
                answer = exchange(method, url, self._headers(payload), body, self.timeout_s,
                                  min(_CONNECT_TIMEOUT_S, self.timeout_s),
                                  lambda: stop.is_set() or self.runtime.should_stop())
            except GenerationStopped:
                stop.set()
                raise
            except HttpFailure as error:
                if not error.retryable:
                    raise EnhancerError(str(error)) from None
                failure = str(error)
            else:
                if 200 <= answer.status < 300:
                    return answer
                if answer.status in tolerate:
                    return None
                self._refuse_final(answer, url)
                failure = f"{url} answered HTTP {answer.status}"
                pause = _retry_after(answer) or pause
            if attempt + 1 < attempts:
                self._sleep(pause, stop)
        raise EnhancerError(
            f"{failure}, after {attempts} attempt(s): check that the server is running and that base_url is right"
        )

    def _refuse_final(self, answer: Answer, url: str) -> None:
        """Raise for an answer that another attempt would not change: a redirect or a 4xx other than 408 and 429."""
        status = answer.status
        trusted = self._trusted()
        if 300 <= status < 400:
            target = f" to {_where(answer.headers.get('Location', ''), url)}" if trusted else ""
            raise EnhancerError(
                f"{url} answered HTTP {status}, a redirect{target}: redirects are not followed (the prompt and any "
                "key go only to base_url); set base_url to the server that answers"
            )
        if _retryable(status):
            return
        said = server_message(answer.body) if trusted else None
        unquoted = "" if trusted else f" ({_UNQUOTED})"
        if status in (401, 403):
            where = f"the key in ${self.api_key_env}" if self.api_key_env else "api_key_env (the server wants a key)"
            raise EnhancerError(f"{url} refused the request (HTTP {status}): check {where}"
                                + (f" (the server says: {said})" if said else unquoted))
        listed = self._served.id[:_MESSAGE_CHARS] if self._served and trusted else ""  # the listing is its words too
        model = self.model or listed
        check = (f"check base_url and the model name {model!r}" if model
                 else "check base_url, and give the model name in 'model'")
        raise EnhancerError(f"{url} answered HTTP {status}" + (f": {said}" if said else unquoted) + f" ({check})")

    def _trusted(self) -> bool:
        """Whether this server's own words may appear in an error (``key_policy.trusted_server``), asked now: the
        binding is read from the environment at each request."""
        return trusted_server(self.root)

    def _sleep(self, seconds: float, stop: threading.Event) -> None:
        """Wait between attempts, listening for a stop request."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if stop.is_set() or self.runtime.should_stop():
                return
            time.sleep(min(left, 0.1))

    def _decode(self, answer: Answer, url: str) -> dict:
        try:
            data = bounded_json.loads(answer.body)
        except ValueError as error:
            kind = (answer.headers.get("Content-Type") or "no content type").split(";")[0].strip()[:60]
            kind = f"{kind}, " if self._trusted() else ""  # the header is the server's words too
            what = str(error) if isinstance(error, NestedTooDeeply) else "not JSON"
            raise EnhancerError(f"malformed answer from {url}: {what} ({kind}{len(answer.body)} bytes)") from error
        if not isinstance(data, dict):
            raise EnhancerError(f"malformed answer from {url}: expected a JSON object, got {type(data).__name__}")
        return data
