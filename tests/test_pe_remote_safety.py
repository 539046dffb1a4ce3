"""The remote PE is safe with any shared workflow and bounded in time and memory (issue 14): the key policy, base_url
as an API root, redirects, error texts, one deadline per request, the answer's size cap and Cancel mid-answer.

The policy is tested against the real ``transformers serve`` behind a recording proxy (what reached the server, with
which headers); misbehaving servers (redirects, trickles, huge answers) are the fault server's, named as such."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
import tracemalloc

import comfy.model_management as mm
import pytest
import requests

from comfyui_ernie_image.nodes.pe.cache import ResultCache, cache_key, enhance_cached
from comfyui_ernie_image.nodes.pe.comfy_runtime import ComfyRuntime
from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePERemote
from comfyui_ernie_image.nodes.pe.protocol import EnhancerError, PromptSpec, SamplingParams, chat_messages
from comfyui_ernie_image.nodes.pe.remote.enhancer import RemotePromptEnhancer
from helpers.pe_servers import (
    FaultServer,
    ForwardProxy,
    RecordingProxy,
    Reply,
    chat_reply,
    key_not_sent,
    models_reply,
    name_in_environment,
    remote,
)
from scripts.comfy_headless import free_port

PROMPT = [PromptSpec("a big dog on a red mat", 848, 1264)]
SAMPLED = SamplingParams(temperature=0.6, top_p=0.8, max_new_tokens=20, seed=3)
KEY, SECRET = "ERNIE_PE_API_KEY_SAFETY", "sk-safety-0123456789"
TRICKLE = Reply(size=200, piece=1, pace=0.05)  # one byte every 50 ms: 10 s for the whole answer
# The one refusal for a key that is unset, has no _URL or is bound elsewhere (issue 24): it names no bound server.
NOT_SENT = key_not_sent(KEY)


@pytest.fixture
def proxies(pe_server):
    """Two origins in front of the same real server: the one a key is set for, and another."""
    with RecordingProxy(pe_server) as mine, RecordingProxy(pe_server) as other:
        yield mine, other


@pytest.fixture
def other_host():
    with FaultServer() as server:
        yield server


def remote_node(base_url: str, api_key_env: str = "") -> RemotePromptEnhancer:
    """The handle the workflow's remote PE node makes."""
    return ErnieImagePERemote.execute(base_url, "", api_key_env, 60.0, 0).result[0]


# --- the key policy, against the real server --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "HF_TOKEN", "ERNIE_PE_API_KEYS",
                                  "ernie_pe_api_key", "MY_ERNIE_PE_API_KEY"])
def test_a_workflow_naming_a_non_permitted_variable_is_refused_before_any_request(proxies, monkeypatch, name):
    mine, _ = proxies
    monkeypatch.setenv(name, "a-secret-of-another-service")
    monkeypatch.setenv(name + "_URL", mine.url)  # even bound to the right host: the name itself is refused
    with pytest.raises(EnhancerError) as error:
        remote_node(mine.url, name).enhance(PROMPT, SAMPLED)
    shown = name if name.isupper() else "this value"
    assert str(error.value).startswith(
        f"api_key_env {shown} is refused: api_key_env may name only ERNIE_PE_API_KEY or ERNIE_PE_API_KEY_<NAME> "
        "(capitals, digits and _), and the key is sent only to the server whose address is in the variable of the "
        "same name ending in _URL. Workflows are shared")
    assert "Fix: set ERNIE_PE_API_KEY_<NAME>=<your key> and ERNIE_PE_API_KEY_<NAME>_URL=<your server's address>" in (
        str(error.value))
    assert "a-secret" not in str(error.value)
    assert mine.received == []


def test_a_url_variable_is_not_a_key_name(proxies, monkeypatch):
    mine, _ = proxies
    monkeypatch.setenv(f"{KEY}_URL", mine.url)
    with pytest.raises(EnhancerError, match=f"api_key_env {KEY}_URL is refused"):
        remote_node(mine.url, f"{KEY}_URL")
    assert mine.received == []


def test_a_key_is_sent_only_to_the_host_it_is_bound_to(proxies, monkeypatch):
    mine, other = proxies
    monkeypatch.setenv(KEY, SECRET)
    monkeypatch.setenv(f"{KEY}_URL", f"{mine.url}/v1")
    (completion,) = remote_node(mine.url, KEY).enhance(PROMPT, SAMPLED)
    assert completion.text
    assert {r.headers["Authorization"] for r in mine.received} == {f"Bearer {SECRET}"}

    with pytest.raises(EnhancerError) as error:  # a workflow aiming the same variable at another host
        remote_node(other.url, KEY)
    assert str(error.value) == NOT_SENT
    assert mine.url not in str(error.value)  # the bound server is not told to the workflow (issue 24)
    assert other.received == []


def test_a_key_rebound_after_the_handle_was_made_is_not_sent(proxies, monkeypatch):
    """The binding is read again at each request: a handle made while the key was bound to its host stops sending
    it when the user binds the key elsewhere."""
    mine, _ = proxies
    monkeypatch.setenv(KEY, SECRET)
    monkeypatch.setenv(f"{KEY}_URL", mine.url)
    pe = remote_node(mine.url, KEY)
    monkeypatch.setenv(f"{KEY}_URL", "https://pe.example.com")
    with pytest.raises(EnhancerError) as error:
        pe.enhance(PROMPT, SAMPLED)
    assert str(error.value) == NOT_SENT and "pe.example.com" not in str(error.value)
    assert mine.received == []


def test_a_key_without_its_url_variable_is_not_sent(proxies, monkeypatch):
    mine, _ = proxies
    monkeypatch.setenv(KEY, SECRET)
    monkeypatch.delenv(f"{KEY}_URL", raising=False)
    with pytest.raises(EnhancerError) as error:
        remote_node(mine.url, KEY)
    assert str(error.value) == NOT_SENT  # the words of an unset or misbound key: set and unset are not told apart
    assert mine.url not in str(error.value)  # never a suggestion to bind the key to the workflow's host
    assert mine.received == []


def test_a_bad_url_variable_is_named(monkeypatch):
    monkeypatch.setenv(KEY, SECRET)
    monkeypatch.setenv(f"{KEY}_URL", "pe.example.com")
    with pytest.raises(EnhancerError, match=f"{KEY}_URL must start with http:// or https://, got 'pe.example.com'"):
        remote("https://pe.example.com", api_key_env=KEY)


# --- base_url is an API root ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("suffix", "words"), [
    ("/v1/models?x=http://10.0.0.1/admin", r"must not carry a query or fragment \('\?…' or '#…'\): it is an API "
                                           r"root, the server's address and an optional path prefix only"),
    ("/v1#models", r"must not carry a query or fragment"),
    ("/v1/chat/completions", r"base_url ends with /chat/completions: give the API root, the part before it \(/v1\)"),
    ("/admin/%2e%2e/v1", r"base_url's path '/admin/%2e%2e/v1' is not an API prefix: only letters, digits and \. _ ~ "
                         r"- between slashes, such as /v1 or /llm/lmapi/v3"),
    ("/a/../v1", r"base_url's path '/a/../v1' is not an API prefix"),
])
def test_a_base_url_with_a_query_or_more_than_a_root_is_refused(proxies, suffix, words):
    mine, _ = proxies
    with pytest.raises(EnhancerError, match=words):
        remote_node(mine.url + suffix)
    assert mine.received == []


@pytest.mark.parametrize(("url", "reason"), [
    ("http://[::1", r"Invalid IPv6 URL"),
    ("http://[::g]:8000", r"'::g' (is not an IPv6 address|does not appear to be an IPv4 or IPv6 address)"),  # Python
    ("http://pe-server:0", r"port 0"),
    ("http://pe-server\t:8000", r"a space or control character"),  # urlsplit would drop it silently
    ("http://pe-server\n:8000/v1", r"a space or control character"),
    ("http://-pe-", r"'-pe-' is not a host name"),
])
def test_a_base_url_that_is_not_a_plain_address_is_refused(url, reason):
    with pytest.raises(EnhancerError) as error:
        remote(url)
    assert re.fullmatch(rf"base_url {re.escape(repr(url))} is not a valid URL \({reason}\): write the server's host "
                        r"and a port from 1 to 65535, e.g. http://127\.0\.0\.1:8000", str(error.value))


def test_a_base_url_with_a_user_and_password_is_refused(proxies):
    mine, _ = proxies
    with pytest.raises(EnhancerError) as error:
        remote_node(mine.url.replace("http://", "http://me:hunter2@"))
    assert str(error.value) == ("base_url must not carry a user name or password ('…@'): workflows are saved and "
                                "shared; give a key through api_key_env instead")
    assert "hunter2" not in str(error.value) and mine.received == []


def test_an_api_root_with_a_path_prefix_reaches_the_server(pe_server):
    """An API gateway's root (``/llm/lmapi/v3``, as Baidu AI Studio's): requests go to ``<root>/models`` and
    ``<root>/chat/completions``, exactly as the OpenAI client sends them."""
    with RecordingProxy(pe_server, prefix="/llm/lmapi/v3") as gateway:
        pe = remote_node(f"{gateway.url}/llm/lmapi/v3/")
        (completion,) = pe.enhance(PROMPT, SAMPLED)
    assert [r.path for r in gateway.received] == ["/llm/lmapi/v3/models", "/llm/lmapi/v3/chat/completions"]
    direct = requests.post(f"{pe_server}/v1/chat/completions", timeout=60, json={
        "model": pe.resolved_model(), "messages": chat_messages("a big dog on a red mat", 848, 1264),
        "temperature": 0.6, "top_p": 0.8, "max_tokens": 20, "seed": 3}).json()["choices"][0]["message"]["content"]
    assert completion.text == direct.strip()


def test_an_unknown_host_is_named():
    with pytest.raises(EnhancerError, match=r"cannot reach http://pe-server.invalid:8000/v1/chat/completions \(host "
                                            r"not found\), after 1 attempt\(s\)"):
        remote("http://pe-server.invalid:8000", model="pe", max_retries=0).enhance(PROMPT, SAMPLED)


def test_a_connection_closed_before_any_answer_is_retried_and_named_fault_server():
    """A fault server of one line: it accepts each connection and closes it at once."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"

        def close_each(count: int) -> None:
            for _ in range(count):
                listener.accept()[0].close()

        threading.Thread(target=close_each, args=(2,), daemon=True).start()
        with pytest.raises(EnhancerError, match=rf"^cannot reach {url}/v1/chat/completions \(connection failed\), "
                                                r"after 2 attempt\(s\)"):
            remote(url, model="pe", max_retries=1).enhance(PROMPT, SAMPLED)


# --- redirects and error texts (fault server) -------------------------------------------------------------------


def test_a_redirect_to_another_host_is_not_followed_fault_server(fault, other_host, monkeypatch):
    monkeypatch.setenv(KEY, SECRET)
    monkeypatch.setenv(f"{KEY}_URL", fault.url)
    fault.default = Reply(307, {}, headers={"Location": f"{other_host.url}/v1/chat/completions?stolen=1"})
    with pytest.raises(EnhancerError) as error:
        remote(fault.url, model="pe", api_key_env=KEY, max_retries=3).enhance(PROMPT, SAMPLED)
    assert str(error.value) == (
        f"{fault.url}/v1/chat/completions answered HTTP 307, a redirect to {other_host.url}: redirects are not "
        "followed (the prompt and any key go only to base_url); set base_url to the server that answers")
    assert len(fault.chats) == 1  # not retried
    assert other_host.received == []


def test_a_redirect_to_the_same_host_is_not_followed_either_fault_server(fault, monkeypatch):
    name_in_environment(monkeypatch, fault.url)  # the target is its words: told only of a server named there
    fault.default = Reply(301, {}, headers={"Location": "/other/v1/chat/completions"})
    with pytest.raises(EnhancerError, match=rf"answered HTTP 301, a redirect to {fault.url}: redirects are not"):
        remote(fault.url, model="pe").enhance(PROMPT, SAMPLED)
    assert [r.path for r in fault.received] == ["/v1/chat/completions"]


LONG = "the model is busy; " * 30


@pytest.mark.parametrize(("body", "quoted"), [
    ({"error": {"message": "The model `pe` does not exist.", "type": "NotFoundError"}}, ": The model `pe` does not "
                                                                                       "exist. (check"),
    ({"object": "error", "message": "max_tokens is too large", "code": 400}, ": max_tokens is too large (check"),
    ({"detail": "Not Found"}, ": Not Found (check"),
    ({"error": "quota\nexceeded"}, ": quota exceeded (check"),
    ({"error": {"message": LONG}}, ": " + " ".join(LONG.split())[:199] + "… (check"),
    ("<html><body>router admin page: wifi password hunter2</body></html>", " (check"),
    ({"data": ["a", "b"]}, " (check"),
])
def test_an_error_quotes_only_the_servers_own_json_message_capped_fault_server(fault, body, quoted, monkeypatch):
    name_in_environment(monkeypatch, fault.url)
    fault.default = Reply(400, body)
    with pytest.raises(EnhancerError) as error:
        remote(fault.url, model="pe").enhance(PROMPT, SAMPLED)
    assert str(error.value) == (f"{fault.url}/v1/chat/completions answered HTTP 400{quoted} base_url and the model "
                                "name 'pe')")


# --- one deadline, a size cap, Cancel (fault server) ---------------------------------------------------------------


def test_a_trickling_server_ends_within_timeout_s_plus_1_s_fault_server(fault):
    fault.default = TRICKLE
    started = time.monotonic()
    with pytest.raises(EnhancerError, match=rf"^{fault.url}/v1/chat/completions did not finish its answer within "
                                            r"timeout_s=2 s \(the limit covers connecting and the whole answer\), "
                                            r"after 1 attempt\(s\): check that the server is running"):
        remote(fault.url, model="pe", timeout_s=2, max_retries=0).enhance(PROMPT, SAMPLED)
    assert time.monotonic() - started <= 3.0
    assert 10 < fault.bytes_sent < 100  # it was sending, byte by byte, all along


def test_a_server_holding_its_answer_back_ends_within_timeout_s_plus_1_s_fault_server(fault):
    """A server that holds the answer back (sleeps before its headers) ends the same way, as no answer."""
    fault.default = chat_reply("too late", delay=30)
    started = time.monotonic()
    with pytest.raises(EnhancerError, match=r"no answer from .* within timeout_s=1.5 s, after 1 attempt"):
        remote(fault.url, model="pe", timeout_s=1.5, max_retries=0).enhance(PROMPT, SAMPLED)
    assert time.monotonic() - started <= 2.5


@pytest.mark.parametrize("announce", [True, False], ids=["with-content-length", "until-close"])
def test_a_50_mb_answer_is_refused_without_being_held_fault_server(fault, announce):
    fault.default = Reply(size=50 * 2**20, announce=announce)
    tracemalloc.start()
    try:
        with pytest.raises(EnhancerError) as error:
            remote(fault.url, model="pe", max_retries=3).enhance(PROMPT, SAMPLED)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(error.value) == (f"{fault.url}/v1/chat/completions sent an answer larger than 8 MiB, refused (a "
                                "prompt enhancer answers in a few KiB): check that base_url is the enhancer's server")
    assert peak < 12 * 2**20  # the cap and one piece at most, never 50 MB
    assert len(fault.chats) == 1  # not retried
    time.sleep(0.5)
    assert fault.bytes_sent < 24 * 2**20  # the client stopped reading (what is left are socket buffers)


def test_cancel_mid_answer_returns_within_1_s_and_no_request_starts_after_it_fault_server(fault):
    fault.default = TRICKLE
    pe = RemotePromptEnhancer(fault.url, model="pe", max_retries=3, max_concurrency=2, runtime=ComfyRuntime())
    pressed = []

    def cancel() -> None:
        pressed.append(time.monotonic())
        mm.interrupt_current_processing(True)

    threading.Timer(1.0, cancel).start()  # the user clicks Cancel while two answers trickle in
    try:
        with pytest.raises(mm.InterruptProcessingException):
            pe.enhance([PromptSpec(f"prompt {i}") for i in range(8)], SAMPLED)
        returned = time.monotonic()
        assert not mm.processing_interrupted()  # raised once, ComfyUI's way
    finally:
        mm.interrupt_current_processing(False)
    assert returned - pressed[0] < 1.0
    sent = fault.bytes_sent
    time.sleep(1.5)
    assert len(fault.chats) == 2  # the two in flight; none after the Cancel
    assert fault.bytes_sent - sent <= 4  # and both stopped reading (a byte or two more each, then a broken pipe)


def test_cancel_mid_answer_of_a_single_prompt_fault_server(fault):
    fault.default = TRICKLE
    pe = RemotePromptEnhancer(fault.url, model="pe", runtime=ComfyRuntime())
    threading.Timer(0.8, mm.interrupt_current_processing, (True,)).start()
    started = time.monotonic()
    try:
        with pytest.raises(mm.InterruptProcessingException):
            pe.enhance(PROMPT, SAMPLED)
    finally:
        mm.interrupt_current_processing(False)
    assert time.monotonic() - started < 1.8
    assert len(fault.chats) == 1


# --- TLS (fault server with a self-signed certificate) -------------------------------------------------------------


@pytest.fixture
def tls_fault(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    with FaultServer(tls=(cert, key)) as server:
        yield server, cert


def test_https_checks_the_certificate_and_trusts_a_given_bundle_fault_server(tls_fault, monkeypatch):
    server, cert = tls_fault
    url = f"https://localhost:{server.port}"
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    with pytest.raises(EnhancerError, match=rf"cannot reach {url}/v1/chat/completions \(TLS: "
                                            r"CERTIFICATE_VERIFY_FAILED\), after 1 attempt"):
        remote(url, model="pe", max_retries=0).enhance(PROMPT, SAMPLED)
    assert server.received == []
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))  # the user's own certificate authority, as requests reads it
    assert remote(url, model="pe").enhance(PROMPT, SAMPLED)[0].text == "a default answer"
    assert server.received[0].headers["Host"] == f"localhost:{server.port}"


# --- proxies from the environment, as requests reads them -------------------------------------------------------


@pytest.fixture
def no_proxy_set(monkeypatch):
    """No proxy variable from the machine's environment (lower case wins over upper case in requests)."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def test_http_proxy_from_the_environment_is_used_and_no_proxy_bypasses_it(pe_server, no_proxy_set, monkeypatch):
    with ForwardProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        (completion,) = remote(pe_server).enhance(PROMPT, SAMPLED)
        assert completion.text
        assert [r.path for r in proxy.received] == [f"{pe_server}/v1/models", f"{pe_server}/v1/chat/completions"]
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert remote(pe_server).enhance(PROMPT, SAMPLED)[0].text == completion.text  # seeded: the same text
        assert len(proxy.received) == 2  # straight to the server


def test_a_proxy_that_is_down_is_named_without_its_password(pe_server, no_proxy_set, monkeypatch):
    proxy = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HTTP_PROXY", proxy.replace("http://", "http://me:hunter2@"))
    with pytest.raises(EnhancerError) as error:
        remote(pe_server, model="pe", max_retries=0).enhance(PROMPT, SAMPLED)
    assert str(error.value).startswith(f"cannot reach {pe_server}/v1/chat/completions (the proxy {proxy} from the "
                                       "environment: connection refused), after 1 attempt(s)")
    assert "hunter2" not in str(error.value)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert remote(pe_server).enhance(PROMPT, SAMPLED)[0].text


def test_netrc_credentials_are_not_sent_fault_server(fault, tmp_path, monkeypatch):
    """requests would add a ~/.netrc login for the host as Basic auth: which credentials go where is the key policy's
    decision alone."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login me password hunter2\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert remote(fault.url, model="pe").enhance(PROMPT, SAMPLED)[0].text == "a default answer"
    assert "Authorization" not in fault.received[0].headers


# --- the remote identity: the server's model and, where it tells, its revision -------------------------------------


def test_the_remote_identity_names_the_model_the_real_server_reports(pe_server):
    (listed,) = requests.get(f"{pe_server}/v1/models", timeout=10).json()["data"]
    pe = remote(pe_server)
    # transformers serve dates the checkpoints of the hub cache; a local folder's `created` is 0.
    assert pe.identity == f'remote:{pe_server}/v1|{listed["id"]}|{{"created": 0}}'
    assert remote(pe_server, model=listed["id"]).identity == pe.identity
    assert remote(pe_server, model="an-alias").identity == f"remote:{pe_server}/v1|an-alias|"  # not listed


LISTED = {"id": "pe", "object": "model", "created": 1_700_000_000, "root": "/models/pe-v1", "parent": None}


@pytest.mark.parametrize("change", [{"id": "pe-2"}, {"root": "/models/pe-v2"}, {"parent": "baidu/ERNIE-Image-Turbo"},
                                    {"created": 1_800_000_000}], ids=["id", "root", "parent", "created"])
def test_each_remote_identity_field_changes_the_key_fault_server(fault, change):
    fault.models = models_reply(LISTED)
    pe = remote(fault.url)
    before = cache_key(pe.identity, PROMPT[0], SAMPLED)
    assert cache_key(pe.identity, PROMPT[0], SAMPLED) == before
    fault.models = models_reply({**LISTED, **change})
    assert cache_key(pe.identity, PROMPT[0], SAMPLED) != before


def test_the_api_root_is_part_of_the_remote_identity_fault_server(fault):
    assert remote(fault.url).identity != remote(f"{fault.url}/v2").identity
    assert [r.path for r in fault.received] == ["/v1/models", "/v2/models"]


def test_a_listing_stamped_with_the_time_of_the_request_is_not_a_revision_fault_server(fault):
    """vLLM and SGLang give each listed model the time of the listing as `created`: not a checkpoint's date."""
    fault.models = Reply(body=lambda request: {"data": [{"id": "pe", "created": int(time.time()), "root": "/m"}]})
    pe = remote(fault.url)
    first = pe.identity
    time.sleep(1.1)
    assert pe.identity == first == f'remote:{fault.url}/v1|pe|{{"root": "/m"}}'


def test_a_server_that_swaps_its_checkpoint_is_asked_again_fault_server(fault, tmp_path):
    cache, pe = ResultCache(tmp_path / "pe.sqlite3"), remote(fault.url, model="pe")
    fault.models, fault.default = models_reply({"id": "pe", "root": "/ckpt/v1"}), chat_reply("a text of v1")
    for _ in range(2):
        assert enhance_cached(pe, PROMPT, SAMPLED, cache)[0].text == "a text of v1"
    assert len(fault.chats) == 1
    fault.models, fault.default = models_reply({"id": "pe", "root": "/ckpt/v2"}), chat_reply("a text of v2")
    assert enhance_cached(pe, PROMPT, SAMPLED, cache)[0].text == "a text of v2"
    assert len(fault.chats) == 2


def test_a_server_without_a_model_listing_is_known_by_the_given_name_fault_server(fault, monkeypatch):
    name_in_environment(monkeypatch, fault.url)
    fault.models = Reply(404, {"detail": "Not Found"})
    assert remote(fault.url, model="pe").identity == f"remote:{fault.url}/v1|pe|"
    with pytest.raises(EnhancerError, match=rf"^{fault.url}/v1/models answered HTTP 404: Not Found \(check base_url"):
        remote(fault.url).resolved_model()  # without a model name, the listing is needed
