"""The remote PE backend: any OpenAI-compatible server (vLLM, SGLang, ``transformers serve``) via
``/v1/chat/completions``.

Connection errors, timeouts, 408, 429 (Retry-After honoured) and 5xx are retried with exponential backoff and
jitter; other 4xx fail at once. Answers are validated. The API key is read from the environment variable named by
``api_key_env`` at each request and never stored. No ComfyUI.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import random
import re
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import requests
from urllib3.exceptions import ReadTimeoutError

from .protocol import Completion, EnhancerError, GenerationStopped, PromptSpec, ResultCallback, SamplingParams
from .runtime import Runtime

_CONNECT_TIMEOUT_S = 10.0  # or timeout_s when shorter: a server that is up accepts at once; timeout_s is for answers
_BACKOFF_BASE_S = 0.5
_BACKOFF_CAP_S = 30.0
_RETRY_AFTER_CAP_S = 120.0
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _retry_after(response: requests.Response) -> float | None:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date), capped."""
    value = response.headers.get("Retry-After")
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


def _connection_failure(url: str, error: requests.RequestException, timeout_s: float) -> str:
    # A body that stalls after the headers comes as a ConnectionError wrapping urllib3's read timeout.
    if error.args and isinstance(error.args[0], ReadTimeoutError):
        return f"{url} timed out mid-answer (no data for timeout_s={timeout_s:g} s)"
    # requests reports a connection dropped after the headers (a server crash, a proxy reset) as a
    # ChunkedEncodingError, not a ConnectionError; it is as transient as one.
    if isinstance(error, requests.exceptions.ChunkedEncodingError):
        return f"{url} dropped the connection mid-answer"
    reason = "connection refused" if "refused" in str(error).lower() else "connection failed"
    return f"cannot reach {url} ({reason})"


class RemotePromptEnhancer:
    """A PE served over HTTP. ``model`` empty: the first model the server lists at ``/v1/models``."""

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
        base_url = base_url.strip().rstrip("/")
        if not re.match(r"https?://", base_url):
            raise EnhancerError(f"base_url must start with http:// or https://, got {base_url!r}")
        try:
            # requests parses the URL only when it sends, and then raises its own InvalidURL: check it here instead
            requests.Request("GET", base_url).prepare()
        except requests.exceptions.InvalidURL as error:
            raise EnhancerError(
                f"base_url {base_url!r} is not a valid URL ({error}): write the server's host and a port from 1 to "
                "65535, e.g. http://127.0.0.1:8000"
            ) from error
        api_key_env = api_key_env.strip()
        if api_key_env and not _ENV_NAME.fullmatch(api_key_env):
            raise EnhancerError(
                "api_key_env takes the NAME of an environment variable that holds the key (letters, digits and _), "
                "not the key itself: remove the key from the workflow and set it in the environment"
            )
        self.base_url = base_url.removesuffix("/v1")
        self.model, self.api_key_env = model.strip(), api_key_env
        self.timeout_s, self.max_retries, self.max_concurrency = timeout_s, max_retries, max_concurrency
        self.runtime = runtime or Runtime()
        self._resolved_model: str | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemotePromptEnhancer({self.base_url}, model={self.model or '<first listed>'})"

    @property
    def identity(self) -> str:
        return f"remote:{self.base_url}|{self.resolved_model()}"

    def resolved_model(self) -> str:
        """The model to ask for: the given one, or the first listed by the server (asked once)."""
        with self._lock:
            if self._resolved_model is None:
                self._resolved_model = self.model or self._discover_model()
            return self._resolved_model

    def _discover_model(self) -> str:
        url = f"{self.base_url}/v1/models"
        with self._host_stop():
            data = self._request("GET", url, threading.Event())
        try:
            ids = [entry["id"] for entry in data["data"]]
        except (KeyError, TypeError) as error:
            raise EnhancerError(f"malformed answer from {url}: expected data[].id ({error!r} missing)") from error
        if not ids:
            raise EnhancerError(f"{url} lists no models: give the model name in 'model'")
        return ids[0]

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
            # The prompts not sent yet are dropped. After a stop, the answers in flight are not waited for; after a
            # failure they are, so that their texts reach on_result (the cache) before the error is raised and a
            # rerun pays only for what failed.
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
        url = f"{self.base_url}/v1/chat/completions"
        body = {
            "model": model,
            "messages": spec.messages(),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
            "seed": params.seed,
            "stream": False,
        }
        data = self._request("POST", url, stop, json=body)
        try:
            choice = data["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError) as error:
            raise EnhancerError(f"malformed answer from {url}: no choices[0].message.content") from error
        if not isinstance(content, str) or not content.strip():
            raise EnhancerError(
                f"{url} returned an empty enhanced prompt (finish_reason={choice.get('finish_reason')!r}); "
                "check that the server runs the ERNIE-Image prompt enhancer"
            )
        return Completion(content.strip(), truncated=choice.get("finish_reason") == "length")

    def _headers(self) -> dict[str, str]:
        if not self.api_key_env:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise EnhancerError(
                f"the environment variable {self.api_key_env} (api_key_env) is not set: set it to the server's API "
                "key in the environment ComfyUI starts from"
            )
        return {"Authorization": f"Bearer {key}"}

    def _request(self, method: str, url: str, stop: threading.Event, **kwargs) -> dict:
        """One call with retries; returns the decoded JSON object. Sets ``stop`` when the host asks to stop."""
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            if stop.is_set() or self.runtime.should_stop():
                stop.set()
                raise GenerationStopped("the request was interrupted")
            pause = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)
            connect_s = min(_CONNECT_TIMEOUT_S, self.timeout_s)
            try:
                response = requests.request(method, url, headers=self._headers(), timeout=(connect_s, self.timeout_s),
                                            **kwargs)
            except requests.ConnectTimeout:
                failure = f"no connection to {url} within {connect_s:g} s"
            except requests.Timeout:
                failure = f"no answer from {url} within timeout_s={self.timeout_s:g} s"
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as error:
                failure = _connection_failure(url, error, self.timeout_s)
            else:
                if response.ok:
                    return self._decode(response, url)
                if not _retryable(response.status_code):
                    raise EnhancerError(self._refusal(response, url))
                failure = f"{url} answered HTTP {response.status_code}"
                pause = _retry_after(response) or pause
            if attempt + 1 < attempts:
                self._sleep(pause, stop)
        raise EnhancerError(
            f"{failure}, after {attempts} attempt(s): check that the server is running and that base_url is right"
        )

    def _sleep(self, seconds: float, stop: threading.Event) -> None:
        """Wait between attempts, listening for a stop request."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if stop.is_set() or self.runtime.should_stop():
                return
            time.sleep(min(left, 0.1))

    @staticmethod
    def _decode(response: requests.Response, url: str) -> dict:
        try:
            data = response.json()
        except ValueError as error:
            raise EnhancerError(f"malformed answer from {url}: not JSON ({response.text[:120]!r})") from error
        if not isinstance(data, dict):
            raise EnhancerError(f"malformed answer from {url}: expected a JSON object, got {type(data).__name__}")
        return data

    def _refusal(self, response: requests.Response, url: str) -> str:
        status, detail = response.status_code, response.text[:300]
        if status in (401, 403):
            where = f"the key in ${self.api_key_env}" if self.api_key_env else "api_key_env (the server wants a key)"
            return f"{url} refused the request (HTTP {status}): check {where}"
        model = self._resolved_model or self.model
        return f"{url} answered HTTP {status}: {detail} (check base_url and the model name {model!r})"
