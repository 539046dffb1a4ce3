"""Issues 24 and 41, the remote PE and a stranger's workflow: where a bound key may go (the path too), whose words an
error may quote (only a server named in the environment's: a local service on another port is a stranger too), what
a refusal tells about the user's environment, whose texts the result cache serves, who may read it, link-local
addresses (refused, also behind a name), and answers nested too deeply to parse.

Against the real ``transformers serve`` behind a recording proxy, and the fault server for the answers a real server
will not give (named so). Every server here listens on loopback, which is a stranger until named."""

from __future__ import annotations

import os
import stat

import folder_paths
import pytest

from comfyui_ernie_image.nodes.pe.cache import ResultCache, enhance_cached
from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePERemote, ErnieImagePromptEnhance, result_cache
from comfyui_ernie_image.nodes.pe.protocol import Completion, EnhancerError, PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.pe.remote.key_policy import trusted_server
from comfyui_ernie_image.nodes.pe.remote.url import is_link_local, parse_api_root
from helpers.pe_servers import RecordingProxy, Reply, key_not_sent, models_reply, name_in_environment, remote

PROMPT = [PromptSpec("a red kite over the sea", 1024, 1024)]
SAMPLED = SamplingParams(temperature=0.6, top_p=0.8, max_new_tokens=16, seed=5)
KEY, SECRET = "ERNIE_PE_API_KEY_STRANGER", "sk-stranger-0123456789"
NOT_SENT = key_not_sent(KEY)
UNQUOTED = ("its answer is not shown: only a server named in the environment, by its address in an "
            "ERNIE_PE_API_KEY_<NAME>_URL variable, is quoted")


def remote_node(base_url: str, api_key_env: str = "", model: str = ""):
    """The handle the workflow's remote PE node makes."""
    return ErnieImagePERemote.execute(base_url, model, api_key_env, 60.0, 0).result[0]


# --- a key bound to a path -----------------------------------------------------------------------------------------


def test_a_key_bound_to_a_gateway_path_goes_to_that_path_only(pe_server, monkeypatch):
    """On main the binding compared the origin alone: a workflow's ``/attacker/v1`` on the bound gateway got the
    key."""
    with RecordingProxy(pe_server, prefix="/team-a/v1") as gateway:
        monkeypatch.setenv(KEY, SECRET)
        monkeypatch.setenv(f"{KEY}_URL", f"{gateway.url}/team-a")
        (completion,) = remote_node(f"{gateway.url}/team-a/v1", KEY).enhance(PROMPT, SAMPLED)
        assert completion.text
        assert {r.headers["Authorization"] for r in gateway.received} == {f"Bearer {SECRET}"}
        sent = len(gateway.received)
        for elsewhere in ("/attacker/v1", "/team-ab/v1", "/v1", "", "/team/a/v1"):
            with pytest.raises(EnhancerError) as error:
                remote_node(gateway.url + elsewhere, KEY)
            assert str(error.value) == NOT_SENT, elsewhere
        assert len(gateway.received) == sent  # nothing more reached the gateway


# --- one refusal, whatever the environment holds ------------------------------------------------------------------


def test_unset_unbound_and_misbound_keys_are_refused_in_the_same_words(monkeypatch):
    """On main the words told an unset key from one without _URL, and named the server a key is bound to: a
    stranger's workflow learned what the user's environment holds."""
    url = "http://127.0.0.1:9"  # nothing listens: every refusal comes before a request
    said = []
    monkeypatch.delenv(KEY, raising=False)
    monkeypatch.delenv(f"{KEY}_URL", raising=False)
    for setting in ({}, {KEY: SECRET}, {f"{KEY}_URL": url}, {KEY: SECRET, f"{KEY}_URL": "https://pe.internal.example"},
                    {KEY: SECRET, f"{KEY}_URL": f"{url}/other"}):
        with monkeypatch.context() as env:
            for name, value in setting.items():
                env.setenv(name, value)
            with pytest.raises(EnhancerError) as error:
                remote_node(url, KEY)
            said.append(str(error.value))
    assert said == [NOT_SENT] * 5
    assert not any("internal" in text or "/other" in text for text in said)


# --- whose words an error may quote --------------------------------------------------------------------------------


def test_a_server_is_quoted_only_when_named_in_the_environment(monkeypatch):
    """On main any loopback port was trusted: a workflow's base_url aimed at another local service read its words."""
    for name in [n for n in os.environ if n.startswith("ERNIE_PE_API_KEY")]:
        monkeypatch.delenv(name)
    assert not trusted_server(parse_api_root("http://127.0.0.1:8000"))
    monkeypatch.setenv(KEY, SECRET)
    monkeypatch.setenv(f"{KEY}_URL", "https://pe.example.com/team")
    monkeypatch.setenv("ERNIE_PE_API_KEY_LOCAL_URL", "http://127.0.0.1:8000")  # a server without a key: the address
    monkeypatch.setenv("ERNIE_PE_API_KEY_BAD_URL", "not an address")  # names nothing, and breaks nothing
    monkeypatch.setenv("OTHER_SERVICE_URL", "http://10.0.0.5:8080")  # not a variable of the pack's
    assert trusted_server(parse_api_root("https://pe.example.com/team/v1"))
    assert trusted_server(parse_api_root("http://127.0.0.1:8000"))
    assert not trusted_server(parse_api_root("https://pe.example.com/other/v1"))
    assert not trusted_server(parse_api_root("http://127.0.0.1:8001"))  # another port of this machine
    assert not trusted_server(parse_api_root("http://localhost:8000"))  # names are compared as written
    assert not trusted_server(parse_api_root("http://10.0.0.5:8080"))


def test_a_local_services_error_text_is_not_quoted_unless_named_fault_server(fault, monkeypatch):
    """On main the fault server on 127.0.0.1, standing for another local service, had its JSON error message quoted
    (200 characters) in ComfyUI's error, which a workflow's author may read back."""
    fault.default = Reply(status=400, body={"error": {"message": "internal: token=abc123"}})
    with pytest.raises(EnhancerError) as error:
        remote(fault.url, model="pe", max_retries=0).enhance(PROMPT, SAMPLED)
    assert str(error.value) == (f"{fault.url}/v1/chat/completions answered HTTP 400 ({UNQUOTED}) (check "
                                "base_url and the model name 'pe')")
    name_in_environment(monkeypatch, fault.url)
    with pytest.raises(EnhancerError, match="answered HTTP 400: internal: token=abc123 "):
        remote(fault.url, model="pe", max_retries=0).enhance(PROMPT, SAMPLED)


@pytest.mark.parametrize("reply", [
    Reply(status=401, body={"detail": "internal realm hunter2"}),
    Reply(status=302, headers={"Location": "http://sso.hunter2.internal/login"}),
    Reply(body="<html>hunter2</html>", headers={"Content-Type": "text/hunter2"}),
    Reply(body={"choices": [{"message": {"content": ""}, "finish_reason": "hunter2"}]}),
])
def test_no_header_or_field_of_a_server_not_named_reaches_an_error_fault_server(fault, reply, monkeypatch):
    """The redirect's target, the content type, finish_reason: the host's words too."""
    fault.default = reply
    with pytest.raises(EnhancerError) as error:
        remote(fault.url, model="pe", max_retries=0).enhance(PROMPT, SAMPLED)
    assert fault.url in str(error.value) and "hunter2" not in str(error.value), str(error.value)
    name_in_environment(monkeypatch, fault.url)
    with pytest.raises(EnhancerError, match="hunter2"):
        remote(fault.url, model="pe", max_retries=0).enhance(PROMPT, SAMPLED)


def test_the_model_a_server_not_named_lists_is_not_echoed_fault_server(fault):
    fault.models = models_reply({"id": "hunter2-internal-model", "object": "model"})
    fault.default = Reply(status=404, body={})
    with pytest.raises(EnhancerError) as error:
        remote(fault.url, max_retries=0).enhance(PROMPT, SAMPLED)
    assert "hunter2" not in str(error.value)
    assert str(error.value).endswith(f"({UNQUOTED}) (check base_url, and give the model name in 'model')")


# --- link-local addresses --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("address", "link_local"), [
    ("169.254.169.254", True), ("169.254.0.1", True), ("fe80::1", True), ("fe80::1%eth0", True),
    ("::ffff:169.254.169.254", True), ("127.0.0.1", False), ("10.0.0.5", False), ("fd00:ec2::254", False),
    ("pe.example.com", False), ("2852039166", False),  # names: what they resolve to decides, at the connection
])
def test_link_local_addresses(address, link_local):
    assert is_link_local(address) is link_local


@pytest.mark.parametrize(("base_url", "host"), [
    ("http://169.254.169.254", "169.254.169.254"), ("http://169.254.170.2:80/v1", "169.254.170.2"),
    ("http://[fe80::1]:8000", "fe80::1"), ("http://[::ffff:169.254.169.254]", "::ffff:169.254.169.254"),
])
def test_a_link_local_base_url_is_refused_before_any_request(base_url, host):
    """On main the workflow's base_url reached the cloud's metadata service (169.254.169.254 hands out credentials)."""
    with pytest.raises(EnhancerError) as error:
        remote_node(base_url)
    assert str(error.value) == (f"base_url's host is the link-local address {host} (169.254.0.0/16, fe80::/10), "
                                "where cloud metadata services answer and never a prompt enhancer: nothing is sent "
                                "there; give the enhancer server's address")


def test_a_name_that_resolves_to_a_link_local_address_is_refused_before_connecting(monkeypatch):
    """``2852039166`` is 169.254.169.254 written as one number: no address by the pack's reading, but the resolver's
    (``getaddrinfo``) makes it one. On main the request went out (here, with no route: a connection error)."""
    for proxy in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    handle = remote_node("http://2852039166:8000", model="pe")
    with pytest.raises(EnhancerError) as error:
        handle.enhance(PROMPT, SAMPLED)
    assert str(error.value) == (
        "http://2852039166:8000/v1/chat/completions was not requested: 2852039166 resolves to the link-local address "
        "169.254.169.254 (169.254.0.0/16, fe80::/10), where cloud metadata services answer and never a prompt "
        "enhancer: nothing is sent there; give the enhancer server's address")


# --- answers nested too deeply ----------------------------------------------------------------------------------------

NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("where", ["chat", "models"])
def test_an_answer_nested_too_deeply_is_refused_in_words_fault_server(fault, where):
    """On main 100,000 nested arrays (200 KB, within the size cap) ended in a RecursionError."""
    if where == "models":
        fault.models = Reply(body=NESTED)
    else:
        fault.default = Reply(body=NESTED)
    endpoint = "models" if where == "models" else "chat/completions"
    with pytest.raises(EnhancerError) as error:
        remote(fault.url, max_retries=0).enhance(PROMPT, SAMPLED)
    assert str(error.value) == f"malformed answer from {fault.url}/v1/{endpoint}: JSON nested too deeply (200000 bytes)"


def test_an_error_answer_nested_too_deeply_is_told_by_its_status_fault_server(fault, monkeypatch):
    name_in_environment(monkeypatch, fault.url)  # its words would be quoted: there are none to find
    fault.default = Reply(status=400, body=NESTED)
    with pytest.raises(EnhancerError) as error:
        remote(fault.url, model="pe", max_retries=0).enhance(PROMPT, SAMPLED)
    assert str(error.value) == (f"{fault.url}/v1/chat/completions answered HTTP 400 (check base_url and the model "
                                "name 'pe')")


# --- whose texts the cache serves -----------------------------------------------------------------------------------


def test_a_run_without_the_key_does_not_read_texts_a_keyed_run_paid_for(pe_server, tmp_path, monkeypatch):
    """On main the cache key left the credential out: the same server, prompt and seed without the key was served
    the keyed run's text from the cache."""
    cache = ResultCache(tmp_path / "pe_cache.sqlite3")
    with RecordingProxy(pe_server) as server:
        monkeypatch.setenv(KEY, SECRET)
        monkeypatch.setenv(f"{KEY}_URL", server.url)
        keyed, keyless = remote_node(server.url, KEY), remote_node(server.url)
        enhance_cached(keyed, PROMPT, SAMPLED, cache)
        enhance_cached(keyless, PROMPT, SAMPLED, cache)
        assert len(server.chats) == 2  # asked again: not the keyed run's stored text
        enhance_cached(keyed, PROMPT, SAMPLED, cache)
        assert len(server.chats) == 2  # the keyed run's own text is still cached for it
        keyed_identity, keyless_identity = keyed.identity, keyless.identity
        monkeypatch.setenv(KEY, SECRET + "-rotated")
        rotated_identity = keyed.identity
    assert SECRET not in keyed_identity and len({keyed_identity, keyless_identity, rotated_identity}) == 3


# --- who may read the cache ----------------------------------------------------------------------------------------


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    """The usual umask, under which main's file was readable by every user of the machine."""
    before = os.umask(0o022)
    yield
    os.umask(before)


def test_the_cache_file_is_private_also_when_it_was_not(tmp_path, umask_022):
    """On main the file took the umask's 0644 (readable by every user of the machine) and the folder 0755."""
    folder = tmp_path / "ernie"
    new = ResultCache(folder / "pe_cache.sqlite3")
    new.put("k", Completion("a text"))
    assert (_mode(folder), _mode(folder / "pe_cache.sqlite3")) == (0o700, 0o600)
    os.chmod(folder, 0o755)
    os.chmod(folder / "pe_cache.sqlite3", 0o644)
    old = ResultCache(folder / "pe_cache.sqlite3")
    assert old.get("k").text == "a text"  # the same file, now private
    assert (_mode(folder), _mode(folder / "pe_cache.sqlite3")) == (0o700, 0o600)


def test_the_nodes_cache_lives_in_a_system_user_folder_fault_server(fault, tmp_path, monkeypatch, umask_022):
    """ComfyUI serves no ``__`` folder over /userdata; on main the file was ``user/ernie_image/pe_cache.sqlite3``,
    0644. A file there from an earlier version is moved, with its texts."""
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path))
    former = tmp_path / "ernie_image" / "pe_cache.sqlite3"
    former.parent.mkdir()
    ResultCache(former).put("from-before", Completion("kept"))
    os.chmod(former, 0o644)
    inode = former.stat().st_ino
    result_cache.cache_clear()
    try:
        values = {"width": 1024, "height": 1024, "enabled": True, "temperature": 0.6, "top_p": 0.8,
                  "max_new_tokens": 16, "seed": 0}
        ErnieImagePromptEnhance.execute(prompt=["a cat"], pe=[remote(fault.url, model="pe")],
                                        **{k: [v] for k, v in values.items()})
        path = tmp_path / "__ernie_image" / "pe_cache.sqlite3"
        assert (_mode(path.parent), _mode(path)) == (0o700, 0o600)
        assert path.stat().st_ino == inode and not former.exists()
        assert result_cache().get("from-before").text == "kept"
    finally:
        result_cache.cache_clear()
